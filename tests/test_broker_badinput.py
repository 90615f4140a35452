"""Malformed input never stops a broker: EPROTO where a response is possible,
otherwise dropped (and counted), and every other client keeps being served."""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import struct
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio
from test_broker_support import RawClient, stats, wait_until

from broker import codec
from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import make_rundir
from broker.message import Message, MsgFlags, MsgType, RawPayload
from broker.overlay import Overlay, ipc_endpoint
from broker.router import Router


async def still_serving(h: Handle, size: int) -> None:
    for rank in range(size):
        assert (await h.ping(rank))["rank"] == rank


# ---------------------------------------------------------------- the connector


@pytest.mark.both_loops
async def test_garbage_bytes_close_that_connection_only(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(15):
        good = await connect(inst, 1)
        for garbage in (
            b"GARBAGE!" * 10,
            struct.pack("<I", 0) + b"\x00" * 8,
            struct.pack("<I", codec.MAX_FRAMES + 1) + b"\x01" * 300,
        ):
            raw = await RawClient.connect(inst, 1)
            raw.send_bytes(garbage)
            await raw.wait_closed_by_peer()
            await raw.close()
            await still_serving(good, 2)
        assert (await stats(good))["connector"]["garbage"] == 3


async def test_garbage_header_is_dropped(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    raw = await RawClient.connect(inst)
    try:
        async with asyncio.timeout(10):
            raw.send_frames([b"\xc1\xc1garbage"])
            raw.send_frames([msgpack.packb({"not": "a header"})])
            raw.send_frames([msgpack.packb([2, "x"])])
            # the same connection is still served, and nothing came back for the above
            msg = await raw.rpc("broker.ping", {}, matchtag=11)
            assert msg.errnum == 0
            h = await connect(inst)
            assert (await stats(h))["connector"]["malformed"] == 3
    finally:
        await raw.close()


@pytest.mark.both_loops
async def test_garbage_payload_gets_eproto_with_its_matchtag(start_instance) -> None:
    inst = await start_instance(size=2, fanout=2)
    raw = await RawClient.connect(inst, 1)
    try:
        async with asyncio.timeout(10):
            req = Message(MsgType.REQUEST, "attr.get", matchtag=4242)
            for tag, frames in enumerate(
                [[b"\xc1"], [b"\x92\x01"], [msgpack.packb(msgpack.ExtType(7, b"x"))]], 100
            ):
                req.matchtag = tag
                raw.send_frames([codec.encode_header(req), *frames])
                msg = await raw.recv()
                assert msg.type == MsgType.RESPONSE
                assert (msg.matchtag, msg.errnum) == (tag, errno.EPROTO)
            # the same on another rank: the payload is only unpacked where it is served
            req.matchtag, req.nodeid = 7, 0
            raw.send_frames([codec.encode_header(req), b"\xc1"])
            msg = await raw.recv()
            assert (msg.matchtag, msg.errnum) == (7, errno.EPROTO)
    finally:
        await raw.close()


async def test_a_request_whose_matchtag_is_not_a_u32_is_dropped(start_instance,
                                                                 connect) -> None:
    """A matchtag is a u32 (protocol.md): one outside it could be carried
    by no answer, so the request is dropped and counted, not served."""
    inst = await start_instance(size=1)
    raw = await RawClient.connect(inst)
    try:
        async with asyncio.timeout(10):
            for tag in (2**32, -1, 2**63):
                h = [MsgType.REQUEST, "attr.get", tag, 0, 0, 0, 0, [], 0, None, 0]
                raw.send_frames([msgpack.packb(h), msgpack.packb({"name": "rank"})])
            # the next answer on this connection is the ping's, nothing before it
            msg = await raw.rpc("broker.ping", {}, matchtag=2**32 - 1)
            assert (msg.matchtag, msg.errnum, msg.topic) == (2**32 - 1, 0, "broker.ping")
            h = await connect(inst)
            assert (await stats(h))["connector"]["malformed"] == 3
    finally:
        await raw.close()


async def test_malformed_noresponse_request_gets_no_answer(start_instance) -> None:
    inst = await start_instance(size=1)
    raw = await RawClient.connect(inst)
    try:
        async with asyncio.timeout(10):
            # a header that fails to decode (route of the wrong type) but
            # whose matchtag, topic and flags can be read
            h = [MsgType.REQUEST, "attr.get", 0, 0, int(MsgFlags.NORESPONSE), 0, 0, "bad", 0,
                 None, 0]
            raw.send_frames([msgpack.packb(h)])
            # the next answer on this connection is the ping's, nothing before it
            msg = await raw.rpc("broker.ping", {}, matchtag=12)
            assert (msg.matchtag, msg.errnum, msg.topic) == (12, 0, "broker.ping")
    finally:
        await raw.close()


async def test_a_flood_of_bad_messages_is_logged_once_a_second_not_each(
        start_instance, connect) -> None:
    """A client chooses how many bad messages it sends: 300 garbage headers
    and 300 malformed NORESPONSE requests are all counted, but logged a few
    times (once a second per kind, the next line saying how many it held
    back), so they neither flood stderr nor push the rank's other records
    out of the ring ``kvbroker dmesg`` reads."""
    inst = await start_instance(size=1, attrs={"log.level": "info"})
    assert inst.stderr_path is not None
    h = await connect(inst)
    raw = await RawClient.connect(inst)
    bad_request = [MsgType.REQUEST, "attr.get", 0, 0, int(MsgFlags.NORESPONSE), 0, 0, "bad",
                   0, None, 0]
    try:
        async with asyncio.timeout(30):
            for _ in range(300):
                raw.send_frames([b"\xc1garbage"])
                raw.send_frames([msgpack.packb(bad_request)])
            assert (await raw.rpc("broker.ping", {}, matchtag=11)).errnum == 0
    finally:
        await raw.close()
    assert (await stats(h))["connector"]["malformed"] == 600
    log = Path(inst.stderr_path).read_text()
    garbage_lines = log.count("dropping malformed message")
    request_lines = log.count("dropping malformed request")
    assert 1 <= garbage_lines <= 5 and 1 <= request_lines <= 5, log
    entries = [e async for e in h.rpc_stream("log.dmesg", {})]
    assert sum("dropping malformed" in e["message"] for e in entries) <= 10
    assert any("no statedir" in e["message"] for e in entries)  # not pushed out


async def test_a_flood_of_non_requests_is_logged_once_a_second_not_each(
        start_instance, connect) -> None:
    """A client sends requests only; 300 well-formed events and responses
    from one are all dropped and counted, but logged a few times, as the
    other kinds of a client's bad input are (LogThrottle): one WARNING each
    let any client flood stderr and the ring ``kvbroker dmesg`` reads."""
    inst = await start_instance(size=1)
    assert inst.stderr_path is not None
    h = await connect(inst)
    raw = await RawClient.connect(inst)
    try:
        async with asyncio.timeout(30):
            for i in range(150):
                raw.send(Message(MsgType.EVENT, "forged.event", {}, seq=i + 1))
                raw.send(Message(MsgType.RESPONSE, "forged.response", {}, matchtag=i))
            assert (await raw.rpc("broker.ping", {}, matchtag=1_000)).errnum == 0
    finally:
        await raw.close()
    assert (await stats(h))["connector"]["malformed"] == 300
    log = Path(inst.stderr_path).read_text()
    assert 1 <= log.count("clients send requests only") <= 5, log
    entries = [e async for e in h.rpc_stream("log.dmesg", {})]
    assert sum("clients send requests only" in e["message"] for e in entries) <= 5
    assert any("no statedir" in e["message"] for e in entries)  # not pushed out


async def test_wrong_field_types_get_eproto(start_instance) -> None:
    inst = await start_instance(size=1)
    raw = await RawClient.connect(inst)
    try:
        async with asyncio.timeout(10):
            # payload fields of the wrong type
            for tag, payload in enumerate([{"name": 5}, {"name": None}, ["rank"], "rank"], 1):
                msg = await raw.rpc("attr.get", payload, matchtag=tag)
                assert msg.errnum == errno.EPROTO
            # header fields of the wrong type: answered when matchtag and topic are readable
            h = [MsgType.REQUEST, "attr.get", 55, "ANY", 0, 0, 0, [], 0, None, 0]
            raw.send_frames([msgpack.packb(h), msgpack.packb({"name": "rank"})])
            msg = await raw.recv()
            assert (msg.matchtag, msg.errnum, msg.topic) == (55, errno.EPROTO, "attr.get")
            h = [MsgType.REQUEST, "attr.get", 56, 0, 0, 0, 0, [1, 2], 0, None, 0]
            raw.send_frames([msgpack.packb(h)])
            msg = await raw.recv()
            assert (msg.matchtag, msg.errnum) == (56, errno.EPROTO)
            assert (await raw.rpc("attr.get", {"name": "rank"}, matchtag=57)).payload == {
                "value": 0
            }
    finally:
        await raw.close()


async def test_a_header_of_nested_arrays_is_answered_without_unpacking_it(
        start_instance) -> None:
    """A route of a million empty arrays (a byte each, 1 MB) is answered
    EPROTO with its matchtag, and the rank serves on; it was unpacked whole,
    twice (1.7 GB and 6.6 s of the loop for 12 MB, from a guest)."""
    inst = await start_instance(size=1)
    raw = await RawClient.connect(inst)
    try:
        head = msgpack.packb([MsgType.REQUEST, "attr.get", 58, 0, 0, 0, 0])
        tail = msgpack.packb([0, None, 0])[1:]
        route = b"\xdd" + (1_000_000).to_bytes(4, "big") + b"\x90" * 1_000_000
        async with asyncio.timeout(10):
            raw.send_frames([b"\x9b" + head[1:] + route + tail])
            msg = await raw.recv()
            assert (msg.matchtag, msg.errnum) == (58, errno.EPROTO)
            assert "a header of 1000" in msg.errstr
            assert (await raw.rpc("attr.get", {"name": "rank"}, matchtag=59)).payload == {
                "value": 0}
    finally:
        await raw.close()


@pytest.mark.both_loops
async def test_clients_cannot_send_responses_or_events(start_instance) -> None:
    inst = await start_instance(size=2, fanout=2)
    victim = await RawClient.connect(inst, 1)
    forger = await RawClient.connect(inst, 1)
    try:
        async with asyncio.timeout(10):
            victim_id = (await victim.rpc("broker.ping", {}, matchtag=1)).payload["route"][0]
            victim.request("event.subscribe", {"topic": "forged."}, matchtag=2)
            assert (await victim.recv()).matchtag == 2
            forger.send(
                Message(
                    MsgType.RESPONSE, "broker.ping", {"fake": True}, matchtag=999, route=[victim_id]
                )
            )
            forger.send(Message(MsgType.EVENT, "forged.event", {"fake": True}, seq=1))
            forger.send(Message(MsgType.CONTROL, "overlay.hello", {"rank": 0}))
            # once the forger's next request is answered, its forgeries were handled
            assert (await forger.rpc("broker.ping", {}, matchtag=3)).errnum == 0
            forger.request("event.pub", {"topic": "forged.real"}, matchtag=4)
            assert (await forger.recv()).matchtag == 4
            # the victim's next message is the real event, not a forgery
            msg = await victim.recv()
            assert (msg.type, msg.topic) == (MsgType.EVENT, "forged.real")
            reply = await victim.rpc("broker.stats-get", {}, matchtag=5)
            assert reply.payload["connector"]["malformed"] == 3
    finally:
        await victim.close()
        await forger.close()


def oversized_errstr(size: int, limit: int) -> str:
    return f"message of {size} bytes exceeds broker.max-message ({limit})"


@pytest.mark.both_loops
@pytest.mark.parametrize("chunk", [None, 1000])
async def test_oversized_requests_are_answered(start_instance, chunk: int | None) -> None:
    inst = await start_instance(size=2, fanout=2, attrs={"broker.max-message": "4096"})
    raw = await RawClient.connect(inst, 1)
    try:
        async with asyncio.timeout(10):
            assert (
                await raw.rpc("attr.get", {"name": "broker.max-message"}, matchtag=1)
            ).payload == {"value": "4096"}
            big = codec.encode(
                Message(MsgType.REQUEST, "broker.ping", {"pad": b"x" * 10000}, matchtag=2)
            )
            size = sum(len(f) for f in big)
            quiet = codec.encode(
                Message(MsgType.REQUEST, "broker.ping", {"pad": b"q" * 10000},
                        flags=MsgFlags.NORESPONSE)
            )
            garbage = [b"\xc1not a header", b"g" * 10000]
            data = b"".join(
                codec.to_stream(f)  # type: ignore[arg-type]
                for f in (
                    big, quiet, garbage,
                    codec.encode(Message(MsgType.REQUEST, "broker.ping", {"n": 3},
                                         matchtag=3, nodeid=0)),
                )
            )
            if chunk is None:
                raw.send_bytes(data)
            else:  # the oversized ones arrive in pieces: skipped as they come
                for pos in range(0, len(data), chunk):
                    raw.send_bytes(data[pos : pos + chunk])
                    await raw.writer.drain()
            # the oversized request is answered; the NORESPONSE one and the
            # one whose header is garbage get nothing; the next one is served
            msg = await raw.recv()
            assert (msg.type, msg.matchtag, msg.topic) == (MsgType.RESPONSE, 2, "broker.ping")
            assert msg.errnum == errno.EMSGSIZE
            assert msg.errstr == oversized_errstr(size, 4096)
            msg = await raw.recv()
            assert (msg.matchtag, msg.errnum, msg.payload["n"]) == (3, 0, 3)
            msg = await raw.rpc("broker.stats-get", {}, matchtag=4)
            assert msg.payload["connector"]["oversized"] == 3
            # just under the limit is fine
            msg = await raw.rpc("broker.ping", {"pad": b"y" * 3000}, matchtag=5)
            assert msg.errnum == 0
    finally:
        await raw.close()


async def test_oversized_rpc_from_a_handle_fails_and_the_handle_goes_on(
    start_instance, connect
) -> None:
    inst = await start_instance(size=2, fanout=2, attrs={"broker.max-message": "1000"})
    async with asyncio.timeout(10):
        h = await connect(inst, 1)
        with pytest.raises(RemoteError) as info:
            await h.rpc("broker.ping", {"pad": "x" * 2000}, nodeid=0)
        assert info.value.errnum == errno.EMSGSIZE
        assert "exceeds broker.max-message (1000)" in info.value.errstr
        assert (await h.ping(0))["rank"] == 0  # the same connection goes on
        assert (await stats(h, 1))["connector"]["oversized"] == 1


LINK_LIMIT = 65536


async def test_messages_too_big_for_a_link_are_answered_not_dropped(start_instance,
                                                                    connect) -> None:
    """``tbon.max-message``: the sending rank answers ``EMSGSIZE`` in place of
    a request or a response too big for the link (its neighbour would drop
    it, and the requester would wait for ever), and rank 0 refuses such an
    event before giving it a sequence number."""
    inst = await start_instance(size=4, fanout=2,
                                attrs={"tbon.max-message": str(LINK_LIMIT)})
    async with asyncio.timeout(20):
        h0, h3 = await connect(inst, 0), await connect(inst, 3)
        # a request: rank 3 does not send it up
        with pytest.raises(RemoteError) as info:
            await h3.rpc("broker.ping", {"pad": b"x" * 100_000}, nodeid=0)
        assert info.value.errnum == errno.EMSGSIZE
        assert f"exceeds tbon.max-message ({LINK_LIMIT})" in info.value.errstr
        # a response: rank 0's answer to rank 3's client does not fit
        await h0.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
            {"key": "big", "flags": 0,
             "dirent": {"ver": 1, "type": "val", "data": b"v" * 100_000}}]})
        with pytest.raises(RemoteError) as info:
            await h3.rpc("kvs.lookup", {"key": "big", "flags": 0, "namespace": "primary"},
                         nodeid=0)
        assert info.value.errnum == errno.EMSGSIZE
        assert f"exceeds tbon.max-message ({LINK_LIMIT})" in info.value.errstr
        assert (await h3.ping(0))["rank"] == 0  # and the way goes on
        # an event: refused whole, not delivered on rank 0 and lost below it
        await h3.subscribe("test.")
        await h0.subscribe("test.")
        with pytest.raises(RemoteError) as info:
            await h0.publish("test.big", {"pad": b"e" * 100_000})
        assert info.value.errnum == errno.EMSGSIZE
        # more large values than a message has frames travel too
        values = [bytes([i]) * 4096 for i in range(10)]
        seq = await h0.publish("test.many", {"a": values})
        for h in (h0, h3):
            ev = await h.recv_event()
            assert (ev.topic, ev.seq, ev.payload) == ("test.many", seq, {"a": values})
        assert (await stats(h3, 3))["events"]["gaps"] == 0
        assert (await stats(h3, 3))["messages"]["oversized"] == 1
        assert (await stats(h0, 0))["messages"]["oversized"] == 1
        await still_serving(h3, 4)


