"""The ``kvbroker`` command line (mirrors ``flux start``, ``flux ping``, ...):
its parser, and the commands that ask a running instance (``rpc``, ``ping``,
``attr``, ``module``, ``dmesg``, ``stats``...).  Starting an instance
(``start``, ``broker``, ``keygen``, ``relay``) is in :mod:`broker.start_cli`;
other commands have a ``*_cli`` module of their own (``exec``:
:mod:`broker.execute`).

Subcommands of plugins (e.g. ``kvs``) are found through the
``kvbroker.commands`` entry-point group; see :mod:`broker.plugins`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import functools
import importlib
import io
import itertools
import math
import os
import pwd
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from broker import __version__, plugins
from broker.cliutil import (
    CLIError,
    ConnectError,
    PermutingParser,
    UsageError,
    add_answer_timeout,
    add_time_options,
    building_only,
    connect,
    dumps,
    duration_arg,
    each_rank,
    errno_detail,
    finite_float,
    json_arg,
    no_answer_detail,
    non_negative_int,
    positive_float,
    print_err,
    rank_int,
    rank_set,
    run_async,
    size_int,
    stdout_is_broken,
    timed_out,
    use_color,
    write_out,
)
from broker.command import STOP_CAP, STOP_TIMEOUT
from broker.errors import ErrnoError, no_service, printable
from broker.handle import Handle
from broker.loops import LOOP_NAMES
from broker.message import NODEID_ANY, NODEID_UPSTREAM

if TYPE_CHECKING:
    from broker import logring

# ------------------------------------------------------------------ client commands


ASK_RANK = "ask rank N (default: the rank attached to)"
"""``-r/--rank N``'s help where a command asks one rank."""


def _nodeid(rank: int | None) -> int:
    return NODEID_ANY if rank is None else rank


def cmd_rpc(args: argparse.Namespace) -> int:
    """One request.  With ``--stream``, ``-t`` bounds connecting and the first
    answer only (as ``kvs watch-keys -t``): a stream's later answers come
    when the service has something to say (a watch's next change), and
    a bound on the whole stream ended a healthy watch mid-way."""
    payload = args.payload
    args.what = printable(args.topic)  # (one line: a newline in it made the error three)
    limit: float | None = args.answer_timeout
    if args.stream:
        args.answer_timeout = None  # (run_async's bound: the first answer's, below)

    async def main() -> int:
        if not args.stream:
            async with await connect() as h:
                print(dumps(await h.rpc(args.topic, payload, nodeid=_nodeid(args.rank))))
            return 0
        async with contextlib.AsyncExitStack() as closing:
            try:
                async with asyncio.timeout(limit) as bound:
                    h = await closing.enter_async_context(await connect())
                    stream = aiter(h.rpc_stream(args.topic, payload,
                                                nodeid=_nodeid(args.rank)))
                    first = await anext(stream, None)
            except TimeoutError:
                if limit is None or not bound.expired():
                    raise
                raise timed_out(args.what, args.rank, limit) from None
            if first is not None:
                print(dumps(first), flush=True)
                async for resp in stream:
                    print(dumps(resp), flush=True)
        return 0

    return run_async(args, main)


PING_TARGETS = {"any": NODEID_ANY, "upstream": NODEID_UPSTREAM}
"""``ping``'s targets besides a rank, as ``flux ping``'s: the rank attached
to, and its parent."""


def ping_target(text: str) -> int | str:
    """argparse ``type`` for ``ping``'s target: a rank, ``any`` or ``upstream``."""
    if text in PING_TARGETS:
        return text
    if not text.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"not a rank, 'any' or 'upstream': {text!r}")
    return rank_int(text)


def cmd_ping(args: argparse.Namespace) -> int:
    target = NODEID_ANY if args.rank is None else PING_TARGETS.get(args.rank, args.rank)
    rank = args.rank if isinstance(args.rank, int) else None  # (for a timeout's message)
    args.what = "ping"

    async def main() -> int:
        async with await connect(timeout=args.ping_timeout) as h:
            for i in itertools.count() if args.count == 0 else range(args.count):
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(args.ping_timeout):
                        resp = await h.rpc("broker.ping", {"seq": i, "pad": "x" * args.pad},
                                           nodeid=target)
                except TimeoutError:
                    raise CLIError("ping", detail=no_answer_detail(
                        rank, args.ping_timeout)) from None
                ms = (time.perf_counter() - t0) * 1000
                cred = (f" userid={resp['userid']} rolemask={resp['rolemask']:#x}"
                        if args.userid else "")
                print(f"rank={resp['rank']} route={'!'.join(resp['route'])} seq={i}{cred} "
                      f"time={ms:.3f} ms", flush=True)
                if args.interval and i + 1 != args.count:
                    await asyncio.sleep(args.interval)  # (-i: the pace asked for)
        return 0

    return run_async(args, main)


def cmd_uptime(args: argparse.Namespace) -> int:
    """``flux uptime``: the time, how long the instance has run, its owner
    and size, and how many ranks are lost or torpid (if any)."""
    from broker import status

    args.what = "uptime"

    async def main() -> int:
        async with await connect(timeout=args.timeout) as h:
            try:
                # within the timeout: the way to rank 0 may pass a torpid rank
                async with asyncio.timeout(args.timeout):
                    started = float(await h.attr_get("broker.starttime", nodeid=0))
                    owner = int(await h.attr_get("security.owner", nodeid=0))
            except TimeoutError:
                raise CLIError("uptime", detail=f"rank 0 did not answer in "
                                                f"{args.timeout:g}s") from None
            try:
                ranks, _ = await status.gather(h, timeout=args.timeout)
            except TimeoutError as exc:
                raise CLIError("uptime", detail=str(exc)) from None
        print(uptime_line(time.time(), started, owner, ranks))
        return 0

    return run_async(args, main)


def uptime_line(now: float, started: float, owner: int,
                ranks: list[Any]) -> str:
    """``20:55:01 run 3.2m,  owner alice,  size 4,  1 lost``, as ``flux
    uptime`` (its two-space separators, and a duration in Flux's units)."""
    from broker import status

    try:
        name = pwd.getpwuid(owner).pw_name
    except KeyError:
        name = str(owner)
    parts = [f"{time.strftime('%H:%M:%S', time.localtime(now))} run "
             f"{status.fsd(max(0.0, now - started))}", f"owner {name}", f"size {len(ranks)}"]
    for state in (status.LOST, status.OFFLINE, status.TORPID):
        n = sum(r.state == state for r in ranks)
        if n:
            parts.append(f"{n} {state}")
    return ",  ".join(parts)


def cmd_startlog(args: argparse.Namespace) -> int:
    """``flux startlog``: the instance's runs (:mod:`broker.startlog`), from
    rank 0 (``content.startlog``) or from a stopped instance's statedir."""
    from broker import startlog

    args.what = "startlog"
    if args.statedir:
        history = startlog.runs(_stopped_runs(args.statedir), live=False)
        return _print_runs(args, history)

    async def main() -> int:
        async with await connect() as h:
            answer = await h.rpc("content.startlog", {}, nodeid=0)
            recorded = answer.get("current", True) is not False
            history = startlog.runs(answer["runs"], live=recorded)
            if not history or not recorded:
                # (no statedir, or a store that could not record this run
                # (a full disk): this one is recorded nowhere)
                started = float(await h.attr_get("broker.starttime", nodeid=0))
                history.append(startlog.Run(started, version=__version__))
        return _print_runs(args, history)

    return run_async(args, main)


