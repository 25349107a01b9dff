"""Weight URIs are confined to the configured weights root (services/weights/disk.py).

A WeightsPublished message comes off the bus: its `uri` must not make sync
point engines at an arbitrary directory, through `..`, an absolute path
elsewhere, another scheme, or a symlink inside the root that leads out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.settings import EngineSettings
from services.runtime.errors import PermanentError
from services.weights import Transports, Wiring


def local_path(uri: str, root: Path) -> Path | None:
    """Where sync points an engine for an announced `uri` (None: the engine's own copy)."""
    path = Transports(Wiring("run", root)).for_uri(uri).source(uri, 1).engine_path(None, None)
    return None if path is None else Path(path)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "weights"
    (r / "run" / "v000001").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    return r


def test_a_directory_inside_the_root_is_accepted(root: Path) -> None:
    assert local_path(f"file://{root}/run/v000001", root) == (root / "run/v000001").resolve()


def test_the_disk_transports_own_uri_is_accepted_under_a_path_with_a_space(
    tmp_path: Path,
) -> None:
    root = tmp_path / "my runs" / "weights"  # as_uri() announces it as my%20runs
    version = root / "run" / "v000001"
    version.mkdir(parents=True)
    uri = version.as_uri()  # what DiskTransport.publish announces
    assert "%20" in uri
    assert local_path(uri, root) == version.resolve()


@pytest.mark.parametrize(
    "uri",
    [
        "file://{root}/%2E%2E/secret",  # an encoded ".." is decoded, then confined
        "file://{root}/../secret",
        "file://{root}/run/../../secret",
        "file://{root}/run/v000001/../../../secret",
        "file:///etc",
        "file://{root}/../weights-evil",  # a sibling sharing the root's name as a prefix
        "http://example.com/weights",
        "s3://bucket/weights",
        "{root}/run/v000001",  # no scheme
        "nats://FLYWHEEL_run_WEIGHTDATA/notanumber",
    ],
)
def test_escapes_are_refused(root: Path, uri: str) -> None:
    with pytest.raises(PermanentError) as err:
        local_path(uri.format(root=root), root)
    assert err.value.reason == "bad_uri"


def test_a_symlink_out_of_the_root_is_refused(root: Path) -> None:
    (root / "run" / "v000002").symlink_to(root.parent / "secret", target_is_directory=True)
    with pytest.raises(PermanentError, match="outside"):
        local_path(f"file://{root}/run/v000002", root)


def test_a_symlinked_root_still_accepts_its_own_directories(tmp_path: Path, root: Path) -> None:
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    assert local_path(f"file://{root}/run/v000001", alias) == (root / "run/v000001").resolve()


def test_engine_admin_api_binds_to_loopback_by_default() -> None:
    s = EngineSettings()
    assert s.host == "127.0.0.1"
    assert s.api_key is None  # optional; tests/integration/engine covers the key itself
    assert s.metrics_host == "127.0.0.1"
