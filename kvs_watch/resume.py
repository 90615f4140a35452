"""Taking a watch up again after its handle reconnected.

A handle connected with ``reconnect=True`` (:meth:`broker.handle.Handle.connect`)
makes its connection again when its rank restarts, but the rank's
kvs-watch forgot the watch with the old connection.  A :class:`Watch
<kvs_watch.client.Watch>` on such a handle then sends its request again
and filters the new stream's first answers by what it had delivered, so
its reader sees neither a repeat nor a gap it could have noticed:

* a plain, ``uniq`` or ``full`` watch skips the new first answer if it
  holds the value last delivered; else it is the change made meanwhile
  (several commits meanwhile are one change, as commits merged into one
  version are);
* an ``append`` watch asks for the initial sentinel, gathers the new
  initial value, checks that it starts with the bytes delivered (a digest
  of them is kept: ``EINVAL`` if the value was replaced or shortened
  meanwhile, as the watch itself says), and yields only the rest, one
  entry per append as while connected (so ``kvs get -w -A --reconnect``
  prints each on its own line);
* a removal meanwhile ends the watch with ``ENOENT`` as it would have
  (``deletes``: one removal entry; ``waitcreate``: the wait goes on);
* a namespace watch compares the new list with the namespaces it knows
  alive (:class:`NamespaceResume`).

(A key watch, ``watch_keys``, resumes by itself: it is sent again with
``since`` its last root, and the diff says what changed.)

Events between the loss and the new connection are not replayed: what is
compared is the state, as after a watch's first answer.
"""

from __future__ import annotations

import errno
import hashlib
from typing import Any, Protocol

from broker.errors import RemoteError
from kvs_watch import flags as F


class Resume(Protocol):
    """The filter a watch on a reconnecting handle passes its answers through."""

    def flags(self, flags: int) -> int:
        """The flags of the request sent again (``flags``: the first one's)."""
        ...

    def restarted(self) -> None:
        """The request was sent again: a new stream starts."""
        ...

    def take(self, payload: Any) -> list[Any]:
        """The payloads to deliver for this answer's (none, one or more)."""
        ...


_NOTHING = object()
"""No value delivered yet."""


class WatchResume:
    """What one watch delivered, and the filter for its restarted stream.

    :meth:`take` turns each answer's payload (``None``: the initial
    sentinel) into the payloads to deliver: none, one, or two (the rest of
    an append watch's value and the sentinel its reader still waits for).
    """

    __slots__ = ("key", "append", "sentinel_asked", "sentinel_seen", "last", "size",
                 "digest", "entries", "catching_up")

    def __init__(self, key: str, flags: int) -> None:
        self.key = key
        self.append = bool(flags & F.APPEND)
        self.sentinel_asked = bool(flags & F.INITIAL_SENTINEL)
        self.sentinel_seen = False
        self.last: Any = _NOTHING
        """The ``val`` last delivered (``None``: a removal); after a
        restart, the first answer holding it is skipped (append: only a
        removal is kept here)."""
        self.size = 0
        """Append: the bytes of the current value delivered..."""
        self.digest = hashlib.blake2b()
        """... and their digest."""
        self.entries = 0
        """Append: the answers of the current value delivered (one per blob:
        an append's chunk), so those appended meanwhile come one by one."""
        self.catching_up: list[dict[str, Any]] | None = None
        """Append, after a restart: the new initial value's answers so far."""

    def flags(self, flags: int) -> int:
        """The flags of the restarted request: an append watch needs the
        sentinel to know where the new initial value ends."""
        return flags | F.INITIAL_SENTINEL if self.append else flags

    def restarted(self) -> None:
        if self.append:
            self.catching_up = []
        elif self.last is not _NOTHING and type(self.last) is not _Fresh:
            self.last = _Fresh(self.last)  # (lost again before the first answer: as it was)

    def take(self, payload: Any) -> list[Any]:
        if payload is None:  # the initial sentinel
            if self.catching_up is not None:
                return self._caught_up()
            if self.sentinel_asked and not self.sentinel_seen:
                self.sentinel_seen = True
                return [None]
            return []  # (only asked for to catch up)
        val = payload["val"]
        if self.append:
            if self.catching_up is not None and val is not None:
                self.catching_up.append(payload)
                return []
            if val is None:  # a removal (deletes): the next value comes whole
                again = self.catching_up is not None and self.last is None
                self.catching_up, self.last = None, None
                self.size, self.digest, self.entries = 0, hashlib.blake2b(), 0
                return [] if again else [payload]
            self.last = _NOTHING
            data = val.get("data", b"")
            self.size += len(data)
            self.digest.update(data)
            self.entries += 1
            return [payload]
        last = self.last
        if type(last) is _Fresh:
            if val == last.val:
                self.last = last.val
                return []
        self.last = val
        return [payload]

    def _caught_up(self) -> list[Any]:
        answers, self.catching_up = self.catching_up or [], None
        data = b"".join(p["val"].get("data", b"") for p in answers)
        if (len(data) < self.size
                or hashlib.blake2b(data[:self.size]).digest() != self.digest.digest()):
            raise RemoteError(errno.EINVAL, f"{self.key}: value replaced or shortened "
                                            "while the handle reconnected")
        out: list[Any] = []
        n = self.entries
        if len(answers) >= n and sum(len(p["val"].get("data", b"")) for p in answers[:n]) \
                == self.size:
            # The answers delivered are the new value's first ones (one per
            # blob): the rest come as they would have, one per append (an
            # empty one too), not joined into one.
            new = answers[n:]
        else:  # (the bytes delivered end inside an answer: the rest in one)
            rest = data[self.size:]
            last = answers[-1] if answers else None
            new = [{**last, "val": {**last["val"], "data": rest}}] if rest and last else []
        for p in new:
            chunk = p["val"].get("data", b"")
            self.size += len(chunk)
            self.digest.update(chunk)
            out.append(p)
        self.entries = len(answers)
        if self.sentinel_asked and not self.sentinel_seen:
            self.sentinel_seen = True
            out.append(None)
        return out


