"""Declaring a service's Prometheus metrics: one line each, under the service's prefix.

    m = MetricSet(registry, "flywheel_buffer_")
    self.groups = m.counter("groups", "Sample groups received, by verdict.", ["verdict"])

The names the dashboards and alerts use (deploy/k8s) are the prefix plus
the short name; prometheus_client adds `_total` to counters on exposition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
"""Histogram buckets for durations from tens of milliseconds to minutes."""


class MetricSet:
    """Counters, gauges and histograms in one registry, named `<prefix><name>`."""

    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        self.registry = registry
        self.prefix = prefix

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        from prometheus_client import Counter

        return Counter(self.prefix + name, doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        from prometheus_client import Gauge

        return Gauge(self.prefix + name, doc, labels, registry=self.registry)

    def histogram(
        self, name: str, doc: str, buckets: Sequence[float] = SECONDS, labels: Sequence[str] = ()
    ) -> Histogram:
        from prometheus_client import Histogram

        return Histogram(self.prefix + name, doc, labels, registry=self.registry, buckets=buckets)
