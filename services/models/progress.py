"""Third-party progress bars off in Flywheel's processes.

transformers draws a bar on every `from_pretrained` ("Loading weights"),
every `save_pretrained` ("Writing model shards") and every GGUF read
("Converting and de-quantizing GGUF tensors"). In `flywheel up` and the
demos every process's output shares one console (and each redraw is a line
in its log file), so a stack of engines loading weight versions buries the
status line. `flywheel` turns them off for itself and, through the
environment, for every process it starts; Flywheel's own bars (`flywheel
sft`'s) are not theirs and stay.
"""

from __future__ import annotations

import os
import sys

# Read by huggingface_hub when it is imported, and through it by transformers' own tqdm.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_progress_bars(*, every_tqdm: bool = False) -> None:
    """Hugging Face progress bars off here and in child processes (unless the user set the
    variable). `every_tqdm`: also bars drawn with plain tqdm (the GGUF reader's), by
    TQDM_DISABLE, for a process with no bar of its own (`flywheel import-model`)."""
    env = {**QUIET_ENV, **({"TQDM_DISABLE": "1"} if every_tqdm else {})}
    for key, value in env.items():
        os.environ.setdefault(key, value)
    # Already imported (a library user, a test): their switches, which the variable no
    # longer reaches.
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
