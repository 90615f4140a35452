"""Watching KVS keys from Python (the client side of ``kvs-watch``).

    from kvs_watch.client import watch

    async with watch(h, "job.state", waitcreate=True) as w:   # cancels on exit
        async for entry in w:                                  # WatchEntry
            print(entry.rootseq, entry.value)
            if entry.value == b"done":
                break

A :class:`Watch` is both an async iterator and an async context manager:
leaving the ``async with`` block sends ``kvs-watch.cancel`` and drains the
stream to its ``ENODATA`` end, so no watcher is left behind on the broker.
A watch dropped without that (``async for e in watch(h, k): break``) is
cancelled when it is garbage collected, and its answers are discarded.
Errors that end a watch (``ENOENT`` key removed -- unless ``deletes=True``,
which yields a removal as an entry with ``removed`` set and goes on --
``ENOTSUP`` namespace removed, ``EPERM``, ``EINVAL``, ``EOVERFLOW`` fell too far behind) are raised
from the iteration as :class:`broker.errors.RemoteError`.

With ``initial_sentinel=True`` (needs ``append=True``, as in Flux) the
iterator yields :data:`INITIAL_DONE` once the initial value has been
delivered -- right away if the key does not exist yet (``waitcreate``).

Helpers: :func:`watch_keys` (the keys commits write below a key, as
etcd's prefix watch), :func:`watch_namespaces` (namespaces as they come
and go), :func:`stream` (a value in chunks), :func:`wait_create` (one value,
waiting for the key), :func:`watch_eventlog` / :func:`wait_event` (RFC 18
eventlogs, entries as the plain dicts of :mod:`kvs.eventlog`), and
:class:`SyncWatch` for the blocking facade (:class:`broker.sync.SyncHandle`).
See docs/api.md, "Watching keys".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, Self, TypedDict, TypeVar, Unpack, cast, overload

from broker.content import blobref
from broker.errors import RemoteError, no_service
from broker.message import NODEID_ANY
from broker.rpc import HandleCore, Stream, check_timeout
from kvs import eventlog
from kvs.client import _parse_json, default_namespace
from kvs.eventlog import EventlogError
from kvs_watch import flags as F
from kvs_watch.backlog import Backlog, Folded, check_max_backlog
from kvs_watch.resume import NamespaceResume, Resume, WatchResume

CANCEL_TIMEOUT = 10.0
"""How long :meth:`Watch.cancel` waits for the broker's ``ENODATA``."""


@dataclass(frozen=True, slots=True)
class WatchEntry:
    """One answer of a watch.

    ``value`` is the bytes of a ``val`` tree object (``None`` for a
    directory, symlink, ... -- see ``treeobj``); ``rootseq`` is the version
    of the namespace the answer was looked up at.  With APPEND, ``value``
    holds only the bytes appended since the previous entry.  ``removed``
    (a ``deletes`` watch only): the key is missing at ``rootseq``;
    ``value`` and ``treeobj`` are then ``None``.
    """

    key: str
    value: bytes | None
    treeobj: dict[str, Any] | None = field(repr=False)
    rootseq: int
    namespace: str
    removed: bool = False

    def text(self, encoding: str = "utf-8", errors: str = "surrogateescape") -> str:
        """``value`` decoded (``""`` for a non-value); bytes that are not
        text come back as surrogate escapes, as ``KVS.get_str`` gives them,
        so the ``str`` a ``put`` stored is the one a watch shows (give
        ``errors="replace"`` for text to display)."""
        return (self.value or b"").decode(encoding, errors)

    def json(self) -> Any:
        """``value`` parsed as JSON (``ValueError`` naming the key if it is
        not JSON, as ``KVS.get_json`` raises; and for an entry with no
        value: ``removed``, or a directory or symlink -- there is nothing
        to parse, and ``json.loads(b"")``'s "Expecting value: line 1
        column 1" said nothing of why)."""
        if self.value is None:
            why = (f"removed at version {self.rootseq}" if self.removed else
                   f"a {(self.treeobj or {}).get('type', 'non-value')}, not a value")
            raise ValueError(f"{self.key}: {why}: no value to parse as JSON")
        return _parse_json(self.key, self.value)


