"""flux-core t/t0005-rexec.t (the broker's subprocess server, ``rexec``, as
driven by t/rexec/rexec.c and rexec_count_stdout/rexec_getline) against
real kvbroker ranks: a 4-rank instance, as Flux's ``test_under_flux 4``.

kvbroker's ``rexec`` (broker/rexec.py, docs/protocol.md "rexec") is built
into every rank.  Flux's test program ``rexec`` becomes a :class:`Handle`
speaking the RPCs (``rexec.exec`` streaming ``started``, ``output``,
``finished``; ``rexec.write``, ``rexec.kill``, ``rexec.list``), and, where
a user meets it, ``kvbroker exec`` on a rank of "another host" (its socket
file removed, so exec goes through the rank's ``rexec``, as across hosts).
Flux's ``flux sproc ps`` / ``kill`` are ``rexec.list`` / ``rexec.kill``
here (``kvbroker sproc`` itself, and background commands: their cases
are in tests/test_flux_conformance_t0040.py and tests/test_rexec.py).

Flux's cases, in order, and what each becomes:

1.-2. 'basic rexec functionality (process success / fail)', 12. 'propagates
    exit code' (0, 1, 2, 3) -> :func:`test_commands_run_and_their_status_is_relayed`
    (``finished`` carries the status; ``kvbroker exec`` exits with it).
3. 'cwd correct' -> same test: the client's ``cwd`` (exec sends its own).
4. 'env passed through' -> same test: the client's ``env`` (exec sends its own).
5.-7. 'echo stdout', 'echo stderr', 'echo stdout/err' -> same test: each
    stream relayed as its own, each with its end.
8. 'invalid rank' -> same test: ``EHOSTUNREACH`` (RPC and exec, nothing run).
9.-11. 'fail exec()' / 'EACCES' (``/``) / 'ENOENT' -> same test: the error
    answer carries execve's errno (``Permission denied``, ``No such file or
    directory``); exec says it as a shell does (126, 127).
13. 'check state changes' (Running, Exited) and 14. 'fail exec() (check
    state changes)' (Failed) -> :func:`test_state_changes`: ``started``
    (running, with its pid), then output, then ``finished`` (exited), then
    the end; a command that cannot start is one error answer, nothing
    before it (failed), counted in ``rexec.stats-get``.
15.-17. 'stdin', 'stdin / stdout multiple lines', 'long lines' (a 5464-byte
    line) -> :func:`test_input_and_long_lines` (RPC and exec), with a line
    longer than an answer carries (sent in pieces, nothing lost).
18.-21. channels ('channel FD created', 'channel input', 'input and
    output', 'multiple lines') -> do not apply: DIFFERENCE, documented
    (docs/protocol.md): a kvbroker command has stdin, stdout and stderr
    only, no extra socketpair channels; Flux uses them for its job shell's
    PMI, which kvbroker does not run.  A command that needs to talk to
    its client does it through the broker (its ``KVBROKER_URI``).
22. 'rexec kill' (SIGTERM once running: 143, "terminated by signal 15")
    -> :func:`test_kill_and_kill_group` (status ``-15``; ``kvbroker exec``
    passes a SIGTERM on, exits 143).
23. 'rexec kill group' (test_fork_sleep) -> same test: a shell that left a
    child in the background; the signal reaches the whole group.  Also
    for a rank started at a terminal (as its foreground job): FIXED, its
    commands shared the rank's process group, so a kill reached the shell
    alone and its child kept the output open
    (:func:`test_kill_group_of_a_rank_started_at_a_terminal`).
24.-25. 'kill process not yet running', 'kill with already pending signal
    gets error' (EINVAL) -> do not apply as such: a kvbroker client names
    a command by the pid ``started`` gives it, so there is no "not yet
    running" for it to signal, and no client-side pending-signal slot to
    be taken twice.  What is there: a kill sent on ``started`` ends it (in
    :func:`test_kill_and_kill_group`); a second kill once it has ended is
    ``ESRCH`` (:func:`test_kill_of_an_unknown_pid`).
26. 'rexec ps works' and 27. 'disconnect terminates all running processes'
    -> :func:`test_list_and_disconnect`: NEW ``rexec.list`` (Flux's
    ``rexec.list``: pid and command of each running, ``mine`` for the
    asking client's); a client that goes takes its commands.
28.-30. line buffering (default, true, false) and 31. 'read_getline call
    works on remote streams' (a last line without a newline) ->
    :func:`test_line_buffering`: NEW ``line-buffered`` (default true, as
    Flux's): each output answer is whole lines; a line's start is held
    until its end comes; with false, output is sent as read.
32. 'configure access.allow-guest-user = true' -> an instance started with
    it (kvbroker's access is fixed at start, not reloaded).
33.-35. 'get URI for rank 1', 'rexec from rank 0 to rank 1 / from rank 1 to
    rank 1 works' -> :func:`test_multi_user_instance_rank_0_is_local_only`.
36. 'rexec from rank 1 to rank 0 is restricted' and 38. 'ps, kill fail
    remotely on rank 0' -> same test: FIXED (was: any owner request
    served, wherever it came from): rank 0 of a multi-user instance
    serves ``rexec`` to its own clients only, ``EPERM`` otherwise, as
    Flux's (rank 0 of a system instance is the management node); exec -r 0
    from another host fails, nothing run.
37. 'ps, kill work locally on rank 0' -> same test: one client lists and
    kills the command another started: FIXED (``rexec.kill`` took only
    the client's own commands; Flux's ``sproc kill`` takes any pid listed).
39.-40. 'allow-guest-user = false', 'rexec from rank 1 to rank 0 works' ->
    in :func:`test_commands_run_and_their_status_is_relayed` (an instance
    without guests: rank 1's client runs on rank 0).
41. 'kill fails with ESRCH when pid is unknown' ("does not belong to any
    subprocess") -> :func:`test_kill_of_an_unknown_pid`.

Guests: ``rexec`` is the instance owner's on every rank (a guest is
``EPERM`` everywhere; Flux's rexec module is owner-only too): pinned in
tests/test_rexec.py (test_a_guest_is_refused).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import pid_alive
from test_broker_guests import ALLOW
from test_broker_support import KVBROKER, run_cli, run_program, wait_until
from test_cli_broker import TAKE_TERMINAL
from test_multihost import brokers, keyed_config  # noqa: F401 (a fixture)
from test_rexec import answers, output

from broker.errors import RemoteError
from broker.handle import Handle
from broker.rexec import READ_CHUNK

T = 20.0
SIZE = 4
PATH = {"PATH": os.environ["PATH"]}


async def run(h: Any, rank: int, cmd: list[str], **kw: Any) -> list[dict[str, Any]]:
    """``cmd`` on ``rank`` through ``rexec.exec``: every answer, the end excepted."""
    return await answers(h.rpc_stream("rexec.exec", {"cmd": cmd, **kw}, nodeid=rank))


async def started(stream: Any) -> int:
    first = await asyncio.wait_for(anext(aiter(stream)), T)
    assert first["type"] == "started", first
    return int(first["pid"])


def data(got: list[dict[str, Any]], name: str = "stdout") -> list[bytes]:
    """The output answers' data, one per answer, of stream ``name``."""
    return [a["data"] for a in got if a["type"] == "output" and a["stream"] == name
            and "data" in a]


