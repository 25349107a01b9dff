"""forward_backward's padded batches against each datum run alone (what the server ran
before it batched): per-datum logprobs and losses, the summed loss and the adapter's
accumulated gradients agree within 1e-5 in float32, for every built-in loss, on datums
of different lengths split over several batches. Real torch, the tiny model, PEFT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.tinker.core import (
    LOSS_INPUTS,
    SUPPORTED_LOSSES,
    Datum,
    datum_batches,
    loss_config,
)
from services.tinker.losses import elementwise

pytest.importorskip("peft", reason="the `lora` extra is not installed (pip install '.[lora]')")

LENGTHS = [5, 17, 30, 9, 23, 12]  # sorted 5 9 12 17 23 30
BUDGET = 100  # batches of lengths [5, 9, 12, 17] (4 x 17 = 68 tokens), [23, 30] (60)
TOL = 1e-5


def _data(vocab: int) -> list[Datum]:
    rng = np.random.default_rng(7)
    data = []
    for n in LENGTHS:
        inputs = {
            "target_tokens": rng.integers(0, vocab, n).astype(np.int64),
            "weights": rng.choice([0.0, 1.0, 2.0], n).astype(np.float32),
            # Sampler logprobs near the trainer's (about -log vocab), so ratios straddle
            # PPO's and CISPO's bands and some tokens clip.
            "logprobs": rng.normal(-np.log(vocab), 0.5, n).astype(np.float32),
            "advantages": rng.normal(0.0, 1.0, n).astype(np.float32),
            # GSPO's sequence ratio over about half of each datum's tokens (one at least).
            "sequence_ratio_mask": np.r_[1.0, rng.choice([0.0, 1.0], n - 1)].astype(np.float32),
        }
        data.append(Datum(tuple(int(t) for t in rng.integers(0, vocab, n)), inputs))
    return data


def _inputs_for(loss: str, d: Datum) -> Datum:
    keep = LOSS_INPUTS[loss][0] + LOSS_INPUTS[loss][1]
    return Datum(d.tokens, {k: d.inputs[k] for k in keep})


def _grads(peft: Any) -> dict[str, torch.Tensor]:
    """The accumulated gradients, taken off the parameters (the next pass starts at none)."""
    grads = {}
    for name, p in peft.named_parameters():
        if p.grad is not None:
            grads[name] = p.grad.clone()
            p.grad = None
    return grads


def _one_by_one(model: Any, loss: str, data: list[Datum], config: dict[str, float]) -> Any:
    """Each datum alone, as the server ran them before batching: [1, N], no mask."""
    model._activate("m")
    outputs, total = [], 0.0
    for d in data:
        logits = model.peft(input_ids=torch.tensor([d.tokens])).logits[0].float()  # [N, V]
        targets = torch.tensor(d.inputs["target_tokens"], dtype=torch.long)
        lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]  # [N]
        per_token = elementwise(loss, lp, d.inputs, config)
        per_token.sum().backward()
        outputs.append((lp.detach().numpy(), per_token.detach().numpy()))
        total += float(per_token.sum().detach())
    return outputs, total, _grads(model.peft)


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Any:
    from services.tinker.model import AdapterModel

    torch.manual_seed(0)
    # Any share of padding (the server's keeps it under 5%): rows padded by up to 12.
    m = AdapterModel(tiny_model, lora_alpha=32.0, batch_tokens=BUDGET, max_padding=1.0)
    m.add_adapter("m", rank=4, seed=1, attn=True, mlp=True, unembed=False)
    # LoRA starts with B = 0 (no gradient reaches A): random adapter weights give every
    # tensor a gradient to compare.
    gen = torch.Generator().manual_seed(3)
    tensors = {
        k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in m.adapter_tensors("m").items()
    }
    m.import_state("m", tensors, None, 0)
    return m


def test_the_data_runs_as_several_padded_batches() -> None:
    # Both mix lengths, so their shorter rows are padded.
    assert [[LENGTHS[i] for i in b] for b in datum_batches(LENGTHS, BUDGET, 1.0)] == [
        [5, 9, 12, 17],
        [23, 30],
    ]


@pytest.mark.parametrize("loss", SUPPORTED_LOSSES)
def test_batched_equals_one_by_one(model: Any, loss: str) -> None:
    given = {"dro": {"beta": 0.1}, "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}
    config = loss_config(loss, given.get(loss))
    data = [_inputs_for(loss, d) for d in _data(model.vocab_size)]
    ref_outputs, ref_total, ref_grads = _one_by_one(model, loss, data, config)

    outputs, metrics = model.forward_backward("m", loss, data, True, config)
    grads = _grads(model.peft)

    for i, (ref_lp, ref_loss) in enumerate(ref_outputs):
        assert outputs[i]["logprobs"].shape == (LENGTHS[i],)
        np.testing.assert_allclose(outputs[i]["logprobs"], ref_lp, rtol=0, atol=TOL)
        np.testing.assert_allclose(outputs[i]["elementwise_loss"], ref_loss, rtol=0, atol=TOL)
    assert metrics["loss:sum"] == pytest.approx(ref_total, rel=TOL, abs=TOL)
    # Gradients on the adapter's tensors only, every one of them, equal to the reference.
    assert ref_grads and set(grads) == set(ref_grads)
    assert all(".a1." in name for name in grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=TOL, atol=TOL, msg=name)
    # The loss is not trivially zero: the comparison saw real values.
    assert any(float(np.abs(o["elementwise_loss"]).max()) > 1e-3 for o in outputs)


def test_forward_only_equals_and_leaves_no_gradient(model: Any) -> None:
    data = [_inputs_for("cross_entropy", d) for d in _data(model.vocab_size)]
    ref_outputs, ref_total, _ = _one_by_one(model, "cross_entropy", data, {})
    outputs, metrics = model.forward_backward("m", "cross_entropy", data, False, {})
    assert _grads(model.peft) == {}
    for i, (ref_lp, _) in enumerate(ref_outputs):
        np.testing.assert_allclose(outputs[i]["logprobs"], ref_lp, rtol=0, atol=TOL)
    assert metrics["loss:sum"] == pytest.approx(ref_total, rel=TOL, abs=TOL)
