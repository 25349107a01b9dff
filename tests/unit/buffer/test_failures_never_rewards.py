"""Failures never pose as rewards: a property test over injected failures.

Random groups whose random members fail in random ways, each marked exactly
as the rollout side marks it (the sandbox pool's own `_reward` for a check
that timed out, crashed or raised; `with_verdicts` for a judge that gave no
verdict; the worker's `env_error` for a verifiers v1 episode; a teacher that
could not score a sample: the worker leaves it out of the group; an engine
error, a killed worker or a preemption: no group at all), made into the
wire's samples and groups by the rollout core, then pushed through the
buffer's pure core (`Assembler`: `scored_part`, `min_scored_per_group`,
the zero-variance filter, batch assembly) and the trainer's own advantage
computation (`to_tensor_batch`, `Trainer._rl_rows`, per token).

What must hold: no failed member is ever trained; a group is dropped as
`unscored` exactly when too few of its members were scored; and each trained
group's advantages equal those computed here, independently, from its scored
members alone (and, with batch normalisation, those whitened over the batch).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proto.messages import PromptTask, SampleGroup, SamplingParams, TrainBatch
from services.buffer.admission import Policy
from services.buffer.core import Assembler, BufferState, Verdict, min_scored, zero_variance
from services.engine_api.engine_client import GenerateResult
from services.rollout.core import Origin, make_group, make_sample
from services.rollout.worker import ENV_ERROR
from services.sandbox import Reward, VerifierPool
from services.tasks.judge import JUDGE_REASONS, JudgeReward, with_verdicts
from services.tasks.judge import Verdict as JudgeVerdict
from services.trainer.core.batching import response_positions
from services.trainer.settings import LossConfig
from services.trainer.trainer import Trainer
from services.trainer.wire import to_tensor_batch

RUN = "prop"
PART = JudgeReward.model_validate(
    {"fn": "judge", "name": "style", "weight": 0.5, "rubric": "Rate {completion}."}
)

# How a member can end without a verdict. The sandbox's kinds are VerifierPool's;
# a judge's reasons are judge.JUDGE_REASONS; "teacher" is left out of its group by
# the worker (dead-lettered teacher_failed); "scored" is a verdict.
SANDBOX_KINDS = ("timeout", "crashed", "raised")
FATES = ("scored",) * 3 + SANDBOX_KINDS + JUDGE_REASONS + ("env", "teacher")


def reward_of(fate: str, value: float) -> Reward:
    """The member's Reward as the rollout side makes it for this fate."""
    if fate in ("scored", "teacher"):  # the teacher fails after the reward was computed
        return with_verdicts(Reward(value, {"exact": value}), [PART], [JudgeVerdict(0.5)])
    if fate in SANDBOX_KINDS:
        why = {"timeout": "timed out after 1s", "crashed": "process died", "raised": "raised X"}
        return VerifierPool._reward(["error", f"rewards.score {why[fate]}", fate])
    if fate in JUDGE_REASONS:
        verdict = JudgeVerdict(None, fate, f"{fate}: no verdict")
        return with_verdicts(Reward(value, {"exact": value}), [PART], [verdict])
    assert fate == "env"
    return Reward(0.0, {}, "verifiers-v1 episode failed: boom", ENV_ERROR)


def generated(i: int) -> GenerateResult:
    ids = [5 + i, 6, 7][: 1 + i % 3]
    return GenerateResult(
        rid=f"r{i}", text="x", output_ids=ids, logprobs=[-0.5] * len(ids), finish_type="stop",
        finish_reason={"type": "stop"}, prompt_tokens=2, completion_tokens=len(ids),
        weight_version=0, e2e_latency=0.0,
    )  # fmt: skip


@dataclass
class Made:
    """A task's group as published (None: the task ended with no group) and its truth."""

    group: SampleGroup | None
    scored: dict[str, float]  # sample id -> reward, of the members with a verdict
    failed: set[str]  # sample ids of the members without one


