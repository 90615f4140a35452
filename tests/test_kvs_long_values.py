"""A value of many blobs (a long eventlog) is stored as a ``vtree``: chunks of
:data:`~kvs.treeobj.VTREE_CHUNK` blobrefs and a tail, so an append no longer
stores every line's blobref again in its directory (docs/protocol.md, Tree
objects).  Every reader still sees a ``valref`` of all the blobs.  Real
ranks; the stored form is read back from the content store."""

from __future__ import annotations

import asyncio
import errno
import tarfile

from test_broker_support import run_cli
from test_kvs_rpc_helpers import READDIR, TREEOBJ, errnum, getroot
from test_watch_append import take, take_bytes
from test_watch_helpers import append, commit, put

from broker.errors import RemoteError
from kvs import treeobj
from kvs.treeobj import VTREE_CHUNK
from kvs.txn import EXPECT
from kvs_watch.client import watch

N = 2 * VTREE_CHUNK + 44  # two whole chunks and a tail


def line(i: int) -> bytes:
    """An eventlog-like line long enough to be a blob of its own."""
    return b'{"timestamp":%d.5,"name":"output","context":{"data":"%06d"}}\n' % (i, i)


async def lookup(h, key: str, flags: int = 0, nodeid: int | None = None) -> dict:
    kw = {} if nodeid is None else {"nodeid": nodeid}
    return (await asyncio.wait_for(h.rpc("kvs.lookup", {
        "key": key, "flags": flags, "namespace": "primary"}, **kw), 10))["val"]


async def stored_entry(h, directory: str, name: str) -> dict:
    """Entry ``name`` as its directory's blob holds it (not as a lookup shows it)."""
    ref = (await lookup(h, directory, TREEOBJ))["data"][0]
    blob = await asyncio.wait_for(h.rpc("content.load", {"blobref": ref}), 10)
    return treeobj.decode(blob["data"])["data"][name]


async def append_lines(h, key: str, first: int, last: int) -> dict:
    r: dict = {}
    for i in range(first, last):
        r = await commit(h, put(key, line(i)) if i == 0 else append(key, line(i)))
    return r


async def test_a_long_value_is_chunked_and_read_whole_on_every_rank(start_instance,
                                                                    connect) -> None:
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    whole = b"".join(line(i) for i in range(N))
    await append_lines(h0, "job.eventlog", 0, VTREE_CHUNK - 1)
    assert (await stored_entry(h0, "job", "eventlog"))["type"] == "valref"  # still short
    r = await append_lines(h0, "job.eventlog", VTREE_CHUNK - 1, N)
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                        "rootseq": r["rootseq"]}), 10)

    stored = await stored_entry(h0, "job", "eventlog")
    assert stored["type"] == "vtree"
    assert len(stored["data"]["chunks"]) == 2 and len(stored["data"]["tail"]) == 44
    for h in (h0, h1):  # every reader: the value, and a valref of every blob
        assert (await lookup(h, "job.eventlog"))["data"] == whole
        shown = await lookup(h, "job.eventlog", TREEOBJ)
        assert shown["type"] == "valref" and len(shown["data"]) == N
        listed = (await lookup(h, "job", READDIR))["data"]["eventlog"]
        assert listed == shown
    # a chunk is a valref of its lines' blobs, in order
    chunk = await asyncio.wait_for(h1.rpc("content.load", {
        "blobref": stored["data"]["chunks"][1]}), 10)
    assert treeobj.decode(chunk["data"])["data"] == shown["data"][VTREE_CHUNK:2 * VTREE_CHUNK]

    # conditions read the whole value; a copy is a value like any other
    await commit(h0, {"key": "job.eventlog", "flags": EXPECT, "dirent": treeobj.val(whole)},
                 put("job.checked", "yes"))
    assert await errnum(commit(h0, {"key": "job.eventlog", "flags": EXPECT,
                                    "dirent": treeobj.val(whole[:-1])})) == errno.ECANCELED
    await commit(h0, put("copy", shown))  # a valref given back: stored chunked again
    assert await stored_entry(h0, ".", "copy") == stored
    assert (await lookup(h1, "copy"))["data"] == whole


