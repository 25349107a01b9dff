"""`[stack] nats_cluster` and `[nats] replicas`: bounds, and what `flywheel up` starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.runtime.errors import ConfigError
from services.runtime.settings import NatsSettings, load_settings
from services.stack.localdev.nats_cluster import NatsCluster, embedded_nats
from services.stack.localdev.nats_server import NatsServer
from services.stack.settings import StackSettings


def run_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_cluster_run_file_loads(tmp_path: Path) -> None:
    path = run_file(tmp_path, "[nats]\nreplicas = 3\n[stack]\nnats_cluster = 3\n")
    s = load_settings(StackSettings, path)
    assert (s.nats_cluster, s.nats.replicas) == (3, 3)
    assert NatsSettings().replicas == 1  # the default: one server, one replica


def test_more_replicas_than_embedded_servers_is_refused_naming_both(tmp_path: Path) -> None:
    path = run_file(tmp_path, "[nats]\nreplicas = 3\n")
    with pytest.raises(ConfigError, match=r"\[nats\] replicas = 3.*\[stack\] nats_cluster = 1"):
        load_settings(StackSettings, path)
    # An external NATS (embedded_nats = false) is the user's to size.
    path = run_file(tmp_path, "[nats]\nreplicas = 3\n[stack]\nembedded_nats = false\n")
    assert load_settings(StackSettings, path).nats.replicas == 3


OUT_OF_BOUNDS = ["[nats]\nreplicas = 0\n", "[nats]\nreplicas = 6\n", "[stack]\nnats_cluster = 0\n"]


@pytest.mark.parametrize("text", OUT_OF_BOUNDS)
def test_out_of_bounds_is_a_config_error(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r"replicas|nats_cluster"):
        load_settings(StackSettings, run_file(tmp_path, text))


def test_embedded_nats_is_one_server_or_a_cluster(tmp_path: Path) -> None:
    one = embedded_nats(1, port=4300, store_dir=tmp_path / "nats")
    assert isinstance(one, NatsServer) and one.store_dir == tmp_path / "nats"
    three = embedded_nats(3, port=4300, store_dir=tmp_path / "nats")
    assert isinstance(three, NatsCluster) and three.size == 3
    assert three.store_root == tmp_path / "nats"
    one.close()
