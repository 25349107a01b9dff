"""The one-file checkpoint skips the zip records' CRC-32, and loses nothing by it.

stateformat.py saves `state.pt` without CRCs because `torch.load` never
checks them; these tests pin both halves, so a torch release that starts
checking (and would then refuse our files, or make the CRC worth its cost)
fails here rather than at a user's restart.
"""

import zipfile

import pytest
import torch

from services.trainer.distributed import DistInfo
from services.trainer.stateformat import ONE_FILE, write_state

try:
    from torch.utils.serialization import config as save_config

    HAS_SWITCH = hasattr(save_config.save, "compute_crc32")
except ImportError:  # an older torch (pyproject allows >= 2.6): it saves CRCs, as before
    HAS_SWITCH = False
needs_switch = pytest.mark.skipif(
    not HAS_SWITCH,
    reason="this torch has no compute_crc32 switch: checkpoints carry CRCs as before",
)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    return {
        "model": {"w": w},
        "optim": {"state": {0: {"exp_avg": w * 0.1, "step": torch.tensor(3.0)}}},
    }


@needs_switch
def test_the_one_file_state_is_written_without_crcs_and_loads_back_equal(tmp_path):
    state = _state()
    write_state(tmp_path, state, {"python": 1}, DistInfo())
    path = tmp_path / ONE_FILE
    records = zipfile.ZipFile(path).infolist()
    data = [r for r in records if "/data/" in r.filename]
    assert data and all(r.CRC == 0 for r in records)
    back = torch.load(path, weights_only=True)
    assert torch.equal(back["model"]["w"], state["model"]["w"])
    assert torch.equal(back["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert back["rng"] == {"python": 1}


@needs_switch
def test_the_crc_setting_is_torchs_own_again_after_a_save(tmp_path):
    write_state(tmp_path, _state(), {}, DistInfo())
    assert save_config.save.compute_crc32 is True
    other = tmp_path / "other.pt"
    torch.save({"w": torch.ones(16)}, other)
    records = zipfile.ZipFile(other).infolist()
    assert any(r.CRC != 0 for r in records if "/data/" in r.filename)


def test_torch_load_checks_no_crc_so_computing_one_was_waste(tmp_path):
    path = tmp_path / "crc.pt"
    torch.save({"t": torch.zeros(4096)}, path)  # CRCs computed, torch's default
    raw = bytearray(path.read_bytes())
    at = raw.find(bytes(4096)) + 2048  # inside the zeros' data record
    raw[at] = 0x7F
    path.write_bytes(bytes(raw))
    t = torch.load(path, weights_only=True)["t"]
    assert int((t != 0).sum()) == 1  # a flipped byte, loaded without a word
