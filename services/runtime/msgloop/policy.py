"""What to do with a message once its handler ran: the pure verdict table and the retry delay.

| outcome                                   | action                                   |
|-------------------------------------------|------------------------------------------|
| handler returned                          | ack                                      |
| `RetryableError`, NATS/timeout errors     | nak with a delay (backoff by delivery #) |
| the same on the last delivery             | dead-letter `max_deliver`, term          |
| `ProtocolError` (bad bytes, wrong schema) | dead-letter `<its reason>`, term         |
| `PermanentError`                          | dead-letter `<its reason>`, term         |
| any other exception (a bug)               | log traceback, dead-letter `handler_error`, term |

`decide()` is that table, tested without a server; the loop only carries
out its decisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from proto.errors import ProtocolError
from services.runtime.errors import PermanentError, RetryableError
from services.runtime.transient import TRANSIENT


class Action(StrEnum):
    ACK = "ack"
    NAK = "nak"
    DEAD_LETTER = "dead_letter"


@dataclass(frozen=True)
class Decision:
    action: Action
    delay_s: float = 0.0  # NAK: redeliver after this long
    reason: str = ""  # DEAD_LETTER: dlq subject suffix
    error: str = ""  # what went wrong, for the header/body and the log
    expected: bool = False  # DEAD_LETTER by design (PermanentError.expected): log at DEBUG


ACK = Decision(Action.ACK)
"""The success decision; a shared constant (frozen), not one allocation per message."""


@dataclass(frozen=True)
class RetryPolicy:
    """Nak delay = base·2^(delivered-1), capped: 1, 2, 4, … 60 s by default.

    Exponential so a downstream outage is not hammered by every worker at
    once; capped so a recovered dependency is noticed within a minute.
    """

    base_s: float = 1.0
    cap_s: float = 60.0

    def delay(self, delivered: int) -> float:
        return min(self.cap_s, self.base_s * 2.0 ** (max(delivered, 1) - 1))


DEFAULT_RETRY = RetryPolicy()


def decide(
    error: BaseException | None,
    delivered: int,
    max_deliver: int,
    policy: RetryPolicy = DEFAULT_RETRY,
    transient: tuple[type[BaseException], ...] = TRANSIENT,
) -> Decision:
    """What to do with a message after its handler ran.

    `delivered` is JetStream's delivery count (1 on first delivery);
    `max_deliver` the consumer's limit (<= 0: unlimited). On the last
    delivery a transient failure becomes a dead letter (a poison message):
    the server would never deliver it again, and nothing may vanish silently.
    """
    if error is None:
        return ACK
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, ProtocolError):
        return Decision(Action.DEAD_LETTER, reason=error.reason, error=text)
    if isinstance(error, PermanentError):
        return Decision(
            Action.DEAD_LETTER, reason=error.reason, error=text, expected=error.expected
        )
    if isinstance(error, (RetryableError, *transient)):
        if 0 < max_deliver <= delivered:
            return Decision(
                Action.DEAD_LETTER,
                reason="max_deliver",
                error=f"gave up after {delivered} deliveries; last error {text}",
            )
        override = error.delay_s if isinstance(error, RetryableError) else None
        delay = override if override is not None else policy.delay(delivered)
        return Decision(Action.NAK, delay_s=delay, error=text)
    return Decision(Action.DEAD_LETTER, reason="handler_error", error=text)
