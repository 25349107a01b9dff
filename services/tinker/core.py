"""The pure core of the Tinker-compatible service: what a request is, when it is wrong,
and the request log that answers a retried request once and never applies it twice.

No HTTP, no torch. The adapter (app.py, wire.py) turns the SDK's JSON and protobuf
into the types here; the model (model.py) only ever sees requests this module has
already checked, so a bad request fails before it touches any adapter, and one
session's bad input cannot leave another's model or optimizer half-changed.

Idempotency follows the SDK: every training request carries the training client's
`seq_id` (1, 2, 3, ... per model), every sample request its sampling session's
`seq_id`. The log keys a request by (owner, kind, seq_id): a second POST with the
same key (the SDK retrying after a lost response) gets the first one's request id
back and is not run again; the future it polls is the first one's.
"""

from __future__ import annotations

import itertools
import secrets
import zlib
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

# The losses the SDK names (tinker.types.LossFnType), split by what this server runs.
SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
SDK_LOSSES = (*SUPPORTED_LOSSES, "stable_reinforce", "custom")

# loss -> (required loss_fn_inputs, optional ones): each a float or int vector, one
# entry per model-input token (Tinker's convention: the target of position i is
# the token the model should predict after seeing tokens[: i + 1]).
LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ()),
    "ppo": (("target_tokens", "logprobs", "advantages"), ()),
    "cispo": (("target_tokens", "logprobs", "advantages"), ()),
    "dro": (("target_tokens", "logprobs", "advantages"), ()),
    "gspo": (("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"), ()),
}

# loss -> its loss_fn_config keys and their defaults (None: the caller must give it),
# as Tinker's loss docs define them: PPO clips the ratio to [0.8, 1.2] (epsilon 0.2),
# CISPO to [0, 4] (no lower bound); DRO's beta and GSPO's thresholds have no documented
# default (GSPO's sequence ratios stay near 1: its paper clips to [1 - 3e-4, 1 + 4e-4],
# where PPO's band would clip nothing).
LOSS_CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": None, "clip_high_threshold": None},
}


class Category(StrEnum):
    """The SDK's RequestErrorCategory values: a `user` error is the caller's to fix."""

    USER = "user"
    SERVER = "server"


class TinkerUserError(ValueError):
    """A request the caller must change; the message says what. Fails that request only."""

    category = Category.USER


class UnsupportedLoss(TinkerUserError):
    def __init__(self, loss: str) -> None:
        self.loss = loss
        named = (
            "one the SDK names but this server does not run yet"
            if loss in SDK_LOSSES
            else ("not a loss the SDK names")
        )
        super().__init__(f"loss_fn {loss!r} is {named}; supported: {', '.join(SUPPORTED_LOSSES)}")


class BadLossConfig(TinkerUserError):
    """A loss_fn_config key the loss does not take, a value that is not a number, a
    required key missing, or clip thresholds out of order."""

    def __init__(self, loss: str, message: str) -> None:
        self.loss = loss
        keys = ", ".join(LOSS_CONFIG[loss]) or "none"
        super().__init__(f"loss_fn_config for {loss!r}: {message} (its keys: {keys})")


class BadShape(TinkerUserError):
    def __init__(self, index: int, name: str, expected: str, got: Any) -> None:
        self.index, self.name = index, name
        super().__init__(f"datum {index}: loss_fn_inputs[{name!r}] must be {expected}, got {got}")


class TooLarge(TinkerUserError):
    """An oversized batch, datum, sample count or max_tokens: past a `[tinker]` limit."""

    def __init__(self, what: str, value: int, limit: int, key: str) -> None:
        self.what, self.value, self.limit = what, value, limit
        super().__init__(f"{what} is {value}, over this server's limit of {limit} ([tinker] {key})")


class UnsupportedInput(TinkerUserError):
    """A model-input chunk (image, audio) or tensor layout this slice does not take."""


class UnknownName(TinkerUserError):
    """A session, model, sampling session, base model or request this server never made."""


class UnsupportedRoute(TinkerUserError):
    """An SDK route this slice does not serve (save_state, load_state, ...)."""


