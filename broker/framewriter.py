"""Writing messages to a stream transport without quadratic copies.

Python 3.11's selector transports (the ``asyncio`` loop) keep unsent bytes
in one ``bytearray`` and delete what each ``send()`` took from its front, so
handing them a 16 MiB message costs a memmove of the remainder per partial
send -- O(n²): 28 ms to push 16 MiB through a Unix socket pair, against
3.9 ms when the same bytes go in 256 KiB pieces as the transport drains
(uvloop: 2.8 ms either way).  That was most of the 3.6× gap between the
loops on W1b's 16 MiB echo.

:class:`FrameWriter` gives the transport at most :data:`CHUNK` bytes it
cannot send at once: a message that fits is written whole (the common
case, unchanged); a bigger one is cut into memoryview slices that are fed
in while the transport is below its high-water mark, the rest when its
protocol's ``resume_writing`` is called.  Order is kept: once anything
waits, later messages wait behind it.  :class:`FramedProtocol` is the
protocol base that wires a writer to its transport.

Small messages are also **coalesced per loop turn**: the first one a writer
gets in a turn is written at once (a lone RPC answer keeps its latency), the
ones that follow in the same turn are held and written together by a
callback the loop runs before it next waits -- what Redis does with the
replies of one event-loop cycle.  Both loops otherwise make one system call
per ``write`` (strace: 100 writes in a callback, 100 ``writev``/``sendto``),
and each one can wake the reader for a single message: a rank forwarding a
burst of 200 events woke its child ~100 times.  Whoever closes a transport
a writer may hold bytes for calls :meth:`FrameWriter.flush` first.  A
writer whose loop is not running (the sync facade between its calls)
writes every message at once.

The pacing needs the transport to call ``pause_writing`` when its buffer
passes the high-water mark.  uvloop's ``writelines`` does; the stock
loop's does not from Python 3.12 on (its ``write`` does), so on the stock
loop a writer hands over one joined ``bytes`` per call through ``write``
(what 3.11's ``writelines`` did itself).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from broker import codec, malloc

CHUNK = 256 << 10
STOCK_HIGH_WATER = 2 * CHUNK
STOCK_LOW_WATER = CHUNK
"""The write-buffer limits of the stock loop's transports (see FrameWriter)."""
PIECE_OVERHEAD = 256
"""What :meth:`FrameWriter.buffered` adds per queued piece for its object
(a view, a bytearray), so a slow-consumer limit bounds memory, not just bytes."""


