"""What a handler may know about its message beyond the body."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from proto.messages import Message

if TYPE_CHECKING:
    from nats.aio.msg import Msg

M = TypeVar("M", bound=Message)


class Delivery:
    """The message's subject, headers, delivery count and stream sequence.

    Read lazily from the nats-py message: parsing the JetStream metadata out
    of the reply subject costs ~3 µs, a tenth of the loop's per-message
    budget, and most handlers never look at it.
    """

    __slots__ = ("_headers", "msg")

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self._headers: dict[str, str] | None = None

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def headers(self) -> dict[str, str]:
        """A copy of the message headers (a handler may change it freely)."""
        if self._headers is None:
            self._headers = dict(self.msg.headers or {})
        return self._headers

    @property
    def delivered(self) -> int:
        """JetStream's delivery count: 1 on the first delivery."""
        return int(self.msg.metadata.num_delivered)

    @property
    def stream_seq(self) -> int:
        return int(self.msg.metadata.sequence.stream)

    def __repr__(self) -> str:
        return (
            f"Delivery(subject={self.subject!r}, delivered={self.delivered}, "
            f"stream_seq={self.stream_seq})"
        )

    async def in_progress(self) -> None:
        """Tell JetStream the message is still being worked on (resets its ack wait)."""
        await self.msg.in_progress()


Handler = Callable[[M, Delivery], Awaitable[None]]
