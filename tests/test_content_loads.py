"""Batch loads: :meth:`ContentModule.load_many` and the kvs module's
:class:`~kvs.blobs.BlobFetcher` on top of it, on a real rank-0 content
module (real SQLite file, in this process: the loads are its Python API).

A cold read of many blobs loads them a batch at a time -- one future per
batch, no task per blob -- and batches that want the same blob share its
load.  A caller that goes away (its batch, or its fetch, cancelled) leaves
the loads it shares with others running for them.
"""

from __future__ import annotations

import asyncio
import errno
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_broker_support import rank0_content

from broker.content.blobref import hash_blob
from broker.content.module import ContentModule
from broker.errors import ErrnoError
from kvs.blobs import BlobFetcher, BlobStore

T = 10.0


@pytest.fixture
async def cold(tmp_path: Path) -> AsyncIterator[tuple[ContentModule, list[bytes], list[str]]]:
    """Rank 0's content module with 600 blobs in its file and (nearly)
    none in its cache (``content.cache-bytes`` is tiny)."""
    content = rank0_content(tmp_path, **{"content.cache-bytes": "1000"})
    await content.start()
    try:
        blobs = [b"blob %d " % i * 8 for i in range(600)]
        refs = content.store_local(blobs)
        await content.drain()
        assert len(content.cache) <= 10 and not content.dirty
        yield content, blobs, refs
    finally:
        await content.stop()


async def test_a_batch_load_shares_loads_and_outlives_a_cancelled_caller(cold) -> None:
    """Two batches overlapping by 200 blobs load each blob once; the first
    cancelled at once (its caller went away), the second still gets every
    blob, and the loads only the first wanted end too (nothing is left in
    flight).  A blob the file lacks is its own ENOENT entry."""
    content, blobs, refs = cold
    unknown = hash_blob(b"never stored")
    before = content.counts["misses"]
    gone = content.load_many(refs[:400])
    wanted = [*refs[200:], unknown]
    kept = content.load_many(wanted)
    gone.cancel()
    got = await asyncio.wait_for(kept, T)
    assert [got[ref] for ref in refs[200:]] == blobs[200:]
    assert isinstance(got[unknown], ErrnoError) and got[unknown].errnum == errno.ENOENT
    misses = content.counts["misses"] - before
    assert 600 - 10 <= misses <= 600 + 1, misses  # (not 800: the overlap is loaded once)
    # the loads only the cancelled batch wanted were not dropped: a batch
    # asking for them now shares them (or reads them again, once done)
    again = await asyncio.wait_for(content.load_many(refs[:200]), T)
    assert [again[ref] for ref in refs[:200]] == blobs[:200]
    assert not content._loading and not content._reads

async def test_a_fetch_cancelled_midway_leaves_a_sharing_fetch_whole(cold) -> None:
    """The kvs module's fetches over the content module: one cancelled while
    its loads are in flight does not cancel the loads another fetch shares
    (it did: each blob's load was a task, shared between the fetches and
    cancelled with the first); the other gets and holds every blob, a
    chunk of them to a load.  A blob missing fails its fetch alone."""
    content, blobs, refs = cold
    store = BlobStore()
    fetcher = BlobFetcher(store, Counter())
    fetcher.loader = fetcher.content = content
    held: set[str] = set()
    first = asyncio.ensure_future(fetcher.fetch(set(refs[:500])))
    second = asyncio.ensure_future(fetcher.fetch(set(refs[100:]), held))
    await asyncio.sleep(0)  # (a loop turn: both have asked for their blobs)
    assert fetcher.counts["blob-fetches"] == 1000
    first.cancel()
    got = await asyncio.wait_for(second, T)
    assert got == dict(zip(refs[100:], blobs[100:], strict=True))
    assert held == set(refs[100:])
    assert all(store.get(ref) == blob for ref, blob in zip(refs[100:], blobs[100:], strict=True))
    assert first.cancelled()
    assert fetcher.counts["blob-loads"] < fetcher.counts["blob-fetches"] // 100
    # a blob no one has fails its fetch with ENOENT naming it; the rest of
    # its chunk is cached all the same, and nothing is held
    unknown = hash_blob(b"never stored")
    held = set()
    store.drop()
    with pytest.raises(ErrnoError) as info:
        await asyncio.wait_for(fetcher.fetch({*refs[:50], unknown}, held), T)
    assert info.value.errnum == errno.ENOENT
    assert info.value.errstr == f"blob {unknown} is not in the content store"
    assert not held
    assert all(store.get(ref) == blob for ref, blob in zip(refs[:50], blobs[:50], strict=True))



async def test_two_loads_of_a_blob_a_sweep_may_delete_in_one_turn_both_end(cold) -> None:
    """Once a collection decided, a load of a blob it does not keep vouches
    for nothing, so a second batch asking for that blob in the same loop
    turn starts a load of its own: both loads are read, and both batches
    end.  (The second replaced the first in the turn's queue of reads, keyed
    by blobref: the first was never read, and its caller waited for ever.)"""
    content, blobs, refs = cold
    collection = content.begin_collection()
    try:
        collection.decide(set())  # (nothing marked: every blob may go)
        first = content.load_many([refs[0]])
        second = content.load_many([refs[0]])
        got = await asyncio.wait_for(asyncio.gather(first, second), T)
        assert got == [{refs[0]: blobs[0]}, {refs[0]: blobs[0]}]
        assert not content._loading and not content._reads
    finally:
        content.end_collection(collection)
