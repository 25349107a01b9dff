"""bench/sync_dist.py's distributed row counts a receiver ready only when what it got verifies.

One real receiver process (the engine's distributed routes on its scheduler)
and sync's `DistTransport` as rank 0, on a tiny safetensors directory: an
intact version is ready with the trainer's digest; one whose file no longer
matches its manifest is not.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.sync_dist import Receivers, measure
from services.weights import published_dir, write_weights_dir


def version(root: Path, n: int, seed: int) -> Path:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sd = {"a.weight": torch.randn(8, 4, generator=g).bfloat16(), "b.bias": torch.randn(3)}

    def write(tmp: Path) -> None:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text("{}")

    out = published_dir(root, "held", n)
    write_weights_dir(out, write)
    return out


def test_ready_means_verified(tmp_path: Path) -> None:
    v1, v2 = version(tmp_path, 1, 0), version(tmp_path, 2, 1)
    with Receivers(1, v1) as rx:
        row: dict[str, Any] = asyncio.run(measure(v2, rx.urls, tmp_path / "a"))
        assert (row["receivers"], row["kind"]) == (1, "distributed")
        assert row["seconds"] > 0 and row["formed_s"] > 0 and row["verify_s"] > 0
        # the bytes on disk no longer match the trainer's manifest: broadcast, never ready
        data = bytearray((v2 / "model.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (v2 / "model.safetensors").write_bytes(bytes(data))
        with pytest.raises(AssertionError, match="tensors differ"):
            asyncio.run(measure(v2, rx.urls, tmp_path / "b"))
