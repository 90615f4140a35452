"""flux-core t/t2805-startlog-cmd.t: ``flux startlog`` -> ``kvbroker
startlog`` (broker/startlog.py, broker/cli.py ``cmd_startlog``, docs/cli.md
"startlog"), against real 2-rank instances started, stopped and killed
with one statedir (tests/test_startlog.py has the model's own tests).

Flux's test posts ``start`` and ``finish`` events by hand into a test
eventlog (``--test-startlog-key``, ``--post-start-event``,
``--post-finish-event``, options its rc1/rc3 scripts use).  kvbroker has
no such options, deliberately: rank 0 records a run's start itself, before
it serves, and its finish only once its final checkpoint is on disk, in
the statedir's store rather than in a KVS eventlog (docs/cli.md, startlog:
no version, key or checkpoint is added to ``primary`` per run).  So the
same histories are made for real: a clean stop is what posts a finish, a
rank 0 killed with SIGKILL is a start with no finish.

Flux's cases, and what each becomes:

1. *works on rank 0*, 2. *one run interval*, 3. *the entry shows the
   instance is still running*, 4. *--check --quiet works*, 5. *works on
   rank 1* -> the same, inside the instance's first run: one line,
   ``... - running (0.5s)``; ``--check --quiet`` exits 0 printing nothing;
   ``kvbroker exec -r 1 kvbroker startlog`` prints the same line
   (:func:`test_runs_clean_running_and_crashed`).
6. *posts start+finish to test eventlog*, 7. *one run interval is
   listed*, 8. *it is not shown as running*, 9. *--check returns success*
   -> that run stopped cleanly: ``startlog --statedir`` lists one interval,
   ``START - FINISH (DURATION)``, not running, and ``--check`` exits 0
   (same test).
10.-11. *posts start*, *--check returns success* -> the second run, while
   it runs: ``--check`` exits 0 (a start with no finish yet is the current
   run, not a crash) (same test).
12.-13. *posts start* again, *--check returns failure* -> rank 0 of that
   run SIGKILLed: its start has no finish, so ``startlog --statedir
   --check`` exits 1 and lists it ``crashed``; the next run says on
   ``start``'s stderr that the instance was not shut down properly, and
   ``--check`` inside it exits 1 too (same test).
14.-15. *append unknown version finish event*, *--check ignores bogus
   finish event* -> there are no event versions to ignore (the runs are
   rows of the store); what the case guards, that a stray ``finish`` does
   not hide a crash, holds here too: ``kvs eventlog append admin.eventlog
   finish '{"version":1}'`` (Flux's own key and event) changes nothing,
   ``--check`` still exits 1 (same test).
16. *--badopt fails* -> exit 2, ``unrecognized arguments: --badopt``; so
   do Flux's ``--post-start-event`` and ``--test-startlog-key=KEY``
   (:func:`test_bad_options_and_flux_s_posting_options_are_refused`).
17. *cannot post events on rank > 0* -> does not apply: nothing is posted
   by hand, on any rank.
"""

from __future__ import annotations

import re
from pathlib import Path

from test_broker_support import run_cli

T = 90.0
WHEN = r"\d{4}-\d\d-\d\d \d\d:\d\d"
FINISHED = re.compile(rf"{WHEN} - {WHEN} \(\d+\.\d[smhd]\)")
CRASHED = re.compile(rf"{WHEN} - crashed")
RUNNING = re.compile(rf"{WHEN} - running \(\d+\.\d[smhd]\)")
NOT_SHUT_DOWN = "the instance was not shut down properly"


async def start(statedir: Path, script: str) -> tuple[int, str, str]:
    return await run_cli("start", "-s", "2", "--statedir", str(statedir), "--", "sh", "-c",
                         script, timeout=T)


async def offline(statedir: Path, *opts: str) -> tuple[int, list[str]]:
    rc, out, err = await run_cli("startlog", "--statedir", str(statedir), *opts)
    assert rc in (0, 1) and err == "", err
    return rc, out.splitlines()


async def test_runs_clean_running_and_crashed(tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    # 1-5: the first run, asked while it runs, on rank 0 and on rank 1
    rc, out, err = await start(sd, "kvbroker startlog && kvbroker startlog --check --quiet && "
                                   "kvbroker exec -r 1 kvbroker startlog")
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and all(RUNNING.fullmatch(s) for s in lines), out
    assert NOT_SHUT_DOWN not in err

    # 6-9: it stopped cleanly: one interval, not running, --check clean
    rc, lines = await offline(sd, "--check")
    assert rc == 0 and len(lines) == 1 and FINISHED.fullmatch(lines[0]), lines

    # 10-13: a run that is running checks clean; killed, it is a crash
    rc, out, err = await start(sd, "kvbroker startlog --check -q && echo clean && "
                                   "kill -9 $(kvbroker attr get broker.pid); sleep 60")
    assert rc == 1 and out == "clean\n" and "killed by signal 9" in err, (out, err)
    rc, lines = await offline(sd, "--check")
    assert rc == 1, lines
    assert len(lines) == 2 and FINISHED.fullmatch(lines[0]) and CRASHED.fullmatch(lines[1])

    # 12-15: the next run says so, checks failed, and a stray finish event
    # (Flux's key and event, in the KVS) does not hide the crash
    rc, out, err = await start(sd, "kvbroker startlog --check -q; echo check=$?; "
                                   "kvbroker kvs eventlog append admin.eventlog finish "
                                   "'{\"version\":1}' && kvbroker startlog --check; "
                                   "echo check=$?")
    assert rc == 0, err
    assert err.count(NOT_SHUT_DOWN) == 1, err
    lines = out.splitlines()
    assert lines[0] == "check=1" and lines[-1] == "check=1", out
    assert [bool(p.fullmatch(s)) for p, s in zip((FINISHED, CRASHED, RUNNING), lines[1:4],
                                                 strict=True)] == [True] * 3, out
    # that run stopped cleanly: the crash is forgotten
    rc, lines = await offline(sd, "--check")
    assert rc == 0 and len(lines) == 3 and FINISHED.fullmatch(lines[2]), lines


async def test_bad_options_and_flux_s_posting_options_are_refused() -> None:
    for opt in ("--badopt", "--post-start-event", "--post-finish-event",
                "--test-startlog-key=testlog"):
        rc, out, err = await run_cli("startlog", opt)
        assert (rc, out) == (2, ""), (opt, err)
        assert f"unrecognized arguments: {opt}" in err, (opt, err)
