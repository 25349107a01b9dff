"""The trainer keeps the weights of its best held-out evaluation (services/weights/best.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from services.weights.best import BEST_DIR, best_record, keep_if_best


def version(root: Path, n: int) -> Path:
    d = root / f"v{n:06d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(bytes([n]) * 64)
    (d / "config.json").write_text(f'{{"v": {n}}}')
    return d


def test_only_a_better_evaluation_replaces_the_kept_weights(tmp_path: Path) -> None:
    ckpt, weights = tmp_path / "checkpoints", tmp_path / "weights"
    ckpt.mkdir()
    assert best_record(ckpt) is None
    assert keep_if_best(ckpt, version(weights, 5), 5, 0.80)
    assert not keep_if_best(ckpt, version(weights, 10), 10, 0.75)  # worse
    assert not keep_if_best(ckpt, version(weights, 15), 15, 0.80)  # a tie keeps the older
    assert best_record(ckpt) == {"step": 5, "accuracy": 0.80, "weights": str(ckpt / BEST_DIR)}
    assert (ckpt / BEST_DIR / "model.safetensors").read_bytes() == bytes([5]) * 64
    assert keep_if_best(ckpt, version(weights, 20), 20, 0.85)
    assert best_record(ckpt)["step"] == 20  # type: ignore[index]
    assert (ckpt / BEST_DIR / "config.json").read_text() == '{"v": 20}'
    assert sorted(p.name for p in ckpt.iterdir()) == [BEST_DIR, "best.json"]  # no leftovers


def test_the_kept_weights_outlive_the_published_version(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    v = version(tmp_path / "weights", 3)
    keep_if_best(ckpt, v, 3, 0.5)
    shutil.rmtree(v)  # sync's keep_last deletes old versions
    assert (ckpt / BEST_DIR / "model.safetensors").read_bytes() == bytes([3]) * 64


def test_a_record_without_its_directory_is_no_best(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    keep_if_best(ckpt, version(tmp_path / "weights", 3), 3, 0.5)
    shutil.rmtree(ckpt / BEST_DIR)  # a crash between the two renames
    assert best_record(ckpt) is None
    assert keep_if_best(ckpt, version(tmp_path / "weights", 4), 4, 0.1)
