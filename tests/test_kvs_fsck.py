"""``kvbroker kvs fsck`` (Flux's ``flux fsck``, t/t2816-fsck-cmd.t): a
tree checked whole, offline (``--statedir``) and online (``content.load``
through a running rank), and the keys named when blobs are missing or
damaged -- the store damaged by hand with sqlite3, as Flux's test damages
a tree object with jq.  Flux's cases and what each becomes:

* fsck with the kvs loaded, read-only -> online fsck (the kvs runs);
  ``--repair`` (damaged keys unlinked, what can be read kept in
  ``lost+found``; refused while the kvs runs) -> ``--repair`` with
  ``--statedir`` (refused online: a usage error).
* fsck simple / verbose (every key named on stderr, ``Total errors: 0``)
  -> :func:`test_a_whole_tree_passes_and_verbose_names_every_key`;
* a value of 2,001 appends (LONGTEST) -> a long value (a ``vtree`` of
  chunks), whole and with a chunk deleted;
* a valref with a bad reference (``missing blobref(s)``, ``index=1`` with
  ``--verbose``, ``Total errors: 1``), two and three such keys, a dirref
  (``missing dirref blobref``), ``--quiet`` -> the same lines, the store
  damaged (``--quiet`` drops the header only, as Flux's);
* fsck of older roots (``--rootref``) -> :func:`test_rootref_checks_an_older_root`.
* not applicable: prefixing messages only on a tty (kvbroker's fsck
  writes its lines bare, as Flux's does on a tty).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

from test_broker_support import run_cli
from test_kvs_rpc_helpers import APPEND, commit, put

from broker.content.sqlite import digest_of
from kvs import treeobj
from kvs.client import KVS

BIG = bytes(range(256)) * 8  # 2 KiB: a valref, not inline


async def _lookup_obj(h: Any, key: str) -> dict[str, Any]:
    """``key``'s tree object (kvs.lookup TREEOBJ)."""
    answer = await asyncio.wait_for(h.rpc("kvs.lookup", {"key": key, "flags": 16,
                                                         "namespace": "primary"}), 10)
    return answer["val"]


async def _fill(h: Any) -> dict[str, str]:
    """testdir.{a,b,c,d} (b and c valrefs of several blobs), an empty
    directory, a link and a long value; the rootref of each step."""
    kvs = KVS(h)
    roots = {}
    await kvs.put("testdir.a", BIG + b"a")
    roots["a"] = (await kvs.getroot()).rootref
    for i in range(4):
        await commit(h, put("testdir.b", BIG + bytes([i]), flags=APPEND))
    roots["b"] = (await kvs.getroot()).rootref
    for i in range(4):
        await commit(h, put("testdir.c", BIG + bytes([10 + i]), flags=APPEND))
    await kvs.mkdir("testdir.adir")
    await kvs.symlink("alink", "testdir")
    await commit(h, *(put("bigval", f"{i}\n".encode(), flags=APPEND) for i in range(1000, 1300)))
    roots["all"] = (await kvs.getroot()).rootref
    return roots


def delete_blobs(statedir: Path, *refs: str) -> None:
    """The blobs gone from the stopped instance's store."""
    db = sqlite3.connect(statedir / "content.sqlite")
    with db:
        for ref in refs:
            assert db.execute("DELETE FROM objects WHERE hash = ?",
                              (digest_of(ref),)).rowcount == 1, ref
    db.close()


def _spoil(statedir: Path, ref: str) -> None:
    """The blob's bytes changed in place: read back, they do not match."""
    db = sqlite3.connect(statedir / "content.sqlite")
    with db:
        assert db.execute("UPDATE objects SET object = ? WHERE hash = ?",
                          (b"not what was stored", digest_of(ref))).rowcount == 1
    db.close()


