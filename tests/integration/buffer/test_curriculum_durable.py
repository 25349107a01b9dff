"""The curriculum and the flat-group mechanisms against a real nats-server.

The real `BufferService` runs in this process (its handlers called as its
message loops call them, as in test_buffer_state.py), on a dataset of 6
prompts. Its dispatcher publishes real PromptTasks to TASKS; a rollout
stand-in answers each with a group whose rewards are chosen by prompt.

- Durable pass rates: two epochs in which two prompts are answered right by
  every sample retire them; the buffer is then replaced by a second one on
  the same bucket, which must hold the same pass rates and never dispatch
  the retired prompts again (they are counted as skipped).
- Rest and refill: a prompt whose group was flat rests (not dispatched in
  the next epoch, across a restart too), and a flat group's slot in the
  batch being filled is refilled with a recent group, which is published
  again in the next TrainBatch.
- Solved is not stuck: groups whose every reply is right (one token sequence,
  as a collapse looks) are said solved, not collapsed; once every prompt is
  retired the buffer ends the run (`on_solved = "stop"`; in this process, and
  as a real `python -m services.buffer` under the stack's Supervisor) or goes
  on (`"continue"`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pytest

from proto.codec import decode, encode
from proto.messages import (
    PromptTask,
    Sample,
    SampleGroup,
    TrainBatch,
    WeightsReady,
    pack_f32,
    pack_i32,
    pack_u8,
)
from proto.streams import consumers_for, kv_bucket, stream_name, streams_for
from proto.subjects import Subjects
from services.buffer.app import BufferService
from services.buffer.curriculum import Difficulty, difficulty
from services.buffer.settings import BufferSettings
from services.buffer.store import StateStore
from services.runtime.errors import PermanentError
from services.runtime.nats_conn import ensure_consumer, ensure_kv, ensure_streams
from services.runtime.settings import load_settings
from services.stack.localdev.nats_server import NatsServer
from tests.harness.runfile import run_file
from tests.integration.buffer.test_buffer_state import At, Ctx

RUN = "curric"
SIZE = 6  # prompts
G = 2  # groups per step


def settings(tmp_path: Path, url: str, **buffer: Any) -> BufferSettings:
    path = tmp_path / "run.toml"
    base = {"groups_per_step": G, "max_staleness": 2, "oversample": 0.0,
            "samples_per_prompt": 4, "keep_settled_s": 0.0}  # fmt: skip
    path.write_text(
        run_file(
            RUN,
            nats={"url": url},
            task={"source": {"type": "arithmetic", "size": SIZE}},
            buffer={**base, **buffer},
        )
    )
    return load_settings(BufferSettings, path)


async def service(js: Any, max_payload: int, s: BufferSettings) -> BufferService:
    bucket = kv_bucket(RUN, "buffer")
    store = StateStore(js, await ensure_kv(js, bucket), bucket)
    svc = BufferService(Ctx(js, max_payload), s, store)  # type: ignore[arg-type]
    await svc.restore()
    return svc


def answer(
    task: PromptTask, rewards: list[float], version: int, same_reply: bool = False
) -> SampleGroup:
    """A group of `rewards`; its replies differ (or are one token sequence: `same_reply`)."""
    gid = f"{task.task_id}:a{task.attempt}"
    samples = tuple(
        Sample(
            sample_id=f"{gid}:s{i}",
            group_id=gid,
            task_id=task.task_id,
            index=i,
            prompt_ids=pack_i32([1, 2]),
            response_ids=pack_i32([3, 0 if same_reply else i]),
            logprobs=pack_f32([-0.1, -0.2]),
            loss_mask=pack_u8([1, 1]),
            reward=r,
            finish_reason="stop",
            weight_version=version,
            weight_version_last=version,
            engine_id="e",
        )
        for i, r in enumerate(rewards)
    )
    return SampleGroup(run=RUN, group_id=gid, task_id=task.task_id, task_name=task.task_name,
                       worker_id="w", samples=samples)  # fmt: skip


class Loop:
    """A rollout stand-in: takes the dispatched tasks, answers them by `rewards_for`."""

    def __init__(self, js: Any) -> None:
        self.js = js
        self.tasks: Any = None
        self.batches: Any = None

    async def open(self) -> None:
        consumers = consumers_for(RUN)
        for role in ("rollout", "trainer"):
            await ensure_consumer(self.js, consumers[role])
        self.tasks = await self.js.pull_subscribe_bind("rollout", stream_name(RUN, "TASKS"))
        self.batches = await self.js.pull_subscribe_bind("trainer", stream_name(RUN, "BATCHES"))

    async def take(self) -> list[PromptTask]:
        out: list[PromptTask] = []
        while True:
            try:
                msgs = await self.tasks.fetch(50, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                return out
            for m in msgs:
                out.append(decode(m.data, PromptTask))
                await m.ack()

    async def trained(self) -> list[TrainBatch]:
        out: list[TrainBatch] = []
        while True:
            try:
                msgs = await self.batches.fetch(50, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                return out
            for m in msgs:
                out.append(decode(m.data, TrainBatch))
                await m.ack()

    async def answer(
        self,
        svc: BufferService,
        tasks: list[PromptTask],
        rewards_for: Callable[[PromptTask], list[float]],
        version: int = 0,
    ) -> None:
        for t in tasks:
            g = answer(t, rewards_for(t), version)
            ack = await self.js.publish(Subjects(RUN).samples, encode(g))
            try:
                await svc.on_group(g, At(ack.seq))  # type: ignore[arg-type]
            except PermanentError:
                pass  # dropped (flat): the message loop dead-letters it


async def epoch(svc: BufferService, loop: Loop, version: int) -> list[PromptTask]:
    """Make `version` ready, dispatch what admission allows, return the tasks published."""
    await svc.on_ready(WeightsReady(run=RUN, version=version), None)  # type: ignore[arg-type]
    await svc.dispatch_once()
    return await loop.take()


def test_pass_rates_survive_a_restart_and_retired_prompts_are_never_drawn(
    tmp_path: Path,
) -> None:
    with NatsServer() as server:
        asyncio.run(asyncio.wait_for(_retire(tmp_path, server.url), 120))


async def _retire(tmp_path: Path, url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    # easy prompts drawn as any (weight 1), no rest: what retires them is their pass rate
    s = settings(tmp_path, url, curriculum_easy_weight=1.0, flat_rest_steps=0)
    svc = await service(js, nc.max_payload, s)
    loop = Loop(js)
    await loop.open()
    first = await epoch(svc, loop, 0)
    assert [t.epoch for t in first] == [0] * SIZE  # (k + 1) * G = 6 slots: one epoch
    solved = {(t.task_name, t.index) for t in first[:2]}  # every sample right, every time

    def rewards(t: PromptTask) -> list[float]:
        return [1.0] * 4 if (t.task_name, t.index) in solved else [0.0, 1.0, 0.0, 0.0]

    await loop.answer(svc, first, rewards)
    second = await epoch(svc, loop, svc.asm.state.next_step)
    assert sorted(t.index for t in second) == sorted(t.index for t in first)  # easy: drawn
    await loop.answer(svc, second, rewards, svc.asm.state.ready_version)
    assert len(solved) == 2
    for key in solved:
        st = svc.prompts[key]
        assert (st.groups, st.pass_rate) == (2, 1.0)
        assert difficulty(st, svc.curriculum) is Difficulty.RETIRED
    others = {k: v for k, v in svc.prompts.items() if k not in solved}
    assert len(others) == SIZE - 2 and all(v.pass_rate == 0.25 for v in others.values())

    again = await service(js, nc.max_payload, s)  # the restart, on the same bucket
    assert again.prompts == svc.prompts
    assert again.census["retired"] == 2 and again.census["normal"] == SIZE - 2
    later: list[PromptTask] = []
    version = again.asm.state.next_step
    for _ in range(6):  # a few more epochs' worth
        tasks = await epoch(again, loop, version)
        await loop.answer(again, tasks, rewards, version)
        later += tasks
        version = again.asm.state.next_step
    assert len(later) >= SIZE
    assert not {(t.task_name, t.index) for t in later} & solved
    skipped = again.metrics.skipped.labels(reason="retired")._value.get()
    assert skipped >= 2
    await nc.close()


def test_a_flat_prompt_rests_and_a_flat_groups_slot_is_refilled(tmp_path: Path) -> None:
    with NatsServer() as server:
        asyncio.run(asyncio.wait_for(_rest_and_refill(tmp_path, server.url), 120))


async def _rest_and_refill(tmp_path: Path, url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    s = settings(tmp_path, url, flat_rest_steps=1000, refill_max_share=0.5)
    svc = await service(js, nc.max_payload, s)
    loop = Loop(js)
    await loop.open()
    tasks = await epoch(svc, loop, 0)
    assert [t.epoch for t in tasks] == [0] * SIZE  # (k + 1) * G = 6 slots: one epoch
    # The order the groups come back: two with a spread (batch 0), one with a spread,
    # then a flat one, whose slot takes the newest of batch 0: batch 1 is full at once.
    spread = [0.0, 1.0, 0.0, 1.0]
    order = [(tasks[0], spread), (tasks[1], spread), (tasks[3], spread), (tasks[2], [0.0] * 4)]
    for t, r in order:
        await loop.answer(svc, [t], functools.partial(lambda r, _t: r, r))
    batches = await loop.trained()
    assert [b.step for b in batches] == [0, 1]
    refill = batches[0].groups[1].group_id
    assert [g.group_id for g in batches[1].groups] == [f"{tasks[3].task_id}:a0", refill]
    assert svc.metrics.refilled._value.get() == 1
    flat_key = (tasks[2].task_name, tasks[2].index)
    assert svc.prompts[flat_key].rest_until == 1 + 1000  # flat while step 1 was filling

    again = await service(js, nc.max_payload, s)  # the rest is durable
    assert again.prompts[flat_key].rest_until == 1001
    await loop.answer(again, tasks[4:], lambda _t: spread)  # the epoch's last two
    next_epoch: list[PromptTask] = []
    for v in range(1, 4):
        got = await epoch(again, loop, v)
        await loop.answer(again, got, lambda _t: spread, v)
        next_epoch += got
    assert {(t.task_name, t.index) for t in next_epoch if t.epoch == 1}
    assert flat_key not in {(t.task_name, t.index) for t in next_epoch}
    assert again.metrics.skipped.labels(reason="resting")._value.get() >= 1
    await nc.close()


def test_a_collapse_is_said_once_in_the_console(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with NatsServer() as server, caplog.at_level(logging.WARNING, "services.buffer.app"):
        asyncio.run(asyncio.wait_for(_collapse(tmp_path, server.url), 120))
    said = [r.getMessage() for r in caplog.records if "no trainable group" in r.getMessage()]
    assert len(said) == 1, said
    assert "no trainable group in the last 2 (1.0 steps' worth)" in said[0]
    assert "every group flat and 1.0 distinct completions of 4 per group" in said[0]


async def _collapse(tmp_path: Path, url: str) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    s = settings(tmp_path, url, stall_warn_steps=1.0)
    svc = await service(js, nc.max_payload, s)
    loop = Loop(js)
    await loop.open()
    tasks = await epoch(svc, loop, 0)
    for t in tasks:  # one sentence, the same reward: the collapsed policy of the demo
        g = answer(t, [0.15] * 4, 0, same_reply=True)
        ack = await js.publish(Subjects(RUN).samples, encode(g))
        with contextlib.suppress(PermanentError):
            await svc.on_group(g, At(ack.seq))  # type: ignore[arg-type]
    assert svc.metrics.stalls._value.get() == 1
    assert svc.metrics.flat_share._value.get() == 1.0
    assert svc.metrics.distinct._value.get() == 1.0
    assert svc.metrics.untrainable._value.get() == SIZE
    await nc.close()


def test_solved_prompts_are_said_solved_and_a_solved_set_stops_the_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every reply right, one token sequence per group (as a collapse looks): the stall
    line says solved, not collapse; once the curriculum has retired all 6 prompts the
    buffer ends the run (`on_solved = "stop"`, the default): RunDone, the stop event set,
    nothing more dispatched."""
    with NatsServer() as server, caplog.at_level(logging.WARNING, "services.buffer.app"):
        svc = asyncio.run(asyncio.wait_for(_solve_all(tmp_path, server.url, {}), 120))
    assert svc.done is not None and svc.ctx.stop.is_set()
    assert svc.metrics.dispatched._value.get() == SIZE  # nothing drawn after it
    assert str(svc.done).startswith(
        "the whole training set is solved: every one of its 6 prompts is retired (pass rate "
        ">= 0.9 over at least 1 groups); stopping the run"
    )
    said = [r.getMessage() for r in caplog.records if "no trainable group" in r.getMessage()]
    assert len(said) == 1 and "these prompts are solved, not stuck" in said[0], said
    assert "collapse)" not in said[0] and "(6 of 6 retired so far)" in said[0]


