"""The in-process module interface.

A module is a named service living inside a rank.  It talks to the broker
through a :class:`ModuleHandle` -- the same request/response/event interface
a client has -- and receives:

* requests for its service, dispatched by exact topic to the handlers it
  returns from :meth:`Module.handlers` (sync functions, or coroutines that
  run as tasks);
* responses to its own requests (through its handle);
* events matching the prefixes it subscribed (:meth:`Module.on_event`).

Modules are found by name through the ``kvbroker.modules`` entry-point group
(see :mod:`broker.plugins`), so the broker core never imports them.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import resource
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from broker.errors import ErrnoError, ProtocolError, describe_failure
from broker.message import NODEID_ANY, Message, MsgFlags, MsgType, Role
from broker.rpc import HandleCore

if TYPE_CHECKING:
    from broker.attrs import AttrSpec
    from broker.router import Router

Handler = Callable[[Message], Awaitable[None] | None]

MAX_HELD = 10_000
"""Requests a module's handlers returned without answering that the broker
notes, at most, to end them ``ENOSYS`` if the module is removed (see
:meth:`ModuleHandle.hold`)."""

MODULE_FAILURES: tuple[type[BaseException], ...] = (Exception, SystemExit)
"""What a module's own code may raise that is the failure of that code --
a handler answered ``EIO``, an event handler's logged, a start-up refused
-- never the rank's end.  ``sys.exit()`` in a module is its bug, as an
exception is: raised from a handler coroutine or a task it stopped the
rank's event loop (the instance went down with the status given), and
from a plain handler it dropped the connection whose read ran it.
``KeyboardInterrupt`` is not one: it is the rank's."""

RELOAD = "module reload"
"""The reason a module's :meth:`Module.stop` is given (:attr:`Module.stop_reason`)
when ``module reload`` removes it for a new one (``module remove``'s is
``"module remove"``): what it tells the clients whose requests it ends."""


class EventCounts:
    """What a module did with the events its subscriptions brought: the
    ``events`` section of its stats (docs/protocol.md, Namespace events).  ``received`` is
    counted by :class:`Module`; the module counts ``handled`` and calls
    :meth:`drop` with the reason for everything else."""

    DROP_KINDS = ("created", "error", "foreign")
    __slots__ = ("received", "handled", "dropped")

    def __init__(self) -> None:
        self.received = 0
        self.handled = 0
        self.dropped: Counter[str] = Counter()

    def drop(self, kind: str) -> None:
        self.dropped[kind] += 1

    def stats(self, subscribe_calls: int) -> dict[str, Any]:
        kinds = dict.fromkeys(self.DROP_KINDS, 0) | dict(self.dropped)
        return {"subscribe_calls": subscribe_calls, "received": self.received,
                "handled": self.handled, "dropped": kinds}


RUSAGE_WHO: dict[str, int | None] = {
    "self": resource.RUSAGE_SELF, "children": resource.RUSAGE_CHILDREN,
    "thread": getattr(resource, "RUSAGE_THREAD", None)}
"""``<name>.rusage``'s ``who``, as Flux's ``--rusage=self|children|thread``."""


def rusage_dict(ru: resource.struct_rusage) -> dict[str, float | int]:
    """A ``struct rusage`` as Flux's ``rusage`` answer names it: the times
    in seconds, ``maxrss`` in KiB (Linux's unit), the rest counts."""
    return {"utime": ru.ru_utime, "stime": ru.ru_stime, "maxrss": ru.ru_maxrss,
            "ixrss": ru.ru_ixrss, "idrss": ru.ru_idrss, "isrss": ru.ru_isrss,
            "minflt": ru.ru_minflt, "majflt": ru.ru_majflt, "nswap": ru.ru_nswap,
            "inblock": ru.ru_inblock, "oublock": ru.ru_oublock, "msgsnd": ru.ru_msgsnd,
            "msgrcv": ru.ru_msgrcv, "nsignals": ru.ru_nsignals, "nvcsw": ru.ru_nvcsw,
            "nivcsw": ru.ru_nivcsw}


