"""Plain processes of a non-root service (a host without bubblewrap, `sandbox =
"insecure-allow"`): the calls share the service's uid, the host's IPC namespace and
its /dev/shm, and their temp directory is the service uid's own. What a call leaves
there — SysV objects, POSIX shared memory, a mark on the temp directory itself — is
gone for the next call, and what the uid had before the call stays.

The service is a `flywheel sandbox` server as the pod's uid (tests/harness/sandbox.py)
whose PATH has no bubblewrap; its pool allows plain processes (`TESTS`). Plain
processes are a guard, not a wall (docs/security/sandbox.md): these check that the
per-call clean-up holds there too, not that a determined call is kept in.
"""

from __future__ import annotations

import asyncio
import ctypes
import random
import subprocess
import time
from collections.abc import Iterator

import pytest

from services.sandbox import VerifierPool
from services.sandbox.jail import python
from services.tasks.registry import as_fields
from services.tasks.rewards import CustomReward
from tests.harness.sandbox import TESTS, PodServer, as_pod

REWARD = "tests.integration.sandbox.escape_fixtures:run_code"
# A uid of this module's own: test_escapes_pod.py runs as the pod's uid on another of make
# test's workers at the same time, and a uid's processes share RLIMIT_NPROC (its forks
# failed with EAGAIN there) and its SysV objects (what this module counts).
UID = 10002
SCORE = "services.tasks.rewards:score"
IPC_RMID = 0


@pytest.fixture(scope="module")
def server() -> Iterator[PodServer]:
    s = PodServer(env={"PATH": "/nonexistent"}, uid=UID)  # no bwrap: plain processes
    yield s
    s.close()


def run(server: PodServer, *codes: str) -> tuple[list[dict[str, float]], float]:
    """`codes` one after another in one slot, as a custom reward: what each printed, and
    the time the last was sent (after a pause: times older than that are carried)."""
    parts = [as_fields(CustomReward(fn=REWARD, name="run"))]

    async def body() -> tuple[list[dict[str, float]], float]:
        async with VerifierPool(1, 10.0, sandbox=TESTS, remote=server.sock) as pool:
            assert pool.confined is False
            out, started = [], 0.0
            for i, code in enumerate(codes):
                if i == len(codes) - 1:
                    await asyncio.sleep(0.2)
                    started = time.time()
                r = await pool.call(SCORE, parts, code, None, {})
                assert r.error is None and not r.parts.get("run.raised"), r
                out.append({k.removeprefix("run."): v for k, v in r.parts.items()})
            return out, started

    return asyncio.run(body())


def test_a_calls_ipc_objects_and_shared_memory_are_gone_for_the_next(server: PodServer) -> None:
    key = 0x5EED0000 + random.randrange(1 << 16)
    name = f"fw{random.randrange(1 << 32):08x}"
    # The uid's own object from before any call (another program of the pod's uid).
    shmget = f"import ctypes; print(ctypes.CDLL(None).shmget({key + 9}, 4096, 0o1600))"
    made = subprocess.run(as_pod([python(), "-c", shmget], UID), capture_output=True, text=True)
    ident = int(made.stdout)
    assert ident >= 0
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        (made_, left), _ = run(
            server,
            f"""
import ctypes
from multiprocessing import shared_memory
libc = ctypes.CDLL(None, use_errno=True)
made = (libc.shmget({key}, 1 << 20, 0o1600) >= 0) + (libc.msgget({key}, 0o1600) >= 0)
made += libc.semget({key}, 1, 0o1600) >= 0
m = shared_memory.SharedMemory({name!r}, create=True, size=4096)
m.close()
print(f"made={{made + 1}}")
""",
            f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
left = (libc.shmget({key}, 0, 0) >= 0) + (libc.msgget({key}, 0) >= 0)
left += (libc.semget({key}, 0, 0) >= 0) + os.path.exists("/dev/shm/{name}")
print(f"left={{left}} before={{int(libc.shmget({key + 9}, 0, 0) >= 0)}}")
""",
        )
        assert made_["made"] == 4, made_
        assert left["left"] == 0 and left["before"] == 1, left
    finally:
        libc.shmctl(ident, IPC_RMID, None)


def test_a_mark_on_the_temp_directory_itself_is_gone_for_the_next(server: PodServer) -> None:
    plant = """
import os
os.setxattr(".", "user.fw", b"planted")
os.utime(".", (1234567, 1234567))
open("plant", "w").write("x")
os.chmod(".", 0)
print("planted=1")
"""
    look = """
import os, stat
st = os.stat(".")
n = len(os.listdir("."))
print(f"xattrs={len(os.listxattr('.'))} mode={stat.S_IMODE(st.st_mode)} entries={n}")
print(f"mtime={st.st_mtime_ns // 1_000_000} ctime={st.st_ctime_ns // 1_000_000}")
"""
    (first, planted, after), started = run(server, look, plant, look)
    assert planted["planted"] == 1, planted
    assert after["xattrs"] == first["xattrs"] == 0, after
    assert after["mode"] == first["mode"] and after["entries"] == first["entries"] == 0, after
    assert after["mtime"] >= (started - 0.01) * 1000, after
    assert after["ctime"] >= (started - 0.01) * 1000, after