async def test_a_client_event_that_grows_past_a_link_is_refused(start_instance,
                                                                  connect) -> None:
    """Rank 0 measured a client's event by its request's bytes, but sends
    the payload re-packed: a request of msgpack float32s (5 bytes each)
    fits ``tbon.max-message``, the event (float64s, 9 bytes each) does not.
    It was sequenced, delivered on rank 0 and dropped by the link: a gap
    on the follower, whose subscriber never saw it.  Now refused
    ``EMSGSIZE`` before it has a sequence number."""
    inst = await start_instance(size=2, fanout=2,
                                attrs={"tbon.max-message": str(LINK_LIMIT)})
    async with asyncio.timeout(20):
        h0, h1 = await connect(inst, 0), await connect(inst, 1)
        await h0.subscribe("test.")
        await h1.subscribe("test.")
        floats = [0.5] * 12_000
        packed = msgpack.packb({"topic": "test.floats", "payload": {"f": floats}},
                               use_single_float=True)
        assert len(packed) < LINK_LIMIT - 1000  # the request fits a link
        assert len(msgpack.packb(floats)) > LINK_LIMIT  # the event does not
        with pytest.raises(RemoteError) as info:
            await h0.rpc("event.pub", RawPayload([packed]))
        assert info.value.errnum == errno.EMSGSIZE, info.value.errstr
        small = await h0.publish("test.small", {"n": 1})
        for h in (h0, h1):  # neither saw the big one: the next is the small one
            ev = await h.recv_event()
            assert (ev.topic, ev.seq) == ("test.small", small)
        assert (await stats(h1, 1))["events"]["gaps"] == 0


