"""ZeroMQ overlay links (``tbon.transport`` ``ipc`` and ``tcp``).

The children's ROUTER socket and the parent's DEALER, with the options every
link gets (heartbeats, high-water marks, the message size cap, CURVE over
``tcp``), their monitors, and :class:`ZmqSocket`, which drives a pyzmq socket
from the asyncio loop.  :mod:`broker.overlay` imports this module only when
an instance uses these transports: pyzmq took ~55 ms of every rank's start
on the default ``unix`` links, which never touch it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.utils.monitor

from broker import codec
from broker.errors import ErrnoError
from broker.linkstall import StallJudge

if TYPE_CHECKING:
    import zmq.auth.thread

log = logging.getLogger("kvbroker.overlay")

BATCH = 512
"""Messages one wake-up of a socket handles before it lets the loop run."""
HWM = 10_000
"""ZeroMQ's high-water mark on each link, in messages.  What ZeroMQ holds
for a peer that does not read is counted in messages, whatever their size,
and outside ``tbon.max-backlog``: kept small, so that past it the messages
wait in :class:`ZmqSocket`'s backlogs, which count bytes."""
HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 10_000
"""ZeroMQ heartbeats on every tcp/ipc link: a peer that answers none for this
long (a host that died without closing its sockets) is disconnected."""
HANDSHAKE_IVL_MS = 5000
"""A peer must complete its ZeroMQ (CURVE) handshake within this."""
RECONNECT_IVL_MS = 20
"""A rank that has not joined yet dials its parent again this long after a
connection that failed or closed (:meth:`broker.overlay.Overlay._dial_again`);
ZeroMQ's own reconnect is put off on that link (:func:`parent_socket`).  The
wait doubles with each dial in a row that did not complete a handshake, up
to :data:`RECONNECT_IVL_MAX_MS`."""
NO_RECONNECT_MS = 2**31 - 1
"""ZeroMQ's reconnect interval on the link to the parent: 24.8 days, so
never while the link matters (:func:`parent_socket`).  Not -1, "no
reconnect": with -1 libzmq ends the endpoint when its connection drops,
and ending it discards at once what the socket has received and the rank
not yet read -- a parent's ``overlay.shutdown`` sent just before it closed
the link was lost, and the child exited 1 at a clean stop (4 of 25 stops
of a 3-rank chain on a loaded machine).  With a reconnect merely due, the
connection's queue stays readable, and no new connection is ever made on
the old one (the abort's cause)."""
RECONNECT_IVL_MAX_MS = 200
"""The longest wait between two dials: each dial is a new socket and its
monitor, and a rank waiting for a parent not started yet took 3.5% of a CPU
dialling every 20 ms (with ZeroMQ's own redial at 20 ms: 0.3%); at 0.2 s,
under 1%, and a child started long before its parent still joins within
0.2 s of the parent's start."""
HANDSHAKE_SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
CLOSED = zmq.EVENT_CLOSED
MONITORED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)
"""Monitor events of a link: a failed handshake (wrong keys), a closed connection."""
UP_MONITORED = MONITORED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CLOSED
"""The link to the parent also hears of handshakes that succeed (its count
of refusals in a row starts again) and of connect attempts that failed
(``CLOSED``).  With ZeroMQ's reconnect put off, libzmq 4.3 ends each dial with
exactly one of ``CLOSED`` (no connection: an ipc path not there or not
listened on, a tcp connect refused or past ``CONNECT_TIMEOUT``) or
``DISCONNECTED`` (a connection that closed: the peer went, a handshake
failed, was refused or timed out, heartbeats went unanswered), then stays
idle: either one is the rank's cue to dial again."""
ACCEPTED = zmq.EVENT_ACCEPTED
DOWN_MONITORED = MONITORED | ACCEPTED
"""The children's socket also hears of each connection accepted: with the
DISCONNECTED that ends it, the connections each file descriptor number has
named, in order (:class:`Connection`)."""
_PROTOCOL_ERRORS = {getattr(zmq, n): n[len("PROTOCOL_ERROR_"):] for n in dir(zmq)
                    if n.startswith("PROTOCOL_ERROR_")}


