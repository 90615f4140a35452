"""What one guest user may hold on a rank, over all its connections.

Each connection was bounded on its own (``broker.max-message`` being
received, ``MAX_BACKLOG`` unread, ``kvs-watch.max-watches-per-client``), but a
guest may open many connections, so those bounds multiplied bounded nothing,
and enough connections took every descriptor of the rank.  These tests run
real guest processes (another uid, as ``test_broker_guests``) against real
ranks: past ``access.max-guest-connections``, ``access.max-guest-bytes`` or
``kvs-watch.max-watches-per-guest`` the guest gets a clear errno and message,
and other users, the owner included, are not affected.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal

import pytest
from test_broker_support import (
    GUEST_UID,
    OTHER_GUEST_UID,
    GuestProc,
    stats,
    stop_process,
    wait_until,
)
from test_watch_helpers import (
    APPEND,
    TREEOBJ,
    WAITCREATE,
    WATCH,
    append,
    commit,
    lookup,
    ns_create,
    put,
    value,
    wait_watchers,
    watch_stream,
)
from test_watch_helpers import stats as watch_stats

from broker.handle import Handle
from kvs_watch.watcher import LOAD_WINDOW

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")

ALLOW = {"access.allow-guest-user": "true"}

async def guest_usage(h: Handle, rank: int, uid: int = GUEST_UID) -> dict[str, int]:
    return (await stats(h, rank))["guests"].get(str(uid), {"connections": 0, "bytes": 0})


@pytest.mark.both_loops
async def test_a_guests_connections_are_capped(start_instance, connect) -> None:
    """One connection past access.max-guest-connections is closed with EUSERS
    and a message naming the attribute; another guest and the owner are not
    counted with it, and a closed connection frees its place."""
    inst = await start_instance(size=2, attrs={**ALLOW, "access.max-guest-connections": "2"})
    h0 = await connect(inst, 0)
    body = """
        async def main():
            hs = [await Handle.connect(uri) for _ in range(3)]
            out(pings=[list(await ping(h)) for h in hs])
            await step()
            await hs[0].close()
            await step()
            h = await Handle.connect(uri)
            out(again=list(await ping(h)))
    """
    guest = await GuestProc.start(inst.uri(1), body)
    other = await GuestProc.start(inst.uri(1), body, uid=OTHER_GUEST_UID)
    try:
        for g in (guest, other):
            (ok1, ok2, refused) = (await g.line())["pings"]
            assert ok1 == [0, ""] and ok2 == [0, ""]
            assert refused[0] == errno.EUSERS
            assert "at most 2 connections per guest user (access.max-guest-connections)" \
                in refused[1]
        # the owner's connections are not counted
        owners = [await connect(inst, 1) for _ in range(3)]
        for h in owners:
            assert (await asyncio.wait_for(h.ping(1), 10))["rank"] == 1
        st = await stats(h0, 1)
        assert st["connector"]["guests-refused"] == 2, st
        assert st["guests"][str(GUEST_UID)]["connections"] == 2
        guest.go()
        await wait_until(lambda: _connections(h0, 1), "the guest's first connection closed")
        guest.go()
        assert (await guest.line())["again"] == [0, ""]
        other.go()
        other.go()
        assert (await other.line())["again"] == [0, ""]
        await guest.finish()
        await other.finish()
    finally:
        guest.kill()
        other.kill()


@pytest.mark.both_loops
async def test_a_refused_guest_is_told_why_however_fast_it_calls(start_instance,
                                                                 connect) -> None:
    """A call made at once after connecting past the cap fails with EUSERS,
    not with a bare connection reset: the rank keeps a refused connection
    half-open a moment, so the client reads why even after writing (a
    write to a closed socket failed before the client read anything)."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-connections": "1"})
    body = """
        async def main():
            held = await Handle.connect(uri)
            assert (await ping(held))[0] == 0
            got = []
            for _ in range(20):
                h = await Handle.connect(uri)
                got.append((await ping(h))[0])
                await h.close()
            out(errnos=got)
    """
    guests = [await GuestProc.start(inst.uri(0), body, uid=uid, loop=loop)
              for uid, loop in ((GUEST_UID, "asyncio"), (OTHER_GUEST_UID, "uvloop"))]
    try:
        for g in guests:
            assert (await g.line())["errnos"] == [errno.EUSERS] * 20
            await g.finish()
        h0 = await connect(inst, 0)

        async def none_left() -> bool:
            return not (await stats(h0))["guests"]
        await wait_until(none_left, "the guests' connections gone")
    finally:
        for g in guests:
            g.kill()


