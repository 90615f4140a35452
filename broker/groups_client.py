"""Python API of the ``groups`` module (broker/groups.py): join a group on
the rank a handle is attached to, read or watch a group's members, wait
for a count, a barrier across ranks.  ``kvbroker groups`` is built on it.

    async with Handle.connect() as h:
        groups = Groups(h)
        async with groups.joined("workers"):       # this rank is a member
            await groups.wait_for("workers", 4)    # until 4 ranks are
        print(await groups.get("broker.online"))   # {0, 1, 2, 3}
        await groups.barrier("step-1")             # every rank, then on

Members are sets of ranks; the wire carries them as idsets (``0-3``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from broker.idset import decode_ranks
from broker.rpc import HandleCore

ALL_RANKS = 1 << 32
"""The bound an answer's ranks are read against (rank 0 checked them)."""


def members(answer: dict[str, str]) -> set[int]:
    return decode_ranks(answer["members"], ALL_RANKS)


class Groups:
    """The groups of the instance ``h`` is attached to (the module must be
    loaded on every rank: ``-S broker.modules=...,groups``)."""

    def __init__(self, h: HandleCore) -> None:
        self.h = h

    async def join(self, name: str) -> None:
        """Make the handle's rank a member of ``name`` until :meth:`leave`
        (or the handle's connection goes); returns once rank 0 knows.
        ``EEXIST`` if the rank is a member already."""
        await self.h.rpc("groups.join", {"name": name})

    async def leave(self, name: str) -> None:
        """End the membership this handle made (``ENOENT`` if it made none)."""
        await self.h.rpc("groups.leave", {"name": name})

    @contextlib.asynccontextmanager
    async def joined(self, name: str) -> AsyncIterator[None]:
        """A member for the block (left at its end, even on an error)."""
        await self.join(name)
        try:
            yield
        finally:
            await self.leave(name)

    async def get(self, name: str) -> set[int]:
        """The members of ``name`` now (empty for a group never joined)."""
        return members(await self.h.rpc("groups.get", {"name": name}, nodeid=0))

    async def watch(self, name: str) -> AsyncIterator[set[int]]:
        """The members now, then again at every change (cancel the
        iteration, or close the generator, to stop)."""
        stream = self.h.rpc_stream("groups.get", {"name": name}, nodeid=0)
        try:
            async for answer in stream:
                yield members(answer)
        finally:
            stream.abandon()  # (the rank forgets it when the connection goes)

    async def wait_for(self, name: str, count: int, *, join: bool = False) -> None:
        """Return once ``name`` has ``count`` members (0: once it is
        empty); with ``join``, join it first -- after the watch is asked,
        which thus reaches rank 0 before the join (one path, in order) and
        cannot miss the group full, however soon the others leave."""
        stream = self.h.rpc_stream("groups.get", {"name": name}, nodeid=0)
        try:
            if join:
                await self.join(name)
            async for answer in stream:
                if len(members(answer)) == count:
                    return
        finally:
            stream.abandon()

    async def barrier(self, name: str, count: int | None = None) -> None:
        """Join ``name``, wait until it has ``count`` members (default:
        every rank), leave: called once on each rank, every call returns
        once all have come."""
        if count is None:
            count = int((await self.h.rpc("attr.get", {"name": "size"}))["value"])
        await self.wait_for(name, count, join=True)
        await self.leave(name)
