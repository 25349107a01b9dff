"""Sparse, lossless weight deltas: what changed between two published versions, and back.

Pure (no I/O): bytes in, bytes out. The transports (deltasync.py) read and
write the directories around it.

Why it pays: at RL learning rates most of Adam's updates fall below the
resolution of the published dtype (bf16: 8 significant bits), so between two
consecutive versions the bit pattern of > 99% of the elements is unchanged
(PULSE, arXiv 2602.03839). A delta records, per tensor of each safetensors
file, the positions of the elements whose bit pattern changed and their new
bit patterns; everything else is the base version's bytes.

Format of one delta (MessagePack, `FORMAT`):

    {"format", "version", "base_version", "base_sha256",  # the version it applies to
     "manifest": <the new version's flywheel-manifest.json text>,
     "files": [{"name", "whole": bytes | None,            # None: patch the base's file
                "tensors": [{"name", "mode", "index", "values"}]}]}

- A file listed in the new manifest but not in `files` is the base's file as is.
- `whole` carries a file that cannot be patched (not safetensors, a
  different header, i.e. other names, shapes, dtypes or offsets).
- Per tensor, `mode` is `sparse32` / `sparse64` (`index`: the changed
  elements' positions as gaps from the previous one, u32 / u64; `values`:
  new − old per changed element, wrapping, as unsigned integers of the
  dtype's width; each zlib-compressed after grouping its bytes by plane,
  see `_patch_tensor`) or `whole` (`values` is the tensor's new bytes).
  Elements are compared as unsigned integers of the dtype's width, so a
  NaN or -0.0 travels bit-exactly.

Exactness is checked where it matters, not assumed: the receiver's result
must match the new manifest's sha256 for every file (deltasync.py), and
anything else is a `DeltaError` that the caller answers with a full download.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from services.runtime.errors import FlywheelError

FORMAT = "flywheel-delta/1"
ZLEVEL = 1  # zlib's fastest: the byte planes are what makes it small (bench/sync_deltas.py)

# Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(FlywheelError, ValueError):
    """A delta that cannot be applied: malformed, or for another base than the one held."""


@dataclass(frozen=True)
class TensorPatch:
    name: str
    mode: str  # idx32 | idx64 | bitmap | whole
    index: bytes
    values: bytes


@dataclass(frozen=True)
class FilePatch:
    name: str
    whole: bytes | None = None
    tensors: tuple[TensorPatch, ...] = ()


@dataclass(frozen=True)
class DeltaStats:
    """Sizes of one version: its full bytes, the delta's, and the elements that changed."""

    full_bytes: int
    delta_bytes: int
    elements: int
    changed: int

    @property
    def fraction_changed(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def ratio(self) -> float:
        return self.delta_bytes / self.full_bytes if self.full_bytes else 0.0


@dataclass(frozen=True)
class Delta:
    version: int
    base_version: int
    base_sha256: str
    manifest: str  # the new version's manifest (JSON text, as the trainer wrote it)
    files: tuple[FilePatch, ...]


@dataclass(frozen=True)
class Layout:
    """A safetensors file's header: where its data starts and each tensor's (dtype, range)."""

    data_start: int
    header: bytes
    tensors: dict[str, tuple[str, int, int]]


def safetensors_layout(data: bytes | bytearray | memoryview) -> Layout | None:
    """The layout of a safetensors file, or None if `data` is not one we can patch."""
    if len(data) < 8:
        return None
    (n,) = struct.unpack_from("<Q", data, 0)
    if n <= 0 or 8 + n > len(data):
        return None
    header = bytes(data[8 : 8 + n])
    try:
        doc = json.loads(header)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    tensors: dict[str, tuple[str, int, int]] = {}
    for name, t in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, (begin, end) = str(t["dtype"]), t["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            return None
        size = DTYPE_BYTES.get(dtype)
        if size is None or not 0 <= begin <= end or (end - begin) % size:
            return None
        if 8 + n + end > len(data):
            return None
        tensors[name] = (dtype, 8 + n + begin, 8 + n + end)
    return Layout(8 + n, header, tensors)


def _uncovered_equal(old: bytes, new: bytes, layout: Layout) -> bool:
    """Whether the bytes of the data region that no tensor covers are equal (padding)."""
    pos = layout.data_start
    for _, begin, end in sorted(layout.tensors.values(), key=lambda t: t[1]):
        if begin > pos and old[pos:begin] != new[pos:begin]:
            return False
        pos = max(pos, end)
    return old[pos:] == new[pos:]


def _planes_z(a: np.ndarray) -> bytes:
    """zlib of a little-endian array's bytes grouped by byte plane (every element's low byte,
    then the next, ...): small integers leave the high planes all zero, nearly free."""
    little = a.astype(a.dtype.newbyteorder("<"), copy=False)
    planes = np.frombuffer(little.tobytes(), np.uint8).reshape(-1, a.itemsize).T
    return zlib.compress(planes.tobytes(), ZLEVEL)


def _unplanes_z(data: bytes, width: int, limit: int, what: str) -> np.ndarray:
    """The little-endian unsigned array `_planes_z` packed (at most `limit` elements)."""
    z = zlib.decompressobj()
    try:
        raw = z.decompress(data, limit * width + 1)
    except zlib.error as e:
        raise DeltaError(f"{what}: {e}") from e
    if len(raw) % width or len(raw) > limit * width or z.unconsumed_tail:
        raise DeltaError(f"{what}: {len(raw)} bytes do not make at most {limit} elements")
    planes = np.frombuffer(raw, np.uint8).reshape(width, -1)
    return np.frombuffer(planes.T.tobytes(), dtype=np.dtype(_UINT[width]).newbyteorder("<"))


def _patch_tensor(name: str, old: np.ndarray, new: np.ndarray) -> tuple[TensorPatch | None, int]:
    """The patch turning `old` into `new` (None if equal), and the elements changed.

    `sparse`: the changed positions as gaps from the previous one, and each
    new element as its (wrapping) difference from the old one, both
    compressed by byte plane. At RL learning rates a change is mostly one
    unit in the last place (a difference of ±1) a few dozen elements after
    the last one, so both compress to about a byte per change. `whole`
    when that would not be smaller than the tensor itself.
    """
    idx = np.flatnonzero(old != new)
    if idx.size == 0:
        return None, 0
    gaps = np.diff(idx, prepend=-1).astype(np.uint32 if new.size <= 1 << 32 else np.uint64)
    index = _planes_z(gaps)
    values = _planes_z(new[idx] - old[idx])  # unsigned: wraps, so any change round-trips
    if len(index) + len(values) >= new.nbytes:
        return TensorPatch(name, "whole", b"", new.tobytes()), int(idx.size)
    mode = "sparse32" if gaps.dtype == np.uint32 else "sparse64"
    return TensorPatch(name, mode, index, values), int(idx.size)


def _view(data: bytes | bytearray, dtype: str, begin: int, end: int) -> np.ndarray:
    width = DTYPE_BYTES[dtype]
    return np.frombuffer(data, dtype=_UINT[width], count=(end - begin) // width, offset=begin)


def diff_file(name: str, old: bytes, new: bytes) -> tuple[FilePatch, int, int]:
    """The patch of one file, with (elements compared, elements changed)."""
    lo, ln = safetensors_layout(old), safetensors_layout(new)
    patchable = (
        lo is not None
        and ln is not None
        and len(old) == len(new)
        and lo.header == ln.header
        and _uncovered_equal(old, new, ln)
    )
    if not patchable:
        return FilePatch(name, whole=new), 0, 0
    assert ln is not None
    patches: list[TensorPatch] = []
    elements = changed = 0
    for tname, (dtype, begin, end) in ln.tensors.items():
        a, b = _view(old, dtype, begin, end), _view(new, dtype, begin, end)
        patch, n = _patch_tensor(tname, a, b)
        elements += b.size
        changed += n
        if patch is not None:
            patches.append(patch)
    return FilePatch(name, tensors=tuple(patches)), elements, changed


def encode(
    base: Mapping[str, bytes],
    new: Mapping[str, bytes],
    *,
    version: int,
    base_version: int,
    base_sha256: str,
    manifest: str,
) -> tuple[bytes, DeltaStats]:
    """The packed delta from `base` to `new` (file name → bytes, manifest excluded)."""
    files: list[FilePatch] = []
    elements = changed = 0
    for name in sorted(new):
        old = base.get(name)
        if old is not None and old == new[name]:
            continue
        if old is None:
            files.append(FilePatch(name, whole=new[name]))
            continue
        patch, n, c = diff_file(name, old, new[name])
        elements, changed = elements + n, changed + c
        files.append(patch)
    packed = pack(Delta(version, base_version, base_sha256, manifest, tuple(files)))
    full = sum(len(b) for b in new.values()) + len(manifest.encode())
    return packed, DeltaStats(full, len(packed), elements, changed)


def pack(delta: Delta) -> bytes:
    files = [
        {"name": f.name, "whole": f.whole, "tensors": [vars(t) for t in f.tensors]}
        for f in delta.files
    ]
    doc = {
        "format": FORMAT,
        "version": delta.version,
        "base_version": delta.base_version,
        "base_sha256": delta.base_sha256,
        "manifest": delta.manifest,
        "files": files,
    }
    return msgpack.packb(doc, use_bin_type=True)


def unpack(data: bytes) -> Delta:
    """A packed delta; DeltaError if it is not one."""
    try:
        doc: Any = msgpack.unpackb(data, raw=False)
        if doc["format"] != FORMAT:
            raise DeltaError(f"unknown delta format {doc['format']!r}")
        files = tuple(
            FilePatch(
                str(f["name"]),
                None if f["whole"] is None else bytes(f["whole"]),
                tuple(
                    TensorPatch(str(t["name"]), str(t["mode"]), bytes(t["index"]), t["values"])
                    for t in f["tensors"]
                ),
            )
            for f in doc["files"]
        )
        return Delta(
            int(doc["version"]),
            int(doc["base_version"]),
            str(doc["base_sha256"]),
            str(doc["manifest"]),
            files,
        )
    except (msgpack.UnpackException, ValueError, KeyError, TypeError) as e:
        if isinstance(e, DeltaError):
            raise
        raise DeltaError(f"malformed delta: {e!r}") from e


def _apply_tensor(buf: bytearray, dtype: str, begin: int, end: int, t: TensorPatch) -> None:
    if t.mode == "whole":
        if len(t.values) != end - begin:
            raise DeltaError(f"tensor {t.name}: {len(t.values)} bytes for {end - begin}")
        buf[begin:end] = t.values
        return
    view = _view(buf, dtype, begin, end)  # writable: a view into the bytearray
    if t.mode not in ("sparse32", "sparse64"):
        raise DeltaError(f"tensor {t.name}: unknown mode {t.mode!r}")
    what = f"tensor {t.name}"
    gaps = _unplanes_z(t.index, 4 if t.mode == "sparse32" else 8, view.size, what)
    diffs = _unplanes_z(t.values, view.itemsize, view.size, what)
    if gaps.size != diffs.size or (gaps.size and int(gaps.min()) < 1):
        raise DeltaError(f"{what}: {gaps.size} positions, {diffs.size} values")
    idx = np.cumsum(gaps.astype(np.int64)) - 1
    if idx.size and int(idx[-1]) >= view.size:
        raise DeltaError(f"{what}: a position past its {view.size} elements")
    view[idx] = view[idx] + diffs.astype(view.dtype)


def apply_file(base: bytes | bytearray, patch: FilePatch) -> bytes | bytearray:
    """The new bytes of one file from the base's and its patch (a bytearray base: in place,
    so that a chain of deltas copies each file once)."""
    if patch.whole is not None:
        return patch.whole
    layout = safetensors_layout(base)
    if layout is None:
        raise DeltaError(f"{patch.name}: the base file is not safetensors")
    buf = base if isinstance(base, bytearray) else bytearray(base)
    for t in patch.tensors:
        where = layout.tensors.get(t.name)
        if where is None:
            raise DeltaError(f"{patch.name}: no tensor {t.name!r} in the base")
        _apply_tensor(buf, *where, t)
    return buf


def apply(base: Mapping[str, bytes | bytearray], delta: Delta) -> dict[str, bytes | bytearray]:
    """The new version's files (name → bytes) from the base's files and a delta (bytearrays
    in `base` are patched in place)."""
    try:
        names = [f["name"] for f in json.loads(delta.manifest)["files"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DeltaError(f"v{delta.version}: malformed manifest in the delta: {e!r}") from e
    patches = {f.name: f for f in delta.files}
    out: dict[str, bytes | bytearray] = {}
    for name in names:
        patch, old = patches.get(name), base.get(name)
        if patch is not None and patch.whole is not None:
            out[name] = patch.whole
        elif old is None:
            raise DeltaError(f"v{delta.version}: {name} is neither in the base nor the delta")
        else:
            out[name] = old if patch is None else apply_file(old, patch)
    return out
