"""W5 and W5x: the job-like namespace lifecycle, alone and among many live ones.

One lifecycle (docs/protocol.md, KVS and kvs-watch):

1. ``kvs.namespace-create {namespace: w5-<i>, owner: uid}`` (rank 0);
2. a WAITCREATE watch ``kvs-watch.lookup {key: eventlog, flags: WATCH|WAITCREATE}``
   from the watcher's rank (rank 3 is the headline variant, rank 0 the other);
3. one commit of 3 ops: put ``jobspec``, put ``R``, APPEND a line to ``eventlog``;
4. the watcher receives the eventlog;
5. ``kvs-watch.cancel {matchtag}`` on the watcher's handle; the stream ends;
6. ``kvs.namespace-remove``.

W5x repeats W5 while 1K, 4K, 16K and 64K other namespaces stay alive, each
with one idle WAITCREATE watcher on rank 3, and reports the rate at each
level, its ratio to the first level, each rank's peak RSS at each level, and
the memory each extra live namespace (+ watcher) costs per rank, in bytes.

W5r (a kvbroker extension) is the job shell's first read: the namespace
created and W5's commit made on rank 0, then ``jobspec`` and ``R`` looked
up on rank 3, which has not loaded the namespace (it asks rank 0 for the
root; the blobs came with the setroot it heard).  It reports the two
lookups' latency and the blobs rank 3 fetched from rank 0 per read.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import time

from benchmarks.harness import (
    RepContext,
    Sample,
    Workload,
    current_rss_mb,
    far_rank,
    kvs_near_and_far,
    percentile,
    rate,
)
from benchmarks.workloads import kvsops
from broker.errors import RemoteError
from broker.handle import Handle, Stream

WAIT = 10.0
JOBSPEC = json.dumps({"version": 1, "resources": [{"type": "slot", "count": 1,
                      "with": [{"type": "core", "count": 1}]}],
                      "tasks": [{"command": ["true"], "slot": "task",
                                 "count": {"per_slot": 1}}],
                      "attributes": {"system": {"duration": 0}}}).encode()
R_OBJ = json.dumps({"version": 1, "execution": {"R_lite": [
    {"rank": "0", "children": {"core": "0"}}], "starttime": 0, "expiration": 0}}).encode()
N = 1_024  # lifecycles (W5, each level of W5x, W5r)
W5X_LEVELS = (1024, 4096, 16384, 65536)
W5X_QUICK_LEVELS = (64, 256, 1024)
CREATE_WINDOW = 64
SETTLE_TOPIC = "w5x.settled"
SETTLE_TIMEOUT = 120.0
SETTLE_POLL = 0.05  # seconds between two looks at kvs-watch's stats while it catches up


def eventlog_line(name: str) -> bytes:
    return (json.dumps({"timestamp": time.time(), "name": name, "context": {}}) + "\n").encode()


async def lifecycle(h0: Handle, hw: Handle, ns: str, uid: int) -> None:
    """One job-like namespace lifecycle (see the module docstring)."""
    await h0.rpc("kvs.namespace-create", {"namespace": ns, "owner": uid})
    stream = kvsops.watch(hw, "eventlog", ns, kvsops.WATCH | kvsops.WAITCREATE)
    line = eventlog_line("submit")
    await kvsops.commit(h0, [
        kvsops.put_op("jobspec", JOBSPEC),
        kvsops.put_op("R", R_OBJ),
        kvsops.put_op("eventlog", line, kvsops.APPEND),
    ], namespace=ns)
    msg = await asyncio.wait_for(stream.next_message(), WAIT)
    if msg is None:
        raise RemoteError(errno.ENODATA, f"{ns}: watch ended before the eventlog arrived")
    got = kvsops.value_of(msg.payload)
    if got is None or not got.startswith(line):
        raise RemoteError(errno.EIO, f"{ns}: watcher got {got!r}, wanted the eventlog line")
    await end_watch(hw, stream)
    await h0.rpc("kvs.namespace-remove", {"namespace": ns})


async def end_watch(h: Handle, stream: Stream) -> None:
    kvsops.cancel(h, stream)
    while await asyncio.wait_for(stream.next_message(), WAIT) is not None:
        pass


async def lifecycles(h0: Handle, hw: Handle, names: list[str]) -> float:
    """Seconds for sequential lifecycles of ``names``."""
    uid = os.getuid()
    t0 = time.perf_counter()
    for ns in names:
        await lifecycle(h0, hw, ns, uid)
    return time.perf_counter() - t0


async def run_w5(ctx: RepContext) -> list[Sample]:
    n = ctx.n(N, 128)
    inst, h0, hw, watch_rank = await kvs_near_and_far(ctx)
    await lifecycles(h0, hw, [f"w5-warm-{i}" for i in range(16)])
    out = []
    base = 0
    # the headline variant first: watcher on rank 3; then the watcher on rank 0
    for rank, handle in [(watch_rank, hw)] + ([(0, h0)] if watch_rank else []):
        names = [f"w5-{base + i}" for i in range(n)]
        base += n
        before = ctx.cpu_snapshot(inst)
        elapsed = await lifecycles(h0, handle, names)
        out.append(Sample(f"watch r{rank}", "rate", rate(n, elapsed), "ns/s"))
        out.extend(ctx.cpu_samples(inst, f"watch r{rank}", before, n))
    return out


async def add_idle(h0: Handle, hw: Handle, start: int, stop: int,
                   streams: list[Stream]) -> None:
    """Create namespaces ``w5x-idle-<k>`` and one idle WAITCREATE watcher in each."""
    uid = os.getuid()

    async def one(k: int) -> None:
        ns = f"w5x-idle-{k}"
        await h0.rpc("kvs.namespace-create", {"namespace": ns, "owner": uid})
        streams.append(kvsops.watch(hw, "eventlog", ns, kvsops.WATCH | kvsops.WAITCREATE))

    await kvsops.window((one(k) for k in range(start, stop)), CREATE_WINDOW)
    await settle(h0, hw)


async def settle(h0: Handle, hw: Handle) -> None:
    """Wait until the watchers' rank has caught up with the set-up, so the
    level's timing measures W5 among the live namespaces, not the tail of
    their creation.  At 64K the ``created`` events and the watchers' first
    lookups were still being handled on rank 3 seconds after the last
    create returned (~20K events and ~23K lookups inside the timed part).

    First every event published so far: a marker published after them
    reaches ``hw``'s client only once rank 3 has routed them (events keep
    their order, and a rank's modules take each event as it is routed).
    Then kvs-watch's own work: no monitor waiting for its first root and
    no ``kvs.lookup`` in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT
    await hw.subscribe(SETTLE_TOPIC)
    try:
        seq = await h0.publish(SETTLE_TOPIC, {})
        while True:
            ev = await asyncio.wait_for(hw.recv_event(), deadline - loop.time())
            if ev.topic == SETTLE_TOPIC and ev.seq >= seq:
                break
    finally:
        await hw.unsubscribe(SETTLE_TOPIC)
    while True:
        st = await hw.rpc("kvs-watch.stats-get")
        if st["monitors-starting"] == 0 and st["lookups-in-flight"] == 0:
            return
        if loop.time() > deadline:
            raise TimeoutError(f"kvs-watch on the watchers' rank still busy after "
                               f"{SETTLE_TIMEOUT:.0f}s: {st['monitors-starting']} monitors "
                               f"starting, {st['lookups-in-flight']} lookups in flight")
        await asyncio.sleep(SETTLE_POLL)


