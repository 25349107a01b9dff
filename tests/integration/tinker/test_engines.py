"""Sampling on the engines (`[tinker] engines`): the real SDK against a Tinker server whose
samplers are adapters on a real CPU engine subprocess (started with --enable-lora), on
the tiny model.

What must hold: a trained adapter's greedy samples from the engine are the in-process
sampler's tokens for the same weights (a second server without engines, loading the
same saved state), with logprobs within LOGPROB_ATOL; two sessions' samplers sampled
concurrently on one engine each get their own adapter's replies; a sampler keeps its
snapshot while training goes on; an adapter the engine cannot serve, and an engine
that is down, fail that request alone with an error that says so.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness.engines import EngineProcess, start_engine, stop_engine
from tests.harness.ports import free_port
from tests.integration.tinker.conftest import MAX_TOKENS, serving

# Engines and servers started and killed, 45-100 s of a worker: scheduled first
# (tests/conftest.py), so make test does not end on this module.
pytestmark = pytest.mark.slow

ENGINE_MAX_RANK = 8
# Measured 2026-11-29 on this test's prompts: the largest |engine - in-process| logprob
# was below 1e-5 (the same float32 weights; the engine adds B(Ax) in a hook where PEFT
# adds it in its LoRA layer, so sums round differently). 1e-4 leaves room for other CPUs.
LOGPROB_ATOL = 1e-4
TEXT = "the cat sat on the mat"
PROMPTS = ["the cat", "a dog ran", "on the"]


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    lora = ["--enable-lora", "--max-lora-rank", str(ENGINE_MAX_RANK),
            "--lora-target-modules", "all"]  # fmt: skip
    proc = start_engine(tiny_model, log, *lora, timeout_s=120)
    yield proc
    stop_engine(proc)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("states")


@pytest.fixture(scope="module")
def on_engine(
    tiny_model: Path,
    engine: EngineProcess,
    state_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    root = tmp_path_factory.mktemp("tinker-engine")
    settings = {"engines": json.dumps([engine.url]), "state_dir": str(state_dir),
                "max_tokens": str(MAX_TOKENS)}  # fmt: skip
    with serving(tiny_model, root, **settings) as (url, _, _):
        yield url


@pytest.fixture(autouse=True)
def _sdk_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-flywheel-test")
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def _datum(tokens: list[int]) -> Any:
    from tinker import types

    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(tokens[1:], dtype=np.int64)},
    )


def _train(training: Any, tokens: list[int], steps: int) -> None:
    from tinker import types

    for _ in range(steps):
        training.forward_backward([_datum(tokens)], "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result(timeout=120)


def _greedy(sampler: Any, prompts: list[list[int]]) -> list[Any]:
    """One greedy sequence per prompt, all requests in flight at once."""
    from tinker import types

    params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    futures = [sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts]
    return [f.result(timeout=120).sequences[0] for f in futures]


def test_engine_samples_equal_the_in_process_samplers(
    tiny_model: Path, on_engine: str, state_dir: Path, tmp_path: Path
) -> None:
    import tinker
    from tinker import types

    tok = _tokenizer(tiny_model)
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    client = tinker.ServiceClient(base_url=on_engine)
    try:
        training = client.create_lora_training_client(
            base_model=tiny_model.name, rank=4, seed=7
        ).result(timeout=120)
        _train(training, list(tok.encode(TEXT)), 4)
        path = training.save_state("trained").result(timeout=120).path
        engine_seqs = _greedy(training.save_weights_and_get_sampling_client().result(120), prompts)
        engine_base = _greedy(
            client.create_sampling_client(base_model=tiny_model.name).result(120), prompts
        )
        sampler = training.save_weights_and_get_sampling_client().result(120)
        engine_lp = sampler.compute_logprobs(types.ModelInput.from_ints(prompts[0])).result(120)
    finally:
        client.close("success").result(timeout=30)
    # The adapter changed the model: a test that compares base with base proves nothing.
    assert [s.tokens for s in engine_seqs] != [s.tokens for s in engine_base]

    settings = {"state_dir": str(state_dir), "max_tokens": str(MAX_TOKENS)}
    with serving(tiny_model, tmp_path, **settings) as (url, _, _):
        local = tinker.ServiceClient(base_url=url)
        try:
            twin = local.create_training_client_from_state(path).result(120)
            twin_sampler = twin.save_weights_and_get_sampling_client().result(120)
            local_seqs = _greedy(twin_sampler, prompts)
            local_base = _greedy(
                local.create_sampling_client(base_model=tiny_model.name).result(120), prompts
            )
            local_lp = twin_sampler.compute_logprobs(types.ModelInput.from_ints(prompts[0])).result(
                120
            )
        finally:
            local.close("success").result(timeout=30)

    worst = 0.0
    for e, p in zip(engine_seqs + engine_base, local_seqs + local_base, strict=True):
        assert e.tokens == p.tokens
        assert e.stop_reason == p.stop_reason
        worst = max(worst, *(abs(a - b) for a, b in zip(e.logprobs, p.logprobs, strict=True)))
    assert engine_lp[0] is None and local_lp[0] is None
    worst = max(worst, *(abs(a - b) for a, b in zip(engine_lp[1:], local_lp[1:], strict=True)))
    print(f"largest engine vs in-process logprob difference: {worst:.3g}")
    assert worst <= LOGPROB_ATOL


def test_two_sessions_samplers_side_by_side_on_one_engine(tiny_model: Path, on_engine: str) -> None:
    import tinker

    tok = _tokenizer(tiny_model)
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    a = tinker.ServiceClient(base_url=on_engine)
    b = tinker.ServiceClient(base_url=on_engine)
    try:
        ta = a.create_lora_training_client(base_model=tiny_model.name, rank=4, seed=1).result(120)
        tb = b.create_lora_training_client(base_model=tiny_model.name, rank=8, seed=2).result(120)
        _train(ta, list(tok.encode("the cat sat on the mat")), 4)
        _train(tb, list(tok.encode("a dog ran to the park")), 4)
        sa = ta.save_weights_and_get_sampling_client().result(120)
        sb = tb.save_weights_and_get_sampling_client().result(120)
        alone_a, alone_b = _greedy(sa, prompts), _greedy(sb, prompts)
        assert [s.tokens for s in alone_a] != [s.tokens for s in alone_b]
        # Both samplers' requests in flight together, interleaved: the engine batches them.
        from tinker import types

        params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
        futures: list[tuple[str, int, Future[Any]]] = []
        for _ in range(2):
            for i, p in enumerate(prompts):
                futures.append(("a", i, sa.sample(types.ModelInput.from_ints(p), 1, params)))
                futures.append(("b", i, sb.sample(types.ModelInput.from_ints(p), 1, params)))
        for who, i, f in futures:
            want = (alone_a if who == "a" else alone_b)[i]
            assert f.result(timeout=120).sequences[0].tokens == want.tokens, (who, i)
    finally:
        a.close("success").result(timeout=30)
        b.close("success").result(timeout=30)


def test_a_sampler_on_the_engine_keeps_its_snapshot(tiny_model: Path, on_engine: str) -> None:
    import tinker
    from tinker import types

    tok = _tokenizer(tiny_model)
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    text = list(tok.encode(TEXT))
    client = tinker.ServiceClient(base_url=on_engine)
    try:
        training = client.create_lora_training_client(
            base_model=tiny_model.name, rank=4, seed=3
        ).result(120)
        _train(training, text, 1)
        before = training.save_weights_and_get_sampling_client().result(120)
        first = _greedy(before, prompts)
        lp0 = before.compute_logprobs(types.ModelInput.from_ints(text)).result(120)
        # A named save, sampled later through its path, is the same snapshot.
        named = training.save_weights_for_sampler("one-step").result(120).path
        _train(training, text, 4)
        after = training.save_weights_and_get_sampling_client().result(120)
        assert [s.tokens for s in _greedy(before, prompts)] == [s.tokens for s in first]
        by_path = client.create_sampling_client(model_path=named).result(120)
        assert [s.tokens for s in _greedy(by_path, prompts)] == [s.tokens for s in first]
        # A seed draws the same samples again, and its samples are not one draw repeated.
        seeded = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop=[])
        prompt = types.ModelInput.from_ints(prompts[0])
        one = before.sample(prompt, 4, seeded).result(120).sequences
        two = before.sample(prompt, 4, seeded).result(120).sequences
        assert [s.tokens for s in one] == [s.tokens for s in two]
        assert len({tuple(s.tokens) for s in one}) > 1
        assert before.compute_logprobs(types.ModelInput.from_ints(text)).result(120) == lp0
        lp1 = after.compute_logprobs(types.ModelInput.from_ints(text)).result(120)
        assert sum(lp1[1:]) > sum(lp0[1:])  # the trained one: the text is likelier
    finally:
        client.close("success").result(timeout=30)


def test_an_adapter_over_the_engines_rank_fails_alone(tiny_model: Path, on_engine: str) -> None:
    import tinker

    tok = _tokenizer(tiny_model)
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    client = tinker.ServiceClient(base_url=on_engine)
    try:
        ok = client.create_lora_training_client(base_model=tiny_model.name, rank=4, seed=1)
        big = client.create_lora_training_client(
            base_model=tiny_model.name, rank=2 * ENGINE_MAX_RANK, seed=1
        ).result(120)
        sampler = ok.result(120).save_weights_and_get_sampling_client().result(120)
        with pytest.raises(tinker.RequestFailedError, match="max-lora-rank") as info:
            big.save_weights_and_get_sampling_client().result(120)
        assert "refused the sampler's adapter" in str(info.value)
        assert len(_greedy(sampler, prompts)) == len(prompts)  # the other sampler samples on
    finally:
        client.close("success").result(timeout=30)


def test_an_engine_that_is_down_fails_the_save_with_a_server_error(
    tiny_model: Path, tmp_path: Path
) -> None:
    import tinker

    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    settings = {"engines": json.dumps([down]), "engine_timeout_s": "10"}
    with serving(tiny_model, tmp_path, **settings) as (url, _, _):
        client = tinker.ServiceClient(base_url=url)
        try:
            training = client.create_lora_training_client(
                base_model=tiny_model.name, rank=4, seed=1
            ).result(120)
            with pytest.raises(tinker.RequestFailedError, match="could not load the adapter"):
                training.save_weights_and_get_sampling_client().result(120)
            # Training goes on: the failure was that request's alone.
            out = training.forward([_datum(list(range(5, 12)))], "cross_entropy").result(120)
            assert len(out.loss_fn_outputs) == 1
        finally:
            client.close("success").result(timeout=30)


def test_an_engine_restarted_gets_the_adapter_again(tiny_model: Path, tmp_path: Path) -> None:
    import tinker

    lora = ["--enable-lora", "--max-lora-rank", str(ENGINE_MAX_RANK),
            "--lora-target-modules", "all"]  # fmt: skip
    first = start_engine(tiny_model, tmp_path / "engine-1.log", *lora, timeout_s=120)
    port = int(first.url.rsplit(":", 1)[1])
    tok = _tokenizer(tiny_model)
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    settings = {"engines": json.dumps([first.url]), "state_dir": str(tmp_path / "state")}
    engines = [first]
    try:
        with serving(tiny_model, tmp_path, **settings) as (url, _, log):
            client = tinker.ServiceClient(base_url=url)
            try:
                training = client.create_lora_training_client(
                    base_model=tiny_model.name, rank=4, seed=9
                ).result(120)
                _train(training, list(tok.encode(TEXT)), 3)
                sampler = training.save_weights_and_get_sampling_client().result(120)
                before = _greedy(sampler, prompts)
                stop_engine(first)  # the engine restarts, its adapters gone
                engines.append(start_engine(tiny_model, tmp_path / "engine-2.log", *lora,
                                            timeout_s=120, port=port))  # fmt: skip
                after = _greedy(sampler, prompts)
            finally:
                client.close("success").result(timeout=30)
            assert [s.tokens for s in after] == [s.tokens for s in before]
            assert "loading tinker-" in log.read_text()  # reloaded, not sampled from the base
    finally:
        for e in engines:
            if e.proc.poll() is None:
                stop_engine(e)
