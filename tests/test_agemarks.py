"""Expiry by age (broker/agemarks.py) of the kvs module's caches, without a
broker: a blob or decoded object unused for MARKS periods goes, a used one
stays, and the caches' sizes and counts account for the marks exactly.
The content cache's expiry, and the attributes, are tested on real ranks
in test_cache_expiry.py."""

from __future__ import annotations

import pytest

from broker.agemarks import MARKS, expire_seconds, is_mark
from broker.content.blobref import hash_blob
from broker.content.module import BLOB_OVERHEAD
from kvs import treeobj as T
from kvs.blobs import BlobStore


def _blob(i: int) -> tuple[str, bytes]:
    data = b"%d" % i * 100
    return hash_blob(data), data


def test_blob_store_forgets_blobs_unused_for_marks_periods() -> None:
    store = BlobStore()
    (a, da), (b, db), (c, dc) = _blob(1), _blob(2), _blob(3)
    store.put(a, da)
    store.put(b, db)
    store.age()  # a and b are in front of this period's mark
    store.put(c, dc)
    assert store.get(a) == da  # used since: a stays
    for _ in range(MARKS - 1):
        assert store.age() == 0  # (the first mark is not yet MARKS periods old)
    assert store.age() == 1  # b, unused since the first mark
    assert store.get(b) is None and store.get(a) == da and store.get(c) == dc
    assert len(store) == 2 and store.expired == 1
    # what is left is the two blobs and the marks, accounted as entries
    assert store.size == len(da) + len(dc) + 2 * BLOB_OVERHEAD + MARKS * BLOB_OVERHEAD
    for _ in range(MARKS + 1):
        store.age()
    assert len(store) == 0 and store.expired == 3
    assert store.size == MARKS * BLOB_OVERHEAD
    store.drop()
    assert store.size == 0 and len(store) == 0


def test_blob_store_put_again_counts_as_a_use() -> None:
    store = BlobStore()
    (a, da), (b, db) = _blob(1), _blob(2)
    store.put(a, da)
    store.put(b, db)
    store.age()
    store.put(a, da)  # stored again (a commit wrote the same blob): used
    for _ in range(MARKS):
        store.age()
    assert store.get(a) == da and store.get(b) is None


def test_blob_store_size_bound_and_marks_together() -> None:
    """The LRU's own bound may evict marks with the blobs before them: the
    size stays exact, and the expiry goes on from the next mark.  (The
    marks themselves may take the store past its bound, by at most MARKS + 1
    entries' overhead: ~2 KB.)"""
    (a, da) = _blob(1)
    store = BlobStore(limit=len(da) + 3 * BLOB_OVERHEAD)
    store.put(a, da)
    for _ in range(3 * MARKS):
        store.age()
    assert len(store) == 0
    used = len(store._blobs)  # marks only
    assert used <= MARKS + 1 and store.size == used * BLOB_OVERHEAD


def test_blob_store_blobs_held_by_an_operation_stay() -> None:
    store = BlobStore()
    a, da = _blob(1)
    held: set[str] = set()
    store.hold(a, da, held)
    for _ in range(MARKS + 1):
        store.age()
    assert store.get(a) == da
    store.release(held)
    assert store.get(a) is None


def test_blob_cache_forgets_objects_unused_for_marks_periods() -> None:
    blobs: dict[str, bytes] = {}
    refs = []
    for i in range(3):
        blob = T.encode(T.dir_({f"k{i}": T.val(b"v")}))
        refs.append(hash_blob(blob))
        blobs[refs[-1]] = blob
    cache = T.BlobCache(blobs)
    for ref in refs:
        cache.get_obj(ref)
    cache.age()
    cache.get_obj(refs[1])  # used since the first mark
    for _ in range(MARKS - 1):
        assert cache.age() == 0
    assert cache.age() == 2
    assert len(cache) == 1 and cache.expired == 2
    assert list(r for r in cache._objs if not is_mark(r)) == [refs[1]]
    assert cache.nbytes == len(blobs[refs[1]])
    assert cache.get_obj(refs[0]) is not None  # decoded again from the store
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


@pytest.mark.parametrize("value,seconds", [("0", 0.0), ("10s", 10.0), ("0.1", 0.1),
                                           ("2m", 120.0)])
def test_expire_seconds_reads_durations(value: str, seconds: float) -> None:
    assert expire_seconds(value) == seconds


@pytest.mark.parametrize("value", ["1ms", "0.05", "-1", "soon"])
def test_expire_seconds_refuses_a_busy_loop_and_garbage(value: str) -> None:
    with pytest.raises(ValueError):
        expire_seconds(value)
