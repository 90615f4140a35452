"""The ``groups`` module (Flux's broker groups): which ranks are members of
each named group, for the instance at rank 0.

A process (a client or a module) joins a group *on its own rank*: the rank
becomes a member until it leaves, or its connection goes.  Each rank knows
the members of its subtree -- its own memberships and what each child last
reported -- and, when that changes, sends its parent the new set
(``groups.update``, at most once per turn of the loop, every changed group
in one message).  Rank 0 thus holds every group whole, and answers
``groups.get``: once, or, streaming, now and at every change, until the
client ends it (``groups.cancel``, a kvbroker extension: Flux's ends only
with the client's connection) or goes.  Rank 0 itself may be a member too.

Every rank joins ``broker.online`` as its module starts, so that group is
the ranks whose groups module runs: the instance's live ranks once it is
loaded on all (``-S broker.modules=...,groups``, or ``kvbroker module load
-r all groups``).  A child that is lost, or stops, takes its subtree's
memberships with it: its parent's router sends ``groups.disconnect`` for
the updates that came by that link, as for any client below it.

Why: a barrier across ranks, "which ranks run the worker", "are all ranks
up" -- answered by the broker, not by polling each rank.  Flux's
``broker.torpid`` group is not kept (``kvbroker overlay status`` shows a
torpid rank).  A group with no member is forgotten (Flux keeps every name
for ever): a rank keeps at most :data:`MAX_GROUPS` groups with members, and
an instance that makes a barrier group per job would otherwise reach it
with groups long empty -- every join refused ``ENOSPC`` from then on, and
a sibling's membership dropped unsaid on the way to rank 0.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any, ClassVar

from broker import attrs, topology
from broker.errors import ErrnoError, ProtocolError
from broker.idset import decode_ranks, encode_ranks
from broker.message import Message
from broker.module import Handler, Module, require, require_notice

ONLINE = "broker.online"
"""The group every rank's groups module joins as it starts."""
MAX_NAME = 256
"""Longest group name, in characters (every rank on the way holds it)."""
MAX_GROUPS = 10_000
"""Groups with members a rank keeps at most (an empty one is forgotten)."""

PARENT_ANSWERED = "groups.parent-answered"
"""The key of :attr:`ModuleContext.kept` that says the parent's module has
answered an update of this rank (once is enough: it has started).  Kept
for the rank's life, not the module's: a ``module reload groups`` below a
parent whose module was removed forgot it, took the ``ENOSYS`` for a start
and said nothing of it, the join below waiting without a word."""
PARENT_ASK_TIMEOUT = 2.0
"""Seconds the parent is given to say which modules it loads."""
RETRY_FIRST, RETRY_MAX = 0.05, 1.0
"""Seconds before an update that failed is sent again, doubling up to the
most (the parent's module may load long after this one)."""

Route = tuple[str, ...]
Watch = tuple[Route, int]
"""A streaming ``groups.get``: its client's route and matchtag, which is
what a ``groups.cancel`` names (the same client, the same tag)."""


def _full(rank: int) -> ErrnoError:
    return ErrnoError(errno.ENOSPC, f"rank {rank} keeps {MAX_GROUPS} groups with members")


def _name(p: Any) -> str:
    name: str = require(p, name=str)["name"]
    if not name or len(name) > MAX_NAME:
        raise ErrnoError(errno.EINVAL, f"a group name has 1 to {MAX_NAME} characters")
    return name


