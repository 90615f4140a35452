"""What ``kvbroker cron tab`` and ``cron at`` read: crontab schedules and
points in time (docs/cli.md "cron").  Pure functions, shared by the
``cron`` module (:mod:`broker.cron`), which checks every request itself,
and the command line, which refuses a bad line before anything is sent.

A schedule is the five fields of crontab(5), in the local time of the
rank that runs it::

    minute 0-59   hour 0-23   day-of-month 1-31   month 1-12 (jan-dec)
    day-of-week 0-7 (sun-sat; 0 and 7 are Sunday)

each ``*``, a number, a range ``a-b``, a list ``a,b-c``, any of them
with a step (``*/15``, ``1-30/5``, ``5/10`` for ``5-max/10``), names in
any case for months and days (``mon-fri``, ``jan,jul``).  As Vixie cron's:
when day-of-month and day-of-week are both restricted (neither starts
with ``*``), a day matching either runs.  The shortcuts ``@yearly``
(``@annually``), ``@monthly``, ``@weekly``, ``@daily`` (``@midnight``)
and ``@hourly`` stand for their five fields; ``@reboot`` is refused (a
rank's cron starts with the module, not the host).

Flux's ``flux cron tab`` counts months 0-11 and days 0-6 (its ``struct
tm``'s); these are crontab(5)'s, which a crontab line copied from a host
already uses.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from dataclasses import dataclass

from broker.attrs import duration

FIELDS = (("minute", 0, 59), ("hour", 0, 23), ("day-of-month", 1, 31), ("month", 1, 12),
          ("day-of-week", 0, 7))
"""The five fields of a crontab line: name, lowest, highest value."""
MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov",
               "dec")
DAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
SHORTCUTS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
             "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
             "@hourly": "0 * * * *"}
SEARCH_YEARS = 8
"""How far :meth:`Schedule.next_after` looks: a schedule that matches
once in that long (Feb 29 on a Monday: every 28 years at worst, but Feb
29 alone every 4 or 8) is found; one that never matches (Feb 30) is
refused when parsed."""
MAX_REPEATED_MINUTES = 3 * 60
"""The most minutes a daylight-saving change repeats, with room to spare
(an hour in most zones, two in a few): :meth:`Schedule.next_time` passes
over that many matches that came already at most."""


@dataclass(frozen=True)
class Schedule:
    """A parsed crontab schedule: the values each field allows."""

    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]
    """0-6, Sunday 0 (a 7 given is read as 0)."""
    days_restricted: bool
    weekdays_restricted: bool
    text: str
    """The five fields as given (a shortcut: as written, ``@daily``)."""

    def day_matches(self, day: dt.date) -> bool:
        """Whether ``day`` is a day to run (month checked apart)."""
        in_days = day.day in self.days
        in_weekdays = (day.isoweekday() % 7) in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return in_days or in_weekdays
        return in_days and in_weekdays

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        """The first minute strictly after ``after`` (naive local time)
        that the schedule matches, or None if none within
        :data:`SEARCH_YEARS`.  Jumps a month, a day, an hour at a time
        where they do not match: a few thousand steps at worst."""
        t = after.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)
        end = after + dt.timedelta(days=366 * SEARCH_YEARS)
        while t <= end:
            if t.month not in self.months:
                year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
                t = dt.datetime(year, month, 1)
            elif not self.day_matches(t.date()):
                t = dt.datetime(t.year, t.month, t.day) + dt.timedelta(days=1)
            elif t.hour not in self.hours:
                t = t.replace(minute=0) + dt.timedelta(hours=1)
            elif t.minute not in self.minutes:
                t += dt.timedelta(minutes=1)
            else:
                return t
        return None

    def next_time(self, now: float) -> float | None:
        """:meth:`next_after` for a time in seconds since the epoch, in
        this process's local time zone; as such a time too.

        Across a daylight-saving change: a minute the clock skips (02:30
        when it jumps from 02:00 to 03:00) runs as the change pushes it,
        at 03:30; a minute it repeats (01:30 when it goes back from 02:00
        to 01:00) runs once, at its first pass, and the second pass is
        passed over -- also for an entry made during it.  Each local
        minute is turned into a time with the zone's offset on each side
        of the change (``fold``, PEP 495), not by ``mktime``, whose choice
        for a repeated minute followed the last time the process had
        converted: the same entry ran at 01:00 or at 01:00 an hour later
        depending on what the rank had computed before it."""
        after = dt.datetime.fromtimestamp(now).replace(fold=0)
        for _ in range(MAX_REPEATED_MINUTES + 1):
            found = self.next_after(after)
            if found is None:
                return None
            when = found.replace(fold=0).timestamp()  # (a repeated minute's first pass)
            if when > now:
                return when
            after = found  # (its first pass is over: now is in the second)
        return None


def _number(text: str, names: tuple[str, ...], low: int, what: str) -> int:
    """One value of a field: digits, or a name (``names[i]`` is ``low + i``)."""
    lowered = text.lower()
    if lowered in names:
        return names.index(lowered) + low
    if not (text.isascii() and text.isdigit()):
        known = f" or a name ({', '.join(names)})" if names else ""
        raise ValueError(f"{what}: {text!r} is not a number{known}")
    return int(text)


def parse_field(text: str, name: str, low: int, high: int,
                names: tuple[str, ...] = ()) -> frozenset[int]:
    """One crontab field: the set of values it allows.  ``ValueError``
    says which field was wrong and why."""
    what = f"{name} field {text!r}"
    out: set[int] = set()
    for item in text.split(","):
        body, slash, step_text = item.partition("/")
        step = 1
        if slash:
            if not (step_text.isascii() and step_text.isdigit()) or int(step_text) == 0:
                raise ValueError(f"{what}: the step {step_text!r} is not a positive number")
            step = int(step_text)
        if body == "*":
            first, last = low, high
        elif "-" in body:
            a, _, b = body.partition("-")
            first = _number(a, names, low, what)
            last = _number(b, names, low, what)
        elif body:
            first = _number(body, names, low, what)
            last = high if slash else first
        else:
            raise ValueError(f"{what}: an empty item (a list is a,b-c)")
        for v in (first, last):
            if not low <= v <= high:
                raise ValueError(f"{what}: {v} is out of range ({low}-{high})")
        if first > last:
            raise ValueError(f"{what}: the range {first}-{last} goes backwards")
        out.update(range(first, last + 1, step))
    return frozenset(out)


def parse_schedule(text: str) -> Schedule:
    """The five fields of a crontab schedule (or a shortcut such as
    ``@daily``), checked: ``ValueError`` says what was wrong, also for a
    schedule that never comes (``0 0 30 2 *``)."""
    words = text.split()
    if len(words) == 1 and words[0].startswith("@"):
        if words[0].lower() == "@reboot":
            raise ValueError("@reboot is not supported: a rank's cron starts with the module "
                             "(start the command with kvbroker start, or exec --bg)")
        if words[0].lower() not in SHORTCUTS:
            raise ValueError(f"unknown shortcut {words[0]!r} (one of "
                             f"{', '.join(SHORTCUTS)})")
        sched = parse_schedule(SHORTCUTS[words[0].lower()])
        return Schedule(**{**sched.__dict__, "text": words[0]})
    if len(words) != 5:
        raise ValueError(f"a schedule has 5 fields (minute hour day-of-month month "
                         f"day-of-week), not {len(words)}: {text!r}")
    values = []
    for word, (name, low, high) in zip(words, FIELDS, strict=True):
        names = MONTH_NAMES if name == "month" else DAY_NAMES if name == "day-of-week" else ()
        values.append(parse_field(word, name, low, high, names))
    weekdays = frozenset(d % 7 for d in values[4])
    sched = Schedule(values[0], values[1], values[2], values[3], weekdays,
                     not words[2].startswith("*"), not words[4].startswith("*"),
                     " ".join(words))
    if sched.next_after(dt.datetime(2000, 1, 1)) is None:
        raise ValueError(f"the schedule {text!r} never comes (no such day)")
    return sched


def split_line(line: str) -> tuple[str, str] | None:
    """A crontab line as (schedule, command); None for a blank line or a
    comment (``#``).  ``ValueError`` for a line without a command."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    words = stripped.split(None, 1 if stripped.startswith("@") else 5)
    count = 1 if stripped.startswith("@") else 5
    if len(words) < count:
        raise ValueError(f"not a crontab line (minute hour day-of-month month day-of-week "
                         f"command): {stripped!r}")
    if len(words) == count or not words[count].strip():
        raise ValueError(f"no command after the schedule: {stripped!r}")
    return " ".join(words[:count]), words[count].strip()


@dataclass(frozen=True)
class TabLine:
    """One entry of a crontab: where it is, its schedule and its command."""

    number: int
    """Its line number in the text (from 1)."""
    schedule: str
    command: str


def parse_crontab(text: str) -> list[TabLine]:
    """The entries of a crontab's text (``cron tab``'s input, a file of
    ``cron.directory``), each schedule checked; blank lines and ``#``
    comments passed over.  ``ValueError`` ``line N: why`` for the first
    bad line: a crontab is taken whole or not at all."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            found = split_line(line)
            if found is not None:
                parse_schedule(found[0])
                out.append(TabLine(number, *found))
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return out


LAST_AT = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC).timestamp()
"""The last time ``cron at`` takes: ``+99999999999999999999`` was taken, and
every ``cron list`` after failed on it ("timestamp out of range")."""


def parse_at(text: str, now: float | None = None) -> float:
    """When ``cron at TIME`` runs, in seconds since the epoch: ``+FSD``
    (``+90s``, ``+1.5h``: that long from ``now``), or an ISO 8601 date
    and time (``2030-01-02T03:04``, ``2030-01-02 03:04:05+01:00``; with
    no offset it is local time).  ``ValueError`` otherwise."""
    now = time.time() if now is None else now
    stripped = text.strip()
    if stripped.startswith("+"):
        at = now + duration(stripped[1:])
    else:
        try:
            when = dt.datetime.fromisoformat(stripped)
        except ValueError:
            raise ValueError(f"{text!r} is not a time: +DURATION (+10m, +1.5h) or an ISO 8601 "
                             "date and time (2030-01-02T03:04, with an offset or in local "
                             "time)") from None
        try:
            at = when.timestamp()  # (naive: local time; a repeated minute's first pass)
        except (OverflowError, ValueError):  # (0001-01-01 in local time: "year 0 ...")
            at = -math.inf
    if not LAST_AT >= at > -math.inf:
        raise ValueError(f"{text!r} is not a time this host can tell (at most the end of "
                         "9999)")
    return at
