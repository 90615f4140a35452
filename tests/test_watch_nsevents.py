"""``kvs-watch.namespaces``: the namespaces that exist, then each one created
or removed (KVS.watch_namespaces, ``kvbroker kvs namespace watch``), on a
far rank, for a guest (its own only), with no gap and no duplicate between
the list and the events, and released by cancel and by a vanished client."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from collections import Counter
from typing import Any

import msgpack
from test_watch_cli import run, spawn
from test_watch_helpers import (
    GUEST_UID,
    T,
    answer,
    cancel,
    end_errnum,
    ns_create,
    ns_remove,
    run_guest,
    stats,
    wait_until,
)

from broker.handle import Handle
from kvs.client import KVS, SyncKVS
from kvs_watch.client import NS_LISTED, NamespaceEvent
from kvs_watch.nswatch import NsHub, NsWatcher


async def nsw_count(h: Any, n: int, nodeid: int) -> None:
    """Until kvs-watch on ``nodeid`` has ``n`` namespace watchers (and as many watchers)."""
    async def check() -> bool:
        st = await stats(h, nodeid)
        return bool(st["namespace-watchers"] == n and st["watchers"] == n)
    await wait_until(check, T, f"{n} namespace watchers on rank {nodeid}")


def brief(e: NamespaceEvent) -> tuple[str, str, bool]:
    return (e.event, e.namespace, e.initial)


async def test_far_rank_sees_existing_then_changes_in_order(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await ns_create(h0, "job-a")
    await ns_create(h0, "other")
    await ns_create(h0, "job-b", owner=1234)
    async with KVS(h3).watch_namespaces("job-") as w:
        first = [await asyncio.wait_for(anext(w), T) for _ in range(2)]
        assert [brief(e) for e in first] == [("created", "job-a", True),
                                             ("created", "job-b", True)]
        assert first[1].owner == 1234 and first[0].epoch is not None
        assert first[0].epoch < first[1].epoch  # in creation order
        old_a = first[0].epoch
        await ns_create(h0, "job-c")
        await ns_create(h0, "not-a-job")
        await ns_remove(h0, "job-a")
        await ns_remove(h0, "other")
        await ns_create(h0, "job-a")  # the same name again: a new namespace
        await ns_remove(h0, "job-b")
        got = [await asyncio.wait_for(anext(w), T) for _ in range(4)]
    assert [brief(e) for e in got] == [("created", "job-c", False),
                                       ("removed", "job-a", False),
                                       ("created", "job-a", False),
                                       ("removed", "job-b", False)]
    assert got[1].epoch == old_a and got[2].epoch is not None and got[2].epoch > old_a
    assert got[3].owner == 1234
    await nsw_count(h0, 0, nodeid=3)  # leaving the block cancelled it
    st = await stats(h3)
    assert st["events"]["subscribe_calls"] == 1  # no subscription of its own
    assert st["counts"]["namespace-watchers-created"] == 1


async def test_guest_sees_only_its_own_namespaces(start_instance, connect):
    inst = await start_instance(size=4, fanout=2, attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "mine-1", owner=GUEST_UID)
    await ns_create(h0, "theirs-1", owner=GUEST_UID - 1)
    guest = asyncio.ensure_future(asyncio.to_thread(run_guest, inst.uri(1), """
        async def body(h):
            out = []
            s = h.rpc_stream("kvs-watch.namespaces", {})
            while True:
                msg = await asyncio.wait_for(s.next_message(), 20)
                p = msg.payload
                if p["event"] == "listed":
                    continue  # (the end of the list: tested below)
                out.append([p["event"], p["namespace"], p["owner"]])
                if p["namespace"] == "mine-3":
                    st = await h.rpc("kvs-watch.stats-get", {})
                    return {"seen": out, "stats": sorted(st)}
    """))
    await nsw_count(h0, 1, nodeid=1)
    await ns_create(h0, "theirs-2", owner=GUEST_UID - 1)
    await ns_create(h0, "mine-2", owner=GUEST_UID)
    await ns_remove(h0, "theirs-1")
    await ns_remove(h0, "mine-1")
    await ns_create(h0, "mine-3", owner=GUEST_UID)
    result = await asyncio.wait_for(guest, 30)
    assert result["seen"] == [["created", "mine-1", GUEST_UID],
                              ["created", "mine-2", GUEST_UID],
                              ["removed", "mine-1", GUEST_UID],
                              ["created", "mine-3", GUEST_UID]]
    # (and its stats tell it nothing of the others' watchers)
    assert result["stats"] == ["namespace-count", "namespaces", "rank"]


async def test_created_while_the_watch_starts_reported_exactly_once(start_instance, connect):
    """Namespaces are created back to back on rank 0 while watchers start on
    rank 3, each at a later point of the burst: each watcher's list holds
    some, its events the others (and events of namespaces already listed
    arrive after it started).  Every namespace is reported once."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    n, nwatchers = 120, 8
    made = 0
    progress = asyncio.Condition()

    async def create_all() -> None:
        nonlocal made
        sem = asyncio.Semaphore(16)  # 16 creates in flight: events on their way

        async def one(i: int) -> None:
            nonlocal made
            async with sem:
                await ns_create(h0, f"race-{i}")
            async with progress:
                made += 1
                progress.notify_all()
        await asyncio.gather(*(one(i) for i in range(n)))

    async def watcher(after: int) -> tuple[Counter[str], int, int]:
        async with progress:
            await asyncio.wait_for(progress.wait_for(lambda: made >= after), T)
        seen: Counter[str] = Counter()
        initial = events = 0
        async with KVS(h3).watch_namespaces("race-") as w:
            while True:
                e = await asyncio.wait_for(anext(w), T)
                if e.namespace == "race-end":
                    return seen, initial, events
                assert e.event == "created", e
                seen[e.namespace] += 1
                if e.initial:
                    initial += 1
                else:
                    events += 1

    creator = asyncio.ensure_future(create_all())
    tasks = [asyncio.ensure_future(watcher(i * n // nwatchers)) for i in range(nwatchers)]
    await asyncio.wait_for(creator, 60)
    await nsw_count(h0, nwatchers, nodeid=3)  # every watcher started before race-end
    await ns_create(h0, "race-end")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    want = {f"race-{i}" for i in range(n)}
    for seen, _, _ in results:
        assert set(seen) == want and set(seen.values()) == {1}, \
            [k for k, v in seen.items() if v != 1]
    # the race was run: some watcher had part of the burst listed, part as events
    assert any(initial and events for _, initial, events in results), \
        [(i, e) for _, i, e in results]
    await nsw_count(h0, 0, nodeid=3)


async def test_cancel_and_vanished_client_release_the_watcher(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    s = h3.rpc_stream("kvs-watch.namespaces", {"prefix": "p"})
    assert (await answer(s))["namespace"] == "primary"
    assert await answer(s) == {"event": "listed"}
    await nsw_count(h0, 1, nodeid=3)
    cancel(h3, s)
    assert await end_errnum(s) == 0  # (ENODATA: the normal end)
    await nsw_count(h0, 0, nodeid=3)
    # changes only (NOLIST), from a client that then goes away
    other = await asyncio.wait_for(Handle.connect(inst.uri(3)), T)
    s2 = other.rpc_stream("kvs-watch.namespaces", {"prefix": "gone-", "flags": 1})
    assert await answer(s2) == {"event": "listed"}  # (at once: the watch has started)
    await nsw_count(h0, 1, nodeid=3)
    await ns_create(h0, "gone-1")
    p = await answer(s2)
    assert (p["event"], p["namespace"], p.get("initial")) == ("created", "gone-1", None)
    before = (await stats(h3))["counts"]
    await other.close()
    await nsw_count(h0, 0, nodeid=3)
    after = (await stats(h3))["counts"]
    assert after["disconnected"] == before["disconnected"] + 1
    assert after["cancelled"] == before["cancelled"] == 1
    assert (await stats(h3))["clients"] == 0


async def test_cli_namespace_watch(start_instance, connect):
    inst = await start_instance(size=2, fanout=2)
    h0 = await connect(inst, 0)
    await ns_create(h0, "job-1")
    p = await spawn(inst.uri(1), "kvs", "namespace", "watch", "job-", "-c", "3")
    assert p.stdout is not None
    line = await asyncio.wait_for(p.stdout.readline(), T)
    assert line == b"exists job-1\n"  # the watch has started: what follows is an event
    await ns_create(h0, "job-2")
    await ns_remove(h0, "job-1")
    out, err = await asyncio.wait_for(p.communicate(), T)
    assert (p.returncode, out, err) == (0, b"created job-2\nremoved job-1\n", b"")
    rc, out_s, err_s = await run(inst.uri(1), "kvs", "namespace", "watch", "--json", "-c",
                                 "1", "job-")
    assert rc == 0 and err_s == "" and '"namespace": "job-2"' in out_s
    assert '"initial": true' in out_s


async def test_sync_kvs_watch_namespaces(start_instance) -> None:
    """SyncKVS.watch_namespaces: the same stream, as a blocking iterator
    (changes only with ``changes_only``); leaving ``with`` cancels it."""
    inst = await start_instance(size=2)

    def script() -> list[tuple[str, str, bool]]:
        with SyncKVS(uri=inst.uri(1)) as kvs:
            kvs.namespace_create("sync-1")
            with kvs.watch_namespaces("sync-", timeout=T) as w:
                seen = [brief(next(w))]
                kvs.namespace_create("sync-2")
                seen.append(brief(next(w)))
            with kvs.watch_namespaces("sync-", changes_only=True, timeout=T) as w:
                kvs.namespace_remove("sync-1")
                seen.append(brief(next(w)))
            return seen

    assert await asyncio.to_thread(script) == [("created", "sync-1", True),
                                               ("created", "sync-2", False),
                                               ("removed", "sync-1", False)]


async def test_listed_marker_ends_the_list_even_when_empty(start_instance, connect):
    """After the list, one ``{"event": "listed"}`` answer: an empty list is
    the marker alone, a list of namespaces is them then the marker, then the
    changes; with NOLIST (changes only) it is the first answer, at once:
    the watch has started.  The Python watch yields it (NS_LISTED) only
    when asked (``listed=True``)."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    s = h3.rpc_stream("kvs-watch.namespaces", {"prefix": "job-"})
    assert await answer(s) == {"event": "listed"}  # on the wire: no namespace, no owner
    cancel(h3, s)
    assert await end_errnum(s) == 0
    kvs = KVS(h3)
    async with kvs.watch_namespaces("job-", listed=True) as w:  # empty: the marker first
        first = await asyncio.wait_for(anext(w), T)
        assert first == NS_LISTED and first.listed and not first.created
        await ns_create(h0, "job-a")
        await ns_create(h0, "job-b")
        got = [await asyncio.wait_for(anext(w), T) for _ in range(2)]
    assert [brief(e) for e in got] == [("created", "job-a", False),
                                       ("created", "job-b", False)]
    async with kvs.watch_namespaces("job-", listed=True) as w:  # the list, marker, changes
        listed = [await asyncio.wait_for(anext(w), T) for _ in range(3)]
        assert [brief(e) for e in listed] == [("created", "job-a", True),
                                              ("created", "job-b", True),
                                              ("listed", "", False)]
        await ns_remove(h0, "job-a")
        assert brief(await asyncio.wait_for(anext(w), T)) == ("removed", "job-a", False)
    async with kvs.watch_namespaces("job-", changes_only=True, listed=True) as w:
        first = await asyncio.wait_for(anext(w), T)  # (no list: the marker at once)
        assert first == NS_LISTED
        await ns_create(h0, "job-c")
        assert brief(await asyncio.wait_for(anext(w), T)) == ("created", "job-c", False)
    await nsw_count(h0, 0, nodeid=3)



async def test_sync_watch_namespaces_listed(start_instance) -> None:
    """SyncKVS.watch_namespaces(listed=True): a script sees the marker of an
    empty list at once (without it, its next() waits for a change)."""
    inst = await start_instance(size=2)

    def script() -> list[tuple[str, str, bool]]:
        with SyncKVS(uri=inst.uri(1)) as kvs, \
                kvs.watch_namespaces("none-", listed=True, timeout=T) as w:
            seen = [brief(next(w))]
            kvs.namespace_create("none-1")
            seen.append(brief(next(w)))
            return seen

    assert await asyncio.to_thread(script) == [("listed", "", False),
                                               ("created", "none-1", False)]


# ---------------------------------------------------------------- the hub, in process

class _Msg:
    """The fields of a request that a namespace watcher reads (the owner's)."""
    is_owner, userid, matchtag = True, 0, 1


class _Backend:
    """Records the answers (the module sends them)."""
    max_backlog = 1000

    def __init__(self, record: bool = True) -> None:
        self.record = record
        self.answers: dict[int, list[tuple[str, str, bool]]] = {}

    def respond_ns(self, w: NsWatcher, p: dict[str, Any]) -> None:
        if self.record:
            self.answers.setdefault(id(w), []).append(
            (p["event"], p.get("namespace", ""), bool(p.get("initial"))))

    def respond_error_ns(self, w: NsWatcher, errnum: int, errstr: str | None) -> None:
        pass

    def ended_ns(self, w: NsWatcher) -> None:
        pass


def _list(epoch: int, *names: tuple[str, int]) -> dict[str, Any]:
    return {"epoch": epoch, "namespaces": [{"namespace": n, "epoch": e, "owner": 0}
                                           for n, e in names]}


def test_list_answered_before_its_events_reports_each_once() -> None:
    """The list may reach the rank before events rank 0 made before it: the
    epoch filter drops those (a create at or below the table's epoch, a
    removal of a namespace the table does not hold), whoever was served."""
    b = _Backend()
    hub = NsHub(b)
    w1 = hub.add(_Msg(), "x", 0)  # type: ignore[arg-type]
    hub.event("removed", "x0", 0, 1)  # buffered, heard before the list: not in it
    # rank 0 listed after x1..x3 were made and x2 removed: epoch 4
    hub.listed(w1, _list(4, ("x1", 2), ("x3", 4)))
    w2 = hub.add(_Msg(), "x", 0)  # type: ignore[arg-type]
    hub.listed(w2, _list(4, ("x1", 2), ("x3", 4)))
    for kind, name, e in [("created", "x1", 2), ("created", "x2", 3), ("removed", "x2", 3),
                          ("created", "x3", 4),  # (late: made before the list)
                          ("created", "x4", 5), ("removed", "x1", 2)]:
        hub.event(kind, name, 0, e)
    want = [("created", "x1", True), ("created", "x3", True), ("listed", "", False),
            ("created", "x4", False), ("removed", "x1", False)]
    assert b.answers[id(w1)] == want
    assert b.answers[id(w2)] == want
    w1.finish()
    w2.finish()
    assert hub.live is None  # no lister left: the table is gone


def test_watchers_share_one_table() -> None:
    """Memory: a watcher of N namespaces costs O(1), not O(N) -- the
    namespaces live once, in the hub's table (each watcher kept its own
    copy, ~200 bytes per namespace, before)."""
    n, nw = 5000, 12
    wire = msgpack.packb(_list(n, *((f"job-{i:06d}", i + 1) for i in range(n))))
    hub = NsHub(_Backend(record=False))
    gc.collect()
    # (no collection while measuring: in a test worker whose heap other
    # tests filled, each gc.collect() took seconds; what a watcher keeps
    # is live, found by reference counting alone)
    gc.disable()
    tracemalloc.start()
    try:
        marks, held = [], []
        for _ in range(nw):
            w = hub.add(_Msg(), "", 0)  # type: ignore[arg-type]
            held.append(w)  # (the module holds its watchers)
            hub.listed(w, msgpack.unpackb(wire))  # its own list, as from rank 0
            marks.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
        gc.enable()
    per_watcher = (marks[-1] - marks[1]) / (nw - 2)
    assert per_watcher < 4096, f"{per_watcher:.0f} bytes per watcher of {n} namespaces"
    assert len(held) == len(hub.watchers) == nw


def test_cancelled_waiting_watchers_leave_the_waiting_set() -> None:
    """Watchers whose list is ahead of the table wait (``NsHub.waiting``);
    each that is cancelled, in any order, leaves it, and the table stays
    while a listing watcher remains.  (How fast: kept in a list, each left
    by a scan, 30,000 cancelled newest first took 10 s, quadratic; as a
    dict, 0.02 s -- measured, not asserted: timings are not test asserts.)"""
    hub = NsHub(_Backend(record=False))
    first = hub.add(_Msg(), "", 0)  # type: ignore[arg-type]
    hub.listed(first, _list(0))  # the table, at epoch 0
    ws = [hub.add(_Msg(), "", 0) for _ in range(30000)]  # type: ignore[arg-type]
    for w in ws:
        hub.listed(w, _list(1))  # rank 0 made namespace 1: its event is on its way
    assert len(hub.waiting) == len(ws)
    for w in reversed(ws[1::2]):
        w.finish()
    assert len(hub.waiting) == len(ws) // 2
    for w in ws[::2]:
        w.finish()
    assert not hub.waiting and hub.live is not None  # (the first watcher still lists)
