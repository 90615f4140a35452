"""The client API: an async :class:`Handle` attached to one rank's local connector.

    async with await Handle.connect() as h:          # KVBROKER_URI
        print(await h.rpc("broker.ping", {"hi": 1}, nodeid=3))
        await h.subscribe("test.")
        await h.publish("test.x", {"n": 1})
        ev = await h.recv_event()

See docs/api.md.  A synchronous facade lives in :mod:`broker.sync`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import subprocess
import warnings
import weakref
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from broker import codec
from broker.errors import ProtocolError, RemoteError, outcome_read
from broker.framewriter import FramedProtocol, FrameWriter
from broker.message import NODEID_ANY, Message, MsgFlags, MsgType
from broker.rpc import HandleCore, Stream, check_str, settle

URI_ENV = "KVBROKER_URI"

__all__ = ["Handle", "Stream", "Event", "parse_uri", "URI_ENV"]

Event = Message
"""Events are delivered as :class:`Message` objects (``topic``, ``payload``, ``seq``)."""


def parse_uri(uri: str | None) -> str:
    """``local:///path/to/socket`` (or a bare path) -> the socket path;
    an ``ssh://`` URI (:mod:`broker.ssh`) is returned whole."""
    if uri is None:
        uri = os.environ.get(URI_ENV)
    elif not uri:
        raise ValueError("empty broker URI (pass None to use $KVBROKER_URI)")
    if not uri:
        raise ValueError(f"no broker URI given and {URI_ENV} is not set")
    if uri.startswith("local://"):
        if uri == "local://":
            raise ValueError("local:// needs the socket's path: local:///path/to/socket")
        return uri[len("local://"):]
    if uri.startswith("ssh://"):
        return uri
    if "://" in uri:
        raise ValueError(f"unsupported broker URI scheme: {uri!r}")
    if uri.startswith(("local:", "ssh:")):  # (a slash short: read as a file name)
        scheme = uri.partition(":")[0]
        raise ValueError(f"{uri}: not a URI: {scheme}:// takes two slashes before the path "
                         f"({'local:///path/to/socket' if scheme == 'local' else 'ssh://host/path'})")
    return uri


def _frames_payload(frames: list[bytes]) -> Any:
    return codec.decode_payload(frames[1:])


class _ClientProtocol(FramedProtocol):
    def __init__(self, handle: Handle) -> None:
        self.handle = handle
        self.decoder = codec.StreamDecoder()
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.decoder.feed(data)
        except ProtocolError:
            self.transport.close()  # type: ignore[union-attr]
            return
        h = self.handle
        for skipped in self.decoder.take_oversized():
            self._fail_oversized(skipped)
        for frames in messages:
            # The common case, the answer to a plain rpc(), skips the Message.
            peek = codec.peek_response(frames)
            if peek is not None and h._answer_future(*peek, frames):
                continue
            try:
                msg = codec.decode(frames)
            except ProtocolError:
                continue
            if msg.type == MsgType.RESPONSE:
                h._on_response(msg)
            elif msg.type == MsgType.EVENT:
                h._on_event(msg)

    def _fail_oversized(self, skipped: codec.Oversized) -> None:
        """An answer too big for this client's decoder was skipped: its
        request fails with ``EMSGSIZE`` rather than wait for ever."""
        peek = codec.peek_response([skipped.header]) if skipped.header is not None else None
        if peek is None:
            return  # not an answer (or its header was too big to keep)
        self.handle._on_response(Message(
            MsgType.RESPONSE, "", matchtag=peek[0], errnum=errno.EMSGSIZE,
            errstr=f"an answer of {skipped.size} bytes exceeds this client's "
                   f"limit ({self.decoder.max_message})"))

    def connection_lost(self, exc: Exception | None) -> None:
        # ECONNRESET (callers test the errno), and the message says whether
        # the user closed the handle or the broker went away -- unless the
        # rank said why it closed the connection (broker.closing).
        h = self.handle
        if h._proto is self:
            if h._user_closed:
                h._fail_all(errno.ECONNRESET, "handle closed")
            elif h._redial is not None:
                if h._redial.parking is None:  # (else handled already: Handle._writer)
                    h._lost()
            elif h._closing is not None:
                h._fail_all(*h._closing)
            else:
                h._fail_all(errno.ECONNRESET, "connection to broker lost")
            h._wake_event_waiters()
        self.let_go_of_output()
        if not self.closed.done():
            self.closed.set_result(None)


