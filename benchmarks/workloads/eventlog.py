"""Wlog (a kvbroker extension, not in BENCHMARKS.md): one long eventlog.

A job's eventlog, or its output kept as eventlog lines, is one key that
grows by appends.  One client on rank 0 appends N lines of ~80 bytes
(each its own blob) to ``log.eventlog``, one commit each, while an
``APPEND`` watcher on the last rank follows it; then:

* ``block 1`` ... ``block 5`` -- the append rate over each fifth of the N
  appends, and ``block 5 / block 1`` (flat means an append costs the same
  at the end of a long log as at its start);
* ``watcher`` -- lines the watcher on the far rank had when the last
  append was answered, and how long after it had them all;
* ``directory blob`` -- the bytes of the blob of the log's directory at the
  end: what every append stores again (docs/protocol.md, ``valref`` and
  long values).
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.harness import RepContext, Sample, Workload, rate, require_modules
from benchmarks.workloads import kvsops

BLOCKS = 5
LINE = b'{"timestamp":%d.0,"name":"output","context":{"stream":"stdout","data":"%08d"}}\n'


async def run_wlog(ctx: RepContext) -> list[Sample]:
    per_block = max(1, ctx.n(10_000, 2_000) // BLOCKS)
    n = per_block * BLOCKS
    inst = await ctx.instance()
    h = await ctx.connect(inst, 0)
    far = await ctx.connect(inst, ctx.size - 1)
    await require_modules(h, "kvs", "kvs-watch")
    await kvsops.commit(h, [kvsops.put_op("log.eventlog", LINE % (0, 0))])
    stream = kvsops.watch(far, "log.eventlog", flags=kvsops.WATCH | kvsops.WATCH_APPEND)
    seen = 0
    all_seen = asyncio.get_running_loop().create_future()

    async def follow() -> None:
        nonlocal seen
        async for _ in stream:
            seen += 1
            if seen == n + 1 and not all_seen.done():
                all_seen.set_result(time.perf_counter())
                return

    follower = asyncio.ensure_future(follow())
    rates: list[float] = []
    for b in range(BLOCKS):
        t0 = time.perf_counter()
        for i in range(b * per_block + 1, (b + 1) * per_block + 1):
            await kvsops.commit(h, [kvsops.put_op("log.eventlog", LINE % (i, i),
                                                  flags=kvsops.APPEND)])
        rates.append(rate(per_block, time.perf_counter() - t0))
    ended = time.perf_counter()
    behind = n + 1 - seen
    try:
        caught_up = await asyncio.wait_for(all_seen, 120)
    finally:
        kvsops.cancel(far, stream)
        follower.cancel()
    dirref = (await kvsops.lookup(h, "log", flags=kvsops.TREEOBJ))["val"]
    blob = await h.rpc("content.load", {"blobref": dirref["data"][0]})
    out = [Sample(f"block {b + 1}", "rate", r, "appends/s") for b, r in enumerate(rates)]
    out += [Sample(f"block {BLOCKS} / block 1", "ratio", rates[-1] / rates[0], "x"),
            Sample("watcher", "lines behind at the end", behind, "lines", "lower"),
            Sample("watcher", "caught up after", (caught_up - ended) * 1e3, "ms", "lower"),
            Sample("directory blob", "bytes", len(blob["data"]), "bytes", "lower")]
    return out


WORKLOADS = [
    Workload("Wlog", "one eventlog growing by appends, followed by a watcher on the last rank",
             "~80-byte lines, one append a commit", run_wlog),
]
