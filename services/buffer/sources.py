"""Where prompts come from: a `TaskSource` maps a dataset index to a prompt.

The buffer only needs `len(source)` and `source[i]`; the cursor decides the
order. Built in: the procedural arithmetic task (a fixed-size, seeded pool
so "epochs" mean something), JSONL files (`{"prompt", "answer"}` or
`{"messages", "answer"}` per line), and reasoning-gym datasets when that
package is installed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.common import arithmetic
from services.common.errors import ConfigError


@dataclass(frozen=True)
class TaskSpec:
    env: str
    answer: str | None
    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


class TaskSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> TaskSpec: ...


@dataclass(frozen=True)
class ArithmeticSource:
    """`size` problems of the built-in addition task, seeded."""

    seed: int
    size: int
    digits: int = 2
    env: str = "arithmetic"

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> TaskSpec:
        p = arithmetic.problem(self.seed, index, self.digits)
        return TaskSpec(env=self.env, prompt=p.prompt, answer=p.answer)


@dataclass(frozen=True)
class JsonlSource:
    """Rows of a JSONL file, loaded once; a bad row is a ConfigError naming its line."""

    rows: Sequence[TaskSpec]

    @classmethod
    def load(cls, path: str | Path, env: str) -> JsonlSource:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"dataset not found: {p}")
        rows: list[TaskSpec] = []
        for n, line in enumerate(p.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                messages = row.get("messages")
                rows.append(
                    TaskSpec(
                        env=env,
                        prompt=row.get("prompt"),
                        messages=tuple(messages) if messages else None,
                        answer=None if row.get("answer") is None else str(row["answer"]),
                    )
                )
            except (json.JSONDecodeError, AttributeError, TypeError) as e:
                raise ConfigError(f"{p}:{n}: not a JSON object with prompt/answer ({e})") from e
            if rows[-1].prompt is None and rows[-1].messages is None:
                raise ConfigError(f"{p}:{n}: needs 'prompt' or 'messages'")
        if not rows:
            raise ConfigError(f"dataset {p} is empty")
        return cls(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> TaskSpec:
        return self.rows[index]


@dataclass(frozen=True)
class ReasoningGymSource:
    """A reasoning-gym dataset (optional dependency), materialised at start."""

    rows: Sequence[TaskSpec]

    @classmethod
    def load(cls, name: str, size: int, seed: int) -> ReasoningGymSource:
        try:
            import reasoning_gym
        except ImportError as e:
            raise ConfigError("source 'reasoning_gym' needs `pip install reasoning-gym`") from e
        data = reasoning_gym.create_dataset(name, size=size, seed=seed)
        return cls(
            [
                TaskSpec(env=f"reasoning_gym:{name}", prompt=e["question"], answer=str(e["answer"]))
                for e in data
            ]
        )

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> TaskSpec:
        return self.rows[index]
