"""The sandbox's seccomp filter: a short classic-BPF program, built here, loaded by bubblewrap.

Namespaces, an unprivileged uid and read-only mounts are the sandbox's walls
(jail.py). This filter takes away the kernel interfaces a process in those
walls could still use to reach for more: making namespaces of its own
(`unshare`, `setns`, `clone` with a CLONE_NEW* flag: a user namespace would
give it capabilities over new network and mount namespaces, the usual first
step of a kernel exploit), mounting, tracing other processes (`ptrace`,
`process_vm_*`), and the interfaces that hold most local privilege
escalations (`bpf`, `perf_event_open`, `userfaultfd`, `io_uring`, `keyctl`,
module and kexec loading). Docker's and containerd's default profiles refuse
the same list; ours adds POSIX message queues (`mq_open`: they live in the
IPC namespace, which a slot's calls share, and none can be listed to remove
them after a call), memory no rlimit counts (`memfd_create`, `memfd_secret`
and SysV shared memory, message queues and semaphores: a memfd written with
write(2), a detached SysV segment or a queue full of messages holds pages
that no process's RLIMIT_AS sees, so without a cgroup a call could hold as
much as the host has; measured: bench/results_sandbox.md) and new unix-domain
sockets (`socket(AF_UNIX)`: a
read-only bind does not stop `connect()` to a socket file in a bound folder;
`socketpair`, which asyncio's self-pipe uses, connects to nothing and
stays). Ours is written out because a pool child must not depend on
the container runtime's profile, and bubblewrap takes a compiled program
(`--seccomp FD`), not a policy file.

Refused calls fail with EPERM, so a library that probes (an `unshare` to
test for namespaces) gets an ordinary error; `clone3` fails with ENOSYS so
glibc falls back to `clone`, whose flags the filter can read (clone3 passes
them in memory, out of a filter's reach). A call from another architecture
(32-bit compat, x32) kills the process: the numbers below would not mean
the same calls.

Why no library: libseccomp's Python binding is not on PyPI, and the program
is a few dozen instructions with two argument checks, tested against the
kernel headers where they are installed (tests/unit/sandbox/test_seccomp.py)
and by the escape battery against a live kernel.
"""

from __future__ import annotations

import errno
import platform
import struct
from dataclasses import dataclass

# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64)
_NR, _ARCH, _ARG0 = 0, 4, 16

# classic BPF opcodes
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K

_AF_UNIX = 1
_ALLOW = 0x7FFF0000
_KILL_PROCESS = 0x80000000
_ERRNO = 0x00050000

# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_FLAGS |= 0x20000000 | 0x40000000

DENIED = (
    "unshare setns mount umount2 pivot_root chroot open_tree move_mount fsopen fsconfig "
    "fsmount fspick mount_setattr ptrace process_vm_readv process_vm_writev bpf "
    "perf_event_open userfaultfd io_uring_setup io_uring_enter io_uring_register keyctl "
    "add_key request_key init_module finit_module delete_module kexec_load kexec_file_load "
    "swapon swapoff reboot acct quotactl syslog vhangup name_to_handle_at open_by_handle_at "
    "mq_open memfd_create memfd_secret shmget msgget semget"
).split()


@dataclass(frozen=True)
class Arch:
    audit: int  # AUDIT_ARCH_* of seccomp_data.arch
    numbers: dict[str, int]  # syscall numbers of the native ABI
    abi_mask: int | None = None  # numbers at or above this are another ABI (x86_64's x32)


_X86_64 = Arch(
    0xC000003E,
    {
        "clone": 56,
        "clone3": 435,
        "socket": 41,
        "unshare": 272,
        "setns": 308,
        "mount": 165,
        "umount2": 166,
        "pivot_root": 155,
        "chroot": 161,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "ptrace": 101,
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "bpf": 321,
        "perf_event_open": 298,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "keyctl": 250,
        "add_key": 248,
        "request_key": 249,
        "init_module": 175,
        "finit_module": 313,
        "delete_module": 176,
        "kexec_load": 246,
        "kexec_file_load": 320,
        "swapon": 167,
        "swapoff": 168,
        "reboot": 169,
        "acct": 163,
        "quotactl": 179,
        "syslog": 103,
        "vhangup": 153,
        "name_to_handle_at": 303,
        "open_by_handle_at": 304,
        "mq_open": 240,
        "memfd_create": 319,
        "memfd_secret": 447,
        "shmget": 29,
        "msgget": 68,
        "semget": 64,
    },
    abi_mask=0x40000000,
)

