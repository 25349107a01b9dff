"""`flywheel status` and `flywheel eval`: look at a run, or at a weights directory.

`status` reads a running (or finished) run's state straight from NATS —
stream positions, the buffer's persisted state, the newest weight versions,
each engine's last heartbeat, dead letters by reason — so it works from any
machine that can reach the run's NATS, with no service's cooperation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


def eval_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="flywheel eval",
        description="Held-out pass@1 (greedy) and pass@k of a model on a run's task.",
    )
    p.add_argument("model", nargs="?", help="weights directory (same as --weights)")
    p.add_argument("-c", "--config", help="run file: its [task] (default: the arithmetic task)")
    p.add_argument(
        "--weights",
        help="HF model directory (default: the run's newest weights, else [stack] model)",
    )
    p.add_argument("-n", type=int, help="held-out rows (default: [task] eval.size)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    args = p.parse_args(argv)
    from services.runtime.errors import ConfigError
    from services.tasks.evaluate import evaluate_dir

    try:
        tasks, model_dir = eval_target(args.config, args.weights or args.model)
        tasks.check(data=True)  # the held-out data found, before the model loads
        report = evaluate_dir(model_dir, tasks, size=args.n)
    except ConfigError as e:
        print(f"flywheel eval: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = {"model": str(model_dir), **report.metrics(), "accuracy": report.pass_at_1}
        print(json.dumps({**doc, "total": report.total, "split": report.split}))
        return 0
    if report.split != "test":
        print("flywheel eval: no test split ([task] eval.test_source or eval.holdout): on the "
              "validation split, which the trainer chooses its best checkpoint on")  # fmt: skip
    for name, t in report.tasks.items():
        k = f", pass@{t.k} {t.pass_at_k:.3f}" if t.pass_at_k is not None else ""
        print(
            f"{model_dir}: {name}: {report.split} pass@1 {t.pass_at_1:.3f}{k} "
            f"(greedy, {t.total} rows; mean reward {t.mean_reward:.3f})"
        )
        for prompt, completion, answer in t.examples:
            print(example_line(prompt, completion, answer))
    return 0


def example_line(prompt: str, completion: str, answer: str | None) -> str:
    """One held-out example as `flywheel eval` prints it: the prompt's last line (a chat's
    user turn, `user: …`), then the completion quoted (its whitespace matters), and the answer."""
    lines = prompt.rstrip().splitlines() or [""]
    return f"  {lines[-1][-70:]}  ->  {completion[:80]!r}  (answer {answer})"


def eval_target(config: str | None, weights: str | None) -> tuple[Any, Path]:
    """The tasks and the model directory `flywheel eval` evaluates (ConfigError if none)."""
    from services.runtime.errors import ConfigError
    from services.runtime.settings import load_settings
    from services.stack.demo import latest_weights
    from services.stack.settings import StackSettings
    from services.tasks.arithmetic import ArithmeticSource
    from services.tasks.spec import EvalSpec, TaskSpec
    from services.tasks.taskset import TaskSet

    if config is None:  # the arithmetic task's validation and test problems
        held_out = ArithmeticSource(type="arithmetic", seed=1_000_003)
        spec = TaskSpec(
            source=ArithmeticSource(type="arithmetic"),
            eval=EvalSpec(source=held_out, test_source=held_out, size=500),
        )
        tasks, model_dir = TaskSet({"arithmetic": spec}, {"arithmetic": "[task]"}), None
    else:
        s = load_settings(StackSettings, config)
        tasks = s.task_set()
        model_dir = latest_weights(s.run_dir, s.run) or s.model
    from services.models.resolve import resolve_model

    if weights:
        return tasks, resolve_model(weights, key="--weights")
    if model_dir is None:
        raise ConfigError("no model: give a weights directory (or -c run.toml)")
    return tasks, resolve_model(model_dir, key="[stack] model")


BufferStatus = Callable[[Any, str], Awaitable["dict[str, Any] | None"]]
"""(JetStream context, run) -> the buffer's persisted state as `flywheel status` shows it,
None before it wrote one. The buffer owns its state's format: services/cli.py hands
`flywheel status` the buffer's reader (services/buffer/store.py `read_status`)."""


