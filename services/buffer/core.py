"""The buffer's pure core: dataset cursor, group assembly, fail-fast watch.

No I/O here: the NATS adapter (services.buffer.app) feeds events in and
carries decisions out. All state that must survive a restart is in
`BufferState`, which the adapter persists (JetStream KV) before it acks the
message that changed it.

Versions and steps. Weight version v is the model after v optimizer steps
(proto/weight_version.py says what a version is); step s trains batch s
with version s and produces version s + 1. A group generated with version w (the oldest
version any of its tokens came from) may train at step s only if
`w >= s - k`, k = max_staleness. k = 0 is synchronous on-policy RL.

Admission (how many tasks to dispatch) is in services.buffer.admission.
"""

from __future__ import annotations

import importlib
import math
import random
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from proto.messages import PromptTask, SampleGroup, SamplingParams
from services.buffer.admission import FilterRate, Policy
from services.runtime.errors import ConfigError
from services.tasks.prompts import format_row
from services.tasks.taskset import LoadedTask, TrainOrder

if TYPE_CHECKING:
    from services.buffer.settings import BufferSettings


# ── dataset cursor ────────────────────────────────────────────────────────────
@dataclass(frozen=True)
class Cursor:
    """Position in the dataset: `offset` prompts into `epoch`'s shuffled order."""

    epoch: int = 0
    offset: int = 0


def epoch_order(seed: int, epoch: int, size: int) -> list[int]:
    """The dataset indices in `epoch`'s order: a seeded shuffle, new every epoch."""
    order = list(range(size))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


def advance(cursor: Cursor, size: int, n: int) -> tuple[Cursor, list[tuple[int, int]]]:
    """Take `n` prompts from `cursor`: the new cursor and `(epoch, position)` pairs."""
    taken: list[tuple[int, int]] = []
    epoch, offset = cursor.epoch, cursor.offset
    for _ in range(n):
        if offset >= size:
            epoch, offset = epoch + 1, 0
        taken.append((epoch, offset))
        offset += 1
    return Cursor(epoch, offset), taken


def task_id(run: str, epoch: int, position: int) -> str:
    """Deterministic task id (proto/README.md): a re-dispatch after a crash is a duplicate."""
    return f"{run}:e{epoch}:i{position}"


_POSITION = re.compile(r":e(\d+):i(\d+)$")


def position_of(tid: str) -> tuple[int, int] | None:
    """`(epoch, position)` of a task id `task_id` made (None: not one of ours)."""
    m = _POSITION.search(tid)
    return (int(m[1]), int(m[2])) if m else None


class PromptTaskMaker:
    """The PromptTask (the unit of work) at a dataset position: a row of one of the run's
    tasks, formatted by its spec.

    `task_name` names the task (its key in the run file's task spec) and `index`
    the row of that task's source: every service resolves the reward and
    the formatting from them. Each epoch visits the rows in its own seeded
    order (`epoch_order`), computed once per epoch.
    """

    def __init__(
        self,
        run: str,
        loaded: dict[str, LoadedTask],
        *,
        seed: int,
        n: int,
        sampling: SamplingParams,
    ) -> None:
        self.run, self.loaded, self.seed, self.n, self.sampling = run, loaded, seed, n, sampling
        self.order = TrainOrder.build(loaded)
        self._slots: dict[int, list[int]] = {}  # epoch -> its order; the two newest kept

    def __len__(self) -> int:
        return len(self.order)

    def task(self, epoch: int, offset: int, min_version: int, now: float) -> PromptTask:
        """The task at `offset` of `epoch`; ConfigError (or ValueError): a bad row."""
        name, row_index = self.order.item(epoch, self._slot(epoch, offset))
        spec = self.loaded[name].spec
        row = self.loaded[name].rows.row(row_index)
        prompt, messages = format_row(spec, row)
        return PromptTask(
            run=self.run,
            task_id=task_id(self.run, epoch, offset),
            epoch=epoch,
            index=row_index,
            task_name=name,
            prompt=prompt,
            messages=messages,
            answer=row.answer,
            n=self.n,
            sampling=self.sampling,
            min_weight_version=min_version,
            created_at=now,
        )

    def key(self, epoch: int, offset: int) -> tuple[str, int]:
        """The prompt at `offset` of `epoch`: its task's name and row (the curriculum's key)."""
        return self.order.item(epoch, self._slot(epoch, offset))

    def _slot(self, epoch: int, offset: int) -> int:
        # Two epochs are kept: groups of the last epoch still arrive while the next
        # is dispatched, and each look-up of another epoch would reshuffle the dataset.
        if epoch not in self._slots:
            self._slots[epoch] = epoch_order(self.seed, epoch, len(self.order))
            for old in sorted(e for e in self._slots if e != epoch)[:-1]:
                del self._slots[old]
        return self._slots[epoch][offset]


