"""The full-disk checkpoint fallback's choice of root
(:meth:`kvs.commits.CommitPipeline.newest_written_root`), on a real rank-0
content module (real SQLite file, in this process) with the kvs module's
real commit pipeline, root history and blob store: when a collection may
have deleted an older root's blobs.  (What a crash then restarts from, on
a full disk, is tested with real ranks in test_kvs_rpc_durability.py.)
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from pathlib import Path

from test_broker_support import rank0_content

from kvs.blobs import BlobFetcher, BlobStore
from kvs.collect import RootHistory
from kvs.commits import CommitPipeline
from kvs.namespaces import PRIMARY, Namespace
from kvs.refcheck import RefChecker
from kvs.treeobj import BlobCache

T = 10.0


async def test_a_written_root_whose_rootref_came_back_is_not_vouched_for_by_that(
        tmp_path: Path) -> None:
    """The full-disk checkpoint fallback (:meth:`CommitPipeline.newest_written_root`)
    names an older root after a collection began only if that root was in
    the collection's grace period.  It asked whether its *rootref* is recent
    now -- but roots are content-addressed: a later commit that brings the
    same tree back notes the same rootref, though the collection, which ran
    when the old root was out of its grace period, may have deleted its
    blobs (stored again since, and not written: the disk is full)."""
    statedir = tmp_path / "state"
    statedir.mkdir()
    content = rank0_content(tmp_path, statedir=str(statedir))
    await content.start()
    gate = threading.Event()
    held_up = None
    try:
        history = RootHistory(grace=0.2)
        store = BlobStore()
        fetcher = BlobFetcher(store, Counter())
        loop = asyncio.get_running_loop()

        async def no_checkpoint(rootref: str, rootseq: int, pending: object = None) -> bool:
            return False

        commits = CommitPipeline(
            log=logging.getLogger("test"), counts=Counter(), spawn=loop.create_task,
            cache=BlobCache(store), blobs=store, fetcher=fetcher,
            refcheck=RefChecker(fetcher, Counter()), publish=lambda topic, body: None,
            checkpoint=no_checkpoint, hash_name=content.hash_name, statedir=str(statedir),
            root_history=history, prime_limit=0)
        commits.content = content
        ns = Namespace(PRIMARY, os.getuid())

        def set_root(rootseq: int, blob: bytes) -> str:  # (as a commit does)
            rootref, = content.store_local([blob])
            ns.set_root(rootseq, rootref)
            history.note(rootref)
            commits._note_primary_root(ns, content)
            return rootref

        x = set_root(1, b"tree X")
        await asyncio.wait_for(content.drain(), T)  # root 1's blobs are written
        # the disk fills: nothing is written from now on
        held_up = content._thread.run(gate.wait)
        set_root(2, b"tree Y")
        root = commits.newest_written_root()
        assert root is not None and root[:2] == (1, x)
        collection = content.begin_collection()  # (root 1 is in its grace period)
        content.end_collection(collection)
        assert commits.newest_written_root() == root
        await asyncio.sleep(0.3)  # (root 1 leaves the grace period)
        collection = content.begin_collection()  # (may delete tree X)
        content.end_collection(collection)
        assert commits.newest_written_root() is None
        assert set_root(3, b"tree X") == x  # the same tree again: stored, not written
        assert x in history.recent()
        assert commits.newest_written_root() is None
    finally:
        gate.set()
        if held_up is not None:
            await held_up
        await content.stop()
