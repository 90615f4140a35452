"""``kvbroker exec``: run a command attached to one rank, or to each of a set.

One rank is the fast path (look its URI up, then become the command); a
set (``-r 0-3``, ``all``) runs one command per rank at once and
supervises them to the end, as ``flux exec`` does (docs/cli.md, exec).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import sys
from typing import Any

from broker.cliutil import (
    CLIError,
    RankSet,
    UsageError,
    command_args,
    connect,
    each_rank,
    encode_ranks,
    no_answer_detail,
    print_err,
    run_async,
)
from broker.command import STOP_SIGNALS
from broker.handle import parse_uri

EXEC_KILL_AFTER = 5.0
"""How long the commands of ``exec`` on several ranks have after SIGTERM,
once ``-t`` has expired, before SIGKILL: Flux's kill timeout (job-exec)."""
LABEL_LINE_MAX = 1 << 20
"""With ``--label-io``, the most of a line without a newline held before
it is written as a labelled piece of its own (as Flux's line-buffered
output does once its buffer is full): binary output, or one huge line,
was held whole until a newline or the end, in memory without bound."""
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
    rank = args.rank.single()
    if rank is None or args.label_io:
        return exec_ranks(args, command)
    args.rank = rank  # (what -t's message names)

    async def main() -> str:
        async with await connect() as h:
            uri = str(await h.attr_get("local-uri", nodeid=rank))
            path = parse_uri(uri)
            if not os.path.exists(path):  # across hosts: the rank's socket is elsewhere
                host = await h.attr_get("hostname", nodeid=rank)
                raise CLIError("exec", detail=f"rank {rank}'s socket {path} is not on "
                               f"this host (rank {rank} runs on {host}); exec reaches "
                               "the ranks of this host only (from here: KVBROKER_URI="
                               f"ssh://{host}{path})")
            return uri

    uri = ""

    async def go() -> int:
        nonlocal uri
        uri = await main()
        return 0

    run_async(args, go)
    from broker.command import cannot_run_message, cannot_run_status

    env = dict(os.environ, KVBROKER_URI=uri, KVBROKER_RANK=str(rank))
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print_err(cannot_run_message(command[0], exc))
        return cannot_run_status(exc)
    return 0  # not reached: the command replaced this process


def exec_ranks(args: argparse.Namespace, command: list[str]) -> int:
    """``exec`` on several ranks: a command per rank, all at once, supervised
    to the end (docs/cli.md, exec).  ``-t`` bounds all of it here, not only
    the look-ups: ``exec`` stays, so it can stop what overstays."""
    limit: float | None = args.answer_timeout
    args.answer_timeout = None  # (run_async's bound would only say "no answer")

    async def main() -> int:
        loop = asyncio.get_running_loop()
        deadline = None if limit is None else loop.time() + limit
        uris = await _exec_lookup(args.rank, deadline, limit)
        return await _exec_run(command, uris, args.label_io, deadline, limit)

    return run_async(args, main)


async def _exec_lookup(rankset: RankSet, deadline: float | None,
                       limit: float | None) -> dict[int, str]:
    """Every rank's local URI, asked of all of them at once; a rank that does
    not answer by ``deadline`` is named (the first in order), as one rank's
    ``exec -t`` names it.  Fails, and nothing runs, if any rank's socket is
    on another host."""
    pending: set[int] = set()
    try:
        async with asyncio.timeout_at(deadline) as bound, await connect() as h:
            ranks = rankset.ranks(int(await h.attr_get("size")), "exec")
            pending.update(ranks)

            async def lookup(rank: int) -> str:
                uri = str(await h.attr_get("local-uri", nodeid=rank))
                pending.discard(rank)
                return uri

            uris = dict(zip(ranks, await each_rank("exec", ranks, lookup), strict=True))
            away = [r for r, uri in uris.items() if not os.path.exists(parse_uri(uri))]
            if away:
                host = await h.attr_get("hostname", nodeid=away[0])
                path = parse_uri(uris[away[0]])
                which = (f"rank {away[0]} is" if len(away) == 1
                         else f"ranks {encode_ranks(away)} are")
                raise CLIError("exec", detail=f"{which} not on this host (rank {away[0]} runs "
                               f"on {host}; from here: KVBROKER_URI=ssh://{host}{path}); exec "
                               "reaches the ranks of this host only, and ran nothing")
            return uris
    except TimeoutError:
        if not bound.expired():
            raise  # (not ours)
        assert limit is not None
        raise CLIError("exec", detail=no_answer_detail(min(pending, default=None),
                                                       limit)) from None