def zero_counts(counts: Counter[str]) -> None:
    """Every counter back to 0, its name kept (stats show them all)."""
    for name in counts:
        counts[name] = 0


@dataclass
class ModuleContext:
    """What a module may know about its rank."""

    rank: int
    size: int
    fanout: int
    attrs: dict[str, Any]
    owner_uid: int
    log: logging.Logger
    extra: dict[str, Any] = field(default_factory=dict)
    siblings: dict[str, Module] = field(default_factory=dict)
    """The modules loaded in this rank by name (filled as they load): for a
    module that may call a sibling's Python API directly instead of through
    an RPC, as the kvs module stores its new blobs into ``content``."""
    kept: dict[str, Any] = field(default_factory=dict)
    """What a module removed from this rank at runtime left for its next
    load here, by module name (``module reload kvs`` on rank 0 hands the
    namespaces over: :meth:`Module.stop` puts, :meth:`Module.start` pops).
    Lives as long as the rank."""
    upstream_lost: Callable[[], bool] = field(default=lambda: False)
    """Whether this rank's link to its parent broke (it stops for that):
    nothing sent upstream will be answered, nor any event come down, so a
    module stopping does not wait for them (a follower's kvs, its relayed
    commits)."""
    progress: Callable[[int], None] = field(default=lambda n: None)
    """Count ``n`` more pieces of start-up work done (rank 0's restore:
    keys read): a launcher gives a start that makes progress more time
    than one that is silent (:mod:`broker.rank`, ``starting <count>``).
    Safe to call from another thread."""