def remote(inst: Any, rank: int) -> None:
    """Make ``rank`` look as if it ran on another host: exec goes through its rexec."""
    os.unlink(Path(inst.rundir) / f"local-{rank}")


async def procs(h: Any, rank: int) -> list[dict[str, Any]]:
    answer = await h.rpc("rexec.list", nodeid=rank)
    assert answer["rank"] == rank
    return list(answer["procs"])


async def test_commands_run_and_their_status_is_relayed(start_instance, connect,
                                                        tmp_path: Path) -> None:
    """Flux 1-12 and 39-40: through the RPC and through ``kvbroker exec``
    on a "remote" rank."""
    inst = await start_instance(size=SIZE, fanout=2)
    h = await connect(inst, 0)
    one = await connect(inst, 1)
    results = await asyncio.gather(
        *(run(h, 3, ["sh", "-c", f"exit {code}"]) for code in (0, 1, 2, 3)),
        run(h, 3, ["pwd"], cwd="/tmp"),
        run(h, 3, ["env"], env={"FOO_BAR_BAZ": "10", **PATH}),
        run(h, 3, ["sh", "-c", "echo foobar.stdout"]),
        run(h, 3, ["sh", "-c", "echo foobar.stderr >&2"]),
        run(h, 3, ["sh", "-c", "echo foobar.stdouterr; echo foobar.stdouterr >&2"]),
        run(one, 0, ["true"]))  # (Flux 40: rank 1 to rank 0, no guests allowed)
    assert [r[-1]["status"] for r in results[:4]] == [0, 1, 2, 3]
    assert output(results[4], "stdout") == b"/tmp\n"
    assert "FOO_BAR_BAZ=10" in output(results[5], "stdout").decode().splitlines()
    assert (output(results[6], "stdout"), output(results[6], "stderr")) == (
        b"foobar.stdout\n", b"")
    assert (output(results[7], "stdout"), output(results[7], "stderr")) == (
        b"", b"foobar.stderr\n")
    assert (output(results[8], "stdout"), output(results[8], "stderr")) == (
        b"foobar.stdouterr\n", b"foobar.stdouterr\n")
    assert results[9][0]["rank"] == 0 and results[9][-1]["status"] == 0
    for got in results:
        ends = sorted(a["stream"] for a in got if a["type"] == "output" and a.get("eof"))
        assert ends == ["stderr", "stdout"]
    for cmd, errnum, text in [(["/"], errno.EACCES, "Permission denied"),
                              (["/usr/bin/foobarbaz"], errno.ENOENT,
                               "No such file or directory")]:
        with pytest.raises(RemoteError) as err:
            await run(h, 3, cmd)
        assert err.value.errnum == errnum and text in err.value.errstr, err.value
    with pytest.raises(RemoteError) as err:
        await run(h, 32, ["true"])
    assert err.value.errnum == errno.EHOSTUNREACH

    remote(inst, 3)  # kvbroker exec -r 3: through rank 3's rexec
    uri = inst.uri(0)
    env = dict(os.environ, FOO_BAR_BAZ="10")
    cli = await asyncio.gather(
        *(run_cli("exec", "-r", "3", "--", "sh", "-c", f"exit {code}", uri=uri)
          for code in (0, 1, 2, 3)),
        run_cli("exec", "-r", "3", "--", "sh", "-c",
                'echo "$(pwd) $FOO_BAR_BAZ $KVBROKER_RANK"; echo err >&2', uri=uri,
                env=env, cwd=tmp_path),
        run_cli("exec", "-r", "3", "--", "/", uri=uri),
        run_cli("exec", "-r", "3", "--", "/usr/bin/foobarbaz", uri=uri),
        run_cli("exec", "-r", "32", "--", "true", uri=uri))
    assert [c[0] for c in cli[:4]] == [0, 1, 2, 3]
    assert cli[4] == (0, f"{tmp_path} 10 3\n", "err\n")
    assert cli[5][0] == 126 and "kvbroker: /: Permission denied" in cli[5][2], cli[5]
    assert cli[6][0] == 127 and "foobarbaz: No such file or directory" in cli[6][2], cli[6]
    assert cli[7][0] == 1 and "No route to host" in cli[7][2], cli[7]


