"""services/replay/lengths.py: response lengths by class and the two-sample KS test."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from proto.codec import encode
from proto.messages import (
    DeadLetter,
    FinishReason,
    Sample,
    SampleGroup,
    TrainBatch,
    pack_f32,
    pack_i32,
    pack_u8,
)
from services.replay.lengths import (
    classify,
    exact_pvalue,
    kolmogorov_sf,
    ks_2samp,
    ks_distance,
    percentile,
    summary,
    table_rows,
)

RUN = "len"


def sample(gid: str, i: int, length: int) -> Sample:
    return Sample(sample_id=f"{gid}:s{i}", group_id=gid, task_id=f"{gid}-task", index=i,
                  prompt_ids=pack_i32([1, 2]), response_ids=pack_i32([3] * length),
                  logprobs=pack_f32([-0.1] * length), loss_mask=pack_u8([1] * length),
                  reward=float(i % 2), finish_reason=FinishReason.STOP, weight_version=0,
                  weight_version_last=0, engine_id="engine-0")  # fmt: skip


def group(gid: str, *lengths: int) -> SampleGroup:
    return SampleGroup(run=RUN, group_id=gid, task_id=f"{gid}-task", env="arith",
                       worker_id="rollout-0",
                       samples=tuple(sample(gid, i, n) for i, n in enumerate(lengths)))  # fmt: skip


def dead(reason: str, payload: bytes, error: str = "", mtype: str = "SampleGroup") -> DeadLetter:
    return DeadLetter(run=RUN, reason=reason, error=error, subject=f"flywheel.{RUN}.samples",
                      message_type=mtype, payload=payload, service="buffer")  # fmt: skip


def test_each_sample_lands_in_the_classes_the_run_recorded() -> None:
    g_trained, g_stale, g_flat, g_chunked = (group("a", 2, 3), group("b", 9, 8),
                                             group("c", 5, 5), group("d", 7, 6))  # fmt: skip
    g_pending = group("e", 4)  # generated, never decided (the run stopped first)
    # a refill trains group a twice; the trainer saw its samples twice, the count is once
    batches = [TrainBatch(run=RUN, batch_id="b0", step=0, groups=(g_trained,)),
               TrainBatch(run=RUN, batch_id="b1", step=1, groups=(g_trained,))]  # fmt: skip
    letters = [
        dead("stale", encode(g_stale)),
        dead("zero_variance", encode(g_flat)),
        # a group published in chunks: the dead letter holds its last chunk; the buffer's
        # line names the group
        dead("stale", b"\x00not a group", "group d (version 0) dropped at step 2: stale", "Chunk"),
        dead("stale", encode(g_stale)),  # dead-lettered twice (a redelivery): once
        dead("verifier_timeout", b"task", "no group here", mtype="PromptTask"),
    ]
    groups = [g_trained, g_stale, g_flat, g_chunked, g_pending, g_stale]
    out = classify(groups, batches, letters)
    assert sorted(out.generated) == [2, 3, 4, 5, 5, 6, 7, 8, 9]
    assert sorted(out.stale) == [6, 7, 8, 9]
    assert out.dropped == {"zero_variance": [5, 5]}
    assert sorted(out.trained) == [2, 3]
    assert out.unattributed == 0


def test_a_stale_group_missing_from_samples_is_taken_from_its_dead_letter() -> None:
    g = group("x", 11, 12)
    out = classify([], [], [dead("stale", encode(g))])
    assert sorted(out.stale) == [11, 12] and out.generated == []
    out = classify([], [], [dead("stale", b"junk", "group y (version 3) dropped", "Chunk")])
    assert out.stale == [] and out.unattributed == 1


def test_summaries_use_nearest_rank_percentiles() -> None:
    xs = list(range(1, 11))
    assert percentile(xs, 50) == 5 and percentile(xs, 90) == 9 and percentile(xs, 100) == 10
    s = summary([7, 1, 3])
    assert s is not None and (s.n, s.mean, s.p50, s.p90) == (3, pytest.approx(11 / 3), 3, 7)
    assert summary([]) is None


def test_the_distance_counts_ties_on_both_sides_at_once() -> None:
    # F_a jumps to 1 at 1; F_b is 1/2 there: D = 1/2, times m·n = 2·2 -> 2
    assert ks_distance([1, 1], [1, 2]) == 2
    assert ks_distance([1, 2, 3], [1, 2, 3]) == 0
    assert ks_distance([1, 2], [3, 4, 5]) == 6  # disjoint: D = 1, m·n = 6


def brute_pvalue(a: list[int], b: list[int]) -> float:
    """P(D >= observed) over every way of splitting the pooled values into two samples of
    the same sizes (distinct values: the permutation distribution is the null)."""
    pooled, m = a + b, len(a)
    h = ks_distance(a, b)
    splits = list(itertools.combinations(range(len(pooled)), m))
    hits = 0
    for idx in splits:
        chosen = set(idx)
        xa = [pooled[i] for i in idx]
        xb = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        hits += ks_distance(xa, xb) >= h
    return hits / len(splits)


@pytest.mark.parametrize("seed", range(6))
def test_the_exact_pvalue_is_the_permutation_distribution(seed: int) -> None:
    rng = random.Random(seed)
    m, n = rng.randint(2, 6), rng.randint(2, 7)
    values = rng.sample(range(1000), m + n)
    a, b = values[:m], values[m:]
    assert ks_2samp(a, b).pvalue == pytest.approx(brute_pvalue(a, b), abs=1e-12)


@pytest.mark.parametrize(("n", "k"), [(5, 1), (5, 3), (10, 4), (20, 7), (40, 12)])
def test_equal_sizes_match_the_closed_form(n: int, k: int) -> None:
    # Gnedenko-Korolyuk: P(D_{n,n} >= k/n) = 2 sum_j (-1)^(j+1) C(2n, n - jk) / C(2n, n)
    closed = 2 * sum((-1) ** (j + 1) * math.comb(2 * n, n - j * k)
                     for j in range(1, n // k + 1)) / math.comb(2 * n, n)  # fmt: skip
    assert exact_pvalue(n, n, k * n) == pytest.approx(min(1.0, closed), rel=1e-12)


def test_kolmogorov_sf_known_values() -> None:
    # Q(λ) at the classic critical points: 1.358 -> 0.05, 1.628 -> 0.01, 1.224 -> 0.10
    assert kolmogorov_sf(1.3581) == pytest.approx(0.05, abs=2e-4)
    assert kolmogorov_sf(1.6276) == pytest.approx(0.01, abs=1e-4)
    assert kolmogorov_sf(1.2238) == pytest.approx(0.10, abs=2e-4)
    assert kolmogorov_sf(0.0) == 1.0 and kolmogorov_sf(10.0) < 1e-80


RNG = random.Random(0)
UNIFORM_400 = [RNG.randint(1, 256) for _ in range(400)]
UNIFORM_600 = [RNG.randint(1, 256) for _ in range(600)]
SHORT_400 = [RNG.randint(1, 200) for _ in range(400)]
# scipy 1.17.1's ks_2samp(x, y, method="exact") on the same samples (many ties: integer
# lengths), computed in a throwaway venv, since the project does not depend on scipy
X = [0.61, 0.29, 0.06, 0.59, -1.73, -0.74, 0.51, -0.56, 0.39, 1.64, 0.05, -0.06, 0.64, -0.82,
     0.37, 1.77, 1.09, -1.28, 2.36, 1.31, 1.05, -0.52, -0.73, -0.46]  # fmt: skip
Y = [-0.41, -0.05, 0.73, 0.91, 0.30, 1.30, -0.10, 2.71, 0.55, 1.56, 1.73, 0.75, 1.87, -0.28,
     0.20, 1.49]  # fmt: skip
SCIPY_EXACT = [
    (UNIFORM_400, UNIFORM_600, 0.0425, 0.7674367143081813),
    (SHORT_400, UNIFORM_600, 0.22666666666666666, 2.8872120927540002e-11),
    (X, Y, 0.3333333333333333, 0.20536232095907972),
]


@pytest.mark.parametrize(("a", "b", "d", "p"), SCIPY_EXACT)
def test_exact_matches_scipy(a: list[float], b: list[float], d: float, p: float) -> None:
    t = ks_2samp(a, b)
    assert t.method == "exact"
    assert t.statistic == pytest.approx(d, rel=1e-12)
    assert t.pvalue == pytest.approx(p, rel=1e-9)


@pytest.mark.parametrize(("a", "b", "d", "p"), SCIPY_EXACT)
def test_the_asymptotic_pvalue_is_near_the_exact_one(
    a: list[float], b: list[float], d: float, p: float
) -> None:
    t = ks_2samp(a, b, exact_max=0)
    assert t.method == "asymp" and t.statistic == pytest.approx(d, rel=1e-12)
    assert t.pvalue == pytest.approx(p, rel=0.15)  # measured: 0.4%, 10%, 7.5% off


def test_same_distribution_passes_and_a_shift_fails() -> None:
    a, b, short = UNIFORM_400, UNIFORM_600, SHORT_400  # short: the long replies missing
    assert ks_2samp(a, b).pvalue > 0.05
    assert ks_2samp(short, b).pvalue < 1e-6
    assert ks_2samp(a, b).method == "exact"
    assert ks_2samp(a, b, exact_max=100).method == "asymp"
    with pytest.raises(ValueError, match="non-empty"):
        ks_2samp([], b)


def test_the_table_has_a_row_per_class_and_the_tests() -> None:
    out = classify([group("a", 2, 3), group("b", 9, 8)],
                   [TrainBatch(run=RUN, batch_id="b0", step=0, groups=(group("a", 2, 3),))],
                   [dead("stale", encode(group("b", 9, 8)))])  # fmt: skip
    rows = table_rows("run", out)
    names = ["generated", "stale", "trained", "KS trained vs generated", "KS stale vs generated"]
    assert [r.split(" | ")[1] for r in rows] == names
    assert "| 2 (50.0%) | 2.5 | 2 | 3 |" in rows[2]
