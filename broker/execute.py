"""``kvbroker exec``: run a command attached to one rank, or to each of a set.

One rank is the fast path (look its URI up, then become the command); a
set (``-r 0-3``, ``all``, less ``-x``) runs one command per rank at once
and supervises them to the end, copying exec's standard input to each,
as ``flux exec`` does (docs/cli.md, exec).  ``--bg`` hands the command to
each rank's ``rexec`` to run in the background, and exits once all have
started it (``kvbroker sproc`` then lists, signals and waits for them).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
from typing import IO, Any

from broker import pipes
from broker.cliutil import (
    CLIError,
    RankSet,
    UsageError,
    command_args,
    connect,
    each_rank,
    errno_detail,
    print_err,
    run_async,
    timed_out,
)
from broker.command import STOP_SIGNALS
from broker.errors import ErrnoError
from broker.handle import parse_uri
from broker.idset import encode_ranks

EXEC_KILL_AFTER = 5.0
"""How long the commands of ``exec`` on several ranks have after SIGTERM,
once ``-t`` has expired, before SIGKILL: Flux's kill timeout (job-exec)."""
LINE_MAX = 1 << 20
"""The most of a line without a newline a relay holds before it writes it
as a piece of its own (labelled, with ``--label-io``), as Flux's
line-buffered output does once its buffer is full: binary output, or one
huge line, was held whole until a newline or the end, in memory without
bound."""
EXEC_STDIN_BACKLOG = 16 << 20
"""The most of exec's standard input held for the commands of a set: how
far the slowest command still taking input may lag behind what was read.
One copy is kept for all of them (each has its own place in it), so it
bounds exec's memory whatever the number of ranks.  At the bound exec
reads no more until that command takes some, or exits: nothing is lost,
as with flux exec's flow control, and a command that does not read holds
the others back only once they are this far ahead of it."""
STDIN_CHUNK = 65536
"""What one read of exec's standard input asks for, and the most given to
one command's pipe at a time (its capacity, by default)."""
_CANNOT_EXECUTE = (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.EISDIR,
                   errno.ELOOP, errno.ENAMETOOLONG, errno.ETXTBSY)
"""``execve``'s errors for a command that cannot be run (said as a shell
does: 127, 126), as a rank's ``rexec`` answers them."""
EXEC_TIMED_OUT = 124
"""``exec``'s status when ``-t`` expired while its commands ran, as
``timeout(1)``'s: a script can tell it from a command's own failure."""


def cmd_exec(args: argparse.Namespace) -> int:
    """``flux exec``: run the command attached to each rank of ``-r``.  One
    rank (as written, without ``--label-io``) is the fast path it always
    was: look the rank's URI up, then become the command."""
    command = command_args(args.cmdline)
    if not command:
        raise UsageError("no command given")
    _check_background_options(args)
    if args.dir is not None:  # (Flux's -d: the commands' working directory; ours too)
        try:
            os.chdir(args.dir)
        except OSError as exc:
            raise CLIError("exec", detail=f"-d {args.dir}: {exc.strerror}") from None
    given = args.rank is not None
    rankset: RankSet = args.rank if given else RankSet(((0, 0),))
    if args.exclude is not None:
        rankset = rankset.without(args.exclude)
        if rankset.empty():
            raise UsageError(_nothing_left(rankset, args.exclude, given))
    args.rank = rankset
    args.rank_given = given
    if args.bg:
        return exec_background(args, command)
    rank = rankset.single()
    if rank is None or args.label_io:
        return exec_ranks(args, command)
    args.rank = rank  # (what -t's message names)

    async def main() -> str:
        async with await connect() as h:
            return str(await h.attr_get("local-uri", nodeid=rank))

    uri = ""

    async def go() -> int:
        nonlocal uri
        uri = await main()
        return 0

    run_async(args, go)
    if not listening_here(parse_uri(uri)):  # across hosts: the rank runs it (rexec)
        args.rank = rankset
        return exec_ranks(args, command)
    from broker.command import cannot_run_message, cannot_run_status

    env = dict(os.environ, KVBROKER_URI=uri, KVBROKER_RANK=str(rank))
    if args.noinput:  # (else the one command has our stdin itself, as it always had)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    try:
        if not command[0]:  # (execvpe: ValueError, exit 1; a shell says 127)
            raise FileNotFoundError(errno.ENOENT, "command not found", "")
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print_err(cannot_run_message(command[0], exc))
        return cannot_run_status(exc, command[0])
    return 0  # not reached: the command replaced this process


