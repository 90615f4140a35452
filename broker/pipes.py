"""A subprocess's pipe handed to the event loop, owned by one object at a time.

Reading a command's output through the loop (``connect_read_pipe``), or
writing its input (``connect_write_pipe``), moves its pipe from the
``Popen`` file object to a transport, and the move takes an await (the
transport's ``connection_made``).  A task cancelled in that await -- its
client went, its module stopped -- must leave the pipe neither open nor
with two owners.  uvloop (0.23) leaves two: cancelled there, it closes the
descriptor (the libuv handle it was given had it) but not the file object,
which still holds the number.  Closed later (by the garbage collector, or
the ``Popen``), that object closes whatever the number names by then --
another command's pipe, a client's socket, a pidfd -- under the libuv
handle that now owns it: ``File descriptor N is used by transport``,
``FileExistsError`` and ``EBADF`` in the rank's log, other clients cut
off, and libuv aborting the rank (the soak audit's rexec bug).  The stock
loop closes the file object itself, a turn later.

:func:`connect_read_pipe` and :func:`connect_write_pipe` are the loop's,
with this rule: the pipe is theirs from the call -- returned as the
transport's (closing the transport closes it), or closed before the call
raises, cancelled or not.  The close is in the same step as the loop's
failure, before any other callback of this thread can have been given the
number again; where the loop had closed the descriptor it is a no-op
(``EBADF``, ignored) that only marks the file object closed, which is what
the loop itself does on each transport's close (uvloop closes a pipe
transport's descriptor, then its file object).

A pipe not handed over yet is its file object's: whoever ends the command
without handing it over closes it (:func:`close_pipe`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import IO, TypeVar

P = TypeVar("P", bound=asyncio.BaseProtocol)
T = TypeVar("T")


async def connect_read_pipe(protocol_factory: Callable[[], P],
                            pipe: IO[bytes]) -> tuple[asyncio.ReadTransport, P]:
    """The running loop's ``connect_read_pipe``; ``pipe`` closed if it
    raises or is cancelled."""
    loop = asyncio.get_running_loop()
    return await _handed(loop.connect_read_pipe(protocol_factory, pipe), pipe)


async def connect_write_pipe(protocol_factory: Callable[[], P],
                             pipe: IO[bytes]) -> tuple[asyncio.WriteTransport, P]:
    """The running loop's ``connect_write_pipe``; ``pipe`` closed if it
    raises or is cancelled."""
    loop = asyncio.get_running_loop()
    return await _handed(loop.connect_write_pipe(protocol_factory, pipe), pipe)


async def _handed(connecting: Awaitable[T], pipe: IO[bytes]) -> T:
    try:
        return await connecting
    except (Exception, asyncio.CancelledError):
        # (Not KeyboardInterrupt or SystemExit: uvloop then leaves the
        # transport open, the descriptor with it, and the process is going.)
        close_pipe(pipe)
        raise


def close_pipe(pipe: IO[bytes]) -> None:
    """Close ``pipe``'s file object; a descriptor the loop closed already
    (``EBADF``) is not an error."""
    with contextlib.suppress(OSError):
        pipe.close()


class OutputProtocol(asyncio.StreamReaderProtocol):
    """A pipe read into a StreamReader (a forked rank's standard output, a
    spawner's), closed at the end of file.  (The stream protocol asks to keep a
    half-closed transport open, which uvloop honours: the pipe was left
    open, and the loop could not close.)"""

    def eof_received(self) -> bool:
        super().eof_received()
        return False
