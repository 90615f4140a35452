"""Helpers shared by the ``test_kvs_rpc_*`` integration tests (no tests here).

These tests drive the ``kvs`` and ``content`` modules with raw RPCs on real
instances, independently of the Python client in :mod:`kvs.client`.  Every
await is time-boxed.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable
from typing import Any

from test_broker_support import GUEST_IMPORT_GUARD

from broker.errors import RemoteError

T = 10.0  # default time box for one RPC

# lookup flags
READDIR, READLINK, TREEOBJ = 1, 2, 16
# commit flags, op flags
NO_MERGE, SYNC, APPEND = 1, 4, 32

GUEST_UID = 65534


def val(data: bytes | str) -> dict[str, Any]:
    if isinstance(data, str):
        data = data.encode()
    return {"ver": 1, "type": "val", "data": data}


def dir_(entries: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"ver": 1, "type": "dir", "data": dict(entries or {})}


def dirref(ref: str) -> dict[str, Any]:
    return {"ver": 1, "type": "dirref", "data": [ref]}


def valref(*refs: str) -> dict[str, Any]:
    return {"ver": 1, "type": "valref", "data": list(refs)}


def symlink(target: str, namespace: str | None = None) -> dict[str, Any]:
    data = {"target": target}
    if namespace is not None:
        data["namespace"] = namespace
    return {"ver": 1, "type": "symlink", "data": data}


def put(key: str, value: bytes | str | dict[str, Any], flags: int = 0) -> dict[str, Any]:
    dirent = value if isinstance(value, dict) else val(value)
    return {"key": key, "flags": flags, "dirent": dirent}


def unlink(key: str) -> dict[str, Any]:
    return {"key": key, "flags": 0, "dirent": None}


async def commit(h: Any, *ops: dict[str, Any], ns: str = "primary", flags: int = 0,
                 timeout: float = T) -> dict[str, Any]:
    """``kvs.commit``; returns ``{rootref, rootseq}``."""
    return await asyncio.wait_for(
        h.rpc("kvs.commit", {"namespace": ns, "flags": flags, "ops": list(ops)}), timeout)


async def lookup(h: Any, key: str, flags: int = 0, ns: str = "primary",
                 rootdir: dict[str, Any] | None = None, timeout: float = T) -> dict[str, Any]:
    """``kvs.lookup``; returns the ``val`` tree object."""
    p: dict[str, Any] = {"key": key, "flags": flags, "namespace": ns}
    if rootdir is not None:
        p["rootdir"] = rootdir
    return (await asyncio.wait_for(h.rpc("kvs.lookup", p), timeout))["val"]


async def get(h: Any, key: str, ns: str = "primary", **kw: Any) -> bytes:
    """The bytes of value ``key``."""
    obj = await lookup(h, key, ns=ns, **kw)
    assert obj["type"] == "val", obj
    return obj["data"]


async def getroot(h: Any, ns: str = "primary", nodeid: int | None = None) -> dict[str, Any]:
    kw = {} if nodeid is None else {"nodeid": nodeid}
    return await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": ns}, **kw), T)


async def stats(h: Any, service: str = "kvs") -> dict[str, Any]:
    return await asyncio.wait_for(h.rpc(f"{service}.stats-get", {}), T)


async def errnum(aw: Awaitable[Any], timeout: float = T) -> int:
    """The errno an RPC fails with (fails the test if it succeeds or hangs)."""
    try:
        result = await asyncio.wait_for(aw, timeout)
    except RemoteError as exc:
        return exc.errnum
    raise AssertionError(f"expected an error, got {result!r}")


def errname(n: int) -> str:
    return errno.errorcode.get(n, str(n))


# ---------------------------------------------------------------- guests

GUEST_PRELUDE = """\
import asyncio, errno, json, os, sys
from broker.errors import RemoteError
from broker.handle import Handle
import broker.codec, broker.rpc, broker.message, msgpack  # noqa: F401 (load before setuid)
import kvs.archive, kvs.client  # noqa: F401
os.setgroups([])
os.setgid({uid})
os.setuid({uid})
assert os.getuid() == {uid}
""" + GUEST_IMPORT_GUARD + """

async def call(h, topic, payload, **kw):
    try:
        return {{"ok": await asyncio.wait_for(h.rpc(topic, payload, **kw), 10)}}
    except RemoteError as exc:
        return {{"errnum": exc.errnum}}

def b(s):
    return s.encode() if isinstance(s, str) else s

def val(s):
    return {{"ver": 1, "type": "val", "data": b(s)}}

def commit(h, ns, *ops, flags=0):
    return call(h, "kvs.commit", {{"namespace": ns, "flags": flags, "ops": list(ops)}})

def put(key, dirent, flags=0):
    return {{"key": key, "flags": flags, "dirent": dirent}}

async def main(uri):
    h = await Handle.connect(uri)
    out = await body(h)
    await h.close()
    return out

"""


def run_guest(uri: str, body: str, uid: int = GUEST_UID, timeout: float = 30) -> Any:
    """Run ``async def body(h)`` (source text) as ``uid`` against ``uri``.

    The interpreter may live where other users cannot read (e.g. a pyenv
    under /root), so the child starts as us, imports what it needs, then
    drops to ``uid`` *before* connecting: the broker sees ``uid`` through
    SO_PEERCRED exactly as for a process started under that uid.  The
    result of ``body`` is returned as JSON (bytes are decoded as UTF-8).
    """
    src = GUEST_PRELUDE.format(uid=uid) + textwrap.dedent(body) + textwrap.dedent("""
        def enc(o):
            return o.decode() if isinstance(o, bytes) else str(o)
        print(json.dumps(asyncio.run(main(sys.argv[1])), default=enc))
    """)
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    r = subprocess.run([sys.executable, "-c", src, uri], capture_output=True, text=True,
                       timeout=timeout, cwd="/", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])
