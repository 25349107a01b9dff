"""What each SGLang release's HTTP API does, as read from its source (pure, no I/O).

Flywheel drives engines only through SGLang's native HTTP API, and that API
moved between the releases a deployment may run. This table was written
from the `sglang` wheels on PyPI, 0.5.4 (the image the GPU overlay pinned)
through 0.5.23 (the newest 0.5.x when written), reading
`srt/entrypoints/http_server.py`, `srt/managers/io_struct.py`,
`srt/managers/tokenizer_manager.py`, `srt/managers/scheduler*.py`,
`srt/utils/auth.py` and, for LoRA, `srt/lora/lora_registry.py` and
`lora_manager.py` of each:

| since  | what changed (file)                                                        |
|--------|----------------------------------------------------------------------------|
| 0.5.4  | `/get_model_info`, `/get_server_info`, `/get_load` (list of per-rank dicts);|
|        | `/pause_generation` takes no body and always aborts (tokenizer_manager)    |
|        | LoRA: `/load_lora_adapter`, `/unload_lora_adapter`, `/generate` lora_path  |
|        | (an adapter's name; ignored without --enable-lora)                         |
|        | `/release_memory_occupation`, `/resume_memory_occupation` (GET or POST,    |
|        | `{"tags": [...] or null}`, 200 `null`): tags default weights + kv_cache;   |
|        | release checks nothing; resuming a tag not released: KeyError, the        |
|        | scheduler dies (scheduler_update_weights_mixin.py)                         |
| 0.5.5  | memory tags default to kv_cache, weights, cuda_graph (constants.py);       |
|        | a release asserts "no ongoing request" (running and waiting empty),       |
|        | else the scheduler dies                                                    |
| 0.5.5  | `/v1/models` lists the loaded adapters (id = name, root = path)            |
|        | `logprob_start_len` k (prompt logprobs, `input_token_logprobs`): k = len(input) |
|        | is refused for a request that generates; k = -1 with return_logprob starts |
|        | at len - 1 (one null entry), at len for max_new_tokens = 0 (scheduler.py) |
| 0.5.6  | `/model_info`, `/server_info`; pause modes abort/retract/in_place          |
|        | a release's `_is_no_request` looks at the running batch only               |
|        | (io_struct PauseGenerationReqInput); `flush_cache` on update requests;     |
|        | `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false` makes `/health` cheap;    |
|        | a `/generate` naming an adapter unloaded earlier loads it again from its   |
|        | path (`lora_ref_cache`); a never-loaded name: "Got LoRA adapter that has   |
|        | never been loaded" (before: "... are not loaded", lora_registry.acquire);  |
|        | the LoRA registry is an OrderedDict (messages print `odict_keys`, before   |
|        | `dict_keys`)                                                               |
| 0.5.7  | `logprob_start_len` = len(input) accepted (only k > len is refused)        |
| 0.5.8  | `/v1/loads` (entrypoints/v1_loads.py)                                      |
| 0.5.9  | k = -1 with return_logprob starts at len - 1 for max_new_tokens = 0 too    |
| 0.5.10 | a request id already in flight is refused (400 "Duplicate request ...");  |
|        | `/v1/chat/completions` defaults: only what generation_config.json sets     |
|        | (0.5.4-0.5.9 pin transformers 4.57.1, whose GenerationConfig fills the     |
|        | rest: temperature 1.0, top_k 50, top_p 1.0, repetition_penalty 1.0)       |
|        | k = -1 with return_logprob starts at len: no input logprobs ([]);           |
|        | `meta_info.output_token_logprobs_length` (tokenizer_manager)               |
|        | `/flush_cache?timeout=s` waits up to s for an idle scheduler (is_fully_idle |
|        | with the waiting queue, paused or not); a refusal answers its message      |
|        | ("Flush cache failed.", "Timed out waiting for idle state.", "Another      |
|        | flush_cache is already in progress."), before the success text with 400    |
|        | a lora_path without --enable-lora is refused (400), no longer ignored      |
|        | a release asserts `is_fully_idle()` (running and waiting): "... only when  |
|        | server is idle." (scheduler_update_weights_mixin.py)                       |
| 0.5.12 | `meta_info.num_retractions` (0.5.10: `reasoning_tokens`)                   |
| 0.5.19 | `meta_info.weight_versions`: per-token version spans (utils/weight_versions)|
| 0.5.20 | `/ready` (503 while paused)                                                |
| 0.5.21 | `/get_load` removed                                                        |
| 0.5.22 | `/generate` bodies checked against a schema: `{"error": "<text>"}` (400);  |
|        | a cache flush after a weight update that finds requests still queued or    |
|        | running fails the update (400); before, the scheduler asserted and died.   |
|        | A paused scheduler's flush ignores its waiting queue (retracted requests)  |
|        | and so does a paused release (weight_updater.py, is_fully_idle)            |
| 0.5.23 | `/ping` reports health (503 after a failed health check), not always 200   |

Unchanged over the whole range: `/generate` (`GenerateReqInput`), the
`output_token_logprobs` and `input_token_logprobs` triples (the first input
entry's logprob null), `max_new_tokens = 0` (prefill only, finish "length"),
finish reasons, per-sample random ids with `n > 1`, `top_k` -1 or >= 1
(`SamplingParams.verify`), `/health` and `/health_generate` generating one
token (at least 1 s; no answer while generation is paused),
`/update_weights_from_disk` with `weight_version`, OpenAI routes: a request
without `model` answers `"model": "default"` (protocol.py DEFAULT_MODEL_NAME;
else the request's, echoed), `/v1/chat/completions` takes temperature,
top_p, top_k, min_p, repetition_penalty the request leaves out from the
model's generation_config.json (`--sampling-defaults model`, the default:
ModelConfig.get_default_sampling_params, ChatCompletionRequest.
to_sampling_params), `/v1/completions` and `/generate` never do,
an update asked for while
generation runs holding `model_update_lock`'s writer lock until the
scheduler has answered, flush included (new requests wait on the reader lock
in the tokenizer manager; 0.5.6+ take no writer lock when paused), and the
API key on every path but `/health*`, `/metrics*` (and `/ready*`).

Supported: 0.5.4 <= version < 0.6. Releases above 0.5.23 are accepted (the
API held still across twenty 0.5.x releases) with a warning; anything
older, or another minor series, is refused with an error naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from services.runtime.errors import FlywheelError

Release = tuple[int, int, int]

MIN_SUPPORTED: Release = (0, 5, 4)
"""Oldest release whose API Flywheel speaks (the GPU overlay's former pin)."""
NEWEST_READ: Release = (0, 5, 23)
"""Newest release whose source this table was written from."""
SUPPORTED_RANGE = ">=0.5.4,<0.6"
"""The same bound as a pip specifier (pyproject's `sglang` extra)."""

UPDATE_MODES = ("wait", "abort", "retract", "in_place")

FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still "
    "running or queued. Retract or finish them, then call /flush_cache."
)
"""0.5.22+: `WeightUpdater.flush_cache_after_weight_update`'s message (HTTP 400)."""
FLUSH_FAILED = "Flush cache failed.\n"
"""0.5.10+: `/flush_cache`'s answer to a refused flush without a message."""
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
"""0.5.10+: a `/flush_cache?timeout=s` that found no idle moment in s seconds."""
FLUSH_IN_PROGRESS = "Another flush_cache is already in progress."
"""0.5.10+: a `/flush_cache` while a waiting one is pending."""
FLUSH_ASSERT = "Cache flush failed after updating weights"
"""0.5.4-0.5.21: the scheduler's assertion message; the scheduler process dies."""
RELEASE_ASSERT_OLD = "release_memory_occupation should be called only when no ongoing request."
"""0.5.5-0.5.9: `release_memory_occupation`'s assertion (the scheduler dies)."""
RELEASE_ASSERT = "release_memory_occupation should be called only when server is idle."
"""0.5.10+: the same assertion, reworded."""
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""`GPU_MEMORY_ALL_TYPES` (constants.py, 0.5.5+): what an empty or null `tags` means."""


class UnsupportedEngine(FlywheelError, RuntimeError):
    """The engine runs an SGLang release (or feature) Flywheel does not support."""


def parse_release(text: str) -> Release:
    """`"0.5.4.post3"` -> (0, 5, 4); UnsupportedEngine if it is not `MAJOR.MINOR.PATCH...`."""
    m = re.match(r"^v?(\d+)\.(\d+)\.(\d+)", str(text).strip())
    if m is None:
        raise UnsupportedEngine(f"engine reports SGLang version {text!r}, which is not X.Y.Z")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def fmt_release(v: Release) -> str:
    return ".".join(map(str, v))


@dataclass(frozen=True)
class Capabilities:
    """How one SGLang release's HTTP API behaves (see the module table)."""

    version: Release

    @classmethod
    def of(cls, text: str) -> Capabilities:
        """The capabilities of a release; UnsupportedEngine (naming it) if outside the range."""
        v = parse_release(text)
        if v < MIN_SUPPORTED or v[:2] != MIN_SUPPORTED[:2]:
            raise UnsupportedEngine(
                f"engine runs SGLang {text}; Flywheel supports SGLang {SUPPORTED_RANGE} "
                f"(read against {fmt_release(MIN_SUPPORTED)}..{fmt_release(NEWEST_READ)})"
            )
        return cls(v)

    def at_least(self, *v: int) -> bool:
        return self.version >= v

    @property
    def beyond_read(self) -> bool:
        """Newer than every release this table was written from (accepted, with a warning)."""
        return self.version > NEWEST_READ

    @property
    def model_info_path(self) -> str:
        return "/model_info" if self.at_least(0, 5, 6) else "/get_model_info"

    @property
    def server_info_path(self) -> str:
        return "/server_info" if self.at_least(0, 5, 6) else "/get_server_info"

    @property
    def loads_path(self) -> str:
        return "/v1/loads" if self.at_least(0, 5, 8) else "/get_load"

    @property
    def pause_modes(self) -> tuple[str, ...]:
        """Modes `/pause_generation` honours; before 0.5.6 it takes no body and aborts."""
        return ("abort", "retract", "in_place") if self.at_least(0, 5, 6) else ("abort",)

    @property
    def has_flush_cache_field(self) -> bool:
        """`UpdateWeightFromDiskReqInput.flush_cache` exists (before: always flushed)."""
        return self.at_least(0, 5, 6)

    @property
    def flush_cache_waits(self) -> bool:
        """`/flush_cache` takes `timeout` (seconds to wait for idle) and a refusal answers
        its message; before 0.5.10 the route reads nothing and a refusal answers the
        success text with status 400."""
        return self.at_least(0, 5, 10)

    @property
    def flush_refusal_is_400(self) -> bool:
        """A failed post-update flush answers 400; before 0.5.22 it killed the scheduler."""
        return self.at_least(0, 5, 22)

    @property
    def paused_flush_ignores_waiting(self) -> bool:
        """While paused, a flush only needs the running batch empty (retracted = waiting)."""
        return self.at_least(0, 5, 22)

    @property
    def rejects_duplicate_rid(self) -> bool:
        return self.at_least(0, 5, 10)

    def duplicate_rid_message(self, rid: str) -> str:
        if self.at_least(0, 5, 16):
            return f"Duplicate request ID detected: {rid}"
        return f"Duplicate request IDs detected: {[rid]}"

    @property
    def schema_errors_are_text(self) -> bool:
        """A body breaking the JSON schema is `{"error": "<text>"}` (api_contract.py)."""
        return self.at_least(0, 5, 22)

    @property
    def reports_version_spans(self) -> bool:
        return self.at_least(0, 5, 19)

    @property
    def has_ready(self) -> bool:
        return self.at_least(0, 5, 20)

    @property
    def has_get_load(self) -> bool:
        return not self.at_least(0, 5, 21)

    @property
    def has_cheap_health_switch(self) -> bool:
        """`SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false` answers /health at once."""
        return self.at_least(0, 5, 6)

    @property
    def lists_lora_models(self) -> bool:
        """`/v1/models` lists each loaded adapter after the base model."""
        return self.at_least(0, 5, 5)

    @property
    def lora_reloads_unloaded(self) -> bool:
        """A `/generate` naming an adapter that was loaded once and since unloaded loads it
        again from its path (`_resolve_lora_path`); an unknown name is "never been loaded"."""
        return self.at_least(0, 5, 6)

    @property
    def lora_registry_keys(self) -> str:
        """How the LoRA registry's messages print its names: an OrderedDict's keys from
        0.5.6 (LRU order), a dict's before."""
        return "odict_keys" if self.at_least(0, 5, 6) else "dict_keys"

    @property
    def lora_refused_when_disabled(self) -> bool:
        """A `lora_path` on an engine without --enable-lora is a 400; before, ignored."""
        return self.at_least(0, 5, 10)

    def default_input_start(self, prompt_len: int, prefill_only: bool) -> int:
        """Where `input_token_logprobs` start for `logprob_start_len` -1 with return_logprob
        (`Scheduler.handle_generate_request`): nothing asked (len) or the last prompt token."""
        if self.at_least(0, 5, 10):
            return prompt_len
        if self.at_least(0, 5, 9) or not prefill_only:
            return prompt_len - 1
        return prompt_len

    def refuses_input_start(self, k: int, prompt_len: int, prefill_only: bool) -> bool:
        """The scheduler aborts the request with "... is higher than the number of input
        tokens ..." (HTTP 400). Before 0.5.7 also k == len for a request that generates.
        (0.5.4-0.5.6 let a prefill-only k > len through to fail later; refused here.)"""
        if k > prompt_len:
            return True
        return k == prompt_len and not prefill_only and not self.at_least(0, 5, 7)

    @property
    def reports_logprobs_length(self) -> bool:
        """`meta_info.output_token_logprobs_length` beside the logprobs (0.5.10+)."""
        return self.at_least(0, 5, 10)

    @property
    def generation_config_fills_hf_defaults(self) -> bool:
        """The chat defaults read from generation_config.json include transformers'
        own GenerationConfig defaults for what the file leaves out (temperature 1.0,
        top_k 50, top_p 1.0, repetition_penalty 1.0): 0.5.4-0.5.9 pin transformers
        4.57.1, whose `to_dict()` carries them; 0.5.10+ pin transformers 5, whose
        defaults are None, so only the file's own values apply. (No file: none.)"""
        return not self.at_least(0, 5, 10)

    @property
    def ping_reports_health(self) -> bool:
        return self.at_least(0, 5, 23)

    @property
    def default_memory_tags(self) -> tuple[str, ...]:
        """What `/release_memory_occupation` (or resume) with no `tags` acts on."""
        return MEMORY_TAGS if self.at_least(0, 5, 5) else ("weights", "kv_cache")

    def release_refused(self, running: int, waiting: int, paused: bool) -> str | None:
        """The assertion SGLang's scheduler dies with when `/release_memory_occupation`
        comes with `running` requests in its batch and `waiting` in its queue (held ones
        are not in it), or None when it releases. 0.5.4 checks nothing; 0.5.5 and
        0.5.10-0.5.21 need both empty; 0.5.6-0.5.9 only the running batch; 0.5.22+
        the running batch, and the queue too unless paused (retracted requests wait)."""
        if not self.at_least(0, 5, 5):
            return None
        message = RELEASE_ASSERT if self.at_least(0, 5, 10) else RELEASE_ASSERT_OLD
        if self.at_least(0, 5, 22):
            waiting_counts = not paused
        else:
            waiting_counts = not (self.at_least(0, 5, 6) and not self.at_least(0, 5, 10))
        busy = running > 0 or (waiting_counts and waiting > 0)
        return message if busy else None

    def check_update_mode(self, mode: str) -> None:
        """UnsupportedEngine if this release cannot update weights in `mode`."""
        if mode in ("wait", "abort") or mode in self.pause_modes:
            return
        raise UnsupportedEngine(
            f"SGLang {fmt_release(self.version)} cannot pause in {mode!r} mode (its "
            f"/pause_generation always aborts; modes arrived in 0.5.6): set [sync] "
            f"update_mode to 'abort' or 'wait', or run SGLang >= 0.5.6"
        )

    def flush_cache_for(self, mode: str) -> bool | None:
        """The `flush_cache` an update in `mode` must send (None: the field does not exist).

        A flush drops the prefix cache computed with the old weights, so it is
        wanted whenever the release can do it without failing: nothing is held
        in `wait` and `abort`; `retract` holds requests in the waiting queue,
        which a paused flush ignores only from 0.5.22 (before, the flush
        failed and the scheduler died); `in_place` keeps running requests,
        which no flush accepts (400 from 0.5.22, a dead scheduler before).
        """
        self.check_update_mode(mode)
        if not self.has_flush_cache_field:
            return None
        if mode == "in_place":
            return False
        if mode == "retract":
            return self.paused_flush_ignores_waiting
        return True
