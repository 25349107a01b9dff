"""Where a sandbox child runs: bubblewrap, an unprivileged uid, rlimits, seccomp.

Rewards and tools run text the policy wrote, and a policy under RL is an
optimiser: any way out that pays, it finds. So their processes (pool.py's
pools) start inside walls that Linux gives and a small, well-kept tool sets
up — bubblewrap (Debian's `bubblewrap`, what Flatpak runs every app in) —
rather than inside Python, where an audit hook can be stepped around (ctypes,
`_posixsubprocess`) and leaves the filesystem, signals and the environment
open. What a child gets:

- its own PID, network, IPC, UTS and cgroup namespaces: it sees only its own
  processes (so it can signal nothing outside), and has only a loopback
  interface (no route anywhere, no abstract unix sockets of the host);
- a root that is an empty read-only tmpfs with read-only binds of what the
  interpreter needs (/usr, the Python prefix and the virtualenv) and of the
  top-level packages of the code it runs (Flywheel's, the user's reward and
  tool modules): no /proc, no /data, no working directory, no repository;
- one writable place, a private /tmp (a size-limited tmpfs), wiped after
  every call, its own metadata (mode, extended attributes, times) put back,
  and dropped whole with the child when it cannot be (zygote.py);
- an empty environment, plus fixed harmless values and what a tool declares;
- a uid of its own with no capabilities and no_new_privs, and RLIMIT_AS /
  NPROC / FSIZE / NOFILE (and RLIMIT_CPU per call, set by the child);
- the seccomp filter of seccomp.py;
- where the host delegates cgroups to this process (v2, or v1's memory and
  pids hierarchies: `cgroups`), a cgroup of its own, joined before
  bubblewrap starts: the child and every process of the call it runs
  together under one memory limit (`memory_mb`) and one process limit;
  elsewhere memory is limited per process (`memory_mode` says which, and
  `flywheel sandbox --check` prints it);
- death with its parent (`--die-with-parent`), and the whole PID namespace
  dies when the pool kills bubblewrap on a time-out.

The uid matters for RLIMIT_NPROC, which the kernel does not enforce for uid 0
(nor with CAP_SYS_RESOURCE / CAP_SYS_ADMIN). Run as root (a container, CI),
bubblewrap is privileged: it sets up the namespaces without a user namespace,
keeps only CAP_SETUID/SETGID/SETPCAP for `setpriv`, which switches to a uid
of the child's own (`child_uid`: unique per child on the host, so the count
of processes is the child's alone) with no groups and no capabilities, and
only then runs Python. Run as anyone else (a Kubernetes sidecar), bubblewrap
makes a user namespace (`--unshare-user --disable-userns`: none inside it)
and the child keeps that unprivileged uid; the kernel counts its processes
per user namespace.

Where the host cannot do this (no bubblewrap, namespaces refused), `probe`
says why, and the pools refuse to run custom rewards and tools unless the
run file says `sandbox = "insecure-allow"` for the task (tasks/scoring.py); they
then run as plain processes with the same rlimits, an empty environment, a
private temp directory, a process group killed on a time-out and, under a
root service, a uid of their own from the first call on. The warm-up imports
run before the switch, and the code a call imports later (its sys.path, the
packages already imported) is reached through directory fds opened before
it (/proc/self/fd/N): a checkout in root's 0700 home works, and no file's
permissions are widened.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import itertools
import logging
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.runtime.errors import ConfigError
from services.sandbox import seccomp

log = logging.getLogger(__name__)

# Where child_uid numbers start: far above any uid a distribution hands out.
UID_BASE = 1 << 30
# Always visible: the code of the child itself.
CORE_MODULES = ("services", "proto")
# The environment every child gets, before what a tool declares.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    # One thread per math library: threads count against RLIMIT_NPROC.
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # No network in here: a library that would try the hub fails at once.
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}


@dataclass(frozen=True)
class Limits:
    """What one child may use (each process of it; the time limit is the pool's)."""

    memory_mb: int = 4096  # RLIMIT_AS of each process; with a cgroup, also all of them
    processes: int = 32  # RLIMIT_NPROC: processes and threads of the child's uid
    file_mb: int = 16  # RLIMIT_FSIZE: the largest file it may write
    tmp_mb: int = 64  # size of its private /tmp
    open_files: int = 256  # RLIMIT_NOFILE


@dataclass(frozen=True)
class Sandbox:
    """What a pool's children may see, what they may use, and who needs the walls.

    `required_by`: the run file's tables whose code may not run without the
    sandbox (their custom rewards and tools); empty: this pool may fall back
    to plain processes where the host has no sandbox (built-in rewards only,
    or every task said `sandbox = "insecure-allow"`).
    """

    modules: tuple[str, ...] = ()  # top-level modules of the user's code
    limits: Limits = field(default_factory=Limits)
    required_by: tuple[str, ...] = ("this pool",)
    audit: bool = False  # plain processes only: the audit hook that refuses sockets/exec

    def to_wire(self) -> dict[str, Any]:
        """As plain data, for a `flywheel sandbox` server (services/sandbox)."""
        return {
            "modules": list(self.modules),
            "limits": asdict(self.limits),
            "required_by": list(self.required_by),
            "audit": self.audit,
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> Sandbox:
        """`to_wire`'s data back; ValueError/TypeError/KeyError if it is not."""
        limits = {k: int(v) for k, v in d["limits"].items()}
        if any(v < 0 for v in limits.values()):
            raise ValueError(f"negative limit in {limits}")
        return cls(
            modules=tuple(str(m) for m in d["modules"]),
            limits=Limits(**limits),
            required_by=tuple(str(r) for r in d["required_by"]),
            audit=bool(d["audit"]),
        )

    def check(self) -> str | None:
        """None when the children will be confined; the reason they will not, when the
        pool may run without; a ConfigError naming the setting when it may not."""
        reason = probe()
        if reason is None:
            return None
        if self.required_by:
            raise ConfigError(
                f"{self.required_by[0]} runs custom rewards or tools, which need the sandbox, "
                f"and this host cannot give one ({reason}): install bubblewrap "
                f'(apt-get install bubblewrap), or set sandbox = "insecure-allow" in '
                f"{self.required_by[0]} to run them without it"
            )
        return reason


@dataclass
class Spawn:
    """How to start one child: the command, what it inherits, how to kill all of it."""

    argv: list[str]
    env: dict[str, str]
    pass_fds: tuple[int, ...] = ()
    cwd: str | None = None
    confined: bool = True  # in bubblewrap: killing argv's process ends its PID namespace
    tmpdir: str | None = None  # plain processes: the private temp dir, removed with the child
    cgroups: tuple[str, ...] = ()  # the child's own cgroup directories, removed with it

    def close_fds(self) -> None:
        """Close the parent's copies of pass_fds once the child has them."""
        for fd in self.pass_fds:
            os.close(fd)

    def cleanup(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)  # a child's leftovers, if any
        for d in self.cgroups:
            _remove_cgroup(d)


# ── memory per call: a cgroup per child where the host lets this process make one ────
@dataclass(frozen=True)
class Cgroups:
    """Where this process may make cgroups: `memory` (and `pids`) parent directories, of
    the unified hierarchy (v2) or of v1's per-controller ones."""

    version: int
    memory: str
    pids: str | None

    def describe(self) -> str:
        return (
            f"cgroup v{self.version}: each child (its zygote and the call it runs) under one "
            f"memory limit (memory_mb) and one process limit, in {self.memory}"
        )


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per controller ("" for v2's unified one)."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _cgroup_mounts() -> dict[str, str]:
    """Mount points of the cgroup hierarchies: "" for v2, else each v1 controller."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, (fstype, _src, opts) = left.split(), right.split()[:3]
            if fstype == "cgroup2":
                out.setdefault("", fields[4])
            elif fstype == "cgroup":
                for opt in opts.split(","):
                    if opt in ("memory", "pids"):
                        out.setdefault(opt, fields[4])
    return out


def _can_make(parent: str, files: tuple[str, ...]) -> bool:
    """Whether a child cgroup of `parent` can be made here and has `files` (its limits)."""
    trial = os.path.join(parent, f"flywheel-probe-{os.getpid()}")
    try:
        os.mkdir(trial)
    except OSError:
        return False
    try:
        return all(os.path.exists(os.path.join(trial, f)) for f in files)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(trial)


@functools.cache
def cgroups() -> Cgroups | None:
    """Where children's cgroups go, or None where the host delegates none to this process
    (then memory is limited per process only: see `memory_mode`)."""
    try:
        own, mounts_ = _own_cgroups(), _cgroup_mounts()
    except (OSError, ValueError):
        return None
    if "" in own and "" in mounts_:
        v2 = os.path.join(mounts_[""], own[""].lstrip("/"))
        if _can_make(v2, ("memory.max", "pids.max")):
            return Cgroups(2, v2, None)
    if "memory" in own and "memory" in mounts_:
        mem = os.path.join(mounts_["memory"], own["memory"].lstrip("/"))
        pids = None
        if "pids" in own and "pids" in mounts_:
            pids = os.path.join(mounts_["pids"], own["pids"].lstrip("/"))
            pids = pids if _can_make(pids, ("pids.max",)) else None
        if _can_make(mem, ("memory.limit_in_bytes",)):
            return Cgroups(1, mem, pids)
    return None


def memory_mode() -> str:
    """How a call's memory is bounded on this host, in one line (`flywheel sandbox --check`
    and the pools' start-up log say it)."""
    cg = cgroups()
    if cg is not None:
        return cg.describe()
    return (
        "per process (no cgroup is delegated to this process): RLIMIT_AS (memory_mb) per "
        "process, RLIMIT_NPROC (processes) per child, /tmp of tmp_mb, memfds and SysV IPC "
        "refused in bubblewrap; a call's processes together may use up to processes x "
        "memory_mb + tmp_mb"
    )


_cgroup_ids = itertools.count()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def make_cgroups(limits: Limits) -> tuple[str, ...]:
    """A child's own cgroups (memory, and processes), limited; () where there are none."""
    cg = cgroups()
    if cg is None:
        return ()
    _sweep(cg)
    name = f"flywheel-{os.getpid()}-{next(_cgroup_ids)}"
    mem = os.path.join(cg.memory, name)
    made: list[str] = []
    try:
        os.mkdir(mem)
        made.append(mem)
        limit = str(limits.memory_mb << 20)
        pids = str(limits.processes + 4)  # + bubblewrap's two processes, the zygote's slack
        if cg.version == 2:
            _write(os.path.join(mem, "memory.max"), limit)
            with contextlib.suppress(OSError):  # no swap to spill into
                _write(os.path.join(mem, "memory.swap.max"), "0")
            _write(os.path.join(mem, "pids.max"), pids)
        else:
            _write(os.path.join(mem, "memory.limit_in_bytes"), limit)
            with contextlib.suppress(OSError):
                _write(os.path.join(mem, "memory.memsw.limit_in_bytes"), limit)
            if cg.pids is not None:
                p = os.path.join(cg.pids, name)
                os.mkdir(p)
                made.append(p)
                _write(os.path.join(p, "pids.max"), pids)
    except OSError as e:
        log.warning("sandbox: cannot make a cgroup (%s); per-process limits only", e)
        for d in made:
            _remove_cgroup(d)
        return ()
    return tuple(made)


@functools.cache
def _sweep(cg: Cgroups) -> None:
    """Once per process: remove the empty cgroups of services that died without removing
    theirs (killed with SIGKILL), so none pile up on a long-lived host."""
    for parent in filter(None, (cg.memory, cg.pids)):
        with contextlib.suppress(OSError), os.scandir(parent) as entries:
            for e in entries:
                owner = e.name.split("-")
                if len(owner) != 3 or owner[0] != "flywheel" or not owner[1].isdigit():
                    continue
                try:
                    os.kill(int(owner[1]), 0)
                except ProcessLookupError:
                    with contextlib.suppress(OSError):
                        os.rmdir(e.path)  # fails while a process is still in it
                except PermissionError:
                    pass  # alive, someone else's


def in_cgroups(argv: list[str], dirs: tuple[str, ...]) -> list[str]:
    """`argv` started inside `dirs`: a shell joins them, then execs it, so that everything
    it starts (bubblewrap, the zygote, every call) is born inside."""
    if not dirs:
        return argv
    joins = " && ".join(f"echo $$ > {shlex.quote(os.path.join(d, 'cgroup.procs'))}" for d in dirs)
    return ["/bin/sh", "-c", f'{joins} && exec "$@"', "flywheel-sandbox", *argv]


def _remove_cgroup(d: str) -> None:
    """Remove a child's cgroup once its processes are gone (a moment after the kill)."""
    import time

    for _ in range(100):
        try:
            os.rmdir(d)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    log.warning("sandbox: cgroup %s still busy; left behind", d)


_uids = itertools.count()


def child_uid() -> int:
    """A uid no other child on this host has while this one lives: the service's pid and
    a counter (64 children per pid at a time)."""
    return UID_BASE + ((os.getpid() & 0x3FFFFF) << 6 | next(_uids) & 63)


def child_options(
    limits: Limits, cpu_s: int, *, pidns: bool, audit: bool, uid: int | None = None
) -> list[str]:
    """The child's own command-line options (zygote.py `_child_main` reads them)."""
    opts = [
        f"--memory={limits.memory_mb}",
        f"--nproc={limits.processes}",
        f"--fsize={limits.file_mb}",
        f"--nofile={limits.open_files}",
        f"--cpu={cpu_s}",
    ]
    opts += [f"--uid={uid}"] if uid is not None else []
    return opts + ["--pidns"] * pidns + ["--audit"] * audit


def _under(path: Path, roots: list[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def module_paths(names: tuple[str, ...]) -> list[tuple[Path, Path]]:
    """(file or package directory, the sys.path entry it was found under) of each
    top-level module, found as the service finds it, without importing it."""
    out: list[tuple[Path, Path]] = []
    for name in dict.fromkeys(n.partition(".")[0] for n in names):
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue  # the child's import names it, as a raised call
        if spec.submodule_search_locations:
            out += [(Path(p), Path(p).parent) for p in spec.submodule_search_locations]
        elif spec.origin and os.path.isfile(spec.origin):
            out.append((Path(spec.origin), Path(spec.origin).parent))
    return out


def interpreter_roots() -> list[Path]:
    """The directories the interpreter and its installed packages live in."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.add(str(Path(os.path.realpath(sys.executable)).parent.parent))
    roots: list[Path] = []
    for p in sorted(Path(os.path.realpath(x)) for x in paths if os.path.isdir(x)):
        if not _under(p, [*roots, Path("/usr")]):
            roots.append(p)
    return roots


def _mkdirs(dest: Path, made: set[Path]) -> list[str]:
    """`--dir` for dest's missing ancestors, mode 0755 (bubblewrap's are 0700: a child's
    uid could not walk through them)."""
    args: list[str] = []
    for parent in reversed(dest.parents):
        if parent != Path("/") and parent not in made:
            made.add(parent)
            args += ["--perms", "0755", "--dir", str(parent)]
    return args


def mounts(modules: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """bubblewrap's mount arguments, and the sys.path entries the child adds."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # The dynamic linker's cache, the time zone and fontconfig (matplotlib, imported by
    # reasoning-gym, complains without it): public files, no credentials.
    etc = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "fonts")
    for f in (f"/etc/{name}" for name in etc):
        args += ["--ro-bind-try", f, f]
    made: set[Path] = {Path("/usr"), Path("/etc"), Path("/tmp")}
    roots = interpreter_roots()
    for root in roots:
        args += [*_mkdirs(root, made), "--ro-bind", str(root), str(root)]
    bound = [Path("/usr"), *roots]
    entries: list[str] = []
    for path, entry in module_paths((*CORE_MODULES, *modules)):
        real = Path(os.path.realpath(path))
        if _under(real, bound) or _under(path, bound):
            continue  # installed with the interpreter: already visible
        args += [*_mkdirs(path, made), "--ro-bind", str(real), str(path)]
        bound.append(path)
        entries.append(str(entry))
    return args, list(dict.fromkeys(entries))


def python() -> str:
    """The interpreter as the sandbox can reach it: its directory resolved (a virtualenv
    reached through a symlink, `.venv -> /elsewhere/.venv`, is bound at its real path
    only), its own name kept (a virtualenv's python is a symlink whose name says where
    its prefix is)."""
    return os.path.join(
        os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable)
    )


def boot(entries: list[str]) -> list[str]:
    """The Python command line of a child: isolated mode (no environment variables, no
    working directory on sys.path), then the entries its modules were found under."""
    code = (
        f"import sys; sys.path[1:1] = {entries!r}; "
        "from services.sandbox.zygote import _child_main; _child_main(sys.argv[1:])"
    )
    return [python(), "-I", "-c", code]


def _seccomp_fd() -> int:
    fd = os.memfd_create("flywheel-seccomp", 0)
    os.write(fd, seccomp.program())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def bwrap_argv(
    options: list[str], modules: tuple[str, ...], limits: Limits, command: list[str] | None = None
) -> tuple[list[str], int]:
    """The bubblewrap command of one child (and the seccomp fd it reads; pass it on)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise FileNotFoundError("bwrap")
    binds, entries = mounts(modules)
    fd = _seccomp_fd()
    argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
    argv += ["--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    root = os.geteuid() == 0
    if root:  # privileged: no user namespace; setpriv below drops to the child's uid
        argv += ["--cap-drop", "ALL"]
        argv += [a for c in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP") for a in ("--cap-add", c)]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    # /tmp first: what is bound below it (a virtualenv or the user's module in /tmp)
    # lands inside the tmpfs instead of under it, hidden.
    argv += ["--perms", "1777", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
    argv += binds
    argv += ["--dev", "/dev", "--remount-ro", "/dev"]
    argv += ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    for k, v in BASE_ENV.items():
        argv += ["--setenv", k, v]
    argv += ["--seccomp", str(fd), "--"]
    if root:
        uid = str(child_uid())
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        argv += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        argv += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    argv += command if command is not None else [*boot(entries), *options]
    return argv, fd


@functools.cache
def probe() -> str | None:
    """None if a child can be confined here (a trial run of the interpreter in the
    sandbox succeeds), else the reason it cannot, in one line."""
    if shutil.which("bwrap") is None:
        return "bwrap is not installed"
    try:
        argv, fd = bwrap_argv([], (), Limits(), [python(), "-I", "-c", "pass"])
    except (seccomp.UnsupportedArch, OSError) as e:
        return f"{type(e).__name__}: {e}"
    try:
        r = subprocess.run(argv, pass_fds=(fd,), capture_output=True, timeout=30, env={})
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap did not run: {e}"
    finally:
        os.close(fd)
    if r.returncode != 0:
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return f"bwrap failed: {err[-1] if err else f'exit {r.returncode}'}"
    return None


def plan(sandbox: Sandbox, cpu_s: int) -> Spawn:
    """How to start one child of `sandbox` (whose `check` has passed or said why not)."""
    groups = make_cgroups(sandbox.limits)
    if probe() is None:
        opts = child_options(sandbox.limits, cpu_s, pidns=True, audit=False)
        argv, fd = bwrap_argv(opts, sandbox.modules, sandbox.limits)
        return Spawn(in_cgroups(argv, groups), env={}, pass_fds=(fd,), cgroups=groups)
    # Plain processes: the same child with the same limits, minus the walls. Never
    # root: a call run as root could signal or write anything on the host, so a root
    # service's child switches to a uid of its own before its first call.
    tmp = tempfile.mkdtemp(prefix="flywheel-sandbox-")
    uid = child_uid() if os.geteuid() == 0 else None
    if uid is not None:
        os.chown(tmp, uid, uid)
    _, entries = mounts(sandbox.modules)
    opts = child_options(sandbox.limits, cpu_s, pidns=False, audit=sandbox.audit, uid=uid)
    env = {**BASE_ENV, "HOME": tmp, "TMPDIR": tmp}
    argv = in_cgroups([*boot(entries), *opts], groups)
    return Spawn(argv, env=env, cwd=tmp, confined=False, tmpdir=tmp, cgroups=groups)
