"""What an evaluation beside training costs the steps and the engine, at nice 0 and nice 19.

    .venv/bin/python bench/eval_priority.py [--model DIR] [--seconds 60]

The trainer's held-out evaluations run on a thread of the trainer process
beside its steps (services/trainer/evaluating.py), at `[trainer] eval_nice`
(services/runtime/threads.py). This measures, on the real model, what that
thread takes from the two things it shares the cores with, in three phases
of `--seconds` each, one after the other in one run:

- the *trainer*: this process, one torch thread, steps of forward + backward
  + AdamW on a fixed batch (32 rows of 74 tokens, the ticket-routing run's
  step at groups_per_step 4 with 16-token replies): steps/s;
- the *engine*: a subprocess, one torch thread, greedy generation of 16
  tokens for 8 prompts in a loop: tokens/s;
- the *evaluation*: `evaluate.generate` on a `niced_pool` thread of this
  process (as HeldOut runs it), 64 prompts × 16 tokens greedy, in a loop:
  generations/s.

Phases: no evaluation (the baseline), the evaluation at nice 0, at nice 19.
Each phase's trainer and engine rates are printed as ratios to the
baseline of the same run. On a machine with idle cores the three phases
read alike; on 2 cores the trainer and the engine fill them, and nice 0
takes its share from them while nice 19 waits for idle time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENGINE = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ids = torch.randint(100, 20000, (8, 60))
deadline = time.monotonic() + float(sys.argv[2])
tokens = 0
print("ready", flush=True)
with torch.no_grad():
    while time.monotonic() < deadline:
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0)
        tokens += (out.shape[1] - ids.shape[1]) * ids.shape[0]
print(tokens / float(sys.argv[2]), flush=True)
"""


def load(model_dir: str) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tok


def train_steps(model: Any, seconds: float) -> float:
    """Steps/s of forward + backward + AdamW on a fixed batch, for `seconds`."""
    import torch

    batch = torch.randint(100, 20000, (32, 74), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    steps, deadline = 0, time.monotonic() + seconds
    start = time.monotonic()
    while time.monotonic() < deadline:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps += 1
    return steps / (time.monotonic() - start)


def phase(model_dir: str, seconds: float, nice: int | None) -> dict[str, Any]:
    """One phase: the engine subprocess, the trainer here, the evaluation thread if `nice`."""
    import asyncio

    from services.runtime.threads import niced_pool, offload_to
    from services.tasks.evaluate import generate

    trainer_model, _ = load(model_dir)
    eval_model, tok = load(model_dir)
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, model_dir, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert engine.stdout is not None
    assert engine.stdout.readline().strip() == "ready"  # loaded: its timed loop starts now
    done = threading.Event()
    evals = [0]

    def evaluation() -> None:
        prompts = [[100 + i] * 60 for i in range(64)]
        run = offload_to(niced_pool(nice or 0, "bench-eval"))

        async def loop() -> None:
            while not done.is_set():
                await run(generate, eval_model, tok, prompts, max_new_tokens=16)
                evals[0] += len(prompts)

        asyncio.run(loop())

    evaluator = threading.Thread(target=evaluation, daemon=True) if nice is not None else None
    if evaluator is not None:
        evaluator.start()
    t0 = time.monotonic()
    steps_per_s = train_steps(trainer_model, seconds)
    wall = time.monotonic() - t0
    done.set()
    engine_tps = float(engine.communicate()[0].strip().splitlines()[-1])
    if evaluator is not None:
        evaluator.join()
    return {
        "eval_nice": nice,
        "trainer_steps_per_s": round(steps_per_s, 4),
        "engine_tokens_per_s": round(engine_tps, 1),
        "eval_generations_per_s": round(evals[0] / wall, 2) if nice is not None else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/flywheel/models/SmolLM2-135M-Instruct"))  # fmt: skip
    ap.add_argument("--seconds", type=float, default=60.0)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows = [phase(a.model, a.seconds, nice) for nice in (None, 0, 19)]
    base = rows[0]
    for r in rows:
        r["trainer_vs_baseline"] = round(r["trainer_steps_per_s"] / base["trainer_steps_per_s"], 3)
        r["engine_vs_baseline"] = round(r["engine_tokens_per_s"] / base["engine_tokens_per_s"], 3)
        print(json.dumps(r), flush=True)
    load1 = os.getloadavg()[0]
    print(json.dumps({"cores": os.cpu_count(), "load": [round(load0, 1), round(load1, 1)]}))


if __name__ == "__main__":
    main()