@dataclass(frozen=True)
class Datum:
    """One training example: the model input's tokens and its loss inputs (1-D arrays)."""

    tokens: tuple[int, ...]
    inputs: dict[str, np.ndarray]


@dataclass(frozen=True)
class Limits:
    max_datums: int
    max_tokens: int
    vocab_size: int
    max_num_samples: int
    max_sample_tokens: int
    max_rank: int


def check_tokens(tokens: tuple[int, ...] | list[int], limits: Limits, what: str) -> None:
    if not tokens:
        raise TinkerUserError(f"{what} is empty")
    if len(tokens) > limits.max_tokens:
        raise TooLarge(f"{what}'s length", len(tokens), limits.max_tokens, "max_tokens")
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        raise TinkerUserError(
            f"{what} has token ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}"
        )


def loss_config(loss: str, given: dict[str, float | str] | None) -> dict[str, float]:
    """The loss's config: `given` over its defaults; BadLossConfig if it cannot be run."""
    known = LOSS_CONFIG[loss]
    given = given or {}
    for key, value in given.items():
        if key not in known:
            raise BadLossConfig(loss, f"{key!r} is not one of its keys")
        if isinstance(value, str) or not np.isfinite(value):
            raise BadLossConfig(loss, f"{key!r} must be a finite number, got {value!r}")
    config: dict[str, float] = {}
    for key, default in known.items():
        chosen = given.get(key, default)  # a str was refused above
        if chosen is None:
            raise BadLossConfig(loss, f"{key!r} is required")
        config[key] = float(chosen)
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")
    if low is not None and high is not None and not 0 <= low <= high:
        raise BadLossConfig(loss, f"needs 0 <= clip_low_threshold <= clip_high_threshold, "
                                  f"got {low} and {high}")  # fmt: skip
    return config


def check_batch(
    loss: str, data: list[Datum], limits: Limits, config: dict[str, float | str] | None = None
) -> None:
    """UnsupportedLoss / BadLossConfig / BadShape / TooLarge / TinkerUserError if the
    batch cannot be run."""
    if loss not in LOSS_INPUTS:
        raise UnsupportedLoss(loss)
    loss_config(loss, config)
    if not data:
        raise TinkerUserError("forward_backward with no datums")
    if len(data) > limits.max_datums:
        raise TooLarge("the batch's datum count", len(data), limits.max_datums, "max_datums")
    required, optional = LOSS_INPUTS[loss]
    for i, d in enumerate(data):
        check_tokens(d.tokens, limits, f"datum {i}'s model_input")
        n = len(d.tokens)
        for name in required:
            if name not in d.inputs:
                raise BadShape(i, name, f"given for {loss}", "nothing")
        unknown = set(d.inputs) - set(required) - set(optional)
        if unknown:
            raise BadShape(i, sorted(unknown)[0], f"one of {required + optional}", "an extra key")
        for name, arr in d.inputs.items():
            if arr.shape != (n,):
                raise BadShape(i, name, f"shape [{n}] (the model input's length)", list(arr.shape))
        if loss == "gspo" and not d.inputs["sequence_ratio_mask"].any():
            # The sequence ratio is a mean over the marked tokens: over none it is 0/0.
            raise BadShape(i, "sequence_ratio_mask", "nonzero on at least one token", "all 0")
        targets = d.inputs["target_tokens"]
        if targets.size and not (0 <= targets.min() and targets.max() < limits.vocab_size):
            raise BadShape(i, "target_tokens", f"ids in [0, {limits.vocab_size})", "ids outside")


# The share of a batch's tokens that may be padding. Padding is computed like any
# token, and on one thread a step is compute-bound: 16 datums of 60-80 tokens on
# SmolLM2 as one batch padded 14% took 1.03x their time one by one, as four batches
# of 4 (3% padding) 0.94x (bench/tinker_forward_backward.py, 2026-11-29).
MAX_PADDING = 0.05


