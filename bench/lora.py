"""LoRA vs full fine-tuning on the real model: trainer s/step, peak RSS, bytes per version,
publish→ready over NATS for 1, 4 and 16 receivers, in one run.

    .venv/bin/python bench/lora.py [--model /work/models/SmolLM2-135M-Instruct] [--steps 2]
        [--repeats 3] [--rows 16 --prompt 32 --response 16] [--rank 8]
        [--receivers 1 4 16] [--out bench/results_lora.md]

1. Training, one subprocess per mode (so each has its own peak RSS),
   one torch thread each (2 shared cores), the same synthetic RL batch
   (`--rows` samples of `--prompt` + `--response` tokens, groups of 8,
   the trainer's real loss path): one warm-up `train_step` (it also makes
   AdamW's state), then `--steps` timed steps; peak RSS (ru_maxrss) after
   them; then the version as the trainer publishes it (`save_weights`:
   the whole HF directory, or PEFT's adapter directory) and its bytes.
   `--repeats` pairs of processes, the order alternating (full, LoRA; then
   LoRA, full; ...), so that the load other jobs put on the shared cores
   falls on both: s/step is the median of every timed step of a mode.
   LoRA: rank `--rank`, alpha 2·rank, the attention and MLP projections
   (the `[trainer.lora]` defaults).
2. publish→ready over NATS, both versions in this process against an
   embedded nats-server: the `nats` transport's upload, then every receiver
   (each on its own NATS connection, as each rollout worker has) downloads
   the version and verifies it against the manifest's sha256. The engine's
   own load is left out (for an adapter: /load_lora_adapter of a few MB;
   for full weights: the whole model). Receivers share this machine's 2
   cores: 16 receivers here cost what 16 machines would not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RUN = "benchlora"
MODEL = Path("/work/models/SmolLM2-135M-Instruct")


def batch(rows: int, prompt: int, response: int, vocab: int) -> Any:
    import torch

    from services.trainer.core.batching import TensorBatch

    g = torch.Generator().manual_seed(0)
    return TensorBatch(
        prompt_ids=[torch.randint(3, vocab, (prompt,), generator=g) for _ in range(rows)],
        response_ids=[torch.randint(3, vocab, (response,), generator=g) for _ in range(rows)],
        rollout_logprobs=[-torch.rand(response, generator=g) - 2 for _ in range(rows)],
        rewards=torch.randint(0, 2, (rows,), generator=g).float(),
        group_ids=torch.arange(rows) // 8,
        truncated=torch.zeros(rows, dtype=torch.bool),
    )


def train(args: argparse.Namespace) -> None:
    """Child: one mode's steps, peak RSS and version; prints one JSON line."""
    import torch

    torch.set_num_threads(1)
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer
    from services.weights.adapter import LoraSettings

    lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank) if args.train == "lora" else None
    cfg = TrainConfig(optim=OptimConfig(lr=1e-5), model=ModelConfig(cpu_threads=1), lora=lora)
    t = Trainer.from_pretrained(args.model, cfg)
    vocab = int(t.model.config.vocab_size)
    b = batch(args.rows, args.prompt, args.response, vocab)
    trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
    t.train_step(b)  # warm-up; AdamW's state is made here
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        t.train_step(b)
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    manifest = t.save_weights(Path(args.out))
    assert manifest is not None
    doc = {
        "mode": args.train,
        "step_s": statistics.median(times),
        "steps_s": times,
        "peak_rss": peak_rss,
        "bytes": manifest.total_bytes,
        "files": sorted(f.name for f in manifest.files),
        "trainable": trainable,
        "tokens": args.rows * (args.prompt + args.response),
    }
    print(json.dumps(doc), flush=True)


