"""Prefix-shared groups (core/prefix.py) give the unshared path's logprobs, loss and
gradients, on fewer tokens (tiny model; SmolLM2 in tests/e2e/test_smollm2_prefix.py)."""

import pytest
import torch

from services.trainer.core.batching import TensorBatch
from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.trainer import Trainer


def grouped_batch(seed: int = 0, groups: int = 3, per_group: int = 4) -> TensorBatch:
    """Groups whose samples share their prompt, and some replies their first tokens
    (as a multi-turn episode's samples share a first turn), with masked tool tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses, logps, masks, gids = [], [], [], [], []
    for group in range(groups):
        prompt = torch.randint(3, 90, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        opening = torch.randint(3, 90, (2,), generator=g)  # half the group starts alike
        for k in range(per_group):
            r = int(torch.randint(1, 9, (1,), generator=g))
            reply = torch.randint(3, 90, (r,), generator=g)
            if k % 2 and r > 2:
                reply[:2] = opening
            prompts.append(prompt.clone())
            responses.append(reply)
            logps.append(-torch.rand(r, generator=g) * 3 - 3.5)
            m = torch.ones(r)
            if r > 3:
                m[2] = 0  # an observation token inside the episode
            masks.append(m)
            gids.append(group)
    n = len(prompts)
    # One group of two identical samples: the whole sequence is their common prefix.
    prompts += [prompts[0].clone(), prompts[0].clone()]
    responses += [responses[0].clone(), responses[0].clone()]
    logps += [logps[0].clone(), logps[0].clone()]
    masks += [masks[0].clone(), masks[0].clone()]
    gids += [groups, groups]
    return TensorBatch(
        prompt_ids=prompts,
        response_ids=responses,
        rollout_logprobs=logps,
        rewards=torch.tensor([float(i % 3 == 0) for i in range(n)] + [1.0, 0.0]),
        group_ids=torch.tensor(gids),
        truncated=torch.zeros(n + 2, dtype=torch.bool),
        loss_mask=masks,
        temperature=0.8,
    )


def _cfg(loss: dict, budget: int = 40, **model) -> TrainConfig:
    model.setdefault("precision", "fp32")
    return TrainConfig(
        loss=LossConfig(**loss),
        optim=OptimConfig(lr=1e-3),
        model=ModelConfig(micro_batch_tokens=budget, packing=True, **model),
    )


def _run(trainer: Trainer, batch: TensorBatch):
    """Loss, entropy, logprobs per sample and gradients of one batch, and tokens computed."""
    micro = trainer._micro_batches(trainer._rl_rows(batch), batch.group_ids.tolist())
    if trainer.cfg.loss.old_logprobs == "recompute":
        trainer._fill_logprobs(micro, "old_logprobs", trainer.model, batch.temperature)
    total, entropy, logps = 0.0, 0.0, []
    for mb in micro:
        out = trainer._rl_loss(mb, batch.temperature, True)
        out.loss.backward()
        total += float(out.loss.detach())
        entropy += float(out.sums["entropy"])
        with torch.no_grad():
            lp, _ = trainer._token_stats(trainer.model, mb, batch.temperature)
        on = mb["loss_mask"][0] > 0
        logps += sorted(lp[0][on].tolist())
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    tokens = sum(mb["input_ids"].numel() for mb in micro)
    return total, entropy, sorted(logps), grads, tokens


LOSSES = [
    {"aggregation": "token-mean", "entropy_coef": 0.01},
    {"policy_loss": "gspo", "aggregation": "seq-mean-token-mean", "eps_low": 3e-4},
    {"old_logprobs": "recompute", "kl_coef": 0.0, "eps_high": 0.28},
]


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("logprobs", ["chunked", "full"])
def test_shared_groups_give_the_unshared_loss_logprobs_and_gradients(
    tiny_model_dir, loss, logprobs
):
    batch = grouped_batch(seed=3)
    plain = Trainer.from_pretrained(
        tiny_model_dir, _cfg(loss, share_prefix=False, logprobs=logprobs)
    )
    shared = Trainer.from_pretrained(tiny_model_dir, _cfg(loss, logprobs=logprobs))
    want_loss, want_ent, want_lp, want, want_tokens = _run(plain, batch)
    got_loss, got_ent, got_lp, got, got_tokens = _run(shared, batch)
    assert got_tokens < 0.8 * want_tokens  # the prompts are computed once per group
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    assert got_ent == pytest.approx(want_ent, rel=1e-5)
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=0)
    assert sum(float(g.abs().sum()) for g in want.values()) > 0
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_a_whole_step_shared_or_not_gives_the_same_metrics(tiny_model_dir):
    """The whole train_step (advantages, layout, loss, clip, step). Its weights are not
    compared: Adam's first update is lr · g / |g| per weight, so the float rounding of a
    near-zero gradient may flip its sign; the gradients are compared above."""
    batch = grouped_batch(seed=8, groups=4)
    plain = Trainer.from_pretrained(tiny_model_dir, _cfg({}, share_prefix=False))
    shared = Trainer.from_pretrained(tiny_model_dir, _cfg({}))
    want, got = plain.train_step(batch), shared.train_step(batch)
    for key in ("loss", "pg_loss", "grad_norm", "entropy", "tokens", "approx_kl", "ratio"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    again_want, again_got = plain.train_step(batch), shared.train_step(batch)
    assert again_got["loss"] == pytest.approx(again_want["loss"], rel=1e-3, abs=1e-5)


def test_bf16_shared_groups_agree_as_the_packed_path_does(tiny_model_dir):
    """In bf16 the shared path is held to what bf16 packed rows already are to float32."""
    batch = grouped_batch(seed=5)
    fp32 = Trainer.from_pretrained(tiny_model_dir, _cfg({}, share_prefix=False))
    plain = Trainer.from_pretrained(tiny_model_dir, _cfg({}, share_prefix=False, precision="bf16"))
    shared = Trainer.from_pretrained(tiny_model_dir, _cfg({}, precision="bf16"))
    ref_loss, _, ref_lp, _, _ = _run(fp32, batch)
    plain_loss, _, plain_lp, _, _ = _run(plain, batch)
    got_loss, _, got_lp, _, _ = _run(shared, batch)
    tol = max(abs(plain_loss - ref_loss), 1e-3)
    assert abs(got_loss - ref_loss) <= 2 * tol
    lp_tol = float((torch.tensor(plain_lp) - torch.tensor(ref_lp)).abs().max())
    assert float((torch.tensor(got_lp) - torch.tensor(ref_lp)).abs().max()) <= 2 * lp_tol + 1e-3


def test_groups_larger_than_the_budget_split_into_trees_that_fit(tiny_model_dir):
    batch = grouped_batch(seed=1, groups=2, per_group=8)
    plain = Trainer.from_pretrained(tiny_model_dir, _cfg({}, budget=12, share_prefix=False))
    shared = Trainer.from_pretrained(tiny_model_dir, _cfg({}, budget=12))
    micro = shared._micro_batches(shared._rl_rows(batch), batch.group_ids.tolist())
    longest = max(
        int(p.numel() + r.numel())
        for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)
    )
    assert all(mb["input_ids"].numel() <= max(12, longest) for mb in micro)
    want_loss, _, want_lp, want, _ = _run(plain, batch)
    got_loss, _, got_lp, got, _ = _run(shared, batch)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-5, rtol=0)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)