def _link_options(sock: zmq.Socket[Any], endpoint: str, ipv6: bool) -> None:
    """Every link's options.  IPv6 when asked (``tbon.ipv6``), or when the
    endpoint's address is an IPv6 one in brackets (``tcp://[::1]:8050``):
    ZeroMQ, IPv4-only by default, refused to bind it ("No such device")."""
    if ipv6 or endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, codec.DEFAULT_MAX_MESSAGE)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def children_socket(ctx: zmq.Context[Any], endpoint: str, curve: tuple[bytes, bytes] | None,
                    ipv6: bool = False) -> tuple[zmq.Socket[Any], zmq.Socket[Any],
                               zmq.auth.thread.ThreadAuthenticator | None]:
    """The ROUTER the children connect to, bound at ``endpoint``; its
    monitor (:data:`DOWN_MONITORED`), started before the bind so that no
    connection's ACCEPTED is missed; and the CURVE authenticator that admits
    only holders of ``curve``'s key pair."""
    s = ctx.socket(zmq.ROUTER)
    monitor = s.get_monitor_socket(DOWN_MONITORED)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    _link_options(s, endpoint, ipv6)
    # a connection that has not completed its handshake by then is
    # dropped (ZeroMQ's default, 30 s, let anyone reaching the port
    # hold a file descriptor per idle connection long enough to use
    # them all up: 1,100 of them stopped the rank's clients)
    s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    auth = None
    if curve is not None:
        from broker.curve import ZAP_DOMAIN, start_authenticator

        public, secret = curve
        auth = start_authenticator(ctx, public)
        s.zap_domain = ZAP_DOMAIN.encode()
        s.curve_server = True
        s.curve_secretkey = secret
        s.curve_publickey = public
    # An ipc:// socket is made owner-only as it is bound, not chmod'ed
    # after: ZeroMQ checks no peer credentials, the run directory is
    # world-searchable when guests are allowed, and a guest connected
    # in between could say hello as a child rank.
    old_umask = os.umask(0o077)
    try:
        s.bind(endpoint)
    except zmq.ZMQError as exc:
        s.close(linger=0)
        monitor.close(linger=0)
        if auth is not None:
            auth.stop()
        errnum = exc.errno or errno.EINVAL
        raise ErrnoError(errnum, bind_failure(endpoint, errnum)) from None
    finally:
        os.umask(old_umask)
    return s, monitor, auth


def bind_failure(endpoint: str, errnum: int) -> str:
    """Why a rank with children could not bind ``endpoint``, in one line
    that says what to check -- not ZeroMQ's ``ZMQError: Address already in
    use (addr=...)``: a second copy of a running rank, or a port another
    program holds, is what an operator meets (the rank exits 1)."""
    what = f"cannot bind {endpoint}, where this rank's children connect: {zmq.strerror(errnum)}"
    if errnum == errno.EADDRINUSE:
        return (f"{what} (another process holds it: this rank already running on this "
                "host, or another program on that port)")
    if errnum == errno.EADDRNOTAVAIL:
        return (f"{what} (no interface of this host has that address: is this the host "
                "its hosts entry names? a wrong --rank?)")
    if errnum == errno.ENODEV:
        # (ZeroMQ binds to an address, or an interface by name, not to a
        # host name: one that is no interface here is "No such device")
        return (f"{what} (ZeroMQ binds an address or an interface of this host, not a "
                "host name: tcp://*:PORT, tcp://10.0.0.1:PORT or tcp://eth0:PORT)")
    return what


def parent_socket(ctx: zmq.Context[Any], rank: int, endpoint: str,
                  curve: tuple[bytes, bytes] | None,
                  connect_timeout: float = 0.0,
                  ipv6: bool = False) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """The DEALER to the parent at ``endpoint``, with a new identity for
    this process (see :mod:`broker.overlay`), and its monitor
    (:data:`UP_MONITORED`), started before the connect so that no
    handshake's event is missed: ZeroMQ connects and shakes hands in its
    own thread, and a monitor started after the connect by a rank whose
    loop lost the CPU meanwhile never heard of the handshake -- the rank
    then thought its link not live, never said its hello again, and waited
    for ever when the parent's answer to the first was lost (seen once in
    CI on a loaded machine).  ``connect_timeout`` (``tbon.connect_timeout``,
    seconds; 0: the system's) bounds one TCP connect attempt.

    ZeroMQ's reconnect is put off for good (:data:`NO_RECONNECT_MS`): the
    socket dials once, and the rank dials again with a new socket while it
    has not joined.  A joined rank never uses a reconnected link (a closed
    link is a lost parent: it exits 1), and that reconnect was harmful: a
    link dropped at the heartbeat timeout while its input was stopped at the
    high-water mark (a rank whose loop hung under a flood) was reconnected
    by libzmq 4.3.5, which then aborted the process once the loop read
    again (``Assertion failed: _input_stopped``, zeromq/libzmq#3937).
    libzmq copies options into a connection at ``connect()``, so the option
    could not be changed later, once joined."""
    s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, f"{rank}-{secrets.token_hex(6)}".encode())
    s.setsockopt(zmq.RECONNECT_IVL, NO_RECONNECT_MS)
    # (as the parent's side: a peer that accepts and never speaks is left
    # after 5 s and dialled again, not after ZeroMQ's default 30 s)
    s.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    if connect_timeout > 0:
        s.setsockopt(zmq.CONNECT_TIMEOUT, max(1, round(connect_timeout * 1000)))
    _link_options(s, endpoint, ipv6)
    if curve is not None:
        public, secret = curve
        s.curve_serverkey = public
        s.curve_publickey = public
        s.curve_secretkey = secret
    monitor = s.get_monitor_socket(UP_MONITORED)
    s.connect(endpoint)
    return s, monitor


