"""The sandbox's child side: the zygote, and the process it forks per call.

Each child is a warm *zygote*: it imports what it runs once (the pool's
first request, `preload`: the modules every child imports, declared by the
code they belong to, and the pool's `PRELOAD`; then its `warmup`, all before it
serves: none of it counts against a call's time limit), and then forks a
fresh process for every call, which runs it and exits; the zygote itself
never runs, nor even reads, a call. A call sees nothing of any other:

- the zygote reads only control frames; a call's request is read from the
  pipe by the call's own process after the fork, and its answer goes back
  through a pipe the zygote splices to the pool (`os.splice`): no request
  or answer of one call is ever in memory another call inherits;
- a tool's or reward's declared `env` (a secret) reaches only its own
  calls: the warm-up carries the functions' names, never their `env`;
- a group's completions (`call_many`) each get a process of their own, in
  one pipe round trip; only requests that run Flywheel's own code reading
  the completion as text (`_pure`: the built-in rewards but math, the
  calculator) share one, as they cannot run the completion;
- after each call the zygote, the subreaper of everything the call started
  (orphans and CLONE_PARENT children come to it), kills and reaps every
  process of it, removes the SysV IPC objects of its IPC namespace, and
  empties /tmp (a flattening wipe that no depth or lock defeats), then puts
  back /tmp's own metadata (its mode first, so a `chmod 0` cannot make it
  unwipable; its extended attributes and ACLs; its owner is checked), and
  sets its times to now just before the next call: under a non-root service
  the calls share the uid that owns /tmp, and could otherwise leave a mark
  on /tmp itself for the next one to read. A slot whose state is in doubt — a
  call that crashed, left processes behind, left /tmp too full or locked to
  empty, or changed /tmp in a way that could not be put back — is replaced,
  and with it goes its whole /tmp (a tmpfs of its mount namespace);
- every request carries a fresh random id that its answers echo; a frame
  that does not (a desynchronised stream) kills and replaces the child, and
  so does a call its caller cancelled (its answer would be the next call's).

A fork, and the copy-on-write faults of the call in it, cost milliseconds
of CPU (bench/results_sandbox.md).

This module runs in the child (jail.py `boot` starts `_child_main`); it imports
nothing of the service's side (pool.py) and nothing of what it runs: the code a
call names is imported by path (`calls.resolve`).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import os
import signal
import stat
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from services.sandbox.calls import resolve, to_reward
from services.sandbox.protocol import HEADER, MAX_FRAME, encode

_DENIED_EVENTS = (
    "socket.connect",
    "socket.bind",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "subprocess.Popen",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.fork",
    "os.forkpty",
    "ctypes.dlopen",
    "ctypes.cdata",
)


def audit_hook() -> None:
    """Plain processes only (no sandbox on this host, `insecure-allow`): refuse sockets,
    processes and ctypes from Python. A guard, not a wall: C code steps around it."""

    def hook(event: str, _args: tuple[Any, ...]) -> None:
        if event in _DENIED_EVENTS:
            raise PermissionError(f"{event} is not allowed in the tool sandbox")

    sys.addaudithook(hook)


@dataclass(frozen=True)
class _Options:
    memory_mb: int = 0
    nproc: int = 0
    fsize_mb: int = 0
    nofile: int = 0
    cpu_s: int = 0
    pidns: bool = False  # alone in a PID namespace: every other process there is a call's
    audit: bool = False
    uid: int = -1  # plain processes of a root service: the uid calls run as

    @classmethod
    def parse(cls, argv: Sequence[str]) -> _Options:
        kw: dict[str, Any] = {}
        names = {"memory": "memory_mb", "nproc": "nproc", "fsize": "fsize_mb"}
        names |= {"nofile": "nofile", "cpu": "cpu_s", "uid": "uid"}
        for a in argv:
            key, _, value = a.removeprefix("--").partition("=")
            if key in names:
                kw[names[key]] = int(value)
            elif key in ("pidns", "audit"):
                kw[key] = True
            else:
                raise SystemExit(f"sandbox child: unknown option {a!r}")
        return cls(**kw)


def _limit(which: int, value: int) -> None:
    import resource

    if value > 0:
        resource.setrlimit(which, (value, value))


def _harden(opts: _Options) -> None:
    """The zygote's own limits, before it imports anything it is asked to: no fd of the
    parent's but its pipes, rlimits its calls inherit, and not dumpable (a call's
    process, same uid, cannot ptrace it or open its /proc files)."""
    import ctypes
    import resource

    os.closerange(3, 1 << 16)
    _limit(resource.RLIMIT_AS, opts.memory_mb << 20)
    _limit(resource.RLIMIT_NPROC, opts.nproc)
    _limit(resource.RLIMIT_FSIZE, opts.fsize_mb << 20)
    _limit(resource.RLIMIT_NOFILE, opts.nofile)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    pr_set_dumpable = 4
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)


def _drop_root(uid: int) -> None:
    """Plain processes of a root service: become `uid`, no groups, no capabilities, for
    good (after the warm-up, before the first call)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _enter_call(opts: _Options) -> None:
    """In the forked process, before the call: no pipe of the zygote's (it could forge
    another call's answer), a CPU limit, the audit hook where there are no walls."""
    import resource

    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    if opts.cpu_s > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (opts.cpu_s, opts.cpu_s + 1))
    if opts.audit:
        audit_hook()


