"""A teacher for on-policy distillation: its run-file table and the pool of its engines.

A teacher is one more model behind SGLang's API (an HF directory on its own
engines, started and supervised by `flywheel up` like the rollout engines,
or any SGLang servers at `urls`). It scores a student's sample with one
prefill-only request per sample (`EngineClient.prompt_logprobs`: the
teacher's log p of each response token given everything before it), and
the rollout worker sends the numbers with the sample (`Sample.teacher_logprobs`)
for the trainer's reverse-KL advantage (services/trainer/core/distill.py).

Failure policy: at most `concurrency` requests in flight per worker (more
teacher engines, more workers: more scoring throughput), each limited to
`timeout_s`; a sample that fails (a timeout, a refused request, an engine
gone) is tried again on the next engine, `attempts` tries in all with
`retry_backoff_s` between them; then `TeacherFailed`, which the worker turns
into a dead letter (reason `teacher_failed`) for that sample alone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from proto.weight_version import from_engine
from services.engine_api.engine_client import EngineClient, EngineError
from services.runtime.errors import FlywheelError
from services.runtime.settings import RunPath

log = logging.getLogger(__name__)

TEACHER_FAILED = "teacher_failed"
"""The dead-letter reason of a sample no teacher engine could score."""


class TeacherSettings(BaseModel):
    """`[teacher]` of the run file: the model that scores every sample (distillation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        "teacher",
        pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="The teacher's name, recorded with every sample it scored.",
    )
    model: RunPath | None = Field(
        None,
        description="The teacher's model (an HF directory or a cached hub id): `flywheel up` "
        "starts its engines on it, and it is recorded with every sample. None: the model "
        "the engines at `urls` report.",
    )
    engines: int = Field(
        1,
        ge=0,
        le=64,
        description="Teacher engines `flywheel up` starts on `model` (0: only `urls`).",
    )
    engine_threads: int = Field(1, ge=0, description="torch threads per CPU teacher engine.")
    urls: list[str] = Field(
        default_factory=list,
        description="Teacher engines (SGLang's API) besides those `flywheel up` starts, e.g. "
        "the teacher Service in Kubernetes.",
    )
    api_key: SecretStr | None = Field(None, description="Bearer key of the teacher engines.")
    concurrency: int = Field(
        8, ge=1, le=1024, description="Scoring requests in flight at once per rollout worker."
    )
    timeout_s: float = Field(60.0, gt=0, description="Limit of one scoring request.")
    attempts: int = Field(
        3,
        ge=1,
        le=20,
        description="Tries per sample, each on the next teacher engine; then the sample is "
        "dead-lettered (reason 'teacher_failed') and the run goes on without it.",
    )
    retry_backoff_s: float = Field(0.5, ge=0, description="Pause before each further try.")

    @model_validator(mode="after")
    def _has_engines(self) -> TeacherSettings:
        if self.model is None and not self.urls:
            raise ValueError("a teacher needs a model (engines to start) or urls")
        return self


class TeacherFailed(FlywheelError, RuntimeError):
    """No teacher engine scored a sample within its tries; `reason` is the dead letter's."""

    reason = TEACHER_FAILED


@dataclass(frozen=True)
class TeacherScore:
    """A sample's teacher logprobs [R] and which teacher gave them."""

    logprobs: list[float]
    model: str
    version: int


class TeacherPool:
    """The teacher's engines, used round-robin under a concurrency limit."""

    def __init__(self, s: TeacherSettings, urls: list[str]) -> None:
        if not urls:
            raise ValueError("a teacher pool needs at least one engine url")
        self.s = s
        key = s.api_key.get_secret_value() if s.api_key else None
        # retries=0: a refused connection is one failed try here, and the next goes elsewhere
        self.clients = [
            EngineClient(u, timeout_s=s.timeout_s, retries=0, api_key=key) for u in urls
        ]
        self._turn = itertools.count()
        self._limit = asyncio.Semaphore(s.concurrency)
        self._who: dict[str, tuple[str, int]] = {}  # url -> (model, weight version)

    async def __aenter__(self) -> TeacherPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.clients:
            await c.close()

    async def _identity(self, c: EngineClient) -> tuple[str, int]:
        """The model and version an engine serves (asked once: a teacher is frozen)."""
        if c.url not in self._who:
            info: dict[str, Any] = await c.model_info()
            model = str(self.s.model) if self.s.model else str(info.get("model_path", "?"))
            self._who[c.url] = (model, from_engine(info.get("weight_version")))
        return self._who[c.url]

    async def score(self, prompt_ids: list[int], response_ids: list[int]) -> TeacherScore:
        """The teacher's logprob of each response token; TeacherFailed after every try."""
        first = next(self._turn)
        errors: list[str] = []
        async with self._limit:
            for attempt in range(self.s.attempts):
                if attempt:
                    await asyncio.sleep(self.s.retry_backoff_s)
                c = self.clients[(first + attempt) % len(self.clients)]
                try:
                    model, version = await self._identity(c)
                    lps = await c.prompt_logprobs(
                        prompt_ids + response_ids, len(prompt_ids) - 1, timeout_s=self.s.timeout_s
                    )
                except EngineError as e:
                    errors.append(f"{c.url}: {type(e).__name__}: {e}")
                    log.info("teacher: try %d on %s failed: %s", attempt + 1, c.url, e)
                    continue
                return TeacherScore(lps, model, version)
        raise TeacherFailed(
            f"teacher {self.s.name!r}: {self.s.attempts} tries failed; last: {errors[-1]}"
        )
