"""The ``rexec`` service (broker/rexec.py): a rank runs a command for a
client elsewhere, as Flux's subprocess server does for ``flux exec``.
Real ranks, real processes; the client is a plain :class:`Handle` speaking
the protocol (docs/protocol.md, "rexec").  ``kvbroker exec`` across hosts
is in tests/test_multihost.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
import textwrap
from typing import Any

import pytest
from conftest import pid_alive
from test_broker_guests import ALLOW, run_guest_cli
from test_broker_support import run_cli, wait_until

from broker.errors import RemoteError
from broker.handle import Handle
from broker.rexec import OUTPUT_WINDOW, READ_CHUNK, RETAINED_OUTPUT

T = 20.0


async def answers(stream: Any) -> list[dict[str, Any]]:
    out = []
    async with asyncio.timeout(T):
        async for answer in stream:
            out.append(answer)
    return out


def output(got: list[dict[str, Any]], name: str) -> bytes:
    return b"".join(a.get("data", b"") for a in got
                    if a["type"] == "output" and a["stream"] == name)


async def test_a_command_runs_on_the_rank_asked(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    got = await answers(h.rpc_stream("rexec.exec", {
        "cmd": ["sh", "-c", 'echo "$KVBROKER_RANK $KVBROKER_URI $MARK $(pwd)"; echo e >&2; '
                'exit 5'],
        "env": {"MARK": "mine", "PATH": os.environ["PATH"]}, "cwd": "/"}, nodeid=1))
    assert got[0]["type"] == "started" and got[0]["rank"] == 1 and got[0]["pid"] > 0
    assert output(got, "stdout") == f"1 {inst.uri(1)} mine /\n".encode()
    assert output(got, "stderr") == b"e\n"
    ends = [a["stream"] for a in got if a["type"] == "output" and a.get("eof")]
    assert sorted(ends) == ["stderr", "stdout"]
    assert got[-1] == {"type": "finished", "status": 5}  # (then ENODATA: the end)


async def test_input_signals_and_errors(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    cat = h.rpc_stream("rexec.exec", {"cmd": ["cat"], "stdin": True}, nodeid=1)
    started = await asyncio.wait_for(anext(aiter(cat)), T)
    pid = started["pid"]
    await h.rpc("rexec.write", {"pid": pid, "data": b"abc"}, nodeid=1)
    await h.rpc("rexec.write", {"pid": pid, "data": b"def", "eof": True}, nodeid=1)
    got = await answers(cat)
    assert output(got, "stdout") == b"abcdef" and got[-1]["status"] == 0
    with pytest.raises(RemoteError) as err:  # (it has ended)
        await h.rpc("rexec.write", {"pid": pid, "data": b"x"}, nodeid=1)
    assert err.value.errnum == errno.ESRCH

    sleeper = h.rpc_stream("rexec.exec", {"cmd": ["sleep", "58.5"]}, nodeid=1)
    pid = (await asyncio.wait_for(anext(aiter(sleeper)), T))["pid"]
    with pytest.raises(RemoteError) as err:  # (stdin was not asked for)
        await h.rpc("rexec.write", {"pid": pid, "data": b"x"}, nodeid=1)
    assert err.value.errnum == errno.EPIPE
    with pytest.raises(RemoteError) as err:
        await h.rpc("rexec.kill", {"pid": pid, "signum": 999}, nodeid=1)
    assert err.value.errnum == errno.EINVAL
    await h.rpc("rexec.kill", {"pid": pid, "signum": int(signal.SIGTERM)}, nodeid=1)
    assert (await answers(sleeper))[-1] == {"type": "finished", "status": -signal.SIGTERM}

    for payload, errnum, text in [
            ({"cmd": ["nosuchcommand-x"]}, errno.ENOENT, "nosuchcommand-x"),
            ({"cmd": []}, errno.EPROTO, "not empty"),
            ({"cmd": ["true"], "env": {"A": 1}}, errno.EPROTO, "env"),
            ({"cmd": ["true"], "cwd": "/nonexistent-dir"}, errno.ENOENT, "/nonexistent-dir"),
            ({"cmd": ["x" * (1 << 20)]}, errno.E2BIG, "bytes")]:
        with pytest.raises(RemoteError) as err:
            await answers(h.rpc_stream("rexec.exec", payload, nodeid=1))
        assert err.value.errnum == errnum and text in err.value.errstr, (payload, err.value)
    with pytest.raises(RemoteError) as err:  # a plain request: it streams
        await h.rpc("rexec.exec", {"cmd": ["true"]}, nodeid=1)
    assert err.value.errnum == errno.EPROTO
    with pytest.raises(RemoteError) as err:
        await h.rpc("rexec.kill", {"pid": os.getpid(), "signum": 15}, nodeid=1)
    assert err.value.errnum == errno.ESRCH  # (not one of ours: not reachable)
    stats = await h.rpc("rexec.stats-get", nodeid=1)
    assert stats["started"] == 2 and stats["running"] == 0 and stats["failed-to-start"] == 1


async def test_a_client_that_goes_takes_its_commands(start_instance, connect) -> None:
    """A client's disconnect kills what it started (as a local exec's
    commands die with it); another client's command runs on."""
    inst = await start_instance(size=2)
    keeper = await connect(inst, 0)
    kept = keeper.rpc_stream("rexec.exec", {"cmd": ["sleep", "57.5"]}, nodeid=1)
    kept_pid = (await asyncio.wait_for(anext(aiter(kept)), T))["pid"]
    h = await connect(inst, 0)
    stream = h.rpc_stream("rexec.exec", {"cmd": ["sleep", "57.25"]}, nodeid=1)
    pid = (await asyncio.wait_for(anext(aiter(stream)), T))["pid"]
    assert pid_alive(pid)
    await h.close()

    async def gone() -> bool:
        return not pid_alive(pid)

    await wait_until(gone, "the gone client's command to be killed")
    assert pid_alive(kept_pid)
    stats = await keeper.rpc("rexec.stats-get", nodeid=1)
    assert stats["killed-at-disconnect"] == 1 and stats["running"] == 1
    await keeper.rpc("rexec.kill", {"pid": kept_pid, "signum": 9}, nodeid=1)
    assert (await answers(kept))[-1]["status"] == -9


