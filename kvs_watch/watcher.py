"""One watch: the answers to one ``kvs-watch.lookup`` request, in commit order.

A :class:`Watcher` is fed roots by its namespace monitor -- ``push(rootseq,
rootref)`` for its initial root and for every later commit that concerns its
key -- and answers the request once per root, strictly in commit order:

* each root becomes a *slot* in a FIFO; the watcher keeps up to
  :data:`LOOKUP_WINDOW` ``kvs.lookup`` requests in flight, each **pinned** to
  its slot's root (``rootdir``), and answers from the head of the FIFO only,
  so a fast lookup never overtakes a slow one;
* APPEND and STREAM look the key up as a tree object and answer with the
  contents of the *new* blobrefs (``content.load``, at most
  :data:`LOAD_WINDOW` in flight, answered in blobref order) before the next
  slot is considered;
* the FIFO is bounded (``max_backlog`` roots): a watcher that falls that far
  behind is ended with ``EOVERFLOW``; but an APPEND watcher (without
  DELETES) with :data:`FOLD_DEPTH` roots queued moves the last one, still
  waiting for its lookup, on to each newer root, which holds its blobs
  too: it answers the same blobs with fewer lookups and does not overflow
  (*folding*, counted ``roots-folded``);
* a root that cannot be read (``ENOENT`` from ``kvs.lookup-plus``, which
  answers a missing key as data: its blobs are gone, an online ``kvs gc``
  collected it while the watcher lagged) says nothing about the key: the
  slot is dropped if a later root is queued, else re-aimed at a newer root
  (the monitor's, or rank 0's current one), so the watcher skips the
  versions the collection removed but never reports a key missing that
  exists, nor waits for ever (:meth:`Watcher._unreadable`).

There is no task per watcher: everything runs from the completion callbacks
of the futures :class:`Backend` returns, so an idle watcher costs only its
object and its index entries.  The watcher does no I/O itself; the module
(or a test) provides a :class:`Backend`.

Answers are ``{"val": treeobj, "rootseq": n, "namespace": ns}`` (``"val":
None``: the key was removed, a DELETES watcher's answer); the
INITIAL_SENTINEL answer has no payload; the stream ends with an error
response (``ENODATA`` for a normal end: cancel, end of STREAM).  See
docs/protocol.md, section "kvs-watch".
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from broker.errors import ErrnoError, error_text
from broker.message import Message
from kvs import treeobj
from kvs_watch.flags import (
    LOOKUP_FLAGS,
    STREAM,
    TREEOBJ,
    WAITCREATE,
    WATCH,
    WATCH_APPEND,
    WATCH_DELETES,
    WATCH_FULL,
    WATCH_INITIAL_SENTINEL,
    WATCH_KEYS,
    WATCH_UNIQ,
)

if TYPE_CHECKING:
    from kvs_watch.monitor import Monitor

log = logging.getLogger("kvbroker.kvs-watch")


MARK0 = treeobj.refs_mark((), (), ())
"""The mark of no blobs: an APPEND watcher's before its first answer."""

LOOKUP_WINDOW = 8
"""Lookups a watcher keeps in flight (for successive roots)."""
LOAD_WINDOW = 16
"""Blob loads a watcher keeps in flight (APPEND / STREAM)."""
FOLD_DEPTH = LOOKUP_WINDOW + 1
"""Roots an APPEND watcher (without DELETES) queues before it folds the
next ones into the last (:meth:`Watcher.push`): as soon as a root must
wait for a lookup, the roots after it are read at the newest, with one
lookup.  While it keeps up, each version is answered on its own.  (64
until 2026-12-05: the lookups of a follower's watcher now cost O(new
blobs), not O(value), so it mostly keeps up, and reading each of 64
queued versions cost it the CPU its rank 0 needed: a watcher on rank 3
of a 10,000-line log had it all 10 ms after the last append, not 60.)"""
FOLDED_KEPT = 1000
"""Roots folded into one slot that it keeps (or ``max_backlog``, if more),
to read them one by one should the newest show the value rewritten: past
that, every other one is forgotten, the newest kept."""
DEFAULT_MAX_BACKLOG = 1000
"""Roots a watcher may have pending before it is ended with ``EOVERFLOW``."""


