"""flux-core t/t1200-stats-basic.t: metrics an instance sends, and how it
takes ``FLUX_FRIPP_STATSD``.

Flux's brokers and modules *push* statsd packets over UDP to the endpoint
``FLUX_FRIPP_STATSD`` names (jobtap plugins' job-state counters and
timings, the content cache's gauges).  kvbroker's ranks push every
module's figures there as gauges, once a second by default
(``stats.statsd-period``), those that changed (docs/cli.md, stats); the
same figures are *pulled* with ``kvbroker stats MODULE``.  Flux's cases:

* prefix set / multiple packets / validate packets (immediate) -> no
  jobtap plugins here: an instance that stores blobs, commits and beats
  (a 0.2 s heartbeat, as Flux's 'timing packets basic') with
  ``FLUX_FRIPP_STATSD`` naming a listening UDP socket sends it several
  datagrams, every line a valid gauge (Flux's regular expression), under
  the prefix asked for: ``-S stats.statsd-prefix=flux.{rank}`` gives
  Flux's ``flux.0.``, ``flux.1.`` (first test).  Timings (``|ms``): no
  figure here is one.
* valid content-cache packets received -> the same run sends Flux's
  ``content-cache.count``, ``.size`` and ``.dirty`` (``count``,
  ``cache-bytes`` and ``dirty`` of ``stats content``) from every rank;
  pulled, they are integers moving with a store (second test).
  ``.valid`` (a cached blob is whole here: ``count``) and
  ``.flush-batch-count`` are not sent.
* nothing received with no endpoint -> without the variable, nothing is
  sent (third test).
* FLUX_FRIPP_STATSD with no port (``localhost``) or a host that does not
  resolve: Flux logs a parse error and runs; so does kvbroker (``parse
  error`` for the first, ``cannot resolve`` for the second), sending
  nothing (fourth test).
* ``stats -c/-C/-R`` (clearing and getrusage, Flux's ``module stats``
  options, not t1200's) are in tests/test_broker_modules.py; more of the
  statsd push in tests/test_statsd.py.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator

import pytest
from test_broker_support import run_cli

GAUGE = re.compile(r"^\d+\n$")
"""A statsd gauge's value as ``-p FIELD --type int`` prints it."""


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A UDP socket on the loopback, non-blocking, as stats-listen.py's."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.setblocking(False)
    yield s
    s.close()


def env_with(value: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    env["FLUX_FRIPP_STATSD"] = value
    return env


BUSY = """
set -e
echo content-cache | kvbroker content store
kvbroker kvs put job.state=run
# beats heard on rank 1 (Flux's 'timing packets basic' runs a 0.2 s heartbeat)
until [ "$(kvbroker stats heartbeat -r 1 -p count --type int)" -ge 3 ]; do :; done
kvbroker kvs put job.state=done
"""


def received(listener: socket.socket) -> list[bytes]:
    """Every datagram the socket holds (the senders are gone: a datagram
    sent on the loopback is in its buffer by the time sendto returns)."""
    out = []
    while True:
        try:
            out.append(listener.recv(65536))
        except BlockingIOError:
            return out


FLUX_LINE = re.compile(r"^[\w.-]+:[+-]*\d+(\.\d+)?\|[gC]$")
"""Flux's stats-listen.py check of a line (a gauge, here), with the dots
and dashes of a metric's name, and a decimal value, allowed."""


async def test_t1200_an_instance_sends_its_figures(listener) -> None:
    port = listener.getsockname()[1]
    rc, out, err = await run_cli(
        "start", "--size", "2", "-S", "broker.modules=content,kvs,kvs-watch,heartbeat",
        "-S", "heartbeat.period=0.2s", "-S", "stats.statsd-period=0.2",
        "-S", "stats.statsd-prefix=flux.{rank}", "--", "sh", "-c", BUSY,
        env=env_with(f"127.0.0.1:{port}"))
    assert rc == 0, err
    assert out.startswith("sha256-"), out  # (the store ran, and the rest with set -e)
    packets = received(listener)
    assert len(packets) >= 3, packets
    lines = [line for p in packets for line in p.decode().splitlines()]
    assert all(FLUX_LINE.match(line) for line in lines), lines
    names = {line.partition(":")[0] for line in lines}
    for rank in (0, 1):
        for gauge in ("count", "size", "dirty"):
            assert f"flux.{rank}.content-cache.{gauge}" in names, sorted(names)
        assert f"flux.{rank}.heartbeat.count" in names


async def test_t1200_nothing_is_sent_without_an_endpoint(listener) -> None:
    env = env_with("")
    env.pop("FLUX_FRIPP_STATSD")
    rc, out, err = await run_cli("start", "--size", "2", "--", "sh", "-c", BUSY.replace(
        "until", "# until"), env=env)
    assert rc == 0, err
    assert received(listener) == []


async def test_t1200_the_content_cache_gauges_are_read_as_integers(start_instance) -> None:
    inst = await start_instance(size=2)

    async def gauges(rank: int) -> dict[str, int]:
        out = {}
        for field in ("count", "cache-bytes", "dirty"):
            rc, text, err = await run_cli("stats", "content", "-r", str(rank), "-p", field,
                                          "--type", "int", uri=inst.uri(1))
            assert rc == 0 and GAUGE.match(text), (field, rank, text, err)
            out[field] = int(text)
        return out

    before = {rank: await gauges(rank) for rank in (0, 1)}
    data = b"a blob for the content-cache gauges, " + os.urandom(8).hex().encode()
    rc, _, err = await run_cli("content", "store", uri=inst.uri(1), input=data)
    assert rc == 0, err
    after = await gauges(1)
    assert after["count"] == before[1]["count"] + 1, (before[1], after)
    assert after["cache-bytes"] > before[1]["cache-bytes"] + len(data), (before[1], after)
    rc, _, err = await run_cli("content", "flush", uri=inst.uri(1))
    assert rc == 0, err
    assert (await gauges(0))["dirty"] == 0  # (written: nothing left dirty on rank 0)


@pytest.mark.parametrize(("value", "said"), [
    ("localhost", "FLUX_FRIPP_STATSD parse error: 'localhost' has no port"),
    ("thiscantpossiblybevalid.invalid:9000",
     "FLUX_FRIPP_STATSD: cannot resolve thiscantpossiblybevalid.invalid")])
async def test_t1200_a_bad_fripp_endpoint_is_logged(value: str, said: str) -> None:
    rc, out, err = await run_cli(
        "start", "--", "sh", "-c",
        "printenv FLUX_FRIPP_STATSD && kvbroker kvs put a=1 && kvbroker kvs get a "
        "&& kvbroker dmesg --all", env=env_with(value))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[:2] == [value, "1"], out  # (set where the ranks run, and they serve)
    log = "\n".join(lines[2:]) + err
    assert said in log, log
