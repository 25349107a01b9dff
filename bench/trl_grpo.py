"""TRL's `GRPOTrainer` on Flywheel's demo task: the baseline of `bench/e2e.py`.

    .venv/bin/python bench/trl_grpo.py --model runs/bench-e2e/model-sft \
        --seconds 300 --target-accuracy 0.9 --metrics-out /tmp/trl.jsonl

Same model directory (the demo's SFT warm start), same prompts (the run
file's `[task]` training rows, formatted as the buffer formats them), same
reward (the task's reward functions, `services.tasks.rewards.score`,
called in process), the same held-out evaluation (the one evaluation
function, `services.tasks.evaluate`, on `[task.eval]`, every
`eval_every` steps) and the same hyper-parameters, as the services resolve
the run file (its keys, else the settings classes' defaults: `demo_hparams`),
set on `GRPOConfig` (TRL 1.x) by `trl_alike`:

- one optimizer step per generation round: per_device_train_batch_size =
  prompts × samples, gradient_accumulation_steps = 1, num_iterations = 1
  (Flywheel's trainer also takes one step per batch);
- loss_type = "dapo" is TRL's name for Flywheel's default aggregation
  `token-mean` (sum of token losses / active tokens of the batch);
  scale_rewards = "group" is GRPO's (r - mean) / std; beta = the run's
  kl_coef (0 by default, TRL's too); the run's lr schedule, warm-up and
  AdamW settings; no gradient checkpointing (TRL defaults to it); bf16
  only where Flywheel's trainer computes in bf16 (TRL defaults to bf16);
  mask_truncated_completions = the run's drop_truncated.

bench/results_learning.md ("TRL side by side") lists every TRL default
that differs from Flywheel's and what is done about it.

Not the same, by construction: TRL has no zero-variance filtering (such
groups get zero advantage and add only to the token count; `SignalCount`
counts the rest, reported as `signal_fraction`) and it is
synchronous: generation and training alternate in one process. It runs on
CPU with one torch thread (on 2 contended cores one thread is faster for
this model, see bench/results_trainer.md).

Output: one JSON row per evaluation (step, elapsed, eval_accuracy, samples,
eval_s) to --metrics-out, and a summary JSON as the last stdout line.
`elapsed` is wall time since training began, evaluations included (as the
Flywheel trainer's `elapsed`); samples/s excludes the evaluation time, which
only flatters TRL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo.toml"


def demo_hparams(config: Path) -> dict[str, Any]:
    """The run's GRPO hyper-parameters as the services resolve them: the run file's keys,
    the settings classes' defaults where it is silent (a user's file that sets no lr
    trains at the trainer's default, and so does TRL here)."""
    from services.buffer.settings import BufferSettings
    from services.runtime.settings import load_settings
    from services.trainer.settings import TrainerSettings

    buf = load_settings(BufferSettings, config)
    tr = load_settings(TrainerSettings, config)
    o, loss = tr.optim, tr.loss
    return {
        "prompts_per_step": buf.groups_per_step,
        "samples_per_prompt": buf.samples_per_prompt,
        "temperature": buf.temperature,
        "top_p": buf.top_p,
        "max_new_tokens": buf.max_new_tokens,
        "lr": o.lr,
        "warmup_steps": o.warmup_steps,
        "schedule": o.schedule,
        "weight_decay": o.weight_decay,
        "betas": list(o.betas),
        "adam_eps": o.eps,
        "minibatches": o.minibatches,
        "eps_low": loss.eps_low,
        "eps_high": loss.eps_high,
        "grad_clip": o.grad_clip,
        "kl_coef": loss.kl_coef,
        "entropy_coef": loss.entropy_coef,
        "advantage": loss.advantage,
        "batch_normalize_advantages": loss.batch_normalize_advantages,
        "aggregation": loss.aggregation,
        "policy_loss": loss.policy_loss,
        "drop_truncated": loss.drop_truncated,
        "precision": tr.runtime.precision,
        "eval_every": tr.eval_every or 5,
        "filter_zero_variance": buf.filter_zero_variance,
    }


# Flywheel's loss keys -> GRPOConfig's (TRL 1.16): set alike wherever TRL has the same thing.
LOSS_TYPE = {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
             "seq-mean-token-sum-norm": "dr_grpo"}  # fmt: skip
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}  # rloo: TRL has no leave-one-out baseline


