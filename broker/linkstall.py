"""When a link to another rank counts as stuck: its peer does not read.

A rank queues what its parent or a child has not read yet; a peer that
stopped reading (a SIGSTOPped rank) would make that queue grow without
bound, so past ``tbon.max-backlog`` bytes the link is dropped.  Bytes alone
misjudged a peer that reads: a burst of big messages (a client's 300 MiB
payloads, one message of up to ``broker.max-message``, 1 GiB, followed by
anything) put a healthy, reading neighbour over the mark, and it was cut
off -- the rank that lost its parent stopped, and with it the instance (a
guest could do it with a few requests: found by a review).

So a link over the mark is stuck only once its peer has read nothing for
:data:`STALL_GRACE` seconds, or once the queue passes :data:`HARD_FACTOR`
times the mark whatever the peer does (memory stays bounded).  The
connector also stops reading guests' connections while any of the rank's
links is over a quarter of the mark (:meth:`broker.overlay.Overlay.congested`),
so guests' big requests do not pile up there (a message each that guests
were finishing still goes: docs/cli.md, ``tbon.max-backlog``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

STALL_GRACE = 5.0
"""Seconds a link over ``tbon.max-backlog`` may go without its peer reading
before it is dropped (``tbon.torpid_min``'s default: a rank busy for that
long is torpid anyway)."""
HARD_FACTOR = 4
"""Past this many times ``tbon.max-backlog`` queued, a link is dropped even
if its peer reads (it reads slower than the rank is given to send)."""
CONGESTED_DIVISOR = 4
"""A link with more than ``tbon.max-backlog`` / this queued is congested:
guests' connections are not read meanwhile."""


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


class StallJudge:
    """One link's verdict: :meth:`stuck` before each message queued behind
    others, :meth:`progressed` whenever the peer takes some of the queue."""

    __slots__ = ("max_backlog", "_clock", "_read_at", "_over_since")

    def __init__(self, max_backlog: int, clock: Callable[[], float] | None = None) -> None:
        self.max_backlog = max_backlog
        self._clock = clock if clock is not None else _loop_time
        """Seconds, monotonic: the running loop's time (a test's own clock)."""
        self._read_at = 0.0
        """``loop.time()`` the peer last took some of the queue."""
        self._over_since: float | None = None
        """When the queue was first seen over the mark (None: it is not)."""

    def progressed(self) -> None:
        self._read_at = self._clock()

    def clear(self) -> None:
        """The queue is under the mark again: the next time over is a new
        episode (else it was judged from the first one's start, and a link
        whose peer had not needed to read for a while -- everything fitting
        in the kernel's buffer -- was dropped the moment it went over)."""
        self._over_since = None

    def stuck(self, queued: int) -> bool:
        """Whether a link with ``queued`` bytes waiting is to be dropped."""
        if queued <= self.max_backlog:
            self.clear()
            return False
        if queued > HARD_FACTOR * self.max_backlog:
            return True
        now = self._clock()
        if self._over_since is None:
            self._over_since = now
        return now - max(self._read_at, self._over_since) > STALL_GRACE
