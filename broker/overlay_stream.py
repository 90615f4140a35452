"""Overlay links over Unix-domain stream sockets (``tbon.transport=unix``).

The same tree, handshake and framing as the ZeroMQ links, without ZeroMQ's
I/O threads: a message crosses a hop as one ``write`` on a Unix socket that
the peer's event loop reads directly.  On this class of machine a ZeroMQ
``ipc://`` hop costs three thread wake-ups per message (application thread
-> ZeroMQ I/O thread -> the peer's I/O thread -> the peer's application
thread); a stream hop costs one.  See docs/performance.md for the figures
that made this the default inside one host.  ``tcp://`` between hosts stays
on ZeroMQ with CURVE.

Admission: the listening socket lives in the private run directory with
mode 0700, and every connection's peer uid (``SO_PEERCRED``) must be the
instance owner's; the first message must be ``overlay.hello`` from one of
this rank's children.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from broker import codec
from broker.connector import peer_uid
from broker.errors import ProtocolError
from broker.framewriter import FramedProtocol
from broker.linkstall import StallJudge
from broker.turns import TurnReader

log = logging.getLogger("kvbroker.overlay")

CONNECT_RETRY = 0.01
MAX_PER_TURN = 512
"""Most messages taken from one link in one turn of the event loop, as a
ZeroMQ link's ``BATCH``.  One read takes up to 256 KiB: ~4,000 small
events from a parent, which a rank handled before any of its own clients'
requests; past this many the rest wait for the next turn, with the link's
reading paused (higher than a client's 64: a link carries a whole subtree's
traffic)."""


class StreamConn(FramedProtocol):
    """One stream connection; hands each complete message's frames to ``on_frames``."""

    def __init__(self, on_frames: Callable[[StreamConn, list[bytes]], None],
                 on_lost: Callable[[StreamConn], None], owner_uid: int | None,
                 max_backlog: int = 512 << 20,
                 on_slow: Callable[[StreamConn], None] | None = None) -> None:
        self.on_frames = on_frames
        self.on_lost = on_lost
        self.owner_uid = owner_uid
        self.max_backlog = max_backlog
        self.on_slow = on_slow
        self._stall = StallJudge(max_backlog)
        """Whether the peer still reads when the queue is over ``max_backlog``."""
        self.decoder = codec.StreamDecoder()
        self.rank: int | None = None  # set by the overlay once the peer said hello
        self.lost_error: Exception | None = None
        """Why the connection was lost, if not closed by its peer (a reset)."""
        self._reader = TurnReader(self._take, lambda n: min(n, MAX_PER_TURN),
                                  self._pause_reading, self._resume_reading)
        """Messages taken at most :data:`MAX_PER_TURN` per loop turn, the rest held."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.owner_uid is not None:
            try:
                uid = peer_uid(transport.get_extra_info("socket"))
            except OSError:
                uid = -1
            if uid != self.owner_uid:
                log.warning("refusing overlay connection from uid %d", uid)
                transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as exc:
            log.warning("unreadable overlay stream (%s); closing", exc)
            self.transport.close()  # type: ignore[union-attr]
            return
        # Not answered, unlike a client's: the peer is another rank of this
        # instance, and a ZeroMQ link (MAXMSGSIZE) gives no answer either.
        for skipped in self.decoder.take_oversized():
            log.warning("dropped an oversized overlay message (%d bytes)", skipped.size)
        self._reader.feed(messages)

    def _pause_reading(self) -> None:
        self.transport.pause_reading()  # type: ignore[union-attr]

    def _resume_reading(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            t.resume_reading()

    def _take(self, messages: list[list[bytes]]) -> None:
        for frames in messages:
            if self.transport.is_closing():  # type: ignore[union-attr]
                self._reader.drop()
                return  # refused: ignore whatever else it sent
            self._deliver(frames)

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            self.on_frames(self, frames)
        except Exception:
            log.exception("error handling an overlay message")

    def resume_writing(self) -> None:
        self._stall.progressed()  # (the peer read: the kernel took some of the queue)
        super().resume_writing()
        if self.queued <= self.max_backlog:  # (judged afresh next time over)
            self._stall.clear()

    @property
    def queued(self) -> int:
        """Bytes waiting for the peer to read them."""
        w = self.writer
        return w.buffered() if w is not None and self.transport is not None else 0

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_error = exc
        # What an admitted peer sent before the link went is still its
        # message (a parent's last events, sequenced): take it first.
        for frames in self._reader.drop():
            self._deliver(frames)
        self.let_go_of_output()
        self.on_lost(self)

    def send(self, frames: list[Any]) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        w = self.writer
        assert w is not None
        # A peer that does not read (a SIGSTOPped rank) made this rank queue
        # without bound, ~15 MB/s under commits and events.  Judged before
        # the message, as for a client: one big message still goes; and
        # over the mark, dropped only once the peer has stopped reading
        # (broker.linkstall).
        queued = w.buffered()
        if queued > self.max_backlog and self._stall.stuck(queued):
            who = "the parent" if self.rank is None else f"child rank {self.rank}"
            log.warning("%s does not read its link (%d bytes queued, tbon.max-backlog): "
                        "dropping it", who, queued)
            if self.on_slow is not None:
                self.on_slow(self)
            t.abort()
            return
        w.send(frames)


def unlink_socket_file(path: str, inode: int) -> None:
    """Remove the socket file this rank bound at ``path`` (neither asyncio
    before Python 3.13, uvloop nor ZeroMQ does at close: a run directory
    the user gave ``start --rundir`` kept ``tbon-0`` after the instance
    stopped) -- unless it is another one now: a newer process of the rank
    bound the path again, and its file is not ours to remove."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


