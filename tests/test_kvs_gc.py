"""``kvbroker kvs gc``: offline garbage collection of a statedir's content store.

The integration tests run real instances on a statedir in ``tmp_path`` and
the real CLI on the stopped store; the unit tests build trees with the commit
engine and check the mark phase against a store made from scratch.
Reference: Flux collects offline as well (``flux shutdown --gc``: dump the
KVS, restore it into a fresh store); see kvs/garbage.py.
"""

from __future__ import annotations

import asyncio
import errno
import os
import sqlite3
from pathlib import Path
from typing import Any

import msgpack
import pytest
from test_broker_support import run_cli
from test_kvs_rpc_helpers import (
    APPEND,
    commit,
    dirref,
    errnum,
    get,
    getroot,
    put,
    symlink,
    unlink,
)

from broker.content import blobref
from broker.content.sqlite import SqliteStore, digest_of
from broker.errors import RemoteError
from kvs import shards, txn
from kvs import treeobj as T
from kvs.garbage import GcError, collect, reachable
from kvs.namespaces import CHECKPOINT_KEY

BIG = bytes(range(256)) * 8  # 2 KiB: a valref


def _count(statedir: Path) -> int:
    store = SqliteStore(str(statedir / "content.sqlite"))
    try:
        return store.count()
    finally:
        store.close()


async def _fill(h: Any) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Commits that leave garbage behind: a sharded directory written in
    steps, values overwritten and unlinked, appends, a symlink, and a
    namespace that a restart does not bring back.  Returns the final
    primary contents and the root of an early version."""
    expect: dict[str, bytes] = {}
    first = await commit(h, put("early", "gone soon"))
    for step in range(6):  # 300 names: an hdir, rewritten shard by shard
        ops = [put(f"big.k{i}", f"{step}-{i}") for i in range(step * 50, step * 50 + 50)]
        await commit(h, *ops)
        expect.update({f"big.k{i}": f"{step}-{i}".encode()
                       for i in range(step * 50, step * 50 + 50)})
    for i in range(5):
        await commit(h, put("blob", BIG + bytes([i])), put("a.b.c", f"v{i}"))
    expect["blob"], expect["a.b.c"] = BIG + bytes([4]), b"v4"
    for i in range(4):
        await commit(h, put("log", f"line {i}\n", flags=APPEND))
    expect["log"] = b"".join(f"line {i}\n".encode() for i in range(4))
    await commit(h, put("link", symlink("big.k7")), unlink("early"))
    expect["link"] = expect["big.k7"]
    await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": "tmp", "owner": -1}), 10)
    await commit(h, put("t", BIG), ns="tmp")
    return expect, first


async def _filled(start_instance, connect, tmp_path: Path) -> tuple[Any, Any, Path]:
    """A 1-rank instance on a statedir in ``tmp_path``, after :func:`_fill`."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    await _fill(h)
    return inst, h, statedir


