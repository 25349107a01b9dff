"""Weight deltas on real pretrained weights after real GRPO steps, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/real_deltas.py \
        --model /work/models/SmolLM2-135M-Instruct [--steps 3] [--lrs 1e-6,4e-5] [--out FILE]

For each learning rate, from the same pretrained weights: `--steps` GRPO
steps of the real trainer (`Trainer.train_step`, its defaults: AdamW, wd 0,
grad clip 1, this CPU's default precision and layout), each on a fresh
on-policy batch: 4 one-digit-sum prompts x 8 samples of <= 16 tokens
sampled from the current policy (bench/real_step.py's `sample_batch`,
reward 1 when the reply's last number is the sum). After every step the
version is written as the trainer publishes it (`save_weights`), and
consecutive versions are diffed with the real codec
(services/weights/delta.py `encode`, what nats-delta sends): fraction of
elements whose bits changed, delta bytes against the full version, encode
and apply time. Versions are also written as float32 (what the trainer
published before it kept the model's own dtype) for the contrast.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from real_step import sample_batch  # noqa: E402


def read_files(d: Path) -> dict[str, bytes]:
    skip = {"flywheel-manifest.json"}
    return {
        p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file() and p.name not in skip
    }


def diff(prev: Path, cur: Path) -> dict[str, Any]:
    from services.weights.delta import apply, encode, unpack

    base, new = read_files(prev), read_files(cur)
    manifest = (cur / "flywheel-manifest.json").read_text()
    t = time.perf_counter()
    packed, st = encode(
        base, new, version=1, base_version=0, base_sha256="0" * 64, manifest=manifest
    )
    enc = time.perf_counter() - t
    t = time.perf_counter()
    rebuilt = apply(base, unpack(packed))
    app = time.perf_counter() - t
    assert all(bytes(rebuilt[k]) == new[k] for k in new)  # the delta really rebuilds it
    return {
        "changed": st.fraction_changed,
        "full": st.full_bytes,
        "delta": st.delta_bytes,
        "encode_s": enc,
        "apply_s": app,
    }


def run_lr(model_dir: Path, lr: float, steps: int, root: Path, seed: int) -> list[dict[str, Any]]:
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer

    cfg = TrainConfig(optim=OptimConfig(lr=lr), model=ModelConfig(cpu_threads=1))
    trainer = Trainer.from_pretrained(model_dir, cfg)
    tok = trainer.tokenizer
    attn = trainer.model.config._attn_implementation

    def publish(v: int) -> tuple[Path, Path]:
        sd = trainer.full_state_dict()
        assert sd is not None
        pub, f32 = root / f"lr{lr:g}" / f"v{v}", root / f"lr{lr:g}-fp32" / f"v{v}"
        trainer.save_weights(pub, overwrite=True, state_dict=sd)
        stored, trainer.publish_dtype = trainer.publish_dtype, None  # float32, as before
        trainer.save_weights(f32, overwrite=True, state_dict=sd)
        trainer.publish_dtype = stored
        return pub, f32

    dirs = [publish(0)]
    rows = []
    for step in range(1, steps + 1):
        trainer.model.set_attn_implementation("sdpa")  # generate: the model's own attention
        trainer.model.eval()
        t = time.perf_counter()
        batch = sample_batch(trainer.model, tok, 4, 8, 16, seed=seed + step)
        gen_s = time.perf_counter() - t
        trainer.model.set_attn_implementation(attn)
        t = time.perf_counter()
        m = trainer.train_step(batch)
        step_s = time.perf_counter() - t
        dirs.append(publish(step))
        d = diff(dirs[-2][0], dirs[-1][0])
        d32 = diff(dirs[-2][1], dirs[-1][1])
        row = {
            "lr": lr,
            "step": step,
            "reward": float(batch.rewards.mean()),
            "grad_norm": m["grad_norm"],
            "gen_s": gen_s,
            "step_s": step_s,
            **d,
            "changed32": d32["changed"],
            "delta32": d32["delta"],
            "full32": d32["full"],
            "load": os.getloadavg()[0],
        }
        rows.append(row)
        print(
            f"lr {lr:g} step {step}: reward {row['reward']:.2f}, changed {d['changed']:.4%}, "
            f"delta {d['delta'] / 1e6:.1f} MB of {d['full'] / 1e6:.1f} MB; fp32 changed "
            f"{d32['changed']:.4%}, {d32['delta'] / 1e6:.1f} of {d32['full'] / 1e6:.1f} MB",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/work/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lrs", default="1e-6,4e-5")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    load0 = os.getloadavg()
    rows: list[dict[str, Any]] = []
    (ROOT / "runs").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "runs") as tmp:
        for i, lr in enumerate(float(x) for x in args.lrs.split(",")):
            rows += run_lr(args.model, lr, args.steps, Path(tmp), seed=100 * i)
    lines = [
        f"Started {started}; {os.cpu_count()} CPUs, load (1/5/15-min) at start "
        f"{load0[0]:.1f}/{load0[1]:.1f}/{load0[2]:.1f}; torch threads 1; model {args.model}.",
        "",
        "| lr | step | reward | grad norm | bf16 elements changed | nats-delta MB | full MB | "
        "delta / full | encode s | apply s | fp32: changed | fp32: delta / full | load |",
        "|---" * 13 + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['lr']:g} | {r['step']} | {r['reward']:.2f} | {r['grad_norm']:.3f} | "
            f"{r['changed']:.3%} | {r['delta'] / 1e6:.1f} | {r['full'] / 1e6:.1f} | "
            f"{r['delta'] / r['full']:.3f} | {r['encode_s']:.1f} | {r['apply_s']:.1f} | "
            f"{r['changed32']:.2%} | {r['delta32'] / r['full32']:.3f} | {r['load']:.1f} |"
        )
    for lr, grp in itertools.groupby(rows, key=lambda r: r["lr"]):
        g = list(grp)
        mean = sum(r["changed"] for r in g) / len(g)
        ratio = sum(r["delta"] for r in g) / sum(r["full"] for r in g)
        lines.append(f"\nlr {lr:g}: mean {mean:.3%} of bf16 elements changed per version; "
                     f"delta / full {ratio:.3f}")  # fmt: skip
    md = "\n".join(lines)
    print("\n" + md)
    if args.out:
        cmd = " ".join(
            ["OMP_NUM_THREADS=1 .venv/bin/python bench/real_deltas.py", *(argv or sys.argv[1:])]
        )
        args.out.write_text(f"<!-- generated by: {cmd} -->\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
