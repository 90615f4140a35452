"""Rank 0's side of an online garbage collection: what the content store
must do so that blobs can be deleted while commits go on.

The KVS decides what is reachable (:mod:`kvs.collect` marks the trees);
this module keeps that decision true while it is carried out:

* **A barrier.**  From :meth:`ContentModule.begin_collection` on, every blob
  stored (and every blob the KVS checks before a commit names it, see
  :meth:`touch`) is kept, whatever the mark found.  A commit that lands
  during the collection builds its tree from the root it replaces (marked,
  or itself built during the collection), its own new blobs (stored: kept)
  and the blobrefs its client named (checked, to the last blob below
  them: kept), so every root made during the collection stays whole.
* **Young blobs.**  Rows whose blobs were stored less than the grace
  period ago are never deleted (the store's rowids only grow:
  :meth:`SqliteStore.max_rowid`; a row is as young as the newest store of
  the batch that wrote it, :attr:`ContentModule.last_stored`), nor blobs
  stored again in that time (:class:`RecentRefs`: their row is older), so
  a blob stored by ``content.store`` and committed soon after survives a
  collection that runs in between.
* **The decision** (:meth:`decide`) is made in one step on the event loop:
  the keep set is fixed and the caches let go of everything outside it.
  From then on a load vouches for a blob (is cached, or shared with a later
  request) only if the blob was kept when the load began
  (:meth:`ContentModule.load_token`): a load that began earlier may read a
  row just before its deletion.
* **The deletion** (:meth:`sweep`) reads existing rows a batch at a time on
  the store's one thread, picks the unkept ones on the loop and queues
  their deletion in the same step, so loads and write-backs run between
  batches, and a blob kept later (stored again, checked by a commit) is
  either spared or asked for after its deletion, and found missing.
"""

from __future__ import annotations

import errno
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from broker.errors import ErrnoError

if TYPE_CHECKING:
    from broker.content.module import ContentModule

SWEEP_ROWS = 8192
"""Rows of the store examined per deletion transaction (a few ms of the
SQLite thread, so loads and write-backs wait no longer than that)."""
READ_BATCH = 512
"""Tree objects the mark reads from the store per trip to its thread."""
MARK_SPAN = 3600.0
"""Seconds of write-back history kept for the young-rows rule: the longest
grace period a collection can honour."""


