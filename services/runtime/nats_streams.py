"""JetStream setup: streams, consumers and KV buckets from proto's data and `[nats] replicas`.

Streams and consumers are created idempotently: created when missing,
updated when their config differs from proto's, left alone when equal. So
every service can ensure the streams it uses at start-up, in any order,
any number of times, and a changed definition in proto rolls out by
restarting services. A change the server refuses in place (storage type,
retention to/from work-queue) is a `StreamConfigError` naming the fields.

Replication is a deployment choice, not wire contract, so it is not in
proto's `StreamSpec`: the caller passes `[nats] replicas` and it applies to
every stream and KV bucket Flywheel creates. Consumers are created with
replicas 0, which JetStream reads as "the stream's", so they follow their
stream. A stream created with another replica count is scaled in place
(JetStream allows that on a cluster), and ensure_* waits until the scaled
stream has a leader again (an election of a few seconds, during which
writes time out) before the service starts work on it.

A cluster that is forming or restarting answers late for a while: streams
without a leader yet do not answer (timeouts), and the meta leader refuses
to place replicas on a member it has not yet seen ("peer offline"). Every
JetStream call here retries those for up to `SETUP_RETRY_S`, so services
started together with their NATS cluster (a Kubernetes rollout) wait for it
instead of failing. Replicas > 1 on a server without
`cluster {}` is a `ReplicasError` naming the setting, raised before the
service does anything else, instead of the server's bare API error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from services.runtime.errors import ConfigError, FlywheelError

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.api import ConsumerConfig, StreamConfig
    from nats.js.errors import APIError
    from nats.js.kv import KeyValue

    from proto.streams import ConsumerSpec, StreamSpec

log = logging.getLogger(__name__)

JS_REPLICAS_NOT_SUPPORTED = 10074
"""JetStream's error code for "replicas > 1 not supported in non-clustered mode"."""

JS_NO_PEERS_FOR_PLACEMENT = 10005
"""JetStream's error code for "no suitable peers for placement" (fewer servers up than replicas)."""

RESCALE_WAIT_S = 30.0
"""How long ensure_* waits for a re-replicated stream to elect its leader."""

SETUP_RETRY_S = 30.0
"""How long a JetStream setup call retries a cluster that cannot answer yet."""

T = TypeVar("T")


class StreamConfigError(FlywheelError, RuntimeError):
    """The server refused to create or update a stream/consumer to proto's definition."""

    def __init__(self, message: str, *, name: str, diff: dict[str, tuple[Any, Any]]) -> None:
        self.name = name
        self.diff = diff
        super().__init__(message)


class ReplicasError(StreamConfigError, ConfigError):
    """`[nats] replicas` cannot be met by this NATS (e.g. > 1 on a single server).

    Also a ConfigError: the fix is a setting, and a service stops at start-up
    with this message (exit status 2) rather than a traceback.
    """


def stream_config(spec: StreamSpec, replicas: int = 1) -> StreamConfig:
    """nats-py's StreamConfig for a proto StreamSpec, replicated `replicas` times."""
    from nats.js.api import RetentionPolicy, StorageType, StreamConfig

    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy(spec.retention),
        storage=StorageType(spec.storage),
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        duplicate_window=spec.duplicate_window_s,
        max_msg_size=spec.max_msg_size,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        num_replicas=replicas,
    )


