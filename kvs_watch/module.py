"""The ``kvs-watch`` module: watches KVS keys on every rank, fed by namespace events.

Requests (docs/protocol.md, section "kvs-watch"):

* ``kvs-watch.lookup`` ``{namespace, key, flags}`` -- streaming.  The first
  answer is the key's current value; with ``WATCH``, one answer per later
  commit that concerns the key (see :mod:`kvs_watch.monitor`), in commit
  order, each ``{"val", "rootseq", "namespace"}``.  Flags and their rules:
  :mod:`kvs_watch.flags`; answering: :mod:`kvs_watch.watcher`.
* ``kvs-watch.cancel`` ``{matchtag}`` -- the watcher started by the same
  client (same route) with that matchtag ends with ``ENODATA``.  Usually
  sent without response; answered ``{}`` if a response is wanted.
* ``kvs-watch.disconnect`` -- the router's notice that a client went away:
  its watchers are dropped silently.
* ``kvs-watch.namespaces`` ``{prefix?, flags?}`` -- streaming: the
  namespaces that exist, then each one created or removed, as ``{namespace,
  owner, event, epoch, initial?}`` (:mod:`kvs_watch.nswatch`).  Cancelled and
  dropped as a lookup's watcher, and counted with them.
* ``kvs-watch.stats-get`` -- watchers, namespaces, event counters (a guest
  sees its own namespaces only, and no counter).

Events (docs/protocol.md, Events and monitors): the module subscribes once,
at start, to ``kvs.namespace-`` (``self.h.subscribe``, a direct call that
never waits), and keeps one :class:`~kvs_watch.monitor.Monitor` per watched
namespace.  It handles ``setroot``, ``removed`` and ``created`` of the
monitored namespaces, gives every ``created`` and ``removed`` to the
namespace watchers (:mod:`kvs_watch.nswatch`) while there are any, drops
``error``, and drops as *foreign* any event that is not from the instance
owner, whose topic is not ``kvs.namespace-<NS>-<kind>`` for a monitored
``NS`` (nor a ``created`` or ``removed`` a namespace watcher takes), whose
``namespace`` field disagrees with the topic, or whose root fields are not
a kvs's (an int ``rootseq``, a blobref ``rootref``).  An event for a
namespace this rank does not watch costs one dict look-up; a watch costs
no subscription.

Access: a guest may watch only a namespace it owns (``EPERM``), checked
against the owner that ``kvs.getroot``/``created``/``setroot`` report; the
pinned lookups carry the watcher's credentials (``rpc_as``) so kvs checks
any namespace a symlink leads into.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import Counter
from collections.abc import Callable
from itertools import count, islice
from typing import Any, ClassVar

from broker.attrs import CONTENT_HASH, AttrSpec, integer
from broker.content import blobref
from broker.errors import ErrnoError, ProtocolError, error_text
from broker.message import Message
from broker.module import RELOAD, Handler, Module, require
from kvs.keys import check_key
from kvs.namespaces import (
    EVENT_PREFIX,
    PRIMARY,
    check_name,
    event_topic_parts,
    gather_namespace_list,
)
from kvs_watch import flags as F
from kvs_watch.monitor import INIT, MISSING, READY, Monitor
from kvs_watch.nswatch import NOLIST, NsHub, NsWatcher
from kvs_watch.nswatch import check_flags as check_ns_flags
from kvs_watch.watcher import DEFAULT_MAX_BACKLOG, Watcher

KVS_RELOADED = f"module kvs was removed ({RELOAD})"
"""How a request to kvs ends when ``module reload kvs`` replaces the module
serving it.  Asked again at once, the rank holds it for the new module:
a watch's lookup is asked again (:meth:`KvsWatchModule.ask_kvs`), not
ended with it (a watch on a rank whose kvs was reloaded ended so)."""
KVS_RELOAD_TRIES = 3
"""Times one request to kvs is asked again across reloads of kvs."""

log = logging.getLogger("kvbroker.kvs-watch")

EVENT_KINDS = frozenset({"setroot", "removed", "created", "error"})
STATS_NAMESPACES = 100
"""At most this many namespaces are detailed in ``stats-get``."""

Route = tuple[str, ...]


MAX_BACKLOG = AttrSpec(
    "kvs-watch.max-backlog", str(DEFAULT_MAX_BACKLOG), integer(1),
    "a watcher more than this many commits behind ends with EOVERFLOW")


MAX_CLIENT_WATCHES = AttrSpec(
    "kvs-watch.max-watches-per-client", "1000000", integer(1),
    "a client's watches in progress on a rank; one more is refused with ENOSPC")
"""Each watch costs the rank memory until it ends (about a kilobyte): a client
that leaks them, or a guest that opens millions, would otherwise grow the
rank without bound.  A connection's cap, as inotify caps a user's watches
(``ENOSPC`` there too)."""


MAX_GUEST_WATCHES = AttrSpec(
    "kvs-watch.max-watches-per-guest", "100000", integer(1),
    "one guest user's watches in progress on a rank, over all its connections; "
    "one more is refused with ENOSPC")
"""The per-client cap alone bounds nothing for a guest, who may open many
connections (up to ``access.max-guest-connections``): as inotify's
``max_user_watches``, this one counts the user.  The instance owner is held
to the per-client cap only."""


DROP_PER_TURN = 256
"""A gone client's watchers dropped per turn of the event loop
(:meth:`KvsWatchModule.disconnect`)."""


COUNTERS = ("watchers-created", "lookups", "lookups-shared", "answers", "blob-loads",
            "cancelled", "disconnected", "namespaces-removed", "refused-over-cap",
            "namespace-watchers-created", "roots-folded")
"""The ``counts`` of ``kvs-watch.stats-get`` (all shown, 0 included)."""


class KvsWatchModule(Module):
    name: ClassVar[str] = "kvs-watch"
    ends_its_requests: ClassVar[bool] = True  # (its stop() ends what it keeps)
    metrics_skip: ClassVar[tuple[str, ...]] = ("rank", "namespaces")
    after: ClassVar[tuple[str, ...]] = ("kvs",)
    attributes: ClassVar[tuple[AttrSpec, ...]] = (MAX_BACKLOG, MAX_CLIENT_WATCHES,
                                                  MAX_GUEST_WATCHES)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        attrs = ctx.attrs
        self.max_backlog = MAX_BACKLOG.value(attrs)
        self.max_client_watches = MAX_CLIENT_WATCHES.value(attrs)
        self.max_guest_watches = MAX_GUEST_WATCHES.value(attrs)
        self.guest_watches: Counter[int] = Counter()
        """Watches in progress of each guest user (by uid) with any."""
        self.hash_name = CONTENT_HASH.value(attrs)
        self.monitors: dict[str, Monitor] = {}
        self.clients: dict[Route, dict[int, Watcher | NsWatcher]] = {}
        """Watchers by the route of their request, then matchtag (cancel, disconnect)."""
        self.nwatchers = 0
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self._lookups: dict[tuple[Any, ...], Any] = {}
        """Lookups in flight, shared by the watchers that want the same one."""
        self._current: dict[str, Any] = {}
        """Rank 0's ``kvs.getroot`` in flight, per namespace (:meth:`current_root`)."""
        self.ns = NsHub(self)
        """``kvs-watch.namespaces`` watchers and their table of namespaces,
        fed the created and removed events."""
        self._arrivals = count()
        """Numbers the lookups as they come (:attr:`Watcher.arrival`)."""

    def handlers(self) -> dict[str, Handler]:
        return {
            "kvs-watch.lookup": self.lookup,
            "kvs-watch.namespaces": self.watch_namespaces,
            "kvs-watch.cancel": self.cancel,
            "kvs-watch.disconnect": self.disconnect,
            "kvs-watch.stats-get": self.stats_get,
        }

    async def start(self) -> None:
        # once, before any watch: a monitor made later misses no event
        self.h.subscribe(EVENT_PREFIX)

    async def stop(self) -> None:
        # ENOSYS as Flux; the text says what the user sees happen, and why
        # (a lost parent is not an operator's stop: the client may retry)
        why = F.STOPPING
        if self.removing:  # (module remove: the rank goes on; a client may watch again)
            why = (F.RELOADED if self.stop_reason == RELOAD
                   else F.REMOVED).format(rank=self.ctx.rank)
        elif self.stop_reason:
            why += f" ({self.stop_reason[:200]})"
        # Every watch registered, not only those of a monitor: a watcher
        # whose namespace was removed has left its monitor, and ends only
        # once its queued roots are answered -- lookups that a stop leaves
        # unanswered for ever (and a namespace watch is registered too)
        for tags in list(self.clients.values()):
            for w in list(tags.values()):
                w.fail(errno.ENOSYS, why)

    def parked(self) -> list[Message]:
        """``module reload kvs-watch``: the lookups that have answered
        nothing yet -- a WAITCREATE one waiting for its key or namespace,
        one still reading its first value -- go to the new module, oldest
        first, as if they came now: their clients have seen nothing the new
        module would show again.  One that has answered (a stream's first
        value, the INITIAL_SENTINEL) must not: the new module would answer
        its first value again; it ends ``RELOADED`` at :meth:`stop`, and a
        reconnecting client asks again and resumes.  So do the namespace
        watches, and a watcher whose namespace was removed (it ends once
        its queued roots are answered; a new one could wait for the next
        namespace of the name)."""
        waiting = [w for tags in self.clients.values() for w in tags.values()
                   if isinstance(w, Watcher) and not (w.done or w.responded or w.sentinel_sent)
                   and w.closing is None]
        waiting.sort(key=lambda w: w.arrival)
        for w in waiting:
            w.finish()  # (forgotten without an answer, its caps' places freed)
            w.msg.payload = {"namespace": w.namespace, "key": w.key, "flags": w.flags}
        return [w.msg for w in waiting]

    # ================================================================ requests

    def lookup(self, msg: Message) -> None:
        p = require(msg.payload, key=str, flags=int)
        name = p.get("namespace")
        if name is None:
            name = PRIMARY
        elif not isinstance(name, str):
            raise ProtocolError("field 'namespace' has the wrong type")
        if msg.noresponse:
            raise ProtocolError("kvs-watch.lookup needs a response")
        flags = F.check(p["flags"], msg.streaming)
        key = check_key(p["key"])
        check_name(name)
        self._check_caps(msg)
        msg.payload = None  # parsed: keep only the envelope
        w = Watcher(self, msg, key, flags, name)
        w.arrival = next(self._arrivals)
        self._register(w)
        mon = self.monitors.get(name)
        if mon is None:
            mon = self._new_monitor(name, bool(flags & F.WAITCREATE))
        elif not flags & F.WAITCREATE:
            self._join_fresh(mon, w)
            return
        mon.add(w)

    def _check_caps(self, msg: Message) -> None:
        """Refuse a watch that would exceed a cap, or reuse a matchtag."""
        tags = self.clients.get(tuple(msg.route))
        if tags is not None and msg.matchtag in tags:
            raise ProtocolError(f"matchtag {msg.matchtag} is already watching")
        if tags is not None and len(tags) >= self.max_client_watches:
            self.counts["refused-over-cap"] += 1
            raise ErrnoError(errno.ENOSPC, f"this client has {len(tags)} watches on rank "
                                           f"{self.ctx.rank} (kvs-watch.max-watches-per-"
                                           "client): end some first")
        if not msg.is_owner and self.guest_watches[msg.userid] >= self.max_guest_watches:
            self.counts["refused-over-cap"] += 1
            raise ErrnoError(errno.ENOSPC, f"this user has {self.guest_watches[msg.userid]} "
                                           f"watches on rank {self.ctx.rank} (kvs-watch.max-"
                                           "watches-per-guest): end some first")

    def _register(self, w: Watcher | NsWatcher) -> None:
        """Count a new watch (its client's, its guest's) so cancel and
        disconnect find it."""
        msg = w.msg
        route = tuple(msg.route)
        tags = self.clients.get(route)
        if tags is None:
            tags = self.clients[route] = {}
        tags[msg.matchtag] = w
        if not msg.is_owner:
            self.guest_watches[msg.userid] += 1
        self.nwatchers += 1
        self.counts["watchers-created"] += 1

    def watch_namespaces(self, msg: Message) -> None:
        """``kvs-watch.namespaces``: list, then follow (:mod:`kvs_watch.nswatch`).

        The hub hears the events for the watcher before its list is asked
        for, so none made after the list is missed; rank 0's ``epoch`` in
        the list says which ones it already holds (the first list builds
        the hub's one table of namespaces, the others say when the table
        has all the watcher must be told).  Open to guests, who are told of their
        own namespaces only: the module asks the list as the owner it runs
        as, and filters."""
        p = msg.payload if msg.payload is not None else {}
        if not isinstance(p, dict):
            raise ProtocolError("the payload must be a map")
        prefix = p.get("prefix", "")
        if not isinstance(prefix, str):
            raise ProtocolError("field 'prefix' has the wrong type")
        flags = check_ns_flags(p.get("flags", 0))
        if not msg.streaming or msg.noresponse:
            raise ErrnoError(errno.EPROTO, "kvs-watch.namespaces must be a streaming RPC")
        self._check_caps(msg)
        msg.payload = None
        w = self.ns.add(msg, prefix, flags)
        self._register(w)
        self.counts["namespace-watchers-created"] += 1
        if w.flags & NOLIST:  # (no list to end: the marker says the watch has started)
            self.respond_ns(w, {"event": "listed"})
            return
        self.spawn(self._list_for(w))

    async def _list_for(self, w: NsWatcher) -> None:
        """Ask rank 0 for ``w``'s list, as a stream (in parts that each fit
        a link, however many namespaces), and give it to the hub whole."""
        try:
            listing = await gather_namespace_list(self.h, 0)
        except Exception as exc:
            if not w.done:
                errnum = exc.errnum if isinstance(exc, ErrnoError) else errno.EIO
                w.fail(errnum, f"kvs.namespace-list: {error_text(exc)}")
            return
        if not w.done:
            self.ns.listed(w, listing)

    def cancel(self, msg: Message) -> None:
        tag = require(msg.payload, matchtag=int)["matchtag"]
        tags = self.clients.get(tuple(msg.route))
        w = tags.get(tag) if tags else None
        if w is not None:
            self.counts["cancelled"] += 1
            w.fail(errno.ENODATA)
        self.h.respond(msg, {})

    def disconnect(self, msg: Message) -> None:
        """Drop a gone client's watchers, :data:`DROP_PER_TURN` per turn of
        the loop: all at once, a client leaving with 100,000 watches held
        the rank 0.4-1 s (4-10 us each), and every other client waited.
        The client is forgotten at once (no cancel matches it); a watcher
        not dropped yet still counts (``watchers``, a guest's cap) and may
        answer, to no one (the router drops it)."""
        tags = self.clients.pop(tuple(msg.route), None)
        if tags:
            self.counts["disconnected"] += len(tags)
            self._drop(list(tags.values()), 0)

    def _drop(self, watchers: list[Watcher | NsWatcher], start: int) -> None:
        end = start + DROP_PER_TURN
        for w in watchers[start:end]:
            w.finish()
        if end < len(watchers):
            asyncio.get_running_loop().call_soon(self._drop, watchers, end)

    # ================================================================ monitors

    def _new_monitor(self, name: str, waitcreate: bool) -> Monitor:
        """A monitor for ``name``, started at the root ``kvs.getroot`` answers.

        Its events are followed from now on, so no commit slips in before
        that root.  A ``WAITCREATE`` watcher's may be the root this rank
        heard (``heard``: no round trip to rank 0 for a namespace just
        created, the job pattern), which may lag rank 0's: it waits for
        what is missing there, and the setroots in flight bring it.  For
        other watchers the kvs answers as for a read (its loaded namespace,
        else rank 0's root): one that does not wait must not miss a key
        only because the rank heard the namespace a moment before."""
        mon = self.monitors[name] = Monitor(name)
        req: dict[str, Any] = {"namespace": name}
        if waitcreate:
            req["heard"] = True
        fut = self.ask_kvs(lambda: self.h.rpc("kvs.getroot", req))
        fut.add_done_callback(lambda f: self._getroot_done(mon, f))
        return mon

    def _join_fresh(self, mon: Monitor, w: Watcher) -> None:
        """A watcher that does not wait joins a monitor that exists: it
        starts at the root a read on this rank sees (``kvs.getroot``), or
        the monitor's if that is newer.  The monitor's may lag a read's: a
        WAITCREATE watcher's monitor took the root this rank heard, or the
        ``created`` event's, while a commit's setroot was still on its way
        (a watch then ended ENOENT, or ENOTSUP, for a key a get on the same
        rank returned)."""
        mon.join(w)
        fut = self.ask_kvs(lambda: self.h.rpc("kvs.getroot", {"namespace": mon.name}))
        fut.add_done_callback(lambda f: self._fresh_root(mon, w, f))

    def _fresh_root(self, mon: Monitor, w: Watcher, fut: Any) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()  # (read even when unwanted: else asyncio logs it "never retrieved")
        if w.done:  # (ended meanwhile: its namespace removed, say, which fails the getroot too)
            return
        if exc is not None:
            errnum = exc.errnum if isinstance(exc, ErrnoError) else errno.EIO
            w.fail(errnum, f"namespace {mon.name!r} does not exist" if errnum == errno.ENOTSUP
                   else f"kvs.getroot {mon.name}: {error_text(exc)}")
            return
        try:
            r = fut.result()
            seq, ref = int(r["rootseq"]), str(r["rootref"])
        except (KeyError, TypeError, ValueError):
            w.fail(errno.EPROTO, "malformed kvs.getroot answer")
            return
        if self.monitors.get(mon.name) is not mon:  # (its namespace was removed since)
            w.fail(errno.ENOTSUP, f"namespace {mon.name} was removed")
            return
        if mon.state != READY:  # the namespace exists: the monitor starts here too
            self._start(mon, mon.set_root(seq, ref, r.get("owner")))
        if mon.rootseq >= seq:
            mon.start(w)
        else:
            mon.start(w, seq, ref)

    def _drop_monitor(self, mon: Monitor) -> None:
        if self.monitors.get(mon.name) is mon:
            del self.monitors[mon.name]

    def _getroot_done(self, mon: Monitor, fut: Any) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if self.monitors.get(mon.name) is not mon or mon.state != INIT:
            return  # gone, or an event already gave us a root
        try:
            if exc is None:
                r = fut.result()
                self._start(mon, mon.set_root(int(r["rootseq"]), str(r["rootref"]),
                                              r.get("owner")))
            elif isinstance(exc, ErrnoError) and exc.errnum == errno.ENOTSUP:
                mon.state = MISSING  # WAITCREATE watchers wait for the created event
                for w in list(mon.waiting or ()):
                    if not w.flags & F.WAITCREATE:
                        w.fail(errno.ENOTSUP, f"namespace {mon.name!r} does not exist")
            else:
                errnum = exc.errnum if isinstance(exc, ErrnoError) else errno.EIO
                for w in list(mon.watchers):
                    w.fail(errnum, f"kvs.getroot {mon.name}: {error_text(exc)}")
        except (KeyError, TypeError, ValueError) as e:
            log.error("bad kvs.getroot answer for %s: %s", mon.name, e)
            for w in list(mon.watchers):
                w.fail(errno.EPROTO, "malformed kvs.getroot answer")

    def _start(self, mon: Monitor, watchers: list[Watcher]) -> None:
        for w in watchers:
            if not w.done:
                mon.start(w)

    # ================================================================ events

    def on_event(self, msg: Message) -> None:
        topic = msg.topic
        parts = event_topic_parts(topic)
        mon, kind = (self.monitors.get(parts[0]), parts[1]) if parts else (None, "")
        if (self.ns.watchers and parts and kind in ("created", "removed")
                and msg.userid == self.ctx.owner_uid):
            heard = self._ns_event(parts[0], kind, msg)
            if mon is None:
                if heard:
                    self.events.handled += 1
                else:
                    self.events.drop("foreign")
                return
        if mon is None or kind not in EVENT_KINDS or msg.userid != self.ctx.owner_uid:
            self.events.drop("foreign")
            return
        if kind == "error":
            self.events.drop("error")
            return
        try:
            p = msg.payload
        except ProtocolError:
            p = None
        if not isinstance(p, dict) or p.get("namespace") != mon.name:
            self.events.drop("foreign")
            return
        seq: Any = p.get("rootseq")
        ref: Any = p.get("rootref")
        if kind != "removed" and (type(seq) is not int or not blobref.is_valid(ref)):
            # fields rank 0's kvs never sends, dropped as the kvs module
            # drops them: a root "5" was taken (the watch then ended EINVAL,
            # its rootseq above every real commit's), a float rootseq
            # raised out of here, received but neither handled nor dropped
            self.events.drop("foreign")
            return
        try:
            if kind == "setroot":
                self._setroot(mon, seq, ref, p)
            elif kind == "created":
                if mon.state != READY:
                    self._start(mon, mon.set_root(seq, ref, p.get("owner")))
            else:
                self._removed(mon)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("malformed %s event: %s", topic, exc)
            self.events.drop("foreign")
            return
        self.events.handled += 1

    def _ns_event(self, name: str, kind: str, msg: Message) -> bool:
        """Tell the namespace watchers of a ``created`` or ``removed``
        event; False (dropped as foreign) if its fields are not rank 0's."""
        try:
            p = msg.payload
        except ProtocolError:
            return False
        if not isinstance(p, dict) or p.get("namespace") != name:
            return False
        owner, epoch = p.get("owner", -1), p.get("epoch")
        if type(owner) is not int or not (epoch is None or type(epoch) is int):
            return False
        if kind == "created" and (epoch is None or type(p.get("rootseq")) is not int
                                  or not blobref.is_valid(p.get("rootref"))):
            return False
        self.ns.event(kind, name, owner, epoch)
        return True

    def _setroot(self, mon: Monitor, seq: int, ref: str, p: dict[str, Any]) -> None:
        if mon.state == READY and seq <= mon.rootseq:
            return  # older than what getroot told us
        started = mon.set_root(seq, ref, p.get("owner"))
        if started:  # the first root this monitor sees: everyone starts here
            self._start(mon, started)
            return
        keys = p.get("keys")
        for w in mon.concerned(keys):
            w.push(seq, ref)
        if mon.keyed:
            for w in list(mon.keyed):
                w.push_keys(seq, ref, keys)

    def _removed(self, mon: Monitor) -> None:
        """Every watcher of the namespace ends ``ENOTSUP``, after answering
        the roots it has queued (commits made before the removal).

        A monitor with no root yet has watchers that have seen nothing of
        the namespace: its ``kvs.getroot`` was answered with a root of it,
        or ``ENOTSUP``, but the answer's callback runs after the events
        delivered meanwhile, this one included.  They start after the
        removal, as a watch sent a moment later would: a ``WAITCREATE``
        one waits for the next namespace of the name, the others end
        ``ENOTSUP``, no such namespace.  (Every one used to end ``ENOTSUP``
        with no answer, which no order of its request and the removal
        gives.)"""
        self.counts["namespaces-removed"] += 1
        if mon.state != READY:
            mon.state = MISSING  # (the answer on its way is not taken: see _getroot_done)
            for w in list(mon.watchers):
                if not w.flags & F.WAITCREATE:
                    w.fail(errno.ENOTSUP, f"namespace {mon.name!r} does not exist")
            return  # (none waiting: the last watcher to end dropped the monitor)
        for w in list(mon.watchers):
            w.fail_after_queue(errno.ENOTSUP, f"namespace {mon.name} was removed")
        self._drop_monitor(mon)

    # ================================================================ watcher backend

    def ask_kvs(self, send: Callable[[], asyncio.Future[Any]]) -> asyncio.Future[Any]:
        """``send()``'s answer -- a request to the kvs module -- asked again
        (at most :data:`KVS_RELOAD_TRIES` times) while it ends
        :data:`KVS_RELOADED`: the kvs that took it was replaced, and the
        new one serves it."""
        outer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        tries = 0

        def answered(inner: asyncio.Future[Any]) -> None:
            nonlocal tries
            if outer.done():
                return
            if inner.cancelled():
                outer.cancel()
                return
            exc = inner.exception()
            if (isinstance(exc, ErrnoError) and exc.errnum == errno.ENOSYS
                    and exc.errstr == KVS_RELOADED and tries < KVS_RELOAD_TRIES):
                tries += 1
                self.counts["asked-again-kvs-reloaded"] += 1
                try:
                    send().add_done_callback(answered)
                except ErrnoError as again:  # (this module's handle closed: it stops too)
                    outer.set_exception(again)
            elif exc is not None:
                outer.set_exception(exc)
            else:
                outer.set_result(inner.result())

        send().add_done_callback(answered)
        return outer

    def lookup_at(self, w: Watcher, rootref: str, flags: int,
                  after: tuple[int, bytes] | None = None) -> Any:
        """One ``kvs.lookup-plus`` per key, root, flags and credentials in
        flight: the watchers of one key that a commit wakes share it
        (100,000 watches of a key cost ~2 s of rank time per commit when
        each made its own).  A result is read, never changed, by the
        watchers.  ``lookup-plus``, not ``lookup``: it answers a missing key
        as data, so its ``ENOENT`` can only mean the root's blobs are gone
        (collected while the watcher lagged), which the watcher must not
        take for "no such key"."""
        self.counts["lookups"] += 1
        who = -1 if w.msg.is_owner else w.msg.userid  # a guest's answer may differ
        k = (w.namespace, w.key, rootref, flags, who, after)
        fut = self._lookups.get(k)
        if fut is not None:
            self.counts["lookups-shared"] += 1
            return fut
        payload = {"key": w.key, "flags": flags, "namespace": w.namespace,
                   "rootdir": {"ver": 1, "type": "dirref", "data": [rootref]}}
        if after is not None:  # (an APPEND watcher: only the blobs after its own)
            payload["after"], payload["mark"] = after
        msg = w.msg
        if msg.is_owner:
            fut = self.ask_kvs(lambda: self.h.rpc("kvs.lookup-plus", payload))
        else:
            fut = self.ask_kvs(lambda: self.h.rpc_as(msg, "kvs.lookup-plus", payload))
        self._lookups[k] = fut
        fut.add_done_callback(lambda f: self._lookups.pop(k, None)
                              if self._lookups.get(k) is f else None)
        return fut

    def current_root(self, w: Watcher) -> Any:
        """Rank 0's current root of ``w``'s namespace, for a watcher whose
        newest root was collected before it could read it (rank 0 made
        the newer one; its setroot may not concern the watcher's key).
        One ``kvs.getroot`` per namespace in flight: a commit wakes many
        watchers of a key at once."""
        name = w.namespace
        fut = self._current.get(name)
        if fut is None:
            fut = self._current[name] = self.ask_kvs(
                lambda: self.h.rpc("kvs.getroot", {"namespace": name}, nodeid=0))
            fut.add_done_callback(lambda f: self._current.pop(name, None)
                                  if self._current.get(name) is f else None)
        return fut

    def load(self, ref: str) -> Any:
        self.counts["blob-loads"] += 1
        return self.h.rpc("content.load", {"blobref": ref})

    def respond(self, w: Watcher, payload: Any) -> None:
        self.counts["answers"] += 1
        self.h.respond(w.msg, payload)

    def respond_error(self, w: Watcher, errnum: int, errstr: str | None) -> None:
        self.h.respond_error(w.msg, errnum, errstr)

    def respond_ns(self, w: NsWatcher, payload: dict[str, Any]) -> None:
        self.counts["answers"] += 1
        self.h.respond(w.msg, payload)

    def respond_error_ns(self, w: NsWatcher, errnum: int, errstr: str | None) -> None:
        self.h.respond_error(w.msg, errnum, errstr)

    def ended_ns(self, w: NsWatcher) -> None:
        self._forget(w)

    def ended(self, w: Watcher) -> None:
        self._forget(w)
        mon = w.monitor
        if mon is not None:
            mon.remove(w)
            if not mon.watchers:
                self._drop_monitor(mon)

    def _forget(self, w: Watcher | NsWatcher) -> None:
        """Uncount a watch that ended (:meth:`_register`)."""
        msg = w.msg
        route = tuple(msg.route)
        tags = self.clients.get(route)
        if tags is not None and tags.get(msg.matchtag) is w:
            del tags[msg.matchtag]
            if not tags:
                del self.clients[route]
        self.nwatchers -= 1
        if not msg.is_owner:
            left = self.guest_watches[msg.userid] - 1
            if left:
                self.guest_watches[msg.userid] = left
            else:
                del self.guest_watches[msg.userid]

    def hash_blob(self, data: bytes) -> str:
        return blobref.hash_blob(data, self.hash_name)

    def folded(self, w: Watcher) -> None:
        self.counts["roots-folded"] += 1

    # ================================================================ stats

    def stats_get(self, msg: Message) -> None:
        """``kvs-watch.stats-get``, open to guests (as in Flux), but a guest
        sees only its own namespaces (:meth:`guest_stats`), not even the
        names of the others.  In Flux a root reference is a capability for
        anyone, so showing another's let a guest read every key of a
        namespace someone watches (here kvs refuses a guest's ``rootdir``
        that is not its own anyway); and the instance-wide figures
        (``watchers``, ``events.received``, ``counts``...) move with what
        other users watch and commit, which a guest could follow."""
        if msg.is_owner:
            self.h.respond(msg, self.stats())
        else:
            self.h.respond(msg, self.guest_stats(msg.userid))

    def guest_stats(self, userid: int) -> dict[str, Any]:
        """A guest's view, all of it (an allow-list, as ``kvs.stats-get``'s):
        ``rank``, ``userid``'s namespaces (at most
        :data:`STATS_NAMESPACES`, chosen before the cut, so a guest whose
        namespaces came after the rank's first 100 still sees them) and
        their count."""
        mine = [(name, mon) for name, mon in self.monitors.items() if mon.owner == userid]
        return {"rank": self.ctx.rank, "namespace-count": len(mine),
                "namespaces": {name: mon.describe()
                               for name, mon in islice(mine, STATS_NAMESPACES)}}

    def stats(self) -> dict[str, Any]:
        """The instance owner's view: the counters, and at most
        :data:`STATS_NAMESPACES` namespaces."""
        return {
            "rank": self.ctx.rank,
            "watchers": self.nwatchers,
            "namespace-watchers": len(self.ns.watchers),
            "namespace-count": len(self.monitors),
            # Work still under way, for a caller waiting until the service
            # has caught up (e.g. a benchmark after creating 64K watchers):
            # monitors still waiting for their first root, and kvs.lookup
            # requests not yet answered.
            "monitors-starting": sum(1 for m in self.monitors.values() if m.state == INIT),
            "lookups-in-flight": len(self._lookups),
            "namespaces": {name: mon.describe()
                           for name, mon in islice(self.monitors.items(), STATS_NAMESPACES)},
            "clients": len(self.clients),
            "guest-users": len(self.guest_watches),
            "max-backlog": self.max_backlog,
            "counts": dict(self.counts),
            "events": self.event_stats(),
        }
