"""broker.malloc: a rank tunes glibc's allocator itself.  Checked by
behaviour, in a child interpreter (so this test process keeps its own
settings): the program break after freeing 8 MiB at the top of the heap."""

from __future__ import annotations

import ctypes.util
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None,
    reason="mallopt is glibc's")

PROBE = """
import ctypes, sys
from broker import malloc
ok = malloc.tune()
libc = ctypes.CDLL(None)
libc.sbrk.restype = ctypes.c_void_p
libc.sbrk.argtypes = (ctypes.c_long,)
start = libc.sbrk(0)
junk = [bytes(1000) for _ in range(8000)]   # > pymalloc's 512 bytes: glibc's heap
grown = libc.sbrk(0) - start
del junk
kept = libc.sbrk(0) - start
print(ok, grown > (4 << 20), kept > (4 << 20))
"""


def probe(env_extra: dict[str, str] | None = None) -> list[str]:
    env = dict(os.environ)
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.split()


def test_freed_top_of_heap_is_kept_for_reuse() -> None:
    # Trim threshold 16 MiB: the 8 MiB freed at the top stay in the heap, so
    # the next burst of allocations needs no brk calls and no fresh pages.
    assert probe() == ["True", "True", "True"]


def test_explicit_malloc_environment_wins() -> None:
    # glibc's own default trim threshold (128 KiB) set explicitly: tune()
    # leaves it alone and the freed memory goes back to the system.
    assert probe({"MALLOC_TRIM_THRESHOLD_": "131072"}) == ["True", "True", "False"]
