"""``kvs.gc`` / ``kvbroker kvs gc``: online garbage collection on rank 0.

Real instances on a statedir in ``tmp_path``; after the collections, the
instance is stopped and its SQLite file is walked directly
(:func:`kvs.garbage.reachable` raises if a blob a root needs is missing), so
"nothing live was deleted" is checked on the store itself, not through a
cache.  Reference: etcd's compaction (reads at a compacted revision fail);
Flux collects offline only (``flux shutdown --gc``).
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli
from test_kvs_gc import BIG, _count, _fill
from test_kvs_rpc_helpers import (
    SYNC,
    TREEOBJ,
    commit,
    dirref,
    errnum,
    get,
    getroot,
    lookup,
    put,
    run_guest,
    stats,
    unlink,
    valref,
)

from broker.content import blobref
from broker.content.collection import RowidMarks
from broker.content.sqlite import SqliteStore
from broker.errors import RemoteError
from kvs import treeobj as T
from kvs.collect import RootHistory
from kvs.garbage import GcError, reachable

NOW = {"kvs.gc-grace": "0"}
"""Keep no history: the most a collection can delete."""


async def gc(h: Any, **kw: Any) -> dict[str, Any]:
    return await asyncio.wait_for(h.rpc("kvs.gc", kw), 60)


async def dropcaches(inst: Any, connect: Any) -> None:
    """Empty the kvs and content caches of every rank: reads go to the store."""
    for rank in range(inst.size):
        h = await connect(inst, rank)
        await asyncio.wait_for(h.rpc("kvs.dropcache", {}), 10)
        await asyncio.wait_for(h.rpc("content.dropcache", {}), 10)


def assert_whole(statedir: Path, roots: list[str]) -> set[str]:
    """Every blob the trees ``roots`` need is in the stopped instance's store."""
    store = SqliteStore(str(statedir / "content.sqlite"))
    try:
        return reachable(store.get, roots, has=store.has)
    finally:
        store.close()


async def test_gc_removes_old_versions_and_keeps_every_live_tree(
        start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    inst = await start_instance(size=2, statedir=str(statedir), attrs=NOW)
    h = await connect(inst, 1)
    orphan = (await asyncio.wait_for(h.rpc("content.store", {"data": b"orphan"}), 10))["blobref"]
    expect, first = await _fill(h)
    await commit(h, put("more", "after the orphan"))
    tmp_expect = {"t": BIG}
    result = await gc(h)  # from rank 1: forwarded to rank 0
    assert result["removed"] > 50, result  # the old versions' shards and roots, the orphan
    assert result["removed-bytes"] > 0 and result["compacted"] is False
    assert result["grace"] == 0
    assert (await gc(h))["removed"] == 0  # nothing left to find

    await dropcaches(inst, connect)
    for rank in (0, 1):
        hr = await connect(inst, rank)
        for key, value in expect.items():
            assert await get(hr, key) == value, key
        for key, value in tmp_expect.items():
            assert await get(hr, key, ns="tmp") == value
    # an old version is gone, as etcd answers a compacted revision; the orphan too
    assert await errnum(get(h, "early", rootdir=dirref(first["rootref"]))) == errno.ENOENT
    assert await errnum(h.rpc("content.load", {"blobref": orphan})) == errno.ENOENT
    await commit(h, put("after", "gc"))  # and it goes on committing
    assert await get(h, "after") == b"gc"

    s = (await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=0), 10))
    assert s["counts"]["collections"] == 2
    assert s["gc"]["last"]["removed"] == 0 and s["gc"]["running"] is False
    roots = [(await getroot(h))["rootref"], (await getroot(h, ns="tmp"))["rootref"]]
    await h.close()
    assert await inst.stop() == [0, 0]
    assert_whole(statedir, roots)
    # a restart resumes from the checkpoint, which the collection kept whole
    inst2 = await start_instance(size=1, statedir=str(statedir))
    h2 = await connect(inst2, 0)
    for key, value in expect.items():
        assert await get(h2, key) == value, key


async def test_gc_keeps_the_roots_of_the_grace_period(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs={"kvs.gc-grace": "1h"})
    h = await connect(inst, 1)
    old = await commit(h, *(put(f"d.k{i}", f"old {i}") for i in range(100)))
    await commit(h, *(put(f"d.k{i}", f"new {i}") for i in range(100)))
    result = await gc(h)
    assert result["grace"] == 3600
    await dropcaches(inst, connect)
    assert await get(h, "d.k7", rootdir=dirref(old["rootref"])) == b"old 7"
    assert await get(h, "d.k7") == b"new 7"


