"""The watching side of ``kvbroker kvs`` (``get -w/-W/-S``, ``eventlog get -w/-W/-S``,
``eventlog wait-event``), as ``flux kvs`` does it.

:mod:`kvs.cli` parses the command line and calls, with the parsed ``args``
(``args.namespace`` already resolved, ``args.what`` set):

* :func:`watch_get` -- ``kvs get [-w] [-W] [-c N] [-u] [-A] [-f] [--deletes] [-S] [-r] [-t]
  [-l] KEY...``
* :func:`eventlog_get` -- ``kvs eventlog get [-w] [-W] [-c N] [-S] [-u|-H|-L] KEY``
* :func:`eventlog_wait_event` -- ``kvs eventlog wait-event [-W] [-t SECS] [-q|-v] KEY NAME``
* :func:`watch_keys` -- ``kvs watch-keys [-W] [-c N] [-v] [KEY]``
* :func:`watch_namespaces` -- ``kvs namespace watch [-c N] [--changes-only] [--json]
  [PREFIX]``

Each connects to ``$KVBROKER_URI``, runs on the loop the user chose and
returns the exit status; errors raise :class:`broker.cliutil.CLIError`
(``kvbroker: KEY: <strerror>``).  Output is flushed after every answer.
Ctrl-C (the runner cancels the command) cancels the watch on the broker
before the command exits (status 130).  The ``*_async`` variants take a
connected handle and an output stream (bytes), for reuse and tests.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import IO, Any, TypeVar

from broker.cliutil import CLIError, connect, errno_detail, run_async
from broker.errors import ErrnoError
from broker.handle import Handle
from broker.rpc import HandleCore
from kvs.cli import error_detail, isdir_hint
from kvs.client import Link, default_namespace
from kvs.keys import shown
from kvs_watch import flags as F
from kvs_watch.client import (
    BAD_EVENTLOG,
    INITIAL_DONE,
    EventlogParser,
    InitialDone,
    Watch,
    WatchEntry,
    behind_removals,
    watch_eventlog,
)
from kvs_watch.client import watch_keys as kvs_watch_keys
from kvs_watch.client import watch_namespaces as kvs_watch_namespaces

__all__ = [
    "eventlog_get",
    "eventlog_get_async",
    "eventlog_wait_event",
    "eventlog_wait_event_async",
    "get_flags",
    "watch_get",
    "watch_get_async",
    "watch_keys",
    "watch_keys_async",
    "watch_namespaces",
    "watch_namespaces_async",
]

T = TypeVar("T")

_BAD = errno_detail(ErrnoError(errno.EINVAL, BAD_EVENTLOG))
"""A malformed eventlog, in the words of ``kvbroker kvs eventlog get`` without a watch."""


def _run(args: argparse.Namespace, body: Callable[[Handle], Awaitable[int]]) -> int:
    async def main() -> int:
        # (-t/--timeout bounds connecting too: an ssh:// host that never
        # answers kept a watch with a timeout waiting for ever)
        async with await connect(reconnect=getattr(args, "reconnect", False),
                                 timeout=getattr(args, "timeout", None)) as h:
            return await body(h)

    try:
        return run_async(args, main, streams=True)
    finally:
        sys.stdout.flush()
        sys.stdout.buffer.flush()


def _out(out: IO[bytes] | None) -> IO[bytes]:
    return out if out is not None else sys.stdout.buffer


def _ns(args: argparse.Namespace) -> str:
    return default_namespace(getattr(args, "namespace", None))


# ---------------------------------------------------------------- kvs get


def get_flags(args: argparse.Namespace) -> int:
    """The kvs-watch flags of ``kvs get`` options, as ``flux kvs get`` sets them
    (``-u``, ``-A``, ``-f`` only count with ``-w``)."""
    flags = F.TREEOBJ if getattr(args, "treeobj", False) else 0
    if getattr(args, "watch", False):
        flags |= F.WATCH
        if getattr(args, "full", False):
            flags |= F.FULL
        if getattr(args, "uniq", False):
            flags |= F.UNIQ
        if getattr(args, "append", False):
            flags |= F.APPEND
        if getattr(args, "deletes", False):
            flags |= F.DELETES
    if getattr(args, "waitcreate", False):
        flags |= F.WAITCREATE
    if getattr(args, "stream", False):
        flags |= F.STREAM
    return flags


def watch_get(args: argparse.Namespace) -> int:
    """``kvbroker kvs get`` with ``--watch``, ``--waitcreate`` or ``--stream``."""
    return _run(args, lambda h: watch_get_async(h, args))


async def watch_get_async(h: HandleCore, args: argparse.Namespace,
                          out: IO[bytes] | None = None) -> int:
    """Print each answer for every key in ``args.keys``.

    With ``--watch`` the keys are watched together (as ``flux kvs get``);
    otherwise one after the other, in command-line order.
    """
    if getattr(args, "at", None):
        raise CLIError(getattr(args, "what", "kvs get"),
                       detail="--at cannot be combined with --watch, --waitcreate or --stream")
    keys = list(getattr(args, "keys", None) or [args.key])
    flags = get_flags(args)
    try:
        F.check(flags, streaming=True)
    except ErrnoError as exc:
        raise CLIError(getattr(args, "what", "kvs get"), detail=error_detail(exc, "")) from None
    timeout: float | None = getattr(args, "timeout", None)
    what = getattr(args, "what", "kvs get") if len(keys) > 1 else keys[0]
    answered: set[str] = set()  # the keys whose watch has had an answer
    try:
        async with asyncio.timeout(timeout) as bound:
            await behind_removals(h)  # (once, for every key)
            if flags & F.WATCH and len(keys) > 1:
                try:
                    async with asyncio.TaskGroup() as tg:
                        for key in keys:
                            tg.create_task(_get_one(h, key, flags, args, out, answered))
                except ExceptionGroup as eg:
                    raise eg.exceptions[0] from None
            else:
                for key in keys:
                    what = key  # (waited one after the other: this one)
                    await _get_one(h, key, flags, args, out, answered)
    except TimeoutError:
        if timeout is None or not bound.expired():
            raise  # (not --timeout's: a socket's own, say)
        if flags & F.WATCH and not flags & F.WAITCREATE and not answered:
            # A watch answers at once (the value, or ENOENT): none came, so
            # the rank never served it (stopped, say) -- nothing was watched.
            why = f"the rank did not answer in {timeout:g} s: stopped or hung?"
        elif flags & F.WATCH and answered:
            why = f"watched for {timeout:g} s"
        else:
            why = f"not created within {timeout:g} s"
        raise CLIError(shown(what), detail=f"{os.strerror(errno.ETIMEDOUT)} ({why})") from None
    return 0


async def _get_one(h: HandleCore, key: str, flags: int, args: argparse.Namespace,
                   out: IO[bytes] | None, answered: set[str]) -> None:
    from kvs.cli import render_value  # the caller's output format

    o = _out(out)
    raw = getattr(args, "raw", False)
    as_treeobj = getattr(args, "treeobj", False)
    label = getattr(args, "label", False)
    count = getattr(args, "count", 0) or 0
    streaming = bool(flags & F.STREAM)
    seen = 0
    wrote = False  # (a streamed value's line is ended once it is all there)
    cut = False  # a streamed value's first NUL byte was printed up to
    try:
        async with Watch[WatchEntry | InitialDone](h, key, flags, namespace=_ns(args)) as w:
            async for entry in w:
                answered.add(key)
                if not isinstance(entry, WatchEntry):
                    continue
                if entry.treeobj is None:  # removed (--deletes): a line no tree object prints
                    o.write(b"null\n" if as_treeobj else
                            f"{key} (removed)\n".encode("utf-8", "surrogateescape"))
                elif streaming and not as_treeobj and not raw:
                    # chunks of one value: printed as the default prints a
                    # whole one (up to its first NUL byte, after KEY= with -l)
                    chunk = entry.value or b""
                    data = b"" if cut else chunk
                    if b"\0" in data:
                        data, cut = data.split(b"\0", 1)[0], True
                    if label and not wrote:
                        data = f"{key}=".encode("utf-8", "surrogateescape") + data
                    o.write(data)
                    wrote = wrote or bool(data) or bool(chunk)  # (b"\0abc" prints a line)
                else:
                    o.write(render_value(key, entry.treeobj, raw=raw, as_treeobj=as_treeobj,
                                         label=label))
                o.flush()
                seen += 1
                if flags & F.WATCH and count and seen >= count:
                    break
    except ErrnoError as exc:
        err = CLIError(shown(key), detail=error_detail(exc, key))
        if flags & F.WATCH:
            err = isdir_hint(err, exc, f"kvbroker kvs watch-keys {key} watches what is below it")
        else:
            err = isdir_hint(err, exc, f"kvbroker kvs dir {key} prints what is below it")
        raise err from None
    finally:
        if wrote:
            o.write(b"\n")
            o.flush()


# ---------------------------------------------------------------- watch-keys


def watch_keys(args: argparse.Namespace) -> int:
    """``kvbroker kvs watch-keys [-W] [-c N] [-v] [KEY]``."""
    return _run(args, lambda h: watch_keys_async(h, args))


async def watch_keys_async(h: HandleCore, args: argparse.Namespace,
                           out: IO[bytes] | None = None) -> int:
    """Print ``VERSION KEY`` for each key a commit writes at or below
    ``args.key`` (``-v``: what the key holds at that version, see
    :func:`_value_at`); ``-c N``: stop after N commits.  ``--since ROOT``
    first prints the keys that differ between ROOT and the root the watch
    starts at (``kvs.diff``), at that version: catching up after a gap."""
    from kvs.client import as_root
    from kvs.treeobj import dirref

    o = _out(out)
    key = args.key
    count = getattr(args, "count", 0) or 0
    since = getattr(args, "since", None)
    ns = _ns(args)
    seen = 0
    try:
        old = as_root(since)["data"][0] if since is not None else None
    except ErrnoError as exc:
        raise CLIError(f"--since {since}", detail=error_detail(exc, since)) from None
    timeout: float | None = getattr(args, "timeout", None)
    try:
        async with kvs_watch_keys(h, key, namespace=ns, waitcreate=args.waitcreate,
                                  since=old) as w:
            async for change in _started_within(w, timeout, key):
                for k in change.keys:
                    line = f"{change.rootseq} {k}"
                    if args.values:
                        line += await _value_at(h, ns, k, dirref(change.rootref))
                    o.write(line.encode("utf-8", "surrogateescape") + b"\n")
                o.flush()
                if change.initial:
                    continue  # (not a commit: -c counts those)
                seen += 1
                if count and seen >= count:
                    return 0
    except ErrnoError as exc:
        raise CLIError(shown(key), detail=error_detail(exc, key)) from None
    return 0


# ---------------------------------------------------------------- namespace watch


def watch_namespaces(args: argparse.Namespace) -> int:
    """``kvbroker kvs namespace watch [-c N] [--changes-only] [--json] [PREFIX]``."""
    return _run(args, lambda h: watch_namespaces_async(h, args))


async def watch_namespaces_async(h: HandleCore, args: argparse.Namespace,
                                 out: IO[bytes] | None = None) -> int:
    """Print ``exists NS`` for each namespace named ``args.prefix...`` at
    the start, then ``created NS`` / ``removed NS`` as they happen (``--json``:
    each answer as JSON); ``-c N``: stop after N lines.  A line per answer,
    flushed, so ``while read event ns`` in a shell sees each at once."""
    o = _out(out)
    count = getattr(args, "count", 0) or 0
    prefix = getattr(args, "prefix", "") or ""
    seen = 0
    try:
        async with kvs_watch_namespaces(h, prefix,
                                        changes_only=getattr(args, "changes_only", False)) as w:
            async for ev in w:
                if getattr(args, "json", False):
                    line = json.dumps({"namespace": ev.namespace, "owner": ev.owner,
                                       "event": ev.event, "epoch": ev.epoch,
                                       "initial": ev.initial})
                else:
                    line = f"{'exists' if ev.initial else ev.event} {ev.namespace}"
                o.write(line.encode("utf-8", "surrogateescape") + b"\n")
                o.flush()
                seen += 1
                if count and seen >= count:
                    return 0
    except ErrnoError as exc:
        raise CLIError(getattr(args, "what", "kvs namespace watch"),
                       detail=error_detail(exc, prefix)) from None
    return 0


async def _started_within(changes: AsyncIterator[T], timeout: float | None,
                          key: str) -> AsyncIterator[T]:
    """``changes``, the first of which (the watch's start: the ``initial``
    answer) must come within ``timeout`` seconds (``watch-keys -t``): with
    ``-W`` the namespace may never be created, and a stopped rank never
    answers -- the watch then waited for ever.  What follows is not
    bounded: a watch runs until interrupted."""
    it = aiter(changes)
    try:
        async with asyncio.timeout(timeout) as bound:
            first = await anext(it, None)
    except TimeoutError:
        if timeout is None or not bound.expired():
            raise
        raise CLIError(shown(key), detail=f"{os.strerror(errno.ETIMEDOUT)} (watch not started "
                                   f"within {timeout:g} s)") from None
    if first is None:
        return
    yield first
    async for change in it:
        yield change


async def _value_at(h: HandleCore, ns: str, key: str, root: dict[str, Any]) -> str:
    """What ``-v`` prints after the key: ``=VALUE`` (up to its first NUL),
    ``.`` for a directory, `` -> TARGET`` for a symlink (not followed),
    `` (removed)``, or `` (ERROR)`` when it cannot be read (the watch goes on):
    a root collected by ``kvs gc`` before it was read says so, not "removed"
    (``kvs.lookup-plus`` answers a missing key as data, so its ``ENOENT`` is
    the root's)."""
    async def lookup(flags: int) -> Any:
        return (await h.rpc("kvs.lookup-plus", {"key": key, "flags": flags, "namespace": ns,
                                                "rootdir": root}))["val"]
    try:
        obj = await lookup(F.TREEOBJ)
        if obj is None:
            return " (removed)"
        kind = obj["type"]
        if kind in ("dir", "dirref"):
            return "."
        if kind == "symlink":
            return f" -> {Link.from_treeobj(obj)}"
        if kind == "valref":
            obj = await lookup(0)
            if obj is None:  # (cannot be: the same root had a valref there)
                return " (removed)"
    except ErrnoError as exc:
        return f" ({error_detail(exc, key)})"
    data = bytes(obj["data"]).split(b"\0", 1)[0]
    return "=" + data.decode("utf-8", "surrogateescape")


# ---------------------------------------------------------------- eventlog get


def eventlog_get(args: argparse.Namespace) -> int:
    """``kvbroker kvs eventlog get`` with ``--watch``, ``--waitcreate`` or ``--stream``."""
    from kvs.cli import make_formatter

    fmt = make_formatter(args)
    return _run(args, lambda h: eventlog_get_async(h, args, fmt))


async def eventlog_get_async(h: HandleCore, args: argparse.Namespace, fmt: Any,
                             out: IO[bytes] | None = None) -> int:
    """Print the events of ``args.key`` (``fmt``: a :class:`kvs.eventlog.Formatter`).

    ``--watch`` keeps printing appended events (``--count N``: stop after N
    events); without it the current eventlog is printed once (waiting for it
    with ``--waitcreate``; fetched in chunks with ``--stream``).
    """
    o = _out(out)
    key = args.key
    flags = 0
    if args.watch:
        flags |= F.WATCH | F.APPEND
    if args.waitcreate:
        flags |= F.WAITCREATE
    if getattr(args, "stream", False):
        flags |= F.STREAM
    count = getattr(args, "count", 0) or 0
    parser = EventlogParser()
    seen = 0
    try:
        await behind_removals(h)
        async with Watch[WatchEntry | InitialDone](h, key, flags, namespace=_ns(args)) as w:
            async for entry in w:
                if entry is INITIAL_DONE or not isinstance(entry, WatchEntry):
                    continue
                for e in parser.feed(entry.value or b""):
                    if not count or seen < count:
                        o.write(fmt.format(e).encode() + b"\n")
                    seen += 1
                o.flush()
                if args.watch and count and seen >= count:
                    return 0
            parser.close()
    except ErrnoError as exc:
        raise CLIError(shown(key), detail=error_detail(exc, key)) from None
    except ValueError:
        raise CLIError(shown(key), detail=_BAD) from None
    return 0


# ---------------------------------------------------------------- eventlog wait-event


def eventlog_wait_event(args: argparse.Namespace) -> int:
    """``kvbroker kvs eventlog wait-event [-W] [-t SECS] [-q|-v] KEY NAME``."""
    from kvs.cli import make_formatter

    fmt = make_formatter(args)
    # (never sent, only compared with each event's name: one that is not
    # UTF-8 matched nothing, and the command waited for ever -- refused
    # before anything is sent, as a key is)
    args.event.encode("utf-8")
    return _run(args, lambda h: eventlog_wait_event_async(
        h, args.key, args.event, fmt, namespace=_ns(args),
        timeout=getattr(args, "timeout", None), waitcreate=args.waitcreate,
        quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", False)))


async def eventlog_wait_event_async(
    h: HandleCore, key: str, name: str, fmt: Any, *, namespace: str | None = None,
    timeout: float | None = None, waitcreate: bool = False, quiet: bool = False,
    verbose: bool = False, out: IO[bytes] | None = None,
) -> int:
    """Wait until eventlog ``key`` has an event ``name``; print it (``-v``: and
    every event before it; ``-q``: nothing).  Errors as ``flux kvs eventlog
    wait-event`` (a timeout, a missing eventlog without ``waitcreate``, a
    malformed one), in the ``KEY: <strerror> (...)`` form of every kvs
    command: ``ETIMEDOUT``, ``ENOENT``, ``EINVAL``."""
    o = _out(out)
    try:
        async with asyncio.timeout(timeout):
            await behind_removals(h)
            async with watch_eventlog(h, key, namespace=namespace, waitcreate=waitcreate) as log:
                async for e in log:
                    if e["name"] == name:
                        if not quiet:
                            o.write(fmt.format(e).encode() + b"\n")
                            o.flush()
                        return 0
                    if verbose:
                        o.write(fmt.format(e).encode() + b"\n")
                        o.flush()
    except TimeoutError:
        raise CLIError(shown(key), detail=f"{os.strerror(errno.ETIMEDOUT)} "
                                   f"(no event '{name}' within {timeout:g} s)") from None
    except ErrnoError as exc:
        raise CLIError(shown(key), detail=error_detail(exc, key)) from None
    except ValueError:
        raise CLIError(shown(key), detail=_BAD) from None
    raise CLIError(shown(key),
                   detail=f"{os.strerror(errno.ENODATA)} (event '{name}' never received)")
