"""MessagePack codec: encode, decode with validation, and message ids.

Framing: one NATS message body = one MessagePack map (`use_bin_type`, so
`bytes` fields are MessagePack bin and text is str). The map holds the
message's fields plus `type` and `schema_version`. Validation is pydantic's,
declared on the message classes; any failure becomes a ProtocolError
subclass naming the message type and the field.
"""

from __future__ import annotations

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
    Chunk,
    DeadLetter,
    EngineHeartbeat,
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
    the field values itself and calls back only for nested models.
    """
    if isinstance(obj, Message):
        return {**obj.__dict__, "type": obj.TYPE}
    if isinstance(obj, BaseModel):
        return obj.__dict__
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(msg: Message, max_payload: int | None = DEFAULT_MAX_PAYLOAD) -> bytes:
    """Encode `msg`; raise MessageTooLarge if it would exceed `max_payload`.

    Pass `max_payload=None` to skip the check (e.g. before chunking).
    """
    data = msgpack.packb(_fields(msg), use_bin_type=True, default=_fields)
    if max_payload is not None and len(data) > max_payload:
        raise MessageTooLarge(len(data), max_payload, message_type=msg.TYPE)
    return data


def _unpack(data: bytes, expected: str) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise MalformedMessage(f"not MessagePack ({e})", message_type=expected) from e
    if not isinstance(body, dict):
        raise MalformedMessage(f"expected a map, got {type(body).__name__}", message_type=expected)
    return body


def _check_version(body: dict[str, Any], type_name: str) -> None:
    version = body.get("schema_version")
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
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise SchemaViolation(first["msg"], message_type=cls.TYPE, field=field) from e


def decode(data: bytes, cls: type[M]) -> M:
    """Decode and validate bytes as a `cls` message."""
    body = _unpack(data, cls.TYPE)
    type_name = body.get("type")
    if type_name != cls.TYPE:
        raise WrongMessageType(f"got a {type_name!r} message", message_type=cls.TYPE, field="type")
    _check_version(body, cls.TYPE)
    return _validate(cls, body)


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
        case Chunk():
            return f"{msg.of}:c{msg.index}"
        case WeightsChunk():
            return f"{msg.run}:wchunk:v{msg.version}:{msg.sha256[:16]}:{msg.index}"
        case DeadLetter() | EngineHeartbeat():
            return None
    raise TypeError(f"no message id rule for {type(msg).__name__}")
