"""flux-core t/t0001-basic.t: starting an instance and the broker basics --
sizes, ``start`` options taken and refused, attributes (``rank``, ``size``,
``rundir``, ``broker.pid``, ``hostlist``...), the initial program's exit
status and signals, the run directory, the command line's help and
version.  Each case here runs ``kvbroker start ...`` as a real process.

Flux case -> here:

* sharness self-tests (TEST_NAME, heredoc, run_timeout,
  test_must_fail_or_be_terminated), "we can find a flux binary" -> do not
  apply (the test harness itself).
* flux-keygen (path optional, --name, --meta, extra argument, mode u=rw,
  overwrite, different keys, unknown arg) -> ``kvbroker keygen FILE``:
  docs/cli.md (broker, keygen) and tests/test_multihost.py; here only: an
  extra argument and an unknown option are usage errors (exit 2), and an
  existing file is not overwritten (exit 1: a difference, Flux overwrites).
* flux-python (--get-path, --list-versions, python3.x), flux fortune ->
  do not apply (no such commands).
* start in exec mode / subprocess mode, size 1 and 2: ``getattr size`` ->
  ``start [-s N] -- kvbroker getattr size`` prints N.
* broker.boot-method simple/single/FLUX_PMI_CLIENT_METHODS -> do not apply
  (no PMI); ``-S broker.boot-method=unknown`` fails -> refused, exit 2
  (any ``broker.`` name not known is refused).
* size 1 has no peers / size 2 has a rank 1 peer (overlay child-count) ->
  ``overlay status`` lists rank 1 under rank 0 at size 2, nothing below 0
  at size 1.
* unknown option, ``--verbose=badopt`` -> usage error, exit 2.
* bad ``SHELL`` (127) -> does not apply as such: a command is executed,
  never through ``$SHELL``; a command not found is 127.
* non-executable command 126, no shebang 126 -> the same (126).
* "does not use $SHELL -c for a script" -> a script runs as itself even
  with a failing ``$SHELL``.
* "does use $SHELL -c otherwise" (one word with spaces, also
  ``flux start 'kill -INT $$'``) -> DIFFERENCE: kvbroker execs that word
  as a file name (127); the command must be ``sh -c ...``.  Pinned.
* bad broker shell script (``#!/badinterp`` via FLUX_EXEC_PATH_PREPEND) ->
  the same situation for the initial program: a command whose interpreter
  is missing: 126 and "bad interpreter", as a shell (it was 127 and "No
  such file or directory" naming the script: DEFECT found here, fixed).
  The same through ``kvbroker exec``.
* ``-s1`` works; broker.mapping -> ``-s1 -- true`` exits 0; mapping does
  not apply (no PMI mapping attribute).
* ``--test-rundir``/``--test-pmi-clique``/``--test-hosts``/
  ``--test-exit-timeout``/``--test-exit-mode``/``--test-start-mode``
  without ``--test-size``, their bad values, ``-vv`` PMI tracing,
  pmi-clique -> do not apply (no test-mode launcher, no PMI) except:
  ``--test-size N`` is ``--size N`` and ``--test-rundir`` is ``--rundir``
  (documented) -- so "--test-rundir without --test-size fails" is a
  difference: it is taken (pinned); ``--test-rundir-cleanup`` is not an
  option here (usage error, exit 2; ``-S rundir-cleanup=1`` is).
* embedded server (startctl status, hi/bye logs) -> does not apply.
* exec/subprocess mode pass through a failing command -> ``-- false`` exits
  1; passes a signal -> ``sh -c 'kill -INT $$'`` exits 130, sizes 1 and 2.
* start as initial program of start (nested) -> ``start -s2 -- kvbroker
  start -- kvbroker getattr size`` prints 1 (the inner instance).
* BASH_ENV, rc1.d files, FLUX_RC_EXTRA -> do not apply (no rc scripts;
  empty ``broker.rc1_path=``/``rc3_path=`` are taken, see below).
* ``--wrap`` -> does not apply (no such option: a usage error);
  ``-v`` prints each rank's command line (pinned, as Flux's ``-vX``).
* dies gracefully when run from a removed directory -> DIFFERENCE: kvbroker
  starts and runs the command (exit 0); nothing there needs the cwd.
* FLUX_HWLOC_XMLFILE, test_under_flux, modcheck -> do not apply.
* ``-o,--setattr=test.foo=42`` and ``--setattr=test.foo=42`` -> 42.
* hostlist on size 1, on every rank of size 4 -> this host's name, once
  per rank, on every rank.
* singleton / -s1 / -s2 clean up their rundir -> the ``rundir`` attribute
  names a directory that is gone after ``start`` exits.
* ``--test-rundir`` works (rundir attr is it, it stays) ->
  ``--test-rundir`` (and ``--rundir``): the attribute is it, it stays
  (emptied).  With ``-S rundir-cleanup=1`` it is removed.
* ``--test-rundir`` missing directory fails -> DIFFERENCE (documented):
  it is made, then removed; not-a-directory fails (exit 2, saying so).
* broker.pid readable (a number), immutable with ``--setattr`` -> the same;
  ``-S broker.pid=...`` refused, exit 2.
* parent-uri / parent-kvs-namespace only for jobs -> no jobs: neither
  attribute exists (``getattr parent-uri`` fails, exit 1).
* local-uri override, malformed, buffer overflow, missing/non/unwritable
  dir -> DIFFERENCE (documented): ``-S local-uri=`` is refused, exit 2,
  naming ``--rundir``; the socket's directory is the rundir, whose
  checks stand in (not a directory, too long below).
* broker ``-o,-v`` works -> DIFFERENCE (documented): ``-o`` takes only
  ``-S``; ``-o,-v`` is a usage error naming it.  ``-o,--not-an-option``
  fails, exit 2 (the same).
* invalid broker.critical-ranks -> refused, exit 2 (unknown ``broker.``
  attribute).
* flux-help extensible, man pages, MANPATH, FLUX_RC_EXTRA dedup,
  test_size_large, waitfile, flux_log(NULL), reactorcat, libtool -> do not
  apply.
* stop cleanly with subscribers (#1025) -> ``start -s2 -- sh -c 'nohup
  kvbroker event sub heartbeat.pulse &'`` exits 0 (heartbeat loaded).
* long rundir (#3925) -> refused, exit 2, "too long a path", and
  nothing is made (the refused rundir and its missing parents were left
  behind: DEFECT found here, fixed).  Long local-uri -> refused as above.
* ``--help`` works outside an instance for every command -> ``kvbroker
  --help`` and each command's and kvs subcommand's ``--help`` print a
  usage and exit 0; ``--version`` prints ``kvbroker 0.1.0``.
* Also: a bad ``--size`` (0, -1, abc, 4097) is a usage error; Flux's
  ``-S rundir=``, ``-S log-stderr-level=6`` are taken, a non-empty
  ``broker.rc1_path``, ``log-stderr-level=9``, ``statedir-cleanup`` and a
  bad ``rundir-cleanup`` refused (exit 2); a command killed by SIGKILL
  gives 137; commands outside an instance say KVBROKER_URI is not set.
* Also (brief): ``getattr``/``attr get`` of rank, size, local-uri on a
  size-2 instance from ranks 0 and 1, and ``ping 1``.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import sys
from pathlib import Path

import pytest
from test_broker_support import KVBROKER

ARGS = ("-S", "broker.rc1_path=", "-S", "broker.rc3_path=")  # Flux's, taken


async def kvb(*args: str, cwd: str | Path | None = None,
              env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``kvbroker ARGS`` outside any instance; (status, stdout, stderr)."""
    e = dict(os.environ)
    e.pop("KVBROKER_URI", None)
    e.update(env or {})
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, *args, cwd=cwd, env=e, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def start(*args: str, **kw) -> tuple[int, str, str]:
    return await kvb("start", *ARGS, *args, **kw)


