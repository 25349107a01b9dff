"""The built-in rewards, and `score`, the one entry point the verifier sandbox calls.

Each reward is a pure function of the completion (and the reference answer,
and for some the response length or the row), tested on its own. A task's
reward is a weighted sum of parts; `score` computes every part of one
completion in the sandbox's child process — one round trip per completion
whatever the number of parts, all under the pool's one time limit — and
returns {"reward": Σ weight·value, "parts": {name: value}}, so reward_parts
keeps each part and the trainer can log its mean.

The parts travel to the child as plain dicts (`payload`), not pydantic
models: the child imports this module and nothing else of the spec.
"""

from __future__ import annotations

import functools
import json
import re
from fractions import Fraction
from typing import Any

_SPACE = re.compile(r"\s+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


# ── extraction ───────────────────────────────────────────────────────────────
def normalise_text(s: str) -> str:
    """Strip, collapse whitespace, drop surrounding $ and a trailing period."""
    return _SPACE.sub(" ", s.strip()).strip("$ ").rstrip(".").strip()


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    while i < len(text):
        depth += text[i] == "{"
        depth -= text[i] == "}"
        if depth == 0:
            return text[start + len("\\boxed{") : i]
        i += 1
    return None


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def extract(text: str, how: str, marker: str = "####") -> str | None:
    """The part of a completion that holds its answer; None when it has none."""
    if how == "first_line":
        return text.split("\n", 1)[0]
    if how == "last_line":
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else ""
    if how == "full":
        return text
    if how == "answer_tag":
        tags = _ANSWER_TAG.findall(text)
        return tags[-1] if tags else None
    if how == "boxed":
        return last_boxed(text)
    if how == "marker":
        return text.rpartition(marker)[2] if marker in text else None
    if how == "last_number":
        return last_number(text)
    raise ValueError(f"unknown extraction {how!r}")


def to_number(s: str) -> Fraction | float | None:
    """Parse "1,234", "7/2", "\\frac{7}{2}" into an exact Fraction, "-3.5" into a float
    (decimals are compared with a tolerance, integers and fractions exactly)."""
    s = normalise_text(s).replace(",", "")
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}/{frac.group(2)}"
    if re.fullmatch(r"-?\d+(/\d+)?", s):
        try:
            return Fraction(s)
        except ZeroDivisionError:
            return None
    try:
        return float(s)
    except ValueError:
        return None


def numbers_equal(a: str | None, b: str | None, rel_tol: float = 1e-6) -> bool:
    x, y = (to_number(a) if a is not None else None), (to_number(b) if b is not None else None)
    if x is None or y is None:
        return False
    if isinstance(x, Fraction) and isinstance(y, Fraction):
        return x == y
    return abs(float(x) - float(y)) <= rel_tol * max(1.0, abs(float(y)))


# ── the rewards ──────────────────────────────────────────────────────────────
def exact_match(
    completion: str,
    answer: str | None,
    *,
    extract_: str = "first_line",
    marker: str = "####",
    normalize: bool = True,
    case_sensitive: bool = True,
) -> float:
    """1 if the extracted answer equals the reference."""
    got = extract(completion, extract_, marker)
    if got is None or answer is None:
        return 0.0
    ref = answer
    if normalize:
        got, ref = normalise_text(got), normalise_text(ref)
    else:
        got, ref = got.strip(), ref.strip()
    if not case_sensitive:
        got, ref = got.casefold(), ref.casefold()
    return 1.0 if got == ref else 0.0


def numeric_match(
    completion: str,
    answer: str | None,
    *,
    extract_: str = "last_number",
    marker: str = "####",
    rel_tol: float = 1e-6,
) -> float:
    """1 if the extracted number equals the reference number."""
    got = extract(completion, extract_, marker)
    if got is not None and to_number(got) is None:  # "#### 42 apples": its first number
        first = _NUMBER.search(got)
        got = first.group() if first else None
    return 1.0 if numbers_equal(got, answer, rel_tol) else 0.0


def simple_math_equal(completion: str, answer: str) -> bool:
    """The fallback without math-verify: last \\boxed{} (or number), as a number or text."""
    got = last_boxed(completion)
    if got is None:
        got = last_number(completion)
    if got is None:
        return False
    if to_number(got) is not None and to_number(answer) is not None:
        return numbers_equal(got, answer)
    return _SPACE.sub("", normalise_text(got)) == _SPACE.sub("", normalise_text(answer))


def math_answer(completion: str, answer: str | None, *, fallback: bool = True) -> float:
    """math-verify's verdict (its parse takes LaTeX, \\boxed{} and plain numbers)."""
    if answer is None:
        return 0.0
    try:
        from math_verify import parse, verify  # optional dependency (extra: math)
    except ImportError:
        if not fallback:
            raise
        return 1.0 if simple_math_equal(completion, answer) else 0.0
    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return 1.0 if verify(gold, parse(completion)) else 0.0


def gsm8k_answer(completion: str, answer: str | None, *, strict: bool = True) -> float:
    """The number after the completion's last '####' equals the reference's."""
    if answer is None:
        return 0.0
    ref = answer.rpartition("####")[2] if "####" in answer else answer
    if "####" in completion:
        got = last_number(completion.rpartition("####")[2].split("\n", 1)[0])
    else:
        got = None if strict else last_number(completion)
    return 1.0 if numbers_equal(got, ref.strip()) else 0.0


