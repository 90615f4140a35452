"""The blocking facade (broker.sync.SyncHandle) against real brokers.

Each script runs in a worker thread (the facade owns its own loop and
refuses a running one), attached to a follower rank so requests cross the
tree.
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_python, wait_until

from broker import sync
from broker.errors import RemoteError
from kvs.treeobj import val
from kvs_watch.flags import WAITCREATE, WATCH


def _put(key: str, data: bytes) -> dict[str, Any]:
    return {"namespace": "primary", "flags": 0,
            "ops": [{"key": key, "flags": 0, "dirent": val(data)}]}


async def test_rpc_answers_errors_and_timeouts(start_instance) -> None:
    inst = await start_instance(size=2)

    def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with sync.connect(inst.uri(1)) as h:
            out["ping"] = h.rpc("broker.ping", {"n": 7}, nodeid=0)
            try:
                h.rpc("nosuch.method", {})
            except RemoteError as exc:
                out["enosys"] = exc.errnum
            # An answer that cannot come in time: TimeoutError, and the
            # request is retired so nothing waits for it any more.
            seq = h.rpc("kvs.getroot", {"namespace": "primary"})["rootseq"]
            t0 = time.monotonic()
            try:
                h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": seq + 1},
                      timeout=0.3)
            except TimeoutError:
                out["waited"] = time.monotonic() - t0
            out["pending"] = h.aio.pending
            # Its late answer (the version now exists) is dropped: the next
            # calls get their own answers.
            out["commit"] = h.rpc("kvs.commit", _put("sync.k", b"1"), timeout=10)
            out["after"] = h.rpc("broker.ping", {"n": 8}, timeout=10)
            out["pending_end"] = h.aio.pending
        return out

    out = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert out["ping"]["n"] == 7 and out["ping"]["route"][-1] == "r0"
    assert out["enosys"] == errno.ENOSYS
    assert 0.25 <= out["waited"] < 5  # uvloop timers run on a millisecond clock
    assert out["pending"] == 0
    assert out["commit"]["rootseq"] >= 1
    assert out["after"]["n"] == 8
    assert out["pending_end"] == 0


async def test_events_and_a_stream_sent_when_called(start_instance) -> None:
    inst = await start_instance(size=2)

    def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with sync.connect(inst.uri(1)) as h:
            h.subscribe("sync.test")
            seq = h.publish("sync.test.a", {"n": 1})
            ev = h.recv_event(timeout=10)
            out["event"] = (ev.topic, ev.payload, ev.seq == seq)
            try:
                h.recv_event(timeout=0.2)
            except TimeoutError:
                out["no_more_events"] = True
            h.rpc("kvs.commit", _put("sw.k", b"1"), timeout=10)
            before = h.rpc("kvs-watch.stats-get", {}, timeout=10)["watchers"]
            # rpc_stream() sends the request itself, before anything is read:
            # the rank's kvs-watch counts the watcher already.
            answers = h.rpc_stream("kvs-watch.lookup",
                                   {"namespace": "primary", "key": "sw.k", "flags": WATCH})
            out["watchers"] = h.rpc("kvs-watch.stats-get", {}, timeout=10)["watchers"] - before
            first = next(answers)
            h.rpc("kvs.commit", _put("sw.k", b"2"), timeout=10)
            second = next(answers)
            out["watched"] = [first["val"]["data"], second["val"]["data"]]
        return out

    out = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert out["event"] == ("sync.test.a", {"n": 1}, True)
    assert out["no_more_events"]
    assert out["watchers"] == 1
    assert out["watched"] == [b"1", b"2"]


async def test_refused_inside_a_running_loop(start_instance) -> None:
    inst = await start_instance(size=1)
    with pytest.raises(RuntimeError, match="inside a running event loop"):
        sync.connect(inst.uri(0))


_INSIDE_A_LOOP_SCRIPT = """
import asyncio, sys
from broker import sync
from kvs.client import SyncKVS
sh = sync.connect(sys.argv[1])
kvs = SyncKVS(sh)
kvs.put("k", "v")

async def main():
    for name, call in (("ping", sh.ping), ("rpc", lambda: sh.rpc("broker.ping", {})),
                       ("get", lambda: kvs.get("k")), ("close", sh.close)):
        try:
            call()
            print(name, "went through")
        except RuntimeError as exc:
            print(name, exc)

