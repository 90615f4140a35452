"""Helpers shared by every CLI subcommand (broker's and the plugins')."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import contextvars
import errno
import json
import math
import os
import re
import select
import stat
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, NoReturn, TypeVar

import msgpack

from broker import jsontoml
from broker.errors import ErrnoError
from broker.handle import URI_ENV, Handle
from broker.idset import encode_ranks
from broker.loops import loop_factory
from broker.message import NODEID_ANY, NODEID_UPSTREAM


class CLIError(Exception):
    """``kvbroker: <what>: <strerror>`` and exit status 1 (or ``status``:
    :data:`CONDITION_FAILED`)."""

    def __init__(self, what: str, errnum: int | None = None, detail: str | None = None,
                 status: int = 1) -> None:
        self.what = what
        self.detail = detail or (os.strerror(errnum) if errnum else None)
        self.status = status
        super().__init__(what)

    def __str__(self) -> str:
        return f"{self.what}: {self.detail}" if self.detail else self.what


CONDITION_FAILED = 3
"""The exit status of ``kvs put``/``unlink`` whose ``--expect`` condition
failed (nothing changed): a script taking a lock can tell "held by another"
(try again) from any other error (1) and a usage error (2), as ``grep``
tells "no match" from trouble."""


class UsageError(Exception):
    """A command line that cannot mean anything: the subcommand's usage and
    the message on stderr, exit status 2 (as argparse's own errors)."""


class ConnectError(Exception):
    """The broker cannot be reached.  The message names the URI tried and
    where it came from: ``No such file or directory`` alone does not say
    that ``$KVBROKER_URI`` is stale, mistyped or unset."""


_CONNECT_HINTS = {
    errno.ENOENT: "no broker there: has the instance stopped, or is that rank still "
                  "waiting for its parent (kvbroker broker)?",
    errno.ECONNREFUSED: "no broker listens there: has the instance stopped, or is that "
                        "rank, restarted, still waiting for its parent (kvbroker broker)?",
    errno.EACCES: "this instance admits other users only if started with "
                  "-S access.allow-guest-user=true",
}


async def connect(reconnect: bool = False, timeout: float | None = None) -> Handle:
    """:meth:`Handle.connect` to ``$KVBROKER_URI``, for a command: failing
    with a :class:`ConnectError` that says which URI could not be reached
    (``reconnect``: ``--reconnect``, a watch that goes on if the rank
    restarts; ``timeout``: give up after that many seconds -- an ssh://
    host that never answers hung a command whose ``-t`` bounded only its
    requests)."""
    uri = os.environ.get(URI_ENV)
    if not uri:
        raise ConnectError(f"cannot connect to broker: {URI_ENV} is not set (kvbroker start "
                           "prints it and sets it for the command it runs)")
    where = f"cannot connect to broker at {URI_ENV}={uri}"
    connecting = _connecting.get()  # (see timed_out)
    if connecting is None:
        return await _connect(uri, where, reconnect, timeout)
    connecting.append(where)
    try:
        handle = await _connect(uri, where, reconnect, timeout)
    except asyncio.CancelledError:
        raise  # (still connecting, as the -t that cut it off says)
    except BaseException:
        connecting.remove(where)
        raise
    connecting.remove(where)
    return handle


async def _connect(uri: str, where: str, reconnect: bool, timeout: float | None) -> Handle:
    """:func:`connect`'s connecting, its failures said as :class:`ConnectError`."""
    try:
        async with asyncio.timeout(timeout):
            return await Handle.connect(uri, reconnect=reconnect)
    except TimeoutError:
        raise ConnectError(f"{where}: {os.strerror(errno.ETIMEDOUT)} (no answer in "
                           f"{timeout:g}s)") from None
    except ValueError as exc:  # not a URI we know
        raise ConnectError(f"{where}: {exc}") from None
    except OSError as exc:
        detail = exc.strerror or str(exc)
        # (over ssh:// the message already says what failed, and where)
        if exc.errno == errno.ECONNREFUSED and not uri.startswith("ssh://"):
            kind = _not_a_socket(uri)  # (Linux refuses a file or directory so too)
            if kind:
                raise ConnectError(f"{where}: {kind}, not a socket (a rank's is "
                                   "RUNDIR/local-RANK: kvbroker attr get local-uri)") from None
        hint = None if uri.startswith("ssh://") else _CONNECT_HINTS.get(exc.errno or 0)
        raise ConnectError(f"{where}: {detail}" + (f" ({hint})" if hint else "")) from None


_connecting: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "connecting", default=None)
"""What :func:`connect` was still connecting to when a command's ``-t``
(:func:`run_async`) cut it off: a host that never answers is said to be
that, not a rank that did not answer a request."""


