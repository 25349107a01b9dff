"""One sequence's scheduler-side state and when it stops (pure, no model).

Split from the scheduler so the continuous-batching loop reads on its own:
`Seq` is what the loop keeps per completion (tokens, logprobs, the weight
versions its tokens came from), `stop_reason` decides when one ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from services.engine.core.protocol import Completion, SeqSpec
from services.runtime.errors import FlywheelError

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


class SchedulerStopped(FlywheelError, RuntimeError):
    """The scheduler thread is gone; no request can be served."""


@dataclass
class Seq:
    """One sequence being generated (scheduler-thread state)."""

    spec: SeqSpec
    on_done: Callable[[Completion], None]
    t0: float
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: Any = None  # torch.Generator for seeded requests
    matched_str: str | None = None
    held: bool = False  # came while paused or an update waited: outside SGLang's scheduler
    events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens) per change
    retractions: int = 0
    input_logprobs: list[float] | None = (
        None  # prompt logprobs, once computed (SeqSpec.input_start)
    )
    # Prompt tokens whose KV came from the prefix cache at its first prefill (SGLang's
    # cached_tokens: counted once, not again after a retraction); None: not prefilled yet.
    cached_tokens: int | None = None


def stop_reason(
    seq: Seq, eos: frozenset[int], decode: Callable[[list[int], bool], str]
) -> tuple[dict[str, Any] | None, str | None]:
    """The finish reason after the latest token, or (None, None) to go on (pure).

    Order: EOS (unless ignore_eos), stop_token_ids, stop strings, length.
    """
    p = seq.spec.params
    tok = seq.output_ids[-1]
    if (tok in eos and not p.ignore_eos) or tok in p.stop_token_ids:
        return {"type": "stop", "matched": tok}, None
    if p.stop:
        # Each token decodes to at least one character for non-special tokens,
        # so the last max(len(stop)) + 2 tokens cover any stop string's end.
        window = max(len(s) for s in p.stop) + 2
        tail = decode(seq.output_ids[-window:], p.skip_special_tokens)
        for s in p.stop:
            if s in tail:
                return {"type": "stop", "matched": s}, s
    if len(seq.output_ids) >= p.max_new_tokens:
        return {"type": "length", "length": p.max_new_tokens}, None
    return None, None


class UpdateRefused(FlywheelError, ValueError):
    """A weight update failed with the message SGLang answers (the old weights may serve)."""


@dataclass
class Update:
    """A pending weight update (the scheduler runs one at a time).

    `load` does it on the scheduler thread and returns SGLang's success message
    (from disk, or received from the weights-update group); it raises
    UpdateRefused with SGLang's failure message.
    """

    load: Callable[[], str]
    version: str | None
    flush: bool
    future: Future[tuple[bool, str, int]]
    locked: bool = True
    """Made while generation ran: SGLang's tokenizer manager then holds
    `model_update_lock`'s writer lock from before the scheduler sees the update
    until it has answered (flush included), so the update waits for every request
    admitted before it and requests arriving meanwhile reach the scheduler only
    after the answer. Made while paused: no lock; the scheduler loads at once."""


class SchedulerCrashed(SchedulerStopped):
    """The scheduler died the way SGLang's does (an assertion); the engine must exit."""


def answer(fut: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Settle a caller's future, unless the caller has gone: an HTTP handler cancelled
    by its client hanging up cancels the future it waits on, and setting a cancelled
    future raises (in this thread, which must not die of it)."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except InvalidStateError:
        log.info("a caller went before its answer (%s)", "error" if error else "result")
