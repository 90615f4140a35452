"""The local connector: a Unix-domain socket through which clients reach a rank.

The client's uid comes from the kernel (``SO_PEERCRED``), never from what
the client says: the instance owner gets role OWNER, anyone else role USER --
and only when the instance allows guests (``access.allow-guest-user``);
otherwise the socket is owner-only and other users are refused.

Back-pressure: while a client does not read what it is owed (its transport
is over its high-water mark), its own requests are not read either, so the
kernel's socket buffers stop it; and when its unsent output (events, watch
answers) passes ``MAX_BACKLOG`` bytes before a message, the connection is
closed (slow-consumer policy).  A stuck client cannot make the broker's
memory grow without bound, and one answer bigger than the limit still
reaches a client that reads.

Guests (other users, when the instance admits them) are bounded per user,
over all their connections to a rank: at most ``access.max-guest-connections``
connections (one more would let a guest take every descriptor of the rank,
and the owner could no longer connect), and at most ``access.max-guest-bytes``
held for them -- the part-received messages they are sending and the answers
and events they have not read.  Each connection's own bounds
(``broker.max-message``, ``MAX_BACKLOG``) multiplied by a guest's connections
bounded nothing.  One connection more is refused; past the bytes, the
user's connections holding the most are closed.  Either way a
``broker.closing`` message says why first (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import struct
from typing import TYPE_CHECKING

from broker import codec, ssh
from broker.errors import ProtocolError
from broker.framewriter import FramedProtocol
from broker.logring import LogThrottle
from broker.message import Message, MsgFlags, MsgType, Role
from broker.turns import TurnReader

if TYPE_CHECKING:
    from broker.router import Router

log = logging.getLogger("kvbroker.connector")


MAX_BACKLOG = 256 << 20
DEFAULT_MAX_GUEST_CONNECTIONS = 256
DEFAULT_MAX_GUEST_BYTES = 1 << 30
MAX_PER_TURN = 64
"""Most requests taken from one connection in one turn of the event loop.

One read takes up to 256 KiB from a client: ~4,000 small requests, ~70 ms
of a rank's time, during which every other client waited (a ping measured
70 ms behind one burst of ``event.pub``).  Past this many, the rest of the
read waits for the next turn with the connection's reading paused, so the
other clients' requests are taken in between (Flux's connector takes one
message per callback).  It costs a burst one more loop turn per 64.  A
guest user's connections share one such allowance per turn
(:meth:`GuestUsage.grant`): many connections buy a guest no more of
the rank's time than one."""
_UCRED = struct.Struct("iII")  # struct ucred: pid_t, uid_t, gid_t (uids past 2**31 too)


COUNTERS = ("garbage", "malformed", "oversized", "slow-consumers", "accept-failed",
            "guests-refused", "guests-over-budget", "guests-held-for-links")
"""The ``connector`` counters of ``broker.stats-get`` (all shown, 0 included)."""
LINKS_POLL = 0.01
"""Seconds between looks at the links while guests' connections are held
for them (:meth:`Connector.hold_for_links`)."""
ACCEPT_RETRY = 0.1
"""Seconds before accepting again when the rank is out of descriptors."""
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
"""``accept`` errors that mean the rank is short of descriptors or memory."""
FD_RESERVE = 64
"""Descriptors clients may not take (a quarter of the limit, if that is
fewer), left to the overlay and the store: a rank whose clients took them
all was aborted by libzmq at the next connection to its ipc:// overlay
socket (its listener asserts on EMFILE), spun a core on a tcp:// one, and
on the stock loop logged a growing storm of tracebacks on a unix one."""
CLOSING_TOPIC = "broker.closing"
"""Topic of the response (matchtag 0) a rank sends before it closes a client's
connection on purpose: its errnum and errstr say why (docs/protocol.md)."""
LINGER = 2.0
"""Seconds a connection closed on purpose stays half-open: its client reads
the ``broker.closing`` message and the end of the stream, and what it still
sends is read and dropped.  Closed at once, a client that had just written
(a request right after connecting) got ``EPIPE`` before it read why."""
SLOW_LINGER = 10.0
"""Seconds a slow consumer's connection stays open after the message that
says why it was dropped: it has the rest of what the kernel and the
transport hold to read first (at most a few hundred KiB and the end of a
message begun), and was slow already."""
MAX_LINGERING = 16
"""Most connections of one guest user left lingering at a time; past it one
is closed at once (a guest refused in a loop cannot hold descriptors)."""


