"""Built-in verifiers: pure functions `(completion, answer) -> reward`, run in the sandbox.

Each is addressable by import path (e.g. "services.rollout.envs.verifiers:exact_match"),
exactly like a user's custom verifier, so the sandbox treats all alike.

- `exact_match`: the completion's answer line equals the reference after
  whitespace normalisation.
- `math_answer`: math-verify (`math_verify.parse` + `verify`) when that
  optional package is installed; otherwise a simple normaliser: take the last
  `\\boxed{…}` (or, failing that, the last number) of the completion and
  compare it with the reference as a number (exact for integers and
  fractions, 1e-6 relative otherwise) or, if not numeric, as text without
  whitespace.
- `arithmetic`: the built-in addition task's own scorer.
"""

from __future__ import annotations

import re
from fractions import Fraction

from services.common import arithmetic

_SPACE = re.compile(r"\s+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def normalise_text(s: str) -> str:
    """Strip, collapse whitespace, drop surrounding $ and a trailing period."""
    s = _SPACE.sub(" ", s.strip()).strip("$ ").rstrip(".")
    return s.strip()


def answer_line(completion: str) -> str:
    """The completion's answer: its first line (the task format's convention)."""
    return completion.split("\n", 1)[0]


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if normalise_text(answer_line(completion)) == normalise_text(answer) else 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    out: list[str] = []
    while i < len(text):
        ch = text[i]
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return "".join(out)
        out.append(ch)
        i += 1
    return None


def to_number(s: str) -> Fraction | float | None:
    """Parse "1,234", "-3.5", "7/2", "\\frac{7}{2}" into an exact Fraction (or float)."""
    s = normalise_text(s).replace(",", "")
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        pass
    try:
        return float(s)
    except ValueError:
        return None


def extract_math_answer(completion: str) -> str | None:
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def simple_math_equal(completion: str, answer: str) -> bool:
    """The fallback checker used when math-verify is not installed."""
    got = extract_math_answer(completion)
    if got is None:
        return False
    a, b = to_number(got), to_number(answer)
    if a is not None and b is not None:
        if isinstance(a, Fraction) and isinstance(b, Fraction):
            return a == b
        return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    # Not numbers: compare as text, ignoring all whitespace ("x+1" == "x + 1").
    return _SPACE.sub("", normalise_text(got)) == _SPACE.sub("", normalise_text(answer))


def math_answer(completion: str, answer: str) -> float:
    try:
        from math_verify import parse, verify  # optional dependency
    except ImportError:
        return 1.0 if simple_math_equal(completion, answer) else 0.0
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return 1.0 if verify(gold, parse(completion)) else 0.0


def arithmetic_score(completion: str, answer: str) -> float:
    return arithmetic.score(completion, answer)


EXACT = "services.rollout.envs.verifiers:exact_match"
MATH = "services.rollout.envs.verifiers:math_answer"
ARITHMETIC = "services.rollout.envs.verifiers:arithmetic_score"
