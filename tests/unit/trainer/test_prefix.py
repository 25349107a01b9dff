"""The tree layout of prefix-shared groups (core/prefix.py) and its attention views."""

import torch

from services.trainer.attention import view_attention
from services.trainer.core.prefix import Tree, collate_trees, common_prefix, plan_trees


def _row(ids: list[int]) -> dict[str, torch.Tensor]:
    t = torch.tensor(ids)
    return {"input_ids": t, "loss_mask": torch.arange(1, t.numel()).float()}


def test_common_prefix():
    assert common_prefix([torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])]) == 2
    assert common_prefix([torch.tensor([1, 2]), torch.tensor([1, 2, 4])]) == 2
    assert common_prefix([torch.tensor([7, 2]), torch.tensor([1, 2])]) == 0
    assert common_prefix([torch.tensor([1, 2, 3])]) == 3


def test_a_group_is_one_tree_its_prefix_once_and_entries_read_the_shared_state():
    rows = [_row([5, 6, 7, 1, 2]), _row([5, 6, 7, 3]), _row([9, 9])]
    trees = plan_trees(rows, [0, 0, 1], token_budget=100)
    assert trees == [Tree((0, 1), 3), Tree((2,), 2)]
    mb = collate_trees(rows, trees)
    # prefix 5 6 7, suffixes 1 2 and 3; then the lone row 9 9 (its own prefix)
    assert mb["input_ids"].tolist() == [[5, 6, 7, 1, 2, 3, 9, 9]]
    assert mb["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 0, 1]]
    # entries: row 0 predicts 6 7 1 2, row 1 predicts 6 7 3, row 2 predicts 9
    assert mb["targets"].tolist() == [[6, 7, 1, 2, 6, 7, 3, 9]]
    # the last prefix token (row position 2) predicts both samples' first own token
    assert mb["hidden_index"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 6]]
    assert mb["seq_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert mb["loss_mask"].tolist() == [[1, 2, 3, 4, 1, 2, 3, 1]]
    # every row position is the query of exactly one view
    q = mb["view_q"][mb["view_q"] < 8]
    assert sorted(q.tolist()) == list(range(8))


def test_a_group_over_the_budget_splits_and_each_part_repeats_the_prefix():
    rows = [_row([1, 2, 3, 4, 10 + i, 20 + i]) for i in range(5)]
    trees = plan_trees(rows, [0] * 5, token_budget=9)
    assert [t.members for t in trees] == [(0, 1), (2, 3), (4,)]
    assert [t.prefix for t in trees] == [4, 4, 6]  # a lone sample is all prefix
    assert all(t.cost([6] * 5) <= 9 for t in trees)


def _dense_reference(q, k, v, pos, visible):
    """Plain attention with an explicit [S, S] visibility matrix (GQA by repetition)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    out = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v  # [1, H, S, D]
    return out.transpose(1, 2)


def test_view_attention_is_tree_attention():
    """A suffix sees the prefix and itself causally, never a sibling; a lone row is causal."""
    rows = [_row([5, 6, 7, 1, 2]), _row([5, 6, 7, 3, 4, 8]), _row([9, 9, 9])]
    mb = collate_trees(rows, plan_trees(rows, [0, 0, 1], token_budget=100))
    s = mb["input_ids"].shape[1]
    # which tree, and which branch of it (0: the prefix; a lone row is all prefix)
    tree = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1])
    branch = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 0, 0, 0])
    pos = mb["position_ids"][0]
    same_tree = tree[:, None] == tree[None, :]
    own_or_prefix = (branch[:, None] == branch[None, :]) | (branch[None, :] == 0)
    visible = same_tree & own_or_prefix & (pos[None, :] <= pos[:, None])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    views = {key: mb[key] for key in ("view_q", "view_k", "view_q_pos", "view_k_pos", "view_out")}
    got, _ = view_attention(q, k, v, views, None)
    want = _dense_reference(q, k, v, pos, visible)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b)
