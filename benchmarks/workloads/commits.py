"""W2, W2s, W2p: KVS commit rates.

* W2 -- N sequential commits of one put each into one flat directory
  (``w2.seq.r<rank>.k<i>`` = ``str(i)``), client on rank 0 and on rank 3.
  The rate of each block of 500 commits is reported too (``b01``..``b10``
  at the standard 5,000) and last/first (``b10/b01``): a rate that falls as
  the directory grows means every commit rewrites the whole directory.  A
  run too short for two blocks of 500 (``--quick``, ``--n-iter``) is cut
  into tenths instead; the table header says which.
* W2s -- the same with keys spread over directories of 100 entries
  (``w2.sh.d<i//100>.k<i>``; the rank-3 client uses ``w2.sh-r3.d...``).
* W2p -- 8 client processes x N commits (one put each), all on rank 0, then
  spread over ranks 0-3; total commits/s, and the ratio to one sequential
  client measured in the same instance right before and after each
  8-client run (commit merging must pay); rank 0's commits per batch.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable

from benchmarks.harness import (
    RepContext,
    Sample,
    Settings,
    Workload,
    count,
    rate,
    reap,
    require_modules,
    spawn,
)
from benchmarks.workloads import kvsops
from broker.handle import Handle

BLOCK = 500
"""Commits per block, as the shared BENCHMARKS.md reports W2."""
W2_N, W2_QUICK_N = 5_000, 1_000
W2P_N = 1_000
WARMUP = 20
W2P_CLIENTS = 8


def block_sizes(n: int) -> list[int]:
    """How a run of ``n`` commits is cut into blocks, each with a rate of
    its own: blocks of :data:`BLOCK` commits when the run has at least two
    (the last one takes the remainder), else tenths of the run -- of which
    there are fewer, of one commit each, below 10 commits: no block is
    empty."""
    if n >= 2 * BLOCK:
        k = n // BLOCK
        return [BLOCK] * (k - 1) + [n - BLOCK * (k - 1)]
    tenths = [n * (b + 1) // 10 - n * b // 10 for b in range(10)]
    return [size for size in tenths if size]


def block_commits(n: int) -> float:
    """Commits per block of a run of ``n`` (:data:`BLOCK`, else a tenth's)."""
    return float(BLOCK) if n >= 2 * BLOCK else n / len(block_sizes(n))


def describe_blocks(n: int) -> str:
    """What the ``bNN`` rows of a run of ``n`` commits are (table header)."""
    sizes = block_sizes(n)
    rows = f"b01-b{len(sizes):02d}"
    if n >= 2 * BLOCK:
        rest = f", the last {sizes[-1]:,}" if sizes[-1] != BLOCK else ""
        return f"blocks {rows} of {BLOCK} commits{rest}"
    if n < 10:
        return f"blocks {rows} of one commit each (a run of {n})"
    return f"blocks {rows} are tenths of the run ({n:,} commits: fewer than two blocks of {BLOCK})"


def w2_payload(settings: Settings) -> str:
    return f"one put, str(i); {describe_blocks(count(settings, W2_N, W2_QUICK_N))}"


async def sequential_commits(h: Handle, keys: list[str]) -> tuple[float, list[float]]:
    """Commit ``keys`` one by one; total seconds and the rate of each block
    (:func:`block_sizes`)."""
    sizes = block_sizes(len(keys))
    bounds = set(itertools.accumulate(sizes))
    marks = [time.perf_counter()]
    commit, put_op = kvsops.commit, kvsops.put_op
    for i, key in enumerate(keys):
        await commit(h, [put_op(key, str(i).encode())])
        if i + 1 in bounds:
            marks.append(time.perf_counter())
    blocks = [rate(k, t1 - t0)
              for k, (t0, t1) in zip(sizes, itertools.pairwise(marks), strict=True)]
    return marks[-1] - marks[0], blocks


def block_samples(variant: str, blocks: list[float]) -> list[Sample]:
    """One rate per block and, with two blocks or more, last / first."""
    out = [Sample(f"{variant} b{b + 1:02d}", "rate", r, "commits/s")
           for b, r in enumerate(blocks)]
    if len(blocks) >= 2 and blocks[0] > 0:
        out.append(Sample(f"{variant} b{len(blocks):02d}/b01", "block_ratio",
                          blocks[-1] / blocks[0], "x"))
    return out


async def _warm(h: Handle, tag: str) -> None:
    for i in range(WARMUP):
        await kvsops.commit(h, [kvsops.put_op(f"w2.warm.{tag}.k{i}", b"x")])


async def _commit_series(ctx: RepContext, key: Callable[[int, int], str]) -> list[Sample]:
    n = ctx.n(W2_N, W2_QUICK_N)
    inst = await ctx.instance()
    h0 = await ctx.connect(inst, 0)
    await require_modules(h0, "kvs")
    ranks = [0] + ([3] if ctx.size >= 4 else [])
    if ctx.size < 4:
        ctx.note("size < 4: the rank-3 client is skipped")
    out = []
    for rank in ranks:
        h = h0 if rank == 0 else await ctx.connect(inst, rank)
        await _warm(h, f"r{rank}")
        before = ctx.cpu_snapshot(inst)
        elapsed, blocks = await sequential_commits(h, [key(rank, i) for i in range(n)])
        v = f"rank{rank}"
        cpu = ctx.cpu_samples(inst, v, before, n)
        out.append(Sample(v, "rate", rate(n, elapsed), "commits/s"))
        # (what the plot titles its block panel with: 500, or a tenth's)
        out.append(Sample(v, "block_size", block_commits(n), "commits", ""))
        out.extend(block_samples(v, blocks))
        out.extend(cpu)
    return out


async def run_w2(ctx: RepContext) -> list[Sample]:
    return await _commit_series(ctx, lambda rank, i: f"w2.seq.r{rank}.k{i}")


async def run_w2s(ctx: RepContext) -> list[Sample]:
    def key(rank: int, i: int) -> str:
        top = "w2.sh" if rank == 0 else f"w2.sh-r{rank}"
        return f"{top}.d{i // 100}.k{i}"

    return await _commit_series(ctx, key)


async def parallel_clients(ctx: RepContext, uris: list[str], n: int, prefix: str,
                           mode: str = "commit") -> tuple[float, int, str,
                                                          tuple[float, float, int]]:
    """Run one kvs_client process per URI (``mode`` commit or ping); (seconds,
    errors, first error, the clients' summed (user s, system s, context switches))."""
    procs = await asyncio.gather(*(
        spawn("benchmarks.workloads.kvs_client", uri, ctx.loop, str(n), f"{prefix}.c{j}",
              mode)
        for j, uri in enumerate(uris)))
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(b"go\n")
        await asyncio.gather(*(p.stdin.drain() for p in procs if p.stdin))
        lines = await asyncio.gather(*(p.stdout.readline() for p in procs if p.stdout))
    finally:
        await asyncio.gather(*(reap(p) for p in procs))
    if not all(lines):
        raise RuntimeError("a W2p client exited without a result (see its stderr above)")
    results = [json.loads(line) for line in lines]
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    errors = sum(r["errors"] for r in results)
    first = next((r["error"] for r in results if r["error"]), "")
    usage = (sum(r["user"] for r in results), sum(r["sys"] for r in results),
             sum(r["ctxsw"] for r in results))
    return end - start, errors, first, usage


async def _batches(h0: Handle) -> int:
    """How many batches of transactions rank 0's kvs has applied."""
    return int((await h0.rpc("kvs.stats-get", nodeid=0))["counts"]["batches"])


async def run_w2p(ctx: RepContext) -> list[Sample]:
    n = ctx.n(W2P_N, 200)
    ops = W2P_CLIENTS * n
    inst = await ctx.instance()
    h0 = await ctx.connect(inst, 0)
    await require_modules(h0, "kvs")
    await _warm(h0, "p")
    spread = min(4, ctx.size)
    # The reference first: the same 8 client processes making broker.ping
    # RPCs to rank 0 -- what the broker and the clients alone cost, so the
    # commit rows show what the KVS adds (docs/performance.md).
    variants = [("ping r0", [inst.uri(0)] * W2P_CLIENTS, "ping"),
                ("all r0", [inst.uri(0)] * W2P_CLIENTS, "commit")]
    if spread > 1:
        variants.append((f"spread r0-{spread - 1}",
                         [inst.uri(j % spread) for j in range(W2P_CLIENTS)], "commit"))

    # The ratios' base, one client, is measured right before and right after
    # each 8-client commit run, and the ratio is to the mean of the two: this
    # machine's speed drifts by tens of percent within a minute, and a single
    # 0.4 s measurement on one side made the ratio swing with it.
    bases: list[float] = []

    async def one_client() -> None:
        keys = [f"w2p.base{len(bases)}.k{i}" for i in range(n)]
        bases.append(rate(n, (await sequential_commits(h0, keys))[0]))

    out: list[Sample] = []
    for name, uris, mode in variants:
        if mode == "commit" and not bases:
            await one_client()
        label = f"{W2P_CLIENTS} clients {name}"
        batches_before = await _batches(h0)
        before = ctx.cpu_snapshot(inst)
        elapsed, errors, first, (user, sys_, switches) = await parallel_clients(
            ctx, uris, n, f"w2p.{name.split()[0]}", mode)
        cpu = ctx.cpu_samples(inst, label, before, ops)
        batches = await _batches(h0) - batches_before
        if errors:
            ctx.note(f"W2p {name}: {errors} requests failed, first: {first}")
        # (in the records too: a rate over fewer commits is not the same figure)
        out.append(Sample(label, "errors", float(errors), "requests", ""))
        total = rate(ops - errors, elapsed)
        if mode == "ping":
            out.append(Sample(label, "rate", total, "rpcs/s"))
        else:
            await one_client()
            out.append(Sample(label, "rate", total, "commits/s"))
            out.append(Sample(f"{label} / 1 client", "ratio",
                              total / ((bases[-2] + bases[-1]) / 2), "x"))
            # what merging did: the commits (every one of them, relayed
            # ones too, is applied on rank 0) per batch rank 0 applied
            out.append(Sample(label, "commits_per_batch", (ops - errors) / max(batches, 1),
                              "commits", ""))
        # Where the two cores go: each rank, and the 8 client processes summed
        # (this process only waits, so its own ``client`` column is dropped).
        out.extend(s for s in cpu if not s.metric.endswith(":client"))
        out.append(Sample(label, "user_us:clients", user / ops * 1e6, "us/op", "lower"))
        out.append(Sample(label, "sys_us:clients", sys_ / ops * 1e6, "us/op", "lower"))
        out.append(Sample(label, "ctxsw:clients", switches / ops, "switches/op", "lower"))
    head = [Sample("1 client r0", "rate", sum(bases) / len(bases), "commits/s")]
    head += [Sample(f"1 client r0 run {k + 1}", "rate", b, "commits/s", "")
             for k, b in enumerate(bases)]
    return head + out


WORKLOADS = [
    Workload("W2", "sequential commits (one put each) into one flat directory",
             w2_payload, run_w2, count=W2_N),
    Workload("W2s", "sequential commits, keys spread over directories of 100",
             w2_payload, run_w2s, count=W2_N),
    Workload("W2p", f"{W2P_CLIENTS} client processes committing concurrently",
             "one put, str(i)", run_w2p, count=W2P_N),
]
