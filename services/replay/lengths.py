"""Response lengths of what a run generated, dropped as stale and trained (issue 46, item 4).

Users of asynchronous RL report that dropping stale samples biases training
towards short replies: a group is published when its slowest sample is
done, so the groups that arrive too late for their step are, more often
than not, those with long replies. This module measures it on a recorded
run, from what the run's streams already hold, with nothing added to the
message path:

- generated: every sample of every SampleGroup the workers published (SAMPLES);
- stale: the samples of the groups the buffer dead-lettered with reason
  `stale` (DLQ; the dead letter carries the group's bytes unchanged, and its
  error names the group, services/buffer/app.py);
- dropped: the groups dead-lettered for any other reason (the filters:
  zero variance, length, custom; unscored), by reason;
- trained: the samples the TrainBatches carried (BATCHES), each sample
  once even if a refill trained its group twice, as the trainer saw it (a
  group's scored part).

Whether trained and generated lengths agree is a two-sample
Kolmogorov-Smirnov test (`ks_2samp`), written here rather than taken from
scipy, which the project does not depend on: exact (Hodges' lattice-path
count, in integers) while the product of the sample sizes is small enough
to count, the Kolmogorov limit with Stephens' small-sample correction above
that. Response lengths are integers with many ties (every reply cut at
`max_new_tokens` has the same length); the p-value is that of the
continuous null, as scipy's, which with ties is conservative (too large).
Note the trained samples are a subset of the generated ones, so the test
asks whether the subset the run kept could be a random draw of what it
generated; what it cannot say is why.

Pure: decoded messages in, figures out. bench/staleness_lengths.py reads a
run directory's store and prints the table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from proto.codec import decode
from proto.errors import ProtocolError
from proto.messages import Chunk, DeadLetter, SampleGroup, TrainBatch

STALE = "stale"  # services/buffer/core.py Verdict.STALE (no service imports another)
EXACT_MAX_CELLS = 2_000_000
"""The largest m x n the exact p-value counts paths over (about a second in Python ints)."""

_GROUP_IN_ERROR = re.compile(r"^group (\S+) ")  # the buffer's drop line: "group <id> (version…"


@dataclass
class Lengths:
    """Response lengths (tokens) by class, and what could not be attributed."""

    generated: list[int] = field(default_factory=list)
    stale: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    dropped: dict[str, list[int]] = field(default_factory=dict)  # other drop reasons
    unattributed: int = 0  # stale dead letters whose group was not found in SAMPLES


def classify(
    groups: Iterable[SampleGroup], batches: Iterable[TrainBatch], dead: Iterable[DeadLetter]
) -> Lengths:
    """Each generated sample's response length, and the classes it fell into (module doc)."""
    by_id: dict[str, SampleGroup] = {}
    for g in groups:
        by_id.setdefault(g.group_id, g)  # a redelivered publish is one group
    out = Lengths(generated=[s.num_response_tokens for g in by_id.values() for s in g.samples])
    seen_dropped: set[str] = set()
    for d in dead:
        gid = dropped_group_id(d)
        if gid is None or gid in seen_dropped:
            continue
        seen_dropped.add(gid)
        group = by_id.get(gid) or _payload_group(d)
        if group is None:
            out.unattributed += d.reason == STALE
            continue
        lengths = [s.num_response_tokens for s in group.samples]
        if d.reason == STALE:
            out.stale.extend(lengths)
        else:
            out.dropped.setdefault(d.reason, []).extend(lengths)
    trained: set[str] = set()
    for b in batches:
        for g in b.groups:
            for s in g.samples:
                if s.sample_id not in trained:
                    trained.add(s.sample_id)
                    out.trained.append(s.num_response_tokens)
    return out


def dropped_group_id(d: DeadLetter) -> str | None:
    """The id of the SampleGroup a dead letter gave up on (None: not a group's)."""
    if d.message_type not in (SampleGroup.TYPE, Chunk.TYPE):
        return None
    group = _payload_group(d)
    if group is not None:
        return group.group_id
    m = _GROUP_IN_ERROR.match(d.error)  # a payload that does not decode: a chunk, say
    return m[1] if m else None


def _payload_group(d: DeadLetter) -> SampleGroup | None:
    try:
        return decode(d.payload, SampleGroup)
    except ProtocolError:
        return None


# ── summaries ─────────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    p50: int
    p90: int


def percentile(sorted_xs: Sequence[int], q: float) -> int:
    """The nearest-rank q-th percentile (0 < q <= 100) of a sorted, non-empty sequence."""
    return sorted_xs[max(0, math.ceil(q / 100 * len(sorted_xs)) - 1)]


def summary(xs: Sequence[int]) -> Summary | None:
    """n, mean, p50, p90 of `xs` (None when empty)."""
    if not xs:
        return None
    s = sorted(xs)
    return Summary(len(s), sum(s) / len(s), percentile(s, 50), percentile(s, 90))


