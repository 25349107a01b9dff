"""A `flywheel up` run under fault injection, and the accounting of what it trained.

The run is the real thing: `python -m services up -c run.toml`
(tests/harness/up.py; engines, rollout workers, sync, trainer, buffer as
supervised subprocesses, `on_failure = "restart"`) against a nats-server
this harness owns (`[stack] embedded_nats = false`, persisted store, fixed
port), so it can be restarted under the running services.
`<run_dir>/pids.json`, written by the supervisor on every (re)start, names
the pid of each service. The run has no step cap: the test stops it with
Ctrl-C once every fault has fired and recovered (see `ChaosRun`).

Faults (`Fault.kind`):

| kind    | what                                                                  |
|---------|-----------------------------------------------------------------------|
| kill    | SIGKILL a service; the supervisor restarts it                          |
| stop    | SIGSTOP a service for `hold_s`, then SIGCONT (a partition / GC pause)  |
| nats    | restart nats-server (SIGTERM: JetStream flushes) on the same port/store |
| nats9   | SIGKILL nats-server, start it again (what survives is what was synced) |
| leader9 | cluster: SIGKILL the member leading most of the work streams (TASKS,  |
|         | SAMPLES, BATCHES); the other two carry the run                        |
| rejoin  | cluster: start the member `leader9` killed again (same ports, store)  |
| roll    | cluster: rolling restart (SIGTERM, start, rejoined; one after another) |

With `nats_servers = 3` the run is on a local `NatsCluster` (three
nats-servers routed on loopback, each with its own store) with `[nats]
replicas = 3`, and services get all three client URLs.

Time to recover (`Injected.to_first_step_s`): from the last trained step
before the fault (its metrics row's `time`) to the first trained step
after the fault began; `longest_gap_s`: the longest pause between trained
steps from then until the fault recovered (see `run_faults`), which for a rolling
restart spans all three restarts.

Accounting (`account`), from the streams and the buffer's KV state only:
the dispatched task ids are the first `dispatched` positions of the
buffer's cursor order; each is trained (its group in exactly one trained
batch) or dead-lettered, never both, except for at most `(k + 1) · G`
tasks the run was stopped with (in flight, pending, or batched for a step
not yet trained: admission control bounds exactly that, see
services/buffer/core.py).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from proto.codec import decode
from proto.messages import DeadLetter, PromptTask, SampleGroup, TrainBatch
from proto.streams import kv_bucket, stream_name
from proto.subjects import Subjects
from services.stack.localdev.nats_cluster import NatsCluster
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.streams import read_stream
from tests.harness.up import UpRun

RUN = "chaos"
G = 2  # groups per step
K = 2  # max staleness (2: a killed worker's stranded tasks do not stop admission)
TAIL_STEPS = 12  # steps trained after the last fault's scheduled step, before the stop
WORK_STREAMS = ("TASKS", "SAMPLES", "BATCHES")  # whose leader a `leader9` fault kills


def chaos_config(
    root: Path, model: Path, nats_url: str, update_mode: str = "retract", replicas: int = 1
) -> str:
    return run_file(
        RUN,
        nats={"url": nats_url, "replicas": replicas},
        stack={"run_dir": str(root / "run"), "model": str(model), "embedded_nats": False,
               "engines": 2, "engine_threads": 1, "on_failure": "restart", "max_restarts": 20,
               "status_interval_s": 0.5, "stop_grace_s": 10.0, "ready_timeout_s": 150.0},
        task={"source": {"type": "arithmetic", "digits": 1}},
        buffer={"samples_per_prompt": 4,
                "groups_per_step": G, "max_new_tokens": 4, "max_staleness": K,
                "oversample": 0.0, "filter_zero_variance": False, "dispatch_interval_s": 0.5},
        rollout={"concurrency": 2, "heartbeat_s": 0.3, "weights_poll_s": 0.5,
                 "behind_retry_s": 0.2},
        engine={"num_threads": 1},
        trainer={"publish_every": 1, "keep_checkpoints": 2, "runtime": {"cpu_threads": 1},
                 "optim": {"lr": 1e-3}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2, "keep_last": 3,
              "update_mode": update_mode},
    )  # fmt: skip


@dataclass(frozen=True)
class Fault:
    kind: str  # kill | stop | nats | nats9 | leader9 | rejoin | roll
    target: str = ""  # a service name from pids.json (kill, stop)
    hold_s: float = 4.0  # stop: how long the process stays frozen

    def __str__(self) -> str:
        return f"{self.kind} {self.target}".strip()


@dataclass
class Injected:
    fault: Fault
    at_step: int  # trainer step when it was injected
    at: float
    recovered_s: float = 0.0  # until the trainer did two more steps than were batched ahead
    old_pid: int | None = None
    new_pid: int | None = None
    detail: str = ""  # e.g. which cluster member, and what it led
    done: float = 0.0  # when it had recovered
    to_first_step_s: float = 0.0  # last step before the fault -> first step after (from rows)
    longest_gap_s: float = 0.0  # longest pause between steps until it recovered (from rows)


@dataclass
class ChaosRun:
    """`flywheel up` (no step cap: the test stops it) on a nats-server this harness owns.

    The run has no `--steps`: a step of the chaos model takes well under a
    tenth of a second, so a run capped at a step count could finish before
    the schedule's last faults fired. The faults are paced by the run
    instead (each waits for its step and for the recovery from the last),
    and `finish` stops the run, with Ctrl-C, once the last fault has
    recovered and `TAIL_STEPS` more steps are trained.
    """

    root: Path
    model: Path
    seed: int = 0
    update_mode: str = "retract"  # sync's: each update pauses the engines, requeues, continues
    nats_servers: int = 1  # 3: a local NatsCluster, [nats] replicas = 3
    nats: NatsServer | NatsCluster = field(init=False)
    down: NatsServer | None = None  # the cluster member `leader9` killed, until `rejoin`
    up: UpRun = field(init=False)
    injected: list[Injected] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    # ── lifecycle ────────────────────────────────────────────────────────────
    def start(self) -> None:
        store = self.root / "nats-store"
        if self.nats_servers == 1:
            self.nats = NatsServer(store_dir=store).start()
        else:
            self.nats = NatsCluster(self.nats_servers, store_root=store).start()
        config = self.root / "run.toml"
        text = chaos_config(
            self.root, self.model, self.nats.url, self.update_mode, replicas=self.nats_servers
        )
        config.write_text(text)
        self.up = UpRun(config, self.run_dir, "--quiet").start()

    def finish(self, steps: int, timeout_s: float = 240) -> int:
        """Once `steps` are trained, stop the run as a user does (Ctrl-C); its exit code."""
        wait_for(lambda: self._check_up() and self.step() >= steps, timeout_s, f"step {steps}",
                 0.2)  # fmt: skip
        return self.up.stop(signal.SIGINT, grace_s=60) or 0

    def close(self) -> None:
        """Stop the stack (leaves nats-server running, for the accounting)."""
        pids = self.pids()
        self.up.stop(signal.SIGINT, grace_s=40)
        for pid in pids.values():  # anything frozen or orphaned by a failed test
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ── observing ────────────────────────────────────────────────────────────
    def pids(self) -> dict[str, int]:
        return self.up.pids()

    def rows(self) -> list[dict[str, Any]]:
        return self.up.rows()

    def step(self) -> int:
        return self.up.step()

    def service_log(self, name: str) -> str:
        return self.up.service_log(name)

    def restarts(self) -> dict[str, int]:
        return self.up.restarts()

    def metric(self, service: str, name: str) -> float | None:
        return self.up.metric(service, name)

    def diagnostics(self) -> str:
        return self.up.diagnostics()

    # ── faults ───────────────────────────────────────────────────────────────
    def wait_alive(self) -> None:
        """Until the up process is running every service (first start can take a while)."""
        wait_for(lambda: self._check_up() and self.step() >= 1, 180, "the first trained step", 0.5)

    def _check_up(self) -> bool:
        return self.up.running()

    def inject(self, fault: Fault) -> Injected:
        rec = Injected(fault, self.step(), time.time())
        if fault.kind in ("kill", "stop"):
            pid = self.pids()[fault.target]
            rec.old_pid = pid
            if fault.kind == "kill":
                os.kill(pid, signal.SIGKILL)
                wait_for(lambda: self._check_up() and self.pids().get(fault.target) != pid, 30,
                         f"{fault.target} restarted", 0.2)  # fmt: skip
                rec.new_pid = self.pids()[fault.target]
            else:
                os.kill(pid, signal.SIGSTOP)
                try:
                    time.sleep(fault.hold_s)  # the fault itself: a frozen process, not a sync
                finally:
                    os.kill(pid, signal.SIGCONT)
        elif fault.kind in ("nats", "nats9"):
            server = self.nats
            assert isinstance(server, NatsServer), f"{fault} is a single-server fault"
            if fault.kind == "nats":
                server.restart()
            else:
                server.kill()
                server.start()
        elif fault.kind in ("leader9", "rejoin", "roll"):
            self._cluster_fault(fault, rec)
        else:
            raise ValueError(f"unknown fault {fault}")
        self.injected.append(rec)
        return rec

    def _cluster_fault(self, fault: Fault, rec: Injected) -> None:
        cluster = self.nats
        assert isinstance(cluster, NatsCluster), f"{fault} needs a NATS cluster"
        if fault.kind == "leader9":
            assert self.down is None, "one member down at a time (a majority must stay)"
            node, led = work_stream_leader(cluster)
            rec.old_pid, rec.detail = node.pid, f"{node.server_name} (led {', '.join(led)})"
            cluster.kill(node)
            self.down = node
            for what in led:  # the other two elect new leaders (RAFT election timeout: seconds)
                cluster.wait_stream_leader(stream_name(RUN, what), other_than=node, timeout_s=60)
            rec.detail += f", its streams led again after {time.time() - rec.at:.1f}s"
        elif fault.kind == "rejoin":
            assert self.down is not None, "rejoin without a member down"
            node, self.down = self.down, None
            cluster.start_node(node)  # returns once it has rejoined and every stream is led
            rec.new_pid, rec.detail = node.pid, f"{node.server_name}"
        else:
            before = [n.pid for n in cluster.nodes]
            cluster.rolling_restart()
            rec.detail = f"pids {before} -> {[n.pid for n in cluster.nodes]}"

    def run_faults(self, faults: list[Fault], schedule: list[int]) -> None:
        """Fault i once the trainer reaches step `schedule[i]`, plus a seeded random delay.

        A fault whose step has passed while the run recovered from the last
        one comes at once. Recovery: the trainer did two more steps than
        the batches that may already have been stored when the fault came
        (the buffer publishes up to k + 1 ahead): a step trained from a
        batch stored before the fault proves nothing about recovery (on a
        cluster, a consumer led elsewhere delivers those without the dead
        stream leader).
        """
        rng = random.Random(self.seed)
        for f, at in zip(faults, schedule, strict=True):
            wait_for(lambda a=at: self._check_up() and self.step() >= a, 150, f"step {at}", 0.05)
            time.sleep(rng.uniform(0.0, 0.5))  # the seeded random moment (not a synchronisation)
            rec = self.inject(f)
            want = max(self.step(), rec.at_step + K + 1) + 2
            wait_for(lambda w=want: self._check_up() and self.step() >= w, 150,
                     f"2 steps after '{f}'", 0.2)  # fmt: skip
            rec.done = time.time()
            rec.recovered_s = rec.done - rec.at

    def measure_recovery(self) -> None:
        """Each fault's `to_first_step_s` and `longest_gap_s`, from the metrics rows' times."""
        times = sorted(float(r["time"]) for r in self.rows())
        for rec in self.injected:
            before = [t for t in times if t <= rec.at]
            after = [t for t in times if t > rec.at]
            if not before or not after:
                continue
            rec.to_first_step_s = after[0] - before[-1]
            window = [before[-1]] + [t for t in after if t <= rec.done]
            rec.longest_gap_s = max((b - a for a, b in pairwise(window)), default=0.0)


def work_stream_leader(cluster: NatsCluster) -> tuple[NatsServer, list[str]]:
    """The member leading most of the run's work streams, and which it leads."""
    leads: dict[str, list[str]] = {}
    for what in WORK_STREAMS:
        leader = cluster.wait_stream_leader(stream_name(RUN, what))
        leads.setdefault(leader.server_name or "", []).append(what)
    name = max(leads, key=lambda n: len(leads[n]))  # ties: the first seen, TASKS' leader
    return cluster.node(name), leads[name]


