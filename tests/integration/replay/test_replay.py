"""`flywheel replay` on a real recorded run: re-train bit for bit, ablate, rescore, export.

One short real run per module, as `flywheel up` plans it (tests/harness/
stack.py): a tiny model, one CPU engine and its rollout worker, sync,
trainer (3 steps, every version kept) and buffer over a real nats-server
whose store is the run's `<run_dir>/nats`, as `flywheel up` keeps it. The
run then stops, NATS included: every replay below opens the stopped run's
store itself (no --nats), as a user replays a finished run.

The run is one a replay could most easily get wrong: its trainer drops
tokens at random (`covariance = "clip_cov"`) while held-out evaluations
sample (pass@2) on a thread beside its steps, and its only reward is an LLM
judge's (a real HTTP judge, tests/harness/judge.py, answering by a rule: a
digit anywhere scores 10 of 10), which a rescore must ask again.

The bit-exact check reads both weight directories here, byte for byte,
not only the command's own verdict.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from proto.messages import SampleGroup, TrainBatch, WeightsPublished
from proto.streams import stream_name
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from services.weights import published_dir
from tests.harness.judge import RUBRIC, JudgeServer, in_thread
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages
from tests.harness.up import QUIET_ENV, flywheel

RUN = "replayed"
STEPS = 3
S = Subjects(RUN)
OTHER = '{fn = "format", pattern = "[a-z]"}'  # rescore: a letter anywhere
AUTO_LR = 4e-5  # services/trainer/core/lr.py: any model up to 135M parameters
pytestmark = pytest.mark.slow


def digit_anywhere(completion: str) -> str:
    """The judge's rule: a reward that varies within a group even for an untrained model
    (the steps move), all or nothing (some sample scores 1.0)."""
    return "Score: 10" if re.search("[0-9]", completion) else "Score: 0"


# the judge's part alone; the evaluation samples 2 completions of 4 held-out prompts
TASK = f"""
[task]
source = {{ type = "arithmetic", digits = 1 }}
eval = {{ source = {{ type = "arithmetic", digits = 1, seed = 1000003 }}, size = 4, k = 2, \
max_new_tokens = 6 }}
[[task.reward]]
type = "judge"
name = "digit"
rubric = {json.dumps(RUBRIC)}
"""


def config_text(root: Path, model: Path, judge_url: str | None) -> str:
    """The run file; `judge_url` None: without [judge] urls (the engines are gone)."""
    judge = {"urls": [judge_url]} if judge_url else {}
    return run_file(
        RUN,
        stack=stack_table(root, model, engines=1, embedded_nats=True),
        buffer={"samples_per_prompt": 8, "groups_per_step": 2, "max_new_tokens": 6,
                "max_staleness": 1, "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
        engine={"num_threads": 1},
        judge={**judge, "engines": 0, "timeout_s": 10.0},
        # the default lr, "auto": the run and its replay each resolve it from the model;
        # Clip-Cov drops 30% of the loss tokens, drawn at random, while evaluations sample
        trainer={"publish_every": 1, "keep_checkpoints": 2, "max_steps": STEPS,
                 "eval_every": 1, "eval_max_share": 1.0,
                 "loss": {"covariance": "clip_cov", "clip_cov_fraction": 0.3,
                          "clip_cov_band": [-1e9, 1e9]},
                 "runtime": {"cpu_threads": 1}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "keep_last": 10},
    ) + TASK  # fmt: skip


@dataclass(frozen=True)
class Recorded:
    root: Path
    config: Path
    groups: list[SampleGroup]
    batches: list[TrainBatch]
    published: int  # WeightsPublished messages the run stored
    judge: JudgeServer  # still answering, at judge_url, for the rescores
    judge_url: str
    model: Path


@pytest.fixture(scope="module")
def recorded(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recorded]:
    """A finished run: 3 steps trained, every process stopped, NATS too (its store kept)."""
    root = tmp_path_factory.mktemp("replay")
    config = root / "run.toml"
    judge = JudgeServer(rule=digit_anywhere)
    with in_thread(judge) as judge_url:
        config.write_text(config_text(root, tiny_model, judge_url))
        yield from _record(root, config, judge, judge_url, tiny_model)


def _record(
    root: Path, config: Path, judge: JudgeServer, judge_url: str, model: Path
) -> Iterator[Recorded]:
    with NatsServer(store_dir=root / "nats") as nats:
        with Stack(config, nats.url) as st, printing_logs_on_failure(st):
            st.start("engine-0", "rollout-0")  # the worker waits for its engine
            st.start("sync", "trainer")
            st.start("buffer")
            wait_for(lambda: st.trained_steps() >= STEPS, 240, f"{STEPS} steps trained")
            wait_for(lambda: not st["trainer"].alive, 60, "the trainer stops at max_steps")
        groups = messages(nats.url, RUN, "SAMPLES", S.samples, SampleGroup)
        batches = messages(nats.url, RUN, "BATCHES", S.batches, TrainBatch)
        published = messages(nats.url, RUN, "WEIGHTS", S.weights_published, WeightsPublished)
    for v in range(1, STEPS + 1):
        assert (published_dir(root / "weights", RUN, v) / "model.safetensors").is_file(), v
    # training moved the weights (else equal weights would prove little): a step with a
    # gradient, and Adam's momentum moves every version after it
    rows = [json.loads(ln) for ln in (root / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("grad_norm", 0) > 0 for r in rows if r["step"] < STEPS), rows
    assert weights(root, STEPS) != weights(root, STEPS - 1)
    # "auto" on the tiny model: the top clamp, said once at start-up, trained at
    assert {r["lr"] for r in rows if "batch_id" in r} == {AUTO_LR}, rows
    assert "trainer: lr auto -> 4.0e-05" in (root / "logs" / "trainer.log").read_text()
    # every step drew (Clip-Cov dropped some of its tokens) and evaluations ran beside them
    assert all(0 < r["clip_cov_frac"] < 1 for r in rows if "batch_id" in r), rows
    assert any("eval_pass_at_k" in r and r["step"] > 0 for r in rows), rows
    yield Recorded(root, config, groups, batches, len(published), judge, judge_url, model)


def replay(*args: str, timeout: float = 300) -> tuple[int, str]:
    p = flywheel("replay", *args, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def weights(root: Path, v: int) -> bytes:
    return (published_dir(root / "weights", RUN, v) / "model.safetensors").read_bytes()


def test_replay_with_the_run_settings_gives_its_weights_bit_for_bit(recorded: Recorded) -> None:
    """Clip-Cov's random drops included, with evaluations sampling beside the steps in the
    run and in the replay, each at its own moments."""
    out = recorded.root / "replay-same"
    code, text = replay("train", "-c", str(recorded.config), "--out", str(out))
    assert code == 0, text
    assert f"{STEPS} versions equal to the run's, bit for bit" in text, text
    for v in range(1, STEPS + 1):  # read here, not only the command's verdict
        assert weights(out, v) == weights(recorded.root, v), f"v{v} differs"
    assert not published_dir(out / "weights", RUN, STEPS + 1).exists()  # the run's step count
    # the same batches, in the same order, as the run trained
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    run_rows = [json.loads(ln) for ln in (recorded.root / "metrics.jsonl").read_text().splitlines()]
    trained = [r["batch_id"] for r in rows if "batch_id" in r]
    assert trained == [r["batch_id"] for r in run_rows if "batch_id" in r][:STEPS]
    assert {r["lr"] for r in rows if "batch_id" in r} == {AUTO_LR}  # resolved alike
    report = json.loads((out / "replay.json").read_text())
    assert all(v["bytes_equal"] for v in report["versions"]), report
    assert report["replay"]["steps"] == STEPS and report["original"]["steps"] == STEPS
    # the replay announced nothing on the run's streams
    with NatsServer(store_dir=recorded.root / "nats") as nats:
        published = messages(nats.url, RUN, "WEIGHTS", S.weights_published, WeightsPublished)
    assert len(published) == recorded.published


def test_a_replay_with_another_setting_is_an_ablation_on_the_same_batches(
    recorded: Recorded,
) -> None:
    """Another seed of the trainer's generator: Clip-Cov drops other tokens, so the weights
    differ (the run's randomness decides them: the bit-for-bit replay above says something)."""
    out = recorded.root / "replay-seed"
    code, text = replay(
        "train", "-c", str(recorded.config), "--out", str(out), "--set", "runtime.seed=7"
    )
    assert code == 0, text
    assert "ablation (runtime.seed=7)" in text, text
    # from the first step with a gradient on, every version differs; the last one surely
    assert weights(out, STEPS) != weights(recorded.root, STEPS), "another seed, the same weights"
    assert f"v{STEPS}: differs" in text, text
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch_id"] for r in rows if "batch_id" in r] == [
        b.batch_id for b in recorded.batches
    ][:STEPS]
    # refuses to write over a replay (its checkpoints would be resumed, not replayed)
    code, text = replay("train", "-c", str(recorded.config), "--out", str(out))
    assert code == 2 and "already holds a replay" in text, text