def datum_batches(
    lengths: list[int], budget: int, max_padding: float = MAX_PADDING
) -> list[list[int]]:
    """The datums' indices grouped into padded batches of at most `budget` tokens each
    (rows x the longest row), shortest first, a row joining only while at most
    `max_padding` of the batch's tokens are padding; a datum longer than `budget` runs
    alone. Deterministic in `lengths`, so a replayed request runs the same batches (and
    sums its gradients in the same order) as the first run."""
    batches: list[list[int]] = []
    real = 0  # the last batch's real tokens
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):  # stable: ties keep order
        # Ascending lengths: the row joining is the batch's longest.
        padded = (len(batches[-1]) + 1) * lengths[i] if batches else 0
        if batches and padded <= budget and padded - real - lengths[i] <= max_padding * padded:
            batches[-1].append(i)
            real += lengths[i]
        else:
            batches.append([i])
            real = lengths[i]
    return batches


@dataclass(frozen=True)
class SampleSpec:
    """A checked sample request."""

    prompt: tuple[int, ...]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop_tokens: tuple[int, ...] | None  # None: stop at EOS; () : never stop early
    stop_strings: tuple[str, ...]
    prompt_logprobs: bool


def check_sample(spec: SampleSpec, limits: Limits) -> None:
    check_tokens(spec.prompt, limits, "the prompt")
    if not 1 <= spec.num_samples <= limits.max_num_samples:
        if spec.num_samples < 1:
            raise TinkerUserError(f"num_samples must be at least 1, got {spec.num_samples}")
        raise TooLarge("num_samples", spec.num_samples, limits.max_num_samples, "max_num_samples")
    if spec.max_tokens < 1:
        raise TinkerUserError(
            f"sampling_params.max_tokens must be at least 1, got {spec.max_tokens}"
        )
    if spec.max_tokens > limits.max_sample_tokens:
        raise TooLarge("max_tokens", spec.max_tokens, limits.max_sample_tokens, "max_sample_tokens")
    if len(spec.prompt) + spec.max_tokens > limits.max_tokens:
        raise TooLarge(
            "prompt + max_tokens",
            len(spec.prompt) + spec.max_tokens,
            limits.max_tokens,
            "max_tokens",
        )
    if spec.temperature < 0:
        raise TinkerUserError(f"temperature must be >= 0, got {spec.temperature}")
    if not 0 < spec.top_p <= 1:
        raise TinkerUserError(f"top_p must be in (0, 1], got {spec.top_p}")
    if spec.top_k == 0 or spec.top_k < -1:
        raise TinkerUserError(f"top_k must be -1 (no limit) or positive, got {spec.top_k}")


def adapter_seed(server_seed: int, model_id: str) -> int:
    """The seed of an adapter created without one: a function of the request (its model
    id, unique per server start) and `[tinker] seed`, so a replay draws the same one."""
    return zlib.crc32(f"{server_seed}:{model_id}".encode())


def check_rank(rank: int, limits: Limits) -> None:
    if rank < 1:
        raise TinkerUserError(f"lora rank must be at least 1, got {rank}")
    if rank > limits.max_rank:
        raise TooLarge("lora rank", rank, limits.max_rank, "max_rank")


# -- the request log ----------------------------------------------------------------


