"""A rank's log: lines on stderr, and the last records in memory for ``kvbroker dmesg``.

Flux keeps each broker's recent log records in a ring buffer that ``flux
dmesg`` reads, at a level of its own (``log-level``) beside the one that
reaches stderr (``log-stderr-level``): the INFO lines a rank keeps cost no
terminal clutter, and they are there to read when something went wrong,
without access to the rank's stderr (another host, journald).  Here:

* ``log.level`` (default ``warning``): what reaches stderr;
* ``log.ring-level`` (default ``info``): what the ring keeps;
* ``log.ring-size`` (default 1,024): how many records it keeps, the oldest
  dropped first.

Both levels can be changed on a running rank (``kvbroker attr set``).
Python's loggers skip a record below every handler's level before building
it, so the root logger's level is the lower of the two: a ``debug`` call
costs a level check only, as before, unless one of them asks for it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from broker.humantime import HumanClock

MAX_ENTRY_TEXT = 8192
"""Characters of a record's text the ring keeps (the rest is counted): a
record may quote what a client sent (a malformed request's topic), and the
ring must not keep 1,024 copies of a client's megabyte."""



def clip(text: str) -> str:
    """``text``, or as much of its start as fits in :data:`MAX_ENTRY_TEXT`
    characters with how many more there were: a client's line
    (``log.append``) is cut so on stderr as in the ring (which leaves
    such a text as it is)."""
    if len(text) <= MAX_ENTRY_TEXT:
        return text
    keep = MAX_ENTRY_TEXT - 64  # (room for the note)
    return f"{text[:keep]}... ({len(text) - keep} more characters)"


def _lines(text: str) -> list[str]:
    """``text``'s lines but the empty ones, at least one (maybe empty): Flux
    logs each line of a message as a record of its own and skips the empty
    ones (its stdlog drops the line breaks at the start of what follows a
    line), so a blank line made no line of ``flux dmesg`` but one of bare
    prefix here.  Trailing line breaks are dropped so too."""
    return [line for line in text.splitlines() if line] or [""]


class PrefixedFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose ``fmt`` ends with ``%(message)s``,
    and which starts every line of a record with what comes before it (the
    time, the rank, the level, the logger).

    A message with newlines (``kvbroker logger "$(cat notes)"``) or a
    traceback (``log.exception``) made bare lines on the rank's stderr,
    which said neither whose nor what they were, and which a ``grep
    'kvbroker\\[3\\]'`` or a log collector splitting on lines lost.
    (Flux writes such a message as it is; escaping the newlines instead
    would leave a traceback unreadable.)"""

    def __init__(self, fmt: str, datefmt: str | None = None) -> None:
        if not fmt.endswith("%(message)s"):
            raise ValueError("a PrefixedFormatter's format ends with %(message)s")
        super().__init__(fmt, datefmt)

    def format(self, record: logging.LogRecord) -> str:
        lines = _lines(super().format(record))  # (sets record.message, asctime)
        if len(lines) == 1:
            return lines[0]
        message, record.message = record.message, ""
        try:
            prefix = self.formatMessage(record)
        finally:
            record.message = message
        return "\n".join([lines[0], *(prefix + line for line in lines[1:])])


Entry = dict[str, Any]
"""One record as ``log.dmesg`` sends it: ``{seq, time, rank, level, name, message}``."""


class LogRing(logging.Handler):
    """The last ``size`` records at or above this handler's level.

    Records may come from any thread (a module's worker thread logs too);
    a follower (a ``kvbroker dmesg --follow`` stream) is always called on
    the event loop's thread, once per record: a record from another thread
    a loop turn later, so possibly after a newer one (not in ``seq``
    order)."""

    def __init__(self, rank: int, size: int, level: int) -> None:
        super().__init__(level)
        self.rank = rank
        self.entries: deque[Entry] = deque(maxlen=size)
        self.next_seq = 1
        self.followers: dict[Any, Callable[[Entry], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._notifying = False
        self.setFormatter(logging.Formatter("%(message)s"))  # with a traceback, if any

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve followers on ``loop`` (the rank's), from its own thread."""
        self._loop, self._loop_thread = loop, threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        """Keep ``record`` and pass it to the followers.  A failure (the
        record's arguments do not fit its format, a follower's answer
        cannot be sent) goes to :meth:`handleError`, as in every logging
        handler: the code that logged must go on."""
        try:
            self._emit(record)
        except Exception:
            self.handleError(record)

    def _emit(self, record: logging.LogRecord) -> None:
        text = self.format(record).rstrip("\r\n")  # (as on stderr: :func:`_lines`)
        if len(text) > MAX_ENTRY_TEXT:
            text = f"{text[:MAX_ENTRY_TEXT]}... ({len(text) - MAX_ENTRY_TEXT} more characters)"
        entry: Entry = {"seq": self.next_seq, "time": record.created, "rank": self.rank,
                        "level": record.levelname.lower(), "name": record.name,
                        "message": text}
        self.next_seq += 1
        self.entries.append(entry)  # (under the handler's lock: emit() is called holding it)
        if not self.followers or self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._notify(entry)
        else:
            try:
                self._loop.call_soon_threadsafe(self._notify, entry)
            except RuntimeError:
                pass  # the loop is closed: the rank is gone, and so are its followers

    def _notify(self, entry: Entry) -> None:
        if self._notifying:
            return  # a follower's failure logged: kept in the ring, not sent round again
        self._notifying = True
        try:
            for follow in list(self.followers.values()):
                follow(entry)
        finally:
            self._notifying = False

    def since(self, seq: int = 0) -> list[Entry]:
        """The records kept whose ``seq`` is above ``seq``, oldest first."""
        return [e for e in list(self.entries) if e["seq"] > seq]

    def clear(self, upto: int | None = None) -> None:
        """Forget the records kept, or only those up to ``seq`` ``upto``."""
        self.acquire()
        try:
            if upto is None:
                self.entries.clear()
            else:
                while self.entries and self.entries[0]["seq"] <= upto:
                    self.entries.popleft()
        finally:
            self.release()


class LogThrottle:
    """At most one line per ``every`` seconds for each kind of event that
    someone else decides how often happens: a client's bad input (the
    connector), a refused overlay handshake (the overlay).

    One line each let a guest flood a rank's stderr, and push every other
    record out of the ring that ``kvbroker dmesg`` reads (1,024 lines in a
    few milliseconds).  The lines held back are counted in the next one of
    their kind; the counters in the stats count every occurrence anyway."""

    def __init__(self, logger: logging.Logger, every: float = 1.0) -> None:
        self.logger = logger
        self.every = every
        self._next_at: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def log(self, level: int, kind: str, msg: str, *args: object) -> None:
        if not self.logger.isEnabledFor(level):
            return
        now = time.monotonic()
        if now < self._next_at.get(kind, 0.0):
            self._held[kind] = self._held.get(kind, 0) + 1
            return
        self._next_at[kind] = now + self.every
        held = self._held.pop(kind, 0)
        if held:
            msg += " (and %d more like it since the last such line, not logged)"
            args = (*args, held)
        self.logger.log(level, msg, *args)

    def reset(self, kind: str) -> int:
        """The trouble of ``kind`` is over (a write succeeds again): its
        next line is news, logged at once.  Returns how many lines of it
        were held back since the last one logged, for the line saying so."""
        self._next_at.pop(kind, None)
        return self._held.pop(kind, 0)


def line(entry: Entry) -> str:
    """``entry`` as a rank writes it on stderr, with the UTC time:
    ``2026-12-01T20:28:20.437Z kvbroker[0]: INFO kvbroker: message`` --
    each line of a message with several (a traceback) so prefixed, as
    :class:`PrefixedFormatter` writes them."""
    t = float(entry["time"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"
    prefix = (f"{stamp} kvbroker[{entry['rank']}]: {str(entry['level']).upper()} "
              f"{entry['name']}: ")
    return "\n".join(prefix + text for text in _lines(str(entry["message"])))


ANSI = {"time": "\033[32m", "timebreak": "\033[1m\033[32m", "name": "\033[33m",
        "error": "\033[31m", "warning": "\033[1m", "debug": "\033[34m",
        "reset": "\033[0m"}
"""``dmesg --color``: Flux's colours -- the time green (bold at a new
minute), the logger's name yellow, an error red, a warning bold, debug blue."""

class DmesgFormat:
    """``dmesg``'s lines: :func:`line`'s by default; with ``human``, as
    ``flux dmesg -H`` (:class:`~broker.humantime.HumanClock`; ``delta``:
    seconds since the record before); ``color``: with Flux's ANSI colours."""

    def __init__(self, human: bool = False, delta: bool = False,
                 color: bool = False) -> None:
        self.human = human
        self.color = color
        self._clock = HumanClock(delta)

    def paint(self, kind: str, text: str) -> str:
        """``text`` in the colour of ``kind`` (a key of :data:`ANSI`), if colouring."""
        return f"{ANSI[kind]}{text}{ANSI['reset']}" if self.color else text

    def line(self, entry: Entry) -> str:
        if not self.human and not self.color:
            return line(entry)
        stamp = self.stamp(float(entry["time"]))
        level = str(entry["level"]).lower()
        level_text = level.upper()
        if level in ("error", "critical", "warning", "debug"):
            level_text = self.paint("error" if level == "critical" else level, level_text)
        prefix = (f"{stamp} kvbroker[{entry['rank']}]: {level_text} "
                  f"{self.paint('name', str(entry['name']))}: ")
        return "\n".join(prefix + text for text in _lines(str(entry["message"])))

    def stamp(self, t: float) -> str:
        """The time ``t`` as this format prints it (``overlay trace`` too)."""
        if self.human:
            text, new_minute = self._clock.stamp(t)
            return self.paint("timebreak" if new_minute else "time", text)
        return self.paint("time", time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
                          + f".{int(t % 1 * 1000):03d}Z")


class RankLog:
    """A rank's two log handlers (stderr and the ring) and their levels."""

    def __init__(self, rank: int, level: str, ring_level: str, ring_size: int,
                 stderr_format: logging.Formatter) -> None:
        self.stderr = logging.StreamHandler(sys.stderr)
        self.stderr.setFormatter(stderr_format)
        self.ring = LogRing(rank, ring_size, logging.NOTSET)
        root = logging.getLogger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.addHandler(self.stderr)
        root.addHandler(self.ring)
        self.set_levels(level, ring_level)

    def set_levels(self, level: str | None = None, ring_level: str | None = None) -> None:
        """New ``log.level`` and/or ``log.ring-level`` (names: ``info``...)."""
        if level is not None:
            self.stderr.setLevel(level.upper())
        if ring_level is not None:
            self.ring.setLevel(ring_level.upper())
        logging.getLogger().setLevel(min(self.stderr.level, self.ring.level))
