"""The single-process Trainer: exact micro-batching, weights out, resume, load errors."""

import time

import pytest
import torch

from services.trainer.model import ModelLoadError, load_model
from services.trainer.settings import LossConfig, ModelConfig, OptimConfig, TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.trainer import Trainer
from services.weights import verify_weights_dir
from tests.integration.trainer.trainer_helpers import random_batch


def _cfg(budget=100_000, **loss):
    return TrainConfig(
        loss=LossConfig(**loss),
        optim=OptimConfig(lr=1e-3, warmup_steps=2, schedule="cosine", total_steps=6),
        model=ModelConfig(micro_batch_tokens=budget, precision="fp32"),  # exactness tests
    )


def _grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "loss",
    [
        {"aggregation": "token-mean"},
        {"aggregation": "seq-mean-token-sum-norm", "policy_loss": "gspo", "eps_low": 3e-4},
        {"aggregation": "seq-mean-token-mean", "old_logprobs": "recompute", "drop_truncated": True},
    ],
)
def test_micro_batching_gives_the_full_batch_gradient(tiny_model_dir, loss):
    big = Trainer.from_pretrained(tiny_model_dir, _cfg(**loss))
    small = Trainer.from_pretrained(tiny_model_dir, _cfg(budget=12, **loss))
    batch = random_batch(seed=3)
    big_mb = big._micro_batches(big._rl_rows(batch))
    small_mb = small._micro_batches(small._rl_rows(batch))
    assert len(big_mb) == 1 and len(small_mb) >= 5
    totals = []
    for t, micro in ((big, big_mb), (small, small_mb)):
        if t.cfg.loss.old_logprobs == "recompute":
            t._fill_logprobs(micro, "old_logprobs", t.model, batch.temperature)
        total = 0.0
        for mb in micro:
            out = t._rl_loss(mb, batch.temperature)
            out.loss.backward()
            total += float(out.loss.detach())
        totals.append(total)
    assert totals[1] == pytest.approx(totals[0], abs=1e-6)
    gb, gs = _grads(big), _grads(small)
    assert sum(float(g.abs().sum()) for g in gb.values()) > 0
    for name in gb:
        torch.testing.assert_close(gs[name], gb[name], atol=1e-6, rtol=1e-5, msg=name)


def test_save_weights_is_a_loadable_verified_hf_dir(tiny_model_dir, tmp_path):
    trainer = Trainer.from_pretrained(tiny_model_dir, _cfg())
    trainer.train_step(random_batch())
    manifest = trainer.save_weights(tmp_path / "v1")
    names = {f.name for f in manifest.files}
    assert {"config.json", "model.safetensors", "generation_config.json"} <= names
    assert "tokenizer.json" in names
    assert verify_weights_dir(tmp_path / "v1").sha256 == manifest.sha256
    reloaded = load_model(tmp_path / "v1").state_dict()
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(reloaded[name], tensor), name


def test_load_errors_are_typed(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "bad")
    assert e.value.path == tmp_path / "bad"


def test_resume_equals_never_stopping(tiny_model_dir, tmp_path):
    n, k = 4, 2
    batches = [random_batch(seed=10 + i) for i in range(n)]

    straight = Trainer.from_pretrained(tiny_model_dir, _cfg())
    want = [straight.train_step(b) for b in batches]

    first = Trainer.from_pretrained(tiny_model_dir, _cfg())
    for b in batches[:k]:
        first.train_step(b)
    first.weight_version = 5
    save_checkpoint(first, tmp_path, {"stream_seq": 41})
    del first

    resumed = Trainer.from_pretrained(tiny_model_dir, _cfg())
    position = load_checkpoint(resumed, latest_checkpoint(tmp_path))
    assert position == {"stream_seq": 41}
    assert (resumed.step, resumed.weight_version) == (k, 5)
    got = [resumed.train_step(b) for b in batches[k:]]
    for g, w in zip(got, want[k:], strict=True):
        assert g["lr"] == w["lr"] and g["step"] == w["step"]
        assert abs(g["loss"] - w["loss"]) < 1e-6
    ref = straight.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=0, msg=name)


def test_snapshot_written_later_equals_a_checkpoint_written_then(tiny_model_dir, tmp_path):
    """A snapshot taken after step k, written after more steps, resumes exactly like step k.

    The trainer service writes step N's checkpoint and weights from a
    snapshot while it trains step N+1; what lands on disk must be step N.
    """
    from safetensors.torch import load_file

    from services.trainer.state import snapshot

    n, k = 4, 2
    batches = [random_batch(seed=20 + i) for i in range(n)]
    straight = Trainer.from_pretrained(tiny_model_dir, _cfg())
    want = [straight.train_step(b) for b in batches]

    live = Trainer.from_pretrained(tiny_model_dir, _cfg())
    for b in batches[:k]:
        live.train_step(b)
    live.weight_version = k
    snap = snapshot(live)
    at_k = {name: t.clone() for name, t in live.model.state_dict().items()}
    live.train_step(batches[k])  # the parameters and Adam moments move on
    save_checkpoint(live, tmp_path / "ckpt", {"seq": 7}, snap)
    live.save_weights(tmp_path / "weights", state_dict=snap.weights)

    saved = load_file(tmp_path / "weights" / "model.safetensors")
    for name, tensor in saved.items():
        torch.testing.assert_close(tensor, at_k[name], atol=0, rtol=0, msg=name)
    resumed = Trainer.from_pretrained(tiny_model_dir, _cfg())
    assert load_checkpoint(resumed, latest_checkpoint(tmp_path / "ckpt")) == {"seq": 7}
    assert (resumed.step, resumed.weight_version) == (k, k)
    got = [resumed.train_step(b) for b in batches[k:]]
    for g, w in zip(got, want[k:], strict=True):
        assert g["lr"] == w["lr"] and abs(g["loss"] - w["loss"]) < 1e-6


def test_a_step_reports_where_its_time_went(tiny_model_dir):
    """The stages bench/e2e.py --profile reads from the metrics rows, summed per step."""
    trainer = Trainer.from_pretrained(tiny_model_dir, _cfg())
    t = time.perf_counter()
    metrics = trainer.train_step(random_batch())
    wall = time.perf_counter() - t
    stages = {k: v for k, v in metrics.items() if k.startswith("time_")}
    want = {"time_prepare_s", "time_logprobs_s", "time_forward_backward_s", "time_optimizer_s"}
    assert set(stages) == want
    assert all(v >= 0 for v in stages.values()) and sum(stages.values()) <= wall
    assert stages["time_forward_backward_s"] > 0
    t = time.perf_counter()
    again = trainer.train_step(random_batch(seed=3))  # a fresh count every step
    wall = time.perf_counter() - t
    assert sum(v for k, v in again.items() if k.startswith("time_")) <= wall
