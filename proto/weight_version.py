"""A weight version: what it is, and every way it is written down. The one owner.

Weight version v is the policy after v optimizer steps: v = 0 is the initial
model; step s trains batch s (`TrainBatch.step`, from 0) and makes version
s + 1, which the trainer publishes. A sample records the versions its tokens
came from; staleness (services/buffer/core.py) compares them with the step a
group would train at.

One integer, written four ways, all of them here:

- on the wire, a non-negative int (`Version`, in every message that carries one);
- on disk, a directory named `v000012` (zero-padded so names sort like versions;
  services/weights/layout.py makes the paths);
- to an engine, a string: SGLang's `weight_version` is free text
  (`/update_weights_from_disk`, `meta_info`, `--weight-version`), so Flywheel
  sends the decimal number and reads back anything else ("default", the
  server's start-up label) as the initial weights, version 0;
- per token, spans: SGLang (>= 0.5.19) says which output tokens came from
  which version (`meta_info.weight_versions`), as `VersionSpan`s here.

This lives in proto/ because the wire needs the type and the spans, and
proto is the leaf every layer may import; everything here is pure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

Version = Annotated[int, Field(ge=0)]
"""A weight version on the wire: a non-negative int."""

INITIAL = 0
"""The weights a run starts from (before any optimizer step)."""


def after_steps(steps: int) -> int:
    """The version of the trainer's weights after `steps` optimizer steps: the same number."""
    return steps


# ── on disk ───────────────────────────────────────────────────────────────────
def dir_name(version: int) -> str:
    """`v000012`: zero-padded so that names sort like versions."""
    return f"v{version:06d}"


def parse_name(name: str) -> int | None:
    """The version a `v<digits>` name stands for, None for any other name: a directory
    (`v000012` → 12) or a WEIGHTDATA subject's last token (`v12`, proto/subjects.py)."""
    digits = name[1:]
    return int(digits) if name.startswith("v") and digits.isdigit() else None


# ── as a LoRA adapter's name on an engine ─────────────────────────────────────────
def adapter_name(version: int) -> str:
    """The name a version's LoRA adapter is loaded under (`/load_lora_adapter`'s
    `lora_name`, `/generate`'s `lora_path`): its directory name, `v000012`."""
    return dir_name(version)


def parse_adapter_name(name: str) -> int | None:
    """The version an adapter name stands for, None for a name Flywheel did not give."""
    return parse_name(name) if len(name) == 7 else None


# ── to and from an engine (SGLang's free-text weight_version) ───────────────────
def to_engine(version: int) -> str:
    """What Flywheel sends an engine as `weight_version`: the decimal number."""
    return str(version)


def from_engine(text: str | int | None) -> int:
    """An engine's `weight_version` as a version: a decimal number is that version;
    anything else (SGLang's "default", none at all) is the initial weights."""
    s = str(text) if text is not None else ""
    return int(s) if s.isdigit() else INITIAL


# ── per-token spans ─────────────────────────────────────────────────────────────
class VersionSpan(BaseModel):
    """Response tokens `[start, end)` were generated with weight version `version`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    version: Version
    start: int = Field(ge=0)
    end: int = Field(ge=0)


def spans_from_engine(raw: Iterable[Mapping[str, Any]] | None) -> tuple[VersionSpan, ...]:
    """SGLang's `meta_info.weight_versions` ([{version, start, end}]) as spans; () if absent."""
    return tuple(
        VersionSpan(version=from_engine(sp["version"]), start=int(sp["start"]), end=int(sp["end"]))
        for sp in raw or ()
    )
