"""The Python API's objects as a user meets them in a REPL or a log line:
their reprs say what and where they are, and an Instance can be started
again after it stopped (resuming from its statedir)."""

from __future__ import annotations

import asyncio
import errno
import gc
import traceback
from pathlib import Path
from typing import Any

import pytest

from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import Instance
from kvs.client import KVS, SyncKVS
from kvs_watch.client import watch, watch_keys

T = 20  # seconds: bound on every await against a broker


async def test_reprs_say_what_and_where(start_instance: Any, connect: Any) -> None:
    inst = await start_instance(size=2)
    assert repr(inst) == f"<Instance size=2 fanout=2 2 of 2 ranks running in {inst.rundir}>"
    assert repr(Instance(3)) == "<Instance size=3 fanout=32 not started>"

    h = await connect(inst, 1)
    uri = inst.uri(1)
    assert repr(h) == f"<Handle {uri} 0 pending>"
    kvs = KVS(h)
    assert repr(kvs) == f"<KVS 'primary' on {uri}>"

    txn = kvs.txn().put("a", 1).put("b", 2).put("c", 3).unlink("d")
    assert repr(txn) == "<Txn 4 ops ['a', 'b', 'c', ...]>"
    await asyncio.wait_for(kvs.commit(txn), T)

    stream = h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "a",
                                               "flags": 4})
    assert repr(stream).startswith(f"<Stream kvs-watch.lookup matchtag={stream.matchtag} ")
    assert repr(h) == f"<Handle {uri} 1 pending>"
    h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag})
    async with asyncio.timeout(T):
        while await stream.next_message() is not None:
            pass
    assert repr(stream) == f"<Stream kvs-watch.lookup matchtag={stream.matchtag} ended>"

    async with watch(h, "a") as w:
        assert repr(w) == "<Watch primary:a flags=0x4>"
    async with watch_keys(h, "b") as kw:
        assert repr(kw) == "<KeyWatch primary:b>"
    assert repr(kw) == "<KeyWatch primary:b ended>"

    def blocking() -> tuple[str, str, str]:
        with pytest.raises(TypeError, match="SyncKVS.uri=...."):
            SyncKVS(uri)  # type: ignore[arg-type]
        with SyncKVS(uri=uri) as skvs, skvs.watch("a", timeout=T) as sw:
            next(iter(sw))
            return repr(skvs.sync_handle), repr(sw), repr(skvs)
    sh, sw, skvs = await asyncio.to_thread(blocking)
    assert sh == f"<SyncHandle {uri}>"
    assert sw == "<SyncWatch of <Watch primary:a flags=0x4>>"
    assert skvs.startswith("<SyncKVS 'primary' on ")

    # connect() is awaited, or entered: then the connection closes at the end
    async with Handle.connect(uri) as h2:
        assert (await asyncio.wait_for(h2.rpc("broker.ping", {}), T))["rank"] == 1
    assert repr(h2) == f"<Handle {uri} closed>"
    async with KVS.connect(uri) as k2:
        assert await asyncio.wait_for(k2.get("a"), T) == b"1"
    assert repr(k2.handle) == f"<Handle {uri} closed>"
    k3 = await KVS.connect(uri)
    await k3.close()
    assert repr(k3.handle) == f"<Handle {uri} closed>"
    # ... and it is a coroutine: create_task and TaskGroup take it (review)
    h4 = await asyncio.create_task(Handle.connect(uri))
    async with asyncio.TaskGroup() as tg:
        k4 = tg.create_task(KVS.connect(uri))
    assert await asyncio.wait_for(k4.result().get("a"), T) == b"1"
    await k4.result().close()
    await h4.close()
    entered = Handle.connect(uri)
    async with entered:
        with pytest.raises(RuntimeError, match="awaited or entered already"):
            async with entered:
                pass
    with pytest.warns(RuntimeWarning, match="connect.. was never awaited"):
        Handle.connect(uri)
        gc.collect()

    # An error answer's text names its errno, so a traceback says which one
    with pytest.raises(RemoteError) as raised:
        await asyncio.wait_for(kvs.get("nosuch"), T)
    assert (raised.value.errnum, raised.value.errstr) == (errno.ENOENT, "nosuch: no such key")
    assert str(raised.value) == "[ENOENT] nosuch: no such key"
    assert traceback.format_exception_only(raised.value)[-1] == (
        "broker.errors.RemoteError: [ENOENT] nosuch: no such key\n")

    await h.close()
    assert repr(h) == f"<Handle {uri} closed>"
    await inst.stop()
    assert repr(inst) == "<Instance size=2 fanout=2 stopped>"


