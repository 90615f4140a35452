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

The remedy is a turn: when a job has been on the thread longer than
:data:`TURN_AFTER`, the loop blocks for :data:`TURN` once per loop turn
(``time.sleep``, which lets go of the GIL) until the thread's jobs are done,
and the thread gets the GIL at once.  A job that finishes sooner costs
nothing, and neither does the disk work itself (SQLite runs without the
GIL): only a thread that is kept waiting gets turns.  If the loop has
nothing else to do between two turns, the next comes :data:`IDLE_GAP`
later instead of at once -- an idle loop lets go of the GIL anyway, and
turns one after another would keep it spinning.  Measured with that
churning client, uvloop (same session): ``SYNC`` commits 6.6 ms p50 and
8.8 p90 against 47-76 and 97-148 without turns, with as many namespaces
churned; W2 and W2p unchanged (20 and 14 turns in a whole run).  The
counts are in ``kvbroker stats content`` (``sqlite-thread``).
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

_BUSY_MARGIN = 100e-6
"""More time than this between two turns, beyond what was planned, means
the loop ran other callbacks meanwhile: it is busy."""


class StoreThread:
    """One worker thread that runs store calls in order, and the GIL turns
    the loop gives it (module docstring).  Use from the event loop thread."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._jobs = 0
        self._turning = False
        self._last = 0.0
        self._planned = 0.0
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
            self._last, self._planned = time.perf_counter(), TURN_AFTER
            loop.call_later(TURN_AFTER, self._turn, loop, True)
        return fut

    def _done(self, _fut: asyncio.Future[Any]) -> None:
        self._jobs -= 1

    def _turn(self, loop: asyncio.AbstractEventLoop, first: bool = False) -> None:
        """Let go of the GIL for :data:`TURN` while a job is on the thread."""
        if not self._jobs:
            self._turning = False
            return
        if first:
            self.counts["turn-runs"] += 1
        now = time.perf_counter()
        busy = now - self._last > self._planned + _BUSY_MARGIN
        time.sleep(TURN)
        self.counts["turns"] += 1
        self._last = time.perf_counter()
        if busy:
            self._planned = 0.0
            loop.call_soon(self._turn, loop)
        else:
            self._planned = IDLE_GAP
            loop.call_later(IDLE_GAP, self._turn, loop)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "queued": self._jobs}

    def shutdown(self) -> None:
        """Wait for the jobs under way, then end the thread."""
        self._executor.shutdown(wait=True)
