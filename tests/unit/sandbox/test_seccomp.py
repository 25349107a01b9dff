"""The sandbox's seccomp program: its syscall numbers are the kernel's, and it is well formed.

The numbers are checked against the kernel headers where they are installed
(linux-libc-dev); the escape battery (tests/integration/sandbox) checks the
loaded filter refuses what it should on the running kernel.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from services.sandbox import seccomp

HEADERS = {
    "x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"),
    "aarch64": Path("/usr/include/asm-generic/unistd.h"),
}


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_syscall_numbers_are_the_kernel_headers(machine: str) -> None:
    header = HEADERS[machine]
    if not header.is_file():
        pytest.skip(f"{header} is not installed (apt-get install linux-libc-dev)")
    defined = {
        m[1]: int(m[2]) for m in re.finditer(r"#define __NR_(\w+)\s+(\d+)\b", header.read_text())
    }
    table = seccomp.ARCHES[machine].numbers
    assert set(seccomp.DENIED) | {"clone", "clone3", "socket"} == set(table)
    assert {n: defined.get(n) for n in table} == table


@pytest.mark.parametrize("machine", sorted(seccomp.ARCHES))
def test_the_program_checks_the_arch_first_and_ends_in_returns(machine: str) -> None:
    prog = seccomp.program(machine)
    insns = [struct.unpack("=HBBI", prog[i : i + 8]) for i in range(0, len(prog), 8)]
    assert insns[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert insns[1][0] == 0x15 and insns[1][3] == seccomp.ARCHES[machine].audit
    rets = [k for op, _, _, k in insns[-4:] if op == 0x06]
    assert rets == [0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000]
    for i, (op, jt, jf, _) in enumerate(insns):
        if op & 0x07 == 0x05:  # a jump lands inside the program
            assert i + 1 + max(jt, jf) < len(insns)


def test_an_unknown_machine_is_named() -> None:
    with pytest.raises(seccomp.UnsupportedArch, match="riscv64"):
        seccomp.program("riscv64")
