"""Namespaces and kvs-watch: the job-1 / job-10 prefix case, removal (ENOTSUP for
every watcher), WAITCREATE on a namespace created later, and guests."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from typing import Any

import pytest
from test_broker_support import wait_until
from test_watch_helpers import (
    GUEST_UID,
    NO_MERGE,
    WAITCREATE,
    WATCH,
    T,
    answer,
    cancel,
    commit,
    end_errnum,
    ns_create,
    ns_remove,
    put,
    run_guest,
    stats,
    value,
    wait_watchers,
    watch_stream,
)

from broker.errors import RemoteError
from broker.handle import Handle, Stream
from kvs_watch.monitor import READY


async def values_to_the_end(s: Stream) -> tuple[list[bytes], int]:
    """Every value a watch answers, and the errno that ends it (0: ENODATA)."""
    got: list[bytes] = []
    try:
        while (msg := await asyncio.wait_for(s.next_message(), T)) is not None:
            got.append(bytes(msg.payload["val"]["data"]))
    except RemoteError as exc:
        return got, exc.errnum
    return got, 0


async def test_job1_job10_prefix_no_cross_talk(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h1, h2 = await connect(inst, 0), await connect(inst, 1), await connect(inst, 2)
    for ns in ("job-1", "job-10"):
        await ns_create(h0, ns)
        await commit(h0, put("k", f"{ns}:0"), ns=ns, sync=[h1, h2])
    only1 = watch_stream(h1, "k", ns="job-1")  # rank 1 watches job-1 only
    both1 = watch_stream(h2, "k", ns="job-1")  # rank 2 watches both
    both10 = watch_stream(h2, "k", ns="job-10")
    assert await value(only1) == b"job-1:0" and await value(both1) == b"job-1:0"
    assert await value(both10) == b"job-10:0"
    before1 = await stats(h1)
    before2 = await stats(h2)
    n = 5
    for i in range(1, n + 1):
        await commit(h0, put("k", f"job-10:{i}"), ns="job-10", flags=NO_MERGE)
    assert [await value(both10) for _ in range(n)] == [f"job-10:{i}".encode()
                                                       for i in range(1, n + 1)]
    await commit(h0, put("k", "job-1:1"), ns="job-1")
    for s in (only1, both1):  # the next job-1 answer is job-1's own commit
        p = await answer(s)
        assert (p["val"]["data"], p["rootseq"], p["namespace"]) == (b"job-1:1", 2, "job-1")
    after1 = await stats(h1)
    after2 = await stats(h2)
    dropped1 = after1["events"]["dropped"]["foreign"] - before1["events"]["dropped"]["foreign"]
    assert dropped1 == n  # job-10's setroots reach rank 1, which watches job-1 only
    assert after1["events"]["handled"] - before1["events"]["handled"] == 1
    assert after2["events"]["dropped"] == before2["events"]["dropped"]  # delivered once each
    assert after2["events"]["handled"] - before2["events"]["handled"] == n + 1
    # one subscription per module, however many namespaces it watches
    assert after1["events"]["subscribe_calls"] == 1 and after2["events"]["subscribe_calls"] == 1
    assert after1["namespace-count"] == 1 and after2["namespace-count"] == 2


async def test_namespace_removed_ends_every_watcher_with_enotsup(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await ns_create(h0, "testns2")
    await commit(h0, put("meep", "1"), ns="testns2", sync=h3)
    active = watch_stream(h3, "meep", ns="testns2")
    assert await value(active) == b"1"
    waiting_key = watch_stream(h3, "nokey", WATCH | WAITCREATE, ns="testns2")
    await wait_watchers(h0, 2, nodeid=3, ns="testns2")
    await ns_remove(h0, "testns2")
    assert await end_errnum(active) == errno.ENOTSUP
    assert await end_errnum(waiting_key) == errno.ENOTSUP
    await wait_watchers(h0, 0, nodeid=3)
    assert (await stats(h3))["namespace-count"] == 0


async def test_the_last_commits_before_a_removal_are_answered_before_enotsup(
        start_instance, connect):
    """A job's last eventlog entry, then its namespace removed at once: a
    watcher on the far rank (and one on rank 0) answers the entry, then ends
    ENOTSUP.  The removal's event used to end the watchers while their
    lookup of the last root was in flight, and the entry was lost.  Here
    the lookup is made slow on purpose: the setroot carries no blobs
    (``kvs.setroot-blob-limit=0``) and the entry is big, so rank 3 loads it
    from rank 0 while the removal's event is on its way."""
    inst = await start_instance(size=4, fanout=2, attrs={"kvs.setroot-blob-limit": "0"})
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    last = b"submit\n" + b"x" * (4 << 20) + b"\nclean\n"
    for i in range(5):
        ns = f"job-{i}"
        await ns_create(h0, ns)
        far = watch_stream(h3, "eventlog", WATCH | WAITCREATE, ns=ns)
        near = watch_stream(h0, "eventlog", WATCH | WAITCREATE, ns=ns)
        await wait_watchers(h0, 1, nodeid=3, ns=ns)
        await wait_watchers(h0, 1, nodeid=0, ns=ns)
        await commit(h0, put("eventlog", "submit\n"), ns=ns)
        await commit(h0, put("eventlog", last), ns=ns)
        await ns_remove(h0, ns)
        for where, s in (("rank 3", far), ("rank 0", near)):
            got, end = await values_to_the_end(s)
            assert end == errno.ENOTSUP and got and got[-1] == last, \
                (ns, where, [g[:8] for g in got], end)


