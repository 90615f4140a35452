"""The ``content`` module: content-addressed blobs, cached on every rank.

* ``content.store`` ``{data}`` -> ``{blobref}`` (or ``{blobs: [data...]}`` ->
  ``{blobrefs}``; both at once is ``EPROTO``, as is a load of both forms):
  the blob enters this rank's cache and is written through to the parent
  before the answer, so rank 0 always holds every blob.
* ``content.load`` ``{blobref}`` -> ``{data}``: from the cache, else from
  upstream (rank != 0) or the SQLite backing store (rank 0); ``ENOENT`` if
  no one has it.  ``{blobrefs: [...]}`` -> ``{data: [...]}`` loads many at
  once (a kvbroker extension): each entry is the blob, or ``[errnum,
  errstr]`` for one that failed, and the answer may stop short of the list
  (at ``LOAD_BYTES``) -- ask again for the rest.  A follower asks its parent
  for the misses of a loop turn this way, so a cold read of a value of many
  blobs (a long eventlog) costs a message per batch, not per blob and hop.
* Rank 0 writes new blobs back to SQLite in batches, on a worker thread so
  the event loop never waits for the disk (SQLite releases the GIL).  With
  a statedir, within ``FLUSH_DELAY`` of their arrival (or ``FLUSH_BLOBS``
  at a time); without one, only to make room: the file lives in the run
  directory and goes with it, so nothing needs a blob on disk until the
  cache is over ``content.cache-bytes`` (then the oldest are written,
  ``FLUSH_BLOBS`` at a time, and can be evicted).  ``content.flush``
  forces every batch out and makes them durable, either way.
* Back-pressure: while more than ``content.backlog-bytes`` of stored blobs
  wait for their write to SQLite, rank 0's commits and stores wait
  (:meth:`ContentModule.room`) -- memory stays bounded when commits come
  faster than the disk takes them, and a failing disk fails them with its
  errno instead of growing the backlog for ever.
* Free-space reserve (rank 0 with a statedir, as etcd's backend quota and
  its NOSPACE alarm): while the room for the store -- free space on the
  statedir's file system plus the store's free pages, less its WAL and
  what waits to be written -- is below ``content.disk-reserve-bytes``,
  stores of blobs are refused with ``ENOSPC`` (:meth:`ContentModule.refusal`;
  the kvs module refuses commits that add data the same way, not unlinks).  What
  only deletes or records roots (unlinks, collections, checkpoints) goes
  on in the reserve, so a store that filled its disk can be shrunk while
  it runs, and writes resume by themselves once there is room.  The free
  space is measured once a second and every :data:`MEASURE_BYTES` written
  (:meth:`ContentModule.measure_disk`), not at every commit.
* ``content.checkpoint-put`` / ``-get`` ``{key, value}`` (Flux's ``{value}``
  alone: the KVS's checkpoint, :func:`_flux_checkpoint`, refused ``EBUSY``
  while the kvs module runs): small named roots
  kept by rank 0 (KVS uses them to resume after a restart), with the
  values each replaced, ``content.max-checkpoints`` in all, listed by
  ``content.checkpoint-list`` (as Flux's content-sqlite keeps 5): older
  roots to roll back to, until a garbage collection deletes their trees
  (:func:`kvs.collect.stale_checkpoints`).
* ``content.dropcache`` drops clean cache entries; ``content.stats-get``.

Blobs larger than ``content.blob-size-limit`` bytes are refused with EFBIG.
Every request is for the instance owner (and modules) only: a guest could
otherwise load any blob by its blobref and read every namespace -- or, from
``content.stats-get``'s counts around a commit of its own, tell whether a
blob it guesses is stored already (a stored blob is not counted again), and
so read small values of others by trying them.  Others get EPERM.  (Flux
lets guests read the stats.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import itertools
import logging
import os
import sqlite3
import stat
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, ClassVar, TypeVar

from broker import __version__, malloc
from broker.agemarks import AgeMarks, expire_seconds, restart_expiry
from broker.attrs import CONTENT_HASH, LINK_MAX_MESSAGE, AttrSpec, integer, text
from broker.content import blobref, storefile
from broker.content.collection import Collection, Holds, RecentRefs, RowidMarks, busy
from broker.content.kvsroot import is_kvs_root
from broker.content.sqlite import (
    DEFAULT_CHECKPOINTS_KEPT,
    MAX_CHECKPOINTS_KEPT,
    STORE_FILE,
    Row,
    SqliteStore,
    StoreLocked,
    Written,
    lasting,
)
from broker.content.storethread import StoreThread
from broker.errors import ErrnoError, LastFailure, LastingFault, ProtocolError, outcome_read
from broker.logring import LogThrottle
from broker.message import NODEID_UPSTREAM, Message
from broker.module import Handler, Module, require

DEFAULT_BLOB_LIMIT = 512 << 20
MIN_BLOB_LIMIT = 256
"""Smaller limits are refused: the KVS stores its own directories as blobs
(the empty root is 21 bytes, a directory of one small value 46), so an
instance with less could not start or would refuse nearly every commit."""
MAX_BLOB_LIMIT = 999_999_000
"""Larger limits are refused: rank 0 writes every blob to SQLite, whose rows
hold at most 1,000,000,000 bytes (``SQLITE_MAX_LENGTH``), the blob's key and
the row's header included (1,000 bytes of room for them).  A blob past that was
acknowledged, then failed every write-back ("string or blob too big") and,
retried with each batch, every commit after it until the rank stopped."""
DEFAULT_CACHE_BYTES = 64 << 20
"""Per-rank cache of blobs (attr ``content.cache-bytes``); blobs not yet written
back are never evicted."""
BLOB_SIZE_LIMIT = AttrSpec(
    "content.blob-size-limit", str(DEFAULT_BLOB_LIMIT),
    integer(MIN_BLOB_LIMIT, "the KVS could not store its own directories", MAX_BLOB_LIMIT),
    "larger blobs are refused with EFBIG (at most 999999000: SQLite's largest row)")
BLOB_OVERHEAD = 256
"""Bytes a cached blob costs beyond its data (its key, the bytes object,
the LRU's node), counted against the cache limits: 16-byte blobs cost
~300 B of memory each, so counting data alone let a 64 MiB cache of tiny
blobs take 1.1-1.4 GiB."""

CACHE_BYTES = AttrSpec(
    "content.cache-bytes", str(DEFAULT_CACHE_BYTES), integer(0),
    "per-rank content cache size (bytes)")
CACHE_EXPIRE = AttrSpec(
    "content.cache-expire", "10s", expire_seconds,
    "blobs unused this long leave the content cache while it is over "
    "content.cache-keep-bytes (a duration; 0: only when content.cache-bytes is reached)")
CACHE_KEEP_BYTES = AttrSpec(
    "content.cache-keep-bytes", str(16 << 20), integer(0),
    "expiry by age leaves the content cache at least this big (bytes)")
"""Flux's content cache purges its entries older than 10 s
(``purge-old-entry``) while it is over 16 MiB (``purge-target-size``), at
each heartbeat: an idle follower gives back what a burst of loads brought
in, and keeps the most recent for its next reads and its children
(:mod:`broker.agemarks`).  Blobs rank 0 has not written back yet never
go."""
BACKLOG_BYTES = AttrSpec(
    "content.backlog-bytes", str(256 << 20), integer(0),
    "rank 0: commits and stores wait while more than this many bytes of blobs "
    "wait for their write to SQLite (0: no limit)")
DEFAULT_DISK_RESERVE = 64 << 20
"""``content.disk-reserve-bytes=auto`` (the default) keeps this much free on
the statedir's file system, or :data:`DISK_RESERVE_FRACTION` of it if that is
less.  What the reserve must hold is what still writes once adding is
refused: SQLite's WAL, which grows to a write-back transaction
(:data:`WRITE_BYTES`) plus what its auto-checkpoint lets pile up (1,000
pages, ~4 MiB) before it is reused; the blobs already accepted (the
backlog, estimated in); the directory blobs of unlink commits (a few kB
each); a collection's deletions (short transactions whose freed pages are
not rewritten: ``secure_delete`` off) and checkpoint rows.  64 MiB holds
that several times over, and is nothing on a disk of a real deployment."""
DISK_RESERVE_FRACTION = 20
"""...capped at 1/20 (5%) of the file system's size when that is smaller, so
a small disk (a 20 MB test tmpfs keeps 1 MB) is not refused from the start."""
WHERE_TO_SET = "to kvbroker start, or to rank 0's kvbroker broker"
"""Where a refusal for space says the reserve and the quota are set: both
are fixed at start, and an instance across hosts has no ``kvbroker start``
(its bootstrap file's ``[attrs]`` take them too, but ``-S`` wins)."""
DISK_CHECK_PERIOD = 1.0
"""Seconds between two measures of the free space (one ``statvfs``, two
``stat`` and a ``PRAGMA`` on the SQLite thread): between them the bytes of
the blobs accepted since are subtracted from the last measure, so the commit
path never makes a system call for it -- and room made from outside (a file
removed) is seen within this long."""
MEASURE_BYTES = 1 << 20
"""...and once this many bytes were written since the last measure: the
estimate counts what is accepted twice (the WAL, then the file) until a
measure sees what it really took, so a burst of big commits on a small disk
was refused early for up to a second (at 8 MB of a 20 MB disk)."""

SMALL_STORE = 1024
"""A ``content.store`` of at most this many bytes in all is accepted below
the reserve, which holds it as it holds an unlink's directories: the KVS
stores a new namespace's empty root (21 bytes) that way, at start too -- a
restart on a disk below the reserve must not fail."""
SMALL_STORE_BUDGET = 64 << 10
"""...up to this many bytes of blobs new to the store, while it refuses
(from the moment it starts refusing until writes are accepted again): the
empty root is one blob, stored again and again, but a client looping on
small stores of new blobs filled the disk the reserve was keeping."""


def reserve_bytes(value: Any) -> int | None:
    """``content.disk-reserve-bytes``: ``auto`` (None: :data:`DEFAULT_DISK_RESERVE`,
    capped) or a number of bytes (``0``: no reserve)."""
    if isinstance(value, str) and value.strip() == "auto":
        return None
    parsed: int = integer(0)(value)
    return parsed


DISK_RESERVE = AttrSpec(
    "content.disk-reserve-bytes", "auto", reserve_bytes,
    "rank 0 with a statedir: while the statedir's file system has less than this "
    "free (free pages of the store count), commits and stores that add data are "
    "refused with ENOSPC; unlinks, kvs gc and checkpoints still work (auto: "
    "64 MiB, at most 5% of the file system; 0: no reserve)")
STORE_QUOTA = AttrSpec(
    "content.store-quota-bytes", "0", integer(0),
    "rank 0 with a statedir: while the store's data (its file less its free pages, "
    "plus what waits to be written) is over this many bytes, commits and stores "
    "that add data are refused with ENOSPC, as below the reserve (0: no quota)")
MAX_CHECKPOINTS = AttrSpec(
    "content.max-checkpoints", str(DEFAULT_CHECKPOINTS_KEPT),
    integer(1, "the current checkpoint is always kept", MAX_CHECKPOINTS_KEPT),
    "rank 0: checkpoints of a key its store keeps, the current one included "
    "(kvbroker content checkpoint list; 1: only the current; at most 100)")
"""At most :data:`MAX_CHECKPOINTS_KEPT`: ``content.checkpoint-list`` answers
them all in one message, and a KVS checkpoint carries its leases."""
DUMP = AttrSpec("content.dump", "", text,
                "rank 0: at stop, dump the KVS checkpoint to this archive (auto: "
                "STATEDIR/dump/DATE.tgz and a RESTORE link to it), as Flux's")
RESTORE = AttrSpec("content.restore", "", text,
                   "rank 0: at start, empty the store and restore this archive into it "
                   "(auto: what STATEDIR/dump/RESTORE names, if it exists), as Flux's")
"""Applied by :mod:`kvs.dumps` (the archive code is the KVS's), with the
store closed: before :meth:`ContentModule.start` opens it, after
:meth:`ContentModule.stop` closed it."""
STATS_WAIT = 2.0
"""Seconds ``content.stats-get`` waits for the SQLite thread's figures
before answering without them (:meth:`ContentModule._store_figures`)."""
FAILURE_LOG_EVERY = 60.0
"""Seconds between two ERROR lines of a write to SQLite that keeps failing
(the overlay's refused handshakes are logged as seldom)."""

FLUSH_DELAY = 0.1
"""Rank 0 writes new blobs back to SQLite at most this long after they arrive...
"""
WRITE_BYTES = 4 << 20
"""A write-back batch is cut into SQLite transactions of about this many
bytes, each subtracted from the backlog when it is written: a stop that
writes a backlog of 256 MiB shows its progress (:meth:`ContentModule.left_to_write`)
every few MiB, not once at the end."""
FLUSH_BLOBS = 4096
"""...or as soon as this many wait.  Big batches matter: blob keys are random,
so a transaction dirties about one index page per blob until the batch is
comparable to the index (see :mod:`broker.content.sqlite`)."""


MAX_HOLD_NAME = 128
"""Characters a ``content.store`` hold's name may have."""

LoadToken = tuple[int, bool]
"""(:attr:`ContentModule.generation`, may cache) when a load started."""

COUNTERS = ("hits", "misses", "stored", "written", "backlog-waits", "read-batches",
            "load-batches", "write-failures", "sync-failures")
"""The counters of ``content.stats-get`` (all shown, 0 included)."""

READ_BATCH = 256
"""Rank 0: the most blobs one call on the SQLite thread reads.  Misses that
come in the same turn of the loop are read together: a cold read of a value
of 100,000 blobs (a long eventlog) made 100,000 calls, each a hand-off to
that thread and back, and took 12-15 s."""


LOAD_BATCH = 256
"""The most blobrefs one ``content.load`` of many asks for: a follower's
misses of a loop turn go upstream together, this many to a message.  Rank 0
reads a batch with one call on its SQLite thread (:data:`READ_BATCH`)."""

LOAD_BATCH_MAX = 4096
"""The most blobrefs a ``content.load`` of many may name (``E2BIG`` past it)."""

LOAD_BYTES = 4 << 20
"""An answer of many blobs stops once it holds this many bytes (and at a
quarter of ``tbon.max-message`` when that is smaller); it always holds the
first blob.  Short answers keep the link free for the messages behind them.
The blobs are loaded in order, in rounds sized by what the budget still
allows at the sizes seen so far, so a batch of big blobs loads about what
its answer holds, not the whole list each time it is asked again."""

LINK_SLACK = 4096
"""Bytes of an answer beside one blob (its envelope): a blob that does not
fit ``tbon.max-message`` with them is answered as an ``EMSGSIZE`` entry of
its own, so it fails alone, not the batch it came in."""


_T = TypeVar("_T")


class ContentModule(Module):
    name: ClassVar[str] = "content"
    attributes: ClassVar[tuple[AttrSpec, ...]] = (BLOB_SIZE_LIMIT, CACHE_BYTES, CACHE_EXPIRE,
                                                  CACHE_KEEP_BYTES, BACKLOG_BYTES,
                                                  DISK_RESERVE, STORE_QUOTA, MAX_CHECKPOINTS,
                                                  DUMP, RESTORE)
    runtime_attributes: ClassVar[tuple[str, ...]] = (CACHE_EXPIRE.name, CACHE_KEEP_BYTES.name)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        attrs = ctx.attrs
        self.hash_name = CONTENT_HASH.value(attrs)
        self._dump_left = 0
        """While ``content.dump`` runs at stop: bytes it has left, about."""
        self.blob_limit = BLOB_SIZE_LIMIT.value(attrs)
        self.cache_limit = CACHE_BYTES.value(attrs)
        self.cache: OrderedDict[str, bytes] = OrderedDict()
        self.cache_bytes = 0
        self.cache_expire: float = CACHE_EXPIRE.value(attrs)
        self.cache_keep: int = CACHE_KEEP_BYTES.value(attrs)
        self._marks = AgeMarks()
        self._expiry: asyncio.Task[None] | None = None
        self.dirty: dict[str, bytes] = {}
        self.backlog_limit = BACKLOG_BYTES.value(attrs)
        self.backlog_bytes = 0
        """Bytes of the blobs waiting for their write to SQLite: :attr:`dirty`
        and the batches handed to the writer (rank 0)."""
        self.backlog_peak = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        """:meth:`room`'s waiters, admitted in arrival order."""
        self.failing: BaseException | None = None
        """Why the last write to SQLite failed (a full disk), until one
        succeeds: meanwhile :meth:`room` lets nothing through unwritten."""
        self.sync_failing = LastFailure(
            on_failure=lambda: self.counts.update(("sync-failures",)))
        """Why the last sync of the store failed (what makes a ``SYNC``
        commit durable: a disk I/O error, a file size limit), until one
        succeeds.  Blob writes may go on meanwhile, so ``failing`` said
        nothing while every ``SYNC`` commit failed ``EIO``."""
        self.checkpoint_failing = LastFailure()
        """Why the last checkpoint write failed, until one succeeds: a store
        that takes blobs but refuses the checkpoint row (a file made
        read-only under the rank, a trigger) showed nothing in ``failing``,
        and a restart lost every commit since the last checkpoint."""
        self._failure_log = LogThrottle(logging.getLogger("kvbroker.content"),
                                        every=FAILURE_LOG_EVERY)
        """A write that fails is an ERROR at once, then at most one a minute
        while it goes on failing: each request and checkpoint retries it, and
        a full disk logged several lines a second, pushing every other record
        out of the ring ``kvbroker dmesg`` reads within minutes."""
        # The free-space reserve (rank 0 with a statedir; see measure_disk)
        self.reserve_setting: int | None = DISK_RESERVE.value(attrs)
        self.disk_reserve = 0
        """The reserve in force (``content.disk-reserve-bytes``, ``auto``
        resolved at start); 0 without a statedir."""
        self.disk_free = 0
        """Bytes free on the statedir's file system at the last measure."""
        self.store_bytes = 0
        """Bytes the store's file and WAL take on disk at the last measure."""
        self.store_free = 0
        """Bytes of the store's free pages (reused for new blobs) then."""
        self.stored_total = 0
        """Bytes of every blob queued for writing since start (:meth:`_backlog`)."""
        self._room_base = 0
        """Room (free space and free pages, less the WAL and twice the
        backlog) at the last measure, plus twice :attr:`stored_total` then:
        the room now is this less twice :attr:`stored_total` -- arithmetic
        on the commit path (:meth:`measure_disk`)."""
        self.store_quota = 0
        """``content.store-quota-bytes`` with a statedir (0: none)."""
        self._used_base = 0
        """The store's data (its pages in use, WAL included, plus the
        backlog) at the last measure, less :attr:`stored_total` then: the
        data now is this plus :attr:`stored_total`.  (Its file less its free
        pages, as first measured, missed the blobs still in the WAL: a store
        with a 2 MB quota took 3 MB of writes when measured between them.)"""
        self.refusing: str | None = None
        """Why writes that add data are refused (below the reserve), or None."""
        self._small_spent = 0
        """Bytes of new blobs small stores added while refusing (:meth:`_spend_small_budget`)."""
        self.admitted = 0
        """Bytes the kvs module's commits were admitted with (:meth:`refusal`
        of their size) and have not stored yet: counted by :meth:`refusal`
        as if stored.  A namespace's commit may wait between its check and
        its store (a blob to read), and the commits of other namespaces,
        checked meanwhile against what was stored, were all admitted -- past
        the quota, or the room below the reserve."""
        self._disk_watch: asyncio.Task[None] | None = None
        self._written_since_measure = 0
        self._measuring = False
        self.stopping = False
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.backing: SqliteStore | None = None
        self._flush_handle: asyncio.TimerHandle | None = None
        self._loading: dict[str, _Load] = {}
        """Loads in flight, each shared by the batches that want its blob
        (:meth:`load_many`)."""
        self._reads: list[_Load] = []
        """Rank 0: loads to read from the file in the next batch (:meth:`_read_batches`).
        A list, not keyed by blobref: two loads of one blob may be queued in
        one turn (the first vouches for nothing, a collection's), and each
        must be read."""
        self._pulls: list[_Load] = []
        """A follower: loads to ask upstream for in the next batch (:meth:`_pull`)."""
        self.link_max = LINK_MAX_MESSAGE.value(attrs)
        self.answer_bytes = min(LOAD_BYTES, self.link_max // 4)
        """An answer of many blobs stops at this many bytes (:data:`LOAD_BYTES`)."""
        self.inflight: dict[str, bytes] = {}  # handed to the writer, not yet written
        self.last_stored = 0.0
        """``time.monotonic()`` of the newest store into :attr:`dirty`: a batch
        written back is as young as this when it is taken (a collection's
        young rows count from their store, not from their write, which
        without a statedir waits for the collection itself)."""
        self._writes: set[asyncio.Future[Written]] = set()
        self._thread: StoreThread | None = None
        self.persistent = False
        """Rank 0 with a statedir: the SQLite file outlives the instance."""
        self.kvs_left_cleanly = False
        """The kvs module was removed at runtime with its last checkpoint
        written (:mod:`kvs.module`): if none took over, this module records
        the run's clean stop at the instance's stop."""
        self._run: int | None = None
        """Rank 0 with a statedir: this run's row in the store's runs
        (:meth:`begin_run`), until it ends cleanly (:meth:`end_run`)."""
        # Online garbage collection (rank 0, broker/content/collection.py)
        self.collection: Collection | None = None
        self.collections_begun = 0
        """Counts collections begun: a commit that checked its blobs before
        one began checks them again (:meth:`kvs.refcheck.RefChecker.keep_whole`)."""
        self.generation = 0
        """Bumped when a collection decides and when it ends: a load that
        spans either does not cache what it read (it may be doomed)."""
        self.rowids = RowidMarks()
        self.restored = RecentRefs()
        self.holds = Holds()
        """Rank 0: blobs stored under a hold, kept by every collection until
        it is released (``content.store`` ``hold``, ``release``)."""
        # Rank 0 with a statedir: which stores are written (a checkpoint
        # that cannot drain falls back to a root they cover)
        self.store_seq = 0
        """Counts :meth:`_keep` calls that queued blobs for writing: a root
        set after store ``n`` names no blob stored later."""
        self._unwritten: dict[str, int] = {}
        """Blobs queued and not yet written, with the store (``store_seq``)
        that queued them."""
        self._unwritten_per_store: dict[int, int] = {}
        """How many of :attr:`_unwritten` each store holds, oldest store
        first (stores only ever grow, and a dict keeps insertion order)."""
        self._oldest_unwritten = 1
        """No store before this one has a blob in :attr:`_unwritten`
        (:meth:`written_through` moves it on)."""

    def handlers(self) -> dict[str, Handler]:
        return {
            "content.store": self.store,
            "content.load": self.load,
            "content.flush": self.flush,
            "content.dropcache": self.dropcache,
            "content.checkpoint-put": self.checkpoint_put,
            "content.checkpoint-get": self.checkpoint_get,
            "content.checkpoint-list": self.checkpoint_list,
            "content.startlog": self.startlog,
            "content.stats-get": self.stats_get,
        }

    async def start(self) -> None:
        self._expire_cache()
        if self.ctx.rank == 0:
            statedir = self.ctx.attrs.get("statedir") or ""
            directory = statedir or self.ctx.attrs["rundir"]
            self.persistent = bool(statedir)
            self._thread = StoreThread("content-sqlite")
            path = os.path.join(directory, STORE_FILE)
            if not statedir and await asyncio.to_thread(_holds_checkpoints, path):
                raise _a_statedirs_store(path)
            await self.db(_remove_leftover, path, statedir)  # (no other thread made)
            restored = None
            if self.ctx.attrs.get(RESTORE.name):
                from kvs import dumps  # (content.restore: Flux's restore at start)

                # (the new store keeps the old one's runs, and replaces it whole)
                restored = await asyncio.to_thread(dumps.restore_at_start, self.ctx.attrs,
                                                   directory, statedir, self.ctx.progress)
            # (a stat, on the loop: to_thread would start an executor's
            # thread for the rank's whole life)
            if statedir and restored is None and _emptied(path):
                logging.getLogger("kvbroker.content").warning(
                    "%s is empty (0 bytes): the KVS starts empty.  A store is never left "
                    "empty but by a crash, so what it held, if anything, was lost (a host "
                    "crash before the file reached the disk?); kvbroker kvs restore puts "
                    "back a dump", path)
            try:
                self.backing = await self.db(SqliteStore, path)
                if (not statedir and restored is None
                        and await self.db(self.backing.max_rowid)):
                    # A rank 0 killed before its stop removed it (a --rundir
                    # it was given): nothing is kept without a statedir, and
                    # reused, the old copy of every value lived on and grew.
                    # Never a store with checkpoints (checked above, and
                    # here, opened): a statedir's.
                    if await self.db(self.backing.all_checkpoints):
                        await self.db(self.backing.close)
                        raise _a_statedirs_store(path)
                    await self.db(self.backing.close)
                    _remove_store(path)
                    self.backing = await self.db(SqliteStore, path)
                self.rowids.note(await self.db(self.backing.max_rowid))
                self.backing.checkpoints_kept = MAX_CHECKPOINTS.value(self.ctx.attrs)
            except StoreLocked:
                if not statedir:  # (the run directory's store: another rank 0 runs there)
                    raise ErrnoError(errno.EBUSY, f"rundir {os.path.dirname(path)} is in use "
                                                  "by another rank 0 (its content.sqlite is "
                                                  "locked)") from None
                raise ErrnoError(errno.EBUSY, f"statedir {statedir} is in use by another "
                                              "instance (its content.sqlite is locked)") from None
            except sqlite3.DatabaseError as exc:  # (not a database, damaged, ...)
                raise (LastingFault if lasting(exc) else ErrnoError)(
                    errno.EIO, f"{path}: {exc}") from None
            total = await self.measure_disk()
            if self.persistent:
                setting = self.reserve_setting
                self.disk_reserve = (min(DEFAULT_DISK_RESERVE, total // DISK_RESERVE_FRACTION)
                                     if setting is None else setting)
                self.store_quota = STORE_QUOTA.value(self.ctx.attrs)
                self._note_room()
            self._disk_watch = self.spawn(self._watch_disk())

    async def stop(self) -> None:
        """Write what is dirty, make the store durable and close it.  A store
        that cannot be made durable (a full disk) fails the stop with one
        ``ErrnoError`` -- the rank says why in one line and exits 1 -- after
        the file is closed all the same."""
        self.stopping = True
        if self._disk_watch is not None:  # (it would use the store as it closes)
            self._disk_watch.cancel()
        self.release_waiters()  # (they see stopping: ENOSYS)
        if self.kvs_left_cleanly and "kvs" not in self.ctx.siblings and not self.removing:
            try:
                await self.end_run()
            except ErrnoError as exc:
                logging.getLogger("kvbroker.content").warning(
                    "this run's clean stop could not be recorded (%s)", exc.errstr)
        failed: ErrnoError | None = None
        if self.backing is not None:
            if self.persistent:  # (without a statedir the file goes with the run directory)
                try:
                    await self._drain()
                except ErrnoError as exc:
                    logging.getLogger("kvbroker.content").error("at stop: %s", exc)
                try:
                    # (the WAL checkpoint copies the WAL's frames into the
                    # main file, which may have to grow: a full disk fails it)
                    await self.db(self.backing.sync, urgent=True)
                except sqlite3.Error as exc:
                    failed = store_error(exc, "making the content store durable")
            else:
                # what is being written must end before the file is closed
                await asyncio.gather(*list(self._writes), return_exceptions=True)
            try:
                await self.db(self.backing.close)
            except sqlite3.Error as exc:
                failed = failed or store_error(exc, "closing the content store")
            if self.ctx.attrs.get(DUMP.name) and failed is None:
                from kvs import dumps  # (content.dump: Flux's dump at stop)

                # What is left falls as the dump goes (from the store's size:
                # a bound), so a launcher waits for a long dump, not the
                # stop timeout (:meth:`left_to_write`).
                self._dump_left = max(1, os.path.getsize(self.backing.path))

                def dumped(n: int) -> None:  # (the dump's thread: one int assigned)
                    self._dump_left = max(1, self._dump_left - n)

                try:
                    await asyncio.to_thread(dumps.dump_at_stop, self.ctx.attrs,
                                            os.path.dirname(self.backing.path),
                                            self.ctx.attrs.get("statedir") or "", dumped)
                except ErrnoError as exc:
                    failed = exc
                finally:
                    self._dump_left = 0
            if not self.persistent:
                # Nothing is kept without a statedir: a run directory the
                # rank was given (kvbroker broker --rundir) outlives it, and
                # the file (a copy of every value) was left there.
                _remove_store(self.backing.path)
        if self._thread is not None:
            self._thread.shutdown()
        if failed is not None:
            raise failed

    # ------------------------------------------------------------ disk space

    def _space(self) -> tuple[int, int, int, int, int, int]:
        """(The SQLite thread) (bytes free on the store's file system, its
        size, :meth:`SqliteStore.space`)."""
        assert self.backing is not None
        st = os.statvfs(os.path.dirname(self.backing.path))
        return (st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize, *self.backing.space())

    async def measure_disk(self) -> int:
        """Rank 0: measure the free space and the store now (on the SQLite
        thread, in order with its writes); the file system's size.  Done
        every :data:`DISK_CHECK_PERIOD`, and by a collection as it ends, so
        the room it made is seen at once."""
        assert self.backing is not None
        self._written_since_measure = 0
        self._measuring = True
        try:
            free, total, used, wal, free_pages, in_use = await self.db(self._space)
        finally:
            self._measuring = False
        self.disk_free, self.store_bytes, self.store_free = free, used, free_pages
        # Counted gone already: the WAL's size (what it holds may still have
        # to be copied into the file, as big again), and twice what is
        # still to be written (into the WAL, then into the file); the blobs
        # accepted after this are counted twice too (room_left).
        self._room_base = (free + free_pages - wal - 2 * self.backlog_bytes
                           + 2 * self.stored_total)
        self._used_base = in_use + self.backlog_bytes - self.stored_total
        self._note_room()
        return int(total)

    async def _watch_disk(self) -> None:
        """Measure the disk every :data:`DISK_CHECK_PERIOD` while the rank runs:
        writes refused for space resume by themselves once there is room,
        whoever made it."""
        log = logging.getLogger("kvbroker.content")
        while True:
            await asyncio.sleep(DISK_CHECK_PERIOD)
            try:
                await self.measure_disk()
            except (OSError, sqlite3.Error) as exc:  # (keep the last measure; try again)
                log.debug("measuring the free space failed: %s", exc)

    async def _measure_quietly(self) -> None:
        """:meth:`measure_disk` after :data:`MEASURE_BYTES` were written (a
        failure keeps the last measure, as the timer does)."""
        with contextlib.suppress(OSError, sqlite3.Error):
            await self.measure_disk()

    def room_left(self) -> int:
        """Estimated bytes free for the store: the last measure less the
        blobs accepted since."""
        return self._room_base - 2 * self.stored_total

    def refusal(self, adding: int = 0) -> ErrnoError | None:
        """Rank 0: ``ENOSPC`` if writes that add data are refused now (the
        room left is below ``content.disk-reserve-bytes``, or the data over
        ``content.store-quota-bytes``), or if a write of ``adding`` bytes
        would take it there, else None.  No system call: arithmetic on the
        last measure (:meth:`measure_disk`).

        ``adding`` counts, as every accepted byte does (:meth:`room_left`),
        and so do the bytes commits were admitted with and have not stored
        yet (:attr:`admitted`):
        checked only against what was accepted before, one 12 MB put on a
        20 MB disk with 19 MB free was accepted -- and acknowledged -- then
        its write failed for want of room, and the store was stuck as
        without a reserve (unlinks failing, the stop exiting 1 with that
        commit lost).  Refusing it alone leaves the room to smaller writes:
        :attr:`refusing` is the state of the store, not of this write."""
        if (self.disk_reserve and self._room_base - 2 * self.stored_total < self.disk_reserve
                or self.store_quota and self._used_base + self.stored_total > self.store_quota):
            if self.refusing is None:
                self._note_room()
            return ErrnoError(errno.ENOSPC, self.refusing or "")
        if self.refusing is not None:
            self._note_room()
        if not adding:
            return None
        pending = self.admitted + adding
        left = self.room_left() - 2 * pending
        disk = bool(self.disk_reserve) and left < self.disk_reserve
        if disk:
            why = (f"{self._write_of(adding)} would leave about {max(left, 0)} bytes of room "
                   f"for the content store (it counts twice until written: into the WAL, "
                   f"then the file), below content.disk-reserve-bytes ({self.disk_reserve})")
        elif self.store_quota and self._used_base + self.stored_total + pending > self.store_quota:
            why = (f"{self._write_of(adding)} would take the content store's data to about "
                   f"{self._used_base + self.stored_total + pending} bytes, over "
                   f"content.store-quota-bytes ({self.store_quota})")
        else:
            return None
        refused = ErrnoError(errno.ENOSPC, f"{why}: it is refused; smaller writes are still "
                                           f"accepted. {self._make_room(disk)}")
        # (the store is not refusing: said here, at most once a minute)
        self._failure_log.log(logging.WARNING, "too-big", "%s", refused.errstr)
        return refused


    def _write_of(self, adding: int) -> str:
        """A refused write, for :meth:`refusal`'s message (formatted only
        when one is refused)."""
        return f"a write of {adding} bytes" + (
            f" (after {self.admitted} bytes of commits admitted, not yet stored)"
            if self.admitted else "")

    def _spend_small_budget(self, blobs: list[bytes]) -> None:
        """Below the reserve, a small store (:data:`SMALL_STORE`) is accepted
        while the bytes of the blobs new to this rank's cache that such
        stores added, since the refusal began, stay within
        :data:`SMALL_STORE_BUDGET`; past it, ``ENOSPC`` as a big one."""
        new = sum(len(b) for b in blobs
                  if blobref.hash_blob(b, self.hash_name) not in self.cache)
        if self._small_spent + new > SMALL_STORE_BUDGET:
            raise ErrnoError(errno.ENOSPC, f"{self.refusing} (small stores of new blobs: "
                             f"{self._small_spent} bytes accepted since the refusal began, "
                             f"{SMALL_STORE_BUDGET} at most)")
        self._small_spent += new

    def _note_room(self) -> None:
        """Update :attr:`refusing` from the room left, logging each change."""
        log = logging.getLogger("kvbroker.content")
        left = self.room_left()
        used = self._used_base + self.stored_total
        if self.disk_reserve and left < self.disk_reserve:
            why = (f"the content store's file system has about {max(left, 0)} bytes of room "
                   f"left (free space and free pages, less what the store has still to "
                   f"write), below content.disk-reserve-bytes ({self.disk_reserve})")
            disk = True
        elif self.store_quota and used > self.store_quota:
            why = (f"the content store holds about {used} bytes of data, over "
                   f"content.store-quota-bytes ({self.store_quota})")
            disk = False
        else:
            if self.refusing is not None:
                self.refusing = None
                self._small_spent = 0
                log.warning("writes are accepted again: about %d bytes of room for the content "
                            "store (content.disk-reserve-bytes %d), %d bytes of data "
                            "(content.store-quota-bytes %d)", left, self.disk_reserve, used,
                            self.store_quota)
            return
        was = self.refusing
        self.refusing = (f"{why}: writes that add data are refused until there is room. "
                         f"{self._make_room(disk)}")
        if was is None:
            log.warning("%s", self.refusing)

    def _make_room(self, disk: bool = True) -> str:
        """How to make room, for the messages of a refusal (``disk``: below
        the reserve, where room made on the file system counts too).  It
        names the way out through the setting as well: an instance started
        on a disk already nearly full (a laptop with less than 64 MiB
        free) is refused from its first write, with a store that has
        nothing to unlink."""
        assert self.backing is not None
        if disk:
            how = (f", or free space on {os.path.dirname(self.backing.path)}, or restart "
                   f"with a lower reserve (-S content.disk-reserve-bytes=BYTES, 0: none, "
                   f"{WHERE_TO_SET})")
        else:
            how = (", or restart with a higher quota (-S content.store-quota-bytes=BYTES, "
                   f"0: none, {WHERE_TO_SET})")
        return (f"Unlink keys (kvbroker kvs unlink), then checkpoint (kvbroker kvs sync) and "
                f"collect (kvbroker kvs gc) while the instance runs{how}")

    async def db(self, fn: Any, *args: Any, urgent: bool = False) -> Any:
        """Run a backing-store call on the one SQLite thread (calls stay in
        order); ``urgent``: a request waits for it (:meth:`StoreThread.run`)."""
        assert self._thread is not None
        return await self._thread.run(fn, *args, urgent=urgent)

    # ------------------------------------------------------------ cache

    def _cache_put(self, ref: str, data: bytes) -> None:
        if ref in self.cache:
            self.cache.move_to_end(ref)
            return
        self.cache[ref] = data
        self.cache_bytes += len(data) + BLOB_OVERHEAD
        if self.cache_bytes > self.cache_limit:
            self._trim()

    def _expire_cache(self) -> None:
        """(Re)start the task that expires unused blobs every
        ``content.cache-expire`` (none for 0)."""
        self._expiry = restart_expiry(self._expiry, self.cache_expire, self._age_cache,
                                      self.spawn)

    def _age_cache(self) -> None:
        """A period of ``content.cache-expire`` passed (:mod:`broker.agemarks`):
        put a mark, and evict the blobs unused since the mark now due, the
        oldest first, while the cache is over ``content.cache-keep-bytes`` --
        stopping at one rank 0 has not written back yet (it goes at a later
        mark, once written)."""
        cache, dirty, inflight = self.cache, self.dirty, self.inflight
        self._marks.put(cache, b"")
        self.cache_bytes += BLOB_OVERHEAD
        before = self.cache_bytes
        gone = 0
        for mark in self._marks.due(cache):
            while self.cache_bytes > self.cache_keep:
                ref = next(iter(cache))
                if ref == mark or ref in dirty or ref in inflight:
                    break
                self.cache_bytes -= len(cache.pop(ref)) + BLOB_OVERHEAD
                gone += 1
            self.cache_bytes -= len(cache.pop(mark)) + BLOB_OVERHEAD
        self._marks.expired += gone
        malloc.let_go(before - self.cache_bytes)  # (untrimmed, an idle rank stayed as big)

    def set_attribute(self, name: str, value: Any) -> None:
        """``content.cache-expire`` or ``content.cache-keep-bytes`` on a
        running rank (``attr set``, ``config reload``): the cache expires so
        from now on."""
        if name == CACHE_KEEP_BYTES.name:
            self.cache_keep = int(value)
            return
        assert name == CACHE_EXPIRE.name
        self.cache_expire = float(value)
        self._expire_cache()

    def _trim(self) -> None:
        """Evict the least recently used blobs down to ``content.cache-bytes``,
        stopping at one rank 0 has not written back yet -- until its write
        is done, which trims again (the cache stayed over its limit while
        idle, by 20-40 MB with a 1 MiB limit).  The newest blob too: one
        bigger than the limit stayed, a 300 MB one on a follower for good.

        Stopped at such a blob, rank 0 evicts the newest clean blobs instead
        (the one just read back, most often) and, without a statedir, starts
        the write-back that makes room (:meth:`_write_for_room`): there only
        a store started one, and with the oldest blob dirty every blob read
        back from the file stayed -- 4 times the limit after one read of
        the store, for good while no store came (the cache's memory grew
        with every read).  Only what waits for its write may keep the cache
        over its limit now, and that briefly."""
        cache = self.cache
        while self.cache_bytes > self.cache_limit and cache:
            old, blob = next(iter(cache.items()))
            if old in self.dirty or old in self.inflight:
                self._trim_newest()  # never evict what rank 0 has not written back yet
                return
            del cache[old]
            self.cache_bytes -= len(blob) + BLOB_OVERHEAD

    def _trim_newest(self) -> None:
        """Rank 0, the oldest blob waiting for its write: evict the newest
        clean blobs down to the limit (an O(1) step each: skipping the
        oldest to reach the clean ones behind them cost a pass over every
        waiting blob at each put), and start the write that lets the oldest
        go.  A blob just stored is dirty: the first step stops there."""
        cache, dirty, inflight = self.cache, self.dirty, self.inflight
        while self.cache_bytes > self.cache_limit and cache:
            new, blob = next(reversed(cache.items()))
            if new in dirty or new in inflight:
                break
            del cache[new]
            self.cache_bytes -= len(blob) + BLOB_OVERHEAD
        if not self.persistent and not self.stopping:  # (with one: within FLUSH_DELAY)
            self._write_for_room()

    def _schedule_write_back(self) -> None:
        if not self.persistent:
            # write only to make room, the oldest first (module docstring):
            # a W2p commit's share of the SQLite thread was ~10 us of rank 0
            if self.cache_bytes > self.cache_limit and self.dirty and not self._writes:
                self._write_back(FLUSH_BLOBS)
            return
        if len(self.dirty) >= FLUSH_BLOBS:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._write_back()
        elif self._flush_handle is None:
            loop = asyncio.get_running_loop()
            self._flush_handle = loop.call_later(FLUSH_DELAY, self._write_back)

    def _write_back(self, limit: int | None = None) -> None:
        """Hand the dirty blobs (at most ``limit`` of them, the oldest) to the
        SQLite thread, in transactions of about :data:`WRITE_BYTES`."""
        self._flush_handle = None
        if not self.dirty or self.backing is None:
            return
        if limit is None or len(self.dirty) <= limit:
            batch, self.dirty = self.dirty, {}
        else:
            batch = dict(itertools.islice(self.dirty.items(), limit))
            for ref in batch:
                del self.dirty[ref]
        # (the batch's bytes stay in the backlog until its write is done)
        self.inflight.update(batch)
        part: dict[str, bytes] = {}
        size = 0
        for ref, data in batch.items():
            part[ref] = data
            size += len(data)
            if size >= WRITE_BYTES:
                self._write_part(part)
                part, size = {}, 0
        if part:
            self._write_part(part)

    def _write_part(self, batch: dict[str, bytes]) -> None:
        """Hand one transaction of :meth:`_write_back` to the SQLite thread."""
        assert self.backing is not None
        stored = self.last_stored  # (no blob of the batch is younger)
        assert self._thread is not None
        fut = self._thread.run(self.backing.put_many, list(batch.items()))
        self._writes.add(fut)

        def done(f: asyncio.Future[Written]) -> None:
            self._writes.discard(f)
            for ref in batch:
                self.inflight.pop(ref, None)
            self.backlog_bytes -= sum(map(len, batch.values()))
            # (cancelled: never ran, or ran unseen -- write them again either way)
            failed = (asyncio.CancelledError("the write was cancelled") if f.cancelled()
                      else f.exception())
            if failed is None and self.failing is not None:
                held = self._failure_log.reset("write")
                logging.getLogger("kvbroker.content").warning(
                    "writing to SQLite succeeds again (it failed: %s%s)", self.failing,
                    f"; {held} more failed writes were not logged" if held else "")
            self.failing = failed
            try:
                if failed is not None:
                    self.counts["write-failures"] += 1
                    self._failure_log.log(logging.ERROR, "write",
                                          "writing %d blobs to SQLite failed: %s",
                                          len(batch), failed)
                    self._backlog(batch, again=True)  # keep them; retry on the next batch
                else:
                    wrote(f.result())
            finally:
                self._admit(failed)

        def wrote(written: Written) -> None:
            self.counts["written"] += len(batch)
            self._written_since_measure += sum(map(len, batch.values()))
            if (self._written_since_measure >= MEASURE_BYTES and not self._measuring
                    and not self.stopping):
                self.spawn(self._measure_quietly())
            if self._unwritten:
                self._note_written(batch)
            self.rowids.note(written.max_rowid, now=stored)
            if written.existing:  # (young again, though their rows are old)
                self.restored.note(written.existing, now=stored)
            if self.cache_bytes > self.cache_limit:
                self._trim()
                if not self.persistent:
                    self._schedule_write_back()  # still over: the next oldest

        fut.add_done_callback(done)

    def left_to_write(self) -> int:
        """Rank 0 with a statedir: the backlog, which its stop writes; while
        it dumps (``content.dump``), about what the dump has left."""
        return self._dump_left or (self.backlog_bytes if self.persistent else 0)

    def _note_unwritten(self, blobs: Mapping[str, bytes]) -> None:
        self.store_seq += 1
        unwritten, seq, n = self._unwritten, self.store_seq, 0
        for ref in blobs:
            if ref not in unwritten:  # (one queued earlier: that store covers it)
                unwritten[ref] = seq
                n += 1
        if n:
            self._unwritten_per_store[seq] = n

    def _note_written(self, batch: Mapping[str, bytes]) -> None:
        per_store = self._unwritten_per_store
        for ref in batch:
            seq = self._unwritten.pop(ref, None)
            if seq is not None:
                left = per_store[seq] - 1
                if left:
                    per_store[seq] = left
                else:
                    del per_store[seq]

    def written_through(self) -> int:
        """Rank 0 with a statedir: the newest store (``store_seq``) whose
        blobs, and those of every store before it, are written to SQLite --
        committed there, so a restart after a crash finds them, whatever
        happened to the writes after them (a full disk)."""
        # (next(iter(...)) of the dict skips the slots of its deleted
        # entries one by one until it is resized: after a backlog of
        # 300,000 stores drained, that cost 300 us at every commit; now
        # once, when the oldest store is written)
        seq = self._oldest_unwritten
        if seq not in self._unwritten_per_store:
            seq = self._oldest_unwritten = next(iter(self._unwritten_per_store),
                                                self.store_seq + 1)
        return seq - 1

    async def checkpoint_written(self, key: str, value: Any) -> bool:
        """Rank 0: record checkpoint ``key`` without writing back what is
        dirty first (unlike ``content.checkpoint-put``), for a root whose
        blobs are all written already (:meth:`written_through`): what a
        checkpoint falls back to when the newest root's blobs cannot be
        written.  False if it could not be synced, only committed (see
        :meth:`SqliteStore.checkpoint_put`); a failure to commit raises."""
        assert self.backing is not None
        if self.collection is not None:  # a root a collection must keep
            self.collection.touch(blobref.found_in(value))
        with self.checkpoint_failing.kept(), _store_errors():
            synced: bool = await self.db(self.backing.checkpoint_put, key,
                                         _checkpoint_bytes(value), True, urgent=True)
        if not synced:  # (kept in the WAL: survives this process's crash, not the host's)
            self.checkpoint_failing.why = "the checkpoint was written but could not be synced"
        return synced

    def _backlog(self, blobs: Mapping[str, bytes], again: bool = False) -> None:
        """Mark ``blobs`` dirty (waiting for their write), counting their
        bytes (``again``: a failed write's, whose bytes :attr:`stored_total`
        counted when they were first stored -- counted twice, each retry
        took them off the room left once more until the next measure)."""
        dirty = self.dirty
        self.last_stored = time.monotonic()
        for ref, data in blobs.items():
            if ref not in dirty:
                dirty[ref] = data
                self.backlog_bytes += len(data)
                if not again:
                    self.stored_total += len(data)
        self.backlog_peak = max(self.backlog_peak, self.backlog_bytes)

    async def room(self) -> None:
        """Rank 0: return once at most ``content.backlog-bytes`` of blobs wait
        for their write to SQLite (at once, nearly always).

        Commits and stores wait here before they add blobs, so a writer
        slower than the commits slows them to its pace, as etcd's backend
        does, instead of holding gigabytes of blobs in memory.  Waiters are
        admitted in arrival order as writes complete (a busy namespace must
        not starve the others), all those that fit under the limit at once:
        the backlog stays under the limit plus what the admitted requests
        add.  If the write they waited for failed, they fail with its errno
        (``ENOSPC`` for a full disk); the next request starts a write again,
        so the instance recovers once the disk has room.  While writes fail,
        every request waits for the next one, however small the backlog:
        a commit acknowledged meanwhile could never become durable (a full
        disk acknowledged 150 commits that a crash then lost).  That holds
        without a limit too (``content.backlog-bytes=0``): it bounds memory,
        not what may be acknowledged, and a full disk acknowledged every
        commit there."""
        if not self._over_limit() and not self._waiting and self.failing is None:
            return
        if self.failing is not None and not self.dirty and not self._writes:
            self.failing = None  # (nothing left to write: a write did it)
            return
        self.counts["backlog-waits"] += 1
        self._write_for_room()  # (first: if it raises, no waiter is left behind)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        assert self._thread is not None
        try:
            with self._thread.hurry():  # (a writer waits for the write-backs)
                await fut
        except asyncio.CancelledError:
            # (one admitted as it was cancelled holds no one up: the others
            # that fitted were admitted with it)
            if fut in self._waiting:
                self._waiting.remove(fut)
            raise

    def _over_limit(self) -> bool:
        """More than ``content.backlog-bytes`` wait for their write (0: no limit)."""
        return bool(self.backlog_limit) and self.backlog_bytes > self.backlog_limit

    def _write_for_room(self) -> None:
        """Start a write if none is under way (without a statedir, writes
        otherwise wait until the cache is full)."""
        if not self._writes and self.dirty:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._write_back(FLUSH_BLOBS)

    def _admit(self, failed: BaseException | None) -> None:
        """A write is done: admit :meth:`room`'s waiters in order while the
        backlog is under the limit; if it failed, fail the rest with its
        errno; else make sure the next write is under way."""
        waiting = self._waiting
        if failed is None:
            while waiting and not self._over_limit():
                fut = waiting.popleft()
                if not fut.done():
                    fut.set_result(None)
            if waiting:
                self._write_for_room()
            return
        # Why they waited: the backlog over its limit, or writes failing
        # (then every request waits for the next write, however small the
        # backlog: room()).
        why = ("its backlog was over content.backlog-bytes" if self._over_limit() else
               "writes were failing: until one succeeds, every request waits for the next")
        while waiting:
            fut = waiting.popleft()
            if not fut.done():
                fut.set_exception(store_error(
                    failed, f"the write-back to SQLite that this request waited for ({why})"))

    def release_waiters(self) -> None:
        """Admit every waiter of :meth:`room` now, whatever the backlog (the
        kvs module stops: what it still applies is written by its last
        checkpoint's drain)."""
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)

    async def _drain(self, urgent: bool = True) -> None:
        """Write every dirty blob now and wait until all writes are done;
        ``urgent``: someone waits for it, so the SQLite thread gets turns
        (:meth:`StoreThread.hurry`).

        ``EIO`` if one of them failed (its blobs are dirty again, retried
        with the next batch): a caller about to record a root that names
        them (a checkpoint) or to promise durability (``content.flush``)
        must not go on as if they were on disk."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        assert self._thread is not None
        with self._thread.hurry() if urgent else contextlib.nullcontext():
            self._write_back()
            # Only the writes under way now: under a steady stream of commits
            # new ones never stop coming, and waiting for all of them starved
            # flushes, checkpoints and garbage collections for minutes.
            # (shielded: a caller cancelled while it waits must not cancel the
            # writes, which would lose the batches not started yet)
            results = await asyncio.gather(*(asyncio.shield(w) for w in list(self._writes)),
                                           return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise store_error(failed, "writing blobs to SQLite")

    # ------------------------------------------------------------ store

    def _check_blob(self, data: Any) -> bytes:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ErrnoError(errno.EPROTO, "blob data must be bytes")
        self._check_size(data)
        return bytes(data)

    def _check_size(self, data: bytes | bytearray | memoryview) -> None:
        if len(data) > self.blob_limit:
            raise blobref.too_big(len(data), self.blob_limit)

    def store_local(self, blobs: list[bytes], refs: list[str] | None = None) -> list[str]:
        """Hash and cache blobs on this rank (rank 0: queue the write-back);
        ``refs``: their blobrefs, hashed already."""
        if refs is None:
            refs = [blobref.hash_blob(data, self.hash_name) for data in blobs]
        self._keep(dict(zip(refs, blobs, strict=True)))
        self.counts["stored"] += len(blobs)
        return refs

    def store_hashed(self, blobs: Mapping[str, bytes]) -> None:
        """Rank 0, for in-process modules: cache ``{blobref: blob}`` pairs whose
        refs the caller computed with this rank's ``content.hash``, and queue
        them for write-back.  ``content.store`` without the request, the
        task and the second hash of every blob (the kvs module hashes each
        new tree object once, to name it).  ``EFBIG`` as ``content.store``."""
        if self.backing is None:
            raise RuntimeError("store_hashed is for rank 0, which has the backing store")
        for data in blobs.values():
            self._check_size(data)
        self._keep(blobs)
        self.counts["stored"] += len(blobs)

    def _keep(self, blobs: Mapping[str, bytes]) -> None:
        """Cache named blobs; on rank 0 also queue them for write-back.

        Rank 0 marks them dirty first: caching a blob evicts older ones, and
        one of this same batch that were not yet dirty could be evicted by
        the next -- a value larger than ``content.cache-bytes`` was, by its
        own directory blobs, and read back as ENOENT until its write-back."""
        if self.backing is not None and blobs:
            self._backlog(blobs)
            if self.persistent:
                self._note_unwritten(blobs)
            if self.collection is not None:
                self.collection.touch(blobs)
        for ref, data in blobs.items():
            self._cache_put(ref, data)
        if self.backing is not None and blobs:
            self._schedule_write_back()

    async def store(self, msg: Message) -> None:
        _owner_only(msg)
        p = msg.payload
        if not isinstance(p, dict) or ("data" not in p and "blobs" not in p
                                       and p.get("release") is not True):
            raise ErrnoError(errno.EPROTO, "content.store needs data or blobs")
        single = "data" in p
        if single and "blobs" in p:  # (it stored data alone, answered, and dropped blobs)
            raise ErrnoError(errno.EPROTO, "content.store takes data or blobs, not both")
        raw = [p["data"]] if single else p.get("blobs", [])  # (a release may store none)
        if not isinstance(raw, list):
            raise ErrnoError(errno.EPROTO, "blobs must be a list")
        blobs = [self._check_blob(d) for d in raw]
        hold, release = p.get("hold"), p.get("release", False)
        if hold is not None and not (isinstance(hold, str) and 0 < len(hold) <= MAX_HOLD_NAME):
            raise ErrnoError(errno.EPROTO, f"hold must be a string of 1-{MAX_HOLD_NAME} "
                                           "characters")
        if not isinstance(release, bool) or (release and hold is None):
            raise ErrnoError(errno.EPROTO, "release must be a boolean, and names a hold")
        named: list[str] | None = None
        if self.backing is not None:
            try:  # (a release too: it takes its turn behind the stores that add to its hold)
                await self.room()
            except ErrnoError:
                # A store of no blobs (a hold's release) has nothing to write:
                # failing with the disk, it left a failed restore's blobs held
                # from every collection for HOLD_LEASE.
                if blobs:
                    raise
            size = sum(map(len, blobs)) if blobs else 0
            if size > SMALL_STORE:
                # (below content.disk-reserve-bytes, or would take it there)
                refused = self.refusal(size)
                if refused is not None:
                    raise refused
            elif blobs and self.refusal() is not None:
                self._spend_small_budget(blobs)
            if blobs and self.stopping:  # (the last drain may have passed: not written)
                raise ErrnoError(errno.ENOSYS, "the content module is stopping: "
                                               "the blobs were not stored")
        else:  # (cached here only once rank 0 has it: it may refuse)
            up: dict[str, Any] = {"blobs": blobs}
            if hold is not None:
                up.update(hold=hold, release=release)
            answer = await self.h.rpc("content.store", up, nodeid=NODEID_UPSTREAM)
            named = self._named_as_upstream(blobs, answer)
        refs = self.store_local(blobs, named)
        if hold is not None and self.backing is not None:
            # (in the step that stored them: no collection can begin between)
            if release:
                self.holds.release(hold)
            elif refs:
                self.holds.add(hold, refs)
        self.h.respond(msg, {"blobref": refs[0]} if single else {"blobrefs": refs})

    def _named_as_upstream(self, blobs: list[bytes], answer: Any) -> list[str]:
        """A follower: the blobrefs of ``blobs``, which its parent stored and
        answered ``answer`` for -- ``EIO``, nothing cached here, if the
        parent named them otherwise (as Flux's follower checks its parent's
        answer).  Its parent refuses a rank of another ``content.hash`` at
        its hello (:meth:`broker.overlay.Overlay._wrong_hash`), so this
        only guards that check: a rank that gave out its own name for a
        blob rank 0 keeps under another gave a blobref that named nothing
        once its cache let the blob go."""
        refs = [blobref.hash_blob(data, self.hash_name) for data in blobs]
        theirs = answer.get("blobrefs") if isinstance(answer, dict) else None
        if isinstance(theirs, list) and theirs != refs:
            raise ErrnoError(errno.EIO, f"this rank's content.hash ({self.hash_name}) is not "
                                        "the instance's: rank 0 stored the blobs under other "
                                        f"blobrefs ({str(theirs[0] if theirs else None):.80}, "
                                        f"here {refs[0] if refs else None})")
        return refs

    # ------------------------------------------------------------ load

    async def load_blob(self, ref: str) -> bytes:
        """Blob ``ref`` (:meth:`load_many` of one): ``ENOENT`` if no one has it."""
        got = (await self.load_many((ref,)))[ref]
        if isinstance(got, BaseException):  # (maybe a shared load's: as a future raises it)
            raise got.with_traceback(None)
        return got

    def load_many(self, refs: Iterable[str]) -> asyncio.Future[dict[str, bytes | BaseException]]:
        """Blobs ``refs``, each one or its error, in one future settled when
        the last is here: from the cache (rank 0: or not yet written back),
        the others loaded -- read from the file (rank 0) or asked upstream
        (:meth:`_pull`) with the other misses of this loop turn.

        A cold read of a value of 20,000 blobs cost a task, a coroutine and
        three futures per blob (~20 us of rank 3's CPU each): a batch is
        one future and a callback per blob.  A blob already being loaded
        is not loaded again: the batches wanting it share its load (not one
        a garbage collection stopped vouching for, :meth:`load_token`).  A
        caller that goes away (its future cancelled) leaves the loads it
        started running for the others; a load is only cancelled when the
        module stops (``CancelledError`` in its place)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, bytes | BaseException]] = loop.create_future()
        found: dict[str, bytes | BaseException] = {}
        cache, dirty, inflight = self.cache, self.dirty, self.inflight
        misses: list[str] = []
        for ref in refs:
            if ref in found:
                continue
            data = cache.get(ref)
            if data is not None:
                cache.move_to_end(ref)  # (used: what expires by age is in front)
            elif dirty or inflight:
                # rank 0: stored, not yet written back (dirty, or being written)
                data = dirty.get(ref)
                if data is None:  # (not `or`: an empty blob is a blob)
                    data = inflight.get(ref)
            if data is None:
                misses.append(ref)
                found[ref] = _PENDING  # (a blob named twice is loaded once)
            else:
                found[ref] = data
        self.counts["hits"] += len(found) - len(misses)
        if not misses:
            fut.set_result(found)
            return fut
        batch = _Batch(fut, found, len(misses))
        loading = self._loading
        generation, collection = self.generation, self.collection
        token: LoadToken = (generation, True)
        # rank 0 reads this turn's misses from its file, a follower asks upstream
        queue = self._pulls if self.backing is None else self._reads
        send = self._send_pulls if self.backing is None else self._read_batches
        new = 0
        for ref in misses:
            load = loading.get(ref)
            if load is None or not (load.token[1] and load.token[0] == generation):
                load = loading[ref] = _Load(
                    ref, token if collection is None else self.load_token(ref))
                _this_turns(queue, load, send)
                new += 1
            load.waiters.append(batch)
        self.counts["misses"] += new
        return fut

    def _loaded(self, load: _Load, result: bytes | BaseException) -> None:
        """Load ``load`` is over: cache its blob (if it may), and tell every
        batch that waits for it."""
        ref = load.ref
        if self._loading.get(ref) is load:  # (another may have replaced it)
            del self._loading[ref]
        if isinstance(result, bytes):
            token = load.token
            if token[1] and token[0] == self.generation:  # (self.vouches)
                self._cache_put(ref, result)  # (not a blob a collection may be deleting)
        for batch in load.waiters:
            batch.settle(ref, result)

    def _pull(self, load: _Load) -> None:
        """A follower: ask upstream for ``load``'s blob with the other misses
        of this turn (:meth:`_send_pulls`)."""
        _this_turns(self._pulls, load, self._send_pulls)

    def _send_pulls(self) -> None:
        """Ask upstream for this turn's misses, :data:`LOAD_BATCH` to a request
        (one alone as a plain ``content.load``)."""
        loads, self._pulls = self._pulls, []
        for i in range(0, len(loads), LOAD_BATCH):
            self.spawn(self._pull_batch(loads[i:i + LOAD_BATCH]))

    async def _pull_batch(self, part: list[_Load]) -> None:
        """Settle ``part``'s loads from one upstream answer; those it stopped
        short of are asked for again (next turn, with that turn's misses)."""
        loaded = self._loaded
        try:
            if len(part) == 1:
                resp = await self.h.rpc("content.load", {"blobref": part[0].ref},
                                        nodeid=NODEID_UPSTREAM)
                loaded(part[0], resp["data"])
                return
            self.counts["load-batches"] += 1
            resp = await self.h.rpc("content.load", {"blobrefs": [load.ref for load in part]},
                                    nodeid=NODEID_UPSTREAM)
            got = resp["data"]
            if not isinstance(got, list) or not 0 < len(got) <= len(part):
                raise ErrnoError(errno.EPROTO, "content.load answered a batch malformed")
        except asyncio.CancelledError:  # (the module stops)
            for load in part:
                loaded(load, asyncio.CancelledError(f"the load of blob {load.ref} was cancelled"))
            raise
        except Exception as exc:
            for load in part:
                loaded(load, exc)
            return
        for load, entry in zip(part, got, strict=False):
            loaded(load, entry if isinstance(entry, bytes) else _entry_error(entry))
        for load in part[len(got):]:  # (the answer stopped short: ask again)
            self._pull(load)

    def _read_batches(self) -> None:
        """Hand this turn's reads to the SQLite thread, :data:`READ_BATCH` at a time."""
        loads, self._reads = self._reads, []
        assert self._thread is not None
        for i in range(0, len(loads), READ_BATCH):
            part = loads[i:i + READ_BATCH]
            self.counts["read-batches"] += 1
            done = self._thread.run(self._get_many_checked, [load.ref for load in part],
                                    urgent=True)
            done.add_done_callback(functools.partial(self._settle_reads, part))

    def _settle_reads(self, part: list[_Load],
                      done: asyncio.Future[dict[str, bytes | ErrnoError | None]]) -> None:
        """Give each read of a batch its blob, its own error, or the batch's."""
        if done.cancelled():  # (the executor was shut down: the module stops)
            for load in part:
                self._loaded(load, asyncio.CancelledError(
                    f"the load of blob {load.ref} was cancelled"))
            return
        failed = done.exception()  # (a SQLite error: every read of the batch fails with it)
        got = {} if failed is not None else done.result()
        for load in part:
            found = failed or got[load.ref]
            if found is None:
                found = ErrnoError(errno.ENOENT, f"unknown blob {load.ref}")
            self._loaded(load, found)

    def _get_many_checked(self, refs: list[str]) -> dict[str, bytes | ErrnoError | None]:
        """(The SQLite thread) :meth:`_get_checked` of each of ``refs``; a
        damaged blob's error in its place, so it fails its own read only.

        A blob SQLite cannot read (a damaged page of the file: "database
        disk image is malformed") is ``EIO`` too: as a ``sqlite3`` error it
        was an "internal error", with a traceback in rank 0's log for every
        read of it."""
        out: dict[str, bytes | ErrnoError | None] = {}
        for ref in refs:
            try:
                out[ref] = self._get_checked(ref)
            except ErrnoError as exc:
                out[ref] = exc
            except sqlite3.DatabaseError as exc:
                out[ref] = ErrnoError(errno.EIO, f"blob {ref} cannot be read from the "
                                                 f"content store: {exc}")
        return out

    def _get_checked(self, ref: str) -> bytes | None:
        """(The SQLite thread) blob ``ref`` from the file, checked against its
        hash: bytes damaged on disk are ``EIO``, not served as a value."""
        assert self.backing is not None
        data = self.backing.get(ref)
        if data is not None and not blobref.matches(ref, data):
            raise blobref.damaged(ref)
        return data

    async def load(self, msg: Message) -> None:
        _owner_only(msg)
        p = msg.payload
        if isinstance(p, dict) and "blobrefs" in p:
            if "blobref" in p:  # (as a store of both: not half served)
                raise ErrnoError(errno.EPROTO, "content.load takes blobref or blobrefs, not both")
            await self._load_many(msg, require(p, blobrefs=list)["blobrefs"])
            return
        ref = blobref.check(require(p, blobref=str)["blobref"])
        data = self.cache.get(ref)
        if data is None:
            data = await self.load_blob(ref)
        else:
            self.cache.move_to_end(ref)  # (used: what expires by age is in front)
            self.counts["hits"] += 1
        self.h.respond(msg, {"data": data})

    async def _load_many(self, msg: Message, refs: list[Any]) -> None:
        """``content.load`` of many: each blob or ``[errnum, errstr]``, in
        order, until the answer holds :attr:`answer_bytes` (see
        :data:`LOAD_BYTES`)."""
        if not refs:
            raise ErrnoError(errno.EINVAL, "blobrefs is empty")
        if len(refs) > LOAD_BATCH_MAX:
            raise ErrnoError(errno.E2BIG, f"{len(refs)} blobrefs: at most "
                                          f"{LOAD_BATCH_MAX} a request")
        for ref in refs:
            if not isinstance(ref, str):
                raise ProtocolError("blobrefs must be strings")
            blobref.check(ref)
        budget = self.answer_bytes
        out: list[bytes | list[Any]] = []
        size = blobs = 0
        i = 0
        while i < len(refs) and (not out or size < budget):
            # this round: one blob first, then as many as the budget left
            # holds at the mean size so far (a round's loads run together)
            n = 1 if not blobs else max(1, (budget - size) * blobs // max(size, 1))
            part = refs[i:i + n]
            got = await self._load_round(part)
            for ref, data in zip(part, got, strict=True):
                entry = self._entry(ref, data)
                if isinstance(entry, bytes):
                    if out and size + len(entry) > budget:
                        break  # (asked again: a later answer holds it)
                    size += len(entry)
                    blobs += 1
                out.append(entry)
                i += 1
            else:
                continue
            break
        self.h.respond(msg, {"data": out})

    async def _load_round(self, refs: list[str]) -> list[bytes | BaseException]:
        """Blobs ``refs`` (or each one's error): from the cache, the others
        loaded together (:meth:`load_many`)."""
        got = await self.load_many(refs)
        return [got[ref] for ref in refs]

    def _entry(self, ref: str, data: bytes | BaseException) -> bytes | list[Any]:
        """One entry of a ``content.load`` of many: the blob, or ``[errnum,
        errstr]`` -- for a blob too big for the link too (it fails alone)."""
        if isinstance(data, bytes):
            if len(data) + LINK_SLACK > self.link_max:
                return [errno.EMSGSIZE, f"blob {ref} of {len(data)} bytes exceeds "
                                        f"tbon.max-message ({self.link_max})"]
            return data
        if isinstance(data, ErrnoError):
            return [data.errnum, data.errstr]
        if isinstance(data, asyncio.CancelledError):  # (a shared load cancelled at stop)
            return [errno.ECANCELED, f"the load of blob {ref} was cancelled"]
        raise data

    # ------------------------------------------------------------ collection

    def begin_collection(self) -> Collection:
        """Rank 0: start an online collection's barrier (``EBUSY`` if one
        runs).  Everything stored from now on is kept."""
        if self.backing is None:
            raise RuntimeError("collections run on rank 0, which has the backing store")
        if self.collection is not None:
            raise busy()
        self.collection = Collection(self)
        self.collections_begun += 1
        return self.collection

    def load_token(self, ref: str) -> LoadToken:
        """Taken when a load of ``ref`` starts: what :meth:`vouches` needs.

        While a collection deletes, a load that started before ``ref`` was
        kept may bring it back from a row about to go.  Its data may serve
        the read that asked, but no cache may keep it and no later request
        may share that load to learn that ``ref`` exists (a commit naming
        it would then be applied without it)."""
        return self.generation, self.collection is None or self.collection.may_cache(ref)

    def vouches(self, token: LoadToken) -> bool:
        """Whether a load that started with ``token`` shows its blob exists
        now (and may be cached, or shared with a later request)."""
        return token[1] and token[0] == self.generation

    def end_collection(self, collection: Collection) -> None:
        if self.collection is collection:
            self.collection = None
            self.generation += 1

    def forget_unkept(self, keep: set[str]) -> None:
        """A collection decided: drop the cached blobs it does not keep, and
        let loads in flight finish without caching or being shared
        (:attr:`generation`, :meth:`load_token`)."""
        self.generation += 1
        for ref in [r for r in self.cache if r not in keep]:
            if ref not in self.dirty and ref not in self.inflight:
                self.cache_bytes -= len(self.cache.pop(ref)) + BLOB_OVERHEAD

    async def check_present(self, refs: list[str]) -> None:
        """Rank 0: ``ENOENT`` unless every blob of ``refs`` is here, without
        reading them; during a collection they are kept from now on, and the
        store is asked after that (in order with its deletions)."""
        if self.collection is not None:
            self.collection.touch(refs)
        ask = [r for r in refs
               if r not in self.cache and r not in self.dirty and r not in self.inflight]
        if ask:
            assert self.backing is not None
            try:
                missing = await self.db(self.backing.missing, ask, urgent=True)
            except sqlite3.DatabaseError as exc:  # (a damaged page, as in _get_many_checked)
                raise ErrnoError(errno.EIO, f"the content store cannot be read: {exc}") from None
            if missing:
                raise ErrnoError(errno.ENOENT, f"blob {missing[0]} is not in the content store")

    async def drain(self) -> None:
        """Write every blob stored so far to SQLite (``EIO`` if that fails),
        as background work: no GIL turns for it (a garbage collection's
        barrier; with turns, the commits beside a collection fell from
        ~0.9x to ~0.6x of their rate alone)."""
        await self._drain(urgent=False)

    async def checkpoints(self) -> list[tuple[str, bytes, int]]:
        """Rank 0: every checkpoint kept, ``(key, packed value, age)`` (age 0:
        the current one; :meth:`SqliteStore.all_checkpoints`)."""
        assert self.backing is not None
        found: list[tuple[str, bytes, int]] = await self.db(self.backing.all_checkpoints)
        return found

    async def checkpoint_history_rows(self, key: str) -> list[tuple[int, bytes]]:
        """Rank 0: ``key``'s older values, ``(row id, packed value)``."""
        assert self.backing is not None
        rows: list[tuple[int, bytes]] = await self.db(self.backing.checkpoint_history_rows, key)
        return rows

    async def drop_checkpoint_history(self, ids: list[int]) -> int:
        """Rank 0: delete these older values (a collection deleted their trees)."""
        if not ids:
            return 0
        assert self.backing is not None
        n: int = await self.db(self.backing.drop_checkpoint_history, ids)
        return n

    # ------------------------------------------------------------ misc

    async def flush(self, msg: Message) -> None:
        _owner_only(msg)
        if self.ctx.rank != 0:
            await self.h.rpc("content.flush", {}, nodeid=NODEID_UPSTREAM)
        elif self.backing is not None:
            await self._drain()
            with self.sync_failing.kept(), _store_errors():
                await self.db(self.backing.sync, urgent=True)
        self.h.respond(msg, {})

    def dropcache(self, msg: Message) -> None:
        _owner_only(msg)
        # (clean ones: not those waiting for their write, nor being written)
        for ref in [r for r in self.cache if r not in self.dirty and r not in self.inflight]:
            self.cache_bytes -= len(self.cache.pop(ref)) + BLOB_OVERHEAD
        malloc.trim()  # (what it held is scattered through the heap: give it back)
        self.h.respond(msg, {})

    async def checkpoint_put(self, msg: Message) -> None:
        """``{key, value}``; or Flux's ``{value}`` alone, the KVS's checkpoint
        (:func:`_flux_checkpoint`)."""
        if not msg.is_owner:  # (first: a guest's malformed put was EPROTO, not EPERM)
            raise ErrnoError(errno.EPERM, "checkpoints are for the instance owner")
        flux_form = isinstance(msg.payload, dict) and "key" not in msg.payload
        body = _flux_checkpoint(require(msg.payload))
        value = body.get("value")
        if self.ctx.rank != 0:
            await self.h.rpc("content.checkpoint-put", msg.payload, nodeid=NODEID_UPSTREAM)
        elif flux_form and "kvs" in self.ctx.siblings:
            # The kvs module would not know: its next start could resume at
            # a root it never had, or one the store lacks.
            raise ErrnoError(errno.EBUSY, "the KVS writes its own checkpoint while it runs "
                                          "(as Flux's 'checkpoint update' refuses with the kvs "
                                          "loaded): stop the instance and use kvbroker content "
                                          "checkpoint update --statedir DIR ROOTREF")
        else:
            assert self.backing is not None
            # Every blob stored so far goes to SQLite first (EIO if that
            # fails), on the same thread: a checkpoint never names a root
            # whose blobs are not written, which a restart could not read.
            await self._drain()
            if self.collection is not None:  # a root a collection must keep
                self.collection.touch(blobref.found_in(value))
            with self.checkpoint_failing.kept(), _store_errors():
                await self.db(self.backing.checkpoint_put, body["key"],
                              _checkpoint_bytes(value), urgent=True)
        self.h.respond(msg, {})

    async def checkpoint_get(self, msg: Message) -> None:
        """``{key}`` -> ``{value}``; without ``key`` (Flux's form) every KVS
        checkpoint kept, as Flux answers: ``{value: [value, ...]}``, newest
        first, ``ENOENT`` for none."""
        flux_form = msg.payload is None or (isinstance(msg.payload, dict)
                                            and "key" not in msg.payload)
        key = await self._checkpoint_request(msg)
        if key is not None and flux_form:
            assert self.backing is not None
            values = await self._checkpoint_read(self.backing.checkpoint_list, key,
                                                 "the KVS checkpoints")
            if not values:
                raise ErrnoError(errno.ENOENT, "no KVS checkpoint")
            self.h.respond(msg, {"value": [checkpoint_or_none(v) for v in values]})
        elif key is not None:
            assert self.backing is not None
            value = await self._checkpoint_read(self.backing.checkpoint_get, key,
                                                f"checkpoint {key!r}")
            if value is None:
                raise ErrnoError(errno.ENOENT, f"no checkpoint {key!r}")
            try:
                decoded = unpack_checkpoint(value)
            except ValueError as exc:  # a damaged row: as a damaged page (EIO)
                raise ErrnoError(errno.EIO, f"checkpoint {key!r} cannot be read from "
                                            f"{self.backing.path}: {exc}") from None
            self.h.respond(msg, {"value": decoded})

    async def checkpoint_list(self, msg: Message) -> None:
        """``{key}`` -> ``{checkpoints: [value, ...]}``: every value of
        ``key`` kept, newest (the current one) first; empty if none.  A row
        that does not decode is listed as null (a value that names no root),
        as the offline list shows it, so the others can still be read."""
        key = await self._checkpoint_request(msg)
        if key is not None:
            assert self.backing is not None
            values = await self._checkpoint_read(self.backing.checkpoint_list, key,
                                                 f"the checkpoints of {key!r}")
            self.h.respond(msg, {"checkpoints": [checkpoint_or_none(v) for v in values]})

    async def _checkpoint_request(self, msg: Message) -> str | None:
        """A checkpoint read's ``key`` on rank 0; elsewhere None, once rank
        0's answer is passed on.  Owner only."""
        _owner_only(msg)
        flux_get = msg.topic == "content.checkpoint-get" and msg.payload is None
        body = require({} if flux_get else msg.payload)  # (Flux's get has no payload)
        if msg.topic == "content.checkpoint-get" and "key" not in body:
            body = {**body, "key": KVS_CHECKPOINT_KEY}  # (Flux's form: the KVS's)
        body = require(body, key=str)
        if self.ctx.rank != 0:  # (as asked: rank 0 answers Flux's form as Flux's)
            self.h.respond(msg, await self.h.rpc(msg.topic, msg.payload,
                                                 nodeid=NODEID_UPSTREAM))
            return None
        key: str = body["key"]
        return key

    async def _checkpoint_read(self, read: Callable[[str], _T], key: str, what: str) -> _T:
        """``read(key)`` on the store's thread; a damaged page is EIO, as for a blob."""
        assert self.backing is not None
        try:
            found: _T = await self.db(read, key)
        except sqlite3.DatabaseError as exc:
            raise ErrnoError(errno.EIO, f"{what} cannot be read from "
                                        f"{self.backing.path}: {exc}") from None
        return found

    async def begin_run(self, period: float) -> list[Row]:
        """Rank 0 with a statedir, as the instance starts (the kvs module
        asks, :mod:`broker.startlog`): the runs recorded so far, oldest
        first, and this one recorded after them, durably, with its
        ``kvs.checkpoint-period``."""
        before = await self.past_runs()
        assert self.backing is not None
        with _store_errors():
            self._run = await self.db(self.backing.run_begin, time.time(), __version__,
                                      period, urgent=True)
        return before

    async def past_runs(self) -> list[Row]:
        """The runs recorded (:meth:`begin_run`'s answer, read only): what a
        start whose own run could not be recorded (a full disk) still
        reads, to say whether the run before it crashed."""
        assert self.backing is not None and self.persistent
        with _store_errors():
            rows: list[Row] = await self.db(self.backing.runs, urgent=True)
        return rows

    async def note_run_period(self, period: float) -> None:
        """This run's ``kvs.checkpoint-period`` changed (``attr set``)."""
        if self._run is not None and self.backing is not None:
            with _store_errors():
                await self.db(self.backing.run_period, self._run, period)

    async def end_run(self) -> None:
        """This run stopped cleanly: its final checkpoint is on disk."""
        if self._run is None or self.backing is None:
            return
        run, self._run = self._run, None
        with _store_errors():
            await self.db(self.backing.run_end, run, time.time(), urgent=True)

    async def startlog(self, msg: Message) -> None:
        """``content.startlog`` -> ``{runs: [[started, finished|null,
        version, checkpoint_period|null], ...], statedir}``, oldest first: the instance's runs
        (``kvbroker startlog``); none without a statedir.  Owner only;
        rank 0's (another rank passes it on)."""
        _owner_only(msg)
        if self.ctx.rank != 0:
            self.h.respond(msg, await self.h.rpc(msg.topic, msg.payload,
                                                 nodeid=NODEID_UPSTREAM))
            return
        rows: list[Row] = []
        if self.persistent and self.backing is not None:
            backing = self.backing
            try:
                rows = await self.db(backing.runs)
            except sqlite3.DatabaseError as exc:
                raise ErrnoError(errno.EIO, f"the runs cannot be read from {backing.path}: "
                                            f"{exc}") from None
        # current: the newest row is this run's (else it could not be
        # recorded, and the newest is an earlier run's, maybe a crash)
        self.h.respond(msg, {"runs": [list(row) for row in rows],
                             "statedir": bool(self.persistent),
                             "current": self._run is not None})

    async def stats_get(self, msg: Message) -> None:
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "content.stats-get is for the instance owner: its "
                                          "counts would tell whether a guessed blob is stored")
        store = await self._store_figures() if self.backing is not None else {}
        out = self.stats()
        out.update(store)
        self.h.respond(msg, out)

    async def _store_figures(self) -> dict[str, Any]:
        """``backing-count`` (the blobs in the file), with the disk measured
        now -- unless the SQLite thread cannot say within
        :data:`STATS_WAIT` seconds (a write blocked on a disk that stopped
        answering) or the file cannot be read (a damaged page): then
        ``backing-count`` is null, the other figures are the last measure's,
        and ``store-unreadable`` says why.  The figures are how such a store
        is looked into: they must come, not an error or no answer."""
        backing = self.backing
        assert backing is not None and self._thread is not None

        async def read() -> int:
            await self.measure_disk()
            n: int = await self.db(backing.count)
            return n

        task = asyncio.ensure_future(read())
        task.add_done_callback(outcome_read)  # (it may end after this answer)
        try:
            n = await asyncio.wait_for(asyncio.shield(task), STATS_WAIT)
            return {"backing-count": n, "store-unreadable": None}
        except TimeoutError:
            why = (f"the SQLite thread has not answered within {STATS_WAIT:g} s "
                   f"({self._thread.stats()['queued']} calls under way): the other "
                   "figures are the last measure's")
        except sqlite3.Error as exc:
            why = f"{backing.path}: {exc}"
        return {"backing-count": None, "store-unreadable": why}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        marks = self._marks.live(self.cache)  # (the expiry's: not blobs, left out)
        out.update({
            "hash": self.hash_name,
            "count": len(self.cache) - marks,
            "cache-bytes": self.cache_bytes - marks * BLOB_OVERHEAD,
            "expired": self._marks.expired,  # (unused for content.cache-expire)
            "dirty": len(self.dirty),
        })
        if self.backing is not None:
            out.update({"backlog-bytes": self.backlog_bytes,
                        "backlog-limit": self.backlog_limit,
                        "backlog-peak": self.backlog_peak,
                        "holds": len(self.holds),
                        # why the last write failed, until one succeeds
                        "failing": None if self.failing is None else str(self.failing),
                        # why the last checkpoint write failed, until one succeeds
                        "checkpoint-failing": self.checkpoint_failing.why,
                        # why the last sync (a SYNC commit's) failed, until one succeeds
                        "sync-failing": self.sync_failing.why,
                        # the store's size and the room for it (as of the last measure)
                        "store-bytes": self.store_bytes,
                        "store-free-bytes": self.store_free,
                        "disk-free-bytes": self.disk_free,
                        "disk-reserve-bytes": self.disk_reserve,
                        "store-quota-bytes": self.store_quota,
                        # why writes that add data are refused, while they are
                        "refusing": self.refusing})
        if self._thread is not None:
            # jobs run on the SQLite thread, and the GIL turns the loop gave
            # it (broker/content/storethread.py)
            out["sqlite-thread"] = self._thread.stats()
        return out


def _emptied(path: str) -> bool:
    """Whether a store file is there at ``path`` with nothing in it, nor in
    its WAL: SQLite would take it as a new, empty store.  kvbroker's open
    writes the tables at once, so only a crash leaves one so (of the host,
    or a rank killed in the moment between)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size:
            return False  # (not a file: the store's own open says why)
        return not os.path.exists(path + "-wal") or os.path.getsize(path + "-wal") == 0
    except OSError:  # (none there, or unreadable: the store's own open says why)
        return False


def _holds_checkpoints(path: str) -> bool:
    """Whether the SQLite store at ``path`` holds a checkpoint (read-only;
    False if there is none, or it cannot be read: the store's own open
    says why then).  A store with checkpoints is a statedir's: rank 0
    without a statedir writes none there, the KVS only checkpoints into a
    statedir."""
    return _read_only(path, lambda db: db.execute(
        "SELECT 1 FROM checkpoints LIMIT 1").fetchone() is not None, False)


def _read_only(path: str, read: Callable[[sqlite3.Connection], _T], default: _T) -> _T:
    """``read`` of the SQLite file at ``path`` opened read-only, before the
    store opens it; ``default`` if there is none or it cannot be read."""
    if not os.path.exists(path):
        return default
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return read(db)
        finally:
            db.close()
    except (sqlite3.Error, TypeError, ValueError):
        return default


def _remove_leftover(path: str, statedir: str) -> None:
    """Remove what a restore killed part-way left beside the store at
    ``path`` (:mod:`broker.content.storefile`), saying so once: the store
    is the one from before that restore.  Refused (EBUSY) while another
    instance's restore is writing it."""
    try:
        removed = storefile.remove_leftover(path)
    except StoreLocked:
        where = f"statedir {statedir}" if statedir else f"rundir {os.path.dirname(path)}"
        raise ErrnoError(errno.EBUSY, f"{where} is in use by another instance (a restore "
                                      f"is writing {storefile.temp_path(STORE_FILE)} "
                                      "there)") from None
    except OSError as exc:
        raise ErrnoError(exc.errno or errno.EIO,
                         f"{storefile.temp_path(path)}: {exc.strerror or exc}") from None
    if removed:
        logging.getLogger("kvbroker.content").warning(
            "a content restore was interrupted (a start with content.restore, or kvs "
            "restore --checkpoint, killed part-way): removed its unfinished %s; the store "
            "is as it was before it", storefile.temp_path(path))


def _a_statedirs_store(path: str) -> ErrnoError:
    """Rank 0 without a statedir found a store with checkpoints in its run
    directory (``--rundir`` naming a stopped instance's statedir, typed for
    ``--statedir``): it is refused, not removed as a killed rank 0's
    leftover -- that deleted the KVS and its checkpoints without a word."""
    directory = os.path.dirname(path)
    return ErrnoError(errno.EEXIST, f"rundir {directory} holds a content store with KVS "
                                    f"checkpoints ({path}): a statedir's, not removed; to "
                                    f"use it give --statedir {directory}, else choose another "
                                    "rundir")


def _remove_store(path: str) -> None:
    """Remove the SQLite file at ``path`` and its WAL and shared-memory files."""
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)


