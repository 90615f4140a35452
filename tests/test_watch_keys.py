"""Key watches (``WATCH_KEYS``, a kvbroker extension): the keys each commit
writes at or below a key, as etcd's prefix watch, on a 4-rank instance.

See docs/protocol.md, kvs-watch, and docs/kvs.md, "Watching what changes
below a key".
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from test_kvs_rpc_helpers import symlink
from test_watch_cli import run, spawn
from test_watch_helpers import (
    NO_MERGE,
    commit,
    end_errnum,
    ns_create,
    ns_remove,
    put,
    run_guest,
    stats,
    unlink,
    wait_until,
    wait_watchers,
)

from broker.errors import RemoteError
from kvs.client import KVS
from kvs_watch import flags as F
from kvs_watch.client import KeyChanges, watch_keys

T = 10.0


async def _next(w) -> KeyChanges:
    return await asyncio.wait_for(w.__anext__(), T)


async def test_list_then_watch_misses_nothing(start_instance, connect) -> None:
    """The first answer names the root the watch starts at; reading the
    keys there, then applying each answer, gives the state after every
    commit -- whatever rank writes, whatever the watcher's rank."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h0, put("jobs.1.state", "run"), put("other", "x"))
    kvs3 = KVS(h3)
    async with watch_keys(h3, "jobs") as w:
        first = await _next(w)
        assert first.initial and first.keys == () and first.prefix == "jobs"
        root = await asyncio.wait_for(kvs3.getroot(), T)
        assert (first.rootseq, first.rootref) == (root.rootseq, root.rootref)
        async with asyncio.timeout(T):
            state = {k: await kvs3.get(k, at=first.rootref) async for k, _ in _walk(kvs3, first)}
        assert state == {"jobs.1.state": b"run"}

        r1 = await commit(h0, put("jobs.2.state", "new"), put("other", "y"), flags=NO_MERGE)
        r2 = await commit(h0, put("other", "z"), flags=NO_MERGE)  # not below jobs
        r3 = await commit(h0, put("jobs.1.state", "done"), unlink("jobs.2"), flags=NO_MERGE)
        got = [await _next(w) for _ in range(2)]
        assert [(c.rootseq, c.rootref, c.keys) for c in got] == [
            (r1["rootseq"], r1["rootref"], ("jobs.2.state",)),
            (r3["rootseq"], r3["rootref"], ("jobs.1.state", "jobs.2"))]
        assert r2["rootseq"] == r1["rootseq"] + 1
        for c in got:
            for k in c.keys:
                try:
                    state[k] = await asyncio.wait_for(kvs3.get(k, at=c.rootref), T)
                except RemoteError as exc:
                    assert exc.errnum in (errno.ENOENT, errno.EISDIR)
                    state = {s: v for s, v in state.items() if s != k
                             and not s.startswith(k + ".")}
        assert state == {"jobs.1.state": b"done"}

        # a directory above the prefix replaced: everything below may have changed
        r4 = await commit(h0, put("jobs", "flat now"))
        c = await _next(w)
        assert (c.rootseq, c.keys) == (r4["rootseq"], ("jobs",))
    assert (await stats(h0, 3))["watchers"] == 0  # leaving the block cancelled it


async def _walk(kvs: KVS, first: KeyChanges):
    try:
        d = await kvs.dir(first.prefix, at=first.rootref)
    except RemoteError:
        return
    async for k, entry in d.walk():
        yield k, entry


