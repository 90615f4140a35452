"""Namespace events (docs/protocol.md) as the kvs module sees and counts them.

Every rank's kvs subscribes once, to ``kvs.namespace-``.  A follower handles
setroot, removed and error of the namespaces it loaded, remembers those it
hears created (kvs-watch's ``kvs.getroot`` with ``heard`` is answered from
them), and drops the events of namespaces it does not follow (``foreign``);
rank 0 drops created.
"""

from __future__ import annotations

import asyncio
import errno

import pytest
from test_broker_support import RawClient
from test_kvs_rpc_helpers import APPEND, T, commit, errnum, get, getroot, put, stats

from broker import codec
from broker.errors import RemoteError
from broker.message import Message, MsgType
from kvs.namespaces import HEARD_LIMIT


def ns_create(h, name: str):
    return asyncio.wait_for(
        h.rpc("kvs.namespace-create", {"namespace": name, "owner": -1}), T)


def ns_remove(h, name: str):
    return asyncio.wait_for(h.rpc("kvs.namespace-remove", {"namespace": name}), T)


async def wait_version(h, ns: str, rootseq: int) -> None:
    await asyncio.wait_for(h.rpc("kvs.wait-version", {"namespace": ns, "rootseq": rootseq}), T)


async def ev(h) -> dict:
    return (await stats(h))["events"]


async def kvs_subscriptions(h, rank: int) -> int:
    st = await asyncio.wait_for(h.rpc("broker.stats-get", {}, nodeid=rank), T)
    return st["subscriptions"].get("m:kvs", 0)


