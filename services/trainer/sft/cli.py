"""`flywheel sft -c run.toml`: supervised fine-tuning from the command line.

argparse reads only the run file and a few flags; everything else is the
typed settings (`[sft]` of the run file, FLYWHEEL_SFT_* overrides). Heavy
imports happen inside the function so `flywheel --help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.runtime.errors import FlywheelError


def sft_main(argv: list[str]) -> int:
    """flywheel sft -c run.toml [--print-config] [--model-dir D] [--output-dir D] [--steps N]."""
    from services.runtime.settings import load_settings, render
    from services.trainer.settings import SftSettings
    from services.trainer.sft.loop import run_sft

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
        from services.models.resolve import resolve_model

        model = resolve_model(settings.model_dir, key="[sft] model_dir")  # a hub id: its snapshot
        run_sft(settings.model_copy(update={"model_dir": model}))
    except FlywheelError as e:
        print(f"flywheel sft: {e}", file=sys.stderr)
        return 2
    return 0
