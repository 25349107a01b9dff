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

    from services.trainer.core.batching import TensorBatch

    g = torch.Generator().manual_seed(0)
    return TensorBatch(
        prompt_ids=[torch.randint(3, 90, (prompt_len,), generator=g) for _ in range(rows)],
        response_ids=[torch.randint(3, 90, (response_len,), generator=g) for _ in range(rows)],
        rollout_logprobs=[-torch.rand(response_len, generator=g) - 4 for _ in range(rows)],
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        group_ids=torch.arange(rows) // 8,
        truncated=torch.zeros(rows, dtype=torch.bool),
    )


def measure(model_dir: str, name: str, steps: int, threads: int | None) -> dict:
    """Time `steps` train steps (after one warm-up) in this process; rank 0 returns stats."""
    from services.trainer.distributed import init_distributed
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
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


# ── memory and speed at a 151,936-token vocabulary ─────────────────────────────
VOCAB = 151_936
SHAPES = {
    # Qwen2-shaped, random weights from a config (nothing downloaded).
    "qwen2-cpu-40M": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
    ),
    "qwen2.5-0.5B": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
}
PATHS = {
    # today: main before #17 (one process: float32, padded rows, full logits; its FSDP2
    # path on GPU: bf16). new: this branch's defaults (bf16 where 'auto' picks it).
    # "base" is the path each one is compared with (same micro-batch, same fsdp flag).
    "today": {"precision": "fp32", "packing": False, "logprobs": "full"},
    "today+ac": {
        "precision": "fp32",
        "packing": False,
        "logprobs": "full",
        "activation_checkpointing": True,
    },
    "today-bf16": {"precision": "bf16", "packing": False, "logprobs": "full"},
    "today-bf16+ac": {
        "precision": "bf16",
        "packing": False,
        "logprobs": "full",
        "activation_checkpointing": True,
    },
    "new": {"precision": "auto", "packing": True, "logprobs": "chunked"},
    "new-c64": {
        "precision": "auto",
        "packing": True,
        "logprobs": "chunked",
        "logits_chunk_mib": 64.0,
    },
    "new-bf16": {"precision": "bf16", "packing": True, "logprobs": "chunked"},
    "new+ac": {
        "precision": "auto",
        "packing": True,
        "logprobs": "chunked",
        "activation_checkpointing": True,
    },
}
BASE = {"new": "today", "new-c64": "today", "new-bf16": "today", "new+ac": "today+ac"}
BASE_FSDP = {"new": "today-bf16", "new-bf16": "today-bf16", "new+ac": "today-bf16+ac"}


def write_big_model(out: Path, shape: str) -> Path:
    """A random-init Qwen2 directory of `shape` with a 151,936 vocabulary."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.models.tiny_model import build_tokenizer

    config = Qwen2Config(
        vocab_size=VOCAB,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out


def uniform_batch(tokens: int, prompt_len: int, response_len: int, vocab: int):
    """Samples of one length adding up to `tokens`: padded and packed plans coincide."""
    import torch

    rows = max(1, tokens // (prompt_len + response_len))
    b = synthetic_batch(rows, prompt_len, response_len)
    g = torch.Generator().manual_seed(1)
    b.prompt_ids = [torch.randint(3, vocab, (prompt_len,), generator=g) for _ in range(rows)]
    b.response_ids = [torch.randint(3, vocab, (response_len,), generator=g) for _ in range(rows)]
    return b


def mixed_batch(tokens: int, vocab: int):
    """Samples of `mixed_lengths` adding up to about `tokens` (at least one)."""
    import torch

    lengths, total = [], 0
    for p, r in mixed_lengths(4096):
        if lengths and total + p + r > tokens:
            break
        lengths.append((p, r))
        total += p + r
    b = synthetic_batch(len(lengths), 1, 1)
    g = torch.Generator().manual_seed(1)
    b.prompt_ids = [torch.randint(3, vocab, (p,), generator=g) for p, _ in lengths]
    b.response_ids = [torch.randint(3, vocab, (r,), generator=g) for _, r in lengths]
    b.rollout_logprobs = [-torch.rand(r, generator=g) - 4 for _, r in lengths]
    return b


def mixed_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) lengths like an RL batch: varied prompts, long-tailed responses."""
    import random

    rnd = random.Random(seed)
    return [
        (rnd.randint(32, 512), min(4096, int(rnd.lognormvariate(5.5, 0.9)) + 8)) for _ in range(n)
    ]