def format_reward(completion: str, *, pattern: str, full_match: bool = False) -> float:
    """1 if the completion matches `pattern` (searched, or matched whole)."""
    rx = _regex(pattern)
    found = rx.fullmatch(completion.strip()) if full_match else rx.search(completion)
    return 1.0 if found else 0.0


@functools.lru_cache(maxsize=64)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.S)


def soft_overlong(response_tokens: int, *, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO: 0 for |y| <= L_max - L_cache, then linearly to -1 at L_max, -1 beyond."""
    start = max_tokens - buffer_tokens
    if response_tokens <= start:
        return 0.0
    if response_tokens > max_tokens:
        return -1.0
    return (start - response_tokens) / buffer_tokens


def reasoning_gym_score(
    completion: str, *, dataset: str, config: dict[str, Any], seed: int, size: int, row: int
) -> float:
    """The generator's own score_answer on row `row` of the (cached) dataset."""
    from services.common.tasks.sources import reasoning_gym_dataset

    data = reasoning_gym_dataset(dataset, json.dumps(config, sort_keys=True), seed, size)
    return float(data.score_answer(answer=completion.strip(), entry=data[row]))


# ── the weighted sum (what the sandbox runs) ─────────────────────────────────
def part_value(
    part: dict[str, Any], completion: str, answer: str | None, ctx: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """One part's value (and sub-parts a custom function returned)."""
    fn = part["fn"]
    if fn == "exact_match":
        return exact_match(
            completion,
            answer,
            extract_=part["extract"],
            marker=part["marker"],
            normalize=part["normalize"],
            case_sensitive=part["case_sensitive"],
        ), {}
    if fn == "numeric":
        return numeric_match(
            completion,
            answer,
            extract_=part["extract"],
            marker=part["marker"],
            rel_tol=part["rel_tol"],
        ), {}
    if fn == "math":
        return math_answer(completion, answer, fallback=part["fallback"]), {}
    if fn == "gsm8k":
        return gsm8k_answer(completion, answer, strict=part["strict"]), {}
    if fn == "format":
        return format_reward(completion, pattern=part["pattern"], full_match=part["full_match"]), {}
    if fn == "soft_overlong":
        return soft_overlong(
            int(ctx["response_tokens"]),
            max_tokens=part["max_tokens"],
            buffer_tokens=part["buffer_tokens"],
        ), {}
    if fn == "reasoning_gym":
        src = ctx["source"]
        return reasoning_gym_score(
            completion,
            dataset=src["dataset"],
            config=src["config"],
            seed=src["seed"],
            size=src["size"],
            row=int(ctx["row"]),
        ), {}
    if fn == "verifiers":
        from services.common.tasks.verifiers_env import rubric_score

        return rubric_score(completion, source=ctx["source"], row=int(ctx["row"]))
    from services.common.tasks.sandbox import environment, resolve, to_reward

    with environment(part.get("env") or {}):
        r = to_reward(resolve(fn)(completion, answer, **part.get("kwargs", {})))
    return r.reward, r.parts


def score(
    parts: list[dict[str, Any]], completion: str, answer: str | None, ctx: dict[str, Any]
) -> dict[str, Any]:
    """Σ weight·value over `parts`; every part's value in "parts" (sub-parts as name.sub)."""
    total = 0.0
    values: dict[str, float] = {}
    for part in parts:
        value, sub = part_value(part, completion, answer, ctx)
        name = part["name"] or str(part["fn"]).rpartition(":")[2]
        values[name] = value
        values.update({f"{name}.{k}": v for k, v in sub.items()})
        total += part["weight"] * value
    return {"reward": total, "parts": values}


def warm(parts: list[dict[str, Any]], ctx: dict[str, Any]) -> float:
    """Run in every new sandbox child before it serves: import what the parts need
    (custom functions, math-verify) and build a reasoning-gym dataset, so a
    completion's time limit is spent scoring it, not importing."""
    from services.common.tasks.sandbox import resolve

    for part in parts:
        fn = str(part["fn"])
        if ":" in fn:
            resolve(fn)
        elif fn == "math":
            math_answer("1", "1", fallback=part["fallback"])
        elif fn == "verifiers" and "source" in ctx:
            from services.common.tasks.verifiers_env import env_of

            env_of(ctx["source"])  # importing and building an env takes seconds
        elif fn == "reasoning_gym" and "source" in ctx:
            src = ctx["source"]
            reasoning_gym_score(
                "",
                dataset=src["dataset"],
                config=src["config"],
                seed=src["seed"],
                size=src["size"],
                row=0,
            )
    return 1.0


SCORE = "services.common.tasks.rewards:score"
WARM = "services.common.tasks.rewards:warm"

# Built-ins that read the completion as text (regular expressions, Fraction) and
# never parse or run it as code: the sandbox answers a group scored only by these
# in its warm process, without a fork per request (sandbox.py). math (sympy
# parsing), reasoning_gym and verifiers (other packages' scorers) and custom
# functions are not on the list.
PURE = frozenset({"exact_match", "numeric", "gsm8k", "format", "soft_overlong"})


def pure(parts: list[dict[str, Any]]) -> bool:
    return all(isinstance(p, dict) and p.get("fn") in PURE for p in parts)
