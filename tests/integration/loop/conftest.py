"""Fixtures of the loop tests: the harness module on sys.path, a tiny model, a nats-server."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from services.common.tiny_model import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="module")
def loop_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("loop-model") / "model", TinyModelSpec())