def run_mode(mode: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--train", mode, "--model", str(args.model),
        "--steps", str(args.steps), "--rows", str(args.rows), "--prompt", str(args.prompt),
        "--response", str(args.response), "--rank", str(args.rank), "--out", str(out),
    ]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: {proc.stderr[-3000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


async def publish_ready(versions: dict[str, Path], counts: list[int], tmp: Path) -> list[dict]:
    """For each version and receiver count: nats upload + every receiver's verified copy."""
    import nats

    from proto.messages import WeightsPublished
    from proto.streams import streams_for
    from services.runtime.nats_conn import ensure_streams
    from services.stack.localdev.nats_server import NatsServer
    from services.weights import Wiring, published_dir, read_manifest, version_dir
    from services.weights.nats import NatsTransport

    rows = []
    with NatsServer(store_dir=tmp / "nats") as server:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        conns = [await nats.connect(server.url) for _ in range(max(counts))]
        for n in counts:
            for mode, src in versions.items():
                root = tmp / f"{mode}-{n}"
                v = 2
                shutil.copytree(src, published_dir(root, RUN, v))
                await ensure_streams(js, streams_for(RUN))
                w = Wiring(RUN, root, js, nc, max_payload=nc.max_payload, idle_timeout_s=120)
                m = read_manifest(published_dir(root, RUN, v))
                start = time.perf_counter()
                sent = await NatsTransport(w).publish(v, published_dir(root, RUN, v))
                msg = WeightsPublished(
                    run=RUN, version=v, step=v, uri=sent.uri, sha256=m.sha256,
                    size_bytes=m.total_bytes,
                )  # fmt: skip

                async def one(c: Any, into: Path, msg: WeightsPublished = msg, v: int = v) -> None:
                    wc = Wiring(RUN, js=c.jetstream(), nc=c, idle_timeout_s=120)
                    got = await NatsTransport(wc).receive(msg, into, newer_than=1)
                    assert got is not None
                    assert read_manifest(version_dir(into, v)).sha256 == msg.sha256

                intos = [root / "rx" / str(i) for i in range(n)]
                await asyncio.gather(*(one(c, i) for c, i in zip(conns, intos, strict=False)))
                seconds = time.perf_counter() - start
                rows.append({"mode": mode, "receivers": n, "seconds": seconds})
                print(f"  {mode:5s} x{n:2d}: {seconds:7.2f}s", flush=True)
                await js.delete_stream(f"FLYWHEEL_{RUN}_WEIGHTDATA")
                shutil.rmtree(root, ignore_errors=True)
        for c in [nc, *conns]:
            await c.close()
    return rows


def merged_runs(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's repeats as one row: every timed step, the median peak RSS."""
    steps = [s for r in rs for s in r["steps_s"]]
    return {
        **rs[0],
        "steps_s": steps,
        "step_s": statistics.median(steps),
        "peak_rss": statistics.median(r["peak_rss"] for r in rs),
        "peak_rss_all": [r["peak_rss"] for r in rs],
    }


def report(args: argparse.Namespace, tr: dict[str, dict], rx: list[dict], cmd: str) -> str:
    full, lora = tr["full"], tr["lora"]
    mb = 1e6
    lines = [
        f"    {cmd}",
        "",
        f"Model {args.model.name}; batch {args.rows} × ({args.prompt} + {args.response}) tokens; "
        f"LoRA rank {args.rank}, alpha {2 * args.rank}, q/k/v/o/gate/up/down; one torch thread "
        f"per trainer; median of {args.steps} steps after a warm-up in each of "
        f"{args.repeats} processes per mode, alternating.",
        "",
        "| | full | LoRA | LoRA / full |",
        "|---|---:|---:|---:|",
        f"| trainable parameters | {full['trainable']:,} | {lora['trainable']:,} | "
        f"{lora['trainable'] / full['trainable']:.4f}× |",
        f"| trainer s/step | {full['step_s']:.2f} | {lora['step_s']:.2f} | "
        f"{lora['step_s'] / full['step_s']:.2f}× |",
        f"| trainer peak RSS (MB) | {full['peak_rss'] / mb:.0f} | {lora['peak_rss'] / mb:.0f} | "
        f"{lora['peak_rss'] / full['peak_rss']:.2f}× |",
        f"| bytes per version (MB) | {full['bytes'] / mb:.1f} | {lora['bytes'] / mb:.2f} | "
        f"{lora['bytes'] / full['bytes']:.4f}× |",
    ]
    by = {(r["mode"], r["receivers"]): r["seconds"] for r in rx}
    for n in args.receivers:
        f, a = by[("full", n)], by[("lora", n)]
        lines.append(
            f"| publish→ready over NATS, {n} receiver{'s' if n > 1 else ''} (s) | {f:.2f} | "
            f"{a:.3f} | {a / f:.3f}× |"
        )
    lines += [
        "",
        f"Steps (s): full {', '.join(f'{s:.2f}' for s in full['steps_s'])}; "
        f"LoRA {', '.join(f'{s:.2f}' for s in lora['steps_s'])}. Peak RSS (MB): full "
        f"{', '.join(f'{x / mb:.0f}' for x in full['peak_rss_all'])}; LoRA "
        f"{', '.join(f'{x / mb:.0f}' for x in lora['peak_rss_all'])}. "
        f"Version files: full {full['files']}; LoRA {lora['files']}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--response", type=int, default=16)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--out", type=Path)
    p.add_argument("--train", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train:
        train(args)
        return
    cmd = "bench/lora.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="benchlora-") as d:
        tmp = Path(d)
        runs: dict[str, list[dict[str, Any]]] = {"full": [], "lora": []}
        for r in range(args.repeats):
            for mode in ("full", "lora") if r % 2 == 0 else ("lora", "full"):
                print(f"training: {mode} (repeat {r + 1})", flush=True)
                out = tmp / mode if r == 0 else tmp / f"{mode}-{r}"
                runs[mode].append(run_mode(mode, args, out))
                print(f"  {json.dumps(runs[mode][-1])}", flush=True)
                if r:
                    shutil.rmtree(out, ignore_errors=True)
        tr = {m: merged_runs(rs) for m, rs in runs.items()}
        print("publish→ready over NATS", flush=True)
        versions = {m: tmp / m for m in ("full", "lora")}
        rx = asyncio.run(publish_ready(versions, args.receivers, tmp))
    text = report(args, tr, rx, f".venv/bin/python {cmd}")
    print(text)
    if args.out:
        args.out.write_text(args.out.read_text() + "\n" + text if args.out.exists() else text)


if __name__ == "__main__":
    main()
