"""The request/response machinery shared by client handles and module handles.

A handle sends requests with a fresh ``matchtag`` and matches responses back
to the waiting future (one answer) or :class:`Stream` (many answers ending
with an error response; ``ENODATA`` is the normal end).
"""

from __future__ import annotations

import asyncio
import errno
import math
import sys
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, final

from broker.errors import RemoteError
from broker.message import NODEID_ANY, Message, MsgFlags, MsgType

WAIT_GRACE = 1.0
"""Seconds a client gives a rank past a wait's own ``timeout`` (sent in the
request: ``kvs.wait-version``, ``rexec.wait``) to say it gave up -- its
answer says why -- before giving up on the rank itself: a stopped rank
answers nothing, and the wait had no end."""

@final
class Stream:
    """The answers of a streaming RPC, as an async iterator of payloads.

    Iteration ends on ``ENODATA``; any other error response raises
    :class:`RemoteError`.  ``matchtag`` identifies the request (e.g. for
    ``kvs-watch.cancel``).  Final: a pending answer is told from a plain
    request's future by ``type(w) is Stream``, which a subclass would fail.

    Its answers are read off the socket as they come, whether or not its
    reader keeps up, so a service's own bound on what it has queued for a
    slow reader never applies: a stream whose service has such a bound
    (a kvs-watch watch) keeps the client side to it with :meth:`bound`.
    Others keep every unread answer, as before (their services have their
    own flow: ``rexec`` output its credits).
    """

    def __init__(self, matchtag: int, topic: str) -> None:
        self.matchtag = matchtag
        self.topic = topic
        self._items: deque[Message] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.done = False
        self.abandoned = False
        """Nobody will read it any more (:meth:`abandon`)."""
        self.max_unread = sys.maxsize
        """Unread answers past which :attr:`_over` decides (:meth:`bound`)."""
        self._over: Callable[[Stream, Message], None] | None = None
        self.ended_here = False
        """Ended on this side (:meth:`end_here`): what its service still
        sends is dropped."""

    def __repr__(self) -> str:
        state = "ended" if self.done else f"{len(self._items)} unread"
        return f"<Stream {self.topic} matchtag={self.matchtag} {state}>"

    @property
    def reading(self) -> bool:
        """Whether a task waits in :meth:`next_message` now."""
        return self._waiter is not None

    def abandon(self) -> None:
        """Its reader is gone, or is to stop (the request is being
        cancelled): keep no answers from now on but the final error
        response, which still ends it -- the handle forgets it then -- and
        ends it quietly, whatever its errno: a reader waiting now, or the
        next one, finds the end of the stream (None), as it asked.  (Before,
        the final answer was dropped too, which left a waiting reader
        waiting for ever: :meth:`kvs_watch.client.SyncWatch.cancel` from
        another thread abandons a stream that a next() reads.)"""
        self.abandoned = True
        items = self._items
        # (its final answer here already, unread: no later one will end it)
        ended = self.ended_here or bool(items and items[-1].errnum)
        items.clear()
        if ended:  # (its end was here already: no later answer ends it)
            self.done = True
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(None)

    def bound(self, max_unread: int, over: Callable[[Stream, Message], None]) -> None:
        """Keep at most ``max_unread`` unread success answers: one that comes
        past that is given to ``over(stream, msg)`` instead of being queued,
        which may fold it into :attr:`unread` or :meth:`end_here`.  (One
        length check per answer: a reader that keeps up pays nothing more.)
        The final error answer is always queued."""
        self.max_unread = max_unread
        self._over = over

    @property
    def unread(self) -> deque[Message]:
        """The answers queued for the reader: an ``over`` may fold an answer
        into the last, or append it past the bound (no reader waits while
        any is queued, so there is none to wake)."""
        return self._items

    def end_here(self, errnum: int, errstr: str) -> None:
        """End the stream on this side, as if its service had sent this
        error: its reader gets the answers queued, then ``RemoteError``.
        Whatever the service still sends is dropped (the caller asks it to
        stop; its last answer still frees the request's tag, in the handle)."""
        if self.ended_here or self.done:
            return
        self.ended_here = True
        self.max_unread = 0  # (every later answer takes the slow path: dropped)
        self._items.append(Message(MsgType.RESPONSE, self.topic, matchtag=self.matchtag,
                                   errnum=errnum, errstr=errstr))
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, msg: Message) -> None:
        if self.abandoned and not msg.errnum:
            return
        items = self._items
        if len(items) >= self.max_unread:  # (sys.maxsize: unbounded)
            if self.ended_here:
                return
            if not msg.errnum:
                assert self._over is not None
                self._over(self, msg)
                return
        items.append(msg)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        msg = await self.next_message()
        if msg is None:
            raise StopAsyncIteration
        return msg.payload

    async def next_message(self) -> Message | None:
        """The next success response, or None at the end of the stream."""
        while not self._items:
            if self.done:
                return None
            if self._waiter is not None:
                # one reader: a second would take half the answers, or wait
                # for ever (as a second __anext__ of an async generator)
                raise RuntimeError(f"another task is already reading the {self.topic} stream")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        msg = self._items.popleft()
        if msg.errnum:
            self.done = True
            self._items.clear()
            if msg.errnum == errno.ENODATA or self.abandoned:
                return None
            raise RemoteError(msg.errnum, msg.errstr)
        return msg


