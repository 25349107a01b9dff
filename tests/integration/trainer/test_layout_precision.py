"""Packed = padded, chunked = full logprobs, and bf16 with float32 master state (tiny model)."""

import dataclasses

import pytest
import torch

from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch


def _cfg(loss: dict, **model) -> TrainConfig:
    model.setdefault("precision", "fp32")  # exactness tests; precision is tested apart
    return TrainConfig(
        loss=LossConfig(**loss),
        optim=OptimConfig(lr=1e-3),
        model=ModelConfig(micro_batch_tokens=24, **model),
    )


def _loss_and_grads(trainer: Trainer, batch):
    micro = trainer._micro_batches(trainer._rl_rows(batch))
    if trainer.cfg.loss.old_logprobs == "recompute":
        trainer._fill_logprobs(micro, "old_logprobs", trainer.model, batch.temperature)
    total, entropy = 0.0, 0.0
    for mb in micro:
        out = trainer._rl_loss(mb, batch.temperature, True)
        out.loss.backward()
        total += float(out.loss.detach())
        entropy += float(out.sums["entropy"])
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return total, entropy, grads, len(micro)


LOSSES = [
    {"aggregation": "token-mean", "entropy_coef": 0.01},
    {"policy_loss": "gspo", "aggregation": "seq-mean-token-mean", "eps_low": 3e-4},
    {"old_logprobs": "recompute", "kl_coef": 0.0, "eps_high": 0.28},
]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(
    "variant",
    [
        {"packing": True, "logprobs": "chunked"},
        {"packing": True, "logprobs": "full"},
        {"packing": False, "logprobs": "chunked"},
    ],
)
def test_layouts_and_logprob_paths_give_the_padded_full_gradient(tiny_model_dir, loss, variant):
    batch = random_batch(seed=5, temperature=0.8)
    base = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, packing=False, logprobs="full"))
    other = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, **variant))
    want_loss, want_ent, want, n_padded = _loss_and_grads(base, batch)
    got_loss, got_ent, got, n_other = _loss_and_grads(other, batch)
    if variant["packing"]:
        assert n_other < n_padded  # the same budget holds the batch in fewer micro-batches
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    assert got_ent == pytest.approx(want_ent, rel=1e-5)
    assert sum(float(g.abs().sum()) for g in want.values()) > 0
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_one_process_keeps_float32_master_weights_and_optimizer(tiny_model_dir):
    loss = {"entropy_coef": 0.01}
    fp32 = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, precision="fp32"))
    bf16 = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, precision="bf16"))
    assert bf16.forward_spec.autocast == torch.bfloat16 and fp32.forward_spec.autocast is None
    batch = random_batch(seed=2)
    want, got = fp32.train_step(batch), bf16.train_step(batch)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    states = [s for s in bf16.optimizer.state.values() if "exp_avg" in s]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)
    assert all(s["exp_avg_sq"].dtype == torch.float32 for s in states)
    # bf16 compute: close to the float32 step, but not bit-equal (it really ran in bf16)
    assert got["loss"] == pytest.approx(want["loss"], abs=2e-2)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=2e-2)
    assert got["loss"] != want["loss"]
    moved = [
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(bf16.model.parameters(), fp32.model.parameters(), strict=True)
    ]
    assert max(moved) < 5e-3  # the same update, up to bf16 rounding of the gradients


def test_entropy_only_on_logged_steps_unless_it_is_a_bonus(tiny_model_dir):
    quiet = Trainer.from_pretrained(tiny_model_dir, _cfg({}, entropy_every=2))
    first, second = quiet.train_step(random_batch(seed=1)), quiet.train_step(random_batch(seed=1))
    assert "entropy" not in first and "entropy" in second
    bonus = Trainer.from_pretrained(tiny_model_dir, _cfg({"entropy_coef": 0.1}, entropy_every=0))
    assert "entropy" in bonus.train_step(random_batch(seed=1))


def test_cpu_packs_by_default_through_segments_attention_as_transformers_sdpa_would(
    tiny_model_dir, tmp_path
):
    """A packed row on CPU attends per sequence (`flywheel_segments`): the same loss and
    gradients as transformers' own sdpa over the packed row (its block-diagonal mask)."""
    from services.trainer.attention import SEGMENTS

    loss = {"entropy_coef": 0.01}
    seg = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, packing=True))
    assert seg.packing and seg.forward_spec.varlen
    assert seg.model.config._attn_implementation == SEGMENTS
    dense = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, packing=True))
    dense.model.set_attn_implementation("sdpa")
    dense.forward_spec = dataclasses.replace(dense.forward_spec, varlen=False)
    batch = random_batch(seed=7)
    want_loss, _, want, _ = _loss_and_grads(dense, batch)
    got_loss, _, got, _ = _loss_and_grads(seg, batch)
    assert got_loss == pytest.approx(want_loss, abs=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
    # The published directory names no attention an engine could not load.
    seg.save_weights(tmp_path / "w")
    assert SEGMENTS not in (tmp_path / "w" / "config.json").read_text()


def test_auto_precision_is_bf16_on_a_cpu_with_native_bf16_and_agrees_with_fp32(tiny_model_dir):
    """The CPU default: bf16 autocast (float32 masters), packed, where the CPU has native
    bf16 — the loss and gradient of the old path (float32, padded) within bf16's tolerance."""
    from services.trainer.attention import SEGMENTS
    from services.trainer.model import cpu_bf16

    auto = Trainer.from_pretrained(tiny_model_dir, _cfg({}, precision="auto"))
    native = cpu_bf16(torch.device("cpu"))
    assert auto.forward_spec.autocast == (torch.bfloat16 if native else None)
    assert auto.packing == native  # packed through segments in bf16; float32 pads
    if not native:
        pytest.skip("this CPU has no native bf16: 'auto' stays float32, padded")
    assert auto.model.config._attn_implementation == SEGMENTS
    fp32 = Trainer.from_pretrained(tiny_model_dir, _cfg({}, precision="fp32"))
    batch = random_batch(seed=4)
    want_loss, _, want, _ = _loss_and_grads(fp32, batch)
    got_loss, _, got, _ = _loss_and_grads(auto, batch)
    assert got_loss != want_loss  # it really ran in bf16
    assert got_loss == pytest.approx(want_loss, abs=2e-2)
    flat_w = torch.cat([want[n].flatten() for n in want]).double()
    flat_g = torch.cat([got[n].flatten() for n in want]).double()
    cosine = float(flat_g @ flat_w / (flat_g.norm() * flat_w.norm()))
    assert cosine > 0.99
    assert float((flat_g.norm() - flat_w.norm()).abs() / flat_w.norm()) < 5e-2