async def test_gc_removes_only_what_the_checkpoint_does_not_reach(
        start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    # Checkpointed only at the stop: a periodic one could name an early
    # version, which the collection must then keep (an older checkpoint).
    inst = await start_instance(size=2, statedir=str(statedir),
                                attrs={"kvs.checkpoint-period": "0"})
    h = await connect(inst, 1)
    expect, first = await _fill(h)
    orphan = (await asyncio.wait_for(h.rpc("content.store", {"data": b"orphan"}), 10))["blobref"]
    root = await getroot(h)
    await h.close()
    assert await inst.stop() == [0, 0]
    before = _count(statedir)

    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 0, err
    kept = _count(statedir)
    assert f"kept {kept:,} blobs" in out
    assert f"removed {before - kept:,} blobs" in out
    assert f"{CHECKPOINT_KEY} (rootseq {root['rootseq']})" in out
    assert before - kept > 50  # the old versions' shards and roots, the orphan, tmp's blobs

    # every blob left is reachable, and nothing reachable went: a second
    # collection finds nothing, and a restart reads every key
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 0 and "removed 0 blobs" in out, (out, err)
    inst2 = await start_instance(size=2, statedir=str(statedir))
    for rank in (0, 1):
        h2 = await connect(inst2, rank)
        again = await getroot(h2)
        assert (again["rootref"], again["rootseq"]) == (root["rootref"], root["rootseq"])
        for key, value in expect.items():
            assert await get(h2, key) == value, key
    # what was not reachable is gone: an early version, the orphan blob
    assert await errnum(get(h2, "early", rootdir=dirref(first["rootref"]))) == errno.ENOENT
    assert await errnum(h2.rpc("content.load", {"blobref": orphan})) == errno.ENOENT
    await commit(h2, put("after", "gc"))  # and it goes on committing
    assert await get(h2, "after") == b"gc"


async def test_gc_dry_run_counts_and_deletes_nothing(start_instance, connect,
                                                     tmp_path) -> None:
    inst, h, statedir = await _filled(start_instance, connect, tmp_path)
    await h.close()
    await inst.stop()
    before = _count(statedir)
    rc, dry, err = await run_cli("kvs", "gc", "-n", "--statedir", str(statedir))
    assert rc == 0, err
    assert _count(statedir) == before
    rc, real, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 0, err
    would = dry.splitlines()[1].replace("would remove", "removed")
    assert would == real.splitlines()[1]
    assert dry.splitlines()[0] == real.splitlines()[0]  # the same "kept" line
    # the file line of a dry run is the size now (it said "1.0 MB -> 1.0 MB")
    assert dry.splitlines()[2].endswith("(a dry run compacts nothing)")
    assert " -> " not in dry.splitlines()[2]


async def test_gc_refuses_a_running_instance(start_instance, connect, tmp_path) -> None:
    inst, h, statedir = await _filled(start_instance, connect, tmp_path)
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 1
    assert "in use by a running instance" in err and "stop it first" in err
    # the instance was not disturbed
    await commit(h, put("still", "serving"))
    assert await get(h, "still") == b"serving"
    await h.close()
    await inst.stop()


async def _damaged(start_instance, connect, tmp_path: Path, key: str,
                   tamper: bool = False) -> tuple[Path, str]:
    """A stopped instance's statedir after :func:`_fill`, with the first
    blob of ``key``'s tree object deleted from the store (``tamper``: its
    bytes replaced by those of an empty directory, a tree object that
    decodes but names nothing, and does not match the blob's hash); and
    that blobref."""
    inst, h, statedir = await _filled(start_instance, connect, tmp_path)
    obj = (await asyncio.wait_for(h.rpc("kvs.lookup", {"key": key, "flags": 16,
                                                       "namespace": "primary"}), 10))["val"]
    await h.close()
    await inst.stop()
    missing = obj["data"][0]
    db = sqlite3.connect(statedir / "content.sqlite")
    with db:
        if tamper:
            db.execute("UPDATE objects SET object = ? WHERE hash = ?",
                       (T.encode(T.dir_()), digest_of(missing)))
        else:
            db.execute("DELETE FROM objects WHERE hash = ?", (digest_of(missing),))
    db.close()
    return statedir, missing


async def test_gc_refuses_a_damaged_store_and_deletes_nothing(start_instance, connect,
                                                              tmp_path) -> None:
    statedir, missing = await _damaged(start_instance, connect, tmp_path, "a.b")
    before = _count(statedir)
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 1
    assert f"blob {missing} is named but not in the store" in err
    assert "nothing was deleted" in err
    assert _count(statedir) == before


async def test_online_gc_refuses_a_damaged_store_and_deletes_nothing(start_instance,
                                                                     connect, tmp_path) -> None:
    """As offline: a live tree naming a missing blob stops an online gc
    before it deletes anything (it went on; with the root's blob missing,
    every blob of the tree looked like garbage and was removed)."""
    statedir, missing = await _damaged(start_instance, connect, tmp_path, "a")
    await _online_gc_refused(start_instance, connect, statedir,
                             f"blob {missing} is named by a live tree but not in the store "
                             "(1 such): the store is damaged; nothing was deleted")


async def _online_gc_refused(start_instance, connect, statedir: Path, why: str) -> None:
    """An online gc on ``statedir`` fails ``EIO`` saying ``why`` and
    deletes nothing."""
    before = _count(statedir)
    inst = await start_instance(size=1, statedir=str(statedir), attrs={"kvs.gc-grace": "0"})
    h = await connect(inst, 0)
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(h.rpc("kvs.gc", {}), 30)
    assert info.value.errnum == errno.EIO
    assert info.value.errstr == why
    await h.close()
    await inst.stop()
    assert _count(statedir) == before


@pytest.mark.parametrize("key", ["a", "."])
async def test_gc_refuses_a_tree_blob_that_does_not_match_its_hash(
        start_instance, connect, tmp_path, key: str) -> None:
    """A directory's bytes (or the root's) replaced on disk by another tree
    object: offline and online, gc deletes nothing and says which blob.  It
    walked the bytes it found, so what the real directory named and the
    replacement does not was deleted for good (a content-store probe: a
    whole subtree from a damaged root, ``removed 9 blobs``, exit 0).  (A
    damaged root stops the start itself: online, a directory.)"""
    statedir, bad = await _damaged(start_instance, connect, tmp_path, key, tamper=True)
    before = _count(statedir)
    rc, _, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 1, err
    assert f"blob {bad} does not match its hash" in err and "nothing was deleted" in err, err
    assert _count(statedir) == before
    if key != ".":
        await _online_gc_refused(start_instance, connect, statedir,
                                 f"blob {bad} does not match its hash (1 such): the store is "
                                 "damaged; nothing was deleted")


@pytest.mark.parametrize("case", ["no dir", "a file", "no store", "no checkpoint",
                                  "bad checkpoint"])
def test_gc_refuses_what_it_cannot_collect(tmp_path, case) -> None:
    statedir = tmp_path / "state"
    if case == "a file":
        statedir.write_text("")
    elif case != "no dir":
        statedir.mkdir(mode=0o700)
    if case in ("no checkpoint", "bad checkpoint"):
        store = SqliteStore(str(statedir / "content.sqlite"))
        ref, data = txn.empty_root()
        store.put_many([(ref, data)])
        if case == "bad checkpoint":
            store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb({"rootref": 42}))
        store.close()
    with pytest.raises(GcError) as info:
        collect(str(statedir))
    message = {"no dir": "no such directory", "a file": "not a directory",
               "no store": "has no content.sqlite",
               "no checkpoint": "would delete everything",
               "bad checkpoint": "is not a KVS root"}[case]
    assert message in str(info.value)
    if case in ("no checkpoint", "bad checkpoint"):
        assert _count(statedir) == 1
    if case == "no store":
        assert not (statedir / "content.sqlite").exists()  # not created by looking