def _check_background_options(args: argparse.Namespace) -> None:
    """``--waitable`` and ``--label`` go with ``--bg`` (as flux exec's
    ``--waitable``), and ``-l`` does not: a usage error, before anything
    runs."""
    if not args.bg:
        if args.waitable or args.label is not None:
            raise UsageError("--waitable and --label are for a background command: add --bg")
        return
    if args.label_io:
        raise UsageError("--label-io labels output, and a background command's is not "
                         "relayed (--bg): leave one out")
    if args.label is not None:
        from broker.rexec import check_label

        try:
            check_label(args.label)
        except ErrnoError as exc:
            raise UsageError(f"--label: {exc.errstr}") from None


def exec_background(args: argparse.Namespace, command: list[str]) -> int:
    """``exec --bg``: start ``command`` in the background on every rank of
    the set, through each rank's ``rexec`` (this host's ranks too: the
    command must be the rank's, for ``sproc`` to list, signal and wait
    for it), print ``RANK: PID`` for each that started (rank order), as
    ``flux exec --bg``, and exit.  A rank that could not start it is said
    on stderr, and the status is then that of a command that cannot run
    (127, 126) or 1; the others' commands run on (``sproc kill``).  ``-t``
    bounds it all: what started is printed, and the ranks that had not
    answered are named (each may still start it: the request was sent)."""
    from broker.sproc_client import Procs  # (here: every kvbroker command imports this module)

    limit: float | None = args.answer_timeout
    args.answer_timeout = None  # (run_async's bound would name no rank)
    env = {k: v for k, v in os.environ.items() if k not in ("KVBROKER_URI", "KVBROKER_RANK")}
    cwd = os.getcwd()

    async def main() -> int:
        pending: set[int] = set()
        got: dict[int, int | ErrnoError] = {}  # (each rank's pid, or why not)

        async def start(h: Any, rank: int) -> None:
            try:
                got[rank] = await Procs(h).start_one(command, rank=rank, waitable=args.waitable,
                                                     label=args.label, env=env, cwd=cwd)
            except ErrnoError as exc:
                got[rank] = exc
            pending.discard(rank)

        try:
            async with asyncio.timeout(limit) as bound, await connect() as h:
                size = int(await h.attr_get("size"))
                ranks = args.rank.ranks(size, "exec")
                if not ranks:
                    assert args.exclude is not None  # (only -x empties a set the instance has)
                    raise UsageError(_nothing_left(args.rank, args.exclude, args.rank_given)
                                     + f" (the instance's ranks are {encode_ranks(range(size))})")
                pending.update(ranks)
                await asyncio.gather(*(start(h, r) for r in ranks))
        except TimeoutError:
            if not bound.expired():
                raise  # (not ours)
            assert limit is not None
            _report_background(command, dict(sorted(got.items())))  # (what did start)
            raise timed_out("exec", sorted(pending), limit) from None
        return _report_background(command, dict(sorted(got.items())))

    return run_async(args, main)


def _report_background(command: list[str], got: dict[int, int | ErrnoError]) -> int:
    """``RANK: PID`` for each rank that started the command, then each
    failure on stderr; the exit status (0 if all started)."""
    from broker.command import cannot_run_status

    for rank, pid in got.items():
        if isinstance(pid, int):
            print(f"{rank}: {pid}")
    sys.stdout.flush()
    status = 0
    for rank, exc in got.items():
        if isinstance(exc, int):
            continue
        if exc.errnum in _CANNOT_EXECUTE and "working directory" not in (exc.errstr or ""):
            print_err(f"exec: rank {rank}: {exc.errstr or os.strerror(exc.errnum)}")
            error = OSError(exc.errnum, exc.errstr)
            status = max(status, cannot_run_status(error, command[0]))
        else:
            print_err(f"exec: rank {rank}: {errno_detail(exc)}")
            status = max(status, 1)
    return status


