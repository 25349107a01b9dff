"""Sampling on the engines against sampling in the Tinker server, on SmolLM2-135M-Instruct
(CPU): the same trained adapter's greedy answer and logprobs from both, and how long a
training step waits while a sampler's request is in flight. docs/tinker.md records a run.

1. A CPU engine (LoRA on) and a Tinker server sampling on it (`[tinker] engines`):
   six cross_entropy steps teaching one made-up chat answer (bench/tinker_smollm2.py's),
   save_state, then a greedy answer and compute_logprobs of prompt + answer.
2. While 8 samples of 48 tokens are in flight on a sampler, one forward_backward +
   optim_step: its seconds (the sample runs on the engine, beside the step).
3. A Tinker server without engines, on the same state_dir, loads the saved state:
   the same greedy answer and compute_logprobs (in its process), and step 2 again (the
   step now queues behind the samples on the one model thread).

    python bench/tinker_engines_smollm2.py [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_MODEL = Path.home() / ".cache/flywheel/models/SmolLM2-135M-Instruct"


def _wait(url: str, proc: subprocess.Popen[bytes], what: str) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < 300:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} did not answer {url} within 300 s")


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )


def _server(model: str, port: int, state: Path, log: Path, engines: list[str]) -> Any:
    env = {
        "FLYWHEEL_TINKER_NUM_THREADS": "1",
        "FLYWHEEL_TINKER_STATE_DIR": str(state),
        "FLYWHEEL_TINKER_ENGINES": json.dumps(engines),
    }
    argv = [sys.executable, "-m", "services.tinker", "--model", model, "--port", str(port)]
    proc = _start(argv, env, log)
    _wait(f"http://127.0.0.1:{port}/api/v1/healthz", proc, "the tinker server")
    return proc


def _chat(tok: Any) -> tuple[list[int], list[int]]:
    question = [{"role": "user", "content": "What is the name of the Flywheel project's mascot?"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    return tok.encode(prompt), tok.encode("The mascot is a blue heron named Ziggy.<|im_end|>")


def _greedy_and_logprobs(sampler: Any, prompt: list[int], answer: list[int]) -> tuple[Any, Any]:
    from tinker import types

    greedy = types.SamplingParams(max_tokens=16, temperature=0.0)
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result().sequences[0]
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + answer)).result()
    return seq, lps


def _step_beside_samples(training: Any, sampler: Any, datum: Any, prompt: list[int]) -> float:
    """Seconds of one forward_backward + optim_step sent just after 8 x 48-token samples."""
    from tinker import types

    params = types.SamplingParams(max_tokens=48, temperature=0.7, stop=[])
    pending = sampler.sample(types.ModelInput.from_ints(prompt), 8, params)
    time.sleep(0.2)  # the sample request is in
    t = time.monotonic()
    fb = training.forward_backward([datum], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-5)).result()
    fb.result()
    took = time.monotonic() - t
    pending.result()
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    import numpy as np
    import tinker
    from tinker import types

    from tests.harness.ports import free_port

    root = Path(tempfile.mkdtemp(prefix="tinker-engines-"))
    state = root / "state"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        eport = free_port()
        engine = [
            sys.executable,
            "-m",
            "services.engine",
            "--model",
            args.model,
            "--port",
            str(eport),
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-target-modules",
            "all",
        ]
        procs.append(_start(engine, {"FLYWHEEL_ENGINE_NUM_THREADS": "1"}, root / "engine.log"))
        _wait(f"http://127.0.0.1:{eport}/health_generate", procs[-1], "the engine")
        port = free_port()
        procs.append(
            _server(args.model, port, state, root / "e.log", [f"http://127.0.0.1:{eport}"])
        )
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}")
        name = Path(args.model).name
        training = service.create_lora_training_client(base_model=name, rank=8, seed=0).result()
        tok = training.get_tokenizer()
        prompt, answer = _chat(tok)
        ids = prompt + answer
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(ids[1:], dtype=np.int64),
                "weights": np.asarray(weights, dtype=np.float32),
            },
        )
        for _ in range(6):
            training.forward_backward([datum], "cross_entropy")
            training.optim_step(types.AdamParams(learning_rate=5e-4)).result()
        path = training.save_state("taught").result().path
        sampler = training.save_weights_and_get_sampling_client().result()
        on_engine, lp_engine = _greedy_and_logprobs(sampler, prompt, answer)
        step_engine = _step_beside_samples(training, sampler, datum, prompt)
        service.close("success").result()
        procs.pop().terminate()

        port = free_port()
        procs.append(_server(args.model, port, state, root / "p.log", []))
        local = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}")
        twin = local.create_training_client_from_state_with_optimizer(path).result()
        twin_sampler = twin.save_weights_and_get_sampling_client().result()
        in_process, lp_local = _greedy_and_logprobs(twin_sampler, prompt, answer)
        step_local = _step_beside_samples(twin, twin_sampler, datum, prompt)
        local.close("success").result()

        diffs = [abs(a - b) for a, b in zip(on_engine.logprobs, in_process.logprobs, strict=True)]
        diffs += [abs(a - b) for a, b in zip(lp_engine[1:], lp_local[1:], strict=True)]
        print(f"engine greedy:     {tok.decode(on_engine.tokens)!r}")
        print(f"in-process greedy: {tok.decode(in_process.tokens)!r}")
        print(
            f"same tokens: {on_engine.tokens == in_process.tokens}; largest logprob "
            f"difference over {len(diffs)} (sampled + prompt) tokens: {max(diffs):.3g}"
        )
        print(
            f"forward_backward + optim_step beside 8 x 48-token samples: "
            f"{step_engine:.2f} s sampling on the engine, {step_local:.2f} s in-process"
        )
        return 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
