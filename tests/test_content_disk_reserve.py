"""Rank 0 keeps a free-space reserve on its statedir's file system
(``content.disk-reserve-bytes``): below it, writes that add blobs are
refused with ``ENOSPC`` while unlinks, ``kvs gc`` and checkpoints still
work, so a store that filled its disk can be shrunk while it runs.

Before, a store that filled its file system could not be shrunk at all:
``kvs unlink`` and ``kvs gc`` failed with ``ENOSPC`` too (SQLite needs room
to delete, and an unlink writes new directory blobs), the stop exited 1,
and a restart went back to the last checkpoint written.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
from collections.abc import Awaitable
from typing import Any

import pytest
from test_broker_support import KVBROKER, wait_until
from test_kvs_rpc_helpers import T, commit, errnum, get, put, stats, unlink

from broker.content import blobref
from broker.content.module import SMALL_STORE_BUDGET
from broker.content.sqlite import SqliteStore
from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import Instance

MB = 1 << 20


async def kvbroker(uri: str, *args: str) -> tuple[int, str]:
    """Run ``kvbroker ARGS`` against ``uri``: (exit status, stdout + stderr)."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, *args, env=dict(os.environ, KVBROKER_URI=uri),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()



async def refused_for_space(write: Awaitable[Any], *says: str) -> None:
    """``write`` (a commit) fails ``ENOSPC``, its message saying each of ``says``."""
    with pytest.raises(RemoteError) as exc:
        await write
    assert exc.value.errnum == errno.ENOSPC, exc.value
    for words in says:
        assert words in exc.value.errstr, exc.value.errstr

async def test_a_store_that_fills_its_disk_is_shrunk_while_it_runs(small_disk, tmp_path) -> None:
    """The operator review's scenario on a 20 MB file system, with the
    default reserve (5% of it there): 1 MB values until a commit is
    refused; then ``kvs unlink -R`` and ``kvs gc`` succeed while the
    instance runs, writes are accepted again by themselves, and the
    instance stops with exit 0 and restarts with its data."""
    statedir, log = str(small_disk / "state"), tmp_path / "rank.log"
    inst = Instance(2, statedir=statedir, stderr_path=str(log), attrs={"kvs.gc-grace": "0"})
    await asyncio.wait_for(inst.start(), 60)
    try:
        h = await Handle.connect(inst.uri(1))  # (a follower: commits are relayed)
        h0 = await Handle.connect(inst.uri(0))
        await commit(h, put("before", "kept"))
        refused: RemoteError | None = None
        for i in range(40):  # 40 MB: twice the disk
            try:
                await commit(h, put(f"big.k{i}", os.urandom(MB)))
            except RemoteError as exc:
                refused = exc
                # (refused early while much waits to be written, which counts
                # twice -- into the WAL, then the file -- until it is: go on
                # if the same put is accepted once it is written)
                await asyncio.wait_for(h0.rpc("content.flush", {}), T)
                try:
                    await commit(h, put(f"big.k{i}", os.urandom(MB)))
                except RemoteError as again:
                    refused = again
                    break
        assert refused is not None, "the disk never filled"
        assert refused.errnum == errno.ENOSPC, refused
        assert "content.disk-reserve-bytes" in refused.errstr, refused.errstr
        assert "kvs gc" in refused.errstr, refused.errstr  # (says how to recover)
        st = await stats(h0, "content")
        # (refusing: the room left is below the reserve; or, not quite, a
        # put of 1 MB would take it there, refused alone)
        assert st["refusing"] is None or "content.disk-reserve-bytes" in st["refusing"], st
        assert st["failing"] is None, st  # SQLite itself never ran out of room
        assert st["store-bytes"] > 8 * MB, st  # (its WAL included)
        assert 0 < st["disk-reserve-bytes"] <= MB, st  # (5% of 20 MB)
        assert 0 < st["disk-free-bytes"] <= 20 * MB - st["store-bytes"], st
        # a content.store that adds blobs is refused alike, through a follower too
        assert await errnum(h.rpc("content.store", {"data": os.urandom(MB)}), T) \
            == errno.ENOSPC
        # The operator's way out, while it runs: unlink, then collect.
        rc, out = await kvbroker(inst.uri(0), "kvs", "unlink", "-R", "big")
        assert rc == 0, out
        # (checkpointed: a collection keeps what the checkpoint names)
        rc, out = await kvbroker(inst.uri(0), "kvs", "sync")
        assert rc == 0, out
        rc, out = await kvbroker(inst.uri(0), "kvs", "gc")
        assert rc == 0, out
        assert "removed" in out, out

        # Writes resume by themselves (no one asks for the stats meanwhile).
        after = os.urandom(MB)

        async def accepted() -> bool:
            try:
                await commit(h, put("after", after))
            except RemoteError as exc:
                assert exc.errnum == errno.ENOSPC, exc
                return False
            return True

        try:
            await wait_until(accepted, "writes to be accepted again", 15)
        except AssertionError:
            raise AssertionError(f"{await stats(h0, 'content')} {out}") from None
        assert (await stats(h0, "content"))["refusing"] is None
        assert await get(h, "before") == b"kept"
        await h.close()
        await h0.close()
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    assert codes == [0, 0], log.read_text()
    inst2 = Instance(1, statedir=statedir, stderr_path=str(log))
    await asyncio.wait_for(inst2.start(), 60)
    try:
        async with await Handle.connect(inst2.uri(0)) as h2:
            assert await get(h2, "before") == b"kept"
            assert len(await get(h2, "after")) == MB
            assert await errnum(get(h2, "big.k0")) == errno.ENOENT
    finally:
        assert await asyncio.wait_for(inst2.stop(), 60) == [0]