# ── two-sample Kolmogorov-Smirnov ─────────────────────────────────────────────
@dataclass(frozen=True)
class KS:
    statistic: float  # D = sup |F_a - F_b|
    pvalue: float  # P(D >= statistic) under the null that both come from one distribution
    method: str  # "exact" or "asymp"


def ks_distance(a: Sequence[float], b: Sequence[float]) -> int:
    """D x m x n as an integer: max over x of |m·n·(F_a(x) - F_b(x))| = |i·n - j·m|, with
    i, j the counts of a and b at or below x (ties step both ECDFs at once)."""
    xa, xb = sorted(a), sorted(b)
    m, n = len(xa), len(xb)
    i = j = best = 0
    while i < m or j < n:
        x = min(xa[i] if i < m else math.inf, xb[j] if j < n else math.inf)
        while i < m and xa[i] == x:
            i += 1
        while j < n and xb[j] == x:
            j += 1
        best = max(best, abs(i * n - j * m))
    return best


def exact_pvalue(m: int, n: int, h: int) -> float:
    """P(D·m·n >= h) for samples of m and n from one continuous distribution.

    Every ordering of the m + n values is equally likely: a lattice path
    from (0, 0) to (m, n), a step right for a value of a, up for one of b.
    D·m·n >= h exactly when the path touches a point with |i·n - j·m| >= h,
    so the p-value is 1 - (paths that never do) / C(m + n, m), counted
    row by row in exact integers (Hodges 1957).
    """
    if h <= 0:
        return 1.0
    row = [0] * (n + 1)
    for j in range(n + 1):  # i = 0
        if j * m >= h:
            break
        row[j] = 1
    for i in range(1, m + 1):
        left = 0
        for j in range(n + 1):
            left = row[j] + left if abs(i * n - j * m) < h else 0
            row[j] = left
    total = math.comb(m + n, m)
    return (total - row[n]) / total  # in integers first: 1 - inside/total loses a tiny p


def kolmogorov_sf(lam: float) -> float:
    """Q(λ) = 2 Σ_{k>=1} (-1)^(k-1) exp(-2 k² λ²): P(sqrt(n)·D > λ) as n -> ∞."""
    if lam < 0.2:  # the series converges slowly here, and Q is 1 to 1e-12
        return 1.0
    total, k = 0.0, 1
    while True:
        term = math.exp(-2.0 * k * k * lam * lam)
        total += term if k % 2 else -term
        if term < 1e-16:
            break
        k += 1
    return max(0.0, min(1.0, 2.0 * total))


def asymp_pvalue(m: int, n: int, d: float) -> float:
    """The Kolmogorov limit at λ = (sqrt(en) + 0.12 + 0.11/sqrt(en))·D, en = m·n/(m + n)
    (Stephens 1970; Numerical Recipes' `kstwo`): within about 1% of the exact value
    once en is past a few dozen."""
    en = m * n / (m + n)
    root = math.sqrt(en)
    return kolmogorov_sf((root + 0.12 + 0.11 / root) * d)


def ks_2samp(a: Sequence[float], b: Sequence[float], exact_max: int = EXACT_MAX_CELLS) -> KS:
    """The two-sample KS test of `a` against `b` (two-sided); ValueError on an empty sample."""
    m, n = len(a), len(b)
    if m == 0 or n == 0:
        raise ValueError(f"a KS test needs two non-empty samples, not {m} and {n}")
    h = ks_distance(a, b)
    d = h / (m * n)
    if m * n <= exact_max:
        return KS(d, exact_pvalue(m, n, h), "exact")
    return KS(d, asymp_pvalue(m, n, d), "asymp")


# ── the table ─────────────────────────────────────────────────────────────────
def table_rows(label: str, lengths: Lengths) -> list[str]:
    """Markdown rows of one run: a row per class, then the KS tests (trained vs generated,
    stale vs generated)."""
    classes: list[tuple[str, list[int]]] = [
        ("generated", lengths.generated),
        (STALE, lengths.stale),
        *[(f"dropped: {r}", xs) for r, xs in sorted(lengths.dropped.items())],
        ("trained", lengths.trained),
    ]
    rows = []
    for name, xs in classes:
        s = summary(xs)
        if s is None:
            rows.append(f"| {label} | {name} | 0 | - | - | - | |")
            continue
        share = f"{len(xs) / len(lengths.generated):.1%}" if lengths.generated else "-"
        rows.append(f"| {label} | {name} | {s.n} ({share}) | {s.mean:.1f} | {s.p50} | {s.p90} | |")
    for name, xs in (("trained", lengths.trained), (STALE, lengths.stale)):
        if xs and lengths.generated:
            t = ks_2samp(xs, lengths.generated)
            rows.append(
                f"| {label} | KS {name} vs generated | | | | | D = {t.statistic:.4f}, "
                f"p = {t.pvalue:.3g} ({t.method}) |"
            )
    return rows


TABLE_HEAD = (
    "| run | class | samples (share of generated) | mean tokens | p50 | p90 | KS |\n"
    "|---|---|---|---|---|---|---|"
)
