"""A real model as the judge: SmolLM2-135M-Instruct on one CPU engine grades 10 completions.

The path a run's judge part takes, end to end, with a pretrained model: the
CPU engine (its own process, one torch thread) serving
/v1/chat/completions, the worker's pool (services/engine_api/chat_pool.py)
and the judge (services/tasks/judge.py: rubric, parser, cache). Prints each
completion's verdict, the judge's raw reply and the request's latency, then
asks the 10 again to show the cache (no request reaches the engine).

SmolLM2-135M is a weak judge: the figures say whether the path is real and
what a verdict costs on these cores, not how good the verdicts are.

    .venv/bin/python bench/judge.py [--parse yes_no|score] [--model <dir>]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.engine_api.chat_pool import ChatPool  # noqa: E402
from services.tasks.judge import Judge, JudgeReward  # noqa: E402

MODEL = Path.home() / ".cache/flywheel/models/SmolLM2-135M-Instruct"
RUBRICS = {
    "yes_no": (
        "Question: {prompt}\nProposed answer: {completion}\n"
        "Is the proposed answer correct? Reply with yes or no."
    ),
    "score": (
        "Question: {prompt}\nProposed answer: {completion}\n"
        "Rate the proposed answer's correctness from 0 (wrong) to 10 (right). "
        "Reply with the number only."
    ),
}
CASES = [  # (prompt, completion, is it right)
    ("What is 2 + 3?", "5", True),
    ("What is 2 + 3?", "7", False),
    ("What is the capital of France?", "Paris", True),
    ("What is the capital of France?", "Berlin", False),
    ("How many legs does a spider have?", "8", True),
    ("How many legs does a spider have?", "6", False),
    ("What color is the sky on a clear day?", "Blue", True),
    ("What color is the sky on a clear day?", "Green", False),
    ("What is 10 - 4?", "6", True),
    ("What is 10 - 4?", "14", False),
]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    import urllib.request

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "FLYWHEEL_ENGINE_NUM_THREADS": "1"}  # fmt: skip
    argv = [sys.executable, "-m", "services.engine", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health_generate", timeout=30) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("engine did not become healthy")


async def judge_all(url: str, part: JudgeReward) -> list[tuple[str, str, bool, str, float, float]]:
    rows = []
    async with ChatPool([url], concurrency=1, timeout_s=120.0) as pool:
        judge = Judge(pool.chat, cache_size=64)
        for prompt, completion, right in CASES:
            t0 = time.monotonic()
            v = await judge.verdict(part, prompt, completion, None)
            rows.append((prompt, completion, right, v.reply.strip(), v.value if v.value is not None
                         else float("nan"), time.monotonic() - t0))  # fmt: skip
        t0 = time.monotonic()
        again = [await judge.verdict(part, p, c, None) for p, c, _ in CASES]
        cached_s = time.monotonic() - t0
        assert all(v.cached for v in again)
    print(f"\nthe 10 again: all from the cache in {cached_s * 1000:.1f} ms in all")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--parse", choices=sorted(RUBRICS), default="yes_no")
    args = ap.parse_args()
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model at {args.model}: `make smollm2` imports it")
    part = JudgeReward.model_validate(
        {"fn": "judge", "rubric": RUBRICS[args.parse], "parse": args.parse, "max_tokens": 4}
    )
    log = Path(tempfile.mkdtemp(prefix="judge-bench-")) / "engine.log"
    t0 = time.monotonic()
    proc, url = start_engine(args.model, log)
    print(f"engine up in {time.monotonic() - t0:.1f} s ({args.model})")
    try:
        rows = asyncio.run(judge_all(url, part))
    finally:
        proc.terminate()
        proc.wait(30)
    print("\n| prompt | completion | right? | judge's reply | verdict | latency s |")
    print("|---|---|---|---|---|---|")
    for prompt, completion, right, reply, value, secs in rows:
        print(f"| {prompt} | {completion} | {'yes' if right else 'no'} | {reply!r} | "
              f"{value:g} | {secs:.2f} |")  # fmt: skip
    scored = [(r, v) for _, _, r, _, v, _ in rows if v == v]
    agree = sum((v >= 0.5) == r for r, v in scored)
    lat = sorted(s for *_, s in rows)
    print(
        f"\nscored {len(scored)}/10, agreeing with the truth {agree}/{len(scored)}; "
        f"latency median {lat[len(lat) // 2]:.2f} s, max {lat[-1]:.2f} s"
    )


if __name__ == "__main__":
    main()