async def test_an_instance_starts_again_from_its_statedir(tmp_path: Path) -> None:
    inst = Instance(2, 2, statedir=str(tmp_path / "state"),
                    stderr_path=str(tmp_path / "broker.log"))
    try:
        await asyncio.wait_for(inst.start(), 60)
        with pytest.raises(RuntimeError, match="already started"):
            await asyncio.wait_for(inst.start(), 60)
        first = inst.pids()
        async with asyncio.timeout(T):
            await KVS(h := await _connect(inst)).put("kept", "yes", sync=True)
            await h.close()
        await inst.stop()

        await asyncio.wait_for(inst.start(), 60)
        assert set(inst.pids()).isdisjoint(first)
        async with asyncio.timeout(T):
            h = await _connect(inst, 1)
            assert await KVS(h).get("kept") == b"yes"
            await h.close()
    finally:
        await inst.stop()


async def test_an_instance_refuses_a_start_beside_its_start_or_stop(tmp_path: Path) -> None:
    """Two ``start()`` at once, or one while ``stop()`` runs: the second is a
    ``RuntimeError`` saying so (each took over the other's run directory
    and pipe: a directory and ranks were left behind, the errors said
    nothing of why -- found by a review); ``uri()`` of a rank the instance
    does not have is a ``ValueError`` (a path nothing listens at); a bad
    ``stderr_path`` is a ``StartError`` naming it, and no descriptor leaks."""
    import os

    from broker.launch import StartError

    runs = tmp_path / "runs"
    runs.mkdir()
    inst = Instance(2, 2, rundir=str(runs / "r"), stderr_path=str(tmp_path / "broker.log"))
    try:
        first, second = await asyncio.wait_for(asyncio.gather(
            inst.start(), inst.start(), return_exceptions=True), 60)
        assert first is None and isinstance(second, RuntimeError), (first, second)
        assert "being started already" in str(second)
        assert len(inst.pids()) == 2
        with pytest.raises(ValueError, match="not one of this instance's"):
            inst.uri(2)
        stopping = asyncio.ensure_future(inst.stop())
        await asyncio.sleep(0)  # (its first step: the ranks told to stop)
        with pytest.raises(RuntimeError, match="being stopped"):
            await inst.start()
        await asyncio.wait_for(stopping, 60)
    finally:
        await inst.stop()
    assert os.listdir(runs) == []  # (the run directory it made, removed)

    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(StartError, match="stderr_path /nonexistent/x.log: No such file"):
            await Instance(2, stderr_path="/nonexistent/x.log").start()
    assert len(os.listdir("/proc/self/fd")) == fds


def test_an_instance_refuses_bad_arguments_as_it_is_made() -> None:
    """A bad ``event_loop`` failed in every rank (a traceback each, then
    ``StartError: rank 1 exited``); ``size="2"`` and ``2.5`` with Python's
    words later, ``True`` in the ranks' parser (found by a review)."""
    with pytest.raises(ValueError, match="event_loop must be one of auto, uvloop, asyncio"):
        Instance(2, event_loop="bogus")
    for bad in ("2", 2.5, True):
        with pytest.raises(TypeError, match="size must be an int"):
            Instance(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fanout must be at least 1"):
        Instance(2, 0)


async def _connect(inst: Instance, rank: int = 0) -> Any:
    from broker.handle import Handle

    return await Handle.connect(inst.uri(rank))


def test_a_connect_not_awaited_says_so_when_used() -> None:
    """``kvs = KVS.connect()`` without ``await``, then ``kvs.put(...)``: the
    AttributeError names the missing await, not only the missing attribute
    (nothing is connected: the coroutine is made on the first await)."""

    with pytest.warns(RuntimeWarning, match="connect.. was never awaited"):
        for pending in (KVS.connect("local:///nowhere"), Handle.connect("local:///nowhere")):
            with pytest.raises(AttributeError, match="connect.. was not awaited") as raised:
                pending.put  # type: ignore[attr-defined]  # noqa: B018
            assert raised.value.name == "put" and raised.value.obj is pending
            assert not hasattr(pending, "_asyncio_future_blocking")  # probes: plain
            del pending, raised  # (the error holds it too)
            gc.collect()


@pytest.mark.both_loops
async def test_a_handle_used_on_another_event_loop_says_so(start_instance: Any,
                                                          connect: Any) -> None:
    """A handle connected on one loop and used on another -- the usual
    case: connected in one ``asyncio.run()``, used in the next, its loop
    closed -- raises a RuntimeError naming the handle and what to do,
    before anything is sent.  It was asyncio's "got Future attached to a
    different loop" (after the request went out) or uvloop's "unable to
    perform operation on <UnixTransport ...>; the handler is closed"
    (API review).  close() too: it waited 5 s for a flush, then failed with
    "The future belongs to a different loop", the handle marked closed and
    its socket left open (a Python-API probe)."""
    from broker.loops import loop_factory

    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await KVS(h).put("x", 1)
    name = "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") \
        else "asyncio"

    async def watch_x() -> Any:
        async with watch(h, "x") as w:
            return await anext(w)

    def elsewhere() -> list[str]:
        errors = []
        with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
            # a handle of the test's loop, still running in another thread
            for call in (lambda: KVS(h).get("x"), h.recv_event, watch_x, h.close):
                try:
                    runner.run(asyncio.wait_for(call(), 5))
                except RuntimeError as exc:
                    errors.append(str(exc))
            # a handle of a loop that is not running: an earlier asyncio.run's
            # (its loop kept open here, to close the handle properly)
            old = runner.run(Handle.connect(inst.uri(0)))
            with asyncio.Runner(loop_factory=loop_factory(name)) as again:
                for call in (old.ping, old.close):
                    try:
                        again.run(asyncio.wait_for(call(), 5))
                    except RuntimeError as exc:
                        errors.append(str(exc))
            assert runner.run(old.ping())["rank"] == 0  # (not closed by the refused close)
            runner.run(old.close())
        return errors

    errors = await asyncio.wait_for(asyncio.to_thread(elsewhere), 60)
    assert len(errors) == 6, errors
    for error in errors:
        assert "was connected on another event loop" in error, error
        assert "connect() again on this one" in error, error
    assert h.pending == 0  # nothing was sent
    assert await KVS(h).get("x") == b"1"  # and the handle goes on on its own loop


