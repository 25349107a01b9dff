"""SGLang's native `/generate` contract: request parsing and response shaping (pure).

Field names and shapes follow SGLang 0.5.x (`python/sglang/srt/managers/
io_struct.py::GenerateReqInput` and `entrypoints/http_server.py`):

- input: exactly one of `text` (str or list of str) or `input_ids` (list of
  int, or list of lists for a batch); `rid` (str, or one per prompt);
  `sampling_params` (one dict, or one per prompt); `return_logprob`.
- `sampling_params`: temperature, top_p, top_k (-1 = off, or >= 1; 0 is
  refused unless temperature is 0, as `SamplingParams.verify` does),
  max_new_tokens, stop (str or list), stop_token_ids, n, ignore_eos,
  no_stop_trim, skip_special_tokens, sampling_seed; unknown keys are refused
  (0.5.22+ in the words of its schema check, `api/v1/api_types.py`).
- ids: one completion of one prompt is answered under the request's `rid`;
  with `n > 1` every sample gets its own random id (`tokenizer_manager.
  _handle_batch_request` calls `regenerate_rid()` per sample), and the
  request's rid only exists as `{rid}_{i}` while the request is admitted.
- output, one dict per completion: `text`, `output_ids`, `meta_info` with
  `id`, `finish_reason`, `prompt_tokens`, `completion_tokens`,
  `cached_tokens`, `weight_version`, `e2e_latency` and, with
  `return_logprob`, `output_token_logprobs` = [[logprob, token_id, null], …].
  A single prompt with n == 1 returns a dict; a batch or n > 1 returns a list
  ordered prompt-major (all n samples of prompt 0, then prompt 1, …).
- prompt logprobs (a teacher scoring a sequence): `logprob_start_len` k (an
  int, or one per prompt) with `return_logprob` answers
  `meta_info.input_token_logprobs` = [[logprob, token_id, null], …] for
  `input_ids[k:]`, the first entry's logprob always null (SGLang's
  `_process_input_token_logprobs`: `[None] + logprobs[:-1]`), so the logprob
  of token i > k is log p(input_ids[i] | input_ids[:i]) from the raw logits.
  `max_new_tokens = 0` answers at once with no output (finish "length", 0).
  k = -1 (the default) and k beyond the prompt follow the release
  (`Capabilities.default_input_start`, `refuses_input_start`: a 400 with the
  scheduler's "... is higher than the number of input tokens ...").
  Without return_logprob, k is ignored.
- finish reasons: {"type": "stop", "matched": token_id | stop_str},
  {"type": "length", "length": max_new_tokens},
  {"type": "abort", "message": str}.

The stop token (EOS or a stop_token_id) stays in `output_ids` and in the
logprobs: a trainer must see it to learn to stop. Only `text` is trimmed (a
matched stop string is cut unless `no_stop_trim`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from services.engine_api.sglang_api import Capabilities
from services.runtime.errors import FlywheelError


class RequestError(FlywheelError, ValueError):
    """A request the engine refuses (answered with HTTP 400 and this message).

    `schema`: the body breaks the JSON contract itself (an unknown field),
    which SGLang 0.5.22+ answers as `{"error": "<text>"}` rather than
    `{"error": {"message": ...}}`.
    """

    def __init__(self, message: str, *, schema: bool = False) -> None:
        super().__init__(message)
        self.schema = schema


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, validated (SGLang names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k here (SGLang's -1; a request's 0 is refused)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None


_BOOL_FIELDS = ("ignore_eos", "no_stop_trim", "skip_special_tokens")
# Accepted and ignored: SGLang fields with no effect on a plain CPU sampler.
_IGNORED_FIELDS = frozenset(
    {"min_new_tokens", "spaces_between_special_tokens", "custom_params", "min_p"}
)
SAMPLING_EPS = 1e-6
"""SGLang's `_SAMPLING_EPS`: a temperature below it is greedy (top_k = 1)."""


MAX_N = 4096
"""Most completions one request may ask for (PromptTask.n's bound too). Without a
bound, n = 10**9 held the event loop for minutes (a fuzzer's find, tests/fuzz)."""


