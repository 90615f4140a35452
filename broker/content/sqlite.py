"""Rank 0's backing store: blobs and checkpoints in one SQLite file (WAL mode)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable


class SqliteStore:
    """``objects(hash -> blob)`` and ``checkpoints(key -> value)``.

    Writes are batched by the caller (:meth:`put_many` in one transaction);
    :meth:`sync` makes everything written so far durable.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        # Owner-only, whatever the umask: the run directory is world-readable
        # when guests are allowed (SQLite gives -wal/-shm the same mode).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS objects (hash TEXT PRIMARY KEY, object BLOB NOT NULL)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS checkpoints (key TEXT PRIMARY KEY, value BLOB NOT NULL)"
        )

    def get(self, ref: str) -> bytes | None:
        row = self.db.execute("SELECT object FROM objects WHERE hash = ?", (ref,)).fetchone()
        return None if row is None else bytes(row[0])

    def put_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT OR IGNORE INTO objects (hash, object) VALUES (?, ?)", items
            )

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM objects").fetchone()[0])

    def checkpoint_put(self, key: str, value: bytes) -> None:
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT OR REPLACE INTO checkpoints (key, value) VALUES (?, ?)", (key, value)
            )
        self.sync()

    def checkpoint_get(self, key: str) -> bytes | None:
        row = self.db.execute("SELECT value FROM checkpoints WHERE key = ?", (key,)).fetchone()
        return None if row is None else bytes(row[0])

    def sync(self) -> None:
        """Make every committed write durable (fsync through a WAL checkpoint)."""
        self.db.execute("PRAGMA wal_checkpoint(FULL)")

    def close(self) -> None:
        self.db.close()
