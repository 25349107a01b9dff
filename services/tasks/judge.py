"""An LLM judge as a reward part: `reward = { type = "judge", rubric = "...", ... }`.

A judge part asks another model, served by engines of its own behind
SGLang's OpenAI-compatible `/v1/chat/completions` (the CPU engine serves it
too), to grade one completion against a rubric, and reads a number from
its reply. It is one part of the task's weighted sum, beside verifiable
parts (exact_match, math, ...), which still run in the verifier sandbox:
the sandbox has no network, so a judge part is scored by the service
(`RewardPart.external`), through the pool the service was given (the
`[judge]` table: engine URLs, concurrency, time limit, retries, cache).

What is decided here, purely: the request a part sends for one completion
(`request`: the rubric with {prompt}, {completion}, {answer} filled in,
temperature 0 by default), what its reply is worth (`parse_reply`: a
number in [0, scale], or yes/no, normalised to [0, 1]; anything else is
*no verdict*, never 0), the cache (`ReplyCache`: bounded, in memory, keyed
by the request, which holds the rubric, prompt and completion; identical
requests in flight share one call) and how verdicts join the sandbox's
reward (`with_verdicts`). A completion the judge could not score (no
answer in time after the retries, an engine refusing, a reply with no
score) is unscored, with a dead-letter reason (`JUDGE_REASONS`): the buffer
leaves it out of the loss and the worker dead-letters it; the run goes on.

`Judge` ties them to a chat function (the rollout worker gives it its
engine pool, services/engine_api/chat_pool.py) and counts what happens
(`JudgeMetrics`, `flywheel_judge_*`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import string
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from services.runtime.errors import FlywheelError
from services.runtime.metrics import MetricSet
from services.sandbox import Reward
from services.tasks.registry import REWARDS, RewardPart

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

RUBRIC_FIELDS = frozenset({"prompt", "completion", "answer"})

# Why a judge could not score a completion: the dead-letter reasons (`dlq.<reason>`).
TIMEOUT = "judge_timeout"  # no answer within timeout_s, on every attempt
UNAVAILABLE = "judge_unavailable"  # engines unreachable or failing (5xx, 429), every attempt
REFUSED = "judge_refused"  # an engine refused the request itself (4xx): retrying cannot help
UNPARSABLE = "judge_unparsable"  # an answer, but no verdict in it (garbage, out of range)
JUDGE_REASONS = (TIMEOUT, UNAVAILABLE, REFUSED, UNPARSABLE)


# ── the run file ─────────────────────────────────────────────────────────────
@REWARDS.register
class JudgeReward(RewardPart):
    """An LLM judge's grade of the completion against a rubric, normalised to [0, 1]."""

    # Scored by the service through the judge's engines, never in the sandbox (no network).
    external: ClassVar[bool] = True
    fn: Literal["judge"]
    rubric: str = Field(
        description="The judge's instruction, a Python format string with {completion} and "
        "optionally {prompt} (the prompt as the policy saw it: text, or `role: content` "
        "lines) and {answer} (the row's reference answer, '' if none); literal braces "
        "doubled. Sent as the user message of one chat.",
    )
    system: str | None = Field(None, description="A system message before the rubric.")
    parse: Literal["score", "yes_no"] = Field(
        "score",
        description="How the reply becomes a value: 'score': the number after the last "
        "'score:', else the reply if it is only a number ('7', '7/10'), in [0, scale], "
        "divided by scale; "
        "'yes_no': the reply's first word, yes = 1, no = 0. Anything else: no verdict (the "
        "sample is unscored and dead-lettered as judge_unparsable), never 0.",
    )
    scale: float = Field(10.0, gt=0, description="'score': the highest score the rubric asks for.")
    max_tokens: int = Field(
        16, ge=1, le=4096, description="The judge's reply limit (a grade needs few tokens)."
    )
    temperature: float = Field(
        0.0, ge=0.0, description="The judge's sampling temperature (0: greedy, repeatable)."
    )
    model: str | None = Field(
        None, description="The `model` field of the request (None: the engine's own model)."
    )

    @model_validator(mode="before")
    @classmethod
    def _type_is_fn(cls, v: Any) -> Any:
        """`type = "judge"` (the issue's spelling) reads as `fn = "judge"`."""
        if isinstance(v, dict) and "type" in v and "fn" not in v:
            v = {("fn" if k == "type" else k): x for k, x in v.items()}
        return v

    @field_validator("rubric")
    @classmethod
    def _rubric(cls, v: str) -> str:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(v) if f is not None}
        except ValueError as e:
            raise ValueError(f"not a format string: {e}") from e
        if "completion" not in names:
            raise ValueError("must use {completion} (the text to grade)")
        if not names <= RUBRIC_FIELDS:
            raise ValueError(
                f"may use only {sorted(RUBRIC_FIELDS)}, found {sorted(names - RUBRIC_FIELDS)}"
                " (double literal braces)"
            )
        return v

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        raise FlywheelError("a judge part is scored by the service's Judge, not in the sandbox")