def consumer_config(spec: ConsumerSpec) -> ConsumerConfig:
    """nats-py's ConsumerConfig for a proto ConsumerSpec (durable, pull, explicit ack)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    return ConsumerConfig(
        name=spec.durable,
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        backoff=list(spec.backoff_s) or None,
    )


_STREAM_FIELDS = (
    "subjects",
    "retention",
    "storage",
    "max_age",
    "max_bytes",
    "duplicate_window",
    "max_msg_size",
    "max_msgs_per_subject",
    "num_replicas",
)
_CONSUMER_FIELDS = ("filter_subject", "ack_wait", "max_deliver", "max_ack_pending", "backoff")


def _norm(value: Any) -> Any:
    # The server reports durations in ns, nats-py converts to float seconds;
    # round so 7 days == 604800.000000001 compares equal.
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, list | tuple):
        return [_norm(v) for v in value]
    if hasattr(value, "value"):  # enums
        return value.value
    return value


def config_diff(want: Any, have: Any, fields: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """Fields whose desired value differs from the server's: name → (want, have).

    Pure; `want`/`have` are nats-py config objects (or anything with those
    attributes). An empty backoff and a missing one are the same.
    """
    diff: dict[str, tuple[Any, Any]] = {}
    for f in fields:
        w, h = _norm(getattr(want, f, None)), _norm(getattr(have, f, None))
        if f == "backoff":
            w, h = w or None, h or None
        if w != h:
            diff[f] = (w, h)
    return diff


@dataclass(frozen=True)
class Ensured:
    """What ensure_* did: "created", "updated" or "unchanged"."""

    name: str
    action: str
    diff: dict[str, tuple[Any, Any]]


def _placement_pending(e: BaseException) -> bool:
    """JetStream's "no suitable peers for placement, peer offline": a member not seen yet."""
    code = getattr(e, "err_code", None)
    return code == JS_NO_PEERS_FOR_PLACEMENT and "offline" in str(getattr(e, "description", ""))


