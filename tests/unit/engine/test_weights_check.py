"""The engine's `weights_check`: what an update verifies before it loads a directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.runner import WeightsLoadError, verify_directory
from services.weights import write_weights_dir


def _published(root: Path) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        (tmp / "config.json").write_text("{}")

    write_weights_dir(root / "v1", write)
    return root / "v1"


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


def test_sha256_refuses_a_flipped_byte_sizes_trusts_it(tmp_path: Path) -> None:
    d = _published(tmp_path)
    verify_directory(d, "sha256")
    verify_directory(d, "sizes")
    _flip_a_byte(d / "model.safetensors")
    with pytest.raises(WeightsLoadError, match="sha256"):
        verify_directory(d, "sha256")
    verify_directory(d, "sizes")  # same size: what "sizes" knowingly does not catch


def test_both_refuse_a_truncated_or_missing_file(tmp_path: Path) -> None:
    d = _published(tmp_path)
    (d / "model.safetensors").write_bytes(b"short")
    for check in ("sha256", "sizes"):
        with pytest.raises(WeightsLoadError, match="bytes"):
            verify_directory(d, check)
    (d / "model.safetensors").unlink()
    for check in ("sha256", "sizes"):
        with pytest.raises(WeightsLoadError, match="missing"):
            verify_directory(d, check)