def _nothing_left(rankset: RankSet, exclude: RankSet, given: bool) -> str:
    """The usage error for ``-x`` taking every rank of ``-r``: flux exec's
    default is every rank, ours rank 0, so ``exec -x 0`` (flux's "all but
    rank 0") is told how to say that here."""
    text = (f"-x {exclude} leaves no rank of -r {RankSet(rankset.ranges, rankset.every)} "
            "to run on")
    if not given:
        text += f" (-r defaults to rank 0, not all: -r all -x {exclude})"
    return text


def exec_ranks(args: argparse.Namespace, command: list[str]) -> int:
    """``exec`` on several ranks: a command per rank, all at once, supervised
    to the end (docs/cli.md, exec).  ``-t`` bounds all of it here, not only
    the look-ups: ``exec`` stays, so it can stop what overstays."""
    limit: float | None = args.answer_timeout
    args.answer_timeout = None  # (run_async's bound would only say "no answer")
    # Stdin closed (`exec <&-`): nothing to copy.  Asked before the loop
    # starts, which may then take fd 0 for its own (not ours to read).
    noinput = args.noinput or not _is_open(0)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        uris = await _exec_lookup(args.rank, deadline, limit, args.exclude, args.rank_given)
        return await _exec_run(command, uris, args.label_io, noinput, deadline, limit)

    return run_async(args, main)


def listening_here(path: str) -> bool:
    """Whether a rank's socket ``path`` is one a process of this host
    listens on: the rank is of this host, and its command runs here.  Across
    hosts the path names a file of another host, absent here -- or present
    and stale: left by a rank of this host that died, on a run directory
    that had the same name (the file alone once made exec run the command
    here, attached to nothing).  A connection refused, or no socket there,
    is a rank elsewhere, run through its ``rexec``.  (The probe is a
    connection the rank accepts and sees closed at once; it logs nothing.)"""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except BlockingIOError:
        return True  # (listening, its backlog full: a busy rank of this host)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _is_open(fd: int) -> bool:
    """Whether ``fd`` is open: a closed stdin is no input, not an error."""
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


async def _exec_lookup(rankset: RankSet, deadline: float | None, limit: float | None,
                       exclude: RankSet | None = None, given: bool = True) -> dict[int, str]:
    """Every rank's local URI, asked of all of them at once; a rank that does
    not answer by ``deadline`` is named, as one rank's ``exec -t`` names
    it (all of them when several do not).  Fails, and nothing runs, if
    ``-x`` (``exclude``) leaves no rank of the instance (``-r all -x 0`` in
    an instance of one rank: a usage error)."""
    pending: set[int] = set()
    try:
        async with asyncio.timeout_at(deadline) as bound, await connect() as h:
            size = int(await h.attr_get("size"))
            ranks = rankset.ranks(size, "exec")
            if not ranks:
                assert exclude is not None  # (only -x empties a set the instance has)
                raise UsageError(_nothing_left(rankset, exclude, given) + " (the instance's "
                                 f"ranks are {encode_ranks(range(size))})")
            pending.update(ranks)

            async def lookup(rank: int) -> str:
                uri = str(await h.attr_get("local-uri", nodeid=rank))
                pending.discard(rank)
                return uri

            return dict(zip(ranks, await each_rank("exec", ranks, lookup), strict=True))
    except TimeoutError:
        if not bound.expired():
            raise  # (not ours)
        assert limit is not None
        raise timed_out("exec", sorted(pending), limit) from None


async def _exec_run(command: list[str], uris: dict[int, str], label_io: bool,
                    noinput: bool, deadline: float | None, limit: float | None) -> int:
    """Run ``command`` once per rank, with that rank's ``KVBROKER_URI``, and
    wait for all of them and for the end of their output, which is relayed
    a whole line at a time (:func:`_relay_lines`); their highest status.
    A rank whose socket is not on this host (across hosts) runs its own
    through its ``rexec`` service (:mod:`broker.rexec_client`), with our
    environment and working directory.  Each gets all of our standard
    input (:class:`_StdinBroadcast`), or ``/dev/null`` with ``noinput``.
    SIGINT, SIGTERM and SIGHUP are passed on to every command; past
    ``deadline`` they are stopped, status 124."""
    remote = [rank for rank, uri in uris.items() if not listening_here(parse_uri(uri))]
    if not remote:
        return await _exec_supervise(command, uris, [], None, label_io, noinput, deadline,
                                     limit)
    async with await connect() as h:
        return await _exec_supervise(command, uris, remote, h, label_io, noinput, deadline,
                                     limit)