class Backend(Protocol):
    """What a watcher needs from its module (a fake one in unit tests)."""

    max_backlog: int

    def lookup_at(self, w: Watcher, rootref: str, flags: int,
                  after: tuple[int, bytes] | None = None) -> asyncio.Future[Any]:
        """``kvs.lookup-plus`` of ``w.key`` pinned at ``rootref`` -> ``{"val":
        treeobj}``, ``{"val": None}`` for a missing key; ``ENOENT`` only when
        the root's blobs cannot be had.  ``after`` (APPEND): the count and
        mark of the blobs answered, so a value that grew from them comes as
        only the blobs after them, with ``length``, ``mark`` and ``grown``
        (:func:`kvs.treeobj.value_after`)."""

    def current_root(self, w: Watcher) -> asyncio.Future[Any]:
        """``kvs.getroot`` of ``w.namespace`` on rank 0 -> ``{"rootseq",
        "rootref"}``: a root newer than one that was collected."""

    def load(self, blobref: str) -> asyncio.Future[Any]:
        """``content.load`` -> ``{"data": bytes}``."""

    def respond(self, w: Watcher, payload: Any) -> None: ...

    def respond_error(self, w: Watcher, errnum: int, errstr: str | None) -> None: ...

    def ended(self, w: Watcher) -> None:
        """``w`` is finished: forget it (indexes, monitor)."""

    def hash_blob(self, data: bytes) -> str:
        """The blobref the content store gives ``data``."""

    def folded(self, w: Watcher) -> None:
        """``w`` (APPEND) will read a queued root's blobs at a newer root
        instead (:meth:`Watcher.push`): counted."""


class _Slot:
    """One root to answer for: its lookup, then (APPEND/STREAM) its blob loads."""

    __slots__ = ("seq", "ref", "initial", "fut", "after", "gen", "refs", "next", "loads",
                 "folded", "pending")

    def __init__(self, seq: int, ref: str, initial: bool) -> None:
        self.seq = seq
        self.ref = ref
        """The root to read at; "" while a newer one is asked for (its root
        could not be read, :meth:`Watcher._unreadable`)."""
        self.folded: list[tuple[int, str]] | None = None
        """APPEND: the roots folded into this slot, oldest first (its own
        ``seq``/``ref`` is the newest): read one by one if the newest shows
        the value rewritten or removed (:meth:`Watcher._unfold`)."""
        self.pending: list[tuple[int, str]] | None = None
        """Unfolded: the roots still to read after this one, in order."""
        self.initial = initial
        self.fut: asyncio.Future[Any] | None = None
        self.after = 0
        """APPEND: the blobs the watcher had answered when it sent the lookup
        (the lookup answers those after them)."""
        self.gen = 0
        """APPEND: the watcher's :attr:`Watcher.gen` then."""
        self.refs: list[str] | None = None
        self.next = 0
        self.loads: deque[asyncio.Future[Any]] | None = None


