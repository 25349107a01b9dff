"""`flywheel demo --task tools`: the warm start and the plot of the tool-use demo.

The problem is 3-digit multiplication ("123*456="), which a 0.5M-parameter
model cannot do in its head; the task (configs/demo-tools.toml) gives it a
calculator (`<calc>123*456</calc>` -> `<result>56088</result>`). The SFT
traces call the calculator only in a fraction of cases and otherwise
answer straight away with the true product, which the model can only
guess: after SFT it calls the tool now and then and is mostly wrong. The
episodes in which it calls the tool are the ones rewarded, so GRPO raises
the tool-call rate and, with it, the held-out accuracy.

Everything else (the stack, the held-out evaluation, the summary) is the
addition demo's (services/stack/demo.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from services.tasks.arithmetic import problem

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "demo-tools.toml"


def tool_records(
    n: int, seed: int, tool_fraction: float, digits: int = 3, train_observation: bool = True
) -> list[dict[str, Any]]:
    """prompt/completion traces: a calculator call with probability `tool_fraction`.

    A trace that calls the tool is in segments, tokenised apart as an
    episode's turns and observation are. The observation is trained on
    (`train_observation`), although the policy never writes it: measured on
    the held-out problems after 900 SFT steps, the model copied the result
    into <answer> wrongly in 100 of 138 calls with the observation masked,
    13 of 105 with it trained (predicting the product's digits inside
    <result> is what the copy into <answer> leans on).
    """
    rng = random.Random(f"tools:{seed}")
    out: list[dict[str, Any]] = []
    for i in range(n):
        p = problem(seed, i, digits, "*")
        expr = p.prompt.rstrip("=")
        answer = f"<answer>{p.answer}</answer>"
        if rng.random() < tool_fraction:
            completion: Any = [
                {"text": f"<calc>{expr}</calc>"},
                {"text": f"<result>{p.answer}</result>", "train": train_observation},
                {"text": answer},
            ]
        else:
            completion = answer
        out.append({"prompt": p.prompt, "completion": completion})
    return out


def write_tool_traces(path: Path, n: int, seed: int, tool_fraction: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in tool_records(n, seed, tool_fraction):
            f.write(json.dumps(rec) + "\n")
    return path


def plot_tools(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """Held-out accuracy and the tool-call rate of training episodes against step."""
    acc = [r for r in rows if "eval_accuracy" in r]
    calls = [r for r in rows if "reward/episode.tool_calls" in r]
    if not acc and not calls:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r["step"] for r in calls],
        [r["reward/episode.tool_calls"] for r in calls],
        label="tool calls per training episode",
    )
    ax.plot(
        [r["step"] for r in calls],
        [r["reward_mean"] for r in calls],
        label="train reward (groups the filter kept)",
        alpha=0.6,
    )
    ax.plot(
        [r["step"] for r in acc],
        [r["eval_accuracy"] for r in acc],
        "o-",
        label="validation accuracy",
    )
    ax.set_xlabel("optimizer step")
    ax.set_ylim(0, 1.5)
    ax.grid(alpha=0.3)
    # under the axes, clear of the curves (services/stack/demo.py legend_below)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, frameon=False)
    fig.suptitle("Flywheel demo: async GRPO learns to call a calculator (3-digit ×)")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(out, dpi=110)
    return out
