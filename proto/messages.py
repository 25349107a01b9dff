"""Message types of the wire contract.

Every message is a MessagePack map. Besides its own fields it carries
`type` (the class name, so a message on the wrong subject is named, not
mis-parsed) and `schema_version` ("MAJOR.MINOR"). Readers reject a MAJOR
they do not know and ignore unknown fields (a newer MINOR may add some).

Per-token data travels as packed little-endian arrays in `bytes` fields,
not as lists: token ids `<i4`, logprobs `<f4`, loss masks `u1`. Measured
(bench/wire.py): encode+decode of a 4k-token sample is ~10 µs as bytes vs
~400 as lists. `pack_*` / `unpack_*` convert; validation checks sizes line up.

Ids are deterministic so that redelivery is idempotent end to end:
task `"{run}:e{epoch}:i{index}"`, group = its task id plus attempt
(`"{task}:a{attempt}"`), sample `"{group}:s{index}"`, batch `"{run}:step{step}"`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from proto.weight_version import Version, VersionSpan
from proto.wirecost import WireCost

SCHEMA_MAJOR = 1
SCHEMA_MINOR = 2  # 1.1: Sample.weight_version_spans; 1.2: Sample.teacher_logprobs, teacher
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.{SCHEMA_MINOR}"

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")
U8 = np.dtype("u1")


def _multiple_of(width: int):
    def check(b: bytes) -> bytes:
        if len(b) % width:
            raise ValueError(f"packed array length {len(b)} is not a multiple of {width}")
        return b

    return AfterValidator(check)


PackedI32 = Annotated[bytes, _multiple_of(4)]
"""Little-endian int32 array (token ids)."""
PackedF32 = Annotated[bytes, _multiple_of(4)]
"""Little-endian float32 array (logprobs)."""
PackedU8 = bytes
"""uint8 array (loss mask: 1 = trained on, 0 = prompt/tool/env token)."""


def pack_i32(values: Any) -> bytes:
    return np.asarray(values, dtype=I32).tobytes()


def pack_f32(values: Any) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def pack_u8(values: Any) -> bytes:
    return np.asarray(values, dtype=U8).tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=I32)


def unpack_f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=F32)


def unpack_u8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=U8)


class CrossFieldError(ValueError):
    """A check across fields failed; `field` names the field at fault.

    A model validator's errors carry no field in pydantic's location; the
    codec reports `field` instead, so the ProtocolError names the field.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check_finite(logprobs: bytes, field: str = "logprobs") -> None:
    """Every logprob finite. One NaN or infinity, even on a token the loss mask drops
    (weight 0 · NaN = NaN), turns a train step's loss and every parameter into NaN, so
    it is refused where it enters: the sample (the buffer dead-letters its group, the
    trainer a batch that carries it), naming the field."""
    lp = unpack_f32(logprobs)
    if lp.size and not np.isfinite(lp).all():
        bad = int(np.flatnonzero(~np.isfinite(lp))[0])
        raise CrossFieldError(field, f"logprob of response token {bad} is {float(lp[bad])}")


Id = Annotated[str, Field(min_length=1, max_length=512)]


class Message(BaseModel):
    """Base of every wire message.

    A field may have another name on the wire than in Python (`task_name`,
    `env` on the wire since 1.0): its `validation_alias` is the wire's name,
    which decoding reads and the codec writes (`WIRE_KEYS`), so the bytes do
    not change when only the Python name does.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, strict=False, populate_by_name=True)

    TYPE: ClassVar[str] = ""
    WIRE_KEYS: ClassVar[dict[str, str]] = {}  # Python name -> wire name, where they differ
    schema_version: str = SCHEMA_VERSION

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = cls.__name__

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.WIRE_KEYS = {
            name: f.validation_alias
            for name, f in cls.model_fields.items()
            if isinstance(f.validation_alias, str)
        }


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string/token
    LENGTH = "length"  # hit max_new_tokens (a truncated completion)
    ABORT = "abort"  # aborted by the engine (e.g. a weight update)


class SamplingParams(BaseModel):
    """The subset of SGLang's sampling_params a task fixes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    max_new_tokens: int = Field(64, ge=1)
    stop: tuple[str, ...] = ()


