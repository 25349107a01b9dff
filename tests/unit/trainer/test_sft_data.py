"""The arithmetic SFT data's plausible mistakes (services/trainer/sft/data.py)."""

from __future__ import annotations

import pytest

from services.trainer.sft.data import (
    add_without_carry,
    arithmetic_records,
    drop_final_carry,
    zero_final_carry,
)


def test_the_three_mistakes() -> None:
    assert add_without_carry(58, 67) == 15
    assert drop_final_carry(58, 67, 2) == 25
    assert zero_final_carry(58, 67, 2) == "025"
    assert zero_final_carry(99, 2, 2) == "001"  # the sum's width is kept
    assert zero_final_carry(12, 34, 2) == "46"  # no carry out of the tens: right


def test_zero_final_carry_records_are_wrong_only_where_the_sum_carries() -> None:
    recs = list(arithmetic_records(2000, seed=7, corrupt_fraction=0.6, corrupt="zero_final_carry"))
    wrong = right_wide = 0
    for rec in recs:
        a, b = (int(x) for x in rec["prompt"].rstrip("=").split("+"))
        if a + b < 100:
            assert rec["completion"] == str(a + b)
        elif rec["completion"] == str(a + b):
            right_wide += 1
        else:
            assert rec["completion"] == f"0{(a + b) % 100:02d}"
            wrong += 1
    assert wrong / (wrong + right_wide) == pytest.approx(0.6, abs=0.05)


def test_an_unknown_mistake_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown corruption"):
        next(arithmetic_records(1, seed=0, corrupt_fraction=0.5, corrupt="forgot_everything"))
