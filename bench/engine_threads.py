"""The CPU engine's generation at the thread counts the core lease moves it between.

    PYTHONPATH=$PWD .venv/bin/python bench/engine_threads.py \\
        --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct

A real engine (in this process, served on a free port) generates demo-real's
shape: `--requests` concurrent /generate calls of n = `--n` samples, each
exactly `--new-tokens` tokens, at each thread count in turn (set through the
engine's /flywheel/num_threads hook, as a rollout worker does), `--repeats`
rounds alternating the counts so the machine's load hits both alike.
Prints generated tokens/s per count (median and best) and the ratio: what a
core lent to the engine is worth on this machine now.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def round_trip(url: str, args: argparse.Namespace, threads: int) -> float:
    from services.engine_api.engine_client import EngineClient

    async with EngineClient(url, retries=0) as c:
        await c.set_num_threads(threads)
        params = {"max_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 0.7,
                  "n": args.n}  # fmt: skip
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(c.generate([1, 2, 3, 4, 5, 6, 7, 8 + i],
                                                 sampling_params=params)
                                      for i in range(args.requests)))  # fmt: skip
        took = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for out in outs for r in out)
    return tokens / took


async def run(args: argparse.Namespace) -> dict[int, list[float]]:
    from services.engine.app import build_app, create_state
    from services.engine.settings import EngineSettings
    from services.runtime.settings import load_settings
    from tests.harness.engines import serving

    state = create_state(load_settings(EngineSettings, model=args.model.expanduser()))
    rates: dict[int, list[float]] = {n: [] for n in args.threads}
    try:
        async with serving(build_app(state)) as url:
            await round_trip(url, args, args.threads[0])  # warm-up
            for _ in range(args.repeats):
                for n in args.threads:
                    rates[n].append(await round_trip(url, args, n))
    finally:
        state.scheduler.stop()
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--requests", type=int, default=2, help="concurrent /generate calls")
    p.add_argument("--n", type=int, default=8, help="samples per request")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    load = os.getloadavg()[0]
    rates = asyncio.run(run(args))
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{when}; {os.cpu_count()} CPUs; load 1m {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after; {args.requests} x n={args.n} x "
          f"{args.new_tokens} tokens, {args.repeats} rounds")  # fmt: skip
    base = statistics.median(rates[args.threads[0]])
    for n, r in rates.items():
        med = statistics.median(r)
        print(f"  {n} thread(s): {med:.0f} tokens/s median, {max(r):.0f} best "
              f"({med / base:.2f}x {args.threads[0]})")  # fmt: skip


if __name__ == "__main__":
    main()
