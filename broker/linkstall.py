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
connector also stops reading guests' connections while any link is over a
quarter of the mark (:meth:`broker.overlay.Overlay.congested`), so a guest
cannot push a link that far.
"""

from __future__ import annotations

import asyncio

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


class StallJudge:
    """One link's verdict: :meth:`stuck` before each message queued behind
    others, :meth:`progressed` whenever the peer takes some of the queue."""

    __slots__ = ("max_backlog", "_read_at", "_over_since")

    def __init__(self, max_backlog: int) -> None:
        self.max_backlog = max_backlog
        self._read_at = 0.0
        """``loop.time()`` the peer last took some of the queue."""
        self._over_since: float | None = None
        """When the queue was first seen over the mark (None: it is not)."""

    def progressed(self) -> None:
        self._read_at = asyncio.get_running_loop().time()

    def stuck(self, queued: int) -> bool:
        """Whether a link with ``queued`` bytes waiting is to be dropped."""
        if queued <= self.max_backlog:
            self._over_since = None
            return False
        if queued > HARD_FACTOR * self.max_backlog:
            return True
        now = asyncio.get_running_loop().time()
        if self._over_since is None:
            self._over_since = now
        return now - max(self._read_at, self._over_since) > STALL_GRACE
