"""The sandbox's wire between a pool and its zygote: length-prefixed MessagePack
frames, and what the pool accepts of a call's answer.

The protocol is length-prefixed MessagePack on the child's stdin/stdout — no
pickle, and no fork of a parent that runs an event loop, NATS and torch
threads. The pool sends control frames, which the zygote reads:
`["warm", id, path, args]` runs in the zygote itself (warm-up: imports,
caches; the service's own requests) and is answered `["warmed", id,
answer]`; `["calls", id, n, pure]` is followed by n request frames
`[id, i, path, args, mode]` (mode None: a reward, answered `["ok", reward,
parts]` or `["error", message]`; "value": a tool call, answered `["value",
text]`), which the zygote does not read: it forks a process for each (for
all n when `pure`), which reads its own. For each such process the zygote
writes `["answer", id, i, k]` followed by that process's own frame
`[id, i, [answer, ...]]` (k answers, spliced), or `["crashed", id, i, k,
why]` when it died without one; then `["done", id, doubt]`, doubt None or
why the slot must be replaced. What a call's process sends back is checked
by the pool, per answer, for the shape its request asks for.

Every request carries a fresh random id that its answers echo (`secrets.randbits`,
drawn by the pool): a frame that does not is a `Desync`, and the child is replaced.
This module is shared by both sides and holds no state: the child's side is
zygote.py, the service's side pool.py.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgpack


class Desync(Exception):
    """A child's frames do not answer the request sent (wrong id, order or shape): its
    stream cannot be trusted, so the child is replaced."""


HEADER = struct.Struct("<I")
MAX_FRAME = 64 << 20  # a call's answer larger than this is refused
# The zygote's first request of every child: import what every child imports and the
# pool's PRELOAD (zygote.preload).
PRELOAD_PATH = "services.sandbox.zygote:preload"


def encode(obj: Any) -> bytes:
    """One frame: its length (little-endian u32), then its MessagePack body."""
    data = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(data)) + data


def _is_verdict(v: Any) -> bool:
    if not isinstance(v, list) or not v:
        return False
    if v[0] == "error":
        return len(v) == 2 and isinstance(v[1], str)
    return (
        v[0] == "ok"
        and len(v) == 3
        and isinstance(v[1], float)
        and math.isfinite(v[1])
        and isinstance(v[2], dict)
        and all(isinstance(k, str) and isinstance(x, float) for k, x in v[2].items())
    )


def checked(answer: Any, mode: str | None) -> list[Any]:
    """A call's answer if it has the shape its request asks for, else an error: what a
    call's process sends is not trusted (its code may be the policy's)."""
    ok = False
    if isinstance(answer, list) and answer and answer[0] == "error":
        ok = _is_verdict(answer)
    elif mode == "value":
        ok = isinstance(answer, list) and len(answer) == 2 and answer[0] == "value"
        ok = ok and isinstance(answer[1], str)
    else:
        ok = _is_verdict(answer)
    return answer if ok else ["error", "sandbox: the call sent back a malformed answer"]