class State(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Entry:
    """One request's fate. `result` is what the adapter sends back (JSON-able or bytes)."""

    request_id: str
    kind: str
    owner: str
    state: State = State.PENDING
    result: Any = None
    error: str = ""
    category: Category = Category.SERVER
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. sample_sequence_ids


class RequestLog:
    """Requests by id, and by (owner, kind, seq_id) so a retry finds its first answer."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._by_key: dict[tuple[str, str, int], str] = {}
        self._keys: dict[str, tuple[str, str, int]] = {}
        # A token per server start in every id: a restarted server that replays an
        # earlier one's requests (journal.py) keeps their ids and never reuses one.
        self._boot = secrets.token_hex(3)
        self._ids = itertools.count(1)
        # The id the next new entry takes instead of a fresh one: set by the replay, so
        # a replayed request keeps the id its client holds.
        self.next_id: str | None = None

    def open(self, owner: str, kind: str, seq_id: int | None) -> tuple[Entry, bool]:
        """The entry for this request and whether it is new (False: a retry; do not run it).

        Without a seq_id (a client that sends none) every request is new."""
        key = (owner, kind, seq_id) if seq_id is not None else None
        if key is not None and key in self._by_key:
            return self._entries[self._by_key[key]], False
        request_id, self.next_id = self.next_id or f"req-{self._boot}-{next(self._ids)}", None
        entry = Entry(request_id=request_id, kind=kind, owner=owner)
        self._entries[entry.request_id] = entry
        if key is not None:
            self._by_key[key] = entry.request_id
            self._keys[entry.request_id] = key
        return entry, True

    def forget(self, entry: Entry) -> None:
        """Drop a new entry that was never accepted (the journal did not store it), so
        the client's retry is a new request, not an answer to a request never run."""
        self._entries.pop(entry.request_id, None)
        key = self._keys.pop(entry.request_id, None)
        if key is not None:
            self._by_key.pop(key, None)

    def known(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise UnknownName(f"no request {request_id!r} on this server") from None

    def entries(self) -> tuple[list[Entry], dict[str, tuple[str, str, int]]]:
        """Every entry, and the retry key of those that have one (a replay checkpoint's)."""
        return list(self._entries.values()), dict(self._keys)

    def restore(self, entries: list[Entry], keys: dict[str, tuple[str, str, int]]) -> None:
        """Take back what `entries` gave (a start from a replay checkpoint)."""
        for entry in entries:
            self._entries[entry.request_id] = entry
        for request_id, key in keys.items():
            self._keys[request_id], self._by_key[key] = key, request_id

    def expire(self, request_ids: set[str], why: str) -> None:
        """Drop the answers of these finished requests; their futures fail with `why`
        (a retry still finds the entry: it is never run again)."""
        for request_id in request_ids:
            entry = self._entries.get(request_id)
            if entry is not None and entry.state is not State.PENDING:
                entry.state, entry.result = State.FAILED, None
                entry.error, entry.category = why, Category.USER

    @staticmethod
    def complete(entry: Entry, result: Any) -> None:
        entry.state, entry.result = State.DONE, result

    @staticmethod
    def fail(entry: Entry, error: str, category: Category) -> None:
        entry.state, entry.error, entry.category = State.FAILED, error, category


# -- sessions and what hangs off them ------------------------------------------------


@dataclass
class TrainingModel:
    model_id: str
    session_id: str
    rank: int
    steps: int = 0  # optim_steps applied: what a retried optim_step must not add to


@dataclass
class SamplingSession:
    sampling_session_id: str
    session_id: str
    model_id: str | None  # None: the base model
    snapshot: str | None  # the adapter snapshot's name in the model, None for the base


class Registry:
    """Sessions, their training models and sampling sessions, by the ids the SDK derives."""

    def __init__(self) -> None:
        # A token per server start in every session id, so a training run's id (and the
        # tinker:// paths of its saved states) never repeats after a restart.
        self._boot = secrets.token_hex(3)
        self._session_ids = itertools.count(1)
        self.sessions: dict[str, list[str]] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplingSession] = {}

    def new_session(self, session_id: str | None = None) -> str:
        """A new session; `session_id` given: the one an earlier start created (replay)."""
        session_id = session_id or f"session-{self._boot}-{next(self._session_ids)}"
        self.sessions[session_id] = []
        return session_id

    def end_session(self, session_id: str) -> None:
        """Undo new_session for a session never handed out (the journal refused it)."""
        self.sessions.pop(session_id, None)

    def session(self, session_id: str) -> list[str]:
        if session_id not in self.sessions:
            raise UnknownName(f"no session {session_id!r} on this server")
        return self.sessions[session_id]

    @staticmethod
    def model_id_for(session_id: str, model_seq_id: int) -> str:
        """The SDK derives the same id client-side (service_client.py): keep them equal."""
        return f"{session_id}:train:{model_seq_id}"

    def add_model(self, model: TrainingModel) -> None:
        self.session(model.session_id).append(model.model_id)
        self.models[model.model_id] = model

    def model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise UnknownName(f"no training model {model_id!r} on this server")
        return self.models[model_id]

    def add_sampler(self, sampler: SamplingSession) -> None:
        self.session(sampler.session_id)
        self.samplers[sampler.sampling_session_id] = sampler

    def sampler(self, sampling_session_id: str) -> SamplingSession:
        if sampling_session_id not in self.samplers:
            raise UnknownName(f"no sampling session {sampling_session_id!r} on this server")
        return self.samplers[sampling_session_id]
