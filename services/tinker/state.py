"""Training state that outlives the server: a training client's adapter weights, its
AdamW state and its step count, saved under `[tinker] state_dir` and named by a
`tinker://<training run>/weights/<name>` path, as the SDK's save_state returns.

A state is one directory, `<state_dir>/<run>/weights/<name>/`, holding
`adapter.safetensors` (the LoRA tensors, named without the adapter's name so any
adapter of the same shape takes them), `optimizer.pt` (AdamW's state_dict: its
moments and per-parameter step) and `meta.json` (base model, LoRA shape, steps,
time, the user's metadata). It is written whole into a temporary directory beside
the runs, synced, then renamed into place: a crash mid-save leaves either the
previous state or none under that name, never half of one, and the temporary
directory is swept at the next start.

Pure file handling: the tensors come from and go to model.py; app.py owns the routes.
"""

from __future__ import annotations

import json
import re
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from services.runtime.durable import fsync_path
from services.tinker.core import TinkerUserError, UnknownName

if TYPE_CHECKING:
    import torch

SCHEME = "tinker://"
KIND = "weights"  # the path segment the SDK reads as a "training" checkpoint
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TMP = ".tmp"


@dataclass(frozen=True)
class StateMeta:
    """What a saved state says about itself; enough to rebuild its adapter."""

    base_model: str
    rank: int
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    steps: int  # optim_steps applied when it was saved
    created: float  # Unix time
    user_metadata: dict[str, str] = field(default_factory=dict)
    has_optimizer: bool = True


def check_name(name: Any) -> str:
    """A save_state name becomes a directory: letters, digits, '.', '_', '-' only."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise TinkerUserError(
            f"save_state name {name!r}: use 1-128 letters, digits, '.', '_' or '-' "
            "(starting with a letter or digit)"
        )
    return name


def tinker_path(run_id: str, name: str) -> str:
    return f"{SCHEME}{run_id}/{KIND}/{name}"


def parse_path(path: Any) -> tuple[str, str]:
    """(run id, name) of a `tinker://<run>/weights/<name>` path; a typed error otherwise."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise TinkerUserError(f"state path {path!r} is not a tinker:// path")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] != KIND or not parts[0]:
        kind = parts[1] if len(parts) == 3 else None
        hint = (
            " (sampler weights hold no optimizer state and are not kept on disk here)"
            if kind == "sampler_weights"
            else ""
        )
        raise TinkerUserError(
            f"state path {path!r} is not of the form tinker://<run>/weights/<name>{hint}"
        )
    return parts[0], check_name(parts[2])


class StateStore:
    """Saved states under one root directory (`[tinker] state_dir`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        shutil.rmtree(root / _TMP, ignore_errors=True)  # what a crash mid-save left behind

    def _dir(self, run_id: str, name: str) -> Path:
        return self.root / quote(run_id, safe="") / KIND / name

    def exists(self, run_id: str, name: str) -> bool:
        return (self._dir(run_id, name) / "meta.json").is_file()

    def save(
        self,
        run_id: str,
        name: str,
        meta: StateMeta,
        tensors: dict[str, torch.Tensor],
        optimizer: dict[str, Any],
        overwrite: bool,
    ) -> str:
        import torch
        from safetensors.torch import save_file

        final = self._dir(run_id, name)
        if final.exists() and not overwrite:
            raise TinkerUserError(
                f"a state named {name!r} exists for {run_id!r}; pass overwrite=True to replace it"
            )
        tmp = self.root / _TMP / uuid.uuid4().hex
        tmp.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / "adapter.safetensors")
        torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(json.dumps(asdict(meta), indent=1))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
        final.parent.mkdir(parents=True, exist_ok=True)
        old = None
        if final.exists():  # overwrite: the old one steps aside, then goes
            old = self.root / _TMP / f"old-{uuid.uuid4().hex}"
            final.rename(old)
        tmp.rename(final)
        fsync_path(final.parent)
        if old is not None:
            shutil.rmtree(old)
        return tinker_path(run_id, name)

    def meta(self, run_id: str, name: str) -> StateMeta:
        if not self.exists(run_id, name):
            raise UnknownName(f"no saved state {tinker_path(run_id, name)!r} on this server")
        return StateMeta(**json.loads((self._dir(run_id, name) / "meta.json").read_text()))

    def load(
        self, run_id: str, name: str, optimizer: bool
    ) -> tuple[StateMeta, dict[str, torch.Tensor], dict[str, Any] | None]:
        import torch
        from safetensors.torch import load_file

        meta = self.meta(run_id, name)
        d = self._dir(run_id, name)
        tensors = load_file(d / "adapter.safetensors")
        opt = torch.load(d / "optimizer.pt", weights_only=True) if optimizer else None
        return meta, tensors, opt

    def list(self, run_id: str) -> list[dict[str, Any]]:
        """The SDK's Checkpoint objects (as JSON) of a run's saved states, oldest first."""
        base = self.root / quote(run_id, safe="") / KIND
        out = []
        for d in sorted(base.iterdir()) if base.is_dir() else []:
            if not (d / "meta.json").is_file():
                continue
            meta = self.meta(run_id, d.name)
            out.append(
                {
                    "checkpoint_id": f"{KIND}/{d.name}",
                    "checkpoint_type": "training",
                    "time": _iso(meta.created),
                    "tinker_path": tinker_path(run_id, d.name),
                    "size_bytes": sum(f.stat().st_size for f in d.iterdir()),
                    "public": False,
                    "user_metadata": meta.user_metadata or None,
                }
            )
        return sorted(out, key=lambda c: c["time"])


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"
