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
        # flat groups, the curriculum, collapse made visible (docs/learning.md)
        self.flat_share = m.gauge(
            "flat_share",
            "Share of flat groups (every reward alike: zero advantage) among the groups "
            "received for the last step (the step being filled once it has a step's worth).",
        )
        self.distinct = m.gauge(
            "distinct_completions",
            "Mean distinct completions (response token sequences) per group, same groups.",
        )
        self.group_samples = m.gauge(
            "group_samples", "Mean samples per group, same groups (what distinct is out of)."
        )
        self.untrainable = m.gauge(
            "untrainable_groups",
            "Groups in a row that brought nothing trainable (0 once one does).",
        )
        self.stalls = m.counter(
            "stalls",
            "Stalls said in the console: [buffer] stall_warn_steps steps' worth of groups in a "
            "row with nothing trainable.",
        )
        self.refilled = m.counter(
            "refilled_groups",
            "Flat groups' batch slots refilled with a recent group that trained before "
            "([buffer] refill_max_share).",
        )
        self.rested = m.counter(
            "rested_prompts",
            "Prompts put to rest after a flat group ([buffer] flat_rest_steps).",
        )
        self.skipped = m.counter(
            "curriculum_skipped",
            "Dataset positions passed over by the curriculum, by reason (easy, hard, retired, "
            "resting).",
            ["reason"],
        )
        self.prompts = m.gauge(
            "curriculum_prompts",
            "Prompts seen, by difficulty (easy, normal, hard, retired) from their pass rates.",
            ["difficulty"],
        )
        # Every series exists from the start: a dashboard shows 0, not "no data".
        for d in ("easy", "normal", "hard", "retired"):
            self.prompts.labels(difficulty=d).set(0)
        for r in ("easy", "hard", "retired", "resting"):
            self.skipped.labels(reason=r)
