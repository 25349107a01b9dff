"""The trainer's commands: the RL service (`flywheel trainer`, `python -m services.trainer`,
also under torchrun) and `flywheel init-model`. (`flywheel sft`: services/trainer/sft/cli.py.)

argparse reads only the run file and a few flags; everything else is the
typed settings. Heavy imports happen inside the functions so `flywheel
--help` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from services.runtime.errors import FlywheelError

if TYPE_CHECKING:
    from proto.streams import StreamSpec
    from services.models.tiny_model import TinyModelSpec


def main(argv: list[str] | None = None) -> int:
    """Every rank loads the model (from the newest checkpoint); rank 0 runs NATS and the
    RL loop, the other ranks train what it broadcasts."""
    import asyncio

    from services.runtime.malloc import bound_heap_growth
    from services.runtime.service_main import parse_args, settings_or_exit
    from services.trainer.settings import TrainerSettings

    bound_heap_growth()  # before any tensor: freed memory goes back (runtime/malloc.py)
    args = parse_args("trainer", argv)
    settings = settings_or_exit("trainer", TrainerSettings, args.config, args.print_config)
    from services.models.resolve import resolve_model
    from services.runtime.errors import EXIT_CONFIG, ConfigError

    try:  # a hub id becomes its cached snapshot; none: one line, not a traceback per rank
        model = resolve_model(settings.model, key="[trainer] model")
    except ConfigError as e:
        print(f"flywheel trainer: {e}", file=sys.stderr)
        return EXIT_CONFIG
    settings = settings.model_copy(update={"model": model})
    from services.runtime.lifecycle import run_service, setup_logging
    from services.runtime.service_main import run_or_exit
    from services.trainer.app import body, load_trainer
    from services.trainer.distributed import init_distributed, shutdown
    from services.trainer.step import follower_loop

    setup_logging("trainer", settings.log_level)
    info = init_distributed()
    try:
        trainer, seq = load_trainer(settings, info)
        if not info.is_main:
            follower_loop(trainer, settings)
            return 0
        streams: list[StreamSpec] | None = [] if settings.replay else None
        return run_or_exit(
            "trainer",
            lambda: asyncio.run(
                # a replay creates no stream: it reads what the recorded run left
                run_service("trainer", settings, body(trainer, seq), streams=streams)
            ),
        )
    finally:
        shutdown(info)


def init_model_parser() -> argparse.ArgumentParser:
    from services.models.tiny_model import TinyModelSpec

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
    return ap


def init_model_main(argv: list[str]) -> int:
    """flywheel init-model [DIR] [-c run.toml] [--sft-steps N] [--hidden N --layers N ...]."""
    from services.models.tiny_model import TinyModelSpec, write_tiny_model

    args = init_model_parser().parse_args(argv)
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
        return _init_for_task(args, out_dir, spec)
    if out_dir is None:
        print("flywheel init-model: give DIR (or -c run.toml)", file=sys.stderr)
        return 2
    if out_dir.exists() and any(out_dir.iterdir()) and not args.force:
        print(f"flywheel init-model: {out_dir} is not empty (use --force)", file=sys.stderr)
        return 2
    print(write_tiny_model(out_dir, spec))
    return 0


def _init_for_task(args: argparse.Namespace, out_dir: Path | None, spec: TinyModelSpec) -> int:
    from services.trainer.init_model import init_for_task

    try:
        out = init_for_task(
            args.config,
            out_dir,
            vocab_size=args.vocab_size,
            sft_steps=args.sft_steps,
            spec=spec,
            force=args.force,
        )
    except FlywheelError as e:
        print(f"flywheel init-model: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
