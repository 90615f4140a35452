"""The KVS Python API (kvs.client, kvs.eventlog): pure parts, then real instances."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal

import pytest
from test_broker_support import run_cli, stop_process, stopped, wait_until
from test_watch_helpers import wait_watchers

from broker.errors import ErrnoError, RemoteError
from kvs import eventlog, treeobj
from kvs.client import (
    APPEND,
    KVS,
    NO_MERGE,
    READDIR,
    SYNC,
    TREE_LIMIT,
    WAIT_GRACE,
    CommitResult,
    Dir,
    Link,
    Root,
    SyncKVS,
    TxnOps,
    as_root,
    default_namespace,
    encode_value,
    kind,
)
from kvs_watch.client import behind_removals

T = 20  # seconds: bound on every await against a broker
REF = "sha256-" + "a" * 64


def errnum(excinfo: pytest.ExceptionInfo[ErrnoError]) -> int:
    return excinfo.value.errnum


# ================================================================ pure: values, ops, roots


def test_encode_value() -> None:
    assert encode_value(b"\x00\xff") == b"\x00\xff"
    assert encode_value(bytearray(b"ab")) == b"ab"
    assert encode_value("ƒoo") == "ƒoo".encode()
    assert encode_value(42) == b"42"
    assert encode_value(3.5) == b"3.5"
    assert encode_value(True) == b"true"
    assert encode_value(None) == b"null"
    assert encode_value({"a": [1, "ƒ"]}) == '{"a":[1,"ƒ"]}'.encode()
    with pytest.raises(TypeError):
        encode_value(object())
    for bad in (float("nan"), float("inf"), [float("-inf")]):  # not JSON
        with pytest.raises(TypeError):
            encode_value(bad)


def test_txn_ops_are_pure_and_ordered() -> None:
    t = TxnOps()
    assert t.put("a", 1).put_raw("b", b"\x00").append("c", "x").mkdir("d") is t
    t.unlink("e").symlink("f", "a").symlink("g", "k", "other")
    assert len(t) == 7
    assert [op["key"] for op in t.ops] == list("abcdefg")
    assert t.ops[0] == {"key": "a", "flags": 0, "dirent": treeobj.val(b"1")}
    assert t.ops[1]["dirent"] == treeobj.val(b"\x00")
    assert t.ops[2] == {"key": "c", "flags": APPEND, "dirent": treeobj.val(b"x")}
    assert t.ops[3]["dirent"] == treeobj.dir_()
    assert t.ops[4] == {"key": "e", "flags": 0, "dirent": None}
    assert t.ops[5]["dirent"] == treeobj.symlink("a")
    assert t.ops[6]["dirent"]["data"] == {"namespace": "other", "target": "k"}
    with pytest.raises(TypeError):
        t.put(42, "x")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        t.put_raw("x", "not bytes")  # type: ignore[arg-type]


def test_put_treeobj_accepts_json_and_native_forms() -> None:
    text = '{"data":"YgA=","type":"val","ver":1}'
    t = TxnOps().put_treeobj("a", text).put_treeobj("b", json.loads(text))
    t.put_treeobj("c", treeobj.val(b"b\0")).put_treeobj("d", treeobj.dirref(REF))
    assert [op["dirent"] for op in t.ops[:3]] == [treeobj.val(b"b\0")] * 3
    assert t.ops[3]["dirent"] == treeobj.dirref(REF)
    bad = ['xyz', '{"data":"MQA=","type":"FOO","ver":1}', '{"data":42,"type":"symlink","ver":1}',
           '{"data":42,"type":"dirref","ver":1}', '{"data":["sha1-aaa"],"type":"dirref","ver":1}',
           '{"data":{"count":0,"depth":0,"shards":{}},"type":"hdir","ver":1}']
    for text in bad:
        with pytest.raises(ErrnoError) as ei:
            TxnOps().put_treeobj("a", text)
        assert errnum(ei) == errno.EINVAL, text


def test_as_root_and_results() -> None:
    d = treeobj.dirref(REF)
    assert as_root(REF) == d
    assert as_root(treeobj.to_json(d)) == d
    assert as_root(" " + treeobj.to_json(d) + "\n") == d
    assert as_root(d) == d
    assert as_root(CommitResult(REF, 3)) == d
    root = Root("primary", 1000, 3, REF)
    assert as_root(root) == d and root.treeobj == d and CommitResult(REF, 1).treeobj == d
    assert root.as_dict() == {"namespace": "primary", "owner": 1000, "rootseq": 3,
                              "rootref": REF, "flags": 0}
    assert Root.from_payload(root.as_dict()) == root
    for bad in ("42", "sha1-aaa", '{"data":42,"type":"dirref","ver":1}',
                treeobj.to_json(treeobj.val(b"x")), "{not json"):
        with pytest.raises(ErrnoError) as ei:
            as_root(bad)
        assert errnum(ei) == errno.EINVAL, bad


def test_link_kind_and_namespace_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert str(Link("a.b")) == "a.b" and str(Link("a.b", "ns")) == "ns::a.b"
    assert Link.from_treeobj(treeobj.symlink("x", "y")) == Link("x", "y")
    # the NS::key form names the namespace too, as reads resolve it (it was
    # Link("ns1::a.b", None): readlink -o printed the whole target)
    assert Link.from_treeobj(treeobj.symlink("ns1::a.b")) == Link("a.b", "ns1")
    assert str(Link.from_treeobj(treeobj.symlink("ns1::a.b"))) == "ns1::a.b"
    assert Link.from_treeobj(treeobj.symlink("::a")) == Link("::a")  # (no namespace named)
    assert [kind(o) for o in (treeobj.val(b""), treeobj.valref([REF]), treeobj.dir_(),
                              treeobj.dirref(REF), treeobj.symlink("x"))] == \
        ["value", "value", "dir", "dir", "symlink"]
    monkeypatch.delenv("KVBROKER_NAMESPACE", raising=False)
    assert default_namespace() == "primary"
    monkeypatch.setenv("KVBROKER_NAMESPACE", "job-1")
    assert default_namespace() == "job-1" and default_namespace("x") == "x"


def test_dir_mapping_view() -> None:
    entries = {"v": treeobj.val(b"1"), "d": treeobj.dirref(REF), "l": treeobj.symlink("v", "n")}
    d = Dir(None, "a..b.", entries, REF)  # type: ignore[arg-type]
    assert d.key == "a.b" and list(d) == ["d", "l", "v"] and len(d) == 3
    assert d["v"] == treeobj.val(b"1") and "x" not in d and d.get("x") is None
    assert [d.kind(n) for n in d] == ["dir", "symlink", "value"]
    assert d.is_dir("d") and d.is_symlink("l") and not d.is_dir("v")
    assert d.path("v") == "a.b.v"
    assert Dir(None, ".", {}, REF).path("x") == "x"  # type: ignore[arg-type]
    assert d.link("l") == Link("v", "n")
    with pytest.raises(ErrnoError) as ei:
        d.link("v")
    assert errnum(ei) == errno.EINVAL


# ================================================================ pure: eventlogs


def test_eventlog_encode_decode() -> None:
    e = eventlog.entry("submit", {"userid": 1}, 1)
    assert eventlog.encode_entry(e) == b'{"timestamp":1.0,"name":"submit","context":{"userid":1}}\n'
    assert eventlog.encode_entry({"name": "x", "timestamp": 2}) == \
        b'{"timestamp":2,"name":"x"}\n'
    assert eventlog.entry("x", '{"a": 1}', 5)["context"] == {"a": 1}
    now = eventlog.entry("x")["timestamp"]
    assert now > 1e9 and eventlog.entry("x", timestamp=0)["timestamp"] >= now
    log = eventlog.encode([e, eventlog.entry("done", timestamp=2.5)])
    assert eventlog.decode(log) == [e, {"timestamp": 2.5, "name": "done"}]
    assert eventlog.decode(log.decode()) == eventlog.decode(log)
    assert eventlog.decode(b"") == [] and eventlog.encode([]) == b""
    for bad in (b"foo", b'{"timestamp":1,"name":"x"}', b'{"timestamp":1,"name":"x"}\n\n',
                b'{"name":"x"}\n', b'{"timestamp":1,"name":""}\n', b'[1]\n',
                b'{"timestamp":1,"name":"x","context":3}\n', b"\xff\n",
                b'{"timestamp":true,"name":"x"}\n'):
        with pytest.raises(eventlog.EventlogError) as ei:
            eventlog.decode(bad)
        assert errnum(ei) == errno.EINVAL, bad
        assert "cannot decode" in str(ei.value)
    for name, ctx, ts in (("", None, 1), ("x", "not_a_object", 1), ("x", "[1]", 1),
                          ("x", "null", 1), ("x", None, -1)):  # ("null": no object, as Flux)
        with pytest.raises(eventlog.EventlogError):
            eventlog.entry(name, ctx, ts)


def test_eventlog_formatter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TZ", "UTC")
    import time
    time.tzset()
    try:
        e1 = eventlog.entry("primus", {"data": "bar", "n": 3}, 120)
        e2 = eventlog.entry("secondus", None, 121)
        e3 = eventlog.entry("tertius", None, 200)
        assert eventlog.Formatter().format(e1) == '120.000000 primus data="bar" n=3'
        assert eventlog.Formatter(unformatted=True).format(e2) == \
            '{"timestamp":121.0,"name":"secondus"}'
        h = eventlog.Formatter(human=True)
        assert [h.format(e) for e in (e1, e2, e3)] == [
            '[Jan01 00:02] primus data="bar" n=3', "[  +1.000000] secondus",
            "[Jan01 00:03] tertius"]
        colored = eventlog.Formatter(color=True).format(e1)
        assert "\x1b[" in colored and "primus" in colored
        with pytest.raises(ValueError):
            eventlog.Formatter(unformatted=True, human=True)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()


# ================================================================ against real instances


async def kvs_on(connect, inst, rank: int = 0, namespace: str | None = None) -> KVS:
    return KVS(await connect(inst, rank), namespace)


@pytest.mark.both_loops
async def test_put_get_across_ranks(start_instance, connect, monkeypatch) -> None:
    monkeypatch.delenv("KVBROKER_NAMESPACE", raising=False)
    inst = await start_instance(size=4, fanout=2)
    k1, k3 = await kvs_on(connect, inst, 1), await kvs_on(connect, inst, 3)
    assert k1.namespace == "primary"
    async with asyncio.timeout(T):
        res = first = await k1.put("a.s", "ƒoo")
        assert isinstance(res, CommitResult) and res.rootseq >= 1
        await k1.put("a.b", b"\x00\xffraw")
        await k1.put("a.j", {"x": [1, 2]})
        big = bytes(range(256)) * 8
        res = await k1.put("a.big", big)
        # rank 1 answered after applying the root; rank 3 catches up on wait
        assert await k3.wait_version(res.rootseq) >= res.rootseq
        assert await k3.get_str("a.s") == "ƒoo"
        assert await k3.get("a.b") == b"\x00\xffraw"
        assert await k3.get_json("a.j") == {"x": [1, 2]}
        assert await k3.get("a.big") == big
        assert (await k3.get_treeobj("a.big"))["type"] == "valref"
        assert await k3.get_treeobj("a.s") == treeobj.val("ƒoo".encode())
        assert (await k3.get_treeobj("."))["type"] == "dirref"
        assert await k3.get_str("..a...s.") == "ƒoo"  # keys are normalised
        assert await k3.exists("a.s") and not await k3.exists("a.nope")
        # at an older root: a.big did not exist before its put
        assert await k3.exists("a.big", at=res) and not await k3.exists("a.big", at=first)
        assert await k3.exists("a.s", at=first.rootref)
        for key, code in (("a.nope", errno.ENOENT), ("a", errno.EISDIR),
                          ("a.s.x", errno.ENOENT)):
            with pytest.raises(RemoteError) as ei:
                await k3.get(key)
            assert errnum(ei) == code, key
        with pytest.raises(RemoteError) as ei:
            await k3.dir("a.s")
        assert errnum(ei) == errno.ENOTDIR
        with pytest.raises(RemoteError) as ei:
            await k3.readlink("a.s")
        assert errnum(ei) == errno.EINVAL
        with pytest.raises(RemoteError) as ei:
            await k1.put(".", 1)
        assert errnum(ei) == errno.EINVAL
        # not JSON: a ValueError that names the key
        with pytest.raises(UnicodeDecodeError, match="codec can't decode .*: a.b: not JSON text"):
            await k3.get_json("a.b")
        with pytest.raises(json.JSONDecodeError, match="^a.s: not JSON: Expecting value"):
            await k3.get_json("a.s")


async def test_txn_commit_and_context_manager(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    kvs = await kvs_on(connect, inst)
    async with asyncio.timeout(T):
        v0 = await kvs.version()
        t = kvs.txn()
        t.put("t.a", 1).mkdir("t.d").symlink("t.l", "t.a").append("t.log", "x")
        res = await t.commit()
        assert t.result == res and res.rootseq == v0 + 1 == await kvs.version()
        assert await kvs.get_json("t.l") == 1  # the link is followed
        assert await kvs.readlink("t.l") == Link("t.a")
        assert len(await kvs.dir("t.d")) == 0

        async with kvs.txn(SYNC) as t2:
            t2.append("t.log", b"y").unlink("t.a")
        assert t2.result is not None and t2.result.rootseq == v0 + 2
        assert await kvs.get("t.log") == b"xy"
        assert not await kvs.exists("t.a")

        with pytest.raises(RuntimeError):
            async with kvs.txn() as t3:
                t3.put("t.never", 1)
                raise RuntimeError("boom")
        assert t3.result is None and not await kvs.exists("t.never")
        assert await kvs.version() == v0 + 2

        async with kvs.txn() as t4:  # an explicit commit is not repeated on exit
            await t4.commit(NO_MERGE)
        assert await kvs.version() == v0 + 3
        # an op added after the commit in a block is not silently dropped
        # (the block does not commit again: that would apply every op again)
        with pytest.raises(RuntimeError, match=r"1 op\(s\) added after the transaction "
                                               "was committed were not sent"):
            async with kvs.txn() as t5:
                t5.put("t.first", 1)
                await t5.commit()
                t5.put("t.late", 2)
        assert await kvs.version() == v0 + 4 and not await kvs.exists("t.late")
        # a block whose own commit failed, and which handled it, sends nothing
        # more at its exit (it sent the failed ops again, and raised their error)
        async with kvs.txn() as t6:
            t6.expect_missing("t.first").put("t.first", "me")
            with pytest.raises(RemoteError) as failed:
                await t6.commit()
            assert failed.value.errnum == errno.ECANCELED
        assert t6.result is None and await kvs.version() == v0 + 4
        v0 += 1

        r = await kvs.commit([{"key": "t.raw", "flags": 0, "dirent": treeobj.val(b"r")}])
        assert r.rootseq == v0 + 4 and await kvs.get("t.raw") == b"r"
        await kvs.append("t.raw", "s")
        await kvs.put_treeobj("t.snap", await kvs.get_treeobj("t"), sync=True)
        assert await kvs.get("t.snap.raw") == b"rs"
        await kvs.mkdir("m1", "m2")
        await kvs.symlink("m3", "x", "otherns")
        assert await kvs.readlink("m3") == Link("x", "otherns")
        with pytest.raises(RemoteError) as ei:  # a failed commit changes nothing
            await kvs.commit(TxnOps().put("ok", 1).append("m1", "x"))
        assert errnum(ei) == errno.EISDIR and not await kvs.exists("ok")


async def test_dir_snapshot_and_walk(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    kvs = await kvs_on(connect, inst, 1)
    async with asyncio.timeout(T):
        big = b"B" * 200
        await kvs.commit(TxnOps().put("d.a", 1).put("d.big", big).mkdir("d.e")
                         .put("d.s.x", "y").symlink("d.l", "d.s").symlink("d.n", "zz", "ns"))
        d = await kvs.dir("d")
        assert list(d) == ["a", "big", "e", "l", "n", "s"]
        assert [d.kind(n) for n in d] == ["value", "value", "dir", "symlink", "symlink", "dir"]
        assert d.link("n") == Link("zz", "ns") and str(d.link("n")) == "ns::zz"
        assert await d.read("a") == b"1" and await d.read("big") == big
        s = await d.subdir("s")
        assert s.key == "d.s" and dict(s) == {"x": treeobj.val(b"y")}
        assert list(await d.subdir("l")) == ["x"]
        root = await kvs.dir()
        assert "d" in root and root.path("d") == "d"
        # the view stays on its root while others commit
        await kvs.put("d.a", 2)
        await kvs.put("d.s.x", "z")
        assert await d.read("a") == b"1" and dict(await d.subdir("s"))["x"] == treeobj.val(b"y")
        assert [k async for k, _ in d.walk()] == ["d.a", "d.big", "d.l", "d.n", "d.s.x"]
        old = await kvs.dir("d", at=d.rootref)
        assert old.rootref == d.rootref and dict(old) == dict(d)
        with pytest.raises(RemoteError) as ei:
            await kvs.dir("d.nope")
        assert errnum(ei) == errno.ENOENT


async def test_get_tree_returns_every_value_below_a_key(start_instance, connect) -> None:
    """get_tree: values by relative dotted key, in depth-first name order
    (valrefs read whole, appended ones joined); symlinks below not followed
    and left out, as are empty directories; the key itself may be a link;
    ENOENT / ENOTDIR; ``at=`` reads an older version; ``limit``."""
    inst = await start_instance(size=2)
    kvs = (await kvs_on(connect, inst, 1)).with_namespace("gt")
    async with asyncio.timeout(T):
        await kvs.with_namespace("primary").namespace_create("gt")
        big = b"B" * 200  # a valref: read with a lookup of its own
        old = await kvs.commit(TxnOps().put("t.a", 1).put("t.big", big).put("t.sub.x", "y")
                               .put("t.sub.deep.z", "zz").mkdir("t.empty")
                               .symlink("t.link", "t.sub").symlink("t.far", "zz", "other")
                               .append("t.app", "x"))
        await kvs.append("t.app", "y")  # (two blobs)
        tree = await kvs.get_tree("t")
        assert tree == {"a": b"1", "app": b"xy", "big": big, "sub.deep.z": b"zz",
                        "sub.x": b"y"}
        assert list(tree) == ["a", "app", "big", "sub.deep.z", "sub.x"]
        assert await kvs.get_tree() == {f"t.{k}": v for k, v in tree.items()}  # "." : full keys
        assert await kvs.get_tree("t.link") == {"deep.z": b"zz", "x": b"y"}
        assert await kvs.get_tree("t.sub.deep") == {"z": b"zz"}
        assert await kvs.get_tree("t.empty") == {}
        for key, err in (("t.a", errno.ENOTDIR), ("t.nope", errno.ENOENT)):
            with pytest.raises(RemoteError) as ei:
                await kvs.get_tree(key)
            assert errnum(ei) == err, key
        await kvs.put("t.a", 2)
        assert (await kvs.get_tree("t"))["a"] == b"2"
        assert (await kvs.get_tree("t", at=old)) == {"a": b"1", "app": b"x", "big": big,
                                                     "sub.deep.z": b"zz", "sub.x": b"y"}
        assert len(await kvs.get_tree("t", limit=5)) == 5
        assert len(await kvs.get_tree("t", limit=None)) == 5
        with pytest.raises(ErrnoError) as ei:
            await kvs.get_tree("t", limit=4)
        assert errnum(ei) == errno.EOVERFLOW and "more than 4 values" in str(ei.value)
        with pytest.raises(ValueError):
            await kvs.get_tree("t", limit=-1)
    assert TREE_LIMIT == 100_000

    def blocking() -> dict[str, bytes]:
        with SyncKVS(uri=inst.uri(0), namespace="gt") as skvs:
            return skvs.get_tree("t.sub")

    assert await asyncio.wait_for(asyncio.to_thread(blocking), 60) == {"deep.z": b"zz",
                                                                       "x": b"y"}


async def test_get_tree_reads_one_version_while_others_commit(start_instance, connect) -> None:
    """Commits landing while get_tree reads (each rewrites every key with
    its generation number) never mix: every value comes from one version.

    The commits land during the read by construction, not by chance: the
    reader's rank 2 hears rank 0 only through rank 1 (a chain), and has the
    directory cached but not the values.  With rank 1 stopped, get_tree
    takes its tree from rank 2's root (generation 0) and its value reads
    wait; a commit lands on rank 0 meanwhile, then rank 1 goes on, and the
    writer goes on committing while the reads finish (rank 2 hears the new
    roots among them).  Left to chance, under load a read could end
    before the commit in flight landed ("no commit landed while get_tree
    read")."""
    inst = await start_instance(size=3, fanout=1)
    writer, reader = await kvs_on(connect, inst, 0), await kvs_on(connect, inst, 2)
    n = 300

    def generation(g: int) -> TxnOps:
        ops = TxnOps()
        for i in range(n):
            ops.put(f"g.k{i:03}", f"{g:06}" + "x" * 100)  # valrefs: one read each
        return ops

    done = 0
    stop, writing = asyncio.Event(), asyncio.Event()

    async def write() -> None:
        nonlocal done
        while not stop.is_set():
            await writer.commit(generation(done + 1))
            done += 1
            writing.set()

    async def reading() -> bool:  # its tree taken: its value reads (READ_WINDOW) in flight
        return reader.handle.pending > 1

    async with asyncio.timeout(3 * T):
        first = await writer.commit(generation(0))
        await reader.wait_version(first.rootseq)
        await reader.dir("g")  # rank 2 caches the directory, not the values
        task: asyncio.Task[None] | None = None
        try:
            async with stopped(inst.pids()[1]):
                read = asyncio.create_task(reader.get_tree("g"))
                await wait_until(reading, "get_tree to read its values", T)
                task = asyncio.create_task(write())
                await writing.wait()  # a commit landed; the reads still wait
            tree = await read
        finally:
            stop.set()
            if task is not None:
                await task
    assert done >= 1  # (landed while the reads waited)
    assert len(tree) == n
    assert {v[:6] for v in tree.values()} == {b"000000"}  # the version before the commits


async def test_unlink_checks(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    kvs = await kvs_on(connect, inst)
    async with asyncio.timeout(T):
        await kvs.commit(TxnOps().put("u.a", 1).put("u.full.x", 1).mkdir("u.empty")
                         .symlink("u.dangling", "nowhere"))
        with pytest.raises(RemoteError) as ei:
            await kvs.unlink("u.missing")
        assert errnum(ei) == errno.ENOENT
        with pytest.raises(RemoteError) as ei:
            await kvs.unlink("u.full")
        assert errnum(ei) == errno.ENOTEMPTY
        assert await kvs.unlinkable("u.missing", force=True) is False
        v = await kvs.version()
        res = await kvs.unlink("u.a", "u.empty", "u.dangling", "u.missing", force=True)
        assert res.rootseq == v + 1  # one transaction
        await kvs.unlink("u.full", recursive=True)
        assert list(await kvs.dir("u")) == []
        # no key at all: a ValueError before anything is sent (as the CLI's
        # usage error), not an empty commit that makes a new version
        v = await kvs.version()
        with pytest.raises(ValueError, match="^unlink needs at least one key"):
            await kvs.unlink(force=True)
        with pytest.raises(ValueError, match="^mkdir needs at least one key"):
            await kvs.mkdir()
        assert await kvs.version() == v


async def test_copy_move_across_namespaces(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    kvs = await kvs_on(connect, inst, 2)
    async with asyncio.timeout(T):
        await kvs.namespace_create("cm")
        other = kvs.with_namespace("cm")
        assert other.namespace == "cm" and other.handle is kvs.handle
        await kvs.commit(TxnOps().put("c.a.x", 1).put("c.a.y", "two").symlink("c.l", "c.a"))
        await kvs.copy("c.a", "c.b")
        assert await kvs.get("c.b.y") == b"two"
        await kvs.copy("c.l", "c.l2")  # links are copied, not followed
        assert await kvs.readlink("c.l2") == Link("c.a")
        await kvs.copy("c.a", "in.other", dst_namespace="cm")
        assert await other.get("in.other.x") == b"1"
        await other.move("in.other", "c.moved", dst_namespace="primary")
        assert await kvs.get("c.moved.y") == b"two" and not await other.exists("in.other")
        v = await kvs.version()
        res = await kvs.move("c.b", "c.c")
        assert res.rootseq == v + 1  # one transaction within a namespace
        assert await kvs.get("c.c.x") == b"1" and not await kvs.exists("c.b")
        with pytest.raises(ErrnoError) as ei:
            await kvs.move("c.c", "c..c")
        assert errnum(ei) == errno.EINVAL
        with pytest.raises(RemoteError) as ei:
            await kvs.copy("c.nope", "c.d")
        assert errnum(ei) == errno.ENOENT


async def test_move_never_loses_the_source(start_instance, connect) -> None:
    """move into its own subtree is EINVAL (it put a.sub inside a, then unlinked
    a: both were gone); move onto itself is EINVAL; move up into an ancestor
    keeps everything; copy into its own subtree is an O(1) snapshot, allowed."""
    inst = await start_instance(size=1)
    kvs = await kvs_on(connect, inst)
    async with asyncio.timeout(T):
        await kvs.commit(TxnOps().put("a.b", 1).put("a.c", "hello"))
        root = await kvs.getroot()
        for src, dst in (("a", "a.sub"), ("a.", "..a.sub.deeper"), ("a", "a"), ("a", "a.")):
            with pytest.raises(ErrnoError) as ei:
                await kvs.move(src, dst)
            assert errnum(ei) == errno.EINVAL, (src, dst)
        assert "subdirectory of itself" in str(await _errstr(kvs.move("a", "a.sub")))
        assert await kvs.getroot() == root  # nothing was committed
        assert await kvs.get("a.b") == b"1" and await kvs.get("a.c") == b"hello"
        # into another namespace, a.sub is not inside a
        await kvs.namespace_create("mv")
        await kvs.move("a", "a.sub", dst_namespace="mv")
        assert await kvs.with_namespace("mv").get("a.sub.c") == b"hello"
        assert not await kvs.exists("a")
        await kvs.move("a.sub", "a", src_namespace="mv")
        # up into an ancestor: x := x.sub; x.sub's own "sub" entry must survive
        await kvs.commit(TxnOps().put("x.sub.sub", "inner").put("x.sub.b", 2).put("x.old", 3))
        await kvs.move("x.sub", "x")
        assert sorted(await kvs.dir("x")) == ["b", "sub"]
        assert await kvs.get("x.sub") == b"inner" and await kvs.get("x.b") == b"2"
        # copy into its own subtree: a snapshot of a as it was
        await kvs.copy("a", "a.snap")
        assert await kvs.get("a.snap.c") == b"hello" and await kvs.get("a.c") == b"hello"
        assert sorted(await kvs.dir("a.snap")) == ["b", "c"]


async def _errstr(aw) -> str:
    try:
        await aw
    except ErrnoError as exc:
        return exc.errstr or ""
    raise AssertionError("no error")


async def test_roots_versions_and_lookup_at(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    k0, k3 = await kvs_on(connect, inst, 0), await kvs_on(connect, inst, 3)
    async with asyncio.timeout(T):
        r0 = await k0.put("r.a", "old")
        root = await k0.getroot()
        assert root.rootref == r0.rootref and root.rootseq == r0.rootseq
        assert root.namespace == "primary" and root.owner == os.getuid()
        waiter = asyncio.ensure_future(k3.wait_version(r0.rootseq + 2))
        await k0.put("r.a", "mid")
        assert not waiter.done()
        r2 = await k0.put("r.a", "new")
        assert await waiter >= r2.rootseq
        assert await k3.get("r.a") == b"new"
        for at in (r0, root, r0.rootref, treeobj.to_json(r0.treeobj), r0.treeobj):
            assert await k3.get("r.a", at=at) == b"old"
        sub = await k0.get_treeobj("r")  # a subdirectory's dirref works as a root too
        assert await k3.get("a", at=sub) == b"new"
        assert (await k3.lookup_at(r0, "r", READDIR))["type"] == "dir"
        with pytest.raises(ErrnoError) as ei:
            await k3.get("r.a", at='{"data":["sha1-aaa"],"type":"dirref","ver":1}')
        assert errnum(ei) == errno.EINVAL


async def test_a_root_read_through_another_namespaces_kvs_follows_its_own_links(
        start_instance, connect) -> None:
    """A :class:`Root` names its namespace: ``at=`` it reads as that
    namespace's root whatever namespace the KVS names, so a link naming the
    root's own namespace is followed inside the snapshot and one naming
    another reads that one's current root (docs/kvs.md).  Through the
    ``primary`` KVS, an ``ns1`` root took ``primary::a`` for a key of the
    snapshot, and ``ns1::a`` to ns1's current root."""
    inst = await start_instance(size=2)
    prim = await kvs_on(connect, inst, 1)
    async with asyncio.timeout(T):
        await prim.namespace_create("ns1")
        ns1 = prim.with_namespace("ns1")
        await prim.put("a", "PRIMARY_a")
        await ns1.put("a", "ns1_a_old")
        await ns1.symlink("plink", "a", namespace="primary")
        await ns1.symlink("selflink", "a", namespace="ns1")
        root = await ns1.getroot()
        await ns1.put("a", "ns1_a_new")
        for kvs in (ns1, prim):
            assert await kvs.get("plink", at=root) == b"PRIMARY_a"
            assert await kvs.get("selflink", at=root) == b"ns1_a_old"
            assert await kvs.exists("selflink", at=root)
            snapshot = await kvs.dir(at=root)
            assert await snapshot.read("selflink") == b"ns1_a_old"
            assert await snapshot.read("plink") == b"PRIMARY_a"
            assert await kvs.get_tree(at=root) == {"a": b"ns1_a_old"}


async def test_namespaces(start_instance, connect, monkeypatch) -> None:
    inst = await start_instance(size=4, fanout=2)
    kvs = await kvs_on(connect, inst, 1)
    async with asyncio.timeout(T):
        await kvs.namespace_create("ns-a")
        await kvs.namespace_create("ns-b", owner=4242)
        with pytest.raises(RemoteError) as ei:
            await kvs.namespace_create("ns-a")
        assert errnum(ei) == errno.EEXIST
        roots = {r.namespace: r for r in await kvs.namespace_list()}
        assert {"primary", "ns-a", "ns-b"} <= set(roots)
        assert roots["ns-b"].owner == 4242 and roots["ns-a"].rootseq == 0
        a = kvs.with_namespace("ns-a")
        await a.put("k", "in-a")
        assert await a.version() == 1 and not await kvs.exists("k")
        await kvs.symlink("to-a", "k", "ns-a")
        assert await kvs.get("to-a") == b"in-a"
        await kvs.symlink("to-a2", "ns-a::k")
        assert await kvs.get("to-a2") == b"in-a"
        start = await a.getroot()
        await kvs.namespace_create("ns-c", rootref=start.rootref)  # a namespace from a root
        assert await kvs.with_namespace("ns-c").get("k") == b"in-a"
        monkeypatch.setenv("KVBROKER_NAMESPACE", "ns-a")
        assert await KVS(kvs.handle).get("k") == b"in-a"
        await kvs.namespace_remove("ns-a")
        await kvs.namespace_remove("never-existed")
        with pytest.raises(RemoteError) as ei:
            await a.get("k")
        assert errnum(ei) == errno.ENOTSUP
        with pytest.raises(RemoteError) as ei:
            await kvs.namespace_remove("primary")
        assert errnum(ei) == errno.ENOTSUP
        assert "ns-a" not in {r.namespace for r in await kvs.namespace_list()}


def test_txn_append_event_is_the_line_kvs_append_event_writes() -> None:
    """TxnOps.append_event: one APPEND op of eventlog.encode_entry's line, so
    an event can join other ops in one commit; bad input fails at once."""
    ops = TxnOps().put("job.spec", {"ntasks": 4}).append_event(
        "job.eventlog", "submit", {"userid": 1000}, timestamp=1.5)
    assert ops.ops[1] == {"key": "job.eventlog", "flags": APPEND, "dirent": treeobj.val(
        b'{"timestamp":1.5,"name":"submit","context":{"userid":1000}}\n')}
    assert ops.ops[1]["dirent"]["data"] == eventlog.encode_entry(
        eventlog.entry("submit", '{"userid": 1000}', 1.5))
    now = eventlog.decode(TxnOps().append_event("log", "start").ops[0]["dirent"]["data"])
    assert now[0]["name"] == "start" and now[0]["timestamp"] > 1e9 and "context" not in now[0]
    for name, ctx in (("", None), ("x", "[1]")):
        with pytest.raises(eventlog.EventlogError):
            TxnOps().append_event("log", name, ctx)


async def test_a_txn_puts_a_jobspec_and_appends_its_submit_event_in_one_commit(
        start_instance, connect) -> None:
    """A reader on rank 3 sees the jobspec and its submit event arrive in
    the same version (one key watch answer naming both, both readable at
    its root), never one without the other."""
    inst = await start_instance(size=4, fanout=2)
    kvs0, kvs3 = await kvs_on(connect, inst, 0), await kvs_on(connect, inst, 3)
    async with asyncio.timeout(T), kvs3.watch_keys("jobs") as w:
        assert (await anext(w)).initial
        async with kvs0.txn() as t:
            t.put("jobs.1.spec", {"ntasks": 4}).append_event(
                "jobs.1.eventlog", "submit", {"userid": 1000}, timestamp=7.0)
        ch = await anext(w)
        assert ch.rootseq == t.result.rootseq
        assert set(ch.keys) == {"jobs.1.spec", "jobs.1.eventlog"}
        assert await kvs3.get_json("jobs.1.spec", at=ch.rootref) == {"ntasks": 4}
        log = eventlog.decode(await kvs3.get("jobs.1.eventlog", at=ch.rootref))
        assert log == [{"timestamp": 7.0, "name": "submit", "context": {"userid": 1000}}]
        # a later event is appended to the same log, as KVS.append_event does
        await kvs0.append_event("jobs.1.eventlog", "start", timestamp=8.0)
        assert [e["name"] for e in await kvs0.get_eventlog("jobs.1.eventlog")] == [
            "submit", "start"]


async def test_eventlog_append_get(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    kvs = await kvs_on(connect, inst, 1)
    async with asyncio.timeout(T):
        await eventlog.append(kvs, "ev", "start", {"n": 1}, timestamp=1)
        await eventlog.append(kvs, "ev", "finish", '{"ok": true}', timestamp=2)
        assert await eventlog.get(kvs, "ev") == [
            {"timestamp": 1.0, "name": "start", "context": {"n": 1}},
            {"timestamp": 2.0, "name": "finish", "context": {"ok": True}}]
        assert (await kvs.get_treeobj("ev"))["type"] == "valref"  # appended, not rewritten
        await kvs.put("notlog", "foo")
        with pytest.raises(eventlog.EventlogError):
            await eventlog.get(kvs, "notlog")


async def test_sync_facade(start_instance) -> None:
    inst = await start_instance(size=2)

    def script() -> list:
        seen: list = []
        with SyncKVS(uri=inst.uri(1)) as kvs:
            r = kvs.put("s.a", {"v": 1}, sync=True)
            seen.append(kvs.get_json("s.a") == {"v": 1} and kvs.version() == r.rootseq)
            with kvs.txn() as t:
                t.put("s.b", "x").symlink("s.l", "s.b").mkdir("s.d")
            seen.append(t.result is not None)
            try:
                with kvs.txn() as t2:
                    t2.put("s.never", 1)
                    raise KeyError("x")
            except KeyError:
                seen.append(not kvs.exists("s.never"))
            kvs.append("s.b", "y")
            seen.append(kvs.get("s.b") == b"xy" and kvs.get_str("s.l") == "xy")
            seen.append(str(kvs.readlink("s.l")) == "s.b")
            seen.append(kvs.get_treeobj("s.d") == kvs.lookup("s.d", 16))
            d = kvs.dir("s")
            seen.append(list(d) == ["a", "b", "d", "l"] and kvs.run(d.read("b")) == b"xy")
            kvs.copy("s.b", "s.c")
            kvs.move("s.c", "s.e")
            kvs.mkdir("s.f")
            kvs.put_treeobj("s.g", kvs.get_treeobj("s.b"))
            kvs.unlink("s.f")
            seen.append(kvs.get("s.e") == b"xy" == kvs.get("s.g"))
            kvs.namespace_create("sync-ns")
            other = kvs.with_namespace("sync-ns")
            other.symlink("back", "s.b", "primary")
            seen.append(other.get("back") == b"xy" and other.namespace == "sync-ns")
            seen.append("sync-ns" in {r.namespace for r in kvs.namespace_list()})
            root = kvs.getroot()
            seen.append(kvs.wait_version(root.rootseq, timeout=5) >= root.rootseq)
            seen.append(kvs.lookup_at(root, "s.b")["data"] == b"xy")
            kvs.run(eventlog.append(kvs.aio, "s.ev", "hi", timestamp=3))
            seen.append(kvs.run(eventlog.get(kvs.aio, "s.ev"))[0]["name"] == "hi")
            kvs.namespace_remove("sync-ns")
            other.close()  # does not own the handle
            seen.append(kvs.get("s.b") == b"xy")
        return seen

    results = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert results == [True] * 14


async def test_connect_owns_its_handle(start_instance) -> None:
    inst = await start_instance(size=1)
    async with asyncio.timeout(T):
        async with await KVS.connect(inst.uri(0), namespace="primary") as kvs:
            await kvs.put("c", 1)
            assert "primary" in repr(kvs)
        with pytest.raises(RemoteError):  # closed with the context
            await kvs.get("c")


async def test_abandoned_waits_do_not_pile_up_on_the_handle(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    kvs = KVS(h)
    async with asyncio.timeout(T):
        for _ in range(50):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(kvs.wait_version(10**9), 0.01)
        assert h.pending == 0
        # the handle still matches answers to calls
        assert (await kvs.put("w.k", 1)).rootseq >= 1
        assert await kvs.get_json("w.k") == 1
        assert h.pending == 0

    def script() -> tuple[int, int]:
        with SyncKVS(uri=inst.uri(0)) as skvs:
            for _ in range(5):
                try:
                    skvs.wait_version(10**9, timeout=0.01)
                except TimeoutError:
                    pass
            return skvs.sync_handle.aio.pending, skvs.version()

    pending, version = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert pending == 0 and version >= 1


async def test_api_misuse_is_refused_before_sending(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    kvs = KVS(h)
    async with asyncio.timeout(T):
        await kvs.put("m.a", 1)
        for call in (lambda: kvs.get(5), lambda: kvs.get_str(5), lambda: kvs.get_json(5),
                     lambda: kvs.lookup(5), lambda: kvs.dir(5), lambda: kvs.exists(5),
                     lambda: kvs.readlink(5), lambda: kvs.get_treeobj(5),
                     lambda: kvs.lookup_at(".", 5), lambda: kvs.unlinkable(5),
                     lambda: kvs.unlink(5), lambda: kvs.copy(5, "m.b"),
                     lambda: kvs.move("m.a", 5)):
            with pytest.raises(TypeError, match="key must be a str"):
                await call()
        for call in (lambda: kvs.put("m.\udcff", 1), lambda: kvs.get("m.\udcff"),
                     lambda: kvs.dir("m\udcff")):
            with pytest.raises(ValueError, match="a lone surrogate .*: a key must be UTF-8 text"):
                await call()
        for bad in (float("nan"), float("inf"), -float("inf"), {"x": [float("nan")]}):
            with pytest.raises(TypeError):
                await kvs.put("m.nan", bad)
            with pytest.raises(TypeError):
                await kvs.append("m.nan", bad)
        assert not await kvs.exists("m.nan")
        assert await kvs.get_json("m.a") == 1
        # a watch's key and namespace too (the broker said only EPROTO)
        from kvs_watch.client import watch
        with pytest.raises(TypeError, match="key must be a str"):
            watch(h, 123)
        with pytest.raises(TypeError, match="namespace must be a str"):
            watch(h, "m.a", namespace=7)
        assert h.pending == 0


async def test_any_str_round_trips_through_put_and_get_str(start_instance, connect) -> None:
    """A str with surrogate escapes (a file name from os.fsdecode) is stored
    as the bytes it stands for; get_str raised UnicodeDecodeError on them."""
    inst = await start_instance(size=1)
    kvs = KVS(await connect(inst, 0))
    async with asyncio.timeout(T):
        name = os.fsdecode(b"caf\xe9-\xff.txt")
        await kvs.put("m.name", name)
        assert await kvs.get("m.name") == b"caf\xe9-\xff.txt"
        assert await kvs.get_str("m.name") == name
        await kvs.put("m.text", "h\u00e9llo")
        assert await kvs.get_str("m.text") == "h\u00e9llo"
        # and a watch's entry.text() gives the same str as get_str (it
        # decoded with errors="replace": U+FFFD for each such byte)
        async with kvs.watch("m.name") as w:
            entry = await anext(w)
        assert entry.text() == name
        assert entry.text(errors="replace") == "caf\ufffd-\ufffd.txt"


async def test_sync_unlinkable(start_instance) -> None:
    inst = await start_instance(size=1)

    def script() -> list:
        with SyncKVS(uri=inst.uri(0)) as kvs:
            kvs.put("u.d.x", 1)
            out = [kvs.unlinkable("u.d.x"), kvs.unlinkable("u.nope", force=True),
                   kvs.unlinkable("u.d", recursive=True)]
            try:
                kvs.unlinkable("u.d")
            except RemoteError as exc:
                out.append(exc.errnum == errno.ENOTEMPTY)
            return out

    assert await asyncio.wait_for(asyncio.to_thread(script), 60) == [True, False, True, True]


@pytest.mark.parametrize("cache_bytes", ["0", "2000"])
async def test_a_cache_smaller_than_what_a_request_reads_still_answers(
        start_instance, connect, cache_bytes: str) -> None:
    """A lookup or commit fetches what it misses and starts again from the
    root: with a kvs cache smaller than the blobs it reads, each pass
    evicted what the previous one fetched, and rank 0 spun at full CPU
    without answering.  What an operation fetched is now held until it is
    done.  On rank 0 and on a follower."""
    inst = await start_instance(size=2, attrs={"kvs.cache-bytes": cache_bytes})
    async with asyncio.timeout(T):
        kvs = KVS(await connect(inst, 0))
        async with kvs.txn() as t:
            for d in ("a", "a.b", "a.b.c"):
                for i in range(20):
                    t.put(f"{d}.f{i}", "x" * 50)
            t.put("a.b.c.v", 1)
        far = KVS(await connect(inst, 1))
        for k in (kvs, far):
            await k.handle.rpc("kvs.dropcache", {})
            assert await k.get_json("a.b.c.v") == 1
            await k.put("a.b.c.w", 2)
            assert await k.get_json("a.b.c.w") == 2
        fetches = (await kvs.handle.rpc("kvs.stats-get", {}))["counts"]["blob-fetches"]
        assert fetches < 100, fetches  # (the spin made hundreds of thousands)


async def test_a_wait_version_timeout_is_the_ranks(start_instance, connect) -> None:
    """With ``timeout`` the rank gives up and forgets the wait (a caller that
    gave up on its own side left the waiter on the rank until the version
    came: one more per call of a script that polled)."""
    inst = await start_instance(size=2)
    h1 = await connect(inst, 1)
    kvs = KVS(h1)
    # rank 1 loads primary first (from rank 0: that counts in a wait's
    # timeout, and a load past 0.05 s, as right after start-up on a loaded
    # machine, is "still loading", not "this rank is at")
    assert await asyncio.wait_for(kvs.wait_version(0), T) >= 0
    for _ in range(3):
        with pytest.raises(TimeoutError, match=r"^version 1000000000 not reached in 0.05 s; "
                                               r"this rank is at \d+$"):
            await asyncio.wait_for(kvs.wait_version(10**9, timeout=0.05), T)
    st = await asyncio.wait_for(h1.rpc("kvs.stats-get", {}), T)
    assert st["namespaces"]["primary"]["waiters"] == 0
    res = await asyncio.wait_for(kvs.put("k", 1), T)
    assert await asyncio.wait_for(kvs.wait_version(res.rootseq, timeout=5), T) >= res.rootseq
    for bad in (-1, "1", True):
        with pytest.raises(RemoteError) as err:
            await asyncio.wait_for(h1.rpc("kvs.wait-version", {
                "namespace": "primary", "rootseq": 10**9, "timeout": bad}), T)
        assert err.value.errnum == errno.EPROTO
    rc, out, err_text = await run_cli("kvs", "wait", "-t", "0.05", "1000000000", uri=inst.uri(1))
    assert rc == 1
    assert err_text.startswith("kvbroker: kvs wait: version 1000000000 not reached in 0.05 s")


async def test_a_wait_version_timeout_holds_when_the_rank_is_stopped(start_instance,
                                                                     connect) -> None:
    """The rank times the wait, so a stopped rank answered nothing and the
    async call, given ``timeout=0.2``, waited for ever (the blocking facade
    and the command each had a limit of their own): it now gives up on the
    rank ``WAIT_GRACE`` later, saying so, and the blocking facade with it."""
    inst = await start_instance(size=2)
    h1 = await connect(inst, 1)
    kvs = KVS(h1)
    # (a version there already is answered at once; but rank 1 loads primary
    # from rank 0 first, inside the rank's timeout -- T, not 0.2 s: right
    # after start-up on a loaded machine that load took 0.1 s)
    assert await asyncio.wait_for(kvs.wait_version(0, timeout=T), T + 2) >= 0
    pid = inst.pids()[1]
    await stop_process(pid)
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError, match=r"^version 5 not reached in 0.2 s; the rank "
                                               r"did not answer \(stopped\?\)$"):
            await asyncio.wait_for(kvs.wait_version(5, timeout=0.2), T)
        assert asyncio.get_running_loop().time() - t0 < 0.2 + WAIT_GRACE + 2
    finally:
        os.kill(pid, signal.SIGCONT)
    # the rank, running again, still answers, and refuses a bad timeout itself
    # (the API refuses it before sending: test_api_misuse.py)
    with pytest.raises(RemoteError) as err:
        await asyncio.wait_for(h1.rpc("kvs.wait-version", {
            "namespace": "primary", "rootseq": 5, "timeout": -1}), T)
    assert err.value.errnum == errno.EPROTO


async def test_a_wait_version_of_timeout_0_needing_a_load_is_answered_at_once(
        start_instance, connect) -> None:
    """``timeout: 0`` asks "reached now?".  On a rank that must load the
    namespace from rank 0 first, with the way there stopped, it waited
    without end for the load (the timeout counts from the request, the
    load included; found by a review): it is ``ETIMEDOUT`` at once."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": "far"}), T)
    await asyncio.wait_for(h3.rpc("kvs.wait-version", {  # (rank 3 holds primary)
        "namespace": "primary", "rootseq": 0, "timeout": T}), T)
    pid = inst.pids()[1]  # (rank 3's parent)
    await stop_process(pid)
    try:
        with pytest.raises(RemoteError) as err:
            await asyncio.wait_for(h3.rpc("kvs.wait-version", {
                "namespace": "far", "rootseq": 0, "timeout": 0}), T)
        assert err.value.errnum == errno.ETIMEDOUT, err.value
        assert "still loading namespace far from rank 0 by way of rank 1" in \
            err.value.errstr, err.value
        # and 0 on a namespace the rank holds is answered from it, as before
        assert (await asyncio.wait_for(h3.rpc("kvs.wait-version", {
            "namespace": "primary", "rootseq": 0, "timeout": 0}), T))["rootseq"] >= 0
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_watch_cancelled_by_another_task_ends_its_readers_loop(start_instance,
                                                                      connect) -> None:
    """``await w.cancel()`` from a controller task while another iterates the
    watch (it raised "another task is already reading"): it returns once the
    cancel is sent, and the reader's loop ends."""
    from kvs_watch.client import watch

    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    kvs = KVS(h)
    async with asyncio.timeout(T):
        await kvs.put("cw.k", 1)
        w = watch(h, "cw.k")
        seen: list[int] = []
        first = asyncio.Event()

        async def reader() -> None:
            async for entry in w:
                seen.append(json.loads(entry.value))  # type: ignore[union-attr]
                first.set()

        task = asyncio.create_task(reader())
        await first.wait()
        await w.cancel()
        await task  # ends: no RuntimeError, no hang
        assert seen == [1] and h.pending == 0


async def test_calls_on_a_closed_handle_raise_a_new_error_each(start_instance,
                                                             connect) -> None:
    """One shared exception object was raised again and again: its traceback
    grew by every call's frames (a retry loop held them all)."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await h.close()
    errors = []
    for _ in range(3):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(h.ping(0), T)
        errors.append(info.value)
    assert len({id(e) for e in errors}) == 3
    assert {(e.errnum, e.errstr) for e in errors} == {(errno.ECONNRESET, "handle closed")}


def test_errors_pickle_and_copy() -> None:
    import copy
    import pickle

    from broker.errors import ProtocolError
    from kvs.eventlog import EventlogError

    for exc in (ProtocolError("bad frame"), EventlogError("bad line"),
                RemoteError(errno.ENOENT, "k: no such key")):
        for again in (pickle.loads(pickle.dumps(exc)), copy.copy(exc)):
            assert type(again) is type(exc)
            assert (again.errnum, again.errstr) == (exc.errnum, exc.errstr)


async def test_wait_create_waits_for_the_key_and_its_namespace(start_instance, connect) -> None:
    """KVS.wait_create (and SyncKVS's): the value once the key exists, in
    the KVS's namespace, even one created after the wait began; at once if
    it exists; TimeoutError after timeout, the watch cancelled."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    k0, k1 = KVS(h0), KVS(h1, "later")
    async with asyncio.timeout(T):
        waiting = asyncio.ensure_future(k1.wait_create("job.state"))
        await wait_watchers(h1, 1)
        await k0.namespace_create("later")
        await KVS(h0, "later").put("job.state", "run")
        entry = await waiting
        assert (entry.value, entry.namespace) == (b"run", "later")
        assert (await k1.wait_create("job.state")).value == b"run"  # exists: at once
        with pytest.raises(TimeoutError,
                           match=r"^job\.never: not created within 0\.2 s \(namespace later\)$"):
            await k1.wait_create("job.never", timeout=0.2)
        await wait_watchers(h1, 0)

    def blocking() -> bytes | None:
        with SyncKVS(uri=inst.uri(1), namespace="later") as skvs:
            return skvs.wait_create("job.state", timeout=T).value
    assert await asyncio.to_thread(blocking) == b"run"


async def test_wait_create_on_another_rank(start_instance, connect) -> None:
    """KVS.wait_create(nodeid=N), as wait_event's: the wait is served by
    rank N's kvs-watch, not the handle's rank."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    kvs = KVS(h0)
    async with asyncio.timeout(T):
        waiting = asyncio.ensure_future(kvs.wait_create("job.far", nodeid=1))
        await wait_watchers(h0, 1, nodeid=1)
        await wait_watchers(h0, 0, nodeid=0)
        await kvs.put("job.far", "here")
        assert (await waiting).value == b"here"
        await wait_watchers(h0, 0, nodeid=1)

    def blocking() -> bytes | None:
        with SyncKVS(uri=inst.uri(0)) as skvs:
            return skvs.wait_create("job.far", timeout=T, nodeid=1).value
    assert await asyncio.to_thread(blocking) == b"here"



async def test_get_with_a_default_answers_a_missing_key(start_instance, connect) -> None:
    """get/get_str/get_json(key, default) give the default for a missing key
    (as dict.get), in one request, also at an older root, and still raise
    for what is not "missing" (a directory); without a default, ENOENT as
    before.  SyncKVS's twins do the same."""
    inst = await start_instance(size=1)
    kvs = KVS(await connect(inst, 0))
    async with asyncio.timeout(T):
        old = await kvs.put("cfg.port", "80")
        await kvs.put("cfg.port", "8080")
        await kvs.put("cfg.obj", {"a": 1})
        assert await kvs.get("cfg.nope", None) is None
        assert await kvs.get("cfg.nope", b"x") == b"x"
        assert await kvs.get("cfg.port", None) == b"8080"
        assert await kvs.get_str("cfg.nope", "dflt") == "dflt"
        assert await kvs.get_str("cfg.port", "dflt") == "8080"
        assert await kvs.get_str("cfg.port", None, at=old) == "80"
        assert await kvs.get_str("cfg.obj", None, at=old) is None
        assert await kvs.get_json("cfg.nope", {"d": 0}) == {"d": 0}
        assert await kvs.get_json("cfg.obj", {}) == {"a": 1}
        assert await kvs.get_json("cfg.nope.deeper", None) is None
        with pytest.raises(RemoteError) as ei:
            await kvs.get("cfg", None)  # a directory is not a missing key
        assert errnum(ei) == errno.EISDIR
        with pytest.raises(RemoteError) as ei:
            await kvs.get("cfg.nope")
        assert errnum(ei) == errno.ENOENT

    def blocking() -> list[object]:
        with SyncKVS(uri=inst.uri(0)) as skvs:
            return [skvs.get("cfg.nope", None), skvs.get_str("cfg.nope", "d"),
                    skvs.get_json("cfg.nope", 7), skvs.get_str("cfg.port", "d")]
    assert await asyncio.wait_for(asyncio.to_thread(blocking), T) == [None, "d", 7, "8080"]


async def test_eventlog_methods_on_a_jobs_namespace(start_instance, connect) -> None:
    """A job's eventlog workflow on the KVS of its namespace, across ranks:
    KVS/SyncKVS append_event, get_eventlog and wait_event (and nodeid for
    watch_eventlog and SyncKVS.watch_keys).  Before, only watch_eventlog
    was a method: appending took kvs.eventlog.append(kvs.aio, ...) on the
    blocking facade, and waiting for an event a handle and the namespace
    again (kvs_watch.client.wait_event)."""
    inst = await start_instance(size=4)
    job3 = KVS(await connect(inst, 3), "job-1")
    # rank 3 waits for "start" before the namespace even exists
    waiter = asyncio.create_task(job3.wait_event("eventlog", "start", waitcreate=True,
                                                 timeout=T))
    await wait_watchers(job3.handle, 1, 3)
    await KVS(await connect(inst, 0)).namespace_create("job-1", owner=os.getuid())

    def script() -> dict:
        out: dict = {}
        with SyncKVS(uri=inst.uri(2), namespace="job-1", timeout=T) as kvs:
            with kvs.watch_keys(nodeid=1, timeout=T) as w:
                next(w)  # the initial answer: the watch is in place on rank 1
                out["rank1_watchers"] = kvs.run(kvs.aio.handle.rpc(
                    "kvs-watch.stats-get", {}, nodeid=1))["watchers"]
            kvs.append_event("eventlog", "submit", {"userid": 42}, timestamp=1.5)
            kvs.append_event("eventlog", "start", sync=True)
            out["log"] = kvs.get_eventlog("eventlog")
            out["start"] = kvs.wait_event("eventlog", "start")
            with kvs.watch_eventlog("eventlog", nodeid=0, timeout=T) as ew:
                out["watched"] = [next(ew)["name"], next(ew)["name"]]
            try:
                kvs.wait_event("eventlog", "finish", timeout=0.3)
            except TimeoutError as exc:
                out["timeout"] = str(exc)
        return out

    out = await asyncio.wait_for(asyncio.to_thread(script), 60)
    started = await asyncio.wait_for(waiter, T)
    assert out["rank1_watchers"] == 1
    assert [(e["name"], e.get("context")) for e in out["log"]] == [
        ("submit", {"userid": 42}), ("start", None)]
    assert out["log"][0]["timestamp"] == 1.5
    assert out["start"] == out["log"][1] == started
    assert out["watched"] == ["submit", "start"]
    assert "no event 'finish' within 0.3 s" in out["timeout"]
    assert [e["name"] for e in await job3.get_eventlog("eventlog")] == ["submit", "start"]
    await job3.append_event("eventlog", "finish", '{"status": 0}')
    assert (await job3.wait_event("eventlog", "finish", timeout=T))["context"] == {"status": 0}


async def test_sync_kvs_inside_a_running_loop_names_the_async_kvs(start_instance) -> None:
    """SyncKVS refused inside a loop named broker.handle.Handle (the
    SyncHandle's words), not the KVS class to use instead."""
    inst = await start_instance(size=1)
    with pytest.raises(RuntimeError, match=r"SyncKVS .* kvs\.client\.KVS"):
        SyncKVS(uri=inst.uri(0))
    async with KVS.connect(inst.uri(0)) as kvs:  # what it points to works there
        assert (await kvs.put("k", 1)).rootseq >= 1


async def test_an_empty_namespace_is_a_valueerror_none_the_default(
        start_instance, connect, monkeypatch: pytest.MonkeyPatch) -> None:
    """``namespace=""`` is a ValueError wherever a namespace is given (KVS,
    KVS.connect, with_namespace, copy's, SyncKVS, every watch function),
    raised before anything is sent or connected; None still means
    $KVBROKER_NAMESPACE, else primary (an empty $KVBROKER_NAMESPACE counts
    as unset).  Before, "" meant the default too, so a namespace read from
    a variable that was never set wrote to primary."""
    from kvs_watch.client import (
        stream,
        wait_create,
        wait_event,
        watch,
        watch_eventlog,
        watch_keys,
    )

    inst = await start_instance(size=1)
    h = await connect(inst)
    monkeypatch.setenv("KVBROKER_NAMESPACE", "")
    assert KVS(h).namespace == KVS(h, None).namespace == "primary"
    monkeypatch.setenv("KVBROKER_NAMESPACE", "job-1")
    assert KVS(h).namespace == "job-1" and KVS(h, "x").namespace == "x"
    monkeypatch.delenv("KVBROKER_NAMESPACE")
    kvs = KVS(h)
    unset = os.environ.get("NEVER_SET_NAMESPACE", "")
    with pytest.raises(ValueError, match="namespace must not be empty"):
        KVS(h, unset)
    with pytest.raises(TypeError, match="namespace must be a str"):
        KVS(h, 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        KVS.connect(inst.uri(0), namespace="")  # (refused before connecting)
    with pytest.raises(ValueError, match="must not be empty"):
        kvs.with_namespace("")
    with pytest.raises(ValueError, match="must not be empty"):
        await kvs.copy("a", "b", dst_namespace="")
    for make in (lambda: watch(h, "a", namespace=""),
                 lambda: watch_keys(h, "a", namespace=""),
                 lambda: watch_eventlog(h, "a", namespace=""),
                 lambda: stream(h, "a", namespace="")):
        with pytest.raises(ValueError, match="must not be empty"):
            make()
    with pytest.raises(ValueError, match="must not be empty"):
        await wait_create(h, "a", namespace="")
    with pytest.raises(ValueError, match="must not be empty"):
        await wait_event(h, "a", "x", namespace="")
    assert h.pending == 0

    def blocking() -> list[str]:
        seen = []
        with SyncKVS(uri=inst.uri(0)) as skvs:
            for make in (lambda: SyncKVS(skvs.sync_handle, ""),
                         lambda: skvs.with_namespace(""),
                         lambda: SyncKVS(uri=inst.uri(0), namespace="")):
                try:
                    make()
                except ValueError as exc:
                    seen.append(str(exc))
        return seen

    seen = await asyncio.wait_for(asyncio.to_thread(blocking), 60)
    assert len(seen) == 3 and all("must not be empty" in s for s in seen), seen
    # nothing of it reached the store
    assert await kvs.get_tree(".") == {}


async def test_cli_an_empty_namespace_option_is_a_usage_error(start_instance) -> None:
    """``-N ""`` (and -S, -D, -T, ``namespace create/remove ""``) is a usage
    error, exit 2, nothing sent; before, ``kvs put -N "" a=1`` wrote to
    primary, and ``namespace remove ""`` succeeded."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    for args in (("put", "-N", "", "a=1"), ("get", "-N", "", "a"),
                 ("get", "-N", "", "--watch", "--count", "1", "a"),
                 ("copy", "-S", "", "a", "b"), ("move", "-D", "", "a", "b"),
                 ("link", "-T", "", "a", "b"), ("namespace", "create", ""),
                 ("namespace", "remove", "")):
        rc, out, err = await run_cli("kvs", *args, uri=uri, timeout=T)
        assert rc == 2, (args, rc, out, err)
        assert "must not be empty" in err, (args, err)
    rc, out, err = await run_cli("kvs", "dir", "-R", ".", uri=uri, timeout=T)
    assert (rc, out) == (0, ""), err


def test_a_lone_surrogate_is_an_unencodable_value() -> None:
    """``"\\ud800"`` (no surrogate escape: UTF-8 cannot hold it) is a
    ``TypeError`` as api.md says of an unencodable value (it was
    ``UnicodeEncodeError``); a surrogate escape is stored as its byte."""
    with pytest.raises(TypeError, match="cannot store a str value"):
        encode_value("\ud800")
    assert encode_value("\udcff") == b"\xff"


async def test_update_and_reads_found_by_a_review(start_instance, connect) -> None:
    """* ``update()`` whose key another writer removes while ``fn`` runs: it
      reads as missing and goes on (an ``ENOENT`` escaped, from the check
      that the key is no symlink).
    * ``update()`` of a symlink with ``retries=0``: ``EINVAL``, as with
      retries (it was the ``ECANCELED``).
    * ``get_str``/``get_json`` with a bytes default equal to the value:
      the value, decoded (``b""`` and one-byte bytes are shared objects,
      and the value read as missing).
    * ``get_tree(key, at=Root)`` of another namespace through a link into a
      third: read in the Root's namespace (the link was taken to be in the
      KVS's, and its target read at the Root's tree)."""
    inst = await start_instance(size=1)
    k, other = await kvs_on(connect, inst), await kvs_on(connect, inst)

    await k.put("u.k", "v")

    async def removed_meanwhile(old: bytes | None) -> bytes | None:
        await other.unlink("u.k")
        return old  # (unchanged: nothing to commit)
    got = await asyncio.wait_for(k.update("u.k", removed_meanwhile), T)
    assert (got.value, got.result) == (b"v", None) and await k.get("u.k", None) is None

    await k.put("u.target", "1")
    await k.symlink("u.link", "u.target")
    with pytest.raises(ErrnoError) as refused:
        await k.update("u.link", lambda old: b"2", retries=0)
    assert errnum(refused) == errno.EINVAL, refused.value

    await k.put("u.empty", b"")
    await k.put("u.x", "x")
    assert await k.get_str("u.empty", b"") == ""
    assert await k.get_str("u.x", b"x") == "x"
    assert await k.get_json("u.one", b"1") == b"1"  # (missing: the default, as given)
    await k.put("u.one", b"1")
    assert await k.get_json("u.one", b"1") == 1

    await k.put("pdir.in_primary", "1")
    await k.namespace_create("treens")
    n = KVS(k.handle, "treens")
    await n.put("pdir.in_treens", "2")
    await n.symlink("L", "pdir", "primary")
    root = await n.getroot()
    assert set(await k.get_tree("L", at=root)) == {"in_primary"}
    assert set(await n.get_tree("L", at=root)) == {"in_primary"}


async def test_wait_event_never_answers_from_a_job_name_used_before(start_instance,
                                                                   connect) -> None:
    """Jobs' names reused at once: rank 3's kvs-watch still followed the old
    namespace (a watch held it) when the new one was made, and a
    ``wait_event`` on rank 3 answered the old job's event until rank 3
    heard the removal (a probe: 7 in 120 tries).  It pings rank 0 first,
    whose answer comes down behind the removal: the event is always the
    new job's."""
    inst = await start_instance(size=4, fanout=1)  # (rank 3 three hops down)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    kvs0 = KVS(h0)

    async def one(name: str, i: int) -> None:
        job0, job3 = kvs0.with_namespace(name), KVS(h3, name)
        await kvs0.namespace_create(name, owner=os.getuid())
        await job0.append_event("eventlog", "start", {"run": -i})
        await behind_removals(h3)  # (a plain watch makes no barrier: the last run's name)
        async with job3.watch_eventlog("eventlog", waitcreate=True) as holder:
            assert (await asyncio.wait_for(anext(holder), T))["context"] == {"run": -i}
            await kvs0.namespace_remove(name)
            await kvs0.namespace_create(name, owner=os.getuid())
            await job0.append_event("eventlog", "start", {"run": i})
            got = await job3.wait_event("eventlog", "start", waitcreate=True, timeout=T)
            assert got["context"] == {"run": i}, (name, i, got)
        await kvs0.namespace_remove(name)

    for i in range(1, 31):
        await asyncio.gather(*(one(f"job-{k}", i) for k in range(4)))