class InitialDone:
    """The marker yielded once the initial value is delivered (INITIAL_SENTINEL)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "INITIAL_DONE"


INITIAL_DONE = InitialDone()

ItemT = TypeVar("ItemT")
ItemT_co = TypeVar("ItemT_co", covariant=True)


class WatchOptions(TypedDict, total=False):
    """The options of :func:`watch` besides ``namespace`` and
    ``initial_sentinel`` (what ``KVS.watch(key, **options)`` passes on)."""

    waitcreate: bool
    uniq: bool
    append: bool
    full: bool
    treeobj: bool
    readdir: bool
    readlink: bool
    deletes: bool
    nodeid: int
    max_backlog: int | None


def _rank_stopping(h: Any, exc: RemoteError) -> bool:
    """``exc`` ended a watch because its rank stops (SIGTERM, a restart, a
    lost parent), and ``h`` reconnects: the watch goes on with the rank's
    next process, as after a lost connection."""
    return (exc.errnum == errno.ENOSYS and exc.errstr.startswith(F.STOPPING)
            and bool(getattr(h, "reconnect", False)))


def _module_removed(h: Any, exc: RemoteError) -> bool:
    """``exc`` ended a watch because ``module remove`` (or ``reload``) took
    kvs-watch off its rank, and ``h`` reconnects: the watch is asked again
    at once, on the same connection -- served by the module loaded again,
    or meanwhile by the one of a rank above -- and resumes without a
    repeat, as after a lost connection."""
    return (exc.errnum == errno.ENOSYS and exc.errstr.startswith(F.ENDED_BY_MODULE_CHANGE)
            and bool(getattr(h, "reconnect", False)))


def _going_on(h: Any, exc: RemoteError, nodeid: int, sent_on: int,
              reask: _Reask) -> tuple[int, bool] | None:
    """How a watch that ``exc`` ended goes on, on a handle that reconnects:
    ``(away, wait)`` -- ``away`` -1 to be sent again on the next connection
    (the current one, if still up), N on one after the handle's N-th (its
    own rank stopping: the connection it went on will close); ``wait``:
    after ``reask``'s pause (a module or rank not back yet) -- or None:
    ``exc`` ends it (always, on a plain handle)."""
    if not getattr(h, "reconnect", False):
        return None
    if _rank_stopping(h, exc):
        # (another rank's, nodeid: the handle's connection stays, and the
        # watch is asked again until that rank is back; this handle's own
        # rank named by nodeid, the lost connection follows)
        return (sent_on, False) if nodeid == NODEID_ANY else (-1, True)
    if exc.errnum == errno.ECONNRESET or _module_removed(h, exc):
        return -1, False
    if reask.waits(exc):
        return -1, True
    return None


REASK_FIRST = 0.01
REASK_MAX = 1.0
"""A watch asked again (above) that no kvs-watch serves -- rank 0's was
removed, and rank 0 has no rank above to send it to -- is asked again
after ``REASK_FIRST`` seconds, then at doubling intervals up to every
``REASK_MAX``, until the module is back: for as long as the watch lives
(its reader's timeout, a cancel, or the handle's close end it)."""


class _Reask:
    """When a watch asked again without a kvs-watch to serve it tries
    once more (:data:`REASK_FIRST`, doubling up to :data:`REASK_MAX`)."""

    __slots__ = ("pending", "delay", "heard")

    def __init__(self) -> None:
        self.pending = False
        """Asked again, and not answered yet: an ``ENOSYS`` from the router
        now means the module is not back yet, not an error of the watch."""
        self.delay = REASK_FIRST
        self.heard = False
        """The watch was answered once: it was running."""

    def answered(self) -> None:
        self.pending = False
        self.delay = REASK_FIRST
        self.heard = True

    def waits(self, exc: RemoteError) -> bool:
        """``exc`` ended the watch: wait, and ask again?  The router's "no
        service" to the watch asked again (the module is not back yet), or
        ``EHOSTUNREACH`` -- the rank serving a ``nodeid`` watch went away
        while it ran, or is not back yet: it is asked again until it is, as
        the handle dials its own rank again (a watch that was never
        answered, sent to a rank that is not there, raises it)."""
        if exc.errnum == errno.EHOSTUNREACH:
            return self.pending or self.heard
        return self.pending and no_service(exc)

    async def wait(self) -> None:
        delay, self.delay = self.delay, min(self.delay * 2, REASK_MAX)
        await asyncio.sleep(delay)


def _entry(key: str, payload: Any, treeobj: bool = False) -> WatchEntry:
    """The entry of an answer; ``treeobj`` (the watch's flag): no ``value``,
    whatever the tree object (it was the bytes of a small value, inline,
    and None for a bigger one's ``valref``)."""
    obj = payload["val"]
    seq, ns = int(payload.get("rootseq", -1)), str(payload.get("namespace", ""))
    if obj is None:  # (only a DELETES watch is answered so)
        return WatchEntry(key, None, None, seq, ns, removed=True)
    value = obj["data"] if obj.get("type") == "val" and not treeobj else None
    return WatchEntry(key, value, obj, seq, ns)


class Watch(Generic[ItemT]):
    """A ``kvs-watch.lookup`` request and its answers (see the module docstring).

    The request is sent by :meth:`start` -- called for you by ``async with``
    or the first ``__anext__``.  ``ItemT`` is what iterating it yields, for
    type checkers: :class:`WatchEntry`, or ``WatchEntry | InitialDone``
    when :func:`watch` is given ``initial_sentinel``.
    """

    _resume: Resume | None = None
    """Set on a handle that reconnects: what was delivered (kvs_watch/resume.py)."""
    _ready: deque[Any]
    """(With ``_resume``.)  Payloads the filter gave beyond the one returned."""
    _stopped = False
    """Cancelled or ended here: a watch waiting for its handle to reconnect
    is not sent again."""
    _stop_wakes: tuple[asyncio.Future[None], ...] = ()
    """While readers wait for the rank's return (:meth:`_wait_back`), one
    future each: :meth:`_stop` wakes them, so a cancel meanwhile ends
    their loops."""
    sent_on = 0
    """The handle's :attr:`~broker.handle.Handle.reconnects` when the
    request was last sent: the connection it went on."""
    _away: int | None = None
    """Set while the watch waits for its rank's return (reconnecting): -1,
    the next connection; N, one after the handle's N-th.  Kept if that wait
    is cut short (a timeout around ``anext``), so the next ``anext`` waits
    again instead of reading the old, ended stream."""
    _reask: _Reask | None = None
    """(On a handle that reconnects.)  Asked again after ``module remove``: see
    :class:`_Reask`."""
    _backlog: Backlog | None = None
    """(A ``WATCH``.)  The bound on its unread answers (kvs_watch/backlog.py)."""
    max_backlog: int | None = None
    """The bound given (None: the serving rank's ``kvs-watch.max-backlog``)."""

    def __init__(self, h: HandleCore, key: str, flags: int, *, namespace: str | None = None,
                 nodeid: int = NODEID_ANY, max_backlog: int | None = None) -> None:
        F.check(flags, streaming=True)  # misuse is a ValueError-like error here already
        if not isinstance(key, str):  # as KVS does: the broker would say only EPROTO
            raise TypeError(f"key must be a str, not {type(key).__name__}")
        if namespace is not None and not isinstance(namespace, str):
            raise TypeError(f"namespace must be a str, not {type(namespace).__name__}")
        if not hasattr(h, "rpc_stream"):  # (it failed later with an AttributeError)
            raise TypeError(f"watch a key through a Handle, not a {type(h).__name__}: "
                            "pass kvs.handle, or call the KVS or SyncKVS method of the "
                            "same name (kvs.watch(key), kvs.watch_keys(key))")
        self.h = h
        self.key = key
        self.flags = flags
        self.namespace = default_namespace(namespace)
        self.nodeid = nodeid
        self.max_backlog = check_max_backlog(max_backlog)
        if flags & F.WATCH:  # (a STREAM, or a lookup, ends by itself)
            self._backlog = Backlog(h, key, flags, nodeid, self.max_backlog)
        self._stream: Stream | None = None

    def __repr__(self) -> str:
        return f"<Watch {self.namespace}:{self.key} flags={self.flags:#x}>"

    @property
    def matchtag(self) -> int | None:
        return self._stream.matchtag if self._stream is not None else None

    @property
    def started(self) -> bool:
        """The request was sent (:meth:`start`)."""
        return self._stream is not None

    @property
    def done(self) -> bool:
        """The stream has ended (cancelled, or ended by the rank).  A watch
        never started is not done: it has not begun.  Nor is one waiting
        for its rank or kvs-watch to come back (a handle that reconnects),
        though its old stream ended: it will be sent again."""
        if self._away is not None and not self._stopped:
            return False
        # (abandoned: left by an exception, its answers no longer read)
        return self._stream is not None and (self._stream.done or self._stream.abandoned)

    def start(self) -> Self:
        """Send the request (once); needs a running event loop."""
        if self._stream is None:
            if getattr(self.h, "reconnect", False):  # (a Handle that reconnects)
                self._resume, self._ready = self._resumer(), deque()
                self._reask = _Reask()
            topic, payload = self._request()
            self._send(topic, payload)
        return self

    def _resumer(self) -> Resume | None:
        """What follows the answers so that the watch can be sent again
        when the handle reconnects (None: it cannot, and ends)."""
        if self.flags & (F.STREAM | F.WATCH_KEYS):
            return None  # (a key watch resumes by its since: KeyWatch)
        return WatchResume(self.key, self.flags)

    def _send(self, topic: str, payload: dict[str, Any]) -> None:
        # (which connection it went on: a rank that then says it is stopping
        # is this connection's, and the watch goes on with the next one)
        self.sent_on = getattr(self.h, "reconnects", 0)
        self._stream = self.h.rpc_stream(topic, payload, nodeid=self.nodeid)
        if self._backlog is not None:
            self._backlog.attach(self._stream)
        # Dropped unfinished, it is cancelled: on the handle's loop when
        # that runs, at once when it does not (the blocking facade
        # between calls, whose loop turns only inside one).
        dropped = weakref.finalize(self, _abandon_soon, asyncio.get_running_loop(),
                                   self.h, self._stream, self.nodeid)
        dropped.atexit = False

    async def _wait_back(self, after: int | None) -> None:
        """Until the handle is connected (``after``: again, after its
        ``after``-th connection); ``StopAsyncIteration`` if the watch is
        cancelled first or meanwhile (:meth:`cancel`, :meth:`_end_now`:
        the reader waiting here was left waiting for the rank, for ever
        if it never came back), ``RemoteError`` if the handle is closed."""
        if self._stopped:
            raise StopAsyncIteration
        h: Any = self.h
        back = asyncio.ensure_future(h.wait_connected() if after is None
                                     else h.wait_reconnected(after))
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._stop_wakes = (*self._stop_wakes, wake)
        try:
            await asyncio.wait((back, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._stop_wakes = tuple(w for w in self._stop_wakes if w is not wake)
            if not back.done():
                back.cancel()
        if self._stopped:
            if back.done() and not back.cancelled():
                back.exception()  # (read: the watch ends anyway)
            raise StopAsyncIteration  # (cancelled meanwhile)
        back.result()

    def _stop(self) -> None:
        """Cancelled, or ended here: not sent again, and a reader waiting
        for the rank's return ends (:meth:`_wait_back`)."""
        self._stopped = True
        for wake in self._stop_wakes:
            if not wake.done():
                wake.set_result(None)

    async def _restart(self, resume: Resume, after: int | None = None) -> Stream:
        """The handle lost its connection and reconnects: send the request
        again once it has (raises if the handle is closed meanwhile).
        ``after``: the rank said it is stopping, while its connection was
        the handle's ``after``-th: wait for the next one."""
        await self._wait_back(after)
        topic, payload = self._request()
        resume.restarted()
        self._send(topic, {**payload, "flags": resume.flags(payload["flags"])})
        self._away = None
        if self._reask is not None:
            self._reask.pending = True
        assert self._stream is not None
        return self._stream

    def _request(self) -> tuple[str, dict[str, Any]]:
        """The streaming request :meth:`start` sends."""
        return "kvs-watch.lookup", {"namespace": self.namespace, "key": self.key,
                                    "flags": self.flags}

    def _enter(self) -> Self:
        """Start it for an ``async with`` block; ``RuntimeError`` if it has
        ended: a watch runs once (its stream, cancelled by the end of a
        first block or ended by the rank, is over), and a second block
        silently yielded nothing."""
        if self.done:
            raise RuntimeError(f"{self!r} has ended (a watch runs once): start a new one "
                               "for another block")
        return self.start()

    async def __aenter__(self) -> Self:
        return self._enter()

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._stop()
        if exc_type is None:
            await self.cancel()
            return
        # Left by an exception (a cancel, a timeout): cancel on the rank
        # without waiting for the end of the stream, which a stuck rank
        # would hold up for CANCEL_TIMEOUT; what it still sends is dropped.
        # While another task iterates it, that task reads on to the end the
        # cancel brings, as cancel() leaves it (nothing was sent: the watch
        # went on, and that task waited for ever).
        stream = self._stream
        if stream is None or stream.done:
            return
        if not stream.reading:
            _abandon(self.h, stream, self.nodeid)
            return
        with contextlib.suppress(RemoteError, OSError):  # the handle is closed
            self.h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag},
                                   nodeid=self.nodeid)

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> ItemT:
        payload = await self.next_payload()
        # (the sentinel comes only when the flags asked for it: see watch())
        return cast(ItemT, INITIAL_DONE if payload is None
                    else _entry(self.key, payload, bool(self.flags & F.TREEOBJ)))

    async def next_payload(self) -> Any:
        """The next answer as sent (``None``: the sentinel); raises
        ``StopAsyncIteration`` at the end of the stream."""
        stream = self.start()._stream
        assert stream is not None
        resume = self._resume
        if resume is None:
            try:
                msg = await stream.next_message()
            except RemoteError as exc:
                self._cut_short(stream, exc)
                raise
            if msg is None:
                raise StopAsyncIteration
            p = msg.payload
            return p.settled() if type(p) is Folded else p
        ready = self._ready
        while not ready:
            if self._away is not None:  # (also a wait for the rank cut short by a timeout)
                stream = await self._restart(resume, None if self._away < 0 else self._away)
            try:
                msg = await stream.next_message()
            except RemoteError as exc:
                assert self._reask is not None  # (a reconnecting handle's, as _resume)
                away = _going_on(self.h, exc, self.nodeid, self.sent_on, self._reask)
                if away is None:
                    self._cut_short(stream, exc)
                    raise
                self._away, reask = away  # (set first: a timeout cutting the wait keeps it)
                if reask:
                    await self._reask.wait()
                continue
            if self._reask is not None:
                self._reask.answered()
            if msg is None:
                raise StopAsyncIteration
            p = msg.payload
            ready.extend(resume.take(p.settled() if type(p) is Folded else p))
        return ready.popleft()

    def _cut_short(self, stream: Stream, exc: RemoteError) -> None:
        """The stream ended with ``exc``.  ``EMSGSIZE`` is a rank's answer in
        place of one it could not pass on (over ``tbon.max-message``): the
        watch is still running on its rank, which does not know, so it is
        cancelled there (else it went on answering into nothing until this
        connection closed).  A value watch of a directory (``EISDIR``) is
        told, in a note its traceback shows, how to watch one: the CLI says
        it its own way, from the same message."""
        if exc.errnum == errno.EISDIR and not self.flags & (F.READDIR | F.TREEOBJ):
            exc.add_note("(watch a directory's entries with readdir=True, or the keys "
                         "below it with watch_keys())")
        if exc.errnum == errno.EMSGSIZE:
            with contextlib.suppress(RemoteError, OSError):  # (the handle is closed)
                self.h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag},
                                       nodeid=self.nodeid)

    async def cancel(self, timeout: float | None = CANCEL_TIMEOUT) -> None:
        """Stop the watch: ``kvs-watch.cancel``, then drain to the end of the stream.

        Idempotent.  Answers still in flight are discarded; an error ending
        the stream meanwhile (or a lost connection) is not raised.  Called
        while another task iterates the watch, it returns once the cancel
        is sent: that task's loop ends at the end of the stream.
        """
        self._stop()
        stream = self._stream
        if stream is None or stream.done:
            return
        try:
            if not stream.ended_here:  # (else it was cancelled then: Backlog)
                self.h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag},
                                       nodeid=self.nodeid)
            if stream.reading:
                return
            async with asyncio.timeout(timeout):
                while await stream.next_message() is not None:
                    pass
        except (RemoteError, TimeoutError):
            pass

    def _end_now(self) -> None:
        """(On the handle's loop.)  End the watch at once for its reader:
        cancel it on the rank and drop what it still sends, so a reader
        waiting now, or the next one, finds the end of the stream (as when
        it is garbage collected).  What :meth:`SyncWatch.cancel` does from
        another thread."""
        self._stop()
        if self._stream is not None:
            _abandon(self.h, self._stream, self.nodeid)


