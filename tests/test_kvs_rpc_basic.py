"""The kvs module over raw RPCs on 1 and 4 ranks: puts, gets, flags, errnos, links.

Reference: flux-core t/t1000-kvs.t and src/modules/kvs/{kvs,lookup,kvstxn}.c.
"""

from __future__ import annotations

import asyncio
import errno

import pytest
from test_kvs_rpc_helpers import (
    APPEND,
    READDIR,
    READLINK,
    TREEOBJ,
    commit,
    dir_,
    errnum,
    get,
    getroot,
    lookup,
    put,
    symlink,
    unlink,
    val,
)

SIZES = pytest.mark.parametrize("size", [1, 4])


@SIZES
@pytest.mark.both_loops
async def test_put_on_last_rank_get_on_every_rank(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    hs = [await connect(inst, r) for r in range(size)]
    writer = hs[-1]
    resp = await commit(writer, put("test.a.b", "hello"), put("test.n", "42"))
    assert resp["rootseq"] == 1 and resp["rootref"].startswith("sha256-")
    # the writer's rank answered after applying the root: visible there at once
    assert await get(writer, "test.a.b") == b"hello"
    for h in hs:
        await asyncio.wait_for(
            h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 1}), 10)
        assert await get(h, "test.a.b") == b"hello"
        assert await get(h, "..test...n.") == b"42"  # normalised key
        assert (await getroot(h))["rootref"] == resp["rootref"]


