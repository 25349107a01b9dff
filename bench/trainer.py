"""Trainer throughput: tokens/s per optimizer step, one process vs 2-rank FSDP2 (CPU).

    .venv/bin/python bench/trainer.py [--steps 4] [--out bench/results_trainer.md]

Builds two random-init models (the ~0.5M tiny model and a ~10M one) in a
temporary directory, runs RL `train_step`s on a synthetic batch (fixed
lengths, real loss path: advantages, PPO-clip, entropy metric), and times
each optimizer step after a warm-up step. Configurations, measured in the
same run so ratios are comparable:

- `1 proc`      : one process, torch's default threads (all cores);
- `1 proc, 1 thr`: one process, one intra-op thread;
- `fsdp2 x2`    : torchrun --nproc_per_node=2, gloo, one thread per rank.

Ratios are tokens/s relative to `1 proc` of the same model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    # name: (hidden, layers, heads, intermediate, rows, prompt_len, response_len)
    "tiny-0.5M": (128, 2, 4, 512, 32, 16, 48),
    "small-10M": (256, 10, 8, 1024, 16, 16, 48),
}


def synthetic_batch(rows: int, prompt_len: int, response_len: int):
    import torch

    from services.trainer.core.batching import TrainBatch

    g = torch.Generator().manual_seed(0)
    return TrainBatch(
        prompt_ids=[torch.randint(3, 90, (prompt_len,), generator=g) for _ in range(rows)],
        response_ids=[torch.randint(3, 90, (response_len,), generator=g) for _ in range(rows)],
        rollout_logprobs=[-torch.rand(response_len, generator=g) - 4 for _ in range(rows)],
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        group_ids=torch.arange(rows) // 8,
        truncated=torch.zeros(rows, dtype=torch.bool),
    )


def measure(model_dir: str, name: str, steps: int, threads: int | None) -> dict:
    """Time `steps` train steps (after one warm-up) in this process; rank 0 returns stats."""
    from services.trainer.config import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.distributed import init_distributed
    from services.trainer.trainer import Trainer

    *_, rows, p, r = MODELS[name]
    info = init_distributed()
    cfg = TrainConfig(
        optim=OptimConfig(lr=1e-5), model=ModelConfig(micro_batch_tokens=4096, cpu_threads=threads)
    )
    trainer = Trainer.from_pretrained(model_dir, cfg, info)
    batch = synthetic_batch(rows, p, r)
    tokens = rows * (p + r)
    trainer.train_step(batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in trainer.model.parameters())  # DTensor: global numel
    return {
        "tokens": tokens,
        "step_s": statistics.median(times),
        "params": params,
        "world": info.world_size,
        "threads": threads,
    }


def worker(args) -> None:
    from services.trainer.distributed import init_distributed, shutdown

    res = measure(args.model_dir, args.name, args.steps, 1)
    info = init_distributed()
    if info.is_main:
        print("RESULT " + json.dumps(res), flush=True)
    shutdown(info)


def run_torchrun(model_dir: str, name: str, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--worker",
        "--model-dir",
        model_dir,
        "--name",
        name,
        "--steps",
        str(steps),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run_single(model_dir: str, name: str, steps: int, threads: int | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--single",
        "--model-dir",
        model_dir,
        "--name",
        name,
        "--steps",
        str(steps),
    ] + (["--threads", str(threads)] if threads else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model-dir")
    ap.add_argument("--name")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.single:
        print(
            "RESULT " + json.dumps(measure(args.model_dir, args.name, args.steps, args.threads)),
            flush=True,
        )
        return None

    from services.common.tiny_model import TinyModelSpec, write_tiny_model

    lines = [
        "| model | params | tokens/step | config | step s | tokens/s | vs 1 proc |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, (h, layers, heads, inter, *_) in MODELS.items():
            d = str(
                write_tiny_model(
                    Path(tmp) / name,
                    TinyModelSpec(
                        hidden_size=h,
                        num_layers=layers,
                        num_heads=heads,
                        num_kv_heads=heads,
                        intermediate_size=inter,
                    ),
                )
            )
            runs = {
                "1 proc": run_single(d, name, args.steps, None),
                "1 proc, 1 thr": run_single(d, name, args.steps, 1),
                "fsdp2 x2 (1 thr/rank)": run_torchrun(d, name, args.steps),
            }
            base = runs["1 proc"]["tokens"] / runs["1 proc"]["step_s"]
            for cfg, r in runs.items():
                tps = r["tokens"] / r["step_s"]
                lines.append(
                    f"| {name} | {r['params'] / 1e6:.2f}M | {r['tokens']} | {cfg} | "
                    f"{r['step_s']:.3f} | {tps:,.0f} | {tps / base:.2f}x |"
                )
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.out:
        args.out.write_text(
            "# Trainer throughput (CPU)\n\n"
            "Command: "
            f"`.venv/bin/python bench/trainer.py --steps {args.steps} --out {args.out}`\n\n"
            f"Machine: {os.cpu_count()} CPU cores (shared with other jobs while measured), "
            "torch CPU, fp32, gloo. Median of the timed steps after one warm-up step; "
            "one optimizer step per batch (RL train_step).\n\n" + table + "\n"
        )
    return None


if __name__ == "__main__":
    main()