def fd_count(pid: int) -> int:
    """The open file descriptors of process ``pid`` (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts a rank's fds in /proc")
@pytest.mark.both_loops
@pytest.mark.parametrize("going", ["close", "reset"])
async def test_clients_that_go_mid_exec_leave_no_fds_behind(start_instance, connect,
                                                           going: str) -> None:
    """200 clients of rank 1 each start ``sleep`` there and go while it
    runs -- closing their connection, or with it reset, as a SIGKILLed
    ``kvbroker exec``'s is -- many of them while the rank is still handing
    the command's output pipes to its loop: their commands are killed,
    the rank's open file descriptors come back to what they were, and
    nothing of another client's is touched (each of the 200 got its
    ``started``; a long-lived client's connection and command live on).
    The soak audit's reproducer: a cancellation there left a pipe's file
    object open after uvloop had closed its descriptor, which then closed
    whatever reused the number (other clients' sockets; the rank aborted)."""
    n = 200
    inst = await start_instance(size=2)
    keeper = await connect(inst, 1)
    kept = keeper.rpc_stream("rexec.exec", {"cmd": ["sleep", "56.5"]}, nodeid=1)
    kept_pid = (await asyncio.wait_for(anext(aiter(kept)), T))["pid"]
    pid = inst.pids()[1]
    before = fd_count(pid)
    pids = []
    for _ in range(n):
        h = await asyncio.wait_for(Handle.connect(inst.uri(1)), T)  # (closed here)
        stream = h.rpc_stream("rexec.exec", {"cmd": ["sleep", "60"]}, nodeid=1)
        started = await asyncio.wait_for(anext(aiter(stream)), T)
        assert started["type"] == "started"
        pids.append(started["pid"])
        if going == "reset":
            h._proto.transport.abort()  # (what the rank sees of a SIGKILLed client)
        await h.close()

    async def all_killed() -> bool:  # (and reaped: their pidfds closed)
        stats = await keeper.rpc("rexec.stats-get", nodeid=1)
        return bool(stats["running"] == 1 and stats["killed-at-disconnect"] == n
                    and not any(pid_alive(p) for p in pids))

    await wait_until(all_killed, f"the {n} commands to be killed", timeout=T)
    after = fd_count(pid)
    assert after <= before + 4, (
        f"rank 1 holds {after - before} more fds after {n} clients went mid-exec")
    assert keeper.connected and pid_alive(kept_pid)
    await keeper.rpc("rexec.kill", {"pid": kept_pid, "signum": 9}, nodeid=1)
    assert (await answers(kept))[-1] == {"type": "finished", "status": -9}


KILLED_CLIENTS = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from broker.handle import Handle

    async def main():
        uri, n = sys.argv[1], int(sys.argv[2])
        hs = [await Handle.connect(uri) for _ in range(n)]
        streams = [h.rpc_stream("rexec.exec", {"cmd": ["sleep", "59.5"]}, nodeid=1)
                   for h in hs]
        for s in streams:
            print((await anext(aiter(s)))["pid"], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts a rank's fds in /proc")
@pytest.mark.both_loops
async def test_a_killed_client_process_takes_its_commands_and_their_fds(
        start_instance, connect) -> None:
    """A client process SIGKILLed with 30 connections to rank 1, each with
    a command running there: all 30 are killed, their pipes closed, and
    another client of the rank is unharmed."""
    n = 30
    inst = await start_instance(size=2)
    keeper = await connect(inst, 1)
    pid = inst.pids()[1]
    before = fd_count(pid)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_CLIENTS, inst.uri(1), str(n),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode == -signal.SIGKILL
    pids = [int(line) for line in out.split()]
    assert len(pids) == n

    async def all_killed() -> bool:
        stats = await keeper.rpc("rexec.stats-get", nodeid=1)
        return bool(stats["running"] == 0 and stats["killed-at-disconnect"] == n
                    and not any(pid_alive(p) for p in pids))

    await wait_until(all_killed, f"the killed client's {n} commands to be killed", timeout=T)

    async def fds_closed() -> bool:  # (a killed command's pipes close as the loop
        # reads their end, a turn or a few after its exit was seen: once in a
        # fresh-clone CI run, 43 of them were still open at the first look)
        return fd_count(pid) <= before + 4

    await wait_until(fds_closed, "the commands' pipes and the client's sockets to close",
                     timeout=T)
    assert keeper.connected


SENT_AND_KILLED = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from broker.handle import Handle

    async def main():
        uri, n = sys.argv[1], int(sys.argv[2])
        hs = [await Handle.connect(uri) for _ in range(n)]
        for h in hs:
            h.rpc_stream("rexec.exec", {"cmd": ["sleep", "59.5"]}, nodeid=1)
            h.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # (before any answer)

    asyncio.run(main())
    """
)


async def test_a_client_killed_as_its_exec_leaves_takes_the_command(
        start_instance, connect) -> None:
    """A client on rank 0 killed right after sending ``rexec.exec`` to rank
    1: the request and its disconnect reached rank 1 in one turn, the
    disconnect ran before the exec handler's task had begun and found
    nothing, and the command then ran on for good, its output held (found
    by a probe of vanishing clients: 2 of 12).  Every command is started
    and killed."""
    n = 24
    inst = await start_instance(size=2)
    keeper = await connect(inst, 1)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SENT_AND_KILLED, inst.uri(0), str(n))
    assert await asyncio.wait_for(proc.wait(), T) == -signal.SIGKILL

    async def all_killed() -> bool:
        stats = await keeper.rpc("rexec.stats-get", nodeid=1)
        return bool(stats["started"] == n and stats["running"] == 0)

    await wait_until(all_killed, f"the killed client's {n} commands to be killed", timeout=T)
    assert (await keeper.rpc("rexec.list", {}, nodeid=1))["procs"] == []


async def test_output_is_held_to_a_window_until_credited(start_instance, connect) -> None:
    """A client that reads nothing (sends no credit) holds the command back
    at :data:`OUTPUT_WINDOW` bytes sent: the rank reads no more of it, the
    command blocks on its pipe, nothing is lost; credit lets it finish."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    total = 3 * OUTPUT_WINDOW
    stream = h.rpc_stream("rexec.exec", {"cmd": ["head", "-c", str(total), "/dev/zero"]},
                          nodeid=1)
    pid = (await asyncio.wait_for(anext(aiter(stream)), T))["pid"]

    async def at_window() -> bool:
        return (await h.rpc("rexec.stats-get", nodeid=1))["output-held"] >= OUTPUT_WINDOW

    await wait_until(at_window, "the output window to fill")
    held = (await h.rpc("rexec.stats-get", nodeid=1))["output-held"]
    assert OUTPUT_WINDOW <= held < OUTPUT_WINDOW + 2 * READ_CHUNK
    assert pid_alive(pid)  # (blocked on its full pipe, not finished)
    got = 0
    async with asyncio.timeout(T):
        async for answer in stream:
            if answer["type"] == "output" and "data" in answer:
                got += len(answer["data"])
                h.send_noresponse("rexec.credit", {"pid": pid, "bytes": len(answer["data"])},
                                  nodeid=1)
            elif answer["type"] == "finished":
                assert answer["status"] == 0
    assert got == total


async def test_a_guest_is_refused(start_instance) -> None:
    """rexec is the owner's: a guest may not run (``exec --bg`` neither),
    list, signal nor wait."""
    inst = await start_instance(size=1, attrs=ALLOW)
    runs = await asyncio.gather(
        run_guest_cli(inst.uri(0), "rpc", "--stream", "rexec.exec", '{"cmd": ["id"]}'),
        run_guest_cli(inst.uri(0), "exec", "--bg", "--", "id"),
        run_guest_cli(inst.uri(0), "sproc", "ps"),
        run_guest_cli(inst.uri(0), "sproc", "wait", "x"))
    for rc, _, err in runs:
        assert rc == 1 and "Operation not permitted" in err and "instance owner" in err, err


async def bg(h: Any, cmd: list[str], rank: int = 0, **kw: Any) -> int:
    """Start a background command (``bg: true`` and ``kw``): its pid; the
    stream has ended after ``started``."""
    got = await answers(h.rpc_stream("rexec.exec", {"cmd": cmd, "bg": True, **kw},
                                     nodeid=rank))
    assert [a["type"] for a in got] == ["started"] and got[0]["rank"] == rank, got
    return int(got[0]["pid"])


async def listed(h: Any, rank: int = 0) -> dict[int, dict[str, Any]]:
    return {p["pid"]: p for p in (await h.rpc("rexec.list", nodeid=rank))["procs"]}


async def refused(call: Any, errnum: int, text: str = "") -> None:
    with pytest.raises(RemoteError) as err:
        await asyncio.wait_for(call, T)
    assert err.value.errnum == errnum and text in (err.value.errstr or ""), err.value


async def test_background_commands_belong_to_the_rank(start_instance, connect) -> None:
    """A background command is answered ``started`` and ends its stream; it
    outlives its client (whose other commands are killed as it goes);
    ``rexec.list`` shows its state, label and kind; its input is closed;
    its end is logged; labels are unique, typed and freed with it."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    client = await connect(inst, 0)
    kept = await bg(client, ["sleep", "57.75"], label="keeper")
    fg = client.rpc_stream("rexec.exec", {"cmd": ["sleep", "57.5"]}, nodeid=0)
    fg_pid = (await asyncio.wait_for(anext(aiter(fg)), T))["pid"]
    procs = await listed(client, 0)
    assert procs[kept] == {"pid": kept, "cmd": ["sleep", "57.75"], "mine": True, "state": "R",
                           "label": "keeper", "bg": True, "waitable": False}
    assert procs[fg_pid]["bg"] is False and procs[fg_pid]["label"] == ""
    await refused(client.rpc("rexec.write", {"pid": kept, "data": b"x"}), errno.EPIPE)
    await client.close()

    async def fg_gone() -> bool:
        return (await h.rpc("rexec.stats-get"))["killed-at-disconnect"] == 1 \
            and not pid_alive(fg_pid)

    await wait_until(fg_gone, "the gone client's own command to be killed")
    assert pid_alive(kept) and (await listed(h))[kept]["mine"] is False

    for payload, errnum, text in [
            ({"label": "keeper"}, errno.EEXIST, "label keeper is taken on rank 0"),
            ({"label": ""}, errno.EINVAL, "not empty"),  # (given: not the same as none)
            ({"label": "123"}, errno.EINVAL, "not be a number"),
            ({"label": "a\tb"}, errno.EINVAL, "printable"),
            ({"label": "x" * 129}, errno.EINVAL, "at most 128"),
            ({"label": 5}, errno.EPROTO, "label a string"),
            ({"bg": False, "waitable": True}, errno.EINVAL, "waitable is for a background"),
            ({"stdin": True}, errno.EINVAL, "takes no input"),
            ({"bg": "yes"}, errno.EPROTO, "booleans")]:
        request = {"cmd": ["true"], "bg": True, **payload}
        await refused(answers(h.rpc_stream("rexec.exec", request, nodeid=0)), errnum, text)
    await refused(answers(h.rpc_stream("rexec.exec", {"cmd": ["nosuchcommand-y"], "bg": True,
                                                      "waitable": True, "label": "nope"},
                                       nodeid=0)), errno.ENOENT)
    assert "nope" not in {p["label"] for p in (await listed(h)).values()}  # (no zombie)

    await h.rpc("rexec.kill", {"label": "keeper", "signum": 15})

    async def ended() -> bool:
        return kept not in await listed(h) and not pid_alive(kept)

    await wait_until(ended, "the background command to end and be forgotten")
    await bg(h, ["true"], label="keeper")  # (its label is free again)
    logged = [e["message"] async for e in h.dmesg()]
    assert any(f"keeper: sleep[{kept}]: Terminated" in m for m in logged), logged[-5:]
    stats = await h.rpc("rexec.stats-get")
    assert stats["bg-started"] == 2 and stats["failed-to-start"] == 1


async def test_waitable_commands_and_rexec_wait(start_instance, connect) -> None:
    """A waitable command ends a zombie (``Z``) until ``rexec.wait``
    collects it (then ``ESRCH``); a wait for one still running is answered
    at its end; one waiter at a time (``EBUSY``), and a waiter's
    disconnect lets another wait; a zombie cannot be signalled; a command
    that is not waitable, and malformed waits, are refused."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    zombie = await bg(h, ["sh", "-c", "echo out; echo err >&2; exit 3"], waitable=True,
                      label="z")

    async def is_zombie() -> bool:
        return (await listed(h)).get(zombie, {}).get("state") == "Z"

    await wait_until(is_zombie, "the waitable command to be a zombie")
    await refused(h.rpc("rexec.kill", {"pid": zombie, "signum": 15}), errno.ESRCH,
                  "has exited")
    assert (await h.rpc("rexec.stats-get"))["zombies"] == 1
    assert await h.rpc("rexec.wait", {"label": "z", "output": True}) == {
        "status": 3, "stdout": b"out\n", "stderr": b"err\n", "stdout-dropped": 0,
        "stderr-dropped": 0}
    await refused(h.rpc("rexec.wait", {"pid": zombie}), errno.ESRCH, "does not belong")
    assert zombie not in await listed(h)

    sleeper = await bg(h, ["sleep", "56.5"], waitable=True, label="s")
    other = await connect(inst, 0)
    first = other.rpc("rexec.wait", {"pid": sleeper})
    # (a second on the same connection comes after it: the first is in)
    await refused(other.rpc("rexec.wait", {"label": "s"}), errno.EBUSY, "already being waited")
    await refused(h.rpc("rexec.wait", {"label": "s"}), errno.EBUSY)
    await other.close()  # (its wait is dropped: another may wait)
    with contextlib.suppress(Exception):
        await first
    waiting: list[Any] = []

    async def taken() -> bool:
        wait = h.rpc("rexec.wait", {"label": "s"})
        await h.rpc("rexec.list")  # (answered after the wait was: one connection, in order)
        if not wait.done():
            waiting.append(wait)
            return True
        assert isinstance(wait.exception(), RemoteError) and wait.exception().errnum == errno.EBUSY
        return False

    await wait_until(taken, "the gone waiter's wait to be dropped")
    await h.rpc("rexec.kill", {"label": "s", "signum": 9})
    assert (await asyncio.wait_for(waiting[0], T))["status"] == -9

    fg = h.rpc_stream("rexec.exec", {"cmd": ["sleep", "56.25"]}, nodeid=0)
    fg_pid = (await asyncio.wait_for(anext(aiter(fg)), T))["pid"]
    plain = await bg(h, ["sleep", "56"], label="plain")
    for payload, errnum, text in [
            ({"pid": fg_pid}, errno.EINVAL, "not waitable"),
            ({"label": "plain"}, errno.EINVAL, "not waitable"),
            ({}, errno.EPROTO, "pid or by label"),
            ({"pid": plain, "label": "plain"}, errno.EPROTO, "pid or by label"),
            ({"pid": "12"}, errno.EPROTO, "integer"),
            ({"label": "plain", "output": 1}, errno.EPROTO, "boolean"),
            ({"label": "nosuch"}, errno.ESRCH, "label nosuch does not belong")]:
        await refused(h.rpc("rexec.wait", payload), errnum, text)
    await refused(answers(h.rpc_stream("rexec.wait", {"label": "plain"})), errno.EPROTO,
                  "plain request")
    for pid in (fg_pid, plain):
        await h.rpc("rexec.kill", {"pid": pid, "signum": 9})
    assert (await answers(fg))[-1]["status"] == -9


async def test_kept_output_is_bounded(start_instance, connect) -> None:
    """A waitable command's output is kept to its last
    :data:`RETAINED_OUTPUT` bytes per stream, what came before counted as
    dropped; ``sproc wait --output`` writes what was kept and says the
    rest was dropped."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    total = 3 * RETAINED_OUTPUT
    script = f"head -c {total} /dev/zero | tr '\\0' a; printf end; echo e >&2"
    await bg(h, ["sh", "-c", script], waitable=True, label="big")
    answer = await asyncio.wait_for(h.rpc("rexec.wait", {"label": "big", "output": True}), T)
    assert answer["status"] == 0 and answer["stderr"] == b"e\n"
    assert len(answer["stdout"]) == RETAINED_OUTPUT and answer["stdout"].endswith(b"aend")
    assert answer["stdout-dropped"] == total + 3 - RETAINED_OUTPUT
    assert (await h.rpc("rexec.stats-get"))["output-kept"] == 0  # (given with its status)

    await bg(h, ["sh", "-c", script], waitable=True, label="big2")
    rc, out, err = await run_cli("sproc", "wait", "--output", "big2", uri=inst.uri(0))
    assert rc == 0 and len(out) == RETAINED_OUTPUT and out.endswith("aend"), (rc, len(out))
    assert err == (f"kvbroker: sproc wait: big2's stdout truncated: its first "
                   f"{total + 3 - RETAINED_OUTPUT} bytes were dropped (the rank keeps the "
                   f"last {RETAINED_OUTPUT})\ne\n"), err


async def test_a_stopping_rank_takes_its_background_commands(start_instance, connect) -> None:
    """Nothing outlives the rank: its background commands are killed and
    its zombies dropped when it stops (the stop is not held up by them)."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    running = await bg(h, ["sleep", "55.5"], rank=1, waitable=True, label="r")
    await bg(h, ["true"], rank=1, waitable=True, label="z")

    async def zombie() -> bool:
        return any(p["state"] == "Z" for p in (await listed(h, 1)).values())

    await wait_until(zombie, "a zombie on rank 1")
    await asyncio.wait_for(inst.stop(), T)

    async def gone() -> bool:
        return not pid_alive(running)

    await wait_until(gone, "rank 1's background command to be killed with it")
