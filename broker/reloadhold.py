"""Requests held while a module is reloaded on a rank.

``module reload NAME`` removes the loaded module, then starts a new one.
Between the two, no module serves NAME's services: the router answered
``ENOSYS`` on rank 0 (or sent the request up, on another rank), and a
writer committing while ``module reload kvs`` ran saw ``no service
matching kvs.commit`` -- a reload the README sells as "a new kvs on rank 0
while serving".  Instead the router holds what comes for those services
(:meth:`ReloadHold.take`), in arrival order, and routes it again once the
reload is over (:meth:`Router.end_hold <broker.router.Router.end_hold>`):
to the new module, or to the old one if it stayed, or answered with why
the reload failed.

A hold is bounded both ways: at most :data:`MAX_RELOAD_HELD` requests
(one more is answered ``EAGAIN`` at once), and for as long as the reload
is given (:data:`RELOAD_HOLD_TIMEOUT`, or the ``timeout`` of the
``module.reload`` request): a reload that hangs answers what it holds
``ETIMEDOUT`` and holds nothing more.  ``module remove`` followed by
``module load`` is no reload: nothing is held between them.

A rank that starts holds the same way, for each module it loads, from
before its links are up until that module has started: a rank 0
restarted under running followers got their clients' requests and
reconnecting watches before its kvs had loaded, and answered them
``ENOSYS`` (``no service matching kvs.namespace-list``, ``kvs is not
loaded on rank 0``), which ended the watches.

What the old module had accepted and parked before the reload -- a
``kvs.wait-version`` for a version not reached yet -- it hands over as it
stops (:meth:`Module.parked <broker.module.Module.parked>`): those go to
the front of the hold, in the order they came (:meth:`ReloadHold.take_first`),
and on to the new module as if they had come during the reload.
"""

from __future__ import annotations

import asyncio
import errno
from collections import deque
from collections.abc import Iterable

from broker.message import Message, MsgFlags

MAX_RELOAD_HELD = 10_000
"""Requests one reload holds at most (as :data:`broker.module.MAX_HELD`,
the requests a module keeps unanswered that the broker notes)."""

RELOAD_HOLD_TIMEOUT = 60.0
"""Seconds a reload holds requests when its ``module.reload`` gave no
``timeout``: more than rank 0's kvs takes to drain its queued commits and
write its last checkpoint (``kvs.module.STOP_DRAIN_TIMEOUT``, 10 s, then
the checkpoint), far less than a client waits for ever."""


class ReloadHold:
    """What comes for module ``module``'s ``services`` on rank ``rank``
    while it is reloaded, in arrival order."""

    __slots__ = ("module", "services", "rank", "limit", "starting", "timeout", "queue",
                 "timer")

    def __init__(self, module: str, services: Iterable[str], rank: int,
                 limit: int = MAX_RELOAD_HELD, starting: bool = False,
                 timeout: float = RELOAD_HOLD_TIMEOUT) -> None:
        self.module = module
        self.services = frozenset(services)
        self.rank = rank
        self.limit = limit
        self.starting = starting
        """The rank is starting, and the module has not yet (the same hold,
        worded so: :meth:`Broker.start <broker.broker.Broker.start>`).  Its
        deadline counts from the first request held, not from the hold."""
        self.timeout = timeout
        self.queue: deque[Message] = deque()
        self.timer: asyncio.TimerHandle | None = None
        """Ends the hold at the reload's deadline (:meth:`Router.hold_for_reload`)."""

    def __len__(self) -> int:
        return len(self.queue)

    def holds(self, msg: Message) -> bool:
        """``msg`` is for one of the services held, and not the module's own
        request (a module stopping or starting that asked its own service
        would wait for itself: it is routed as before, without the hold)."""
        if msg.service not in self.services:
            return False
        route = msg.route
        return not (len(route) == 1 and route[0] == f"m:{self.module}")

    def take(self, msg: Message) -> bool:
        """Hold ``msg``; False if :attr:`limit` are held already (a
        ``.disconnect``, which needs no answer and is the only way the new
        module learns that a client whose requests it will get is gone, is
        held all the same)."""
        if len(self.queue) >= self.limit and not msg.flags & MsgFlags.NORESPONSE:
            return False
        self.queue.append(msg)
        return True

    def take_first(self, parked: list[Message]) -> list[Message]:
        """Hold ``parked`` (the old module's, oldest first) before everything
        held: they came before it.  They count toward :attr:`limit`: those
        past it (the newest) are returned, to be answered as a request past
        the limit is."""
        room = max(0, self.limit - len(self.queue))
        self.queue.extendleft(reversed(parked[:room]))
        return parked[room:]

    def full_error(self) -> tuple[int, str]:
        """The answer to a request past :attr:`limit`."""
        being = "started" if self.starting else "reloaded"
        return errno.EAGAIN, (f"module {self.module} is being {being} on rank {self.rank} "
                              f"and {self.limit} requests wait for it already: retry")

    def timeout_error(self, timeout: float) -> tuple[int, str]:
        """The answer to each request held when the reload took too long."""
        verb = "start" if self.starting else "reload"
        return errno.ETIMEDOUT, (f"module {self.module} did not {verb} on rank {self.rank} "
                                 f"within {timeout:g}s: retry")

    def drain(self) -> list[Message]:
        """Everything held, oldest first; the hold is then empty."""
        out = list(self.queue)
        self.queue.clear()
        return out
