"""Rows of a task's source: loading, the held-out split, and start-up checks.

A `Rows` is anything with `len()` and `row(i)`: a JSONL file is read once
into memory, a Hugging Face dataset and a reasoning-gym generator are
indexed lazily, the arithmetic task computes row i from (seed, i). Row i of
a source is the same in every service, which is what lets a PromptTask name
its row by index.

Bad records. A record without a prompt (or not JSON) is skipped and counted,
so one bad row cannot stop a run; but when fewer than half the records are
usable the field names are wrong, not the data, and loading fails with a
ConfigError naming the key to set (`prompt_field = "question"`).

The held-out splits (validation and test) are a seeded choice of prompts
(`eval.holdout`) removed from training, or separate sources
(services/common/tasks/taskset.py). Nothing downloads: reasoning-gym is
procedural and `datasets` runs with HF_DATASETS_OFFLINE=1.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from services.common import arithmetic
from services.common.errors import ConfigError
from services.common.tasks.episode_spec import FunctionTool
from services.common.tasks.spec import (
    ArithmeticSource,
    CustomReward,
    FunctionSource,
    HfSource,
    JsonlSource,
    MathAnswer,
    ReasoningGymSource,
    SourceSpec,
    TaskSpec,
    VerifiersSource,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One problem: a prompt (text or chat messages) and its reference answer."""

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    answer: str | None = None
    solution: str | None = None  # the answer as written (SFT target); `answer` may be cut


class Rows(Protocol):
    def __len__(self) -> int: ...
    def row(self, index: int) -> Row: ...


@dataclass(frozen=True)
class ListRows:
    rows: Sequence[Row]

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> Row:
        return self.rows[index]


@dataclass(frozen=True)
class ArithmeticRows:
    spec: ArithmeticSource

    def __len__(self) -> int:
        return self.spec.size

    def row(self, index: int) -> Row:
        s = self.spec
        p = arithmetic.problem(s.seed, index, s.digits, s.op, s.split or "train")
        return Row(prompt=p.prompt, answer=p.answer, solution=p.answer)


@dataclass(frozen=True)
class MappedRows:
    """Lazily converted records (a datasets.Dataset, a reasoning-gym dataset)."""

    data: Any
    fields: Any  # the source spec with the field names
    where: str

    def __len__(self) -> int:
        return len(self.data)

    def row(self, index: int) -> Row:
        row = to_row(self.data[index], self.fields)
        if isinstance(row, str):
            raise ConfigError(f"{self.where} row {index}: {row}")
        return row


def to_row(rec: Any, f: Any) -> Row | str:
    """A record as a Row, or why it is not one (a string)."""
    if not isinstance(rec, dict):
        return rec if isinstance(rec, str) else "not a JSON object"
    answer = rec.get(f.answer_field)
    answer = None if answer is None else str(answer)
    solution = answer
    if answer is not None and f.answer_marker:
        answer = answer.rpartition(f.answer_marker)[2].strip()
    msgs = rec.get(f.messages_field)
    if isinstance(msgs, list) and msgs:
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
            return f"'{f.messages_field}' must be a list of {{role, content}}"
        messages = tuple(
            {"role": str(m.get("role", "user")), "content": m["content"]} for m in msgs
        )
        return Row(messages=messages, answer=answer, solution=solution)
    prompt = rec.get(f.prompt_field)
    if not isinstance(prompt, str) or not prompt:
        return f"no '{f.prompt_field}' (string) or '{f.messages_field}' (list)"
    return Row(prompt=prompt, answer=answer, solution=solution)


def rows_from_records(records: Iterable[tuple[str, Any]], f: Any, key: str, what: str) -> ListRows:
    """Rows of `(where, record)` pairs; skips bad ones, fails when most are bad."""
    rows: list[Row] = []
    bad: list[str] = []
    seen: set[str] = set()
    for where, rec in records:
        r = to_row(rec, f)
        if isinstance(r, str):
            bad.append(f"{where}: {r}")
            if isinstance(rec, dict):
                seen.update(map(str, rec))
        else:
            rows.append(r)
    if len(rows) < len(bad) or not rows:
        hint = f" (fields seen: {', '.join(sorted(seen))})" if seen else ""
        raise ConfigError(
            f"{key}: {len(bad)} of {len(rows) + len(bad)} records of {what} are unusable, e.g. "
            f"{bad[0] if bad else 'none at all'}{hint}; set prompt_field / messages_field / "
            "answer_field to the names your records use"
        )
    if bad:
        log.warning("tasks: skipped %d bad records of %s, e.g. %s", len(bad), what, bad[0])
    return ListRows(rows)


