"""Request routing across the tree, built-in services, and their errors
(docs/protocol.md, Routing)."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from test_broker_support import stats, tree_path

from broker import __version__
from broker.errors import RemoteError
from broker.message import NODEID_UPSTREAM, Role


def expected_route(client_route_id: str, src: int, dst: int, fanout: int) -> list[str]:
    return [client_route_id, *(f"r{r}" for r in tree_path(src, dst, fanout))]


@pytest.mark.both_loops
@pytest.mark.parametrize("size", [1, 4, 8])
async def test_ping_every_rank_from_several_ranks(start_instance, connect, size: int) -> None:
    inst = await start_instance(size=size, fanout=2)
    async with asyncio.timeout(30):
        for src in sorted({0, size // 2, size - 1}):
            h = await connect(inst, src)
            me = (await h.ping())["route"][0]
            assert me.startswith("c")
            for dst in range(size):
                resp = await h.ping(dst, {"hello": dst, "blob": b"\x00" * 5000})
                assert resp["rank"] == dst
                assert resp["route"] == expected_route(me, src, dst, 2)
                assert resp["hello"] == dst and resp["blob"] == b"\x00" * 5000
                assert resp["userid"] == os.getuid() and resp["rolemask"] == Role.OWNER


async def test_route_of_the_longest_path(start_instance, connect) -> None:
    inst = await start_instance(size=8, fanout=2)
    h = await connect(inst, 7)
    async with asyncio.timeout(10):
        me = (await h.ping())["route"][0]
        resp = await h.ping(6)
        # 7 -> 3 -> 1 -> 0 -> 2 -> 6: up to the common ancestor, then down
        assert resp["route"] == [me, "r7", "r3", "r1", "r0", "r2", "r6"]


async def test_nodeid_any_is_answered_locally(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(10):
        for rank in range(4):
            h = await connect(inst, rank)
            resp = await h.ping()
            assert resp["rank"] == rank and len(resp["route"]) == 2


async def test_upstream_goes_to_the_parent(start_instance, connect) -> None:
    inst = await start_instance(size=8, fanout=2)
    async with asyncio.timeout(10):
        for rank, parent in [(7, 3), (3, 1), (1, 0), (6, 2)]:
            h = await connect(inst, rank)
            resp = await h.ping(NODEID_UPSTREAM)
            assert resp["rank"] == parent
            assert resp["route"][1:] == [f"r{rank}", f"r{parent}"]
        h0 = await connect(inst, 0)
        with pytest.raises(RemoteError) as info:
            await h0.ping(NODEID_UPSTREAM)
        assert info.value.errnum == errno.EHOSTUNREACH


@pytest.mark.both_loops
async def test_unknown_rank_is_unreachable(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(10):
        for src in (0, 3):
            h = await connect(inst, src)
            for bad in (4, 99, 0xFFFFFFF0):
                with pytest.raises(RemoteError) as info:
                    await h.ping(bad)
                assert info.value.errnum == errno.EHOSTUNREACH
                # it says which ranks there are, so a typo is plain
                assert f"no route to rank {bad}: the instance has ranks 0-3" in str(info.value)
            assert (await h.ping(1))["rank"] == 1  # and the handle still works


async def test_unknown_service(start_instance, connect) -> None:
    inst = await start_instance(size=8, fanout=2)
    async with asyncio.timeout(10):
        h = await connect(inst, 7)
        h0 = await connect(inst, 0)
        before = (await stats(h0, 0))["messages"]["requests"]
        # nodeid ANY: not on rank 7, so upstream hop by hop; rank 0 answers ENOSYS
        with pytest.raises(RemoteError) as info:
            await h.rpc("nosuch.method", {})
        assert info.value.errnum == errno.ENOSYS
        assert "nosuch.method" in info.value.errstr
        after = (await stats(h0, 0))["messages"]["requests"]
        assert after >= before + 2  # the failed request reached rank 0 (plus our stats call)
        # a rank named explicitly answers ENOSYS itself
        with pytest.raises(RemoteError) as info:
            await h0.rpc("nosuch.method", {}, nodeid=5)
        assert info.value.errnum == errno.ENOSYS
        # an unknown method of a known service
        with pytest.raises(RemoteError) as info:
            await h.rpc("broker.nosuch", {}, nodeid=3)
        assert info.value.errnum == errno.ENOSYS


async def test_noresponse_requests_get_no_answer(start_instance, connect) -> None:
    from test_broker_support import RawClient

    from broker.message import MsgFlags

    inst = await start_instance(size=2, fanout=2)
    raw = await RawClient.connect(inst, 1)
    try:
        async with asyncio.timeout(10):
            raw.request("broker.ping", {}, matchtag=1, flags=MsgFlags.NORESPONSE)
            raw.request("nosuch.x", {}, matchtag=2, flags=MsgFlags.NORESPONSE)
            raw.request("broker.ping", {}, matchtag=3, nodeid=7, flags=MsgFlags.NORESPONSE)
            msg = await raw.rpc("broker.ping", {}, matchtag=4, nodeid=0)
            assert msg.errnum == 0 and msg.payload["rank"] == 0
    finally:
        await raw.close()


async def test_attributes(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(10):
        h = await connect(inst, 0)
        for rank in range(4):
            expected = {
                "rank": rank,
                "size": 4,
                "fanout": 2,
                "rundir": inst.rundir,
                "statedir": "",
                "version": __version__,
                "content.hash": "sha256",
                "local-uri": inst.uri(rank),
                "access.allow-guest-user": "false",
            }
            for name, value in expected.items():
                assert await h.attr_get(name, nodeid=rank) == value, name
            names = (await h.rpc("attr.list", {}, nodeid=rank))["names"]
            assert set(expected) <= set(names)
            assert names == sorted(names)
        with pytest.raises(RemoteError) as info:
            await h.attr_get("nosuch")
        assert info.value.errnum == errno.ENOENT
        for bad in (None, {}, {"name": 5}, {"name": None}, ["rank"]):
            with pytest.raises(RemoteError) as info:
                await h.rpc("attr.get", bad)
            assert info.value.errnum == errno.EPROTO, bad


async def test_attributes_set_on_the_command_line(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2, attrs={"content.hash": "sha1", "my.attr": "x"})
    async with asyncio.timeout(10):
        h = await connect(inst, 1)
        assert await h.attr_get("content.hash") == "sha1"
        assert await h.attr_get("my.attr", nodeid=0) == "x"
        blobref = (await h.rpc("content.store", {"data": b"abc"}))["blobref"]
        assert blobref.startswith("sha1-") and len(blobref) == 5 + 40


async def test_module_list_and_stats_get_of_every_module(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(10):
        h = await connect(inst, 1)
        for rank in (0, 1):
            modules = (await h.rpc("module.list", {}, nodeid=rank))["modules"]
            by_name = {m["name"]: m for m in modules}
            assert {"broker", "content"} <= set(by_name)
            assert set(by_name["broker"]["services"]) == {
                "broker", "attr", "event", "module", "log", "overlay", "config", "rexec"}
            for m in modules:
                assert isinstance(m["requests"], int)
                assert isinstance(await h.rpc(f"{m['name']}.stats-get", {}, nodeid=rank), dict)


async def test_stats_show_every_counter_even_at_zero(start_instance, connect) -> None:
    """A script reading ``stats["messages"]["unroutable"]`` must not get a
    KeyError on a quiet rank: every counter is there from the start, and
    the ones counted are exactly the declared ones."""
    from broker import connector, router
    from broker.content import module as content
    from kvs import module as kvs
    from kvs_watch import module as kvs_watch

    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(20):
        h = await connect(inst, 1)
        for rank in (0, 1):
            stats = await h.rpc("broker.stats-get", {}, nodeid=rank)
            assert set(stats["messages"]) == set(router.COUNTERS)
            assert stats["messages"]["unroutable"] == 0
            assert stats["connector"] == dict.fromkeys(connector.COUNTERS, 0)
            counts = (await h.rpc("kvs-watch.stats-get", {}, nodeid=rank))["counts"]
            assert counts == dict.fromkeys(kvs_watch.COUNTERS, 0)
            counts = (await h.rpc("kvs.stats-get", {}, nodeid=rank))["counts"]
            assert counts == dict.fromkeys(kvs.COUNTERS, 0)
            stats = await h.rpc("content.stats-get", {}, nodeid=rank)
            assert set(content.COUNTERS) <= set(stats), stats  # rank 0 stored its empty root
            assert stats["misses"] == 0
        # after some work, still the declared names and no others
        await h.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
            {"key": "z.a", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"1"}}]})
        await h.rpc("kvs.lookup", {"namespace": "primary", "key": "z.a", "flags": 0})
        for rank in (0, 1):
            assert set((await h.rpc("kvs.stats-get", {}, nodeid=rank))["counts"]) == \
                set(kvs.COUNTERS)
            assert set((await h.rpc("broker.stats-get", {}, nodeid=rank))["messages"]) == \
                set(router.COUNTERS)
        assert (await h.rpc("kvs.stats-get", {}, nodeid=1))["counts"]["relays"] == 1


async def test_broker_stats_counts(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(10):
        h3 = await connect(inst, 3)
        h0 = await connect(inst, 0)
        me = (await h3.ping())["route"][0]
        await h3.subscribe("count.")
        await h3.subscribe("count.")
        await h3.subscribe("other.")
        s0, s3 = await stats(h0, 0), await stats(h3)
        assert s3["rank"] == 3 and s0["rank"] == 0
        assert s3["subscriptions"][me] == 3
        assert s3["clients"] == 1 and s0["clients"] == 1
        assert s3["overlay"]["children"] == [] and s0["overlay"]["children"] == [1, 2]
        seq_before = s0["events"]["sequenced"]
        delivered_before = s3["events"]["delivered"]
        req_before = s3["messages"]["requests"]

        for _ in range(5):
            await h0.ping(3)
        last = 0
        for i in range(4):
            last = await h0.publish("count.x", {"i": i})
        for _ in range(4):
            ev = await h3.recv_event()
        assert ev.seq == last

        s0, s3 = await stats(h0, 0), await stats(h3)
        assert s0["events"]["sequenced"] >= seq_before + 4
        assert s3["events"]["delivered"] >= delivered_before + 4
        assert s3["events"]["last-seq"] == last and s3["events"]["gaps"] == 0
        assert s3["messages"]["requests"] >= req_before + 5  # the pings routed through rank 3
        assert s3["events"]["prefixes"] >= 2
