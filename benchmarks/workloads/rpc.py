"""W1 (RPC round trips) and W1b (RPC echo bandwidth, KVS put/get of big values)."""

from __future__ import annotations

import asyncio
import errno
import json
import struct
import time
from typing import Any

from benchmarks.harness import (
    RepContext,
    Sample,
    Settings,
    Workload,
    fmt_size,
    rate,
    reap,
    require_modules,
    spawn,
)
from benchmarks.workloads import kvsops, w0_raw
from broker.errors import RemoteError
from broker.handle import Handle

WARMUP = 200
YARDSTICKS = ("zmq-blocking", "zmq-asyncio")
W1B_SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)
W1B_QUICK_SIZES = (1 << 10, 64 << 10, 1 << 20)
MiB = float(1 << 20)


async def ping_loop(h: Handle, rank: int, n: int, payload: dict[str, Any] | None = None) -> float:
    """Seconds for ``n`` sequential ``broker.ping`` RPCs to ``rank``."""
    body = payload if payload is not None else {}
    rpc = h.rpc
    t0 = time.perf_counter()
    for _ in range(n):
        await rpc("broker.ping", body, nodeid=rank)
    return time.perf_counter() - t0


async def sync_pings(uri: str, n: int, loop: str) -> float:
    """Seconds for ``n`` ``broker.ping`` RPCs to the local rank through the
    blocking facade (:mod:`broker.sync`), made by a script: its own process,
    main thread (:mod:`benchmarks.workloads.sync_client`)."""
    proc = await spawn("benchmarks.workloads.sync_client", uri, loop, str(n))
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
    finally:
        await reap(proc)
    return float(json.loads(line)["elapsed"])


W1_N = 10_000


async def run_w1(ctx: RepContext) -> list[Sample]:
    n = ctx.n(W1_N, 2_000)
    inst = await ctx.instance()
    h = await ctx.connect(inst, 0)
    targets = [0] + ([3] if ctx.size >= 4 else [])
    if ctx.size < 4:
        ctx.note("size < 4: the rank-3 variant is skipped")
    rates = {}
    yard: dict[str, float] = {}
    cpu: list[Sample] = []
    for rank in targets:
        await ping_loop(h, rank, WARMUP)
        before = ctx.cpu_snapshot(inst)
        rates[rank] = rate(n, await ping_loop(h, rank, n))
        cpu.extend(ctx.cpu_samples(inst, f"rank{rank}", before, n))
        if rank == 0:
            # The W0 yardsticks, measured right here so that the ratio the
            # target is about compares figures taken at the same moment.
            for mode in YARDSTICKS:
                yard[mode] = rate(n, await w0_raw.round_trips(mode, n, ctx.loop))
            # A script's view: the blocking facade, in a process of its own.
            blocking = rate(n, await sync_pings(inst.uri(0), n, ctx.loop))
    out = [Sample(f"rank{r}", "rate", v, "rt/s") for r, v in rates.items()]
    out.append(Sample("rank0 sync facade", "rate", blocking, "rt/s"))
    out.append(Sample("sync/async", "ratio", blocking / rates[0], "x"))
    for mode, v in yard.items():
        out.append(Sample(f"W0 {mode}", "rate", v, "rt/s"))
        out.append(Sample(f"rank0/{mode}", "ratio", rates[0] / v, "x"))
    if 3 in rates:
        # Time per RPC through the tree (0->1->3 and back) over a local one,
        # and what one hop adds, in units of a local RPC.
        hops = topology_hops(3, ctx.fanout)
        t0, t3 = 1 / rates[0], 1 / rates[3]
        out.append(Sample("rank3/rank0", "cost_ratio", t3 / t0, "x", "lower"))
        out.append(Sample("per hop/local", "hop_cost", (t3 - t0) / hops / t0, "x", "lower"))
    return out + cpu


def topology_hops(rank: int, fanout: int) -> int:
    """Overlay hops between rank 0 and ``rank``."""
    hops = 0
    while rank:
        rank = (rank - 1) // fanout
        hops += 1
    return hops


def w1b_sizes(settings: Settings) -> list[int]:
    if settings.msg_sizes:
        return list(settings.msg_sizes)
    return list(W1B_QUICK_SIZES if settings.quick else W1B_SIZES)


def w1b_payload(settings: Settings) -> str:
    return "{data: bytes} of " + ",".join(fmt_size(s) for s in w1b_sizes(settings))


def w1b_iters(ctx: RepContext, size: int) -> int:
    if ctx.settings.n_iter:
        return ctx.settings.n_iter
    if ctx.quick:
        return max(4, min(300, (8 << 20) // size))
    return max(8, min(2000, (256 << 20) // size))


def _unique(base: bytes, i: int) -> bytes:
    """``base`` with its first bytes replaced by ``i`` (content stores dedup)."""
    tag = struct.pack("<Q", i)
    return tag[: len(base)] + base[len(tag):]


async def run_w1b(ctx: RepContext) -> list[Sample]:
    inst = await ctx.instance()
    h = await ctx.connect(inst, 0)
    sizes = w1b_sizes(ctx.settings)
    targets = [0] + ([3] if ctx.size >= 4 and not ctx.quick else [])
    out: list[Sample] = []
    for size in sizes:
        n = w1b_iters(ctx, size)
        payload = {"data": bytes(size)}
        for rank in targets:
            await ping_loop(h, rank, 2, payload)
            elapsed = await ping_loop(h, rank, n, payload)
            label = f"echo {fmt_size(size)} r{rank}"
            out.append(Sample(label, "bandwidth", size * n / elapsed / MiB, "MiB/s"))
            out.append(Sample(label, "latency", elapsed / n * 1e6, "us", "lower"))
    try:
        await require_modules(h, "kvs")
    except Exception as exc:  # Skip, or an old broker without module.list
        ctx.note(f"KVS put/get skipped: {exc}")
        return out
    for size in sizes:
        out.extend(await _kvs_put_get(h, size, w1b_iters(ctx, size)))
    return out


async def _kvs_put_get(h: Handle, size: int, n: int) -> list[Sample]:
    base = bytes(range(256)) * (size // 256) + bytes(size % 256)
    put_time = 0.0
    key = ""
    for i in range(n + 1):  # the first put is a warm-up
        key = f"w1b.s{size}.k{i}"
        value = _unique(base, i)
        t0 = time.perf_counter()
        await kvsops.commit(h, [kvsops.put_op(key, value)])
        if i:
            put_time += time.perf_counter() - t0
    got = kvsops.value_of(await kvsops.lookup(h, key))
    if got is None or len(got) != size:
        raise RemoteError(errno.EIO, f"kvs.lookup of {key} returned "
                          f"{'nothing' if got is None else len(got)} bytes, wanted {size}")
    t0 = time.perf_counter()
    for _ in range(n):
        await kvsops.lookup(h, key)
    get_time = time.perf_counter() - t0
    label = f"kvs {fmt_size(size)} r0"
    return [
        Sample(label, "put_bw", size * n / put_time / MiB, "MiB/s"),
        Sample(label, "get_bw", size * n / get_time / MiB, "MiB/s"),
    ]


WORKLOADS = [
    Workload("W1", "sequential broker.ping RPCs from a client on rank 0",
             "{} (empty map)", run_w1, count=W1_N),
    Workload("W1b", "RPC echo bandwidth (broker.ping {data: bytes}); KVS put/get of values",
             w1b_payload, run_w1b),
]
