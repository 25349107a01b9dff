"""What one weight version costs the machine, in CPU seconds, by stage, on a real model.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python bench/version_cost.py \
        [--model ~/.cache/flywheel/models/SmolLM2-135M-Instruct] [--versions 3] \
        [--no-delta] [--out FILE]

Why CPU seconds: on a shared 2-core machine wall time swings with whatever
else runs; the CPU a stage burns (its thread's user + system time,
`getrusage(RUSAGE_THREAD)`) is what it takes away from the trainer and the
engines beside it, and load distorts it far less. User time is shown apart:
system time includes writing into the page cache and, when memory is short,
reclaiming pages for it, which swings with what the rest of the machine holds.

One process plays the trainer and an engine, running the product's own
code, one stage after the other (torch on 1 thread):

- the trainer: one real optimizer step per version (AdamW, demo-real's lr
  4e-5, float32 masters) on a batch of random tokens (4 groups x 8 samples,
  prompt 40, reply 8), so each version's weights and optimizer state really
  changed; then `state.snapshot` and `step.save_version`, exactly as the
  trainer service calls them (the weights directory written on a thread
  while the checkpoint is staged).
- an engine: `ModelRunner.load_weights` of the published directory with
  the engine's default `weights_check = "sha256"`.
- `disk-delta` (unless `--no-delta`): the trainer's `DiskDeltaTransport.publish`
  (the delta written beside the version) and, beside the engine,
  `receive` (the engine's own copy rebuilt from the delta, verified), then
  the same engine load from that copy.

The stages inside are timed by wrapping the functions the product calls
(module attributes replaced for the run, restored after), each on the
thread it runs on: cast (`cast_state`), serialise (`save_pretrained` of the
model; of the tokenizer), hash (`manifest.build_manifest`, or the hashes
taken while writing), fsync (the weights directory's), checkpoint stage /
commit, the engine's verify (`runner.verify_directory`). A whole call's
CPU (`save_version`, `load_weights`) is the process's CPU over it (all
threads); "other" is the whole less its named stages.

`--compare` also runs, on every version and in the same process, each cut
this bench measured against what it replaced: the checkpoint staged with
torch's own `torch.save` (CRC-32 of every record) and as stateformat.py
saves it now (no CRC: `torch.load` never checks one); the engine's copy
of the loaded bf16 tensors into its float32 parameters as `.to()` then
`copy_` (before) and one `copy_` that converts (now).

Not measured here: sync's own handling of a version (for `disk`: decode
the message, confine the URI, one HTTP call per engine, one WeightsReady),
which moves no weight bytes; bench/sync.py measures it on a real sync
process (its CPU table).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_MODEL = Path("~/.cache/flywheel/models/SmolLM2-135M-Instruct").expanduser()
RUN = "versioncost"


def _cpu(who: int) -> tuple[float, float]:
    """(user, system) CPU seconds of this thread (RUSAGE_THREAD) or process (RUSAGE_SELF)."""
    r = resource.getrusage(who)
    return r.ru_utime, r.ru_stime


class Meter:
    """CPU (user + system), user and wall seconds per stage, summed over one version's calls.

    User and system apart: a stage's system time includes writing into the page
    cache and, with memory short, reclaiming pages for it, which swings with
    what the rest of the machine holds; user time is the stage's own work.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cpu: dict[str, float] = defaultdict(float)
        self.user: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.changed: float | None = None  # disk-delta: fraction of elements whose bits changed
        self.unchanged: tuple[int, int, int] | None = None  # tensors unchanged, of all, bytes

    def add(self, stage: str, user: float, system: float, wall: float) -> None:
        with self.lock:
            self.cpu[stage] += user + system
            self.user[stage] += user
            self.wall[stage] += wall

    @contextmanager
    def timed(self, stage: str, who: int) -> Iterator[None]:
        (u, s), w = _cpu(who), time.perf_counter()
        try:
            yield
        finally:
            u1, s1 = _cpu(who)
            self.add(stage, u1 - u, s1 - s, time.perf_counter() - w)

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` timed on the thread it runs on."""

        @functools.wraps(fn)
        def timed(*a: Any, **kw: Any) -> Any:
            with self.timed(stage, resource.RUSAGE_THREAD):
                return fn(*a, **kw)

        return timed

    def whole(self, stage: str) -> Any:
        """A call that may use threads: the process's CPU over it."""
        return self.timed(stage, resource.RUSAGE_SELF)


@contextmanager
def wrapped(meter: Meter, targets: list[tuple[Any, str, str]]) -> Iterator[None]:
    """Replace `obj.attr` by a timed wrapper for each (obj, attr, stage) present."""
    saved = []
    for obj, attr, stage in targets:
        if not hasattr(obj, attr):
            continue
        fn = getattr(obj, attr)
        saved.append((obj, attr, obj.__dict__.get(attr, None), attr in obj.__dict__))
        setattr(obj, attr, meter.wrap(stage, fn))
    try:
        yield
    finally:
        for obj, attr, old, own in reversed(saved):
            if own:
                setattr(obj, attr, old)
            else:
                delattr(obj, attr)


def random_batch(vocab: int, seed: int) -> Any:
    """4 groups x 8 samples of random tokens (prompt 40, reply 8), rewards 0/1 alternating."""
    import torch

    from services.trainer.core.batching import TensorBatch

    g = torch.Generator().manual_seed(seed)
    n, per = 32, 8
    prompts = [torch.randint(0, vocab, (40,), generator=g) for _ in range(n // per)]
    return TensorBatch(
        prompt_ids=[prompts[i // per].clone() for i in range(n)],
        response_ids=[torch.randint(0, vocab, (8,), generator=g) for _ in range(n)],
        rollout_logprobs=[torch.full((8,), -5.0) for _ in range(n)],
        rewards=torch.tensor([float(i % 2) for i in range(n)]),
        group_ids=torch.arange(n) // per,
        truncated=torch.zeros(n, dtype=torch.bool),
    )


def trainer_targets(trainer: Any) -> list[tuple[Any, str, str]]:
    import services.trainer.step as step_mod
    import services.trainer.trainer as trainer_mod
    import services.weights.manifest as manifest_mod

    return [
        (trainer_mod, "cast_state", "trainer: cast to the publish dtype"),
        (trainer.model, "save_pretrained", "trainer: serialise safetensors (save_pretrained)"),
        (trainer.tokenizer, "save_pretrained", "trainer: serialise tokenizer"),
        (manifest_mod, "build_manifest", "trainer: hash (read back)"),
        (manifest_mod, "hashed_manifest", "trainer: hash (while writing)"),
        (manifest_mod, "_fsync_path", "trainer: fsync weights dir"),
        (step_mod, "stage_checkpoint", "trainer: checkpoint stage (torch.save + fsync)"),
        (step_mod, "commit_checkpoint", "trainer: checkpoint commit"),
    ]


def engine_targets(who: str) -> list[tuple[Any, str, str]]:
    import services.engine.runner as runner_mod

    return [(runner_mod, "verify_directory", f"{who}: verify (sha256 of every file)")]


def old_save_fsynced(obj: Any, path: Path) -> None:
    """stateformat._save_fsynced before the cut: torch.save as torch does it (CRC-32s)."""
    import torch

    from services.trainer.stateformat import fsync_path

    torch.save(obj, path)
    fsync_path(path)


def before_after(m: Meter, trainer: Any, runner: Any, snap: Any, out: Path, work: Path) -> None:
    """The cuts' before and after on the same version, one after the other (`--compare`)."""
    import shutil

    import torch
    from safetensors.torch import load_file

    import services.trainer.stateformat as sf
    from proto.weight_version import dir_name
    from services.trainer.state import stage_checkpoint

    order = [("before", old_save_fsynced), ("after", sf._save_fsynced)]
    if trainer.step % 2 == 0:  # each goes first on every other version: neither always
        order.reverse()  # writes into a page cache the other just filled
    for label, save in order:
        root = work / f"ckpt-{label}"
        kept, sf._save_fsynced = sf._save_fsynced, save
        try:
            with m.whole(f"compare: checkpoint stage, {label}"):
                stage_checkpoint(trainer, root, {"seq": 0}, snap)
        finally:
            sf._save_fsynced = kept
        shutil.rmtree(root)
    import hashlib

    from services.weights.manifest import file_sha256

    f = out / "model.safetensors"
    data = f.read_bytes()  # not timed: what a writer that hashed as it wrote would hold
    with m.whole("compare: sha256 of model.safetensors, read back (now)"):
        file_sha256(f)
    with m.whole("compare: sha256 of the same bytes in memory (hashing while writing)"):
        hashlib.sha256(data).hexdigest()
    del data
    loaded = {}
    for f in sorted(out.glob("*.safetensors")):
        loaded.update(load_file(str(f)))
    prev = out.parent / dir_name(trainer.step - 1) / "model.safetensors"
    if prev.is_file():  # tensors whose published bytes did not change: nothing to re-serialise
        old = load_file(str(prev))
        same = [k for k, t in loaded.items() if k in old and torch.equal(old[k], t)]
        m.unchanged = (len(same), len(loaded), sum(loaded[k].nbytes for k in same))
    live = runner.model.state_dict()
    with m.whole("compare: engine copy into float32, before (.to, then copy_)"), torch.no_grad():
        for name, t in loaded.items():
            live[name].copy_(t.to(live[name].dtype))
    with m.whole("compare: engine copy into float32, after (copy_ converts)"), torch.no_grad():
        for name, t in loaded.items():
            live[name].copy_(t)


async def delta_publish(transport: Any, version: int, out: Path) -> Any:
    return await transport.publish(version, out)


def one_version(
    v: int,
    trainer: Any,
    runner: Any,
    transport: Any,
    work: Path,
    held: int | None,
    compare: bool,
) -> tuple[Meter, int | None]:
    """Train, publish and load version `v`; every stage's CPU and wall seconds."""
    from proto.messages import WeightsPublished
    from services.trainer.state import prune_checkpoints, snapshot
    from services.trainer.step import save_version
    from services.weights import published_dir

    m = Meter()
    with m.whole("(compute: one optimizer step, for scale)"):
        trainer.train_step(random_batch(trainer.model.config.vocab_size, seed=v))
    trainer.weight_version = trainer.step
    out = published_dir(work / "weights", RUN, trainer.step)
    with wrapped(m, trainer_targets(trainer)):
        with m.whole("trainer: snapshot (weights + optimizer copied out)"):
            snap = snapshot(trainer)
        with m.whole("trainer: save_version (whole)"):
            manifest = save_version(
                trainer, out, work / "ckpt", {"seq": v, "batch_id": f"b{v}"}, snap
            )
        prune_checkpoints(work / "ckpt", 2)
    assert manifest is not None
    with wrapped(m, engine_targets("engine")), m.whole("engine: load_weights (whole)"):
        runner.load_weights(out)
    if compare:
        before_after(m, trainer, runner, snap, out, work)
    del snap
    if transport is not None:
        with m.whole("disk-delta: trainer writes the delta (publish)"):
            sent = asyncio.run(delta_publish(transport, trainer.step, out))
        if sent.delta is not None:
            m.changed = sent.delta.fraction_changed
        msg = WeightsPublished(
            run=RUN,
            version=trainer.step,
            step=trainer.step,
            uri=sent.uri,
            sha256=manifest.sha256,
            size_bytes=manifest.total_bytes,
        )
        local = work / "engine-local"
        with m.whole("disk-delta: engine side rebuilds its copy (receive)"):
            asyncio.run(transport.receive(msg, local, held))
        held = trainer.step
        with (
            wrapped(m, engine_targets("disk-delta: engine")),
            m.whole("disk-delta: engine load_weights (whole)"),
        ):
            runner.load_weights(local / out.name)
    return m, held


def table(meters: list[Meter]) -> list[str]:
    stages = list(dict.fromkeys(k for m in meters for k in m.cpu))
    lines = [
        "| stage | CPU s per version (median) | of it user | each version (CPU s) "
        "| wall s (median) |",
        "|---|---|---|---|---|",
    ]
    for k in stages:
        cpu = [m.cpu.get(k, 0.0) for m in meters]
        user = [m.user.get(k, 0.0) for m in meters]
        wall = [m.wall.get(k, 0.0) for m in meters]
        each = ", ".join(f"{x:.3f}" for x in cpu)
        lines.append(
            f"| {k} | {statistics.median(cpu):.3f} | {statistics.median(user):.3f} | {each} "
            f"| {statistics.median(wall):.3f} |"
        )
    return lines


def totals(meters: list[Meter]) -> list[str]:
    def med(key: str) -> float:
        return statistics.median(m.cpu.get(key, 0.0) for m in meters)

    trainer = med("trainer: snapshot (weights + optimizer copied out)") + med(
        "trainer: save_version (whole)"
    )
    engine = med("engine: load_weights (whole)")
    lines = [
        f"- trainer, per version (snapshot + save_version): **{trainer:.2f} CPU s**",
        f"- each engine, per version (`disk`: load_weights): **{engine:.2f} CPU s**",
        f"- machine per version, `disk`, 1 engine: **{trainer + engine:.2f} CPU s** "
        f"(one optimizer step of this batch: {med('(compute: one optimizer step, for scale)'):.2f} "
        "CPU s)",
    ]
    if any("disk-delta: trainer writes the delta (publish)" in m.cpu for m in meters):
        later = meters[1:] or meters  # version 1 has no copy to rebuild from: copied whole
        dt = statistics.median(
            m.cpu["disk-delta: trainer writes the delta (publish)"] for m in later
        )
        de = statistics.median(
            m.cpu["disk-delta: engine side rebuilds its copy (receive)"]
            + m.cpu["disk-delta: engine load_weights (whole)"]
            for m in later
        )
        lines.append(
            f"- machine per version, `disk-delta`, 1 engine (versions 2+): "
            f"**{trainer + dt + de:.2f} CPU s** (trainer + {dt:.2f} delta, engine side "
            f"{de:.2f} rebuild + load)"
        )
    changed = [m.changed for m in meters if m.changed is not None]
    if changed:
        lines.append(
            "- elements whose published bits changed, versions 2+: "
            + ", ".join(f"{c:.1%}" for c in changed)
        )
    for m in meters:
        if m.unchanged is not None:
            same, total, nbytes = m.unchanged
            lines.append(
                f"- tensors whose published bytes equal the version before's: {same} of {total} "
                f"({nbytes / 1e6:.2f} MB)"
            )
    pairs = [
        (
            "checkpoint stage",
            "compare: checkpoint stage, before",
            "compare: checkpoint stage, after",
        ),
        (
            "engine copy into float32",
            "compare: engine copy into float32, before (.to, then copy_)",
            "compare: engine copy into float32, after (copy_ converts)",
        ),
        (
            "sha256 of model.safetensors, read back -> of the bytes in memory",
            "compare: sha256 of model.safetensors, read back (now)",
            "compare: sha256 of the same bytes in memory (hashing while writing)",
        ),
    ]
    for what, b, a in pairs:
        if any(b in m.cpu for m in meters):
            before, after = med(b), med(a)
            ub = statistics.median(m.user.get(b, 0.0) for m in meters)
            ua = statistics.median(m.user.get(a, 0.0) for m in meters)
            lines.append(
                f"- {what}, before -> after (same versions): {before:.2f} -> {after:.2f} CPU s "
                f"({before - after:+.2f} saved per version; user time {ub:.2f} -> {ua:.2f})"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--no-delta", action="store_true", help="skip the disk-delta transport")
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also run each cut's before and after on every version (module docstring)",
    )
    ap.add_argument("--out", type=Path, help="also write the tables to this file")
    args = ap.parse_args(argv)

    import torch

    from services.engine.runner import ModelRunner
    from services.trainer.settings import ModelConfig, OptimConfig, TrainConfig
    from services.trainer.trainer import Trainer
    from services.weights import Wiring
    from services.weights.diskdelta import DiskDeltaTransport

    torch.set_num_threads(1)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load0 = os.getloadavg()
    cfg = TrainConfig(optim=OptimConfig(lr=4e-5), model=ModelConfig(cpu_threads=1))
    trainer = Trainer.from_pretrained(args.model, cfg)
    runner = ModelRunner(args.model, num_threads=1)  # weights_check "sha256", the default
    (ROOT / "runs").mkdir(exist_ok=True)
    meters: list[Meter] = []
    with tempfile.TemporaryDirectory(dir=ROOT / "runs", prefix="version-cost-") as tmp:
        work = Path(tmp)
        transport = None
        if not args.no_delta:
            transport = DiskDeltaTransport(Wiring(RUN, work / "weights"))
        held: int | None = None
        for v in range(1, args.versions + 1):
            m, held = one_version(v, trainer, runner, transport, work, held, args.compare)
            meters.append(m)
            print(f"v{v}: " + ", ".join(f"{k} {c:.2f}" for k, c in m.cpu.items()), flush=True)
        size = sum(f.stat().st_size for f in (work / "weights" / RUN).rglob("*.safetensors"))
    load1 = os.getloadavg()
    out = [
        f"Started {started}; {os.cpu_count()} CPUs, load (1-min) {load0[0]:.1f} at start, "
        f"{load1[0]:.1f} at end; torch threads 1; model {args.model.name} "
        f"(publish dtype {trainer.publish_dtype}); {args.versions} versions.",
        "",
        *table(meters),
        "",
        *totals(meters),
        "",
        f"(safetensors written in the run, all versions: {size / 1e6:.0f} MB)",
    ]
    md = "\n".join(out)
    print("\n" + md)
    if args.out:
        cmd = "OMP_NUM_THREADS=1 .venv/bin/python bench/version_cost.py " + " ".join(
            argv if argv is not None else sys.argv[1:]
        )
        args.out.write_text(f"<!-- generated by: {cmd} -->\n\n{md}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
