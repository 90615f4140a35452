"""Pure parts of :mod:`kvs.namespaces`: the transactions a follower
relayed, settled by the events that name them; the guests' recent roots;
the namespaces a follower heard created; event topics."""

from __future__ import annotations

import asyncio
import errno
import heapq

import pytest

from broker.errors import ErrnoError
from kvs.namespaces import Heard, HeardRoot, Namespace, RecentRoots, event_topic_parts


async def test_finish_settles_only_the_named_transactions() -> None:
    ns = Namespace("job-1", owner=0, rootref="r0", rootseq=0)
    a, b = ns.expect("3.1"), ns.expect("3.2")
    ns.set_root(1, "r1")
    ns.finish(["1.7", "3.1", 42], 1, "r1")  # others' names and junk are ignored
    assert a.result() == (1, "r1")
    assert not b.done() and list(ns.relayed) == ["3.2"]


async def test_fail_carries_errno_and_message() -> None:
    ns = Namespace("job-1", owner=0, rootref="r0", rootseq=0)
    a = ns.expect("3.1")
    ns.fail(["3.1"], errno.EISDIR, "d is a directory")
    with pytest.raises(ErrnoError) as info:
        a.result()
    assert (info.value.errnum, info.value.errstr) == (errno.EISDIR, "d is a directory")
    assert ns.relayed is None  # none left: the table is given back


async def test_remove_fails_relayed_and_refuses_new_ones() -> None:
    ns = Namespace("job-1", owner=0, rootref="r0", rootseq=0)
    a = ns.expect("3.1")
    ns.remove()
    with pytest.raises(ErrnoError) as info:
        await asyncio.wait_for(a, 5)
    assert info.value.errnum == errno.ENOTSUP
    assert ns.relayed is None
    with pytest.raises(ErrnoError):
        ns.expect("3.2")


def test_recent_roots_are_kept_per_guest() -> None:
    """One guest's commits never push out another's roots (the cache was
    shared: 4,096 commits of guest B made guest A's last root EPERM), and
    a root two guests' namespaces reach is each one's."""
    recent = RecentRoots(size=3)
    ns = Namespace("a", owner=1001, rootref="a0", rootseq=0, recent=recent)
    recent.note("a0", 1001)
    ns.set_root(1, "a1")
    for i in range(100):
        recent.note(f"b{i}", 1002)
    recent.note("shared", 1002)
    ns.set_root(2, "shared")
    assert [recent.known(1001, r) for r in ("a0", "a1", "shared")] == [True, True, True]
    assert recent.known(1002, "shared") and not recent.known(1002, "a1")
    assert not recent.known(1002, "b0") and recent.known(1002, "b99")  # its own last 3
    ns.set_root(3, "a3")
    assert not recent.known(1001, "a0") and recent.known(1001, "a3")
    assert len(recent) == 6


async def test_an_idle_namespace_holds_no_waiter_heap_or_relay_table() -> None:
    """Memory per namespace: the version waiters' heap and the relayed
    transactions' table exist only while something waits in them."""
    ns = Namespace("job-2", owner=0, rootref="r0", rootseq=0)
    assert ns._waiters is None and ns.relayed is None
    wait = asyncio.ensure_future(ns.wait_version(1))
    relay = ns.expect("3.1")
    await asyncio.sleep(0)  # the wait is in the heap
    assert ns.waiters == 1 and ns._waiters is not None and ns.relayed is not None
    ns.set_root(1, "r1")
    ns.finish(["3.1"], 1, "r1")
    await asyncio.wait_for(wait, 5)
    assert relay.result() == (1, "r1")
    assert ns._waiters is None and ns.relayed is None
    ns.expect("3.2")
    ns.forget_relayed("3.2")  # its requester went away
    assert ns.relayed is None


