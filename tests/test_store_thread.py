"""broker/content/storethread.py: a job someone waits on gets turns at the
GIL from a busy event loop; background work does not, and an idle loop is
left to sleep.

In process, on both loops.  The job stands for a store call: it lets go of
the GIL and needs it back many times (as a SQLite call returning to Python
does), while the loop runs Python without end, as under a churning client.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
from test_watch_helpers import wait_until

from broker.content import storethread
from broker.content.storethread import StoreThread

pytestmark = pytest.mark.both_loops

GIL_TRIPS = 200


def needs_the_gil_often() -> int:
    """Give the GIL back and take it again GIL_TRIPS times."""
    n = 0
    for _ in range(GIL_TRIPS):
        time.sleep(0)  # (lets go of the GIL, then must take it again)
        n += 1
    return n


async def busy_loop(stop: asyncio.Event) -> int:
    """Run Python on the loop, with a loop turn between chunks, until ``stop``."""
    turns = 0
    while not stop.is_set():
        sum(range(5_000))
        await asyncio.sleep(0)
        turns += 1
    return turns


async def turning_stopped(thread: StoreThread) -> None:
    async def stopped() -> bool:
        return not thread._turning
    await wait_until(stopped, 10, "the turns to stop")


async def run_beside_a_busy_loop(thread: StoreThread, urgent: bool = False,
                                 hurry: bool = False) -> None:
    stop = asyncio.Event()
    busy = asyncio.create_task(busy_loop(stop))
    try:
        job = thread.run(needs_the_gil_often, urgent=urgent)
        with thread.hurry() if hurry else contextlib.nullcontext():
            assert await asyncio.wait_for(job, 60) == GIL_TRIPS
    finally:
        stop.set()
        assert await busy > 0


@pytest.mark.parametrize("how", ["urgent", "hurry"])
async def test_a_job_waited_on_beside_a_busy_loop_gets_turns_and_they_stop_after(
        how: str) -> None:
    thread = StoreThread("test-store")
    try:
        await run_beside_a_busy_loop(thread, urgent=how == "urgent", hurry=how == "hurry")
        stats = thread.stats()
        assert stats["jobs"] == 1 and stats["queued"] == 0 and stats["waiters"] == 0
        assert stats["turn-runs"] == 1 and stats["turns"] >= 1, stats
        await turning_stopped(thread)
        given = thread.stats()["turns"]
        # nothing on the thread: no more turns, however long the loop runs
        for _ in range(100):
            await asyncio.sleep(0)
        assert thread.stats()["turns"] == given
    finally:
        thread.shutdown()


@pytest.mark.parametrize("urgent", [True, False], ids=["waited-on", "background"])
async def test_only_a_job_waited_on_gets_turns(urgent: bool) -> None:
    """A job held on the thread while the loop runs Python for 20 ms: turns
    if someone waits on it; none for background work (a garbage
    collection's), which waits for the GIL as it always did -- turns would
    take the loop's time from the writers.  (Not a job that needs the GIL
    here: without turns, each trip beside this loop took seconds.)"""
    thread = StoreThread("test-store")
    gate = threading.Event()
    try:
        held = thread.run(gate.wait, 30, urgent=urgent)
        end = time.perf_counter() + 0.02  # (the busy loop under test, not a wait)
        while time.perf_counter() < end:
            sum(range(5_000))
            await asyncio.sleep(0)
        gate.set()
        assert await asyncio.wait_for(held, 10) is True
        stats = thread.stats()
        if urgent:
            assert stats["turn-runs"] == 1 and stats["turns"] >= 1, stats
        else:
            assert stats["turn-runs"] == 0 and stats["turns"] == 0, stats
        await turning_stopped(thread)
    finally:
        gate.set()
        thread.shutdown()


async def test_an_idle_loop_gives_no_turn_one_after_another() -> None:
    """A long job beside an idle loop: the loop looks at the thread every
    IDLE_GAP, and an idle loop gives no turns (it lets go of the GIL while
    it waits for events); turns one after another would keep it spinning
    for as long as the job, ~10 a millisecond."""
    thread = StoreThread("test-store")
    gate = threading.Event()
    try:
        held = thread.run(gate.wait, 30, urgent=True)
        t0 = time.perf_counter()

        async def looked() -> bool:
            return thread.stats()["turn-runs"] == 1
        await wait_until(looked, 10, "a look at the held job")
        await asyncio.sleep(0.05)  # (the idle loop under test, not a wait for an event)
        gate.set()
        assert await asyncio.wait_for(held, 10) is True
        elapsed_ms = (time.perf_counter() - t0) * 1000
        turns = thread.stats()["turns"]
        # (a look the scheduler delays can take the loop for busy: a turn,
        # then the next look; at most a couple a millisecond)
        assert turns <= 2 * elapsed_ms / (storethread.IDLE_GAP * 1000) + 2, (turns, elapsed_ms)
        await turning_stopped(thread)
    finally:
        gate.set()
        thread.shutdown()


async def test_jobs_run_in_order_and_errors_reach_the_caller() -> None:
    thread = StoreThread("test-store")
    try:
        seen: list[int] = []
        futs = [thread.run(seen.append, i) for i in range(50)]

        def fail() -> None:
            raise ValueError("no room")
        bad = thread.run(fail)
        await asyncio.wait_for(asyncio.gather(*futs), 10)
        with pytest.raises(ValueError, match="no room"):
            await asyncio.wait_for(bad, 10)
        assert seen == list(range(50))
        await turning_stopped(thread)
        assert thread.stats()["queued"] == 0
    finally:
        thread.shutdown()