async def _exec_run(command: list[str], uris: dict[int, str], label_io: bool,
                    deadline: float | None, limit: float | None) -> int:
    """Run ``command`` once per rank, with that rank's ``KVBROKER_URI``, and
    wait for all of them (and, with ``label_io``, for the end of their
    output); their highest status.  SIGINT, SIGTERM and SIGHUP are passed
    on to every command; past ``deadline`` they are stopped, status 124."""
    from broker.command import Command, cannot_run_message, cannot_run_status, exit_code

    loop = asyncio.get_running_loop()
    cmds: dict[int, Command] = {}
    returncodes: dict[int, int] = {}  # (-N: killed by signal N)
    said: set[str] = set()

    def on_signal(sig: int) -> None:
        for cmd in cmds.values():
            cmd.forward(sig)

    pipe = subprocess.PIPE if label_io else None
    for sig in STOP_SIGNALS:  # (run once spawning is over: it does not yield)
        loop.add_signal_handler(sig, on_signal, sig)
    pumps: dict[int, list[asyncio.Task[None]]] = {}
    try:
        for rank, uri in uris.items():
            env = dict(os.environ, KVBROKER_URI=uri, KVBROKER_RANK=str(rank))
            try:
                cmd = Command.spawn(command, env, stdin=subprocess.DEVNULL,
                                    stdout=pipe, stderr=pipe)
            except OSError as exc:  # (the same on every rank: said once)
                message = cannot_run_message(command[0], exc)
                if message not in said:
                    said.add(message)
                    print_err(message)
                returncodes[rank] = cannot_run_status(exc)
                continue
            cmds[rank] = cmd
            if cmd.proc.stdout is not None and cmd.proc.stderr is not None:  # label_io
                pumps[rank] = [
                    asyncio.ensure_future(_label_lines(rank, cmd.proc.stdout, sys.stdout)),
                    asyncio.ensure_future(_label_lines(rank, cmd.proc.stderr, sys.stderr))]
        every_pump = [task for tasks in pumps.values() for task in tasks]
        try:
            async with asyncio.timeout_at(deadline) as bound:
                for rank, code in zip(cmds, await asyncio.gather(
                        *(cmd.wait() for cmd in cmds.values())), strict=True):
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
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        for cmd in cmds.values():  # (an error of ours: nothing we started outlives us)
            if cmd.returncode is None:
                cmd.kill()
        for tasks in pumps.values():
            for task in tasks:
                task.cancel()
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


async def _label_lines(rank: int, pipe: Any, out: Any) -> None:
    """Copy a command's output to ``out`` (our stdout or stderr) a line at a
    time, each as ``RANK: line`` (``flux exec --label-io``); a last line
    without a newline gets one, so the next label starts a line.  A line
    longer than :data:`LABEL_LINE_MAX` is written in pieces, each labelled,
    as it comes: held whole, and joined again at every read, one without
    a newline took memory without bound and time as its square."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), pipe)
    label = f"{rank}: ".encode()
    rest = bytearray()  # (the line begun: grows in place, not copied at each read)
    try:
        while chunk := await reader.read(65536):
            end = chunk.rfind(b"\n")
            if end < 0:
                rest += chunk
                if len(rest) < LABEL_LINE_MAX:
                    continue
                lines, rest = [bytes(rest)], bytearray()
            else:
                lines = (bytes(rest) + chunk[:end]).split(b"\n")
                rest = bytearray(chunk[end + 1:])
            out.buffer.write(b"".join(label + line + b"\n" for line in lines))
            out.buffer.flush()
        if rest:
            out.buffer.write(label + rest + b"\n")
            out.buffer.flush()
    finally:
        transport.close()
