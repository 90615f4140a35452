"""The startlog (broker/startlog.py; Flux's ``flux startlog``, t/t2805
and the startlog cases of t/t3200-instance-restart): rank 0 with a
statedir records each run's start and clean stop in its content store,
says at start when the run before did not stop cleanly, and ``kvbroker
startlog`` lists the runs (from rank 0, or a stopped statedir).

Flux's t2805 cases and what each becomes:

* works on rank 0, one run interval, shown ``running``, ``--check
  --quiet`` succeeds, works on rank 1 ->
  :func:`test_runs_a_crash_and_a_clean_stop_across_restarts` (its first
  run, and from rank 1 later) and
  :func:`test_without_a_statedir_the_current_run_only` (Flux's instance
  there has no statedir);
* ``--post-start-event``/``--post-finish-event`` into a test eventlog,
  ``--check`` after start, finish, start, start -> the same sequences
  through :func:`broker.startlog.runs` and :func:`broker.startlog.crashed`
  (rank 0 records the runs itself, as Flux's rc scripts do; there is no
  option to post by hand, and no eventlog: the runs are rows of the store,
  so a finish event of an unknown version has no counterpart);
* ``--badopt`` fails -> exit 2 (kvbroker's usage errors);
* posting on rank > 0 fails -> not applicable (nothing to post by hand).

t3200's: restarts listed, the newest ``running``; a run that did not
finish (Flux's test posts a second start by hand, here rank 0 is
SIGKILLed) makes the next start say so on stderr ("was not shut down
properly").  Beyond Flux's files: the runs survive ``content.restore``
(which replaces the store; killed part-way: tests/test_restore_atomic.py),
``--statedir`` reads a stopped instance, and
the KVS is untouched (no version, no key, no checkpoint per run).
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from test_broker_support import run_cli

from broker import startlog
from broker.content.sqlite import SqliteStore

FINISHED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - \d{4}-\d\d-\d\d \d\d:\d\d \(\d+\.\ds\)$")
CRASHED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - crashed$")
RUNNING = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - running \(\d+\.\d[smhd]\)$")
NOT_SHUT_DOWN = "the instance was not shut down properly"


def _rows(*finished: bool) -> list[startlog.Row]:
    return [(1000.0 + 10 * i, 1005.0 + 10 * i if done else None, "0.1.0")
            for i, done in enumerate(finished)]


# ---------------------------------------------------------------- the model


def test_a_finished_run_is_not_running_and_checks_clean() -> None:
    history = startlog.runs(_rows(True), live=False)
    assert history == [startlog.Run(1000.0, 1005.0, False, "0.1.0")]
    assert not startlog.crashed(history)


def test_the_newest_unfinished_run_is_running_only_when_live() -> None:
    assert startlog.runs(_rows(True, False), live=True)[-1] == startlog.Run(1010.0,
                                                                            version="0.1.0")
    assert startlog.runs(_rows(True, False), live=False)[-1].crashed


def test_a_crash_is_forgotten_once_a_later_run_finishes() -> None:
    # (Flux's t2805 sequence: start, finish, start -> clean; start -> crashed)
    assert not startlog.crashed(startlog.runs(_rows(True, False), live=True))
    history = startlog.runs(_rows(True, False, False), live=True)
    assert [r.crashed for r in history] == [False, True, False]
    assert startlog.crashed(history)
    assert not startlog.crashed(startlog.runs(_rows(False, True), live=True))
    assert startlog.crashed(startlog.runs(_rows(True, False), live=False))  # (offline)


def test_lines_show_the_span_a_crash_or_the_running_time() -> None:
    assert FINISHED.match(startlog.line(startlog.Run(1000.0, 1045.0), now=0))
    assert startlog.line(startlog.Run(1000.0, 1045.0), now=0).endswith("(45.0s)")
    assert CRASHED.match(startlog.line(startlog.Run(1000.0, crashed=True), now=0))
    running = startlog.line(startlog.Run(1000.0), now=1000.0 + 3 * 60)
    assert RUNNING.match(running) and running.endswith("(3.0m)")
    shown = startlog.line(startlog.Run(1000.0, 1001.0, version="0.1.0"), 0, show_version=True)
    assert shown.startswith(" " * 20 + "0.1.0  ")


# ---------------------------------------------------------------- real instances


async def _start(statedir: Path, script: str, *opts: str) -> tuple[int, str, str]:
    return await run_cli("start", "--size", "2", "--statedir", str(statedir), *opts,
                         "--", "sh", "-c", script, timeout=90)


async def test_runs_a_crash_and_a_clean_stop_across_restarts(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    rc, out, err = await _start(sd, "kvbroker startlog && kvbroker startlog --check --quiet"
                                    " && echo clean")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and RUNNING.match(lines[0]) and lines[1] == "clean", out
    assert NOT_SHUT_DOWN not in err

    # rank 0 killed: no clean stop recorded
    rc, _out, err = await _start(sd, "kvbroker kvs put a=1 --sync && "
                                     "kill -9 $(kvbroker attr get broker.pid); sleep 60")
    assert rc == 1 and "killed by signal 9" in err, err
    rc, out, err = await run_cli("startlog", "--statedir", str(sd), "--check")
    assert rc == 1, err  # (read from the stopped statedir: its newest run crashed)
    lines = out.splitlines()
    assert len(lines) == 2 and FINISHED.match(lines[0]) and CRASHED.match(lines[1]), out

    # the next start says so, once, and lists it
    rc, out, err = await _start(sd, "kvbroker startlog; kvbroker startlog --check -q; "
                                    "echo check=$?; kvbroker exec -r 1 kvbroker startlog -v")
    assert rc == 0, err
    assert err.count(NOT_SHUT_DOWN) == 1, err
    lines = out.splitlines()
    assert FINISHED.match(lines[0]) and CRASHED.match(lines[1]) and RUNNING.match(lines[2]), out
    assert lines[3] == "check=1"
    assert len(lines) == 7 and lines[4].split()[0] == "0.1.0", out  # (rank 1's, -v)

    # that run stopped cleanly: the crash is history, nothing is said, and
    # the KVS holds what the runs wrote, at their version: no more
    rc, out, err = await _start(sd, "kvbroker startlog --check && kvbroker kvs ls && "
                                    "kvbroker kvs version")
    assert rc == 0, (out, err)
    assert NOT_SHUT_DOWN not in err
    lines = out.splitlines()
    assert [bool(p.match(s)) for p, s in zip((FINISHED, CRASHED, FINISHED, RUNNING),
                                             lines, strict=False)] == [True] * 4, out
    assert lines[4:] == ["a", "1"]


async def test_without_a_statedir_the_current_run_only(tmp_path: Path) -> None:
    rc, out, err = await run_cli(
        "start", "--", "sh", "-c", "kvbroker startlog && kvbroker startlog --check", timeout=60)
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(RUNNING.match(s) for s in lines), out
    assert err == ""


async def test_the_runs_survive_a_restore_that_replaces_the_store(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    rc, _out, err = await _start(sd, "kvbroker kvs put x=1", "-S", "content.dump=auto")
    assert rc == 0, err
    rc, out, err = await _start(sd, "kvbroker startlog && kvbroker kvs get x",
                                "-S", "content.restore=auto")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 3 and FINISHED.match(lines[0]) and RUNNING.match(lines[1]), out
    assert lines[2] == "1"


async def test_a_statedir_that_cannot_be_read_offline_is_refused(tmp_path: Path) -> None:
    rc, _out, err = await run_cli("startlog", "--statedir", str(tmp_path / "none"))
    assert rc == 1 and f"statedir {tmp_path / 'none'}: no such directory" in err, err
    (tmp_path / "empty").mkdir()
    rc, _out, err = await run_cli("startlog", "--statedir", str(tmp_path / "empty"))
    assert rc == 1 and "it has no content.sqlite" in err, err
    assert not (tmp_path / "empty" / "content.sqlite").exists()
    sd = tmp_path / "sd"
    rc, out, err = await _start(sd, f"kvbroker startlog --statedir {sd}; echo rc=$?")
    assert rc == 0 and out == "rc=1\n", (out, err)
    assert f"statedir {sd} is in use by a running instance" in err
    # a statedir another user could have tampered with, as the other offline
    # tools refuse it (startlog read it: a review audit)
    sd.chmod(0o777)
    rc, _out, err = await run_cli("startlog", "--statedir", str(sd))
    assert rc == 1 and f"statedir {sd}: writable by group or others (mode 777)" in err, err
    sd.chmod(0o700)
    rc, _out, err = await run_cli("startlog", "--badopt")
    assert rc == 2 and "unrecognized arguments: --badopt" in err


async def test_the_crash_warning_tells_the_period_the_crashed_run_had_last(
        tmp_path: Path) -> None:
    """``attr set kvs.checkpoint-period`` during a run: a crash of it is
    told with the period it had then, not the next start's."""
    sd = tmp_path / "sd"
    script = ("kvbroker attr set kvs.checkpoint-period 0 && "
              "until kvbroker rpc content.startlog | grep -q '0.0\\]\\]'; do :; done; "
              "kill -9 $(kvbroker attr get broker.pid); sleep 60")
    rc, _out, err = await _start(sd, script)
    assert rc == 1 and "killed by signal 9" in err, err
    rc, _out, err = await _start(sd, "true")
    assert rc == 0, err
    assert "(its kvs.checkpoint-period was 0)" in err, err


