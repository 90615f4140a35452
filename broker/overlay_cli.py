"""``kvbroker overlay``: the tree's health and traffic, as ``flux overlay``
(``status``, ``errors``, ``trace``, ``disconnect``, ``lookup``, ``parentof``).
The parser is built in :mod:`broker.cli`; the commands run here."""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import math
import operator
import os
from typing import Any

from broker import logring
from broker.cliutil import (
    CLIError,
    UsageError,
    connect,
    dumps,
    rank_int,
    rank_set,
    run_async,
    use_color,
)
from broker.handle import Handle
from broker.idset import encode_ranks
from broker.message import MsgType


def cmd_overlay(args: argparse.Namespace) -> int:
    from broker import status

    async def main() -> int:
        limit = args.timeout or 2.0 if args.wait is None else args.timeout
        async with await connect(timeout=limit) as h:
            try:
                if args.wait is None:
                    ranks, fanout = await status.gather(h, timeout=args.timeout or 2.0)
                else:
                    ranks, fanout = await wait_for_state(h)
            except TimeoutError as exc:
                raise CLIError("overlay status", detail=str(exc)) from None
        if args.summary:
            print(ranks[0].state)
        else:
            for line in status.render(ranks, fanout):
                print(line)
        return 0 if all(r.state == status.FULL for r in ranks) else 1

    async def wait_for_state(h: Any) -> tuple[list[status.RankStatus], int]:
        """Ask again (every 0.1 s) until rank 0 is in the state asked for,
        as ``flux overlay status --wait``; ``-t`` bounds the whole wait."""
        loop = asyncio.get_running_loop()
        # (no -t: no bound, as Flux's --wait without --timeout)
        deadline = loop.time() + (args.timeout or math.inf)
        last = "no answer"
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                # (each rank within the default 2 s, or what is left)
                ranks, fanout = await status.gather(h, timeout=min(2.0, left))
            except TimeoutError:
                # (what was left bounded this try: the wait's own end, even
                # if the loop's timer fired a hair before the deadline --
                # "did not answer in 1.5e-11s" was printed so once)
                if left >= 2.0 and loop.time() < deadline:
                    raise
                raise TimeoutError(f"{os.strerror(errno.ETIMEDOUT)} (rank 0 not {args.wait} "
                                   f"within {args.timeout:g}s: {last})") from None
            last = ranks[0].state
            if last == args.wait:
                return ranks, fanout
            await asyncio.sleep(min(0.1, max(0.0, deadline - loop.time())))

    async def disconnect() -> int:
        from broker import topology

        async with await connect() as h:
            # (size and fanout: the attached rank's, the same as rank 0's,
            # which a torpid rank on the way might keep from answering)
            size = int(await h.attr_get("size"))
            target = await disconnect_target(h)
            if target >= size:
                raise CLIError("overlay disconnect", detail=f"rank {target} is not a "
                               f"rank of this instance (size {size})")
            parent = args.parent
            if parent is None:
                fanout = int(await h.attr_get("fanout"))
                parent = topology.parent_of(target, fanout)
                if parent is None:
                    raise CLIError("overlay disconnect", detail="rank 0 has no parent: "
                                   "stop the instance instead (kvbroker shutdown)")
            print(f"asking rank {parent} to disconnect child rank {target}", flush=True)
            await h.rpc("overlay.disconnect-subtree", {"rank": target}, nodeid=parent)
        return 0

    async def disconnect_target(h: Handle) -> int:
        """TARGET: a rank, or the host of exactly one rank (as Flux's)."""
        text = args.target
        if isinstance(text, int):
            return text
        hosts = str(await h.attr_get("hostlist")).split(",")
        ranks = [rank for rank, host in enumerate(hosts) if host == text]
        if len(ranks) != 1:
            why = (f"ranks {encode_ranks(ranks)} run on host {text!r}: name one" if ranks
                   else f"no rank of this instance runs on host {text!r}")
            raise CLIError("overlay disconnect",
                           detail=f"TARGET must be a valid rank or hostname: {why}")
        return ranks[0]

    async def lookup() -> int:
        async with await connect() as h:
            hosts = str(await h.attr_get("hostlist")).split(",")
        print(translate_target(args.target, hosts))
        return 0

    async def parentof() -> int:
        from broker import topology

        async with await connect() as h:
            size = int(await h.attr_get("size"))
            fanout = int(await h.attr_get("fanout"))
        if args.rank >= size:
            raise CLIError("overlay parentof", detail=f"{args.rank} is not a rank of this "
                           f"instance (size {size})")
        parent = topology.parent_of(args.rank, fanout)
        if parent is None:
            raise CLIError("overlay parentof", detail="rank 0 has no parent")
        print(parent)
        return 0

    async def list_errors() -> int:
        limit = args.timeout or 2.0  # (connecting too, as overlay status and uptime)
        async with await connect(timeout=limit) as h:
            try:
                ranks, _ = await status.gather(h, timeout=limit)
            except TimeoutError as exc:
                raise CLIError("overlay errors", detail=str(exc)) from None
        for line in status.errors(ranks):
            print(line)
        return 0

    async def trace() -> int:
        fmt = logring.DmesgFormat(human=args.human, delta=args.delta,
                                  color=use_color(args.color))
        async with await connect() as h:
            async for answer in h.overlay_trace(
                    args.topic_glob, types=functools.reduce(operator.or_, args.types or (), 0),
                    full=args.full, peer=-1 if args.peer is None else args.peer):
                print(trace_line(fmt, answer), flush=True)
        return 0

    if args.overlay_cmd == "trace" and args.delta and not args.human:
        raise UsageError("--delta can only be used with --human")
    commands = {"status": main, "trace": trace, "disconnect": disconnect,
                "errors": list_errors, "lookup": lookup, "parentof": parentof}
    args.what = f"overlay {args.overlay_cmd}"
    return run_async(args, commands[args.overlay_cmd], streams=args.overlay_cmd == "trace")


