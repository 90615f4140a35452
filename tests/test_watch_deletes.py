"""Watches that survive deletes (``deletes=True``, flag ``WATCH_DELETES``, a
kvbroker extension): a removal is answered (``val: null``; a
``WatchEntry`` with ``removed`` set; ``KEY (removed)`` from the CLI) and the
watch goes on, waiting for the key to come back -- as etcd's DELETE event --
where a plain watch ends ``ENOENT`` (Flux's t1007 "terminated by key
removal", still the default).
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest
from test_watch_cli import run, spawn
from test_watch_helpers import (
    APPEND,
    UNIQ,
    WAITCREATE,
    WATCH,
    answer,
    append,
    commit,
    end_errnum,
    errnum,
    ns_create,
    ns_remove,
    put,
    stats,
    unlink,
    value,
    wait_watchers,
    watch_stream,
)

from broker.errors import ErrnoError, RemoteError
from kvs import treeobj
from kvs.client import KVS, TxnOps
from kvs_watch import flags as F

T = 10.0
DELETES = 1 << 17


async def test_a_deletes_watch_sees_value_removal_and_new_value_where_a_plain_one_ends(
        start_instance, connect) -> None:
    """Leader election's watch on rank 3: the holder's value, its release,
    the next holder's value, in commit order and without ENOENT; a plain
    watch of the same key (sharing its lookups) still ends ENOENT at the
    release, as Flux's."""
    inst = await start_instance(size=4, fanout=2)
    kvs0, kvs3 = KVS(await connect(inst, 0)), KVS(await connect(inst, 3))
    first = await kvs0.put("lock", "alice")
    await kvs3.wait_version(first.rootseq, timeout=T)
    async with kvs3.watch("lock", deletes=True) as w, kvs3.watch("lock") as plain:
        e = await asyncio.wait_for(anext(w), T)
        assert (e.value, e.removed, e.rootseq) == (b"alice", False, first.rootseq)
        assert (await asyncio.wait_for(anext(plain), T)).value == b"alice"

        gone = await kvs0.commit(TxnOps().unlink("lock"))
        e = await asyncio.wait_for(anext(w), T)
        assert e.removed and e.value is None and e.treeobj is None
        assert (e.key, e.rootseq, e.namespace) == ("lock", gone.rootseq, "primary")
        with pytest.raises(RemoteError) as exc:
            await asyncio.wait_for(anext(plain), T)
        assert exc.value.errnum == errno.ENOENT

        # a commit naming the key that leaves it missing is no second removal
        await kvs0.commit(TxnOps().unlink("lock"))
        again = await kvs0.put("lock", "bob")
        e = await asyncio.wait_for(anext(w), T)
        assert (e.value, e.removed, e.rootseq) == (b"bob", False, again.rootseq)


