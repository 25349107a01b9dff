"""Fuzz every parser of external bytes with hypothesis, on a fixed budget.

Each target (tests/fuzz/fuzz_targets.py) gets arbitrary bytes and mutated
valid inputs (bit flips, truncation, splices, extra/missing/retyped fields,
another schema major or type name); only its documented typed errors may
escape. The budget is `FLYWHEEL_FUZZ_EXAMPLES` inputs per target and
strategy (default 150: a few seconds per target in CI); raise it for a
longer run, e.g. `FLYWHEEL_FUZZ_EXAMPLES=20000 pytest tests/fuzz`.
"""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.fuzz_targets import TARGETS, Target, check, mutate

EXAMPLES = int(os.environ.get("FLYWHEEL_FUZZ_EXAMPLES", "150"))
BUDGET = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # CI is stateless; a failure prints its reproducing input
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NAMES = sorted(TARGETS)


@pytest.mark.parametrize("name", NAMES)
def test_arbitrary_bytes_raise_only_typed_errors(name: str) -> None:
    target = TARGETS[name]

    @BUDGET
    @given(st.binary(max_size=2048))
    def run(data: bytes) -> None:
        check(target, data)

    run()


@pytest.mark.parametrize("name", NAMES)
def test_mutated_valid_inputs_raise_only_typed_errors(name: str) -> None:
    target = TARGETS[name]

    @BUDGET
    @given(st.sampled_from(target.seeds), st.integers(0, 2**32 - 1), st.integers(1, 4))
    def run(seed: bytes, rng_seed: int, rounds: int) -> None:
        rng = random.Random(rng_seed)
        data = seed
        for _ in range(rounds):
            data = mutate(data, rng)
        check(target, data)

    run()


@pytest.mark.parametrize("name", NAMES)
def test_seeds_are_valid(name: str) -> None:
    """The seeds parse: a mutation starts from a real input, not from noise."""
    target: Target = TARGETS[name]
    for seed in target.valid:
        target.run(seed)


def test_a_target_catches_what_it_should_not_allow() -> None:
    """`check` lets an undocumented error through (the fuzz tests can fail)."""
    boom = Target("boom", lambda b: {}["missing"], (ValueError,), (b"",))
    with pytest.raises(KeyError):
        check(boom, b"x")


@pytest.mark.parametrize(
    "sampling",
    [
        {"n": 10**9},  # found by fuzzing: minutes of CPU building 10**9 sequences
        {"n": 2**64 - 1},
        {"temperature": float("nan")},  # json.loads accepts NaN: NaN probabilities
        {"top_p": float("inf")},
        {"temperature": 10**400},  # OverflowError converting to float
    ],
)
def test_generate_regressions_are_refused_quickly(sampling: dict[str, object]) -> None:
    import json
    import time

    from services.engine.core.protocol import RequestError

    body = json.dumps({"text": "1+1=", "sampling_params": sampling}).encode()
    start = time.monotonic()
    with pytest.raises(RequestError):
        TARGETS["generate"].run(body)
    assert time.monotonic() - start < 1.0