def schedule(n_faults: int, seed: int, first: int = 4, every: int = 8) -> list[int]:
    """Step of each fault: one seeded random step in each window of `every` steps."""
    rng = random.Random(f"schedule:{seed}")
    return [first + i * every + rng.randrange(every) for i in range(n_faults)]


# ── accounting ───────────────────────────────────────────────────────────────
@dataclass
class Accounting:
    dispatched: list[str]  # task ids, in dispatch order
    trained: dict[str, int]  # task id -> step (trained batches only)
    batched_untrained: set[str]
    dead: dict[str, str]  # task id -> dead-letter reason
    dlq_reasons: Counter[str]
    trained_twice: list[str]
    both: list[str]  # trained and dead-lettered
    stranded: list[str]  # neither (the run was stopped with them)
    foreign: list[str]  # in a batch or the DLQ, but never dispatched
    stale: list[tuple[str, int, int]]  # (sample id, version, step) beyond the bound
    batch_steps: list[int]
    state: Any
    # task id -> where it was seen (batches, dead letters): to explain a failed assertion
    seen: dict[str, list[str]] = field(default_factory=dict)

    def explain(self, task_ids: list[str]) -> str:
        return "\n".join(f"  {t}: {'; '.join(self.seen.get(t, []))}" for t in task_ids)


