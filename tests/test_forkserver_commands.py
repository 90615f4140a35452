"""``kvbroker`` commands served by the fork server (broker/forkclient.py):
the command runs in a fork of the server, the process started stands in
for it, and what anyone sees of the command -- its output, errors, exit
status, the files it writes, its answer to signals -- is what an executed
one gives.  Each test starts a server of its own (the suite's, from
conftest, serves the other tests' commands too)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_broker_spawner import stat_of
from test_broker_support import KVBROKER, wait_until
from test_watch_helpers import wait_watchers

from broker import forkclient, forkserver
from broker.handle import Handle
from broker.launch import Instance

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"),
                                reason="Linux's pidfds and /proc")

T = 30.0


INTERACTIVE = (signal.SIGINT, signal.SIGQUIT)
"""Signals a shell's background job ignores (a test worker may run so):
the server and the commands here start with them as an interactive
command would, so that a Ctrl-C is a ``KeyboardInterrupt``."""


def interactive() -> None:
    for sig in INTERACTIVE:
        signal.signal(sig, signal.SIG_DFL)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A fork server of this test's, and its socket's path."""
    where = tmp_path / "fs"
    where.mkdir(mode=0o700)
    kept = {sig: signal.signal(sig, signal.SIG_DFL) for sig in INTERACTIVE}
    try:  # (started with them, as the commands will be)
        proc = forkserver.start_server(str(where / "sock"))
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    yield proc, str(where / "sock")
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(T)


def env_for(uri: str, served: str | None) -> dict[str, str]:
    """The environment of a command attached to ``uri``, asking the server
    at ``served`` (or none)."""
    env = {k: v for k, v in os.environ.items() if k != forkclient.FORKSERVER_ENV}
    env["KVBROKER_URI"] = uri
    if served is not None:
        env[forkclient.FORKSERVER_ENV] = served
    return env


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if stat_of(int(entry))[1] == pid:
                    out.append(int(entry))
            except (OSError, ValueError):
                continue
    return out


