"""`logprob_start_len` as each SGLang release's scheduler resolves it (read from the wheels:
0.5.4's `>=` refusal for a generating request, 0.5.7's `>`, 0.5.9's len - 1 for a
prefill-only default, 0.5.10's len), through the CPU engine's request parser."""

from __future__ import annotations

import pytest

from services.engine.core.protocol import RequestError, parse_generate
from services.engine_api.sglang_api import Capabilities

IDS = [4, 5, 6, 7, 8]


def start(version: str, k: int | None, max_new: int, return_logprob: bool = True) -> int | None:
    body: dict[str, object] = {
        "input_ids": IDS,
        "sampling_params": {"max_new_tokens": max_new},
        "return_logprob": return_logprob,
    }
    if k is not None:
        body["logprob_start_len"] = k
    parsed = parse_generate(body, lambda t: [], 100, 64, caps=Capabilities.of(version))
    return parsed.seqs[0].input_start


@pytest.mark.parametrize(
    ("version", "generating", "prefill_only"),
    [("0.5.4", 4, 5), ("0.5.8", 4, 5), ("0.5.9", 4, 4), ("0.5.10", 5, 5), ("0.5.23", 5, 5)],
)
def test_the_default_start(version: str, generating: int, prefill_only: int) -> None:
    assert start(version, None, 3) == generating
    assert start(version, None, 0) == prefill_only


@pytest.mark.parametrize("version", ["0.5.4", "0.5.6", "0.5.7", "0.5.23"])
def test_a_start_beyond_the_prompt_is_refused_with_the_schedulers_words(version: str) -> None:
    with pytest.raises(RequestError, match=r"req.logprob_start_len=6 is higher than the number"):
        start(version, 6, 0)
    assert start(version, 5, 0) == 5  # prefill only: nothing to score, accepted
    assert start(version, 2, 3) == 2


@pytest.mark.parametrize(
    ("version", "refused"), [("0.5.4", True), ("0.5.6", True), ("0.5.7", False)]
)
def test_start_at_the_prompt_end_of_a_generating_request(version: str, refused: bool) -> None:
    if refused:
        with pytest.raises(RequestError, match="is higher than the number of input tokens"):
            start(version, 5, 3)
    else:
        assert start(version, 5, 3) == 5


def test_without_return_logprob_the_start_is_ignored_and_bad_values_refused() -> None:
    assert start("0.5.23", 99, 0, return_logprob=False) is None
    with pytest.raises(RequestError, match="-1 or at least 0"):
        start("0.5.23", -2, 0)
    with pytest.raises(RequestError, match="integer"):
        start("0.5.23", True, 0)
