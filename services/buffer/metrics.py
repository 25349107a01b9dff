"""The buffer's Prometheus metrics (the message loops add their own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class BufferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.dispatched = Counter(
            "flywheel_buffer_tasks_dispatched", "Tasks published.", registry=r
        )
        self.in_flight = Gauge(
            "flywheel_buffer_tasks_in_flight", "Tasks awaiting a group.", registry=r
        )
        self.groups = Counter(
            "flywheel_buffer_groups", "Sample groups received, by verdict.", ["verdict"], registry=r
        )
        self.staleness = Histogram(
            "flywheel_buffer_staleness_steps",
            "Steps between a group's weight version and the step it trains at.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
            registry=r,
        )
        self.batches = Counter("flywheel_buffer_batches_published", "Train batches.", registry=r)
        self.next_step = Gauge("flywheel_buffer_next_step", "Step of the next batch.", registry=r)
        self.ready_version = Gauge(
            "flywheel_buffer_ready_version", "Version every engine serves.", registry=r
        )
        self.batches_ahead = Gauge(
            "flywheel_buffer_batches_ahead",
            "Batches published whose step is not yet trained into a ready version.",
            registry=r,
        )
        self.epoch = Gauge("flywheel_buffer_dataset_epoch", "Dataset epoch.", registry=r)
        self.batch_fill = Histogram(
            "flywheel_buffer_batch_fill_seconds",
            "Time from a batch's first accepted group to its publication.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
