"""Device check of the exploration losses and the adaptive entropy controller.

    DEV=cuda .venv/bin/python bench/exploration_device.py   # STEPS=40; OUT=dir for the JSON

Part 1: Clip-Cov's and KL-Cov's loss value, gradient and share on the
four-token example of tests/unit/trainer/test_exploration.py, on the CPU
and on DEV: they must agree. Part 2: the tiny model trained on DEV on the
collapsing batches of tests/integration/trainer/test_entropy_control.py
with the adaptive coefficient plus KL-Cov or Clip-Cov, in bf16 and fp32:
entropy, coefficient and covariance share of the first and last step, the
mean entropy of the last 10, seconds per step.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.models.tiny_model import TinyModelSpec, write_tiny_model
from services.trainer.core.loss import policy_loss, sample_weights, token_weights
from services.trainer.distributed import DistInfo
from services.trainer.settings import (
    LossConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from services.trainer.trainer import Trainer
from tests.integration.trainer.test_entropy_control import _collapsing_batch

DEV = torch.device(os.environ.get("DEV", "cuda"))
STEPS = int(os.environ.get("STEPS", "40"))
LOGP = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([[1.0] * 3, [-1.0] * 3])
DELTA = torch.tensor([[0.1, -0.2, 0.0], [-0.5, 0.0, 0.0]])
LOSSES = {
    "kl_cov": LossConfig(covariance="kl_cov", kl_cov_fraction=0.5, kl_cov_coef=0.5, eps_high=10),
    "clip_cov": LossConfig(covariance="clip_cov", clip_cov_band=(0.5, 3.0), clip_cov_fraction=0.5),
}
ADAPTIVE: dict[str, Any] = {"entropy_control": "adaptive", "entropy_target": 1.5,
                            "entropy_coef_lr": 0.03, "entropy_coef_max": 0.3}  # fmt: skip
RUNS = {
    "adaptive+kl_cov": {**ADAPTIVE, "covariance": "kl_cov", "kl_cov_fraction": 0.05},
    "adaptive+clip_cov": {**ADAPTIVE, "covariance": "clip_cov", "clip_cov_fraction": 0.05,
                          "clip_cov_band": (0.0, 100.0)},
}  # fmt: skip
KEYS = ("entropy", "entropy_coef", "kl_cov_frac", "clip_cov_frac", "loss")


def small_example(cfg: LossConfig, dev: str) -> tuple[float, list, dict[str, float]]:
    logp = LOGP.clone().to(dev).requires_grad_(True)
    m, a = MASK.to(dev), ADV.to(dev)
    w = token_weights(m, sample_weights(m.sum(-1), "token-mean"))
    g = torch.Generator().manual_seed(0)  # Clip-Cov's draws (one candidate here: any seed)
    out = policy_loss(logp, (LOGP - DELTA).to(dev), a, m, w, cfg, generator=g)
    out.loss.backward()
    assert logp.grad is not None
    shares = {k: float(v) for k, v in out.sums.items() if "cov" in k}
    return float(out.loss.detach()), logp.grad.cpu().tolist(), shares


def main() -> None:
    out: dict[str, Any] = {}
    for name, cfg in LOSSES.items():
        cpu, dev = small_example(cfg, "cpu"), small_example(cfg, str(DEV))
        same = abs(cpu[0] - dev[0]) < 1e-6 and torch.allclose(
            torch.tensor(cpu[1]), torch.tensor(dev[1]), atol=1e-6
        )
        out[name] = {"cpu": cpu, "dev": dev, "same": same}
        print(name, out[name], flush=True)
    model = write_tiny_model(Path("/tmp/tiny-exploration"), TinyModelSpec())
    for label, loss in RUNS.items():
        for precision in ("bf16", "fp32"):
            train = TrainConfig(
                loss=LossConfig(old_logprobs="recompute", **loss),
                optim=OptimConfig(lr=2e-3),
                model=ModelConfig(precision=precision),
            )
            trainer = Trainer.from_pretrained(model, train, DistInfo(device=DEV))
            rows, t0 = [], time.perf_counter()
            for s in range(STEPS):
                m = trainer.train_step(_collapsing_batch(s))
                rows.append({k: round(m.get(k, float("nan")), 4) for k in KEYS})
            out[f"{label} {precision}"] = got = {
                "s_per_step": round((time.perf_counter() - t0) / STEPS, 4),
                "first": rows[0],
                "last": rows[-1],
                "entropy_last10": round(sum(r["entropy"] for r in rows[-10:]) / 10, 3),
            }
            print(label, precision, got, flush=True)
    path = Path(os.environ.get("OUT", "/tmp")) / "exploration_device.json"
    path.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
