"""Rank 0's SQLite thread, and the turns at the GIL the event loop gives it.

The content module writes blobs and checkpoints to SQLite on one thread of
its own, so that the event loop does not wait for the disk.  Between two
SQLite calls that thread runs a little Python, for which it needs the GIL,
and a busy event loop can keep it from getting it for tens of milliseconds
at a time:

* uvloop runs each callback with the GIL taken and gives it back after, so
  a loop with work to do releases and retakes the GIL thousands of times a
  second, retaking it before the waiting thread wakes to it;
* CPython asks the holder to hand the GIL over only when a waiter has gone
  a whole switch interval (5 ms) without *any* thread taking it -- and each
  retake by the loop starts that wait again.

So the thread waits until the loop happens to go idle.  With one client
churning namespaces (create, commit, remove, ~1,000 a second), a ``SYNC``
commit on rank 0 -- a few jobs of a few SQLite calls each -- took 40-100 ms
(p50) instead of 3, and 100-150 at p90; py-spy showed the thread's busy time
mostly spent in ``take_gil`` after a SQLite call returned.  (asyncio's own
loop holds the GIL across its callbacks and shows it far less: 5-7 ms.)

The remedy is a turn.  When a job has been on the thread longer than
:data:`TURN_AFTER`, the loop looks whether it is busy: a look asked for
at once (``call_soon``) that runs late found other callbacks first.  If so it
blocks for :data:`TURN` (``time.sleep``, which lets go of the GIL: ~85 us
here, with the kernel's timer slack), so the thread takes the GIL at once,
and looks again at the next turn, until the thread's jobs are done.  If the
loop is idle it gives no turn -- waiting for events, it lets go of the GIL
itself -- and looks again :data:`IDLE_GAP` later.  A job that finishes
sooner costs nothing, and neither does the disk work (SQLite runs without
the GIL).  Measured by ``benchmarks/run.py Wsync`` (uvloop, three
alternated pairs against the code before): ``SYNC`` commits beside a
churning client 12-13 ms p50 and 16-18 p90, against 21-23 and 68-87; alone
2.1-2.4 ms either way; W2 and W2p unchanged (performance.md, Wsync).
The counts are in ``kvbroker stats content`` (``sqlite-thread``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

TURN = 30e-6
"""How long the loop lets go of the GIL at each turn (seconds)."""

TURN_AFTER = 0.002
"""A job on the thread this long (seconds) starts the turns."""

IDLE_GAP = 0.001
"""Between two turns when the loop did nothing else meanwhile (seconds)."""

BUSY_LATE = 50e-6
"""A look at the thread this late (seconds) means the loop was running
other callbacks meanwhile: it is busy."""


class StoreThread:
    """One worker thread that runs store calls in order, and the GIL turns
    the loop gives it (module docstring).  Use from the event loop thread."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._jobs = 0
        self._turning = False
        self._due = 0.0
        self.counts = {"jobs": 0, "turns": 0, "turn-runs": 0}
        """Jobs run; turns given; times a job waited long enough to start them."""

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on the thread, after the calls before it."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._executor, fn, *args)
        self._jobs += 1
        self.counts["jobs"] += 1
        fut.add_done_callback(self._done)
        if not self._turning:
            self._turning = True
            loop.call_later(TURN_AFTER, self._look, loop, True)
        return fut

    def _done(self, _fut: asyncio.Future[Any]) -> None:
        self._jobs -= 1

    def _look(self, loop: asyncio.AbstractEventLoop, first: bool = False) -> None:
        """(A timer, which fires up to a millisecond late by design: it
        cannot tell a busy loop.)  If a job is still on the thread, see at
        the next loop turn whether the loop is busy."""
        if not self._jobs:
            self._turning = False
            return
        if first:
            self.counts["turn-runs"] += 1
        self._due = time.perf_counter()
        loop.call_soon(self._turn, loop)

    def _turn(self, loop: asyncio.AbstractEventLoop) -> None:
        """While a job is on the thread: if this loop turn ran other
        callbacks before this one (it came late), the loop is busy: let go
        of the GIL for :data:`TURN` and come back at the next turn.  If not,
        the loop is idle and lets go of the GIL itself, waiting for events:
        only look again :data:`IDLE_GAP` later."""
        if not self._jobs:
            self._turning = False
            return
        if time.perf_counter() - self._due > BUSY_LATE:
            time.sleep(TURN)
            self.counts["turns"] += 1
            self._due = time.perf_counter()
            loop.call_soon(self._turn, loop)
        else:
            loop.call_later(IDLE_GAP, self._look, loop)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "queued": self._jobs}

    def shutdown(self) -> None:
        """Wait for the jobs under way, then end the thread."""
        self._executor.shutdown(wait=True)
