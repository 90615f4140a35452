"""``kvbroker cron``: a rank's ``cron`` module from the command line
(Flux's ``flux cron``; docs/cli.md "cron").

* ``interval``, ``event``, ``tab``, ``at``: create entries on the rank
  attached to (``--rank N``: rank N's cron), printing ``TYPE: cron-ID
  created`` for each, as Flux's.  The command is the words after the
  trigger joined by spaces, run by ``/bin/sh -c`` on the rank, as Flux's.
* ``list``: a table of the rank's entries; ``dump ID``: one entry in full,
  ``key = value`` lines as Flux's (``--key KEY`` one value, ``--json``
  the entry as the module answers it); exit 1 for an unknown id.
* ``delete [--kill]``, ``stop``, ``start``: by id.
* ``sync [TOPIC] [--disable] [--epsilon FSD]``: show or set the event
  tasks wait for.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from broker.cliutil import (
    CLIError,
    UsageError,
    add_answer_timeout,
    command_args,
    connect,
    duration_arg,
    each_rank,
    errno_detail,
    non_negative_int,
    positive_float,
    print_err,
    rank_int,
    rank_set,
    run_async,
)
from broker.cron_client import Cron
from broker.errors import ErrnoError

T = TypeVar("T")

EXTRA_OPTIONS = ("timeout", "rank", "stop-on-failure", "task-history-count")
"""Flux's ``-o KEY=VALUE`` options."""
FLUX_KEYS = {"typedata.next_wakeup": "typedata.next"}
"""Flux's names of ``dump --key`` keys that are named otherwise here: a
script reading when a ``tab`` or ``at`` entry runs next (Flux's t0016)
runs as written."""


def register(sub: Any) -> None:
    s = sub.add_parser("cron", help="run commands on a rank every so often, at times, or on "
                       "events (the cron module), as flux cron",
                       description="Entries of a rank's cron module (kvbroker module load "
                       "cron): a command run by /bin/sh -c on that rank, as the instance "
                       "owner, each time its trigger comes.")
    csub = s.add_subparsers(dest="cron_cmd", required=True, metavar="COMMAND",
                            title="supported subcommands")
    p = csub.add_parser("interval", help="run COMMAND every INTERVAL (30s, 10m, 1.5h; 0: once)")
    p.add_argument("-n", "--name", help="the entry's name (default: the command's first word)")
    p.add_argument("-a", "--after", type=duration_arg, metavar="FSD",
                   help="the first run after FSD (default: after INTERVAL)")
    _create_options(p)
    p.add_argument("interval", type=duration_arg, metavar="INTERVAL")
    p.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND")
    p = csub.add_parser("event", help="run COMMAND each time an event of topic TOPIC "
                        "(exactly) is published")
    p.add_argument("-N", "--name", help="the entry's name (default: the command's first word)")
    p.add_argument("-n", "--nth", type=non_negative_int, metavar="N",
                   help="run on every Nth event only")
    p.add_argument("-a", "--after", type=non_negative_int, metavar="N",
                   help="the first run on the Nth event (the ones before are counted only)")
    p.add_argument("-i", "--min-interval", type=duration_arg, metavar="FSD",
                   help="run at most once every FSD: an event sooner waits until then")
    _create_options(p)
    p.add_argument("topic", metavar="TOPIC")
    p.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND")
    p = csub.add_parser("tab", help="an entry for each crontab line (m h dom mon dow "
                        "command) of FILE (default: standard input), in the rank's local time")
    _create_options(p, count=False)
    p.add_argument("file", nargs="?", metavar="FILE")
    p = csub.add_parser("at", help="run COMMAND once at TIME: an ISO 8601 date and time "
                        "(local unless it has an offset) or +FSD from now")
    p.add_argument("-n", "--name", help="the entry's name (default: the command's first word)")
    _create_options(p, count=False)
    p.add_argument("time", metavar="TIME")
    p.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND")

    p = csub.add_parser("list", help="a table of the rank's entries")
    p.add_argument("-r", "--rank", type=rank_set, metavar="IDSET",
                   help="rank N's cron, or each rank's of IDSET (0-3, all: a RANK column "
                   "first; default: the rank attached to)")
    add_answer_timeout(p)
    p = csub.add_parser("dump", help="an entry in full (key = value lines)")
    p.add_argument("-k", "--key", metavar="KEY", help="print only KEY's value (task.1.state, "
                   "stats.count, typedata.topic...)")
    p.add_argument("--json", action="store_true", help="the entry as one JSON object")
    _common(p)
    p.add_argument("id", type=non_negative_int, metavar="ID")
    for verb, what in (("delete", "delete entries (a task still running is left to end, "
                                  "unless --kill)"),
                       ("stop", "stop entries: no more runs until started"),
                       ("start", "start stopped entries again (their counts from 0)")):
        p = csub.add_parser(verb, help=what)
        if verb == "delete":
            p.add_argument("-k", "--kill", action="store_true",
                           help="terminate a running task too (SIGTERM, SIGKILL 2s later)")
        _common(p)
        p.add_argument("ids", nargs="+", type=non_negative_int, metavar="ID")
    p = csub.add_parser("sync", help="show the sync event, or set it: tasks due wait for "
                        "the next event of TOPIC")
    p.add_argument("-d", "--disable", action="store_true", help="no sync event: tasks run "
                   "when due (those waiting run now)")
    p.add_argument("-e", "--epsilon", type=duration_arg, metavar="FSD",
                   help="a task due within FSD of the sync event runs at once")
    _common(p)
    p.add_argument("topic", nargs="?", metavar="TOPIC")
    s.set_defaults(func=cmd_cron)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("-r", "--rank", type=rank_int, metavar="N",
                   help="rank N's cron (default: the rank attached to)")
    add_answer_timeout(p)


