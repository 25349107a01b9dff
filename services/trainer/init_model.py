"""`flywheel init-model`: a tiny model for any task, built here with nothing downloaded.

    flywheel init-model -c run.toml            # for the run file's task, at its [stack] model
    flywheel init-model DIR                    # the demo's char-tokenizer model, untrained

With a run file: a byte-level BPE tokenizer is trained on the task's own
text (its training prompts, formatted as the buffer sends them, and their
solutions), the tiny Qwen2 is initialised around it with a ChatML chat
template, and `--sft-steps` (default 300) of supervised warm start on the
training rows (never the held-out ones) teach it the answer format, so RL
starts from groups whose rewards differ. A random model scores 0 on every
sample of a real task: every group would be filtered and nothing would
train. The warm start is `flywheel sft`'s loop (services/trainer/sft/loop.py).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.tasks.prompts import format_row, sft_messages
from services.tasks.taskset import LoadedTask

MAX_TEXT_ROWS = 20_000  # rows of each task the tokenizer is trained on


def training_rows(loaded: dict[str, LoadedTask], limit: int) -> Iterator[tuple[LoadedTask, Any]]:
    """Up to `limit` training rows of each task (held-out rows are not among them)."""
    for t in loaded.values():
        for i in t.train[:limit]:
            yield t, t.rows.row(int(i))


def task_texts(loaded: dict[str, LoadedTask]) -> Iterator[str]:
    for t, row in training_rows(loaded, MAX_TEXT_ROWS):
        prompt, messages = format_row(t.spec, row)
        yield prompt if prompt is not None else "\n".join(m["content"] for m in messages or ())
        yield row.solution or row.answer or ""


def write_sft_file(loaded: dict[str, LoadedTask], path: Path, limit: int) -> int:
    n = 0
    with path.open("w") as f:
        for t, row in training_rows(loaded, limit):
            f.write(json.dumps({"messages": sft_messages(t.spec, row)}) + "\n")
            n += 1
    return n


def init_for_task(
    config: Path,
    out: Path | None,
    *,
    vocab_size: int,
    sft_steps: int,
    spec: Any,
    force: bool,
    log: Any = print,
) -> Path:
    """Build the task's tiny model at `out` (default: the run file's [stack] model)."""
    from services.models.tiny_model import build_bpe_tokenizer, write_tiny_model
    from services.runtime.errors import ConfigError
    from services.runtime.settings import load_settings, read_run_file, run_path
    from services.tasks.settings import TaskServiceSettings
    from services.trainer.settings import ModelConfig, OptimConfig, SftSettings
    from services.trainer.sft.loop import run_sft

    s = load_settings(TaskServiceSettings, config)
    stack = read_run_file(config).get("stack", {})
    model = stack.get("model") if isinstance(stack, dict) else None
    if out is None:
        if not model:
            raise ConfigError(f"{config} has no [stack] model: give --out DIR")
        out = run_path(model)
    if out.exists() and any(out.iterdir()) and not force:
        raise ConfigError(f"{out} is not empty (use --force to replace it)")
    loaded = s.task_set().load()
    log(f"flywheel init-model: training a {vocab_size}-token BPE on {', '.join(loaded)}")
    tokenizer = build_bpe_tokenizer(task_texts(loaded), vocab_size)
    work = out.with_name(f".{out.name}.init")
    shutil.rmtree(work, ignore_errors=True)
    write_tiny_model(work, spec, tokenizer=tokenizer)
    if sft_steps == 0:
        shutil.rmtree(out, ignore_errors=True)
        work.rename(out)
        return out
    data = work / "sft.jsonl"
    n = write_sft_file(loaded, data, limit=sft_steps * 32)
    log(f"flywheel init-model: {sft_steps} SFT steps on {n} training rows (warm start)")
    run_sft(
        SftSettings(
            model_dir=work,
            train_file=data,
            output_dir=out,
            overwrite=True,
            steps=sft_steps,
            batch_size=32,
            max_seq_len=spec.max_position_embeddings,
            log_every=100,
            progress=False,
            optim=OptimConfig(lr=2e-3, warmup_steps=20, schedule="cosine", min_lr_ratio=0.1),
            model=ModelConfig(cpu_threads=1),
        ),
        log=lambda m: log(f"flywheel init-model: sft {m}"),
    )
    shutil.rmtree(work)
    return out