def test_a_runs_table_of_the_first_version_gains_the_period(tmp_path: Path) -> None:
    path = tmp_path / "content.sqlite"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, started REAL NOT "
               "NULL, finished REAL, version TEXT NOT NULL)")
    db.execute("INSERT INTO runs (started, finished, version) VALUES (1000, 1005, '0.1.0')")
    db.commit()
    db.close()
    store = SqliteStore(str(path))
    try:
        assert store.runs() == [(1000.0, 1005.0, "0.1.0", None)]
        run = store.run_begin(2000.0, "0.1.0", 1.0)
        store.run_period(run, 0.0)
        assert store.runs()[-1] == (2000.0, None, "0.1.0", 0.0)
    finally:
        store.close()
    assert startlog.crash_warning(startlog.Run(1000.0, crashed=True)).endswith(
        "the commits since its last checkpoint may have been lost (kvbroker startlog "
        "lists the runs)")


async def test_a_crash_is_said_even_when_this_run_cannot_be_recorded(tmp_path: Path) -> None:
    """Rank 0 killed (a crash), then started again on a store that cannot
    record the new run (a full disk; here a trigger fails the row's
    INSERT as SQLite does then; found by the crash audit on a full tmpfs).
    Before, the start returned on that error before reading the runs, so
    the "not shut down properly" warning was never given, and ``startlog``
    took the crashed run for the current one (``running``; ``--check`` 0).
    Now both are said, and this run is listed as running, recorded nowhere."""
    sd = tmp_path / "sd"
    rc, out, err = await _start(sd, "kvbroker kvs put a=1 && kvbroker kvs sync && "
                                    "kill -9 $(kvbroker attr get broker.pid); sleep 60")
    assert rc == 1 and "killed by signal 9" in err, err
    db = sqlite3.connect(sd / "content.sqlite")
    db.execute("CREATE TRIGGER disk_full BEFORE INSERT ON runs "
               "BEGIN SELECT RAISE(FAIL, 'database or disk is full'); END")
    db.commit()
    db.close()
    rc, out, err = await _start(sd, "kvbroker startlog; kvbroker startlog --check -q; "
                                    "echo check=$?")
    assert rc == 0, err
    assert "this run could not be recorded in the startlog" in err, err
    assert NOT_SHUT_DOWN in err, err
    lines = out.splitlines()
    assert lines[-1] == "check=1", out
    assert CRASHED.match(lines[-3]) and RUNNING.match(lines[-2]), out
