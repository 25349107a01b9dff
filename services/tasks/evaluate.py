"""The held-out evaluation: greedy pass@1 and sampled pass@k, through the task's own reward.

One function, `evaluate`, used by the trainer (`eval_every`, on the
validation split: it chooses the best checkpoint), `flywheel eval -c
run.toml` and the demo (on the test split: what is reported, never what a
checkpoint was chosen on; `report_split`) and bench/trl_grpo.py. Prompts are formatted
and tokenized exactly as the rollout worker does (`prompts.format_row` +
`prompts.encode`), and completions are scored by the task's reward in the
verifier sandbox (`Scorer`). A completion is correct when the reward part
named by `eval.part` (default: the first) reaches `eval.threshold`.

Generation is a `Complete` function: a model in this process (`hf_complete`:
batched Hugging Face `generate` with left padding, so each row's last prompt
token sits at the same position; `flywheel eval`, the demo, the trainer's
`eval_on = "trainer"`) or an engine serving the run (engine_eval.py: the
SGLang API, each answer checked to come from the version evaluated; sync's
evaluations). Greedy decoding makes pass@1 deterministic for a given model.
pass@k samples k completions per prompt (temperature `eval.temperature`,
no top-k/top-p truncation; in this process through a generator of its own,
never torch's default one: the trainer's evaluations run on a thread beside
its steps) and counts a prompt solved when any of them is correct (the
unbiased estimator with n = k). Stop strings are not applied: generation
ends at EOS or `eval.max_new_tokens`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError
from services.runtime.threads import Offload
from services.tasks.episode_eval import run_episodes
from services.tasks.episode_spec import EpisodeSpec
from services.tasks.prompts import encode, format_row, readable
from services.tasks.scoring import Scorer, correct, tool_pool, verifier_pool
from services.tasks.taskset import LoadedTask, Split, TaskSet


@dataclass(frozen=True)
class TaskEval:
    total: int
    pass_at_1: float
    mean_reward: float
    k: int = 1
    pass_at_k: float | None = None
    # (prompt as text: chat turns as `role: content` lines, completion, answer)
    examples: tuple[tuple[str, str, str | None], ...] = ()


@dataclass(frozen=True)
class EvalReport:
    tasks: dict[str, TaskEval] = field(default_factory=dict)
    split: Split = "validation"  # which held-out split the figures are of

    def _mean(self, attr: str) -> float | None:
        rows = [(t.total, getattr(t, attr)) for t in self.tasks.values()]
        rows = [(n, v) for n, v in rows if v is not None]
        total = sum(n for n, _ in rows)
        return sum(n * v for n, v in rows) / total if total else None

    @property
    def pass_at_1(self) -> float:
        return self._mean("pass_at_1") or 0.0

    @property
    def pass_at_k(self) -> float | None:
        return self._mean("pass_at_k")

    @property
    def k(self) -> int:
        return max((t.k for t in self.tasks.values()), default=1)

    @property
    def total(self) -> int:
        return sum(t.total for t in self.tasks.values())

    def metrics(self) -> dict[str, float]:
        """The metrics.jsonl fields: eval_accuracy (pass@1), eval_pass_at_k, per task."""
        return self.pass_at_1_metrics() | self.pass_at_k_metrics()

    def pass_at_1_metrics(self) -> dict[str, float]:
        """eval_accuracy (greedy pass@1), eval_mean_reward and each task's pass@1."""
        out: dict[str, float] = {
            "eval_accuracy": self.pass_at_1,
            "eval_mean_reward": self._mean("mean_reward") or 0.0,
        }
        if len(self.tasks) > 1:
            out |= {f"eval/{name}/pass@1": t.pass_at_1 for name, t in self.tasks.items()}
        return out

    def pass_at_k_metrics(self) -> dict[str, float]:
        """eval_pass_at_k and each task's pass@k ({} before the samples are drawn)."""
        out: dict[str, float] = {}
        if self.pass_at_k is not None:
            out["eval_pass_at_k"] = self.pass_at_k
        if len(self.tasks) > 1:
            out |= {f"eval/{name}/pass@{t.k}": t.pass_at_k
                    for name, t in self.tasks.items() if t.pass_at_k is not None}  # fmt: skip
        return out


