"""LoRA training ([trainer.lora]): only the adapter trains, a version is PEFT's adapter
directory (PEFT itself loads it), checkpoints hold the adapter and its optimizer state,
resume equals never stopping, an adapted head gives the same logprobs both ways, and an
adapter directory loads as its base with the adapter merged in."""

import json

import pytest
import torch
from safetensors.torch import load_file

from services.runtime.errors import ConfigError
from services.trainer.model import load_model
from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
from services.trainer.state import latest_checkpoint, load_checkpoint, save_checkpoint, snapshot
from services.trainer.step import save_version
from services.trainer.trainer import Trainer
from services.weights import verify_weights_dir
from services.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoraSettings, read_config
from tests.integration.trainer.trainer_helpers import random_batch


def _cfg(lora: LoraSettings | None = None, **model) -> TrainConfig:
    return TrainConfig(
        optim=OptimConfig(lr=1e-2, warmup_steps=2, schedule="cosine", total_steps=6),
        # float32, padded: these tests compare with PEFT's own forward exactly
        model=ModelConfig(micro_batch_tokens=100_000, **{"precision": "fp32", **model}),
        lora=lora or LoraSettings(rank=4, alpha=8),
    )


def _ids() -> torch.Tensor:
    return torch.randint(3, 80, (3, 11), generator=torch.Generator().manual_seed(0))


def test_only_the_adapter_trains(tiny_model_dir):
    t = Trainer.from_pretrained(tiny_model_dir, _cfg())
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    trainable = {n for n, p in t.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    t.train_step(random_batch(seed=1))
    for name, p in t.model.named_parameters():
        moved = not torch.equal(p, before[name])
        # B starts at zero and A moves once B does: after one step every B has moved
        assert moved == (".lora_B" in name), name


def test_a_version_is_the_adapter_in_peft_layout_that_peft_loads(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = Trainer.from_pretrained(tiny_model_dir, _cfg())
    t.train_step(random_batch(seed=1))
    manifest = t.save_weights(tmp_path / "v1")
    assert {f.name for f in manifest.files} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert verify_weights_dir(tmp_path / "v1").sha256 == manifest.sha256
    cfg = read_config(tmp_path / "v1")
    assert (cfg.rank, cfg.alpha, cfg.base) == (4, 8.0, str(tiny_model_dir.resolve()))
    full = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert manifest.total_bytes < 0.1 * full

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "v1")  # PEFT reads our files
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=_ids()).logits, t.model(input_ids=_ids()).logits)


def test_saved_names_are_peft_s(tiny_model_dir):
    from peft import get_peft_model, get_peft_model_state_dict

    from services.trainer.lora import adapter_tensors, peft_config

    s = LoraSettings(rank=4, heads=("lm_head", "embed_tokens"))
    wrapped = get_peft_model(load_model(tiny_model_dir), peft_config(s))
    ours = adapter_tensors(wrapped.get_base_model().state_dict())
    theirs = get_peft_model_state_dict(wrapped, save_embedding_layers=False)
    assert ours.keys() == theirs.keys() and len(ours) == 4 * 7 + 4  # 2 layers x 7, 2 heads
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_the_checkpoint_holds_the_adapter_and_resume_equals_never_stopping(
    tiny_model_dir, tmp_path
):
    n, k = 4, 2
    batches = [random_batch(seed=10 + i) for i in range(n)]
    straight = Trainer.from_pretrained(tiny_model_dir, _cfg())
    want = [straight.train_step(b) for b in batches]

    first = Trainer.from_pretrained(tiny_model_dir, _cfg())
    for b in batches[:k]:
        first.train_step(b)
    first.weight_version = k
    save_version(first, tmp_path / "w" / "v2", tmp_path / "ckpt", {"seq": 41}, snapshot(first))
    state = torch.load(latest_checkpoint(tmp_path / "ckpt") / "state.pt", weights_only=True)
    assert state["model"] and all(".lora_" in name for name in state["model"])
    assert len(state["optim"]["state"]) == len(state["model"])  # Adam moments of the adapter
    del first

    torch.manual_seed(1234)  # a restart's fresh adapter differs until the checkpoint loads
    resumed = Trainer.from_pretrained(tiny_model_dir, _cfg())
    assert load_checkpoint(resumed, latest_checkpoint(tmp_path / "ckpt")) == {"seq": 41}
    got = [resumed.train_step(b) for b in batches[k:]]
    for g, w in zip(got, want[k:], strict=True):
        assert g["lr"] == w["lr"] and g["step"] == w["step"]
        assert g["loss"] == pytest.approx(w["loss"], abs=1e-6)
    ref = straight.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        torch.testing.assert_close(tensor, ref[name], atol=1e-6, rtol=0, msg=name)


