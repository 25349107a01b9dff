"""Credentials out of every log line: one pure function, applied by the log formatter.

A NATS URL may carry `user:password@`, an engine command line `--api-key K`,
an HTTP header `Authorization: Bearer K`, an environment dump `..._PASSWORD=P`.
`setup_logging` passes every formatted line (the message, its arguments and
any traceback) through `redact`, so a log call that forgets cannot leak one;
error messages that name a URL use it too.
"""

from __future__ import annotations

import re

MASK = "***"

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # scheme://user:password@host -> scheme://user:***@host (and a bare token@host)
    (re.compile(r"(\b[a-zA-Z][\w+.-]*://)([^\s:/@]*):([^\s/@]+)@"), rf"\1\2:{MASK}@"),
    (re.compile(r"(\b(?:nats|tls|wss?)://)([^\s:/@]+)@"), rf"\1{MASK}@"),
    (re.compile(r"(--api-key[= ])(\S+)"), rf"\1{MASK}"),
    (re.compile(r"(\bBearer )([^\s'\"]+)", re.IGNORECASE), rf"\1{MASK}"),
    # NAME_PASSWORD=..., api_key='...', "token": "..." (env dumps, reprs, JSON); a name
    # must END in the word: max_tokens=64 or tokens_per_s: 9 are not secrets
    (
        re.compile(
            r"""(\b\w*(?:PASSWORD|PASSWD|SECRET|SECRET_KEY|TOKEN|API_KEY|APIKEY|ACCESS_KEY)\b"""
            r"""['"]?\s*[=:]\s*"""
            r"""(?:SecretStr\()?['"]?)"""
            # not null/true/false (JSON stays JSON), not a value masked already (**********)
            r"""((?!(?:null|None|true|false)\b)[^\s'",)}*][^\s'",)}]*)""",
            re.IGNORECASE,
        ),
        rf"\1{MASK}",
    ),
)


def redact(text: str) -> str:
    """`text` with every credential it recognises replaced by ***."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text
