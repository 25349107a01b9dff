"""The CPU engine's load of a published version: exact values in, a mismatch refused.

The trainer publishes bf16 (the model's stored dtype) and the engine serves
float32; `load_weights` converts as it copies into the live parameters. The
load must give exactly the published values, widened, and a directory whose
bytes differ from its manifest must leave the old weights serving.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.runner import ModelRunner, WeightsLoadError
from services.weights import write_weights_dir


def _publish(runner: ModelRunner, out: Path, seed: int) -> dict[str, torch.Tensor]:
    """A new bf16 version of the runner's model, written as the trainer writes one."""
    g = torch.Generator().manual_seed(seed)
    new: dict[int, torch.Tensor] = {}  # by storage: tied embeddings stay tied
    sd = {}
    for k, v in runner.model.state_dict().items():
        ptr = v.untyped_storage().data_ptr()
        if ptr not in new:
            new[ptr] = (v + 0.01 * torch.randn(v.shape, generator=g)).to(torch.bfloat16)
        sd[k] = new[ptr]

    def write(tmp: Path) -> None:
        runner.model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)

    write_weights_dir(out, write)
    return sd


def test_a_bf16_version_loads_exactly_and_a_corrupt_one_changes_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    runner = ModelRunner(tiny_model, num_threads=1)  # weights_check "sha256", the default
    v1 = _publish(runner, tmp_path / "v1", seed=1)
    runner.load_weights(tmp_path / "v1")
    live = runner.model.state_dict()
    for name, tensor in v1.items():
        assert live[name].dtype == torch.float32
        assert torch.equal(live[name], tensor.float()), name

    _publish(runner, tmp_path / "v2", seed=2)
    f = tmp_path / "v2" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0x01  # a tensor's bytes, the file's size unchanged
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsLoadError, match="sha256"):
        runner.load_weights(tmp_path / "v2")
    for name, tensor in v1.items():
        assert torch.equal(runner.model.state_dict()[name], tensor.float()), name