async def _connections(h: Handle, rank: int) -> bool:
    return (await guest_usage(h, rank))["connections"] == 1


async def test_a_guest_sees_only_its_own_usage(start_instance, connect) -> None:
    inst = await start_instance(size=1, attrs=ALLOW)
    h0 = await connect(inst, 0)
    body = """
        async def main():
            h = await Handle.connect(uri)
            await step()
            st = await h.rpc("broker.stats-get", {})
            out(guests=st["guests"])
            await step()  # connected until the test has looked (it exits after)
    """
    guest = await GuestProc.start(inst.uri(0), body)
    other = await GuestProc.start(inst.uri(0), body, uid=OTHER_GUEST_UID)
    try:
        await wait_until(lambda: _both_connected(h0), "both guests connected")
        guest.go()
        seen = (await guest.line())["guests"]
        assert list(seen) == [str(GUEST_UID)] and seen[str(GUEST_UID)]["connections"] == 1
        assert sorted((await stats(h0))["guests"]) == sorted(
            [str(GUEST_UID), str(OTHER_GUEST_UID)])
        other.go()
        assert list((await other.line())["guests"]) == [str(OTHER_GUEST_UID)]
        guest.go()
        other.go()
        await guest.finish()
        await other.finish()
    finally:
        guest.kill()
        other.kill()


async def _both_connected(h: Handle) -> bool:
    return len((await stats(h))["guests"]) == 2


BUDGET = 256 << 10


@pytest.mark.both_loops
async def test_a_guests_part_sent_messages_share_one_budget(start_instance, connect) -> None:
    """Two connections part-way through a 250 KiB request each, the first
    100 KiB in: once the second takes the user past access.max-guest-bytes
    (256 KiB), the one holding the most (the second) is closed with ENOBUFS;
    the first's request then completes and is answered."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": str(BUDGET)})
    h0 = await connect(inst, 0)
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            big = request("broker.ping", {"pad": b"x" * (250 << 10)}, 7)
            first, second = raw(), raw()
            first.sendall(big[:100 << 10])
            out(sent=len(big))
            await step()
            send_until_closed(second, big[:200 << 10])
            out(second=read_all(second)["responses"])
            first.sendall(big[100 << 10:])
            answer = read_one(first, codec.StreamDecoder())
            out(first=list(codec.peek_response(answer)[:2]))
    """)
    try:
        size = (await guest.line())["sent"]
        assert size > 250 << 10

        async def part_received() -> bool:
            return (await guest_usage(h0, 0))["bytes"] >= 100 << 10
        await wait_until(part_received, "the first part received")
        # the owner is not held to the guests' budget
        big = await asyncio.wait_for(h0.rpc("broker.ping", {"pad": b"y" * (1 << 20)}), 30)
        assert big["rank"] == 0
        guest.go()
        goodbye = (await guest.line())["second"]
        assert len(goodbye) == 1, goodbye
        matchtag, errnum, errstr = goodbye[0]
        assert (matchtag, errnum) == (0, errno.ENOBUFS)
        assert "more than access.max-guest-bytes (262144)" in errstr
        assert (await guest.line())["first"] == [7, 0]
        await guest.finish()
        st = await stats(h0)
        assert st["connector"]["guests-over-budget"] == 1
        assert st["guests"] == {}
    finally:
        guest.kill()