class _Parking:
    """Where a reconnecting handle's requests wait, encoded, for the new
    connection (a :class:`FrameWriter`'s ``send``; sent in order once
    connected)."""

    __slots__ = ("messages", "subscriptions")

    def __init__(self) -> None:
        self.messages: list[Sequence[codec.Frame]] = []
        self.subscriptions: Counter[str] = Counter()
        """Per prefix, the subscribes (+1) and unsubscribes (-1) among
        :attr:`messages`: the handle's counts already hold them, so what it
        subscribes again once connected leaves them out -- they go after,
        parked (each was applied twice: an unsubscribe left the rank
        subscribed, and one made while away was ``ENOENT``)."""

    def send(self, frames: Sequence[codec.Frame]) -> None:
        self.messages.append(frames)

    def flush(self) -> None:
        pass


class _Redial:
    """A reconnecting handle's state (see ``Handle.connect(reconnect=True)``)."""

    __slots__ = ("count", "parking", "task", "_waiters")

    def __init__(self) -> None:
        self.count = 0
        self.parking: _Parking | None = None
        """Set while disconnected: the requests made meanwhile."""
        self.task: asyncio.Task[None] | None = None
        """The task dialling again, while disconnected."""
        self._waiters: list[asyncio.Future[None]] = []

    def done_future(self) -> asyncio.Future[None]:
        """A future set when the next dial ends (connected, or the handle closed)."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)


_handles: weakref.WeakSet[Handle] = weakref.WeakSet()
"""Every connected handle, for :func:`_after_fork_in_child`."""
_fork_hook = False
"""Whether :func:`_after_fork_in_child` is registered (at the first connect)."""


def _after_fork_in_child() -> None:
    """In a child of ``fork()``, every connected handle is the parent's: see
    :meth:`Handle._orphan`."""
    for h in list(_handles):
        h._orphan()


class _Closable(Protocol):
    async def close(self) -> None: ...


C = TypeVar("C", bound=_Closable)


class Connecting(Coroutine[Any, Any, C]):
    """What ``connect()`` returns: a coroutine of the connection (await it,
    or hand it to ``asyncio.create_task``, ``asyncio.run``, ``gather``...),
    which is also an async context manager: ``async with X.connect() as
    x:`` connects, and closes the connection at the end of the block.
    (``async with await X.connect()`` works as well: the connection is its
    own context manager.)"""

    __slots__ = ("_open", "_coro", "_entered")

    def __init__(self, open_: Callable[[], Coroutine[Any, Any, C]]) -> None:
        self._open = open_
        self._coro: Coroutine[Any, Any, C] | None = None
        self._entered: C | None = None

    def _inner(self) -> Coroutine[Any, Any, C]:
        if self._coro is None:
            self._coro = self._open()
        return self._coro

    def send(self, value: Any) -> Any:
        return self._inner().send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if val is None and tb is None:
            return self._inner().throw(typ)
        return self._inner().throw(typ, val, tb)

    def close(self) -> None:
        if self._coro is not None:
            self._coro.close()

    def __await__(self) -> Generator[Any, None, C]:
        return self._inner().__await__()

    def __del__(self) -> None:
        if self._coro is None:  # (as Python warns of a coroutine never awaited)
            warnings.warn("connect() was never awaited", RuntimeWarning, stacklevel=2)

    if not TYPE_CHECKING:  # (for a type checker, a missing attribute stays an error)
        def __getattr__(self, name: str) -> Any:
            """Python's own ``'Connecting' object has no attribute 'put'``,
            saying what went wrong: ``kvs = KVS.connect()`` without ``await``
            is the usual slip, and the plain message does not name it."""
            if name.startswith("_"):  # (probes: asyncio's, copy's, ...)
                raise AttributeError(name, name=name, obj=self)
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}: connect() was "
                "not awaited (x = await X.connect(), or async with X.connect() as x:)",
                name=name, obj=self)

    async def __aenter__(self) -> C:
        if self._coro is not None:
            raise RuntimeError("this connect() was awaited or entered already")
        self._entered = await self._inner()
        return self._entered

    async def __aexit__(self, *exc: object) -> None:
        conn, self._entered = self._entered, None
        if conn is not None:
            await conn.close()


class Handle(HandleCore):
    """An async connection to a broker rank (use :meth:`connect`)."""

    def __init__(self) -> None:
        super().__init__()
        self._proto: _ClientProtocol | None = None
        self._events: deque[Message] = deque()
        # The tasks waiting in recv_event(), oldest first: several tasks may
        # share one handle's events, and each event wakes one of them.
        self._event_waiters: deque[asyncio.Future[bool]] = deque()
        """Tasks in :meth:`recv_event`, longest waiting first; a waiter's
        result says whether all were woken at once (the connection went)."""
        self._user_closed = False
        self._closing: tuple[int, str] | None = None
        """(errnum, errstr) of the rank's ``broker.closing``, if it sent one."""
        self._ssh: subprocess.Popen[bytes] | None = None
        """The ssh process of an ``ssh://`` connection."""
        self.uri = ""
        self._path = ""
        """What :func:`parse_uri` made of the URI: a socket path, or ``ssh://...``."""
        self._redial: _Redial | None = None
        """Reconnecting is on (``connect(reconnect=True)``): its state."""
        self._subscriptions: Counter[str] = Counter()
        """The event prefixes subscribed (as many times as net), renewed on a
        new connection."""
        self._owner_pid = os.getpid()
        self._forked = False
        """This process is a child of a fork() made while the handle was open."""

    @classmethod
    def connect(cls, uri: str | None = None, *, reconnect: bool = False) -> Connecting[Self]:
        """Attach to the rank at ``uri`` (default: ``$KVBROKER_URI``):
        ``h = await Handle.connect()``, or ``async with Handle.connect() as
        h:``, which closes it at the end.

        Raises ``OSError`` (e.g. ``ENOENT``, ``ECONNREFUSED``) if the broker
        is not there.

        With ``reconnect``, a lost connection (the rank restarted) is made
        again, as ``flux proxy --reconnect`` does: the requests in flight
        fail with ``ECONNRESET`` (whether the rank acted on one is not
        known), those made meanwhile wait and are sent once connected, the
        event subscriptions are renewed (events published in between are
        missed), and :func:`kvs_watch.client.watch` watches resume.  It
        retries until :meth:`close`, every :attr:`REDIAL_MAX` seconds at
        most.  The first connection must succeed.
        """
        return Connecting(functools.partial(cls._connect, uri, reconnect))

    @classmethod
    async def _connect(cls, uri: str | None, reconnect: bool = False) -> Self:
        path = parse_uri(uri)
        self = cls()
        self._path = path
        self.uri = path if path.startswith("ssh://") else f"local://{path}"
        loop = asyncio.get_running_loop()
        self._proto = await self._dial(loop)
        self._loop = loop
        if reconnect:
            self._redial = _Redial()
        global _fork_hook
        if not _fork_hook:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook = True
        _handles.add(self)
        return self

    async def _dial(self, loop: asyncio.AbstractEventLoop) -> _ClientProtocol:
        """A new connection to :attr:`_path`."""
        path = self._path
        if path.startswith("ssh://"):
            from broker import ssh

            sock, relay = await ssh.open_connection(path)
            try:
                _, proto = await loop.create_unix_connection(lambda: _ClientProtocol(self),
                                                             sock=sock)
            except BaseException:
                sock.close()
                await ssh.reap(relay)
                raise
            self._ssh = relay
            return proto
        try:
            _, proto = await loop.create_unix_connection(lambda: _ClientProtocol(self), path)
        except OSError as exc:
            if exc.errno == errno.ECONNREFUSED and os.path.isdir(path):
                raise type(exc)(exc.errno, "a directory, not a rank's socket (local-RANK "
                                "in an instance's run directory)", path) from None
            if exc.filename is not None or exc.errno is None:
                raise
            # uvloop's says "No such file or directory" and not where
            raise type(exc)(exc.errno, exc.strerror, path) from None
        return proto

    # ------------------------------------------------------------ reconnecting

    REDIAL_MIN = 0.05
    """Seconds before the first try to connect again after a loss."""
    REDIAL_MAX = 2.0
    """The most seconds between two tries (the wait doubles up to it; Flux's
    proxy retries every 2 s)."""

    @property
    def connected(self) -> bool:
        """Whether the handle has a connection now (False while it reconnects,
        and once closed)."""
        proto = self._proto
        return (not self._user_closed and proto is not None and proto.transport is not None
                and not proto.transport.is_closing())

    @property
    def reconnect(self) -> bool:
        """It makes its connection again when lost, until closed
        (``connect(reconnect=True)``, and not closed)."""
        return self._redial is not None and not self._user_closed

    @property
    def reconnects(self) -> int:
        """How many times the connection was made again (``reconnect=True``)."""
        return self._redial.count if self._redial is not None else 0

    async def wait_connected(self) -> None:
        """Return once the handle is connected (at once if it is); raises
        ``RemoteError(ECONNRESET)`` if it is closed, or was lost without
        ``reconnect``."""
        await self._wait_dialled(-1)

    async def wait_reconnected(self, after: int) -> None:
        """Return once the connection has been made again since
        :attr:`reconnects` was ``after`` (``reconnect=True``): a rank that
        said it is stopping still holds the old connection for a moment;
        raises ``RemoteError(ECONNRESET)`` as :meth:`wait_connected`."""
        await self._wait_dialled(after)

    async def _wait_dialled(self, after: int) -> None:
        """Wait until connected with :attr:`reconnects` above ``after``
        (``-1``: any connection will do)."""
        while self.reconnects <= after or not self.connected:
            self._check_open()
            redial = self._redial
            if redial is None or self._user_closed:
                raise RemoteError(errno.ECONNRESET, "handle closed" if self._user_closed
                                  else "connection to broker lost")
            await asyncio.shield(redial.done_future())

    def _lost(self) -> None:
        """The connection went and ``reconnect`` is on: fail what was in
        flight, park what comes next, and dial again in the background."""
        redial = self._redial
        assert redial is not None and self._loop is not None
        why = self._closing or (errno.ECONNRESET, "connection to broker lost")
        self._fail_all(errno.ECONNRESET, f"{why[1]} (reconnecting: the request's fate "
                                         "is unknown)", final=False)
        self._closing = None
        redial.parking = _Parking()
        redial.task = self._loop.create_task(self._redial_loop())

    async def _redial_loop(self) -> None:
        redial = self._redial
        assert redial is not None and redial.parking is not None and self._loop is not None
        delay = self.REDIAL_MIN
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.REDIAL_MAX)
            if self._ssh is not None:
                from broker import ssh

                ssh_proc, self._ssh = self._ssh, None
                await ssh.reap(ssh_proc)
            try:
                proto = await self._dial(self._loop)
            except OSError:  # (not there yet: the rank restarts)
                continue
            except Exception as exc:  # no use trying again: the handle ends
                redial.parking = redial.task = None
                self._fail_all(errno.ECONNRESET, f"cannot reconnect: {exc}")
                self._wake_event_waiters()
                redial.wake()
                return
            assert proto.transport is not None
            try:
                if await self._answers(proto):
                    break
            except BaseException:  # (closed meanwhile)
                proto.transport.abort()
                raise
            proto.transport.abort()
        parked, redial.parking, redial.task = redial.parking, None, None
        self._proto = proto
        redial.count += 1
        # the subscriptions first: the parked requests may be waiting for events
        # (as they were before the parked subscribes and unsubscribes, which follow)
        parked_subs = parked.subscriptions
        for prefix in [*self._subscriptions, *(p for p in parked_subs
                                               if p not in self._subscriptions)]:
            for _ in range(self._subscriptions[prefix] - parked_subs[prefix]):
                # (nobody waits for it; an error is the rank's: a guest's limit)
                self.rpc("event.subscribe", {"topic": prefix}).add_done_callback(outcome_read)
        writer = proto.writer
        assert writer is not None
        for frames in parked.messages:
            writer.send(frames)
        redial.wake()

    async def _answers(self, proto: _ClientProtocol) -> bool:
        """Whether the rank answers a ping on a new connection, before any
        parked request goes there: a rank dying (killed) closes its clients'
        connections before its listening socket, which meanwhile still
        takes new ones that no process will read."""
        assert self._loop is not None and proto.writer is not None
        tag = self._alloc_tag()
        answer: asyncio.Future[Any] = self._loop.create_future()
        self._pending[tag] = answer
        try:
            proto.writer.send(codec.encode_request("broker.ping", {}, tag, NODEID_ANY, 0))
            await asyncio.wait((answer, proto.closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._pending.pop(tag, None)
        return answer.done() and not answer.cancelled() and answer.exception() is None

    def _orphan(self) -> None:
        """In a child of ``fork()``: the connection is the parent's, and so
        is the loop's epoll instance (shared across fork).  A request sent
        here went on the parent's connection under the matchtag the parent
        was to use next, and its answer settled the parent's request (a
        ping's payload for a ``kvs.wait-version``); a ``close()`` here
        unregistered the parent's socket from that epoll, and the parent's
        next call waited for ever.  So, as the blocking facade does, the
        handle is closed to this process without touching either: calls
        raise ``ECONNRESET`` saying why, ``close()`` and ``flush()`` do
        nothing.  Done by a fork hook, so the RPC path checks nothing more
        than it did (the closed error it already tests, and ``_writer``'s
        missing protocol)."""
        self._forked = True
        self._user_closed = True
        self._closed_error = RemoteError(
            errno.ECONNRESET, f"this handle belongs to process {self._owner_pid}, which "
                              "forked this one: connect() again here")
        self._proto = None

    def __repr__(self) -> str:
        proto = self._proto
        if self._forked:
            state = f"of process {self._owner_pid} (forked)"
        elif proto is None:
            state = "not connected"
        elif self._user_closed:
            state = "closed"
        elif proto.transport is None or proto.transport.is_closing():
            state = "reconnecting" if self._redial is not None else "disconnected"
        else:
            state = f"{self.pending} pending"
        return f"<Handle {self.uri or '?'} {state}>"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    CLOSE_FLUSH_TIMEOUT = 5.0
    """Seconds :meth:`close` waits for what is still unsent (a
    ``publish_nowait`` just before it) to reach a broker that is not reading
    (stopped, or stuck), before it drops it and closes anyway."""

    def flush(self) -> None:
        """Hand what the writer held back this loop turn to the socket now
        (small messages after the turn's first go out together when the
        turn ends: docs/protocol.md).  :meth:`close` does it; the sync
        facade does it when its loop stops after a call."""
        proto = self._proto
        if proto is not None and proto.writer is not None:
            proto.writer.flush()

    async def drain(self) -> None:
        """Until what was sent so far is the transport's: back-pressure for a
        loop of :meth:`publish_nowait` or :meth:`send_noresponse`, which
        never wait (as asyncio's ``StreamWriter.drain``).  Such a loop that
        never awaited queued in this process without bound while the rank
        was slower (2.6 GB for a flood of events); awaiting this now and
        then bounds it to about the transport's high-water mark.  At once
        when nothing waits; a connection that ends ends it too (a
        reconnecting handle that is away: at once, its messages wait in
        memory for the next connection)."""
        proto = self._proto
        if proto is None or proto.writer is None or self._forked:
            return
        self._check_loop()
        await asyncio.wait([proto.writer.drained(), proto.closed],
                           return_when=asyncio.FIRST_COMPLETED)

    async def wait_closed(self) -> None:
        """Until this connection ends: the rank closed it (it stopped: the
        last thing a stopping rank does after its modules, so a dump or a
        final checkpoint is written by then), or the handle was closed.
        What ``kvbroker shutdown`` waits on."""
        proto = self._proto
        if proto is None or self._forked:
            return
        self._check_loop()
        await asyncio.shield(proto.closed)

    def abort(self) -> None:
        """Drop the connection now, without a flush or a wait (what is
        unsent is lost; calls still waiting fail once the loop runs): for a
        handle that can no longer be closed properly, as a blocking handle
        collected unclosed, whose loop will not run again."""
        self._user_closed = True
        proto = self._proto
        if proto is not None and proto.transport is not None:
            proto.transport.abort()

    async def close(self) -> None:
        """Disconnect; calls still waiting fail with ``RemoteError(ECONNRESET,
        "handle closed")``.  Unsent requests are flushed first, for at most
        :attr:`CLOSE_FLUSH_TIMEOUT` seconds.  From a loop other than the
        handle's, ``RuntimeError`` saying so, and the handle stays open
        (as any call from there): it waited 5 s for a flush that loop could
        not see, then failed with asyncio's "future belongs to a different
        loop" with the handle marked closed and its socket open."""
        if self._forked:
            self._user_closed = True
            return  # (the parent's: see _orphan)
        self._check_loop()
        proto = self._proto
        self._user_closed = True
        redial = self._redial
        if redial is not None and redial.task is not None:
            redial.task.cancel()  # (the parked requests fail below)
            with contextlib.suppress(asyncio.CancelledError):
                await redial.task
            redial.task = redial.parking = None
            self._fail_all(errno.ECONNRESET, "handle closed")
            self._wake_event_waiters()
        if redial is not None:
            redial.wake()
        if proto is not None and proto.transport is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.CLOSE_FLUSH_TIMEOUT
            if proto.writer is not None:
                # What the writer still holds in pieces (a big message, and
                # those behind it) goes before the transport closes: closed
                # first, it dropped them, the rank read a cut message and
                # EOF, and both were lost.
                await asyncio.wait([proto.writer.drained(), proto.closed],
                                   timeout=self.CLOSE_FLUSH_TIMEOUT,
                                   return_when=asyncio.FIRST_COMPLETED)
            proto.transport.close()
            try:
                await asyncio.wait_for(asyncio.shield(proto.closed),
                                       max(0.0, deadline - loop.time()))
            except TimeoutError:
                proto.transport.abort()
                await proto.closed
        if self._ssh is not None:
            from broker import ssh

            await ssh.reap(self._ssh)

    def _check_loop(self) -> None:
        """The wrong-loop ``RuntimeError`` in a coroutine of the handle's
        that waits on its loop's futures (``close``, ``drain``,
        ``wait_closed``: asyncio's "attached to a different loop", or "Event
        loop is closed", named neither the handle nor what to do)."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise self._wrong_loop()

    def _wrong_loop(self) -> RuntimeError:
        """A call from a loop other than the one the handle was connected
        on: its answers come on that loop (closed, often: the handle of an
        earlier ``asyncio.run()``), so the call failed with asyncio's
        "attached to a different loop" or uvloop's "the handler is closed",
        or waited for ever, neither naming the handle."""
        return RuntimeError(
            f"this Handle ({self.uri}) was connected on another event loop than the one "
            "running now (an earlier asyncio.run()?): a handle serves the loop it was "
            "connected on; connect() again on this one")

    def _wrong_thread(self) -> RuntimeError:
        """A call from a thread while the handle's loop runs in another: the
        writer and the futures are that loop's, not thread-safe (a call
        from ``asyncio.to_thread`` went through, and under asyncio's debug
        mode left the writer waiting for a turn's end that never came: every
        later call on the handle waited for ever)."""
        return RuntimeError(
            f"this Handle ({self.uri}) serves an event loop running in another thread: call "
            "it from that loop (asyncio.run_coroutine_threadsafe, loop.call_soon_threadsafe)")

    def _check_open(self) -> None:
        """:meth:`HandleCore._check_open`, and a reconnecting handle's loss
        handled now if its transport closed this loop turn (see
        :meth:`_lost_early`): before a call waits for its answer, which the
        loss would fail."""
        super()._check_open()
        redial = self._redial
        if redial is not None and redial.parking is None:
            self._lost_early()

    def _lost_early(self) -> None:
        """A reconnecting handle's transport closed this loop turn and its
        loss is handled at the next (``connection_lost`` comes a turn
        later): handled now, so a call made meanwhile waits for the next
        connection as one made a turn later does (it failed "connection to
        broker lost")."""
        proto = self._proto
        if (proto is not None and proto.transport is not None and proto.transport.is_closing()
                and not self._user_closed and not self._forked
                and asyncio._get_running_loop() is self._loop):  # (else _writer says why)
            self._lost()
            self._wake_event_waiters()

    def _writer(self) -> FrameWriter:
        # (asyncio._get_running_loop: the getter that returns None where no
        # loop runs, instead of raising -- cheap, and on every send's path)
        running = asyncio._get_running_loop()
        if running is not self._loop:
            if running is not None:
                raise self._wrong_loop()
            if self._loop is not None and self._loop.is_running():  # in another thread
                raise self._wrong_thread()
        proto = self._proto
        if proto is None or proto.transport is None or proto.transport.is_closing():
            redial = self._redial
            if redial is not None and not self._user_closed:
                if redial.parking is None:
                    self._lost_early()
                if redial.parking is not None:
                    return redial.parking  # type: ignore[return-value]
            if self._forked:
                self._check_open()
            if self._closing is not None and not self._user_closed:
                raise RemoteError(*self._closing)  # the rank said why it closed
            # (a transport closing is a loss not yet handled, for a loop
            # turn: said in the same words as after it)
            raise RemoteError(errno.ECONNRESET, "handle closed" if self._user_closed
                              else "not connected to a broker" if proto is None
                              else "connection to broker lost")
        return proto.writer  # type: ignore[return-value]

    def _send(self, msg: Message) -> None:
        self._writer().send(codec.encode(msg))

    def _send_request(self, topic: str, payload: Any, matchtag: int, nodeid: int,
                      flags: int) -> None:
        self._writer().send(codec.encode_request(topic, payload, matchtag, nodeid, flags))

    def _answer_future(self, matchtag: int, errnum: int, errstr: str | None,
                       frames: list[bytes]) -> bool:
        """Settle the future of a plain rpc() from a response's frames;
        False if ``matchtag`` is not one (a stream's: decode it in full)."""
        waiter = self._pending.get(matchtag)
        if waiter is None:
            if matchtag == 0 and errnum:
                # broker.closing: the rank is about to close the connection
                # and says why (docs/protocol.md); the calls fail with it
                self._closing = (errnum, errstr or "")
            elif self._unanswered:
                self._late_answer(matchtag, errnum)
            return True  # nobody waits (any more): drop it
        if type(waiter) is Stream:
            return False
        del self._pending[matchtag]
        settle(waiter, errnum, errstr, _frames_payload, frames)
        return True

    # ---------------------------------------------------------------- events

    async def subscribe(self, prefix: str) -> None:
        """Receive events whose topic starts with ``prefix``.

        Counted as the request leaves, not when its answer comes: a call
        cut short after sending it (a timeout, a cancelled task, Ctrl-C)
        still subscribes on the rank, and the handle must know -- to
        unsubscribe it, and to subscribe it again on a reconnect.  Only an
        error answer (the rank refused it) takes it back."""
        check_str(prefix, "prefix")  # (a list went out, then could not be counted)
        parking = self._parking_now()
        answer = self.rpc("event.subscribe", {"topic": prefix})  # (sent now)
        self._subscriptions[prefix] += 1
        if parking is not None:
            parking.subscriptions[prefix] += 1
        try:
            await answer
        except RemoteError:
            self._uncount(prefix)
            raise

    async def unsubscribe(self, prefix: str) -> None:
        """Stop receiving what :meth:`subscribe` asked for with ``prefix``
        (once per call of it).  Uncounted as the request leaves, so that a
        call cut short after sending it is not subscribed again on a
        reconnect, nor counted by a retry that the rank answers ``ENOENT``."""
        check_str(prefix, "prefix")
        parking = self._parking_now()
        answer = self.rpc("event.unsubscribe", {"topic": prefix})  # (sent now)
        if parking is not None and self._subscriptions[prefix] > 0:
            # (one that takes nothing away -- not subscribed -- leaves the
            # re-subscription alone: the rank answers it ENOENT, as when
            # connected, and subscribes nothing it was never asked for)
            parking.subscriptions[prefix] -= 1
        self._uncount(prefix)
        await answer

    def _parking_now(self) -> _Parking | None:
        """Where a request made now waits while reconnecting (None: it goes
        out now), as :meth:`_writer` decides."""
        proto = self._proto
        redial = self._redial
        if (redial is not None and redial.parking is not None and not self._user_closed
                and (proto is None or proto.transport is None
                     or proto.transport.is_closing())):
            return redial.parking
        return None

    def _uncount(self, prefix: str) -> None:
        left = self._subscriptions.pop(prefix, 0) - 1
        if left > 0:
            self._subscriptions[prefix] = left

    async def publish(
        self, topic: str, payload: Any = None, *, private: bool = False
    ) -> int:
        """Publish an event (sequenced by rank 0); returns its sequence number."""
        body: dict[str, Any] = {"topic": check_str(topic, "topic"), "payload": payload}
        if private:
            body["flags"] = int(MsgFlags.PRIVATE)
        resp = await self.rpc("event.pub", body)
        return int(resp["seq"])

    def publish_nowait(self, topic: str, payload: Any = None) -> None:
        """Publish without waiting for the sequence number (no response: a
        topic that is not a ``str`` is a ``TypeError`` here, or it went
        nowhere, unsaid)."""
        self.send_noresponse("event.pub", {"topic": check_str(topic, "topic"),
                                           "payload": payload})

    def _on_event(self, msg: Message) -> None:
        self._events.append(msg)
        if self._event_waiters:
            self._wake_event_waiter()

    def _wake_event_waiter(self) -> None:
        """Wake the oldest waiting task for an event that is there: one, so
        an event costs one task's turn however many tasks wait (waking them
        all cost ~1.5 ms of CPU per event with 1,000 waiting)."""
        waiters = self._event_waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(False)
                return

    def _wake_event_waiters(self) -> None:
        """Wake every waiting task (the connection is gone: each raises)."""
        waiters = self._event_waiters
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(True)

    async def recv_event(self) -> Message:
        """The next event received (raises ``RemoteError`` once disconnected).

        Tasks may wait on one handle together: each event goes to one of
        them, to the one that has waited longest.  After ``close()`` (or in
        a child of ``fork()``) it raises at once, even with events still
        queued: they are the closed connection's (the parent's).  After the
        connection is lost, the events that came before are read first (a
        rank's last words before it went), then it raises."""
        if not self._events or self._user_closed or self._forked:
            self._check_open()
        woken = False
        while not self._events:
            self._check_open()
            loop = asyncio.get_running_loop()
            if loop is not self._loop:
                raise self._wrong_loop()  # (the events come on that loop)
            waiter = loop.create_future()
            if woken:  # (its event was taken by a task that did not wait: still first)
                self._event_waiters.appendleft(waiter)
            else:
                self._event_waiters.append(waiter)
            try:
                # (woken with all the others -- a reconnect -- each goes back
                # in the order it had: they resume in it, so at the end)
                woken = not await waiter
            except BaseException:
                # Cancelled: if this task was already woken for an event,
                # that event is still here and goes to the next one waiting.
                if waiter.done() and not waiter.cancelled():
                    if self._events:
                        self._wake_event_waiter()
                else:
                    waiter.cancel()
                    try:
                        self._event_waiters.remove(waiter)
                    except ValueError:
                        pass
                raise
        msg = self._events.popleft()
        if self._events and self._event_waiters:
            self._wake_event_waiter()  # (a task that took one without waiting)
        return msg

    async def events(self) -> AsyncIterator[Message]:
        """Async iterator over received events."""
        while True:
            yield await self.recv_event()

    # ---------------------------------------------------------------- helpers

    async def ping(self, nodeid: int = NODEID_ANY, payload: Any = None) -> dict[str, Any]:
        answer: dict[str, Any] = await self.rpc(
            "broker.ping", payload if payload is not None else {}, nodeid=nodeid)
        return answer

    async def attr_get(self, name: str, nodeid: int = NODEID_ANY) -> Any:
        return (await self.rpc("attr.get", {"name": check_str(name, "name")},
                               nodeid=nodeid))["value"]

    async def attr_set(self, name: str, value: str, nodeid: int = NODEID_ANY) -> None:
        """Change a runtime attribute (``log.level``, ``log.ring-level``,
        ``tbon.torpid_min``, ``tbon.torpid_max``, or a loaded module's:
        ``kvs.checkpoint-period``, ``kvs.cache-expire``, ...) on rank
        ``nodeid``: the instance owner only.  ``value`` as ``-S`` gives it:
        a ``str``."""
        await self.rpc("attr.set", {"name": check_str(name, "name"),
                                    "value": check_str(value, "value")}, nodeid=nodeid)

    def dmesg(self, *, follow: bool = False, since: int = 0,
              nodeid: int = NODEID_ANY) -> Stream:
        """The log records rank ``nodeid`` keeps (``kvbroker dmesg``), oldest
        first, each ``{seq, time, rank, level, name, message}``, those after
        ``since``; with ``follow`` then each new one, until the stream is
        cancelled (``log.cancel``) or the handle closed.  The instance owner
        only: ``async for entry in h.dmesg(): ...``."""
        return self.rpc_stream("log.dmesg", {"follow": follow, "since": since}, nodeid=nodeid)

    def overlay_trace(self, topic_glob: str = "*", *, types: int = 0, peer: int = -1,
                      full: bool = False, nodeid: int = NODEID_ANY) -> Stream:
        """A summary of each message rank ``nodeid``'s overlay sends or
        receives (``kvbroker overlay trace``): a :class:`Stream` of ``{timestamp,
        prefix, rank, type, topic, size, errnum, payload?, errstr?}``, those
        whose topic matches ``topic_glob``, of ``types`` (``MsgType`` bits;
        0: all), to or from neighbour ``peer`` (-1: any), with payloads if
        ``full``; until cancelled (``overlay.trace-cancel``) or the handle
        closed.  The instance owner only."""
        return self.rpc_stream("overlay.trace", {"topic_glob": topic_glob, "typemask": types,
                                                 "nodeid": peer, "full": full}, nodeid=nodeid)

    async def log(self, message: str, level: str = "info", name: str = "logger",
                  nodeid: int = NODEID_ANY) -> None:
        """Write ``message`` to rank ``nodeid``'s log as ``name`` at ``level``
        (``kvbroker logger``): the instance owner only."""
        await self.rpc("log.append", {"message": check_str(message, "message"),
                                      "level": check_str(level, "level"),
                                      "name": check_str(name, "name")}, nodeid=nodeid)
