"""broker.content.sqlite: rank 0's SQLite backing store (unit, real files),
and the content module's write-back onto it."""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
from contextlib import closing

import pytest
from test_broker_support import rank0_content

from broker.content import module as content_module
from broker.content.blobref import hash_blob
from broker.content.module import BLOB_OVERHEAD, FLUSH_DELAY, ContentModule
from broker.content.sqlite import SqliteStore, digest_of
from broker.errors import ErrnoError


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


def test_written_blobs_are_not_kept_by_sqlites_statement_cache(tmp_path) -> None:
    """sqlite3 caches a prepared statement per batch size, each holding the
    values it last ran with: written blobs stayed in rank 0's memory (~110
    MB after 78 values of 4 MB), outside every cache limit.  SQLite's own
    count of the memory it holds tells, whatever malloc does with it."""
    ctypes = pytest.importorskip("ctypes")
    try:
        lib = ctypes.CDLL("libsqlite3.so.0")
    except OSError:
        pytest.skip("the sqlite3 module's library is not libsqlite3.so.0")
    lib.sqlite3_memory_used.restype = ctypes.c_int64
    store = SqliteStore(str(tmp_path / "content.sqlite"))
    try:
        before = lib.sqlite3_memory_used()
        for rows in range(1, 31):  # 30 batch sizes: 30 cached statements
            blobs = [os.urandom(64 << 10) for _ in range(rows)]
            store.put_many([(hash_blob(b), b) for b in blobs])
        held = lib.sqlite3_memory_used() - before
        written = sum(range(1, 31)) * (64 << 10)  # ~30 MB
        assert held < written / 10, f"SQLite holds {held} bytes after writing {written}"
        assert store.count() == sum(range(1, 31))
    finally:
        store.close()


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


def disk_full() -> None:
    """A stand-in for :meth:`SqliteStore.sync` on a full disk."""
    raise sqlite3.OperationalError("database or disk is full")


def test_a_checkpoint_that_could_not_be_made_durable_is_taken_back(tmp_path) -> None:
    """The row was committed before the WAL checkpoint that makes it
    durable; when that failed (a full disk), the caller failed the SYNC
    commit, yet the row stayed and a restart could restore a root nobody
    acknowledged.  The old value is put back first, and the error says
    what it is (ENOSPC, not an internal error)."""
    store = SqliteStore(str(tmp_path / "c.db"))
    store.checkpoint_put("k", b"old")
    store.sync = disk_full  # type: ignore[method-assign]
    with pytest.raises(sqlite3.OperationalError):
        store.checkpoint_put("k", b"new")
    assert store.checkpoint_get("k") == b"old"
    with pytest.raises(sqlite3.OperationalError):
        store.checkpoint_put("fresh", b"new")
    assert store.checkpoint_get("fresh") is None
    store.close()
    with pytest.raises(ErrnoError) as info, content_module._store_errors():
        disk_full()
    assert info.value.errnum == errno.ENOSPC
    assert str(info.value.errstr) == ("writing to the content store failed: database or "
                                      "disk is full")


def test_a_checkpoint_taken_back_leaves_no_older_one_behind(tmp_path) -> None:
    """A put whose sync fails puts the old value back (the caller reports
    the error): the history row it added goes too, or the old value would
    be listed twice."""
    store = SqliteStore(str(tmp_path / "c.db"))
    store.checkpoint_put("k", b"old")
    store.checkpoint_put("k", b"current")

    store.sync = disk_full  # type: ignore[method-assign]
    with pytest.raises(sqlite3.OperationalError):
        store.checkpoint_put("k", b"new")
    assert store.checkpoint_list("k") == [b"current", b"old"]
    # kept unsynced (an acknowledged root): it stays, and so does its history
    assert store.checkpoint_put("k", b"new", keep_unsynced=True) is False
    assert store.checkpoint_list("k") == [b"new", b"current", b"old"]
    store.close()


