"""Subjects, namespaced by run: `flywheel.<run>.<what>`.

Several runs can share one NATS: every subject and stream name carries the
run name, which is restricted to `[A-Za-z0-9_-]` so it is a single subject
token and a valid stream-name fragment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def check_token(value: str, what: str) -> str:
    if not TOKEN.match(value):
        raise ValueError(f"{what} {value!r} must match {TOKEN.pattern} (one subject token)")
    return value


@dataclass(frozen=True)
class Subjects:
    """All subjects of one run."""

    run: str

    def __post_init__(self) -> None:
        if not RUN_NAME.match(self.run):
            raise ValueError(f"run name {self.run!r} must match {RUN_NAME.pattern}")

    @property
    def prefix(self) -> str:
        return f"flywheel.{self.run}"

    @property
    def tasks(self) -> str:
        return f"{self.prefix}.tasks"

    @property
    def samples(self) -> str:
        return f"{self.prefix}.samples"

    @property
    def batches(self) -> str:
        return f"{self.prefix}.batches"

    @property
    def weights_published(self) -> str:
        return f"{self.prefix}.weights.published"

    @property
    def weights_ready(self) -> str:
        return f"{self.prefix}.weights.ready"

    @property
    def eval_requested(self) -> str:
        """EvalRequest, trainer -> sync (in WEIGHTS: `weights.>` takes it)."""
        return f"{self.prefix}.weights.evaluate"

    @property
    def eval_results(self) -> str:
        """EvalResult, sync -> trainer and whoever reads a run's evaluations."""
        return f"{self.prefix}.weights.evaluated"

    @property
    def weights_all(self) -> str:
        return f"{self.prefix}.weights.>"

    def weightdata(self, version: int) -> str:
        """Where the WeightsChunks of one version travel (NATS weights transport)."""
        if version < 0:
            raise ValueError(f"weight version {version} must be >= 0")
        return f"{self.prefix}.weightdata.v{version}"

    def weightdelta(self, version: int) -> str:
        """Where the delta into one version travels (NATS delta transport), beside its chunks."""
        if version < 0:
            raise ValueError(f"weight version {version} must be >= 0")
        return f"{self.prefix}.weightdata.d{version}"

    @property
    def weights_snapshot(self) -> str:
        """Core request/reply (no stream): a receiver asks the trainer for a full version."""
        return f"{self.prefix}.weightsnap"

    @property
    def weightdata_all(self) -> str:
        return f"{self.prefix}.weightdata.*"

    def heartbeat(self, engine_id: str) -> str:
        return f"{self.prefix}.engines.{check_token(engine_id, 'engine id')}"

    @property
    def heartbeats_all(self) -> str:
        return f"{self.prefix}.engines.*"

    def dlq(self, reason: str) -> str:
        return f"{self.prefix}.dlq.{check_token(reason, 'dead-letter reason')}"

    @property
    def dlq_all(self) -> str:
        return f"{self.prefix}.dlq.>"
