"""Supervised fine-tuning (`flywheel sft`, and the warm start of `init-model` and the demo).

The RL trainer's machinery (the same `Trainer`, micro-batching, FSDP2 path
and weights writer) with token-mean negative log-likelihood:

- `loop`  shuffle → step → (eval) → save, in one process or under torchrun;
- `data`  JSONL (chat or prompt/completion) → tokenized examples with their
          trained-token masks; the demo's arithmetic records;
- `cli`   the command line.

Its settings are `[sft]` (`SftSettings` in services/trainer/settings.py).
"""
