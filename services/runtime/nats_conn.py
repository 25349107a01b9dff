"""NATS connection from typed settings (JetStream setup lives in nats_streams).

Connecting. Start-up order in Kubernetes is arbitrary, so the first connect
retries with capped exponential backoff (`connect_backoff`) for
`settings.connect_attempts` attempts, logging each failure; an
authorization failure or a server certificate that does not verify is not
retried (neither will fix itself). Each start-up
attempt runs with reconnection off, so a dead server fails the attempt at
once instead of looping inside nats-py; once connected, reconnection is
switched on (forever, every `RECONNECT_WAIT_S`) so a running service rides
out a NATS restart, with every disconnect/reconnect logged and `/readyz`
reporting "disconnected" meanwhile.

Several servers: `[nats] url` takes a comma-separated list (every member
of a cluster); nats-py tries them (in random order) and learns the others from the
server's INFO, so a running service fails over to a surviving member.

Streams, consumers and KV buckets are set up in services.runtime.nats_streams;
its names are re-exported here, where services have always imported them.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, Any

from services.runtime.errors import ConfigError, FlywheelError
from services.runtime.nats_streams import (
    Ensured,
    ReplicasError,
    StreamConfigError,
    config_diff,
    consumer_config,
    ensure_consumer,
    ensure_kv,
    ensure_stream,
    ensure_streams,
    stream_config,
)
from services.runtime.redact import redact

if TYPE_CHECKING:
    from nats.aio.client import Client

    from services.runtime.settings import NatsSettings

__all__ = [
    "Ensured",
    "NatsConnectError",
    "ReplicasError",
    "StreamConfigError",
    "auth_options",
    "config_diff",
    "connect",
    "connect_backoff",
    "consumer_config",
    "ensure_consumer",
    "ensure_kv",
    "ensure_stream",
    "ensure_streams",
    "server_max_payload",
    "stream_config",
    "tls_context",
]

log = logging.getLogger(__name__)

RECONNECT_WAIT_S = 1.0
"""Pause between reconnect attempts of a running service."""

BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 5.0


class NatsConnectError(FlywheelError, ConnectionError):
    """NATS could not be reached within the configured attempts (or refused our credentials)."""

    def __init__(self, message: str, *, url: str, attempts: int) -> None:
        self.url = url
        self.attempts = attempts
        super().__init__(message)


def connect_backoff(
    attempt: int, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S
) -> float:
    """Seconds to wait after failed attempt `attempt` (1-based): base·2^(n-1), capped.

    0.1, 0.2, 0.4, … 5, 5, …: 30 attempts cover about two minutes, long
    enough for a nats-server pod to be scheduled and start.
    """
    return min(cap_s, base_s * 2.0 ** (attempt - 1))


def tls_context(settings: NatsSettings) -> ssl.SSLContext | None:
    """An SSL context when TLS is configured (a CA, a client cert, or a tls:// URL)."""
    wants_tls = settings.tls_ca or settings.tls_cert or settings.url.startswith("tls://")
    if not wants_tls:
        return None
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigError("[nats] tls_cert and tls_key must be given together")
    ctx = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(settings.tls_ca) if settings.tls_ca else None
    )
    if settings.tls_cert and settings.tls_key:
        ctx.load_cert_chain(str(settings.tls_cert), str(settings.tls_key))
    return ctx


def auth_options(settings: NatsSettings) -> dict[str, Any]:
    """nats-py keyword arguments for the configured credentials (none by default)."""
    opts: dict[str, Any] = {}
    if settings.user is not None or settings.password is not None:
        if settings.user is None or settings.password is None:
            raise ConfigError("[nats] user and password must be given together")
        opts["user"], opts["password"] = settings.user, settings.password.get_secret_value()
    if settings.token is not None:
        opts["token"] = settings.token.get_secret_value()
    if settings.creds_file is not None or settings.nkeys_seed is not None:
        try:
            import nkeys  # noqa: F401  (nats-py needs it for JWT/nkey auth)
        except ImportError as e:
            raise ConfigError(
                "[nats] creds_file / nkeys_seed need the `nkeys` package: "
                "pip install 'nats-py[nkeys]'"
            ) from e
        if settings.creds_file is not None:
            opts["user_credentials"] = str(settings.creds_file)
        if settings.nkeys_seed is not None:
            opts["nkeys_seed"] = str(settings.nkeys_seed)
    return opts


def _callbacks(name: str, client: list[Client] | None = None) -> dict[str, Any]:
    """nats-py's callbacks; `client` holds the connection once there is one."""

    async def on_error(e: Exception) -> None:
        log.warning("nats[%s]: %s: %s", name, type(e).__name__, e)

    async def on_disconnected() -> None:
        # drain()/close() (the service stopping) is no news; a lost server is a warning.
        closing = client is not None and bool(client) and client[0].is_closed
        log.log(logging.INFO if closing else logging.WARNING, "nats[%s]: disconnected", name)

    async def on_reconnected() -> None:
        log.info("nats[%s]: reconnected", name)

    async def on_closed() -> None:
        log.info("nats[%s]: connection closed", name)

    return {
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
        "closed_cb": on_closed,
    }