async def test_room_made_or_taken_from_outside_is_seen_within_seconds(
        small_disk, tmp_path) -> None:
    """The free space is measured on a timer, not at each commit: another
    file filling the disk makes small commits refused, and removing it
    lets them through again, with no one asking for the stats."""
    log = tmp_path / "rank.log"
    inst = Instance(1, statedir=str(small_disk / "state"), stderr_path=str(log))
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            await commit(h, put("a", "1"))
            free = os.statvfs(small_disk)
            filler = small_disk / "filler"
            with open(filler, "wb") as f:  # leave 500 kB: below the reserve (1 MB)
                f.write(b"\0" * (free.f_bavail * free.f_frsize - 500_000))

            async def outcome() -> int:
                try:
                    await commit(h, put("a", os.urandom(8)))
                except RemoteError as exc:
                    return exc.errnum
                return 0

            async def refused() -> bool:
                return await outcome() == errno.ENOSPC

            async def accepted() -> bool:
                return await outcome() == 0

            await wait_until(refused, "a small commit to be refused", 10)
            filler.unlink()
            await wait_until(accepted, "commits to be accepted again", 10)
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    assert codes == [0], log.read_text()
    text = log.read_text()
    assert "below content.disk-reserve-bytes" in text, text
    assert "writes are accepted again" in text, text


async def test_below_the_reserve_only_commits_that_add_blobs_are_refused(
        start_instance, connect, tmp_path) -> None:
    """A reserve larger than any disk: every write that adds a value is
    refused, while a transaction of unlinks (and of expectations) is
    applied -- also when it is queued behind a refused put it would merge
    with -- and a SYNC unlink is checkpointed."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"),
                                attrs={"content.disk-reserve-bytes": str(1 << 60)})
    h = await connect(inst)
    st = await stats(h, "content")
    assert st["disk-reserve-bytes"] == 1 << 60
    assert "content.disk-reserve-bytes" in st["refusing"], st
    assert st["store-bytes"] > 0 and st["disk-free-bytes"] > 0, st
    assert await errnum(commit(h, put("a", "1"))) == errno.ENOSPC
    assert await errnum(h.rpc("content.store", {"data": b"x" * 2000})) == errno.ENOSPC
    # (a small one passes: the KVS stores a new namespace's empty root so)
    await asyncio.wait_for(h.rpc("content.store", {"data": b"x" * 100}), T)
    # a put and an unlink queued together (they would merge): only the put fails
    put_fut = asyncio.ensure_future(commit(h, put("b", "2")))
    unlink_fut = asyncio.ensure_future(commit(h, unlink("nothing.here")))
    assert await errnum(put_fut) == errno.ENOSPC
    await unlink_fut
    await commit(h, unlink("gone"), flags=4)  # SYNC: its checkpoint is written


async def test_the_stats_show_the_store_and_the_disk(start_instance, connect, tmp_path) -> None:
    """``stats content`` on rank 0 shows the store's size (only ``kvs gc``
    said it before), the free space and the reserve; writes are accepted."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"))
    h = await connect(inst)
    await commit(h, put("k", os.urandom(200_000)))
    await asyncio.wait_for(h.rpc("content.flush", {}), T)
    st = await stats(h, "content")
    assert st["refusing"] is None, st
    free = os.statvfs(tmp_path)
    assert 0 < st["disk-reserve-bytes"] <= 64 * MB, st
    assert st["disk-reserve-bytes"] <= free.f_blocks * free.f_frsize // 20, st
    assert st["disk-free-bytes"] > 0, st
    assert st["store-bytes"] > 0, st


