"""Flywheel's wire contract: messages, codec, subjects, streams. No torch, no NATS client.

See proto/README.md for the format, written so that a client in another
language can be built from it alone.
"""

from proto.codec import decode, decode_any, encode, message_id
from proto.errors import ProtocolError
from proto.messages import SCHEMA_VERSION

__all__ = ["SCHEMA_VERSION", "ProtocolError", "decode", "decode_any", "encode", "message_id"]
