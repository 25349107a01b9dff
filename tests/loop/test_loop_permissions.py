"""The whole loop with each service logged in as its own NATS user, limited to its subjects.

The users and permissions are services/stack/nats_permissions.py's (what the
Kubernetes base's nats-auth.conf holds), on a real nats-server; the stack is
`flywheel up`'s plan (one CPU engine, its rollout worker, sync, trainer,
buffer) with weights over NATS, so every grant a service needs is used: the
trainer uploads chunks and announces versions, the worker reads them beside
its engine, sync purges old ones and announces them ready, the buffer keeps
its KV state. The loop must get through versions with no permission refused
in any log. (Denials themselves: tests/integration/runtime/test_nats_security.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from proto.messages import WeightsReady
from proto.subjects import Subjects
from services.stack.localdev.nats_server import NatsServer
from services.stack.nats_permissions import SERVICES, authorization
from tests.harness.poll import wait_for
from tests.harness.runfile import run_file
from tests.harness.stack import Stack, printing_logs_on_failure, stack_table
from tests.harness.streams import messages

RUN = "perms"
pytestmark = pytest.mark.slow


def _conf() -> str:
    users = authorization(RUN, {s: f'"pw-{s}"' for s in SERVICES})
    # An observer for the test itself (no permissions block: everything).
    return "jetstream {}\n" + users.replace(
        "  users = [\n", '  users = [\n    { user: observer, password: "pw-observer" }\n'
    )


def test_the_loop_runs_with_each_service_under_its_own_user(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = tmp_path / "run.toml"
    config.write_text(run_file(
        RUN,
        stack=stack_table(tmp_path, tiny_model, engines=1),
        task={"source": {"type": "arithmetic", "digits": 1}},
        buffer={"samples_per_prompt": 4, "groups_per_step": 2, "max_new_tokens": 4,
                "max_staleness": 1, "oversample": 0.0, "filter_zero_variance": False},
        rollout={"concurrency": 4, "heartbeat_s": 0.3, "weights_poll_s": 0.5},
        engine={"num_threads": 1},
        trainer={"publish_every": 1, "weights_transport": "nats", "runtime": {"cpu_threads": 1},
                 "optim": {"lr": 1e-3}},
        sync={"liveness_s": 3.0, "tick_s": 0.1, "retry_backoff_s": 0.2, "keep_last": 2},
    ))  # fmt: skip
    logins = {}
    for s in SERVICES:
        logins[f"FLYWHEEL_{s.upper()}_NATS__USER"] = s
        logins[f"FLYWHEEL_{s.upper()}_NATS__PASSWORD"] = f"pw-{s}"
    with NatsServer(config=_conf()) as nats, Stack(config, nats.url, env=logins) as st:
        observer = nats.url.replace("nats://", "nats://observer:pw-observer@")
        with printing_logs_on_failure(st):
            st.start("engine-0", "rollout-0")  # the worker waits for its engine
            st.start("sync", "trainer")
            st.start("buffer")

            def ready() -> int:
                msgs = messages(observer, RUN, "WEIGHTS", Subjects(RUN).weights_ready, WeightsReady)
                return max((m.version for m in msgs), default=0)

            wait_for(lambda: ready() >= 3, 240, "three versions ready on the engine")
        logs = {n: st.proc(n).log() for n in st.names}
    for name, text in logs.items():
        assert "ermissions violation" not in text and "Permissions Violation" not in text, (
            name, text[-3000:])  # fmt: skip
