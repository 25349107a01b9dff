"""What the trainer reports: Prometheus metrics, and one metrics row per trained step.

A step's row (the batch's reward, lengths and staleness, the step's loss,
entropy and timings) goes to the Prometheus gauges and to every configured
logger (loggers.py: the metrics file, TensorBoard, W&B). The row is written
last in a step's publishing, so a row means its step is checkpointed
(state.reconcile_rows relies on that after a crash). A held-out evaluation
writes a row of its own when it ends (evaluating.py), for the version it
evaluated and without a `batch_id`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from proto.messages import TrainBatch
from services.runtime.metrics import MetricSet
from services.trainer.heldout import reward_parts
from services.trainer.loggers import open_loggers
from services.trainer.settings import TrainerSettings
from services.trainer.wire import batch_stats

if TYPE_CHECKING:
    from services.tasks.evaluate import EvalReport
    from services.trainer.step import StepResult
    from services.weights import Sent

log = logging.getLogger(__name__)

GAUGES = {
    "loss": "Policy loss of the last step.",
    "reward_mean": "Mean reward of the last batch.",
    "kl_ref": "KL to the reference model (configured estimator), last step.",
    "approx_kl": "Approximate KL between the policy and the old policy.",
    "entropy": "Mean token entropy (nats) of the policy over the last step's loss tokens, "
    "from the trainer's own forward at the sampling temperature (a collapse shows as a fall).",
    "entropy_coef": "Entropy bonus weight the last step used (fixed, or the adaptive "
    "controller's).",
    "clip_cov_frac": "Clip-Cov: share of the last step's loss tokens whose policy-gradient "
    "term was dropped.",
    "kl_cov_frac": "KL-Cov: share of the last step's loss tokens given the |logp - old| penalty.",
    "clip_frac_low": "Fraction of tokens clipped below.",
    "clip_frac_high": "Fraction of tokens clipped above.",
    "ratio": "Mean importance ratio.",
    "ratio_max": "Max importance ratio.",
    "mismatch_abs_mean": "Train–inference mismatch: mean |trainer − engine logprob| over the "
    "tokens generated with the trainer's weights (from the last step that had some).",
    "mismatch_abs_max": "Train–inference mismatch: max |trainer − engine logprob|, same tokens.",
    "mismatch_k3": "Train–inference mismatch: k3 estimate of KL(engine || trainer), same tokens.",
    "mismatch_tokens": "Share of the last step's loss tokens the mismatch was measured on.",
    "behaviour_k3": "k3 KL(engine || trainer) over all loss tokens (mismatch plus staleness).",
    "mis_token_masked_frac": "Share of loss tokens masked by the MIS token band.",
    "mis_seq_masked_frac": "Share of loss tokens masked by the MIS sequence band.",
    "grad_norm": "Gradient norm before clipping.",
    "lr": "Learning rate of the last step.",
    "staleness_max": "Largest step − sample version in the last batch.",
    "response_tokens_mean": "Mean response length of the last batch.",
    "eval_accuracy": "Held-out greedy pass@1 through the task's reward (last evaluation).",
    "eval_pass_at_k": "Held-out sampled pass@k (eval.k > 1; last evaluation).",
}

EVAL_GAUGES = ("eval_accuracy", "eval_pass_at_k")
"""The held-out figures: NaN until an evaluation measured them (eval_version says which)."""

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)


class TrainerMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        m = MetricSet(r, "flywheel_trainer_")
        self.gauges = {k: m.gauge(k, doc) for k, doc in GAUGES.items()}
        for k in EVAL_GAUGES:  # not measured yet reads as such (NaN), never as a 0.000
            self.gauges[k].set(float("nan"))
        self.eval_version = m.gauge(
            "eval_version",
            "Weight version the last held-out evaluation measured (-1 until one has ended).",
        )
        self.eval_version.set(-1)
        self.eval_at = m.gauge(
            "eval_timestamp_seconds",
            "Unix time the last held-out evaluation ended (0 until one has).",
        )
        self.step = m.gauge("step", "Optimizer steps done.")
        self.version = m.gauge("weight_version", "Newest version.")
        self.phase = m.counter(
            "phase_seconds",
            "Wall time by phase: waiting for data, compute, publishing (saving), upload (NATS).",
            ["phase"],
        )
        self.step_seconds = m.histogram(
            "step_seconds", "Compute time of one optimizer step.", STEP_BUCKETS
        )
        self.tokens = m.counter("tokens", "Tokens trained on.")
        parts = "Mean of each reward part over the last batch."
        self.reward_part = m.gauge("reward_part", parts, ["part"])
        self.upload_bytes = m.counter("weights_upload_bytes", "Weight bytes sent over NATS.")
        self.samples = m.counter("samples", "Samples trained on.")
        self.tokens_per_s = m.gauge("tokens_per_second", "Compute tokens/s of the last step.")
        idle = "Fraction of wall time spent waiting for data since start."
        self.idle = m.gauge("idle_fraction", idle)
        self.weights_full = m.gauge("weights_full_bytes", "Bytes of the last version, whole.")
        self.weights_wire = m.gauge(
            "weights_wire_bytes",
            "Bytes the last version put on the wire (nats: whole; nats-delta: its delta, plus "
            "the whole when it is a snapshot; disk: 0).",
        )
        self.weights_delta = m.gauge(
            "weights_delta_bytes", "Bytes of the last version's delta (nats-delta)."
        )
        self.weights_changed = m.gauge(
            "weights_changed_fraction",
            "Fraction of the last version's elements whose published bits changed (nats-delta).",
        )
        self.eval_in_flight = m.gauge(
            "eval_in_flight", "1 while a held-out evaluation runs beside training, else 0."
        )
        self.evals_skipped = m.counter(
            "evals_skipped",
            "Due held-out evaluations skipped because a newer version fell due while one ran.",
        )
        self.evals_deferred = m.counter(
            "evals_deferred",
            "Due held-out evaluations deferred (not run) because the evaluations' measured cost "
            "to the steps beside them was over [trainer] eval_max_share of the RL wall time.",
        )
        self.eval_models_loaded = m.counter(
            "eval_models_loaded",
            "Model copies this trainer loaded to generate held-out evaluations itself "
            "([trainer] eval_on = 'trainer'); stays 0 when the engines evaluate.",
        )
        self.eval_cost_share = m.gauge(
            "eval_cost_share",
            "Running estimate of the share of RL wall time the held-out evaluations cost the "
            "steps beside them (their excess over the median step trained with none in flight).",
        )
        self.blocked = m.gauge(
            "blocked_fraction",
            "Fraction of wall time since start the loop spent waiting, after a step's compute, "
            "for the previous step's saving, announcing and recording.",
        )
        self.weights_publish_s = m.gauge(
            "weights_publish_seconds", "Time to make the last version reachable (encode + send)."
        )

    def weights_sent(self, sent: Sent, full_bytes: int) -> None:
        """Bytes on the wire for one version: whole, sent, delta, fraction changed."""
        self.weights_full.set(full_bytes)
        t = sent.transfer
        self.weights_wire.set(t.bytes if t is not None else 0)
        self.weights_publish_s.set(t.seconds if t is not None else 0.0)
        if sent.delta is not None:
            self.weights_delta.set(sent.delta.delta_bytes)
            self.weights_changed.set(sent.delta.fraction_changed)


class Recorder:
    """Rows and gauges of the trained steps; time spent waiting for data against working."""

    def __init__(self, registry: CollectorRegistry, s: TrainerSettings) -> None:
        self.metrics = TrainerMetrics(registry)
        self.started = time.time()
        self.waited = 0.0
        self.busy = 0.0
        self.blocked = 0.0  # part of busy: waiting for the previous step's publish and record
        self.loggers = open_loggers(
            s.loggers,
            run=s.run,
            metrics_file=s.metrics_file,
            log_dir=s.log_dir,
            wandb_project=s.wandb_project,
            wandb_mode=s.wandb_mode,
            config=s.model_dump(mode="json", include={"loss", "optim", "runtime", "model"}),
        )

    def close(self) -> None:
        self.loggers.close()

    def timed(self, waited_s: float, busy_s: float, blocked_s: float = 0.0) -> None:
        """One step's wait for its batch, its work after that (for the idle fraction), and
        the part of that work spent waiting for the previous step's publish and record."""
        self.waited += waited_s
        self.busy += busy_s
        self.blocked += blocked_s
        self.metrics.blocked.set(self.blocked / max(self.waited + self.busy, 1e-9))

    def row(self, batch: TrainBatch, r: StepResult, waited: float) -> dict[str, Any]:
        """Step `r.step`'s metrics row; the gauges follow it."""
        stats = batch_stats(batch)
        parts = reward_parts(batch)
        idle = self.waited / max(self.waited + self.busy, 1e-9)
        row: dict[str, Any] = {
            "step": r.step,
            "batch_id": batch.batch_id,
            "time": time.time(),
            "elapsed": time.time() - self.started,
            **stats,
            **parts,
            **r.metrics,
            "wait_s": waited,
            "compute_s": r.compute_s,
            "publish_s": r.publish_s,
        }
        for name, v in parts.items():
            self.metrics.reward_part.labels(part=name.removeprefix("reward/")).set(v)
        for k, g in self.metrics.gauges.items():
            if k in row:
                g.set(float(row[k]))
        self._count(r, waited, stats, idle)
        row["idle_fraction"] = idle
        return row

    def _count(self, r: StepResult, waited: float, stats: dict[str, float], idle: float) -> None:
        m = self.metrics
        m.step.set(r.step)
        m.version.set(r.step)
        m.phase.labels(phase="wait").inc(waited)
        m.phase.labels(phase="compute").inc(r.compute_s)
        m.phase.labels(phase="publish").inc(r.publish_s)
        m.step_seconds.observe(r.compute_s)
        m.tokens.inc(stats["tokens"])
        m.samples.inc(stats["samples"])
        m.tokens_per_s.set(stats["tokens"] / max(r.compute_s, 1e-9))
        m.idle.set(idle)

    def evaluated(self, report: EvalReport, row: dict[str, Any]) -> None:
        """A held-out evaluation's figures, into the row and the gauges."""
        row.update(report.metrics())
        m = self.metrics
        m.gauges["eval_accuracy"].set(report.pass_at_1)
        if report.pass_at_k is not None:
            m.gauges["eval_pass_at_k"].set(report.pass_at_k)
        m.eval_version.set(int(row["step"]))
        m.eval_at.set(time.time())

    def sampled(self, report: EvalReport, row: dict[str, Any]) -> None:
        """The pass@k an evaluation added after its pass@1 row, into its own row and gauge."""
        row.update(report.pass_at_k_metrics())
        if report.pass_at_k is not None:
            self.metrics.gauges["eval_pass_at_k"].set(report.pass_at_k)

    def write(self, row: dict[str, Any]) -> None:
        """To every configured logger (the metrics file, TensorBoard, W&B)."""
        self.loggers.write(row)

    def log_step(self, row: dict[str, Any], r: StepResult, waited: float) -> None:
        log.info(
            "trainer: step %d loss %.4f reward %.3f wait %.2fs compute %.2fs publish %.2fs%s%s",
            r.step,
            row.get("loss", float("nan")),
            row["reward_mean"],
            waited,
            r.compute_s,
            r.publish_s,
            entropy_line(row),
            mismatch_line(row),
        )


def entropy_line(row: dict[str, Any]) -> str:
    """` entropy 0.412` when the step measured it, with ` (bonus 0.0123)` while it has one."""
    if "entropy" not in row:
        return ""
    coef = row.get("entropy_coef", 0.0)
    return f" entropy {row['entropy']:.3f}" + (f" (bonus {coef:.4f})" if coef > 0 else "")


def mismatch_line(row: dict[str, Any]) -> str:
    """` mismatch |Δlogp| 0.0123 max 0.31 k3 2.1e-04` when the step measured it, else ''."""
    if "mismatch_abs_mean" not in row:
        return ""
    return (
        f" mismatch |Δlogp| {row['mismatch_abs_mean']:.4f} max {row['mismatch_abs_max']:.2f}"
        f" k3 {row['mismatch_k3']:.1e}"
    )
