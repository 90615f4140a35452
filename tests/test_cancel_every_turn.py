"""Async client calls cancelled at every moment: nothing is left behind.

Each call is started as a task and cancelled after k turns of the event
loop, for k = 0, 1, 2, ... until the call finishes by itself within k
turns (a read, a commit) or up to :data:`TURNS` (a watch, which never
ends by itself; a read or commit whose answer takes longer, as it waits
on I/O from the last of them on).  So a cancel lands in turn at every point where the call
waits -- before its request is written, while the answer is on its way,
inside a watch's setup and its loop -- not at a few moments chosen by
timing.  After each one the handle must hold no request for it and the
ranks no watcher for it (a watcher left on a rank is a leak that grows
with every Ctrl-C or timeout of a long-running client).  The client is on
rank 1, so the watches are set up through rank 1's kvs-watch and its
requests relay to rank 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from test_broker_support import wait_until

from broker.handle import Handle
from kvs.client import KVS

TURNS = 40
"""Most loop turns before the cancel, for calls that never end by themselves."""


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _watchers(h: Handle, rank: int) -> int:
    return int((await h.rpc("kvs-watch.stats-get", {}, nodeid=rank))["watchers"])


def _operations(kvs: KVS) -> dict[str, Callable[[], Awaitable[Any]]]:
    async def watch_block() -> None:
        async with kvs.watch("turns.a") as w:
            async for _ in w:
                await asyncio.sleep(3600)

    async def watch_loop() -> None:  # (no ``async with``: dropped by the cancel)
        async for _ in kvs.watch("turns.a"):
            await asyncio.sleep(3600)

    async def watch_keys() -> None:
        async for _ in kvs.watch_keys("turns"):
            await asyncio.sleep(3600)

    async def watch_namespaces() -> None:
        async for _ in kvs.watch_namespaces():
            await asyncio.sleep(3600)

    return {
        "get": lambda: kvs.get("turns.a"),
        "put": lambda: kvs.put("turns.b", b"2"),
        "watch in a block": watch_block,
        "watch in a loop": watch_loop,
        "wait_create": lambda: kvs.wait_create("turns.never"),
        "watch_keys": watch_keys,
        "watch_namespaces": watch_namespaces,
    }


@pytest.mark.parametrize("operation", ["get", "put", "watch in a block", "watch in a loop",
                                       "wait_create", "watch_keys", "watch_namespaces"])
async def test_a_call_cancelled_after_any_number_of_turns_leaves_nothing(
        start_instance, connect, operation: str) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    kvs = KVS(h)
    await kvs.put("turns.a", b"1")
    pending = h.pending
    watchers = [await _watchers(h, r) for r in (0, 1)]
    call = _operations(kvs)[operation]
    cancelled = 0
    for k in range(TURNS):
        task = asyncio.ensure_future(call())
        await _turns(k)
        if task.done():  # (it finished within k turns: every earlier moment was tried)
            task.result()
            break
        if k == TURNS - 1 and operation not in ("get", "put"):
            # the last cancel with a watch in place: what the checks would
            # see leak (waited for: wait_create asks rank 0 first, a round
            # trip that some turns do not cover)
            async def in_place() -> bool:
                if operation == "watch_namespaces":  # (a key watch: rank 1's kvs-watch)
                    return h.pending > pending
                return h.pending > pending and await _watchers(h, 1) > watchers[1]

            await wait_until(in_place, f"{operation}: the watch in place")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled += 1

        async def clean() -> bool:
            now = [await _watchers(h, r) for r in (0, 1)]
            return h.pending == pending and now == watchers

        await wait_until(clean, f"{operation}: nothing left after a cancel at turn {k}")
    assert cancelled >= (TURNS if operation not in ("get", "put") else 2), cancelled
    # and the handle works on
    assert await kvs.get("turns.a") == b"1"
