"""flux-core t/t3200-instance-restart, as kvbroker has it: one instance
with a statedir (``kvbroker start --statedir DIR``, Flux's ``-S
statedir=DIR``) started again and again, what it wrote kept, its runs
listed by ``kvbroker startlog``, and a run that did not stop cleanly
reported by the next start.

tests/test_startlog.py holds the basics (one run listed; a SIGKILLed rank
0 listed ``crashed`` and reported once by the next start; ``--check``;
``startlog`` from rank 1 and ``-v``; the runs surviving
``content.restore``; ``--statedir`` refusals).  This file goes further,
as a user restarting an instance many times would.

Flux's cases, in order, and what each becomes here:

1. *run a job in persistent instance*, 2-3. *restart instance and run
   another job* (twice): kvbroker has no jobs (out of scope); a run's
   trace is what it writes to the KVS: an event appended to an eventlog
   (``kvs eventlog append admin.log runN``, Flux's job eventlogs) and a key
   ``run.N``, and the ``kvs version`` before and after ->
   :func:`test_t3200_five_runs_keep_all_they_wrote_and_versions_ascend`
   (runs 1-4, each started differently: Flux's ``--setattr=statedir=.``
   in the statedir, ``kvs.checkpoint-period=0``, size
   2 writing through rank 1, ``log-stderr-level=6``, ``content.dump``).
4. *restart instance and list inactive jobs*, 5. *inactive job list
   contains all jobs run before* -> the same test, run 5: every key and
   every event of runs 1-4 is there, in order, none twice; a watcher
   started then (``kvs get --watch``, ``kvs eventlog get --watch``) sees
   the restored state first, then the new writes, nothing repeated.
6. *job IDs were issued in ascending order* -> ``kvs version``: each run
   starts at the version the run before stopped at (never lower after a
   clean stop, even with ``kvs.checkpoint-period=0``) and the event
   timestamps ascend across runs.  Run 5 restores a dump (Flux's
   ``content.dump``/``content.restore`` across a restart): the store then
   starts again at version 0, documented (docs/kvs.md, Garbage collection
   across a restart, as Flux), with every key and event kept.
7. *restart instance and capture startlog*, 8. *startlog shows 5 run
   periods*, 9. *most recent period is still running* -> the same test:
   run 5 lists 5 runs, the newest ``running``; afterwards ``startlog
   --statedir`` on the stopped instance lists the same runs, all finished,
   in order, and ``--check`` is clean.
10. *doctor startlog to look like a crash* (Flux posts a second start
    event by hand): there is nothing to post by hand here (docs/cli.md,
    startlog); real crashes instead: rank 0 SIGKILLed with
    ``kvs.checkpoint-period=0``
    (:func:`test_t3200_a_crash_with_period_0_keeps_the_synced_commits_only`),
    and rank 0 hung in its stop and killed by ``start``
    (:func:`test_t3200_killed_in_its_stop_then_recovery_then_a_clean_run`).
11. *run flux and capture logs on stderr* (``log-stderr-level=6``), 12.
    *improper shutdown was logged* -> both tests: the WARNING "the
    instance was not shut down properly", once, beside the INFO line
    naming the checkpoint restored; after a crash of a run with
    ``kvs.checkpoint-period=0`` it must say that everything since the last
    ``--sync`` commit may be lost, not "the last 1 s"
    (:func:`test_t3200_the_crash_warning_names_the_crashed_runs_period`;
    until 2026-12-05 it told the next start's period).
13-15. *the same with content-files*: kvbroker has one backend, SQLite
    (``DIR/content.sqlite``); Flux's ``-S
    content.backing-module=content-files`` must then be refused saying so,
    as kvbroker refuses Flux's other attributes for what it does not build
    (broker/attrs.py ``FLUX_NOT_BUILT``), not with "did you mean
    content.backlog-bytes?" ->
    :func:`test_t3200_flux_backing_module_is_refused_saying_the_store_is_sqlite`
    (fixed 2026-12-05; ``content-sqlite``, Flux's default, is taken and
    ignored).

Beyond Flux's file: an instance restarted over a thousand times lists
its newest 1,000 runs (docs/cli.md, startlog), oldest first, and a
crash among them is still reported
(:func:`test_t3200_a_long_lived_statedir_lists_its_newest_runs_in_order`;
the earlier runs are written into the store as rank 0 writes them, through
:class:`broker.content.sqlite.SqliteStore`, rather than started 1,000
times); a second ``start`` on the statedir while the first
runs is refused and leaves no phantom run, and a rank other than 0 killed
is no crash of the instance (its state is rank 0's: docs/kvs.md)
(:func:`test_t3200_a_refused_second_start_and_a_lost_rank_1_are_no_crash`);
``start --recovery DIR`` on a statedir whose last run
crashed (Flux's recovery mode, where rc1 checks the startlog too): it says
so, shows the synced commits, keeps a repair, and its clean stop makes the
next start silent.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from test_broker_support import run_cli

from broker.content.sqlite import RUNS_KEPT, SqliteStore

FINISHED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - \d{4}-\d\d-\d\d \d\d:\d\d \(\d+\.\d[smhd]\)$")
CRASHED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - crashed$")
RUNNING = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - running \(\d+\.\d[smhd]\)$")
NOT_SHUT_DOWN = "the instance was not shut down properly"
SINCE_SYNC = "the commits since its last SYNC commit may have been lost"


async def _start(statedir: Path | None, script: str, *opts: str, size: int = 1,
                 cwd: Path | None = None) -> tuple[int, str, str]:
    where = ("--statedir", str(statedir)) if statedir is not None else ()
    return await run_cli("start", "--size", str(size), *where, *opts, "--", "sh", "-c",
                         script, timeout=90, cwd=cwd)


def _values(out: str) -> dict[str, str]:
    """The ``name=value`` lines a script echoed."""
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line
                and not line.startswith("{"))


def _started(line: str) -> str:
    return line[:16]  # (YYYY-mm-dd HH:MM: sorts as it ascends)


async def test_t3200_five_runs_keep_all_they_wrote_and_versions_ascend(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    versions: list[tuple[int, int]] = []
    sd.mkdir()
    starts = {  # run -> (start options, size, how it writes its key)
        1: (("--setattr=statedir=.",), 1, "kvbroker kvs put run.1=1"),  # (Flux's form)
        2: (("-S", "kvs.checkpoint-period=0"), 1, "kvbroker kvs put run.2=2"),
        3: ((), 2, "kvbroker exec -r 1 kvbroker kvs put run.3=3"),
        4: (("-S", "log-stderr-level=6", "-S", "content.dump=auto"), 1,
            "kvbroker kvs put run.4=4"),
    }
    for run, (opts, size, put) in starts.items():
        rc, out, err = await _start(  # (run 1: the statedir given as -S, relative)
            None if run == 1 else sd, f"echo first=$(kvbroker kvs version) && "
                f"kvbroker kvs eventlog append admin.log run{run} '{{\"run\": {run}}}' && "
                f"{put} && echo last=$(kvbroker kvs version) && "
                "kvbroker startlog --check --quiet && echo clean=yes", *opts, size=size, cwd=sd)
        assert rc == 0, (run, out, err)
        assert NOT_SHUT_DOWN not in err, (run, err)
        got = _values(out)
        assert got["clean"] == "yes", (run, out)
        versions.append((int(got["first"]), int(got["last"])))
        if run == 4:  # (Flux's log-stderr-level=6: the checkpoint restored, at INFO)
            assert (f"restored the primary namespace from checkpoint rootseq "
                    f"{versions[2][1]} ") in err, err
    # each run resumes where the one before stopped, and only goes up
    assert versions[0][0] == 0
    for (_first, last), (nxt, _) in zip(versions, versions[1:], strict=False):
        assert nxt == last, versions
    assert all(last > first for first, last in versions), versions
    assert (sd / "dump" / "RESTORE").is_symlink()

    # run 5: the dump restored (version 0 again: documented), all kept;
    # watchers started now see the restored state, then what comes
    rc, out, err = await _start(
        sd, "kvbroker startlog && echo version=$(kvbroker kvs version) && "
            "kvbroker kvs get run.1 run.2 run.3 run.4 && "
            "{ kvbroker kvs get --watch -c 2 run.4 >w & "
            "kvbroker kvs eventlog get -u --watch -c 5 admin.log >e & } && "
            "until [ -s w ] && [ \"$(wc -l <e)\" -ge 4 ]; do sleep 0.05; done && "
            "kvbroker kvs put run.4=again && "
            "kvbroker kvs eventlog append admin.log run5 '{\"run\": 5}' && wait && "
            "cat w e && echo after=$(kvbroker kvs version)",
        "-S", "content.restore=auto", cwd=tmp_path)
    assert rc == 0, (out, err)
    assert NOT_SHUT_DOWN not in err
    lines = out.splitlines()
    listed = lines[:5]
    assert all(FINISHED.match(s) for s in listed[:4]) and RUNNING.match(listed[4]), out
    assert lines[5] == "version=0"
    assert lines[6:10] == ["1", "2", "3", "4"], out
    assert lines[10:12] == ["4", "again"], out  # (the watcher: restored value, then the new)
    events = [json.loads(s) for s in lines[12:17]]
    assert [e["name"] for e in events] == ["run1", "run2", "run3", "run4", "run5"], out
    assert [e["context"] for e in events] == [{"run": n} for n in range(1, 6)]
    stamps = [e["timestamp"] for e in events]
    assert stamps == sorted(stamps) and len(set(stamps)) == 5, stamps
    assert lines[17] == "after=2" and len(lines) == 18, out
    assert not (sd / "dump" / "RESTORE").exists() and list((sd / "dump").glob("*.tgz"))

    # the stopped instance: the same five runs, in order, all finished
    rc, offline, err = await run_cli("startlog", "--statedir", str(sd), "--check")
    assert rc == 0, err
    off = offline.splitlines()
    assert len(off) == 5 and all(FINISHED.match(s) for s in off), offline
    assert off[:4] == listed[:4]
    assert _started(off[4]) == _started(listed[4])
    assert [_started(s) for s in off] == sorted(_started(s) for s in off)
    rc, shown, err = await run_cli("startlog", "--statedir", str(sd), "-v")
    assert rc == 0 and [s[25:] for s in shown.splitlines()] == ["  " + s for s in off], shown


async def _crash_with_period_0(sd: Path) -> None:
    """A run with ``kvs.checkpoint-period=0``: ``a`` written ``--sync``,
    then ``b`` and ``c`` acknowledged without, then rank 0 SIGKILLed."""
    rc, out, err = await _start(
        sd, "kvbroker kvs put a=1 --sync && kvbroker kvs put b=2 && kvbroker kvs put c=3 && "
            "echo version=$(kvbroker kvs version) && "
            "kill -9 $(kvbroker attr get broker.pid); sleep 60",
        "-S", "kvs.checkpoint-period=0")
    assert rc == 1 and "killed by signal 9" in err, (out, err)
    assert out == "version=3\n"


async def test_t3200_a_crash_with_period_0_keeps_the_synced_commits_only(
        tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    await _crash_with_period_0(sd)
    rc, out, err = await _start(
        sd, "kvbroker kvs get a; kvbroker kvs get b c; echo get=$?; "
            "echo version=$(kvbroker kvs version); kvbroker startlog; "
            "kvbroker startlog --check --quiet; echo check=$?; "
            "kvbroker kvs put d=4 && echo next=$(kvbroker kvs version)",
        "-S", "kvs.checkpoint-period=0", "-S", "log-stderr-level=6")
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == "1" and lines[1] == "get=1", out  # (b, c: lost, as documented)
    assert lines[2] == "version=1"  # (back to the synced commit)
    assert CRASHED.match(lines[3]) and RUNNING.match(lines[4]), out
    assert lines[5:] == ["check=1", "next=2"], out
    assert "b: No such file or directory" in err
    assert "restored the primary namespace from checkpoint rootseq 1 " in err
    assert err.count(NOT_SHUT_DOWN) == 1 and SINCE_SYNC in err, err


async def test_t3200_the_crash_warning_names_the_crashed_runs_period(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    await _crash_with_period_0(sd)
    rc, out, err = await _start(sd, "kvbroker kvs get a; kvbroker kvs get b; echo get=$?")
    assert rc == 0 and out == "1\nget=1\n", (out, err)  # (b lost, though < 1 s old)
    assert err.count(NOT_SHUT_DOWN) == 1, err
    assert SINCE_SYNC in err and "about its last 1 s" not in err, err


async def test_t3200_killed_in_its_stop_then_recovery_then_a_clean_run(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    # rank 0 stopped (SIGSTOP) as the command ends: its SIGTERM waits,
    # and start kills it a second later, before any final checkpoint
    rc, out, err = await _start(
        sd, "kvbroker kvs put a=1 --sync && kvbroker kvs put b=2 --sync && "
            "kill -STOP $(kvbroker attr get broker.pid)",
        "--rank-stop-timeout", "1", size=2)
    assert rc == 1, (out, err)
    assert "rank 0 did not exit within 1 s of SIGTERM, so it was killed" in err, err
    rc, out, err = await run_cli("startlog", "--statedir", str(sd), "--check")
    assert rc == 1 and CRASHED.match(out.strip()), (out, err)

    # Flux's recovery mode on it: told, the synced commits there, a repair kept
    rc, out, err = await run_cli(
        "start", "--recovery", str(sd), "--", "sh", "-c",
        "kvbroker attr get broker.recovery-mode && kvbroker kvs get a b && "
        "kvbroker startlog && kvbroker kvs put fixed=1 && kvbroker kvs version", timeout=90)
    assert rc == 0, (out, err)
    assert err.count(NOT_SHUT_DOWN) == 1, err
    lines = out.splitlines()
    assert lines[:3] == ["1", "1", "2"], out
    assert CRASHED.match(lines[3]) and RUNNING.match(lines[4]) and lines[5:] == ["3"], out

    # the recovery stopped cleanly: the next start is silent, lists all three
    rc, out, err = await _start(
        sd, "kvbroker startlog && kvbroker startlog --check -q && kvbroker kvs get fixed && "
            "kvbroker kvs version", size=2)
    assert rc == 0, (out, err)
    assert NOT_SHUT_DOWN not in err, err
    lines = out.splitlines()
    assert CRASHED.match(lines[0]) and FINISHED.match(lines[1]) and RUNNING.match(lines[2]), out
    assert lines[3:] == ["1", "3"], out


async def test_t3200_a_refused_second_start_and_a_lost_rank_1_are_no_crash(
        tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    rc, out, err = await _start(
        sd, f"kvbroker kvs put a=1 --sync && kvbroker start --statedir {sd} -- true; "
            "echo second=$? && kvbroker startlog && "
            "kill -9 $(kvbroker exec -r 1 kvbroker attr get broker.pid); sleep 60", size=2)
    assert rc == 1 and "rank 1 exited unexpectedly, killed by signal 9" in err, (out, err)
    assert f"statedir {sd} is in use by another instance" in err, err
    lines = out.splitlines()
    assert lines[0] != "second=0" and lines[0].startswith("second="), out
    assert len(lines) == 2 and RUNNING.match(lines[1]), out  # (no run for the refused start)
    # rank 0 stopped cleanly all the same: nothing to report
    rc, out, err = await run_cli("startlog", "--statedir", str(sd), "--check")
    assert rc == 0 and FINISHED.match(out.strip()), (out, err)


async def test_t3200_a_long_lived_statedir_lists_its_newest_runs_in_order(
        tmp_path: Path) -> None:
    # 1,004 earlier runs an hour apart (the newest crashed), recorded in the
    # statedir's store as rank 0 records them; then a real start
    sd = tmp_path / "sd"
    sd.mkdir()
    hour, base = 3600.0, time.time() - 1100 * 3600.0
    store = SqliteStore(str(sd / "content.sqlite"))
    try:
        store.runs_put([(base + i * hour, None if i == RUNS_KEPT + 3 else base + i * hour + 60,
                         "0.1.0") for i in range(RUNS_KEPT + 4)])
    finally:
        store.close()
    rc, out, err = await _start(sd, "kvbroker startlog && kvbroker startlog --check -q; "
                                    "echo check=$?")
    assert rc == 0, (out, err)
    assert err.count(NOT_SHUT_DOWN) == 1, err
    assert time.strftime("(started %Y-%m-%d %H:%M)", time.localtime(base + 1003 * hour)) in err
    lines = out.splitlines()
    assert len(lines) == RUNS_KEPT + 1 and lines[-1] == "check=1", len(lines)
    listed = lines[:-1]  # (the newest 1,000, this one included: the first five went)
    for i, line in enumerate(listed[:-1]):  # (in order: the seeded runs 5..1003)
        assert line.startswith(time.strftime("%Y-%m-%d %H:%M ",
                                             time.localtime(base + (5 + i) * hour))), (i, line)
    assert all(FINISHED.match(s) for s in listed[:-2]), listed[-3:]
    assert CRASHED.match(listed[-2]) and RUNNING.match(listed[-1]), listed[-3:]
    rc, out, err = await run_cli("startlog", "--statedir", str(sd), "--check")
    assert rc == 0 and len(out.splitlines()) == RUNS_KEPT, err  # (that run stopped cleanly)


async def test_t3200_flux_backing_module_is_refused_saying_the_store_is_sqlite(
        tmp_path: Path) -> None:
    rc, out, err = await _start(tmp_path / "files", "true",
                                "-S", "content.backing-module=content-files")
    assert rc == 2, (out, err)
    assert "content.backlog-bytes" not in err, err
    assert "sqlite" in err.lower(), err
    # Flux's default, content-sqlite, is what kvbroker does: taken, or
    # refused the same way, never pointed at another attribute
    rc, out, err = await _start(tmp_path / "sqlite", "kvbroker kvs put a=1",
                                "-S", "content.backing-module=content-sqlite")
    assert rc == 0 or (rc == 2 and "content.backlog-bytes" not in err
                       and "sqlite" in err.lower()), (rc, out, err)
