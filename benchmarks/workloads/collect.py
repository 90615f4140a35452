"""Wgc (a kvbroker extension, not in BENCHMARKS.md): online garbage collection.

W2's traffic leaves the most garbage per commit (each one rewrites a shard
of a 5,000-key directory and the root), so the store is filled that way:
N sequential commits into one flat directory, in an instance with
``kvs.gc-grace=0`` (nothing is spared for being recent).  Then:

* ``gc idle`` -- one ``kvs.gc`` with nothing else running: its seconds,
  and blobs removed per second;
* ``commits`` / ``commits during gc`` -- one client's sequential commit
  rate alone, and while a collection of as much garbage again runs on
  rank 0 (their ratio is what a collection costs the writers; the gc's
  own seconds under that load are reported too).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.harness import RepContext, Sample, Workload, rate, require_modules
from benchmarks.workloads import kvsops
from benchmarks.workloads.commits import sequential_commits
from broker.handle import Handle


async def _gc(h: Handle) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    result = await h.rpc("kvs.gc", {})
    return time.perf_counter() - t0, result


async def _fill(h: Handle, n: int, tag: str) -> None:
    commit, put_op = kvsops.commit, kvsops.put_op
    for i in range(n):
        await commit(h, [put_op(f"gc.{tag}.k{i}", str(i).encode())])


async def run_wgc(ctx: RepContext) -> list[Sample]:
    n = ctx.n(5_000, 1_000)
    probe = ctx.n(1_000, 300)
    inst = await ctx.instance(attrs={"kvs.gc-grace": "0"})
    h = await ctx.connect(inst, 0)
    h_gc = await ctx.connect(inst, 0)
    await require_modules(h, "kvs")
    await _fill(h, n, "a")
    seconds, idle = await _gc(h_gc)
    out = [Sample("gc idle", "seconds", seconds, "s", "lower"),
           Sample("gc idle", "removed", idle["removed"], "blobs"),
           Sample("gc idle", "rate", rate(idle["removed"], seconds), "blobs/s")]

    elapsed, _ = await sequential_commits(h, [f"gc.alone.k{i}" for i in range(probe)])
    alone = rate(probe, elapsed)
    await _fill(h, n, "b")  # as much garbage again
    gc_task = asyncio.ensure_future(_gc(h_gc))
    elapsed, _ = await sequential_commits(h, [f"gc.during.k{i}" for i in range(probe)])
    during = rate(probe, elapsed)
    loaded_seconds, loaded = await gc_task
    if not gc_task.done() or loaded_seconds > elapsed:
        ctx.note("the collection outlasted the commits measured during it")
    out += [Sample("commits", "rate", alone, "commits/s"),
            Sample("commits during gc", "rate", during, "commits/s"),
            Sample("commits during gc / alone", "ratio", during / alone, "x"),
            Sample("gc under commits", "seconds", loaded_seconds, "s", "lower"),
            Sample("gc under commits", "removed", loaded["removed"], "blobs")]
    return out


WORKLOADS = [
    Workload("Wgc", "online kvs gc after W2-like commits; commits while it runs",
             "one put, str(i)", run_wgc),
]
