"""Events: sequenced by rank 0, sent down the tree, delivered by string prefix
(docs/protocol.md, Events)."""

from __future__ import annotations

import asyncio
import errno

import pytest
from test_broker_support import stats

from broker.errors import RemoteError
from broker.handle import Handle
from broker.message import Message, MsgFlags
from broker.services import MAX_EVENT_TOPIC


async def topics_until(h: Handle, last: str) -> list[str]:
    """Topics of the events ``h`` receives, up to and including ``last``."""
    out = []
    while True:
        ev = await h.recv_event()
        out.append(ev.topic)
        if ev.topic == last:
            return out


async def next_not_kvs(h: Handle) -> Message:
    while True:
        ev = await h.recv_event()
        if not ev.topic.startswith("kvs."):
            return ev


@pytest.mark.both_loops
async def test_prefix_filtering(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(15):
        sub = await connect(inst, 3)
        pub = await connect(inst, 2)
        await sub.subscribe("job-1")
        await sub.subscribe("end")
        for topic in ("job-1", "job-10-setroot", "job-2", "jo", "job-", "xjob-1", "job-1.x"):
            await pub.publish(topic, {"t": topic})
        await pub.publish("end")
        # a plain string prefix: job-1 also catches job-10 (subscribers check payloads)
        assert await topics_until(sub, "end") == ["job-1", "job-10-setroot", "job-1.x", "end"]

        await sub.unsubscribe("job-1")
        await pub.publish("job-1")
        await pub.publish("end")
        assert await topics_until(sub, "end") == ["end"]
        with pytest.raises(RemoteError) as info:
            await sub.unsubscribe("job-1")
        assert info.value.errnum == errno.ENOENT


async def test_payloads_and_empty_prefix(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(10):
        sub = await connect(inst, 1)
        await sub.subscribe("")  # everything (the modules' own kvs.* events too)
        big = bytes(range(256)) * 40
        seq = await sub.publish("any.thing", {"n": 1, "blob": big})
        ev = await next_not_kvs(sub)
        assert (ev.topic, ev.seq, ev.payload) == ("any.thing", seq, {"n": 1, "blob": big})
        await sub.publish("no.payload")
        ev = await next_not_kvs(sub)
        assert ev.topic == "no.payload" and ev.payload is None


async def test_subscription_refcounts(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    async with asyncio.timeout(10):
        h = await connect(inst)
        await h.subscribe("a.")
        await h.subscribe("a.")
        await h.subscribe("a.b")  # overlapping prefixes: one delivery per event
        await h.publish("a.b.c")
        await h.unsubscribe("a.")
        await h.publish("a.x")  # still one "a." reference
        await h.unsubscribe("a.")
        await h.publish("a.y")  # gone
        await h.publish("a.b.end")
        assert await topics_until(h, "a.b.end") == ["a.b.c", "a.x", "a.b.end"]


@pytest.mark.both_loops
async def test_every_rank_sees_the_same_order(start_instance, connect) -> None:
    size, per_publisher = 8, 15
    inst = await start_instance(size=size, fanout=2)
    async with asyncio.timeout(30):
        subs = [await connect(inst, r) for r in range(size)]
        for h in subs:
            await h.subscribe("ord.")
        publishers = [subs[0], subs[4], subs[7]]

        async def publish_all(i: int, h: Handle) -> list[int]:
            return [await h.publish(f"ord.p{i}", {"n": n}) for n in range(per_publisher)]

        seqs = await asyncio.gather(*(publish_all(i, h) for i, h in enumerate(publishers)))
        for mine in seqs:
            assert mine == sorted(mine)  # each publisher's seqs increase
        total = len(publishers) * per_publisher
        assert len({s for mine in seqs for s in mine}) == total

        seen = []
        for h in subs:
            events = [await h.recv_event() for _ in range(total)]
            seen.append([(e.seq, e.topic, e.payload["n"]) for e in events])
        assert all(s == seen[0] for s in seen)
        numbers = [s for s, _, _ in seen[0]]
        assert numbers == sorted(set(numbers))  # strictly increasing
        for i in range(len(publishers)):  # each publisher's events in its own order
            assert [n for _, t, n in seen[0] if t == f"ord.p{i}"] == list(range(per_publisher))


async def test_publish_gives_increasing_seq(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(10):
        hs = [await connect(inst, r) for r in (3, 0, 2, 1)]
        seqs = [await hs[i % 4].publish("inc.x") for i in range(12)]
        assert seqs == sorted(set(seqs))  # strictly increasing, whichever rank published
        # publish without waiting for the seq (no response), then one that waits
        hs[0].publish_nowait("inc.y")
        assert await hs[0].publish("inc.z") > seqs[-1] + 1


async def test_bad_publish_requests(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(10):
        h = await connect(inst, 1)
        for bad in (None, {}, {"topic": 5}, {"topic": ""}, {"topic": "x", "flags": "private"},
                    # a topic every rank would keep in its match cache
                    {"topic": "t" * (MAX_EVENT_TOPIC + 1)},
                    # sequenced, then dropped as malformed by every rank: a gap
                    {"topic": "x", "userid": True}, {"topic": "x", "userid": "a"},
                    {"topic": "x", "userid": -5}, {"topic": "x", "flags": -1}):
            with pytest.raises(RemoteError) as info:
                await h.rpc("event.pub", bad)
            assert info.value.errnum == errno.EPROTO, str(bad)[:80]
        assert (await stats(h, 1))["events"]["gaps"] == 0
        await h.publish("t" * MAX_EVENT_TOPIC)  # the longest is fine
        for bad in (None, {"topic": 7}, {"topic": "p" * (MAX_EVENT_TOPIC + 1)}):
            with pytest.raises(RemoteError) as info:
                await h.rpc("event.subscribe", bad)
            assert info.value.errnum == errno.EPROTO, bad


async def test_subscribe_only_on_own_rank(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(10):
        h = await connect(inst, 1)
        with pytest.raises(RemoteError) as info:
            await h.rpc("event.subscribe", {"topic": "x."}, nodeid=0)
        assert info.value.errnum == errno.EINVAL


async def test_private_events_reach_the_owner(start_instance, connect) -> None:
    """The owner sees every private event (guests: see test_broker_guests.py)."""
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(10):
        sub = await connect(inst, 1)
        pub = await connect(inst, 0)
        await sub.subscribe("p.")
        seq = await pub.publish("p.secret", {"x": 1}, private=True)
        ev = await sub.recv_event()
        assert ev.topic == "p.secret" and ev.seq == seq
        assert ev.flags & MsgFlags.PRIVATE
        # private for another user: the owner still sees it
        await pub.rpc("event.pub", {"topic": "p.theirs", "flags": MsgFlags.PRIVATE, "userid": 4242})
        ev = await sub.recv_event()
        assert ev.topic == "p.theirs" and ev.userid == 4242