@pytest.mark.both_loops
async def test_a_connection_closed_mid_read_serves_nothing_more_of_it(start_instance,
                                                                      connect) -> None:
    """One read holding [a ping whose 70 KiB answer takes the user past a
    64 KiB budget, a watch, the start of another message]: the answer gets
    the connection closed, and the rest of that read is not served.  It was:
    the watch was left registered for a client already gone, counted against
    the guest's cap for good, until the guest could watch no more."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": "65536",
                                               "kvs-watch.max-watches-per-guest": "5"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "gn", owner=GUEST_UID)
    await commit(h0, put("k", "v"), ns="gn")
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            rounds = []
            for i in range(6):
                s = raw()
                big = request("broker.ping", {"pad": b"p" * (70 << 10)}, 1)
                wf = codec.encode_request("kvs-watch.lookup",
                                          {"namespace": "gn", "key": "k", "flags": 4},
                                          2, NODEID_ANY, 1)  # (flags: STREAMING)
                watch = b"".join([codec.stream_prefix(wf), *wf])
                tail = request("broker.ping", {"pad": b"q" * (100 << 10)}, 3)[:30 << 10]
                s.sendall(big + watch + tail)
                rounds.append([r[:2] for r in read_all(s)["responses"]])
                s.close()
            out(rounds=rounds)
            await step()
            h = await Handle.connect(uri)
            st = h.rpc_stream("kvs-watch.lookup", {"namespace": "gn", "key": "k", "flags": 4})
            msg = await asyncio.wait_for(st.next_message(), 10)
            out(after=msg.payload["val"]["data"].decode())
    """)
    try:
        assert (await guest.line())["rounds"] == [[[0, errno.ENOBUFS]]] * 6
        await wait_watchers(h0, 0, nodeid=0)
        assert (await watch_stats(h0, 0))["guest-users"] == 0
        guest.go()
        assert (await guest.line())["after"] == "v"
        await guest.finish()
    finally:
        guest.kill()


async def test_a_guests_unread_output_shares_one_budget(start_instance, connect) -> None:
    """A guest subscribed on two connections that it does not read: once the
    rank holds more than access.max-guest-bytes for the two, they are
    closed, while an owner's subscriber gets every event."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": str(BUDGET)})
    h0 = await connect(inst, 0)
    mine = await connect(inst, 0)
    await asyncio.wait_for(mine.subscribe("flood."), 10)
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            socks = [raw(), raw()]
            for s in socks:
                s.sendall(request("event.subscribe", {"topic": "flood."}, 1))
                read_one(s, codec.StreamDecoder())
            out(subscribed=True)
            await step()  # events pile up unread meanwhile
            out(events=[read_all(s)["events"] for s in socks])
    """)
    try:
        assert (await guest.line())["subscribed"]
        n, pad = 400, b"z" * (8 << 10)
        for i in range(n):
            await asyncio.wait_for(h0.publish("flood.e", {"i": i, "pad": pad}), 10)

        async def both_closed() -> bool:
            st = await stats(h0)
            return bool(st["connector"]["guests-over-budget"] == 2 and not st["guests"])
        await wait_until(both_closed, "both guest connections closed", timeout=20)
        for i in range(n):
            ev = await asyncio.wait_for(mine.recv_event(), 10)
            assert ev.payload["i"] == i
        guest.go()
        # each connection was cut off: it holds what its socket buffer took
        events = (await guest.line())["events"]
        assert all(0 < k < n for k in events), events
        await guest.finish()
    finally:
        guest.kill()


async def test_a_connection_that_read_everything_holds_nothing(start_instance,
                                                                connect) -> None:
    """A connection's share of its user's bytes was refreshed only when it
    was sent something: one that had read everything since still counted
    what it had read, and was closed when another connection's answer
    needed the room.  Shares are refreshed before anything is closed."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": str(BUDGET)})
    h0 = await connect(inst, 0)
    await ns_create(h0, "big", owner=GUEST_UID)
    await commit(h0, put("v", b"b" * (240 << 10)), ns="big")
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            a = raw()
            a.sendall(request("event.subscribe", {"topic": "flood."}, 1))
            dec = codec.StreamDecoder()
            read_one(a, dec)
            out(subscribed=True)
            n = int(await step())  # events are queued for a, unread
            events = 0
            while events < n:
                events += len(dec.feed(a.recv(1 << 16)))
            out(drained=events)
            await step()
            b = await Handle.connect(uri)
            v = await b.rpc("kvs.lookup", {"namespace": "big", "key": "v", "flags": 0})
            out(b=len(v["val"]["data"]))
            a.sendall(request("broker.ping", {}, 2))
            out(a=list(codec.peek_response(read_one(a, dec))[:2]))
    """)
    try:
        assert (await guest.line())["subscribed"]
        n = 0
        while (await guest_usage(h0, 0))["bytes"] < 24 << 10:  # past the socket's buffer
            await asyncio.wait_for(h0.publish("flood.e", {"pad": b"z" * (8 << 10)}), 10)
            n += 1
        guest.go(str(n))
        assert (await guest.line())["drained"] == n
        guest.go()
        assert (await guest.line())["b"] == 240 << 10
        assert (await guest.line())["a"] == [2, 0]  # still open
        await guest.finish()
        assert (await stats(h0))["connector"]["guests-over-budget"] == 0
    finally:
        guest.kill()


