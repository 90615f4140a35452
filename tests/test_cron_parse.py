"""Unit tests of broker.crontab (what ``kvbroker cron tab`` and ``cron at``
read) and of the ``cron`` CLI's option parsing: no instance."""

from __future__ import annotations

import datetime as dt
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.cliutil import UsageError
from broker.cron_cli import extra_options, flatten, show
from broker.cron_directory import crontab_files, read_directory
from broker.crontab import TabLine, parse_at, parse_crontab, parse_field, parse_schedule, split_line
from broker.errors import ErrnoError


def test_fields_star_ranges_lists_steps_names() -> None:
    assert parse_field("*", "hour", 0, 23) == frozenset(range(24))
    assert parse_field("*/15", "minute", 0, 59) == {0, 15, 30, 45}
    assert parse_field("1-10/3,20", "minute", 0, 59) == {1, 4, 7, 10, 20}
    assert parse_field("5/20", "minute", 0, 59) == {5, 25, 45}
    assert parse_schedule("0 0 * jan,Jul *").months == {1, 7}
    assert parse_schedule("0 0 * * mon-fri").weekdays == {1, 2, 3, 4, 5}
    assert parse_schedule("0 0 * * 7").weekdays == {0}  # (7 is Sunday too)
    assert parse_schedule("@hourly").minutes == {0} and parse_schedule("@hourly").text == "@hourly"


@pytest.mark.parametrize(("text", "why"), [
    ("* * * *", "a schedule has 5 fields"),
    ("60 * * * *", "minute field '60': 60 is out of range (0-59)"),
    ("* 5-2 * * *", "the range 5-2 goes backwards"),
    ("*/0 * * * *", "the step '0' is not a positive number"),
    ("* * * foo *", "month field 'foo': 'foo' is not a number or a name (jan"),
    ("* * 1,,2 * *", "an empty item"),
    ("0 0 30 2 *", "never comes"),
    ("@reboot", "@reboot is not supported"),
    ("@often", "unknown shortcut"),
])
def test_bad_schedules_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_schedule(text)
    assert why in str(info.value), str(info.value)


def test_next_after_jumps_to_the_next_match() -> None:
    t = dt.datetime(2030, 1, 1, 12, 7, 30)  # a Tuesday
    assert parse_schedule("*/5 * * * *").next_after(t) == dt.datetime(2030, 1, 1, 12, 10)
    assert parse_schedule("0 9 * * mon").next_after(t) == dt.datetime(2030, 1, 7, 9, 0)
    assert parse_schedule("0 0 1 * *").next_after(t) == dt.datetime(2030, 2, 1)
    assert parse_schedule("30 4 29 2 *").next_after(t) == dt.datetime(2032, 2, 29, 4, 30)
    # day-of-month and day-of-week both restricted: either one (Vixie cron's rule)
    assert parse_schedule("0 0 15 * fri").next_after(t) == dt.datetime(2030, 1, 4)
    # only one restricted: that one alone
    assert parse_schedule("0 0 15 * *").next_after(t) == dt.datetime(2030, 1, 15)
    # strictly after: the minute given does not count
    assert parse_schedule("7 12 * * *").next_after(t) == dt.datetime(2030, 1, 2, 12, 7)


@pytest.fixture
def new_york() -> Iterator[None]:
    """This process in US Eastern time (a POSIX rule: no tz database
    needed): 2024-03-10 02:00 EST is 03:00 EDT, 2024-11-03 02:00 EDT is
    01:00 EST (01:00-01:59 twice)."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "EST5EDT,M3.2.0,M11.1.0"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


def utc(*when: int) -> float:
    return dt.datetime(*when, tzinfo=dt.UTC).timestamp()


def test_next_time_across_daylight_saving_changes(new_york: None) -> None:
    every15, at0130 = parse_schedule("*/15 * * * *"), parse_schedule("30 1 * * *")
    # the hour the clock repeats: its first pass, whatever was computed before
    # (mktime's choice followed the last conversion: after 02:00 EST, 01:00
    # EST, and the entry skipped an hour)
    assert parse_schedule("0 2 * * *").next_time(utc(2024, 11, 3, 4, 50)) == utc(
        2024, 11, 3, 7)  # (00:50 EDT -> 02:00 EST)
    assert every15.next_time(utc(2024, 11, 3, 4, 50)) == utc(2024, 11, 3, 5)  # 01:00 EDT
    assert every15.next_time(utc(2024, 11, 3, 5, 50)) == utc(2024, 11, 3, 7)  # 01:50 EDT
    assert at0130.next_time(utc(2024, 11, 3, 4)) == utc(2024, 11, 3, 5, 30)  # 01:30 EDT
    # in its second pass, a minute of it has run already: once, not twice
    assert at0130.next_time(utc(2024, 11, 3, 5, 31)) == utc(2024, 11, 4, 6, 30)
    assert every15.next_time(utc(2024, 11, 3, 6, 10)) == utc(2024, 11, 3, 7)  # 01:10 EST
    assert parse_schedule("* * * * *").next_time(utc(2024, 11, 3, 6, 59)) == utc(
        2024, 11, 3, 7)  # (01:59 EST: 59 minutes passed over)
    # the hour the clock skips: a minute of it runs as the change pushes it
    assert parse_schedule("30 2 * * *").next_time(utc(2024, 3, 10, 6)) == utc(
        2024, 3, 10, 7, 30)  # (01:00 EST -> 03:30 EDT)
    assert every15.next_time(utc(2024, 3, 10, 6, 50)) == utc(2024, 3, 10, 7)  # 03:00 EDT
    assert parse_at("2024-11-03T01:30") == utc(2024, 11, 3, 5, 30)  # (its first pass too)


def test_next_time_is_in_local_time() -> None:
    now = time.mktime(dt.datetime(2030, 6, 1, 10, 0, 20).timetuple())
    assert parse_schedule("30 10 * * *").next_time(now) == now - 20 + 30 * 60


def test_split_line() -> None:
    assert split_line("  # a comment") is None and split_line("   ") is None
    assert split_line("*/5 * * * *  echo a  b") == ("*/5 * * * *", "echo a  b")
    assert split_line("@daily  run it") == ("@daily", "run it")
    with pytest.raises(ValueError, match="no command after the schedule"):
        split_line("0 0 * * *")
    with pytest.raises(ValueError, match="not a crontab line .*: 'zzz'"):
        split_line("zzz")  # (Flux's t3201 bad file: said as such, not "no command")


def test_parse_crontab_takes_a_file_whole_or_not_at_all() -> None:
    text = "# nightly\n\n30 2 * * *  ./nightly --all\n@hourly ./sweep\n"
    assert parse_crontab(text) == [TabLine(3, "30 2 * * *", "./nightly --all"),
                                   TabLine(4, "@hourly", "./sweep")]
    assert parse_crontab("# nothing yet\n") == []
    with pytest.raises(ValueError, match="^line 2: minute field '61'"):
        parse_crontab("0 0 * * * ok\n61 * * * * no\n")


def test_the_directory_s_regular_files_by_name(tmp_path: Path) -> None:
    (tmp_path / "b").write_text("0 0 * * * b\n")
    (tmp_path / "a").write_text("0 0 * * * a1\n0 1 * * * a2\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x").write_text("zzz\n")
    (tmp_path / "link").symlink_to(tmp_path / "b")  # (a link to a file is one, as Flux's)
    assert crontab_files(str(tmp_path)) == [str(tmp_path / n) for n in ("a", "b", "link")]
    assert [(d.source, d.line.command) for d in read_directory(str(tmp_path))] == [
        (f"{tmp_path}/a:1", "a1"), (f"{tmp_path}/a:2", "a2"), (f"{tmp_path}/b:1", "b"),
        (f"{tmp_path}/link:1", "b")]
    assert crontab_files(str(tmp_path / "none")) == []  # (Flux's "non-existent ... works")
    with pytest.raises(ErrnoError) as info:
        crontab_files(str(tmp_path / "a"))
    assert info.value.errnum == errno.ENOTDIR and info.value.errstr.startswith(
        f"cron.directory {tmp_path}/a: "), info.value
    (tmp_path / "c").write_bytes(b"0 0 * * * \xff\n")
    with pytest.raises(ErrnoError, match=f"could not load crontab {tmp_path}/c: not text"):
        read_directory(str(tmp_path))


def test_at_times() -> None:
    now = 1_900_000_000.0
    assert parse_at("+90s", now) == now + 90
    assert parse_at("+1.5h", now) == now + 5400
    assert parse_at("2030-01-02T03:04:05+00:00") == dt.datetime(
        2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC).timestamp()
    local = dt.datetime(2030, 1, 2, 3, 4, 5, 500000)
    assert parse_at("2030-01-02 03:04:05.5") == time.mktime(local.timetuple()) + 0.5
    for bad in ("tomorrow", "+soon", "+-1s"):
        with pytest.raises(ValueError):
            parse_at(bad, now)


def test_flux_extra_options() -> None:
    assert extra_options(["timeout=0.5,rank=1", "stop-on-failure=3"]) == {
        "timeout": 0.5, "rank": 1, "stop-on-failure": 3}
    assert extra_options(["task-history-count=5"]) == {"task-history-count": 5}
    for bad in ("badopt", "task-history-count=x", "timeout=soon", "rank=-1"):
        with pytest.raises(UsageError):
            extra_options([bad])


def test_dump_flattens_as_flux() -> None:
    entry = {"id": 1, "stopped": True, "typedata": {"topic": "t"}, "stats": {"count": 2},
             "tasks": [{"state": "Exited"}]}
    assert flatten(entry) == [("id", 1), ("stopped", True), ("typedata.topic", "t"),
                              ("stats.count", 2), ("task.1.state", "Exited")]
    assert show(True, True) == "true" and show("a\nb", True) == '"a\\nb"'
    assert show("a", False) == "a"


def test_cron_list_keeps_its_columns_with_a_long_name(capsys: pytest.CaptureFixture[str]) -> None:
    """NAME is 15 wide, as Flux's, or as the longest name: one of 19
    characters pushed STATE and the rest of its row out of line."""
    from broker.cron_cli import print_list

    entries = [{"id": 1, "name": "nonexistent-cmd-xyz", "state": "active", "repeat": 0,
                "stats": {"count": 0}, "tasks": [], "type": "interval",
                "typedata": {"interval": 1.0}},
               {"id": 2, "name": "short", "state": "stopped", "repeat": 0,
                "stats": {"count": 0}, "tasks": [], "type": "interval",
                "typedata": {"interval": 1.0}}]
    print_list(entries)
    head, *rows = capsys.readouterr().out.splitlines()
    assert [row.index(state) for row, state in zip(rows, ("active", "stopped"), strict=True)] \
        == [head.index("STATE")] * 2
