"""Classic `verifiers` environments (0.2.1's API; `verifiers.legacy` in 0.3), run unmodified.

`source = { type = "verifiers", env = "my-env", args = {...} }` loads the
environment as `vf-eval` does (`verifiers.load_environment`, which imports
the module `my_env` and calls its `load_environment(**args)`). Its dataset's
rows become Flywheel prompts (the `prompt` column: chat messages, the env's
system prompt already in them; `answer` as the reference), and its rubric
is the reward: the completion becomes the assistant message of a state the
env itself initialised (`init_state`), scored by `rubric.score_rollout`.

Generation stays Flywheel's: token-in/token-out through the rollout worker,
which is what a SingleTurnEnv's rollout amounts to. A multi-turn env's own
rollout loop (ToolEnv) calls an OpenAI client instead; docs/verifiers.md
says how far that runs against the engine's /v1/chat/completions.

Loading is cached per (env, args): the buffer reads rows, the verifier
sandbox's child scores with the same object. Nothing here imports
`verifiers` until a verifiers task is used (`require` names the extra).
"""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import threading
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from services.runtime.errors import ConfigError
from services.tasks.registry import REWARDS, SOURCES, RewardPart, Row, Rows, SourceSpec
from services.tasks.sources import require

_ENV_ID = r"^([\w.-]+/)?[A-Za-z_][\w.-]*$"  # 'owner/my-env' imports my_env

# The client `init_state` asks for: only stored in the state, never called (the
# completion is Flywheel's), so its address is never reached.
_UNUSED_URL = "http://flywheel.invalid/v1"


@SOURCES.register
class VerifiersSource(SourceSpec):
    """A `verifiers` environment's dataset (extra: verifiers); its rubric scores by default."""

    default_reward: ClassVar[str | None] = "verifiers"

    type: Literal["verifiers"]
    env: str = Field(pattern=_ENV_ID, description="Its id as vf-eval takes it ('my-env').")
    args: dict[str, Any] = Field(default_factory=dict, description="load_environment's kwargs.")
    split: Literal["train", "eval"] = Field("train", description="dataset or eval_dataset.")

    def rows(self, key: str) -> Rows:
        return VerifiersRows(self)

    def check(self, key: str, *, data: bool) -> None:
        require("verifiers", f"{key}: type 'verifiers'", "verifiers")

    def task_name(self) -> str:
        return f"verifiers:{self.env}"

    def scorer_context(self) -> dict[str, Any] | None:
        return self.model_dump(mode="json")

    def sandbox_modules(self) -> tuple[str, ...]:
        return (self.env.rpartition("/")[2].replace("-", "_"),)  # 'owner/my-env': my_env


@REWARDS.register
class VerifiersRubric(RewardPart):
    """The `verifiers` environment's own rubric (source type 'verifiers')."""

    own_source: ClassVar[str | None] = "verifiers"
    calls_code: ClassVar[bool] = True  # another package's rubric, on the policy's text

    fn: Literal["verifiers"]

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return rubric_score(completion, source=ctx["source"], row=int(ctx["row"]))

    def warm(self, ctx: dict[str, Any]) -> None:
        if "source" in ctx:
            env_of(ctx["source"])  # importing and building an env takes seconds


def _load(env_id: str, args: dict[str, Any]) -> Any:
    vf = require("verifiers", "source type 'verifiers'", "verifiers")
    # Environment.__post_init__ installs SIGINT/SIGTERM handlers that exit(143) at
    # once: they would replace a service's graceful drain, so the old ones go back.
    # signal.signal only works in the main thread, where Flywheel loads tasks.
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(f"verifiers env {env_id!r}: load it in the main thread")
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return vf.load_environment(env_id, **args)
    except (ImportError, ValueError, TypeError, AttributeError) as e:
        raise ConfigError(f"verifiers env {env_id!r}: {type(e).__name__}: {e}") from e
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@functools.lru_cache(maxsize=8)
def load_env(env_id: str, args_json: str) -> Any:
    """The environment (cached: the sandbox child scores every completion with it)."""
    env = _load(env_id, json.loads(args_json))
    if env.rubric.has_group_rewards:
        raise ConfigError(
            f"verifiers env {env_id!r}: its rubric has group reward functions; "
            "Flywheel scores one completion at a time"
        )
    return env


def env_of(spec: VerifiersSource | dict[str, Any]) -> Any:
    src = spec if isinstance(spec, VerifiersSource) else VerifiersSource.model_validate(spec)
    return load_env(src.env, json.dumps(src.args, sort_keys=True))


def dataset(spec: VerifiersSource | dict[str, Any]) -> Any:
    """The env's dataset of that split (a datasets.Dataset, the same order everywhere)."""
    src = spec if isinstance(spec, VerifiersSource) else VerifiersSource.model_validate(spec)
    env = env_of(src)
    try:
        return env.get_eval_dataset() if src.split == "eval" else env.get_dataset()
    except ValueError as e:  # the env has no dataset of that split
        raise ConfigError(f"verifiers env {src.env!r} split {src.split!r}: {e}") from e


def to_row(record: dict[str, Any], where: str) -> Row:
    """A dataset record as a Row: its chat `prompt`, its `answer` as the reference."""
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        return Row(prompt=prompt, answer=_answer(record), solution=_answer(record))
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"{where}: 'prompt' is neither text nor chat messages")
    messages = []
    for m in prompt:
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, str):
            raise ConfigError(f"{where}: only text message content is supported, got {m!r}")
        messages.append({"role": str(m.get("role", "user")), "content": content})
    return Row(messages=tuple(messages), answer=_answer(record), solution=_answer(record))


def _answer(record: dict[str, Any]) -> str | None:
    answer = record.get("answer")
    return None if answer is None or answer == "" else str(answer)


@dataclass(frozen=True)
class VerifiersRows:
    """The rows of a verifiers env's dataset, converted as they are asked for."""

    spec: VerifiersSource

    def __len__(self) -> int:
        return len(dataset(self.spec))

    def row(self, index: int) -> Row:
        return to_row(dataset(self.spec)[index], f"verifiers:{self.spec.env} row {index}")


def rubric_score(completion: str, *, source: dict[str, Any], row: int) -> tuple[float, dict]:
    """The env's rubric on `completion` as the answer to row `row`: (reward, its metrics)."""
    env = env_of(source)
    record = dataset(source)[row]
    return asyncio.run(_score(env, record, completion))


async def _score(env: Any, record: dict[str, Any], completion: str) -> tuple[float, dict]:
    import verifiers as vf

    client = vf.ClientConfig(api_base_url=_UNUSED_URL, max_retries=0)
    state = await env.init_state(record, client, model="flywheel")
    state["completion"] = [vf.AssistantMessage(content=completion)]
    await env.rubric.score_rollout(state)
    metrics = {str(k): float(v) for k, v in (state.get("metrics") or {}).items()}
    return float(state["reward"]), metrics
