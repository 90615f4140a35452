"""Older checkpoints, kept to roll back to (``content.max-checkpoints``).

Rank 0's store keeps the primary namespace's checkpoint and the ones it
replaced (5 by default, as Flux's content-sqlite), listed by
``content.checkpoint-list`` / ``kvbroker content checkpoint list``, kept
whole by every garbage collection, and made current again on a stopped
instance by ``kvbroker content checkpoint update --statedir DIR ROOTREF``.
Unit tests on the SQLite store; the rest on real instances on a statedir
in ``tmp_path`` and the real CLI.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tarfile
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli, wait_until
from test_kvs_rpc_durability import refused_start_log
from test_kvs_rpc_helpers import commit, get, getroot, put

from broker.content.sqlite import SqliteStore
from broker.handle import Handle
from kvs import treeobj as T
from kvs.client import KVS, SyncKVS
from kvs.namespaces import CHECKPOINT_KEY
from kvs.txn import SYNC

T_OUT = 10


def _value(i: int) -> str:
    """A value big enough to be a blob of its own (a valref): collected
    with its version unless a checkpoint keeps it."""
    return f"{i}:" + "x" * 2048


# ------------------------------------------------------------ the store


def test_the_store_keeps_the_newest_values_of_a_key_newest_first(tmp_path) -> None:
    store = SqliteStore(str(tmp_path / "c.db"))
    store.checkpoints_kept = 3
    for i in range(6):
        store.checkpoint_put("k", b"v%d" % i)
    store.checkpoint_put("other", b"o")
    assert store.checkpoint_get("k") == b"v5"
    assert store.checkpoint_list("k") == [b"v5", b"v4", b"v3"]
    assert store.checkpoint_list("other") == [b"o"] and store.checkpoint_list("none") == []
    assert sorted(store.all_checkpoints()) == [
        ("k", b"v3", 2), ("k", b"v4", 1), ("k", b"v5", 0), ("other", b"o", 0)]
    store.checkpoints_kept = 1  # only the current one: the history goes at the next put
    store.checkpoint_put("k", b"v6")
    assert store.checkpoint_list("k") == [b"v6"]
    store.close()


def test_a_store_from_an_older_kvbroker_gains_a_history(tmp_path) -> None:
    path = str(tmp_path / "c.db")
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE objects (hash BLOB PRIMARY KEY, object BLOB NOT NULL)")
    db.execute("CREATE TABLE checkpoints (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
    db.execute("INSERT INTO checkpoints VALUES ('k', x'01')")
    db.commit()
    db.close()
    store = SqliteStore(path)
    assert store.checkpoint_list("k") == [b"\x01"]
    store.checkpoint_put("k", b"\x02")
    assert store.checkpoint_list("k") == [b"\x02", b"\x01"]
    store.close()


# ------------------------------------------------------------ instances


async def _versions(start_instance, connect, statedir: Path, *, n: int,
                    attrs: dict[str, str] | None = None) -> tuple[Any, Any, list[dict[str, Any]]]:
    """An instance of 2 ranks on ``statedir``, checkpointed only by its n
    SYNC commits of ``v`` (and at its stop); returns it, a handle on rank
    0 and each commit's root."""
    inst = await start_instance(size=2, statedir=str(statedir), attrs={
        "kvs.checkpoint-period": "0", **(attrs or {})})
    h = await connect(inst, 0)
    roots = [await commit(h, put("v", _value(i)), flags=SYNC) for i in range(1, n + 1)]
    return inst, h, roots


async def _list(statedir: Path, *extra: str) -> list[dict[str, Any]]:
    rc, out, err = await run_cli("content", "checkpoint", "list", "-j", "--statedir",
                                 str(statedir), *extra)
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines()]