async def test_one_big_answer_at_a_time_for_a_guest_that_does_not_read(start_instance,
                                                                      connect) -> None:
    """A guest asking for a 1 MiB value on connections it does not read, with
    a 256 KiB budget: one answer bigger than the budget is queued while the
    user holds nothing else; the next closes the connection holding it.  The
    rank never holds much more than one such answer for the user."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": str(BUDGET)})
    h0 = await connect(inst, 0)
    await ns_create(h0, "big", owner=GUEST_UID)
    await commit(h0, put("v", b"b" * (1 << 20)), ns="big")
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            socks = []
            for i in range(4):
                s = raw()
                s.sendall(request("kvs.lookup", {"namespace": "big", "key": "v", "flags": 0}, 1))
                socks.append(s)
                out(asked=i)
                await step()
    """)
    try:
        for i in range(4):
            assert (await guest.line())["asked"] == i

            async def queued(closed: int = i) -> bool:
                st = await stats(h0)
                usage = st["guests"].get(str(GUEST_UID), {})
                return bool(st["connector"]["guests-over-budget"] == closed
                            and usage.get("connections") == 1 and usage.get("bytes"))
            # the answer is queued, and the connection that held the last
            # one is closed: the user holds one answer, on one connection
            await wait_until(queued, f"answer {i + 1} queued")
            assert (await guest_usage(h0, 0))["bytes"] <= 1 << 20
            guest.go()
        await guest.finish()
    finally:
        guest.kill()


