"""Response lengths of what a run generated, dropped as stale and trained, from its run directory.

    .venv/bin/python bench/staleness_lengths.py RUN_DIR [RUN_DIR ...] [--run NAME]
    .venv/bin/python bench/staleness_lengths.py --tiny-model runs/stale-long/model

Issue 46 item 4: does dropping stale groups bias training towards short
replies? For each run directory (`[stack] run_dir` of a `flywheel up` or
`flywheel demo`, running or stopped) it reads the run's recorded streams,
SAMPLES (every group generated), BATCHES (what trained) and DLQ (what the
buffer dropped, with the reason), and prints a markdown table: per class
the samples, mean, p50 and p90 response tokens, and a two-sample
Kolmogorov-Smirnov test of trained against generated lengths (and stale
against generated). The analysis is services/replay/lengths.py (pure,
unit-tested); this script only reads.

Where the streams are: the nats-server of a `flywheel up` still running on
that directory (`<run_dir>/run.json`), else the stopped run's store
(`<run_dir>/nats`) opened by a nats-server of our own. Every run the store
holds is read unless `--run` names one (a store holds one run per `run`
name that ever used that directory).

--tiny-model DIR writes the random tiny model bench/configs/stale-long.toml
runs (the default tiny model with 512 positions: a 256-token reply after a
prompt does not fit its default 256).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextlib.contextmanager
def nats_of(run_dir: Path) -> Iterator[str]:
    """The URL of the NATS holding `run_dir`'s streams while the caller reads (module doc)."""
    from services.runtime import local_run
    from services.stack.replaying import open_store

    live = local_run.find(run_dir)
    if live is not None:
        yield live.nats_url
        return
    with open_store(run_dir) as url:
        yield url


async def runs_in(js: Any) -> list[str]:
    """The runs whose SAMPLES stream the server holds (FLYWHEEL_<run>_SAMPLES)."""
    names = [s.config.name for s in await js.streams_info()]
    return sorted(n[len("FLYWHEEL_") : -len("_SAMPLES")] for n in names
                  if n.startswith("FLYWHEEL_") and n.endswith("_SAMPLES"))  # fmt: skip


async def messages(js: Any, run: str, what: str) -> list[bytes]:
    """Every whole message `what` holds now (chunks put back together)."""
    from proto.streams import stream_name
    from services.runtime.recording import extent, recorded

    stream = stream_name(run, what)
    ext = await extent(js, stream, "reading a run's lengths")
    return [data async for _, data in recorded(js, stream, start_seq=ext.first, end_seq=ext.last)]


def decoded(blobs: list[bytes], cls: type[Any]) -> tuple[list[Any], int]:
    """The messages that decode as `cls`, and how many did not."""
    from proto.codec import decode
    from proto.errors import ProtocolError

    out, bad = [], 0
    for b in blobs:
        try:
            out.append(decode(b, cls))
        except ProtocolError:
            bad += 1
    return out, bad


async def read_run(url: str, only: str | None) -> dict[str, Any]:
    """run name -> its Lengths (services/replay/lengths.py), for every run at `url`."""
    import nats

    from proto.messages import DeadLetter, SampleGroup, TrainBatch
    from services.replay.lengths import classify

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        runs = [only] if only else await runs_in(js)
        out = {}
        for run in runs:
            groups, bad_g = decoded(await messages(js, run, "SAMPLES"), SampleGroup)
            batches, bad_b = decoded(await messages(js, run, "BATCHES"), TrainBatch)
            dead, bad_d = decoded(await messages(js, run, "DLQ"), DeadLetter)
            if bad_g or bad_b or bad_d:
                print(f"{run}: left out undecodable messages: SAMPLES {bad_g}, BATCHES {bad_b}, "
                      f"DLQ {bad_d}", file=sys.stderr)  # fmt: skip
            out[run] = classify(groups, batches, dead)
        return out
    finally:
        await nc.close()


def every_third(group: Any) -> str | None:
    """A buffer filter that drops a third of the groups by a hash of their id, whatever
    their lengths (bench/configs/stale-long-learned.toml: `[buffer] custom_filter =
    "bench.staleness_lengths:every_third"`). A random model's groups are all flat, so the
    zero-variance filter is off there; this one makes the learned over-sampling dispatch
    surplus tasks as a real filter does, without judging length itself."""
    import zlib

    return "every_third" if zlib.crc32(group.group_id.encode()) % 3 == 0 else None


def write_tiny_model(out: Path) -> None:
    from services.models.tiny_model import TinyModelSpec, write_tiny_model

    write_tiny_model(out, TinyModelSpec(max_position_embeddings=512))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", type=Path, nargs="*", help="run directories ([stack] run_dir)")
    p.add_argument("--run", help="only this run of each store (default: every run it holds)")
    p.add_argument("--tiny-model", type=Path, help="write the 512-position tiny model here")
    args = p.parse_args(argv)
    if args.tiny_model:
        write_tiny_model(args.tiny_model)
    if not args.run_dirs:
        return 0 if args.tiny_model else p.error("give at least one RUN_DIR")
    from services.replay.lengths import TABLE_HEAD, table_rows

    rows = []
    for run_dir in args.run_dirs:
        started = time.perf_counter()
        with nats_of(run_dir) as url:
            found = asyncio.run(read_run(url, args.run))
        for run, lengths in found.items():
            label = f"{run} ({run_dir.name})" if run != run_dir.name else run
            rows += table_rows(label, lengths)
            if lengths.unattributed:
                print(f"{label}: {lengths.unattributed} stale dead letters name no group found",
                      file=sys.stderr)  # fmt: skip
        print(f"read {run_dir} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(TABLE_HEAD)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