class RowidMarks:
    """When the store's rowids reached what: ``[first time, last time, max
    rowid]``, the writes of one second in one mark, over the last
    :data:`MARK_SPAN` seconds."""

    def __init__(self) -> None:
        self._marks: deque[list[float]] = deque()

    def note(self, rowid: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        marks = self._marks
        if marks and now - marks[-1][0] < 1.0:
            last = marks[-1]
            last[1] = now  # (the mark is as old as its newest write)
            last[2] = max(rowid, last[2])
        else:
            marks.append([now, now, rowid])
        while len(marks) > 1 and marks[1][1] <= now - MARK_SPAN:
            marks.popleft()

    def as_of(self, age: float, now: float | None = None) -> int:
        """The highest rowid known written ``age`` seconds ago (0: none):
        every row at or below it is at least that old."""
        now = time.monotonic() if now is None else now
        best = 0
        for _first, last, rowid in self._marks:
            if last > now - age:
                break
            best = int(rowid)
        return best


class RecentRefs:
    """Refs with the time they were noted, kept for ``span`` seconds: the
    blobs stored again while their row already existed (the row keeps its
    old rowid, so :class:`RowidMarks` cannot tell they are young)."""

    def __init__(self, span: float = 10.0) -> None:
        self.span = span
        self._log: deque[tuple[float, list[str]]] = deque()

    def note(self, refs: list[str], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._log.append((now, refs))
        while self._log and self._log[0][0] < now - self.span:
            self._log.popleft()

    def since(self, age: float, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {ref for t, refs in self._log if t >= now - age for ref in refs}


HOLD_LEASE = MARK_SPAN
"""Seconds a hold (:class:`Holds`) outlives its last store when it is not
released: what a client that died before releasing it costs."""


class Holds:
    """Blobs stored under a *hold* (``content.store`` with ``hold: ID``):
    every collection keeps them, however old, until the hold is released
    (``release: true``) or :data:`HOLD_LEASE` passes without a store under
    it.  For a client that stores many blobs over a long time before one
    commit names them all (``kvs restore``): the grace period keeps a blob
    only so long after its store, and a collection in between would delete
    the first ones, failing the commit."""

    def __init__(self, lease: float = HOLD_LEASE) -> None:
        self.lease = lease
        self._holds: dict[str, tuple[float, set[str]]] = {}

    def add(self, hold: str, refs: Iterable[str], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._expire(now)
        entry = self._holds.pop(hold, None)  # (re-inserted: oldest use first)
        held = entry[1] if entry is not None else set()
        held.update(refs)
        self._holds[hold] = (now, held)

    def release(self, hold: str) -> None:
        self._holds.pop(hold, None)

    def refs(self, now: float | None = None) -> set[str]:
        """Every blob held now."""
        self._expire(time.monotonic() if now is None else now)
        return {ref for _, held in self._holds.values() for ref in held}

    def _expire(self, now: float) -> None:
        holds = self._holds
        while holds:
            hold, (used, _) = next(iter(holds.items()))
            if used > now - self.lease:
                break
            del holds[hold]

    def __len__(self) -> int:
        return len(self._holds)


class Collection:
    """One online collection, from its barrier to the end of its sweep."""

    def __init__(self, content: ContentModule) -> None:
        self.content = content
        self.keep: set[str] = set()
        """Blobrefs kept: touched since the barrier, and the marked once decided."""
        self.decided = False
        self.removed = 0
        self.removed_bytes = 0

    # ------------------------------------------------------------ barrier

    def touch(self, refs: Iterable[str]) -> None:
        """Keep ``refs``: stored, or about to be named by a commit."""
        self.keep.update(refs)

    def may_cache(self, ref: str) -> bool:
        """Whether a load of ``ref`` that starts now may cache what it reads
        (asked when it starts; the :attr:`ContentModule.generation` must not
        change before it ends): not if the sweep may delete it.  A blob
        kept by then is safe: a deletion that could still take it was
        queued before this load, which then finds nothing."""
        return not self.decided or ref in self.keep

    # ------------------------------------------------------------ mark support

    async def read(self, refs: Iterable[str]) -> dict[str, bytes]:
        """The blobs of ``refs`` that exist, for the mark: from the cache
        (and what waits to be written), else from the store, without
        caching them."""
        content = self.content
        found: dict[str, bytes] = {}
        missing: list[str] = []
        for ref in refs:
            data = content.cache.get(ref)
            if data is None:  # (not `or`: an empty blob is a blob)
                data = content.dirty.get(ref)
                if data is None:
                    data = content.inflight.get(ref)
            if data is None:
                missing.append(ref)
            else:
                found[ref] = data
        if missing:
            assert content.backing is not None
            found.update(await content.db(content.backing.get_many, missing))
        return found

    # ------------------------------------------------------------ decision

    def decide(self, marked: set[str]) -> None:
        """Fix the keep set (touched + ``marked``) and make every cache of
        this rank forget the rest: run without yielding to the loop."""
        self.keep |= marked
        self.decided = True
        self.content.forget_unkept(self.keep)

    # ------------------------------------------------------------ sweep

    async def sweep(self, watermark: int) -> None:
        """Delete every row at or below rowid ``watermark`` that is not kept.

        A range of rows is read on the store's thread, the unkept ones are
        picked here, and their deletion is queued in the same step of the
        loop: a blob kept later (stored again, named by a commit) is either
        picked no more, or asked for after its deletion, in order, and
        found missing -- never vouched for and then deleted."""
        content = self.content
        store = content.backing
        assert store is not None and self.decided
        after = 0
        while True:
            rows = await content.db(store.scan_rows, after, watermark, SWEEP_ROWS)
            if not rows:
                break
            after = rows[-1][0]
            doomed = [(key, size) for _rowid, key, ref, size in rows if ref not in self.keep]
            if doomed:
                await content.db(store.delete_keys, [key for key, _ in doomed])
                self.removed += len(doomed)
                self.removed_bytes += sum(size for _, size in doomed)
            if len(rows) < SWEEP_ROWS:
                break


def busy() -> ErrnoError:
    return ErrnoError(errno.EBUSY, "a garbage collection is already running")


__all__ = ["HOLD_LEASE", "Collection", "Holds", "RecentRefs", "RowidMarks", "busy"]
