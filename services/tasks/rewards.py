"""The built-in rewards, and `score`, the one entry point the verifier sandbox calls.

Each reward is a pure function of the completion (and the reference answer,
and for some the response length or the row), tested on its own, and a
class (`fn = "<name>"` in the run file, registered with `@REWARDS.register`)
whose fields are its options and whose `value` calls the function. A task's
reward is a weighted sum of parts; `score` computes every part of one
completion in the sandbox's child process — one round trip per completion
whatever the number of parts, all under the pool's one time limit — and
returns {"reward": Σ weight·value, "parts": {name: value}}, so reward_parts
keeps each part and the trainer can log its mean.

The parts travel to the child as plain fields with their class's module
(registry.as_fields); the child imports that module and rebuilds each part
without validating it again. The rewards of a source of their own live with
it (reasoning_gym.py, verifiers_env.py).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from fractions import Fraction
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.runtime.errors import ConfigError
from services.sandbox import every_child_imports, text_reader
from services.tasks.registry import FN_PATH, REWARDS, RewardPart

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


# ── the reward classes (the run file's `fn = ...`) ────────────────────────────
Extract = Literal["first_line", "last_line", "full", "answer_tag", "boxed", "marker", "last_number"]


@REWARDS.register
class ExactMatch(RewardPart):
    """1 if the extracted answer equals the reference (after normalisation)."""

    text_only: ClassVar[bool] = True
    fn: Literal["exact_match"]
    extract: Extract = Field("first_line", description="Which part of the completion to compare.")
    marker: str = Field("####", description="extract = 'marker': text after its last occurrence.")
    normalize: bool = Field(
        True, description="Collapse whitespace, drop surrounding $ and a trailing period."
    )
    case_sensitive: bool = Field(True, description="Compare case-sensitively.")

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return exact_match(
            completion,
            answer,
            extract_=self.extract,
            marker=self.marker,
            normalize=self.normalize,
            case_sensitive=self.case_sensitive,
        ), {}


@REWARDS.register
class NumericMatch(RewardPart):
    """1 if the extracted number equals the reference number (exact for integers/fractions)."""

    text_only: ClassVar[bool] = True
    fn: Literal["numeric"]
    extract: Extract = Field("last_number", description="Which part of the completion to parse.")
    marker: str = Field("####", description="extract = 'marker': text after its last occurrence.")
    rel_tol: float = Field(1e-6, ge=0, description="Relative tolerance for non-exact numbers.")

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return numeric_match(
            completion, answer, extract_=self.extract, marker=self.marker, rel_tol=self.rel_tol
        ), {}


@REWARDS.register
class MathAnswer(RewardPart):
    """math-verify's parse + verify (LaTeX, \\boxed{}, plain numbers), or the built-in fallback."""

    fn: Literal["math"]
    fallback: bool = Field(
        True,
        description="Without math-verify installed, use the built-in normaliser (last \\boxed{} "
        "or number); false: refuse to start without math-verify.",
    )

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return math_answer(completion, answer, fallback=self.fallback), {}

    def warm(self, ctx: dict[str, Any]) -> None:
        math_answer("1", "1", fallback=self.fallback)  # imports math-verify (seconds)

    def check(self, key: str) -> None:
        if not self.fallback and importlib.util.find_spec("math_verify") is None:
            raise ConfigError(
                f"{key}: needs math-verify: pip install 'flywheel[math]' (or set fallback = true)"
            )


@REWARDS.register
class Gsm8kAnswer(RewardPart):
    """GSM8K: the number after the completion's last '####' equals the reference's."""

    text_only: ClassVar[bool] = True
    fn: Literal["gsm8k"]
    strict: bool = Field(
        True, description="Require '#### n' in the completion; false: fall back to its last number."
    )

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return gsm8k_answer(completion, answer, strict=self.strict), {}


@REWARDS.register
class FormatReward(RewardPart):
    """1 if the completion matches a regular expression (an answer tag present, well-formed)."""

    text_only: ClassVar[bool] = True
    fn: Literal["format"]
    pattern: str = Field(
        r"<answer>.+?</answer>", description="Python regular expression searched for."
    )
    full_match: bool = Field(False, description="The whole completion must match, not a part.")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from e
        return v

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        return format_reward(completion, pattern=self.pattern, full_match=self.full_match), {}


