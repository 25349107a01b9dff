"""Packing plans and the packed layout."""

import torch

from services.trainer.core.batching import layout_sample, plan_micro_batches
from services.trainer.core.packing import collate_packed, plan_packed


def test_plan_packs_within_budget_and_covers_everything():
    lengths = [7, 3, 9, 2, 5, 5, 12, 1]
    plan = plan_packed(lengths, 12)
    assert sorted(i for g in plan for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 12 for g in plan)
    assert len(plan) == 4  # 44 tokens: ceil(44 / 12), which first-fit decreasing reaches here
    assert plan_packed([20, 3], 10) == [[0], [1]]  # too long: alone


def test_packing_needs_fewer_micro_batches_than_padding_on_mixed_lengths():
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(8, 200, (64,), generator=g)]
    padded, packed = plan_micro_batches(lengths, 512), plan_packed(lengths, 512)
    assert len(packed) < len(padded)
    assert len(packed) <= -(-sum(lengths) // 512) + 1


def test_collate_packed_layout():
    rows = [
        layout_sample(torch.tensor([5, 6]), torch.tensor([7, 8, 9]), {"w": torch.ones(3)}),
        layout_sample(torch.tensor([1]), torch.tensor([2]), {"w": torch.full((1,), 2.0)}),
    ]
    mb = collate_packed(rows, pad_id=0)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert mb["seq_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 1]]
    # target of position j is token j + 1 of the same sequence; boundary slots carry 0 weight
    assert mb["targets"].tolist() == [[6, 7, 8, 9, 0, 2, 0]]
    assert mb["w"].tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 0.0]]
    assert mb["cu_seqlens"].tolist() == [0, 5, 7] and int(mb["max_len"]) == 5
