"""How much of the trainer's wall time held-out evaluation blocks, on the tiny model.

    .venv/bin/python bench/eval_blocking.py [--steps 30] [--eval-every 5] [--size 60]
        [--k 4] [--max-new-tokens 32] [--run-dir runs/bench-eval-blocking] [--label NAME]

One `flywheel up --steps N` run (embedded nats-server, one CPU engine and
its rollout worker, sync, trainer, buffer; one torch thread each) of the
tiny random model (services/models/tiny_model.py) on 1-digit arithmetic,
with a held-out evaluation every `--eval-every` steps sized by `--size`
prompts, pass@`--k` and `--max-new-tokens`; then the figures from the
trainer's metrics.jsonl, over the steps after the first (from step 1's row
to step N's: the start-up and the step-0 evaluation left out):

- wall: seconds between those rows, and per step;
- not stepping: wall - sum(wait_s + compute_s) over those steps: the loop's
  time neither waiting for a batch nor computing one (publishing and
  recording not overlapped, and whatever evaluation blocked); comparable
  between versions of the code, since every version writes these fields;
- blocked_s (where the rows have it): the loop's own count of time spent
  after a step's compute waiting for the previous step's publish and record;
- evaluations: how many ran and, where the rows say, their seconds.

With `--run-file FILE` it measures a real run instead (e.g.
configs/examples/ticket-routing.toml: SmolLM2, 150 validation prompts,
pass@4), in two `flywheel up --steps N` runs back to back on the same seed:
the baseline with no evaluation (`eval_every = 0`), then evaluations every
`--eval-every` steps at the run file's other settings (`eval_nice`,
`eval_max_share`: the defaults unless it sets them). Both with
`filter_zero_variance = false`, so that every step trains the same work
(with the filter on, a step's wait for trainable groups depends on what the
policy has learned by then, which timing changes). The evaluations' share of
the RL wall time is 1 - wall(baseline) / wall(with evaluations), over the
same steps 2..N.

`services` is imported from wherever Python finds it first, so
`PYTHONPATH=/path/to/other/checkout` measures another version of the code
with the same script (how the "before" figure was taken).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN_FILE = """
run = "evalblock"

[stack]
run_dir = "{run_dir}"
model = "{model}"
engines = 1
engine_threads = 1
status_interval_s = 5
ready_timeout_s = 180

[task]
source = {{ type = "arithmetic", digits = 1 }}

[task.eval]
source = {{ type = "arithmetic", digits = 2, seed = 1000003 }}
size = {size}
k = {k}
max_new_tokens = {max_new_tokens}

[buffer]
samples_per_prompt = 4
groups_per_step = 2
max_new_tokens = 4
max_staleness = 1
oversample = 0.0
filter_zero_variance = false

[rollout]
concurrency = 4
heartbeat_s = 0.5

[engine]
num_threads = 1

[trainer]
eval_every = {eval_every}

[trainer.optim]
lr = 1e-3

[trainer.runtime]
cpu_threads = 1
"""


def figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    trained = [r for r in rows if "batch_id" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    window = trained[1:]  # steps 2..N: from step 1's row to step N's
    wall = trained[-1]["time"] - trained[0]["time"]
    stepping = sum(r["wait_s"] + r["compute_s"] for r in window)
    out: dict[str, Any] = {
        "steps": len(trained),
        "wall_s": round(wall, 2),
        "s_per_step": round(wall / len(window), 3),
        "not_stepping_s": round(wall - stepping, 2),
        "not_stepping_share": round((wall - stepping) / wall, 4),
        "evaluations": [r["step"] for r in evals],
    }
    if all("blocked_s" in r for r in window):
        blocked = sum(r["blocked_s"] for r in window)
        out |= {"blocked_s": round(blocked, 2), "blocked_share": round(blocked / wall, 4)}
    if evals and all("eval_s" in r for r in evals):
        out["eval_s"] = [round(r["eval_s"], 1) for r in evals]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--size", type=int, default=60)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/bench-eval-blocking"))
    ap.add_argument("--label", default="")
    ap.add_argument("--run-file", type=Path, help="a real run file: the A/B described above")
    ap.add_argument("--seed", type=int, default=0, help="--run-file: both runs' seed")
    args = ap.parse_args()
    if args.run_file:
        real_share(args)
        return

    import services
    from services.models.tiny_model import TinyModelSpec, write_tiny_model

    run_dir = args.run_dir.resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    model = write_tiny_model(run_dir / "tiny-model", TinyModelSpec())
    config = run_dir / "run.toml"
    config.write_text(
        RUN_FILE.format(
            run_dir=run_dir / "run", model=model, size=args.size, k=args.k,
            max_new_tokens=args.max_new_tokens, eval_every=args.eval_every,
        )
    )  # fmt: skip
    started, load = time.time(), os.getloadavg()[0]
    rows = up_steps(config, args.steps, run_dir / "run")
    result = {
        "label": args.label,
        "code": str(Path(services.__file__).parent.parent),
        "load_before": round(load, 1),
        "load_after": round(os.getloadavg()[0], 1),
        "up_s": round(time.time() - started, 1),
        "config": {k: getattr(args, k) for k in ("steps", "eval_every", "size", "k")}
        | {"max_new_tokens": args.max_new_tokens},
        **figures(rows),
    }
    print(json.dumps(result))


def up_steps(config: Path, steps: int, run_dir: Path) -> list[dict[str, Any]]:
    """`flywheel up -c config --steps N`, then the trainer's metrics rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    up = [sys.executable, "-c", "from services.cli import main; raise SystemExit(main())"]
    code = subprocess.call(
        [*up, "up", "-c", str(config), "--steps", str(steps), "--quiet", "--no-check"], env=env
    )
    if code != 0:
        raise SystemExit(f"flywheel up exited {code}: see {run_dir / 'logs'}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def real_share(args: argparse.Namespace) -> None:
    """The A/B on a real run file: no evaluation, then evaluations every --eval-every."""
    import tomllib

    from services.models.resolve import resolve_model
    from services.runtime.settings import load_settings
    from services.stack.demo import dump_toml, run_file
    from services.stack.settings import StackSettings

    doc = tomllib.loads(args.run_file.read_text())
    # [stack] model as `flywheel up` reads it (services/runtime/settings.py, "Paths")
    model = resolve_model(load_settings(StackSettings, args.run_file).model)
    arms: dict[str, dict[str, Any]] = {}
    for name, every in (("none", 0), ("eval", args.eval_every)):
        run_dir = (args.run_dir / name).resolve()
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        src = run_dir / "source.toml"
        doc.setdefault("trainer", {})["eval_every"] = every
        doc.setdefault("buffer", {})["filter_zero_variance"] = False
        src.write_text(dump_toml(doc))
        config = run_file(src, run_dir, model, None, seed=args.seed)
        started, load = time.time(), os.getloadavg()[0]
        rows = up_steps(config, args.steps, run_dir)
        arms[name] = {"load_before": round(load, 1), "load_after": round(os.getloadavg()[0], 1),
                      "up_s": round(time.time() - started, 1), **figures(rows)}  # fmt: skip
        print(json.dumps({"arm": name, "eval_every": every, **arms[name]}), flush=True)
    share = 1 - arms["none"]["wall_s"] / arms["eval"]["wall_s"]
    print(json.dumps({"run_file": str(args.run_file), "steps": args.steps,
                      "eval_share_of_wall": round(share, 4)}))  # fmt: skip


if __name__ == "__main__":
    main()
