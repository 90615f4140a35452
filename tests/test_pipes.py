"""broker/pipes.py: a subprocess's pipe handed to the event loop has one
owner at every moment, whenever the task handing it over is cancelled --
on both loops (uvloop, cancelled midway, closed the descriptor and left
the pipe's file object open on the number: the soak audit's rexec bug).
Real pipes, the real loops; nothing of ours is mocked."""

from __future__ import annotations

import asyncio
import os
from typing import IO, Any

import pytest

from broker import pipes

T = 10.0


def fd_state(pipe: IO[bytes], fd: int, inode: int) -> str:
    """``closed`` (the file object closed, the number not its pipe's any
    more), ``open`` (both still the pipe's), or ``two owners`` (the file
    object open on a number that is closed or is something else now)."""
    try:
        same = os.fstat(fd).st_ino == inode
    except OSError:
        same = False
    if pipe.closed:
        return "closed" if not same else "file object closed, descriptor open"
    return "open" if same else "two owners"


async def hand_over(kind: str, pipe: IO[bytes]) -> tuple[asyncio.BaseTransport, Any]:
    if kind == "read":
        reader = asyncio.StreamReader()
        return await pipes.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                             pipe)
    return await pipes.connect_write_pipe(asyncio.Protocol, pipe)


def new_pipe(kind: str) -> tuple[IO[bytes], int, int, int]:
    """The end ``kind`` of a new pipe as a file object (as ``Popen`` gives
    it), its number and inode, and the other end's number."""
    r, w = os.pipe()
    mine, other = (r, w) if kind == "read" else (w, r)
    return os.fdopen(mine, "rb" if kind == "read" else "wb", buffering=0), mine, \
        os.fstat(mine).st_ino, other


@pytest.mark.both_loops
@pytest.mark.parametrize("kind", ["read", "write"])
@pytest.mark.parametrize("turns", [0, 1, 2, 3])
async def test_a_hand_over_cancelled_at_any_point_leaves_one_owner(kind: str,
                                                                   turns: int) -> None:
    """Cancelled after ``turns`` turns of the loop: before it began (the
    pipe is still the caller's, open), midway (closed: file object and
    descriptor together), or once done (the transport's, open until it is
    closed) -- never a file object open on a descriptor already closed."""
    pipe, fd, inode, other = new_pipe(kind)
    try:
        task = asyncio.ensure_future(hand_over(kind, pipe))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            transport, _ = await asyncio.wait_for(task, T)
        except asyncio.CancelledError:
            transport = None
        state = fd_state(pipe, fd, inode)
        if transport is None:
            assert state == ("open" if turns == 0 else "closed"), state
            if turns == 0:
                pipe.close()
        else:  # (it was done before the cancel came)
            assert state == "open", state
            transport.close()
            await asyncio.sleep(0)  # (the stock loop closes the pipe a turn later)
            await asyncio.sleep(0)
            assert fd_state(pipe, fd, inode) == "closed"
    finally:
        os.close(other)


@pytest.mark.both_loops
async def test_one_cancelled_midway_is_closed_in_the_same_step() -> None:
    """The hand-over is cancelled while it waits for the transport's
    ``connection_made`` (one turn in): the pipe is closed by the time the
    cancellation is seen, before another callback could reuse the number."""
    pipe, fd, inode, other = new_pipe("read")
    try:
        task = asyncio.ensure_future(hand_over("read", pipe))
        await asyncio.sleep(0)  # (it now waits in the loop's connect_read_pipe)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fd_state(pipe, fd, inode) == "closed"
    finally:
        os.close(other)


@pytest.mark.both_loops
async def test_a_pipe_handed_over_is_read_and_closed_with_its_transport() -> None:
    pipe, fd, inode, other = new_pipe("read")
    reader = asyncio.StreamReader()
    transport, _ = await asyncio.wait_for(pipes.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe), T)
    os.write(other, b"data")
    os.close(other)
    assert await asyncio.wait_for(reader.read(), T) == b"data"
    transport.close()
    for _ in range(2):  # (the stock loop closes the pipe a turn later)
        await asyncio.sleep(0)
    assert fd_state(pipe, fd, inode) == "closed"


def test_a_hand_over_the_loop_refuses_closes_the_pipe() -> None:
    """One the stock loop refuses (a regular file is no pipe: ValueError) is
    closed too.  (Not on uvloop: libuv aborts the process on a file it
    cannot watch -- nothing but a pipe is ever handed over here.)"""

    async def refused() -> None:
        f = open(os.path.realpath(__file__), "rb", buffering=0)  # noqa: SIM115 (the call's)
        fd, inode = f.fileno(), os.fstat(f.fileno()).st_ino
        with pytest.raises(ValueError):
            await asyncio.wait_for(pipes.connect_read_pipe(asyncio.Protocol, f), T)
        assert fd_state(f, fd, inode) == "closed"

    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        runner.run(refused())
