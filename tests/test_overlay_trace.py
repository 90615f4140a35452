"""``overlay.trace`` and ``kvbroker overlay trace``: the messages a rank's
overlay sends and receives, as ``flux overlay trace`` (flux-core t3400)."""

from __future__ import annotations

import asyncio
import errno
import re
import signal
import sys
from typing import Any

import pytest
from test_broker_guests import ALLOW, run_guest_cli
from test_broker_support import KVBROKER, run_cli, wait_until

from broker import logring, overlay_cli
from broker.errors import RemoteError
from broker.handle import Stream
from broker.message import MsgType

WAIT = 30.0


async def collect(stream: Stream, until: Any) -> list[dict[str, Any]]:
    """The stream's answers up to the first for which ``until`` holds."""
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(WAIT):
        while True:
            msg = await stream.next_message()
            assert msg is not None, got
            got.append(msg.payload)
            if until(msg.payload):
                return got


def summary(answers: list[dict[str, Any]], topic: str) -> list[tuple[str, int, int]]:
    return [(a["prefix"], a["rank"], a["type"]) for a in answers if a["topic"] == topic]


async def test_a_trace_sees_a_request_and_its_answer_pass_through(start_instance,
                                                                  connect) -> None:
    """Rank 1 traced, rank 0 pings rank 3 (0 -> 1 -> 3): rank 1 receives the
    request from 0, sends it to 3, and the answer back the same way."""
    inst = await start_instance(size=4, fanout=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    stream = h1.rpc_stream("overlay.trace", {"topic_glob": "broker.pi*", "full": True})
    # (the trace is registered once rank 1 has its request: a ping of rank 1 answers
    # after it, so the first one traced below is this test's)
    await h1.ping()
    await h0.ping(3, {"pad": "x"})
    answers = await collect(stream, lambda a: a["prefix"] == "tx" and a["rank"] == 0)
    assert summary(answers, "broker.ping") == [
        ("rx", 0, MsgType.REQUEST), ("tx", 3, MsgType.REQUEST),
        ("rx", 3, MsgType.RESPONSE), ("tx", 0, MsgType.RESPONSE)]
    request, response = answers[0], answers[-1]
    assert request["payload"] == {"pad": "x"} and request["size"] > 0
    assert response["errnum"] == 0 and response["payload"]["rank"] == 3
    assert response["payload"]["route"][-2:] == ["r1", "r3"]


async def test_filters_and_a_failed_answer(start_instance, connect) -> None:
    """``typemask``, ``nodeid`` (the overlay peer) and ``topic_glob`` each
    narrow what is sent; a failed answer carries its errno and, with
    ``full``, its text; a trace's own answers crossing the overlay (a
    tracer attached to another rank) are not traced, or they would be for
    ever."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    # rank 1 traced from rank 3: every answer crosses the link 1 -> 3
    remote = h3.rpc_stream("overlay.trace", {"typemask": MsgType.RESPONSE, "nodeid": 3,
                                             "topic_glob": "broker.*", "full": True},
                           nodeid=1)
    await h3.ping(1)
    with pytest.raises(RemoteError):
        await h0.rpc("broker.no-such", {}, nodeid=3)
    await h0.ping(3)
    answers = await collect(remote, lambda a: a["topic"] == "broker.ping"
                            and a["prefix"] == "rx")
    # (first rank 1's answer to the ping that made sure the trace had begun)
    assert [(a["prefix"], a["rank"], a["topic"], a["errnum"]) for a in answers] == [
        ("tx", 3, "broker.ping", 0), ("rx", 3, "broker.no-such", errno.ENOSYS),
        ("rx", 3, "broker.ping", 0)]
    assert answers[1]["errstr"] == "unknown topic broker.no-such"
    assert all(a["type"] == MsgType.RESPONSE for a in answers)
    # unfiltered, from rank 3: its own answers to rank 3 are not among them
    every = h3.rpc_stream("overlay.trace", {}, nodeid=1)
    await h3.ping(1)
    await h0.ping(3)
    answers = await collect(every, lambda a: a["topic"] == "broker.ping"
                            and a["prefix"] == "tx" and a["rank"] == 0)
    assert not [a for a in answers if a["topic"] == "overlay.trace"], answers
    assert summary(answers, "broker.ping")[-4:] == [
        ("rx", 0, MsgType.REQUEST), ("tx", 3, MsgType.REQUEST),
        ("rx", 3, MsgType.RESPONSE), ("tx", 0, MsgType.RESPONSE)]
    # events only, seen by rank 1 from rank 0 and passed to rank 3
    h1 = await connect(inst, 1)
    events = h1.rpc_stream("overlay.trace", {"typemask": MsgType.EVENT, "topic_glob": "t.*"})
    await h1.ping()
    await h0.publish("t.one", {"n": 1})
    got = await collect(events, lambda a: a["prefix"] == "tx")
    assert [(a["prefix"], a["rank"], a["topic"], "payload" in a) for a in got] == [
        ("rx", 0, "t.one", False), ("tx", 3, "t.one", False)]


async def test_bad_requests_are_refused(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    with pytest.raises(RemoteError) as err:
        await h.rpc("overlay.trace", {})
    assert err.value.errnum == errno.EPROTO and "streaming" in str(err.value)
    for bad in ({"typemask": "all"}, {"typemask": 99}, {"topic_glob": 3}, {"nodeid": "1"}):
        with pytest.raises(RemoteError) as err:
            async for _ in h.rpc_stream("overlay.trace", bad):
                pass
        assert err.value.errnum == errno.EPROTO, bad


async def test_a_guest_may_not_trace(start_instance) -> None:
    inst = await start_instance(size=2, attrs=ALLOW)
    rc, out, err = await run_guest_cli(inst.uri(1), "overlay", "trace")
    assert (rc, out) == (1, ""), err
    assert "only the instance owner may trace the overlay" in err, err


async def test_the_cli_prints_flux_s_lines_until_its_reader_goes(start_instance,
                                                                 connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "overlay", "trace", "-t", "request,response", "broker.ping",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**__import__("os").environ, "KVBROKER_URI": inst.uri(1)})
    h0 = await connect(inst, 0)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        async with asyncio.timeout(WAIT):
            while len(lines) < 4:
                await h0.ping(3)  # (until the trace has started: then 4 lines a ping)
                while len(lines) < 4:
                    try:
                        line = await asyncio.wait_for(proc.stdout.readline(), 0.5)
                    except TimeoutError:
                        break
                    lines.append(line.decode())
        stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
        assert re.fullmatch(stamp + r" rx 0 > broker\.ping \[\d+B\]\n", lines[0]), lines
        assert re.fullmatch(stamp + r" tx 3 > broker\.ping \[\d+B\]\n", lines[1]), lines
        assert re.fullmatch(stamp + r" rx 3 < broker\.ping \[\d+B\] success\n", lines[2])
        assert re.fullmatch(stamp + r" tx 0 < broker\.ping \[\d+B\] success\n", lines[3])
    finally:
        proc.send_signal(signal.SIGINT)
        await asyncio.wait_for(proc.wait(), WAIT)


@pytest.mark.parametrize("args, why", [
    (["x", "y"], "unrecognized arguments: y"),
    (["-t", "foo,bar"], "valid types: request, response, event, control"),
    (["--delta"], "--delta can only be used with --human"),
    (["--not-an-arg"], "unrecognized arguments: --not-an-arg"),
])
async def test_the_cli_refuses_what_flux_s_refuses(args: list[str], why: str) -> None:
    rc, out, err = await run_cli("overlay", "trace", *args, uri="local:///nonexistent")
    assert (rc, out) == (2, "") and why in err, err


def test_trace_lines_as_flux_prints_them() -> None:
    fmt = logring.DmesgFormat()
    t = 1796157000.25  # 2026-12-01 20:30:00.25 UTC
    base = {"timestamp": t, "prefix": "rx", "rank": 1, "topic": "kvs.commit"}
    assert overlay_cli.trace_line(fmt, {**base, "type": MsgType.REQUEST, "size": 312,
                                "errnum": 0}) == \
        "2026-12-01T20:30:00.250Z rx 1 > kvs.commit [312B]"
    assert overlay_cli.trace_line(fmt, {**base, "type": MsgType.RESPONSE, "size": 1536,
                                "errnum": errno.ENOENT, "errstr": "no such key"}) == \
        "2026-12-01T20:30:00.250Z rx 1 < kvs.commit [1.5K] ENOENT\nno such key"
    assert overlay_cli.trace_line(fmt, {**base, "type": MsgType.EVENT, "size": 3 << 20,
                                "errnum": 0, "payload": {"a": 1}}) == \
        '2026-12-01T20:30:00.250Z rx 1 e kvs.commit [3.0M]\n{\n  "a": 1\n}'
    assert overlay_cli.trace_line(logring.DmesgFormat(color=True), {
        **base, "type": MsgType.RESPONSE, "size": 1, "errnum": errno.EPERM}) == (
        "\033[32m2026-12-01T20:30:00.250Z\033[0m \033[31mrx 1 < kvs.commit [1B] "
        "EPERM\033[0m")


if sys.platform != "linux":  # (the guest test drops to another uid)
    pytestmark = pytest.mark.skip("Linux only")


async def traces(h: Any) -> int:
    """The trace streams the handle's rank serves (its stats)."""
    return int((await h.rpc("broker.stats-get", {}))["overlay"]["traces"])


async def test_the_python_api_traces_and_cancels(start_instance, connect) -> None:
    """A trace ends when its client cancels it, and when its client goes:
    the rank's stats count it until then."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    stream = h1.overlay_trace("broker.ping", types=MsgType.REQUEST, full=True)
    await h1.ping()
    assert await traces(h1) == 1
    await h0.ping(1, {"n": 7})
    got = await collect(stream, lambda a: a["topic"] == "broker.ping")
    assert [(a["prefix"], a["rank"], a["payload"]) for a in got] == [("rx", 0, {"n": 7})]
    h1.send_noresponse("overlay.trace-cancel", {"matchtag": stream.matchtag})
    async with asyncio.timeout(WAIT):
        assert await stream.next_message() is None  # (ENODATA: the end)
    assert await traces(h1) == 0
    gone = await connect(inst, 1)
    gone.overlay_trace()
    await gone.ping()
    assert await traces(h1) == 1
    await gone.close()

    async def ended() -> bool:  # (the rank hears of the close after it happened)
        return await traces(h1) == 0

    await wait_until(ended, "the closed client's trace to end", WAIT)


@pytest.mark.parametrize("argv, color, glob", [
    (["-L", "kvs.*"], "always", "kvs.*"),
    (["--color", "kvs.*"], "always", "kvs.*"),
    (["-Lnever"], "never", "*"),
    (["--color=never", "x"], "never", "x"),
])
def test_color_takes_its_when_only_attached(argv: list[str], color: str, glob: str) -> None:
    """As Flux's optparse (and ``kvs eventlog get``): ``-L kvs.*`` is colour
    and a glob, not a colour named ``kvs.*``."""
    from broker.cli import build_parser

    args = build_parser("overlay").parse_args(["overlay", "trace", *argv])
    assert (args.color, args.topic_glob) == (color, glob)
