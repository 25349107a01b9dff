"""Wire errors. Every decode failure is a `ProtocolError` naming type and field.

`reason` is a short slug used as the dead-letter subject suffix
(`flywheel.<run>.dlq.<reason>`), so operators can subscribe per failure kind.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message could not be encoded or decoded under the wire contract."""

    reason = "protocol"

    def __init__(self, message: str, *, message_type: str = "?", field: str | None = None):
        self.message_type = message_type
        self.field = field
        where = f"{message_type}.{field}" if field else message_type
        super().__init__(f"{where}: {message}")


class MalformedMessage(ProtocolError):
    """The bytes are not a MessagePack map (truncated, garbage, wrong framing)."""

    reason = "malformed"


class SchemaViolation(ProtocolError):
    """A field is missing, has the wrong type, or breaks a bound."""

    reason = "schema"


class UnknownSchemaVersion(ProtocolError):
    """The message's major schema version is not one this reader knows."""

    reason = "version"


class WrongMessageType(ProtocolError):
    """The message is a valid message of another type than the one expected here."""

    reason = "wrong_type"


class MessageTooLarge(ProtocolError):
    """The encoded message exceeds the server's max_payload; chunk it instead."""

    reason = "too_large"

    def __init__(self, size: int, limit: int, *, message_type: str = "?"):
        self.size = size
        self.limit = limit
        super().__init__(
            f"encoded size {size} B exceeds max_payload {limit} B (split it with proto.chunking)",
            message_type=message_type,
        )
