"""The tree-based overlay network (TBON) between ranks, over ZeroMQ.

Each rank binds a ROUTER socket for its children and connects a DEALER to
its parent's ROUTER (identity = the rank number).  Sockets are plain pyzmq
sockets driven by the asyncio loop's reader callback on the ZeroMQ FD: each
wake-up drains every message that is ready (ZeroMQ's FD is edge-triggered,
so the socket is re-checked after every send too).

Handshake (CONTROL messages):

* ``overlay.hello`` child -> parent ``{rank}``; the parent admits only its
  own children and answers ``overlay.hello`` ``{rank, size}``.
* ``overlay.ready`` child -> parent once the child's whole subtree is up;
  when rank 0 has heard it from every child the instance is ready.

Over ``tcp://`` the ROUTER is a CURVE server and every DEALER must present
the instance's CURVE key pair (see :mod:`broker.curve`), so only ranks that
hold the instance's keys are admitted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from broker import codec, topology
from broker.errors import ProtocolError
from broker.message import Message, MsgType

if TYPE_CHECKING:
    from broker.router import Router

log = logging.getLogger("kvbroker.overlay")

BATCH = 512
HWM = 100_000


def ipc_endpoint(rundir: str, rank: int) -> str:
    return f"ipc://{rundir}/tbon-{rank}"


class _Sock:
    """One pyzmq socket hooked into the asyncio loop, with a send backlog."""

    def __init__(self, sock: zmq.Socket, on_message: Callable[[list[bytes]], None]) -> None:
        self.sock = sock
        self.on_message = on_message
        self.backlog: deque[list[codec.Frame]] = deque()
        self.loop = asyncio.get_running_loop()
        self.fd = sock.getsockopt(zmq.FD)
        self._scheduled = False
        self.loop.add_reader(self.fd, self._run)

    def send(self, frames: list[codec.Frame]) -> None:
        if self.backlog:
            self.backlog.append(frames)
        else:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.backlog.append(frames)
        self._schedule()

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
            events = sock.getsockopt(zmq.EVENTS)
            if self.backlog and events & zmq.POLLOUT:
                self._flush()
            if not events & zmq.POLLIN:
                break
            if n >= BATCH:  # be fair to the rest of the loop
                self._schedule()
                break
            try:
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

    def close(self) -> None:
        self.loop.remove_reader(self.fd)
        self.sock.close(linger=0)


class Overlay:
    """This rank's links: a ROUTER for its children, a DEALER to its parent."""

    def __init__(
        self,
        router: Router,
        rundir: str,
        *,
        endpoints: dict[int, str] | None = None,
        curve: tuple[bytes, bytes] | None = None,
    ) -> None:
        self.router = router
        self.rank = router.rank
        self.size = router.size
        self.fanout = router.fanout
        self.rundir = rundir
        self.endpoints = endpoints or {}
        self.curve = curve
        self.ctx = zmq.Context()
        self.children = set(topology.children_of(self.rank, self.fanout, self.size))
        self.parent = topology.parent_of(self.rank, self.fanout)
        self.hello_from: set[int] = set()
        self.ready_from: set[int] = set()
        self.parent_acked = self.parent is None
        self.ready = asyncio.get_running_loop().create_future()
        self._sent_ready = False
        self._down: _Sock | None = None
        self._up: _Sock | None = None
        self.dropped = 0
        self._auth = None
        router.overlay = self

    def endpoint(self, rank: int) -> str:
        return self.endpoints.get(rank) or ipc_endpoint(self.rundir, rank)

    def start(self) -> None:
        if self.children:
            s = self.ctx.socket(zmq.ROUTER)
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.SNDHWM, HWM)
            s.setsockopt(zmq.RCVHWM, HWM)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, codec.DEFAULT_MAX_MESSAGE)
            if self.curve is not None:
                from broker.curve import ZAP_DOMAIN, start_authenticator

                public, secret = self.curve
                self._auth = start_authenticator(self.ctx, public)
                s.zap_domain = ZAP_DOMAIN.encode()
                s.curve_server = True
                s.curve_secretkey = secret
                s.curve_publickey = public
            endpoint = self.endpoint(self.rank)
            s.bind(endpoint)
            if endpoint.startswith("ipc://"):
                # Only the owner's ranks may connect, whatever the umask (the
                # run directory is world-searchable when guests are allowed).
                os.chmod(endpoint[len("ipc://"):], 0o700)
            self._down = _Sock(s, self._from_child)
        if self.parent is not None:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, str(self.rank).encode())
            s.setsockopt(zmq.SNDHWM, HWM)
            s.setsockopt(zmq.RCVHWM, HWM)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 20)
            s.setsockopt(zmq.MAXMSGSIZE, codec.DEFAULT_MAX_MESSAGE)
            if self.curve is not None:
                public, secret = self.curve
                s.curve_serverkey = public
                s.curve_publickey = public
                s.curve_secretkey = secret
            s.connect(self.endpoint(self.parent))
            self._up = _Sock(s, self._from_parent)
            self._control_up("overlay.hello", {"rank": self.rank})
        self._check_ready()

    def close(self) -> None:
        for s in (self._down, self._up):
            if s is not None:
                s.close()
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()

    # ------------------------------------------------------------ sending

    def send(self, rank: int, msg: Message) -> bool:
        """Send to a neighbour; False if it is not (or no longer) connected."""
        try:
            frames = codec.encode(msg)
        except TypeError as exc:
            log.error("cannot encode %s: %s", msg, exc)
            return False
        if rank == self.parent and self._up is not None:
            self._up.send(frames)
            return True
        if rank in self.hello_from and self._down is not None:
            try:
                self._down.send([str(rank).encode(), *frames])
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the child is gone
                log.warning("cannot send to rank %d: %s", rank, exc)
                return False
            return True
        return False

    def broadcast_down(self, msg: Message) -> None:
        """Forward an event to every child, encoding it once."""
        if not self.hello_from or self._down is None:
            return
        frames = msg.wire
        if frames is None:
            frames = msg.wire = codec.encode(msg)
        for child in self.hello_from:
            try:
                self._down.send([str(child).encode(), *frames])
            except zmq.ZMQError as exc:
                log.warning("cannot send event to rank %d: %s", child, exc)

    def _control_up(self, topic: str, payload: dict) -> None:
        assert self._up is not None
        self._up.send(codec.encode(Message(MsgType.CONTROL, topic, payload)))

    # ------------------------------------------------------------ receiving

    def _decode(self, frames: list[bytes], origin: str) -> Message | None:
        try:
            return codec.decode(frames)
        except ProtocolError as exc:
            self.dropped += 1
            log.warning("dropping malformed message from %s: %s", origin, exc)
            return None

    def _from_child(self, parts: list[bytes]) -> None:
        ident, frames = parts[0], parts[1:]
        try:
            child = int(ident)
        except ValueError:
            child = -1
        if child not in self.children:
            self.dropped += 1
            log.warning("dropping message from unknown peer %r", ident[:32])
            return
        msg = self._decode(frames, f"rank {child}")
        if msg is None:
            return
        if msg.type == MsgType.CONTROL:
            self._child_control(child, msg)
        elif child not in self.hello_from:
            self.dropped += 1
            log.warning("dropping message from rank %d before its hello", child)
        else:
            self.router.from_rank(child, msg)

    def _child_control(self, child: int, msg: Message) -> None:
        if msg.topic == "overlay.hello":
            self.hello_from.add(child)
            assert self._down is not None
            reply = Message(MsgType.CONTROL, "overlay.hello", {"rank": self.rank,
                                                                "size": self.size})
            self._down.send([str(child).encode(), *codec.encode(reply)])
        elif msg.topic == "overlay.ready":
            self.ready_from.add(child)
            self._check_ready()

    def _from_parent(self, parts: list[bytes]) -> None:
        msg = self._decode(parts, "parent")
        if msg is None:
            return
        if msg.type == MsgType.CONTROL:
            if msg.topic == "overlay.hello":
                self.parent_acked = True
                self._check_ready()
            return
        assert self.parent is not None
        if msg.type == MsgType.EVENT:
            msg.wire = parts  # forwarded to children and local clients as received
        self.router.from_rank(self.parent, msg)

    def _check_ready(self) -> None:
        if self._sent_ready or not self.parent_acked or self.ready_from != self.children:
            return
        self._sent_ready = True
        if self._up is not None:
            self._control_up("overlay.ready", {"rank": self.rank})
        if not self.ready.done():
            self.ready.set_result(None)
