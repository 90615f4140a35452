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
    unlink,
    wait_watchers,
    watch_stream,
)

from broker.errors import ErrnoError, RemoteError
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
