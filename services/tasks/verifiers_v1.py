"""Environments written for verifiers' v1 API (>=0.3.1: Taskset / Harness / Env), as tasks.

`source = { type = "verifiers-v1", taskset = "my-taskset", args = {...} }`
loads the taskset as verifiers' `eval` does (`verifiers.v1.load_environment`:
the module `my_taskset`, its exported Taskset, and its exported `Env` where
it has one: a multi-turn or multi-agent env; else SingleAgentEnv);
`env = "my-env"` pairs a reusable Env instead. Each of the taskset's
tasks is one Flywheel row (its prompt, for the buffer's records); a rollout
worker runs the env's episodes on it itself (`V1Runner`), because in v1 the
env drives the turns and scores the finished trace with the task's
`@reward`s: the reward is the trace's (`Trace.reward`), its named rewards
and metrics logged as `verifiers.<name>` parts.

Rollouts go through the engine's /v1/chat/completions, as SGLang serves it:
`FlywheelClient` (a verifiers `Client`) adds `logprobs` and
`return_token_ids` to every model call the interception server relays, and
hands verifiers the answer's token ids (`prompt_token_ids`,
`response_token_ids`) and per-token logprobs as the turn's `TurnTokens`. The
trace's message graph then holds exactly the tokens the engine saw; its
final branch (graph.py: prompt + every turn, observation tokens unsampled)
becomes the sample: loss mask 1 on sampled tokens, 0 on the env's.

The agents' program is Flywheel's in-process chat loop
(services/tasks/verifiers_v1_harness.py): verifiers' bundled loops install
their dependencies with `uv` at run time. Runtimes are local subprocesses
(verifiers' default is a remote Prime sandbox).

Nothing here imports `verifiers` until a v1 task is used.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import gc
import itertools
import re
import sys
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import Field

from services.runtime.errors import ConfigError, RetryableError
from services.tasks.episode import Episode
from services.tasks.registry import REWARDS, SOURCES, RewardPart, Row, Rows, SourceSpec
from services.tasks.sources import require

_ID = r"^([\w.-]+/)?[A-Za-z_][\w.-]*(@[\w.-]+)?$"  # 'owner/my-taskset@1.0' imports my_taskset
# verifiers' bundled harnesses that run a `uv` script (downloads at run time): Flywheel's
# in-process chat loop plays their seats.
_UV_HARNESSES = frozenset({"bash", "null"})


@SOURCES.register
class VerifiersV1Source(SourceSpec):
    """A verifiers v1 taskset (extra: verifiers): its tasks, rolled out by its env, scored
    by its rewards."""

    default_reward: ClassVar[str | None] = "verifiers-v1"

    type: Literal["verifiers-v1"]
    taskset: str = Field(pattern=_ID, description="The taskset id ('my-taskset').")
    env: str = Field(
        "", pattern=r"^$|" + _ID, description="The Env id; empty: the taskset's own, else "
        "SingleAgentEnv (one agent, one turn per segment).",
    )  # fmt: skip
    args: dict[str, Any] = Field(default_factory=dict, description="The taskset's config.")
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="The env's config (roles, max_turns, ...)."
    )
    limit: int | None = Field(None, ge=1, description="The first N tasks (infinite tasksets).")

    def rows(self, key: str) -> Rows:
        return V1Rows(self)

    def check(self, key: str, *, data: bool) -> None:
        require("verifiers", f"{key}: type 'verifiers-v1'", "verifiers")
        load_env(self.key())  # a bad id or config fails at start-up, naming it

    def task_name(self) -> str:
        return f"verifiers-v1:{self.taskset}" + (f"+{self.env}" if self.env else "")

    def in_split(self, split: str, key: str) -> VerifiersV1Source:
        if split != "train":  # evaluation scores text in-process; a v1 reward reads a trace
            raise ValueError(f"{key}: a verifiers-v1 source is a training source only (for now)")
        return self

    def key(self) -> str:
        """Its JSON (the cache key: the env is built once per process)."""
        return self.model_dump_json()


@REWARDS.register
class VerifiersV1Rewards(RewardPart):
    """The task's own `@reward`s, scored by the env on the finished trace (source type
    'verifiers-v1'): the rollout worker's episode computes it, not the verifier sandbox."""

    own_source: ClassVar[str | None] = "verifiers-v1"
    # Never runs in the verifier sandbox: the env's rewards run inside its episode, in
    # the rollout worker's process (docs/verifiers.md says so), so the sandbox rule
    # (bubblewrap or insecure-allow) has nothing to decide here.
    calls_code: ClassVar[bool] = False

    fn: Literal["verifiers-v1"]

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        # A v1 reward reads the whole trace, which only the episode has.
        raise ConfigError("a verifiers-v1 task is scored in its episode (V1Runner), not on text")