async def test_checkpoints_are_listed_newest_first_on_every_rank(start_instance, connect,
                                                                 tmp_path) -> None:
    statedir = tmp_path / "state"
    inst, h, roots = await _versions(start_instance, connect, statedir, n=5,
                                     attrs={"content.max-checkpoints": "3"})
    want = [(r["rootref"], r["rootseq"]) for r in reversed(roots[-3:])]
    for rank in (0, 1):  # rank 1 asks rank 0
        hr = await connect(inst, rank)
        resp = await asyncio.wait_for(hr.rpc("content.checkpoint-list",
                                             {"key": CHECKPOINT_KEY}), T_OUT)
        assert [(c["rootref"], c["rootseq"]) for c in resp["checkpoints"]] == want
    # the Python API and the CLI (Flux's columns), online
    found = await KVS(h).checkpoints()
    assert [(c.rootref, c.rootseq) for c in found] == want
    assert found[0].timestamp is not None and found[0].timestamp >= found[1].timestamp

    def blocking() -> list[Any]:  # (the facade owns a loop: another thread)
        with SyncKVS(uri=inst.uri(1), timeout=T_OUT) as kvs:
            return kvs.checkpoints()

    assert await asyncio.to_thread(blocking) == found
    rc, out, err = await run_cli("content", "checkpoint", "list", uri=inst.uri(1))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["Index", "Sequence", "Time", "Rootref"]
    assert [line.split()[0:2] + line.split()[3:] for line in lines[1:]] == [
        [str(i), str(seq), ref] for i, (ref, seq) in enumerate(want)]
    rc, out, _ = await run_cli("kvs", "checkpoint", "list", "-n", uri=inst.uri(0))
    assert rc == 0 and out.splitlines() == lines[1:]
    # a key nobody checkpointed: none
    resp = await asyncio.wait_for(h.rpc("content.checkpoint-list", {"key": "nothing"}), T_OUT)
    assert resp == {"checkpoints": []}


async def test_an_instance_without_a_statedir_lists_none(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await commit(h, put("a", "1"), flags=SYNC)
    assert await KVS(h).checkpoints() == []
    rc, out, err = await run_cli("content", "checkpoint", "list", uri=inst.uri(0))
    assert (rc, out.split(), err) == (0, ["Index", "Sequence", "Time", "Rootref"], "")


async def test_an_update_rolls_back_to_a_checkpoint_an_online_gc_kept(start_instance, connect,
                                                                      tmp_path) -> None:
    """A collection keeps the roots of its grace period whole, the older
    checkpoints among them: they stay listed.  One made current again comes
    back at its version, and the one it replaced is kept in turn."""
    statedir = tmp_path / "state"
    inst, h, roots = await _versions(start_instance, connect, statedir, n=5,
                                     attrs={"content.max-checkpoints": "3"})
    last = await commit(h, put("v", _value(6)))  # the stop checkpoints it
    resp = await asyncio.wait_for(h.rpc("kvs.gc", {}), 30)  # (grace: 10 s)
    assert resp["checkpoints-dropped"] == 0, resp
    await h.close()
    assert await inst.stop() == [0, 0]
    listed = await _list(statedir)
    assert [c["rootseq"] for c in listed] == [last["rootseq"], roots[4]["rootseq"],
                                              roots[3]["rootseq"]]

    # what the oldest one holds, seen before going back to it
    rc, out, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(statedir),
                                 "--index", "2", str(tmp_path / "old.tar"))
    assert rc == 0, err
    with tarfile.open(tmp_path / "old.tar") as tar:
        member = tar.extractfile("v")
        assert member is not None and member.read() == _value(4).encode()
    rc, out, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(statedir),
                                 "--index", "3", str(tmp_path / "none.tar"))
    assert rc == 1 and "keeps 3 KVS checkpoints: no index 3" in err, err

    target = roots[3]  # the oldest one kept
    rc, out, err = await run_cli("content", "checkpoint", "update", "--statedir",
                                 str(statedir), target["rootref"])
    assert rc == 0, err
    assert (f"the next start resumes at {target['rootref']}, rootseq {target['rootseq']}"
            in out), out
    assert (f"the one it replaces (rootseq {last['rootseq']}, {last['rootref']}) is kept as "
            "index 1") in out
    assert [c["rootref"] for c in await _list(statedir)][:2] == [target["rootref"],
                                                                 last["rootref"]]
    inst2 = await start_instance(size=2, statedir=str(statedir))
    for rank in (0, 1):
        h2 = await connect(inst2, rank)
        assert await get(h2, "v") == _value(4).encode()
        assert (await getroot(h2))["rootseq"] == target["rootseq"]
    await commit(h2, put("after", "rollback"))  # and it goes on committing
    await h2.close()
    assert await inst2.stop() == [0, 0]
    assert (await _list(statedir))[0]["rootseq"] == target["rootseq"] + 1