async def test_key_watch_looks_nothing_up_and_shares_the_monitor(start_instance,
                                                                 connect) -> None:
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    watches = [watch_keys(h1, "."), watch_keys(h1, "a"), watch_keys(h1, "a.b.c")]
    for w in watches:
        w.watch.start()
        assert (await _next(w)).initial
    before = (await stats(h0, 1))["counts"]["lookups"]
    for i in range(20):
        await commit(h0, put(f"a.b.k{i}", str(i)), flags=NO_MERGE)
    await commit(h0, put("a.b.c.d", "deep"), flags=NO_MERGE)
    every, a = [await _next(watches[0]) for _ in range(21)], [await _next(watches[1])
                                                               for _ in range(21)]
    assert [c.keys for c in every] == [c.keys for c in a]
    c = await _next(watches[2])
    assert c.keys == ("a.b.c.d",) and c.rootseq == every[-1].rootseq
    st = await stats(h0, 1)
    assert st["counts"]["lookups"] == before and st["namespace-count"] == 1
    assert st["watchers"] == 3
    for w in watches:
        await asyncio.wait_for(w.cancel(), T)
    await wait_watchers(h0, 0, nodeid=1)


async def test_key_watch_namespaces(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    w = watch_keys(h1, ".", namespace="later", waitcreate=True)
    w.watch.start()
    await wait_watchers(h0, 1, nodeid=1)
    await ns_create(h0, "later")
    first = await _next(w)
    assert first.initial and first.namespace == "later" and first.rootseq == 0
    await commit(h0, put("x", "1"), ns="later")
    assert (await _next(w)).keys == ("x",)
    await ns_remove(h0, "later")
    with pytest.raises(RemoteError) as info:
        await _next(w)
    assert info.value.errnum == errno.ENOTSUP
    with pytest.raises(RemoteError) as info:  # without waitcreate: at once
        await _next(watch_keys(h1, ".", namespace="nope"))
    assert info.value.errnum == errno.ENOTSUP
    # flags that ask for values are refused before anything is sent
    s = h1.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "a",
                                           "flags": F.WATCH | F.WATCH_KEYS | F.UNIQ})
    assert await end_errnum(s) == errno.EINVAL


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guest")
async def test_guest_watches_keys_of_its_own_namespace_only(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "mine", owner=65534)
    out = await asyncio.to_thread(run_guest, inst.uri(1), f"""
        async def body(h):
            r = {{}}
            for ns in ("mine", "primary"):
                s = h.rpc_stream("kvs-watch.lookup", {{"namespace": ns, "key": ".",
                                                      "flags": {F.WATCH | F.WATCH_KEYS}}})
                try:
                    msg = await asyncio.wait_for(s.next_message(), 10)
                    r[ns] = msg.payload["keys"]
                except RemoteError as exc:
                    r[ns] = exc.errnum
            return r
    """)
    assert out == {"mine": [], "primary": errno.EPERM}


async def _started(h0, spawned) -> asyncio.subprocess.Process:
    """A ``watch-keys`` on rank 3 once it has its first answer: a commit made
    while rank 3 still learns the namespace's root may become that root
    (its keys then are the start, not a change), as for any watch."""
    before = (await stats(h0, 3))["counts"]["answers"]
    p = await spawned

    async def answered() -> bool:
        return (await stats(h0, 3))["counts"]["answers"] > before
    await wait_until(answered, T, "the first answer of watch-keys")
    return p