class ModuleHandle(HandleCore):
    """A module's connection to its rank's router (no serialisation)."""

    def __init__(self, router: Router, module: Module, first_tag: int = 1) -> None:
        super().__init__()
        self._next_tag = first_tag  # (see Broker._next_tags)
        self._router = router
        self._module = module
        self.peer_id = f"m:{module.name}"
        self.userid = router.owner_uid
        self.rolemask = int(Role.OWNER)
        self.subscribe_calls = 0
        self._cred: tuple[int, int] | None = None
        self.held: dict[tuple[str, ...], dict[int, Message]] = {}
        """Requests that outlived their handler without their last answer,
        by client route and matchtag (see :meth:`hold`)."""
        self.held_count = 0
        self._held_full = False

    def close_as_removed(self, why: str) -> int:
        """The module is gone: its requests still waiting fail ``ENOSYS``
        ``why``, and so does any it would make from now on (a task of a
        stop that ``module remove --cancel`` cut short may run on), so
        that none takes a matchtag its next load numbers from -- which
        this returns."""
        self._fail_all(errno.ENOSYS, why)
        return self._next_tag

    def _send(self, msg: Message) -> None:
        cred = self._cred
        if cred is not None:
            msg.userid, msg.rolemask = cred
        self._router.from_local(self, msg)

    def rpc_as(self, requester: Message, topic: str, payload: Any = None, *,
               nodeid: int = NODEID_ANY) -> asyncio.Future[Any]:
        """:meth:`rpc` carrying the credentials (userid, rolemask) of ``requester``,
        a request this module is serving, so that the service checks *that*
        client's access (Flux's ``flux_msg_set_cred``)."""
        self._cred = (requester.userid, requester.rolemask)
        try:
            return self.rpc(topic, payload, nodeid=nodeid)
        finally:
            self._cred = None

    # The router calls this to deliver anything addressed to the module.
    def deliver(self, msg: Message) -> None:
        t = msg.type
        if t == MsgType.REQUEST:
            self._module._dispatch(msg)
        elif t == MsgType.RESPONSE:
            self._on_response(msg)
        elif t == MsgType.EVENT:
            self._module._receive_event(msg)

    # -- responding
    def respond(self, request: Message, payload: Any = None) -> None:
        flags = request.flags
        if flags & MsgFlags.NORESPONSE:
            return
        if not flags & MsgFlags.STREAMING:  # (a stream's last answer is an error)
            request.answered = True
            if self.held:
                self._release(request)
        self._router.route_response(request.response(payload))

    def respond_error(self, request: Message, errnum: int, errstr: str | None = None) -> None:
        """An error answer; ``errnum`` 0 is ``EINVAL``, as in Flux (it went
        out as a success, and a stream it was to end went on)."""
        if request.flags & MsgFlags.NORESPONSE:
            return
        request.answered = True
        if self.held:
            self._release(request)
        self._router.route_response(request.response(None, errnum or errno.EINVAL, errstr))

    def hold(self, request: Message) -> None:
        """``request`` outlived its handler without its last answer (a
        stream, a request parked to answer later): kept by client, to be
        answered ``ENOSYS`` if the module is removed (:meth:`end_held`).
        At most :data:`MAX_HELD` (a client sending streaming requests to a
        service that answers once would otherwise pin each of them, payload
        and all, for as long as it stays connected): past that, one is not
        noted -- it gets no ``ENOSYS`` at a removal -- and the log says so."""
        if self.held_count >= MAX_HELD:
            if not self._held_full:
                self._held_full = True
                logging.getLogger("kvbroker").warning(
                    "module %s keeps %d requests unanswered: more are not noted (a removal "
                    "of the module will not end them)", self._module.name, MAX_HELD)
            return
        mine = self.held.setdefault(tuple(request.route), {})
        if request.matchtag not in mine:
            self.held_count += 1
        mine[request.matchtag] = request

    def settled_elsewhere(self, request: Message) -> None:
        """``request`` gets no answer from here on, by design: its sender
        learns the outcome some other way (a relayed commit's, from the
        events naming its transactions).  So it is not held (:meth:`hold`):
        neither kept, payload and all, for as long as its sender stays
        connected, nor answered ``ENOSYS`` when the module is removed."""
        request.answered = True
        if self.held:
            self._release(request)

    def _release(self, request: Message) -> None:
        mine = self.held.get(tuple(request.route))
        if mine is not None and mine.pop(request.matchtag, None) is not None:
            self.held_count -= 1
            if not mine:
                del self.held[tuple(request.route)]

    def forget_client(self, route: list[str]) -> None:
        """The client at ``route`` went (its ``.disconnect``): what it had
        held needs no answer."""
        mine = self.held.pop(tuple(route), None)
        if mine:
            self.held_count -= len(mine)

    def hand_over_parked(self) -> int:
        """``module reload`` replaces the module: what it parked
        (:meth:`Module.parked`) goes to the front of the reload's hold, for
        the new module, each as a copy -- the module's own is marked
        answered, so that nothing at its stop ends it ``ENOSYS``.  Nothing
        is asked if no reload holds the module's services (a plain ``module
        remove``, a reload past its deadline): they are ended as ever.
        How many were handed over."""
        hold = self._router.reload_hold(self._module.name)
        if hold is None:
            return 0
        parked = [msg for msg in self._module.parked() if not msg.answered]
        for msg in parked:
            msg.answered = True
            if self.held:
                self._release(msg)
        self._router.hold_parked(hold, [msg.copy() for msg in parked])
        return len(parked)

    def end_held(self, why: str) -> None:
        """Answer ``ENOSYS`` every request still held (the module is removed)."""
        held, self.held, self.held_count = self.held, {}, 0
        for requests in held.values():
            for request in requests.values():
                if not request.answered:
                    self.respond_error(request, errno.ENOSYS, why)

    # -- events: direct calls into the rank's subscription table (never block)
    def subscribe(self, prefix: str) -> None:
        self.subscribe_calls += 1
        self._router.subscribe(self, prefix)

    def unsubscribe(self, prefix: str) -> None:
        self._router.unsubscribe(self, prefix)

    async def publish(self, topic: str, payload: Any = None, *, private: bool = False,
                      userid: int | None = None) -> int:
        body: dict[str, Any] = {"topic": topic, "payload": payload}
        if private:
            body["flags"] = int(MsgFlags.PRIVATE)
        if userid is not None:
            body["userid"] = userid
        return int((await self.rpc("event.pub", body))["seq"])

    def publish_nowait(self, topic: str, payload: Any = None) -> None:
        self.send_noresponse("event.pub", {"topic": topic, "payload": payload})