def trl_alike(hp: dict[str, Any]) -> dict[str, Any]:
    """The GRPOConfig keys that make TRL train as Flywheel's run file says (see
    bench/results_learning.md, "TRL side by side", for each default that differs)."""
    import torch

    from services.trainer.model import compute_dtype

    bf16 = compute_dtype(hp["precision"], torch.device("cpu")) == torch.bfloat16
    return {
        "num_generations": hp["samples_per_prompt"],
        "num_iterations": 1,  # TRL's μ: Flywheel takes each batch once
        "steps_per_generation": hp["minibatches"],  # minibatches > 1: optimizer steps per batch
        "max_completion_length": hp["max_new_tokens"],
        "temperature": hp["temperature"],
        "top_p": hp["top_p"],
        "top_k": 0,
        "learning_rate": hp["lr"],
        "lr_scheduler_type": "cosine" if hp["schedule"] == "cosine" else "constant",
        "warmup_steps": hp["warmup_steps"],
        "weight_decay": hp["weight_decay"],
        "adam_beta1": hp["betas"][0],
        "adam_beta2": hp["betas"][1],
        "adam_epsilon": hp["adam_eps"],
        "optim": "adamw_torch",
        "max_grad_norm": hp["grad_clip"] or 0.0,
        "epsilon": hp["eps_low"],
        "epsilon_high": hp["eps_high"],
        "beta": hp["kl_coef"],
        "entropy_coef": hp["entropy_coef"],
        "loss_type": LOSS_TYPE[hp["aggregation"]],
        "scale_rewards": (
            "batch"
            if hp["batch_normalize_advantages"]
            else SCALE_REWARDS.get(hp["advantage"], "group")
        ),
        "importance_sampling_level": "sequence" if hp["policy_loss"] == "gspo" else "token",
        "mask_truncated_completions": hp["drop_truncated"],
        "gradient_checkpointing": False,  # TRL's default True; Flywheel's does not recompute
        "bf16": bf16,  # TRL's default True; Flywheel's 'auto': bf16 on a native-bf16 CPU only
        "fp16": False,
        "disable_dropout": False,  # both train in train() mode: dropout as the model says
    }


def load_tasks(config: Path) -> Any:
    """The run file's task set (what the buffer, the workers and the trainer resolve)."""
    from services.runtime.settings import load_settings
    from services.tasks.settings import TaskServiceSettings

    return load_settings(TaskServiceSettings, config).task_set()


class SignalCount:
    """Samples TRL scored, and those in groups whose rewards differ: the only ones
    a group-relative advantage gives a gradient (a group of equal rewards has
    advantage 0 everywhere). Flywheel's buffer filters the others out before
    training, so its trained samples are all of this kind; counting TRL's the
    same way compares like with like."""

    def __init__(self, group: int) -> None:
        self.group, self.scored, self.with_signal = group, 0, 0

    def add(self, rewards: list[float]) -> None:
        # TRL's RepeatSampler puts a prompt's num_generations completions side by side.
        for i in range(0, len(rewards), self.group):
            g = rewards[i : i + self.group]
            self.scored += len(g)
            self.with_signal += len(g) if max(g) != min(g) else 0


def text_of(completion: Any) -> str:
    """A completion's text: TRL hands chat prompts' completions over as a list of messages."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)


def make_reward(tasks: Any, counts: SignalCount) -> Any:
    """A TRL reward function: the task's own reward (dataset columns arrive as keywords)."""
    from services.tasks.rewards import score
    from services.tasks.scoring import reward_payload

    parts = {name: reward_payload(spec) for name, spec in tasks.specs.items()}

    def reward(completions: list[str], answer: list[str], task: list[str], row: list[int],
               completion_ids: list[list[int]] | None = None, **_: Any) -> list[float]:  # fmt: skip
        n = [len(c) for c in completion_ids] if completion_ids else [0] * len(completions)
        texts = [text_of(c) for c in completions]
        rows = zip(texts, answer, task, row, n, strict=True)
        out = [score(parts[t], c, a, {"row": r, "response_tokens": k})["reward"]
               for c, a, t, r, k in rows]  # fmt: skip
        counts.add(out)
        return out

    return reward


