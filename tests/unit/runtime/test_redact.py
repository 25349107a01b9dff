"""Credentials never reach a log line: the redaction, and the formatter every service uses."""

from __future__ import annotations

import io
import logging

import pytest

from services.runtime.lifecycle import _HANDLER_MARK, setup_logging
from services.runtime.redact import redact

LEAKS = [
    ("connect to nats://flywheel:s3cr3t-pw@nats:4222 failed", "s3cr3t-pw", "nats://flywheel:***@"),
    ("servers nats://a:pw-one@h1:4222,tls://b:pw-two@h2:4222", "pw-", "tls://b:***@h2"),
    ("token url nats://tok3n-value@nats:4222", "tok3n-value", "nats://***@nats"),
    (
        "argv: python -m sglang.launch_server --api-key sk-live-99 --port 1",
        "sk-live-99",
        "--api-key ***",
    ),
    ("headers {'Authorization': 'Bearer sk-hdr-77'}", "sk-hdr-77", "Bearer ***"),
    ("env FLYWHEEL_BUFFER_NATS__PASSWORD=pw-env-5 X=1", "pw-env-5", "PASSWORD=***"),
    ("Nats(password=SecretStr('pw-repr-3'), token='tk-4')", "pw-repr-3", "SecretStr('***')"),
    ('{"api_key": "sk-json-8", "n": 1}', "sk-json-8", '"api_key": "***'),
]


@pytest.mark.parametrize(("line", "secret", "shown"), LEAKS)
def test_redact_hides_each_kind(line: str, secret: str, shown: str) -> None:
    out = redact(line)
    assert secret not in out and shown in out, out


def test_redact_keeps_what_is_not_a_secret() -> None:
    plain = (
        "consuming FLYWHEEL_demo_SAMPLES/buffer at nats://nats:4222 (http://10.1.2.3:30000); "
        "max_tokens=64 generated_tokens: 12 tokens_per_s=9.5 password_file=/run/secret/pw; "
        '{"password": "**********", "token": null, "api_key": null}'
    )
    assert redact(plain) == plain


def test_every_log_line_of_a_service_is_redacted() -> None:
    """Message, arguments and traceback alike, through the handler setup_logging installs."""
    setup_logging("buffer")
    handler = next(h for h in logging.getLogger().handlers if getattr(h, _HANDLER_MARK, False))
    assert isinstance(handler, logging.StreamHandler)
    stream = io.StringIO()
    old = handler.setStream(stream)
    try:
        log = logging.getLogger("tests.redact")
        log.warning("connect to %s failed", "nats://u:pw-arg-1@nats:4222")
        try:
            raise ConnectionError("refused nats://u:pw-exc-2@nats:4222")
        except ConnectionError:
            log.exception("engine --api-key %s", "sk-msg-3")
    finally:
        if old is not None:
            handler.setStream(old)
    text = stream.getvalue()
    assert "failed" in text and "Traceback" in text
    for secret in ("pw-arg-1", "pw-exc-2", "sk-msg-3"):
        assert secret not in text, text


def test_an_uncaught_exception_is_redacted_too() -> None:
    """The interpreter prints those itself; setup_logging routes them through the handler."""
    import subprocess
    import sys

    from tests.harness import REPO

    code = (
        "from services.runtime.lifecycle import setup_logging\n"
        "setup_logging('buffer')\n"
        "raise RuntimeError('cannot reach nats://u:pw-uncaught-9@nats:4222')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=60, check=False)  # fmt: skip
    assert out.returncode == 1
    assert "uncaught exception" in out.stderr and "RuntimeError" in out.stderr, out.stderr
    assert "pw-uncaught-9" not in out.stderr, out.stderr


def test_print_config_masks_a_password_in_a_url() -> None:
    from services.runtime.settings import load_settings, render
    from services.sync.settings import SyncSettings

    s = load_settings(SyncSettings, None, nats={"url": "nats://u:pw-url-4@nats:4222"})
    text = render(s)
    assert "pw-url-4" not in text and "nats://u:***@nats:4222" in text