def test_a_replay_that_compared_nothing_fails(recorded: Recorded) -> None:
    """A version the replay did not write, or none written at all, is a failure with one
    line saying so, never "not compared" and a pass."""
    quick = ["--set", "publish_every=2", "--set", "eval_every=0"]
    code, text = replay("train", "-c", str(recorded.config), "--out",
                        str(recorded.root / "replay-none"), "--steps", "1", *quick)  # fmt: skip
    assert code == 1, text
    assert "the replay wrote no version (v1..v1): nothing was compared" in text, text
    code, text = replay("train", "-c", str(recorded.config), "--out",
                        str(recorded.root / "replay-half"), "--steps", "2", *quick)  # fmt: skip
    assert code == 1, text
    assert "the replay wrote no weights for versions [1], which the run has" in text, text


def test_export_writes_every_recorded_sample_to_parquet_and_datasets(recorded: Recorded) -> None:
    import pyarrow.parquet as pq
    from datasets import load_from_disk

    pq_path, ds_path = recorded.root / "samples.parquet", recorded.root / "samples-ds"
    code, text = replay(
        "export", "-c", str(recorded.config), "--parquet", str(pq_path), "--dataset", str(ds_path)
    )
    assert code == 0, text
    rows = pq.read_table(pq_path).to_pylist()
    samples = {s.sample_id: (g, s) for g in recorded.groups for s in g.samples}
    assert sorted(r["sample_id"] for r in rows) == sorted(samples)
    trained = {g.group_id: b.step for b in recorded.batches for g in b.groups}
    for r in rows:
        g, s = samples[r["sample_id"]]
        assert r["response_ids"] == list(memoryview(s.response_ids).cast("i"))
        assert r["prompt_ids"] == list(memoryview(s.prompt_ids).cast("i"))
        assert r["logprobs"] == list(memoryview(s.logprobs).cast("f"))
        assert (r["reward"], r["weight_version"]) == (s.reward, s.weight_version)
        assert r["group_id"] == g.group_id and r["task_name"] == g.task_name
        assert r["trained_step"] == trained.get(g.group_id)
        assert r["prompt"]  # decoded text
    assert any(r["trained_step"] is not None for r in rows)
    ds = load_from_disk(str(ds_path))
    assert ds.num_rows == len(rows) and ds[0]["sample_id"] == rows[0]["sample_id"]


