"""The pure delta codec: bit-identical rebuilds, cheapest encodings, malformed input refused."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save

from services.weights.delta import (
    DeltaError,
    apply,
    encode,
    safetensors_layout,
    unpack,
)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layer.0.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "norm.weight": torch.ones(32, dtype=torch.float32),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def adam_like(t: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """Change about `frac` of each tensor's elements (as a small optimizer step would)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in t.items():
        mask = torch.rand(v.shape, generator=g) < frac
        if v.is_floating_point():
            out[k] = torch.where(mask, v + 0.5, v).to(v.dtype)
        else:
            out[k] = torch.where(mask, v + 1, v)
    return out


MANIFEST = json.dumps({"files": [{"name": "config.json"}, {"name": "model.safetensors"}]})


def files(t: dict[str, torch.Tensor], config: str = '{"a": 1}') -> dict[str, bytes]:
    return {"model.safetensors": save(t), "config.json": config.encode()}


def roundtrip(base: dict[str, bytes], new: dict[str, bytes]) -> tuple[dict[str, bytes], float]:
    packed, stats = encode(
        base, new, version=2, base_version=1, base_sha256="b" * 64, manifest=MANIFEST
    )
    delta = unpack(packed)
    assert (delta.version, delta.base_version, delta.base_sha256) == (2, 1, "b" * 64)
    return apply(base, delta), stats.ratio


@pytest.mark.parametrize("frac", [0.0, 0.001, 0.01, 0.2, 1.0])
def test_rebuild_is_bit_identical(frac: float) -> None:
    base_t = tensors(0)
    base, new = files(base_t), files(adam_like(base_t, frac, 1))
    got, ratio = roundtrip(base, new)
    assert got == new
    if frac <= 0.01:
        assert ratio < 0.1  # sparse: indices + values, far below the full size


def test_nan_and_signed_zero_travel_bit_exactly() -> None:
    base_t = tensors(0)
    new_t = dict(base_t)
    w = base_t["layer.0.weight"].clone()
    w[0, 0], w[1, 1], w[2, 2] = float("nan"), -0.0, float("inf")
    new_t["layer.0.weight"] = w
    base, new = files(base_t), files(new_t)
    got, _ = roundtrip(base, new)
    assert got == new


def test_a_changed_layout_or_other_file_travels_whole() -> None:
    base_t = tensors(0)
    grown = dict(base_t, extra=torch.zeros(3))
    base, new = files(base_t), files(grown, config='{"a": 2}')
    packed, stats = encode(
        base, new, version=2, base_version=1, base_sha256="b" * 64, manifest=MANIFEST
    )
    delta = unpack(packed)
    assert {f.name for f in delta.files if f.whole is not None} == set(new)
    assert apply(base, delta) == new
    assert stats.elements == 0  # nothing was compared element by element


def test_sparse_changes_travel_sparse() -> None:
    base_t = tensors(0)
    base = files(base_t)

    def modes(frac: float) -> set[str]:
        new = files(adam_like(base_t, frac, 1))
        packed, _ = encode(
            base, new, version=2, base_version=1, base_sha256="b" * 64, manifest=MANIFEST
        )
        return {t.mode for f in unpack(packed).files for t in f.tensors}

    assert modes(0.001) == {"sparse32"}


def test_a_tensor_of_new_random_bits_goes_whole() -> None:
    base_t = tensors(0)
    noise = bytearray(random.Random(5).randbytes(base_t["embed.weight"].numel() * 2))
    new_t = dict(base_t)
    new_t["embed.weight"] = torch.frombuffer(noise, dtype=torch.bfloat16).reshape(64, 32)
    base, new = files(base_t), files(new_t)
    packed, _ = encode(
        base, new, version=2, base_version=1, base_sha256="b" * 64, manifest=MANIFEST
    )
    patches = {t.name: t.mode for f in unpack(packed).files for t in f.tensors}
    assert patches == {"embed.weight": "whole"}
    assert apply(base, unpack(packed)) == new


def test_unchanged_files_are_left_out() -> None:
    base = files(tensors(0))
    packed, stats = encode(
        base, dict(base), version=2, base_version=1, base_sha256="b" * 64, manifest=MANIFEST
    )
    assert unpack(packed).files == ()
    assert stats.changed == 0 and stats.delta_bytes < 1000


def test_malformed_deltas_are_refused() -> None:
    base_t = tensors(0)
    base, new = files(base_t), files(adam_like(base_t, 0.01, 1))
    packed, _ = encode(
        base, new, version=2, base_version=1, base_sha256="b" * 64, manifest=MANIFEST
    )
    with pytest.raises(DeltaError):
        unpack(packed[: len(packed) // 2])
    with pytest.raises(DeltaError):
        unpack(b"\x93\x01\x02\x03")
    # a base without the file a patch needs
    with pytest.raises(DeltaError, match="neither"):
        apply({"config.json": b"{}"}, unpack(packed))
    # a base whose file is not safetensors
    with pytest.raises(DeltaError, match="not safetensors"):
        apply({"config.json": b"{}", "model.safetensors": b"junk"}, unpack(packed))


def test_layout_refuses_non_safetensors() -> None:
    assert safetensors_layout(b"") is None
    assert safetensors_layout(b"\xff" * 16) is None
    assert safetensors_layout((4).to_bytes(8, "little") + b"[1] ") is None
    assert safetensors_layout(save(tensors(0))) is not None


def test_a_patch_with_bad_positions_or_values_is_refused() -> None:
    import zlib

    from services.weights.delta import FilePatch, TensorPatch, apply_file

    base = save(tensors(0))

    def patch(index: bytes, values: bytes) -> FilePatch:
        return FilePatch("m", tensors=(TensorPatch("norm.weight", "sparse32", index, values),))

    one = zlib.compress(b"\x01\x00\x00\x00")  # one gap of 1 (u32, by byte plane)
    with pytest.raises(DeltaError):
        apply_file(base, patch(b"not zlib", zlib.compress(b"\x01\x00\x00\x00")))
    with pytest.raises(DeltaError, match="past"):  # a gap beyond the tensor's 32 elements
        apply_file(base, patch(zlib.compress(b"\x40\x00\x00\x00"), zlib.compress(bytes(4))))
    with pytest.raises(DeltaError, match="positions"):  # one position, two values
        apply_file(base, patch(one, zlib.compress(bytes(8))))
    with pytest.raises(DeltaError, match="at most"):  # more values than the tensor has
        apply_file(base, patch(one, zlib.compress(bytes(4 * 33))))