# -- sizes, getattr ---------------------------------------------------------

@pytest.mark.parametrize("size", [None, "1", "2"])
async def test_t0001_start_getattr_size(size: str | None) -> None:
    opts = () if size is None else ("-s", size)
    assert await start(*opts, "--", KVBROKER, "getattr", "size") == (0, f"{size or 1}\n", "")


async def test_t0001_test_size_is_size() -> None:
    assert await start("--test-size=2", "--", KVBROKER, "getattr", "size") == (0, "2\n", "")


async def test_t0001_rank_size_local_uri_and_ping_on_two_ranks() -> None:
    script = ("kvbroker getattr rank; kvbroker attr get size; kvbroker attr get local-uri; "
              "kvbroker exec -r 1 -- sh -c 'kvbroker getattr rank; kvbroker attr get local-uri';"
              " kvbroker ping 1; echo uri=$KVBROKER_URI")
    rc, out, err = await start("-s2", "--", "sh", "-c", script,
                               env={"PATH": f"{Path(KVBROKER).parent}:{os.environ['PATH']}"})
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0:2] == ["0", "2"]
    m = re.fullmatch(r"local://(/.+)/local-0", lines[2])
    assert m, lines
    assert lines[3:5] == ["1", f"local://{m.group(1)}/local-1"]
    assert re.fullmatch(r"rank=1 route=c\d+!r0!r1 seq=0 time=[\d.]+ ms", lines[5]), lines
    assert lines[6] == f"uri={lines[2]}"