class MemoryMeter:
    """Peak memory above a baseline: CUDA allocator stats, or the process's RSS on CPU.

    CPU: torch's CPU allocator keeps no statistics, so the meter reads the
    kernel's resident-set high-water mark (VmHWM), reset to the current RSS
    through /proc/self/clear_refs right before the measured steps. The
    process runs with MALLOC_MMAP_THRESHOLD_ = 1 MiB, so freed tensors go
    back to the kernel instead of staying resident in malloc's heap.
    """

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"

    @staticmethod
    def _status(key: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def start(self) -> None:
        import gc

        import torch

        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")
            self.base = self._status("VmRSS")

    def peak_above_base(self) -> int:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base


def measure_memory(job: dict) -> list[dict]:
    """In this process: the job's path at each micro-batch size; peak extra memory and tokens/s."""
    import torch

    from services.trainer.distributed import init_distributed
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer

    info = init_distributed(shard_single=job["fsdp"])
    if info.device.type == "cpu" and job.get("threads"):
        torch.set_num_threads(job["threads"])

    def cfg(size: int) -> TrainConfig:
        m = ModelConfig(micro_batch_tokens=size, entropy_every=1, **PATHS[job["path"]])
        return TrainConfig(optim=OptimConfig(lr=1e-6, grad_clip=1.0), model=m)

    trainer = Trainer.from_pretrained(job["model_dir"], cfg(job["sizes"][0]), info)
    grad_bytes = sum(p.numel() * 4 for p in trainer.model.parameters() if p.requires_grad)
    meter, out = MemoryMeter(info.device), []
    p_len, r_len = job["lengths"]
    for size in job["sizes"]:
        trainer.cfg = cfg(size)
        batch = (
            uniform_batch(2 * size, p_len, r_len, VOCAB)
            if job["workload"] == "uniform"
            else mixed_batch(2 * size, VOCAB)
        )
        row: dict = {"path": job["path"], "fsdp": job["fsdp"], "size": size}
        try:
            trainer.train_step(batch)  # warm-up; the first one also creates AdamW's state
            meter.start()
            times = []
            for _ in range(job["steps"]):
                t0 = time.perf_counter()
                trainer.train_step(batch)
                if info.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            extra = meter.peak_above_base() - grad_bytes
        except torch.OutOfMemoryError:
            out.append({**row, "oom": True})
            print("ROW " + json.dumps(out[-1]), flush=True)
            break
        tokens = sum(
            p.numel() + r.numel() for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)
        )
        row.update(
            extra_gib=extra / 2**30,
            step_s=statistics.median(times),
            tokens_per_s=tokens / statistics.median(times),
            oom=False,
        )
        out.append(row)
        print("ROW " + json.dumps(row), flush=True)
    return out