async def test_an_answer_too_big_for_the_client_fails_its_request(start_instance,
                                                                  connect) -> None:
    """A client's decoder skips an answer over its limit; the request it
    answers fails with EMSGSIZE (it waited for ever) and the handle goes on."""
    inst = await start_instance(size=1)
    async with asyncio.timeout(10):
        h = await connect(inst)
        assert h._proto is not None
        h._proto.decoder.max_message = 10_000
        with pytest.raises(RemoteError) as info:
            await h.rpc("broker.ping", {"pad": b"x" * 20_000})
        assert info.value.errnum == errno.EMSGSIZE
        assert "exceeds this client's limit (10000)" in info.value.errstr
        assert (await h.ping(0))["rank"] == 0


# ---------------------------------------------------------------- the overlay


@pytest.mark.both_loops
async def test_rogue_peers_on_a_ranks_router_are_dropped(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs={"tbon.transport": "ipc"})
    ctx = zmq.asyncio.Context()
    socks = []
    try:
        async with asyncio.timeout(15):
            h = await connect(inst, 0)
            before = (await stats(h, 1))["overlay"]["dropped"]
            ping = codec.encode(
                Message(MsgType.REQUEST, "broker.ping", {}, matchtag=1, route=["c1"])
            )
            hello = codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": 9}))
            # rank 1's children are 3 (and 4, absent in a size-4 instance)
            sent = 0
            for ident in (b"9", b"0", b"2", b"4", b"rogue", None):
                s = ctx.socket(zmq.DEALER)
                s.linger = 0
                if ident is not None:
                    s.setsockopt(zmq.IDENTITY, ident)
                s.connect(ipc_endpoint(inst.rundir, 1))
                socks.append(s)
                for frames in (hello, ping, [b"\xc1garbage"]):
                    await s.send_multipart(frames)
                    sent += 1

            async def all_dropped() -> bool:
                return (await stats(h, 1))["overlay"]["dropped"] >= before + sent

            await wait_until(all_dropped, "rank 1 to drop every rogue message")
            for s in socks:
                assert not await s.poll(0), "a rogue peer got an answer"
            await still_serving(h, 4)
            assert (await stats(h, 1))["overlay"]["children"] == [3]
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