class PromptTask(Message):
    """One prompt to roll out `n` times. Published by the buffer to `tasks`."""

    run: Id
    task_id: Id
    epoch: int = Field(ge=0)
    index: int = Field(ge=0, description="Row of the task's source (the same in every service).")
    task_name: Id = Field(
        validation_alias="env",
        description="The task's name in the run file's task spec, e.g. 'jsonl' (`env` on the "
        "wire). A PromptTask is one unit of work of that task: one prompt, `n` completions.",
    )
    prompt: str | None = Field(None, description="Prompt text (or chat-templated by the worker).")
    messages: tuple[dict[str, str], ...] | None = Field(None, description="Chat messages.")
    prompt_ids: PackedI32 | None = Field(None, description="Pre-tokenised prompt (<i4).")
    answer: str | None = Field(None, description="Ground truth for the verifier.")
    n: int = Field(ge=1, le=4096, description="Completions per prompt (the group size).")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    min_weight_version: Version = Field(
        0, description="Oldest weight version allowed to serve this task (staleness bound)."
    )
    attempt: int = Field(0, ge=0, description="Re-dispatch counter of the same prompt.")
    created_at: float = Field(0.0, description="Unix time the buffer dispatched it.")

    @model_validator(mode="after")
    def _has_prompt(self) -> PromptTask:
        if self.prompt is None and self.messages is None and self.prompt_ids is None:
            raise ValueError("one of prompt, messages or prompt_ids is required")
        return self


