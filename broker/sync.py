"""A small blocking facade over :class:`broker.handle.Handle`, for scripts.

    from broker.sync import connect
    with connect() as h:                       # $KVBROKER_URI
        print(h.rpc("broker.ping", {}, nodeid=1))
        for answer in h.rpc_stream("kvs-watch.lookup", {...}):
            ...

It owns a private event loop in the calling thread, so it cannot be used
from inside a running event loop -- use the async API there.  ``run(coro)``
runs any coroutine of the async API on that loop, which is how the kvs
facade reuses the async client (``h.run(KVS(h.aio).get(k))``).

Each call turns the loop only until its answer is there
(``loop.run_until_complete``), and :meth:`SyncHandle.rpc` sends on the
async handle directly and waits for its future, without a coroutine or a
task.  The facade first ran every call through ``asyncio.Runner.run``
(which installs and restores a SIGINT handler around each call) with a
coroutine and ``asyncio.timeout`` around the RPC: 4,900 RPCs/s where the
async API made 10,600.  Now it makes ~10,000 (uvloop; 7,500 on the stock
loop), measured by ``benchmarks/run.py W1``'s sync row.

Ctrl-C.  Python's own SIGINT handler raises ``KeyboardInterrupt`` wherever
the main thread is, and in a call that is inside the event loop's
internals: uvloop then closed the connection (the exception went through
the protocol's ``data_received``) or was left "already running" (it came
between the loop's setup and its ``try``), and the stock loop kept a
``stop()`` for the next call -- in ~10% of 800 interrupts the handle was
broken for the rest of the script.  ``asyncio.Runner`` swaps in a handler
that cancels the main task around each ``run()``, at the cost of two
``sigaction`` calls per call, which this facade gave up for speed.  So a
handle made in the main thread, where SIGINT's handler is still Python's
default, installs one handler (:func:`_on_sigint`) for as long as it (or
another handle that found it there) is open; a handler of the user's own
is never replaced, and the last ``close()`` puts the default back if ours
is still there.  Importing this module changes nothing.  Between calls the
handler does what the default does.  During a call of the main thread it
has the loop cancel what the call waits for, in a callback (a cancel from
the handler itself, which runs wherever a call returns, landed between
an answer's ``done()`` check and its ``set_result``: InvalidStateError,
and the connection closed), and wakes the loop: the call ends at once
-- the request retired as on a timeout, its late answer dropped -- and
raises ``KeyboardInterrupt`` once the loop has stopped, so the next call
finds the handle as it was.  (Another Ctrl-C within
:data:`SECOND_PRESS_AFTER` of the loop acting on the first is the same
press -- a terminal's and a parent's forwarded one, or the call simply
ending: raised inside uvloop's internals, it broke the handle for good, in
a storm of SIGINTs every 2 ms after ~300 to ~4,000 of them.  One after
that, in a call that does not end -- a coroutine that ignores the cancel,
a callback that blocks -- raises at once, where the program is, as
Runner's second one does.)  If an
interrupt does come out of the loop's internals (that second one, or a
SIGINT handler of the user's own), the next call repairs what the stock
loop left and ignores a leftover ``stop()``.  Registering a handle and
letting it go happen with Ctrl-C held (:class:`_HoldCtrlC`), so an
interrupt never leaves one half done; tests/bin/sigint_positions.py sends
one at every point where Python may run the handler, one point at a time.
A ``KeyboardInterrupt`` that Python drops (raised in a finalizer) is kept
for the next call (:func:`_on_unraisable`).

One thread at a time: a call made while another thread is in a call on
the same handle raises ``RuntimeError`` (two threads turning one loop, or
sending while it reads, break it silently).  The check is an attribute
tested and set -- about 55 ns a call where a lock costs 100 (CPython
3.11), next to ~100 us an RPC takes; under the GIL nothing can run between
the test and the set.  With the SIGINT bookkeeping, ``run()`` of a done
future went from 5.43 to 5.59 us on the stock loop (27 us on uvloop, which
makes a socketpair for signals at every run in the main thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import os
import selectors
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable
from threading import get_ident
from types import FrameType
from typing import Any, Self, TypeVar

from broker.errors import RemoteError
from broker.handle import Handle
from broker.loops import loop_factory
from broker.message import NODEID_ANY, Message
from broker.rpc import Stream, check_timeout

T = TypeVar("T")


class Default(enum.Enum):
    """The type of :data:`DEFAULT`."""

    DEFAULT = "the handle's timeout"


DEFAULT = Default.DEFAULT
"""A call's ``timeout`` when none is given: the handle's ``timeout``."""


SECOND_PRESS_AFTER = 0.1
"""Seconds after the loop cancelled what a call waits for (its first
Ctrl-C) before another Ctrl-C raises at once, inside the loop: before, the
call is taken to be ending (see the module's docstring)."""

NOTICE_TURNS = 3
"""Loop turns that take a closed connection from the socket to the handle
(the end of file read, the transport closed, ``connection_lost``)."""


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _nothing() -> None:
    pass


_handles: weakref.WeakSet[SyncHandle] = weakref.WeakSet()
"""Every open handle: the SIGINT handler looks for the one the main thread is in."""
_sigint_users = 0
"""Open handles that count on :func:`_on_sigint` being installed."""


class _Holds(threading.local):
    count = 0
    """Open :class:`_HoldCtrlC` blocks in this thread (the main thread's
    is the one :func:`_on_sigint` reads: handlers run there)."""


_holds = _Holds()
_held = False
"""A SIGINT came while held."""


class _HoldCtrlC:
    """``with _HOLD_CTRL_C:`` around the few statements that register a
    handle or let it go, which a ``KeyboardInterrupt`` must not split: a
    handle half registered kept the facade's handler installed for good
    (and a connected handle that ``connect()`` never returned stayed open).
    A SIGINT meanwhile acts at the block's end, where it would have gone.
    Only while the handler is ours (a user's own, or Python's default
    before the first handle installs ours, raises as always).

    The count is per thread and changed without a call in between
    (CPython runs a signal handler only where a call returns, at a loop's
    back-edge or a function's start): a ``KeyboardInterrupt`` between a
    count and its use would leave Ctrl-C held for good."""

    def __enter__(self) -> None:
        _holds.count += 1

    def __exit__(self, *exc: object) -> None:
        global _held
        _holds.count -= 1
        if not _holds.count and _held and get_ident() == threading.main_thread().ident:
            _on_sigint(signal.SIGINT, None)


_HOLD_CTRL_C = _HoldCtrlC()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """Python's SIGINT handler while a handle made in the main thread is
    open: the default's ``KeyboardInterrupt`` where the program is, unless
    the main thread is in a handle's call (see the module's docstring)."""
    global _held
    if _holds.count:
        _held = True
        return
    _held = False  # (this one stands for any held before it)
    me = get_ident()  # (the main thread's: Python runs signal handlers there)
    for h in _handles:
        if h._caller == me:
            h._on_sigint(signum, frame)
            return
    signal.default_int_handler(signum, frame)


_fork_hook = False
"""Whether :func:`_after_fork_in_child` is registered (at the first handle)."""


def _after_fork_in_child() -> None:
    """In a child of ``fork()``, every open handle is the parent's: see
    :meth:`SyncHandle._orphan` (a handle another thread was making at the
    fork too: that thread is not in this process to finish it)."""
    for h in list(_handles):
        h._orphan()


def _claim_sigint() -> bool:
    """Install :func:`_on_sigint` if SIGINT has Python's default handler
    (from the main thread only; never over a handler of the user's own);
    whether this handle counts on it (and releases it at its close)."""
    global _sigint_users
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is signal.default_int_handler:
        try:
            signal.signal(signal.SIGINT, _on_sigint)
        except ValueError:  # (not the main interpreter)
            return False
        _hook_unraisable()
    elif current is not _on_sigint:
        return False
    elif _sigint_users == 0:
        # Left installed by a last release off the main thread (a dropped
        # handle's finalizer, run by the collector in a worker), where it
        # cannot be changed: what it kept meanwhile is no call's
        global _dropped
        _dropped = False
    _sigint_users += 1
    return True


def _release_sigint() -> None:
    """The last handle counting on :func:`_on_sigint` closed: put Python's
    default back, unless the handler was replaced meanwhile (or this is not
    the main thread, where it cannot be changed: ours, with no handle in a
    call, does what the default does)."""
    global _sigint_users
    _sigint_users -= 1
    if (_sigint_users == 0 and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _on_sigint):
        _unhook_unraisable()
        signal.signal(signal.SIGINT, signal.default_int_handler)


_prior_unraisablehook: Callable[[Any], object] | None = None
_dropped = False
"""A KeyboardInterrupt that Python dropped (see :func:`_on_unraisable`)."""


def _on_unraisable(unraisable: Any) -> None:
    """``sys.unraisablehook`` while the facade's SIGINT handler is installed.

    A Ctrl-C between two calls raises ``KeyboardInterrupt`` where the
    program is, as Python's default does -- and where the program is may be
    a finalizer: a weakref callback or a ``__del__`` that the collector
    runs, such as the ``WeakSet`` callback of an asyncio task freed after
    an interrupted call.  Python prints an exception raised there ("Exception
    ignored in ...") and drops it: the Ctrl-C was lost.  This hook keeps
    it instead, and the main thread's next call raises it (its wait ends at
    once, as for a Ctrl-C during the call); any other unraisable exception
    goes to the hook that was there before."""
    global _dropped
    if unraisable.exc_type is KeyboardInterrupt and _sigint_users > 0:
        _dropped = True  # (with no handle left to raise it: dropped, as before)
        return
    (_prior_unraisablehook or sys.__unraisablehook__)(unraisable)


def _hook_unraisable() -> None:
    global _prior_unraisablehook
    if sys.unraisablehook is not _on_unraisable:
        _prior_unraisablehook = sys.unraisablehook
        sys.unraisablehook = _on_unraisable


def _unhook_unraisable() -> None:
    """Put back the hook that was there (unless ours was replaced since:
    pytest, for one, swaps its own in and out around each test)."""
    global _prior_unraisablehook, _dropped
    if sys.unraisablehook is _on_unraisable:
        sys.unraisablehook = _prior_unraisablehook or sys.__unraisablehook__
    _prior_unraisablehook = None
    _dropped = False  # (no handle left to raise it: as lost as before)


def _close_dropped(loop: asyncio.AbstractEventLoop, claimed_sigint: bool,
                   connection: list[Handle]) -> None:
    """A :class:`SyncHandle` collected without ``close()`` (a finalizer:
    it runs wherever the collector does, so it runs no loop).  uvloop keeps
    a transport that is still open alive through its loop, so the handle's
    connection, loop and 7 descriptors stayed for as long as the process
    ran (300 dropped handles: 2,100 descriptors, then ``EMFILE``), and the
    facade's SIGINT handler with them.  Closing the loop closes them (the
    stock loop's are collected anyway, each with Python's ResourceWarning).
    Warned as an unclosed file is, once: the connection is closed first
    (and its end run, a turn of the loop, where no other loop runs), or
    each loop warned of it too ("unclosed resource <UnixTransport>",
    "unclosed transport", "unclosed <socket.socket>").  That turn runs in
    the thread the collector runs in, with the handle's tasks cancelled
    first: their ``finally`` clauses run there, and nothing else of theirs."""
    warnings.warn("a SyncHandle was not closed: close() it, or use it as a context "
                  "manager (with connect() as h: ...)", ResourceWarning, stacklevel=2)
    if not loop.is_closed() and not loop.is_running():
        for aio in connection:
            aio.abort()
        for task in asyncio.all_tasks(loop):
            task.cancel()
        if asyncio._get_running_loop() is None:
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    if claimed_sigint:
        with _HOLD_CTRL_C:
            _release_sigint()


class CallRefused(RuntimeError):
    """A call refused before it did anything (another call is in progress,
    or an event loop runs in this thread): a stream it was for goes on.
    A ``RuntimeError``, as the docs say, public so that a traceback names
    no private class."""


def _refuse_in_a_loop() -> None:
    """``RuntimeError`` if an event loop runs in this thread: the facade runs
    its own loop for each call, which cannot run inside another."""
    if asyncio._get_running_loop() is not None:
        raise CallRefused("the blocking facade cannot be used inside a running event "
                          "loop: use the async API (broker.handle.Handle) there")


class SyncHandle:
    """A blocking handle on a private event loop (use :func:`connect`).

    Every request takes ``timeout`` (seconds; ``TimeoutError`` when it
    passes, and the call is abandoned on this side); the default for calls
    that give none is the handle's ``timeout`` (None: wait as long as it
    takes).  Waits for what may be long in coming -- an event, a stream's or
    a watch's next answer -- have their own timeouts, with no limit by
    default.
    After :meth:`close`, every call raises ``RemoteError(ECONNRESET, "handle
    closed")``, as the async handle's do.  One thread at a time: a call
    while another thread is in one raises ``RuntimeError``.  Ctrl-C in a
    call of the main thread ends it with ``KeyboardInterrupt`` and leaves
    the handle usable (see the module's docstring)."""

    def __init__(self, uri: str | None = None, *, event_loop: str | None = None,
                 timeout: float | None = None, reconnect: bool = False) -> None:
        _refuse_in_a_loop()
        timeout = check_timeout(timeout)  # (before anything: it bounds the connect too)
        global _fork_hook
        if not _fork_hook:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook = True
        self.timeout = timeout
        self._closed = False
        self._pid = os.getpid()
        self._forked = False
        """This is a child of a fork() made while the handle was open: not its handle."""
        self._caller: int | None = None
        """The thread in a call now (its ``get_ident()``), None between calls."""
        self._waiting: asyncio.Future[Any] | None = None
        """What the call in progress waits for: a Ctrl-C cancels it."""
        self._interrupts = 0
        """SIGINTs received during the call in progress."""
        self._interrupt_token: object = None
        self._interrupt_seen: float | None = None
        """When the loop acted on the call's first SIGINT (``time.monotonic()``)."""
        self._mending = 0
        """Leftover stops still to ignore, after an interrupt left the loop's internals."""
        self._flush: Callable[[], None] = _nothing
        self._agen_hooks = sys.get_asyncgen_hooks()
        self._sigint = False
        # Registered whole or not at all (a Ctrl-C meanwhile is this call's,
        # and ends its connect at once); the loop first, which an
        # interrupted call wakes.
        with _HOLD_CTRL_C:
            self._sigint = _claim_sigint()
            _handles.add(self)
            try:
                self._runner = asyncio.Runner(loop_factory=loop_factory(event_loop))
                self._loop = self._runner.get_loop()
            except BaseException:
                self._closed = True
                self._let_go()
                raise
            self._connection: list[Handle] = []
            """The connection, for :func:`_close_dropped` (filled once made)."""
            self._finalizer = weakref.finalize(self, _close_dropped, self._loop, self._sigint,
                                               self._connection)
            self._finalizer.atexit = False  # (at exit a handle left open is no leak)
            self._caller = get_ident()
        try:  # (the connect too is bounded by ``timeout``: an ssh:// one may hang)
            self.aio: Handle = self._wait(asyncio.ensure_future(asyncio.wait_for(
                Handle.connect(uri, reconnect=reconnect), timeout), loop=self._loop), None)
            self._flush = self.aio.flush
            self._connection.append(self.aio)
        except BaseException:
            self._abandon()
            raise
        finally:
            if self._interrupts and not self._closed:
                self._abandon()  # a Ctrl-C as the connect ended: not a handle left open
            self._caller = None
            if self._interrupts:
                self._raise_interrupt()

    def _abandon(self) -> None:
        """Close a handle whose connect failed or was interrupted."""
        self._closed = True
        try:
            self._runner.close()
        finally:
            self._let_go()

    @property
    def closed(self) -> bool:
        """Closed, or this process is a child of a fork() of its owner's:
        what works on its behalf in other threads (a lease's keepalives)
        stops then."""
        return self._closed

    def _enter(self) -> None:
        """Start a call: refused when closed, or while another call runs, or
        inside a running event loop (it runs its own: the call failed with
        asyncio's "Cannot run the event loop while another loop is running",
        or a message blaming another loop; a close() so refused had marked
        the handle closed and kept its connection open)."""
        ident = get_ident()
        if self._caller is not None or self._closed:  # (no switch point until the set)
            self._refuse(ident)
        _refuse_in_a_loop()  # (after: inside a call, its own loop runs)
        # Zeroed before the claim, not after: under a tracer (a debugger's),
        # where a handler may run between any two lines, a SIGINT between
        # the two was counted for this call, then forgotten.
        self._interrupts = 0
        self._caller = ident
        if _dropped and ident == threading.main_thread().ident:  # (main: a fork may move it)
            self._take_dropped()
        if self.aio.reconnect and self.aio.connected:
            try:
                self._notice_loss()
            except BaseException:
                self._caller = None
                if self._interrupts:  # (what the interrupt cancelled is not news)
                    self._raise_interrupt()
                raise

    def _take_dropped(self) -> None:
        """A Ctrl-C that Python dropped (:func:`_on_unraisable`) is this
        call's: counted as if it came now, it ends the call's wait at once
        and the call raises it."""
        global _dropped
        _dropped = False
        self._interrupts += 1

    def _notice_loss(self) -> None:
        """A reconnecting handle: the loop does not run between calls, so a
        connection the rank closed meanwhile (it restarted) still looks
        open, and this call's request would be written to it and fail as
        one in flight.  A few turns of the loop read the closing first, and
        the request then waits for the new connection instead."""
        self._wait(asyncio.ensure_future(_turns(NOTICE_TURNS), loop=self._loop), None)

    def _refuse(self, ident: int) -> None:
        if self._forked:
            raise RemoteError(errno.ECONNRESET, f"this handle belongs to process {self._pid}, "
                              "which forked this one: connect() again here")
        caller = self._caller
        if caller is None:
            raise RemoteError(errno.ECONNRESET, "handle closed")
        if caller == ident:
            raise CallRefused("a SyncHandle call was made inside another call on it "
                              "(from a coroutine it runs?): use the async API there (h.aio)")
        raise CallRefused("this SyncHandle is in a call in another thread: a handle serves "
                          "one thread at a time (give each thread its own connect())")

    def _orphan(self) -> None:
        """In a child of ``fork()``: the connection, and the stock loop's
        epoll instance, are shared with the parent.  A call here read the
        parent's answers (a ping returned another's payload), and a
        ``close()`` here, or the loop's finalizer at the child's exit,
        unregistered the parent's socket and wakeup pipe from that epoll
        (the parent's next call, or its Ctrl-C, waited for ever).  So the
        handle is closed to this process without touching either: calls
        raise ``ECONNRESET`` saying why, ``close()`` does nothing, and the
        stock loop gets an epoll of its own to unregister from."""
        self._forked = True
        self._closed = True
        self._caller = None
        self._waiting = None
        loop = getattr(self, "_loop", None)  # (None: half made, its loop not yet)
        if isinstance(loop, asyncio.BaseEventLoop) and hasattr(loop, "_selector"):
            shared = loop._selector
            loop._selector = selectors.DefaultSelector()
            shared.close()  # (this process's descriptor of it: the parent's stays)
        self._let_go()

    def _raise_interrupt(self) -> None:
        """End a call that a SIGINT interrupted (the loop is stopped now).

        Raised from the call's ``finally``, usually while the
        ``CancelledError`` of what the interrupt cancelled goes by: ``from
        None`` keeps that out of the traceback, which is then the default
        handler's one ``KeyboardInterrupt`` from the script's line (the
        cancel is how the facade stops the call, not news to the user)."""
        self._interrupts = 0
        raise KeyboardInterrupt from None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        """SIGINT during a call of the main thread (see the module's docstring)."""
        self._interrupts += 1
        if self._interrupts == 1:
            # Not fut.cancel() here: this runs between any two bytecodes,
            # e.g. between an answer's done() check and its set_result()
            # (InvalidStateError, and the connection closed).  A callback
            # runs between two others; call_soon_threadsafe also wakes a
            # loop that is in select() for a long while.
            token = self._interrupt_token = object()
            self._interrupt_seen = None
            try:
                self._loop.call_soon_threadsafe(self._interrupted, token)
            except RuntimeError:
                pass  # the loop is closed: close() is ending, and raises at its end
        elif (self._interrupt_seen is not None and self._waiting is not None
              and time.monotonic() - self._interrupt_seen >= SECOND_PRESS_AFTER):
            signal.default_int_handler(signum, frame)  # the call does not end: raise here
        # (else the same Ctrl-C, pressed twice, or the call is ending: it raises then)

    def _interrupted(self, token: object) -> None:
        """The loop's turn after a SIGINT: cancel what the call waits for."""
        if token is not self._interrupt_token or not self._interrupts:
            return  # (queued in a call that ended before the loop turned)
        self._interrupt_seen = time.monotonic()
        fut = self._waiting
        if fut is not None:
            fut.cancel()

    def _wait(self, fut: asyncio.Future[T], timeout: float | None) -> T:
        """Turn the loop until ``fut`` is done; ``TimeoutError`` after
        ``timeout`` seconds, and ``fut`` is cancelled if the wait ends
        without it (a timeout, or Ctrl-C in the middle)."""
        loop = self._loop
        self._waiting = fut
        if self._interrupts:  # Ctrl-C came before the wait
            fut.cancel()
        timer = None
        expired = False
        if timeout is not None:
            def expire() -> None:
                nonlocal expired
                expired = True
                fut.cancel()
            timer = loop.call_later(timeout, expire)
        try:
            while True:
                try:
                    return loop.run_until_complete(fut)
                except RuntimeError:
                    if fut.done() or not self._mend():
                        raise  # (fut's own error, or the loop is beyond repair)
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError(f"no answer within {timeout} s") from None
            raise
        except BaseException as exc:
            if not isinstance(exc, Exception):  # out of the loop: maybe from its internals
                self._mending = 3
                self._repair()
            raise
        finally:
            self._waiting = None
            if timer is not None:
                timer.cancel()
            if not fut.done():
                fut.cancel()
            self._flush()  # the loop stops here: nothing may wait for its turn's end

    def _repair(self) -> None:
        """Undo what an exception raised inside the loop's own code (not a
        callback's) may have left: the stock loop still marked running in
        this thread, or its async generator hooks set.  A ``stop()`` it
        left is ignored by the next calls (:meth:`_mend`)."""
        loop = self._loop
        if asyncio._get_running_loop() is loop:
            asyncio._set_running_loop(None)
        if isinstance(loop, asyncio.BaseEventLoop) and loop.is_running():
            loop._thread_id = None  # type: ignore[attr-defined]  # (run_forever's finally)
            loop._stopping = False  # type: ignore[attr-defined]
        firstiter = sys.get_asyncgen_hooks().firstiter
        if getattr(firstiter, "__self__", None) is loop:
            sys.set_asyncgen_hooks(*self._agen_hooks)

    def _mend(self) -> bool:
        """The loop refused to run, or stopped before ``fut`` was done:
        whether that is what an interrupt left (repaired: run it again)."""
        if self._mending <= 0:
            return False
        self._mending -= 1
        self._repair()
        if self._loop.is_running():  # uvloop's: nothing outside it can reset that
            raise RuntimeError("this SyncHandle's loop was left marked running by a "
                               "KeyboardInterrupt raised inside it: close the handle "
                               "and connect again")
        return True

    def __repr__(self) -> str:
        return f"<SyncHandle {self.aio.uri}{' closed' if self._closed else ''}>"

    def call_soon_threadsafe(self, callback: Callable[[], object]) -> bool:
        """Have ``callback()`` run on this handle's loop, from any thread --
        the one way another thread may act on a handle that a call holds:
        it runs at once if a call is waiting (the loop is woken), else in
        the next call's first turn.  False (and it never runs) once the
        handle is closed.  The callback runs in the handle's thread, inside
        the loop: it may send (``h.aio.send_noresponse``), not wait."""
        if self._closed:
            return False
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # (closed meanwhile: close() ran in the handle's thread)
            return False
        return True

    def _timeout(self, timeout: float | None | Default) -> float | None:
        """A call's ``timeout``, checked (:func:`~broker.rpc.check_timeout`)
        before the call sends anything."""
        return self.timeout if isinstance(timeout, Default) else check_timeout(timeout)

    def run(self, aw: Awaitable[T], timeout: float | None | Default = DEFAULT) -> T:
        """Run an awaitable of the async API on this handle's loop, for at
        most ``timeout`` seconds (None: no limit; omitted: the handle's)."""
        try:
            limit = self._timeout(timeout)
            self._enter()
        except BaseException:
            if asyncio.iscoroutine(aw):
                aw.close()  # never to be awaited: no "never awaited" warning
            raise
        try:
            return self._wait(asyncio.ensure_future(aw, loop=self._loop), limit)
        finally:
            self._caller = None
            if self._interrupts:
                self._raise_interrupt()

    def rpc(self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY,
            flags: int = 0, timeout: float | None | Default = DEFAULT) -> Any:
        """Send a request and return its answer's payload (``RemoteError``
        for an error answer, ``TimeoutError`` after ``timeout`` seconds)."""
        limit = self._timeout(timeout)
        self._enter()
        try:
            tag, fut = self.aio.rpc_tagged(topic, payload, nodeid=nodeid, flags=flags)
            try:
                return self._wait(fut, limit)
            finally:
                if not fut.done() or fut.cancelled():
                    self.aio.retire(tag)  # a late answer is dropped, not kept waiting
        finally:
            self._caller = None
            if self._interrupts:
                self._raise_interrupt()

    def rpc_stream(self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY,
                   flags: int = 0, timeout: float | None = None) -> SyncStream:
        """Send a streaming request now; iterate its answers (ends at
        ``ENODATA``, raises ``RemoteError`` on an error answer, and
        ``TimeoutError`` if an answer takes more than ``timeout`` seconds).
        See :class:`SyncStream` for leaving early."""
        timeout = check_timeout(timeout)
        self._enter()
        try:  # (interrupted, the SyncStream is dropped: its __del__ retires the request)
            stream = SyncStream(self, self.aio.rpc_stream(topic, payload, nodeid=nodeid,
                                                          flags=flags), timeout)
        finally:
            self._caller = None
            if self._interrupts:
                self._raise_interrupt()
        return stream

    def subscribe(self, prefix: str, timeout: float | None | Default = DEFAULT) -> None:
        """Receive events whose topic starts with ``prefix``."""
        self.run(self.aio.subscribe(prefix), timeout)

    def unsubscribe(self, prefix: str, timeout: float | None | Default = DEFAULT) -> None:
        """Stop receiving events of a prefix given to :meth:`subscribe`."""
        self.run(self.aio.unsubscribe(prefix), timeout)

    def publish(self, topic: str, payload: Any = None, *, private: bool = False,
                timeout: float | None | Default = DEFAULT) -> int:
        """Publish an event; returns its sequence number."""
        return self.run(self.aio.publish(topic, payload, private=private), timeout)

    def recv_event(self, timeout: float | None = None) -> Message:
        """The next event received (``TimeoutError`` after ``timeout``
        seconds; events may be rare, so the handle's default does not apply)."""
        return self.run(self.aio.recv_event(), timeout)

    # The async handle's helpers, blocking, so that a script does not have
    # to unwrap ``rpc("attr.get", ...)["value"]`` itself or reach for
    # ``run(h.aio.attr_get(...))`` (as SyncKVS mirrors KVS).

    def ping(self, nodeid: int = NODEID_ANY, payload: Any = None, *,
             timeout: float | None | Default = DEFAULT) -> dict[str, Any]:
        """``broker.ping`` rank ``nodeid``: ``{..., route, rank, userid, rolemask}``."""
        return self.run(self.aio.ping(nodeid, payload), timeout)

    def attr_get(self, name: str, nodeid: int = NODEID_ANY, *,
                 timeout: float | None | Default = DEFAULT) -> Any:
        """One broker attribute of rank ``nodeid`` (``local-uri``: the URI
        that attaches to that rank)."""
        return self.run(self.aio.attr_get(name, nodeid), timeout)

    def attr_set(self, name: str, value: str, nodeid: int = NODEID_ANY, *,
                 timeout: float | None | Default = DEFAULT) -> None:
        """Change a runtime attribute on rank ``nodeid`` (instance owner only)."""
        self.run(self.aio.attr_set(name, value, nodeid), timeout)

    def log(self, message: str, level: str = "info", name: str = "logger",
            nodeid: int = NODEID_ANY, *, timeout: float | None | Default = DEFAULT) -> None:
        """Write ``message`` to rank ``nodeid``'s log (instance owner only)."""
        self.run(self.aio.log(message, level, name, nodeid), timeout)

    def close(self) -> None:
        """Disconnect (a second call does nothing)."""
        if self._closed:
            return
        self._enter()
        self._closed = True
        try:
            self._wait(asyncio.ensure_future(self.aio.close(), loop=self._loop), None)
        finally:
            try:
                self._runner.close()
            finally:
                self._let_go()  # (the call ends there: _caller is None)
                if self._interrupts:
                    self._raise_interrupt()

    def _let_go(self) -> None:
        """This handle is done (its call, if one is in progress, ends): it
        no longer needs the SIGINT handler."""
        with _HOLD_CTRL_C:  # (a Ctrl-C in between left the handler counted for good)
            _handles.discard(self)
            self._caller = None
            finalizer = getattr(self, "_finalizer", None)  # (None: half made)
            if finalizer is not None:
                finalizer.detach()
            if self._sigint:
                self._sigint = False
                _release_sigint()  # last: it may put back Python's default, which holds nothing

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(uri: str | None = None, *, event_loop: str | None = None,
            timeout: float | None = None, reconnect: bool = False) -> SyncHandle:
    """Attach to a rank (default ``$KVBROKER_URI``) with a blocking handle
    whose calls, and the connect itself, time out after ``timeout`` seconds
    by default (``TimeoutError``); ``reconnect``: as
    :meth:`broker.handle.Handle.connect`'s (the handle dials again during
    calls: a call made while the rank is away waits for it, up to its
    timeout)."""
    return SyncHandle(uri, event_loop=event_loop, timeout=timeout, reconnect=reconnect)


class SyncStream:
    """The answers of a streaming request made through :class:`SyncHandle`:
    an iterator of payloads, and a context manager that closes it.

    ``matchtag`` names the request, for the service's own cancel RPC
    (``kvs-watch.cancel {matchtag}`` on the same rank).  :meth:`close` --
    also on leaving a ``with`` block, when it is dropped (a ``for`` loop
    over ``rpc_stream(...)`` left through ``break`` or an exception), and
    when ``next()`` raises anything but ``TimeoutError``,
    ``KeyboardInterrupt`` or a refused call's ``RuntimeError`` (after those
    it goes on: ``next()`` may wait again) -- stops the waiting on this
    side only (``h.aio.pending`` does not grow, late answers are dropped):
    the service keeps streaming until cancelled or the handle closes.
    """

    def __init__(self, handle: SyncHandle, stream: Stream, timeout: float | None = None) -> None:
        self.timeout = timeout
        """Seconds each next answer may take (``TimeoutError``); None: no limit."""
        self._handle = handle
        self._stream = stream
        self.matchtag = stream.matchtag

    def __repr__(self) -> str:
        return f"<SyncStream of {self._stream!r}>"

    def __iter__(self) -> SyncStream:
        return self

    def __next__(self) -> Any:
        try:
            msg = self._handle.run(self._stream.next_message(), self.timeout)
        except (TimeoutError, KeyboardInterrupt, CallRefused):
            raise  # (the stream goes on: next() may wait again, as SyncWatch's)
        except BaseException:
            self.close()
            raise
        if msg is None:
            raise StopIteration
        return msg.payload

    def close(self) -> None:
        """Stop waiting for answers (a no-op once the stream has ended)."""
        if not self._stream.done:
            self._stream.done = True
            self._handle.aio.retire(self.matchtag)

    def __enter__(self) -> SyncStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped without close() (a for loop left through break, or never
        # iterated): as a generator would be, stop waiting on this side.
        stream = getattr(self, "_stream", None)
        if stream is not None and not stream.done:
            self.close()
