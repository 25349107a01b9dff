"""What moving torch's intra-op thread count costs, and whether it is process-wide.

    PYTHONPATH=$PWD .venv/bin/python bench/thread_switch.py

The core lease (services/runtime/cores.py) changes a role's thread count
between ops: the trainer at every decoder layer, an engine between scheduler
steps. This measures, on this machine:

- `torch.set_num_threads(n)` when n is already the count, and when it changes;
- one SmolLM2-135M-sized MLP matmul ([tokens, 576] @ [576, 1536]) at 1 thread,
  at 2, and the first one right after each change (the OpenMP team re-forms);
- whether a count set on one thread reaches another thread once that thread
  has used ATen's thread pool (`at::parallel_for` reads OpenMP's per-thread
  count, set from torch's global one only at the thread's first use; MKL's
  matmuls read MKL's process-wide count): the lease sets it on the compute
  thread itself, which covers both.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def per_call_us(fn: object, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()  # type: ignore[operator]
    return (time.perf_counter() - t0) / n * 1e6


def matmul_ms(a: object, b: object, reps: int) -> float:
    import torch

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)  # type: ignore[call-overload]
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=512, help="rows of the matmul")
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    a, b = torch.randn(args.tokens, 576), torch.randn(576, 1536)
    torch.set_num_threads(2)
    torch.matmul(a, b)
    same = per_call_us(lambda: torch.set_num_threads(2), 100_000)
    flips = iter(range(10**9))
    change = per_call_us(lambda: torch.set_num_threads(1 + next(flips) % 2), 100_000)
    torch.set_num_threads(1)
    one = matmul_ms(a, b, args.reps)
    torch.set_num_threads(2)
    two = matmul_ms(a, b, args.reps)
    first_after = []
    for _ in range(args.reps):
        for n in (1, 2):
            torch.set_num_threads(n)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            first_after.append(((time.perf_counter() - t0) * 1e3, n))
    first1 = statistics.median(t for t, n in first_after if n == 1)
    first2 = statistics.median(t for t, n in first_after if n == 2)

    seen: dict[str, int] = {}
    ready, go = threading.Event(), threading.Event()

    def other() -> None:
        seen["before"] = torch.get_num_threads()  # first use: the thread's count is its own
        ready.set()
        go.wait()
        seen["other"] = torch.get_num_threads()

    t = threading.Thread(target=other)
    torch.set_num_threads(2)
    t.start()
    ready.wait()
    torch.set_num_threads(1)
    go.set()
    t.join()

    print(f"torch {torch.__version__}; {args.tokens}x576 @ 576x1536 fp32; median of {args.reps}")
    print(f"set_num_threads, unchanged: {same:.3f} us/call; changing: {change:.3f} us/call")
    print(f"matmul at 1 thread {one:.2f} ms, at 2 threads {two:.2f} ms ({one / two:.2f}x)")
    print(f"first matmul after a change: to 1 thread {first1:.2f} ms, to 2 threads {first2:.2f} ms")
    main_now = torch.get_num_threads()
    print(f"set to 1 on the main thread; another thread that had used the pool at "
          f"{seen['before']} still has {seen['other']} (main: {main_now})")  # fmt: skip


if __name__ == "__main__":
    main()