def _create_options(p: argparse.ArgumentParser, count: bool = True) -> None:
    if count:
        p.add_argument("-c", "--count", type=non_negative_int, metavar="N",
                       help="run N times, then stop (default: until stopped)")
    p.add_argument("-r", "--rank", type=rank_int, metavar="N",
                   help="rank N's cron runs it, on its host (default: the rank attached to)")
    p.add_argument("-E", "--preserve-env", action="store_true",
                   help="run it in this command's environment (default: the rank's)")
    p.add_argument("-d", "--working-dir", metavar="DIR",
                   help="run it in DIR (default: the rank's working directory)")
    p.add_argument("--timeout", type=positive_float, metavar="FSD",
                   help="terminate a task still running after FSD (SIGTERM, SIGKILL 2s later)")
    p.add_argument("--stop-on-failure", type=non_negative_int, metavar="N",
                   help="stop the entry after N failed runs (default: never)")
    p.add_argument("-o", "--options", action="append", default=[], metavar="KEY=VALUE,...",
                   help="Flux's extra options: timeout=FSD, rank=N, stop-on-failure=N, "
                   "task-history-count=N (the last N tasks kept, 1 to 16; default 1)")


def extra_options(given: list[str]) -> dict[str, Any]:
    """``-o timeout=1,rank=2``: Flux's spellings, as the request's fields."""
    out: dict[str, Any] = {}
    for item in (x for text in given for x in text.split(",") if x):
        key, sep, value = item.partition("=")
        if not sep or key not in EXTRA_OPTIONS:
            raise UsageError(f"-o {item!r}: expected KEY=VALUE with KEY one of "
                             f"{', '.join(EXTRA_OPTIONS)}")
        try:
            if key == "timeout":
                out["timeout"] = duration(value)
            elif key == "rank":
                out["rank"] = rank_int(value)
            elif key == "stop-on-failure":
                out["stop-on-failure"] = non_negative_int(value)
            else:
                out["task-history-count"] = non_negative_int(value)  # (1-16: the rank says)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise UsageError(f"-o {item!r}: {exc}") from None
    return out


def entry_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options of :meth:`Cron.create` every type takes, from the
    command's options (an explicit one over its ``-o`` spelling)."""
    extra = extra_options(args.options)
    out: dict[str, Any] = {"timeout": extra.get("timeout"), "rank": extra.get("rank"),
                           "stop_on_failure": extra.get("stop-on-failure"),
                           "task_history_count": extra.get("task-history-count")}
    for key, value in (("count", getattr(args, "count", None)), ("timeout", args.timeout),
                       ("stop_on_failure", args.stop_on_failure), ("rank", args.rank),
                       ("name", getattr(args, "name", None))):
        if value is not None:
            out[key] = value
    if args.working_dir is not None:
        out["cwd"] = os.path.abspath(args.working_dir)
    out["preserve_env"] = args.preserve_env
    return {k: v for k, v in out.items() if v is not None}


def command_line(args: argparse.Namespace) -> str:
    words = command_args(args.cmdline)
    if not words:
        raise UsageError(f"cron {args.cron_cmd}: no COMMAND given")
    return " ".join(words)


def creations(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """The entries a create command makes, as (type, command, trigger) for
    :meth:`Cron.create` (one per crontab line for ``tab``), checked before
    any is sent."""
    kind = args.cron_cmd
    if kind == "interval":
        iargs = {"interval": args.interval}
        if args.after is not None:
            iargs["after"] = args.after
        return [(kind, command_line(args), iargs)]
    if kind == "event":
        eargs = {"topic": args.topic, "nth": args.nth or 0, "after": args.after or 0,
                 "min_interval": args.min_interval or 0.0}
        return [(kind, command_line(args), eargs)]
    if kind == "at":
        from broker.crontab import parse_at

        try:
            when = parse_at(args.time)
        except ValueError as exc:
            raise UsageError(f"cron at: {exc}") from None
        if not args.time.strip().startswith("+") and when < time.time() - 1:
            raise UsageError(f"cron at: {args.time} is in the past")
        return [(kind, command_line(args), {"at": when})]
    return [("tab", command, {"schedule": schedule})
            for schedule, command in tab_lines(args.file)]


def tab_lines(path: str | None) -> list[tuple[str, str]]:
    """The (schedule, command) of each crontab line of ``path`` (standard
    input for None or ``-``); a bad line is a usage error naming it."""
    try:
        if path in (None, "-"):
            text = sys.stdin.read()
        else:
            with open(path) as f:
                text = f.read()
    except OSError as exc:
        where = "standard input" if path in (None, "-") else path  # (it said "None")
        raise CLIError(f"cron tab: {where}", exc.errno) from None
    from broker.crontab import parse_crontab

    try:
        lines = parse_crontab(text)
    except ValueError as exc:
        raise UsageError(f"cron tab: {exc}") from None
    for line in lines:
        if "\0" in line.command:  # (no command line can hold one: the task never started)
            raise UsageError(f"cron tab: line {line.number}: its command holds a NUL byte")
    out = [(line.schedule, line.command) for line in lines]
    if not out:
        raise UsageError("cron tab: no crontab line (minute hour day-of-month month "
                         "day-of-week command) was given")
    return out


def cmd_cron(args: argparse.Namespace) -> int:
    args.what = f"cron {args.cron_cmd}"
    options: dict[str, Any] = {}
    requests: list[tuple[str, str, dict[str, Any]]] = []
    if args.cron_cmd in ("interval", "event", "tab", "at"):
        options = entry_options(args)
        requests = creations(args)
    if "rank" in options:  # (-o rank=N, Flux's spelling of --rank N)
        args.rank = options["rank"]
    if args.cron_cmd == "list" and args.rank is not None:
        if args.rank.single() is None:
            return run_async(args, lambda: _list_ranks(args))
        args.rank = args.rank.single()
    return run_async(args, lambda: _main(args, requests, options))


async def _list_ranks(args: argparse.Namespace) -> int:
    """``cron list -r IDSET``: each rank's entries, asked at once."""
    async with await connect() as h:
        cron = Cron(h)
        ranks = args.rank.ranks(int(await h.attr_get("size")), args.what)

        def show(lists: list[list[dict[str, Any]]]) -> None:
            print_list([e for entries in lists for e in entries], ranks=True)
            sys.stdout.flush()  # (before the refusals, on stderr)
        show(await each_rank(args.what, ranks, cron.list, answered=show))
    return 0


async def _main(args: argparse.Namespace, requests: list[tuple[str, str, dict[str, Any]]],
                options: dict[str, Any]) -> int:
    async with await connect() as h:
        cron = Cron(h)
        rank = args.rank
        if rank is None:
            rank = int(await h.attr_get("rank"))

        async def call(aw: Awaitable[T]) -> T:
            try:
                return await aw
            except ErrnoError as exc:
                if exc.errnum == errno.ENOSYS:  # (the module not loaded: said so)
                    raise CLIError(args.what, detail=exc.errstr) from None
                raise

        if requests:
            for kind, command, targs in requests:
                entry = await call(cron.create(kind, command, targs, **{**options,
                                                                        "rank": rank}))
                where = f" on rank {rank}" if args.rank is not None else ""
                print(f"{args.cron_cmd}: cron-{entry['id']} created{where}")
            return 0
        if args.cron_cmd == "list":
            print_list(await call(cron.list(rank)))
            return 0
        if args.cron_cmd == "dump":
            try:
                return dump(args, await call(cron.get(args.id, rank)))
            except ErrnoError as exc:
                if exc.errnum != errno.ENOENT:
                    raise
                print_err(f"cron dump: {exc.errstr}")
                return 1
        if args.cron_cmd == "sync":
            return await sync(args, cron, rank, call)
        status = 0
        for eid in args.ids:
            try:
                if args.cron_cmd == "delete":
                    entry = await call(cron.delete(eid, kill=args.kill, rank=rank))
                elif args.cron_cmd == "stop":
                    entry = await call(cron.stop(eid, rank=rank))
                else:
                    entry = await call(cron.start(eid, rank=rank))
            except ErrnoError as exc:
                print_err(f"{args.what}: cron-{eid}: {errno_detail(exc)}")
                status = 1
                continue
            if args.cron_cmd == "delete":
                print(f"Removed cron-{eid}: {entry['name']}{last_ran(entry, args.kill)}")
            else:
                print(f"{'Stopped' if args.cron_cmd == 'stop' else 'Started'} cron-{eid}")
        return status


# broker.attrs, broker.crontab and broker.status are imported where used:
# every kvbroker command imports this module to register its parser, and
# those took ~11 ms of each command's ~100 ms start.


def duration(text: str) -> float:
    """:func:`broker.attrs.duration` (Flux's FSD: ``30s``, ``1.5m``)."""
    from broker.attrs import duration as parse

    return parse(text)


def fsd(seconds: float) -> str:
    """:func:`broker.status.fsd`: ``seconds`` as Flux prints a duration."""
    from broker.status import fsd as text

    return text(seconds)


def ago(t: float) -> str:
    return f"{fsd(max(0.0, time.time() - t))} ago"


def last_ran(entry: dict[str, Any], kill: bool) -> str:
    """What ``delete`` says of the entry's last task (Flux's words)."""
    tasks = entry.get("tasks") or []
    if not tasks or "start-time" not in tasks[0]:
        return ""
    task = tasks[0]
    if "end-time" not in task:
        how = "terminated" if kill else "left to end (delete --kill ends it)"
        return f" still running, started {ago(task['start-time'])}: {how}"
    return (f" last ran {ago(task['end-time'])} for "
            f"{fsd(task['end-time'] - task['start-time'])}")


def trigger(entry: dict[str, Any]) -> str:
    """The entry's trigger in a few words (``list``'s last column)."""
    td, kind = entry.get("typedata", {}), entry.get("type")
    if kind == "interval":
        return f"every {td.get('interval', 0):g}s"
    if kind == "event":
        extra = "".join(f" {k}={td[k]:g}" for k in ("nth", "after", "min_interval")
                        if td.get(k))
        return f"event {td.get('topic')}{extra}"
    if kind == "tab":
        return f"tab {td.get('schedule')}"
    if kind == "at":
        return "at " + time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(td.get("at", 0)))
    return str(kind)