def test_rescore_with_the_run_reward_reproduces_it_and_another_reward_replaces_it(
    recorded: Recorded,
) -> None:
    judge, asked_in_the_run = recorded.judge, len(recorded.judge.bodies)
    same = recorded.root / "rescore-same.jsonl"
    code, text = replay("rescore", "-c", str(recorded.config), "--out", str(same))
    assert code == 0, text
    lines = [json.loads(ln) for ln in same.read_text().splitlines()]
    n = sum(len(g.samples) for g in recorded.groups)
    assert len(lines) == n
    assert all(ln["new_reward"] == ln["old_reward"] for ln in lines), text
    assert any(ln["old_reward"] == 1.0 for ln in lines)  # the run's reward varied
    assert any(ln["old_reward"] == 0.0 for ln in lines)
    # the run's judge (its [judge] urls) was asked what the run's workers asked it
    rescored = judge.bodies[asked_in_the_run:]
    assert rescored and all(b in judge.bodies[:asked_in_the_run] for b in rescored)
    # another reward: 1 for a completion with a letter in it (no judge part: none asked)
    other = recorded.root / "rescore-letter.jsonl"
    asked = len(judge.bodies)
    code, text = replay("rescore", "-c", str(recorded.config), "--out", str(other),
                        "--reward", OTHER)  # fmt: skip
    assert code == 0, text
    assert len(judge.bodies) == asked
    pq_rows = {r["sample_id"]: r for r in _export_rows(recorded)}
    lines = [json.loads(ln) for ln in other.read_text().splitlines()]
    assert len(lines) == n
    for ln in lines:
        want = 1.0 if re.search("[a-z]", str(pq_rows[ln["sample_id"]]["completion"])) else 0.0
        assert ln["new_reward"] == want, ln
    summary = json.loads(text.splitlines()[0])
    assert (
        summary["rescored"] == n
        and summary["mean_new"] == sum(ln["new_reward"] for ln in lines) / n
    )