async def test_a_first_gc_without_a_statedir_removes_the_old_versions(
        start_instance, connect) -> None:
    """Without a statedir, rank 0 writes blobs to its file only to make room
    or for a collection, which writes them first: their rows were as young
    as the collection, so the first one past the grace period removed
    nothing (the README's tour: 'removed 0 blobs').  A row is now as old as
    the newest store of its batch.  A read at a collected root then fails
    on rank 0 at once (its memo of decoded objects answered it until
    evicted), and on a rank that read it once its caches let it go."""
    inst = await start_instance(size=2, attrs={"kvs.gc-grace": "0.5s"})
    h, h1 = await connect(inst, 0), await connect(inst, 1)
    first = await commit(h, put("x.v", "1"))
    old = dirref(first["rootref"])
    assert await get(h, "x.v", rootdir=old) == b"1"
    assert await get(h1, "x.v", rootdir=old) == b"1"
    await commit(h, put("x.v", "2"))
    await commit(h, put("x.v", "3"))
    assert (await stats(h, "content"))["written"] == 0  # (nothing written yet)
    await asyncio.sleep(1.0)  # the old versions age past the grace period (the behaviour)
    result = await gc(h)
    assert result["removed"] > 0, result
    assert await errnum(get(h, "x.v", rootdir=old)) == errno.ENOENT
    await asyncio.wait_for(h1.rpc("kvs.dropcache", {}), 10)
    await asyncio.wait_for(h1.rpc("content.dropcache", {}), 10)
    assert await errnum(get(h1, "x.v", rootdir=old)) == errno.ENOENT
    assert await get(h, "x.v") == b"3"
    assert await get(h1, "x.v") == b"3"


