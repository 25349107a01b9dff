"""The trainer's side of the core lease (services/trainer/lending.py), on a real model and
real threads: the count the lease gives is the count the compute thread runs with, and it
moves mid-computation when another role's state changes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from services.runtime.cores import CoreLease, CoreLeaseSettings
from services.trainer.lending import ThreadLending, layers


def forward_threads(pool: ThreadPoolExecutor, model: Any) -> int:
    """Run a forward on the pool's (one) thread; the thread count it ended with there."""

    def run() -> int:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3, 4]]))
        return torch.get_num_threads()

    return pool.submit(run).result()


def test_the_compute_thread_takes_the_leases_count(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert len(layers(model)) == model.config.num_hidden_layers  # checked at every layer
    s = CoreLeaseSettings(dir=tmp_path / "cores", total=2, poll_s=0.05)
    engine = CoreLease(s, "engine-0")
    lending = ThreadLending(s, model)
    lending.lease.runnable = lambda: 1  # a quiet machine (the shared one here is not)
    pool = ThreadPoolExecutor(1)  # as asyncio.to_thread: a thread of its own
    try:
        engine.mark(True)
        lending.working()  # both have work: the trainer's share
        assert forward_threads(pool, model) == 1
        engine.mark(False)  # the engines stopped (the buffer admits nothing): their core too
        deadline = time.monotonic() + 5
        while lending.target != 2:
            assert time.monotonic() < deadline, "the watcher never read the engine's state"
            time.sleep(0.02)
        assert forward_threads(pool, model) == 2
        lending.waiting()
        assert (tmp_path / "cores" / "trainer").read_text().split()[1] == "idle"
    finally:
        pool.shutdown()
        lending.close()
    assert lending.changes >= 1
    assert not (tmp_path / "cores" / "trainer").exists()