async def test_rogue_peers_on_a_stream_overlay_are_refused(start_instance, connect,
                                                           tmp_path) -> None:
    """The default unix-stream overlay: a peer whose first message is not one of
    the rank's children's hello is dropped and disconnected; the tree keeps going."""
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    before = (await stats(h, 1))["overlay"]["dropped"]
    path = os.path.join(inst.rundir, "tbon-1")
    ping = codec.encode(Message(MsgType.REQUEST, "broker.ping", {}, matchtag=1, route=["c1"]))
    firsts = [
        codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": 9})),  # not a child
        codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": 3})),  # taken
        ping,  # talk before hello
        [b"\xc1garbage"],
        # a hello whose payload is no msgpack, or whose rank is no int
        # (each raised in the handler and left the connection open)
        [codec.encode(Message(MsgType.CONTROL, "overlay.hello", None))[0], b"\xc1"],
        codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": [3]})),
        codec.encode(Message(MsgType.CONTROL, "overlay.hello", {"rank": True})),
    ]
    async with asyncio.timeout(15):
        for frames in firsts:
            reader, writer = await asyncio.open_unix_connection(path)
            writer.write(codec.to_stream(frames) + codec.to_stream(ping))
            await writer.drain()
            assert await reader.read() == b"", "a rogue peer got an answer"
            writer.close()
        assert (await stats(h, 1))["overlay"]["dropped"] == before + len(firsts)
        # garbage framing closes the connection too
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(b"\xff" * 64)
        assert await reader.read() == b""
        writer.close()
        await still_serving(h, 4)
        assert (await stats(h, 1))["overlay"]["children"] == [3]
    assert "Traceback" not in (tmp_path / "broker-0.log").read_text()


