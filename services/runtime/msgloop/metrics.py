"""The message loop's Prometheus metrics, once per registry."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from services.runtime.metrics import MetricSet

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


class LoopMetrics:
    """Handled, failed, dead-lettered and latency, labelled by service and subject.

    Every loop of a service (and its dead-letter publisher) shares them.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricSet(registry, "flywheel_")
        labels = ("service", "subject")
        self.handled = m.counter(
            "messages_handled", "Messages handled successfully (acked).", labels
        )
        self.failed = m.counter(
            "messages_failed",
            "Handler failures, by outcome reason (retryable failures are nak'ed).",
            (*labels, "reason"),
        )
        self.dead_lettered = m.counter(
            "messages_dead_lettered",
            "Messages sent to the dead-letter subject, by reason.",
            (*labels, "reason"),
        )
        self.latency = m.histogram(
            "handler_seconds",
            "Handler wall time per message.",
            (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900),
            labels,
        )

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> LoopMetrics:
        found = _METRICS.get(registry)
        if found is None:
            found = _METRICS[registry] = cls(registry)
        return found


# Prometheus refuses to register a metric name twice in one registry, so the
# loops of one service share one LoopMetrics; weak keys let a test's
# registries be collected.
_METRICS: weakref.WeakKeyDictionary[CollectorRegistry, LoopMetrics] = weakref.WeakKeyDictionary()