async def full_collections(h: Handle, size: int) -> list[int]:
    """Each rank's count of full (generation 2) garbage collections so far.

    A full collection of a big heap stops a rank for a noticeable part of a
    level's ~1 s of lifecycles, so W5x notes how many fell inside each one."""
    return [int((await h.rpc("broker.stats-get", nodeid=r))["gc"]["collections"][2])
            for r in range(size)]


def _label(level: int) -> str:
    return f"{level // 1024}K" if level % 1024 == 0 else str(level)


async def run_w5x(ctx: RepContext) -> list[Sample]:
    levels = W5X_QUICK_LEVELS if ctx.quick else W5X_LEVELS
    n = ctx.n(N, 64)
    inst, h0, hw, _ = await kvs_near_and_far(ctx)
    await lifecycles(h0, hw, [f"w5x-warm-{i}" for i in range(16)])
    streams: list[Stream] = []
    out: list[Sample] = []
    rates: dict[int, float] = {}
    rss_at: dict[int, dict[str, float]] = {}
    live = 0
    for level in levels:
        try:
            t0 = time.perf_counter()
            await add_idle(h0, hw, live, level, streams)
            live = level
            ctx.note(f"{_label(level)} idle namespaces + watchers set up in "
                     f"{time.perf_counter() - t0:.1f}s")
            names = [f"w5x-{level}-{i}" for i in range(n)]
            gc_before = await full_collections(h0, ctx.size)
            before = ctx.cpu_snapshot(inst)
            rates[level] = rate(n, await lifecycles(h0, hw, names))
            cpu = ctx.cpu_samples(inst, f"{_label(level)} live", before, n)
            gc_after = await full_collections(h0, ctx.size)
            ctx.note(f"{_label(level)} level: full collections while timed, by rank: "
                     + " ".join(f"r{r}={gc_after[r] - gc_before[r]}"
                                for r in range(ctx.size)))
        except Exception as exc:
            ctx.note(f"W5x level {_label(level)} failed: {exc!r}")
            break
        rss_at[level] = {str(r): mb for r, pid in enumerate(inst.pids())
                         if (mb := current_rss_mb(pid)) is not None}
        v = f"{_label(level)} live"
        out.append(Sample(v, "rate", rates[level], "ns/s", rss_mb=ctx.rss_now(inst)))
        out.extend(cpu)
        if level != levels[0] and levels[0] in rates:
            out.append(Sample(f"{_label(level)}/{_label(levels[0])}", "ratio",
                              rates[level] / rates[levels[0]], "x"))
    top = levels[-1]
    out.append(Sample(f"{_label(top)} level", "completed", float(top in rates), "bool"))
    done = [lv for lv in levels if lv in rss_at]
    if len(done) >= 2:
        lo, hi = done[0], done[-1]
        for rank in rss_at[hi]:
            grown = (rss_at[hi][rank] - rss_at[lo].get(rank, 0.0)) * (1 << 20)
            out.append(Sample(f"mem r{rank} per live ns", "bytes", grown / (hi - lo), "B",
                              "lower"))
    return out