def task_status(entry: dict[str, Any]) -> tuple[str, str]:
    """(last run, status) of ``list``."""
    tasks = entry.get("tasks") or []
    if not tasks:
        return "-", "-"
    task = tasks[0]
    lastrun = ago(task["start-time"]) if "start-time" in task else "-"
    state = task.get("state", "?")
    if state == "Exited":
        return lastrun, "Success"
    if state == "Failed":
        return lastrun, "Exec-Error" if task.get("code") == 127 else f"Failed:rc={task.get('code')}"
    return lastrun, state


def print_list(entries: list[dict[str, Any]], ranks: bool = False) -> None:
    """The table of ``cron list``; with ``ranks`` (several asked), a RANK
    column first: ids are per rank.  NAME is 15 wide, as Flux's, or as the
    longest name (a longer one pushed the rest of its row out of line)."""
    width = max([15] + [len(str(e["name"])) for e in entries])
    fmt = "{:>4} {:<" + str(width) + "} {:<8} {:>7} {:>14}  {:<14} {}"
    first = "{:>4} " if ranks else ""
    head = ("ID", "NAME", "STATE", "RUNS", "LAST RUN", "STATUS", "TRIGGER")
    print((first + fmt).format(*(("RANK",) if ranks else ()), *head).rstrip())
    for e in entries:
        stats = e.get("stats", {})
        runs = f"{stats.get('count', 0)}" + (f"/{e['repeat']}" if e.get("repeat") else "")
        lastrun, status = task_status(e)
        row = (e["id"], e["name"], e.get("state", "?"), runs, lastrun, status, trigger(e))
        print((first + fmt).format(*((e.get("rank", "?"),) if ranks else ()), *row).rstrip())


