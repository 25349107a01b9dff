"""`flywheel status` reads a run's state from a real nats-server; `flywheel eval` scores a model."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import nats

from proto.examples import EXAMPLES
from proto.messages import EngineHeartbeat, WeightsPublished, WeightsReady
from proto.streams import kv_bucket, streams_for
from proto.subjects import Subjects
from services.buffer.core import BufferState, Cursor
from services.buffer.state import dump_state
from services.models.tiny_model import write_tiny_model
from services.runtime.nats_conn import ensure_streams
from services.runtime.publish import publish
from services.stack.localdev.nats_server import NatsServer

RUN = "inspected"


async def seed_run(url: str) -> None:
    from nats.js.api import KeyValueConfig

    nc = await nats.connect(url)
    js = nc.jetstream()
    await ensure_streams(js, streams_for(RUN))
    s, mp = Subjects(RUN), nc.max_payload
    for i, v in enumerate((3, 4)):
        hb = EngineHeartbeat(run=RUN, engine_id=f"e{i}", url=f"http://h{i}:1", worker_id="w",
                             weight_version=v, running=2, sent_at=0.0)  # fmt: skip
        await publish(js, s.heartbeat(f"e{i}"), hb, mp)
        await publish(js, s.heartbeat(f"e{i}"), hb.model_copy(update={"weight_version": v + 1}), mp)
    wp = EXAMPLES["WeightsPublished"]
    assert isinstance(wp, WeightsPublished)
    await publish(js, s.weights_published, wp.model_copy(update={"run": RUN, "version": 5}), mp)
    await publish(js, s.weights_ready, WeightsReady(run=RUN, version=4), mp)
    dl = EXAMPLES["DeadLetter"]
    for reason in ("stale", "stale", "malformed"):
        await js.publish(s.dlq(reason), bytes(dl.model_dump()["payload"]))
    kv = await js.create_key_value(KeyValueConfig(bucket=kv_bucket(RUN, "buffer")))
    state = BufferState(cursor=Cursor(1, 7), dispatched=40, answered=35, next_step=9)
    await kv.put("state", dump_state(state, [("g1", 3)]))
    await nc.close()


def test_status_reads_the_run_from_nats(tmp_path: Path) -> None:
    with NatsServer() as server:
        asyncio.run(seed_run(server.url))
        cfg = tmp_path / "run.toml"
        cfg.write_text(f'run = "{RUN}"\n[nats]\nurl = "{server.url}"\n')
        out = subprocess.run(
            [sys.executable, "-m", "services", "status", "-c", str(cfg), "--json"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
    s = json.loads(out)
    assert (s["published"], s["ready"]) == (5, 4)
    assert {k: e["version"] for k, e in s["engines"].items()} == {"e0": 4, "e1": 5}
    assert s["buffer"] == {"next_step": 9, "dispatched": 40, "in_flight": 5,
                           "pending_groups": 1, "epoch": 1}  # fmt: skip
    assert s["dead_letters"] == {"stale": 2, "malformed": 1}


def test_eval_scores_a_model_directory(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    r = subprocess.run(
        [sys.executable, "-m", "services", "eval", str(model), "-n", "20", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["total"] == 20 and 0.0 <= res["accuracy"] <= 1.0
    bad = subprocess.run(
        [sys.executable, "-m", "services", "eval", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "no such model directory" in bad.stderr
