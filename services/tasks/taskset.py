"""A run's tasks by name, their training order and their held-out rows.

`TaskSet.from_settings` resolves the run file's `[task]` (one task, named
after its source: "arithmetic", "jsonl", "reasoning_gym:leg_counting", …)
or `[tasks.<name>]` tables (a mixture). `load_task` splits a task's rows
into training rows and two held-out splits, validation and test, that
share no prompt with training. The buffer walks `TrainOrder`: an
epoch has one slot per training row of every task, or, with weights, each
task's share of them; slot → (task, row of its source), and a task with
fewer slots than rows moves on through its rows from epoch to epoch. The
buffer shuffles the slots per epoch, so the mixture is interleaved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Literal

from services.runtime.errors import ConfigError
from services.tasks.episode_spec import FunctionTool
from services.tasks.registry import Row, Rows, SourceSpec
from services.tasks.sources import check_tool, load_rows
from services.tasks.spec import TaskSpec

Split = Literal["validation", "test"]
"""The held-out splits: validation chooses checkpoints, test is reported."""


def task_name(spec: TaskSpec) -> str:
    """The name of a lone `[task]`: its source type (reasoning-gym: with the generator)."""
    return spec.source.task_name()


def check(name: str, spec: TaskSpec, key: str, *, data: bool) -> None:
    """Start-up checks that need the disk or optional packages (not the data itself).

    `data`: also check the sources' files exist and their packages import
    (the buffer, trainer and `flywheel up`; a rollout worker needs no data).
    """
    for i, part in enumerate(spec.reward):
        part.check(f"{key} reward[{i}]")
    for i, tool in enumerate(spec.episode.tools if spec.episode else ()):
        if isinstance(tool, FunctionTool):
            check_tool(tool, f"{key} episode.tools[{i}]")
    spec.source.check(f"{key} source", data=data)
    if spec.eval.source is not None:
        spec.eval.source.check(f"{key} eval.source", data=data)
    if spec.eval.test_source is not None:
        spec.eval.test_source.check(f"{key} eval.test_source", data=data)


def prompt_key(row: Row) -> str:
    """What makes two rows one problem: the prompt's text (chat rows: the messages)."""
    if row.prompt is not None:
        return row.prompt
    return json.dumps(row.messages, sort_keys=True)


def holdout_share(key: str, seed: int) -> float:
    """A prompt's place in [0, 1): a seeded hash of its text, the same in every service
    and for every copy of the prompt (JSONL files repeat rows)."""
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@dataclass
class LoadedTask:
    name: str
    spec: TaskSpec
    rows: Rows  # the training source
    train: Sequence[int]  # its row indices that train (no held-out prompt among them)
    validation: list[tuple[int, Row]]  # (index in validation_source, row), distinct prompts
    test: list[tuple[int, Row]]  # (index in test_source, row), distinct prompts
    validation_source: SourceSpec  # where those indices point: eval.source or the source
    test_source: SourceSpec  # eval.test_source or the source
    held_keys: frozenset[str] = frozenset()  # every held-out prompt (mixtures: see TaskSet.load)

    def held_out(self, split: Split) -> list[tuple[int, Row]]:
        return self.validation if split == "validation" else self.test

    def source_of(self, split: Split) -> SourceSpec:
        return self.validation_source if split == "validation" else self.test_source


def _distinct(
    rows: Rows,
    size: int,
    banned: AbstractSet[str] = frozenset(),
    where: Iterable[int] | None = None,
) -> list[tuple[int, Row]]:
    """The first `size` rows (of `where`, default all) with a prompt not seen before."""
    seen = set(banned)
    out: list[tuple[int, Row]] = []
    for i in range(len(rows)) if where is None else where:
        if len(out) >= size:
            break
        row = rows.row(int(i))
        k = prompt_key(row)
        if k not in seen:
            seen.add(k)
            out.append((int(i), row))
    return out


def _keys(rows: Rows | None) -> set[str]:
    return set() if rows is None else {prompt_key(rows.row(i)) for i in range(len(rows))}