async def test_state_changes(start_instance, connect) -> None:
    """Flux 13-14: running (``started``), exited (``finished``) in order;
    failed: one error answer, nothing before it."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    got = await run(h, 1, ["sh", "-c", "echo out"])
    kinds = [a["type"] for a in got]
    assert kinds[0] == "started" and kinds[-1] == "finished"
    assert set(kinds[1:-1]) == {"output"}
    stream = h.rpc_stream("rexec.exec", {"cmd": ["/"]}, nodeid=1)
    seen: list[Any] = []
    with pytest.raises(RemoteError) as err:
        async with asyncio.timeout(T):
            async for answer in stream:
                seen.append(answer)
    assert seen == [] and err.value.errnum == errno.EACCES
    stats = await h.rpc("rexec.stats-get", nodeid=1)
    assert (stats["started"], stats["finished"], stats["failed-to-start"]) == (1, 1, 1)


async def test_input_and_long_lines(start_instance, connect, tmp_path: Path) -> None:
    """Flux 15-17: input written then closed; several lines; a long line
    (and one longer than an answer carries) comes back whole."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)

    async def with_input(cmd: list[str], chunks: list[bytes]) -> list[dict[str, Any]]:
        stream = h.rpc_stream("rexec.exec", {"cmd": cmd, "stdin": True}, nodeid=1)
        pid = await started(stream)
        for i, chunk in enumerate(chunks):
            await h.rpc("rexec.write", {"pid": pid, "data": chunk,
                                        "eof": i == len(chunks) - 1}, nodeid=1)
        return await answers(stream)

    got = await with_input(["sh", "-c", "tee /dev/stderr"], [b"hello"])
    assert (output(got, "stdout"), output(got, "stderr")) == (b"hello", b"hello")
    assert got[-1]["status"] == 0
    got = await with_input(["cat"], [b"foo\nbar\n", b"baz\n"])
    assert output(got, "stdout") == b"foo\nbar\nbaz\n"

    line = base64.b64encode(os.urandom(4096))  # (5464 bytes, no newline)
    huge = base64.b64encode(os.urandom(3 * READ_CHUNK))
    (tmp_path / "expected").write_bytes(line)
    (tmp_path / "huge").write_bytes(huge)
    got = await run(h, 1, ["cat", str(tmp_path / "expected")])
    assert output(got, "stdout") == line
    got = await run(h, 1, ["cat", str(tmp_path / "huge")])
    assert output(got, "stdout") == huge
    assert max(len(d) for d in data(got)) <= READ_CHUNK

    remote(inst, 1)
    rc, out, err = await run_cli("exec", "-r", "1", "--", "cat", uri=inst.uri(0),
                                 input=b"foo\nbar\nbaz\n")
    assert (rc, out, err) == (0, "foo\nbar\nbaz\n", "")
    rc, out, err = await run_cli("exec", "-r", "1", "--", "cat", str(tmp_path / "expected"),
                                 uri=inst.uri(0))
    assert (rc, out.encode(), err) == (0, line, "")


