"""The client ``Handle`` against crafted answers on a real Unix socket.

The peer here is the test itself speaking the wire format (docs/protocol.md),
so the Handle meets answers a broker would never send: garbage payloads,
spoiled headers, unknown matchtags, streams.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import msgpack
import pytest

from broker import codec
from broker.errors import ProtocolError, RemoteError
from broker.handle import Handle
from broker.message import Message, MsgType

T = 5.0


class Peer:
    """A one-connection server: hands each request to the test, sends what it is told."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[Message] = asyncio.Queue()
        self.writer: asyncio.StreamWriter | None = None
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        decoder = codec.StreamDecoder()
        try:
            while data := await reader.read(1 << 16):
                for frames in decoder.feed(data):
                    self.requests.put_nowait(codec.decode(frames))
        finally:
            writer.close()
            self.done.set()

    def send_frames(self, frames: list[bytes]) -> None:
        assert self.writer is not None
        self.writer.write(codec.to_stream(frames))

    def answer(self, req: Message, payload: Any = None, errnum: int = 0,
               errstr: str | None = None) -> None:
        self.send_frames(codec.encode(req.response(payload, errnum, errstr)))  # type: ignore[arg-type]


@pytest.fixture
async def wired(tmp_path: Path):
    peer = Peer()
    path = str(tmp_path / "peer.sock")
    server = await asyncio.start_unix_server(peer.serve, path)
    h = await Handle.connect(f"local://{path}")
    yield h, peer
    await h.close()
    await asyncio.wait_for(peer.done.wait(), T)  # the peer saw the hang-up
    server.close()
    await server.wait_closed()


def header(req: Message, **fields: Any) -> bytes:
    h = [MsgType.RESPONSE, req.topic, req.matchtag, 0, 0, 0, 0, [], 0, None, 0]
    names = ["type", "topic", "matchtag", "nodeid", "flags", "userid", "rolemask", "route",
             "errnum", "errstr", "seq"]
    for name, value in fields.items():
        h[names.index(name)] = value
    return msgpack.packb(h)


@pytest.mark.both_loops
async def test_answers_errors_and_garbage(wired) -> None:
    h, peer = wired
    ok = h.rpc("svc.ok", {"a": 1})
    req = await asyncio.wait_for(peer.requests.get(), T)
    assert (req.topic, req.payload) == ("svc.ok", {"a": 1})
    peer.answer(req, {"b": [1, b"x" * codec.OOB_THRESHOLD]})  # a blob in its own frame
    assert await asyncio.wait_for(ok, T) == {"b": [1, b"x" * codec.OOB_THRESHOLD]}

    failing = h.rpc("svc.fail", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.answer(req, errnum=errno.ENOENT, errstr="no such thing")
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(failing, T)
    assert (info.value.errnum, info.value.errstr) == (errno.ENOENT, "no such thing")

    garbage = h.rpc("svc.garbage", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.send_frames([header(req), b"\xc1 not msgpack"])
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(garbage, T)


@pytest.mark.both_loops
async def test_spoiled_headers_and_strangers_are_dropped(wired) -> None:
    h, peer = wired
    pending = h.rpc("svc.wait", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.send_frames([header(req, matchtag=str(req.matchtag)), msgpack.packb({})])
    peer.send_frames([header(req, errnum="ENOENT")])
    peer.send_frames([header(req, matchtag=req.matchtag + 1000), msgpack.packb({"x": 1})])
    peer.send_frames([b"\xc1"])
    peer.answer(req, {"finally": True})  # the one sound answer settles it
    assert await asyncio.wait_for(pending, T) == {"finally": True}
    assert h.pending == 0


@pytest.mark.both_loops
async def test_a_stream_gets_every_answer_in_order(wired) -> None:
    h, peer = wired
    stream = h.rpc_stream("svc.stream", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    for i in range(3):
        peer.answer(req, {"i": i})
    peer.answer(req, errnum=errno.ENODATA)
    got = [p async for p in stream]
    assert got == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert h.pending == 0
