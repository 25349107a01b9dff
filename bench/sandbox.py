"""What the sandbox costs per verifier call, per group and per tool call.

    .venv/bin/python bench/sandbox.py [--calls 200] [--rounds 3] [--group 8]

Two ways to run the same reward (`rewards.score` with exact_match, and with
math when math-verify is installed) and the same python tool call:

- plain:  the pool without walls (what `insecure-allow` runs where the host
  has no bubblewrap);
- bwrap:  the pool in bubblewrap (jail.py), as the services run it.

Per call: `call` (one completion per round trip) and `call_many` (a group of
`--group` completions per round trip, reported per completion and per group)
for rewards, `run` for the tool. Also the time to start one child and warm
it. The ways are measured in turns, round after round, so load from
elsewhere on the machine falls on all of them alike. Medians over the
rounds. A change to the sandbox is measured by running this script of the
commit before it and of the commit after it, back to back
(bench/results_sandbox.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.sandbox import (  # noqa: E402
    ToolPool,
    VerifierPool,
    jail,
)
from services.sandbox.jail import Sandbox  # noqa: E402
from services.tasks import rewards as R  # noqa: E402
from services.tasks.tools import CALL  # noqa: E402

PY = {"type": "python", "tag": "python", "description": ""}
EXACT = [
    {"fn": "exact_match", "extract": "first_line", "marker": "####", "normalize": True,
     "case_sensitive": True, "name": None, "weight": 1.0, "_module": R.__name__},
]  # fmt: skip
MATH = [{"fn": "math", "fallback": True, "name": None, "weight": 1.0, "_module": R.__name__}]


def zygote_pid(pool: VerifierPool) -> int:
    """The Python process that answers (bubblewrap's grandchild, or the child itself)."""
    root = pool._all[0].pid
    assert root is not None
    if not Path(f"/proc/{root}/cmdline").read_bytes().startswith(b"/"):
        return root
    todo, found = [root], []
    while todo:
        p = todo.pop()
        kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        todo += [int(k) for k in kids]
        found += [int(k) for k in kids]
    exe = jail.python().encode()  # as the child was started: the venv's directory resolved
    return next(
        p for p in [root, *found] if Path(f"/proc/{p}/cmdline").read_bytes().startswith(exe)
    )


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and the children it has reaped (the calls' forks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def per_call(
    fn: Callable[[], Awaitable[Any]], n: int, pool: VerifierPool
) -> tuple[float, float]:
    """(wall ms, CPU ms of this process and the answering one) per awaited call."""
    await fn()
    pid = zygote_pid(pool)
    wall, c0, s0 = time.perf_counter(), cpu_s(pid), time.process_time()
    for _ in range(n):
        await fn()
    cpu = cpu_s(pid) - c0 + time.process_time() - s0
    return (time.perf_counter() - wall) / n * 1e3, cpu / n * 1e3


async def measure(
    parts: list[dict[str, Any]], n: int, group: int, make: Callable[..., VerifierPool],
    make_tools: Callable[..., VerifierPool],
) -> dict[str, float]:  # fmt: skip
    t = time.perf_counter()
    pool = make(1, 30.0, warmup=[(R.WARM, (parts, {}))])
    await pool.start()
    spawn = (time.perf_counter() - t) * 1e3
    tools = make_tools()
    await tools.start()
    one = (parts, "42", "42", {})
    assert isinstance(tools, ToolPool)
    try:
        assert (await pool.call(R.SCORE, *one)).reward == 1.0
        call = await per_call(lambda: pool.call(R.SCORE, *one), n, pool)
        many = await per_call(
            lambda: pool.call_many(R.SCORE, [one] * group), max(1, n // group), pool
        )
        tool = await per_call(lambda: tools.run(CALL, PY, "print(6 * 7)"), n, tools)
        return {
            "spawn+warm ms": spawn,
            "call ms": call[0],
            "call CPU ms": call[1],
            "call_many ms/completion": many[0] / group,
            "call_many CPU ms/completion": many[1] / group,
            "call_many ms/group": many[0],
            "call_many CPU ms/group": many[1],
            "python tool ms": tool[0],
            "python tool CPU ms": tool[1],
        }
    finally:
        await pool.close()
        await tools.close()


async def main(args: argparse.Namespace) -> None:
    if jail.probe() is not None:
        sys.exit(f"no sandbox on this host: {jail.probe()}")
    rewards = {"exact_match": EXACT}
    if importlib.util.find_spec("math_verify") is not None:
        rewards["math (math-verify)"] = MATH
    box = Sandbox(required_by=())

    def pools(cls: type[VerifierPool], tools: type[ToolPool]) -> Callable[..., Any]:
        def way(parts: list[dict[str, Any]]) -> Awaitable[dict[str, float]]:
            return measure(
                parts, args.calls, args.group,
                lambda *a, **k: cls(*a, **k, sandbox=box),
                lambda: tools(1, 30.0, tools=[PY], sandbox=box),
            )  # fmt: skip

        return way

    ways: dict[str, Callable[[list[dict[str, Any]]], Awaitable[dict[str, float]]]] = {
        "plain": lambda p: _plain(pools(VerifierPool, ToolPool), p),
        "bwrap": pools(VerifierPool, ToolPool),
    }
    print(f"# bench/sandbox.py --calls {args.calls} --rounds {args.rounds} --group {args.group}")
    print(f"# {platform.node()} {platform.machine()} python {platform.python_version()}\n")
    for label, parts in rewards.items():
        runs: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        for _ in range(args.rounds):
            for way, fn in ways.items():
                runs[way].append(await fn(parts))
        metrics = list(runs["bwrap"][0])
        print(f"## reward {label}\n")
        print("| metric | " + " | ".join(ways) + " |")
        print("|---|" + "---:|" * len(ways))
        for m in metrics:
            med = {w: statistics.median(r[m] for r in runs[w]) for w in ways}
            cells = " | ".join(f"{med[w]:.3f}" for w in ways)
            print(f"| {m} | {cells} |")
        print()


async def _plain(way: Callable[..., Awaitable[dict[str, float]]], parts: Any) -> dict[str, float]:
    """Today's pool as plain processes (jail.probe says no sandbox while it runs)."""
    real = jail.probe
    jail.probe = lambda: "measuring plain processes"  # type: ignore[assignment]
    try:
        return await way(parts)
    finally:
        jail.probe = real  # type: ignore[assignment]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=200, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=3, help="rounds of both ways")
    p.add_argument("--group", type=int, default=8, help="completions per call_many")
    logging.basicConfig(level=logging.ERROR)  # not the plain pools' warning, each round
    asyncio.run(main(p.parse_args()))