def test_gc_keeps_what_other_checkpoints_name(tmp_path) -> None:
    """content.checkpoint-put takes any key and value: gc cannot know what
    they mean, so every blobref in one is kept (and walked if a tree)."""
    statedir = tmp_path / "state"
    store, blobs, root = _new_store(statedir)
    cache = T.BlobCache(blobs)
    mine = txn.apply(cache, root, [put("x", BIG)])  # a tree (with a valref under it)
    blobs.update(mine.new_blobs)
    raw = b"just bytes"
    raw_ref = blobref.hash_blob(raw)
    blobs[raw_ref] = raw
    garbage = blobref.hash_blob(b"garbage")
    store.put_many([*blobs.items(), (garbage, b"garbage")])
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb({"rootref": root, "rootseq": 0}))
    store.checkpoint_put("mine", msgpack.packb({"saved": [mine.rootref, {"r": raw_ref}]}))
    store.close()
    report = collect(str(statedir))
    assert report.removed == 1
    store = SqliteStore(str(statedir / "content.sqlite"))
    assert store.get(garbage) is None
    assert all(store.get(ref) == b for ref, b in blobs.items())
    store.close()
    assert report.roots == {CHECKPOINT_KEY: "rootseq 0", "mine": "2 blobref(s)"}


def test_reachable_is_exactly_the_tree_of_the_last_root(monkeypatch) -> None:
    """Mark, checked against a store built from scratch: the final contents
    committed in one transaction into an empty store make the same tree
    (content addressing, canonical encoding), and so exactly the blobs the
    mark must find in the store that saw every version."""
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 8)  # deep hdir tries, few keys
    history: dict[str, bytes] = {}
    root, data = txn.empty_root()
    history[root] = data
    cache = T.BlobCache(history)
    final: dict[str, bytes] = {}
    for step in range(40):
        ops = [put(f"d.k{(step * 7 + j) % 90}", f"{step}.{j}" * (1 + j * 20))
               for j in range(3)]
        ops.append(put(f"e.f{step % 5}.g", str(step)))
        res = txn.apply(cache, root, ops)
        history.update(res.new_blobs)
        root = res.rootref
        for op in ops:
            final[op["key"]] = op["dirent"]["data"]
    fresh: dict[str, bytes] = {}
    empty, data = txn.empty_root()
    fresh[empty] = data
    one = txn.apply(T.BlobCache(fresh), empty, [put(k, v) for k, v in final.items()])
    assert one.rootref == root
    fresh.update(one.new_blobs)
    assert reachable(history.get, [root]) == set(fresh) - {empty}
    assert len(history) > 3 * len(fresh)  # there was garbage to leave out


