"""Micro-batch planning, layout, and exact gradient accumulation (toy bigram model)."""

import pytest
import torch

from services.trainer.core.batching import (
    BatchError,
    TensorBatch,
    collate,
    layout_sample,
    plan_micro_batches,
    shard_for_ranks,
)
from services.trainer.core.logprobs import token_logprobs
from services.trainer.core.loss import policy_loss, sample_weights
from services.trainer.settings import LossConfig

V = 11


def test_layout_puts_response_on_target_positions():
    row = layout_sample(
        torch.tensor([5, 6, 7]), torch.tensor([8, 9]), {"m": torch.tensor([1.0, 2.0])}
    )
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9]
    # position 2 predicts token 8, position 3 predicts token 9.
    assert row["m"].tolist() == [0.0, 0.0, 1.0, 2.0]


def test_collate_pads_right_with_zero_weight():
    rows = [
        layout_sample(torch.tensor([1]), torch.tensor([2, 3]), {"m": torch.ones(2)}),
        layout_sample(torch.tensor([1]), torch.tensor([2]), {"m": torch.ones(1)}),
    ]
    mb = collate(rows, pad_id=0)
    assert mb["input_ids"].tolist() == [[1, 2, 3], [1, 2, 0]]
    assert mb["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert mb["m"].tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb["targets"].tolist() == [[2, 3], [2, 0]]


def test_plan_respects_padded_budget():
    lengths = [5, 9, 3, 3, 8, 20]
    plan = plan_micro_batches(lengths, token_budget=18)
    assert sorted(i for g in plan for i in g) == list(range(6))
    for g in plan:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 18
    assert [5] in plan  # the over-long sample goes alone


def test_shards_balance_tokens_and_cover_everything():
    costs = [10, 9, 8, 1, 1, 1]
    shards = shard_for_ranks(costs, 2)
    assert sorted(shards[0] + shards[1]) == list(range(6))
    loads = sorted(sum(costs[i] for i in s) for s in shards)
    assert loads == [13, 17]  # the best split of these costs


def test_validate_names_sample_and_field():
    b = TensorBatch(
        prompt_ids=[torch.tensor([1])],
        response_ids=[torch.tensor([2, 3])],
        rollout_logprobs=[torch.tensor([-1.0])],
        rewards=torch.tensor([1.0]),
        group_ids=torch.tensor([0]),
        truncated=torch.tensor([False]),
    )
    with pytest.raises(BatchError) as e:
        b.validate()
    assert e.value.sample == 0 and e.value.field == "rollout_logprobs"


def _rows(seed=0, n=7):
    g = torch.Generator().manual_seed(seed)
    rows = []
    masks = []
    for _ in range(n):
        p, r = (
            int(torch.randint(1, 4, (1,), generator=g)),
            int(torch.randint(1, 7, (1,), generator=g)),
        )
        m = (torch.rand(r, generator=g) > 0.2).float()
        masks.append(m)
        rows.append(
            (
                torch.randint(0, V, (p,), generator=g),
                torch.randint(0, V, (r,), generator=g),
                m,
                -torch.rand(r, generator=g) - 2,
                float(torch.randn(1, generator=g)),
            )
        )
    return rows


def _loss_and_grad(table, rows, cfg, budget):
    """Loss and d loss / d table, accumulated over micro-batches under `budget`."""
    w = sample_weights(
        torch.tensor([float(r[2].sum()) for r in rows]), cfg.aggregation, cfg.norm_tokens
    )
    laid = [
        layout_sample(
            p,
            r,
            {"loss_mask": m, "weights": m * float(w[i]), "old": old, "adv": torch.full_like(m, a)},
        )
        for i, (p, r, m, old, a) in enumerate(rows)
    ]
    table.grad = None
    total = 0.0
    for group in plan_micro_batches([x["input_ids"].numel() for x in laid], budget):
        mb = collate([laid[i] for i in group], pad_id=0)
        logits = table[mb["input_ids"][:, :-1]]  # bigram model: [B, T-1, V]
        logp = token_logprobs(logits, mb["targets"], temperature=0.7)
        out = policy_loss(logp, mb["old"], mb["adv"], mb["loss_mask"], mb["weights"], cfg)
        out.loss.backward()
        total += float(out.loss.detach())
    return total, table.grad.clone()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_micro_batches_sum_to_the_full_batch(mode, kind):
    torch.manual_seed(0)
    table = torch.randn(V, V, dtype=torch.float64).float().requires_grad_(True)
    rows = _rows()
    cfg = LossConfig(aggregation=mode, policy_loss=kind, eps_low=0.1, eps_high=0.1)
    full_loss, full_grad = _loss_and_grad(table, rows, cfg, budget=10_000)
    micro_loss, micro_grad = _loss_and_grad(table, rows, cfg, budget=8)
    assert full_grad.abs().sum() > 0
    assert micro_loss == pytest.approx(full_loss, abs=1e-6)
    torch.testing.assert_close(micro_grad, full_grad, atol=1e-6, rtol=1e-5)
