"""Eventlogs: append-only logs of events kept in one KVS value (Flux RFC 18).

An eventlog is a sequence of lines, each one compact JSON object followed by
``\\n``::

    {"timestamp":1700000000.25,"name":"submit","context":{"userid":1000}}

``timestamp`` is seconds since the epoch (a number), ``name`` a non-empty
string, ``context`` an optional JSON object.  Events are added with the KVS
``APPEND`` operation, so adding one never rewrites the log, and a watcher
(``kvbroker kvs eventlog get --watch``) receives only the new lines.

Everything here but :func:`append` and :func:`get` is pure.  :class:`Formatter`
renders entries the way ``flux kvs eventlog get`` does: ``%f`` timestamp,
name, then ``key=<json>`` per context entry; ``unformatted`` prints the RFC 18
JSON; ``human`` prints ``[MonDD HH:MM]`` at each new minute and ``[ +s.ssssss]``
offsets within it.
"""

from __future__ import annotations

import errno
import json
import math
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from broker import jsontoml
from broker.errors import ErrnoError
from broker.humantime import HumanClock

if TYPE_CHECKING:
    from kvs.client import KVS, CommitResult

__all__ = [
    "EventlogError",
    "Formatter",
    "append",
    "decode",
    "decode_entry",
    "encode",
    "encode_entry",
    "entry",
    "get",
]

Entry = dict[str, Any]

BAD = "cannot decode improperly formatted eventlog"
"""Flux's words for a log that is not one, which every message about one starts with."""


class EventlogError(ErrnoError, ValueError):
    """Malformed eventlog or entry (``EINVAL``).  A ``ValueError`` too (as
    ``json.JSONDecodeError`` is), so that one ``except`` catches a malformed
    log whether it was read (:func:`get`) or watched (``wait_event``,
    ``watch_eventlog``, which raise it as well)."""

    def __init__(self, errstr: str = BAD) -> None:
        super().__init__(errno.EINVAL, errstr)

    def __reduce__(self) -> tuple[type, tuple[str]]:  # (pickle, copy: one argument)
        return self.__class__, (self.errstr,)


def _check(e: object) -> Entry:
    if not isinstance(e, dict):
        raise EventlogError("an eventlog entry must be a JSON object")
    ts, name = e.get("timestamp"), e.get("name")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
        raise EventlogError("an eventlog entry needs a numeric timestamp")
    if not isinstance(name, str) or not name:
        raise EventlogError("an eventlog entry needs a non-empty name")
    if "context" in e and not isinstance(e["context"], dict):
        raise EventlogError("an eventlog entry's context must be a JSON object")
    return e


def entry(name: str, context: Mapping[str, Any] | str | None = None,
          timestamp: float | None = None) -> Entry:
    """A new entry; ``timestamp`` ``None`` or ``0`` means now.

    ``context`` may be a mapping or JSON text of an object.  Raises
    :class:`EventlogError` (``EINVAL``) for an empty name, a negative
    timestamp or a context that is not an object.
    """
    if timestamp is None or timestamp == 0:
        timestamp = time.time()
    if timestamp < 0:
        raise EventlogError("timestamp must not be negative")
    if isinstance(context, str):
        try:
            context = jsontoml.loads_json(context)
        except ValueError:
            raise EventlogError("context is not valid JSON") from None
        if context is None:  # ("null" is text given, not no context: as Flux refuses it)
            raise EventlogError("an eventlog entry's context must be a JSON object")
    e: Entry = {"timestamp": float(timestamp), "name": name}
    if context is not None:
        e["context"] = dict(context) if isinstance(context, Mapping) else context
    return _check(e)


def encode_entry(e: Mapping[str, Any]) -> bytes:
    """One RFC 18 line: compact JSON (``timestamp``, ``name``, ``context``) and ``\\n``."""
    e = _check(dict(e))
    ordered = {"timestamp": e["timestamp"], "name": e["name"]}
    if "context" in e:
        ordered["context"] = e["context"]
    for k, v in e.items():  # keep any extra fields, after the standard ones
        ordered.setdefault(k, v)
    try:
        text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # (Python's json writes NaN, Infinity: no RFC 18 reader takes them)
        raise EventlogError("an eventlog entry may not hold NaN or Infinity: they are not "
                            "JSON") from None
    return text.encode() + b"\n"


def encode(entries: Iterable[Mapping[str, Any]]) -> bytes:
    """A whole eventlog (``b""`` for no entries)."""
    return b"".join(encode_entry(e) for e in entries)


