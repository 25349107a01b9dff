"""A full disk gives a DiskFullError that says how much was needed and how much was free,
and leaves nothing half-written behind — not the writer's own words (torch's zip writer:
`unexpected pos 509875968 vs 509875920`, as a CI run out of disk printed).

Real filesystems of a given size: tmpfs mounts bubblewrap makes in a mount namespace of
their own, where a tiny-model trainer writes its checkpoint and a weights directory.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.harness.sandbox import require_sandbox

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20

SCRIPT = r"""
import json, sys
from pathlib import Path
from services.runtime.diskroom import DiskFullError
from services.trainer.settings import TrainConfig
from services.trainer.state import latest_checkpoint, save_checkpoint
from services.trainer.trainer import Trainer
from services.weights import write_weights_dir

out = {}
t = Trainer.from_pretrained(sys.argv[1], TrainConfig())
small, big = Path("/mnt"), Path("/mnt/big")
(small / "ckpt").mkdir()
try:
    save_checkpoint(t, small / "ckpt")
    out["small"] = "saved"
except DiskFullError as e:
    out["small"] = str(e)
    out["small_left"] = sorted(p.name for p in (small / "ckpt").iterdir())
    out["small_latest"] = str(latest_checkpoint(small / "ckpt"))
out["big"] = save_checkpoint(t, big / "ckpt").name

def write(tmp):  # more than the filesystem holds, past a check that was told 1 byte
    (tmp / "blob").write_bytes(bytes(120 << 20))

try:
    write_weights_dir(big / "w" / "v1", write, need=1)
    out["weights"] = "written"
except DiskFullError as e:
    out["weights"] = str(e)
    out["weights_left"] = sorted(p.name for p in (big / "w").iterdir())
print(json.dumps(out))
"""


def test_a_full_disk_says_so_and_leaves_nothing_behind(tiny_model_dir):
    require_sandbox()
    cmd = [
        "bwrap", "--dev-bind", "/", "/", "--die-with-parent",
        "--size", str(32 * MiB), "--tmpfs", "/mnt", "--dir", "/mnt/big",
        "--size", str(100 * MiB), "--tmpfs", "/mnt/big",
        sys.executable, "-c", SCRIPT, str(tiny_model_dir),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # 32 MiB holds the tiny model's ~6 MB of state, not it plus the writer's slack: refused
    # before a byte is written, with both figures and what to do
    assert out["small"].startswith("no room for checkpoint step-00000000 in /mnt/ckpt: it needs")
    assert "MiB free there" in out["small"] and "keep_checkpoints" in out["small"]
    assert out["small_left"] == [] and out["small_latest"] == "None"
    # where there is room it is written
    assert out["big"] == "step-00000000"
    # a writer that meets ENOSPC mid-file: the same error, and its temporary directory gone
    assert out["weights"].startswith("no room for weights v1 in /mnt/big/w")
    assert out["weights_left"] == []
