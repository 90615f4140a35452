"""broker.framewriter: large messages reach a real stream transport in
pieces, intact and in order, while small ones are written whole."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import pytest

from broker import codec
from broker.framewriter import CHUNK, FramedProtocol, FrameWriter


class _Sink(asyncio.Protocol):
    def __init__(self) -> None:
        self.decoder = codec.StreamDecoder()
        self.messages: list[list[bytes]] = []
        self.waiter: asyncio.Future[None] | None = None
        self.want = 0

    def data_received(self, data: bytes) -> None:
        self.messages += self.decoder.feed(data)
        if self.waiter is not None and len(self.messages) >= self.want and not self.waiter.done():
            self.waiter.set_result(None)


class _Source(FramedProtocol):
    """The protocol base the broker's connections use, as it is."""


@pytest.fixture
async def wired() -> AsyncIterator[tuple[asyncio.Transport, FrameWriter, _Sink]]:
    """A writer's transport, the writer, and the sink at the other end of a
    real socket pair."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    ta, src = await loop.create_unix_connection(_Source, sock=a)
    tb, sink = await loop.create_unix_connection(_Sink, sock=b)
    assert src.writer is not None
    try:
        yield ta, src.writer, sink
    finally:
        ta.close()
        tb.close()


@pytest.mark.both_loops
async def test_big_message_goes_in_pieces_and_order_is_kept(wired) -> None:
    ta, writer, sink = wired
    loop = asyncio.get_running_loop()
    big = bytes(range(256)) * (16 << 12)  # 16 MiB
    writer.send([b"head", big])
    # The transport was handed at most a piece beyond what the socket took:
    # the rest waits in the writer until the transport drains.
    assert ta.get_write_buffer_size() <= 2 * CHUNK
    assert writer.buffered() > len(big) // 2
    writer.send([b"small-1"])
    writer.send([b"small-2", b"x" * 10])
    sink.want, sink.waiter = 3, loop.create_future()
    await asyncio.wait_for(sink.waiter, 30)
    assert sink.messages[0] == [b"head", big]
    assert sink.messages[1:] == [[b"small-1"], [b"small-2", b"x" * 10]]
    assert writer.buffered() == 0


@pytest.mark.both_loops
async def test_small_message_is_written_whole(wired) -> None:
    ta, writer, sink = wired
    writer.send([b"h", b"p" * 1000])
    assert writer.buffered() == ta.get_write_buffer_size()  # nothing held back
    sink.want, sink.waiter = 1, asyncio.get_running_loop().create_future()
    await asyncio.wait_for(sink.waiter, 10)
    assert sink.messages == [[b"h", b"p" * 1000]]