@pytest.mark.parametrize("size", ["1", "2"])
async def test_t0001_overlay_peers(size: str) -> None:
    rc, out, err = await start("-s", size, "--", KVBROKER, "overlay", "status")
    assert rc == 0, err
    ranks = [int(w.split()[0]) for w in out.splitlines() if w.strip()]
    assert ranks == list(range(int(size))), out


# -- options refused / taken ------------------------------------------------

@pytest.mark.parametrize("opts", [
    ("--unknown",),
    ("--verbose=badopt",),
    ("--wrap=/bin/echo,start:",),
    ("--test-rundir-cleanup",),
    ("-o,-v",),
    ("-o,--not-an-option",),
])
async def test_t0001_start_refuses_option(opts: tuple[str, ...]) -> None:
    rc, out, err = await start(*opts, "true")
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "usage: kvbroker start" in err
    assert opts[0].split("=")[0].removeprefix("-o,") in err, err


@pytest.mark.parametrize("attr, says", [
    ("broker.boot-method=unknown", "broker.boot-method: unknown attribute"),
    ("broker.critical-ranks=0-1", "broker.critical-ranks: unknown attribute"),
    ("broker.pid=1234", "broker.pid cannot be set with -S"),
    ("local-uri=baduri", "local-uri cannot be set with -S"),
])
async def test_t0001_start_refuses_attribute(attr: str, says: str) -> None:
    rc, out, err = await start("-S", attr, "--", KVBROKER, "getattr", "broker.pid")
    assert (rc, out) == (2, ""), (rc, out, err)
    assert says in err, err


@pytest.mark.parametrize("how", [("-o,--setattr=test.foo=42",), ("--setattr=test.foo=42",)])
async def test_t0001_setattr(how: tuple[str, ...]) -> None:
    assert await start(*how, "--", KVBROKER, "getattr", "test.foo") == (0, "42\n", "")


async def test_t0001_verbose_prints_rank_command_lines() -> None:
    rc, out, err = await start("-v", "-s2", "--", "true")
    assert (rc, out) == (0, ""), err
    lines = [ln for ln in err.splitlines() if ln.startswith("kvbroker: start: rank ")]
    assert [ln.split(":")[2].strip() for ln in lines] == ["rank 0", "rank 1"], err
    assert all("-P -m broker.rank" in ln for ln in lines), err


# -- the command's exit status and signals ----------------------------------

@pytest.mark.parametrize("size", ["1", "2"])
async def test_t0001_failing_command_passes_through(size: str) -> None:
    assert (await start("-s", size, "--", "false"))[0] == 1
    assert (await start("-s", size, "--", "sh", "-c", "exit 7"))[0] == 7


@pytest.mark.parametrize("size", ["1", "2"])
async def test_t0001_signal_exit_is_128_plus_n(size: str) -> None:
    assert (await start("-s", size, "--", "sh", "-c", "kill -INT $$"))[0] == 130


async def test_t0001_not_found_127_not_executable_126(tmp_path: Path) -> None:
    script = tmp_path / "no-shebang.sh"
    script.write_text("true\n")
    rc, _, err = await start("--", str(tmp_path / "nosuch"))
    assert rc == 127 and "No such file or directory" in err, err
    rc, _, err = await start("--", str(script))
    assert rc == 126 and "Permission denied" in err, err
    script.chmod(0o755)
    rc, _, err = await start("--", str(script))
    assert rc == 126 and "Exec format error" in err, err


async def test_t0001_script_does_not_go_through_shell(tmp_path: Path) -> None:
    fail = tmp_path / "fail.sh"
    fail.write_text("#!/bin/sh\nexit 1\n")
    ok = tmp_path / "ok.sh"
    ok.write_text("#!/bin/sh\nexit 0\n")
    fail.chmod(0o755)
    ok.chmod(0o755)
    assert (await start("--", str(ok), env={"SHELL": str(fail)}))[0] == 0
    assert (await start("--", KVBROKER, "uptime", env={"SHELL": "/no/such/path"}))[0] == 0


async def test_t0001_one_word_command_is_not_run_by_shell() -> None:
    """Difference: Flux runs ``flux start 'kill -INT $$'`` as ``$SHELL -c``."""
    rc, out, err = await start("--", "exit 3")
    assert (rc, out) == (127, ""), err
    assert "exit 3: No such file or directory" in err