def timed_out(what: str, who: int | list[Any] | None, limit: float,
              note: str = "") -> Exception:
    """What a command cut off by its ``-t`` (``limit``) raises: the error
    of a connect's own timeout if it was still connecting (:func:`connect`:
    a host that never answers is not a rank that did not answer), else
    :func:`no_answer_detail` of ``who`` (and ``note``)."""
    connecting = _connecting.get()
    if connecting:
        return ConnectError(f"{connecting[0]}: {os.strerror(errno.ETIMEDOUT)} "
                            f"(no answer in {limit:g}s)")
    return CLIError(what, detail=no_answer_detail(who, limit) + note)


def _not_a_socket(uri: str) -> str | None:
    """What the local path of ``uri`` is when it is there but no socket
    (``a directory``, ``a regular file``); None otherwise."""
    import stat

    path = uri[len("local://"):] if uri.startswith("local://") else uri
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISSOCK(mode):
        return None
    return (f"{path} is a directory" if stat.S_ISDIR(mode) else
            f"{path} is a regular file" if stat.S_ISREG(mode) else f"{path} is no socket")


def write_out(data: bytes) -> None:
    """Write ``data`` to standard output, all of it or an error.

    A buffered write larger than the buffer that fails after writing part of
    it (the reader of a pipe left: ``kvs get -r big | head -c 10``) returns
    the part's length instead of raising, and the rest is lost without a
    word; here that is the BrokenPipeError the command's dispatcher knows."""
    written = sys.stdout.buffer.write(data)
    if written is not None and written < len(data):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def non_negative_int(text: str, maximum: int = (1 << 63) - 1) -> int:
    """argparse ``type`` for counts, sizes and versions: refuses ``-2``, and
    more than ``maximum`` (what a message can carry: a traceback before).
    ASCII digits only: Python's ``int()`` also took ``1_0``, `` 3`` and
    other scripts' digits, which no other tool reads as numbers."""
    digits = text[1:] if text.startswith("-") else text
    if not (digits.isascii() and digits.isdigit()):
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}")
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {value}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum}: {value}")
    return value


