"""Pure parts of the runtime: backoff, config diffs, auth/TLS options, readiness, logging."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest

from proto.streams import consumers_for, streams_for
from services.runtime.errors import ConfigError
from services.runtime.http_health import Readiness
from services.runtime.lifecycle import setup_logging
from services.runtime.nats_conn import (
    auth_options,
    config_diff,
    connect_backoff,
    consumer_config,
    stream_config,
    tls_context,
)
from services.runtime.settings import NatsSettings


def test_connect_backoff_doubles_and_caps():
    assert [connect_backoff(n) for n in range(1, 8)] == [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0]
    # the default 30 attempts wait long enough for a NATS pod to start, but not forever
    assert 60 < sum(connect_backoff(n) for n in range(1, 30)) < 180


def test_config_diff_normalises_durations_enums_and_empty_backoff():
    want = stream_config(streams_for("r")[0])
    have = SimpleNamespace(**{**vars(want), "max_age": want.max_age + 1e-9})
    assert config_diff(want, have, ["max_age", "retention", "subjects"]) == {}
    other = SimpleNamespace(**{**vars(want), "duplicate_window": 60.0})
    assert config_diff(want, other, ["duplicate_window"]) == {
        "duplicate_window": (want.duplicate_window, 60.0)
    }
    c = consumer_config(consumers_for("r")["trainer"])
    assert config_diff(c, SimpleNamespace(**{**vars(c), "backoff": []}), ["backoff"]) == {}


def test_stream_and_consumer_configs_follow_proto():
    tasks = stream_config(streams_for("r")[0])
    assert tasks.retention.value == "workqueue" and tasks.subjects == ["flywheel.r.tasks"]
    trainer = consumer_config(consumers_for("r")["trainer"])
    assert trainer.durable_name == "trainer" and trainer.max_ack_pending == 1
    assert trainer.ack_policy.value == "explicit"


def test_auth_options():
    assert auth_options(NatsSettings()) == {}
    assert auth_options(NatsSettings(user="u", password="p")) == {"user": "u", "password": "p"}
    assert auth_options(NatsSettings(token="t")) == {"token": "t"}
    with pytest.raises(ConfigError, match="together"):
        auth_options(NatsSettings(user="u"))


def test_tls_context_only_when_configured():
    assert tls_context(NatsSettings()) is None
    ctx = tls_context(NatsSettings(url="tls://127.0.0.1:4222"))
    assert ctx is not None and ctx.check_hostname
    with pytest.raises(ConfigError, match="tls_cert and tls_key"):
        tls_context(NatsSettings(tls_cert="/nonexistent.pem"))


def test_readiness_static_and_dynamic_conditions():
    r = Readiness()
    assert r.ready
    r.set("nats", "connecting")
    flag = {"up": False}
    r.check("engine", lambda: None if flag["up"] else "down")
    assert r.problems() == {"nats": "connecting", "engine": "down"}
    r.ok("nats")
    flag["up"] = True
    assert r.ready and r.problems() == {}


@pytest.fixture
def restore_root_logger():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_lines_carry_time_service_level(capsys, restore_root_logger):
    setup_logging("trainer", "DEBUG")
    setup_logging("trainer", "INFO")  # idempotent: still one line per record
    logging.getLogger("flywheel.test").info("step 3 done")
    logging.getLogger("flywheel.test").debug("hidden")
    lines = capsys.readouterr().err.strip().splitlines()
    ours = [ln for ln in lines if "step 3 done" in ln]
    assert len(ours) == 1 and not any("hidden" in ln for ln in lines)
    assert re.match(
        r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z trainer INFO flywheel.test: step 3 done$", ours[0]
    )