def load_task(name: str, spec: TaskSpec, key: str, eval_size: int | None = None) -> LoadedTask:
    """Load a task's rows and split them (ConfigError names `key` on failure);
    `eval_size` overrides eval.size (how many held-out rows of each split are kept).

    No held-out prompt is ever a training row. Separate sources: the
    arithmetic task's splits are disjoint parts of the problem space
    (services/tasks/arithmetic.py); any other source's prompts are dropped
    from training wherever they occur in it. `holdout`: a prompt is held out
    by a seeded hash of its text, so every copy of it is; the held-out
    prompts are split into test (`test_share`) and validation the same way.
    """
    rows = load_rows(spec.source, f"{key} source")
    e = spec.eval
    size = eval_size or e.size
    train: Sequence[int] = range(len(rows))
    validation: list[tuple[int, Row]] = []
    test: list[tuple[int, Row]] = []
    held: set[str] = set()
    if e.source is not None:
        vrows = load_rows(e.source, f"{key} eval.source")
        trows = load_rows(e.test_source, f"{key} eval.test_source") if e.test_source else None
        apart = all(s.splits_apart for s in (spec.source, *e.sources))
        vkeys = set() if apart else _keys(vrows)
        validation = _distinct(vrows, size)
        test = _distinct(trows, size, banned=vkeys) if trows is not None else []
        held = {prompt_key(r) for _, r in validation + test}
        if not apart:  # by construction for arithmetic splits; by prompt for the rest
            held = vkeys | _keys(trows)
            train = [i for i in range(len(rows)) if prompt_key(rows.row(i)) not in held]
    elif e.holdout > 0:
        shares = [holdout_share(prompt_key(rows.row(i)), e.seed) for i in range(len(rows))]
        cut = e.holdout * e.test_share
        train = [i for i, u in enumerate(shares) if u >= e.holdout]
        held = {prompt_key(rows.row(i)) for i, u in enumerate(shares) if u < e.holdout}
        test = _distinct(rows, size, where=(i for i, u in enumerate(shares) if u < cut))
        validation = _distinct(
            rows, size, where=(i for i, u in enumerate(shares) if cut <= u < e.holdout)
        )
        if not train or not validation or (e.test_share > 0 and not test):
            raise ConfigError(
                f"{key} eval.holdout: {e.holdout} of {len(rows)} rows leaves {len(train)} to "
                f"train, {len(validation)} prompts to validate and {len(test)} to test"
            )
    if e.enabled and not train:
        raise ConfigError(f"{key} source: every training prompt is also a held-out prompt")
    vsource = e.source or spec.source
    tsource = e.test_source or vsource
    return LoadedTask(name, spec, rows, train, validation, test, vsource, tsource, frozenset(held))


class TaskSet:
    """The run's tasks by name, as validated by the settings (no data loaded yet)."""

    def __init__(self, specs: dict[str, TaskSpec], keys: dict[str, str]) -> None:
        if not specs:
            raise ConfigError(
                "[task] missing: the run file names no task; add a [task] table, e.g.\n"
                '  [task]\n  source = { type = "jsonl", path = "data/train.jsonl" }\n'
                '  reward = "math"'
            )
        self.specs = specs
        self.keys = keys  # name -> how the run file spells it, for errors: "[task]"

    @classmethod
    def from_fields(cls, task: TaskSpec | None, tasks: dict[str, TaskSpec]) -> TaskSet:
        if task is not None and tasks:
            raise ConfigError("[task] and [tasks.<name>]: give one task or a mixture, not both")
        if task is not None:
            return cls({task_name(task): task}, {task_name(task): "[task]"})
        return cls(dict(tasks), {n: f"[tasks.{n}]" for n in tasks})

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def spec(self, name: str) -> TaskSpec | None:
        return self.specs.get(name)

    def check(self, *, data: bool) -> None:
        for name, spec in self.specs.items():
            check(name, spec, self.keys[name], data=data)

    def load(self, eval_size: int | None = None) -> dict[str, LoadedTask]:
        """Every task loaded; in a mixture, no task trains on another's held-out prompts."""
        self.check(data=True)
        loaded = {n: load_task(n, s, self.keys[n], eval_size) for n, s in self.specs.items()}
        for name, t in loaded.items():
            others = frozenset().union(*(o.held_keys for n, o in loaded.items() if n != name))
            if others:
                t.train = [i for i in t.train if prompt_key(t.rows.row(int(i))) not in others]
                if not t.train:
                    raise ConfigError(f"{self.keys[name]} source: every training prompt is "
                                      "held out by another task of the mixture")  # fmt: skip
        return loaded


@dataclass
class TrainOrder:
    """Slots of an epoch → (task name, row index in its source)."""

    tasks: list[LoadedTask]
    counts: list[int]  # slots per epoch of each task

    @classmethod
    def build(cls, loaded: dict[str, LoadedTask]) -> TrainOrder:
        tasks = list(loaded.values())
        total = sum(len(t.train) for t in tasks)
        if all(t.spec.weight is None for t in tasks):
            return cls(tasks, [len(t.train) for t in tasks])
        weights = [t.spec.weight or len(t.train) / max(total, 1) for t in tasks]
        w = sum(weights)
        return cls(tasks, [max(1, round(total * x / w)) for x in weights])

    def __len__(self) -> int:
        return sum(self.counts)

    def item(self, epoch: int, slot: int) -> tuple[str, int]:
        for t, c in zip(self.tasks, self.counts, strict=True):
            if slot < c:
                k = (epoch * c + slot) % len(t.train) if c != len(t.train) else slot
                return t.name, int(t.train[k])
            slot -= c
        raise IndexError(slot)