def test_a_solved_set_goes_on_when_the_run_file_says_continue(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with NatsServer() as server, caplog.at_level(logging.WARNING, "services.buffer.app"):
        svc = asyncio.run(
            asyncio.wait_for(_solve_all(tmp_path, server.url, {"on_solved": "continue"}), 120)
        )
    assert svc.done is None and not svc.ctx.stop.is_set()
    said = [r.getMessage() for r in caplog.records if "whole training set" in r.getMessage()]
    assert len(said) == 1 and "drawing them anyway" in said[0]
    assert svc.metrics.dispatched._value.get() > SIZE  # the solved prompts drawn again
    assert not any("retired or resting" in r.getMessage() for r in caplog.records)


async def _solve_all(tmp_path: Path, url: str, extra: dict[str, Any]) -> BufferService:
    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    s = settings(tmp_path, url, curriculum_retire_after=1, flat_rest_steps=0,
                 stall_warn_steps=3.0, **extra)  # fmt: skip
    svc = await service(js, nc.max_payload, s)
    loop = Loop(js)
    await loop.open()
    tasks = await epoch(svc, loop, 0)
    assert len(tasks) == SIZE
    for t in tasks:  # the right answer, said alike by every sample
        g = answer(t, [1.0] * 4, 0, same_reply=True)
        ack = await js.publish(Subjects(RUN).samples, encode(g))
        with contextlib.suppress(PermanentError):
            await svc.on_group(g, At(ack.seq))  # type: ignore[arg-type]
    assert svc.census["retired"] == SIZE and svc.metrics.stalls._value.get() == 1
    await svc.dispatch_once()
    if svc.done is None:  # continue: what was drawn comes back solved again
        more = await epoch(svc, loop, 0)
        assert more
    await nc.close()
    return svc


def test_the_buffer_process_ends_a_solved_run_and_the_supervisor_stops_it(
    tmp_path: Path,
) -> None:
    """The stop made real: `python -m services.buffer` under the stack's own Supervisor,
    on a real nats-server; a rollout stand-in answers every task right. The buffer says
    why and exits EXIT_DONE; the supervisor ends the run, neither failed nor restarted."""
    from services.runtime.errors import EXIT_DONE
    from services.stack.plan import ProcSpec
    from services.stack.supervisor import Supervisor
    from tests.harness.ports import free_port

    with NatsServer() as server:
        port = free_port()
        s = settings(tmp_path, server.url, curriculum_retire_after=1, flat_rest_steps=0)
        assert s.on_solved == "stop"  # the default
        argv = (sys.executable, "-m", "services.buffer", "-c", str(tmp_path / "run.toml"))
        url = f"http://127.0.0.1:{port}"
        spec = ProcSpec("buffer", "buffer", argv, {"FLYWHEEL_BUFFER_METRICS_PORT": str(port)},
                        f"{url}/readyz", f"{url}/metrics")  # fmt: skip
        sup = Supervisor([spec], tmp_path / "logs", max_restarts=3, console=None)

        async def scenario() -> None:
            await sup.start_all()
            watch = asyncio.create_task(sup.watch(asyncio.Event()))
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            loop = Loop(js)
            await loop.open()
            answered = 0
            while not watch.done() and answered < 4 * SIZE:
                for t in await loop.take():  # every reply right, every time
                    await js.publish(Subjects(RUN).samples, encode(answer(t, [1.0] * 4, 0)))
                    answered += 1
            await asyncio.wait_for(watch, 60)
            await nc.close()
            await sup.stop_all()

        asyncio.run(asyncio.wait_for(scenario(), 120))
    buffer = sup.get("buffer")
    assert sup.finished == "buffer ended the run" and sup.failed is None
    assert buffer.restarts == 0 and buffer.proc is not None
    assert buffer.proc.returncode == EXIT_DONE
    log = buffer.log_path.read_text()
    assert "flywheel buffer: the whole training set is solved: every one of its 6 prompts" in log
