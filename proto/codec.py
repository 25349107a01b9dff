"""MessagePack codec: encode, decode with validation, and message ids.

Framing: one NATS message body = one MessagePack map (`use_bin_type`, so
`bytes` fields are MessagePack bin and text is str). The map holds the
message's fields plus `type` and `schema_version`. Validation is pydantic's,
declared on the message classes; any failure becomes a ProtocolError
subclass naming the message type and the field.

Cost (4k-token Sample, 38 KB; measured on the 2-core dev box, see
bench/results_wire.md): msgpack's own pack + unpack is most of a round trip,
dominated by copying the packed arrays (the packer copies them into its
buffer and out, the unpacker into new `bytes`). The rest is pydantic's
validation (Rust, plus one Python call per cross-field check) and a few
Python-level checks kept off the common path: a per-thread reused
`Packer`, the validator called directly rather than via `model_validate`,
and the version parsed only when it is not exactly the current one.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from proto.errors import (
    MalformedMessage,
    MessageTooLarge,
    SchemaViolation,
    UnknownSchemaVersion,
    WrongMessageType,
)
from proto.messages import (
    MESSAGE_TYPES,
    SCHEMA_MAJOR,
    SCHEMA_VERSION,
    Chunk,
    CrossFieldError,
    DeadLetter,
    EngineHeartbeat,
    EvalRequest,
    EvalResult,
    Message,
    PromptTask,
    Sample,
    SampleGroup,
    TrainBatch,
    WeightsChunk,
    WeightsPublished,
    WeightsReady,
)

M = TypeVar("M", bound=Message)

DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""nats-server's default max_payload (1 MiB)."""


def _fields(obj: Any) -> dict[str, Any]:
    """msgpack's hook for nested models: their field map (plus `type` for messages).

    Cheaper than `model_dump` (measured ~4 µs for a Sample): the packer walks
    the field values itself and calls back only for nested models. The key
    order — the fields in declaration order, `type` last — is part of the
    golden bytes.
    """
    if isinstance(obj, Message):
        return {**(_wire_fields(obj) if obj.WIRE_KEYS else obj.__dict__), "type": obj.TYPE}
    if isinstance(obj, BaseModel):
        return obj.__dict__
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _wire_fields(msg: Message) -> dict[str, Any]:
    """Its fields by their wire names, in order (called only where a name differs)."""
    keys = msg.WIRE_KEYS
    return {keys.get(k, k): v for k, v in msg.__dict__.items()}


_KEEP_PACKER_BUFFER = 4 * 1024 * 1024
"""A packer whose buffer grew past this (a huge batch before chunking) is dropped."""

_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's Packer.

    Reused because `packb` builds a Packer, and allocates its buffer, per
    call (~0.3 µs of a ~3 µs 38 KB pack). Per thread because `pack` calls
    back into Python (`_fields`), where another thread could otherwise
    interleave with the same buffer. `pack` resets the buffer on an error.
    """
    packer: msgpack.Packer | None = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=_fields)
    return packer


def encode(msg: Message, max_payload: int | None = DEFAULT_MAX_PAYLOAD) -> bytes:
    """Encode `msg`; raise MessageTooLarge if it would exceed `max_payload`.

    Pass `max_payload=None` to skip the check (e.g. before chunking).
    """
    if not isinstance(msg, Message):
        raise TypeError(f"cannot encode {type(msg).__name__}")
    fields = _wire_fields(msg) if msg.WIRE_KEYS else msg.__dict__
    data: bytes = _packer().pack({**fields, "type": msg.TYPE})
    if len(data) > _KEEP_PACKER_BUFFER:
        _local.packer = None  # do not keep a buffer that large per thread
    if max_payload is not None and len(data) > max_payload:
        raise MessageTooLarge(len(data), max_payload, message_type=msg.TYPE)
    return data


_UNPACK_ERRORS = (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)


def _unpack(data: bytes, expected: str) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except _UNPACK_ERRORS as e:
        raise MalformedMessage(f"not MessagePack ({e})", message_type=expected) from e
    if type(body) is not dict:
        raise MalformedMessage(f"expected a map, got {type(body).__name__}", message_type=expected)
    return body


def _check_version(body: dict[str, Any], type_name: str) -> None:
    version = body.get("schema_version")
    if version == SCHEMA_VERSION:  # the common case, without parsing
        return
    if not isinstance(version, str):
        raise SchemaViolation(
            "missing or non-string", message_type=type_name, field="schema_version"
        )
    major, _, _minor = version.partition(".")
    if major != str(SCHEMA_MAJOR):
        raise UnknownSchemaVersion(
            f"major version {major!r} is not supported (this reader knows {SCHEMA_MAJOR}.x)",
            message_type=type_name,
            field="schema_version",
        )


def _validate(cls: type[M], body: dict[str, Any]) -> M:
    """pydantic validation of the whole tree (nested messages included).

    The validator is called directly: `model_validate` only adds keyword
    plumbing (~0.3 µs a call) for options we do not use.
    """
    try:
        return cls.__pydantic_validator__.validate_python(body)
    except ValidationError as e:
        raise _schema_violation(cls, e) from e


def _schema_violation(cls: type[Message], e: ValidationError) -> SchemaViolation:
    """The first of pydantic's errors, naming the field (`samples.0.loss_mask`)."""
    first = e.errors()[0]
    loc = first["loc"]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, CrossFieldError):  # a model-level check names its field
        loc = (*loc, cause.field)
    field = ".".join(str(p) for p in loc) or None
    return SchemaViolation(first["msg"], message_type=cls.TYPE, field=field)


