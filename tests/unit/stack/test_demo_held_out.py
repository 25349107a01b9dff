"""No demo evaluates on a prompt it trains on: the SFT file each demo writes and the
prompts its buffer sends, against its validation and test prompts (as strings).

2-digit addition has only 8,100 problems: before the problem space was split,
44% of the trainer's evaluation prompts were among the demo's first 4,160 RL
prompts and all of them in its SFT file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proto.messages import SamplingParams
from services.buffer.core import PromptTaskMaker
from services.buffer.settings import BufferSettings
from services.runtime.settings import load_settings
from services.stack.demo import DEFAULT_CONFIG, parse_args, sft_data
from services.stack.demo_tools import CONFIG as TOOLS_CONFIG


@pytest.mark.parametrize("task", ["arithmetic", "tools"])
def test_no_demo_held_out_prompt_is_in_its_sft_or_rl_data(task: str, tmp_path: Path) -> None:
    args = parse_args(["--task", task])  # the demo's own defaults
    config = TOOLS_CONFIG if task == "tools" else DEFAULT_CONFIG
    sft = sft_data(args, tmp_path)  # the 50,000-row file `make demo` trains on
    sft_prompts = {json.loads(line)["prompt"] for line in sft.read_text().splitlines()}

    settings = load_settings(BufferSettings, config)
    (loaded,) = settings.task_set().load(eval_size=args.eval_size).values()
    maker = PromptTaskMaker(settings.run, {loaded.name: loaded}, seed=settings.seed, n=1,
                            sampling=SamplingParams(max_new_tokens=4))  # fmt: skip
    # The buffer's first epoch (100,000 tasks): far more than a demo dispatches.
    rl_prompts = {maker.task(0, off, 0, 0.0).prompt for off in range(len(maker))}

    validation = [r.prompt for _, r in loaded.validation]
    test = [r.prompt for _, r in loaded.test]
    # The sizes the demo uses: the trainer's validation, the reported test.
    assert (
        len(set(validation)) == len(validation) >= settings.task_set().specs[loaded.name].eval.size
    )
    assert len(set(test)) == len(test) == args.eval_size
    assert not set(validation) & set(test)
    held = set(validation) | set(test)
    assert not held & sft_prompts, sorted(held & sft_prompts)[:5]
    assert not held & rl_prompts, sorted(held & rl_prompts)[:5]
    assert len(sft_prompts) > 1000 and len(rl_prompts) > 1000
