"""kvs-watch on a 4-rank instance (fanout 2): first answer, one answer per commit
naming the key, UNIQ, FULL, key matching, errors, cancel and disconnect.

Mirrors flux-core t/t1007-kvs-lookup-watch.t where it applies.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal

import pytest
from test_watch_helpers import (
    FULL,
    NO_MERGE,
    READDIR,
    STREAM,
    TREEOBJ,
    UNIQ,
    WAITCREATE,
    WATCH,
    answer,
    cancel,
    commit,
    end_errnum,
    errname,
    errnum,
    lookup,
    put,
    stats,
    unlink,
    value,
    wait_watchers,
    watch_stream,
)

from broker.errors import RemoteError
from broker.message import NODEID_ANY


@pytest.mark.both_loops
async def test_watch_from_every_rank_sees_every_commit_in_order(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    hs = [await connect(inst, r) for r in range(4)]
    first = await commit(hs[0], put("test.a", "1"), sync=hs)
    streams = [watch_stream(h, "test.a") for h in hs]
    for s in streams:
        p = await answer(s)
        assert p == {"val": {"ver": 1, "type": "val", "data": b"1"},
                     "rootseq": first["rootseq"], "namespace": "primary"}
    seqs = []
    for v in ("2", "2", "3"):  # a duplicate value is still a new answer (no UNIQ)
        seqs.append((await commit(hs[3], put("test.a", v), flags=NO_MERGE))["rootseq"])
    for s in streams:
        got = [await answer(s) for _ in range(3)]
        assert [(g["val"]["data"], g["rootseq"]) for g in got] == list(
            zip([b"2", b"2", b"3"], seqs, strict=True))
    # one monitor per rank, one subscription each
    for r in range(4):
        st = await stats(hs[0], r)
        assert st["watchers"] == 1 and st["namespace-count"] == 1
        assert st["namespaces"]["primary"]["watchers"] == 1
        assert st["events"]["subscribe_calls"] == 1
    for h, s in zip(hs, streams, strict=True):
        cancel(h, s)
        assert await end_errnum(s) == 0  # ENODATA: the normal end
    for r in range(4):
        await wait_watchers(hs[0], 0, nodeid=r)
        assert (await stats(hs[0], r))["namespace-count"] == 0


async def test_many_watchers_one_subscription(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 3)
    await commit(h, put("k", "0"))
    streams = [watch_stream(h, f"k{'.' * (i % 3)}") for i in range(20)]  # normalised keys
    for s in streams:
        assert await value(s) == b"0"
    await commit(h, put("..k..", "1"))
    for s in streams:
        assert await value(s) == b"1"
    st = await stats(h)
    assert st["watchers"] == 20 and st["events"]["subscribe_calls"] == 1
    # commits elsewhere in the namespace cost the watchers nothing
    lookups = st["counts"]["lookups"]
    shared = st["counts"]["lookups-shared"]
    for i in range(5):
        await commit(h, put(f"other.{i}", "x"))
    await commit(h, put("k", "2"))
    for s in streams:
        assert await value(s) == b"2"
    st = await stats(h)
    assert st["counts"]["lookups"] == lookups + 20
    # and the 20 woken by one commit share one kvs.lookup (each made its own)
    assert st["counts"]["lookups-shared"] == shared + 19
    assert st["events"]["handled"] >= 7


async def test_errors_without_waitcreate_and_flag_misuse(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 2)
    await commit(h, put("test.v", "1"))
    assert await end_errnum(watch_stream(h, "test.noexist")) == errno.ENOENT
    assert await end_errnum(watch_stream(h, "test.v", ns="noexist")) == errno.ENOTSUP
    # misuse: EPROTO for non-streaming WATCH/STREAM and malformed payloads, EINVAL else
    for flags in (WATCH, STREAM):
        assert await errnum(h.rpc("kvs-watch.lookup", {"namespace": "primary", "key": "test.v",
                                                       "flags": flags})) == errno.EPROTO
    for payload in (None, {}, {"key": 1, "flags": WATCH}, {"key": "a", "flags": "4"},
                    {"key": "a", "flags": WATCH, "namespace": 3}):
        s = h.rpc_stream("kvs-watch.lookup", payload)
        assert await end_errnum(s) == errno.EPROTO, payload
    for flags in (WATCH | STREAM, FULL, UNIQ, 256, WATCH | 1024, WATCH | 1 << 20,
                  WATCH | 256 | READDIR):
        s = watch_stream(h, "test.v", flags)
        n = await end_errnum(s)
        assert n == errno.EINVAL, (flags, errname(n))
    assert await end_errnum(watch_stream(h, "k", ns="bad/name")) == errno.EINVAL
    assert (await stats(h))["watchers"] == 0


async def test_key_removed_ends_watch_and_value_turned_directory(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h0, put("test.e", "1"), put("test.f", "1"), sync=h3)
    se, sf = watch_stream(h3, "test.e"), watch_stream(h3, "test.f")
    assert await value(se) == b"1" and await value(sf) == b"1"
    await commit(h0, unlink("test.e"))
    assert await end_errnum(se) == errno.ENOENT
    # a key below a watched value turns it into a directory: the watcher hears of it
    await commit(h0, put("test.f.sub", "x"))
    assert await end_errnum(sf) == errno.EISDIR


async def test_directory_and_root_watches_see_changes_below(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 1)
    await commit(h, put("d.a", "1"))
    sd = watch_stream(h, "d", WATCH | READDIR)
    sr = watch_stream(h, ".", WATCH | TREEOBJ)
    assert set((await answer(sd))["val"]["data"]) == {"a"}
    r0 = await answer(sr)
    assert r0["val"]["type"] == "dirref"
    await commit(h, put("d.b.c", "2"))
    assert set((await answer(sd))["val"]["data"]) == {"a", "b"}
    r1 = await answer(sr)
    assert r1["rootseq"] == r0["rootseq"] + 1 and r1["val"] != r0["val"]
    await commit(h, put("elsewhere", "3"))  # not below d: only the root watch answers
    assert (await answer(sr))["rootseq"] == r0["rootseq"] + 2
    await commit(h, put("d.a", "4"))
    p = await answer(sd)
    assert p["rootseq"] == r0["rootseq"] + 3


async def test_uniq_answers_only_changed_values(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 3)
    await commit(h, put("test.f", "1"))
    s = watch_stream(h, "test.f", WATCH | UNIQ)
    assert await value(s) == b"1"
    for v in ("1", "1", "2", "2", "3", "3"):
        await commit(h, put("test.f", v), flags=NO_MERGE)
    assert [await value(s) for _ in range(2)] == [b"2", b"3"]
    await commit(h, put("test.f", "4"))
    assert await value(s) == b"4"  # nothing else was queued before it


async def test_full_sees_parent_directory_replacement(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h2 = await connect(inst, 0), await connect(inst, 2)
    await commit(h0, put("test.dir_orig.a", "abc"), put("test.dir_new.a", "xyz"),
                 put("test.dir_b.b", "xyz"), sync=h2)
    plain = watch_stream(h2, "test.dir_orig.a")
    full = watch_stream(h2, "test.dir_orig.a", WATCH | FULL)
    full2 = watch_stream(h2, "test.dir_orig.a", WATCH | FULL)
    for s in (plain, full, full2):
        assert await value(s) == b"abc"
    dirref = await lookup(h0, "test.dir_new", TREEOBJ)
    await commit(h0, put("test.dir_orig", dirref))
    assert await value(full) == b"xyz"  # only FULL notices the replaced parent
    assert await value(full2) == b"xyz"
    await commit(h0, put("test.other", "1"))  # unchanged value: FULL stays quiet
    await commit(h0, put("test.dir_orig.a", "def"))
    assert await value(plain) == b"def"  # the plain watch saw only this one
    assert await value(full) == b"def"
    assert await value(full2) == b"def"
    cancel(h2, full2)
    assert await end_errnum(full2) == 0
    await commit(h0, put("test.dir_orig", await lookup(h0, "test.dir_b", TREEOBJ)))
    assert await end_errnum(full) == errno.ENOENT  # FULL detects the key vanishing


async def test_full_and_waitcreate_with_changing_sizes(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 1)
    s = watch_stream(h, "test.dir.a", WATCH | FULL | WAITCREATE)
    await wait_watchers(h, 1)
    big = "abcdefghijklmnopqrstuvwxyz" * 4
    for v in ("abc", "abc", big, big, "xyz", big):
        await commit(h, put("test.dir.a", v), flags=NO_MERGE)
    got = [await value(s) for _ in range(4)]
    assert got == [b"abc", big.encode(), b"xyz", big.encode()]


async def test_cancel_needs_the_same_client(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    a, b, h0 = await connect(inst, 3), await connect(inst, 3), await connect(inst, 0)
    await commit(h0, put("k", "1"), sync=(h0, 3))  # not via a or b: keep their tags equal
    sa, sb = watch_stream(a, "k"), watch_stream(b, "k")
    assert sa.matchtag == sb.matchtag  # same tag, different clients
    assert await value(sa) == b"1" and await value(sb) == b"1"
    cancel(b, sb)
    assert await end_errnum(sb) == 0
    await commit(h0, put("k", "2"), sync=(a, 1))
    assert await value(sa) == b"2"  # a's watch was not cancelled
    # a cancel for an unknown matchtag is harmless, and answered when asked
    assert await asyncio.wait_for(b.rpc("kvs-watch.cancel", {"matchtag": 999}), 10) == {}
    # a watch served by another rank is cancelled there (same route)
    sr = watch_stream(a, "k", nodeid=1)
    assert await value(sr) == b"2"
    assert (await stats(a, 1))["watchers"] == 1
    cancel(a, sr, nodeid=1)
    assert await end_errnum(sr) == 0
    await wait_watchers(a, 0, nodeid=1)


async def test_client_close_drops_its_watchers_everywhere(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    c = await connect(inst, 1)
    await commit(h, put("k", "1"), sync=[(h, r) for r in range(4)])
    streams = [watch_stream(c, "k", nodeid=r) for r in (NODEID_ANY, 0, 2, 3)]
    waiting = watch_stream(c, "nokey", WATCH | WAITCREATE, nodeid=3)
    for s in streams:
        assert await value(s) == b"1"
    await wait_watchers(h, 2, nodeid=3)
    await c.close()
    for r in range(4):
        await wait_watchers(h, 0, nodeid=r)
    st = await stats(h, 3)
    assert st["counts"]["disconnected"] == 2 and st["counts"]["cancelled"] == 0
    del waiting


async def test_a_clients_watches_are_capped(start_instance, connect):
    """kvs-watch.max-watches-per-client: one watch more is ENOSPC (as
    inotify's per-user cap); other clients are not affected, and a watch
    that ends frees its place."""
    inst = await start_instance(size=2, attrs={"kvs-watch.max-watches-per-client": "3"})
    h0, h1, other = [await connect(inst, r) for r in (0, 1, 1)]
    streams = [watch_stream(h1, f"cap.k{i}", WATCH | WAITCREATE) for i in range(3)]
    await wait_watchers(h0, 3, nodeid=1)
    assert await end_errnum(watch_stream(h1, "cap.k3", WATCH | WAITCREATE)) == errno.ENOSPC
    theirs = watch_stream(other, "cap.k9", WATCH | WAITCREATE)
    await wait_watchers(h0, 4, nodeid=1)
    cancel(h1, streams[0], nodeid=1)
    assert await end_errnum(streams[0]) == 0
    again = watch_stream(h1, "cap.k3", WATCH | WAITCREATE)
    await wait_watchers(h0, 4, nodeid=1)
    await commit(h0, put("cap.k3", "x"), put("cap.k9", "y"))
    assert await value(again) == b"x" and await value(theirs) == b"y"
    assert (await stats(h0, 1))["counts"]["refused-over-cap"] == 1


async def test_a_watch_left_by_a_timeout_does_not_wait_for_a_stuck_rank(
        start_instance, connect):
    """A watch left by an exception (a timeout, a cancel) cancels it on the
    rank without draining its stream: with the serving rank stopped, a
    1 s asyncio.timeout around wait_create took 11 s, the drain's own
    bound (concurrency audit).  Left normally, a watch still drains.

    Rank 1 stays stopped until the wait is over: a drain could end only at
    its bound, so waiting for it takes 0.5 s + CANCEL_TIMEOUT at the least,
    and under CANCEL_TIMEOUT can only be the watch left at once (0.5 s and
    the test's own scheduling: the bound says nothing of its speed)."""
    import time

    from test_broker_support import stopped

    from kvs_watch.client import CANCEL_TIMEOUT, wait_create

    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    async with stopped(inst.pids()[1]):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):
                await wait_create(h0, "test.never", nodeid=1)
        waited = time.monotonic() - t0
    assert waited < CANCEL_TIMEOUT, f"{waited:.1f} s: it drained the stream"
    await wait_watchers(h0, 0, nodeid=1)  # the cancel reached rank 1 once it ran
    assert h0.pending == 0  # (its ENODATA came; the stream is forgotten)


async def test_eventlog_and_key_watches_left_by_a_timeout_do_not_wait_for_a_stuck_rank(
        start_instance, connect):
    """As a plain watch (above), an eventlog watch (``wait_event``, what
    ``kvbroker kvs eventlog wait-event -t`` runs) and a key watch left by an
    exception cancel on the rank without draining: they drained for
    CANCEL_TIMEOUT, so wait_event(timeout=0.5) against a stopped serving
    rank took 10.5 s.  Each wait is told from a drain as above: under
    CANCEL_TIMEOUT, against 0.5 s + CANCEL_TIMEOUT at the least."""
    import time

    from test_broker_support import stopped

    from kvs_watch.client import CANCEL_TIMEOUT, wait_event, watch_keys

    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    waited: list[float] = []
    async with stopped(inst.pids()[1]):
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await wait_event(h0, "test.log", "never", waitcreate=True, timeout=0.5, nodeid=1)
        waited.append(time.monotonic() - t0)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5), watch_keys(h0, "test", nodeid=1) as w:
                await anext(w)
        waited.append(time.monotonic() - t0)
    assert max(waited) < CANCEL_TIMEOUT, f"{waited}: a watch drained its stream"
    await wait_watchers(h0, 0, nodeid=1)  # the cancels reached rank 1 once it ran
    assert h0.pending == 0