async def test_kill_and_kill_group(start_instance, connect) -> None:
    """Flux 22-24: SIGTERM once running ends it (status -15; exec: 143); to
    a shell with a child in the background it reaches both."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    stream = h.rpc_stream("rexec.exec", {"cmd": ["sleep", "59.1"]}, nodeid=1)
    pid = await started(stream)
    await h.rpc("rexec.kill", {"pid": pid, "signum": int(signal.SIGTERM)}, nodeid=1)
    assert (await answers(stream))[-1] == {"type": "finished", "status": -signal.SIGTERM}

    await kill_group(h, 1)

    remote(inst, 1)
    env = dict(os.environ, KVBROKER_URI=inst.uri(0))
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "exec", "-r", "1", "--", "sleep", "59.2", env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async def running() -> bool:
            return any(p["cmd"] == ["sleep", "59.2"] for p in await procs(h, 1))

        await wait_until(running, "exec's command to run on rank 1")
        proc.send_signal(signal.SIGTERM)  # (exec passes it on)
        out, err = await asyncio.wait_for(proc.communicate(), T)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert b"rank 1: Terminated" in err, err
    assert await procs(h, 1) == []


async def kill_group(h: Any, rank: int) -> None:
    """A shell that started a child in the background and waits for it:
    SIGTERM to the command ends both (the child held the output open)."""
    stream = h.rpc_stream("rexec.exec", {"cmd": ["sh", "-c", "sleep 58.9 & echo $!; wait"]},
                          nodeid=rank)
    pid = await started(stream)
    line = await asyncio.wait_for(anext(aiter(stream)), T)
    child = int(line["data"])
    assert pid_alive(child)
    await h.rpc("rexec.kill", {"pid": pid, "signum": int(signal.SIGTERM)}, nodeid=rank)
    assert (await answers(stream))[-1] == {"type": "finished", "status": -signal.SIGTERM}

    async def gone() -> bool:
        return not pid_alive(child)

    await wait_until(gone, "the background child to be killed with its group")


async def test_kill_group_of_a_rank_started_at_a_terminal(tmp_path: Path, brokers) -> None:  # noqa: F811
    """Flux 23, for a rank run at a terminal's prompt (``kvbroker broker``
    on a host, in the foreground): its rexec commands lead groups of
    their own all the same, so a kill reaches the command's children."""
    config = await keyed_config(tmp_path, 1, 2)
    rundir = tmp_path / "run"
    master, slave = os.openpty()
    log = open(tmp_path / "stderr", "wb")  # noqa: SIM115 (closed below)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", TAKE_TERMINAL, KVBROKER, "broker", "--config", str(config),
        "--rank", "0", "--rundir", str(rundir), stdin=slave, stdout=subprocess.PIPE,
        stderr=log, start_new_session=True)
    os.close(slave)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), T)).decode()
        assert line.startswith("ready "), (line, (tmp_path / "stderr").read_text())
        h = await asyncio.wait_for(Handle.connect(line.split()[1]), T)
        try:
            await kill_group(h, 0)
        finally:
            await h.close()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        os.close(master)
        log.close()


