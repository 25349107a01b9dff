"""FSDP2 under torchrun (2 ranks, gloo, CPU) equals one process on the same batch;
checkpoints cross between the two (DCP written by two ranks, the one-file one by one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.trainer import Trainer
from services.weights import verify_weights_dir
from tests.harness import REPO
from tests.integration.trainer.trainer_helpers import random_batch

CFG = TrainConfig(
    loss=LossConfig(
        old_logprobs="recompute",
        kl_coef=0.05,
        entropy_coef=0.01,
        aggregation="seq-mean-token-mean",
        eps_high=0.28,
    ),
    # Adam's first step is lr · g / (|g| + eps): with the default eps = 1e-8 an element
    # whose gradient is ~1e-8 moves by a fraction of lr that float summation order
    # (two half-batches reduced vs one batch) decides; eps = 1e-6 keeps the comparison
    # about the sharding, not about rounding in the 8th digit.
    optim=OptimConfig(lr=1e-3, grad_clip=1.0, eps=1e-6),
    model=ModelConfig(micro_batch_tokens=24, precision="fp32"),  # exactness; bf16 apart
)


def _torchrun(model_dir, jobs: list[dict]) -> None:
    """The jobs (fsdp_worker.py) in one torchrun: two ranks starting torch once for all."""
    spec = Path(jobs[0]["out"]).parent / "jobs.json"
    spec.write_text(json.dumps(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",  # the worker as a module of the tests package, from the repository root
        "tests.integration.trainer.fsdp_worker",
        str(model_dir),
        str(spec),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _bf16(cfg: TrainConfig) -> TrainConfig:
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"precision": "bf16"})})


def _lora(cfg: TrainConfig) -> TrainConfig:
    from services.weights.adapter import LoraSettings

    return cfg.model_copy(update={"lora": LoraSettings(rank=4, alpha=8, heads=("lm_head",))})


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """Every test's two-rank run, by name: one torchrun for the module (each test's own
    launch cost ~15 CPU s, most of it torch starting in three processes)."""
    root = tmp_path_factory.mktemp("fsdp")
    # the one-process checkpoint the "resume" run starts from (its test checks it)
    single = Trainer.from_pretrained(tiny_model_dir, CFG)
    single.train_step(random_batch(seed=1))
    save_checkpoint(single, root / "one", {"seq": 3})
    cfgs = {"fp32": (CFG, None), "bf16": (_bf16(CFG), None), "resume": (CFG, root / "one"),
            "lora": (_lora(CFG), None)}  # fmt: skip
    outs = {name: root / name for name in cfgs}
    for out in outs.values():
        out.mkdir()
    jobs = [{"out": str(outs[n]), "cfg": c.model_dump_json(), "resume": r and str(r)}
            for n, (c, r) in cfgs.items()]  # fmt: skip
    _torchrun(tiny_model_dir, jobs)
    return {**outs, "one": root / "one"}


@pytest.mark.slow  # torchrun: two ranks, each importing torch
def test_two_rank_fsdp_matches_single_process(tiny_model_dir, runs):
    tmp_path = runs["fp32"]

    single = Trainer.from_pretrained(tiny_model_dir, CFG)
    want = single.train_step(random_batch(seed=1))
    got = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("loss", "pg_loss", "kl_loss", "entropy", "tokens", "grad_norm", "ratio_max"):
        assert abs(got[key] - want[key]) < 1e-5, (key, got[key], want[key])

    verify_weights_dir(tmp_path / "weights")
    fsdp_weights = load_file(tmp_path / "weights" / "model.safetensors")
    ref = single.model.state_dict()
    assert set(fsdp_weights) <= set(ref) and len(fsdp_weights) > 10
    for name, tensor in fsdp_weights.items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=name)
    moved = max(
        float((ref[n] - t).abs().max())
        for n, t in load_file(tiny_model_dir / "model.safetensors").items()
    )
    assert moved > 1e-4  # the step really changed the weights

    # The 2-rank DCP checkpoint loads into one process (resharding) with the same weights.
    resumed = Trainer.from_pretrained(tiny_model_dir, CFG)
    pos = load_checkpoint(resumed, latest_checkpoint(tmp_path / "ckpt"))
    assert pos == {"seq": 7} and resumed.step == 1
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow  # torchrun: two ranks, each importing torch
def test_two_rank_fsdp_in_bf16_matches_single_process_bf16(tiny_model_dir, runs):
    """bf16 compute with float32 master weights under FSDP2 (gloo) as in one process.

    FSDP2's MixedPrecisionPolicy casts every parameter to bf16, autocast only
    each matmul's inputs, so the two agree to bf16 rounding, not to 1e-5.
    """
    cfg, tmp_path = _bf16(CFG), runs["bf16"]
    single = Trainer.from_pretrained(tiny_model_dir, cfg)
    want = single.train_step(random_batch(seed=1))
    got = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("loss", "pg_loss", "kl_loss", "entropy", "tokens"):
        assert got[key] == pytest.approx(want[key], rel=2e-2, abs=2e-3), key
    fsdp_weights = load_file(tmp_path / "weights" / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in fsdp_weights.values())  # the master copy
    ref = single.model.state_dict()
    start = load_file(tiny_model_dir / "model.safetensors")
    names = [n for n in fsdp_weights if n in start]  # lm_head.weight: tied to the embedding
    # bf16 rounding flips the sign of some near-zero gradients (Adam's first step moves
    # each element by about ±lr either way; k_proj.bias's gradient is pure rounding,
    # softmax ignores it): compare the update as a whole, not element by element.
    diff = sum(float((fsdp_weights[n] - ref[n]).abs().sum()) for n in names)
    step = sum(float((ref[n] - start[n]).abs().sum()) for n in names)
    assert step > 0 and diff < 0.1 * step, (diff, step)


@pytest.mark.slow  # torchrun: two ranks, each importing torch
def test_a_one_process_checkpoint_resumes_under_two_rank_fsdp(tiny_model_dir, runs):
    """One process writes one file (the full state); two FSDP2 ranks resume from it.

    Each rank keeps its shards of the full model and AdamW state, so the next
    step equals the one process's next step; the two ranks' own checkpoint is DCP.
    """
    tmp_path = runs["resume"]
    single = Trainer.from_pretrained(tiny_model_dir, CFG)  # the step `runs` saved in "one"
    single.train_step(random_batch(seed=1))
    assert (latest_checkpoint(runs["one"]) / "state.pt").is_file()

    want = single.train_step(random_batch(seed=1))
    got = json.loads((tmp_path / "metrics.json").read_text())
    assert got["step"] == want["step"] == 2
    for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
        assert abs(got[key] - want[key]) < 1e-5, (key, got[key], want[key])
    ref = single.model.state_dict()
    for name, tensor in load_file(tmp_path / "weights" / "model.safetensors").items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=name)
    assert (latest_checkpoint(tmp_path / "ckpt") / "state").is_dir()  # FSDP2 keeps DCP


@pytest.mark.slow  # torchrun: two ranks, each importing torch
def test_two_rank_fsdp_trains_a_lora_adapter_as_one_process(tiny_model_dir, runs):
    """[trainer.lora] under FSDP2: the same step as one process, the version gathered on
    rank 0 is the adapter alone, and the two ranks' DCP checkpoint (adapter and its AdamW
    state) resumes in one process."""
    from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    cfg, tmp_path = _lora(CFG), runs["lora"]
    single = Trainer.from_pretrained(tiny_model_dir, cfg)
    want = single.train_step(random_batch(seed=1))
    got = json.loads((tmp_path / "metrics.json").read_text())
    for key in ("loss", "pg_loss", "kl_loss", "grad_norm"):
        assert abs(got[key] - want[key]) < 1e-5, (key, got[key], want[key])

    manifest = verify_weights_dir(tmp_path / "weights")
    assert {f.name for f in manifest.files} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    saved = load_file(tmp_path / "weights" / ADAPTER_WEIGHTS)
    ref = single.model.state_dict()
    assert len(saved) == 4 * 7 + 2  # 2 layers x 7 modules x (A, B), the head's A and B
    for name, tensor in saved.items():
        live = name.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        torch.testing.assert_close(tensor, ref[live], atol=1e-5, rtol=0, msg=name)

    resumed = Trainer.from_pretrained(tiny_model_dir, cfg)
    assert load_checkpoint(resumed, latest_checkpoint(tmp_path / "ckpt")) == {"seq": 7}
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-5, rtol=0, msg=name)