async def test_t0001_missing_interpreter_is_126(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/badinterp\n")
    bad.chmod(0o755)
    rc, _, err = await start("--", str(bad))
    assert rc == 126, (rc, err)
    assert "No such file or directory" not in err or "interp" in err, err


async def test_t0001_nested_start() -> None:
    for inner in ((), ("-s1",)):
        rc, out, err = await start("-s2", "--", KVBROKER, "start", *ARGS, *inner, "--",
                                   KVBROKER, "getattr", "size")
        assert (rc, out) == (0, "1\n"), err


async def test_t0001_start_from_removed_directory(tmp_path: Path) -> None:
    """Difference: Flux fails (gracefully); nothing here needs the cwd."""
    gone = tmp_path / "foo"
    gone.mkdir()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        f"import os, subprocess, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
        f"sys.exit(subprocess.call([{KVBROKER!r}, 'start', '--', 'true']))",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err


async def test_t0001_stops_cleanly_with_subscribers() -> None:
    rc, _, err = await start(
        "-s2", "-S", "broker.modules=content,kvs,kvs-watch,heartbeat", "--", "sh", "-c",
        f"nohup {KVBROKER} event sub heartbeat.pulse >/dev/null 2>&1 &")
    assert rc == 0, err


# -- attributes ---------------------------------------------------------------

async def test_t0001_hostlist_on_every_rank() -> None:
    # (exec relays whole lines, as flux exec: an unbuffered Python -- this
    # sandbox sets PYTHONUNBUFFERED=1 -- writes a line and its newline
    # apart, and four sharing exec's stdout once interleaved them)
    rc, out, err = await start("-s4", "--", KVBROKER, "exec", "-r", "all", "--",
                               KVBROKER, "getattr", "hostlist")
    assert rc == 0, err
    host = socket.gethostname()
    assert out.splitlines() == [",".join([host] * 4)] * 4


async def test_t0001_hostlist_size_1() -> None:
    host = socket.gethostname()
    assert await start("--", KVBROKER, "getattr", "hostlist") == (0, f"{host}\n", "")


async def test_t0001_broker_pid_is_a_number() -> None:
    rc, out, err = await start("--", KVBROKER, "getattr", "broker.pid")
    assert rc == 0 and out.strip().isdigit() and int(out) > 0, (rc, out, err)


async def test_t0001_no_parent_uri_without_jobs() -> None:
    for name in ("parent-uri", "parent-kvs-namespace"):
        rc, out, err = await start("--", KVBROKER, "getattr", name)
        assert (rc, out) == (1, ""), err
        assert f"unknown attribute '{name}'" in err


# -- the run directory ---------------------------------------------------------

@pytest.mark.parametrize("size", [None, "1", "2"])
async def test_t0001_rundir_cleaned_up(size: str | None) -> None:
    opts = () if size is None else ("-s", size)
    rc, out, err = await start(*opts, "--", KVBROKER, "getattr", "rundir")
    assert rc == 0 and out.strip(), err
    assert not os.path.lexists(out.strip())


@pytest.mark.parametrize("opt", ["--test-rundir", "--rundir"])
async def test_t0001_given_rundir_stays(tmp_path: Path, opt: str) -> None:
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    rc, out, err = await start(f"{opt}={rundir}", "--", KVBROKER, "getattr", "rundir")
    assert (rc, out) == (0, f"{rundir}\n"), err
    assert rundir.is_dir() and list(rundir.iterdir()) == []


async def test_t0001_rundir_cleanup_attribute(tmp_path: Path) -> None:
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    assert (await start(f"--rundir={rundir}", "-S", "rundir-cleanup=1", "--", "true"))[0] == 0
    assert not rundir.exists()


async def test_t0001_missing_rundir_is_made_then_removed(tmp_path: Path) -> None:
    """Difference (documented): Flux's --test-rundir must exist."""
    rundir = tmp_path / "noexist"
    rc, out, err = await start(f"--test-rundir={rundir}", "--", KVBROKER, "getattr", "rundir")
    assert (rc, out) == (0, f"{rundir}\n"), err
    assert not rundir.exists()


async def test_t0001_rundir_not_a_directory(tmp_path: Path) -> None:
    notdir = tmp_path / "notdir"
    notdir.touch()
    rc, out, err = await start("--test-rundir=notdir", "--", "true", cwd=tmp_path)
    assert (rc, out) == (2, ""), err
    assert f"rundir {notdir}: not a directory" in err


def long_rundir(tmp_path: Path) -> Path:
    return tmp_path / ("rundir-" + "0123456789" * 11)


async def test_t0001_long_rundir_refused(tmp_path: Path) -> None:
    longdir = long_rundir(tmp_path)
    longdir.mkdir(mode=0o700)
    rc, out, err = await start(f"--rundir={longdir}", "--", "true")
    assert (rc, out) == (2, ""), err
    assert "too long a path for the ranks' sockets" in err


async def test_t0001_refused_long_rundir_leaves_nothing(tmp_path: Path) -> None:
    longdir = tmp_path / "x" / "y" / long_rundir(tmp_path).name
    rc, _, err = await start(f"--rundir={longdir}", "--", "true")
    assert rc == 2, err
    assert not (tmp_path / "x").exists()


# -- help, usage, version ---------------------------------------------------------

COMMANDS = ["start", "broker", "keygen", "relay", "exec", "rpc", "event", "ping", "attr",
            "dmesg", "logger", "module", "stats", "overlay", "uptime", "shutdown",
            "content", "kvs", "getattr", "lsattr", "setattr"]


async def test_t0001_help_outside_an_instance() -> None:
    rc, out, _ = await kvb("--help")
    assert rc == 0 and out.lower().startswith("usage: kvbroker"), out
    helps = await asyncio.gather(*(kvb(*c.split(), "--help") for c in
                                   COMMANDS + ["kvs namespace", "kvs eventlog"]))
    for cmd, (rc, out, err) in zip(COMMANDS + ["kvs namespace", "kvs eventlog"], helps,
                                   strict=True):
        assert rc == 0 and "usage:" in out.lower(), (cmd, rc, out, err)


async def test_t0001_version_and_usage() -> None:
    assert await kvb("--version") == (0, "kvbroker 0.1.0\n", "")
    rc, out, err = await kvb()
    assert (rc, out) == (2, "") and "usage: kvbroker" in err
    rc, out, err = await kvb("nosuch")
    assert (rc, out) == (2, "") and "invalid choice: 'nosuch'" in err


async def test_t0001_keygen_usage_and_no_overwrite(tmp_path: Path) -> None:
    key = tmp_path / "k"
    assert (await kvb("keygen", str(key), "extra"))[0] == 2
    assert (await kvb("keygen", "--badopt", str(key)))[0] == 2
    assert (await kvb("keygen", str(key)))[0] == 0
    assert key.stat().st_mode & 0o777 == 0o600
    before = key.read_bytes()
    rc, _, err = await kvb("keygen", str(key))
    assert rc == 1, err
    assert key.read_bytes() == before


# -- more of start's options (Flux's spellings) ----------------------------------

@pytest.mark.parametrize("size, says", [
    ("0", "--size must be at least 1"),
    ("-1", "--size must be at least 1"),
    ("abc", "invalid int value"),
    ("4097", "--size must be at most 4096"),
])
async def test_t0001_bad_size_refused(size: str, says: str) -> None:
    rc, out, err = await start(f"--size={size}", "--", "true")
    assert (rc, out) == (2, ""), err
    assert says in err, err


async def test_t0001_flux_attr_spellings(tmp_path: Path) -> None:
    rundir = tmp_path / "run"
    rc, out, err = await start("-S", f"rundir={rundir}", "-S", "log-stderr-level=6", "--",
                               "sh", "-c", f"{KVBROKER} getattr rundir; "
                               f"{KVBROKER} getattr log.level")
    assert (rc, out) == (0, f"{rundir}\ninfo\n"), err
    for attr, says in [("broker.rc1_path=/bin/true", "runs no rc scripts"),
                       ("log-stderr-level=9", "0-7"),
                       ("statedir-cleanup=1", "statedir-cleanup"),
                       ("rundir-cleanup=bogus", "not a boolean")]:
        rc, out, err = await start("-S", attr, "--", "true")
        assert (rc, out) == (2, ""), (attr, err)
        assert says in err, (attr, err)


async def test_t0001_command_killed_by_sigkill_is_137() -> None:
    assert (await start("--", "sh", "-c", "kill -KILL $$"))[0] == 137


async def test_t0001_commands_outside_an_instance_say_so() -> None:
    for cmd in (("getattr", "size"), ("ping",)):
        rc, out, err = await kvb(*cmd)
        assert (rc, out) == (1, ""), err
        assert "KVBROKER_URI is not set" in err, err


async def test_t0001_missing_interpreter_is_126_through_exec(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/badinterp\n")
    bad.chmod(0o755)
    rc, _, err = await start("--", KVBROKER, "exec", "-r", "0", "--", str(bad))
    assert rc == 126, (rc, err)