asyncio.run(main())
print("closed", sh.closed, "ping", sh.ping()["rank"], "get", kvs.get("k"))
sh.close()
print("closed", sh.closed)
"""


async def test_an_open_blocking_handle_is_refused_inside_a_running_loop(start_instance) -> None:
    """Used inside a running loop, a call failed with asyncio's "Cannot run
    the event loop while another loop is running" (or blamed another
    loop), and close() so refused marked the handle closed and leaked its
    connection and tasks; now every call says why, and the handle goes on."""
    inst = await start_instance(size=1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-X", "dev", "-c", _INSIDE_A_LOOP_SCRIPT, inst.uri(0),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        cwd=str(Path(__file__).parent.parent))
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert (proc.returncode, err.decode()) == (0, "")
    said = ("the blocking facade cannot be used inside a running event loop: use the async "
            "API (broker.handle.Handle) there")
    assert out.decode().splitlines() == [
        f"ping {said}", f"rpc {said}", f"get {said}", f"close {said}",
        "closed False ping 0 get b'v'", "closed True"]


_INTERRUPTED_SCRIPT = """
import sys
from broker import sync
h = sync.connect(sys.argv[1])
print("ready", flush=True)
try:
    h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**6})
except KeyboardInterrupt:
    print("interrupted", h.aio.pending, flush=True)
    print("ping", h.rpc("broker.ping", {"a": 1}, timeout=10)["a"], flush=True)
    h.close()