async def _retrying(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, retried with backoff for up to SETUP_RETRY_S on what a forming
    cluster answers (timeouts, no responders, a peer offline); anything else,
    or the same past the deadline, is raised."""
    from nats.js.errors import APIError

    from services.runtime.transient import transient_errors

    transient = transient_errors()
    retry_on: tuple[type[BaseException], ...] = (*transient, APIError)
    deadline = time.monotonic() + SETUP_RETRY_S
    delay = 0.1
    while True:
        try:
            return await call()
        except retry_on as e:
            pending = isinstance(e, transient) or _placement_pending(e)
            if not pending or time.monotonic() + delay > deadline:
                raise
            log.warning("%s: %r; retrying in %.1fs", what, e, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)


def _refused(
    e: APIError, doing: str, name: str, replicas: int, diff: dict[str, tuple[Any, Any]]
) -> StreamConfigError:
    """The typed error for a refused create/update; a ReplicasError when replication is why."""
    if e.err_code == JS_REPLICAS_NOT_SUPPORTED:
        return ReplicasError(
            f"[nats] replicas = {replicas}: cannot {doing} {name}: this nats-server is not "
            f"clustered ({e.description}). Connect to a NATS cluster of at least {replicas} "
            "servers (`flywheel nats --cluster 3`, `[stack] nats_cluster = 3`, or the "
            "nats-cluster Kubernetes component), or set [nats] replicas = 1.",
            name=name,
            diff=diff,
        )
    if e.err_code == JS_NO_PEERS_FOR_PLACEMENT and replicas > 1:
        return ReplicasError(
            f"[nats] replicas = {replicas}: cannot {doing} {name}: {e.description}: the NATS "
            f"cluster has fewer than {replicas} servers up (or fewer in all). Start the missing "
            "servers, or set [nats] replicas to at most the cluster's size.",
            name=name,
            diff=diff,
        )
    hint = f" ([nats] replicas = {replicas})" if replicas > 1 else ""
    return StreamConfigError(
        f"cannot {doing} {name}: {e.description}{hint}; differing: {diff}", name=name, diff=diff
    )


async def ensure_stream(js: JetStreamContext, spec: StreamSpec, *, replicas: int = 1) -> Ensured:
    """Create the stream, or update it if its config (replicas included) differs from `spec`."""
    from nats.js.errors import APIError, NotFoundError

    want = stream_config(spec, replicas)
    try:
        info = await _retrying(f"stream {spec.name}", lambda: js.stream_info(spec.name))
    except NotFoundError:
        try:
            await _retrying(f"create stream {spec.name}", lambda: js.add_stream(want))
        except APIError as e:
            raise _refused(e, "create stream", spec.name, replicas, {}) from e
        log.info("stream %s created (%s, R%d)", spec.name, ", ".join(spec.subjects), replicas)
        return Ensured(spec.name, "created", {})
    diff = config_diff(want, info.config, _STREAM_FIELDS)
    if not diff:
        return Ensured(spec.name, "unchanged", {})
    try:
        await _retrying(f"update stream {spec.name}", lambda: js.update_stream(want))
    except APIError as e:
        err = _refused(e, "update stream", spec.name, replicas, diff)
        if not isinstance(err, ReplicasError):
            err = StreamConfigError(
                f"{err} Delete the stream (losing its messages) or keep its old definition.",
                name=spec.name,
                diff=diff,
            )
        raise err from e
    log.info("stream %s updated: %s", spec.name, diff)
    if "num_replicas" in diff:
        await _until_replicated(js, spec.name, replicas)
    return Ensured(spec.name, "updated", diff)


async def ensure_streams(
    js: JetStreamContext, specs: Iterable[StreamSpec], *, replicas: int = 1
) -> list[Ensured]:
    return [await ensure_stream(js, s, replicas=replicas) for s in specs]


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> Ensured:
    """Create the durable pull consumer, or update it if its config differs."""
    from nats.js.errors import APIError, NotFoundError

    want = consumer_config(spec)
    try:
        info = await _retrying(
            f"consumer {spec.durable}", lambda: js.consumer_info(spec.stream, spec.durable)
        )
    except NotFoundError:
        info = None
    diff = {} if info is None else config_diff(want, info.config, _CONSUMER_FIELDS)
    if info is not None and not diff:
        return Ensured(spec.durable, "unchanged", {})
    try:
        # CONSUMER.CREATE without an action is create-or-update on the server.
        await _retrying(f"consumer {spec.durable}", lambda: js.add_consumer(spec.stream, want))
    except APIError as e:
        raise StreamConfigError(
            f"cannot create/update consumer {spec.durable} on {spec.stream}: {e.description}; "
            f"differing: {diff}",
            name=spec.durable,
            diff=diff,
        ) from e
    action = "created" if info is None else "updated"
    log.info("consumer %s/%s %s %s", spec.stream, spec.durable, action, diff or "")
    return Ensured(spec.durable, action, diff)


async def ensure_kv(
    js: JetStreamContext, bucket: str, *, replicas: int = 1, history: int = 1
) -> KeyValue:
    """Open the KV bucket, creating it (or re-replicating its stream) to `replicas`.

    A bucket is the stream `KV_<bucket>`; nats-py has no KV update, so a
    bucket created with another replica count is scaled by updating that
    stream's `num_replicas` and nothing else (history stays as created).
    """
    from nats.js.api import KeyValueConfig
    from nats.js.errors import APIError, BucketNotFoundError

    try:
        kv = await _retrying(f"KV bucket {bucket}", lambda: js.key_value(bucket))
    except BucketNotFoundError:
        try:
            config = KeyValueConfig(bucket=bucket, history=history, replicas=replicas)
            return await _retrying(f"KV bucket {bucket}", lambda: js.create_key_value(config))
        except APIError as e:
            raise _refused(e, "create KV bucket", bucket, replicas, {}) from e
    stream = f"KV_{bucket}"
    have = (await _retrying(f"stream {stream}", lambda: js.stream_info(stream))).config
    if have.num_replicas != replicas:
        diff = {"num_replicas": (replicas, have.num_replicas)}
        try:
            scaled = dataclasses.replace(have, num_replicas=replicas)
            await _retrying(f"update stream {stream}", lambda: js.update_stream(scaled))
        except APIError as e:
            raise _refused(e, "update KV bucket", bucket, replicas, diff) from e
        log.info("KV bucket %s updated: %s", bucket, diff)
        await _until_replicated(js, stream, replicas)
    return kv


async def _until_replicated(
    js: JetStreamContext, stream: str, replicas: int, timeout_s: float = RESCALE_WAIT_S
) -> None:
    """Wait until a re-scaled stream has a leader and `replicas - 1` current followers.

    On timeout (a member is down, say) log and go on: writes retry on their own.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        cluster = (await _retrying(f"stream {stream}", lambda: js.stream_info(stream))).cluster
        if cluster is None:  # not clustered: nothing to elect
            return
        followers = [p for p in cluster.replicas or [] if p.current]
        if cluster.leader and len(followers) == replicas - 1:
            return
        if time.monotonic() > deadline:
            log.warning(
                "stream %s: not %d current replicas after %.0fs", stream, replicas, timeout_s
            )
            return
        await asyncio.sleep(0.1)
