"""The adaptive entropy control on the tiny model: it holds the policy's entropy where the
bare loss collapses it, and a checkpoint (written then, or from a snapshot) restores its
coefficient so that resuming equals never stopping."""

import itertools
import statistics

import pytest
import torch

from services.trainer.core.batching import TensorBatch
from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint, snapshot
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch

ADAPTIVE = {
    "entropy_control": "adaptive",
    "entropy_target": 1.5,
    "entropy_coef_lr": 0.03,
    "entropy_coef_max": 0.3,
}


def _cfg(**loss) -> TrainConfig:
    return TrainConfig(
        loss=LossConfig(old_logprobs="recompute", **loss),
        optim=OptimConfig(lr=2e-3),
        model=ModelConfig(precision="fp32", micro_batch_tokens=100_000),
    )


def _collapsing_batch(seed: int) -> TensorBatch:
    """Four groups of four: in each, two replies of one repeated token earn 1, two random
    replies earn 0. The bare loss drives every position towards that token."""
    g = torch.Generator().manual_seed(seed)
    n = 16
    responses = [
        torch.full((6,), 10) if i % 2 == 0 else torch.randint(3, 40, (6,), generator=g)
        for i in range(n)
    ]
    return TensorBatch(
        prompt_ids=[torch.randint(3, 40, (4,), generator=g) for _ in range(n)],
        response_ids=responses,
        rollout_logprobs=[torch.full((6,), -3.6) for _ in range(n)],
        rewards=torch.tensor([1.0 if i % 2 == 0 else 0.0 for i in range(n)]),
        group_ids=torch.arange(4).repeat_interleave(4),
        truncated=torch.zeros(n, dtype=torch.bool),
        temperature=1.0,
    )


def _entropies(trainer: Trainer, steps: int) -> list[tuple[float, float]]:
    out = []
    for s in range(steps):
        m = trainer.train_step(_collapsing_batch(s))
        out.append((m["entropy"], m["entropy_coef"]))
    return out


@pytest.mark.timeout(600)
def test_the_adaptive_coefficient_holds_the_entropy_the_bare_loss_collapses(tiny_model_dir):
    steps = 40
    bare = _entropies(Trainer.from_pretrained(tiny_model_dir, _cfg()), steps)
    held = _entropies(Trainer.from_pretrained(tiny_model_dir, _cfg(**ADAPTIVE)), steps)
    late_bare = statistics.fmean(h for h, _ in bare[-10:])
    late_held = statistics.fmean(h for h, _ in held[-10:])
    print(f"\nentropy, last 10 of {steps} steps: bare {late_bare:.4f}, adaptive {late_held:.3f}"
          f" (target 1.5, coefficient {held[-1][1]:.3f})")  # fmt: skip
    assert bare[0][0] > 4.0 and late_bare < 0.05  # from ~log(90) to a near-deterministic policy
    assert 0.75 < late_held < 3.0, held
    assert all(c == 0 for _, c in bare)  # fixed at entropy_coef = 0
    coefs = [c for _, c in held]
    assert coefs[0] == 0 and max(coefs) <= 0.3 and max(coefs) > 0.05
    # each step's coefficient is the previous one moved by lr · (target - entropy), clipped
    for (h, c), (_, c_next) in itertools.pairwise(held):
        assert c_next == pytest.approx(min(max(c + 0.03 * (1.5 - h), 0.0), 0.3))


@pytest.mark.parametrize("from_snapshot", [False, True])
def test_a_checkpoint_restores_the_coefficient(tiny_model_dir, tmp_path, from_snapshot):
    cfg = _cfg(**{**ADAPTIVE, "entropy_target": 5.0, "entropy_coef_lr": 0.05})
    n, k = 5, 3
    batches = [random_batch(seed=50 + i) for i in range(n)]
    straight = Trainer.from_pretrained(tiny_model_dir, cfg)
    want = [straight.train_step(b) for b in batches]
    assert len({w["entropy_coef"] for w in want}) > 2  # it moved

    first = Trainer.from_pretrained(tiny_model_dir, cfg)
    for b in batches[:k]:
        first.train_step(b)
    coef_at_k = first.entropy_coef
    assert coef_at_k == want[k]["entropy_coef"] and coef_at_k > 0
    snap = snapshot(first) if from_snapshot else None
    if from_snapshot:
        first.train_step(batches[k])  # the live coefficient moves on; the snapshot's is step k's
        assert first.entropy_coef != coef_at_k
    save_checkpoint(first, tmp_path, {"seq": 1}, snap)

    resumed = Trainer.from_pretrained(tiny_model_dir, cfg)
    assert resumed.entropy_coef == 0.0
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    load_checkpoint(resumed, ckpt)
    assert resumed.entropy_coef == coef_at_k
    got = [resumed.train_step(b) for b in batches[k:]]
    for g, w in zip(got, want[k:], strict=True):
        assert g["entropy_coef"] == w["entropy_coef"]
        assert abs(g["loss"] - w["loss"]) < 1e-6
    # a run file that switches to a fixed weight gets that weight, not the checkpoint's
    fixed = Trainer.from_pretrained(tiny_model_dir, _cfg(entropy_coef=0.01))
    load_checkpoint(fixed, ckpt)
    assert fixed.entropy_coef == 0.01