def store_error(exc: BaseException, doing: str) -> ErrnoError:
    """A failed SQLite write as an errno with a message (a full disk is
    ENOSPC, anything else EIO), not an "internal error" with a traceback."""
    errnum = errno.ENOSPC if "full" in str(exc) else errno.EIO
    return ErrnoError(errnum, f"{doing} failed: {exc}")


@contextlib.contextmanager
def _store_errors() -> Iterator[None]:
    """:func:`store_error` for what the ``with`` block writes."""
    try:
        yield
    except sqlite3.Error as exc:
        raise store_error(exc, "writing to the content store") from None


class _Batch:
    """The blobs one caller of :meth:`ContentModule.load_many` waits for: its
    future is settled by the last of them, with them all."""

    __slots__ = ("fut", "found", "left")

    def __init__(self, fut: asyncio.Future[dict[str, bytes | BaseException]],
                 found: dict[str, bytes | BaseException], left: int) -> None:
        self.fut = fut
        self.found = found
        self.left = left

    def settle(self, ref: str, result: bytes | BaseException) -> None:
        self.found[ref] = result
        self.left -= 1
        if not self.left and not self.fut.done():  # (done: its caller went away)
            self.fut.set_result(self.found)


class _Load:
    """A blob being loaded, with what it may vouch for
    (:meth:`ContentModule.load_token`) and the batches that wait for it."""

    __slots__ = ("ref", "token", "waiters")

    def __init__(self, ref: str, token: LoadToken) -> None:
        self.ref = ref
        self.token = token
        self.waiters: list[_Batch] = []


