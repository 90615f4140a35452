"""flux-core t/t1200-stats-basic.t: metrics an instance sends, and how it
takes ``FLUX_FRIPP_STATSD``.

Flux's brokers and modules *push* statsd packets over UDP to the endpoint
``FLUX_FRIPP_STATSD`` names (jobtap plugins' job-state counters and
timings, the content cache's gauges).  kvbroker pushes nothing: its
metrics are *pulled*, ``kvbroker stats MODULE`` (``MODULE.stats-get``,
``-p FIELD`` for one value; docs/cli.md, stats).  So most of the script
has nothing to observe here, and what is checked is how kvbroker stands
where Flux's test stands:

* prefix set / multiple packets / validate packets / timing packets
  (immediate, basic with a 0.2 s heartbeat) -> do not apply: no jobs, no
  jobtap, no statsd client.  First test: with ``FLUX_FRIPP_STATSD``
  naming a listening UDP socket, an instance with a 0.2 s heartbeat that
  stores blobs and commits (as Flux's runs beat and run jobs) sends that
  socket nothing.
* valid content-cache packets received -> the same gauges, pulled:
  Flux's ``content-cache.count``, ``.size`` and ``.dirty`` are ``count``,
  ``cache-bytes`` and ``dirty`` of ``stats content``, each an integer (a
  valid statsd gauge value) on every rank, moving with a store (second
  test).  ``.valid`` is ``count`` here (a cached blob is whole), and
  ``.flush-batch-count`` has no counterpart.
* nothing received with no endpoint -> the first test's result, with one.
* FLUX_FRIPP_STATSD with no port (``localhost``) or a host that does not
  resolve: Flux logs a parse error and runs; kvbroker ignores the variable
  and runs, logging nothing of it (third test).
* ``stats -c/-C/-R`` (clearing and getrusage, Flux's ``module stats``
  options, not t1200's) are in tests/test_broker_modules.py.
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


async def test_t1200_an_instance_sends_no_statsd_packets(listener) -> None:
    port = listener.getsockname()[1]
    rc, out, err = await run_cli(
        "start", "--size", "2", "-S", "broker.modules=content,kvs,kvs-watch,heartbeat",
        "-S", "heartbeat.period=0.2s", "--", "sh", "-c", BUSY,
        env=env_with(f"127.0.0.1:{port}"))
    assert rc == 0, err
    assert out.startswith("sha256-"), out  # (the store ran, and the rest with set -e)
    # Every process that could have sent is gone; a datagram sent on the
    # loopback is in the socket's buffer by the time sendto returns.
    with pytest.raises(BlockingIOError):
        packet = listener.recv(1024)
        raise AssertionError(f"received {packet!r}")


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


@pytest.mark.parametrize("value", ["localhost", "thiscantpossiblybevalid:9000"])
async def test_t1200_a_bad_fripp_endpoint_is_ignored(value: str) -> None:
    rc, out, err = await run_cli(
        "start", "--", "sh", "-c",
        "printenv FLUX_FRIPP_STATSD && kvbroker kvs put a=1 && kvbroker kvs get a "
        "&& kvbroker dmesg --all", env=env_with(value))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[:2] == [value, "1"], out  # (set where the ranks run, and they serve)
    log = "\n".join(lines[2:]) + err
    assert "kvbroker[0]" in log, log  # (the ranks' log was read)
    assert not re.search(r"parse error|fripp|statsd", log, re.I), log