async def test_rank0_subscribes_once(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    before = await ev(h0)
    assert before["subscribe_calls"] == 1
    for i in range(6):
        await ns_create(h3 if i % 2 else h0, f"ns{i}")
        await commit(h3, put("k", str(i)), ns=f"ns{i}")
        await commit(h0, put("k", str(i)), ns=f"ns{i}")
        assert await get(h3, "k", ns=f"ns{i}") == str(i).encode()
    await commit(h0, put("p", "1"))
    after = await ev(h0)
    assert after["subscribe_calls"] == 1
    assert await kvs_subscriptions(h0, 0) == 1
    # rank 0 saw its own events: created dropped, setroot handled
    assert after["dropped"]["created"] - before["dropped"]["created"] == 6
    assert after["handled"] - before["handled"] >= 13
    assert after["dropped"]["foreign"] == 0
    assert after["received"] >= after["handled"] + after["dropped"]["created"]


async def recv_until(h, topic: str):
    """The client's next event named ``topic`` (others before it skipped)."""
    async with asyncio.timeout(T):
        while True:
            msg = await h.recv_event()
            if msg.topic == topic:
                return msg


async def test_follower_subscribes_once_and_follows_what_it_loaded_or_heard(
        start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h1 = await connect(inst, 1)
    # this client sees the events when rank 1's kvs does (same rank, same order)
    await asyncio.wait_for(h1.subscribe("kvs.namespace-"), T)
    base = await stats(h1)
    assert base["events"]["subscribe_calls"] == 1
    assert await kvs_subscriptions(h0, 1) == 1
    assert "primary" not in base["namespaces"]  # rank 1 has read nothing yet

    # created, then committed on rank 0: rank 1 hears both, loads nothing
    await ns_create(h0, "job-1")
    await ns_create(h0, "job-10")
    resp = await commit(h0, put("a", "1"), ns="job-1")
    await recv_until(h1, "kvs.namespace-job-1-setroot")
    st = await stats(h1)
    assert st["heard"] == 2 and st["namespace-count"] == 0
    assert st["events"]["handled"] - base["events"]["handled"] == 3
    # kvs-watch's getroot (heard: true) is answered from what rank 1 heard
    heard = await asyncio.wait_for(h1.rpc("kvs.getroot", {"namespace": "job-1",
                                                           "heard": True}), T)
    assert (heard["rootseq"], heard["rootref"]) == (resp["rootseq"], resp["rootref"])
    st = await stats(h1)
    assert st["counts"]["getroot-heard"] == 1 and st["namespace-count"] == 0
    # a read loads job-1 from rank 0, and finds the blobs the setroot brought
    assert await get(h1, "a", ns="job-1") == b"1"
    st = await stats(h1)
    assert st["counts"]["namespaces-loaded"] == 1 and st["counts"]["blob-fetches"] == 0
    assert st["heard"] == 1 and st["namespace-count"] == 1

    # job-10, heard and not loaded, is kept current by its setroots
    for i in range(3):
        await commit(h0, put("b", str(i)), ns="job-10")
    await commit(h0, put("a", "2"), ns="job-1")
    await recv_until(h1, "kvs.namespace-job-1-setroot")
    st2 = await stats(h1)
    assert st2["events"]["handled"] - st["events"]["handled"] == 4
    heard = await asyncio.wait_for(h1.rpc("kvs.getroot", {"namespace": "job-10",
                                                           "heard": True}), T)
    assert heard["rootseq"] == 3
    assert await get(h1, "a", ns="job-1") == b"2"
    assert await get(h1, "b", ns="job-10") == b"2"

    # primary was created before any of this: rank 1 neither loaded nor
    # heard of it, so its events are dropped without a look at their payload
    st = await stats(h1)
    await commit(h0, put("p", "1"))
    await recv_until(h1, "kvs.namespace-primary-setroot")
    st2 = await stats(h1)
    assert st2["events"]["dropped"]["foreign"] - st["events"]["dropped"]["foreign"] == 1
    assert await get(h1, "p") == b"1"
    # however many namespaces it follows: one subscription
    st = await stats(h1)
    assert st["counts"]["namespaces-loaded"] == 3 and st["heard"] == 0
    assert st["events"]["subscribe_calls"] == 1
    assert await kvs_subscriptions(h0, 1) == 1

    # an error event (failed commit) is handled, not dropped
    resp = await commit(h0, put("dir.x", "1"), ns="job-1")
    await wait_version(h1, "job-1", resp["rootseq"])
    st = await ev(h1)
    assert await errnum(commit(h1, put("dir", "z", APPEND), ns="job-1")) == errno.EISDIR
    resp = await commit(h0, put("after-error", "1"), ns="job-1")
    await wait_version(h1, "job-1", resp["rootseq"])
    st2 = await ev(h1)
    assert st2["handled"] - st["handled"] == 2  # the error and the setroot
    assert st2["dropped"]["error"] == 0

    # removal: rank 1 forgets job-10; created again, it is heard again
    await ns_remove(h0, "job-10")
    await recv_until(h1, "kvs.namespace-job-10-removed")
    assert await errnum(get(h1, "b", ns="job-10")) == errno.ENOTSUP
    assert "job-10" not in (await stats(h1))["namespaces"]
    await ns_create(h0, "job-10")
    await recv_until(h1, "kvs.namespace-job-10-created")
    assert (await stats(h1))["heard"] == 1
    assert (await stats(h1))["events"]["subscribe_calls"] == 1


async def test_a_first_read_on_a_far_rank_sees_the_commit_before_it(
        start_instance, connect) -> None:
    """Read-your-writes across ranks for a namespace the far rank has not
    loaded: the read asks rank 0 for the root (as Flux), even though the
    rank heard the namespace created and its setroot may still be on its
    way (the root it heard would lack the commit)."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    for i in range(20):
        await ns_create(h0, f"job-{i}")
        await commit(h0, put("jobspec", f"spec-{i}"), ns=f"job-{i}")
        assert await get(h3, "jobspec", ns=f"job-{i}") == f"spec-{i}".encode()
    assert (await stats(h3))["counts"]["getroot-heard"] == 0


async def test_a_namespace_is_heard_within_bounds(start_instance, connect) -> None:
    """A follower remembers the last kvs.HEARD_LIMIT namespaces heard
    created; for an older one, getroot with heard asks rank 0 as before."""
    inst = await start_instance(size=2, fanout=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    n = HEARD_LIMIT + 5
    async with asyncio.timeout(60):
        await asyncio.gather(*(ns_create(h0, f"h-{i}") for i in range(n)))
    await wait_version(h1, f"h-{n - 1}", 0)  # (loads the last: all created were heard)
    assert (await stats(h1))["heard"] == HEARD_LIMIT - 1
    for name in ("h-0", f"h-{n - 2}"):
        await asyncio.wait_for(h1.rpc("kvs.getroot", {"namespace": name, "heard": True}), T)
    counts = (await stats(h1))["counts"]
    assert counts["namespaces-loaded"] == 2 and counts["getroot-heard"] == 1


async def test_unknown_namespace_leaves_no_subscription(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h3 = await connect(inst, 3)
    subs = await kvs_subscriptions(h3, 3)
    for _ in range(3):
        assert await errnum(get(h3, "k", ns="nope")) == errno.ENOTSUP
        assert await errnum(commit(h3, put("k", "v"), ns="nope")) == errno.ENOTSUP
    assert await kvs_subscriptions(h3, 3) == subs == 1
    assert "nope" not in (await stats(h3))["namespaces"]


async def test_event_payloads(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h2 = await connect(inst, 2)
    owner = await asyncio.wait_for(h0.attr_get("security.owner"), T)
    await asyncio.wait_for(h2.subscribe("kvs.namespace-evns"), T)
    await ns_create(h0, "evns")
    resp = await commit(h2, put("a.b", "1"), put("..c.", "2"), put("a.b", "3"), ns="evns")
    assert await errnum(commit(h2, put("a", "z", APPEND), ns="evns")) == errno.EISDIR
    await ns_remove(h0, "evns")
    got = []
    async with asyncio.timeout(T):
        while len(got) < 4:
            got.append(await h2.recv_event())
    topics = [e.topic for e in got]
    assert topics == ["kvs.namespace-evns-created", "kvs.namespace-evns-setroot",
                      "kvs.namespace-evns-error", "kvs.namespace-evns-removed"]
    created, setroot, error, removed = (e.payload for e in got)
    assert created == {"namespace": "evns", "rootseq": 0, "rootref": created["rootref"],
                       "owner": owner, "flags": 0, "epoch": created["epoch"]}
    assert type(created["epoch"]) is int and created["epoch"] > 0
    assert created["rootref"].startswith("sha256-")
    assert set(setroot) == {"namespace", "rootseq", "rootref", "names", "keys", "owner",
                            "blobs"}
    # the commit's new blobs ride along to prime followers' caches
    assert setroot["rootref"] in setroot["blobs"]
    assert all(isinstance(b, bytes) for b in setroot["blobs"].values())
    assert setroot["namespace"] == "evns" and setroot["owner"] == owner
    assert (setroot["rootseq"], setroot["rootref"]) == (resp["rootseq"], resp["rootref"])
    assert setroot["keys"] == ["a.b", "c"]
    assert len(setroot["names"]) == 1 and isinstance(setroot["names"][0], str)
    assert set(error) == {"namespace", "names", "errnum", "errstr"}
    assert error["namespace"] == "evns" and error["errnum"] == errno.EISDIR
    assert isinstance(error["errstr"], str) and error["errstr"]
    assert len(error["names"]) == 1 and error["names"] != setroot["names"]
    # which namespace of the name went, and whose (kvs-watch.namespaces)
    assert removed == {"namespace": "evns", "owner": owner, "epoch": created["epoch"]}
    assert all(e.userid == owner for e in got)


async def test_a_setroot_carries_the_smallest_new_blobs_when_all_are_too_many_bytes(
        start_instance, connect) -> None:
    """Past ``kvs.setroot-blob-limit`` (8 KiB) of new blobs, the smallest
    that fit still ride along (each saves a follower a ``content.load``):
    the root directory goes, the 20 KB value stays behind, and the
    follower reads the value all the same.  Before, none went."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await asyncio.wait_for(h1.subscribe("kvs.namespace-primary-setroot"), T)
    big, small = b"x" * 20_000, b"y" * 3_000
    resp = await commit(h0, put("d.big", big), put("d.small", small))
    async with asyncio.timeout(T):
        setroot = (await h1.recv_event()).payload
    assert setroot["rootref"] == resp["rootref"]
    carried = setroot["blobs"]
    assert resp["rootref"] in carried and small in carried.values()
    assert big not in carried.values() and sum(map(len, carried.values())) <= 8 << 10
    got = await asyncio.wait_for(h1.rpc("kvs.lookup", {"key": "d.big", "namespace": "primary"}),
                                 T)
    assert got["val"]["data"] == big


@pytest.mark.both_loops
async def test_relayed_commits_are_answered_by_events(start_instance, connect) -> None:
    """A follower's commits travel up as ``kvs.relaycommit`` and come back as
    the setroot (or error) event naming them: rank 0 sends no response for a
    queued relay, and the follower keeps nothing waiting afterwards."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    await commit(h3, put("warm", "0"))  # rank 3 loads primary
    n = 20
    before = (await asyncio.wait_for(h0.rpc("broker.stats-get", {}, nodeid=0), T))["messages"]
    roots = [await commit(h3, put(f"relay.k{i}", str(i))) for i in range(n)]
    after = (await asyncio.wait_for(h0.rpc("broker.stats-get", {}, nodeid=0), T))["messages"]
    # rank 0 routed the relays but answered none of them (the one extra
    # response is the first stats-get's own)
    assert after["requests"] - before["requests"] >= n
    assert after.get("responses", 0) - before.get("responses", 0) < n // 4
    # each answer is the root that holds the write, readable at once on rank 3
    assert [r["rootseq"] for r in roots] == sorted({r["rootseq"] for r in roots})
    for i in (0, n - 1):
        assert await get(h3, f"relay.k{i}") == str(i).encode()
    st = await stats(h3)
    assert st["counts"]["relayed"] == n + 1  # one client, one at a time: one each
    assert st["counts"]["relays"] == n + 1
    assert st["relays-waiting"] == 0 and st["rpcs-pending"] == 0
    # ... nor keeps their matchtags out of use (no answer will come), and
    # rank 0 does not hold the relays as requests still to answer
    assert st["rpcs-retired"] == 0
    assert await kvs_held(h0, 0) == 0


async def kvs_held(h, rank: int) -> int:
    """The requests rank ``rank``'s kvs module holds unanswered (module.list)."""
    listing = await asyncio.wait_for(h.rpc("module.list", {}, nodeid=rank), T)
    return int(next(m["held"] for m in listing["modules"] if m["name"] == "kvs"))


@pytest.mark.both_loops
async def test_relayed_commit_failures_carry_errno_and_message(start_instance, connect) -> None:
    """A relayed commit that fails at rank 0 after being queued is answered
    from the error event (errno and message as on rank 0); one refused before
    queueing is answered by rank 0 directly; neither leaves anything waiting."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    await commit(h0, put("d.x", "1"))
    messages = []
    for h in (h0, h3):
        try:
            await asyncio.wait_for(h.rpc("kvs.commit", {
                "namespace": "primary", "flags": 0, "ops": [put("d", "z", APPEND)]}), T)
        except RemoteError as exc:
            messages.append((exc.errnum, exc.errstr))
    assert len(messages) == 2 and messages[0] == messages[1]
    assert messages[0][0] == errno.EISDIR and messages[0][1]
    # refused at rank 0 before queueing: an unknown namespace gets an answer
    assert await errnum(h0.rpc("kvs.relaycommit", {
        "namespace": "no-such-ns", "txns": [{"name": "x.1", "flags": 0, "ops": []}]},
        nodeid=0)) == errno.ENOTSUP
    assert await errnum(h0.rpc("kvs.relaycommit", {
        "namespace": "primary", "txns": [{"name": "x.2", "flags": 0, "ops": []},
                                         {"name": "x.3", "ops": "junk"}]},
        nodeid=0)) == errno.EPROTO  # refused whole, before any of it is queued
    # the follower still works and holds no leftovers
    await commit(h3, put("after", "1"))
    st = await stats(h3)
    assert st["relays-waiting"] == 0 and st["rpcs-pending"] == 0
    assert st["rpcs-retired"] == 0 and await kvs_held(h0, 0) == 0


@pytest.mark.both_loops
async def test_commits_in_one_turn_share_one_relay(start_instance, connect) -> None:
    """Commits a follower reads in one turn of its loop go to rank 0 as one
    ``kvs.relaycommit``; each is still its own transaction with its own answer."""
    inst = await start_instance(size=4, fanout=2)
    h3 = await connect(inst, 3)
    await commit(h3, put("warm", "0"))
    before = (await stats(h3))["counts"]
    raw = await RawClient.connect(inst, 3)
    n = 10
    raw.send_bytes(b"".join(codec.to_stream(codec.encode(Message(  # type: ignore[arg-type]
        MsgType.REQUEST, "kvs.commit",
        {"namespace": "primary", "flags": 0, "ops": [put(f"turn.k{i}", str(i))]},
        matchtag=i + 1))) for i in range(n)))  # one write: one read on rank 3
    answers = {}
    for _ in range(n):
        msg = await raw.recv(T)
        assert msg.errnum == 0, msg.errstr
        answers[msg.matchtag] = msg.payload
    await raw.close()
    assert sorted(answers) == list(range(1, n + 1))
    for i in range(n):
        assert await get(h3, f"turn.k{i}") == str(i).encode()
    after = (await stats(h3))["counts"]
    assert after["relayed"] - before["relayed"] == n
    assert after["relays"] - before["relays"] == 1
    st = await stats(h3)
    assert st["relays-waiting"] == 0 and st["rpcs-pending"] == 0


async def test_a_relay_gathers_no_more_than_a_link_carries(start_instance, connect) -> None:
    """Big commits read in one turn leave in several relays, each well within
    ``tbon.max-message`` (a quarter of it), so none is refused for the
    others' size; a commit too big alone is answered EMSGSIZE by its rank."""
    limit = 65536
    inst = await start_instance(size=4, fanout=2, attrs={"tbon.max-message": str(limit)})
    h3 = await connect(inst, 3)
    await commit(h3, put("warm", "0"))
    before = (await stats(h3))["counts"]
    raw = await RawClient.connect(inst, 3)
    n = 16  # 16 x 5 KB: more than the link takes, in one read
    raw.send_bytes(b"".join(codec.to_stream(codec.encode(Message(  # type: ignore[arg-type]
        MsgType.REQUEST, "kvs.commit",
        {"namespace": "primary", "flags": 0, "ops": [put(f"big.k{i}", b"%x" % i * 5_000)]},
        matchtag=i + 1))) for i in range(n)))
    for _ in range(n):
        msg = await raw.recv(T)
        assert msg.errnum == 0, msg.errstr
    after = (await stats(h3))["counts"]
    assert after["relayed"] - before["relayed"] == n
    assert after["relays"] - before["relays"] >= 6  # at most three 5 KB ones per 16 KiB
    for i in range(n):
        assert await get(h3, f"big.k{i}") == b"%x" % i * 5_000
    msg = await raw.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
        put("huge", b"h" * 100_000)]}, matchtag=99)
    assert msg.errnum == errno.EMSGSIZE, msg.errstr
    await raw.close()
    st = await stats(h3)
    assert st["relays-waiting"] == 0 and st["rpcs-pending"] == 0


