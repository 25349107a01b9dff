"""The CPU engine's prefix cache on a real model and scheduler thread: same answers as
without it, each prompt computed once, and emptied exactly where SGLang flushes.

The model is the tiny test model in float32 (the engine's dtype). "Computed once" is
counted by a runner that records how many tokens each forward pass was given.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from services.engine.core import kvbatch
from services.engine.core.protocol import Completion, SeqSpec, parse_generate
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler
from services.engine_api.sglang_api import FLUSH_IN_PROGRESS, FLUSH_TIMED_OUT
from tests.harness.poll import wait_for

PROMPT = [5, 9, 3, 7, 2, 8, 4, 6, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 20 tokens
TIMEOUT = 120


class CountingRunner(ModelRunner):
    """A ModelRunner that counts the tokens its prefills and extends compute."""

    computed = 0

    def prefill(self, seqs: list[list[int]], lora_ids: Any = None) -> Any:
        self.computed += sum(len(s) for s in seqs)
        return super().prefill(seqs, lora_ids)

    def extend(self, past: kvbatch.KVBatch, suffixes: list[list[int]], lora_ids: Any = None) -> Any:
        self.computed += sum(len(s) for s in suffixes)
        return super().extend(past, suffixes, lora_ids)


def _scheduler(model: Path, cache_mib: float) -> Scheduler:
    runner = CountingRunner(model, num_threads=1, weights_check="sizes")
    sched = Scheduler(
        runner,
        eos=frozenset(),
        decode=lambda ids, skip: "",
        prefix_cache_bytes=int(cache_mib * 2**20),
    )
    sched.start()
    return sched


@pytest.fixture
def schedulers(tiny_model: Path) -> Any:
    made: list[Scheduler] = []

    def make(cache_mib: float) -> Scheduler:
        made.append(_scheduler(tiny_model, cache_mib))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def _specs(body: dict[str, Any]) -> list[SeqSpec]:
    return parse_generate(body, lambda text: [], vocab_size=50_000, context_len=2048).seqs


def _run(sched: Scheduler, specs: list[SeqSpec]) -> list[Completion]:
    """Submit all specs at once (so they share admissions), wait for every answer."""
    futures: list[Future[Completion]] = []
    for spec in specs:
        fut: Future[Completion] = Future()
        futures.append(fut)
        sched.submit(spec, fut.set_result)
    return [f.result(TIMEOUT) for f in futures]


def _group(n: int, prompt: list[int] = PROMPT, **params: Any) -> dict[str, Any]:
    sampling = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "n": n, **params}
    return {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}


def _assert_same(a: list[Completion], b: list[Completion]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5
        )


def test_greedy_answers_and_logprobs_equal_the_uncached_path(schedulers: Any) -> None:
    plain, cached = schedulers(0), schedulers(64)
    other = [5, 9, 3, 7, 2, 8, 4, 30, 31, 32, 33]  # shares 7 tokens with PROMPT
    bodies = [_group(8), _group(1), _group(1, other), _group(1, [40, 41, 42])]
    specs = [s for b in bodies for s in _specs(b)]
    before = _run(plain, specs)
    after = _run(cached, specs)
    _assert_same(before, after)
    # And again, now from a warm cache (whole prompts and a partial prefix hit).
    again = _run(cached, [*_specs(_group(4)), *_specs(_group(1, [*other[:7], 50, 51]))])
    _assert_same(before[:4], again[:4])
    assert again[4].cached_tokens == 7


def test_a_groups_samples_compute_the_prompt_once(schedulers: Any) -> None:
    plain, cached = schedulers(0), schedulers(64)
    specs = _specs(_group(8, max_new_tokens=1))
    _run(plain, specs)
    _run(cached, specs)
    assert plain.runner.computed == 8 * len(PROMPT)
    # The prompt but its last token once (SGLang's warm-up), then one token per sample.
    assert cached.runner.computed == len(PROMPT) - 1 + 8
    cached.runner.computed = 0
    done = _run(cached, _specs(_group(1, max_new_tokens=1)))  # an identical prompt, later
    assert cached.runner.computed == 1
    assert done[0].cached_tokens == len(PROMPT) - 1


def test_cached_tokens_as_sglang_counts_them(schedulers: Any) -> None:
    sched = schedulers(64)
    first = _run(sched, _specs(_group(1, max_new_tokens=2)))
    assert first[0].cached_tokens == 0  # nothing cached yet
    group = _run(sched, _specs(_group(3, [*PROMPT, 1], max_new_tokens=2)))
    assert [c.cached_tokens for c in group] == [len(PROMPT)] * 3
    # Prompt logprobs from k on: SGLang matches no further than k.
    body = {**_group(1, max_new_tokens=2), "logprob_start_len": 4}
    assert _run(sched, _specs(body))[0].cached_tokens == 4


def test_seeded_samples_are_unchanged_by_the_cache(schedulers: Any) -> None:
    plain, cached = schedulers(0), schedulers(64)
    specs = _specs(_group(8, temperature=1.0, sampling_seed=11, max_new_tokens=6))
    before, after = _run(plain, specs), _run(cached, specs)
    _assert_same(before, after)
    assert len({tuple(c.output_ids) for c in after}) > 1  # per-sample seeds: not 8 copies


def test_the_bound_holds_and_a_prefix_too_large_is_still_shared_within_its_group(
    schedulers: Any,
) -> None:
    tiny = schedulers(1e-4)  # ~100 bytes: no prompt's KV fits
    specs = _specs(_group(8, max_new_tokens=1))
    done = _run(tiny, specs)
    assert tiny.prefix_cache_entries().result(TIMEOUT) == 0
    assert tiny.runner.computed == len(PROMPT) - 1 + 8
    small = schedulers(0.05)  # ~52 KB: a few prompts of the tiny model
    for i in range(20):
        _run(small, _specs(_group(1, [60 + i, *PROMPT], max_new_tokens=1)))
    cache = small._batch.prefix_cache
    assert 0 < len(cache) < 20 and cache.nbytes <= cache.capacity and cache.evictions > 0
    assert [c.cached_tokens for c in done] == [len(PROMPT) - 1] * 8


def _cached(sched: Scheduler) -> bool:
    """Whether PROMPT's prefix is cached: a 1-token request computes 1 token."""
    before = sched.runner.computed
    _run(sched, _specs(_group(1, max_new_tokens=1)))
    return sched.runner.computed - before == 1


