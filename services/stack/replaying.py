"""What `flywheel replay` needs of the stack, handed to it by services/cli.py.

`flywheel replay` (services/replay/) may not import the stack (the import
contract), yet a replay of a run `flywheel up` ran needs two things only
the stack knows: where that run kept its NATS store, opened again once the
run has stopped (`open_store`), and the trainer process exactly as `up`
planned it (`trainer_process`: the same command, the same per-process
environment: `[stack] cpus` pins the trainer's cores and sets its torch
threads to match, which a bit-exact replay must repeat).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from services.stack.localdev.ports import free_port


@contextlib.contextmanager
def open_store(run_dir: Path) -> Iterator[str]:
    """A nats-server on the stopped run's store (`<run_dir>/nats`); its URL while open."""
    from services.runtime.errors import ConfigError
    from services.stack.localdev.nats_server import NatsServer

    store = run_dir / "nats"
    if not store.is_dir():
        raise ConfigError(
            f"no NATS store at {store}: the run was not recorded there (give --nats URL "
            "for a run whose NATS is elsewhere)"
        )
    with NatsServer(store_dir=store) as server:
        yield server.url


def trainer_process(
    config: Path, nats_url: str
) -> tuple[tuple[str, ...], dict[str, str], tuple[int, ...]]:
    """The trainer `flywheel up -c config` starts: (argv, environment, pinned cores)."""
    from services.runtime.settings import load_settings
    from services.stack.plan import ProcSpec, pinned, trainer_spec
    from services.stack.settings import StackSettings

    s = load_settings(StackSettings, config)
    prefix = "FLYWHEEL_TRAINER_"

    def service(
        kind: str, name: str, argv: tuple[str, ...], env: dict[str, str], **extra: object
    ) -> ProcSpec:
        port = free_port()
        env = {f"{prefix}NATS__URL": nats_url, f"{prefix}METRICS_PORT": str(port),
               f"{prefix}RUN": s.run, **env}  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        return ProcSpec(name, kind, argv, env, f"{url}/readyz", f"{url}/metrics", **extra)  # type: ignore[arg-type]

    spec = pinned(s, trainer_spec(s, config.resolve(), s.run_dir.resolve(), service))
    return spec.argv, dict(spec.env), tuple(spec.cpus or ())
