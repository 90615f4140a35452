"""One ``kvs-watch.namespaces`` request: the namespaces that exist, then
each one created or removed, as a stream.

Why here: job workers discover jobs by their namespaces, and the
``kvs.namespace-<NS>-created``/``-removed`` events are private to the
instance owner (they carry roots, a capability for a guest).  kvs-watch
already follows them on every rank with its one subscription, so a watcher
of namespaces costs no subscription and no event of its own.

List, then follow, without a gap or a duplicate (etcd's list-then-watch
with a revision; here the revision is rank 0's namespace *epoch*, which
numbers every namespace-create).  What was reported lives once per module,
in :class:`NsHub`'s *table* of the namespaces alive (name -> epoch, owner),
kept while any watcher lists; a watcher keeps its list's epoch only (each
kept what it had reported before: ~200 bytes per watcher and namespace).

1. the watcher is registered: from now on the hub hears every event for
   it (buffered while the table has no list yet);
2. ``kvs.namespace-list`` is asked of rank 0; its answer is the namespaces
   alive when rank 0 answered, and ``epoch``, the last epoch given by then;
3. the first list to come builds the table, which then takes the buffered
   events, then each event as it comes, by the rule below;
4. the watcher is served once the table's epoch has reached its list's
   (the table holds every namespace made before its request): the table's
   namespaces it may see (``initial``), one ``{event: "listed"}`` answer
   (the list is complete, even when it is empty -- without it a client
   could not tell "no namespace yet" from "the list is on its way", nor
   when its watch has started), then each change the table takes.

The rule, for the table: a ``created`` event of epoch ``e`` at or below the
table's epoch was made before its list and is in it (or removed before
it): dropped; one above it is taken, and the table's epoch becomes ``e``.
A ``removed`` event names its epoch: it is taken only if the table holds
that namespace, name *and* epoch, so a removal made before the list, of a
namespace the list no longer holds or of an earlier one of the same name,
is dropped.  This holds whatever the order in which the list's answer and
the events reach this rank: an event made before the list is covered by
the list, one made after it comes after the table started buffering (the
request left this rank after that).

No gap, no duplicate, for each watcher: it is served the table in one go
(no event in between), and then told of every change the table takes.
So, by induction over the events, the namespaces it was told exist and
were not told removed are exactly the table's that it may see: a change is
reported iff the table changes, a removal only of what the table held (and
the watcher was therefore told of), a creation only of what it did not.

With :data:`NOLIST` the list is skipped: creations and removals from the
request on, nothing buffered, and the ``listed`` answer at once (no list
to end, but the watch has started: a client that waits for it knows that
a namespace it creates next is reported, as etcd's watch-created answer).
A guest is told of its own namespaces only (``owner``), the instance owner
of all; ``prefix`` filters by name.
"""

from __future__ import annotations

import errno
from typing import Any, Protocol

from broker.errors import ErrnoError
from broker.message import Message

NOLIST = 1
"""Flag: skip the initial list, report changes only."""
ALL_FLAGS = NOLIST


def check_flags(flags: object) -> int:
    if type(flags) is not int:
        raise ErrnoError(errno.EPROTO, "flags must be an integer")
    if flags & ~ALL_FLAGS or flags < 0:
        raise ErrnoError(errno.EINVAL, f"unknown kvs-watch.namespaces flags "
                                       f"{flags & ~ALL_FLAGS:#x}")
    return flags


class NsBackend(Protocol):
    """What the namespace watchers need from their module."""

    max_backlog: int

    def respond_ns(self, w: NsWatcher, payload: dict[str, Any]) -> None: ...

    def respond_error_ns(self, w: NsWatcher, errnum: int, errstr: str | None) -> None: ...

    def ended_ns(self, w: NsWatcher) -> None:
        """``w`` is finished: forget it (after :meth:`NsHub.remove`)."""


class NsWatcher:
    """The state of one ``kvs-watch.namespaces`` request: O(1), whatever the
    number of namespaces (what it was told lives in the hub's table)."""

    __slots__ = ("hub", "msg", "prefix", "flags", "list_epoch", "following", "done")

    def __init__(self, hub: NsHub, msg: Message, prefix: str, flags: int) -> None:
        self.hub = hub
        self.msg = msg
        self.prefix = prefix
        self.flags = flags
        self.list_epoch = -1
        """Its list's epoch: it is served once the table has reached it."""
        self.following = bool(flags & NOLIST)
        """Fed the events (listed and served, or NOLIST)."""
        self.done = False

    def __repr__(self) -> str:
        return (f"<NsWatcher prefix={self.prefix!r} tag={self.msg.matchtag}"
                f"{' done' if self.done else ''}>")

    def visible(self, name: str, owner: int) -> bool:
        """Matches the prefix and may be seen: the instance owner sees every
        namespace, a guest only its own."""
        return name.startswith(self.prefix) and (
            self.msg.is_owner or (owner >= 0 and owner == self.msg.userid))

    def send(self, name: str, owner: int, event: str, epoch: int | None,
             initial: bool = False) -> None:
        p: dict[str, Any] = {"namespace": name, "owner": owner, "event": event}
        if epoch is not None:
            p["epoch"] = epoch
        if initial:
            p["initial"] = True
        self.hub.backend.respond_ns(self, p)

    def fail(self, errnum: int, errstr: str | None = None) -> None:
        """End the watch with an error response (``ENODATA``: normal end)."""
        if self.done:
            return
        self.hub.backend.respond_error_ns(self, errnum, errstr)
        self.finish()

    def finish(self) -> None:
        """End the watch without a response (the client went away)."""
        if not self.done:
            self.done = True
            self.hub.remove(self)
            self.hub.backend.ended_ns(self)