def run_memory_job(job: dict) -> list[dict]:
    """`job` in a fresh process (torchrun with one rank for FSDP2); its rows."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20), "PYTHONUNBUFFERED": "1"}
    args = [__file__, "--memory-job", json.dumps(job)]
    cmd = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", *args]
        if job["fsdp"]
        else [sys.executable, *args]
    )
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if proc.returncode != 0 and not any(r.get("oom") for r in rows):
        oom = "OutOfMemoryError" in proc.stderr or proc.returncode == -9
        done = {r["size"] for r in rows}
        rows += [
            {
                "path": job["path"],
                "fsdp": job["fsdp"],
                "size": s,
                "oom": oom,
                "error": proc.stderr[-300:],
            }
            for s in job["sizes"]
            if s not in done
        ]
    return rows


def packing_table(sizes: list[int], n: int = 256) -> list[str]:
    """Micro-batches and padding for a mixed-length batch: padded plan vs packed plan."""
    from services.trainer.core.batching import plan_micro_batches
    from services.trainer.core.packing import plan_packed

    lengths = [p + r for p, r in mixed_lengths(n)]
    real = sum(lengths)
    lines = [
        f"Mixed-length batch: {n} samples, {real:,} tokens (prompts 32-512, responses "
        f"log-normal, median {sorted(lengths)[n // 2]}, max {max(lengths)}).",
        "",
        "| micro_batch_tokens | padded: micro-batches | padded: pad share | packed: micro-batches "
        "| packed/padded |",
        "|---:|---:|---:|---:|---:|",
    ]
    for size in sizes:
        padded = plan_micro_batches(lengths, size)
        packed = plan_packed(lengths, size)
        slots = sum(len(g) * max(lengths[i] for i in g) for g in padded)
        lines.append(
            f"| {size} | {len(padded)} | {1 - real / slots:.0%} | {len(packed)} | "
            f"{len(packed) / len(padded):.2f} |"
        )
    return lines


def memory_main(args) -> None:
    import torch

    gpu = torch.cuda.is_available()
    shape = args.shape or ("qwen2.5-0.5B" if gpu else "qwen2-cpu-40M")
    sizes = [int(s) for s in args.sizes.split(",")]
    lengths = (256, 768) if gpu else (32, 96)
    configs = [c.split(":") for c in args.configs.split(",")]  # path[:fsdp]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_big_model(Path(tmp) / "model", shape))
        rows = []
        for path, *flag in configs:
            for chunk in [sizes] if gpu else [[s] for s in sizes]:  # CPU: a process per size
                job = {
                    "workload": args.workload,
                    "path": path,
                    "fsdp": bool(flag),
                    "model_dir": model_dir,
                    "sizes": chunk,
                    "steps": args.steps,
                    "lengths": lengths,
                    "threads": args.threads,
                }
                rows += run_memory_job(job)
                print(rows[-1], flush=True)
    for r in rows:
        if "error" in r:
            print(f"{r['path']} fsdp={r['fsdp']} size={r['size']}: {r['error']}", flush=True)
    lines = memory_table(rows, shape, lengths, args.workload)
    lines += ["", *packing_table(sizes)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def memory_table(rows: list[dict], shape: str, lengths, workload: str) -> list[str]:
    """Rows as a table, each new path against its base path at the same micro-batch size."""
    by = {(r["path"], r["fsdp"], r["size"]): r for r in rows}
    what = (
        f"samples of {lengths[0]} prompt + {lengths[1]} response tokens"
        if workload == "uniform"
        else "the mixed-length samples below"
    )
    lines = [
        f"Model: {shape} (Qwen2 shape, vocabulary {VOCAB:,}, random weights); {what}; "
        "about 2 micro-batches' worth of tokens per step.",
        "",
        "| path | fsdp2 (1 rank) | micro_batch_tokens | peak extra GiB | tokens/s | base "
        "| extra / base | tokens/s / base |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        base_name = (BASE_FSDP if r["fsdp"] else BASE).get(r["path"], "")
        base = by.get((base_name, r["fsdp"], r["size"]))
        if r.get("oom") or "extra_gib" not in r:
            why = "OOM" if r.get("oom") else "failed"
            lines.append(f"| {r['path']} | {r['fsdp']} | {r['size']} | {why} | - | | | |")
            continue
        ratio_m = ratio_t = "-"
        if base and "extra_gib" in base:
            ratio_m = f"{r['extra_gib'] / base['extra_gib']:.3f}"
            ratio_t = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
        elif base:
            ratio_m = ratio_t = "base OOM"
        lines.append(
            f"| {r['path']} | {r['fsdp']} | {r['size']} | {r['extra_gib']:.2f} | "
            f"{r['tokens_per_s']:,.0f} | {base_name} | {ratio_m} | {ratio_t} |"
        )
    return lines


def check_main(args) -> None:
    """Agreement checks on this device: chunked vs full logprobs, packed vs padded forwards."""
    import torch

    from services.trainer.core.logprobs import chunked_token_stats, token_entropy, token_logprobs
    from services.trainer.distributed import init_distributed
    from services.trainer.settings import ModelConfig, TrainConfig
    from services.trainer.trainer import Trainer

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    n, hid = 512, 896
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(n, hid, device=dev, generator=g).requires_grad_()
        w = (torch.randn(VOCAB, hid, device=dev, generator=g) * 0.05).requires_grad_()
        t = torch.randint(0, VOCAB, (n,), device=dev, generator=g)
        grads = []
        for chunked in (True, False):
            h.grad = w.grad = None
            with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
                if chunked:
                    lp, ent = chunked_token_stats(h, w, t, 0.9, entropy=True, rows=100)
                else:
                    logits = (h @ w.t())[None]
                    lp, ent = token_logprobs(logits, t[None], 0.9)[0], token_entropy(logits, 0.9)[0]
            (lp.sum() + 0.1 * ent.sum()).backward()
            grads.append((lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone()))
        (a_lp, a_ent, a_h, a_w), (b_lp, b_ent, b_h, b_w) = grads
        rel = [float((x - y).norm() / y.norm()) for x, y in ((a_h, b_h), (a_w, b_w))]
        print(
            f"CHECK chunked vs full {dtype}: max|dlogp| {float((a_lp - b_lp).abs().max()):.2e} "
            f"max|dH| {float((a_ent - b_ent).abs().max()):.2e} "
            f"rel grad h {rel[0]:.2e} w {rel[1]:.2e}; min H {float(a_ent.min()):.3e}",
            flush=True,
        )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_big_model(Path(tmp) / "model", args.shape or "qwen2.5-0.5B")
        batch = mixed_batch(8192, VOCAB)
        info = init_distributed()
        sums = {}
        for name, over in (
            ("packed bf16", {"precision": "bf16"}),
            ("padded bf16", {"precision": "bf16", "packing": False}),
            ("padded fp32", {"precision": "fp32", "packing": False}),
        ):
            cfg = TrainConfig(model=ModelConfig(micro_batch_tokens=4096, **over))
            trainer = Trainer.from_pretrained(model_dir, cfg, info)
            total = 0.0
            with torch.no_grad():
                for mb in trainer._micro_batches(trainer._rl_rows(batch)):
                    lp, _ = trainer._token_stats(trainer.model, mb, 1.0)
                    total += float((lp.float().cpu() * mb["loss_mask"]).sum())
            sums[name] = total
            print(
                f"CHECK {name} (varlen={trainer.forward_spec.varlen}): sum logp {total:.3f}",
                flush=True,
            )
            del trainer
        tokens = sum(r.numel() for r in batch.response_ids)
        print(
            f"CHECK per-token |packed - padded| (bf16) "
            f"{abs(sums['packed bf16'] - sums['padded bf16']) / tokens:.2e}, "
            f"|padded bf16 - fp32| {abs(sums['padded bf16'] - sums['padded fp32']) / tokens:.2e}"
            f" over {tokens} tokens",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--single", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model-dir")
    ap.add_argument("--name")
    ap.add_argument("--memory", action="store_true", help="vocabulary-151,936 memory benchmark")
    ap.add_argument("--memory-job", help=argparse.SUPPRESS)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--sizes", default="1024,2048,4096", help="micro_batch_tokens values")
    ap.add_argument("--configs", default="today,new", help="paths, ':fsdp' = FSDP2 on 1 rank")
    ap.add_argument("--workload", choices=["uniform", "mixed"], default="uniform")
    ap.add_argument("--check", action="store_true", help="agreement checks on this device")
    args = ap.parse_args()
    if args.memory_job:
        measure_memory(json.loads(args.memory_job))
        return None
    if args.memory:
        return memory_main(args)
    if args.check:
        return check_main(args)
    if args.worker:
        return worker(args)
    if args.single:
        print(
            "RESULT " + json.dumps(measure(args.model_dir, args.name, args.steps, args.threads)),
            flush=True,
        )
        return None

    from services.models.tiny_model import TinyModelSpec, write_tiny_model

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
