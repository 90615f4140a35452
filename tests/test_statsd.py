"""Each rank pushing its figures to a statsd server (``stats.statsd``, or
Flux's ``FLUX_FRIPP_STATSD``): the pure parts, then real ranks sending to a
real UDP socket of the test."""

from __future__ import annotations

import asyncio
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_broker_support import run_cli, stats, wait_until

from broker import attrs as battrs
from broker.handle import Handle
from broker.statsd import PACKET_MAX, flatten, lines_of, packets, parse_address
from kvs.client import KVS

LINE_RE = re.compile(r"[A-Za-z0-9_.-]+:-?[0-9]+(\.[0-9]+)?\|g")


# -- the pure parts -------------------------------------------------------

def test_an_address_is_host_and_port() -> None:
    assert parse_address("127.0.0.1:8125") == ("127.0.0.1", 8125)
    assert parse_address("stats.example:9") == ("stats.example", 9)
    assert parse_address("[::1]:8125") == ("::1", 8125)
    for bad, why in (("localhost", "missing colon"), (":8125", "no host"),
                     ("h:0", "1 to 65535"), ("h:65536", "1 to 65535"), ("h:x", "1 to 65535")):
        with pytest.raises(ValueError, match=why):
            parse_address(bad)


def test_flatten_keeps_the_numbers_of_plain_names_and_skips_what_it_is_told() -> None:
    """Nested maps become dotted names; bools count 0/1; strings, lists,
    None, NaN and infinities are not figures; a skipped field (dotted,
    within the stats) and a key that could break a statsd line
    (``a:1|g``, a space, a newline) are left out."""
    got = flatten({"a": 1, "pid": 7, "b": True, "s": "x", "none": None, "l": [1, 2],
                   "nan": float("nan"), "inf": float("inf"), "f": 0.25,
                   "namespaces": {"job-1": {"rootseq": 3}},
                   "overlay": {"hosts": {"n1": 1}, "dropped": 2},
                   "evil:1|g\nx": 5, "a b": 6},
                  ("pid", "namespaces", "overlay.hosts"), "kvs.")
    assert got == {"kvs.a": 1, "kvs.b": 1, "kvs.f": 0.25, "kvs.overlay.dropped": 2}


def test_lines_are_gauges_and_packets_end_on_whole_lines() -> None:
    assert lines_of("kvbroker.3", {"kvs.counts.commits": 12, "x.f": 0.5, "t": 1e-5,
                                   "z": 0.0, "big": 1e20, "n": -2.5}) == [
        b"kvbroker.3.kvs.counts.commits:12|g\n", b"kvbroker.3.x.f:0.5|g\n",
        b"kvbroker.3.t:0.00001|g\n", b"kvbroker.3.z:0|g\n",
        b"kvbroker.3.big:100000000000000000000|g\n", b"kvbroker.3.n:-2.5|g\n"]
    lines = [f"p.metric-{i}:{i}|g\n".encode() for i in range(500)]
    out = packets(lines)
    assert b"".join(out) == b"".join(lines)
    assert all(len(p) <= PACKET_MAX and p.endswith(b"\n") for p in out)
    assert len(out) > 1
    long = b"x" * (PACKET_MAX + 10) + b"\n"
    assert packets([b"a\n", long, b"b\n"]) == [b"a\n", long, b"b\n"]


def test_the_attributes_are_checked() -> None:
    for name, value, why in (("stats.statsd", "nocolon", "missing colon"),
                             ("stats.statsd-period", "0", "under 0.01s"),
                             # (each send gathers every module's stats: a busy loop)
                             ("stats.statsd-period", "0.0001ms", "under 0.01s"),
                             ("stats.statsd", "h:\u0668\u0660", "port"),  # (Arabic-Indic 80)
                             ("stats.statsd-prefix", "a b", "words"),
                             ("stats.statsd-prefix", "a..b", "words")):
        with pytest.raises(battrs.AttrError, match=why):
            battrs.check({name: value}, battrs.BROKER_ATTRS)
    ok = battrs.check({"stats.statsd": "127.0.0.1:8125", "stats.statsd-prefix": "flux.{rank}",
                       "stats.statsd-period": "250ms"}, battrs.BROKER_ATTRS)
    assert ok["stats.statsd-period"] == 0.25


# -- real ranks ---------------------------------------------------------------

class Server(asyncio.DatagramProtocol):
    """A statsd server's socket: every datagram received, and the lines by
    name, newest value last."""

    def __init__(self) -> None:
        self.datagrams: list[bytes] = []
        self.values: dict[str, str] = {}
        self.changed = asyncio.Event()

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.datagrams.append(data)
        for line in data.decode().splitlines():
            name, _, value = line.partition(":")
            self.values[name] = value
        self.changed.set()

    async def until(self, name: str, value: str | None = None, timeout: float = 20) -> str:
        """Wait until ``name`` was received (with ``value``, if given: a
        line's value and type, ``3|g``); its number."""
        async with asyncio.timeout(timeout):
            while self.values.get(name) is None or (
                    value is not None and self.values[name] != value):
                self.changed.clear()
                await self.changed.wait()
        return self.values[name].removesuffix("|g")


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, int]]:
    loop = asyncio.get_running_loop()
    transport, proto = await loop.create_datagram_endpoint(
        Server, local_addr=("127.0.0.1", 0), family=socket.AF_INET)
    yield proto, transport.get_extra_info("sockname")[1]
    transport.close()


