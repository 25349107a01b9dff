"""SGLang's OpenAI-compatible `/v1/completions` and `/v1/chat/completions`, pure.

Shapes follow SGLang 0.5.23 (`entrypoints/openai/protocol.py`,
`serving_chat.py`, `serving_completions.py`): a request becomes the native
/generate body (sampling parameters renamed: `max_tokens` ->
`max_new_tokens`, …), and the native answers become the OpenAI response:

- completions: `choices[].text`, `logprobs` = {tokens, token_logprobs,
  text_offset, top_logprobs} when `logprobs` is set, `token_ids` and
  `prompt_token_ids` with `return_token_ids`;
- chat: `choices[].message` {role: "assistant", content}, `logprobs` =
  {content: [{token, bytes, logprob, top_logprobs}]} when `logprobs` is
  true, `response_token_ids`/`prompt_token_ids` with `return_token_ids`;
- both: `finish_reason`, `matched_stop`, `usage` {prompt_tokens,
  completion_tokens, total_tokens}, `metadata` {weight_version(s)}, `id` =
  the first completion's request id, `model` = the request's, or "default"
  when it names none (protocol.py's DEFAULT_MODEL_NAME is the field's
  default, and serving_*.py answer `request.model`).

Sampling defaults: chat takes temperature, top_p, top_k, min_p and
repetition_penalty the request leaves out from the model's
generation_config.json (`ChatCompletionRequest.to_sampling_params`: the
request's value, else `model_generation_config`, else OpenAI's 1.0/1.0/-1/
0.0/1.0; `model_generation_config` is `ModelConfig.
get_default_sampling_params()`, `--sampling-defaults model` being the
default in 0.5.4 and 0.5.23). Completions never do (`CompletionRequest`'s
own field defaults). `generation_defaults` reads them as the release does.

Not served (refused with a 400 naming the field, as the CPU engine cannot
honour them): streaming, tools/tool_choice parsing, logit_bias, penalties
(a repetition_penalty other than 1.0 too, the model's default included),
min_p > 0, top_logprobs > 0, echo, grammars. A trainer needs the token ids and
logprobs; the text is the tokenizer's decoding of those ids.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.engine.core.protocol import RequestError

DEFAULT_MODEL_NAME = "default"
"""SGLang's `protocol.py` DEFAULT_MODEL_NAME: the `model` of a request that names none."""

# ModelConfig.get_default_sampling_params: what generation_config.json may set.
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
# transformers 4.57.1's GenerationConfig defaults for those (SGLang 0.5.4-0.5.9 pin it;
# its to_dict() carries them for whatever the file leaves out; min_p's is None).
_HF4_DEFAULTS = {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
# ChatCompletionRequest._DEFAULT_SAMPLING_PARAMS: what neither request nor model sets.
_OPENAI_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

# OpenAI fields the CPU engine refuses when set to anything but their default.
_UNSUPPORTED: dict[str, Any] = {
    "stream": False,
    "logit_bias": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "echo": False,
    "best_of": None,
    "suffix": None,
    "tools": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "response_format": None,
}
# OpenAI/SGLang name -> the native sampling_params name.
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "n": "n",
    "ignore_eos": "ignore_eos",
    "no_stop_trim": "no_stop_trim",
    "skip_special_tokens": "skip_special_tokens",
    "seed": "sampling_seed",
}


def generation_defaults(config: dict[str, Any] | None, hf_fills_defaults: bool) -> dict[str, Any]:
    """The chat sampling defaults SGLang takes from a model's generation_config.json
    (`config`, None when there is no file): `ModelConfig.get_default_sampling_params`
    keeps the fields that are not None of `GenerationConfig.to_dict()`, which under
    transformers 4 (`hf_fills_defaults`, SGLang < 0.5.10) holds its own defaults
    for those the file leaves out."""
    if config is None:
        return {}
    merged = {**(_HF4_DEFAULTS if hf_fills_defaults else {}), **config}
    return {k: merged[k] for k in GENERATION_CONFIG_FIELDS if merged.get(k) is not None}


def _chat_sampling(body: dict[str, Any], model_defaults: dict[str, Any]) -> dict[str, Any]:
    """`ChatCompletionRequest.to_sampling_params`' get_param: the request's value, else
    the model's, else OpenAI's; refuses a penalty or min_p this engine cannot apply."""
    out = {}
    for key, openai in _OPENAI_DEFAULTS.items():
        value = body.get(key)
        out[key] = value if value is not None else model_defaults.get(key, openai)
    for key, neutral in (("repetition_penalty", 1.0), ("min_p", 0.0)):
        if out[key] != neutral:
            given = body.get(key) is not None
            whose = "the request's" if given else "the model's generation_config.json default"
            raise RequestError(
                f"{key} {out[key]} ({whose}) is not supported by this engine; "
                f"send {key} {neutral} to sample without it"
            )
    return {k: out[k] for k in ("temperature", "top_p", "top_k")}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, default in _UNSUPPORTED.items():
        if key in body and body[key] not in (default, [], {}):
            raise RequestError(f"{key} is not supported by this engine")
    if body.get("top_logprobs"):
        raise RequestError("top_logprobs is not supported by this engine")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model must be a string")


