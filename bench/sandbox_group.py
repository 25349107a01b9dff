"""CPU and wall per group of 8 with the real-model demo's reward (exact_match and
last_word's brevity_credit), through the verifier pool's public API only, so the same
script measures any commit: run it from a tree's root with that tree's venv.

    .venv/bin/python bench/sandbox_group.py [ROUNDS]   # ROUNDS x 5 groups, medians

bench/results_sandbox.md has the figures before and after per-call isolation.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())

from services.sandbox import VerifierPool
from services.sandbox.jail import Sandbox
from services.tasks import rewards as R
from services.tasks.scoring import reward_payload
from services.tasks.spec import TaskSpec

DEMO = [{"fn": "exact_match"}, {"fn": "services.tasks.last_word:brevity_credit", "name": "brevity"}]


def zygote_pid(pool: VerifierPool) -> int:
    """The Python process that answers (bubblewrap's grandchild, or the child itself)."""
    root = pool._all[0].pid
    assert root is not None
    todo, found = [root], []
    while todo:
        p = todo.pop()
        for tid in os.listdir(f"/proc/{p}/task"):
            kids = [int(k) for k in Path(f"/proc/{p}/task/{tid}/children").read_text().split()]
            todo += kids
            found += kids
    exe = sys.executable.encode()
    return next(
        p for p in [root, *found] if Path(f"/proc/{p}/cmdline").read_bytes().startswith(exe)
    )


def cpu_s(pid: int) -> float:
    """CPU seconds of a process and the children it has reaped (the calls' forks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


async def main(rounds: int) -> None:
    spec = TaskSpec.model_validate({"source": {"type": "arithmetic"}, "reward": DEMO})
    parts = reward_payload(spec)
    box = Sandbox(modules=("services",), required_by=())
    pool = VerifierPool(1, 30.0, warmup=[(R.WARM, (parts, {}))], sandbox=box)
    await pool.start()
    ctx: dict[str, Any] = {"row": 1, "response_tokens": 5}
    group = [(parts, f"The answer is word{i}", "word3", ctx) for i in range(8)]
    await pool.call_many(R.SCORE, group)
    pid = zygote_pid(pool)
    walls, cpus = [], []
    for _ in range(rounds):
        c0, t0, p0 = cpu_s(pid), time.perf_counter(), time.process_time()
        for _ in range(5):
            await pool.call_many(R.SCORE, group)
        walls.append((time.perf_counter() - t0) / 5 * 1e3)
        cpus.append((cpu_s(pid) - c0 + time.process_time() - p0) / 5 * 1e3)
    await pool.close()
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    print(f"{os.getcwd()}: group of 8: wall ms {wall:.1f}, CPU ms {cpu:.1f} ({rounds}x5 groups)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 9))