async def test_a_guests_watches_are_capped_over_its_connections(start_instance,
                                                                connect) -> None:
    """kvs-watch.max-watches-per-guest counts a guest's watches on all its
    connections: one more is ENOSPC; the owner is not held to it, and a
    guest whose connection closes gets its places back."""
    inst = await start_instance(size=2, attrs={**ALLOW,
                                               "kvs-watch.max-watches-per-guest": "3"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "gw", owner=GUEST_UID)
    guest = await GuestProc.start(inst.uri(1), """
        async def main():
            a, b = await Handle.connect(uri), await Handle.connect(uri)
            def watch(h, key):
                return h.rpc_stream("kvs-watch.lookup",
                                    {"namespace": "gw", "key": key, "flags": 4 | 8})
            held = [watch(a, "k0"), watch(a, "k1"), watch(b, "k2")]
            await step()
            try:
                await asyncio.wait_for(watch(b, "k3").next_message(), 10)
                out(fourth="answered")
            except RemoteError as exc:
                out(fourth=[exc.errnum, exc.errstr])
            await a.close()
            await step()  # the rank has seen a go
            again = watch(b, "k4")
            msg = await asyncio.wait_for(again.next_message(), 20)
            out(again=msg.payload["val"]["data"].decode())
    """)
    try:
        await wait_watchers(h0, 3, nodeid=1)
        # the owner's four watches, over two connections, are not refused
        o1, o2 = await connect(inst, 1), await connect(inst, 1)
        owner = [watch_stream(h, f"ow.k{i}", WATCH | WAITCREATE)
                 for i, h in enumerate((o1, o1, o2, o2))]
        await wait_watchers(h0, 7, nodeid=1)
        guest.go()
        errnum, errstr = (await guest.line())["fourth"]
        assert errnum == errno.ENOSPC and "kvs-watch.max-watches-per-guest" in errstr
        await wait_watchers(h0, 5, nodeid=1)  # a's two ended with it
        guest.go()
        await wait_watchers(h0, 6, nodeid=1)
        await commit(h0, put("k4", "yes"), ns="gw")
        assert (await guest.line())["again"] == "yes"
        await commit(h0, put("ow.k0", "o"))
        assert await value(owner[0]) == b"o"
        await guest.finish()
        st = await watch_stats(h0, 1)
        assert st["counts"]["refused-over-cap"] == 1 and st["guest-users"] == 0
    finally:
        guest.kill()


async def test_a_guests_subscriptions_and_version_waits_are_capped(start_instance,
                                                                    connect) -> None:
    """access.max-guest-subscriptions and kvs.max-waits-per-guest count a
    guest's event subscriptions and kvs.wait-version requests over all its
    connections (100,000 of each grew a rank by 400 MB): one more is ENOSPC,
    naming the attribute; the places come back when a connection closes."""
    inst = await start_instance(size=2, attrs={
        **ALLOW, "access.max-guest-subscriptions": "3", "kvs.max-waits-per-guest": "3"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "gv", owner=GUEST_UID)
    guest = await GuestProc.start(inst.uri(1), """
        async def main():
            a, b = await Handle.connect(uri), await Handle.connect(uri)
            def wait(h):
                return h.rpc("kvs.wait-version", {"namespace": "gv", "rootseq": 99})
            for h, prefix in ((a, "x."), (a, "y."), (b, "x.")):
                await h.subscribe(prefix)
            waits = [wait(a), wait(a), wait(b)]
            out(sub=await outcome(b.subscribe("z.")), wait=await outcome(wait(b)))
            await step()
            await a.close()
            await step()  # the rank has seen a go
            await b.subscribe("z.")
            out(again="subscribed")
            await step()
    """)
    try:
        async def held(subs: int, waiters: int) -> bool:
            st = await stats(h0, 1)
            kvs = await h0.rpc("kvs.stats-get", {}, nodeid=1)
            n = sum(v for k, v in st["subscriptions"].items() if k[0] == "c")
            return n == subs and kvs["namespaces"].get("gv", {}).get("waiters") == waiters

        line = await guest.line()
        assert line["sub"][0] == errno.ENOSPC and \
            "access.max-guest-subscriptions" in line["sub"][1], line
        assert line["wait"][0] == errno.ENOSPC and \
            "kvs.max-waits-per-guest" in line["wait"][1], line
        await wait_until(lambda: held(3, 3), "the guest's 3 subscriptions and waits")
        # the owner is not held to them
        o = await connect(inst, 1)
        for prefix in ("p.", "q.", "r.", "s."):
            await asyncio.wait_for(o.subscribe(prefix), 10)
        owner_waits = [o.rpc("kvs.wait-version", {"namespace": "gv", "rootseq": 99})
                       for _ in range(4)]
        await wait_until(lambda: held(7, 7), "the owner's 4 more")
        guest.go()
        await wait_until(lambda: held(5, 5), "the guest's first connection's to go")
        guest.go()
        assert (await guest.line())["again"] == "subscribed"
        guest.go()
        await guest.finish()
        await wait_until(lambda: held(4, 4), "the guest's places to come back")
        for fut in owner_waits:
            fut.cancel()
    finally:
        guest.kill()


async def test_what_a_guests_requests_leave_on_the_ranks_on_their_way_is_capped(
        start_instance, connect) -> None:
    """access.max-guest-requests caps a guest's requests held below a rank
    (a streaming request to a service that answers once stays held until
    its client goes: 1,000 of 100 KB grew ranks 0 and 1 by 100 MB), and
    access.max-guest-services the (service, rank) pairs its connections
    address (each remembered on every rank on the way)."""
    inst = await start_instance(size=4, fanout=2, attrs={
        **ALLOW, "access.max-guest-requests": "5", "access.max-guest-services": "4"})
    h0 = await connect(inst, 0)
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            h = await Handle.connect(uri)
            def streaming(tag):
                return h.rpc_stream("attr.get", {"name": "rank", "pad": b"x" * 100_000},
                                    nodeid=3)
            pairs = [await outcome(h.rpc("nosuch.x", {}, nodeid=0)),
                     await outcome(h.rpc("broker.ping", {}, nodeid=2)),
                     await outcome(h.rpc("broker.ping", {}, nodeid=1))]
            streams = [streaming(i) for i in range(6)]  # attr@3: the fourth pair
            firsts = [await outcome(s.next_message()) for s in streams]
            pairs.append(await outcome(h.rpc("broker.ping", {}, nodeid=0)))  # a fifth
            out(firsts=firsts, pairs=pairs)
            await step()
    """)
    try:
        line = await guest.line()
        firsts, pairs = line["firsts"], line["pairs"]
        assert firsts[:5] == ["ok"] * 5, firsts
        assert firsts[5][0] == errno.ENOSPC and "access.max-guest-requests" in firsts[5][1]
        assert (await stats(h0, 0))["sent-down"] == 5
        assert (await stats(h0, 1))["sent-down"] == 5
        assert pairs[0][0] == errno.ENOSYS and pairs[1:3] == ["ok", "ok"], pairs
        assert pairs[3][0] == errno.ENOSPC and "access.max-guest-services" in pairs[3][1]
        guest.go()
        await guest.finish()

        async def let_go() -> bool:
            return [(await stats(h0, r))["sent-down"] for r in (0, 1)] == [0, 0]

        await wait_until(let_go, "the guest's requests to be let go")
    finally:
        guest.kill()


@pytest.mark.both_loops
async def test_a_burst_to_a_guest_that_reads_is_not_counted_against_it(
        start_instance, connect) -> None:
    """A writer holds a loop turn's small messages after the first and
    writes them together when the turn ends; those bytes are on their way
    to the kernel, not kept for a guest that does not read.  A burst of
    100 events of 1 KiB in one turn, past a 64 KiB budget, used to close
    the reading guest with ENOBUFS."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": "65536"})
    h0 = await connect(inst, 0)
    guest = await GuestProc.start(inst.uri(0), """
        async def main():
            h = await Handle.connect(uri)
            await h.subscribe("burst.")
            out(subscribed=True)
            n = 0
            while n < 100:
                await asyncio.wait_for(h.recv_event(), 20)
                n += 1
            out(events=n)
            await h.close()
    """)
    try:
        assert (await guest.line())["subscribed"]
        for i in range(100):  # one loop turn: the rank reads them together
            h0.publish_nowait("burst.e", {"i": i, "pad": b"p" * 1024})
        assert (await guest.line())["events"] == 100
        await guest.finish()
        assert (await stats(h0))["connector"]["guests-over-budget"] == 0
    finally:
        guest.kill()


