"""A rank dials its parent itself until it has joined (ZeroMQ's reconnect
is off on that link: broker/overlay_zmq.py ``parent_socket``): a child
started well before its parent, over ipc and over tcp, and one whose parent
went away before answering and came back only after several failed dials,
still join.  Real rank processes (``python -m broker.rank``, as
tests/test_overlay_faults.py starts one; ``kvbroker broker`` with a
bootstrap file for the stand-in parent's case)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli, wait_until
from test_multihost import START, StandInParent, keyed_config
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)

from broker.bootstrap import load
from broker.handle import Handle
from broker.launch import free_tcp_ports

WAITED = "no connection to parent rank 0 at"
"""The WARNING a rank logs once it has had no connection to its parent for
``tbon.connect_timeout``: proof it has been dialling in vain that long."""


@pytest.fixture
async def ranks(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start rank processes of one 2-rank instance; kill what is left at the end."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(rank: int, transport: str, endpoints: dict[str, str],
                    log: Path) -> asyncio.subprocess.Process:
        attrs = {"tbon.transport": transport, "tbon.connect_timeout": "0.5s",
                 "log.level": "info"}
        keys = tmp_path / "curve.key"
        curve = ["--curve-keys", str(keys)] if transport == "tcp" else []
        with open(log, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "broker.rank", "--rank", str(rank), "--size", "2",
                "--fanout", "2", "--rundir", str(tmp_path / "run"),
                "--attrs", json.dumps(attrs), "--endpoints", json.dumps(endpoints), *curve,
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=err, start_new_session=True)
        procs.append(proc)
        return proc

    (tmp_path / "run").mkdir()
    yield start
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


async def ready(proc: asyncio.subprocess.Process) -> str:
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), START)).decode()
    assert line.startswith("ready "), line
    return line.split()[1]


async def logged(log: Path, text: str, timeout: float = 15.0) -> None:
    async def there() -> bool:
        return log.exists() and text in log.read_text()

    await wait_until(there, f"{text!r} in {log.name}", timeout)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_a_child_started_well_before_its_parent_joins_once_it_comes(
        tmp_path: Path, ranks: Callable[..., Any], transport: str) -> None:
    """Rank 1 alone dials a parent that is not there (ipc: no socket file,
    ENOENT; tcp: connection refused), each dial ending in ZeroMQ's
    ``EVENT_CLOSED`` and another dial from the rank, for longer than
    ``tbon.connect_timeout`` (its WARNING says so, once).  Then rank 0
    starts, and both join: rank 1 says ``ready``, and a ping from rank 0
    reaches it.  Were any failed dial not dialled again, rank 1 would wait
    for ever."""
    endpoints: dict[str, str] = {}
    if transport == "tcp":
        assert (await run_cli("keygen", str(tmp_path / "curve.key")))[0] == 0
        endpoints = {"0": f"tcp://127.0.0.1:{free_tcp_ports(1)[0]}"}
    log1 = tmp_path / "rank1.log"
    rank1 = await ranks(1, transport, endpoints, log1)
    await logged(log1, WAITED)
    rank0 = await ranks(0, transport, endpoints, tmp_path / "rank0.log")
    uri1 = await ready(rank1)
    uri0 = await ready(rank0)
    async with Handle.connect(uri0) as h:
        assert (await h.ping(1))["route"][-1] == "r1"
    async with Handle.connect(uri1) as h:
        assert (await h.ping(0))["route"][-1] == "r0"
    assert log1.read_text().count(WAITED) == 1


async def test_a_child_whose_parent_went_before_answering_joins_when_it_is_back(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    """The parent reads rank 1's hello and goes before answering (a parent
    restarting), and nothing listens at its address for a while: rank 1's
    dials to it fail (its WARNING after ``tbon.connect_timeout`` says so).
    A real rank 0 then starts at that address and rank 1 joins it, on a
    connection dialled by rank 1 after the failed ones."""
    config = await keyed_config(tmp_path, 2, 2, **{"tbon.connect_timeout": "0.5s"})
    parent = StandInParent(tmp_path, load(str(config)).endpoints()[0])
    log1 = tmp_path / "stderr1-0"
    try:
        rank1 = await brokers(config, 1)
        parent.recv("overlay.hello")
    finally:
        parent.close()  # the link drops, and nothing listens there for now
    await logged(log1, "closed before it answered this rank's hello")
    await logged(log1, WAITED)
    rank0 = await brokers(config, 0)
    assert await rank1.ready() == rank1.uri
    await rank0.ready()
    async with Handle.connect(rank0.uri) as h:
        assert (await h.ping(1))["route"][-1] == "r1"


async def test_a_parent_that_drops_each_hello_is_logged_once_a_second(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    """A parent that reads each hello and drops the link before answering,
    over and over (a parent crashing as it admits its children): the
    child's INFO that it says hello again on a new connection comes once a
    second at most, the ones held back counted in the next -- it was one
    line per dial, 301 for 300 drops (a review audit)."""
    config = await keyed_config(tmp_path, 2, 2, **{"tbon.connect_timeout": "30s"})
    parent = StandInParent(tmp_path, load(str(config)).endpoints()[0])
    log1 = tmp_path / "stderr1-0"
    loop = asyncio.get_running_loop()
    try:
        await brokers(config, 1)
        parent.recv("overlay.hello")
        began = loop.time()
        for _ in range(20):
            parent.sock.close(0)  # (the link drops before any answer)
            parent.sock = parent.bind()
            parent.recv("overlay.hello")  # (the child dialled again)
        took = loop.time() - began
    finally:
        parent.close()
    lines = log1.read_text().count("closed before it answered this rank's hello")
    assert 1 <= lines <= took + 1, (took, log1.read_text())


def fake_parent(tmp_path: Path) -> socket.socket:
    """A listening socket at rank 0's ipc endpoint that speaks no ZeroMQ."""
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(tmp_path / "run" / "tbon-0"))
    srv.listen(16)
    srv.setblocking(False)
    return srv


