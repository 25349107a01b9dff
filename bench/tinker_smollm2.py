"""The Tinker SDK against `flywheel tinker` on a real model (SmolLM2-135M-Instruct, CPU):
a few supervised steps teaching one chat answer the base model does not give (a
made-up fact) through forward_backward + optim_step,
then samples (with logprobs) from the trained adapter. Prints each step's loss and
seconds, and the samples. docs/tinker.md records a run.

    python bench/tinker_smollm2.py [--model DIR] [--steps N] [--port P]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/flywheel/models/SmolLM2-135M-Instruct"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--port", type=int, default=18800)
    p.add_argument("--lr", type=float, default=5e-4)
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    cmd = [sys.executable, "-m", "services.tinker", "--model", args.model, "--port", str(args.port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return run(f"http://127.0.0.1:{args.port}", Path(args.model).name, args)
    finally:
        server.terminate()
        server.wait(30)


def run(base_url: str, model_name: str, args: argparse.Namespace) -> int:
    import httpx
    import numpy as np
    import tinker
    from tinker import types

    t0 = time.monotonic()
    while True:  # the server loads the model first
        try:
            if httpx.get(f"{base_url}/api/v1/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > 120:
            raise SystemExit("the server did not answer /api/v1/healthz within 120 s")
        time.sleep(0.5)
    print(f"server up in {time.monotonic() - t0:.1f} s")
    service = tinker.ServiceClient(base_url=base_url)
    training = service.create_lora_training_client(base_model=model_name, rank=8, seed=0).result()
    tok = training.get_tokenizer()
    question = [{"role": "user", "content": "What is the name of the Flywheel project's mascot?"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt)
    answer_ids = tok.encode("The mascot is a blue heron named Ziggy.<|im_end|>")
    ids = prompt_ids + answer_ids
    weights = [0.0] * (len(prompt_ids) - 1) + [1.0] * len(answer_ids)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(ids[1:], dtype=np.int64),
            "weights": np.asarray(weights, dtype=np.float32),
        },
    )
    print(f"datum: {len(ids) - 1} tokens, {len(answer_ids)} weighted")
    for step in range(args.steps):
        t = time.monotonic()
        fb = training.forward_backward([datum], "cross_entropy")
        opt = training.optim_step(types.AdamParams(learning_rate=args.lr))
        loss = fb.result().metrics["loss:sum"] / len(answer_ids)
        opt.result()
        print(f"step {step}: loss per answer token {loss:.3f}, {time.monotonic() - t:.2f} s")
    sampler = training.save_weights_and_get_sampling_client().result()
    t = time.monotonic()
    params = types.SamplingParams(max_tokens=12, temperature=0.7, seed=1)
    result = sampler.sample(types.ModelInput.from_ints(prompt_ids), 4, params).result()
    print(f"4 samples of up to 12 tokens in {time.monotonic() - t:.2f} s:")
    for s in result.sequences:
        mean_lp = sum(s.logprobs or []) / max(len(s.tokens), 1)
        print(f"  {tok.decode(s.tokens)!r} ({s.stop_reason}, mean logprob {mean_lp:.2f})")
    service.close("success").result()
    return 0


if __name__ == "__main__":
    sys.exit(main())
