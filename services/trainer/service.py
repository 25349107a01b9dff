"""The RL trainer service: TrainBatches in stream order → optimizer steps → weights out.

    python -m services.trainer -c run.toml                       # one process
    torchrun --nproc_per_node=2 -m services.trainer -c run.toml  # FSDP2

Rank 0 does all NATS I/O and hands each batch to the other ranks as bytes
(a length, then a uint8 tensor: no pickle). Every rank then runs the same
step. The loop, as the algorithm reads:

    batch = next batch in stream order          (rank 0; then broadcast)
    metrics = trainer.train_step(batch)
    every publish_every steps:
        save weights → <weights_root>/<run>/v000012/ (atomic, sha256 manifest)
        checkpoint (model, optimizer, schedule, RNG, stream position)
        publish WeightsPublished                (rank 0)

Position. The checkpoint records the stream sequence of the last batch
trained; on restart the trainer reads from the next one, so no batch is
trained twice and none is skipped, whatever the consumer's ack state. The
checkpoint is written before the weights are announced, so a restart never
announces a version whose weights it then trains again; a version that was
saved and checkpointed but not yet announced is announced at start-up.

Overlap. In one process, saving is not on the critical path: the step's
state is copied out (a `Snapshot`, ~1 ms for the demo model) and step N's
weights, checkpoint, announcement, evaluation and metrics row are done
while step N+1 trains; step N+2 waits for them. The order above, per step,
is unchanged. Under FSDP2 the saving is a collective and stays in the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.chunking import Reassembler
from proto.codec import decode, encode
from proto.errors import ProtocolError
from proto.messages import TrainBatch as WireBatch
from proto.messages import WeightsPublished
from proto.streams import stream_name, weights_nats_uri
from proto.subjects import Subjects
from services.common.errors import FlywheelError
from services.common.lifecycle import ServiceContext
from services.common.msgloop import REASON_HEADER, dead_letter
from services.common.publish import publish
from services.trainer.checkpoint import (
    Snapshot,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    snapshot,
)
from services.trainer.distributed import DistInfo
from services.trainer.heldout import HeldOut, eval_line, reward_parts
from services.trainer.loggers import open_loggers
from services.trainer.service_settings import TrainerSettings
from services.trainer.trainer import Trainer
from services.trainer.wire import batch_stats, to_core_batch

log = logging.getLogger(__name__)

STOP = -1  # broadcast length that tells the other ranks to stop


class BatchStreamError(FlywheelError, RuntimeError):
    """The batch stream skips a step: training it would break the run's order."""


def version_dir(root: Path, run: str, version: int) -> Path:
    return root / run / f"v{version:06d}"