def _abandon_soon(loop: asyncio.AbstractEventLoop, h: HandleCore, stream: Stream,
                  nodeid: int) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: so is the handle
        if loop.is_running():
            loop.call_soon_threadsafe(_abandon, h, stream, nodeid)
        else:  # the blocking facade between calls: its loop turns only inside one
            _abandon(h, stream, nodeid)


def _abandon(h: HandleCore, stream: Stream, nodeid: int) -> None:
    """A watch was garbage collected before its stream ended: cancel it on
    the broker and discard what it still sends."""
    if stream.done:
        return
    stream.abandon()
    with contextlib.suppress(RemoteError, OSError):  # the handle is closed
        h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag}, nodeid=nodeid)


@overload
def watch(h: HandleCore, key: str, *, namespace: str | None = None,
          initial_sentinel: Literal[False] = False,
          **options: Unpack[WatchOptions]) -> Watch[WatchEntry]: ...


@overload
def watch(h: HandleCore, key: str, *, namespace: str | None = None,
          initial_sentinel: bool,
          **options: Unpack[WatchOptions]) -> Watch[WatchEntry | InitialDone]: ...


def watch(
    h: HandleCore,
    key: str,
    *,
    namespace: str | None = None,
    waitcreate: bool = False,
    uniq: bool = False,
    append: bool = False,
    full: bool = False,
    initial_sentinel: bool = False,
    treeobj: bool = False,
    readdir: bool = False,
    readlink: bool = False,
    deletes: bool = False,
    nodeid: int = NODEID_ANY,
    max_backlog: int | None = None,
) -> Watch[Any]:
    """Watch ``key``: its current value, then one entry per commit naming it.

    * ``waitcreate``: a missing key (or namespace) is waited for instead of
      raising ``ENOENT`` (``ENOTSUP``);
    * ``uniq``: only entries whose value changed;
    * ``full``: look the key up on every commit of the namespace, so a
      replaced parent directory or symlink target is noticed (entries only
      on change);
    * ``append``: the initial value as one entry per stored blob (a value
      built by appends comes in several, all with the same ``rootseq``),
      then only appended bytes (``EINVAL`` if the value is replaced or
      shortened);
    * ``initial_sentinel``: yield :data:`INITIAL_DONE` after the initial
      value (with ``append``); the watch then yields
      ``WatchEntry | InitialDone``, and :class:`WatchEntry` alone otherwise
      (as type checkers see it too);
    * ``treeobj`` / ``readdir`` / ``readlink``: as for a lookup;
    * ``deletes``: a removal of the key does not end the watch with
      ``ENOENT``: it yields an entry with ``removed`` set (``value`` and
      ``treeobj`` None), then nothing until the key has a value again,
      which comes as a new value (with ``append``, all of it).  A key
      missing at the start is such an entry too (with ``waitcreate``, it is
      waited for silently).  A kvbroker extension, as etcd's DELETE event;
    * ``nodeid``: the rank whose kvs-watch serves the watch (default: ours);
    * ``max_backlog``: answers its reader may leave unread (default: the
      serving rank's ``kvs-watch.max-backlog``); past it the watch ends
      ``EOVERFLOW``, as if its rank had overflowed -- with ``append``
      (without ``deletes``) it folds instead: an answer joins the unread one
      before it, each byte once, in order (kvs_watch/backlog.py).

    ``namespace`` defaults to ``$KVBROKER_NAMESPACE``, then ``primary``.
    Raises ``ErrnoError(EINVAL)`` at once for an invalid combination.
    """
    flags = F.WATCH
    for on, bit in ((waitcreate, F.WAITCREATE), (uniq, F.UNIQ), (append, F.APPEND),
                    (full, F.FULL), (initial_sentinel, F.INITIAL_SENTINEL),
                    (treeobj, F.TREEOBJ), (readdir, F.READDIR), (readlink, F.READLINK),
                    (deletes, F.DELETES)):
        if on:
            flags |= bit
    return Watch(h, key, flags, namespace=namespace, nodeid=nodeid, max_backlog=max_backlog)