def account(nats_url: str, trained_steps: int) -> Accounting:
    import asyncio

    import nats

    from services.buffer.core import BufferState, Cursor, advance
    from services.buffer.core import task_id as make_task_id
    from services.buffer.store import read_state

    async def kv_state() -> BufferState:
        nc = await nats.connect(nats_url.split(","))
        try:
            rec = await read_state(await nc.jetstream().key_value(kv_bucket(RUN, "buffer")))
            assert not rec.fresh
            return rec.state
        finally:
            await nc.close()

    state = asyncio.run(kv_state())
    s = Subjects(RUN)
    # The buffer's source has 100 000 prompts (default dataset_size): no epoch wraps here.
    _, taken = advance(Cursor(), 100_000, state.dispatched)
    dispatched = [make_task_id(RUN, e, o) for e, o in taken]
    assert state.cursor == advance(Cursor(), 100_000, state.dispatched)[0]

    batches = [decode(b, TrainBatch) for b in read_stream(nats_url, stream_name(RUN, "BATCHES"),
                                                          s.batches)]  # fmt: skip
    by_step: dict[int, TrainBatch] = {}
    for b in batches:
        # the same step twice in the stream must be the same batch (dedup'd ids)
        if b.step in by_step:
            assert by_step[b.step].batch_id == b.batch_id
            assert [g.group_id for g in by_step[b.step].groups] == [g.group_id for g in b.groups], (
                f"step {b.step} stored twice with different groups"
            )
        by_step[b.step] = b
    trained: dict[str, int] = {}
    twice: list[str] = []
    untrained: set[str] = set()
    stale: list[tuple[str, int, int]] = []
    seen: dict[str, list[str]] = {}
    for step, b in sorted(by_step.items()):
        for g in b.groups:
            versions = sorted({smp.weight_version for smp in g.samples})
            seen.setdefault(g.task_id, []).append(
                f"batch step {step} group {g.group_id} versions {versions} by {g.worker_id}"
            )
            for smp in g.samples:
                if smp.weight_version < step - K:
                    stale.append((smp.sample_id, smp.weight_version, step))
            if step >= trained_steps:
                untrained.add(g.task_id)
            elif g.task_id in trained:
                twice.append(g.task_id)
            else:
                trained[g.task_id] = step

    dead: dict[str, str] = {}
    reasons: Counter[str] = Counter()
    for raw in read_stream(nats_url, stream_name(RUN, "DLQ"), s.dlq_all):
        dl = decode(raw, DeadLetter)
        reasons[dl.reason] += 1
        tid = None
        if dl.message_type == PromptTask.TYPE:
            tid = decode(dl.payload, PromptTask).task_id
        elif dl.message_type == SampleGroup.TYPE:
            tid = decode(dl.payload, SampleGroup).task_id
        if tid is not None:
            dead.setdefault(tid, dl.reason)
            seen.setdefault(tid, []).append(
                f"dlq {dl.reason} ({dl.message_type} by {dl.service}, delivered {dl.delivered}, "
                f"at {dl.at:.1f}): {dl.error[:160]}"
            )

    known = set(dispatched)
    return Accounting(
        dispatched=dispatched,
        trained=trained,
        batched_untrained=untrained,
        dead=dead,
        dlq_reasons=reasons,
        trained_twice=twice,
        both=sorted(set(trained) & set(dead)),
        stranded=[t for t in dispatched if t not in trained and t not in dead],
        foreign=sorted((set(trained) | untrained | set(dead)) - known),
        stale=stale,
        batch_steps=sorted(by_step),
        state=state,
        seen=seen,
    )
