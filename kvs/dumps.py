"""Flux's ``content.dump`` and ``content.restore``: rank 0 dumps the KVS
checkpoint to an archive as it stops, and restores one into an emptied
store as it starts -- an offline garbage collection across a restart, as
Flux's rc3 and rc1 scripts do with ``flux dump --checkpoint`` and ``flux
restore --checkpoint``.

* ``-S content.dump=FILE`` writes the archive to FILE (a tar, compressed
  as its name says: :mod:`kvs.archive`); ``auto`` writes
  ``DIR/dump/YYYYmmdd_HHMMSS.tgz`` and points the symlink
  ``DIR/dump/RESTORE`` at it, where DIR is the statedir, or without one
  rank 0's working directory (as Flux's ``.``).
* ``-S content.restore=FILE`` replaces the store with one that holds
  FILE restored, before the KVS loads (a FILE that does not exist: an
  empty store all the same, as Flux's truncate); ``auto`` restores what
  ``DIR/dump/RESTORE`` names, if it exists, then removes the link (the
  archive stays), and otherwise leaves the store as it is.  The new store
  keeps the old one's runs (``kvbroker startlog``), and replaces it only
  once whole (:mod:`broker.content.storefile`): a start killed during the
  restore leaves the old store as it was.

The content module calls these on rank 0 with its store closed: before it
opens the store (:func:`restore_at_start`) and after it closed it at stop
(:func:`dump_at_stop`).  They block, so it runs them in a thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any

from broker.content.module import BLOB_SIZE_LIMIT, DUMP, RESTORE
from broker.content.sqlite import STORE_FILE
from broker.errors import ErrnoError, LastingFault

RESTORE_SIZE_LIMIT = 100 * 1024 * 1024
"""Largest value a restore at start takes (Flux's rc1: ``--size-limit=100M``)."""
AUTO = "auto"
LINK = "RESTORE"

log = logging.getLogger("kvbroker.content")


def _auto_dir(statedir: str) -> str:
    """Where ``auto`` dumps go: the statedir's ``dump``, else the working
    directory's (Flux's ``.`` for an instance whose statedir is removed)."""
    return os.path.join(statedir or os.getcwd(), "dump")


def restore_at_start(attrs: Mapping[str, Any], store_dir: str, statedir: str,
                     progress: Callable[[int], None] | None = None) -> str | None:
    """Before rank 0's content store opens: apply ``content.restore`` to
    ``store_dir/content.sqlite``, counting each key and directory read with
    ``progress`` (a start that restores a large archive is not a hung
    one).  The archive restored, if any."""
    from kvs import archive  # (the archive code needs the kvs engines)

    setting = str(attrs.get(RESTORE.name) or "")
    if not setting:
        return None
    link: str | None = None
    if setting == AUTO:
        link = os.path.join(_auto_dir(statedir), LINK)
        if not os.path.islink(link):
            return None
        path = os.path.realpath(link)
    else:
        path = os.path.abspath(setting)
    restored = None
    with contextlib.ExitStack() as stack:
        old = None
        if os.path.exists(os.path.join(store_dir, STORE_FILE)):
            # Open (and so locked) until the new store is in its place: never
            # empty a store another instance has open, nor let one open it
            # while its runs are carried over.
            try:
                old = stack.enter_context(archive.open_stopped_store(
                    store_dir, create=False,
                    instead="content.restore empties it: stop that one"))
            except archive.ArchiveError as exc:  # (in use: EBUSY; damaged: EIO; ...)
                # (a newer format or a damaged file: exit 2, as without the restore)
                raise (LastingFault if exc.lasting else ErrnoError)(
                    exc.errnum, f"content.restore: {exc}") from None
        try:
            runs = old.runs() if old is not None and statedir else []  # (kept: startlog)
        except sqlite3.Error as exc:
            raise ErrnoError(errno.EIO, f"content.restore: {old.path if old else ''}: "
                                        f"{exc}") from None
        if os.path.isfile(path):
            log.info("restoring content from %s", path)
        else:
            log.warning("content.restore %s: no such file: the store starts empty", path)
        started = time.monotonic()
        try:
            report = archive.replace_store(
                store_dir, path if os.path.isfile(path) else None, old=old, runs=runs,
                size_limit=RESTORE_SIZE_LIMIT,
                on_item=None if progress is None else lambda item: progress(1),
                blob_limit=BLOB_SIZE_LIMIT.value(attrs))
        except (archive.ArchiveError, OSError) as exc:
            raise ErrnoError(_errnum(exc), f"content.restore {path}: {_why(exc, path)}") from None
        # (as kvs restore says them on stderr, and the dump at stop logs its
        # own: unsaid, a value over the size limit was gone without a word)
        for what in report.skipped:
            log.warning("content.restore: skipped %s", what)
        if report.rootref:
            log.info("restored %d keys and %d empty directories (%d blobs) from %s in %.1f s",
                     report.keys, report.dirs, report.blobs, path, time.monotonic() - started)
            restored = path
    if link is not None:
        os.unlink(link)
    return restored


def dump_at_stop(attrs: Mapping[str, Any], store_dir: str, statedir: str,
                 on_bytes: Callable[[int], None] | None = None) -> str | None:
    """After rank 0's content store closed at stop: apply ``content.dump``.
    The archive written, if any.  Blobs the checkpoint names that the store
    lacks are left out and logged (Flux's ``--ignore-failed-read``).
    ``on_bytes(n)``: each entry written, with its bytes (from this thread)."""
    from kvs import archive

    setting = str(attrs.get(DUMP.name) or "")
    if not setting:
        return None
    link: str | None = None
    if setting == AUTO:
        where = _auto_dir(statedir)
        os.makedirs(where, exist_ok=True)
        path = os.path.join(where, time.strftime("%Y%m%d_%H%M%S") + ".tgz")
        link = os.path.join(where, LINK)
    else:
        path = os.path.abspath(setting)
    log.info("dumping content to %s", path)
    try:
        report = archive.dump_checkpoint(
            store_dir, path, ignore_failed_read=True,
            on_item=None if on_bytes is None else lambda item: on_bytes(len(item.data) + 1))
    except (archive.ArchiveError, OSError) as exc:
        raise ErrnoError(_errnum(exc), f"content.dump {path}: {_why(exc, path)}") from None
    for what in report.skipped:
        log.error("content.dump: left out %s", what)
    if link is not None:
        try:
            os.unlink(link)
        except FileNotFoundError:
            pass
        os.symlink(os.path.basename(path), link)
    return path


def _errnum(exc: Exception) -> int:
    """An OSError's errno, an ``archive.ArchiveError``'s (imported late:
    see :func:`restore_at_start`), else ``EIO``."""
    if isinstance(exc, OSError):
        return exc.errno or errno.EIO
    return int(getattr(exc, "errnum", errno.EIO))


def _why(exc: Exception, path: str) -> str:
    """The reason alone, without the path the message names already."""
    why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    return why.removeprefix(f"{path}: ")