class NsHub:
    """The module's namespace watchers and its one table of the namespaces
    alive, kept while a watcher that lists (not :data:`NOLIST`) exists.

    Why one table: a watcher that kept what it had reported cost ~200 bytes
    per namespace (100 watchers of 64K namespaces: 1.3 GB); the table costs
    that once, a watcher ~0.5 KB.
    """

    def __init__(self, backend: NsBackend) -> None:
        self.backend = backend
        self.watchers: dict[NsWatcher, None] = {}
        """Every watcher in progress."""
        self.listing = 0
        """Watchers in progress that list: the table is kept while any."""
        self.live: dict[str, tuple[int, int]] | None = None
        """The table: name -> (epoch, owner), in creation order (None: not
        built yet -- its first list has not come)."""
        self.epoch = -1
        """The table's epoch: its list's, then the last ``created`` taken."""
        self.buffer: list[tuple[str, str, int, int | None]] | None = None
        """Events heard while the table's first list is asked for."""
        self.waiting: dict[NsWatcher, None] = {}
        """Listed watchers whose list epoch the table has not reached yet
        (a dict, not a list: a watcher leaves it in O(1) -- cancelling
        30,000 waiting watchers from a list took 10 s, each a scan)."""

    def add(self, msg: Message, prefix: str, flags: int) -> NsWatcher:
        """A new watcher, hearing the events from now on (a lister: its list
        must then be asked of rank 0, and given to :meth:`listed`)."""
        w = NsWatcher(self, msg, prefix, flags)
        self.watchers[w] = None
        if not w.following:
            self.listing += 1
            if self.live is None and self.buffer is None:
                self.buffer = []
        return w

    def remove(self, w: NsWatcher) -> None:
        if w not in self.watchers:
            return
        del self.watchers[w]
        if w.flags & NOLIST:
            return
        self.waiting.pop(w, None)
        self.listing -= 1
        if not self.listing:  # no one needs the table: its memory goes
            self.live = self.buffer = None
            self.epoch = -1

    # ------------------------------------------------------------ input

    def listed(self, w: NsWatcher, resp: Any) -> None:
        """``w``'s ``kvs.namespace-list`` answer.  The first one builds the
        table (and it takes the events buffered meanwhile); ``w`` is served
        the table once it holds every namespace created up to its list."""
        if w.done:
            return
        try:
            epoch = resp["epoch"]
            if type(epoch) is not int:
                raise TypeError("epoch")
            entries = ([(int(d["epoch"]), str(d["namespace"]), int(d["owner"]))
                        for d in resp["namespaces"]] if self.live is None else [])
        except (KeyError, TypeError, ValueError):
            w.fail(errno.EPROTO, "malformed kvs.namespace-list answer")
            return
        w.list_epoch = epoch
        if self.live is None:
            entries.sort()  # in creation order
            self.live = {name: (e, owner) for e, name, owner in entries}
            self.epoch = epoch
            buffered, self.buffer = self.buffer or [], None
            for kind, name, owner, ev_epoch in buffered:
                self._apply(kind, name, owner, ev_epoch)
        if epoch <= self.epoch:
            self._serve(w)
        else:
            self.waiting[w] = None

    def event(self, kind: str, name: str, owner: int, epoch: int | None) -> None:
        """A ``created`` or ``removed`` event (``owner`` -1 if it said none)."""
        for w in list(self.watchers):  # changes only: every event, as it comes
            if w.flags & NOLIST and not w.done and w.visible(name, owner):
                if kind == "removed" or epoch is not None:
                    w.send(name, owner, kind, epoch)
        if self.live is None:
            buf = self.buffer
            if buf is None:
                return
            if len(buf) >= self.backend.max_backlog:
                for w in [w for w in self.watchers if not w.flags & NOLIST]:
                    w.fail(errno.EOVERFLOW, "more namespaces came and went than "
                           "kvs-watch.max-backlog while the list was asked for")
                return
            buf.append((kind, name, owner, epoch))
            return
        self._apply(kind, name, owner, epoch)
        if kind == "created" and self.waiting:
            ready = [w for w in self.waiting if w.list_epoch <= self.epoch]
            for w in ready:
                del self.waiting[w]
                self._serve(w)

    def _apply(self, kind: str, name: str, owner: int, epoch: int | None) -> None:
        """Take an event into the table, and tell the served watchers that
        may see it of a change."""
        live = self.live
        assert live is not None
        if kind == "created":
            if epoch is None or epoch <= self.epoch:
                return  # in the table already (or removed before its list)
            self.epoch = epoch
            live.pop(name, None)  # (cannot be there: its removal came first)
            live[name] = (epoch, owner)
            for w in list(self.watchers):
                if w.following and not w.flags & NOLIST and w.visible(name, owner):
                    w.send(name, owner, "created", epoch)
            return
        got = live.get(name)
        if got is None or (epoch is not None and got[0] != epoch):
            return  # not in the table: removed before its list, or an earlier one
        del live[name]
        for w in list(self.watchers):
            if w.following and not w.flags & NOLIST and w.visible(name, got[1]):
                w.send(name, got[1], "removed", got[0])

    def _serve(self, w: NsWatcher) -> None:
        """The table as ``w`` may see it, ``listed``, then the events."""
        live = self.live
        assert live is not None
        for name, (e, owner) in list(live.items()):
            if w.done:
                return
            if w.visible(name, owner):
                w.send(name, owner, "created", e, initial=True)
        if not w.done:
            self.backend.respond_ns(w, {"event": "listed"})
            w.following = True