async def test_waitcreate_namespace_created_later_then_removed(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h2 = await connect(inst, 0), await connect(inst, 2)
    ns = "ns_create_and_remove"
    s = watch_stream(h2, "test.k", WATCH | WAITCREATE, ns=ns)
    plain = watch_stream(h2, "test.k", WATCH, ns=ns)  # no WAITCREATE: ENOTSUP now
    with pytest.raises(RemoteError) as info:  # quoted as kvs.lookup quotes it
        await asyncio.wait_for(plain.next_message(), T)
    assert (info.value.errnum, info.value.errstr) == (
        errno.ENOTSUP, f"namespace {ns!r} does not exist")
    await wait_watchers(h0, 1, nodeid=2, ns=ns)
    await ns_create(h0, ns)
    await commit(h0, put("test.k", "0"), ns=ns)
    p = await answer(s)
    assert (p["val"]["data"], p["namespace"]) == (b"0", ns)
    await ns_remove(h0, ns)
    assert await end_errnum(s) == errno.ENOTSUP
    # a WAITCREATE watcher still waiting for its key also gets ENOTSUP on
    # removal, once it has started at a root of the namespace (a removal
    # before that leaves it waiting for the next namespace of the name, as
    # if the watch had come after: kvs_watch/module.py, _removed)
    await ns_create(h0, "ns_remove")
    s2 = watch_stream(h2, "test.k", WATCH | WAITCREATE, ns="ns_remove")
    await wait_watchers(h0, 1, nodeid=2, ns="ns_remove")

    async def started() -> bool:
        return bool((await stats(h0, 2))["namespaces"]["ns_remove"]["state"] == READY)

    await wait_until(started, "rank 2's monitor of ns_remove to have its root", T)
    await ns_remove(h0, "ns_remove")
    assert await end_errnum(s2) == errno.ENOTSUP
    await wait_watchers(h0, 0, nodeid=2)


async def test_job_pattern_on_a_far_rank_asks_rank_0_nothing_for_waitcreate(
        start_instance, connect):
    """A namespace created, then watched WAITCREATE on rank 3 and committed:
    rank 3 heard it created, so the watch starts from that root (kvs.getroot
    with heard, no round trip to rank 0) and the commit's setroot brings the
    value.  (A read's freshness: test_kvs_rpc_events.)

    Whether rank 3 has heard the ``created`` event when the watch comes is
    a race (the event goes 0 -> 1 -> 3, the watch test -> 3): the first
    round waits until rank 3's kvs has heard it, so one watch at least
    takes the heard root whatever the load; the others race, as jobs do.
    (They all lost it when rank 1 was held up a moment: getroot-heard 0.)"""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)

    async def heard() -> int:
        return int((await stats(h3, 3, service="kvs"))["heard"])

    before = await heard()
    for i in range(10):
        ns = f"job-{i}"
        await ns_create(h0, ns)
        if i == 0:
            await wait_until(lambda: _is(heard(), before + 1), f"rank 3 to hear {ns} created")
        s = watch_stream(h3, "eventlog", WATCH | WAITCREATE, ns=ns)
        await commit(h0, put("jobspec", "{}"), put("eventlog", f"submit {i}"), ns=ns)
        assert await value(s) == f"submit {i}".encode()
        await commit(h0, put("eventlog", f"submit {i}\nstart"), ns=ns)
        assert await value(s) == f"submit {i}\nstart".encode()
        cancel(h3, s)
        assert await end_errnum(s) == 0
        await ns_remove(h0, ns)
    kvs3 = await stats(h0, 3, service="kvs")
    # (a created event still on its way when a watch came: rank 0 answered;
    # on 2 loaded cores that was 6 of the 10 once, so this asks for the
    # first round's)
    assert kvs3["counts"]["getroot-heard"] >= 1 and kvs3["events"]["subscribe_calls"] == 1
    # the setroots brought their blobs: at most one fetch, of the empty root
    # every namespace starts with (a created event carries none)
    assert kvs3["counts"]["blob-fetches"] <= 1