async def test_list_and_disconnect(start_instance, connect) -> None:
    """Flux 26-27 (and 37's kill of another client's command): two clients'
    commands are listed (``mine`` for the asker's own); another client may
    kill one; a client that goes takes its own with it."""
    inst = await start_instance(size=2)
    a, b, watcher = [await connect(inst, 0) for _ in range(3)]
    streams = [c.rpc_stream("rexec.exec", {"cmd": ["sleep", "100"]}, nodeid=1)
               for c in (a, b)]
    pids = [await started(s) for s in streams]
    listed = await procs(watcher, 1)
    assert sorted(p["pid"] for p in listed) == sorted(pids)
    assert all(p["cmd"] == ["sleep", "100"] and not p["mine"] for p in listed)
    assert [p["pid"] for p in await procs(a, 1) if p["mine"]] == [pids[0]]
    await a.close()
    await b.close()

    async def none() -> bool:
        return await procs(watcher, 1) == []

    await wait_until(none, "the gone clients' commands to end")

    async def dead() -> bool:  # (killed at the disconnect; reaped a moment later)
        return not any(pid_alive(p) for p in pids)

    await wait_until(dead, "the killed commands to be reaped")
    assert (await watcher.rpc("rexec.stats-get", nodeid=1))["killed-at-disconnect"] == 2


async def test_line_buffering(start_instance, connect) -> None:
    """Flux 28-31: by default each output answer is whole lines (a line's
    start waits for its end; a last line without a newline comes at the
    end); ``line-buffered: false`` sends output as it is read."""
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    got = await run(h, 1, ["sh", "-c", "yes hi | head -n 2200"])
    chunks = data(got)
    assert b"".join(chunks) == b"hi\n" * 2200 and all(c.endswith(b"\n") for c in chunks)

    piece = ["sh", "-c", 'printf abc; read x; echo "def$x"']
    for buffered in (True, False):
        stream = h.rpc_stream("rexec.exec", {"cmd": piece, "stdin": True,
                                             "line-buffered": buffered}, nodeid=1)
        pid = await started(stream)
        if not buffered:  # "abc" comes as it is, before the rest is written
            first = await asyncio.wait_for(anext(aiter(stream)), T)
            assert first == {"type": "output", "stream": "stdout", "data": b"abc"}
        await h.rpc("rexec.write", {"pid": pid, "data": b"X\n", "eof": True}, nodeid=1)
        got = await answers(stream)
        assert data(got) == ([b"abcdefX\n"] if buffered else [b"defX\n"]), got

    stream = h.rpc_stream("rexec.exec", {"cmd": ["cat"], "stdin": True}, nodeid=1)
    pid = await started(stream)
    await h.rpc("rexec.write", {"pid": pid, "data": b"foo\nbar", "eof": True}, nodeid=1)
    assert data(await answers(stream)) == [b"foo\n", b"bar"]
    with pytest.raises(RemoteError) as err:
        await run(h, 1, ["true"], **{"line-buffered": "yes"})
    assert err.value.errnum == errno.EPROTO