class TeacherId(BaseModel):
    """Which teacher scored a sample (on-policy distillation, since schema 1.2)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Id = Field(description="The run file's [teacher] name.")
    model: str = Field(min_length=1, max_length=1024, description="The teacher's model.")
    version: Version = Field(0, description="The weight version its engine served.")


class Sample(Message):
    """One completion with everything the trainer and the accounting need."""

    sample_id: Id
    group_id: Id
    task_id: Id
    index: int = Field(ge=0, description="Index of this completion within its group.")
    attempt: int = Field(0, ge=0)
    prompt_ids: PackedI32
    response_ids: PackedI32
    logprobs: PackedF32 = Field(description="Rollout (behaviour) logprob of each response token.")
    loss_mask: PackedU8 = Field(description="1 per response token trained on, 0 for env tokens.")
    reward: float = Field(allow_inf_nan=False)
    reward_parts: dict[str, float] = Field(default_factory=dict)
    finish_reason: FinishReason
    weight_version: Version = Field(description="Version of the first generated token.")
    weight_version_last: Version = Field(description="Version of the last generated token.")
    weight_version_spans: tuple[VersionSpan, ...] = Field(
        (),
        description="Which version generated which response tokens, in order, covering them "
        "all (first = weight_version, last = weight_version_last); () when the engine does "
        "not report it (SGLang before 0.5.19). Since schema 1.1.",
    )
    engine_id: Id
    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    verifier_error: str | None = Field(
        None,
        description="Why the reward could not be computed (then reward is 0 and the sample "
        "is never trained on: the buffer leaves it out of its group).",
    )

    teacher_logprobs: PackedF32 | None = Field(
        None,
        description="The teacher's logprob of each response token (on-policy distillation: "
        "log p_teacher(token | the tokens before it)); None when no teacher scored it. Since "
        "schema 1.2; a 1.1 reader ignores it (and trains on the task reward alone).",
    )
    teacher: TeacherId | None = Field(
        None, description="The teacher that gave teacher_logprobs (since schema 1.2)."
    )

    @model_validator(mode="after")
    def _aligned(self) -> Sample:
        n = len(self.response_ids) // 4
        if len(self.logprobs) // 4 != n:
            raise CrossFieldError(
                "logprobs", f"logprobs has {len(self.logprobs) // 4} entries, expected {n}"
            )
        if len(self.loss_mask) != n:
            raise CrossFieldError(
                "loss_mask", f"loss_mask has {len(self.loss_mask)} entries, expected {n}"
            )
        if self.weight_version_last < self.weight_version:
            raise CrossFieldError("weight_version_last", "weight_version_last < weight_version")
        if self.weight_version_spans:
            _check_spans(
                self.weight_version_spans, n, self.weight_version, self.weight_version_last
            )
        _check_finite(self.logprobs)
        if self.teacher_logprobs is not None:
            if len(self.teacher_logprobs) // 4 != n:
                raise CrossFieldError(
                    "teacher_logprobs",
                    f"teacher_logprobs has {len(self.teacher_logprobs) // 4} entries, expected {n}",
                )
            if self.teacher is None:
                raise CrossFieldError("teacher", "teacher_logprobs without the teacher's identity")
            _check_finite(self.teacher_logprobs, "teacher_logprobs")
        return self

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids) // 4


def _check_spans(spans: tuple[VersionSpan, ...], n: int, first: int, last: int) -> None:
    """Spans cover tokens 0..n in order, with non-decreasing versions from first to last."""
    at = 0
    for sp in spans:
        if sp.start != at or sp.end < sp.start:
            raise CrossFieldError("weight_version_spans", f"span {sp} does not start at {at}")
        at = sp.end
    if at != n:
        raise CrossFieldError("weight_version_spans", f"spans cover {at} tokens, expected {n}")
    versions = [sp.version for sp in spans]
    if versions != sorted(versions) or (versions[0], versions[-1]) != (first, last):
        raise CrossFieldError(
            "weight_version_spans",
            f"span versions {versions} must rise from weight_version {first} to "
            f"weight_version_last {last}",
        )


class SampleGroup(Message):
    """All `n` completions of one task attempt. Published by rollout to `samples`."""

    run: Id
    group_id: Id
    task_id: Id
    task_name: Id = Field(validation_alias="env", description="Its PromptTask's task_name.")
    worker_id: Id
    samples: tuple[Sample, ...] = Field(min_length=1)
    temperature: float = Field(
        1.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Sampling temperature; the trainer's logprobs use the same.",
    )
    created_at: float = 0.0

    @property
    def weight_version(self) -> int:
        """The oldest weight version any of its tokens came from."""
        return min(s.weight_version for s in self.samples)


class TrainBatch(Message):
    """The groups of one optimizer step. Published by the buffer to `batches`.

    A batch larger than max_payload travels as chunks (proto.chunking).
    """

    run: Id
    batch_id: Id
    step: int = Field(ge=0)
    groups: tuple[SampleGroup, ...] = Field(min_length=1)
    created_at: float = 0.0


class WeightsPublished(Message):
    """The trainer wrote weight version `version` at `uri`."""

    run: Id
    version: Version
    step: int = Field(ge=0)
    uri: str = Field(min_length=1, description="Where it is (per transport: proto/README.md).")
    # "peft-lora": the version is a LoRA adapter of the run's base model (PEFT's layout),
    # which engines load by name (proto/weight_version.adapter_name) beside the base.
    format: Literal["hf-safetensors", "peft-lora"] = "hf-safetensors"
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)
    published_at: float = 0.0
    wire: WireCost | None = None  # what it cost on the wire (None: nothing was sent)


class WeightsReady(Message):
    """Every live engine serves `version`. Published by sync."""

    run: Id
    version: Version
    engines: tuple[Id, ...] = ()
    ready_at: float = 0.0


Split = Literal["validation", "test"]


class EvalRequest(Message):
    """Evaluate weight version `version` on the held-out `split`, on the engines.

    Published by the trainer when `[trainer] eval_every` makes a version due (before its
    WeightsPublished, so sync knows before any engine loads it); sync holds an engine at
    `version` until the evaluation is done and answers with one EvalResult.
    """

    run: Id
    version: Version
    split: Split = "validation"
    requested_at: float = 0.0


class TaskEvalResult(BaseModel):
    """One task's figures in an EvalResult (greedy pass@1; pass@k where eval.k > 1)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: Id = Field(description="The task's name in the run file.")
    total: int = Field(ge=0, description="Held-out rows evaluated.")
    pass_at_1: float = Field(ge=0.0, le=1.0, allow_inf_nan=False)
    mean_reward: float = Field(allow_inf_nan=False)
    k: int = Field(1, ge=1)
    pass_at_k: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)


