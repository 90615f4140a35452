"""The ``kvbroker`` command: start, exec and the client commands (docs/cli.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import re
import signal
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, client_subscriptions, run_cli, stats, wait_until

from broker import cli
from broker.handle import Handle, parse_uri
from broker.launch import STOP_TIMEOUT


def rundir_of(uri: str) -> str:
    return os.path.dirname(parse_uri(uri.strip()))


def error_line(stderr: str, what: str, errnum: int) -> None:
    """``kvbroker: <what>: <strerror>`` (maybe followed by the service's own words)."""
    line = stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvbroker: {what}: {os.strerror(errnum)}"), stderr


# ---------------------------------------------------------------- start


async def test_start_exits_with_the_commands_status() -> None:
    rc, out, err = await run_cli(
        "start", "--size", "2", "--", "sh", "-c", 'echo "$KVBROKER_URI"; exit 7'
    )
    assert rc == 7, err
    uri = out.strip()
    assert uri.startswith("local:///") and uri.endswith("/local-0")
    assert not os.path.exists(rundir_of(uri))  # stopped and cleaned up


async def test_start_gives_its_command_rank_0_not_an_outer_exec_s_rank() -> None:
    """An instance started inside an ``exec -r 3`` command: its own command
    and ranks see this instance's rank (0), not the outer one's
    ``KVBROKER_RANK``."""
    script = 'echo "$KVBROKER_RANK"; kvbroker exec -r 1 -- sh -c \'echo "$KVBROKER_RANK"\''
    rc, out, err = await run_cli("start", "--size", "2", "--", "sh", "-c", script,
                                 env=dict(os.environ, KVBROKER_RANK="3"))
    assert rc == 0, err
    assert out.split() == ["0", "1"]


async def test_start_size_8_ping_rank_7() -> None:
    rc, out, err = await run_cli(
        "start", "--size", "8", "--fanout", "2", "--", KVBROKER, "ping", "--count", "10", "7"
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 10
    for i, line in enumerate(lines):
        assert re.fullmatch(rf"rank=7 route=c\d+!r0!r1!r3!r7 seq={i} time=[\d.]+ ms", line), line


async def test_start_reports_a_command_killed_by_a_signal() -> None:
    rc, _, err = await run_cli("start", "--", "sh", "-c", "kill -TERM $$")
    assert rc == 128 + signal.SIGTERM, err


async def test_start_says_which_rank_it_had_to_kill() -> None:
    """A rank that does not exit on SIGTERM (stopped here) is killed after
    the stop timeout (``--rank-stop-timeout``, here 2 s, not the default
    15): ``start`` names it and why, and exits 1 -- it used to wait in
    silence, then blame the rank's log, which says nothing."""
    stop_rank_2 = f'kill -STOP $({KVBROKER} attr get broker.pid -r 2)'
    rc, _, err = await asyncio.wait_for(run_cli(
        "start", "--size", "3", "--fanout", "2", "--rank-stop-timeout", "2",
        "--", "sh", "-c", stop_rank_2), 60)
    assert rc == 1, err
    assert err.strip().splitlines()[-1] == (
        "kvbroker: rank 2 did not exit within 2 s of SIGTERM, "
        "so it was killed (a hung or stopped process)"), err


async def test_start_stopped_by_sigterm_says_which_rank_it_had_to_kill() -> None:
    """The same when ``start`` serves without a command and is stopped by
    SIGTERM, as a service is: it exited 0 (operator audit)."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "--size", "3", "--fanout", "2", "--rank-stop-timeout", "2s",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        uri = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode().strip()
        rc, out, err = await run_cli("attr", "get", "broker.pid", "-r", "2", uri=uri)
        assert rc == 0, err
        os.kill(int(out), signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        _out, err_b = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 1, err_b
    assert err_b.decode().strip().splitlines()[-1] == (
        "kvbroker: rank 2 did not exit within 2 s of SIGTERM, "
        "so it was killed (a hung or stopped process)"), err_b


async def test_start_missing_command() -> None:
    rc, _, err = await run_cli("start", "--", "/nonexistent/command")
    assert rc == 127
    error_line(err, "/nonexistent/command", errno.ENOENT)


async def test_start_a_command_that_cannot_be_executed_exits_126() -> None:
    """Found but not executable: 126, as a shell (was 127, "not found")."""
    for path in ("/etc/passwd", os.devnull, "/"):
        rc, _, err = await run_cli("start", "--", path)
        assert rc == 126, (path, err)
        error_line(err, path, errno.EACCES)  # execve says so of a directory too


async def test_start_a_script_whose_interpreter_is_missing_exits_126(tmp_path) -> None:
    """Flux's t0001 "invalid shebang": the script is there, its ``#!``
    interpreter is not: 126 and ``bad interpreter``, as bash says it (it
    was 127, "No such file or directory", as if the script were missing)."""
    script = tmp_path / "badi.sh"
    script.write_text("#!/nonexistent/interp -x\necho hi\n")
    script.chmod(0o755)
    rc, out, err = await run_cli("start", "--", str(script))
    assert (rc, out) == (126, ""), err
    assert err == (f"kvbroker: {script}: /nonexistent/interp: bad interpreter: "
                   f"{os.strerror(errno.ENOENT)}\n"), err


async def test_start_in_a_run_directory_of_ones_choice(tmp_path) -> None:
    """``start --rundir DIR`` (Flux's ``--rundir``/``--test-rundir``, and
    ``-S rundir=DIR``): the sockets go in DIR, made if missing and then
    removed; one that was there stays, emptied of what the start wrote.
    One another running instance uses is refused: its ranks' sockets
    would have been taken over (a rank replaces a socket at its path)."""
    made = tmp_path / "made"
    script = 'echo "$KVBROKER_URI"; kvbroker ping 1 >/dev/null && kvbroker attr get rundir'
    rc, out, err = await run_cli("start", "--size", "2", "--rundir", str(made), "--",
                                 "sh", "-c", script)
    assert (rc, out) == (0, f"local://{made}/local-0\n{made}\n"), err
    assert not made.exists()
    kept = tmp_path / "kept"
    kept.mkdir(mode=0o700)
    (kept / "mine").write_text("x")
    for option in (("--test-rundir", str(kept)), ("-S", f"rundir={kept}")):
        rc, out, err = await run_cli("start", "--size", "2", "-S", "tbon.transport=tcp",
                                     *option, "--", "kvbroker", "attr", "get", "rundir")
        assert (rc, out) == (0, f"{kept}\n"), err
        assert sorted(p.name for p in kept.iterdir()) == ["mine"]
    for transport in ("unix", "ipc"):  # (their tbon-R socket files too: tbon-0 stayed)
        rc, out, err = await run_cli("start", "--size", "3", "--fanout", "1", "-S",
                                     f"tbon.transport={transport}", "--rundir", str(kept),
                                     "--", "kvbroker", "ping", "2")
        assert rc == 0 and "route=" in out, err
        assert sorted(p.name for p in kept.iterdir()) == ["mine"], transport
    # guests need it 0755 while the instance runs; its own mode comes back
    rc, out, err = await run_cli("start", "--rundir", str(kept), "-S",
                                 "access.allow-guest-user=true", "--",
                                 "stat", "-c", "%a", str(kept))
    assert (rc, out) == (0, "755\n"), err
    assert stat.S_IMODE(kept.stat().st_mode) == 0o700
    running = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "--rundir", str(kept), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL)
    try:
        assert running.stdout is not None
        uri = (await asyncio.wait_for(running.stdout.readline(), 30)).decode().strip()
        assert uri == f"local://{kept}/local-0"
        rc, out, err = await run_cli("start", "--rundir", str(kept), "--", "true")
        assert (rc, out) == (2, ""), err
        assert f"rundir {kept} is in use by a running instance" in err, err
        rc, out, err = await run_cli("ping", uri=uri)  # (the running one is untouched)
        assert rc == 0, err
    finally:
        running.send_signal(signal.SIGTERM)
        await asyncio.wait_for(running.wait(), 30)
    kept.chmod(0o777)
    rc, _, err = await run_cli("start", "--rundir", str(kept), "--", "true")
    assert rc == 2 and f"rundir {kept}: writable by group or others" in err, err


async def test_start_recovery_on_a_statedir_or_an_archive(tmp_path) -> None:
    """Flux's ``start --recovery TARGET``: rank 0 alone on a statedir, or
    on what a dump archive holds, restored into a store of its own (what
    changes there goes at the stop)."""
    state, archive = tmp_path / "state", tmp_path / "a.tgz"
    rc, _, err = await run_cli("start", "--statedir", str(state), "--",
                               "kvbroker", "kvs", "put", "a=1")
    assert rc == 0, err
    rc, out, err = await run_cli("start", "--recovery", str(state), "--", "sh", "-c",
                                 "kvbroker attr get size && kvbroker kvs get a")
    assert (rc, out) == (0, "1\n1\n"), err
    rc, _, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(state),
                               str(archive))
    assert rc == 0, err
    rc, out, err = await run_cli("start", "-r", str(archive), "--", "sh", "-c",
                                 "kvbroker kvs get a && kvbroker kvs put a=2")
    assert (rc, out) == (0, "1\n"), err
    rc, out, err = await run_cli("start", "--recovery", str(state), "--",
                                 "kvbroker", "kvs", "get", "a")
    assert (rc, out) == (0, "1\n"), err  # (the archive's store was its own)
    for args, message in (
            (("--recovery", str(state), "--size", "2"), "--recovery runs rank 0 alone"),
            (("--recovery", str(tmp_path / "nope")), "no such directory or file"),
            (("--recovery", str(archive), "--statedir", str(state)),
             "an archive is restored into a store of its own: no --statedir")):
        rc, out, err = await run_cli("start", *args, "--", "true")
        assert (rc, out) == (2, ""), err
        assert message in err, err


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_start_event_loop_and_attributes(loop: str) -> None:
    script = f"{KVBROKER} attr get event-loop; {KVBROKER} attr get my.attr --rank 1"
    rc, out, err = await run_cli(
        "start",
        "--size",
        "2",
        "--event-loop",
        loop,
        "-S",
        "my.attr=hello",
        "--",
        "sh",
        "-c",
        script,
    )
    assert rc == 0, err
    assert out.split() == [loop, "hello"]


async def test_start_takes_the_ranks_loop_from_kvbrokers_option_and_the_environment() -> None:
    """``kvbroker --event-loop asyncio start`` and ``$KVBROKER_EVENT_LOOP``
    were taken and dropped: ``start``'s own default, auto, ran uvloop ranks.
    Its own option still comes first."""
    script = f"{KVBROKER} exec -r all -- {KVBROKER} attr get event-loop"
    env = {k: v for k, v in os.environ.items() if k != "KVBROKER_EVENT_LOOP"}
    for argv, extra, want in [
            (["--event-loop", "asyncio", "start"], {}, "asyncio"),
            (["start"], {"KVBROKER_EVENT_LOOP": "asyncio"}, "asyncio"),
            (["--event-loop", "asyncio", "start", "--event-loop", "uvloop"], {}, "uvloop"),
            (["start"], {"KVBROKER_EVENT_LOOP": "bogus"}, None)]:
        rc, out, err = await run_cli(*argv, "--size", "2", "--", "sh", "-c", script,
                                     env={**env, **extra})
        if want is None:
            assert (rc, out) == (1, ""), err
            assert "unknown event loop 'bogus'" in err, err
        else:
            assert (rc, out.split()) == (0, [want, want]), (argv, extra, err)


async def test_start_rejects_bad_arguments() -> None:
    rc, _, err = await run_cli("start", "--size", "0", "--", "true")
    assert rc == 2
    assert err.startswith("usage: kvbroker start") and "at least 1" in err
    rc, _, err = await run_cli("start", "-S", "novalue", "--", "true")
    assert rc == 2 and "ATTR=VALUE" in err
    rc, _, err = await run_cli("start", "--event-loop", "bogus", "--", "true")
    assert rc == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
async def test_start_without_a_command_serves_until_signalled(sig: int) -> None:
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER,
        "start",
        "--size",
        "3",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env=env,
    )
    try:
        async with asyncio.timeout(30):
            assert proc.stdout is not None
            uri = (await proc.stdout.readline()).decode().strip()
            assert uri.startswith("local://")
            async with await Handle.connect(uri) as h:
                assert (await h.ping(2))["rank"] == 2
            proc.send_signal(sig)
            _, err = await proc.communicate()
            assert proc.returncode == 0, err
            assert not os.path.exists(rundir_of(uri))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_start_stops_when_a_rank_dies() -> None:
    script = f"kill -9 $({KVBROKER} attr get --rank 1 broker.pid); exec sleep 60"
    rc, _, err = await run_cli("start", "--size", "2", "--", "sh", "-c", script, timeout=30)
    assert rc == 1
    assert "rank 1 exited unexpectedly, killed by signal 9 (SIGKILL); stopping" in err


def proc_stat(pid: int | str) -> list[str]:
    """/proc/PID/stat from the state field on (state, ppid, pgrp, session, ...);
    empty if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return []


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    stat = proc_stat(pid)
    return bool(stat) and stat[0] not in ("Z", "X")


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (the ranks have their own)."""
    for entry in os.listdir("/proc"):
        stat = proc_stat(entry) if entry.isdigit() else []
        if len(stat) > 3 and int(stat[3]) == sid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry), signal.SIGKILL)


async def all_gone(pids: list[int], what: str, timeout: float = 10.0) -> None:
    async def gone() -> bool:
        return not any(alive(pid) for pid in pids)

    await wait_until(gone, what, timeout)


@contextlib.asynccontextmanager
async def start_process(
    *args: str, pass_fds: tuple[int, ...] = ()
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``kvbroker start ARGS`` in a session of its own, as a script or a
    service runs it: no controlling terminal (the command gets its own
    process group, even when the tests run in a terminal), and the signals
    a test sends reach ``start`` alone.  At exit, what is left of the
    session is killed: a failed test must not wait for a command still
    holding start's output pipes."""
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, env=env,
        start_new_session=True, pass_fds=pass_fds,
    )
    try:
        yield proc
    finally:
        kill_session(proc.pid)
        async with asyncio.timeout(30):
            await proc.communicate()


async def read_line(stream: asyncio.StreamReader | None, timeout: float = 30.0) -> str:
    assert stream is not None
    async with asyncio.timeout(timeout):
        line = await stream.readline()
    assert line, "end of output"
    return line.decode().strip()


async def rank_pids(uri: str, size: int) -> list[int]:
    async with asyncio.timeout(10), await Handle.connect(uri) as h:
        return [int(await h.attr_get("broker.pid", nodeid=r)) for r in range(size)]


@pytest.mark.slow
async def test_start_stops_the_instance_and_kills_a_command_ignoring_sigterm() -> None:
    """A rank dies while the command (and its child) ignore SIGTERM: the
    other ranks stop at once, alongside the command, which is killed with
    its whole process group after the stop timeout (``--stop-timeout``,
    15 s by default); start exits 1."""
    script = (
        'trap "" TERM; echo "$KVBROKER_URI"; sleep 300 & echo $!; '
        f"for r in 0 1 2; do {KVBROKER} attr get --rank $r broker.pid; done; "
        f"kill -9 $({KVBROKER} attr get --rank 3 broker.pid); wait; echo after"
    )
    # The stop timeout leaves the ranks time to exit on a loaded machine
    # before the command is killed, so the lingering it checks is not a race.
    async with start_process("--size", "4", "--fanout", "2", "--stop-timeout", "6",
                             "--", "sh", "-c", script) as proc:
        uri = await read_line(proc.stdout)
        sleep_pid = int(await read_line(proc.stdout))
        pids = [int(await read_line(proc.stdout)) for _ in range(3)]  # but rank 3's
        while "stopping" not in (line := await read_line(proc.stderr)):
            pass
        await all_gone(pids, "the other ranks to stop while the command lingers")
        assert alive(sleep_pid)  # ignoring SIGTERM, until killed
        assert line == "kvbroker: rank 3 exited unexpectedly, killed by signal 9 (SIGKILL); " \
            "stopping"
        async with asyncio.timeout(STOP_TIMEOUT):  # (6 s, not the default 15)
            out, _ = await proc.communicate()
        assert proc.returncode == 1
        assert "after" not in out.decode()
        await all_gone([sleep_pid], "the command's child to be killed with it")
        assert not os.path.exists(rundir_of(uri))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
async def test_start_passes_a_signal_to_the_commands_process_group(sig: int) -> None:
    """SIGINT, SIGTERM, SIGHUP to start reach the command and its children
    (a child the shell made ignore SIGINT is killed once the command is
    gone); start exits as the command did, having stopped the instance."""
    script = 'echo "$KVBROKER_URI"; sleep 300 & echo $!; wait $!; echo after'
    async with start_process("--size", "2", "--", "sh", "-c", script) as proc:
        uri = await read_line(proc.stdout)
        sleep_pid = int(await read_line(proc.stdout))
        pids = await rank_pids(uri, 2)
        proc.send_signal(sig)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
        assert proc.returncode == 128 + sig, err
        assert "after" not in out.decode()
        await all_gone([sleep_pid, *pids], "the command's child and the ranks to exit")
        assert not os.path.exists(rundir_of(uri))


async def test_start_serves_a_command_until_it_exits_on_sigterm() -> None:
    """The instance serves while the command handles the signal."""
    script = (
        f'trap "{KVBROKER} attr get size; exit 3" TERM; echo "$KVBROKER_URI"; '
        "sleep 300 & wait"
    )
    async with start_process("--size", "2", "--", "sh", "-c", script) as proc:
        uri = await read_line(proc.stdout)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            out, err = await proc.communicate()
        assert proc.returncode == 3, err
        assert out.decode().split() == ["2"]
        assert not os.path.exists(rundir_of(uri))


async def test_start_leaves_what_a_command_left_running() -> None:
    """A command that exits by itself is done: what it left in the
    background is its own business, as a shell's background jobs."""
    script = "sleep 300 >/dev/null 2>&1 & echo $!"  # not holding start's output open
    async with start_process("--", "sh", "-c", script) as proc:
        pid = int(await read_line(proc.stdout))
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        assert alive(pid)  # killed with start's session at exit


async def test_start_passes_its_file_descriptors_to_the_command(tmp_path) -> None:
    """As a shell does (``3>log``, a make jobserver)."""
    with open(tmp_path / "log", "w") as log:
        fd = log.fileno()
        write = f"import os; os.write({fd}, b'hello')"
        async with start_process("--", sys.executable, "-c", write, pass_fds=(fd,)) as proc:
            async with asyncio.timeout(30):
                _, err = await proc.communicate()
            assert proc.returncode == 0, err
    assert (tmp_path / "log").read_text() == "hello"


async def test_start_with_its_standard_streams_closed_runs_the_command(tmp_path) -> None:
    """``kvbroker start --size 2 -- CMD <&- >&- 2>&-`` (as a daemon may be
    started): the ranks inherited the closed stderr, died at their first
    log line, and ``start`` exited 2 without running CMD, saying why to the
    closed stderr.  Now the instance serves; CMD gets the closed streams,
    as from a shell (reading stdin fails), and its kvbroker commands work."""
    out = tmp_path / "out"
    script = (f'{KVBROKER} kvs put a=1 && {KVBROKER} kvs get a > {out} && '
              f'{{ {KVBROKER} kvs put -r b=- 2>> {out}; echo "put -r: $?" >> {out}; }}')
    proc = await asyncio.create_subprocess_exec(
        "sh", "-c", 'exec "$0" start --size 2 -- sh -c "$1" <&- >&- 2>&-', KVBROKER, script)
    async with asyncio.timeout(60):
        rc = await proc.wait()
    assert rc == 0
    assert out.read_text() == ("1\nkvbroker: kvs put: standard input: Bad file descriptor\n"
                               "put -r: 1\n")


@pytest.mark.parametrize("first,second", [(signal.SIGINT, signal.SIGINT),
                                          (signal.SIGTERM, signal.SIGINT)])
async def test_start_finishes_its_stop_despite_a_second_signal(first: int, second: int) -> None:
    """Ctrl-C twice, or SIGTERM then Ctrl-C: the second signal comes while
    start waits for a rank to stop (rank 1, held by SIGSTOP); start still
    stops every rank, removes the run directory and exits 0."""
    async with start_process("--size", "2") as proc:
        uri = await read_line(proc.stdout)
        pids = await rank_pids(uri, 2)
        os.kill(pids[1], signal.SIGSTOP)
        try:
            proc.send_signal(first)
            await all_gone(pids[:1], "rank 0 to stop")  # start is stopping
            proc.send_signal(second)
        finally:
            os.kill(pids[1], signal.SIGCONT)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert not alive(pids[1])
        assert not os.path.exists(rundir_of(uri))


async def test_a_killed_start_leaves_no_run_directory(tmp_path) -> None:
    """start SIGKILLed: its ranks exit (their launcher pipe closes) and the
    last of them removes the run directory -- never the statedir.  They
    say nothing on the stderr they shared with it: a follower telling its
    launcher ``parent-gone`` wrote a ``BrokenPipeError`` traceback there
    about every other time."""
    statedir = tmp_path / "state"
    async with start_process("--size", "4", "--fanout", "2", "--statedir", str(statedir)) as proc:
        uri = await read_line(proc.stdout)
        pids = await rank_pids(uri, 4)
        proc.kill()
        _, err = await proc.communicate()  # (until every rank has closed it too)
        await all_gone(pids, "the ranks to exit")
        assert not os.path.exists(rundir_of(uri))
        assert (statedir / "content.sqlite").exists()
        assert b"Traceback" not in err and b"Error" not in err, err


async def test_a_killed_starts_rundir_is_not_reused_until_its_ranks_are_out(tmp_path) -> None:
    """start SIGKILLed with a rank slow to exit (stopped here): a new start
    on the same run directory is refused while that rank holds it -- its
    rank 0, gone, no longer answers, which was the only check: the new
    start ran, and the old instance's last rank out then removed the
    directory, the new one's sockets with it (found by a review).  Once
    that rank is out, the directory is free again."""
    rundir = tmp_path / "run"
    async with start_process("--size", "4", "--fanout", "2", "--rundir", str(rundir)) as proc:
        uri = await read_line(proc.stdout)
        pids = await rank_pids(uri, 4)
        os.kill(pids[3], signal.SIGSTOP)
        try:
            proc.kill()
            await proc.wait()
            await all_gone(pids[:3], "the other ranks to exit")
            rc, out, err = await run_cli("start", "--rundir", str(rundir), "--", "true")
            assert (rc, out) == (2, ""), err
            assert "processes of another instance still hold it" in err, err
        finally:
            os.kill(pids[3], signal.SIGCONT)
        await all_gone(pids[3:], "the stopped rank to exit")
    assert not rundir.exists()  # (its last rank out removed it, as the launcher could not)
    rc, out, err = await run_cli("start", "--rundir", str(rundir), "--", "true")
    assert rc == 0, err


async def test_a_killed_start_kills_its_command() -> None:
    """start SIGKILLed: nothing of it runs to stop its command, so the
    kernel kills the command (its parent-death signal, Linux), as the ranks
    exit by themselves.  Before, the command ran on, its instance gone."""
    async with start_process("--size", "2", "--", "sh", "-c", "echo $$; exec sleep 300") as proc:
        pid = int(await read_line(proc.stdout))  # (sleep's too: exec keeps the pid)
        assert alive(pid)
        proc.kill()
        await all_gone([pid], "the command to be killed with start")


async def test_start_uri_file_appears_once_ready_and_goes_at_stop(tmp_path) -> None:
    """``start --uri-file`` without a command, in the background as a
    script runs it: the file appears (a whole line) once every rank
    answers, so the first thing read from it works at once, with no temp
    file left beside it; SIGTERM stops the instance and removes it."""
    path = tmp_path / "uri"
    async with start_process("--size", "4", "--fanout", "2", "--uri-file", str(path)) as proc:
        async def written() -> bool:
            return path.exists()

        await wait_until(written, "the URI file", 30)
        text = path.read_text()
        assert text.endswith("\n") and text.count("\n") == 1
        uri = text.strip()
        async with asyncio.timeout(10), await Handle.connect(uri) as h:
            assert [(await h.ping(r))["rank"] for r in range(4)] == [0, 1, 2, 3]
        assert await read_line(proc.stdout) == uri  # (stdout says so too)
        assert os.listdir(tmp_path) == ["uri"]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err
    assert not path.exists()
    assert os.listdir(tmp_path) == []
    assert not os.path.exists(rundir_of(uri))


async def test_start_uri_file_with_a_command(tmp_path) -> None:
    """With a command, the file holds its ``$KVBROKER_URI`` while it runs,
    and is gone once start has exited as the command did."""
    path = tmp_path / "uri"
    script = f'test "$(cat {path})" = "$KVBROKER_URI" && {KVBROKER} ping --count 1 1 && exit 7'
    rc, out, err = await run_cli("start", "--size", "2", "--uri-file", str(path),
                                 "--", "sh", "-c", script, timeout=60)
    assert rc == 7, err
    assert "rank=1" in out
    assert not path.exists()


async def test_start_removes_only_the_uri_file_it_wrote(tmp_path) -> None:
    """A file put in its place meanwhile (another instance's URI, say) is
    not start's to remove at stop."""
    path = tmp_path / "uri"
    async with start_process("--uri-file", str(path)) as proc:
        uri = await read_line(proc.stdout)
        assert path.read_text() == uri + "\n"
        other = tmp_path / "other"
        other.write_text("local:///elsewhere/local-0\n")
        os.replace(other, path)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            _, err = await proc.communicate()
        assert proc.returncode == 0, err
    assert path.read_text() == "local:///elsewhere/local-0\n"


async def test_start_writes_no_uri_file_when_the_instance_does_not_start(tmp_path) -> None:
    """A rank that fails during start-up: the instance never was ready, so
    no file (nor a temp file) is written."""
    path = tmp_path / "uri"
    rc, _, err = await run_cli("start", "--size", "2", "-S", "broker.modules=content,nosuch",
                               "--uri-file", str(path), "--", "true", timeout=60)
    assert rc == 2 and "during start-up" in err, err
    assert os.listdir(tmp_path) == []


async def test_start_uri_file_in_a_missing_directory_is_a_usage_error(tmp_path) -> None:
    """Refused before any rank starts: the module that would make rank 0
    fail at start-up is never loaded, and nothing is written."""
    for path, message in ((tmp_path / "nodir" / "uri", "no such directory"),
                          (tmp_path, "is a directory")):
        rc, _, err = await run_cli("start", "-S", "broker.modules=content,nosuch",
                                   "--uri-file", str(path), "--", "true")
        assert rc == 2, err
        assert err.startswith("usage: kvbroker start"), err
        assert f"--uri-file {path}: {message}" in err
        assert "start-up" not in err  # (no rank ran)
    assert os.listdir(tmp_path) == []


async def test_start_uri_file_that_is_not_a_regular_file_is_a_usage_error(tmp_path) -> None:
    """A FIFO, a device or a terminal (``/dev/null``, ``/dev/stdout``, a
    symlink to one) as ``--uri-file``: the file is written by renaming a new
    one over FILE, so start replaced the FIFO (or, run as root, the device
    node ``/dev/null`` itself) with a regular file, which a reader already
    waiting on the FIFO never saw, and then removed it at stop.  Refused
    before any rank starts; the FIFO and the link are left as they were."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "null"
    link.symlink_to(os.devnull)
    for path in (fifo, link):
        rc, _, err = await run_cli("start", "--uri-file", str(path), "--", "true")
        assert rc == 2, err
        assert err.startswith("usage: kvbroker start"), err
        assert f"--uri-file {path}: not a regular file" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.readlink(link) == os.devnull
    assert sorted(os.listdir(tmp_path)) == ["fifo", "null"]


TAKE_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)
COUNT_SIGINT = (
    "import signal, sys\n"
    "n = 0\n"
    "def count(*_):\n"
    "    global n\n"
    "    n += 1\n"
    "signal.signal(signal.SIGINT, count)\n"
    "print('ready', flush=True)\n"
    "print('got', sys.stdin.readline().strip(), flush=True)\n"
    "sys.stdin.readline()\n"
    "print('sigint', n, flush=True)\n"
)


async def test_start_in_a_terminal_leaves_the_terminal_to_the_command() -> None:
    """At a terminal's prompt (start the foreground job of its terminal),
    the command stays in start's process group: it reads the terminal (in a
    group of its own it would be stopped, SIGTTIN), and Ctrl-C reaches it
    from the terminal once -- start does not pass on a second."""
    import pty

    loop = asyncio.get_running_loop()
    master, slave = pty.openpty()
    output = bytearray()
    more = asyncio.Event()

    def on_output() -> None:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the terminal's last process is gone
            data = b""
        if not data:
            loop.remove_reader(master)
        output.extend(data)
        more.set()

    async def wait_for(text: bytes) -> None:
        async with asyncio.timeout(30):
            while text not in output:
                more.clear()
                await more.wait()

    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    loop.add_reader(master, on_output)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", TAKE_TERMINAL, KVBROKER, "start", "--size", "2", "--",
            sys.executable, "-c", COUNT_SIGINT,
            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
        )
        os.close(slave)
        try:
            await wait_for(b"ready")
            os.write(master, b"hello\n")
            await wait_for(b"got hello")
            os.write(master, b"\x03")  # Ctrl-C: SIGINT to the foreground job
            os.write(master, b"done\n")
            await wait_for(b"sigint 1")
            async with asyncio.timeout(30):
                assert await proc.wait() == 0, output.decode(errors="replace")
        finally:
            kill_session(proc.pid)
            await proc.wait()
    finally:
        loop.remove_reader(master)
        os.close(master)


# ---------------------------------------------------------------- client commands


async def test_exec_attaches_to_a_rank(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2)
    uri = inst.uri(0)
    async with asyncio.timeout(60):
        rc, out, err = await run_cli(
            "exec", "-r", "3", "--", KVBROKER, "attr", "get", "rank", uri=uri
        )
        assert (rc, out) == (0, "3\n"), err
        rc, out, err = await run_cli(
            "exec", "-r", "2", "--", "sh", "-c", 'echo "$KVBROKER_URI"', uri=uri
        )
        assert (rc, out.strip()) == (0, inst.uri(2)), err
        # "--" before the command is optional; one inside it is the command's
        rc, out, err = await run_cli("exec", "echo", "a", "--", "b", uri=uri)
        assert (rc, out) == (0, "a -- b\n"), err
        rc, _, err = await run_cli("exec", "-r", "9", "--", "true", uri=uri)
        assert rc == 1
        error_line(err, "exec", errno.EHOSTUNREACH)
        rc, _, err = await run_cli("exec", "--", "/nonexistent/cmd", uri=uri)
        assert rc == 127  # as a shell says it
        error_line(err, "/nonexistent/cmd", errno.ENOENT)
        rc, _, err = await run_cli("exec", "--", os.devnull, uri=uri)
        assert rc == 126
        error_line(err, os.devnull, errno.EACCES)
        rc, _, err = await run_cli("exec", "-r", "1", uri=uri)
        assert rc == 2 and err.startswith("usage: kvbroker exec") and "no command" in err


async def test_usage_errors_show_the_subcommands_usage() -> None:
    for args, usage in [
        (("ping", "--bogus"), "usage: kvbroker ping"),
        (("ping", "--count", "-2"), "usage: kvbroker ping"),
        (("ping", "--pad", "-5"), "usage: kvbroker ping"),
        (("event", "sub", "--count", "-1"), "usage: kvbroker event sub"),
        (("kvs", "get", "-Z", "a"), "usage: kvbroker kvs get"),
        (("attr", "get"), "usage: kvbroker attr get"),
    ]:
        rc, out, err = await run_cli(*args)
        assert (rc, out) == (2, ""), (args, err)
        assert err.startswith(usage), (args, err)



@pytest.mark.parametrize("args, message", [
    (("kvs", "get", "-w", "-c", "-1", "k"), "argument -c/--count: must not be negative: -1"),
    (("kvs", "eventlog", "get", "-w", "-c", "-3", "log"),
     "argument -c/--count: must not be negative: -3"),
    (("kvs", "eventlog", "wait-event", "-t", "-1", "log", "start"),
     "argument -t/--timeout: must be a positive number of seconds: -1"),
    (("kvs", "eventlog", "wait-event", "-t", "nan", "log", "start"),
     "argument -t/--timeout: must be a positive number of seconds: nan"),
    # a Flux duration's unit is read (-t 2m), an unknown one is not
    (("kvs", "eventlog", "wait-event", "-t", "5x", "log", "start"),
     "argument -t/--timeout: invalid number of seconds: '5x' (or a duration: 500ms, 2s, "
     "1m, 1h, 1d)"),
    (("kvs", "eventlog", "wait-event", "-t", "0ms", "log", "start"),
     "argument -t/--timeout: must be a positive number of seconds: 0ms"),
    (("overlay", "status", "--timeout", "-1"),
     "argument --timeout/-t: must be a positive number of seconds: -1"),
    (("overlay", "status", "--timeout", "0"),
     "argument --timeout/-t: must be a positive number of seconds: 0"),
    (("kvs", "namespace", "create", "-o", "-5", "ns"),
     "argument -o/--owner: must not be negative: -5"),
    (("rpc", "broker.ping", "--rank", "-5"), "argument --rank/-r: must not be negative: -5"),
    (("attr", "get", "rank", "--rank", "-1"), "argument --rank/-r: must not be negative: -1"),
    (("attr", "list", "--rank", "-1"), "argument --rank/-r: must not be negative: -1"),
    (("module", "list", "--rank", "-2"), "argument --rank/-r: must not be negative: -2"),
    (("stats", "kvs", "--rank", "-2"), "argument --rank/-r: must not be negative: -2"),
    (("exec", "-r", "-1", "true"), "argument -r/--rank: must not be negative: -1"),
    # numbers no message can carry, or that name no rank or user (were
    # msgpack tracebacks, or "any rank" answered by the local one)
    (("ping", str(1 << 80)), f"argument RANK: must be at most 4294967293: {1 << 80}"),
    (("ping", "4294967295"), "argument RANK: must be at most 4294967293: 4294967295"),
    (("rpc", "broker.ping", "-r", "4294967294"),
     "argument --rank/-r: must be at most 4294967293: 4294967294"),
    (("exec", "-r", str(1 << 64), "true"),
     f"argument -r/--rank: must be at most 4294967293: {1 << 64}"),
    (("shutdown", "-r", str(1 << 64)),
     f"argument --rank/-r: must be at most 4294967293: {1 << 64}"),
    (("kvs", "wait", str(1 << 64)),
     f"argument VERSION: must be at most {(1 << 63) - 1}: {1 << 64}"),
    (("kvs", "namespace", "create", "-o", "4294967295", "ns"),
     "argument -o/--owner: must be at most 4294967294: 4294967295"),
])
async def test_negative_counts_ranks_and_timeouts_are_usage_errors(args, message) -> None:
    """Refused before anything is sent (were: a count of -1 printing and
    exiting 0, a timeout expiring at once, the broker's EPROTO or EHOSTUNREACH)."""
    rc, out, err = await run_cli(*args, uri="local:///nonexistent/socket")
    assert (rc, out) == (2, ""), err
    assert err.startswith(f"usage: kvbroker {args[0]} "), err
    assert err.rstrip().endswith(f": error: {message}"), err


@pytest.mark.parametrize("sub, args, message", [
    ("kvs get", ("-w", "-a", '{"ver":1,"type":"dirref","data":["x"]}', "k"),
     "--at cannot be combined with --watch, --waitcreate or --stream"),
    ("kvs get", ("-w", "-S", "k"), "--watch and --stream cannot be combined"),
    ("kvs eventlog get", ("-w", "-S", "log"), "--watch and --stream cannot be combined"),
    ("kvs put", ("-A", "-t", 'k={"ver":1,"type":"val","data":"eA=="}'),  # (was: replaced k)
     "--append cannot be combined with --treeobj (a tree object replaces the entry)"),
    ("rpc", ("broker.ping", "notjson"),
     "argument PAYLOAD-JSON: not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    ("event pub", ("job.x", "{not json"), "argument PAYLOAD-JSON: not valid JSON: "
     "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    # beyond JSON, or beyond msgpack: echoed by event sub as NaN, or a traceback
    ("event pub", ("job.x", "NaN"),
     "argument PAYLOAD-JSON: not valid JSON: NaN: not a finite number (JSON has no nan or "
     "infinity)"),
    ("event pub", ("job.x", "[1e400]"),
     "argument PAYLOAD-JSON: not valid JSON: 1e400: not a finite number (JSON has no nan "
     "or infinity)"),
    ("rpc", ("broker.ping", '{"n": 123456789012345678901234567890}'),
     "argument PAYLOAD-JSON: not valid JSON: Integer value out of range"),
    ("kvs eventlog get", ("-u", "-H", "log"),
     "--unformatted cannot be combined with --human or --color=always"),
    ("kvs eventlog wait-event", ("-u", "-L", "log", "x"),
     "--unformatted cannot be combined with --human or --color=always"),
    ("kvs eventlog get", ("--color=sometimes", "log"),
     "argument --color: invalid choice: 'sometimes' (choose from 'auto', 'always', 'never')"),
    ("start", ("--size", "0", "--", "true"), "--size must be at least 1 (got 0)"),
    ("start", ("--fanout", "0", "--", "true"), "--fanout must be at least 1 (got 0)"),
    ("start", ("--size", str(1 << 80), "--", "true"),  # (was: memory exhausted)
     f"--size must be at most 4096, each rank a process on this host (got {1 << 80}); "
     "across hosts: kvbroker broker"),
])
async def test_option_conflicts_and_bad_payloads_are_usage_errors(sub, args, message) -> None:
    """Exit 2 with the subcommand's usage, in the options' own names, before
    anything is sent (were exit 1, some without the command's name, one in
    kvs-watch's flag names: 'WATCH and STREAM cannot be combined')."""
    rc, out, err = await run_cli(*sub.split(), *args, uri="local:///nonexistent/socket")
    assert (rc, out) == (2, ""), err
    assert err.startswith(f"usage: kvbroker {sub} "), err
    assert err.rstrip().endswith(f"kvbroker {sub}: error: {message}"), err


async def test_errors_say_what_and_strerror(start_instance) -> None:
    inst = await start_instance(size=2, fanout=2)
    uri = inst.uri(0)
    async with asyncio.timeout(60):
        rc, out, err = await run_cli("ping", "99", uri=uri)
        assert rc == 1 and out == ""
        error_line(err, "ping", errno.EHOSTUNREACH)
        rc, _, err = await run_cli("attr", "get", "nosuch", uri=uri)
        assert rc == 1
        error_line(err, "attr get", errno.ENOENT)
        rc, _, err = await run_cli("rpc", "nosuch.method", uri=uri)
        assert rc == 1
        error_line(err, "nosuch.method", errno.ENOSYS)
        rc, _, err = await run_cli("rpc", "attr.get", '{"name": 5}', uri=uri)
        assert rc == 1
        error_line(err, "attr.get", errno.EPROTO)
        rc, _, err = await run_cli("stats", "nosuch", uri=uri)
        assert rc == 1
        error_line(err, "stats nosuch", errno.ENOSYS)


async def test_attr_set_changes_a_ranks_log_level_at_once(start_instance, connect) -> None:
    """``attr set log.level`` on one rank: that rank logs at the new level
    from the next line on (its log shows a line only INFO lets through),
    the others keep theirs; ``--all`` reaches every rank."""
    inst = await start_instance(size=4, fanout=2)
    assert inst.stderr_path is not None
    h = await connect(inst, 0)
    uri = inst.uri(0)
    async with asyncio.timeout(60):
        rc, out, err = await run_cli("attr", "set", "log.level", "info", "--rank", "2", uri=uri)
        assert (rc, out, err) == (0, "", "")
        assert [await h.attr_get("log.level", nodeid=r) for r in range(4)] == [
            "warning", "warning", "info", "warning"]
        # rank 2 logs the change (INFO), at the level it has just taken
        log = inst.stderr_path

        async def logged() -> bool:
            with open(log) as f:
                return "kvbroker[2]: INFO kvbroker: attribute log.level set to info" in f.read()

        await wait_until(logged, "rank 2 to log at INFO")
        rc, out, err = await run_cli("attr", "set", "log.level", "ERROR", "--all", uri=uri)
        assert rc == 0, err
        # read back as the start keeps it (-S log.level=ERROR reads error), not as typed
        assert [await h.attr_get("log.level", nodeid=r) for r in range(4)] == ["error"] * 4


@pytest.mark.parametrize("args, errnum, says", [
    (("nosuch", "1"), errno.ENOENT, "unknown attribute 'nosuch'"),
    (("size", "3"), errno.EINVAL, "size may not be changed on a running rank"),
    (("statedir", "x"), errno.EINVAL,
     "statedir may not be changed on a running rank (set it at start with --statedir DIR)"),
    (("tbon.transport", "tcp"), errno.EINVAL, "tbon.transport may not be changed"),
    # a loaded module's: its reload takes it, which the hint says too
    (("kvs.cache-bytes", "1000"), errno.EINVAL,
     "kvs.cache-bytes may not be changed on a running rank (set it at start: -S "
     "kvs.cache-bytes=VALUE; or give it to a reload: kvbroker module reload kvs "
     "cache-bytes=VALUE)"),
    # rank 0's content module is loaded for the instance's life: no reload
    # (it named one, which is refused)
    (("content.cache-bytes", "1000"), errno.EINVAL,
     "content.cache-bytes may not be changed on a running rank (set it at start: -S "
     "content.cache-bytes=VALUE))\n"),
    (("log.level", "loud"), errno.EINVAL, "log.level: unknown level 'loud'"),
    (("tbon.torpid_min", "0"), errno.EINVAL, "tbon.torpid_min: must be at least 0.1"),
    (("tbon.torpid_min", "0.0000001"), errno.EINVAL, "tbon.torpid_min: must be at least 0.1"),
    # 30 (the default torpid_max) is not more than twice 20: refused on
    # every rank, and the error names them all
    (("tbon.torpid_min", "20", "--all"), errno.EINVAL, "tbon.torpid_max: 30 must be 0"),
])
async def test_attr_set_refuses_with_the_reason_and_changes_nothing(
        start_instance, connect, args, errnum: int, says: str) -> None:
    inst = await start_instance(size=2, fanout=2)
    h = await connect(inst, 0)
    before = [{n: await h.attr_get(n, nodeid=r) for n in ("log.level", "tbon.torpid_min")}
              for r in range(2)]
    async with asyncio.timeout(30):
        rc, out, err = await run_cli("attr", "set", *args, uri=inst.uri(0))
    assert (rc, out) == (1, ""), err
    # (with --all, every rank refuses, and the error names them: ranks 0-1)
    error_line(err, "attr set: ranks 0-1" if "--all" in args else "attr set", errnum)
    assert says in err, err
    after = [{n: await h.attr_get(n, nodeid=r) for n in ("log.level", "tbon.torpid_min")}
             for r in range(2)]
    assert after == before


async def test_connection_errors_name_the_uri(tmp_path) -> None:
    """Which URI could not be reached, and that it came from KVBROKER_URI
    (was: ``cannot connect to broker: Connection refused``, alone)."""
    from broker.launch import Instance

    async with Instance(1) as inst:
        stale = inst.uri(0)
    enoent = os.strerror(errno.ENOENT)
    # (a directory is said to be one: tests/test_flux_conformance_t0010.py)
    for uri, what, detail in [
        ("local:///nonexistent/socket", "ping", enoent),
        ("garbage", "ping", enoent),
        (stale, "attr get", enoent),  # the instance has stopped
    ]:
        args = ("attr", "get", "rank") if what == "attr get" else (what,)
        rc, out, err = await run_cli(*args, uri=uri)
        assert (rc, out) == (1, ""), err
        assert err.startswith(f"kvbroker: {what}: cannot connect to broker at "
                              f"KVBROKER_URI={uri}: {detail} ("), err
        if detail == enoent:  # (or not up yet: a rank waiting for its parent has no socket)
            assert "or is that rank still waiting for its parent" in err, err
    rc, _, err = await run_cli("ping", uri="tcp://host:1")
    assert err.strip() == ("kvbroker: ping: cannot connect to broker at "
                           "KVBROKER_URI=tcp://host:1: unsupported broker URI scheme: "
                           "'tcp://host:1'")
    rc, _, err = await run_cli("ping")
    assert rc == 1
    assert err.startswith("kvbroker: ping: cannot connect to broker: KVBROKER_URI is not set")


@pytest.mark.parametrize("command", [
    ("attr", "get", "-t", "1", "size"),
    ("exec", "-t", "1", "-r", "all", "true"),
    ("exec", "--bg", "-t", "1", "true"),
    ("groups", "waitfor", "-t", "1", "-c", "1", "g"),
    ("groups", "get", "-w", "-t", "1", "broker.online"),
    ("rpc", "--stream", "-t", "1", "broker.ping"),
], ids=lambda c: " ".join(c[:2]))
async def test_a_timeout_while_connecting_says_so(command: tuple[str, ...], tmp_path) -> None:
    """A command whose ``-t`` bounds it whole, given up while connecting to
    a host that never answers, says it could not connect, naming the URI,
    as a connect's own timeout does (it said ``no answer in 1s: stopped or
    hung?``, a rank's fault, when no rank had been reached)."""
    from test_broker_support import unanswering_ssh

    uri = "ssh://nohost/tmp/kvb-x/local-0"
    rc, out, err = await run_cli(*command, uri=uri, env=unanswering_ssh(tmp_path), timeout=10)
    assert (rc, out) == (1, ""), err
    assert err.endswith(f"cannot connect to broker at KVBROKER_URI={uri}: "
                        f"{os.strerror(errno.ETIMEDOUT)} (no answer in 1s)\n"), err


async def test_client_commands(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    uri = inst.uri(0)
    async with asyncio.timeout(60):
        rc, out, err = await run_cli("ping", "--count", "2", "--pad", "100", "2", uri=uri)
        assert rc == 0 and len(out.splitlines()) == 2, err
        assert out.startswith("rank=2 route=")

        rc, out, err = await run_cli("rpc", "broker.ping", '{"a": [1, 2]}', "--rank", "3", uri=uri)
        assert rc == 0, err
        resp = json.loads(out)
        assert resp["a"] == [1, 2] and resp["rank"] == 3

        rc, out, err = await run_cli("attr", "list", "--rank", "1", uri=uri)
        assert rc == 0, err
        attrs = dict((line.split(None, 1) + [""])[:2] for line in out.splitlines())
        assert attrs["rank"] == "1" and attrs["size"] == "4" and attrs["fanout"] == "2"
        assert attrs["statedir"] == "" and attrs["rundir"] == inst.rundir
        # one column of values, however long the names
        columns = {len(line) - len(line.split(None, 1)[1])
                   for line in out.splitlines() if len(line.split(None, 1)) == 2}
        assert len(columns) == 1, out

        rc, out, err = await run_cli("module", "list", uri=uri)
        assert rc == 0, err
        assert out.splitlines()[0].split() == ["Module", "Requests", "Services"]
        assert any(line.startswith("content ") for line in out.splitlines())
        rc, out, err = await run_cli("module", "list", "--json", "--rank", "2", uri=uri)
        assert rc == 0, err
        assert "broker" in {m["name"] for m in json.loads(out)["modules"]}

        rc, out, err = await run_cli("stats", "broker", "--rank", "1", uri=uri)
        assert rc == 0, err
        s = json.loads(out)
        assert s["rank"] == 1 and s["overlay"]["children"] == [3]

        data = bytes(range(256)) * 100
        rc, out, err = await run_cli("content", "store", uri=uri, input=data)
        assert rc == 0, err
        blobref = out.strip()
        assert re.fullmatch(r"sha256-[0-9a-f]{64}", blobref)
        proc = await asyncio.create_subprocess_exec(
            KVBROKER,
            "content",
            "load",
            blobref,
            stdout=asyncio.subprocess.PIPE,
            env=dict(os.environ, KVBROKER_URI=inst.uri(3)),
        )
        loaded, _ = await proc.communicate()
        assert proc.returncode == 0 and loaded == data


async def test_event_pub_and_sub(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(60):
        watcher = await connect(inst, 3)
        st = await stats(watcher)
        clients, subs = st["clients"], client_subscriptions(st)
        env = dict(os.environ, KVBROKER_URI=inst.uri(3))
        sub = await asyncio.create_subprocess_exec(
            KVBROKER,
            "event",
            "sub",
            "--count",
            "2",
            "cli.a",
            "cli.b",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:

            async def subscribed() -> bool:
                s = await stats(watcher)  # (the client's own two, not rank 3's modules')
                return s["clients"] == clients + 1 and client_subscriptions(s) >= subs + 2

            await wait_until(subscribed, "kvbroker event sub to subscribe", timeout=20)
            rc, out, err = await run_cli("event", "pub", "-v", "cli.other", uri=inst.uri(1))
            assert rc == 0, err
            first = int(out)
            # (-s, Flux's "synchronous", is what pub always does)
            rc, out, err = await run_cli("event", "pub", "-s", "cli.a.x", '{"n": 1}',
                                         uri=inst.uri(1))
            assert (rc, out) == (0, ""), err
            rc, out, err = await run_cli(
                "event", "pub", "-v", "--private", "cli.b", uri=inst.uri(0)
            )
            assert rc == 0 and int(out) > first, err
            out_b, err_b = await sub.communicate()
            assert sub.returncode == 0, err_b
            assert out_b.decode().splitlines() == ['cli.a.x\t{"n": 1}', "cli.b\tnull"]
        finally:
            if sub.returncode is None:
                sub.kill()
                await sub.wait()


async def test_count_0_means_until_interrupted(start_instance, connect) -> None:
    """``ping -c 0`` and ``event sub -c 0`` go on until stopped, as Flux's
    (they printed nothing and exited 0)."""
    inst = await start_instance(size=2, fanout=2)
    env = dict(os.environ, KVBROKER_URI=inst.uri(1))
    h = await connect(inst, 1)
    procs = []
    try:
        async with asyncio.timeout(30):
            for args in (("ping", "-c", "0", "0"), ("event", "sub", "-c", "0", "cz.")):
                procs.append(await asyncio.create_subprocess_exec(
                    KVBROKER, *args, stdout=asyncio.subprocess.PIPE, env=env))
            ping, sub = procs
            assert ping.stdout is not None and sub.stdout is not None
            for _ in range(5):
                assert (await ping.stdout.readline()).startswith(b"rank=0 ")

            async def subscribed() -> bool:
                subs = (await stats(h, 1))["subscriptions"]
                return any(peer.startswith("c") for peer in subs)

            await wait_until(subscribed, "kvbroker event sub to subscribe", timeout=20)
            for n in range(3):
                await h.publish("cz.x", n)
                assert await sub.stdout.readline() == f"cz.x\t{n}\n".encode()
            assert ping.returncode is None and sub.returncode is None
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def spawn_to_closed_pipe(uri: str, *args: str) -> asyncio.subprocess.Process:
    """``kvbroker ARGS`` whose standard output is a pipe nobody reads (as
    ``... | head -1`` once head has exited): its first write fails."""
    r, w = os.pipe()
    os.close(r)
    try:
        return await asyncio.create_subprocess_exec(
            KVBROKER, *args, stdout=w, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL, env=dict(os.environ, KVBROKER_URI=uri))
    finally:
        os.close(w)


async def test_a_reader_leaving_mid_value_is_a_closed_stdout(start_instance) -> None:
    """``kvs get -r big | head -c 10``: the reader takes a little and goes.
    Python's buffered write then returns the part it wrote instead of
    raising, and the command exited 0 with the rest silently lost; it now
    ends as for any closed output (141).  Piped whole, nothing is lost."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    big = b"0123456789abcdef" * (256 << 10)  # 4 MiB, far beyond a pipe's 64 KiB
    rc, _, err = await run_cli("kvs", "put", "-r", "big=-", uri=uri, input=big)
    assert rc == 0, err
    r, w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "kvs", "get", "-r", "big", stdout=w, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL, env=dict(os.environ, KVBROKER_URI=uri))
    finally:
        os.close(w)
    try:
        first = await asyncio.wait_for(
            asyncio.get_running_loop().run_in_executor(None, os.read, r, 10), 30)
    finally:
        os.close(r)  # as head -c 10 does once it has its bytes
    assert first == big[:len(first)]
    _, err_b = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, err_b) == (141, b"")
    rc, out, err = await run_cli("kvs", "get", "-r", "big", uri=uri)
    assert rc == 0 and out.encode() == big


async def test_a_closed_stdout_ends_every_command_quietly(start_instance) -> None:
    """``cmd | head -1``: exit 141 (128 + SIGPIPE) and nothing on stderr, as a
    command killed by SIGPIPE -- was ``kvbroker: kvs dir: Broken pipe``, exit 1."""
    inst = await start_instance(size=2, fanout=2)
    uri = inst.uri(0)
    async with asyncio.timeout(60):
        rc, _, err = await run_cli("kvs", "put", "a.b=1", "a.c=2", "k=v", uri=uri)
        assert rc == 0, err
        for args in (("kvs", "dir"), ("kvs", "ls", "-R"), ("attr", "list"),
                     ("kvs", "get", "-w", "k"), ("ping", "--count", "3"),
                     ("dmesg",), ("dmesg", "--follow"),  # (rank 0 has kept a record)
                     ("kvs", "dump", "-")):  # (was `kvs dump: archive: Broken pipe`, 1)
            proc = await spawn_to_closed_pipe(uri, *args)
            _, err_b = await proc.communicate()
            assert (proc.returncode, err_b) == (141, b""), args

        # (a command that streams ends before any event or change comes:
        # test_a_watch_ends_when_its_reader_leaves_without_waiting_for_a_change)
        sub = await spawn_to_closed_pipe(uri, "event", "sub", "pipe.test")
        _, err_b = await sub.communicate()
        assert (sub.returncode, err_b) == (141, b"")


async def _spawn_into_pipe(w: int, args: tuple[str, ...], uri: str,
                           loop: str) -> asyncio.subprocess.Process:
    """``kvbroker ARGS`` on ``loop`` with its standard output the pipe end
    ``w``, which is closed here (the command holds it now)."""
    try:
        return await asyncio.create_subprocess_exec(
            KVBROKER, *args, stdout=w, stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env=dict(os.environ, KVBROKER_URI=uri, KVBROKER_EVENT_LOOP=loop))
    finally:
        os.close(w)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_a_watch_ends_when_its_reader_leaves_without_waiting_for_a_change(
        start_instance, connect, loop) -> None:
    """``kvs get --watch k | head -1``: head exits after the first value.
    The command learned it only from its next write, so it held its watch
    on the rank until ``k`` changed again, which may be never; it now ends
    at once (141, nothing on stderr, as for a failed write), and the rank
    drops the watch.  ``event sub`` and ``dmesg --follow`` alike."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    h = await connect(inst, 0)
    async with asyncio.timeout(60):
        rc, _, err = await run_cli("kvs", "put", "k=v", uri=uri)
        assert rc == 0, err
        rc, _, err = await run_cli("logger", "a record for dmesg", uri=uri)
        assert rc == 0, err
        for args, first in ((("kvs", "get", "--watch", "k"), b"v\n"),
                            (("event", "sub", "reader."), b"reader.x\tnull\n"),
                            (("dmesg", "--follow"), None)):
            r, w = os.pipe()
            proc = await _spawn_into_pipe(w, args, uri, loop)
            with os.fdopen(r, "rb", 0) as reader:
                if args[0] == "event":  # (once subscribed: published before, it is not seen)
                    await wait_until(lambda: _client_subscribed(h), "event sub to subscribe")
                    rc, _, err = await run_cli("event", "pub", "reader.x", uri=uri)
                    assert rc == 0, err
                line = await asyncio.to_thread(reader.readline)
                assert first is None or line == first, (args, line)
            # (the reader is gone; nothing more is written, committed or published)
            _, err_b = await proc.communicate()
            assert (proc.returncode, err_b) == (141, b""), args

        async def unwatched() -> bool:
            return int((await h.rpc("kvs-watch.stats-get", {}))["watchers"]) == 0

        await wait_until(unwatched, "the rank to drop the watch")


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_a_watching_command_writes_whole_values_into_a_pipe_and_leaves_it_blocking(
        start_instance, loop) -> None:
    """Watching for the pipe's reader to leave must not make the pipe
    non-blocking (uvloop's add_reader did): a value bigger than the room
    left in the pipe was cut to it, the rest lost and the exit status 0,
    and a writer after the command into the same pipe failed with EAGAIN."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    value = b"a" * 100_000 + b"z"
    async with asyncio.timeout(60):
        rc, _, err = await run_cli("kvs", "put", "-r", "txt=-", uri=uri, input=value)
        assert rc == 0, err
        for args in (("kvs", "get", "--watch", "--count", "1", "txt"),
                     ("kvs", "get", "--waitcreate", "txt")):
            r, w = os.pipe()
            shell_end = os.dup(w)  # (the shell's, which the writers after it share)
            proc = await _spawn_into_pipe(w, args, uri, loop)
            with os.fdopen(r, "rb") as reader:
                read = asyncio.ensure_future(asyncio.to_thread(reader.read))
                try:
                    _, err_b = await proc.communicate()
                    blocking = os.get_blocking(shell_end)
                finally:
                    os.close(shell_end)  # (the reader's EOF)
                assert (proc.returncode, err_b, blocking) == (0, b"", True), args
                assert await read == value + b"\n", args


async def test_event_sub_prints_whatever_another_client_publishes(start_instance,
                                                                    connect) -> None:
    """A msgpack timestamp (the one ext type besides ours a payload may
    hold), or a payload nested deeper than Python's recursion limit,
    published by someone else, made ``event sub`` die with a traceback.
    A tab or a newline in a topic broke its line, a NaN was printed bare
    (no JSON), a bytes key as ``"b'k'"`` (a pub/sub probe)."""
    import msgpack

    inst = await start_instance(size=1)
    uri = inst.uri(0)
    h = await connect(inst, 0)
    deep: object = 1
    for _ in range(1000):
        deep = [deep]
    async with asyncio.timeout(60):
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "event", "sub", "--count", "5", "odd.", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=dict(os.environ, KVBROKER_URI=uri))
        await wait_until(lambda: _client_subscribed(h), "event sub to subscribe")
        await h.publish("odd.ts", {"t": msgpack.Timestamp(1, 500_000)})
        await h.publish("odd.deep", {"d": deep})
        await h.publish("odd.plain", {"n": 1})
        await h.publish("odd.a\tb\nc", {"x": float("nan"), "y": [float("-inf")]})
        await h.publish("odd.keys", {b"k": 1, 2: b"\x00\xff"})
        out, err = await proc.communicate()
    assert (proc.returncode, err) == (0, b"")
    assert out.decode().splitlines() == [
        'odd.ts\t{"t": "1970-01-01T00:00:01.000500+00:00"}',
        'odd.deep\t"<payload nested too deep to print as JSON>"',
        'odd.plain\t{"n": 1}',
        "'odd.a\\tb\\nc'\t{\"x\": \"NaN\", \"y\": [\"-Infinity\"]}",
        'odd.keys\t{"k": 1, "2": "AP8="}']


async def _client_subscribed(h: Handle) -> bool:
    """Whether a client of ``h``'s rank holds an event subscription."""
    return client_subscriptions(await stats(h)) >= 1


@pytest.mark.parametrize("args, listed", [
    ((), ("start ", "kvs ", "shutdown ")),
    (("kvs",), ("get ", "put ", "gc ", "namespace ")),
    (("kvs", "namespace"), ("create ", "remove ", "list ")),
])
async def test_a_command_without_its_subcommand_lists_them(args, listed) -> None:
    """It said only "the following arguments are required: COMMAND"."""
    rc, out, err = await run_cli(*args)
    assert rc == 2 and out == ""
    assert all(re.search(rf"\n    {name.strip()}\b", err) for name in listed), err
    assert err.endswith(f"{' '.join(('kvbroker', *args))}: error: the following arguments "
                        f"are required: {'SUBCOMMAND' if args else 'COMMAND'}\n")


@pytest.mark.parametrize(("argv", "word"), [
    (["ping", "3"], "ping"),
    (["--event-loop", "asyncio", "kvs", "get", "a"], "kvs"),
    (["--version"], None),
    ([], None),
    (["--event-loop"], None),
])
def test_the_command_word_skips_top_level_options(argv: list[str], word: str | None) -> None:
    """What decides whether plugins' commands are loaded (only when the
    word is not a built-in command's)."""
    assert cli.command_word(argv) == word
    parser = cli.build_parser(word)
    action = cli.subparsers(parser)
    assert action is not None
    names = action.choices
    assert "start" in names
    assert ("kvs" in names) == (word != "ping")


def subcommand_levels(parser: argparse.ArgumentParser, argv: list[str]) -> list[set[str]]:
    """The subcommand names each level of ``parser`` holds along ``argv``'s
    command words: ``[{"kvs", ...}, {"get", ...}]``."""
    levels, words = [], iter(cli.command_words(argv))
    while (action := cli.subparsers(parser)) is not None:
        levels.append(set(action.choices))
        if (word := next(words, None)) not in action.choices:
            break
        parser = action.choices[word]
    return levels


@pytest.mark.parametrize(("argv", "levels"), [
    (["kvs", "get", "a"], [{"kvs"}, {"get"}]),
    (["--event-loop", "asyncio", "kvs", "namespace", "create", "-o", "5", "job"],
     [{"kvs"}, {"namespace"}, {"create"}]),
    (["ping", "--count", "3", "7"], [{"ping"}]),
    (["attr", "get", "rank"], [{"attr"}, {"get"}]),
    (["exec", "-r", "all", "--", "kvs", "get"], [{"exec"}]),
])
def test_a_command_line_builds_only_the_parsers_it_runs(
        argv: list[str], levels: list[set[str]]) -> None:
    """Building every parser took ~50 ms of a ~180 ms ``kvbroker kvs get``;
    now only the named command's, level by level, and it parses as the
    whole parser does."""
    parser = cli.parser_for(argv)
    assert subcommand_levels(parser, argv) == levels

    def parsed(p: argparse.ArgumentParser) -> dict[str, str]:
        args, extra = p.parse_known_args(argv)
        assert extra == []
        return {k: str(v) for k, v in vars(args).items()}  # (a RankSet: by its str)

    assert parsed(parser) == parsed(cli.build_parser())


@pytest.mark.parametrize("argv", [
    ["kvs", "bogus"],  # no such subcommand: the error lists them all
    ["bogus"],
    ["kvs"],  # no subcommand: the help lists them all
    [],
])
def test_a_command_line_that_names_no_subcommand_gets_the_whole_parser(argv: list[str]) -> None:
    """At the level where the command line names no subcommand, or one
    that is not, every subcommand is built: for the help, or for the
    error, that lists them."""
    last = subcommand_levels(cli.parser_for(argv), argv)[-1]
    assert last == subcommand_levels(cli.build_parser(), argv)[-1]
    assert len(last) > 10


async def test_an_unknown_subcommand_is_refused_with_the_list_of_them() -> None:
    rc, out, err = await run_cli("kvs", "bogus")
    assert rc == 2 and out == ""
    assert "kvbroker kvs: error: argument SUBCOMMAND: invalid choice: 'bogus' (choose from " \
        "'get', 'put'," in err, err


_CTRL_C_IN_IMPORT = """
import os, signal, sys

def interrupt_its_import(event, args):
    if event == "import" and args[0] == "broker.cli":  # a Ctrl-C as it is imported
        os.kill(os.getpid(), signal.SIGINT)

sys.addaudithook(interrupt_its_import)
import runpy
sys.argv = [sys.argv[1], "--version"]
runpy.run_path(sys.argv[0], run_name="__main__")  # the console script pip made
"""


async def test_a_ctrl_c_while_the_command_line_is_imported_exits_130_quietly() -> None:
    """The console script imported broker.cli before anything caught a
    KeyboardInterrupt: a Ctrl-C in the first ~50-180 ms printed a traceback.
    (The script run is the one pip made from pyproject.toml's entry point.)"""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CTRL_C_IN_IMPORT, KVBROKER, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, out, err) == (130, b"", b"")


def test_the_bundled_commands_are_the_distributions_entry_points() -> None:
    """``kvbroker kvs`` loads its registrar from plugins.BUNDLED_COMMANDS,
    without the entry-point scan: the table must say what pyproject.toml
    declares, and a bundled command is built alone."""
    from importlib.metadata import entry_points

    from broker import plugins

    declared = {ep.name: ep.value for ep in entry_points(group=plugins.COMMANDS_GROUP)
                if ep.dist is not None and ep.dist.name == "kvbroker"}
    assert declared == plugins.BUNDLED_COMMANDS
    for name in plugins.BUNDLED_COMMANDS:
        assert list(plugins.command_registrars(name)) == [name]


async def test_start_takes_flux_s_broker_opts_and_test_size() -> None:
    """A Flux command line runs as written: ``flux start -o,-Sa=1 --test-size
    2`` gives the brokers ``-S a=1``; ``-S`` given directly wins; any other
    broker option is a usage error naming it (it was "unrecognized
    arguments")."""
    script = f"{KVBROKER} attr get my.a; {KVBROKER} attr get my.b; {KVBROKER} attr get size"
    rc, out, err = await run_cli("start", "--test-size", "2", "-o,-Smy.a=1,-S,my.b=2",
                                 "--", "sh", "-c", script)
    assert (rc, out.split()) == (0, ["1", "2", "2"]), err
    # Flux's tests' idiom: no rc scripts (kvbroker runs none), a stderr level
    rc, out, err = await run_cli(
        "start", "-o,-Sbroker.rc1_path=,-Sbroker.rc3_path=,-Slog-stderr-level=7", "--",
        "sh", "-c", f"{KVBROKER} attr get log.level")
    assert (rc, out) == (0, "debug\n"), err
    rc, out, err = await run_cli("start", "--broker-opts=--setattr=my.a=1", "-S", "my.a=3",
                                 "-S", "my.b=x", "--", "sh", "-c", script)
    assert (rc, out.split()) == (0, ["3", "x", "1"]), err
    rc, out, err = await run_cli("start", "-o,-v", "--", "true")
    assert (rc, out) == (2, ""), err
    assert "error: -o,-v: '-v' is not taken: only -S ATTR=VAL" in err, err


def test_flux_s_command_spellings_resolve_to_ours() -> None:
    """``flux getattr``/``setattr``/``lsattr`` and ``flux module stats``
    were "invalid choice"; each is the command spelled here, options and
    the top-level ``--event-loop`` kept in place."""
    assert cli.resolve_alias(["getattr", "rank", "-r", "1"]) == (
        ["attr", "get", "rank", "-r", "1"], "getattr")
    assert cli.resolve_alias(["--event-loop", "asyncio", "lsattr", "-v"]) == (
        ["--event-loop", "asyncio", "attr", "list", "-v"], "lsattr")
    assert cli.resolve_alias(["module", "stats", "kvs", "-r", "1"]) == (
        ["stats", "kvs", "-r", "1"], "module stats")
    assert cli.resolve_alias(["content", "checkpoint", "list"]) == (
        ["kvs", "checkpoint", "list"], "content checkpoint")
    assert cli.resolve_alias(["dump", "--checkpoint", "out.tar"]) == (
        ["kvs", "dump", "--checkpoint", "out.tar"], "dump")
    argv = ["attr", "get", "rank"]
    assert cli.resolve_alias(argv) == (argv, None)


def test_an_aliased_command_s_usage_names_it_as_typed(capsys) -> None:
    """``kvbroker content checkpoint update`` printed its usage as ``kvbroker
    kvs checkpoint update``; the command spelled here keeps its own."""
    for argv, usage in ((["content", "checkpoint", "update"],
                         "usage: kvbroker content checkpoint update "),
                        (["getattr"], "usage: kvbroker getattr "),
                        (["kvs", "checkpoint", "update"],
                         "usage: kvbroker kvs checkpoint update ")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(usage), err
        assert f"{usage[7:].rstrip()}: error: the following arguments are required" in err, err
    with pytest.raises(SystemExit):
        cli.main(["content", "checkpoint", "--help"])
    assert capsys.readouterr().out.startswith("usage: kvbroker content checkpoint ")


async def test_flux_s_attribute_and_archive_commands_run(start_instance, tmp_path) -> None:
    inst = await start_instance(size=2)
    uri = inst.uri(0)
    assert await run_cli("getattr", "size", uri=uri) == (0, "2\n", "")
    assert await run_cli("setattr", "log.level", "info", "-r", "1", uri=uri) == (0, "", "")
    assert await run_cli("getattr", "log.level", "-r", "1", uri=uri) == (0, "info\n", "")
    rc, out, err = await run_cli("lsattr", "-v", uri=uri)
    assert rc == 0 and re.search(r"^size +2$", out, re.M), err
    rc, out, err = await run_cli("module", "stats", "kvs", uri=uri)
    assert rc == 0 and "counts" in json.loads(out), err
    assert await run_cli("getattr", "nosuch", uri=uri) == (
        1, "", "kvbroker: getattr: No such file or directory (unknown attribute 'nosuch')\n")
    # flux dump / flux restore: kvs dump / restore, named as typed
    assert (await run_cli("kvs", "put", "d.x=1", uri=uri))[0] == 0
    tar = str(tmp_path / "d.tar")
    rc, _, err = await run_cli("dump", "--key", "d", tar, uri=uri)
    assert rc == 0 and err.startswith("kvbroker: dump: 1 key"), err
    rc, _, err = await run_cli("restore", "--key", "e", tar, uri=uri)
    assert rc == 0 and err.startswith("kvbroker: restore: 1 key"), err
    assert await run_cli("kvs", "get", "e.x", uri=uri) == (0, "1\n", "")
    # with Flux's tuning options, taken as written (they change nothing here)
    rc, _, err = await run_cli("dump", "--maxreqs=1000", "--no-cache", "--key", "d", tar,
                               uri=uri)
    assert rc == 0, err
    rc, _, err = await run_cli("restore", "--maxreqs=4", "--sd-notify", "--key", "f", tar,
                               uri=uri)
    assert rc == 0, err
    assert await run_cli("kvs", "get", "f.x", uri=uri) == (0, "1\n", "")
    # flux exec -d DIR: the commands' working directory
    assert await run_cli("exec", "-d", str(tmp_path), "pwd", uri=uri) == (
        0, f"{tmp_path}\n", "")
    rc, out, err = await run_cli("exec", "-r", "all", "-l", "-d", str(tmp_path), "pwd", uri=uri)
    assert (rc, sorted(out.splitlines())) == (0, [f"0: {tmp_path}", f"1: {tmp_path}"]), err
    assert await run_cli("exec", "-d", str(tmp_path / "nope"), "pwd", uri=uri) == (
        1, "", f"kvbroker: exec: -d {tmp_path / 'nope'}: No such file or directory\n")


async def test_module_stats_parse_type_and_scale_as_flux_s(start_instance) -> None:
    """Flux's test scripts read one stats value: ``flux module stats
    --parse watchers kvs-watch`` (t1103), ``--type int``, ``-t int`` (its
    -t), ``--scale``.  They were "unrecognized arguments"."""
    inst = await start_instance(size=2)
    uri = inst.uri(0)
    watch = await asyncio.create_subprocess_exec(
        KVBROKER, "kvs", "get", "--watch", "--waitcreate", "noexist",
        env={**os.environ, "KVBROKER_URI": uri}, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        async def watching() -> bool:
            rc, out, _ = await run_cli("module", "stats", "--parse", "watchers", "kvs-watch",
                                       uri=uri)
            return rc == 0 and out == "1\n"

        await wait_until(watching, "the watcher to be counted")
    finally:
        watch.kill()
        await watch.wait()

    async def gone() -> bool:  # (t1103: the watcher goes with its client)
        rc, out, _ = await run_cli("module", "stats", "-t", "int", "-p", "watchers",
                                   "kvs-watch", uri=uri)
        return rc == 0 and out == "0\n"

    await wait_until(gone, "the watcher to go with its client")
    assert await run_cli("stats", "-p", "hash", "content", uri=uri) == (0, '"sha256"\n', "")
    rc, out, err = await run_cli("stats", "content", "-p", "backlog-limit", "--type", "double",
                                 "-s", "0.5", uri=uri)
    assert (rc, out) == (0, "134217728.000000\n"), err
    # --scale alone keeps an integer field an integer (as Flux prints it; it
    # printed 268435456.000000), and --clear / --clear-all are one or the other
    rc, out, err = await run_cli("stats", "content", "-p", "backlog-limit", "-s", "2", uri=uri)
    assert (rc, out) == (0, "536870912\n"), err
    rc, out, err = await run_cli("stats", "content", "-p", "backlog-limit", "-s", "0.3",
                                 uri=uri)
    assert (rc, out) == (0, f"{268435456 * 0.3:f}\n"), err
    rc, _, err = await run_cli("stats", "--clear", "--clear-all", "kvs", uri=uri)
    assert rc == 2 and "not allowed with argument" in err, err
    rc, out, err = await run_cli("stats", "kvs-watch", "-r", "1", "-t", "5", "-p", "rank",
                                 uri=uri)  # (-t SECONDS is still the timeout)
    assert (rc, out) == (0, "1\n"), err
    rc, out, err = await run_cli("stats", "content", "-p", "sqlite-thread.nope", uri=uri)
    assert (rc, out) == (1, ""), err
    assert err.startswith("kvbroker: stats content: sqlite-thread.nope: sqlite-thread has no "
                          "field 'nope' (its fields: "), err
    rc, _, err = await run_cli("stats", "content", "-p", "hash", "--type", "int", uri=uri)
    assert rc == 1 and 'hash: not a number: "sha256"' in err, err
    rc, _, err = await run_cli("stats", "content", "--type", "int", uri=uri)
    assert rc == 2 and "--type and --scale need --parse OBJNAME" in err, err


async def test_rundir_cleanup_keeps_or_removes_the_run_directory(tmp_path) -> None:
    """Flux's ``-S rundir-cleanup=0|1`` (t0036): 0 keeps a run directory the
    start made, emptied of what it wrote; 1 removes one that was there, with
    what it holds, as Flux's cleanup does.  ``statedir-cleanup`` is refused
    with why."""
    script = "kvbroker attr get rundir"
    rc, out, err = await run_cli("start", "--size", "2", "-S", "rundir-cleanup=0", "--",
                                 "sh", "-c", script)
    assert rc == 0, err
    made = Path(out.strip())
    try:
        assert made.is_dir() and list(made.iterdir()) == []
    finally:
        made.rmdir()
    there = tmp_path / "there"
    there.mkdir(mode=0o700)
    (there / "mine").write_text("x")
    rc, out, err = await run_cli("start", "--rundir", str(there), "-S", "rundir-cleanup=1",
                                 "--", "true")
    assert rc == 0 and not there.exists(), err
    rc, _, err = await run_cli("start", "-S", "rundir-cleanup=maybe", "--", "true")
    assert rc == 2 and "rundir-cleanup: 'maybe' is not a boolean" in err, err
    rc, _, err = await run_cli("start", "-S", "statedir-cleanup=0", "--", "true")
    assert rc == 2 and "only when given one (--statedir DIR, kept)" in err, err


@pytest.mark.parametrize("spawn", ["fork", "exec", "served"])
async def test_start_in_a_directory_of_same_named_modules_runs_the_brokers_own(
        tmp_path: Path, spawn: str) -> None:
    """A ``kvs.py``, ``sqlite3.py`` or ``msgpack.py`` in the directory
    ``start`` is run in was imported by the ranks (``python -m`` puts the
    working directory first on the import path) in place of the broker's
    modules: the ranks failed to start.  They run with ``-P`` now (forked
    from a spawner, executed, or served by the suite's fork server)."""
    for name in ("kvs.py", "sqlite3.py", "msgpack.py"):
        (tmp_path / name).write_text("raise SystemExit('the shadow was imported')\n")
    env = dict(os.environ)
    if spawn == "served" and not env.get("KVBROKER_FORKSERVER"):
        pytest.skip("no fork server here (KVBROKER_TEST_FORKSERVER=0?)")
    if spawn != "served":
        env.pop("KVBROKER_FORKSERVER", None)
        env["KVBROKER_SPAWN"] = spawn
    rc, out, err = await run_cli("start", "--size", "2", "--", "kvbroker", "kvs", "get", "a",
                                 cwd=tmp_path, env=env)
    assert (rc, out) == (1, ""), err
    assert err == "kvbroker: a: No such file or directory\n", err


@pytest.mark.parametrize("spawn", ["fork", "exec", "served"])
async def test_an_uninstalled_checkout_runs_its_own_broker_in_the_ranks(
        tmp_path: Path, spawn: str) -> None:
    """``python -m broker.cli start`` run in a copy of the packages: the
    ranks run that copy too (``python -P`` alone would have them import the
    installed kvbroker, or fail to find one); ``config builtin`` names where
    each rank's ``broker`` package is."""
    import shutil

    from broker import pypath

    src = tmp_path / "src"
    for package in ("broker", "kvs", "kvs_watch"):
        shutil.copytree(Path(pypath.ROOT) / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ)
    if spawn != "served":
        env.pop("KVBROKER_FORKSERVER", None)
        env["KVBROKER_SPAWN"] = spawn
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", "start", "--size", "2", "--", "sh", "-c",
        "kvbroker config builtin python_path && "
        "kvbroker exec -r 1 kvbroker config builtin python_path",
        cwd=src, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert (proc.returncode, out.decode()) == (0, f"{src}\n{src}\n"), err.decode()


async def test_start_verbose_prints_each_ranks_command_line() -> None:
    """``start -v`` (Flux's ``flux start -v``): every rank's command line on
    stderr as it starts, quoted for a shell; the command runs as without it."""
    import shlex

    rc, out, err = await run_cli("start", "-v", "--size", "2", "--", "echo", "ran")
    assert (rc, out) == (0, "ran\n"), err
    lines = [ln for ln in err.splitlines() if ln.startswith("kvbroker: start: rank ")]
    assert [ln.split(":")[2].strip() for ln in lines] == ["rank 0", "rank 1"], err
    for rank, line in enumerate(lines):
        argv = shlex.split(line.split(": ", 3)[3])
        assert argv[1:4] == ["-P", "-m", "broker.rank"]
        assert argv[argv.index("--rank") + 1] == str(rank) and "--attrs" in argv
    rc, out, err = await run_cli("start", "--size", "2", "--", "true")
    assert rc == 0 and "rank 0:" not in err  # (not without -v)


async def test_broker_rundir_cleanup_never_takes_a_statedir_with_it(tmp_path: Path) -> None:
    """``kvbroker broker -S rundir-cleanup=1`` removes its ``--rundir`` at
    the stop, as ``start``'s does (it was taken and ignored); a
    ``--statedir`` inside it would go too, so that is refused before
    anything starts (exit 2), and the statedir is left as it was."""
    conf = tmp_path / "one.toml"
    conf.write_text("[bootstrap]\n")
    rundir, statedir = tmp_path / "run", tmp_path / "run" / "state"
    rc, out, err = await run_cli("broker", "-c", str(conf), "--rundir", str(rundir),
                                 "--statedir", str(statedir), "-S", "rundir-cleanup=1",
                                 "--", "true")
    assert (rc, out) == (2, ""), err
    assert "is inside the rundir" in err and "never removed" in err, err
    assert not statedir.exists()
    rc, out, err = await run_cli("broker", "-c", str(conf), "--rundir", str(rundir),
                                 "--statedir", str(tmp_path / "state"), "-S",
                                 "rundir-cleanup=1", "--", "kvbroker", "kvs", "put", "a=1")
    assert rc == 0, err
    assert not rundir.exists() and (tmp_path / "state" / "content.sqlite").exists()
