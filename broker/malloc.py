"""glibc allocator settings for a rank process (a no-op elsewhere).

A rank's heap traffic has two shapes that glibc's defaults handle badly:

* **Big blobs come and go** (values up to the message limit).  With the
  default *dynamic* mmap threshold, a freed 16 MiB buffer raises the
  threshold and later ones land in the heap, where they stay: a rank that saw
  a few such values kept ~100 MB it no longer used.  A fixed threshold of
  1 MiB sends every big buffer to its own mapping, returned on free.
* **Small objects churn at the top of the heap**, thousands of times a
  second (messages, tree objects, msgpack buffers).  Fixing the mmap
  threshold also pins the trim threshold at its 128 KiB default, so the
  heap was shrunk and grown again with ``brk`` about four times per commit
  (an strace of W2p: 32,000 ``brk`` calls for 8,000 commits), and every
  regrowth page-faults fresh pages in.  Keeping up to 16 MiB of free top
  of heap, and growing it 1 MiB at a time, removed those calls: W2p's
  system time on rank 0 fell from ~55 to ~37 us per commit.

The settings are applied by the rank itself (not through ``MALLOC_*``
environment variables set by the launcher) so a rank started by hand on
another host gets them too.  Explicit ``MALLOC_*_`` variables still win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

# mallopt() parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

SETTINGS = {
    # parameter: (value, environment variable that overrides it)
    M_MMAP_THRESHOLD: (1 << 20, "MALLOC_MMAP_THRESHOLD_"),
    M_TRIM_THRESHOLD: (16 << 20, "MALLOC_TRIM_THRESHOLD_"),
    M_TOP_PAD: (1 << 20, "MALLOC_TOP_PAD_"),
}


def tune() -> bool:
    """Apply :data:`SETTINGS` with ``mallopt``; False where there is no glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl, macOS: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = True
    for param, (value, env) in SETTINGS.items():
        if env not in os.environ:
            ok = bool(mallopt(param, value)) and ok
    return ok


TRIM_AFTER = 16 << 20
"""Bytes let go of at once (a dropped client's backlog) past which the rank
gives the heap's free pages back (:func:`trim`): below it, the top pad
kept anyway (``M_TRIM_THRESHOLD``) covers them."""

_malloc_trim: Any = None
_let_go = 0
"""Bytes let go of since the last trim (:func:`let_go`)."""


def let_go(nbytes: int) -> None:
    """The rank let go of ``nbytes`` (a dropped backlog, expired cache
    entries): :func:`trim` once :data:`TRIM_AFTER` have gone since the last
    trim, in one go or a little at a time -- one count for the process, so
    what every module lets go of adds up."""
    global _let_go
    _let_go += nbytes
    if _let_go > TRIM_AFTER:
        trim()




def trim() -> bool:
    """Give the heap's free pages back to the system (glibc's
    ``malloc_trim``), after a rank let go of much at once -- a slow
    consumer's backlog, its caches: the small blocks that held it are
    scattered through the heap, so its size stayed at the peak (a rank
    that dropped a subscriber's 268 MB backlog kept 113 MB of resident
    memory, 25 MB after a trim).  A few milliseconds for a few hundred MB;
    False where there is no glibc."""
    global _malloc_trim, _let_go
    _let_go = 0
    if _malloc_trim is None:
        name = ctypes.util.find_library("c")
        try:
            _malloc_trim = ctypes.CDLL(name).malloc_trim if name else False
        except (OSError, AttributeError):  # musl, macOS
            _malloc_trim = False
        if _malloc_trim:
            _malloc_trim.argtypes = (ctypes.c_size_t,)
            _malloc_trim.restype = ctypes.c_int
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    return True
