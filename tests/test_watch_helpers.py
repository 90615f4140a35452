"""Helpers shared by the ``test_watch_*`` tests (no tests here).

Raw RPCs against real instances; every await is time-boxed.  Conditions are
waited for by polling a service (``wait_until``), never by sleeping a guess.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from typing import Any

from test_broker_support import GUEST_IMPORT_GUARD

from broker.errors import RemoteError
from broker.message import MsgFlags
from broker.rpc import Stream

T = 10.0  # default time box for one answer

READDIR, READLINK, WATCH, WAITCREATE, TREEOBJ = 1, 2, 4, 8, 16
FULL, UNIQ, APPEND, STREAM, INITIAL_SENTINEL = 64, 128, 256, 512, 1024
OP_APPEND, NO_MERGE = 32, 1
GUEST_UID = 65534


def val(data: bytes | str) -> dict[str, Any]:
    return {"ver": 1, "type": "val", "data": data.encode() if isinstance(data, str) else data}


def put(key: str, value: bytes | str | dict[str, Any], flags: int = 0) -> dict[str, Any]:
    return {"key": key, "flags": flags, "dirent": value if isinstance(value, dict) else val(value)}


def append(key: str, value: bytes | str) -> dict[str, Any]:
    return put(key, value, OP_APPEND)


def unlink(key: str) -> dict[str, Any]:
    return {"key": key, "flags": 0, "dirent": None}


async def commit(h: Any, *ops: dict[str, Any], ns: str = "primary", flags: int = 0,
                 timeout: float = T, sync: Any = None) -> dict[str, Any]:
    """``kvs.commit``; then, for each handle (or ``(handle, rank)``) in ``sync``
    (a list for several), wait until that rank has applied the new version.  A
    commit is read-your-writes on the committing rank only (as in Flux), so a
    watch started on another rank right after it could begin at the version
    before."""
    r = await asyncio.wait_for(
        h.rpc("kvs.commit", {"namespace": ns, "flags": flags, "ops": list(ops)}), timeout)
    for other in sync if isinstance(sync, list) else [] if sync is None else [sync]:
        hh, kw = (other[0], {"nodeid": other[1]}) if isinstance(other, tuple) else (other, {})
        await asyncio.wait_for(hh.rpc("kvs.wait-version", {
            "namespace": ns, "rootseq": r["rootseq"]}, **kw), timeout)
    return r


async def lookup(h: Any, key: str, flags: int = 0, ns: str = "primary") -> dict[str, Any]:
    return (await asyncio.wait_for(
        h.rpc("kvs.lookup", {"key": key, "flags": flags, "namespace": ns}), T))["val"]


async def ns_create(h: Any, name: str, owner: int | None = None) -> None:
    p: dict[str, Any] = {"namespace": name}
    if owner is not None:
        p["owner"] = owner
    await asyncio.wait_for(h.rpc("kvs.namespace-create", p), T)


async def ns_remove(h: Any, name: str) -> None:
    await asyncio.wait_for(h.rpc("kvs.namespace-remove", {"namespace": name}), T)


def watch_stream(h: Any, key: str, flags: int = WATCH, ns: str = "primary",
                 nodeid: int | None = None) -> Stream:
    """A raw ``kvs-watch.lookup`` streaming request."""
    kw = {} if nodeid is None else {"nodeid": nodeid}
    return h.rpc_stream("kvs-watch.lookup", {"namespace": ns, "key": key, "flags": flags}, **kw)


async def answer(s: Stream, timeout: float = T) -> dict[str, Any] | None:
    """The next answer's payload (``None`` for the sentinel); fails at the end."""
    msg = await asyncio.wait_for(s.next_message(), timeout)
    assert msg is not None, "stream ended"
    return msg.payload


async def value(s: Stream, timeout: float = T) -> bytes:
    p = await answer(s, timeout)
    assert p is not None and p["val"]["type"] == "val", p
    return p["val"]["data"]