class _Fresh:
    """The value last delivered, before a restarted stream's first answer."""

    __slots__ = ("val",)

    def __init__(self, val: Any) -> None:
        self.val = val


class NamespaceResume:
    """What a namespace watch (``kvs-watch.namespaces``) delivered, and the
    filter for its restarted stream.

    It keeps the namespaces alive as the watch told them (name -> the
    answer that listed or created it).  A restarted watch asks for the list
    again; at its end (``listed``) the filter yields a ``removed`` for each
    namespace known that is gone, or came back as another (a new epoch),
    then a ``created`` (not ``initial``) for each one new to it: what
    happened meanwhile, as changes.  A ``changes_only`` watch on a
    reconnecting handle asks for the list too, to know what exists, and
    yields none of it.
    """

    __slots__ = ("changes_only", "known", "listing", "listed")

    def __init__(self, changes_only: bool) -> None:
        self.changes_only = changes_only
        self.known: dict[str, dict[str, Any]] = {}
        self.listing: list[dict[str, Any]] | None = None
        """After a restart: the new list, until its end."""
        self.listed = False
        """The first list has ended (its marker went to the reader)."""

    def flags(self, flags: int) -> int:
        return 0  # (the list, always)

    def restarted(self) -> None:
        self.listing = []

    def take(self, payload: Any) -> list[Any]:
        event, name = payload.get("event"), payload.get("namespace")
        if self.listing is not None:
            if event == "listed":
                return self._relisted(payload)
            if payload.get("initial"):
                self.listing.append(payload)
                return []
        if event == "listed":
            first, self.listed = not self.listed, True
            # (for a changes_only watch: it has started, as a plain handle's
            # NOLIST marker says; the list before it was taken only to resume)
            return [payload] if first else []
        if event == "created":
            self.known[name] = payload
            return [] if payload.get("initial") and self.changes_only else [payload]
        if event == "removed":
            self.known.pop(name, None)
        return [payload]

    def _relisted(self, marker: dict[str, Any]) -> list[Any]:
        """The restarted stream's list has ended (``marker``).  If the first
        list never had (the stream was lost before it was served, or part
        way), this one is the first: what it adds is ``initial`` (none for
        ``changes_only``), then the marker -- it was taken for changes, and
        the marker swallowed, so a reader waiting for ``NS_LISTED`` waited
        for ever (a review: a kvs-watch reload as the watch started)."""
        first = not self.listed
        listing, self.listing = self.listing or [], None
        now = {p["namespace"]: p for p in listing}
        out: list[Any] = []
        for name, old in list(self.known.items()):
            new = now.get(name)
            if new is None or new.get("epoch") != old.get("epoch"):
                del self.known[name]
                out.append({**old, "event": "removed", "initial": False})
        for name, new in now.items():
            if name not in self.known:
                self.known[name] = new
                if not first:
                    out.append({**new, "initial": False})
                elif not self.changes_only:
                    out.append({**new, "initial": True})
        if first:
            self.listed = True
            out.append(marker)
        return out