def stream(h: HandleCore, key: str, *, namespace: str | None = None,
           waitcreate: bool = False, nodeid: int = NODEID_ANY) -> Watch[WatchEntry]:
    """Read a (large) value in chunks: one entry per stored blob, then the end.

    Flux's ``FLUX_KVS_STREAM``: the value is never assembled in one message.
    With ``waitcreate`` a missing key is waited for.
    """
    flags = F.STREAM | (F.WAITCREATE if waitcreate else 0)
    return Watch[WatchEntry](h, key, flags, namespace=namespace, nodeid=nodeid)


async def wait_create(h: HandleCore, key: str, *, namespace: str | None = None,
                      treeobj: bool = False, readdir: bool = False, readlink: bool = False,
                      nodeid: int = NODEID_ANY) -> WatchEntry:
    """The value of ``key``, waiting until it (and its namespace) exists.

    Time-box it with ``asyncio.timeout``: cancelling it cancels the watch.

    Served by the handle's rank (``nodeid`` not given: an explicit one,
    even that rank's, goes without), it first pings
    rank 0: the answer comes down the tree behind every event rank 0 sent
    before it, so a namespace removed before this call (its
    ``namespace_remove`` answered, anywhere) is known removed here by then,
    and the value is never the removed namespace's -- a follower that had
    not heard the removal yet answered from it (a chaos probe: 7-37% of
    tries, a name reused at once).  One round trip to rank 0 more.
    """
    await behind_removals(h, nodeid)
    flags = F.WAITCREATE
    for on, bit in ((treeobj, F.TREEOBJ), (readdir, F.READDIR), (readlink, F.READLINK)):
        if on:
            flags |= bit
    async with Watch[WatchEntry](h, key, flags, namespace=namespace, nodeid=nodeid) as w:
        async for entry in w:
            return entry
    raise RemoteError(errno.ENODATA, f"{key}: watch ended without a value")


