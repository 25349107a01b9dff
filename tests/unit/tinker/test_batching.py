"""Sample requests that agree on all but their count share one generation (batching.py)."""

from __future__ import annotations

import dataclasses

from services.tinker.batching import SampleBatches
from services.tinker.core import SampleSpec

SPEC = SampleSpec(
    prompt=(5, 6, 7), num_samples=1, max_tokens=16, temperature=0.7, top_k=-1, top_p=1.0,
    seed=None, stop_tokens=None, stop_strings=(), prompt_logprobs=False,
)  # fmt: skip


def test_requests_join_the_open_batch_and_get_their_own_rows() -> None:
    batches: SampleBatches[str] = SampleBatches(cap=64)
    batch = batches.add("snap", SPEC, "a")
    assert batch is not None
    assert batches.add("snap", SPEC, "b") is None
    assert batches.add("snap", dataclasses.replace(SPEC, num_samples=3), "c") is None
    spec = batches.take("snap", batch)
    assert spec.num_samples == 5 and dataclasses.replace(spec, num_samples=1) == SPEC
    assert batch.slices() == [("a", slice(0, 1)), ("b", slice(1, 2)), ("c", slice(2, 5))]


def test_a_taken_batch_takes_no_more_requests() -> None:
    batches: SampleBatches[str] = SampleBatches(cap=64)
    first = batches.add(None, SPEC, "a")
    assert first is not None
    batches.take(None, first)
    second = batches.add(None, SPEC, "b")
    assert second is not None and second is not first
    assert [m for m, _ in first.members] == ["a"]


def test_what_differs_does_not_batch() -> None:
    batches: SampleBatches[str] = SampleBatches(cap=64)
    assert batches.add("snap", SPEC, "a") is not None
    assert batches.add("other-snapshot", SPEC, "b") is not None
    assert batches.add("snap", dataclasses.replace(SPEC, prompt=(5, 6)), "c") is not None
    assert batches.add("snap", dataclasses.replace(SPEC, temperature=1.0), "d") is not None
    assert batches.add("snap", dataclasses.replace(SPEC, max_tokens=8), "e") is not None


def test_a_seeded_request_runs_alone() -> None:
    batches: SampleBatches[str] = SampleBatches(cap=64)
    seeded = dataclasses.replace(SPEC, seed=3)
    alone = batches.add("snap", seeded, "a")
    assert alone is not None and alone.taken
    assert batches.add("snap", seeded, "b") is not None  # its own batch again
    assert batches.take("snap", alone) == seeded


def test_a_batch_never_passes_the_cap() -> None:
    batches: SampleBatches[str] = SampleBatches(cap=4)
    first = batches.add(None, dataclasses.replace(SPEC, num_samples=3), "a")
    assert first is not None
    assert batches.add(None, SPEC, "b") is None  # 4: at the cap
    second = batches.add(None, SPEC, "c")  # 5 would pass it: a new batch
    assert second is not None and second is not first
    assert batches.take(None, first).num_samples == 4
    assert batches.add(None, SPEC, "d") is None  # joins the newest open one
    assert batches.take(None, second).num_samples == 2
