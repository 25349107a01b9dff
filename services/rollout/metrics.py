"""The rollout worker's Prometheus metrics: groups, samples, rewards, engine and weights."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.runtime.metrics import MetricSet
from services.weights import Transfer


class RolloutMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        m = MetricSet(r, "flywheel_rollout_")
        self.groups = m.counter("groups", "Sample groups published.")
        self.samples = m.counter("samples", "Samples generated, by finish reason.", ["finish"])
        self.tokens = m.counter("generated_tokens", "Response tokens generated.")
        self.reward = m.histogram(
            "reward", "Reward per sample.", (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
        )
        self.verifier_errors = m.counter("verifier_errors", "Verifier calls that hung or raised.")
        self.teacher_seconds = m.histogram(
            "teacher_seconds",
            "Time to score one sample with the teacher (distillation), tries included.",
            (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.teacher_failures = m.counter(
            "teacher_failures", "Samples no teacher engine scored (dead-lettered teacher_failed)."
        )
        self.aborted = m.counter(
            "aborted_generations", "Generations aborted by the engine (then generated again)."
        )
        self.behind = m.counter(
            "engine_behind", "Tasks handed back because the engine was older than the task allows."
        )
        self.episode_turns = m.histogram(
            "episode_turns", "Policy turns per multi-turn episode.", (1, 2, 3, 4, 6, 8, 16, 32)
        )
        self.tool_calls = m.counter("tool_calls", "Tool calls run in multi-turn episodes.")
        self.tool_errors = m.counter(
            "tool_errors", "Tool calls that hung, raised, crashed or were malformed."
        )
        self.tool_seconds = m.histogram(
            "tool_seconds", "Mean time of a tool call, per episode.", (0.01, 0.05, 0.1, 0.5, 1, 5)
        )
        self.task_seconds = m.histogram(
            "task_seconds",
            "Task time from receipt to group published.",
            (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
        )
        self.in_flight = m.gauge("tasks_in_flight", "Tasks being worked on.")
        self.engine_idle = m.gauge(
            "engine_idle_fraction",
            "Fraction of wall time since this worker's first task with none of its tasks in "
            "flight (its engine had nothing of this worker's to generate).",
        )
        self.engine_threads = m.gauge(
            "engine_threads", "Threads the worker last gave its engine (core lease; 0: none)."
        )
        self.engine_version = m.gauge("engine_version", "Weight version of this engine.")
        self.weights_downloaded = m.gauge(
            "weights_downloaded_version", "Newest weight version received over NATS."
        )
        self.weights_bytes = m.counter("weights_download_bytes", "Weight bytes received over NATS.")
        self.weights_given_up = m.counter(
            "weights_given_up", "Weight versions given up after repeated failed downloads."
        )
        self.weights_given_up_version = m.gauge(
            "weights_given_up_version", "Newest weight version given up (0: none)."
        )
        self.weights_seconds = m.histogram(
            "weights_download_seconds", "Time to receive one weight version."
        )

        self.weights_rebuild = m.gauge(
            "weights_rebuild_seconds",
            "nats-delta: time the last version took to rebuild from deltas (0: it came whole).",
        )
        self.weights_deltas = m.counter(
            "weights_deltas_applied", "nats-delta: deltas applied to rebuild versions."
        )

    def given_up(self, version: int) -> None:
        self.weights_given_up.inc()
        self.weights_given_up_version.set(version)

    def downloaded(self, t: Transfer) -> None:
        self.weights_downloaded.set(t.version)
        self.weights_bytes.inc(t.bytes)
        self.weights_seconds.observe(t.seconds)
        self.weights_rebuild.set(t.rebuild_s)
        self.weights_deltas.inc(t.deltas)