"""


async def test_ctrl_c_in_a_blocking_rpc_leaves_the_handle_usable(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _INTERRUPTED_SCRIPT, inst.uri(0),
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).parent.parent))
    assert proc.stdout is not None
    try:
        assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"

        async def waiting() -> bool:  # the script's RPC is in flight
            stats = await h.rpc("kvs.stats-get", {})
            return stats["namespaces"]["primary"]["waiters"] == 1

        async with asyncio.timeout(20):
            while not await waiting():
                await asyncio.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out = await asyncio.wait_for(proc.stdout.read(), 20)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert out.decode().splitlines() == ["interrupted 0", "ping 1"]


async def test_a_blocking_stream_names_its_request_and_closes(start_instance) -> None:
    inst = await start_instance(size=1)

    def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with sync.connect(inst.uri(0)) as h:
            h.rpc("kvs.commit", _put("sc.k", b"1"), timeout=10)
            watch = {"namespace": "primary", "key": "sc.k", "flags": WATCH}
            # never iterated, then dropped: nothing waits for it
            h.rpc_stream("kvs-watch.lookup", watch)
            out["dropped"] = h.aio.pending
            # a for loop left through break drops it too; the watch's later
            # answers are dropped and the next calls get their own
            for answer in h.rpc_stream("kvs-watch.lookup", watch):
                out["looped"] = answer["val"]["data"]
                break
            out["after_break"] = h.aio.pending
            h.rpc("kvs.commit", _put("sc.k", b"2"), timeout=10)  # both watches answer it
            out["ping"] = h.rpc("broker.ping", {"n": 1}, timeout=10)["n"]
            # the matchtag lets a script cancel the service's side too
            with h.rpc_stream("kvs-watch.lookup", watch) as answers:
                out["first"] = next(answers)["val"]["data"]
                h.rpc("kvs-watch.cancel", {"matchtag": answers.matchtag}, timeout=10)
                out["rest"] = [a["val"]["data"] for a in answers]  # ends at ENODATA
            out["pending"] = h.aio.pending
            with h.rpc_stream("kvs-watch.lookup", watch) as answers:
                next(answers)
            out["after_with"] = h.aio.pending
        return out

    out = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert out == {"dropped": 0, "looped": b"1", "after_break": 0, "ping": 1,
                   "first": b"2", "rest": [], "pending": 0, "after_with": 0}


async def test_calls_after_close_say_the_handle_was_closed(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    async with asyncio.timeout(20):
        seq = (await h.rpc("kvs.getroot", {"namespace": "primary"}))["rootseq"]
        waiting = h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": seq + 100})
        stream = h.rpc_stream("kvs-watch.lookup",
                              {"namespace": "primary", "key": "nope", "flags": WATCH | WAITCREATE})
        await h.subscribe("closed.")
        event = asyncio.ensure_future(h.recv_event())
        await h.close()
        for aw in (waiting, stream.next_message(), event):
            with pytest.raises(RemoteError) as ei:
                await aw
            assert ei.value.errnum == errno.ECONNRESET
            assert "handle closed" in str(ei.value), str(ei.value)
        with pytest.raises(RemoteError) as ei:
            h.rpc("broker.ping", {})
        assert ei.value.errnum == errno.ECONNRESET and "handle closed" in str(ei.value)


async def test_a_closed_blocking_handle_says_so_for_every_call(start_instance) -> None:
    """After close() every call raises RemoteError(ECONNRESET, "handle
    closed"), as rpc() did; run(), publish() and the kvs facade raised
    "Event loop is closed", and a second close() raised too."""
    from kvs.client import SyncKVS

    inst = await start_instance(size=1)

    def script() -> list[Any]:
        h = sync.connect(inst.uri(0))
        kvs = SyncKVS(h)
        h.close()
        h.close()  # a no-op
        calls = [lambda: h.rpc("broker.ping", {}), lambda: h.publish("x.y"),
                 lambda: h.subscribe("x."), lambda: h.recv_event(timeout=1),
                 lambda: h.rpc_stream("kvs-watch.lookup", {}), lambda: kvs.get("a"),
                 lambda: kvs.put("a", 1), lambda: h.run(asyncio.sleep(0))]
        out = []
        for call in calls:
            try:
                call()
            except Exception as exc:  # noqa: BLE001 (the test records what each raised)
                out.append((type(exc).__name__, getattr(exc, "errnum", None), str(exc)))
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "coroutine ... never awaited" fails it
        out = await asyncio.wait_for(asyncio.to_thread(script), 30)
    assert len(out) == 8
    for name, errnum, text in out:
        assert (name, errnum) == ("RemoteError", errno.ECONNRESET), out
        assert "handle closed" in text


async def test_the_handles_timeout_is_every_requests_default(start_instance) -> None:
    """connect(timeout=S) / SyncKVS(timeout=S): a request that is not
    answered in S seconds raises TimeoutError; waits that may rightly be
    long (a stream's next answer) have their own."""
    from kvs.client import SyncKVS

    inst = await start_instance(size=2)

    def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with sync.connect(inst.uri(1), timeout=0.3) as h:
            # (rank 1 loads primary from rank 0 first: right after start-up,
            # on a loaded machine, that took a third of 0.3 s)
            seq = h.rpc("kvs.getroot", {"namespace": "primary"}, timeout=10)["rootseq"]
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": seq + 100})
            out["rpc"] = time.monotonic() - t0
            with pytest.raises(TimeoutError):
                h.run(asyncio.sleep(5))
            out["run_none"] = h.run(asyncio.sleep(0.5, "slept"), timeout=None)
            stream = h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "nope",
                                                       "flags": WATCH | WAITCREATE},
                                  timeout=0.2)
            with pytest.raises(TimeoutError):
                next(stream)
            # a timeout leaves the stream going: next() may wait again (it
            # said StopIteration, as if the stream had ended; concurrency audit)
            with pytest.raises(TimeoutError):
                next(stream)
            out["going"] = h.aio.pending
            stream.close()
            out["pending"] = h.aio.pending
        with pytest.raises(ValueError, match="the handle's"):
            SyncKVS(h, timeout=1)  # the handle's timeout applies: said, not ignored
        with SyncKVS(uri=inst.uri(0), timeout=0.3) as kvs:
            with pytest.raises(TimeoutError):
                kvs.run(asyncio.sleep(5))
            # and it still works (as put() and get_json() run them, bounded
            # by a generous timeout of their own, not 0.3 s, on a loaded machine)
            kvs.run(kvs.aio.put("t.k", 1), timeout=10)
            out["get"] = kvs.run(kvs.aio.get_json("t.k"), timeout=10)
        return out

    out = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert 0.25 < out["rpc"] < 5, out
    assert out["run_none"] == "slept" and out["get"] == 1
    assert (out["going"], out["pending"]) == (1, 0)


async def test_sends_between_calls_leave_at_once(start_instance, connect) -> None:
    """The facade's loop is stopped between calls, so no loop turn ends to
    write what a turn would hold back: each message sent then (publish
    without an answer, a stream's cancel) is written at once, and none
    waits for the script's next call or is lost if it never makes one."""
    inst = await start_instance(size=2)
    sub = await connect(inst, 0)
    await asyncio.wait_for(sub.subscribe("between."), 10)
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def script() -> None:
        h = sync.connect(inst.uri(1))
        h.rpc("broker.ping", {})
        for i in range(5):
            h.aio.publish_nowait("between.e", {"i": i})
        # no call now until the subscriber saw all five
        asyncio.run_coroutine_threadsafe(release.wait(), loop).result(30)
        h.close()

    worker = asyncio.create_task(asyncio.to_thread(script))
    try:
        got = [(await asyncio.wait_for(sub.recv_event(), 10)).payload["i"] for _ in range(5)]
        assert got == list(range(5))
    finally:
        release.set()
        await asyncio.wait_for(worker, 30)


