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


@pytest.mark.both_loops
async def test_one_turns_small_messages_go_out_together_in_order(wired) -> None:
    """The turn's first message is written at once; the ones after it in the
    same turn are held and written together before the loop next waits."""
    ta, writer, sink = wired
    messages = [[b"m", str(i).encode() * 10] for i in range(100)]
    writer.send(messages[0])
    assert writer.buffered() == ta.get_write_buffer_size()  # the first: at once
    for m in messages[1:]:
        writer.send(m)
    held = sum(len(codec.stream_prefix(m)) + sum(map(len, m)) for m in messages[1:])
    assert writer.buffered() == ta.get_write_buffer_size() + held
    big = b"b" * (CHUNK + 1)
    writer.send([big])  # a big one lets what was held go first
    writer.send([b"after"])
    sink.want, sink.waiter = 102, asyncio.get_running_loop().create_future()
    await asyncio.wait_for(sink.waiter, 10)
    assert sink.messages == [*messages, [big], [b"after"]]
    assert writer.buffered() == 0


@pytest.mark.both_loops
async def test_flush_hands_held_messages_over_before_a_close(wired) -> None:
    ta, writer, sink = wired
    for i in range(5):
        writer.send([b"n", bytes([i])])
    writer.flush()
    assert writer.buffered() == ta.get_write_buffer_size()  # nothing held back
    ta.close()  # a close flushes the transport, not the writer
    sink.want, sink.waiter = 5, asyncio.get_running_loop().create_future()
    await asyncio.wait_for(sink.waiter, 10)
    assert sink.messages == [[b"n", bytes([i])] for i in range(5)]
