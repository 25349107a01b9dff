"""CPU seconds per test module from a `tests/harness/cpu_report.py` log.

    FLYWHEEL_CPU_REPORT=/tmp/cpu.tsv PYTEST_PLUGINS=tests.harness.cpu_report make test
    .venv/bin/python bench/suite_cpu.py /tmp/cpu.tsv [--top 25]

Prints each module's CPU seconds (its tests' setup, call and teardown, with
the processes they reaped), its share of the suite's, and its wall seconds,
largest first: on 2 cores make test's wall time is about the suite's CPU
seconds over 2, so these say where a cut shortens it.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path


def per_module(lines: list[str]) -> dict[str, tuple[float, float]]:
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for line in lines:
        node, _phase, c, w = line.rstrip("\n").split("\t")
        module = node.split("::", 1)[0]
        cpu[module] += float(c)
        wall[module] += float(w)
    return {m: (cpu[m], wall[m]) for m in cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log", type=Path)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    mods = per_module(args.log.read_text().splitlines())
    total = sum(c for c, _ in mods.values())
    print(f"{len(mods)} modules, {total:.0f} CPU s in all (/2 cores = {total / 2:.0f} s)")
    print(f"{'CPU s':>8} {'share':>6} {'wall s':>8}  module")
    for m, (c, w) in sorted(mods.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{c:8.1f} {c / total:6.1%} {w:8.1f}  {m}")


if __name__ == "__main__":
    main()
