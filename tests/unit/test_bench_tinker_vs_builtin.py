"""The Tinker-vs-built-in bench's accounting of the API path: each future's polls and
try_agains counted against the request that opened it, the server's model-thread seconds
joined by request id, and the built-in side's flat groups read from its status line."""

from __future__ import annotations

from pathlib import Path

from bench.tinker_vs_builtin import http_summary, model_thread_seconds, overhead, status_figures

FB, OPT = "/api/v1/forward_backward", "/api/v1/optim_step"
POLL = "/api/v1/retrieve_future"


def records() -> list[dict[str, object]]:
    """A forward_backward polled twice (a try_again, then its result), an optim_step
    polled once, and a heartbeat with no future."""
    return [
        {"path": FB, "t": 100.0, "s": 0.01, "request_id": "r1", "try_again": False},
        {"path": OPT, "t": 100.1, "s": 0.02, "request_id": "r2", "try_again": False},
        {"path": POLL, "t": 100.2, "s": 10.0, "polled": "r1", "try_again": True},
        {"path": POLL, "t": 110.2, "s": 2.0, "polled": "r1", "try_again": False},
        {"path": POLL, "t": 100.3, "s": 12.5, "polled": "r2", "try_again": False},
        {"path": "/api/v1/session_heartbeat", "t": 101.0, "s": 0.003},
    ]


def test_each_future_counts_its_polls_and_its_time_to_result() -> None:
    kinds = http_summary(records(), {"r1": 11.5, "r2": 0.25})
    fb, opt = kinds[FB], kinds[OPT]
    assert (fb["requests"], fb["futures"], fb["polls"], fb["try_again"]) == (1, 1, 2, 1)
    assert fb["to_result_s_median"] == 12.2  # posted at 100.0, the result at 110.2 + 2.0
    assert fb["model_thread_s"] == 11.5
    assert (opt["polls"], opt["try_again"], opt["to_result_s_median"]) == (1, 0, 12.7)
    assert POLL not in kinds  # polls are counted under the request they waited on
    assert kinds["/api/v1/session_heartbeat"]["requests"] == 1


def test_the_overhead_is_training_less_the_model_thread() -> None:
    side = {"http": http_summary(records(), {"r1": 11.5, "r2": 0.25}),
            "steps": [{"train_s": 12.0, "sampling_s": 2.0}]}  # fmt: skip
    text = "\n".join(overhead(side))
    assert "model thread ran forward_backward + optim_step 11.8 s (98%)" in text
    assert "the rest, 0.2 s, is the API path" in text
    assert "3 retrieve_future polls, 1 of them answered try_again" in text


def test_log_and_status_lines_are_read(tmp_path: Path) -> None:
    log = tmp_path / "tinker.log"
    log.write_text(
        "2026-11-29T04:05:41.280Z tinker DEBUG flywheel.tinker: train r1: 8.125 s\n"
        "2026-11-29T04:05:41.290Z tinker INFO flywheel.tinker: session s created\n"
        "2026-11-29T04:05:42.000Z tinker DEBUG flywheel.tinker: train r2: 0.020 s\n"
    )
    assert model_thread_seconds(log) == {"r1": 8.125, "r2": 0.02}
    status = tmp_path / "status.log"
    status.write_text(
        "04:20:51 step 11 | reward 0.750 | samples/s 6.1 | flat 86% | filtered 57 | stale 0\n"
        "04:20:53 step - | reward - | samples/s 6.5 | flat 83% | filtered 61 | stale 0\n"
    )
    assert status_figures(status) == {
        "filtered_groups": 61.0,
        "flat_pct": 83.0,
        "generated_samples_per_s": 6.5,
    }