def many_keys(tag: str, n: int) -> list[dict]:
    """``n`` one-byte puts whose keys take ~45 bytes each in a setroot's ``keys``."""
    return [put(f"{tag}.key-number-{i:06d}-with-a-longish-name", "v") for i in range(n)]


async def test_a_setroot_too_big_for_a_link_is_never_made(start_instance, connect) -> None:
    """A commit's setroot event lists every key it wrote, and every rank
    must receive it (a follower learns the new root, and answers a relayed
    commit, from it alone).  One too big for ``tbon.max-message`` was
    sequenced, then dropped by every link: the followers never saw the
    root (stale reads, ``kvs.wait-version`` and relayed commits waiting for
    ever).  Such a commit is refused ``EMSGSIZE`` instead, before its root
    is set; merged commits whose setroot would be too big are split and
    each succeeds; every rank receives every event, counted exactly."""
    limit = 65536
    inst = await start_instance(size=2, fanout=2, attrs={"tbon.max-message": str(limit)})
    h0 = await connect(inst, 0)
    h1 = await connect(inst, 1)
    await commit(h0, put("a", "1"))
    assert await get(h1, "a") == b"1"  # rank 1 follows primary
    # ~90 KB of keys alone: refused, and no rank has a new root
    assert await errnum(commit(h0, *many_keys("alone", 2000), put("a", "2"))) == errno.EMSGSIZE
    # ~45 KB each: each fits alone, not merged with the next
    split = (await stats(h0))["counts"]["merges-split"]
    raw = await RawClient.connect(inst, 0)
    n = 4
    raw.send_bytes(b"".join(codec.to_stream(codec.encode(Message(  # type: ignore[arg-type]
        MsgType.REQUEST, "kvs.commit",
        {"namespace": "primary", "flags": 0, "ops": many_keys(f"m{i}", 1000)},
        matchtag=i + 1))) for i in range(n)))  # one write: queued together
    seqs = []
    for _ in range(n):
        msg = await raw.recv(T)
        assert msg.errnum == 0, msg.errstr
        seqs.append(msg.payload["rootseq"])
    await raw.close()
    assert (await stats(h0))["counts"]["merges-split"] > split  # (merged, then split)
    await wait_version(h1, "primary", max(seqs))
    assert await get(h1, "a") == b"1"
    assert await get(h1, "m3.key-number-000999-with-a-longish-name") == b"v"
    b0 = await asyncio.wait_for(h0.rpc("broker.stats-get", {}, nodeid=0), T)
    b1 = await asyncio.wait_for(h0.rpc("broker.stats-get", {}, nodeid=1), T)
    assert b1["events"]["last-seq"] == b0["events"]["last-seq"]
    assert b1["events"]["gaps"] == 0
    for h in (h0, h1):
        e = await ev(h)
        assert e["received"] == b0["events"]["last-seq"]
        assert e["received"] == e["handled"] + sum(e["dropped"].values())