_PENDING = ErrnoError(errno.EINPROGRESS, "still loading")
"""A miss's place in a batch until its load settles it (never seen outside)."""


def _this_turns(batch: list[_Load], load: _Load, send: Callable[[], None]) -> None:
    """Put ``load`` in ``batch``, the misses of this loop turn: the first one
    schedules ``send`` for the end of the turn, which takes the batch whole."""
    if not batch:
        asyncio.get_running_loop().call_soon(send)
    batch.append(load)


def _entry_error(entry: Any) -> ErrnoError:
    """A failed entry of a ``content.load`` of many, ``[errnum, errstr]``."""
    if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
            and isinstance(entry[1], str)):
        return ErrnoError(entry[0], entry[1])
    return ErrnoError(errno.EPROTO, "content.load answered a batch entry malformed")


def _owner_only(msg: Message) -> None:
    if not msg.is_owner:
        raise ErrnoError(errno.EPERM, f"{msg.topic} is for the instance owner")


def unpack_checkpoint(value: bytes) -> Any:
    """A checkpoint's value as stored, decoded as the codec reads payloads
    (a checkpoint-put may carry int keys); ``ValueError`` if the row does
    not decode (a damaged file)."""
    import msgpack

    try:
        return msgpack.unpackb(value, raw=False, strict_map_key=False)
    except Exception as exc:  # (whatever garbled bytes make msgpack raise)
        raise ValueError(f"it does not decode ({type(exc).__name__}: {exc})") from None


