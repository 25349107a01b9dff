"""The real tinker SDK (0.38.0) against Flywheel's Tinker server on the tiny model:
training lowers the loss, sampling answers with logprobs, sessions are independent,
bad input fails that request alone with an error that says what is wrong."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from tests.integration.tinker.conftest import MAX_TOKENS, Server

TEXT = "the cat sat on the mat"


def _tokens(server: Server, text: str = TEXT) -> list[int]:
    return server.tokens(text)


def _datum(tokens: list[int], weights: list[float] | None = None) -> Any:
    """Next-token prediction on `tokens`: input tokens[:-1], targets tokens[1:]."""
    from tinker import types

    inputs, targets = tokens[:-1], tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(inputs),
        loss_fn_inputs={
            "target_tokens": np.asarray(targets, dtype=np.int64),
            "weights": np.asarray(weights or [1.0] * len(targets), dtype=np.float32),
        },
    )


def _loss(client: Any, data: list[Any]) -> float:
    out = client.forward(data, "cross_entropy").result(timeout=60)
    return float(out.metrics["loss:sum"])


def test_forward_backward_and_optim_step_lower_the_loss(
    service_client: Any, tinker_server: Server
) -> None:
    from tinker import types

    training = service_client.create_lora_training_client(
        base_model=tinker_server.model_name, rank=8, seed=1
    ).result(timeout=60)
    assert training.get_info().lora_rank == 8
    data = [_datum(_tokens(tinker_server)), _datum(_tokens(tinker_server, "a dog ran"))]
    losses = []
    for _ in range(5):
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result(timeout=60)
        step.result(timeout=60)
        losses.append(out.metrics["loss:sum"])
        # One output per datum, a logprob per target token.
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [
            len(d.model_input.to_ints()) for d in data
        ]
    after = _loss(training, data)
    assert after < 0.7 * losses[0], (losses, after)


def test_sample_returns_num_samples_sequences_with_true_logprobs(
    service_client: Any, tinker_server: Server
) -> None:
    from tinker import types

    training = service_client.create_lora_training_client(
        base_model=tinker_server.model_name, rank=4, seed=2
    ).result(timeout=60)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = _tokens(tinker_server, "the cat")
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[])
    result = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result(timeout=60)
    assert len(result.sequences) == 3
    for seq in result.sequences:
        assert len(seq.tokens) == 6 and seq.stop_reason == "length"  # stop=[]: runs to max_tokens
        assert seq.logprobs is not None and len(seq.logprobs) == 6
        assert all(lp <= 0 for lp in seq.logprobs)
    # The sampled tokens' logprobs are the model's: compute_logprobs scores the same tokens.
    seq = result.sequences[0]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + list(seq.tokens)))
    scored = scored.result(timeout=60)
    assert scored[0] is None and len(scored) == len(prompt) + 6
    assert np.allclose(scored[len(prompt) :], seq.logprobs, atol=1e-4)
    # A seed makes a sample reproducible.
    again = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result(timeout=60)
    assert [s.tokens for s in again.sequences] == [s.tokens for s in result.sequences]


def test_a_sampler_keeps_the_weights_it_was_saved_with(
    service_client: Any, tinker_server: Server
) -> None:
    from tinker import types

    training = service_client.create_lora_training_client(
        base_model=tinker_server.model_name, rank=4, seed=3
    ).result(timeout=60)
    tokens = _tokens(tinker_server)
    before = training.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = types.ModelInput.from_ints(tokens)
    lp0 = before.compute_logprobs(prompt).result(timeout=60)
    for _ in range(3):
        training.forward_backward([_datum(tokens)], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    after = training.save_weights_and_get_sampling_client().result(timeout=60)
    assert before.compute_logprobs(prompt).result(timeout=60) == lp0  # its snapshot
    lp1 = after.compute_logprobs(prompt).result(timeout=60)
    assert sum(lp1[1:]) > sum(lp0[1:])  # the trained one: the text is likelier


def test_two_sessions_train_their_own_adapters(tinker_server: Server) -> None:
    import tinker
    from tinker import types

    a = tinker.ServiceClient(base_url=tinker_server.base_url)
    b = tinker.ServiceClient(base_url=tinker_server.base_url)
    try:
        ta = a.create_lora_training_client(
            base_model=tinker_server.model_name, rank=8, seed=5
        ).result(60)
        tb = b.create_lora_training_client(
            base_model=tinker_server.model_name, rank=8, seed=5
        ).result(60)
        data = [_datum(_tokens(tinker_server))]
        b_before = _loss(tb, data)
        a_before = _loss(ta, data)
        assert a_before == pytest.approx(b_before, rel=1e-6)  # same seed, same start
        # B accumulates a gradient; A trains three steps meanwhile; B's stays its own.
        tb.forward_backward(data, "cross_entropy").result(timeout=60)
        for _ in range(3):
            ta.forward_backward(data, "cross_entropy")
            ta.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert _loss(ta, data) < 0.9 * a_before
        assert _loss(tb, data) == pytest.approx(b_before, rel=1e-6)  # A's steps moved nothing of B
        # B's one step uses B's gradient alone: equal to a fresh twin's one step.
        tb.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        twin = a.create_lora_training_client(
            base_model=tinker_server.model_name, rank=8, seed=5
        ).result(60)
        twin.forward_backward(data, "cross_entropy").result(timeout=60)
        twin.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert _loss(tb, data) == pytest.approx(_loss(twin, data), rel=1e-5)
    finally:
        a.close("success").result(timeout=30)
        b.close("success").result(timeout=30)


def test_bad_inputs_fail_alone_with_a_clear_error(
    service_client: Any, tinker_server: Server
) -> None:
    import tinker
    from tinker import types

    other = tinker.ServiceClient(base_url=tinker_server.base_url)
    try:
        bad = service_client.create_lora_training_client(
            base_model=tinker_server.model_name, rank=4
        ).result(60)
        good = other.create_lora_training_client(
            base_model=tinker_server.model_name, rank=4
        ).result(60)
        tokens = _tokens(tinker_server)
        data = [_datum(tokens)]
        good_before = _loss(good, data)

        def error_of(future: Any) -> str:
            with pytest.raises(tinker.RequestFailedError) as info:
                future.result(timeout=60)
            return str(info.value)

        # An SDK loss this server does not run, named, with what it does run.
        msg = error_of(bad.forward_backward(data, "stable_reinforce"))
        assert "'stable_reinforce'" in msg and "cross_entropy, importance_sampling, ppo" in msg
        # Weights one short of the input: the key, the shape wanted, the shape given.
        short = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                "weights": np.ones(len(tokens) - 2, dtype=np.float32),
            },
        )
        msg = error_of(bad.forward_backward([short], "cross_entropy"))
        assert (
            "'weights'" in msg and f"[{len(tokens) - 1}]" in msg and f"[{len(tokens) - 2}]" in msg
        )
        # importance_sampling without its sampler logprobs.
        msg = error_of(bad.forward_backward(data, "importance_sampling"))
        assert "'logprobs'" in msg
        # An oversized datum: longer than [tinker] max_tokens.
        long_tokens = (tokens * 10)[: MAX_TOKENS + 2]
        msg = error_of(bad.forward_backward([_datum(long_tokens)], "cross_entropy"))
        assert f"limit of {MAX_TOKENS}" in msg and "max_tokens" in msg
        # Too many samples at once.
        sampler = bad.save_weights_and_get_sampling_client().result(timeout=60)
        params = types.SamplingParams(max_tokens=2)
        msg = error_of(sampler.sample(types.ModelInput.from_ints(tokens), 100, params))
        assert "num_samples" in msg and "max_num_samples" in msg
        # A base model this server does not serve fails the create, naming what it serves.
        with pytest.raises(tinker.RequestFailedError, match=tinker_server.model_name):
            service_client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result(
                60
            )
        # Nothing of that touched either session: the other trains on, and so does this one.
        assert _loss(good, data) == pytest.approx(good_before, rel=1e-6)
        good.forward_backward(data, "cross_entropy").result(timeout=60)
        good.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        assert _loss(good, data) < good_before
        assert math.isfinite(_loss(bad, data))
    finally:
        other.close("success").result(timeout=30)


def test_importance_sampling_on_the_samplers_own_logprobs(
    service_client: Any, tinker_server: Server
) -> None:
    """The RL loss on a sample: with the sampler's logprobs equal to the trainer's, the
    ratio is 1 and the loss is -Σ advantages; a step on a positive advantage makes the
    sampled tokens likelier."""
    from tinker import types

    training = service_client.create_lora_training_client(
        base_model=tinker_server.model_name, rank=4, seed=4
    ).result(timeout=60)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=60)
    prompt = _tokens(tinker_server, "the cat")
    params = types.SamplingParams(max_tokens=5, seed=3, stop=[])
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result(60).sequences[0]
    tokens = prompt + list(seq.tokens)
    n = len(tokens) - 1
    sampled_lp = [0.0] * (len(prompt) - 1) + list(seq.logprobs or [])
    advantages = [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": np.asarray(sampled_lp, dtype=np.float32),
            "advantages": np.asarray(advantages, dtype=np.float32),
        },
    )
    assert len(sampled_lp) == n
    out = training.forward_backward([datum], "importance_sampling").result(timeout=60)
    assert out.metrics["loss:sum"] == pytest.approx(-len(seq.tokens), rel=1e-4)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    after = training.forward([datum], "importance_sampling").result(timeout=60)
    assert after.metrics["loss:sum"] < out.metrics["loss:sum"]  # ratios above 1 now


def test_a_custom_loss_computed_client_side_trains_as_its_built_in_twin(
    service_client: Any, tinker_server: Server
) -> None:
    """forward_backward_custom (the SDK computes the loss from forward's logprobs and sends
    its gradient as cross_entropy weights): a custom loss equal to the weighted cross
    entropy leaves its session's adapter where the built-in loss leaves a twin's."""
    from tinker import types

    weights = [0.5, 2.0, 1.0, 0.0, 1.5]
    tokens = _tokens(tinker_server)
    w = (weights * 4)[: len(tokens) - 1]
    data = [_datum(tokens, w)]
    sessions = [
        service_client.create_lora_training_client(
            base_model=tinker_server.model_name, rank=4, seed=6
        ).result(timeout=60)
        for _ in range(2)
    ]
    custom, built_in = sessions

    def weighted_nll(batch: list[Any], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        import torch

        total = sum(
            -(torch.tensor(d.loss_fn_inputs["weights"].tolist()) * lp).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return total, {"custom:sum": float(total.detach())}

    before = _loss(built_in, data)
    out = custom.forward_backward_custom(data, weighted_nll).result(timeout=60)
    assert out.metrics["custom:sum"] == pytest.approx(
        built_in.forward(data, "cross_entropy").result(60).metrics["loss:sum"], rel=1e-5
    )
    built_in.forward_backward(data, "cross_entropy").result(timeout=60)
    for client in sessions:
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
    after = [_loss(client, [_datum(tokens)]) for client in sessions]
    assert after[0] == pytest.approx(after[1], rel=1e-5)
    assert _loss(built_in, data) < before  # both moved, the same way