def settle(waiter: asyncio.Future[Any], errnum: int, errstr: str | None,
           decode: Callable[[Any], Any], source: Any) -> None:
    """Settle a plain request's future from its answer: ``RemoteError`` for an
    error response, else the payload ``decode(source)`` gives (an exception
    from a malformed payload fails the future instead)."""
    if waiter.done():
        return
    if errnum:
        waiter.set_exception(RemoteError(errnum, errstr))
        return
    try:
        waiter.set_result(decode(source))
    except Exception as exc:  # malformed payload
        waiter.set_exception(exc)


def check_request(topic: Any, nodeid: Any, flags: Any, answered: bool = True) -> None:
    """API misuse is a ``TypeError`` here, before anything is sent: the
    broker cannot answer a request whose topic it cannot read (it drops it),
    so such a call would wait for ever -- as would one flagged NORESPONSE
    that expects an answer (``ValueError``)."""
    check_str(topic, "topic")
    if not isinstance(nodeid, int) or isinstance(nodeid, bool):
        raise TypeError(f"nodeid must be an int, not {type(nodeid).__name__}")
    if not isinstance(flags, int) or isinstance(flags, bool):
        raise TypeError(f"flags must be an int, not {type(flags).__name__}")
    if answered and flags & MsgFlags.NORESPONSE:
        raise ValueError("a NORESPONSE request is never answered: use send_noresponse()")


def check_str(value: Any, what: str) -> str:
    """``value`` if it is a ``str``, else a ``TypeError`` naming ``what``,
    before anything is sent: a topic or a name of another type went out, to
    come back ``EPROTO`` (or, sent without an answer, nowhere)."""
    if type(value) is not str:
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not value.isascii():  # (O(1): CPython keeps the flag)
        try:
            value.encode()
        except UnicodeEncodeError as exc:  # (a lone surrogate: the error blamed the
            # payload; still a UnicodeEncodeError, which the command line reports
            # as "Invalid argument ('k\\xff' is not UTF-8 text)")
            raise UnicodeEncodeError(exc.encoding, value, exc.start, exc.end,
                                     f"{what} is not UTF-8 text") from None
    return value


