"""The CPU engine's OpenAI routes default as SGLang's do (core/openai_protocol.py).

Chat takes what the request leaves out from the model's generation_config.json
(SGLang's ModelConfig.get_default_sampling_params and ChatCompletionRequest.
to_sampling_params), as the release at hand reads that file; completions never
do; a request naming no model is answered as model "default".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.engine.core import openai_protocol as oa
from services.engine.core.protocol import RequestError
from services.engine.runner import generation_config
from services.engine_api.sglang_api import Capabilities

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(body: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    native = oa.chat_request({"messages": MESSAGES, **body}, lambda m: [1, 2], defaults)
    return dict(native["sampling_params"])


def test_the_release_decides_whether_transformers_fills_the_rest() -> None:
    # 0.5.4-0.5.9 pin transformers 4.57.1 (GenerationConfig defaults filled in);
    # 0.5.10 moved to transformers 5 (defaults None).
    assert Capabilities.of("0.5.4").generation_config_fills_hf_defaults
    assert Capabilities.of("0.5.9").generation_config_fills_hf_defaults
    assert not Capabilities.of("0.5.10").generation_config_fills_hf_defaults
    assert not Capabilities.of("0.5.23").generation_config_fills_hf_defaults


def test_generation_defaults_keep_the_sampling_fields_set() -> None:
    qwen = {"eos_token_id": [1, 2], "temperature": 0.7, "top_k": 20, "top_p": 0.8,
            "repetition_penalty": 1.05, "do_sample": True}  # fmt: skip
    want = {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}
    assert oa.generation_defaults(qwen, hf_fills_defaults=False) == want
    assert oa.generation_defaults(qwen, hf_fills_defaults=True) == want
    assert oa.generation_defaults({"eos_token_id": 2}, hf_fills_defaults=False) == {}
    assert oa.generation_defaults({"eos_token_id": 2}, hf_fills_defaults=True) == {
        "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}  # fmt: skip
    assert oa.generation_defaults(None, hf_fills_defaults=True) == {}


@pytest.mark.parametrize(
    "config",
    [{"eos_token_id": 2}, {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0},
     {"repetition_penalty": 1.1, "top_p": None}],
)  # fmt: skip
def test_generation_defaults_match_the_installed_transformers(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    """What SGLang computes with the transformers installed here: 5.x (what SGLang >= 0.5.10
    pins) leaves unset fields None; 4.x (0.5.4-0.5.9's pin; `make test-deps`) fills its own
    defaults in."""
    import transformers
    from transformers import GenerationConfig

    fills = int(transformers.__version__.split(".")[0]) < 5
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    hf = GenerationConfig.from_pretrained(tmp_path).to_dict()
    sglang = {p: hf[p] for p in oa.GENERATION_CONFIG_FIELDS if hf.get(p) is not None}
    assert oa.generation_defaults(generation_config(tmp_path), fills) == sglang


def test_generation_config_file(tmp_path: Path) -> None:
    assert generation_config(tmp_path) is None
    (tmp_path / "generation_config.json").write_text("{not json")
    assert generation_config(tmp_path) is None
    (tmp_path / "generation_config.json").write_text('{"top_k": 20}')
    assert generation_config(tmp_path) == {"top_k": 20}


def test_chat_takes_what_the_request_leaves_out_from_the_model() -> None:
    model = {"temperature": 0.7, "top_k": 20, "top_p": 0.8}
    assert chat({}, model) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert chat({"temperature": 1.0, "top_k": -1}, model) == {
        "temperature": 1.0, "top_p": 0.8, "top_k": -1}  # fmt: skip
    assert chat({"top_p": None}, model)["top_p"] == 0.8  # null: not given
    assert chat({}, {}) == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def test_completions_never_take_the_model_defaults() -> None:
    native = oa.completion_request({"prompt": "hi"})
    assert "temperature" not in native["sampling_params"]  # /generate's 1.0


def test_a_penalty_or_min_p_this_engine_cannot_apply_is_refused() -> None:
    with pytest.raises(RequestError, match=r"repetition_penalty 1\.05 \(the model"):
        chat({}, {"repetition_penalty": 1.05})
    with pytest.raises(RequestError, match=r"min_p 0\.1 \(the request"):
        chat({"min_p": 0.1})
    # Asked for explicitly, the neutral values sample without them.
    assert chat({"repetition_penalty": 1.0, "min_p": 0.0}, {"repetition_penalty": 1.05})
    with pytest.raises(RequestError, match="repetition_penalty"):
        oa.completion_request({"prompt": "hi", "repetition_penalty": 1.2})


def _answer(body: dict[str, Any]) -> dict[str, Any]:
    meta = {"id": "r", "prompt_tokens": 1, "completion_tokens": 1, "weight_version": "0",
            "finish_reason": {"type": "length"}}  # fmt: skip
    outs = [{"text": "a", "output_ids": [3], "meta_info": meta}]
    return oa.chat_response(body, outs, [1], str)


def test_the_model_answered_is_the_requests_or_default() -> None:
    assert _answer({"messages": MESSAGES})["model"] == "default"
    assert _answer({"messages": MESSAGES, "model": "judge"})["model"] == "judge"
    assert _answer({"messages": MESSAGES, "model": ""})["model"] == ""
    with pytest.raises(RequestError, match="model must be a string"):
        oa.chat_request({"messages": MESSAGES, "model": None}, lambda m: [1], None)
