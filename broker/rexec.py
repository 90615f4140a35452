"""The ``rexec`` service: run a command on a rank, for a client elsewhere.

``kvbroker exec`` runs a command "attached to" a rank: with that rank's
``KVBROKER_URI``, on that rank's host.  A rank of this host is reached by
starting the command here; a rank of another host (``kvbroker broker``,
one per host) needs someone *there* to start it, which is this service, as
Flux's broker has its subprocess server (``rexec``, RFC 42) for ``flux
exec``.  Every rank has it, built in: one of the broker's own services
(:class:`broker.services.BrokerServices` serves it through
:class:`RexecService`, so it is always there and cannot be removed).  It
is the instance owner's: a command runs as the rank's user, so a guest
may not ask.  On a multi-user instance (``access.allow-guest-user``),
rank 0 serves only the clients connected to it, as Flux's rank 0 refuses
remote ``rexec`` there: a precaution for system instances, whose rank 0
is on a management node that users of the other nodes may not reach.

Requests (docs/protocol.md, "rexec"):

* ``rexec.exec {cmd, env?, cwd?, stdin?, line-buffered?}`` (streaming):
  start ``cmd`` (a list of strings) with ``env`` (default: the rank's
  environment) plus ``KVBROKER_URI`` and ``KVBROKER_RANK`` naming this
  rank, in ``cwd`` (default: the rank's), in a process group of its own
  (always: also when the rank was started at a terminal), killed if the
  rank dies.  Its standard input is ``/dev/null`` unless ``stdin``.
  Answers ``{type: "started", pid, rank}``, then ``{type: "output",
  stream: "stdout"|"stderr", data}`` as it writes -- whole lines
  (``line-buffered``, the default, as Flux's ``LINE_BUFFER``: a line
  without its newline is held until it comes, the stream ends, or
  :data:`READ_CHUNK` bytes are held), else as read -- and ``{type: "output",
  stream, eof: true}`` at each stream's end, then ``{type: "finished",
  status}`` (its exit status, ``-N`` for signal N) once it has exited and
  both streams have ended, then ``ENODATA``.  A command that cannot be
  started is an error answer with the ``errno`` of ``execve`` (``ENOENT``
  not found, ``EACCES``...), a ``cwd`` that is not there ``ENOENT``.
* ``rexec.write {pid, data, eof?}``: give the command bytes of input
  (answered once they are in its pipe: a client that waits for each answer
  never has more than one write in flight); ``eof`` closes its input.
  ``EPIPE`` once it takes no more (it exited, or closed its input).
* ``rexec.kill {pid, signum}``: a signal to the command's process group;
  any command of the rank (the owner's, as Flux's ``sproc kill``).
* ``rexec.list {}``: ``{rank, procs: [{pid, cmd, mine}]}``, the commands
  running on the rank (``mine``: started by the asking client), as Flux's
  ``rexec.list`` (``flux sproc ps``).
* ``rexec.credit {pid, bytes}`` (no answer): the client has written out
  that much of the output.  At most :data:`OUTPUT_WINDOW` bytes are sent
  and not yet credited: past it the rank stops reading the command's
  output, which then blocks on its full pipe, as a local command does on a
  reader that does not keep up -- nothing is held without bound, nothing
  is lost.
* ``rexec.disconnect`` (the router's, for a client that went): the
  client's commands are killed (SIGKILL to their groups), as a local
  ``exec``'s die with it.

Only the client that started a command may write to it (another one's
``pid`` is ``ESRCH``, as Flux's, which finds the command to write to by
its ``exec`` request); any may list or signal the rank's commands (they
are all the owner's; a ``pid`` that is not one of them is ``ESRCH``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
from collections import Counter
from typing import Any

from broker import attrs as battrs
from broker.command import Command
from broker.errors import ErrnoError
from broker.message import Message
from broker.module import Handler, Module, require

OUTPUT_WINDOW = 4 << 20
"""Bytes of a command's output sent to its client and not yet credited
(``rexec.credit``), at most: past it the rank reads no more of it."""
READ_CHUNK = 1 << 16
"""The most of a command's output one answer carries; also the most of a
line held for its newline (``line-buffered``) before it is sent as it is,
as Flux's line buffer is once full."""
MAX_ARGV_BYTES = 1 << 20
"""A command line (with its environment) larger than this is refused
(``E2BIG``), as ``execve`` refuses one past the system's bound."""


class _Running:
    """A command this rank started for a client, until it has ended."""

    def __init__(self, msg: Message, cmd: Command, argv: list[str], lines: bool) -> None:
        self.msg = msg
        self.cmd = cmd
        self.argv = argv
        self.lines = lines
        """Output is sent a whole line at a time (``line-buffered``)."""
        self.unacked = 0
        """Output bytes sent and not yet credited."""
        self.room = asyncio.Event()
        self.room.set()
        self.stdin: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    def credit(self, nbytes: int) -> None:
        self.unacked = max(0, self.unacked - nbytes)
        if self.unacked < OUTPUT_WINDOW:
            self.room.set()