@REWARDS.register
class SoftOverlong(RewardPart):
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then down to -1 at max."""

    text_only: ClassVar[bool] = True
    fn: Literal["soft_overlong"]
    max_tokens: int = Field(ge=1, description="L_max: responses this long or longer score -1.")
    buffer_tokens: int = Field(ge=1, description="L_cache: the length of the linear ramp.")

    @model_validator(mode="after")
    def _buffer_fits(self) -> SoftOverlong:
        if self.buffer_tokens > self.max_tokens:
            raise ValueError("buffer_tokens must be <= max_tokens")
        return self

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        n = int(ctx["response_tokens"])
        return soft_overlong(n, max_tokens=self.max_tokens, buffer_tokens=self.buffer_tokens), {}


@REWARDS.register
class CustomReward(RewardPart):
    """A user function `fn(completion, answer, **kwargs)` -> float | (float, parts) | dict."""

    tag: ClassVar[str] = "custom"  # any 'pkg.module:function' (registry._reward_tag)
    calls_code: ClassVar[bool] = True

    fn: str = Field(pattern=FN_PATH, description="'pkg.module:function'.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of fn.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables fn sees; the sandbox's environment is otherwise "
        "empty (never the service's: it holds credentials).",
    )

    def value(
        self, completion: str, answer: str | None, ctx: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        from services.sandbox import environment, resolve, to_reward

        with environment(self.env):
            r = to_reward(resolve(self.fn)(completion, answer, **self.kwargs))
        return r.reward, r.parts

    def sandbox_modules(self) -> tuple[str, ...]:
        return (*super().sandbox_modules(), self.fn.partition(":")[0])

    def warm(self, ctx: dict[str, Any]) -> None:
        from services.sandbox import resolve

        resolve(self.fn)

    def check(self, key: str) -> None:
        from services.tasks.sources import import_function

        import_function(self.fn, f"{key}.fn")


# ── the weighted sum (what the sandbox runs) ─────────────────────────────────
def score(
    parts: list[dict[str, Any]], completion: str, answer: str | None, ctx: dict[str, Any]
) -> dict[str, Any]:
    """Σ weight·value over `parts`; every part's value in "parts" (sub-parts as name.sub)."""
    total = 0.0
    values: dict[str, float] = {}
    for fields in parts:
        part = REWARDS.rebuild(fields)
        value, sub = part.value(completion, answer, ctx)
        name = part.part_name
        values[name] = value
        values.update({f"{name}.{k}": v for k, v in sub.items()})
        total += part.weight * value
    return {"reward": total, "parts": values}


def warm(parts: list[dict[str, Any]], ctx: dict[str, Any]) -> float:
    """Run in every new sandbox child before it serves: import what the parts need
    (custom functions, math-verify) and build a reasoning-gym dataset or a verifiers
    env, so a completion's time limit is spent scoring it, not importing."""
    for fields in parts:
        REWARDS.rebuild(fields).warm(ctx)
    return 1.0


SCORE = "services.tasks.rewards:score"
WARM = "services.tasks.rewards:warm"


# Flywheel's own function rewards that read the completion only as text (no eval, no
# state kept): trusted as the text-only built-ins are (`pure`).
TEXT_ONLY_FUNCTIONS = frozenset(
    {"services.tasks.last_word:brevity_credit", "services.tasks.last_word:names_the_word"}
)


def pure(parts: list[dict[str, Any]]) -> bool:
    """Every part is one of this module's built-ins that read the completion only as text
    (`RewardPart.text_only`), or one of TEXT_ONLY_FUNCTIONS: the sandbox scores a group
    of such completions in one process (`text_reader`, services/sandbox/pool.py) instead
    of a process each.
    A class or function defined elsewhere, a user's included, never is: only
    Flywheel's own code is trusted not to run the completion or leave state behind."""
    for p in parts:
        if isinstance(p, dict) and p.get("fn") in TEXT_ONLY_FUNCTIONS and not p.get("env"):
            continue
        cls = REWARDS.kinds.get(str(p.get("fn"))) if isinstance(p, dict) else None
        if cls is None or not cls.text_only or cls.__module__ != __name__:
            return False
    return True


# What the sandbox runs of this module: every child imports it before it serves, and a
# group of text-only parts shares one process.
every_child_imports(__name__)
text_reader(SCORE, None, pure)
