"""Checkpoints in one process: the one-file format, the old DCP one, torn files, the order.

A one-process trainer writes its model, optimizer and RNG as one `state.pt`
(services/trainer/stateformat.py); a checkpoint written before that (DCP's
`state/` directory plus `rng-rank0.pt`) must still resume a run.
"""

import json
import random
import warnings

import pytest
import torch

from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
from services.trainer.state import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    snapshot,
    stage_checkpoint,
)
from services.trainer.stateformat import model_optim_state, rng_state
from services.trainer.step import save_version
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch

CFG = TrainConfig(
    optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=8),
    model=ModelConfig(micro_batch_tokens=100_000),
)


def _trained(model_dir, steps: int) -> Trainer:
    t = Trainer.from_pretrained(model_dir, CFG)
    for i in range(steps):
        t.train_step(random_batch(seed=30 + i))
    t.weight_version = t.step
    return t


def _assert_same_state(a: Trainer, b: Trainer) -> None:
    """Model, optimizer (moments, step counts, groups), schedule, counters: bit for bit."""
    for name, tensor in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[name], tensor), name
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys() and oa["state"]
    for k, per_param in oa["state"].items():
        for field, v in per_param.items():
            assert torch.equal(ob["state"][k][field], v), (k, field)
    assert a.scheduler.state_dict() == b.scheduler.state_dict()
    assert (a.step, a.weight_version) == (b.step, b.weight_version)


def _next_loss(t: Trainer) -> float:
    return t.train_step(random_batch(seed=99))["loss"]


def test_one_file_checkpoint_resumes_bit_identically(tiny_model_dir, tmp_path):
    """What the service does: save_version from a snapshot; a restart resumes exactly there."""
    live = _trained(tiny_model_dir, 2)
    rng_then = torch.get_rng_state()
    python_then = random.getstate()
    snap = snapshot(live)
    position = {"seq": 41, "batch_id": "b-2"}
    manifest = save_version(live, tmp_path / "w" / "v2", tmp_path / "ckpt", position, snap)
    assert manifest is not None and (tmp_path / "w" / "v2" / "model.safetensors").is_file()

    ckpt = latest_checkpoint(tmp_path / "ckpt")
    assert ckpt is not None and ckpt.name == "step-00000002"
    assert sorted(p.name for p in ckpt.iterdir()) == ["state.pt", "trainer-state.json"]
    torch.manual_seed(12345)  # the restart's RNG differs until the checkpoint restores it
    random.seed(12345)
    resumed = Trainer.from_pretrained(tiny_model_dir, CFG)
    assert load_checkpoint(resumed, ckpt) == position
    _assert_same_state(live, resumed)
    assert torch.equal(torch.get_rng_state(), rng_then) and random.getstate() == python_then
    assert _next_loss(resumed) == _next_loss(live)


def test_a_checkpoint_written_before_the_one_file_format_still_loads(tiny_model_dir, tmp_path):
    """The old layout, as the old save_checkpoint wrote it in one process: DCP's state/."""
    import torch.distributed.checkpoint as dcp

    live = _trained(tiny_model_dir, 2)
    old = tmp_path / "step-00000002"
    old.mkdir()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(model_optim_state(live), checkpoint_id=old / "state")
    torch.save(rng_state(), old / "rng-rank0.pt")
    doc = {
        "step": live.step,
        "weight_version": live.weight_version,
        "world_size": 1,
        "scheduler": live.scheduler.state_dict(),
        "input_position": {"seq": 7},
    }
    (old / "trainer-state.json").write_text(json.dumps(doc))
    (tmp_path / "latest").write_text(old.name)

    resumed = Trainer.from_pretrained(tiny_model_dir, CFG)
    assert load_checkpoint(resumed, latest_checkpoint(tmp_path)) == {"seq": 7}
    _assert_same_state(live, resumed)
    assert _next_loss(resumed) == _next_loss(live)


@pytest.mark.parametrize("damage", ["truncated", "zeros", "text"])
def test_a_torn_one_file_checkpoint_is_a_typed_error_naming_the_file(
    tiny_model_dir, tmp_path, damage
):
    save_checkpoint(_trained(tiny_model_dir, 1), tmp_path, {"seq": 1})
    state = latest_checkpoint(tmp_path) / "state.pt"
    data = state.read_bytes()
    bad = {"truncated": data[: len(data) // 2], "zeros": b"\x00" * 4096, "text": b"hi" * 99}
    state.write_bytes(bad[damage])
    with pytest.raises(CheckpointError, match=r"state\.pt") as e:
        load_checkpoint(Trainer.from_pretrained(tiny_model_dir, CFG), state.parent)
    assert e.value.path == state


def test_a_checkpoint_without_model_state_is_a_typed_error(tiny_model_dir, tmp_path):
    ckpt = save_checkpoint(_trained(tiny_model_dir, 1), tmp_path)
    (ckpt / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="holds no model state") as e:
        load_checkpoint(Trainer.from_pretrained(tiny_model_dir, CFG), ckpt)
    assert e.value.path == ckpt


def test_a_staged_checkpoint_is_not_the_latest_until_committed(tiny_model_dir, tmp_path):
    """A crash between staging and committing leaves the previous checkpoint in force."""
    t = _trained(tiny_model_dir, 1)
    save_checkpoint(t, tmp_path, {"seq": 1})
    t.train_step(random_batch(seed=40))
    stage_checkpoint(t, tmp_path, {"seq": 2})  # no commit: the process "died" here
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    assert load_checkpoint(
        Trainer.from_pretrained(tiny_model_dir, CFG), tmp_path / "step-00000001"
    ) == {"seq": 1}


def test_no_checkpoint_is_committed_when_its_weights_directory_fails(tiny_model_dir, tmp_path):
    """The checkpoint is staged beside the weights but never names a version without them."""
    t = _trained(tiny_model_dir, 1)
    save_checkpoint(t, tmp_path / "ckpt", {"seq": 1})
    t.train_step(random_batch(seed=41))
    t.weight_version = t.step
    (tmp_path / "not-a-dir").write_text("")  # the weights directory cannot be created
    with pytest.raises(OSError):
        save_version(t, tmp_path / "not-a-dir" / "v2", tmp_path / "ckpt", {"seq": 2}, snapshot(t))
    assert latest_checkpoint(tmp_path / "ckpt").name == "step-00000001"
