"""Every parser of external bytes, as a fuzz target with its documented errors.

A target is a function of one `bytes` input plus the exception types it is
*allowed* to raise: the typed errors its callers catch (the message loop
catches `ProtocolError`, a service's main catches `ConfigError`, the engine
answers `RequestError` with HTTP 400). Anything else escaping a target is a
bug: the message loop would dead-letter it as `handler_error` at best, a
service would crash at start with a traceback at worst.

The same targets drive the hypothesis tests (tests/fuzz/test_fuzz_*.py, a
fixed budget in CI) and the atheris harness (tests/fuzz/atheris_fuzz.py,
coverage-guided, for a longer run).

Seeds: the golden example of every message type (proto/examples.py), a
chunked message, the buffer's persisted state, the shipped run files and a
valid /generate body. `mutate` turns a seed into the inputs a fuzzer should
try: bit flips, truncation, extra fields, fields of the wrong type, another
schema major, another type name.
"""

from __future__ import annotations

import atexit
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from proto.chunking import Reassembler, split
from proto.codec import decode, decode_any, encode
from proto.errors import ProtocolError
from proto.examples import EXAMPLES
from proto.messages import MESSAGE_TYPES
from services.buffer.core import BufferState, Cursor
from services.buffer.state import BufferStateError, dump_state, load_state
from services.engine.core.protocol import RequestError, parse_generate
from services.runtime.errors import ConfigError
from services.runtime.settings import ServiceSettings, load_settings
from tests.harness import REPO

ROOT = REPO


@dataclass(frozen=True)
class Target:
    name: str
    run: Callable[[bytes], Any]
    allowed: tuple[type[BaseException], ...]
    valid: tuple[bytes, ...]  # seeds that must parse
    others: tuple[bytes, ...] = ()  # more seeds to mutate (e.g. other message types)

    @property
    def seeds(self) -> tuple[bytes, ...]:
        return self.valid + self.others


# ── wire decoders ─────────────────────────────────────────────────────────────
def _decode_as(type_name: str) -> Callable[[bytes], Any]:
    cls = MESSAGE_TYPES[type_name]
    return lambda data: decode(data, cls)


WIRE_SEEDS: tuple[bytes, ...] = tuple(encode(m) for m in EXAMPLES.values())


