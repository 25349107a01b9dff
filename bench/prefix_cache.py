"""Samples/s of the CPU engine on 8-sample groups, with its prefix cache against without.

Two engine schedulers on the same model in the same process (the server's
`Scheduler` + `ModelRunner`, without HTTP): one with `[engine]
prefix_cache_mib` 0 (every sample prefills its prompt, the engine before the
cache), one with the cache on. Each round submits `--groups` requests at once,
each a distinct chat prompt with n = 8 samples at temperature 1 and exactly
`--new-tokens` new tokens (EOS ignored), as a rollout worker sends a task's
group; the wall time runs from the first submit to the last answer. Rounds
alternate between the two schedulers, every round on fresh prompts (the cache
never sees a prompt before its own round) and, on the cached one, after a
/flush_cache, so only sharing within a round counts. Each figure is the best of
`--repeats` rounds (the machine is shared); torch runs on `--threads` threads.

    python bench/prefix_cache.py --model tiny
    python bench/prefix_cache.py --model ~/.cache/flywheel/models/SmolLM2-135M-Instruct

Prints samples/s without and with the cache, their ratio, the prompt length,
and the prompt tokens each path computed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.engine.core.protocol import Completion, parse_generate  # noqa: E402
from services.engine.runner import ModelRunner  # noqa: E402
from services.engine.scheduler import Scheduler  # noqa: E402
from services.tasks.arithmetic import problem  # noqa: E402


class CountingRunner(ModelRunner):
    """Counts the tokens its prefills and extends are given (the prompt work)."""

    computed = 0

    def prefill(self, seqs: list[list[int]], lora_ids: Any = None) -> Any:
        self.computed += sum(len(s) for s in seqs)
        return super().prefill(seqs, lora_ids)

    def extend(self, past: Any, suffixes: list[list[int]], lora_ids: Any = None) -> Any:
        self.computed += sum(len(s) for s in suffixes)
        return super().extend(past, suffixes, lora_ids)


def model_dir(name: str) -> Path:
    if name != "tiny":
        return Path(name).expanduser()
    from services.models.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(Path(tempfile.mkdtemp()) / "tiny", TinyModelSpec())


def chat_prompts(path: Path, count: int, start: int) -> list[list[int]]:
    """Token ids of `count` arithmetic problems as a chat prompt (the demo's shape)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for i in range(start, start + count):
        text = (
            f"Add the numbers and answer with the sum. {problem(seed=0, index=i, digits=3).prompt}"
        )
        if tok.chat_template:
            text = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        out.append([int(t) for t in tok.encode(text, add_special_tokens=False)])
    return out


def scheduler(path: Path, cache_mib: float, threads: int) -> Scheduler:
    runner = CountingRunner(path, num_threads=threads, weights_check="sizes")
    sched = Scheduler(
        runner, eos=frozenset(), decode=lambda ids, skip: "",
        prefix_cache_bytes=int(cache_mib * 2**20),
    )  # fmt: skip
    sched.start()
    return sched


def one_round(sched: Scheduler, prompts: list[list[int]], n: int, new_tokens: int) -> float:
    """Seconds from the first submit to the last answer of these groups."""
    sampling = {"n": n, "temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
    specs = [
        s
        for p in prompts
        for s in parse_generate(
            {"input_ids": p, "sampling_params": sampling}, lambda t: [], 10**9, 10**6
        ).seqs
    ]
    sched.flush_cache().result(60)
    futures: list[Future[Completion]] = []
    t0 = time.perf_counter()
    for spec in specs:
        fut: Future[Completion] = Future()
        futures.append(fut)
        sched.submit(spec, fut.set_result)
    for f in futures:
        done = f.result(600)
        assert len(done.output_ids) == new_tokens, done.finish_reason
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="'tiny' or a model directory")
    ap.add_argument("--groups", type=int, default=4, help="requests (groups) per round")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-mib", type=float, default=256.0)
    args = ap.parse_args()

    path = model_dir(args.model)
    plain = scheduler(path, 0.0, args.threads)
    cached = scheduler(path, args.cache_mib, args.threads)
    samples = args.groups * args.n
    best: dict[str, float] = {"plain": float("inf"), "cached": float("inf")}
    computed: dict[str, int] = {}
    lengths: list[int] = []
    try:
        one_round(plain, chat_prompts(path, args.groups, 10**6), args.n, args.new_tokens)  # warm-up
        one_round(cached, chat_prompts(path, args.groups, 10**6), args.n, args.new_tokens)
        for r in range(args.repeats):
            prompts = chat_prompts(path, args.groups, r * args.groups)
            lengths += [len(p) for p in prompts]
            for name, sched in (("plain", plain), ("cached", cached)):
                before = sched.runner.computed  # type: ignore[attr-defined]
                best[name] = min(best[name], one_round(sched, prompts, args.n, args.new_tokens))
                computed[name] = sched.runner.computed - before  # type: ignore[attr-defined]
    finally:
        plain.stop()
        cached.stop()
    rate = {k: samples / v for k, v in best.items()}
    print(f"model {args.model}: {args.groups} groups x n={args.n}, {args.new_tokens} new tokens, "
          f"prompt {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.1f}), "
          f"{args.threads} thread(s), best of {args.repeats}")  # fmt: skip
    print(f"prompt tokens computed per round: without cache {computed['plain']}, "
          f"with {computed['cached']}")  # fmt: skip
    print(f"samples/s without cache {rate['plain']:.2f}, with cache {rate['cached']:.2f}: "
          f"{rate['cached'] / rate['plain']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