class StreamLinks:
    """A listening socket for the children, a connection to the parent."""

    def __init__(self, path_of: Callable[[int], str], owner_uid: int,
                 on_child: Callable[[StreamConn, list[bytes]], None],
                 on_parent: Callable[[list[bytes]], None],
                 on_child_lost: Callable[[StreamConn], None],
                 on_parent_lost: Callable[[], None],
                 max_backlog: int = 512 << 20) -> None:
        self.path_of = path_of
        self.owner_uid = owner_uid
        self.on_child = on_child
        self.on_parent = on_parent
        self.on_child_lost = on_child_lost
        self.on_parent_lost = on_parent_lost
        self.max_backlog = max_backlog
        self.slow = 0
        """Links dropped because the peer did not read."""
        self.server: asyncio.AbstractServer | None = None
        self.bound: tuple[str, int] | None = None
        """The socket file listened on, and its inode: removed at close."""
        self.up: StreamConn | None = None
        self.conns: set[StreamConn] = set()
        self.closing = False

    async def listen(self, rank: int) -> None:
        path = self.path_of(rank)
        loop = asyncio.get_running_loop()

        def factory() -> StreamConn:
            conn = StreamConn(self.on_child, self._lost, self.owner_uid, self.max_backlog,
                              self._slow)
            self.conns.add(conn)
            return conn

        self.server = await loop.create_unix_server(factory, path)
        os.chmod(path, 0o700)
        self.bound = (path, os.stat(path).st_ino)

    def _slow(self, _conn: StreamConn) -> None:
        self.slow += 1

    def _lost(self, conn: StreamConn) -> None:
        self.conns.discard(conn)
        if not self.closing:
            self.on_child_lost(conn)

    async def connect(self, parent: int, timeout: float = 60.0) -> None:
        """Connect to the parent, retrying while it is not listening yet."""
        path = self.path_of(parent)
        loop = asyncio.get_running_loop()

        def on_lost(_conn: StreamConn) -> None:
            if not self.closing:
                self.on_parent_lost()

        async with asyncio.timeout(timeout):
            while True:
                try:
                    _, conn = await loop.create_unix_connection(
                        lambda: StreamConn(lambda _c, f: self.on_parent(f), on_lost, None,
                                           self.max_backlog, self._slow), path)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(CONNECT_RETRY)
        self.up = conn

    def close(self, flush: bool = False, flush_up: bool = False) -> None:
        """Close every link; ``flush`` lets what is queued for the children
        (a shutdown) leave first, ``flush_up`` what is queued for the
        parent (a goodbye)."""
        self.closing = True
        if self.server is not None:
            self.server.close()
        if self.bound is not None:
            unlink_socket_file(*self.bound)
            self.bound = None
        for conn in list(self.conns):
            if conn.transport is not None:
                if flush:
                    if conn.writer is not None:
                        conn.writer.flush()
                    conn.transport.close()
                else:
                    conn.transport.abort()
        if self.up is not None and self.up.transport is not None:
            if flush_up and self.up.writer is not None:  # (a goodbye)
                self.up.writer.flush()
                self.up.transport.close()
            else:
                self.up.transport.abort()