async def _exec_supervise(command: list[str], uris: dict[int, str], remote: list[int], h: Any,
                          label_io: bool, noinput: bool, deadline: float | None,
                          limit: float | None) -> int:
    """:func:`_exec_run`'s work, with ``h`` attached for the ``remote`` ranks."""
    from broker.command import Command, cannot_run_message, cannot_run_status, exit_code
    from broker.rexec_client import RemoteCommand

    loop = asyncio.get_running_loop()
    cmds: dict[int, Command | RemoteCommand] = {}
    returncodes: dict[int, int] = {}  # (-N: killed by signal N)
    said: set[str] = set()
    early: list[int] | None = []
    """Signals that came while the remote commands were being started: each
    is sent on to them once started (as Flux's rexec holds a signal for a
    process not yet running), else a Ctrl-C then was lost and they ran on."""

    def on_signal(sig: int) -> None:
        if early is not None:
            early.append(sig)
        for cmd in cmds.values():
            cmd.forward(sig)

    for sig in STOP_SIGNALS:  # (run once spawning is over: it does not yield)
        loop.add_signal_handler(sig, on_signal, sig)
    pumps: dict[int, list[asyncio.Task[None]]] = {}
    broadcast: _StdinBroadcast | None = None
    stdins: dict[int, IO[bytes]] = {}

    def cannot_run(rank: int, exc: OSError, where: str = "") -> None:
        message = where + cannot_run_message(command[0], exc)
        if message not in said:  # (the same on every rank: said once)
            said.add(message)
            print_err(message)
        returncodes[rank] = cannot_run_status(exc, command[0])

    try:
        for rank, uri in uris.items():
            if rank in remote:
                continue
            env = dict(os.environ, KVBROKER_URI=uri, KVBROKER_RANK=str(rank))
            try:
                local = Command.spawn(command, env,
                                      stdin=subprocess.DEVNULL if noinput else subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            except OSError as exc:
                cannot_run(rank, exc)
                continue
            cmds[rank] = local
            if local.proc.stdin is not None:
                stdins[rank] = local.proc.stdin
        if remote:
            env = {k: v for k, v in os.environ.items()
                   if k not in ("KVBROKER_URI", "KVBROKER_RANK")}
            started = await asyncio.gather(
                *(RemoteCommand.start(h, rank, command, env, os.getcwd(), not noinput)
                  for rank in remote), return_exceptions=True)
            for rank, got in zip(remote, started, strict=True):
                if isinstance(got, OSError) and got.errno in _CANNOT_EXECUTE \
                        and "working directory" not in (got.strerror or ""):
                    cannot_run(rank, got)  # (as a command of this host: 127, 126)
                elif isinstance(got, OSError):  # (its working directory, a guest...)
                    message = f"exec: rank {rank}: {got.strerror or got}"
                    if message not in said:
                        said.add(message)
                        print_err(message)
                    returncodes[rank] = 1
                elif isinstance(got, BaseException):
                    raise got
                else:
                    cmds[rank] = got
                    for early_sig in early or ():
                        got.forward(early_sig)
                    if got.stdin is not None:
                        stdins[rank] = got.stdin
        early = None  # (from now on every command is in cmds)
        lock = asyncio.Lock()  # (one: both may be one pipe, 2>&1)
        outputs = _Output(sys.stdout, lock), _Output(sys.stderr, lock)
        for rank, cmd in cmds.items():
            label = f"{rank}: ".encode() if label_io else None
            if isinstance(cmd, RemoteCommand):
                readers: tuple[Any, Any] = cmd.stdout, cmd.stderr
            else:
                assert cmd.proc.stdout is not None and cmd.proc.stderr is not None
                readers = (await _pipe_reader(cmd.proc.stdout),
                           await _pipe_reader(cmd.proc.stderr))
            pumps[rank] = [asyncio.ensure_future(_relay_lines(label, readers[0], outputs[0])),
                           asyncio.ensure_future(_relay_lines(label, readers[1], outputs[1]))]
        every_pump = [task for tasks in pumps.values() for task in tasks]
        if not noinput:
            broadcast = _StdinBroadcast(stdins)

        async def exited(rank: int, cmd: Command | RemoteCommand) -> int:
            code = await cmd.wait()
            if broadcast is not None:  # (what it left running gets no more, as in flux)
                broadcast.drop(rank)
            return code

        try:
            async with asyncio.timeout_at(deadline) as bound:
                for rank, code in zip(cmds, await asyncio.gather(
                        *(exited(rank, cmd) for rank, cmd in cmds.items())), strict=True):
                    returncodes[rank] = code
                await asyncio.gather(*every_pump)
        except TimeoutError:
            if not bound.expired():
                raise  # (not ours)
            assert limit is not None
            # still running, or something it left holds its output open
            late = [r for r, cmd in cmds.items() if cmd.returncode is None
                    or not all(task.done() for task in pumps.get(r, []))]
            await asyncio.gather(*(cmds[r].stop(EXEC_KILL_AFTER) for r in late))
            with contextlib.suppress(TimeoutError):  # what they wrote last, if it comes
                async with asyncio.timeout(1.0):
                    await asyncio.gather(*every_pump)
            which = f"rank {late[0]}" if len(late) == 1 else f"ranks {encode_ranks(late)}"
            print_err(f"exec: {os.strerror(errno.ETIME)} ({which} still running after "
                      f"{limit:g}s: stopped)")
            return EXEC_TIMED_OUT
    finally:
        if broadcast is not None:
            broadcast.close()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        for cmd in cmds.values():  # (an error of ours: nothing we started outlives us)
            if cmd.returncode is None:
                cmd.kill()
        for tasks in pumps.values():
            for task in tasks:
                task.cancel()
        for cmd in cmds.values():
            if isinstance(cmd, RemoteCommand):
                if cmd.error is not None:
                    print_err(f"exec: rank {cmd.rank}: {errno_detail(cmd.error)}")
                cmd.close()
    _report_exec_statuses(returncodes)
    return max(exit_code(code) for code in returncodes.values())


def _report_exec_statuses(returncodes: dict[int, int]) -> None:
    """Each status but 0 on stderr with the ranks that had it, as ``flux
    exec`` does: ``kvbroker: exec: ranks 1,3: Exit 3``, ``rank 2:
    Terminated`` -- in the highest status alone, which ranks failed, and
    how, would be lost."""
    by_code: dict[int, list[int]] = {}
    for rank in sorted(returncodes):
        if returncodes[rank]:
            by_code.setdefault(returncodes[rank], []).append(rank)
    for code, ranks in sorted(by_code.items(), key=lambda item: item[1][0]):
        name = f"Exit {code}"
        if code < 0:
            with contextlib.suppress(ValueError):
                name = signal.strsignal(-code) or f"Signal {-code}"
        which = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {encode_ranks(ranks)}"
        print_err(f"exec: {which}: {name}")


class _Output:
    """Our stdout or stderr, as the lines of every command go to it: a
    batch of whole lines at a time (never two commands' mixed in a line),
    and without blocking the loop where it can wait instead.  Written
    whole with a blocking write, a pipe nobody read (a paused pager, a
    stuck consumer) held the loop, so ``-t`` never fired and the signals
    to pass on were never passed: only SIGKILL ended exec.  A pipe, socket
    or terminal is written PIPE_BUF bytes at a time, each once it is
    writable; a file is written as before (it cannot be waited on, nor
    block long).

    ``lock`` is shared by stdout's and stderr's: with both on one pipe or
    terminal (``2>&1``), a batch of one went out in pieces between which
    the other's landed, cutting a line.  The descriptor is shared with the
    shell, so its flags are left as they were given: uvloop's
    ``add_writer`` makes it non-blocking (a terminal then refused a write,
    ``EAGAIN``, and exec ended "Resource temporarily unavailable" with
    the rest of the output lost), so such a write waits again, and the
    blocking mode is put back after each batch."""

    def __init__(self, stream: Any, lock: asyncio.Lock) -> None:
        self.stream = stream
        self.lock = lock
        self.blocking = True
        try:
            self.fd: int | None = stream.fileno()
            mode = os.fstat(self.fd).st_mode
            if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)):
                self.fd = None
            else:
                self.blocking = os.get_blocking(self.fd)
        except (OSError, ValueError, AttributeError):
            self.fd = None

    async def write(self, data: bytes) -> None:
        async with self.lock:
            if self.fd is None:
                self.stream.buffer.write(data)
                self.stream.buffer.flush()
                return
            self.stream.flush()  # (what print() left there goes first)
            view = memoryview(data)
            try:
                while view:
                    await self._writable()
                    try:
                        view = view[os.write(self.fd, view[:select.PIPE_BUF]):]
                    except BlockingIOError:  # (writable, but not for this much)
                        continue
            finally:
                if self.blocking and not os.get_blocking(self.fd):
                    os.set_blocking(self.fd, True)

    async def _writable(self) -> None:
        assert self.fd is not None
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def writable() -> None:
            if not ready.done():
                ready.set_result(None)

        try:
            loop.add_writer(self.fd, writable)
        except (OSError, ValueError, NotImplementedError):
            return  # (not pollable after all, e.g. /dev/null: written at once)
        try:
            await ready
        finally:
            loop.remove_writer(self.fd)