def _stopped_runs(statedir: str) -> list[Any]:
    """The runs a stopped instance's statedir records (``startlog --statedir``)."""
    import sqlite3

    from broker.content.sqlite import STORE_FILE, StoreLocked, open_to_read
    from broker.launch import StartError, private_dir

    path = os.path.join(statedir, STORE_FILE)
    if not os.path.isfile(path):
        why = "no such directory" if not os.path.isdir(statedir) else f"it has no {STORE_FILE}"
        raise CLIError("startlog", detail=f"statedir {statedir}: {why}")
    try:
        private_dir(statedir, "statedir")  # (this user's, as every offline tool asks)
    except StartError as exc:
        raise CLIError("startlog", detail=str(exc)) from None
    try:
        store = open_to_read(path)  # (a read-only statedir too: a snapshot)
    except StoreLocked:
        raise CLIError("startlog", detail=f"statedir {statedir} is in use by a running "
                                          "instance: ask it (kvbroker startlog with its "
                                          "KVBROKER_URI)") from None
    except (sqlite3.Error, OSError) as exc:
        raise CLIError("startlog", detail=f"{path}: {exc}") from None
    try:
        return store.runs()
    except sqlite3.Error as exc:
        raise CLIError("startlog", detail=f"{path}: {exc}") from None
    finally:
        store.close()


def _print_runs(args: argparse.Namespace, history: list[Any]) -> int:
    """List ``history`` (unless ``--quiet``); 1 for ``--check`` of a crash."""
    from broker import startlog

    if not args.quiet:
        now = time.time()
        for run in history:
            print(startlog.line(run, now, show_version=args.show_version))
    return 1 if args.check and startlog.crashed(history) else 0


def cmd_shutdown(args: argparse.Namespace) -> int:
    args.what = "shutdown"
    # The request is not withdrawn by giving up on its answer (as Flux's).
    args.timeout_note = ("; it may still take effect: the request waits for the rank, "
                         "which stops once it runs again")

    limit: float | None = args.answer_timeout
    args.answer_timeout = None  # (-t bounds the answer, not the wait for the end)

    async def main() -> int:
        async with await connect(timeout=limit) as h:
            stops_here = False
            try:
                async with asyncio.timeout(limit):
                    if not args.background:
                        me = int(await h.attr_get("rank"))
                        fanout = int(await h.attr_get("fanout"))
                        stops_here = _in_subtree(me, args.rank, fanout)
                    await h.rpc("broker.shutdown", {}, nodeid=args.rank)
            except TimeoutError:
                assert limit is not None
                raise CLIError(args.what, detail=no_answer_detail(args.rank, limit)
                               + args.timeout_note) from None
            if stops_here:
                # As flux shutdown, return once it is over (a dump written,
                # the final checkpoint taken): the rank attached to, in the
                # subtree shut down, closes this connection as it ends.
                await h.wait_closed()
        return 0

    return run_async(args, main)


def _in_subtree(rank: int, top: int, fanout: int) -> bool:
    """Whether ``rank`` is ``top`` or below it in the tree."""
    while rank > top:
        rank = (rank - 1) // fanout
    return rank == top


def cmd_event(args: argparse.Namespace) -> int:
    args.what = f"event {args.event_cmd}"

    async def main() -> int:
        async with await connect() as h:
            if args.event_cmd == "pub":
                if args.loopback:  # (before it is published: it cannot pass unseen)
                    await h.subscribe(args.topic)
                seq = await h.publish(args.topic, args.payload, private=args.private)
                if args.verbose:
                    print(seq, flush=True)
                while args.loopback and (await h.recv_event()).seq != seq:
                    pass  # (another event under the same prefix)
                return 0
            for prefix in args.prefixes or [""]:
                await h.subscribe(prefix)
            n = 0
            while not args.count or n < args.count:  # (0: no limit, as Flux's)
                ev = await h.recv_event()
                # (a tab or a newline in a topic broke the line in two)
                print(f"{printable(ev.topic)}\t{dumps(ev.payload)}", flush=True)
                n += 1
        return 0

    return run_async(args, main, streams=args.event_cmd == "sub")


def cmd_attr(args: argparse.Namespace) -> int:
    args.what = getattr(args, "spelled", None) or f"attr {args.attr_cmd}"

    async def main() -> int:
        async with await connect() as h:
            nodeid = _nodeid(args.rank)
            if args.attr_cmd == "get":
                print(await h.attr_get(args.name, nodeid=nodeid))
            elif args.attr_cmd == "set":
                await _attr_set(h, args)
            else:
                names = (await h.rpc("attr.list", {}, nodeid=nodeid))["names"]
                width = max(map(len, names), default=0)
                for name in names:
                    value = await h.attr_get(name, nodeid=nodeid)
                    print(f"{name:{width}} {value}")
        return 0

    return run_async(args, main)


async def _attr_set(h: Handle, args: argparse.Namespace) -> None:
    """``attr set``: on one rank, or with ``--all`` on every rank at once; a
    rank that refuses is named (the others keep the new value)."""
    if not args.all:
        await h.attr_set(args.name, args.value, nodeid=_nodeid(args.rank))
        return
    ranks = list(range(int(await h.attr_get("size"))))
    await each_rank("attr set", ranks, lambda r: h.attr_set(args.name, args.value, nodeid=r))


def cmd_module(args: argparse.Namespace) -> int:
    args.what = f"module {args.module_cmd}"
    if args.module_cmd != "list":
        return run_async(args, lambda: _change_modules(args))

    async def main() -> int:
        async with await connect() as h:
            resp = await h.rpc("module.list", {}, nodeid=_nodeid(args.rank))
            if args.json:
                print(dumps(resp))
                return 0
            print(f"{'Module':16} {'Requests':>9}  Services")
            for m in resp["modules"]:
                # (a guest is not told the counts: they move with what others do)
                print(f"{m['name']:16} {m.get('requests', '-'):>9}  {', '.join(m['services'])}")
        return 0

    return run_async(args, main)


async def _change_modules(args: argparse.Namespace) -> int:
    """``module load|remove|reload NAME`` on the rank attached to, or on
    each rank of ``-r IDSET`` at once (a rank that refuses is named).
    ``reload`` removes, then loads with the settings given, once they are
    checked (the rank holds the requests for the module meanwhile, no
    longer than ``-t``); ``-f`` takes a module that is not loaded as
    removed already."""
    if plugins.is_file_module(args.name):  # (a module file: the rank's directory is not ours)
        args.name = os.path.abspath(args.name)
    async with await connect() as h:
        if args.rank is None:
            ranks: list[int | None] = [None]
        else:
            ranks = list(args.rank.ranks(int(await h.attr_get("size")), args.what))

        async def change(rank: int | None) -> None:
            nodeid = _nodeid(rank)
            if args.module_cmd == "remove":
                try:
                    await h.rpc("module.remove", {"name": args.name, "cancel": args.cancel},
                                nodeid=nodeid)
                except ErrnoError as exc:
                    if not (args.force and exc.errnum == errno.ENOENT):
                        raise
            elif args.module_cmd == "reload":
                body: dict[str, Any] = {"name": args.name, "args": args.settings,
                                        "force": args.force}
                if args.answer_timeout is not None:
                    # (the requests the reload holds wait no longer than we do)
                    body["timeout"] = args.answer_timeout
                await h.rpc("module.reload", body, nodeid=nodeid)
            else:
                await h.rpc("module.load", {"name": args.name, "args": args.settings},
                            nodeid=nodeid)

        await each_rank(args.what, ranks, change, named=args.rank is not None
                        and args.rank.single() is None)
    return 0


def cmd_dmesg(args: argparse.Namespace) -> int:
    """``flux dmesg``: print the log records a rank keeps (``log.ring-size``
    of them, at ``log.ring-level``), oldest first; with ``--all`` every
    rank's, merged by time; ``--follow`` then prints new ones as they come,
    until interrupted (``--new``: without printing those kept first);
    ``--clear`` forgets them, ``--read-clear`` after printing them (only
    those printed)."""
    from broker import logring  # (here: ~1 ms of every other command)

    args.what = "dmesg"
    if args.delta and not args.human:
        raise UsageError("--delta can only be used with --human")
    fmt = logring.DmesgFormat(human=args.human, delta=args.delta,
                              color=use_color(args.color))

    async def main() -> int:
        # (-t bounds connecting too: an ssh:// host that never answers)
        async with await connect(timeout=args.rank_timeout) as h:
            ranks = (list(range(int(await h.attr_get("size")))) if args.all
                     else [_nodeid(args.rank)])
            lost: list[int] = []
            if args.all or args.rank_timeout:  # (when the others' logs are wanted most)
                ranks, lost = await _reachable(h, ranks, args.rank_timeout)
            if args.clear:
                await each_rank("dmesg", ranks, lambda r: h.rpc("log.clear", {}, nodeid=r))
                return 1 if lost else 0
            kept = await each_rank("dmesg", ranks, lambda r: _read_log(h, r))
            # (--new: none printed, but read all the same: a follow goes on
            # from each rank's last record)
            shown = [[] for _ in kept] if args.new else kept
            for entry in sorted((e for entries in shown for e in entries),
                                key=lambda e: (e["time"], e["rank"], e["seq"])):
                print(fmt.line(entry), flush=args.follow)
            if args.follow:  # (from each rank's last record read: none lost or repeated)
                await _follow_logs(h, {r: entries[-1]["seq"] if entries else 0
                                       for r, entries in zip(ranks, kept, strict=True)}, fmt)
                return 0
            if args.read_clear:  # (only what was printed: not what came since)
                last = {r: entries[-1]["seq"]
                        for r, entries in zip(ranks, shown, strict=True) if entries}
                await each_rank("dmesg", list(last),
                                 lambda r: h.rpc("log.clear", {"seq": last[r]}, nodeid=r))
        return 1 if lost else 0

    return run_async(args, main, streams=args.follow)


async def _reachable(h: Handle, ranks: list[int],
                     timeout: float | None) -> tuple[list[int], list[int]]:
    """``ranks`` split into those the tree reaches and those it answers
    ``EHOSTUNREACH`` for (lost, cut off) or, with ``timeout``, that do not
    answer within it (stopped, hung), each of the latter named on stderr as
    an error (``dmesg: rank 3: No route to host (...)``).  ``dmesg --all``
    printed nothing at all while one rank was lost, and waited for ever
    while one was stopped, when the other ranks' records, which say what
    happened, are what the operator needs; the exit status stays 1."""

    async def probe(rank: int) -> object:
        async with asyncio.timeout(timeout):
            return await h.attr_get("rank", nodeid=rank)

    answers = await asyncio.gather(*(probe(r) for r in ranks), return_exceptions=True)
    up: list[int] = []
    lost: list[int] = []
    for rank, answer in zip(ranks, answers, strict=True):
        # (no -r: the wire's "any rank", the attached one, not "rank 4294967295")
        who = "dmesg" if rank == NODEID_ANY else f"dmesg: rank {rank}"
        if isinstance(answer, ErrnoError) and answer.errnum == errno.EHOSTUNREACH:
            print_err(f"{who}: {errno_detail(answer)}")
            lost.append(rank)
        elif isinstance(answer, TimeoutError):
            said = "no answer" if rank == NODEID_ANY else "did not answer"
            print_err(f"{who}: {os.strerror(errno.ETIMEDOUT)} ({said} "
                      f"in {timeout:g}s: stopped or hung?)")
            lost.append(rank)
        else:
            up.append(rank)  # (any other failure is the log requests' to report)
    return up, lost


async def _read_log(h: Handle, rank: int) -> list[dict[str, Any]]:
    return [entry async for entry in h.dmesg(nodeid=rank)]


async def _follow_logs(h: Handle, since: dict[int, int], fmt: logring.DmesgFormat) -> None:
    """Print each rank's records logged after ``since[rank]`` (the last one
    printed), as they are logged, in the order they arrive."""
    ranks = list(since)
    queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()

    async def pump(rank: int) -> None:
        try:
            async for entry in h.dmesg(follow=True, since=since[rank], nodeid=rank):
                queue.put_nowait(entry)
        except ErrnoError as exc:
            queue.put_nowait(CLIError(f"dmesg: rank {rank}" if len(ranks) > 1 else "dmesg",
                                      exc.errnum, errno_detail(exc)))
        except BaseException as exc:  # (the connection went: the loop below stops)
            queue.put_nowait(exc)

    pumps = [asyncio.ensure_future(pump(r)) for r in ranks]
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            print(fmt.line(item), flush=True)
    finally:
        for task in pumps:
            task.cancel()


SEVERITIES = {"debug": "debug", "info": "info", "warning": "warning", "error": "error",
              # flux logger's (syslog's) other names, at the nearest level kept here
              "notice": "info", "err": "error", "crit": "error",
              "alert": "error", "emerg": "error"}
"""``logger --severity``: a rank's levels, and Flux's names for them."""


def cmd_logger(args: argparse.Namespace) -> int:
    """``flux logger``: write MESSAGE to a rank's log (its stderr at
    ``log.level``, its ring for ``dmesg`` at ``log.ring-level``)."""
    args.what = "logger"
    if args.message:
        # (a note for people: a stray byte is shown as U+FFFD rather than the
        # note lost, as Flux logs it; names, keys and topics are refused so)
        message = " ".join(os.fsencode(word).decode("utf-8", "replace")
                           for word in args.message)
    else:  # (as flux logger: the message is what standard input holds)
        message = sys.stdin.buffer.read().decode("utf-8", "replace").replace("\0", "\ufffd")

    async def main() -> int:
        async with await connect() as h:
            await h.log(message, SEVERITIES[args.severity], args.appname,
                        nodeid=_nodeid(args.rank))
        return 0

    return run_async(args, main)


RUSAGE_WHO = ("self", "children", "thread")


class RusageAction(argparse.Action):
    """``-R/--rusage[=WHO]``, whose WHO is optional as in Flux (``-RWHO``,
    ``--rusage=WHO``): ``stats -R kvs`` is the module ``kvs``, not a WHO."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if values is None or values in RUSAGE_WHO:
            namespace.rusage = values or "self"
            return
        namespace.rusage = "self"
        namespace.rusage_module = values


def cmd_stats(args: argparse.Namespace) -> int:
    taken = getattr(args, "rusage_module", None)  # (stats -R MODULE)
    if taken is not None:
        if args.module is not None:
            raise UsageError(f"--rusage takes {', '.join(RUSAGE_WHO)}, as --rusage=WHO or "
                             f"-RWHO: {taken!r}")
        args.module = taken
    if args.module is None:
        raise UsageError("the MODULE to ask is missing (broker, content, kvs, kvs-watch...)")
    args.what = f"{getattr(args, 'spelled', 'stats')} {args.module}"
    if isinstance(args.answer_timeout, str):  # (Flux's -t int|double: its --type)
        args.type, args.answer_timeout = args.answer_timeout, None
    if (args.type or args.scale is not None) and not args.parse:
        raise UsageError("--type and --scale need --parse OBJNAME (a number to convert)")
    if args.clear_all and args.rank is not None:
        raise UsageError("--clear-all clears every rank: it takes no --rank")
    if (args.clear or args.clear_all) and (args.parse or args.rusage):
        raise UsageError("--clear and --clear-all print nothing: no --parse or --rusage")

    async def main() -> int:
        async with await connect() as h:
            if args.clear or args.clear_all:
                await _clear_stats(h, args.module, args.rank, args.clear_all, args.what)
                return 0
            if args.rusage:
                resp = await h.rpc(f"{args.module}.rusage", {"who": args.rusage},
                                   nodeid=_nodeid(args.rank))
            else:
                try:
                    resp = await h.rpc(f"{args.module}.stats-get", {},
                                       nodeid=_nodeid(args.rank))
                except ErrnoError as exc:
                    if no_service(exc) and exc.errstr.endswith(".stats-get"):
                        # (a name no installed module has: say where to look)
                        raise CLIError(args.what, exc.errnum, f"{errno_detail(exc)[:-1]}: "
                                       "is a module of that name loaded? kvbroker module "
                                       "list)") from None
                    raise
        if not args.parse:
            print(dumps(resp, pretty=True))
            return 0
        print(stats_field(resp, args.parse, args.type, args.scale, args.what))
        return 0

    return run_async(args, main)


async def _clear_stats(h: Handle, module: str, rank: int | None, every: bool,
                       what: str) -> None:
    """``stats --clear`` (one rank) or ``--clear-all`` (each rank, asked in
    turn: Flux publishes an event, but a module here subscribes only to the
    prefixes it serves, so a request per rank does it, and says which rank
    failed)."""
    if not every:
        await h.rpc(f"{module}.stats-clear", {}, nodeid=_nodeid(rank))
        return
    size = int((await h.rpc("attr.get", {"name": "size"}))["value"])
    for r in range(size):
        try:
            await h.rpc(f"{module}.stats-clear", {}, nodeid=r)
        except ErrnoError as exc:
            raise CLIError(what, exc.errnum, f"rank {r}: {errno_detail(exc)}") from None


def timeout_or_stats_type(text: str) -> float | str:
    """``stats -t``: kvbroker's answer timeout, or Flux's ``-t int|double``
    (``--type``), which a Flux test line gives ``module stats``."""
    return text if text in ("int", "double") else positive_float(text)


def stats_field(stats: Any, objname: str, kind: str | None, scale: float | None,
                what: str = "stats") -> str:
    """What ``stats --parse OBJNAME`` prints, as Flux's ``module stats``: the
    value at the period-delimited path OBJNAME (JSON), or with ``kind`` a
    number as an ``int`` or a ``double`` (``%f``), times ``scale``."""
    value = stats
    for i, name in enumerate(objname.split(".")):
        if not isinstance(value, dict) or name not in value:
            where = ".".join(objname.split(".")[:i]) or "the stats"
            fields = ", ".join(sorted(value)) if isinstance(value, dict) else ""
            fields = fields or "none"  # (a map with no field: not an empty list)
            raise CLIError(what, detail=f"{objname}: {where} has no field {name!r} "
                                        f"(its fields: {fields})")
        value = value[name]
    if kind is None and scale is None:
        return dumps(value, pretty=isinstance(value, (dict, list)))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CLIError(what, detail=f"{objname}: not a number: {dumps(value)}")
    number = value * (1.0 if scale is None else scale)
    if not math.isfinite(number):  # (a finite scale may still overflow a double)
        raise CLIError(what, detail=f"{objname}: {value} times {scale} is not a finite number")
    if kind is None and isinstance(value, int) and float(number).is_integer():
        kind = "int"  # (--scale alone: an integer field stays one, as Flux prints it)
    return str(int(number)) if kind == "int" else f"{float(number):f}"


def cmd_content(args: argparse.Namespace) -> int:
    args.what = f"content {args.content_cmd}"

    refs: list[str] = []
    if args.content_cmd == "load":
        # As flux content load: the blobrefs named, else one a line on stdin
        # (what ``content store`` printed), each blob written in that order.
        refs = args.blobref or sys.stdin.read().split()
        if not refs:
            raise UsageError("no blobrefs were given (as arguments or on standard input)")

    async def main() -> int:
        async with await connect() as h:
            if args.content_cmd == "load":
                for ref in refs:
                    resp = await h.rpc("content.load", {"blobref": ref})
                    write_out(resp["data"])
            elif args.content_cmd == "store":
                data = sys.stdin.buffer.read()
                resp = await h.rpc("content.store", {"data": data})
                print(resp["blobref"])
            else:  # flush, dropcache: this rank's content module
                await h.rpc(f"content.{args.content_cmd}", {})
        return 0

    return run_async(args, main)


# ------------------------------------------------------------------ other modules' commands
#
# Modules that build or run one command only (start, exec, overlay, cron...)
# are imported when the command line names that command: each was ~1-3 ms
# of every kvbroker command, and the test suite starts thousands.


@functools.cache
def deferred(target: str) -> Callable[..., Any]:
    """The function ``module:name`` (a command's ``func``, an option's
    ``type``), its module imported at the first call.  It has the
    function's name, which argparse's errors show for a ``type``."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def register_from(sub: Any, name: str, module: str) -> None:
    """Add command ``name``, whose parser ``module``'s ``register(sub)``
    builds, importing ``module`` only if this command line may run it
    (all are, outside :func:`~broker.cliutil.building_only`)."""
    if getattr(sub, "wanted", None) in (None, name):  # (LazySubParsers.wanted)
        importlib.import_module(module).register(sub)


cmd_start = deferred("broker.start_cli:cmd_start")
cmd_broker = deferred("broker.start_cli:cmd_broker")
cmd_relay = deferred("broker.start_cli:cmd_relay")
cmd_keygen = deferred("broker.start_cli:cmd_keygen")
parse_attr = deferred("broker.start_cli:parse_attr")
cmd_exec = deferred("broker.execute:cmd_exec")
cmd_overlay = deferred("broker.overlay_cli:cmd_overlay")
rank_or_host = deferred("broker.overlay_cli:rank_or_host")
trace_types = deferred("broker.overlay_cli:trace_types")


# ------------------------------------------------------------------ parser


def _is_event_loop_option(word: str) -> bool:
    """``--event-loop`` as argparse takes it, an abbreviation too
    (``--event-l``), without its value."""
    return len(word) > 3 and "--event-loop".startswith(word)