def _number(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RequestError(f"sampling_params.{key} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError as e:  # an integer literal beyond float range
        raise RequestError(f"sampling_params.{key} is out of range") from e
    # JSON parsers accept NaN/Infinity; a NaN temperature makes NaN probabilities.
    if not math.isfinite(number):
        raise RequestError(f"sampling_params.{key} must be finite, got {value!r}")
    return number


def _integer(d: dict[str, Any], key: str, default: int | None) -> int | None:
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def parse_sampling_params(raw: Any, default_max_new_tokens: int = 128) -> SamplingParams:
    """Validate one `sampling_params` dict; RequestError names the bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError("sampling_params must be an object")
    known = [*SamplingParams.__dataclass_fields__, *sorted(_IGNORED_FIELDS)]
    unknown = [k for k in raw if k not in known]
    if unknown:
        listed = ", ".join(f"`{k}`" for k in known)
        raise RequestError(f"unknown field `{unknown[0]}`, expected one of {listed}", schema=True)
    temperature = _number(raw, "temperature", 1.0)
    top_p = _number(raw, "top_p", 1.0)
    top_k = _integer(raw, "top_k", -1)
    max_new = _integer(raw, "max_new_tokens", default_max_new_tokens)
    n = _integer(raw, "n", 1)
    seed = _integer(raw, "sampling_seed", None)
    assert max_new is not None and n is not None and top_k is not None
    # SGLang's SamplingParams: a temperature under eps becomes greedy (top_k = 1)
    # before verify(), so only a sampled request's top_k 0 is an error.
    if 0 <= temperature < SAMPLING_EPS:
        top_k = 1
    if temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1 and top_k != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    if not 1 <= n <= MAX_N:
        raise RequestError(f"sampling_params.n must be in 1..{MAX_N}")
    stop = raw.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("sampling_params.stop must be a string or a list of non-empty strings")
    stop_ids = raw.get("stop_token_ids") or ()
    if not isinstance(stop_ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise RequestError("sampling_params.stop_token_ids must be a list of integers")
    flags = {}
    for key in _BOOL_FIELDS:
        value = raw.get(key, getattr(SamplingParams, key))
        if not isinstance(value, bool):
            raise RequestError(f"sampling_params.{key} must be a boolean")
        flags[key] = value
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=_top_k(top_k, temperature),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        n=n,
        sampling_seed=seed,
        **flags,
    )


def _top_k(top_k: int, temperature: float) -> int:
    """SGLang's top_k (-1 off, >= 1) as this sampler's (0 off); greedy rows sample argmax."""
    return 0 if top_k == -1 or temperature < SAMPLING_EPS else top_k


@dataclass(frozen=True)
class SeqSpec:
    """One completion to generate: a prompt, its settings and its id."""

    rid: str  # this completion's request id: meta_info.id, what /abort_request matches
    input_ids: tuple[int, ...]
    params: SamplingParams
    return_logprob: bool
    lora_id: str | None = None  # the adapter load it samples with (None: the base model)
    # Where its prompt logprobs start (`input_token_logprobs` covers input_ids[start:]);
    # None: the answer carries none (no return_logprob).
    input_start: int | None = None

    @property
    def out_id(self) -> str:
        return self.rid


@dataclass
class ParsedGenerate:
    """A validated /generate request: the completions in output order, and the reply shape.

    `held`: the request ids in flight for the whole request (one per
    completion of an n == 1 request); `claimed`: those of n > 1 requests
    (`{rid}_{i}`), which SGLang registers only while it admits the request.
    Both must not already be in flight.
    """

    seqs: list[SeqSpec]
    as_list: bool
    held: list[str] = field(default_factory=list)
    claimed: list[str] = field(default_factory=list)
    lora_names: list[str | None] = field(default_factory=list)  # each seq's `lora_path`


def _as_batch(value: Any, name: str, batch: int) -> list[Any]:
    if isinstance(value, list):
        if len(value) != batch:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {batch}")
        return value
    return [value] * batch


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompts(
    body: dict[str, Any], encode: Callable[[str], list[int]]
) -> tuple[list[list[int]], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("exactly one of text or input_ids must be given")
    if text is not None:
        if isinstance(text, str):
            return [encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [encode(t) for t in text], True
        raise RequestError("text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and _is_id_list(ids):
        return [list(ids)], False
    if isinstance(ids, list) and ids and all(_is_id_list(x) for x in ids):
        return [list(x) for x in ids], True
    raise RequestError("input_ids must be a list of integers or a non-empty list of such lists")


def parse_generate(
    body: Any,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    context_len: int,
    default_max_new_tokens: int = 128,
    caps: Capabilities | None = None,
) -> ParsedGenerate:
    """Validate a /generate body into the completions to run; RequestError if invalid."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by the CPU engine")
    prompts, is_batch = _prompts(body, encode)
    batch = len(prompts)
    params_raw = body.get("sampling_params")
    params_list = (
        _as_batch(params_raw, "sampling_params", batch)
        if isinstance(params_raw, list)
        else [params_raw] * batch
    )
    rid = body.get("rid")
    rids = _as_batch(rid, "rid", batch) if isinstance(rid, list) else [rid] * batch
    if rid is not None and not isinstance(rid, list) and is_batch:
        raise RequestError("a batch needs one rid per prompt")
    return_logprob = body.get("return_logprob", False)
    if not isinstance(return_logprob, bool):
        raise RequestError("return_logprob must be a boolean")
    parsed = ParsedGenerate(seqs=[], as_list=False)
    params_of = [parse_sampling_params(raw, default_max_new_tokens) for raw in params_list]
    if len({p.n for p in params_of}) > 1:
        raise RequestError(
            "The parallel_sample_num should be the same for all samples in sample params."
        )
    if sum(p.n for p in params_of) > MAX_N:
        raise RequestError(f"a request may ask for at most {MAX_N} completions in all")
    loras = _lora_names(body.get("lora_path"), batch)
    starts = _start_lens(body.get("logprob_start_len"), batch)
    release = caps or Capabilities((0, 5, 23))
    for prompt, params, r, lora, k in zip(prompts, params_of, rids, loras, starts, strict=True):
        _check_prompt(prompt, params, vocab_size, context_len)
        if r is not None and not isinstance(r, str):
            raise RequestError("rid must be a string or a list of strings")
        start = (
            input_start(k, len(prompt), params.max_new_tokens, release) if return_logprob else None
        )
        _expand(parsed, prompt, params, r, isinstance(rid, list), return_logprob, start)
        parsed.lora_names += [lora] * (len(parsed.seqs) - len(parsed.lora_names))
    parsed.as_list = is_batch or len(parsed.seqs) > len(prompts)
    return parsed


def _lora_names(value: Any, batch: int) -> list[str | None]:
    """`lora_path`: an adapter's name for every prompt, or one per prompt (None or ""
    for the base model)."""
    if value is None or isinstance(value, str):
        return [value or None] * batch
    if isinstance(value, list) and all(v is None or isinstance(v, str) for v in value):
        return [v or None for v in _as_batch(value, "lora_path", batch)]
    raise RequestError("lora_path must be a string or a list of strings", schema=True)


def _start_lens(value: Any, batch: int) -> list[int]:
    """`logprob_start_len`: one int for every prompt, or one per prompt (None: -1)."""
    if value is None:
        return [-1] * batch
    values = (
        _as_batch(value, "logprob_start_len", batch) if isinstance(value, list) else [value] * batch
    )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise RequestError("logprob_start_len must be an integer or a list of integers")
    return values


def input_start(k: int, prompt_len: int, max_new_tokens: int, caps: Capabilities) -> int:
    """Where a request's `input_token_logprobs` start, as that release's scheduler
    resolves `logprob_start_len` k; RequestError with its message where it refuses k."""
    prefill_only = max_new_tokens == 0
    if k == -1:
        return caps.default_input_start(prompt_len, prefill_only)
    if k < 0:  # SGLang leaves other negatives to fail deep in the scheduler; refused here
        raise RequestError(f"logprob_start_len must be -1 or at least 0, got {k}")
    if caps.refuses_input_start(k, prompt_len, prefill_only):
        raise RequestError(
            f"req.logprob_start_len={k} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={prompt_len}. Please use a smaller logprob_start_len."
        )
    return k


def _check_prompt(prompt: list[int], params: SamplingParams, vocab: int, context: int) -> None:
    if not prompt:
        raise RequestError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    if len(prompt) + params.max_new_tokens > context:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of "
            f"{context} tokens: {len(prompt)} prompt + {params.max_new_tokens} new"
        )


