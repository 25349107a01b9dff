"""Prefix-shared groups: a group's samples computed as one tree, their common prefix once.

A GRPO group is n replies to one prompt. Laid out as n sequences, the
prompt's forward and backward run n times; with a ~50-token prompt and
~10-token replies, 8 samples cost ~480 token positions where ~130 differ.
Here a group becomes one *tree segment* of a packed row: the longest
common prefix of its samples' token ids (the prompt, and more where the
replies, or a multi-turn episode's turns, start alike), then each sample's
own suffix:

    row:       [ prefix (L) | suffix_1 | suffix_2 | ... | suffix_n ]
    positions:   0 .. L-1     L .. T_1-1  L .. T_2-1        (RoPE sees each sample as it was)

Attention follows the tree: a prefix token sees the prefix causally, a
suffix token sees the whole prefix and its own suffix up to itself, never a
sibling's. The attention kernel gets this as *views*: view 0 of a segment is
(queries = the prefix, keys = the prefix), view i is (queries = suffix_i,
keys = prefix ++ suffix_i), and within a view a key is visible to a query
iff its position id is not greater (services/trainer/attention.py). Every
token's hidden state is then exactly the one it has in its own unshared
sequence, so logprobs, losses and gradients equal the unshared path's up to
float rounding (tests/unit/trainer/test_prefix.py holds them to it).

Per-token fields are laid out per *entry*: sample i's T_i - 1 target
positions, exactly as core/batching.py lays out one sample, concatenated
over samples. An entry's logprob is read from the hidden state at
`hidden_index` (a prefix position for entries inside the prefix, shared by
all the samples: the last prefix token predicts each sample's first own
token) with the entry's own `targets` token. So the loss code sees the same
fields, in the same order, as for unshared packed rows, less the boundary
slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Row = dict[str, torch.Tensor]

# Position id of padding in a view: pad queries see every real key (never a softmax over
# nothing, which would put NaN into the backward), pad keys are seen by no query.
PAD_QUERY_POS = 2**30
PAD_KEY_POS = 2**30 + 1


def common_prefix(seqs: list[torch.Tensor]) -> int:
    """Length of the longest common prefix of 1-D token tensors."""
    shortest = min(s.numel() for s in seqs)
    first = seqs[0][:shortest]
    same = torch.ones(shortest, dtype=torch.bool)
    for s in seqs[1:]:
        same &= s[:shortest] == first
    differs = (~same).nonzero()
    return int(differs[0]) if differs.numel() else shortest


@dataclass(frozen=True)
class Tree:
    """Some samples of one group (indices into the rows) and their common prefix length."""

    members: tuple[int, ...]
    prefix: int

    def cost(self, lengths: list[int]) -> int:
        """Token positions the tree takes in a packed row."""
        return self.prefix + sum(lengths[i] - self.prefix for i in self.members)


def plan_trees(rows: list[Row], group_ids: list[int], token_budget: int) -> list[Tree]:
    """Each group's rows as trees of at most `token_budget` positions (a group too large
    for one is split, each part repeating the prefix; one row longer than the budget is a
    tree of its own). Groups in first-seen order, members in row order: deterministic."""
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        by_group.setdefault(g, []).append(i)
    lengths = [r["input_ids"].numel() for r in rows]
    trees: list[Tree] = []
    for members in by_group.values():
        part: list[int] = []
        for i in members:
            grown = _tree(rows, [*part, i])
            if part and grown.cost(lengths) > token_budget:
                trees.append(_tree(rows, part))
                part = [i]
            else:
                part.append(i)
        trees.append(_tree(rows, part))
    return trees


def _tree(rows: list[Row], members: list[int]) -> Tree:
    return Tree(tuple(members), common_prefix([rows[i]["input_ids"] for i in members]))


def collate_trees(rows: list[Row], trees: list[Tree]) -> dict[str, torch.Tensor]:
    """Trees as one packed row with its entries and attention views (module docstring).

    Returns input_ids, position_ids [1, S]; targets, hidden_index, seq_ids and every
    per-token field of the rows [1, E]; the views as view_q / view_k [m, W] row
    positions (S where padded), view_q_pos / view_k_pos [m, W] their position ids, and
    view_out [S]: where each row position's query sits in the flattened [m · Wq] views.
    """
    ids: list[torch.Tensor] = []
    pos: list[torch.Tensor] = []
    hidden: list[torch.Tensor] = []
    views: list[tuple[torch.Tensor, torch.Tensor]] = []
    order: list[int] = []  # rows in entry order
    start = 0
    for tree in trees:
        first = rows[tree.members[0]]["input_ids"]
        p = tree.prefix
        prefix_at = torch.arange(start, start + p)
        ids.append(first[:p].long())
        pos.append(torch.arange(p))
        if p:
            views.append((prefix_at, prefix_at))
        start += p
        for i in tree.members:
            x = rows[i]["input_ids"]
            own = x.numel() - p
            own_at = torch.arange(start, start + own)
            ids.append(x[p:].long())
            pos.append(torch.arange(p, x.numel()))
            if own:
                views.append((own_at, torch.cat([prefix_at, own_at])))
            # Target position j reads the hidden state of token j: in the prefix while j < p.
            hidden.append(torch.cat([prefix_at, own_at])[: x.numel() - 1])
            order.append(i)
            start += own
    size = start
    out: dict[str, torch.Tensor] = {
        "input_ids": torch.cat(ids)[None],
        "position_ids": torch.cat(pos)[None],
        "hidden_index": torch.cat(hidden)[None],
        "targets": torch.cat([rows[i]["input_ids"][1:].long() for i in order])[None],
        "seq_ids": torch.cat(
            [torch.full((rows[i]["input_ids"].numel() - 1,), j) for j, i in enumerate(order)]
        )[None],
    }
    for name in rows[order[0]]:
        if name != "input_ids":
            out[name] = torch.cat([rows[i][name] for i in order])[None]
    out |= _views(views, out["position_ids"][0], size)
    return out


def _views(views: list[tuple[torch.Tensor, torch.Tensor]], pos: torch.Tensor, size: int) -> Row:
    """The views as padded index and position tensors [m, Wq] / [m, Wk] (pad index: `size`),
    and view_out [size]: each row position's place among the m · Wq queries (each position
    is the query of exactly one view)."""
    wq = max(q.numel() for q, _ in views)
    wk = max(k.numel() for _, k in views)
    m = len(views)
    q_at = torch.full((m, wq), size, dtype=torch.long)
    k_at = torch.full((m, wk), size, dtype=torch.long)
    q_pos = torch.full((m, wq), PAD_QUERY_POS, dtype=torch.long)
    k_pos = torch.full((m, wk), PAD_KEY_POS, dtype=torch.long)
    for v, (q, k) in enumerate(views):
        q_at[v, : q.numel()], q_pos[v, : q.numel()] = q, pos[q]
        k_at[v, : k.numel()], k_pos[v, : k.numel()] = k, pos[k]
    out = torch.empty(size, dtype=torch.long)
    valid = q_at < size
    out[q_at[valid]] = torch.arange(m * wq).view(m, wq)[valid]
    return {
        "view_q": q_at,
        "view_k": k_at,
        "view_q_pos": q_pos,
        "view_k_pos": k_pos,
        "view_out": out,
    }


# The micro-batch keys that describe attention views (the model's forward gets them together).
VIEW_KEYS = ("view_q", "view_k", "view_q_pos", "view_k_pos", "view_out")
