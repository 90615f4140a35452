"""Garbage-collector thresholds for a rank process: a server with a big,
long-lived heap.

CPython's full (generation 2) collection scans every tracked object, and it
runs each time the long-lived heap has grown by a quarter since the last
one.  A rank's long-lived heap is its state -- namespaces, watchers,
monitors, decoded tree objects -- and it grows with the instance: in W5x
(64K live namespaces, each with an idle watcher on rank 3) rank 3 ran 26
full collections in one run, 7.7 s in all, the longest 0.61 s, during
which it answered nothing.  That, not any code path, is what made the 16K
and 64K levels slow.

A rank therefore raises the thresholds: a young-generation collection every
2,000 net allocations (CPython: 700), the middle one every 20 of those
(10), and a full collection considered only every 100 middle ones (10) --
and still only after the heap has grown by a quarter.  Garbage cycles are
still collected, later; objects without cycles are freed by reference
counting as always.  Measured A/B in one session (``KVBROKER_GC_THRESHOLDS
=python`` against the default, W2p W4 W5 W5x, two runs each): rank 3 ran
no full collection at all; W5x 16K/1K 0.71-0.82 -> 0.96-0.98 (64K/1K
0.29-0.43 -> 0.49 in an earlier run); W5 857-906 -> 949-952 namespaces/s;
rank 3's peak RSS 350 -> 309-321 MB; W4 and W2p within noise.

Applied by the rank's ``main`` (the application), never on import, like
:mod:`broker.malloc`.  ``KVBROKER_GC_THRESHOLDS="a,b,c"`` overrides the
values; ``KVBROKER_GC_THRESHOLDS=python`` keeps CPython's own.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Mapping

log = logging.getLogger("kvbroker.gc")

THRESHOLDS = (2000, 20, 100)
ENV = "KVBROKER_GC_THRESHOLDS"


def tune(environ: Mapping[str, str] = os.environ) -> tuple[int, ...]:
    """Set the collector's thresholds for a rank; returns what is in force."""
    wanted: tuple[int, ...] = THRESHOLDS
    value = environ.get(ENV, "").strip()
    if value == "python":
        return gc.get_threshold()
    if value:
        try:
            wanted = tuple(int(x) for x in value.split(","))
            if len(wanted) != 3 or min(wanted) < 1:
                raise ValueError
        except ValueError:
            log.warning("ignoring %s=%r: expected three positive integers", ENV, value)
            wanted = THRESHOLDS
    gc.set_threshold(*wanted)
    return gc.get_threshold()


def stats() -> dict[str, object]:
    """The collector's thresholds and collection counts, for ``broker.stats-get``."""
    return {"thresholds": list(gc.get_threshold()),
            "collections": [g["collections"] for g in gc.get_stats()]}
