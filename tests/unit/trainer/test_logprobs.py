"""Chunked logprobs/entropy: the same values and gradients as materialised logits."""

import pytest
import torch

from services.trainer.core.logprobs import (
    chunk_rows,
    chunked_token_stats,
    token_entropy,
    token_logprobs,
)


def _problem(seed: int, n: int = 37, h: int = 16, v: int = 50, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 2).requires_grad_()
    b = torch.randn(v, generator=g, dtype=torch.float64).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets, g


def _grads(*tensors):
    out = [t.grad.clone() for t in tensors if t is not None]
    for t in tensors:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("rows", [1, 5, 37, 1000])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_equals_full_logits_in_float64(temperature, rows, entropy_grad):
    hidden, weight, bias, targets, g = _problem(rows)
    a = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)
    c = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64)

    def loss(lp, ent):
        return (a * lp).sum() + (c * (ent if entropy_grad else ent.detach())).sum()

    lp, ent = chunked_token_stats(
        hidden, weight, targets, temperature, bias=bias, entropy=True, rows=rows
    )
    loss(lp, ent).backward()
    got = _grads(hidden, weight, bias)
    logits = (hidden @ weight.t() + bias)[None]  # today's path: [1, N, V] materialised
    want_lp = token_logprobs(logits, targets[None], temperature)[0]
    want_ent = token_entropy(logits, temperature)[0]
    loss(want_lp, want_ent).backward()
    want = _grads(hidden, weight, bias)
    torch.testing.assert_close(lp, want_lp, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-10, rtol=0)
    assert sum(float(w.abs().sum()) for w in want) > 0
    for x, y in zip(got, want, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)


def test_entropy_is_not_computed_or_differentiated_unless_asked():
    hidden, weight, _, targets, _ = _problem(0, bias=False)
    lp, ent = chunked_token_stats(hidden, weight, targets, rows=8)
    assert ent is None
    lp.sum().backward()
    got = _grads(hidden, weight)
    lp2, _ = chunked_token_stats(hidden, weight, targets, rows=8, entropy=True)
    lp2.sum().backward()  # the entropy output unused: its gradient is no work and no change
    for x, y in zip(got, _grads(hidden, weight), strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)


def _llm_like_rows(n: int, v: int, seed: int) -> torch.Tensor:
    """Peaked rows of large float32 logits, like a trained LLM's (one token near certain)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3 + 30
    top = torch.randint(0, v, (n,), generator=g)
    logits[torch.arange(n), top] += torch.rand(n, generator=g) * 20 + 15
    return logits


def test_entropy_never_negative_on_large_logit_rows():
    logits = _llm_like_rows(2000, 4096, seed=0)  # float32
    # Today's formula, lse - sum(p · z), subtracts two numbers of the size of the logits.
    z = logits
    lse = torch.logsumexp(z, -1, keepdim=True)
    textbook = lse.squeeze(-1) - (torch.exp(z - lse) * z).sum(-1)
    assert (textbook < 0).any()  # the defect this guards against is real at this scale
    full = token_entropy(logits[None])[0]
    identity = torch.eye(4096)  # logits @ I.T = logits, exactly
    _, chunked = chunked_token_stats(
        logits, identity, torch.zeros(2000, dtype=torch.long), entropy=True, rows=128
    )
    exact = token_entropy(logits.double()[None])[0]
    for ent in (full, chunked):
        assert ent is not None and bool((ent >= 0).all())
        assert float((ent.double() - exact).abs().max()) < 1e-5


def test_chunk_rows_and_errors():
    assert chunk_rows(151_936, 256) == 441
    assert chunk_rows(10**9, 1) == 1
    hidden, weight, _, targets, _ = _problem(0, bias=False)
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_stats(hidden, weight, targets, 0.0)
    with pytest.raises(ValueError, match="rows"):
        chunked_token_stats(hidden, weight, targets, rows=0)


def test_bf16_compute_keeps_float32_statistics_and_master_grads():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=g).requires_grad_()
    weight = torch.randn(300, 32, generator=g).requires_grad_()
    targets = torch.randint(0, 300, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = chunked_token_stats(hidden, weight, targets, entropy=True, rows=16)
    assert lp.dtype == torch.float32 and ent is not None and ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and hidden.grad.dtype == torch.float32
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    logits = (hidden.bfloat16() @ weight.bfloat16().t()).float()[None]
    torch.testing.assert_close(lp, token_logprobs(logits, targets[None])[0], atol=1e-4, rtol=0)
