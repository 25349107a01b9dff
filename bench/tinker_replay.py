"""What a restart of `flywheel tinker` on a journal costs: the replay of the logged steps,
with and without replay checkpoints.

For each N in --steps, twice (without checkpoints, then with `[tinker]
journal_checkpoint_every` = --checkpoint-every): a server on a fresh journal stream (a
local nats-server), the Tinker SDK runs N cross-entropy steps (forward_backward +
optim_step of two short datums), the server is SIGKILLed and started again on the
stream; the restarted server's log says how long its replay took (a checkpoint's load
included) and how many optim_steps it ran again, and its checkpoint lines how long
requests were held, how long a checkpoint took to write and to load. Prints, per N and
case, the live seconds per step, the optim_steps replayed, the replay's seconds, the
restart's time until /healthz answers (model load included), the records the stream
holds after the restart and the checkpoints' times; then the same steps on a server
without a journal, for what the appends cost a live step.
docs/tinker.md records a run.

    python bench/tinker_replay.py [--model DIR] [--steps 5 20 40] [--checkpoint-every 15]

Without --model, the tests' tiny model (services/models/tiny_model.py), written to a
temporary directory. The server runs on one torch thread, as the tests' do.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPLAYED = re.compile(r"records replayed in ([0-9.]+) s: .*\((\d+) optim_steps\)")
LOADED = re.compile(r"checkpoint \d+ loaded in ([0-9.]+) s")
CHECKPOINTED = re.compile(r"requests held ([0-9.]+) s, written in ([0-9.]+) s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(model: Path, port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    import httpx

    cmd = [sys.executable, "-m", "services.tinker", "--model", str(model), "--port", str(port)]
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited {process.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the server did not answer /healthz in 600 s: see {log}")


def _data(tokenizer: Any) -> list[Any]:
    import numpy as np
    from tinker import types

    data = []
    for text in ("the cat sat on the mat", "a dog ran to the park"):
        ids = list(tokenizer.encode(text))
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": np.asarray(ids[1:], dtype=np.int64)},
            )
        )
    return data


def _stream_messages(nats_url: str, stream: str) -> int:
    import asyncio

    import nats

    async def body() -> int:
        nc = await nats.connect(nats_url)
        try:
            return int((await nc.jetstream().stream_info(stream)).state.messages)
        finally:
            await nc.close()

    return asyncio.run(body())


def one(
    model: Path, steps: int, nats_url: str, root: Path, journal: bool, every: int = 0
) -> dict[str, float]:
    import tinker
    from tinker import types

    port, log = _free_port(), root / f"server-{steps}-{journal}-{every}.log"
    stream = f"bench-replay-{steps}-{every}"
    env = {
        **os.environ,
        "FLYWHEEL_TINKER_NUM_THREADS": "1",
        "FLYWHEEL_TINKER_STATE_DIR": str(root / "state"),
        "FLYWHEEL_TINKER_JOURNAL_STREAM": stream if journal else "",
        "FLYWHEEL_TINKER_NATS__URL": nats_url,
        "FLYWHEEL_TINKER_JOURNAL_CHECKPOINT_EVERY": str(every),
        "FLYWHEEL_TINKER_CHECKPOINT_DIR": str(root / "checkpoints"),
    }
    process = _start(model, port, env, log)
    service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}")
    training = service.create_lora_training_client(base_model=model.name, rank=8, seed=1).result()
    data = _data(training.get_tokenizer())
    t0 = time.perf_counter()
    for _ in range(steps):
        fb = training.forward_backward(data, "cross_entropy")
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        fb.result()
    live = (time.perf_counter() - t0) / steps
    if not journal:
        service.close("success").result()  # else its heartbeats complain once the server is gone
        process.terminate()
        process.wait(30)
        return {"live": live}
    if every:  # the last checkpoint due is written after its step's answer
        deadline = time.monotonic() + 120
        while len(CHECKPOINTED.findall(log.read_text())) < steps // every:
            if time.monotonic() > deadline:
                raise SystemExit(f"checkpoints missing in {log}")
            time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    t0 = time.perf_counter()
    process = _start(model, port, env, log)
    restart = time.perf_counter() - t0
    service.close("success").result()
    process.terminate()
    process.wait(30)
    text = log.read_text()
    found = REPLAYED.findall(text)
    replay_s, replayed_steps = float(found[-1][0]), int(found[-1][1])
    assert replayed_steps == (steps % every if every else steps), (replayed_steps, steps)
    held = [float(h) for h, _ in CHECKPOINTED.findall(text)]
    written = [float(w) for _, w in CHECKPOINTED.findall(text)]
    return {
        "live": live,
        "replayed": replayed_steps,
        "replay": replay_s,
        "restart": restart,
        "messages": _stream_messages(nats_url, stream),
        "held": max(held, default=0.0),
        "written": max(written, default=0.0),
        "loaded": max((float(x) for x in LOADED.findall(text)), default=0.0),  # 0: none taken
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the tests' tiny model)")
    p.add_argument("--steps", type=int, nargs="+", default=[5, 20, 40])
    p.add_argument("--checkpoint-every", type=int, default=15)
    args = p.parse_args()
    os.environ.setdefault("TINKER_API_KEY", "tml-local")
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from services.stack.localdev.nats_server import NatsServer

    with tempfile.TemporaryDirectory() as tmp, NatsServer() as nats:
        root = Path(tmp)
        if args.model:
            model = Path(args.model).expanduser()
        else:
            from services.models.tiny_model import TinyModelSpec, write_tiny_model

            model = write_tiny_model(root / "tiny" / "model", TinyModelSpec())
        print(f"model {model.name}; steps of forward_backward + optim_step, 2 datums")
        print("steps  checkpoint every  live s/step  steps replayed  replay s  restart to "
              "healthy s  stream records  checkpoint: held s  written s  loaded s")  # fmt: skip
        for n in args.steps:
            for every in (0, args.checkpoint_every):
                r = one(model, n, nats.url, root, journal=True, every=every)
                print(f"{n:5d}  {every or '-':>16}  {r['live']:11.3f}  {r['replayed']:14d}  "
                      f"{r['replay']:8.2f}  {r['restart']:20.2f}  {r['messages']:14d}  "
                      f"{r['held']:18.3f}  {r['written']:9.3f}  {r['loaded']:8.2f}",
                      flush=True)  # fmt: skip
        n = max(args.steps)
        bare = one(model, n, nats.url, root, journal=False)["live"]
        print(f"{n:5d} steps without a journal: {bare:.3f} s/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
