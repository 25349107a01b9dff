"""The Tinker sample request as SGLang's /generate body, and its answer as the SDK's
sequences (services/tinker/engines.py's pure part)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.engine.core.protocol import parse_generate, parse_sampling_params
from services.engine_api.sglang_api import Capabilities
from services.tinker.core import SampleSpec
from services.tinker.engines import (
    EngineFault,
    adapter_missing,
    generate_body,
    peft_files,
    sampling_params,
    sequences_from,
)

SPEC = SampleSpec(
    prompt=(5, 6, 7),
    num_samples=3,
    max_tokens=9,
    temperature=0.7,
    top_k=-1,
    top_p=0.9,
    seed=None,
    stop_tokens=None,
    stop_strings=(),
    prompt_logprobs=False,
)


def test_the_sdks_parameters_are_sglangs() -> None:
    assert sampling_params(SPEC) == {
        "max_new_tokens": 9, "temperature": 0.7, "top_p": 0.9, "top_k": -1,
    }  # fmt: skip
    assert sampling_params(replace(SPEC, top_k=0))["top_k"] == -1  # off, not SGLang's error
    assert sampling_params(replace(SPEC, top_k=5))["top_k"] == 5
    # Stop ids: those ids only, as the in-process sampler stops; [] never early.
    ids = sampling_params(replace(SPEC, stop_tokens=(2, 3)))
    assert ids["stop_token_ids"] == [2, 3] and ids["ignore_eos"] is True
    never = sampling_params(replace(SPEC, stop_tokens=()))
    assert never["ignore_eos"] is True and "stop_token_ids" not in never
    assert sampling_params(replace(SPEC, stop_strings=("\n",)))["stop"] == ["\n"]
    assert "ignore_eos" not in sampling_params(SPEC)  # None: the model's EOS


def test_the_body_is_one_the_engine_accepts() -> None:
    caps = Capabilities.of("0.5.23")
    plain = generate_body(SPEC, "tinker-x-1")
    assert plain["lora_path"] == "tinker-x-1" and plain["sampling_params"]["n"] == 3
    assert "lora_path" not in generate_body(SPEC, None)  # a base-model sampler
    for body in (plain, generate_body(replace(SPEC, seed=4, prompt_logprobs=True), None)):
        parsed = parse_generate(body, lambda t: [1], 1000, 4096, 128, caps)
        assert len(parsed.seqs) == 3
    seeded = generate_body(replace(SPEC, seed=4), None)
    assert [p["sampling_seed"] for p in seeded["sampling_params"]] == [4, 5, 6]
    assert all(parse_sampling_params(p).n == 1 for p in seeded["sampling_params"])
    assert generate_body(replace(SPEC, prompt_logprobs=True), None)["logprob_start_len"] == 0


def _reply(tokens: list[int], reason: str) -> dict[str, object]:
    return {
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": {"type": reason},
            "output_token_logprobs": [[-0.5 * (i + 1), t, None] for i, t in enumerate(tokens)],
            "input_token_logprobs": [[None, 5, None], [-1.0, 6, None], [-2.0, 7, None]],
        },
    }


def test_the_answer_becomes_the_sdks_sequences() -> None:
    reply = [_reply([1, 2], "stop"), _reply([3], "length"), _reply([], "length")]
    seqs, prompt_lp = sequences_from(reply, SPEC)
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in seqs] == [
        ([1, 2], [-0.5, -1.0], "stop"), ([3], [-0.5], "length"), ([], [], "length"),
    ]  # fmt: skip
    assert prompt_lp is None
    one = replace(SPEC, num_samples=1, prompt_logprobs=True)
    _, prompt_lp = sequences_from(_reply([1], "stop"), one)  # n = 1: a dict, not a list
    assert prompt_lp is not None and math.isnan(prompt_lp[0]) and prompt_lp[1:] == [-1.0, -2.0]


@pytest.mark.parametrize(
    "reply",
    [
        [_reply([1], "stop")],  # fewer completions than asked
        [_reply([1], "abort"), _reply([1], "stop"), _reply([1], "stop")],
        [{**_reply([1], "stop"), "output_ids": [1, 2]}] * 3,  # tokens without logprobs
    ],
)
def test_an_answer_that_does_not_fit_is_a_server_fault(reply: object) -> None:
    with pytest.raises(EngineFault):
        sequences_from(reply, SPEC)


def test_the_adapter_is_peft_s_layout() -> None:
    import torch

    names = [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        "base_model.model.lm_head.lora_A.weight",
    ]
    files, config = peft_files({n: torch.zeros(2, 2) for n in names}, 2, 32.0, "m")
    assert set(files) == set(names)
    assert config["target_modules"] == ["lm_head", "q_proj"]
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (2, 32.0, "LORA")


def test_an_adapter_the_engine_lost_is_told_from_other_refusals() -> None:
    # SGLang's texts (services/engine/loras.py): not registered, and never loaded here.
    lost = "The following requested LoRA adapters are not loaded: tinker-a-1\nLoaded adapters: x."
    never = "Got LoRA adapter that has never been loaded: tinker-a-1\nAll loaded adapters: ."
    assert adapter_missing(lost, "tinker-a-1") and adapter_missing(never, "tinker-a-1")
    assert not adapter_missing(lost, None)  # a base-model sample names no adapter
    assert not adapter_missing("top_p must be in (0, 1], got 2.", "tinker-a-1")