async def behind_removals(h: HandleCore, nodeid: int = NODEID_ANY) -> None:
    """A barrier before a watch whose namespace may just have been removed
    and created again (a job's name reused): a ``broker.ping`` to rank 0,
    whose answer comes down the tree behind every event rank 0 sent before
    it, so the handle's rank has heard of every removal answered before
    this call -- it served a watch from the incarnation it still held (a
    waitcreate watch then ended ``ENOTSUP`` without ever following the new
    one; :func:`wait_event` returned the old job's event: a probe, 1-12%
    of tries).  Nothing for a watch sent to a rank of the caller's choice
    (``nodeid``): its own path is not the handle's.  One round trip to
    rank 0; :func:`wait_create`, :func:`wait_event` and the kvs-watch
    commands make it, a :func:`watch` does not (await this first)."""
    if nodeid == NODEID_ANY:
        await h.rpc("broker.ping", {}, nodeid=0)


# ---------------------------------------------------------------- namespaces


@dataclass(frozen=True, slots=True)
class NamespaceEvent:
    """One answer of :func:`watch_namespaces`: namespace ``namespace``
    (owned by uid ``owner``) was ``"created"`` or ``"removed"``.  ``epoch``
    tells namespaces of the same name apart (rank 0 numbers every
    namespace-create, increasing across its restarts; ``primary`` is 0).
    ``initial``: it existed when the watch started (the list), rather than
    being created since.

    Asked for (``listed=True``), the end of the list is one more, ``event``
    ``"listed"`` (:data:`NS_LISTED`: ``namespace`` ``""``, ``owner`` -1,
    ``epoch`` None, ``initial`` False): a marker, so that a watcher of an
    empty list still learns the list is complete."""

    namespace: str
    owner: int
    event: str
    epoch: int | None = None
    initial: bool = False

    @property
    def created(self) -> bool:
        return self.event == "created"

    @property
    def removed(self) -> bool:
        return self.event == "removed"

    @property
    def listed(self) -> bool:
        """The end-of-list marker (only with ``listed=True``)."""
        return self.event == "listed"


NS_LISTED = NamespaceEvent("", -1, "listed")
"""The end-of-list marker :func:`watch_namespaces` yields with ``listed=True``
(equal to every such answer: a frozen dataclass compares by value)."""


NS_NOLIST = 1
"""``kvs-watch.namespaces`` flag: changes only, no initial list."""


