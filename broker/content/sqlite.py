"""Rank 0's backing store: blobs and checkpoints in one SQLite file (WAL mode).

Blobs are keyed by their raw digest (``hash BLOB``: 32 bytes for sha256),
not by the 71-character blobref text.  Content addresses are random, so
every insert lands on a random page of the key index; once the index is
bigger than a write-back batch, nearly every blob dirties its own index page
and the WAL traffic per blob grows with the store.  A key half the size
halves the index: with 40,000 blobs an insert cost ~13 us with text keys
and ~7 us with digests (batches of 1,500).  A file made by an older
kvbroker (``hash TEXT``) is still read and written in its own format.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import urllib.parse
from collections.abc import Iterable
from functools import lru_cache
from typing import Any, NamedTuple

from broker.content import locks

STORE_FILE = "content.sqlite"
"""The file's name in rank 0's statedir (or run directory)."""

ROWS_PER_STATEMENT = 400
"""Two parameters a row: within SQLite's historic limit of 999 parameters."""

DEFAULT_CHECKPOINTS_KEPT = 5
"""How many checkpoints of a key the store keeps, the current one included
(Flux's content-sqlite ``max_checkpoints``): the older ones are what a
damaged or unwanted newest root can be rolled back to."""

MAX_CHECKPOINTS_KEPT = 100
"""The most ``content.max-checkpoints`` may say."""


def sqlite_temp_dir() -> str:
    """The directory SQLite puts its temporary files in on Unix (a
    ``VACUUM``'s copy of the store): the first of ``$SQLITE_TMPDIR``,
    ``$TMPDIR``, ``/var/tmp``, ``/usr/tmp``, ``/tmp`` that is a directory
    this process may write and search, else ``.`` (as ``unixTempFileDir``)."""
    for directory in (os.environ.get("SQLITE_TMPDIR"), os.environ.get("TMPDIR"),
                      "/var/tmp", "/usr/tmp", "/tmp"):
        if directory and os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK):
            return directory
    return "."


@lru_cache(maxsize=8)
def _insert_sql(rows: int) -> str:
    return ("INSERT OR IGNORE INTO objects (hash, object) VALUES " + ",".join(["(?, ?)"] * rows)
            + " RETURNING hash")


def digest_of(ref: str) -> bytes:
    """The raw digest in blobref ``ref`` (``sha256-<hex>`` -> 32 bytes)."""
    return bytes.fromhex(ref[ref.index("-") + 1:])


def ref_of(digest: bytes) -> str:
    """The blobref of a raw digest (its length says the hash)."""
    return f"{'sha1' if len(digest) == 20 else 'sha256'}-{digest.hex()}"


_COLUMNS = {"objects": ("hash", "object"), "checkpoints": ("key", "value"),
            "checkpoint_history": ("id", "key", "value"),
            "runs": ("id", "started", "finished", "version")}
"""The columns the store reads and writes, checked when it opens."""


STORE_FORMAT = 1
"""The store's format, in SQLite's ``user_version``: what a kvbroker that
changes the file's layout raises, so that an older one refuses the file
(:func:`check_format`) instead of reading it wrong or altering it.  A file
without one (0: from before it was kept) is this format, and is marked so
the first time it is opened for writing."""


_MAY_PASS = frozenset({sqlite3.SQLITE_PERM, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
                       sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR,
                       sqlite3.SQLITE_FULL, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PROTOCOL})
"""SQLite's primary result codes of a store that fails to open but may
open at the next start."""


def lasting(exc: sqlite3.DatabaseError) -> bool:
    """Whether a store that failed to open so will fail the same way at
    every start until someone acts (:class:`~broker.errors.LastingFault`):
    a damaged file, not a database, a newer format, another program's --
    not one locked, full or unreadable for now."""
    return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) not in _MAY_PASS


class NewerFormat(sqlite3.DatabaseError):
    """The store file is of a newer format than this kvbroker reads."""


