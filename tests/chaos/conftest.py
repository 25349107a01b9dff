"""Fixtures of the chaos suite: the harness module on sys.path, a tiny model."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from services.common.tiny_model import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="module")
def chaos_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("chaos-model") / "model", TinyModelSpec())