@pytest.mark.parametrize("where", ["online", "offline"])
async def test_a_gc_drops_the_older_checkpoints_whose_versions_it_collects(
        start_instance, connect, tmp_path, where) -> None:
    """What a collection deletes cannot be rolled back to: the older
    checkpoints naming it go from the list first (an online collection
    keeps the current checkpoint's; an offline one keeps only the current
    checkpoint, as Flux's), and the version is refused by ``update``."""
    statedir = tmp_path / "state"
    inst, h, roots = await _versions(start_instance, connect, statedir, n=5, attrs={
        "content.max-checkpoints": "3", "kvs.gc-grace": "0"})
    last = await commit(h, put("v", _value(6)))  # the stop checkpoints it
    if where == "online":
        resp = await asyncio.wait_for(h.rpc("kvs.gc", {}), 30)
        assert resp["checkpoints-dropped"] == 2 and resp["removed"] > 0, resp
        rc, out, err = await run_cli("content", "checkpoint", "list", "-n", uri=inst.uri(1))
        assert [line.split()[1] for line in out.splitlines()] == [str(roots[4]["rootseq"])]
    await h.close()
    assert await inst.stop() == [0, 0]
    if where == "offline":
        rc, out, err = await run_cli("kvs", "gc", "-n", "--statedir", str(statedir))
        assert rc == 0 and "would drop 2 older checkpoints of the KVS" in out, (out, err)
        assert len(await _list(statedir)) == 3
        rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
        assert rc == 0 and "dropped 2 older checkpoints of the KVS" in out, (out, err)
        assert [c["rootseq"] for c in await _list(statedir)] == [last["rootseq"]]
        gone = roots[4]
    else:
        assert [c["rootseq"] for c in await _list(statedir)] == [last["rootseq"],
                                                                  roots[4]["rootseq"]]
        gone = roots[3]
    rc, out, err = await run_cli("content", "checkpoint", "update", "--statedir",
                                 str(statedir), gone["rootref"])
    assert rc == 1 and out == ""
    assert f"root {gone['rootref']} is not in the content store" in err, err
    inst2 = await start_instance(size=1, statedir=str(statedir))  # the current one is whole
    h2 = await connect(inst2, 0)
    assert await get(h2, "v") == _value(6).encode()


