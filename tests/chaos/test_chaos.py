"""Faults during a training run: the run completes, and the streams account for every task.

One `flywheel up` run (2 CPU engines and workers, sync, trainer, buffer,
`on_failure = "restart"`) on a nats-server we own; faults at seeded random
moments, each once the run has recovered from the previous one (two more
trained steps than were batched ahead when it came). Then, from the
streams and the buffer's KV state only (chaos_run.account): every
dispatched task trained exactly once or dead-lettered, never both; no
step trained twice or skipped; no sample beyond the staleness bound; at
most (k+1)·G tasks left in flight by the stop. The supervisor's restart
counts, service metrics and logs show each fault and the recovery.

Sync runs in `retract` mode (the GPU default): every update pauses the
engines, requeues what they were generating and continues, so a fault can
land between pause and continue. CI runs a few faults in one such run (≤ 3
min on 2 cores). The full variant, every fault kind several times, runs
with `FLYWHEEL_CHAOS_FULL=1` (`make chaos`), in `wait` mode as well.

On a local 3-server NATS cluster with `[nats] replicas = 3`: kill -9 of
the member leading the work streams, and later its restart (CI); the full
variant adds rolling restarts of all three, and a second leader kill with
a service kill while a member is down. The same accounting holds. Each
fault's time to recover (last trained step before it -> first step after)
is printed.
"""

from __future__ import annotations

import os
import time
from itertools import pairwise
from pathlib import Path

import pytest

from tests.chaos.chaos_run import RUN, TAIL_STEPS, ChaosRun, Fault, G, K, account, schedule

# A soak of ~120 CPU s (a ninth of make test's): `make test-long`, which CI runs.
pytestmark = pytest.mark.long

FULL = os.environ.get("FLYWHEEL_CHAOS_FULL") == "1"
SEED = int(os.environ.get("FLYWHEEL_CHAOS_SEED", "0"))

CI_FAULTS = [
    Fault("kill", "rollout-0"),
    Fault("kill", "buffer"),
    Fault("kill", "trainer"),
    Fault("nats"),
    Fault("stop", "sync", hold_s=4.0),
]
FULL_FAULTS = [
    Fault("kill", "rollout-0"),
    Fault("kill", "engine-1"),
    Fault("kill", "buffer"),
    Fault("kill", "sync"),
    Fault("kill", "trainer"),
    Fault("nats"),
    Fault("stop", "trainer", hold_s=5.0),
    Fault("stop", "buffer", hold_s=5.0),
    Fault("stop", "rollout-1", hold_s=5.0),
    Fault("stop", "sync", hold_s=5.0),
    Fault("stop", "engine-0", hold_s=5.0),
    Fault("nats9"),
    Fault("kill", "rollout-1"),
    Fault("kill", "engine-0"),
    Fault("kill", "buffer"),
    Fault("kill", "trainer"),
]


CLUSTER_CI_FAULTS = [Fault("leader9"), Fault("rejoin")]
CLUSTER_FULL_FAULTS = [
    Fault("leader9"),
    Fault("rejoin"),
    Fault("roll"),
    Fault("leader9"),
    Fault("kill", "buffer"),  # a service restarts while the cluster runs on two members
    Fault("rejoin"),
    Fault("roll"),
]


def run_with_faults(
    root: Path, model: Path, faults: list[Fault], seed: int, update_mode: str, nats_servers: int = 1
) -> None:
    at = schedule(len(faults), seed)
    chaos = ChaosRun(root, model, seed=seed, update_mode=update_mode, nats_servers=nats_servers)
    t0 = time.monotonic()
    chaos.start()
    try:
        try:
            chaos.wait_alive()
            started = time.monotonic() - t0
            chaos.run_faults(faults, at)
            evidence = gather_evidence(chaos, faults)
            # Every fault has fired and recovered: now the run may end (it has no cap).
            steps = max(at[-1], chaos.step()) + TAIL_STEPS
            rc = chaos.finish(steps)
            assert rc == 0, f"flywheel up exited {rc}"
        except BaseException:
            print(chaos.diagnostics())
            raise
        finally:
            chaos.close()
        chaos.measure_recovery()
        report(chaos, started, time.monotonic() - t0, evidence)
        check_accounting(chaos, steps)  # nats-server still up: the streams are read
    finally:
        chaos.nats.close()


