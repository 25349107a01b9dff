"""The weights-directory format: atomic write, manifest, verification errors."""

import hashlib
import json

import pytest

from services.weights import (
    MANIFEST_NAME,
    ManifestMissingError,
    WeightsExistsError,
    WeightsFileMissingError,
    WeightsMismatchError,
    read_manifest,
    verify_weights_dir,
    write_weights_dir,
)


def _write(tmp):
    (tmp / "config.json").write_text('{"a": 1}')
    (tmp / "sub").mkdir()
    (tmp / "sub" / "w.bin").write_bytes(b"\x00\x01\x02")


def test_manifest_lists_files_and_digest_is_defined(tmp_path):
    m = write_weights_dir(tmp_path / "v1", _write)
    h = {
        n: hashlib.sha256(b).hexdigest()
        for n, b in [("config.json", b'{"a": 1}'), ("sub/w.bin", b"\x00\x01\x02")]
    }
    assert [(f.name, f.size, f.sha256) for f in m.files] == [
        ("config.json", 8, h["config.json"]),
        ("sub/w.bin", 3, h["sub/w.bin"]),
    ]
    lines = f"config.json {h['config.json']}\nsub/w.bin {h['sub/w.bin']}\n"
    assert m.sha256 == hashlib.sha256(lines.encode()).hexdigest()
    assert m.total_bytes == 11
    assert read_manifest(tmp_path / "v1") == m == verify_weights_dir(tmp_path / "v1")
    assert json.loads((tmp_path / "v1" / MANIFEST_NAME).read_text())["format"]
    # nothing left beside the target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_failed_write_leaves_nothing(tmp_path):
    def boom(tmp):
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_weights_dir(tmp_path / "v1", boom)
    assert list(tmp_path.iterdir()) == []


def test_existing_target_needs_overwrite(tmp_path):
    write_weights_dir(tmp_path / "v1", _write)
    with pytest.raises(WeightsExistsError):
        write_weights_dir(tmp_path / "v1", _write)
    m = write_weights_dir(tmp_path / "v1", lambda t: (t / "only").write_text("y"), overwrite=True)
    assert [f.name for f in m.files] == ["only"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_verify_names_the_bad_file(tmp_path):
    d = tmp_path / "v1"
    write_weights_dir(d, _write)
    (d / "sub" / "w.bin").write_bytes(b"\x00\x01\x03")  # same size, other bytes
    with pytest.raises(WeightsMismatchError) as e:
        verify_weights_dir(d)
    assert e.value.file == "sub/w.bin"
    (d / "sub" / "w.bin").write_bytes(b"\x00")
    with pytest.raises(WeightsMismatchError, match="bytes"):
        verify_weights_dir(d)
    (d / "config.json").unlink()
    with pytest.raises(WeightsFileMissingError) as e:
        verify_weights_dir(d)
    assert e.value.file == "config.json"


def test_missing_or_bad_manifest(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ManifestMissingError):
        verify_weights_dir(tmp_path / "d")
    (tmp_path / "d" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestMissingError, match="JSON"):
        read_manifest(tmp_path / "d")
    with pytest.raises(OSError):  # WeightsError is an OSError
        verify_weights_dir(tmp_path / "nope")