def make(g: int, members: list[tuple[str, float]], lost: bool) -> Made:
    task = PromptTask(
        run=RUN, task_id=f"{RUN}:e0:i{g}", epoch=0, index=g, task_name="t", prompt="p",
        n=len(members), sampling=SamplingParams(), created_at=time.time(),
    )  # fmt: skip
    gid = f"{task.task_id}:a0"
    origin = Origin("engine-0", 0, time.time())
    samples, scored, failed = [], {}, set()
    for i, (fate, value) in enumerate(members):
        s = make_sample(task, gid, i, [1, 2], generated(i), reward_of(fate, value), origin)
        if fate == "teacher":  # with_teacher leaves it out of the group
            failed.add(s.sample_id)
            continue
        samples.append(s)
        if fate == "scored":
            assert s.verifier_error is None
            scored[s.sample_id] = s.reward
        else:
            assert s.verifier_error is not None and s.reward == 0.0  # marked, never a verdict
            failed.add(s.sample_id)
    if lost or not samples:  # an engine error, a killed worker: redelivered or dead-lettered
        return Made(None, {}, failed | set(scored))
    return Made(make_group(RUN, task, gid, tuple(samples), "w"), scored, failed)


def reference(rewards: list[float], estimator: str, eps: float) -> list[float]:
    """Group-relative advantages of one group's scored rewards, by the papers' formulas."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = statistics.fmean(rewards)
    if estimator == "grpo":
        std = statistics.stdev(rewards)
        return [(r - mean) / (std + eps) for r in rewards]
    if estimator == "dr_grpo":
        return [r - mean for r in rewards]
    return [n / (n - 1) * (r - mean) for r in rewards]  # rloo


def whitened(values: list[float], eps: float) -> list[float]:
    if len(values) < 2:
        return values
    mean, std = statistics.fmean(values), statistics.stdev(values)
    return [(v - mean) / (std + eps) for v in values]


def trained_advantages(batch: TrainBatch, loss: LossConfig) -> list[float]:
    """The trainer's per-token advantages of each sample (one value over its response)."""
    core = to_tensor_batch(batch)
    trainer = Trainer.__new__(Trainer)  # only its batch preparation: pure given the batch
    trainer.cfg = SimpleNamespace(loss=loss, distill=None)  # type: ignore[assignment]
    out = []
    for i, row in enumerate(trainer._rl_rows(core)):
        span = response_positions(core.prompt_ids[i].numel(), core.response_ids[i].numel())
        adv = row["advantages"][span]  # [R]
        assert torch.equal(adv, adv[:1].expand_as(adv)), adv  # one value per sample
        out.append(float(adv[0]))
    return out


member = st.tuples(st.sampled_from(FATES), st.sampled_from((0.0, 0.25, 0.5, 1.0)))


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(st.lists(member, min_size=1, max_size=8), min_size=1, max_size=12),
    lost=st.sets(st.integers(0, 11), max_size=3),
    per_step=st.integers(1, 4),
    floor=st.one_of(st.none(), st.integers(1, 8)),
    estimator=st.sampled_from(("grpo", "dr_grpo", "rloo")),
    normalize=st.booleans(),
)
def test_each_trained_group_has_the_advantages_of_its_scored_members_alone(
    groups: list[list[tuple[str, float]]],
    lost: set[int],
    per_step: int,
    floor: int | None,
    estimator: str,
    normalize: bool,
) -> None:
    loss = LossConfig(advantage=estimator, batch_normalize_advantages=normalize)
    asm = Assembler(
        Policy(groups_per_step=per_step, max_staleness=1000),
        BufferState(),
        filters=(zero_variance,),
        min_scored=floor,
    )
    made = [make(g, members, g in lost) for g, members in enumerate(groups)]
    truth = {m.group.group_id: m for m in made if m.group is not None}
    failed = set().union(*(m.failed for m in made))
    batches = []
    for m in made:
        if m.group is None:
            asm.task_dead_lettered()
            continue
        verdict = asm.offer(m.group)
        enough = len(m.scored) >= min_scored(floor, len(m.group.samples))
        assert (verdict == Verdict.UNSCORED) == (not enough), (verdict, m.scored)
        while (taken := asm.take_batch()) is not None:
            batches.append(taken)

    trained: set[str] = set()
    for step, grps in batches:
        batch = TrainBatch(run=RUN, batch_id=f"{RUN}:step{step}", step=step, groups=tuple(grps))
        got = trained_advantages(batch, loss)
        want: list[float] = []
        for grp in grps:
            ids = [s.sample_id for s in grp.samples]
            scored = truth[grp.group_id].scored
            assert set(ids) == set(scored), "a trained group holds exactly its scored members"
            want += reference([scored[i] for i in ids], estimator, loss.advantage_eps)
            trained.update(ids)
        if normalize:
            want = whitened(want, loss.advantage_eps)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4), (got, want)
    assert not trained & failed, "a member without a verdict was trained"
