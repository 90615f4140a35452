"""A small blocking facade over :class:`broker.handle.Handle`, for scripts.

    from broker.sync import connect
    with connect() as h:                       # $KVBROKER_URI
        print(h.rpc("broker.ping", {}, nodeid=1))
        for answer in h.rpc_stream("kvs-watch.lookup", {...}):
            ...

It owns a private event loop (``asyncio.Runner``) in the calling thread, so
it cannot be used from inside a running event loop -- use the async API
there.  ``run(coro)`` runs any coroutine of the async API on that loop, which
is how the kvs facade reuses the async client (``h.run(kvs.get(h.aio, k))``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterator
from typing import Any, TypeVar

from broker.handle import Handle
from broker.loops import loop_factory
from broker.message import NODEID_ANY, Message

T = TypeVar("T")


class SyncHandle:
    def __init__(self, uri: str | None = None, *, event_loop: str | None = None) -> None:
        self._runner = asyncio.Runner(loop_factory=loop_factory(event_loop))
        try:
            self.aio: Handle = self._runner.run(Handle.connect(uri))
        except BaseException:
            self._runner.close()
            raise

    def run(self, aw: Awaitable[T], timeout: float | None = None) -> T:
        """Run an awaitable of the async API on this handle's loop."""
        async def wait() -> T:
            async with asyncio.timeout(timeout):
                return await aw
        return self._runner.run(wait())

    def rpc(self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY,
            flags: int = 0, timeout: float | None = None) -> Any:
        async def call() -> Any:
            return await self.aio.rpc(topic, payload, nodeid=nodeid, flags=flags)
        return self.run(call(), timeout)

    def rpc_stream(self, topic: str, payload: Any = None, *, nodeid: int = NODEID_ANY,
                   flags: int = 0) -> Iterator[Any]:
        """Iterate the answers of a streaming RPC (ends at ``ENODATA``)."""
        async def start() -> Any:
            return self.aio.rpc_stream(topic, payload, nodeid=nodeid, flags=flags)
        stream = self.run(start())
        while True:
            msg = self.run(stream.next_message())
            if msg is None:
                return
            yield msg.payload

    def subscribe(self, prefix: str) -> None:
        self.run(self.aio.subscribe(prefix))

    def unsubscribe(self, prefix: str) -> None:
        self.run(self.aio.unsubscribe(prefix))

    def publish(self, topic: str, payload: Any = None, *, private: bool = False) -> int:
        return self.run(self.aio.publish(topic, payload, private=private))

    def recv_event(self, timeout: float | None = None) -> Message:
        return self.run(self.aio.recv_event(), timeout)

    def close(self) -> None:
        try:
            self._runner.run(self.aio.close())
        finally:
            self._runner.close()

    def __enter__(self) -> SyncHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(uri: str | None = None, *, event_loop: str | None = None) -> SyncHandle:
    """Attach to a rank (default ``$KVBROKER_URI``) with a blocking handle."""
    return SyncHandle(uri, event_loop=event_loop)
