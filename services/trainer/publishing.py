"""Publishing a trained version: saved, then reachable by its transport, then announced.

The checkpoint is written before the weights are announced, so a restart
never announces a version whose weights it then trains again; a version
that was saved and checkpointed but never announced (the process died in
between) is announced at start-up (`announce_pending`), under the same
message id, so JetStream stores it once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from proto.messages import WeightsPublished
from proto.subjects import Subjects
from proto.wirecost import WireCost
from services.runtime.lifecycle import ServiceContext
from services.runtime.publish import publish
from services.trainer.batches import Batch
from services.trainer.metrics import TrainerMetrics
from services.trainer.settings import TrainerSettings
from services.trainer.step import StepResult, persist
from services.trainer.trainer import Trainer
from services.weights import (
    Transfer,
    WeightsError,
    Wiring,
    open_transport,
    published_dir,
    read_manifest,
)
from services.weights.delta import DeltaStats

log = logging.getLogger(__name__)


def wire_cost(t: Transfer, d: DeltaStats | None) -> WireCost:
    return WireCost(
        sent_bytes=t.bytes,
        delta_bytes=d.delta_bytes if d is not None else None,
        changed_fraction=d.fraction_changed if d is not None else None,
        publish_s=t.seconds,
    )


class Publisher:
    """Rank 0's side of a version's way out: save it (from a snapshot), send it, announce it."""

    def __init__(
        self, ctx: ServiceContext, s: TrainerSettings, trainer: Trainer, metrics: TrainerMetrics
    ) -> None:
        self.ctx, self.s, self.trainer, self.metrics = ctx, s, trainer, metrics
        self.subjects = Subjects(s.run)
        wiring = Wiring(
            s.run,
            s.weights_root,
            ctx.js,
            ctx.nc,
            max_payload=ctx.max_payload,
            upload_window=s.weights_upload_window,
            snapshot_every=s.weights_snapshot_every,
        )
        self.transport = open_transport(s.weights_transport, wiring)

    async def save(self, batch: Batch, r: StepResult) -> None:
        """Write the step's weights and checkpoint from its snapshot (when it has one)."""
        if r.snapshot is not None:
            await asyncio.to_thread(persist, self.trainer, self.s, batch.wire, batch.seq, r)

    async def announce(self, version: int, path: Path, sha256: str, size: int) -> None:
        """Announce a saved version once its transport made it reachable."""
        if self.s.replay:  # a replay's versions are files only: no engine of the run hears
            return
        sent = await self.transport.publish(version, path)
        if sent.transfer is not None:
            self._sent(sent.transfer)
        self.metrics.weights_sent(sent, size)
        t, d = sent.transfer, sent.delta
        msg = WeightsPublished(
            run=self.s.run,
            version=version,
            step=version,
            uri=sent.uri,
            format="hf-safetensors" if self.trainer.adapter is None else "peft-lora",
            sha256=sha256,
            size_bytes=size,
            published_at=time.time(),
            wire=None if t is None else wire_cost(t, d),
        )
        await publish(self.ctx.js, self.subjects.weights_published, msg, self.ctx.max_payload)
        log.info("trainer: published v%d (%s)", version, path)

    def _sent(self, t: Transfer) -> None:
        self.metrics.upload_bytes.inc(t.bytes)
        self.metrics.phase.labels(phase="upload").inc(t.seconds)
        log.info(
            "trainer: v%d sent (%s): %d chunks, %.1f MB in %.2fs (%.0f MB/s)",
            t.version,
            self.transport.kind,
            t.chunks,
            t.bytes / 1e6,
            t.seconds,
            t.mb_per_s,
        )

    async def announce_pending(self) -> None:
        """After a restart: announce the checkpointed version if it never was."""
        v = self.trainer.weight_version
        if v == 0:
            return
        path = published_dir(self.s.weights_root, self.s.run, v)
        try:
            m = read_manifest(path)
        except WeightsError as e:
            log.warning("trainer: cannot re-announce v%d: %s", v, e)
            return
        await self.announce(v, path, m.sha256, m.total_bytes)  # same id: stored once
