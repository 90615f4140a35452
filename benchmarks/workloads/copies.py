"""Wcopy (a kvbroker extension, not in BENCHMARKS.md): copying a big directory.

A commit that names a directory by reference (``kvs copy``) has rank 0
check that every blob below it exists; rank 0 remembers the trees it
checked until the next garbage collection begins (docs/performance.md,
item 22).  N keys are committed into one directory (10,000 puts a
commit), and the directory is then copied ``COPIES`` times:

* ``first copy`` -- the copy that walks the directory's tree objects;
* ``later copies`` -- the median of the others, which read only its top;
* ``one-key commit`` -- a plain commit's latency in the same instance, for scale.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.harness import RepContext, Sample, Workload, require_modules
from benchmarks.workloads import kvsops
from broker.handle import Handle

COPIES = 10
BATCH = 10_000


async def _timed_commit(h: Handle, ops: list[dict[str, Any]]) -> float:
    t0 = time.perf_counter()
    await kvsops.commit(h, ops)
    return (time.perf_counter() - t0) * 1e3


async def run_wcopy(ctx: RepContext) -> list[Sample]:
    n = ctx.n(100_000, 10_000)
    inst = await ctx.instance()
    h = await ctx.connect(inst, 0)
    await require_modules(h, "kvs")
    for start in range(0, n, BATCH):
        await kvsops.commit(h, [kvsops.put_op(f"big.k{i}", b"v%d" % i)
                                for i in range(start, min(n, start + BATCH))])
    src = (await kvsops.lookup(h, "big", flags=kvsops.TREEOBJ))["val"]  # a dirref
    ms = [await _timed_commit(h, [{"key": f"copy{i}", "flags": 0, "dirent": src}])
          for i in range(COPIES)]
    plain = statistics.median([await _timed_commit(h, [kvsops.put_op(f"one.k{i}", b"x")])
                               for i in range(20)])
    later = statistics.median(ms[1:])
    return [Sample("first copy", "latency", ms[0], "ms", "lower"),
            Sample("later copies", "latency", later, "ms", "lower"),
            Sample("one-key commit", "latency", plain, "ms", "lower"),
            Sample("first / later", "ratio", ms[0] / later, "x")]


WORKLOADS = [
    Workload("Wcopy", "copying a big directory: the first copy and the later ones",
             "N keys of a few bytes in one directory", run_wcopy),
]
