"""What `flywheel up` starts, in readiness order: a pure function of the settings.

Each service gets the run file (`-c`), plus per-instance environment
overrides (ports, engine URL and ids, the NATS URL), so one run file
describes the whole run and the same file configures Kubernetes pods.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.stack.settings import StackSettings

ORDER = ("engine", "rollout", "sync", "trainer", "buffer")


@dataclass(frozen=True)
class ProcSpec:
    name: str  # unique, e.g. "engine-0"
    kind: str  # the service, e.g. "engine"
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None  # polled until it answers 200
    metrics_url: str | None = None


def _py(*module_args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", *module_args)


def plan(
    s: StackSettings, config: Path, nats_url: str, free_port: Callable[[], int]
) -> list[ProcSpec]:
    specs: list[ProcSpec] = []
    run_dir = s.run_dir.resolve()
    weights = run_dir / "weights"

    def service(kind: str, name: str, argv: tuple[str, ...], env: dict[str, str]) -> ProcSpec:
        port = free_port()
        prefix = f"FLYWHEEL_{kind.upper()}_"
        env = {
            f"{prefix}NATS__URL": nats_url,
            f"{prefix}METRICS_PORT": str(port),
            f"{prefix}RUN": s.run,
            **env,
        }
        base = f"http://127.0.0.1:{port}"
        return ProcSpec(name, kind, argv, env, f"{base}/readyz", f"{base}/metrics")

    engine_urls = []
    if "engine" in s.services:
        for i in range(s.engines):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            engine_urls.append(url)
            argv = _py(
                "services.rollout.engine", "--config", str(config), "--model", str(s.model),
                "--port", str(port), "--weight-version", "0",
            )  # fmt: skip
            env = {"FLYWHEEL_ENGINE_NUM_THREADS": str(s.engine_threads)}
            ready = f"{url}/health_generate"
            specs.append(ProcSpec(f"engine-{i}", "engine", argv, env, ready, None))
    if "rollout" in s.services:
        for i, url in enumerate(engine_urls):
            env = {
                "FLYWHEEL_ROLLOUT_ENGINE_URL": url,
                "FLYWHEEL_ROLLOUT_ENGINE_ID": f"engine-{i}",
                "FLYWHEEL_ROLLOUT_WORKER_ID": f"rollout-{i}",
                "FLYWHEEL_ROLLOUT_MODEL": str(s.model),
            }
            specs.append(
                service("rollout", f"rollout-{i}", _py("services.rollout", "-c", str(config)), env)
            )
    if "sync" in s.services:
        env = {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(weights)}
        specs.append(service("sync", "sync", _py("services.sync", "-c", str(config)), env))
    if "trainer" in s.services:
        trainer_argv: tuple[str, ...]
        if s.trainer_nproc > 1:
            trainer_argv = (
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={s.trainer_nproc}", "-m", "services.trainer", "-c", str(config),
            )  # fmt: skip
        else:
            trainer_argv = _py("services.trainer", "-c", str(config))
        env = {
            "FLYWHEEL_TRAINER_MODEL": str(s.model),
            "FLYWHEEL_TRAINER_WEIGHTS_ROOT": str(weights),
            "FLYWHEEL_TRAINER_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
            "FLYWHEEL_TRAINER_METRICS_FILE": str(run_dir / "metrics.jsonl"),
        }
        specs.append(service("trainer", "trainer", trainer_argv, env))
    if "buffer" in s.services:
        specs.append(service("buffer", "buffer", _py("services.buffer", "-c", str(config)), {}))
    return sorted(specs, key=lambda p: ORDER.index(p.kind))
