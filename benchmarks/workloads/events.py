"""W6: event throughput from a publisher on rank 0 to a subscriber on rank 3.

The subscriber subscribes ``test.x`` on rank 3 (or the highest rank below
4 when the instance is smaller); the publisher sends N events ``test.x``
``{seq: i}`` with ``publish_nowait`` (no acks), in bursts with a yield in
between so the subscriber's handle gets to read.  Rate = N / (last receipt
- first publish).  Every event must arrive, in order: losses, reorders and
gaps in the broker's global ``seq`` are reported as their own figures, and
so is each process's CPU time per event (the instance is CPU-bound on a
small machine: the sum over processes bounds the rate).
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.harness import RepContext, Sample, Workload, far_rank, rate

TOPIC = "test.x"
BURST = 256
IDLE_TIMEOUT = 10.0  # seconds without an event after which the rest are lost
N = 10_000


async def run(ctx: RepContext) -> list[Sample]:
    n = ctx.n(N, N)
    inst = await ctx.instance()
    sub_rank = far_rank(ctx.size)
    sub = await ctx.connect(inst, sub_rank)
    pub = await ctx.connect(inst, 0)
    await sub.subscribe(TOPIC)
    # warm-up: one acknowledged event, so the path is up when timing starts
    await pub.publish(TOPIC, {"seq": -1})
    first = await asyncio.wait_for(sub.recv_event(), IDLE_TIMEOUT)
    last_seq = first.seq

    received = 0
    misordered = 0
    last_payload = -1
    gaps = 0
    t_last = 0.0

    async def consume() -> None:
        # one deadline for the whole run: no per-event wait_for (a task each)
        nonlocal received, misordered, gaps, t_last, last_seq, last_payload
        recv = sub.recv_event
        while received < n:
            ev = await recv()
            t_last = time.perf_counter()
            if ev.topic != TOPIC:
                continue
            # (one that does not come after the last one's: compared with
            # the count, one lost event -- a gap, counted below -- made
            # every one after it count as misordered)
            seq = ev.payload.get("seq")
            if not isinstance(seq, int) or seq <= last_payload:
                misordered += 1
            else:
                last_payload = seq
            if ev.seq != last_seq + 1:
                gaps += 1
            last_seq = ev.seq
            received += 1

    consumer = asyncio.get_running_loop().create_task(consume())
    publish = pub.publish_nowait
    before = ctx.cpu_snapshot(inst)
    t0 = time.perf_counter()
    for start in range(0, n, BURST):
        for i in range(start, min(n, start + BURST)):
            publish(TOPIC, {"seq": i})
        await asyncio.sleep(0)
    # Given up only once nothing has arrived for IDLE_TIMEOUT: a slow
    # subscriber is slow, not losing events (one overall deadline called it
    # that below 500 events/s)
    seen = -1
    while not consumer.done() and received > seen:
        seen = received
        await asyncio.wait({consumer}, timeout=IDLE_TIMEOUT)
    if not consumer.done():
        consumer.cancel()
        ctx.note(f"subscriber heard nothing for {IDLE_TIMEOUT:.0f}s: {n - received} "
                 "events lost")
    else:
        consumer.result()  # (raises what ended it)
    variant = f"r0->r{sub_rank}"
    elapsed = t_last - t0
    return [
        Sample(variant, "rate", rate(received, elapsed) if received else 0.0, "events/s"),
        Sample(variant, "lost", float(n - received), "events", "lower"),
        Sample(variant, "misordered", float(misordered + gaps), "events", "lower"),
        *ctx.cpu_samples(inst, variant, before, n),
    ]


WORKLOADS = [
    Workload("W6", lambda s: f"event throughput, publisher on rank 0 -> subscriber on rank "
                       f"{far_rank(s.size)}",
             "test.x {seq: i}", run, count=N),
]
