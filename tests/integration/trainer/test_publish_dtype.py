"""Weights go out in the dtype they came in: a bf16 model trains on float32 masters and is
published as bf16 (half the bytes to write, hash, send and load; bf16 deltas)."""

import json

import torch
from safetensors.torch import load_file

from services.trainer.settings import OptimConfig, TrainConfig
from services.trainer.trainer import Trainer
from tests.integration.trainer.trainer_helpers import random_batch


def _bf16_copy(src, dst):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


def test_a_bf16_model_trains_in_float32_and_is_published_as_bf16(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    src = _bf16_copy(tiny_model_dir, tmp_path / "bf16-model")
    trainer = Trainer.from_pretrained(src, TrainConfig(optim=OptimConfig(lr=1e-2)))
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    trainer.train_step(random_batch(seed=3))
    trainer.save_weights(tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    masters = dict(trainer.model.named_parameters())
    assert written and all(t.dtype == torch.bfloat16 for t in written.values())
    for name, t in written.items():
        assert torch.equal(t, masters[name].detach().to(torch.bfloat16)), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    # Loadable as it is, tied head included (what an engine does with it).
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(back.lm_head.weight, back.model.embed_tokens.weight)


def test_a_float32_model_is_published_bit_for_bit_as_it_trains(tiny_model_dir, tmp_path):
    trainer = Trainer.from_pretrained(tiny_model_dir, TrainConfig(optim=OptimConfig(lr=1e-2)))
    trainer.train_step(random_batch(seed=3))
    trainer.save_weights(tmp_path / "out")
    written = load_file(tmp_path / "out" / "model.safetensors")
    masters = dict(trainer.model.named_parameters())
    for name, t in written.items():
        assert t.dtype == torch.float32 and torch.equal(t, masters[name].detach()), name