async def end_errnum(s: Stream, timeout: float = T) -> int:
    """The errno that ends ``s`` (0 for ENODATA); fails on another answer."""
    try:
        msg = await asyncio.wait_for(s.next_message(), timeout)
    except RemoteError as exc:
        return exc.errnum
    assert msg is None, f"expected the end of the stream, got {msg.payload!r}"
    return 0


async def errnum(aw: Awaitable[Any], timeout: float = T) -> int:
    try:
        result = await asyncio.wait_for(aw, timeout)
    except RemoteError as exc:
        return exc.errnum
    raise AssertionError(f"expected an error, got {result!r}")


def cancel(h: Any, s: Stream, nodeid: int | None = None) -> None:
    kw = {} if nodeid is None else {"nodeid": nodeid}
    h.send_noresponse("kvs-watch.cancel", {"matchtag": s.matchtag}, **kw)


async def stats(h: Any, nodeid: int | None = None, service: str = "kvs-watch") -> dict[str, Any]:
    kw = {} if nodeid is None else {"nodeid": nodeid}
    return await asyncio.wait_for(h.rpc(f"{service}.stats-get", {}, **kw), T)


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = T,
                     what: str = "condition") -> None:
    """Poll ``check`` until it holds (a condition wait, time-boxed)."""
    try:
        async with asyncio.timeout(timeout):
            while not await check():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def wait_watchers(h: Any, n: int, nodeid: int | None = None, ns: str | None = None,
                        timeout: float = T) -> None:
    """Until kvs-watch on ``nodeid`` has ``n`` watchers (in ``ns`` if given)."""
    async def check() -> bool:
        st = await stats(h, nodeid)
        if ns is None:
            return bool(st["watchers"] == n)
        return bool(st["namespaces"].get(ns, {}).get("watchers", 0) == n)
    await wait_until(check, timeout, f"{n} watchers on rank {nodeid} ns {ns}")


def errname(n: int) -> str:
    return errno.errorcode.get(n, str(n))


NONSTREAMING = int(MsgFlags.NONE)

# ---------------------------------------------------------------- other processes

GUEST_PRELUDE = """\
import asyncio, errno, json, os, sys
from broker.errors import RemoteError
from broker.handle import Handle
import broker.codec, broker.rpc, broker.message, msgpack, kvs_watch.client  # noqa: F401
# The interpreter may live where uid {uid} cannot read it (e.g. under /root), so
# this process starts as us, imports, then becomes {uid} *before* connecting:
# the broker learns {uid} from SO_PEERCRED, exactly as for a process started so.
os.setgroups([])
os.setgid({uid})
os.setuid({uid})
assert os.getuid() == {uid}
""" + GUEST_IMPORT_GUARD + """

async def first(h, key, ns, flags=4):
    s = h.rpc_stream("kvs-watch.lookup", {{"namespace": ns, "key": key, "flags": flags}})
    try:
        msg = await asyncio.wait_for(s.next_message(), 10)
        obj = msg.payload["val"]
        return {{"val": obj["data"].decode() if obj["type"] == "val" else obj["type"]}}
    except RemoteError as exc:
        return {{"errnum": exc.errnum}}

async def main(uri):
    h = await Handle.connect(uri)
    out = await body(h)
    await h.close()
    return out

"""


def run_guest(uri: str, body: str, uid: int = GUEST_UID, timeout: float = 30) -> Any:
    """Run ``async def body(h)`` (source) as ``uid`` against ``uri``; its JSON result."""
    src = GUEST_PRELUDE.format(uid=uid) + textwrap.dedent(body) + textwrap.dedent("""
        print(json.dumps(asyncio.run(main(sys.argv[1]))))
    """)
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    r = subprocess.run([sys.executable, "-c", src, uri], capture_output=True, text=True,
                       timeout=timeout, cwd="/", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
