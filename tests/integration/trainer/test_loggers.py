"""The trainer's loggers: the same rows in metrics.jsonl, TensorBoard event files and W&B."""

import json

import pytest

from services.trainer.loggers import LoggerError, open_loggers
from services.trainer.settings import TrainerSettings

ROWS = [
    {"step": 0, "time": 1_700_000_000.0, "elapsed": 0.0, "eval_accuracy": 0.25},
    {
        "step": 1,
        "batch_id": "r:step1",
        "time": 1_700_000_001.0,
        "loss": 0.5,
        "reward_mean": 0.25,
        "entropy": 1.5,
        "recovered": False,
    },
    {
        "step": 2,
        "batch_id": "r:step2",
        "time": 1_700_000_002.0,
        "loss": 0.25,
        "reward_mean": 0.75,
        "grad_norm": float("nan"),
    },
]


def test_tensorboard_and_jsonl_get_the_same_rows(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = open_loggers(
        ["jsonl", "tensorboard"], run="r", metrics_file=tmp_path / "metrics.jsonl", log_dir=None
    )
    for row in ROWS:
        loggers.write(row)
    loggers.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [0, 1, 2]

    acc = EventAccumulator(str(tmp_path / "tensorboard" / "r"))  # TensorBoard's own reader
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"trainer/loss", "trainer/reward_mean", "trainer/eval_accuracy"} <= tags
    assert "trainer/step" not in tags and "trainer/batch_id" not in tags
    assert "trainer/grad_norm" not in tags  # NaN is left out, not plotted as a spike
    loss = [(e.step, e.value) for e in acc.Scalars("trainer/loss")]
    assert loss == [(1, 0.5), (2, 0.25)]
    assert [e.wall_time for e in acc.Scalars("trainer/reward_mean")] == [
        1_700_000_001.0,
        1_700_000_002.0,
    ]


def test_wandb_offline_run_holds_the_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = open_loggers(
        ["wandb"], run="r", metrics_file=None, log_dir=tmp_path, config={"loss": {"eps_high": 0.28}}
    )
    for row in ROWS:
        loggers.write(row)
    loggers.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()  # W&B's record log: the keys are stored as plain strings
    assert b"reward_mean" in data and b"eval_accuracy" in data and b"eps_high" in data


def test_settings_default_to_jsonl_and_name_the_extra_when_missing(monkeypatch):
    task = {"source": {"type": "arithmetic"}}
    assert TrainerSettings(task=task).loggers == ["jsonl"]
    s = TrainerSettings(task=task, loggers=["jsonl", "tensorboard", "wandb"], wandb_mode="offline")
    assert s.loggers == ["jsonl", "tensorboard", "wandb"]
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "torch.utils.tensorboard":
            raise ImportError("no tensorboard")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(LoggerError, match=r"flywheel\[tensorboard\]"):
        open_loggers(["tensorboard"], run="r", metrics_file=None, log_dir=None)