async def test_a_watch_left_by_an_exception_while_another_task_iterates_it_ends(
        start_instance, connect):
    """Leaving ``async with watch(...)`` by an exception cancels the watch on
    the rank even while another task iterates it, and that task's loop ends
    (as a normal exit does): it sent nothing, so the watcher stayed on the
    rank and the other task waited for ever."""
    from kvs_watch.client import watch

    inst = await start_instance(size=1)
    h0 = await connect(inst, 0)
    await commit(h0, put("test.k", "1"))
    w = watch(h0, "test.k")
    seen: list[bytes | None] = []
    first = asyncio.Event()

    async def iterate() -> None:
        async for entry in w:
            seen.append(entry.value)
            first.set()

    reader: asyncio.Task[None] | None = None
    with pytest.raises(ValueError):
        async with w:
            reader = asyncio.ensure_future(iterate())
            await asyncio.wait_for(first.wait(), 10)
            raise ValueError("leaving the block")
    assert reader is not None
    await asyncio.wait_for(reader, 10)  # its loop ended: the cancel's ENODATA
    assert seen == [b"1"]
    await wait_watchers(h0, 0)


async def test_a_watch_ended_by_its_rank_s_stop_says_why(start_instance, connect):
    """A watch on a rank that stops ends ENOSYS, "this rank is stopping" --
    and now says why (a signal; a lost parent, after which a client may
    retry elsewhere), which the operator review found missing."""
    inst = await start_instance(size=2, fanout=2)
    h = await connect(inst, 1)
    await commit(h, put("k", "1"))
    s = watch_stream(h, "k")
    assert (await value(s)) == b"1"
    os.kill(inst.pids()[1], signal.SIGTERM)
    with pytest.raises(RemoteError) as ended:
        await asyncio.wait_for(s.next_message(), 30)
    assert (ended.value.errnum, ended.value.errstr) == (
        errno.ENOSYS, "the watch ended: this rank is stopping (signal SIGTERM)")