# ── rank 0 → all ranks ───────────────────────────────────────────────────────
def broadcast_bytes(data: bytes | None, info: DistInfo) -> bytes | None:
    """Rank 0's `data` on every rank (None = stop). Plain tensors, no pickle."""
    if not info.distributed:
        return data
    import torch.distributed as dist

    dev = info.device if dist.get_backend() == "nccl" else torch.device("cpu")
    n = torch.tensor([STOP if data is None else len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(n, src=0)
    size = int(n.item())
    if size == STOP:
        return None
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        if info.is_main and data is not None
        else torch.empty(size, dtype=torch.uint8, device=dev)
    )
    dist.broadcast(buf, src=0)
    return data if info.is_main else bytes(buf.cpu().numpy().tobytes())


# ── one step, on every rank ──────────────────────────────────────────────────
@dataclass
class StepResult:
    metrics: dict[str, float]
    step: int  # the trainer's step after this batch (= the weight version it publishes)
    published: Path | None = None  # the new weights directory, if this step published
    sha256: str = ""
    size_bytes: int = 0
    compute_s: float = 0.0
    publish_s: float = 0.0  # saving weights + checkpoint (overlapped with the next step: 1 rank)


def compute_one(trainer: Trainer, batch: WireBatch) -> StepResult:
    """One optimizer step on `batch`; the weight version follows the step."""
    started = time.perf_counter()
    metrics = trainer.train_step(to_core_batch(batch))
    trainer.weight_version = trainer.step
    return StepResult(metrics, trainer.step, compute_s=time.perf_counter() - started)


def publish_due(trainer: Trainer, s: TrainerSettings) -> bool:
    return trainer.step % s.publish_every == 0


def persist(
    trainer: Trainer, s: TrainerSettings, batch: WireBatch, seq: int, r: StepResult,
    snap: Snapshot | None = None,
) -> None:  # fmt: skip
    """Save step `r.step`'s weights directory, then its checkpoint (which records `seq`).

    The weights come first: a checkpoint never names a version whose
    directory is missing. From `snap` (one process) while the next step
    trains; otherwise from the live trainer, on every rank in step.
    """
    t = time.perf_counter()
    out = version_dir(s.weights_root, s.run, r.step)
    manifest = trainer.save_weights(out, overwrite=True, state_dict=snap.weights if snap else None)
    save_checkpoint(trainer, s.checkpoint_dir, {"seq": seq, "batch_id": batch.batch_id}, snap)
    if trainer.info.is_main:
        prune_checkpoints(s.checkpoint_dir, s.keep_checkpoints)
    r.published = out
    if manifest is not None:
        r.sha256, r.size_bytes = manifest.sha256, manifest.total_bytes
    r.publish_s = time.perf_counter() - t


def train_one(trainer: Trainer, s: TrainerSettings, batch: WireBatch, seq: int) -> StepResult:
    """Train `batch` (stream sequence `seq`) and, when due, save weights + checkpoint."""
    r = compute_one(trainer, batch)
    if publish_due(trainer, s):
        persist(trainer, s, batch, seq, r)
    return r


def prune_checkpoints(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=False)


def follower_loop(trainer: Trainer, s: TrainerSettings) -> None:
    """Ranks > 0: train whatever rank 0 broadcasts until it says stop."""
    while (data := broadcast_bytes(None, trainer.info)) is not None:
        batch = decode(data, WireBatch)
        train_one(trainer, s, batch, seq=-1)


# ── rank 0: reading batches ──────────────────────────────────────────────────
class BatchReader:
    """TrainBatches in stream order from `start_seq`, reassembled, validated, gap-checked."""

    def __init__(self, ctx: ServiceContext, run: str, start_seq: int) -> None:
        self.ctx = ctx
        self.run = run
        self.start_seq = max(1, start_seq)
        self.subjects = Subjects(run)
        self.reassembler = Reassembler()
        self.sub: Any = None

    async def open(self) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        cfg = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self.start_seq,
            ack_policy=AckPolicy.EXPLICIT,
            inactive_threshold=300.0,
            max_ack_pending=64,
        )
        self.sub = await self.ctx.js.pull_subscribe(
            self.subjects.batches, durable=None, stream=stream_name(self.run, "BATCHES"), config=cfg
        )

    async def next(self, step: int, stop: asyncio.Event) -> tuple[WireBatch, int] | None:
        """The batch for `step` and its (last) stream sequence; None once stopped."""
        from nats.errors import ConnectionClosedError
        from nats.errors import TimeoutError as NatsTimeout

        from services.common.msgloop import transient_errors

        while not stop.is_set():
            try:
                msgs = await self.sub.fetch(1, timeout=1.0)
            except (TimeoutError, NatsTimeout):
                continue
            except ConnectionClosedError:
                raise  # final (reconnecting is not): nothing more will come
            except transient_errors() as e:
                # NATS restarting: JetStream answers 503 while it recovers its streams
                # (found by the chaos suite); as the message loop does, retry.
                log.warning("trainer: fetch failed (%s: %s)", type(e).__name__, e)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                continue
            msg = msgs[0]
            await msg.ack()
            try:
                whole = self.reassembler.feed(msg.data)
                if whole is None:
                    continue
                batch = decode(whole, WireBatch)
            except ProtocolError as e:
                await self._dead_letter(msg, e)
                continue
            if batch.step < step:
                log.info("trainer: skipping batch %d (already trained)", batch.step)
                continue
            if batch.step > step:
                raise BatchStreamError(f"expected batch {step}, the stream has {batch.step}")
            return batch, msg.metadata.sequence.stream
        return None

    async def close(self) -> None:
        """Unsubscribe (a pull subscription left open makes the connection's drain hang)."""
        if self.sub is not None:
            await self.sub.unsubscribe()
            self.sub = None

    async def _dead_letter(self, msg: Any, e: ProtocolError) -> None:
        meta = msg.metadata
        _, data = dead_letter(
            run=self.run, reason=e.reason, error=str(e), subject=msg.subject, payload=msg.data,
            service="trainer", delivered=meta.num_delivered, max_payload=self.ctx.max_payload,
            where=f"stream {meta.stream} seq {meta.sequence.stream}",
        )  # fmt: skip
        log.warning("trainer: dead-lettering batch-stream message %d: %s", meta.sequence.stream, e)
        await self.ctx.js.publish(
            self.subjects.dlq(e.reason),
            data,
            headers={REASON_HEADER: e.reason, "Nats-Msg-Id": f"dlq:trainer:{meta.sequence.stream}"},
        )


