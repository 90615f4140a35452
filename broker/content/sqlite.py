"""Rank 0's backing store: blobs and checkpoints in one SQLite file (WAL mode)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from functools import lru_cache

ROWS_PER_STATEMENT = 400
"""Two parameters a row: within SQLite's historic limit of 999 parameters."""


@lru_cache(maxsize=8)
def _insert_sql(rows: int) -> str:
    return "INSERT OR IGNORE INTO objects (hash, object) VALUES " + ",".join(["(?, ?)"] * rows)


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
        """Insert ``(blobref, blob)`` pairs in one transaction.

        Many rows per statement, not ``executemany``: sqlite3 releases the
        GIL around every step, and with the event loop thread busy each
        release is a GIL hand-off (two futex calls, two context switches).
        One statement per :data:`ROWS_PER_STATEMENT` rows makes that one
        hand-off per chunk.
        """
        items = list(items)
        with self.db:
            self.db.execute("BEGIN")
            for i in range(0, len(items), ROWS_PER_STATEMENT):
                part = items[i:i + ROWS_PER_STATEMENT]
                self.db.execute(_insert_sql(len(part)), [x for row in part for x in row])

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
