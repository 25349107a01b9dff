"""`flywheel up` with an LLM judge: its engines start first and every worker is given them."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from services.stack.plan import plan
from services.stack.settings import StackSettings

PORTS = itertools.count(21000)
JUDGED = {
    "source": {"type": "arithmetic"},
    "reward": [{"fn": "exact_match"}, {"type": "judge", "rubric": "Grade {completion}"}],
}


def test_judge_engines_start_first_and_every_worker_asks_them(tmp_path: Path) -> None:
    s = StackSettings(run_dir=tmp_path, model=tmp_path / "m", engines=2, task=JUDGED,
                      judge={"engines": 2, "threads": 2, "urls": ["http://far:1"]})  # fmt: skip
    specs = plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))
    assert [p.kind for p in specs][:4] == ["judge", "judge", "engine", "engine"]
    judges = [p for p in specs if p.kind == "judge"]
    assert [p.name for p in judges] == ["judge-0", "judge-1"]
    for j in judges:  # the policy's base model by default, on the CPU, with its threads
        assert j.argv[j.argv.index("--model") + 1] == str(tmp_path / "m")
        assert j.env["FLYWHEEL_ENGINE_NUM_THREADS"] == "2" and j.ready_url
    urls = ["http://far:1", *((j.ready_url or "").removesuffix("/health_generate") for j in judges)]
    for w in (p for p in specs if p.kind == "rollout"):
        assert json.loads(w.env["FLYWHEEL_ROLLOUT_JUDGE__URLS"]) == urls


def test_no_judge_part_no_judge_engines(tmp_path: Path) -> None:
    task = {"source": {"type": "arithmetic"}}
    s = StackSettings(run_dir=tmp_path, engines=1, task=task, judge={"engines": 3})
    specs = plan(s, tmp_path / "run.toml", "nats://x:1", lambda: next(PORTS))
    assert "judge" not in [p.kind for p in specs]
    assert all("FLYWHEEL_ROLLOUT_JUDGE__URLS" not in p.env for p in specs)


def test_judge_model_and_urls_only(tmp_path: Path) -> None:
    s = StackSettings(run_dir=tmp_path, engines=1, task=JUDGED, judge={"model": "org/judge"})
    (j,) = [p for p in plan(s, tmp_path / "r.toml", "nats://x:1", lambda: next(PORTS))
            if p.kind == "judge"]  # fmt: skip
    assert j.argv[j.argv.index("--model") + 1] == "org/judge"
    given = StackSettings(run_dir=tmp_path, engines=1, task=JUDGED,
                          judge={"engines": 0, "urls": ["http://j:1"]})  # fmt: skip
    specs = plan(given, tmp_path / "r.toml", "nats://x:1", lambda: next(PORTS))
    assert "judge" not in [p.kind for p in specs]


def test_sglang_judges_on_gpus_of_their_own(tmp_path: Path) -> None:
    judge = {"engines": 2, "gpus": [[2], [3, 4]], "model": "/models/judge"}
    s = StackSettings(run_dir=tmp_path, model=tmp_path / "m", engine="sglang", engines=1,
                      engine_gpus=[[0]], trainer_gpus=[1], task=JUDGED, judge=judge)  # fmt: skip
    (tmp_path / "r.toml").write_text("")  # the rollout engines' LoRA keys: none
    judges = [p for p in plan(s, tmp_path / "r.toml", "nats://x:1", lambda: next(PORTS))
              if p.kind == "judge"]  # fmt: skip
    assert [j.gpus for j in judges] == [(2,), (3, 4)]
    for j, tp in zip(judges, ("1", "2"), strict=True):
        assert "sglang.launch_server" in " ".join(j.argv)
        assert j.argv[j.argv.index("--model-path") + 1] == "/models/judge"
        assert j.argv[j.argv.index("--tp-size") + 1] == tp
        assert j.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, j.gpus))


@pytest.mark.parametrize(
    ("judge", "why"),
    [({"engines": 2, "gpus": [[2]]}, "1 GPU lists for 2 judge engines"),
     ({"engines": 1, "gpus": [[0]]}, "given twice"),
     ({"engines": 1, "gpus": [[]]}, "empty GPU list")],
)  # fmt: skip
def test_a_bad_judge_gpu_map_is_refused(tmp_path: Path, judge: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        StackSettings(run_dir=tmp_path, engine="sglang", engines=1, engine_gpus=[[0]],
                      task=JUDGED, judge=judge)  # fmt: skip
    with pytest.raises(ValueError, match="only SGLang judge engines"):
        StackSettings(run_dir=tmp_path, task=JUDGED, judge={"gpus": [[1]]})
