"""A command run on a rank of another host through its ``rexec`` service
(:mod:`broker.rexec`), shaped as ``kvbroker exec`` handles a local one
(:class:`broker.command.Command`): its output read as it comes, its input
written through a pipe of ours (so exec's input broadcast treats it as any
command's), signals passed on, and its exit status awaited.

The output is credited back to the rank (``rexec.credit``) as it is read
from here, so a reader that does not keep up holds the command back
(the rank reads no more past its window) instead of filling memory; the
input is written one ``rexec.write`` at a time, each answered once it is
in the command's pipe, so a command that does not read holds exec's input
back through our pipe, as a local one does through its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from broker import pipes
from broker.errors import ErrnoError


class RemoteOutput:
    """A command's stdout or stderr as it arrives: ``await read(n)``, as an
    ``asyncio.StreamReader`` (empty at the end); each chunk read is
    credited to the rank.  :meth:`close` lets it go as a local pipe's
    reader closes the pipe (``closed``: the rank closes its read end, so
    the command's next write to it gets SIGPIPE from the kernel, the
    process that wrote alone, as a local one does)."""

    def __init__(self, credit: Any, closed: Callable[[], None]) -> None:
        self._chunks: deque[bytes] = deque()
        self._eof = False
        self._closed = False
        self._ready = asyncio.Event()
        self._credit = credit
        self._on_close = closed

    def feed(self, data: bytes) -> None:
        if not data:
            return
        if self._closed:
            self._credit(len(data))  # (dropped: the command must not wait for credit)
            return
        self._chunks.append(data)
        self._ready.set()

    def end(self) -> None:
        self._eof = True
        self._ready.set()

    async def read(self, n: int = -1) -> bytes:
        while not self._chunks and not self._eof:
            self._ready.clear()
            await self._ready.wait()
        if not self._chunks:
            return b""
        chunk = self._chunks.popleft()
        if 0 < n < len(chunk):
            chunk, rest = chunk[:n], chunk[n:]
            self._chunks.appendleft(rest)
        self._credit(len(chunk))
        return chunk

    def close(self) -> None:
        """No more is read (exec's own output was closed: EPIPE).  What
        waits unread is dropped and credited, so the command writes on and
        meets its SIGPIPE: without that it waited for credit for ever, and
        exec for its end."""
        if self._closed:
            return
        self._closed = True
        dropped = sum(map(len, self._chunks))
        self._chunks.clear()
        if dropped:
            self._credit(dropped)
        if not self._eof:
            self._on_close()


class RemoteCommand:
    """``cmd`` running on rank ``rank`` (started by :meth:`start`)."""

    def __init__(self, h: Any, rank: int, stream: Any, pid: int, stdin: bool) -> None:
        self.h = h
        self.rank = rank
        self.pid = pid
        self._stream = stream
        self.stdout = RemoteOutput(self._credit, lambda: self._close_output("stdout"))
        self.stderr = RemoteOutput(self._credit, lambda: self._close_output("stderr"))
        self.error: ErrnoError | None = None
        """Why the command's stream failed (its rank was lost...), if it did."""
        self._status: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.stdin: IO[bytes] | None = None
        """The write end of a pipe whose other end is copied to the command's input."""
        self._tasks = [asyncio.ensure_future(self._answers())]
        if stdin:
            r, w = os.pipe()
            self.stdin = os.fdopen(w, "wb", buffering=0)
            self._tasks.append(asyncio.ensure_future(self._copy_input(r)))

    @classmethod
    async def start(cls, h: Any, rank: int, cmd: list[str], env: dict[str, str],
                    cwd: str | None, stdin: bool) -> RemoteCommand:
        """Start ``cmd`` on ``rank``; raises ``OSError`` (the ``errno`` of
        ``execve`` there) if it cannot be started."""
        stream = h.rpc_stream("rexec.exec", {"cmd": cmd, "env": env, "cwd": cwd,
                                             "stdin": stdin}, nodeid=rank)
        try:
            first = await anext(aiter(stream))
        except ErrnoError as exc:
            raise OSError(exc.errnum, exc.errstr or os.strerror(exc.errnum)) from None
        except StopAsyncIteration:
            raise OSError(errno.EPROTO, f"rank {rank} ended rexec.exec at once") from None
        if not isinstance(first, dict) or first.get("type") != "started":
            raise OSError(errno.EPROTO, f"rank {rank}: rexec.exec answered {first!r}")
        return cls(h, rank, stream, int(first["pid"]), stdin)

    @property
    def returncode(self) -> int | None:
        return self._status.result() if self._status.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._status)

    async def _answers(self) -> None:
        outputs = {"stdout": self.stdout, "stderr": self.stderr}
        try:
            async for answer in self._stream:
                kind = answer.get("type") if isinstance(answer, dict) else None
                if kind == "output" and answer.get("stream") in outputs:
                    out = outputs[answer["stream"]]
                    if answer.get("eof"):
                        out.end()
                    else:
                        out.feed(bytes(answer.get("data") or b""))
                elif kind == "finished" and not self._status.done():
                    self._status.set_result(int(answer["status"]))
        except ErrnoError as exc:
            self.error = exc
        finally:
            for out in outputs.values():
                out.end()
            if not self._status.done():
                if self.error is None:
                    self.error = ErrnoError(errno.EPROTO, "the stream ended without a status")
                self._status.set_result(1)

    async def _copy_input(self, fd: int) -> None:
        """Our pipe's contents to the command's input, a write at a time."""
        reader = asyncio.StreamReader()
        transport, _ = await pipes.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
        try:
            while True:
                chunk = await reader.read(1 << 16)
                await self.h.rpc("rexec.write", {"pid": self.pid, "data": chunk,
                                                 "eof": not chunk}, nodeid=self.rank)
                if not chunk:
                    return
        except ErrnoError:
            return  # (EPIPE: it takes no more; closing our end tells the broadcast)
        finally:
            transport.close()

    def _credit(self, nbytes: int) -> None:
        if not self._status.done():
            with contextlib.suppress(Exception):
                self.h.send_noresponse("rexec.credit", {"pid": self.pid, "bytes": nbytes},
                                       nodeid=self.rank)

    def _close_output(self, stream: str) -> None:
        """We read no more of ``stream``: the rank closes its read end
        (``rexec.close-output``), so the process that writes to it next gets
        SIGPIPE from the kernel, as with a local pipe.  (Before, SIGPIPE went
        to the command's whole process group: a script whose writer died so
        did not go on to its last lines, as it does locally.)  A rank that
        does not know the request (an older kvbroker, ``ENOSYS``) gets that
        SIGPIPE to the group, as before."""
        if self._status.done():
            return

        async def send() -> None:
            try:
                await self.h.rpc("rexec.close-output", {"pid": self.pid, "stream": stream},
                                 nodeid=self.rank)
            except ErrnoError as exc:
                if exc.errnum == errno.ENOSYS:
                    self.signal(signal.SIGPIPE)
            except OSError:
                pass

        self._tasks.append(asyncio.ensure_future(send()))

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command's process group on its rank."""
        if self._status.done():
            return

        async def send() -> None:
            with contextlib.suppress(ErrnoError, OSError):
                await self.h.rpc("rexec.kill", {"pid": self.pid, "signum": int(sig)},
                                 nodeid=self.rank)

        self._tasks.append(asyncio.ensure_future(send()))

    def forward(self, sig: int) -> None:
        self.signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def stop(self, timeout: float) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; its status."""
        self.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.wait()
        self.kill()
        return await self.wait()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
