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

* ``rexec.exec {cmd, env?, cwd?, stdin?, line-buffered?, bg?, waitable?,
  label?}`` (streaming): start ``cmd`` (a list of strings) with ``env``
  (default: the rank's environment) plus ``KVBROKER_URI`` and
  ``KVBROKER_RANK`` naming this rank, in ``cwd`` (default: the rank's), in
  a process group of its own (always: also when the rank was started at a
  terminal), killed if the rank dies.  Its standard input is ``/dev/null``
  unless ``stdin``.  Answers ``{type: "started", pid, rank}``, then
  ``{type: "output", stream: "stdout"|"stderr", data}`` as it writes --
  whole lines (``line-buffered``, the default, as Flux's ``LINE_BUFFER``:
  a line without its newline is held until it comes, the stream ends, or
  :data:`READ_CHUNK` bytes are held), else as read -- and ``{type:
  "output", stream, eof: true}`` at each stream's end, then ``{type:
  "finished", status}`` (its exit status, ``-N`` for signal N) once it has
  exited and both streams have ended, then ``ENODATA``.  A command that
  cannot be started is an error answer with the ``errno`` of ``execve``
  (``ENOENT`` not found, ``EACCES``...), a ``cwd`` that is not there
  ``ENOENT``.

  ``label`` names the command on the rank (``rexec.kill``, ``rexec.wait``
  and ``rexec.list`` take it as well as its pid; Flux's ``flux exec
  --label``): printable, not empty, not a number (a pid), at most
  :data:`MAX_LABEL` characters (``EINVAL``), and unique among the rank's
  commands running or zombie (``EEXIST``).

  ``bg`` (Flux's ``flux exec --bg``) starts a *background* command: it
  belongs to the rank, not to its client -- answered ``started``, then
  ``ENODATA`` at once (nothing more is sent), and not killed when its
  client goes; its input is ``/dev/null`` (``stdin`` is ``EINVAL``).
  What it writes is not sent anywhere: a plain background command's
  standard output and error are ``/dev/null`` (redirect them yourself,
  ``sh -c 'cmd >log 2>&1'``, to keep them); a ``waitable`` one's are read
  by the rank, which keeps the last :data:`RETAINED_OUTPUT` bytes of each
  for ``rexec.wait`` (what came before is dropped, and counted), so it
  never blocks on a full pipe and the rank never holds more.  A
  background command's end is logged on the rank (``kvbroker dmesg``).

  ``waitable`` (with ``bg`` only, else ``EINVAL``): once it has ended the
  command stays on the rank as a *zombie* (state ``Z``) until
  ``rexec.wait`` collects its status; a command that is not waitable is
  forgotten when it ends.
* ``rexec.write {pid, data, eof?}``: give the command bytes of input
  (answered once they are in its pipe: a client that waits for each answer
  never has more than one write in flight); ``eof`` closes its input.
  ``EPIPE`` once it takes no more (it exited, or closed its input, or is
  a background command).
* ``rexec.kill {pid | label, signum}``: a signal to the command's process
  group; any command of the rank (the owner's, as Flux's ``sproc kill``).
  A zombie is ``ESRCH`` (it has exited: there is nothing to signal).
* ``rexec.wait {pid | label, output?, timeout?}``: the status of a waitable command
  once it has ended -- at once for a zombie, else when it ends --
  ``{status}``, with ``output`` also ``{stdout, stderr, stdout-dropped,
  stderr-dropped}`` (the bytes kept, and how many were dropped before
  them); the command is then forgotten (a second wait is ``ESRCH``).
  ``EINVAL`` for a command that is not waitable, ``EBUSY`` while another
  client waits for it (one waiter at a time, as Flux's; the waiter's
  disconnect, or its ``rexec.wait-cancel``, lets another wait).
  ``timeout`` (seconds): ``ETIMEDOUT``
  then, the command kept for a later wait.
* ``rexec.wait-cancel {matchtag}`` (a notice): the sender's own wait of
  that matchtag ends ``ECANCELED``, the command kept (what a client that
  stops waiting sends: else the wait's answer, when the command ends,
  reached nobody, and the command and its status were forgotten).
* ``rexec.list {}``: ``{rank, procs: [{pid, cmd, mine, state, label, bg,
  waitable}]}``, the commands of the rank (``mine``: started by the
  asking client; ``state`` ``R`` running, ``Z`` zombie), as Flux's
  ``rexec.list`` (``flux sproc ps``).
* ``rexec.credit {pid, bytes}`` (no answer): the client has written out
  that much of the output.  At most :data:`OUTPUT_WINDOW` bytes are sent
  and not yet credited: past it the rank stops reading the command's
  output, which then blocks on its full pipe, as a local command does on a
  reader that does not keep up -- nothing is held without bound, nothing
  is lost.
* ``rexec.disconnect`` (the router's, for a client that went): the
  client's commands are killed (SIGKILL to their groups), as a local
  ``exec``'s die with it, and their pipes closed then and there (also
  those no pump had taken yet: :meth:`_Running.release`) -- not its
  background commands, which are the rank's; a wait it had is dropped.

Only the client that started a command may write to it (another one's
``pid`` is ``ESRCH``, as Flux's, which finds the command to write to by
its ``exec`` request); any may list, signal or wait for the rank's
commands (they are all the owner's; a ``pid`` or ``label`` that is not
one of them is ``ESRCH``).  When the rank stops, every command it runs is
killed, background ones too, and its zombies are forgotten: nothing
outlives the rank.

A zombie's process has been reaped: its pid may be given to a new
process.  A pid then names the running command first (``rexec.kill``),
the waitable one first (``rexec.wait``); a label is never ambiguous.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
from collections import Counter
from typing import IO, Any

from broker import attrs as battrs
from broker import pipes
from broker.command import Command
from broker.errors import ErrnoError
from broker.message import Message
from broker.module import Handler, Module, require, require_notice

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
RETAINED_OUTPUT = 1 << 20
"""The most of each stream of a waitable background command the rank
keeps for ``rexec.wait``: its last bytes (Flux keeps 8 KiB in all, its
newest records).  A rank with N such commands holds at most 2N MiB."""
MAX_LABEL = 128
"""The longest label (characters): a name to type and to show in a table."""
MAX_WAIT_TIMEOUT = 365 * 24 * 3600.0
"""A ``rexec.wait`` ``timeout`` past this (a year) waits this long: the
loop's timers take no bigger delay (uvloop's are 64-bit milliseconds)."""


class OutputTail:
    """The last ``limit`` bytes of a stream, and how many came before them
    (dropped): a daemon that writes for days costs the rank no more than
    one that writes a line.  (A waitable background command's streams
    here; a cron task's output, :mod:`broker.cron`.)"""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        over = len(self.data) - self.limit
        if over > 0:
            del self.data[:over]  # (from the front: no copy in CPython)
            self.dropped += over


class _Running:
    """A command this rank started for a client, until it has ended (and,
    waitable, until its status is collected)."""

    def __init__(self, msg: Message, cmd: Command, argv: list[str], lines: bool, *,
                 bg: bool = False, waitable: bool = False, label: str = "") -> None:
        self.msg = msg
        self.route = tuple(msg.route)
        """The client that started it."""
        self.cmd = cmd
        self.argv = argv
        self.lines = lines
        """Output is sent a whole line at a time (``line-buffered``)."""
        self.bg = bg
        """A background command: the rank's, not its client's."""
        self.waitable = waitable
        self.label = label
        self.kept: dict[str, OutputTail] | None = (
            {name: OutputTail(RETAINED_OUTPUT) for name in ("stdout", "stderr")}
            if waitable else None)
        """A waitable command's output, kept for ``rexec.wait``."""
        self.status: int | None = None
        """A zombie's exit status (set once it has ended, if waitable)."""
        self.waiter: Message | None = None
        """The ``rexec.wait`` to answer when it ends."""
        self.wait_timer: asyncio.TimerHandle | None = None
        """Ends :attr:`waiter` at its ``timeout`` (:meth:`RexecService.wait`)."""
        self.unacked = 0
        """Output bytes sent and not yet credited."""
        self.room = asyncio.Event()
        self.room.set()
        self.stdin: asyncio.StreamWriter | None = None
        self.pipes: dict[str, IO[bytes]] = {
            name: pipe for name, pipe in (("stdout", cmd.proc.stdout),
                                          ("stderr", cmd.proc.stderr)) if pipe is not None}
        """Its output pipes that no pump has taken yet, this object's to
        close (:meth:`release`); a pump takes its pipe out of here as it
        hands it to the loop, and closes it from then on."""
        self.readers: dict[str, asyncio.BaseTransport] = {}
        """The transport each pump reads its output pipe through."""
        self.closed_outputs: set[str] = set()
        """Outputs its client reads no more of (``rexec.close-output``)."""
        self.task: asyncio.Task[None] | None = None
        self.over = False
        """It has ended, been killed or been dropped (:meth:`RexecService._end_run`)."""

    @property
    def key(self) -> tuple[tuple[str, ...], int]:
        return self.route, self.cmd.pid

    def name(self) -> str:
        """``pid N``, or ``pid N (label L)``: what a message calls it."""
        return f"pid {self.cmd.pid}" + (f" (label {self.label})" if self.label else "")

    def credit(self, nbytes: int) -> None:
        self.unacked = max(0, self.unacked - nbytes)
        if self.unacked < OUTPUT_WINDOW:
            self.room.set()

    def release(self) -> None:
        """Close the pipes this object still owns: the input's writer and
        the output pipes no pump took (its task was cancelled before they
        started: the command's client went at once, or the rank stops).
        Without this they were left to the garbage collector."""
        if self.stdin is not None:
            self.stdin.close()
        while self.pipes:
            pipes.close_pipe(self.pipes.popitem()[1])


def check_label(label: str) -> None:
    """Raise ``EINVAL`` unless ``label`` can name a command: it is typed
    (not empty, printable, short) and told from a pid (not all digits:
    ``sproc kill 15 1234`` reads a pid)."""
    if not label or not label.isprintable() or label.strip() != label:
        raise ErrnoError(errno.EINVAL, f"label {label!r}: a label is printable text, not "
                         "empty, without leading or trailing spaces")
    if label.isdigit():
        raise ErrnoError(errno.EINVAL, f"label {label!r}: a label must not be a number "
                         "(it would be read as a pid)")
    if len(label) > MAX_LABEL:
        raise ErrnoError(errno.EINVAL, f"label of {len(label)} characters: at most "
                         f"{MAX_LABEL}")


class RexecService:
    """The ``rexec.*`` requests of a rank, served by ``module`` (the
    broker's own services: its handle answers, its tasks supervise)."""

    def __init__(self, module: Module) -> None:
        self.module = module
        self.ctx = module.ctx
        self.running: dict[tuple[tuple[str, ...], int], _Running] = {}
        """The commands running, by (the client's route, pid)."""
        self.zombies: list[_Running] = []
        """Waitable commands that have ended, until waited for (oldest first)."""
        self.labels: dict[str, _Running] = {}
        """The labelled commands, running or zombie, by label."""
        self.stopping = False
        self.counts: Counter[str] = Counter()

    def handlers(self) -> dict[str, Handler]:
        return {
            "rexec.exec": self.exec_,
            "rexec.write": self.write,
            "rexec.kill": self.kill,
            "rexec.close-output": self.close_output,
            "rexec.wait": self.wait,
            "rexec.wait-cancel": self.wait_cancel,
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
        kept = [t for r in (*self.running.values(), *self.zombies) for t in (r.kept or {}).values()]
        return {"rank": self.ctx.rank, "running": len(self.running),
                "background": sum(r.bg for r in self.running.values()),
                "zombies": len(self.zombies),
                "output-held": sum(r.unacked for r in self.running.values()),
                "output-kept": sum(len(t.data) for t in kept),
                **{k: self.counts[k] for k in ("started", "failed-to-start", "finished",
                                               "killed-at-disconnect", "bg-started",
                                               "waited")}}

    async def stop(self) -> None:
        """The rank stops: nothing it started outlives it, background
        commands included; zombies and waits are dropped."""
        self.stopping = True
        why = f"rank {self.ctx.rank} is stopping: its commands are killed"
        for run in list(self.running.values()):
            run.cmd.kill()
            run.release()
            if not run.msg.answered:
                self.h.respond_error(run.msg, errno.ENOSYS, why)
        for run in (*self.running.values(), *self.zombies):
            waiter = _take_waiter(run)
            if waiter is not None:
                self.h.respond_error(waiter, errno.ENOSYS, why)
        self.running.clear()
        self.zombies.clear()
        self.labels.clear()

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

    def _lookup(self, msg: Message, waiting: bool = False) -> _Running:
        """The command a ``pid`` or a ``label`` names (one of them), any
        client's, running or zombie.  A pid a zombie had and a new command
        has now names the running one, or with ``waiting`` the waitable."""
        p = require(msg.payload)
        pid, label = p.get("pid"), p.get("label")
        if (pid is None) == (label is None):
            raise ErrnoError(errno.EPROTO, "name the command by pid or by label (one of them)")
        if label is not None:
            if not isinstance(label, str):
                raise ErrnoError(errno.EPROTO, "label must be a string")
            run = self.labels.get(label)
            if run is None:
                raise ErrnoError(errno.ESRCH, f"label {label} does not belong to any command "
                                 f"of rank {self.ctx.rank}")
            return run
        if type(pid) is not int:
            raise ErrnoError(errno.EPROTO, "pid must be an integer")
        found = [r for r in (*self.running.values(), *reversed(self.zombies))
                 if r.cmd.pid == pid]
        if not found:
            raise ErrnoError(errno.ESRCH, f"pid {pid} does not belong to any command of rank "
                             f"{self.ctx.rank}")
        if waiting:
            return next((r for r in found if r.waitable), found[0])
        return found[0]

    def list_(self, msg: Message) -> None:
        self._allowed(msg)
        route = tuple(msg.route)
        self.h.respond(msg, {"rank": self.ctx.rank, "procs": [
            {"pid": run.cmd.pid, "cmd": run.argv, "mine": run.route == route,
             "state": "R" if run.status is None else "Z", "label": run.label, "bg": run.bg,
             "waitable": run.waitable}
            for run in (*self.running.values(), *self.zombies)]})

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
        bg, waitable, label = self._background(p, stdin)
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
        output = subprocess.DEVNULL if bg and not waitable else subprocess.PIPE
        try:
            command = Command.spawn(cmd, environ, cwd=cwd,
                                    stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                    stdout=output, stderr=output, own_group=True)
        except OSError as exc:
            self.counts["failed-to-start"] += 1
            raise ErrnoError(exc.errno or errno.ENOEXEC,
                             f"{cmd[0]}: {exc.strerror or exc}") from None
        self.counts["started"] += 1
        self.counts["bg-started"] += bg
        run = _Running(msg, command, cmd, lines and not bg, bg=bg, waitable=waitable,
                       label=label)
        self.running[run.key] = run
        if label:  # (checked free above, with no await between: no other took it)
            self.labels[label] = run
        if command.proc.stdin is not None:  # (ready before the client may write)
            loop = asyncio.get_running_loop()
            try:
                transport, protocol = await pipes.connect_write_pipe(
                    asyncio.streams.FlowControlMixin, command.proc.stdin)
            except BaseException:
                command.kill()
                self.running.pop(run.key, None)
                self._forget(run)
                run.release()
                raise
            run.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
            if run.over or self.stopping:  # (its client went meanwhile, or the rank stops)
                run.release()
                return
        self.h.respond(msg, {"type": "started", "pid": command.pid, "rank": self.ctx.rank})
        if bg:  # (the rank's from now on: its client has nothing more to wait for)
            self.h.respond_error(msg, errno.ENODATA)
        run.task = self.module.spawn(self._supervise(run))

    def _background(self, p: dict[str, Any], stdin: bool) -> tuple[bool, bool, str]:
        """``rexec.exec``'s ``bg``, ``waitable`` and ``label``, checked (a
        label free on the rank)."""
        bg, waitable, label = p.get("bg", False), p.get("waitable", False), p.get("label")
        if not isinstance(bg, bool) or not isinstance(waitable, bool) \
                or not isinstance(label, (str, type(None))):
            raise ErrnoError(errno.EPROTO, "bg and waitable must be booleans, label a string")
        if waitable and not bg:
            raise ErrnoError(errno.EINVAL, "waitable is for a background command (bg: true): "
                             "a command of a client ends with it")
        if bg and stdin:
            raise ErrnoError(errno.EINVAL, "a background command takes no input: its stdin "
                             "is /dev/null")
        if label is not None:  # (given empty: refused, not taken for none)
            check_label(label)
            taken = self.labels.get(label)
            if taken is not None:
                raise ErrnoError(errno.EEXIST, f"label {label} is taken on rank "
                                 f"{self.ctx.rank} by pid {taken.cmd.pid}"
                                 + (" (a zombie: collect it with sproc wait)"
                                    if taken.status is not None else ""))
        return bg, waitable, label or ""

    async def _supervise(self, run: _Running) -> None:
        """Relay the command's output (a background one's: keep it, or
        nothing), then its end."""
        status: int | None = None
        try:
            await asyncio.gather(*(self._pump(run, name) for name in list(run.pipes)))
            status = await run.cmd.wait()
            self.counts["finished"] += 1
            if not run.bg:
                self.h.respond(run.msg, {"type": "finished", "status": status})
                self.h.respond_error(run.msg, errno.ENODATA)
        except Exception as exc:  # (ours: the client must not wait for ever)
            self.module.log.exception("rexec: relaying pid %d failed", run.cmd.pid)
            if not run.msg.answered:
                self.h.respond_error(run.msg, errno.EIO, f"rank {self.ctx.rank}: relaying "
                                     f"the command's output failed: {exc}")
        finally:
            self._end_run(run, status)

    def _end_run(self, run: _Running, status: int | None) -> None:
        """``run`` is over (once: its task's end and its client's going
        may both say so): what it holds of its pipes closed, its process
        group killed if it has not exited, and it is forgotten or kept
        (:meth:`_ended`)."""
        if run.over:
            return
        run.over = True
        run.release()
        if run.cmd.returncode is None:
            run.cmd.kill()
        if self.running.get(run.key) is run:
            del self.running[run.key]
        self._ended(run, status)

    def _ended(self, run: _Running, status: int | None) -> None:
        """``run`` is over (``status`` None: it was killed by its client's
        going, or the relay failed): a waitable one becomes a zombie, and
        its waiter is answered; any other is forgotten."""
        if run.bg and status is not None:
            self.module.log.info("rexec: %s%s[%d]: %s", f"{run.label}: " if run.label else "",
                                 os.path.basename(run.argv[0]), run.cmd.pid,
                                 describe_status(status))
        if self.stopping:
            return
        if run.waitable and status is not None:
            run.status = status
            self.zombies.append(run)
            self._answer_waiter(run)
            return
        self._forget(run)
        waiter = _take_waiter(run)
        if waiter is not None:
            self.h.respond_error(waiter, errno.EIO, f"rank {self.ctx.rank}: the status of "
                                 f"{run.name()} was lost (see the rank's log)")

    def _forget(self, run: _Running) -> None:
        if run.label and self.labels.get(run.label) is run:
            del self.labels[run.label]

    def _answer_waiter(self, run: _Running) -> None:
        """Answer the wait for ``run`` if it is a zombie and one is waiting:
        its status collected, it is forgotten."""
        if run.waiter is None or run.status is None:
            return
        waiter = _take_waiter(run)
        assert waiter is not None
        answer: dict[str, Any] = {"status": run.status}
        want = waiter.payload.get("output", False) if isinstance(waiter.payload, dict) else False
        if want and run.kept is not None:
            for name, tail in run.kept.items():
                answer[name] = bytes(tail.data)
                answer[f"{name}-dropped"] = tail.dropped
        self.h.respond(waiter, answer)
        self.counts["waited"] += 1
        self.zombies.remove(run)
        self._forget(run)

    async def _pump(self, run: _Running, name: str) -> None:
        """Relay (or keep) one output stream.  Its pipe is the pump's from
        here: closed if the hand-over to the loop fails or is cancelled
        (:mod:`broker.pipes`), else with the transport."""
        pipe = run.pipes.pop(name, None)
        if pipe is None:
            return  # (released: the command is over)
        reader = asyncio.StreamReader(limit=READ_CHUNK)
        transport, _ = await pipes.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        run.readers[name] = transport
        if name in run.closed_outputs:  # (closed by its client before it started)
            transport.close()
        held = b""  # (line-buffered: a line's start, less than READ_CHUNK bytes)
        try:
            if run.kept is not None:  # (a waitable background command: kept, not sent)
                while chunk := await reader.read(READ_CHUNK):
                    run.kept[name].add(chunk)
                return
            while True:
                if name not in run.closed_outputs:
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
        run = self._lookup(msg)
        signum = require(msg.payload, signum=int)["signum"]
        if signum not in {int(s) for s in signal.valid_signals()} or signum == 0:
            raise ErrnoError(errno.EINVAL, f"no signal {signum}")
        if run.status is not None:
            raise ErrnoError(errno.ESRCH, f"{run.name()} has exited (status "
                             f"{describe_status(run.status)}): a zombie until its status "
                             "is collected (kvbroker sproc wait)")
        run.cmd.signal(signum)
        self.h.respond(msg, {})

    def close_output(self, msg: Message) -> None:
        """``rexec.close-output {pid | label, stream}`` -> ``{}``: its client
        reads no more of the command's ``stream`` (``kvbroker exec``'s own
        output closed: EPIPE).  The rank closes its read end of the pipe, as
        a local reader's close does: the process that writes to it next
        gets SIGPIPE from the kernel -- that process alone, not the group.
        What was read already goes out, then the stream's end."""
        self._allowed(msg)
        run = self._lookup(msg)
        name = require(msg.payload, stream=str)["stream"]
        if name not in ("stdout", "stderr"):
            raise ErrnoError(errno.EINVAL, f"no output stream {name!r}: stdout or stderr")
        if name not in run.closed_outputs:
            run.closed_outputs.add(name)
            transport = run.readers.get(name)
            if transport is not None:
                transport.close()  # (its reader then finds the end)
        self.h.respond(msg, {})

    def wait(self, msg: Message) -> None:
        """``rexec.wait``: answered now for a zombie, else when it ends, or
        ``ETIMEDOUT`` at its ``timeout`` (the command kept for a later
        wait).  One waiter at a time, as Flux's (``EBUSY``): a client that
        gives up on its wait says so (``rexec.wait-cancel``) before it may
        wait again."""
        self._allowed(msg)
        if msg.streaming:
            raise ErrnoError(errno.EPROTO, "rexec.wait is a plain request, not a streaming one")
        run = self._lookup(msg, waiting=True)
        output = msg.payload.get("output", False)
        if not isinstance(output, bool):
            raise ErrnoError(errno.EPROTO, "output must be a boolean")
        timeout = msg.payload.get("timeout")
        if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):
            raise ErrnoError(errno.EPROTO, "timeout must be a number of seconds, at least 0")
        if not run.waitable:
            raise ErrnoError(errno.EINVAL, f"{run.name()} is not waitable: only a background "
                             "command started waitable is (kvbroker exec --bg --waitable)")
        if run.waiter is not None:
            raise ErrnoError(errno.EBUSY, f"{run.name()} is already being waited for "
                             "(one wait at a time)")
        run.waiter = msg
        self._answer_waiter(run)
        if run.waiter is msg and timeout is not None:
            run.wait_timer = asyncio.get_running_loop().call_later(
                min(float(timeout), MAX_WAIT_TIMEOUT), self._wait_timed_out, run, msg,
                float(timeout))

    def _wait_timed_out(self, run: _Running, msg: Message, timeout: float) -> None:
        if run.waiter is msg:
            _take_waiter(run)
            self.h.respond_error(msg, errno.ETIMEDOUT, f"{run.name()} has not ended within "
                                 f"{timeout:g}s (it can be waited for again)")

    def wait_cancel(self, msg: Message) -> None:
        """``rexec.wait-cancel {matchtag}`` (a notice; ``{}`` if asked as a
        request): the client's own wait of that matchtag ends ``ECANCELED``
        and the command stays to be waited for.  Sent by a client that gave
        up waiting (``Procs.wait`` cancelled): else the rank answered the
        wait -- to nobody -- once the command ended, and forgot it and its
        status.  Another client's wait, or one ended already, is left."""
        self._allowed(msg)
        tag = require(msg.payload, matchtag=int)["matchtag"]
        route = tuple(msg.route)
        for run in (*self.running.values(), *self.zombies):
            w = run.waiter
            if w is not None and w.matchtag == tag and tuple(w.route) == route:
                _take_waiter(run)
                self.h.respond_error(w, errno.ECANCELED, f"the wait for {run.name()} was "
                                     "cancelled")
                break
        self.h.respond(msg, {})

    def credit(self, msg: Message) -> None:
        """``rexec.credit {pid, bytes}`` (a notice, never answered): the
        client read that much of the command's output."""
        require_notice(msg)
        with contextlib.suppress(ErrnoError):
            run = self._find(msg)
            nbytes = msg.payload.get("bytes") if isinstance(msg.payload, dict) else None
            if type(nbytes) is int and nbytes > 0:
                run.credit(nbytes)

    def disconnect(self, msg: Message) -> None:
        """The client's commands are killed, but not its background ones
        (the rank's); a wait it had is dropped, so another may wait."""
        route = tuple(msg.route)
        for run in [r for r in self.running.values() if r.route == route and not r.bg]:
            self.counts["killed-at-disconnect"] += 1
            run.cmd.kill()  # (its group: also once the command itself has exited)
            self._end_run(run, None)  # (here: a task cancelled before its first step
            #  never runs its finally)
            if run.task is not None:
                run.task.cancel()
        for run in (*self.running.values(), *self.zombies):
            if run.waiter is not None and tuple(run.waiter.route) == route:
                _take_waiter(run)


def _take_waiter(run: _Running) -> Message | None:
    """``run``'s wait, no longer its (its timer stopped), for the caller to
    answer or drop."""
    waiter, run.waiter = run.waiter, None
    if run.wait_timer is not None:
        run.wait_timer.cancel()
        run.wait_timer = None
    return waiter


def describe_status(status: int) -> str:
    """``Exit N``, or the signal's name (``Killed``), as a log line says it."""
    if status >= 0:
        return f"Exit {status}"
    try:
        return signal.strsignal(-status) or f"Signal {-status}"
    except ValueError:
        return f"Signal {-status}"