def checkpoint_or_none(value: bytes) -> Any:
    """:func:`unpack_checkpoint`, or None for a row that does not decode
    (listed as a value that names no root, online and offline alike)."""
    try:
        return unpack_checkpoint(value)
    except ValueError:
        return None


KVS_CHECKPOINT_KEY = "kvs-primary"
"""The checkpoint of the KVS's primary root (``kvs.namespaces.CHECKPOINT_KEY``):
what Flux's checkpoint requests, which name no key, mean."""


def _flux_checkpoint(body: dict[str, Any]) -> dict[str, Any]:
    """A ``content.checkpoint-put``'s ``{key, value}``.  Flux's form, ``{value}``
    alone, is the KVS's checkpoint, kept as sent (the kvs module reads its
    ``sequence``: ``kvs.checkpoints.rootseq_of``)."""
    if "key" in body:
        return require(body, key=str)
    if "value" not in body:
        raise ProtocolError("request is missing field 'value' (or 'key')")
    value = body["value"]
    if not is_kvs_root(value):  # (what the kvs's next start would refuse)
        raise ErrnoError(errno.EINVAL, "a checkpoint without a key is the KVS's: its value "
                                       "must name a root ({version, rootref, sequence, "
                                       "timestamp}, as Flux's, sequence an integer >= 0)")
    return {**body, "key": KVS_CHECKPOINT_KEY, "value": value}


def _checkpoint_bytes(value: Any) -> bytes:
    import msgpack

    packed: bytes = msgpack.packb(value, use_bin_type=True)
    return packed