async def _finish(p: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """Its output once it exits; killed (and reaped) if it does not."""
    try:
        return await asyncio.wait_for(p.communicate(), 20)
    except TimeoutError:
        p.kill()
        await p.wait()
        raise


async def test_kvs_watch_keys_since_catches_up_first(start_instance, connect) -> None:
    """``watch-keys --since ROOT`` prints the keys changed since ROOT, at the
    version the watch starts at, then the commits after it."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    old = (await commit(h0, put("jobs.a", "1"), put("jobs.b", "2")))["rootref"]
    s = (await commit(h0, put("jobs.a", "9"), put("jobs.c", "3"), put("other", "x")))["rootseq"]
    await asyncio.wait_for(h3.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": s}),
                           T)  # (the watch starts at the version rank 3 has)
    p = await _started(h0, spawn(inst.uri(3), "kvs", "watch-keys", "-v", "--since", old,
                                 "-c", "1", "jobs"))
    await commit(h0, put("jobs.d", "4"))
    out, err = await _finish(p)
    assert (p.returncode, out.decode(), err) == (
        0, f"{s} jobs.a=9\n{s} jobs.c=3\n{s + 1} jobs.d=4\n", b"")
    rc, _, err = await run(inst.uri(3), "kvs", "watch-keys", "--since", "nonsense", "jobs")
    assert rc == 1 and "--since nonsense: Invalid argument" in err, err


async def test_kvs_watch_keys_cli(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    p = await _started(h0, spawn(inst.uri(3), "kvs", "watch-keys", "-v", "-c", "3", "jobs"))
    r1 = await commit(h0, put("jobs.a", "1"), put("other", "x"), flags=NO_MERGE)
    await commit(h0, put("other", "y"), flags=NO_MERGE)
    await commit(h0, put("jobs.b.c", "2"), put("jobs.a", "3"), flags=NO_MERGE)
    r4 = await commit(h0, unlink("jobs.a"), flags=NO_MERGE)
    out, err = await _finish(p)
    s = r1["rootseq"]
    assert (p.returncode, out.decode(), err) == (
        0, f"{s} jobs.a=1\n{s + 2} jobs.b.c=2\n{s + 2} jobs.a=3\n{r4['rootseq']} jobs.a "
           "(removed)\n", b"")
    rc, out, err = await run(inst.uri(3), "kvs", "watch-keys", "-N", "nope", "-c", "1")
    assert rc == 1 and "Operation not supported" in err
    # -v shows links (never followed: one may dangle, loop, or lead nowhere)
    # and a key it cannot read, and goes on
    p = await _started(h0, spawn(inst.uri(3), "kvs", "watch-keys", "-v", "-c", "2", "l"))
    r = await commit(h0, put("l.dangle", symlink("nothere")), put("l.cyc", symlink("l.cyc")),
                     put("l.far", symlink("x", "nonexist")), put("l.in", symlink("l.cyc.x")))
    await commit(h0, put("l.after", "1"))
    out, err = await _finish(p)
    s = r["rootseq"]
    assert (p.returncode, out.decode(), err) == (
        0, f"{s} l.dangle -> nothere\n{s} l.cyc -> l.cyc\n{s} l.far -> nonexist::x\n"
           f"{s} l.in -> l.cyc.x\n{s + 1} l.after=1\n", b""), err


async def test_a_key_watch_polled_with_timeouts_goes_on(start_instance, connect):
    """A timeout around anext (asyncio.wait_for(anext(w), t)) neither skips
    the wait for since_version nor ends a watch catching up with since=:
    the first skipped the wait on its retry (a version back: a commit
    reported twice), the second ended the watch with StopAsyncIteration
    when it landed in the catch-up diff (concurrency audit)."""
    import time

    from kvs.client import TxnOps

    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    kvs = KVS(h)
    await asyncio.wait_for(kvs.mkdir("d"), T)
    v = await asyncio.wait_for(kvs.version(), T)
    w = watch_keys(h, "d", since_version=v + 1)  # a version not reached: waits ~2 s
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(w.__anext__(), 0.3)
    first = await asyncio.wait_for(w.__anext__(), 10)
    assert time.monotonic() - t0 > 1.5  # (it waited for the version, as uncancelled)
    assert first.initial
    await asyncio.wait_for(w.cancel(), T)

    old = await asyncio.wait_for(kvs.getroot(), T)
    for i in range(5):
        t = TxnOps()
        for j in range(1000):
            t.put(f"d.k{i}_{j}", j)
        await asyncio.wait_for(kvs.commit(t), T)
    async with kvs.watch_keys("d", since=old) as kw:
        for attempt in range(40):  # polls that land anywhere, the diff included
            try:
                got = await asyncio.wait_for(kw.__anext__(), 0.001 * (attempt + 1))
                break
            except TimeoutError:
                continue
        else:
            got = await asyncio.wait_for(kw.__anext__(), 30)
        assert got.initial and sum(k.startswith("d.k") for k in got.keys) == 5000
