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
from pathlib import Path
from typing import Any


def eval_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="flywheel eval", description="Held-out greedy accuracy of a weights directory."
    )
    p.add_argument("model", help="HF model directory (e.g. runs/demo/weights/demo/v000130)")
    p.add_argument("--task", choices=["arithmetic"], default="arithmetic")
    p.add_argument("-n", type=int, default=500, help="held-out problems")
    p.add_argument("--seed", type=int, default=1_000_003, help="seed of the held-out problems")
    p.add_argument("--digits", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print a JSON object")
    args = p.parse_args(argv)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        print(f"flywheel eval: {model_dir} is not a model directory (no config.json)",
              file=sys.stderr)  # fmt: skip
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.arithmetic import problem
    from services.trainer.evaluate import exact_match_accuracy

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    problems = [problem(args.seed, i, args.digits) for i in range(args.n)]
    r = exact_match_accuracy(model, tok, problems)
    if args.json:
        print(json.dumps({"accuracy": r.accuracy, "correct": r.correct, "total": r.total}))
    else:
        print(f"{model_dir}: held-out greedy accuracy {r.accuracy:.3f} ({r.correct}/{r.total})")
        for prompt, completion, answer in r.samples:
            print(f"  {prompt}{completion!r}  (answer {answer})")
    return 0


async def gather_status(settings: Any) -> dict[str, Any]:
    """Everything `flywheel status` shows, as a plain dict."""
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from proto.codec import decode
    from proto.errors import ProtocolError
    from proto.messages import WeightsPublished, WeightsReady
    from proto.streams import consumers_for, kv_bucket, stream_name, streams_for
    from proto.subjects import Subjects
    from services.common.nats_conn import connect

    run, subjects = settings.run, Subjects(settings.run)
    nc = await connect(settings.nats, "flywheel-status")
    js = nc.jetstream()
    out: dict[str, Any] = {"run": run, "streams": {}, "at": time.time()}
    try:
        for spec in streams_for(run):
            try:
                info = await js.stream_info(spec.name)
            except NotFoundError:
                continue
            out["streams"][spec.name] = {"messages": info.state.messages,
                                         "last_seq": info.state.last_seq}  # fmt: skip
        c = consumers_for(run)["rollout"]
        try:
            ci = await js.consumer_info(c.stream, c.durable)
            out["tasks"] = {"pending": ci.num_pending, "in_progress": ci.num_ack_pending}
        except NotFoundError:
            pass
        for key, subject, cls in (
            ("published", subjects.weights_published, WeightsPublished),
            ("ready", subjects.weights_ready, WeightsReady),
        ):
            try:
                raw = await js.get_last_msg(stream_name(run, "WEIGHTS"), subject)
                out[key] = decode(raw.data or b"", cls).version  # type: ignore[attr-defined]
            except (NotFoundError, ProtocolError):
                out[key] = None
        engines = {}
        for hb in await last_heartbeats(js, run, subjects.heartbeats_all):
            engines[hb.engine_id] = {
                "version": hb.weight_version,
                "url": hb.url,
                "running": hb.running,
                "age_s": time.time() - hb.sent_at,
            }
        out["engines"] = engines
        try:
            kv = await js.key_value(kv_bucket(run, "buffer"))
            from services.buffer.app import load_state

            state, pending = load_state((await kv.get("state")).value or b"")
            out["buffer"] = {"next_step": state.next_step, "dispatched": state.dispatched,
                             "in_flight": state.in_flight, "pending_groups": len(pending),
                             "epoch": state.cursor.epoch}  # fmt: skip
        except (NotFoundError, KeyNotFoundError):
            out["buffer"] = None
        reasons: Counter[str] = Counter()
        try:  # per-subject counts, straight from the server
            dlq = await js.stream_info(stream_name(run, "DLQ"), subjects_filter=subjects.dlq_all)
            for subject, count in (dlq.state.subjects or {}).items():
                reasons[subject.rsplit(".", 1)[-1]] += count
        except NotFoundError:
            pass
        out["dead_letters"] = dict(reasons)
    finally:
        await nc.close()
    return out


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


def render_status(s: dict[str, Any]) -> str:
    lines = [f"run {s['run']}"]
    b = s.get("buffer")
    if b:
        lines.append(f"  buffer: next step {b['next_step']}, {b['dispatched']} tasks dispatched, "
                     f"{b['in_flight']} in flight, {b['pending_groups']} groups pending, "
                     f"epoch {b['epoch']}")  # fmt: skip
    t = s.get("tasks")
    if t:
        lines.append(f"  tasks queue: {t['pending']} waiting, {t['in_progress']} being generated")
    lines.append(
        f"  weights: published v{s.get('published')}, ready on every engine v{s.get('ready')}"
    )
    for eid, e in sorted(s.get("engines", {}).items()):
        lines.append(f"  engine {eid}: v{e['version']} at {e['url']}, {e['running']} running, "
                     f"heartbeat {e['age_s']:.0f}s ago")  # fmt: skip
    dl = s.get("dead_letters") or {}
    lines.append(
        "  dead letters: " + (", ".join(f"{k} {v}" for k, v in sorted(dl.items())) or "none")
    )
    for name, st in sorted(s["streams"].items()):
        lines.append(f"  stream {name}: {st['messages']} messages (last seq {st['last_seq']})")
    return "\n".join(lines)


def status_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="flywheel status", description=__doc__.split("\n\n")[1])
    p.add_argument("-c", "--config", help="the run file ([nats] url and run name)")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    args = p.parse_args(argv)
    from services.common.service_main import settings_or_exit
    from services.stack.settings import StackSettings

    settings = settings_or_exit("status", StackSettings, args.config, False)
    s = asyncio.run(gather_status(settings))
    print(json.dumps(s, indent=2) if args.json else render_status(s))
    return 0
