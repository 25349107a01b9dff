"""The CPU engine's pure parts: sampling, the batched KV layout, request parsing, stops."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from services.engine.core import kvbatch
from services.engine.core.protocol import (
    Completion,
    RequestError,
    SamplingParams,
    SeqSpec,
    parse_generate,
    parse_sampling_params,
    response,
    trim_text,
    version_spans,
)
from services.engine.core.sampling import sample_rows, truncation_mask, uniform_noise
from services.engine.core.sequence import Seq, stop_reason
from services.engine.settings import EngineSettings
from services.engine_api.sglang_api import Capabilities
from services.engine_api.sglang_launcher import SGLangOptions, command, environment
from services.runtime.errors import ConfigError
from services.runtime.settings import load_settings

# ---- sampling ------------------------------------------------------------------------------


def _rows(n: int, t: float = 1.0, p: float = 1.0, k: int = 0) -> tuple[torch.Tensor, ...]:
    return torch.full((n,), t), torch.full((n,), p), torch.full((n,), k, dtype=torch.long)


def test_logprob_is_the_tempered_distribution_before_truncation() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 3)
    temp = torch.tensor([0.7, 1.0, 0.0])
    noise = torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    tokens, lps = sample_rows(logits, temp, torch.tensor([0.5, 1.0, 1.0]),
                              torch.tensor([0, 2, 0]), noise)  # fmt: skip
    for row, t in enumerate([0.7, 1.0, 1.0]):  # greedy row reports T = 1
        expected = torch.log_softmax(logits[row] / t, -1)[tokens[row]]
        assert math.isclose(lps[row].item(), expected.item(), abs_tol=1e-6)
    assert tokens[2].item() == 0  # greedy = argmax


def test_truncation_mask_top_p_and_top_k() -> None:
    logp = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 3))
    keep = truncation_mask(logp, torch.tensor([0.5, 1.0, 0.05]), torch.tensor([0, 3, 0]))
    # top_p 0.5: 0.4 (mass before 0) and 0.3 (mass before 0.4 < 0.5); not 0.2 (0.7).
    assert keep[0].tolist() == [False, True, False, True]
    assert keep[1].tolist() == [False, True, True, True]  # top_k 3
    assert keep[2].tolist() == [False, True, False, False]  # always the best one


def test_sampling_frequencies_follow_the_truncated_distribution() -> None:
    n = 40_000
    logits = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3])).repeat(n, 1)
    noise = torch.rand(n, 4, generator=torch.Generator().manual_seed(1))
    tokens, _ = sample_rows(logits, *_rows(n), noise)
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.1, 0.4, 0.2, 0.3]), atol=0.01)
    tokens, _ = sample_rows(logits, *_rows(n, p=0.6), noise)  # keeps {0.4, 0.3}
    freq = torch.bincount(tokens, minlength=4).float() / n
    assert torch.allclose(freq, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]), atol=0.01)


def test_seeded_rows_draw_the_same_noise_in_any_batch() -> None:
    shared = torch.Generator().manual_seed(0)
    alone = uniform_noise(1, 5, shared, [torch.Generator().manual_seed(42)])
    mixed = uniform_noise(3, 5, shared, [None, torch.Generator().manual_seed(42), None])
    assert torch.equal(alone[0], mixed[1])
    assert not torch.equal(mixed[0], mixed[2])


# ---- KV batch layout -------------------------------------------------------------------------


def _kv(lengths: list[int], width: int, fill: float) -> kvbatch.KVBatch:
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, width - n :] = 1
    k = torch.full((len(lengths), 2, width, 3), fill)  # [B, H, T, D]
    return kvbatch.zero_padding(kvbatch.KVBatch([(k, k.clone())], mask, torch.tensor(lengths)))


def test_join_right_aligns_and_select_trims() -> None:
    joined = kvbatch.join(_kv([2, 3], 3, 1.0), _kv([5], 5, 2.0))
    assert joined.width == 5 and joined.lengths.tolist() == [2, 3, 5]
    assert joined.mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    keys = joined.layers[0][0]
    assert keys[0, :, :3].abs().sum() == 0 and (keys[0, :, 3:] == 1.0).all()
    assert (keys[2] == 2.0).all()
    kept = kvbatch.select(joined, [1, 0])
    assert kept is not None and kept.width == 3  # the 5-long row left: trimmed to 3
    assert kept.lengths.tolist() == [3, 2] and kept.mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert kvbatch.select(joined, []) is None


def test_left_pad_ids_and_positions() -> None:
    ids, mask = kvbatch.left_pad_ids([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert kvbatch.positions(mask).tolist() == [[0, 1, 2], [0, 0, 0]]


# ---- request parsing and responses -----------------------------------------------------------


def _parse(body: object) -> object:
    return parse_generate(
        body, lambda s: [ord(c) % 90 for c in s], vocab_size=100, context_len=1000
    )


def test_parse_single_batch_and_n() -> None:
    single = _parse({"text": "ab", "rid": "x", "sampling_params": {"max_new_tokens": 4}})
    assert single.as_list is False and [s.out_id for s in single.seqs] == ["x"]
    batch = _parse({"input_ids": [[1, 2], [3]], "rid": ["p", "q"],
                    "sampling_params": [{"top_k": 5}, {"top_k": -1}]})  # fmt: skip
    assert batch.as_list is True and [s.out_id for s in batch.seqs] == ["p", "q"]
    assert [s.params.top_k for s in batch.seqs] == [5, 0]  # SGLang's -1 is this sampler's 0
    assert batch.held == ["p", "q"] and batch.claimed == []
    # n > 1: every sample its own random id (SGLang's regenerate_rid), seeds differ
    multi = _parse(
        {"input_ids": [1, 2], "rid": "g", "sampling_params": {"n": 3, "sampling_seed": 10}}
    )
    ids = [s.out_id for s in multi.seqs]
    assert multi.as_list is True and len(set(ids)) == 3 and all(len(i) == 32 for i in ids)
    assert [s.params.sampling_seed for s in multi.seqs] == [10, 11, 12]
    assert multi.held == [] and multi.claimed == ["g_0", "g_1", "g_2"]
    with pytest.raises(RequestError, match="parallel_sample_num should be the same"):
        _parse({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {"n": 1}]})


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
        ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
        ({"temperature": -0.5}, "temperature must be non-negative, got -0.5."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
        ({"temprature": 1}, "unknown field `temprature`"),
    ],
)
def test_sampling_params_refused_in_sglangs_words(params: dict, message: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_sampling_params(params)
    assert str(err.value).startswith(message)


def test_top_k_zero_is_greedy_at_temperature_zero() -> None:
    assert parse_sampling_params({"top_k": 0, "temperature": 0.0}).top_k == 0  # argmax anyway


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"text": 5},
        {"input_ids": []},
        {"input_ids": [[1], []]},
        {"text": "a", "stream": True},
        {"text": "a", "sampling_params": {"n": 0}},
        {"text": "a", "sampling_params": {"stop": [""]}},
        {"text": "a", "sampling_params": {"stop_token_ids": [1.5]}},
        {"text": "a", "sampling_params": {"ignore_eos": "no"}},
        {"text": "a", "sampling_params": {"max_new_tokens": 1000}},
        {"text": "a", "sampling_params": {"temperature": True}},
        {"text": ["a", "b"], "rid": "one"},
    ],
)
def test_parse_refuses(body: object) -> None:
    with pytest.raises(RequestError):
        _parse(body)


def test_response_shape_and_trim() -> None:
    p = parse_sampling_params({"stop": "##", "max_new_tokens": 3})
    spec = SeqSpec("r", (1, 2), p, True)
    done = Completion([7, 8], [-0.5, -0.25], {"type": "stop", "matched": "##"}, "v3", 0.1, "##",
                      spans=[("v2", 0, 1), ("v3", 1, 2)])  # fmt: skip
    out = response(spec, done, trim_text("ab##cd", p, "##"), reported_version="v2",
                   caps=Capabilities.of("0.5.23"))  # fmt: skip
    assert out["text"] == "ab" and out["output_ids"] == [7, 8]
    meta = out["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 7, None], [-0.25, 8, None]]
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (
        2,
        2,
        "v3",
    )
    assert meta["weight_versions"] == [{"version": "v2", "start": 0, "end": 1},
                                       {"version": "v3", "start": 1, "end": 2}]  # fmt: skip
    old = response(spec, done, "ab", reported_version="v2", caps=Capabilities.of("0.5.4"))
    assert "weight_versions" not in old["meta_info"] and old["meta_info"]["weight_version"] == "v2"
    no_trim = parse_sampling_params({"stop": "##", "no_stop_trim": True})
    assert trim_text("ab##cd", no_trim, "##") == "ab##cd"


def test_version_spans_as_sglang_computes_them() -> None:
    assert version_spans([], "3", 4) == [("3", 0, 4)]
    assert version_spans([], "3", 0) == [("3", 0, 0)]
    # v3 for 2 tokens, then v4 (changed again to v5 before any v4 token, then v5)
    assert version_spans([("3", 2), ("4", 2)], "5", 6) == [("3", 0, 2), ("5", 2, 6)]
    assert version_spans([("3", 2)], "4", 2) == [("3", 0, 2)]  # nothing after the change yet


def _seq(params: SamplingParams, out: list[int]) -> Seq:
    s = Seq(spec=SeqSpec("r", (1,), params, False), on_done=lambda c: None, t0=0.0)
    s.output_ids = out
    return s


def test_stop_reasons() -> None:
    eos = frozenset({1})

    def decode(ids: list[int], skip: bool) -> str:
        return "".join(chr(96 + i) for i in ids)  # 2 -> "b", 3 -> "c"

    base = SamplingParams(max_new_tokens=4)
    assert stop_reason(_seq(base, [2, 1]), eos, decode)[0] == {"type": "stop", "matched": 1}
    ignore = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert stop_reason(_seq(ignore, [2, 1]), eos, decode) == (None, None)
    ids = SamplingParams(max_new_tokens=4, ignore_eos=True, stop_token_ids=(1,))
    assert stop_reason(_seq(ids, [1]), eos, decode)[0] == {"type": "stop", "matched": 1}
    text = SamplingParams(max_new_tokens=9, stop=("bc",))
    assert stop_reason(_seq(text, [4, 2, 3]), eos, decode) == (
        {"type": "stop", "matched": "bc"}, "bc")  # fmt: skip
    assert stop_reason(_seq(base, [2, 2, 2, 2]), eos, decode)[0] == {"type": "length", "length": 4}


# ---- settings and the SGLang command ---------------------------------------------------------


def test_engine_settings_env_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLYWHEEL_ENGINE_PORT", "31234")
    s = load_settings(EngineSettings, model="/m")
    assert (s.port, s.host, s.api_key, s.model) == (31234, "127.0.0.1", None, Path("/m"))
    with pytest.raises(ConfigError, match="max_running_requests"):
        load_settings(EngineSettings, max_running_requests=0)


def test_sglang_command() -> None:
    argv = command(SGLangOptions(Path("/models/q"), port=30001, weight_version="7",
                                 api_key="k", deterministic=True), python="py")  # fmt: skip
    # The key is never on the command line: keyed_launch adds it from the environment.
    assert argv[:4] == ["py", "-m", "services.engine_api.keyed_launch", "sglang.launch_server"]
    assert "k" not in argv and "--api-key" not in argv
    assert environment(SGLangOptions(Path("/m"), api_key="k")) == {"FLYWHEEL_ENGINE_API_KEY": "k"}
    flags = dict(zip(argv[4::2], argv[5::2], strict=False))
    assert flags["--model-path"] == "/models/q" and flags["--port"] == "30001"
    assert flags["--weight-version"] == "7"
    assert argv[-1] == "--enable-deterministic-inference"
    plain = command(SGLangOptions(Path("/m")), python=sys.executable)
    assert plain[1:3] == ["-m", "sglang.launch_server"] and "--api-key" not in plain
    assert environment(SGLangOptions(Path("/m"))) == {}