def test_rescore_of_a_judged_run_without_its_judge_refuses_or_takes_one_given(
    recorded: Recorded,
) -> None:
    """The run's judge engines are gone (no [judge] urls): exit 2 naming what is missing,
    never every judge part scored 0; --judge-url names one, and the rewards come back."""
    config = recorded.root / "run-judge-gone.toml"
    config.write_text(config_text(recorded.root, recorded.model, None))
    out = recorded.root / "rescore-given.jsonl"
    code, text = replay("rescore", "-c", str(config), "--out", str(out))
    assert code == 2, text
    assert "[task] reward 'digit': scored by an LLM judge, and no judge engine is given" in text
    assert "--judge-url" in text and not out.exists()
    code, text = replay("rescore", "-c", str(config), "--out", str(out),
                        "--judge-url", recorded.judge_url)  # fmt: skip
    assert code == 0, text
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(lines) == sum(len(g.samples) for g in recorded.groups)
    assert all(ln["new_reward"] == ln["old_reward"] for ln in lines)
    assert {ln["old_reward"] for ln in lines} == {0.0, 1.0}
    assert f"judge parts by {recorded.judge_url}" in text, text


def _export_rows(recorded: Recorded) -> list[dict[str, object]]:
    import pyarrow.parquet as pq

    path = recorded.root / "samples.parquet"
    if not path.exists():
        code, text = replay("export", "-c", str(recorded.config), "--parquet", str(path))
        assert code == 0, text
    return pq.read_table(path).to_pylist()


def test_a_trimmed_or_holed_batch_stream_is_refused_naming_the_first_missing_sequence(
    recorded: Recorded, tmp_path: Path, tiny_model: Path
) -> None:
    """A copy of the stopped run (its store), trimmed as max_age would and holed by hand."""
    root = tmp_path / "copy"
    root.mkdir()
    shutil.copytree(recorded.root / "nats", root / "nats")
    config = root / "run.toml"
    config.write_text(recorded.config.read_text().replace(str(recorded.root), str(root)))
    stream = stream_name(RUN, "BATCHES")
    with NatsServer(store_dir=root / "nats") as nats:
        asyncio.run(_edit(nats.url, stream, delete=3))
        code, text = replay("train", "-c", str(config), "--nats", nats.url)
        assert code == 2, text
        assert f"stream {stream} is missing sequence 3: sequence 3 was deleted" in text, text
        asyncio.run(_edit(nats.url, stream, keep_from=2))  # what max_age does: the head goes
        code, text = replay("train", "-c", str(config), "--nats", nats.url)
        assert code == 2, text
        assert f"stream {stream} is missing sequence 1: the stream now starts at sequence 2" in text
        assert "history_max_age_s" in text
        assert not (root / "replay" / "weights").exists()  # refused before training
        # the trainer in replay mode, without the command's check first: the same refusal
        code, text = replay_trainer(config, nats.url, tiny_model, tmp_path / "direct")
        assert code == 2, text
        assert f"stream {stream} is missing sequence 1: the stream now starts at sequence 2" in text
        assert not (tmp_path / "direct" / "weights").exists()


def replay_trainer(config: Path, url: str, model: Path, out: Path) -> tuple[int, str]:
    """`python -m services.trainer` with `[trainer] replay = true`, as replay train runs it."""
    env = {**os.environ, **QUIET_ENV, "FLYWHEEL_TRAINER_REPLAY": "true",
           "FLYWHEEL_TRAINER_NATS__URL": url, "FLYWHEEL_TRAINER_MODEL": str(model),
           "FLYWHEEL_TRAINER_METRICS_PORT": "0",
           "FLYWHEEL_TRAINER_WEIGHTS_ROOT": str(out / "weights"),
           "FLYWHEEL_TRAINER_CHECKPOINT_DIR": str(out / "checkpoints")}  # fmt: skip
    p = subprocess.run([sys.executable, "-m", "services.trainer", "-c", str(config)], env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    return p.returncode, p.stdout + p.stderr


async def _edit(url: str, stream: str, *, delete: int = 0, keep_from: int = 0) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        if delete:
            await js.delete_msg(stream, delete)
        if keep_from:
            await js.purge_stream(stream, seq=keep_from)
    finally:
        await nc.close()
