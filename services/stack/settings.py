"""Settings of the local multi-process stack (`[stack]` in the run file)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, SecretStr, model_validator

from services.engine_api.teacher import TeacherSettings
from services.runtime.settings import RunPath
from services.tasks.settings import TaskServiceSettings

SMALL_MACHINE_CORES = 4
"""At most this many cores, `placement = "auto"` colocates a CPU run: there are too few
to give the trainer and each engine cores of their own, so a fixed split leaves the
waiting role's cores idle."""


class StackSettings(TaskServiceSettings):
    section: ClassVar[str] = "stack"
    shared_tables: ClassVar[frozenset[str]] = TaskServiceSettings.shared_tables | {"teacher"}
    own_tables: ClassVar[dict[str, bool]] = {**TaskServiceSettings.own_tables, "teacher": False}

    run_dir: RunPath = Field(Path("runs/demo"), description="Logs, NATS store, weights, metrics.")
    model: RunPath = Field(
        Path("runs/demo/model"),
        description="The model to start from: a Hugging Face directory, or a hub id "
        "('org/name') found in the local Hugging Face cache (never downloaded). "
        "`flywheel import-model` and `make smollm2` make one from a GGUF.",
    )
    embedded_nats: bool = Field(
        True, description="Start a nats-server here; false: use [nats] url as given."
    )
    nats_port: int = Field(
        0, ge=0, le=65535, description="Embedded NATS port (0: free port); a cluster: port + i."
    )
    nats_cluster: int = Field(
        1,
        ge=1,
        le=5,
        description=(
            "Embedded nats-servers: 1, or 3 for a local JetStream cluster that survives the "
            "loss of one (set [nats] replicas = 3 with it)."
        ),
    )
    engine: Literal["cpu", "sglang"] = Field(
        "cpu",
        description="Which engine servers to start: Flywheel's CPU engine, or SGLang "
        "(`python -m sglang.launch_server`, GPU, `pip install 'flywheel[sglang]'`).",
    )
    engines: int = Field(2, ge=0, le=64, description="Engines (one rollout worker each).")
    engine_threads: int = Field(1, ge=0, description="torch threads per CPU engine (0: default).")
    engine_gpus: list[list[int]] = Field(
        default_factory=list,
        description="GPUs of each SGLang engine, e.g. [[4], [5], [6], [7]]: one list per "
        "engine (its CUDA_VISIBLE_DEVICES; more than one GPU means tensor parallel). "
        "Required with engine = 'sglang'.",
    )
    engine_mem_fraction: float = Field(
        0.85, gt=0, le=1, description="SGLang --mem-fraction-static (weights + KV cache)."
    )
    engine_args: list[str] = Field(
        default_factory=list, description="More flags for every SGLang engine, as given."
    )
    engine_api_key: SecretStr | None = Field(
        None,
        description="An API key for the engines this stack starts; rollout workers and sync "
        "are given it too.",
    )
    trainer_nproc: int = Field(1, ge=1, description="Trainer ranks (>1 runs under torchrun).")
    trainer_gpus: list[int] = Field(
        default_factory=list,
        description="GPUs of the trainer, one per rank (its CUDA_VISIBLE_DEVICES); must "
        "number trainer_nproc. Empty: not set (CPU, or whatever torch finds).",
    )
    cpus: dict[str, list[int]] = Field(
        default_factory=dict,
        description="CPU cores per process, e.g. {trainer = [0, 1], engine = [2, 3], "
        "'engine-1' = [4]}: keyed by service (engine, rollout, sync, trainer, buffer) or by "
        "process name (a name wins over its service). The process is pinned to them "
        "(sched_setaffinity) and its torch threads are their count (OMP_NUM_THREADS; an "
        "engine's num_threads, the trainer's runtime.cpu_threads), so roles on a many-core "
        "box do not fight for cores. Empty: no pinning.",
    )
    placement: Literal["auto", "colocated", "disaggregated"] = Field(
        "disaggregated",
        description="How the trainer and the engines share this machine. 'disaggregated': "
        "each keeps its own threads (engine_threads, [trainer.runtime] cpu_threads). "
        "'colocated' (CPU engines, a one-process trainer): cores move to whichever role has "
        "work through a core lease in <run_dir>/cores (services/runtime/cores.py): while "
        "the trainer waits for a batch the engines compute with its cores, while the "
        "engines wait (max_staleness ahead) the trainer computes with theirs. 'auto': "
        "colocated on a machine of at most 4 cores running CPU engines, one trainer "
        "process and no `cpus` map; disaggregated otherwise. The default stays "
        "'disaggregated' until lending is measured to help on quiet cores: on demo-real "
        "(2 shared cores) the trainer idled 62-79% either way (bench/results_placement.md).",
    )
    services: tuple[str, ...] = Field(
        ("engine", "rollout", "sync", "trainer", "buffer"),
        description="Which services to start here (others run elsewhere, as pods do). "
        "Add 'tinker' for the Tinker API server ([tinker] table), sampling on the engines "
        "started here; ['engine', 'tinker'] is a Tinker-only run (configs/examples/tinker.toml): "
        "the user's own loop drives it, no rollout, sync, trainer or buffer.",
    )
    teacher: TeacherSettings | None = Field(
        None,
        description="[teacher] (distillation): `flywheel up` starts its `engines` CPU engines "
        "on its model beside the rollout engines (supervised alike) and gives every rollout "
        "worker their URLs.",
    )
    check: bool = Field(
        True,
        description="Before starting anything, sample the base model on a few training "
        "prompts through the task's reward (`flywheel check`) and print its one-line verdict: "
        "whether RL has anything to learn from, and what would help. The run goes on either "
        "way. Off: false, or `flywheel up --no-check`. Skipped with engine = 'sglang'.",
    )
    on_failure: Literal["restart", "stop"] = Field(
        "restart", description="When a service dies: restart it, or stop the whole run."
    )
    max_restarts: int = Field(5, ge=0, description="Restarts per service before the run stops.")
    ready_timeout_s: float = Field(180.0, gt=0, description="Limit for a service to get ready.")
    stop_grace_s: float = Field(15.0, gt=0, description="SIGTERM → SIGKILL grace on shutdown.")
    status_interval_s: float = Field(2.0, gt=0, description="Refresh of the status view.")

    @model_validator(mode="after")
    def _replicas_fit_the_embedded_cluster(self) -> StackSettings:
        if self.embedded_nats and self.nats.replicas > self.nats_cluster:
            raise ValueError(
                f"[nats] replicas = {self.nats.replicas} needs at least that many servers, but "
                f"[stack] nats_cluster = {self.nats_cluster}: raise nats_cluster or lower replicas"
            )
        return self

    @model_validator(mode="after")
    def _gpu_map(self) -> StackSettings:
        """Every GPU process gets its own GPUs: counts match, nothing shared."""
        if self.engine == "sglang" and self.engines and len(self.engine_gpus) != self.engines:
            raise ValueError(
                f"engine_gpus: {len(self.engine_gpus)} GPU lists for {self.engines} SGLang "
                f"engines (one list per engine, e.g. [[4], [5]])"
            )
        if self.engine == "cpu" and self.engine_gpus:
            raise ValueError("engine_gpus: only SGLang engines use GPUs (engine = 'sglang')")
        if any(not gpus for gpus in self.engine_gpus):
            raise ValueError("engine_gpus: an engine has an empty GPU list")
        if self.trainer_gpus and len(self.trainer_gpus) != self.trainer_nproc:
            raise ValueError(
                f"trainer_gpus: {len(self.trainer_gpus)} GPUs for trainer_nproc = "
                f"{self.trainer_nproc} ranks"
            )
        judge = self.judge.gpus
        if judge and self.judge.engines and len(judge) != self.judge.engines:
            raise ValueError(
                f"[judge] gpus: {len(judge)} GPU lists for {self.judge.engines} judge engines"
            )
        if judge and self.engine != "sglang":
            raise ValueError("[judge] gpus: only SGLang judge engines use GPUs (engine = 'sglang')")
        if any(not gpus for gpus in judge):
            raise ValueError("[judge] gpus: a judge engine has an empty GPU list")
        used = [g for gpus in self.engine_gpus for g in gpus] + list(self.trainer_gpus)
        used += [g for gpus in judge for g in gpus]
        shared = sorted({g for g in used if used.count(g) > 1})
        if shared:
            raise ValueError(f"engine_gpus/trainer_gpus/[judge] gpus: GPU(s) {shared} given twice")
        return self

    @model_validator(mode="after")
    def _teacher_engines(self) -> StackSettings:
        t = self.teacher
        if t is not None and t.engines and self.engine == "sglang":
            raise ValueError(
                "teacher.engines: `flywheel up` starts CPU teacher engines only; with engine = "
                "'sglang' start the teacher's SGLang servers yourself and list them in [teacher] "
                "urls (engines = 0)"
            )
        if t is not None and t.engines and t.model is None:
            raise ValueError("teacher.engines: the teacher's engines need [teacher] model")
        return self

    @model_validator(mode="after")
    def _cpus_exist(self) -> StackSettings:
        """Cores this machine has, each list non-empty: a bad map fails at start-up, named."""
        import os

        have = os.cpu_count() or 1
        for key, cores in self.cpus.items():
            bad = [c for c in cores if not 0 <= c < have]
            if not cores or bad:
                what = f"core(s) {bad} (this machine has 0..{have - 1})" if bad else "no cores"
                raise ValueError(f"cpus.{key}: {what}")
        return self

    @model_validator(mode="after")
    def _colocation_possible(self) -> StackSettings:
        if self.placement != "colocated":
            return self
        if self.engine != "cpu":
            raise ValueError(
                "placement = 'colocated' lends CPU cores between CPU engines and the trainer; "
                "with SGLang engines `flywheel up` does not yet release and resume their GPU "
                "memory around a step (the engines answer /release_memory_occupation): use "
                "'disaggregated'"
            )
        if self.cpus:
            raise ValueError("placement = 'colocated' moves cores between roles: drop `cpus`")
        if self.trainer_nproc > 1:
            raise ValueError("placement = 'colocated' lends to a one-process trainer only")
        return self

    @property
    def colocated(self) -> bool:
        """Whether roles lend each other cores here (`placement`, 'auto' resolved)."""
        if self.placement != "auto":
            return self.placement == "colocated"
        import os

        small = (os.cpu_count() or 1) <= SMALL_MACHINE_CORES
        return small and self.engine == "cpu" and not self.cpus and self.trainer_nproc == 1

    def cpus_of(self, name: str, kind: str) -> tuple[int, ...]:
        """The cores of process `name` (of service `kind`); () when not pinned."""
        return tuple(self.cpus.get(name, self.cpus.get(kind, ())))

    @property
    def gpu_map(self) -> bool:
        return bool(self.engine_gpus or self.trainer_gpus or self.judge.gpus)