async def gather_status(settings: Any, buffer_status: BufferStatus) -> dict[str, Any]:
    """Everything `flywheel status` shows, as a plain dict."""
    from services.runtime.nats_conn import connect

    run = settings.run
    nc = await connect(settings.nats, "flywheel-status")
    js = nc.jetstream()
    try:
        return {
            "run": run,
            "streams": await _streams(js, run),
            "at": time.time(),
            **await _task_queue(js, run),
            **await _weight_versions(js, run),
            "engines": await _engines(js, run),
            "buffer": await buffer_status(js, run),
            "dead_letters": await _dead_letters(js, run),
        }
    finally:
        await nc.close()


async def _streams(js: Any, run: str) -> dict[str, Any]:
    from nats.js.errors import NotFoundError

    from proto.streams import streams_for

    out = {}
    for spec in streams_for(run):
        try:
            info = await js.stream_info(spec.name)
        except NotFoundError:
            continue
        out[spec.name] = {"messages": info.state.messages, "last_seq": info.state.last_seq}
    return out


async def _task_queue(js: Any, run: str) -> dict[str, Any]:
    """The rollout work queue's backlog (absent until a worker made its consumer)."""
    from nats.js.errors import NotFoundError

    from proto.streams import consumers_for

    c = consumers_for(run)["rollout"]
    try:
        ci = await js.consumer_info(c.stream, c.durable)
    except NotFoundError:
        return {}
    return {"tasks": {"pending": ci.num_pending, "in_progress": ci.num_ack_pending}}


async def _weight_versions(js: Any, run: str) -> dict[str, Any]:
    """The newest version published (and what it cost on the wire), the newest ready."""
    from nats.js.errors import NotFoundError

    from proto.codec import decode
    from proto.errors import ProtocolError
    from proto.messages import WeightsPublished, WeightsReady
    from proto.streams import stream_name
    from proto.subjects import Subjects

    subjects = Subjects(run)
    out: dict[str, Any] = {}
    for key, subject, cls in (
        ("published", subjects.weights_published, WeightsPublished),
        ("ready", subjects.weights_ready, WeightsReady),
    ):
        try:
            raw = await js.get_last_msg(stream_name(run, "WEIGHTS"), subject)
            msg = decode(raw.data or b"", cls)
        except (NotFoundError, ProtocolError):
            out[key] = None
            continue
        out[key] = msg.version  # type: ignore[attr-defined]
        if isinstance(msg, WeightsPublished):
            out["wire"] = wire_of(msg)
    return out


def wire_of(m: Any) -> dict[str, Any]:
    """What the newest version cost on the wire (WeightsPublished's optional fields)."""
    w = m.wire
    return {"full_bytes": m.size_bytes, **(w.model_dump() if w is not None else {})}


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def wire_line(w: dict[str, Any]) -> str:
    """`3.2 MB whole, delta 41.0 kB (0.013x, 0.40% changed), sent 41.0 kB in 0.05s`."""
    mb = _size
    parts = [f"{mb(w['full_bytes'])} whole"]
    if w.get("delta_bytes") is not None:
        ratio = w["delta_bytes"] / max(w["full_bytes"], 1)
        changed = (w.get("changed_fraction") or 0.0) * 100
        parts.append(f"delta {mb(w['delta_bytes'])} ({ratio:.3f}x, {changed:.2f}% changed)")
    if w.get("sent_bytes") is not None:
        parts.append(f"sent {mb(w['sent_bytes'])} in {w.get('publish_s') or 0.0:.2f}s")
    else:
        parts.append("nothing sent (shared disk)")
    return "  weights on the wire (newest): " + ", ".join(parts)


async def _engines(js: Any, run: str) -> dict[str, Any]:
    from proto.subjects import Subjects

    return {
        hb.engine_id: {
            "version": hb.weight_version,
            "url": hb.url,
            "running": hb.running,
            "age_s": time.time() - hb.sent_at,
        }
        for hb in await last_heartbeats(js, run, Subjects(run).heartbeats_all)
    }


async def _dead_letters(js: Any, run: str) -> dict[str, int]:
    """Dead letters by reason: per-subject counts, straight from the server."""
    from nats.js.errors import NotFoundError

    from proto.streams import stream_name
    from proto.subjects import Subjects

    reasons: Counter[str] = Counter()
    subjects = Subjects(run)
    try:
        dlq = await js.stream_info(stream_name(run, "DLQ"), subjects_filter=subjects.dlq_all)
    except NotFoundError:
        return {}
    for subject, count in (dlq.state.subjects or {}).items():
        reasons[subject.rsplit(".", 1)[-1]] += count
    return dict(reasons)