def monitor_event(parts: list[bytes]) -> tuple[bool, int, int]:
    """A monitor message as ``(disconnected, event, value)``: a connection
    closed (``value`` its file descriptor), or one was accepted
    (:data:`ACCEPTED`, ``value`` its file descriptor), or else a handshake
    failed."""
    event = zmq.utils.monitor.parse_monitor_message(parts)
    return event["event"] == zmq.EVENT_DISCONNECTED, int(event["event"]), int(event["value"])


def refusal(event: int, value: int, server: bool = False) -> str | None:
    """What a failed handshake (monitor ``event``, ``value``) says about
    keys, in words; ``None`` for a failure that says nothing of them (a
    handshake that timed out: a frozen or overloaded peer).

    Seen from a rank (``server`` False): with another key pair than its
    parent's, its hello addresses another server key, which the parent
    cannot decrypt; the parent just closes the connection, and ZeroMQ
    reports ``NO_DETAIL`` with ``EPIPE`` or ``ECONNRESET``.  A parent whose
    ZAP handler refuses the rank's public key answers ``AUTH`` (status 400).
    Seen from the parent (``server``): ``PROTOCOL`` ``ZMTP_CRYPTOGRAPHIC``
    for the first, ``AUTH`` for the second."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if server:
            return f"its public key is not the instance's (EVENT_HANDSHAKE_FAILED_AUTH, " \
                   f"ZAP status {value})"
        return f"EVENT_HANDSHAKE_FAILED_AUTH: its ZAP handler refused our public key " \
               f"(status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        name = _PROTOCOL_ERRORS.get(value, f"{value:#x}")
        if server and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "its CURVE hello was not made for the instance's key " \
                   "(EVENT_HANDSHAKE_FAILED_PROTOCOL: ZMTP_CRYPTOGRAPHIC)"
        return f"EVENT_HANDSHAKE_FAILED_PROTOCOL: {name}"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and value in (errno.EPIPE,
                                                                   errno.ECONNRESET):
        if server:
            return f"the peer closed the connection during the handshake " \
                   f"(EVENT_HANDSHAKE_FAILED_NO_DETAIL: {os.strerror(value)})"
        return f"EVENT_HANDSHAKE_FAILED_NO_DETAIL, {os.strerror(value)}: it closed the " \
               f"connection during the handshake, as a CURVE server does with a hello " \
               f"made for another key"
    return None


class Connection:
    """One connection the children's ROUTER accepted, from its monitor's
    ACCEPTED until its DISCONNECTED, and the identity that spoke on it.

    Both events name the connection by its file descriptor number alone,
    which the next connection accepted may reuse as soon as ZeroMQ's I/O
    thread closed it.  But that thread puts every event and message of a
    connection in order: its ACCEPTED before its first message, its
    DISCONNECTED after its last message and before the number is closed,
    so before the next connection on that number is accepted.  So the
    connections a number named, oldest first, are its ACCEPTED events not
    yet matched by a DISCONNECTED; once every monitor event queued by the
    time a new identity's first message is read has been handled, only one
    is left on its number: the one that message came on (see
    :meth:`broker.overlay.Overlay._claim`)."""

    __slots__ = ("fd", "ident", "inode")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.ident: bytes | None = None
        """The identity of the child that said hello on it, once one has."""
        self.inode: int | None = None
        """Its file descriptor's inode then (:func:`hang_up`)."""