# ── loading ────────────────────────────────────────────────────────────────────
MIN_VERSION = (0, 3, 1)  # 0.2.1 ships an early `verifiers.v1`, 0.3.0 another Client API


def version_of(text: str) -> tuple[int, ...]:
    """'0.3.1' -> (0, 3, 1); a pre-release or local suffix is ignored ('0.4.0rc1': (0, 4, 0))."""
    return tuple(int(re.sub(r"\D.*", "", part) or 0) for part in text.split(".")[:3])


def _vf() -> Any:
    verifiers = require("verifiers", "source type 'verifiers-v1'", "verifiers")
    installed = str(getattr(verifiers, "__version__", "0"))
    if version_of(installed) < MIN_VERSION:
        raise ConfigError(
            f"source type 'verifiers-v1' needs verifiers>=0.3.1 (installed: {installed}): "
            "pip install 'flywheel[verifiers]'"
        )
    import verifiers.v1 as vf

    _register_harness()
    _route_clients()
    _quick_exit()
    return vf


@functools.cache
def _quick_exit() -> None:
    """Freeze the heap at exit: with verifiers' import graph (anthropic, mcp, openai-agents,
    ...) the interpreter's exit-time collections took 3 s idle and over 8 s on a loaded
    2-core box, where a stopped rollout worker outlived `flywheel up`'s SIGTERM grace and
    was SIGKILLed. Frozen objects are never collected; the OS reclaims the memory."""
    atexit.register(gc.freeze)


def _register_harness() -> None:
    """Make Flywheel's harness loadable by id: verifiers imports a harness id as a
    top-level module (a dotted path is looked for under its own package first)."""
    from services.tasks import verifiers_v1_harness as h

    sys.modules.setdefault(h.HARNESS_ID, h)


@functools.lru_cache(maxsize=8)
def load_env(key: str) -> Any:
    """The env of a source (its JSON), built once per process, every seat local."""
    vf = _vf()
    src = VerifiersV1Source.model_validate_json(key)
    raw = {
        **src.env_args,
        "id": src.env,
        "taskset": {**src.args, "id": src.taskset},
    }
    try:
        config = vf.resolve_env_config(raw)
        config = _local_seats(vf, config)
        return vf.load_environment(config)
    except (ImportError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"verifiers-v1 {src.task_name()}: {type(e).__name__}: {e}") from e


def _local_seats(vf: Any, config: Any) -> Any:
    """Every seat in a local subprocess runtime; seats on a `uv` loop play Flywheel's."""
    from verifiers.v1.harnesses.null.harness import NullHarnessConfig  # noqa: F401 (narrowing)

    from services.tasks.verifiers_v1_harness import HARNESS_ID, FlywheelChatConfig

    update = {}
    for name, info in type(config).model_fields.items():
        seat = getattr(config, name)
        if not isinstance(info.default, vf.AgentConfig):
            continue
        harness = seat.harness
        if harness is None or harness.id in _UV_HARNESSES:
            harness = FlywheelChatConfig(id=HARNESS_ID)
        update[name] = seat.model_copy(
            update={"harness": harness, "runtime": vf.SubprocessConfig()}
        )
    return config.model_copy(update=update)


@functools.lru_cache(maxsize=8)
def tasks(key: str) -> tuple[Any, ...]:
    """The taskset's tasks, in its order (the row index is the position)."""
    env = load_env(key)
    src = VerifiersV1Source.model_validate_json(key)
    if src.limit is not None:  # islice, not Taskset.head: 0.4.0 has no head
        return tuple(itertools.islice(env.taskset, src.limit))
    if getattr(env.taskset, "INFINITE", False):
        raise ConfigError(f"verifiers-v1 {src.task_name()}: an infinite taskset needs `limit`")
    return tuple(env.taskset)


