"""Weight versions for transport tests: a small bf16 policy whose versions change sparsely."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from proto.messages import WeightsPublished
from services.weights import published_dir, read_manifest, write_weights_dir


class Policy:
    """A small bf16 'model' whose versions change ~1% of their elements, like RL steps."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.t = {
            "embed.weight": torch.randn(256, 128, generator=g).to(torch.bfloat16),
            "mlp.weight": torch.randn(128, 256, generator=g).to(torch.bfloat16),
            "norm.weight": torch.ones(128, dtype=torch.bfloat16),
        }
        self.g = g

    def step(self) -> None:
        for k, v in self.t.items():
            mask = torch.rand(v.shape, generator=self.g) < 0.01
            self.t[k] = torch.where(mask, v * 1.5 + 0.01, v).to(v.dtype)

    def save(self, root: Path, run: str, version: int) -> Path:
        def write(tmp: Path) -> None:
            (tmp / "model.safetensors").write_bytes(save(self.t))
            (tmp / "config.json").write_text(json.dumps({"hidden_size": 128}))

        out = published_dir(root, run, version)
        write_weights_dir(out, write)
        return out


def announced(run: str, version: int, uri: str, directory: Path) -> WeightsPublished:
    m = read_manifest(directory)
    return WeightsPublished(
        run=run,
        version=version,
        step=version,
        uri=uri,
        sha256=m.sha256,
        size_bytes=m.total_bytes,
        published_at=0.0,
    )


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n
