"""Build Flywheel's Grafana dashboards (JSON) from the panel lists below.

    python deploy/k8s/components/monitoring/dashboards/build.py   # rewrites *.json

The JSON files are what Grafana loads (through the ConfigMaps of
../kustomization.yaml); this script is their source, so a panel is one line
here rather than sixty lines of JSON, and every dashboard shares one layout
and one datasource variable. tests/deploy checks that the committed JSON is
what this script writes, that every query names only metrics the services
export, and that every query returns data from a running stack.

Queries use `$__rate_interval` (Grafana picks a window of at least four
scrape intervals) and aggregate `by (pod)` where a panel is per instance:
on Kubernetes `pod` names the worker; on a local stack the label is absent
and `instance` (host:port) is added to tell processes apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
RI = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    exprs: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[tuple[str, tuple[Panel, ...]], ...]
    tags: tuple[str, ...] = field(default=("flywheel",))


def p(title: str, *exprs: tuple[str, str], unit: str = "short", kind: str = "timeseries",
      description: str = "") -> Panel:  # fmt: skip
    return Panel(title, tuple(exprs), unit, kind, description)


def quantiles(metric: str, by: str = "") -> tuple[tuple[str, str], ...]:
    grouping = f"{by}, le" if by else "le"
    prefix = "{{" + by + "}} " if by else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({grouping}) (rate({metric}_bucket[{RI}])))",
            f"{prefix}p{int(q * 100)}",
        )
        for q in (0.5, 0.9)
    )


OVERVIEW = Dashboard(
    uid="flywheel-overview",
    title="Flywheel / Run overview",
    description="Is the run learning, and is the loop flowing?",
    rows=(
        (
            "Learning",
            (
                p(
                    "Reward (mean)",
                    ("flywheel_trainer_reward_mean", "trained batch"),
                    ("flywheel:rollout_reward:mean5m", "generated (5m)"),
                    description="Mean reward of the last trained batch (after filters) and of "
                    "everything generated.",
                ),
                p(
                    "Held-out accuracy",
                    ("flywheel_trainer_eval_accuracy", "greedy exact match"),
                    unit="percentunit",
                ),
                p(
                    "Step rate",
                    ("flywheel:trainer_steps:rate5m", "steps/s (5m)"),
                    ("sum(rate(flywheel_trainer_step_seconds_count[" + RI + "]))", "steps/s"),
                    unit="ops",
                ),
                p(
                    "Trainer step",
                    ("max(flywheel_trainer_step)", "step"),
                    ("max(flywheel_trainer_weight_version)", "published version"),
                    ("max(flywheel_sync_ready_version)", "ready version"),
                    kind="stat",
                ),
            ),
        ),
        (
            "Collapse and curriculum",
            (
                p(
                    "Flat groups",
                    ("max(flywheel_buffer_flat_share)", "share of the last step's groups"),
                    unit="percentunit",
                    description="Groups with no reward spread (zero advantage: nothing to "
                    "learn). Near 100% with few distinct completions is a collapsed policy "
                    "(docs/learning.md).",
                ),
                p(
                    "Distinct completions per group",
                    ("max(flywheel_buffer_distinct_completions)", "distinct (mean)"),
                    ("max(flywheel_buffer_group_samples)", "samples per group"),
                    description="Different response token sequences among a group's samples, "
                    "over the last step's groups: 1 is a policy that says one thing.",
                ),
                p(
                    "Policy entropy",
                    ("flywheel_trainer_entropy", "mean token entropy (trainer)"),
                ),
                p(
                    "Prompts by difficulty",
                    (
                        "sum by (difficulty) (flywheel_buffer_curriculum_prompts)",
                        "{{difficulty}}",
                    ),
                    description="Prompts seen, by pass rate: easy and hard ones are drawn "
                    "less, retired (solved) ones never ([buffer] curriculum_*).",
                ),
                p(
                    "Flat groups handled",
                    (f"sum(rate(flywheel_buffer_refilled_groups_total[{RI}]))", "refilled"),
                    (f"sum(rate(flywheel_buffer_rested_prompts_total[{RI}]))", "prompts rested"),
                    (
                        f"sum by (reason) (rate(flywheel_buffer_curriculum_skipped_total[{RI}]))",
                        "skipped: {{reason}}",
                    ),
                    unit="ops",
                ),
                p(
                    "Groups in a row with nothing trainable",
                    ("max(flywheel_buffer_untrainable_groups)", "groups"),
                    (f"sum(increase(flywheel_buffer_stalls_total[{RI}]))", "stalls said"),
                    description="A stall is said once in the console after [buffer] "
                    "stall_warn_steps steps' worth of such groups.",
                ),
            ),
        ),
        (
            "Freshness",
            (
                p(
                    "Staleness (steps)",
                    *quantiles("flywheel_buffer_staleness_steps"),
                    ("max(flywheel_trainer_staleness_max)", "max in last batch"),
                    description="Steps between the weights a sample was generated with and the "
                    "step it trains at.",
                ),
                p(
                    "Publish → ready latency",
                    *quantiles("flywheel_sync_publish_to_ready_seconds"),
                    unit="s",
                    description="From WeightsPublished to every engine serving it.",
                ),
                p(
                    "Trainer idle fraction",
                    ("max(flywheel_trainer_idle_fraction)", "waiting for data"),
                    unit="percentunit",
                ),
                p(
                    "Batches ahead of ready weights",
                    ("max(flywheel_buffer_batches_ahead)", "batches"),
                ),
            ),
        ),
        (
            "Flow",
            (
                p(
                    "Queue depth",
                    ("sum(flywheel_buffer_tasks_in_flight)", "tasks awaiting a group"),
                    ("sum(flywheel_rollout_tasks_in_flight)", "tasks being generated"),
                ),
                p(
                    "Groups received by verdict",
                    (f"sum by (verdict) (rate(flywheel_buffer_groups_total[{RI}]))", "{{verdict}}"),
                    unit="ops",
                ),
                p(
                    "Dead letters by reason",
                    (
                        f"sum by (service, reason) "
                        f"(increase(flywheel_messages_dead_lettered_total[{RI}]))",
                        "{{service}} {{reason}}",
                    ),
                    description="Filtered groups (zero_variance, too_long, stale) are "
                    "dead-lettered by design; other reasons are failures.",
                ),
                p(
                    "Samples and batches",
                    (f"sum(rate(flywheel_rollout_samples_total[{RI}]))", "samples/s"),
                    (f"sum(rate(flywheel_buffer_batches_published_total[{RI}]))", "batches/s"),
                    unit="ops",
                ),
                p(
                    "Handler latency p90",
                    (
                        f"histogram_quantile(0.9, sum by (service, le) "
                        f"(rate(flywheel_handler_seconds_bucket[{RI}])))",
                        "{{service}}",
                    ),
                    unit="s",
                ),
                p("Dataset epoch", ("max(flywheel_buffer_dataset_epoch)", "epoch"), kind="stat"),
            ),
        ),
    ),
)

ROLLOUT = Dashboard(
    uid="flywheel-rollout",
    title="Flywheel / Rollout fleet",
    description="Per engine and per worker: throughput, latency, versions, failures.",
    rows=(
        (
            "Throughput",
            (
                p(
                    "Samples/s per worker",
                    (
                        f"sum by (pod, instance) (rate(flywheel_rollout_samples_total[{RI}]))",
                        "{{pod}}{{instance}}",
                    ),
                    unit="ops",
                ),
                p(
                    "Generated tokens/s per worker",
                    (
                        f"sum by (pod, instance) "
                        f"(rate(flywheel_rollout_generated_tokens_total[{RI}]))",
                        "{{pod}}{{instance}}",
                    ),
                    unit="ops",
                ),
                p(
                    "Tasks in flight per worker",
                    (
                        "sum by (pod, instance) (flywheel_rollout_tasks_in_flight)",
                        "{{pod}}{{instance}}",
                    ),
                ),
                p(
                    "Finish reasons",
                    (f"sum by (finish) (rate(flywheel_rollout_samples_total[{RI}]))", "{{finish}}"),
                    unit="ops",
                ),
            ),
        ),
        (
            "Latency and reward",
            (
                p(
                    "Task latency",
                    *quantiles("flywheel_rollout_task_seconds"),
                    unit="s",
                    description="From task receipt to its group published.",
                ),
                p(
                    "Reward distribution",
                    (f"sum by (le) (rate(flywheel_rollout_reward_bucket[{RI}]))", "≤ {{le}}"),
                    unit="ops",
                ),
                p(
                    "Engine update time",
                    *quantiles("flywheel_sync_engine_update_seconds"),
                    unit="s",
                ),
            ),
        ),
        (
            "Versions and failures",
            (
                p(
                    "Weight version per engine",
                    ("max by (engine) (flywheel_sync_engine_version)", "{{engine}} (sync)"),
                    (
                        "max by (pod, instance) (flywheel_rollout_engine_version)",
                        "{{pod}}{{instance}} (worker)",
                    ),
                ),
                p("Live engines", ("max(flywheel_sync_engines_live)", "engines"), kind="stat"),
                # `or … * 0`: a zero line per known engine until its first failure
                # (a labelled counter has no series before its first increment).
                p(
                    "Update failures per engine",
                    (
                        f"sum by (engine) (increase(flywheel_sync_update_failures_total[{RI}])) "
                        "or max by (engine) (flywheel_sync_engine_version) * 0",
                        "{{engine}}",
                    ),
                ),
                p(
                    "Aborted, behind, verifier errors",
                    (f"sum(rate(flywheel_rollout_aborted_generations_total[{RI}]))", "aborted"),
                    (f"sum(rate(flywheel_rollout_engine_behind_total[{RI}]))", "engine behind"),
                    (f"sum(rate(flywheel_rollout_verifier_errors_total[{RI}]))", "verifier errors"),
                    unit="ops",
                ),
                p(
                    "Weight bytes loaded",
                    (f"sum(rate(flywheel_sync_bytes_total[{RI}]))", "bytes/s"),
                    unit="Bps",
                ),
            ),
        ),
    ),
)

TRAINER = Dashboard(
    uid="flywheel-trainer",
    title="Flywheel / Trainer internals",
    description="The policy update: loss, KL, entropy, clipping, gradients, throughput.",
    rows=(
        (
            "Objective",
            (
                p("Loss", ("flywheel_trainer_loss", "policy loss")),
                p(
                    "KL",
                    ("flywheel_trainer_kl_ref", "to reference"),
                    ("flywheel_trainer_approx_kl", "to old policy (approx)"),
                ),
                p("Entropy", ("flywheel_trainer_entropy", "mean token entropy")),
                p(
                    "Clip fractions",
                    ("flywheel_trainer_clip_frac_low", "clipped low"),
                    ("flywheel_trainer_clip_frac_high", "clipped high"),
                    unit="percentunit",
                ),
                p(
                    "Importance ratio",
                    ("flywheel_trainer_ratio", "mean"),
                    ("flywheel_trainer_ratio_max", "max"),
                ),
            ),
        ),
        (
            "Train–inference mismatch",
            (
                p(
                    "|Δ logprob| (trainer − engine, same version)",
                    ("flywheel_trainer_mismatch_abs_mean", "mean"),
                    ("flywheel_trainer_mismatch_abs_max", "max"),
                    description="The engine's logprob of each sampled token against the "
                    "trainer's under the same weights, over the tokens generated with the "
                    "version the trainer held when it stepped.",
                ),
                p(
                    "Mismatch KL (k3)",
                    ("flywheel_trainer_mismatch_k3", "same version"),
                    ("flywheel_trainer_behaviour_k3", "all tokens (with staleness)"),
                ),
                p(
                    "Token shares",
                    ("flywheel_trainer_mismatch_tokens", "measured"),
                    ("flywheel_trainer_mis_token_masked_frac", "MIS token mask"),
                    ("flywheel_trainer_mis_seq_masked_frac", "MIS sequence mask"),
                    unit="percentunit",
                ),
            ),
        ),
        (
            "Optimisation",
            (
                p("Gradient norm", ("flywheel_trainer_grad_norm", "before clipping")),
                p("Learning rate", ("flywheel_trainer_lr", "lr")),
                p("Response length", ("flywheel_trainer_response_tokens_mean", "tokens (mean)")),
            ),
        ),
        (
            "Throughput",
            (
                p(
                    "Tokens/s",
                    ("flywheel_trainer_tokens_per_second", "last step (compute)"),
                    (f"sum(rate(flywheel_trainer_tokens_total[{RI}]))", "wall clock"),
                    unit="ops",
                ),
                p(
                    "Samples/s",
                    (f"sum(rate(flywheel_trainer_samples_total[{RI}]))", "samples/s"),
                    unit="ops",
                ),
                p("Step time", *quantiles("flywheel_trainer_step_seconds"), unit="s"),
                p(
                    "Time by phase",
                    (
                        f"sum by (phase) (rate(flywheel_trainer_phase_seconds_total[{RI}]))",
                        "{{phase}}",
                    ),
                    unit="percentunit",
                    description="Seconds per second in each phase.",
                ),
            ),
        ),
        (
            "Weights on the wire",
            (
                p(
                    "Bytes per version",
                    ("max(flywheel_trainer_weights_full_bytes)", "whole version"),
                    ("max(flywheel_trainer_weights_wire_bytes)", "sent"),
                    ("max(flywheel_trainer_weights_delta_bytes)", "delta (delta transports)"),
                    unit="bytes",
                    description="The newest version: its full size, what the trainer put on "
                    "the wire for it, and its delta against the version before.",
                ),
                p(
                    "Fraction of elements changed",
                    ("max(flywheel_trainer_weights_changed_fraction)", "changed"),
                    unit="percentunit",
                    description="Elements whose published bits changed (nats-delta, disk-delta).",
                ),
                p(
                    "Publish and rebuild time",
                    ("max(flywheel_trainer_weights_publish_seconds)", "publish (trainer)"),
                    ("max(flywheel_rollout_weights_rebuild_seconds)", "rebuild (slowest engine)"),
                    unit="s",
                ),
            ),
        ),
    ),
)

DASHBOARDS = (OVERVIEW, ROLLOUT, TRAINER)


def panel_json(panel: Panel, pid: int, x: int, y: int, w: int) -> dict[str, object]:
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for i, (expr, legend) in enumerate(panel.exprs)
        ],
    }


def dashboard_json(d: Dashboard) -> dict[str, object]:
    panels: list[dict[str, object]] = []
    pid, y = 1, 0
    for row_title, row_panels in d.rows:
        panels.append({
            "id": pid, "type": "row", "title": row_title, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        })  # fmt: skip
        pid, y = pid + 1, y + 1
        per_line = min(len(row_panels), 4)
        w = 24 // per_line
        for i, panel in enumerate(row_panels):
            x = (i % per_line) * w
            if i and i % per_line == 0:
                y += 8
            panels.append(panel_json(panel, pid, x, y, w))
            pid += 1
        y += 8
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": list(d.tags),
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                }
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render(d: Dashboard) -> str:
    return json.dumps(dashboard_json(d), indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    for d in DASHBOARDS:
        (HERE / f"{d.uid}.json").write_text(render(d), encoding="utf-8")


if __name__ == "__main__":
    main()
