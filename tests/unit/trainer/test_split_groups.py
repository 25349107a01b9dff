"""Mini-batches of whole groups, for several optimizer steps per RL batch."""

from __future__ import annotations

import torch

from services.trainer.core.batching import TensorBatch, split_groups


def batch(groups: list[int]) -> TensorBatch:
    n = len(groups)
    return TensorBatch(
        prompt_ids=[torch.tensor([1, 2])] * n,
        response_ids=[torch.tensor([i, i]) for i in range(n)],
        rollout_logprobs=[torch.zeros(2)] * n,
        rewards=torch.arange(n, dtype=torch.float32),
        group_ids=torch.tensor(groups),
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def test_groups_stay_whole_and_every_sample_lands_once() -> None:
    b = batch([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    parts = split_groups(b, 2)
    assert len(parts) == 2
    seen = sorted(int(r[0]) for p in parts for r in p.response_ids)
    assert seen == list(range(10))
    for p in parts:
        p.validate()
        ids = p.group_ids.tolist()
        for g in set(ids):
            assert ids.count(g) == 2  # never split
    assert [sorted(set(p.group_ids.tolist())) for p in parts] == [[0, 2, 4], [1, 3]]


def test_one_part_or_more_parts_than_groups() -> None:
    b = batch([7, 7, 9])
    assert split_groups(b, 1) == [b]
    assert len(split_groups(b, 5)) == 2