async def _filled(start_instance, connect, tmp_path: Path
                  ) -> tuple[Path, dict[str, str], dict[str, Any]]:
    """A stopped instance's statedir after :func:`_fill`, its roots, and the
    tree objects of testdir.b, testdir.c, testdir.adir's dirref and bigval."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    roots = await _fill(h)
    objs = {k: await _lookup_obj(h, k) for k in ("testdir.b", "testdir.c")}
    # (a lookup shows a long value as a valref: its vtree is the root's entry)
    root = await asyncio.wait_for(h.rpc("content.load", {"blobref": roots["all"]}), 10)
    objs["bigval"] = treeobj.decode(root["data"])["data"]["bigval"]
    testdir = await _lookup_obj(h, "testdir")
    dirs = await asyncio.wait_for(h.rpc("content.load", {"blobref": testdir["data"][0]}), 10)
    objs["adir"] = treeobj.decode(dirs["data"])["data"]["adir"]
    await h.close()
    await inst.stop()
    return statedir, roots, objs


async def test_a_whole_tree_passes_and_verbose_names_every_key(
        start_instance, connect, tmp_path) -> None:
    statedir, _, _ = await _filled(start_instance, connect, tmp_path)
    rc, out, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert (rc, err) == (0, ""), err
    assert out.startswith("Checking integrity of checkpoint from ") and \
        "(version 12, sha256-" in out and out.endswith(f" in {statedir}\n"), out
    rc, out, err = await run_cli("kvs", "fsck", "-v", "--statedir", str(statedir))
    assert rc == 0, err
    assert err.splitlines() == ["alink", "bigval", "testdir", "testdir.a", "testdir.adir",
                                "testdir.b", "testdir.c", "Total errors: 0"]


async def test_missing_and_damaged_blobs_are_named_offline_and_online(
        start_instance, connect, tmp_path) -> None:
    """Flux's damaged-valref cases: testdir.b's blob 1 deleted, testdir.c's
    2 and 3 changed in place, testdir.adir's directory deleted, and a chunk
    of the long value deleted: each key is named once (every failing blob
    with ``-v``), ``Total errors: 4``, exit 1; online (the kvs running, as
    Flux's read-only fsck) the same.  ``-q`` drops the header only."""
    statedir, _, objs = await _filled(start_instance, connect, tmp_path)
    b, c = objs["testdir.b"]["data"], objs["testdir.c"]["data"]
    assert objs["bigval"]["type"] == "vtree", objs["bigval"]
    chunk = objs["bigval"]["data"]["chunks"][0]
    adir = objs["adir"]["data"][0]
    delete_blobs(statedir, b[1], adir, chunk)
    _spoil(statedir, c[2])
    _spoil(statedir, c[3])
    expect = ["bigval: missing blobref(s)", "testdir.adir: missing dirref blobref",
              "testdir.b: missing blobref(s)", "testdir.c: damaged blobref(s)",
              "Total errors: 4"]
    rc, out, err = await run_cli("kvs", "fsck", "-q", "--statedir", str(statedir))
    assert (rc, out) == (1, ""), err
    assert sorted(err.splitlines()[:-1]) == expect[:-1] and err.splitlines()[-1] == expect[-1]
    rc, out, err = await run_cli("kvs", "fsck", "-v", "--statedir", str(statedir))
    assert rc == 1
    lines = err.splitlines()
    assert f"testdir.b: missing blobref index=1 {b[1]}" in lines
    assert f"testdir.c: damaged blobref index=2 {c[2]}" in lines
    assert f"testdir.c: damaged blobref index=3 {c[3]}" in lines
    assert f"testdir.adir: missing dirref blobref {adir}" in lines
    assert f"bigval: missing blobref {chunk}" in lines
    assert lines[-1] == "Total errors: 4"
    inst = await start_instance(size=2, statedir=str(statedir))
    for rank in (0, 1):
        rc, out, err = await run_cli("kvs", "fsck", uri=inst.uri(rank))
        assert rc == 1 and out.startswith("checking namespace primary at version "), err
        assert sorted(err.splitlines()[:-1]) == expect[:-1], err
    # a namespace whose tree is whole passes, while primary's does not
    h = await connect(inst, 0)
    kvs = KVS(h)
    await kvs.namespace_create("other")
    await KVS(h, "other").put("x", BIG)
    rc, out, err = await run_cli("kvs", "fsck", "-N", "other", uri=inst.uri(1))
    assert (rc, err) == (0, ""), err


async def test_rootref_checks_an_older_root(start_instance, connect, tmp_path) -> None:
    """Flux's fsck of older roots: one from before testdir.c was made is
    whole though testdir.c's blobs are gone, and names only its keys."""
    statedir, roots, objs = await _filled(start_instance, connect, tmp_path)
    delete_blobs(statedir, objs["testdir.c"]["data"][0])
    rc, _, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert rc == 1 and "testdir.c: missing blobref(s)" in err, err
    rc, out, err = await run_cli("kvs", "fsck", "-v", "--statedir", str(statedir),
                                 "--rootref", roots["b"])
    assert rc == 0, err
    assert out == f"checking {roots['b']} in {statedir}\n"
    assert err.splitlines() == ["testdir", "testdir.a", "testdir.b", "Total errors: 0"]


async def test_fsck_refuses_what_it_cannot_check(start_instance, tmp_path) -> None:
    """A statedir a running instance holds, one with no store, a rootref
    that names nothing (the root itself missing: one problem, ``.``)."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    rc, _, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert rc == 1 and "in use by a running instance" in err, err
    rc, _, err = await run_cli("kvs", "fsck", "--statedir", str(tmp_path / "nothing"))
    assert rc == 1 and "no such directory" in err, err
    nothing = "sha256-" + "0" * 64
    rc, _, err = await run_cli("kvs", "fsck", "--rootref", nothing, uri=inst.uri(0))
    assert (rc, err) == (1, ".: missing root blobref\nTotal errors: 1\n"), err


async def test_a_sharded_directory_is_walked_and_a_lost_shard_named(
        start_instance, connect, tmp_path) -> None:
    """A directory of 1,000 keys is an ``hdir`` whose shards are blobs: all
    its keys are checked, and a shard deleted is named at the directory
    (``missing hdir shard blobref``: its keys cannot be listed)."""
    from kvs import shards

    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    await commit(h, *(put(f"big.k{i}", b"%d" % i) for i in range(1000)))
    rootref = (await KVS(h).getroot()).rootref
    root = treeobj.decode((await h.rpc("content.load", {"blobref": rootref}))["data"])
    big = treeobj.decode((await h.rpc("content.load", {
        "blobref": root["data"]["big"]["data"][0]}))["data"])
    assert shards.is_hdir(big)
    await h.close()
    await inst.stop()
    rc, _, err = await run_cli("kvs", "fsck", "-v", "--statedir", str(statedir))
    assert rc == 0, err[-500:]
    assert len(err.splitlines()) == 1 + 1000 + 1 and err.endswith("Total errors: 0\n")
    shard = sorted(big["data"]["shards"].values())[0]
    delete_blobs(statedir, shard)
    rc, _, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert (rc, err) == (1, "big: missing hdir shard blobref\nTotal errors: 1\n")


async def _load_obj(h: Any, ref: str) -> dict[str, Any]:
    """The tree object in blob ``ref``."""
    answer = await asyncio.wait_for(h.rpc("content.load", {"blobref": ref}), 10)
    return treeobj.decode(answer["data"])


async def test_repair_rebuilds_a_big_directory_from_its_readable_shards(
        start_instance, connect, tmp_path) -> None:
    """A big directory (an ``hdir`` of 300 keys) that lost one shard, and
    a damaged value in another: ``--repair`` rebuilds the directory from
    the entries of its readable shards, says how many were lost with the
    shard (their names were in it), and mends the value as any other.  It
    unlinked the whole directory, every readable key with it."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    await commit(h, *(put(f"big.k{i}", b"%d" % i) for i in range(300)), put("small.a", "1"))
    top = await _load_obj(h, (await _lookup_obj(h, "big"))["data"][0])
    assert top["type"] == "hdir" and top["data"]["depth"] == 0
    refs = sorted(top["data"]["shards"].values())
    leaf = await _load_obj(h, refs[0])
    assert leaf["type"] == "dir"
    gone = set(leaf["data"])
    victim = sorted(set((await _load_obj(h, refs[1]))["data"]) - gone)[0]
    await commit(h, put(f"big.{victim}", BIG))  # a valref, in a shard that stays
    value_ref = (await _lookup_obj(h, f"big.{victim}"))["data"][0]
    await h.close()
    await inst.stop()
    delete_blobs(statedir, refs[0], value_ref)

    rc, _, err = await run_cli("kvs", "fsck", "--repair", "-q", "--statedir", str(statedir))
    assert rc == 1, err
    lines = err.splitlines()
    assert lines[:3] == ["big: missing hdir shard blobref", f"big.{victim}: missing blobref(s)",
                         "Total errors: 2"], err
    assert lines[3:] == ["Total repairs: 1", "Total rebuilt directories: 1"], err
    rc, _, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert (rc, err) == (0, ""), err

    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    kvs = KVS(h)
    names = set(await kvs.dir("big"))
    assert names == {f"k{i}" for i in range(300)} - gone - {victim}
    for k in sorted(names):
        assert await kvs.get(f"big.{k}") == k[1:].encode(), k
    assert await kvs.get("small.a") == b"1"
    assert await kvs.get(f"lost+found.big.{victim}") == b""
    await h.close()


async def test_repair_says_what_each_rebuilt_directory_lost_and_rebuilds_a_big_root(
        start_instance, connect, tmp_path) -> None:
    """The root is a big directory too (200 top-level keys): a lost shard
    of it is rebuilt around, not ``cannot repair``; each rebuilt directory
    is named with the shards and entries it lost."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    await commit(h, *(put(f"r{i}", b"%d" % i) for i in range(200)))
    root = await _load_obj(h, (await KVS(h).getroot()).rootref)
    assert root["type"] == "hdir"
    lost = sorted(root["data"]["shards"].values())[:2]
    gone = set()
    for ref in lost:
        gone |= set((await _load_obj(h, ref))["data"])
    await h.close()
    await inst.stop()
    delete_blobs(statedir, *lost)
    rc, _, err = await run_cli("kvs", "fsck", "--repair", "--statedir", str(statedir))
    assert rc == 1, err
    lines = err.splitlines()
    assert lines[:4] == [".: missing hdir shard blobref", ".: missing hdir shard blobref",
                         "Total errors: 2",
                         f". rebuilt without its 2 unreadable hdir shards: {len(gone)} "
                         "entries lost"], err
    assert lines[4].startswith("Updated primary checkpoint") and lines[5:] == [
        "Total rebuilt directories: 1"], err
    rc, _, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert (rc, err) == (0, ""), err
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    assert set(await KVS(h).dir(".")) == {f"r{i}" for i in range(200)} - gone
    await h.close()


async def test_repair_unlinks_the_damaged_keys_and_keeps_what_can_be_read(
        start_instance, connect, tmp_path) -> None:
    """Flux's ``--repair``, offline (the kvs cannot write meanwhile): the
    damaged keys go from the checkpoint's tree, a value's readable blobs
    kept as ``lost+found.KEY``, in a new checkpoint at the next version;
    a start resumes there with every other key, fsck passes, and the
    damaged root is still the checkpoint before it (``checkpoint update``
    takes it back).  It exits 1, as Flux's: errors were found.  Refused
    online and with ``--rootref`` (usage, 2)."""
    statedir, roots, objs = await _filled(start_instance, connect, tmp_path)
    b = objs["testdir.b"]["data"]
    adir = objs["adir"]["data"][0]
    delete_blobs(statedir, b[1], adir)
    rc, out, err = await run_cli("kvs", "fsck", "--repair", "--statedir", str(statedir))
    assert rc == 1, err  # (errors were found: Flux's exit status, repaired or not)
    lines = err.splitlines()
    assert lines[:6] == ["testdir.b: missing blobref(s)", "testdir.adir: missing dirref blobref",
                         "Total errors: 2", "testdir.b repaired and moved to lost+found",
                         "testdir.adir unlinked due to missing blobref",
                         lines[5]], err
    assert lines[5].startswith("Updated primary checkpoint to include lost+found: version 13, ")
    assert f"kvs checkpoint update --statedir {statedir} {roots['all']} takes it back" \
        in lines[5]
    assert lines[6:] == ["Total repairs: 1", "Total unlinked directories: 1"], err
    rc, out, err = await run_cli("kvs", "fsck", "--statedir", str(statedir))
    assert (rc, err) == (0, ""), err
    rc, out, err = await run_cli("kvs", "checkpoint", "list", "--statedir", str(statedir))
    assert rc == 0 and out.splitlines()[2].endswith(roots["all"]), out
    inst = await start_instance(size=1, statedir=str(statedir))
    h = await connect(inst, 0)
    kvs = KVS(h)
    assert await kvs.get("lost+found.testdir.b") == b"".join(
        BIG + bytes([i]) for i in (0, 2, 3))
    assert await kvs.get("testdir.a") == BIG + b"a"
    assert not await kvs.exists("testdir.b") and not await kvs.exists("testdir.adir")
    rc, _, err = await run_cli("kvs", "fsck", "--repair", uri=inst.uri(0))
    assert rc == 2 and "--repair mends a stopped instance's checkpoint" in err, err