TRACE_TYPES = {"request": MsgType.REQUEST, "response": MsgType.RESPONSE,
               "event": MsgType.EVENT, "control": MsgType.CONTROL}
TRACE_MARKS = {MsgType.REQUEST: ">", MsgType.RESPONSE: "<", MsgType.EVENT: "e",
               MsgType.CONTROL: "c"}
"""``overlay trace``'s mark of each message type, as Flux's."""


def trace_types(text: str) -> int:
    """argparse ``type`` for ``overlay trace -t request,event``: the type bits."""
    mask = 0
    for name in text.split(","):
        if name not in TRACE_TYPES:
            raise argparse.ArgumentTypeError("valid types: " + ", ".join(TRACE_TYPES))
        mask |= TRACE_TYPES[name]
    return mask


def trace_line(fmt: logring.DmesgFormat, answer: dict[str, Any]) -> str:
    """One ``overlay.trace`` answer as ``flux overlay trace`` prints it:
    ``<time> rx 1 > kvs.commit [312B]``, a response with ``success`` or its
    errno's name, and with ``--full`` the payload (JSON) or error text on
    the lines below."""
    mtype, errnum = int(answer.get("type", 0)), int(answer.get("errnum", 0))
    line = (f"{answer.get('prefix')} {answer.get('rank')} {TRACE_MARKS.get(mtype, '?')} "
            f"{answer.get('topic')} [{_size_text(int(answer.get('size', 0)))}]")
    if mtype == MsgType.RESPONSE:
        line += " success" if not errnum else f" {errno.errorcode.get(errnum, f'errno {errnum}')}"
    if "errstr" in answer and answer["errstr"]:
        line += "\n" + str(answer["errstr"])
    elif "payload" in answer and answer["payload"] is not None:
        line += "\n" + dumps(answer["payload"], pretty=True)
    if mtype == MsgType.RESPONSE and errnum:
        line = fmt.paint("error", line)
    return f"{fmt.stamp(float(answer.get('timestamp', 0.0)))} {line}"


def _size_text(n: int) -> str:
    """``312B``, ``1.5K``, ``2.0M``: a message's size, as Flux's trace prints it."""
    if n < 1024:
        return f"{n}B"
    if n < 1 << 20:
        return f"{n / 1024:.1f}K"
    return f"{n / (1 << 20):.1f}M"


def rank_or_host(text: str) -> int | str:
    """argparse ``type`` for ``overlay disconnect TARGET``: a rank (checked
    as :func:`rank_int` checks one), else a host name, looked up later.
    A negative number is a rank's, refused as one (it was looked up as a
    host name: "no rank of this instance runs on host '-1'")."""
    digits = text[1:] if text.startswith("-") else text
    return rank_int(text) if digits.isascii() and digits.isdigit() else text


def translate_target(target: str, hosts: list[str]) -> str:
    """``overlay lookup``: a rank idset (``0-3``, ``all``) to the host list of
    those ranks, in rank order (``node[0-3]``), or a host list to the idset
    of the ranks on those hosts -- every rank of a host, where Flux names
    the first (here several ranks commonly share one host).  ``hosts``: the
    instance's host by rank (the ``hostlist`` attribute)."""
    from broker import hostlist

    try:
        wanted = rank_set(target)
    except argparse.ArgumentTypeError:
        pass
    else:
        return hostlist.encode(hosts[r] for r in wanted.ranks(len(hosts), "overlay lookup",
                                                              routed=False))
    try:
        names = hostlist.expand(target)
    except ValueError as exc:
        raise CLIError("overlay lookup", detail=f"TARGET must be a rank idset or a host "
                       f"list: {exc}") from None
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    ranks: set[int] = set()
    for name in names:
        found = by_host.get(name)
        if found is None:
            raise CLIError("overlay lookup", detail=f"no rank of this instance runs on "
                           f"host {name!r} (its hosts: {hostlist.encode(dict.fromkeys(hosts))})")
        ranks.update(found)
    return encode_ranks(sorted(ranks))