async def test_follower_client_vanishing_mid_commit_leaves_nothing(start_instance,
                                                                    connect) -> None:
    """A client on rank 3 that sends a commit and hangs up at once: the commit
    is still applied (it was sent), its answer is dropped, and rank 3 keeps
    no relay state for it."""
    inst = await start_instance(size=4, fanout=2)
    h3 = await connect(inst, 3)
    await commit(h3, put("warm", "0"))
    await asyncio.wait_for(h3.subscribe("kvs.namespace-primary-setroot"), T)
    raw = await RawClient.connect(inst, 3)
    raw.send(Message(MsgType.REQUEST, "kvs.commit", {
        "namespace": "primary", "flags": 0, "ops": [put("gone.k", "1")]}, matchtag=1))
    await raw.close()
    # Nothing orders this connection's requests against another client's
    # (rank 3 may accept it a loop turn later): wait for the setroot naming
    # the key.  Rank 3 relays to rank 0 only what it read, so this also
    # proves the request was read before the hang-up was noticed.
    async with asyncio.timeout(T):
        while "gone.k" not in (await h3.recv_event()).payload["keys"]:
            pass
    assert await get(h3, "gone.k") == b"1"
    st = await stats(h3)
    assert st["relays-waiting"] == 0 and st["rpcs-pending"] == 0