# ── metrics ──────────────────────────────────────────────────────────────────
GAUGES = {
    "loss": "Policy loss of the last step.",
    "reward_mean": "Mean reward of the last batch.",
    "kl_ref": "KL to the reference model (configured estimator), last step.",
    "approx_kl": "Approximate KL between the policy and the old policy.",
    "entropy": "Mean token entropy of the last step.",
    "clip_frac_low": "Fraction of tokens clipped below.",
    "clip_frac_high": "Fraction of tokens clipped above.",
    "ratio": "Mean importance ratio.",
    "ratio_max": "Max importance ratio.",
    "grad_norm": "Gradient norm before clipping.",
    "lr": "Learning rate of the last step.",
    "staleness_max": "Largest step − sample version in the last batch.",
    "response_tokens_mean": "Mean response length of the last batch.",
    "eval_accuracy": "Held-out greedy pass@1 through the task's reward (last evaluation).",
    "eval_pass_at_k": "Held-out sampled pass@k (eval.k > 1; last evaluation).",
}


class TrainerMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.gauges = {
            k: Gauge(f"flywheel_trainer_{k}", doc, registry=r) for k, doc in GAUGES.items()
        }
        self.step = Gauge("flywheel_trainer_step", "Optimizer steps done.", registry=r)
        self.version = Gauge("flywheel_trainer_weight_version", "Newest version.", registry=r)
        self.phase = Counter(
            "flywheel_trainer_phase_seconds",
            "Wall time by phase: waiting for data, compute, publishing (saving), upload (NATS).",
            ["phase"], registry=r,
        )  # fmt: skip
        self.step_seconds = Histogram(
            "flywheel_trainer_step_seconds", "Compute time of one optimizer step.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300), registry=r,
        )  # fmt: skip
        self.tokens = Counter("flywheel_trainer_tokens", "Tokens trained on.", registry=r)
        self.reward_part = Gauge(
            "flywheel_trainer_reward_part", "Mean of each reward part over the last batch.",
            ["part"], registry=r,
        )  # fmt: skip
        self.upload_bytes = Counter(
            "flywheel_trainer_weights_upload_bytes", "Weight bytes sent over NATS.", registry=r
        )
        self.samples = Counter("flywheel_trainer_samples", "Samples trained on.", registry=r)
        self.tokens_per_s = Gauge(
            "flywheel_trainer_tokens_per_second", "Compute tokens/s of the last step.", registry=r
        )
        self.idle = Gauge("flywheel_trainer_idle_fraction",
                          "Fraction of wall time spent waiting for data since start.",
                          registry=r)  # fmt: skip


