"""Two weight versions compared: byte for byte, and tensor by tensor where the bytes differ.

A replay with the run's settings must give the run's weights bit for bit:
every `*.safetensors` file equal byte for byte is the verdict. Where a file
differs, the tensors say how: equal tensors (only the file's metadata
differs) or the tensors that changed and by how much (an ablation's
distance from the run, or where determinism broke).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class VersionDiff:
    """One version of the run against the same version of its replay."""

    version: int
    original: Path
    replayed: Path
    bytes_equal: bool = False
    tensors_equal: bool = False
    missing: str | None = None  # why there is nothing to compare
    # whose side has no weights: "run" (sync pruned it, or the run never wrote it: not
    # compared) or "replay" (the run has it and the replay did not write it: a failure)
    missing_in: str | None = None
    written: bool = False  # the replay wrote this version (whether or not the run kept it)
    differing: list[str] = field(default_factory=list)  # tensor names
    max_abs_diff: float = 0.0

    def line(self) -> str:
        v = f"v{self.version}"
        if self.missing is not None:
            return f"{v}: not compared ({self.missing})"
        if self.bytes_equal:
            return f"{v}: identical (every safetensors file equal byte for byte)"
        if self.tensors_equal:
            return f"{v}: tensors equal (the files' bytes differ: metadata)"
        names = ", ".join(self.differing[:3]) + (" …" if len(self.differing) > 3 else "")
        return (
            f"{v}: differs: {len(self.differing)} tensors (max |Δ| {self.max_abs_diff:.3g}: "
            f"{names})"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "version": self.version,
            "bytes_equal": self.bytes_equal,
            "tensors_equal": self.tensors_equal,
            "missing": self.missing,
            "missing_in": self.missing_in,
            "written": self.written,
            "differing": self.differing,
            "max_abs_diff": self.max_abs_diff,
        }


def files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.safetensors"))


def compare_version(version: int, original: Path, replayed: Path) -> VersionDiff:
    """`original` vs `replayed` (two version directories) as a VersionDiff."""
    diff = VersionDiff(version, original, replayed, written=bool(files(replayed)))
    if not files(original):
        diff.missing = f"the run's {original} has no safetensors (not kept, or never written)"
        diff.missing_in = "run"
        return diff
    if not files(replayed):
        diff.missing = f"the replay wrote no weights ({replayed} has no safetensors)"
        diff.missing_in = "replay"
        return diff
    if files(original) != files(replayed):
        diff.missing = f"different files: {files(original)} vs {files(replayed)}"
        return diff
    diff.bytes_equal = all(
        (original / f).read_bytes() == (replayed / f).read_bytes() for f in files(original)
    )
    if diff.bytes_equal:
        diff.tensors_equal = True
        return diff
    _compare_tensors(diff)
    return diff


def _compare_tensors(diff: VersionDiff) -> None:
    import torch
    from safetensors.torch import load_file

    for f in files(diff.original):
        a, b = load_file(diff.original / f), load_file(diff.replayed / f)
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b or a[name].shape != b[name].shape:
                diff.differing.append(name)
                continue
            if a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]):
                continue
            delta = (a[name].float() - b[name].float()).abs().max().item()
            diff.differing.append(name)
            diff.max_abs_diff = max(diff.max_abs_diff, float(delta))
    diff.tensors_equal = not diff.differing