class NamespaceWatch(Watch[NamespaceEvent]):
    """A ``kvs-watch.namespaces`` request (:func:`watch_namespaces`): the
    same async iterator and context manager as :class:`Watch`, cancelled the
    same way, yielding :class:`NamespaceEvent`."""

    def __init__(self, h: HandleCore, prefix: str = "", *, changes_only: bool = False,
                 listed: bool = False, nodeid: int = NODEID_ANY) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, not {type(prefix).__name__}")
        if not hasattr(h, "rpc_stream"):
            raise TypeError(f"watch namespaces through a Handle, not a {type(h).__name__}")
        self.h = h
        self.key = ""
        self.flags = 0
        self.namespace = ""
        self.prefix = prefix
        self.changes_only = changes_only
        self.listed = listed
        """Yield the broker's end-of-list answer (:data:`NS_LISTED`); else skip it."""
        self.nodeid = nodeid
        self._stream = None

    def __repr__(self) -> str:
        return f"<NamespaceWatch prefix={self.prefix!r}>"

    def _request(self) -> tuple[str, dict[str, Any]]:
        # (on a handle that reconnects, the list is asked for anyway: what
        # exists must be known to resume; NamespaceResume drops it)
        nolist = self.changes_only and self._resume is None
        return "kvs-watch.namespaces", {"prefix": self.prefix,
                                        "flags": NS_NOLIST if nolist else 0}

    def _resumer(self) -> Resume | None:
        return NamespaceResume(self.changes_only)

    async def __anext__(self) -> NamespaceEvent:
        p = await self.next_payload()
        if p.get("event") == "listed":
            if self.listed:
                return NS_LISTED
            # (skipped unless asked for: a loop written before the marker
            # existed, `if ev.created: ... else: ...`, would take it for a removal)
            p = await self.next_payload()
        epoch = p.get("epoch")
        return NamespaceEvent(str(p["namespace"]), int(p["owner"]), str(p["event"]),
                              epoch if isinstance(epoch, int) else None,
                              bool(p.get("initial", False)))


def watch_namespaces(h: HandleCore, prefix: str = "", *, changes_only: bool = False,
                     listed: bool = False, nodeid: int = NODEID_ANY) -> NamespaceWatch:
    """The namespaces whose name starts with ``prefix``: first each one that
    exists (``initial``, in creation order), then each one created or removed
    as it happens, with no gap and no duplicate between the two (the broker
    merges them by epoch).  A guest is told of its own namespaces only.
    ``changes_only`` skips the list.  ``listed`` yields :data:`NS_LISTED`
    between the list and the changes (first, with ``changes_only``), so a
    caller can tell the list is complete (and the watch started) even when
    it is empty; off by default,
    so that loops that know only created and removed see nothing new.  As
    etcd's list-then-watch, so a job worker discovers jobs by their
    namespaces (``job-``) without coordinating through keys of ``primary``.
    A kvbroker extension."""
    return NamespaceWatch(h, prefix, changes_only=changes_only, listed=listed, nodeid=nodeid)


class _Wrapped:
    """A :class:`Watch` whose answers another class turns into its own items:
    the same async context manager (``async with`` cancels it)."""

    def __init__(self, w: Watch[Any]) -> None:
        self.watch = w

    async def __aenter__(self) -> Self:
        self.watch._enter()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # As the watch's own: left by an exception (a timeout), it cancels
        # without draining, or a stuck rank held wait_event(timeout=0.5)
        # for the drain's CANCEL_TIMEOUT.
        await self.watch.__aexit__(exc_type, *exc)

    def __aiter__(self) -> Self:
        return self

    async def cancel(self) -> None:
        await self.watch.cancel()

    def _end_now(self) -> None:
        self.watch._end_now()

    @property
    def started(self) -> bool:
        return self.watch.started

    @property
    def done(self) -> bool:
        return self.watch.done

    def __repr__(self) -> str:
        w = self.watch
        return f"<{type(self).__name__} {w.namespace}:{w.key}{' ended' if w.done else ''}>"


# ---------------------------------------------------------------- key changes


@dataclass(frozen=True, slots=True)
class KeyChanges:
    """One answer of :func:`watch_keys`.

    ``keys`` are the keys one commit wrote at or below the watched key, as
    written (normalised), or a directory above it that the commit replaced
    or removed (everything below may have changed).  The first answer
    (``initial``) is the root the watch starts from -- read the keys there,
    then follow the changes; it has no keys, or with ``since`` the keys
    changed since that root.  Keys are as the commits named them: a write
    through a symlink shows the link's path.
    """

    prefix: str
    keys: tuple[str, ...]
    rootseq: int
    rootref: str
    namespace: str
    initial: bool = False
    """The first answer: where the changes start."""


SINCE_WAIT = 2.0
"""Seconds a key watch with ``since_version`` waits for its rank to reach
that version before it starts anyway (a lagging rank takes milliseconds; a
namespace removed and created again since never gets there)."""


