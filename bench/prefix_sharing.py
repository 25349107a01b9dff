"""Prefix-shared groups in the trainer: tokens computed and step time, shared vs unshared.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prefix_sharing.py \
        [--model ~/.cache/flywheel/models/SmolLM2-135M-Instruct] [--rounds 3] [--out FILE]

One `Trainer` per arm on the same model (the CPU default: bf16 autocast, float32
masters, packed rows, one torch thread), the same synthetic batch per shape
(token ids drawn from the vocabulary: a step's cost does not depend on which
tokens they are), at three shapes:

- demo-real: 4 groups x 8 samples, prompt 50 tokens, replies 1-16 (uniform);
- review: 4 groups x 8, prompt 90 (the review task's chat prompt), replies 1-16;
- long: 1 group x 4, prompt 200, replies 256 (x 8 ran out of memory beside
  the other processes of a shared machine).

Per shape: the tokens the micro-batches hold (what the forward and backward
compute), the loss of both arms on the first step (they must agree), and the
median `train_step` time over `--rounds` interleaved rounds (arm A, arm B, A,
B ...: load drift on this shared machine hits both alike), after one untimed
step each. Ratios are shared / unshared, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {  # groups, samples per group, prompt tokens, (shortest, longest) reply
    "demo-real": (4, 8, 50, (1, 16)),
    "review": (4, 8, 90, (1, 16)),
    "long": (1, 4, 200, (256, 256)),
}


def batch_of(shape: str, vocab: int, seed: int):
    import torch

    from services.trainer.core.batching import TensorBatch

    groups, per, prompt_len, (lo, hi) = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)
    prompts, replies, logps, gids = [], [], [], []
    for group in range(groups):
        prompt = torch.randint(10, vocab, (prompt_len,), generator=g)
        for _ in range(per):
            r = int(torch.randint(lo, hi + 1, (1,), generator=g))
            prompts.append(prompt.clone())
            replies.append(torch.randint(10, vocab, (r,), generator=g))
            logps.append(-torch.rand(r, generator=g) * 2 - 0.1)
            gids.append(group)
    n = len(prompts)
    return TensorBatch(
        prompt_ids=prompts,
        response_ids=replies,
        rollout_logprobs=logps,
        rewards=torch.tensor([float(i % 3 == 0) for i in range(n)]),
        group_ids=torch.tensor(gids),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def trainer_for(model: str, share: bool):
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer

    cfg = TrainConfig(
        optim=OptimConfig(lr=1e-7),  # the weights barely move: every step costs the same
        model=ModelConfig(share_prefix=share, cpu_threads=1),
    )
    return Trainer.from_pretrained(model, cfg)


def tokens_of(trainer, batch) -> int:
    micro = trainer._micro_batches(trainer._rl_rows(batch), batch.group_ids.tolist())
    return sum(int(mb["input_ids"].numel()) for mb in micro)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="~/.cache/flywheel/models/SmolLM2-135M-Instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model = str(Path(args.model).expanduser())
    arms = {"unshared": trainer_for(model, False), "shared": trainer_for(model, True)}
    vocab = int(arms["shared"].model.config.vocab_size)
    lines = [
        "| shape | tokens unshared → shared | ratio | loss unshared / shared | "
        "step s unshared → shared | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for shape in args.shapes:
        batch = batch_of(shape, vocab, seed=0)
        tokens = {name: tokens_of(t, batch) for name, t in arms.items()}
        loss = {name: t.train_step(batch)["loss"] for name, t in arms.items()}  # untimed
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, t in arms.items():
                start = time.perf_counter()
                t.train_step(batch)
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(v) for name, v in times.items()}
        lines.append(
            f"| {shape} | {tokens['unshared']} → {tokens['shared']} | "
            f"{tokens['shared'] / tokens['unshared']:.2f}x | "
            f"{loss['unshared']:.6f} / {loss['shared']:.6f} | "
            f"{med['unshared']:.2f} → {med['shared']:.2f} | "
            f"{med['shared'] / med['unshared']:.2f}x |"
        )
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