async def test_multi_user_instance_rank_0_is_local_only(start_instance, connect) -> None:
    """Flux 32-38: with guests allowed, rank 0 serves ``rexec`` to its own
    clients only; the others' requests (from rank 1) are ``EPERM``, for
    exec, list and kill alike.  Rank 1 serves both; rank 0's own clients
    list and kill what another of them started."""
    inst = await start_instance(size=2, attrs=ALLOW)
    zero, zero_b = await connect(inst, 0), await connect(inst, 0)
    got = await run(zero, 1, ["sh", "-c", 'echo "$KVBROKER_URI"'])
    uri1 = output(got, "stdout").decode().strip()
    assert uri1 == inst.uri(1)
    one = await asyncio.wait_for(Handle.connect(uri1), T)
    try:
        assert await one.attr_get("rank") == 1
        assert (await run(zero, 0, ["true"]))[-1]["status"] == 0
        assert (await run(one, 1, ["true"]))[-1]["status"] == 0
        with pytest.raises(RemoteError) as err:
            await run(one, 0, ["true"])
        assert err.value.errnum == errno.EPERM and "multi-user" in err.value.errstr

        stream = zero.rpc_stream("rexec.exec", {"cmd": ["sleep", "3600"]}, nodeid=0)
        pid = await started(stream)
        assert [p["pid"] for p in await procs(zero_b, 0)] == [pid]
        for topic, payload in (("rexec.list", {}),
                               ("rexec.kill", {"pid": pid, "signum": 15})):
            with pytest.raises(RemoteError) as err:
                await one.rpc(topic, payload, nodeid=0)
            assert err.value.errnum == errno.EPERM, topic
        await zero_b.rpc("rexec.kill", {"pid": pid, "signum": 15}, nodeid=0)
        assert (await answers(stream))[-1]["status"] == -15
        assert await procs(zero_b, 0) == []
    finally:
        await one.close()

    remote(inst, 0)  # exec -r 0 from rank 1 is refused there, nothing run
    rc, out, err = await run_cli("exec", "-r", "0", "--", "echo", "ran", uri=uri1)
    assert (rc, out) == (1, ""), err
    assert err.startswith("kvbroker: exec: rank 0: rexec requests from other ranks are not "
                          "allowed on rank 0 of a multi-user instance"), err


async def test_kill_of_an_unknown_pid(start_instance, connect) -> None:
    """Flux 41 (and 25's second kill): a pid that is no command of the rank
    -- never was, or has ended -- is ``ESRCH``, said as Flux says it."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    for topic in ("rexec.kill", "rexec.write"):
        with pytest.raises(RemoteError) as err:
            await h.rpc(topic, {"pid": 12345678, "signum": 15, "data": b""}, nodeid=1)
        assert err.value.errnum == errno.ESRCH, topic
    with pytest.raises(RemoteError) as err:
        await h.rpc("rexec.kill", {"pid": 12345678, "signum": 15}, nodeid=1)
    assert "pid 12345678 does not belong to any command of rank 1" in err.value.errstr
    stream = h.rpc_stream("rexec.exec", {"cmd": ["sleep", "59.3"]}, nodeid=1)
    pid = await started(stream)
    await h.rpc("rexec.kill", {"pid": pid, "signum": 15}, nodeid=1)
    await answers(stream)
    with pytest.raises(RemoteError) as err:
        await h.rpc("rexec.kill", {"pid": pid, "signum": 15}, nodeid=1)
    assert err.value.errnum == errno.ESRCH


@pytest.mark.parametrize("cmd", [["yes"], ["seq", "1", "2000000"]])
async def test_a_closed_output_ends_commands_of_another_host_as_local_ones(
        start_instance, connect, cmd: list[str]) -> None:
    """``kvbroker exec ... | head -2``: exec's output closed, the commands
    of ranks on another host end as those of this host do -- at their next
    write, by SIGPIPE -- and exec exits 141.  Through ``rexec`` it waited
    for ever (a probe): the output it no longer read was never credited,
    so each command stopped, waiting for credit, and never ended."""
    inst = await start_instance(size=SIZE)
    h = await connect(inst, 0)
    remote(inst, 2)
    remote(inst, 3)
    _, out, err = await run_program(
        "bash", "-c", f'{KVBROKER} exec -r 2-3 -- "$@" | head -2; echo "${{PIPESTATUS[0]}}"',
        "sh", *cmd, env=dict(os.environ, KVBROKER_URI=inst.uri(0)), timeout=T)
    assert out.splitlines()[-1] == "141", (out, err)
    for rank in (2, 3):
        assert await procs(h, rank) == []
