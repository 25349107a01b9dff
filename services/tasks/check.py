"""The pre-flight check: the base model sampled on training prompts through the real reward.

`flywheel check -c run.toml` (and the first seconds of `flywheel up`) draws
N training prompts (seeded, across the run's tasks as the buffer weighs
them: `TrainOrder`), formats and tokenizes them exactly as the buffer and
the rollout worker do (`prompts.format_row` + `prompts.encode`), samples k
replies each with the held-out evaluation's batched generation
(`evaluate.generate`) at the run's `[buffer]` temperature and
max_new_tokens, and scores every reply with the task's reward in the
verifier sandbox (`Scorer`, one round trip per group), as a rollout worker
would. `check_verdict.py` turns the scores into figures and one verdict.

What differs from a rollout, on purpose: the model runs in this process,
in bfloat16 where the CPU computes it natively (half the time of float32 in
the one comparison run: bench/results_learning.md, "Pre-flight"; 32
prompts' statistics are far coarser than bf16's rounding), and stop strings and
top_p are not applied (`evaluate.generate` samples the full distribution
and stops at EOS). Multi-turn tasks ([task.episode]) are not checked:
`evaluate` plays their episodes greedily only. Judge reward parts are left
out of the sum, as in `flywheel eval`.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError, FlywheelError
from services.tasks.check_verdict import Reply, Stats, Verdict, names_answer, stats, verdict
from services.tasks.evaluate import Evaluator, generate, load_model
from services.tasks.prompts import encode, format_row, readable
from services.tasks.registry import Row
from services.tasks.scoring import Scorer, correct
from services.tasks.taskset import LoadedTask, TaskSet, TrainOrder


class NotCheckable(FlywheelError):
    """The run's tasks are of a kind the check cannot sample (multi-turn episodes)."""


@dataclass(frozen=True)
class Sampling:
    """How the check samples: the rollout's `[buffer]` keys, and its own size."""

    prompts: int = 32
    k: int = 8
    temperature: float = 0.7
    max_new_tokens: int = 16
    seed: int = 0


@dataclass(frozen=True)
class Sample:
    """One reply, as the check shows it."""

    task: str
    prompt: str  # readable: chat turns as `role: content` lines
    reply: str
    answer: str | None
    reward: float
    correct: bool


@dataclass(frozen=True)
class CheckReport:
    stats: Stats
    verdict: Verdict
    sampling: Sampling
    seconds: float  # model load, sampling and scoring (not the interpreter's start)
    dtype: str
    per_task: dict[str, Stats] = field(default_factory=dict)
    samples: tuple[Sample, ...] = ()


def draw(loaded: dict[str, LoadedTask], n: int, seed: int) -> list[tuple[LoadedTask, int, Row]]:
    """`n` distinct training prompts, drawn at random from the buffer's first epoch (a
    mixture in its weights): (task, row index in its source, row)."""
    order = TrainOrder.build(loaded)
    slots = random.Random(seed).sample(range(len(order)), min(n, len(order)))
    out = []
    for slot in slots:
        name, idx = order.item(0, slot)
        task = loaded[name]
        out.append((task, idx, task.rows.row(idx)))
    return out


def sampling_dtype() -> Any:
    """bfloat16 where this CPU computes it natively (as the trainer's precision 'auto'
    does), else float32."""
    import torch

    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native else torch.float32


async def _score(
    scorer: Scorer, drawn: list[tuple[LoadedTask, int, Row]], replies: list[list[tuple[str, int]]]
) -> list[list[Any]]:
    """Every group scored in one sandbox round trip each, concurrently."""
    return await asyncio.gather(
        *(
            scorer.score_group(task.name, idx, row.answer, group)
            for (task, idx, row), group in zip(drawn, replies, strict=True)
        )
    )


def check_model(
    model: Any, tokenizer: Any, ev: Evaluator, how: Sampling, *, show: int = 3
) -> tuple[Stats, Verdict, dict[str, Stats], tuple[Sample, ...]]:
    """Sample and score `how.prompts` training prompts of `ev`'s tasks (its loop, its
    verifier pool); the figures, the verdict, per task figures, `show` sample replies."""
    if how.k < 2:
        raise ConfigError("-k must be at least 2 (a group's spread needs two)")
    episodic = [n for n, t in ev.loaded.items() if t.spec.episode is not None]
    if episodic:
        raise NotCheckable(f"{ev.tasks.keys[episodic[0]]} has an episode: the check samples "
                           "single-turn tasks only")  # fmt: skip
    drawn = draw(ev.loaded, how.prompts, how.seed)
    formatted = [format_row(task.spec, row) for task, _, row in drawn]
    ids = [
        encode(tokenizer, p, m, task.spec.chat_template)
        for (p, m), (task, _, _) in zip(formatted, drawn, strict=True)
    ]
    replies = generate(model, tokenizer, ids, max_new_tokens=how.max_new_tokens, k=how.k,
                       temperature=how.temperature, seed=how.seed, batch_size=32)  # fmt: skip
    scorer = Scorer(ev.tasks, ev.pool, ev.tools)
    rewards = ev.loop.run_until_complete(_score(scorer, drawn, replies))
    groups: dict[str, list[list[Reply]]] = {}
    samples: list[Sample] = []
    for (task, _, row), (p, m), group, scored in zip(
        drawn, formatted, replies, rewards, strict=True
    ):
        out = [
            Reply(r.reward, correct(task.spec, r), names_answer(text, row.answer), r.error)
            for (text, _), r in zip(group, scored, strict=True)
        ]
        groups.setdefault(task.name, []).append(out)
        if len(samples) < show:
            text, r = group[0][0], out[0]
            samples.append(Sample(task.name, readable(p, m), text, row.answer, r.reward, r.correct))
    overall = stats([g for gs in groups.values() for g in gs])
    per_task = {name: stats(gs) for name, gs in groups.items()} if len(groups) > 1 else {}
    return overall, verdict(overall, temperature=how.temperature), per_task, tuple(samples)


def check_dir(
    model_dir: str | Path, tasks: TaskSet, how: Sampling, *, timeout_s: float = 5.0, show: int = 3
) -> CheckReport:
    """The check of a model directory: loaded once, in `sampling_dtype`, its replies scored
    in a verifier pool of this call's own."""
    started = time.monotonic()
    model, tokenizer = load_model(model_dir)
    dtype = sampling_dtype()
    model.to(dtype)
    with Evaluator(tasks, timeout_s=timeout_s) as ev:
        s, v, per_task, samples = check_model(model, tokenizer, ev, how, show=show)
    return CheckReport(s, v, how, time.monotonic() - started, str(dtype).removeprefix("torch."),
                       per_task, samples)  # fmt: skip