def connect_options(
    settings: NatsSettings, name: str, client: list[Client] | None = None
) -> dict[str, Any]:
    """nats-py's connect() options for one start-up attempt (`client`: see _callbacks)."""
    return {
        "servers": [u.strip() for u in settings.url.split(",") if u.strip()],
        "name": name,
        "connect_timeout": settings.connect_timeout_s,
        "drain_timeout": settings.drain_timeout_s,
        "tls": tls_context(settings),
        # One start-up attempt = one quick pass over the servers: nats-py's
        # server selection retries a server until it has failed more than
        # max_reconnect_attempts times (and forever for -1), without waiting
        # when reconnect_time_wait is 0. connect() does the backoff.
        "allow_reconnect": False,
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": 0,
        **auth_options(settings),
        **_callbacks(name, client),
    }


async def connect(settings: NatsSettings, name: str) -> Client:
    """Connect to NATS with start-up retries; see the module docstring."""
    from nats.aio.client import Client
    from nats.errors import Error as NatsError

    client: list[Client] = []
    opts = connect_options(settings, name, client)
    last: Exception | None = None
    for attempt in range(1, settings.connect_attempts + 1):
        nc = Client()
        client[:] = [nc]
        try:
            await nc.connect(**opts)
        except (OSError, TimeoutError, NatsError) as e:
            await _discard(nc)
            _raise_if_final(e, redact(settings.url), attempt)
            last = e
            if attempt < settings.connect_attempts:
                delay = connect_backoff(attempt)
                log.warning(
                    "nats[%s]: connect attempt %d/%d to %s failed (%s: %s); retrying in %.1fs",
                    name,
                    attempt,
                    settings.connect_attempts,
                    settings.url,
                    type(e).__name__,
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
            continue
        _ride_out_restarts(nc)
        log.info(
            "nats[%s]: connected to %s", name, nc.connected_url.netloc if nc.connected_url else "?"
        )
        return nc
    raise NatsConnectError(
        f"cannot connect to NATS at {redact(settings.url)} after {settings.connect_attempts} "
        f"attempts: {type(last).__name__}: {last}",
        url=redact(settings.url),
        attempts=settings.connect_attempts,
    ) from last


def _raise_if_final(e: Exception, url: str, attempt: int) -> None:
    """A failure retrying cannot fix (a certificate, credentials): NatsConnectError now."""
    if isinstance(e, ssl.SSLCertVerificationError):  # a wrong CA will not fix itself
        raise NatsConnectError(
            f"TLS: the certificate of NATS at {url} does not verify against [nats] tls_ca: {e}",
            url=url,
            attempts=attempt,
        ) from e
    if _is_auth_error(e):
        raise NatsConnectError(
            f"NATS at {url} refused the credentials: {e}", url=url, attempts=attempt
        ) from e


def _is_auth_error(e: Exception) -> bool:
    # nats-py raises a plain nats.errors.Error for the server's -ERR during
    # the CONNECT handshake, so the typed AuthorizationError is not enough.
    from nats.errors import AuthorizationError

    return isinstance(e, AuthorizationError) or "authorization violation" in str(e).lower()


def _ride_out_restarts(nc: Client) -> None:
    """Switch a connected client to reconnect forever, every RECONNECT_WAIT_S.

    nats-py reads these options at each disconnect (Client._process_op_err,
    _select_next_server), so setting them after the initial connect is
    enough. The server-restart integration test guards this against a
    nats-py upgrade.
    """
    nc.options["allow_reconnect"] = True
    nc.options["max_reconnect_attempts"] = -1
    nc.options["reconnect_time_wait"] = RECONNECT_WAIT_S


DISCARD_TIMEOUT_S = 2.0
"""Bound on closing a client whose connect failed.

After a failed TLS upgrade (e.g. the server's certificate does not verify)
nats-py's `close()` waits forever for the half-upgraded transport to close;
unbounded, a misconfigured CA hung the service at start instead of failing
with the certificate error (found by tests/integration/security)."""


async def _discard(nc: Client) -> None:
    from nats.errors import ConnectionClosedError

    if not nc.is_closed:
        try:
            await asyncio.wait_for(nc.close(), DISCARD_TIMEOUT_S)
        except ConnectionClosedError:
            log.debug("discarded a half-open NATS client")
        except TimeoutError:
            log.debug("gave up closing a half-open NATS client after %.1fs", DISCARD_TIMEOUT_S)


def server_max_payload(nc: Client, override: int | None = None) -> int:
    """The largest message the server accepts; `override` may only lower it."""
    server = int(nc.max_payload)
    return min(server, override) if override else server