def connection_inode(fd: int) -> int | None:
    """The inode of connection ``fd`` (a ZeroMQ I/O thread's socket), to
    tell later that the number still names the same connection."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


def hang_up(fd: int, inode: int | None) -> bool:
    """Shut down connection ``fd`` of a ZeroMQ socket, if it is still the
    one whose inode is ``inode``.

    A ROUTER cannot disconnect one peer, so this shuts the connection down
    under ZeroMQ, through a duplicate of its descriptor: ZeroMQ's I/O thread
    then sees it closed, as if the peer had closed it, and the peer's
    monitor reports it disconnected.  The descriptor itself stays ZeroMQ's.
    """
    try:
        if inode is None or os.fstat(fd).st_ino != inode:
            return False  # closed since, and the number maybe reused
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        dup.close()
    return True


class ZmqSocket:
    """One pyzmq socket hooked into the asyncio loop, with send backlogs.

    A message ZeroMQ does not take at once (the peer's pipe is at its
    high-water mark: a stopped or slow rank) waits in a backlog of its own
    peer's: a ROUTER keeps one per child, so one child that does not read
    holds up no message to its siblings.  A backlog that grows past
    ``max_backlog`` bytes (``tbon.max-backlog``) is dropped and
    ``on_stuck(ident, bytes)`` called (``ident`` ``b""`` on a DEALER): the
    overlay then gives up that peer, as a stream link does, instead of
    buffering for it without bound -- ZeroMQ's heartbeats do not notice a
    stopped peer while the link's buffers are full.
    """

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[bytes]], None],
                 track_fd: bool = False, max_backlog: int | None = None,
                 on_stuck: Callable[[bytes, int], None] | None = None) -> None:
        self.sock = sock
        self.on_message = on_message
        self.track_fd = track_fd
        self.last_fd = -1
        """With ``track_fd``: the connection (its file descriptor in ZeroMQ's
        I/O thread) the message being handled came from -- how a ROUTER
        learns which child a monitor's DISCONNECTED names."""
        self.backlogs: dict[bytes, deque[list[codec.Frame]]] = {}
        """What waits for room in each peer's pipe, by identity (``b""``:
        a DEALER's one peer); a key only while its queue is not empty."""
        self.backlog_bytes: dict[bytes, int] = {}
        self._stalls: dict[bytes, StallJudge] = {}
        """Per backlog over ``max_backlog``: whether its peer still reads
        (:mod:`broker.linkstall`); forgotten with the backlog."""
        self.received = 0
        """Messages read so far (:meth:`broker.overlay.Overlay._reap`)."""
        self.max_backlog = max_backlog
        self.on_stuck = on_stuck
        self.loop = asyncio.get_running_loop()
        # pyzmq types getsockopt() as int | bytes: FD and EVENTS are int options
        self.fd = cast(int, sock.getsockopt(zmq.FD))
        self._scheduled = False
        self.loop.add_reader(self.fd, self._run)
        self._schedule()  # the FD is edge-triggered: read what came before we looked

    def send(self, frames: list[codec.Frame]) -> None:
        """DEALER: send to the peer (queued while its pipe is full)."""
        self._send(b"", frames)

    def send_to(self, ident: bytes, frames: list[codec.Frame]) -> str | None:
        """ROUTER: send to the connection ``ident``; why not, if it is gone
        (``EHOSTUNREACH``: ``ROUTER_MANDATORY`` is set)."""
        try:
            self._send(ident, [ident, *frames])
        except zmq.ZMQError as exc:
            return str(exc)
        return None

    def try_send_to(self, ident: bytes, frames: list[codec.Frame]) -> bool:
        """ROUTER: send to connection ``ident`` now, or not at all (its pipe
        is full, or it is gone): for an answer to a peer that is not one
        of our children, which gets no backlog of its own."""
        if self.sock.closed:
            return False
        try:
            self.sock.send_multipart([ident, *frames], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            return False
        self._schedule()  # (the send may have taken the FD's edge: see _send)
        return True

    def _send(self, ident: bytes, frames: list[codec.Frame]) -> None:
        if self.sock.closed:  # stopping: e.g. a client's disconnect while links close
            return
        queue = self.backlogs.get(ident)
        if queue is None:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                # A send may take the FD's edge for messages that arrived
                # meanwhile (ZeroMQ's FD is edge-triggered): look again, or
                # they wait for the next edge -- a keepalive sent from a
                # timer left a request to this rank unread for good.
                self._schedule()
                return
            except zmq.Again:
                queue = self.backlogs[ident] = deque()
                self.backlog_bytes[ident] = 0
        # Judged before the message, as a stream link does: one big one still goes.
        queued = self.backlog_bytes[ident]
        if self.max_backlog is not None and queued > self.max_backlog and self._stuck(ident,
                                                                                    queued):
            self.drop_backlog(ident)
            if self.on_stuck is not None:
                self.on_stuck(ident, queued)
            return
        queue.append(frames)
        self.backlog_bytes[ident] = queued + codec.frames_size(frames)
        self._schedule()

    def _stuck(self, ident: bytes, queued: int) -> bool:
        """Whether peer ``ident``, ``queued`` bytes behind, has stopped
        reading (:class:`broker.linkstall.StallJudge`)."""
        judge = self._stalls.get(ident)
        if judge is None:
            assert self.max_backlog is not None
            judge = self._stalls[ident] = StallJudge(self.max_backlog)
        return judge.stuck(queued)

    def drop_backlog(self, ident: bytes) -> int:
        """Forget what waits for peer ``ident``; how many messages that was."""
        self._stalls.pop(ident, None)
        self.backlog_bytes.pop(ident, None)
        queue = self.backlogs.pop(ident, None)
        return len(queue) if queue is not None else 0

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._scheduled_run)

    def _scheduled_run(self) -> None:
        # (the flag is cleared here, not in _run: a _run called otherwise --
        # the FD's reader, read_slice -- while this one waits must not
        # schedule a second one, and each turn one more)
        self._scheduled = False
        self._run()

    def _run(self) -> int:
        """Read and handle what is ready (at most :data:`BATCH` messages,
        then again at the next turn); how many messages that was."""
        sock = self.sock
        if sock.closed:
            return 0
        n = 0
        while True:
            events = cast(int, sock.getsockopt(zmq.EVENTS))
            if self.backlogs and events & zmq.POLLOUT:
                self._flush()
            if not events & zmq.POLLIN:
                break
            if n >= BATCH:  # be fair to the rest of the loop
                self._schedule()
                break
            try:
                if self.track_fd:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    self.last_fd = frames[0].get(zmq.SRCFD)
                    parts = [f.bytes for f in frames]
                else:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                self.on_message(parts)
            except Exception:
                log.exception("error handling an overlay message")
        self.received += n
        if self.backlogs:
            self.loop.call_later(0.001, self._schedule)
        return n

    def read_slice(self) -> bool:
        """Handle what has arrived, now, up to :data:`BATCH` messages;
        whether more is waiting."""
        if self.sock.closed:
            return False
        self._run()
        return (not self.sock.closed
                and bool(cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN))

    def read_all(self) -> None:
        """Handle every message that has arrived, now, whatever the batch
        size (a monitor's DISCONNECTED may be read before the last messages
        of the connection it reports).  Stops when a turn reads nothing,
        should ZeroMQ say POLLIN with nothing to take."""
        while (not self.sock.closed
               and cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN and self._run()):
            pass

    def _flush(self) -> None:
        """Send what each backlog holds, until its peer's pipe is full."""
        for ident, queue in list(self.backlogs.items()):
            judge = self._stalls.get(ident)
            before = len(queue)
            while queue:
                try:
                    self.sock.send_multipart(queue[0], zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ZMQError as exc:  # the peer is gone: say so once
                    log.warning("overlay send failed: %s (%d queued messages dropped)",
                                exc, self.drop_backlog(ident))
                    break
                self.backlog_bytes[ident] -= codec.frames_size(queue.popleft())
            else:
                self.drop_backlog(ident)
                continue
            left = self.backlog_bytes.get(ident)  # (None: dropped, the peer gone)
            if judge is not None and left is not None:
                if len(queue) < before:
                    judge.progressed()  # (the peer took some: once a flush)
                if left <= judge.max_backlog:
                    judge.clear()  # (judged afresh next time over)

    def most_queued(self) -> int:
        """The most bytes waiting for one peer (0: nothing waits)."""
        return max(self.backlog_bytes.values(), default=0)

    def close(self, linger_ms: int = 0) -> None:
        self.loop.remove_reader(self.fd)
        self._flush()
        self.sock.close(linger=linger_ms)


def new_context() -> zmq.Context[Any]:
    return zmq.Context()
