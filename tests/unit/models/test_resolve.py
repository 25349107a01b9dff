"""`[stack] model` resolution: a directory, or a hub id from the local Hugging Face cache only."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.models.resolve import ModelNotFoundError, is_hub_id, resolve_model


def hub_cache_with(cache: Path, repo_id: str, model: Path | None = None) -> Path:
    """A Hugging Face hub cache holding `repo_id` at `main`, laid out as huggingface_hub
    writes it (models--org--name/refs/main, snapshots/<commit>/); its snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    if model is not None:
        shutil.copytree(model, snap)
    else:
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
    return snap


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_a_model_directory_is_itself(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "m") == tmp_path / "m"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match=r"^\[stack\] model = .*has no config\.json"):
        resolve_model(tmp_path / "empty")


def test_a_hub_id_is_its_snapshot_in_the_local_cache(hub_cache: Path) -> None:
    snap = hub_cache_with(hub_cache, "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == snap


def test_neither_a_directory_nor_cached_is_one_line_naming_the_key(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("nobody/no-such-model", key="[trainer] model")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("[trainer] model = 'nobody/no-such-model': ")
    assert "not in the local Hugging Face cache" in msg and str(hub_cache) in msg
    assert "flywheel import-model" in msg and "make smollm2" in msg and "init-model" in msg
    with pytest.raises(ModelNotFoundError, match=r"runs/x/model': no such model directory; get"):
        resolve_model("runs/x/model")  # two slashes: a path, never a hub id


def test_what_counts_as_a_hub_id() -> None:
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name_v1.2")
    for path in ("runs/demo/model", "./org/name", "/models/x", "name", "a/../b", "~/m/x"):
        assert not is_hub_id(path), path
