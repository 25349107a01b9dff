"""The side-by-side bench's ratios: per second of training leaves each side's evaluations out,
and the median over seeds is shown beside every seed's own figure."""

from __future__ import annotations

from bench.learning_side_by_side import Side, across_seeds, ratios


def sides(fw_samples: int, trl_samples: int, trl_eval_s: float) -> list[Side]:
    fw = Side("Flywheel", ok=True, samples=fw_samples, curve=[(50.0, 0.8, 5, 40.0)])
    trl = Side("TRL GRPOTrainer", ok=True, samples=trl_samples, seconds=100.0,
               eval_seconds=trl_eval_s, curve=[(100.0, 0.8, 5, 80.0)])  # fmt: skip
    return [fw, trl]


def test_per_second_of_training_takes_out_trl_s_evaluations() -> None:
    r = ratios(sides(200, 100, trl_eval_s=50.0), budget=100.0, target=0.7)
    assert r["trained samples/s"] == 2.0  # 2.0 / 1.0 samples per budget second
    assert r["per second of training"] == 1.0  # 2.0 / (100 samples in 50 s of training)
    assert r["time to target, evaluated"] == 0.5  # 50 s / 100 s
    assert r["time to target, trained"] == 0.5  # 40 s / 80 s


def test_a_target_never_reached_is_no_ratio_and_left_out_of_the_median() -> None:
    never = sides(100, 100, 0.0)
    never[0].curve = [(50.0, 0.2, 5, 40.0)]
    per_seed = {0: ratios(sides(200, 100, 0.0), 100.0, 0.7), 1: ratios(never, 100.0, 0.7)}
    assert per_seed[1]["time to target, evaluated"] is None
    table = across_seeds(per_seed)
    assert "| time to target, evaluated | 0.50x | 0.50x | — | ≤ 0.7x |" in table
    assert "| trained samples/s | 1.50x | 2.00x | 1.00x | ≥ 1.3x |" in table
