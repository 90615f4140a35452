"""broker.content.sqlite: rank 0's SQLite backing store (unit, real files)."""

from __future__ import annotations

import sqlite3
from contextlib import closing

from broker.content.blobref import hash_blob
from broker.content.sqlite import SqliteStore, digest_of


def test_blobs_are_keyed_by_raw_digest(tmp_path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    blobs = {hash_blob(b"x%d" % i): b"x%d" % i for i in range(1000)}
    store.put_many(blobs.items())
    store.put_many(list(blobs.items())[:10])  # storing again is a no-op
    assert store.count() == 1000
    assert all(store.get(ref) == data for ref, data in blobs.items())
    assert store.get(hash_blob(b"absent")) is None
    store.close()
    with closing(sqlite3.connect(tmp_path / "c.db")) as db:
        keys = [row[0] for row in db.execute("SELECT hash FROM objects LIMIT 5")]
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert digest_of(hash_blob(b"y", "sha1")) == bytes.fromhex(hash_blob(b"y", "sha1")[5:])


def test_a_store_with_text_keys_keeps_working(tmp_path) -> None:
    # A file written by an older kvbroker, blobrefs as text keys.
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE objects (hash TEXT PRIMARY KEY, object BLOB NOT NULL)")
    old_ref = hash_blob(b"old")
    db.execute("INSERT INTO objects VALUES (?, ?)", (old_ref, b"old"))
    db.commit()
    db.close()
    store = SqliteStore(str(path))
    assert store.text_keys
    assert store.get(old_ref) == b"old"
    new_ref = hash_blob(b"new")
    store.put_many([(new_ref, b"new")])
    assert store.get(new_ref) == b"new" and store.count() == 2
    store.close()