def test_a_value_that_looks_like_a_tree_is_data(tmp_path) -> None:
    """A value's bytes are never walked: a user may store anything, the
    encoding of a tree object naming blobs that do not exist included
    (it is kept, and the collection neither refuses nor follows it).  So is
    a blob another checkpoint names that looks like such a tree."""
    statedir = tmp_path / "state"
    store, blobs, empty = _new_store(statedir)
    nowhere = blobref.hash_blob(b"never stored")
    lookalike = T.encode(T.dirref(nowhere))
    assert len(lookalike) > T.INLINE_MAX  # stored as a valref's data blob
    res = txn.apply(T.BlobCache(blobs), empty, [put("v", lookalike)])
    blobs.update(res.new_blobs)
    store.put_many(blobs.items())
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb({"rootref": res.rootref, "rootseq": 1}))
    store.checkpoint_put("other", msgpack.packb([blobref.hash_blob(lookalike)]))
    store.close()
    report = collect(str(statedir))
    assert (report.kept, report.removed) == (2, 1)  # the root and the value; not the empty root
    store = SqliteStore(str(statedir / "content.sqlite"))
    assert store.get(blobref.hash_blob(lookalike)) == lookalike
    store.close()


def _new_store(statedir: Path) -> tuple[SqliteStore, dict[str, bytes], str]:
    """A new statedir's store, and the blobs of a tree to be built there:
    so far the empty root (its blobref is the third value)."""
    statedir.mkdir(mode=0o700)
    store = SqliteStore(str(statedir / "content.sqlite"))
    empty, data = txn.empty_root()
    return store, {empty: data}, empty


def _store_with_primary(statedir: Path) -> tuple[SqliteStore, dict[str, bytes]]:
    """A statedir whose primary checkpoint names a one-key tree."""
    store, blobs, empty = _new_store(statedir)
    res = txn.apply(T.BlobCache(blobs), empty, [put("x", BIG)])
    blobs.update(res.new_blobs)
    store.put_many(blobs.items())
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb({"rootref": res.rootref, "rootseq": 1}))
    return store, blobs


