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


TRIM_PROBE = """
import os
from broker import malloc
malloc.tune()
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
blocks = [bytes(3000) for _ in range(40000)]   # ~120 MB in glibc's heap
keep = blocks[::40]                             # one block in 40 stays: the heap cannot shrink
del blocks
held = rss()
trimmed = malloc.trim()
print(trimmed, held - rss() > (60 << 20))
"""


def test_trim_gives_a_scattered_heap_back() -> None:
    """A rank that lets go of much at once (a dropped client's backlog, its
    caches) calls :func:`malloc.trim`: the blocks it freed are scattered
    through the heap, so without it the rank's memory stayed at its peak."""
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"], out