async def test_relays_under_concurrency_and_removal_all_settle(start_instance,
                                                               connect) -> None:
    """Clients on every follower commit concurrently into two namespaces while
    one of them is removed: every commit is answered (success, or ENOTSUP once
    its namespace is gone), every successful write is readable, and no rank
    keeps relay state afterwards."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    for ns in ("keep", "drop"):
        await ns_create(h0, ns)
    clients = [await connect(inst, rank) for rank in (1, 2, 3) for _ in range(2)]
    half = asyncio.Event()
    n = 40

    async def run(j: int, h) -> list[tuple[str, str, int]]:
        out = []
        for i in range(n):
            ns = "keep" if i % 2 else "drop"
            try:
                await commit(h, put(f"c{j}.k{i}", str(i)), ns=ns)
                out.append((ns, f"c{j}.k{i}", 0))
            except RemoteError as exc:
                out.append((ns, f"c{j}.k{i}", exc.errnum))
            if i == n // 2:
                half.set()
        return out

    async def remover() -> None:
        await half.wait()
        await ns_remove(h0, "drop")

    async with asyncio.timeout(60):
        results, _ = await asyncio.gather(
            asyncio.gather(*(run(j, h) for j, h in enumerate(clients))), remover())
    outcomes = [r for rs in results for r in rs]
    assert len(outcomes) == n * len(clients)
    assert all(err == 0 for ns, _, err in outcomes if ns == "keep")
    assert {err for ns, _, err in outcomes if ns == "drop"} <= {0, errno.ENOTSUP}
    assert any(err == errno.ENOTSUP for ns, _, err in outcomes if ns == "drop")
    for ns, key, _ in outcomes:
        if ns == "keep":
            assert await get(h0, key, ns="keep") == key.rpartition("k")[2].encode()
    for rank in (1, 2, 3):
        st = await asyncio.wait_for(h0.rpc("kvs.stats-get", {}, nodeid=rank), T)
        assert st["relays-waiting"] == 0 and st["rpcs-pending"] == 0, (rank, st)


async def test_a_malformed_namespace_event_is_dropped_not_raised(
        start_instance, connect, tmp_path) -> None:
    """The owner may publish ``kvs.*`` events; one with fields rank 0's kvs
    never sends (a rootseq that is not an int, a rootref that is no
    blobref, names that are not strings) raised in every follower's
    handler.  It is dropped as foreign; the namespace carries on."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h1, put("a", "1"))  # rank 1 follows primary
    base = await ev(h1)
    root = await getroot(h0)
    forged = [
        ("setroot", {"rootseq": "x", "rootref": root["rootref"]}),
        ("setroot", {"rootseq": 10**6, "rootref": "nope"}),
        ("setroot", {"rootseq": 10**6, "rootref": root["rootref"] + "\n"}),
        ("setroot", {"rootseq": 10**6, "rootref": root["rootref"], "names": [1]}),
        ("error", {"names": "x", "errnum": 1}),
        ("error", {"names": [], "errnum": "x"}),
    ]
    for kind, payload in forged:
        await asyncio.wait_for(h0.publish(f"kvs.namespace-primary-{kind}",
                                          {"namespace": "primary", **payload}), T)
    await commit(h1, put("a", "2"))  # answered once rank 1 applied its (later) setroot
    assert await get(h1, "a") == b"2"
    after = await ev(h1)
    assert after["dropped"]["foreign"] - base["dropped"]["foreign"] == len(forged)
    assert (await getroot(h1))["rootseq"] == (await getroot(h0))["rootseq"]
    assert "Traceback" not in (tmp_path / "broker-0.log").read_text()



async def test_a_reloaded_followers_transactions_are_named_anew(start_instance,
                                                                connect) -> None:
    """A follower learns how a relayed transaction went only from the names
    in rank 0's events.  Its kvs reloaded (or its rank restarted) named its
    transactions from ``<rank>.1`` again, so the old load's, still queued
    on rank 0 when it went, were taken for the new one's of the same names:
    commits answered applied at another's version that rank 0 failed.  Each
    load's names are its own."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await asyncio.wait_for(h0.subscribe("kvs.namespace-primary-setroot"), T)

    async def name_of_next_commit() -> str:
        await commit(h1, put("k", "v"))
        async with asyncio.timeout(T):
            [name] = (await h0.recv_event()).payload["names"]
        return name

    first = await name_of_next_commit()
    assert first.startswith("1.")
    await asyncio.wait_for(h0.rpc("module.reload", {"name": "kvs"}, nodeid=1), T)
    h1 = await connect(inst, 1)
    second = await name_of_next_commit()
    assert second.startswith("1.") and second != first, (first, second)
