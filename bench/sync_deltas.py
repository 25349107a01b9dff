"""Sparse weight deltas at RL learning rates: bytes per version and publish→ready, in one run.

    .venv/bin/python bench/sync.py --deltas [--size 191m] [--steps 3] [--receivers 1,4,16]

1. A Qwen2-shaped model built from a config (no download; `--size`), fp32
   master weights, real AdamW steps (wd 0) on random tokens, at lr 1e-6,
   1e-5 and the demo's (configs/demo.toml, 1.5e-4), each from the same
   initial weights. Every version is published as the trainer publishes it
   (bf16 safetensors + manifest); per step: fraction of elements whose bf16
   bits changed, delta bytes against the full version (the real codec,
   services/weights/delta.py), encode time.
2. publish→ready for 1, 4 and 16 receivers, in one process against an
   embedded nats-server, on the lr 1e-6 versions (receivers hold v1; the
   trainer publishes v2): ready = every receiver holds v2 verified against
   the trainer's sha256 (the engine's own load, the same for all, is left
   out; bench/sync.py's main table has it).
   - disk: each receiver reads and hashes the shared directory (what an
     engine with `weights_check = "sha256"` does);
   - nats-full: `nats` transport upload + every receiver downloads;
   - nats-delta: encode + upload of the delta, every receiver rebuilds;
   - disk-delta: the delta beside the directory, every receiver rebuilds;
   - distributed: sync's rank 0 (`DistTransport`) broadcasts v2 over one
     two-rank gloo group per receiver, each receiver a separate process
     serving the engine's own distributed routes (bench/sync_dist.py says
     what is and is not included; group formation is timed apart).
   Receivers share this machine's 2 cores (at most 2 rebuilds at once), so
   16 receivers here cost what 16 machines would not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sync_dist import Receivers, measure  # noqa: E402

from proto.messages import WeightsPublished  # noqa: E402
from proto.streams import streams_for  # noqa: E402
from services.weights import (  # noqa: E402
    Wiring,
    published_dir,
    read_manifest,
    verify_weights_dir,
    version_dir,
    write_weights_dir,
)
from services.weights.delta import encode  # noqa: E402
from services.weights.deltasync import read_files  # noqa: E402

RUN = "benchdelta"
DEMO_LR = 1.5e-4  # configs/demo.toml [trainer.optim] lr
LRS = (1e-6, 1e-5, DEMO_LR)
SIZES = {  # params → (hidden, layers, intermediate, heads, kv heads); vocab 32000, tied
    "11m": (256, 4, 704, 4, 2),
    "39m": (512, 8, 1408, 8, 2),
    "98m": (768, 12, 2048, 12, 2),
    "191m": (1024, 14, 2816, 16, 4),
    "319m": (1280, 16, 3456, 16, 4),
}


def build_model(size: str) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    h, layers, inter, heads, kv = SIZES[size]
    cfg = Qwen2Config(
        vocab_size=32000,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def save_bf16(model: Any, out: Path) -> None:
    """Publish as the trainer does: an HF directory of bf16 safetensors, with its manifest."""
    import torch
    from safetensors.torch import save_file

    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    sd.pop("lm_head.weight", None)  # tied

    def write(tmp: Path) -> None:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        model.config.to_json_file(str(tmp / "config.json"))

    write_weights_dir(out, write, overwrite=True)


def train_versions(size: str, lr: float, steps: int, root: Path, init: dict) -> list[Path]:
    """v0 (the initial weights) and one version per AdamW step at `lr`."""
    import torch

    model = build_model(size)
    model.load_state_dict(init)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    dirs = [root / f"lr{lr:g}" / RUN / "v000000"]
    save_bf16(model, dirs[0])
    for step in range(1, steps + 1):
        ids = torch.randint(0, 32000, (4, 64), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dirs.append(published_dir(root / f"lr{lr:g}", RUN, step))
        save_bf16(model, dirs[-1])
    return dirs


def delta_rows(lr: float, dirs: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for prev, cur in itertools.pairwise(dirs):
        base, new = read_files(prev), read_files(cur)
        manifest = (cur / "flywheel-manifest.json").read_text()
        t = time.perf_counter()
        _, st = encode(
            base, new, version=1, base_version=0, base_sha256="0" * 64, manifest=manifest
        )
        rows.append(
            {
                "lr": lr,
                "version": cur.name,
                "changed": st.fraction_changed,
                "full": st.full_bytes,
                "delta": st.delta_bytes,
                "ratio": st.ratio,
                "encode_s": time.perf_counter() - t,
            }
        )
    return rows


def announced(version: int, uri: str, directory: Path) -> WeightsPublished:
    m = read_manifest(directory)
    return WeightsPublished(
        run=RUN, version=version, step=version, uri=uri, sha256=m.sha256, size_bytes=m.total_bytes
    )


def hold(src: Path, into: Path) -> None:
    """A receiver that holds `src` verified: hard links (read only: rebuilds never write them)."""
    target = version_dir(into, 1)
    for p in src.rglob("*"):
        q = target / p.relative_to(src)
        if p.is_dir():
            q.mkdir(parents=True, exist_ok=True)
        else:
            q.parent.mkdir(parents=True, exist_ok=True)
            os.link(p, q)


async def receivers_ready(
    transport_cls: Any, wiring: Wiring, msg: WeightsPublished, conns: list[Any], intos: list[Path]
) -> None:
    """Every receiver brings v2 in beside its engine, each on its own connection (as each
    worker process has: a shared one would be cut as a slow consumer)."""

    async def one(nc: Any, into: Path) -> None:
        w = dataclasses.replace(wiring, nc=nc, js=nc.jetstream())
        got = await transport_cls(w).receive(msg, into, newer_than=1)
        assert got is not None and read_manifest(version_dir(into, 2)).sha256 == msg.sha256

    await asyncio.gather(*(one(nc, i) for nc, i in zip(conns, intos, strict=False)))


async def transports(v1: Path, v2: Path, counts: list[int], tmp: Path) -> list[dict[str, Any]]:
    import nats

    from services.runtime.nats_conn import ensure_streams
    from services.stack.localdev.nats_server import NatsServer
    from services.weights.diskdelta import DiskDeltaTransport
    from services.weights.nats import NatsTransport
    from services.weights.natsdelta import NatsDeltaTransport

    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(2))  # 2 cores
    rows: list[dict[str, Any]] = []
    with NatsServer(store_dir=tmp / "nats") as server, Receivers(max(counts), v1) as engines:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        conns = [await nats.connect(server.url) for _ in range(max(counts))]
        for n in counts:
            for kind in ("disk", "nats-full", "nats-delta", "disk-delta"):
                run_root = tmp / f"{kind}-{n}"
                src1, src2 = published_dir(run_root, RUN, 1), published_dir(run_root, RUN, 2)
                shutil.copytree(v1, src1)
                shutil.copytree(v2, src2)
                intos = [run_root / "rx" / str(i) for i in range(n)]
                for into in intos:
                    hold(src1, into)
                await ensure_streams(js, streams_for(RUN))
                w = Wiring(
                    RUN,
                    run_root,
                    js,
                    nc,
                    max_payload=nc.max_payload,
                    snapshot_every=100,
                    idle_timeout_s=60,
                )
                sent_bytes = 0
                if kind in ("nats-delta", "disk-delta"):
                    cls = NatsDeltaTransport if kind == "nats-delta" else DiskDeltaTransport
                    trainer = cls(w)
                    await trainer.publish(1, src1)  # the base: a snapshot, not timed
                    t = time.perf_counter()
                    sent = await trainer.publish(2, src2)
                    await receivers_ready(cls, w, announced(2, sent.uri, src2), conns, intos)
                    sent_bytes = sent.delta.delta_bytes if sent.delta else 0
                elif kind == "nats-full":
                    t = time.perf_counter()
                    sent = await NatsTransport(w).publish(2, src2)
                    msg = announced(2, sent.uri, src2)
                    await receivers_ready(NatsTransport, w, msg, conns, intos)
                    sent_bytes = sent.transfer.bytes if sent.transfer else 0
                else:  # disk: every engine reads and hashes the shared directory
                    t = time.perf_counter()
                    await asyncio.gather(
                        *(asyncio.to_thread(verify_weights_dir, src2) for _ in intos)
                    )
                seconds = time.perf_counter() - t
                per_rx = sent_bytes if kind != "disk" else read_manifest(src2).total_bytes
                rows.append(
                    {"receivers": n, "kind": kind, "seconds": seconds, "bytes_per_receiver": per_rx}
                )
                print(f"  {kind:10s} x{n:2d}: {seconds:7.2f}s", flush=True)
                await js.delete_stream(f"FLYWHEEL_{RUN}_WEIGHTDATA")
                shutil.rmtree(run_root, ignore_errors=True)
            # sync's own loop and executor, as in its process (bench/sync_dist.py)
            dist = measure(v2, engines.urls[:n], tmp / f"distributed-{n}")
            rows.append(await asyncio.to_thread(asyncio.run, dist))
            print(
                f"  {'distributed':10s} x{n:2d}: {rows[-1]['seconds']:7.2f}s "
                f"(groups formed in {rows[-1]['formed_s']:.2f}s, not counted)",
                flush=True,
            )
        for c in [nc, *conns]:
            await c.close()
    return rows


def report_deltas(size: str, params: int, steps: int, deltas: list[dict]) -> None:
    print(
        f"\nmodel {size}: {params / 1e6:.0f}M params, bf16 published "
        f"({deltas[0]['full'] / 1e6:.0f} MB per version), {steps} AdamW steps per lr\n"
    )
    print(
        "| lr | fraction of elements changed (per step) | delta bytes (per step) "
        "| delta / full (per step) | mean delta / full | encode s |"
    )
    print("|---|---|---|---|---|---|")
    for lr in LRS:
        rs = [r for r in deltas if r["lr"] == lr]
        pct = " / ".join(f"{r['changed'] * 100:.2f}%" for r in rs)
        mb = " / ".join(f"{r['delta'] / 1e6:.1f} MB" for r in rs)
        ratio = " / ".join(f"{r['ratio']:.4f}×" for r in rs)
        mean = statistics.mean(r["ratio"] for r in rs)
        enc = statistics.mean(r["encode_s"] for r in rs)
        print(f"| {lr:g} | {pct} | {mb} | {ratio} | {mean:.4f}× | {enc:.2f} |", flush=True)


def report_receivers(rx: list[dict]) -> None:
    print(
        "\npublish→ready at lr 1e-6 (v1 held, v2 published), seconds; "
        "ratio to nats-full in the same run:\n"
    )
    kinds = ("disk", "nats-full", "nats-delta", "disk-delta", "distributed")
    print(
        "| receivers | " + " | ".join(kinds) + " | nats-delta / nats-full "
        "| disk-delta / disk | distributed / nats-full | bytes per receiver: full → delta |"
    )
    print("|---|" + "---|" * (len(kinds) + 4))
    counts = sorted({r["receivers"] for r in rx})
    for n in counts:
        by = {r["kind"]: r for r in rx if r["receivers"] == n}
        cells = " | ".join(f"{by[k]['seconds']:.2f}" for k in kinds)
        nd = by["nats-delta"]["seconds"] / by["nats-full"]["seconds"]
        dd = by["disk-delta"]["seconds"] / by["disk"]["seconds"]
        xd = by["distributed"]["seconds"] / by["nats-full"]["seconds"]
        full, delta = by["nats-full"]["bytes_per_receiver"], by["nats-delta"]["bytes_per_receiver"]
        print(
            f"| {n} | {cells} | {nd:.3f}× | {dd:.3f}× | {xd:.3f}× "
            f"| {full / 1e6:.0f} MB → {delta / 1e6:.1f} MB |"
        )
    print(
        "\ndistributed, outside publish→ready: one two-rank group per receiver, formed at "
        "once; inside it: the slowest receiver's sha256 of what it received\n"
    )
    print("| receivers | groups formed s | receiver sha256 s (max) |\n|---|---|---|")
    for n in counts:
        d = next(r for r in rx if r["receivers"] == n and r["kind"] == "distributed")
        print(f"| {n} | {d['formed_s']:.2f} | {d['verify_s']:.2f} |")


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="191m", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--receivers", default="1,4,16")
    p.add_argument("--tmp", default=None)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    started = time.perf_counter()
    model = build_model(args.size)
    params = sum(t.numel() for t in model.parameters())
    init = {k: v.clone() for k, v in model.state_dict().items()}
    del model
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=args.tmp)))
        deltas: list[dict[str, Any]] = []
        lr_dirs: dict[float, list[Path]] = {}
        for lr in LRS:
            t = time.perf_counter()
            lr_dirs[lr] = train_versions(args.size, lr, args.steps, tmp, init)
            deltas += delta_rows(lr, lr_dirs[lr])
            print(
                f"lr {lr:g}: {args.steps} steps in {time.perf_counter() - t:.0f}s; changed "
                + ", ".join(f"{r['changed'] * 100:.2f}%" for r in deltas if r["lr"] == lr),
                flush=True,
            )
        report_deltas(args.size, params, args.steps, deltas)
        counts = [int(n) for n in args.receivers.split(",")]
        v1, v2 = lr_dirs[1e-6][1], lr_dirs[1e-6][2]
        rx = asyncio.run(transports(v1, v2, counts, tmp / "rx"))
    report_receivers(rx)
    print(f"\ntotal {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1:])
