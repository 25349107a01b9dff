"""A check of Chrome's Trace Event Format, as Perfetto's JSON importer reads it.

The shape of the JSON object format (the spec: "Trace Event Format",
Google, docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU):
`traceEvents` a list of objects; each has `ph` (phase), `name`, `pid`,
`tid` (metadata of a process may omit it); "X" complete events a numeric
`ts` and `dur` >= 0 in microseconds; "i" instants a `ts` and a scope `s`
in g/p/t; "M" metadata one of the names the viewers know, with its `args`.
Beyond the spec, what Perfetto needs to draw slices right: the "X" slices
of one thread nest (none overlaps another without containing it).
Returns the list of problems (empty: valid), each naming the event.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

META_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index",
              "process_labels"}  # fmt: skip
PHASES = {"X", "i", "I", "M", "B", "E", "b", "e", "n", "C", "s", "t", "f"}


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v


def problems(doc: Any) -> list[str]:
    """What is wrong with `doc` as a trace (module doc); [] when nothing is."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    out: list[str] = []
    per_thread: dict[tuple[int, int], list[tuple[float, float, int]]] = defaultdict(list)
    for i, ev in enumerate(doc["traceEvents"]):
        out += [f"event {i}: {p}" for p in _event_problems(ev)]
        if isinstance(ev, dict) and ev.get("ph") == "X" and not _event_problems(ev):
            per_thread[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"], i))
    for (pid, tid), spans in per_thread.items():
        out += [f"pid {pid} tid {tid}: {p}" for p in _nesting_problems(spans)]
    return out


def _event_problems(ev: Any) -> list[str]:
    if not isinstance(ev, dict):
        return ["not an object"]
    ph = ev.get("ph")
    if ph not in PHASES:
        return [f"unknown ph {ph!r}"]
    out = [f"{k} missing" for k in ("name", "pid") if k not in ev]
    if not isinstance(ev.get("name", ""), str):
        out.append("name not a string")
    if not isinstance(ev.get("pid", 0), int):
        out.append("pid not an integer")
    if ph != "M" and not isinstance(ev.get("tid"), int):
        out.append("tid missing or not an integer")
    if ph == "M":
        if ev.get("name") not in META_NAMES:
            out.append(f"metadata name {ev.get('name')!r} unknown")
        if not isinstance(ev.get("args"), dict):
            out.append("metadata without args")
        elif ev.get("name", "").endswith("_name") and not isinstance(ev["args"].get("name"), str):
            out.append("metadata args.name not a string")
        if ev.get("name") == "thread_name" and not isinstance(ev.get("tid"), int):
            out.append("thread_name without tid")
        return out
    if not _num(ev.get("ts")):
        out.append(f"ts {ev.get('ts')!r} not a number")
    if ph == "X" and not (_num(ev.get("dur")) and ev["dur"] >= 0):
        out.append(f"dur {ev.get('dur')!r} not a number >= 0")
    if ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
        out.append(f"instant scope {ev.get('s')!r} not g/p/t")
    if "args" in ev and not isinstance(ev["args"], dict):
        out.append("args not an object")
    return out


def _nesting_problems(spans: list[tuple[float, float, int]]) -> list[str]:
    """Slices of one thread must nest: each inside the enclosing one, or after it (to
    1 ns: Perfetto reads the microseconds into integer nanoseconds)."""
    out: list[str] = []
    stack: list[tuple[float, float, int]] = []
    for s, e, i in sorted(spans, key=lambda x: (x[0], -x[1])):
        while stack and stack[-1][1] <= s + 1e-3:
            stack.pop()
        if stack and e > stack[-1][1] + 1e-3:
            out.append(f"event {i} [{s}, {e}] overlaps event {stack[-1][2]} without nesting")
        stack.append((s, e, i))
    return out
