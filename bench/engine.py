"""Generated tokens/s of the CPU engine vs transformers `generate`, same model, same run.

For each model spec and each concurrency C in (1, 8, 32):

- engine:  C concurrent /generate requests to a real engine server subprocess
           (HTTP, continuous batching), wall time from first send to last reply;
- (a) loop:    prompts through `model.generate` one request at a time (what a
               naive per-request rollout worker does); its tokens/s does not
               depend on C, so min(C, 8) requests are timed;
- (b) batched: the same C prompts in one left-padded `model.generate` call
               (the limit: one static batch, no HTTP, no scheduling).

Every request samples (temperature 1) exactly `--new-tokens` tokens (EOS
ignored / suppressed), so all three do the same work. Each figure is the
best of `--repeats` runs (the machine is shared). Prints a table and
the ratios engine/(a) and engine/(b); `--markdown` prints it as a table for
bench/results_engine.md.

    python bench/engine.py                # both specs, ~2 minutes on 2 cores
    python bench/engine.py --specs tiny --concurrency 1 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.models.tiny_model import TinyModelSpec, build_tokenizer, write_tiny_model  # noqa: E402
from services.tasks.arithmetic import problem  # noqa: E402

SPECS = {
    # ~0.5M parameters: the demo/test model.
    "tiny": TinyModelSpec(),
    # ~10M parameters: big enough that the forward pass, not Python, dominates.
    "10m": TinyModelSpec(
        hidden_size=320,
        num_layers=6,
        num_heads=5,
        num_kv_heads=5,
        intermediate_size=1280,
        max_position_embeddings=512,
    ),
}


@dataclass
class Row:
    spec: str
    concurrency: int
    engine: float
    loop: float
    batched: float


def prompts(n: int) -> list[str]:
    return [problem(seed=0, index=i, digits=3).prompt for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_engine(model_dir: Path, threads: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "FLYWHEEL_ENGINE_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.engine",
            "--model",
            str(model_dir),
            "--port",
            str(port),
        ],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health_generate", timeout=30):
                return proc, url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("engine did not start")


async def engine_tps(url: str, texts: list[str], new_tokens: int) -> float:
    from services.engine_api.engine_client import EngineClient

    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
    async with EngineClient(url) as c:
        warm = {**params, "max_new_tokens": 4}
        await asyncio.gather(*(c.generate(text=t, sampling_params=warm) for t in texts))
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(c.generate(text=t, sampling_params=params, return_logprob=True) for t in texts)
        )
        dt = time.perf_counter() - t0
    tokens = sum(r[0].completion_tokens for r in results)
    assert tokens == len(texts) * new_tokens, tokens
    return tokens / dt


def hf_tps(model, tok, texts: list[str], new_tokens: int, batched: bool) -> float:
    import torch

    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        pad_token_id=tok.pad_token_id,
    )
    tok.padding_side = "left"
    groups = [texts] if batched else [[t] for t in texts]
    t0 = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for g in groups:
            enc = tok(g, return_tensors="pt", padding=True)
            out = model.generate(**enc, **kwargs)
            tokens += (out.shape[1] - enc["input_ids"].shape[1]) * len(g)
    dt = time.perf_counter() - t0
    assert tokens == len(texts) * new_tokens, tokens
    return tokens / dt


def run_spec(
    name: str, spec: TinyModelSpec, conc: list[int], new_tokens: int, threads: int, repeats: int
) -> list[Row]:
    import torch
    from transformers import AutoModelForCausalLM

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / name, spec)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        params = sum(p.numel() for p in model.parameters())
        print(
            f"# {name}: {params / 1e6:.1f}M parameters, {new_tokens} new tokens/request", flush=True
        )
        tok = build_tokenizer()
        hf_tps(model, tok, prompts(2), 4, batched=True)  # warm-up
        proc, url = start_engine(model_dir, threads)
        try:
            for c in conc:
                texts = prompts(c)
                # Best of `repeats`: on a shared box the slowest runs measure the neighbours.
                eng = max(asyncio.run(engine_tps(url, texts, new_tokens)) for _ in range(repeats))
                # The sequential loop's tokens/s does not depend on C: time min(C, 8) requests.
                loop = max(
                    hf_tps(model, tok, texts[:8], new_tokens, batched=False) for _ in range(repeats)
                )
                batched = max(
                    hf_tps(model, tok, texts, new_tokens, batched=True) for _ in range(repeats)
                )
                rows.append(Row(name, c, eng, loop, batched))
                print(
                    f"  C={c:3d} engine {eng:8.0f} tok/s  (a) loop {loop:8.0f}  "
                    f"(b) batched {batched:8.0f}  engine/(a) {eng / loop:5.2f}x  "
                    f"engine/(b) {eng / batched:5.2f}x",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(10)
    return rows


def markdown(rows: list[Row]) -> str:
    lines = [
        "| model | concurrent | engine tok/s | (a) loop tok/s | (b) batched tok/s "
        "| engine/(a) | engine/(b) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.spec} | {r.concurrency} | {r.engine:.0f} | {r.loop:.0f} | {r.batched:.0f} "
            f"| {r.engine / r.loop:.2f}x | {r.engine / r.batched:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--specs", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the engine and both baselines alike (default 1: on a shared "
        "2-core box, 2 OpenMP threads stall at every barrier when a neighbour takes a core)",
    )
    p.add_argument("--repeats", type=int, default=3, help="best of this many runs per figure")
    p.add_argument("--markdown", action="store_true")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows: list[Row] = []
    for name in args.specs:
        rows += run_spec(
            name, SPECS[name], args.concurrency, args.new_tokens, args.threads, args.repeats
        )
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