def make_callback(hp: dict[str, Any], tasks: Any, seconds: float, target: float | None,
                  out: Path | None):  # fmt: skip
    """A TrainerCallback that evaluates every `eval_every` steps and stops on time or target."""
    from transformers import TrainerCallback

    from services.tasks.evaluate import Evaluator

    per_step = hp["prompts_per_step"] * hp["samples_per_prompt"]
    # The validation split, as Flywheel's trainer: these evaluations stop the run. Greedy
    # pass@1 only: the one figure read here (and the one Flywheel's trainer writes first,
    # before its pass@k samples): TRL's training waits for no samples it does not use.
    evaluator = Evaluator(tasks, split="validation", greedy_only=True).__enter__()

    class Bench(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = 0.0
            self.eval_s = 0.0
            self.rows: list[dict[str, Any]] = []
            self.reached: float | None = None

        def evaluate(self, step: int, model: Any, tok: Any) -> float:
            t = time.perf_counter()
            acc = evaluator(model, tok).pass_at_1
            if not self.t0:  # the step-0 evaluation: RL time (and its evaluations) start after it
                self.t0 = time.perf_counter()
            else:
                self.eval_s += time.perf_counter() - t
            row = {"step": step, "elapsed": time.perf_counter() - self.t0, "eval_accuracy": acc,
                   "samples": step * per_step, "eval_s": self.eval_s}  # fmt: skip
            self.rows.append(row)
            if out is not None:
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            print(f"trl_grpo: step {step} acc {acc:.3f} elapsed {row['elapsed']:.1f}s",
                  flush=True)  # fmt: skip
            if target is not None and acc >= target and self.reached is None:
                self.reached = row["elapsed"]
            return acc

        def close(self) -> None:
            evaluator.__exit__(None, None, None)

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            self.evaluate(0, model, processing_class)  # at elapsed 0: RL time starts after it

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            step = state.global_step
            if step % hp["eval_every"] == 0:
                self.evaluate(step, model, processing_class)
                if self.reached is not None:
                    control.should_training_stop = True
            if time.perf_counter() - self.t0 >= seconds:
                control.should_training_stop = True

    return Bench()


def training_rows(tasks: Any, n: int) -> list[dict[str, Any]]:
    """The first `n` training rows of the task, formatted as the buffer sends them."""
    from services.tasks.prompts import format_row

    rows = []
    for name, t in tasks.load().items():
        for i in t.train[:n]:
            row = t.rows.row(int(i))
            prompt, messages = format_row(t.spec, row)
            rows.append({"prompt": prompt if prompt is not None else list(messages or ()),
                         "answer": row.answer, "task": name, "row": int(i)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the SFT model directory (DIR/model-sft)")
    p.add_argument("-c", "--config", default=str(DEFAULT_CONFIG), help="the demo's run file")
    p.add_argument("--seconds", type=float, default=300.0, help="cap on RL wall time")
    p.add_argument("--target-accuracy", type=float, help="stop once held-out accuracy ≥ this")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--metrics-out", type=Path, help="append one JSON row per evaluation")
    p.add_argument("--lr", type=float, help="override the demo's lr (diagnostics only)")
    p.add_argument("--output-dir", default="/tmp/flywheel-trl-grpo", help="TRL's output_dir")
    p.add_argument("--seed", type=int, default=0, help="TRL's seed (data order, sampling)")
    args = p.parse_args(argv)

    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:  # one line, not a traceback
        print(f"trl_grpo: TRL is not installed ({e}): pip install -e '.[bench]'", file=sys.stderr)
        return 2
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    hp = demo_hparams(Path(args.config))
    if args.lr is not None:
        hp["lr"] = args.lr
    per_step = hp["prompts_per_step"] * hp["samples_per_prompt"]
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    if hp["lr"] == "auto":  # as the trainer resolves it: from the loaded model's count
        from services.trainer.core.lr import resolve_lr
        from services.trainer.trainer import parameter_count

        hp["lr"] = resolve_lr("auto", parameter_count(model), lora=False)
    tasks = load_tasks(Path(args.config))
    # Enough distinct prompts that the cap, not the dataset, ends training.
    rows = training_rows(tasks, hp["prompts_per_step"] * 2000)
    cfg = GRPOConfig(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=per_step,  # completions per device step
        gradient_accumulation_steps=1,
        **trl_alike(hp),
        max_steps=100_000,  # the callback stops on time or target
        logging_steps=hp["eval_every"],
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip
    bench = make_callback(hp, tasks, args.seconds, args.target_accuracy, args.metrics_out)
    counts = SignalCount(hp["samples_per_prompt"])
    trainer = GRPOTrainer(
        model=model, reward_funcs=make_reward(tasks, counts), args=cfg,
        train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[bench],
    )  # fmt: skip
    trainer.train()
    steps = trainer.state.global_step
    if bench.rows[-1]["step"] != steps:  # stopped between evaluations: evaluate the end too
        bench.evaluate(steps, trainer.model, tok)
    bench.close()
    wall = bench.rows[-1]["elapsed"]
    samples = steps * per_step
    summary = {
        "steps": steps, "samples": samples, "rl_seconds": wall, "eval_seconds": bench.eval_s,
        "samples_per_s": samples / max(wall - bench.eval_s, 1e-9),
        "samples_per_s_incl_eval": samples / max(wall, 1e-9),
        # the trained share of the scored samples that had a gradient (see SignalCount)
        "signal_fraction": counts.with_signal / max(counts.scored, 1),
        "time_to_target": bench.reached, "accuracy_start": bench.rows[0]["eval_accuracy"],
        "accuracy_end": bench.rows[-1]["eval_accuracy"], "threads": args.threads,
        "hparams": hp,
    }  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