async def test_deletes_with_waitcreate_uniq_append_and_a_namespace_removal(
        start_instance, connect) -> None:
    """How DELETES combines with the other modes (raw protocol, watched on
    rank 1, committed on rank 0)."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)

    # missing at the start: answered as missing at once; then the value
    s = watch_stream(h1, "a", WATCH | DELETES)
    p = await answer(s)
    assert p is not None and p["val"] is None and p["namespace"] == "primary"
    await commit(h0, put("a", "1"))
    p = await answer(s)
    assert p is not None and p["val"]["data"] == b"1"

    # with WAITCREATE, a missing key is waited for silently, before and after
    w = watch_stream(h1, "b", WATCH | WAITCREATE | DELETES)
    await wait_watchers(h0, 2, nodeid=1)
    await commit(h0, unlink("b"))  # still missing: no answer
    await commit(h0, put("b", "x"))
    p = await answer(w)
    assert p is not None and p["val"]["data"] == b"x"
    await commit(h0, unlink("b"))
    p = await answer(w)
    assert p is not None and p["val"] is None

    # UNIQ: the same value written again after a removal is a change
    u = watch_stream(h1, "a", WATCH | UNIQ | DELETES)
    p = await answer(u)
    assert p is not None and p["val"]["data"] == b"1"
    await commit(h0, put("a", "1"))  # unchanged: not answered (UNIQ)
    await commit(h0, unlink("a"))
    await commit(h0, put("a", "1"))
    got = [await answer(u), await answer(u)]
    assert [g["val"] and g["val"]["data"] for g in got if g is not None] == [None, b"1"]

    # APPEND: an eventlog removed and begun again comes whole, not EINVAL
    # ("value shortened") as its blobs were counted against the old one's
    await commit(h0, put("log", "a\n"))
    await commit(h0, append("log", "b\n"), sync=(h0, 1))
    lg = watch_stream(h1, "log", WATCH | APPEND | DELETES)
    assert [(await answer(lg) or {})["val"]["data"] for _ in range(2)] == [b"a\n", b"b\n"]
    await commit(h0, unlink("log"))
    await commit(h0, append("log", "c\n"))
    await commit(h0, append("log", "d\n"))
    got = [await answer(lg) for _ in range(3)]
    assert [g["val"] and g["val"]["data"] for g in got if g is not None] == [
        None, b"c\n", b"d\n"]

    # removing the namespace still ends the watch (ENOTSUP)
    await ns_create(h0, "job-1")
    await commit(h0, put("k", "v"), ns="job-1", sync=(h0, 1))
    n = watch_stream(h1, "k", WATCH | DELETES, ns="job-1")
    p = await answer(n)
    assert p is not None and p["val"]["data"] == b"v"
    await ns_remove(h0, "job-1")
    assert await end_errnum(n) == errno.ENOTSUP

    # DELETES needs WATCH, and means nothing to a key watch
    assert await errnum(answer(watch_stream(h1, "a", DELETES))) == errno.EINVAL
    for bad in (DELETES, WATCH | F.WATCH_KEYS | DELETES):
        with pytest.raises(ErrnoError):
            F.check(bad, streaming=True)
    assert F.DELETES == F.WATCH_DELETES == DELETES


async def test_kvs_get_watch_deletes_prints_the_removal_and_goes_on(start_instance,
                                                                    connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    await commit(h0, put("lock", "alice"), sync=(h0, 3))
    p = await spawn(inst.uri(3), "kvs", "get", "--watch", "--deletes", "-c", "3", "lock")
    try:
        assert p.stdout is not None
        # its first value printed: the watch has read its first root
        assert await asyncio.wait_for(p.stdout.readline(), T) == b"alice\n"
        await commit(h0, unlink("lock"))
        await commit(h0, put("lock", "bob"))
        out, err = await asyncio.wait_for(p.communicate(), 20)
    finally:
        if p.returncode is None:
            p.kill()
            await p.wait()
    assert (p.returncode, out.decode(), err.decode()) == (
        0, "lock (removed)\nbob\n", "")
    rc, _, err2 = await run(inst.uri(0), "kvs", "get", "--deletes", "lock")
    assert rc == 2 and "--deletes needs --watch" in err2


# ---------------------------------------------------------------- ancestors
# A commit that unlinks or replaces a directory above the watched key removes
# the key without naming it (its setroot lists the directory's key only).  A
# DELETES watcher is concerned by it, as etcd's range delete emits a DELETE
# for every key in the range; a plain watcher is not, as in Flux (FULL only).


async def _watch_abc(h0: Any, h1: Any) -> Any:
    """``a.b.c`` = ``1``, watched with DELETES on rank 1: its first answer read."""
    await commit(h0, put("a.b.c", "1"), sync=(h0, 1))
    s = watch_stream(h1, "a.b.c", WATCH | DELETES)
    p = await answer(s)
    assert p is not None and p["val"]["data"] == b"1"
    return s


async def test_deletes_watch_sees_an_ancestor_unlinked_then_the_key_recreated(
        start_instance, connect) -> None:
    """``kvs unlink -R a.b`` while ``a.b.c`` is watched: the deletion answer
    at that version; the key written again: its value -- two answers, in
    commit order.  A plain watcher of the key on the same rank goes on
    unaware, as in Flux, and sees the new value only."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    s = await _watch_abc(h0, h1)
    plain = watch_stream(h1, "a.b.c", WATCH)
    assert await value(plain) == b"1"

    gone = await commit(h0, unlink("a.b"))
    p = await answer(s)
    assert p == {"val": None, "rootseq": gone["rootseq"], "namespace": "primary"}
    back = await commit(h0, put("a.b.c", "2"))
    p = await answer(s)
    assert p is not None and (p["val"]["data"], p["rootseq"]) == (b"2", back["rootseq"])
    p = await answer(plain)
    assert p is not None and (p["val"]["data"], p["rootseq"]) == (b"2", back["rootseq"])

    # the grandparent too, through the Python API
    async with KVS(h1).watch("a.b.c", deletes=True) as w:
        assert (await asyncio.wait_for(anext(w), T)).value == b"2"
        gone = await commit(h0, unlink("a"))
        e = await asyncio.wait_for(anext(w), T)
        assert e.removed and (e.key, e.rootseq) == ("a.b.c", gone["rootseq"])


