"""W0: the yardsticks -- raw round trips with no broker in between.

Two processes ping-pong a small msgpack map ({"topic", "seq"}), each side
unpacking and packing it as an RPC would:

* ``zmq-blocking`` -- DEALER/ROUTER over ``ipc://``, plain blocking pyzmq.
* ``zmq-asyncio`` -- the same through ``zmq.asyncio`` on the rep's loop.
* ``unix-blocking`` -- a Unix stream socket, u32-length-prefixed frames.
* ``unix-asyncio`` -- the same with asyncio Protocols on the rep's loop
  (the shape of the broker's local connector).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Any

import msgpack
import zmq

from benchmarks.harness import (
    RepContext,
    Sample,
    Workload,
    blocking_section,
    rate,
    reap,
    spawn,
)

U32 = struct.Struct("<I")
MODES = ("zmq-blocking", "zmq-asyncio", "unix-blocking", "unix-asyncio")
WARMUP = 200


def _msg(i: int) -> dict[str, Any]:
    return {"topic": "w0.ping", "seq": i}


def zmq_blocking_client(endpoint: str, n: int) -> float:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
        send, recv = sock.send, sock.recv
        for i in range(WARMUP):
            send(packb(_msg(i)))
            unpackb(recv())
        t0 = time.perf_counter()
        for i in range(n):
            send(packb(_msg(i)))
            r = unpackb(recv())
        elapsed = time.perf_counter() - t0
        assert r["seq"] == n - 1
        send(packb({"stop": True}))
        recv()
    finally:
        ctx.destroy(linger=0)  # (see zmq_asyncio_client)
    return elapsed


async def zmq_asyncio_client(endpoint: str, n: int) -> float:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
        for i in range(WARMUP):
            await sock.send(packb(_msg(i)))
            unpackb(await sock.recv())
        t0 = time.perf_counter()
        for i in range(n):
            await sock.send(packb(_msg(i)))
            r = unpackb(await sock.recv())
        elapsed = time.perf_counter() - t0
        assert r["seq"] == n - 1
        await sock.send(packb({"stop": True}))
        await sock.recv()
    finally:
        # Closed whatever ends the run: a rep cut off by --timeout left the
        # context to the garbage collector, whose term() blocked the whole
        # runner for good, in C, where no timeout reaches
        ctx.destroy(linger=0)
    return elapsed


def _connect_unix(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return s


def unix_blocking_client(path: str, n: int) -> float:
    s = _connect_unix(path)
    packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    hdr = bytearray(4)
    body = bytearray(1 << 16)

    def recv_exact(buf: bytearray, k: int) -> None:
        view, got = memoryview(buf), 0
        while got < k:
            m = s.recv_into(view[got:k])
            if not m:
                raise ConnectionError("peer closed")
            got += m

    def rt(i: int) -> Any:
        out = packb(_msg(i))
        s.sendall(U32.pack(len(out)) + out)
        recv_exact(hdr, 4)
        (k,) = U32.unpack(hdr)
        recv_exact(body, k)
        return unpackb(body[:k])

    for i in range(WARMUP):
        rt(i)
    t0 = time.perf_counter()
    for i in range(n):
        r = rt(i)
    elapsed = time.perf_counter() - t0
    assert r["seq"] == n - 1
    s.close()
    return elapsed


class _ClientProtocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future[dict[str, Any]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (k,) = U32.unpack_from(buf, pos)
            if end - pos - 4 < k:
                break
            msg = msgpack.unpackb(buf[pos + 4 : pos + 4 + k])
            pos += 4 + k
            w = self.waiter
            if w is not None and not w.done():
                w.set_result(msg)
        if pos:
            del buf[:pos]


async def unix_asyncio_client(path: str, n: int) -> float:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_unix_connection(_ClientProtocol, path)
    packb = msgpack.Packer(use_bin_type=True).pack

    async def rt(i: int) -> Any:
        fut = proto.waiter = loop.create_future()
        out = packb(_msg(i))
        transport.write(U32.pack(len(out)) + out)
        return await fut

    for i in range(WARMUP):
        await rt(i)
    t0 = time.perf_counter()
    for i in range(n):
        r = await rt(i)
    elapsed = time.perf_counter() - t0
    assert r["seq"] == n - 1
    transport.close()
    return elapsed


def socket_dir() -> str:
    """A fresh directory for the peer's socket, under ``$TMPDIR`` like any
    temporary file -- unless that path is so long that a socket in it would
    not fit an AF_UNIX address (~107 bytes), then under /tmp, as
    :func:`broker.launch.make_rundir` does."""
    base = tempfile.gettempdir()
    return tempfile.mkdtemp(prefix="kvb-w0-", dir=base if len(base) <= 60 else "/tmp")


async def round_trips(mode: str, n: int, loop: str) -> float:
    """Seconds for ``n`` raw round trips of ``mode`` against a fresh peer process
    (the peer's asyncio side runs on ``loop``)."""
    tmp = socket_dir()
    try:
        address = f"ipc://{tmp}/{mode}" if mode.startswith("zmq") else os.path.join(tmp, mode)
        peer = await spawn("benchmarks.workloads.w0_peer", mode, address, loop)
        try:
            if mode == "zmq-blocking":
                with blocking_section():
                    return zmq_blocking_client(address, n)
            if mode == "zmq-asyncio":
                return await zmq_asyncio_client(address, n)
            if mode == "unix-blocking":
                with blocking_section():
                    return unix_blocking_client(address, n)
            return await unix_asyncio_client(address, n)
        finally:
            await reap(peer)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def run(ctx: RepContext) -> list[Sample]:
    n = ctx.n(10_000, 2_000)
    return [Sample(mode, "rate", rate(n, await round_trips(mode, n, ctx.loop)), "rt/s")
            for mode in MODES]


WORKLOADS = [
    Workload("W0", "raw round trips, no broker (pyzmq DEALER/ROUTER ipc://, Unix socket)",
             "{topic, seq} msgpack map", run),
]
