"""The journal's replay checkpoints: the whole state a replay would rebuild, on disk.

journal.py says when a checkpoint is taken and how a start uses it; this module copies
the state out of a running server and puts it back into a starting one, and owns the
files. A checkpoint is one directory, `<checkpoint_dir>/<stream>/<covers>/` (`covers`:
the last journal sequence it covers, zero-padded so the names sort):

- `models/`: a StateStore (state.py, save_state's own format) holding each training
  model's adapter, AdamW state and step count, as `tinker://<model id>/weights/replay`;
- `grads/<i>.safetensors`: model i's accumulated gradients (a forward_backward not yet
  stepped); absent when it has none;
- `snapshots/<i>.safetensors`: sampler snapshot i's adapter tensors (with engines, the
  adapter the engines were given; without, the in-process snapshot);
- `state.msgpack`: the sessions, the models (id, session, LoRA shape, steps), the
  sampling sessions, which snapshot file is whose, and the request log (every entry
  with its answer, and the retry keys);
- `manifest.json`, written last: every other file's size and sha256.

It is written whole into a temporary directory beside the others, synced, then renamed
into place, as state.py writes a saved state: a crash mid-write leaves no directory
under that name, and the temporary one is swept at the next start. A directory whose
manifest is missing, or whose files do not match it, is not whole (`why_not_whole`),
and a start passes over it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from services.runtime.durable import fsync_path
from services.tinker.core import Category, Entry, SamplingSession, State, TrainingModel
from services.tinker.journal import Checkpoint, JournalCorrupt

if TYPE_CHECKING:
    import torch

    from services.tinker.model import AdapterModel

VERSION = 1
MANIFEST = "manifest.json"
STATE_NAME = "replay"  # the save_state name each model's state is stored under
_TMP = ".tmp-"

# What a future whose answer a checkpoint dropped fails with (journal.py: answers are
# kept for one checkpoint interval).
EXPIRED = (
    "this request's answer expired: the tinker journal keeps answers for one checkpoint "
    "interval ([tinker] journal_checkpoint_every optim_steps), and it was answered before "
    "the last two checkpoints"
)


@dataclass
class ModelCopy:
    """One training model as a checkpoint holds it."""

    model: TrainingModel  # the registry's (its steps: what a retried optim_step checks)
    lora: tuple[int, bool, bool, bool]  # rank, attn, mlp, unembed
    steps: int  # the adapter's own count, which save_state records
    tensors: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    grads: dict[str, torch.Tensor]


@dataclass
class Captured:
    """The whole state a replay would rebuild, after every record up to `covers`."""

    covers: int
    base_model: str
    sessions: dict[str, list[str]]
    models: list[ModelCopy]
    samplers: list[SamplingSession]
    snapshots: dict[str, tuple[str, dict[str, torch.Tensor]]]  # key -> (model id, tensors)
    entries: list[Entry]
    keys: dict[str, tuple[str, str, int]]


def copy_models(
    model: AdapterModel, models: list[TrainingModel], engine_snapshots: dict[str, Path] | None
) -> tuple[list[ModelCopy], dict[str, dict[str, torch.Tensor]]]:
    """On the model thread: copies of every model's state (state.py's export, and the
    gradients) and of every sampler snapshot's tensors (with engines, read back from the
    adapter directories they were given: `engine_snapshots`, key -> directory)."""
    copies = []
    for m in models:
        tensors, optimizer, steps = model.export_state(m.model_id)
        grads = model.gradients(m.model_id)
        lora = model.lora_shape(m.model_id)
        copies.append(ModelCopy(dataclasses.replace(m), lora, steps, tensors, optimizer, grads))
    if engine_snapshots is None:
        return copies, model.snapshots()
    from safetensors.torch import load_file

    return copies, {
        key: load_file(directory / "adapter_model.safetensors")
        for key, directory in engine_snapshots.items()
    }


def restore_models(model: AdapterModel, captured: Captured, in_process_snapshots: bool) -> None:
    """On the model thread: every model's adapter, AdamW state, steps and gradients back
    (and the sampler snapshots, when sampling runs in this process)."""
    for m in captured.models:
        rank, attn, mlp, unembed = m.lora
        # The seed is moot: import_state overwrites every initial value.
        model.add_adapter(m.model.model_id, rank, 0, attn, mlp, unembed)
        model.import_state(m.model.model_id, m.tensors, m.optimizer, m.steps)
        model.set_gradients(m.model.model_id, m.grads)
    if in_process_snapshots:
        for key, (model_id, tensors) in captured.snapshots.items():
            model.import_snapshot(model_id, key, tensors)


class CheckpointStore:
    """The checkpoint directories of one journal stream (`<checkpoint_dir>/<stream>/`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        if root.is_dir():  # what a crash mid-write left behind
            for d in root.glob(f"{_TMP}*"):
                shutil.rmtree(d, ignore_errors=True)

    @staticmethod
    def name(covers: int) -> str:
        return f"{covers:012d}"

    def write(self, captured: Captured) -> Checkpoint:
        """Write `captured` whole (temporary directory, sync, rename); its record."""
        from safetensors.torch import save_file

        from services.tinker.state import StateMeta, StateStore

        tmp = self.root / f"{_TMP}{uuid.uuid4().hex}"
        (tmp / "grads").mkdir(parents=True)
        (tmp / "snapshots").mkdir()
        store = StateStore(tmp / "models")
        models = []
        for i, m in enumerate(captured.models):
            rank, attn, mlp, unembed = m.lora
            meta = StateMeta(captured.base_model, rank, attn, mlp, unembed, m.steps, time.time())
            store.save(m.model.model_id, STATE_NAME, meta, m.tensors, m.optimizer, False)
            if m.grads:
                save_file(_contiguous(m.grads), tmp / "grads" / f"{i}.safetensors")
            models.append({**dataclasses.asdict(m.model), "grads": bool(m.grads)})
        snapshots = []
        for i, (key, (model_id, tensors)) in enumerate(captured.snapshots.items()):
            save_file(_contiguous(tensors), tmp / "snapshots" / f"{i}.safetensors")
            snapshots.append({"key": key, "model_id": model_id, "file": f"{i}.safetensors"})
        state = {
            "v": VERSION,
            "covers": captured.covers,
            "base_model": captured.base_model,
            "sessions": captured.sessions,
            "models": models,
            "samplers": [dataclasses.asdict(s) for s in captured.samplers],
            "snapshots": snapshots,
            "entries": [_entry(e) for e in captured.entries],
            "keys": [[rid, *key] for rid, key in captured.keys.items()],
        }
        (tmp / "state.msgpack").write_bytes(msgpack.packb(state, use_bin_type=True))
        files = sorted(f for f in tmp.rglob("*") if f.is_file())
        manifest = {str(f.relative_to(tmp)): [f.stat().st_size, _sha256(f)] for f in files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for f in [*files, tmp / MANIFEST]:
            fsync_path(f)
        fsync_path(tmp)
        final = self.root / self.name(captured.covers)
        shutil.rmtree(final, ignore_errors=True)  # a checkpoint written but never recorded
        tmp.rename(final)
        fsync_path(self.root)
        return Checkpoint(final.name, captured.covers)

    def why_not_whole(self, cp: Checkpoint) -> str | None:
        """None if `cp`'s directory is whole; else what is wrong with it."""
        d = self.root / cp.directory
        if not (d / MANIFEST).is_file():
            return f"{d} is missing" if not d.exists() else f"{d} has no {MANIFEST}"
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except ValueError as e:
            return f"{d / MANIFEST} is not JSON ({e})"
        for rel, (size, digest) in manifest.items():
            f = d / rel
            if not f.is_file():
                return f"{f} is missing"
            if f.stat().st_size != size or _sha256(f) != digest:
                return f"{f} is not the file that was written (size or sha256 differ)"
        return None

    def read(self, cp: Checkpoint) -> Captured:
        """The state in a whole checkpoint directory."""
        from safetensors.torch import load_file

        from services.tinker.state import StateStore

        d = self.root / cp.directory
        state = msgpack.unpackb((d / "state.msgpack").read_bytes(), raw=False)
        if state.get("v") != VERSION:
            raise JournalCorrupt(f"checkpoint {d} has version {state.get('v')!r}; "
                                 f"this server reads {VERSION}")  # fmt: skip
        store = StateStore(d / "models")
        models = []
        for i, m in enumerate(state["models"]):
            has_grads = m.pop("grads")
            model = TrainingModel(**m)
            meta, tensors, optimizer = store.load(model.model_id, STATE_NAME, True)
            assert optimizer is not None
            grads = load_file(d / "grads" / f"{i}.safetensors") if has_grads else {}
            lora = (meta.rank, meta.train_attn, meta.train_mlp, meta.train_unembed)
            models.append(ModelCopy(model, lora, meta.steps, tensors, optimizer, grads))
        snapshots = {
            s["key"]: (s["model_id"], load_file(d / "snapshots" / s["file"]))
            for s in state["snapshots"]
        }
        return Captured(
            covers=int(state["covers"]),
            base_model=str(state["base_model"]),
            sessions={k: list(v) for k, v in state["sessions"].items()},
            models=models,
            samplers=[SamplingSession(**s) for s in state["samplers"]],
            snapshots=snapshots,
            entries=[_unentry(e) for e in state["entries"]],
            keys={rid: (owner, kind, int(seq)) for rid, owner, kind, seq in state["keys"]},
        )

    def remove_before(self, covers: int) -> None:
        """Delete the directories of checkpoints older than the one covering `covers`."""
        for d in self.root.iterdir() if self.root.is_dir() else []:
            if d.name.isdigit() and int(d.name) < covers:
                shutil.rmtree(d, ignore_errors=True)


def _entry(e: Entry) -> dict[str, Any]:
    return {
        "id": e.request_id,
        "kind": e.kind,
        "owner": e.owner,
        "state": e.state.value,
        "result": e.result,
        "error": e.error,
        "category": e.category.value,
    }


def _unentry(d: dict[str, Any]) -> Entry:
    return Entry(
        request_id=d["id"],
        kind=d["kind"],
        owner=d["owner"],
        state=State(d["state"]),
        result=d["result"],
        error=d["error"],
        category=Category(d["category"]),
    )


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in tensors.items()}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
