"""What one weight version cost on the wire: carried by `WeightsPublished.wire` (optional)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WireCost(BaseModel):
    """Bytes and time of one published version, as the trainer's transport measured them."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=False)

    sent_bytes: int = Field(ge=0, description="Bytes put on the wire (NATS chunks, delta files).")
    delta_bytes: int | None = Field(
        None, ge=0, description="Bytes of the delta against the version before (None: no delta)."
    )
    changed_fraction: float | None = Field(
        None, ge=0, le=1, description="Fraction of elements whose published bits changed."
    )
    publish_s: float = Field(0.0, ge=0, description="Seconds to make the version reachable.")
