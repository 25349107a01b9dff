"""`flywheel replay {train,rescore,export} -c run.toml`: a recorded run read back.

argparse reads the run file and a few flags; the rest is the run file's
settings (`[replay]`, services/replay/settings.py, and the run's own).
Heavy imports (torch, transformers, pyarrow) happen inside the command
that needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from services.replay.source import Hooks, RecordedRun, nats_url, recorded_run
from services.runtime.errors import FlywheelError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel replay",
        description="Read a recorded run back: re-train on its batches, re-score its samples, "
        "or export them. docs/replay.md.",
    )
    sub = p.add_subparsers(dest="what", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-c", "--config", type=Path, required=True, help="the run's run file")
    common.add_argument("--nats", help="NATS URL holding the run's streams (default: see docs)")
    common.add_argument(
        "--print-config", action="store_true", help="print the resolved [replay] settings, exit"
    )
    t = sub.add_parser("train", parents=[common], help="re-train on the recorded batches")
    t.add_argument("--out", type=Path, help="replay directory (default: [replay] out_dir)")
    t.add_argument("--steps", type=int, help="steps to train (default: as many as the run did)")
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a [trainer] setting (optim.lr=1e-5): an ablation on the same batches",
    )
    r = sub.add_parser("rescore", parents=[common], help="score the recorded samples again")
    r.add_argument("--reward", help="TOML value of [task] reward (default: the run file's)")
    r.add_argument("--out", type=Path, help="per-sample JSONL (default: <out_dir>/rescore.jsonl)")
    r.add_argument(
        "--judge-url",
        action="append",
        default=[],
        metavar="URL",
        help="a judge engine for judge reward parts (repeatable; default: [judge] urls)",
    )
    e = sub.add_parser("export", parents=[common], help="samples to Parquet / datasets")
    e.add_argument("--parquet", type=Path, help="write a Parquet file here")
    e.add_argument("--dataset", type=Path, help="write a `datasets` directory here")
    return p


def main(argv: list[str], hooks: Hooks | None = None) -> int:
    args = parser().parse_args(argv)
    hooks = hooks or Hooks()
    try:
        return _run(args, hooks)
    except FlywheelError as e:
        print(f"flywheel replay: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, hooks: Hooks) -> int:
    from services.replay.rescore import reward_overrides

    rec = recorded_run(args.config)
    if args.what == "rescore" and args.reward is not None:
        rec = recorded_run(args.config, **reward_overrides(rec, args.reward))
    if args.print_config:
        from services.runtime.settings import render

        print(render(rec.settings))
        return 0
    if args.what == "export" and args.parquet is None and args.dataset is None:
        print("flywheel replay export: give --parquet FILE and/or --dataset DIR", file=sys.stderr)
        return 2
    if args.what in ("export", "rescore"):  # they decode with the run's tokenizer
        rec.model_dir()  # a bad [stack] model: one line now, not after the streams are read
    judges: tuple[str, ...] = ()
    if args.what == "rescore":  # refused before the recording is opened
        from services.replay.rescore import judge_urls

        judges = judge_urls(rec, args.judge_url)
    with nats_url(rec, args.nats, hooks) as url:
        if args.what == "train":
            from services.replay.retrain import train_main

            return train_main(rec, url, hooks, out=args.out, steps=args.steps, sets=args.set)
        if args.what == "rescore":
            return _rescore(rec, url, hooks, args.out, judges)
        return _export(rec, url, args.parquet, args.dataset)


def _rescore(
    rec: RecordedRun, url: str, hooks: Hooks, out: Path | None, judges: tuple[str, ...]
) -> int:
    from services.replay.rescore import rescore
    from services.runtime.errors import ConfigError

    if hooks.task_finder is None:
        raise ConfigError("replay rescore needs the buffer's task finder (run `flywheel replay`)")
    out = out or rec.out_dir / "rescore.jsonl"
    report = asyncio.run(rescore(rec, url, hooks.task_finder(rec.config), out, judges))
    print(json.dumps(report))
    print(
        f"flywheel replay: {report['rescored']} of {report['samples']} samples rescored: "
        f"mean reward {report['mean_old']:.3f} -> {report['mean_new']:.3f}, "
        f"{report['changed']} changed ({report['report']})"
        + (f"; judge parts by {', '.join(judges)}" if judges else "")
    )
    return 0


def _export(rec: RecordedRun, url: str, parquet: Path | None, dataset: Path | None) -> int:
    from proto.messages import TrainBatch
    from services.replay import records
    from services.replay.export import write
    from services.replay.samples import rows_of, tokenizer_decode
    from services.replay.source import connected

    async def read() -> tuple[records.Recording, records.Recording]:
        async with connected(rec, url) as js:
            groups = await records.sample_groups(js, rec.run)
            return groups, await records.read(js, rec.run, "BATCHES", TrainBatch)

    groups, batches = asyncio.run(read())
    decode = tokenizer_decode(rec.model_dir())
    trained = records.trained_steps(batches)
    rows = [
        row
        for seq, g in groups.messages
        for row in rows_of(seq, g, decode, trained.get(g.group_id))
    ]
    for line in write(rows, parquet, dataset):
        print(f"flywheel replay: wrote {line}")
    return 0