@dataclass(frozen=True)
class V1Rows:
    """The taskset's tasks as rows: the prompt (for the records; the env renders its own)."""

    spec: VerifiersV1Source

    def __len__(self) -> int:
        return len(tasks(self.spec.key()))

    def row(self, index: int) -> Row:
        data = tasks(self.spec.key())[index].data
        messages: list[dict[str, str]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            for m in data.prompt:
                messages.append({"role": m.role, "content": _text(m.content)})
        answer = getattr(data, "answer", None)
        answer = None if answer is None else str(answer)
        if not messages:  # a task the env opens (a user simulator speaks first)
            return Row(prompt=f"{self.spec.task_name()} task {index}", answer=answer)
        return Row(messages=tuple(messages), answer=answer, solution=answer)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(getattr(p, "text", "") or "" for p in content or ())


# ── the client: the engine's /v1/chat/completions, with token ids ─────────────
_CLIENTS: dict[str, FlywheelClient] = {}  # V1Runner.key -> the runner's client
_KEY_HEADER = "X-Flywheel-Client"  # in the client config: which runner's client serves it


def _route_clients() -> None:
    """The interception server builds each session's client from its config with
    `resolve_client`, which knows verifiers' two (eval: no token ids; train: vLLM's
    /inference/v1/generate). A Flywheel config gets the runner's own client."""
    from verifiers.v1.interception import server

    original = server.resolve_client
    if getattr(original, "flywheel", False):
        return

    def resolve(config: Any) -> Any:
        key = (getattr(config, "headers", None) or {}).get(_KEY_HEADER)
        if key is not None:
            if key not in _CLIENTS:
                raise ConfigError(f"verifiers-v1: no Flywheel client {key!r} (runner closed?)")
            return _CLIENTS[key]
        return original(config)

    resolve.flywheel = True  # type: ignore[attr-defined]
    server.resolve_client = resolve


@dataclass
class Turn:
    """What the engine said about one model call (beyond what verifiers keeps)."""

    weight_version: int
    finish_reason: str | None


@dataclass
class FlywheelClient:
    """A verifiers `Client` posting to an engine's /v1/chat/completions (built by
    `make_client`, which mixes in verifiers' base class)."""

    engine_url: str
    timeout_s: float
    max_abort_retries: int
    on_abort: Callable[[], Any]
    api_key: str | None = None
    turns: dict[str, list[Turn]] = field(default_factory=dict)  # trace id -> its calls
    http: Any = None

    async def get_response(
        self,
        dialect: Any,
        body: dict,
        sampling: Any,
        session_id: str | None = None,
        turn: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> Any:
        from verifiers.v1.dialects import ChatDialect
        from verifiers.v1.errors import model_error

        if not isinstance(dialect, ChatDialect):
            raise model_error(f"the engine serves chat only, not {dialect}", status_code=400)
        answer = await self._post({**body, "logprobs": True, "return_token_ids": True},
                                  session_id or uuid.uuid4().hex)  # fmt: skip
        return _response(dialect, answer, self.turns.setdefault(session_id or "", []))

    async def _post(self, body: dict[str, Any], session: str) -> dict[str, Any]:
        import httpx
        from verifiers.v1.errors import model_error

        if self.http is None:
            self.http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0))
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        n = len(self.turns.get(session, []))
        for attempt in range(self.max_abort_retries + 1):
            # A request id unique per call: SGLang refuses an id still in flight.
            rid = f"vf-{session}-t{n}" + (f":r{attempt}" if attempt else "")
            try:
                r = await self.http.post(
                    f"{self.engine_url}/v1/chat/completions",
                    json={**body, "rid": rid},
                    headers=headers,
                )
            except httpx.HTTPError as e:
                raise model_error(f"engine: {type(e).__name__}: {e}", status_code=503) from e
            if r.status_code != 200:
                why = f"engine answered {r.status_code}: {r.text}"
                raise model_error(why, status_code=r.status_code)
            answer = r.json()
            # A weight update aborted it: generate it again (partial tokens dropped).
            if (answer.get("choices") or [{}])[0].get("finish_reason") != "abort":
                return dict(answer)
            self.on_abort()
        raise RetryableError(f"{session}: generation aborted {self.max_abort_retries + 1} times")

    async def relay(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError("the Flywheel client does not stream")

    async def relay_aux(self, *a: Any, **k: Any) -> dict:
        raise NotImplementedError("the Flywheel client relays no side routes")

    async def close(self) -> None:
        """The interception server closes it with itself; the runner owns it (aclose)."""

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None


def make_client(**kw: Any) -> FlywheelClient:
    """A FlywheelClient that is a verifiers `Client` (its ABC imported only now)."""
    import verifiers.v1 as vf

    cls = type("FlywheelVerifiersClient", (FlywheelClient, vf.Client), {})
    return cls(**kw)


def _response(dialect: Any, answer: dict[str, Any], turns: list[Turn]) -> Any:
    """SGLang's answer as verifiers' Response: its token ids and logprobs as TurnTokens."""
    from verifiers.v1.errors import model_error
    from verifiers.v1.types import TurnTokens

    choice = (answer.get("choices") or [None])[0]
    if not isinstance(choice, dict):
        raise model_error("engine answer without choices", status_code=502)
    prompt_ids, ids = choice.pop("prompt_token_ids", None), choice.pop("response_token_ids", None)
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(t["logprob"]) for t in content]
    if prompt_ids is None or ids is None or len(logprobs) != len(ids):
        raise model_error(
            "engine answer without token ids or per-token logprobs (an engine older than "
            "SGLang's return_token_ids?)", status_code=502,
        )  # fmt: skip
    # SGLang's metadata carries weight_versions (a list); OpenAI's ChatCompletion types
    # metadata as {str: str}, so it is read here and left out of what verifiers validates.
    meta = answer.pop("metadata", None) or {}
    turns.append(Turn(_version(meta.get("weight_version")), choice.get("finish_reason")))
    response = dialect.parse_response(dialect.validate_response(answer))
    response.raw = answer  # what the program receives
    response.tokens = TurnTokens(
        prompt_ids=[int(t) for t in prompt_ids],
        completion_ids=[int(t) for t in ids],
        completion_logprobs=logprobs,
    )
    return response


