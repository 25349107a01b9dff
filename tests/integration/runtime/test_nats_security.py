"""NATS authentication, TLS and per-service permissions against a real nats-server.

User/password and token auth are tested in tests/integration/runtime/
test_nats_conn.py; here: nkey auth (a seed file), TLS with a throwaway CA
(server verified by the client), mutual TLS (the server verifies us), and
the per-service permission example in docs/security/nats-permissions.conf
with the real buffer service running under its user.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import nkeys
import pytest

from proto.streams import stream_name
from services.runtime.nats_conn import NatsConnectError, connect
from services.runtime.settings import NatsSettings
from services.stack.localdev.nats_server import NatsServer
from tests.harness import REPO

ROOT = REPO
PERMISSIONS = ROOT / "docs/security/nats-permissions.conf"


async def _roundtrip(settings: NatsSettings) -> bytes:
    """Connect, request/reply through the server, close: proves an authorised session."""
    nc = await connect(settings, "sec-test")

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data + b"!")

    try:
        sub = await nc.subscribe("sec.echo", cb=echo)
        reply = await nc.request("sec.echo", b"hi", timeout=5)
        await sub.unsubscribe()
        return bytes(reply.data)
    finally:
        await nc.close()


# ── nkeys ─────────────────────────────────────────────────────────────────────
def test_nkey_seed_file_auth(tmp_path: Path, run_async: Any) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "user.nk").write_bytes(seed)
    other = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    (tmp_path / "other.nk").write_bytes(other)
    conf = f"authorization {{ users = [ {{ nkey: {public} }} ] }}"
    with NatsServer(config=conf) as server:
        ok = NatsSettings(url=server.url, nkeys_seed=tmp_path / "user.nk", connect_attempts=1)
        assert run_async(_roundtrip(ok)) == b"hi!"
        bad = NatsSettings(url=server.url, nkeys_seed=tmp_path / "other.nk", connect_attempts=5)
        with pytest.raises(NatsConnectError, match="refused the credentials") as err:
            run_async(_roundtrip(bad))
        assert err.value.attempts == 1  # an auth failure is not retried
        anon = NatsSettings(url=server.url, connect_attempts=1)
        with pytest.raises(NatsConnectError):
            run_async(_roundtrip(anon))


# ── TLS ───────────────────────────────────────────────────────────────────────
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throwaway CA, a server cert for 127.0.0.1 and a client cert, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ca = ("-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=flywheel-test-ca")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *ca, cwd=d)
    exts = (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    )
    for name, ext in exts:
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", "-subj", f"/CN=flywheel-{name}", cwd=d)  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "1", "-out", f"{name}.pem",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    # A second CA that signed nothing here: trusting it must not be enough.
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-keyout", "rogue.key", "-out", "rogue.pem", "-subj", "/CN=rogue", cwd=d)  # fmt: skip
    return d


def _tls_conf(pki: Path, verify: bool) -> str:
    return (
        f'tls {{ cert_file: "{pki / "server.pem"}", key_file: "{pki / "server.key"}", '
        f'ca_file: "{pki / "ca.pem"}", verify: {"true" if verify else "false"}, timeout: 5 }}'
    )


def test_tls_server_verified_by_ca(pki: Path, run_async: Any) -> None:
    with NatsServer(config=_tls_conf(pki, verify=False)) as server:
        good = NatsSettings(url=server.url, tls_ca=pki / "ca.pem", connect_attempts=1)
        assert run_async(_roundtrip(good)) == b"hi!"
        tls_url = server.url.replace("nats://", "tls://")
        assert run_async(_roundtrip(good.model_copy(update={"url": tls_url}))) == b"hi!"
        rogue = NatsSettings(url=server.url, tls_ca=pki / "rogue.pem", connect_attempts=1)
        with pytest.raises(NatsConnectError, match=r"(?i)certificate"):
            run_async(_roundtrip(rogue))
        plain = NatsSettings(url=server.url, connect_attempts=1, connect_timeout_s=2)
        with pytest.raises(NatsConnectError):  # the server requires TLS
            run_async(_roundtrip(plain))


def test_mutual_tls_requires_a_client_certificate(pki: Path, run_async: Any) -> None:
    with NatsServer(config=_tls_conf(pki, verify=True)) as server:
        mtls = NatsSettings(
            url=server.url,
            tls_ca=pki / "ca.pem",
            tls_cert=pki / "client.pem",
            tls_key=pki / "client.key",
            connect_attempts=1,
        )
        assert run_async(_roundtrip(mtls)) == b"hi!"
        no_cert = NatsSettings(
            url=server.url, tls_ca=pki / "ca.pem", connect_attempts=1, connect_timeout_s=2
        )
        with pytest.raises(NatsConnectError):
            run_async(_roundtrip(no_cert))


# ── per-service permissions ───────────────────────────────────────────────────
RUN = "permtest"


def _permissions_conf() -> str:
    return (
        PERMISSIONS.read_text()
        .replace("flywheel.demo.", f"flywheel.{RUN}.")
        .replace("FLYWHEEL_demo_", f"FLYWHEEL_{RUN}_")
    )


async def _stream_count(js: Any, what: str) -> int:
    info = await js.stream_info(stream_name(RUN, what))
    return int(info.state.messages)


def test_permission_example_runs_the_buffer_and_denies_a_forged_batch(
    tmp_path: Path, run_async: Any, eventually: Any
) -> None:
    with NatsServer(config=_permissions_conf()) as server:
        run_file = tmp_path / "run.toml"
        run_file.write_text(
            f'run = "{RUN}"\n[nats]\nurl = "{server.url}"\nuser = "buffer"\n'
            f'password = "change-me-buffer"\nconnect_attempts = 3\n'
            '[task]\nsource = { type = "arithmetic", size = 20 }\n'
            "[buffer]\ngroups_per_step = 2\nsamples_per_prompt = 2\n"
        )
        log = tmp_path / "buffer.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.buffer", "-c", str(run_file)],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        try:
            run_async(_buffer_works_rollout_is_fenced(server, proc, log, eventually), timeout_s=60)
        finally:
            proc.terminate()
            proc.wait(15)
        assert "Permissions Violation" not in log.read_text(), log.read_text()[-3000:]


async def _buffer_works_rollout_is_fenced(
    server: NatsServer, proc: Any, log: Path, eventually: Any
) -> None:
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    rollout = NatsSettings(
        url=server.url, user="rollout", password="change-me-rollout", connect_attempts=3
    )
    nc = await connect(rollout, "forger")
    try:
        js = nc.jetstream()

        async def tasks_dispatched() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                return await _stream_count(js, "TASKS") > 0
            except Exception:  # noqa: BLE001 - the stream may not exist yet
                return False

        # The buffer, under its restricted user, created its streams, consumers
        # and KV bucket and dispatched tasks.
        await eventually(tasks_dispatched, timeout_s=30, interval_s=0.2)
        # The rollout user may publish samples but not batches.
        with pytest.raises((NatsTimeout, NoRespondersError, asyncio.TimeoutError)):
            await js.publish(f"flywheel.{RUN}.batches", b"forged", timeout=1.0)
        assert await _stream_count(js, "BATCHES") == 0
        ack = await js.publish(f"flywheel.{RUN}.samples", b"not a group", timeout=5)
        assert ack.stream == stream_name(RUN, "SAMPLES")
    finally:
        await nc.close()
