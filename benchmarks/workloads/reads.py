"""W3: sequential ``kvs.lookup`` of one small JSON value, on rank 0 and rank 3."""

from __future__ import annotations

import errno
import json
import time

from benchmarks.harness import RepContext, Sample, Workload, rate, require_modules
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


WORKLOADS = [
    Workload("W3", "sequential kvs.lookup of one small value", f"{len(VALUE)}-byte JSON",
             run, ("kvs",)),
]
