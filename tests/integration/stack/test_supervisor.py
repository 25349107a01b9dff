"""The local stack's supervisor with real processes: readiness, restarts, no orphans."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.stack.plan import ProcSpec
from services.stack.supervisor import StackError, Supervisor

SLEEPER = (sys.executable, "-c", "import time; time.sleep(60)")

SUPERVISED = """
import asyncio, sys
from pathlib import Path
from services.stack.plan import ProcSpec
from services.stack.supervisor import StackError, Supervisor

async def main():
    spec = ProcSpec("sleeper", "x", {argv!r})
    sup = Supervisor([spec], Path({logs!r}), console=None)
    await sup.start_all()
    print(sup.procs[0].proc.pid, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_supervisor_leaves_no_orphans(tmp_path: Path) -> None:
    code = SUPERVISED.format(argv=SLEEPER, logs=str(tmp_path / "logs"))
    sup = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    child = int(sup.stdout.readline())
    assert alive(child)
    sup.kill()  # SIGKILL: no chance to stop its children itself
    sup.wait()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = not alive(child)
    if not gone:
        os.kill(child, 9)
    assert gone, "the supervised child outlived its supervisor"


def test_a_dead_service_is_reported_and_restarted(tmp_path: Path) -> None:
    async def scenario() -> None:
        crash = (sys.executable, "-c", "print('boom', flush=True); raise SystemExit(1)")
        sup = Supervisor(
            [ProcSpec("crasher", "x", crash)], tmp_path / "logs", max_restarts=2, console=None
        )
        stop = asyncio.Event()
        await sup.start_all()
        await asyncio.wait_for(sup.watch(stop), 30)  # returns once restarts are used up
        p = sup.get("crasher")
        assert p.restarts == 2
        assert sup.failed is not None and "crasher died (exit code 1)" in sup.failed
        assert "boom" in sup.failed  # the tail of its log
        assert (tmp_path / "logs" / "crasher.log").read_text().count("boom") == 3
        await sup.stop_all()

    asyncio.run(scenario())


def test_a_service_that_halts_the_run_is_not_restarted(tmp_path: Path) -> None:
    """Exit 3 (RunHalted) or 2 (a bad setting): restarting cannot help; its words stop the run."""

    async def scenario() -> None:
        halt = (sys.executable, "-c",
                "print('starting'); print('flywheel buffer: stopping the run: bug', flush=True);"
                " raise SystemExit(3)")  # fmt: skip
        sup = Supervisor([ProcSpec("buffer", "x", halt)], tmp_path / "logs", max_restarts=5,
                         console=None)  # fmt: skip
        await sup.start_all()
        await asyncio.wait_for(sup.watch(asyncio.Event()), 30)
        assert sup.get("buffer").restarts == 0
        assert sup.failed is not None and "buffer stopped the run" in sup.failed
        assert "flywheel buffer: stopping the run: bug" in sup.failed
        assert "starting" not in sup.failed  # its last words, not its whole log
        await sup.stop_all()

    asyncio.run(scenario())


def test_a_service_that_finishes_ends_the_run_and_is_not_restarted(tmp_path: Path) -> None:
    """The trainer given max_steps (`flywheel up --steps`) exits 0 when done: the run is over,
    not a death; any other service that exits 0 is restarted as before."""

    async def scenario() -> None:
        done = (sys.executable, "-c", "print('trained', flush=True)")
        specs = [ProcSpec("trainer", "trainer", done, finishes=True), ProcSpec("s", "x", SLEEPER)]
        sup = Supervisor(specs, tmp_path / "logs", max_restarts=5, console=None)
        await sup.start_all()
        await asyncio.wait_for(sup.watch(asyncio.Event()), 30)
        assert sup.finished == "trainer finished" and sup.failed is None
        assert sup.get("trainer").restarts == 0
        await sup.stop_all()

        again = [ProcSpec("other", "x", done)]
        sup = Supervisor(again, tmp_path / "logs2", max_restarts=1, console=None)
        await sup.start_all()
        await asyncio.wait_for(sup.watch(asyncio.Event()), 30)
        assert sup.finished is None and sup.get("other").restarts == 1
        await sup.stop_all()

    asyncio.run(scenario())


def test_a_service_whose_work_is_done_ends_the_run_without_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RunDone (the buffer's whole training set solved, `[buffer] on_solved = "stop"`): the
    service says why and exits EXIT_DONE; the run ends, neither failed nor restarted."""
    from services.runtime.errors import EXIT_DONE, RunDone
    from services.runtime.service_main import run_or_exit

    def solved() -> None:
        raise RunDone("the whole training set is solved: ...")

    assert run_or_exit("buffer", solved) == EXIT_DONE
    assert capsys.readouterr().err == "flywheel buffer: the whole training set is solved: ...\n"

    async def scenario() -> None:
        done = (
            sys.executable,
            "-c",
            f"print('flywheel buffer: solved', flush=True); raise SystemExit({EXIT_DONE})",
        )
        specs = [ProcSpec("buffer", "buffer", done), ProcSpec("s", "x", SLEEPER)]
        sup = Supervisor(specs, tmp_path / "logs", max_restarts=5, console=None)
        await sup.start_all()
        await asyncio.wait_for(sup.watch(asyncio.Event()), 30)
        assert sup.finished == "buffer ended the run" and sup.failed is None
        assert sup.get("buffer").restarts == 0
        await sup.stop_all()

    asyncio.run(scenario())


def test_a_pinned_service_runs_on_its_cores_only(tmp_path: Path) -> None:
    """`[stack] cpus`: the affinity is set in the child before exec, so the service and
    every thread it starts stay on its cores; an unpinned one keeps the whole machine."""
    show = (sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), flush=True)")
    every = sorted(os.sched_getaffinity(0))
    mine = (every[-1],)

    async def scenario() -> None:
        specs = [ProcSpec("pinned", "x", show, cpus=mine), ProcSpec("free", "x", show)]
        sup = Supervisor(specs, tmp_path / "logs", max_restarts=0, console=None)
        await sup.start_all()
        for name in ("pinned", "free"):
            proc = sup.get(name).proc
            assert proc is not None
            await asyncio.wait_for(proc.wait(), 30)
        await sup.stop_all()

    asyncio.run(scenario())
    assert (tmp_path / "logs" / "pinned.log").read_text().strip() == str(list(mine))
    assert (tmp_path / "logs" / "free.log").read_text().strip() == str(every)


def test_a_worker_starts_beside_its_engine_and_the_next_kind_waits(tmp_path: Path) -> None:
    """A rollout worker waits for its engine itself, so `flywheel up` starts it with its
    engine (their start-ups overlap); a later kind still waits for both to be ready."""
    never_ready = "http://127.0.0.1:9/readyz"  # the discard port: nothing answers

    async def scenario() -> None:
        specs = [
            ProcSpec("engine-0", "engine", SLEEPER, ready_url=never_ready),
            ProcSpec("sync", "sync", SLEEPER),
            ProcSpec("rollout-0", "rollout", SLEEPER, beside="engine-0"),
        ]
        sup = Supervisor(specs, tmp_path / "logs", ready_timeout_s=1.0, console=None)
        with pytest.raises(StackError, match="engine-0 not ready"):
            await sup.start_all()
        started = {p.name for p in sup.procs if p.proc is not None}
        await sup.stop_all()
        assert started == {"engine-0", "rollout-0"}

    asyncio.run(scenario())