def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    k: int = 1,
    temperature: float = 1.0,
    batch_size: int = 64,
    seed: int = 0,
    halt: threading.Event | None = None,
) -> list[list[tuple[str, int]]]:
    """k completions per prompt as (text, generated tokens up to and with EOS); k = 1: greedy.

    `halt`, once set, ends the generation at the next token and raises `Halted` (a thread
    cannot be cancelled, and a process waits for its pool's threads before it exits).

    k > 1 samples through a generator of its own, seeded with `seed`, and leaves torch's
    default generator alone (`SampleWith`): this runs on a thread beside the trainer's
    steps, whose randomness must not move with it (services/trainer/randomness.py).
    """
    import torch
    from transformers import LogitsProcessorList

    device = next(model.parameters()).device
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    pad = eos if pad is None else pad
    was_training = model.training
    model.eval()
    sampler, stopping = None, None
    if halt is not None:
        from transformers import StoppingCriteriaList

        stopping = StoppingCriteriaList([HaltOn(halt)])
    if k > 1:
        generator = torch.Generator(device=device).manual_seed(seed)
        sampler = LogitsProcessorList([SampleWith(temperature, generator)])
    out: list[list[tuple[str, int]]] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device
            )
            # k rows per prompt, next to each other: row j * k + s is prompt j's s-th sample
            ids, mask = ids.repeat_interleave(k, dim=0), mask.repeat_interleave(k, dim=0)
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad,
                    eos_token_id=eos,
                    do_sample=False,  # k > 1: the sampler leaves one token for greedy to pick
                    logits_processor=sampler,
                    stopping_criteria=stopping,
                )
            if halt is not None and halt.is_set():
                raise Halted("generation halted: the evaluation was called off")
            new = gen[:, width:].tolist()  # [B·k, new]
            for j in range(len(chunk)):
                out.append([_cut(tokenizer, new[j * k + s], eos) for s in range(k)])
    finally:
        model.train(was_training)
    return out


class Halted(RuntimeError):
    """A generation ended early by its `halt` event; its completions are not returned."""


class HaltOn:
    """A stopping criterion that ends every row once `event` is set."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


class SampleWith:
    """A logits processor that samples the next token from softmax(scores / temperature)
    through `generator` and leaves it the only finite score, so that greedy decoding picks
    it: sampling (no top-k / top-p truncation) without Hugging Face's own sampler, which
    draws from torch's default generator and takes none of its own.

    Placed last, after the processors `generate` adds from the model's generation config,
    as Hugging Face applies temperature after them.
    """

    def __init__(self, temperature: float, generator: Any) -> None:
        self.temperature, self.generator = temperature, generator

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        probs = torch.softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        pick = torch.multinomial(probs, 1, generator=self.generator)  # [B, 1]
        return torch.full_like(scores, float("-inf")).scatter_(1, pick, 0.0)


Completions = list[list[tuple[str, int]]]
Complete = Callable[..., Awaitable[Completions]]
"""`complete(prompt_ids, *, max_new_tokens, k=1, temperature=1.0, seed=0)`: k completions per
prompt as (text, generated tokens up to and with EOS); k = 1 is greedy."""


def hf_complete(
    model: Any,
    tokenizer: Any,
    offload: Offload = asyncio.to_thread,
    halt: threading.Event | None = None,
) -> Complete:
    """`generate` on a model of this process, run by `offload` (off the event loop);
    `halt` ends a generation early (`generate`)."""

    async def complete(
        ids: list[list[int]],
        *,
        max_new_tokens: int,
        k: int = 1,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> Completions:
        return await offload(
            generate, model, tokenizer, ids, max_new_tokens=max_new_tokens, k=k,
            temperature=temperature, seed=seed, halt=halt,
        )  # fmt: skip

    return complete


def _cut(tokenizer: Any, ids: list[int], eos: int | None) -> tuple[str, int]:
    n = ids.index(eos) + 1 if eos is not None and eos in ids else len(ids)
    return tokenizer.decode(ids[:n], skip_special_tokens=True), n


async def episode_completions(
    model: Any,
    tokenizer: Any,
    spec: EpisodeSpec,
    ids: list[list[int]],
    e: Any,
    scorer: Scorer,
    offload: Offload = asyncio.to_thread,
) -> list[list[tuple[str, int]]]:
    """Greedy episodes (services/tasks/episode_eval.py) as (transcript, tokens)."""
    if scorer.tools is None:
        raise ConfigError("a task with [task.episode] is evaluated without a tool sandbox")
    episodes = await run_episodes(
        model, tokenizer, spec, ids, e.max_new_tokens, scorer.tools, offload
    )
    return [[(ep.text, len(ep.response_ids))] for ep in episodes]


async def _score(
    scorer: Scorer, name: str, rows: Any, completions: list[list[tuple[str, int]]], split: Split
) -> list[list[Any]]:
    """Every completion of every held-out row, scored concurrently; per row, in order."""
    return await asyncio.gather(
        *(
            asyncio.gather(
                *(scorer.score(name, idx, text, row.answer, n, split=split) for text, n in comps)
            )
            for (idx, row), comps in zip(rows, completions, strict=True)
        )
    )


@dataclass(frozen=True)
class _Rows:
    """One task's held-out rows of a split, formatted and tokenized as the worker does."""

    rows: list[Any]
    formatted: list[Any]
    ids: list[list[int]]