async def test_a_guests_connections_share_one_turn(start_instance, connect) -> None:
    """Time per guest user: a rank takes at most MAX_PER_TURN requests per
    turn of its loop from all of one guest's connections together, not that
    many from each.  Sixteen guest connections each hold a burst while
    rank 0 is stopped, and the owner sends one request after them: once
    rank 0 runs, the owner's request is sequenced after at most a turn or
    two of the guest's events (a turn per connection, 16 x 64, before).
    Nothing of the guest's is lost."""
    from broker.connector import MAX_PER_TURN

    conns, each = 16, 400
    inst = await start_instance(size=1, attrs=ALLOW)
    sub, owner = await connect(inst, 0), await connect(inst, 0)
    await asyncio.wait_for(sub.subscribe("fair."), 10)
    guest = await GuestProc.start(inst.uri(0), f"""
        async def main():
            socks = [raw() for _ in range({conns})]
            for s in socks:  # each one accepted and read by the rank
                s.sendall(request("broker.ping", {{}}, 1))
                read_one(s, codec.StreamDecoder())
            out(ready=True)
            await step()
            burst = b"".join(request("event.pub", {{"topic": "fair.guest"}}, 2 + i)
                             for i in range({each}))
            for s in socks:
                s.sendall(burst)
            out(sent=True)
            await step()
    """)
    try:
        assert await guest.line() == {"ready": True}
        rank0 = inst.pids()[0]
        await stop_process(rank0)
        try:
            guest.go()
            assert await guest.line() == {"sent": True}
            owner.publish_nowait("fair.owner")
            owner.flush()
        finally:
            os.kill(rank0, signal.SIGCONT)
        topics = []
        async with asyncio.timeout(60):
            while len(topics) < conns * each + 1:
                topics.append((await sub.recv_event()).topic)
        guest.go()
        await guest.finish()
    finally:
        guest.kill()
    assert topics.count("fair.guest") == conns * each
    position = topics.index("fair.owner")
    assert position <= 2 * MAX_PER_TURN, position


