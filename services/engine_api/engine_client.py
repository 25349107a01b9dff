"""One async HTTP client for every engine (SGLang on GPU, Flywheel's CPU engine).

The rollout worker (generate) and sync (pause, update weights, continue)
both use it. It speaks SGLang's native API only: one code drives either.

Versions: the first call that needs to know asks the server which SGLang
release it runs (`/server_info`, or `/get_server_info` before 0.5.6) and
keeps its `Capabilities` (services/engine_api/sglang_api.py): which routes
exist (`/model_info` or `/get_model_info`, `/v1/loads` or `/get_load`), which
pause modes, whether an update takes `flush_cache`. A release outside the
supported range is refused with `UnsupportedEngine` naming it. The CPU
engine answers as the release it emulates.

Weight versions are ints here, as everywhere in Flywheel: the client writes
and reads SGLang's free-text `weight_version` through proto/weight_version.py.

Failure policy:
- connection errors (refused, reset, DNS) are retried with exponential
  backoff (`retries` times, base `backoff_s`, capped at `max_backoff_s`),
  because an engine that is restarting or not yet listening is the common
  transient case; after the last try, `EngineUnavailable`;
- a timeout is *not* retried: a generate may already be running on the
  server, and blindly re-sending doubles the work — the caller decides
  (`EngineTimeout`, an `EngineUnavailable`);
- any 4xx/5xx is `EngineHTTPError(status, message)` with the server's own
  message (`{"error": {"message": …}}`, `{"error": "…"}` (401, schema
  errors), the `message` of an update reply or the `error_message` of a LoRA
  adapter reply). A 400 from `/generate` is the engine refusing the request
  itself: re-sending it cannot help.

LoRA (SGLang started with `--enable-lora`): `load_lora_adapter` and
`unload_lora_adapter` manage named adapters (PEFT directories on the
engine's disk), and `generate(..., lora_path=name)` samples with one. A
refused load or unload (a name already loaded, an unknown name, a rank over
`--max-lora-rank`, LoRA not enabled) is `EngineHTTPError(400, SGLang's
error_message)`.

aiohttp is imported inside functions so importing it stays light.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proto.weight_version import VersionSpan, from_engine, spans_from_engine, to_engine
from services.engine_api.sglang_api import Capabilities, UnsupportedEngine
from services.runtime.errors import FlywheelError

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)


class EngineError(FlywheelError, RuntimeError):
    """Base of engine client errors; `url` names the engine."""

    def __init__(self, message: str, url: str = "") -> None:
        super().__init__(message)
        self.url = url


class EngineUnavailable(EngineError, ConnectionError):
    """The engine could not be reached (after retries), or did not answer in time."""


class EngineTimeout(EngineUnavailable, TimeoutError):
    """The engine did not answer within the request timeout (not retried)."""


class EngineHTTPError(EngineError):
    """The engine answered with an error status."""

    def __init__(self, status: int, message: str, url: str = "") -> None:
        super().__init__(f"engine {url} answered {status}: {message}", url)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class GenerateResult:
    """One completion: token ids with their logprobs, how it ended, and which weights made it."""

    rid: str  # the engine's id of this completion (its own random one per sample if n > 1)
    text: str
    output_ids: list[int]
    logprobs: list[float]  # one per output id; empty when logprobs were not requested
    finish_type: str  # "stop" | "length" | "abort"
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    weight_version: int  # the version at completion (the last span's)
    e2e_latency: float
    weight_versions: tuple[VersionSpan, ...] = ()  # per-token (SGLang >= 0.5.19); () if not

    @property
    def aborted(self) -> bool:
        return self.finish_type == "abort"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> GenerateResult:
        meta = d.get("meta_info", {})
        reason = meta.get("finish_reason") or {}
        logprobs_raw = meta.get("output_token_logprobs") or []
        output_ids = list(d.get("output_ids") or [t for _, t, _ in logprobs_raw])
        return cls(
            rid=str(meta.get("id", "")),
            text=str(d.get("text", "")),
            output_ids=[int(t) for t in output_ids],
            logprobs=[float(lp) for lp, _, _ in logprobs_raw],
            finish_type=str(reason.get("type", "")),
            finish_reason=dict(reason),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            weight_version=from_engine(meta.get("weight_version")),
            e2e_latency=float(meta.get("e2e_latency") or 0.0),
            weight_versions=spans_from_engine(meta.get("weight_versions")),
        )


@dataclass(frozen=True)
class UpdateResult:
    success: bool
    message: str
    num_paused_requests: int  # summed over data-parallel ranks (SGLang sends a list then)


@dataclass(frozen=True)
class Load:
    """Requests decoding and waiting, summed over data-parallel ranks."""

    running: int
    queued: int


def paused_count(value: Any) -> int:
    """`num_paused_requests`: an int, or one per data-parallel rank (dp_size > 1)."""
    if isinstance(value, list):
        return sum(int(v or 0) for v in value)
    return int(value or 0)


def load_of(doc: Any) -> Load:
    """`/v1/loads` (`{"loads": [per rank]}`) or `/get_load` (a list of per-rank dicts
    with `num_reqs` = running + waiting), summed over ranks."""
    if isinstance(doc, list):
        queued = sum(int(r.get("num_waiting_reqs", 0)) for r in doc)
        return Load(sum(int(r.get("num_reqs", 0)) for r in doc) - queued, queued)
    rows = doc.get("loads") or [] if isinstance(doc, dict) else []
    running = sum(int(r.get("num_running_reqs", 0)) for r in rows)
    return Load(running, sum(int(r.get("num_waiting_reqs", 0)) for r in rows))


def _error_message(status: int, body: str) -> str:
    try:
        doc = json.loads(body)
    except json.JSONDecodeError:
        return body.strip() or f"HTTP {status}"
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        if "message" in doc:
            return str(doc["message"])
        if doc.get("error_message"):  # LoRAUpdateOutput (load/unload_lora_adapter)
            return str(doc["error_message"])
    return body.strip()


class EngineClient:
    """Async client of one engine at `url`. Use as `async with EngineClient(url) as c:`."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retries: int = 5,
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        api_key: str | None = None,
        capabilities: Capabilities | None = None,
    ) -> None:
        """`capabilities`: the release, if already detected (then not asked again)."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None
        self._caps = capabilities

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # No connection cap: a rollout worker keeps many generations in flight.
            self._session = aiohttp.ClientSession(
                headers=headers, connector=aiohttp.TCPConnector(limit=0)
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
    ) -> Any:
        """Send one request; JSON (or text, or None) on 2xx; typed errors otherwise."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.timeout_s, sock_connect=self.connect_timeout_s
        )
        url = f"{self.url}{path}"
        delay = self.backoff_s
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                async with self._get_session().request(
                    method, url, json=body, timeout=timeout
                ) as resp:
                    text = await resp.text()
                    if resp.status >= 400:
                        raise EngineHTTPError(resp.status, _error_message(resp.status, text), url)
                    if not text:
                        return None
                    if resp.content_type == "application/json":
                        return json.loads(text)
                    return text
            except (aiohttp.ClientConnectionError, ConnectionError) as e:
                if isinstance(e, aiohttp.ServerTimeoutError):
                    raise EngineTimeout(f"{method} {url} timed out", url) from e
                if attempt == retries:
                    raise EngineUnavailable(
                        f"{method} {url} failed after {attempt + 1} attempts: {e!r}", url
                    ) from e
                log.debug("engine %s unreachable (%r); retry in %.2fs", url, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            except TimeoutError as e:
                raise EngineTimeout(f"{method} {url} timed out", url) from e
        raise AssertionError("unreachable")

    # ---- versions ------------------------------------------------------------------

    async def detect(self) -> Capabilities:
        """Ask the server its SGLang release; UnsupportedEngine if outside the range.

        `/server_info` (0.5.6+), else `/get_server_info` (0.5.4-0.5.5). An
        EngineHTTPError (401: a wrong API key) or EngineUnavailable passes through.
        """
        try:
            info = await self.request("GET", "/server_info")
        except EngineHTTPError as e:
            if e.status != 404:
                raise
            info = await self.request("GET", "/get_server_info")
        version = info.get("version") if isinstance(info, dict) else None
        if not isinstance(version, str):
            raise UnsupportedEngine(f"engine {self.url} reports no SGLang version: {info!r}")
        caps = Capabilities.of(version)
        if caps.beyond_read:
            why = "newer than any release Flywheel was checked against; proceeding"
            log.warning("engine %s runs SGLang %s, %s", self.url, version, why)
        self._caps = caps
        return caps

    async def capabilities(self) -> Capabilities:
        """The server's release (detected once)."""
        return self._caps or await self.detect()

    # ---- the API ---------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int] | None = None,
        *,
        text: str | None = None,
        sampling_params: dict[str, Any] | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        timeout_s: float | None = None,
        lora_path: str | None = None,
    ) -> list[GenerateResult]:
        """Generate from one prompt; one result per sample (`sampling_params["n"]`).

        `rid` must not be in flight on this engine (SGLang >= 0.5.10 answers 400).
        `lora_path`: the *name* of a loaded LoRA adapter to sample with (SGLang's
        field name; None: the base model).
        """
        body: dict[str, Any] = {
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        out = await self.request("POST", "/generate", body, timeout_s=timeout_s)
        items = out if isinstance(out, list) else [out]
        return [GenerateResult.from_json(d) for d in items]

    async def prompt_logprobs(
        self,
        input_ids: list[int],
        start: int,
        *,
        rid: str | None = None,
        timeout_s: float | None = None,
        lora_path: str | None = None,
    ) -> list[float]:
        """log p(input_ids[i] | input_ids[:i]) for i in start + 1 .. len - 1: how a teacher
        scores a sequence. SGLang's prefill-only request (`max_new_tokens` 0,
        `logprob_start_len` = start) answers `input_token_logprobs` for input_ids[start:],
        whose first logprob is null, so the logprobs of a response after a P-token prompt
        are asked with start = P - 1. EngineError if the answer does not line up."""
        if not 0 <= start < len(input_ids):
            raise ValueError(f"start {start} must index the {len(input_ids)} input ids")
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        if rid is not None:
            body["rid"] = rid
        if lora_path is not None:
            body["lora_path"] = lora_path
        out = await self.request("POST", "/generate", body, timeout_s=timeout_s)
        meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
        reason = meta.get("finish_reason") or {}
        if reason.get("type") == "abort":
            raise EngineError(f"prompt logprobs aborted: {reason.get('message')}", self.url)
        triples = meta.get("input_token_logprobs")
        want = input_ids[start:]
        if not isinstance(triples, list) or [t[1] for t in triples] != want:
            raise EngineError(
                f"input_token_logprobs does not cover input_ids[{start}:] "
                f"({len(want)} tokens): {str(triples)[:200]}",
                self.url,
            )
        return [float(t[0]) for t in triples[1:]]

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: int | None = None,
        *,
        update_mode: str = "wait",
        flush_cache: bool | None = None,
        timeout_s: float | None = None,
    ) -> UpdateResult:
        """Load new weights; EngineHTTPError(400) if the engine refuses them.

        `update_mode` is how generation was held for the update (sync's
        `[sync] update_mode`): it decides `abort_all_requests` and the
        `flush_cache` this release needs (`Capabilities.flush_cache_for`);
        `flush_cache` overrides the latter.
        """
        caps = await self.capabilities()
        flush = caps.flush_cache_for(update_mode) if flush_cache is None else flush_cache
        body: dict[str, Any] = {
            "model_path": model_path,
            "abort_all_requests": update_mode == "abort",
        }
        if flush is not None and caps.has_flush_cache_field:
            body["flush_cache"] = flush
        if weight_version is not None:
            body["weight_version"] = to_engine(weight_version)
        out = await self.request("POST", "/update_weights_from_disk", body, timeout_s=timeout_s)
        return UpdateResult(
            bool(out["success"]), str(out["message"]), paused_count(out.get("num_paused_requests"))
        )

    async def load_lora_adapter(
        self, name: str, path: str, *, pinned: bool = False, timeout_s: float | None = None
    ) -> None:
        """Load the PEFT adapter directory `path` (on the engine's disk) as `name`.

        EngineHTTPError(400) with SGLang's message if refused: `name` already
        loaded, a rank or target module the engine was not started for, an
        unreadable directory, or LoRA not enabled.
        """
        body = {"lora_name": name, "lora_path": path, "pinned": pinned}
        await self.request("POST", "/load_lora_adapter", body, timeout_s=timeout_s)

    async def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> None:
        """Unload adapter `name`; SGLang answers once no request uses it any more.

        EngineHTTPError(400) if no adapter of that name is loaded (or LoRA is
        not enabled). From some release on (see sglang_api.py), a later
        /generate naming an unloaded adapter loads it again from its path.
        """
        await self.request("POST", "/unload_lora_adapter", {"lora_name": name}, timeout_s=timeout_s)

    async def pause_generation(self, mode: str = "abort") -> None:
        """Pause; UnsupportedEngine if the release cannot pause in `mode` (it would abort)."""
        (await self.capabilities()).check_update_mode(mode)
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        await self.request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def model_info(self) -> dict[str, Any]:
        path = (await self.capabilities()).model_info_path
        return dict(await self.request("GET", path))

    async def weight_version(self) -> int:
        return from_engine((await self.model_info())["weight_version"])

    async def server_info(self) -> dict[str, Any]:
        path = (await self.capabilities()).server_info_path
        return dict(await self.request("GET", path))

    async def health(self, *, timeout_s: float = 30.0) -> bool:
        """True if /health answers 200; False on an error status or when unreachable (no retry).

        SGLang's /health generates a token and takes at least a second
        (unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false), and up to its
        20 s SGLANG_HEALTH_CHECK_TIMEOUT: hence the long default.
        """
        try:
            await self.request("GET", "/health", timeout_s=timeout_s, retries=0)
        except EngineError:
            return False
        return True

    async def loads(self) -> Load:
        """Running and waiting requests (`/v1/loads`, or `/get_load` before 0.5.8)."""
        path = (await self.capabilities()).loads_path
        return load_of(await self.request("GET", path))

    async def flush_cache(self) -> None:
        await self.request("POST", "/flush_cache")

    # ---- colocation (services/engine/memory_api.py has SGLang's rules) ---------------

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Give up the engine's memory (`tags`: weights, kv_cache, cuda_graph; None: all).

        Only while nothing runs (pause first): SGLang's scheduler asserts it and
        dies otherwise, which reaches here as `EngineUnavailable`."""
        await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Take back what `release_memory_occupation` gave up (the same `tags`).

        Never retried: a resume that arrived but whose answer was lost would, sent
        again, resume a tag no longer released, which kills SGLang's scheduler."""
        await self.request("POST", "/resume_memory_occupation", {"tags": tags}, retries=0)

    async def num_threads(self) -> int:
        """The CPU engine's torch intra-op threads (404 `EngineHTTPError` from SGLang)."""
        return int((await self.request("GET", "/flywheel/num_threads"))["num_threads"])

    async def set_num_threads(self, k: int) -> int:
        """Let the CPU engine compute with `k` threads from its next step; the count before."""
        out = await self.request("POST", "/flywheel/num_threads", {"num_threads": k})
        return int(out["previous"])
