"""The trainer's allocator settings give a freed large block back (services/runtime/malloc.py).

Each case runs in a fresh interpreter (mallopt is process-wide) with no
MALLOC_* variables: a 16 MiB block is allocated and freed once (under glibc's
defaults that raises the mmap threshold to 16 MiB), then again with a small
block allocated after it so the heap's top stays pinned, and the resident
size after the second free is compared with before it.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, ctypes.util, sys
from services.runtime.malloc import bound_heap_growth
from services.runtime.malloc import release_free_memory
applied = bound_heap_growth() if sys.argv[1] == "bound" else False
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 16 << 20
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def touched(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
libc.free(touched(SIZE))  # glibc's default: the threshold rises to 16 MiB
big = touched(SIZE)
pin = touched(4096)  # keeps the heap's top in use: a block below it cannot be trimmed
before = rss()
libc.free(big)
if sys.argv[1] == "trim":
    release_free_memory()
print(applied, (before - rss()) >> 20)
"""


def freed_mib(mode: str) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_block_goes_back_to_the_system() -> None:
    applied, freed = freed_mib("bound")
    assert applied
    assert freed >= 15, freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_under_glibcs_defaults_it_stays_in_the_heap() -> None:
    """The control: without the settings the same block stays resident (the growth seen)."""
    applied, freed = freed_mib("default")
    assert not applied
    assert freed < 2, freed


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_block_freed_inside_the_heap_goes_back_when_trimmed() -> None:
    """What the trainer does after every step: the free pages inside a heap returned."""
    applied, freed = freed_mib("trim")
    assert not applied
    assert freed >= 15, freed
