"""``kvbroker sproc ps|kill|wait`` (Flux's ``flux sproc``; docs/cli.md
"sproc"): the commands a rank's ``rexec`` service runs (:mod:`broker.rexec`)
-- those of ``exec --bg`` above all, which nothing else follows once
``exec`` has exited: list them, signal one, wait for a waitable one and
exit as it did."""

from __future__ import annotations

import argparse
import asyncio
import errno
import shlex
import signal
import string
import sys
from typing import TYPE_CHECKING, Any

from broker.cliutil import (
    UsageError,
    add_answer_timeout,
    connect,
    each_rank,
    errno_detail,
    print_err,
    rank_int,
    rank_set,
    run_async,
)
from broker.errors import ErrnoError

if TYPE_CHECKING:
    from broker.handle import Handle
    from broker.sproc_client import Proc, Procs, Target, WaitResult

HEADINGS = {"pid": "PID", "state": "ST", "label": "LABEL", "rank": "RANK", "cmd": "COMMAND"}
"""``sproc ps``'s fields (``--format``) and their column headings, as Flux's."""
DEFAULT_FORMAT = "{pid:>9} {state:<2} {label:<12} {cmd}"
"""``sproc ps``'s table without ``--format``, as Flux's."""
_TYPE_CHARS = "bcdeEfFgGnosxX%"


def register(sub: Any) -> None:
    s = sub.add_parser("sproc", help="list, signal or wait for the commands a rank runs "
                       "for clients (exec --bg), as flux sproc",
                       description="The commands a rank's rexec service runs: those of "
                       "kvbroker exec --bg, and of exec on another host's ranks. A "
                       "TARGET is a pid, or the label given with exec --bg --label.")
    ssub = s.add_subparsers(dest="sproc_cmd", required=True, metavar="COMMAND",
                            title="supported subcommands")
    p = ssub.add_parser("ps", help="list a rank's commands: running (R) and zombie (Z)")
    _common(p, ranks=True)
    p.add_argument("-o", "--format", metavar="FORMAT",
                   help="each line in Python's format syntax, with fields "
                   f"{', '.join('{' + f + '}' for f in HEADINGS)} (default "
                   f"{DEFAULT_FORMAT!r}, as Flux's)")
    p.add_argument("-n", "--no-header", action="store_true", help="leave out the heading line")
    k = ssub.add_parser("kill", help="send a signal to a command (its process group)")
    _common(k)
    k.add_argument("-w", "--wait", action="store_true",
                   help="then wait for it, and exit as it did (128+N for signal N): a "
                   "waitable command only; waits also when the signal failed because it "
                   "had exited (a zombie)")
    k.add_argument("signal", type=signal_arg, metavar="SIGNAL",
                   help="a number (15) or a name (TERM, SIGTERM)")
    k.add_argument("target", metavar="TARGET", help="a pid, or a label")
    w = ssub.add_parser("wait", help="wait for a waitable command (exec --bg --waitable) to "
                        "end, and exit as it did (128+N for signal N)")
    _common(w)
    w.add_argument("-o", "--output", action="store_true",
                   help="write what it wrote (the last MiB of each stream, kept by the "
                   "rank) to stdout and stderr, as it wrote them")
    w.add_argument("target", metavar="TARGET", help="a pid, or a label")
    s.set_defaults(func=cmd_sproc)


def _common(p: argparse.ArgumentParser, ranks: bool = False) -> None:
    if ranks:  # (ps: kvbroker's own, Flux's takes one rank)
        p.add_argument("-r", "--rank", type=rank_set, metavar="IDSET",
                       help="ask rank N, or each rank of IDSET (0-3, all: a RANK column "
                       "first; default: the rank attached to)")
    else:
        p.add_argument("-r", "--rank", type=rank_int, metavar="N",
                       help="ask rank N (default: the rank attached to)")
    p.add_argument("-s", "--service", default="rexec", metavar="NAME",
                   help="the subprocess service to ask (default rexec, the only one), "
                   "as Flux's")
    add_answer_timeout(p)


