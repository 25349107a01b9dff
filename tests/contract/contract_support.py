"""The SGLang contract fixtures and what runs them (tests/contract/fixtures/*.json).

Each fixture file holds request/response pairs of one SGLang release, each
naming the source function it was read from. A response body is a concrete
example of what that release answers, restricted to the fields Flywheel reads
plus those that pin the shape (real answers carry more). Two runs use the
same pairs:

- the CPU engine, emulating that release, must answer every request (`engine`
  not false) the same way: same status; every field of the example present
  and equal, except the paths in `vary` (same JSON type only: model-dependent
  text, token ids, logprobs, timings), `patterns` (a regex) and `distinct`
  (pairwise different); `absent` paths must be missing; `min_seconds` /
  `max_seconds` bound how long the answer takes; `same` paths must hold one value
  everywhere (`choices[*].message.content`: every sample alike);
- the engine client, against a server replaying the example, must send the
  fixture's request and read the answer as `client` says.

Paths: `a.b` for keys, `[*]` for every element of a list (`[*].meta_info.id`).
`given` sets up the engine first: `api_key`, `health_generation`,
`health_check_timeout_s`, `released` memory tags (a release before the
request; every case ends with all tags resumed), requests sent `before` (each
answered 200, in order: a generation that fills the prefix cache, a flush, an
update), an `in_flight` generation (slowed down so it stays in flight), then
`paused` in a mode. `given.during` lists `/generate` bodies sent once the
case's request is pending in the engine (a weight update waiting on the
in-flight generation); each must answer as `given.during_response` says (same
rules as `response`, no `vary`).
`{weights_dir}` in a request stands for a valid weights directory.

`given.generation_config` starts the engine on a copy of the model whose
generation_config.json has these keys too (SGLang's chat sampling defaults).

LoRA: `given.lora` starts the engine with these LoRA settings (enable_lora,
max_lora_rank, lora_target_modules, max_loras_per_batch; a fresh engine per
case, since SGLang remembers every adapter name it ever loaded);
`given.adapters` names adapters loaded from `{adapter_dir}` before the
request, `given.unloaded` those unloaded again. `{adapter_dir}` is a rank-4
PEFT adapter on q_proj and v_proj, `{big_adapter_dir}` a rank-16 one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MISSING = object()


@dataclass(frozen=True)
class Case:
    version: str
    weight_version: str
    name: str
    source: str
    request: dict[str, Any]
    response: dict[str, Any]
    given: dict[str, Any] = field(default_factory=dict)
    vary: tuple[str, ...] = ()
    patterns: dict[str, str] = field(default_factory=dict)
    distinct: tuple[str, ...] = ()
    same: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    absent_in_request: tuple[str, ...] = ()
    min_seconds: float | None = None
    max_seconds: float | None = None
    engine: bool = True
    client: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        return f"{self.version}:{self.name}"


def load_cases() -> list[Case]:
    cases = []
    for path in sorted(FIXTURES.glob("sglang-*.json")):
        doc = json.loads(path.read_text())
        for c in doc["cases"]:
            assert c.get("source"), f"{path.name}:{c['name']} names no source"
            cases.append(
                Case(
                    version=doc["sglang_version"],
                    weight_version=doc["engine_weight_version"],
                    name=c["name"],
                    source=c["source"],
                    request=c["request"],
                    response=c["response"],
                    given=c.get("given", {}),
                    vary=tuple(c.get("vary", ())),
                    patterns=c.get("patterns", {}),
                    distinct=tuple(c.get("distinct", ())),
                    same=tuple(c.get("same", ())),
                    absent=tuple(c.get("absent", ())),
                    absent_in_request=tuple(c.get("absent_in_request", ())),
                    min_seconds=c.get("min_seconds"),
                    max_seconds=c.get("max_seconds"),
                    engine=c.get("engine", True),
                    client=c.get("client"),
                )
            )
    return cases


def substitute(value: Any, places: dict[str, str]) -> Any:
    """The request with its placeholders (`{weights_dir}`, `{adapter_dir}`, ...) replaced."""
    if isinstance(value, str):
        for place, real in places.items():
            value = value.replace(place, real)
        return value
    if isinstance(value, list):
        return [substitute(v, places) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, places) for k, v in value.items()}
    return value


# ── paths ─────────────────────────────────────────────────────────────────────
def _split(path: str) -> list[str]:
    return [p for p in re.split(r"\.|(?=\[\*\])", path) if p]


def select(doc: Any, path: str) -> list[Any]:
    """Every value at `path` (MISSING where a key is absent)."""
    values = [doc]
    for part in _split(path):
        nxt: list[Any] = []
        for v in values:
            if part == "[*]":
                nxt.extend(v if isinstance(v, list) else [MISSING])
            else:
                nxt.append(v.get(part, MISSING) if isinstance(v, dict) else MISSING)
        values = nxt
    return values


def _covered(path: str, rules: tuple[str, ...]) -> str | None:
    """The rule path that `path` equals or lies under, if any."""
    for rule in rules:
        if path == rule or path.startswith(rule + ".") or path.startswith(rule + "[*]"):
            return rule
    return None


def _kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if v is None:
        return "null"
    return type(v).__name__


def same_shape(example: Any, actual: Any) -> bool:
    """Same JSON type; lists: element by element if as long (tuples like a logprob's
    [logprob, token_id, text]), else each like the example's first; dicts: the keys."""
    if _kind(example) != _kind(actual):
        return False
    if isinstance(example, list):
        if len(example) == len(actual):
            return all(same_shape(e, a) for e, a in zip(example, actual, strict=True))
        return not example or all(same_shape(example[0], a) for a in actual)
    if isinstance(example, dict):
        return all(k in actual and same_shape(v, actual[k]) for k, v in example.items())
    return True