class Module:
    """Base class of in-process modules.

    Subclasses set ``name`` (the service), implement :meth:`handlers`, and
    may override :meth:`start`, :meth:`stop`, :meth:`on_event`, :meth:`stats`.
    ``<name>.stats-get`` is answered here from :meth:`stats`.  ``attributes``
    declares the broker attributes the module reads (:mod:`broker.attrs`):
    their values are checked before the module is created, and their defaults
    become readable attributes of the rank.
    """

    name: ClassVar[str] = ""
    services: ClassVar[tuple[str, ...]] = ()
    after: ClassVar[tuple[str, ...]] = ()
    """Modules this one uses as it starts: when ``broker.modules`` names them
    too, they are started first, whatever the list's order (as Flux's rc1
    loads content before kvs)."""
    ends_its_requests: ClassVar[bool] = False
    """Its :meth:`stop` answers every request it keeps beyond its handler
    (kvs-watch's watches): then none is noted for it.  Otherwise the broker
    notes each (a stream, one parked to answer later) and answers those
    left ``ENOSYS`` when the module is removed; a client's ``.disconnect``
    forgets its own."""
    repeatable: ClassVar[frozenset[str]] = frozenset()
    """Topics of requests whose handler (a coroutine) may wait long without
    having acted -- ``kvs.wait-version`` -- which the new module is given
    again when ``module reload`` replaces this one (:meth:`parked`)."""
    calls: ClassVar[tuple[str, ...]] = ()
    """Modules of this rank this one calls in process and keeps a reference
    to (:attr:`ModuleContext.siblings`): while it is loaded, ``module
    remove`` refuses them (``EBUSY``), and ``module load`` of this one
    needs them loaded first."""
    attributes: ClassVar[tuple[AttrSpec, ...]] = ()
    runtime_attributes: ClassVar[tuple[str, ...]] = ()
    """Names among ``attributes`` that ``attr set`` may change on a running
    rank (as Flux's ``flux config reload`` changes a module's option); the
    broker checks the value with its spec and calls :meth:`set_attribute`."""
    metrics_skip: ClassVar[tuple[str, ...]] = ("rank", "pid")
    """Fields of :meth:`stats` (dotted: ``overlay.hosts``) a rank does not
    send to statsd (:mod:`broker.statsd`): who it is, and every map keyed
    by names users chose (namespaces, uids, subscriptions), which are not
    a fixed set of figures."""

    def __init__(self, ctx: ModuleContext, handle: ModuleHandle | None = None) -> None:
        self.ctx = ctx
        self.log = ctx.log.getChild(self.name)
        self.h: ModuleHandle = handle  # type: ignore[assignment]
        self._handlers: dict[str, Handler] = {}
        self._tasks: dict[asyncio.Task[Any], None] = {}
        """The module's tasks, in the order they were spawned (a handler's:
        the order its requests came, :meth:`parked`)."""
        self.requests = 0
        self._warned_returns: set[str] = set()
        """Topics whose handler returned a value unanswered, said once (:meth:`_returned`)."""
        self.events = EventCounts()
        self.stop_reason: str | None = None
        """Why the rank stops (``signal SIGTERM``, ``lost the connection to
        parent rank 1 ...``), set before :meth:`stop`: what a module tells
        the clients it ends requests for."""
        self.source_file: str | None = None
        """The Python file the module's class was loaded from (``module load
        ./echo.py``, or a path in ``broker.modules``), set by the broker;
        None for an entry point's.  ``module reload NAME`` imports it
        again: the file's code as it is then."""
        self.removing = False
        """:meth:`stop` is for ``module remove`` (the rank goes on), not for
        the rank's stop: what a module keeps for its next load is put in
        :attr:`ModuleContext.kept` then, and the requests it was still
        serving are answered ``ENOSYS`` (their clients stay connected)."""

    # -- to override
    def handlers(self) -> dict[str, Handler]:
        return {}

    async def start(self) -> None:
        """Called once the module is registered with the router (a plain
        function may override it too)."""

    async def stop(self) -> None:
        """Called at shutdown, before the router goes away (a plain
        function may override it too)."""

    def on_event(self, msg: Message) -> Awaitable[None] | None:
        """Called for each event matching one of the module's subscriptions.
        A coroutine function may be given: each event's call then runs as a
        task of the module, started in the order the events came."""
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def parked(self) -> list[Message]:
        """``module reload`` is replacing this module, which is about to
        stop: the requests it accepted and has not answered that the new
        module may be given instead, as if they came now, oldest first --
        only those it has not acted on in any way the new module could not
        repeat (a wait for a version, yes; a commit it may have applied,
        never).  From this call on the module must not answer them: the
        broker holds them for the new module (:mod:`broker.reloadhold`).
        Not called for a plain ``module remove``, which ends them ``ENOSYS``
        as Flux does.  The default: the requests of :attr:`repeatable`
        topics whose handler still runs, their tasks cancelled; none if it
        names none."""
        if not self.repeatable:
            return []
        parked = []
        for task in list(self._tasks):
            msg = _serving(task)
            if msg is not None and msg.topic in self.repeatable and not msg.answered:
                _close_unstarted_handler(task)
                task.cancel()
                parked.append(msg)
        return parked

    def clear_stats(self) -> None:
        """Set the counters back to 0 (``<name>.stats-clear``, Flux's
        ``module stats --clear``): the module's requests and events, and
        its ``counts``.  What is now (gauges: watchers, cache sizes, peaks
        of the backlog) stays, as do the subscriptions."""
        self.requests = 0
        self.events = EventCounts()
        counts = getattr(self, "counts", None)
        if isinstance(counts, Counter):
            zero_counts(counts)

    def left_to_write(self) -> int:
        """Bytes the module still has to write to disk before it can stop
        (rank 0's content backlog): a rank reports it to its launcher while
        it stops, which gives a rank that makes progress more time."""
        return 0

    # -- plumbing
    def service_names(self) -> tuple[str, ...]:
        """The services the router sends this module: ``services``, and
        always its name, whose ``<name>.stats-get`` it answers (a module
        serving others only had stats no request could reach)."""
        return _service_names(self.name, self.services)

    @classmethod
    def declared_services(cls) -> tuple[str, ...]:
        """:meth:`service_names` as the class declares them, before any
        module is made (the rank holds them as it starts); a module that
        sets its ``services`` as it is made is held under its name only."""
        return _service_names(cls.name, cls.services)

    def _bind(self, handle: ModuleHandle) -> None:
        self.h = handle
        self._handlers = dict(self.handlers())
        self._handlers.setdefault(f"{self.name}.stats-get", self._stats_get)
        self._handlers.setdefault(f"{self.name}.stats-clear", self._stats_clear)
        self._handlers.setdefault(f"{self.name}.rusage", self._rusage)

    def event_stats(self) -> dict[str, Any]:
        """The ``events`` section of this module's stats."""
        return self.events.stats(self.h.subscribe_calls)

    def _stats_get(self, msg: Message) -> None:
        """Open to guests, as in Flux, but a guest is shown only ``rank``:
        a module's counters are instance-wide and move with what other
        users do (docs/protocol.md, Built-in services).  A module that has
        something of a guest's own to show answers its own stats-get."""
        if msg.is_owner:
            self.h.respond(msg, self.stats())
        else:
            self.h.respond(msg, {"rank": self.ctx.rank})

    def _stats_clear(self, msg: Message) -> None:
        """The instance owner only: the counters are instance-wide."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, f"{self.name}.stats-clear is for the instance owner")
        self.clear_stats()
        self.h.respond(msg, {})

    def _rusage(self, msg: Message) -> None:
        """``getrusage(2)`` of the rank's process (Flux's ``module stats
        --rusage``): the modules run in it, so ``self`` is the rank's,
        ``thread`` its event loop's thread (Linux), ``children`` the
        processes it waited for.  The instance owner only, as stats-get."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, f"{self.name}.rusage is for the instance owner")
        p = msg.payload if msg.payload is not None else {}
        if not isinstance(p, dict):
            raise ErrnoError(errno.EPROTO, "the payload must be a map")
        who = p.get("who", "self")
        code = RUSAGE_WHO.get(who) if isinstance(who, str) else None
        if code is None:
            raise ErrnoError(errno.EINVAL, f"who must be one of "
                             f"{', '.join(w for w, v in RUSAGE_WHO.items() if v is not None)}"
                             f": {who!r}")
        self.h.respond(msg, rusage_dict(resource.getrusage(code)))

    def _receive_event(self, msg: Message) -> None:
        self.events.received += 1
        try:
            result = self.on_event(msg)
        except MODULE_FAILURES:
            self.log.exception("event handler failed for %s", msg.topic)
            return
        if result is not None and inspect.isawaitable(result):
            self._own(self._finish_event(msg, result))

    async def _finish_event(self, msg: Message, aw: Awaitable[None]) -> None:
        try:
            await aw
        except asyncio.CancelledError:
            raise
        except MODULE_FAILURES:
            self.log.exception("event handler failed for %s", msg.topic)

    def _dispatch(self, msg: Message) -> None:
        if self._tasks and msg.topic.endswith(".disconnect") and self._unstarted_from(msg):
            # A request of this client's came in the same turn, and its
            # handler's task has not begun: the disconnect waits for it
            # (a turn), so the handler sees the order the client sent.  It
            # found nothing to end, and the handler then started what the
            # client would never end: a rexec.exec's command ran on for good.
            asyncio.get_running_loop().call_soon(self._dispatch, msg)
            return
        self.requests += 1
        handler = self._handlers.get(msg.topic)
        if handler is None:
            if not msg.topic.endswith(".disconnect"):
                self.h.respond_error(msg, errno.ENOSYS, f"unknown topic {msg.topic}")
            elif self.h.held:
                self.h.forget_client(msg.route)
            return
        try:
            result = handler(msg)
        except ErrnoError as exc:
            self.h.respond_error(msg, exc.errnum, exc.errstr)
            self._gone_anyway(msg)
            return
        except MODULE_FAILURES as exc:
            self.log.exception("handler %s failed", msg.topic)
            self.h.respond_error(msg, errno.EIO, f"internal error: {failure_words(exc)}")
            self._gone_anyway(msg)
            return
        if result is not None and inspect.isawaitable(result):
            self._serve(msg, result)
        elif not msg.answered:
            if result is not None:
                self._returned(msg, result)
            self._held(msg)

    def _unstarted_from(self, disconnect: Message) -> bool:
        """Whether a handler task of a request from the client that
        ``disconnect`` names has not begun yet.  Only the newest tasks can
        be such (a task's first step runs in the order tasks were made),
        so the walk stops at the first one that has begun: nothing is
        noted per request."""
        for task in reversed(self._tasks):
            if not _unstarted(task):
                return False  # (begun, or over: so have all made before it)
            served = _serving(task)
            if served is not None and served.route == disconnect.route:
                return True
        return False

    def _returned(self, msg: Message, result: object) -> None:
        """A handler returned a value without answering: said once per
        topic (its client waited with no hint: a handler answers with
        ``self.h.respond``, whatever it returns)."""
        if msg.topic not in self._warned_returns:
            self._warned_returns.add(msg.topic)
            self.log.warning("handler %s returned a %s without answering its request: "
                             "answer with self.h.respond(msg, payload) (what a handler "
                             "returns is not sent)", msg.topic, type(result).__name__)

    def _gone_anyway(self, msg: Message) -> None:
        """A ``.disconnect`` whose handler failed: the client is gone all
        the same, and what the broker held for it is forgotten (its
        requests stayed held, payloads and all, until the module went)."""
        if msg.topic.endswith(".disconnect") and self.h.held:
            self.h.forget_client(msg.route)

    def _held(self, msg: Message) -> None:
        """``msg``'s handler returned without its last answer: a client's
        disconnect forgets what it held; a module that does not end its
        requests itself at stop keeps it (:attr:`ends_its_requests`)."""
        if msg.flags & MsgFlags.NORESPONSE:
            if msg.topic.endswith(".disconnect") and self.h.held:
                self.h.forget_client(msg.route)
        elif not self.ends_its_requests:
            self.h.hold(msg)

    async def _finish(self, msg: Message, aw: Awaitable[object]) -> None:
        try:
            result = await aw
            if not msg.answered:
                if result is not None:
                    self._returned(msg, result)
                self._held(msg)
        except ErrnoError as exc:
            self.h.respond_error(msg, exc.errnum, exc.errstr)
            self._gone_anyway(msg)
        except asyncio.CancelledError:
            raise
        except MODULE_FAILURES as exc:
            self.log.exception("handler %s failed", msg.topic)
            self.h.respond_error(msg, errno.EIO, f"internal error: {failure_words(exc)}")
            self._gone_anyway(msg)

    def set_attribute(self, name: str, value: Any) -> None:
        """Apply runtime attribute ``name`` (one of :attr:`runtime_attributes`),
        its ``value`` parsed and checked already."""
        raise NotImplementedError(f"{self.name} declares no runtime attribute {name}")

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task owned by the module (cancelled at stop).
        A ``sys.exit()`` in it fails the task with :class:`ModuleExit`, as
        an exception would, instead of ending the rank."""
        task = self._own(_exit_contained(self.name, coro))
        # (a task cancelled before its first step never awaits ``coro``:
        # closed then, or Python warns that it was never awaited)
        task.add_done_callback(lambda _: coro.close())
        task.add_done_callback(self._log_exit)
        return task

    def _log_exit(self, task: asyncio.Task[Any]) -> None:
        """A spawned task that called ``sys.exit()`` is logged as it ends,
        as api.md says: kept by the module (``self.t = self.spawn(...)``,
        the usual way), it was said by nobody -- asyncio reports an
        exception never retrieved only when the task is collected.  Other
        failures are the module's to read (it may await the task)."""
        if not task.cancelled() and isinstance(task.exception(), ModuleExit):
            self.log.error("%s", task.exception())

    def _serve(self, msg: Message, aw: Awaitable[None]) -> asyncio.Task[Any]:
        """Serve request ``msg`` with ``aw`` in a task owned by the module:
        what an async handler returns is run so.  Its failure, ``sys.exit()``
        included, is answered ``EIO``; a request it leaves unanswered is
        noted, as a plain handler's is."""
        return self._own(self._finish(msg, aw))

    def _own(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks[task] = None
        task.add_done_callback(self._tasks.pop)
        return task

    async def _shutdown(self, why: str | None = None) -> None:
        self.stop_reason = why
        try:
            if self.removing:
                try:
                    n = self.h.hand_over_parked()
                except Exception:  # (a bug of parked(): what it kept is ended below)
                    self.log.exception("the requests it parked could not be handed over "
                                       "to the module reloaded")
                else:
                    if n:
                        self.log.info("%d requests it parked are held for the module "
                                      "reloaded", n)
            try:
                stopped = self.stop()
                if inspect.isawaitable(stopped):  # (a plain stop() did its work as called)
                    await stopped
            except SystemExit as exc:  # (its failure to stop, not the rank's exit)
                raise _module_exit(self.name, "stop()", exc) from exc
        finally:
            self.end_serving(why)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    def end_serving(self, why: str | None = None) -> None:
        """What a stop leaves behind, ended: the handler tasks cancelled (a
        removal answers their requests ``ENOSYS``), the requests held for
        it answered ``ENOSYS``.  Again and again as needed: the stop's end
        runs it, and so does a remove whose ``--cancel`` cancelled the
        stop, maybe before it began -- which then never ran, and left its
        clients waiting for ever, its handlers running on."""
        for task in list(self._tasks):
            if self.removing:
                self._end_request(task, why)
            _close_unstarted_handler(task)
            task.cancel()
        if self.removing:
            self.h.end_held(f"module {self.name} was removed" + (f" ({why})" if why else ""))

    def _end_request(self, task: asyncio.Task[Any], why: str | None) -> None:
        """A request still being served as the module is removed (a handler
        task, :meth:`_finish`) gets ``ENOSYS``, as Flux answers a request to
        an unloaded module: its client stays connected, and would wait for
        ever.  One answered already (its handler went on after its answer,
        or it was handed over to the new module, :meth:`parked`) is not."""
        msg = _serving(task)
        if msg is not None and not msg.answered:
            self.h.respond_error(msg, errno.ENOSYS, f"module {self.name} was removed"
                                 + (f" ({why})" if why else ""))


def _serving(task: asyncio.Task[Any]) -> Message | None:
    """The request a handler task (:meth:`Module._finish`) serves, if
    ``task`` is one that has not finished: read from its frame, so that
    nothing is noted per request."""
    coro = task.get_coro()
    frame = getattr(coro, "cr_frame", None)
    if frame is None or getattr(coro, "cr_code", None) is not Module._finish.__code__:
        return None
    msg = frame.f_locals.get("msg")
    return msg if isinstance(msg, Message) else None


def _close_unstarted_handler(task: asyncio.Task[Any]) -> None:
    """A ``_finish`` (or ``_finish_event``) task cancelled before its first
    step never awaits the handler coroutine it was given, and Python then
    warns "coroutine ... was never awaited" on the rank's stderr as it
    stops: close that coroutine here (a frame not yet run still holds its
    arguments)."""
    if _unstarted(task):
        aw = task.get_coro().cr_frame.f_locals.get("aw")  # type: ignore[union-attr]
        if asyncio.iscoroutine(aw):
            aw.close()


def _unstarted(task: asyncio.Task[Any]) -> bool:
    """Whether ``task``'s coroutine has not begun (its first step to come)."""
    coro = task.get_coro()
    return inspect.getcoroutinestate(coro) == inspect.CORO_CREATED  # type: ignore[arg-type]


class ModuleExit(RuntimeError):
    """A module's task (:meth:`Module.spawn`) or :meth:`Module.stop` called
    ``sys.exit()``: the failure of that code, not the rank's exit."""


def _module_exit(name: str, what: str, exc: SystemExit) -> ModuleExit:
    code = "" if exc.code is None else repr(exc.code)
    return ModuleExit(f"module {name}'s {what} called sys.exit({code})")


async def _exit_contained(name: str, coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except SystemExit as exc:
        raise _module_exit(name, "task", exc) from exc


def failure_words(exc: BaseException) -> str:
    """A handler's failure in its ``EIO`` answer: the exception's words,
    but ``SystemExit: N`` for ``sys.exit(N)``, whose words are ``N`` alone."""
    return describe_failure(exc) if isinstance(exc, SystemExit) else str(exc)


def require(payload: Any, **fields: type | tuple[type, ...]) -> dict[str, Any]:
    """Check a request payload: a map holding ``fields`` of the given types.

    Missing or mistyped fields raise ``EPROTO`` (``ProtocolError``), as Flux
    answers an unpackable request.  Returns the payload.
    """
    if not isinstance(payload, dict):
        raise ProtocolError("request payload must be a map")
    for name, types in fields.items():
        value = payload.get(name, _MISSING)
        if type(value) is types:  # the usual case: exactly the type asked for
            continue
        if value is _MISSING:
            raise ProtocolError(f"request is missing field {name!r}")
        if not isinstance(value, types) or (isinstance(value, bool) and types is int):
            raise ProtocolError(f"field {name!r} has the wrong type")
    return payload


def require_notice(msg: Message) -> None:
    """A one-way notice between ranks or from a client (``groups.resend``,
    ``rexec.credit``), which its handler never answers: sent as an RPC
    (expecting an answer: ``kvbroker rpc TOPIC``), it is refused ``EPROTO``
    and not acted on, rather than left waiting for ever."""
    if not msg.flags & MsgFlags.NORESPONSE:
        raise ProtocolError(f"{msg.topic} is a notice, never answered: send it expecting "
                            "no answer (send_noresponse)")


_MISSING = object()


def _service_names(name: str, services: tuple[str, ...]) -> tuple[str, ...]:
    """``services``, with ``name`` first if it is not among them, each
    once (one named twice failed the load as "already registered", by
    itself)."""
    if not services:
        return (name,)
    return tuple(dict.fromkeys(services if name in services else (name, *services)))