def decode(data: bytes, cls: type[M]) -> M:
    """Decode and validate bytes as a `cls` message.

    The steps of `decode_any`, inlined: on the hot path of every consumer
    (the message loop), where each Python call is ~0.1 µs on a loaded box.
    """
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except _UNPACK_ERRORS as e:
        raise MalformedMessage(f"not MessagePack ({e})", message_type=cls.TYPE) from e
    if type(body) is not dict:
        raise MalformedMessage(f"expected a map, got {type(body).__name__}", message_type=cls.TYPE)
    type_name = body.get("type")
    if type_name != cls.TYPE:
        raise WrongMessageType(f"got a {type_name!r} message", message_type=cls.TYPE, field="type")
    if body.get("schema_version") != SCHEMA_VERSION:
        _check_version(body, cls.TYPE)
    try:
        return cls.__pydantic_validator__.validate_python(body)
    except ValidationError as e:
        raise _schema_violation(cls, e) from e


def decode_any(data: bytes) -> Message:
    """Decode a message of any known type (tools, dead-letter inspection)."""
    body = _unpack(data, "?")
    type_name = body.get("type")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise WrongMessageType(f"unknown message type {type_name!r}", field="type")
    _check_version(body, cls.TYPE)
    return _validate(cls, body)


def peek_type(data: bytes) -> str:
    """The `type` of encoded bytes, or "?" if they are not a readable message."""
    try:
        body = _unpack(data, "?")
    except MalformedMessage:
        return "?"
    t = body.get("type")
    return t if isinstance(t, str) else "?"


def message_id(msg: Message) -> str | None:
    """The deterministic `Nats-Msg-Id` of a message (None: not de-duplicated).

    JetStream drops a second publish with the same id inside the stream's
    duplicate window, which is what makes at-least-once publishing safe.
    """
    match msg:
        case PromptTask():  # not its group's id: ids must be unique across types
            return f"task:{msg.task_id}:a{msg.attempt}"
        case SampleGroup():
            return msg.group_id
        case Sample():
            return msg.sample_id
        case TrainBatch():
            return msg.batch_id
        case WeightsPublished():
            return f"{msg.run}:weights:v{msg.version}"
        case WeightsReady():
            return f"{msg.run}:ready:v{msg.version}"
        case EvalRequest():
            return f"{msg.run}:evaluate:{msg.split}:v{msg.version}"
        case EvalResult():
            return f"{msg.run}:evaluated:{msg.split}:v{msg.version}"
        case Chunk():
            return f"{msg.of}:c{msg.index}"
        case WeightsChunk():
            return f"{msg.run}:wchunk:v{msg.version}:{msg.sha256[:16]}:{msg.index}"
        case DeadLetter() | EngineHeartbeat():
            return None
    raise TypeError(f"no message id rule for {type(msg).__name__}")
