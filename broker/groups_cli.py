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
import contextlib
import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from broker.cliutil import (
    CLIError,
    add_answer_timeout,
    command_args,
    connect,
    non_negative_int,
    run_async,
    timed_out,
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
    if args.groups_cmd in ("waitfor", "barrier"):
        return _wait(args)
    if args.watch:
        return _watch(args)

    async def main() -> int:
        async with await connect() as h:
            print(encode_ranks(sorted(await Groups(h).get(args.name))))
        return 0

    return run_async(args, main)


def _watch(args: argparse.Namespace) -> int:
    """``get -w``: its ``-t`` bounds connecting and the first answer only,
    as ``rpc --stream -t``: the later ones come when the group changes, and
    a bound on the whole watch ended a healthy one with ``no answer: stopped
    or hung?`` after printing what rank 0 had answered."""
    limit: float | None = args.answer_timeout
    args.answer_timeout = None

    async def main() -> int:
        async with contextlib.AsyncExitStack() as closing:
            try:
                async with asyncio.timeout(limit) as bound:
                    h = await closing.enter_async_context(await connect())
                    changes = await closing.enter_async_context(
                        contextlib.aclosing(Groups(h).watch(args.name)))
                    first = await anext(changes)
            except TimeoutError:
                if limit is None or not bound.expired():
                    raise
                raise timed_out(args.what, None, limit) from None
            print(encode_ranks(sorted(first)), flush=True)
            async for ranks in changes:
                print(encode_ranks(sorted(ranks)), flush=True)
        return 0

    return run_async(args, main, streams=True)


def _wait(args: argparse.Namespace) -> int:
    """``waitfor`` and ``barrier``: their ``-t`` bounds the whole command
    here, not in :func:`run_async`, so a group that rank 0 reported but that
    fell short of the count says so -- ``no answer: stopped or hung?`` sent
    the operator after a rank that had answered at once."""
    limit: float | None = args.answer_timeout
    args.answer_timeout = None
    last: list[set[int]] = []  # (the members at rank 0's latest answer, once one came)
    count: int = args.count

    def seen(members: set[int]) -> None:  # (the latest only: a watch may run for days)
        last[:] = [members]

    async def main() -> int:
        try:
            async with asyncio.timeout(limit) as bound:
                await wait(seen)
        except TimeoutError:
            if bound.expired() and last:
                raise CLIError(args.what, detail=short_of(last[-1], limit)) from None
            if bound.expired():
                raise timed_out(args.what, None, limit or 0) from None
            raise
        return 0

    async def wait(seen: Callable[[set[int]], None]) -> None:
        nonlocal count
        async with await connect() as h:
            groups = Groups(h)
            if count is None:  # (every rank)
                count = int(await h.attr_get("size"))
            if args.groups_cmd == "barrier":
                await groups.barrier(args.name, count, seen=seen)
            else:
                await groups.wait_for(args.name, count, seen=seen)

    def short_of(members: set[int], limit: float | None) -> str:
        return (f"{os.strerror(errno.ETIMEDOUT)} ({args.name} had {len(members)} of "
                f"the {count} members waited for ({encode_ranks(sorted(members)) or 'none'}) "
                f"after {limit:g}s)")

    return run_async(args, main)


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
        # The membership is the connection's: when it is lost (the rank
        # stopped), say so at once -- a join without COMMAND waited silently
        # for a signal for as long as it ran, not a member any more.
        lost = asyncio.ensure_future(h.wait_closed())
        try:
            if not command:
                stop = asyncio.Event()
                for sig in STOP_SIGNALS:
                    loop.add_signal_handler(sig, stop.set)
                try:
                    waiting = asyncio.ensure_future(stop.wait())
                    await asyncio.wait([waiting, lost], return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                finally:
                    for sig in STOP_SIGNALS:
                        loop.remove_signal_handler(sig)
                if not stop.is_set():
                    raise _membership_lost(args)
                await groups.leave(args.name)
                return 0
            try:
                cmd = Command.spawn(command, dict(os.environ))
            except OSError as exc:
                print(f"kvbroker: {cannot_run_message(command[0], exc)}", file=sys.stderr)
                return cannot_run_status(exc)

            def tell(fut: asyncio.Future[None]) -> None:
                if not fut.cancelled():
                    print(f"kvbroker: {_membership_lost(args)}; {command[0]} goes on",
                          file=sys.stderr, flush=True)

            lost.add_done_callback(tell)
            with cmd.forwarding_stop_signals():
                code = await cmd.wait()
            if lost.done():
                raise _membership_lost(args)
            await groups.leave(args.name)
            return exit_code(code)
        finally:
            lost.cancel()


def _membership_lost(args: argparse.Namespace) -> CLIError:
    return CLIError(args.what, errno.ECONNRESET,
                    f"{args.name}: the connection to the broker was lost (its rank stopped?): "
                    "no longer a member")
