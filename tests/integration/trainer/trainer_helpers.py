"""Shared builders for the trainer integration tests (and the torchrun worker)."""

from __future__ import annotations

import torch

from services.trainer.core.batching import TensorBatch


def random_batch(
    seed: int = 0,
    groups: int = 3,
    per_group: int = 4,
    vocab: int = 90,
    temperature: float = 1.0,
) -> TensorBatch:
    """A deterministic RL batch of varied lengths with a partial loss mask."""
    g = torch.Generator().manual_seed(seed)
    n = groups * per_group
    prompts, responses, logps, masks = [], [], [], []
    for _ in range(n):
        p = int(torch.randint(2, 7, (1,), generator=g))
        r = int(torch.randint(1, 9, (1,), generator=g))
        prompts.append(torch.randint(3, vocab, (p,), generator=g))
        responses.append(torch.randint(3, vocab, (r,), generator=g))
        logps.append(-torch.rand(r, generator=g) * 3 - 3.5)
        m = torch.ones(r)
        if r > 3:
            m[1] = 0  # a tool token inside the response
        masks.append(m)
    return TensorBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=logps,
        rewards=torch.randint(0, 2, (n,), generator=g).float(),
        group_ids=torch.arange(groups).repeat_interleave(per_group),
        truncated=torch.arange(n) % 5 == 0,
        loss_mask=masks,
        temperature=temperature,
    )