async def test_a_value_watch_of_a_directory_says_how_to_watch_one(start_instance, connect):
    """``EISDIR`` from ``KVS.watch`` of a directory carries a note (shown in
    its traceback, not in its message, which the CLI words its own way)
    naming ``readdir=True`` and ``watch_keys()``; a ``readdir`` watch of it
    works."""
    from kvs.client import KVS

    inst = await start_instance(size=1)
    kvs = KVS(await connect(inst, 0))
    await kvs.put("d.x", 1)
    with pytest.raises(RemoteError) as exc:
        async with asyncio.timeout(10):
            async for _ in kvs.watch("d"):
                break
    assert exc.value.errnum == errno.EISDIR and str(exc.value) == "[EISDIR] d: is a directory"
    assert exc.value.__notes__ == ["(watch a directory's entries with readdir=True, or the "
                                   "keys below it with watch_keys())"]
    async with asyncio.timeout(10), kvs.watch("d", readdir=True) as w:
        entry = await anext(w)
    assert entry.treeobj is not None and "x" in entry.treeobj["data"], entry


async def test_wait_create_after_a_removal_never_answers_from_the_removed_namespace(
        start_instance, connect):
    """A namespace removed (its namespace-remove answered), made again and
    written, while rank 3 has not heard the removal yet (its parent, rank
    1, stopped): ``wait_create`` on rank 3, called after the removal, got
    the removed namespace's value (a review's chaos probe: 7-37% of tries
    with no rank stopped).  It first pings rank 0, whose answer comes down
    the tree behind the removal's event, so it waits for the new one."""
    from test_broker_support import stop_process

    from kvs.client import KVS

    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    k0, k3 = KVS(h0, "reused"), KVS(h3, "reused")
    await k0.namespace_create("reused")
    await k3.wait_version(await k0.put("job.state", "old"))
    rank1 = inst.pids()[1]
    await stop_process(rank1)
    try:
        await k0.namespace_remove("reused")  # (answered: rank 0 waits for no rank)
        waiting = asyncio.ensure_future(k3.wait_create("job.state"))
        await k0.namespace_create("reused")
        await k0.put("job.state", "new")
    finally:
        os.kill(rank1, signal.SIGCONT)
    entry = await asyncio.wait_for(waiting, 20)
    assert entry.value == b"new", entry
