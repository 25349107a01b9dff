"""A real CPU engine server, started as a subprocess on a free port, for a test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.models.tiny_model import TinyModelSpec, write_tiny_model
from tests.harness.engines import EngineProcess, start_engine, stop_engine


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("model") / "m", TinyModelSpec())


@pytest.fixture(scope="module")
def engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    eng = start_engine(tiny_model_dir, tmp_path_factory.mktemp("engine") / "engine.log")
    yield eng
    stop_engine(eng)