class GuestUsage:
    """What one guest user holds on this rank, over all its connections.

    Kept as sums that each connection updates with its own share, so a check
    costs the same with one connection or hundreds.  A connection's share of
    ``output`` is refreshed when a message is queued for it and when its
    transport drains below the low-water mark, so it may count bytes that
    drained since; every share is refreshed before anything is closed for
    the budget, and for ``broker.stats-get``."""

    __slots__ = ("conns", "partial", "output", "lingering", "taken", "turn_open")

    def __init__(self) -> None:
        self.conns: set[ClientConnection] = set()
        self.partial = 0
        """Bytes of the messages its connections are part-way through sending."""
        self.output = 0
        """Bytes queued for its connections and not yet sent."""
        self.lingering = 0
        """Its connections closed on purpose, not gone yet (:data:`LINGER`)."""
        self.taken = 0
        """Requests its connections took in this turn of the loop (:meth:`grant`)."""
        self.turn_open = False

    def grant(self, wanted: int) -> int:
        """How many of ``wanted`` requests one of its connections may take
        now, counted: :data:`MAX_PER_TURN` per turn of the loop for all of
        them together, so a guest with many connections gets one share of
        the rank's time, not one per connection."""
        if not self.turn_open:
            self.turn_open = True
            self.taken = 0
            asyncio.get_running_loop().call_soon(self._close_turn)
        granted = min(wanted, MAX_PER_TURN - self.taken)
        self.taken += granted
        return granted

    def _close_turn(self) -> None:
        self.turn_open = False

    def held(self) -> int:
        """Bytes held for the user: part-received messages and unsent output."""
        return self.partial + self.output


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    uid: int = _UCRED.unpack(data)[1]
    return uid