def _jsonl_records(path: Path, key: str) -> Iterable[tuple[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as e:
        raise ConfigError(f"{key}.path: file not found: {path}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{key}.path: cannot read {path}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{n}", f"not JSON ({e})"


def load_rows(spec: SourceSpec, key: str = "[task] source") -> Rows:
    """The rows of a source; ConfigError names `key` (e.g. '[task] source') on failure."""
    if isinstance(spec, ArithmeticSource):
        return ArithmeticRows(spec)
    if isinstance(spec, JsonlSource):
        return rows_from_records(_jsonl_records(spec.path, key), spec, key, str(spec.path))
    if isinstance(spec, HfSource):
        return MappedRows(_hf_dataset(spec, key), spec, str(spec.path))
    if isinstance(spec, ReasoningGymSource):
        data = reasoning_gym_dataset(
            spec.dataset, json.dumps(spec.config, sort_keys=True), spec.seed, spec.size
        )
        return MappedRows(data, _RG_FIELDS, f"reasoning_gym:{spec.dataset}")
    if isinstance(spec, VerifiersSource):
        from services.common.tasks.verifiers_env import VerifiersRows  # imports this module

        return VerifiersRows(spec)
    assert isinstance(spec, FunctionSource)
    fn = import_function(spec.fn, f"{key}.fn")
    try:
        records = list(fn(**spec.kwargs))
    except Exception as e:
        raise ConfigError(f"{key}.fn: {spec.fn} raised {type(e).__name__}: {e}") from e
    return rows_from_records(
        ((f"{spec.fn}[{i}]", r) for i, r in enumerate(records)), spec, key, spec.fn
    )


@dataclass(frozen=True)
class _RgFields:
    prompt_field: str = "question"
    messages_field: str = "messages"
    answer_field: str = "answer"
    answer_marker: str | None = None


_RG_FIELDS = _RgFields()


@functools.lru_cache(maxsize=16)
def reasoning_gym_dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    """A reasoning-gym dataset (cached: the sandbox's scorer asks for it per completion)."""
    rg = require("reasoning_gym", "source type 'reasoning_gym'", "reasoning")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"reasoning_gym dataset {name!r}: {e}") from e


def _hf_dataset(spec: HfSource, key: str) -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never a hub, whatever the path says
    ds = require("datasets", "source type 'hf'", "datasets")
    p = spec.path
    if not p.exists():
        raise ConfigError(f"{key}.path: not found: {p}")
    formats = {
        ".parquet": "parquet",
        ".arrow": "arrow",
        ".json": "json",
        ".jsonl": "json",
        ".csv": "csv",
    }
    try:
        if p.is_dir():
            data = ds.load_from_disk(str(p))
        elif p.suffix in formats:
            data = ds.load_dataset(formats[p.suffix], data_files=str(p), split=spec.split)
        else:
            raise ConfigError(f"{key}.path: {p} is neither a saved dataset nor {sorted(formats)}")
    except (OSError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{key}.path: cannot load {p}: {e}") from e
    if isinstance(data, ds.DatasetDict):
        if spec.split not in data:
            raise ConfigError(f"{key}.split: {spec.split!r} not in {sorted(data)}")
        data = data[spec.split]
    return data


def require(module: str, what: str, extra: str) -> Any:
    """Import an optional package, or a ConfigError saying which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{what} needs the '{module}' package: pip install 'flywheel[{extra}]'"
        ) from e


def import_function(path: str, key: str) -> Any:
    """Import 'pkg.module:function'; ConfigError naming `key` if it cannot."""
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{key}: cannot import {path!r}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"{key}: {path!r} is not callable")
    return fn


def check_tool(tool: FunctionTool, key: str) -> None:
    """The function imports and accepts exactly the declared parameters (by keyword)."""
    import inspect

    fn = import_function(tool.fn, f"{key}.fn")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: checked by its calls
    try:
        sig.bind(**dict.fromkeys(tool.required))
        sig.bind(**dict.fromkeys(tool.parameters))
    except TypeError as e:
        raise ConfigError(
            f"{key}.parameters: {tool.fn} does not take {sorted(tool.parameters)} "
            f"(required {list(tool.required)}): {e}"
        ) from e


def check(name: str, spec: TaskSpec, key: str, *, data: bool) -> None:
    """Start-up checks that need the disk or optional packages (not the data itself).

    `data`: also check the sources' files exist and their packages import
    (the buffer, trainer and `flywheel up`; a rollout worker needs no data).
    """
    for i, part in enumerate(spec.reward):
        if isinstance(part, CustomReward):
            import_function(part.fn, f"{key} reward[{i}].fn")
        elif isinstance(part, MathAnswer) and not part.fallback:
            if importlib.util.find_spec("math_verify") is None:
                raise ConfigError(
                    f"{key} reward[{i}]: needs math-verify: pip install "
                    "'flywheel[math]' (or set fallback = true)"
                )
    for i, tool in enumerate(spec.episode.tools if spec.episode else ()):
        if isinstance(tool, FunctionTool):
            check_tool(tool, f"{key} episode.tools[{i}]")
    sources = [(f"{key} source", spec.source)]
    if spec.eval.source is not None:
        sources.append((f"{key} eval.source", spec.eval.source))
    if spec.eval.test_source is not None:
        sources.append((f"{key} eval.test_source", spec.eval.test_source))
    for skey, src in sources:
        if isinstance(src, ReasoningGymSource):
            require("reasoning_gym", f"{skey}: type 'reasoning_gym'", "reasoning")
        elif isinstance(src, VerifiersSource):
            require("verifiers", f"{skey}: type 'verifiers'", "verifiers")
        elif not data:
            continue
        elif isinstance(src, JsonlSource | HfSource) and not src.path.exists():
            raise ConfigError(f"{skey}.path: not found: {src.path} (from {Path.cwd()})")
        elif isinstance(src, HfSource):
            require("datasets", f"{skey}: type 'hf'", "datasets")
        elif isinstance(src, FunctionSource):
            import_function(src.fn, f"{skey}.fn")
