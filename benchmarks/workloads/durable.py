"""Wsync (a kvbroker extension, not in BENCHMARKS.md): SYNC commits beside load.

A ``SYNC`` commit on rank 0 with a statedir is answered once its blobs and a
checkpoint naming its root are written to SQLite and synced.  That work runs
on rank 0's SQLite thread, which a busy event loop can keep from the GIL
(``broker/content/storethread.py``), so the figure to watch is its latency
while something else keeps rank 0 busy.  One instance of one rank, with a
statedir:

* ``alone`` -- N sequential ``SYNC`` commits of one small put: latency
  p50 and p90;
* ``beside churn`` -- the same while a second connection of the runner
  churns namespaces as fast as it can (create, one commit of a 3,000-byte
  value, remove: W5's lifecycle without a watcher): the ``SYNC`` latencies,
  the churn's namespaces/s, and the GIL turns rank 0's loop gave its SQLite
  thread meanwhile (``kvbroker stats content``: ``sqlite-thread``).
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.harness import RepContext, Sample, Workload, percentile
from benchmarks.workloads import kvsops
from broker.handle import Handle


async def _sync_commits(h: Handle, n: int, tag: str) -> list[float]:
    """Seconds each of ``n`` sequential SYNC commits took."""
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        await kvsops.commit(h, [kvsops.put_op(f"sync.{tag}.k{i}", str(i).encode())],
                            flags=kvsops.SYNC)
        lat.append(time.perf_counter() - t0)
    return lat


async def _churn(h: Handle, stop: asyncio.Event) -> int:
    """Namespace lifecycles until ``stop``; how many."""
    n = 0
    value = b"x" * 3000
    while not stop.is_set():
        name = f"churn-{n}"
        await h.rpc("kvs.namespace-create", {"namespace": name})
        await kvsops.commit(h, [kvsops.put_op("x", value)], namespace=name)
        await h.rpc("kvs.namespace-remove", {"namespace": name})
        n += 1
    return n


def _latencies(variant: str, lat: list[float]) -> list[Sample]:
    ms = sorted(x * 1e3 for x in lat)
    return [Sample(variant, "p50", percentile(ms, 50), "ms", "lower"),
            Sample(variant, "p90", percentile(ms, 90), "ms", "lower")]


async def _turns(h: Handle) -> int:
    """(0 from a rank older than the turns: an A/B against one)"""
    stats = await h.rpc("content.stats-get", {})
    return int(stats.get("sqlite-thread", {}).get("turns", 0))


SIZE = 1  # (what it measures is rank 0's own: its loop and its SQLite thread)


async def run_wsync(ctx: RepContext) -> list[Sample]:
    n = ctx.n(300, 50)
    ctx.note("one rank (size 1), with a statedir; --size does not apply")
    inst = await ctx.instance(size=SIZE, statedir=str(ctx.logdir / f"Wsync-{ctx.loop}-{ctx.rep}"))
    h = await ctx.connect(inst, 0)
    churner = await ctx.connect(inst, 0)
    await _sync_commits(h, 5, "warm")
    out = _latencies("alone", await _sync_commits(h, n, "alone"))

    turns0 = await _turns(h)
    stop = asyncio.Event()
    churn = asyncio.create_task(_churn(churner, stop))
    t0 = time.perf_counter()
    try:
        lat = await _sync_commits(h, n, "churn")
    finally:
        stop.set()
        lifecycles = await churn
    elapsed = time.perf_counter() - t0
    out += _latencies("beside churn", lat)
    out.append(Sample("beside churn", "churn", lifecycles / elapsed, "namespaces/s"))
    out.append(Sample("beside churn", "turns", await _turns(h) - turns0, "turns", ""))
    return out


WORKLOADS = [
    Workload("Wsync", "SYNC commits on rank 0, alone and beside a client churning namespaces",
             "one put, SYNC; churn: create, 3,000-byte put, remove", run_wsync, size=SIZE),
]