# ── the service body (rank 0) ────────────────────────────────────────────────
class TrainerService:
    def __init__(self, ctx: ServiceContext, s: TrainerSettings, trainer: Trainer, seq: int):
        self.ctx, self.s, self.trainer = ctx, s, trainer
        self.subjects = Subjects(s.run)
        self.metrics = TrainerMetrics(ctx.registry)
        self.reader = BatchReader(ctx, s.run, seq + 1)
        self.waited = 0.0
        self.busy = 0.0
        self.started = time.time()
        self.finishing: asyncio.Task[None] | None = None
        self.heldout = HeldOut(s)  # its rows load now: a missing split fails at start-up
        self.loggers = open_loggers(
            s.loggers,
            run=s.run,
            metrics_file=s.metrics_file,
            log_dir=s.log_dir,
            wandb_project=s.wandb_project,
            wandb_mode=s.wandb_mode,
            config=s.model_dump(mode="json", include={"loss", "optim", "runtime", "model"}),
        )

    async def announce(self, version: int, path: Path, sha256: str, size: int) -> None:
        """Announce a saved version; over NATS, its chunks are all stored first."""
        uri = path.resolve().as_uri()
        if self.s.weights_transport == "nats":
            from services.common.weights_nats import upload

            sent = await upload(
                self.ctx.js, self.s.run, version, path, max_payload=self.ctx.max_payload,
                window=self.s.weights_upload_window,
            )  # fmt: skip
            self.metrics.upload_bytes.inc(sent.bytes)
            self.metrics.phase.labels(phase="upload").inc(sent.seconds)
            log.info(
                "trainer: v%d sent over NATS: %d chunks, %.1f MB in %.2fs (%.0f MB/s)",
                version, sent.chunks, sent.bytes / 1e6, sent.seconds, sent.mb_per_s,
            )  # fmt: skip
            uri = weights_nats_uri(self.s.run, version)
        msg = WeightsPublished(
            run=self.s.run, version=version, step=version,
            uri=uri, sha256=sha256, size_bytes=size, published_at=time.time(),
        )  # fmt: skip
        await publish(self.ctx.js, self.subjects.weights_published, msg, self.ctx.max_payload)
        log.info("trainer: published v%d (%s)", version, path)

    async def announce_pending(self) -> None:
        """After a restart: announce the checkpointed version if it never was."""
        from services.common.weights import WeightsError, read_manifest

        v = self.trainer.weight_version
        if v == 0:
            return
        path = version_dir(self.s.weights_root, self.s.run, v)
        try:
            m = read_manifest(path)
        except WeightsError as e:
            log.warning("trainer: cannot re-announce v%d: %s", v, e)
            return
        await self.announce(v, path, m.sha256, m.total_bytes)  # same id: stored once

    def record(self, batch: WireBatch, r: StepResult, waited: float) -> dict[str, Any]:
        stats = batch_stats(batch)
        parts = reward_parts(batch)
        row: dict[str, Any] = {
            "step": r.step, "batch_id": batch.batch_id, "time": time.time(),
            "elapsed": time.time() - self.started, **stats, **parts, **r.metrics,
            "wait_s": waited, "compute_s": r.compute_s, "publish_s": r.publish_s,
        }  # fmt: skip
        for name, v in parts.items():
            self.metrics.reward_part.labels(part=name.removeprefix("reward/")).set(v)
        for k, g in self.metrics.gauges.items():
            if k in row:
                g.set(float(row[k]))
        m = self.metrics
        m.step.set(r.step)
        m.version.set(r.step)
        m.phase.labels(phase="wait").inc(waited)
        m.phase.labels(phase="compute").inc(r.compute_s)
        m.phase.labels(phase="publish").inc(r.publish_s)
        m.step_seconds.observe(r.compute_s)
        m.tokens.inc(stats["tokens"])
        m.samples.inc(stats["samples"])
        m.tokens_per_s.set(stats["tokens"] / max(r.compute_s, 1e-9))
        m.idle.set(self.waited / max(self.waited + self.busy, 1e-9))
        row["idle_fraction"] = self.waited / max(self.waited + self.busy, 1e-9)
        return row

    async def evaluate(self, path: Path, row: dict[str, Any]) -> None:
        """The held-out evaluation of `path` into `row` and the gauges."""
        report = await self.heldout.run(path)
        row.update(report.metrics())
        self.metrics.gauges["eval_accuracy"].set(report.pass_at_1)
        if report.pass_at_k is not None:
            self.metrics.gauges["eval_pass_at_k"].set(report.pass_at_k)

    def write_row(self, row: dict[str, Any]) -> None:
        # metrics_file (jsonl), TensorBoard, W&B: services/trainer/loggers.py
        self.loggers.write(row)

    def reconcile_rows(self) -> None:
        """Make the metrics file agree with the checkpoint we resumed from.

        A row is appended after its step's checkpoint, so a crash between the
        two leaves the checkpointed step without a row; rows of steps after
        the checkpoint (publish_every > 1) describe training that died with
        the process and is done again. Both would break the file's contract
        of one row per trained step, in order (tests/chaos checks it): drop
        rows past the checkpoint, and add a `recovered` row for its step.
        """
        path = self.s.metrics_file
        ckpt = latest_checkpoint(self.s.checkpoint_dir)
        if path is None or ckpt is None or not path.is_file():
            return
        doc = json.loads((ckpt / "trainer-state.json").read_text())
        step, batch_id = int(doc["step"]), doc["input_position"].get("batch_id")
        lines = path.read_text().splitlines()
        rows = [(ln, _json_row(ln)) for ln in lines]
        # An unparsable line is a row cut by the crash itself: dropped too.
        keep = [ln for ln, r in rows if r is not None and int(r.get("step", 0)) <= step]
        if batch_id and not any((_json_row(ln) or {}).get("batch_id") == batch_id for ln in keep):
            row = {"step": step, "batch_id": batch_id, "time": time.time(), "recovered": True}
            keep.append(json.dumps(row))
            log.warning("trainer: metrics row of step %d was lost in a crash; recovered", step)
        if keep != lines:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            tmp.replace(path)

    async def run(self) -> None:
        self.reconcile_rows()
        await self.reader.open()
        try:
            async with self.heldout:
                await self._run()
        finally:
            await self.reader.close()
            self.loggers.close()

    async def _run(self) -> None:
        await self.announce_pending()
        if self.s.eval_every and self.trainer.step == 0:
            row: dict[str, Any] = {"step": 0, "time": time.time(), "elapsed": 0.0}
            await self.evaluate(self.s.model, row)
            self.write_row(row)
            log.info("trainer: held-out evaluation at start:%s", eval_line(row))
        self.ctx.readiness.ok("trainer")
        try:
            await self._loop()
        finally:
            await self._settle()

    async def _loop(self) -> None:
        """Wait for a batch, train it, and hand its publishing to `_finish`.

        The trainer computes step N+1 while step N's weights and checkpoint
        are written, announced and evaluated (one step of overlap: the next
        step's finish starts only once the previous one is done). Under
        FSDP2 the saving is a collective done inside the step; only the
        announcing overlaps.
        """
        while not self.ctx.stop.is_set():
            if self.s.max_steps is not None and self.trainer.step >= self.s.max_steps:
                log.info("trainer: reached max_steps=%d", self.s.max_steps)
                break
            t = time.perf_counter()
            got = await self.reader.next(self.trainer.step, self.ctx.stop)
            if got is None:
                break
            batch, seq = got
            waited = time.perf_counter() - t
            data = encode(batch, max_payload=None)
            r, snap = await asyncio.to_thread(self._step, data, batch, seq)
            await self._settle()  # the previous step's finish ran alongside this compute
            self.waited += waited
            self.busy += time.perf_counter() - t - waited
            self.finishing = asyncio.create_task(self._finish(batch, seq, r, snap, waited))

    async def _settle(self) -> None:
        """Wait for the step being finished, if any (its errors surface here)."""
        task, self.finishing = self.finishing, None
        if task is not None:
            await task

    async def _finish(
        self, batch: WireBatch, seq: int, r: StepResult, snap: Snapshot | None, waited: float
    ) -> None:
        """Save (from the snapshot), announce, evaluate and log step `r.step`, in that order.

        The metrics row comes last: a row means the step is checkpointed
        (reconcile_rows relies on it after a crash).
        """
        if snap is not None:
            await asyncio.to_thread(persist, self.trainer, self.s, batch, seq, r, snap)
        row = self.record(batch, r, waited)
        if r.published is not None:
            await self.announce(r.step, r.published, r.sha256, r.size_bytes)
            if self.s.eval_every and r.step % self.s.eval_every == 0:
                await self.evaluate(r.published, row)
        self.write_row(row)
        log.info(
            "trainer: step %d loss %.4f reward %.3f wait %.2fs compute %.2fs publish %.2fs%s",
            r.step, row.get("loss", float("nan")), row["reward_mean"], waited, r.compute_s,
            r.publish_s, eval_line(row),
        )  # fmt: skip

    def _step(self, data: bytes, batch: WireBatch, seq: int) -> tuple[StepResult, Snapshot | None]:
        """Train (every rank); when due, snapshot for `_finish` to write, or save in step."""
        broadcast_bytes(data, self.trainer.info)
        if self.trainer.info.world_size > 1:  # saving is a collective: in step, every rank
            return train_one(self.trainer, self.s, batch, seq), None
        r = compute_one(self.trainer, batch)
        return r, snapshot(self.trainer) if publish_due(self.trainer, self.s) else None


def _json_row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def make_body(trainer: Trainer, seq: int):
    async def body(ctx: ServiceContext) -> None:
        settings = ctx.settings
        assert isinstance(settings, TrainerSettings)
        try:
            await TrainerService(ctx, settings, trainer, seq).run()
        finally:
            with contextlib.suppress(RuntimeError):  # followers may already be gone
                broadcast_bytes(None, trainer.info)

    return body


def load_trainer(s: TrainerSettings, info: DistInfo) -> tuple[Trainer, int]:
    """The trainer, restored from the newest checkpoint if any, and its stream position."""
    trainer = Trainer.from_pretrained(s.model, s.train_config(), info)
    seq = 0
    ckpt = latest_checkpoint(s.checkpoint_dir)
    if ckpt is not None:
        pos = load_checkpoint(trainer, ckpt)
        seq = int(pos.get("seq", 0))
        log.info("trainer: resumed from %s (step %d, stream seq %d)", ckpt, trainer.step, seq)
    return trainer, seq
