"""Settings of the buffer service (`[buffer]` in the run file)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from services.tasks.settings import TaskServiceSettings


class BufferSettings(TaskServiceSettings):
    section: ClassVar[str] = "buffer"
    needs_task: ClassVar[bool] = True

    # what to generate: the run file's [task] table (services/tasks/spec.py)
    seed: int = Field(0, description="Seed of the per-epoch shuffle of the prompts.")
    samples_per_prompt: int = Field(8, ge=1, le=4096, description="Completions per prompt (n).")
    temperature: float = Field(
        0.7,
        ge=0.0,
        description="Sampling temperature (the trainer computes its logprobs at the same). "
        "0.7, not 1.0: at 1.0 a small model rambles (SmolLM2-135M on ticket routing: "
        "40-token replies at 3.1 nats a token, 5 RL steps in 13 minutes, nothing learned; "
        "the runs that learned on it sampled at 0.7: docs/learning.md). Large models are "
        "often sampled at 1.0: set it.",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling.")
    max_new_tokens: int = Field(16, ge=1, description="Completion length limit.")
    stop: tuple[str, ...] = Field((), description="Stop strings.")

    # how batches are made
    groups_per_step: int = Field(32, ge=1, description="Prompts (groups) per optimizer step.")
    max_staleness: int = Field(
        1, ge=0, description="k: a sample of version w trains at step s only if w >= s - k."
    )
    oversample: float | None = Field(
        None,
        ge=0.0,
        le=4.0,
        description="Extra fraction of tasks dispatched to cover the groups the filters drop. "
        "None (default): learned from the run's observed filter rate, dispatching only what "
        "the staleness bound's free slots are expected to take (services/buffer/admission.py); "
        "a number fixes it, and groups beyond the bound are then generated and dropped stale: "
        "the slowest, so the longest replies (measured: a fixed 0.5 at max_staleness 0 trained "
        "replies 15% shorter than it generated, KS p = 0.0115; learned: no stale drop, "
        "bench/results_staleness_lengths.md).",
    )
    max_oversample: float = Field(
        4.0, ge=0.0, description="Cap on the learned extra fraction (filter rate 0.8 at 4.0)."
    )
    oversample_margin: float = Field(
        2.0,
        ge=0.0,
        description="Standard deviations of filter luck the learned admission keeps back, so "
        "that a run of kept groups does not overflow the bound (0: dispatch the expectation).",
    )
    min_scored_per_group: int | None = Field(
        None,
        ge=1,
        description="A sample whose reward could not be computed (its verifier timed out, "
        "crashed or raised: `verifier_error`) is never trained on, nor counts in its group's "
        "baseline; its group trains on the rest if at least this many samples were scored, "
        "else it is dead-lettered (reason 'unscored'). None: half the group, at least 2 "
        "(GRPO's mean and std of fewer say little).",
    )
    filter_zero_variance: bool = Field(
        True, description="Drop groups whose rewards are all equal (no learning signal)."
    )
    max_response_tokens: int | None = Field(
        None, ge=1, description="Drop groups with a longer response (None: keep all)."
    )
    custom_filter: str | None = Field(
        None, description="'module:function' taking a SampleGroup, returning a reason or None."
    )
    # flat groups, the curriculum, collapse made visible (docs/learning.md)
    flat_rest_steps: int = Field(
        4,
        ge=0,
        description="A prompt whose group was flat (every reward alike: zero advantage) is not "
        "drawn again for this many steps (it waits for the cursor's next pass after that). "
        "0: never rests.",
    )
    refill_max_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="When a flat group is dropped, its batch slot is refilled with a recent "
        "group that had a reward spread and already trained (each such group at most once "
        "more), up to this share of each batch. 0.5 (default) keeps a trainer starved by "
        "flat groups stepping on at least half fresh groups; 0: every group trains once.",
    )
    refill_max_staleness: int = Field(
        2,
        ge=0,
        description="A refilled group's weight version w must satisfy w >= s - this at the "
        "step s it trains again (recent, not too stale), and w >= s - max_staleness as every "
        "sample must: max_staleness 0 (synchronous) refills nothing.",
    )
    curriculum: bool = Field(
        True,
        description="Draw prompts by their pass rate: easy and hard ones less often, solved "
        "ones never (the curriculum_* keys); the pass rates are kept and shown either way.",
    )
    curriculum_pass_reward: float = Field(
        1.0,
        description="A sample passes when its reward is at least this (1.0: right, for "
        "exact-match and math rewards); a prompt's pass rate is over its groups' samples.",
    )
    curriculum_ema: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Weight of a prompt's newest group in its pass rate (1: the last group alone).",
    )
    curriculum_easy_pass_rate: float = Field(
        0.8, ge=0.0, le=1.0, description="A prompt with a pass rate at least this is easy."
    )
    curriculum_hard_pass_rate: float = Field(
        0.0, ge=0.0, le=1.0, description="A prompt with a pass rate at most this is hard."
    )
    curriculum_easy_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The chance an easy prompt is drawn when the cursor reaches it (1: as any).",
    )
    curriculum_hard_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The chance a hard prompt is drawn when the cursor reaches it (1: as any).",
    )
    curriculum_retire_pass_rate: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="A prompt with a pass rate at least this over curriculum_retire_after "
        "groups is solved: never drawn again.",
    )
    curriculum_retire_after: int = Field(
        2, ge=0, description="Groups a prompt needs before it can retire (0: never retire)."
    )
    on_solved: Literal["stop", "continue"] = Field(
        "stop",
        description="When the curriculum has retired every training prompt (each solved: "
        "pass rate >= curriculum_retire_pass_rate over curriculum_retire_after groups), the "
        "console says so once and the run stops ('stop': the buffer ends it, as the "
        "trainer's max_steps would; every group would be flat from then on) or goes on "
        "drawing the solved prompts ('continue').",
    )
    stall_warn_steps: float = Field(
        3.0,
        ge=0.0,
        description="After this many steps' worth of groups in a row with nothing trainable, "
        "say so once in the console, with the cause and the keys that help (0: never).",
    )
    dispatch_interval_s: float = Field(
        0.2, gt=0, description="How often admission is re-evaluated without an event."
    )
    keep_settled_steps: int = Field(
        8, ge=1, description="Remember batched group ids this many steps back (dedupe)."
    )
    keep_settled_s: float = Field(
        180.0,
        ge=0,
        description="... and at least this many seconds: a message whose ack was lost comes "
        "back after its consumer's ack wait (tasks 60 s plus the generation, samples 30 s).",
    )

    halt_after: int = Field(
        16,
        ge=0,
        description="Stop the run when this many tasks in a row fail the same way (a "
        "dead-lettered task, or a group whose every sample's reward raised): a systematic "
        "error, not a bad row. 0: never.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_to_task(cls, data: Any) -> Any:
        """The pre-[task] keys: say where they went instead of 'extra inputs'."""
        moved = sorted(set(data) & LEGACY_KEYS) if isinstance(data, dict) else []
        if moved:
            raise ValueError(
                f"{', '.join(moved)}: [buffer] no longer says what to train on; the run "
                "file's [task] table does. E.g. for a JSONL file:\n"
                "    [task]\n"
                '    source = { type = "jsonl", path = "train.jsonl" }\n'
                '    reward = "math"\n'
                "  (docs/task.md; every key: flywheel buffer --print-config)"
            )
        return data


LEGACY_KEYS = {"source", "dataset", "dataset_name", "dataset_size", "env", "digits"}