def gather_evidence(chaos: ChaosRun, faults: list[Fault]) -> dict[str, object]:
    """While the run goes on: the supervisor and the services saw each fault and recovered."""
    restarts = chaos.restarts()
    for f in faults:
        if f.kind == "kill":
            want = sum(1 for g in faults if g.kind == "kill" and g.target == f.target)
            assert restarts[f.target] >= want, (f, restarts)
        if f.kind == "stop":
            # frozen, not dead: the supervisor did not restart it for that
            kills = sum(1 for g in faults if g.kind == "kill" and g.target == f.target)
            assert restarts[f.target] == kills, (f, restarts)
    # each server restarted: every client lost its server once (a leader9 may hit none)
    nats_faults = sum(1 for f in faults if f.kind in ("nats", "nats9", "roll"))
    reconnects = {n: chaos.service_log(n).count("reconnected") for n in ("buffer", "sync")}
    if nats_faults:
        # a service started after the last restart need not have reconnected; sync or buffer did
        assert max(reconnects.values()) >= 1, reconnects
    handled = chaos.metric("buffer", "flywheel_messages_handled_total")
    ready = chaos.metric("sync", "flywheel_sync_ready_version")
    step = chaos.step()
    assert ready is not None and ready >= step - K - 1, (ready, step)  # sync kept up
    assert handled is not None and handled > 0
    return {"restarts": restarts, "reconnects": reconnects, "buffer_handled": handled,
            "sync_ready": ready, "sync_update_failures":
            chaos.metric("sync", "flywheel_sync_update_failures_total")}  # fmt: skip


def report(chaos: ChaosRun, started: float, total: float, evidence: dict[str, object]) -> None:
    times = sorted(float(r["time"]) for r in chaos.rows())
    gaps = sorted(b - a for a, b in pairwise(times))
    median = gaps[len(gaps) // 2] if gaps else 0.0
    print(f"\nchaos: first step after {started:.0f}s, run {total:.0f}s, seed {chaos.seed}, "
          f"update_mode {chaos.update_mode}, nats servers {chaos.nats_servers}, "
          f"median step interval {median:.2f}s")  # fmt: skip
    for r in chaos.injected:
        print(f"  {r.fault!s:22s} at step {r.at_step:3d}: recovered in "
              f"{r.recovered_s:5.1f}s, last step before -> first after {r.to_first_step_s:5.1f}s, "
              f"longest gap {r.longest_gap_s:5.1f}s  pid {r.old_pid} -> {r.new_pid} "
              f"{r.detail}")  # fmt: skip
    print(f"  evidence: {evidence}")


def check_accounting(chaos: ChaosRun, steps: int) -> None:
    rows = chaos.rows()
    got = [int(r["step"]) for r in rows]
    assert got == list(range(1, len(got) + 1)), got  # no step twice, none skipped
    assert len(got) >= steps
    assert [r["batch_id"] for r in rows] == [f"{RUN}:step{s - 1}" for s in got]
    trained_steps = len(got)
    acc = account(chaos.nats.url, trained_steps)
    print(f"  dispatched {len(acc.dispatched)}, trained {len(acc.trained)}, "
          f"dead-lettered {len(acc.dead)} {dict(acc.dlq_reasons)}, stranded {len(acc.stranded)} "
          f"(batched for untrained steps {len(acc.batched_untrained)})")  # fmt: skip
    assert set(range(trained_steps)) <= set(acc.batch_steps)
    assert len(acc.trained) == trained_steps * G  # every trained batch: G distinct tasks
    assert acc.trained_twice == [], "trained twice:\n" + acc.explain(acc.trained_twice)
    assert acc.both == [], "trained and dead-lettered:\n" + acc.explain(acc.both)
    assert acc.foreign == [], "never dispatched:\n" + acc.explain(acc.foreign)
    assert acc.stale == [], acc.stale[:5]
    assert all(acc.dead.values())  # every dead letter has its reason
    # Stopped mid-run: what was in flight, pending or batched ahead is bounded by admission.
    assert len(acc.stranded) <= (K + 1) * G, acc.stranded
    assert acc.state.answered <= acc.state.dispatched


@pytest.mark.slow
@pytest.mark.timeout(900 if FULL else 240)
@pytest.mark.parametrize("update_mode", ["retract", "wait"] if FULL else ["retract"])
def test_chaos_run_completes_and_accounts_for_every_task(
    tiny_model: Path, tmp_path: Path, update_mode: str
) -> None:
    run_with_faults(tmp_path, tiny_model, FULL_FAULTS if FULL else CI_FAULTS, SEED, update_mode)


@pytest.mark.slow
@pytest.mark.timeout(900 if FULL else 240)
def test_chaos_on_a_nats_cluster_losing_and_restarting_servers(
    tiny_model: Path, tmp_path: Path
) -> None:
    faults = CLUSTER_FULL_FAULTS if FULL else CLUSTER_CI_FAULTS
    run_with_faults(tmp_path, tiny_model, faults, SEED, "retract", nats_servers=3)
