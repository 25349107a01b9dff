"""The SFT loop: JSONL in, an HF weights directory out.

The loop is the RL trainer's machinery (same Trainer, micro-batching, FSDP2
path, weights writer) with token-mean negative log-likelihood over the
trained tokens: shuffle → step → (eval) → save. Runs in one process or
under `torchrun` (every rank reads the same file and the same seeded
order; the Trainer gives each rank its share of every batch).
"""

from __future__ import annotations

import math
import random
import sys
import time
from typing import Any

from services.trainer.settings import SftSettings, TrainConfig


def _batches(n: int, batch_size: int, seed: int):
    """Endless stream of index batches: a fresh seeded shuffle every epoch."""
    epoch = 0
    while True:
        order = list(range(n))
        random.Random(f"sft:{seed}:{epoch}").shuffle(order)
        for i in range(0, n - batch_size + 1 if n >= batch_size else 1, batch_size):
            yield order[i : i + batch_size]
        epoch += 1


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="sft", dynamic_ncols=True)


def run_sft(settings: SftSettings, log=print) -> dict[str, Any]:
    """Train, evaluate, save; returns the final metrics (and the manifest digest)."""
    import torch

    from services.trainer.distributed import DistInfo, all_reduce, init_distributed
    from services.trainer.model import load_tokenizer
    from services.trainer.sft.data import load_sft_file
    from services.trainer.trainer import Trainer

    info: DistInfo = init_distributed()
    tokenizer = load_tokenizer(settings.model_dir)
    train = load_sft_file(settings.train_file, tokenizer, settings.max_seq_len)
    evals = (
        load_sft_file(settings.eval_file, tokenizer, settings.max_seq_len)
        if settings.eval_file
        else None
    )
    per_epoch = max(len(train) // settings.batch_size, 1)
    steps = settings.steps or max(math.ceil(settings.epochs * per_epoch), 1)
    cfg = TrainConfig(
        optim=settings.optim.model_copy(update={"total_steps": steps}),
        model=settings.model,
        lora=settings.lora,
    )
    trainer = Trainer.from_pretrained(settings.model_dir, cfg, info)
    if info.is_main and (note := trainer.auto_lr_note("sft.optim")):
        log(f"sft: {note}")
    show = settings.progress if settings.progress is not None else sys.stderr.isatty()
    bar = _progress(steps, show and info.is_main)
    start = time.monotonic()
    metrics: dict[str, Any] = {}
    batches = _batches(len(train), settings.batch_size, settings.seed)
    for step in range(1, steps + 1):
        metrics = trainer.sft_step([train[i] for i in next(batches)])
        if evals and settings.eval_every and step % settings.eval_every == 0:
            metrics["eval_loss"] = trainer.sft_eval_loss(evals)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}")
        elif info.is_main and (step % settings.log_every == 0 or step == steps):
            log(f"step {step}/{steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e}")
        over = settings.max_time_s is not None and time.monotonic() - start > settings.max_time_s
        # every rank must stop at the same step: agree on the slowest clock
        if int(all_reduce(torch.tensor([int(over)]), info, "max")):
            break
    if bar is not None:
        bar.close()
    if evals:
        metrics["eval_loss"] = trainer.sft_eval_loss(evals)
    manifest = trainer.save_weights(settings.output_dir, overwrite=settings.overwrite)
    metrics["steps_done"] = trainer.step
    metrics["elapsed_s"] = time.monotonic() - start
    if manifest is not None:
        metrics["sha256"] = manifest.sha256
    if info.is_main:
        log(f"saved {settings.output_dir} after {trainer.step} steps: {metrics}")
    return metrics
