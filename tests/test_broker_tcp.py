"""The tcp:// overlay: ZeroMQ CURVE admits only the instance's own ranks."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from test_broker_support import stats, wait_until
from zmq.utils.monitor import recv_monitor_message

from broker import codec
from broker.curve import load_keys
from broker.message import Message, MsgType

TCP = {"tbon.transport": "tcp"}


async def handshake_outcome(sock: zmq.asyncio.Socket, endpoint: str) -> int:
    """Connect ``sock`` and return the first handshake event its monitor reports."""
    mon = sock.get_monitor_socket()
    try:
        sock.connect(endpoint)
        while True:
            ev = await recv_monitor_message(mon)
            if ev["event"] in (
                zmq.EVENT_HANDSHAKE_SUCCEEDED,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                return int(ev["event"])
    finally:
        sock.disable_monitor()
        mon.close(0)


@pytest.mark.both_loops
async def test_tcp_overlay_with_curve(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=TCP)
    ctx = zmq.asyncio.Context()
    socks: list[zmq.asyncio.Socket] = []
    try:
        async with asyncio.timeout(20):
            # ranks with children listen on tcp://, the others only connect
            assert sorted(inst.endpoints) == [0, 1]
            assert all(e.startswith("tcp://127.0.0.1:") for e in inst.endpoints.values())
            assert not os.path.exists(os.path.join(inst.rundir, "tbon-0"))
            keyfile = os.path.join(inst.rundir, "curve.key")
            assert os.stat(keyfile).st_mode & 0o077 == 0
            h = await connect(inst, 0)
            resp = await h.ping(3)
            assert resp["rank"] == 3 and resp["route"][1:] == ["r0", "r1", "r3"]
            before = (await stats(h, 0))["overlay"]["dropped"]

            public, _ = load_keys(keyfile)
            # a peer with its own fresh key pair: refused by the ZAP handler
            rogue = ctx.socket(zmq.DEALER)
            socks.append(rogue)
            rogue.linger = 0
            rogue.setsockopt(zmq.IDENTITY, b"1")
            rogue.curve_serverkey = public
            rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
            outcome = await handshake_outcome(rogue, inst.endpoints[0])
            assert outcome == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            # a peer without CURVE at all: no handshake either
            plain = ctx.socket(zmq.DEALER)
            socks.append(plain)
            plain.linger = 0
            plain.setsockopt(zmq.IDENTITY, b"2")
            outcome = await handshake_outcome(plain, inst.endpoints[0])
            assert outcome != zmq.EVENT_HANDSHAKE_SUCCEEDED
            assert not await rogue.poll(0) and not await plain.poll(0)

            # the instance never noticed: nothing reached rank 0's router
            assert (await stats(h, 0))["overlay"]["dropped"] == before
            for rank in range(4):
                assert (await h.ping(rank))["rank"] == rank
            sub = await connect(inst, 3)
            await sub.subscribe("tcp.")
            seq = await h.publish("tcp.event", {"big": b"z" * 100000})
            ev = await sub.recv_event()
            assert ev.seq == seq and ev.payload == {"big": b"z" * 100000}
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


async def test_the_listening_ranks_get_distinct_ports_when_a_draw_repeats(
        start_instance, connect, monkeypatch) -> None:
    """Each listening rank's port was drawn at random and let go at once,
    before the next draw: two draws could name the same port (one pair in
    ~23,000, so now and then in a full suite's tcp instances), and the
    second rank's bind failed the start.  Here the second draw repeats the
    first on purpose: the ranks still get two ports, and serve."""
    real = random.randrange
    draws: list[int] = []

    def unlucky(*args: int) -> int:
        port = draws[0] if len(draws) == 1 else real(*args)
        draws.append(port)
        return port

    monkeypatch.setattr(random, "randrange", unlucky)
    inst = await start_instance(size=4, fanout=2, attrs=TCP)
    monkeypatch.undo()
    assert len(draws) >= 2 and draws[1] == draws[0]
    ports = {int(e.rsplit(":", 1)[1]) for e in inst.endpoints.values()}
    assert sorted(inst.endpoints) == [0, 1] and len(ports) == 2 and draws[0] in ports
    h = await connect(inst, 0)
    for rank in range(4):
        assert (await asyncio.wait_for(h.ping(rank), 10))["rank"] == rank


async def test_a_flood_of_bad_overlay_messages_is_logged_a_few_times(
        start_instance, connect) -> None:
    """A peer holding the instance's keys passes the CURVE handshake, so
    how many bad messages it sends is its choice: 600 (garbage, a request
    before any hello, a hello from a rank that is not a child) are all
    dropped and counted, but logged a few times each (once a second per
    kind, as the connector logs a client's bad input), not once each --
    which flooded stderr and pushed every other record out of the ring
    ``kvbroker dmesg`` reads -- and the rank keeps serving."""
    inst = await start_instance(size=4, fanout=2, attrs=TCP)
    assert inst.stderr_path is not None
    ctx = zmq.asyncio.Context()
    peer = ctx.socket(zmq.DEALER)
    peer.linger = 0
    try:
        async with asyncio.timeout(30):
            h = await connect(inst, 0)
            before = (await stats(h, 1))["overlay"]["dropped"]
            public, secret = load_keys(os.path.join(inst.rundir, "curve.key"))
            peer.curve_serverkey = public
            peer.curve_publickey, peer.curve_secretkey = public, secret
            peer.connect(inst.endpoints[1])
            ping = codec.encode(Message(MsgType.REQUEST, "broker.ping", {}, matchtag=1,
                                        route=["c1"]))
            hello = codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": 9}))
            for _ in range(200):
                for frames in ([b"\xc1garbage"], ping, hello):
                    await peer.send_multipart(frames)

            async def all_dropped() -> bool:
                return (await stats(h, 1))["overlay"]["dropped"] == before + 600

            await wait_until(all_dropped, "rank 1 to drop the peer's 600 messages", 20)
            # its hellos as rank 9 are answered, once: it holds the keys
            refused = codec.decode(await peer.recv_multipart())
            assert (refused.type, refused.topic, refused.payload) == (
                MsgType.CONTROL, "overlay.refused",
                {"rank": 1, "why": "rank 9 is not a child of rank 1 in this instance's "
                 "topology (size 4, fanout 2: it is not a rank of this instance): check "
                 "the bootstrap file"})
            for rank in range(4):
                assert (await h.ping(rank))["rank"] == rank
            entries = [e async for e in h.rpc_stream("log.dmesg", {}, nodeid=1)]
            assert not await peer.poll(0), "a second answer to the same peer"
    finally:
        peer.close(0)
        ctx.term()
    log = Path(inst.stderr_path).read_text()
    for line in ("dropping malformed message from an unidentified peer",
                 "its first message is not a child's hello",
                 "a hello from rank 9, which is not a child"):
        assert 1 <= log.count(line) <= 5, log
        assert 1 <= sum(line in e["message"] for e in entries) <= 5


async def test_a_flood_of_hellos_from_new_connections_is_logged_a_few_times(
        start_instance, connect) -> None:
    """Each new connection that says hello as a connected child replaces
    that child's old one (the newest process wins), and said so in a
    WARNING: a peer holding the instance's keys opened 60 connections, each
    saying hello as rank 3, for 60 lines -- stderr flooded and the ring
    ``kvbroker dmesg`` reads pushed out (and an INFO line each, "lost
    child rank 3", in the ring), as with its bad messages.  Every
    one is still counted (``overlay.replaced``) and the rank keeps
    serving, but logged a few times."""
    inst = await start_instance(size=4, fanout=2, attrs=TCP)
    assert inst.stderr_path is not None
    ctx = zmq.asyncio.Context()
    peers: list[zmq.asyncio.Socket] = []
    n = 60
    try:
        async with asyncio.timeout(30):
            h = await connect(inst, 0)
            public, secret = load_keys(os.path.join(inst.rundir, "curve.key"))
            hello = codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": 3}))
            for _ in range(n):  # (all kept open: a closed one is a lost rank 3)
                peer = ctx.socket(zmq.DEALER)
                peer.linger = 0
                peer.curve_serverkey = public
                peer.curve_publickey, peer.curve_secretkey = public, secret
                peer.connect(inst.endpoints[1])
                peers.append(peer)
                await peer.send_multipart(hello)

            async def all_replaced() -> bool:
                return (await stats(h, 1))["overlay"]["replaced"] == n

            await wait_until(all_replaced, f"rank 1 to replace rank 3 {n} times", 20)
            for rank in range(3):
                assert (await h.ping(rank))["rank"] == rank
            entries = [e async for e in h.rpc_stream("log.dmesg", {}, nodeid=1)]
    finally:
        for peer in peers:
            peer.close(0)
        ctx.term()
    log = Path(inst.stderr_path).read_text()
    line = "rank 3 said hello again from a new process"
    assert 1 <= log.count(line) <= 5, log
    assert 1 <= sum(line in e["message"] for e in entries) <= 5
    # (nor a line each in the ring at INFO, which it keeps)
    assert sum("lost child rank 3" in e["message"] for e in entries) <= 5
