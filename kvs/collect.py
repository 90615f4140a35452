"""Online garbage collection of the content store (``kvs.gc``, ``kvbroker kvs gc``).

Every commit adds blobs and nothing removes the versions they replace, so
the store of a long-running instance only grows.  :mod:`kvs.garbage`
collects a *stopped* instance (as Flux does, offline); this collects a
running one, on rank 0, while commits, lookups and watches go on.  It is a
mark and sweep in the manner of etcd's compaction: what the instance still
reads is kept, older versions go.

**Kept**, whole: the current root of every namespace; every root published
in the last ``kvs.gc-grace`` seconds (10 s by default: a watcher or a
follower a little behind still reads the root it was told about); the
recent roots guests may name (:class:`kvs.namespaces.RecentRoots`); the
checkpoints (the KVS's current one, which a restart resumes from, as a
tree; any other as the blobrefs its value holds, as :mod:`kvs.garbage`); the root of every
commit between the store of its blobs and its setting
(:attr:`kvs.commits.CommitPipeline.unpublished`); the blobs stored under a
hold until it is released (a ``kvs restore``'s, until its commit:
:class:`broker.content.collection.Holds`); every blob stored or
named by a commit while the collection runs (a commit checks every blob
below a directory it names, :meth:`kvs.refcheck.RefChecker.check_whole`);
and every blob stored (or stored again) less than the grace period ago.
**Removed**: the rest.  A read at an older root (``kvs.lookup`` with
``rootdir``, ``kvs.diff``, ``watch_keys(since=)``) then fails with
``ENOENT``, as etcd answers a revision it compacted.

The steps (:func:`collect`):

1. the barrier (:meth:`ContentModule.begin_collection`): from here on,
   blobs stored, and blobs a commit names (``kvs.blobs.BlobFetcher.fetch(keep=True)``),
   are kept; a commit that checked its blobs before checks them again;
2. every blob stored so far is written to SQLite, so the mark can read it;
3. the roots are listed and marked, reading tree objects in batches from
   the content cache or the store (never caching them);
4. the decision: the keep set is fixed and rank 0's caches forget the rest
   (:meth:`broker.content.collection.Collection.decide`);
5. the sweep deletes unkept rows older than the grace period, a batch at a
   time, on the store's thread between its other work.

The file does not shrink (SQLite reuses the freed pages for new blobs)
unless ``compact`` is asked for: ``VACUUM`` rewrites the file and holds the
store's thread meanwhile, so every load and write-back waits for it.  It
needs room for a copy of what is kept, checked first
(:meth:`broker.content.sqlite.SqliteStore.compact_shortfall`): without it,
``ENOSPC`` once the collection is done, with nothing compacted.
"""

from __future__ import annotations

import asyncio
import errno
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Container, Iterable
from typing import Any

import msgpack

from broker.attrs import AttrSpec, duration
from broker.content import blobref
from broker.content.collection import READ_BATCH, Collection
from broker.content.module import ContentModule, store_error
from broker.errors import ErrnoError
from kvs import treeobj

GRACE = AttrSpec(
    "kvs.gc-grace", "10s", duration,
    "an online kvs gc keeps every root published, and every blob stored, this recently")
PERIOD = AttrSpec(
    "kvs.gc-period", "0", duration,
    "rank 0 runs an online kvs gc this often (0: only when asked)")
"""etcd's ``--auto-compaction-retention`` (off by default there too)."""
MAX_RECENT_ROOTS = 65536
"""Roots :class:`RootHistory` remembers at most, whatever the grace period
(a commit rate of 6,500 roots/s over 10 s): an instance committing faster
keeps a shorter history.  ~100 bytes each."""


class RootHistory:
    """Rank 0: the roots its namespaces took in the last ``grace`` seconds."""

    def __init__(self, grace: float, maxlen: int = MAX_RECENT_ROOTS) -> None:
        self.grace = grace
        self._roots: deque[tuple[float, str]] = deque(maxlen=maxlen)

    def note(self, rootref: str) -> None:
        now = time.monotonic()
        roots = self._roots
        if roots and roots[-1][1] == rootref:
            return
        roots.append((now, rootref))
        while roots[0][0] < now - self.grace:
            roots.popleft()

    def recent(self) -> list[str]:
        horizon = time.monotonic() - self.grace
        return list({ref: None for t, ref in self._roots if t >= horizon})

    def noted_recently_by(self, rootref: str, at: float) -> bool:
        """Whether ``rootref`` was noted at or before ``at`` (a monotonic
        time) and is in the grace period still: then every collection
        since ``at`` kept its blobs.  Not whether it is recent: roots are
        content-addressed, and the same rootref noted again later (the
        same tree back) says nothing of a collection in between."""
        horizon = time.monotonic() - self.grace
        return any(ref == rootref and horizon <= t <= at for t, ref in self._roots)

    def __len__(self) -> int:
        return len(self._roots)


