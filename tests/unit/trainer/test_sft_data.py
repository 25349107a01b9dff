"""The arithmetic SFT data's plausible mistakes (services/tasks/arithmetic_sft.py), and SFT
files' segments (services/trainer/sft/data.py)."""

from __future__ import annotations

import json

import pytest

from services.tasks.arithmetic_sft import (
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


def test_a_segmented_completion_masks_the_segments_not_trained_on(tmp_path) -> None:
    from services.models.tiny_model import build_tokenizer
    from services.trainer.sft.data import load_sft_file

    tok = build_tokenizer()
    path = tmp_path / "traces.jsonl"
    segments = [
        {"text": "<c>2*3</c>"},
        {"text": "<r>6</r>", "train": False},
        {"text": "<a>6</a>"},
    ]
    path.write_text(json.dumps({"prompt": "2*3=", "completion": segments}) + "\n")
    (ex,) = load_sft_file(path, tok)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # each segment tokenised apart, as an episode's turns and observations are
    assert ex.input_ids.tolist() == enc("2*3=") + enc("<c>2*3</c>") + enc("<r>6</r>") + enc(
        "<a>6</a>"
    ) + [tok.eos_token_id]
    mask = [0] * 4 + [1] * 10 + [0] * 8 + [1] * 8 + [1]
    assert ex.loss_mask.tolist() == mask


@pytest.mark.parametrize(
    ("completion", "error"),
    [
        ([], "non-empty list"),
        ([{"txt": "a"}], "segment 0 must be an object with a string 'text'"),
        ([{"text": "a"}, {"text": "b", "train": "no"}], "segment 1: 'train' must be"),
    ],
)
def test_a_malformed_segment_names_the_line_and_the_segment(tmp_path, completion, error) -> None:
    from services.models.tiny_model import build_tokenizer
    from services.trainer.sft.data import SftDataError, load_sft_file

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "x", "completion": completion}) + "\n")
    with pytest.raises(SftDataError, match=f"bad.jsonl:1: .*{error}"):
        load_sft_file(path, build_tokenizer())
