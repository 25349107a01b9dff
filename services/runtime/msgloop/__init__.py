"""The message loop every service runs on a JetStream durable pull consumer, by job.

fetch a batch → decode each message into the expected proto type → call the
service's handler → act on the outcome (`policy.decide`: ack, nak with a
delay, or dead-letter with a reason). Errors are caught there, once per
message, so one bad message never stops a service: it goes to
`flywheel.<run>.dlq.<reason>` (`deadletter`, the one publisher every
service uses) and the loop goes on. If the dead-letter publish itself
fails (NATS down), the message is nak'ed instead of terminated, so it is
never dropped silently.

- `policy`      the pure verdict table and retry delays; which errors are transient;
- `deadletter`  the DeadLetter message and the one publisher (its message ids);
- `delivery`    what a handler knows about its message;
- `heartbeats`  in-progress acks for long handlers;
- `metrics`     the loop's Prometheus counters;
- `loop`        `MessageLoop`, which ties them together;
- `wait`        `pause`: how every other service loop sleeps (stop, wake, timeout).
"""

from services.runtime.msgloop.deadletter import (
    ERROR_HEADER,
    REASON_HEADER,
    DeadLetterPublisher,
    dead_letter,
    header_safe,
    stored_origin,
)
from services.runtime.msgloop.delivery import Delivery, Handler
from services.runtime.msgloop.heartbeats import Heartbeats
from services.runtime.msgloop.loop import MessageLoop
from services.runtime.msgloop.metrics import LoopMetrics
from services.runtime.msgloop.policy import (
    ACK,
    Action,
    Decision,
    RetryPolicy,
    decide,
)
from services.runtime.msgloop.wait import pause
from services.runtime.transient import TRANSIENT, transient_errors

__all__ = [
    "ACK",
    "ERROR_HEADER",
    "REASON_HEADER",
    "TRANSIENT",
    "Action",
    "DeadLetterPublisher",
    "Decision",
    "Delivery",
    "Handler",
    "Heartbeats",
    "LoopMetrics",
    "MessageLoop",
    "RetryPolicy",
    "dead_letter",
    "decide",
    "header_safe",
    "pause",
    "stored_origin",
    "transient_errors",
]
