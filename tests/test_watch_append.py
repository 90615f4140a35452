"""APPEND, INITIAL_SENTINEL, STREAM and WAITCREATE, through the Python API
(:mod:`kvs_watch.client`) on a 4-rank instance.  Mirrors the append, stream
and sentinel sections of flux-core t/t1007 and the eventlog ones of t/t1008."""

from __future__ import annotations

import asyncio
import errno
import json
import time

import pytest
from test_watch_helpers import (
    NO_MERGE,
    WAITCREATE,
    append,
    commit,
    end_errnum,
    lookup,
    put,
    stats,
    unlink,
    value,
    wait_watchers,
    watch_stream,
)

from broker.errors import ErrnoError, RemoteError
from broker.sync import SyncHandle
from kvs_watch.client import (
    INITIAL_DONE,
    SyncWatch,
    WatchEntry,
    stream,
    wait_create,
    wait_event,
    watch,
    watch_eventlog,
)

LARGE = b"abcdefghijklmnopqrstuvwxyz" * 4  # stored as a valref


async def take(w, n: int, timeout: float = 10.0) -> list:
    """The next ``n`` items of a watch (values as bytes, INITIAL_DONE as is)."""
    out = []
    async with asyncio.timeout(timeout):
        for _ in range(n):
            e = await anext(w)
            out.append(e.value if isinstance(e, WatchEntry) else e)
    return out


async def take_bytes(w, size: int, timeout: float = 30.0) -> bytes:
    """The next ``size`` bytes an append watch reports, joined: however many
    entries carry them.  A reader more than its bound behind (the client's
    ``max_backlog``: a loaded machine, a long initial read) gets its unread
    answers folded into fewer entries, each byte once, in order, so a test
    of what is read counts bytes, not entries."""
    out = b""
    async with asyncio.timeout(timeout):
        while len(out) < size:
            e = await anext(w)
            assert isinstance(e, WatchEntry), e
            out += e.value
    return out


async def raises(w, timeout: float = 10.0) -> int:
    try:
        async with asyncio.timeout(timeout):
            e = await anext(w)
    except RemoteError as exc:
        return exc.errnum
    raise AssertionError(f"expected an error, got {e!r}")


@pytest.mark.both_loops
async def test_append_sends_only_new_chunks(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h0, put("test.small", "abc"), put("test.large", LARGE), sync=h3)
    assert (await lookup(h0, "test.large", 16))["type"] == "valref"
    async with watch(h3, "test.small", append=True) as ws, \
            watch(h3, "test.large", append=True) as wl:
        assert await take(ws, 1) == [b"abc"]
        assert await take(wl, 1) == [LARGE]
        for v in ("d", "e", ""):  # an empty append is an (empty) chunk
            await commit(h0, append("test.small", v), append("test.large", v))
        await commit(h0, append("test.small", "f"), append("test.small", "g"))  # one txn
        assert await take(ws, 5) == [b"d", b"e", b"", b"f", b"g"]
        assert await take(wl, 3) == [b"d", b"e", b""]
    await wait_watchers(h0, 0, nodeid=3)


async def test_a_blob_the_watcher_cannot_load_ends_the_watch_in_one_message(
        start_instance, connect):
    """An appended blob too big for the link ends an APPEND watch with its
    errno and the load's own message, without the '[EMSGSIZE]' a
    RemoteError's str now leads with (review)."""
    inst = await start_instance(size=2, attrs={"tbon.max-message": "65536"})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("test.log", "start"), sync=h1)
    async with watch(h1, "test.log", append=True) as w:
        assert await take(w, 1) == [b"start"]
        await commit(h0, append("test.log", b"x" * 100_000))
        with pytest.raises(RemoteError) as info:
            await take(w, 1)
    assert info.value.errnum == errno.EMSGSIZE
    assert info.value.errstr.startswith("test.log: cannot load a blob of the value: ")
    assert "[EMSGSIZE]" not in info.value.errstr, info.value.errstr


