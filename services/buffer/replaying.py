"""The buffer's answer to "which prompt was task <run>:e<epoch>:i<position>?", for replays.

A recorded sample names its task by the buffer's deterministic task id
(core.task_id), not by the row it came from: the prompt task that carried
the row index and the answer was a work-queue message, gone once done.
The buffer rebuilds the same task from the run file (the same seeded epoch
order, core.PromptTaskMaker), which is how `flywheel replay rescore` finds
each completion's row and answer. Handed to it by services/cli.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from proto.messages import PromptTask, SamplingParams
from services.buffer.core import PromptTaskMaker
from services.buffer.settings import BufferSettings
from services.runtime.settings import load_settings


def task_finder(config: Path) -> Callable[[int, int], PromptTask]:
    """(epoch, position) -> the PromptTask the buffer of `config`'s run made there."""
    s = load_settings(BufferSettings, config)
    sampling = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens, stop=s.stop
    )
    maker = PromptTaskMaker(
        s.run, s.task_set().load(), seed=s.seed, n=s.samples_per_prompt, sampling=sampling
    )
    return lambda epoch, position: maker.task(epoch, position, 0, 0.0)
