"""`flywheel check -c run.toml`: does the base model give RL anything to learn from?

Samples `[stack] model` k times on N training prompts, at the run file's
`[buffer] temperature` and `max_new_tokens` (k: its `samples_per_prompt`,
the group size the trainer will see), through the task's real reward
(services/tasks/check.py), prints pass@1, pass@k, the share of groups that
would be flat, the share of replies naming the answer and a few replies,
then one verdict line (services/tasks/check_verdict.py). Exit 0: RL has
something to learn from; 3: it warns (nothing to learn: the line names what
would help); 2: a bad run file.

`flywheel up` runs the same check before it starts anything (`[stack]
check`, `--no-check`) and prints the verdict line alone: the run goes on
either way, so a warning costs the run only the check's own seconds.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from services.runtime.errors import EXIT_CONFIG, ConfigError

# The sampling keys are the buffer's (`[buffer]`): read through its settings class, by
# name, as `flywheel up`'s preflight reads every service's (no service imports another).
BUFFER_SETTINGS = "services.buffer.settings"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel check",
        description="Does the base model give RL anything to learn from? Samples [stack] model "
        "k times on N training prompts through the task's reward: pass@1, pass@k, flat groups, "
        "replies naming the answer, a few replies, and one verdict line.",
        epilog="exit status: 0 RL has something to learn from; 3 it warns (the line says what "
        "would help); 2 a bad run file. docs/task.md, 'Before you train'.",
    )
    p.add_argument("-c", "--config", required=True, help="TOML run file")
    p.add_argument("-n", type=int, default=32, help="training prompts to sample (default 32)")
    p.add_argument(
        "-k", type=int, help="replies per prompt (default: [buffer] samples_per_prompt, 8)"
    )
    p.add_argument("--temperature", type=float, help="default: [buffer] temperature (0.7)")
    p.add_argument("--max-new-tokens", type=int, help="default: [buffer] max_new_tokens (16)")
    p.add_argument("--seed", type=int, default=0, help="which prompts, and the sampling's seed")
    p.add_argument("--show", type=int, default=3, help="sample replies to print (default 3)")
    return p


def sampling(config: str, **flags: Any) -> Any:
    """The check's `Sampling`: the flags given, the run file's `[buffer]` for the rest."""
    from services.runtime.settings import load_settings
    from services.tasks.check import Sampling

    b = load_settings(importlib.import_module(BUFFER_SETTINGS).BufferSettings, config)
    given = {k: v for k, v in flags.items() if v is not None}
    how = Sampling(
        prompts=given.get("prompts", Sampling.prompts),
        k=given.get("k", b.samples_per_prompt),
        temperature=given.get("temperature", b.temperature),
        max_new_tokens=given.get("max_new_tokens", b.max_new_tokens),
        seed=given.get("seed", 0),
    )
    if how.prompts < 1 or how.k < 2 or how.temperature <= 0 or how.max_new_tokens < 1:
        raise ConfigError(f"flywheel check: -n >= 1, -k >= 2 (a group's spread needs two "
                          f"replies), temperature > 0, max_new_tokens >= 1; got {how}")  # fmt: skip
    return how


def run(s: Any, how: Any, *, show: int = 3) -> Any:
    """The check of `s.model` (a StackSettings, model resolved) on the run's tasks."""
    from services.models.resolve import resolve_model
    from services.tasks.check import check_dir

    model = resolve_model(s.model, key="[stack] model")
    return check_dir(model, s.task_set(), how, show=show)


def render(report: Any, model: Any) -> str:
    """Everything but the verdict line: what was sampled, the figures, a few replies."""
    s, how = report.stats, report.sampling
    named = "n/a" if s.names_answer is None else f"{s.names_answer:.3f}"
    lines = [
        f"{model}: {s.prompts} training prompts x {s.k} replies (temperature "
        f"{how.temperature:g}, max_new_tokens {how.max_new_tokens}, {report.dtype}) in "
        f"{report.seconds:.0f} s",
        f"  pass@1 {s.pass_at_1:.3f}  pass@{s.k} {s.pass_at_k:.3f}  flat groups {s.flat:.3f} "
        f"(all correct {s.all_correct:.3f})  replies naming the answer {named}  "
        f"mean reward {s.mean_reward:.3f}" + (f"  unscored {s.unscored:.3f}" if s.unscored else ""),
    ]
    for name, t in report.per_task.items():
        lines.append(f"  {name}: pass@1 {t.pass_at_1:.3f}  pass@{t.k} {t.pass_at_k:.3f}  "
                     f"flat {t.flat:.3f}")  # fmt: skip
    for x in report.samples:
        last = (x.prompt.rstrip().splitlines() or [""])[-1]
        last = last if len(last) <= 60 else "…" + last[-59:]
        lines.append(f"  {last}  ->  {x.reply[:80]!r}  (answer {x.answer}, reward "
                     f"{x.reward:g}{', correct' if x.correct else ''})")  # fmt: skip
    return "\n".join(lines)


def check_main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from services.runtime.service_main import settings_or_exit
    from services.stack.settings import StackSettings
    from services.tasks.check import NotCheckable

    settings = settings_or_exit("check", StackSettings, args.config, False)
    try:
        how = sampling(args.config, prompts=args.n, k=args.k, temperature=args.temperature,
                       max_new_tokens=args.max_new_tokens, seed=args.seed)  # fmt: skip
        report = run(settings, how, show=args.show)
    except NotCheckable as e:
        print(f"flywheel check: skipped: {e}")
        return 0
    except ConfigError as e:
        print(f"flywheel check: {str(e).removeprefix('flywheel check: ')}", file=sys.stderr)
        return EXIT_CONFIG
    print(render(report, settings.model), flush=True)
    print(f"flywheel check: {report.verdict.line}", flush=True)
    return report.verdict.exit_code


def before_up(s: Any, config: str) -> None:
    """`flywheel up`'s check: the verdict line alone, on the console, before anything
    starts (the run goes on after a warning: the line says what would help). A check
    that cannot run, or fails, says why in one line and the run starts anyway: it is
    advice, and the run it advises on must not depend on it."""
    from services.runtime.errors import FlywheelError

    if s.engine != "cpu":  # a GPU model sampled on this CPU would take minutes
        print("flywheel up: check skipped (engine = 'sglang'): run `flywheel check` where "
              "the model fits a GPU", flush=True)  # fmt: skip
        return
    print("flywheel up: checking the base model's replies (--no-check skips it)", flush=True)
    try:
        report = run(s, sampling(config))
    except KeyboardInterrupt:  # Ctrl-C while checking: the user stops the run, not the check
        print("flywheel up: interrupted during the check; nothing was started", flush=True)
        raise SystemExit(130) from None
    except FlywheelError as e:  # ConfigError, NotCheckable: preflight passed the run file
        print(f"flywheel up: check skipped: {e}", flush=True)
        return
    except Exception as e:  # noqa: BLE001 - advice only: a check that breaks must not stop the run
        print(f"flywheel up: check failed ({type(e).__name__}: {e}); starting anyway "
              f"(`flywheel check -c {config}` shows it)", flush=True)  # fmt: skip
        return
    print(f"flywheel up: check ({report.seconds:.0f} s): {report.verdict.line}", flush=True)
