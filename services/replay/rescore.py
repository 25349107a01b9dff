"""`flywheel replay rescore`: a recorded run's completions scored with another reward.

Each recorded sample's completion (decoded from its token ids, samples.py)
is scored by the reward of the run file's task, or of `--reward` (a TOML
value for `[task] reward`: `'"math"'`, `'{fn = "pkg.mod:f"}'`), in the same
sandboxed verifier pool a rollout worker uses (services/tasks/scoring.py),
with the row and answer of the prompt it answered (the buffer's
`task_finder`, handed in by services/cli.py: the recorded task id names the
buffer's epoch and position). Nothing is re-generated and nothing is
written to the run: the old and new reward of every sample go to a JSONL
report, and a summary to the console.

Judge parts (`type = "judge"`) are asked of a judge, as the run's rollout
workers asked theirs (services/tasks/judge_pool.py, the same request with the
same prompt text): the engines of `--judge-url`, else the run file's `[judge]
urls`. A run whose judge engines `flywheel up` started has none left once it
stopped; with no judge to ask, rescoring refuses (`judge_urls`, exit 2) rather
than score every judge part 0, which would pass for a verdict.

An episode's sample (tool or environment tokens in its completion) is not
rescored (`skipped`): its reward was computed on the episode, which the
recorded tokens alone do not give back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proto.messages import PromptTask
from services.replay import records
from services.replay.samples import parse_task_id, rows_of, tokenizer_decode
from services.replay.source import RecordedRun, connected
from services.runtime.errors import ConfigError
from services.tasks.prompts import readable

TaskAt = Callable[[int, int], PromptTask]


def reward_value(text: str) -> Any:
    """`--reward`'s text as the TOML value of `reward = …` (a bare word: a reward's name)."""
    try:
        return tomllib.loads(f"reward = {text}")["reward"]
    except tomllib.TOMLDecodeError:
        return text


def reward_overrides(rec: RecordedRun, reward: str | None) -> dict[str, Any]:
    """ReplaySettings overrides that give every task of the run file `reward`."""
    if reward is None:
        return {}
    value = reward_value(reward)
    doc = rec.doc
    if isinstance(doc.get("task"), dict):
        return {"task": {**doc["task"], "reward": value}}
    tasks = doc.get("tasks")
    if isinstance(tasks, dict):
        return {"tasks": {n: {**t, "reward": value} for n, t in tasks.items()}}
    raise ConfigError("--reward: the run file has no [task] or [tasks.<name>] table")


def judge_urls(rec: RecordedRun, given: Sequence[str]) -> tuple[str, ...]:
    """The judge engines a rescore asks: `given` (--judge-url), else the run file's `[judge]
    urls`; () when no task has a judge part. ConfigError naming the parts when one has and
    no engine is given, or when engines are given and no part needs one."""
    tasks = rec.settings.task_set()
    judged = [
        f"{tasks.keys[name]} reward {p.part_name!r}"
        for name, spec in tasks.specs.items()
        for p in spec.reward
        if p.external
    ]
    if not judged:
        if given:
            raise ConfigError("--judge-url: no reward part of the run file is a judge's")
        return ()
    urls = tuple(given) or rec.settings.judge.urls
    if not urls:
        raise ConfigError(
            f"{', '.join(judged)}: scored by an LLM judge, and no judge "
            "engine is given: pass --judge-url URL (an engine serving /v1/chat/completions), "
            "or set [judge] urls in the run file (a judge `flywheel up` started stopped with "
            "the run)"
        )
    return urls


@dataclass
class Summary:
    samples: int = 0
    scored: int = 0
    skipped: int = 0
    errors: int = 0  # the new reward could not be computed
    changed: int = 0
    old_sum: float = 0.0
    new_sum: float = 0.0

    def add(self, old: float | None, new: float | None) -> None:
        self.samples += 1
        if new is None:
            return
        self.scored += 1
        self.new_sum += new
        self.old_sum += old or 0.0
        self.changed += int(old is None or abs(new - old) > 1e-9)

    def as_dict(self) -> dict[str, Any]:
        n = max(self.scored, 1)
        return {
            "samples": self.samples,
            "rescored": self.scored,
            "skipped": self.skipped,
            "errors": self.errors,
            "changed": self.changed,
            "mean_old": self.old_sum / n,
            "mean_new": self.new_sum / n,
        }


async def rescore(
    rec: RecordedRun, url: str, task_at: TaskAt, out: Path, judges: Sequence[str] = ()
) -> dict[str, Any]:
    """Score every recorded sample again, judge parts by the engines at `judges` (from
    `judge_urls`); per-sample lines in `out`, the summary returned."""
    from services.tasks.judge_pool import judge_over
    from services.tasks.scoring import Scorer, verifier_pool

    async with connected(rec, url) as js:
        groups = await records.sample_groups(js, rec.run)
    decode = await asyncio.to_thread(tokenizer_decode, rec.model_dir())
    tasks = rec.settings.task_set()
    s = Summary()
    out.parent.mkdir(parents=True, exist_ok=True)
    pool = verifier_pool(
        tasks, size=rec.settings.verifier_workers, timeout_s=rec.settings.verifier_timeout_s
    )
    judging = judge_over(rec.settings.judge, judges) if judges else contextlib.nullcontext(None)
    async with pool, judging as judge:
        scorer = Scorer(tasks, pool, judge=judge)
        with out.open("w") as f:
            for seq, g in groups.messages:
                for line in await _group(scorer, task_at, rows_of(seq, g, decode, None), s):
                    f.write(json.dumps(line) + "\n")
    report = {**s.as_dict(), "undecodable_seqs": groups.undecodable, "report": str(out)}
    return {**report, "judge": list(judges)}


async def _group(
    scorer: Any, task_at: TaskAt, rows: list[dict[str, Any]], s: Summary
) -> list[dict[str, Any]]:
    """One recorded group's rows, scored again: one report line each."""
    where = parse_task_id(rows[0]["task_id"])
    if where is None:
        raise ConfigError(
            f"task id {rows[0]['task_id']!r} is not the buffer's: cannot find its row"
        )
    task = task_at(*where)
    if task.task_name != rows[0]["task_name"]:
        raise ConfigError(
            f"task {rows[0]['task_id']} was {rows[0]['task_name']!r} in the run, "
            f"{task.task_name!r} by this run file: not the run file the run ran with"
        )
    todo = [r for r in rows if r["env_tokens"] == 0]
    got = await scorer.score_group(
        task.task_name,
        task.index,
        task.answer,
        [(r["completion"], len(r["response_ids"])) for r in todo],
        prompt=readable(task.prompt, task.messages),  # the judge's {prompt}, as the worker's
    )
    new = {r["sample_id"]: x for r, x in zip(todo, got, strict=True)}
    lines = []
    for r in rows:
        old = None if r["verifier_error"] else r["reward"]
        x = new.get(r["sample_id"])
        if x is None:
            s.skipped += 1
        elif x.error is not None:
            s.errors += 1
        reward = None if x is None or x.error is not None else x.reward
        s.add(old, reward)
        lines.append({
            "sample_id": r["sample_id"], "group_id": r["group_id"], "task_name": r["task_name"],
            "row": task.index, "old_reward": old, "new_reward": reward,
            "old_parts": json.loads(r["reward_parts"]), "new_parts": None if x is None else x.parts,
            "new_error": None if x is None else x.error, "skipped": x is None,
        })  # fmt: skip
    return lines
