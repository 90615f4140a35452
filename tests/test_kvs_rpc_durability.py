"""KVS durability over raw RPCs: restart from a statedir, SYNC commits, content.hash,
and EFBIG for a blob over content.blob-size-limit.

Reference: flux-core t/t2010-kvs-snapshot-restore.t / t1000-kvs.t (``put --sync``),
t/t2011-kvs-checkpoint-period.t, and docs/protocol.md "Durability".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli
from test_kvs_rpc_helpers import (
    SYNC,
    TREEOBJ,
    commit,
    errnum,
    get,
    getroot,
    lookup,
    put,
    stats,
)
from test_watch_helpers import wait_until

from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import STOP_CAP, Instance, StartError

BIG = bytes(range(256)) * 1024  # 256 KiB
# The small_disk tests fill the disk until SQLite itself fails (ENOSPC from a
# write): without a free-space reserve, which would refuse the commits first.
NO_RESERVE = {"content.disk-reserve-bytes": "0"}


@pytest.mark.parametrize("size", [1, 4])
async def test_restart_resumes_root_and_version(start_instance, connect, tmp_path,
                                                size) -> None:
    statedir = tmp_path / "state"
    inst = await start_instance(size=size, fanout=2, statedir=str(statedir))
    h = await connect(inst, size - 1)
    await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": "tmp", "owner": -1}),
                           10)
    await commit(h, put("k", "v"), ns="tmp")
    for i in range(5):
        await commit(h, put(f"k{i}", str(i)), put("big", BIG + bytes([i])))
    await commit(h, put("d.e.f", "deep"))
    root = await getroot(h)
    assert root["rootseq"] == 6
    await h.close()
    assert await inst.stop() == [0] * size  # clean stop
    assert (statedir / "content.sqlite").exists()

    inst2 = await start_instance(size=size, fanout=2, statedir=str(statedir))
    for rank in range(size):
        h2 = await connect(inst2, rank)
        again = await getroot(h2)
        assert (again["rootref"], again["rootseq"]) == (root["rootref"], root["rootseq"])
        assert await get(h2, "k3") == b"3"
        assert await get(h2, "big") == BIG + bytes([4])
        assert await get(h2, "d.e.f") == b"deep"
    # only primary is restored (as in Flux); it goes on from where it was
    listed = await asyncio.wait_for(h2.rpc("kvs.namespace-list", {}), 10)
    assert [d["namespace"] for d in listed["namespaces"]] == ["primary"]
    resp = await commit(h2, put("after", "restart"))
    assert resp["rootseq"] == 7


async def test_a_clean_stop_keeps_every_acknowledged_commit(start_instance, connect,
                                                           tmp_path) -> None:
    """Clients kept committing while the instance stopped: rank 0 wrote its
    last checkpoint, then went on applying and acknowledging commits, and
    the next start lost them (a crash audit: 67-207 per stop, their
    versions numbered again).  Rank 0 now refuses new transactions at stop
    (ENOSYS), lets the queued ones finish, then checkpoints."""
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=2, statedir=statedir)
    acked: dict[str, int] = {}
    last_rootseq = 0

    async def writer(rank: int, n: int) -> None:
        nonlocal last_rootseq
        h = await connect(inst, rank)
        i = 0
        while True:
            i += 1
            try:
                resp = await asyncio.wait_for(h.rpc("kvs.commit", {
                    "namespace": "primary", "flags": 0, "ops": [put(f"w{n}", str(i))]}), 10)
            except Exception:  # refused (ENOSYS) or cut off: not acknowledged
                return
            acked[f"w{n}"] = i
            last_rootseq = max(last_rootseq, resp["rootseq"])

    writers = [asyncio.create_task(writer(n % 2, n)) for n in range(8)]

    async def busy() -> bool:
        return len(acked) == 8 and min(acked.values()) >= 20

    await wait_until(busy, what="every writer to commit a while")
    await inst.stop()
    await asyncio.wait_for(asyncio.gather(*writers), 30)
    inst2 = await start_instance(size=1, statedir=statedir)
    h2 = await connect(inst2)
    assert (await getroot(h2))["rootseq"] >= last_rootseq
    for key, i in acked.items():
        assert int(await get(h2, key)) >= i, key


async def test_a_stop_that_cannot_sync_the_store_exits_1_in_one_line(small_disk,
                                                                   tmp_path) -> None:
    """Blobs written to the store's WAL and not yet copied into its main file,
    then a full disk: at stop, copying them (the WAL checkpoint that makes
    them durable) fails too.  The rank logged that with a traceback (seen
    under load in the test above, whose timing rarely leaves frames in the
    WAL); it now says why in one line and exits 1."""
    log = tmp_path / "rank.log"
    inst = Instance(1, statedir=str(small_disk / "state"), stderr_path=str(log),
                    attrs=NO_RESERVE)
    await asyncio.wait_for(inst.start(), 60)
    try:
        h = await Handle.connect(inst.uri(0))
        for i in range(15):  # ~1.5 MB: under SQLite's WAL auto-checkpoint (4 MB)
            await commit(h, put(f"w{i}", os.urandom(100_000)))

        async def written() -> bool:
            return (await stats(h, "content"))["dirty"] == 0

        await wait_until(written, what="the blobs to reach the WAL")
        with open(small_disk / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (64 << 10))
                    f.flush()
            except OSError as exc:  # the disk is full
                assert exc.errno == errno.ENOSPC
        await h.close()
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    text = log.read_text()
    assert codes == [1], text
    assert "Traceback" not in text, text
    assert ("module content failed to stop: making the content store durable failed: "
            "database or disk is full") in text, text


async def test_a_stop_that_cannot_write_its_checkpoint_exits_1(small_disk, tmp_path) -> None:
    """A full disk: commits acknowledged meanwhile cannot be kept at stop.
    Rank 0 logged a traceback and exited 0, as if nothing was lost; it now
    says why in one line and exits 1."""
    log = tmp_path / "rank.log"
    inst = Instance(1, statedir=str(small_disk / "state"), stderr_path=str(log),
                    attrs=NO_RESERVE)
    await asyncio.wait_for(inst.start(), 60)
    try:
        h = await Handle.connect(inst.uri(0))
        await commit(h, put("a", "1"), flags=SYNC)
        free = os.statvfs(small_disk)
        with open(small_disk / "filler", "wb") as f:
            f.write(b"\0" * (free.f_bavail * free.f_frsize - 200_000))
        last = None
        for i in range(30):
            try:  # acknowledged only; once a write has failed, refused (ENOSPC)
                last = await commit(h, put(f"p{i}", os.urandom(100_000)))
            except RemoteError as exc:
                assert exc.errnum == errno.ENOSPC and i > 0, exc
                break
        assert last is not None
        await h.close()
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    assert codes == [1]
    text = log.read_text()
    assert "Traceback" not in text, text
    assert "failed to stop: writing blobs to SQLite failed: database or disk is full" in text
    # the root those commits reached is named, to take back before any kvs gc
    assert (f"the primary namespace's last root (rootseq {last['rootseq']}, rootref "
            f"{last['rootref']}) is not checkpointed") in text


async def commit_until_the_disk_is_full(h: Handle, disk) -> tuple[int, list[str]]:
    """A SYNC commit (checkpointed), then ~200 kB commits, each written to
    SQLite before the next, until one's write fails for a full disk
    (acknowledged all the same: its write comes after).  The newest rootseq
    whose blobs were all written, and the keys of those commits."""
    await commit(h, put("a", "1"), flags=SYNC)
    free = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:  # room for a few of them
        f.write(b"\0" * (free.f_bavail * free.f_frsize - 1_500_000))
    written, keys = 1, []
    for i in range(30):
        resp = await commit(h, put(f"p{i}", os.urandom(200_000)))

        async def settled() -> bool:
            c = await stats(h, "content")
            return c["write-failures"] > 0 or (c["dirty"] == 0 and c["backlog-bytes"] == 0)

        await wait_until(settled, what="the commit's blobs to be written, or to fail")
        if (await stats(h, "content"))["write-failures"]:
            assert written > 2, written  # (some were written before)
            return written, keys
        written = resp["rootseq"]
        keys.append(f"p{i}")
    raise AssertionError("the disk never filled")


async def check_resumes_at(statedir: str, rootseq: int, keys: list[str], log) -> None:
    """A restart resumes at ``rootseq``, with every value of ``keys``."""
    inst = Instance(1, statedir=statedir, stderr_path=str(log))
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            assert (await getroot(h))["rootseq"] == rootseq, log.read_text()
            for key in keys:
                assert len(await get(h, key)) == 200_000
    finally:
        await asyncio.wait_for(inst.stop(), 60)


async def test_a_full_disk_checkpoints_the_newest_root_whose_blobs_are_written(
        small_disk, tmp_path) -> None:
    """The periodic checkpoint always named the newest root; on a full disk
    its blobs cannot be written, so no checkpoint was, and a crash went back
    to the last one that succeeded -- losing the commits after it whose
    blobs were written (here 7 of them).  It now names the newest root
    whose blobs are all written instead, and a crash loses only the
    commits after that.  (The period is long enough that no checkpoint
    comes between the SYNC commit and the full disk: ~1 s of work, a few
    on a loaded machine; at 8 s one run in ~11 failed under load.)"""
    statedir, log = str(small_disk / "state"), tmp_path / "rank.log"
    inst = Instance(1, statedir=statedir, stderr_path=str(log),
                    attrs={"kvs.checkpoint-period": "15s", **NO_RESERVE})
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            written, keys = await commit_until_the_disk_is_full(h, small_disk)
            cp = (await stats(h))["checkpoint"]
            assert cp["rootseq"] == 1, f"a periodic checkpoint came too soon: {cp}"

            async def fell_back() -> bool:
                # (failed counts the periodic checkpoint's failure before
                # the fallback is written: waiting on it alone raced)
                return (await stats(h))["checkpoint"]["written-fallback"] > 0

            await wait_until(fell_back, what="a periodic checkpoint's fallback", timeout=45)
            cp = (await stats(h))["checkpoint"]
            assert cp["failed"] >= 1, cp
            assert cp["rootseq"] == written, cp
            assert cp["written-fallback"] == 1, cp
        os.kill(inst.pids()[0], signal.SIGKILL)  # a crash
    finally:
        await asyncio.wait_for(inst.stop(), 60)
    assert (f"WARNING kvbroker.kvs: checkpointed rootseq {written} (rootref "
            in log.read_text()), log.read_text()
    os.remove(small_disk / "filler")
    await check_resumes_at(statedir, written, keys, log)


async def test_a_stop_on_a_full_disk_keeps_the_newest_root_whose_blobs_are_written(
        small_disk, tmp_path) -> None:
    """The final checkpoint falls back the same way: the stop still fails
    (exit 1, naming the root it could not keep), but the next start
    resumes at the newest root whose blobs were written, not at the last
    checkpoint (here the SYNC commit's: no periodic checkpoints)."""
    statedir, log = str(small_disk / "state"), tmp_path / "rank.log"
    inst = Instance(1, statedir=statedir, stderr_path=str(log),
                    attrs={"kvs.checkpoint-period": "0", **NO_RESERVE})
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            written, keys = await commit_until_the_disk_is_full(h, small_disk)
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    text = log.read_text()
    assert codes == [1], text
    assert f"checkpointed rootseq {written} (rootref " in text, text
    assert "is not checkpointed" in text, text
    os.remove(small_disk / "filler")
    await check_resumes_at(statedir, written, keys, log)


async def test_rank_0_logs_what_it_restored_and_what_it_kept(tmp_path) -> None:
    """A start said what it restored; a clean stop said nothing of what it
    kept, and a start without a statedir nothing at all.  Rank 0 now logs
    (INFO) its final checkpoint -- the pair of the next start's "restored"
    line -- or that nothing was new since the last, and a start without a
    statedir says the store starts empty and goes with the instance."""
    statedir, log = str(tmp_path / "state"), tmp_path / "rank.log"
    info = {"log.level": "info"}

    def lines() -> list[str]:
        return [line.split(": ", 1)[1] for line in log.read_text().splitlines()
                if "kvbroker.kvs:" in line]

    async def run(statedir: str | None, value: str | None) -> dict:
        log.write_text("")
        inst = Instance(1, statedir=statedir, attrs=info, stderr_path=str(log))
        await asyncio.wait_for(inst.start(), 60)
        try:
            async with await Handle.connect(inst.uri(0)) as h:
                if value is not None:
                    await commit(h, put("k", value))
                root: dict = await getroot(h)
        finally:
            assert await asyncio.wait_for(inst.stop(), 60) == [0], log.read_text()
        return root

    root = await run(statedir, "1")
    assert lines() == [
        f"INFO kvbroker.kvs: no checkpoint in statedir {statedir}: the primary namespace "
        "starts empty",
        f"INFO kvbroker.kvs: final checkpoint: the primary namespace at rootseq 1 (rootref "
        f"{root['rootref']})"]
    assert await run(statedir, None) == root
    assert lines()[0].startswith(
        f"INFO kvbroker.kvs: restored the primary namespace from checkpoint rootseq 1 "
        f"(rootref {root['rootref']}, written ")
    assert lines()[1:] == [
        f"INFO kvbroker.kvs: final checkpoint: the primary namespace at rootseq 1 (rootref "
        f"{root['rootref']}), checkpointed already"]
    await run(None, "1")
    assert lines() == ["INFO kvbroker.kvs: no statedir: the primary namespace starts empty, "
                       "and is not kept when the instance stops"]


async def test_a_store_removed_while_running_fails_the_sync_commit_and_the_stop(
        tmp_path) -> None:
    """The store file removed under a running rank 0 (an operator's ``rm``,
    a cleanup job; found by the crash audit): before, a ``--sync`` commit
    after the removal was acknowledged into the unlinked file, the stop
    was clean, and the next start found an empty store without a word.
    Now the commit fails ``EIO`` naming the removed file, and so does the
    stop (exit 1): nothing acknowledged durable is lost."""
    sd = tmp_path / "sd"
    store = sd / "content.sqlite"
    rc, out, err = await run_cli(
        "start", "--statedir", str(sd), "--", "sh", "-c",
        f"kvbroker kvs put --sync a=1 && rm -f {store} {store}-wal {store}-shm && "
        "kvbroker kvs put --sync b=2; echo put=$?", timeout=90)
    assert out.strip().endswith("put=1"), (out, err)
    assert f"the store file {store} was removed or replaced while the instance ran" in err
    assert rc == 1, err


async def test_a_failing_sync_shows_in_the_stats_until_one_succeeds(start_instance, connect,
                                                                    tmp_path) -> None:
    """Blob writes succeed while the sync that makes a ``SYNC`` commit
    durable fails (here the store's path names nothing for a while; a disk
    I/O error, a file size limit): every ``SYNC`` commit failed ``EIO``
    while ``stats content`` showed nothing wrong (found by a review).  Its
    ``sync-failing`` says why until a sync succeeds, counted in
    ``sync-failures``; plain commits go on."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    await commit(h, put("a", "1"), flags=SYNC)
    st = await stats(h, "content")
    assert st["sync-failing"] is None and st["sync-failures"] == 0, st
    store = statedir / "content.sqlite"
    store.rename(statedir / "aside.sqlite")
    try:
        with pytest.raises(RemoteError) as exc:
            await commit(h, put("b", "2"), flags=SYNC)
        assert exc.value.errnum == errno.EIO
        await commit(h, put("c", "3"))  # (a plain one: its blobs are written)
        st = await stats(h, "content")
        assert "was removed or replaced" in (st["sync-failing"] or ""), st
        assert st["sync-failures"] >= 1 and st["failing"] is None, st
    finally:
        (statedir / "aside.sqlite").rename(store)
    await commit(h, put("d", "4"), flags=SYNC)
    assert (await stats(h, "content"))["sync-failing"] is None


async def test_without_statedir_nothing_persists(start_instance, connect, tmp_path) -> None:
    inst = await start_instance(size=1)
    rundir = inst.rundir
    h = await connect(inst)
    await commit(h, put("k", "v"))
    assert os.path.exists(os.path.join(rundir, "content.sqlite"))
    await h.close()
    await inst.stop()
    assert not os.path.exists(rundir)
    inst2 = await start_instance(size=1)
    assert (await getroot(await connect(inst2)))["rootseq"] == 0


@pytest.mark.parametrize("size", [1, 4])
async def test_sync_commit_survives_sigkill(start_instance, connect, tmp_path, size) -> None:
    statedir = tmp_path / "state"
    inst = await start_instance(size=size, fanout=2, statedir=str(statedir))
    h = await connect(inst, size - 1)
    await commit(h, put("a", "1"), put("big", BIG))
    resp = await commit(h, put("b", "2"), flags=SYNC)
    # the process dies without any chance to checkpoint; a rank below it may
    # have gone already, on its own, for its lost parent (and been reaped)
    for pid in inst.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await h.close()
    await inst.stop()

    await restart_and_check(start_instance, connect, size, str(statedir), resp)


async def restart_and_check(start_instance, connect, size: int, statedir: str, resp: dict,
                            **kw):
    """Start again on ``statedir``: the root is ``resp``'s and a, b, big are
    back (as the tests above wrote them).  Returns the new instance and a
    handle on its last rank."""
    inst2 = await start_instance(size=size, fanout=2, statedir=statedir, **kw)
    h2 = await connect(inst2, size - 1)
    root = await getroot(h2)
    assert (root["rootref"], root["rootseq"]) == (resp["rootref"], resp["rootseq"])
    assert await get(h2, "a") == b"1"
    assert await get(h2, "b") == b"2"
    assert await get(h2, "big") == BIG
    return inst2, h2


async def wait_checkpoint(h0, rootseq: int) -> dict:
    """Until rank 0 has checkpointed ``rootseq`` (or newer); its checkpoint stats."""
    async def done() -> bool:
        return (await stats(h0))["checkpoint"]["rootseq"] >= rootseq
    await wait_until(done, 15, f"a checkpoint of rootseq {rootseq}")
    return (await stats(h0))["checkpoint"]


def kill_rank0(inst) -> None:
    """SIGKILL rank 0 alone: no clean stop, no final checkpoint."""
    os.kill(inst.pids()[0], signal.SIGKILL)


@pytest.mark.parametrize("size", [1, 4])
async def test_periodic_checkpoint_keeps_plain_commits_across_sigkill(
        start_instance, connect, tmp_path, size) -> None:
    """Plain (not SYNC) commits survive a crash of rank 0 once the periodic
    checkpoint (kvs.checkpoint-period, default 1 s) has named their root."""
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=size, fanout=2, statedir=statedir)
    h0 = await connect(inst, 0)
    h = await connect(inst, size - 1)
    assert (await stats(h0))["checkpoint"] == {"period": 1.0, "rootseq": 0, "written": 0,
                                               "written-fallback": 0, "failed": 0,
                                               "failing": None}
    assert (await stats(h))["checkpoint"] is None or size == 1  # rank 0's business
    await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": "tmp"}), 10)
    kept = await commit(h, put("k", "v"), ns="tmp", flags=SYNC)
    await commit(h, put("a", "1"), put("big", BIG))
    resp = await commit(h, put("b", "2"))
    cp = await wait_checkpoint(h0, resp["rootseq"])
    assert cp["written"] >= 1 and cp["failed"] == 0
    kill_rank0(inst)
    await h.close()
    await inst.stop()

    inst2, h2 = await restart_and_check(start_instance, connect, size, statedir, resp,
                                        attrs={"log.level": "info"})
    log = (tmp_path / "broker-1.log").read_text()
    assert (f"restored the primary namespace from checkpoint rootseq {resp['rootseq']} "
            f"(rootref {resp['rootref']}, written ") in log, log
    cp = (await stats(await connect(inst2, 0)))["checkpoint"]
    assert cp["rootseq"] == resp["rootseq"] and cp["written"] == 0  # nothing new yet
    # Other namespaces are not restored, even after a SYNC commit; their
    # blobs are there, so a root reference kept from before brings one back.
    assert await errnum(get(h2, "k", ns="tmp")) == errno.ENOTSUP
    await asyncio.wait_for(h2.rpc("kvs.namespace-create", {
        "namespace": "tmp", "rootref": kept["rootref"]}), 10)
    assert await get(h2, "k", ns="tmp") == b"v"


async def test_periodic_checkpoint_only_when_the_root_changed(start_instance, connect,
                                                              tmp_path) -> None:
    inst = await start_instance(size=2, statedir=str(tmp_path / "state"),
                                attrs={"kvs.checkpoint-period": "50ms"})
    h0 = await connect(inst, 0)
    h1 = await connect(inst, 1)
    assert (await stats(h0))["checkpoint"]["period"] == 0.05
    resp = await commit(h1, put("a", "1"))
    assert (await wait_checkpoint(h0, resp["rootseq"]))["written"] == 1
    # Ten idle periods (a deliberate wait for something that must NOT
    # happen): the root did not change, so nothing is written.
    await asyncio.sleep(0.5)
    assert (await stats(h0))["checkpoint"]["written"] == 1
    for i in range(3):
        resp = await commit(h1, put("a", str(i)))
        assert (await wait_checkpoint(h0, resp["rootseq"]))["written"] == 2 + i
    # a SYNC commit checkpoints at once, and counts as one
    resp = await commit(h1, put("s", "1"), flags=SYNC)
    cp = (await stats(h0))["checkpoint"]
    assert cp["rootseq"] == resp["rootseq"] and cp["written"] == 5 and cp["failed"] == 0


async def test_a_refused_checkpoint_shows_why_until_one_is_written(start_instance, connect,
                                                                   tmp_path) -> None:
    """A store that takes blobs but refuses the checkpoint row (here a
    trigger, standing for a main file made read-only under the rank while
    its WAL takes writes): the kvs and content stats say why while it
    lasts, not just a count, and clear once a checkpoint is written again.
    Before, ``stats content`` showed nothing wrong: its ``failing`` is
    about blob writes.  (The trigger is made between two runs, as a
    running rank holds the file; it lets checkpoints through again once a
    checkpoint ``unlock`` is there, which the test then writes.)"""
    statedir = tmp_path / "state"
    attrs = {"kvs.checkpoint-period": "50ms"}
    inst = await start_instance(size=1, statedir=str(statedir), attrs=attrs)
    h = await connect(inst, 0)
    await commit(h, put("a", "1"))
    await h.close()
    await inst.stop()
    with contextlib.closing(sqlite3.connect(statedir / "content.sqlite")) as db:
        db.execute("CREATE TRIGGER refuse BEFORE INSERT ON checkpoints WHEN NEW.key != 'unlock' "
                   "AND NOT EXISTS (SELECT 1 FROM checkpoints WHERE key = 'unlock') "
                   "BEGIN SELECT RAISE(ABORT, 'checkpoint refused by a test trigger'); END")
        db.commit()

    inst = await start_instance(size=1, statedir=str(statedir), attrs=attrs)
    h = await connect(inst, 0)
    content = await stats(h, "content")
    assert content["checkpoint-failing"] is None and content["failing"] is None, content
    await commit(h, put("a", "2"))  # its blobs are written; its checkpoint is not

    async def failing() -> bool:
        return (await stats(h))["checkpoint"]["failing"] is not None
    await wait_until(failing, 15, "a failed checkpoint")
    cp = (await stats(h))["checkpoint"]
    assert "checkpoint refused by a test trigger" in cp["failing"] and cp["failed"] >= 1, cp
    content = await stats(h, "content")
    assert "checkpoint refused by a test trigger" in content["checkpoint-failing"], content
    assert content["failing"] is None, content  # the blobs were written
    await asyncio.wait_for(h.rpc("content.checkpoint-put", {"key": "unlock", "value": 1}), 10)
    assert (await stats(h, "content"))["checkpoint-failing"] is None  # (that one was written)
    last = await commit(h, put("a", "3"))
    cp = await wait_checkpoint(h, last["rootseq"])
    assert cp["failing"] is None, cp


async def test_checkpoint_period_0_checkpoints_only_at_stop(start_instance, connect,
                                                            tmp_path) -> None:
    """kvs.checkpoint-period=0: the old behaviour -- a clean stop and SYNC
    commits checkpoint, so a crash loses the plain commits since then."""
    statedir = str(tmp_path / "state")
    attrs = {"kvs.checkpoint-period": "0"}
    inst = await start_instance(size=2, statedir=statedir, attrs=attrs)
    h = await connect(inst, 1)
    first = await commit(h, put("a", "1"))
    await h.close()
    await inst.stop()  # a clean stop: the one checkpoint

    inst2 = await start_instance(size=2, statedir=statedir, attrs=attrs)
    h0 = await connect(inst2, 0)
    h = await connect(inst2, 1)
    assert (await getroot(h))["rootseq"] == first["rootseq"]
    await commit(h, put("b", "2"))
    assert (await stats(h0))["checkpoint"] == {"period": 0.0, "rootseq": first["rootseq"],
                                               "written": 0, "written-fallback": 0,
                                               "failed": 0, "failing": None}
    kill_rank0(inst2)
    await h.close()
    await inst2.stop()

    inst3 = await start_instance(size=2, statedir=statedir, attrs=attrs)
    h = await connect(inst3, 1)
    root = await getroot(h)
    assert (root["rootref"], root["rootseq"]) == (first["rootref"], first["rootseq"])
    assert await get(h, "a") == b"1"
    assert await errnum(get(h, "b")) == errno.ENOENT


async def test_a_statedir_in_use_is_refused_with_a_clear_message(start_instance, connect,
                                                                 tmp_path) -> None:
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=2, statedir=statedir)
    log = tmp_path / "second.log"
    second = Instance(1, statedir=statedir, stderr_path=str(log))
    # the launcher and the command line, side by side (each waits out
    # SQLite's 5 s busy timeout)
    refused, (rc, out, err) = await asyncio.gather(
        start_refused(second),
        run_cli("start", "--size", "1", "--statedir", statedir, "--", "true"))
    assert isinstance(refused, StartError) and "during start-up" in str(refused)
    message = f"start-up failed: statedir {statedir} is in use by another instance"
    assert message in log.read_text(), log.read_text()
    assert rc == 2 and message in err, (rc, err)
    # the instance holding it is unharmed
    h = await connect(inst, 1)
    resp = await commit(h, put("k", "v"), flags=SYNC)
    assert resp["rootseq"] == 1


async def test_a_checkpoint_that_is_not_a_root_stops_start_up_clearly(
        start_instance, connect, tmp_path) -> None:
    """The owner may write any value under any checkpoint key, the KVS's
    own included; at the next start rank 0 failed with "TypeError: 'int'
    object is not subscriptable".  It now names the checkpoint and says
    what is wrong with it, and the statedir is left as it was."""
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=1, statedir=statedir)
    h = await connect(inst)
    await asyncio.wait_for(h.rpc("content.checkpoint-put", {"key": "kvs-primary",
                                                            "value": 5}), 10)
    await h.close()
    await inst.stop()
    text = await refused_start_log(statedir, tmp_path / "again.log")
    assert (f"start-up failed: the checkpoint 'kvs-primary' in statedir {statedir} is not "
            "a KVS root: 5") in text, text
    assert "Traceback" not in text


async def test_a_checkpoint_whose_root_is_missing_stops_start_up_clearly(
        start_instance, connect, tmp_path) -> None:
    """A checkpoint naming a root directory the store lacks (a damaged
    file): rank 0 started, every get and put then failed, and an online
    gc took the store for empty and removed every blob.  Start-up now
    fails, naming the root and the statedir, and deletes nothing."""
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=1, statedir=statedir)
    h = await connect(inst)
    missing = "sha256-" + "ab" * 32
    await asyncio.wait_for(h.rpc("content.checkpoint-put", {"key": "kvs-primary", "value": {
        "rootref": missing, "rootseq": 7}}), 10)
    await h.close()
    await inst.stop()
    text = await refused_start_log(statedir, tmp_path / "again.log")
    assert (f"start-up failed: the checkpoint in statedir {statedir} names root {missing} "
            "(rootseq 7), which the content store cannot give") in text, text
    assert "the store is damaged" in text and "Traceback" not in text
    # and where to go from there: the older checkpoints kept
    assert f"kvbroker content checkpoint list --statedir {statedir}" in text


async def test_a_store_that_is_not_a_database_is_named_at_start_up(tmp_path) -> None:
    """The start-up error names the file (it said only "DatabaseError: file
    is not a database")."""
    statedir = tmp_path / "state"
    statedir.mkdir(mode=0o700)
    (statedir / "content.sqlite").write_bytes(b"not a database, " * 512)
    text = await refused_start_log(statedir, tmp_path / "rank.log")
    assert f"start-up failed: {statedir}/content.sqlite: file is not a database" in text, text


async def test_an_emptied_store_is_said_at_start_up(tmp_path) -> None:
    """A store file of 0 bytes (left so by a host crash) was taken as a new
    store: the KVS started empty, exit 0, not a word.  It still starts (the
    data is gone either way), but says so, once: the next start finds the
    store it made."""
    statedir = tmp_path / "state"
    statedir.mkdir(mode=0o700)
    rc, _, err = await run_cli("start", "--statedir", str(statedir), "--", "kvbroker", "kvs",
                               "put", "a=1")
    assert rc == 0, err
    os.truncate(statedir / "content.sqlite", 0)
    rc, out, err = await run_cli("start", "--statedir", str(statedir), "--", "kvbroker", "kvs",
                                 "ls")
    assert (rc, out) == (0, ""), err
    assert (f"WARNING kvbroker.content: {statedir}/content.sqlite is empty (0 bytes): the KVS "
            "starts empty.") in err, err
    rc, _, err = await run_cli("start", "--statedir", str(statedir), "--", "true")
    assert rc == 0 and "is empty" not in err, err


async def test_another_programs_sqlite_file_is_refused_at_start_up(tmp_path) -> None:
    """A database whose ``objects`` table is not ours was taken for an empty
    store ("no checkpoint ... starts empty"), then every write failed EIO."""
    statedir = tmp_path / "state"
    statedir.mkdir(mode=0o700)
    with sqlite3.connect(statedir / "content.sqlite") as db:
        db.execute("CREATE TABLE objects (id INTEGER PRIMARY KEY, object BLOB)")
    db.close()
    text = await refused_start_log(statedir, tmp_path / "rank.log")
    assert (f"start-up failed: {statedir}/content.sqlite: not a kvbroker content store: "
            "its table objects has no column hash") in text, text


async def stopped_with_a_key(tmp_path: Path) -> tuple[Instance, Path]:
    """A one-rank instance on ``tmp_path/state`` that committed ``kept`` and
    stopped cleanly, and its statedir."""
    statedir = tmp_path / "state"
    inst = Instance(1, statedir=str(statedir))
    await asyncio.wait_for(inst.start(), 60)
    async with await Handle.connect(inst.uri(0)) as h:
        await commit(h, put("kept", "yes"))
    assert await inst.stop() == [0]
    return inst, statedir


async def test_a_store_of_a_newer_format_is_refused_and_left_as_it_is(tmp_path) -> None:
    """The store records its format (``PRAGMA user_version``): a file a newer
    kvbroker wrote is refused at start-up and by the offline tools, naming
    both formats, and nothing is written to it -- without the mark it was
    opened, switched to WAL and given the tables this version lacks."""
    from broker import __version__
    from broker.content.sqlite import STORE_FORMAT

    inst, statedir = await stopped_with_a_key(tmp_path)
    store = statedir / "content.sqlite"
    with contextlib.closing(sqlite3.connect(store)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == STORE_FORMAT
        db.execute("PRAGMA journal_mode=DELETE")  # (the newer one's choice, say)
        db.execute(f"PRAGMA user_version={STORE_FORMAT + 1}")
        db.execute("DROP TABLE runs")
    before = store.read_bytes()
    text = await refused_start_log(statedir, tmp_path / "rank.log")
    why = (f"written by a newer kvbroker (store format {STORE_FORMAT + 1}; this one, "
           f"{__version__}, reads format {STORE_FORMAT} and older)")
    assert f"start-up failed: {store}: {why}" in text, text
    for args in (["kvs", "fsck", "--statedir"], ["startlog", "--statedir"],
                 ["kvs", "gc", "--statedir"]):
        rc, out, err = await run_cli(*args, str(statedir))
        assert rc != 0 and why in err, (args, err)
    # a start that restores an archive over it refuses it the same way: rank
    # 0 exits 2, a lasting fault (it was 1, which a supervisor restarts on)
    rc, out, err = await run_cli("start", "--statedir", str(statedir), "-S",
                                 f"content.restore={tmp_path / 'some.tar'}", "--", "true")
    assert rc == 2 and f"content.restore: {store}: {why}" in err, (rc, err)
    assert "rank 0 exited with status 2 during start-up" in err, err
    assert store.read_bytes() == before
    assert sorted(p.name for p in statedir.iterdir() if p.name.startswith("content")) == [
        "content.sqlite"]


async def test_a_store_without_a_format_is_marked_at_its_next_start(tmp_path) -> None:
    """A store from before the format was recorded (``user_version`` 0) is
    this format: read as it is, and marked when a start opens it."""
    from broker.content.sqlite import STORE_FORMAT

    inst, statedir = await stopped_with_a_key(tmp_path)
    store = statedir / "content.sqlite"
    with contextlib.closing(sqlite3.connect(store)) as db:
        db.execute("PRAGMA user_version=0")
    rc, out, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert rc == 0, err
    await asyncio.wait_for(inst.start(), 60)
    async with await Handle.connect(inst.uri(0)) as h:
        assert await get(h, "kept") == b"yes"
    assert await inst.stop() == [0]
    with contextlib.closing(sqlite3.connect(store)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == STORE_FORMAT


async def test_a_newer_store_with_wal_frames_is_refused_without_being_written(
        tmp_path: Path) -> None:
    """A newer kvbroker's store killed with its last writes in the WAL (the
    format may be set there only): refused by a tool without being written.
    The format was checked on a connection opened to write, and closing it
    copied the WAL into the file and removed the WAL (a review audit)."""
    sd = tmp_path / "sd"
    sd.mkdir(mode=0o700)
    store = sd / "content.sqlite"
    # a newer kvbroker's store, its last writes in the WAL (killed: no checkpoint)
    script = ("import os, sqlite3, sys; db = sqlite3.connect(sys.argv[1], "
              "isolation_level=None); db.execute('PRAGMA journal_mode=WAL'); "
              "db.execute('PRAGMA wal_autocheckpoint=0'); "
              "db.execute('CREATE TABLE newer (x)'); db.execute('PRAGMA user_version=2'); "
              "db.execute('INSERT INTO newer VALUES (1)'); os._exit(0)")
    subprocess.run([sys.executable, "-c", script, str(store)], check=True)
    wal = Path(f"{store}-wal")
    assert wal.stat().st_size > 0

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "absent"

    before = (digest(store), digest(wal))
    rc, _out, err = await run_cli("content", "checkpoint", "list", "--statedir", str(sd))
    assert rc == 1 and "written by a newer kvbroker (store format 2" in err, err
    assert (digest(store), digest(wal)) == before, "the refused store was written"


def damage_page(path: str, page: int, data: bytes) -> None:
    """Overwrite the start of SQLite page ``page`` (1-based) of file ``path``."""
    with sqlite3.connect(path) as db:
        size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    with open(path, "r+b") as f:
        f.seek((page - 1) * size)
        f.write(data)


async def test_a_damaged_page_of_the_store_is_eio_not_an_internal_error(
        start_instance, connect, tmp_path) -> None:
    """A page SQLite cannot read (a bad disk, a stray write): a read of the
    blob on it answered "internal error: database disk image is malformed",
    with a traceback in rank 0's log at every read, and a damaged page of
    the checkpoints table failed start-up the same way.  Now a read of such
    a blob is EIO naming it and the content store (other keys are still
    read), and start-up fails in one line naming the file."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=2, statedir=str(statedir))
    h = await connect(inst, 1)
    damaged = b"\xab" * 20000  # (on overflow pages of its own)
    await commit(h, put("good", "1"), put("bad", damaged))
    await h.close()
    assert await inst.stop() == [0, 0]
    path = str(statedir / "content.sqlite")
    raw = (statedir / "content.sqlite").read_bytes()
    with sqlite3.connect(path) as db:
        size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    page = next(off for off in range(0, len(raw), size)  # an overflow page of "bad"
                if raw[off + 4:off + size] == damaged[:size - 4]) // size + 1
    damage_page(path, page, (0xFFFFFF00).to_bytes(4, "big"))  # its next page: beyond the file

    inst2 = await start_instance(size=2, statedir=str(statedir))
    h2 = await connect(inst2, 1)
    assert await get(h2, "good") == b"1"
    for _ in range(2):
        with pytest.raises(RemoteError) as info:
            await get(h2, "bad")
        assert info.value.errnum == errno.EIO
        assert "cannot be read from the content store: database disk image is malformed" in \
            info.value.errstr, info.value.errstr
        assert "internal error" not in info.value.errstr
    await h2.close()
    await inst2.stop()
    assert "Traceback" not in (tmp_path / "broker-1.log").read_text()

    with sqlite3.connect(path) as db:
        table = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'checkpoints'"
                           ).fetchone()[0]
    db.close()
    damage_page(path, table, b"\xff" * 4096)
    text = await refused_start_log(statedir, tmp_path / "again.log")
    assert (f"start-up failed: checkpoint 'kvs-primary' cannot be read from {path}: database "
            "disk image is malformed") in text, text
    assert "Traceback" not in text


async def start_refused(inst: Instance) -> BaseException | None:
    try:
        await inst.start(timeout=30)
    except StartError as exc:
        return exc
    await inst.stop()
    return None


async def refused_start_log(statedir: str | Path, log: Path) -> str:
    """Start one rank on ``statedir``, which must be refused: what it logged
    to ``log``.  Started as a service (``kvbroker broker``), the rank exits
    2, not 1: starting it again would only repeat the failure, and a
    supervisor restarting on failure looped on it."""
    refused = await start_refused(Instance(1, statedir=str(statedir), stderr_path=str(log)))
    assert isinstance(refused, StartError), refused
    conf = log.with_suffix(".toml")
    conf.write_text("")  # (one rank on its own)
    rc, _, err = await run_cli("broker", "-c", str(conf), "--statedir", str(statedir), "--",
                               "true")
    assert rc == 2 and "start-up failed: " in err, (rc, err)
    return log.read_text()


async def test_content_hash_sha1(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs={"content.hash": "sha1"})
    h = await connect(inst, 3)
    resp = await commit(h, put("big", BIG), put("small", "s"))
    assert resp["rootref"].startswith("sha1-") and len(resp["rootref"]) == 45
    obj = await lookup(h, "big", TREEOBJ)
    assert obj["type"] == "valref" and all(r.startswith("sha1-") for r in obj["data"])
    assert await get(h, "big") == BIG
    assert (await getroot(h))["rootref"].startswith("sha1-")
    ref = (await asyncio.wait_for(h.rpc("content.store", {"data": b"abc"}), 10))["blobref"]
    assert ref == "sha1-a9993e364706816aba3e25717850c26c9cd0d89d"
    assert (await stats(h, "content"))["hash"] == "sha1"


@pytest.mark.parametrize("size", [1, 4])
async def test_blob_over_limit_fails_commit_with_efbig(start_instance, connect, size) -> None:
    limit = 1 << 20
    inst = await start_instance(size=size, fanout=2,
                                attrs={"content.blob-size-limit": str(limit)})
    h = await connect(inst, size - 1)
    await commit(h, put("ok", b"x" * limit))  # at the limit: fine
    before = await getroot(h)
    assert await errnum(commit(h, put("huge", b"y" * (limit + 1))), 20) == errno.EFBIG
    assert await getroot(h) == before
    assert await errnum(get(h, "huge")) == errno.ENOENT
    # the namespace is not wedged: later commits work
    resp = await commit(h, put("after", "1"))
    assert resp["rootseq"] == before["rootseq"] + 1
    # in a merged batch only the big one fails
    futs = [asyncio.ensure_future(commit(h, put(f"m{i}", str(i)), timeout=20))
            for i in range(10)]
    futs.insert(5, asyncio.ensure_future(commit(h, put("huge2", b"z" * (2 * limit)),
                                                timeout=20)))
    results = await asyncio.gather(*futs, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and failed[0].errnum == errno.EFBIG, results
    for i in range(10):
        assert await get(h, f"m{i}") == str(i).encode()
    # content.store itself refuses it too, on any rank
    assert await errnum(h.rpc("content.store", {"data": b"q" * (limit + 1)})) == errno.EFBIG


async def test_dropped_caches_are_refilled(start_instance, connect) -> None:
    """After kvs.dropcache and content.dropcache, reads and commits fetch what
    they need again (the engines' NeedBlobs path), on rank 0 and a leaf."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    ops = [put(f"d{i % 7}.sub.k{i}", str(i) * 30) for i in range(300)]
    resp = await commit(h3, put("big", BIG), *ops)
    await asyncio.wait_for(h0.rpc("content.flush", {}), 10)
    for h in (h0, h3):
        await asyncio.wait_for(h.rpc("kvs.dropcache", {}), 10)
        await asyncio.wait_for(h.rpc("content.dropcache", {}), 10)
        assert (await stats(h))["cache"]["blobs"] == 0
    assert await get(h3, "big") == BIG
    assert await get(h3, "d3.sub.k10") == b"10" * 30
    before = (await stats(h0))["counts"].get("blob-fetches", 0)
    # a commit on rank 0 into directories it no longer has in memory
    resp = await commit(h3, put("d5.sub.new", "n"), put("big", "x", 32))
    assert (await stats(h0))["counts"].get("blob-fetches", 0) > before
    assert await get(h3, "d5.sub.new") == b"n"
    assert await get(h0, "big") == BIG + b"x"
    assert await get(h0, "d5.sub.k5") == b"5" * 30
    assert resp["rootseq"] == 2


@pytest.mark.parametrize("size", [1, 2])
async def test_kvs_sync_makes_plain_commits_survive_sigkill(start_instance, connect,
                                                            tmp_path, size) -> None:
    """``kvbroker kvs sync`` (Flux's ``flux kvs sync``): an empty SYNC commit,
    so the plain commits before it survive a crash without a periodic
    checkpoint (there is none: kvs.checkpoint-period=0)."""
    statedir = str(tmp_path / "state")
    attrs = {"kvs.checkpoint-period": "0"}
    inst = await start_instance(size=size, statedir=statedir, attrs=attrs)
    h = await connect(inst, size - 1)
    await commit(h, put("a", "1"), put("big", BIG))
    plain = await commit(h, put("b", "2"))
    rc, out, err = await run_cli("kvs", "sync", "-s", uri=inst.uri(size - 1))
    assert rc == 0, err
    assert int(out) == plain["rootseq"] + 1  # a commit: the version goes up
    resp = await getroot(h)
    kill_rank0(inst)
    await h.close()
    await inst.stop()
    await restart_and_check(start_instance, connect, size, statedir, resp, attrs=attrs)




class FrozenThread:
    """One thread of a process frozen in a cgroup-v1 freezer of its own (the
    rest of the process runs on): rank 0's SQLite thread, a disk that does
    not answer.  Root only; the test is skipped where that cannot be done."""

    ROOT = "/sys/fs/cgroup/freezer"

    def __init__(self, pid: int) -> None:
        # (a rank just started has two threads: its loop's and SQLite's)
        tids = [t for t in os.listdir(f"/proc/{pid}/task") if t != str(pid)]
        if os.geteuid() != 0 or not os.path.isdir(self.ROOT) or len(tids) != 1:
            pytest.skip("needs root, a cgroup-v1 freezer, and rank 0's SQLite thread "
                        "alone beside its loop's")
        self.path = os.path.join(self.ROOT, f"kvbroker-test-{os.getpid()}-{pid}")
        try:
            os.mkdir(self.path)
            self._write("tasks", tids[0])
            self._write("freezer.state", "FROZEN")
        except OSError as exc:
            self.thaw()
            pytest.skip(f"cannot freeze a thread here: {exc}")

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def set(self, frozen: bool) -> None:
        """Freeze the thread again, or let it run for a while (a slow disk)."""
        self._write("freezer.state", "FROZEN" if frozen else "THAWED")

    def killed(self, pid: int) -> bool:
        """Whether ``pid`` was killed: its other threads are gone (its main
        thread a zombie), the frozen one waits to be thawed to exit."""
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"

    def thaw(self) -> None:
        if os.path.isdir(self.path):
            with contextlib.suppress(OSError):
                self._write("freezer.state", "THAWED")
            with contextlib.suppress(OSError):
                with open(os.path.join(self.path, "tasks")) as f:
                    tids = f.read().split()
                for tid in tids:
                    with open(os.path.join(self.ROOT, "tasks"), "w") as f:
                        f.write(tid)
            with contextlib.suppress(OSError):
                os.rmdir(self.path)


async def frozen_or_stopped(inst: Instance, pid: int) -> FrozenThread:
    """:class:`FrozenThread` of ``pid``, or ``inst`` stopped before the
    skip (or error) goes on: left running, its loop never closed."""
    try:
        return FrozenThread(pid)
    except BaseException:
        await asyncio.wait_for(inst.stop(), 60)
        raise


async def test_a_sigkill_during_the_stop_loses_no_commit_it_acknowledged(
        start_instance, connect, tmp_path) -> None:
    """A stop lets the queued transactions through, and answered them before
    writing the final checkpoint, which must first write their blobs: on a
    slow disk that outlasts a launcher's patience (``kvbroker start``
    SIGKILLs a rank 15 s after its SIGTERM), and the restart had lost
    commits rank 0 acknowledged.  Here rank 0's SQLite thread is frozen (a
    disk that does not answer) while writers' transactions wait for room in
    the write-back backlog; the stop lets them through.  Now a batch of the
    primary namespace is checkpointed before it is answered during a stop,
    as a SYNC one: rank 0 killed at its first answer has lost nothing it
    acknowledged (kvs.checkpoint-period=0: no other checkpoint helps)."""
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=1, statedir=statedir, attrs={
        "kvs.checkpoint-period": "0", "content.backlog-bytes": str(1 << 20)})
    pid = inst.pids()[0]
    disk = FrozenThread(pid)
    h = await connect(inst, 0)  # one connection: its answers come in rank 0's order
    acked: list[str] = []
    stopping = asyncio.Event()
    acked_in_stop = asyncio.Event()

    async def writer(w: int) -> None:
        for i in range(3):
            key = f"w{w}.k{i}"
            try:
                await commit(h, put(key, f"{key} ".encode() * (1 << 18)), timeout=60)
            except RemoteError:  # (ENOSYS once stopping, or rank 0 gone)
                return
            acked.append(key)
            if stopping.is_set():
                acked_in_stop.set()

    writers = [asyncio.create_task(writer(w)) for w in range(8)]
    try:
        # The first commit is let through (the backlog was empty) and
        # answered; its blobs cannot be written, so the next ones wait.
        await wait_until(lambda: _true(acked), 30, "the first commit")
        # (kvs stats: the content module's would wait for the SQLite thread)
        base = (await stats(h))["cache"]["bytes"]
        stopping.set()
        os.kill(pid, signal.SIGTERM)

        async def applied() -> bool:  # the stop let the held ones through: their blobs
            return (await stats(h))["cache"]["bytes"] > base
        await wait_until(applied, 30, "the stop to apply the held transactions")
        # Whatever rank 0 answered before that stats answer is here by now
        # (one connection).  The final checkpoint cannot be written yet.
        if not acked_in_stop.is_set():
            disk.thaw()  # the disk catches up: checkpoint, then answers
            await asyncio.wait_for(acked_in_stop.wait(), 60)
        # The launcher's SIGKILL, at the first answer of the stop.  Thawed,
        # the disk may let rank 0 end its stop and exit before this (2 runs
        # in 6 under load: ProcessLookupError): a clean stop, checked below.
        proc = inst.procs[0]
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # (exited, reaped)
                os.kill(pid, signal.SIGKILL)
        disk.thaw()
        await asyncio.wait_for(asyncio.gather(*writers, return_exceptions=True), 60)
    finally:
        disk.thaw()
        for t in writers:
            t.cancel()
        await asyncio.gather(*writers, return_exceptions=True)
    assert await inst.stop() in ([-signal.SIGKILL], [0])  # killed, or had stopped cleanly
    done = list(acked)
    inst2 = await start_instance(size=1, statedir=statedir)
    h2 = await connect(inst2, 0)
    missing = [k for k in done if await errnum_or_none(get(h2, k))]
    assert not missing, f"{len(missing)} of {len(done)} acknowledged commits lost: {missing[:5]}"


async def commit_mib(h: Handle, n: int) -> list[str]:
    """``n`` commits of a 1 MiB value each (the writer frozen: they wait in
    rank 0's backlog); their keys."""
    keys = [f"mib{i}" for i in range(n)]
    for key in keys:
        await commit(h, put(key, os.urandom(1 << 20)), timeout=30)
    return keys


async def test_a_stop_whose_writer_makes_no_progress_is_killed_after_the_timeout(
        tmp_path) -> None:
    """Rank 0 says how much it has left to write while it stops (``stopping
    <bytes>``), and the launcher gives more time only for progress: a writer
    that does not move (a hung disk) is killed after the stop timeout, as
    before, though it keeps reporting."""
    timeout = 2.0
    inst = Instance(1, statedir=str(tmp_path / "state"), attrs={"kvs.checkpoint-period": "0"})
    await asyncio.wait_for(inst.start(), 60)
    pid = inst.pids()[0]
    disk = await frozen_or_stopped(inst, pid)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            await commit_mib(h, 4)
        loop = asyncio.get_running_loop()
        began = loop.time()
        stopping = asyncio.ensure_future(inst.stop(timeout=timeout))
        # (the frozen thread holds the killed process until it is thawed)
        await wait_until(lambda: _true(disk.killed(pid)), 30, "rank 0 to be killed")
        elapsed = loop.time() - began
        disk.thaw()
        codes = await asyncio.wait_for(stopping, 30)
        killed = inst.killed
    finally:
        disk.thaw()
        await asyncio.wait_for(inst.stop(), 60)
    assert codes == [-signal.SIGKILL] and killed == [0]
    # Killed at its timeout, not at the cap (STOP_CAP timeouts after the
    # SIGTERM) that reports counted as progress would push it to: the bound
    # tells the two apart by construction (such a kill comes STOP_CAP * 2 s
    # after ``began`` at the least), and says nothing of how soon the
    # launcher acts on a loaded machine (it was 4 s).
    assert timeout <= elapsed < STOP_CAP * timeout, elapsed
    # it said so, several times, and no report was counted as progress
    assert inst.left_to_write[0] is not None and inst.left_to_write[0] >= 4 << 20


async def test_a_stop_whose_writer_makes_progress_outlasts_the_timeout(tmp_path) -> None:
    """A slow disk writing rank 0's backlog at stop (here 60 MiB, stalled
    for 0.7 s between bursts of a few MiB: ~15 stalls, 10 s) outlasts a
    stop timeout of 4.5 s.  (Reports may come 2 s apart under load -- the
    thread frozen after a write and before it handed back its result, so
    that write is reported with the next burst's -- which 3 s left close.)
    The launcher SIGKILLed it then, losing every commit it had acknowledged
    since the last checkpoint; now each report of fewer bytes left restarts
    the rank's deadline, the stop ends cleanly, and a restart has every
    acknowledged commit."""
    TIMEOUT = 4.5
    statedir = str(tmp_path / "state")
    inst = Instance(1, statedir=statedir, attrs={"kvs.checkpoint-period": "0"})
    await asyncio.wait_for(inst.start(), 60)
    disk = await frozen_or_stopped(inst, inst.pids()[0])
    store = os.path.join(statedir, "content.sqlite")
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            keys = await commit_mib(h, 60)
        loop = asyncio.get_running_loop()
        began = loop.time()
        stopping = asyncio.ensure_future(inst.stop(timeout=TIMEOUT))
        def grown(size: int) -> Callable[[], Awaitable[bool]]:
            return lambda: _true(stopping.done() or os.path.getsize(store) >= size + (1 << 20))

        while not stopping.done():
            # The slow disk: stalled for 0.7 s, then running until the store
            # grows (SQLite copies its WAL into it every 4 MB or so).  The
            # rank reports what was written within 0.5 s, or of the next
            # burst (the thread may be frozen before it hands its result
            # back): well within the timeout.
            await asyncio.wait({stopping}, timeout=0.7)
            size = os.path.getsize(store)
            disk.set(False)
            await wait_until(grown(size), 30, "the store to grow")
            disk.set(True)
        elapsed = loop.time() - began
        codes, killed = await stopping, inst.killed
    finally:
        disk.thaw()
        await asyncio.wait_for(inst.stop(), 60)
    assert codes == [0] and killed == [], (codes, elapsed)
    assert elapsed > TIMEOUT, f"the stop took {elapsed:.1f} s: no longer than its timeout"
    inst2 = Instance(1, statedir=statedir)
    await asyncio.wait_for(inst2.start(), 60)
    try:
        async with await Handle.connect(inst2.uri(0)) as h2:
            missing = [k for k in keys if await errnum_or_none(get(h2, k))]
    finally:
        await asyncio.wait_for(inst2.stop(), 60)
    assert not missing, f"{len(missing)} of {len(keys)} acknowledged commits lost"


async def test_a_failed_checkpoint_whose_rollback_failed_is_written_over(
        small_disk, tmp_path) -> None:
    """A SYNC commit's checkpoint row is written to SQLite's WAL, then synced;
    if the sync fails (a full disk) the old row is put back -- and if that
    fails too (the WAL cannot grow), the row names the failed commit's root,
    which was never applied.  The kvs module skipped the next checkpoint
    while ``primary`` was unchanged (not newer than the last one written), so
    a restart found the failed commit (here after the final checkpoint was
    skipped, "checkpointed already").  Now after any failed checkpoint the
    next one is written, whatever the root.

    The disk fills at the sync: rank 0's SQLite thread is frozen while the
    commit flushes its blobs, blobs stored meanwhile wait (content.backlog-
    bytes) to be written after that flush's sync and before the checkpoint's
    row, and the room left holds their WAL frames but not their copy into the
    store's main file."""
    statedir, log = str(small_disk / "state"), tmp_path / "rank.log"
    inst = Instance(1, statedir=statedir, stderr_path=str(log), attrs={
        "kvs.checkpoint-period": "0", "content.backlog-bytes": str(1 << 20),
        "log.level": "info", **NO_RESERVE})
    await asyncio.wait_for(inst.start(), 60)
    try:
        async with await Handle.connect(inst.uri(0)) as h:
            await commit(h, put("a", "1"), flags=SYNC)  # checkpointed: rootseq 1
            free = os.statvfs(small_disk)
            with open(small_disk / "filler", "wb") as f:  # leave ~4.9 MB
                f.write(b"\0" * (free.f_bavail * free.f_frsize - 4_900_000))
            disk = FrozenThread(inst.pids()[0])
            try:
                base = (await stats(h))["cache"]["bytes"]
                failed = asyncio.ensure_future(commit(h, put("failed", "x"), flags=SYNC))

                async def flushing() -> bool:  # its blobs stored: its flush is under way
                    return bool((await stats(h))["cache"]["bytes"] > base)

                await wait_until(flushing, 30, "the SYNC commit to flush")
                # 1.1 MB, written before the flush's sync; then 2.5 MB, which
                # waits for room (over 1 MiB) until that write is done
                await h.rpc("content.store", {"data": os.urandom(1_100_000)})
                late = asyncio.ensure_future(h.rpc("content.store",
                                                   {"data": os.urandom(2_500_000)}))
                await stats(h)  # (answered after that request reached rank 0)
            finally:
                disk.thaw()
            assert await errnum_or_none(failed) in (errno.ENOSPC, errno.EIO)
            await asyncio.wait_for(late, 30)
        os.remove(small_disk / "filler")
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    text = log.read_text()
    assert codes == [0], text
    assert "final checkpoint: the primary namespace at rootseq 1 (rootref" in text, text
    assert "checkpointed already" not in text, text
    inst2 = Instance(1, statedir=statedir, stderr_path=str(log))
    await asyncio.wait_for(inst2.start(), 60)
    try:
        async with await Handle.connect(inst2.uri(0)) as h2:
            root = await getroot(h2)
            assert root["rootseq"] == 1, log.read_text()
            assert await errnum_or_none(get(h2, "failed")) == errno.ENOENT
            assert await get(h2, "a") == b"1"
    finally:
        await asyncio.wait_for(inst2.stop(), 60)


async def _true(x: Any) -> bool:
    return bool(x)

async def errnum_or_none(aw: Any) -> int | None:
    """The errno ``aw`` fails with, None if it succeeds."""
    try:
        await asyncio.wait_for(aw, 30)
    except RemoteError as exc:
        return exc.errnum
    return None