def test_adapted_heads_give_the_same_logprobs_chunked_and_full(tiny_model_dir):
    lora = LoraSettings(rank=4, heads=("lm_head", "embed_tokens"))
    chunked = Trainer.from_pretrained(tiny_model_dir, _cfg(lora, logprobs="chunked"))
    full = Trainer.from_pretrained(tiny_model_dir, _cfg(lora, logprobs="full"))
    full.model.load_state_dict(chunked.model.state_dict())
    a = chunked.train_step(random_batch(seed=5))
    b = full.train_step(random_batch(seed=5))
    for key in ("loss", "grad_norm", "entropy"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    head = chunked.model.get_output_embeddings()
    assert float(head.lora_B["default"].weight.abs().sum()) > 0  # the head's adapter trained


def test_an_adapter_directory_loads_as_its_base_with_the_adapter_merged(tiny_model_dir, tmp_path):
    lora = LoraSettings(rank=4, heads=("lm_head", "embed_tokens"))
    t = Trainer.from_pretrained(tiny_model_dir, _cfg(lora))
    for i in range(2):
        t.train_step(random_batch(seed=i))
    t.save_weights(tmp_path / "v2")
    merged = load_model(tmp_path / "v2")  # flywheel eval --weights, or a run started from it
    assert not merged.config.tie_word_embeddings  # the adapted head is a matrix of its own
    with torch.no_grad():
        want, got = t.model(input_ids=_ids()).logits, merged(input_ids=_ids()).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_published_adapter_is_the_snapshot_step(tiny_model_dir, tmp_path):
    t = Trainer.from_pretrained(tiny_model_dir, _cfg())
    t.train_step(random_batch(seed=1))
    snap = snapshot(t)
    assert all(".lora_" in name for name in snap.weights)  # the frozen base is not copied
    at_1 = {n: p.detach().clone() for n, p in t.model.named_parameters() if p.requires_grad}
    t.train_step(random_batch(seed=2))
    t.save_weights(tmp_path / "v1", state_dict=snap.weights)
    saved = load_file(tmp_path / "v1" / ADAPTER_WEIGHTS)
    for live, tensor in at_1.items():
        name = "base_model.model." + live.replace(".default", "")
        assert torch.equal(saved[name], tensor), name


def test_a_module_the_model_lacks_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match=r"\[trainer.lora\]"):
        Trainer.from_pretrained(tiny_model_dir, _cfg(LoraSettings(target_modules=("c_attn",))))


def test_checkpoint_of_an_adapter_run_without_a_snapshot(tiny_model_dir, tmp_path):
    """save_checkpoint from the live trainer (what FSDP2 does, in step) holds the adapter too."""
    t = Trainer.from_pretrained(tiny_model_dir, _cfg())
    t.train_step(random_batch(seed=1))
    save_checkpoint(t, tmp_path, {"seq": 1})
    doc = json.loads((latest_checkpoint(tmp_path) / "trainer-state.json").read_text())
    assert doc["step"] == 1
    state = torch.load(latest_checkpoint(tmp_path) / "state.pt", weights_only=True)
    assert all(".lora_" in name for name in state["model"])


def test_sft_with_lora_writes_an_adapter_that_flywheel_eval_takes(tiny_model_dir, tmp_path, capsys):
    """`[sft.lora]`: the SFT run trains the adapter (its eval loss falls), output_dir is the
    adapter with its manifest, and `flywheel eval --weights <adapter>` evaluates base + it."""
    from services.stack.inspect import eval_main
    from services.tasks.arithmetic_sft import arithmetic_records
    from services.trainer.settings import SftSettings
    from services.trainer.sft.loop import run_sft

    records = [json.dumps(r) for r in arithmetic_records(600, seed=0)]
    (tmp_path / "train.jsonl").write_text("\n".join(records[:500]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(records[500:]) + "\n")
    common = dict(
        model_dir=tiny_model_dir,
        train_file=tmp_path / "train.jsonl",
        eval_file=tmp_path / "eval.jsonl",
        batch_size=16,
        progress=False,
        optim=OptimConfig(lr=1e-2, warmup_steps=2, schedule="constant"),
        model=ModelConfig(cpu_threads=1),
        lora=LoraSettings(rank=4, alpha=8, heads=("lm_head",)),
    )
    before = run_sft(SftSettings(**common, steps=1, output_dir=tmp_path / "o1"), log=lambda *_: 0)
    after = run_sft(SftSettings(**common, steps=25, output_dir=tmp_path / "out"), log=lambda *_: 0)
    assert after["eval_loss"] < before["eval_loss"] - 0.1, (before, after)

    out = tmp_path / "out"
    manifest = verify_weights_dir(out)
    assert {f.name for f in manifest.files} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert read_config(out).base == str(tiny_model_dir.resolve())

    capsys.readouterr()
    assert eval_main(["--weights", str(out), "-n", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == str(out) and doc["total"] == 4


def test_an_adapter_run_must_start_from_a_whole_model(tiny_model_dir, tmp_path):
    t = Trainer.from_pretrained(tiny_model_dir, _cfg())
    t.save_weights(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="itself a LoRA adapter"):
        Trainer.from_pretrained(tmp_path / "adapter", _cfg())
