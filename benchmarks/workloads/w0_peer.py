"""W0's echo peer: ``python -m benchmarks.workloads.w0_peer MODE ADDRESS LOOP``.

Binds ``ADDRESS`` (an ``ipc://`` endpoint, or a Unix socket path), prints
``ready`` on stdout, then answers each small msgpack map with the same map
(unpacked and packed again, as an RPC service would) until the client says
``{"stop": true}`` (ZeroMQ) or hangs up (Unix socket), or until its stdin
closes (the runner is gone: :mod:`benchmarks.workloads.lifeline`; the
socket and its directory are removed then).

MODE is ``zmq-blocking``, ``zmq-asyncio``, ``unix-blocking`` or
``unix-asyncio``; the asyncio modes run on LOOP (``uvloop``/``asyncio``).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys

import msgpack
import zmq

from benchmarks.workloads.lifeline import Lifeline, remove_socket
from broker.loops import loop_factory

U32 = struct.Struct("<I")


def zmq_blocking(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    recv, send = sock.recv_multipart, sock.send_multipart
    while True:
        ident, body = recv()
        m = unpackb(body)
        send([ident, packb(m)])
        if m.get("stop"):
            break
    sock.close()
    ctx.term()


async def zmq_asyncio(endpoint: str) -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    while True:
        ident, body = await sock.recv_multipart()
        m = unpackb(body)
        await sock.send_multipart([ident, packb(m)])
        if m.get("stop"):
            break
    sock.close()
    ctx.term()


def _recv_exact(conn: socket.socket, buf: bytearray, n: int) -> bool:
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:n])
        if not k:
            return False
        got += k
    return True


def unix_blocking(path: str) -> None:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    print("ready", flush=True)
    conn, _ = srv.accept()
    packb, unpackb = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    hdr = bytearray(4)
    body = bytearray(1 << 16)
    while _recv_exact(conn, hdr, 4):
        (n,) = U32.unpack(hdr)
        if n > len(body):
            body = bytearray(n)
        if not _recv_exact(conn, body, n):
            break
        out = packb(unpackb(body[:n]))
        conn.sendall(U32.pack(len(out)) + out)
    conn.close()
    srv.close()


class _EchoProtocol(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[None]) -> None:
        self.buf = bytearray()
        self.done = done
        self.packb = msgpack.Packer(use_bin_type=True).pack
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (n,) = U32.unpack_from(buf, pos)
            if end - pos - 4 < n:
                break
            out = self.packb(msgpack.unpackb(buf[pos + 4 : pos + 4 + n]))
            self.transport.write(U32.pack(len(out)) + out)  # type: ignore[union-attr]
            pos += 4 + n
        if pos:
            del buf[:pos]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def unix_asyncio(path: str) -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    server = await loop.create_unix_server(lambda: _EchoProtocol(done), path)
    print("ready", flush=True)
    await done
    server.close()


def main(argv: list[str]) -> int:
    mode, address, loop = argv
    Lifeline(on_exit=lambda: remove_socket(address))
    if mode == "zmq-blocking":
        zmq_blocking(address)
    elif mode == "unix-blocking":
        unix_blocking(address)
    else:
        coro = zmq_asyncio if mode == "zmq-asyncio" else unix_asyncio
        with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
            runner.run(coro(address))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