async def accepted(srv: socket.socket, child: asyncio.subprocess.Process,
                   timeout: float) -> socket.socket:
    """The next connection to ``srv``; fails if ``child`` exits first or none
    comes within ``timeout``."""
    loop = asyncio.get_running_loop()
    accept = asyncio.ensure_future(loop.sock_accept(srv))
    exited = asyncio.ensure_future(child.wait())
    done, _ = await asyncio.wait({accept, exited}, timeout=timeout,
                                 return_when=asyncio.FIRST_COMPLETED)
    exited.cancel()
    if accept not in done:
        accept.cancel()
        raise AssertionError(f"no dial within {timeout} s (child exit {child.returncode})")
    return accept.result()[0]


async def test_a_parent_that_drops_connections_is_dialled_again_not_blamed_on_keys(
        ranks: Callable[..., Any], tmp_path: Path) -> None:
    """A parent endpoint that accepts and closes each connection (a parent
    dying as it accepts, or restarting in a loop), on ipc without CURVE:
    the child dials again, for ever.  It counted each as a CURVE key
    refusal and stopped with exit 3 after five, "curve_cert must be the
    same key file as its parent's" -- with no keys at all (a review audit)."""
    srv = fake_parent(tmp_path)
    try:
        child = await ranks(1, "ipc", {}, tmp_path / "rank1.log")
        for _ in range(10):
            (await accepted(srv, child, 20)).close()
        assert child.returncode is None
        assert "CURVE" not in (tmp_path / "rank1.log").read_text()
    finally:
        srv.close()


async def test_a_parent_that_never_speaks_is_left_after_the_handshake_limit(
        ranks: Callable[..., Any], tmp_path: Path) -> None:
    """A peer that accepts the connection and never speaks ZeroMQ: the
    child gives that connection up after the 5 s handshake limit (as a
    parent does its children's) and dials again -- it waited ZeroMQ's
    default 30 s, saying "no connection" meanwhile (a review audit)."""
    srv = fake_parent(tmp_path)
    held = []
    try:
        child = await ranks(1, "ipc", {}, tmp_path / "rank1.log")
        held.append(await accepted(srv, child, 20))
        held.append(await accepted(srv, child, 15))  # (5 s and a dial, not 30 s)
        assert child.returncode is None
    finally:
        for conn in held:
            conn.close()
        srv.close()
