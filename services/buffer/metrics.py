"""The buffer's Prometheus metrics (the message loops add their own)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.runtime.metrics import MetricSet


class BufferMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricSet(registry, "flywheel_buffer_")
        self.dispatched = m.counter("tasks_dispatched", "Tasks published.")
        self.in_flight = m.gauge("tasks_in_flight", "Tasks awaiting a group.")
        self.groups = m.counter("groups", "Sample groups received, by verdict.", ["verdict"])
        self.group_tokens = m.counter(
            "group_tokens",
            "Response tokens of the groups received, by verdict (stale: generated, then wasted).",
            ["verdict"],
        )
        self.unscored_samples = m.counter(
            "unscored_samples",
            "Samples whose reward could not be computed (verifier timed out, crashed or "
            "raised): never trained on; their group trained on the rest or was dead-lettered.",
        )
        self.filter_rate = m.gauge(
            "filter_rate", "Learned share of groups the filters drop (admission over-samples it)."
        )
        self.staleness = m.histogram(
            "staleness_steps",
            "Steps between a group's weight version and the step it trains at.",
            (0, 1, 2, 3, 4, 6, 8, 16),
        )
        self.batches = m.counter("batches_published", "Train batches.")
        self.next_step = m.gauge("next_step", "Step of the next batch.")
        self.ready_version = m.gauge("ready_version", "Version every engine serves.")
        self.batches_ahead = m.gauge(
            "batches_ahead", "Batches published whose step is not yet trained into a ready version."
        )
        self.epoch = m.gauge("dataset_epoch", "Dataset epoch.")
        self.batch_fill = m.histogram(
            "batch_fill_seconds",
            "Time from a batch's first accepted group to its publication.",
            (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )
