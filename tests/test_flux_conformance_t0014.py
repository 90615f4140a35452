"""flux-core t/t0014-runlevel.t: the broker's run levels and initial program.

Flux's broker runs rc1 (a start-up script), rc2 (the *initial program*)
and rc3 (a shutdown script), plus the cleanup commands pushed with ``flux
admin cleanup-push``.  kvbroker runs no rc scripts and has no cleanup
commands (docs/cli.md, ``start``'s ``-S``: an empty ``broker.rc1_path`` or
``broker.rc3_path`` is taken and ignored, a non-empty one is refused), but
it has the initial program: ``kvbroker start [...] -- COMMAND`` and rank 0's
``kvbroker broker --config FILE -- COMMAND`` (docs/cli.md, *start* and
*broker*; docs/guide.md).  Its exit status becomes the instance's, signals
to the instance go to its process group, it inherits the standard streams,
and its environment names the instance.  Without a COMMAND there is no
default program: ``start`` prints the URI and serves until signalled, rank
0 of ``broker`` prints ``ready URI`` and serves until ``kvbroker
shutdown``.  Every case runs real ``kvbroker start`` / ``kvbroker broker``
processes.

Flux case -> here:

1.  initial program is run when rc1/rc3 are nullified -> the same:
    ``-Slog-stderr-level=6 -Sbroker.rc1_path= -Sbroker.rc3_path= -- true``
    exits 0, for ``start`` and ``broker``.
2.  rc1 failure causes instance failure (``rc1_path=false``) -> not
    applicable (no rc scripts); the non-empty ``rc1_path`` is refused
    before any rank starts, exit 2, saying kvbroker runs no rc scripts,
    and the command does not run (documented).  What an rc1 failure stands
    for -- start-up work that fails -- is case 10's test: the command does
    not run and ``start`` exits 2.
3.  rc1 bad path handled as failure (127) -> refused as 2.  The 127 of a
    program that is not found is the initial program's here: ``start --
    nosuch`` and ``broker -- nosuch`` exit 127 saying ``nosuch: No such
    file or directory``; 126 for one that cannot be executed (a
    directory, a script whose ``#!`` interpreter is missing, with bash's
    ``bad interpreter``); the program's own status otherwise (0, 1, 3;
    128+N when signal N killed it) -- all documented, all tested.  An
    empty command word (``start -- ''``) exits 127, ``: command not
    found``, as a shell (until 2026-12-05: 126, ``: Permission denied``,
    each PATH directory tried as the program).
4.  default initial program is ``$SHELL`` (on a tty) -> DIFFERENCE
    (documented: without a COMMAND ``start`` prints the URI and serves):
    with stdin a terminal and ``$SHELL`` a script that would leave a mark,
    ``start`` prints the URI, the instance answers, no shell runs, and
    SIGINT stops it with exit 0.
5.  rc2 failure if stdin is not a tty -> DIFFERENCE (the same): with stdin
    /dev/null ``start`` serves just the same; ``broker`` rank 0 without a
    command prints ``ready URI`` and serves until ``kvbroker shutdown``,
    then prints ``shutdown`` and exits 0 (documented).
6.  rc3 failure causes instance failure -> not applicable; a non-empty
    ``rc3_path`` is refused as 2.
7.  ``broker.rc2_none`` terminates by signal (SIGALRM) without error ->
    kvbroker's ``rc2_none`` is ``start`` without a COMMAND (4-5).  Flux's
    attribute is refused with ``unknown attribute (did you mean
    broker.modules?)`` until 2026-12-05; now it is refused saying what is
    done instead, as the docs' rule for Flux's names of what is not built
    here is.  (Flux's valueless ``-Sbroker.rc2_none`` is a usage error
    here, ``expected ATTR=VALUE``: ``-S`` takes ``ATTR=VAL``,
    documented.)  SIGALRM and SIGQUIT, stop signals of Flux's broker (with
    SIGHUP, SIGINT, SIGTERM), stop ``start`` cleanly, exit 0 (until
    2026-12-05 they killed it by their default action, 142 or 131: the
    ranks still exited and removed the run directory, tested).
8.  ``flux admin cleanup-push true`` works -> not applicable (no cleanup
    commands, no ``kvbroker admin``).  The equivalent documented here:
    SIGTERM to the instance goes to the command's whole process group (a
    child it started sees it too), the instance serves until the command
    has exited, so its trap cleans up through the instance (``kvs put``,
    ``kvs get``), and ``start``/rank 0 exit with its status -- for both
    launchers.
9.  cleanup-push false causes instance failure -> the same test: the
    trap's ``exit 5`` is the instance's status.  An uncaught forwarded
    signal is 128+N (SIGINT to ``start``: 130; SIGHUP to ``broker``: 129).
10. cleanup does not run if rc1 fails -> the command does not run when the
    instance does not come up: a module that cannot be loaded fails
    ``start`` (exit 2) before the command; a signal to ``broker`` rank 0
    while it waits for a rank that never comes stops it with 128+N and
    the command never runs (documented).
11.-12. cleanup-push with an empty / no command fails -> not applicable
    (the empty command word of the initial program: case 3).
13.-14. cleanup-push from stdin, in order -> not applicable; the initial
    program's own stdin: it reads ``start``'s (``broker``'s) standard
    input, its output and errors go to their stdout and stderr, and
    neither launcher prints anything else on stdout (no URI, no ``ready``)
    (documented).  A closed stdin reaches the command closed, as from a
    shell (documented).
15. capture the environment of the three rc scripts -> rc2's: the
    command's environment, below.
16. PMI_FD/PMI_SIZE/PMI_RANK not set -> not applicable (no PMI
    bootstrap); the environment is passed on as a shell passes it:
    ``PMI_RANK`` given to ``start`` reaches the command.
17. ``SLURM_*`` cleared -> DIFFERENCE (no jobs or resource manager here,
    documented scope): ``SLURM_FOO`` reaches the command unchanged.
18. ``FLUX_URI`` is set -> ``KVBROKER_URI`` names rank 0 (its
    ``local-uri`` attribute), replacing an enclosing one;
    ``KVBROKER_RANK`` is 0; ``PATH`` finds this ``kvbroker`` first: its
    directory goes just before the first other one holding a ``kvbroker``
    (documented) -- for both launchers.
19.-20. job environment / ``FLUX_ENCLOSING_ID`` not set -> not applicable
    (no jobs).
21.-23. an instance run as a job, and its rc environment -> no jobs; the
    nearest thing, an instance started from another's command: the inner
    command's ``KVBROKER_URI`` is the inner instance's, not the outer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, wait_until
from test_multihost import keyed_config

ARGS = ("-S", "broker.rc1_path=", "-S", "broker.rc3_path=")  # Flux's, taken
T = 60
BIN = str(Path(KVBROKER).parent)
LAUNCHERS = ["start", "broker"]


def cli_env(**extra: str) -> dict[str, str]:
    """The test's environment, no ``KVBROKER_URI``, ``PATH`` finding this
    ``kvbroker``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != "KVBROKER_URI"}
    env["PATH"] = f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def launch_args(launcher: str, tmp_path: Path, cmd: tuple[str, ...],
                extra: tuple[str, ...] = ()) -> list[str]:
    """``start [ARGS] -- CMD`` or ``broker -c SOLO [ARGS] -- CMD`` (a
    bootstrap file without hosts: one rank on its own)."""
    if launcher == "start":
        return ["start", *ARGS, *extra, *(["--", *cmd] if cmd else [])]
    conf = tmp_path / "solo.toml"
    conf.write_text("[bootstrap]\n")
    return ["broker", "-c", str(conf), *ARGS, *extra, *(["--", *cmd] if cmd else [])]


