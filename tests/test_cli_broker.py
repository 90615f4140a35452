"""The ``kvbroker`` command: start, exec and the client commands (docs/cli.md)."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal

import pytest
from test_broker_support import KVBROKER, run_cli, stats, wait_until

from broker.handle import Handle, parse_uri


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


async def test_start_missing_command() -> None:
    rc, _, err = await run_cli("start", "--", "/nonexistent/command")
    assert rc == 127
    error_line(err, "/nonexistent/command", errno.ENOENT)


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


async def test_start_rejects_bad_arguments() -> None:
    rc, _, err = await run_cli("start", "--size", "0", "--", "true")
    assert rc == 2
    assert err.startswith("usage: kvbroker start") and "at least 1" in err
    rc, _, err = await run_cli("start", "-S", "novalue", "--", "true")
    assert rc == 2 and "ATTR=VALUE" in err
    rc, _, err = await run_cli("start", "--event-loop", "bogus", "--", "true")
    assert rc == 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
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
    assert "rank 1 exited unexpectedly" in err


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
        rc, _, err = await run_cli("rpc", "broker.ping", "{not json", uri=uri)
        assert rc == 1 and err.startswith("kvbroker: payload is not valid JSON")
        # no broker
        rc, _, err = await run_cli("ping", uri="local:///nonexistent/socket")
        assert rc == 1
        assert err.strip() == (
            f"kvbroker: ping: cannot connect to broker: {os.strerror(errno.ENOENT)}"
        )
        rc, _, err = await run_cli("ping")
        assert rc == 1 and err.startswith("kvbroker: ping: ") and "KVBROKER_URI" in err


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
        clients = (await stats(watcher))["clients"]
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
                s = await stats(watcher)
                return s["clients"] == clients + 1 and sum(s["subscriptions"].values()) >= 2

            await wait_until(subscribed, "kvbroker event sub to subscribe", timeout=20)
            rc, out, err = await run_cli("event", "pub", "-v", "cli.other", uri=inst.uri(1))
            assert rc == 0, err
            first = int(out)
            rc, out, err = await run_cli("event", "pub", "cli.a.x", '{"n": 1}', uri=inst.uri(1))
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