async def test_update_refuses_what_a_start_could_not_read(start_instance, connect,
                                                          tmp_path) -> None:
    statedir = tmp_path / "state"
    inst, h, roots = await _versions(start_instance, connect, statedir, n=1)

    async def store(data: bytes) -> str:
        resp = await asyncio.wait_for(h.rpc("content.store", {"data": data}), T_OUT)
        return str(resp["blobref"])

    not_a_tree = await store(b"just bytes")
    a_value = await store(T.encode(T.val(b"a value")))
    missing = "sha256-" + "cd" * 32
    broken = await store(T.encode(T.dir_({"x": T.valref([missing])})))
    await asyncio.wait_for(h.rpc("content.flush", {}), T_OUT)

    async def update(*args: str) -> tuple[int, str]:
        rc, out, err = await run_cli("content", "checkpoint", "update", *args)
        assert out == "" or rc == 0, out
        return rc, err

    # while the instance runs: it holds the store
    rc, err = await update("--statedir", str(statedir), roots[0]["rootref"])
    assert rc == 1 and err.startswith("kvbroker: content checkpoint update: ")  # (as spelled)
    assert "is in use by a running instance" in err, err
    rc, err = await update(roots[0]["rootref"])  # no --statedir: a usage error
    assert rc == 2 and "works on a stopped instance: --statedir DIR" in err, err
    await h.close()
    assert await inst.stop() == [0, 0]
    before = await _list(statedir)

    for ref, why in [("sha256-00", "is not a blobref"),
                     (not_a_tree, "is not a tree object"),
                     (a_value, "is a val tree object, not a directory"),
                     (broken, f"tree is not whole in the content store (blob {missing} "
                              "is named but not in the store)")]:
        rc, err = await update("--statedir", str(statedir), ref)
        assert rc == 1 and why in err, (ref, err)
    rc, err = await update("--statedir", str(tmp_path / "nowhere"), roots[0]["rootref"])
    assert rc == 1 and "no such directory" in err, err
    assert await _list(statedir) == before  # nothing was written

    # the current one: nothing to do
    rc, out, err = await run_cli("content", "checkpoint", "update", "--statedir",
                                 str(statedir), before[0]["rootref"])
    assert rc == 0 and "is the current checkpoint already" in out, (out, err)
    assert await _list(statedir) == before


async def test_a_start_refused_for_a_damaged_newest_root_recovers_by_a_rollback(
        start_instance, connect, tmp_path) -> None:
    """The checkpoint names a root the store lacks (the owner wrote it, or
    the disk lost it): the start fails and says where to look; rolling back
    to the checkpoint before it starts again, with the data of that one."""
    statedir = tmp_path / "state"
    inst, h, roots = await _versions(start_instance, connect, statedir, n=2)
    missing = "sha256-" + "ab" * 32
    await asyncio.wait_for(h.rpc("content.checkpoint-put", {"key": CHECKPOINT_KEY, "value": {
        "rootref": missing, "rootseq": 9, "timestamp": 1.0}}), T_OUT)
    await h.close()
    await inst.stop()
    text = await refused_start_log(statedir, tmp_path / "refused.log")
    assert f"kvbroker content checkpoint list --statedir {statedir}" in text

    rc, out, err = await run_cli("content", "checkpoint", "list", "--statedir", str(statedir))
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines()[1:]]
    assert rows[0] == ["0", "9", "1970-01-01T00:00:01Z", missing]
    assert [r[3] for r in rows[1:3]] == [roots[1]["rootref"], roots[0]["rootref"]]
    rc, out, err = await run_cli("kvs", "checkpoint", "update", "--statedir", str(statedir),
                                 roots[1]["rootref"])
    assert rc == 0, err
    inst2 = await start_instance(size=1, statedir=str(statedir))
    h2 = await connect(inst2, 0)
    assert await get(h2, "v") == _value(2).encode()
    assert (await getroot(h2))["rootseq"] == roots[1]["rootseq"]


def _cut(statedir: Path, table: str, where: str) -> None:
    """Damage one checkpoint row: its last 3 bytes cut off (msgpack no longer decodes)."""
    db = sqlite3.connect(statedir / "content.sqlite")
    with db:
        (rowid, value), = db.execute(f"SELECT rowid, value FROM {table} WHERE {where}")
        db.execute(f"UPDATE {table} SET value = ? WHERE rowid = ?", (value[:-3], rowid))
    db.close()