def sampling_params(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    params = {native: body[k] for k, native in _SAMPLING.items() if body.get(k) is not None}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    return params


def _max_tokens(body: dict[str, Any], *keys: str) -> int | None:
    for k in keys:
        v = body.get(k)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise RequestError(f"{k} must be a non-negative integer")
            return v
    return None


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    _refuse_unsupported(body)
    return body


def completion_request(body: Any) -> dict[str, Any]:
    """A /v1/completions body as the native /generate body (one prompt)."""
    body = _object(body)
    prompt = body.get("prompt")
    native: dict[str, Any] = {}
    if isinstance(prompt, str):
        native["text"] = prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        native["input_ids"] = prompt
    else:
        raise RequestError("prompt must be a string or a list of token ids (one prompt)")
    lp = body.get("logprobs")
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
        raise RequestError("logprobs must be a non-negative integer")
    # CompletionRequest's repetition_penalty (1.0) and min_p (0.0) are plain fields.
    if body.get("repetition_penalty", 1.0) != 1.0 or body.get("min_p", 0.0) != 0.0:
        raise RequestError("repetition_penalty and min_p are not supported by this engine")
    native["sampling_params"] = sampling_params(body, _max_tokens(body, "max_tokens") or 16)
    native["return_logprob"] = lp is not None
    if isinstance(body.get("rid"), str):
        native["rid"] = body["rid"]
    return native


def chat_request(
    body: Any,
    apply_template: Callable[[list[Any]], list[int]],
    model_defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A /v1/chat/completions body as the native /generate body (the template applied,
    what it leaves unset from `model_defaults`: `generation_defaults`)."""
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role")
        if not isinstance(m.get("content", ""), str):
            raise RequestError(f"messages[{i}].content: only text content is supported")
    if not isinstance(body.get("logprobs", False), bool):
        raise RequestError("logprobs must be a boolean")
    max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    native: dict[str, Any] = {
        "input_ids": apply_template(messages),
        "sampling_params": {
            **sampling_params(body, max_tokens),
            **_chat_sampling(body, model_defaults or {}),
        },
        "return_logprob": bool(body.get("logprobs", False)),
    }
    if isinstance(body.get("rid"), str):
        native["rid"] = body["rid"]
    return native


def _usage(outs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def _metadata(meta: dict[str, Any]) -> dict[str, Any]:
    """SGLang's build_endpoint_weight_version_metadata."""
    out = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        out["weight_versions"] = meta["weight_versions"]
    return out


def _finish(meta: dict[str, Any]) -> dict[str, Any]:
    reason = meta.get("finish_reason") or {}
    return {"finish_reason": reason.get("type"), "matched_stop": reason.get("matched")}


def _pairs(meta: dict[str, Any]) -> list[tuple[float, int]]:
    return [(float(lp), int(t)) for lp, t, _ in meta.get("output_token_logprobs") or []]


def _envelope(
    kind: str, body: dict[str, Any], outs: list[dict[str, Any]], choices: list[Any]
) -> dict[str, Any]:
    """What both /v1 responses wrap their choices in (SGLang's serving_*.py)."""
    return {
        "id": outs[0]["meta_info"]["id"],
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model", DEFAULT_MODEL_NAME),
        "choices": choices,
        "usage": _usage(outs, int(body.get("n") or 1)),
        "metadata": _metadata(outs[0]["meta_info"]),
    }


def completion_response(
    body: dict[str, Any],
    outs: list[dict[str, Any]],
    prompt_ids: list[int],
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """The native answers as a /v1/completions response."""
    want_ids = bool(body.get("return_token_ids"))
    choices = []
    for i, o in enumerate(outs):
        meta = o["meta_info"]
        choice: dict[str, Any] = {"index": i, "text": o["text"], "logprobs": None, **_finish(meta)}
        if body.get("logprobs") is not None:
            tokens = [token_text(t) for _, t in _pairs(meta)]
            offsets, at = [], 0
            for tok in tokens:
                offsets.append(at)
                at += len(tok)
            choice["logprobs"] = {
                "text_offset": offsets,
                "token_logprobs": [lp for lp, _ in _pairs(meta)],
                "tokens": tokens,
                "top_logprobs": [],
            }
        if want_ids:
            choice["token_ids"] = list(o["output_ids"])
            choice["prompt_token_ids"] = list(prompt_ids)
        choices.append(choice)
    return _envelope("text_completion", body, outs, choices)


def chat_response(
    body: dict[str, Any],
    outs: list[dict[str, Any]],
    prompt_ids: list[int],
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """The native answers as a /v1/chat/completions response."""
    want_ids = bool(body.get("return_token_ids"))
    choices = []
    for i, o in enumerate(outs):
        meta = o["meta_info"]
        logprobs = None
        if body.get("logprobs"):
            content = []
            for lp, t in _pairs(meta):
                text = token_text(t)
                entry = {"token": text, "bytes": list(text.encode()), "logprob": lp}
                content.append({**entry, "top_logprobs": []})
            logprobs = {"content": content}
        choice: dict[str, Any] = {
            "index": i,
            "message": {"role": "assistant", "content": o["text"], "reasoning_content": None},
            "logprobs": logprobs,
            **_finish(meta),
        }
        if want_ids or body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = list(prompt_ids)
        if want_ids:
            choice["response_token_ids"] = list(o["output_ids"])
        choices.append(choice)
    return _envelope("chat.completion", body, outs, choices)