async def test_deletes_watch_sees_an_ancestor_replaced(start_instance, connect) -> None:
    """``a.b`` replaced by a value, then by a directory holding the key
    again, then by an empty directory, then by a symlink to where the key
    is missing: each version is answered as a removal or the key's value;
    a symlink on the path retargeted is such an ancestor too.  A removal
    made at a link's target, which names the target and not the path the
    watcher reads through, is not seen (docs/protocol.md)."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    s = await _watch_abc(h0, h1)

    r = await commit(h0, put("a.b", "1"))
    assert await answer(s) == {"val": None, "rootseq": r["rootseq"], "namespace": "primary"}
    r = await commit(h0, put("a.b", treeobj.dir_({"c": treeobj.val(b"3")})))
    p = await answer(s)
    assert p is not None and (p["val"]["data"], p["rootseq"]) == (b"3", r["rootseq"])
    r = await commit(h0, {"key": "a.b", "flags": 0, "dirent": treeobj.dir_()})
    assert await answer(s) == {"val": None, "rootseq": r["rootseq"], "namespace": "primary"}

    # a.b -> x, where x.c is: the key has a value again, read through the link
    await commit(h0, put("x.c", "4"))
    r = await commit(h0, put("a.b", treeobj.symlink("x")))
    p = await answer(s)
    assert p is not None and (p["val"]["data"], p["rootseq"]) == (b"4", r["rootseq"])
    await commit(h0, unlink("x"))  # at the target: names x, not seen
    r = await commit(h0, put("a.b", treeobj.symlink("y")))  # retargeted: seen
    assert await answer(s) == {"val": None, "rootseq": r["rootseq"], "namespace": "primary"}


async def test_deletes_watch_ignores_commits_that_do_not_name_an_ancestor(
        start_instance, connect) -> None:
    """Keys beside the watched one, or sharing a prefix with a directory
    above it without being that directory, neither answer nor cost the
    watcher a lookup: the next answer is the removal that follows them,
    and that removal is the only lookup they and it cost."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    s = await _watch_abc(h0, h1)
    before = (await stats(h1, nodeid=1))["counts"]["lookups"]
    for key in ("a.b.d", "a.bc", "a.b.cd", "ab", "a.x.c", "z"):
        await commit(h0, put(key, "v"))
    await commit(h0, unlink("a.bc"))
    gone = await commit(h0, unlink("a.b"))
    assert await answer(s) == {"val": None, "rootseq": gone["rootseq"],
                               "namespace": "primary"}
    assert (await stats(h1, nodeid=1))["counts"]["lookups"] == before + 1