class EvalResult(Message):
    """What became of an EvalRequest: the figures of `version`, every answer counted generated
    by exactly that version (the engine's `weight_version` of each response, checked), or why
    there are none. Published by sync."""

    run: Id
    version: Version
    split: Split = "validation"
    outcome: Literal["evaluated", "skipped", "aborted"] = Field(
        description="evaluated: `tasks` hold the figures; skipped: no engine served the "
        "version (they went past it before it could be evaluated); aborted: it started but "
        "could not finish on that version (an engine moved on, failed or timed out)."
    )
    reason: str = Field("", max_length=2048, description="Why skipped or aborted, in words.")
    tasks: tuple[TaskEvalResult, ...] = ()
    engines: tuple[Id, ...] = Field((), description="The engines that generated the answers.")
    requested_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0

    @model_validator(mode="after")
    def _figures_iff_evaluated(self) -> EvalResult:
        if self.outcome == "evaluated" and not self.tasks:
            raise CrossFieldError("tasks", "an evaluated result carries at least one task")
        if self.outcome != "evaluated" and self.tasks:
            raise CrossFieldError("tasks", f"a result {self.outcome} carries no figures")
        return self


class EngineHeartbeat(Message):
    """An engine's state, sent by the rollout worker beside it."""

    run: Id
    engine_id: Id
    url: str = Field(min_length=1)
    worker_id: Id
    weight_version: Version
    running: int = Field(0, ge=0, description="Requests being generated.")
    queued: int = Field(0, ge=0, description="Requests waiting.")
    sent_at: float = 0.0
    local_weights_dir: str | None = Field(
        None,
        description="Engine-local directory where the worker writes weights received over "
        "NATS (<dir>/v000012/); None: the engine reads the shared weights directory.",
    )
    downloaded_version: Version | None = Field(
        None, description="Newest version complete and verified in local_weights_dir."
    )


class DeadLetter(Message):
    """A message a service could not process, with the reason. Never dropped silently."""

    run: Id
    reason: Id = Field(description="Slug, also the dlq subject suffix.")
    error: str
    subject: str
    message_type: str = "?"
    payload: bytes = Field(description="The original bytes, unchanged.")
    service: str
    delivered: int = Field(0, ge=0, description="Delivery count when it was given up.")
    at: float = 0.0


class Chunk(Message):
    """Part `index` of `count` of one oversized encoded message (proto.chunking)."""

    of: Id = Field(description="Message id of the whole message.")
    index: int = Field(ge=0)
    count: int = Field(ge=1)
    total_size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Of the whole encoded message.")
    data: bytes

    @model_validator(mode="after")
    def _in_range(self) -> Chunk:
        if self.index >= self.count:
            raise ValueError(f"index {self.index} >= count {self.count}")
        return self


class WeightsChunk(Message):
    """Bytes `[offset, offset + len(data))` of one file of weight version `version`.

    The NATS weights transport (services/weights/nats.py): the trainer
    publishes every file of the weights directory, manifest first, as
    `count` chunks on `weightdata.v<version>`; a receiver has the version
    once it holds all `count` indices, then checks the files against the
    manifest and the manifest's digest against `sha256`.
    """

    run: Id
    version: Version
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Directory digest (manifest).")
    file: str = Field(min_length=1, max_length=1024, description="Path relative to the dir.")
    offset: int = Field(ge=0, description="Byte offset of `data` in the file.")
    index: int = Field(ge=0, description="Chunk number within the version, 0-based.")
    count: int = Field(ge=1, description="Chunks of the whole version.")
    data: bytes

    @model_validator(mode="after")
    def _in_range(self) -> WeightsChunk:
        if self.index >= self.count:
            raise ValueError(f"index {self.index} >= count {self.count}")
        parts = self.file.split("/")
        if self.file.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"file {self.file!r} must be a plain relative path")
        return self


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        PromptTask,
        Sample,
        SampleGroup,
        TrainBatch,
        WeightsPublished,
        WeightsReady,
        EvalRequest,
        EvalResult,
        EngineHeartbeat,
        DeadLetter,
        Chunk,
        WeightsChunk,
    )
}