async def last_heartbeats(js: Any, run: str, subject: str) -> list[Any]:
    """The newest heartbeat of every engine (one per subject in ENGINES)."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.api import ConsumerConfig, DeliverPolicy
    from nats.js.errors import NotFoundError

    from proto.codec import decode
    from proto.errors import ProtocolError
    from proto.messages import EngineHeartbeat
    from proto.streams import stream_name

    stream = stream_name(run, "ENGINES")
    try:
        n = (await js.stream_info(stream)).state.messages
    except NotFoundError:
        return []
    if n == 0:
        return []
    cfg = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
    sub = await js.pull_subscribe(subject, durable=None, stream=stream, config=cfg)
    out = []
    try:
        for msg in await sub.fetch(n, timeout=2):
            try:
                out.append(decode(msg.data, EngineHeartbeat))
            except ProtocolError:
                continue  # a malformed heartbeat says nothing about an engine
    except (TimeoutError, NatsTimeout):
        pass  # fewer than n arrived: show what did
    finally:
        await sub.unsubscribe()
    return out


def stale_line(run: str, streams: dict[str, Any], dead: dict[str, int]) -> list[str]:
    """Groups generated and then dropped as stale (wasted generation), when any were made."""
    from proto.streams import stream_name

    generated = streams.get(stream_name(run, "SAMPLES"), {}).get("messages", 0)
    if not generated:
        return []
    stale = dead.get("stale", 0)
    return [f"  stale drops: {stale} of {generated} groups generated ({stale / generated:.1%})"]


def render_status(s: dict[str, Any]) -> str:
    lines = [f"run {s['run']}"]
    b = s.get("buffer")
    if b:
        lines.append(
            f"  buffer: next step {b['next_step']}, {b['dispatched']} tasks dispatched, "
            f"{b['in_flight']} in flight, {b['pending_groups']} groups pending, "
            f"epoch {b['epoch']}"
        )
    t = s.get("tasks")
    if t:
        lines.append(f"  tasks queue: {t['pending']} waiting, {t['in_progress']} being generated")
    lines.append(
        f"  weights: published v{s.get('published')}, ready on every engine v{s.get('ready')}"
    )
    if s.get("wire"):
        lines.append(wire_line(s["wire"]))
    for eid, e in sorted(s.get("engines", {}).items()):
        lines.append(
            f"  engine {eid}: v{e['version']} at {e['url']}, {e['running']} running, "
            f"heartbeat {e['age_s']:.0f}s ago"
        )
    dl = s.get("dead_letters") or {}
    lines.append(
        "  dead letters: " + (", ".join(f"{k} {v}" for k, v in sorted(dl.items())) or "none")
    )
    lines += stale_line(s["run"], s.get("streams") or {}, dl)
    for name, st in sorted(s["streams"].items()):
        lines.append(f"  stream {name}: {st['messages']} messages (last seq {st['last_seq']})")
    return "\n".join(lines)


def status_main(argv: list[str] | None = None, *, buffer_status: BufferStatus) -> int:
    p = argparse.ArgumentParser(prog="flywheel status", description=__doc__.split("\n\n")[1])
    p.add_argument("-c", "--config", help="the run file ([nats] url and run name)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    args = p.parse_args(argv)
    from services.runtime.service_main import settings_or_exit
    from services.stack.settings import StackSettings

    settings = settings_or_exit("status", StackSettings, args.config, False, attach=True)
    # The run's NATS is up or the command says so at once: no minute of retries.
    import logging

    from services.runtime.errors import FlywheelError

    # A one-shot reader: the connection's own notes (closing = "disconnected") are not news.
    logging.getLogger("services.runtime.nats_conn").setLevel(logging.ERROR)
    nats = settings.nats.model_copy(update={"connect_attempts": 1})
    try:
        s = asyncio.run(gather_status(settings.model_copy(update={"nats": nats}), buffer_status))
    except (OSError, TimeoutError, FlywheelError) as e:
        from services.runtime.redact import redact

        where = redact(nats.url)
        print(f"flywheel status: cannot reach NATS at {where}: {redact(str(e))}", file=sys.stderr)
        return 1
    print(json.dumps(s, indent=2) if args.json else render_status(s))
    return 0