class JudgeSettings(BaseModel):
    """The `[judge]` table: the judge's engines and how they are asked.

    Read by the rollout worker (which judges) and by `flywheel up` (which starts
    `engines` of them and gives the workers their URLs). One pool per run;
    every judge part of every task uses it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    urls: tuple[str, ...] = Field(
        (),
        description="Base URLs of the judge engines (SGLang or the CPU engine; their "
        "/v1/chat/completions). `flywheel up` sets them to the engines it starts; in "
        "Kubernetes, the judge component's Service.",
    )
    engines: int = Field(
        1, ge=0, le=64, description="`flywheel up`: judge engines it starts (0: use urls)."
    )
    model: str | None = Field(
        None,
        description="`flywheel up`: the judge engines' model (a directory or a cached hub id; "
        "default: [stack] model, the policy's base).",
    )
    threads: int = Field(1, ge=0, description="`flywheel up`: torch threads per CPU judge engine.")
    gpus: tuple[tuple[int, ...], ...] = Field(
        (),
        description="`flywheel up` with [stack] engine = 'sglang': the GPUs of each SGLang "
        "judge engine, one list per engine (more than one: tensor parallel), e.g. [[6], [7]]; "
        "none given there: the judge engines are CPU engines.",
    )
    concurrency: int = Field(
        8,
        ge=1,
        le=1024,
        description="Judge requests in flight per rollout worker (more wait, counted in "
        "flywheel_judge_waiting); the engines' load is workers x concurrency.",
    )
    timeout_s: float = Field(30.0, gt=0, description="Limit of one judge request (one attempt).")
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Further attempts after a timeout, an unreachable engine, a 5xx or 429 "
        "(each on the least-loaded engine, the failed one last); a 4xx is not retried.",
    )
    backoff_s: float = Field(0.2, ge=0, description="Wait before a retry, doubled each time.")
    cache_size: int = Field(
        4096,
        ge=0,
        description="Replies kept per worker, keyed by the request (rubric, prompt, "
        "completion, answer, sampling); 0: no cache.",
    )
    api_key: SecretStr | None = Field(None, description="Bearer key of the judge engines.")


# ── a part's request, its reply's value ──────────────────────────────────────
def request(part: JudgeReward, prompt: str, completion: str, answer: str | None) -> dict[str, Any]:
    """The /v1/chat/completions body that asks the judge about one completion."""
    text = part.rubric.format(prompt=prompt, completion=completion, answer=answer or "")
    messages = [{"role": "system", "content": part.system}] if part.system else []
    messages.append({"role": "user", "content": text})
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": part.max_tokens,
        "temperature": part.temperature,
    }
    if part.model is not None:
        body["model"] = part.model
    return body


_NUMBER = r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)"
_SCORE_AFTER = re.compile(rf"score\W{{0,3}}\s*({_NUMBER})", re.I)
# A reply that is a number and nothing else: "7", "**7**", "7.", "7/10", "7 out of 10".
_OUT_OF = r"(?:(?:/|out of)\s*\d+(?:\.\d+)?)?"
_ONLY_NUMBER = re.compile(rf"^[\s*]*({_NUMBER})[\s*]*{_OUT_OF}[\s*.]*$", re.I)
_YES_NO = re.compile(r"^\W*(yes|no)\b", re.I)


def parse_reply(part: JudgeReward, reply: str) -> float | None:
    """The reply's verdict in [0, 1], or None when it holds none (never a guess of 0)."""
    if part.parse == "yes_no":
        m = _YES_NO.match(reply)
        return None if m is None else float(m.group(1).lower() == "yes")
    # Only a number the judge gave as its score: a reply that echoes the question
    # ("2 + 3 ...") holds numbers that are no verdict.
    found = _SCORE_AFTER.findall(reply)
    if found:
        raw = found[-1]
    else:
        m = _ONLY_NUMBER.match(reply)
        if m is None:
            return None
        raw = m.group(1)
    x = float(raw)
    if not math.isfinite(x) or not 0.0 <= x <= part.scale:
        return None
    return x / part.scale


