"""On-policy distillation end to end: real processes over a real nats-server, as
`flywheel up` plans and supervises them.

The student is the tiny model; the teacher is a differently seeded tiny model on
an engine of its own (`[teacher] engines = 1`, started like the rollout engines),
and beside it a teacher URL that is a real HTTP server which never answers. With
one try per sample, the workers' round-robin sends about half the samples to each:
those the real teacher scores travel with its logprobs and identity, and the
trainer trains on the reverse-KL advantage alone (`reward_weight = 0`); those sent
to the hung one are dead-lettered `teacher_failed` with the reason, and the run
goes on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from proto.codec import decode
from proto.messages import DeadLetter, Sample, SampleGroup, unpack_f32, unpack_i32
from proto.subjects import Subjects
from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.stack.localdev.nats_server import NatsServer
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages

RUN = "distill"
S = Subjects(RUN)
STEPS = 3
pytestmark = pytest.mark.slow


class HungServer:
    """An HTTP server (aiohttp, its own thread and loop) that accepts every request and
    never answers it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""
        self.runner: Any = None

    async def _start(self) -> str:
        from aiohttp import web

        async def hang(request: web.Request) -> web.Response:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", hang)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def __enter__(self) -> HungServer:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def teacher_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("teacher") / "m", TinyModelSpec(seed=1))


@pytest.fixture(scope="module")
def stack(
    tiny_model: Path, teacher_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("distill")
    config = root / "run.toml"
    with HungServer() as hung:
        config.write_text(
            run_file(
                RUN,
                stack=stack_table(root, tiny_model, engines=1),
                task={"source": {"type": "arithmetic", "digits": 1}},
                buffer={
                    "samples_per_prompt": 4,
                    "groups_per_step": 2,
                    "max_new_tokens": 6,
                    "max_staleness": 1,
                    "oversample": 0.0,
                    "filter_zero_variance": False,
                },
                rollout={"concurrency": 2, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
                engine={"num_threads": 1},
                teacher={
                    "name": "tiny-seed1",
                    "model": teacher_model,
                    "engines": 1,
                    "engine_threads": 1,
                    "urls": [hung.url],
                    "attempts": 1,
                    "timeout_s": 2.0,
                    "concurrency": 4,
                },
                trainer={
                    "publish_every": 1,
                    "runtime": {"cpu_threads": 1},
                    "optim": {"lr": 1e-3},
                    "distill": {"coef": 1.0, "reward_weight": 0.0},
                },
                sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2},
            )
        )
        with NatsServer(store_dir=root / "nats") as nats, Stack(config, nats.url) as st:
            with printing_logs_on_failure(st):
                st.start("engine-0", "teacher-0")
                st.start("rollout-0", "sync", "trainer")
                st.start("buffer")
                wait_for(lambda: st.trained_steps() >= STEPS, 300, f"{STEPS} trained steps")
            yield st


def teacher_forward(model_dir: Path, ids: list[int], start: int) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i > start, from a transformers forward of the teacher."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(x).logits[0, start:-1].float(), dim=-1)
    return logp.gather(-1, x[0, start + 1 :, None])[:, 0]


def test_samples_carry_the_teachers_logprobs_and_identity(
    stack: Stack, teacher_model: Path
) -> None:
    groups = messages(stack.nats_url, RUN, "SAMPLES", S.samples, SampleGroup)
    samples = [s for g in groups for s in g.samples]
    assert samples and all(s.teacher_logprobs is not None for s in samples)
    for s in samples:
        assert s.teacher is not None and s.teacher.name == "tiny-seed1"
        assert s.teacher.model == str(teacher_model) and s.teacher.version == 0
        assert len(unpack_f32(s.teacher_logprobs or b"")) == s.num_response_tokens
    # the numbers are the teacher's, not the student's: a forward of the teacher model
    s = next(s for s in samples if s.num_response_tokens > 1)
    prompt, response = unpack_i32(s.prompt_ids).tolist(), unpack_i32(s.response_ids).tolist()
    want = teacher_forward(teacher_model, prompt + response, len(prompt) - 1)
    got = torch.from_numpy(unpack_f32(s.teacher_logprobs or b"").copy())
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert not torch.allclose(got, torch.from_numpy(unpack_f32(s.logprobs).copy()), atol=1e-3)


def test_the_trainer_trains_on_the_distillation_advantage(stack: Stack) -> None:
    rows = stack.trained_rows()
    assert len(rows) >= STEPS
    for r in rows:
        # reward_weight = 0: every gradient is the reverse KL's; teacher_kl is measured
        assert r["grad_norm"] > 0 and "teacher_kl" in r, r


def test_a_hung_teacher_costs_dead_letters_with_the_reason_and_the_run_goes_on(
    stack: Stack,
) -> None:
    dead = messages(stack.nats_url, RUN, "DLQ", S.dlq("teacher_failed"), DeadLetter)
    assert dead, "no sample was dead-lettered though half went to a hung teacher"
    for d in dead:
        assert d.reason == "teacher_failed" and d.service == "rollout"
        assert "timed out" in d.error and "1 tries failed" in d.error, d.error
        lost = decode(d.payload, Sample)
        assert lost.teacher_logprobs is None  # the sample as generated, unscored
    metric = stack.proc("rollout-0").metric_sum("flywheel_rollout_teacher_failures_total")
    assert metric is not None and metric >= len(dead)
    # the run went on: more steps trained after the dead letters, every process alive
    before = stack.trained_steps()
    wait_for(lambda: stack.trained_steps() > before, 240, "a step after the dead letters")
    assert all(stack.proc(n).alive for n in stack.names), stack.failed
