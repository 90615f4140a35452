"""Expiry by age for a rank's caches, at no cost per use.

A rank's caches (the content cache, the kvs module's blob store and its
decoded tree objects) are LRUs kept in ``OrderedDict``\\ s: a use moves its
key to the end, so the dict is in order of last use.  Bounded by size alone,
they kept what a burst brought in for as long as the rank lived: an idle
follower stayed at ~200 MB after a soak.  Flux expires cache entries unused
for 10 s (its kvs module) or trims old ones beyond a target size (its
content cache), driven by the heartbeat.

Stamping every use with its time would cost every read.  Instead, every
``expire / MARKS`` seconds the owner puts a *mark* at the end of the dict: a
key no blobref can be.  Every entry in front of a mark was last used before
the mark was put; when a mark is :data:`MARKS` periods old, what is in front
of it has not been used for ``expire`` seconds, and goes, and the mark with
it.  An entry is so expired between ``expire`` and ``expire * (1 + 1 /
MARKS)`` seconds after its last use.

A mark its owner cannot or need not expire up to (a content cache at its
floor, an entry rank 0 has not written yet at the front) is simply taken out:
what was in front of it then counts as no older than the next mark, so
entries are expired later than their age says, never earlier.  A mark that
an LRU trim or a ``dropcache`` evicted with the entries in front of it needs
nothing more (:meth:`AgeMarks.due` skips it).  The owner accounts for a
mark's entry as for any other (a mark's value is empty).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

MARKS = 8
"""Marks in a cache at once: an entry goes at most ``1 / MARKS`` of the
expiry after its age is reached, for a wake-up of the rank every
``expire / MARKS`` seconds."""
MIN_EXPIRE = 0.1
"""The shortest expiry but 0 (never), in seconds: the owner wakes every
``expire / MARKS``, used or not."""
MARK_PREFIX = "\x00age-mark-"
"""A mark's key: blobrefs are ``HASH-HEX`` text, never this."""


def expire_seconds(value: Any) -> float:
    """An attribute's expiry: 0 (never) or at least :data:`MIN_EXPIRE`."""
    from broker.attrs import duration

    seconds = duration(value)
    if 0 < seconds < MIN_EXPIRE:
        raise ValueError(f"{value!r} is under {MIN_EXPIRE:g}s (the rank would wake every "
                         f"{seconds / MARKS:g}s to expire its cache); 0 never expires")
    return seconds


class AgeMarks:
    """The marks put in one ``OrderedDict`` LRU, oldest first."""

    def __init__(self) -> None:
        self._marks: deque[str] = deque()
        self._made = 0
        self.expired = 0
        """Entries taken out by age, for the owner's stats."""

    def put(self, lru: OrderedDict[str, Any], value: Any) -> None:
        """Put a new mark at the end of ``lru`` (as the newest entry, with
        ``value``: the owner accounts for it)."""
        self._made += 1
        mark = f"{MARK_PREFIX}{self._made}"
        lru[mark] = value
        self._marks.append(mark)

    def due(self, lru: OrderedDict[str, Any]) -> Iterator[str]:
        """The marks now :data:`MARKS` periods old and still in ``lru``,
        oldest first; each is forgotten here (the owner expires up to it,
        then takes it out of ``lru``)."""
        marks = self._marks
        while len(marks) > MARKS:
            mark = marks.popleft()
            if mark in lru:
                yield mark

    def expire(self, lru: OrderedDict[str, Any],
               forget: Callable[[str, Any], object]) -> int:
        """Take out of ``lru`` what is in front of each mark now due, and
        the mark, calling ``forget(key, value)`` for each (the mark last:
        the owner's bookkeeping).  Returns how many entries (not marks)
        went, also added to :attr:`expired`.  For an owner that may let all
        of them go (the content cache keeps a floor: its own loop)."""
        gone = 0
        for mark in self.due(lru):
            while True:
                key, value = lru.popitem(last=False)
                forget(key, value)
                if key == mark:
                    break
                gone += 1
        self.expired += gone
        return gone

    def live(self, lru: OrderedDict[str, Any]) -> int:
        """Marks in ``lru`` now (its entries that are not the owner's)."""
        return sum(1 for mark in self._marks if mark in lru)

    def clear(self) -> None:
        """The LRU was emptied: no mark is in it any more."""
        self._marks.clear()


def is_mark(key: str) -> bool:
    """Whether ``key`` of an LRU is a mark, not an entry of its owner."""
    return key.startswith(MARK_PREFIX)


def restart_expiry(running: asyncio.Task[Any] | None, expire: float,
                   age: Callable[[], object],
                   spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[Any]],
                   ) -> asyncio.Task[Any] | None:
    """A module's expiry task at a new ``expire``: the ``running`` one
    cancelled, a new one spawned (``spawn``: the module's, cancelled at its
    stop) calling ``age`` every ``expire / MARKS`` seconds; none for 0."""
    if running is not None:
        running.cancel()
    return spawn(_expire_periodically(expire, age)) if expire > 0 else None


async def _expire_periodically(expire: float, age: Callable[[], object]) -> None:
    """Call ``age`` (the owner's caches put a mark and expire what is due)
    every ``expire / MARKS`` seconds, until cancelled."""
    period = expire / MARKS
    while True:
        await asyncio.sleep(period)
        age()