async def test_every_rank_sends_its_figures_as_gauges(
        start_instance, connect, server, monkeypatch) -> None:
    """With ``FLUX_FRIPP_STATSD`` (Flux's variable) every rank sends every
    module's figures, Flux's content-cache names too, as well-formed gauge
    lines in datagrams of at most 1,440 bytes; a commit is seen as it
    moves the count; a namespace's name (a map keyed by what a user
    chose) never becomes a metric."""
    proto, port = server
    monkeypatch.setenv("FLUX_FRIPP_STATSD", f"127.0.0.1:{port}")
    inst = await start_instance(size=2, attrs={"stats.statsd-period": "0.1"})
    h = await connect(inst, 0)
    await KVS(h).namespace_create("secret-job-name")
    before = int(await proto.until("kvbroker.0.kvs.counts.commits"))
    await KVS(h).put("a", 1)
    await proto.until("kvbroker.0.kvs.counts.commits", f"{before + 1}|g")
    for name in ("kvbroker.0.content-cache.count", "kvbroker.0.content-cache.size",
                 "kvbroker.0.content-cache.dirty", "kvbroker.1.kvs-watch.watchers",
                 "kvbroker.1.broker.messages.requests", "kvbroker.0.kvs.namespace-count"):
        await proto.until(name)
    assert all(len(d) <= PACKET_MAX for d in proto.datagrams)
    lines = [line for d in proto.datagrams for line in d.decode().splitlines()]
    assert lines and all(LINE_RE.fullmatch(line) for line in lines), lines[:5]
    assert not [line for line in lines if "secret-job-name" in line or ".pid:" in line]
    st = await stats(h, 1)
    assert st["statsd"]["address"] == f"127.0.0.1:{port}"
    assert st["statsd"]["prefix"] == "kvbroker.1" and st["statsd"]["packets"] > 0
    assert (await h.attr_get("stats.statsd", nodeid=1)) == f"127.0.0.1:{port}"


async def test_only_changed_figures_are_sent_again(start_instance, connect, server) -> None:
    """After the first packet, a period sends only what moved: a put sends
    rank 0's commit count again, not a figure that stood still, such as the
    hash-checked ``content.write-failures``."""
    proto, port = server
    inst = await start_instance(size=1, attrs={"stats.statsd": f"127.0.0.1:{port}",
                                               "stats.statsd-period": "0.1",
                                               "stats.statsd-prefix": "flux.{rank}"})
    h = await connect(inst, 0)
    await proto.until("flux.0.content.write-failures")
    before = int(await proto.until("flux.0.kvs.counts.commits"))
    proto.values.pop("flux.0.content.write-failures")
    await KVS(h).put("a", 1)
    await proto.until("flux.0.kvs.counts.commits", f"{before + 1}|g")
    await proto.until("flux.0.content.stored")
    assert "flux.0.content.write-failures" not in proto.values


async def _logged(h: Handle, text: str) -> None:
    async def said() -> bool:
        return any([text in e["message"] async for e in h.dmesg(nodeid=0)])
    await wait_until(said, f"the rank to log {text!r}", timeout=20)


async def test_a_bad_variable_is_logged_and_the_rank_serves_on(
        start_instance, connect, monkeypatch) -> None:
    """As Flux: a ``FLUX_FRIPP_STATSD`` without a port, or whose host does
    not resolve, is an ERROR in the rank's log, nothing is sent, and the
    rank serves."""
    for value, text in (("localhost", "FLUX_FRIPP_STATSD parse error: 'localhost' has no port"),
                        ("thiscantpossiblybevalid.invalid:9000",
                         "FLUX_FRIPP_STATSD: cannot resolve thiscantpossiblybevalid.invalid")):
        monkeypatch.setenv("FLUX_FRIPP_STATSD", value)
        inst = await start_instance(size=1)
        h = await connect(inst, 0)
        await _logged(h, text)
        await KVS(h).put("a", 1)
        assert "statsd" not in await stats(h, 0)


async def test_a_bad_attribute_stops_the_start(tmp_path) -> None:
    rc, out, err = await run_cli("start", "-S", "stats.statsd=nocolon", "--", "true")
    assert rc == 2 and "stats.statsd" in err and "missing colon" in err, err
    rc, out, err = await run_cli("start", "-S", "stats.statsd-period=0", "--", "true")
    assert rc == 2 and "stats.statsd-period" in err, err


async def test_nobody_listening_costs_the_rank_nothing(start_instance, connect) -> None:
    """Datagrams to a port nobody reads are dropped (statsd is best
    effort): the rank goes on serving and sending."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    inst = await start_instance(size=1, attrs={"stats.statsd": f"127.0.0.1:{port}",
                                               "stats.statsd-period": "0.05"})
    h = await connect(inst, 0)

    async def sent_some() -> bool:
        st = (await stats(h, 0))["statsd"]
        return st["packets"] + st["dropped"] >= 10

    await wait_until(sent_some, "ten periods of figures", timeout=20)
    kvs = KVS(h)
    await kvs.put("a", 1)
    assert await kvs.get("a") == b"1"
    # (fixed at start, as every attribute but the log levels and torpid ones)
    rc, _, err = await run_cli("attr", "set", "stats.statsd", "127.0.0.1:1", uri=inst.uri(0))
    assert rc != 0 and "stats.statsd" in err, err
