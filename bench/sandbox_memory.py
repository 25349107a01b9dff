"""How much memory one sandboxed call can hold, in each mode the product ships.

    .venv/bin/python bench/sandbox_memory.py [--memory-mb 256] [--modes service,pod]

A tool pool of one slot with `memory_mb` = 256 (the issue's probe), its
children started by this process (`service`: root here, bubblewrap
privileged, a cgroup per slot where the host delegates one) or by a
`flywheel sandbox` server as the pod's uid 10001 (`pod`: a user namespace,
no cgroup; tests/harness/sandbox.py; needs root to switch). Two calls:

- processes: six processes each touch 200 MiB (each under its own
  RLIMIT_AS) and hold it for 2 s;
- memfds: as many memfds as it can, each written with write(2) up to
  RLIMIT_FSIZE (pages no RLIMIT_AS counts), held for 2 s.

While each runs, this process samples every 20 ms the proportional set size
(PSS: shared pages counted once) of every process of the slot (the host's
/proc: bubblewrap's descendants) and the host's Shmem (/proc/meminfo, less
its value before the call: other processes on the host move it too).
Printed: the peaks, and what the call said it held (or how it ended), a
table row per mode and call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.sandbox import ToolPool  # noqa: E402
from services.sandbox.jail import Sandbox  # noqa: E402
from services.tasks.tools import CALL  # noqa: E402
from tests.harness.sandbox import PodServer  # noqa: E402

PY = {"type": "python", "tag": "python", "description": ""}
PROCESSES = """
import os, select, time
r, w = os.pipe()
pids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        try:
            x = bytearray(200 << 20)
            for i in range(0, len(x), 4096):
                x[i] = 1
            os.write(w, b"1")
            time.sleep(2)
        finally:
            os._exit(0)
    pids.append(pid)
os.close(w)
filled, deadline = 0, time.monotonic() + 20
while filled < 6 and time.monotonic() < deadline:
    got = os.read(r, 16)
    if not got:
        break
    filled += len(got)
print(f"filled={filled} of 6 x 200 MiB")
"""
MEMFDS = """
import os, time
held, fds, why = 0, [], "200 memfds"
chunk = b"x" * (1 << 20)
while len(fds) < 200 and why == "200 memfds":
    try:
        fds.append(os.memfd_create("hold"))
        while True:
            held += os.write(fds[-1], chunk)
    except OSError as e:
        if e.errno != 27:  # EFBIG (RLIMIT_FSIZE): this one is full, on to the next
            why = f"errno {e.errno}"
print(f"memfds={len(fds)} held_mib={held >> 20} ended: {why}")
time.sleep(2)
"""


def pss_kib(pid: int) -> int:
    """A process's proportional set size: pages shared with the zygote (or a sibling)
    counted once across them, not once per process as RSS would."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def shmem_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1])
    return 0


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{p}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(p))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Sampler:
    def __init__(self, root: int) -> None:
        self.root, self.stop = root, threading.Event()
        self.base_pss = sum(pss_kib(p) for p in descendants(root))
        self.base_shmem = shmem_kib()
        self.peak_pss = self.peak_shmem = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            pss = sum(pss_kib(p) for p in descendants(self.root)) - self.base_pss
            self.peak_pss = max(self.peak_pss, pss)
            self.peak_shmem = max(self.peak_shmem, shmem_kib() - self.base_shmem)
            time.sleep(0.02)


async def measure(mode: str, memory_mb: int) -> list[tuple[str, str, int, int, str]]:
    server = PodServer() if mode == "pod" else None
    remote = server.sock if server is not None else None
    rows = []
    try:
        box = Sandbox(modules=(), required_by=("bench",))
        async with ToolPool(1, 30.0, memory_mb, [PY], sandbox=box, remote=remote) as pool:
            for name, code in (("processes", PROCESSES), ("memfds", MEMFDS)):
                root = server.proc.pid if server is not None else pool._all[0].pid or 0
                sampler = Sampler(root)
                sampler.thread.start()
                out = await pool.run(CALL, PY, code)
                sampler.stop.set()
                sampler.thread.join()
                said = (out.text or "").strip().replace("\n", " ") or f"{out.error}"
                rows.append((mode, name, sampler.peak_pss >> 10, sampler.peak_shmem >> 10, said))
    finally:
        if server is not None:
            server.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--modes", default="service,pod")
    args = ap.parse_args()
    print(f"memory_mb = {args.memory_mb}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(
        "| mode | call | peak PSS of the slot's processes, MiB | peak host Shmem rise, MiB "
        "| the call said |"
    )
    print("|---|---|---:|---:|---|")
    for mode in args.modes.split(","):
        for row in asyncio.run(measure(mode, args.memory_mb)):
            print("| {} | {} | {} | {} | {} |".format(*row))


if __name__ == "__main__":
    main()
