"""tinker-cookbook 0.6.1's own loops, unchanged, against `flywheel tinker`.

The example scripts (configs/examples/cookbook/sl.py and rl.py) run as a user runs them,
in a subprocess from the repository root, against a server subprocess:
`tinker_cookbook.supervised.train` on a local JSONL and `tinker_cookbook.rl.train` on
the review task, the tokenizer loaded from the model directory (HF_HUB_OFFLINE=1: no
hub) and a renderer the cookbook ships. On the tiny model (`role_colon`: its character
tokenizer has no ChatML tokens) a few steps each; on SmolLM2-135M-Instruct
(`qwen3_instruct`, ChatML) the RL recipe's reward rises (`long`; bench/results_tinker.md
has the recorded run).

Both loops end with the cookbook's final checkpoint, `save_state` then
`save_weights_for_sampler`: a run must exit 0 with both paths in its checkpoints.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.models.gguf_import import models_dir
from tests.integration.tinker.conftest import serving

pytest.importorskip(
    "tinker_cookbook",
    reason="tinker-cookbook is not installed (docs/tinker.md, section tinker-cookbook)",
)

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "configs" / "examples" / "cookbook"


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # one thread: the tiny model's matmuls are too small for a thread team (conftest.py)
    with serving(tiny_model, tmp_path_factory.mktemp("cookbook")) as (url, _, _):
        yield url


def _run(script: str, base_url: str, model: Path, log_path: Path, *args: str,
         timeout: float) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """The example as a user runs it: from the repo root, which is importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "TINKER_API_KEY": "tml-flywheel-test", "TINKER_TELEMETRY": "0"}  # fmt: skip
    cmd = [sys.executable, str(EXAMPLES / script), "--model", str(model),
           "--base-url", base_url, "--log-path", str(log_path), *args]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def _finished(proc: subprocess.CompletedProcess[str], log_path: Path) -> None:
    """The run ended well: exit 0, its final checkpoint (state and sampler) written."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = [json.loads(x) for x in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert final[-1]["name"] == "final", final
    assert final[-1]["state_path"].startswith("tinker://"), final
    assert final[-1]["sampler_path"].startswith("tinker://"), final


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_cookbook_sl_loop_lowers_the_nll_on_the_tiny_model(
    tiny_server: str, tiny_model: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "sl"
    proc = _run("sl.py", tiny_server, tiny_model, log_path, "--renderer", "role_colon",
                "--max-steps", "5", timeout=120)  # fmt: skip
    _finished(proc, log_path)
    rows = [r for r in _metrics(log_path) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == list(range(5))
    # 4 chats a step, every token of the answers trained, through the server's optim_step
    assert all(r["num_sequences"] == 4 and r["num_loss_tokens"] > 0 for r in rows), rows
    assert all(r["grad_norm:mean"] > 0 for r in rows), rows
    nll = [r["train_mean_nll"] for r in rows]
    assert nll[-1] < nll[0], nll  # lr 5e-4 on the same 8 chats: the NLL falls every epoch


def test_cookbook_rl_loop_runs_its_steps_on_the_tiny_model(
    tiny_server: str, tiny_model: Path, tmp_path: Path
) -> None:
    log_path = tmp_path / "rl"
    proc = _run("rl.py", tiny_server, tiny_model, log_path, "--renderer", "role_colon",
                "--steps", "3", "--batch-size", "2", "--group-size", "4", "--max-tokens", "8",
                timeout=120)  # fmt: skip
    _finished(proc, log_path)
    rows = [r for r in _metrics(log_path) if "env/all/reward/total" in r]
    assert [r["step"] for r in rows] == [0, 1, 2], rows
    for r in rows:
        # 2 groups of 4 replies sampled by the server (at most 8 tokens each), then trained
        assert 0 < r["tokens/sampled"] <= 2 * 4 * 8, r
        assert r["tokens/trained"] > r["tokens/sampled"], r
        assert 0.0 <= r["env/all/reward/total"] <= 1.0, r


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(1500)
def test_cookbook_rl_reward_rises_on_smollm2(tmp_path: Path) -> None:
    model = models_dir() / "SmolLM2-135M-Instruct"
    assert (model / "config.json").exists(), f"{model}: run `make smollm2` first"
    with serving(model, tmp_path) as (url, _, _):  # one thread: docs/tinker.md
        log_path = tmp_path / "rl"
        proc = _run("rl.py", url, model, log_path, "--steps", "12", timeout=1200)
    _finished(proc, log_path)
    rewards = [r["env/all/reward/total"] for r in _metrics(log_path) if "env/all/reward/total" in r]
    print("reward per step:", rewards)
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last >= first + 0.15, rewards