async def test_a_watch_is_done_only_once_it_ended_and_runs_once(start_instance: Any,
                                                                connect: Any) -> None:
    """A watch never started is not done; one that ended refuses a second
    ``async with`` (it yielded nothing, silently) -- plain, key and eventlog
    watches, and the blocking facade's."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    kvs = KVS(h)
    async with asyncio.timeout(T):
        await kvs.put("a", 1)
        await kvs.append_event("log", "go")
        for w in (kvs.watch("a"), kvs.watch_keys("."), kvs.watch_eventlog("log")):
            assert not w.done  # never started: not ended either
            assert not w.started
            async with w:
                assert w.started and not w.done
                await anext(w)
            assert w.done
            with pytest.raises(RuntimeError, match="has ended"):
                async with w:
                    pass
        for w in (kvs.watch("a"), kvs.watch_keys("."), kvs.watch_eventlog("log")):
            # left by an exception: done at once too (it stayed not done,
            # and a second block was let in, to yield nothing)
            with pytest.raises(ValueError):
                async with w:
                    await anext(w)
                    raise ValueError("leave the block")
            assert w.done
            with pytest.raises(RuntimeError, match="has ended"):
                async with w:
                    pass
        w = kvs.watch("a")  # started by iterating, entered after: fine
        assert (await anext(w)).value == b"1"
        async with w:
            pass
        assert w.done

    def script() -> list[Any]:
        with SyncKVS(uri=inst.uri(0)) as skvs:
            sw = skvs.watch("a")
            with sw:
                seen = [next(sw).value]
            try:
                with sw:
                    pass
            except RuntimeError as exc:
                seen.append(str(exc))
            return seen

    seen = await asyncio.wait_for(asyncio.to_thread(script), T)
    assert seen[0] == b"1" and "has ended" in seen[1]


async def test_watch_entry_json_says_why_there_is_no_value(start_instance: Any,
                                                           connect: Any) -> None:
    inst = await start_instance(size=1)
    kvs = KVS(await connect(inst, 0))
    async with asyncio.timeout(T):
        await kvs.put("j", {"x": 1})
        await kvs.put("t", "not json")
        await kvs.put("d.e", 1)
        async with kvs.watch("j", deletes=True) as w:
            assert (await anext(w)).json() == {"x": 1}
            await kvs.unlink("j")
            gone = await anext(w)
        assert gone.removed
        with pytest.raises(ValueError, match=rf"^j: removed at version {gone.rootseq}: "):
            gone.json()
        async with kvs.watch("d", treeobj=True) as w:
            entry = await anext(w)
        with pytest.raises(ValueError, match="^d: a dirref, not a value"):
            entry.json()
        # with treeobj, no value whatever the object (a small value's bytes
        # came, inline, and a big one's valref gave None)
        await kvs.put("big", "x" * 5000)
        for key, kind in (("t", "val"), ("big", "valref")):
            async with kvs.watch(key, treeobj=True) as w:
                entry = await anext(w)
            assert entry.treeobj is not None and entry.treeobj["type"] == kind
            assert entry.value is None, key
        with pytest.raises(ValueError, match="^t: not JSON"):
            (await kvs.wait_create("t")).json()