def request_key(body: dict[str, Any]) -> str:
    """The cache key of a request: its rubric, prompt, completion, answer and sampling."""
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ── outcomes ─────────────────────────────────────────────────────────────────
class JudgeCallFailed(FlywheelError, RuntimeError):
    """The judge's engines gave no answer; `reason` is one of JUDGE_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Verdict:
    """A judge part's value of one completion, or why there is none."""

    value: float | None
    reason: str | None = None  # a JUDGE_REASONS entry when value is None
    error: str | None = None
    reply: str = ""  # what the judge said (for the dead letter)
    cached: bool = False


def with_verdicts(r: Reward, parts: Sequence[JudgeReward], verdicts: Sequence[Verdict]) -> Reward:
    """The sandbox's reward `r` of a completion joined with its judge parts' verdicts.

    The sum is Σ weight·value over every part. A part without a verdict
    leaves the whole sample unscored (reward 0 with an error and the
    dead-letter reason): a sum missing a part is no reward. A sandbox error
    stays the sample's error.
    """
    values = dict(r.parts)
    total = r.reward
    failed: tuple[JudgeReward, Verdict] | None = None
    for part, v in zip(parts, verdicts, strict=True):
        if v.value is None:
            failed = failed or (part, v)
            continue
        values[part.part_name] = v.value
        total += part.weight * v.value
    if r.error is not None:
        return replace(r, parts=values)
    if failed is not None:
        part, v = failed
        return Reward(0.0, values, f"judge {part.part_name}: {v.error}", v.reason)
    return Reward(total, values)


# ── the cache ────────────────────────────────────────────────────────────────
class ReplyCache:
    """Judge replies by request key: least recently used out first, at most `size`.

    Identical requests in flight share one call (`get_or_call`), so n equal
    completions of one group cost the judge one request. A failed call is not
    kept: the next asks again. In memory, per worker: the repeats that pay
    (equal completions of one group, the same prompt's group again) meet on
    the worker that has the task; a fleet-wide cache (NATS KV) would add a
    round trip to every miss for the rarer cross-worker hit.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._done: OrderedDict[str, str] = OrderedDict()
        self._pending: dict[str, asyncio.Future[str]] = {}

    def __len__(self) -> int:
        return len(self._done)

    def get(self, key: str) -> str | None:
        reply = self._done.get(key)
        if reply is not None:
            self._done.move_to_end(key)
        return reply

    def put(self, key: str, reply: str) -> None:
        if self.size <= 0:
            return
        self._done[key] = reply
        self._done.move_to_end(key)
        while len(self._done) > self.size:
            self._done.popitem(last=False)

    async def get_or_call(self, key: str, call: Callable[[], Awaitable[str]]) -> tuple[str, bool]:
        """(reply, whether it came without a call of this request's own)."""
        reply = self.get(key)
        if reply is not None:
            return reply, True
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending), True
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            reply = await call()
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved: no "never retrieved" warning when nobody shared it
            raise
        else:
            fut.set_result(reply)
            self.put(key, reply)
            return reply, False
        finally:
            del self._pending[key]