class RexecService:
    """The ``rexec.*`` requests of a rank, served by ``module`` (the
    broker's own services: its handle answers, its tasks supervise)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.ctx = module.ctx
        self.running: dict[tuple[tuple[str, ...], int], _Running] = {}
        """The commands running, by (the client's route, pid)."""
        self.counts: Counter[str] = Counter()

    def handlers(self) -> dict[str, Handler]:
        return {
            "rexec.exec": self.exec_,
            "rexec.write": self.write,
            "rexec.kill": self.kill,
            "rexec.list": self.list_,
            "rexec.credit": self.credit,
            "rexec.disconnect": self.disconnect,
            "rexec.stats-get": self.stats_get,
        }

    @property
    def h(self) -> Any:
        return self.module.h

    def stats_get(self, msg: Message) -> None:
        """``rexec.stats-get`` (``kvbroker stats rexec``): the owner's."""
        self._owner(msg)
        self.h.respond(msg, self.stats())

    def stats(self) -> dict[str, Any]:
        return {"rank": self.ctx.rank, "running": len(self.running),
                "output-held": sum(r.unacked for r in self.running.values()),
                **{k: self.counts[k] for k in ("started", "failed-to-start", "finished",
                                               "killed-at-disconnect")}}

    async def stop(self) -> None:
        """The rank stops: nothing it started outlives it."""
        for run in list(self.running.values()):
            run.cmd.kill()
            if not run.msg.answered:
                self.h.respond_error(run.msg, errno.ENOSYS,
                                     f"rank {self.ctx.rank} is stopping: its commands are killed")
        self.running.clear()

    # -- requests
    @staticmethod
    def _owner(msg: Message) -> None:
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "rexec runs commands as the instance owner: "
                             "it is the instance owner's")

    def _allowed(self, msg: Message) -> None:
        """The owner's; on rank 0 of a multi-user instance, a client of
        rank 0's own (a request that came from another rank has the hop
        it came by on its route)."""
        self._owner(msg)
        if (self.ctx.rank == 0 and len(msg.route) > 1
                and battrs.ALLOW_GUEST_USER.value(self.ctx.attrs)):
            raise ErrnoError(errno.EPERM, "rexec requests from other ranks are not allowed on "
                             "rank 0 of a multi-user instance (access.allow-guest-user)")

    def _find(self, msg: Message) -> _Running:
        pid = require(msg.payload, pid=int)["pid"]
        run = self.running.get((tuple(msg.route), pid))
        if run is None:
            raise ErrnoError(errno.ESRCH, f"no command of yours with pid {pid} runs on rank "
                             f"{self.ctx.rank}")
        return run

    def _find_any(self, msg: Message) -> _Running:
        pid = require(msg.payload, pid=int)["pid"]
        for (_, running_pid), run in self.running.items():
            if running_pid == pid:
                return run
        raise ErrnoError(errno.ESRCH, f"pid {pid} does not belong to any command of rank "
                         f"{self.ctx.rank}")

    def list_(self, msg: Message) -> None:
        self._allowed(msg)
        route = tuple(msg.route)
        self.h.respond(msg, {"rank": self.ctx.rank, "procs": [
            {"pid": pid, "cmd": run.argv, "mine": client == route}
            for (client, pid), run in self.running.items()]})

    async def exec_(self, msg: Message) -> None:
        self._allowed(msg)
        if not msg.streaming:
            raise ErrnoError(errno.EPROTO, "rexec.exec is a streaming request")
        p = require(msg.payload, cmd=list)
        cmd, env, cwd, stdin = p["cmd"], p.get("env"), p.get("cwd"), p.get("stdin", False)
        if not cmd or not all(isinstance(w, str) for w in cmd):
            raise ErrnoError(errno.EPROTO, "cmd must be a list of strings, not empty")
        if env is not None and not (isinstance(env, dict) and all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ErrnoError(errno.EPROTO, "env must be a map of strings")
        lines = p.get("line-buffered", True)
        if (cwd is not None and not isinstance(cwd, str) or not isinstance(stdin, bool)
                or not isinstance(lines, bool)):
            raise ErrnoError(errno.EPROTO, "cwd must be a string, stdin and line-buffered "
                             "booleans")
        size = sum(len(w) + 1 for w in cmd) + sum(len(k) + len(v) + 2
                                                   for k, v in (env or {}).items())
        if size > MAX_ARGV_BYTES:
            raise ErrnoError(errno.E2BIG, f"the command line and environment hold {size} "
                             f"bytes (at most {MAX_ARGV_BYTES})")
        environ = dict(os.environ if env is None else env)
        environ["KVBROKER_URI"] = str(self.ctx.attrs.get("local-uri", ""))
        environ["KVBROKER_RANK"] = str(self.ctx.rank)
        if cwd is not None and not os.path.isdir(cwd):
            raise ErrnoError(errno.ENOENT, f"working directory {cwd}: no such directory on "
                             f"rank {self.ctx.rank}'s host ({self.ctx.attrs.get('hostname')})")
        try:
            command = Command.spawn(cmd, environ, cwd=cwd,
                                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    own_group=True)
        except OSError as exc:
            self.counts["failed-to-start"] += 1
            raise ErrnoError(exc.errno or errno.ENOEXEC,
                             f"{cmd[0]}: {exc.strerror or exc}") from None
        self.counts["started"] += 1
        run = _Running(msg, command, cmd, lines)
        self.running[(tuple(msg.route), command.pid)] = run
        if command.proc.stdin is not None:  # (ready before the client may write)
            loop = asyncio.get_running_loop()
            try:
                transport, protocol = await loop.connect_write_pipe(
                    asyncio.streams.FlowControlMixin, command.proc.stdin)
            except BaseException:
                command.kill()
                self.running.pop((tuple(msg.route), command.pid), None)
                raise
            run.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        self.h.respond(msg, {"type": "started", "pid": command.pid, "rank": self.ctx.rank})
        run.task = self.module.spawn(self._supervise(run))

    async def _supervise(self, run: _Running) -> None:
        """Relay the command's output, then its end."""
        key = (tuple(run.msg.route), run.cmd.pid)
        proc = run.cmd.proc
        try:
            assert proc.stdout is not None and proc.stderr is not None
            await asyncio.gather(self._pump(run, "stdout", proc.stdout),
                                 self._pump(run, "stderr", proc.stderr))
            status = await run.cmd.wait()
            self.counts["finished"] += 1
            self.h.respond(run.msg, {"type": "finished", "status": status})
            self.h.respond_error(run.msg, errno.ENODATA)
        except Exception as exc:  # (ours: the client must not wait for ever)
            self.module.log.exception("rexec: relaying pid %d failed", run.cmd.pid)
            if not run.msg.answered:
                self.h.respond_error(run.msg, errno.EIO, f"rank {self.ctx.rank}: relaying "
                                     f"the command's output failed: {exc}")
        finally:
            if run.stdin is not None:
                run.stdin.close()
            if run.cmd.returncode is None:
                run.cmd.kill()
            self.running.pop(key, None)

    async def _pump(self, run: _Running, name: str, pipe: Any) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=READ_CHUNK)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        held = b""  # (line-buffered: a line's start, less than READ_CHUNK bytes)
        try:
            while True:
                await run.room.wait()
                chunk = await reader.read(READ_CHUNK - len(held))
                if not chunk:
                    if held:
                        self._send(run, name, held)
                    self.h.respond(run.msg, {"type": "output", "stream": name, "eof": True})
                    return
                if run.lines:
                    chunk, held = held + chunk, b""
                    cut = chunk.rfind(b"\n") + 1
                    if 0 < cut < len(chunk) or not cut and len(chunk) < READ_CHUNK:
                        chunk, held = chunk[:cut], chunk[cut:]
                    if not chunk:
                        continue
                self._send(run, name, chunk)
        finally:
            transport.close()

    def _send(self, run: _Running, name: str, data: bytes) -> None:
        self.h.respond(run.msg, {"type": "output", "stream": name, "data": data})
        run.unacked += len(data)
        if run.unacked >= OUTPUT_WINDOW:
            run.room.clear()

    async def write(self, msg: Message) -> None:
        self._allowed(msg)
        run = self._find(msg)
        p = require(msg.payload, data=bytes)
        eof = p.get("eof", False)
        if not isinstance(eof, bool):
            raise ErrnoError(errno.EPROTO, "eof must be a boolean")
        if run.stdin is None or run.stdin.is_closing():
            raise ErrnoError(errno.EPIPE, f"pid {run.cmd.pid} takes no input (stdin was not "
                             "asked for, or it was closed)")
        try:
            if p["data"]:
                run.stdin.write(p["data"])
                await run.stdin.drain()
            if eof:
                run.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            run.stdin.close()
            raise ErrnoError(errno.EPIPE, f"pid {run.cmd.pid} takes no more input") from None
        self.h.respond(msg, {})

    def kill(self, msg: Message) -> None:
        self._allowed(msg)
        run = self._find_any(msg)
        signum = require(msg.payload, signum=int)["signum"]
        if signum not in {int(s) for s in signal.valid_signals()} or signum == 0:
            raise ErrnoError(errno.EINVAL, f"no signal {signum}")
        run.cmd.signal(signum)
        self.h.respond(msg, {})

    def credit(self, msg: Message) -> None:
        with contextlib.suppress(ErrnoError):
            run = self._find(msg)
            nbytes = msg.payload.get("bytes") if isinstance(msg.payload, dict) else None
            if type(nbytes) is int and nbytes > 0:
                run.credit(nbytes)

    def disconnect(self, msg: Message) -> None:
        route = tuple(msg.route)
        for key in [k for k in self.running if k[0] == route]:
            run = self.running.pop(key)
            self.counts["killed-at-disconnect"] += 1
            run.cmd.kill()
            if run.task is not None:
                run.task.cancel()