async def test_a_client_cannot_write_a_vtree(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await append_lines(h, "log", 0, VTREE_CHUNK)
    stored = await stored_entry(h, ".", "log")
    assert stored["type"] == "vtree"
    for dirent in (stored, treeobj.dir_({"inside": stored})):  # (a client sees valrefs)
        assert await errnum(commit(h, put("mine", dirent))) == errno.EINVAL
    await commit(h, put("after", "1"))  # and it goes on serving
    assert (await lookup(h, "after"))["data"] == b"1"
    assert (await lookup(h, "log"))["data"] == b"".join(line(i) for i in range(VTREE_CHUNK))


async def test_an_append_watch_follows_a_long_value_across_its_chunks(start_instance,
                                                                      connect) -> None:
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    r = await append_lines(h0, "log", 0, 100)
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                        "rootseq": r["rootseq"]}), 10)
    async with watch(h1, "log", append=True) as w:
        assert await take(w, 100) == [line(i) for i in range(100)]
        await append_lines(h0, "log", 100, N)  # past two chunk boundaries
        assert await take(w, N - 100) == [line(i) for i in range(100, N)]


async def test_a_long_value_survives_a_restart_a_collection_and_an_offline_dump(
        start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    inst = await start_instance(size=2, statedir=str(statedir))
    h = await connect(inst, 1)
    await append_lines(h, "log", 0, N)
    await h.close()
    assert await inst.stop() == [0, 0]
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 0, err
    rc, out, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(statedir),
                                 str(tmp_path / "dump.tar"))
    assert rc == 0, err
    with tarfile.open(tmp_path / "dump.tar") as tar:
        f = tar.extractfile("log")
        assert f is not None and f.read() == b"".join(line(i) for i in range(N))

    inst2 = await start_instance(size=2, statedir=str(statedir))
    h2 = await connect(inst2, 1)
    assert (await lookup(h2, "log"))["data"] == b"".join(line(i) for i in range(N))
    await append_lines(h2, "log", N, N + VTREE_CHUNK)  # and it grows on
    assert (await lookup(h2, "log"))["data"] == b"".join(line(i) for i in range(N + VTREE_CHUNK))
    assert (await getroot(h2))["rootseq"] > 0


async def test_a_damaged_vtree_is_a_clear_error_and_the_rank_serves_on(start_instance,
                                                                       connect) -> None:
    """A directory blob written by hand (the instance owner may store blobs)
    whose vtree names a chunk that is not one: every read of it says so
    (``ENOTRECOVERABLE``, naming the chunk), one that is not a tree object
    is refused at the commit, and the rank goes on serving."""
    inst = await start_instance(size=2)
    h = await connect(inst, 1)

    async def store(data: bytes) -> str:
        return (await asyncio.wait_for(h.rpc("content.store", {"data": data}), 10))["blobref"]

    lines = [await store(b"line %d\n" % i) for i in range(3)]
    short = await store(treeobj.encode(treeobj.valref(lines)))  # 3 blobrefs, not 128
    raw = await store(b"not a tree object")
    for name, chunk in (("short", short), ("raw", raw)):
        d = treeobj.encode(treeobj.dir_({"log": treeobj.vtree([chunk], lines[:1])}))
        op = put(name, treeobj.dirref(await store(d)))
        if name == "raw":
            assert await errnum(commit(h, op)) == errno.EPROTO
            continue
        await commit(h, op)
        for key, flags in (("short.log", 0), ("short.log", TREEOBJ), ("short", READDIR)):
            try:
                await lookup(h, key, flags)
            except RemoteError as exc:
                assert exc.errnum == errno.ENOTRECOVERABLE and short in exc.errstr
            else:
                raise AssertionError(f"{key} read")
    await commit(h, put("after", "1"))
    assert (await lookup(h, "after"))["data"] == b"1"