_AARCH64 = Arch(
    0xC00000B7,
    {
        "clone": 220,
        "clone3": 435,
        "socket": 198,
        "unshare": 97,
        "setns": 268,
        "mount": 40,
        "umount2": 39,
        "pivot_root": 41,
        "chroot": 51,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "ptrace": 117,
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "bpf": 280,
        "perf_event_open": 241,
        "userfaultfd": 282,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "keyctl": 219,
        "add_key": 217,
        "request_key": 218,
        "init_module": 105,
        "finit_module": 273,
        "delete_module": 106,
        "kexec_load": 104,
        "kexec_file_load": 294,
        "swapon": 224,
        "swapoff": 225,
        "reboot": 142,
        "acct": 89,
        "quotactl": 60,
        "syslog": 116,
        "vhangup": 58,
        "name_to_handle_at": 264,
        "open_by_handle_at": 265,
        "mq_open": 180,
        "memfd_create": 279,
        "memfd_secret": 447,
        "shmget": 194,
        "msgget": 186,
        "semget": 190,
    },
)

ARCHES = {"x86_64": _X86_64, "aarch64": _AARCH64}


class UnsupportedArch(RuntimeError):
    """No syscall table for this machine: the sandbox cannot load its filter."""


def arch(machine: str | None = None) -> Arch:
    name = machine or platform.machine()
    if name not in ARCHES:
        raise UnsupportedArch(f"no seccomp syscall table for {name!r} (have {sorted(ARCHES)})")
    return ARCHES[name]


def program(machine: str | None = None) -> bytes:
    """The filter as `struct sock_filter[]` bytes (what `bwrap --seccomp FD` reads)."""
    a = arch(machine)
    code: list[tuple[int, str | int, str | int, int]] = []  # (op, jt, jf, k); jumps by label

    def op(o: int, k: int = 0, jt: str | int = 0, jf: str | int = 0) -> None:
        code.append((o, jt, jf, k))

    op(_LD_W_ABS, _ARCH)
    op(_JEQ_K, a.audit, jf="kill")
    op(_LD_W_ABS, _NR)
    if a.abi_mask is not None:
        op(_JGE_K, a.abi_mask, jt="kill")
    for name in DENIED:
        op(_JEQ_K, a.numbers[name], jt="eperm")
    op(_JEQ_K, a.numbers["clone3"], jt="enosys")
    op(_JEQ_K, a.numbers["socket"], jf=2)  # not socket: on to clone, two instructions on
    op(_LD_W_ABS, _ARG0)  # socket's domain
    op(_JEQ_K, _AF_UNIX, jt="eperm", jf="allow")
    op(_JEQ_K, a.numbers["clone"], jf="allow")
    op(_LD_W_ABS, _ARG0)  # clone's flags (their low 32 bits hold every CLONE_NEW*)
    op(_JSET_K, CLONE_NEW_FLAGS, jt="eperm")
    labels = {"allow": len(code), "eperm": len(code) + 1, "enosys": len(code) + 2}
    labels["kill"] = len(code) + 3
    op(_RET_K, _ALLOW)
    op(_RET_K, _ERRNO | errno.EPERM)
    op(_RET_K, _ERRNO | errno.ENOSYS)
    op(_RET_K, _KILL_PROCESS)

    out = bytearray()
    for i, (o, jt, jf, k) in enumerate(code):
        rel = [labels[j] - i - 1 if isinstance(j, str) else j for j in (jt, jf)]
        assert all(0 <= r <= 255 for r in rel), "a jump past 255 instructions"
        out += struct.pack("=HBBI", o, rel[0], rel[1], k)
    return bytes(out)