class GcAborted(ErrnoError):
    """A collection stopped before deleting anything."""


DAMAGED_SHOWN = 10
"""Blobrefs of damage a collection's answer names at most."""


# What a reference to mark leads to: (must exist, is a tree object)
_LIVE_TREE = (True, True)
_LIVE_DATA = (True, False)
_TREE = (False, True)
_DATA = (False, False)
_OPAQUE = (False, None)  # a checkpoint's blobref: walked if it decodes


MISSING = "is named by a live tree but not in the store"
MISMATCHED = "does not match its hash"


async def mark(collection: Collection, live: Iterable[str], recent: Iterable[str],
               opaque: Iterable[str], damaged: dict[str, str] | None = None) -> set[str]:
    """Every blobref reachable from the roots ``live`` (which should be
    whole: a blob missing or a tree object that does not decode is added to
    ``damaged``, with why), from ``recent`` (kept as far as they still
    exist) and from the blobs ``opaque`` (walked if they decode as tree
    objects).  A blob read whose bytes do not match its hash is damage
    wherever it is (walked, its bytes would keep what they name, not what
    the real blob names, which would be deleted for good).

    A damaged live tree does not stop the marking; :func:`collect` then
    deletes nothing.

    A blob may be named as a value's data and as a directory too (a client
    may put either): kept as data, it is still read and walked the first
    time it comes as a tree."""
    marked: set[str] = set()
    walked: set[str] = set()  # tree objects read, their children queued
    todo: list[tuple[str, tuple[bool, bool | None]]] = [
        *((r, _OPAQUE) for r in opaque), *((r, _TREE) for r in recent),
        *((r, _LIVE_TREE) for r in live)]
    while todo:
        batch: dict[str, tuple[bool, bool | None]] = {}
        while todo and len(batch) < READ_BATCH:
            ref, kind = todo.pop()
            if kind[1] is False:  # a value's data: kept, never read
                marked.add(ref)
            elif ref not in walked and batch.get(ref, (False,))[0] is False:
                batch[ref] = kind
        if not batch:
            continue
        blobs = await collection.read(batch)
        for ref, (live_ref, is_tree) in batch.items():
            data = blobs.get(ref)
            if data is None:
                if live_ref and damaged is not None:
                    damaged[ref] = MISSING
                continue
            if not blobref.matches(ref, data):
                if damaged is not None:
                    damaged[ref] = MISMATCHED
                continue
            marked.add(ref)
            walked.add(ref)
            try:
                obj = treeobj.decode(data)
            except ErrnoError:
                if live_ref and is_tree and damaged is not None:
                    damaged[ref] = MISSING
                continue
            for child, child_is_tree in treeobj.blobrefs(obj):
                if child in walked or (not child_is_tree and child in marked):
                    continue
                if is_tree is None:
                    todo.append((child, _OPAQUE))
                elif live_ref:
                    todo.append((child, _LIVE_TREE if child_is_tree else _LIVE_DATA))
                else:
                    todo.append((child, _TREE if child_is_tree else _DATA))
        await asyncio.sleep(0)  # (a batch all from the cache never yielded)
    return marked


def checkpoint_roots(checkpoints: Iterable[tuple[str, bytes, int]],
                     kvs_key: str) -> tuple[list[str], list[str]]:
    """(trees, opaque blobrefs) the checkpoints name (``(key, value, age)``,
    as :meth:`ContentModule.checkpoints`): the KVS's current one is a root
    (``EIO`` if it is not one); its older ones name nothing (a collection
    keeps those it keeps anyway and drops the rest: :func:`stale_checkpoints`);
    any other value's blobrefs, current or older, are opaque."""
    trees: list[str] = []
    opaque: list[str] = []
    for key, raw, age in checkpoints:
        if key == kvs_key and age > 0:
            continue
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # (names nothing: kept as it is, by its row)
            continue
        if key == kvs_key:
            if not (isinstance(value, dict) and blobref.is_valid(value.get("rootref"))):
                raise GcAborted(errno.EIO, f"the checkpoint {key!r} is not a KVS root; "
                                "nothing was collected")
            trees.append(value["rootref"])
        else:
            opaque += blobref.found_in(value)
    return trees, opaque


def stale_checkpoints(history: Iterable[tuple[int, bytes]], kept: Container[str]) -> list[int]:
    """The row ids of the older KVS checkpoints (``(id, value)``) whose root
    is not in ``kept``: a collection deletes their trees, so they go from
    the list too.  Those it keeps anyway -- the current root's, and those of
    the last ``kvs.gc-grace`` seconds, whose trees are kept whole -- stay,
    to roll back to.  A value that is not a KVS root goes."""
    stale: list[int] = []
    for row_id, raw in history:
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:
            value = None
        ref = value.get("rootref") if isinstance(value, dict) else None
        if not (isinstance(ref, str) and ref in kept):
            stale.append(row_id)
    return stale