async def test_append_errors(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h2 = await connect(inst, 0), await connect(inst, 2)
    await commit(h0, put("t.dir.x", "1"), *(put(f"t.{k}", "abc") for k in "abcd"), sync=h2)
    async with watch(h2, "t.dir", append=True) as w:
        assert await raises(w) == errno.EISDIR
    ws = {k: watch(h2, f"t.{k}", append=True).start() for k in "abcd"}
    for w in ws.values():
        assert await take(w, 1) == [b"abc"]
    await commit(h0, *(append(f"t.{k}", "d") for k in "abcd"))
    for w in ws.values():
        assert await take(w, 1) == [b"d"]
    await commit(h0, unlink("t.a"), put("t.b.sub", "x"), put("t.c", "abcd"), put("t.d", LARGE))
    assert await raises(ws["a"]) == errno.ENOENT  # removed
    assert await raises(ws["b"]) == errno.EINVAL  # now a directory
    assert await raises(ws["c"]) == errno.EINVAL  # rewritten, not appended
    assert await raises(ws["d"]) == errno.EINVAL  # valref shortened
    async with watch(h2, "t.e", append=True, waitcreate=True) as w:
        await wait_watchers(h0, 1, nodeid=2)
        await commit(h0, put("t.e.f", "1"))  # created as a directory
        assert await raises(w) == errno.EISDIR
    assert (await stats(h0, 2))["watchers"] == 0
    # a rewrite that keeps the blob count and ends with the same blob (blobs
    # are named by content): [x, +] -> [y, +] was taken for "nothing new"
    await commit(h0, put("t.g", "x"), append("t.g", "+"), sync=h2)
    async with watch(h2, "t.g", append=True) as w:
        assert await take(w, 2) == [b"x", b"+"]  # one entry per blob
        await commit(h0, put("t.g", "y"), append("t.g", "+"))
        await commit(h0, append("t.g", "z"))
        assert await raises(w) == errno.EINVAL  # not b"z" on top of a gone "x+"


async def test_append_with_waitcreate_and_initial_sentinel(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("s.test1", "1"))
    await commit(h0, append("s.test1", "2"), sync=h1)
    async with watch(h1, "s.test1", append=True, initial_sentinel=True) as w:
        assert await take(w, 3) == [b"1", b"2", INITIAL_DONE]
        await commit(h0, append("s.test1", "42"))
        await commit(h0, append("s.test1", "43"))
        assert await take(w, 2) == [b"42", b"43"]
    async with watch(h1, "s.test2", append=True, initial_sentinel=True) as w:
        assert await raises(w) == errno.ENOENT
    async with watch(h1, "s.test2", append=True, initial_sentinel=True,
                     waitcreate=True) as w:
        assert await take(w, 1) == [INITIAL_DONE]  # nothing there yet
        await commit(h0, put("s.test2", "1"))
        await commit(h0, append("s.test2", "42"))
        assert await take(w, 2) == [b"1", b"42"]
    async with watch(h1, "s.test3", append=True, waitcreate=True) as w:
        await wait_watchers(h0, 1, nodeid=1)
        for v in ("abc", "d", "e"):
            await commit(h0, append("s.test3", v) if v != "abc" else put("s.test3", v))
        assert await take(w, 3) == [b"abc", b"d", b"e"]
    with pytest.raises(ErrnoError) as ei:
        watch(h1, "x", initial_sentinel=True)  # needs append, as in Flux
    assert ei.value.errnum == errno.EINVAL


async def test_stream_returns_a_value_in_chunks(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h0, put("st.a", "42"), put("st.empty", ""), put("st.d.x", "1"), sync=h3)
    for v in (b"event1\n", b"event2\n", b"event3\n"):
        await commit(h0, append("st.log", v), sync=h3)

    async def chunks(key: str, **kw) -> list[bytes | None]:
        async with asyncio.timeout(10), stream(h3, key, **kw) as s:
            return [e.value async for e in s if isinstance(e, WatchEntry)]

    assert await chunks("st.a") == [b"42"]
    assert await chunks("st.empty") == [b""]
    assert await chunks("st.log") == [b"event1\n", b"event2\n", b"event3\n"]
    with pytest.raises(RemoteError) as ei:
        await chunks("st.d")
    assert ei.value.errnum == errno.EISDIR
    with pytest.raises(RemoteError) as ei:
        await chunks("st.none")
    assert ei.value.errnum == errno.ENOENT
    waiting = asyncio.ensure_future(chunks("st.b", waitcreate=True))
    await wait_watchers(h0, 1, nodeid=3)
    await commit(h0, put("st.b", "43"))
    assert await asyncio.wait_for(waiting, 10) == [b"43"]
    waiting = asyncio.ensure_future(chunks("st.c", waitcreate=True, namespace="ns_stream"))
    await wait_watchers(h0, 1, nodeid=3, ns="ns_stream")
    await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": "ns_stream"}), 10)
    await commit(h0, put("st.c", "44"), ns="ns_stream")
    assert await asyncio.wait_for(waiting, 10) == [b"44"]


async def test_waitcreate_lookup_without_watch(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h2 = await connect(inst, 0), await connect(inst, 2)
    await commit(h0, put("w.exists", "1"))
    e = await asyncio.wait_for(wait_create(h2, "w.exists"), 10)
    assert (e.key, e.value, e.namespace) == ("w.exists", b"1", "primary")
    # non-streaming, as flux_kvs_lookup (WAITCREATE) sends it: one answer
    fut = h2.rpc("kvs-watch.lookup", {"namespace": "primary", "key": "w.later",
                                      "flags": WAITCREATE})
    later = asyncio.ensure_future(wait_create(h2, "w.later"))
    await wait_watchers(h0, 2, nodeid=2)
    await commit(h0, put("w.later", "2"))
    assert (await asyncio.wait_for(fut, 10))["val"]["data"] == b"2"
    assert (await asyncio.wait_for(later, 10)).value == b"2"
    await wait_watchers(h0, 0, nodeid=2)
    # cancelled by a timeout: the watcher goes away
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await wait_create(h2, "w.never")
    await wait_watchers(h0, 0, nodeid=2)
    # waitcreate + watch: wait, then follow; a key unlinked before it exists is waited past
    s = watch_stream(h2, "w.create_later", 4 | WAITCREATE)
    await wait_watchers(h0, 1, nodeid=2)
    await commit(h0, unlink("w.create_later"), flags=NO_MERGE)
    await commit(h0, put("w.create_later", "0"))
    assert await value(s) == b"0"
    await commit(h0, unlink("w.create_later"))
    assert await end_errnum(s) == errno.ENOENT


async def test_eventlog_watch_and_wait_event(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)

    def ev(ts: float, name: str, **ctx) -> bytes:
        e = {"timestamp": ts, "name": name, **({"context": ctx} if ctx else {})}
        return json.dumps(e, separators=(",", ":")).encode() + b"\n"

    await commit(h0, append("test.e", ev(1, "foo", data="bar")), sync=h3)
    async with watch_eventlog(h3, "test.e") as log:
        got = [await asyncio.wait_for(anext(log), 10)]
        for i in range(2, 21):
            await commit(h0, append("test.e", ev(i, "foo", data="bar")))
        async with asyncio.timeout(10):
            got += [await anext(log) for _ in range(19)]
    assert [e["timestamp"] for e in got] == [float(i) for i in range(1, 21)]
    assert got[0] == {"timestamp": 1.0, "name": "foo", "context": {"data": "bar"}}
    await commit(h0, append("test.w", ev(42, "foo")), append("test.w", ev(43, "bar")),
                 sync=h3)
    assert (await wait_event(h3, "test.w", "bar", timeout=10))["timestamp"] == 43.0
    with pytest.raises(TimeoutError, match=r"^test\.w: no event 'baz' within 0\.2 s$"):
        await wait_event(h3, "test.w", "baz", timeout=0.2)
    with pytest.raises(RemoteError):
        await wait_event(h3, "test.nolog", "foo", timeout=10)
    waiter = asyncio.ensure_future(wait_event(h3, "test.f", "foo", waitcreate=True, timeout=10))
    await wait_watchers(h0, 1, nodeid=3)
    await commit(h0, append("test.f", ev(1, "foo", data="bar")))
    assert (await waiter)["context"] == {"data": "bar"}
    await commit(h0, put("test.bad", "not an eventlog\n"), sync=h3)
    with pytest.raises(ValueError):
        await wait_event(h3, "test.bad", "foo", timeout=10)
    await wait_watchers(h0, 0, nodeid=3)


async def test_a_watch_dropped_without_cancel_is_cancelled(start_instance, connect):
    """``async for e in watch(h, k): break`` leaves no watcher on the broker
    and no answers piling up in the client: the watch is cancelled when it
    is garbage collected."""
    inst = await start_instance(size=2, fanout=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("test.dropped", "1"), sync=h1)
    async for entry in watch(h1, "test.dropped"):
        assert entry.value == b"1"
        break
    await wait_watchers(h0, 0, nodeid=1)
    await commit(h0, put("test.dropped", "2"), sync=h1)  # nobody reads this one
    async with asyncio.timeout(10):
        while h1.pending:
            await asyncio.sleep(0.005)


def test_sync_facade(tmp_path):
    """The blocking API drives a watch through SyncHandle.run."""
    from broker.launch import Instance
    from broker.loops import loop_factory

    async def start() -> Instance:
        inst = Instance(2, 2, stderr_path=str(tmp_path / "broker.log"))
        await asyncio.wait_for(inst.start(), 60)
        return inst

    with asyncio.Runner(loop_factory=loop_factory("asyncio")) as runner:
        inst = runner.run(start())
        try:
            with SyncHandle(inst.uri(1)) as sh:
                sh.run(commit(sh.aio, put("sync.k", "1")), timeout=10)
                with SyncWatch(sh, watch(sh.aio, "sync.k"), timeout=10) as w:
                    it = iter(w)
                    assert next(it).value == b"1"
                    sh.run(commit(sh.aio, put("sync.k", "2")), timeout=10)
                    assert next(it).value == b"2"
                assert sh.rpc("kvs-watch.stats-get", {}, timeout=10)["watchers"] == 0
                # dropped unfinished, here too it is cancelled, at once: this
                # handle's loop does not turn until its next call, so another
                # handle looks
                it = iter(SyncWatch(sh, watch(sh.aio, "sync.k"), timeout=10))
                assert next(it).value == b"2"
                del it
                with SyncHandle(inst.uri(1)) as other:
                    deadline = time.monotonic() + 10
                    while other.rpc("kvs-watch.stats-get", {}, timeout=10)["watchers"]:
                        assert time.monotonic() < deadline, "the dropped watch stayed"
        finally:
            runner.run(inst.stop())


async def test_kvs_watch_methods_follow_the_kvs_namespace(start_instance, connect):
    """``KVS.watch`` / ``watch_eventlog`` watch in the KVS's own namespace
    (the free function with a KVS's handle watched primary), and a KVS
    given to ``watch()`` is a TypeError that says what to do (it was an
    AttributeError about rpc_stream from deep inside)."""
    from kvs import eventlog
    from kvs.client import KVS

    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": "job", "owner": -1}), 10)
    job, primary = KVS(h, "job"), KVS(h)
    await asyncio.wait_for(primary.put("k", "in primary"), 10)
    await asyncio.wait_for(job.put("k", "in job"), 10)
    w = job.watch("k", uniq=True)
    assert w.namespace == "job"
    assert await take(w, 1) == [b"in job"]
    await asyncio.wait_for(job.put("k", "again"), 10)
    assert await take(w, 1) == [b"again"]
    await asyncio.wait_for(w.cancel(), 10)
    await asyncio.wait_for(eventlog.append(job, "log", "submit"), 10)
    log = job.watch_eventlog("log")
    async with asyncio.timeout(10):
        assert (await anext(log))["name"] == "submit"
    await asyncio.wait_for(log.cancel(), 10)
    with pytest.raises(TypeError, match=r"not a KVS: pass kvs.handle, or call the KVS"):
        watch(job, "k")  # type: ignore[arg-type]


def test_sync_kvs_watch(tmp_path):
    """``SyncKVS.watch`` is a blocking iterator in the facade's namespace."""
    from broker.launch import Instance
    from broker.loops import loop_factory
    from kvs import eventlog
    from kvs.client import SyncKVS

    with asyncio.Runner(loop_factory=loop_factory("asyncio")) as runner:
        inst = Instance(2, 2, stderr_path=str(tmp_path / "broker.log"))
        runner.run(asyncio.wait_for(inst.start(), 60))
        try:
            with SyncKVS(uri=inst.uri(1)) as kvs:
                kvs.namespace_create("job")
                job = kvs.with_namespace("job")
                job.put("k", "1")
                with job.watch("k", timeout=10) as w:
                    it = iter(w)
                    assert next(it).value == b"1"
                    job.put("k", "2")
                    assert next(it).value == b"2"
                job.run(eventlog.append(job.aio, "log", "start"))
                with job.watch_eventlog("log", timeout=10) as w:
                    assert next(iter(w))["name"] == "start"
                assert kvs.sync_handle.rpc("kvs-watch.stats-get", {}, timeout=10)["watchers"] == 0
        finally:
            runner.run(inst.stop())
