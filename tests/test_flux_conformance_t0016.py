"""flux-core t/t0016-cron-faketime.t's checks of when a ``tab`` or ``at``
entry runs next, against the real clock.

Flux sets the clock with libfaketime (Jun 1 2016 15:30, ...) and then
checks ``typedata.next_wakeup`` of each entry it creates, then moves the
clock to that time and waits for the run.  libfaketime is not used here,
and the clock is not faked: each entry is created through a running
instance, and its next run (``cron dump --key typedata.next_wakeup``,
Flux's key, which reads kvbroker's ``typedata.next``) must be the next
matching local time computed here with plain ``datetime`` arithmetic --
not with broker.crontab -- from ``time.time()`` taken just before or just
after the creation (a minute may turn between the two: either is right).

Flux's cases, and where each is:

1. 'libfaketime works', 2. 'load cron module': no libfaketime; the
   module is loaded with the instance.
3. '15 * * * *' (at 15:30: 16:15), 4. '0 0 * * *' (the next midnight),
   5. '0 0 * * Mon' (the next Monday midnight), 6. '0 0 30 * *' (the next
   30th), 7. '0 0 30 Dec *' (Dec 30) -> :func:`test_tab_entries_next_run`,
   with ``type`` (``tab`` here, Flux's ``datetime``) and ``stopped``
   false as Flux checks them, and ``next`` in ``cron.create``'s answer.
   Flux then moves the clock to that time and sees the run; here the
   runs themselves are t0015's (an ``at`` entry and intervals run
   there), and the schedule's steps are tests/test_cron_parse.py's.
8. 'flux-cron at works', 9. 'relative flux-cron at works' ->
   :func:`test_at_entries_next_run`: an ISO 8601 time (Flux's takes any
   ``date`` string) and ``+5m`` (Flux's ``+1 hour``).
10. 'remove cron module' -> the end of :func:`test_at_entries_next_run`:
   removed, no entry is left to run.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import re
import time
from collections.abc import Callable

from test_broker_support import run_cli

T = 20.0
MODULES = {"broker.modules": "content,kvs,kvs-watch,cron"}
Next = Callable[[dt.datetime], dt.datetime]


def at_minute_15(now: dt.datetime) -> dt.datetime:
    """``15 * * * *``: the next hh:15."""
    found = now.replace(minute=15, second=0, microsecond=0)
    return found if found > now else found + dt.timedelta(hours=1)


def midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time())


def next_midnight(now: dt.datetime) -> dt.datetime:
    """``0 0 * * *``."""
    return midnight(now.date() + dt.timedelta(days=1))


def next_monday(now: dt.datetime) -> dt.datetime:
    """``0 0 * * Mon``."""
    found = midnight(now.date() + dt.timedelta(days=-now.weekday() % 7))
    return found if found > now else found + dt.timedelta(days=7)


def next_30th(now: dt.datetime) -> dt.datetime:
    """``0 0 30 * *``: the next month that has a 30th (February has none)."""
    year, month = now.year, now.month
    while True:
        if month != 2 and midnight(dt.date(year, month, 30)) > now:
            return midnight(dt.date(year, month, 30))
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)


def next_dec_30(now: dt.datetime) -> dt.datetime:
    """``0 0 30 Dec *``."""
    found = midnight(dt.date(now.year, 12, 30))
    return found if found > now else midnight(dt.date(now.year + 1, 12, 30))


SCHEDULES: list[tuple[str, Next]] = [
    ("15 * * * *", at_minute_15), ("0 0 * * *", next_midnight),
    ("0 0 * * Mon", next_monday), ("0 0 30 * *", next_30th), ("0 0 30 Dec *", next_dec_30)]


def local(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t)


async def key(uri: str, eid: int, name: str) -> str:
    rc, out, err = await run_cli("cron", "dump", "--key", name, str(eid), uri=uri, timeout=T)
    assert rc == 0, (name, err)
    return out.rstrip("\n")


def test_the_expected_times_are_right() -> None:
    """The arithmetic above, on t0016's own dates (Wednesday Jun 1 2016
    15:30, Saturday Jun 4 and Sunday Jun 5 15:45)."""
    jun1, jun4, jun5 = (dt.datetime(2016, 6, 1, 15, 30), dt.datetime(2016, 6, 4, 15, 45),
                        dt.datetime(2016, 6, 5, 15, 45))
    assert at_minute_15(jun1) == dt.datetime(2016, 6, 1, 16, 15)
    assert at_minute_15(dt.datetime(2016, 6, 1, 15, 14, 59)) == dt.datetime(2016, 6, 1, 15, 15)
    assert at_minute_15(dt.datetime(2016, 6, 1, 15, 15)) == dt.datetime(2016, 6, 1, 16, 15)
    assert next_midnight(jun1) == dt.datetime(2016, 6, 2)
    assert next_monday(jun4) == dt.datetime(2016, 6, 6)
    assert next_monday(dt.datetime(2016, 6, 6, 0, 0, 1)) == dt.datetime(2016, 6, 13)
    assert next_30th(jun5) == dt.datetime(2016, 6, 30)
    assert next_30th(dt.datetime(2016, 1, 30, 1)) == dt.datetime(2016, 3, 30)
    assert next_dec_30(jun5) == dt.datetime(2016, 12, 30)
    assert next_dec_30(dt.datetime(2016, 12, 30, 0, 1)) == dt.datetime(2017, 12, 30)


async def test_tab_entries_next_run(start_instance, connect) -> None:
    """Flux 3-7."""
    inst = await start_instance(size=1, attrs=MODULES)
    uri, h = inst.uri(0), await connect(inst, 0)
    lines = "".join(f"{sched} kvbroker event pub t.cron.complete\n" for sched, _ in SCHEDULES)
    before = time.time()
    rc, out, err = await run_cli("cron", "tab", uri=uri, input=lines.encode(), timeout=T)
    after = time.time()
    assert rc == 0, err
    ids = [int(n) for n in re.findall(r"^tab: cron-(\d+) created$", out, re.M)]
    assert len(ids) == len(SCHEDULES), out
    wakeups = await asyncio.gather(*(key(uri, eid, "typedata.next_wakeup") for eid in ids))
    entries = {e["id"]: e for e in (await h.rpc("cron.list", {}))["entries"]}
    for eid, wakeup, (sched, expected) in zip(ids, wakeups, SCHEDULES, strict=True):
        e = entries[eid]
        assert (e["type"], e["stopped"], e["typedata"]["schedule"]) == ("tab", False, sched)
        assert float(wakeup) == e["typedata"]["next"]  # (kvbroker's own name)
        wanted = {expected(local(before)).timestamp(), expected(local(after)).timestamp()}
        assert float(wakeup) in wanted, (sched, local(float(wakeup)), local(before))
    # the answer that creates an entry says it already (Flux's cron tab prints it)
    before = time.time()
    answer = await h.rpc("cron.create", {"type": "tab", "command": "true",
                                         "args": {"schedule": "0 0 * * Mon"}})
    after = time.time()
    assert answer["typedata"]["next"] in {next_monday(local(before)).timestamp(),
                                          next_monday(local(after)).timestamp()}, answer


async def test_at_entries_next_run(start_instance, connect) -> None:
    """Flux 8-10."""
    inst = await start_instance(size=1, attrs=MODULES)
    uri, h = inst.uri(0), await connect(inst, 0)
    when = (local(time.time()) + dt.timedelta(days=1)).replace(microsecond=0)
    absolute = await run_cli("cron", "at", when.isoformat(), "kvbroker", "event", "pub",
                             "t.cron.complete", uri=uri, timeout=T)
    before = time.time()
    relative = await run_cli("cron", "at", "+5m", "kvbroker", "event", "pub",
                             "t.cron.complete", uri=uri, timeout=T)
    after = time.time()
    eids = []
    for rc, out, err in (absolute, relative):
        m = re.fullmatch(r"at: cron-(\d+) created\n", out)
        assert rc == 0 and m is not None, (out, err)
        eids.append(int(m.group(1)))
    wakeups = [float(w) for w in await asyncio.gather(
        *(key(uri, eid, "typedata.next_wakeup") for eid in eids))]
    entries = {e["id"]: e for e in (await h.rpc("cron.list", {}))["entries"]}
    for eid in eids:
        e = entries[eid]
        assert (e["type"], e["stopped"], e["repeat"]) == ("at", False, 1), e
    assert wakeups[0] == entries[eids[0]]["typedata"]["at"] == when.timestamp()
    assert before + 300 <= wakeups[1] <= after + 300, (wakeups[1] - before, after - before)

    rc, out, err = await run_cli("module", "remove", "cron", uri=uri, timeout=T)
    assert rc == 0, err
    modules = (await h.rpc("module.list", {}))["modules"]
    assert "cron" not in [m["name"] for m in modules]
