"""Errors of the transport, not of the message or the data: what a retry may outlast.

Its own module (not the message loop's) because stream set-up, `publish` and
the message loop all retry on them, and the loop depends on the set-up.
"""

from __future__ import annotations

import functools

TRANSIENT: tuple[type[BaseException], ...] = (TimeoutError, ConnectionError)
"""Errors of the transport, not of the message: treated like RetryableError.

The message loop adds nats-py's connection errors at run time (so this
module does not import nats); a handler whose publish hits a NATS restart
gets its message redelivered, not dead-lettered as a bug.
"""


@functools.cache
def transient_errors() -> tuple[type[BaseException], ...]:
    """`TRANSIENT` plus nats-py's connection errors: what a publish during a NATS outage raises.

    For the message loop's verdicts, `publish`'s retries, and loops outside
    the message loop (a dispatcher, a heartbeat) that must retry such a
    publish later rather than die with it.
    """
    return TRANSIENT + _nats_transient_errors()


def _nats_transient_errors() -> tuple[type[BaseException], ...]:
    from nats import errors
    from nats.js import errors as js_errors

    return (
        errors.ConnectionClosedError,
        errors.ConnectionReconnectingError,
        errors.ConnectionDrainingError,
        errors.StaleConnectionError,
        errors.OutboundBufferLimitError,
        errors.NoRespondersError,
        js_errors.NoStreamResponseError,
        js_errors.ServiceUnavailableError,
    )
