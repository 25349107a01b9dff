"""The judge reward's pure parts: the spec, the request, the parser, the cache, the sum."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from services.sandbox import Reward
from services.tasks import judge as j
from services.tasks.registry import REWARDS
from services.tasks.spec import TaskSpec


def part(**kw: object) -> j.JudgeReward:
    return j.JudgeReward.model_validate({"fn": "judge", "rubric": "Grade: {completion}", **kw})


def test_type_judge_is_a_reward_part_and_mixes_with_verifiable_ones() -> None:
    spec = TaskSpec.model_validate({
        "source": {"type": "arithmetic"},
        "reward": [{"fn": "exact_match"},
                   {"type": "judge", "rubric": "Q {prompt} A {completion} R {answer}",
                    "weight": 0.5, "name": "style"}],
    })  # fmt: skip
    exact, judged = spec.reward
    assert isinstance(judged, j.JudgeReward) and judged.part_name == "style"
    assert judged.external and not exact.external
    assert "judge" in REWARDS.tags


@pytest.mark.parametrize(
    ("rubric", "why"),
    [("Grade it", "{completion}"), ("{completion} {secret}", "only"), ("{completion", "format")],
)
def test_a_bad_rubric_is_refused_at_start_up(rubric: str, why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        part(rubric=rubric)


def test_evaluation_decides_correct_on_the_first_verifiable_part() -> None:
    spec = TaskSpec.model_validate({
        "source": {"type": "arithmetic"},
        "reward": [{"type": "judge", "rubric": "{completion}"}, {"fn": "exact_match"}],
    })  # fmt: skip
    assert spec.correct_part == "exact_match"


def test_eval_part_may_not_be_a_judge() -> None:
    with pytest.raises(ValidationError, match="judge part"):
        TaskSpec.model_validate({
            "source": {"type": "arithmetic"},
            "reward": [{"fn": "exact_match"}, {"type": "judge", "rubric": "{completion}"}],
            "eval": {"part": "judge"},
        })  # fmt: skip


def test_request_fills_the_rubric_and_asks_greedily() -> None:
    p = part(rubric="P={prompt} C={completion} A={answer} {{x}}", system="be strict")
    body = j.request(p, "1+1=", "2 {not a field}", None)
    assert body["messages"] == [
        {"role": "system", "content": "be strict"},
        {"role": "user", "content": "P=1+1= C=2 {not a field} A= {x}"},
    ]
    assert body["temperature"] == 0.0 and body["max_tokens"] == 16 and "model" not in body
    # the key holds rubric, prompt and completion: any of them changes it
    k = j.request_key(body)
    assert k == j.request_key(j.request(p, "1+1=", "2 {not a field}", None))
    assert k != j.request_key(j.request(p, "1+1=", "3", None))
    assert k != j.request_key(j.request(p, "1+2=", "2 {not a field}", None))
    assert k != j.request_key(j.request(part(rubric="{completion}!"), "1+1=", "2", None))


@pytest.mark.parametrize(
    ("reply", "value"),
    [("7", 0.7), (" 10/10", 1.0), ("**8** out of 10.", 0.8), ("Score: 3. Reason: 9 words", 0.3),
     ("0", 0.0), ("score = 8, then Score: 6", 0.6), ("2.5\n", 0.25),
     ("I think 2.5", None), ("2 + 3", None), ("10 -", None),  # echoes, not verdicts
     ("no number", None), ("", None), ("11", None), ("-1", None), ("score: 12", None)],
)  # fmt: skip
def test_score_parser(reply: str, value: float | None) -> None:
    got = j.parse_reply(part(), reply)
    assert got == pytest.approx(value) if value is not None else got is None


@pytest.mark.parametrize(
    ("reply", "value"),
    [("Yes", 1.0), ("no.", 0.0), ("**YES** it is", 1.0), ("  No, because", 0.0),
     ("maybe", None), ("yesterday", None), ("The answer is yes", None)],
)  # fmt: skip
def test_yes_no_parser(reply: str, value: float | None) -> None:
    assert j.parse_reply(part(parse="yes_no"), reply) == value


def test_verdicts_join_the_weighted_sum_and_a_missing_one_unscores() -> None:
    a, b = part(name="a", weight=0.5), part(name="b", weight=2.0)
    base = Reward(1.0, {"exact_match": 1.0})
    ok = j.with_verdicts(base, [a, b], [j.Verdict(0.4), j.Verdict(1.0)])
    assert ok == Reward(1.0 + 0.2 + 2.0, {"exact_match": 1.0, "a": 0.4, "b": 1.0})
    bad = j.with_verdicts(base, [a, b], [j.Verdict(0.4), j.Verdict(None, j.TIMEOUT, "slow")])
    assert bad.reward == 0.0 and bad.reason == j.TIMEOUT and bad.error == "judge b: slow"
    failed = Reward(0.0, {}, "verifier timed out")  # the sandbox's error stays the sample's
    kept = j.with_verdicts(failed, [a], [j.Verdict(None, j.UNPARSABLE, "x")])
    assert kept.error == "verifier timed out" and kept.reason is None


def test_cache_is_bounded_least_recently_used() -> None:
    c = j.ReplyCache(2)
    c.put("a", "1")
    c.put("b", "2")
    assert c.get("a") == "1"  # a is now the most recent
    c.put("c", "3")
    assert (c.get("a"), c.get("b"), c.get("c"), len(c)) == ("1", None, "3", 2)
    off = j.ReplyCache(0)
    off.put("a", "1")
    assert off.get("a") is None


def test_equal_requests_in_flight_share_one_call_and_failures_are_not_kept() -> None:
    calls = 0

    async def slow() -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return "8"

    async def fails() -> str:
        nonlocal calls
        calls += 1
        raise j.JudgeCallFailed(j.TIMEOUT, "no answer")

    async def body() -> None:
        c = j.ReplyCache(8)
        got = await asyncio.gather(*(c.get_or_call("k", slow) for _ in range(5)))
        assert [r for r, _ in got] == ["8"] * 5 and sum(not hit for _, hit in got) == 1
        assert await c.get_or_call("k", slow) == ("8", True)
        for _ in range(2):
            with pytest.raises(j.JudgeCallFailed):
                await c.get_or_call("f", fails)

    asyncio.run(body())
    assert calls == 1 + 2


def test_judge_scores_counts_and_reports_unparsable_replies() -> None:
    replies = iter(["score: 9", "gibberish"])
    sent: list[dict[str, object]] = []

    async def chat(body: dict[str, object]) -> str:
        sent.append(body)
        return next(replies)

    async def body() -> list[list[j.Verdict]]:
        judge = j.Judge(chat, cache_size=16)
        return await judge.verdicts([part()], "p", ["good", "bad", "good"], None)

    (good,), (bad,), (again,) = asyncio.run(body())
    assert good.value == pytest.approx(0.9) and not good.cached
    assert bad.value is None and bad.reason == j.UNPARSABLE and "gibberish" in (bad.error or "")
    assert again.value == pytest.approx(0.9) and again.cached
    assert len(sent) == 2  # the third, equal to the first, came from the cache