def signal_arg(text: str) -> int:
    """argparse ``type`` for a signal: a number, or a name with or without
    ``SIG`` (``TERM``, ``SIGTERM``, ``term``)."""
    valid = {int(s) for s in signal.valid_signals()}
    if text.isascii() and text.isdigit():
        if int(text) in valid and int(text) != 0:
            return int(text)
        raise argparse.ArgumentTypeError(f"no signal {text}")
    name = text.upper()
    try:
        return int(signal.Signals[name if name.startswith("SIG") else "SIG" + name])
    except KeyError:
        raise argparse.ArgumentTypeError(f"not a signal: {text!r} (a number, or a name: "
                                         "TERM, SIGKILL)") from None


def procs_of(h: Handle, service: str) -> Procs:
    """:class:`broker.sproc_client.Procs`, imported here: every kvbroker
    command imports this module to register ``sproc``'s parser, and that
    module (its dataclasses, broker.command) was ~3 ms of each."""
    from broker.sproc_client import Procs

    return Procs(h, service)


def target(text: str) -> Target:
    """A TARGET as :class:`Procs` names it: digits are a pid, anything else
    a label (a label may not be a number: :func:`broker.rexec.check_label`)."""
    if text.isascii() and text.isdigit():
        pid = int(text)
        if pid > MAX_PID:  # (msgpack's limit: a traceback, "not msgpack-able")
            raise UsageError(f"{text}: not a pid (at most {MAX_PID})")
        return pid
    return text


MAX_PID = (1 << 63) - 1
"""The largest number a TARGET may be: a pid is far smaller, and the
request's payload (msgpack) takes no integer past 2**64."""


def cmd_sproc(args: argparse.Namespace) -> int:
    args.what = f"sproc {args.sproc_cmd}"
    if args.sproc_cmd == "ps":
        fmt = args.format if args.format is not None else DEFAULT_FORMAT
        fields = format_fields(fmt)

        async def ps() -> int:
            async with await connect() as h:
                procs = procs_of(h, args.service)
                one = args.rank.single() if args.rank is not None else None
                if args.rank is None or one is not None:
                    found = await procs.list(one)
                    print_table(fmt, fields, found, not args.no_header)
                    return 0
                ranks = args.rank.ranks(int(await h.attr_get("size")), args.what)
                lists = await each_rank(args.what, ranks, procs.list)
            many = fmt if args.format is not None else "{rank:>4} " + fmt
            print_table(many, format_fields(many), [p for found in lists for p in found],
                        not args.no_header)
            return 0

        return run_async(args, ps)
    if args.sproc_cmd == "kill":
        return run_async(args, lambda: kill(args))
    return run_async(args, lambda: wait(args))


def format_fields(fmt: str) -> list[tuple[str, str | None, str]]:
    """``--format`` parsed: (literal text, field, spec) pieces; a field
    that is not one of :data:`HEADINGS`, or a malformed format, is a usage
    error."""
    try:
        pieces = [(text, field, spec or "") for text, field, spec, _ in
                  string.Formatter().parse(fmt)]
    except ValueError as exc:
        raise UsageError(f"--format {fmt!r}: {exc}") from None
    for _, field, spec in pieces:
        # (a field nested in a spec, {pid:>{width}}, is a field too: a KeyError)
        for name in [field] + [f for _, f, _, _ in _parse(fmt, spec)]:
            if name is not None and name not in HEADINGS:
                raise UsageError(f"--format {fmt!r}: no field {{{name}}} (fields: "
                                 f"{', '.join('{' + f + '}' for f in HEADINGS)})")
    try:  # (a width no line can have, {pid:99999999999}: a MemoryError)
        fmt.format(pid=1, state="R", label="", rank=0, cmd="")
    except (MemoryError, OverflowError):
        raise UsageError(f"--format {fmt!r}: a width too large to print") from None
    except (ValueError, TypeError):
        pass  # (a spec the value does not take: said as the table is printed)
    return pieces


def _parse(fmt: str, spec: str) -> list[tuple[str, str | None, str | None, str | None]]:
    try:
        return list(string.Formatter().parse(spec))
    except ValueError as exc:
        raise UsageError(f"--format {fmt!r}: {exc}") from None


