"""SFT end to end: `flywheel sft` (sft_main in a subprocess) on arithmetic, then accuracy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.tasks.arithmetic import ArithmeticSource, problem
from services.tasks.arithmetic_sft import arithmetic_records
from services.tasks.evaluate import evaluate_dir
from services.tasks.spec import EvalSpec, TaskSpec
from services.tasks.taskset import TaskSet
from services.trainer.model import load_tokenizer
from services.trainer.sft.data import SftDataError, load_sft_file, tokenize_chat
from services.weights import verify_weights_dir

# A fixed number of steps and one thread, so the run is the same on any load: 900 steps
# gave the same weights (one sha256) and 9.75% held-out exact match in every run here
# (random init: 0%). A wall-clock budget made it load-dependent: CI's loaded machine
# trained fewer steps, stopped before the learning rate decayed, and read 3.25%.
MIN_ACCURACY = 0.04
SFT_MAIN = (
    "import sys; from services.trainer.sft.cli import sft_main; sys.exit(sft_main(sys.argv[1:]))"
)


def sft(run_toml: Path, timeout_s: float) -> str:
    """`flywheel sft -c run_toml` (sft_main in a subprocess); its stdout, once it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-c", SFT_MAIN, "-c", str(run_toml)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.long  # a learning run of 900 steps (~25 CPU s), then `flywheel sft` again
def test_sft_learns_arithmetic(tiny_model_dir, tmp_path):
    # The validation split's problems: those the evaluation below draws (eval.source
    # is the validation split), none of them a train problem (arithmetic_records').
    held_out = [problem(1, i, split="validation") for i in range(400)]
    banned = {p.prompt for p in held_out}
    with open(tmp_path / "train.jsonl", "w") as f:
        for rec in arithmetic_records(20_000, seed=0):
            if rec["prompt"] not in banned:
                f.write(json.dumps(rec) + "\n")
    with open(tmp_path / "eval.jsonl", "w") as f:
        for p in held_out[:128]:
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": p.prompt},
                            {"role": "assistant", "content": p.answer},
                        ]
                    }
                )
                + "\n"
            )
    (tmp_path / "run.toml").write_text(f"""
[sft]
model_dir = "{tiny_model_dir}"
train_file = "{tmp_path / "train.jsonl"}"
eval_file = "{tmp_path / "eval.jsonl"}"
output_dir = "{tmp_path / "out"}"
steps = 900
batch_size = 32
log_every = 300
progress = false

[sft.optim]
lr = 3e-3
warmup_steps = 20
schedule = "cosine"
min_lr_ratio = 0.05

[sft.model]
cpu_threads = 1
""")
    assert "after 900 steps" in sft(tmp_path / "run.toml", timeout_s=300)

    verify_weights_dir(tmp_path / "out")
    # the one held-out evaluation (services/tasks/evaluate.py) on the same problems
    spec = TaskSpec(
        source=ArithmeticSource(type="arithmetic"),
        eval=EvalSpec(
            source=ArithmeticSource(type="arithmetic", seed=1), size=400, max_new_tokens=8
        ),
    )
    tasks = TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"})
    result = evaluate_dir(tmp_path / "out", tasks).tasks["arithmetic"]
    print(f"held-out pass@1: {result.pass_at_1:.3f} of {result.total}", result.examples)
    assert result.total == 400 and result.pass_at_1 >= MIN_ACCURACY, result
    # the untrained model is at chance on the same problems
    base = evaluate_dir(tiny_model_dir, tasks, size=100).tasks["arithmetic"]
    assert base.total == 100 and base.pass_at_1 < 0.02


def test_a_time_budget_stops_sft_early_and_still_saves(tiny_model_dir, tmp_path):
    (tmp_path / "train.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in arithmetic_records(64, seed=0))
    )
    (tmp_path / "run.toml").write_text(f"""
[sft]
model_dir = "{tiny_model_dir}"
train_file = "{tmp_path / "train.jsonl"}"
output_dir = "{tmp_path / "out"}"
steps = 1000000
max_time_s = 1
batch_size = 4
progress = false
""")
    out = sft(tmp_path / "run.toml", timeout_s=120)
    done = int(out.split(" after ")[1].split(" steps")[0])
    assert 1 <= done < 1_000_000
    verify_weights_dir(tmp_path / "out")


def test_chat_records_train_only_assistant_turns(tiny_model_dir, tmp_path):
    tok = load_tokenizer(tiny_model_dir)
    ex = tokenize_chat(
        tok,
        [
            {"role": "user", "content": "1+2="},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "4+4="},
            {"role": "assistant", "content": "8"},
        ],
    )
    text = [tok.decode([int(t)]) for t in ex.input_ids]
    trained = [t for t, m in zip(text, ex.loss_mask.tolist(), strict=True) if m]
    assert trained == ["3", tok.eos_token, "8", tok.eos_token]
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n{"bad": 1}\n')
    with pytest.raises(SftDataError) as e:
        load_sft_file(tmp_path / "d.jsonl", tok)
    assert e.value.line == 2
