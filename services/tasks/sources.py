"""The file and function sources (`jsonl`, `hf`, `function`), and what every source uses.

A source's `rows` are anything with `len()` and `row(i)` (registry.Rows): a
JSONL file is read once into memory, a Hugging Face dataset and a
reasoning-gym generator are indexed lazily, the arithmetic task computes
row i from (seed, i). Row i of a source is the same in every service, which
is what lets a PromptTask name its row by index. The other built-in sources
live with their task: arithmetic.py, reasoning_gym.py, verifiers_env.py.

Bad records. A record without a prompt (or not JSON) is skipped and counted,
so one bad row cannot stop a run; but when fewer than half the records are
usable the field names are wrong, not the data, and loading fails with a
ConfigError naming the key to set (`prompt_field = "question"`).

The held-out splits (validation and test) are a seeded choice of prompts
(`eval.holdout`) removed from training, or separate sources
(services/tasks/taskset.py). Nothing downloads: reasoning-gym is
procedural and `datasets` runs with HF_DATASETS_OFFLINE=1.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from services.runtime.errors import ConfigError
from services.runtime.settings import RunPath
from services.tasks.episode_spec import FunctionTool
from services.tasks.registry import FN_PATH, SOURCES, Row, Rows, SourceSpec

__all__ = ["Row", "Rows", "load_rows"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ListRows:
    rows: Sequence[Row]

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, index: int) -> Row:
        return self.rows[index]


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
    return spec.rows(key)


# ── the file and function sources ───────────────────────────────────────────
class Fields(SourceSpec):
    """Which fields of a record hold the prompt and the answer."""

    prompt_field: str = Field(
        "prompt", description="Field holding the prompt text (e.g. 'question', 'problem')."
    )
    messages_field: str = Field(
        "messages", description="Field holding chat messages [{role, content}] (used if present)."
    )
    answer_field: str = Field(
        "answer", description="Field holding the reference answer (e.g. 'solution')."
    )
    answer_marker: str | None = Field(
        None,
        description="Keep only the answer's text after the last occurrence of this marker "
        "(GSM8K: '####'); the full text stays the SFT target of `flywheel init-model`.",
    )


@SOURCES.register
class JsonlSource(Fields):
    """A local JSONL file, one record per line."""

    type: Literal["jsonl"]
    path: RunPath = Field(
        description="The JSONL file (`~`: your home; relative paths: from the working directory)."
    )

    def rows(self, key: str) -> Rows:
        return rows_from_records(_jsonl_records(self.path, key), self, key, str(self.path))

    def check(self, key: str, *, data: bool) -> None:
        if data and not self.path.exists():
            raise ConfigError(f"{key}.path: not found: {self.path} (from {Path.cwd()})")


@SOURCES.register
class HfSource(Fields):
    """A local Hugging Face `datasets` directory or a Parquet/Arrow/JSON/CSV file.

    Needs the `datasets` package (extra: datasets).
    """

    type: Literal["hf"]
    path: RunPath = Field(
        description="A directory written by Dataset.save_to_disk, or a .parquet/.arrow/"
        ".json/.jsonl/.csv file. Nothing is downloaded."
    )
    split: str = Field("train", description="Split to read when the data has several.")

    def rows(self, key: str) -> Rows:
        return MappedRows(_hf_dataset(self, key), self, str(self.path))

    def check(self, key: str, *, data: bool) -> None:
        if not data:
            return
        if not self.path.exists():
            raise ConfigError(f"{key}.path: not found: {self.path} (from {Path.cwd()})")
        require("datasets", f"{key}: type 'hf'", "datasets")


@SOURCES.register
class FunctionSource(Fields):
    """Rows from a user function `pkg.module:function(**kwargs)` returning an iterable of dicts."""

    type: Literal["function"]
    fn: str = Field(pattern=FN_PATH, description="'pkg.module:function' returning rows.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of fn.")

    def rows(self, key: str) -> Rows:
        f = import_function(self.fn, f"{key}.fn")
        try:
            records = list(f(**self.kwargs))
        except Exception as e:
            raise ConfigError(f"{key}.fn: {self.fn} raised {type(e).__name__}: {e}") from e
        return rows_from_records(
            ((f"{self.fn}[{i}]", r) for i, r in enumerate(records)), self, key, self.fn
        )

    def check(self, key: str, *, data: bool) -> None:
        if data:
            import_function(self.fn, f"{key}.fn")


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
