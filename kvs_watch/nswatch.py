"""One ``kvs-watch.namespaces`` request: the namespaces that exist, then
each one created or removed, as a stream.

Why here: job workers discover jobs by their namespaces, and the
``kvs.namespace-<NS>-created``/``-removed`` events are private to the
instance owner (they carry roots, a capability for a guest).  kvs-watch
already follows them on every rank with its one subscription, so a watcher
of namespaces costs no subscription and no event of its own.

List, then follow, without a gap or a duplicate (etcd's list-then-watch
with a revision; here the revision is rank 0's namespace *epoch*, which
numbers every namespace-create):

1. the watcher is registered (it hears every event from now on, buffered);
2. ``kvs.namespace-list`` is asked of rank 0; its answer is the namespaces
   alive at the moment rank 0 answered, and ``epoch``, the last epoch given
   by then;
3. the list is answered (``initial``), then one ``{event: "listed"}``
   answer (no namespace): the list is complete, even when it is empty --
   without it a client could not tell "no namespace yet" from "the list is
   on its way", nor when its watch has started; then the buffered events,
   then the events as they come, each by the rule below.

A ``created`` event of epoch ``e <= epoch`` was made before the list and is
in it (or removed before it): dropped.  One after the list is answered.  A
``removed`` event names its epoch: it is answered only if that namespace
(name *and* epoch) was answered as existing, so a removal made before the
list, of a namespace the list no longer holds or of an earlier one of the
same name, is never reported.  The rule holds whatever the order in which
the list's answer and the events reach this rank: an event made before the
list is covered by the list, one made after it comes after the watcher was
registered (the request left this rank after that).

With :data:`NOLIST` the list is skipped: creations and removals from the
request on, nothing buffered, and no ``listed`` answer (no list to end).
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
    """What a namespace watcher needs from its module."""

    max_backlog: int

    def respond_ns(self, w: NsWatcher, payload: dict[str, Any]) -> None: ...

    def respond_error_ns(self, w: NsWatcher, errnum: int, errstr: str | None) -> None: ...

    def ended_ns(self, w: NsWatcher) -> None:
        """``w`` is finished: forget it."""


class NsWatcher:
    """The state of one ``kvs-watch.namespaces`` request (module docstring)."""

    __slots__ = ("backend", "msg", "prefix", "flags", "list_epoch", "buffer", "reported",
                 "done")

    def __init__(self, backend: NsBackend, msg: Message, prefix: str, flags: int) -> None:
        self.backend = backend
        self.msg = msg
        self.prefix = prefix
        self.flags = flags
        self.list_epoch = -1
        """The list's epoch: a created event at or below it is in the list."""
        self.buffer: list[tuple[str, str, int, int | None]] | None = (
            None if flags & NOLIST else [])
        """Events heard while the list is asked for (None: listed, or NOLIST)."""
        self.reported: dict[str, tuple[int, int]] = {}
        """Namespaces answered as existing: name -> (epoch, owner)."""
        self.done = False

    def __repr__(self) -> str:
        return (f"<NsWatcher prefix={self.prefix!r} tag={self.msg.matchtag}"
                f"{' done' if self.done else ''}>")

    def visible(self, name: str, owner: int) -> bool:
        """Matches the prefix and may be seen: the instance owner sees every
        namespace, a guest only its own."""
        return name.startswith(self.prefix) and (
            self.msg.is_owner or (owner >= 0 and owner == self.msg.userid))

    # ------------------------------------------------------------ input

    def listed(self, resp: Any) -> None:
        """The ``kvs.namespace-list`` answer: report it, then what was buffered."""
        if self.done:
            return
        try:
            epoch = resp["epoch"]
            entries = [(int(d["epoch"]), str(d["namespace"]), int(d["owner"]))
                       for d in resp["namespaces"]]
            if type(epoch) is not int:
                raise TypeError("epoch")
        except (KeyError, TypeError, ValueError):
            self.fail(errno.EPROTO, "malformed kvs.namespace-list answer")
            return
        self.list_epoch = epoch
        for e, name, owner in sorted(entries):  # in creation order
            if self.visible(name, owner):
                self.reported[name] = (e, owner)
                self._send(name, owner, "created", e, initial=True)
        self.backend.respond_ns(self, {"event": "listed"})
        buffered, self.buffer = self.buffer or [], None
        for kind, name, owner, ev_epoch in buffered:
            if self.done:
                return
            self._apply(kind, name, owner, ev_epoch)

    def event(self, kind: str, name: str, owner: int, epoch: int | None) -> None:
        """A ``created`` or ``removed`` event (``owner`` -1 if it said none)."""
        if self.done:
            return
        buf = self.buffer
        if buf is not None:
            if len(buf) >= self.backend.max_backlog:
                self.fail(errno.EOVERFLOW, "more namespaces came and went than "
                          "kvs-watch.max-backlog while the list was asked for")
                return
            buf.append((kind, name, owner, epoch))
            return
        self._apply(kind, name, owner, epoch)

    def _apply(self, kind: str, name: str, owner: int, epoch: int | None) -> None:
        if kind == "created":
            if epoch is None or epoch <= self.list_epoch:
                return  # in the list already (or removed before it)
            if self.visible(name, owner):
                self.reported[name] = (epoch, owner)
                self._send(name, owner, "created", epoch)
            return
        got = self.reported.get(name)
        if got is not None:
            if epoch is not None and got[0] != epoch:
                return  # an earlier namespace of that name, gone before the list
            del self.reported[name]
            self._send(name, got[1], "removed", got[0])
        elif self.flags & NOLIST and self.visible(name, owner):
            # (created before the watch: its removal is a change the caller asked for)
            self._send(name, owner, "removed", epoch)

    def _send(self, name: str, owner: int, event: str, epoch: int | None,
              initial: bool = False) -> None:
        p: dict[str, Any] = {"namespace": name, "owner": owner, "event": event}
        if epoch is not None:
            p["epoch"] = epoch
        if initial:
            p["initial"] = True
        self.backend.respond_ns(self, p)

    # ------------------------------------------------------------ end

    def fail(self, errnum: int, errstr: str | None = None) -> None:
        """End the watch with an error response (``ENODATA``: normal end)."""
        if self.done:
            return
        self.backend.respond_error_ns(self, errnum, errstr)
        self.finish()

    def finish(self) -> None:
        """End the watch without a response (the client went away)."""
        if not self.done:
            self.done = True
            self.buffer = None
            self.reported = {}
            self.backend.ended_ns(self)
