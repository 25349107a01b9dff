"""`flywheel_segments` (CPU packed-row attention) against causal sdpa run per sequence."""

import pytest
import torch

from services.trainer.attention import _segments_attention


def _packed(lengths, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = sum(lengths)
    q, k, v = (torch.randn(1, h, s, d, generator=g) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def _reference(q, k, v, cu, scale):
    """Each sequence alone through sdpa (causal), concatenated: [1, S, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qi, ki, vi = q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]
        ki, vi = ki.repeat_interleave(rep, dim=1), vi.repeat_interleave(rep, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            qi, ki, vi, is_causal=True, scale=scale
        )
        outs.append(o)
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])  # plain and grouped-query attention
def test_segments_equal_causal_attention_per_sequence_values_and_gradients(heads):
    hq, hkv = heads
    lengths = [5, 1, 9, 3]
    q, k, v, cu = _packed(lengths, hq, hkv, d=8)
    for x in (q, k, v):
        x.requires_grad_(True)
    got, _ = _segments_attention(
        torch.nn.Module(), q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=max(lengths)
    )
    want = _reference(q, k, v, cu, 0.3)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    w = torch.randn_like(want)
    g_got = torch.autograd.grad((got * w).sum(), (q, k, v))
    g_want = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_segments_under_bf16_autocast_stay_close_to_float32():
    lengths = [7, 12]
    q, k, v, cu = _packed(lengths, 4, 4, d=16, seed=1)
    kw = {"cu_seq_lens_q": cu, "max_length_q": max(lengths)}
    want, _ = _segments_attention(torch.nn.Module(), q, k, v, None, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = _segments_attention(torch.nn.Module(), q, k, v, None, **kw)
    assert got.dtype == torch.bfloat16
    assert not torch.equal(got.float(), want)  # it really ran in bf16
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


def test_segments_refuse_rows_without_boundaries():
    q, k, v, _ = _packed([4], 2, 2, d=4)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        _segments_attention(torch.nn.Module(), q, k, v, None)
