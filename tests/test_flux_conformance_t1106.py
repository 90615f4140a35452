"""flux-core t/t1106-ssh-connector.t: the ``ssh://`` connector and ``flux
relay`` -> kvbroker's ``ssh://`` URIs (broker/ssh.py) and ``kvbroker
relay``, against real ranks.  ssh is a stand-in written here in the shape
of Flux's ``t/scripts/tssh``: it says on its stderr the host, port, user
and command it was given, drops them, and runs the command with
``$SHELL -c``, so the relay, the socket and the ranks are real.
``KVBROKER_SSH`` and ``KVBROKER_SSH_RCMD`` are Flux's ``FLUX_SSH`` and
``FLUX_SSH_RCMD``; Flux's ``flux proxy`` has no counterpart (see
test_flux_conformance_t1105.py: the ``ssh://`` URI is the whole mechanism).

Flux's cases, and what each becomes:

1.-3. *rundir/bin exists*, *rundir/bin/flux is a symlink*, *points to an
   executable* -> ``RUNDIR/bin/kvbroker`` is an executable each rank
   writes, a script that runs the rank's own Python and ``broker``
   package (a symlink to a console script could name a Python whose
   package is found only through the rank's environment), and it is gone
   when the instance stops (a given ``--rundir`` is left empty)
   (:func:`test_rundir_bin_holds_the_ranks_kvbroker_while_it_runs`).
   **Added by this file**: until then the remote command was this host's
   ``kvbroker`` by its absolute path, which a client whose installation
   lives elsewhere than the rank's (a laptop, another venv) could not run.
4. *load heartbeat module with fast rate* / 16. *can work with events* /
   29. *remove heartbeat module* -> ``module load heartbeat period=0.1s``,
   ``event sub --count=1 heartbeat.pulse`` through ssh, ``module remove
   heartbeat`` (:func:`test_events_through_ssh`).
5. *with local sockdir works* (``getattr size``; tssh's ``hostname=`` and
   the ``flux relay SOCKDIR`` command on stderr) -> ``attr get size``
   through the stand-in; what ssh wrote on its stderr reaches the
   command's (:func:`test_a_command_reaches_the_rank_through_ssh`).
6.-9. *remote PATH is set*, *has rundir/bin first*, *includes the local
   flux bindir*, *includes system bindirs* -> the remote command is ``env
   PATH=RUNDIR/bin:BINDIR:/bin:/usr/bin kvbroker relay SOCKET``, and the
   relay that ran is the rank's ``RUNDIR/bin/kvbroker`` (its process runs
   ``python -m broker.cli``) (:func:`test_the_remote_path_puts_the_rundir_bin_first`).
10. *FLUX_SSH_RCMD does not set remote PATH* -> the same with
   ``KVBROKER_SSH_RCMD``: no ``PATH=`` on the command line (same test).
11. *SHELL=tcsh works* -> the same command line run by tcsh, where there
   is one (:func:`test_a_csh_login_shell_runs_the_relay`; skipped, as
   Flux's prerequisite, without /bin/tcsh).
12.-14. *with port*, *with user*, *with user and port* -> ``-p 42`` and
   ``-l fred`` given to ssh (:func:`test_port_and_user_are_given_to_ssh`).
15. *nontrivial message load* (``flux ping --count=100 -i 0.001``) ->
   ``kvbroker ping -c 100 -i 0.001`` through ssh, every one answered
   (:func:`test_a_hundred_pings_through_ssh`).
17.-20. *register a service*, *re-register after disconnect*, *EINVAL
   with a method*, *EEXIST shadowing broker* -> do not apply: a client
   cannot register services in kvbroker; services are modules loaded by
   the ranks (docs/api.md, Writing a module), as test_flux_conformance_t1105
   says of the same cases.
21.-24. *bad query option*, *bad FLUX_SSH*, *bad FLUX_SSH_RCMD*, *missing
   path* fail in ``flux_open()`` -> each fails at connect, exit 1, saying
   what (:func:`test_bad_uris_and_commands_fail_at_connect`): a query or
   no path is refused as a malformed URI (nothing run); a missing ssh is
   ``cannot run`` with the variable to set (Flux's hint); a remote
   command that cannot be found ends with the remote shell's own error in
   the message.
25.-26. *ssh stderr is redirected with Python flux.Flux()* -> a ssh that
   writes ``error from ssh`` and exits 1: ``Handle.connect`` raises
   OSError whose message ends with ``error from ssh``, and the program's
   own stderr stays empty (:func:`test_python_connect_says_what_ssh_said`).
   **Fixed by this file**: ssh's stderr went straight to the program's,
   and the exception said "ssh's own error, if any, is above"; it is now
   kept while ssh connects, and passed on once the relay answers (errno is
   ``EHOSTUNREACH`` where Flux's is ``ECONNRESET``).
27.-28. *flux command that emits data on stdout*, *fails without hang*
   with the hint about shell init files -> a ``KVBROKER_SSH_RCMD`` that
   echoes ``foo`` first: the command and ``Handle.connect`` fail at once
   ("not a kvbroker relay: b'foo\\n'") with the hint
   (:func:`test_noise_before_the_relay_fails_at_once_with_a_hint`).
   **Added by this file**: the hint.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, wait_until
from test_flux_conformance_t1105 import relays

from broker import __version__
from broker.handle import Handle

T = 30.0

TSSH = r"""#!/bin/sh
# ssh stand-in (as Flux's tssh): says what it was given, runs the command here
while getopts "p:l:" opt; do
    case $opt in
        p) echo "port=$OPTARG" >&2 ;;
        l) echo "user=$OPTARG" >&2 ;;
        *) exit 255 ;;
    esac
