"""The CPU engine hands its KV cache to the model by the name the installed transformers
takes (`cache` since the rename; `past_key_values` warns there and goes in 5.40).

A cache passed by a name the forward does not read would be dropped silently (the forward
takes **kwargs): decode would then see one token with no context. So the test compares a
prefill + decode against one forward over the whole sequence, and turns every warning
into an error.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from services.engine.runner import ModelRunner, cache_kwarg


def test_decode_with_the_cache_equals_a_full_forward_and_warns_nothing(tiny_model: Path) -> None:
    runner = ModelRunner(tiny_model, num_threads=1, weights_check="sizes")
    prompt, nxt = [5, 9, 3, 7, 2], 11
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the deprecation is a FutureWarning
        _, kv = runner.prefill([prompt])
        logits = runner.decode(kv, torch.tensor([nxt]))  # [1, V]
    with torch.inference_mode():
        full = runner.model(input_ids=torch.tensor([[*prompt, nxt]]), use_cache=False).logits
    torch.testing.assert_close(logits, full[:, -1, :].float(), rtol=1e-4, atol=1e-4)


def test_the_name_is_read_from_the_forward() -> None:
    class Old:
        def forward(self, input_ids: object = None, past_key_values: object = None) -> None: ...

    class New:
        def forward(self, input_ids: object = None, cache: object = None) -> None: ...

    assert cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(New()) == "cache"
