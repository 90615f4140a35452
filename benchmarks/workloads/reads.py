"""W3: sequential ``kvs.lookup`` of one small JSON value, on rank 0 and rank 3.

W3c (a kvbroker extension, not in BENCHMARKS.md): the first read of a long
eventlog -- a value of one blob per appended line -- with none of its blobs
in memory on any rank (as after a restart), on the far rank and on rank 0,
then the same read again warm.  Every blob of a cold read travels up the
tree and back, so what it costs is the price of a blob's trip.
"""

from __future__ import annotations

import errno
import json
import time
from typing import Any

from benchmarks.harness import RepContext, Sample, Workload, far_rank, rate, require_modules
from benchmarks.workloads import kvsops
from broker.errors import RemoteError

KEY = "w3.key"
VALUE = json.dumps({"state": "run", "ranks": "0-3", "ntasks": 4}).encode()
WARMUP = 200


async def run(ctx: RepContext) -> list[Sample]:
    n = ctx.n(10_000, 2_000)
    inst = await ctx.instance()
    h0 = await ctx.connect(inst, 0)
    await require_modules(h0, "kvs")
    resp = await kvsops.commit(h0, [kvsops.put_op(KEY, VALUE)])
    ranks = [0] + ([3] if ctx.size >= 4 else [])
    if ctx.size < 4:
        ctx.note("size < 4: the rank-3 client is skipped")
    out = []
    for rank in ranks:
        h = h0 if rank == 0 else await ctx.connect(inst, rank)
        await kvsops.wait_version(h, resp["rootseq"])
        got = kvsops.value_of(await kvsops.lookup(h, KEY))
        if got != VALUE:
            raise RemoteError(errno.EIO, f"rank {rank}: {KEY} = {got!r}, wanted {VALUE!r}")
        lookup = kvsops.lookup
        for _ in range(WARMUP):
            await lookup(h, KEY)
        before = ctx.cpu_snapshot(inst)
        t0 = time.perf_counter()
        for _ in range(n):
            await lookup(h, KEY)
        out.append(Sample(f"rank{rank}", "rate", rate(n, time.perf_counter() - t0), "gets/s"))
        out.extend(ctx.cpu_samples(inst, f"rank{rank}", before, n))
    return out


LOG_KEY = "w3c.log"
LINE = b'{"timestamp":1700000000.5,"name":"progress","context":{"step":%d}}\n'
APPENDS_PER_COMMIT = 1000


async def _drop_caches(inst: Any, handles: list[Any]) -> None:
    """Nothing of the log in memory anywhere: rank 0 writes every blob to
    its file, then each rank drops its kvs and content caches."""
    await handles[0].rpc("content.flush", {})
    for h in handles:
        await h.rpc("kvs.dropcache", {})
        await h.rpc("content.dropcache", {})


async def run_cold(ctx: RepContext) -> list[Sample]:
    n = ctx.n(20_000, 2_000)
    inst = await ctx.instance()
    handles = [await ctx.connect(inst, r) for r in range(ctx.size)]
    h0 = handles[0]
    await require_modules(h0, "kvs")
    resp = None
    for first in range(0, n, APPENDS_PER_COMMIT):
        ops = [kvsops.put_op(LOG_KEY, LINE % i, kvsops.APPEND)
               for i in range(first, min(n, first + APPENDS_PER_COMMIT))]
        resp = await kvsops.commit(h0, ops)
    assert resp is not None
    want = b"".join(LINE % i for i in range(n))
    out = []
    for rank in dict.fromkeys((far_rank(ctx.size), 0)):
        h = handles[rank]
        await kvsops.wait_version(h, resp["rootseq"])
        await _drop_caches(inst, handles)
        for variant in (f"rank{rank} cold", f"rank{rank} warm"):
            before = ctx.cpu_snapshot(inst)
            t0 = time.perf_counter()
            got = kvsops.value_of(await kvsops.lookup(h, LOG_KEY))
            elapsed = time.perf_counter() - t0
            if got != want:
                raise RemoteError(errno.EIO, f"rank {rank}: {LOG_KEY} read back "
                                             f"{len(got or b'')} bytes, wanted {len(want)}")
            out.append(Sample(variant, "rate", rate(n, elapsed), "blobs/s"))
            out.append(Sample(variant, "wall", elapsed * 1e3, "ms", "lower"))
            out.extend(ctx.cpu_samples(inst, variant, before, n))
    return out


WORKLOADS = [
    Workload("W3", "sequential kvs.lookup of one small value", f"{len(VALUE)}-byte JSON",
             run),
    Workload("W3c", "first read of a long eventlog with no blob in memory, then again",
             f"{len(LINE % 0)}-byte lines, one blob each", run_cold),
]
