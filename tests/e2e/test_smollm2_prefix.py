"""Prefix-shared groups on a real pretrained model: SmolLM2-135M-Instruct (`make smollm2`,
which make test-long runs first) gives the unshared path's logprobs, loss and gradients.

The tiny model's tests (tests/integration/trainer/test_prefix_sharing.py) cover the
losses and layouts; this one checks the same tree on a real model's shapes (grouped-query
attention 9/3 heads, 30 layers, a 49k vocabulary, tied embeddings) in float32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from services.models.gguf_import import models_dir
from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
from services.trainer.trainer import Trainer
from tests.integration.trainer.test_prefix_sharing import _run

pytestmark = [pytest.mark.slow, pytest.mark.long]


def _batch(vocab: int):
    """Two groups of 8 replies (1-16 tokens) to 50-token prompts: demo-real's shape."""
    from services.trainer.core.batching import TensorBatch

    g = torch.Generator().manual_seed(0)
    prompts, replies, logps, gids = [], [], [], []
    for group in range(2):
        prompt = torch.randint(10, vocab, (50,), generator=g)
        for _ in range(8):
            r = int(torch.randint(1, 17, (1,), generator=g))
            prompts.append(prompt.clone())
            replies.append(torch.randint(10, vocab, (r,), generator=g))
            logps.append(-torch.rand(r, generator=g) * 2 - 0.1)
            gids.append(group)
    return TensorBatch(
        prompt_ids=prompts,
        response_ids=replies,
        rollout_logprobs=logps,
        rewards=torch.tensor([float(i % 3 == 0) for i in range(16)]),
        group_ids=torch.tensor(gids),
        truncated=torch.zeros(16, dtype=torch.bool),
        temperature=0.7,
    )


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_smollm2_shared_groups_equal_unshared(precision):
    model = models_dir() / "SmolLM2-135M-Instruct"
    assert (model / "config.json").exists(), f"{model}: run `make smollm2` first"

    def trainer(share: bool) -> Trainer:
        cfg = TrainConfig(
            optim=OptimConfig(lr=1e-6),
            model=ModelConfig(packing=True, share_prefix=share, precision=precision, cpu_threads=1),
        )
        return Trainer.from_pretrained(model, cfg)

    plain, shared = trainer(False), trainer(True)
    batch = _batch(int(plain.model.config.vocab_size))
    want_loss, _, want_lp, want, want_tokens = _run(plain, batch)
    got_loss, _, got_lp, got, got_tokens = _run(shared, batch)
    assert got_tokens < 0.35 * want_tokens
    if precision == "fp32":
        assert got_loss == pytest.approx(want_loss, abs=1e-5)
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=0)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-3, msg=name)
    else:  # bf16: the shared path rounds differently, as packed rows do against padded ones
        assert got_loss == pytest.approx(want_loss, abs=2e-2)
        diff = (torch.tensor(got_lp) - torch.tensor(want_lp)).abs()
        assert float(diff.mean()) < 0.05