async def test_a_lookup_after_sends_only_the_blobs_after_those_marked(start_instance,
                                                                     connect) -> None:
    """``after`` and ``mark`` (what an APPEND watcher asks with): a follower
    answers the blobrefs after the first ``after`` only, with the mark of
    all of them, when the first ``after`` are those marked; else all of
    them, ``grown: false``.  Bad fields are refused; the rank serves on,
    and the watch on the follower asked with ``after`` (counted)."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    r = await append_lines(h0, "log", 0, N)
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                        "rootseq": r["rootseq"]}), 10)
    refs = (await lookup(h1, "log", TREEOBJ))["data"]
    stored = await stored_entry(h1, ".", "log")
    chunks, tail = stored["data"]["chunks"], stored["data"]["tail"]

    async def after(count: int, mark: bytes, **more) -> dict:
        return await asyncio.wait_for(h1.rpc("kvs.lookup-plus", {
            "key": "log", "flags": TREEOBJ, "namespace": "primary", "after": count,
            "mark": mark, **more}), 10)

    for count in (0, 100, VTREE_CHUNK, 200, N):
        k = count // VTREE_CHUNK
        got = await after(count, treeobj.refs_mark([], chunks[:k], refs[k * VTREE_CHUNK:count]))
        assert got["val"] == {"data": refs[count:], "type": "valref", "ver": 1}
        assert got["length"] == N and got["grown"] is True
        assert got["mark"] == treeobj.refs_mark([], chunks, tail)
    wrong = await after(200, treeobj.refs_mark([], chunks[:1], refs[129:201]))
    assert wrong["grown"] is False and wrong["val"]["data"] == refs
    assert (await after(N + 1, b"\0" * 16))["grown"] is False  # (more than it has)
    assert (await after(0, treeobj.refs_mark([], [], []), key="."))["val"]["type"] == "dirref"
    for bad, want in (({"after": 3}, errno.EPROTO), ({"mark": b"\0" * 16}, errno.EPROTO),
                      ({"after": -1, "mark": b"\0" * 16}, errno.EPROTO),
                      ({"after": 1, "mark": b"short"}, errno.EPROTO),
                      ({"after": 1, "mark": b"\0" * 16, "flags": 0}, errno.EINVAL)):
        assert await errnum(h1.rpc("kvs.lookup", {"key": "log", "flags": TREEOBJ,
                                                  "namespace": "primary", **bad})) == want

    before = (await h1.rpc("kvs.stats-get", {}))["counts"]["lookups-after"]
    async with watch(h1, "log", append=True) as w:
        assert await take(w, N) == [line(i) for i in range(N)]
        await append_lines(h0, "log", N, N + 3)
        assert await take(w, 3) == [line(i) for i in range(N, N + 3)]
    assert (await h1.rpc("kvs.stats-get", {}))["counts"]["lookups-after"] > before
    assert (await lookup(h1, "log"))["data"] == b"".join(line(i) for i in range(N + 3))


async def test_a_log_of_more_than_a_group_of_chunks_is_read_watched_and_collected(
        start_instance, connect, tmp_path) -> None:
    """A value of more than 16,384 blobs has an index of groups of 128
    chunks: a follower reads it whole and watches it grow across the next
    group's end, an online and an offline ``kvs gc`` keep every group,
    chunk and line, and a restart reads it on."""
    g = treeobj.VTREE_GROUP
    statedir = tmp_path / "state"
    inst = await start_instance(size=2, statedir=str(statedir), attrs={"kvs.gc-grace": "0"})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    lines = [b"line %06d\n" % i for i in range(2 * g - 3)]
    refs = []
    for i in range(0, len(lines), 4096):
        refs += (await asyncio.wait_for(h0.rpc("content.store", {"blobs": lines[i:i + 4096]}),
                                        30))["blobrefs"]
    r = await commit(h0, put("log", treeobj.valref(refs)))  # (a copy, a restore: written whole)
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                        "rootseq": r["rootseq"]}), 10)
    stored = await stored_entry(h1, ".", "log")
    index, chunks, tail = treeobj.vtree_parts(stored)
    assert len(index) == 1 and len(chunks) == 127 and len(tail) == 125
    assert (await lookup(h1, "log", TREEOBJ))["data"] == refs
    async with watch(h1, "log", append=True) as w:
        assert await take_bytes(w, len(b"".join(lines))) == b"".join(lines)
        more = [line(i) for i in range(6)]  # the second group fills at the third
        for ln in more:
            await commit(h0, append("log", ln))
        assert await take(w, len(more)) == more
    assert len(treeobj.vtree_parts(await stored_entry(h1, ".", "log"))[0]) == 2
    whole = b"".join(lines + more)
    await commit(h0, put("other", "x"))
    assert (await asyncio.wait_for(h0.rpc("kvs.gc", {}), 60))["removed"] >= 1
    assert (await lookup(h1, "log"))["data"] == whole
    await h0.close()
    await h1.close()
    assert await inst.stop() == [0, 0]
    rc, out, err = await run_cli("kvs", "gc", "--statedir", str(statedir))
    assert rc == 0, err
    inst2 = await start_instance(size=2, statedir=str(statedir))
    h = await connect(inst2, 1)
    assert (await lookup(h, "log"))["data"] == whole
