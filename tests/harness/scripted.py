"""A tiny model taught a few scripts, so a test can rely on what it generates.

Multi-turn tests need a policy that calls tools: a random tiny model never
writes `<calc>…</calc>`. This trains the character-level tiny model (real
torch, a few hundred steps, seconds on a CPU) until greedy decoding of each
script's prompt reproduces the script: the test then drives a real engine
on a real model whose behaviour it knows, and checks what the engine said.
"""

from __future__ import annotations

from pathlib import Path


def write_scripted_model(
    out: Path, scripts: list[tuple[str, str]], steps: int = 600, lr: float = 3e-3
) -> Path:
    """A tiny model that completes each `prompt` with its `script` (+ EOS).

    Trained to a mean token loss below 1e-3, so even sampled at temperature
    0.8 a script of ~100 tokens comes out unchanged nearly always. One
    torch thread: on a loaded 2-core machine more threads are slower.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from services.models.tiny_model import TinyModelSpec, build_tokenizer, write_tiny_model

    write_tiny_model(out, TinyModelSpec())
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    rows = []
    for prompt, script in scripts:
        p = tok.encode(prompt)
        ids = p + tok.encode(script) + [tok.eos_token_id]
        labels = [-100] * len(p) + ids[len(p) :]
        rows.append((ids, labels))
    width = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id
    x = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    y = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attn = (torch.arange(width)[None, :] < torch.tensor([len(i) for i, _ in rows])[:, None]).long()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = model(input_ids=x, attention_mask=attn, labels=y).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if loss.item() < 1e-3:
                break
    finally:
        torch.set_num_threads(threads)
    if loss.item() >= 1e-3:
        raise RuntimeError(f"the scripts were not learnt: loss {loss.item():.4f}")
    model.save_pretrained(out, safe_serialization=True)
    return out