def _chunk_seeds() -> tuple[bytes, ...]:
    whole = encode(EXAMPLES["TrainBatch"])
    return tuple(split(whole, "golden:step3", max_payload=2048 + len(whole) // 3))


CHUNK_SEEDS = _chunk_seeds()


def feed_chunks(data: bytes) -> None:
    """Feed the input, then every valid chunk (a mutated part among good ones)."""
    r = Reassembler(remember=8)
    r.feed(data)
    for part in CHUNK_SEEDS:
        r.feed(part)


# ── buffer state ──────────────────────────────────────────────────────────────
STATE_SEED = dump_state(
    BufferState(
        cursor=Cursor(1, 5),
        dispatched=40,
        answered=38,
        next_step=4,
        ready_version=3,
        settled={"golden:e0:i7:a0": (3, "accepted"), "golden:e0:i8:a0": (3, "zero_variance")},
    ),
    [("golden:e1:i2:a0", 17)],
)


# ── settings (TOML run files) ─────────────────────────────────────────────────
def _settings_classes() -> list[type[ServiceSettings]]:
    from services.buffer.settings import BufferSettings
    from services.engine.settings import EngineSettings
    from services.rollout.settings import RolloutSettings
    from services.stack.settings import StackSettings
    from services.sync.settings import SyncSettings
    from services.trainer.settings import TrainerSettings

    return [
        BufferSettings,
        EngineSettings,
        RolloutSettings,
        StackSettings,
        SyncSettings,
        TrainerSettings,
    ]


SETTINGS_CLASSES = _settings_classes()
_TMP = Path(tempfile.mkdtemp(prefix="flywheel-fuzz-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)  # one per importing process


def load_run_file(data: bytes) -> None:
    """Write the bytes as a run file and load every service's settings from it."""
    path = _TMP / "run.toml"
    path.write_bytes(data)
    for cls in SETTINGS_CLASSES:
        load_settings(cls, path)


TOML_SEEDS: tuple[bytes, ...] = tuple(
    p.read_bytes() for p in sorted((ROOT / "configs").glob("*.toml"))
)


# ── engine /generate ──────────────────────────────────────────────────────────
VOCAB = 64
CONTEXT = 256


def generate_request(data: bytes) -> None:
    """The engine's request path: JSON text → parse_generate (as server.generate does)."""
    try:
        body = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:  # server._json_body's rule
        raise RequestError(f"request body is not valid JSON: {e}") from e
    parse_generate(body, lambda s: [ord(c) % VOCAB for c in s], VOCAB, CONTEXT, 16)


GENERATE_SEEDS: tuple[bytes, ...] = tuple(
    json.dumps(b).encode()
    for b in (
        {"text": "12+34=", "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "n": 2}},
        {"input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"], "return_logprob": True},
        {"input_ids": [1, 2], "sampling_params": {"stop": ["\n"], "stop_token_ids": [3]}},
    )
)


# ── the registry ──────────────────────────────────────────────────────────────
TARGETS: dict[str, Target] = {
    **{
        f"decode_{t}": Target(
            f"decode_{t}",
            _decode_as(t),
            (ProtocolError,),
            tuple(encode(EXAMPLES[t]) for t in [t] if t in EXAMPLES),
            WIRE_SEEDS,
        )
        for t in MESSAGE_TYPES
    },
    "decode_any": Target("decode_any", decode_any, (ProtocolError,), WIRE_SEEDS),
    "reassembler": Target("reassembler", feed_chunks, (ProtocolError,), CHUNK_SEEDS, WIRE_SEEDS),
    "buffer_state": Target("buffer_state", load_state, (BufferStateError,), (STATE_SEED,)),
    "run_file": Target("run_file", load_run_file, (ConfigError,), TOML_SEEDS),
    "generate": Target("generate", generate_request, (RequestError,), GENERATE_SEEDS),
}


# ── mutations ─────────────────────────────────────────────────────────────────
_WRONG_VALUES: tuple[Any, ...] = (
    None, True, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 600,
    b"\x00\x01\x02", [], [1, "a"], {}, {"k": 1}, {1: 2},
)  # fmt: skip


def _as_map(data: bytes) -> dict[Any, Any] | None:
    try:
        body = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    return body if isinstance(body, dict) else None


def _structural(data: bytes, rng: random.Random) -> bytes | None:
    """A MessagePack-level mutation of a map: drop/add/retype a field, change version/type."""
    body = _as_map(data)
    if not body:
        return None
    key = rng.choice(list(body))
    match rng.randrange(6):
        case 0:
            body.pop(key)
        case 1:
            body[key] = rng.choice(_WRONG_VALUES)
        case 2:
            body[f"extra_{rng.randrange(100)}"] = rng.choice(_WRONG_VALUES)
        case 3:
            body["schema_version"] = rng.choice(["2.0", "0.9", "1", "1.99", "", "x.y", 1])
        case 4:
            body["type"] = rng.choice([*MESSAGE_TYPES, "Nope", 3, None])
        case _:
            nested = body[key]
            if isinstance(nested, list | tuple) and nested and isinstance(nested[0], dict):
                inner = dict(nested[0])
                inner[rng.choice(list(inner) or ["k"])] = rng.choice(_WRONG_VALUES)
                body[key] = [inner, *nested[1:]]
            else:
                body[key] = rng.choice(_WRONG_VALUES)
    return msgpack.packb(body, use_bin_type=True)


def _json_structural(data: bytes, rng: random.Random) -> bytes | None:
    try:
        body = json.loads(data)
    except ValueError:
        return None
    if not isinstance(body, dict) or not body:
        return None
    key = rng.choice(list(body))
    value = rng.choice([v for v in _WRONG_VALUES if not isinstance(v, bytes | dict)])
    if rng.random() < 0.5 and isinstance(body[key], dict) and body[key]:
        inner = body[key]
        inner[rng.choice(list(inner))] = value
    else:
        body[key] = value
    return json.dumps(body).encode()


def mutate(data: bytes, rng: random.Random) -> bytes:
    """One random mutation of `data` (byte-level or structural)."""
    kind = rng.randrange(7)
    if kind == 0 and data:  # bit flips
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        return bytes(buf)
    if kind == 1 and data:  # truncation
        return data[: rng.randrange(len(data))]
    if kind == 2:  # random bytes spliced in
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.randbytes(rng.randint(1, 16)) + data[i:]
    if kind == 3 and data:  # a byte set to a MessagePack/TOML/JSON-significant value
        buf = bytearray(data)
        buf[rng.randrange(len(buf))] = rng.choice(b'\xc1\xd9\xdb\xdd\xdf\x00\xff"[]={}\n#\\')
        return bytes(buf)
    structural = _structural(data, rng) if kind in (4, 5) else _json_structural(data, rng)
    return structural if structural is not None else rng.randbytes(rng.randint(0, 64))


def check(target: Target, data: bytes) -> None:
    """Run `target` on `data`; an exception outside its allowed types propagates."""
    try:
        target.run(data)
    except target.allowed:
        pass
