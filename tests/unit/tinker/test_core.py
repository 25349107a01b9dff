"""The Tinker service's pure core: each bad request's typed error, and the request log."""

from __future__ import annotations

import numpy as np
import pytest

from services.tinker.core import (
    BadShape,
    Datum,
    Limits,
    RequestLog,
    SampleSpec,
    State,
    TinkerUserError,
    TooLarge,
    UnknownName,
    UnsupportedLoss,
    check_batch,
    check_rank,
    check_sample,
    datum_batches,
)

LIMITS = Limits(
    max_datums=4, max_tokens=16, vocab_size=100, max_num_samples=8, max_sample_tokens=8,
    max_rank=32,
)  # fmt: skip


def ce(n: int = 5, **inputs: np.ndarray) -> Datum:
    base = {"target_tokens": np.arange(n, dtype=np.int64), "weights": np.ones(n, np.float32)}
    return Datum(tokens=tuple(range(n)), inputs={**base, **inputs})


def test_a_good_batch_passes() -> None:
    check_batch("cross_entropy", [ce(), ce(3)], LIMITS)
    targets = ce().inputs["target_tokens"]
    is_inputs = {"logprobs": np.zeros(5, np.float32), "advantages": np.ones(5, np.float32)}
    check_batch(
        "importance_sampling", [Datum(ce().tokens, {"target_tokens": targets, **is_inputs})], LIMITS
    )


@pytest.mark.parametrize("loss", ["stable_reinforce", "custom"])
def test_an_sdk_loss_not_run_here_is_named_with_what_is(loss: str) -> None:
    with pytest.raises(UnsupportedLoss, match=f"'{loss}' is one the SDK names") as e:
        check_batch(loss, [ce()], LIMITS)
    assert "cross_entropy, importance_sampling, ppo, cispo, dro, gspo" in str(e.value)


def test_gspo_needs_its_mask_on_some_token_and_both_thresholds() -> None:
    from services.tinker.core import BadLossConfig

    def gspo(mask: list[float]) -> Datum:
        rl = {"logprobs": np.zeros(3, np.float32), "advantages": np.ones(3, np.float32),
              "sequence_ratio_mask": np.array(mask, np.float32)}  # fmt: skip
        return Datum((1, 2, 3), {"target_tokens": np.arange(3, dtype=np.int64), **rl})

    band = {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}
    check_batch("gspo", [gspo([0.0, 1.0, 1.0])], LIMITS, band)
    with pytest.raises(BadShape, match=r"datum 1: .*'sequence_ratio_mask'.*nonzero"):
        check_batch("gspo", [gspo([1.0, 0.0, 0.0]), gspo([0.0, 0.0, 0.0])], LIMITS, band)
    with pytest.raises(BadShape, match="'sequence_ratio_mask'"):
        no_mask = gspo([1.0, 1.0, 1.0])
        inputs = {k: v for k, v in no_mask.inputs.items() if k != "sequence_ratio_mask"}
        check_batch("gspo", [Datum(no_mask.tokens, inputs)], LIMITS, band)
    with pytest.raises(BadLossConfig, match="'clip_low_threshold' is required"):
        check_batch("gspo", [gspo([1.0, 1.0, 1.0])], LIMITS)


def test_an_unknown_loss_is_not_one_the_sdk_names() -> None:
    with pytest.raises(UnsupportedLoss, match="'mse' is not a loss the SDK names"):
        check_batch("mse", [ce()], LIMITS)


def test_a_wrong_shape_names_the_datum_the_key_and_both_shapes() -> None:
    with pytest.raises(BadShape, match=r"datum 1: loss_fn_inputs\['weights'\].*\[5\].*\[4\]"):
        check_batch("cross_entropy", [ce(), ce(weights=np.ones(4, np.float32))], LIMITS)


def test_missing_and_extra_inputs() -> None:
    with pytest.raises(BadShape, match="'advantages'"):
        check_batch("importance_sampling", [ce(logprobs=np.zeros(5, np.float32))], LIMITS)
    with pytest.raises(BadShape, match=r"'advantages'.*an extra key"):
        check_batch("cross_entropy", [ce(advantages=np.zeros(5, np.float32))], LIMITS)


def test_oversized_batches_name_the_limit_and_its_key() -> None:
    with pytest.raises(
        TooLarge, match=r"datum count is 5, .* limit of 4 \(\[tinker\] max_datums\)"
    ):
        check_batch("cross_entropy", [ce()] * 5, LIMITS)
    with pytest.raises(TooLarge, match=r"length is 17, .* limit of 16 \(\[tinker\] max_tokens\)"):
        check_batch("cross_entropy", [ce(17)], LIMITS)


