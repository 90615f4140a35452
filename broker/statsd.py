"""Pushing a rank's figures to a statsd server, as Flux's brokers do when
``FLUX_FRIPP_STATSD=HOST:PORT`` is set (its "fripp" client).

The figures are the ones ``kvbroker stats MODULE`` shows: every number of
every module's ``stats()``, flattened to dotted names under a per-rank
prefix (``kvbroker.3.kvs.counts.commits``), and the content cache's also
under Flux's names (``content-cache.count``, ``.dirty``, ``.size``), so a
dashboard made for Flux finds them.  Once a period each rank sends, as
statsd gauges (``NAME:VALUE|g``), those that changed since its last
packet, in UDP datagrams of at most :data:`PACKET_MAX` bytes, each ending
on a whole line: statsd reads a datagram line by line.  Counters are sent
as they stand (gauges), not as increments: a lost datagram then loses
nothing, and a rate is the gauge's derivative.

Nothing here waits: the socket is non-blocking, and a datagram nobody
receives (no server yet: ``ECONNREFUSED``) or that the kernel has no room
for is dropped, as statsd's own clients do.  Only names made of letters,
digits, ``_`` and ``-`` are sent: a map keyed by what users chose (a
namespace, a subscription, a uid) is not a set of metrics, so each module
names those in :attr:`broker.module.Module.metrics_skip`, and any other
field whose key could break a statsd line is left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger("kvbroker.statsd")

PACKET_MAX = 1440
"""The most bytes of one datagram, as Flux's fripp sends: under a
1,500-byte Ethernet MTU with the IP and UDP headers."""
METRICS_MAX = 4096
"""The most metrics a rank sends a period (names past it are left out, and
that is logged once): a bound on what a stats field that grew with use
could cost each period, whatever a module's stats hold."""
ENV = "FLUX_FRIPP_STATSD"
"""Flux's variable: the statsd server's ``HOST:PORT``, when
``stats.statsd`` is not given."""

_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")
FLUX_CONTENT_NAMES = {"count": "count", "dirty": "dirty", "cache-bytes": "size"}
"""The content module's figures Flux's content cache also sends, by our
name: theirs, under ``content-cache.``."""


def parse_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (Flux's form; ``[::1]:8125`` for an IPv6 address) as
    a host and a port; :class:`ValueError` saying what is wrong."""
    host, sep, port = value.strip().rpartition(":")
    if not sep:
        raise ValueError(f"{value!r} has no port: HOST:PORT (missing colon delimiter)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{value!r} has no host: HOST:PORT")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def flatten(stats: Mapping[str, Any], skip: Iterable[str] = (),
            prefix: str = "") -> dict[str, float | int]:
    """The numbers of ``stats`` by dotted name (``counts.commits``): nested
    maps are followed, ``bool`` counts as 0/1; lists, strings, ``None``
    and floats that are not finite are left out, and so is every field
    named in ``skip`` (a dotted name within ``stats``: ``namespaces``,
    ``overlay.hosts``) and every key that is not a plain word
    (:data:`_NAME_RE`).  Each name starts with ``prefix``."""
    out: dict[str, float | int] = {}
    skipped = set(skip)

    def walk(node: Mapping[str, Any], path: str) -> None:
        for key, value in node.items():
            if not isinstance(key, str) or not _NAME_RE.fullmatch(key):
                continue
            name = f"{path}{key}"
            if name in skipped:
                continue
            if isinstance(value, Mapping):
                walk(value, name + ".")
            elif isinstance(value, bool):
                out[prefix + name] = int(value)
            elif isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
                out[prefix + name] = value
    walk(stats, "")
    return out


def lines_of(prefix: str, metrics: Mapping[str, float | int]) -> list[bytes]:
    """Each metric as a statsd gauge line, ``PREFIX.NAME:VALUE|g\n``; a
    float in plain decimals, at most 6 places (``0.25``, never ``1e-05``:
    not every statsd server reads an exponent)."""
    return [f"{prefix}.{name}:{_number(value)}|g\n".encode() for name, value in metrics.items()]


def _number(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def packets(lines: Iterable[bytes], limit: int = PACKET_MAX) -> list[bytes]:
    """``lines`` packed into datagrams of at most ``limit`` bytes, each
    ending on a whole line (a line longer than ``limit`` goes alone)."""
    out: list[bytes] = []
    current = b""
    for line in lines:
        if current and len(current) + len(line) > limit:
            out.append(current)
            current = b""
        current += line
    if current:
        out.append(current)
    return out


class StatsdSender:
    """One rank's pusher: every ``period`` seconds, the metrics ``collect``
    gives that changed since they were last sent, to ``address``.  The
    first period sends them all; so does each 60th after, so a server
    started later, or one that lost its state, learns the figures that
    stand still too."""

    RESEND_EVERY = 60

    def __init__(self, address: tuple[str, int], prefix: str, period: float,
                 collect: Callable[[], dict[str, float | int]]) -> None:
        self.address = address
        self.prefix = prefix
        self.period = period
        self.collect = collect
        self.sent: dict[str, float | int] = {}
        self.packets = 0
        self.dropped = 0
        self.turns = 0
        self._said_too_many = False
        self._sock: socket.socket | None = None
        self._sockaddr: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, source: str) -> bool:
        """Resolve the server's address and start sending; a name that does
        not resolve is logged, naming ``source`` (the attribute or the
        variable that gave it; Flux logs a "parse error") and nothing is
        sent (False): the rank serves on."""
        host, port = self.address
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            log.error("%s: cannot resolve %s: %s; sending no figures", source, host, why)
            return False
        family, kind, proto, _, sockaddr = infos[0]
        self._sock = socket.socket(family, kind, proto)
        self._sock.setblocking(False)
        self._sockaddr = sockaddr
        self._task = asyncio.ensure_future(self._run())
        return True

    async def _run(self) -> None:
        while True:
            try:
                self.send_once()
            except Exception:  # (a module's stats() failing must not end the pusher)
                log.exception("statsd: could not send this period's figures")
            await asyncio.sleep(self.period)

    def send_once(self) -> int:
        """Send what changed (everything on a resend turn); the datagrams sent."""
        metrics = self.collect()
        if len(metrics) > METRICS_MAX:
            if not self._said_too_many:
                self._said_too_many = True
                log.warning("statsd: %d figures, sending the first %d", len(metrics),
                            METRICS_MAX)
            metrics = dict(list(metrics.items())[:METRICS_MAX])
        every = self.turns % self.RESEND_EVERY == 0
        self.turns += 1
        changed = {name: value for name, value in metrics.items()
                   if every or self.sent.get(name) != value}
        self.sent = metrics
        sent = 0
        assert self._sock is not None
        for packet in packets(lines_of(self.prefix, changed)):
            try:
                self._sock.sendto(packet, self._sockaddr)
                sent += 1
            except OSError:  # (nobody listening, or no room: statsd is best effort)
                self.dropped += 1
        self.packets += sent
        return sent

    def stats(self) -> dict[str, Any]:
        return {"address": f"{self.address[0]}:{self.address[1]}", "prefix": self.prefix,
                "period": self.period, "packets": self.packets, "dropped": self.dropped,
                "figures": len(self.sent)}

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