def check_format(version: int) -> int:
    """``version``, a file's store format (its ``PRAGMA user_version``);
    :class:`sqlite3.DatabaseError` naming both formats if it is newer than
    this kvbroker's :data:`STORE_FORMAT`."""
    if version > STORE_FORMAT:
        raise NewerFormat(
            f"written by a newer kvbroker (store format {version}; this one, "
            f"{_version()}, reads format {STORE_FORMAT} and older): run that version, or "
            f"save the data with its `kvbroker kvs dump --checkpoint --statedir` and "
            f"restore the archive here")
    return version


def header_format(path: str) -> int | None:
    """The store format a SQLite file's header at ``path`` records (its
    ``user_version``, bytes 60-63), read without SQLite; None if there is
    no file, or its header is not a sound SQLite one (SQLite then says
    why: its own schema format, bytes 44-47, must be 1 to 4).  Read before
    the store is opened for writing: a newer kvbroker's file is refused
    untouched -- an open to write makes the file owner-only, and closing it
    copies a WAL into it."""
    try:
        with open(path, "rb") as f:
            head = f.read(100)
    except (FileNotFoundError, IsADirectoryError):
        return None
    if (len(head) < 100 or not head.startswith(b"SQLite format 3\x00")
            or not 1 <= int.from_bytes(head[44:48], "big") <= 4):
        return None
    return int.from_bytes(head[60:64], "big")


def _refuse_newer(path: str) -> None:
    """:class:`NewerFormat` if the store file at ``path`` is a newer
    kvbroker's, found without writing it: from its header, or, when its WAL
    holds frames (the format may be set there only), through a read-only
    open, which never copies the WAL in.  Anything else wrong with the file
    is left for the open that follows to say."""
    check_format(header_format(path) or 0)
    wal = path + "-wal"
    try:
        if os.path.getsize(wal) == 0:
            return
    except OSError:
        return
    with contextlib.suppress(StoreLocked, OSError):
        try:
            SqliteStore(path, read_only=True).close()
        except NewerFormat:
            raise
        except sqlite3.Error:
            pass


def _version() -> str:
    from broker import __version__  # (not at import: broker imports this module)

    return __version__


RUNS_KEPT = 1000
"""Runs of the instance its store remembers (:meth:`SqliteStore.run_begin`)."""

Row = tuple[float, float | None, str, float | None]
"""A run as stored: start, finish or None, version, checkpoint period or None
(what :func:`broker.startlog.runs` reads)."""


def read_runs(db: sqlite3.Connection) -> list[Row]:
    """The runs table of ``db``, oldest first (a store of the table's first
    version has no checkpoint period: None)."""
    has_period = "checkpoint_period" in {row[1] for row in db.execute(
        "PRAGMA table_info(runs)")}
    rows = db.execute("SELECT started, finished, version"
                      + (", checkpoint_period" if has_period else ", NULL")
                      + " FROM runs ORDER BY id")
    return [(float(started), None if finished is None else float(finished), str(version),
             None if period is None else float(period))
            for started, finished, version, period in rows]


class Written(NamedTuple):
    """What :meth:`SqliteStore.put_many` did."""

    max_rowid: int
    existing: list[str]
    """Refs stored again: their row was there already."""


_HISTORY_TABLE = ("CREATE TABLE checkpoint_history (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                  "key TEXT NOT NULL, value BLOB NOT NULL)")
_RUNS_TABLE = ("CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, started REAL NOT NULL, "
               "finished REAL, version TEXT NOT NULL, checkpoint_period REAL)")


class StoreLocked(RuntimeError):
    """Another process holds the file (rank 0 of another instance on the
    same statedir): SQLite said ``database is locked``."""


