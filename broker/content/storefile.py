"""Replacing rank 0's store file whole, so that a kill at any point leaves
the old store or the new one, never neither and never a part.

A restore (``-S content.restore``, ``kvbroker kvs restore --checkpoint``
into a statedir with no store yet) builds the new store under a temporary
name beside the old one (:func:`temp_path`), with the runs it keeps, and
:func:`install` renames it over ``content.sqlite`` once it is whole and on
disk.  Emptying the old store first, as Flux's truncate does, left no store
or a half-restored one, with no checkpoint and no run history, to a start
killed in between (the crash audit).

SQLite's side files are the trap: an old ``content.sqlite-wal`` left next
to the renamed new file would be replayed into the wrong database, and a
``-wal`` of the temporary file would be lost by the rename.  So the new
store is sealed in rollback mode (no WAL: everything in its one file), the
old one is checkpointed and closed by SQLite (which empties and removes
its WAL), its side files are removed, and only then is the name moved.

A start removes what a killed restore left under the temporary name
(:func:`remove_leftover`), unless a live restore holds it: a restore
holds an ``flock`` on its temporary file from the moment it makes it until
the file is renamed into place or removed (:func:`create` ..
:func:`install` / :func:`discard`).  Not SQLite's own lock: that one is a
POSIX lock, which SQLite drops when it closes the file to seal it, so the
finished file sat unlocked until its rename, and a second restore (or a
start) took it for a leftover, removed it, and the first linked the
second's half-written file into place and said it had succeeded (a review
audit).  An ``flock`` belongs to its own open file, whatever SQLite opens
or closes, and SQLite's locks never meet it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3

from broker.content import locks
from broker.content.sqlite import SqliteStore, StoreLocked

TEMP_SUFFIX = ".restoring"
"""The temporary file's name is the store's with this added."""
SIDE_FILES = ("-wal", "-shm", "-journal")
"""The files SQLite keeps beside a database file (their names: its own + these)."""


def temp_path(path: str) -> str:
    """Where the store that will replace ``path`` is built."""
    return path + TEMP_SUFFIX


_held: dict[str, int] = {}
"""Temporary file -> the descriptor holding its ``flock``, for each restore
this process runs (from :func:`create` to :func:`install` or :func:`discard`)."""


def remove_leftover(path: str) -> bool:
    """Remove what a killed restore left in place of the store ``path``
    (its temporary file and that file's side files); whether there was
    such a thing.  :class:`StoreLocked` if a restore running now holds it
    (another instance starting on the same statedir).  A temporary name
    that is a second name of the store itself (a restore into a new
    statedir killed between its ``link`` and removing the name) is removed
    quietly: that restore had finished."""
    temp = temp_path(path)
    if not os.path.lexists(temp):  # (and a read-only file system says EROFS, not ENOENT)
        return _unlink(temp, sides_only=True)  # (a kill between removing them and it)
    fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        _flock(fd, temp)
        if not _names(temp, fd):
            raise StoreLocked(f"{temp}: made again by another restore as this one looked")
        with contextlib.suppress(FileNotFoundError):
            if os.path.samefile(temp, path):
                os.unlink(temp)
                return False
        return _unlink(temp)  # (held: no restore can use it meanwhile)
    finally:
        os.close(fd)


def create(path: str) -> SqliteStore:
    """A new, empty store under ``path``'s temporary name, held (``flock``)
    until :func:`install` or :func:`discard`; what an earlier killed
    restore left there removed first.  :class:`StoreLocked` if another
    restore holds that name."""
    remove_leftover(path)
    temp = temp_path(path)
    try:
        fd = os.open(temp, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # (another restore made it since the leftover went)
        raise StoreLocked(f"{temp}: a restore is writing it") from None
    try:
        _flock(fd, temp)
        if not _names(temp, fd):  # (removed by another's remove_leftover before our flock)
            raise StoreLocked(f"{temp}: removed by another restore as this one began")
        store = SqliteStore(temp)  # (an empty file: SQLite makes a new database of it)
    except BaseException:
        os.close(fd)
        raise
    _held[temp] = fd
    return store


def discard(store: SqliteStore) -> None:
    """Close and remove a temporary store that will not be installed."""
    store.close()
    try:
        _unlink(store.path)
    finally:
        _release(store.path)


def _flock(fd: int, name: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise StoreLocked(f"{name}: a restore is writing it") from None


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _release(temp: str) -> None:
    fd = _held.pop(temp, None)
    if fd is not None:
        os.close(fd)


def install(new: SqliteStore, path: str, old: SqliteStore | None) -> None:
    """Put the temporary store ``new`` (from :func:`create`) in place of the
    store ``path``: the store ``old``, open (and so locked against another
    instance) since before ``new`` was begun, or None if there was none.
    Both are closed.  On an error the old store is left whole, and ``new``
    as a leftover for the caller to :func:`discard`.

    Order, each step safe to be killed after:

    1. ``new`` into rollback mode (its WAL copied in and removed), closed,
       fsynced: one whole file, nothing beside it.
    2. ``old`` checkpointed and closed: its main file is the whole store and
       SQLite removes its WAL.  Closing drops SQLite's lock, so this process
       takes the same lock itself, refused if another process got the file
       in between, and checks the name still names the file it closed.
    3. Any side file of ``path`` removed (stale: nothing holds the file).
    4. ``new`` renamed to ``path`` (without an old store: linked, refused if
       a store appeared meanwhile), the directory fsynced.

    After step 4 the new file is not locked until its opener opens it (the
    lock of step 2 is on the old file; a lock held by this process on the
    new one would be dropped with SQLite's own when it is released): another
    instance starting in that instant gets the new store whole, and the
    opener is refused."""
    _seal(new)
    fd: int | None = None
    held = _held.get(new.path)
    try:
        if held is None or not _names(new.path, held):  # (never another's file)
            raise StoreLocked(f"{new.path}: no longer the file this restore wrote")
        if old is not None:
            fd = _retire(old, path)
        for side in SIDE_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + side)
        if old is not None:
            os.rename(new.path, path)
        else:
            _link_new(new.path, path)
        _fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        if fd is not None:
            os.close(fd)
        if held is not None and not os.path.lexists(new.path):
            _release(new.path)  # (installed; else discard() lets go of it)


def _seal(store: SqliteStore) -> None:
    """Step 1 of :func:`install`."""
    busy = store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
    mode = store.db.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
    if busy or str(mode).lower() != "delete":
        store.close()
        raise sqlite3.OperationalError(f"{store.path}: could not leave WAL mode ({mode})")
    store.close()  # (in rollback mode with nothing pending: no journal left)
    for side in SIDE_FILES:
        if os.path.exists(store.path + side):
            raise sqlite3.OperationalError(f"{store.path}{side} is left after closing it")
    fd = os.open(store.path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _retire(old: SqliteStore, path: str) -> int:
    """Step 2 of :func:`install`: the descriptor holding the lock."""
    busy = old.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
    if busy:
        raise sqlite3.OperationalError(f"{path}: its WAL could not be copied into it")
    identity = old._identity
    old.close()
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        try:
            locks.lock(fd, exclusive=True)
        except locks.Held:
            raise StoreLocked(f"{path}: opened by another process as the restore "
                              "finished") from None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            raise StoreLocked(f"{path}: replaced by another process as the restore finished")
        wal = path + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:  # (closing could not empty it)
            raise sqlite3.OperationalError(f"{wal} could not be emptied into {path}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link_new(temp: str, path: str) -> None:
    """Step 4 without an old store: never over a store that appeared."""
    try:
        os.link(temp, path)
    except FileExistsError:
        raise StoreLocked(f"{path}: made by another process during the restore") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.exists(path):  # (a file system without hard links)
            raise StoreLocked(f"{path}: made by another process during the "
                              "restore") from None
        os.rename(temp, path)
        return
    os.unlink(temp)  # (killed before this: the next start removes the extra name)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str, *, sides_only: bool = False) -> bool:
    """Remove ``path``'s side files, then ``path`` (a side file left
    without its database would be replayed into the next file of that
    name); whether any was there."""
    found = False
    for name in [path + side for side in SIDE_FILES] + ([] if sides_only else [path]):
        if os.path.lexists(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
            found = True
    return found
