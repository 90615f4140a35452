"""The tcp:// overlay: ZeroMQ CURVE admits only the instance's own ranks."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq
import zmq.asyncio
from test_broker_support import stats
from zmq.utils.monitor import recv_monitor_message

from broker.curve import load_keys

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
