"""The trainer's side of the core lease (services/runtime/cores.py): threads it computes
with, moved while it computes.

The loop marks the trainer busy when a batch arrives and idle when its step's
compute is done, so while it waits for a batch the engines take its cores.
The count it computes with is applied on the compute thread itself, by a
forward pre-hook on every decoder layer: ATen's parallel ops read OpenMP's
per-thread count, which a thread takes from torch's global one only at its
first use, so set from the loop's thread or the watcher it would not reach
the step's elementwise ops (MKL's matmuls read a process-wide count; setting
it on the compute thread covers both). A change costs under a microsecond
(bench/results_placement.md), so a layer boundary is a fine place: an engine
that goes idle mid-step (the buffer stopped admitting) lends its cores to the
rest of that step, not only to the next one. Backward runs on the same thread
on a CPU, with the count the last forward layer set.

Only a one-process trainer on a CPU lends (FSDP2 ranks and GPUs have their
own devices).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from services.runtime.cores import CoreLease, CoreLeaseSettings

log = logging.getLogger(__name__)


def layers(model: Any) -> list[Any]:
    """Where the count is checked: each decoder layer (the model itself if it has none)."""
    found = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    return found or [model]


class ThreadLending:
    """Marks the trainer's phases on the lease; applies the lease's count on compute."""

    def __init__(self, settings: CoreLeaseSettings, model: Any) -> None:
        self.lease = CoreLease(settings, "trainer")
        self.poll_s = settings.poll_s
        self.target = settings.share  # read by the hook on the compute thread
        self.changes = 0  # how often the hook changed the count (a test reads it)
        self._busy = False
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="core-lease", daemon=True)
        self._handles = [m.register_forward_pre_hook(self._apply) for m in layers(model)]
        self._watcher.start()

    @classmethod
    def of(cls, settings: CoreLeaseSettings, trainer: Any) -> ThreadLending | None:
        """Lending for this trainer, or None (off, several ranks, or not on a CPU)."""
        info = trainer.info
        if not settings.enabled or info.distributed or info.device.type != "cpu":
            return None
        return cls(settings, trainer.model)

    def working(self) -> None:
        """A batch arrived: the trainer has work (the count is read once more now)."""
        self._busy = True
        self.lease.mark(True)
        self.target = self.lease.threads(mine=self.target)

    def waiting(self) -> None:
        """The step's compute is done: until the next batch the cores are the engines'."""
        self._busy = False
        self.lease.mark(False)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._busy:
                try:
                    self.target = self.lease.threads(mine=self.target)
                except OSError as e:  # the run directory went away: keep the last count
                    log.warning("trainer: core lease unreadable: %s", e)

    def _apply(self, module: Any, args: Any) -> None:
        import torch

        n = self.target
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
            self.changes += 1

    def close(self) -> None:
        self._stop.set()
        for h in self._handles:
            h.remove()
        self._watcher.join(timeout=5)
        self.lease.close()