@SIZES
async def test_read_your_writes(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h = await connect(inst, size - 1)
    for i in range(20):
        resp = await commit(h, put("ryw", str(i)))
        assert await get(h, "ryw") == str(i).encode()
        root = await getroot(h)
        assert root["rootseq"] >= resp["rootseq"]


@SIZES
async def test_lookup_flags_and_errnos(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    w = await connect(inst, 0)
    r = await connect(inst, size - 1)
    resp = await commit(w, put("d.v", "x"), put("d.sub.w", "y"),
                        put("d.link", symlink("d.v")), put("d.dlink", symlink("d.sub")))
    await asyncio.wait_for(r.rpc("kvs.wait-version", {"namespace": "primary",
                                                     "rootseq": resp["rootseq"]}), 10)
    # a directory read as a value, a value read as a directory
    assert await errnum(lookup(r, "d")) == errno.EISDIR
    assert await errnum(lookup(r, ".")) == errno.EISDIR
    assert await errnum(lookup(r, "d.v", READDIR)) == errno.ENOTDIR
    # readlink of a value / of a directory
    assert await errnum(lookup(r, "d.v", READLINK)) == errno.EINVAL
    assert await errnum(lookup(r, "d", READLINK)) == errno.EINVAL
    # a path through a value, a missing key
    assert await errnum(lookup(r, "d.v.x")) == errno.ENOENT
    assert await errnum(lookup(r, "d.nope")) == errno.ENOENT
    assert await errnum(lookup(r, "nope.deeper")) == errno.ENOENT
    # READDIR: entries as stored, not expanded
    listing = await lookup(r, "d", READDIR)
    assert listing["type"] == "dir"
    assert set(listing["data"]) == {"v", "sub", "link", "dlink"}
    assert listing["data"]["v"] == val("x")
    assert listing["data"]["sub"]["type"] == "dirref"
    root_listing = await lookup(r, ".", READDIR)
    assert set(root_listing["data"]) == {"d"}
    # TREEOBJ: the entry as stored; the final link is not followed
    assert await lookup(r, "d.v", TREEOBJ) == val("x")
    assert (await lookup(r, "d.sub", TREEOBJ))["type"] == "dirref"
    assert await lookup(r, "d.link", TREEOBJ) == symlink("d.v")
    root = await lookup(r, ".", TREEOBJ)
    assert root == {"ver": 1, "type": "dirref", "data": [(await getroot(r))["rootref"]]}
    # links: followed at the end unless READLINK, always in the middle
    assert await get(r, "d.link") == b"x"
    assert await lookup(r, "d.link", READLINK) == symlink("d.v")
    assert await get(r, "d.dlink.w") == b"y"
    assert set((await lookup(r, "d.dlink", READDIR))["data"]) == {"w"}
    assert await errnum(lookup(r, "d.dlink")) == errno.EISDIR


async def test_write_root_is_einval(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    for rank in (0, 3):
        h = await connect(inst, rank)
        for key in (".", "", "..."):
            assert await errnum(commit(h, put(key, "x"))) == errno.EINVAL
            assert await errnum(commit(h, unlink(key))) == errno.EINVAL
        assert (await getroot(h))["rootseq"] == 0


async def test_symlink_chains_and_eloop(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 2)
    ops = [put("target", "end")]
    # l0 -> l1 -> ... -> l9 -> target: 10 links, allowed
    for i in range(10):
        ops.append(put(f"l{i}", symlink(f"l{i + 1}" if i < 9 else "target")))
    # m0 -> l0: 11 links in the chain
    ops.append(put("m0", symlink("l0")))
    ops.append(put("self", symlink("self")))
    ops.append(put("a", symlink("b")))
    ops.append(put("b", symlink("a")))
    await commit(h, *ops)
    assert await get(h, "l0") == b"end"
    assert await errnum(lookup(h, "m0")) == errno.ELOOP
    assert await errnum(lookup(h, "self")) == errno.ELOOP
    assert await errnum(lookup(h, "a.x")) == errno.ELOOP
    assert await lookup(h, "self", READLINK) == symlink("self")
    # a dangling link is simply "no such key"
    await commit(h, put("dangling", symlink("no.where")))
    assert await errnum(lookup(h, "dangling")) == errno.ENOENT


@SIZES
async def test_cross_namespace_symlinks(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h0 = await connect(inst, 0)
    h = await connect(inst, size - 1)
    await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": "other", "owner": -1}),
                           10)
    await commit(h, put("in.other", "from-other"), ns="other")
    await commit(h, put("x", "from-primary"))
    await commit(h, put("ln1", symlink("other::in.other")),
                 put("ln2", symlink("in.other", "other")),
                 put("ln3", symlink("in", "other")),
                 put("ln4", symlink("other::.")))
    for rank in range(size):
        hr = h if rank == size - 1 else await connect(inst, rank)
        await asyncio.wait_for(
            hr.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 2}), 10)
        assert await get(hr, "ln1") == b"from-other"
        assert await get(hr, "ln2") == b"from-other"
        assert await get(hr, "ln3.other") == b"from-other"
        assert set((await lookup(hr, "ln4", READDIR))["data"]) == {"in"}
        assert await lookup(hr, "ln1", READLINK) == symlink("other::in.other")
    # a link back into primary from "other", written with the target-namespace form
    await commit(h, put("back", symlink("x", "primary")), ns="other")
    assert await get(h, "back", ns="other") == b"from-primary"
    # a link into a namespace that does not exist
    await commit(h, put("bad", symlink("nosuchns::k")))
    assert await errnum(lookup(h, "bad")) == errno.ENOTSUP


@SIZES
async def test_lookup_at_root(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h = await connect(inst, size - 1)
    first = await commit(h, put("k", "one"), put("d.e", "deep"))
    old = await lookup(h, ".", TREEOBJ)
    assert old["data"] == [first["rootref"]]
    await commit(h, put("k", "two"), unlink("d"))
    assert await get(h, "k") == b"two"
    assert await get(h, "k", rootdir=old) == b"one"
    assert await get(h, "d.e", rootdir=old) == b"deep"
    assert await errnum(lookup(h, "d.e")) == errno.ENOENT
    # a subdirectory's dirref works as a root too
    await commit(h, put("d.e", "again"))
    sub = await lookup(h, "d", TREEOBJ)
    assert await get(h, "e", rootdir=sub) == b"again"
    # lookup-plus reports the root it used
    plus = await asyncio.wait_for(h.rpc("kvs.lookup-plus", {
        "key": "k", "flags": 0, "namespace": "primary"}), 10)
    root = await getroot(h)
    assert plus["rootref"] == root["rootref"] and plus["rootseq"] == root["rootseq"]
    assert plus["val"] == val("two")
    missing = await asyncio.wait_for(h.rpc("kvs.lookup-plus", {
        "key": "missing", "flags": 0, "namespace": "primary"}), 10)
    assert missing["val"] is None  # ENOENT as data


@pytest.mark.both_loops  # asyncio's transports take big messages in pieces (framewriter)
@SIZES
async def test_big_values_round_trip(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    w = await connect(inst, size - 1)
    r = await connect(inst, size // 2)
    small = b"s" * 64
    medium = bytes(range(256)) * 4 + b"!"  # 1025 bytes
    mib = bytes(i * 7 % 251 for i in range(1 << 20))
    big = mib * 16
    resp = await commit(w, put("small", small), put("medium", medium), put("mib", mib),
                        put("big", big), timeout=60)
    await asyncio.wait_for(r.rpc("kvs.wait-version", {"namespace": "primary",
                                                     "rootseq": resp["rootseq"]}), 10)
    assert await lookup(r, "small", TREEOBJ) == val(small)  # <= 64 bytes stays inline
    for key, data in (("medium", medium), ("mib", mib), ("big", big)):
        obj = await lookup(r, key, TREEOBJ)
        assert obj["type"] == "valref", key
        assert await get(r, key, timeout=60) == data
    # 65 bytes is already a blob
    await commit(w, put("x65", b"z" * 65))
    assert (await lookup(w, "x65", TREEOBJ))["type"] == "valref"


@SIZES
async def test_append(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h = await connect(inst, size - 1)
    await commit(h, put("log", "a", APPEND))  # missing key: created
    await commit(h, put("log", "b", APPEND))  # val -> valref of both
    await commit(h, put("log", "c" * 100, APPEND))
    assert await get(h, "log") == b"ab" + b"c" * 100
    obj = await lookup(h, "log", TREEOBJ)
    assert obj["type"] == "valref" and len(obj["data"]) == 3
    # several appends in one transaction, in order
    await commit(h, put("log2", "1", APPEND), put("log2", "2", APPEND),
                 put("log2", "3", APPEND))
    assert await get(h, "log2") == b"123"
    # append to a directory / a symlink
    await commit(h, put("dir.x", "1"), put("lnk", symlink("log")))
    assert await errnum(commit(h, put("dir", "z", APPEND))) == errno.EISDIR
    assert await errnum(commit(h, put("lnk", "z", APPEND))) == errno.EOPNOTSUPP
    # append needs a val dirent: a null one too (it removed the key)
    assert await errnum(commit(h, put("log", dir_(), APPEND))) == errno.EPROTO
    assert await errnum(commit(h, {"key": "log", "flags": APPEND, "dirent": None})) \
        == errno.EPROTO
    reader = await connect(inst, 0)
    assert await get(reader, "log") == b"ab" + b"c" * 100


@SIZES
async def test_empty_dir_and_unlink(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h = await connect(inst, size - 1)
    await commit(h, put("empty", dir_()))
    assert (await lookup(h, "empty", READDIR))["data"] == {}
    assert (await lookup(h, "empty", TREEOBJ))["type"] == "dirref"
    assert await errnum(lookup(h, "empty")) == errno.EISDIR
    # unlink of a missing key (and below a missing dir, below a value) succeeds
    before = (await getroot(h))["rootseq"]
    resp = await commit(h, unlink("never.was"), unlink("empty.x"))
    assert resp["rootseq"] == before + 1
    await commit(h, put("v", "1"))
    await commit(h, unlink("v.below"))
    assert await get(h, "v") == b"1"
    # unlink a value, a directory with content, a link (not its target)
    await commit(h, put("t.a", "1"), put("t.b.c", "2"), put("lnk", symlink("v")))
    await commit(h, unlink("t"), unlink("lnk"))
    assert await errnum(lookup(h, "t.a")) == errno.ENOENT
    assert await errnum(lookup(h, "lnk", READLINK)) == errno.ENOENT
    assert await get(h, "v") == b"1"
    # a put replaces a directory with a value and vice versa
    await commit(h, put("p.q", "1"))
    await commit(h, put("p", "now-a-value"))
    assert await get(h, "p") == b"now-a-value"
    await commit(h, put("p.r", "dir-again"))
    assert await get(h, "p.r") == b"dir-again"
    # a dir dirent with content, written whole
    await commit(h, put("whole", dir_({"a": val("1"), "b": dir_({"c": val("2")})})))
    assert await get(h, "whole.b.c") == b"2"
    assert (await lookup(h, "whole.b", TREEOBJ))["type"] == "dirref"


@SIZES
async def test_snapshots_copies_and_links(start_instance, connect, size) -> None:
    """t1000 'put --treeobj' snapshots, 'link' corner cases and t1009 copies,
    expressed as TREEOBJ lookups and dirent commits."""
    inst = await start_instance(size=size, fanout=2)
    h = await connect(inst, size - 1)
    h0 = await connect(inst, 0)
    await commit(h, put("dir.a.a", "hello"), put("dir.a.b", "goodbye"),
                 put("dir.a.big", b"B" * 500), put("dir.a.lnk", symlink("dir.a.a")),
                 put("empty", ""))
    assert await get(h, "empty") == b""
    # snapshot of the root (a dirref put under a key), and of a subdirectory
    root = await lookup(h, ".", TREEOBJ)
    await commit(h, put("snap", root), put("dir.b", await lookup(h, "dir.a", TREEOBJ)))
    assert await lookup(h, "snap", TREEOBJ) == root
    assert await get(h, "snap.dir.a.a") == b"hello"
    assert await get(h, "dir.b.b") == b"goodbye"
    assert await get(h, "dir.b.big") == b"B" * 500
    # a copy keeps links as links (copy does not follow them)
    assert await lookup(h, "dir.b.lnk", READLINK) == symlink("dir.a.a")
    # the copy is independent of the original
    await commit(h, put("dir.b.a", "changed"))
    assert await get(h, "dir.a.a") == b"hello"
    # a treeobj put clobbers the destination
    await commit(h, put("dir.v", "42"))
    await commit(h, put("dir.v", root))
    assert await errnum(lookup(h, "dir.v")) == errno.EISDIR
    # intermediate links are followed by put; the link itself stays
    await commit(h, put("real", dir_()), put("via", symlink("real")))
    await commit(h, put("via.X", "42"))
    assert await lookup(h, "via", READLINK) == symlink("real")
    assert await get(h, "real.X") == b"42"
    assert await get(h, "via.X") == b"42"
    # links to nowhere, to an unknown namespace, in a cycle: all unlinkable
    await commit(h, put("l1", symlink("invalid")), put("l2", symlink("x", "nosuchns")),
                 put("c1", symlink("c2")), put("c2", symlink("c1")))
    await commit(h, unlink("l1"), unlink("l2"), unlink("c1"), unlink("c2"))
    names = set((await lookup(h, ".", READDIR))["data"])
    assert not names & {"l1", "l2", "c1", "c2"}
    # copy across namespaces (t1009): a dirref and a valref from primary
    await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": "dst", "owner": -1}),
                           10)
    obj = await lookup(h, "dir.a", TREEOBJ)
    big = await lookup(h, "dir.a.big", TREEOBJ)
    await commit(h, put("copy", obj), put("bigcopy", big), ns="dst")
    assert await get(h, "copy.b", ns="dst") == b"goodbye"
    assert await get(h, "bigcopy", ns="dst") == b"B" * 500
    # move = copy + unlink in one transaction
    await commit(h, put("moved", await lookup(h, "dir.b", TREEOBJ)), unlink("dir.b"))
    assert await get(h, "moved.a") == b"changed"
    assert await errnum(lookup(h, "dir.b")) == errno.ENOENT