done
shift $((OPTIND - 1))
echo "hostname=$1" >&2
shift
echo "cmd=\"$*\"" >&2
exec "${SHELL:-/bin/sh}" -c "$*"
"""


@pytest.fixture
def tssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = tmp_path / "tssh"
    path.write_text(TSSH)
    path.chmod(0o755)
    monkeypatch.setenv("KVBROKER_SSH", str(path))
    monkeypatch.setenv("SHELL", "/bin/sh")
    monkeypatch.delenv("KVBROKER_SSH_RCMD", raising=False)
    return str(path)


def sockpath(local_uri: str) -> str:
    return local_uri.removeprefix("local://")


def ssh_uri(local_uri: str, authority: str = "node1") -> str:
    return f"ssh://{authority}{sockpath(local_uri)}"


def remote_cmd(err: str) -> list[str]:
    """The remote command line the stand-in was given (its ``cmd=`` line)."""
    line = next(s for s in err.splitlines() if s.startswith("cmd="))
    return shlex.split(line.removeprefix("cmd=").strip('"'))


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    path.chmod(0o755)
    return str(path)


# ------------------------------------------------------------------ 1-3


async def test_rundir_bin_holds_the_ranks_kvbroker_while_it_runs(
        start_instance, tmp_path: Path) -> None:
    inst = await start_instance(size=2)
    bindir = Path(inst.rundir) / "bin"
    exe = bindir / "kvbroker"
    assert bindir.is_dir() and exe.is_file() and os.access(exe, os.X_OK)
    assert not os.stat(exe).st_mode & 0o022  # (nobody else may change it)
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True,
                         env={"PATH": "/bin:/usr/bin"}, timeout=T)
    assert (out.returncode, out.stdout.split()[-1]) == (0, __version__), out

    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    rc, out_, err = await run_cli("start", "-s", "2", "--rundir", str(rundir), "--", "sh", "-c",
                                  f"test -x {rundir}/bin/kvbroker && echo there", timeout=T)
    assert (rc, out_) == (0, "there\n"), err
    assert list(rundir.iterdir()) == []  # (the last rank to stop took it away)


# ------------------------------------------------------------------ 5-10


async def test_a_command_reaches_the_rank_through_ssh(start_instance, tssh: str) -> None:
    inst = await start_instance(size=2)
    rc, out, err = await run_cli("attr", "get", "size", uri=ssh_uri(inst.uri(1)))
    assert (rc, out) == (0, "2\n"), err
    assert "hostname=node1\n" in err, err  # (ssh's stderr, passed on)
    assert remote_cmd(err)[-3:] == ["kvbroker", "relay", sockpath(inst.uri(1))], err


async def test_the_remote_path_puts_the_rundir_bin_first(
        start_instance, tssh: str, monkeypatch: pytest.MonkeyPatch) -> None:
    inst = await start_instance(size=1)
    uri = ssh_uri(inst.uri(0))
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 0, err
    words = remote_cmd(err)
    assert words[0] == "env" and words[1].startswith("PATH="), words
    path = words[1].removeprefix("PATH=").split(":")
    assert path[0] == f"{inst.rundir}/bin"
    assert os.path.dirname(KVBROKER) in path[1:]
    assert path[-2:] == ["/bin", "/usr/bin"]

    # the relay that ran is the rank's RUNDIR/bin/kvbroker (python -m broker.cli)
    async with asyncio.timeout(T):
        h = await Handle.connect(uri)
        try:
            [pid] = relays(sockpath(inst.uri(0)))
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
            assert argv[1:4] == [b"-P", b"-m", b"broker.cli"], argv
            assert (await h.rpc("broker.ping", {}))["rank"] == 0
        finally:
            await h.close()

    monkeypatch.setenv("KVBROKER_SSH_RCMD", KVBROKER)
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 0, err
    words = remote_cmd(err)
    assert words[0] == KVBROKER and not any(w.startswith("PATH=") for w in words), words


@pytest.mark.skipif(not os.path.exists("/bin/tcsh"), reason="no /bin/tcsh")
async def test_a_csh_login_shell_runs_the_relay(start_instance, tssh: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    inst = await start_instance(size=1)
    monkeypatch.setenv("SHELL", "/bin/tcsh")
    rc, out, err = await run_cli("attr", "get", "size", uri=ssh_uri(inst.uri(0)))
    assert (rc, out) == (0, "1\n"), err


# ------------------------------------------------------------------ 12-16


async def test_port_and_user_are_given_to_ssh(start_instance, tssh: str) -> None:
    inst = await start_instance(size=1)
    for authority, said in (("node1:42", ["port=42"]), ("fred@node1", ["user=fred"]),
                            ("fred@node1:42", ["port=42", "user=fred"])):
        rc, out, err = await run_cli("attr", "get", "size", uri=ssh_uri(inst.uri(0), authority))
        assert (rc, out) == (0, "1\n"), err
        lines = err.splitlines()
        assert all(s in lines for s in said) and "hostname=node1" in lines, (authority, err)
        assert remote_cmd(err)[-2:] == ["relay", sockpath(inst.uri(0))]


async def test_a_hundred_pings_through_ssh(start_instance, tssh: str) -> None:
    inst = await start_instance(size=2)
    rc, out, err = await run_cli("ping", "-c", "100", "-i", "0.001", "0",
                                 uri=ssh_uri(inst.uri(1)), timeout=T)
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 100 and all(s.startswith("rank=0 route=c") for s in lines), out


async def test_events_through_ssh(start_instance, tssh: str) -> None:
    inst = await start_instance(size=2)
    rc, _, err = await run_cli("module", "load", "heartbeat", "period=0.1s", uri=inst.uri(0))
    assert rc == 0, err
    rc, out, err = await run_cli("event", "sub", "--count=1", "heartbeat.pulse",
                                 uri=ssh_uri(inst.uri(1)), timeout=T)
    assert rc == 0 and out.startswith("heartbeat.pulse\t"), (out, err)
    rc, _, err = await run_cli("module", "remove", "heartbeat", uri=inst.uri(0))
    assert rc == 0, err


# ------------------------------------------------------------------ 21-28


async def test_bad_uris_and_commands_fail_at_connect(start_instance, tssh: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    inst = await start_instance(size=1)
    uri = ssh_uri(inst.uri(0))
    for bad in (f"{uri}?badarg=bar", "ssh://node1"):
        rc, _, err = await run_cli("attr", "get", "size", uri=bad)
        assert rc == 1 and f"bad ssh URI {bad!r}: expected ssh://" in err, err
        assert "hostname=" not in err  # (no ssh was run)

    monkeypatch.setenv("KVBROKER_SSH", "/noexist")
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 1, err
    assert "cannot run /noexist: No such file or directory (KVBROKER_SSH names" in err, err

    monkeypatch.setenv("KVBROKER_SSH", tssh)
    monkeypatch.setenv("KVBROKER_SSH_RCMD", "/nocmd")
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 1, err
    # what ssh and the remote shell said, in the message
    _, sep, said = err.partition("ssh to node1 ended before the relay answered: ")
    assert sep and said.startswith("hostname=node1\n"), err
    assert said.rstrip().endswith("/nocmd: not found"), err  # (the remote shell's words)


PY_OPEN = """\
import asyncio
from broker.handle import Handle