def test_gc_keeps_blobrefs_wherever_a_checkpoint_holds_them(tmp_path) -> None:
    """Under an int map key (the wire allows them), as a map key, as bytes,
    nested past Python's recursion limit: all kept (the audit lost the
    first three, and the last raised RecursionError)."""
    store, _ = _store_with_primary(tmp_path / "state")
    refs = {}
    for name in ("int-key", "as-key", "as-bytes", "deep", "garbage"):
        refs[name] = blobref.hash_blob(name.encode())
        store.put_many([(refs[name], name.encode())])
    deep = b"\x91" * 1000 + msgpack.packb(refs["deep"])  # [[[...[ref]...]]]
    store.checkpoint_put("a", msgpack.packb({1: refs["int-key"]}))
    store.checkpoint_put("b", msgpack.packb({refs["as-key"]: "saved"}))
    store.checkpoint_put("c", msgpack.packb({"r": refs["as-bytes"].encode()}))
    store.checkpoint_put("d", deep)
    store.close()
    report = collect(str(tmp_path / "state"))
    assert report.removed == 2  # the empty root, "garbage"
    store = SqliteStore(str(tmp_path / "state" / "content.sqlite"))
    assert [store.has(refs[n]) for n in refs] == [True, True, True, True, False]
    store.close()


def test_gc_compacts_what_an_interrupted_run_left(tmp_path) -> None:
    """A run whose deletion committed but whose VACUUM failed (disk full,
    killed) left free pages: a run that removes nothing still gives them
    back (it compacted only when it removed something)."""
    store, blobs = _store_with_primary(tmp_path / "state")
    store.put_many((blobref.hash_blob(b"%d" % i), b"%d" % i * 500) for i in range(2000))
    # the deletion of a run that then failed to compact (the empty root is garbage)
    store.sweep(set(blobs) - {txn.empty_root()[0]})
    store.close()
    report = collect(str(tmp_path / "state"))
    assert report.removed == 0
    assert report.file_before > 1_000_000
    assert report.file_after < report.file_before / 10


def test_gc_says_what_is_wrong_with_the_file(tmp_path) -> None:
    statedir = tmp_path / "state"
    statedir.mkdir(mode=0o700)
    (statedir / "content.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(GcError, match=r"content.sqlite is damaged \(file is not a database"):
        collect(str(statedir))
    (statedir / "content.sqlite").unlink()
    (statedir / "content.sqlite").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"")
    with pytest.raises(GcError, match=r"content.sqlite: Too many levels of symbolic links"):
        collect(str(statedir))


async def test_gc_without_room_to_compact_says_so_and_the_next_run_does(
        small_disk, tmp_path) -> None:
    """VACUUM copies what it keeps into SQLite's temporary directory: with
    no room there (a 20 MB tmpfs, 24 MB kept), the run says so in one line
    (it was a traceback), and the next run, with room, compacts."""
    statedir = tmp_path / "state"
    store, blobs, empty = _new_store(statedir)
    res = txn.apply(T.BlobCache(blobs), empty,
                    [put(f"v{i}", bytes([i]) * (3 << 20)) for i in range(8)])
    blobs.update(res.new_blobs)
    store.put_many(blobs.items())
    store.put_many((blobref.hash_blob(b"%d" % i), b"%d" % i * 500) for i in range(4000))
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb({"rootref": res.rootref, "rootseq": 1}))
    store.close()
    env = dict(os.environ, SQLITE_TMPDIR=str(small_disk))
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir), env=env)
    assert rc == 1
    assert "no space left" in err and "the next run compacts" in err
    assert "Traceback" not in err
    path = statedir / "content.sqlite"
    owed = path.stat().st_size
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("kept 9 blobs (25.2 MB)")  # the root and the 8 values
    assert lines[1] == "removed 0 blobs (0 B)"  # the failed run's deletion held
    assert path.stat().st_size < owed - 2_000_000


def test_the_offline_report_counts_one_blob_as_one() -> None:
    """'kept 1 blobs' (operator audit): the offline report says 'blob' for one,
    as the online one does."""
    from kvs.garbage import GcReport, describe

    report = GcReport(dry_run=False)
    report.kept, report.removed = 1, 0
    text = describe(report)
    assert text.startswith("kept 1 blob (0 B) reachable from ")
    assert "\nremoved 0 blobs (0 B)\n" in text

