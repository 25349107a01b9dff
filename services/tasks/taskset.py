"""A run's tasks by name, their training order and their held-out rows.

`TaskSet.from_settings` resolves the run file's `[task]` (one task, named
after its source: "arithmetic", "jsonl", "reasoning_gym:leg_counting", …)
or `[tasks.<name>]` tables (a mixture). The buffer walks `TrainOrder`: an
epoch has one slot per training row of every task, or, with weights, each
task's share of them; slot → (task, row of its source), and a task with
fewer slots than rows moves on through its rows from epoch to epoch. The
buffer shuffles the slots per epoch, so the mixture is interleaved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.runtime.errors import ConfigError
from services.tasks.episode_spec import FunctionTool
from services.tasks.registry import Row, Rows, SourceSpec
from services.tasks.sources import check_tool, load_rows
from services.tasks.spec import TaskSpec

if TYPE_CHECKING:
    import numpy as np


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


def holdout_mask(n: int, fraction: float, seed: int) -> np.ndarray:
    """Which of `n` rows are held out: a seeded coin per row (the same in every service)."""
    import numpy as np

    return np.random.default_rng([seed, 1_000_003]).random(n) < fraction


@dataclass
class LoadedTask:
    name: str
    spec: TaskSpec
    rows: Rows  # the training source
    train: Sequence[int]  # its row indices that train (all but the held-out ones)
    held_out: list[tuple[int, Row]]  # (index in eval_source, row), at most eval.size
    eval_source: SourceSpec  # where held-out indices point: eval.source or the source


def load_task(name: str, spec: TaskSpec, key: str, eval_size: int | None = None) -> LoadedTask:
    """Load a task's rows and split them (ConfigError names `key` on failure);
    `eval_size` overrides eval.size (how many held-out rows are kept)."""
    import numpy as np

    rows = load_rows(spec.source, f"{key} source")
    e = spec.eval
    size = eval_size or e.size
    train: Sequence[int] = range(len(rows))
    held: list[tuple[int, Row]] = []
    if e.source is not None:
        erows = load_rows(e.source, f"{key} eval.source")
        held = [(i, erows.row(i)) for i in range(min(size, len(erows)))]
    elif e.holdout > 0:
        mask = holdout_mask(len(rows), e.holdout, e.seed)
        train = np.flatnonzero(~mask).tolist()
        held = [(int(i), rows.row(int(i))) for i in np.flatnonzero(mask)[:size]]
        if not train or not held:
            raise ConfigError(
                f"{key} eval.holdout: {e.holdout} of {len(rows)} rows leaves "
                f"{len(train)} to train and {len(held)} to evaluate"
            )
    return LoadedTask(name, spec, rows, train, held, e.source or spec.source)


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
        self.check(data=True)
        return {n: load_task(n, s, self.keys[n], eval_size) for n, s in self.specs.items()}


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