async def _is(aw: Any, want: int) -> bool:
    return bool(await aw == want)


async def test_guests_watch_only_namespaces_they_own(start_instance, connect):
    inst = await start_instance(size=4, fanout=2, attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    await commit(h0, put("test.g", "42"), put("secret", "s3cr3t"))
    await ns_create(h0, "guestns", owner=GUEST_UID)
    await ns_create(h0, "otherns", owner=GUEST_UID - 1)
    await commit(h0, put("test.i", "69"), put("link", {"ver": 1, "type": "symlink", "data": {
        "target": "secret", "namespace": "primary"}}), ns="guestns")
    await commit(h0, put("test.j", "102"), ns="otherns")
    result = await asyncio.to_thread(run_guest, inst.uri(3), """
        async def body(h):
            out = {
                "own": await first(h, "test.i", "guestns"),
                "primary": await first(h, "test.g", "primary"),
                "other": await first(h, "test.j", "otherns"),
                "link": await first(h, "link", "guestns"),
                "readlink": await first(h, "link", "guestns", 4 | 2),
            }
            return out
    """)
    assert result["own"] == {"val": "69"}
    assert result["primary"] == {"errnum": errno.EPERM}
    assert result["other"] == {"errnum": errno.EPERM}
    assert result["link"] == {"errnum": errno.EPERM}  # kvs checked the guest's access
    assert result["readlink"] == {"val": "symlink"}  # the link itself is the guest's


async def test_guest_waitcreate_namespace_owned_later(start_instance, connect):
    inst = await start_instance(size=4, fanout=2, attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    guest = asyncio.ensure_future(asyncio.to_thread(run_guest, inst.uri(1), """
        async def body(h):
            out = {}
            for ns in ("mine", "notmine"):
                s = h.rpc_stream("kvs-watch.lookup",
                                 {"namespace": ns, "key": "k", "flags": 4 | 8})
                try:
                    msg = await asyncio.wait_for(s.next_message(), 20)
                    out[ns] = msg.payload["val"]["data"].decode()
                except RemoteError as exc:
                    out[ns] = exc.errnum
            return out
    """))
    await wait_watchers(h0, 1, nodeid=1, ns="mine", timeout=20)
    await ns_create(h0, "mine", owner=GUEST_UID)
    await commit(h0, put("k", "yes"), ns="mine")
    await wait_watchers(h0, 1, nodeid=1, ns="notmine", timeout=20)
    await ns_create(h0, "notmine")
    await commit(h0, put("k", "no"), ns="notmine")
    assert await asyncio.wait_for(guest, 30) == {"mine": "yes", "notmine": errno.EPERM}



async def test_guest_stats_get_hides_foreign_rootrefs(start_instance, connect):
    """A root reference is a capability in Flux (``kvs.lookup`` with
    ``rootdir`` needs no access to the namespace), so ``kvs-watch.stats-get``
    shows a guest its own namespaces only: with another's rootref, it read
    every key of a namespace someone was watching."""
    inst = await start_instance(size=2, fanout=2, attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "theirs", owner=GUEST_UID - 1)
    await ns_create(h0, "guestns", owner=GUEST_UID)
    await commit(h0, put("secret", "s3cr3t"), ns="theirs")
    await commit(h0, put("k", "v"), ns="guestns")
    s1 = watch_stream(h0, "secret", ns="theirs", nodeid=1)
    s2 = watch_stream(h0, "k", ns="guestns", nodeid=1)
    assert await value(s1) == b"s3cr3t" and await value(s2) == b"v"
    owner_view = (await stats(h0, 1))["namespaces"]
    assert owner_view["theirs"]["rootref"].startswith("sha") and owner_view["guestns"]["rootref"]
    result = await asyncio.to_thread(run_guest, inst.uri(1), """
        async def body(h):
            st = await asyncio.wait_for(h.rpc("kvs-watch.stats-get", {}), 10)
            out = {"namespaces": st["namespaces"], "read": None}
            ref = st["namespaces"].get("theirs", {}).get("rootref")
            if ref:
                try:
                    v = await asyncio.wait_for(h.rpc("kvs.lookup", {
                        "key": "secret", "flags": 0, "namespace": "guestns",
                        "rootdir": {"ver": 1, "type": "dirref", "data": [ref]}}), 10)
                    out["read"] = v["val"]["data"].decode()
                except RemoteError as exc:
                    out["read"] = exc.errnum
            return out
    """)
    assert result["read"] is None, result
    # another's namespace is not shown at all (not even its name); its own is
    assert list(result["namespaces"]) == ["guestns"], result
    assert result["namespaces"]["guestns"]["rootref"] == owner_view["guestns"]["rootref"]


async def test_a_plain_watch_starts_no_older_than_a_read_on_its_rank(start_instance,
                                                                    connect) -> None:
    """A WAITCREATE watch on a far rank made kvs-watch follow a namespace
    from the root that rank heard (or its ``created`` event); a plain watch
    that came next shared that root while a commit's setroot was still on
    its way, and ended ENOENT for a key a read on the same rank had just
    returned (34 of 100 rounds at size 8, ENOTSUP in some).  It now starts
    no older than what a read there has seen: after a get on the rank
    returned the key, a watch of it on that rank sees it too."""
    from kvs.client import KVS
    from kvs_watch.client import watch

    inst = await start_instance(size=8, fanout=2)
    h0, far = await connect(inst, 0), await connect(inst, 7)
    outcomes = []
    async with asyncio.timeout(120):
        for i in range(30):
            ns = f"fresh{i}"
            pre = watch(far, "other", namespace=ns, waitcreate=True).start()

            async def following(name: str = ns) -> bool:
                return name in (await stats(far, 7))["namespaces"]

            await wait_until(following, "kvs-watch on rank 7 to follow the namespace")
            await KVS(h0).namespace_create(ns)
            await KVS(h0, ns).put("k", "1")
            try:
                got: object = await KVS(far, ns).get("k")
            except RemoteError as exc:  # (the rank had not caught up: so be it)
                got = exc.errstr
            try:
                async with watch(far, "k", namespace=ns) as w:
                    entry = await anext(w)
                watched: object = entry.value  # type: ignore[union-attr]
            except RemoteError as exc:
                watched = exc.errstr
            if got == b"1":  # a read on the rank saw the commit: so must a watch after it
                outcomes.append(watched)
            await pre.cancel()
            await KVS(h0).namespace_remove(ns)
    assert len(outcomes) >= 10 and outcomes == [b"1"] * len(outcomes), outcomes


async def test_a_malformed_setroot_is_dropped_as_kvs_drops_it(start_instance, connect):
    """A setroot whose fields rank 0's kvs never sends (a rootseq that is
    not an int, a rootref that is not a blobref) is dropped as foreign by
    kvs-watch, as the kvs module drops it: one such event (the instance
    owner's: kvs.* is theirs only) ended a watch with EINVAL (a lookup at
    root "5"), or set its root to a rootseq no real commit ever reached, or
    raised out of on_event (received but neither handled nor dropped).
    The watch goes on to the next real commit, and every event is counted."""
    inst = await start_instance(size=2, fanout=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("a", "1"), sync=h1)
    s = watch_stream(h1, "a")
    assert await value(s) == b"1"
    before = (await stats(h1))["events"]
    forged = [
        {"rootseq": 10**6, "rootref": 5},
        {"rootseq": float("inf"), "rootref": "sha256-" + "0" * 64},
        {"rootseq": True, "rootref": "sha256-" + "0" * 64},
        {"rootseq": 10**6, "rootref": "not-a-blobref"},
    ]
    for p in forged:
        await h0.publish("kvs.namespace-primary-setroot",
                         {"namespace": "primary", "names": [], "keys": ["a"], **p})
    await commit(h0, put("a", "2"))
    assert await value(s) == b"2"  # the real commit, not a forged root's answer
    after = (await stats(h1))["events"]
    assert after["received"] - before["received"] == len(forged) + 1
    assert after["dropped"]["foreign"] - before["dropped"]["foreign"] == len(forged)
    assert after["handled"] - before["handled"] == 1
    assert after["received"] == after["handled"] + sum(after["dropped"].values())


async def test_a_watch_whose_first_root_is_on_its_way_when_the_namespace_goes(
        start_instance, connect):
    """kvs-watch on rank 1 asks its kvs for a namespace's root, which asks
    rank 0 (rank 1 has not loaded it); rank 0 answers, then removes the
    namespace, and rank 1 reads the answer and the ``removed`` event in one
    turn.  The event is handled first (the answer's callbacks run at the
    next turn), by a monitor with no root yet.  Its watchers have seen
    nothing of the namespace: a ``WAITCREATE`` one waits for the next
    namespace of the name, a plain one ends ``ENOTSUP`` (no such
    namespace).  (The WAITCREATE one ended ``ENOTSUP`` with no answer, an
    outcome no order of its request and the removal gives: CI, a
    test_watch_nsmodel late watcher.)

    The order is made with SIGSTOP: rank 0 stopped while rank 1 sends it
    the root request, then the removal (in that order, on one link); rank
    1 stopped while rank 0 handles both.  Should rank 1 still take them in
    two turns, the watch starts from the root and answers it before
    ``ENOTSUP``: an order the removal and the request allow, accepted (as
    when the removal had not left rank 1 when it stopped)."""
    from test_broker_support import stop_process, stopped

    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    ns = "job-gone"
    await ns_create(h0, ns)
    await commit(h0, put("k", "1"), ns=ns)
    rank0, rank1 = inst.pids()[0], inst.pids()[1]

    async def loading() -> bool:  # rank 1's kvs has asked rank 0 for the root
        held = (await stats(h1, 1, service="kvs"))["namespaces"]
        return ns in held and held[ns]["rootseq"] < 0

    async with stopped(rank0):
        plain = watch_stream(h1, "k", WATCH, ns=ns)  # makes the monitor: getroot from rank 0
        waiting = watch_stream(h1, "k", WATCH | WAITCREATE, ns=ns)
        await wait_until(loading, what="rank 1 to ask rank 0 for the root")
        await wait_watchers(h1, 2, nodeid=1, ns=ns)
        removal = h1.rpc("kvs.namespace-remove", {"namespace": ns}, nodeid=0)
        await asyncio.wait_for(h1.rpc("broker.ping", {}, nodeid=1), T)  # (the removal is sent)
        await stop_process(rank1)
    try:
        async def removed() -> bool:
            return bool((await stats(h0, 0, service="kvs"))["counts"]["namespaces-removed"])
        # (the removal is on its way unless rank 1's ZeroMQ thread, stopped
        # with it, had not written it out yet: then it goes once rank 1
        # runs, after the answer, the second order above)
        with contextlib.suppress(AssertionError):
            await wait_until(removed, timeout=5, what="rank 0 to remove the namespace")
    finally:
        os.kill(rank1, signal.SIGCONT)
    await asyncio.wait_for(removal, T)

    got, end = await values_to_the_end(plain)
    assert end == errno.ENOTSUP and got in ([], [b"1"]), (got, end)
    if got == [b"1"]:  # (the monitor had its root: both watchers started before the removal)
        assert await value(waiting) == b"1" and await end_errnum(waiting) == errno.ENOTSUP
        return
    await ns_create(h0, ns)  # the waiting watcher follows the next namespace of the name
    await commit(h0, put("k", "2"), ns=ns)
    assert await value(waiting) == b"2"


async def test_a_plain_watch_ended_by_a_removal_before_its_root_came_logs_nothing(
        tmp_path) -> None:
    """A plain watch (no ``WAITCREATE``) joins a monitor that a waiting one
    keeps on rank 1, and asks the kvs for a fresh root; the namespace's
    removal, sent at the same time, ends it first, and the kvs's answer is
    ``ENOTSUP`` too.  Nobody read that answer: each such watch logged
    "Future exception was never retrieved" at ERROR on rank 1 (a
    test_watch_nsmodel run's rank log; 42 of 50 tries here)."""
    from broker.launch import Instance

    log = tmp_path / "ranks.log"
    inst = Instance(2, stderr_path=str(log))
    await asyncio.wait_for(inst.start(), 60)
    try:
        h0, h1 = await Handle.connect(inst.uri(0)), await Handle.connect(inst.uri(1))
        for i in range(30):
            ns = f"job-{i}"
            await ns_create(h0, ns)
            await commit(h0, put("k", "1"), ns=ns)
            waiting = watch_stream(h1, "k", WATCH | WAITCREATE, ns=ns)
            assert await value(waiting) == b"1"
            removal = h0.rpc("kvs.namespace-remove", {"namespace": ns})
            plain = watch_stream(h1, "k", WATCH, ns=ns)
            await asyncio.wait_for(removal, T)
            for s in (waiting, plain):  # (plain: from the root or not, it ends so)
                assert (await values_to_the_end(s))[1] == errno.ENOTSUP
        await h0.close()
        await h1.close()
    finally:
        await asyncio.wait_for(inst.stop(), 60)
    text = log.read_text()
    assert "never retrieved" not in text and "Traceback" not in text, text
