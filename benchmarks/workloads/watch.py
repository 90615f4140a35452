"""W4: watch latency -- a writer on rank 0, a watcher on rank 3.

The watcher streams ``kvs-watch.lookup`` ``{key: w4.key, flags: WATCH}``.
N times the writer commits a new value and the clock runs until the
watcher's stream yields that value: latency = receipt - commit sent.
"""

from __future__ import annotations

import asyncio
import errno
import time

from benchmarks.harness import (
    RepContext,
    Sample,
    Workload,
    far_rank,
    kvs_near_and_far,
    percentile,
)
from benchmarks.workloads import kvsops
from broker.errors import RemoteError

KEY = "w4.key"
WAIT = 10.0
N = 1_000


async def run(ctx: RepContext) -> list[Sample]:
    n = ctx.n(N, 200)
    inst, writer, watcher, watch_rank = await kvs_near_and_far(ctx)
    resp = await kvsops.commit(writer, [kvsops.put_op(KEY, b"init")])
    await kvsops.wait_version(watcher, resp["rootseq"])
    stream = kvsops.watch(watcher, KEY)
    first = await asyncio.wait_for(stream.next_message(), WAIT)
    if first is None:
        raise RemoteError(errno.ENODATA, "watch ended before its first answer")
    stale = 0
    lat: list[float] = []
    before = ctx.cpu_snapshot(inst)
    for i in range(n):
        want = str(i).encode()
        t0 = time.perf_counter()
        fut = kvsops.commit(writer, [kvsops.put_op(KEY, want)])
        while True:
            msg = await asyncio.wait_for(stream.next_message(), WAIT)
            t1 = time.perf_counter()
            if msg is None:
                raise RemoteError(errno.ENODATA, "watch ended early")
            if kvsops.value_of(msg.payload) == want:
                break
            stale += 1
        lat.append((t1 - t0) * 1e3)
        await fut
    cpu = ctx.cpu_samples(inst, f"r0->r{watch_rank}", before, n)
    kvsops.cancel(watcher, stream)
    while await asyncio.wait_for(stream.next_message(), WAIT) is not None:
        pass
    if stale:
        ctx.note(f"the watcher saw {stale} answer(s) other than the value just written")
    v = f"r0->r{watch_rank}"
    return [
        Sample(v, "p50", percentile(lat, 50), "ms", "lower"),
        Sample(v, "p99", percentile(lat, 99), "ms", "lower"),
        Sample(v, "mean", sum(lat) / len(lat), "ms", "lower"),
        *cpu,
    ]


WORKLOADS = [
    Workload("W4", lambda s: f"watch latency, writer on rank 0 -> watcher on rank "
                       f"{far_rank(s.size)}",
             "str(i) value", run, count=N),
]