class Roots:
    """What a collection starts from, listed by the kvs module."""

    def __init__(self, live: list[str], recent: list[str]) -> None:
        self.live = live
        self.recent = recent


async def collect(content: ContentModule, roots: Callable[[], Roots],
                  forget: Callable[[set[str]], None], kvs_key: str, *,
                  grace: float, compact: bool = False) -> dict[str, Any]:
    """Run one online collection (module docstring).

    ``roots()`` lists the :class:`Roots` to keep, ``forget(keep)`` drops
    the rest from the kvs module's own cache at the decision.  Returns what ``kvs.gc``
    answers.  ``EBUSY`` if a collection runs already."""
    start = time.monotonic()
    collection = content.begin_collection()
    damaged: dict[str, str] = {}
    try:
        await content.drain()
        # Young rows are spared: rowids written up to grace seconds ago, and
        # blobs stored again meanwhile (their rows are older)
        watermark = content.rowids.as_of(grace)
        collection.touch(content.restored.since(grace))
        # and blobs stored under a hold (a restore's, until its commit)
        collection.touch(content.holds.refs())
        listed: Roots = roots()
        trees, opaque = checkpoint_roots(await content.checkpoints(), kvs_key)
        marked = await mark(collection, [*listed.live, *trees], listed.recent, opaque, damaged)
        # The checkpoints once more: one written meanwhile names a root made
        # during the collection (whole: kept by the barrier) -- unless the
        # owner named an older one; mark that too.
        trees2, opaque2 = checkpoint_roots(await content.checkpoints(), kvs_key)
        marked |= await mark(collection, [r for r in trees2 if r not in marked], (),
                             [r for r in opaque2 if r not in marked], damaged)
        # The older checkpoints as they are now (one written from here on
        # retires a root this collection keeps: it stays)
        history = await content.checkpoint_history_rows(kvs_key)
        if damaged:
            # As offline: a live tree names a blob the store lacks.  Commits
            # check what they name, so this is damage, and below it may be
            # blobs that are there but unreachable from here (a missing root
            # made every blob look like garbage): delete nothing.
            first, why = next(iter(damaged.items()))
            raise ErrnoError(errno.EIO, f"blob {first} {why} ({len(damaged)} such): the store "
                                        "is damaged; nothing was deleted")
        collection.decide(marked)  # (no await between these two)
        forget(collection.keep)
        # (before the sweep: a crash between the two leaves no row naming a
        # deleted tree, only one fewer version to roll back to)
        dropped = await content.drop_checkpoint_history(
            stale_checkpoints(history, collection.keep))
        await collection.sweep(watermark)
        assert content.backing is not None
        shortfall = None
        if compact:
            # (refused up front without the room: half-way, it took every
            # free byte of the file system until it failed)
            try:
                shortfall = await content.db(content.backing.compact_if_room)
            except sqlite3.Error as exc:
                raise store_error(exc, "compacting the content store (the collection itself "
                                  "was done; nothing was lost)") from None
        file_bytes, free_bytes = await content.db(content.backing.file_bytes)
        # the room made counts at once: writes refused for want of it resume
        await content.measure_disk()
    except sqlite3.Error as exc:
        raise store_error(exc, "collecting garbage") from None
    finally:
        content.end_collection(collection)
    if shortfall is not None:
        raise ErrnoError(errno.ENOSPC, f"{shortfall}: the store was not compacted. The "
                         f"collection itself was done ({collection.removed} blobs, "
                         f"{collection.removed_bytes} bytes removed): the {free_bytes} bytes "
                         "of free pages in content.sqlite are reused for new blobs, and count "
                         "as room for content.disk-reserve-bytes. To compact, make that room "
                         "(remove other files there, or restart rank 0 with $SQLITE_TMPDIR on "
                         "a file system with room for the temporary copy), then run kvs gc "
                         "--compact again; or go on without compacting")
    return {
        "roots": len({*listed.live, *listed.recent, *trees, *opaque}),
        "kept": len(collection.keep),
        "removed": collection.removed,
        "removed-bytes": collection.removed_bytes,
        "damaged": list(damaged)[:DAMAGED_SHOWN],
        "damaged-count": len(damaged),
        "file-bytes": file_bytes,
        "free-bytes": free_bytes,
        "compacted": compact,
        "grace": grace,
        "checkpoints-dropped": dropped,
        "seconds": round(time.monotonic() - start, 6),
    }


__all__ = ["GRACE", "PERIOD", "GcAborted", "RootHistory", "Roots", "checkpoint_roots", "collect",
           "mark", "stale_checkpoints"]
