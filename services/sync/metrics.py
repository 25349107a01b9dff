"""Sync's Prometheus metrics: versions per engine, update times and failures, publish→ready."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class SyncMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.latency = Histogram(
            "flywheel_sync_publish_to_ready_seconds",
            "From WeightsPublished to WeightsReady of that version.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )
        self.update_seconds = Histogram(
            "flywheel_sync_engine_update_seconds",
            "One engine's weight update.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
            registry=r,
        )
        self.engine_version = Gauge(
            "flywheel_sync_engine_version",
            "Weight version each engine serves.",
            ["engine"],
            registry=r,
        )
        self.failures = Counter(
            "flywheel_sync_update_failures", "Failed engine updates.", ["engine"], registry=r
        )
        self.bytes = Counter("flywheel_sync_bytes", "Weight bytes loaded by engines.", registry=r)
        self.engines = Gauge(
            "flywheel_sync_engines_live", "Engines with a recent heartbeat.", registry=r
        )
        self.ready = Gauge(
            "flywheel_sync_ready_version", "Newest version announced ready.", registry=r
        )
        self.published = Gauge(
            "flywheel_sync_published_version", "Newest published version.", registry=r
        )
        self.awaiting = Gauge(
            "flywheel_sync_engines_awaiting_download",
            "Engines behind only because their worker has not received the version over NATS.",
            registry=r,
        )