def _version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # "default": an engine that never loaded a Flywheel version


# ── the runner: a task's n episodes, as samples ───────────────────────────────
@dataclass(frozen=True)
class V1Sample:
    """One episode's trainable trace, as the rollout worker publishes it."""

    episode: Episode
    reward: float
    parts: dict[str, float]
    error: str | None


class V1Runner:
    """Runs a v1 env's episodes against one engine (the rollout worker owns one)."""

    def __init__(
        self,
        engine_url: str,
        model: str,
        timeout_s: float,
        max_abort_retries: int,
        on_abort: Callable[[], Any] = lambda: None,
        api_key: str | None = None,
    ) -> None:
        _vf()
        self.model = model
        self.key = uuid.uuid4().hex
        self.client = make_client(
            engine_url=engine_url.rstrip("/"),
            timeout_s=timeout_s,
            max_abort_retries=max_abort_retries,
            on_abort=on_abort,
            api_key=api_key,
        )
        _CLIENTS[self.key] = self.client
        self.stack = contextlib.AsyncExitStack()
        self.serving: dict[str, Any] = {}  # source key -> its env, serving
        self.lock = asyncio.Lock()

    async def __aenter__(self) -> V1Runner:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.stack.aclose()
        self.serving.clear()
        _CLIENTS.pop(self.key, None)
        await self.client.aclose()

    async def env(self, src: VerifiersV1Source) -> Any:
        """The env, serving (its interception server and shared tools) until aclose: an
        env holds one serving context, so every task of it shares this one."""
        async with self.lock:
            key = src.key()
            if key not in self.serving:
                env = load_env(key)
                await self.stack.enter_async_context(env.serving())
                self.serving[key] = env
            return self.serving[key]

    def context(self, sampling: Mapping[str, Any]) -> Any:
        """The run's model context: the engine through Flywheel's client, the task's
        sampling (SGLang names: max_new_tokens is OpenAI's max_tokens)."""
        import verifiers.v1 as vf

        # Every parameter the chat route would otherwise take from the model's
        # generation_config.json (SGLang's --sampling-defaults model) is sent, at
        # /generate's defaults where the task leaves it out: the samples must come
        # from the task's distribution, as the native route's do, not the model card's.
        extra = {"top_k": sampling.get("top_k", -1), "min_p": 0.0, "repetition_penalty": 1.0}
        s = vf.Sampling(
            temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0),
            max_tokens=sampling.get("max_new_tokens"),
            **({"stop": list(sampling["stop"])} if sampling.get("stop") else {}),
            extra_body=extra,
        )
        return vf.ModelContext(model=self.model, client=self._config(), sampling=s)

    def _config(self) -> Any:
        import verifiers.v1 as vf

        # The header names this runner's client to _route_clients (never sent: the
        # runner's client posts itself).
        return vf.EvalClientConfig(
            base_url=self.client.engine_url + "/v1",
            api_key_var="FLYWHEEL_ENGINE_API_KEY",
            headers={_KEY_HEADER: self.key},
        )

    async def run(
        self, src: VerifiersV1Source, index: int, n: int, sampling: Mapping[str, Any]
    ) -> list[V1Sample]:
        """`n` episodes of task `index`, at once (the engine batches their turns)."""
        env = await self.env(src)
        task = tasks(src.key())[index]
        ctx = self.context(sampling)
        episodes = await asyncio.gather(*(env.run_episode(task, ctx) for _ in range(n)))
        return [self.sample(src, ep) for ep in episodes]

    def sample(self, src: VerifiersV1Source, episode: Any) -> V1Sample:
        trainable = [t for t in episode.traces if t.agent.trainable]
        if len(trainable) != 1:
            raise ConfigError(
                f"verifiers-v1 {src.task_name()}: an episode has {len(trainable)} trainable "
                "traces; Flywheel trains one per episode (mark the others untrainable in "
                "Env.setup)"
            )
        (trace,) = trainable
        calls = self.client.turns.pop(trace.id, [])
        for t in episode.traces:  # the untrainable seats' calls, not kept
            self.client.turns.pop(t.id, None)
        ep, dropped = as_episode(trace, calls)
        parts = {f"verifiers.{k}": float(r.value) for k, r in trace.rewards.items() if r}
        parts |= {f"verifiers.{k}": float(v) for k, v in trace.metrics.items() if v is not None}
        parts |= {"episode.turns": float(ep.turns), "verifiers.dropped_branches": float(dropped)}
        errors = [e.message for e in [*episode.errors, *trace.errors]]
        if not episode.ok or errors or not ep.response_ids:
            why = "; ".join(errors) or "the episode produced no sampled tokens"
            return V1Sample(ep, 0.0, parts, f"verifiers-v1 episode failed: {why}")
        return V1Sample(ep, float(trace.reward), parts, None)


def as_episode(trace: Any, calls: list[Turn]) -> tuple[Episode, int]:
    """The trace's final branch as an Episode: its first turn's prompt, then every token
    after it (sampled: loss mask 1 and the engine's logprobs; the env's: 0, 0.0).
    Returns it and how many other branches (turns re-tokenised apart) were left out."""
    branches = trace.branches
    if not branches:
        return Episode(prompt_ids=[]), 0
    branch = branches[-1]
    ids, mask, lps = branch.token_ids, branch.sampled_mask, branch.logprobs
    first = mask.index(True) if True in mask else len(ids)
    finish = calls[-1].finish_reason if calls else None
    ep = Episode(
        prompt_ids=list(ids[:first]),
        response_ids=list(ids[first:]),
        logprobs=list(lps[first:]),
        loss_mask=[int(m) for m in mask[first:]],
        text=trace.last_reply,
        turns=sum(1 for node in branch.nodes if node.sampled),
        finish_type="length" if finish == "length" else "stop",
        weight_version=calls[-1].weight_version if calls else 0,
        all_spans=False,
    )
    return ep, len(branches) - 1
