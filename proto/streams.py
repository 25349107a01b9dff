"""JetStream streams and consumers, as data.

Services create these idempotently at start-up (services.runtime.nats_conn);
a client in another language creates the same from proto/README.md.

- TASKS is a work queue: each task is delivered to one rollout worker and
  removed when acked; unacked tasks are redelivered after `ack_wait`
  (workers send in-progress acks during long generations).
- SAMPLES, BATCHES, WEIGHTS and DLQ keep history (limits retention) so a
  restarted consumer can resume by sequence and runs can be audited.
- ENGINES keeps one heartbeat per engine subject: the latest state.
- WEIGHTDATA carries weight versions as WeightsChunks (the NATS weights
  transport), one subject per version. Sync purges the subjects of
  versions older than its `keep_last`; `max_age_s` is the backstop.
- ADVISORIES keeps the server's max-deliveries advisories of the run's
  consumers (JSON, written by nats-server, not by Flywheel): a message the
  server gave up redelivering is noted here even when no service is up to
  hear it, and each service dead-letters its own from a durable consumer
  (`advisory_consumer`; docs/RELIABILITY.md says why a stream and not a
  reconcile at start-up). A work queue: an advisory handled is removed.
Every stream de-duplicates on `Nats-Msg-Id` within `duplicate_window_s`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from proto.subjects import Subjects

Retention = Literal["limits", "workqueue", "interest"]

DAY = 24 * 3600


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: Retention = "limits"
    max_age_s: float = 7 * DAY  # 0: kept for ever
    max_bytes: int = -1  # -1: no size limit (the oldest messages go first past it)
    duplicate_window_s: float = 2 * 3600
    max_msg_size: int = -1  # -1: the server's max_payload
    max_msgs_per_subject: int = -1
    storage: Literal["file", "memory"] = "file"


@dataclass(frozen=True)
class ConsumerSpec:
    durable: str
    stream: str
    filter_subject: str
    ack_wait_s: float = 60.0
    max_deliver: int = 5
    max_ack_pending: int = 1000
    backoff_s: tuple[float, ...] = ()


def stream_name(run: str, what: str) -> str:
    # Stream names may not contain '.', '*', '>' or spaces; run names cannot.
    return f"FLYWHEEL_{run}_{what}"


MAX_DELIVERIES_PREFIX = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"
"""nats-server's advisory subject for a message past its consumer's max_deliver:
`<prefix>.<stream>.<consumer>`, a JSON body with `stream_seq` and `deliveries`."""

# The streams whose consumers' max-deliveries advisories ADVISORIES keeps.
_CONSUMED = ("TASKS", "SAMPLES", "BATCHES", "WEIGHTS", "DLQ")


def max_deliveries_subject(stream: str, consumer: str) -> str:
    """The advisory subject of one consumer (`*` for every consumer of `stream`)."""
    return f"{MAX_DELIVERIES_PREFIX}.{stream}.{consumer}"


HISTORY_MAX_AGE_S = 7 * DAY
"""How long SAMPLES and BATCHES keep a message by default: a run's recording, which
`flywheel replay` reads back (deployments choose: `[nats] history_max_age_s`)."""


def streams_for(
    run: str, *, history_max_age_s: float = HISTORY_MAX_AGE_S, history_max_bytes: int = -1
) -> list[StreamSpec]:
    """The run's streams; SAMPLES and BATCHES keep `history_max_age_s` (0: for ever) and
    at most `history_max_bytes` each (-1: no limit), the oldest messages going first."""
    s = Subjects(run)
    age, size = history_max_age_s, history_max_bytes
    return [
        StreamSpec(stream_name(run, "TASKS"), (s.tasks,), retention="workqueue"),
        StreamSpec(stream_name(run, "SAMPLES"), (s.samples,), max_age_s=age, max_bytes=size),
        StreamSpec(stream_name(run, "BATCHES"), (s.batches,), max_age_s=age, max_bytes=size),
        StreamSpec(stream_name(run, "WEIGHTS"), (s.weights_all,)),
        StreamSpec(
            stream_name(run, "ENGINES"),
            (s.heartbeats_all,),
            max_age_s=3600,
            max_msgs_per_subject=1,
            duplicate_window_s=60,
        ),
        StreamSpec(stream_name(run, "DLQ"), (s.dlq_all,), max_age_s=30 * DAY),
        StreamSpec(
            stream_name(run, "WEIGHTDATA"),
            (s.weightdata_all,),
            max_age_s=DAY,
            duplicate_window_s=600,
        ),
        StreamSpec(
            stream_name(run, "ADVISORIES"),
            tuple(max_deliveries_subject(stream_name(run, w), "*") for w in _CONSUMED),
            retention="workqueue",
            max_age_s=30 * DAY,
        ),
    ]


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def stream_of(subject: str) -> str | None:
    """The stream that stores `subject`, by proto's definitions: a run's subject
    (`flywheel.<run>.…`) its run's stream, a key of bucket B (`$KV.B.…`) `KV_B`;
    None for a subject no Flywheel stream takes (a core request subject)."""
    parts = subject.split(".")
    if len(parts) >= 3 and parts[0] == "$KV":
        return f"KV_{parts[1]}"
    if len(parts) < 3 or parts[0] != "flywheel":
        return None
    try:
        specs = streams_for(parts[1])
    except ValueError:  # not a run name
        return None
    for spec in specs:
        if any(subject_matches(p, subject) for p in spec.subjects):
            return spec.name
    return None


NATS_WEIGHTS_SCHEME = "nats"


def weights_nats_uri(run: str, version: int) -> str:
    """The `WeightsPublished.uri` of a version sent over NATS: `nats://<stream>/<version>`."""
    return f"{NATS_WEIGHTS_SCHEME}://{stream_name(run, 'WEIGHTDATA')}/{version}"


def parse_weights_nats_uri(uri: str) -> tuple[str, int]:
    """(stream, version) of a `nats://<stream>/<version>` weights URI; ValueError otherwise."""
    prefix = f"{NATS_WEIGHTS_SCHEME}://"
    if not uri.startswith(prefix):
        raise ValueError(f"not a nats weights uri: {uri!r}")
    stream, _, version = uri[len(prefix) :].partition("/")
    if not stream or not version.isdigit():
        raise ValueError(f"weights uri {uri!r} is not nats://<stream>/<version>")
    return stream, int(version)


def consumers_for(run: str) -> dict[str, ConsumerSpec]:
    """Durable consumers by role."""
    s = Subjects(run)
    return {
        # Shared by every rollout worker (a work queue allows one consumer per
        # subject, so all workers pull from this one durable).
        "rollout": ConsumerSpec(
            "rollout", stream_name(run, "TASKS"), s.tasks, ack_wait_s=60, max_deliver=5
        ),
        "buffer": ConsumerSpec(
            "buffer", stream_name(run, "SAMPLES"), s.samples, ack_wait_s=30, max_deliver=10
        ),
        "trainer": ConsumerSpec(
            "trainer",
            stream_name(run, "BATCHES"),
            s.batches,
            ack_wait_s=600,
            max_deliver=100,
            max_ack_pending=1,
        ),
        "sync": ConsumerSpec(
            "sync",
            stream_name(run, "WEIGHTS"),
            s.weights_published,
            ack_wait_s=600,
            max_deliver=100,
        ),
        # Held-out evaluations on the engines: sync takes the requests, the trainer the
        # results (each answered once; an evaluation holds an engine for seconds, not minutes).
        "sync-evals": ConsumerSpec(
            "sync-evals",
            stream_name(run, "WEIGHTS"),
            s.eval_requested,
            ack_wait_s=60,
            max_deliver=100,
        ),
        "trainer-evals": ConsumerSpec(
            "trainer-evals",
            stream_name(run, "WEIGHTS"),
            s.eval_results,
            ack_wait_s=60,
            max_deliver=100,
        ),
        # The buffer counts tasks that ended as dead letters (no group will come).
        "buffer-dlq": ConsumerSpec(
            "buffer-dlq", stream_name(run, "DLQ"), s.dlq_all, ack_wait_s=30, max_deliver=10
        ),
        "buffer-ready": ConsumerSpec(
            "buffer-ready",
            stream_name(run, "WEIGHTS"),
            s.weights_ready,
            ack_wait_s=30,
            max_deliver=100,
        ),
    }


def advisory_consumer(consumer: ConsumerSpec) -> ConsumerSpec:
    """The durable consumer of ADVISORIES that holds `consumer`'s max-deliveries notices.

    Shared by every process consuming `consumer` (each notice is handled once),
    durable (a notice stored while the service was down waits for it).
    """
    run = consumer.stream.removeprefix("FLYWHEEL_").rsplit("_", 1)[0]
    return ConsumerSpec(
        f"{consumer.durable}-maxdeliver",
        stream_name(run, "ADVISORIES"),
        max_deliveries_subject(consumer.stream, consumer.durable),
        ack_wait_s=30,
        max_deliver=-1,  # a notice is retried until its dead letter is stored
    )


def kv_bucket(run: str, owner: str) -> str:
    """The JetStream key-value bucket where `owner` (e.g. "buffer") keeps its state."""
    return f"FLYWHEEL_{run}_{owner}_state"