async def test_gc_under_concurrent_commits_copies_and_namespaces_loses_nothing(
        start_instance, connect, tmp_path) -> None:
    """Collections back to back while three ranks commit: values (small, and
    big ones stored as blobs of their own) into a growing sharded directory,
    copies of a directory taken from *old* roots (whose subtrees the
    collection is deleting), and namespaces created and removed.  A copy may
    fail with ENOENT (its source went); none may succeed with a tree that
    cannot be read.  At the end every root's tree is whole in the store
    itself, and every value reads back."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=3, statedir=str(statedir), attrs=NOW)
    h0, h1, h2 = [await connect(inst, r) for r in range(3)]
    model: dict[str, bytes] = {}
    snapshots: list[tuple[str, dict[str, bytes]]] = []  # (rootref, the "s" keys then)
    copies: dict[str, dict[str, bytes]] = {}
    namespaces: dict[str, bytes] = {}
    stop = asyncio.Event()
    have_snapshot = asyncio.Event()  # the writer's first snapshot is there
    counts = {"copy-failed": 0, "old-root-gone": 0}

    async def writer() -> None:
        i = 0
        while not stop.is_set():
            ops = [put(f"s.d{(i + j) % 7}.k{i + j}", f"v{i + j}") for j in range(3)]
            ops.append(put("hot", f"hot {i}"))
            if i % 30 == 0:  # a value stored as a blob of its own (a valref)
                ops.append(put(f"s.big.b{i}", BIG + str(i).encode()))
            r = await commit(h1, *ops)
            model.update({op["key"]: op["dirent"]["data"] for op in ops})
            if i % 15 == 0:
                snapshots.append((r["rootref"], {k: v for k, v in model.items()
                                                 if k.startswith("s.")}))
                have_snapshot.set()
            i += 3

    async def copier() -> None:
        n = 0
        await have_snapshot.wait()  # (the test waits for it, time-boxed)
        while not stop.is_set():
            # Every other copy from the newest snapshot, the rest round the
            # older ones: copying only old roots, all of them collected
            # back to back, could leave no copy made at all (1 run in ~25).
            rootref, snap = snapshots[-1 if n % 2 else n // 2 % len(snapshots)]
            n += 1
            try:
                tree = await lookup(h2, "s", TREEOBJ, rootdir=dirref(rootref))
            except RemoteError as exc:
                assert exc.errnum == errno.ENOENT, exc
                counts["old-root-gone"] += 1
                continue
            try:
                await commit(h2, put(f"copy{n}", tree))
            except RemoteError as exc:
                assert exc.errnum == errno.ENOENT, exc  # its source was collected
                counts["copy-failed"] += 1
                continue
            copies[f"copy{n}"] = {f"copy{n}." + k[2:]: v for k, v in snap.items()}

    async def namespacer() -> None:
        n = 0
        while not stop.is_set():
            name = f"job{n}"
            await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": name}), 10)
            await commit(h0, put("eventlog", f"job {n}\n"), put("R", BIG), ns=name)
            namespaces[name] = f"job {n}\n".encode()
            if n % 2:
                await asyncio.wait_for(h0.rpc("kvs.namespace-remove", {"namespace": name}), 10)
                del namespaces[name]
            n += 1

    tasks = [asyncio.create_task(f()) for f in (writer, copier, namespacer)]
    removed = 0
    try:
        # A writer that failed first is reported by the gather below.
        await asyncio.wait_for(have_snapshot.wait(), 30)
        collections = 0
        while collections < 12 or len(model) < 600:  # (and 200 commits at least)
            result = await gc(h0)
            assert result["damaged-count"] == 0, result["damaged"]  # every live tree was whole
            removed += result["removed"]
            collections += 1
            for t in tasks:
                if t.done():
                    t.result()  # a writer failed: say why
    finally:
        stop.set()
        have_snapshot.set()  # (a copier still waiting for one ends too)
        await asyncio.gather(*tasks)
    assert removed > 100, removed
    assert copies, counts  # some copies made it (others may not: counted)

    await dropcaches(inst, connect)
    for key, value in model.items():
        assert await get(h1, key) == value, key
    for expect in copies.values():
        for key, value in expect.items():
            assert await get(h2, key) == value, key
    for name, value in namespaces.items():
        assert await get(h0, "eventlog", ns=name) == value
    roots = [(await getroot(h0))["rootref"]]
    roots += [(await getroot(h0, ns=name))["rootref"] for name in namespaces]
    for h in (h0, h1, h2):
        await h.close()
    assert await inst.stop() == [0, 0, 0]
    assert_whole(statedir, roots)


async def test_gc_period_collects_by_itself(start_instance, connect) -> None:
    """``kvs.gc-period``: rank 0 collects on its own, as etcd's auto-compaction."""
    inst = await start_instance(size=2, attrs={**NOW, "kvs.gc-period": "200ms"})
    h = await connect(inst, 1)
    first = await commit(h, put("a.b", "first"))
    for i in range(20):
        await commit(h, put("a.b", f"{i}"))

    async def collections() -> int:
        s = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=0), 10)
        assert s["gc"]["period"] == 0.2
        return int(s["counts"]["collections"])

    # Two more collections: one of them began after the last commit
    target = await collections() + 2
    async with asyncio.timeout(30):
        while await collections() < target:
            await asyncio.sleep(0.05)  # (polls the state it waits for)
    await dropcaches(inst, connect)
    assert await errnum(get(h, "a.b", rootdir=dirref(first["rootref"]))) == errno.ENOENT
    assert await get(h, "a.b") == b"19"


async def test_a_blob_stored_then_committed_survives_a_gc_in_between(
        start_instance, connect) -> None:
    """``content.store`` first, commit a valref later: the blob is young (the
    grace period) and kept, so the commit finds it."""
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    ref = (await asyncio.wait_for(h.rpc("content.store", {"data": BIG}), 10))["blobref"]
    await asyncio.wait_for(h.rpc("content.flush", {}), 10)  # written: a row like any other
    assert (await gc(h))["removed"] == 0
    await dropcaches(inst, connect)
    await commit(h, put("big", valref(ref)))
    assert await get(h, "big") == BIG


async def test_gc_compact_shrinks_the_file(start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir), attrs=NOW)
    h = await connect(inst, 0)
    for i in range(40):
        await commit(h, put("v", os.urandom(4096) + bytes([i])))
    await asyncio.wait_for(h.rpc("content.flush", {}), 10)
    before = (await gc(h))
    assert before["removed"] >= 38 and before["free-bytes"] > 100_000, before
    after = await gc(h, compact=True)
    assert after["compacted"] is True and after["free-bytes"] == 0
    assert after["file-bytes"] < before["file-bytes"] - 100_000
    assert len(await get(h, "v")) == 4097
    await h.close()
    await inst.stop()
    assert _count(statedir) < 10


