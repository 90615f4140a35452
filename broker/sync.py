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
"""

from __future__ import annotations

import asyncio
import enum
import errno
from collections.abc import Awaitable
from typing import Any, Self, TypeVar

from broker.errors import RemoteError
from broker.handle import Handle
from broker.loops import loop_factory
from broker.message import NODEID_ANY, Message
from broker.rpc import Stream

T = TypeVar("T")


class Default(enum.Enum):
    """The type of :data:`DEFAULT`."""

    DEFAULT = "the handle's timeout"


DEFAULT = Default.DEFAULT
"""A call's ``timeout`` when none is given: the handle's ``timeout``."""


class SyncHandle:
    """A blocking handle on a private event loop (use :func:`connect`).

    Every request takes ``timeout`` (seconds; ``TimeoutError`` when it
    passes, and the call is abandoned on this side); the default for calls
    that give none is the handle's ``timeout`` (None: wait as long as it
    takes).  Waits for what may be long in coming -- an event, a stream's or
    a watch's next answer -- have their own timeouts, with no limit by
    default.
    After :meth:`close`, every call raises ``RemoteError(ECONNRESET, "handle
    closed")``, as the async handle's do.  One thread at a time."""

    def __init__(self, uri: str | None = None, *, event_loop: str | None = None,
                 timeout: float | None = None) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError("the blocking facade cannot be used inside a running event "
                               "loop: use the async API (broker.handle.Handle) there")
        self.timeout = timeout
        self._closed = False
        self._runner = asyncio.Runner(loop_factory=loop_factory(event_loop))
        self._loop = self._runner.get_loop()
        try:  # (the connect too is bounded by ``timeout``: an ssh:// one may hang)
            self.aio: Handle = self._loop.run_until_complete(
                asyncio.wait_for(Handle.connect(uri), timeout))
        except BaseException:
            self._runner.close()
            raise

    def _wait(self, fut: asyncio.Future[T], timeout: float | None) -> T:
        """Turn the loop until ``fut`` is done; ``TimeoutError`` after
        ``timeout`` seconds, and ``fut`` is cancelled if the wait ends
        without it (a timeout, or Ctrl-C in the middle)."""
        loop = self._loop
        timer = None
        expired = False
        if timeout is not None:
            def expire() -> None:
                nonlocal expired
                expired = True
                fut.cancel()
            timer = loop.call_later(timeout, expire)
        try:
            return loop.run_until_complete(fut)
        except asyncio.CancelledError:
            if expired:
                raise TimeoutError(f"no answer within {timeout} s") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if not fut.done():
                fut.cancel()
            self.aio.flush()  # the loop stops here: nothing may wait for its turn's end

    def __repr__(self) -> str:
        return f"<SyncHandle {self.aio.uri}{' closed' if self._closed else ''}>"

    def _check_open(self) -> None:
        if self._closed:
            raise RemoteError(errno.ECONNRESET, "handle closed")

    def _timeout(self, timeout: float | None | Default) -> float | None:
        return self.timeout if isinstance(timeout, Default) else timeout

    def run(self, aw: Awaitable[T], timeout: float | None | Default = DEFAULT) -> T:
        """Run an awaitable of the async API on this handle's loop, for at
        most ``timeout`` seconds (None: no limit; omitted: the handle's)."""
        if self._closed:
            if asyncio.iscoroutine(aw):
                aw.close()  # never to be awaited: no "never awaited" warning
            self._check_open()
        return self._wait(asyncio.ensure_future(aw, loop=self._loop), self._timeout(timeout))

    def rpc(self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY,
            flags: int = 0, timeout: float | None | Default = DEFAULT) -> Any:
        """Send a request and return its answer's payload (``RemoteError``
        for an error answer, ``TimeoutError`` after ``timeout`` seconds)."""
        self._check_open()
        tag, fut = self.aio.rpc_tagged(topic, payload, nodeid=nodeid, flags=flags)
        try:
            return self._wait(fut, self._timeout(timeout))
        finally:
            if not fut.done() or fut.cancelled():
                self.aio.retire(tag)  # a late answer is dropped, not kept waiting

    def rpc_stream(self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY,
                   flags: int = 0, timeout: float | None = None) -> SyncStream:
        """Send a streaming request now; iterate its answers (ends at
        ``ENODATA``, raises ``RemoteError`` on an error answer, and
        ``TimeoutError`` if an answer takes more than ``timeout`` seconds).
        See :class:`SyncStream` for leaving early."""
        self._check_open()
        return SyncStream(self, self.aio.rpc_stream(topic, payload, nodeid=nodeid, flags=flags),
                          timeout)

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

    def close(self) -> None:
        """Disconnect (a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run_until_complete(self.aio.close())
        finally:
            self._runner.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(uri: str | None = None, *, event_loop: str | None = None,
            timeout: float | None = None) -> SyncHandle:
    """Attach to a rank (default ``$KVBROKER_URI``) with a blocking handle
    whose calls, and the connect itself, time out after ``timeout`` seconds
    by default (``TimeoutError``)."""
    return SyncHandle(uri, event_loop=event_loop, timeout=timeout)


class SyncStream:
    """The answers of a streaming request made through :class:`SyncHandle`:
    an iterator of payloads, and a context manager that closes it.

    ``matchtag`` names the request, for the service's own cancel RPC
    (``kvs-watch.cancel {matchtag}`` on the same rank).  :meth:`close` --
    also on leaving a ``with`` block, or a ``for`` loop through ``break`` or
    an exception, once iteration started -- stops the waiting on this side
    only (``h.aio.pending`` does not grow, late answers are dropped): the
    service keeps streaming until cancelled or the handle closes.
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
        except TimeoutError:
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