async def test_damaged_checkpoint_rows_fail_the_start_in_one_line_or_list_as_dashes(
        start_instance, connect, tmp_path) -> None:
    """A current checkpoint row that does not decode fails the start in one
    line naming the file (kvs.md), not with a traceback and "internal
    error"; an older one is listed as a value naming no root, online as
    offline, and the rest of the list is still read."""
    statedir = tmp_path / "state"
    inst, h, roots = await _versions(start_instance, connect, statedir, n=3)
    await h.close()
    await inst.stop()
    _cut(statedir, "checkpoint_history", "id = (SELECT MIN(id) FROM checkpoint_history)")
    want = [roots[2]["rootref"], roots[1]["rootref"], None]
    inst2 = await start_instance(size=2, statedir=str(statedir))
    kvs = KVS(await connect(inst2, 1))  # (rank 1 asks rank 0)
    assert [c.rootref for c in await asyncio.wait_for(kvs.checkpoints(), T_OUT)] == want
    await kvs.handle.close()
    await inst2.stop()
    assert [r.get("rootref") if isinstance(r, dict) else None
            for r in await _list(statedir)] == want

    _cut(statedir, "checkpoints", f"key = '{CHECKPOINT_KEY}'")
    text = await refused_start_log(statedir, tmp_path / "refused.log")
    assert (f"checkpoint '{CHECKPOINT_KEY}' cannot be read from {statedir}/content.sqlite: "
            "it does not decode") in text, text
    assert "Traceback" not in text and "internal error" not in text, text
    rc, out, err = await run_cli("content", "checkpoint", "update", "--statedir",
                                 str(statedir), roots[1]["rootref"])  # the way back
    assert rc == 0 and "; the value it replaces (not a KVS root: it does not decode, or " \
        "names none) is kept as index 1" in out, (out, err)
    inst3 = await start_instance(size=1, statedir=str(statedir))
    assert await get(await connect(inst3), "v") == _value(2).encode()


async def test_a_start_refuses_a_checkpoint_whose_root_is_not_a_directory(
        start_instance, connect, tmp_path) -> None:
    """The owner may checkpoint any blob (content.checkpoint-put): a root
    that is a value, not a directory, is refused at the start, as offline
    update refuses it, instead of a start after which every request fails."""
    statedir = tmp_path / "state"
    inst, h, _ = await _versions(start_instance, connect, statedir, n=1)
    a_value = (await asyncio.wait_for(h.rpc("content.store", {
        "data": T.encode(T.val(b"a value"))}), T_OUT))["blobref"]
    await asyncio.wait_for(h.rpc("content.checkpoint-put", {"key": CHECKPOINT_KEY, "value": {
        "rootref": a_value, "rootseq": 3, "timestamp": 1.0}}), T_OUT)
    await h.close()
    await inst.stop()
    text = await refused_start_log(statedir, tmp_path / "refused.log")
    assert (f"names root {a_value} (rootseq 3), which is not a directory (a val tree "
            "object, not a directory)") in text, text


def test_a_value_that_is_not_a_kvs_root_is_listed_with_dashes() -> None:
    """The owner may write anything under the key (content.checkpoint-put):
    the list shows what it can, a rootref that is not a blobref as stored
    (as Flux does; it showed ``-``), quoted if it would break the table."""
    from kvs.checkpoints import Checkpoint, format_table

    rows = format_table([Checkpoint.from_value("junk"),
                         Checkpoint.from_value({"rootref": "x", "rootseq": 1.5,
                                                "timestamp": float("nan")}),
                         Checkpoint.from_value({"rootref": "a b\n" + "c" * 100}),
                         Checkpoint.from_value({"rootref": 7})], header=False)
    assert [r.split(None, 3) for r in rows[:2]] == [["0", "-", "-", "-"], ["1", "-", "-", "x"]]
    assert rows[2].split(None, 3)[3] == "'a b\\n" + "c" * 32 + "..." + "c" * 38 + "'"
    assert rows[3].split() == ["3", "-", "-", "-"]
    assert Checkpoint.from_value({"a": b"\xff"}).as_json() == '{"a":"\\ufffd"}'


