"""``kvbroker kvs get --watch ...`` and ``kvbroker kvs eventlog get/wait-event``
(:mod:`kvs_watch.cli`), as real processes; Ctrl-C cancels the watch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

from test_watch_helpers import (
    NO_MERGE,
    append,
    commit,
    put,
    stats,
    wait_until,
    wait_watchers,
)


def _env(uri: str) -> dict[str, str]:
    env = dict(os.environ, KVBROKER_URI=uri)
    env.pop("KVBROKER_NAMESPACE", None)
    return env


async def spawn(uri: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", *args, env=_env(uri),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def run(uri: str, *args: str, timeout: float = 20) -> tuple[int, str, str]:
    p = await spawn(uri, *args)
    out, err = await asyncio.wait_for(p.communicate(), timeout)
    assert p.returncode is not None
    return p.returncode, out.decode(), err.decode()


def ev(ts: float, name: str, **ctx) -> bytes:
    e = {"timestamp": ts, "name": name, **({"context": ctx} if ctx else {})}
    return json.dumps(e, separators=(",", ":")).encode() + b"\n"


async def test_kvs_get_watch_waitcreate_append_stream(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(3)
    await commit(h0, put("test.a", "42"), sync=(h0, 3))
    assert await run(uri, "kvs", "get", "--watch", "--count=1", "test.a") == (0, "42\n", "")
    p = await spawn(uri, "kvs", "get", "-w", "-c", "3", "test.a")
    await wait_watchers(h0, 1, nodeid=3)
    for v in ("43", "43"):
        await commit(h0, put("test.a", v), flags=NO_MERGE)
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out, err) == (0, b"42\n43\n43\n", b"")
    p = await spawn(uri, "kvs", "get", "-W", "-w", "-A", "-c", "3", "test.log")
    await wait_watchers(h0, 1, nodeid=3)
    await commit(h0, put("test.log", "abc"))
    await commit(h0, append("test.log", "d"), append("test.log", "e"))
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out, err) == (0, b"abc\nd\ne\n", b"")
    assert await run(uri, "kvs", "get", "--stream", "test.log") == (0, "abcde\n", "")
    rc, out, err = await run(uri, "kvs", "get", "--watch", "--count=1", "test.nokey")
    assert rc == 1 and err == "kvbroker: test.nokey: No such file or directory\n"
    rc, out, err = await run(uri, "kvs", "get", "-N", "noexist", "--watch", "test.a")
    assert rc == 1 and "Operation not supported" in err
    rc, out, err = await run(uri, "kvs", "get", "--watch", "--stream", "test.a")
    assert rc == 1 and "Invalid argument" in err
    await wait_watchers(h0, 0, nodeid=3)


async def test_eventlog_get_watch_and_wait_event(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(2)
    await commit(h0, append("test.d", ev(42, "foo")))
    await commit(h0, append("test.d", ev(43, "bar", data="x")), sync=(h0, 2))
    assert await run(uri, "kvs", "eventlog", "get", "--watch", "--unformatted", "--count=2",
                     "test.d") == (0, (ev(42, "foo") + ev(43, "bar", data="x")).decode(), "")
    assert await run(uri, "kvs", "eventlog", "get", "-w", "-c", "2", "test.d") == (
        0, '42.000000 foo\n43.000000 bar data="x"\n', "")
    rc, out, _ = await run(uri, "kvs", "eventlog", "wait-event", "-u", "test.d", "bar")
    assert (rc, out) == (0, ev(43, "bar", data="x").decode())
    rc, out, _ = await run(uri, "kvs", "eventlog", "wait-event", "-v", "test.d", "bar")
    assert (rc, out) == (0, '42.000000 foo\n43.000000 bar data="x"\n')
    rc, out, err = await run(uri, "kvs", "eventlog", "wait-event", "-t", "0.2", "test.d", "baz")
    assert rc == 1 and "wait-event timeout on event 'baz'" in err
    rc, out, err = await run(uri, "kvs", "eventlog", "wait-event", "test.nolog", "foo")
    assert rc == 1 and "eventlog path test.nolog not found" in err
    p = await spawn(uri, "kvs", "eventlog", "wait-event", "--waitcreate", "-u", "test.f", "foo")
    await wait_watchers(h0, 1, nodeid=2)
    await commit(h0, append("test.f", ev(1, "foo", data="bar")))
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out) == (0, ev(1, "foo", data="bar"))
    await commit(h0, put("test.noteventlog", "foo"), sync=(h0, 2))
    rc, out, err = await run(uri, "kvs", "eventlog", "get", "-W", "test.noteventlog")
    assert rc == 1 and "cannot decode improperly formatted eventlog" in err
    await wait_watchers(h0, 0, nodeid=2)


async def test_ctrl_c_cancels_the_watch(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    p = await spawn(inst.uri(1), "kvs", "get", "--watch", "--waitcreate", "never.created")
    await wait_watchers(h0, 1, nodeid=1)
    p.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(p.communicate(), 20)
    assert p.returncode == 130, err

    async def cancelled() -> bool:
        st = await stats(h0, 1)
        return bool(st["watchers"] == 0)

    await wait_until(cancelled)
    st = await stats(h0, 1)
    assert st["counts"].get("cancelled") == 1  # a cancel, not just the disconnect
