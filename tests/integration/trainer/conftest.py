"""Fixtures of the trainer integration tests: a tiny model directory built offline."""

from pathlib import Path

import pytest

from services.models.tiny_model import TinyModelSpec, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelSpec())