def _update(sched: Scheduler, model: Path, flush: bool) -> tuple[bool, str, int]:
    load = sched.runner.disk_loader(str(model))
    result: tuple[bool, str, int] = sched.update_weights(load, "2", False, flush).result(TIMEOUT)
    return result


def test_flush_cache_and_weight_updates_empty_it_as_sglang_does(
    schedulers: Any, tiny_model: Path
) -> None:
    sched = schedulers(64)
    _run(sched, _specs(_group(2, max_new_tokens=1)))
    assert _cached(sched)
    assert sched.flush_cache().result(TIMEOUT) == (True, "")
    assert not _cached(sched)  # that request cached it again
    # An update with flush_cache false keeps what the old weights computed (SGLang does).
    assert _update(sched, tiny_model, flush=False)[0]
    assert _cached(sched)
    assert _update(sched, tiny_model, flush=True)[0]
    assert sched.prefix_cache_entries().result(TIMEOUT) == 0
    # A refused load flushes nothing.
    _run(sched, _specs(_group(1, max_new_tokens=1)))
    bad = sched.update_weights(sched.runner.disk_loader("/nonexistent"), "3", False, True)
    assert bad.result(TIMEOUT)[0] is False
    assert sched.prefix_cache_entries().result(TIMEOUT) == 1