class KeyWatch(_Wrapped):
    """A key watch (:func:`watch_keys`), yielding :class:`KeyChanges`."""

    def __init__(self, w: Watch[Any], since: str | None = None,
                 since_version: int | None = None) -> None:
        super().__init__(w)
        self.since = since
        self.since_version = since_version
        self._first = True
        self._ready = since_version is None
        self._held: dict[str, Any] | None = None
        """The first answer, kept when catching up was interrupted (a
        timeout around ``anext``): the next call catches up from it."""
        self._last: tuple[str, int] | None = None
        """The root (rootref, rootseq) of the last answer yielded: where a
        watch resumed after its handle reconnected catches up from."""
        self._resumed = False
        """The watch was sent again: its first answer is a change, not initial."""
        self._away: int | None = None
        """As :attr:`Watch._away`: its rank's return is being waited for."""
        self._reask = _Reask()
        """As :attr:`Watch._reask`."""

    async def _prepare(self) -> None:
        """Start the watch -- with ``since_version``, once its rank has
        reached that version: a watch that started on a rank still behind
        the root it catches up from went back a version, and reported the
        next commit twice.  (Ready only once that wait is over: a timeout
        around the first ``anext`` must not skip it.)"""
        if not self._ready:
            try:
                await self.watch.h.rpc("kvs.wait-version", {
                    "namespace": self.watch.namespace, "rootseq": self.since_version,
                    "timeout": SINCE_WAIT}, nodeid=self.watch.nodeid)
            except RemoteError as exc:
                # No such namespace yet (waitcreate's), or a version it will
                # not reach (removed and created again since): start anyway.
                if exc.errnum not in (errno.ENOTSUP, errno.ETIMEDOUT):
                    raise
            self._ready = True
        if self.watch._stopped:  # (cancelled during that wait: not sent, the loop ends)
            raise StopAsyncIteration
        self.watch.start()

    async def __aenter__(self) -> Self:
        if self.watch.done:
            self.watch._enter()  # (raises: a watch runs once)
        await self._prepare()
        return self

    async def __anext__(self) -> KeyChanges:
        while True:
            changes = await self._next()
            if changes is not None:
                return changes

    @property
    def done(self) -> bool:
        """As :attr:`Watch.done`: not while waiting to be sent again."""
        if self._away is not None and not self.watch._stopped:
            return False
        return self.watch.done

    async def _resume(self, after: int | None = None) -> None:
        """The handle reconnected (``reconnect=True``): send the watch again,
        catching up since the last root yielded, so no change is missed
        (``after``: as :meth:`Watch._restart`'s)."""
        w = self.watch
        await w._wait_back(after)
        self._away = None
        self._reask.pending = True
        self.watch = Watch[Any](w.h, w.key, w.flags, namespace=w.namespace, nodeid=w.nodeid,
                                max_backlog=w.max_backlog)
        if self._last is not None:
            self.since, self.since_version = self._last
            self._first = self._resumed = True
        self._ready = self.since_version is None

    async def _next(self) -> KeyChanges | None:
        """The next answer, or None for a resumed watch's first one when
        nothing changed meanwhile."""
        if self._away is not None:  # (a wait for the rank cut short by a timeout)
            await self._resume(None if self._away < 0 else self._away)
            return None
        if not self._ready:
            await self._prepare()
        p, self._held = self._held, None
        if p is None:
            try:
                p = await self.watch.next_payload()
            except RemoteError as exc:
                w = self.watch
                away = _going_on(w.h, exc, w.nodeid, w.sent_on, self._reask)
                if away is None:
                    raise
                self._away, reask = away
                if reask:
                    await self._reask.wait()
                await self._resume(None if self._away < 0 else self._away)
                return None
            self._reask.answered()
        keys = p["keys"]
        if self._first and self.since is not None:  # what changed since, at this root
            try:
                keys = (await self.watch.h.rpc("kvs.diff", {
                    "namespace": p["namespace"], "old": self.since, "new": p["rootref"],
                    "key": self.watch.key}))["keys"]
            except RemoteError as exc:
                # The watch cannot say where it started: it ends (restart
                # without since, and read the key at the new first answer).
                await self.watch.cancel()
                raise RemoteError(exc.errnum, f"catching up since {self.since}: "
                                  f"{exc.errstr}") from None
            except asyncio.CancelledError:
                # (this call was cancelled, a timeout around it: the watch
                # goes on, and the next call catches up from the same answer)
                self._held = p
                raise
            except BaseException:
                await self.watch.cancel()
                raise
        first, self._first = self._first, False
        if self._resumed:
            self._resumed = first = False
            if not keys:
                return None
        self._last = (str(p["rootref"]), int(p["rootseq"]))
        return KeyChanges(self.watch.key, tuple(keys), int(p["rootseq"]),
                          str(p["rootref"]), str(p["namespace"]), initial=first)


def watch_keys(h: HandleCore, key: str = ".", *, namespace: str | None = None,
               waitcreate: bool = False, since: str | None = None,
               since_version: int | None = None, nodeid: int = NODEID_ANY,
               max_backlog: int | None = None) -> KeyWatch:
    """The keys each commit writes at or below ``key`` (``"."``: anywhere in
    the namespace), as etcd's prefix watch: a first :class:`KeyChanges`
    (``initial``) without keys naming the root it starts at, then one per
    commit that wrote such a key.  With ``since`` (a blobref: the last
    ``rootref`` a watcher saw), the first one holds the keys changed since
    that root (``kvs.diff``), so a watcher that was away misses nothing;
    ``since_version``, that root's version, makes the watch start no earlier
    (on a rank still behind it, it waits).  If the catch-up fails (``EPERM``:
    a guest's root no longer recent; ``ENOENT``: its blobs are gone;
    ``EOVERFLOW``), the first iteration raises it and the watch ends: start
    again without ``since`` and read the key at the first answer's root.
    Nothing is looked up, so it costs the rank a filter of each commit's
    keys.  ``waitcreate`` waits for a missing namespace.  ``max_backlog``:
    as :func:`watch`'s (past it, ``EOVERFLOW``).  A kvbroker extension
    (flag ``WATCH_KEYS``)."""
    if since is not None:
        blobref.check(since)  # (EINVAL now, not at the first answer)
    flags = F.WATCH | F.WATCH_KEYS | (F.WAITCREATE if waitcreate else 0)
    return KeyWatch(Watch[Any](h, key, flags, namespace=namespace, nodeid=nodeid,
                               max_backlog=max_backlog), since, since_version)


# ---------------------------------------------------------------- eventlogs

EventlogEntry = dict[str, Any]
"""An RFC 18 entry ``{"timestamp": float, "name": str, "context"?: {...}}``, the
same plain dict :func:`kvs.eventlog.get` returns."""

BAD_EVENTLOG = eventlog.BAD


def parse_eventlog_entry(line: str | bytes) -> EventlogEntry:
    """Parse one eventlog line; :class:`kvs.eventlog.EventlogError` (a
    ``ValueError``) if it is not an RFC 18 entry: the very check a read
    makes (:func:`kvs.eventlog.decode_entry`), so the two never disagree,
    in the same words."""
    try:
        return eventlog.decode_entry(line)
    except EventlogError as exc:
        raise EventlogError(f"{BAD_EVENTLOG}: {exc.errstr}") from None


class EventlogParser:
    """Turns the answers of an eventlog watch into entries.

    Each answer (an APPEND watch's chunk, a STREAM's blob) is one append and
    must be whole lines: empty, or entries each ending in ``\n``.  Flux
    decodes every answer by itself the same way (``eventlog_decode``); a
    chunk without its final newline is ``EventlogError`` (a ``ValueError``)
    at once -- buffering it would wait forever for a newline that no later
    append supplies.
    """

    def __init__(self) -> None:
        self.lines = 0
        """Lines fed so far: a bad one is named by its number in the log."""

    def feed(self, data: bytes) -> list[EventlogEntry]:
        entries = eventlog.decode(data, first=self.lines + 1)  # (as a read decodes it)
        self.lines += len(entries)
        return entries

    def close(self) -> None:
        """Nothing is ever left over (kept for callers that mark the end)."""