async def main():
    try:
        await asyncio.wait_for(Handle.connect(), 30)
    except OSError as err:
        print(f"Exception: errno={err.errno} msg={err.strerror}")

asyncio.run(main())
"""


async def python_open(uri: str) -> tuple[int, str, str]:
    env = dict(os.environ, KVBROKER_URI=uri)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PY_OPEN, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL)
    out, err = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_python_connect_says_what_ssh_said(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ssh = script(tmp_path, "ssh.sh", """\
        #!/bin/sh
        printf "error from ssh\\n" >&2
        exit 1
        """)
    monkeypatch.setenv("KVBROKER_SSH", ssh)
    rc, out, err = await python_open("ssh://node1/foo/bar")
    assert (rc, err) == (0, "")
    assert out == ("Exception: errno=113 msg=ssh to node1 ended before the relay answered: "
                   "error from ssh\n")


async def test_noise_before_the_relay_fails_at_once_with_a_hint(
        start_instance, tssh: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inst = await start_instance(size=1)
    uri = ssh_uri(inst.uri(0))
    bad = script(tmp_path, "kvbroker-bad.sh", f"""\
        #!/bin/sh
        echo foo
        exec {shlex.quote(KVBROKER)} "$@"
        """)
    monkeypatch.setenv("KVBROKER_SSH_RCMD", bad)
    hint = "do the shell's init files on that host write to standard output"
    rc, _, err = await run_cli("attr", "get", "size", uri=uri, timeout=T)
    assert rc == 1 and "node1: not a kvbroker relay: b'foo\\n'" in err and hint in err, err
    rc, out, err = await python_open(uri)
    assert rc == 0 and out.startswith("Exception: errno=71 msg=node1: not a kvbroker"), out
    assert hint in out
    # (the relay it started went with it)
    async def gone() -> bool:
        return relays(sockpath(inst.uri(0))) == []

    await wait_until(gone, "the relay to end", T)