def test_flush_while_a_request_runs_is_refused_and_keeps_the_cache(schedulers: Any) -> None:
    sched = schedulers(64)
    _run(sched, _specs(_group(1, max_new_tokens=1)))
    sched.slow_down(0.05).result(TIMEOUT)
    long = _specs(_group(1, [70, 71, 72], max_new_tokens=400))[0]
    fut: Future[Completion] = Future()
    sched.submit(long, fut.set_result)
    try:
        # Admitted (so its prompt is cached) and running.
        wait_for(lambda: sched.load()["num_running_reqs"] or None, TIMEOUT, "the long request")
        assert sched.flush_cache().result(TIMEOUT) == (False, "")
        assert sched.prefix_cache_entries().result(TIMEOUT) == 2
    finally:
        sched.abort(abort_all=True).result(TIMEOUT)
        sched.slow_down(None).result(TIMEOUT)
    fut.result(TIMEOUT)


def _smollm2() -> Path:
    from services.models.gguf_import import models_dir

    path = models_dir() / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        pytest.skip(f"SmolLM2-135M-Instruct is not imported at {path} (make smollm2)")
    return path


@pytest.mark.slow
def test_a_real_model_answers_the_same_with_the_cache() -> None:
    """SmolLM2-135M-Instruct, float32: a chat-sized prompt's group, then a prompt sharing
    its first 30 tokens, then both again (whole prompts from the cache), greedy.

    One request at a time on both sides, so each answer comes from the same batch
    composition: on this model the uncached path itself moves a logprob by ~1.1e-5
    when the same prompt is prefilled beside others instead of alone (padding changes
    the matmuls' shapes), which would blur what the cache changes."""
    model = _smollm2()
    plain, cached = _scheduler(model, 0), _scheduler(model, 64)
    try:
        prompt = [1, 9690, 198, *range(2000, 2045)]  # 48 tokens
        other = [*prompt[:30], *range(3000, 3010)]
        bodies = [_group(4, prompt), _group(1, other)] * 2
        for body, hit in zip(bodies, [47, 30, 47, 39], strict=True):
            done = _run(cached, _specs(body))
            _assert_same(_run(plain, _specs(body)), done)
            assert {c.cached_tokens for c in done} == {hit}
        assert cached.runner.computed < plain.runner.computed / 3
    finally:
        plain.stop()
        cached.stop()


def test_a_flush_with_a_timeout_waits_for_idle_or_times_out(schedulers: Any) -> None:
    """SGLang 0.5.10+'s deferred flush: at the first idle moment, else at the deadline
    "Timed out waiting for idle state."; a second one meanwhile is refused."""
    sched = schedulers(64)
    sched.slow_down(0.02).result(TIMEOUT)
    short = _specs(_group(1, [80, 81, 82], max_new_tokens=15))[0]
    fut: Future[Completion] = Future()
    sched.submit(short, fut.set_result)
    wait_for(lambda: sched.load()["num_running_reqs"] or None, TIMEOUT, "the request")
    waiting = sched.flush_cache(timeout_s=60)
    assert sched.flush_cache(timeout_s=60).result(TIMEOUT) == (False, FLUSH_IN_PROGRESS)
    # At the request's end (~0.3 s of decoding), not at its 60-s deadline.
    assert waiting.result(20) == (True, "")
    assert fut.done()  # it flushed once the request had finished
    assert sched.prefix_cache_entries().result(TIMEOUT) == 0
    long = _specs(_group(1, [83, 84], max_new_tokens=400))[0]
    fut = Future()
    sched.submit(long, fut.set_result)
    wait_for(lambda: sched.load()["num_running_reqs"] or None, TIMEOUT, "the long request")
    try:
        assert sched.flush_cache(timeout_s=0.3).result(TIMEOUT) == (False, FLUSH_TIMED_OUT)
        assert sched.prefix_cache_entries().result(TIMEOUT) == 1
    finally:
        sched.abort(abort_all=True).result(TIMEOUT)
        sched.slow_down(None).result(TIMEOUT)
    fut.result(TIMEOUT)
