"""``kvbroker groups``: the ``groups`` module from the command line
(docs/cli.md "groups").  Flux tests its groups with a script
(``t/scripts/groups.py``: get, join, waitfor, barrier); here they are
commands.

* ``get NAME [-w]``: the members (an idset, empty for none), from rank 0;
  ``-w`` prints the set again at every change, until interrupted.
* ``join NAME [COMMAND...]``: the rank attached to is a member while
  COMMAND runs (its status is ``join``'s), or, without one, until
  interrupted.  A membership is its connection's: a ``join`` killed takes
  it away.
* ``waitfor NAME [-c N]``: until the group has N members (default: the
  instance's size; 0 waits for it to be empty).
* ``barrier NAME [-c N]``: join, wait for N members, leave -- run on every
  rank (``kvbroker exec -r all kvbroker groups barrier NAME``), each
  returns once all have come.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from broker.cliutil import (
    add_answer_timeout,
    command_args,
    connect,
    non_negative_int,
    run_async,
)
from broker.groups_client import Groups
from broker.idset import encode_ranks


def register(sub: Any) -> None:
    s = sub.add_parser("groups", help="which ranks are members of named groups (the "
                       "groups module: barriers, broker.online)")
    gsub = s.add_subparsers(dest="groups_cmd", required=True)
    g = gsub.add_parser("get", help="print the members of group NAME (an idset)")
    g.add_argument("name", metavar="NAME")
    g.add_argument("-w", "--watch", action="store_true",
                   help="print them again at every change, until interrupted")
    add_answer_timeout(g)
    g = gsub.add_parser("join", help="make the rank attached to a member of NAME while "
                        "COMMAND runs (or until interrupted)")
    g.add_argument("name", metavar="NAME")
    g.add_argument("cmdline", nargs=argparse.REMAINDER, metavar="COMMAND")
    for verb, what in (("waitfor", "wait until NAME has N members"),
                       ("barrier", "join NAME, wait until it has N members, leave")):
        g = gsub.add_parser(verb, help=what)
        g.add_argument("name", metavar="NAME")
        g.add_argument("-c", "--count", type=non_negative_int, metavar="N",
                       help="the members to wait for (default: the instance's size)")
        add_answer_timeout(g)
    s.set_defaults(func=cmd_groups)


def cmd_groups(args: argparse.Namespace) -> int:
    args.what = f"groups {args.groups_cmd}"
    if args.groups_cmd == "join":
        return run_async(args, lambda: _join(args))

    async def main() -> int:
        async with await connect() as h:
            groups = Groups(h)
            if args.groups_cmd == "get" and not args.watch:
                print(encode_ranks(sorted(await groups.get(args.name))))
            elif args.groups_cmd == "get":
                async for ranks in groups.watch(args.name):
                    print(encode_ranks(sorted(ranks)), flush=True)
            elif args.groups_cmd == "barrier":
                await groups.barrier(args.name, args.count)
            else:
                count = args.count
                if count is None:
                    count = int(await h.attr_get("size"))
                await groups.wait_for(args.name, count)
        return 0

    return run_async(args, main, streams=args.groups_cmd == "get" and args.watch)


async def _join(args: argparse.Namespace) -> int:
    """Join, run COMMAND (its status is ours) or wait for a stop signal,
    leave.  The stop signals are passed on to COMMAND, as ``exec`` does."""
    from broker.command import (
        STOP_SIGNALS,
        Command,
        cannot_run_message,
        cannot_run_status,
        exit_code,
    )

    command = command_args(args.cmdline)
    loop = asyncio.get_running_loop()
    async with await connect() as h:
        groups = Groups(h)
        await groups.join(args.name)
        if not command:
            stop = asyncio.Event()
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, stop.set)
            try:
                await stop.wait()
            finally:
                for sig in STOP_SIGNALS:
                    loop.remove_signal_handler(sig)
            await groups.leave(args.name)
            return 0
        try:
            cmd = Command.spawn(command, dict(os.environ))
        except OSError as exc:
            print(f"kvbroker: {cannot_run_message(command[0], exc)}", file=sys.stderr)
            return cannot_run_status(exc)
        with cmd.forwarding_stop_signals():
            code = await cmd.wait()
        await groups.leave(args.name)
        return exit_code(code)