class ClientConnection(FramedProtocol):
    """One client's connection; a router peer with id ``c<N>``."""

    def __init__(self, server: Connector, peer_id: str) -> None:
        self.server = server
        self.router = server.router
        self.peer_id = peer_id
        self.userid = -1
        self.rolemask = 0
        self.decoder = codec.StreamDecoder(server.max_message)
        self.registered = False
        self.guest: GuestUsage | None = None
        """The user's usage when the client is a guest."""
        self._partial = 0
        """This connection's share of ``guest.partial``."""
        self._output = 0
        """This connection's share of ``guest.output``."""
        self._lingering: tuple[GuestUsage | None, asyncio.TimerHandle] | None = None
        """While closed on purpose and not gone yet: the user it counts for, the timer."""
        self._reader = TurnReader(self._take, self._grant, self._pause_reading,
                                  self._resume_reading)
        """Requests taken at most :data:`MAX_PER_TURN` per loop turn, the rest held."""
        self.held_for_links = False
        """A guest's connection not read while a link to another rank is
        congested (:meth:`Connector.hold_for_links`)."""

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        try:
            uid = peer_uid(sock)
        except OSError as exc:
            log.warning("cannot read peer credentials: %s", exc)
            transport.close()
            return
        if uid == self.server.owner_uid:
            self.rolemask = int(Role.OWNER)
        elif self.server.allow_guest:
            self.rolemask = int(Role.USER)
            self.userid = uid
            if not self._admit_guest(uid):
                return
        else:
            self.server.log_throttle.log(
                logging.WARNING, "not-owner", "refusing a connection from uid %d (guests "
                "not allowed: access.allow-guest-user)", uid)
            # Said to the client (broker.closing), so it reads EPERM and why,
            # as Flux's connector answers it, not a bare "connection reset".
            self.close_with(errno.EPERM, f"this instance admits only its owner (uid "
                                         f"{self.server.owner_uid}); to admit other users "
                                         "as guests, start it with -S "
                                         "access.allow-guest-user=true", self.server.refused)
            return
        self.userid = uid
        self.router.add_peer(self)
        self.registered = True
        self.server.connections[self.peer_id] = self

    def _admit_guest(self, uid: int) -> bool:
        """Count a guest's connection against its user's, or refuse it."""
        server = self.server
        usage = server.guests.get(uid)
        if usage is None:
            usage = server.guests[uid] = GuestUsage()
        cap = server.max_guest_connections
        if len(usage.conns) >= cap:
            server.counts["guests-refused"] += 1
            server.log_throttle.log(
                logging.INFO, "guest-refused", "refusing a connection from uid %d: it has "
                "%d already (access.max-guest-connections)", uid, len(usage.conns))
            self.close_with(errno.EUSERS, f"this rank admits at most {cap} connection"
                                          f"{'' if cap == 1 else 's'} per guest user "
                                          "(access.max-guest-connections)", usage)
            return False
        usage.conns.add(self)
        self.guest = usage
        return True

    def close_with(self, errnum: int, errstr: str, usage: GuestUsage | None = None,
                   patient: bool = False) -> None:
        """Close the connection on purpose, first telling the client why
        (``broker.closing``): its calls then fail with ``errnum`` and
        ``errstr``, not with a bare "connection lost".

        It stops being served at once (its requests and watches end as at a
        disconnect, its bytes stop counting for its user), then stays
        half-open for :data:`LINGER` seconds so the client reads the message
        whatever it was doing.  A client that does not read never would:
        its connection is aborted with what it had left unread -- at once,
        or (``patient``: a slow consumer, which may yet read what the
        transport holds before the message) after :data:`SLOW_LINGER`."""
        t = self.transport
        w = self.writer
        if t is None or t.is_closing() or w is None or self._lingering is not None:
            return
        usage = usage or self.guest
        self._retire()
        w.send(codec.encode(Message(MsgType.RESPONSE, CLOSING_TOPIC, matchtag=0,
                                    errnum=errnum, errstr=errstr)))
        w.flush()
        if w.buffered() and not patient:
            t.abort()  # it does not read: keep nothing more for it
            return
        if not t.can_write_eof() or (usage is not None and usage.lingering >= MAX_LINGERING):
            t.abort() if w.buffered() else t.close()
            return
        # The end of the stream follows the message, so the client that
        # reads it learns at once the connection is over (a slow consumer's
        # waited SLOW_LINGER for it); once the writer's pieces are all the
        # transport's -- a write after write_eof is refused -- which takes
        # them before the end, whatever it still holds.
        drained = w.drained()

        def end_stream(_: object = None) -> None:
            if not t.is_closing():
                t.write_eof()

        if drained.done():
            end_stream()
        else:
            drained.add_done_callback(end_stream)
        if usage is not None:
            usage.lingering += 1
        self._lingering = (usage, asyncio.get_running_loop().call_later(
            SLOW_LINGER if patient else LINGER, self._end_linger))

    def _end_linger(self) -> None:
        """:data:`LINGER` is over: closed, or aborted if the client still
        has not read everything (a close would wait for it for ever)."""
        t, w = self.transport, self.writer
        if t is None or t.is_closing():
            return
        if w is not None and w.buffered():
            t.abort()
        else:
            t.close()

    def _retire(self) -> None:
        """Stop serving the connection: out of the router (a disconnect for
        the modules) and out of its user's usage; a part-received message is
        let go."""
        usage, self.guest = self.guest, None
        if usage is not None:
            usage.conns.discard(self)
            usage.partial -= self._partial
            usage.output -= self._output
            self._partial = self._output = 0
            self._forget_if_idle(usage)
        if self.registered:
            self.registered = False
            self.server.connections.pop(self.peer_id, None)
            self.router.remove_peer(self)
            self.decoder = codec.StreamDecoder(self.server.max_message)
        if self._reader.holding:
            self._reader.drop()  # not served any more: what it sends is read and dropped
            self._resume_reading()

    def _forget_if_idle(self, usage: GuestUsage) -> None:
        """Drop the user's entry once it has no connection, lingering ones included."""
        if not usage.conns and not usage.lingering \
                and self.server.guests.get(self.userid) is usage:
            del self.server.guests[self.userid]

    def _note_output(self, usage: GuestUsage) -> int:
        """Refresh this connection's share of its user's output; return it."""
        out = self.writer.buffered() if self.writer is not None else 0
        usage.output += out - self._output
        self._output = out
        return out

    def _fits(self, usage: GuestUsage, extra: int, message: int) -> bool:
        """Whether the user may hold ``extra`` bytes more, within
        ``access.max-guest-bytes``, for a message of ``message`` bytes (being
        received: already counted, ``extra`` 0; being sent: ``extra`` is its
        size).  If not, its connections holding the most are closed until it
        may: False when this one is among them.  One message bigger than the
        budget passes while the user holds nothing else (the limit for it is
        ``broker.max-message``)."""
        budget = self.server.max_guest_bytes

        def fits() -> bool:
            held = usage.held() + extra
            return held <= budget or held <= message

        if fits():
            return True
        # (a share is refreshed when its connection is sent something: one
        # that has read everything since may still count what it read)
        for conn in list(usage.conns):
            if conn.writer is not None:
                conn.writer.flush()  # what a turn held is the kernel's to hold
            conn._note_output(usage)
        if fits():
            return True
        holders = sorted(usage.conns, key=lambda c: (c._partial + c._output, c is self),
                         reverse=True)  # (this one first among equals)
        for conn in holders:
            if fits():
                break
            held = usage.held()
            share = conn._partial + conn._output
            if not share:
                break
            self.server.counts["guests-over-budget"] += 1
            log.warning("%s: uid %d holds %d bytes of this rank's memory, more than "
                        "access.max-guest-bytes (%d); closing its connection holding %d",
                        conn.peer_id, self.userid, held + extra, budget, share)
            conn.close_with(errno.ENOBUFS, f"this rank held {held + extra} bytes for this "
                                           f"user's connections, more than access.max-guest-"
                                           f"bytes ({budget}), and {share} for this one: "
                                           "read what you are sent, send less at once")
            if conn is self:
                return False
        return True

    def data_received(self, data: bytes) -> None:
        if not self.registered:
            return
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as exc:
            self.server.log_throttle.log(logging.WARNING, "unreadable",
                                         "%s: unreadable stream (%s); closing", self.peer_id, exc)
            self.server.counts["garbage"] += 1
            self.transport.close()  # type: ignore[union-attr]
            return
        usage = self.guest
        if usage is not None:
            partial = self.decoder.buffered
            usage.partial += partial - self._partial
            self._partial = partial
            if partial and not self._fits(usage, 0, partial):
                return
        if self.decoder.oversized:
            self.server.counts["oversized"] += self.decoder.oversized
            self.decoder.oversized = 0
        for skipped in self.decoder.take_oversized():
            self._answer_oversized(skipped)
        self._reader.feed(messages)
        if usage is not None and self.server.links_congested():
            self.server.hold_for_links(self)

    def _grant(self, wanted: int) -> int:
        """How many of ``wanted`` requests to take in this turn: at most
        :data:`MAX_PER_TURN`, or what is left of a guest user's share."""
        usage = self.guest
        return min(wanted, MAX_PER_TURN) if usage is None else usage.grant(wanted)

    def _pause_reading(self) -> None:
        self.transport.pause_reading()  # type: ignore[union-attr]

    def _resume_reading(self) -> None:
        """Read the client again, unless it still has answers to read first
        (:meth:`pause_writing`) or requests held (:data:`MAX_PER_TURN`)."""
        t = self.transport
        if t is not None and not t.is_closing() and not self._reader.holding \
                and (self.writer is None or not self.writer.paused) \
                and not self.held_for_links:
            t.resume_reading()

    def _take(self, messages: list[list[bytes]]) -> None:
        for frames in messages:
            if not self.registered:
                return  # closed by what came before in this read (_fits)
            try:
                msg = codec.decode(frames)
            except ProtocolError as exc:
                self.server.counts["malformed"] += 1
                self._answer_malformed(frames, exc)
                continue
            if msg.type != MsgType.REQUEST:
                # Clients only send requests: a forged response or event
                # could otherwise be routed to another client.
                self.server.counts["malformed"] += 1
                self.server.log_throttle.log(logging.WARNING, "not-a-request",
                                             "%s: dropping %s (clients send requests only)",
                                             self.peer_id, msg)
                continue
            self.router.from_local(self, msg)

    def _answer_malformed(self, frames: list[bytes], exc: ProtocolError) -> None:
        """Answer a request that cannot be decoded with its error (EPROTO),
        when its matchtag and topic can be read; a request flagged
        NORESPONSE gets nothing, anything else is dropped and logged."""
        peek = codec.peek_request(frames[0]) if frames else None
        if peek is None:
            self.server.log_throttle.log(logging.WARNING, "malformed",
                                         "%s: dropping malformed message: %s", self.peer_id, exc)
            return
        matchtag, topic, flags = peek
        if flags & MsgFlags.NORESPONSE:
            self.server.log_throttle.log(logging.INFO, "malformed-request",
                                         "%s: %r: dropping malformed request: %s",
                                         self.peer_id, topic, exc)
            return
        self.deliver(Message(MsgType.RESPONSE, codec.echoed_topic(topic), matchtag=matchtag,
                             errnum=exc.errnum, errstr=exc.errstr))

    def _answer_oversized(self, skipped: codec.Oversized) -> None:
        """Answer a request the decoder skipped for exceeding ``broker.max-message``.

        The errno is ``EMSGSIZE`` ("Message too long"), not ``EPROTO``: the
        message is well formed, only too big for this broker -- as with
        ``EFBIG`` for ``content.blob-size-limit`` and ``E2BIG`` for too many
        KVS ops, a limit gets its own errno so a client can tell it from
        garbage.  A request flagged NORESPONSE gets nothing; a message whose
        header cannot be read as a request's is dropped and logged.
        """
        peek = None if skipped.header is None else codec.peek_request(skipped.header)
        if peek is None:
            why = ("is not a request's" if skipped.header is not None else
                   f"was not read (over {codec.HEADER_PEEK} bytes)")
            self.server.log_throttle.log(logging.WARNING, "oversized",
                                         "%s: dropped an oversized message (%d bytes) whose "
                                         "header %s", self.peer_id, skipped.size, why)
            return
        matchtag, topic, flags = peek
        errstr = (f"message of {skipped.size} bytes exceeds broker.max-message "
                  f"({self.decoder.max_message})")
        self.server.log_throttle.log(logging.INFO, "oversized-request", "%s: %r: %s",
                                     self.peer_id, topic, errstr)
        if flags & MsgFlags.NORESPONSE:
            return
        self.deliver(Message(MsgType.RESPONSE, codec.echoed_topic(topic), matchtag=matchtag,
                             errnum=errno.EMSGSIZE, errstr=errstr))

    def connection_lost(self, exc: Exception | None) -> None:
        self._retire()
        self.let_go_of_output()
        self.server._held_for_links.discard(self)
        if self._lingering is not None:
            usage, timer = self._lingering
            timer.cancel()
            if usage is not None:
                usage.lingering -= 1
                self._forget_if_idle(usage)

    # -- router peer
    def deliver(self, msg: Message) -> None:
        t = self.transport
        if t is None or t.is_closing() or self._lingering is not None:
            return  # (lingering: closed on purpose, half-open for its client to read why)
        frames = msg.wire if msg.type == MsgType.EVENT else None
        if frames is None:
            try:
                frames = codec.encode(msg)
            except TypeError as exc:
                # (a module answered what cannot be packed: a set, say.
                # Dropped, the client's RPC waited for ever; answered EPROTO
                # in its place, as a rank does an answer it cannot send on)
                log.error("cannot encode %s: %s", msg, exc)
                if msg.type != MsgType.RESPONSE:
                    return
                frames = codec.encode(codec.error_in_place(
                    msg, errno.EPROTO, f"the answer cannot be sent to this client: {exc}"))
            if msg.type == MsgType.EVENT:
                msg.wire = frames
        if codec.may_exceed_link(frames):
            frames = self._within_limit(msg, frames)
            if frames is None:
                return
        w = self.writer
        assert w is not None
        # Judged before this message: one answer bigger than the limit (a
        # 300 MB value) still goes to a client that reads; a client that
        # has not read the last MAX_BACKLOG bytes gets nothing more.
        if w.buffered() > MAX_BACKLOG:
            queued = w.buffered()
            log.warning("%s: slow consumer (%d bytes queued); disconnecting", self.peer_id,
                        queued)
            self.server.counts["slow-consumers"] += 1
            # What it has not begun to read goes, and the client reads why
            # right after the rest (ENOBUFS), not a bare ECONNRESET
            w.drop_unstarted()
            self.close_with(errno.ENOBUFS, f"this connection was dropped as a slow consumer: "
                                           f"the rank had queued {queued} bytes for it unread "
                                           f"(the limit is {MAX_BACKLOG}); read what you are "
                                           "sent (events, watch answers) as fast as it comes",
                            patient=True)
            return
        usage = self.guest
        if usage is None:
            w.send(frames)
            return
        size = sum(map(len, frames))
        self._note_output(usage)
        if not self._fits(usage, size, size):
            return
        w.send(frames)
        self._note_output(usage)

    def _within_limit(self, msg: Message, frames: list[codec.Frame]) -> list[codec.Frame] | None:
        """``frames``, or in place of a message bigger than a client takes
        (:data:`codec.MAX_LINK_MESSAGE`: its decoder would skip it, and an
        RPC would wait for ever) the ``EMSGSIZE`` answer to its request;
        None for such an event (dropped and logged)."""
        size = codec.frames_size(frames)
        if size <= codec.MAX_LINK_MESSAGE:
            return frames
        self.server.counts["oversized"] += 1
        log.warning("%s: not sending %s of %d bytes", self.peer_id, msg, size)
        if msg.type != MsgType.RESPONSE:
            return None
        return codec.encode(codec.oversized_error(msg, size, codec.MAX_LINK_MESSAGE,
                                                  "what a client takes"))

    # A client that does not read what it is owed is not read either, so
    # its own requests cannot pile answers up on this rank without bound
    # (a ping flood that never read held 2.8 GB); events and watch answers
    # are bounded by MAX_BACKLOG.
    def pause_writing(self) -> None:
        super().pause_writing()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()  # may fill the buffer again (and pause)
        if self.guest is not None:
            self._note_output(self.guest)
        if self.writer is not None:
            self._resume_reading()