@pytest.mark.both_loops
async def test_overlay_handshake() -> None:
    """Rank 0's side of the overlay in-process, with test DEALERs as ranks 1 and 2."""
    rundir = make_rundir()
    router = Router(rank=0, size=3, fanout=2, owner_uid=os.getuid())
    overlay = Overlay(router, rundir, transport="ipc")
    await overlay.start()
    assert oct(os.stat(os.path.join(rundir, "tbon-0")).st_mode & 0o777) == "0o700"
    ctx = zmq.asyncio.Context()
    socks: dict[bytes, zmq.asyncio.Socket] = {}

    def dealer(ident: bytes) -> zmq.asyncio.Socket:
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.setsockopt(zmq.IDENTITY, ident)
        s.connect(ipc_endpoint(rundir, 0))
        socks[ident] = s
        return s

    async def dropped(n: int) -> None:
        async def check() -> bool:
            return overlay.dropped == n

        await wait_until(check, f"{n} dropped overlay messages")

    def control(topic: str, rank: int) -> list[bytes]:
        return codec.encode(Message(MsgType.CONTROL, topic, {"rank": rank}))  # type: ignore

    try:
        async with asyncio.timeout(15):
            # not a child of rank 0: its hello is dropped, never answered
            rogue = dealer(b"5")
            await rogue.send_multipart(control("overlay.hello", 5))
            await dropped(1)
            # a child that talks before its hello
            one = dealer(b"1")
            req = Message(MsgType.REQUEST, "nosuch.method", matchtag=9, route=["c1"])
            await one.send_multipart(codec.encode(req))
            await dropped(2)
            await one.send_multipart([b"\xc1garbage"])
            await dropped(3)
            # the hello is answered with the parent's rank and the size
            await one.send_multipart(control("overlay.hello", 1))
            msg = codec.decode(await one.recv_multipart())
            assert (msg.type, msg.topic, msg.payload) == (
                MsgType.CONTROL,
                "overlay.hello",
                {"rank": 0, "size": 3},
            )
            # now its requests are routed: no such service on rank 0 -> ENOSYS,
            # sent back down to rank 1 with rank 1's part of the route left
            await one.send_multipart(codec.encode(req))
            msg = codec.decode(await one.recv_multipart())
            assert (msg.type, msg.matchtag, msg.errnum, msg.route) == (
                MsgType.RESPONSE,
                9,
                errno.ENOSYS,
                ["c1"],
            )
            # events only come down the tree: one sent up by a child is dropped
            await one.send_multipart(codec.encode(Message(MsgType.EVENT, "up.event", seq=1)))
            await one.send_multipart(control("overlay.ready", 1))

            async def counted() -> bool:
                return router.counts["dropped-events"] == 1

            await wait_until(counted, "the upward event to be dropped")
            assert not overlay.ready.done()  # rank 2 is not there yet
            two = dealer(b"2")
            await two.send_multipart(control("overlay.hello", 2))
            assert codec.decode(await two.recv_multipart()).topic == "overlay.hello"
            await two.send_multipart(control("overlay.ready", 2))
            await asyncio.wait_for(overlay.ready, 5)
            # a sequenced event goes to both children, once each
            router.sequence_event("down.event", {"x": 1}, 0, os.getuid())
            for s in (one, two):
                msg = codec.decode(await s.recv_multipart())
                assert (msg.type, msg.topic, msg.seq, msg.payload) == (
                    MsgType.EVENT,
                    "down.event",
                    1,
                    {"x": 1},
                )
            assert not await rogue.poll(0)
            assert overlay.dropped == 3
    finally:
        for s in socks.values():
            s.close(0)
        ctx.term()
        overlay.close()
        shutil.rmtree(rundir, ignore_errors=True)