def decode_entry(line: str | bytes) -> Entry:
    """Parse one line (without its ``\\n``); :class:`EventlogError` if malformed.

    Strictly JSON in UTF-8, as Flux's jansson reads it, so that a read and
    a watch of the same bytes agree (the watch's parser was ``json.loads``
    of the bytes, which guesses UTF-16 or skips a byte-order mark): no
    byte-order mark, no ``NaN`` or ``Infinity`` (Python's, not JSON's; the
    writer refuses them), no lone surrogate escape (``"\\ud800"``, which
    no UTF-8 holds: printing the name was a traceback)."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes | bytearray) else line
    except UnicodeDecodeError:
        raise EventlogError("not UTF-8 text") from None
    if not text:
        raise EventlogError("an empty line")
    if text.startswith("\ufeff"):
        raise EventlogError("a byte-order mark before it (not JSON)")
    try:
        obj = jsontoml.loads_json(text, parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        raise EventlogError(f"not JSON: {exc.msg}") from None
    except ValueError as exc:  # (NaN, Infinity; too deep)
        raise EventlogError(str(exc)) from None
    if ("\\ud" in text or "\\uD" in text) and not _all_utf8(obj):
        raise EventlogError("not JSON in UTF-8: a lone surrogate escape")
    return _check(obj)


def bad_line(number: int, why: EventlogError | str) -> EventlogError:
    """The error for a log whose line ``number`` (from 1) is not an entry:
    Flux's message, then which line and why (a log of thousands of lines
    is otherwise unreadable with no clue where)."""
    reason = why.errstr if isinstance(why, EventlogError) else why
    return EventlogError(f"{BAD}: line {number}: {reason}")


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _all_utf8(value: Any) -> bool:
    """Every string in ``value`` (keys too) can be UTF-8: no lone surrogate
    (written out as JSON without escapes, any one fails to encode)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def decode(data: str | bytes, first: int = 1) -> list[Entry]:
    """Parse an eventlog: every line must be a valid entry ending in ``\\n``.

    The empty log is ``[]``; anything else malformed (no final newline, an
    empty line, bad JSON, a missing field) raises :class:`EventlogError`
    naming the first line that is not an entry (:func:`bad_line`), counted
    from ``first`` (a watch's later append: the lines before it).
    """
    if not data:
        return []
    lines: list[str | bytes] = [
        *(bytes(data).split(b"\n") if isinstance(data, bytes | bytearray) else data.split("\n"))]
    tail = lines.pop()  # (empty: the log ends in its newline)
    entries = []
    for number, line in enumerate(lines, first):
        try:
            entries.append(decode_entry(line))
        except EventlogError as exc:
            raise bad_line(number, exc) from None
    if tail:
        raise bad_line(first + len(lines), "no newline at its end")
    return entries


# ---------------------------------------------------------------- output

_GREEN, _YELLOW, _BLUE, _MAGENTA, _GRAY = (f"\x1b[{n}m" for n in (32, 33, 34, 35, 37))
_BOLD, _RED, _RESET = "\x1b[1m", "\x1b[31m", "\x1b[0m"


class Formatter:
    """Renders entries as ``flux kvs eventlog get`` does (see module docstring).

    ``human`` keeps state (the minute last printed), so use one formatter
    per output stream.
    """

    def __init__(self, *, unformatted: bool = False, human: bool = False,
                 color: bool = False) -> None:
        if unformatted and (human or color):
            raise ValueError("unformatted output cannot be human-readable or colored")
        self.unformatted = unformatted
        self.human = human
        self.color = color
        self._clock = HumanClock()

    def _c(self, code: str, text: str) -> str:
        return f"{code}{text}{_RESET}" if self.color else text

    def _timestamp(self, ts: float) -> str:
        if not self.human:
            return self._c(_GREEN, f"{ts:f}")
        text, new_minute = self._clock.stamp(ts)
        return self._c(_BOLD + _GREEN if new_minute else _GREEN, text)

    def format(self, e: Mapping[str, Any]) -> str:
        """One entry as a line of text (without the newline)."""
        e = _check(dict(e))
        if self.unformatted:
            return encode_entry(e)[:-1].decode()
        name = e["name"]
        parts = [self._timestamp(e["timestamp"]),
                 self._c(_BOLD + _RED if name == "exception" else _YELLOW, name)]
        for key, value in e.get("context", {}).items():
            text = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
            is_num = isinstance(value, int | float) and not isinstance(value, bool)
            parts.append(f"{self._c(_BLUE, key)}={self._c(_GRAY if is_num else _MAGENTA, text)}")
        return " ".join(parts)


# ---------------------------------------------------------------- KVS access


async def append(kvs: KVS, key: str, name: str,
                 context: Mapping[str, Any] | str | None = None, *,
                 timestamp: float | None = None, flags: int = 0) -> CommitResult:
    """Append one event to the eventlog at ``key`` (created if missing):
    a transaction of one :meth:`kvs.client.TxnOps.append_event`, the one
    place the line is made."""
    return await kvs.commit(kvs.txn().append_event(key, name, context, timestamp=timestamp),
                            flags)


async def get(kvs: KVS, key: str) -> list[Entry]:
    """The entries of the eventlog at ``key`` (``ENOENT`` if missing,
    :class:`EventlogError` if the value is not an eventlog)."""
    return decode(await kvs.get(key))