async def test_a_watcher_closed_mid_answer_loads_and_answers_nothing_more(start_instance,
                                                                          connect) -> None:
    """A guest's APPEND watch of a value of 400 blobs, on a connection it
    does not read: an answer takes the user past access.max-guest-bytes and
    the connection is closed, which finishes the watcher in the middle of
    answering.  It went on: it issued more blob loads and answered the loads
    already done, to a client gone (the router dropped those answers).  It
    stops at the answer that ended it; the rank holds nothing of it after."""
    inst = await start_instance(size=1, attrs={**ALLOW, "access.max-guest-bytes": str(BUDGET)})
    h0 = await connect(inst, 0)
    await ns_create(h0, "log", owner=GUEST_UID)
    blobs, size = 400, 8 << 10
    for first in range(0, blobs, 50):  # one blob per append
        await commit(h0, *[append("v", i.to_bytes(4, "big") * (size // 4))
                           for i in range(first, first + 50)], ns="log")
    assert len((await lookup(h0, "v", TREEOBJ, ns="log"))["data"]) == blobs
    dropped = (await stats(h0))["messages"]["dropped-responses"]
    guest = await GuestProc.start(inst.uri(0), f"""
        async def main():
            s = raw()
            wf = codec.encode_request("kvs-watch.lookup",
                                      {{"namespace": "log", "key": "v", "flags": {WATCH | APPEND}}},
                                      2, NODEID_ANY, 1)  # (flags: STREAMING)
            s.sendall(b"".join([codec.stream_prefix(wf), *wf]))
            out(watching=True)
            await step()  # the answers pile up unread meanwhile
            got = read_all(s)["responses"]
            out(answers=sum(1 for r in got if r[0] == 2))
    """)
    try:
        assert (await guest.line())["watching"]

        async def closed() -> bool:
            st = await stats(h0)
            return bool(st["connector"]["guests-over-budget"] == 1 and not st["guests"])
        await wait_until(closed, "the guest's connection closed over its budget", timeout=20)
        await wait_watchers(h0, 0, nodeid=0)
        guest.go()
        out = await guest.line()
        await guest.finish()
    finally:
        guest.kill()
    st = await watch_stats(h0, 0)
    counts = st["counts"]
    assert 0 < out["answers"] <= counts["answers"] < blobs, (out, counts)
    # no load was issued after the answer that ended the watch (the window,
    # refilled before each answer, held at most LOAD_WINDOW - 1 more)...
    assert counts["blob-loads"] < counts["answers"] + LOAD_WINDOW, counts
    # ... and nothing was answered to the client gone
    assert (await stats(h0))["messages"]["dropped-responses"] == dropped
    assert (st["watchers"], st["clients"], st["guest-users"], st["lookups-in-flight"],
            st["namespace-count"]) == (0, 0, 0, 0, 0), st


async def test_a_guests_big_requests_wait_while_a_link_is_congested(start_instance,
                                                                     connect) -> None:
    """A guest on rank 1 sends 6 MiB of requests to rank 0 while rank 0
    does not read (stopped): once rank 1's link to it holds over a quarter
    of ``tbon.max-backlog`` (1 MiB), the guest's connection is not read
    (counted), so the link never reaches 4 times the mark, where it is
    dropped whatever the peer does; once rank 0 reads again, every request
    is answered.  A guest stopped ranks this way with a few 300 MiB
    requests (found by a review); the owner's connection is read on."""
    inst = await start_instance(size=2, attrs={**ALLOW, "tbon.max-backlog": str(1 << 20)})
    h1 = await connect(inst, 1)
    rank0 = inst.pids()[0]
    guest = await GuestProc.start(inst.uri(1), """
        async def main():
            h = await Handle.connect(uri)
            await h.ping(0)
            out(ready=True)
            await step()
            pad = b"x" * (512 << 10)
            calls = [h.rpc("broker.ping", {"pad": pad}, nodeid=0) for _ in range(12)]
            out(results=[await outcome(c) for c in calls])
    """)
    try:
        assert (await guest.line())["ready"]
        await stop_process(rank0)
        try:
            guest.go()

            async def held() -> bool:
                st = await stats(h1, 1)
                return bool(st["connector"]["guests-held-for-links"] >= 1)
            await wait_until(held, "the guest's connection held for the link")
            assert (await asyncio.wait_for(h1.ping(1), 10))["rank"] == 1  # (the owner's is read)
        finally:
            os.kill(rank0, signal.SIGCONT)
        assert (await guest.line())["results"] == ["ok"] * 12
        await guest.finish()
        assert (await stats(h1, 1))["overlay"]["slow"] == 0
    finally:
        guest.kill()
