"""NATS authentication, TLS and per-service permissions against a real nats-server.

User/password and token auth are tested in tests/integration/runtime/
test_nats_conn.py; here: nkey auth (a seed file), TLS with a throwaway CA
(server verified by the client), mutual TLS (the server verifies us), and
the per-service users of services/stack/nats_permissions.py (the example in
docs/security/nats-permissions.conf, the Kubernetes nats-auth.conf) with the
real buffer and sync running under theirs, and what the others may not do.
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
    from services.stack.nats_permissions import SERVICES, authorization

    return "jetstream {}\n" + authorization(RUN, {s: f'"pw-{s}"' for s in SERVICES})


def _as(server: NatsServer, user: str) -> NatsSettings:
    return NatsSettings(url=server.url, user=user, password=f"pw-{user}", connect_attempts=3)


async def _stream_count(js: Any, what: str) -> int:
    info = await js.stream_info(stream_name(RUN, what))
    return int(info.state.messages)


def _service(service: str, server: NatsServer, tmp_path: Path) -> tuple[Any, Path]:
    run_file = tmp_path / f"{service}.toml"
    run_file.write_text(
        f'run = "{RUN}"\n[nats]\nurl = "{server.url}"\nuser = "{service}"\n'
        f'password = "pw-{service}"\nconnect_attempts = 3\n'
        '[task]\nsource = { type = "arithmetic", size = 20 }\n'
        "[buffer]\ngroups_per_step = 2\nsamples_per_prompt = 2\n"
        f'[sync]\nweights_root = "{tmp_path / "weights"}"\n'
    )
    log = tmp_path / f"{service}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", f"services.{service}", "-c", str(run_file)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return proc, log


def test_services_run_under_their_users_and_a_rollout_user_cannot_publish_batches(
    tmp_path: Path, run_async: Any, eventually: Any
) -> None:
    with NatsServer(config=_permissions_conf()) as server:
        procs = [_service(s, server, tmp_path) for s in ("buffer", "sync")]
        try:
            run_async(_services_work_others_are_fenced(server, procs, eventually), timeout_s=90)
        finally:
            for proc, _ in procs:
                proc.terminate()
                proc.wait(15)
        for _, log in procs:
            text = log.read_text()
            assert "Permissions Violation" not in text and "Traceback" not in text, text[-3000:]


async def _services_work_others_are_fenced(
    server: NatsServer, procs: list[tuple[Any, Path]], eventually: Any
) -> None:
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    forbidden = (NatsTimeout, NoRespondersError, asyncio.TimeoutError)
    rollout = await connect(_as(server, "rollout"), "forger")
    trainer = await connect(_as(server, "trainer"), "forger")
    buffer = await connect(_as(server, "buffer"), "checker")
    sync = await connect(_as(server, "sync"), "checker")
    own = {"buffer": buffer.jetstream(), "sync": sync.jetstream()}
    try:
        js = rollout.jetstream()

        async def started() -> bool:
            for proc, log in procs:
                assert proc.poll() is None, log.read_text()[-3000:]
            advisories = stream_name(RUN, "ADVISORIES")
            try:  # the buffer dispatched tasks; both made their max-deliveries consumers
                return await _stream_count(js, "TASKS") > 0 and all([
                    await own[user].consumer_info(advisories, f"{durable}-maxdeliver")
                    for user, durable in (("buffer", "buffer"), ("buffer", "buffer-ready"),
                                          ("buffer", "buffer-dlq"), ("sync", "sync"))
                ])  # fmt: skip
            except Exception:  # noqa: BLE001 - not made yet
                return False

        # Under their restricted users they created their streams, consumers and
        # KV bucket, and the buffer dispatched tasks.
        await eventually(started, timeout_s=60, interval_s=0.2)
        # The rollout user may publish samples but not train batches.
        with pytest.raises(forbidden):
            await js.publish(f"flywheel.{RUN}.batches", b"forged", timeout=1.0)
        assert await _stream_count(js, "BATCHES") == 0
        ack = await js.publish(f"flywheel.{RUN}.samples", b"not a group", timeout=5)
        assert ack.stream == stream_name(RUN, "SAMPLES")
        # The trainer may not dispatch tasks, nor announce a version as ready.
        tjs = trainer.jetstream()
        for subject in (f"flywheel.{RUN}.tasks", f"flywheel.{RUN}.weights.ready"):
            with pytest.raises(forbidden):
                await tjs.publish(subject, b"forged", timeout=1.0)
    finally:
        for nc in (rollout, trainer, buffer, sync):
            await nc.close()