async def test_a_store_over_its_quota_refuses_writes_until_collected(
        start_instance, connect, tmp_path) -> None:
    """``content.store-quota-bytes`` bounds the store's own data, whatever the
    disk holds: past it, writes are refused as below the reserve, and an
    unlink and a collection bring it back under (free pages do not count).

    Each write is measured before the next (the measure that follows its
    write-back): the blobs are then in SQLite's WAL, not yet in its file,
    and a measure of the file alone missed them -- writes went on past the
    quota (1 run in ~20 of this test, when a measure came between them)."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"), attrs={
        "content.store-quota-bytes": str(2 * MB), "kvs.gc-grace": "0"})
    h = await connect(inst)
    refused: RemoteError | None = None
    written = 0
    for i in range(20):  # 6 MB: three times the quota
        try:
            await commit(h, put(f"big.k{i}", os.urandom(300_000)))
        except RemoteError as exc:
            refused = exc
            break
        written += 300_000

        async def measured(at_least: int = written) -> bool:
            return int((await stats(h, "content"))["store-bytes"]) >= at_least

        await wait_until(measured, f"a measure of the store with {written} bytes written")
    assert refused is not None and refused.errnum == errno.ENOSPC, refused
    assert "over content.store-quota-bytes (2097152)" in refused.errstr, refused.errstr
    assert 4 <= i <= 6, i  # (about 2 MB went in first, and no more)
    st = await stats(h, "content")
    assert st["store-quota-bytes"] == 2 * MB, st
    # (the put that would pass the quota is refused alone: the store stays under)
    assert await errnum(commit(h, put("more", os.urandom(300_000)))) == errno.ENOSPC
    await commit(h, unlink("big"))
    rc, out = await kvbroker(inst.uri(0), "kvs", "sync")
    assert rc == 0, out
    rc, out = await kvbroker(inst.uri(0), "kvs", "gc")
    assert rc == 0, out
    await commit(h, put("after", os.urandom(300_000)))
    assert (await stats(h, "content"))["refusing"] is None


async def test_a_write_bigger_than_the_room_left_is_refused_alone(small_disk, tmp_path) -> None:
    """A 12 MB put on a 20 MB disk with 19 MB free would leave no room once
    written (into the WAL, then the file): it is refused, not accepted and
    acknowledged to fail its write -- which left the store stuck as with no
    reserve (unlinks failing, the stop exiting 1 with that commit lost).
    Smaller writes go on, and so does the instance."""
    log = tmp_path / "rank.log"
    inst = Instance(1, statedir=str(small_disk / "state"), stderr_path=str(log))
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            await commit(h, put("small", "1"))
            # (queued behind a small put it may merge with: only the big one fails)
            small = asyncio.ensure_future(commit(h, put("small2", "2")))
            with_big = asyncio.ensure_future(
                commit(h, put("big", os.urandom(12 * MB)), timeout=30))
            await small
            await refused_for_space(with_big, "a write of", "content.disk-reserve-bytes")
            assert await errnum(h.rpc("content.store", {"data": os.urandom(12 * MB)}), 30) \
                == errno.ENOSPC
            await asyncio.wait_for(h.rpc("content.flush", {}), T)
            st = await stats(h, "content")
            assert st["failing"] is None and st["refusing"] is None, st
            await commit(h, put("after", os.urandom(MB)))
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    assert codes == [0], log.read_text()


async def test_a_write_that_would_pass_the_quota_is_refused(
        start_instance, connect, tmp_path) -> None:
    """``content.store-quota-bytes`` counts the write itself: one put of 3 MB
    into an empty store with a 2 MB quota is refused, a small one is not."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"), attrs={
        "content.store-quota-bytes": str(2 * MB)})
    h = await connect(inst)
    await refused_for_space(commit(h, put("big", os.urandom(3 * MB)), timeout=30),
                            "over content.store-quota-bytes (2097152)")
    await commit(h, put("small", os.urandom(300_000)))
    assert (await stats(h, "content"))["refusing"] is None


