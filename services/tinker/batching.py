"""Sample requests that can share one generation, gathered while the model thread is busy.

tinker-cookbook's RL loop samples a group of G replies to one prompt as G requests of
`num_samples=1` (one per env, all at once), not one request of G. Run one by one on
the model thread, each pays a batch-1 prefill and decode: on a CPU that is most of an
RL step. So requests that agree on everything but their count (the same sampler
snapshot, prompt and sampling parameters) and give no seed of their own join one open
batch until the model thread takes it, then generate as one batch of their summed
count, each request answered with its own slice.

A request with a `seed` runs alone: its samples must be what that seed draws, whatever
else is queued. A batch is capped at `max_num_samples` (a request over the cap was
already refused by the checks), so one batch never exceeds what one request may ask.
Pure and thread-safe: the event loop adds, the model thread takes.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.tinker.core import SampleSpec

T = TypeVar("T")  # what the caller keeps per request (its log entry)


@dataclass
class Batch(Generic[T]):
    """Requests that generate together: `spec` with `num_samples` their sum."""

    spec: SampleSpec
    members: list[tuple[T, int]] = field(default_factory=list)  # (request, its num_samples)
    taken: bool = False

    def slices(self) -> list[tuple[T, slice]]:
        """Each request and the rows of the batch's samples that are its own."""
        out, start = [], 0
        for item, n in self.members:
            out.append((item, slice(start, start + n)))
            start += n
        return out


class SampleBatches(Generic[T]):
    """The open batches, by (snapshot, spec without its count)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[Hashable, Batch[T]] = {}
        self._lock = threading.Lock()

    def add(self, snapshot: str | None, spec: SampleSpec, item: T) -> Batch[T] | None:
        """Join an open batch (None: the request is in it) or open a new one, returned
        for the caller to queue on the model thread, which then `take`s it."""
        if spec.seed is not None:
            batch: Batch[T] = Batch(spec, [(item, spec.num_samples)])
            batch.taken = True  # never open: nothing joins a seeded request
            return batch
        key = (snapshot, dataclasses.replace(spec, num_samples=0))
        with self._lock:
            open_ = self._open.get(key)
            if open_ is not None and open_.spec.num_samples + spec.num_samples <= self.cap:
                open_.members.append((item, spec.num_samples))
                open_.spec = dataclasses.replace(
                    open_.spec, num_samples=open_.spec.num_samples + spec.num_samples
                )
                return None
            batch = Batch(spec, [(item, spec.num_samples)])
            self._open[key] = batch  # a full batch stays queued; later requests start this one
            return batch

    def take(self, snapshot: str | None, batch: Batch[T]) -> SampleSpec:
        """Close `batch` (the model thread is about to run it): nothing joins it after."""
        with self._lock:
            if not batch.taken:
                key = (snapshot, dataclasses.replace(batch.spec, num_samples=0))
                if self._open.get(key) is batch:
                    del self._open[key]
                batch.taken = True
            return batch.spec