async def run_w5r(ctx: RepContext) -> list[Sample]:
    n = ctx.n(N, 128)
    inst, h0, hr, read_rank = await kvs_near_and_far(ctx)
    uid = os.getuid()
    lat: list[float] = []

    async def one(ns: str, timed: bool) -> None:
        await h0.rpc("kvs.namespace-create", {"namespace": ns, "owner": uid})
        # (each job's eventlog line has its time: each root directory is new)
        await kvsops.commit(h0, [
            kvsops.put_op("jobspec", JOBSPEC), kvsops.put_op("R", R_OBJ),
            kvsops.put_op("eventlog", eventlog_line("submit"), kvsops.APPEND)], namespace=ns)
        t0 = time.perf_counter()
        got = [kvsops.value_of(await kvsops.lookup(hr, key, ns)) for key in ("jobspec", "R")]
        if timed:
            lat.append((time.perf_counter() - t0) * 1e3)
        if got != [JOBSPEC, R_OBJ]:
            raise RemoteError(errno.EIO, f"{ns}: rank {read_rank} read {got!r}")
        await h0.rpc("kvs.namespace-remove", {"namespace": ns})

    for i in range(16):
        await one(f"w5r-warm-{i}", False)
    fetched = (await hr.rpc("kvs.stats-get"))["counts"]["blob-fetches"]
    before = ctx.cpu_snapshot(inst)
    for i in range(n):
        await one(f"w5r-{i}", True)
    cpu = ctx.cpu_samples(inst, f"read r{read_rank}", before, n)
    fetched = (await hr.rpc("kvs.stats-get"))["counts"]["blob-fetches"] - fetched
    v = f"read r{read_rank}"
    return [
        Sample(v, "p50", percentile(lat, 50), "ms", "lower"),
        Sample(v, "p99", percentile(lat, 99), "ms", "lower"),
        Sample(v, "fetches", fetched / n, "blobs/read", "lower"),
        *cpu,
    ]


WORKLOADS = [
    Workload("W5", "job-like namespace lifecycle (create, watch, commit, cancel, remove)",
             "jobspec + R + 1 eventlog line", run_w5, count=N),
    Workload("W5x", "W5 while 1K..64K other namespaces with idle watchers stay alive",
             "as W5", run_w5x, count=N),
    Workload("W5r", lambda s: f"job read: create + commit on rank 0, first lookups on rank "
                        f"{far_rank(s.size)}",
             "as W5; lookups of jobspec and R", run_w5r, count=N),
]