# ── group assembly ────────────────────────────────────────────────────────────
class Verdict(StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    UNSCORED = "unscored"  # too few samples whose reward could be computed
    STALE = "stale"
    ZERO_VARIANCE = "zero_variance"
    TOO_LONG = "too_long"
    CUSTOM_FILTER = "custom_filter"


GroupFilter = Callable[[SampleGroup], str | None]
"""A filter returns a drop reason, or None to keep the group."""


def scored_part(group: SampleGroup) -> SampleGroup:
    """The group without its samples whose reward could not be computed.

    A verifier that timed out, crashed or raised gave its sample reward 0
    with a `verifier_error`: not a judgement of the completion (a right
    answer whose checker timed out would be pushed down), so the sample is
    never trained on, and the group's mean and std (the trainer's GRPO
    baseline, over the samples a batch holds) are of the scored samples
    alone. Deterministic: a batch re-read from the stream after a restart
    is rebuilt the same, byte for byte.
    """
    kept = tuple(s for s in group.samples if s.verifier_error is None)
    if len(kept) == len(group.samples):
        return group
    return group.model_copy(update={"samples": kept})


def min_scored(setting: int | None, n: int) -> int:
    """Scored samples a group of `n` needs to train (`[buffer] min_scored_per_group`)."""
    return min(n, setting if setting is not None else max(2, -(-n // 2)))


def unscored(group: SampleGroup) -> int:
    """How many of the group's samples have no reward (a verifier error)."""
    return sum(s.verifier_error is not None for s in group.samples)


def zero_variance(group: SampleGroup) -> str | None:
    """DAPO dynamic sampling: a group whose rewards are all equal has zero advantage."""
    rewards = {s.reward for s in group.samples}
    return Verdict.ZERO_VARIANCE if len(rewards) <= 1 else None


def max_length(limit: int) -> GroupFilter:
    """Drop groups with a response longer than `limit` tokens."""

    def check(group: SampleGroup) -> str | None:
        longest = max(s.num_response_tokens for s in group.samples)
        return Verdict.TOO_LONG if longest > limit else None

    return check


def import_filter(ref: str) -> GroupFilter:
    """A user's filter named `module:function`; ConfigError (exit 2 at start-up) if absent."""
    module, _, name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"[buffer] custom_filter {ref!r} cannot be imported: {e}") from e


def make_filters(s: BufferSettings) -> list[GroupFilter]:
    """The filters `[buffer]` asks for, in the order a group meets them."""
    filters: list[GroupFilter] = []
    if s.filter_zero_variance:
        filters.append(zero_variance)
    if s.max_response_tokens is not None:
        filters.append(max_length(s.max_response_tokens))
    if s.custom_filter:
        filters.append(import_filter(s.custom_filter))
    return filters


@dataclass
class BufferState:
    """Everything the buffer must remember across a restart."""

    cursor: Cursor = field(default_factory=Cursor)
    dispatched: int = 0  # tasks published, ever
    answered: int = 0  # tasks answered by a group (any verdict but duplicate) or a dead letter
    next_step: int = 0  # step of the next batch to publish
    # group id -> (step, verdict): the step it was batched in with "accepted",
    # or the step being filled when it was dropped, with the drop reason. Only
    # ids that could still be redelivered matter; `forget_before` prunes the rest.
    settled: dict[str, tuple[int, str]] = field(default_factory=dict)
    ready_version: int = 0  # newest version every engine serves

    @property
    def in_flight(self) -> int:
        return self.dispatched - self.answered


@dataclass
class Assembler:
    """Orders accepted groups into batches of exactly G, checking staleness on entry."""

    policy: Policy
    state: BufferState
    filters: Sequence[GroupFilter] = (zero_variance,)
    pending: list[SampleGroup] = field(default_factory=list)
    filter_rate: FilterRate | None = None  # default: learned over 8 batches of groups
    forgotten_below: int = 0  # settled ids of steps before this one are forgotten
    min_scored: int | None = None  # [buffer] min_scored_per_group
    # Refill ([buffer] refill_max_share): a flat group's slot is filled by a recent
    # group that had a reward spread and already trained, at most `refill_max` per
    # batch, each recent group at most once, its version w >= s - refill_max_staleness,
    # and never staler than max_staleness allows any sample (`_refill_floor`).
    refill_max: int = 0
    refill_max_staleness: int = 2
    recent: deque[SampleGroup] = field(default_factory=deque)  # batched, with a spread
    refilled: dict[int, int] = field(default_factory=dict)  # step -> refills going into it
    refill_ids: set[str] = field(default_factory=set)  # pending groups that are refills
    last_refill: SampleGroup | None = None  # what the last offer refilled (the adapter's seq)

    def __post_init__(self) -> None:
        if self.filter_rate is None:
            self.filter_rate = FilterRate(horizon=8 * self.policy.groups_per_step)

    @property
    def rate(self) -> float:
        """The learned share of groups the filters drop (admission's over-sampling)."""
        return self.filter_rate.rate if self.filter_rate is not None else 0.0

    @property
    def evidence(self) -> float:
        """How many groups `rate` stands for (admission's confidence in it)."""
        return self.filter_rate.evidence if self.filter_rate is not None else math.inf

    @property
    def filled(self) -> int:
        return self.state.next_step * self.policy.groups_per_step + len(self.pending)

    def target_step(self) -> int:
        """The step the next accepted group would train at."""
        return self.state.next_step + len(self.pending) // self.policy.groups_per_step

    def offer(self, group: SampleGroup) -> str:
        """Decide one arriving group; returns a Verdict (or a custom filter's reason)."""
        gid = group.group_id
        self.last_refill = None
        if gid in self.state.settled:
            # Redelivered. A dropped group gets its drop reason again, so a crash
            # between deciding and dead-lettering cannot lose its dead letter.
            verdict = self.state.settled[gid][1]
            return Verdict.DUPLICATE if verdict == Verdict.ACCEPTED else verdict
        if any(p.group_id == gid for p in self.pending):
            return Verdict.DUPLICATE
        self.state.answered += 1
        scored = scored_part(group)
        reason = self._drop_reason(group, scored)
        self.last_refill = self._refill() if reason == Verdict.ZERO_VARIANCE else None
        if self.filter_rate is not None:  # a stale group passed the filters; a refill fills
            filtered = reason is not None and reason != Verdict.STALE
            self.filter_rate.observe(filtered and self.last_refill is None)
        if reason is not None:
            self.state.settled[gid] = (self.state.next_step, reason)
            return reason
        self.pending.append(scored)
        return Verdict.ACCEPTED

    def _drop_reason(self, group: SampleGroup, scored: SampleGroup) -> str | None:
        """Why `group` is dropped (None: it trains as `scored`, its scored samples)."""
        if len(scored.samples) < min_scored(self.min_scored, len(group.samples)):
            return Verdict.UNSCORED
        for check in self.filters:
            reason = check(scored)
            if reason is not None:
                return reason
        if scored.weight_version < self.target_step() - self.policy.max_staleness:
            return Verdict.STALE
        return None

    def take_batch(self) -> tuple[int, list[SampleGroup]] | None:
        """The next full batch `(step, groups)`, marking its groups settled."""
        g = self.policy.groups_per_step
        if len(self.pending) < g:
            return None
        groups, self.pending = self.pending[:g], self.pending[g:]
        step = self.state.next_step
        self.refilled.pop(step, None)
        for grp in groups:
            self.state.settled[grp.group_id] = (step, Verdict.ACCEPTED)
            if grp.group_id in self.refill_ids:  # a refill is not kept: twice at most
                self.refill_ids.discard(grp.group_id)
            elif self.refill_max > 0 and zero_variance(grp) is None:
                self.recent.append(grp)
        self.state.next_step += 1
        self._prune_recent()
        return step, groups

    def _refill(self) -> SampleGroup | None:
        """A recent group for the slot a flat group leaves empty (None: none may)."""
        target = self.target_step()
        if self.refill_max <= 0 or self.refilled.get(target, 0) >= self.refill_max:
            return None
        floor = self._refill_floor(target)
        for i in range(len(self.recent) - 1, -1, -1):  # the newest first
            grp = self.recent[i]
            if grp.weight_version >= floor and grp.group_id not in self._pending_ids():
                del self.recent[i]
                self.pending.append(grp)
                self.refill_ids.add(grp.group_id)
                self.refilled[target] = self.refilled.get(target, 0) + 1
                return grp
        return None

    def _refill_floor(self, step: int) -> int:
        """The oldest version a group refilled into `step` may have. max_staleness bounds a
        refill as it bounds a fresh sample: a run that asks for synchronous on-policy
        training (0) gets no refill (a refilled group has trained once, so it is at least
        a step stale), and the demo's `staleness_max <= 1` holds with max_staleness 1."""
        return step - min(self.refill_max_staleness, self.policy.max_staleness)

    def _pending_ids(self) -> set[str]:
        return {p.group_id for p in self.pending}

    def _prune_recent(self) -> None:
        """Keep the groups a refill could still take (and at most 4 batches of them)."""
        floor = self._refill_floor(self.state.next_step)
        keep = [grp for grp in self.recent if grp.weight_version >= floor]
        self.recent = deque(keep[-4 * self.policy.groups_per_step :])

    def task_dead_lettered(self) -> None:
        """A task ended in the dead-letter queue without a group: it is answered."""
        self.state.answered += 1

    def forget_before(self, step: int) -> None:
        """Drop settled ids of batches before `step`, bounding the state.

        Safe once their messages can no longer come back (see `settled_horizon`). Ids
        are settled at the step being filled or later, so a step already forgotten
        has none: the scan runs once per step, not per group.
        """
        if step <= self.forgotten_below:
            return
        self.state.settled = {k: v for k, v in self.state.settled.items() if v[0] >= step}
        self.forgotten_below = step

    def forget_settled(
        self, step_starts: dict[int, float], now: float, keep_s: float, keep_steps: int
    ) -> dict[int, float]:
        """Forget ids settled over `keep_steps` steps and `keep_s` seconds ago (when each
        step began filling: `step_starts`, which is returned pruned)."""
        starts = {**step_starts, self.state.next_step: step_starts.get(self.state.next_step, now)}
        horizon = settled_horizon(starts, now, keep_s)
        if horizon is None:
            return starts
        self.forget_before(min(self.state.next_step - keep_steps, horizon))
        return {s: t for s, t in starts.items() if s >= horizon}


def settled_horizon(step_starts: dict[int, float], now: float, keep_s: float) -> int | None:
    """The step before which every settled id is at least `keep_s` seconds old (None: none).

    An acked message is not redelivered, but an ack can be lost: the buffer
    killed between persisting its decision and acking, or a nats-server
    killed before it stored the ack (then an acked task comes back too, and
    its group is generated again). Such a message returns after its
    consumer's ack wait, which may be many steps later when steps are
    fast; forgotten by then, its group was decided again: trained twice,
    or trained and dead-lettered, and counted as answered twice (admission
    then dispatched one task too many for the rest of the run). So an id
    is kept for a time, not only for a number of steps. `step_starts[s]`:
    when the buffer began filling step s; an id settled at step s was
    settled before step s + 1 began.
    """
    old = [s for s, t in step_starts.items() if t <= now - keep_s]
    return max(old) if old else None


# ── fail fast ─────────────────────────────────────────────────────────────────
_VARYING = re.compile(r"'[^']*'|\"[^\"]*\"|\d+")


def failure_signature(reason: str, error: str) -> str:
    """What stays the same when the same bug hits every task: the reason and the
    error's first line with quoted strings and numbers (ids, rows, counts) masked."""
    first = error.strip().split("\n", 1)[0]
    return f"{reason}: {_VARYING.sub('…', first)}"


@dataclass
class FailureWatch:
    """Counts tasks failing the same way in a row; any answered task resets the count.

    A bad row fails alone and costs one dead letter; a systematic error (a
    reward that raises on everything, a tokenizer that refuses every
    prompt, a task name the workers do not know) fails every task with the
    same signature, and after `limit` in a row the run must stop.
    """

    limit: int
    streak: int = 0
    signature: str | None = None
    example: str = ""

    def succeeded(self) -> None:
        self.streak, self.signature = 0, None

    def failed(self, reason: str, error: str) -> bool:
        """Record one failed task; True once `limit` in a row failed the same way."""
        sig = failure_signature(reason, error)
        if sig == self.signature:
            self.streak += 1
        else:
            self.signature, self.streak = sig, 1
        self.example = f"{reason}: {error.strip()}"
        return 0 < self.limit <= self.streak


def group_failure(group: SampleGroup) -> str | None:
    """The verifier error shared by every sample of a group, or None if any scored."""
    errors = [s.verifier_error for s in group.samples]
    return errors[0] if errors and all(errors) else None