def cmdline(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().rstrip(b"\0").split(b"\0")


async def served_child(server_pid: int, stand_in: int) -> int:
    """The server's child that runs the command ``stand_in`` stands in for
    (it shows the stand-in's command line)."""
    found: list[int] = []

    async def forked() -> bool:
        want = cmdline(stand_in)
        found[:] = [p for p in children_of(server_pid) if cmdline(p) == want]
        return bool(found)

    await wait_until(forked, "the server to fork the command")
    return found[0]


COMMANDS: list[tuple[list[str], bytes]] = [
    (["kvs", "put", "a=1"], b""),
    (["kvs", "get", "a"], b""),
    (["kvs", "get", "nope"], b""),  # an error: status 1 and a line on stderr
    (["kvs", "nosuch"], b""),  # a usage error: status 2 and the usage
    (["kvs", "put", "-r", "b=-"], b"from standard input\n"),
    (["kvs", "get", "b"], b""),
    (["attr", "get", "rank"], b""),  # the rank $KVBROKER_URI names: the stand-in's
    (["kvs", "dump", "dumped.tar"], b""),  # a file in the working directory
]


async def test_a_served_command_answers_as_an_executed_one(server, tmp_path: Path) -> None:
    """Each command gives the same status, output and errors served as
    executed, reads its stand-in's standard input, and writes into its
    working directory with its umask."""
    _, sock = server
    async with Instance(2) as inst:
        seen: dict[str | None, list[Any]] = {}
        for served in (sock, None):
            work = tmp_path / ("served" if served else "executed")
            work.mkdir()
            seen[served] = []
            for argv, given in COMMANDS:
                r = subprocess.run([KVBROKER, *argv], input=given, capture_output=True,
                                   env=env_for(inst.uri(1), served), cwd=work, umask=0o077,
                                   preexec_fn=interactive, timeout=T)
                seen[served].append((argv, r.returncode, r.stdout, r.stderr))
            dumped = work / "dumped.tar"
            seen[served].append(oct(dumped.stat().st_mode & 0o777))
        assert seen[sock] == seen[None]
    by_argv = {tuple(entry[0]): entry[1:] for entry in seen[sock][:-1]}
    assert by_argv[("kvs", "get", "b")] == (0, b"from standard input\n\n", b"")
    assert by_argv[("attr", "get", "rank")][:2] == (0, b"1\n")
    assert by_argv[("kvs", "get", "nope")][0] == 1
    assert by_argv[("kvs", "nosuch")][0] == 2
    assert seen[sock][-1] == "0o600"


async def watching(inst: Instance, sock: str | None,
                   preexec: Any = interactive) -> asyncio.subprocess.Process:
    """``kvbroker kvs get --watch a`` on rank 1, once it has printed the
    value: its watch is running."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "kvs", "get", "--watch", "--count", "5", "a",
        env=env_for(inst.uri(1), sock), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, preexec_fn=preexec)
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), T) == b"1\n"
    return proc


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
async def test_a_signal_to_the_stand_in_reaches_the_command_and_both_end_alike(
        server, sig: signal.Signals) -> None:
    """The stand-in passes the signal on; the command ends as an executed
    one does (``SIGINT``: status 130, quietly; others: killed by it), and
    the stand-in ends the same way.  Its watch ends on the rank."""
    proc_server, sock = server
    async with Instance(2) as inst:
        async with Handle.connect(inst.uri(0)) as h:
            await h.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
                {"key": "a", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"1\n"}}]})
            ends = {}
            for served in (sock, None):
                proc = await watching(inst, served)
                if served:
                    child = await served_child(proc_server.pid, proc.pid)
                proc.send_signal(sig)
                out, err = await asyncio.wait_for(proc.communicate(), T)
                ends[served] = (proc.returncode, out, err)
                await wait_watchers(h, 0, nodeid=1)
            assert not os.path.exists(f"/proc/{child}")  # (reaped by the server)
    assert ends[sock] == ends[None]
    assert ends[sock][0] == (130 if sig == signal.SIGINT else -sig)


async def test_a_stand_in_killed_takes_its_command_with_it(server) -> None:
    """``SIGKILL`` cannot be passed on: the command sees its stand-in's
    connection close and kills itself, so its watch ends too."""
    proc_server, sock = server
    async with Instance(2) as inst:
        async with Handle.connect(inst.uri(0)) as h:
            await h.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
                {"key": "a", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"1\n"}}]})
            proc = await watching(inst, sock)
            child = await served_child(proc_server.pid, proc.pid)
            proc.kill()
            assert await proc.wait() == -signal.SIGKILL

            async def gone() -> bool:
                return not os.path.exists(f"/proc/{child}")

            await wait_until(gone, "the served command to end")
            await wait_watchers(h, 0, nodeid=1)


def _lower_nofile() -> None:
    interactive()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512) - 1, hard))


async def test_a_stand_in_whose_start_differs_runs_its_command_itself(server) -> None:
    """A stand-in whose start differs from the server's (here an rlimit)
    runs the command itself, as without a server: nothing is forked."""
    proc_server, sock = server
    async with Instance(2) as inst:
        async with Handle.connect(inst.uri(0)) as h:
            await h.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
                {"key": "a", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"1\n"}}]})
        proc = await watching(inst, sock, preexec=_lower_nofile)
        try:
            assert children_of(proc_server.pid) == []
        finally:
            proc.terminate()
            await proc.communicate()


@pytest.mark.parametrize("how", ["closed streams", "not served"])
async def test_a_command_the_server_may_not_serve_runs_in_place(server, how: str) -> None:
    """A command whose standard streams cannot all be passed on (one
    closed), or that is not one the server serves (``kvs lease run``, which
    runs a command of its own), runs in the process started: a closed
    stream is handled as ever (docs/cli.md), and the command ``lease run``
    starts is that process's child.  With standard input closed, the
    connection to the server took descriptor 0, and was passed on as the
    command's standard input: ``kvs put -r b=-`` read it for ever."""
    _, sock = server
    async with Instance(2) as inst:
        env = env_for(inst.uri(1), sock)
        if how == "closed streams":
            def sh(script: str, *argv: str) -> tuple[int, bytes, bytes]:
                r = subprocess.run(["sh", "-c", script, "sh", KVBROKER, *argv],
                                   capture_output=True, env=env, timeout=T,
                                   preexec_fn=interactive)
                return r.returncode, r.stdout, r.stderr

            assert sh('"$@"', "kvs", "put", "a=1")[0] == 0
            assert sh('"$@" <&-', "kvs", "put", "-r", "b=-") == (
                1, b"", b"kvbroker: kvs put: standard input: Bad file descriptor\n")
            assert sh('"$@" >&-', "kvs", "get", "a") == (0, b"", b"")
            assert sh('"$@" <&-', "kvs", "get", "a") == (0, b"1\n", b"")
            return
        assert not forkclient.servable(["kvs", "lease", "run", "5", "--", "true"])
        proc = subprocess.Popen([KVBROKER, "kvs", "lease", "run", "5", "--", "sh", "-c",
                                 "echo $PPID"], stdout=subprocess.PIPE, env=env,
                                preexec_fn=interactive)
        out, _ = proc.communicate(timeout=T)
        assert proc.returncode == 0
        assert int(out) == proc.pid


@pytest.mark.parametrize("argv, served", [
    (["kvs", "get", "a"], True),
    (["--event-loop", "asyncio", "kvs", "get", "a"], True),
    (["-V"], False),
    ([], False),
    (["start", "-s", "2"], False),
    (["broker", "--config", "x"], False),
    (["exec", "-r", "all", "true"], False),
    (["kvs", "lease", "run", "5", "--", "true"], False),
    (["--", "kvs", "get"], False),
    (["ping", "1"], True),
])
def test_which_commands_are_served(argv: list[str], served: bool) -> None:
    assert forkclient.servable(argv) is served


def test_a_request_is_json_as_the_json_module_writes_it() -> None:
    """The stand-in writes its request without :mod:`json`: byte for byte
    what ``json.dumps`` writes, for every kind of value a request holds
    (a name that is not UTF-8 is a surrogate escape, as ``os.fsdecode``
    makes it)."""
    value = {"kind": "command", "argv": ["kvbroker", "kvs", "put", "k=\u00e9\u20ac\U0001f600"],
             "env": {"A": os.fsdecode(b"\xff\xfe"), "B": "\"quoted\"\\\n\t"},
             "umask": 18, "flags": [0, 1, True, False, None], "empty": {}, "none": [],
             "nested": {"x": [[1, 2], {"y": -3}]}}
    assert forkclient.to_json(value) == json.dumps(value)
    with pytest.raises(TypeError):
        forkclient.to_json({"x": 1.5})


def test_a_malformed_command_request_is_refused_and_the_server_serves_on(server) -> None:
    """A command request missing a field is answered ``no`` and closed."""
    proc_server, sock = server
    request = json.dumps({"kind": "command", "argv": ["kvbroker", "kvs", "get", "a"]}).encode()
    r, w = os.pipe()
    try:
        fd = forkclient.send_request(sock, request, [r, w, w])
    finally:
        os.close(r)
        os.close(w)
    assert fd is not None
    with open(fd, "rb") as conn:
        assert conn.readline() == b"no a malformed request\n"
    r = subprocess.run([KVBROKER, "kvs", "nosuch"], capture_output=True, timeout=T,
                       env={**os.environ, forkclient.FORKSERVER_ENV: sock},
                       preexec_fn=interactive)
    assert r.returncode == 2 and b"invalid choice" in r.stderr
    assert proc_server.poll() is None