def _fd_ceiling() -> int | None:
    """The lowest descriptor number a new client may not have (None: no
    limit): descriptors are given lowest first, so a spare one numbered
    this high means fewer than the reserve are left."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return soft - min(FD_RESERVE, soft // 4)


class Connector:
    """The rank's Unix-socket server."""

    def __init__(self, router: Router, path: str, *, owner_uid: int, allow_guest: bool,
                 max_message: int = codec.DEFAULT_MAX_MESSAGE,
                 max_guest_connections: int = DEFAULT_MAX_GUEST_CONNECTIONS,
                 max_guest_bytes: int = DEFAULT_MAX_GUEST_BYTES) -> None:
        from collections import Counter

        self.router = router
        self.path = path
        self.owner_uid = owner_uid
        self.allow_guest = allow_guest
        self.max_message = max_message
        self.max_guest_connections = max_guest_connections
        self.max_guest_bytes = max_guest_bytes
        self.guests: dict[int, GuestUsage] = {}
        self.refused = GuestUsage()
        """The connections of other users refused (no guests admitted) still
        lingering, all users together: at most :data:`MAX_LINGERING` hold a
        descriptor while their client reads why."""
        """Guest users with connections here, by uid."""
        self.connections: dict[str, ClientConnection] = {}
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.log_throttle = LogThrottle(log)
        """Client errors are logged at most once a second per kind."""
        self._next = 0
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._bound: tuple[int, int] | None = None
        """(device, inode) of the socket this rank made at ``path``."""
        self._held_for_links: set[ClientConnection] = set()
        self._links_poll: asyncio.TimerHandle | None = None

    def links_congested(self) -> bool:
        """Whether a link to another rank is congested
        (:meth:`broker.overlay.Overlay.congested`)."""
        overlay = self.router.overlay
        return overlay is not None and overlay.congested()

    def hold_for_links(self, conn: ClientConnection) -> None:
        """Stop reading every guest's connection (``conn``'s read found a
        link congested) until no link to another rank is (looked at every
        :data:`LINKS_POLL` seconds): a guest's big messages, sent on as
        fast as they came, queued faster than a neighbour read them, and
        past ``tbon.max-backlog`` that neighbour was dropped as stuck -- a
        guest stopped ranks with a few 300 MiB requests (found by a
        review).  All guests', not only the one that read: each could
        finish a message more.  The owner's connections are read on: the
        owner's traffic is the instance's own."""
        if self._links_poll is None:  # (a new time congested: every guest held)
            self.counts["guests-held-for-links"] += 1
            for usage in self.guests.values():
                for other in usage.conns:
                    self._hold_for_links(other)
            self._links_poll = asyncio.get_running_loop().call_later(
                LINKS_POLL, self._poll_links)
        self._hold_for_links(conn)  # (one that came since, too)

    def _hold_for_links(self, conn: ClientConnection) -> None:
        if conn.held_for_links:
            return
        conn.held_for_links = True
        if conn.transport is not None and not conn.transport.is_closing():
            conn.transport.pause_reading()
        self._held_for_links.add(conn)

    def _poll_links(self) -> None:
        self._links_poll = None
        if self.links_congested():
            self._links_poll = asyncio.get_running_loop().call_later(
                LINKS_POLL, self._poll_links)
            return
        held, self._held_for_links = self._held_for_links, set()
        for conn in held:
            conn.held_for_links = False
            conn._resume_reading()

    def guest_stats(self) -> dict[str, dict[str, int]]:
        """Each guest user's connections and bytes held here, by uid (as text)."""
        out = {}
        for uid, usage in self.guests.items():
            for conn in list(usage.conns):
                conn._note_output(usage)  # (fresh, not as of the last message sent)
            out[str(uid)] = {"connections": len(usage.conns), "bytes": usage.held()}
        return out

    @property
    def uri(self) -> str:
        return f"local://{self.path}"

    def _factory(self) -> ClientConnection:
        self._next += 1
        return ClientConnection(self, f"c{self._next}")

    async def start(self) -> None:
        # the kvbroker an ssh:// client's relay runs here (before the
        # socket: a client that finds the socket finds it too)
        ssh.install_relay_command(os.path.dirname(self.path))
        # A socket left here is taken over: a restarted rank replaces a dead
        # (or frozen) process of the same rank, as its overlay link does.
        if os.path.exists(self.path):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        self._sock = sock
        os.chmod(self.path, 0o777 if self.allow_guest else 0o700)
        st = os.stat(self.path)
        self._bound = (st.st_dev, st.st_ino)
        self._accepting = asyncio.ensure_future(self._accept_loop(sock))

    async def _accept_loop(self, sock: socket.socket) -> None:
        """Accept clients; out of descriptors, pause and try again.

        Our own loop rather than ``create_unix_server``: on the stock
        asyncio loop (CPython 3.11-3.13) an ``EMFILE`` at accept made the
        server retry in a storm -- a rank at full CPU writing millions of
        tracebacks until clients left.  Here the clients wait in the
        listen queue, and the rank says so once."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                ceiling = _fd_ceiling()  # (as the limit is now: prlimit may change it)
                if ceiling is not None:  # (keep FD_RESERVE for the overlay and the store)
                    spare = os.dup(sock.fileno())
                    os.close(spare)
                    if spare >= ceiling:
                        raise OSError(errno.EMFILE, "too many open files (the last few "
                                      "are kept for the overlay and the store)")
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES:  # (a client gone already)
                    log.debug("accept: %s", exc)
                    continue
                if not self.counts["accept-failed"]:
                    log.warning("cannot accept clients: %s (raise ulimit -n); retrying",
                                exc.strerror)
                self.counts["accept-failed"] += 1
                await asyncio.sleep(ACCEPT_RETRY)
                continue
            try:
                await loop.connect_accepted_socket(self._factory, conn)
            except OSError as exc:  # gone already
                log.debug("accepted client lost at once: %s", exc)
                conn.close()

    async def close(self) -> None:
        if self._links_poll is not None:
            self._links_poll.cancel()
            self._links_poll = None
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._sock is not None:
            self._sock.close()
            for conn in list(self.connections.values()):
                if conn.transport is not None:
                    conn.transport.abort()
            # Only our own socket: a newer process of this rank that took
            # the path over keeps it (the old one, stopping, removed the
            # new one's socket, and the rank was unreachable though up).
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._bound:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            ssh.remove_relay_command(os.path.dirname(self.path))  # (if the last)
