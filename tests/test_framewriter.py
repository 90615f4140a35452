"""broker.framewriter: large messages reach a real stream transport in
pieces, intact and in order, while small ones are written whole."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker import codec
from broker.framewriter import CHUNK, FramedProtocol, FrameWriter
from broker.loops import loop_factory


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
    # The transport was handed at most a piece beyond its high-water mark:
    # the rest waits in the writer until the transport drains.
    assert ta.get_write_buffer_size() <= ta.get_write_buffer_limits()[1] + CHUNK
    assert writer.buffered() > len(big) // 2
    writer.send([b"small-1"])
    writer.send([b"small-2", b"x" * 10])
    sink.want, sink.waiter = 3, loop.create_future()
    await asyncio.wait_for(sink.waiter, 30)
    assert sink.messages[0] == [b"head", big]
    assert sink.messages[1:] == [[b"small-1"], [b"small-2", b"x" * 10]]
    assert writer.buffered() == 0


@pytest.mark.both_loops
async def test_drop_unstarted_keeps_the_message_begun_and_what_follows_is_whole(wired) -> None:
    """What a slow consumer is told why it is dropped with: every message
    not begun goes (small ones packed together, a second big one), the big
    one part-written is finished, and the next message is read right after
    it, whole."""
    ta, writer, sink = wired
    loop = asyncio.get_running_loop()
    big = bytes(range(256)) * (16 << 12)  # 16 MiB: begun, most of it waiting
    writer.send([b"head", big])
    for i in range(50):
        writer.send([b"small", b"%d" % i])
    writer.send([b"head-2", big])
    before = writer.buffered()
    dropped = writer.drop_unstarted()
    assert dropped > len(big) and writer.buffered() == before - dropped
    writer.send([b"why"])
    sink.want, sink.waiter = 2, loop.create_future()
    await asyncio.wait_for(sink.waiter, 30)
    assert sink.messages[0] == [b"head", big]
    assert sink.messages[1:] == [[b"why"]]
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
async def test_a_send_whose_turn_end_cannot_be_scheduled_holds_nothing(wired) -> None:
    """Under asyncio's debug mode, call_soon from another thread raises: the
    writer had marked the turn begun first, so every later message was held
    for an end of turn that never came."""
    ta, writer, sink = wired
    loop = asyncio.get_running_loop()
    loop.set_debug(True)

    def from_a_thread() -> None:
        with pytest.raises(RuntimeError):
            writer.send([b"stray"])

    await asyncio.to_thread(from_a_thread)
    writer.send([b"after"])
    sink.want, sink.waiter = 1, loop.create_future()
    await asyncio.wait_for(sink.waiter, 10)
    assert sink.messages[-1] == [b"after"]


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


class _PeerGoesAway(socket.socket):
    """A real socket whose peer vanishes at a moment the test picks: from
    then on a send fails as the kernel's would (``EPIPE``)."""

    gone = False

    def send(self, data: Any, flags: int = 0) -> int:
        if self.gone:
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")
        return super().send(data, flags)


class _LosesItsPeerOnResume(FramedProtocol):
    """Its peer goes away just as the transport asks it for more."""

    def __init__(self, sock: _PeerGoesAway) -> None:
        self.sock = sock
        self.lost: list[BaseException | None] = []

    def resume_writing(self) -> None:
        self.sock.gone = True
        super().resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost.append(exc)


def test_a_write_that_fails_as_the_transport_drains_loses_the_connection_once() -> None:
    """The stock loop's socket transport calls ``resume_writing`` from inside
    its drain step; a write made there that fails (the peer just went away)
    made it tear the connection down twice -- ``AttributeError: 'NoneType'
    object has no attribute 'close'`` in the loop's exception handler, as a
    flood from a client whose rank exited once showed (CPython gh-156512, in
    3.11 to 3.13).  On that loop, a resume that finds the transport's buffer
    empty pumps from the next loop turn instead."""

    async def main() -> tuple[list[BaseException | None], list[dict[str, Any]]]:
        loop = asyncio.get_running_loop()
        errors: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        a0, b = socket.socketpair()
        a = _PeerGoesAway(fileno=a0.detach())
        reader = threading.Thread(target=lambda: [None for _ in iter(lambda: b.recv(1 << 16), b"")])
        reader.start()
        try:
            ta, proto = await loop.create_unix_connection(lambda: _LosesItsPeerOnResume(a),
                                                          sock=a)
            # (resumed only once the transport's buffer is empty: the drain
            # step that resumes is the one that found nothing left to send)
            ta.set_write_buffer_limits(high=CHUNK, low=0)
            assert proto.writer is not None
            proto.writer.send([b"x" * (8 * CHUNK)])  # more than one CHUNK waits in the writer
            async with asyncio.timeout(10):
                while not proto.lost:
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0)  # (a second teardown would be scheduled by now)
        finally:
            b.shutdown(socket.SHUT_RDWR)
            reader.join(10)
            b.close()
        return proto.lost, errors

    with asyncio.Runner(loop_factory=loop_factory("asyncio")) as runner:
        lost, errors = runner.run(main())
    assert errors == []
    assert len(lost) == 1 and isinstance(lost[0], BrokenPipeError)
