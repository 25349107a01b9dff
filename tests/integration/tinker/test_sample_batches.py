"""Sample requests queued behind a busy model thread generate as one batch (batching.py),
on the real tiny model: the thread is held busy, three requests that differ only in
their count come in, and when it is free one generation answers each with its own rows;
a seeded request beside them runs alone. (The package's conftest skips it without the
`tinker` and `lora` extras.)"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

from services.tinker.app import Service
from services.tinker.core import SampleSpec, State
from services.tinker.model import AdapterModel
from services.tinker.settings import TinkerSettings

SPEC = SampleSpec(
    prompt=(5, 6, 7, 8), num_samples=1, max_tokens=6, temperature=1.0, top_k=-1, top_p=1.0,
    seed=None, stop_tokens=(), stop_strings=(), prompt_logprobs=False,
)  # fmt: skip


def _rows(result: bytes) -> list[list[int]]:
    from tinker.proto import tinker_public_pb2 as pb  # the SDK's own generated module

    msg = pb.SampleResponse.FromString(result)
    return [list(memoryview(s.tokens).cast("i")) for s in msg.sequences]


def test_queued_requests_share_one_generation(tiny_model: Path) -> None:
    settings = TinkerSettings(model=str(tiny_model), num_threads=1)
    svc = Service(settings, AdapterModel(tiny_model, settings.lora_alpha), tiny_model)
    calls: list[int] = []
    sample = svc.model.sample

    def counted(snapshot: str | None, spec: SampleSpec):  # type: ignore[no-untyped-def]
        calls.append(spec.num_samples)  # the real sampler, counted
        return sample(snapshot, spec)

    svc.model.sample = counted  # type: ignore[method-assign]

    async def scenario() -> list[list[list[int]]]:
        busy = threading.Event()
        loop = asyncio.get_running_loop()
        held = loop.run_in_executor(svc.thread, busy.wait)  # the model thread, busy
        counts = [1, 1, 3]
        entries = [svc.log.open("sampler", "sample", i)[0] for i in range(4)]
        for entry, n in zip(entries, counts, strict=False):
            batch = svc.batches.add(None, dataclasses.replace(SPEC, num_samples=n), entry)
            if batch is not None:
                svc.submit_batch(None, batch)
        seeded = svc.batches.add(None, dataclasses.replace(SPEC, seed=7), entries[3])
        assert seeded is not None
        svc.submit_batch(None, seeded)
        busy.set()
        await held
        for entry in entries:
            await svc.wait(entry, 60)
        assert all(e.state is State.DONE for e in entries), [e.error for e in entries]
        return [_rows(e.result) for e in entries]

    rows = asyncio.run(scenario())
    svc.thread.shutdown()
    assert calls == [5, 1]  # one generation of 1 + 1 + 3, then the seeded request alone
    assert [len(r) for r in rows] == [1, 1, 3, 1]
    assert all(len(seq) == SPEC.max_tokens for r in rows for seq in r)
