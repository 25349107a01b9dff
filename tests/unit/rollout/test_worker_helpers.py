"""Rollout worker helpers: engine versions, loads, request ids, a sample's versions."""

from __future__ import annotations

from typing import Any

from proto.messages import PromptTask
from proto.weight_version import VersionSpan
from services.engine_api.engine_client import GenerateResult, Load, load_of
from services.rollout.core import request_id, sample_versions


def test_loads_sum_over_ranks_in_both_formats() -> None:
    v1 = {"loads": [{"num_running_reqs": 3, "num_waiting_reqs": 1},
                    {"num_running_reqs": 2, "num_waiting_reqs": 0}]}  # fmt: skip
    assert load_of(v1) == Load(5, 1)
    get_load = [{"num_reqs": 4, "num_waiting_reqs": 1}, {"num_reqs": 2, "num_waiting_reqs": 2}]
    assert load_of(get_load) == Load(3, 3)  # /get_load before 0.5.8: num_reqs = both
    assert load_of({}) == Load(0, 0)


def test_every_delivery_gets_its_own_request_id() -> None:
    task = PromptTask(run="r", task_id="r:e0:i1", epoch=0, index=1, task_name="arithmetic",
                      prompt="1+1=", n=2)  # fmt: skip
    ids = {request_id(task, 1), request_id(task, 1), request_id(task, 2)}
    assert len(ids) == 3 and all(i.startswith("r:e0:i1:a0:d") for i in ids)


def _result(version: str, spans: tuple[tuple[str, int, int], ...]) -> GenerateResult:
    """A completion as the engine's JSON gives it (SGLang's weight versions are text)."""
    meta: dict[str, Any] = {"weight_version": version, "finish_reason": {"type": "length"}}
    if spans:
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in spans]
    return GenerateResult.from_json({"output_ids": [1, 2, 3], "meta_info": meta})


def test_sample_versions_from_spans_or_a_lower_bound() -> None:
    spans = (("3", 0, 1), ("4", 1, 3))
    want = (VersionSpan(version=3, start=0, end=1), VersionSpan(version=4, start=1, end=3))
    assert sample_versions(_result("4", spans), before=3) == (3, 4, want)
    # No spans (SGLang < 0.5.19): the version when the task began bounds the first token.
    assert sample_versions(_result("4", ()), before=3) == (3, 4, ())
    assert sample_versions(_result("default", ()), before=0) == (0, 0, ())
