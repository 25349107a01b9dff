"""ppo, cispo, dro and gspo through the real SDK, with loss_fn_config: the server's loss
equals the docs' formula computed here from the server's own logprobs, a config
changes it, and a bad config fails that request alone, naming the key."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.integration.tinker.conftest import Server


def _formula(loss: str, lp: np.ndarray, q: np.ndarray, adv: np.ndarray, cfg: dict) -> float:
    ratio = np.exp(lp - q)
    if loss == "ppo":
        clipped = np.clip(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return float(-np.minimum(ratio * adv, clipped * adv).sum())
    if loss == "cispo":
        clipped = np.clip(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return float(-(clipped * lp * adv).sum())
    if loss == "gspo":  # the geometric mean of the marked tokens' ratios, for every token
        s = np.exp((lp - q)[cfg["mask"] != 0].mean())
        clipped = np.clip(s, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return float(-np.minimum(s * adv, clipped * adv).sum())
    return float(-(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2).sum())  # dro


def test_rl_losses_follow_their_formulas_and_configs(
    service_client: Any, tinker_server: Server
) -> None:
    import tinker
    from tinker import types

    training = service_client.create_lora_training_client(
        base_model=tinker_server.model_name, rank=4, seed=3
    ).result(60)
    ids = tinker_server.tokens("the cat sat on the mat")
    inputs, targets = ids[:-1], np.asarray(ids[1:], dtype=np.int64)
    ce = types.Datum(
        model_input=types.ModelInput.from_ints(inputs), loss_fn_inputs={"target_tokens": targets}
    )
    lp = np.asarray(training.forward([ce], "cross_entropy").result(60).loss_fn_outputs[0][
        "logprobs"].tolist(), dtype=np.float64)  # fmt: skip
    n = len(lp)
    # Sampler logprobs half a nat either side of the trainer's: ratios e^±0.5 and 1,
    # so PPO's and CISPO's bands clip some tokens and not others.
    q = lp + np.resize([0.5, -0.5, 0.0], n)
    adv = np.resize([1.0, -1.0, 2.0, -0.5], n)
    rl = types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={
            "target_tokens": targets,
            "logprobs": q.astype(np.float32),
            "advantages": adv.astype(np.float32),
        },
    )
    q32 = q.astype(np.float32).astype(np.float64)  # what the server reads
    cases = [
        ("ppo", None, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0}, None),
        ("cispo", None, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, None),
        ("dro", {"beta": 0.5}, None),
    ]
    seen = set()
    for loss, config, defaults in cases:
        out = training.forward([rl], loss, loss_fn_config=config).result(60)
        expected = _formula(loss, lp, q32, adv, config or defaults or {})
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4), loss
        seen.add(round(out.metrics["loss:sum"], 4))
    assert len(seen) == len(cases)  # each config changed the loss
    # gspo (before the update below moves lp): the sequence ratio s over the tokens
    # sequence_ratio_mask marks (all but the first two, e^-0.5 and e^0.5), in a band
    # that holds s and one that lies between 1 and s (every token clipped to it); then
    # without the mask, which fails naming that key.
    mask = np.r_[0.0, 0.0, np.ones(n - 2)].astype(np.float32)
    gspo = types.Datum(
        model_input=rl.model_input,
        loss_fn_inputs={**rl.loss_fn_inputs, "sequence_ratio_mask": mask},
    )
    s = float(np.exp((lp - q32)[2:].mean()))
    assert abs(s - 1) > 1e-3  # the mask left out ratios that do not cancel
    mid = 1.0 + (s - 1) / 2
    sums = []
    for band in (
        {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
        {"clip_low_threshold": min(mid, 1.0), "clip_high_threshold": max(mid, 1.0)},
    ):
        out = training.forward([gspo], "gspo", loss_fn_config=band).result(60)
        expected = _formula("gspo", lp, q32, adv, {**band, "mask": mask})
        assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4), band
        sums.append(out.metrics["loss:sum"])
    assert sums[0] != pytest.approx(sums[1], abs=1e-4)  # the narrow band clipped
    with pytest.raises(tinker.RequestFailedError, match="'sequence_ratio_mask'"):
        training.forward_backward([rl], "gspo", loss_fn_config=band).result(60)
    # forward_backward and optim_step with one of them: the update runs.
    training.forward_backward([rl], "ppo").result(60)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(60)
    # A bad config fails alone and names the key; the client trains on.
    with pytest.raises(tinker.RequestFailedError, match="'beta' is required"):
        training.forward_backward([rl], "dro").result(60)
    with pytest.raises(tinker.RequestFailedError, match="'epsilon' is not one of its keys"):
        training.forward_backward([rl], "ppo", loss_fn_config={"epsilon": 0.2}).result(60)
    assert training.forward([rl], "cispo").result(60).metrics["loss:sum"] != 0
