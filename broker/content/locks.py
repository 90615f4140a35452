"""SQLite's file locks, taken and tested from outside SQLite, and whether a
store file can be written at all.

Rank 0 holds its store with SQLite's exclusive locking mode: a POSIX write
lock on the file's "shared" byte range for as long as the store is open.
Two callers need that lock without a SQLite connection that takes it:

* a reader of a store it cannot write (a read-only file system): SQLite's
  read-only connections that work there take no lock at all, so the reader
  takes a read lock on the same bytes itself -- refused while an instance
  holds the store (through a writable mount of the same files), and
  keeping one from starting on it while the read lasts;
* the swap of a restored store over the old one (:mod:`broker.content.storefile`),
  which must keep the old store locked between closing its SQLite
  connection and renaming the new file over it.

POSIX locks belong to the process, and closing *any* descriptor of the file
drops them all: these locks are taken on files the process has no SQLite
connection to, or released before it opens one.
"""

from __future__ import annotations

import errno
import fcntl
import os

PENDING_BYTE = 0x40000000
"""SQLite's lock bytes (os_unix.c): the pending byte, the reserved byte
after it, then the shared range."""
SHARED_FIRST = PENDING_BYTE + 2
SHARED_SIZE = 510

_HELD = (errno.EACCES, errno.EAGAIN)
"""What ``F_SETLK`` says when another process holds a conflicting lock."""
_UNSUPPORTED = (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS)
"""What it says where the file system has no locks (some network mounts):
whether the store is held cannot be known there, and is not claimed."""


class Held(OSError):
    """Another process holds a SQLite lock on the file."""


def lock(fd: int, *, exclusive: bool) -> bool:
    """Take SQLite's shared (``exclusive``: exclusive) lock on the open file
    ``fd``, without waiting.  True if taken, False where the file system
    has no locks; :class:`Held` if another process holds a conflicting one."""
    try:
        fcntl.lockf(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB,
                    SHARED_SIZE, SHARED_FIRST, os.SEEK_SET)
    except OSError as exc:
        if exc.errno in _HELD:
            raise Held(exc.errno, "locked by another process") from None
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


def read_only_fs(path: str) -> bool:
    """Whether ``path`` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def unwritable(path: str) -> str | None:
    """Why the store file ``path`` (or, if it does not exist yet, its
    directory) cannot be written -- ``read-only file system`` or
    ``permission denied`` -- or None if it can.  SQLite also writes files
    beside it (its WAL), so the directory counts too."""
    directory = os.path.dirname(os.path.abspath(path))
    for p in (directory, path):
        if not os.path.exists(p):
            continue
        if read_only_fs(p):
            return "read-only file system"
        if not os.access(p, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            return "permission denied"
    return None


def write_refused(exc: BaseException) -> str | None:
    """``read-only file system`` or ``permission denied`` if ``exc`` is the
    file system refusing a write, else None."""
    if isinstance(exc, OSError):
        if exc.errno == errno.EROFS:
            return "read-only file system"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "permission denied"
    return None


READERS = ("kvs fsck", "kvs dump --checkpoint", "startlog --statedir",
           "content checkpoint list", "kvs gc --dry-run")
"""The offline tools that read a store they cannot write (the error of the
others names them)."""


def cannot_write(path: str, why: str) -> str:
    """The one-line error of an offline tool that would write the store
    ``path`` and cannot (``why``: :func:`unwritable`)."""
    return (f"{path}: cannot be written ({why}), and this command changes the store "
            f"({', '.join(READERS)} only read it)")