async def _relay_lines(label: bytes | None, reader: Any, out: _Output) -> None:
    """Copy a command's output to ``out`` (our stdout or stderr) whole lines
    at a time, as ``flux exec`` relays its line-buffered output, so lines
    of different ranks never mix within a line: written by the commands
    to our stdout themselves, a command that writes a line in pieces (an
    unbuffered Python writes ``print``'s text and its newline apart) had
    another rank's line land in the middle of it.

    With a ``label`` (``--label-io``) each line is written as ``RANK:
    line`` and a last line without a newline gets one, so the next label
    starts a line; without one the bytes are relayed as written, a last
    partial line as it is.  A line longer than :data:`LINE_MAX` is written
    in pieces (each labelled) as it comes: held whole, and joined again at
    every read, one without a newline took memory without bound and time
    as its square."""
    rest = bytearray()  # (the line begun: grows in place, not copied at each read)
    try:
        while chunk := await reader.read(65536):
            end = chunk.rfind(b"\n")
            if end >= 0:
                whole = bytes(rest) + chunk[:end + 1]
                rest = bytearray(chunk[end + 1:])
            else:
                rest += chunk
                if len(rest) < LINE_MAX:
                    continue
                whole, rest = bytes(rest), bytearray()
            await out.write(whole if label is None else _labelled(label, whole))
        if rest:
            await out.write(bytes(rest) if label is None else _labelled(label, bytes(rest)))
    finally:
        reader.close()


