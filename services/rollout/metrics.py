"""The rollout worker's Prometheus metrics: groups, samples, rewards, engine and weights."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RolloutMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.groups = Counter("flywheel_rollout_groups", "Sample groups published.", registry=r)
        self.samples = Counter(
            "flywheel_rollout_samples",
            "Samples generated, by finish reason.",
            ["finish"],
            registry=r,
        )
        self.tokens = Counter(
            "flywheel_rollout_generated_tokens", "Response tokens generated.", registry=r
        )
        self.reward = Histogram(
            "flywheel_rollout_reward",
            "Reward per sample.",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=r,
        )
        self.verifier_errors = Counter(
            "flywheel_rollout_verifier_errors", "Verifier calls that hung or raised.", registry=r
        )
        self.aborted = Counter(
            "flywheel_rollout_aborted_generations",
            "Generations aborted by the engine (then generated again).",
            registry=r,
        )
        self.behind = Counter(
            "flywheel_rollout_engine_behind",
            "Tasks handed back because the engine was older than the task allows.",
            registry=r,
        )
        self.task_seconds = Histogram(
            "flywheel_rollout_task_seconds",
            "Task time from receipt to group published.",
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.in_flight = Gauge(
            "flywheel_rollout_tasks_in_flight", "Tasks being worked on.", registry=r
        )
        self.engine_version = Gauge(
            "flywheel_rollout_engine_version", "Weight version of this engine.", registry=r
        )
        self.weights_downloaded = Gauge(
            "flywheel_rollout_weights_downloaded_version",
            "Newest weight version received over NATS.",
            registry=r,
        )
        self.weights_bytes = Counter(
            "flywheel_rollout_weights_download_bytes",
            "Weight bytes received over NATS.",
            registry=r,
        )
        self.weights_seconds = Histogram(
            "flywheel_rollout_weights_download_seconds",
            "Time to receive one weight version.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )

    def downloaded(self, version: int, size: int, seconds: float) -> None:
        self.weights_downloaded.set(version)
        self.weights_bytes.inc(size)
        self.weights_seconds.observe(seconds)
