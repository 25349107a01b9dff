"""Where the tool demo's held-out episodes go wrong, per model directory.

    .venv/bin/python bench/tool_errors.py runs/demo-tools/model-sft runs/demo-tools/checkpoints/best

For each model, two readings on the tool demo's held-out problems
(configs/demo-tools.toml `[task.eval]`):

- episodes: the greedy held-out episodes (the trainer's evaluation loop,
  tools in their sandbox), each put in one class: right; no calculator call;
  a call whose expression is not the problem's; a result copied wrongly
  into <answer>; anything else;
- copies: the result given (`123*456=<calc>123*456</calc><result>56088</result><answer>`),
  is the greedy continuation the result? Counted per result width (5 or 6
  digits), since the copy of 5-digit results is what held the demo back.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo-tools.toml"


def classify(expr: str, answer: str, text: str) -> str:
    answers = re.findall(r"<answer>(.*?)</answer>", text)
    calls = re.findall(r"<calc>(.*?)</calc>", text)
    results = re.findall(r"<result>(.*?)</result>", text)
    if answers and answers[-1] == answer:
        return "right"
    if not calls:
        return "no call"
    if calls[0] != expr:
        return "wrong expression"
    if results and answers and answers[-1] != results[-1]:
        return "result copied wrongly"
    return "other"


def episodes(model_dir: Path, size: int) -> Counter[str]:
    from services.runtime.settings import load_settings
    from services.stack.settings import StackSettings
    from services.tasks.episode_eval import run_episodes
    from services.tasks.evaluate import Evaluator, load_model
    from services.tasks.prompts import encode, format_row

    tasks = load_settings(StackSettings, CONFIG).task_set()
    model, tok = load_model(model_dir)
    with Evaluator(tasks, size=size) as ev:
        ((_, task),) = ev.loaded.items()
        spec, rows = task.spec, task.held_out(ev.split)[:size]
        assert spec.episode is not None and ev.tools is not None
        prompts = [format_row(spec, r)[0] or "" for _, r in rows]
        ids = [encode(tok, p, None, spec.chat_template) for p in prompts]
        eps = ev.loop.run_until_complete(
            run_episodes(model, tok, spec.episode, ids, spec.eval.max_new_tokens, ev.tools)
        )
    return Counter(
        classify(p.rstrip("="), str(r.answer), ep.text)
        for p, (_, r), ep in zip(prompts, rows, eps, strict=True)
    )


def copies(model_dir: Path, size: int) -> dict[int, tuple[int, int]]:
    import torch

    from services.tasks.arithmetic import problem
    from services.tasks.evaluate import load_model

    model, tok = load_model(model_dir)
    model.eval()
    seen: dict[int, list[int]] = {}
    for i in range(size):
        p = problem(1000003, i, 3, "*", "test")  # problems of the test split
        text = f"{p.prompt}<calc>{p.prompt.rstrip('=')}</calc><result>{p.answer}</result><answer>"
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=len(str(p.answer)),
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
        got = tok.decode(out[0, ids.shape[1] :])
        right, n = seen.setdefault(len(str(p.answer)), [0, 0])
        seen[len(str(p.answer))] = [right + (got == str(p.answer)), n + 1]
    return {w: (r, n) for w, (r, n) in sorted(seen.items())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help="model directories")
    ap.add_argument("--size", type=int, default=200, help="held-out episodes")
    ap.add_argument("--copies", type=int, default=400, help="held-out problems for the copy check")
    args = ap.parse_args(argv)
    for m in args.models:
        eps: dict[str, Any] = dict(episodes(m, args.size))
        cps = copies(m, args.copies)
        widths = ", ".join(f"{w}-digit {r}/{n}" for w, (r, n) in cps.items())
        print(f"{m}: episodes {eps}; copies given the result: {widths}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
