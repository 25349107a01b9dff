"""state.py: the tinker:// paths, the names, and a save that is whole or absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.tinker.core import TinkerUserError, UnknownName
from services.tinker.state import StateMeta, StateStore, check_name, parse_path, tinker_path

META = StateMeta("m", 4, True, True, False, steps=3, created=1.5e9, user_metadata={"k": "v"})


def test_paths_round_trip_and_bad_ones_say_why() -> None:
    assert parse_path(tinker_path("session-ab-1:train:0", "step3")) == (
        "session-ab-1:train:0",
        "step3",
    )
    for bad in ("s3://x/weights/a", "tinker://run/weights", "tinker:///weights/a", 7):
        with pytest.raises(TinkerUserError, match="tinker://"):
            parse_path(bad)
    with pytest.raises(TinkerUserError, match="sampler weights hold no optimizer"):
        parse_path("tinker://run/sampler_weights/a")
    for bad_name in ("", "../x", "a/b", ".hidden", "x" * 129, None):
        with pytest.raises(TinkerUserError, match="save_state name"):
            check_name(bad_name)


def _optimizer() -> dict[str, object]:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()
    return opt.state_dict()


def test_save_load_list_and_overwrite(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    tensors = {"layer.lora_A.weight": torch.arange(6.0).reshape(2, 3)}
    path = store.save("run:1", "s", META, tensors, _optimizer(), overwrite=False)
    assert path == "tinker://run:1/weights/s"
    meta, loaded, opt = store.load("run:1", "s", optimizer=True)
    assert meta == META
    assert torch.equal(loaded["layer.lora_A.weight"], tensors["layer.lora_A.weight"])
    assert opt is not None and torch.equal(
        opt["state"][0]["exp_avg"], _optimizer()["state"][0]["exp_avg"]
    )
    assert store.load("run:1", "s", optimizer=False)[2] is None
    [listed] = store.list("run:1")
    assert (listed["tinker_path"], listed["user_metadata"]) == (path, {"k": "v"})
    assert listed["size_bytes"] > 0
    with pytest.raises(TinkerUserError, match="overwrite=True"):
        store.save("run:1", "s", META, tensors, _optimizer(), overwrite=False)
    twice = {"layer.lora_A.weight": 2 * tensors["layer.lora_A.weight"]}
    store.save("run:1", "s", META, twice, _optimizer(), overwrite=True)
    assert torch.equal(store.load("run:1", "s", optimizer=False)[1]["layer.lora_A.weight"],
                       twice["layer.lora_A.weight"])  # fmt: skip
    assert not list((tmp_path / ".tmp").iterdir())  # nothing left beside the states
    with pytest.raises(UnknownName, match="no saved state"):
        store.meta("run:1", "other")
    assert store.list("nobody") == []


def test_a_save_that_dies_midway_leaves_nothing_under_its_name(tmp_path: Path) -> None:
    store = StateStore(tmp_path)
    bad = {"w": torch.ones(2)[None].expand(3, 2)}  # fine; the optimizer state below is not
    with pytest.raises(Exception):  # noqa: B017 - any failure of torch.save will do
        store.save("run", "s", META, bad, {"x": lambda: 0}, overwrite=False)
    assert not store.exists("run", "s")
    assert store.list("run") == []
    StateStore(tmp_path)  # a restart sweeps what the dead save left in .tmp
    assert not (tmp_path / ".tmp").exists()