def _verdict(fn: Callable[..., Any], args: Sequence[Any]) -> list[Any]:
    """["ok", reward, parts] of one call, or ["error", message] if it raised."""
    try:
        r = to_reward(fn(*args))
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
        return ["error", f"{type(e).__name__}: {e}"]
    return ["ok", r.reward, r.parts]


def _answer(fn: Callable[..., Any], args: Sequence[Any], mode: str | None) -> list[Any]:
    try:
        if mode == "value":
            return ["value", str(fn(*args))]
        return _verdict(fn, args)
    except Exception as e:  # noqa: BLE001 -- reported to the parent, which counts it
        return ["error", f"{type(e).__name__}: {e}"]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n > 0:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _read_frame_fd(fd: int) -> Any:
    """One frame from `fd`, read unbuffered: not a byte past it (what follows is the next
    reader's: a zygote reads only its control frames, never a call's request)."""
    header = _read_exact(fd, HEADER.size)
    if header is None:
        raise EOFError
    (n,) = HEADER.unpack(header)
    body = _read_exact(fd, n) if n <= MAX_FRAME else None
    if body is None:
        raise EOFError
    return msgpack.unpackb(body, raw=False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fork() -> int:
    """os.fork, waiting out a moment of EAGAIN (the last call's processes still being reaped
    count against RLIMIT_NPROC)."""
    for _ in range(100):
        try:
            return os.fork()
        except BlockingIOError:
            time.sleep(0.01)
    return os.fork()


def _died(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by {signal.strsignal(sig) or sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def _serve_call(rid: int, first: int, k: int, opts: _Options) -> list[Any]:
    """In the call's process: read its `k` request frames from stdin (the zygote has not
    read them), close every pipe of the zygote's, answer. [rid, first, [answer, ...]] as
    read: the pool matches them against what it sent."""
    frames = [_read_frame_fd(0) for _ in range(k)]
    _enter_call(opts)
    got = [f[0], f[1]] if (f := frames[0]) and isinstance(f, list) and len(f) == 5 else [-1, -1]
    answers: list[Any] = []
    for j, frame in enumerate(frames):
        if not (isinstance(frame, list) and len(frame) == 5 and frame[:2] == [rid, first + j]):
            return [*got, []]  # not the request it was forked for: answer nothing
        _, _, path, args, mode = frame
        try:
            fn = resolve(path)
        except Exception as e:  # noqa: BLE001 -- a module that fails to import: reported
            answers.append(["error", f"{type(e).__name__}: {e}"])
            continue
        answers.append(_answer(fn, args, mode))
    return [rid, first, answers]


def _relay(r: int, marker: bytes) -> str | None:
    """Pass one frame of the call's pipe `r` on to the pool after `marker`: the 4-byte
    header through this process, the body spliced pipe to pipe (the zygote never holds
    an answer). None, or why there was none."""
    header = _read_exact(r, HEADER.size)
    if header is None:
        return "without answering"
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        return f"with an answer of {n} bytes (the limit is {MAX_FRAME})"
    _write_all(1, marker + header)
    while n > 0:
        moved = os.splice(r, 1, n)
        if moved == 0:  # the frame is cut: the pool's stream cannot be trusted past it
            os._exit(3)
        n -= moved
    return None


def _reap(pid: int, opts: _Options) -> tuple[int, int]:
    """Kill and reap the call's process and everything it started (this zygote is their
    subreaper: orphans and CLONE_PARENT children come here). Its wait status, and how
    many other processes were left."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    left = 0
    for _ in range(10_000):
        targets = _others(opts)
        if not targets:
            break
        for target in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(target, signal.SIGKILL)
        left += _reap_children()
    return status, left


def _others(opts: _Options) -> list[int]:
    """Processes of this slot but the zygote. In a PID namespace: [-1] while there are any
    (kill(-1) reaches exactly them: the namespace holds only bubblewrap's init, which it
    skips, this zygote and the calls' processes). Plain processes: this zygote's
    children (it is their subreaper: every process a call starts stays below it)."""
    if opts.pidns:
        try:
            os.kill(-1, 0)
        except ProcessLookupError:
            return []
        return [-1]
    me = str(os.getpid())
    kids: list[int] = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[1] == me:
                    kids.append(int(pid))
    return kids


def _reap_children() -> int:
    """Reap what has died (waiting for at least one); how many."""
    n = 0
    flags = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, flags)
        except ChildProcessError:
            time.sleep(0.001)  # signalled, not (yet) ours: re-parented next
            return n
        if pid == 0:
            return n
        n += 1
        flags = os.WNOHANG


_IPC = (  # (ctl, *_INFO, *_STAT_ANY) of SysV shared memory, message queues, semaphores
    ("shmctl", 14, 15),
    ("msgctl", 12, 13),
    ("semctl", 19, 20),
)


def _ipc_table() -> list[tuple[Callable[[int, int, Any], int], int, int]]:
    """(ctl(ident, cmd, arg), *_INFO, *_STAT_ANY) of each kind of SysV IPC object."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    out: list[tuple[Callable[[int, int, Any], int], int, int]] = []
    for name, info, stat_any in _IPC:
        ctl = getattr(libc, name)

        def call(ident: int, cmd: int, arg: Any, ctl: Any = ctl, name: str = name) -> int:
            return int(ctl(ident, 0, cmd, arg) if name == "semctl" else ctl(ident, cmd, arg))

        out.append((call, info, stat_any))
    return out


def _ipc_objects() -> set[tuple[int, int]]:
    """(kind, id) of every SysV IPC object this uid made that this IPC namespace holds."""
    import ctypes

    buf = ctypes.create_string_buffer(1024)
    uid = os.geteuid()
    out: set[tuple[int, int]] = set()
    for kind, (call, info, stat_any) in enumerate(_ipc_table()):
        for index in range(call(0, info, buf) + 1):
            ident = call(index, stat_any, buf)
            # struct ipc_perm opens every *id_ds: key, uid, gid, cuid (its creator), cgid
            if ident >= 0 and struct.unpack_from("=iIII", buf.raw)[3] == uid:
                out.add((kind, ident))
    return out


def _clear_ipc(before: set[tuple[int, int]] | None = None) -> int:
    """Remove the SysV IPC objects a call made (they would outlive it: the next call could
    read them): every one of this slot's IPC namespace (`before` None), or, where the
    namespace is the host's, those this uid made that were not there `before` the call.
    How many there were."""
    table = _ipc_table()
    if before is None:
        import ctypes

        buf = ctypes.create_string_buffer(1024)
        found = {
            (kind, ident)
            for kind, (call, info, stat_any) in enumerate(table)
            for index in range(call(0, info, buf) + 1)
            if (ident := call(index, stat_any, buf)) >= 0
        }
    else:
        found = _ipc_objects() - before
    return sum(table[kind][0](ident, 0, None) == 0 for kind, ident in found)  # IPC_RMID


def _dev_shm() -> set[str]:
    """The entries of the host's /dev/shm this uid owns."""
    uid = os.geteuid()
    out: set[str] = set()
    with contextlib.suppress(OSError), os.scandir("/dev/shm") as entries:
        for e in entries:
            with contextlib.suppress(OSError):
                if e.stat(follow_symlinks=False).st_uid == uid:
                    out.add(e.path)
    return out


def _clear_dev_shm(before: set[str] | None = None) -> None:
    """Plain processes share the host's /dev/shm: remove the POSIX shared memory (and named
    semaphores) this uid made there: all of them where the uid is the slot's own
    (`before` None), else those that appeared during the call."""
    for path in _dev_shm() - (before or set()):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _keep(root: str) -> set[str]:
    """What is in `root` before any call: the mount points of what is bound below /tmp and
    the directories that lead to them (not entered: another filesystem)."""
    keep: set[str] = set()
    dev = os.stat(root).st_dev
    with os.scandir(root) as entries:
        for e in entries:
            keep.add(e.path)
            if e.is_dir(follow_symlinks=False) and e.stat(follow_symlinks=False).st_dev == dev:
                keep |= _keep(e.path)
    return keep


@dataclass(frozen=True)
class _Meta:
    """What a call could change of a directory it may write to but not remove (the temp
    dir itself, and the kept directories on its filesystem that lead to binds below
    it): its mode, owner and extended attributes, as they were before any call."""

    mode: int
    uid: int
    gid: int
    xattrs: tuple[tuple[str, bytes], ...]


def _xattrs(path: str) -> tuple[tuple[str, bytes], ...]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return ()  # a filesystem without them: nothing to plant
        raise
    return tuple(sorted((n, os.getxattr(path, n, follow_symlinks=False)) for n in names))


def _meta(path: str) -> _Meta:
    st = os.lstat(path)
    return _Meta(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, _xattrs(path))


def _own_dirs(root: str, keep: set[str]) -> dict[str, _Meta]:
    """The temp dir and its kept directories on the same filesystem, parents first, with
    their metadata before any call (`_restore` puts it back after each)."""
    dev = os.stat(root).st_dev
    own = (p for p in keep if stat.S_ISDIR((st := os.lstat(p)).st_mode) and st.st_dev == dev)
    dirs = [root, *sorted(own)]
    return {p: _meta(p) for p in dirs}


def _chmod(path: str, mode: int) -> None:
    """`path`'s mode set to `mode` if it is a directory with another (Linux has no chmod of
    a symlink itself: one a call put in a directory's place is left to the wipe)."""
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def _reopen(dirs: dict[str, _Meta]) -> None:
    """Before the wipe: each directory's mode as it was, so that a call that made /tmp
    unreadable (chmod 0) cannot make it unwipable. A directory whose mode this process
    cannot set (not its owner) is one the call could not change either."""
    for path, meta in dirs.items():
        with contextlib.suppress(OSError):
            _chmod(path, meta.mode)


def _restore(dirs: dict[str, _Meta]) -> str | None:
    """After the wipe: each directory's extended attributes and mode as they were, checked
    (owner included: no call can change it, and if one did the slot goes). None, or
    what could not be put back: the slot is then replaced and its /tmp with it."""
    for path, meta in dirs.items():
        try:
            before = dict(meta.xattrs)
            now = dict(_xattrs(path))
            for name in now.keys() - before.keys():
                os.removexattr(path, name, follow_symlinks=False)
            for name, value in before.items():
                if now.get(name) != value:
                    os.setxattr(path, name, value, follow_symlinks=False)
            _chmod(path, meta.mode)
            if _meta(path) != meta:
                return f"{path} is not as it was: {_meta(path)} (was {meta})"
        except OSError as e:
            return f"cannot restore {path}: {e}"
    return None


def _touch(dirs: dict[str, _Meta]) -> None:
    """Just before a call: each directory's times set to now. What an earlier call did to
    them (an mtime it chose, the moment it wrote a file, the wipe after it) is then gone:
    a call reads only the time it started, which it knows anyway. A directory this
    process may not touch (not writable by it) is one no call could change."""
    for path in dirs:
        with contextlib.suppress(PermissionError):
            os.utime(path, follow_symlinks=False)


WIPE_BUDGET = 20_000  # entries a call may leave in /tmp before its slot is replaced instead


def _wipe(root: str, keep: set[str]) -> bool:
    """Remove what a call left in `root` (all but `keep`), unreadable directories and chains
    nested past any fd or path limit included: each directory's subdirectories are moved
    up to `root` before it is emptied, so nothing is ever more than one level deep. False
    when it could not (or there was more than WIPE_BUDGET): the slot is then replaced and
    its /tmp goes with its mount namespace."""
    seen = 0
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    try:
        todo = _unkept(root, keep)
        while todo:
            seen += 1
            if seen > WIPE_BUDGET:
                return False
            p = todo.pop()
            try:
                mode = os.lstat(p).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(mode):
                os.unlink(p)
                continue
            os.chmod(p, 0o700)
            with os.scandir(p) as it:
                entries = [(e.path, e.is_dir(follow_symlinks=False)) for e in it]
            if not entries:
                os.rmdir(p)
                continue
            todo.append(p)  # again once its entries are gone
            for path, is_dir in entries:
                if is_dir:
                    flat = os.path.join(root, f".wipe-{token}-{seen}-{len(todo)}")
                    os.rename(path, flat)
                    todo.append(flat)
                else:
                    os.unlink(path)
        return not _unkept(root, keep)
    except OSError:
        return False


def _unkept(path: str, keep: set[str]) -> list[str]:
    """What is in `path` that was not there before any call (the kept directories that
    lead to binds below it searched too)."""
    out: list[str] = []
    with os.scandir(path) as entries:
        for e in entries:
            if e.path not in keep:
                out.append(e.path)
            elif e.is_dir(follow_symlinks=False) and any(k.startswith(e.path + "/") for k in keep):
                out += _unkept(e.path, keep)
    return out


def _call(
    rid: int, first: int, k: int, opts: _Options, keep: set[str], dirs: dict[str, _Meta]
) -> str | None:
    """Run requests first..first+k-1 of call `rid` in a new process, relay its answer, then
    kill and reap all it started, clear IPC and /tmp (its entries and its own metadata).
    Why this slot is in doubt, or None."""
    # The zygote's objects out of the collector's reach: a call's collections then never
    # write to (and copy) the pages of the warm imports it inherits.
    gc.freeze()
    shared_ipc = not opts.pidns and not (opts.uid >= 0 and os.geteuid() != 0)
    before = _ipc_objects() if shared_ipc else set()
    shm_before = _dev_shm() if shared_ipc else set()
    _touch(dirs)
    r, w = os.pipe()
    try:
        pid = _fork()
    except OSError as e:
        os.close(r)
        os.close(w)
        _write_all(1, encode(["crashed", rid, first, k, f"no process for the call: {e}"]))
        return "no process for a call"
    if pid == 0:  # the call's process: answer once, exit whatever happens
        try:
            os.close(r)
            data = memoryview(encode(_serve_call(rid, first, k, opts)))
            while data:
                data = data[os.write(w, data) :]
        finally:
            os._exit(0)
    os.close(w)
    doubt = None
    try:
        why = _relay(r, encode(["answer", rid, first, k]))
    finally:
        os.close(r)
        status, left = _reap(pid, opts)
    if why is not None:
        _write_all(1, encode(["crashed", rid, first, k, f"its process {_died(status)} {why}"]))
        doubt = "a call crashed"
    if left:
        doubt = f"a call left {left} processes"
    if not shared_ipc:  # an IPC namespace, or a uid, of the slot's own: all of it goes
        _clear_ipc()
    else:  # the service's uid in the host's namespace: what appeared during the call
        _clear_ipc(before)
    if not opts.pidns:  # plain processes share the host's /dev/shm: the call's own files
        _clear_dev_shm(shm_before if shared_ipc else None)
    _reopen(dirs)
    if not _wipe(os.getcwd(), keep):
        doubt = "a call left /tmp too full or locked to empty"
    elif why := _restore(dirs):
        doubt = f"a call changed /tmp's own metadata: {why}"
    return doubt


def preload(modules: list[str]) -> float:
    """A child's first request (in the zygote, before /tmp's state is taken): import
    `modules` (what every child imports, `pool.every_child_imports`, and the pool's
    PRELOAD): each call's fork starts with them warm. Its answer also says the child is
    up: its interpreter started, its imports done."""
    for module in modules:
        importlib.import_module(module)
    return 1.0


def _reachable_code() -> None:
    """Plain processes of a root service, before the uid switch: the code this child runs
    (sys.path and the packages already imported) reachable through directory fds opened
    now, as /proc/self/fd/N. A checkout in a 0700 home directory stays unreadable to the
    call's uid, and no permission is widened: only what is on sys.path is reached."""
    fds: dict[str, str] = {}
    for entry in dict.fromkeys(sys.path):
        if entry and os.path.isdir(entry):
            fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
            fds[entry.rstrip("/")] = f"/proc/self/fd/{fd}"

    def moved(p: str) -> str:
        for root, new in fds.items():
            if p == root or p.startswith(root + "/"):
                return new + p[len(root) :]
        return p

    sys.path[:] = [moved(p) for p in sys.path]
    for module in list(sys.modules.values()):
        path = getattr(module, "__path__", None)
        if isinstance(path, list):
            path[:] = [moved(p) for p in path]
    sys.path_importer_cache.clear()


def _warm(control: list[Any]) -> None:
    """Answer a warm-up request `["warm", id, path, args]` in the zygote itself."""
    _, rid, path, args = control
    try:
        answer = _answer(resolve(path), args, None)
    except Exception as e:  # noqa: BLE001 -- a module that fails to import: reported
        answer = ["error", f"{type(e).__name__}: {e}"]
    _write_all(1, encode(["warmed", rid, answer]))


def _child_main(argv: Sequence[str]) -> None:
    """The zygote: read control frames, answer warm-ups in itself and fork a process for
    each call (which reads its own request); see the module docstring for the frames."""
    import ctypes

    opts = _Options.parse(argv)
    _harden(opts)
    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    try:
        control = _read_frame_fd(0)
    except EOFError:
        return
    # The pool's first request is the preload: the zygote's own imports, answered before
    # /tmp's state is taken, as everything the zygote does before it serves.
    if control[0] == "warm":
        _warm(control)
        control = None
    keep = _keep(os.getcwd())  # the temp dir as it is before any call
    dirs = _own_dirs(os.getcwd(), keep)  # and the metadata of its directories
    dropped = opts.uid < 0
    while True:
        if control is None:
            try:
                control = _read_frame_fd(0)
            except EOFError:
                return
        kind, rid, *rest = control
        control = None
        if kind == "warm":  # the service's own request (imports, caches): in the zygote
            _warm([kind, rid, *rest])
            continue
        n, pure = rest
        if not dropped:
            _reachable_code()
            _drop_root(opts.uid)
            dropped = True
        doubts = []
        # Text readers (`_pure`) share one process: they never run a completion as code.
        for first, k in [(0, n)] if pure else [(i, 1) for i in range(n)]:
            doubt = _call(rid, first, k, opts, keep, dirs)
            if doubt:
                doubts.append(doubt)
        _write_all(1, encode(["done", rid, "; ".join(doubts) or None]))