def test_token_ids_outside_the_vocabulary() -> None:
    with pytest.raises(TinkerUserError, match="outside the vocabulary"):
        check_batch("cross_entropy", [Datum((1, 100), ce(2).inputs)], LIMITS)
    with pytest.raises(BadShape, match="target_tokens"):
        check_batch("cross_entropy", [ce(2, target_tokens=np.array([1, -1]))], LIMITS)


def spec(**kw: object) -> SampleSpec:
    base: dict[str, object] = dict(
        prompt=(1, 2, 3), num_samples=2, max_tokens=4, temperature=1.0, top_k=-1, top_p=1.0,
        seed=None, stop_tokens=None, stop_strings=(), prompt_logprobs=False,
    )  # fmt: skip
    return SampleSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_sample_limits() -> None:
    check_sample(spec(), LIMITS)
    with pytest.raises(TooLarge, match=r"num_samples is 9.*max_num_samples"):
        check_sample(spec(num_samples=9), LIMITS)
    with pytest.raises(TooLarge, match=r"max_tokens is 9.*max_sample_tokens"):
        check_sample(spec(max_tokens=9), LIMITS)
    with pytest.raises(TinkerUserError, match="top_k"):
        check_sample(spec(top_k=0), LIMITS)
    with pytest.raises(TinkerUserError, match="the prompt is empty"):
        check_sample(spec(prompt=()), LIMITS)
    with pytest.raises(TooLarge, match="lora rank is 64"):
        check_rank(64, LIMITS)


def test_the_log_answers_a_retry_with_the_first_request() -> None:
    log = RequestLog()
    first, fresh = log.open("m1", "train", 1)
    assert fresh and first.state is State.PENDING
    again, fresh_again = log.open("m1", "train", 1)
    assert again is first and not fresh_again
    other, fresh_other = log.open("m2", "train", 1)  # another model's seq_id 1: its own
    assert fresh_other and other.request_id != first.request_id
    log.complete(first, {"metrics": {}})
    assert log.get(first.request_id).state is State.DONE
    assert log.open("m1", "train", None)[1] and log.open("m1", "train", None)[1]  # no seq_id
    with pytest.raises(UnknownName, match="req-x"):
        log.get("req-x")


def test_loss_config_defaults_overrides_and_each_bad_one_named() -> None:
    from services.tinker.core import BadLossConfig, loss_config

    assert loss_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert loss_config("cispo", {"clip_high_threshold": 2.0}) == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 2.0,
    }
    assert loss_config("dro", {"beta": 0.05}) == {"beta": 0.05}
    bad: list[tuple[str, dict[str, float | str], str]] = [
        ("dro", {}, "'beta' is required"),
        ("ppo", {"clip_ratio": 0.2}, "'clip_ratio' is not one of its keys"),
        ("ppo", {"clip_low_threshold": "low"}, "must be a finite number"),
        ("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0}, "0 <= clip_low"),
        ("cross_entropy", {"beta": 1.0}, "its keys: none"),
    ]
    for loss, given, message in bad:
        with pytest.raises(BadLossConfig, match=message):
            loss_config(loss, given)
    with pytest.raises(BadLossConfig, match="'beta' is required"):
        check_batch("dro", [ce()], LIMITS, {})


def test_datum_batches_pack_shortest_first_under_the_token_budget() -> None:
    # Sorted: 3 (i1), 5 (i0), 5 (i3), 9 (i2), 20 (i4). Rows x the longest row <= 16:
    # [3, 5, 5] is 15, a fourth row of 9 would be 36; [9] then a row of 20 would be 40.
    assert datum_batches([5, 3, 9, 5, 20], 16, max_padding=1.0) == [[1, 0, 3], [2], [4]]
    # Every datum exactly once, whatever the budget; a budget of 1 runs each alone.
    assert datum_batches([5, 3, 9], 1) == [[1], [0], [2]]
    assert datum_batches([4] * 6, 4 * 6) == [list(range(6))]
    assert datum_batches([], 8) == []


def test_datum_batches_start_a_new_batch_rather_than_pad_much() -> None:
    # [60, 61, 62]: 186 tokens, 3 of them padding (1.6%); a 70 would pad 27 of 280.
    assert datum_batches([60, 70, 61, 62, 71], 4096, max_padding=0.05) == [[0, 2, 3], [1, 4]]
    assert datum_batches([60, 70, 61, 62, 71], 4096, max_padding=0.2) == [[0, 2, 3, 1, 4]]
