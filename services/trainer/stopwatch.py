"""Where a step's time goes: seconds summed per named stage, as metrics-row keys.

    watch = Stopwatch()
    with watch("logprobs"):
        ...
    row.update(watch.take())   # {"time_logprobs_s": 0.012, ...}, and the watch restarts

Cheap enough for every step (two perf_counter calls a stage); the keys go
into the trainer's metrics rows, from which `bench/e2e.py --profile`
builds the per-stage breakdown of a step.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class Stopwatch:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t

    def take(self) -> dict[str, float]:
        """The stages' totals as `time_<stage>_s`, and a fresh start."""
        out = {f"time_{k}_s": v for k, v in self.seconds.items()}
        self.seconds = {}
        return out
