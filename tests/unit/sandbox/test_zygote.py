"""The sandbox's pure decisions: which requests a group may share one process for, and
what the pool accepts of a call's answer."""

from __future__ import annotations

import math

import pytest

from services.sandbox.pool import _pure
from services.sandbox.protocol import checked
from services.sandbox.zygote import _Options
from services.tasks import rewards as R
from services.tasks.tools import CALL

EXACT = {"fn": "exact_match", "extract": "first_line"}
MATH = {"fn": "math", "fallback": True}
CUSTOM = {"fn": "pkg.mod:fn"}


@pytest.mark.parametrize(
    ("path", "args", "mode", "pure"),
    [
        (R.SCORE, ([EXACT], "7", "7", {}), None, True),
        (R.SCORE, ([EXACT, {"fn": "format"}], "x", "7", {}), None, True),
        (R.SCORE, ([EXACT, MATH], "7", "7", {}), None, False),  # sympy parses the text
        (R.SCORE, ([CUSTOM], "x", "7", {}), None, False),
        (
            R.SCORE,
            ([EXACT, {"fn": "services.tasks.last_word:brevity_credit"}], "x", "7", {}),
            None,
            True,
        ),
        (
            R.SCORE,
            ([{"fn": "services.tasks.last_word:brevity_credit", "env": {"K": "v"}}], "x", "7", {}),
            None,
            False,
        ),
        (R.SCORE, ([{"fn": "reasoning_gym"}], "7", "7", {}), None, False),
        (CALL, ({"type": "calculator"}, "1+1"), "value", True),
        (CALL, ({"type": "python"}, "1+1"), "value", False),
        (CALL, ({"type": "function", "fn": "a:b"}, "{}"), "value", False),
        ("tests.unit.tasks.fixtures:shouting", ("A", None), None, False),
        (R.SCORE, ("not", "a", "call"), None, False),
        (R.SCORE, ([EXACT], "7", "7", {}), "value", False),
    ],
)
def test_only_flywheels_text_readers_share_a_process(
    path: str, args: object, mode: str | None, pure: bool
) -> None:
    assert _pure(path, args, mode) is pure  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("answer", "mode", "ok"),
    [
        (["ok", 1.0, {"a": 0.5}], None, True),
        (["error", "ValueError: x"], None, True),
        (["ok", "1.0", {}], None, False),  # a string where the service parses a float
        (["ok", math.inf, {}], None, False),
        (["ok", 1.0, {"a": "x"}], None, False),
        (["value", "text"], "value", True),
        (["value", 7], "value", False),
        (["ok", 1.0, {}], "value", False),  # an answer of another kind of request
        ({"ok": 1}, None, False),
        (None, None, False),
    ],
)
def test_a_calls_answer_passes_only_in_the_shape_asked_for(
    answer: object, mode: str | None, ok: bool
) -> None:
    out = checked(answer, mode)
    assert (out == answer) is ok
    if not ok:
        assert out == ["error", "sandbox: the call sent back a malformed answer"]


def test_options() -> None:
    o = _Options.parse(["--memory=512", "--nproc=8", "--cpu=3", "--pidns", "--uid=1073741824"])
    assert (o.memory_mb, o.nproc, o.cpu_s, o.pidns, o.audit, o.uid) == (
        512, 8, 3, True, False, 1 << 30
    )  # fmt: skip
    with pytest.raises(SystemExit, match="unknown option"):
        _Options.parse(["--bogus"])