class EventlogWatch(_Wrapped):
    """An APPEND watch of an eventlog, yielding its entries (async iterator and
    async context manager, like :class:`Watch`).  A malformed entry raises
    ``EventlogError`` (a ``ValueError``)."""

    def __init__(self, w: Watch[WatchEntry]) -> None:
        super().__init__(w)
        self._parser = EventlogParser()
        self._ready: deque[EventlogEntry] = deque()

    async def __anext__(self) -> EventlogEntry:
        while not self._ready:
            try:
                entry = await self.watch.__anext__()
            except StopAsyncIteration:
                self._parser.close()
                raise
            self._ready.extend(self._parser.feed(entry.value or b""))
        return self._ready.popleft()


def watch_eventlog(h: HandleCore, key: str, *, namespace: str | None = None,
                   waitcreate: bool = False, nodeid: int = NODEID_ANY) -> EventlogWatch:
    """Every entry of eventlog ``key``, then each new one as it is appended."""
    return EventlogWatch(watch(h, key, namespace=namespace, waitcreate=waitcreate,
                               append=True, nodeid=nodeid))


async def wait_event(h: HandleCore, key: str, name: str, *, namespace: str | None = None,
                     waitcreate: bool = False, timeout: float | None = None,
                     nodeid: int = NODEID_ANY) -> EventlogEntry:
    """The first entry of eventlog ``key`` named ``name`` (waiting for it).

    Raises ``TimeoutError`` after ``timeout`` seconds (the watch is cancelled),
    ``RemoteError`` (``ENOENT`` without ``waitcreate``...) if the watch fails.
    """
    timeout = check_timeout(timeout)
    try:
        async with asyncio.timeout(timeout):
            await behind_removals(h, nodeid)
            async with watch_eventlog(h, key, namespace=namespace, waitcreate=waitcreate,
                                      nodeid=nodeid) as log:
                async for entry in log:
                    if entry["name"] == name:
                        return entry
    except TimeoutError:
        raise TimeoutError(f"{key}: no event {name!r} within {timeout:g} s") from None
    raise RemoteError(errno.ENODATA, f"{key}: event {name!r} never received")


# ---------------------------------------------------------------- blocking facade


class _AsyncWatch(Protocol[ItemT_co]):
    """What :class:`SyncWatch` drives: a :class:`Watch`, :class:`KeyWatch`,
    :class:`EventlogWatch` or :class:`NamespaceWatch`."""

    async def __aenter__(self) -> Any: ...

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None: ...

    async def __anext__(self) -> ItemT_co: ...

    async def cancel(self) -> None: ...

    def _end_now(self) -> None: ...

    @property
    def started(self) -> bool: ...

    @property
    def done(self) -> bool: ...


class SyncWatch(Generic[ItemT]):
    """A :class:`Watch` driven through :class:`broker.sync.SyncHandle`.

        with connect() as sh, SyncWatch(sh, watch(sh.aio, "a.b")) as w:
            for entry in w:
                ...

    It yields what the watch it drives yields (``SyncWatch[WatchEntry]``
    for a plain :func:`watch`).  A ``TimeoutError`` or a Ctrl-C
    (``KeyboardInterrupt``, see :mod:`broker.sync`) from ``next()`` leaves
    the watch going: the next ``next()`` catches up from where it was.
    :meth:`cancel` may be called from another thread, to end a ``next()``
    blocked in the thread that iterates (``StopIteration``).
    """

    def __init__(self, sh: Any, w: _AsyncWatch[ItemT], *,
                 timeout: float | None = None) -> None:
        self.sh = sh
        self.watch = w
        self.timeout = check_timeout(timeout)
        """Seconds each ``next()`` may wait (``TimeoutError``; the watch goes on)."""
        self._reader: int | None = None
        """The thread that entered or iterates it last (``get_ident()``)."""
        self._stopped = False
        """:meth:`cancel` was called from another thread."""

    def __repr__(self) -> str:
        return f"<SyncWatch of {self.watch!r}>"

    def __enter__(self) -> Self:
        self._reader = threading.get_ident()
        self.sh.run(self._start())
        return self

    async def _start(self) -> None:
        if not self._stopped:  # (checked on the loop: see cancel())
            await self.watch.__aenter__()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.cancel()
            return
        # Left by an exception (a next() that timed out, Ctrl-C): as the
        # watch's own ``async with`` does, cancel on the rank without
        # draining, or a stuck serving rank held the exit for CANCEL_TIMEOUT
        # (a next(timeout=0.5) took 10.5 s to come out of the block).
        with contextlib.suppress(RemoteError):  # (the handle is closed)
            self.sh.run(self.watch.__aexit__(exc_type, *exc))

    def __iter__(self) -> Iterator[ItemT]:
        return self

    def __next__(self) -> ItemT:
        async def step() -> Any:
            # (the check runs on the loop, after any _end_now queued before
            # it: a watch stopped before it started is not started here)
            if self._stopped and (self.watch.done or not self.watch.started):
                return _END
            try:
                return await self.watch.__anext__()
            except StopAsyncIteration:
                return _END
        self._reader = threading.get_ident()
        item = self.sh.run(step(), self.timeout)
        if item is _END:
            raise StopIteration
        return cast(ItemT, item)

    def cancel(self) -> None:
        """As :meth:`Watch.cancel`: idempotent, and silent on a closed handle
        (leaving a ``with`` block, it must not replace the block's own
        exception with the handle's).

        From a thread other than the one that iterates the watch (or
        entered its ``with``), it only asks the handle's loop to end the
        watch (:meth:`broker.sync.SyncHandle.call_soon_threadsafe`) and
        returns at once: a ``next()`` blocked there wakes and raises
        ``StopIteration`` (a ``for`` loop just ends), answers still coming
        are dropped, and the rank is sent the cancel; a ``next()`` that
        was not waiting yet raises it when called.  The handle stays
        usable."""
        if self._reader is not None and self._reader != threading.get_ident():
            self._stopped = True  # (set before the callback is queued: see step())
            self.sh.call_soon_threadsafe(self.watch._end_now)
            return
        with contextlib.suppress(RemoteError):  # (the handle is closed)
            self.sh.run(self.watch.cancel())


_END = object()
