"""The local stack's pure parts: what `flywheel up` starts, and the status line."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from services.stack.plan import plan
from services.stack.settings import StackSettings
from services.stack.status import RateWindow, Status, parse, render_line, summarise

PORTS = itertools.count(20000)


def test_plan_orders_services_and_wires_each_worker_to_its_engine(tmp_path: Path) -> None:
    s = StackSettings(run="r1", run_dir=tmp_path, model=tmp_path / "m", engines=2)
    specs = plan(s, tmp_path / "run.toml", "nats://127.0.0.1:4222", lambda: next(PORTS))
    kinds = [p.kind for p in specs]
    assert kinds == ["engine", "engine", "rollout", "rollout", "sync", "trainer", "buffer"]
    engines = {p.name: p for p in specs if p.kind == "engine"}
    for w in (p for p in specs if p.kind == "rollout"):
        url = w.env["FLYWHEEL_ROLLOUT_ENGINE_URL"]
        eid = w.env["FLYWHEEL_ROLLOUT_ENGINE_ID"]
        assert engines[eid].ready_url == f"{url}/health_generate"  # a real generation
        assert w.env["FLYWHEEL_ROLLOUT_NATS__URL"] == "nats://127.0.0.1:4222"
        assert w.ready_url is not None and w.ready_url.endswith("/readyz")
    ports = [p.ready_url for p in specs]
    assert len(set(ports)) == len(ports)  # every process its own port
    trainer = next(p for p in specs if p.kind == "trainer")
    assert trainer.argv[1:3] == ("-m", "services.trainer")


def test_plan_subset_and_torchrun(tmp_path: Path) -> None:
    s = StackSettings(run_dir=tmp_path, services=("trainer", "sync"), trainer_nproc=2)
    specs = plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))
    assert [p.kind for p in specs] == ["sync", "trainer"]
    assert "torch.distributed.run" in specs[1].argv
    assert "--nproc_per_node=2" in specs[1].argv


def test_plan_steps_make_the_trainer_stop_itself(tmp_path: Path) -> None:
    """`flywheel up --steps N`: the trainer is given max_steps and its exit ends the run."""
    s = StackSettings(run_dir=tmp_path, services=("trainer", "sync"))
    trainer = plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS), max_steps=3)[-1]
    assert trainer.env["FLYWHEEL_TRAINER_MAX_STEPS"] == "3" and trainer.finishes
    free = plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))[-1]
    assert "FLYWHEEL_TRAINER_MAX_STEPS" not in free.env and not free.finishes


TRAINER = """
# TYPE flywheel_trainer_step gauge
flywheel_trainer_step 12
# TYPE flywheel_trainer_reward_mean gauge
flywheel_trainer_reward_mean 0.75
# TYPE flywheel_trainer_idle_fraction gauge
flywheel_trainer_idle_fraction 0.25
"""
ROLLOUT = """
# TYPE flywheel_rollout_samples counter
flywheel_rollout_samples_total{finish="stop"} 90
flywheel_rollout_samples_total{finish="length"} 10
# TYPE flywheel_messages_dead_lettered counter
flywheel_messages_dead_lettered_total{reason="stale",service="rollout",subject="s"} 3
flywheel_messages_dead_lettered_total{reason="malformed",service="rollout",subject="s"} 2
"""
SYNC = """
# TYPE flywheel_sync_engine_version gauge
flywheel_sync_engine_version{engine="engine-0"} 12
flywheel_sync_engine_version{engine="engine-1"} 11
"""
BUFFER = """
# TYPE flywheel_buffer_groups counter
flywheel_buffer_groups_total{verdict="accepted"} 180
flywheel_buffer_groups_total{verdict="zero_variance"} 16
flywheel_buffer_groups_total{verdict="stale"} 4
flywheel_buffer_groups_total{verdict="duplicate"} 7
# TYPE flywheel_buffer_group_tokens counter
flywheel_buffer_group_tokens_total{verdict="stale"} 96
flywheel_buffer_group_tokens_total{verdict="accepted"} 4000
# TYPE flywheel_buffer_unscored_samples counter
flywheel_buffer_unscored_samples_total 5
"""


def test_status_line_shows_stale_drops_as_a_share_of_generated_groups() -> None:
    now = summarise({"buffer": parse(BUFFER)})
    assert (now.groups, now.stale, now.stale_tokens) == (200, 4, 96)  # duplicates not counted
    assert "stale 4 (2.0%)" in render_line(now, None)
    assert "unscored 5 |" in render_line(now, None)  # rewards that could not be computed
    assert "stale 0 |" in render_line(Status(), None)  # nothing received yet: no share


def test_summary_and_status_line() -> None:
    now = summarise({"trainer": parse(TRAINER), "rollout-0": parse(ROLLOUT), "sync": parse(SYNC)})
    assert now.step == 12 and now.reward == 0.75 and now.samples_total == 100
    assert now.engines == {"engine-0": 12, "engine-1": 11}
    assert (now.filtered, now.dead_letters) == (3, 2)
    before = Status(samples_total=50, at=now.at - 10)
    line = render_line(now, before)
    assert "step 12" in line and "samples/s 5.0" in line and "trainer idle 25%" in line
    assert "engine-0=v12 engine-1=v11" in line
    assert "acc none yet" in line  # never evaluated (and never "acc 0.000")
    assert "mismatch - |" in line  # never measured


def test_status_line_shows_the_train_inference_mismatch() -> None:
    gauges = TRAINER + (
        "flywheel_trainer_mismatch_abs_mean 0.0123\n"
        "flywheel_trainer_mismatch_abs_max 0.31\n"
        "flywheel_trainer_mismatch_k3 0.00021\n"
    )
    now = summarise({"trainer": parse(gauges)})
    assert now.mismatch == (0.0123, 0.31, 0.00021)
    assert "mismatch |Δlogp| 0.012 max 0.31 k3 2.1e-04 |" in render_line(now, None)
    zeros = TRAINER + "flywheel_trainer_mismatch_abs_mean 0\nflywheel_trainer_mismatch_abs_max 0\n"
    assert (
        summarise({"trainer": parse(zeros + "flywheel_trainer_mismatch_k3 0\n")}).mismatch is None
    )


def test_flywheel_status_shows_stale_drops_against_groups_generated() -> None:
    from services.stack.inspect import render_status

    s = {
        "run": "r",
        "streams": {"FLYWHEEL_r_SAMPLES": {"messages": 400, "last_seq": 400}},
        "dead_letters": {"stale": 6, "zero_variance": 30},
    }
    assert "stale drops: 6 of 400 groups generated (1.5%)" in render_status(s)
    s["streams"] = {}  # nothing generated yet: no line rather than a division by zero
    assert "stale drops" not in render_status(s)


def samples_per_s(line: str) -> float | None:
    shown = line.split("samples/s ")[1].split(" ")[0]
    return None if shown == "-" else float(shown)


def test_samples_per_second_spans_steps_of_a_slow_trainer() -> None:
    """A trainer step every 15 s; the workers generate its 32 samples in the 2 s after each
    weight version, then wait. Status every 2 s: line to line, the rate read 0.0 most of the
    time; over a window spanning two steps it reads the run's rate, about 32/15 per second."""
    window = RateWindow()
    last = None
    shown, line_to_line = [], []
    for tick in range(1, 60):
        t = 2.0 * tick
        step = int(t // 15)
        done = step * 32 + min(32, int((t - 15 * step) / 2 * 32))
        now = Status(step=step, samples_total=done, at=1000.0 + t)
        if last is not None:
            line_to_line.append(samples_per_s(render_line(now, last)))
        shown.append((t, samples_per_s(render_line(now, window.start(now)))))
        last = now
    assert sum(r == 0.0 for r in line_to_line) > len(line_to_line) / 2  # what it showed
    assert shown[0][1] is None  # nothing before the first line
    steady = [r for t, r in shown if t > 45]
    assert steady and all(r is not None and 1.4 <= r <= 3.2 for r in steady), steady
    assert len(window.seen) < 30  # only the window is kept


def test_samples_per_second_after_a_worker_restart_is_not_negative() -> None:
    window = RateWindow(min_s=0.0)
    window.start(Status(step=1, samples_total=500, at=0.0))
    assert window.start(Status(step=1, samples_total=20, at=2.0)) is None  # counter began again


def test_plan_starts_the_teacher_engines_and_gives_every_worker_their_urls(
    tmp_path: Path,
) -> None:
    from services.engine_api.teacher import TeacherSettings

    t = TeacherSettings(model=tmp_path / "teacher", engines=2, engine_threads=3)
    s = StackSettings(run_dir=tmp_path, model=tmp_path / "m", engines=2, teacher=t)
    specs = plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))
    kinds = [p.kind for p in specs]
    assert kinds[:4] == ["engine", "engine", "teacher", "teacher"]
    teachers = [p for p in specs if p.kind == "teacher"]
    assert all(str(tmp_path / "teacher") in p.argv for p in teachers)
    assert all(p.env["FLYWHEEL_ENGINE_NUM_THREADS"] == "3" for p in teachers)
    urls = [(p.ready_url or "").removesuffix("/health_generate") for p in teachers]
    for w in (p for p in specs if p.kind == "rollout"):
        assert json.loads(w.env["FLYWHEEL_ROLLOUT_TEACHER_URLS"]) == urls
    plain = plan(StackSettings(run_dir=tmp_path), tmp_path / "r.toml", "nats://x:1", lambda: 1)
    assert not any("FLYWHEEL_ROLLOUT_TEACHER_URLS" in p.env for p in plain)