async def test_a_wait_cancelled_after_its_version_came_is_counted_once() -> None:
    """A wait whose version arrived, cancelled before its task resumed (its
    client went away at that moment), is not counted out a second time."""
    ns = Namespace("job-3", owner=0, rootref="r0", rootseq=0)
    early = asyncio.ensure_future(ns.wait_version(1))
    later = asyncio.ensure_future(ns.wait_version(5))
    await asyncio.sleep(0)  # both waits are in the heap
    assert ns.waiters == 2
    ns.set_root(1, "r1")  # early's version: counted out here...
    early.cancel()  # ...and cancelled before it resumed
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(early, 5)
    assert ns.waiters == 1
    later.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(later, 5)
    assert ns.waiters == 0


async def test_cancelled_version_waits_are_dropped_lazily(monkeypatch) -> None:
    """A client that left with 100k waits cost rank 0 O(n^2) (the heap was
    rebuilt per cancelled wait: over 17 minutes at full CPU).  Cancelled
    waits now stay in the heap, skipped, until they are half of it."""
    rebuilds = []
    heapify = heapq.heapify
    monkeypatch.setattr(heapq, "heapify", lambda h: (rebuilds.append(len(h)), heapify(h)))
    ns = Namespace("primary", 0, "sha256-" + "0" * 64, 1)
    waits = [asyncio.ensure_future(ns.wait_version(2 + i % 50)) for i in range(10_000)]
    await asyncio.sleep(0)  # every wait is in the heap
    assert ns.waiters == 10_000
    live = waits[::3]
    gone = [w for w in waits if w not in set(live)]
    for w in gone:
        w.cancel()
    await asyncio.wait_for(asyncio.gather(*gone, return_exceptions=True), 5)
    assert ns.waiters == len(live)
    assert len(rebuilds) <= 2  # not once per cancelled wait (6,666 of them)
    assert len(ns._waiters) <= 2 * len(live) + 16  # compacted, not left to grow
    ns.set_root(25, "sha256-" + "1" * 64)  # wakes exactly the live ones at <= 25
    await asyncio.sleep(0)
    woken = [w for w in live if w.done()]
    assert woken == [w for i, w in enumerate(waits) if w in set(live) and 2 + i % 50 <= 25]
    assert ns.waiters == len(live) - len(woken)
    ns.remove()
    assert ns.waiters == 0
    await asyncio.wait_for(asyncio.gather(*live, return_exceptions=True), 5)


def created(owner=1000, rootref="sha256-0", **kw):
    return {"namespace": "x", "rootseq": 0, "rootref": rootref, "owner": owner,
            "flags": 0, "epoch": 7, **kw}


def test_heard_follows_setroots_until_taken_or_removed() -> None:
    heard = Heard()
    assert heard.created("job-1", created())
    heard.setroot("job-1", 2, "sha256-2")
    heard.setroot("job-1", 1, "sha256-1")  # older: ignored
    assert heard.created("job-2", created(owner=0))
    heard.removed("job-2")
    assert "job-2" not in heard and len(heard) == 1
    assert heard.take("job-1") == HeardRoot(1000, 2, "sha256-2", 0, 7)
    assert heard.take("job-1") is None and len(heard) == 0


def test_heard_refuses_fields_rank_0_never_sends() -> None:
    heard = Heard()
    for bad in (created(owner="0"), created(rootref=None), created(epoch=1.5),
                created(flags=None), created(rootseq="0")):
        assert not heard.created("job-1", bad)
    assert len(heard) == 0


def test_heard_forgets_the_oldest_beyond_its_limit() -> None:
    heard = Heard(limit=3)
    for i in range(5):
        heard.created(f"job-{i}", created())
    heard.setroot("job-2", 1, "sha256-1")  # (being current does not make it younger)
    heard.created("job-5", created())
    assert [f"job-{i}" in heard for i in range(6)] == [False] * 3 + [True] * 3


def test_event_topic_parts() -> None:
    assert event_topic_parts("kvs.namespace-job-1-setroot") == ("job-1", "setroot")
    assert event_topic_parts("kvs.namespace-primary-removed") == ("primary", "removed")
    for topic in ("kvs.namespace-", "kvs.namespace--created", "kvs.namespaceX-a-b",
                  "kvs.namespace-setroot", "other.namespace-a-setroot"):
        assert event_topic_parts(topic) is None, topic
