"""The Tinker server's forward_backward, datum by datum against padded batches, on a real
model: seconds of one request of the cookbook RL recipe's shape, both paths timed
alternately in one run. bench/results_tinker.md records a run.

The request: `--datums` datums (default 16: 4 prompts x 4 replies, as
configs/examples/cookbook/rl.py steps) of `--min-len`..`--max-len` tokens (60-80: a
review prompt and a reply of at most 16 tokens), `importance_sampling` with advantages
on each datum's last 16 tokens, on a LoRA adapter of rank 8 on attention, MLP and the
unembedding (the SDK's defaults, as the cookbook asks). Float32, `--threads` torch
threads (1, as `flywheel up` runs the server).

- one-by-one: `batch_tokens` 1, so every datum runs alone as a [1, N] forward and
  backward without a mask: the computation the server ran before it batched.
- batched: `batch_tokens` `--batch-tokens` (the setting's default, 4096): the datums
  as right-padded batches of similar lengths (at most `--max-padding` of a batch's
  tokens padding, core.MAX_PADDING by default; services/tinker/model.py).

Each round times one forward_backward of each (their order alternating round by round;
gradients zeroed between, untimed) after one untimed warm-up of each; it prints each
round, the medians and their ratio, the largest difference of the two paths' logprobs
and gradients, and the load average before and after.

    PYTHONPATH=$PWD .venv/bin/python bench/tinker_forward_backward.py [--model DIR] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_MODEL = Path.home() / ".cache/flywheel/models/SmolLM2-135M-Instruct"
REPLY = 16  # tokens of a datum that carry an advantage (the reply; the prompt's are 0)


def _data(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[Any]:
    from services.tinker.core import Datum

    rng = np.random.default_rng(seed)
    data = []
    for length in rng.integers(lo, hi + 1, n):
        adv = np.zeros(length, np.float32)
        adv[-REPLY:] = rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.0)
        inputs = {
            "target_tokens": rng.integers(0, vocab, length).astype(np.int64),
            "logprobs": rng.normal(-3.0, 1.0, length).astype(np.float32),
            "advantages": adv,
        }
        data.append(Datum(tuple(int(t) for t in rng.integers(0, vocab, length)), inputs))
    return data


def _pass(model: Any, data: list[Any], budget: int) -> tuple[float, Any, dict[str, Any]]:
    """One forward_backward under `budget`: its seconds, outputs, and the gradients (taken
    off the adapter, untimed, so the next pass starts from none)."""
    model.batch_tokens = budget
    t0 = time.perf_counter()
    outputs, _ = model.forward_backward("m", "importance_sampling", data, True, {})
    seconds = time.perf_counter() - t0
    grads = {}
    for name, p in model.peft.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
            p.grad = None
    return seconds, outputs, grads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--datums", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=60)
    ap.add_argument("--max-len", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-padding", type=float, default=None, help="default: core's")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from services.tinker.core import MAX_PADDING, datum_batches
    from services.tinker.model import AdapterModel

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    share = MAX_PADDING if args.max_padding is None else args.max_padding
    model = AdapterModel(args.model, lora_alpha=32.0, seed=args.seed, max_padding=share)
    model.add_adapter("m", args.rank, args.seed, attn=True, mlp=True, unembed=True)
    # LoRA's B starts at 0; random weights make the adapter (and every gradient) non-zero.
    gen = torch.Generator().manual_seed(args.seed)
    model.import_state("m", {k: 0.01 * torch.randn(v.shape, generator=gen)
                             for k, v in model.adapter_tensors("m").items()}, None, 0)  # fmt: skip
    data = _data(model.vocab_size, args.datums, args.min_len, args.max_len, args.seed)
    lengths = [len(d.tokens) for d in data]
    plan = datum_batches(lengths, args.batch_tokens, share)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in plan)
    print(f"model {args.model.name}, vocab {model.vocab_size}, {args.datums} datums of "
          f"{min(lengths)}-{max(lengths)} tokens ({sum(lengths)} in all), rank {args.rank}, "
          f"{torch.get_num_threads()} torch thread(s); batched: {len(plan)} batch(es) "
          f"{[len(b) for b in plan]} of <= {args.batch_tokens} padded tokens, {padded} "
          f"padded tokens in all (max_padding {share})")  # fmt: skip

    paths = {"one-by-one": 1, "batched": args.batch_tokens}
    warm = {name: _pass(model, data, budget) for name, budget in paths.items()}
    print("warm-up s: " + ", ".join(f"{k} {v[0]:.3f}" for k, v in warm.items()))
    (_, lp1, g1), (_, lp2, g2) = warm["one-by-one"], warm["batched"]
    pairs = zip(lp1, lp2, strict=True)
    lp_diff = max(float(np.abs(a["logprobs"] - b["logprobs"]).max()) for a, b in pairs)
    g_diff = max(float((g1[k] - g2[k]).abs().max()) for k in g1)
    g_scale = max(float(g.abs().max()) for g in g1.values())
    print(f"largest |difference|: logprobs {lp_diff:.2e}, gradients {g_diff:.2e} "
          f"(largest gradient {g_scale:.2e})")  # fmt: skip

    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.rounds):
        order = list(paths) if r % 2 == 0 else list(reversed(paths))
        for name in order:
            seconds[name].append(_pass(model, data, paths[name])[0])
        print(f"round {r + 1}: " + ", ".join(f"{n} {seconds[n][-1]:.3f} s" for n in order))
    med = {name: statistics.median(s) for name, s in seconds.items()}
    for name, s in seconds.items():
        print(f"{name}: median {med[name]:.3f} s, min {min(s):.3f}, max {max(s):.3f}")
    print(f"batched / one-by-one, medians: {med['batched'] / med['one-by-one']:.2f}x")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
