"""A tiny causal LM and its tokenizer, built offline.

The demo and the tests need a real Hugging Face model directory without
touching a hub. This writes one from a config with random weights and a
tokenizer built with the `tokenizers` library (saved so
`AutoTokenizer.from_pretrained` loads it). It takes the same code path as a
7B model: config.json + safetensors + tokenizer files + chat template.

Two tokenizers: the demo's character-level one (one token per printable
character, a chat template that adds nothing, so "12+34=" is completed by
"46<eos>"), and for any other task a byte-level BPE trained on the task's
own text (`build_bpe_tokenizer`) with a ChatML template, as Qwen's.

Measured on a 2-core CPU: hidden 128, 2 layers, 4 heads (~0.5M parameters)
learns 2-digit addition.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAD = "<pad>"
EOS = "<eos>"
UNK = "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)

# Every printable ASCII character is one token; nothing else is needed by the
# built-in tasks, and anything else maps to <unk>.
CHARS = tuple(dict.fromkeys(string.digits + string.ascii_letters + string.punctuation + " \n"))

# User turns are emitted verbatim and the assistant turn ends with EOS: the
# arithmetic prompt "12+34=" is completed by "46<eos>".
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Qwen2 model (defaults: ~0.53M parameters)."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    seed: int = 0


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast
    """The character-level fast tokenizer (one token per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BPE_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 1024):  # -> PreTrainedTokenizerFast
    """A byte-level BPE trained on `texts` (any byte sequence encodes), with ChatML.

    `<|im_end|>` ends an assistant turn and is the EOS; `<|endoftext|>` pads.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(BPE_SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def write_tiny_model(
    out_dir: str | Path, spec: TinyModelSpec | None = None, tokenizer: Any = None
) -> Path:
    """Write a randomly initialised tiny Qwen2 model directory to `out_dir`
    (with `tokenizer`, default the character-level one)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
