"""A `flywheel up` run under fault injection, and the accounting of what it trained.

The run is the real thing: `python -m services up -c run.toml --steps N`
(engines, rollout workers, sync, trainer, buffer as supervised subprocesses,
`on_failure = "restart"`) against a nats-server this harness owns
(`[stack] embedded_nats = false`, persisted store, fixed port), so it can be
restarted under the running services. `<run_dir>/pids.json`, written by the
supervisor on every (re)start, names the pid of each service.

Faults (`Fault.kind`):

| kind    | what                                                                  |
|---------|-----------------------------------------------------------------------|
| kill    | SIGKILL a service; the supervisor restarts it                          |
| stop    | SIGSTOP a service for `hold_s`, then SIGCONT (a partition / GC pause)  |
| nats    | restart nats-server (SIGTERM: JetStream flushes) on the same port/store |
| nats9   | SIGKILL nats-server, start it again (what survives is what was synced) |

Accounting (`account`), from the streams and the buffer's KV state only:
the dispatched task ids are the first `dispatched` positions of the
buffer's cursor order; each is trained (its group in exactly one trained
batch) or dead-lettered, never both, except for at most `(k + 1) · G`
tasks the run was stopped with (in flight, pending, or batched for a step
not yet trained: admission control bounds exactly that, see
services/buffer/core.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOP = Path(__file__).resolve().parents[1] / "integration" / "loop"
sys.path.insert(0, str(LOOP))

from loop_stack import read_stream, run_file, wait_for  # noqa: E402

from proto.codec import decode  # noqa: E402
from proto.messages import DeadLetter, PromptTask, SampleGroup, TrainBatch  # noqa: E402
from proto.streams import kv_bucket, stream_name  # noqa: E402
from proto.subjects import Subjects  # noqa: E402
from services.common.nats_server import NatsServer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = "chaos"
G = 2  # groups per step
K = 2  # max staleness (2: a killed worker's stranded tasks do not stop admission)


def chaos_config(root: Path, model: Path, nats_url: str, update_mode: str = "retract") -> str:
    return run_file(
        RUN,
        nats={"url": nats_url},
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
    kind: str  # kill | stop | nats | nats9
    target: str = ""  # a service name from pids.json (kill, stop)
    hold_s: float = 4.0  # stop: how long the process stays frozen

    def __str__(self) -> str:
        return f"{self.kind} {self.target}".strip()


@dataclass
class Injected:
    fault: Fault
    at_step: int  # trainer step when it was injected
    at: float
    recovered_s: float = 0.0  # until the trainer did two more steps
    old_pid: int | None = None
    new_pid: int | None = None


@dataclass
class ChaosRun:
    root: Path
    model: Path
    steps: int
    seed: int = 0
    update_mode: str = "retract"  # sync's: each update pauses the engines, requeues, continues
    nats: NatsServer = field(init=False)
    up: subprocess.Popen[bytes] | None = None
    injected: list[Injected] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def log(self) -> Path:
        return self.root / "up.log"

    # ── lifecycle ────────────────────────────────────────────────────────────
    def start(self) -> None:
        self.nats = NatsServer(store_dir=self.root / "nats-store").start()
        config = self.root / "run.toml"
        config.write_text(chaos_config(self.root, self.model, self.nats.url, self.update_mode))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        with self.log.open("ab") as f:
            self.up = subprocess.Popen(
                [sys.executable, "-m", "services", "up", "-c", str(config), "--steps",
                 str(self.steps), "--quiet"],
                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def close(self) -> None:
        """Stop the stack (leaves nats-server running, for the accounting)."""
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            try:
                self.up.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait(5)
        for pid in self.pids().values():  # anything frozen or orphaned by a failed test
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_done(self, timeout_s: float) -> int:
        assert self.up is not None
        rc = self.up.wait(timeout_s)
        return rc

    # ── observing ────────────────────────────────────────────────────────────
    def pids(self) -> dict[str, int]:
        path = self.run_dir / "pids.json"
        try:
            return {k: int(v) for k, v in json.loads(path.read_text()).items()}
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def rows(self) -> list[dict[str, Any]]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        return [r for r in rows if "batch_id" in r]

    def step(self) -> int:
        return max((int(r["step"]) for r in self.rows()), default=0)

    def up_log(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def service_log(self, name: str) -> str:
        path = self.run_dir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def procs(self) -> dict[str, dict[str, Any]]:
        """`procs.json`: per service its pid, restart count, metrics URL."""
        try:
            return dict(json.loads((self.run_dir / "procs.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def restarts(self) -> dict[str, int]:
        """Restarts per service, as the supervisor counts them."""
        return {n: int(d["restarts"]) for n, d in self.procs().items()}

    def metric(self, service: str, name: str) -> float | None:
        url = self.procs().get(service, {}).get("metrics_url")
        return metric(url, name) if url else None

    def diagnostics(self) -> str:
        names = sorted(self.pids()) or []
        parts = [f"==== up.log\n{self.up_log()[-3000:]}"]
        parts += [f"==== {n}\n{self.service_log(n)[-2500:]}" for n in names]
        return "\n".join(parts)

    # ── faults ───────────────────────────────────────────────────────────────
    def wait_alive(self) -> None:
        """Until the up process is running every service (first start can take a while)."""
        wait_for(lambda: self._check_up() and self.step() >= 1, 180, "the first trained step", 0.5)

    def _check_up(self) -> bool:
        if self.up is not None and self.up.poll() is not None:
            raise AssertionError(f"flywheel up exited ({self.up.returncode})")
        return True

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
        elif fault.kind == "nats":
            self.nats.restart()
        elif fault.kind == "nats9":
            self.nats.kill()
            self.nats.start()
        else:
            raise ValueError(f"unknown fault {fault}")
        self.injected.append(rec)
        return rec

    def run_faults(self, faults: list[Fault], schedule: list[int]) -> None:
        """Fault i once the trainer reaches step `schedule[i]`, plus a seeded random delay.

        A fault whose step has passed while the run recovered from the last
        one comes at once. Recovery: the trainer did two more steps.
        """
        rng = random.Random(self.seed)
        for f, at in zip(faults, schedule, strict=True):
            wait_for(lambda a=at: self._check_up() and self.step() >= a, 150, f"step {at}", 0.05)
            time.sleep(rng.uniform(0.0, 0.5))  # the seeded random moment (not a synchronisation)
            rec = self.inject(f)
            want = max(self.step(), rec.at_step) + 2
            wait_for(lambda w=want: self._check_up() and self.step() >= w, 150,
                     f"2 steps after '{f}'", 0.2)  # fmt: skip
            rec.recovered_s = time.time() - rec.at


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


def account(nats_url: str, trained_steps: int) -> Accounting:
    import asyncio

    import nats

    from services.buffer.core import Cursor, advance
    from services.buffer.core import task_id as make_task_id
    from services.buffer.state import STATE_KEY, load_state

    async def kv_state() -> bytes:
        nc = await nats.connect(nats_url)
        try:
            kv = await nc.jetstream().key_value(kv_bucket(RUN, "buffer"))
            entry = await kv.get(STATE_KEY)
            assert entry.value is not None
            return entry.value
        finally:
            await nc.close()

    state, _pending = load_state(asyncio.run(kv_state()))
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
    for step, b in sorted(by_step.items()):
        for g in b.groups:
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
    )


def metric(url: str, name: str) -> float | None:
    """Sum of a metric's samples (all label sets) at `url`; None when unreachable/absent."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{.*\}})? (\S+)$",
                                                       text, re.M)]  # fmt: skip
    return sum(values) if values else None