class GroupsModule(Module):
    """One rank's view: its own memberships, its children's subtrees."""

    name: ClassVar[str] = "groups"
    ends_its_requests: ClassVar[bool] = True  # (its stop() ends what it keeps)
    metrics_skip: ClassVar[tuple[str, ...]] = ("rank", "pid", "subtree")

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.joined: dict[str, Route | None] = {}
        """The groups this rank is a member of, each with who joined it
        (a client's route; None: the module itself, ``broker.online``)."""
        self.below: dict[Route, dict[str, set[int]]] = {}
        """What each child reported of its subtree, by the route its
        updates came by (a child that joins again comes by a new one)."""
        self.subtree: dict[str, set[int]] = {}
        """Each group's members in this rank's subtree (rank 0: all); a
        group with none is not here."""
        self.watchers: dict[str, dict[Watch, Message]] = {}
        """Rank 0: the streaming ``groups.get`` requests, by group, then by
        client and matchtag (in the order they came: answered in it)."""
        self._watching: dict[Watch, str] = {}
        """Rank 0: the group each streaming ``groups.get`` watches, so a
        ``groups.cancel`` finds it at once (however many a client has)."""
        self.cancelled = 0
        self._changed: set[str] = set()
        self._told: dict[str, str] = {}
        """Rank 0: what the watchers were last told of each group with
        members (of one without: ``""``)."""
        self._unsent: set[str] = set()
        """Rank > 0: groups whose members the parent has not been told yet."""
        self._sender: asyncio.Task[None] | None = None
        self._waiting: list[Message] = []
        """Rank > 0: joins, leaves and children's updates to answer once
        the changes made so far are told above (:meth:`_answer_once_told`)."""
        self._flush_scheduled = False
        self._parent_missing = False
        self._parent_modules: list[str] | None = None
        """The modules the parent loads as it starts, as it says (asked once)."""
        self.parent = topology.parent_of(ctx.rank, ctx.fanout)
        self.updates_sent = 0
        self.updates_received = 0

    def handlers(self) -> dict[str, Handler]:
        return {
            "groups.join": self.join,
            "groups.leave": self.leave,
            "groups.get": self.get,
            "groups.cancel": self.cancel,
            "groups.update": self.update,
            "groups.resend": self.resend,
            "groups.disconnect": self.disconnect,
        }

    async def start(self) -> None:
        self.joined[ONLINE] = None
        self._recount(ONLINE)
        # Children whose module started before this one sent their update
        # to no service: ask them for it again (one whose module is not
        # loaded yet sends its own as it starts).
        for child in topology.children_of(self.ctx.rank, self.ctx.fanout, self.ctx.size):
            self.h.send_noresponse("groups.resend", {}, nodeid=child)

    def resend(self, msg: Message) -> None:
        """``groups.resend`` (no response), from the parent's module as it
        starts: send it this subtree's members of every group again."""
        require_notice(msg)
        if not msg.is_owner or self.parent is None:
            return
        self._changed.update(n for n, m in self.subtree.items() if m)
        self._schedule_flush()

    async def stop(self) -> None:
        """Take this subtree's memberships out of the parent's view (on a
        ``module remove``; at a rank's stop its link's end does it too),
        and end the watches of rank 0's groups."""
        if self.parent is not None and self.subtree:
            self.h.send_noresponse("groups.update",
                                   {"update": {name: "" for name in self.subtree}},
                                   nodeid=self.parent)
        for watching in self.watchers.values():
            for msg in watching.values():
                self.h.respond_error(msg, errno.ENOSYS, "the groups module stopped on rank 0")
        self.watchers.clear()
        self._watching.clear()
        for msg in self._waiting:
            self.h.respond_error(msg, errno.ENOSYS, f"the groups module stopped on rank "
                                                    f"{self.ctx.rank} before its parent was "
                                                    "told")
        self._waiting.clear()

    # ------------------------------------------------------------ requests

    def _owner_only(self, msg: Message, what: str) -> None:
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, f"groups.{what} is for the instance owner")

    def join(self, msg: Message) -> None:
        """``groups.join {name}`` -> ``{}``: this rank is a member of
        ``name`` until the client leaves it or goes.  The client must be
        this rank's own (the rank that answers is the one that joins)."""
        self._owner_only(msg, "join")
        name = _name(msg.payload)
        if len(msg.route) != 1:
            raise ProtocolError("groups.join is restricted to the local broker")
        if name in self.joined:
            raise ErrnoError(errno.EEXIST, f"rank {self.ctx.rank} is already a member of "
                                           f"{name}")
        if name not in self.subtree and len(self.subtree) >= MAX_GROUPS:
            raise _full(self.ctx.rank)
        self.joined[name] = tuple(msg.route)
        self._recount(name)
        self._answer_once_told(msg)

    def leave(self, msg: Message) -> None:
        """``groups.leave {name}`` -> ``{}``: by the client that joined."""
        self._owner_only(msg, "leave")
        name = _name(msg.payload)
        if len(msg.route) != 1:
            raise ProtocolError("groups.leave is restricted to the local broker")
        if self.joined.get(name, ()) != tuple(msg.route):
            raise ErrnoError(errno.ENOENT, f"this client has not made rank {self.ctx.rank} "
                                           f"a member of {name} (not a member)")
        del self.joined[name]
        self._recount(name)
        self._answer_once_told(msg)

    def get(self, msg: Message) -> None:
        """``groups.get {name}`` -> ``{members: IDSET}`` (``""``: none), at
        rank 0; streaming, now and again at every change, until the client
        cancels it (:meth:`cancel`) or goes."""
        self._owner_only(msg, "get")
        name = _name(msg.payload)
        if self.ctx.rank != 0:
            raise ProtocolError("groups.get is only available on rank 0")
        self.h.respond(msg, {"members": encode_ranks(sorted(self.subtree.get(name, ())))})
        if msg.streaming:
            key = (tuple(msg.route), msg.matchtag)
            old = self._watching.get(key)
            if old is not None:  # (a tag reused by a client that did not end its
                self.watchers[old].pop(key, None)  # first stream: the new one wins)
            self._watching[key] = name
            self.watchers.setdefault(name, {})[key] = msg

    def cancel(self, msg: Message) -> None:
        """``groups.cancel {matchtag}`` (a kvbroker extension, as
        ``kvs-watch.cancel``): the streaming ``groups.get`` of that matchtag
        *from the same client* (route) ends with ``ENODATA``; anything else
        (another client's tag, one ended already) is ignored.  Usually a
        notice; answered ``{}`` if sent expecting an answer.  Why: a
        client that stops reading a watch (``Groups.wait_for`` satisfied, a
        barrier passed) would otherwise leave it here, answered at every
        change of the group, until its connection closed -- one per call
        for a service that runs a barrier per job."""
        tag = require(msg.payload, matchtag=int)["matchtag"]
        key = (tuple(msg.route), tag)
        name = self._watching.pop(key, None)
        if name is not None:
            watching = self.watchers[name]
            request = watching.pop(key)
            if not watching:
                del self.watchers[name]
            self.cancelled += 1
            self.h.respond_error(request, errno.ENODATA)
        self.h.respond(msg, {})

    def update(self, msg: Message) -> None:
        """``groups.update {update: {name: IDSET}}`` -> ``{}``, from a
        child: its subtree's members of each group named.  A malformed one
        is dropped, as Flux does (``EPROTO`` if it asked for an answer)."""
        self.updates_received += 1
        p = msg.payload
        update = p.get("update") if isinstance(p, dict) else None
        if not msg.is_owner or len(msg.route) < 2 or not isinstance(update, dict):
            self.log.warning("dropping a malformed groups.update")
            raise ProtocolError("groups.update is {update: {NAME: IDSET}}, from a child rank")
        route = tuple(msg.route)
        reported = self.below.setdefault(route, {})
        size = self.ctx.size
        left_out = 0
        # (the groups it empties first: what they free makes room for the
        # ones it adds, in this update too)
        for name, members in sorted(update.items(), key=lambda item: bool(item[1])):
            if not isinstance(name, str) or not isinstance(members, str) or not name:
                continue
            try:
                ranks = decode_ranks(members, size)
            except ValueError:
                self.log.warning("dropping groups.update of %.64r: %r is not an idset",
                                 name, members)
                continue
            if ranks:
                if name not in self.subtree and len(self.subtree) >= MAX_GROUPS:
                    left_out += 1
                    continue
                reported[name] = ranks
            else:
                reported.pop(name, None)
            self._recount(name)
        if left_out:
            # (the rest applied; the child sends it again until there is
            # room, its joins waiting: a membership dropped here unsaid
            # left rank 0 reading the group empty)
            raise _full(self.ctx.rank)
        self._answer_once_told(msg)

    def disconnect(self, msg: Message) -> None:
        """A client (or a child's link, for the updates it sent) went away:
        its memberships go with it, and its streaming gets end."""
        route = tuple(msg.route)
        for name in [n for n, who in self.joined.items() if who == route]:
            del self.joined[name]
            self._recount(name)
        reported = self.below.pop(route, None)
        for name in reported or ():
            self._recount(name)
        for name, watching in list(self.watchers.items()):
            for key in [k for k in watching if k[0] == route]:
                del watching[key]
                del self._watching[key]
            if not watching:
                del self.watchers[name]

    def _answer_once_told(self, msg: Message) -> None:
        """Answer a join, a leave or a child's update once rank 0 knows what
        it changed: a ``groups.get`` made after it returns sees it (rank 0
        knows at once; another rank once its own update, sent up, is
        answered -- which each rank on the way does once it is told above)."""
        if self.parent is None or not (self._changed or self._unsent
                                       or self._flush_scheduled):
            self.h.respond(msg, {})
        else:
            self._waiting.append(msg)

    # ------------------------------------------------------------ the sets

    def _recount(self, name: str) -> None:
        """``name``'s members in this subtree again; if they changed, tell
        the parent (rank 0: the watchers), once this turn of the loop is
        over (joins and leaves of one turn go in one update)."""
        members = {self.ctx.rank} if name in self.joined else set()
        for reported in self.below.values():
            members |= reported.get(name, set())
        if members:
            if members == self.subtree.get(name):
                return
            self.subtree[name] = members
        elif self.subtree.pop(name, None) is None:
            return  # (none before either: the parent was never told of it)
        self._changed.add(name)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        changed, self._changed = self._changed, set()
        if self.parent is not None:
            self._unsent |= changed
            if self._sender is None or self._sender.done():
                self._sender = self.spawn(self._send_updates())
            return
        for name in sorted(changed):
            members = encode_ranks(sorted(self.subtree.get(name, ())))
            if self._told.get(name, "") == members:  # (a join and a leave in one turn)
                continue
            if members:
                self._told[name] = members
            else:
                del self._told[name]
            for msg in self.watchers.get(name, {}).values():
                self.h.respond(msg, {"members": members})

    async def _send_updates(self) -> None:
        """Tell the parent this subtree's members of each group changed, one
        update at a time, in order; one that fails (the parent's module not
        loaded yet, the link down) is sent again, with what is current
        then, until one gets through."""
        assert self.parent is not None
        delay = RETRY_FIRST
        while self._unsent:
            # (what changed this turn, not flushed yet, goes too: a join
            # waiting below is answered by this update, which must carry it)
            self._unsent |= self._changed
            self._changed = set()
            names, self._unsent = self._unsent, set()
            waiting, self._waiting = self._waiting, []
            told = {n: encode_ranks(sorted(self.subtree.get(n, ()))) for n in sorted(names)}
            try:
                await self.h.rpc("groups.update", {"update": told}, nodeid=self.parent)
            except ErrnoError as exc:
                if (exc.errnum == errno.ENOSYS and not self._parent_missing
                        and not await self._parent_still_starting()):
                    self._parent_missing = True  # (said once, until one gets through)
                    self.log.warning("rank %d has no groups module: the groups of this "
                                     "subtree (and the joins waiting for them) wait until "
                                     "it is loaded", self.parent)
                self._unsent |= names
                self._waiting[:0] = waiting
                await asyncio.sleep(delay)  # (a retry's pace, not a wait for an event)
                delay = min(delay * 2, RETRY_MAX)
                continue
            self.updates_sent += 1
            self.ctx.kept[PARENT_ANSWERED] = True
            delay = RETRY_FIRST
            if self._parent_missing:
                self._parent_missing = False
                self.log.info("rank %d's groups module is told this subtree's groups",
                              self.parent)
            for msg in waiting:
                self.h.respond(msg, {})

    async def _parent_still_starting(self) -> bool:
        """The parent's module has not answered this rank yet and the
        parent's module list loads it: a rank's modules start before its
        parent's at an ordinary start (rank 0 starts its content store and
        kvs first), so its first updates meet ``ENOSYS`` and the parent's
        ``groups.resend`` asks for them as it starts -- no cause for a
        warning.  Once one got through, on this rank (by any load of this
        module: :data:`PARENT_ANSWERED`), an ``ENOSYS`` is a module removed
        (``kvbroker module remove groups``), and is said."""
        assert self.parent is not None
        if self.ctx.kept.get(PARENT_ANSWERED, False):
            return False
        return self.name in await self._parent_loads()

    async def _parent_loads(self) -> list[str]:
        """The modules the parent loads as it starts, by its own
        ``broker.modules``: a rank of a bootstrap file has its own command
        line (``-S``), and may have a file of its own, so this rank's list
        says nothing of its parent's.  A parent that cannot be asked is
        judged by this rank's list (the next ``ENOSYS`` asks again)."""
        assert self.parent is not None
        if self._parent_modules is None:
            try:  # (bounded: the updates wait behind it)
                told = await asyncio.wait_for(self.h.rpc(
                    "attr.get", {"name": attrs.MODULES.name}, nodeid=self.parent),
                    PARENT_ASK_TIMEOUT)
            except (ErrnoError, TimeoutError):
                return attrs.module_names(self.ctx.attrs, self.parent)
            self._parent_modules = attrs.module_names({attrs.MODULES.name: told["value"]},
                                                      self.parent)
        return self._parent_modules

    def stats(self) -> dict[str, Any]:
        """Flux's ``subtree`` (each group's members below and at this rank)."""
        return {"rank": self.ctx.rank,
                "subtree": {n: encode_ranks(sorted(m)) for n, m in sorted(self.subtree.items())},
                "joined": sorted(self.joined),
                "watchers": len(self._watching),
                "cancelled": self.cancelled,
                "updates": {"sent": self.updates_sent, "received": self.updates_received}}