async def test_a_refusal_says_which_setting_to_change(start_instance, connect, tmp_path) -> None:
    """An instance started on a disk with less room than the reserve (a
    laptop with less than 64 MiB free) is refused from its first write, with
    nothing to unlink: the message says how to start it with a lower reserve
    -- and, over a quota, with a higher quota."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"),
                                attrs={"content.disk-reserve-bytes": str(1 << 60)})
    h = await connect(inst)
    # (said for kvbroker broker too: an instance across hosts has no start)
    await refused_for_space(commit(h, put("a", "1")),
                            "-S content.disk-reserve-bytes=BYTES, 0: none, to kvbroker "
                            "start, or to rank 0's kvbroker broker)")
    inst2 = await start_instance(size=1, statedir=str(tmp_path / "state2"),
                                 attrs={"content.store-quota-bytes": "1"})
    h2 = await connect(inst2)
    await refused_for_space(commit(h2, put("a", "1")),
                            "-S content.store-quota-bytes=BYTES, 0: none, to kvbroker "
                            "start, or to rank 0's kvbroker broker)")


async def test_small_stores_below_the_reserve_are_bounded(start_instance, connect,
                                                           tmp_path) -> None:
    """Below the reserve a small ``content.store`` is still accepted (a new
    namespace's empty root), but a client looping on small stores of new
    blobs grew the store without bound -- the disk the reserve keeps.  Now
    new blobs are accepted up to SMALL_STORE_BUDGET while it refuses; blobs
    the store has (the empty root of every new namespace) cost nothing."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"),
                                attrs={"content.disk-reserve-bytes": str(1 << 60)})
    h = await connect(inst)
    await refused_for_space(commit(h, put("a", "1")), "content.disk-reserve-bytes")
    for i in range(SMALL_STORE_BUDGET // 1000):
        await h.rpc("content.store", {"data": i.to_bytes(4, "big") * 250})
    await refused_for_space(h.rpc("content.store", {"data": b"x" * 1000}),
                            "small stores of new blobs")
    await h.rpc("content.store", {"data": (0).to_bytes(4, "big") * 250})  # (has it)
    for i in range(100):
        await h.rpc("kvs.namespace-create", {"namespace": f"ns{i}", "owner": os.getuid()})


async def test_a_compaction_without_room_is_refused_up_front(small_disk, tmp_path) -> None:
    """``kvs gc --compact`` needs room for a copy of what the store keeps
    (SQLite's ``VACUUM`` writes every page kept into the WAL).  Without it,
    the compaction is refused before it writes anything, with ``ENOSPC``
    saying how much it needs, where, and that the collection itself was
    done; the instance keeps its room and goes on.  Before, the copy
    failed half-way, having taken every free byte of the file system for
    its WAL (3 MB here) and kept it: the store, which accepted writes,
    refused them from then on, and so was the rest of the disk full."""
    statedir, log = str(small_disk / "state"), tmp_path / "rank.log"
    inst = Instance(1, statedir=statedir, stderr_path=str(log), attrs={"kvs.gc-grace": "0"})
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            for name in ("keep", "junk"):  # 5 MB kept, 5 MB of garbage
                for i in range(5):
                    await commit(h, put(f"{name}.k{i}", os.urandom(MB)))
                    await asyncio.wait_for(h.rpc("content.flush", {}), T)
            await commit(h, unlink("junk"), flags=4)  # (SYNC: the checkpoint names it)
            rc, out = await kvbroker(inst.uri(0), "kvs", "gc")
            assert rc == 0 and "MB of it free" in out, out
            free = os.statvfs(small_disk)
            filler = small_disk / "filler"
            with open(filler, "wb") as f:  # 3 MB left: above the reserve (1 MB)
                f.write(b"\0" * (free.f_bavail * free.f_frsize - 3 * MB))
            rc, out = await kvbroker(inst.uri(0), "kvs", "gc", "--compact")
            assert rc == 1, out
            for words in ("No space left on device", "compacting needs about",
                          f"free on the file system of {statedir}", "not compacted",
                          "collection itself was done", "kvs gc --compact again"):
                assert words in out, out
            left = os.statvfs(small_disk)
            assert left.f_bavail * left.f_frsize > 2 * MB  # (nothing was taken)
            assert (await stats(h, "content"))["refusing"] is None
            await commit(h, put("after", os.urandom(100_000)))  # writes go on
            assert len(await get(h, "keep.k4")) == MB
            filler.unlink()  # with the room, it compacts
            size = os.stat(os.path.join(statedir, "content.sqlite")).st_size
            rc, out = await kvbroker(inst.uri(0), "kvs", "gc", "--compact")
            assert rc == 0 and out.endswith("compacted\n"), out
            assert os.stat(os.path.join(statedir, "content.sqlite")).st_size < size - 4 * MB
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    assert codes == [0], log.read_text()


def test_a_compaction_that_fails_gives_its_room_back(small_disk) -> None:
    """A ``VACUUM`` that runs out of room all the same (something else
    filled the disk after the check) leaves the WAL it grew empty: its
    frames, rolled back, held the file system's last free bytes until
    the next compaction."""
    store = SqliteStore(str(small_disk / "content.sqlite"))
    try:
        store.put_many((blobref.hash_blob(b"%d" % i), os.urandom(1000)) for i in range(6000))
        assert store.compact_shortfall() is None  # (room: and the WAL is emptied)
        free = os.statvfs(small_disk)
        with open(small_disk / "filler", "wb") as f:  # 2 MB left: the copy takes 6
            f.write(b"\0" * (free.f_bavail * free.f_frsize - 2 * MB))
        assert "compacting needs about" in (store.compact_shortfall() or "")
        with pytest.raises(sqlite3.OperationalError, match="full"):
            store.compact()
        wal = small_disk / "content.sqlite-wal"
        assert not wal.exists() or wal.stat().st_size == 0
        assert store.count() == 6000
    finally:
        store.close()
