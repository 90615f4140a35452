"""A watch whose reader falls behind is bounded on the client too.

A handle reads every answer off its socket as it comes, so kvs-watch never
sees a backlog: the client keeps a watch's unread answers to the rank's
``kvs-watch.max-backlog`` (or the watch's ``max_backlog``) and past it ends
the watch ``EOVERFLOW`` (cancelled on its rank), or folds an ``append``
watch's answers (kvs_watch/backlog.py).  Every wait is on the condition
expected, time-boxed.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable
from typing import Any

import pytest
from test_watch_helpers import wait_until

from broker.errors import RemoteError
from kvs.client import KVS, NO_MERGE, SyncKVS, TxnOps
from kvs_watch.backlog import DEFAULT_MAX_BACKLOG
from kvs_watch.client import INITIAL_DONE, WatchEntry, watch, watch_keys

T = 30.0


async def rank_watchers(h: Any) -> int:
    return int((await h.rpc("kvs-watch.stats-get", {}))["watchers"])


async def test_a_reader_past_max_backlog_gets_eoverflow(start_instance, connect) -> None:
    # (the client-API audit's reproducer, commit 0a3ebaa, as it was written)
    inst = await start_instance(1, attrs={"kvs-watch.max-backlog": "10"})
    h, writer = await connect(inst), await connect(inst)
    kvs = KVS(writer)
    await kvs.put("k", 0)
    behind = 50
    with pytest.raises(RemoteError) as ended:
        async with asyncio.timeout(T), watch(h, "k") as w:
            it = aiter(w)
            await anext(it)  # the current value; then the reader stops reading
            for i in range(1, behind + 1):
                await kvs.commit(TxnOps().put("k", i), NO_MERGE)
            await kvs.commit(TxnOps().put("k", "end"), NO_MERGE)
            # 51 commits behind with a max-backlog of 10: the watch should end
            # EOVERFLOW before the reader gets to the last value
            async for entry in it:
                if entry.value == b"end":
                    break
    assert ended.value.errnum == errno.EOVERFLOW


async def test_overflow_keeps_the_answers_before_it_and_leaves_nothing_on_the_rank(
        start_instance, connect) -> None:
    inst = await start_instance(1, attrs={"kvs-watch.max-backlog": "10"})
    h, writer = await connect(inst), await connect(inst)
    kvs = KVS(writer)
    await kvs.put("k", 0)
    async with asyncio.timeout(T):
        w = watch(h, "k")  # (no async with: a watch its reader walked away from)
        it = aiter(w)
        assert (await anext(it)).value == b"0"
        for i in range(1, 31):
            await kvs.commit(TxnOps().put("k", i), NO_MERGE)
        # The client cancelled it on the rank: the rank keeps nothing ...
        await wait_until(lambda: _eq(rank_watchers(h), 0), what="the rank to drop the watcher")
        # ... and holds at most the bound (+ the error), whatever comes.
        assert w._stream is not None and len(w._stream.unread) <= 10 + 1
        got = []
        with pytest.raises(RemoteError) as ended:
            async for entry in it:
                got.append(entry.json())
    assert ended.value.errnum == errno.EOVERFLOW
    assert "fell more than 10 commits behind" in ended.value.errstr
    assert got == list(range(1, 11))  # the answers queued before, in order
    assert h.pending == 0  # (the rank's ENODATA for the cancel freed the tag)


async def _eq(value: Awaitable[Any], want: Any) -> bool:
    return bool(await value == want)


async def test_a_reader_that_keeps_up_is_unaffected(start_instance, connect) -> None:
    inst = await start_instance(1)
    h, writer = await connect(inst), await connect(inst)
    kvs = KVS(writer)
    await kvs.put("k", 0)
    async with asyncio.timeout(T), watch(h, "k", max_backlog=1) as w:
        it = aiter(w)
        assert (await anext(it)).json() == 0
        for i in range(1, 101):  # far more commits than the bound, each read
            await kvs.commit(TxnOps().put("k", i), NO_MERGE)
            assert (await anext(it)).json() == i
    assert w.done


async def test_an_append_reader_far_behind_reads_each_byte_once_in_order(
        start_instance, connect) -> None:
    inst = await start_instance(1)
    h, writer = await connect(inst), await connect(inst)
    kvs = KVS(writer)
    await kvs.put("log", b"start\n")
    appends = 200
    lines = [f"line {i:04d}\n".encode() for i in range(appends)] + [b"END\n"]
    async with asyncio.timeout(T), watch(h, "log", append=True, max_backlog=5) as w:
        it = aiter(w)
        first = await anext(it)
        assert first.value == b"start\n"
        for line in lines:  # the reader reads nothing meanwhile
            await kvs.commit(TxnOps().append("log", line), NO_MERGE)
        last = await kvs.version()
        stream = w._stream
        assert stream is not None

        async def all_here() -> bool:
            tail = stream.unread[-1].payload if stream.unread else None
            return bool(tail and tail["val"]["data"].endswith(b"END\n"))

        await wait_until(all_here, what="the last append's answer to reach the client")
        assert len(stream.unread) <= 5  # folded: the bound held
        entries = []
        data = b""
        while not data.endswith(b"END\n"):
            e = await anext(it)
            assert type(e.value) is bytes
            entries.append(e)
            data += e.value
    assert data == b"".join(lines)  # each byte once, in order
    assert len(entries) <= 5 < appends  # from fewer entries
    seqs = [e.rootseq for e in entries]
    assert seqs == sorted(seqs) and seqs[-1] == last  # the folded one at the newest
    assert await rank_watchers(h) == 0


async def test_folding_keeps_the_initial_sentinel_in_its_place(start_instance, connect) -> None:
    inst = await start_instance(1)
    h, writer = await connect(inst), await connect(inst)
    kvs = KVS(writer)
    initial = [b"a\n", b"b\n", b"c\n"]  # three blobs: three initial answers
    await kvs.put("log", initial[0])
    for chunk in initial[1:]:
        await kvs.commit(TxnOps().append("log", chunk), NO_MERGE)
    later = [f"{i}\n".encode() for i in range(30)] + [b"END\n"]
    async with asyncio.timeout(T):
        w = watch(h, "log", append=True, initial_sentinel=True, max_backlog=2).start()
        stream = w._stream
        assert stream is not None

        async def sentinel_here() -> bool:  # (else an append could be read as initial)
            return any(m.payload is None for m in stream.unread)

        await wait_until(sentinel_here, what="the initial answers and their sentinel")
        for chunk in later:  # the reader has read nothing yet
            await kvs.commit(TxnOps().append("log", chunk), NO_MERGE)

        async def all_here() -> bool:
            tail = stream.unread[-1].payload if stream.unread else None
            return bool(tail and tail["val"]["data"].endswith(b"END\n"))

        await wait_until(all_here, what="the last append's answer to reach the client")
        assert len(stream.unread) <= 2 + 2  # (the sentinel, and the entry after it)
        before, after, seen = b"", b"", False
        async with w:
            async for e in w:
                if e is INITIAL_DONE:
                    seen = True
                    continue
                assert isinstance(e, WatchEntry) and e.value is not None
                if seen:
                    after += e.value
                else:
                    before += e.value
                if after.endswith(b"END\n"):
                    break
    assert before == b"".join(initial) and after == b"".join(later)


async def test_a_key_watch_past_its_bound_ends_eoverflow(start_instance, connect) -> None:
    inst = await start_instance(1)
    h, writer = await connect(inst), await connect(inst)
    kvs = KVS(writer)
    async with asyncio.timeout(T):
        kw = watch_keys(h, "d", max_backlog=5)
        it = aiter(kw)
        assert (await anext(it)).initial
        for i in range(20):
            await kvs.commit(TxnOps().put(f"d.k{i}", i), NO_MERGE)
        await wait_until(lambda: _eq(rank_watchers(h), 0), what="the rank to drop the key watcher")
        got = []
        with pytest.raises(RemoteError) as ended:
            async for change in it:
                got.extend(change.keys)
    assert ended.value.errnum == errno.EOVERFLOW
    assert got == [f"d.k{i}" for i in range(5)]


async def test_the_bound_is_the_rank_max_backlog_unless_given(start_instance, connect) -> None:
    inst = await start_instance(1, attrs={"kvs-watch.max-backlog": "7"})
    h = await connect(inst)
    await KVS(h).put("k", 0)
    async with asyncio.timeout(T):
        async with watch(h, "k") as w:
            await anext(aiter(w))
            stream = w._stream
            assert stream is not None

            async def learnt() -> bool:  # (the attr.get sent with it is not waited for)
                return stream.max_unread == 7

            await wait_until(learnt, what="the rank's max-backlog to be learnt")
        async with watch(h, "k", max_backlog=3) as w2:  # (learnt once: no wait now)
            assert w2._stream is not None and w2._stream.max_unread == 3
        async with watch(h, "k") as w3:
            assert w3._stream is not None and w3._stream.max_unread == 7
    with pytest.raises(ValueError):
        watch(h, "k", max_backlog=0)
    assert DEFAULT_MAX_BACKLOG == 1000


async def test_other_streams_stay_unbounded(start_instance, connect) -> None:
    inst = await start_instance(1)
    h = await connect(inst)
    s = h.dmesg(follow=False)
    assert s.max_unread > 10**9
    async with asyncio.timeout(T):
        async for _ in s:
            pass


async def test_the_blocking_facade_takes_max_backlog(start_instance) -> None:
    inst = await start_instance(1)

    def script() -> tuple[list[int], int, int | None]:
        with SyncKVS(uri=inst.uri(0)) as skvs:
            skvs.put("k", 0)
            got: list[int] = []
            with skvs.watch("k", max_backlog=3, timeout=T) as w:
                assert next(w).json() == 0
                for i in range(1, 11):
                    skvs.commit(TxnOps().put("k", i), NO_MERGE)
                stream = w.watch._stream
                assert stream is not None
                for _ in range(int(T / 0.01)):  # (the loop turns only inside a call)
                    if stream.ended_here:
                        break
                    skvs.run(asyncio.sleep(0.01))
                try:
                    for entry in w:
                        got.append(entry.json())
                    errnum = 0
                except RemoteError as exc:
                    errnum = exc.errnum
            with skvs.watch_keys("d", max_backlog=2) as kw:
                bound = kw.watch.watch.max_backlog
            return got, errnum, bound

    got, errnum, bound = await asyncio.wait_for(asyncio.to_thread(script), 2 * T)
    assert errnum == errno.EOVERFLOW and got == [1, 2, 3]
    assert bound == 2
