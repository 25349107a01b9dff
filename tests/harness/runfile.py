"""A run file's TOML text from keyword tables, for tests that write their own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str | Path):
        return json.dumps(str(v))
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return repr(v)


def run_file(run: str, **sections: dict[str, Any]) -> str:
    """`run = …`, then one table per keyword (nested dicts as sub-tables)."""
    lines = [f'run = "{run}"']

    def table(name: str, body: dict[str, Any]) -> None:
        lines.append(f"\n[{name}]")
        nested = {k: v for k, v in body.items() if isinstance(v, dict)}
        lines.extend(f"{k} = {_value(v)}" for k, v in body.items() if not isinstance(v, dict))
        for k, v in nested.items():
            table(f"{name}.{k}", v)

    for name, body in sections.items():
        table(name, body)
    return "\n".join(lines) + "\n"