_SIZE_SCALE = {"": 1, "k": 1 << 10, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size_int(text: str, maximum: int = 1 << 30) -> int:
    """argparse ``type`` for a size in bytes, with Flux's binary suffixes
    (``1024``, ``10K``, ``1.5M``, ``1G``; ``k`` is ``K``), at most ``maximum``
    (default 1 GiB, the largest message a rank takes)."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?)([kKMG]?)", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (bytes, or with K, M or G: 512, 64k, 1.5M)")
    value = float(m.group(1)) * _SIZE_SCALE[m.group(2)]
    if not value <= maximum:  # (and a number too long for a float: inf)
        raise argparse.ArgumentTypeError(f"must be at most {maximum}: {text}")
    return int(value)


def duration_arg(text: str) -> float:
    """argparse ``type`` for a duration of 0 or more: seconds, or with a unit
    as Flux's (``ms``, ``s``, ``m``, ``h``, ``d``: ``0.5``, ``100ms``)."""
    from broker.attrs import duration  # (the attributes' parser: only when asked)

    try:
        return duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


MAX_RANK = 0xFFFFFFFD
"""The largest rank: the node ids above it mean "any rank" and "upstream"."""
MAX_START_SIZE = 4096
"""``kvbroker start --size`` at most: each rank is a process on this host."""


def rank_int(text: str) -> int:
    """argparse ``type`` for a rank: 0 to :data:`MAX_RANK`."""
    return non_negative_int(text, MAX_RANK)


class RankSet:
    """A set of ranks as Flux writes it (an *idset*, RFC 22): ``3``,
    ``0-3``, ``1-2,5``, ``[0-3]``, or ``all``.  Kept as its ranges until
    the instance's size is known, so ``0-4000000000`` costs nothing before
    it is refused."""

    def __init__(self, ranges: tuple[tuple[int, int], ...], every: bool = False,
                 excluded: tuple[tuple[int, int], ...] = ()) -> None:
        self.ranges = ranges
        """Ascending, disjoint ``(first, last)`` ranges (none for ``all``)."""
        self.every = every
        """``all``: every rank of the instance, whatever its size."""
        self.excluded = excluded
        """Ranges taken out of the set (``exec -x``), ascending and disjoint;
        ranks the instance does not have among them are no error."""

    def __str__(self) -> str:
        """As written, less :attr:`excluded`: ``all``, ``0-3,5``."""
        if self.every:
            return "all"
        return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in self.ranges)

    def without(self, other: RankSet) -> RankSet:
        """This set less the ranks of ``other`` (``exec -r IDSET -x IDSET``).
        Kept apart from :attr:`ranges`, so that a rank of ``-r`` beyond the
        instance is still refused (as flux exec checks ``-r`` before
        ``-x``), and so that :meth:`single` still says what was written."""
        gone = ((0, MAX_RANK),) if other.every else other.ranges
        return RankSet(self.ranges, self.every, _union(self.excluded, gone))

    def empty(self) -> bool:
        """Nothing is left whatever the instance's size (``-r 3 -x 3``,
        ``-x all``): known before anything is asked."""
        if self.every:
            return self.excluded[:1] == ((0, MAX_RANK),)
        return not _subtract(self.ranges, self.excluded)

    def single(self) -> int | None:
        """The one rank this set names as written (``3``, ``3-3`` is not
        valid), else None -- ``all`` too, whatever the instance's size."""
        if not self.every and len(self.ranges) == 1 and self.ranges[0][0] == self.ranges[0][1]:
            return self.ranges[0][0]
        return None

    def ranks(self, size: int, what: str, routed: bool = True) -> list[int]:
        """The ranks in an instance of ``size``, in order; raises
        :class:`CLIError` (``<what>: No route to host``, or without
        ``routed`` -- a translation that asks no rank, ``overlay lookup`` --
        the reason alone) naming the first rank it does not have, before
        anything is asked of any rank."""
        if self.every:
            ranges: tuple[tuple[int, int], ...] = ((0, size - 1),) if size else ()
        else:
            ranges = self.ranges
            last = ranges[-1][1]
            if last >= size:
                first_out = max(size, next(lo for lo, hi in ranges if hi >= size))
                why = f"no rank {first_out}: the instance's ranks are {encode_ranks(range(size))}"
                if not routed:
                    raise CLIError(what, detail=why)
                raise CLIError(what, detail=f"{os.strerror(errno.EHOSTUNREACH)} ({why})")
        return [r for lo, hi in _subtract(ranges, self.excluded) for r in range(lo, hi + 1)]