def _rows(tokenizer: Any, task: LoadedTask, size: int | None, split: Split) -> _Rows:
    spec = task.spec
    rows = task.held_out(split)[: size or spec.eval.size]
    formatted = [format_row(spec, r) for _, r in rows]
    ids = [encode(tokenizer, p, m, spec.chat_template) for p, m in formatted]
    return _Rows(rows, formatted, ids)


def samples_k(task: LoadedTask) -> bool:
    """Whether the task's evaluation draws pass@k samples (eval.k > 1; episodes: never)."""
    return task.spec.eval.k > 1 and task.spec.episode is None


async def evaluate_task(
    model: Any,
    tokenizer: Any,
    task: LoadedTask,
    scorer: Scorer,
    *,
    size: int | None = None,
    seed: int = 0,
    split: Split = "validation",
    greedy_only: bool = False,
    offload: Offload = asyncio.to_thread,
    complete: Complete | None = None,
) -> TaskEval:
    """Greedy pass@1 (and pass@k when eval.k > 1, unless `greedy_only`) of one task's rows
    of `split`; `offload` runs the generation off the event loop (the trainer's: a thread
    at low CPU priority, services/runtime/threads.py). `complete`: where the completions
    come from (default: `model` here, `hf_complete`; an engine: engine_eval.py)."""
    complete = complete or hf_complete(model, tokenizer, offload)
    held = _rows(tokenizer, task, size, split)
    spec, e = task.spec, task.spec.eval
    if spec.episode is not None:
        if model is None:
            raise ConfigError(
                f"[task] {task.name}: a task with [task.episode] is evaluated by a model of "
                "the evaluating process ([trainer] eval_on = 'trainer'), not on the engines"
            )
        greedy = await episode_completions(
            model, tokenizer, spec.episode, held.ids, e, scorer, offload
        )
    else:
        greedy = await complete(held.ids, max_new_tokens=e.max_new_tokens, seed=seed)
    scored = [rs[0] for rs in await _score(scorer, task.name, held.rows, greedy, split)]
    n = max(len(held.rows), 1)
    result = TaskEval(
        total=len(held.rows),
        pass_at_1=sum(correct(spec, r) for r in scored) / n,
        mean_reward=sum(r.reward for r in scored) / n,
        examples=tuple(
            (readable(p, m), g[0][0], r.answer)
            for (p, m), g, (_, r) in list(zip(held.formatted, greedy, held.rows, strict=True))[:5]
        ),
    )
    if greedy_only or not samples_k(task):
        return result
    return await _pass_at_k(task, scorer, result, held, seed, split, complete)


async def _pass_at_k(
    task: LoadedTask,
    scorer: Scorer,
    greedy: TaskEval,
    held: _Rows,
    seed: int,
    split: Split,
    complete: Complete,
) -> TaskEval:
    """`greedy` with the task's pass@k added: eval.k samples per row, solved when any is."""
    e = task.spec.eval
    sampled = await complete(
        held.ids, k=e.k, temperature=e.temperature, seed=seed, max_new_tokens=e.max_new_tokens
    )
    scored_k = await _score(scorer, task.name, held.rows, sampled, split)
    solved = [any(correct(task.spec, r) for r in rs) for rs in scored_k]
    return replace(greedy, k=e.k, pass_at_k=sum(solved) / max(len(held.rows), 1))