def flatten(entry: dict[str, Any]) -> list[tuple[str, Any]]:
    """An entry as Flux's ``dump`` shows it: ``stats.count``,
    ``typedata.topic``, ``task.1.state``..."""
    out: list[tuple[str, Any]] = []
    for key, value in entry.items():
        if key == "tasks":
            for i, task in enumerate(value, 1):
                out += [(f"task.{i}.{k}", v) for k, v in task.items()]
        elif isinstance(value, dict):
            out += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            out.append((key, value))
    return out


def show(value: Any, quoted: bool) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if quoted else value
    return str(value)


def dump(args: argparse.Namespace, entry: dict[str, Any]) -> int:
    if args.json:
        print(json.dumps(entry, indent=2, sort_keys=True))
        return 0
    pairs = flatten(entry)
    if args.key is not None:
        key = FLUX_KEYS.get(args.key, args.key)
        found = [v for k, v in pairs if k == key]
        if not found:
            print_err(f"cron dump: cron-{args.id} has no key {args.key} (keys: "
                      f"{', '.join(k for k, _ in pairs)})")
            return 1
        print(show(found[0], quoted=False))
        return 0
    for key, value in pairs:
        print(f"{key} = {show(value, quoted=True)}")
    return 0


async def sync(args: argparse.Namespace, cron: Cron, rank: int, call: Any) -> int:
    if args.disable and args.topic:
        raise UsageError("cron sync: give TOPIC or --disable, not both")
    answer = await call(cron.sync(args.topic or None, disable=args.disable,
                                  epsilon=args.epsilon, rank=rank))
    eps = f"epsilon={answer.get('sync_epsilon', 0):.3f}s"
    if answer.get("sync_event"):
        print(f"sync: {answer['sync_event']} {eps}")
    else:
        print(f"sync: disabled ({eps})")
    return 0