async def test_gc_bad_input_and_concurrent_requests(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    assert await errnum(h.rpc("kvs.gc", {"compact": "yes"})) == errno.EPROTO
    await commit(h, *(put(f"k{i}", f"{i}") for i in range(50)))
    # Two at once: each either runs or is told one is running; none breaks
    outcomes = await asyncio.gather(*(gc(h) for _ in range(4)), return_exceptions=True)
    for o in outcomes:
        assert isinstance(o, dict) or (isinstance(o, RemoteError) and o.errnum == errno.EBUSY), o
    assert any(isinstance(o, dict) for o in outcomes)
    assert await get(h, "k7") == b"7"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guest")
async def test_gc_is_the_instance_owners(start_instance) -> None:
    inst = await start_instance(size=2, attrs={"access.allow-guest-user": "true"})
    out = await asyncio.to_thread(run_guest, inst.uri(1), """
        async def body(h):
            return await call(h, "kvs.gc", {})
    """)
    assert out == {"errnum": errno.EPERM}


async def test_cli_gc_online(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs=NOW)
    h = await connect(inst, 1)
    for i in range(10):
        await commit(h, put("a.b", f"{i}"))
    rc, out, err = await run_cli("kvs", "gc", uri=inst.uri(1))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("removed ") and " blobs (" in lines[0], out
    assert int(lines[0].split()[1].replace(",", "")) >= 9
    assert "the last 0 s" in lines[1]
    assert lines[2].startswith("content.sqlite: ") and "free for new blobs" in lines[2]
    rc, out, err = await run_cli("kvs", "gc", "--compact", uri=inst.uri(0))
    assert rc == 0 and out.splitlines()[2].endswith("compacted"), (out, err)


async def test_cli_gc_dry_run_online_is_a_usage_error(start_instance) -> None:
    """``gc --dry-run`` without ``--statedir`` is an option of the offline form:
    a usage error (exit 2, the usage line, nothing sent), as docs/cli.md says
    of usage errors and as ``dump --statedir`` without ``--checkpoint`` is; it
    exited 1 with an error line."""
    inst = await start_instance(size=1, attrs=NOW)
    rc, out, err = await run_cli("kvs", "gc", "--dry-run", uri=inst.uri(0))
    assert rc == 2, (rc, err)
    assert err.startswith("usage: kvbroker kvs gc"), err
    assert "--dry-run is for a stopped instance (--statedir DIR)" in err
    assert out == ""


async def test_a_directory_also_named_as_a_value_keeps_its_subtree(
        start_instance, connect, tmp_path) -> None:
    """One blob named as a directory (dirref) and as a value's data (valref):
    the mark walks it as the directory too (it was kept as data alone)."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir), attrs=NOW)
    h = await connect(inst, 0)
    await commit(h, put("sub.x", "below the directory"), put("sub.y", BIG))
    d = (await lookup(h, "sub", TREEOBJ))["data"][0]
    await commit(h, put("a", dirref(d)), put("b", valref(d)), unlink("sub"))
    await gc(h)
    await dropcaches(inst, connect)
    assert await get(h, "a.y") == BIG
    root = (await getroot(h))["rootref"]
    await h.close()
    await inst.stop()
    assert_whole(statedir, [root])


def test_offline_mark_walks_a_directory_also_named_as_a_value() -> None:
    value = b"V" * 100
    value_ref = blobref.hash_blob(value)
    sub = T.encode(T.dir_({"y": T.valref([value_ref])}))
    sub_ref = blobref.hash_blob(sub)
    root = T.encode(T.dir_({"a": T.dirref(sub_ref), "b": T.valref([sub_ref])}))
    root_ref = blobref.hash_blob(root)
    store = {sub_ref: sub, root_ref: root, value_ref: value}
    assert reachable(store.get, [root_ref]) == {root_ref, sub_ref, value_ref}


def test_offline_mark_finds_damage_under_a_root_shared_with_another_checkpoint() -> None:
    """A subtree of the KVS root also under another checkpoint key's blob
    (walked as "maybe a tree", whose missing blobs are skipped): walked
    that way first, a blob missing under it was skipped, then the root's
    walk found the subtree walked already, and the damage was never said
    -- a collection of a damaged store went ahead (found by a review).
    The roots are walked first."""
    sub = T.encode(T.dir_({"y": T.dirref(blobref.hash_blob(b"gone"))}))
    sub_ref = blobref.hash_blob(sub)
    root = T.encode(T.dir_({"a": T.dirref(sub_ref)}))
    root_ref = blobref.hash_blob(root)
    other = T.encode(T.dir_({"s": T.dirref(sub_ref)}))
    other_ref = blobref.hash_blob(other)
    store = {sub_ref: sub, root_ref: root, other_ref: other}
    with pytest.raises(GcError, match="is named but not in the store"):
        reachable(store.get, [root_ref], [other_ref])


async def test_sync_commits_racing_collections_stay_whole(
        start_instance, connect, tmp_path) -> None:
    """A SYNC commit stores its blobs, then waits for the flush and the
    checkpoint before its root is set: a collection that lists the roots
    meanwhile keeps that root too (it is live from its store on)."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir), attrs=NOW)
    h = await connect(inst, 0)
    await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": "other"}), 10)
    model: dict[str, dict[str, bytes]] = {"primary": {}, "other": {}}
    stop = asyncio.Event()

    async def writer(ns: str, w: int) -> None:
        i = 0
        while not stop.is_set():
            key, value = f"d{w}.k{i % 50}", f"{ns} {w} {i}".encode() * 40  # valrefs
            await commit(h, put(key, value), ns=ns, flags=SYNC)
            model[ns][key] = value
            i += 1

    tasks = [asyncio.create_task(writer(ns, w)) for ns in model for w in range(3)]
    try:
        for _ in range(40):
            assert (await gc(h))["damaged-count"] == 0
            for t in tasks:
                if t.done():
                    t.result()
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    await dropcaches(inst, connect)
    for ns, values in model.items():
        for key, value in values.items():
            assert await get(h, key, ns=ns) == value, (ns, key)
    roots = [(await getroot(h, ns=ns))["rootref"] for ns in model]
    await h.close()
    await inst.stop()
    assert_whole(statedir, roots)


async def test_a_blob_stored_again_is_young_for_the_grace_period(
        start_instance, connect) -> None:
    """Storing a blob whose (garbage) row is old keeps the old row: the
    collection still counts the store's time, not the row's."""
    inst = await start_instance(size=2, attrs={"kvs.gc-grace": "1s"})
    h = await connect(inst, 1)
    await commit(h, put("v", BIG))
    await commit(h, put("v", "replaced"))  # BIG's blob is garbage now
    await asyncio.wait_for(h.rpc("content.flush", {}), 10)
    await asyncio.sleep(1.5)  # (the row must be older than the grace period)
    ref = (await asyncio.wait_for(h.rpc("content.store", {"data": BIG}), 10))["blobref"]
    await asyncio.wait_for(h.rpc("content.flush", {}), 10)
    await gc(h)
    await dropcaches(inst, connect)
    await commit(h, put("big", valref(ref)))
    assert await get(h, "big") == BIG


async def test_a_dirref_to_a_directory_with_missing_entries_is_refused(
        start_instance, connect) -> None:
    """A commit checks every blob below a dirref it names: a directory whose
    entries were never stored (or were collected) is ENOENT, and no tree
    that cannot be read is made, so collections go on."""
    inst = await start_instance(size=2, attrs=NOW)
    h = await connect(inst, 1)
    never = blobref.hash_blob(b"never stored")
    bad = T.encode(T.dir_({"x": T.dirref(never)}))
    ref = (await asyncio.wait_for(h.rpc("content.store", {"data": bad}), 10))["blobref"]
    assert await errnum(commit(h, put("bad", dirref(ref)))) == errno.ENOENT
    assert (await gc(h))["damaged-count"] == 0


@pytest.mark.parametrize("op", ["diff", "lookup", "commit"])
async def test_work_under_way_at_a_decision_finishes(start_instance, connect, op) -> None:
    """A collection's decision drops rank 0's kvs cache in place: a diff, a
    lookup or a commit under way keeps what it holds and finishes.  (Caches
    swapped for new ones left a diff reading the old one for ever, rank 0
    spinning, and with a small cache a lookup or commit fetching for ever.)"""
    inst = await start_instance(size=1, attrs={"kvs.gc-grace": "1h", "kvs.cache-bytes": "3000"})
    h = await connect(inst, 0)
    deep = ".".join(["a"] * 60)
    old = (await commit(h, put(f"{deep}.x", "1")))["rootref"]
    new = (await commit(h, put(f"{deep}.x", "2")))["rootref"]
    for attempt in range(8):
        await asyncio.wait_for(h.rpc("kvs.dropcache", {}), 10)  # (every read fetches)
        if op == "diff":
            work = h.rpc("kvs.diff", {"old": old, "new": new})
        elif op == "lookup":
            work = get(h, f"{deep}.x")
        else:
            work = commit(h, put(f"{deep}.y{attempt}", "v"))
        answer, _ = await asyncio.wait_for(asyncio.gather(work, gc(h)), 30)
        if op == "diff":
            assert answer["keys"] == [f"{deep}.x"]
        elif op == "lookup":
            assert answer == b"2"
    assert await get(h, f"{deep}.y7" if op == "commit" else f"{deep}.x") in (b"v", b"2")


# ---------------------------------------------------------------- pure parts


def test_rowid_marks_say_what_was_written_how_long_ago() -> None:
    marks = RowidMarks()
    marks.note(10, now=100.0)
    marks.note(15, now=100.5)  # the same second: the mark moves up
    marks.note(40, now=105.0)
    marks.note(90, now=110.0)
    assert marks.as_of(0, now=110.0) == 90
    assert marks.as_of(5, now=110.0) == 40
    assert marks.as_of(9.9, now=110.0) == 0  # row 15 is only 9.5 s old
    assert marks.as_of(9.5, now=110.0) == 15
    assert marks.as_of(11, now=110.0) == 0  # nothing that old: delete nothing
    merged = RowidMarks()
    merged.note(10, now=100.0)
    merged.note(500, now=100.9)  # the same second: the mark is as young as row 500
    assert merged.as_of(10.0, now=110.1) == 0
    marks.note(95, now=5000.0)  # an hour on: older marks go, the last before stays
    assert marks.as_of(3600, now=5000.0) == 90


def test_root_history_keeps_the_grace_period() -> None:
    history = RootHistory(grace=1000.0, maxlen=3)
    for i in range(5):
        history.note(f"sha1-{i:040x}")
    assert history.recent() == [f"sha1-{i:040x}" for i in (2, 3, 4)]  # bounded
    history.note(f"sha1-{4:040x}")  # the same root again: noted once
    assert len(history) == 3
    assert RootHistory(grace=0.0).recent() == []


async def test_a_directory_checked_whole_is_walked_again_only_after_a_gc(
        start_instance, connect) -> None:
    """Rank 0 remembers the directories a commit checked whole: naming one
    again (a second ``kvs copy``) reads only its top.  A collection empties
    that memory, since it may remove blobs below a tree checked before it:
    a directory whose subdirectory it removed is ENOENT again, even though
    it was once checked whole and its own blob came back."""
    inst = await start_instance(size=1, attrs=NOW)
    h = await connect(inst, 0)

    async def checked() -> int:
        return (await stats(h))["counts"]["trees-checked"]

    await commit(h, *(put(f"big.k{i}", f"v{i}") for i in range(600)))  # sharded
    src = await lookup(h, "big", flags=TREEOBJ)
    assert src["type"] == "dirref"
    before = await checked()
    await commit(h, put("copy1", src))
    first = await checked() - before
    assert first >= 4  # the shards below the top, read once
    await commit(h, put("copy2", src))
    assert await checked() - before == first  # not again
    assert await get(h, "copy2.k599") == b"v599"
    # X = {sub: Y}, stored by hand, checked whole, then unreachable and collected
    y = T.encode(T.dir_({"k": T.val(b"gone")}))
    yref = (await asyncio.wait_for(h.rpc("content.store", {"data": y}), 10))["blobref"]
    x = T.encode(T.dir_({"sub": T.dirref(yref)}))
    xref = (await asyncio.wait_for(h.rpc("content.store", {"data": x}), 10))["blobref"]
    await commit(h, put("old", dirref(xref)))
    assert (await stats(h))["trees-known-whole"] >= 2
    await commit(h, unlink("old"))
    await gc(h)
    assert (await stats(h))["trees-known-whole"] == 0
    await dropcaches(inst, connect)
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(h.rpc("content.load", {"blobref": yref}), 10)
    assert info.value.errnum == errno.ENOENT  # the collection removed Y
    await asyncio.wait_for(h.rpc("content.store", {"data": x}), 10)  # X is back, Y is not
    assert await errnum(commit(h, put("again", dirref(xref)))) == errno.ENOENT


async def test_a_read_at_a_collected_root_says_so_and_is_never_a_missing_key(
        start_instance, connect) -> None:
    """A read at a root ``kvs gc`` collected fails ``ENOENT`` naming the root
    and the collection, not "no such key"; and the readers that answer a
    missing key as data do not take it for one: ``KVS.exists`` answered
    False, ``watch-keys -v`` printed ``KEY (removed)`` for a key that
    exists, at a version it only could not read."""
    from kvs.client import KVS
    from kvs_watch.cli import _value_at

    inst = await start_instance(size=1, attrs=NOW)
    h = await connect(inst, 0)
    old = await commit(h, put("k", "v"))
    await commit(h, put("other", "x"))
    assert (await gc(h))["removed"] > 0
    at = dirref(old["rootref"])
    with pytest.raises(RemoteError) as err:
        await lookup(h, "k", rootdir=at)
    assert err.value.errnum == errno.ENOENT
    assert f"cannot read k at root {old['rootref']}" in err.value.errstr
    assert "kvs gc" in err.value.errstr and "no such key" not in err.value.errstr
    kvs = KVS(h)
    with pytest.raises(RemoteError) as err:
        await asyncio.wait_for(kvs.exists("k", at=at), 10)
    assert err.value.errnum == errno.ENOENT
    shown = await asyncio.wait_for(_value_at(h, "primary", "k", at), 10)
    assert "removed" not in shown and "cannot read k at root" in shown, shown
    # at a root that can be read, a missing key is still just missing
    now = dirref((await getroot(h))["rootref"])
    assert await asyncio.wait_for(kvs.exists("nosuch", at=now), 10) is False
    assert await asyncio.wait_for(kvs.exists("k", at=now), 10) is True
    assert await asyncio.wait_for(_value_at(h, "primary", "nosuch", now), 10) == " (removed)"
    assert await asyncio.wait_for(_value_at(h, "primary", "k", now), 10) == "=v"


async def test_a_restore_keeps_its_blobs_through_a_collection_before_its_commit(
        start_instance, connect) -> None:
    """``kvs restore`` stores the values' blobs as it reads the archive and
    names them in one commit at the end; a collection in between (here
    with no grace period: the blobs were older than it) deleted the first
    ones, and the commit failed ENOENT.  The restore stores them under a
    hold that every collection keeps until the restore releases it, after
    its commit: then they are the collector's again."""
    import io
    import tarfile

    from test_broker_support import KVBROKER, wait_until

    inst = await start_instance(size=2, attrs=NOW)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    values = [f"value {i} ".encode() * 20 for i in range(1500)]  # blobs of their own
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for i, data in enumerate(values):
            info = tarfile.TarInfo(f"d{i % 10}/k{i}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive_bytes = buf.getvalue()
    cut = 1200 * 1024  # (a header and a block of data each): past the first store batch
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "kvs", "restore", "-q", "--key", "r", "-",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "KVBROKER_URI": inst.uri(1)})
    try:
        assert proc.stdin is not None
        proc.stdin.write(archive_bytes[:cut])
        await proc.stdin.drain()
        first_batch = [blobref.hash_blob(v) for v in values[:1024]]

        async def stored() -> bool:
            try:
                await h0.rpc("content.load", {"blobref": first_batch[-1]})
            except RemoteError:
                return False
            return True

        await wait_until(stored, "the restore's first batch of blobs on rank 0", 30)
        assert (await gc(h0))["removed"] == 0  # the restore's blobs are held
        proc.stdin.write(archive_bytes[cut:])
        proc.stdin.close()
        _out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    assert (await stats(h0, "content"))["holds"] == 0  # released after its commit
    await gc(h0)
    await dropcaches(inst, connect)
    for i in (0, 1023, 1499):
        assert await get(h1, f"r.d{i % 10}.k{i}") == values[i]
    await commit(h1, unlink("r"))
    assert (await gc(h0))["removed"] >= 1500  # no longer held
