"""KVS requests as the contract spells them (docs/protocol.md, KVS and kvs-watch).

Written against the RPC payloads, not against the ``kvs`` client library,
so the benchmarks measure the wire protocol and keep working while the
client API moves.
"""

from __future__ import annotations

import asyncio
from typing import Any

from broker.handle import Handle, Stream

PRIMARY = "primary"
# kvs.lookup flags / commit flags and op flags / kvs-watch flags
SYNC = 4
APPEND = 32
TREEOBJ = 16
WATCH = 4
WAITCREATE = 8
WATCH_APPEND = 256


def val(data: bytes) -> dict[str, Any]:
    return {"ver": 1, "type": "val", "data": data}


def put_op(key: str, data: bytes, flags: int = 0) -> dict[str, Any]:
    return {"key": key, "flags": flags, "dirent": val(data)}


def commit(h: Handle, ops: list[dict[str, Any]], namespace: str = PRIMARY,
           flags: int = 0) -> asyncio.Future[Any]:
    """``kvs.commit`` -> ``{rootref, rootseq}``."""
    return h.rpc("kvs.commit", {"namespace": namespace, "flags": flags, "ops": ops})


def lookup(h: Handle, key: str, namespace: str = PRIMARY,
           flags: int = 0) -> asyncio.Future[Any]:
    """``kvs.lookup`` -> ``{val: treeobj}``."""
    return h.rpc("kvs.lookup", {"key": key, "flags": flags, "namespace": namespace})


def wait_version(h: Handle, rootseq: int, namespace: str = PRIMARY) -> asyncio.Future[Any]:
    return h.rpc("kvs.wait-version", {"namespace": namespace, "rootseq": rootseq})


def watch(h: Handle, key: str, namespace: str = PRIMARY, flags: int = WATCH) -> Stream:
    """``kvs-watch.lookup`` (streaming)."""
    return h.rpc_stream("kvs-watch.lookup", {"namespace": namespace, "key": key,
                                             "flags": flags})


def cancel(h: Handle, stream: Stream) -> None:
    """``kvs-watch.cancel`` on the handle that started ``stream`` (no response;
    the stream then ends with ENODATA)."""
    h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag})


def value_of(resp: Any) -> bytes | None:
    """The bytes of a lookup/watch answer ``{val: {type: val, data}}``."""
    if not isinstance(resp, dict):
        return None
    v = resp.get("val")
    if isinstance(v, dict):
        v = v.get("data")
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, str):
        return v.encode()
    return None


async def window(coros: Any, limit: int) -> list[Any]:
    """Await an iterable of awaitables with at most ``limit`` in flight."""
    results: list[Any] = []
    pending: set[asyncio.Future[Any]] = set()
    for aw in coros:
        pending.add(asyncio.ensure_future(aw))
        if len(pending) >= limit:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            results.extend(d.result() for d in done)
    if pending:
        done, _ = await asyncio.wait(pending)
        results.extend(d.result() for d in done)
    return results
