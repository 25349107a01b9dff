"""What `flywheel up` starts, in readiness order: a pure function of the settings.

Each service gets the run file (`-c`), plus per-instance environment
overrides (ports, engine URL and ids, the NATS URL), so one run file
describes the whole run and the same file configures Kubernetes pods.

Engines are Flywheel's CPU engine or SGLang (`[stack] engine`). SGLang gets
the flags the Kubernetes GPU overlay gives it (deploy/k8s/overlays/gpu):
model path, host/port, `--weight-version 0`, `--mem-fraction-static`,
`--enable-metrics`, and `--tp-size` = its number of GPUs. GPUs are placed
by `CUDA_VISIBLE_DEVICES` per process from the `[stack]` GPU map: each
engine its own, the trainer its ranks'; with a map, every other process
sees none, so nothing else can take memory on an engine's or trainer's GPU.
Cores likewise (`[stack] cpus`): a pinned process gets its cores' count as
its torch threads here, and the supervisor sets the affinity at spawn. A
colocated run (`[stack] placement`) pins nothing: the trainer and each rollout
worker are given the run's core lease (`<run_dir>/cores`, their `cores`
settings), and the cores move to whichever role has work.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from proto.weight_version import INITIAL, to_engine
from services.engine_api.sglang_launcher import (
    EngineLoraSettings,
    SGLangOptions,
    command,
    environment,
)
from services.runtime.settings import read_run_file
from services.stack.settings import StackSettings

ORDER = ("judge", "engine", "teacher", "tinker", "rollout", "sync", "trainer", "buffer")
SECRET_WORDS = ("PASSWORD", "TOKEN", "KEY", "SECRET")


@dataclass(frozen=True)
class ProcSpec:
    name: str  # unique, e.g. "engine-0"
    kind: str  # the service, e.g. "engine"
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None  # polled until it answers 200
    metrics_url: str | None = None
    gpus: tuple[int, ...] = ()  # its CUDA_VISIBLE_DEVICES (display; env carries it)
    cpus: tuple[int, ...] = ()  # cores it is pinned to (the supervisor sets the affinity)
    beside: str | None = None  # a rollout worker's engine
    # It exits 0 once its work is done (the trainer given max_steps): the run is over then,
    # not a death to restart.
    finishes: bool = False


def _py(*module_args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", *module_args)


def _visible(gpus: list[int] | tuple[int, ...]) -> dict[str, str]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}


def engine_spec(
    s: StackSettings, i: int, config: Path, port: int
) -> tuple[tuple[str, ...], dict[str, str], tuple[int, ...]]:
    """argv, environment and GPUs of engine `i` listening on `port`."""
    key = s.engine_api_key.get_secret_value() if s.engine_api_key else None
    if s.engine == "sglang":
        gpus = tuple(s.engine_gpus[i])
        opts = SGLangOptions(
            model_path=s.model,
            port=port,
            weight_version=to_engine(INITIAL),
            tp_size=len(gpus),
            mem_fraction_static=s.engine_mem_fraction,
            api_key=key,
            enable_metrics=True,
            # The run file's [engine] LoRA keys, which the CPU engine reads itself.
            lora=EngineLoraSettings.from_run_file(read_run_file(config)).lora,
            extra_args=tuple(s.engine_args),
        )
        env = {**_visible(gpus), "HF_HUB_OFFLINE": "1", **environment(opts)}
        return tuple(command(opts)), env, gpus
    argv = _py("services.engine", "--config", str(config), "--model", str(s.model))
    argv += ("--port", str(port), "--weight-version", "0")
    env = {"FLYWHEEL_ENGINE_NUM_THREADS": str(s.engine_threads)}
    if key:  # by environment: a command line is visible to every user (ps)
        env["FLYWHEEL_ENGINE_API_KEY"] = key
    return argv, {**env, **(_visible(()) if s.gpu_map else {})}, ()


def plan(
    s: StackSettings,
    config: Path,
    nats_url: str,
    free_port: Callable[[], int],
    *,
    max_steps: int | None = None,
) -> list[ProcSpec]:
    """Every process, in readiness order. `max_steps` (`flywheel up --steps`): the trainer
    stops itself after that many steps and its exit ends the run, so it trains exactly that
    many whatever is in flight when it gets there."""
    specs: list[ProcSpec] = []
    run_dir = s.run_dir.resolve()
    weights = run_dir / "weights"
    key = s.engine_api_key.get_secret_value() if s.engine_api_key else None
    no_gpu = _visible(()) if s.gpu_map else {}

    def service(
        kind: str, name: str, argv: tuple[str, ...], env: dict[str, str], **extra: object
    ) -> ProcSpec:
        port = free_port()
        prefix = f"FLYWHEEL_{kind.upper()}_"
        env = {
            f"{prefix}NATS__URL": nats_url,
            f"{prefix}METRICS_PORT": str(port),
            f"{prefix}RUN": s.run,
            **no_gpu,
            **env,
        }
        if key and kind in ("rollout", "sync"):
            env[f"{prefix}ENGINE_API_KEY"] = key
        base = f"http://127.0.0.1:{port}"
        return ProcSpec(name, kind, argv, env, f"{base}/readyz", f"{base}/metrics", **extra)  # type: ignore[arg-type]

    engines: list[ProcSpec] = []
    if "engine" in s.services:
        for i in range(s.engines):
            port = free_port()
            argv, env, gpus = engine_spec(s, i, config, port)
            url = f"http://127.0.0.1:{port}"
            engines.append(
                ProcSpec(f"engine-{i}", "engine", argv, env, f"{url}/health_generate", None, gpus)
            )
    specs += engines
    judges = judge_specs(s, config, free_port) if "engine" in s.services else []
    specs += judges
    teachers = teacher_specs(s, config, free_port) if "engine" in s.services else []
    specs += teachers
    if "rollout" in s.services:
        for i, eng in enumerate(engines):
            env = {
                "FLYWHEEL_ROLLOUT_ENGINE_URL": (eng.ready_url or "").rsplit("/", 1)[0],
                "FLYWHEEL_ROLLOUT_ENGINE_ID": eng.name,
                "FLYWHEEL_ROLLOUT_WORKER_ID": f"rollout-{i}",
                "FLYWHEEL_ROLLOUT_MODEL": str(s.model),
            }
            if judges:  # the judge's engines: those given, and those started here
                urls = [*s.judge.urls, *((j.ready_url or "").rsplit("/", 1)[0] for j in judges)]
                env["FLYWHEEL_ROLLOUT_JUDGE__URLS"] = json.dumps(urls)
            if teachers:
                urls = [(t.ready_url or "").rsplit("/", 1)[0] for t in teachers]
                env["FLYWHEEL_ROLLOUT_TEACHER_URLS"] = json.dumps(urls)
            if s.colocated:  # the worker lends its engine cores (its share: engine_threads)
                env.update(lease_env("ROLLOUT", run_dir, max(s.engine_threads, 1)))
            argv = _py("services.rollout", "-c", str(config))
            specs.append(service("rollout", f"rollout-{i}", argv, env, beside=eng.name))
    if "sync" in s.services:
        # the model: the tokenizer of held-out evaluations on the engines
        env = {"FLYWHEEL_SYNC_WEIGHTS_ROOT": str(weights), "FLYWHEEL_SYNC_MODEL": str(s.model)}
        specs.append(service("sync", "sync", _py("services.sync", "-c", str(config)), env))
    if "trainer" in s.services:
        specs.append(trainer_spec(s, config, run_dir, service, max_steps))
    if "buffer" in s.services:
        specs.append(service("buffer", "buffer", _py("services.buffer", "-c", str(config)), {}))
    if "tinker" in s.services:
        specs.append(tinker_spec(s, config, run_dir, engines, free_port))
    return sorted((pinned(s, p) for p in specs), key=lambda p: ORDER.index(p.kind))


def judge_specs(s: StackSettings, config: Path, free_port: Callable[[], int]) -> list[ProcSpec]:
    """The LLM judge's engines (`[judge] engines`), when a task has a judge part: CPU
    engines on `[judge] model` (default: the policy's base, `[stack] model`), supervised
    like the rollout engines; their /v1/chat/completions is what the workers ask. They
    serve no weight updates (sync never learns of them: no worker heartbeats them)."""
    j = s.judge
    if not s.judged() or j.engines == 0:
        return []
    model = j.model or str(s.model)
    key = j.api_key.get_secret_value() if j.api_key else None
    specs = []
    for i in range(j.engines):
        port = free_port()
        gpus: tuple[int, ...] = ()
        if j.gpus:  # SGLang on GPUs of its own (StackSettings checks the map)
            gpus = tuple(j.gpus[i])
            opts = SGLangOptions(
                model_path=Path(model),
                port=port,
                weight_version=to_engine(INITIAL),
                tp_size=len(gpus),
                mem_fraction_static=s.engine_mem_fraction,
                api_key=key,
                enable_metrics=True,
            )
            argv = tuple(command(opts))
            env = {**_visible(gpus), "HF_HUB_OFFLINE": "1", **environment(opts)}
        else:
            argv = _py("services.engine", "--config", str(config), "--model", model)
            argv += ("--port", str(port), "--weight-version", "0")
            env = {"FLYWHEEL_ENGINE_NUM_THREADS": str(j.threads), **_visible(())}
            if key:  # by environment, as the rollout engines' key
                env["FLYWHEEL_ENGINE_API_KEY"] = key
        url = f"http://127.0.0.1:{port}"
        specs.append(ProcSpec(f"judge-{i}", "judge", argv, env, f"{url}/health_generate",
                              None, gpus))  # fmt: skip
    return specs


def teacher_specs(s: StackSettings, config: Path, free_port: Callable[[], int]) -> list[ProcSpec]:
    """The teacher's CPU engines (`[teacher] engines` on its model): engines like the
    rollout ones, started and restarted alike, never updated (sync knows engines only
    from rollout workers' heartbeats)."""
    t = s.teacher
    if t is None or not t.engines or t.model is None:
        return []
    key = t.api_key.get_secret_value() if t.api_key else None  # what the workers send it
    out = []
    for i in range(t.engines):
        port = free_port()
        argv = _py("services.engine", "--config", str(config), "--model", str(t.model))
        argv += ("--port", str(port), "--weight-version", "0")
        env = {"FLYWHEEL_ENGINE_NUM_THREADS": str(t.engine_threads)}
        if key:
            env["FLYWHEEL_ENGINE_API_KEY"] = key
        env.update(_visible(()) if s.gpu_map else {})
        url = f"http://127.0.0.1:{port}"
        out.append(ProcSpec(f"teacher-{i}", "teacher", argv, env, f"{url}/health_generate"))
    return out


def tinker_spec(
    s: StackSettings,
    config: Path,
    run_dir: Path,
    engines: list[ProcSpec],
    free_port: Callable[[], int],
) -> ProcSpec:
    """The Tinker API server (`[stack] services` has "tinker"): on `[stack] model` unless
    `[tinker] model` names one, sampling on the engines started here (its `engines`; those
    of the run file's `[tinker] engines` when none start here), listening where
    `[tinker]` says (a free port for `port = 0`), its saved states under the run's
    directory unless `[tinker] state_dir` is set. The stack reads the table raw: it
    imports no service's settings (the server checks them itself, and preflight first)."""
    table = read_run_file(config).get("tinker", {}) if config.exists() else {}
    port = int(table.get("port", 8000)) or free_port()
    argv = _py("services.tinker", "-c", str(config), "--port", str(port))
    if "model" not in table:
        argv += ("--model", str(s.model))
    env = {"HF_HUB_OFFLINE": "1", **(_visible(()) if s.gpu_map else {})}
    if engines:
        urls = [(e.ready_url or "").rsplit("/", 1)[0] for e in engines]
        env["FLYWHEEL_TINKER_ENGINES"] = json.dumps(urls)
    if "state_dir" not in table:
        env["FLYWHEEL_TINKER_STATE_DIR"] = str(run_dir / "tinker-state")
    return ProcSpec("tinker", "tinker", argv, env, f"{tinker_url(port)}/api/v1/healthz")


def tinker_url(port: int) -> str:
    return f"http://127.0.0.1:{port}"


def pinned(s: StackSettings, p: ProcSpec) -> ProcSpec:
    """`p` with its `[stack] cpus`: the cores, and torch threads to match them."""
    cores = s.cpus_of(p.name, p.kind)
    if not cores:
        return p
    n = str(len(cores))
    env = {**p.env, "OMP_NUM_THREADS": n}
    if (
        p.kind == "teacher"
        or (p.kind == "engine" and s.engine == "cpu")
        or (p.kind == "judge" and not p.gpus)
    ):
        env["FLYWHEEL_ENGINE_NUM_THREADS"] = n
    if p.kind == "trainer":
        env["FLYWHEEL_TRAINER_RUNTIME__CPU_THREADS"] = n
    if p.kind == "tinker":
        env["FLYWHEEL_TINKER_NUM_THREADS"] = n
    return replace(p, env=env, cpus=cores)


def trainer_spec(
    s: StackSettings,
    config: Path,
    run_dir: Path,
    service: Callable[..., ProcSpec],
    max_steps: int | None = None,
) -> ProcSpec:
    trainer_argv: tuple[str, ...]
    if s.trainer_nproc > 1:
        torchrun = ("torch.distributed.run", "--standalone", f"--nproc_per_node={s.trainer_nproc}")
        trainer_argv = _py(*torchrun, "-m", "services.trainer", "-c", str(config))
    else:
        trainer_argv = _py("services.trainer", "-c", str(config))
    env = {
        "FLYWHEEL_TRAINER_MODEL": str(s.model),
        "FLYWHEEL_TRAINER_WEIGHTS_ROOT": str(run_dir / "weights"),
        "FLYWHEEL_TRAINER_CHECKPOINT_DIR": str(run_dir / "checkpoints"),
        "FLYWHEEL_TRAINER_METRICS_FILE": str(run_dir / "metrics.jsonl"),
    }
    if max_steps is not None:
        env["FLYWHEEL_TRAINER_MAX_STEPS"] = str(max_steps)
    if s.colocated:
        env.update(lease_env("TRAINER", run_dir, 1))
    if s.trainer_gpus:
        env.update(_visible(s.trainer_gpus))
    return service(
        "trainer",
        "trainer",
        trainer_argv,
        env,
        gpus=tuple(s.trainer_gpus),
        finishes=max_steps is not None,
    )


def lease_env(service: str, run_dir: Path, share: int) -> dict[str, str]:
    """The core lease of a colocated run, for one service's `cores` settings."""
    prefix = f"FLYWHEEL_{service}_CORES__"
    return {f"{prefix}DIR": str(run_dir / "cores"), f"{prefix}SHARE": str(share)}


def _redact(name: str, value: str) -> str:
    return "***" if any(w in name.upper() for w in SECRET_WORDS) else value


def describe(specs: list[ProcSpec]) -> str:
    """Every process: its GPUs, command and environment (secrets shown as ***)."""
    by_name = {p.name: p for p in specs}
    lines = []
    for p in specs:
        if p.gpus:
            where = "GPUs " + ",".join(map(str, p.gpus))
        elif p.beside is not None:
            eng = by_name[p.beside]
            on = ",".join(map(str, eng.gpus)) if eng.gpus else "CPU"
            where = f"no GPU; beside {eng.name} (GPUs {on})" if eng.gpus else "no GPU"
        else:
            where = "no GPU"
        argv = list(p.argv)
        for i, a in enumerate(argv[:-1]):
            if a == "--api-key":  # none of ours: engine_args could hold one
                argv[i + 1] = "***"
        if p.cpus:
            where += "; cores " + ",".join(map(str, p.cpus))
        lines.append(f"{p.name} [{p.kind}] {where}")
        lines.append(f"  command: {' '.join(argv)}")
        env = " ".join(f"{k}={_redact(k, v)}" for k, v in sorted(p.env.items()))
        lines.append(f"  env: {env}")
        if p.ready_url:
            lines.append(f"  ready: {p.ready_url}")
    return "\n".join(lines)