class _PipeReader(asyncio.StreamReader):
    """A local command's pipe, read by the loop; :meth:`close` lets it go."""

    transport: asyncio.BaseTransport | None = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def _pipe_reader(pipe: IO[bytes]) -> _PipeReader:
    reader = _PipeReader()
    reader.transport, _ = await pipes.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader


def _labelled(label: bytes, data: bytes) -> bytes:
    """``data``'s lines each as ``label`` + line + newline (one without a
    newline at the end of ``data`` gets one)."""
    lines = data.split(b"\n")
    if not lines[-1]:
        lines.pop()
    return b"".join(label + line + b"\n" for line in lines)


class _StdinBroadcast:
    """exec's standard input copied to every command's, as ``flux exec``
    does by default: each gets every byte, then EOF when our input ends.

    Our stdin is read by a thread, a chunk at a time and only when asked:
    a blocking read works on any file (a regular file cannot be watched by
    epoll) and leaves its flags alone (made non-blocking, a terminal or a
    pipe shared with the shell would stay so after exec).  One copy of what
    was read is kept, each command with its place in it, and given to each
    command's pipe (non-blocking, ours alone) as it takes it.  A command
    that exits, closes its stdin or dies (EPIPE) is given no more and holds
    nothing back; the others lag as they like up to
    :data:`EXEC_STDIN_BACKLOG` behind what was read, and at that bound the
    reading waits for the slowest (back-pressure: nothing is dropped)."""

    def __init__(self, pipes: dict[int, IO[bytes]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._pipes = dict(pipes)
        """The write end of each command's stdin, until it gets EOF or is dropped."""
        self._taken = dict.fromkeys(pipes, 0)
        """How much of the input each command has been given."""
        self._data = bytearray()  # what some command still has to take
        self._start = 0  # (where _data begins in the input)
        self._eof = False
        self._reading = False  # (a read asked of the thread, its chunk not yet here)
        self._watched: set[int] = set()
        self._closed = False
        self._go = threading.Event()
        for pipe in pipes.values():
            os.set_blocking(pipe.fileno(), False)
        threading.Thread(target=self._read, name="exec-stdin", daemon=True).start()
        self._settle()

    def _read(self) -> None:
        """(The thread.)  Read a chunk each time it is asked to, and hand it
        to the loop; an empty one is the end.  Left blocked in a read (a
        terminal, a pipe nobody writes) when exec ends: it holds nothing."""
        while True:
            self._go.wait()
            self._go.clear()
            if self._closed:
                return
            error: OSError | None = None
            try:
                chunk = os.read(0, STDIN_CHUNK)
            except OSError as exc:
                chunk, error = b"", exc
            try:
                self._loop.call_soon_threadsafe(self._got, chunk, error)
            except RuntimeError:  # the loop is closed: exec is ending
                return
            if not chunk:
                return

    def _got(self, chunk: bytes, error: OSError | None) -> None:
        self._reading = False
        if self._closed:
            return
        if error is not None:  # (a directory, a terminal we may not read: said once)
            print_err(f"exec: reading standard input: {error.strerror or error} "
                      "(the commands get EOF)")
        if chunk:
            self._data += chunk
        else:
            self._eof = True
        for rank in list(self._pipes):
            self._give(rank)
        self._settle()

    def _writable(self, rank: int) -> None:
        self._give(rank)
        self._settle()

    def _give(self, rank: int) -> None:
        """Write to ``rank``'s pipe what it has not had, as much as it takes
        now; watch it for room if some is left; EOF once it has all there
        will ever be."""
        pipe = self._pipes.get(rank)
        if pipe is None:
            return
        end = self._start + len(self._data)
        while (taken := self._taken[rank]) < end:
            at = taken - self._start
            piece = self._data[at:at + STDIN_CHUNK]
            try:
                written = os.write(pipe.fileno(), piece)
            except BlockingIOError:
                break
            except OSError:  # (EPIPE: it takes no more input; exited, or closed it)
                self.drop(rank)
                return
            self._taken[rank] = taken + written
            if written < len(piece):
                break
        if self._taken[rank] < end:
            if rank not in self._watched:
                self._watched.add(rank)
                self._loop.add_writer(pipe.fileno(), self._writable, rank)
            return
        self._unwatch(rank)
        if self._eof:
            self.drop(rank)  # (closed: its EOF)

    def _unwatch(self, rank: int) -> None:
        if rank in self._watched:
            self._watched.discard(rank)
            self._loop.remove_writer(self._pipes[rank].fileno())

    def _settle(self) -> None:
        """Forget what every command has taken; ask for the next chunk if
        some command still takes input and the slowest is less than
        :data:`EXEC_STDIN_BACKLOG` behind."""
        end = self._start + len(self._data)
        low = min((self._taken[r] for r in self._pipes), default=end)
        if low > self._start:
            del self._data[:low - self._start]  # (from the front: no copy in CPython)
            self._start = low
        if (self._pipes and not self._eof and not self._reading and not self._closed
                and end - low < EXEC_STDIN_BACKLOG):
            self._reading = True
            self._go.set()

    def drop(self, rank: int) -> None:
        """Give ``rank``'s command no more input (it exited, or cannot take
        it) and close its pipe; what it had not taken is no longer kept
        for it."""
        if rank not in self._pipes:
            return
        self._unwatch(rank)
        pipe = self._pipes.pop(rank)
        with contextlib.suppress(OSError):
            pipe.close()
        if not self._closed:
            self._settle()

    def close(self) -> None:
        """The end of exec: close every pipe and let the thread go (if it
        is not in a read)."""
        self._closed = True
        for rank in list(self._pipes):
            self.drop(rank)
        self._go.set()
