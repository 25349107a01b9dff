"""The live status view of `flywheel up`: scrape every service's /metrics, summarise.

Pure parts (`parse`, `summarise`, `render_line`) are tested without a
stack; `scrape` is one HTTP GET per service.

No figure is shown before it is measured: the held-out accuracy reads
"none yet" until an evaluation has ended (the trainer's eval gauges are NaN
and `eval_version` -1 until then), and a figure shown says which version it
measured and how long ago ("acc 0.620 (v10, 40 s ago)"), so a step-0 figure
an hour into a run reads as old. Evaluations that were due and not run
(skipped for a newer version, deferred for their cost) are counted beside
it; the trainer's console warning says why, once.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

Samples = dict[str, list[tuple[dict[str, str], float]]]

# Dead-letter reasons that are decisions, not failures: filtered groups
# (DAPO dynamic sampling, length) and groups too old for the staleness bound.
FILTERED = {"zero_variance", "too_long", "custom_filter", "stale"}


def parse(text: str) -> Samples:
    """Prometheus text → {sample name: [(labels, value), …]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def value(samples: Samples, name: str, default: float | None = None, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`."""
    rows = [
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    ]
    return sum(rows) if rows else default


@dataclass
class Status:
    step: int | None = None
    reward: float | None = None
    accuracy: float | None = None  # None: no held-out evaluation has ended yet
    eval_version: int | None = None  # the version `accuracy` measured
    eval_at: float | None = None  # when that evaluation ended (unix seconds)
    evals_not_run: tuple[int, int] = (0, 0)  # due evaluations skipped, deferred
    staleness: float | None = None
    idle: float | None = None
    # the engines' idle fraction: the mean over rollout workers of the share of wall time
    # their engine had no task of theirs in flight (None: no worker reports it)
    engine_idle: float | None = None
    # train–inference mismatch of the trainer's last measured step: mean and max
    # |trainer − engine logprob| and k3, on tokens of the trainer's version (None: never)
    mismatch: tuple[float, float, float] | None = None
    samples_total: float = 0.0
    engines: dict[str, int] = field(default_factory=dict)  # engine id → version
    tasks_in_flight: float | None = None
    dead_letters: float = 0.0  # failures: malformed, handler errors, max deliveries, …
    filtered: float = 0.0  # groups dropped by a filter or as stale
    groups: float = 0.0  # groups the buffer received (duplicates not counted)
    stale: float = 0.0  # of which dropped as stale: generated, then wasted
    stale_tokens: float = 0.0
    unscored: float = 0.0  # samples whose reward could not be computed: not trained on
    # collapse made visible (docs/learning.md): the buffer's last step's share of flat
    # groups and distinct completions per group (of `group_samples`), the trainer's entropy
    flat_share: float | None = None
    distinct: float | None = None
    group_samples: float | None = None
    entropy: float | None = None
    at: float = field(default_factory=time.time)


def summarise(by_service: dict[str, Samples]) -> Status:
    st = Status()
    engine_idle: list[float] = []
    for name, s in by_service.items():
        if name.startswith("trainer"):
            step = value(s, "flywheel_trainer_step")
            st.step = int(step) if step is not None else None
            # a batch's figures: none before the first step (the gauges read 0 until then)
            st.reward = value(s, "flywheel_trainer_reward_mean") if st.step else None
            held_out(st, s)
            st.staleness = value(s, "flywheel_trainer_staleness_max") if st.step else None
            st.idle = value(s, "flywheel_trainer_idle_fraction")
            st.mismatch = mismatch(s)
            # the trainer's per-step entropy gauge (0 until a step measured it)
            st.entropy = value(s, "flywheel_trainer_entropy") if st.step else None
        elif name.startswith("rollout"):
            st.samples_total += value(s, "flywheel_rollout_samples_total", 0.0) or 0.0
            idle = value(s, "flywheel_rollout_engine_idle_fraction")
            if idle is not None:
                engine_idle.append(idle)
        elif name.startswith("sync"):
            for labels, v in s.get("flywheel_sync_engine_version", []):
                st.engines[labels.get("engine", "?")] = int(v)
        elif name.startswith("buffer"):
            st.tasks_in_flight = value(s, "flywheel_buffer_tasks_in_flight")
            st.stale = value(s, "flywheel_buffer_groups_total", 0.0, verdict="stale") or 0.0
            st.stale_tokens = (
                value(s, "flywheel_buffer_group_tokens_total", 0.0, verdict="stale") or 0.0
            )
            every = value(s, "flywheel_buffer_groups_total", 0.0) or 0.0
            dups = value(s, "flywheel_buffer_groups_total", 0.0, verdict="duplicate") or 0.0
            st.groups = every - dups
            st.unscored = value(s, "flywheel_buffer_unscored_samples_total", 0.0) or 0.0
            size = value(s, "flywheel_buffer_group_samples")
            if size:  # absent from an older buffer; 0 before its first group
                st.group_samples = size
                st.flat_share = value(s, "flywheel_buffer_flat_share")
                st.distinct = value(s, "flywheel_buffer_distinct_completions")
        for labels, v in s.get("flywheel_messages_dead_lettered_total", []):
            if labels.get("reason") in FILTERED:
                st.filtered += v
            else:
                st.dead_letters += v
    if engine_idle:
        st.engine_idle = sum(engine_idle) / len(engine_idle)
    return st


def held_out(st: Status, s: Samples) -> None:
    """The trainer's last held-out figure, its version and time, or none when none ended."""
    version = value(s, "flywheel_trainer_eval_version")
    acc = value(s, "flywheel_trainer_eval_accuracy")
    skipped = value(s, "flywheel_trainer_evals_skipped_total", 0.0) or 0.0
    deferred = value(s, "flywheel_trainer_evals_deferred_total", 0.0) or 0.0
    st.evals_not_run = (int(skipped), int(deferred))
    if version is None or version < 0 or acc is None or math.isnan(acc):
        return  # not measured yet (a trainer without eval_version: none can be told apart)
    st.accuracy, st.eval_version = acc, int(version)
    at = value(s, "flywheel_trainer_eval_timestamp_seconds")
    st.eval_at = at if at else None


def accuracy_text(now: Status) -> str:
    """`acc 0.620 (v10, 40 s ago)`, `acc none yet`, or `acc -` (no trainer seen); with the
    due evaluations that did not run: `acc none yet (not run: 2 deferred)`."""
    if now.step is None and now.accuracy is None:
        return "acc -"
    skipped, deferred = now.evals_not_run
    counts = [f"{n} {what}" for n, what in ((skipped, "skipped"), (deferred, "deferred")) if n]
    not_run = [f"not run: {', '.join(counts)}"] if counts else []
    if now.accuracy is None or now.eval_version is None:
        return "acc none yet" + (f" ({not_run[0]})" if not_run else "")
    where = f"v{now.eval_version}"
    if now.eval_at is not None:
        where += f", {ago(now.at - now.eval_at)} ago"
    return f"acc {now.accuracy:.3f} ({'; '.join([where, *not_run])})"


def ago(seconds: float) -> str:
    """`40 s`, `7 min`, `2.1 h`: how old a figure is, at a glance."""
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def mismatch(s: Samples) -> tuple[float, float, float] | None:
    """(mean, max |Δ logprob|, k3) from the trainer's gauges; None until a step measured it
    (the gauges read 0 before: a max of exactly 0 is not a measurement on a real model)."""
    names = ("mean", "max")
    got = [value(s, f"flywheel_trainer_mismatch_abs_{n}") for n in names]
    k3 = value(s, "flywheel_trainer_mismatch_k3")
    if got[0] is None or got[1] is None or k3 is None or got[1] == 0:
        return None
    return got[0], got[1], k3


@dataclass
class RateWindow:
    """Where the status line's samples/s is measured from: a window that spans trainer steps.

    Generation comes in bursts: admission lets a step's tasks out when a weight
    version is ready, and with a trainer slower than generation the workers then
    wait for the next one. A rate between two status lines (2 s apart) read 0.0
    for most of a 15 s step. So the rate is over a window reaching back to the
    newest status seen at least `min_s` ago whose step is two or more steps behind
    (one step's burst and one step's wait inside it), at most `max_s` back; until
    the run is that old, over all of it. A fast trainer gets a plain `min_s`
    moving average.
    """

    min_s: float = 30.0
    max_s: float = 600.0
    steps: int = 2
    seen: deque[Status] = field(default_factory=deque)

    def start(self, now: Status) -> Status | None:
        """Record `now`; the status the rate runs from (None: nothing before `now`)."""
        if self.seen and now.samples_total < self.seen[-1].samples_total:
            self.seen.clear()  # a worker restarted: its counter began again
        while self.seen and now.at - self.seen[0].at > self.max_s:
            self.seen.popleft()
        start = next((s for s in reversed(self.seen) if self._spans(s, now)), None)
        if start is None and self.seen:
            start = self.seen[0]
        while self.seen and self.seen[0] is not start:
            self.seen.popleft()
        self.seen.append(now)
        return start

    def _spans(self, then: Status, now: Status) -> bool:
        if now.at - then.at < self.min_s:
            return False
        return now.step is None or then.step is None or then.step <= now.step - self.steps


def render_line(now: Status, before: Status | None) -> str:
    """The status line; samples/s is measured since `before` (a RateWindow's start)."""
    rate = None
    if before is not None and now.at > before.at:
        rate = (now.samples_total - before.samples_total) / (now.at - before.at)

    def f(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    engines = " ".join(f"{k}=v{v}" for k, v in sorted(now.engines.items())) or "-"
    stale = f"{now.stale:.0f}" + (f" ({now.stale / now.groups:.1%})" if now.groups else "")
    mm = now.mismatch
    gap = "-" if mm is None else f"|Δlogp| {mm[0]:.3f} max {mm[1]:.2f} k3 {mm[2]:.1e}"
    distinct = "-"
    if now.distinct is not None and now.group_samples:
        distinct = f"{now.distinct:.1f}/{now.group_samples:.0f}"
    return (
        f"step {f(now.step, 'd')} | reward {f(now.reward, '.3f')} | {accuracy_text(now)} "
        f"| staleness {f(now.staleness, '.0f')} | mismatch {gap} | samples/s {f(rate, '.1f')} "
        f"| trainer idle {f(now.idle, '.0%')} | engine idle {f(now.engine_idle, '.0%')} "
        f"| in flight {f(now.tasks_in_flight, '.0f')} "
        f"| flat {f(now.flat_share, '.0%')} | distinct {distinct} "
        f"| entropy {f(now.entropy, '.2f')} "
        f"| filtered {now.filtered:.0f} | stale {stale} | unscored {now.unscored:.0f} "
        f"| dead letters {now.dead_letters:.0f} | engines {engines}"
    )


async def scrape(urls: dict[str, str], timeout_s: float = 2.0) -> dict[str, Samples]:
    import aiohttp

    out: dict[str, Samples] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        for name, url in urls.items():
            try:
                async with session.get(url) as r:
                    if r.status == 200:
                        out[name] = parse(await r.text())
            except (aiohttp.ClientError, TimeoutError):
                continue  # a service that is restarting: shown as missing this round
    return out