async def test_a_replaced_ranks_old_process_leaves_the_new_socket(tmp_path) -> None:
    """A rank started again with the same run directory takes the local
    socket over; the old process, stopping, removed the new one's socket,
    and the rank was up but unreachable."""
    from broker.connector import Connector

    path = str(tmp_path / "local-3")
    old = Connector(Router(rank=3, size=4, fanout=2, owner_uid=os.getuid()), path,
                    owner_uid=os.getuid(), allow_guest=False)
    new = Connector(Router(rank=3, size=4, fanout=2, owner_uid=os.getuid()), path,
                    owner_uid=os.getuid(), allow_guest=False)
    await old.start()
    await new.start()  # takes the path over
    await old.close()
    assert os.path.exists(path)
    _reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 5)
    writer.close()
    await new.close()
    assert not os.path.exists(path)  # its own, removed


async def test_a_notice_sent_as_an_rpc_is_refused_not_left_waiting(start_instance,
                                                                   connect) -> None:
    """``rexec.credit`` and ``groups.resend`` are one-way notices their
    handlers never answer: sent expecting an answer (``kvbroker rpc``), the
    caller waited for ever; now ``EPROTO`` saying so, at once.  Sent as a
    notice, it is still taken (a ping after it is answered)."""
    inst = await start_instance(size=2, attrs={"broker.modules": "content,kvs,kvs-watch,groups"})
    h = await connect(inst, 0)
    for topic, payload, rank in (("rexec.credit", {"pid": 1, "bytes": 1}, 0),
                                 ("groups.resend", {}, 1)):
        with pytest.raises(RemoteError) as exc:
            await asyncio.wait_for(h.rpc(topic, payload, nodeid=rank), 10)
        assert exc.value.errnum == errno.EPROTO, exc.value
        assert f"{topic} is a notice, never answered" in exc.value.errstr
        h.send_noresponse(topic, payload, nodeid=rank)
        assert (await asyncio.wait_for(h.ping(rank), 10))["rank"] == rank