async def test_the_checkpoint_period_changes_on_a_running_rank(start_instance, connect,
                                                               tmp_path) -> None:
    """``attr set kvs.checkpoint-period`` (Flux's t1011 changes it with
    ``flux config reload``): started without periodic checkpoints, rank 0
    writes them once a period is set, and a bad value is refused with why,
    changing nothing.  It was refused as fixed at start."""
    inst = await start_instance(size=2, statedir=str(tmp_path / "state"),
                                attrs={"kvs.checkpoint-period": "0"})
    h = await connect(inst, 1)
    done = await commit(h, put("periodic", "1"))

    async def checkpointed() -> int:
        stats = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=0), 10)
        return int(stats["checkpoint"]["rootseq"])

    assert await checkpointed() < done["rootseq"]  # none yet: no period
    rc, out, err = await run_cli("attr", "set", "kvs.checkpoint-period", "50ms", "--all",
                                 uri=inst.uri(1))
    assert rc == 0, err
    assert await h.attr_get("kvs.checkpoint-period", nodeid=0) == "50ms"

    async def caught_up() -> bool:
        return await checkpointed() >= done["rootseq"]

    await wait_until(caught_up, "a periodic checkpoint of the commit")
    stats = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=0), 10)
    assert stats["checkpoint"]["period"] == 0.05
    rc, out, err = await run_cli("attr", "set", "kvs.checkpoint-period", "1Z", uri=inst.uri(0))
    assert rc == 1 and "is not a duration" in err, err
    assert await h.attr_get("kvs.checkpoint-period", nodeid=0) == "50ms"
    rc, out, err = await run_cli("attr", "set", "kvs.checkpoint-period", "0", uri=inst.uri(0))
    assert rc == 0, err
    stats = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=0), 10)
    assert stats["checkpoint"]["period"] == 0


async def test_the_checkpoint_period_of_a_removed_kvs_is_kept_for_its_load(
        start_instance, tmp_path) -> None:
    """With kvs removed from a rank, setting its runtime attribute was
    refused as fixed at start ("set it at start"), and so a whole config
    reload on that rank failed.  It is checked and kept, and the next load
    starts from it, as from any attribute the module left behind."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"))
    uri = inst.uri(0)

    async def cli(*args: str, rc: int = 0) -> str:
        code, out, err = await run_cli(*args, uri=uri)
        assert code == rc, (args, code, out, err)
        return out + err

    await cli("module", "remove", "kvs-watch")
    await cli("module", "remove", "kvs")
    assert "is not a duration" in await cli("attr", "set", "kvs.checkpoint-period", "1Z",
                                            rc=1)
    await cli("attr", "set", "kvs.checkpoint-period", "9s")
    assert await cli("attr", "get", "kvs.checkpoint-period") == "9s\n"
    await cli("module", "load", "kvs")
    async with await Handle.connect(uri) as h:
        stats = await asyncio.wait_for(h.rpc("kvs.stats-get", {}), 10)
    assert stats["checkpoint"]["period"] == 9


def test_a_damaged_checkpoints_time_and_numbers_are_listed_not_fatal() -> None:
    """A checkpoint value written by hand or damaged: a timestamp no
    calendar holds listed as ``-`` (the listing failed with an
    OverflowError traceback), and ``-j`` printing JSON (it printed ``NaN``)."""
    from kvs.checkpoints import Checkpoint, format_table

    far = Checkpoint.from_value({"rootref": "sha256-zz", "timestamp": 1e300})
    nan = Checkpoint.from_value({"rootref": "sha256-zz", "rootseq": "x",
                                 "timestamp": float("nan"), "n": [float("inf")]})
    lines = format_table([far, nan])
    assert lines[1].split()[:3] == ["0", "-", "-"], lines
    assert json.loads(nan.as_json()) == {"rootref": "sha256-zz", "rootseq": "x",
                                         "timestamp": None, "n": [None]}