class Watcher:
    """The state of one watch request (see the module docstring)."""

    __slots__ = (
        "backend", "msg", "key", "flags", "namespace", "monitor", "seq", "queue",
        "issued", "responded", "done", "sentinel_sent", "prev", "count", "mark", "gen",
        "recent", "absent", "closing", "arrival",
    )

    def __init__(self, backend: Backend, msg: Message, key: str, flags: int,
                 namespace: str) -> None:
        self.backend = backend
        self.msg = msg
        """The request: route, matchtag and credentials of the watcher."""
        self.key = key
        self.flags = flags
        self.namespace = namespace
        self.monitor: Monitor | None = None
        self.seq = -1
        """Root sequence number of the last root queued (-1: none yet)."""
        self.queue: deque[_Slot] | None = None  # None while idle (saves memory)
        self.issued = 0  # the first `issued` slots have their lookup sent
        self.responded = False
        self.done = False
        self.sentinel_sent = False
        self.prev: bytes | None = None  # UNIQ/FULL: digest of the last value sent
        self.count = -1  # APPEND/STREAM: number of blobs already answered (-1: none)
        self.mark = MARK0  # APPEND: the mark of the blobs answered (treeobj.refs_mark)
        self.gen = 0  # APPEND: values watched (a DELETES watcher's key may come back)
        self.recent: tuple[int, list[str]] | None = None
        """APPEND: ``(base, refs)``, the blobrefs answered from blob ``base``
        on, kept while a lookup sent before they were answered is in flight
        (it answers from ``base``: :meth:`_grown`)."""
        self.absent = False  # DELETES: the key is missing, and that was answered
        self.closing: tuple[int, str] | None = None
        """The error to end with once the roots queued are answered
        (:meth:`fail_after_queue`); no root is queued after it."""
        self.arrival = 0
        """The module's number for its request: the order requests came in
        (a reload hands the watches that have answered nothing to the new
        module in that order: ``KvsWatchModule.parked``)."""

    def __repr__(self) -> str:
        return (f"<Watcher {self.namespace}:{self.key} flags={self.flags:#x} "
                f"tag={self.msg.matchtag} seq={self.seq}{' done' if self.done else ''}>")

    # ------------------------------------------------------------ properties

    @property
    def full(self) -> bool:
        """Looks the key up on every commit of the namespace."""
        return bool(self.flags & WATCH_FULL)

    @property
    def deletes(self) -> bool:
        """A WATCH_DELETES watcher: a commit naming a directory above its key
        concerns it too (it may have removed the key: :mod:`kvs_watch.monitor`)."""
        return bool(self.flags & WATCH_DELETES)

    @property
    def keyed(self) -> bool:
        """A WATCH_KEYS watcher: answers with the keys commits wrote, looks
        nothing up (:meth:`push_keys`)."""
        return bool(self.flags & WATCH_KEYS)

    @property
    def wants_updates(self) -> bool:
        """Needs the roots of later commits (WATCH, or WAITCREATE still waiting)."""
        return bool(self.flags & (WATCH | WAITCREATE))

    def may_access(self, owner: int) -> bool:
        """The instance owner, or the namespace's owner (Flux's cred_authorize)."""
        return self.msg.is_owner or (owner >= 0 and self.msg.userid == owner)

    @property
    def lookup_flags(self) -> int:
        if self.flags & (WATCH_APPEND | STREAM):
            return TREEOBJ
        return self.flags & LOOKUP_FLAGS

    @property
    def backlog(self) -> int:
        q = self.queue
        return len(q) if q is not None else 0

    # ------------------------------------------------------------ life cycle

    def push(self, seq: int, rootref: str, initial: bool = False) -> None:
        """Answer for root ``seq`` (after every root pushed before it)."""
        if self.done or seq <= self.seq or self.closing is not None:
            return
        if self.keyed:  # only its first answer comes this way: where the keys start
            if initial:
                self.push_keys(seq, rootref, None)
            return
        q = self.queue
        if q is None:
            q = self.queue = deque()
        n = len(q)
        folds = self.flags & (WATCH_APPEND | WATCH_DELETES) == WATCH_APPEND
        if folds and n > self.issued and n >= min(FOLD_DEPTH, self.backend.max_backlog):
            # Far behind, the last root queued still waiting for its lookup:
            # this newer root holds every blob that one would answer, and
            # more, so that slot reads at this root instead.  A follower's
            # watcher of an eventlog appended to faster than it can read
            # each version keeps up, instead of ending EOVERFLOW.  The roots
            # folded are kept, to be read one by one should the newest show
            # the value rewritten (its lines before that are still owed).
            tail = q[-1]
            folded = tail.folded
            if folded is None:
                folded = tail.folded = []
            folded.append((tail.seq, tail.ref))
            if len(folded) > max(FOLDED_KEPT, self.backend.max_backlog):
                del folded[-2::-2]  # (thinned, the newest kept: docs/protocol.md)
            tail.seq, tail.ref = seq, rootref
            self.seq = seq
            self.backend.folded(self)
            return
        if n >= self.backend.max_backlog and not folds:
            # (a folding watcher queues past a small bound until a root
            # waits for its lookup: at most LOOKUP_WINDOW + 1, then folds)
            self.fail(errno.EOVERFLOW, f"{self.key}: watcher fell more than "
                                       f"{self.backend.max_backlog} commits behind")
            return
        self.seq = seq
        q.append(_Slot(seq, rootref, initial))
        self._issue()

    def push_keys(self, seq: int, rootref: str, keys: Any) -> None:
        """WATCH_KEYS: answer root ``seq`` with the keys of ``keys`` (a
        setroot's) at or below the watched key, or above it (a directory
        replaced or removed on the way to it); nothing if there are none.
        ``keys`` None: the first answer, ``keys: []``."""
        if self.done or seq <= self.seq:
            return
        k = self.key
        if keys is None:
            mine: list[str] = []
        elif not isinstance(keys, list):
            return
        else:
            below = k + "."
            mine = [x for x in keys if isinstance(x, str) and (
                k == "." or x == k or x.startswith(below) or below.startswith(x + "."))]
            if not mine:  # (an empty commit, or one of conditions only, too)
                return
        self.seq = seq
        self.responded = True
        self.backend.respond(self, {"keys": mine, "rootseq": seq, "rootref": rootref,
                                    "namespace": self.namespace})

    def fail_after_queue(self, errnum: int, errstr: str) -> None:
        """End with ``errnum`` once every root queued so far is answered.

        The namespace was removed: the commits made before the removal came
        before it, so their answers do too (a job's last eventlog entries,
        then its namespace removed, reach a watcher on a far rank whose
        lookups were still in flight).  The lookups are pinned to their
        roots, which the removal does not take from the content store."""
        if self.done:
            return
        if not self.queue:
            self.fail(errnum, errstr)
            return
        self.closing = (errnum, errstr)

    def fail(self, errnum: int, errstr: str | None = None) -> None:
        """End the watch with an error response (``ENODATA``: normal end)."""
        if self.done:
            return
        self.backend.respond_error(self, errnum, errstr)
        self._end()

    def finish(self) -> None:
        """End the watch without a response (disconnect, one-shot request done)."""
        if not self.done:
            self._end()

    def _end(self) -> None:
        self.done = True
        for slot in self.queue or ():  # lookups already answered, never to be read
            fut = slot.fut
            if fut is not None and fut.done() and not fut.cancelled():
                fut.exception()  # (so asyncio does not log an error as never retrieved)
        self.queue = None
        self.issued = 0
        self.backend.ended(self)

    # ------------------------------------------------------------ pipeline

    def _issue(self) -> None:
        q = self.queue
        assert q is not None
        n = len(q)
        while self.issued < n and self.issued < LOOKUP_WINDOW:
            slot = q[self.issued]
            self.issued += 1
            self._lookup(slot)

    def _wake(self, fut: asyncio.Future[Any]) -> None:
        if self.done:  # its answer is not wanted: read the error, if any, so
            if not fut.cancelled():  # asyncio does not log it as never retrieved
                fut.exception()
            return
        self._wake_soon()

    def _wake_soon(self) -> None:
        try:
            self._pump()
        except Exception as exc:  # a bug: end this watch, keep the module alive
            log.exception("watcher %r failed", self)
            self.fail(errno.EIO, f"kvs-watch internal error: {exc}")

    def _pump(self) -> None:
        """Answer from the head of the FIFO for as long as results are ready."""
        q = self.queue
        while q and not self.done:
            slot = q[0]
            fut = slot.fut
            if not slot.ref:  # its root was collected: a newer one is on its way
                if len(q) == 1:
                    return
                self._drop_head()  # a later root answers instead
                continue
            if fut is not None:  # stage 1: the pinned lookup
                if not fut.done():
                    return
                slot.fut = None
                if not self._lookup_done(slot, fut):
                    if self.done or slot.fut is not None or not slot.ref:
                        return  # ended, or reading again at a newer root
                    self._drop_head()
                    continue
                if self.done:  # (its answer ended it: a stream cut, a client dropped)
                    return
            if slot.refs is not None and not self._load_some(slot):  # stage 2: blobs
                return
            if slot.pending:  # unfolded: the next of its roots, in order
                slot.seq, slot.ref = slot.pending.pop(0)
                slot.refs = None
                self._lookup(slot)
                continue
            q.popleft()
            self.issued -= 1
            self._slot_done(slot)
            if self.done:
                return
            self._issue()
        if q is not None and not q and self.queue is q:
            self.queue = None
            if self.closing is not None and not self.done:
                self.fail(*self.closing)

    def _drop_head(self) -> None:
        """Forget the head slot, whose root was collected, without an answer:
        the next one answers, as the initial root if the head was."""
        q = self.queue
        assert q is not None and len(q) > 1
        slot = q.popleft()
        self.issued -= 1
        if slot.initial:
            q[0].initial = True
        self._issue()

    def _unreadable(self, slot: _Slot, exc: ErrnoError) -> None:
        """The head ``slot``'s root cannot be read (its blobs are gone: a
        collection removed it while this watcher lagged).  A later root
        queued answers instead (the caller drops this slot); else the slot
        is read again at the monitor's root if newer, else at rank 0's
        current root, which no collection removes (this one is then not
        it); if rank 0's is no newer, the store lacks a live root's blobs
        (damaged): the watch ends with the error."""
        q = self.queue
        assert q is not None
        if len(q) > 1:
            return
        if self.closing is not None:
            # its namespace is gone: no newer root to read (rank 0's current
            # one may be a new namespace of the same name)
            self.fail(*self.closing)
            return
        mon = self.monitor
        if mon is not None and mon.rootseq > slot.seq:
            self._reaim(slot, mon.rootseq, mon.rootref)
            return
        slot.ref = ""
        fut = self.backend.current_root(self)
        fut.add_done_callback(lambda f: self._current_root(slot, f, exc))

    def _current_root(self, slot: _Slot, fut: asyncio.Future[Any], first: ErrnoError) -> None:
        if self.done:
            if not fut.cancelled():
                fut.exception()
            return
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None or fut.cancelled():
            errnum = exc.errnum if isinstance(exc, ErrnoError) else errno.EIO
            self.fail(errnum, f"{self.key}: root (rootseq {slot.seq}) cannot be read "
                              f"({first.errstr}), nor the current root found: "
                              f"{error_text(exc) if exc is not None else 'cancelled'}")
            return
        try:
            r = fut.result()
            seq, ref = int(r["rootseq"]), str(r["rootref"])
        except (KeyError, TypeError, ValueError):
            self.fail(errno.EPROTO, f"{self.key}: malformed kvs.getroot response")
            return
        q = self.queue
        if not q or q[0] is not slot:
            return
        if len(q) > 1:  # a later root came meanwhile: it answers
            self._wake_soon()
            return
        if self.closing is not None:  # its namespace went meanwhile: that root may be
            self.fail(*self.closing)  # a new namespace's of the same name
            return
        if seq <= slot.seq:
            self.fail(first.errnum, f"{self.key}: the current root (rootseq {slot.seq}) "
                                    f"cannot be read: {first.errstr}")
            return
        self._reaim(slot, seq, ref)

    def _reaim(self, slot: _Slot, seq: int, ref: str) -> None:
        """Read ``slot`` again at the newer root ``seq``: the commits since
        its own are in it, so later roots up to ``seq`` are not wanted --
        nor the roots an unfolded slot had still to read (all older: read
        after it, they went back a version, and an APPEND watch ended
        ``EINVAL``, "fewer blobs")."""
        slot.seq, slot.ref = seq, ref
        if slot.pending:
            slot.pending = [root for root in slot.pending if root[0] > seq] or None
        self.seq = max(self.seq, seq)
        self._lookup(slot)

    def _lookup(self, slot: _Slot) -> None:
        after = None
        if self.flags & WATCH_APPEND:
            # (a lookup sent before the previous slots are answered: it
            # answers from what was answered when it was sent)
            slot.after, slot.gen = max(self.count, 0), self.gen
            after = (slot.after, self.mark)
        fut = self.backend.lookup_at(self, slot.ref, self.lookup_flags, after)
        slot.fut = fut
        fut.add_done_callback(self._wake)

    def _rewritten(self, slot: _Slot, answer: dict[str, Any]) -> bool:
        """APPEND, ``slot`` folded: whether lookup ``answer`` at its newest
        root (``val`` None: missing) means the roots folded in are to be
        read one by one (:meth:`_unfold`): the value rewritten, as
        :meth:`_append` would find, or missing (removed, or never there
        at the newest root though made and removed before it)."""
        obj = answer["val"]
        if obj is None:
            # (missing at the newest root: removed -- or, for a WAITCREATE
            # watcher that has answered nothing, perhaps made and removed in
            # the roots folded in, whose lines are owed before ENOENT)
            return True
        if self.count < 0:
            return obj["type"] not in ("val", "valref")
        return isinstance(self._grown(slot, answer), str)

    def _unfold(self, slot: _Slot) -> None:
        """The newest root folded into ``slot`` shows its value rewritten or
        removed: the lines of the roots folded in before it are still owed,
        so they are read one by one, in order, that newest one last (which
        then ends the watch where it would have without folding)."""
        assert slot.folded is not None
        roots = [*slot.folded, (slot.seq, slot.ref)]
        slot.folded = None
        (slot.seq, slot.ref), slot.pending = roots[0], roots[1:]
        self._lookup(slot)

    def _slot_done(self, slot: _Slot) -> None:
        if slot.initial:
            self._send_sentinel()
        if not self.flags & WATCH and self.responded:
            # STREAM, or a lookup (WAITCREATE): one value, then done.
            if self.msg.streaming:
                self.fail(errno.ENODATA)
            else:
                self.finish()

    def _send_sentinel(self) -> None:
        if self.flags & WATCH_INITIAL_SENTINEL and not self.sentinel_sent:
            self.sentinel_sent = True
            self.backend.respond(self, None)

    def _answer(self, obj: Any, seq: int) -> None:
        """One answer; ``obj`` None: the key is missing (DELETES)."""
        self.responded = True
        self.backend.respond(self, {"val": obj, "rootseq": seq, "namespace": self.namespace})

    # ------------------------------------------------------------ results

    def _lookup_done(self, slot: _Slot, fut: asyncio.Future[Any]) -> bool:
        """Handle the head slot's lookup; False: its root could not be read
        (the slot is to be dropped, unless re-aimed: :meth:`_unreadable`)."""
        if fut.cancelled():
            self.fail(errno.ECANCELED, f"{self.key}: lookup cancelled")
            return True
        exc = fut.exception()
        if exc is not None:
            if not isinstance(exc, ErrnoError):
                self.fail(errno.EIO, f"{self.key}: lookup failed: {exc}")
            elif exc.errnum == errno.ENOENT:  # (a missing key is no error here)
                self._unreadable(slot, exc)
                return False
            else:
                self.fail(exc.errnum, exc.errstr)
            return True
        try:
            answer = fut.result()
            obj = answer["val"]
            if self.flags & WATCH_APPEND and (slot.gen != self.gen
                                              or slot.after > max(self.count, 0)):
                # sent for the value before the key was removed and made
                # again (DELETES): ask again, from the new value's start
                self._lookup(slot)
                return False
            if slot.folded and self._rewritten(slot, answer):
                self._unfold(slot)
                return False  # (reading again, at the oldest root folded in)
            if obj is None:  # no such key at this root
                if self.flags & WATCH_DELETES:
                    self._missing(slot)
                elif not (self.flags & WAITCREATE and not self.responded):
                    self.fail(errno.ENOENT, f"{self.key}: no such key")
                return True  # (WAITCREATE: not created yet, keep waiting)
            kind = obj["type"]
        except (KeyError, TypeError):
            self.fail(errno.EPROTO, f"{self.key}: malformed kvs.lookup-plus response")
            return True
        self.absent = False
        flags = self.flags
        if flags & (WATCH_APPEND | STREAM):
            self._append(slot, answer, kind)
        elif flags & (WATCH_UNIQ | WATCH_FULL):
            digest = hashlib.blake2b(treeobj.encode(obj), digest_size=16).digest()
            if not (self.responded and digest == self.prev):
                self.prev = digest
                self._answer(obj, slot.seq)
        else:
            self._answer(obj, slot.seq)
        return True

    def _missing(self, slot: _Slot) -> None:
        """DELETES: the key is missing at ``slot``'s root.  Answered once
        (``val: None``) when it goes missing -- removed, or missing at the
        start of a watch without WAITCREATE, so the watcher knows the key
        is free -- then the watcher waits for it as WAITCREATE does: later
        commits that still leave it missing are not answered.  What the
        key holds when it comes back is a new value, answered whatever the
        mode: UNIQ/FULL forget the last value, APPEND starts over with the
        whole of the new one (its blobs are not the old value's)."""
        if self.absent:
            return
        self.absent = True
        self.prev = None
        self.count = -1
        self.mark = MARK0
        self.gen += 1
        self.recent = None
        if self.flags & WAITCREATE and not self.responded:
            return  # not created yet: waited for silently, as WAITCREATE
        self._answer(None, slot.seq)

    def _append(self, slot: _Slot, answer: dict[str, Any], kind: str) -> None:
        """APPEND / STREAM: answer with the blobs not answered yet."""
        obj = answer["val"]
        what = "streamed" if self.flags & STREAM else "watched with APPEND"
        if self.count < 0 and kind == "val":  # the first value, inline
            self.count = 1
            if self.flags & WATCH_APPEND:
                # An append turns a val into [blob(old bytes), blob(new)].
                ref = self.backend.hash_blob(obj["data"])
                self.mark = treeobj.refs_mark((), (), (ref,))
                self._keep_recent(0, [ref])
            self._answer(obj, slot.seq)
            return
        if self.count < 0 and kind != "valref":
            errnum = errno.EISDIR if kind in ("dir", "dirref") else errno.EINVAL
            self.fail(errnum, f"{self.key}: a {kind} cannot be {what}")
            return
        if not self.flags & WATCH_APPEND:  # STREAM: the value's blobs, once
            self.count = len(obj["data"])
            self._load(slot, obj["data"])
            return
        # The value grew by appends only (from nothing, the first time):
        # the lookup answered the blobs after those answered when it was sent.
        new = self._grown(slot, answer)
        if isinstance(new, str):
            self.fail(errno.EINVAL, f"{self.key}: value {what} was {new}")
            return
        old = max(self.count, 0)
        self.count = answer["length"]
        self.mark = answer["mark"]
        self._keep_recent(old, new)
        if new:
            self._load(slot, new)

    def _grown(self, slot: _Slot, answer: dict[str, Any]) -> list[str] | str:
        """APPEND: the blobrefs of lookup ``answer`` after those answered,
        or how the value was changed other than by appends
        (``"overwritten"``, ``"rewritten with fewer blobs than were
        answered"``: blobs are what is counted, one per append, so a value
        rewritten longer but in fewer blobs is one too -- it was called
        "shortened").

        The kvs checked that the first ``slot.after`` blobs are the ones
        answered (their mark): the blobs after them come in ``val``.  A
        lookup sent before the previous slots were answered has more blobs
        than are new: those answered since (:attr:`recent`) must be there,
        in place.  Blobs are named by content, so the last one alone would
        not do: a rewrite may end with it ([x, +] -> [y, +])."""
        obj = answer["val"]
        if obj["type"] != "valref" or "grown" not in answer:
            return "overwritten"
        if answer["length"] < self.count:
            return "rewritten with fewer blobs than were answered"
        if not answer["grown"]:
            return "overwritten"
        refs: list[str] = obj["data"]
        have = max(self.count, 0) - slot.after
        if have:
            recent = self.recent
            if recent is None or slot.after < recent[0]:
                return "overwritten"  # (never so: _keep_recent keeps them)
            base, answered = recent
            if refs[:have] != answered[slot.after - base:]:
                return "overwritten"
            return refs[have:]
        return refs

    def _keep_recent(self, old: int, new: list[str]) -> None:
        """APPEND: ``new`` blobrefs were answered after the first ``old``:
        keep, of those answered, the ones that lookups in flight answer
        again (from the ``after`` of the next slot sent), else none."""
        q = self.queue
        start = self.count
        if q is not None and self.issued > 1 and len(q) > 1 and q[1].gen == self.gen:
            start = q[1].after
        if start >= self.count:
            self.recent = None
            return
        base, refs = self.recent if self.recent is not None else (old, [])
        refs = refs + new
        self.recent = (start, refs[start - base:])

    def _load(self, slot: _Slot, refs: list[str]) -> None:
        slot.refs = refs
        slot.next = 0
        slot.loads = deque()

    def _load_some(self, slot: _Slot) -> bool:
        """Answer loaded blobs in order; True once every blob of ``slot`` is answered."""
        refs = slot.refs
        loads = slot.loads
        assert refs is not None and loads is not None
        while True:
            while slot.next < len(refs) and len(loads) < LOAD_WINDOW:
                fut = self.backend.load(refs[slot.next])
                slot.next += 1
                loads.append(fut)
                fut.add_done_callback(self._wake)
            if not loads:
                return True
            fut = loads[0]
            if not fut.done():
                return False
            loads.popleft()
            exc = None if fut.cancelled() else fut.exception()
            if fut.cancelled() or exc is not None:
                errnum = exc.errnum if isinstance(exc, ErrnoError) else errno.EIO
                self.fail(errnum, f"{self.key}: cannot load a blob of the value: "
                                  f"{error_text(exc) if exc is not None else 'cancelled'}")
                return False
            try:
                data = fut.result()["data"]
            except (KeyError, TypeError):
                self.fail(errno.EPROTO, f"{self.key}: malformed content.load response")
                return False
            self._answer(treeobj.val(data), slot.seq)
            if self.done:
                # Answering ended the watch (its client's connection was
                # closed for its byte budget, a disconnect): no more loads,
                # nor answers to a client gone.
                return False