async def test_a_failed_write_back_fails_the_drain_and_is_retried(tmp_path) -> None:
    """The content module's write-back onto the store: a batch SQLite refused
    fails the drain with EIO (so content.flush and content.checkpoint-put
    never report blobs durable, nor record a root naming them, when they are
    not), keeps the blobs dirty, and the next drain writes them."""
    content = rank0_content(tmp_path)
    await content.start()
    store = content.backing
    assert store is not None
    put_many = store.put_many

    def refuse(items: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    store.put_many = refuse  # type: ignore[method-assign]
    (ref,) = content.store_local([b"blob"])
    with pytest.raises(ErrnoError) as info:
        await asyncio.wait_for(content._drain(), 10)
    assert info.value.errnum == errno.EIO and "disk I/O error" in str(info.value)
    assert ref in content.dirty and store.get(ref) is None

    def full(items: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    store.put_many = full  # type: ignore[method-assign]
    with pytest.raises(ErrnoError) as info:  # as a checkpoint's or a flush's sync says it
        await asyncio.wait_for(content._drain(), 10)
    assert info.value.errnum == errno.ENOSPC
    store.put_many = put_many  # type: ignore[method-assign]
    await asyncio.wait_for(content._drain(), 10)
    assert not content.dirty and store.get(ref) == b"blob"
    await content.stop()


async def test_rank_0s_cache_comes_back_to_its_limit_once_written(tmp_path) -> None:
    """Blobs not yet written back are never evicted, so a burst leaves rank
    0's cache over ``content.cache-bytes``; it used to stay there while idle
    (20-40 MB over a 1 MiB limit), as nothing trimmed it after the write."""
    content = rank0_content(tmp_path, **{"content.cache-bytes": "100000"})
    await content.start()
    try:
        refs = content.store_local([os.urandom(10_000) for _ in range(100)])  # 1 MB, all dirty
        assert content.cache_bytes == 100 * (10_000 + BLOB_OVERHEAD)
        await asyncio.wait_for(content._drain(), 10)
        assert content.cache_bytes <= 100_000
        assert refs[-1] in content.cache  # the most recent stay
        assert content.backing is not None and content.backing.count() == 100
    finally:
        await content.stop()


async def test_without_a_statedir_blobs_go_to_disk_only_to_make_room(tmp_path) -> None:
    """The file is in the run directory and goes with it: under its limit
    the cache keeps new blobs in memory only (no SQLite work per commit);
    over it, the oldest are written and evicted.  With a statedir they are
    written within FLUSH_DELAY whatever the cache holds."""
    def module(**attrs: str) -> ContentModule:
        return rank0_content(tmp_path, **{"content.cache-bytes": "200000", **attrs})

    content = module()
    await content.start()
    try:
        assert not content.persistent and content.backing is not None
        content.store_local([os.urandom(1000) for _ in range(50)])  # 60 KB: room enough
        # A deliberate wait for something that must NOT happen: three flush
        # delays pass, and under the limit nothing is written.
        await asyncio.sleep(3 * FLUSH_DELAY)
        assert len(content.dirty) == 50 and not content._writes
        assert content.backing.count() == 0
        refs = content.store_local([os.urandom(10_000) for _ in range(30)])  # over
        while content._writes:
            await asyncio.wait_for(asyncio.gather(*list(content._writes)), 10)
        assert content.backing.count() == 80 and not content.dirty
        assert content.cache_bytes <= 200_000 and refs[-1] in content.cache
    finally:
        await content.stop()

    state = tmp_path / "state"
    state.mkdir()
    content = module(statedir=str(state))
    await content.start()
    try:
        assert content.persistent
        content.store_local([b"one blob"])
        for _ in range(100):
            if content.backing is not None and not content.dirty and not content._writes:
                break
            await asyncio.sleep(FLUSH_DELAY)
        assert content.backing is not None and content.backing.count() == 1
    finally:
        await content.stop()
