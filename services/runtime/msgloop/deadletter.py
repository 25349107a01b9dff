"""Dead letters: the one publisher every service uses, and the message it builds.

A dead letter goes to `flywheel.<run>.dlq.<reason>` with `Flywheel-Dlq-Reason`
/ `Flywheel-Dlq-Error` headers and a `DeadLetter` body that keeps the
original bytes (cut, and saying where the original lies, only when they
would not fit in one NATS message).

Its `Nats-Msg-Id` is `dlq:<origin>`, the origin naming what was refused:
for a stream message `<stream>:<consumer>:<sequence>` (`stored_origin`),
otherwise whatever the service names it by (the buffer: the task id of a
row it could not turn into a task). A crash between the publish and the
message's term() redelivers the message, and every worker of a consumer
hears the same max-deliveries advisory: the id stores each dead letter
once. The consumer is part of it because two consumers of one stream may
each refuse the same message for their own reasons.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from proto.codec import encode, peek_type
from proto.messages import DeadLetter
from proto.subjects import Subjects
from services.runtime.missing import no_answer_errors, raise_if_subject_unstored

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

REASON_HEADER = "Flywheel-Dlq-Reason"
ERROR_HEADER = "Flywheel-Dlq-Error"
MAX_HEADER_ERROR = 512  # header values are single-line and should stay small


def header_safe(text: str, limit: int = MAX_HEADER_ERROR) -> str:
    """One line, bounded: NATS headers cannot carry CR/LF."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def dead_letter(
    *,
    run: str,
    reason: str,
    error: str,
    subject: str,
    payload: bytes,
    service: str,
    delivered: int,
    max_payload: int,
    where: str = "",
) -> tuple[DeadLetter, bytes]:
    """Build and encode a DeadLetter that fits in `max_payload`.

    The original bytes travel unchanged unless they would not fit (a message
    near max_payload plus the envelope); then they are cut and the error
    says so and where the original lies (`where`: stream and sequence).
    """
    dl = DeadLetter(
        run=run,
        reason=reason,
        error=error,
        subject=subject,
        message_type=peek_type(payload),
        payload=payload,
        service=service,
        delivered=delivered,
        at=time.time(),
    )
    data = encode(dl, max_payload=None)
    if len(data) <= max_payload:
        return dl, data
    room = max_payload - (len(data) - len(payload)) - 256  # 256: the longer error text
    note = f" [payload truncated from {len(payload)} B to {room} B; original at {where or '?'}]"
    dl = dl.model_copy(update={"payload": payload[: max(room, 0)], "error": error + note})
    return dl, encode(dl, max_payload=max_payload)


def stored_origin(stream: str, consumer: str, seq: int) -> str:
    """The origin of a stream message as its consumer saw it (module docstring)."""
    return f"{stream}:{consumer}:{seq}"


class DeadLetterPublisher:
    """Publishes one service's dead letters and counts them by reason.

    `subject` labels the count (`flywheel_messages_dead_lettered_total`):
    the subject the service consumes, as the message loop labels its
    other counters.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        run: str,
        service: str,
        max_payload: int,
        registry: CollectorRegistry,
        subject: str,
    ) -> None:
        from services.runtime.msgloop.metrics import LoopMetrics

        self.js = js
        self.run = run
        self.service = service
        self.max_payload = max_payload
        self.subjects = Subjects(run)
        self._counter = LoopMetrics.for_registry(registry).dead_lettered
        self._labels = {"service": service, "subject": subject}
        self._by_reason: dict[str, Counter] = {}  # resolved once per reason

    async def publish(
        self,
        *,
        reason: str,
        error: str,
        subject: str,
        payload: bytes,
        delivered: int,
        origin: str,
        where: str = "",
        expected: bool = False,
    ) -> None:
        """Dead-letter `payload` (which came on `subject`) as `reason`; raises if NATS fails."""
        _, data = dead_letter(
            run=self.run,
            reason=reason,
            error=error,
            subject=subject,
            payload=payload,
            service=self.service,
            delivered=delivered,
            max_payload=self.max_payload,
            where=where or origin,
        )
        log.log(
            logging.DEBUG if expected else logging.WARNING,
            "%s: dead-lettering %s (%s) as %s: %s",
            self.service,
            subject,
            where or origin,
            reason,
            error,
        )
        headers = {
            REASON_HEADER: reason,
            ERROR_HEADER: header_safe(error),
            "Nats-Msg-Id": f"dlq:{origin}",
        }
        to = self.subjects.dlq(reason)
        try:
            await self.js.publish(to, data, headers=headers)
        except no_answer_errors():  # NATS away, or the DLQ stream gone (then: stop)
            await raise_if_subject_unstored(self.js, to, f"dead-lettering to {to}")
            raise
        self._count(reason)

    def _count(self, reason: str) -> None:
        child = self._by_reason.get(reason)
        if child is None:
            child = self._by_reason[reason] = self._counter.labels(**self._labels, reason=reason)
        child.inc()