# ── metrics ──────────────────────────────────────────────────────────────────
class JudgeMetrics:
    """`flywheel_judge_*`, served by the service that judges (the rollout worker)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        m = MetricSet(registry, "flywheel_judge_")
        self.requests = m.counter(
            "requests", "Judge engine requests (attempts), by engine and outcome.",
            ["engine", "outcome"],
        )  # fmt: skip
        self.seconds = m.histogram(
            "request_seconds",
            "Latency of one judge engine request (one attempt).",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.in_flight = m.gauge("in_flight", "Judge requests being answered now.")
        self.waiting = m.gauge("waiting", "Judge requests queued for a concurrency slot.")
        self.cache_hits = m.counter(
            "cache_hits", "Verdicts answered from the cache (or a request in flight)."
        )
        self.cache_misses = m.counter("cache_misses", "Verdicts that asked an engine.")
        self.verdicts = m.counter("verdicts", "Completions the judge scored.")
        self.unscored = m.counter(
            "unscored", "Completions the judge could not score, by reason.", ["reason"]
        )
        self.value = m.histogram(
            "value", "Judge verdicts (normalised to [0, 1]).", (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
        )

    def request_done(self, engine: str, outcome: str, seconds: float) -> None:
        self.requests.labels(engine=engine, outcome=outcome).inc()
        self.seconds.observe(seconds)


Chat = Callable[[dict[str, Any]], Awaitable[str]]
"""Sends one chat-completions body to the judge's engines; the reply's text, or
JudgeCallFailed. (The rollout worker's: services/engine_api/chat_pool.py.)"""


class Judge:
    """Verdicts of judge parts through `chat`, with a reply cache and metrics."""

    def __init__(
        self, chat: Chat, cache_size: int = 4096, metrics: JudgeMetrics | None = None
    ) -> None:
        self.chat = chat
        self.cache = ReplyCache(cache_size)
        self.metrics = metrics

    async def verdict(
        self, part: JudgeReward, prompt: str, completion: str, answer: str | None
    ) -> Verdict:
        body = request(part, prompt, completion, answer)
        try:
            reply, cached = await self.cache.get_or_call(request_key(body), lambda: self.chat(body))
        except JudgeCallFailed as e:
            return self._unscored(Verdict(None, e.reason, str(e)))
        if self.metrics is not None:
            (self.metrics.cache_hits if cached else self.metrics.cache_misses).inc()
        value = parse_reply(part, reply)
        if value is None:
            what = "yes or no" if part.parse == "yes_no" else f"a score in [0, {part.scale:g}]"
            why = f"reply holds no verdict ({what} expected): {reply[:200]!r}"
            return self._unscored(Verdict(None, UNPARSABLE, why, reply, cached))
        if self.metrics is not None:
            self.metrics.verdicts.inc()
            self.metrics.value.observe(value)
        return Verdict(value, reply=reply, cached=cached)

    def _unscored(self, v: Verdict) -> Verdict:
        if self.metrics is not None and v.reason is not None:
            self.metrics.unscored.labels(reason=v.reason).inc()
        return v

    async def verdicts(
        self,
        parts: Sequence[JudgeReward],
        prompt: str,
        completions: Sequence[str],
        answer: str | None,
    ) -> list[list[Verdict]]:
        """Every part's verdict of every completion, at once (the pool bounds the load)."""
        flat = await asyncio.gather(
            *(self.verdict(p, prompt, c, answer) for c in completions for p in parts)
        )
        k = len(parts)
        return [list(flat[i * k : (i + 1) * k]) for i in range(len(completions))]