def command_words(argv: list[str]) -> list[str]:
    """``argv``'s words that are not options, nor the top-level option's
    value: the command and its subcommand come first (``kvs``, ``get``)."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if _is_event_loop_option(word) and not out:
            next(words, None)
        elif word == "--":
            out.extend(words)
        elif not word.startswith("-") or word == "-":
            out.append(word)
    return out


def drop_driver_dashes(argv: list[str]) -> list[str]:
    """``argv`` without a ``--`` that ends the driver's own options before
    the command (``kvbroker -- getattr size``, as getopt takes Flux's):
    argparse read it as the command."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if _is_event_loop_option(argv[i]) else 1
    if i < len(argv) and argv[i] == "--":
        return argv[:i] + argv[i + 1:]
    return argv


ALIASES: dict[tuple[str, ...], tuple[str, ...]] = {
    ("content", "checkpoint"): ("kvs", "checkpoint"),
    ("getattr",): ("attr", "get"),
    ("setattr",): ("attr", "set"),
    ("lsattr",): ("attr", "list"),
    ("module", "stats"): ("stats",),
    ("dump",): ("kvs", "dump"),
    ("restore",): ("kvs", "restore"),
}
"""Commands spelled as Flux's that are spelled otherwise here: Flux's
``content checkpoint`` lists and updates the KVS's checkpoints, which the
kvs commands own (a plugin: the broker core does not read KVS roots);
``flux getattr``/``setattr``/``lsattr`` are ``attr get``/``set``/``list``,
``flux module stats`` is ``stats``, ``flux dump``/``restore`` are ``kvs
dump``/``restore``."""


def resolve_alias(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` with an :data:`ALIASES` command's words replaced, and those
    words as given (their errors name the command as the user spelled it);
    ``argv`` and None when it names none."""
    words = command_words(argv)
    for n in (2, 1):
        key = tuple(words[:n])
        target = ALIASES.get(key) if len(key) == n else None
        if target is None:
            continue
        spots = [argv.index(key[0])]
        for word in key[1:]:
            spots.append(argv.index(word, spots[-1] + 1))
        out = list(argv)
        for spot in reversed(spots[1:]):  # (the first word's place takes the target)
            del out[spot]
        out[spots[0]:spots[0] + 1] = target
        return out, " ".join(key)
    return argv, None


def command_word(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not a top-level
    option or an option's value (None if there is none)."""
    return next(iter(command_words(argv)), None)


def respell(parser: argparse.ArgumentParser, argv: list[str], spelled: str) -> None:
    """An aliased command's usage and help name it as the user spelled it
    (``kvbroker content checkpoint update`` said ``kvbroker kvs checkpoint
    update`` in its usage): the parsers of the words ``argv`` (resolved)
    names in place of ``spelled``'s, and those below them, are renamed."""
    words = command_words(argv)
    target = next((t for t in ALIASES.values() if tuple(words[:len(t)]) == t), None)
    if target is None:
        return
    p = parser
    for word in target:
        action = subparsers(p)
        if action is None or word not in action.choices:
            return
        p = action.choices[word]
    old, new = " ".join(("kvbroker", *target)), f"kvbroker {spelled}"
    stack = [p]
    while stack:
        q = stack.pop()
        if q.prog == old or q.prog.startswith(old + " "):
            q.prog = new + q.prog[len(old):]
        action = subparsers(q)
        if action is not None:
            stack.extend(action.choices.values())


def parser_for(argv: list[str]) -> argparse.ArgumentParser:
    """The parser of ``argv``'s command, with only that command (and
    subcommand) built (:class:`~broker.cliutil.LazySubParsers`), or, if
    that did not find them, the whole one."""
    words = command_words(argv)
    command = words[0] if words else None
    with building_only(words) as build:
        parser = build_parser(command)
    return parser if build.complete else build_parser(command)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line's parser.  Plugins' commands are added unless
    ``command`` names a built-in one: finding them reads the installed
    distributions' entry points, ~40 ms of a ~250 ms command.  A bundled
    plugin command (``kvs``) is loaded alone, without that scan."""
    p = PermutingParser(prog="kvbroker", description="kvbroker: a message broker "
                                "and key-value store in the manner of Flux")
    p.add_argument("-V", "--version", action="version", version=f"kvbroker {__version__}")
    p.add_argument("--event-loop", choices=LOOP_NAMES, default=None,
                   help="event loop for client commands (default: $KVBROKER_EVENT_LOOP "
                        "or auto)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser("start", help="start an instance of N ranks on this host",
                       description="Start N ranks on this host, each its own process, "
                       "as a tree of fanout K. With a COMMAND (after --), run it "
                       "with KVBROKER_URI set, stop the instance when it exits, and exit "
                       "as it did; without one, print the URI and serve until Ctrl-C or "
                       "'kvbroker shutdown'.")
    s.add_argument("--size", "-s", "--test-size", type=int, default=1, metavar="N",
                   help="number of ranks (default 1; --test-size: Flux's spelling)")
    s.add_argument("--fanout", "-k", type=int, default=32, metavar="K",
                   help="children per rank in the tree (default 32)")
    s.add_argument("--event-loop", choices=LOOP_NAMES, default=argparse.SUPPRESS,
                   dest="event_loop",
                   help="the ranks' event loop (default: kvbroker's --event-loop, "
                   "$KVBROKER_EVENT_LOOP, or auto: uvloop if installed)")
    s.add_argument("--statedir", metavar="DIR",
                   help="keep the content store and the primary namespace here, "
                   "across restarts (default: nothing survives the instance)")
    s.add_argument("--recovery", "-r", metavar="TARGET",
                   help="rank 0 alone, on TARGET: a statedir (a directory) or a "
                   "kvbroker kvs dump archive (a file, restored into a store that goes "
                   "at the stop), as Flux's --recovery")
    s.add_argument("--rundir", "--test-rundir", metavar="DIR",
                   help="the ranks' sockets go here (local://DIR/local-R), made if missing "
                   "and then removed at stop (default: a new directory in $TMPDIR; "
                   "--test-rundir: Flux's spelling)")
    s.add_argument("-S", "--setattr", action="append", type=parse_attr, metavar="ATTR=VAL",
                   help="set a broker attribute (repeatable; see docs/cli.md)")
    s.add_argument("--config", "-c", "--config-path", metavar="FILE",
                   help="broker attributes from the [attrs] table of this TOML file (as a "
                   "bootstrap file's; -S and the options win; --config-path: Flux's "
                   "spelling)")
    s.add_argument("-o", "--broker-opts", action="append", default=[], metavar="OPTS",
                   help="Flux's way to give the brokers options, comma-separated: "
                   "-o,-Sa=1,-Sb=2 is -S a=1 -S b=2 (only -S/--setattr is taken)")
    s.add_argument("--uri-file", metavar="FILE",
                   help="once every rank is ready, write the instance's URI to FILE "
                   "(atomically: a reader never sees part of it); removed when the "
                   "instance stops. Its directory must exist")
    s.add_argument("--stop-timeout", type=positive_float, default=STOP_TIMEOUT,
                   metavar="SECONDS",
                   help="when the instance stops under the command (a rank failed, or "
                   "'kvbroker shutdown'), how long the command has after SIGTERM "
                   f"before it and its process group are killed (default {STOP_TIMEOUT:g})")
    s.add_argument("--rank-stop-timeout", type=positive_float, default=STOP_TIMEOUT,
                   metavar="SECONDS", dest="rank_stop_timeout",
                   help="when the instance stops, how long each rank has after SIGTERM, "
                   "or after the last progress it reports writing to disk (at most "
                   f"{STOP_CAP} times this in all), before it is killed "
                   f"(default {STOP_TIMEOUT:g})")
    s.add_argument("--verbose", "-v", action="count", default=0,
                   help="print each rank's command line to stderr as it starts "
                   "(as Flux's flux start -v)")
    s.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command to run in the instance")
    s.set_defaults(func=cmd_start)

    # (no abbreviations: Flux's broker option --conf read as --config, its
    # setting dropped without a word)
    s = sub.add_parser("broker", help="run one rank of an instance spread over hosts "
                       "(a bootstrap file, as Flux's)", allow_abbrev=False)
    s.add_argument("--config", "-c", required=True, metavar="FILE",
                   help="the bootstrap file every rank reads (TOML)")
    s.add_argument("--rank", "-r", type=rank_int,
                   help="this rank (default: the hosts entry naming this host); its "
                   "parent refuses it, and it exits 1, if this host is not that entry's")
    s.add_argument("--rundir", help="where the local connector's socket goes "
                   "(default: a new private directory, removed on exit)")
    s.add_argument("--statedir", metavar="DIR",
                   help="rank 0: keep the content store and the primary namespace here")
    s.add_argument("--event-loop", choices=LOOP_NAMES, default=argparse.SUPPRESS,
                   dest="event_loop",
                   help="this rank's event loop (default: kvbroker's --event-loop, "
                   "$KVBROKER_EVENT_LOOP, or auto: uvloop if installed)")
    s.add_argument("-S", "--setattr", action="append", type=parse_attr, metavar="ATTR=VAL",
                   help="set a broker attribute (repeatable); -S hostname=NAME: the "
                   "host name this rank goes by (its entry, its hello)")
    s.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the initial program: rank 0 runs it once the instance is up, "
                   "then stops the instance and exits as it did (other ranks ignore it)")
    s.set_defaults(func=cmd_broker)

    s = sub.add_parser("relay", help="connect standard input and output to a rank's local "
                       "socket (what an ssh:// URI runs on the rank's host)")
    s.add_argument("path", metavar="SOCKET")
    s.set_defaults(func=cmd_relay)

    s = sub.add_parser("keygen", help="create an instance's CURVE key pair file (mode 0600)")
    s.add_argument("path", metavar="FILE")
    s.set_defaults(func=cmd_keygen)

    # (no abbreviations: an option of Flux's that we lack would be read as one of
    # ours it starts, and its argument run as the command: --label NAME was
    # --label-io until --label came)
    s = sub.add_parser("exec", help="run COMMAND attached to each rank of IDSET",
                       allow_abbrev=False)
    s.add_argument("-r", "--rank", type=rank_set, metavar="IDSET",
                   help="the ranks to run COMMAND on, each with its rank's URI as "
                   "KVBROKER_URI: 3, 0-3,5 or all (default 0)")
    s.add_argument("-x", "--exclude", type=rank_set, metavar="IDSET",
                   help="leave out these ranks of -r (ranks the instance does not have "
                   "are ignored)")
    s.add_argument("-n", "--noinput", action="store_true",
                   help="give the commands /dev/null as stdin (default: each gets all "
                   "of exec's stdin)")
    s.add_argument("-l", "--label-io", action="store_true", dest="label_io",
                   help="write each line of the commands' output as 'RANK: line'")
    s.add_argument("-d", "--dir", metavar="DIR",
                   help="run the commands in DIR (default: this directory), as flux exec -d")
    s.add_argument("--bg", action="store_true",
                   help="start COMMAND in the background on each rank, print 'RANK: PID' "
                   "for each, and exit once all have started: the ranks run them (kvbroker "
                   "sproc ps|kill|wait), as flux exec --bg")
    s.add_argument("--waitable", action="store_true",
                   help="with --bg: each stays on its rank, a zombie, once it has ended, "
                   "until kvbroker sproc wait collects its status (and the last MiB of "
                   "its output)")
    s.add_argument("--label", metavar="LABEL",
                   help="with --bg: name the command on each rank, for kvbroker sproc "
                   "(unique on a rank; not a number)")
    add_answer_timeout(s)
    s.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND")
    s.set_defaults(func=cmd_exec)
    register_from(sub, "sproc", "broker.sproc_cli")

    s = sub.add_parser("rpc", help="send one request and print the response(s)")
    s.add_argument("topic", metavar="TOPIC")
    s.add_argument("payload", nargs="?", type=json_arg, metavar="PAYLOAD-JSON")
    s.add_argument("--rank", "-r", type=rank_int, metavar="N",
                   help="send it to rank N (default: any rank offering the service)")
    s.add_argument("--stream", action="store_true",
                   help="a streaming request: print each response as it comes")
    add_answer_timeout(s, help_text="give up when no answer came in SECONDS (exit 1; with "
                       "--stream, the first answer only: a stream that answered runs "
                       "on; default: wait as long as the rank takes)")
    s.set_defaults(func=cmd_rpc)

    s = sub.add_parser("ping", help="ping a rank's broker service")
    s.add_argument("rank", nargs="?", type=ping_target, metavar="RANK",
                   help="the rank to ping, or 'any' (the one attached to: the default) "
                   "or 'upstream' (its parent), as flux ping")
    s.add_argument("--count", "-c", type=non_negative_int, default=1, metavar="N",
                   help="pings to send, one after the other (default 1; 0: until Ctrl-C)")
    s.add_argument("--pad", "-p", type=size_int, default=0, metavar="BYTES",
                   help="payload padding per ping, in bytes or with K, M or G, as "
                   "flux ping's (default 0; the ping must fit broker.max-message, "
                   "1 GiB: 1G is too big)")
    s.add_argument("--interval", "-i", type=duration_arg, default=0.0, metavar="SECONDS",
                   help="wait SECONDS between pings, or with a unit: 100ms (default 0: "
                   "back to back; flux ping waits 1s)")
    s.add_argument("--timeout", "-t", type=positive_float, dest="ping_timeout",
                   metavar="SECONDS", help="give up when a ping is not answered in SECONDS "
                   "(exit 1; default: wait as long as the rank takes)")
    s.add_argument("--userid", "-u", action="store_true",
                   help="print the userid and rolemask the answering rank saw (from "
                   "the OS, at the rank the client is attached to), as flux ping -u")
    s.set_defaults(func=cmd_ping)

    s = sub.add_parser("event", help="publish or subscribe to events")
    esub = s.add_subparsers(dest="event_cmd", required=True)
    e = esub.add_parser("pub", help="publish one event")
    e.add_argument("topic", metavar="TOPIC")
    e.add_argument("payload", nargs="?", type=json_arg, metavar="PAYLOAD-JSON")
    e.add_argument("--private", "-p", action="store_true",
                   help="deliver it only to the instance owner and its publisher's user")
    e.add_argument("-v", "--verbose", action="store_true", help="print the sequence number")
    e.add_argument("--loopback", "-l", action="store_true",
                   help="exit once the event has come back to this rank, which has "
                   "passed it to its subscribers (as flux event pub -l)")
    e.add_argument("--synchronous", "-s", action="store_true",
                   help="accepted for flux event pub's scripts: pub always returns once "
                   "the event has its sequence number")
    e = esub.add_parser("sub", help="print events whose topic starts with a PREFIX")
    e.add_argument("--count", "-c", type=non_negative_int, metavar="N",
                   help="exit after N events (default, or 0: until Ctrl-C)")
    e.add_argument("prefixes", nargs="*", metavar="PREFIX",
                   help="topic prefixes (default: every event)")
    s.set_defaults(func=cmd_event)

    s = sub.add_parser("attr", help="read broker attributes, or change a runtime one")
    asub = s.add_subparsers(dest="attr_cmd", required=True)
    a = asub.add_parser("get")
    a.add_argument("name")
    a.add_argument("--rank", "-r", type=rank_int, metavar="N", help=ASK_RANK)
    add_answer_timeout(a)
    a = asub.add_parser("list")
    a.add_argument("--values", "-v", action="store_true",
                   help="(values are always shown; taken for Flux's lsattr -v)")
    a.add_argument("--rank", "-r", type=rank_int, metavar="N", help=ASK_RANK)
    add_answer_timeout(a)
    a = asub.add_parser("set", help="change log.level, log.ring-level, tbon.torpid_min, "
                        "tbon.torpid_max or a loaded module's runtime attribute "
                        "(kvs.checkpoint-period, kvs.cache-expire, content.cache-expire, "
                        "content.cache-keep-bytes) on a running rank (the instance owner only)")
    a.add_argument("name")
    a.add_argument("value")
    where = a.add_mutually_exclusive_group()
    where.add_argument("--rank", "-r", type=rank_int, metavar="N",
                       help="on rank N (default: the rank attached to)")
    where.add_argument("--all", "-a", action="store_true", help="on every rank")
    add_answer_timeout(a)
    s.set_defaults(func=cmd_attr)

    s = sub.add_parser("module", help="list, load, remove or reload a rank's modules")
    msub = s.add_subparsers(dest="module_cmd", required=True)
    m = msub.add_parser("list", help="the modules loaded on a rank and their services")
    m.add_argument("--rank", "-r", type=rank_int, metavar="N", help=ASK_RANK)
    m.add_argument("--json", action="store_true")
    add_answer_timeout(m)
    for verb, purpose in (("load", "load module NAME (its entry point), or the module a "
                        "Python file defines (PATH.py), on a running rank"),
                       ("remove", "stop module NAME on a running rank (the requests it "
                        "serves end ENOSYS)"),
                       ("reload", "replace module NAME by a new one (the requests "
                        "for it meanwhile wait for the new one; a module file's code "
                        "is read again)")):
        m = msub.add_parser(verb, help=purpose)
        m.add_argument("name", metavar="NAME",
                       help="a module's name, or the path of a Python file defining one "
                       "(it holds a / or ends .py; on the rank's host)")
        if verb != "remove":
            # (default=[]: without it argparse named ATTR=VALUE "required" too)
            m.add_argument("settings", nargs="*", metavar="ATTR=VALUE", default=[],
                           help="the module's attributes for this load (kvs.transaction-"
                           "merge=false, or as Flux's module options transaction-merge=false)")
        else:
            m.set_defaults(settings=[])
        if verb != "load":
            m.add_argument("-f", "--force", action="store_true",
                           help="a module that is not loaded is no error")
        if verb == "remove":
            m.add_argument("--cancel", action="store_true",
                           help="cancel the module's stop instead of waiting for it (one "
                           "that hangs; also the stop a remove before is waiting for)")
        m.add_argument("--rank", "-r", type=rank_set, metavar="IDSET",
                       help="on these ranks at once: 3, 0-3 or all (default: the rank "
                       "attached to)")
        if verb == "reload":
            add_answer_timeout(m, "give up when no answer came in SECONDS (exit 1), and "
                               "let the rank hold the requests for the module no longer "
                               "(default: wait as long as the rank takes; it holds them "
                               "at most 60 s)")
        else:
            add_answer_timeout(m)
    s.set_defaults(func=cmd_module)

    register_from(sub, "groups", "broker.groups_cli")
    register_from(sub, "cron", "broker.cron_cli")
    register_from(sub, "config", "broker.config_cli")
    register_from(sub, "uri", "broker.uri_cli")

    s = sub.add_parser("overlay", help="the tree's health")
    osub = s.add_subparsers(dest="overlay_cmd", required=True)
    o = osub.add_parser("status", help="each rank: full, partial (something below is "
                        "not full), lost, offline (stopped on purpose, or not joined yet) or "
                        "torpid; exit 1 unless all are up")
    o.add_argument("--timeout", "-t", type=positive_float, metavar="SECONDS",
                   help="seconds a rank may take to answer (default 2); with --wait, "
                   "the whole wait (default: none, until Ctrl-C)")
    o.add_argument("--summary", action="store_true",
                   help="print rank 0's state only (full, partial, torpid), as flux "
                   "overlay status --summary")
    o.add_argument("--wait", choices=("full", "partial"), metavar="STATE",
                   help="ask again until rank 0 is full (every rank answers) or partial "
                   "(something below is not), within -t; as flux overlay status --wait")
    o.set_defaults(func=cmd_overlay)
    o = osub.add_parser("disconnect", help="cut a rank and its subtree off the tree (a hung "
                        "rank: requests to it then fail at once); as flux overlay disconnect")
    o.add_argument("target", type=rank_or_host, metavar="TARGET",
                   help="a rank, or the host of one rank")
    o.add_argument("--parent", "-r", type=rank_int, metavar="RANK",
                   help="the rank to ask (default: the target's parent in the tree)")
    o.set_defaults(func=cmd_overlay)
    o = osub.add_parser("trace", help="print each message this rank's overlay sends (tx) "
                        "and receives (rx), until interrupted; as flux overlay trace")
    o.add_argument("topic_glob", nargs="?", default="*", metavar="TOPIC_GLOB",
                   help="only topics matching this glob (default *)")
    o.add_argument("--full", "-f", action="store_true",
                   help="with each message's payload (JSON), or a failed answer's text")
    o.add_argument("--rank", "-r", dest="peer", type=rank_int, metavar="RANK",
                   help="only messages to or from this overlay peer (not the sender or "
                   "the destination: the neighbour in the tree)")
    o.add_argument("--type", "-t", dest="types", type=trace_types, action="append",
                   metavar="TYPE,...", help="only these: request, response, event, control "
                   "(repeatable: -t request -t response is -t request,response)")
    add_time_options(o)
    o.set_defaults(func=cmd_overlay)
    o = osub.add_parser("errors", help="the ranks that are lost, offline or torpid, "
                        "grouped by why; as flux overlay errors")
    o.add_argument("--timeout", "-t", type=positive_float, metavar="SECONDS",
                   help="seconds a rank may take to answer (default 2)")
    o.set_defaults(func=cmd_overlay)
    o = osub.add_parser("lookup", help="translate ranks (an idset: 0-3) to the host list "
                        "they run on, or a host list (node[0-3]) to its ranks; as flux "
                        "overlay lookup")
    o.add_argument("target", metavar="TARGET")
    o.set_defaults(func=cmd_overlay)
    o = osub.add_parser("parentof", help="the rank's parent in the tree; as flux overlay "
                        "parentof")
    o.add_argument("rank", type=rank_int, metavar="RANK")
    o.set_defaults(func=cmd_overlay)

    s = sub.add_parser("uptime", help="how long the instance has run, its owner and size "
                       "(as flux uptime)")
    s.add_argument("--timeout", "-t", type=positive_float, default=2.0, metavar="SECONDS",
                   help="seconds a rank may take to answer (default 2)")
    s.set_defaults(func=cmd_uptime)

    s = sub.add_parser("startlog", help="the instance's runs, and whether each stopped "
                       "cleanly (as flux startlog)",
                       description="List the runs of an instance with a statedir, oldest "
                                   "first: when each started and stopped, 'crashed' for one "
                                   "that did not stop cleanly, 'running' for this one.")
    s.add_argument("--check", action="store_true",
                   help="exit 1 if a run did not stop cleanly and no run since has")
    s.add_argument("--quiet", "-q", action="store_true", help="print nothing (for --check)")
    s.add_argument("--show-version", "-v", action="store_true",
                   help="print first the kvbroker version each run started with")
    s.add_argument("--statedir", metavar="DIR",
                   help="read a stopped instance's statedir instead of asking rank 0")
    add_answer_timeout(s)
    s.set_defaults(func=cmd_startlog)

    s = sub.add_parser("shutdown", help="stop the instance (or rank R and its subtree)")
    s.add_argument("--rank", "-r", type=rank_int, default=0, metavar="N",
                   help="stop rank N and the ranks below it (default 0: all of them)")
    s.add_argument("--background", action="store_true",
                   help="return once the rank answers, not once it has stopped (as Flux's)")
    add_answer_timeout(s)
    s.set_defaults(func=cmd_shutdown)

    s = sub.add_parser("dmesg", help="print the log records ranks keep (as flux dmesg)")
    where = s.add_mutually_exclusive_group()
    where.add_argument("--rank", "-r", type=rank_int, metavar="N", help=ASK_RANK)
    where.add_argument("--all", "-a", action="store_true",
                       help="every rank's, merged by time (a rank out of reach is named "
                       "on stderr and left out: exit 1)")
    what = s.add_mutually_exclusive_group()
    what.add_argument("--follow", "-f", action="store_true",
                      help="then print new records as they come, until interrupted")
    what.add_argument("--clear", "-C", action="store_true",
                      help="forget the records kept (print nothing)")
    what.add_argument("--read-clear", "-c", action="store_true",
                      help="print the records kept, then forget them")
    s.add_argument("--new", "-n", action="store_true",
                   help="leave out the records kept: with --follow, only those logged "
                   "from now on (as flux dmesg --new)")
    s.add_argument("-t", "--timeout", type=positive_float, dest="rank_timeout",
                   metavar="SECONDS",
                   help="leave out (naming it; exit 1) a rank that does not answer in "
                        "SECONDS: stopped or hung (default: wait as long as it takes)")
    add_time_options(s)
    s.set_defaults(func=cmd_dmesg)

    s = sub.add_parser("logger", help="write a message to a rank's log (as flux logger)")
    s.add_argument("message", nargs="*", metavar="MESSAGE",
                   help="the words to log, joined by spaces (none: standard input, "
                   "as flux logger)")
    s.add_argument("--severity", "-s", default="info", type=str.lower, metavar="LEVEL",
                   choices=tuple(SEVERITIES),
                   help="debug, info (the default), warning or error; Flux's notice "
                   "is info here, and err, crit, alert and emerg are error")
    s.add_argument("--appname", "-n", default="logger", help="the name the line carries")
    s.add_argument("--rank", "-r", type=rank_int, metavar="N",
                   help="log on rank N (default: the rank attached to)")
    add_answer_timeout(s)
    s.set_defaults(func=cmd_logger)

    s = sub.add_parser("stats", help="print a module's stats (broker, content, kvs, ...)")
    s.add_argument("module", nargs="?", metavar="MODULE",
                   help="the module to ask: broker, content, kvs, kvs-watch... (required, "
                   "unless -R WHO names it)")
    s.add_argument("--rank", "-r", type=rank_int, metavar="N", help=ASK_RANK)
    s.add_argument("-p", "--parse", metavar="OBJNAME",
                   help="print only this value: field names separated by periods "
                   "(overlay.children), as Flux's module stats")
    s.add_argument("--type", choices=("int", "double"), default=None,
                   help="print the value as an int or a double (-t int|double too, as "
                   "Flux's)")
    s.add_argument("-s", "--scale", type=finite_float, metavar="N",
                   help="multiply the value by N (with --parse)")
    s.add_argument("-t", "--timeout", type=timeout_or_stats_type, dest="answer_timeout",
                   metavar="SECONDS",
                   help="give up when no answer came in SECONDS (exit 1; default: wait as "
                   "long as the rank takes); int or double: --type, as Flux's -t")
    s.add_argument("-R", "--rusage", nargs="?", const="self", action=RusageAction,
                   metavar="self|children|thread",
                   help="print getrusage(2) of the rank's process instead (the modules run "
                   "in it; default self), as Flux's module stats --rusage")
    clear = s.add_mutually_exclusive_group()  # (both given: cleared everywhere, silently)
    clear.add_argument("-c", "--clear", action="store_true",
                       help="set the module's counters back to 0 on the rank (the instance "
                       "owner only), as Flux's")
    clear.add_argument("-C", "--clear-all", action="store_true",
                       help="set the module's counters back to 0 on every rank")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("content", help="load or store raw blobs, flush or drop the cache")
    csub = s.add_subparsers(dest="content_cmd", required=True)
    c = csub.add_parser("load", help="write blobs to stdout",
                        description="Write each blob to standard output, in order; "
                        "without BLOBREF, read the blobrefs from standard input "
                        "(whitespace-separated, as content store prints them).")
    c.add_argument("blobref", nargs="*", metavar="BLOBREF")
    c = csub.add_parser("store", help="store stdin as one blob; print its blobref")
    c = csub.add_parser("flush", help="write every blob stored so far to the backing store",
                        description="Return once every blob stored so far is in rank 0's "
                        "SQLite file, on stable storage (as flux content flush); fails "
                        "with the store's error (No space left on device...) if that "
                        "cannot be done.")
    # (listed here for the help; main() hands it to kvs checkpoint: ALIASES)
    csub.add_parser("checkpoint", help="list the KVS checkpoints kept, or roll back to one "
                    "(the same as kvbroker kvs checkpoint)")
    c = csub.add_parser("dropcache", help="drop this rank's cached blobs",
                        description="Drop the blobs this rank's content cache holds "
                        "(those not yet written to the backing store stay), as flux "
                        "content dropcache; run it with kvbroker exec -r RANK for "
                        "another rank.")
    s.set_defaults(func=cmd_content)

    if command is None or command not in sub.choices:
        for name, register in plugins.command_registrars(command).items():
            try:
                register(sub)
            except Exception as exc:  # (a built-in's name, another plugin's, a bug of its
                # own: it took --help and every other command down with it)
                print(f"kvbroker: ignoring plugin command {name!r}: {exc}", file=sys.stderr)
    return p


def subparsers(parser: argparse.ArgumentParser,
               ) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    """``parser``'s subcommands (their ``choices``: name -> parser), if it has any."""
    return next((a for a in parser._actions  # noqa: SLF001 (argparse has no public walk)
                 if isinstance(a, argparse._SubParsersAction)), None)


def subcommand_parser(parser: argparse.ArgumentParser,
                      args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand ``args`` ran (``kvbroker kvs get``),
    so that an error shows that command's usage, not the top level's."""
    p = parser
    while True:
        action = subparsers(p)
        name = getattr(args, action.dest, None) if action is not None else None
        if action is None or not isinstance(name, str) or name not in action.choices:
            return p
        p = action.choices[name]


def main(argv: list[str] | None = None) -> int:
    """Parse, run the command, and turn its failure into one line on stderr
    and an exit status (docs/cli.md, Conventions) -- in this one place, so
    that every command reports alike."""
    argv, spelled = resolve_alias(drop_driver_dashes(sys.argv[1:] if argv is None else argv))
    guard_std_streams()
    parser = parser_for(argv)
    word = command_word(argv)
    if word is not None and word in plugins.FAILED_COMMANDS:
        print_err(f"{word}: {plugins.FAILED_COMMANDS[word]}")
        return 1
    if spelled is not None:
        respell(parser, argv, spelled)
    args, extra = parser.parse_known_args(argv)
    if extra:
        subcommand_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if spelled is not None:  # (its errors name the command as the user spelled it)
        args.spelled = spelled
    try:
        rc = int(args.func(args) or 0)
        # Flushed here, not by the interpreter at exit, where a closed
        # reader would be a traceback-like complaint and status 120.
        sys.stdout.flush()
        return rc
    except UsageError as exc:
        subcommand_parser(parser, args).error(str(exc))
    except CLIError as exc:
        print_err(str(exc))
        return exc.status
    except ErrnoError as exc:
        print_err(f"{args.command}: {errno_detail(exc)}")
        return 1
    except ConnectError as exc:
        print_err(f"{getattr(args, 'what', args.command)}: {exc}")
        return 1
    except TypeError as exc:
        # The codec refuses a str it cannot encode as a TypeError (API
        # misuse, docs/api.md), raised from the UnicodeEncodeError
        if isinstance(exc.__cause__, UnicodeEncodeError):
            return report_not_utf8(args, exc.__cause__)
        raise
    except UnicodeEncodeError as exc:
        return report_not_utf8(args, exc)
    except (OSError, ValueError) as exc:
        if isinstance(exc, BrokenPipeError) and stdout_is_broken():
            return stdout_closed()
        return report_local_error(args, exc)
    except KeyboardInterrupt:
        return 130


class _ClosedInput(io.RawIOBase):
    """Standard input when the command was started with it closed (``<&-``)."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF), "standard input")


def guard_std_streams() -> None:
    """Put ``/dev/null`` on each of descriptors 0-2 that is closed (``cmd
    <&-``, ``>&-``), as daemons do: else the connection to the broker took
    the lowest free one, and uvloop aborted the process (SIGABRT, status
    134) closing it, "Assertion `fd > STDERR_FILENO' failed"; the stock loop
    died in a traceback on the missing ``sys.stdout``.  Then, as Python
    does for a closed stream, output there is discarded; reading a closed
    standard input (``put -r a=-``, ``content store``) is ``Bad file
    descriptor``, not an empty value."""
    for fd in range(3):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # (the lowest free descriptor: fd)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    if sys.stdin is None:
        sys.stdin = io.TextIOWrapper(io.BufferedReader(_ClosedInput()))
    if sys.stdout is None:
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (for the process's life)
    if sys.stderr is None:
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def report_not_utf8(args: argparse.Namespace, exc: UnicodeEncodeError) -> int:
    """``kvbroker: <what>: Invalid argument ('k\\xff' is not UTF-8 text)``,
    exit status 1, for a word of the command line that is not UTF-8 where
    the message needs text (a key, namespace, topic, name): Python hands
    such bytes over as surrogate escapes, which nothing can send, and the
    command died with a traceback.  Flux refuses them with EINVAL (jansson
    packs UTF-8 only).  Values and file names are bytes, and not refused."""
    what = getattr(args, "what", None) or args.command
    text = exc.object if isinstance(exc.object, str) else ""
    if len(text) > 40:  # (a whole event, as ``eventlog append`` encodes it): the bad part
        text = text[exc.start:exc.end]
    try:
        shown = repr(os.fsencode(text))[1:] if text else "an argument"
    except UnicodeEncodeError:  # (a surrogate no file name's byte made: not ours)
        shown = ascii(text)
    print_err(f"{what}: {os.strerror(errno.EINVAL)} ({shown} is not UTF-8 text)")
    return 1


def report_local_error(args: argparse.Namespace, exc: OSError | ValueError) -> int:
    """``kvbroker: <what>: <strerror>`` for an error of this process (not a
    service's), exit status 1."""
    what = getattr(args, "what", args.command)
    detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        detail = f"{exc.filename}: {detail}"  # which file, not only what went wrong
    print_err(f"{what}: {detail}")
    return 1


SIGPIPE_STATUS = 128 + signal.SIGPIPE
"""What a shell reports for a process killed by SIGPIPE (141): what ``cmd |
head`` has always meant for a C command such as ``flux kvs dir``."""


def stdout_closed() -> int:
    """End quietly, as a command killed by SIGPIPE would (exit status 141),
    without setting SIGPIPE to its default action: a write to the broker
    would then kill us silently too.  Standard output now goes to /dev/null
    so that the interpreter's final flush of what is still buffered does not
    fail again (Python's documented recipe, "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return SIGPIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