def compare(case: Case, example: Any, actual: Any, path: str = "") -> list[str]:
    """Where `actual` departs from the fixture's `example` (empty: it matches)."""
    rule = _covered(path, case.vary)
    if rule is not None:
        return [] if same_shape(example, actual) else [f"{path or '<body>'}: shape {actual!r}"]
    if isinstance(example, dict):
        if not isinstance(actual, dict):
            return [f"{path or '<body>'}: expected an object, got {actual!r}"]
        problems = []
        for k, v in example.items():
            sub = f"{path}.{k}" if path else k
            if k not in actual:
                problems.append(f"{sub}: missing")
            else:
                problems += compare(case, v, actual[k], sub)
        return problems
    if isinstance(example, list):
        if not isinstance(actual, list) or len(actual) != len(example):
            return [f"{path or '<body>'}: expected a list of {len(example)}, got {actual!r}"]
        return [p for i, (e, a) in enumerate(zip(example, actual, strict=True))
                for p in compare(case, e, a, f"{path}[*]")]  # fmt: skip
    if example != actual:
        return [f"{path or '<body>'}: expected {example!r}, got {actual!r}"]
    return []


def check_body(case: Case, actual: Any) -> list[str]:
    """All departures of an engine's answer from the fixture (status checked apart)."""
    if "body" not in case.response:
        return []
    problems = compare(case, case.response["body"], actual)
    for path, regex in case.patterns.items():
        for v in select(actual, path):
            if not isinstance(v, str) or not re.search(regex, v):
                problems.append(f"{path}: {v!r} does not match {regex}")
    for path in case.distinct:
        values = select(actual, path)
        if len(set(map(json.dumps, values))) != len(values):
            problems.append(f"{path}: values repeat: {values}")
    for path in case.same:
        values = select(actual, path)
        if len(set(map(json.dumps, values))) != 1:
            problems.append(f"{path}: values differ: {values}")
    for path in case.absent:
        if any(v is not MISSING for v in select(actual, path)):
            problems.append(f"{path}: present, but this release does not send it")
    return problems
