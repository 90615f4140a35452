"""Routing of requests, responses and events inside one rank.

* A request entering the rank (from a local client or module, or from a
  neighbouring rank) gets its sender pushed on its ``route`` stack, then goes
  to the local service (nodeid ANY with a local provider, or this rank), up
  to the parent, or down towards the target rank.
* A request for a module being reloaded on this rank waits until the new
  one has started (:mod:`broker.reloadhold`).
* A response pops the top of its route stack and goes to that hop.
* An event is delivered to every local subscriber whose prefix matches and
  forwarded to every child rank.
* A request sent down to a child is remembered until its (last) response
  comes back; if the child is lost meanwhile, each is answered
  ``EHOSTUNREACH`` (as Flux's overlay does with its RPC tracker), so no
  requester waits forever on a subtree that is gone.  Upstream needs no
  tracker: a rank that loses its parent stops, and its clients see the
  connection close.

Route hops are strings: ``c<N>`` a local client connection, ``m:<name>`` a
module, ``r<rank>`` a neighbouring rank -- ``r<rank>.<n>`` for the n-th
process of a child rank that joined since this rank started.  A hop names
one *link*, not just a rank number: a rank that was lost (or restarted in
place of one that still looked alive) sent no disconnect for its clients.
The rank that loses the link sends them instead, for every service they
used through it (:class:`UsedBelow`), so what they left elsewhere (a watch
another rank serves) ends.  An answer still on its way along a route
through the old link is dropped here instead of reaching whichever client
of the new process got the same ``c<N>``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from broker import codec, topology
from broker.errors import ErrnoError, no_service_message
from broker.events import SeqTracker, SubscriptionTable
from broker.logring import LogThrottle
from broker.message import (
    NODEID_ANY,
    NODEID_UPSTREAM,
    Message,
    MsgFlags,
    MsgType,
    Role,
)
from broker.overlay import Oversized, Unencodable
from broker.reloadhold import RELOAD_HOLD_TIMEOUT, ReloadHold
from broker.tally import add_count

if TYPE_CHECKING:
    from broker.overlay import Overlay

log = logging.getLogger("kvbroker.router")


COUNTERS = ("requests", "responses", "events-sequenced", "events-delivered", "disconnects-sent",
            "unroutable", "lost-requests", "dropped-responses", "dropped-events",
            "dropped-local", "dropped-control", "oversized", "unencodable", "streams-cut",
            "reload-held", "reload-released", "reload-refused")
"""The ``messages`` counters of ``broker.stats-get``."""

MAX_REQUEST_TOPIC = codec.MAX_REQUEST_TOPIC

CUT_STREAMS_MAX = 1024
"""Streams cut short (:meth:`Router._cut_stream`) a rank remembers, to drop
their later answers until their last."""


LINK_LIMIT = "tbon.max-message"


Route = tuple[str, ...]


class SentDown:
    """Requests forwarded to each child and not yet answered: per child, by
    route (the client that sent it), then matchtag -- what a response
    carries back.  A lost child's are answered ``EHOSTUNREACH``; a client's
    disconnect drops its own (the service ends them without answering)."""

    __slots__ = ("_by_child", "guests")

    def __init__(self) -> None:
        self._by_child: dict[int, dict[Route, dict[int, Message]]] = {}
        self.guests: Counter[int] = Counter()
        """Requests held per guest user (``access.max-guest-requests``)."""

    def __len__(self) -> int:
        return sum(len(tags) for sent in self._by_child.values() for tags in sent.values())

    def add(self, child: int, msg: Message) -> None:
        sent = self._by_child.get(child)
        if sent is None:
            sent = self._by_child[child] = {}
        tags = sent.get(route := tuple(msg.route))
        if tags is None:
            tags = sent[route] = {}
        old = tags.get(msg.matchtag)
        if old is not None:
            self._forget(old)
        tags[msg.matchtag] = msg
        if not msg.rolemask & Role.OWNER:
            add_count(self.guests, msg.userid, 1)

    def _forget(self, req: Message) -> None:
        if not req.rolemask & Role.OWNER:
            add_count(self.guests, req.userid, -1)

    def answered(self, child: int, response: Message) -> None:
        """``child`` sent ``response``: forget its request if that was the
        last answer (any answer but a stream's success)."""
        sent = self._by_child.get(child)
        if not sent:
            return
        route = tuple(response.route)
        tags = sent.get(route)
        if tags is None:
            return
        req = tags.get(response.matchtag)
        if req is not None and (response.errnum or not req.flags & MsgFlags.STREAMING):
            del tags[response.matchtag]
            self._forget(req)
            if not tags:
                del sent[route]

    def done(self, child: int, route: Route, matchtag: int) -> None:
        """Request ``matchtag`` of ``route`` got its last answer."""
        sent = self._by_child.get(child)
        tags = sent.get(route) if sent else None
        if sent is None or tags is None:
            return
        req = tags.pop(matchtag, None)
        if req is not None:
            self._forget(req)
            if not tags:
                del sent[route]

    def remove(self, child: int, route: Route, keep: Callable[[Message], bool]) -> None:
        """Forget ``route``'s requests to ``child`` that ``keep`` rejects."""
        sent = self._by_child.get(child)
        tags = sent.get(route) if sent else None
        if sent is None or tags is None:
            return
        for tag in [tag for tag, req in tags.items() if not keep(req)]:
            self._forget(tags.pop(tag))
        if not tags:
            del sent[route]

    def pop_child(self, child: int) -> list[Message]:
        """Every request still out to ``child``, forgotten."""
        sent = self._by_child.pop(child, None) or {}
        out = [req for tags in sent.values() for req in tags.values()]
        for req in out:
            self._forget(req)
        return out


class UsedBelow:
    """The services the clients below each child link have used through
    this rank: per link (its route hop), the ``(route, service, nodeid)`` of
    their requests, with the credentials to speak for them.  Their own rank
    sends each client's ``.disconnect`` along the same way when it goes, and
    that forgets the entry here; a *lost* rank never will, so this rank
    sends them instead (:meth:`Router.child_lost`): a watch or version wait
    such a client left anywhere -- served here, above, or on another
    subtree -- would otherwise stay for ever.  One entry per live client
    and service, not per request."""

    __slots__ = ("_by_hop",)

    def __init__(self) -> None:
        self._by_hop: dict[str, dict[tuple[Route, str, int], tuple[int, int]]] = {}

    def __len__(self) -> int:
        return sum(map(len, self._by_hop.values()))

    def note(self, hop: str, msg: Message) -> bool:
        """``msg``, a request, came in by ``hop``'s link (its route ends with
        it).  True if it is a client's disconnect."""
        used = self._by_hop.get(hop)
        if used is None:
            used = self._by_hop[hop] = {}
        topic = msg.topic
        key = (tuple(msg.route), topic.partition(".")[0], msg.nodeid)
        if topic.endswith(".disconnect"):
            used.pop(key, None)
            return True
        used[key] = (msg.userid, msg.rolemask)
        return False

    def pop(self, hop: str) -> list[tuple[tuple[Route, str, int], tuple[int, int]]]:
        """What ``hop``'s clients used, forgotten."""
        return list((self._by_hop.pop(hop, None) or {}).items())


class Peer(Protocol):
    """Anything local that can receive messages: a client connection or a module."""

    peer_id: str
    userid: int
    rolemask: int

    def deliver(self, msg: Message) -> None: ...


class Router:
    def __init__(self, rank: int, size: int, fanout: int, owner_uid: int) -> None:
        self.rank = rank
        self.size = size
        self.fanout = fanout
        self.owner_uid = owner_uid
        self.overlay: Overlay | None = None
        self.peers: dict[str, Peer] = {}
        self.services: dict[str, Peer] = {}
        self.subs = SubscriptionTable()
        self._peer_prefixes: dict[str, Counter[str]] = defaultdict(Counter)
        self._guest_services: Counter[int] = Counter()
        """Distinct (service, rank) pairs of each guest user's connections."""
        self.max_guest_services = 1 << 62
        """``access.max-guest-services``: each pair a guest's connections
        address is remembered (to send its ``.disconnect``) on every rank on
        the way while the connection lives."""
        self.max_guest_requests = 1 << 62
        """``access.max-guest-requests``: a request sent down is held until
        its last answer (a streaming request to a service that answers once,
        until its client goes)."""
        self.guest_subscriptions: Counter[int] = Counter()
        """Subscriptions held by each guest user's connections on this rank
        (``access.max-guest-subscriptions`` caps them)."""
        self._used_services: dict[str, set[tuple[str, int]]] = {}
        self.seq = 0  # rank 0: last sequence number assigned
        self._delivering = False
        self._waiting_events: deque[Message] = deque()
        """Events waiting while one is being delivered (see :meth:`distribute_event`)."""
        self.seq_tracker = SeqTracker(f"rank {rank}")
        # every counter from the start, at 0: stats show those that never moved
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._cut: OrderedDict[tuple[int, tuple[str, ...], int], None] = OrderedDict()
        """Streams whose answer this rank replaced by ``EMSGSIZE`` (the link to
        ``rank`` could not take it), by (rank, route beyond it, matchtag):
        their later answers are dropped, the last one too (:meth:`_cut_stream`)."""
        self._rank_log = LogThrottle(log)
        """Warnings about one message from a neighbour rank (an event sent up
        by a child): logged at most once a second per kind -- a peer admitted
        as a child sends as many as it likes; ``dropped-events`` counts each."""
        self._sent_down = SentDown()
        self._used_below = UsedBelow()
        self._passed_on: defaultdict[tuple[Route, str], set[int]] = defaultdict(set)
        """Where :meth:`pass_on` sent requests of clients below other ranks."""
        self._hops: dict[int, str] = {}
        """The route hop of each neighbour's current link (see the module docstring)."""
        self._holds: dict[str, ReloadHold] = {}
        """The services of modules being reloaded on this rank, and what is
        held for them meanwhile (:mod:`broker.reloadhold`)."""
        self._hop_ranks: dict[str, int] = {}
        self._joins: Counter[int] = Counter()
        parent = topology.parent_of(rank, fanout)
        self._parent = parent
        if parent is not None:
            self._link(parent, f"r{parent}")

    def _link(self, rank: int, hop: str) -> None:
        old = self._hops.get(rank)
        if old is not None:
            del self._hop_ranks[old]
        self._hops[rank] = hop
        self._hop_ranks[hop] = rank

    def child_joined(self, child: int) -> None:
        """The overlay admitted ``child``'s hello: a new link, a new hop."""
        self._joins[child] += 1
        n = self._joins[child]
        self._link(child, f"r{child}" if n == 1 else f"r{child}.{n}")

    # ------------------------------------------------------------ peers

    def add_peer(self, peer: Peer, services: tuple[str, ...] = ()) -> None:
        self.peers[peer.peer_id] = peer
        for name in services:
            if name in self.services:
                raise ValueError(f"service {name!r} is already registered")
            self.services[name] = peer

    def withdraw_services(self, peer: Peer) -> list[str]:
        """Route no more requests to ``peer`` (a module being removed: what
        comes is sent upstream, or answered ``ENOSYS`` on rank 0 -- unless
        a reload holds it, :meth:`hold_for_reload`), while the answers to
        its own requests still reach it; the names withdrawn."""
        names = [n for n, p in self.services.items() if p is peer]
        for name in names:
            del self.services[name]
        return names

    def remove_peer(self, peer: Peer) -> None:
        """Forget a peer; send ``<service>.disconnect`` for every service it used."""
        pid = peer.peer_id
        self.peers.pop(pid, None)
        self.withdraw_services(peer)
        prefixes = self._peer_prefixes.pop(pid, None)
        if prefixes:
            self.subs.unsubscribe_all(pid, prefixes)
            if not peer.rolemask & Role.OWNER:
                add_count(self.guest_subscriptions, peer.userid, -sum(prefixes.values()))
        used = self._used_services.pop(pid, ())
        if used and not peer.rolemask & Role.OWNER:
            add_count(self._guest_services, peer.userid, -len(used))
        for service, nodeid in used:
            self._send_disconnect(service, nodeid, (pid,), peer.userid, peer.rolemask)

    def _send_disconnect(self, service: str, nodeid: int, route: Route, userid: int,
                         rolemask: int) -> None:
        """``<service>.disconnect`` for the client at ``route``, to ``nodeid``
        (each rank on the way pushes its hop, so the service sees the route
        it keyed that client's state by)."""
        self.counts["disconnects-sent"] += 1
        self.route_request(Message(
            MsgType.REQUEST, f"{service}.disconnect", None, nodeid=nodeid,
            flags=MsgFlags.NORESPONSE, userid=userid, rolemask=rolemask, route=list(route)))

    # ------------------------------------------------------------ requests

    def from_local(self, peer: Peer, msg: Message) -> None:
        """A message sent by a local client or module."""
        t = msg.type
        if t == MsgType.REQUEST:
            # A module (in-process, OWNER) may send a request carrying the
            # credentials of a client it serves (ModuleHandle.rpc_as), as Flux
            # modules do with flux_msg_set_cred; everyone else is stamped.
            if msg.userid < 0 or peer.peer_id[:2] != "m:" or not peer.rolemask & Role.OWNER:
                msg.userid = peer.userid
                msg.rolemask = peer.rolemask
            # The route starts here, whatever the header said: services key
            # per-client state (watchers, version waits, cancel) by route and
            # drop it on the ``.disconnect`` that names [peer_id]; a forged
            # prefix made a client's state outlive its connection.  (No more
            # work than the append it replaces.)
            msg.route = [peer.peer_id]
            if peer.peer_id[0] == "c":
                if len(msg.topic) > MAX_REQUEST_TOPIC:
                    # (every rank on the way notes the service a client
                    # addressed until it goes: a guest's made-up names of
                    # 256 KiB held 50 MiB on its rank and on rank 0)
                    self.counts["dropped-local"] += 1
                    size = len(msg.topic)
                    msg.topic = codec.echoed_topic(msg.topic)
                    self.respond_error(msg, errno.EPROTO, "request topics are at most "
                                       f"{MAX_REQUEST_TOPIC} characters, not {size}")
                    return
                if msg.topic.endswith(".disconnect"):
                    # the router's notice that a client went away: a live
                    # client's own would make every rank on the way forget
                    # what it has in flight (no EHOSTUNREACH if a rank is lost)
                    self.counts["dropped-local"] += 1
                    self.respond_error(msg, errno.EPERM, f"{msg.topic} is sent by the broker only")
                    return
                used = self._used_services.get(peer.peer_id)
                if used is None:
                    used = self._used_services[peer.peer_id] = set()
                pair = (msg.service, msg.nodeid)
                if pair not in used:
                    if not peer.rolemask & Role.OWNER:
                        if self._guest_services[peer.userid] >= self.max_guest_services:
                            self.respond_error(msg, errno.ENOSPC, "this user addresses "
                                               f"{self.max_guest_services} services and "
                                               f"ranks from rank {self.rank} "
                                               "(access.max-guest-services)")
                            return
                        add_count(self._guest_services, peer.userid, 1)
                    used.add(pair)
            elif not msg.topic.endswith(".disconnect"):
                # A module's too: ``module remove`` then sends their
                # ``.disconnect``, as for a client that goes (a watch it
                # made was counted for good).  (A module may forward a
                # client's disconnect: that one is not a use.)
                used = self._used_services.get(peer.peer_id)
                if used is None:
                    used = self._used_services[peer.peer_id] = set()
                used.add((msg.service, msg.nodeid))
            self.route_request(msg)
        elif t == MsgType.RESPONSE:
            self.route_response(msg)
        else:
            self.counts["dropped-local"] += 1
            log.warning("dropping %s from local peer %s", msg, peer.peer_id)

    def pass_on(self, msg: Message, nodeid: int) -> None:
        """A local service sends a request it got on to rank ``nodeid``
        (``event.pub`` to rank 0).  The client's disconnect must then go
        there too: each rank on the way noted the client (UsedBelow), and
        only its disconnect makes them forget it.  A client of this rank
        has its services noted here; for another rank's client (above or
        below), this rank remembers where it passed the request, and sends
        the disconnect on when the client's comes (or when the link it came
        by is lost)."""
        route = msg.route
        if len(route) == 1:
            used = self._used_services.get(route[0])
            pair = (msg.service, nodeid)
            if used is not None and pair not in used:
                used.add(pair)
                if not msg.rolemask & Role.OWNER:  # (counted, not capped: ours)
                    add_count(self._guest_services, msg.userid, 1)
        else:
            self._passed_on[(tuple(route), msg.service)].add(nodeid)
        msg.nodeid = nodeid
        self.route_request(msg)

    def _disconnect_passed_on(self, route: Route, service: str, userid: int,
                              rolemask: int) -> None:
        """A client's disconnect reached this rank: send it on to the ranks
        :meth:`pass_on` sent the client's requests to."""
        for nodeid in self._passed_on.pop((route, service), ()):
            self._send_disconnect(service, nodeid, route, userid, rolemask)

    def from_rank(self, sender: int, msg: Message) -> None:
        """A message received over the overlay from a neighbouring rank."""
        t = msg.type
        if t == MsgType.REQUEST:
            hop = self._hops.get(sender) or f"r{sender}"
            msg.route.append(hop)
            if sender != self._parent:  # (noted before routing may rewrite nodeid)
                disconnect = self._used_below.note(hop, msg)
            else:
                disconnect = msg.topic.endswith(".disconnect")
            if disconnect and self._passed_on:
                self._disconnect_passed_on(tuple(msg.route), msg.service, msg.userid,
                                           msg.rolemask)
            self.route_request(msg)
        elif t == MsgType.RESPONSE:
            self._sent_down.answered(sender, msg)
            self.route_response(msg)
        elif t == MsgType.EVENT:
            if sender != topology.parent_of(self.rank, self.fanout):
                self.counts["dropped-events"] += 1
                self._rank_log.log(logging.WARNING, "event-from-child",
                                   "dropping event %s from non-parent rank %d", msg.topic,
                                   sender)
                return
            self.seq_tracker.see(msg.seq)
            self.distribute_event(msg)
        else:
            self.counts["dropped-control"] += 1

    def _no_service(self, msg: Message) -> None:
        """``ENOSYS``: no module of this rank serves ``msg``; naming the
        module to load when one installed would (:mod:`broker.plugins`)."""
        from broker.plugins import installed_modules

        module = msg.service if msg.service in installed_modules() else None
        self.respond_error(msg, errno.ENOSYS, no_service_message(msg.topic, module))

    def route_request(self, msg: Message) -> None:
        self.counts["requests"] += 1
        self._route(msg)

    def _route(self, msg: Message) -> None:
        nodeid = msg.nodeid
        if nodeid == NODEID_ANY:
            if self._holds and self._hold(msg):
                return
            peer = self.services.get(msg.service)
            if peer is not None:
                peer.deliver(msg)
            elif self.rank == 0:
                self._no_service(msg)
            else:
                self._send_up(msg)
        elif nodeid == NODEID_UPSTREAM:
            if self.rank == 0:
                self.respond_error(msg, errno.EHOSTUNREACH, "rank 0 has no upstream")
            else:
                msg.nodeid = NODEID_ANY
                self._send_up(msg)
        elif nodeid == self.rank:
            if self._holds and self._hold(msg):
                return
            peer = self.services.get(msg.service)
            if peer is not None:
                peer.deliver(msg)
            else:
                self._no_service(msg)
        elif not 0 <= nodeid < self.size:
            ranks = "rank 0" if self.size == 1 else f"ranks 0-{self.size - 1}"
            self.respond_error(msg, errno.EHOSTUNREACH,
                               f"no route to rank {nodeid}: the instance has {ranks}")
        else:
            child = topology.child_toward(self.rank, nodeid, self.fanout)
            if child is not None:
                self._send_down(child, msg)
            else:
                self._send_up(msg)

    def respond_error(self, req: Message, errnum: int, errstr: str | None = None) -> None:
        if req.flags & MsgFlags.NORESPONSE:
            return
        self.route_response(req.response(None, errnum or errno.EINVAL, errstr))

    # ------------------------------------------------------------ reloads

    def hold_for_reload(self, module: str, services: tuple[str, ...],
                        timeout: float = RELOAD_HOLD_TIMEOUT,
                        starting: bool = False) -> ReloadHold:
        """Module ``module`` is about to be reloaded on this rank (or, with
        ``starting``, started as the rank starts): from now
        on, what comes for its ``services`` (addressed to this rank, or to
        any rank) waits, in arrival order, until :meth:`end_hold` -- at
        most ``timeout`` seconds, after which it is answered ``ETIMEDOUT``
        and nothing more is held (a reload that hangs)."""
        hold = ReloadHold(module, services, self.rank, starting=starting, timeout=timeout)
        for name in hold.services:
            self._holds[name] = hold
        if not starting:  # (starting: from the first request held -- a rank
            # may wait for its parent for hours before its modules start)
            self._arm(hold)
        return hold

    def _arm(self, hold: ReloadHold) -> None:
        hold.timer = asyncio.get_running_loop().call_later(
            hold.timeout, self._hold_expired, hold, hold.timeout)

    def _hold(self, msg: Message) -> bool:
        """Hold ``msg`` if a reload holds its service (or answer it, past
        the bound); False: route it as ever."""
        hold = self._holds.get(msg.service)
        if hold is None or not hold.holds(msg):
            return False
        if hold.take(msg):
            self.counts["reload-held"] += 1
            if hold.timer is None:
                self._arm(hold)
        else:
            self.counts["reload-refused"] += 1
            self.respond_error(msg, *hold.full_error())
        return True

    def reload_hold(self, module: str) -> ReloadHold | None:
        """The hold of ``module``'s reload on this rank, if one holds now
        (not a plain ``module remove``, nor a reload past its deadline)."""
        hold = self._holds.get(module)
        return hold if hold is not None and hold.module == module else None

    def hold_parked(self, hold: ReloadHold, parked: list[Message]) -> None:
        """Hold what module ``hold.module`` had parked before its reload
        (:meth:`Module.parked <broker.module.Module.parked>`), oldest first,
        ahead of what was held since: counted as held, and routed with it
        by :meth:`end_hold`.  Past the hold's bound, the newest are
        answered as a request past it is (``EAGAIN``, retry)."""
        refused = hold.take_first(parked)
        self.counts["reload-held"] += len(parked) - len(refused)
        for msg in refused:
            self.counts["reload-refused"] += 1
            self.respond_error(msg, *hold.full_error())

    def _forget_hold(self, hold: ReloadHold) -> bool:
        """Hold nothing more for ``hold``'s services; False if it had ended."""
        if hold.timer is not None:
            hold.timer.cancel()
            hold.timer = None
        active = False
        for name in hold.services:
            if self._holds.get(name) is hold:
                del self._holds[name]
                active = True
        return active

    def end_hold(self, hold: ReloadHold, failure: str | None = None) -> None:
        """The reload is over: route what was held, oldest first, to the
        module that serves now -- the new one, or the old one if it was
        kept.  ``failure`` (the new module did not start, and the old one
        is gone): a request for a service no module of this rank offers
        now is answered ``ENOSYS`` with it, unless it may be served by a
        rank above (any rank's service, held on a rank other than 0),
        where it goes, as it would have without the reload."""
        if not self._forget_hold(hold):
            return
        for msg in hold.drain():
            if (failure is not None and msg.service not in self.services
                    and (self.rank == 0 or msg.nodeid == self.rank)):
                self.counts["reload-refused"] += 1
                self.respond_error(msg, errno.ENOSYS, failure)
            else:
                self.counts["reload-released"] += 1
                self._route(msg)

    def _hold_expired(self, hold: ReloadHold, timeout: float) -> None:
        """The reload took longer than it was given: answer what was held
        (a ``.disconnect`` is routed on: it needs no answer), hold no more."""
        hold.timer = None
        if not self._forget_hold(hold):
            return
        log.warning("module %s: its %s on rank %d took more than %gs: %d requests held "
                    "for it answered ETIMEDOUT", hold.module,
                    "start" if hold.starting else "reload", self.rank, timeout, len(hold))
        errnum, errstr = hold.timeout_error(timeout)
        for msg in hold.drain():
            if msg.flags & MsgFlags.NORESPONSE:
                self.counts["reload-released"] += 1
                self._route(msg)
            else:
                self.counts["reload-refused"] += 1
                self.respond_error(msg, errnum, errstr)

    def held_for_reload(self) -> dict[str, int]:
        """The modules being reloaded on this rank whose requests are held,
        each with how many are held now."""
        return {h.module: len(h) for h in self._holds.values()}

    # ------------------------------------------------------------ responses

    def route_response(self, msg: Message) -> None:
        self.counts["responses"] += 1
        if not msg.route:
            self.counts["dropped-responses"] += 1
            return
        hop = msg.route.pop()
        if hop[0] == "r":
            rank = self._hop_ranks.get(hop)
            if rank is None:  # the link it came in by is gone (module docstring)
                self.counts["dropped-responses"] += 1
                return
            if self._cut and msg.flags & MsgFlags.STREAMING:
                key = (rank, tuple(msg.route), msg.matchtag)
                if key in self._cut:  # a stream this rank ended: nothing more
                    if msg.errnum:
                        del self._cut[key]
                    self.counts["dropped-responses"] += 1
                    return
            self._send_rank(rank, msg)
            return
        peer = self.peers.get(hop)
        if peer is None:
            self.counts["dropped-responses"] += 1  # the client went away
            return
        peer.deliver(msg)

    # ------------------------------------------------------------ overlay

    def _send_up(self, msg: Message) -> None:
        parent = topology.parent_of(self.rank, self.fanout)
        assert parent is not None
        self._send_rank(parent, msg)

    def _send_down(self, child: int, msg: Message) -> None:
        if msg.flags & MsgFlags.NORESPONSE:
            if msg.topic.endswith(".disconnect"):
                # A client's disconnect on its way to the service, which ends
                # that client's requests without answering them (watches,
                # version waits): stop holding them here -- they piled up on
                # every rank along the way, one per abandoned remote watch.
                service = msg.service
                self._sent_down.remove(child, tuple(msg.route), lambda r: r.service != service)
            self._send_rank(child, msg)
            return
        if not msg.rolemask & Role.OWNER and \
                self._sent_down.guests[msg.userid] >= self.max_guest_requests:
            self.respond_error(msg, errno.ENOSPC, f"this user has {self.max_guest_requests} "
                                                  f"requests in flight through rank {self.rank} "
                                                  "(access.max-guest-requests)")
            return
        self._sent_down.add(child, msg)
        if not self._send_rank(child, msg):
            self._sent_down.done(child, tuple(msg.route), msg.matchtag)  # answered EHOSTUNREACH
            return
        msg.payload = None  # sent: what answers it needs is the envelope

    def child_lost(self, child: int) -> None:
        """The link to ``child`` is gone: answer what was sent down to it,
        and end what its clients had sent down to other children."""
        hop = self._hops.pop(child, None)
        if hop is not None:
            del self._hop_ranks[hop]
        for req in self._sent_down.pop_child(child):
            self.counts["lost-requests"] += 1
            self.respond_error(req, errno.EHOSTUNREACH,
                               f"rank {child} was lost before answering")
        if hop is not None:
            self._disconnect_below(hop)

    def _disconnect_below(self, hop: str) -> None:
        """The clients below a lost link are gone, and their rank will never
        send their disconnects: send each one's, for every service it used
        through this rank, the way its requests went (:class:`UsedBelow`).
        A disconnect going down also drops their requests still held in
        :class:`SentDown`."""
        for (route, service, nodeid), (userid, rolemask) in self._used_below.pop(hop):
            self._send_disconnect(service, nodeid, route, userid, rolemask)
            self._disconnect_passed_on(route, service, userid, rolemask)

    def sent_down(self) -> int:
        """Requests forwarded to children and not yet answered."""
        return len(self._sent_down)

    def _send_rank(self, rank: int, msg: Message) -> bool:
        ov = self.overlay
        try:
            sent = ov is not None and ov.send(rank, msg)
        except Oversized as exc:
            # Answered here rather than dropped by the neighbour (a relayed
            # commit's requester would wait for ever): a request gets its
            # EMSGSIZE answer, a response becomes one, sent on in its place.
            # (one line a second: a client chooses how many it sends, and
            # one line each flushed the dmesg ring)
            self.counts["oversized"] += 1
            self._rank_log.log(logging.WARNING, "oversized", "not sending %s to rank %d: "
                               "%d bytes", msg, rank, exc.size)
            if msg.type == MsgType.REQUEST:
                if not msg.flags & MsgFlags.NORESPONSE:
                    self.route_response(codec.oversized_error(msg, exc.size, exc.limit, LINK_LIMIT))
            elif msg.type == MsgType.RESPONSE:  # (its route is already past this hop)
                assert ov is not None
                ov.send(rank, codec.oversized_error(msg, exc.size, exc.limit, LINK_LIMIT))
                if msg.flags & MsgFlags.STREAMING and not msg.errnum:
                    self._cut_stream(rank, msg)
            return False
        except Unencodable as exc:
            # A payload that decoded as it came but cannot be packed again
            # (nested too deep once a module wrapped it): answered EPROTO
            # here, as an oversized one -- not "unreachable", and not one
            # log line per message, since a client chooses how many.
            self.counts["unencodable"] += 1
            self._rank_log.log(logging.WARNING, "unencodable", "not sending %s to rank %d: %s",
                               msg, rank, exc)
            errstr = f"cannot send the payload on to rank {rank}: {exc}"
            if msg.type == MsgType.REQUEST:
                self.respond_error(msg, errno.EPROTO, errstr)
            elif msg.type == MsgType.RESPONSE:
                assert ov is not None
                ov.send(rank, codec.error_in_place(msg, errno.EPROTO, errstr))
            return False
        if not sent:
            self.counts["unroutable"] += 1
            if msg.type == MsgType.REQUEST:
                state = "is unreachable" if ov is None else ov.why_unreachable(rank)
                self.respond_error(msg, errno.EHOSTUNREACH, f"rank {rank} {state}")
            return False
        return True

    def _cut_stream(self, rank: int, msg: Message) -> None:
        """``msg``, an answer of a stream on its way to ``rank``, was replaced
        by ``EMSGSIZE``, which ends the stream for its client (RFC 6: an
        error answer is the last).  Its later answers are dropped here, and
        its service, when it runs on this rank (where such an answer is
        cut: the first link on its way), is sent ``<service>.cancel
        {matchtag}`` as its client would send it (the route it came by, the
        client's credentials, no response), as Flux's streaming services
        take it: a kvs watch so cut is ended (it answered every later commit
        into nothing until its client's connection closed).  A service
        without such a method ignores it (no response is sent)."""
        self.counts["streams-cut"] += 1
        cut = self._cut
        cut[(rank, tuple(msg.route), msg.matchtag)] = None
        if len(cut) > CUT_STREAMS_MAX:
            cut.popitem(last=False)
        service = msg.service
        peer = self.services.get(service)
        hop = self._hops.get(rank)
        if peer is None or hop is None:
            return
        peer.deliver(Message(MsgType.REQUEST, f"{service}.cancel", {"matchtag": msg.matchtag},
                             nodeid=NODEID_ANY, flags=MsgFlags.NORESPONSE, userid=msg.userid,
                             rolemask=msg.rolemask, route=[*msg.route, hop]))

    # ------------------------------------------------------------ events

    def subscribe(self, peer: Peer, prefix: str) -> None:
        self._peer_prefixes[peer.peer_id][prefix] += 1
        self.subs.subscribe(peer.peer_id, prefix)
        if not peer.rolemask & Role.OWNER:
            add_count(self.guest_subscriptions, peer.userid, 1)

    def unsubscribe(self, peer: Peer, prefix: str) -> bool:
        counts = self._peer_prefixes.get(peer.peer_id)
        if not counts or not counts[prefix]:
            return False
        counts[prefix] -= 1
        if not counts[prefix]:
            del counts[prefix]
        if not peer.rolemask & Role.OWNER:
            add_count(self.guest_subscriptions, peer.userid, -1)
        return self.subs.unsubscribe(peer.peer_id, prefix)

    def sequence_event(self, topic: str, payload: Any, flags: int, userid: int) -> int:
        """Rank 0: give an event the next sequence number and send it everywhere.

        With links, the event is encoded here, before it has its number, and
        refused (``EMSGSIZE``; ``EPROTO`` if it cannot be packed) unless it
        fits ``tbon.max-message``: sequenced, it reached rank 0's own
        subscribers while every link dropped it -- a gap on every other rank,
        whose subscribers never saw it.  Its size is only known packed (a
        module's payload comes unpacked; a client's is re-packed, and may
        grow: msgpack float32s come back float64s), and the encoding is the
        one the links and the clients send (:attr:`Message.wire`), so the
        check costs no extra encode where the event goes anywhere."""
        assert self.rank == 0
        msg = Message(MsgType.EVENT, topic, payload, flags=flags & MsgFlags.PRIVATE,
                      userid=userid, seq=self.seq + 1)
        if self.overlay is not None:
            try:
                frames = msg.wire = codec.encode(msg)
            except TypeError as exc:
                raise ErrnoError(errno.EPROTO, f"event payload: {exc}") from None
            limit = self.overlay.max_message
            if codec.may_exceed_link(frames) and codec.frames_size(frames) > limit:
                raise ErrnoError(errno.EMSGSIZE, f"an event of {codec.frames_size(frames)} "
                                                 f"bytes exceeds tbon.max-message ({limit})")
        self.seq = msg.seq
        self.counts["events-sequenced"] += 1
        self.seq_tracker.see(self.seq)
        self.distribute_event(msg)
        return self.seq

    def distribute_event(self, msg: Message) -> None:
        """Deliver to matching local subscribers, then forward to the children.

        A module's ``on_event`` runs inside its delivery, and on rank 0 an
        event it publishes there is sequenced at once: delivered then, it
        reached the subscribers after that module before the event being
        delivered (seq N+1 before N, on rank 0 only).  Such events wait
        here until the one being delivered has reached every subscriber,
        still within this call."""
        waiting = self._waiting_events
        if self._delivering:
            waiting.append(msg)
            return
        self._delivering = True
        try:
            self._deliver_event(msg)
            while waiting:
                self._deliver_event(waiting.popleft())
        finally:
            self._delivering = False

    def _deliver_event(self, msg: Message) -> None:
        if self.overlay is not None:
            self.overlay.broadcast_down(msg)
        private = msg.flags & MsgFlags.PRIVATE
        for pid in self.subs.match(msg.topic):
            peer = self.peers.get(pid)  # type: ignore[call-overload]
            if peer is None:
                continue
            if private and not (peer.rolemask & Role.OWNER or peer.userid == msg.userid):
                continue
            self.counts["events-delivered"] += 1
            peer.deliver(msg)

    # ------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        subs = {pid: sum(c.values()) for pid, c in self._peer_prefixes.items() if c}
        return {
            "rank": self.rank,
            "messages": dict(self.counts),
            "events": {
                "sequenced": self.counts["events-sequenced"],
                "delivered": self.counts["events-delivered"],
                "last-seq": self.seq_tracker.last,
                "gaps": self.seq_tracker.gaps,
                "prefixes": self.subs.prefixes(),
            },
            "subscriptions": subs,
            "clients": sum(1 for p in self.peers if p[0] == "c"),
            "sent-down": self.sent_down(),
            "held-for-reload": self.held_for_reload(),
            "used-below": len(self._used_below),
        }
