"""The live status view of `flywheel up`: scrape every service's /metrics, summarise.

Pure parts (`parse`, `summarise`, `render_line`) are tested without a
stack; `scrape` is one HTTP GET per service.
"""

from __future__ import annotations

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
    accuracy: float | None = None
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
            st.reward = value(s, "flywheel_trainer_reward_mean")
            st.accuracy = value(s, "flywheel_trainer_eval_accuracy")
            st.staleness = value(s, "flywheel_trainer_staleness_max")
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
        f"step {f(now.step, 'd')} | reward {f(now.reward, '.3f')} | acc {f(now.accuracy, '.3f')} "
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
