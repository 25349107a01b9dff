"""The episode record (pure): tokens, mask, logprobs and weight-version spans across turns."""

from __future__ import annotations

from services.rollout.episodes import as_result
from services.tasks.episode import Episode, TurnOutput


def test_observations_join_the_span_of_the_turn_before_them() -> None:
    ep = Episode(prompt_ids=[1, 2])
    ep.add_turn(TurnOutput([5, 6], [-0.5, -0.25], "ab", "stop", 3, ((3, 0, 2),)))
    ep.add_observation([7, 8, 9], "obs")
    ep.add_turn(TurnOutput([10], [-1.0], "c", "stop", 4, ((4, 0, 1),)))
    assert ep.response_ids == [5, 6, 7, 8, 9, 10]
    assert ep.loss_mask == [1, 1, 0, 0, 0, 1]
    assert ep.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert ep.spans == [(3, 0, 5), (4, 5, 6)]
    r = as_result(ep, "x")
    assert [(s.version, s.start, s.end) for s in r.weight_versions] == ep.spans
    assert r.weight_version == 4 and r.completion_tokens == 3 and r.text == "abobsc"


def test_no_spans_when_a_turn_did_not_report_them() -> None:
    ep = Episode(prompt_ids=[1])
    ep.add_turn(TurnOutput([5], [-0.5], "a", "stop", 3, ((3, 0, 1),)))
    ep.add_observation([7], "o")
    ep.add_turn(TurnOutput([6], [-0.5], "b", "length", 3))  # an older engine
    assert as_result(ep, "x").weight_versions == ()
    assert ep.finish_type == "length" and ep.turns == 2