async def evaluate(
    model: Any,
    tokenizer: Any,
    loaded: dict[str, LoadedTask],
    scorer: Scorer,
    *,
    size: int | None = None,
    seed: int = 0,
    split: Split = "validation",
    greedy_only: bool = False,
    offload: Offload = asyncio.to_thread,
    complete: Complete | None = None,
) -> EvalReport:
    """Every task with rows of `split`, evaluated (tasks without them are left out)."""
    return EvalReport(
        {
            name: await evaluate_task(
                model,
                tokenizer,
                t,
                scorer,
                size=size,
                seed=seed,
                split=split,
                greedy_only=greedy_only,
                offload=offload,
                complete=complete,
            )
            for name, t in loaded.items()
            if t.held_out(split)
        },
        split,
    )


async def add_pass_at_k(
    tokenizer: Any,
    loaded: dict[str, LoadedTask],
    scorer: Scorer,
    report: EvalReport,
    complete: Complete,
    *,
    size: int | None = None,
    seed: int = 0,
) -> EvalReport:
    """A greedy-only `report` (`evaluate(..., greedy_only=True)`) with the pass@k of every
    task that samples (`samples_k`) added: the same figures `evaluate` gives in one call,
    for a caller that publishes pass@1 before drawing the samples (the trainer)."""
    tasks = dict(report.tasks)
    for name, greedy in report.tasks.items():
        task = loaded[name]
        if samples_k(task):
            held = _rows(tokenizer, task, size, report.split)
            tasks[name] = await _pass_at_k(task, scorer, greedy, held, seed, report.split, complete)
    return EvalReport(tasks, report.split)


def report_split(loaded: dict[str, LoadedTask]) -> Split:
    """The split a figure is reported on: test where every task has one, else validation
    (the split checkpoints were chosen on: the caller says so)."""
    return "test" if loaded and all(t.test for t in loaded.values()) else "validation"


def load_model(model_dir: str | Path) -> tuple[Any, Any]:
    """A model directory, or a LoRA adapter directory (its base with the adapter merged in,
    the base's tokenizer), and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.weights.adapter import is_adapter_dir

    if is_adapter_dir(model_dir):
        from services.models.adapters import base_of, load_merged

        model, model_dir = load_merged(model_dir), base_of(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    return model, AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


class Evaluator:
    """`evaluate` from synchronous code (the CLI, the demo, a TRL callback): an event
    loop and a verifier pool of its own, kept across evaluations.

        with Evaluator(tasks) as ev:
            report = ev(model, tokenizer)
    """

    def __init__(
        self,
        tasks: TaskSet,
        loaded: dict[str, LoadedTask] | None = None,
        *,
        size: int | None = None,
        timeout_s: float = 5.0,
        split: Split | None = None,
        greedy_only: bool = False,
    ) -> None:
        self.tasks, self.size, self.greedy_only = tasks, size, greedy_only
        self.loaded = loaded if loaded is not None else tasks.load(eval_size=size)
        self.split: Split = split or report_split(self.loaded)
        self.pool = verifier_pool(tasks, timeout_s=timeout_s)
        self.tools = tool_pool(tasks)
        self.loop = asyncio.new_event_loop()

    def __enter__(self) -> Evaluator:
        self.loop.run_until_complete(self.pool.start())
        if self.tools is not None:
            self.loop.run_until_complete(self.tools.start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.pool.close())
        if self.tools is not None:
            self.loop.run_until_complete(self.tools.close())
        self.loop.close()

    def __call__(self, model: Any, tokenizer: Any) -> EvalReport:
        scorer = Scorer(self.tasks, self.pool, self.tools)
        return self.loop.run_until_complete(
            evaluate(
                model,
                tokenizer,
                self.loaded,
                scorer,
                size=self.size,
                split=self.split,
                greedy_only=self.greedy_only,
            )
        )


def evaluate_dir(
    model_dir: str | Path,
    tasks: TaskSet,
    *,
    size: int | None = None,
    timeout_s: float = 5.0,
    split: Split | None = None,
    greedy_only: bool = False,
) -> EvalReport:
    """`evaluate` a model directory once (`flywheel eval`, the demo), on `split`
    (default: `report_split`: test where there is one); `greedy_only`: pass@1 without
    the pass@k samples (the demo reports pass@1 alone)."""
    model, tokenizer = load_model(model_dir)
    with Evaluator(tasks, size=size, timeout_s=timeout_s, split=split,
                   greedy_only=greedy_only) as ev:  # fmt: skip
        return ev(model, tokenizer)
