"""Sync's Prometheus metrics: versions per engine, update times and failures, publish→ready."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.runtime.metrics import SECONDS, MetricSet


class SyncMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        m = MetricSet(r, "flywheel_sync_")
        self.latency = m.histogram(
            "publish_to_ready_seconds", "From WeightsPublished to WeightsReady of that version."
        )
        self.update_seconds = m.histogram(
            "engine_update_seconds", "One engine's weight update.", SECONDS[:-1]
        )
        self.engine_version = m.gauge(
            "engine_version", "Weight version each engine serves.", ["engine"]
        )
        self.failures = m.counter("update_failures", "Failed engine updates.", ["engine"])
        self.bytes = m.counter("bytes", "Weight bytes loaded by engines.")
        self.engines = m.gauge("engines_live", "Engines with a recent heartbeat.")
        self.ready = m.gauge("ready_version", "Newest version announced ready.")
        self.published = m.gauge("published_version", "Newest published version.")
        self.awaiting = m.gauge(
            "engines_awaiting_download",
            "Engines behind only because their worker has not received the version over NATS.",
        )
