"""The Trainer's mismatch metrics on a real model: 0 against its own logprobs, the
closed form against logprobs shifted by a constant, only on same-version tokens."""

import math

import pytest
import torch

from services.trainer.core.logprobs import token_logprobs
from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch


@torch.no_grad()
def own_logprobs(trainer: Trainer, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """The model's logprob of each response token, as an engine with the same weights reports."""
    ids = torch.cat([prompt, response]).long()[None]
    logits = trainer.model(input_ids=ids).logits.float()
    lp = token_logprobs(logits[:, :-1], ids[:, 1:])[0]
    return lp[prompt.numel() - 1 :]


@pytest.mark.parametrize("old", ["rollout", "recompute"])
def test_mismatch_is_measured_on_tokens_of_the_trainers_version(tiny_model_dir, old):
    cfg = TrainConfig(
        loss=LossConfig(old_logprobs=old),
        optim=OptimConfig(lr=1e-3),
        # float32, padded: the same numerics as `own_logprobs`, so the gap is the shift alone
        model=ModelConfig(precision="fp32", packing=False),
    )
    trainer = Trainer.from_pretrained(tiny_model_dir, cfg)
    batch = random_batch(seed=5)
    n = len(batch)
    shift = 0.1  # the engine reports each token 0.1 nats likelier than the trainer computes
    batch.rollout_logprobs = [
        own_logprobs(trainer, p, r) + (shift if i % 2 else 0.0)
        for i, (p, r) in enumerate(zip(batch.prompt_ids, batch.response_ids, strict=True))
    ]
    # odd samples from version 0 (the trainer's), even ones from an older, unknown one:
    # only the shifted samples are compared
    batch.token_versions = [
        torch.full_like(r, 0 if i % 2 else -1) for i, r in enumerate(batch.response_ids)
    ]
    m = trainer.train_step(batch)
    assert m["mismatch_abs_mean"] == pytest.approx(shift, abs=1e-4)
    assert m["mismatch_abs_max"] == pytest.approx(shift, abs=1e-4)
    assert m["mismatch_k3"] == pytest.approx(math.exp(-shift) - 1 + shift, abs=1e-5)
    masks = batch.loss_mask or []
    on = sum(float(masks[i].sum()) for i in range(1, n, 2))
    assert m["mismatch_tokens"] == pytest.approx(on / sum(float(x.sum()) for x in masks))
    # the next step's weights are version 1: tokens of version 0 are no longer compared
    again = trainer.train_step(batch)
    assert "mismatch_abs_mean" not in again and again["mismatch_tokens"] == 0