def heading(fmt: str, pieces: list[tuple[str, str | None, str]]) -> str:
    """The heading line of ``fmt``: each field's heading in its place,
    with its width and alignment (a type such as ``d`` left out)."""
    out = []
    for text, field, spec in pieces:
        out.append(text)
        if field is None:
            continue
        spec = spec[:-1] if spec and spec[-1] in _TYPE_CHARS else spec
        try:
            out.append(format(HEADINGS[field], spec.replace("=", ">")))
        except ValueError:
            out.append(HEADINGS[field])
    return "".join(out)


def print_table(fmt: str, pieces: list[tuple[str, str | None, str]], procs: list[Proc],
                header: bool) -> None:
    """One line per command of a rank (after the heading)."""
    lines = [heading(fmt, pieces)] if header else []
    for proc in procs:
        item = {"pid": proc.pid, "state": proc.state, "label": proc.label, "rank": proc.rank,
                "cmd": shlex.join(proc.cmd)}
        try:
            lines.append(fmt.format(**item))
        except (ValueError, TypeError, OverflowError, MemoryError) as exc:
            # (a spec the value does not take, {label:d}; a width nested from
            # a value, {pid:{pid}{pid}}, too large to print)
            raise UsageError(f"--format {fmt!r}: {exc or type(exc).__name__}") from None
    for line in lines:
        print(line.rstrip())


async def kill(args: argparse.Namespace) -> int:
    """``sproc kill``: with ``--wait`` the wait is asked first (sent before
    the kill: :meth:`Procs.wait`), so that a command that had already
    exited (a zombie: the kill is ``ESRCH``) is still collected, as Flux's
    does."""
    named = target(args.target)
    async with await connect() as h:
        procs = procs_of(h, args.service)
        waiting = procs.wait(named, rank=args.rank) if args.wait else None
        try:
            return await _kill_then_wait(args, procs, named, waiting)
        finally:
            if waiting is not None:
                _give_up(waiting)


async def _kill_then_wait(args: argparse.Namespace, procs: Procs, named: Target,
                          waiting: asyncio.Future[WaitResult] | None) -> int:
    """The kill, then the wait already sent, if any: ``sproc kill``'s status.
    A kill that finds no such command (``ESRCH``) while the wait collects
    one says nothing: it had exited, and the wait, sent first, collected it
    before the kill came (the kill said ``label spin does not belong to any
    command``, then the command exited 137 as its wait said)."""
    missed: ErrnoError | None = None
    try:
        await procs.kill(named, args.signal, rank=args.rank)
    except ErrnoError as exc:
        if waiting is None or exc.errnum != errno.ESRCH:
            print_err(f"sproc kill: {errno_detail(exc)}")
            return 1
        missed = exc
    if waiting is None:
        return 0
    try:
        result = await waiting
    except ErrnoError as exc:
        if missed is not None:
            print_err(f"sproc kill: {errno_detail(missed)}")
        print_err(f"sproc kill: wait failed: {errno_detail(exc)}")
        return 1
    return result.code


def _give_up(waiting: asyncio.Future[WaitResult]) -> None:
    """Cancel a wait the command did not see to its end (the kill failed;
    ``-t`` or Ctrl-C cut it short), and read the failure of one that ended
    unread: left as it was, it failed as the handle closed, and Python
    printed ``Future exception was never retrieved`` and the error after
    the command's own message."""
    if not waiting.done():
        waiting.cancel()
    elif not waiting.cancelled():
        waiting.exception()


async def wait(args: argparse.Namespace) -> int:
    """``sproc wait``: the command's status as the exit code, and with
    ``--output`` what the rank kept of its output (and what it dropped)."""
    async with await connect() as h:
        result = await procs_of(h, args.service).wait(target(args.target), rank=args.rank,
                                                   output=args.output)
    if args.output:
        for name, stream in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            data: bytes = getattr(result, name)
            dropped: int = getattr(result, f"{name}_dropped")
            if dropped:
                print_err(f"sproc wait: {args.target}'s {name} truncated: its first "
                          f"{dropped} bytes were dropped (the rank keeps the last "
                          f"{len(data)})")
            stream.flush()
            stream.buffer.write(data)
            stream.flush()
    return result.code