async def test_leaving_a_sync_watch_keeps_the_blocks_own_exception(start_instance) -> None:
    """A SyncWatch left by an exception after its handle was closed: the
    block's exception comes out, not the handle's ECONNRESET from the
    watch's cancel (concurrency audit).  Its cancel is silent there, as
    Watch.cancel is."""
    from kvs.client import SyncKVS

    inst = await start_instance(size=1)

    def script() -> str:
        with SyncKVS(uri=inst.uri(0)) as kvs:
            kvs.put("w.k", 1)
            try:
                with kvs.watch("w.k", timeout=10) as w:
                    next(iter(w))
                    kvs.close()
                    raise ValueError("the block's own")
            except ValueError as exc:
                return str(exc)
        return "no exception"

    assert await asyncio.wait_for(asyncio.to_thread(script), 60) == "the block's own"


_FORK_SCRIPT = """
import asyncio, errno, os, signal, sys, threading, time
from broker import sync
from broker.errors import RemoteError
h = sync.connect(sys.argv[1], event_loop=sys.argv[2], timeout=10)
h.rpc("broker.ping", {})
sys.stdout.flush()
if os.fork() == 0:
    try:
        h.rpc("broker.ping", {"who": "child"})
        print("child: answered", flush=True)
    except RemoteError as exc:
        print("child:", exc.errname, "fork" in str(exc), flush=True)
    h.close()
    sys.exit(0)  # (with the finalizers of the handle's loop and socket)
os.wait()
print("parent:", all(h.rpc("broker.ping", {"i": i})["i"] == i for i in range(20)), flush=True)

def interrupt():  # once the main thread waits in a call
    while h._waiting is None:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt, daemon=True).start()
try:
    h.run(asyncio.sleep(3600), timeout=None)
except KeyboardInterrupt:
    print("parent: interrupted", flush=True)
h.close()
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_forked_child_leaves_the_parents_handle_alone(start_instance, loop) -> None:
    """A child of fork() shares its parent's connection (and the stock
    loop's epoll instance).  Its calls read the parent's answers (the
    parent's ping returned the child's payload); its close(), or the loop's
    finalizer at its exit, unregistered the parent's socket and wakeup pipe
    (the parent's next call timed out, its Ctrl-C waited for ever).  The
    handle is closed to the child now: ECONNRESET, saying why."""
    inst = await start_instance(size=1)
    rc, out, err = await run_python(_FORK_SCRIPT, inst.uri(0), loop)
    assert out.splitlines() == [
        "child: ECONNRESET True", "parent: True", "parent: interrupted"], err[-2000:]
    assert rc == 0


_HALF_MADE_FORK_SCRIPT = """
import os, sys, threading
from broker import sync
from broker.errors import RemoteError
uri, loop = sys.argv[1], sys.argv[2]
h = sync.connect(uri, event_loop=loop, timeout=10)
at_loop, go, made = threading.Event(), threading.Event(), []

def pause(frame, event, arg):  # the other thread, inside connect(): registered, no loop yet
    if event == "call" and frame.f_code.co_name == "get_loop":
        at_loop.set()
        go.wait(30)

def connect():  # (as SyncKVS.lease() does, for its keepalive)
    sys.settrace(pause)
    try:
        made.append(sync.connect(uri, event_loop=loop, timeout=10))
    finally:
        sys.settrace(None)

t = threading.Thread(target=connect)
t.start()
assert at_loop.wait(30)
if os.fork() == 0:
    try:
        h.rpc("broker.ping", {"who": "child"})
        print("child: answered", flush=True)
    except RemoteError as exc:
        print("child:", exc.errname, flush=True)
    h.close()
    os._exit(0)
os.wait()
go.set()
t.join()
print("parent:", h.rpc("broker.ping", {"i": 1})["i"], made[0].rpc("broker.ping", {"i": 2})["i"],
      flush=True)
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_fork_while_another_thread_makes_a_handle(start_instance, loop) -> None:
    """fork() while another thread is in connect() (SyncKVS.lease() makes
    its keepalive's handle so): the child's hook met a handle registered
    without its loop yet and raised AttributeError ("Exception ignored in
    _after_fork_in_child"), which stopped it, so the handles after it in
    the set stayed the parent's in the child (its calls read the parent's
    answers, or waited for ever).  Every handle is closed to the child now."""
    inst = await start_instance(size=1)
    rc, out, err = await run_python(_HALF_MADE_FORK_SCRIPT, inst.uri(0), loop)
    assert out.splitlines() == ["child: ECONNRESET", "parent: 1 2"], err
    assert "Exception ignored" not in err, err
    assert rc == 0


_DROPPED_SCRIPT = """
import gc, json, os, signal, sys, warnings
from broker import sync
warned = []
warnings.simplefilter("always", ResourceWarning)
warnings.showwarning = lambda message, *rest, **kw: warned.append(str(message))
def descriptors():
    return len(os.listdir("/proc/self/fd"))
def use_and_forget():
    h = sync.connect(sys.argv[1], event_loop=sys.argv[2], timeout=10)
    h.rpc("broker.ping", {})
before = descriptors()
for _ in range(50):
    use_and_forget()
gc.collect()
print(json.dumps({"grew": descriptors() - before,
                  "warned": sum("SyncHandle was not closed" in w for w in warned),
                  "others": [w for w in warned if "SyncHandle was not closed" not in w][:3],
                  "default_sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_a_handle_dropped_without_close_is_closed(start_instance, loop) -> None:
    """A blocking handle collected without close() is closed, with a
    ResourceWarning, as an unclosed file: its descriptors go, and the
    facade's SIGINT handler once the last one has.  On uvloop its
    connection and loop stayed alive (7 descriptors a handle, for good:
    EMFILE in a long script), and the handler with them.  The one warning
    is all: the loops' own of the connection ("unclosed resource
    <UnixTransport>", "unclosed transport", "unclosed <socket.socket>")
    came too, each naming a resource the user never made."""
    inst = await start_instance(size=1)
    rc, out, err = await run_python(_DROPPED_SCRIPT, inst.uri(0), loop)
    assert rc == 0, err[-2000:]
    result = json.loads(out)
    assert result["grew"] <= 7 and result["warned"] == 50 and result["default_sigint"], result
    assert result["others"] == [], result


_DROPPED_IN_A_THREAD_SCRIPT = """
import gc, json, signal, sys, threading, types, warnings
from broker import sync
warnings.simplefilter("ignore", ResourceWarning)
def use_and_forget():
    h = sync.connect(sys.argv[1], event_loop=sys.argv[2], timeout=10)
    h.rpc("broker.ping", {})
gc.disable()  # (collected below, in a worker thread)
use_and_forget()
worker = threading.Thread(target=gc.collect)
worker.start()
worker.join()
# a Ctrl-C Python drops in a finalizer now is no call's: not kept for one,
# but given to the hook that was there (which prints it, as Python does)
passed = []
sync._prior_unraisablehook = passed.append
sync._on_unraisable(types.SimpleNamespace(exc_type=KeyboardInterrupt, exc_value=None,
                                          exc_traceback=None, err_msg=None, object=None))
kept = sync._dropped
with sync.connect(sys.argv[1], event_loop=sys.argv[2], timeout=10) as h:
    pinged = h.rpc("broker.ping", {"n": 1})["n"]
print(json.dumps({"users": sync._sigint_users, "kept": kept, "passed": len(passed),
                  "pinged": pinged,
                  "default": signal.getsignal(signal.SIGINT) is signal.default_int_handler}))
"""


async def test_a_handle_collected_in_another_thread_leaves_no_ctrl_c_behind(
        start_instance) -> None:
    """A dropped handle's finalizer run by the collector in a worker thread
    cannot put Python's SIGINT handler back (not the main thread): a Ctrl-C
    dropped in a finalizer after that was kept, for the next handle's call
    to raise, maybe much later.  Now none is kept with no handle open, and
    the next handle made in the main thread puts the default back at its
    close."""
    inst = await start_instance(size=1)
    rc, out, err = await run_python(_DROPPED_IN_A_THREAD_SCRIPT, inst.uri(0), "asyncio")
    assert rc == 0, err[-2000:]
    assert json.loads(out) == {"users": 0, "kept": False, "passed": 1, "pinged": 1,
                               "default": True}


async def test_a_refused_next_leaves_the_stream_going(start_instance, connect) -> None:
    """next() on a SyncStream while another thread is in a call on the
    handle raises RuntimeError before anything is done, as every refused
    call; it also ended the stream (the next next() was StopIteration, a
    for loop stopped, and the watch's answers were lost).  It goes on now,
    as a SyncWatch does."""
    inst = await start_instance(size=1)
    writer = await connect(inst, 0)
    await writer.rpc("kvs.commit", _put("s.k", b"0"))
    h = await asyncio.to_thread(sync.connect, inst.uri(0), timeout=10)
    try:
        stream = await asyncio.to_thread(h.rpc_stream, "kvs-watch.lookup", {
            "namespace": "primary", "key": "s.k", "flags": WATCH})
        assert (await asyncio.to_thread(next, stream))["val"]["data"] == b"0"
        seq = (await writer.rpc("kvs.getroot", {"namespace": "primary"}))["rootseq"]
        busy = asyncio.ensure_future(asyncio.to_thread(  # (until the next commit)
            h.rpc, "kvs.wait-version", {"namespace": "primary", "rootseq": seq + 1}))

        async def in_a_call() -> bool:
            stats = await writer.rpc("kvs.stats-get", {})
            return bool(stats["namespaces"]["primary"]["waiters"] == 1)

        await wait_until(in_a_call, "the other thread's call to wait")
        with pytest.raises(RuntimeError, match="in a call in another thread"):
            await asyncio.to_thread(next, stream)
        await writer.rpc("kvs.commit", _put("s.k", b"1"))
        await asyncio.wait_for(busy, 20)
        answer = await asyncio.wait_for(asyncio.to_thread(next, stream, None), 20)
        assert answer is not None and answer["val"]["data"] == b"1"  # (None: it ended)
    finally:
        await asyncio.to_thread(h.close)


async def test_the_async_handles_helpers_block_too(start_instance) -> None:
    """SyncHandle has Handle's ping, attr_get, attr_set and log: a script
    attached to rank 1 finds rank 3's URI (attr local-uri) and attaches
    there, as a worker on each rank does.  Before, only rpc() was there,
    answering attr.get's {"value": ...} wrapper."""
    inst = await start_instance(size=4, fanout=2)

    def script() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with sync.connect(inst.uri(1), timeout=10) as h:
            out["ping"] = h.ping(2, {"n": 5})
            out["uri3"] = h.attr_get("local-uri", 3)
            h.attr_set("log.level", "debug", nodeid=3)
            out["level3"] = h.attr_get("log.level", nodeid=3)
            h.log("hello from a script", level="warning", name="app", nodeid=2)
            out["dmesg2"] = [r["message"] for r in h.rpc_stream("log.dmesg", {}, nodeid=2,
                                                                  timeout=10)
                             if r["name"] == "app"]
        with sync.connect(out["uri3"], timeout=10) as h3:
            out["rank3"] = h3.attr_get("rank")
        return out

    out = await asyncio.wait_for(asyncio.to_thread(script), 60)
    assert out["ping"]["rank"] == 2 and out["ping"]["n"] == 5
    assert out["uri3"] == inst.uri(3)
    assert out["level3"] == "debug"
    assert out["dmesg2"] == ["hello from a script"]
    assert out["rank3"] == 3


async def test_a_sync_watch_left_by_a_timeout_does_not_wait_for_a_stuck_rank(
        start_instance, connect) -> None:
    """``with kvs.watch(k, timeout=T) as w: next(w)`` whose serving rank is
    stopped: the TimeoutError comes out of the block at once, as it does
    from the async ``async with watch(...)``.  The SyncWatch's exit drained
    the cancelled stream for CANCEL_TIMEOUT whatever ended the block, so a
    0.5 s timeout took 10.5 s (API review).

    Rank 1 stays stopped until the wait is over, so a drain could end only
    at its bound: a drained wait takes 0.5 s + CANCEL_TIMEOUT at the least,
    and one under CANCEL_TIMEOUT can only be the block left at once (as
    test_watch_basic tells them apart: no wall-clock bound on success)."""
    import os

    from test_broker_support import stop_process
    from test_watch_helpers import wait_watchers

    from kvs.client import SyncKVS
    from kvs_watch.client import CANCEL_TIMEOUT

    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    pid = inst.pids()[1]
    loop = asyncio.get_running_loop()

    def script() -> tuple[bytes | None, str, float]:
        with SyncKVS(uri=inst.uri(0)) as kvs:
            kvs.put("w.stuck", 1)
            kvs.wait_version(kvs.version(), timeout=10)  # (rank 1 serves it too)
            try:
                # (the first answer is waited for as long as it takes: a
                # rank descheduled 0.5 s on a loaded machine is no stuck rank)
                with kvs.watch("w.stuck", timeout=30, nodeid=1) as w:
                    first = next(w).value
                    asyncio.run_coroutine_threadsafe(stop_process(pid), loop).result(10)
                    w.timeout = 0.5  # (each next() from here on)
                    t0 = time.monotonic()
                    next(w)
            except TimeoutError as exc:
                return first, str(exc), time.monotonic() - t0
        return None, "no timeout", 0.0

    try:
        first, error, took = await asyncio.wait_for(asyncio.to_thread(script), 60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (first, error) == (b"1", "no answer within 0.5 s")
    assert took < CANCEL_TIMEOUT, f"{took:.1f} s: the with block drained the stream"
    await wait_watchers(h0, 0, nodeid=1)  # the cancel reached rank 1 once it ran


async def test_a_sync_watch_is_stopped_from_another_thread(start_instance, connect) -> None:
    """``SyncWatch.cancel()`` from a thread other than the one iterating:
    a ``next()`` blocked there wakes and raises StopIteration (the ``for``
    loop ends), the watch is cancelled on the rank, and the handle goes on
    working; called before the iterating thread waits again, its next
    ``next()`` raises StopIteration at once, the answers already queued
    dropped.  Before, it raised "this SyncHandle is in a call in another
    thread" (or, between calls, raced the reader for the handle): only a
    ``timeout=`` poll could stop a blocked watch."""
    import threading

    from test_broker_support import wait_until
    from test_watch_helpers import wait_watchers

    from kvs.client import KVS, SyncKVS

    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await KVS(h).put("tw.k", 1)
    box: dict[str, Any] = {}
    first = threading.Event()
    proceed = threading.Event()

    def blocked_reader() -> tuple[list[bytes | None], str]:
        with SyncKVS(uri=inst.uri(0)) as kvs, kvs.watch("tw.k") as w:
            box["w"] = w
            seen = []
            for entry in w:  # the current value, then waits
                seen.append(entry.value)
                first.set()
            return seen, kvs.get_str("tw.k")

    def idle_reader() -> tuple[list[bytes | None], str]:
        with SyncKVS(uri=inst.uri(0)) as kvs, kvs.watch("tw.k") as w:
            box["w2"] = w
            first.set()
            assert proceed.wait(20)
            return [e.value for e in w], kvs.get_str("tw.k")

    loop = asyncio.get_running_loop()

    def in_daemon_thread(fn: Any) -> asyncio.Future[Any]:
        """``fn()`` in a thread of its own that a failed test leaves behind
        (a daemon: a reader blocked for ever must not hold up the exit)."""
        fut: asyncio.Future[Any] = loop.create_future()

        def body() -> None:
            try:
                result = fn()
            except BaseException as exc:
                loop.call_soon_threadsafe(fut.set_exception, exc)
            else:
                loop.call_soon_threadsafe(fut.set_result, result)
        threading.Thread(target=body, daemon=True).start()
        return fut

    reader = in_daemon_thread(blocked_reader)
    assert await asyncio.to_thread(first.wait, 20)
    w = box["w"]
    # (only to be sure the reader is blocked in next() when the cancel comes)
    async def reading() -> bool:
        stream = w.watch._stream
        return stream is not None and stream.reading

    await wait_until(reading, "the reader thread blocked in next()", 20)
    await asyncio.wait_for(asyncio.to_thread(w.cancel), 10)  # from a third thread
    assert await asyncio.wait_for(reader, 20) == ([b"1"], "1")
    await wait_watchers(h, 0)

    first.clear()
    reader = in_daemon_thread(idle_reader)
    assert await asyncio.to_thread(first.wait, 20)
    await wait_watchers(h, 1)  # started, its first answer on its way or queued
    await asyncio.wait_for(asyncio.to_thread(box["w2"].cancel), 10)
    proceed.set()
    assert await asyncio.wait_for(reader, 20) == ([], "1")
    await wait_watchers(h, 0)