class SqliteStore:
    """``objects(hash -> blob)``, ``checkpoints(key -> value)`` and the
    values those replaced, ``checkpoint_history(id, key, value)``: the
    newest :attr:`checkpoints_kept` - 1 of them per key; and the instance's
    runs, ``runs(id, started, finished, version)`` (:mod:`broker.startlog`),
    the newest :data:`RUNS_KEPT`.

    Writes are batched by the caller (:meth:`put_many` in one transaction);
    :meth:`sync` makes everything written so far durable.  Only rank 0's
    content module opens the file, so SQLite's locking is exclusive (no
    shared-memory WAL index, no lock calls per transaction).
    """

    def __init__(self, path: str, *, read_only: bool = False) -> None:
        self.path = path
        self.read_only = read_only
        """Opened without writing anything (:meth:`_open_read_only`): a
        store on a read-only file system, read by the offline tools."""
        self._lock_fd: int | None = None
        """Read-only: the descriptor holding this process's read lock."""
        self.checkpoints_kept = DEFAULT_CHECKPOINTS_KEPT
        """Checkpoints of a key kept, the current one included (1: no history)."""
        if read_only:
            self._open_read_only()
        else:
            _refuse_newer(path)
            self._open_writable()
        for table, needed in _COLUMNS.items():
            have = {row[1] for row in self.db.execute(f"PRAGMA table_info({table})")}
            missing = [c for c in needed if c not in have]
            if missing:  # (another program's file: every write would fail, EIO)
                self.close()
                raise sqlite3.DatabaseError(
                    f"not a kvbroker content store: its table {table} has no "
                    f"column {missing[0]}")
        columns = {row[1]: row[2] for row in self.db.execute("PRAGMA table_info(objects)")}
        self.text_keys = columns.get("hash", "").upper() == "TEXT"
        """A file from an older kvbroker: blobrefs as text keys."""

    def _open_writable(self) -> None:
        path = self.path
        # Owner-only, whatever the umask: the run directory is world-readable
        # when guests are allowed (SQLite gives -wal/-shm the same mode).
        # O_NOFOLLOW: not through a symlink planted in the directory.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            st = os.fstat(fd)
        finally:
            os.close(fd)
        self._identity = (st.st_dev, st.st_ino)
        """The file opened: :meth:`sync` checks that ``path`` still names it."""
        # A short busy timeout: the only contender is another instance
        # holding the file, whose exclusive lock lasts until it stops, so
        # waiting SQLite's usual 5 s only delays saying so (1 s still lets
        # an instance that is exiting right now go).
        self.db = sqlite3.connect(path, timeout=1.0, isolation_level=None,
                                  check_same_thread=False)
        try:
            self._open()
        except sqlite3.Error as exc:  # (not a database, locked, ...): never leave it open
            self.db.close()
            if isinstance(exc, sqlite3.OperationalError) and (
                    getattr(exc, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY,
                                                               sqlite3.SQLITE_LOCKED)
                    or "locked" in str(exc)):
                raise StoreLocked(f"{path}: {exc}") from None
            raise

    def _open_read_only(self) -> None:
        """Open a store this process cannot write, writing nothing.

        SQLite's ordinary read-only open (``mode=ro``) of a WAL-mode file
        needs its ``-shm`` file, which it cannot make there.  What works:

        * no WAL (or an empty one: a clean stop) -- ``immutable=1``: the
          main file is the whole store, read without locks or side files;
        * a WAL with frames (a crash, or a reader racing nothing: the file
          system is read-only) -- the ``unix-none`` VFS with exclusive
          locking mode, which keeps the WAL index in memory instead of the
          ``-shm`` file and reads the WAL as a writer would.  ``immutable``
          would ignore the WAL: the last checkpoints and runs lost.

        Neither takes a lock, so a read lock is taken here (:mod:`locks`):
        an instance holding the store through a writable mount of the same
        files is refused as for a writable statedir (:class:`StoreLocked`).
        Tables a store from an older kvbroker lacks are added empty as
        temporary ones (the writable open adds them to the file)."""
        path = self.path
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            locks.lock(fd, exclusive=False)
        except locks.Held:
            os.close(fd)
            raise StoreLocked(f"{path}: database is locked") from None
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        self._identity = (st.st_dev, st.st_ino)
        wal = path + "-wal"
        replay = os.path.exists(wal) and os.path.getsize(wal) > 0
        uri = f"file:{urllib.parse.quote(path)}?mode=ro&" + (
            "vfs=unix-none" if replay else "immutable=1")
        try:
            self.db = sqlite3.connect(uri, uri=True, isolation_level=None,
                                      check_same_thread=False)
        except sqlite3.Error:
            self._release_lock()
            raise
        try:
            if replay:
                self.db.execute("PRAGMA locking_mode=EXCLUSIVE")  # (before the first read)
            self.db.execute("PRAGMA temp_store=MEMORY")
            tables = {row[0] for row in self.db.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            for table, ddl in (("checkpoint_history", _HISTORY_TABLE), ("runs", _RUNS_TABLE)):
                if table not in tables:
                    self.db.execute(ddl.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))
        except sqlite3.Error as exc:
            self.close()
            raise sqlite3.OperationalError(
                f"{exc} (read without writing: the file"
                f"{' and its WAL' if replay else ''} could not be read as they are)") from None
        if version > STORE_FORMAT:
            self.close()
            check_format(version)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _open(self) -> None:
        self.db.execute("PRAGMA locking_mode=EXCLUSIVE")
        # (before anything is written: a newer kvbroker's file is not altered;
        # after the schema is read: a damaged header is SQLite's error, not
        # a "format" read from its bytes)
        self.db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        version = check_format(self.db.execute("PRAGMA user_version").fetchone()[0])
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS objects (hash BLOB PRIMARY KEY, object BLOB NOT NULL)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS checkpoints (key TEXT PRIMARY KEY, value BLOB NOT NULL)"
        )
        # (a file from an older kvbroker gains it empty: its history starts now)
        self.db.execute(_HISTORY_TABLE.replace("TABLE", "TABLE IF NOT EXISTS", 1))
        self.db.execute(_RUNS_TABLE.replace("TABLE", "TABLE IF NOT EXISTS", 1))
        if "checkpoint_period" not in {row[1] for row in self.db.execute(
                "PRAGMA table_info(runs)")}:  # (a store of the first version of runs)
            self.db.execute("ALTER TABLE runs ADD COLUMN checkpoint_period REAL")
        if version < STORE_FORMAT:
            self.db.execute(f"PRAGMA user_version={STORE_FORMAT}")

    def _key(self, ref: str) -> str | bytes:
        return ref if self.text_keys else digest_of(ref)

    def get(self, ref: str) -> bytes | None:
        row = self.db.execute("SELECT object FROM objects WHERE hash = ?",
                              (self._key(ref),)).fetchone()
        return None if row is None else bytes(row[0])

    def has(self, ref: str) -> bool:
        return self.db.execute("SELECT 1 FROM objects WHERE hash = ?",
                               (self._key(ref),)).fetchone() is not None

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> Written:
        """Insert ``(blobref, blob)`` pairs in one transaction; the store's
        highest rowid after it (:meth:`max_rowid`), and the refs whose row
        was there already (a blob stored again keeps its old row).

        Many rows per statement, not ``executemany``: sqlite3 releases the
        GIL around every step, and with the event loop thread busy each
        release is a GIL hand-off (two futex calls, two context switches).
        One statement per :data:`ROWS_PER_STATEMENT` rows makes that one
        hand-off per chunk.

        Each statement is then run once more with every parameter NULL,
        which inserts nothing (``OR IGNORE`` skips a NULL ``object``) but
        lets go of the blobs bound to it: sqlite3 keeps up to 128 prepared
        statements, one per batch size, each holding a copy of the values
        it last ran with.  Rank 0 held ~110 MB of blobs written long ago
        that way after 78 values of 4 MB, outside every cache limit.
        """
        items = list(items)
        pairs: list[tuple[str, bytes]] | list[tuple[bytes, bytes]]  # (key as stored, blob)
        if self.text_keys:
            pairs = items
        else:
            pairs = [(digest_of(ref), data) for ref, data in items]
        inserted: set[Any] = set()
        with self.db:
            self.db.execute("BEGIN")
            sizes = set()
            for i in range(0, len(pairs), ROWS_PER_STATEMENT):
                part = pairs[i:i + ROWS_PER_STATEMENT]
                cur = self.db.execute(_insert_sql(len(part)), [x for row in part for x in row])
                inserted.update(row[0] for row in cur)
                sizes.add(len(part))
            for rows in sizes:
                self.db.execute(_insert_sql(rows), [None] * (2 * rows)).fetchall()
        existing = [] if len(inserted) == len(pairs) else [
            ref for (ref, _), (key, _) in zip(items, pairs, strict=True) if key not in inserted]
        return Written(self.max_rowid(), existing)

    def max_rowid(self) -> int:
        """The highest rowid in ``objects`` (0: empty).  New rows get the next
        one, so rows at or below a value read earlier were all written
        before it -- as long as the highest row is never deleted, which
        :meth:`scan_rows` makes sure of (it never offers it for deletion).
        An online collection uses it to spare blobs written recently
        (:mod:`kvs.collect`)."""
        return int(self.db.execute("SELECT COALESCE(MAX(rowid), 0) FROM objects").fetchone()[0])

    def missing(self, refs: Iterable[str]) -> list[str]:
        """Those of ``refs`` not in the store."""
        return [ref for ref in refs if not self.has(ref)]

    def get_many(self, refs: Iterable[str]) -> dict[str, bytes]:
        """``{ref: blob}`` for those of ``refs`` in the store."""
        found: dict[str, bytes] = {}
        for ref in refs:
            row = self.db.execute("SELECT object FROM objects WHERE hash = ?",
                                  (self._key(ref),)).fetchone()
            if row is not None:
                found[ref] = bytes(row[0])
        return found

    def scan_rows(self, after: int, upto: int, limit: int) -> list[tuple[int, Any, str, int]]:
        """For an online collection: up to ``limit`` rows with ``after <
        rowid <= upto``, in rowid order, as ``(rowid, key, blobref, size)``.
        The highest row of the store is never among them (see
        :meth:`max_rowid`)."""
        upto = min(upto, self.max_rowid() - 1)
        rows = self.db.execute(
            "SELECT rowid, hash, LENGTH(object) FROM objects WHERE rowid > ? AND rowid <= ? "
            "ORDER BY rowid LIMIT ?", (after, upto, limit)).fetchall()
        return [(rowid, key, key if self.text_keys else ref_of(bytes(key)), size)
                for rowid, key, size in rows]

    def delete_keys(self, keys: list[Any]) -> None:
        """Delete the rows of ``keys`` (as :meth:`scan_rows` gave them), in one
        transaction."""
        self.db.execute("PRAGMA secure_delete=OFF")  # (see sweep)
        with self.db:
            self.db.execute("BEGIN")
            for i in range(0, len(keys), ROWS_PER_STATEMENT):
                part = keys[i:i + ROWS_PER_STATEMENT]
                self.db.execute("DELETE FROM objects WHERE hash IN (" + ",".join("?" * len(part))
                                + ")", part)

    def file_bytes(self) -> tuple[int, int]:
        """(bytes of the file, bytes of it free for reuse): SQLite's page counts."""
        size = int(self.db.execute("PRAGMA page_size").fetchone()[0])
        pages = int(self.db.execute("PRAGMA page_count").fetchone()[0])
        return pages * size, self.free_bytes()

    def space(self) -> tuple[int, int, int, int]:
        """(bytes the store takes on disk: its file and its WAL; of them, the
        WAL's; bytes of the file held by free pages; bytes of the pages in
        use).  The WAL keeps its largest size once grown, and what it holds
        not yet copied into the file will need as much room again there.
        The pages in use are the database's as SQLite reads it, WAL
        included: the file alone lacks the blobs whose frames are still in
        the WAL (until a checkpoint copies them), which is all of them
        while the WAL is under its checkpoint size."""
        sizes = []
        for name in (self.path, self.path + "-wal"):
            try:
                sizes.append(os.stat(name).st_blocks * 512)
            except FileNotFoundError:
                sizes.append(0)
        page = int(self.db.execute("PRAGMA page_size").fetchone()[0])
        free = int(self.db.execute("PRAGMA freelist_count").fetchone()[0])
        pages = int(self.db.execute("PRAGMA page_count").fetchone()[0])
        return sum(sizes), sizes[1], free * page, (pages - free) * page

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM objects").fetchone()[0])

    def checkpoint_put(self, key: str, value: bytes, keep_unsynced: bool = False) -> bool:
        """Write ``value`` under ``key``, durably, and keep the value it
        replaces in the key's history (:meth:`checkpoint_list`); if it
        cannot be made durable, put the old value back before raising: the
        caller reports the failure (a SYNC commit answered EIO), and a row
        left in the WAL could still come back at the next start, naming a
        root nobody acknowledged.

        ``keep_unsynced``: a root that was acknowledged, whose blobs were
        written by earlier transactions -- if only the sync fails (a full
        disk: the WAL cannot be copied into a main file that must grow),
        keep the row in the WAL and return False.  A restart after a crash
        of the process finds it there with those transactions before it
        (the WAL is replayed as a prefix), which is what the caller asks."""
        old = self.checkpoint_get(key)
        retired: int | None = None
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints (key, value) VALUES (?, ?)", (key, value)
            )
            if old is not None and old != value and self.checkpoints_kept > 1:
                retired = self.db.execute(
                    "INSERT INTO checkpoint_history (key, value) VALUES (?, ?)", (key, old)
                ).lastrowid
        try:
            self.sync()
        except sqlite3.Error:
            if keep_unsynced:
                self._prune_history(key)
                return False
            with contextlib.suppress(sqlite3.Error), self.db:
                self.db.execute("BEGIN")
                if old is None:
                    self.db.execute("DELETE FROM checkpoints WHERE key = ?", (key,))
                else:
                    self.db.execute("INSERT OR REPLACE INTO checkpoints (key, value) "
                                    "VALUES (?, ?)", (key, old))
                if retired is not None:
                    self.db.execute("DELETE FROM checkpoint_history WHERE id = ?", (retired,))
            raise
        self._prune_history(key)
        return True

    def _prune_history(self, key: str) -> None:
        """Drop ``key``'s retired values past the newest ``checkpoints_kept``
        - 1.  Not synced, and a failure is ignored: a row it leaves is one
        more old checkpoint, dropped by the next put."""
        with contextlib.suppress(sqlite3.Error), self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "DELETE FROM checkpoint_history WHERE key = ? AND id NOT IN (SELECT id "
                "FROM checkpoint_history WHERE key = ? ORDER BY id DESC LIMIT ?)",
                (key, key, max(0, self.checkpoints_kept - 1)))

    def checkpoint_get(self, key: str) -> bytes | None:
        row = self.db.execute("SELECT value FROM checkpoints WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def checkpoint_list(self, key: str) -> list[bytes]:
        """Every value of ``key`` kept, newest (the current one) first;
        empty if it has none."""
        current = self.checkpoint_get(key)
        if current is None:
            return []
        return [current, *(value for _, value in self.checkpoint_history_rows(key))]

    def all_checkpoints(self) -> list[tuple[str, bytes, int]]:
        """Every checkpoint kept, as ``(key, value, age)``: age 0 the current
        value of its key, 1 the one before, ..."""
        out = [(key, bytes(value), 0) for key, value in self.db.execute(
            "SELECT key, value FROM checkpoints ORDER BY key")]
        ages: dict[str, int] = {}
        for key, value in self.db.execute(
                "SELECT key, value FROM checkpoint_history ORDER BY key, id DESC"):
            ages[key] = ages.get(key, 0) + 1
            out.append((key, bytes(value), ages[key]))
        return out

    def checkpoint_history_rows(self, key: str) -> list[tuple[int, bytes]]:
        """``key``'s older values with their row ids, newest first: what
        :meth:`drop_checkpoint_history` takes."""
        return [(int(row_id), bytes(value)) for row_id, value in self.db.execute(
            "SELECT id, value FROM checkpoint_history WHERE key = ? ORDER BY id DESC", (key,))]

    def drop_checkpoint_history(self, ids: Iterable[int]) -> int:
        """Delete these older values (a garbage collection that deletes
        their trees); how many went."""
        with self.db:
            self.db.execute("BEGIN")
            cur = self.db.executemany("DELETE FROM checkpoint_history WHERE id = ?",
                                      ((i,) for i in ids))
        return int(cur.rowcount)

    def runs(self) -> list[Row]:
        """The instance's runs, oldest first: ``(started, finished or None,
        version, checkpoint period or None)`` (:mod:`broker.startlog`)."""
        return read_runs(self.db)

    def run_begin(self, started: float, version: str, period: float | None = None) -> int:
        """Record a run begun at ``started`` with ``kvs.checkpoint-period``
        ``period``, durably (before the instance serves: else a crash soon
        after would leave no trace of it); its id, for :meth:`run_end`.
        Only the newest :data:`RUNS_KEPT` are kept."""
        with self.db:
            self.db.execute("BEGIN")
            run = int(self.db.execute(
                "INSERT INTO runs (started, version, checkpoint_period) VALUES (?, ?, ?)",
                (started, version, period)).lastrowid or 0)
            self.db.execute("DELETE FROM runs WHERE id <= ?", (run - RUNS_KEPT,))
        self.sync()
        return run

    def run_period(self, run: int, period: float) -> None:
        """Run ``run``'s checkpoint period changed (``attr set``): what a
        crash of it may have lost is told by the newest."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("UPDATE runs SET checkpoint_period = ? WHERE id = ?",
                            (period, run))

    def run_end(self, run: int, finished: float) -> None:
        """Run ``run`` stopped cleanly at ``finished``, durably."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("UPDATE runs SET finished = ? WHERE id = ?", (finished, run))
        self.sync()

    def runs_put(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Add runs recorded elsewhere (a store emptied by ``content.restore``
        keeps its runs), after those here: ``(started, finished, version[,
        checkpoint period])``."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT INTO runs (started, finished, version, checkpoint_period) "
                "VALUES (?, ?, ?, ?)", ((*r[:3], r[3] if len(r) > 3 else None) for r in rows))

    def totals(self) -> tuple[int, int]:
        """(blobs, bytes of blob data) in the store."""
        n, size = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(LENGTH(object)), 0) FROM objects").fetchone()
        return int(n), int(size)

    def sweep(self, keep: Iterable[str], *, dry_run: bool = False) -> tuple[int, int]:
        """Delete every blob whose ref is not in ``keep``, in one transaction;
        (blobs, bytes) removed -- or that would be, with ``dry_run``.  The
        set goes into a temporary table so SQLite does the anti-join, not a
        Python loop over every row of a store of millions."""
        # Freed pages are not overwritten with zeros first (SQLite builds
        # with SECURE_DELETE do that): the WAL would grow by every page the
        # garbage held -- as much free space again as the garbage, on a
        # disk full enough to want a collection.  VACUUM drops them anyway.
        self.db.execute("PRAGMA secure_delete=OFF")
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute("CREATE TEMP TABLE keep (hash PRIMARY KEY) WITHOUT ROWID")
            try:
                self.db.executemany("INSERT OR IGNORE INTO keep (hash) VALUES (?)",
                                    ((self._key(ref),) for ref in keep))
                gone = "FROM objects WHERE hash NOT IN (SELECT hash FROM keep)"
                n, size = self.db.execute(
                    f"SELECT COUNT(*), COALESCE(SUM(LENGTH(object)), 0) {gone}").fetchone()
                if not dry_run:
                    self.db.execute(f"DELETE {gone}")
            finally:
                # (a failed statement may have rolled the table back already)
                self.db.execute("DROP TABLE IF EXISTS temp.keep")
        return int(n), int(size)

    def free_bytes(self) -> int:
        """Bytes of the file held by free pages (deleted blobs not yet compacted)."""
        pages = self.db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(pages) * int(self.db.execute("PRAGMA page_size").fetchone()[0])

    def check(self) -> str | None:
        """SQLite's ``quick_check``: None if the file is sound, else what is wrong."""
        rows = [r[0] for r in self.db.execute("PRAGMA quick_check")]
        return None if rows == ["ok"] else "; ".join(rows[:3])

    def compact_shortfall(self) -> str | None:
        """Whether a :meth:`compact` has room now: None if so, else what it
        needs and where, in a sentence.  Call it on the thread that compacts,
        right before: nothing writes in between.

        ``VACUUM`` writes the compacted copy twice: into a temporary
        database in SQLite's temporary directory (:func:`sqlite_temp_dir`,
        unless SQLite keeps temporary files in memory), then every page of
        it into the WAL, beside a main file that keeps its size until the
        final checkpoint truncates it.  Both are about the store's pages
        in use (its pages less the free ones); a WAL frame is a page and a
        24-byte header.  The WAL is emptied first (``TRUNCATE``), so the
        free space measured counts the room it held.  Without the room the
        copy failed half-way (``database or disk is full``), having taken
        every free byte of the file system for its WAL -- the room the
        free-space reserve keeps -- and kept it until the next compaction."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = int(self.db.execute("PRAGMA page_size").fetchone()[0])
        pages = (int(self.db.execute("PRAGMA page_count").fetchone()[0])
                 - int(self.db.execute("PRAGMA freelist_count").fetchone()[0]))
        pages += pages // 100 + 16  # (slack: the copy's own layout may differ a little)
        need: dict[int, list[Any]] = {}  # st_dev -> [directory, bytes needed, what for]
        here = os.path.dirname(os.path.abspath(self.path))
        need[os.stat(here).st_dev] = [here, pages * (size + 24) + 32, "its WAL"]
        temp = None if self._temp_in_memory() else sqlite_temp_dir()
        if temp is not None:
            entry = need.setdefault(os.stat(temp).st_dev, [temp, 0, ""])
            entry[1] += pages * size
            entry[2] = (f"{entry[2]} and " if entry[2] else "") + (
                f"SQLite's temporary copy (in {temp}: $SQLITE_TMPDIR, else $TMPDIR, "
                "else /var/tmp or /tmp)")
        for directory, wanted, what in need.values():
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
            if free < wanted:
                return (f"compacting needs about {wanted} bytes free on the file system of "
                        f"{directory} (for {what}: the {pages * size} bytes the store keeps, "
                        f"copied), and it has {free}")
        return None

    def compact_if_room(self) -> str | None:
        """:meth:`compact` if :meth:`compact_shortfall` finds room; else what
        it lacks, with nothing written."""
        shortfall = self.compact_shortfall()
        if shortfall is None:
            self.compact()
        return shortfall

    def _temp_in_memory(self) -> bool:
        """Whether SQLite keeps temporary databases in memory (its
        ``TEMP_STORE`` build option and ``PRAGMA temp_store``)."""
        built = 1
        for (option,) in self.db.execute("PRAGMA compile_options"):
            if str(option).startswith("TEMP_STORE="):
                built = int(str(option).partition("=")[2])
        pragma = int(self.db.execute("PRAGMA temp_store").fetchone()[0])
        return {0: False, 1: pragma == 2, 2: pragma != 1}.get(built, True)

    def compact(self) -> None:
        """Give the space of deleted blobs back to the file system (``VACUUM``),
        durably, with the WAL emptied.  If it fails (a full disk), the WAL is
        emptied all the same: the frames of the copy rolled back held the
        room it took, every free byte of the file system maybe, until the
        next compaction.  (Check :meth:`compact_shortfall` first.)"""
        try:
            self.db.execute("VACUUM")
        except sqlite3.Error:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            raise
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def sync(self) -> None:
        """Make every committed write durable (fsync through a WAL checkpoint).

        First, check that the store's path still names the file opened: one
        removed or replaced under the running instance (a cleanup job, an
        operator's ``rm``) took writes that nothing would ever read again
        -- a SYNC commit was acknowledged into it and the next start found
        an empty store, without a word (the crash audit).  That is a failed
        sync, as a full disk's: the SYNC commit fails ``EIO``, the stop
        says so and exits 1.  One ``stat`` per sync."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
            same = (st.st_dev, st.st_ino) == self._identity
        except OSError:
            same = False
        if not same:
            raise sqlite3.OperationalError(
                f"the store file {self.path} was removed or replaced while the instance "
                "ran, so nothing written is kept for the next start (the running "
                "instance still reads it: kvbroker kvs dump saves what it holds)")
        self.db.execute("PRAGMA wal_checkpoint(FULL)")

    def close(self) -> None:
        self.db.close()
        self._release_lock()  # (after SQLite's descriptor: the lock is the process's)


def open_to_read(path: str) -> SqliteStore:
    """The store at ``path`` for a tool that only reads it: opened as rank 0
    opens it where it can be written (locked the same way), else read-only
    (:meth:`SqliteStore._open_read_only`: a read-only file system, a
    snapshot), instead of failing with the raw errno of opening it to write."""
    return SqliteStore(path, read_only=locks.unwritable(path) is not None)
