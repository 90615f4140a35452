"""The ``rexec`` service (broker/rexec.py): a rank runs a command for a
client elsewhere, as Flux's subprocess server does for ``flux exec``.
Real ranks, real processes; the client is a plain :class:`Handle` speaking
the protocol (docs/protocol.md, "rexec").  ``kvbroker exec`` across hosts
is in tests/test_multihost.py."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from typing import Any

import pytest
from conftest import pid_alive
from test_broker_guests import ALLOW, run_guest_cli
from test_broker_support import wait_until

from broker.errors import RemoteError
from broker.rexec import OUTPUT_WINDOW, READ_CHUNK

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
    inst = await start_instance(size=1, attrs=ALLOW)
    rc, _, err = await run_guest_cli(inst.uri(0), "rpc", "--stream", "rexec.exec",
                                     '{"cmd": ["id"]}')
    assert rc == 1 and "Operation not permitted" in err and "instance owner" in err, err
