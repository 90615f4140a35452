"""The tree-based overlay network (TBON) between ranks.

Links come in two transports, chosen by the attribute ``tbon.transport``:

* ``unix`` (default inside one host): Unix-domain stream sockets read by the
  event loop directly -- see :mod:`broker.overlay_stream`.
* ``ipc`` / ``tcp``: ZeroMQ.  Each rank binds a ROUTER socket for its
  children and connects a DEALER to its parent's ROUTER; ``tcp`` adds CURVE
  (below).  A DEALER's ZeroMQ identity is new for every process
  (``<rank>-<random>``) and the parent learns the rank from the hello, so a
  rank restarted while its old connection still looks alive (its host froze
  or vanished without closing it) is admitted at once: the newest hello
  wins, the old process is told it was replaced, and what was in flight to
  it is answered as for a lost rank.  (A fixed identity would make the
  ROUTER refuse the newcomer -- losing its hello -- until heartbeats drop
  the old connection; and with ZeroMQ's identity handover a resumed old
  process reconnecting would take the identity back.)  ZeroMQ's reconnect
  is off on the DEALER: a child dials its parent itself, each time from a
  new DEALER, until the parent answers its hello (:meth:`Overlay._dial_again`),
  and once joined a closed link is a lost parent.  Sockets are plain pyzmq
sockets driven by the asyncio loop's reader callback on the ZeroMQ FD: each
wake-up drains every message that is ready (ZeroMQ's FD is edge-triggered,
so the socket is re-checked after every send too).

Handshake (CONTROL messages):

* ``overlay.hello`` child -> parent ``{rank, process, size, hostname, hash}``
  (``process``: a random name of the child's process, the same in each of
  its hellos, on any connection: :meth:`Overlay._dial_again`; ``size``: the
  instance size the child was started with; ``hostname``: the child's
  ``hostname`` attribute; ``hash``: its ``content.hash``); the parent
  admits only its own children, of its own size and hash, and answers
  ``overlay.hello`` ``{rank, size}`` -- again to each hello said again
  (ZeroMQ may lose an answer: a child says hello until answered,
  :meth:`Overlay._hello_due`).  Over
  ``tcp`` (CURVE: the peer holds the instance's keys) a hello from a rank
  that is not a child or says another size -- mismatched bootstrap files
  (:meth:`Overlay._wrong_size`) -- or another ``content.hash``
  (:meth:`Overlay._wrong_hash`), or, with a
  bootstrap file, from a host that is not its rank's entry (a wrong
  ``--rank``: :meth:`Overlay._wrong_host`) is answered
  ``overlay.refused`` ``{rank, why}``, and the rank stops (exit 1) saying
  why; any other peer's is dropped unanswered.  A refused hello leaves
  the running process of that rank, if any, untouched.
* ``overlay.ready`` child -> parent once the child's whole subtree is up;
  when rank 0 has heard it from every child the instance is ready.
* ``overlay.shutdown`` parent -> children when a rank stops: each child
  stops too, and passes it on, so stopping rank 0 stops the instance --
  what a multi-host instance (``kvbroker broker``) relies on.
* ``overlay.keepalive`` child -> parent ``{rank}`` when the child has sent
  its parent nothing for ``tbon.torpid_min`` (see *Torpid children*).

Torpid children (Flux's ``tbon.torpid_min`` / ``tbon.torpid_max``): a rank
that hangs without closing its link (a deadlock, a host swapping, SIGSTOP
on a stream link) is noticed by no transport -- a stream link stays open,
and ZeroMQ's heartbeats are answered by its I/O thread while only the
rank's loop is stuck.  (A rank stopped whole, SIGSTOP on a ZeroMQ link, has
its I/O thread stopped too: its link is dropped after
``HEARTBEAT_TIMEOUT_MS``, 10 s, before the default ``torpid_max``;
docs/guide.md, "Torpid ranks".)  So each
rank counts *ticks* of one timer (every ``torpid_min``); every message from
a child records the current tick (one assignment, no clock read per
message), and every message to the parent records it too.  At each tick a
rank that sent its parent nothing during the tick just ended sends it an
``overlay.keepalive``, and a child last heard before the tick just ended
whose silence since then reaches ``torpid_max`` is marked *torpid*: a
WARNING, ``overlay.torpid`` in ``kvbroker stats broker`` and ``kvbroker
overlay status``; one INFO when it speaks again.  A torpid child is not
disconnected (nor is it by Flux): its requests stay routed to it, and it
resumes where it stopped.

A rank that loses its parent without a shutdown (the parent crashed, its
host went away: the stream closed, or ZeroMQ saw the TCP connection drop or
its heartbeats go unanswered) stops with exit status 1, as a Flux broker
does, rather than serving a subtree cut off from rank 0 whose requests
upstream would never be answered; its own children stop with it.

Over ``tcp://`` the ROUTER is a CURVE server and every DEALER must present
the instance's CURVE key pair (see :mod:`broker.curve`), so only ranks that
hold the instance's keys are admitted.  The ZeroMQ sockets themselves are in
:mod:`broker.overlay_zmq`, imported only when a link uses them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import re
import secrets
import socket
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from broker import codec, topology
from broker.bootstrap import wrong_host
from broker.errors import ProtocolError
from broker.linkstall import CONGESTED_DIVISOR
from broker.logring import LogThrottle
from broker.message import Message, MsgType
from broker.overlay_stream import StreamConn, StreamLinks, unlink_socket_file

if TYPE_CHECKING:
    import zmq
    import zmq.auth.thread

    from broker.overlay_zmq import Connection, ZmqSocket
    from broker.router import Router

log = logging.getLogger("kvbroker.overlay")

TRANSPORTS = ("unix", "ipc", "tcp")
DEFAULT_TRANSPORT = "unix"
REFUSALS_TO_GIVE_UP = 5
"""CURVE handshakes the parent refuses in a row before a rank that has not
joined yet stops (:meth:`Overlay._on_up_monitor`): a fraction of a second
at the 20 ms to 0.2 s between dials (:meth:`Overlay._dial_again`)."""
EXIT_REFUSED = 3
"""Exit status of a rank whose parent refused its CURVE key: not 1 (a lost
parent, which a supervisor's restart may cure), so that a supervisor can
tell it apart and not restart it (systemd: ``RestartPreventExitStatus=3``)."""
CUT_OFF_KEPT = 64
"""ZeroMQ identities this rank cut off that it remembers (the newest)."""
REFUSED_HELLOS_PER_SECOND = 10
"""Answers a parent sends, per second at most, to hellos it refuses (from
ranks that are not its children, or from the wrong host:
:meth:`Overlay._refuse_hello`); each identity is answered once."""
REFUSAL_LOG_INTERVAL = 60
"""Seconds between a parent's warnings about refused handshakes."""
KEEPALIVE = "overlay.keepalive"
HELLO_RETRY_FIRST = 0.5
"""Seconds a ZeroMQ child waits for its parent's hello answer, over a live
link, before it says hello again (:meth:`Overlay._hello_due`); doubled at
each try, up to :data:`HELLO_RETRY_MAX`."""
HELLO_RETRY_MAX = 4.0
"""The longest wait between two hellos; the first hello sent after a wait
this long is logged at WARNING (once): a parent busy for a second at its
start is no news, one silent for seconds on a live link is."""
MAX_HELD_UP = 10_000
"""Messages a ZeroMQ rank holds for a parent that has not answered its hello
yet (:meth:`Overlay._send_parent`); past it a request is refused (no route)."""
DEFAULT_CONNECT_TIMEOUT = 30.0
"""``tbon.connect_timeout``'s default (Flux's): seconds without any
connection to the parent after which a child that has not joined says so,
at WARNING, once per outage -- from its start, or from a link that closed
before the parent answered (it goes on waiting: ranks may start in any
order) -- and, over tcp, how long one connect attempt may take."""
DEFAULT_TORPID_MIN = 5.0
DEFAULT_TORPID_MAX = 30.0


@dataclass
class _Rejoins:
    """A child's hellos after its first (:attr:`Overlay._rejoins`)."""
    times: int = 0
    replaced: int = 0
    """Of them, those that took the place of an old process still connected."""
    at: float = 0.0
    """The loop time of the last."""


class Unencodable(Exception):
    """A message whose payload cannot be packed (:meth:`Overlay.send`): it
    decoded as it came, but a module re-nested it deeper than msgpack packs
    (a follower's kvs relays a commit's ops two levels down)."""


class Oversized(Exception):
    """A message of ``size`` bytes, over a link's ``limit`` (:meth:`Overlay.send`)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)
        self.size = size
        self.limit = limit


def hello_process(payload: Any) -> str | None:
    """The process a hello's payload names (:attr:`Overlay.process_id`);
    None if it names none (a peer that does not say: counted as a new
    process each time, as all were)."""
    process = payload.get("process") if isinstance(payload, dict) else None
    return process if isinstance(process, str) and len(process) <= 64 else None


_HOSTNAME = re.compile(r"[A-Za-z0-9._:%\[\]-]{1,255}")


def hello_hostname(payload: Any) -> str | None:
    """The host a hello's payload says its process runs on (the child's
    ``hostname`` attribute); None if it says none, or nothing that looks
    like a host name (a peer with the instance's keys says what it likes:
    it is logged, and shown by ``kvbroker overlay status``)."""
    name = payload.get("hostname") if isinstance(payload, dict) else None
    return name if isinstance(name, str) and _HOSTNAME.fullmatch(name) else None


def ipc_endpoint(rundir: str, rank: int) -> str:
    return f"ipc://{rundir}/tbon-{rank}"


REPLACED = "it said hello again"
"""Why a child's old link is dropped when a new process of it says hello:
not a loss (it is back)."""


class Overlay:
    """This rank's links: a ROUTER for its children, a DEALER to its parent."""

    def __init__(
        self,
        router: Router,
        rundir: str,
        *,
        endpoints: dict[int, str] | None = None,
        bind: str | None = None,
        curve: tuple[bytes, bytes] | None = None,
        transport: str = DEFAULT_TRANSPORT,
        on_stop: Callable[[str | None, int], None] | None = None,
        max_backlog: int = 512 << 20,
        max_message: int = codec.MAX_LINK_MESSAGE,
        torpid_min: float = DEFAULT_TORPID_MIN,
        torpid_max: float = DEFAULT_TORPID_MAX,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        ipv6: bool = False,
        hostname: str = "",
        hosts: list[str] | None = None,
        content_hash: str = "",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"unknown tbon.transport {transport!r}")
        if transport == "unix" and (endpoints or curve):
            transport = "tcp"  # endpoints/keys given: the launcher chose ZeroMQ
        self.transport = transport
        self.max_backlog = max_backlog
        """``tbon.max-backlog``: a stream link whose peer leaves more than this
        unread is dropped (:class:`~broker.overlay_stream.StreamConn`)."""
        self.connect_timeout = connect_timeout
        """``tbon.connect_timeout`` (ZeroMQ links): see :data:`DEFAULT_CONNECT_TIMEOUT`;
        0: no warning, and the system's own connect timeout."""
        self.ipv6 = ipv6
        """``tbon.ipv6`` (ZeroMQ links): IPv6 too (``overlay_zmq._link_options``)."""
        self.max_message = max_message
        """``tbon.max-message``: the largest message sent on a link (every
        rank takes up to :data:`codec.MAX_LINK_MESSAGE`, its largest value)."""
        self.router = router
        self.rank = router.rank
        self.size = router.size
        self.fanout = router.fanout
        self.rundir = rundir
        self.hostname = hostname
        """The host this rank says it runs on, in its hellos (its ``hostname``)."""
        self.content_hash = content_hash
        """This rank's ``content.hash``, in its hellos: a child's of another
        is refused (:meth:`_wrong_hash`); empty: none said, none judged."""
        self.hosts = hosts
        """Each rank's host from the bootstrap file, by rank (None without
        one: ``kvbroker start``): a child's hello from another host is
        refused (:meth:`_wrong_host`)."""
        self._child_host: dict[int, str] = {}
        """The host each child's last admitted hello named (kept once the
        child is lost): what :meth:`child_hosts` tells ``kvbroker overlay
        status``, for the ranks that do not answer."""
        self.endpoints = endpoints or {}
        self.bind = bind
        self.curve = curve
        self.on_stop = on_stop
        """Called to stop this rank: ``(None, 0)`` when the parent said
        shutdown, ``(why, status)`` when the parent was lost (status 1) or
        refused our CURVE key (:data:`EXIT_REFUSED`)."""
        self._shutdown_sent = False
        self._shutdown_unanswered: set[int] = set()
        """Children told to stop that have not answered it yet (nor gone)."""
        self._shutdown_answered: asyncio.Future[None] | None = None
        """Set once every child told to stop answered it (or can no longer)."""
        self._goodbye_sent = False
        self._goodbye_answered: asyncio.Future[None] | None = None
        """Set when the parent answered our goodbye (or can no longer)."""
        self._parent_gone = False
        """The parent was lost, or told us to stop: no goodbye to say."""
        self.parent_lost = False
        """The link to the parent broke once joined (:meth:`_parent_lost`):
        nothing sent up will be answered, nor any event come down."""
        self._parent_stays = False
        """... and still runs: it refused our hello, or admitted a newer
        process of this rank in our place."""
        self._leaving: dict[int, str] = {}
        """Children that said goodbye (``overlay.goodbye``), with why: their
        link's closing is a stop, logged at INFO, not a loss."""
        self._lost: dict[int, str] = {}
        """Children lost (a crash, a kill, a host gone, cut off by ``overlay
        disconnect``), with why, until one says hello again: what
        :meth:`lost` tells ``kvbroker overlay status`` (it said only "rank N
        is unreachable", whatever this rank saw)."""
        self._stopped: dict[int, str] = {}
        """Children whose last process stopped on purpose (it said goodbye,
        or this rank told it to), with why, until one says hello again:
        what :meth:`offline` tells ``kvbroker overlay status``, which showed
        a rank stopped for maintenance as lost, as if it had crashed."""
        self._closing = False
        self.ctx: zmq.Context[Any] | None = None
        self._streams: StreamLinks | None = None
        self._child_conns: dict[int, StreamConn] = {}
        self.children = set(topology.children_of(self.rank, self.fanout, self.size))
        self.parent = topology.parent_of(self.rank, self.fanout)
        self.hello_from: set[int] = set()
        self._send_failed: set[bytes] = set()
        """ZeroMQ links to children a send failed on (said once each)."""
        self._refused_by_parent = 0
        """Handshakes with the parent refused in a row (none succeeded since)."""
        self._refusal_log = LogThrottle(log, REFUSAL_LOG_INTERVAL)
        self._hello_refused: dict[bytes, None] = {}
        """Identities answered ``overlay.refused`` (the newest
        :data:`CUT_OFF_KEPT`): each is answered once."""
        self._refusals_at = (0.0, 0)
        """The second the last refusals were sent in, and how many then."""
        self._peer_log = LogThrottle(log)
        """The warnings about one message from a peer (malformed, or not the
        hello of one of our children): how many such messages a peer sends
        is its choice -- any that reaches the socket over ``ipc``, one that
        holds the instance's keys over ``tcp`` -- so each kind is logged at
        most once a second (``overlay.dropped`` counts every one)."""
        self.ready_from: set[int] = set()
        self.parent_acked = self.parent is None
        self.ready = asyncio.get_running_loop().create_future()
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Set once the parent answered our hello (at once on rank 0): the
        rank takes over its local socket only then (:meth:`Broker.start`)."""
        if self.parent_acked:
            self.admitted.set_result(None)
        self._sent_ready = False
        self._down: ZmqSocket | None = None
        self._up: ZmqSocket | None = None
        self.dropped = 0
        self.replaced = 0
        """Children admitted while an older process of the same rank was connected."""
        self._joined: set[int] = set()
        """Children that said hello at least once since this rank started."""
        self._rejoins: dict[int, _Rejoins] = {}
        """Children that joined again since (a new process: the old one was
        lost, or replaced): what :meth:`rejoined` tells ``kvbroker overlay
        status``, which otherwise showed a restarted rank as full, as if
        nothing had happened."""
        self._child_process: dict[int, str] = {}
        """The ``process`` each child's last admitted hello named (kept once the
        child is lost): a hello from a new identity naming the same one is a
        new connection of that process, not a restart (:meth:`_admit`,
        :attr:`_rejoins`)."""
        self._auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self._ipc_bound: tuple[str, int] | None = None
        """ZeroMQ over ipc: the socket file bound for the children, and its inode."""
        self._monitor: ZmqSocket | None = None
        # ZeroMQ links: each child's current connection, by its identity, and
        # the connections the monitor reported, for its DISCONNECTED events.
        self._child_ident: dict[int, bytes] = {}
        self._ident_child: dict[bytes, int] = {}
        self._fd_conns: dict[int, deque[Connection]] = {}
        """The connections accepted on each file descriptor number whose
        DISCONNECTED was not handled yet, oldest first (see
        :class:`~broker.overlay_zmq.Connection`)."""
        self._ident_conn: dict[bytes, Connection] = {}
        """Each admitted identity's connection (to hang it up)."""
        self._closed: dict[bytes, int] = {}
        """Identities whose connection closed, to lose once what they sent
        before is read (:meth:`_reap`), with the children's socket's
        message count (``received``) then."""
        self._reap_due = False
        self._cut_off: dict[bytes, None] = {}
        """Identities of child links this rank cut (disconnected, replaced or
        dropped as stuck) or lost (closed), oldest first, at most :data:`CUT_OFF_KEPT`: what
        such a link still brings -- the messages in flight when it was cut,
        those its old process sends when it runs again -- is dropped quietly
        (``overlay.dropped``).  Taken for a stranger's, each was a WARNING:
        a busy child disconnected flooded stderr with thousands, and pushed
        the disconnect's own record out of the dmesg ring."""
        self._zmq_slow = 0
        self._losing: dict[int, str] = {}
        """ZeroMQ: children dropped as stuck (:meth:`_child_stuck`) whose loss
        is yet to run, next loop turn, with why.  A new process of that rank
        admitted meanwhile has it run first (:meth:`_admit`): run after,
        it took the new link for the old and lost it for good."""
        self._up_monitor: ZmqSocket | None = None
        self._up_handshaken = False
        """The link to the parent completed a handshake, and has not closed since."""
        self._unreached_since: float | None = None
        """The loop time since when no link to the parent has completed a
        handshake (the first hello, or the last link's close before the
        parent answered), None while one is up: :meth:`_hello_due` warns
        after :attr:`connect_timeout` seconds of it, once per outage."""
        self._hello_timer: asyncio.TimerHandle | None = None
        self._dial_timer: asyncio.TimerHandle | None = None
        """ZeroMQ, before joining: the next dial of the parent (:meth:`_dial_later`)."""
        self._dial_wait = 0.0
        """Seconds before the next dial (0: not set yet): see ``RECONNECT_IVL_MS``."""
        self._resolving: asyncio.Task[None] | None = None
        """ZeroMQ: the look-up of the parent's host name (:meth:`_check_parent_host`)."""
        self._hello_retry = HELLO_RETRY_FIRST
        self._hello_started = 0.0
        """The loop time of the first hello."""
        self._hellos = 0
        self._held_up: list[list[codec.Frame]] = []
        """ZeroMQ: what this rank sent its parent before the parent answered
        its hello, sent on once it does (:meth:`_send_parent`)."""
        """Hellos sent to the parent so far."""
        self._hello_warned = False
        self._unreached_warned = False
        self.process_id = secrets.token_hex(8)
        """Names this process in its hellos, on every connection: a parent
        then tells a connection renewed by this process (:meth:`_dial_again`)
        from a restart of the rank."""
        self._stopping_refused = False
        self.refused = 0
        """Overlay handshakes that failed: a peer without the instance's keys."""
        self.torpid_min = torpid_min
        """``tbon.torpid_min``: the keepalive and torpid check's period (seconds)."""
        self.torpid_max = torpid_max
        """``tbon.torpid_max``: a child silent this long is torpid (0: never)."""
        self._tick = 0
        """Periods of the torpid check so far: what every message records."""
        self._sent_tick = 0
        """The tick of the last message to the parent."""
        self._heard: dict[int, int] = {}
        """Each child's last message's tick (set per message: keep it cheap)."""
        self._seen_at: dict[int, float] = {}
        """Each child's last message, at most: the loop time of the check
        that ended the tick it was heard in."""
        self.torpid: dict[int, float] = {}
        """Torpid children, with ``_seen_at`` when they were marked."""
        self._checked_at = 0.0
        self._check_timer: asyncio.TimerHandle | None = None
        self.tracer: Callable[[str, int, list[Any], Message | None], None] | None = None
        """While someone traces this rank's overlay (``overlay.trace``,
        :mod:`broker.trace`): called with ``tx`` or ``rx``, the peer rank,
        each message's frames, and the message if it is decoded already."""
        router.overlay = self

    def congested(self) -> bool:
        """Whether a link has more than ``tbon.max-backlog`` / 4 bytes
        waiting for its peer (:mod:`broker.linkstall`): the connector reads
        no guest's connection meanwhile, so guests' big messages do not
        pile up there (they did, and a neighbour that read was dropped as
        stuck)."""
        mark = self.max_backlog // CONGESTED_DIVISOR
        links = self._streams
        if links is not None:
            up = links.up
            if up is not None and up.queued > mark:
                return True
            return any(conn.queued > mark for conn in links.conns)
        return any(z is not None and z.most_queued() > mark for z in (self._up, self._down))

    @property
    def slow(self) -> int:
        """Links dropped because the peer did not read (``tbon.max-backlog``)."""
        return self._streams.slow if self._streams is not None else self._zmq_slow

    def endpoint(self, rank: int) -> str:
        return self.endpoints.get(rank) or ipc_endpoint(self.rundir, rank)

    async def start(self) -> None:
        if self.transport == "unix":
            await self._start_streams()
        else:
            self._start_zmq()
        if self.children or self.parent is not None:
            loop = asyncio.get_running_loop()
            self._checked_at = loop.time()
            self._check_timer = loop.call_later(self.torpid_min, self._check_torpid)
        self._check_ready()

    def set_torpid(self, torpid_min: float, torpid_max: float) -> None:
        """New ``tbon.torpid_min`` / ``tbon.torpid_max`` (``kvbroker attr
        set``).  A new period starts now: the tick in progress ends with the
        next check, ``torpid_min`` from now, so a silence is still never
        overstated."""
        changed = torpid_min != self.torpid_min
        self.torpid_min, self.torpid_max = torpid_min, torpid_max
        if changed and self._check_timer is not None:
            self._check_timer.cancel()
            loop = asyncio.get_running_loop()
            self._checked_at = loop.time()
            self._check_timer = loop.call_later(torpid_min, self._check_torpid)

    def rejoined(self) -> dict[str, dict[str, float]]:
        """Each child that joined again since this rank started (``str(rank)``,
        for JSON): ``{times, replaced, ago}`` -- how many times a new process
        of it said hello, how many of those took the place of an old one
        still connected (:meth:`_admit`), and how many seconds ago the last
        did."""
        now = asyncio.get_running_loop().time()
        return {str(c): {"times": r.times, "replaced": r.replaced, "ago": round(now - r.at, 1)}
                for c, r in sorted(self._rejoins.items())}

    def child_hosts(self) -> dict[str, str]:
        """The host each child that said hello since this rank started said
        it runs on (``str(rank)``, for JSON), the last one's; kept once it
        is lost: ``kvbroker overlay status`` names the host of a torpid,
        lost or offline rank with it."""
        return {str(c): host for c, host in sorted(self._child_host.items())}

    def unjoined(self) -> list[int]:
        """The children no process of which has said hello since this rank
        started: not started yet (ranks may start in any order), or still
        waiting for a parent of their own, or refused.  ``kvbroker overlay
        status`` shows them *offline*, as Flux does a child that never
        connected; a child that joined and went is lost or offline instead."""
        return sorted(self.children - self._joined)

    def lost(self) -> dict[str, str]:
        """Each child lost and not joined again (``str(rank)``, for JSON),
        with why (``its connection closed``, ``disconnected: kvbroker
        overlay disconnect, by uid 1000``)."""
        return {str(c): why for c, why in sorted(self._lost.items())}

    def was_lost(self, child: int) -> bool:
        """Whether ``child`` was lost and has not joined again."""
        return child in self._lost

    def why_unreachable(self, rank: int) -> str:
        """What this rank knows of child ``rank``, for the error of a
        request it cannot pass on (``rank N ...``): ``is offline: it
        stopped (WHY)`` or ``was lost: WHY``, as ``overlay status`` says it
        (it said only "is unreachable", where the operator's next command
        knew it was shut down); else ``is unreachable``."""
        if rank in self._stopped:
            return f"is offline: it stopped ({self._stopped[rank]})"
        if rank in self._lost:
            return f"was lost: {self._lost[rank]}"
        return "is unreachable"

    def offline(self) -> dict[str, str]:
        """Each child that stopped on purpose and has not joined again
        (``str(rank)``, for JSON), with why (``signal SIGTERM``): offline,
        as Flux says, not lost."""
        return {str(c): why for c, why in sorted(self._stopped.items())}

    def torpid_seconds(self) -> dict[str, float]:
        """Each torpid child (``str(rank)``, for JSON) with how long it has
        been silent, in seconds (at least: see :attr:`_seen_at`)."""
        now = asyncio.get_running_loop().time()
        return {str(c): round(now - at, 1) for c, at in sorted(self.torpid.items())}

    def _check_torpid(self) -> None:
        """Every ``torpid_min``: end the current tick; send the parent a
        keepalive if this rank sent it nothing during that tick; mark
        children silent for ``torpid_max`` torpid, and those heard again
        responsive.

        A message heard during tick ``t`` came before the check that ended
        it, so its child is counted silent only from that check on: a
        silence is never overstated, and a healthy idle child (a keepalive
        at most ``2 * torpid_min`` apart) is never marked.  A check that
        comes much later than due (this rank itself was held up, or the
        machine was) marks no one: what arrived meanwhile may not be read
        yet."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        ended = self._tick
        self._tick = ended + 1
        late = now - self._checked_at > 2 * self.torpid_min
        self._checked_at = now
        self._check_timer = loop.call_later(self.torpid_min, self._check_torpid)
        if (self.parent is not None and self._sent_tick != ended and self.parent_acked
                and not self._goodbye_sent and not self._parent_gone):
            self._control_up(KEEPALIVE, {"rank": self.rank})
        for child in self.hello_from:
            if self._heard.get(child) == ended or child not in self._seen_at:
                self._seen_at[child] = now
                if self.torpid.pop(child, None) is not None:
                    log.info("child rank %d is responsive again", child)
                continue
            silent = now - self._seen_at[child]
            if (not late and self.torpid_max and silent >= self.torpid_max
                    and child not in self.torpid and child not in self._leaving):
                # (a child that said goodbye sends no keepalive while it stops)
                self.torpid[child] = self._seen_at[child]
                log.warning("child rank %d is torpid: nothing heard for %.0f s "
                            "(tbon.torpid_max %g s); it stays connected, and requests "
                            "to its subtree wait for it", child, silent, self.torpid_max)

    async def _start_streams(self) -> None:
        links = self._streams = StreamLinks(
            lambda r: self.endpoint(r)[len("ipc://"):], self.router.owner_uid,
            self._from_child_conn, self._from_parent, self._child_lost,
            lambda: self._parent_lost("its connection closed"), self.max_backlog)
        if self.children:
            await links.listen(self.rank)
        if self.parent is not None:
            await links.connect(self.parent)
            self._control_up("overlay.hello", self._hello_payload())

    def _start_zmq(self) -> None:
        from broker import overlay_zmq as zl

        ctx = self.ctx = zl.new_context()
        if self.children:
            endpoint = self.bind or self.endpoint(self.rank)
            s, monitor, self._auth = zl.children_socket(ctx, endpoint, self.curve, self.ipv6)
            if endpoint.startswith("ipc://"):  # (its file: removed at close)
                path = endpoint[len("ipc://"):]
                with contextlib.suppress(OSError):
                    self._ipc_bound = (path, os.stat(path).st_ino)
            self._monitor = zl.ZmqSocket(monitor, self._on_monitor)
            self._down = zl.ZmqSocket(s, self._from_child, track_fd=True,
                                      max_backlog=self.max_backlog, on_stuck=self._child_stuck)
        if self.parent is not None:
            self._open_up()
            self._hello_started = asyncio.get_running_loop().time()
            self._unreached_since = self._hello_started
            self._say_hello()
            self._resolving = asyncio.get_running_loop().create_task(
                self._check_parent_host(self.endpoint(self.parent)))

    async def _check_parent_host(self, endpoint: str) -> None:
        """Say at once (WARNING) when the parent's host name does not
        resolve: ZeroMQ retries such a name without a word, and the rank
        said only "no connection ... is it running?" after
        ``tbon.connect_timeout`` (Flux warns "unable to resolve upstream
        peer").  It goes on trying: the name may resolve later."""
        m = re.fullmatch(r"tcp://(?:[^;]*;)?\[?([^\[\]]+?)\]?:(\d+)", endpoint)
        if m is None or m[1] == "*":
            return
        try:
            ipaddress.ip_address(m[1])
            return  # (a literal address: nothing to look up)
        except ValueError:
            pass
        try:
            await asyncio.get_running_loop().getaddrinfo(m[1], int(m[2]),
                                                         type=socket.SOCK_STREAM)
        except OSError as exc:  # (socket.gaierror)
            log.warning("parent rank %s at %s: its host %s does not resolve (%s): still "
                        "trying", self.parent, endpoint, m[1], exc.strerror or exc)

    def _open_up(self) -> None:
        """ZeroMQ: the DEALER to the parent, with a new identity, and its monitor."""
        from broker import overlay_zmq as zl

        assert self.ctx is not None and self.parent is not None
        s, monitor = zl.parent_socket(self.ctx, self.rank, self.endpoint(self.parent),
                                      self.curve, self.connect_timeout, self.ipv6)
        self._up = zl.ZmqSocket(s, self._from_parent, max_backlog=self.max_backlog,
                                on_stuck=self._parent_stuck)
        self._up_monitor = zl.ZmqSocket(monitor, self._on_up_monitor)
        self._up_handshaken = False

    def _close_up(self, linger_ms: int = 0) -> None:
        # (the monitor first: see close())
        if self._up_monitor is not None:
            if self._up is not None:
                self._up.sock.disable_monitor()
            self._up_monitor.close()
            self._up_monitor = None
        if self._up is not None:
            self._up.close(linger_ms=linger_ms)
            self._up = None

    def _hello_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"rank": self.rank, "process": self.process_id,
                                   "size": self.size}
        if self.hostname:
            payload["hostname"] = self.hostname
        if self.content_hash:
            payload["hash"] = self.content_hash
        return payload

    def _say_hello(self, counted: bool = True) -> None:
        """ZeroMQ: say hello to the parent, and make sure it is said again
        until the parent answers (:meth:`_hello_due`).  Not ``counted``: the
        one queued on the last dial never left (that link never connected)."""
        if counted:
            self._hellos += 1
        self._control_up("overlay.hello", self._hello_payload())
        if self._hello_timer is None:
            self._hello_timer = asyncio.get_running_loop().call_later(self._hello_retry,
                                                                      self._hello_due)

    def _hello_due(self) -> None:
        """No answer to our hello yet: say it again if the link to the parent is up.

        ZeroMQ drops what a ROUTER sends to a peer whose connection is gone,
        so the parent's answer can be lost -- the connection dropped after
        the parent read our hello, the parent restarted in between -- and
        the rank waited for ever.  A hello is said again only over a live
        link (one that completed its handshake): while there is none, the
        hello queued in the DEALER goes out once it connects, and repeating
        it would only queue more.  The waits double from
        :data:`HELLO_RETRY_FIRST` to :data:`HELLO_RETRY_MAX`; a parent that
        reads a hello again from the same identity answers it again
        (:meth:`_child_control`).  There is no join timeout: the ranks of an
        instance may start in any order, and a child waits for its parent,
        saying so (WARNING) if it has had no connection to it for
        :attr:`connect_timeout` seconds (``tbon.connect_timeout``)."""
        self._hello_timer = None
        if (self.parent_acked or self._closing or self._parent_gone or self._stopping_refused
                or self._up is None or self.parent is None):
            return
        loop = asyncio.get_running_loop()
        waited = loop.time() - self._hello_started
        endpoint = self.endpoint(self.parent)
        if self._up_handshaken:
            level = logging.DEBUG
            if self._hello_retry >= HELLO_RETRY_MAX and not self._hello_warned:
                self._hello_warned = True
                level = logging.WARNING
            # (the waits double between hellos only, not while there is no link)
            self._hello_retry = min(2 * self._hello_retry, HELLO_RETRY_MAX)
            self._say_hello()  # (and the timer, at the new wait)
            log.log(level, "parent rank %d at %s has not answered this rank's hello "
                    "(%d sent, the first %.1f s ago) over a live link: saying it again, "
                    "every %g s at most, until it does", self.parent, endpoint,
                    self._hellos, waited, HELLO_RETRY_MAX)
        elif (self._unreached_since is not None and not self._unreached_warned
              and self.connect_timeout > 0
              and loop.time() - self._unreached_since >= self.connect_timeout):
            self._unreached_warned = True
            log.warning("no connection to parent rank %d at %s after %.3g s (is it "
                        "running? is that its address?): still trying", self.parent,
                        endpoint, loop.time() - self._unreached_since)
        if self._hello_timer is None:
            self._hello_timer = loop.call_later(self._hello_retry, self._hello_due)

    def _dial_later(self, handshaken: bool) -> None:
        """ZeroMQ: the link to the parent failed or closed before the parent
        answered our hello: dial again (:meth:`_dial_again`) after
        ``RECONNECT_IVL_MS``, doubled for each dial in a row that completed
        no handshake, up to ``RECONNECT_IVL_MAX_MS``.  ``handshaken``: that
        link had completed its handshake, so the parent may have read our
        hello -- an outage of its own, warned about again if it lasts
        (:meth:`_hello_due`)."""
        from broker import overlay_zmq as zl

        if self._dial_timer is not None:
            return  # (one dial at a time)
        loop = asyncio.get_running_loop()
        if handshaken:
            self._unreached_since = loop.time()
            self._dial_wait = 0.0
        wait = self._dial_wait or zl.RECONNECT_IVL_MS / 1000
        self._dial_wait = min(2 * wait, zl.RECONNECT_IVL_MAX_MS / 1000)
        # (later: this runs inside a read of the monitor it closes)
        self._dial_timer = loop.call_later(wait, self._dial_again, handshaken)

    def _dial_again(self, handshaken: bool) -> None:
        """ZeroMQ: dial the parent again, from a new DEALER with a new
        identity, and say hello on it.

        ZeroMQ's reconnect is put off (:func:`~broker.overlay_zmq.parent_socket`):
        this is how a rank started before its parent, or whose parent
        restarts before answering, gets through.  A new DEALER rather than a
        new connect on the old one: nothing the old socket's monitor still
        reports can be taken for the new connection's, and after a link
        that closed following its handshake the identity must be new -- a
        parent that read our hello admitted the old identity, lost it with
        its connection, and drops what that identity sends from then on (it
        may be an old process resuming: :attr:`_cut_off`), so a hello said
        again from it was never answered.  The hello queued on a link that
        never connected went with it unsent, and is not counted again."""
        self._dial_timer = None
        if (self.parent_acked or self._closing or self._parent_gone or self._stopping_refused
                or self._up is None or self.parent is None):
            return
        if handshaken:  # (once a second at most: a parent dropping us in a loop)
            self._peer_log.log(logging.INFO, "redial",
                               "the link to parent rank %d at %s closed before it answered "
                               "this rank's hello: saying hello again on a new connection",
                               self.parent, self.endpoint(self.parent))
        self._close_up()
        self._open_up()
        self._say_hello(counted=handshaken)

    @property
    def parent_gone(self) -> bool:
        """This rank stops because its parent went: it was lost, or it
        stopped and told this rank to stop.  Not when the parent, still
        running, refused this rank's hello or admitted a newer process of
        it (:attr:`_parent_stays`): a launcher blames the rank above for a
        ``parent-gone``."""
        return self._parent_gone and not self._parent_stays

    def shutdown_children(self, failed: bool = False) -> None:
        """Tell every child to stop (it tells its own): sent once, before
        :meth:`close`, which lets it leave.  ``failed``: this rank stops
        because of a failure (its parent was lost), and so do they -- each
        exits 1, as it does, so that a supervisor restarts the whole subtree
        (``Restart=on-failure``), not only its top."""
        if self._shutdown_sent:
            return
        self._shutdown_sent = True
        payload: dict[str, Any] = {"rank": self.rank}
        if failed:
            payload["failed"] = True
        frames = codec.encode(Message(MsgType.CONTROL, "overlay.shutdown", payload))
        self._shutdown_answered = asyncio.get_running_loop().create_future()
        for child in sorted(self.hello_from):
            # (one that said goodbye stops already: a link torn under it is
            # no loss to it, and over ZeroMQ its close may be heard late)
            if self._send_child(child, frames) and child not in self._leaving:
                self._shutdown_unanswered.add(child)
        self._check_shutdown_answered()

    async def shutdown_heard(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until every child told to stop
        answered it, before :meth:`close` -- as a child waits for its
        goodbye's answer (:meth:`goodbye_heard`), and for the same reason:
        a child that wrote to this rank after its link closed (EPIPE) had
        its link torn down with the shutdown still unread, and stopped as
        if its parent were lost, exit 1 (a chain of 16 ranks stopped with
        status 1 one time in three).  Returns at once if none was told."""
        if not await _answered(self._shutdown_answered, timeout):
            log.info("child rank(s) %s did not answer this rank's shutdown within %.1f s: "
                     "their links are closed anyway",
                     ",".join(map(str, sorted(self._shutdown_unanswered))), timeout)

    def _shutdown_heard_from(self, child: int) -> None:
        """``child`` answered the shutdown, or went."""
        self._shutdown_unanswered.discard(child)
        self._check_shutdown_answered()

    def _check_shutdown_answered(self) -> None:
        fut = self._shutdown_answered
        if fut is not None and not fut.done() and not self._shutdown_unanswered:
            fut.set_result(None)

    def goodbye(self, why: str) -> None:
        """Tell the parent this rank stops on purpose (``why``: a signal,
        ``kvbroker shutdown``, ...), as Flux's ``overlay.goodbye``: it then
        logs the link's closing at INFO, and keeps WARNING for a child lost
        unexpectedly.  Sent once, before :meth:`close`, which lets it leave."""
        if (self._goodbye_sent or self.parent is None or not self.parent_acked
                or self._parent_gone):
            return
        self._goodbye_sent = True
        self._goodbye_answered = asyncio.get_running_loop().create_future()
        self._control_up("overlay.goodbye", {"rank": self.rank, "why": why})

    async def goodbye_heard(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until the parent answered our
        goodbye, before :meth:`close`: closing first could fail the parent's
        next write to us (EPIPE) before it read the goodbye, and the clean
        stop was logged as a loss.  Flux's goodbye is a request for the same
        reason.  Returns at once if no goodbye was said.

        No answer in time is a WARNING (Flux: an error, "goodbye timeout"):
        the parent, stopped or stuck, may then log this rank as lost, and
        an operator at the default level saw nothing of why (it was INFO).
        The rank still exits 0: it stopped as asked."""
        if not await _answered(self._goodbye_answered, timeout):
            log.warning("parent rank %s did not answer this rank's goodbye within %.1f s: "
                        "its link is closed anyway (the parent may log this rank as lost)",
                        self.parent, timeout)

    def _goodbye_over(self) -> None:
        fut = self._goodbye_answered
        if fut is not None and not fut.done():
            fut.set_result(None)

    def close(self) -> None:
        # A child told to stop that answered, or that said goodbye, and
        # whose link has not closed yet: it stops, and is said so now.  Its
        # link's close, after this, was no longer heard, and the line went
        # missing whenever a child answered a shutdown and this rank
        # closed first (t0025: one stop in a few hundred).
        for child in sorted(self.hello_from):
            left = self._leaving.get(child)
            if left is not None or (self._shutdown_sent
                                    and child not in self._shutdown_unanswered):
                self._say_stopped(child, left or "this rank told it to")
        self._closing = True
        if self._check_timer is not None:
            self._check_timer.cancel()
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._dial_timer is not None:
            self._dial_timer.cancel()
        if self._resolving is not None:
            self._resolving.cancel()
        if self._streams is not None:
            self._streams.close(flush=self._shutdown_sent, flush_up=self._goodbye_sent)
        # A monitor is stopped before the socket we read it on is closed:
        # ZeroMQ's I/O thread sends each event to that socket with a
        # blocking send, holding the monitor's lock, so an event (a parent's
        # DISCONNECTED) raised once our end is gone blocks it for ever, and
        # disable_monitor() then waits for the lock: a rank that never exits.
        if self._monitor is not None:
            if self._down is not None:
                self._down.sock.disable_monitor()
            self._monitor.close()
        # A shutdown just queued for the children must still leave (ZeroMQ
        # drops unsent messages of a socket closed with linger 0).
        if self._down is not None:
            self._down.close(linger_ms=1000 if self._shutdown_sent else 0)
        self._close_up(linger_ms=1000 if self._goodbye_sent else 0)
        if self._auth is not None:
            self._auth.stop()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)  # our sockets are closed; nothing left may block it
        if self._ipc_bound is not None:
            unlink_socket_file(*self._ipc_bound)
            self._ipc_bound = None

    # ------------------------------------------------------------ links

    def _send_parent(self, frames: list[codec.Frame], hello: bool = False) -> bool:
        """Send to the parent; False if it cannot be (never yet: this rank
        has held :data:`MAX_HELD_UP` messages for a parent that has not
        answered its hello).

        ZeroMQ: what is sent before the parent answers this rank's hello is
        held here and sent on once it does (:meth:`_parent_answered`).  A
        rank's modules start while it still dials its parent, and what they
        sent went into that dial's DEALER -- closed with it when the dial
        failed (:meth:`_dial_again`), so a request a module made as it
        started was lost without a word, its sender waiting for ever (a
        review's find: a rank started before its parent).  Only the
        ``hello`` goes at once, on each dial's DEALER."""
        if self._up is not None and not (hello or self.parent_acked):
            if len(self._held_up) >= MAX_HELD_UP:
                return False
            self._held_up.append(frames)
            return True
        self._sent_tick = self._tick  # (no keepalive due this tick)
        if self.tracer is not None and self.parent is not None:
            self.tracer("tx", self.parent, frames, None)
        if self._up is not None:
            self._up.send(frames)
        elif self._streams is not None and self._streams.up is not None:
            self._streams.up.send(frames)
        return True

    def _parent_answered(self) -> None:
        """The parent answered this rank's hello: send on, in order, what
        was held for it (:meth:`_send_parent`)."""
        held, self._held_up = self._held_up, []
        for frames in held:
            self._send_parent(frames)

    def _send_child(self, child: int, frames: list[codec.Frame]) -> bool:
        if self.tracer is not None:
            self.tracer("tx", child, frames, None)
        if self._down is not None:
            ident = self._child_ident.get(child)
            if ident is None:
                return False
            error = self._down.send_to(ident, frames)
            if error is not None:  # EHOSTUNREACH: the child is gone
                if ident not in self._send_failed:  # once per link, not per message
                    self._send_failed.add(ident)
                    # (expected of a child that said goodbye, or of one we
                    # told to stop: not worth a warning at every clean stop;
                    # nor of one whose link closed, lost once its last
                    # messages are read)
                    expected = (self._shutdown_sent or child in self._leaving
                                or ident in self._closed)
                    log.log(logging.INFO if expected else logging.WARNING,
                            "cannot send to rank %d: %s", child, error)
                return False
            return True
        conn = self._child_conns.get(child)
        if conn is None or conn.transport is None or conn.transport.is_closing():
            return False
        conn.send(frames)
        return True

    # ------------------------------------------------------------ sending

    def send(self, rank: int, msg: Message) -> bool:
        """Send to a neighbour; False if it is not (or no longer) connected.

        Raises :class:`Oversized` instead of sending a message bigger than
        the neighbour takes (it would drop it, and the sender would wait),
        :class:`Unencodable` for one whose payload cannot be packed."""
        try:
            frames = codec.encode(msg)
        except TypeError as exc:
            raise Unencodable(str(exc)) from None
        if codec.may_exceed_link(frames):
            size = codec.frames_size(frames)
            if size > self.max_message:
                raise Oversized(size, self.max_message)
        if rank == self.parent:
            return self._send_parent(frames)
        if rank in self.hello_from:
            return self._send_child(rank, frames)
        return False

    def broadcast_down(self, msg: Message) -> None:
        """Forward an event to every child, encoding it once."""
        if not self.hello_from:
            return
        frames = msg.wire
        if frames is None:
            frames = msg.wire = codec.encode(msg)
        if codec.may_exceed_link(frames):
            size = codec.frames_size(frames)
            if size > self.max_message:  # (event.pub refuses such an event)
                self.dropped += 1
                log.error("cannot forward %s: %d bytes exceed tbon.max-message (%d)", msg,
                          size, self.max_message)
                return
        for child in self.hello_from:
            self._send_child(child, frames)

    def _control_up(self, topic: str, payload: dict[str, Any]) -> None:
        self._send_parent(codec.encode(Message(MsgType.CONTROL, topic, payload)),
                          hello=topic == "overlay.hello")

    # ------------------------------------------------------------ receiving

    def _decode(self, frames: list[bytes], origin: str) -> Message | None:
        try:
            return codec.decode(frames)
        except ProtocolError as exc:
            self.dropped += 1
            self._peer_log.log(logging.WARNING, "malformed",
                               "dropping malformed message from %s: %s", origin, exc)
            return None

    def _on_up_monitor(self, parts: list[bytes]) -> None:
        """An event of the link to the parent: it closed, or a CURVE
        handshake with the parent succeeded or was refused.

        Refused :data:`REFUSALS_TO_GIVE_UP` times in a row (none succeeded
        in between) before the parent answered our hello, the rank stops
        with :data:`EXIT_REFUSED`: its key pair is not the instance's, and
        retrying every 20 ms for ever (as it did) helped no one.  Not at the
        first refusal: a parent going down in the middle of a handshake
        fails that one, and a restarting parent must not stop its children
        (a restarted parent with the instance's keys refuses none; a
        handshake that timed out, a frozen parent, is not counted)."""
        from broker import overlay_zmq as zl

        disconnected, event, value = zl.monitor_event(parts)
        if disconnected or event == zl.CLOSED:  # (this dial is over: see UP_MONITORED)
            if self._up is not None:
                self._up.read_all()  # (its last messages first: maybe a shutdown)
            handshaken, self._up_handshaken = self._up_handshaken, False
            if not self.parent_acked:
                self._dial_later(handshaken)
                return
            self._parent_lost(
                "its link closed: the parent stopped, or dropped this rank -- after "
                f"{zl.HEARTBEAT_TIMEOUT_MS // 1000} s without an answer to its heartbeats "
                "(was this rank, or its host, stopped that long?), or by `kvbroker overlay "
                "disconnect`")
            return
        if event == zl.HANDSHAKE_SUCCEEDED:
            self._refused_by_parent = 0
            self._up_handshaken, self._unreached_since = True, None
            self._unreached_warned = False
            return
        # (no CURVE, no key to refuse: a parent that closes connections as
        # it accepts them -- dying, restarting -- is dialled again for ever)
        why = zl.refusal(event, value) if self.curve is not None else None
        if why is None or self.parent is None or self.parent_acked or self._stopping_refused:
            return  # (once joined, a link that fails is a lost parent: _parent_lost)
        self._refused_by_parent += 1
        endpoint = self.endpoint(self.parent)
        if self._refused_by_parent == 1:
            # (said at the first: "giving up after 5" read as given up, by a
            # rank that then went on waiting -- its parent had gone meanwhile)
            log.warning("parent rank %d at %s refused this rank's CURVE handshake (%s); "
                        "this rank stops (exit status %d) if %d in a row are refused "
                        "before it joins", self.parent, endpoint, why, EXIT_REFUSED,
                        REFUSALS_TO_GIVE_UP)
        if self._refused_by_parent >= REFUSALS_TO_GIVE_UP:
            self._stopping_refused = True
            if self.on_stop is not None:
                self.on_stop(f"parent rank {self.parent} at {endpoint} refused this rank's "
                             f"CURVE key {self._refused_by_parent} times in a row ({why}); "
                             "every rank needs the instance's key pair (this rank's "
                             "curve_cert must be the same key file as its parent's)",
                             EXIT_REFUSED)
            return
    def _on_monitor(self, parts: list[bytes]) -> None:
        """An event of the children's socket: a connection accepted or
        closed, or a failed CURVE handshake -- wrong keys (ZAP refused them,
        or they were not made for this instance's)."""
        from broker import overlay_zmq as zl

        disconnected, event, value = zl.monitor_event(parts)
        if event == zl.ACCEPTED:
            self._fd_conns.setdefault(value, deque()).append(zl.Connection(value))
            return
        if disconnected:
            # The oldest connection on that number: the number alone may
            # name a newer one by now (see overlay_zmq.Connection)
            conns = self._fd_conns.get(value)
            conn = conns.popleft() if conns else None
            if conns is not None and not conns:
                del self._fd_conns[value]
            if conn is not None and conn.ident is not None:
                self._conn_closed(conn)
            return
        self.refused += 1
        # Once, not per retry: a refused peer dials again within 0.2 s (a
        # rank gives up after a few; anything else may go on for ever).
        self._refusal_log.log(
            logging.WARNING, "refused",
            "refused an overlay connection: %s -- a rank started with another key "
            "file, or not a rank (%d refused so far; overlay.refused in `kvbroker "
            "stats broker`; logged again at most every %d s)",
            zl.refusal(event, value, server=True) or f"ZeroMQ handshake event {event:#x}",
            self.refused, REFUSAL_LOG_INTERVAL)

    def _hello_rank(self, frames: list[bytes], ident: bytes | None = None) -> int | None:
        """The rank a new connection's first message says hello as, if it is
        one of our children's, from its host; None (counted, logged) for
        anything else -- a hello from another rank, or from the wrong host
        (:meth:`_wrong_host`), on ZeroMQ connection ``ident`` is also
        answered (:meth:`_refuse_hello`)."""
        msg = self._decode(frames, "an unidentified peer")  # counts garbage
        rank = None
        if msg is not None and msg.type == MsgType.CONTROL and msg.topic == "overlay.hello":
            try:
                payload = msg.payload  # (decoded on first use)
            except ProtocolError:
                payload = None
            if isinstance(payload, dict):
                rank = payload.get("rank")
        if type(rank) is int and rank in self.children:  # (not True, 1.0 or a list)
            wrong_size = self._wrong_size(payload)
            wrong_hash = None if wrong_size else self._wrong_hash(payload)
            why = wrong_size or wrong_hash or self._wrong_host(rank, payload)
            if why is None:
                return rank
            self.dropped += 1
            # (as Flux: an error, but at most once a second: how many hellos a
            # peer with the keys sends is its choice)
            self._peer_log.log(logging.ERROR, "wrong-size" if wrong_size else
                               "wrong-hash" if wrong_hash else "wrong-host",
                               "refusing overlay peer: a "
                               "hello as rank %d%s: %s", rank,
                               f" from {hello_hostname(payload)}"
                               if hello_hostname(payload) else "", why)
            if ident is not None:
                self._refuse_hello(ident, why)
            return None
        if msg is not None:
            self.dropped += 1
            if type(rank) is int:
                self._peer_log.log(
                    logging.WARNING, "not-a-child",
                    "refusing overlay peer: a hello from rank %s, which is not a child of "
                    "rank %d (its children: %s); check the bootstrap file's parent/connect "
                    "entries", rank, self.rank, sorted(self.children) or "none")
                if ident is not None:
                    self._refuse_hello(ident, self._not_a_child(rank))
            else:
                self._peer_log.log(logging.WARNING, "not-a-hello", "refusing overlay peer: "
                                   "its first message is not a child's hello")
        return None

    def _wrong_size(self, payload: Any) -> str | None:
        """Why a child's hello is refused for the instance size it says
        (``size``: its bootstrap file lists another number of hosts), or
        None.  Admitted, a rank whose file is shorter has no children where
        this instance has some -- they could never join, yet rank 0 said
        ``ready`` -- and one whose file is longer serves a size, and hosts,
        of its own.  A hello that says no size is not judged."""
        size = payload.get("size")
        if type(size) is not int or size == self.size:
            return None
        return (f"this instance has {self.size} ranks, this rank's bootstrap file lists "
                f"{size} hosts: every host needs the same bootstrap file")

    def _wrong_hash(self, payload: Any) -> str | None:
        """Why a child's hello is refused for the ``content.hash`` it says
        (``hash``: ``kvbroker broker -S`` sets it for its rank alone), or
        None.  Every rank's content store hands out blobrefs of its own
        hash, but only rank 0 keeps the blobs, named by rank 0's: admitted,
        a ``sha1`` rank under a ``sha256`` rank 0 answered each store with
        a ``sha1-`` blobref rank 0 did not know -- once that rank's cache
        let the blob go, the client's blobref named nothing.  A rank checks
        its children against its own hash, so every rank of the tree has
        rank 0's.  A hello that says no hash is not judged."""
        theirs = payload.get("hash")
        if not isinstance(theirs, str) or not self.content_hash or theirs == self.content_hash:
            return None
        return (f"this rank's content.hash is {theirs[:40]!r}, its parent's (rank "
                f"{self.rank}) is {self.content_hash!r}: every rank needs the instance's "
                f"content.hash (-S content.hash={self.content_hash}), as only rank 0 keeps "
                "the blobs, named by its hash")

    def _wrong_host(self, rank: int, payload: Any) -> str | None:
        """Why a hello as child ``rank`` is refused for the host it came
        from, or None to admit it.  With a bootstrap file (:attr:`hosts`),
        a hello whose ``hostname`` is not the host of ``rank``'s entry --
        compared as :meth:`broker.bootstrap.Bootstrap.rank_of` finds a
        rank -- comes from a process started with the wrong ``--rank``, or
        on the wrong host (Flux's check, flux-core#6389): admitted, it
        would take the running rank's place (the newest hello wins).  Not
        judged, so admitted: a hello that names no host, or an entry or
        name that no host can be told by -- an IP address, ``localhost``
        (:func:`broker.bootstrap.judged_by_name`)."""
        host = hello_hostname(payload)
        if self.hosts is None or host is None or not wrong_host(self.hosts, rank, host):
            return None
        return (f"{self.hosts[rank]} is configured as rank {rank}: mismatched config? "
                f"(this hello came from {host}: a wrong --rank, a rank started on the "
                "wrong host, or another bootstrap file; an entry that is not the host's "
                f"own name needs -S hostname={self.hosts[rank]} on that rank)")

    def _not_a_child(self, rank: int) -> str:
        """Why a hello as ``rank``, not one of our children, is refused."""
        if 0 <= rank < self.size:
            where = (f"its parent is rank {topology.parent_of(rank, self.fanout)}"
                     if rank else "it has no parent")
        else:
            where = "it is not a rank of this instance"
        return (f"rank {rank} is not a child of rank {self.rank} in this instance's "
                f"topology (size {self.size}, fanout {self.fanout}: {where}): check the "
                "bootstrap file")

    def _refuse_hello(self, ident: bytes, why: str) -> None:
        """Tell connection ``ident``, whose hello this rank refuses, why
        (``overlay.refused``): its process stops, saying it (status 1).
        Without an answer a rank started with a bootstrap file that names
        the wrong parent waited for ever, saying nothing.

        Only over CURVE (``tcp``), where the ZAP handler admitted the peer
        with the instance's key pair: a peer that only reached an ``ipc``
        socket is answered nothing, as it was (its socket is the owner's
        only, but what reaches it is not known to be a rank).  Each
        identity is answered once, and at most
        :data:`REFUSED_HELLOS_PER_SECOND` a second in all: how many hellos
        a peer with the keys sends is its choice."""
        if self.curve is None or self._down is None or ident in self._hello_refused:
            return
        now = int(asyncio.get_running_loop().time())
        second, sent = self._refusals_at
        if second == now and sent >= REFUSED_HELLOS_PER_SECOND:
            return
        self._refusals_at = (now, sent + 1 if second == now else 1)
        self._hello_refused[ident] = None
        if len(self._hello_refused) > CUT_OFF_KEPT:
            del self._hello_refused[next(iter(self._hello_refused))]
        refused = Message(MsgType.CONTROL, "overlay.refused", {"rank": self.rank, "why": why})
        self._down.try_send_to(ident, codec.encode(refused))

    def _conn_closed(self, conn: Connection) -> None:
        """The connection a child's identity spoke on closed: lose that
        child, once what the connection sent before is read (:meth:`_reap`,
        at the next loop turn: this may run inside a read of the children's
        socket, from :meth:`_claim`, which must not read it again)."""
        ident = conn.ident
        assert ident is not None
        if self._ident_conn.get(ident) is conn:
            del self._ident_conn[ident]
        if self._down is not None:
            self._down.drop_backlog(ident)
            self._closed.setdefault(ident, self._down.received)
        if not self._reap_due:  # (later: this may run inside a read of the socket)
            self._reap_due = True
            asyncio.get_running_loop().call_soon(self._reap)

    def _reap(self) -> None:
        """Lose the children whose connections closed (:attr:`_closed`) --
        once what each sent before is read.

        The monitor's DISCONNECTED may come before a connection's last
        messages are read from the children's socket (a goodbye then read
        as a stranger's made a clean stop a loss), so the socket is read
        first: :data:`~broker.overlay_zmq.BATCH` messages per loop turn,
        not all at once (a child that died with thousands queued held the
        rank that long in one callback), until it is empty -- or until,
        since the DISCONNECTED, it has handed out
        :data:`~broker.overlay_zmq.HWM` messages per connection that may
        have any: it takes one from each in turn, and a connection has at
        most that many queued, so the closed one's are read by then even if
        the others keep it busy for ever."""
        from broker import overlay_zmq as zl

        self._reap_due = False
        down = self._down
        if down is None:
            self._closed.clear()
            return
        more = down.read_slice()
        # (+ BATCH: a DISCONNECTED handled inside a read noted the count
        # before that read's messages were added to it)
        enough = zl.HWM * (sum(map(len, self._fd_conns.values())) + 1) + zl.BATCH
        for ident, since in list(self._closed.items()):
            if more and down.received - since < enough:
                continue
            del self._closed[ident]
            child = self._ident_child.pop(ident, None)
            if child is not None:  # (a replaced connection was forgotten already)
                del self._child_ident[child]
                # What that identity sends from now on is an old process's:
                # one stopped past the heartbeat timeout (SIGSTOP) runs again
                # -- a DEALER of an older kvbroker, whose ZeroMQ reconnect was
                # on, dialled again before its loop read that its link closed,
                # and its keepalive was a stranger's WARNING
                self._cut(ident)
                self._lose_child(child, "its connection closed, or it answered no "
                                 f"heartbeat for {zl.HEARTBEAT_TIMEOUT_MS // 1000} s")
        if self._closed and not self._reap_due:
            self._reap_due = True
            asyncio.get_running_loop().call_soon(self._reap)

    def _claim(self, ident: bytes, fd: int) -> Connection:
        """The connection the first message of identity ``ident``, read
        from file descriptor ``fd``, came on, marked as ``ident``'s.

        Every monitor event queued by now is handled first: the
        DISCONNECTED of each older connection on that number was queued
        before this message (see :class:`~broker.overlay_zmq.Connection`),
        so the one connection left on it is this message's.  Without that,
        a DISCONNECTED handled after a new connection's hello on the same
        number dropped the newcomer -- a rank restarted at once, or
        another child -- in place of the child it was about."""
        from broker import overlay_zmq as zl

        if self._monitor is not None:
            self._monitor.read_all()
        conns = self._fd_conns.setdefault(fd, deque())
        while len(conns) > 1:  # (no DISCONNECTED will come for these: never seen)
            stale = conns.popleft()
            if stale.ident is not None:
                self._conn_closed(stale)
        if not conns:  # (not seen accepted: never seen either)
            conns.append(zl.Connection(fd))
        conn = conns[0]
        if conn.ident is not None and conn.ident != ident:
            # That identity's hello was read after its connection closed and
            # this one was accepted on the number: it is gone.
            self._conn_closed(conn)
        conn.ident = ident
        conn.inode = zl.connection_inode(fd)
        return conn

    def _from_child(self, parts: list[bytes]) -> None:
        ident, frames = parts[0], parts[1:]
        child = self._ident_child.get(ident)
        if child is None:  # a new connection (or one replaced since): only a hello
            if ident in self._cut_off:
                self.dropped += 1
                return
            child = self._hello_rank(frames, ident)
            if child is None:
                return
            self._admit(child, ident, hello_process(codec.decode(frames).payload))
        self._child_frames(child, frames)

    def _admit(self, child: int, ident: bytes, process: str | None) -> None:
        """ZeroMQ: connection ``ident`` said hello as ``child``, from
        ``process``.  If an older connection of that rank is still open, the
        newest hello wins (see the module docstring): the old process is
        told to stop, and the requests it held are answered as for a lost
        rank.  If the hello names the process the old connection's did, it
        is that process on a new connection (the answer to its hello was
        lost with the old one: :meth:`_dial_again`), not a replacement: no
        one to stop, nothing counted."""
        stuck = self._losing.pop(child, None)
        if stuck is not None:  # (the old link was dropped this turn: lose it first)
            self._lose_child(child, stuck, True)
        old = self._child_ident.get(child)
        if old is not None:
            if self._same_process(child, process):
                log.info("rank %d said hello again on a new connection: dropping its old "
                         "one", child)
            else:
                self.replaced += 1
                # (counted as a rejoin when its hello is read, next)
                self._rejoins.setdefault(child, _Rejoins()).replaced += 1
                # (throttled: each new connection of a peer holding the keys
                # says it -- as many lines as it likes, otherwise)
                self._peer_log.log(logging.WARNING, "hello-again", "rank %d said hello "
                                   "again from a new process: dropping its old connection",
                                   child)
                replaced = Message(MsgType.CONTROL, "overlay.shutdown",
                                   {"rank": self.rank, "replaced": True})
                assert self._down is not None
                # (if that connection is gone already, there is no one to tell;
                # what waited for it goes, so the notice is not held behind it)
                self._down.drop_backlog(old)
                self._down.send_to(old, codec.encode(replaced))
            # (popped: a send to it may have dropped it as stuck meanwhile)
            self._ident_child.pop(old, None)
            self._send_failed.discard(old)
            self._cut(old)
            self._losing.pop(child, None)  # (lost here, as replaced)
            self._lose_child(child, REPLACED, quiet=True)
        self._child_ident[child] = ident
        self._ident_child[ident] = child
        assert self._down is not None
        self._ident_conn[ident] = self._claim(ident, self._down.last_fd)

    def _cut(self, ident: bytes) -> None:
        """Remember that this rank cut link ``ident`` off (:attr:`_cut_off`)."""
        self._cut_off[ident] = None
        if len(self._cut_off) > CUT_OFF_KEPT:
            del self._cut_off[next(iter(self._cut_off))]

    def _child_stuck(self, ident: bytes, queued: int) -> None:
        """ZeroMQ: a child left more than ``tbon.max-backlog`` bytes unread
        (a stopped rank): drop it as a stream link does.  Its connection is
        hung up, so the process, if it ever runs again, finds its parent
        lost and stops (exit 1), as its own children then do."""
        child = self._ident_child.pop(ident, None)
        if child is None:
            return
        del self._child_ident[child]
        self._cut(ident)
        self._zmq_slow += 1
        log.warning("child rank %d does not read its link (%d bytes queued, "
                    "tbon.max-backlog): dropping it", child, queued)
        conn = self._ident_conn.pop(ident, None)
        if conn is not None:
            from broker.overlay_zmq import hang_up

            conn.ident = None  # (forgotten already: its DISCONNECTED has nothing to do)
            hang_up(conn.fd, conn.inode)
        # (later: this runs inside a send, maybe a broadcast to the children)
        self._losing[child] = "it did not read its link (tbon.max-backlog)"
        asyncio.get_running_loop().call_soon(self._lose_stuck, child)

    def _lose_stuck(self, child: int) -> None:
        """The loss :meth:`_child_stuck` put off, unless :meth:`_admit` ran it."""
        why = self._losing.pop(child, None)
        if why is not None:
            self._lose_child(child, why, True)

    def disconnect_child(self, child: int, why: str) -> bool:
        """Cut connected child ``child`` off (``kvbroker overlay disconnect``,
        as Flux's): its link is closed at once, its subtree is lost -- what
        was in flight to it is answered ``EHOSTUNREACH``, and so is what is
        sent to it from now on -- and the process, if it ever runs again,
        finds its parent gone and stops (exit 1).  For a torpid rank that
        holds its subtree's requests.  False if it is not connected."""
        if child not in self.hello_from:
            return False
        conn = self._child_conns.pop(child, None)
        if conn is not None:  # a stream link (its connection_lost then finds it gone)
            if conn.transport is not None:
                conn.transport.abort()
        else:
            ident = self._child_ident.pop(child, None)
            if ident is not None:
                del self._ident_child[ident]
                self._send_failed.discard(ident)
                self._cut(ident)
                zconn = self._ident_conn.pop(ident, None)
                if self._down is not None:
                    self._down.drop_backlog(ident)
                if zconn is not None:
                    from broker.overlay_zmq import hang_up

                    zconn.ident = None  # (forgotten already, as above)
                    hang_up(zconn.fd, zconn.inode)
        log.warning("disconnecting child rank %d (%s): requests to its subtree are "
                    "answered EHOSTUNREACH", child, why)
        self._lose_child(child, f"disconnected: {why}", warned=True)
        return True

    def _parent_stuck(self, _ident: bytes, queued: int) -> None:
        """ZeroMQ: the parent left more than ``tbon.max-backlog`` bytes unread."""
        self._zmq_slow += 1
        log.warning("the parent does not read its link (%d bytes queued, tbon.max-backlog): "
                    "dropping it", queued)
        asyncio.get_running_loop().call_soon(self._parent_lost, "it did not read its link")

    def _from_child_conn(self, conn: StreamConn, frames: list[bytes]) -> None:
        """A stream link: the first message must be the hello of one of our children."""
        if conn.rank is None:
            rank = self._hello_rank(frames)
            if rank is None or rank in self._child_conns:
                if rank is not None:
                    self.dropped += 1
                    self._peer_log.log(logging.WARNING, "connected-already", "refusing "
                                       "overlay peer: rank %d is connected already", rank)
                if conn.transport is not None:
                    conn.transport.close()
                return
            conn.rank = rank
            self._child_conns[rank] = conn
        self._child_frames(conn.rank, frames)

    def _child_lost(self, conn: StreamConn) -> None:
        if conn.rank is not None and self._child_conns.get(conn.rank) is conn:
            del self._child_conns[conn.rank]
            why = ("its connection closed" if conn.lost_error is None
                   else f"its connection failed: {conn.lost_error}")
            self._lose_child(conn.rank, why)

    def _host_of(self, child: int) -> str:
        """`` on HOST``, the host ``child`` ran on when not this one's, as
        overlay status names it (across hosts, the machine an operator must
        look at); else nothing."""
        host = self._child_host.get(child)
        return f" on {host}" if host and host != self.hostname else ""

    def _say_stopped(self, child: int, why: str) -> None:
        """INFO: ``child`` stopped on purpose (``why``), not lost."""
        log.info("child rank %d%s stopped (%s)", child, self._host_of(child), why)

    def _lose_child(self, child: int, why: str, warned: bool = False,
                    quiet: bool = False) -> None:
        """A child's link closed (``why``): its subtree is gone (it stops
        when it loses us, and takes its own children along); answer what it
        owed.  A child that said goodbye, or that we told to stop, stopped:
        INFO.  Any other loss (a crash, a kill, a host gone) is WARNING,
        with why -- both were INFO, so an operator at the default level
        never saw a rank die (``warned``: a WARNING said so already;
        ``quiet``: no line at all, a throttled WARNING stands for it)."""
        self.hello_from.discard(child)
        self._heard.pop(child, None)
        self._seen_at.pop(child, None)
        self.torpid.pop(child, None)
        self._shutdown_heard_from(child)  # (gone: no answer will come)
        left = self._leaving.pop(child, None)
        if left is not None:
            self._stopped[child] = left
        elif self._shutdown_sent:
            self._stopped[child] = "this rank told it to"
        else:
            self._stopped.pop(child, None)
        if left is None and not self._shutdown_sent and why != REPLACED:
            self._lost[child] = why or "its link was dropped"
        else:
            self._lost.pop(child, None)
        if self._closing:
            return
        on = self._host_of(child)
        if left is not None or self._shutdown_sent:
            self._say_stopped(child, left or "this rank told it to")
        elif quiet:
            pass
        elif warned:
            log.info("lost child rank %d%s%s", child, on, f": {why}" if why else "")
        else:
            log.warning("lost child rank %d%s unexpectedly: %s (requests in flight to its "
                        "subtree are answered EHOSTUNREACH)", child, on, why)
        self.router.child_lost(child)

    def _child_frames(self, child: int, frames: list[bytes]) -> None:
        self._heard[child] = self._tick  # any message counts (:meth:`_check_torpid`)
        msg = self._decode(frames, f"rank {child}")
        if msg is None:
            return
        if self.tracer is not None:
            self.tracer("rx", child, frames, msg)
        if msg.type == MsgType.CONTROL:
            self._child_control(child, msg)
        elif child not in self.hello_from:
            self.dropped += 1
            self._peer_log.log(logging.WARNING, "before-hello",
                               "dropping message from rank %d before its hello", child)
        else:
            self.router.from_rank(child, msg)

    def _same_process(self, child: int, process: str | None) -> bool:
        """``process`` (a hello's) is the one ``child``'s last admitted hello named."""
        return process is not None and self._child_process.get(child) == process

    def _child_control(self, child: int, msg: Message) -> None:
        if msg.topic == "overlay.hello":
            if child not in self.hello_from:
                self.router.child_joined(child)
                self._stopped.pop(child, None)
                self._lost.pop(child, None)
                process = hello_process(msg.payload)
                # a new process of it (see _rejoins), not the same one on a new link
                host = hello_hostname(msg.payload)
                if child in self._joined and not self._same_process(child, process):
                    again = self._rejoins.setdefault(child, _Rejoins())
                    again.times += 1
                    again.at = asyncio.get_running_loop().time()
                    # (the recovery, in the log beside the loss: dmesg --all)
                    log.info("child rank %d%s rejoined: a new process (%d since this rank "
                             "started)", child, f" on {host}" if host else "", again.times)
                self._joined.add(child)
                if host is not None:
                    self._child_host[child] = host
                else:  # (not the host of the process it replaced)
                    self._child_host.pop(child, None)
                if process is None:
                    self._child_process.pop(child, None)
                else:
                    self._child_process[child] = process
            self.hello_from.add(child)
            reply = Message(MsgType.CONTROL, "overlay.hello", {"rank": self.rank,
                                                                "size": self.size})
            self._send_child(child, codec.encode(reply))
        elif msg.topic == "overlay.ready":
            self.ready_from.add(child)
            self._check_ready()
        elif msg.topic == "overlay.shutdown":  # (a child's answer to ours)
            self._shutdown_heard_from(child)
        elif msg.topic == "overlay.goodbye" and child in self.hello_from:
            why = msg.payload.get("why") if isinstance(msg.payload, dict) else None
            self._leaving[child] = why[:200] if isinstance(why, str) else "it said goodbye"
            self._shutdown_heard_from(child)  # (it stops already: no need to wait for it)
            # answered: the child closes its link once it knows we read this
            self._send_child(child, codec.encode(Message(MsgType.CONTROL, "overlay.goodbye",
                                                         {"rank": self.rank})))

    def _from_parent(self, parts: list[bytes]) -> None:
        msg = self._decode(parts, "parent")
        if msg is None:
            return
        if self.tracer is not None and self.parent is not None:
            self.tracer("rx", self.parent, parts, msg)
        if msg.type == MsgType.CONTROL:
            if msg.topic == "overlay.hello":
                if not self.parent_acked and self._hellos > 1:
                    log.info("parent rank %s answered this rank's hello (%d sent)",
                             self.parent, self._hellos)
                self.parent_acked = True
                self._parent_answered()
                if self._hello_timer is not None:
                    self._hello_timer.cancel()
                    self._hello_timer = None
                if not self.admitted.done():
                    self.admitted.set_result(None)
                self._check_ready()
            elif msg.topic == "overlay.goodbye":
                self._goodbye_over()
            elif (msg.topic == "overlay.refused" and not self.parent_acked
                  and self.on_stop is not None and not self._parent_gone
                  and self.parent is not None):
                self._parent_gone = self._parent_stays = True  # (never admitted: no goodbye)
                why = msg.payload.get("why") if isinstance(msg.payload, dict) else None
                self.on_stop(f"parent rank {self.parent} at {self.endpoint(self.parent)} "
                             "refused this rank's hello: "
                             f"{why[:300] if isinstance(why, str) else 'no reason given'}", 1)
            elif msg.topic == "overlay.shutdown" and self.on_stop is not None:
                # answered at once: the parent closes our link once it knows
                # we read this (:meth:`shutdown_heard`)
                self._control_up("overlay.shutdown", {"rank": self.rank})
                self._parent_gone = True  # (it stops: it knows why we do)
                if isinstance(msg.payload, dict) and msg.payload.get("replaced"):
                    self._parent_stays = True
                    self.on_stop(f"rank {self.parent} admitted a newer rank {self.rank} "
                                 "process in this one's place", 1)
                    return
                if isinstance(msg.payload, dict) and msg.payload.get("failed"):
                    self.on_stop(f"rank {self.parent} stopped after a failure", 1)
                    return
                self.on_stop(None, 0)
            return
        assert self.parent is not None
        if msg.type == MsgType.EVENT:
            msg.wire = parts  # forwarded to children and local clients as received
        self.router.from_rank(self.parent, msg)

    def _parent_lost(self, why: str) -> None:
        """The link to the parent broke without a shutdown: stop (see the
        module's docstring).  Before the parent answered our hello this is
        still start-up, where a ZeroMQ link may come and go (the rank dials
        again: :meth:`_dial_again`).  A stream link is connected once, and a
        parent closes it before answering our hello only when it refused it (another
        process of this rank still holds its link, or the hello was not a
        child's) or stopped: nothing would ever answer, and the rank waited
        for ever, silent.  It stops with status 1, saying why, as a Flux
        broker does when its hello is refused -- a supervisor may try again
        once the old process is gone."""
        self._goodbye_over()  # (no answer will come)
        if self._closing or self.parent is None:
            return
        if not self.parent_acked:
            if self._streams is None:
                return
            self._parent_gone = True
            if self.on_stop is not None:
                self.on_stop(f"parent rank {self.parent} closed this rank's link before "
                             "answering its hello: it refused it (is another process of "
                             f"rank {self.rank} still connected to it? its log says) "
                             "or it stopped", 1)
            return
        self._parent_gone = self.parent_lost = True
        if self.on_stop is not None:
            self.on_stop(f"lost the connection to parent rank {self.parent} ({why})", 1)

    def _check_ready(self) -> None:
        if self._sent_ready or not self.parent_acked or self.ready_from != self.children:
            return
        self._sent_ready = True
        if self.parent is not None:
            self._control_up("overlay.ready", {"rank": self.rank})
        if not self.ready.done():
            self.ready.set_result(None)


async def _answered(fut: asyncio.Future[None] | None, timeout: float) -> bool:
    """Whether ``fut`` (an answer awaited: a goodbye's, a shutdown's) is set
    within ``timeout`` seconds; True at once if there is none to wait for."""
    if fut is None or fut.done():
        return True
    try:
        await asyncio.wait_for(asyncio.shield(fut), timeout)
    except TimeoutError:
        return False
    return True
