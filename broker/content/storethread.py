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

The remedy is a turn, for work someone waits on: a checkpoint (a ``SYNC``
commit's, the periodic one), a flush, a client's read that missed the cache, a writer held
back by the write-back backlog (:meth:`StoreThread.run` with ``urgent``,
:meth:`StoreThread.hurry`).  When such a wait has lasted
:data:`TURN_AFTER`, the loop looks whether it is busy: a look asked for at
once (``call_soon``) that runs late found other callbacks first.  If so it
blocks for :data:`TURN` (``time.sleep``, which lets go of the GIL: ~85 us
here, with the kernel's timer slack), so the thread takes the GIL at once,
and looks again at the next loop turn, until the wait ends.  If the loop is
idle it gives no turn -- waiting for events, it lets go of the GIL itself --
and looks again :data:`IDLE_GAP` later.  A wait that ends sooner costs
nothing, and neither does the disk work (SQLite runs without the GIL).
Background work gets no turns: with them, a garbage collection took the
commits beside it from ~0.9x to ~0.6x of their rate alone, and finished no
sooner.  Measured by ``benchmarks/run.py Wsync`` (uvloop, alternated runs
against the code before; docs/performance.md): ``SYNC`` commits beside a
churning client 12-13 ms p50 and 16-20 p90, against 19-47 and 68-116.
The counts are in ``kvbroker stats content`` (``sqlite-thread``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

TURN = 30e-6
"""How long the loop lets go of the GIL at each turn (seconds)."""

TURN_AFTER = 0.002
"""A wait on the thread this long (seconds) starts the turns."""

IDLE_GAP = 0.001
"""Between two turns when the loop did nothing else meanwhile (seconds)."""

BUSY_LATE = 50e-6
"""A look at the thread this late (seconds) means the loop was running
other callbacks meanwhile: it is busy."""


class StoreThread:
    """One worker thread that runs store calls in order, and the GIL turns
    the loop gives it while someone waits on it (module docstring).  Use
    from the event loop thread."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._jobs = 0
        self._waiters = 0
        self._turning = False
        self._due = 0.0
        self.counts = {"jobs": 0, "turns": 0, "turn-runs": 0}
        """Jobs run; turns given; times a wait lasted long enough to start them."""

    def run(self, fn: Callable[..., T], *args: Any, urgent: bool = False) -> asyncio.Future[T]:
        """``fn(*args)`` on the thread, after the calls before it; ``urgent``:
        someone waits for it (a client, a ``SYNC`` commit), so the thread
        gets turns until it is done -- the jobs before it too.  Background
        work (write-back on a timer, a garbage collection) is not: given
        turns, a collection took half of one writer's commit rate where it
        had taken a fifth."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        self._jobs += 1
        self.counts["jobs"] += 1
        fut.add_done_callback(self._done)
        if urgent:
            self._wait_begins()
            fut.add_done_callback(self._wait_ends)
        elif self._waiters:
            self._start()
        return fut

    @contextlib.contextmanager
    def hurry(self) -> Iterator[None]:
        """Turns while the block runs: for a caller that waits on jobs
        already under way (a flush waits for the write-backs)."""
        self._wait_begins()
        try:
            yield
        finally:
            self._wait_ends()

    def _done(self, _fut: asyncio.Future[Any]) -> None:
        self._jobs -= 1

    def _wait_begins(self) -> None:
        self._waiters += 1
        self._start()

    def _start(self) -> None:
        if not self._turning:
            self._turning = True
            asyncio.get_running_loop().call_later(TURN_AFTER, self._look, True)

    def _wait_ends(self, _fut: object = None) -> None:
        self._waiters -= 1

    def _look(self, first: bool = False) -> None:
        """(A timer, which fires up to a millisecond late by design: it
        cannot tell a busy loop.)  If someone still waits on the thread, see
        at the next loop turn whether the loop is busy."""
        if not (self._waiters and self._jobs):
            self._turning = False
            return
        if first:
            self.counts["turn-runs"] += 1
        self._due = time.perf_counter()
        asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        """If this look came late, other callbacks ran first: the loop is
        busy, so let go of the GIL for :data:`TURN` and look again at the
        next loop turn.  If not, the loop is idle and lets go of the GIL
        itself, waiting for events: look again :data:`IDLE_GAP` later."""
        if not (self._waiters and self._jobs):
            self._turning = False
            return
        if time.perf_counter() - self._due > BUSY_LATE:
            time.sleep(TURN)
            self.counts["turns"] += 1
            self._due = time.perf_counter()
            asyncio.get_running_loop().call_soon(self._turn)
        else:
            asyncio.get_running_loop().call_later(IDLE_GAP, self._look)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "queued": self._jobs, "waiters": self._waiters}

    def shutdown(self) -> None:
        """Wait for the jobs under way, then end the thread."""
        self._executor.shutdown(wait=True)
