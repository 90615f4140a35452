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
import logging
import os
import secrets
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import zmq
import zmq.utils.monitor

from broker import codec

if TYPE_CHECKING:
    import zmq.auth.thread

log = logging.getLogger("kvbroker.overlay")

BATCH = 512
"""Messages one wake-up of a socket handles before it lets the loop run."""
HWM = 100_000
HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 10_000
"""ZeroMQ heartbeats on every tcp/ipc link: a peer that answers none for this
long (a host that died without closing its sockets) is disconnected."""
HANDSHAKE_IVL_MS = 5000
"""A peer must complete its ZeroMQ (CURVE) handshake within this."""
MONITORED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)
"""Monitor events of a link: a failed handshake (wrong keys), a closed connection."""


def _link_options(sock: zmq.Socket[Any]) -> None:
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, codec.DEFAULT_MAX_MESSAGE)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


def children_socket(ctx: zmq.Context[Any], endpoint: str, curve: tuple[bytes, bytes] | None,
                    ) -> tuple[zmq.Socket[Any], zmq.auth.thread.ThreadAuthenticator | None]:
    """The ROUTER the children connect to, bound at ``endpoint``, and the
    CURVE authenticator that admits only holders of ``curve``'s key pair."""
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)
    _link_options(s)
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
    finally:
        os.umask(old_umask)
    return s, auth


def parent_socket(ctx: zmq.Context[Any], rank: int, endpoint: str,
                  curve: tuple[bytes, bytes] | None) -> zmq.Socket[Any]:
    """The DEALER to the parent at ``endpoint``, with a new identity for
    this process (see :mod:`broker.overlay`)."""
    s: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, f"{rank}-{secrets.token_hex(6)}".encode())
    s.setsockopt(zmq.RECONNECT_IVL, 20)
    _link_options(s)
    if curve is not None:
        public, secret = curve
        s.curve_serverkey = public
        s.curve_publickey = public
        s.curve_secretkey = secret
    s.connect(endpoint)
    return s


def monitor_event(parts: list[bytes]) -> tuple[bool, int, int]:
    """A monitor message as ``(disconnected, event, value)``: a connection
    closed (``value`` its file descriptor), or else a handshake failed."""
    event = zmq.utils.monitor.parse_monitor_message(parts)
    return event["event"] == zmq.EVENT_DISCONNECTED, int(event["event"]), int(event["value"])


class ZmqSocket:
    """One pyzmq socket hooked into the asyncio loop, with a send backlog."""

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[bytes]], None],
                 track_fd: bool = False) -> None:
        self.sock = sock
        self.on_message = on_message
        self.track_fd = track_fd
        self.last_fd = -1
        """With ``track_fd``: the connection (its file descriptor in ZeroMQ's
        I/O thread) the message being handled came from -- how a ROUTER
        learns which child a monitor's DISCONNECTED names."""
        self.backlog: deque[list[codec.Frame]] = deque()
        self.loop = asyncio.get_running_loop()
        # pyzmq types getsockopt() as int | bytes: FD and EVENTS are int options
        self.fd = cast(int, sock.getsockopt(zmq.FD))
        self._scheduled = False
        self.loop.add_reader(self.fd, self._run)
        self._schedule()  # the FD is edge-triggered: read what came before we looked

    def send(self, frames: list[codec.Frame]) -> None:
        if self.sock.closed:  # stopping: e.g. a client's disconnect while links close
            return
        if self.backlog:
            self.backlog.append(frames)
        else:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.backlog.append(frames)
        self._schedule()

    def send_to(self, ident: bytes, frames: list[codec.Frame]) -> str | None:
        """ROUTER: send to the connection ``ident``; why not, if it is gone
        (``EHOSTUNREACH``: ``ROUTER_MANDATORY`` is set)."""
        try:
            self.send([ident, *frames])
        except zmq.ZMQError as exc:
            return str(exc)
        return None

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        sock = self.sock
        if sock.closed:
            return
        n = 0
        while True:
            events = cast(int, sock.getsockopt(zmq.EVENTS))
            if self.backlog and events & zmq.POLLOUT:
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
        if self.backlog:
            self.loop.call_later(0.001, self._schedule)

    def _flush(self) -> None:
        while self.backlog:
            try:
                self.sock.send_multipart(self.backlog[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.warning("overlay send failed: %s", exc)
            self.backlog.popleft()

    def close(self, linger_ms: int = 0) -> None:
        self.loop.remove_reader(self.fd)
        self._flush()
        self.sock.close(linger=linger_ms)


def new_context() -> zmq.Context[Any]:
    return zmq.Context()