def _expand(
    parsed: ParsedGenerate,
    prompt: list[int],
    params: SamplingParams,
    rid: str | None,
    rid_from_list: bool,
    return_logprob: bool,
    start: int | None = None,
) -> None:
    """One prompt's completions, with SGLang's ids (see the module docstring)."""
    if params.n == 1:
        rid = rid if rid is not None else uuid.uuid4().hex
        parsed.held.append(rid)
        parsed.seqs.append(SeqSpec(rid, tuple(prompt), params, return_logprob, input_start=start))
        return
    if rid is not None:  # io_struct._normalize_rid: a str becomes rid_0 .. rid_{n-1}
        parsed.claimed.extend([rid] if rid_from_list else [f"{rid}_{j}" for j in range(params.n)])
    for j in range(params.n):
        # Sample j of n draws from seed + j: n copies of one seed would be n
        # identical completions, useless for group-relative advantages.
        seeded = params
        if params.sampling_seed is not None and j:
            seeded = replace(params, sampling_seed=params.sampling_seed + j)
        parsed.seqs.append(
            SeqSpec(uuid.uuid4().hex, tuple(prompt), seeded, return_logprob, input_start=start)
        )


@dataclass
class Completion:
    """What the scheduler hands back for one sequence."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict[str, Any]
    weight_version: str  # the version serving at completion (the last span's)
    e2e_latency: float
    matched_stop_str: str | None = None
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (version, start, end)
    retractions: int = 0
    # log p(input_ids[i] | input_ids[:i]) for i in input_start + 1 .. len - 1 (None: not asked)
    input_logprobs: list[float] | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (meta_info.cached_tokens)


def trim_text(text: str, params: SamplingParams, matched: str | None) -> str:
    """Cut the text at a matched stop string unless no_stop_trim is set."""
    if matched is None or params.no_stop_trim:
        return text
    cut = text.find(matched)
    return text if cut < 0 else text[:cut]


def version_spans(
    events: list[tuple[str, int]], current: str, n_tokens: int
) -> list[tuple[str, int, int]]:
    """SGLang's `compute_weight_version_spans` (utils/weight_versions.py).

    `events`: (old version, output tokens at the change) for each weight
    change while the sequence lived; tokens before it came from the old one.
    """
    spans: list[list[Any]] = []
    for version, end in [*events, (current, n_tokens)]:
        end = min(end, n_tokens)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    # add_weight_versions_to_meta_info: spans past the output are dropped
    return [(v, a, b) for v, a, b in spans if a < n_tokens or a == 0]


def response(
    spec: SeqSpec,
    done: Completion,
    text: str,
    *,
    reported_version: str,
    caps: Capabilities,
) -> dict[str, Any]:
    """One completion as SGLang's /generate returns it.

    `meta_info.weight_version` is the server's configured version
    (`reported_version`) before 0.5.19, and the last span's from then on,
    which is also when `weight_versions` appears (`spans`).
    """
    meta: dict[str, Any] = {
        "id": spec.out_id,
        "finish_reason": done.finish_reason,
        "prompt_tokens": len(spec.input_ids),
        "weight_version": reported_version,
    }
    if caps.at_least(0, 5, 12):
        meta["num_retractions"] = done.retractions
    meta["completion_tokens"] = len(done.output_ids)
    meta["cached_tokens"] = done.cached_tokens
    if caps.at_least(0, 5, 10):
        meta["reasoning_tokens"] = 0
    if caps.reports_version_spans and done.spans:
        meta["weight_versions"] = [{"version": v, "start": a, "end": b} for v, a, b in done.spans]
        meta["weight_version"] = done.spans[-1][0]
    meta["e2e_latency"] = done.e2e_latency
    if spec.return_logprob:
        meta["input_token_logprobs"] = input_token_logprobs(spec, done)
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(done.logprobs, done.output_ids, strict=True)
        ]
        if caps.reports_logprobs_length:
            meta["output_token_logprobs_length"] = len(done.output_ids)
    return {"text": text, "output_ids": list(done.output_ids), "meta_info": meta}


def input_token_logprobs(spec: SeqSpec, done: Completion) -> list[list[Any]]:
    """SGLang's `input_token_logprobs`: [logprob, token, null] for input_ids[start:], the
    first logprob null. [] when nothing was asked or the request ended before its prefill
    (aborted while waiting: SGLang had computed none either)."""
    start = spec.input_start
    if start is None or start >= len(spec.input_ids) or done.input_logprobs is None:
        return []
    tokens = spec.input_ids[start:]
    values: list[float | None] = [None, *done.input_logprobs]
    return [[lp, tok, None] for lp, tok in zip(values, tokens, strict=True)]