def _union(a: tuple[tuple[int, int], ...],
           b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The ranges of ``a`` and ``b`` (each ascending, disjoint) as one such
    tuple, touching ranges merged."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(a + b):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _subtract(ranges: tuple[tuple[int, int], ...],
              gone: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """``ranges`` less ``gone`` (both ascending, disjoint), as ranges: a
    range of billions costs no more than one of two."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        for glo, ghi in gone:
            if ghi < lo or glo > hi:
                continue
            if glo > lo:
                out.append((lo, glo - 1))
            lo = ghi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return out


def rank_set(text: str) -> RankSet:
    """argparse ``type`` for ``exec -r IDSET``: Flux's idset syntax (RFC
    22) -- ranks and ranges ``N-M`` (M above N), ascending and disjoint,
    without leading zeros, optionally in brackets -- or ``all``.  A lone
    number is checked as :func:`rank_int` is, with its messages (``-r -1``
    says "must not be negative", as it did before ``-r`` took a set)."""
    if text == "all":
        return RankSet((), every=True)
    if text.lstrip("-").isdigit() and not text.startswith("--") and (
            text.startswith("-") or text == "0" or not text.startswith("0")):
        rank = rank_int(text)  # (a lone one: "must not be negative" for -1)
        return RankSet(((rank, rank),))
    body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    ranges: list[tuple[int, int]] = []
    for item in body.split(","):
        lo_text, dash, hi_text = item.partition("-")
        bounds = [lo_text, hi_text] if dash else [lo_text]
        if not all(b.isdigit() and b.isascii() and (b == "0" or not b.startswith("0"))
                   for b in bounds):
            raise argparse.ArgumentTypeError(f"not a rank or range of ranks: {item!r} "
                                             f"(in {text!r}: e.g. 0-3,5 or all)")
        lo, hi = rank_int(bounds[0]), rank_int(bounds[-1])
        if dash and hi <= lo:
            raise argparse.ArgumentTypeError(f"range {item!r} does not ascend (in {text!r})")
        if ranges and lo <= ranges[-1][1]:
            raise argparse.ArgumentTypeError(f"{item!r} is out of order (in {text!r}: "
                                             "ascending, each rank once)")
        ranges.append((lo, hi))
    return RankSet(tuple(ranges))


def uid_int(text: str) -> int:
    """argparse ``type`` for a user id: 0 to 2**32 - 2 (-1 is no user)."""
    return non_negative_int(text, 0xFFFFFFFE)


def finite_float(text: str) -> float:
    """argparse ``type`` for a factor (``stats --scale``): a finite number
    (``inf`` made ``--type int`` a traceback, ``nan`` printed ``nan``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite number: {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type`` for timeouts: a finite number of seconds above 0,
    bare or with a unit as Flux's durations (RFC 23: ``500ms``, ``2s``,
    ``1.5m``, ``1h``, ``1d``), which its commands take where ours take
    seconds (``flux kvs eventlog wait-event -t 5s``).  A timeout of 0 or
    less would expire before any answer could come: every rank "lost", an
    event "never" received -- a mistake, not a request."""
    try:
        value = float(text)
    except ValueError:
        from broker.attrs import duration  # (only for a unit: keeps the CLI's start light)

        try:
            value = duration(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid number of seconds: {text!r} (or a duration: 500ms, 2s, 1m, 1h, "
                "1d)") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text}")
    return value


T = TypeVar("T")


async def each_rank(what: str, ranks: list[Any], call: Callable[[Any], Awaitable[T]],
                    named: bool | None = None,
                    answered: Callable[[list[T]], None] | None = None) -> list[T]:
    """``call(rank)`` for every rank at once (``--all``: ``kvs dropcache``,
    ``attr set``, ``dmesg``), their answers in rank order.  A refusal is
    raised as ``<what>: ranks N,M: <strerror>`` naming every rank that
    refused, those with the same error on one line (the others' lines
    first, on stderr), when ``named`` (default: when there are several
    ranks), else as it came.  Cut off by the command's ``-t``, it leaves the ranks
    that had not answered for the error to name (``attr set --all`` said
    only "no answer", not which rank was stopped).  ``answered``, given
    the answers of the ranks that gave one before a refusal is raised,
    shows them first (``cron list -r all`` printed nothing of the ranks
    that had entries when one rank lacked the module)."""
    calls = [asyncio.ensure_future(call(r)) for r in ranks]
    try:
        answers = await asyncio.gather(*calls, return_exceptions=True)
    except asyncio.CancelledError:  # (by ``-t``: :func:`run_async` names them)
        _unanswered.set([r for r, c in zip(ranks, calls, strict=True) if c.cancelled()])
        raise
    if named is None:
        named = len(ranks) > 1
    out: list[T] = []
    refused: dict[tuple[int, str], list[Any]] = {}
    for rank, answer in zip(ranks, answers, strict=True):
        if isinstance(answer, ErrnoError) and named:
            refused.setdefault((answer.errnum, errno_detail(answer)), []).append(rank)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            out.append(answer)
    if refused:
        if answered is not None and out:  # (none answered: no empty table)
            answered(out)
        # every rank that refused, those alike on one line: naming the first
        # alone read as if the others had taken what was asked
        lines = []
        for (errnum, detail), which in refused.items():
            listed = (encode_ranks(which) if all(type(r) is int for r in which)
                      else ",".join(map(str, which)))
            who = f"rank {which[0]}" if len(which) == 1 else f"ranks {listed}"
            lines.append(CLIError(f"{what}: {who}", errnum, detail))
        for line in lines[:-1]:
            print_err(str(line))
        raise lines[-1]
    return out


def errno_detail(exc: ErrnoError) -> str:
    """``strerror`` of ``exc``'s errno, followed by the service's own message
    in parentheses when it says more (``No route to host (no route to rank
    99: the instance has ranks 0-3)``)."""
    text = os.strerror(exc.errnum)
    if exc.errstr and exc.errstr != text:
        text = f"{text} ({exc.errstr})"
    return text


def jsonable(value: Any) -> Any:
    """Make a payload printable as JSON: bytes as UTF-8 text, else base64
    (a map's bytes keys too: they were printed ``"b'k'"``); a msgpack
    timestamp as an ISO 8601 time (UTC); a NaN or an infinity as the
    string ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (printed bare, no JSON
    reader took the line, ``event pub`` neither)."""
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else jsonable(k) if isinstance(k, bytes)
                 else str(k)): jsonable(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        b = bytes(value)
        try:
            return b.decode()
        except UnicodeDecodeError:
            return base64.b64encode(b).decode()
    if isinstance(value, msgpack.Timestamp):
        try:
            return value.to_datetime().isoformat()
        except (ValueError, OverflowError, OSError):  # past year 9999, say
            return f"{value.seconds}.{value.nanoseconds:09d}"
    return value


def dumps(value: Any, pretty: bool = False) -> str:
    """``value`` (a payload) as one JSON text.  Whatever a payload may hold
    is printable: a command that prints another client's payloads (``event
    sub``) died of a msgpack timestamp, or of one nested deeper than
    Python's recursion limit -- that one is shown as a JSON string saying so."""
    try:
        return json.dumps(jsonable(value), indent=2 if pretty else None, sort_keys=pretty,
                          default=repr)
    except RecursionError:
        return json.dumps("<payload nested too deep to print as JSON>")


def json_arg(text: str) -> Any:
    """argparse ``type`` for a JSON argument (a payload): malformed JSON is a
    usage error, refused before anything is sent -- and so are what Python's
    parser takes beyond JSON (``NaN``, ``Infinity``, ``1e400``: echoed back,
    they are not JSON any more) and integers msgpack cannot carry (beyond
    64 bits: a traceback at send time)."""
    try:
        text.encode()
    except UnicodeEncodeError:  # (bytes the shell gave that are not UTF-8)
        raise argparse.ArgumentTypeError("not valid JSON: it is not UTF-8 text") from None
    try:
        value = jsontoml.loads_finite_json(text)
        msgpack.packb(value)
    except UnicodeEncodeError:  # (an escape of half a surrogate pair: "\ud800")
        raise argparse.ArgumentTypeError("not valid JSON: a \\u escape of half a "
                                         "surrogate pair is no character") from None
    except (ValueError, OverflowError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    return value


def command_args(cmdline: list[str] | None) -> list[str]:
    """A command given after the options: ``--`` before it is optional, and
    any later ``--`` is the command's own."""
    command = list(cmdline or [])
    return command[1:] if command[:1] == ["--"] else command


def add_answer_timeout(parser: argparse.ArgumentParser,
                       help_text: str = "give up when no answer came in SECONDS (exit 1; default: "
                                   "wait as long as the rank takes)") -> None:
    """``-t/--timeout SECONDS`` for a command that asks a rank and waits for
    its answer (``exec -r``, ``attr``, ``rpc``...): :func:`run_async` gives
    the whole command that long.  A request to a stopped or hung rank (or
    one behind such a rank) waits as long as the rank does, as in Flux --
    the tree keeps it until the rank answers or is disconnected -- so a
    script that must not hang needs a bound of its own."""
    parser.add_argument("-t", "--timeout", type=positive_float, dest="answer_timeout",
                        metavar="SECONDS",
                        help=help_text)


_unanswered: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "unanswered", default=None)
"""The ranks :func:`each_rank` was still waiting for when ``-t`` cut it off."""


def no_answer_detail(rank: int | list[Any] | None, timeout: float) -> str:
    """``Connection timed out (rank 3 did not answer in 0.5s)``: what a
    command given ``-t`` says when it gives up (``rank`` None: the rank
    attached to, or whichever rank the request went to; a list: those of
    several asked at once that had not answered)."""
    if isinstance(rank, list):  # (the wire's "any rank" is the attached one: no rank)
        rank = [r for r in rank if r not in (NODEID_ANY, NODEID_UPSTREAM)]
    elif rank in (NODEID_ANY, NODEID_UPSTREAM):
        rank = None
    if isinstance(rank, list) and len(rank) > 1:
        who = f"ranks {encode_ranks(rank)} did not answer"
    else:
        if isinstance(rank, list):
            rank = rank[0] if rank else None
        who = "no answer" if rank is None else f"rank {rank} did not answer"
    return f"{os.strerror(errno.ETIMEDOUT)} ({who} in {timeout:g}s: stopped or hung?)"


def stdout_is_broken() -> bool:
    """Whether standard output is a pipe (or socket) nobody reads any more.

    Python ignores SIGPIPE, so a write there raises BrokenPipeError -- as
    does a write to the broker's socket, which is a real error.  The kernel
    flags the first case itself: a pipe without readers polls POLLERR."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))


class _StdoutReaderGone:
    """Cancels ``task`` when the pipe on standard output loses its reader.

    A command that prints as things happen (``kvs get --watch``, ``event
    sub``) learned that its reader had gone (``... | head -1``) only from
    its next write, which might never come: it sat there, holding a watch
    on a rank, until the key changed again.  GNU ``tail -f`` watches for
    the same thing.  A pipe's writing end never polls readable, so a
    reader on it fires only for the error a closed pipe polls; anything
    else on standard output (a terminal, a file, a socket) is left alone.

    The pipe stays in blocking mode.  uvloop's ``add_reader`` makes the
    descriptor non-blocking, and that flag belongs to the pipe's open file,
    shared with the shell and every other writer into it: a write bigger
    than the room left in the pipe was cut short and the rest lost (a
    100 KB value printed 64 KiB), and ``head`` after the command failed
    with EAGAIN.  Watching for the error does not need it."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.fired = False
        self.fd: int | None = None
        self.blocking = True
        try:
            fd = sys.stdout.fileno()
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                self.blocking = os.get_blocking(fd)
                asyncio.get_running_loop().add_reader(fd, self._check)
                self.fd = fd
                os.set_blocking(fd, self.blocking)
        except (AttributeError, OSError, ValueError):
            pass

    def _check(self) -> None:
        if stdout_is_broken() and not self.fired:
            self.fired = True
            self.close()
            self.task.cancel()

    def close(self) -> None:
        if self.fd is not None:
            asyncio.get_running_loop().remove_reader(self.fd)
            try:
                os.set_blocking(self.fd, self.blocking)
            except OSError:
                pass
            self.fd = None


class TermCleansUp:
    """``with TermCleansUp() as term:`` around a command that writes files
    (``archive extract``, ``kvs dump``): SIGTERM -- ``timeout``'s,
    ``kvbroker exec -t``'s, a stopping ``start``'s -- stops it as Ctrl-C
    does, so that what it leaves half done is removed (a file cut short, a
    ``.part`` archive), and the process then dies of SIGTERM as it would
    have (its parent sees the same status).  By default SIGTERM ended it at
    once: a 300 MB file left at 54 MB, a dump's ``.part`` left for good.

    On a loop (:func:`run_async` with ``term=``) the handler has the loop
    cancel the command's task, in a callback, as ``asyncio.Runner`` does
    for Ctrl-C; elsewhere it raises ``KeyboardInterrupt``.  Nothing changes
    where SIGTERM is not Python's default (ignored: ``nohup``), nor outside
    the main thread."""

    def __init__(self) -> None:
        self.hit = False
        self._task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._installed = False

    def __enter__(self) -> TermCleansUp:
        import signal
        import threading

        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
            signal.signal(signal.SIGTERM, self._on_term)
            self._installed = True
        return self

    def _on_term(self, signum: int, frame: Any) -> None:
        self.hit = True
        task, loop = self._task, self._loop
        if task is not None and loop is not None and not task.done():
            loop.call_soon_threadsafe(task.cancel)  # (wakes it too)
            return
        raise KeyboardInterrupt

    async def guard(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` as the task SIGTERM cancels."""
        self._task, self._loop = asyncio.current_task(), asyncio.get_running_loop()
        try:
            return await aw
        finally:
            self._task = self._loop = None

    def __exit__(self, *exc: object) -> None:
        import signal

        if not self._installed:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.hit:  # cleaned up: now end as SIGTERM would have
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGTERM)


def run_async(args: argparse.Namespace, coro_fn: Callable[[], Awaitable[int | None]],
              *, streams: bool = False, term: TermCleansUp | None = None) -> int:
    """Run a client command on the loop the user chose (``--event-loop``),
    within ``-t/--timeout`` if the command has it (:func:`add_answer_timeout`).
    A command that ``streams`` output as things happen ends as soon as the
    pipe it prints into has no reader (``BrokenPipeError``, which the
    dispatcher turns into exit status 141, as for a write that failed).
    ``term``: SIGTERM cancels the command (:class:`TermCleansUp`)."""
    name = getattr(args, "event_loop", None) or os.environ.get("KVBROKER_EVENT_LOOP") or "auto"
    limit: float | None = getattr(args, "answer_timeout", None)

    async def main() -> int | None:
        task = asyncio.current_task()
        gone = _StdoutReaderGone(task) if streams and task is not None else None
        try:
            return await (bounded() if term is None else term.guard(bounded()))
        except asyncio.CancelledError:
            if gone is None or not gone.fired:
                raise
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE)) from None
        finally:
            if gone is not None:
                gone.close()

    async def bounded() -> int | None:
        _connecting.set([])
        if limit is None:
            return await coro_fn()
        try:
            async with asyncio.timeout(limit) as bound:
                return await coro_fn()
        except TimeoutError:
            if not bound.expired():
                raise  # (not ours)
            what = getattr(args, "what", None) or args.command
            who = _unanswered.get() or getattr(args, "rank", None)
            # (a command whose request outlives it says so: shutdown)
            raise timed_out(what, who, limit, getattr(args, "timeout_note", "")) from None

    try:
        with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
            rc = runner.run(main())
    except ErrnoError as exc:
        what = getattr(args, "what", None) or args.command
        raise CLIError(what, exc.errnum, errno_detail(exc)) from None
    return int(rc or 0)


def print_err(msg: str) -> None:
    print(f"kvbroker: {msg}", file=sys.stderr)


class _Unbuilt:
    """What :class:`LazySubParsers` hands back for a subcommand the command
    line does not run: every call on it (``add_argument``,
    ``add_subparsers``, ``set_defaults``...) does nothing and returns it
    again, so the code that builds a parser needs no change to be skipped."""

    def __getattr__(self, _name: str) -> Callable[..., _Unbuilt]:
        return self._ignore

    def _ignore(self, *_args: Any, **_kwargs: Any) -> _Unbuilt:
        return self


_UNBUILT = _Unbuilt()


class LazySubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands of which, inside :func:`building_only`, only the one the
    command line names is built.  Building ``kvbroker``'s ~60 parsers and
    ~300 options took ~50 ms of a ~180 ms ``kvbroker kvs get`` (argparse
    makes every parser and translates every help text as it goes), and the
    test suite starts such commands by the thousand.

    The subparsers of a parser ``depth`` words below ``kvbroker`` want the
    command line's ``depth``-th word that is not an option: ``get`` in
    ``kvbroker --event-loop asyncio kvs get -N ns a``.  A word that is no
    subcommand's (it was an option's value, or a typo) builds nothing, and
    :func:`building_only` then says the parser is not complete: the caller
    builds it whole, which gives the usual error listing the choices.  No
    word (``kvbroker kvs``, ``kvbroker --help``) builds them all."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wanted: str | None = None
        build = _building.get()
        if build is not None:
            depth = len(self._prog_prefix.split()) - 1
            self.wanted = build.words[depth] if depth < len(build.words) else None
            build.levels.append(self)

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if self.wanted is not None and self.wanted != name \
                and self.wanted not in kwargs.get("aliases", ()):
            return _UNBUILT
        return super().add_parser(name, **kwargs)


class _Build:
    """One :func:`building_only`: the words it wants, the levels made."""

    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.levels: list[LazySubParsers] = []

    @property
    def complete(self) -> bool:
        """Every level found the subcommand it wanted."""
        return all(lv.wanted is None or lv.wanted in lv.choices for lv in self.levels)


_building: contextvars.ContextVar[_Build | None] = contextvars.ContextVar(
    "kvbroker_building", default=None)


@contextlib.contextmanager
def building_only(words: list[str]) -> Iterator[_Build]:
    """Parsers built inside build only the subcommands ``words`` name
    (:class:`LazySubParsers`): ``words`` are the command line's words that
    are not options, the top level's first.  Check ``complete`` after."""
    build = _Build(words)
    token = _building.set(build)
    try:
        yield build
    finally:
        _building.reset(token)


class PermutingParser(argparse.ArgumentParser):
    """Options may follow or sit between a command's positionals (``kvs put
    a=1 -N job b=2``, ``rpc TOPIC '{}' --rank 1``), as getopt_long lets them
    for flux's own commands.  Plain argparse stops at the first option after
    a positional and reports the rest as unrecognized.

    A command that takes a command line (``start``, ``exec``, ``broker``:
    ``-- CMD ...``) keeps the ordinary parse, where everything after the
    first positional belongs to that command line, and so do parsers of
    subcommands themselves.  So does a command line with ``--`` (``kvs get
    -- -key``): the permuting parse would read what follows it as options."""

    _permuting = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", LazySubParsers)

    def error(self, message: str) -> NoReturn:
        """A command given without its subcommand prints the subcommands
        (``kvbroker``, ``kvbroker kvs``), as ``flux`` does, not only that one
        is required."""
        if message.startswith("the following arguments are required") and any(
                isinstance(a, argparse._SubParsersAction) for a in self._actions):
            self.print_help(sys.stderr)
            self.exit(2, f"\n{self.prog}: error: {message}\n")
        super().error(message)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if args is not None and "--color" in self._option_string_actions:
            args = _attach_color(list(args))
        if (self._permuting or (args is not None and "--" in args)
                or any(a.nargs in (argparse.REMAINDER, argparse.PARSER) for a in self._actions)):
            return super().parse_known_args(args, namespace)
        # parse_known_intermixed_args calls back here, twice: once for the
        # options with positionals set aside, once for the positionals
        self._permuting = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._permuting = False


def _attach_color(args: list[str]) -> list[str]:
    """``--color`` and ``-L`` take their optional WHEN only attached, as
    Flux's optparse does (``--color=never``, ``-Lnever``): argparse took the
    next word, so ``eventlog get --color KEY`` read KEY as WHEN, and
    ``-Lalways`` was refused.  (Up to ``--``: what follows is not options.)"""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if arg == "--color":
            arg = "--color=always"
        elif arg.startswith("-L") and len(arg) > 2:
            arg = f"--color={arg[2:]}"
        out.append(arg)
    return out


COLOR_CHOICES = ("auto", "always", "never")


def add_color_option(parser: argparse.ArgumentParser) -> None:
    """``--color[=WHEN]`` and ``-L[WHEN]``, as Flux's (see :func:`use_color`)."""
    parser.add_argument("--color", nargs="?", const="always", default="auto", metavar="WHEN",
                        choices=COLOR_CHOICES,
                        help="colorize: always (if WHEN is omitted), never, auto (the "
                        "default: on a terminal, unless NO_COLOR is set); write --color=WHEN")
    parser.add_argument("-L", dest="color", action="store_const", const="always",
                        help="same as --color=always")


def use_color(when: str) -> bool:
    """``--color WHEN``: ``always``, ``never``, or ``auto`` (standard output
    is a terminal and ``NO_COLOR`` is not set)."""
    return when == "always" or (when == "auto" and sys.stdout.isatty()
                                and not os.environ.get("NO_COLOR"))


def add_time_options(parser: argparse.ArgumentParser) -> None:
    """``-H``, ``-d`` and ``-L`` of ``dmesg`` and ``overlay trace``, as Flux's."""
    parser.add_argument("--human", "-H", action="store_true",
                        help="human-readable times, local: [Dec03 14:02] at each new "
                        "minute, then seconds since it (as flux dmesg -H)")
    parser.add_argument("--delta", "-d", action="store_true",
                        help="with --human, seconds since the line before instead")
    add_color_option(parser)