class FrameWriter:
    """Length-prefixed messages onto ``transport``, in pieces when large.

    The owning protocol forwards ``pause_writing`` / ``resume_writing`` to
    :meth:`pause` / :meth:`resume`.
    """

    __slots__ = ("transport", "_pending", "_pending_bytes", "_paused", "_writelines",
                 "_loop", "_held", "_held_bytes", "_pump_later", "_drain_waiters")

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        self._pending: deque[memoryview | bytes | bytearray] = deque()
        self._pending_bytes = 0
        self._paused = False
        self._loop = asyncio.get_running_loop()
        self._held: list[codec.Frame] | None = None
        """This turn's small messages after the first (None: nothing written yet this turn)."""
        self._held_bytes = 0
        self._drain_waiters: list[asyncio.Future[None]] = []
        # writelines() when it applies flow control (uvloop), else write(join)
        uvloop = type(transport).__module__.startswith("uvloop")
        self._writelines = transport.writelines if uvloop else self._write_joined
        # The stock loop's socket transport calls resume_writing() from inside
        # its drain step.  A write made there that finds its buffer empty
        # sends at once, and if that send fails (the peer just went away)
        # the transport tears the connection down twice: the second raises
        # AttributeError into the loop's exception handler, and the protocol
        # hears connection_lost(None), the error lost (CPython gh-156512, in
        # 3.11 to 3.13).  So there a resume that finds the buffer empty
        # pumps from the next loop turn, outside that step.  A turn per
        # resume cost ~15% of a 1 MiB echo's rate on that loop, so its
        # transports also pause later and resume sooner than by default
        # (64 KiB / 16 KiB): fewer resumes, and W1b's echoes went no slower
        # than before the change (docs/performance.md, "What moved").
        self._pump_later = not uvloop
        if not uvloop:
            transport.set_write_buffer_limits(high=STOCK_HIGH_WATER, low=STOCK_LOW_WATER)

    def _write_joined(self, pieces: Sequence[codec.Frame]) -> None:
        self.transport.write(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    @property
    def paused(self) -> bool:
        """The transport's buffer is over its high-water mark."""
        return self._paused

    def send(self, frames: Sequence[codec.Frame]) -> None:
        """Queue one message (its frames) for writing."""
        prefix = codec.stream_prefix(frames)
        size = sum(map(len, frames))
        if size <= CHUNK and not self._pending and not self._paused:
            if not self._loop.is_running():
                # The sync facade sends between its calls, with no loop
                # turn to end until its next one: write now.
                self.flush()
                self._writelines([prefix, *frames])
                return
            held = self._held
            if held is None:  # the turn's first: now, and hold the rest of the turn
                # (the turn's end first: if that cannot be scheduled -- the
                # loop's debug mode refuses a call from another thread --
                # nothing is held that no end of turn would write)
                self._loop.call_soon(self._end_turn)
                self._held = []
                self._writelines([prefix, *frames])
                return
            held.append(prefix)
            held.extend(frames)
            self._held_bytes += len(prefix) + size
            if self._held_bytes >= CHUNK:
                self.flush()
            return
        self.flush()  # what this turn held goes first
        pending = self._pending
        if size <= CHUNK:
            # Small messages that must wait are packed together, not kept as
            # a prefix and a view per frame: ~400 bytes of objects each made
            # a client that never read cost rank 0 10-14 times the bytes it
            # was owed (2.8 GB for a 256 MiB backlog of ping answers).
            tail = pending[-1] if pending else None
            if not isinstance(tail, bytearray) or len(tail) + len(prefix) + size > CHUNK:
                tail = bytearray()
                pending.append(tail)
                self._pending_bytes += PIECE_OVERHEAD
            tail += prefix
            for frame in frames:
                tail += frame
            self._pending_bytes += len(prefix) + size
            self._pump()
            return
        pending.append(prefix)
        self._pending_bytes += len(prefix) + PIECE_OVERHEAD
        for frame in frames:
            if not isinstance(frame, bytes):
                frame = bytes(frame)  # a caller's bytearray may change before it is sent
            view = memoryview(frame)
            for i in range(0, len(view), CHUNK):
                piece = view[i:i + CHUNK]
                pending.append(piece)
                self._pending_bytes += len(piece) + PIECE_OVERHEAD
        self._pump()

    def discard(self) -> None:
        """The connection is gone: let go of what waits to be written now.
        The protocol and its transport hold each other, so they are freed by
        the garbage collector's next full pass -- which an idle rank may
        never make: a subscriber SIGSTOPped under a flood of events was
        dropped at its 256 MiB backlog, and the rank kept the 268 MB queued
        for it.  Drain waiters are woken (the transport is closing)."""
        dropped = self._pending_bytes + self._held_bytes
        self._pending.clear()
        self._pending_bytes = 0
        if self._held:
            self._held.clear()
        self._held_bytes = 0
        self._wake_drain_waiters()
        malloc.let_go(dropped)

    def drop_unstarted(self) -> int:
        """Let go of every queued message not yet begun (the turn's held
        ones and the pending ones from the first that starts a message),
        keeping the rest of one already part-written, so that a message
        sent next is read whole, right after it: how a slow consumer is
        told why it is dropped, instead of behind 256 MiB it will never
        read.  Returns the bytes let go of.

        A pending piece starts a message unless it is a ``memoryview``:
        small messages wait packed whole in ``bytearray`` pieces, a big one
        as its ``bytes`` prefix and then views of its frames."""
        dropped = self._held_bytes
        if self._held:
            self._held.clear()
        self._held_bytes = 0
        pending = self._pending
        for i, piece in enumerate(pending):
            if not isinstance(piece, memoryview):
                for _ in range(len(pending) - i):
                    dropped += len(pending.pop()) + PIECE_OVERHEAD
                break
        self._pending_bytes = sum(len(p) + PIECE_OVERHEAD for p in pending)
        if not pending:
            self._wake_drain_waiters()
        malloc.let_go(dropped)
        return dropped

    def buffered(self) -> int:
        """Bytes not yet handed to the kernel (the transport's and ours)."""
        return self.transport.get_write_buffer_size() + self._pending_bytes + self._held_bytes

    def flush(self) -> None:
        """Hand what this turn held to the transport now (before closing it,
        or a message that must not wait behind it)."""
        held = self._held
        if held:
            self._held = []
            self._held_bytes = 0
            if not self.transport.is_closing():
                self.transport.write(b"".join(held))  # may call pause_writing() -> self.pause()

    def drained(self) -> asyncio.Future[None]:
        """A future set once every message given so far is the transport's
        (what is cut into pieces waits here while the transport is paused):
        closing the transport drops what is still here, and closes with
        only the start of a big message sent.  Also set if the transport
        closes first."""
        self.flush()
        fut = self._loop.create_future()
        if self._pending and not self.transport.is_closing():
            self._drain_waiters.append(fut)
        else:
            fut.set_result(None)
        return fut

    def _wake_drain_waiters(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _end_turn(self) -> None:
        self.flush()
        self._held = None

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._pump_later and not self.transport.get_write_buffer_size():
            self._loop.call_soon(self._pump)
        else:
            self._pump()

    def _pump(self) -> None:
        t = self.transport
        pending = self._pending
        while pending and not self._paused:
            if t.is_closing():
                pending.clear()
                self._pending_bytes = 0
                break
            # Up to CHUNK bytes per call: the small messages queued behind a
            # big one go out together, not one system call each.
            batch = [pending.popleft()]
            size = len(batch[0])
            while pending and size < CHUNK:
                piece = pending.popleft()
                batch.append(piece)
                size += len(piece)
            self._pending_bytes -= size + PIECE_OVERHEAD * len(batch)
            self._writelines(batch)  # may call pause_writing() -> self.pause()
        if self._drain_waiters and not pending:
            self._wake_drain_waiters()


class FramedProtocol(asyncio.Protocol):
    """A stream protocol that sends through a :class:`FrameWriter`: the
    connector's client connections, the overlay's links and the client
    ``Handle`` share it.  Subclasses that override ``connection_made`` call
    this one first."""

    transport: asyncio.Transport | None = None
    writer: FrameWriter | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.writer = FrameWriter(self.transport)  # type: ignore[arg-type]

    def pause_writing(self) -> None:
        if self.writer is not None:
            self.writer.pause()

    def resume_writing(self) -> None:
        if self.writer is not None:
            self.writer.resume()

    def let_go_of_output(self) -> None:
        """What a subclass's ``connection_lost`` calls: the output queued
        for the peer that went is dropped at once (:meth:`FrameWriter.discard`)."""
        if self.writer is not None:
            self.writer.discard()
