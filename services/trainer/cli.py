"""Entry points the `flywheel` CLI wires as subcommands: `sft` and `init-model`.

argparse reads only the run file and a few flags; everything else is the
typed settings (`[sft]` of the run file, FLYWHEEL_SFT_* overrides). Heavy
imports happen inside the functions so `flywheel --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.errors import FlywheelError


def sft_main(argv: list[str]) -> int:
    """flywheel sft -c run.toml [--print-config] [--model-dir D] [--output-dir D] [--steps N]."""
    from services.common.settings import load_settings, render
    from services.trainer.sft import SftSettings, run_sft

    ap = argparse.ArgumentParser(prog="flywheel sft", description="Supervised fine-tuning.")
    ap.add_argument("-c", "--config", type=Path, help="TOML run file ([sft] section).")
    ap.add_argument("--print-config", action="store_true", help="Show resolved settings, exit.")
    ap.add_argument("--model-dir", type=Path, help="Override sft.model_dir.")
    ap.add_argument("--train-file", type=Path, help="Override sft.train_file.")
    ap.add_argument("--output-dir", type=Path, help="Override sft.output_dir.")
    ap.add_argument("--steps", type=int, help="Override sft.steps.")
    args = ap.parse_args(argv)
    overrides = {
        k: v
        for k, v in {
            "model_dir": args.model_dir,
            "train_file": args.train_file,
            "output_dir": args.output_dir,
            "steps": args.steps,
        }.items()
        if v is not None
    }
    try:
        settings = load_settings(SftSettings, args.config, **overrides)
        if args.print_config:
            print(render(settings))
            return 0
        run_sft(settings)
    except FlywheelError as e:
        print(f"flywheel sft: {e}", file=sys.stderr)
        return 2
    return 0


def init_model_main(argv: list[str]) -> int:
    """flywheel init-model [DIR] [-c run.toml] [--sft-steps N] [--hidden N --layers N ...]."""
    from services.common.tiny_model import TinyModelSpec, write_tiny_model

    d = TinyModelSpec()
    ap = argparse.ArgumentParser(
        prog="flywheel init-model",
        description="Write a tiny Qwen2 model. With -c: a BPE tokenizer trained on the run "
        "file's task and an SFT warm start on its training rows, at [stack] model. "
        "Without: the demo's char-tokenizer model, untrained, at DIR.",
    )
    ap.add_argument("dir", type=Path, nargs="?", help="Output directory (same as --out).")
    ap.add_argument("-c", "--config", type=Path, help="Run file whose [task] the model is for.")
    ap.add_argument("--out", type=Path, help="Output directory (default: [stack] model).")
    ap.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary (with -c).")
    ap.add_argument(
        "--sft-steps",
        type=int,
        default=300,
        help="Warm-start steps on the task's training rows (with -c; 0: none).",
    )
    ap.add_argument("--hidden", type=int, default=d.hidden_size)
    ap.add_argument("--layers", type=int, default=d.num_layers)
    ap.add_argument("--heads", type=int, default=d.num_heads)
    ap.add_argument("--kv-heads", type=int, default=None, help="Default: --heads.")
    ap.add_argument("--intermediate", type=int, default=None, help="Default: 4 × hidden.")
    ap.add_argument("--max-positions", type=int, default=d.max_position_embeddings)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--force", action="store_true", help="Write into a non-empty directory.")
    args = ap.parse_args(argv)
    if args.hidden % args.heads:
        print("flywheel init-model: --hidden must be divisible by --heads", file=sys.stderr)
        return 2
    spec = TinyModelSpec(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads or args.heads,
        intermediate_size=args.intermediate or 4 * args.hidden,
        max_position_embeddings=args.max_positions,
        seed=args.seed,
    )
    out_dir = args.out or args.dir
    if args.config is not None:
        from services.trainer.init_model import init_for_task

        try:
            out = init_for_task(args.config, out_dir, vocab_size=args.vocab_size,
                                sft_steps=args.sft_steps, spec=spec, force=args.force)  # fmt: skip
        except FlywheelError as e:
            print(f"flywheel init-model: {e}", file=sys.stderr)
            return 2
        print(out)
        return 0
    if out_dir is None:
        print("flywheel init-model: give DIR (or -c run.toml)", file=sys.stderr)
        return 2
    if out_dir.exists() and any(out_dir.iterdir()) and not args.force:
        print(f"flywheel init-model: {out_dir} is not empty (use --force)", file=sys.stderr)
        return 2
    print(write_tiny_model(out_dir, spec))
    return 0
