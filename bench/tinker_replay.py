"""What a restart of `flywheel tinker` on a journal costs: the replay of every logged step.

For each N in --steps: a server on a fresh journal stream (a local nats-server), the
Tinker SDK runs N cross-entropy steps (forward_backward + optim_step of two short
datums), the server is SIGKILLed and started again on the stream; the restarted
server's log says how long its replay took. Prints, per N, the live seconds per step,
the replay's seconds in all and per replayed step, and the restart's time until
/healthz answers (model load included); then the same steps on a server without a
journal, for what the appends cost a live step. docs/tinker.md records a run.

    python bench/tinker_replay.py [--model DIR] [--steps 5 20 40]

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


def one(model: Path, steps: int, nats_url: str, root: Path, journal: bool) -> dict[str, float]:
    import tinker
    from tinker import types

    port, log = _free_port(), root / f"server-{steps}-{journal}.log"
    env = {
        **os.environ,
        "FLYWHEEL_TINKER_NUM_THREADS": "1",
        "FLYWHEEL_TINKER_STATE_DIR": str(root / "state"),
        "FLYWHEEL_TINKER_JOURNAL_STREAM": f"bench-replay-{steps}" if journal else "",
        "FLYWHEEL_TINKER_NATS__URL": nats_url,
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
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    t0 = time.perf_counter()
    process = _start(model, port, env, log)
    restart = time.perf_counter() - t0
    service.close("success").result()
    process.terminate()
    process.wait(30)
    found = REPLAYED.findall(log.read_text())
    replay_s, replayed_steps = float(found[-1][0]), int(found[-1][1])
    assert replayed_steps == steps, (replayed_steps, steps)
    return {"live": live, "replay": replay_s, "per_step": replay_s / steps, "restart": restart}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the tests' tiny model)")
    p.add_argument("--steps", type=int, nargs="+", default=[5, 20, 40])
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
        print("steps  live s/step  replay s  replay s/step  restart to healthy s")
        for n in args.steps:
            r = one(model, n, nats.url, root, journal=True)
            print(f"{n:5d}  {r['live']:11.3f}  {r['replay']:8.2f}  {r['per_step']:13.3f}  "
                  f"{r['restart']:20.2f}")  # fmt: skip
        n = max(args.steps)
        bare = one(model, n, nats.url, root, journal=False)["live"]
        print(f"{n:5d} steps without a journal: {bare:.3f} s/step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
