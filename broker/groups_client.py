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

A watch (``watch``, ``wait_for``, ``barrier``) is a streaming ``groups.get``
at rank 0.  Whenever one stops reading it -- returned, left by ``break`` or
``aclose()``, an error, a cancellation or a timeout -- it sends
``groups.cancel`` for it, so nothing is left on rank 0 (answering it at
every change of the group) nor in the handle: one per call, for as long as
the connection lasts, for a service that runs a barrier per job.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from broker.errors import RemoteError
from broker.idset import decode_ranks
from broker.rpc import HandleCore, Stream, check_str

ALL_RANKS = 1 << 32
"""The bound an answer's ranks are read against (rank 0 checked them)."""


def members(answer: dict[str, str]) -> set[int]:
    return decode_ranks(answer["members"], ALL_RANKS)


def _end(h: HandleCore, stream: Stream) -> None:
    """Stop reading ``stream`` (a ``groups.get`` at rank 0): cancel it
    there, by the path it took (the same client: its route and matchtag),
    and retire its tag -- what it still sends is dropped, and the tag is
    issued again once its ``ENODATA`` end comes.  Nothing to do for a
    stream that has ended (the rank forgot it), nor once the handle is
    closed (the connection's end did it)."""
    if stream.done:
        return
    with contextlib.suppress(RemoteError, OSError):  # (the handle is closed)
        h.send_noresponse("groups.cancel", {"matchtag": stream.matchtag}, nodeid=0)
    h.retire(stream.matchtag)


class Groups:
    """The groups of the instance ``h`` is attached to (the module must be
    loaded on every rank: ``-S broker.modules=...,groups``)."""

    def __init__(self, h: HandleCore) -> None:
        self.h = h

    async def join(self, name: str) -> None:
        """Make the handle's rank a member of ``name`` until :meth:`leave`
        (or the handle's connection goes); returns once rank 0 knows.
        ``EEXIST`` if the rank is a member already."""
        await self.h.rpc("groups.join", {"name": check_str(name, "a group's name")})

    async def leave(self, name: str) -> None:
        """End the membership this handle made (``ENOENT`` if it made none)."""
        await self.h.rpc("groups.leave", {"name": check_str(name, "a group's name")})

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
        return members(await self.h.rpc("groups.get", {"name": check_str(name, "a group's name")},
                                        nodeid=0))

    async def watch(self, name: str) -> AsyncGenerator[set[int], None]:
        """The members now, then again at every change.  To stop: ``break``
        (the loop's async-generator finaliser then closes it, on its next
        turn), ``aclose()`` it (at once: ``contextlib.aclosing``), or cancel
        the task; either way the watch is cancelled at rank 0."""
        stream = self.h.rpc_stream("groups.get", {"name": check_str(name, "a group's name")},
                                   nodeid=0)
        try:
            async for answer in stream:
                yield members(answer)
        finally:
            _end(self.h, stream)

    async def wait_for(self, name: str, count: int, *, join: bool = False,
                       seen: Callable[[set[int]], None] | None = None) -> None:
        """Return once ``name`` has ``count`` members (0: once it is
        empty); with ``join``, join it first -- after the watch is asked,
        which thus reaches rank 0 before the join (one path, in order) and
        cannot miss the group full, however soon the others leave.  Its
        watch is cancelled at rank 0 as it returns, or is cancelled (a
        timeout around it), or fails.  ``seen``: called with the members
        at each answer (so a timeout around it can say how far it got).
        A ``count`` that is not an int from 0 to the instance's size is a
        ``TypeError``/``ValueError`` before anything is asked (``"2"``,
        ``2.5``, ``-1`` or 5 of 4 ranks waited for ever)."""
        check_str(name, "a group's name")
        await self._check_count(count)
        await self._wait_for(name, count, join, seen, None)

    async def _wait_for(self, name: str, count: int, join: bool,
                        seen: Callable[[set[int]], None] | None,
                        joined: list[bool] | None) -> None:
        """:meth:`wait_for`, checked; ``joined`` holds True from the moment
        its join is sent until the rank refuses it (the join may have been
        made then, whatever comes after)."""
        stream = self.h.rpc_stream("groups.get", {"name": name}, nodeid=0)
        try:
            if join:
                if joined is not None:
                    joined.append(True)
                try:
                    await self.join(name)
                except RemoteError:
                    if joined is not None:
                        joined.clear()  # (refused: EEXIST, a membership not ours)
                    raise
            async for answer in stream:
                now = members(answer)
                if seen is not None:
                    seen(now)
                if len(now) == count:
                    return
        finally:
            _end(self.h, stream)

    async def barrier(self, name: str, count: int | None = None, *,
                      seen: Callable[[set[int]], None] | None = None) -> None:
        """Join ``name``, wait until it has ``count`` members (default:
        every rank), leave: called once on each rank, every call returns
        once all have come (``seen``: as :meth:`wait_for`'s)."""
        check_str(name, "a group's name")
        if count is None:
            count = await self._size()
        await self._check_count(count)
        joined: list[bool] = []
        try:
            await self._wait_for(name, count, True, seen, joined)
        except BaseException:
            # A timeout around it, a cancel, a failure after its join: not a
            # member after (a second try failed EEXIST, already a member).
            # Only its own join is undone: a membership the handle held
            # before (the join refused EEXIST) stays.
            if joined:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._leave_if_member(name))
            raise
        await self.leave(name)

    async def _leave_if_member(self, name: str) -> None:
        try:
            await self.leave(name)
        except RemoteError as exc:
            if exc.errnum != errno.ENOENT:  # (cancelled before its join was made)
                raise

    async def _size(self) -> int:
        return int((await self.h.rpc("attr.get", {"name": "size"}))["value"])

    async def _check_count(self, count: Any) -> None:
        if isinstance(count, bool) or not isinstance(count, int):
            raise TypeError(f"count must be an int, not {type(count).__name__}")
        if count < 0:
            raise ValueError(f"count must be at least 0, not {count}")
        size = await self._size()
        if count > size:
            raise ValueError(f"count {count} is more than the instance's {size} ranks: "
                             "it would wait for ever")