def check_timeout(timeout: Any, what: str = "timeout") -> float | None:
    """``timeout`` (seconds) as a float, or None (no limit).  API misuse is
    a ``TypeError`` (not a number) or ``ValueError`` (negative, NaN or
    infinite: None is no limit) here, before anything is sent or started:
    the blocking facade sent the request, then refused the timeout, and
    NaN made a wait give up at once saying the rank "did not answer"."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{what} must be a number of seconds or None, not "
                        f"{type(timeout).__name__}")
    try:
        seconds = float(timeout)
    except OverflowError:  # (an int past a float's range)
        seconds = math.inf
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{what} must be a number of seconds, at least 0 (None: no "
                         f"limit), not {timeout!r}")
    return seconds


def _message_payload(msg: Message) -> Any:
    return msg.payload


def _request(topic: str, payload: Any, matchtag: int, nodeid: int, flags: int) -> Message:
    """A new request (cheaper than the keyword constructor; rpc() is the hot path)."""
    return Message.from_fields(MsgType.REQUEST, topic, payload, matchtag, nodeid, flags,
                               -1, 0, [], 0, None, 0)


class HandleCore:
    """Matchtags, pending futures and streams; subclasses provide ``_send``."""

    def __init__(self) -> None:
        self._next_tag = 1
        # A plain request's future stays here until its answer comes, even if
        # the caller stopped waiting (``asyncio.wait_for`` cancelled it): an
        # answer may never come (``kvs.wait-version`` for a version never
        # reached).  Rather than a done-callback per request, _sweep() drops
        # the done futures every SWEEP_EVERY tags and when ``pending`` is read.
        self._pending: dict[int, asyncio.Future[Any] | Stream] = {}
        self._unanswered: set[int] = set()
        """Tags of requests forgotten before their answer came (swept,
        retired): not issued again until that answer comes, as Flux's
        matchtag pool does, so a late answer never reaches a newer request."""
        self._retired_streams: set[int] = set()
        """Those of :attr:`_unanswered` that are streams: only their last
        answer (an error: ``ENODATA`` at the end) frees the tag."""
        self._closed_error: RemoteError | None = None
        # The loop this handle's answers arrive on, when it is bound to one
        # (a client connection): rpc() may then be called while that loop is
        # not running, as the blocking facade does.  None: the running loop.
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- transport, provided by subclasses
    def _send(self, msg: Message) -> None:
        raise NotImplementedError

    def _send_request(self, topic: str, payload: Any, matchtag: int, nodeid: int,
                      flags: int) -> None:
        """Send a new request (a subclass that serialises may skip the Message)."""
        self._send(_request(topic, payload, matchtag, nodeid, flags))

    # -- requests
    SWEEP_EVERY = 1024  # a power of 2: tags allocated between sweeps

    def _alloc_tag(self) -> int:
        while True:
            tag = self._next_tag
            self._next_tag = tag + 1 if tag < 0x7FFFFFFF else 1
            if not tag & (self.SWEEP_EVERY - 1):
                self._sweep()
            if tag not in self._pending and tag not in self._unanswered:
                return tag
            # (wrapped after 2**31 requests: skip what may still be answered,
            # a long watch's stream or an abandoned wait)

    def _sweep(self) -> None:
        """Forget plain requests whose futures are done without an answer
        (cancelled by a caller that gave up): a late answer is dropped."""
        pending = self._pending
        dead = [tag for tag, w in pending.items() if type(w) is not Stream and w.done()]
        for tag in dead:
            del pending[tag]
        self._unanswered.update(dead)

    def _late_answer(self, tag: int, errnum: int) -> None:
        """An answer nobody waits for any more: its tag may be issued again
        -- a stream's only at its last answer (an error), since the service
        goes on answering it until then."""
        if tag in self._retired_streams:
            if not errnum:
                return
            self._retired_streams.discard(tag)
        self._unanswered.discard(tag)

    def _check_open(self) -> None:
        if self._closed_error is not None:  # (a new one each time: a shared one's
            e = self._closed_error                 # traceback grew with every raise)
            raise RemoteError(e.errnum, e.errstr)

    def rpc(
        self,
        topic: str,
        payload: Any = None,
        *,
        nodeid: int = NODEID_ANY,
        flags: int = 0,
    ) -> asyncio.Future[Any]:
        """Send a request; the returned future resolves to the response payload
        or raises :class:`RemoteError`."""
        return self.rpc_tagged(topic, payload, nodeid=nodeid, flags=flags)[1]

    def rpc_tagged(
        self,
        topic: str,
        payload: Any = None,
        *,
        nodeid: int = NODEID_ANY,
        flags: int = 0,
    ) -> tuple[int, asyncio.Future[Any]]:
        """:meth:`rpc`, also returning the request's matchtag, for a caller
        that may stop waiting with :meth:`retire`."""
        check_request(topic, nodeid, flags)
        self._check_open()
        fut: asyncio.Future[Any] = (self._loop or asyncio.get_running_loop()).create_future()
        tag = self._alloc_tag()
        self._pending[tag] = fut
        try:
            self._send_request(topic, payload, tag, nodeid, flags)
        except BaseException:
            del self._pending[tag]
            raise
        return tag, fut

    def retire(self, tag: int, *, may_answer: bool = True) -> None:
        """Stop waiting for the answer to request ``tag`` (its future is
        cancelled; a late answer is dropped).  For a request whose success is
        learnt some other way: ``kvs.relaycommit`` is answered only if refused,
        its success is the ``setroot`` event that names the transaction.
        ``may_answer`` False: its service is known never to answer it now
        (the event that names a relayed transaction says rank 0 queued the
        relay, which it then never answers), so the tag may be issued again
        at once -- else it is kept out of use until an answer comes
        (:attr:`_unanswered`), which for such a request is never: one
        entry per relayed commit, for good."""
        waiter = self._pending.pop(tag, None)
        if waiter is not None and type(waiter) is not Stream and not waiter.done():
            waiter.cancel()
        if waiter is not None and may_answer:
            self._unanswered.add(tag)
            if type(waiter) is Stream:
                self._retired_streams.add(tag)

    @property
    def retired(self) -> int:
        """Requests nobody waits for whose answer may still come: their tags
        are kept out of use until it does (a count that grows with each such
        request shows a service that never answers what it was sent)."""
        self._sweep()
        return len(self._unanswered)

    @property
    def pending(self) -> int:
        """Requests still waiting for an answer (a leak shows here); a request
        whose caller stopped waiting (its future cancelled) is not counted."""
        self._sweep()
        return len(self._pending)

    def rpc_stream(
        self,
        topic: str,
        payload: Any = None,
        *,
        nodeid: int = NODEID_ANY,
        flags: int = 0,
    ) -> Stream:
        """Send a streaming request; iterate the returned :class:`Stream`."""
        check_request(topic, nodeid, flags)
        self._check_open()
        tag = self._alloc_tag()
        stream = Stream(tag, topic)
        self._pending[tag] = stream
        try:
            self._send_request(topic, payload, tag, nodeid, flags | MsgFlags.STREAMING)
        except BaseException:
            del self._pending[tag]
            raise
        return stream

    def send_noresponse(
        self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY
    ) -> None:
        """Send a request that gets no response (``matchtag`` 0)."""
        check_request(topic, nodeid, 0, answered=False)
        self._check_open()
        self._send_request(topic, payload, 0, nodeid, MsgFlags.NORESPONSE)

    # -- responses
    def _on_response(self, msg: Message) -> None:
        waiter = self._pending.get(msg.matchtag)
        if waiter is None:
            if self._unanswered:
                self._late_answer(msg.matchtag, msg.errnum)
            return
        if type(waiter) is Stream:
            if msg.errnum:
                del self._pending[msg.matchtag]
                if msg.errnum == errno.EMSGSIZE:
                    # A rank could not pass an answer on (over tbon.max-message,
                    # or this connection's limit) and sent this in its place:
                    # the service may go on answering, so the tag is not
                    # issued again until its last answer (a watch's client
                    # cancels it: kvs_watch.client), and those are dropped.
                    self._unanswered.add(msg.matchtag)
                    self._retired_streams.add(msg.matchtag)
            waiter._push(msg)
            return
        del self._pending[msg.matchtag]
        settle(waiter, msg.errnum, msg.errstr, _message_payload, msg)

    def _fail_all(self, errnum: int, errstr: str, final: bool = True) -> None:
        """Fail every pending request (the connection is gone; ``final``: for
        good, so calls from now on fail the same way)."""
        if final:
            self._closed_error = RemoteError(errnum, errstr)
        # no answer can come now on the connection the retired tags were
        # sent on (a reconnecting handle's next one starts afresh)
        self._unanswered.clear()
        self._retired_streams.clear()
        pending, self._pending = self._pending, {}
        for tag, waiter in pending.items():
            if type(waiter) is Stream:
                waiter._push(Message(MsgType.RESPONSE, waiter.topic, matchtag=tag,
                                     errnum=errnum, errstr=errstr))
            elif not waiter.done():
                waiter.set_exception(RemoteError(errnum, errstr))
