"""What a run's trainer keeps on disk, estimated from the model directory before it starts.

Every published step writes a checkpoint (the model and AdamW's two moments in
float32: 12 bytes a parameter, SmolLM2-135M's 1.6 GB) and a weights version (the
model in its stored dtype: 269 MB); `[trainer] keep_checkpoints` of the first and
`[sync] keep_last` of the second stay while the next is written. A disk that cannot
hold one of each fails the run at its first step, so `flywheel up` refuses it
before anything loads; one that cannot hold the steady state gets a warning.
The trainer checks again before each write (services/runtime/diskroom.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from services.runtime.diskroom import existing, free_bytes, human

# bytes an element takes in a model directory's stored dtype (config.json's dtype)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 master + AdamW's exp_avg and exp_avg_sq


@dataclass(frozen=True)
class DiskPlan:
    checkpoint: int  # bytes of one checkpoint
    version: int  # bytes of one published weights version
    keep_checkpoints: int
    keep_versions: int

    def first(self) -> tuple[int, int]:
        """(checkpoint, weights) bytes the first published step writes."""
        return self.checkpoint, self.version

    def steady(self) -> tuple[int, int]:
        """(checkpoint, weights) bytes on disk while a step is written, later in the run."""
        return (self.checkpoint * (self.keep_checkpoints + 1),
                self.version * (self.keep_versions + 1))  # fmt: skip


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


def plan_for(model_dir: Path, keep_checkpoints: int, keep_versions: int) -> DiskPlan | None:
    """The plan for full fine-tuning of `model_dir`; None where its size is unknown (no
    safetensors, a dtype not in DTYPE_BYTES)."""
    stored = weights_bytes(model_dir)
    try:
        doc = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    per = DTYPE_BYTES.get(str(doc.get("dtype") or doc.get("torch_dtype") or "float32"))
    if not stored or per is None:
        return None
    params = stored // per
    return DiskPlan(params * CHECKPOINT_BYTES_PER_PARAM, stored, keep_checkpoints, keep_versions)


def shortfalls(
    plan: DiskPlan, checkpoint_dir: Path, weights_root: Path
) -> tuple[list[str], list[str]]:
    """(errors, warnings): where the first step's files, or the steady state's, do not fit
    (the two directories on one filesystem: together)."""
    (first_ckpt, first_w), (steady_ckpt, steady_w) = plan.first(), plan.steady()
    needs = [(checkpoint_dir, "[trainer] checkpoint_dir", first_ckpt, steady_ckpt),
             (weights_root, "[trainer] weights_root", first_w, steady_w)]  # fmt: skip
    if os.stat(existing(checkpoint_dir)).st_dev == os.stat(existing(weights_root)).st_dev:
        needs = [(checkpoint_dir, "[trainer] checkpoint_dir and weights_root",
                  first_ckpt + first_w, steady_ckpt + steady_w)]  # fmt: skip
    errors, warnings = [], []
    for path, key, first, steady in needs:
        free = free_bytes(path)
        where = f"{key} ({path}) has {human(free)} free"
        if free < first:
            errors.append(f"{where}: the first step's checkpoint and weights need {human(first)}")
        elif free < steady:
            warnings.append(
                f"{where}: with {plan.keep_checkpoints} checkpoints and {plan.keep_versions} "
                f"weights versions kept the run needs {human(steady)}, and stops when it fills"
            )
    return errors, warnings
