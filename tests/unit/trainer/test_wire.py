"""A wire TrainBatch becomes the trainer core's tensors without losing anything."""

from __future__ import annotations

import pytest
import torch

from proto.examples import sample
from proto.messages import SampleGroup, TrainBatch, pack_u8
from services.trainer.core.batching import BatchError
from services.trainer.wire import batch_stats, to_tensor_batch


def group(gid: str, temperature: float = 0.7) -> SampleGroup:
    s0 = sample(0)
    s1 = sample(1).model_copy(update={"finish_reason": "length", "loss_mask": pack_u8([1, 0, 1])})
    return SampleGroup(
        run="r", group_id=gid, task_id=gid, task_name="e", worker_id="w", samples=(s0, s1),
        temperature=temperature,
    )  # fmt: skip


def test_groups_flatten_to_samples_with_shared_group_ids() -> None:
    wire = TrainBatch(run="r", batch_id="r:step3", step=3, groups=(group("a"), group("b")))
    b = to_tensor_batch(wire)
    b.validate()
    assert len(b) == 4
    assert b.group_ids.tolist() == [0, 0, 1, 1]
    assert b.rewards.tolist() == [0.0, 1.0, 0.0, 1.0]
    assert b.truncated.tolist() == [False, True, False, True]
    assert b.temperature == pytest.approx(0.7)
    assert b.prompt_ids[0].tolist() == [4, 5, 75, 6, 7, 83] and b.prompt_ids[0].dtype == torch.int64
    assert b.response_ids[1].tolist() == [8, 4, 1]
    assert b.loss_mask is not None and b.loss_mask[1].tolist() == [1, 0, 1]
    torch.testing.assert_close(b.rollout_logprobs[0], torch.tensor([-0.5, -1.25, -0.125]))
    stats = batch_stats(wire)
    assert stats["samples"] == 4 and stats["staleness_max"] == 0.0  # version 3 at step 3
    assert stats["truncated_frac"] == 0.5


def test_mixed_temperatures_are_refused() -> None:
    wire = TrainBatch(run="r", batch_id="r:step0", step=0, groups=(group("a", 1.0), group("b")))
    with pytest.raises(BatchError, match="temperature"):
        to_tensor_batch(wire)


def test_an_unscored_sample_is_refused_never_trained_as_reward_0() -> None:
    """The buffer sends scored samples only (`scored_part`); one that slipped through with
    its failed check's 0 would be a failure posing as a reward in its group's baseline."""
    g = group("a")
    failed = g.samples[1].model_copy(update={"verifier_error": "verifier timed out after 1s"})
    g = g.model_copy(update={"samples": (g.samples[0], failed)})
    wire = TrainBatch(run="r", batch_id="r:step0", step=0, groups=(g,))
    with pytest.raises(BatchError, match=r"no reward.*timed out") as e:
        to_tensor_batch(wire)
    assert (e.value.sample, e.value.field) == (1, "verifier_error")