async def run(launcher: str, tmp_path: Path, *cmd: str, extra: tuple[str, ...] = (),
              **kw: object) -> tuple[int, str, str]:
    """Run the launcher to its end: (status, stdout, stderr)."""
    kw.setdefault("env", cli_env())
    return await run_cli(*launch_args(launcher, tmp_path, cmd, extra), timeout=T,
                         **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def spawned(launcher: str, tmp_path: Path, *cmd: str, stdin: int | None = None,
                  env: dict[str, str] | None = None, args: list[str] | None = None,
                  ) -> AsyncIterator[asyncio.subprocess.Process]:
    """The launcher running in a session of its own (as from a script or a
    service: no terminal's foreground), stdout and stderr piped; killed at
    the end if it is still running."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, *(args or launch_args(launcher, tmp_path, cmd)),
        stdin=asyncio.subprocess.DEVNULL if stdin is None else stdin,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=env or cli_env(), start_new_session=True)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def line(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), T)).decode()


async def finish(proc: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# -- 1: the initial program with Flux's rc paths emptied ----------------------

@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_t0014_initial_program_runs_with_rc_paths_empty(tmp_path: Path,
                                                              launcher: str) -> None:
    marker = tmp_path / "ran"
    rc, out, err = await run(launcher, tmp_path, "sh", "-c", f"echo yes > {marker}",
                             extra=("-Slog-stderr-level=6",))
    assert (rc, out) == (0, ""), err
    assert marker.read_text() == "yes\n"


# -- 2, 3, 6: rc scripts are refused --------------------------------------------

@pytest.mark.parametrize("attr", ["broker.rc1_path=false", "broker.rc1_path=rc1-nonexist",
                                  "broker.rc3_path=false"])
async def test_t0014_rc_scripts_are_refused_before_anything_runs(tmp_path: Path,
                                                                 attr: str) -> None:
    marker = tmp_path / "ran"
    rc, out, err = await run("start", tmp_path, "sh", "-c", f"touch {marker}",
                             extra=("-S", attr))
    name = attr.partition("=")[0]
    assert (rc, out) == (2, ""), err
    assert err == (f"kvbroker: start: {name}: kvbroker runs no rc scripts; only an empty "
                   f"value is taken (as Flux's -S{name}=)\n")
    assert not marker.exists()


# -- 3: the initial program's exit status ---------------------------------------

def bad_interpreter(tmp_path: Path) -> str:
    script = tmp_path / "script"
    script.write_text("#!/no/such/interp\necho hi\n")
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize("launcher, cmd, status, says", [
    ("start", ["true"], 0, None),
    ("start", ["false"], 1, None),
    ("start", ["sh", "-c", "exit 3"], 3, None),
    ("broker", ["sh", "-c", "exit 3"], 3, None),
    ("start", ["sh", "-c", "kill -USR1 $$"], 128 + signal.SIGUSR1, None),
    ("broker", ["sh", "-c", "kill -USR1 $$"], 128 + signal.SIGUSR1, None),
    ("start", ["nosuch-t0014"], 127, "nosuch-t0014: No such file or directory"),
    ("broker", ["nosuch-t0014"], 127, "nosuch-t0014: No such file or directory"),
    ("start", ["/"], 126, "/: Permission denied"),
    ("broker", ["/"], 126, "/: Permission denied"),
    ("start", ["BAD"], 126, "BAD: /no/such/interp: bad interpreter: No such file or "
                            "directory"),
])
async def test_t0014_instance_exits_with_the_initial_program_s_status(
        tmp_path: Path, launcher: str, cmd: list[str], status: int, says: str | None) -> None:
    if cmd == ["BAD"]:
        cmd = [bad_interpreter(tmp_path)]
        says = says.replace("BAD", cmd[0]) if says else None
    rc, out, err = await run(launcher, tmp_path, *cmd)
    assert (rc, out) == (status, ""), err
    if says is None:
        assert err == "", err
    elif launcher == "start":
        assert err == f"kvbroker: {says}\n"
    else:  # (rank 0's log line)
        assert f"ERROR kvbroker: initial program {says}\n" in err, err


@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_t0014_an_empty_command_word_is_not_found(tmp_path: Path,
                                                        launcher: str) -> None:
    rc, out, err = await run(launcher, tmp_path, "")
    assert (rc, out) == (127, ""), err
    assert "Permission denied" not in err, err


# -- 4, 5: no command -----------------------------------------------------------

@pytest.mark.parametrize("stdin", ["terminal", "devnull"])
async def test_t0014_start_without_a_command_serves_and_runs_no_shell(
        tmp_path: Path, stdin: str) -> None:
    marker = tmp_path / "shell-ran"
    shell = tmp_path / "myshell"
    shell.write_text(f"#!/bin/sh\ntouch {marker}\n")
    shell.chmod(0o755)
    master, slave = os.openpty() if stdin == "terminal" else (-1, -1)
    try:
        async with spawned("start", tmp_path, stdin=slave if slave >= 0 else None,
                           env=cli_env(SHELL=str(shell))) as proc:
            uri = (await line(proc)).strip()
            assert uri.startswith("local://") and uri.endswith("/local-0"), uri
            rc, out, err = await run_cli("attr", "get", "rank", uri=uri, timeout=T)
            assert (rc, out) == (0, "0\n"), err
            proc.send_signal(signal.SIGINT)
            rc, out, err = await finish(proc)
    finally:
        for fd in (master, slave):
            if fd >= 0:
                os.close(fd)
    assert (rc, out) == (0, ""), err
    assert not marker.exists()


async def test_t0014_broker_rank_0_without_a_command_serves_until_shutdown(
        tmp_path: Path) -> None:
    async with spawned("broker", tmp_path) as proc:
        ready = (await line(proc)).split()
        assert ready[0] == "ready" and ready[1].endswith("/local-0"), ready
        rc, _, err = await run_cli("shutdown", uri=ready[1], timeout=T)
        assert rc == 0, err
        rc, out, err = await finish(proc)
    assert (rc, out) == (0, "shutdown\n"), err


# -- 7: broker.rc2_none, and Flux's stop signal SIGALRM ------------------------

async def test_t0014_rc2_none_says_what_is_done_instead(tmp_path: Path) -> None:
    rc, out, err = await run("start", tmp_path, "true", extra=("-S", "broker.rc2_none=1"))
    assert "broker.modules" not in err, err
    assert "COMMAND" in err or "command" in err, err


async def uri_file_rundir(uri_file: Path) -> Path:
    async def written() -> bool:
        return uri_file.exists()

    await wait_until(written, "start's --uri-file", timeout=T)
    return Path(uri_file.read_text().strip().removeprefix("local://")).parent


async def test_t0014_start_killed_by_sigalrm_leaves_nothing_behind(tmp_path: Path) -> None:
    """Flux's case 7's signal: whatever ``start`` makes of it, the ranks go
    and the run directory with them."""
    uri_file = tmp_path / "uri"
    args = ["start", *ARGS, "--uri-file", str(uri_file)]
    async with spawned("start", tmp_path, args=args) as proc:
        rundir = await uri_file_rundir(uri_file)
        pids = (await run_cli("attr", "get", "broker.pid", uri=f"local://{rundir}/local-0",
                              timeout=T))[1].split()
        proc.send_signal(signal.SIGALRM)
        await finish(proc)

    async def gone() -> bool:
        return not rundir.exists() and not any(Path(f"/proc/{p}").exists() for p in pids)

    await wait_until(gone, "the ranks to exit and remove the run directory", timeout=T)


@pytest.mark.parametrize("sig", [signal.SIGALRM, signal.SIGQUIT])
async def test_t0014_sigalrm_stops_start_cleanly(tmp_path: Path, sig: int) -> None:
    uri_file = tmp_path / "uri"
    args = ["start", *ARGS, "--uri-file", str(uri_file)]
    async with spawned("start", tmp_path, args=args) as proc:
        await uri_file_rundir(uri_file)
        proc.send_signal(sig)
        rc, out, err = await finish(proc)
    assert rc == 0, (rc, err)


# -- 8, 9: signals to the instance reach the command's group; its cleanup -------

CHILD = """\
import signal, sys
def on(sig, frame):
    with open(sys.argv[1], "w") as f:
        f.write(signal.Signals(sig).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, on)
print("up", flush=True)
while True:
    signal.pause()
"""


@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_t0014_sigterm_reaches_the_command_s_group_which_cleans_up(
        tmp_path: Path, launcher: str) -> None:
    child, marker = tmp_path / "child.py", tmp_path / "child-got"
    child.write_text(CHILD)
    script = ('trap "kvbroker kvs put cleanup=ok && kvbroker kvs get cleanup; wait; exit 5"'
              ' TERM; "$0" "$1" "$2" & wait')
    async with spawned(launcher, tmp_path, "sh", "-c", script, sys.executable, str(child),
                       str(marker)) as proc:
        assert await line(proc) == "up\n"  # (the trap is set, the child's handler too)
        proc.send_signal(signal.SIGTERM)
        rc, out, err = await finish(proc)
    assert (rc, out) == (5, "ok\n"), err
    assert marker.read_text() == "SIGTERM"


@pytest.mark.parametrize("launcher, sig", [("start", signal.SIGINT),
                                           ("broker", signal.SIGHUP)])
async def test_t0014_a_forwarded_signal_that_kills_the_command_is_128_plus_n(
        tmp_path: Path, launcher: str, sig: signal.Signals) -> None:
    async with spawned(launcher, tmp_path, "sh", "-c", "echo up; exec sleep 300") as proc:
        assert await line(proc) == "up\n"
        proc.send_signal(sig)
        rc, out, err = await finish(proc)
    assert (rc, out) == (128 + sig, ""), err


# -- 10: the command does not run when the instance does not come up ----------

async def test_t0014_start_up_failure_runs_no_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    rc, out, err = await run("start", tmp_path, "sh", "-c", f"touch {marker}",
                             extra=("-S", "broker.modules=content,kvs,nosuchmod"))
    assert (rc, out) == (2, ""), err
    assert "no module named 'nosuchmod'" in err, err
    assert "kvbroker: start: rank 0 exited with status 1 during start-up\n" in err, err
    assert not marker.exists()


async def test_t0014_broker_signalled_before_the_instance_is_up_runs_no_command(
        tmp_path: Path) -> None:
    config = await keyed_config(tmp_path, 2, 2)
    marker, rundir = tmp_path / "ran", tmp_path / "run0"
    args = ["broker", "--config", str(config), "--rank", "0", "--rundir", str(rundir),
            "--", "sh", "-c", f"touch {marker}"]
    async with spawned("broker", tmp_path, args=args) as proc:
        async def listening() -> bool:  # (rank 0's socket: at once, handlers set)
            return (rundir / "local-0").exists()

        await wait_until(listening, "rank 0's local socket", timeout=T)
        proc.send_signal(signal.SIGTERM)
        rc, out, err = await finish(proc)
    assert (rc, out) == (128 + signal.SIGTERM, ""), err
    assert not marker.exists()


# -- 13-14: standard streams ------------------------------------------------------

@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_t0014_the_command_has_the_launcher_s_streams(tmp_path: Path,
                                                            launcher: str) -> None:
    rc, out, err = await run(launcher, tmp_path, "sh", "-c",
                             "cat; echo to-stderr >&2", input=b"Hello world\nHello solar\n")
    assert (rc, out) == (0, "Hello world\nHello solar\n"), err
    assert "to-stderr\n" in err


async def test_t0014_a_closed_stdin_reaches_the_command_closed(tmp_path: Path) -> None:
    probe = 'if [ -e /dev/fd/0 ]; then echo open; else echo closed; fi'
    rc, out, err = await _closed_stdin(tmp_path, probe)
    assert (rc, out) == (0, "closed\n"), err


async def _closed_stdin(tmp_path: Path, probe: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", 'exec "$@" <&-', "sh", KVBROKER,
        *launch_args("start", tmp_path, ("sh", "-c", probe)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env())
    try:
        return await finish(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# -- 15-23: the command's environment -------------------------------------------

ENV_PROBE = ('printf "%s\\n" "$KVBROKER_URI" "$KVBROKER_RANK" "$PATH" "$SLURM_FOO" '
             '"$PMI_RANK"; command -v kvbroker; kvbroker attr get local-uri')


@pytest.mark.parametrize("launcher", LAUNCHERS)
async def test_t0014_the_command_s_environment(tmp_path: Path, launcher: str) -> None:
    empty, fake = tmp_path / "empty", tmp_path / "fakebin"
    empty.mkdir()
    fake.mkdir()
    (fake / "kvbroker").write_text("#!/bin/sh\necho fake; exit 99\n")
    (fake / "kvbroker").chmod(0o755)
    path = f"{empty}:{fake}:/usr/bin:/bin"
    env = cli_env(SLURM_FOO="42", PMI_RANK="3")
    env["PATH"] = path
    rc, out, err = await run(launcher, tmp_path, "sh", "-c", ENV_PROBE, env=env,
                             uri="local:///enclosing/instance/local-0")
    assert rc == 0, err
    uri, rank, got_path, slurm, pmi, which, local_uri = out.splitlines()
    assert uri == local_uri and uri.startswith("local://") and uri.endswith("/local-0")
    assert rank == "0"
    assert got_path == f"{empty}:{BIN}:{fake}:/usr/bin:/bin"
    assert which == KVBROKER
    assert (slurm, pmi) == ("42", "3")  # passed on as a shell does (no jobs here)


async def test_t0014_a_nested_instance_s_command_names_the_inner_instance(
        tmp_path: Path) -> None:
    inner = 'echo "$KVBROKER_URI"; kvbroker attr get rundir'
    script = (f'echo "$KVBROKER_URI"; kvbroker start {" ".join(ARGS)} -- sh -c '
              f"'{inner}'")
    rc, out, err = await run("start", tmp_path, "sh", "-c", script)
    assert rc == 0, err
    outer, inner_uri, inner_rundir = out.splitlines()
    assert outer != inner_uri
    assert inner_uri == f"local://{inner_rundir}/local-0"
