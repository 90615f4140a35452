"""An instance spread over hosts: ``kvbroker keygen``, the bootstrap file and
``kvbroker broker`` (docs/guide.md, "Across hosts").  The hosts here are all
127.0.0.1, but each rank is its own ``kvbroker broker`` process that knows
the others only from the file, over ``tcp://`` with CURVE."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import signal
import socket
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import KVBROKER, run_cli, stats, stop_process, wait_until
from test_cli_broker import alive, all_gone

from broker import codec
from broker.bootstrap import BootstrapError, judged_by_name, load, parse, wrong_host
from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import free_tcp_ports
from broker.message import Message, MsgType
from broker.overlay import DEFAULT_CONNECT_TIMEOUT, hello_hostname
from kvs.client import KVS

START = 30.0


def write_config(path: Path, size: int, fanout: int, cert: str,
                 hosts: list[str] | None = None, **attrs: Any) -> None:
    """A bootstrap file for ``size`` ranks on 127.0.0.1, each rank with
    children on its own free port (``%p`` would collide with real ports).
    Every entry names this host (a parent refuses a hello from a host
    that is not its rank's entry), unless ``hosts`` says otherwise (then
    start each rank with ``-S hostname=`` its entry)."""
    entries = []
    names = hosts or [socket.gethostname()] * size
    for rank, port in enumerate(free_tcp_ports(size)):  # (distinct: drawn together)
        entries.append(f'{{ host = "{names[rank]}", bind = "tcp://127.0.0.1:{port}", '
                       f'connect = "tcp://127.0.0.1:{port}" }}')
    listed = ",\n  ".join(entries)
    text = (f'[bootstrap]\ncurve_cert = "{cert}"\nfanout = {fanout}\n'
            f'hosts = [\n  {listed}\n]\n')
    if attrs:
        text += "[attrs]\n" + "".join(f'"{k}" = {v!r}\n' for k, v in attrs.items())
    path.write_text(text)


async def keyed_config(tmp_path: Path, size: int, fanout: int,
                       hosts: list[str] | None = None, **attrs: Any) -> Path:
    """A new key pair and a bootstrap file naming it (``tmp_path/inst.toml``),
    with ``attrs`` in its ``[attrs]`` table."""
    assert (await run_cli("keygen", str(tmp_path / "curve.key")))[0] == 0
    config = tmp_path / "inst.toml"
    write_config(config, size, fanout, "curve.key", hosts, **attrs)
    return config


class Rank:
    """One ``kvbroker broker`` process and its run directory."""

    def __init__(self, proc: asyncio.subprocess.Process, rundir: Path, rank: int) -> None:
        self.proc, self.rundir, self.rank = proc, rundir, rank

    @property
    def uri(self) -> str:
        return f"local://{self.rundir}/local-{self.rank}"

    async def ready(self) -> str:
        assert self.proc.stdout is not None
        line = (await asyncio.wait_for(self.proc.stdout.readline(), START)).decode()
        assert line.startswith("ready "), line
        return line.split()[1]


@pytest.fixture
async def brokers(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Start ``kvbroker broker --config FILE --rank R``; kill what is left at the end."""
    started: list[Rank] = []

    async def start(config: Path, rank: int, *extra: str) -> Rank:
        rundir = tmp_path / f"run{rank}-{len(started)}"
        with open(tmp_path / f"stderr{rank}-{len(started)}", "wb") as log:
            proc = await asyncio.create_subprocess_exec(
                KVBROKER, "broker", "--config", str(config), "--rank", str(rank),
                "--rundir", str(rundir), "-S", "log.level=info", *extra,
                stdout=asyncio.subprocess.PIPE, stderr=log,
                stdin=asyncio.subprocess.DEVNULL)
        started.append(Rank(proc, rundir, rank))
        return started[-1]

    yield start
    for r in started:
        if r.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.kill()
            await r.proc.wait()


# ---------------------------------------------------------------- the file


GOOD = """
[bootstrap]
curve_cert = "keys/curve.key"
fanout = 2
default_bind = "tcp://*:8050"
default_connect = "tcp://%h:8050"
hosts = [
  { host = "node0.example.org" },
  { host = "node1", connect = "tcp://10.0.0.1:9000" },
  { host = "node2" },
  { host = "node3" },
]
[attrs]
"kvs.setroot-blob-limit" = 0
"""


def test_bootstrap_file_names_ranks_endpoints_and_keys() -> None:
    boot = parse(GOOD, "/etc/kvb/inst.toml")
    assert boot.size == 4 and boot.fanout == 2
    assert boot.curve_cert == "/etc/kvb/keys/curve.key"  # relative to the file
    # only ranks with children (0 -> 1, 2; 1 -> 3) are dialled or bound
    assert boot.endpoints() == {0: "tcp://node0.example.org:8050", 1: "tcp://10.0.0.1:9000"}
    assert boot.bind_endpoint(0) == "tcp://*:8050" and boot.bind_endpoint(3) is None
    assert boot.attrs == {"kvs.setroot-blob-limit": 0}
    assert boot.rank_of("node2") == 2
    assert boot.rank_of("node0") == 0  # a short name matches a full one ...
    assert boot.rank_of("node1.example.org") == 1  # ... and the other way round
    with pytest.raises(BootstrapError, match="no hosts entry for this host"):
        boot.rank_of("elsewhere")
    assert boot.rank_of("NODE2") == 2  # host names ignore case, as DNS does
    assert boot.hostnames() == ["node0.example.org", "node1", "node2", "node3"]
    two = parse(GOOD.replace('"node3"', '"node2"'), "x.toml")
    with pytest.raises(BootstrapError, match="ranks 2, 3 all run on node2; give --rank"):
        two.rank_of("node2")


def test_a_hello_s_host_is_judged_as_rank_of_finds_ranks() -> None:
    """What a parent refuses (:func:`wrong_host`): a hello as rank R from a
    host that rank_of would not find R on.  Entries and names that no one
    host goes by (an address, localhost) are not judged, nor is a name
    that matches several entries for one of them."""
    hosts = ["node0.example.org", "node1", "10.0.0.2", "localhost", "node1", "[::1]",
             "node6.a.org", "node6"]
    assert not wrong_host(hosts, 0, "node0") and not wrong_host(hosts, 0, "NODE0.example.org")
    assert not wrong_host(hosts, 1, "node1.example.org")
    assert wrong_host(hosts, 1, "node0") and wrong_host(hosts, 0, "node1")
    assert not wrong_host(hosts, 4, "node1")  # two ranks on one host
    for rank in (2, 3, 5):  # an address or localhost: cannot be judged
        assert not wrong_host(hosts, rank, "node9"), rank
    for name in ("127.0.0.1", "::1", "localhost", "localhost.localdomain", ""):
        assert not wrong_host(hosts, 1, name), name
    assert not wrong_host(hosts, 9, "node0")  # (no such entry: not this check's to say)
    # the full name first, as rank_of: node6.a.org is rank 6's, not rank 7's
    assert wrong_host(hosts, 7, "node6.a.org") and not wrong_host(hosts, 7, "node6.b.org")
    assert [judged_by_name(h) for h in ("node1", "10.0.0.2", "[::1]", "LocalHost")] == \
        [True, False, False, False]
    assert hello_hostname({"hostname": "node1.example.org"}) == "node1.example.org"
    for bad in ({}, {"hostname": 3}, {"hostname": "a\nb"}, {"hostname": "x" * 256}, None):
        assert hello_hostname(bad) is None, bad


@pytest.mark.parametrize(("text", "message"), [
    ("[bootstrap\n", "x.toml: "),
    ("[other]\n", "unknown table\\(s\\) or key\\(s\\): other"),
    ('[bootstrap]\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "curve_cert is required for more than one rank"),
    ('[bootstrap]\ncurve_cert = "k"\nhosts = "a"\n', "hosts must be a list of host entries"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 0\nhosts = [{ host = "a" }]\n', "fanout"),
    ('[bootstrap]\ncurve_cert = "k"\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "hosts\\[0\\] \\(a\\) has children and needs bind"),
    ('[bootstrap]\ncurve_cert = "k"\ndefault_bind = "ipc:///x"\ndefault_connect = "tcp://a:1"\n'
     'hosts = [{ host = "a" }, { host = "b" }]\n', "must be a tcp:// endpoint"),
    ('[bootstrap]\ncurve_cert = "k"\nhosts = [{ host = "a", port = 1 }]\n',
     "hosts\\[0\\]: unknown key\\(s\\): port"),
    ('[bootstrap]\ncurve_cert = "k"\nhots = []\n', "unknown bootstrap key\\(s\\): hots"),
    # a Flux config's tables were ignored without a word, their settings not in effect
    ('[bootstrap]\ncurve_cert = "k"\nhosts = [{ host = "a" }]\n[access]\nallow-guest-user = true\n',
     'unknown table\\(s\\) or key\\(s\\): access: a bootstrap file holds \\[bootstrap\\] and '
     '\\[attrs\\]; broker attributes go in \\[attrs\\] \\(as "access.allow-guest-user" = ...\\)'),
    ('fanout = 2\n[bootstrap]\ncurve_cert = "k"\nhosts = [{ host = "a" }]\n[kvs]\n'
     'checkpoint-period = "5s"\n', "unknown table\\(s\\) or key\\(s\\): fanout, kvs: "),
    ('[bootstrap]\ncurve_cert = "k"\nhosts = [{ bind = "tcp://a:1" }]\n', "host is required"),
    ('[bootstrap]\ncurve_cert = "k"\nhosts = [{ host = "a b" }]\n',
     "hosts\\[0\\]: host 'a b' is not a host name"),
    ('[bootstrap]\ncurve_cert = "k"\nhosts = [{ host = "n[3-1]" }]\n',
     "hosts\\[0\\]: host 'n\\[3-1\\]' is not a host list: range '3-1' does not ascend"),
    ('[bootstrap]\ncurve_cert = "k"\ndefault_port = 0\nhosts = [{ host = "a" }]\n',
     "default_port must be a port number"),
    ('[bootstrap]\ncurve_cert = "k"\nenable_ipv6 = 1\nhosts = [{ host = "a" }]\n',
     "enable_ipv6 must be true or false"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:1"\n'
     'default_connect = "tcp://x:1"\nhosts = [{ host = "n[0-2]" }]\n',
     "hosts\\[0\\] n1 \\(rank 1\\).connect 'tcp://x:1' is also hosts\\[0\\] n0 \\(rank 0\\)'s"),
    # found here, not as "Address already in use" or a hello to the wrong rank
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:1"\n'
     'default_connect = "tcp://a"\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "hosts\\[0\\].connect 'tcp://a' needs a port"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:1"\n'
     'default_connect = "tcp://a:1"\nhosts = [{ host = "a" }, { host = "b" }, { host = "c" }]\n',
     "hosts\\[1\\].connect 'tcp://a:1' is also hosts\\[0\\]'s"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:1"\n'
     'default_connect = "tcp://%h:1"\nhosts = [{ host = "a" }, { host = "a" }, { host = "c" }]\n',
     "hosts\\[1\\].bind 'tcp://\\*:1' is also hosts\\[0\\]'s"),
    # one host by two names, as ranks_on takes them (the text was compared)
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:1"\n'
     'default_connect = "tcp://%h:1"\nhosts = [{ host = "a" }, { host = "A.example.org" }, '
     '{ host = "c" }]\n',
     "hosts\\[1\\].bind 'tcp://\\*:1' is also hosts\\[0\\]'s"),
    # ports ZeroMQ takes, but no instance can come up on
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:%p"\n'
     'default_connect = "tcp://%h:%p"\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "hosts\\[0\\].bind 'tcp://\\*:0': port 0 is not a port number \\(1-65535\\) \\(without "
     "bootstrap.default_port, %p is the rank: give default_port, or write it after "
     "digits, as 90%p\\)$"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:99999"\n'
     'default_connect = "tcp://%h:1"\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "hosts\\[0\\].bind 'tcp://\\*:99999': port 99999 is not a port number \\(1-65535\\)$"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:1"\n'
     'default_connect = "tcp://%h:*"\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "hosts\\[0\\].connect 'tcp://a:\\*': a rank with children needs a fixed port"),
    # an IPv6 address without brackets: ZeroMQ failed only as the rank bound it
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\n'
     'hosts = [{ host = "a", bind = "tcp://::1:90", connect = "tcp://[::1]:90" }, '
     '{ host = "b" }]\n',
     "hosts\\[0\\].bind 'tcp://::1:90': an IPv6 address goes in brackets "
     "\\(tcp://\\[::1\\]:90\\)$"),
    ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://*:*"\n'
     'default_connect = "tcp://%h:1"\nhosts = [{ host = "a" }, { host = "b" }]\n',
     "hosts\\[0\\].bind 'tcp://\\*:\\*': a rank with children needs a fixed port"),
])
def test_bootstrap_file_errors_say_where(text: str, message: str) -> None:
    with pytest.raises(BootstrapError, match=message):
        parse(text, "x.toml")


def test_a_percent_in_a_host_name_is_not_expanded_again() -> None:
    """``%h`` then ``%p`` in turn expanded a ``%p`` inside the host's name."""
    from broker.bootstrap import _expand

    assert _expand("tcp://%h:%p", "a%p", 0, 900) == "tcp://a%p:900"
    assert _expand("tcp://%h:90%p", "n1", 3, None) == "tcp://n1:903"


def test_a_small_or_big_float_in_a_file_is_the_number_written() -> None:
    """TOML's ``0.0000001`` was the text ``1e-07``, which no duration takes:
    refused, naming a value nobody wrote."""
    from broker.attrs import duration
    from broker.bootstrap import attr_text

    assert attr_text(0.0000001) == "0.0000001" and duration(attr_text(0.0000001)) == 1e-07
    assert attr_text(1e20) == "100000000000000000000"
    assert attr_text(2.5) == 2.5 and attr_text(True) == "true"


def test_two_addresses_are_two_hosts_for_the_bind_check() -> None:
    """Addresses are not cut at their first dot as names are: 127.0.0.1
    and 127.0.0.2 bind the same port each on its own."""
    text = ('[bootstrap]\ncurve_cert = "k"\nfanout = 1\ndefault_bind = "tcp://%h:1"\n'
            'default_connect = "tcp://%h:1"\nhosts = [{ host = "127.0.0.1" }, '
            '{ host = "127.0.0.2" }, { host = "127.0.0.3" }]\n')
    assert len(parse(text, "x.toml").hosts) == 3


def test_compact_hosts_and_default_port_read_as_flux_s() -> None:
    """flux-config-bootstrap(5)'s 1,024-node example: a host list in
    ``host`` makes one entry per name (its compact hosts, RFC 29), and
    ``%p`` is ``default_port`` when the file gives one (else the rank, as
    before).  A Flux file with either was refused, or read otherwise."""
    boot = parse("""
[bootstrap]
curve_cert = "curve.cert"
fanout = 2
default_port = 8050
default_bind = "tcp://en0:%p"
default_connect = "tcp://e%h:%p"
hosts = [
  { host = "test0", bind = "tcp://en4:9001", connect = "tcp://test-mgmt:9001" },
  { host = "test[1-1023]" },
]
""", "x.toml")
    assert boot.size == 1024
    assert boot.hostnames()[:3] == ["test0", "test1", "test2"]
    assert boot.hostnames()[-1] == "test1023"
    assert boot.endpoints()[0] == "tcp://test-mgmt:9001" and boot.bind_endpoint(0) == "tcp://en4:9001"
    assert boot.endpoints()[1] == "tcp://etest1:8050" and boot.bind_endpoint(1) == "tcp://en0:8050"
    assert boot.rank_of("test5") == 5
    # a plain list, an address and localhost are entries of their own, in order
    boot = parse('[bootstrap]\ncurve_cert = "k"\nfanout = 8\ndefault_bind = "tcp://*:9%p"\n'
                 'default_connect = "tcp://%h:9%p"\n'
                 'hosts = [{ host = "[::1]" }, { host = "a,b[7-8]" }, { host = "localhost" }]\n',
                 "x.toml")
    assert boot.hostnames() == ["[::1]", "a", "b7", "b8", "localhost"]
    assert boot.endpoints() == {0: "tcp://[::1]:90"}  # (no default_port: %p is the rank)


async def test_an_instance_from_compact_hosts(tmp_path: Path, brokers) -> None:
    """Three ranks from two entries, ``n0`` and ``n[1-2]`` (each rank
    going by its host's name with ``-S hostname``): one instance."""
    assert (await run_cli("keygen", str(tmp_path / "curve.key")))[0] == 0
    port = free_tcp_ports(1)[0]
    config = tmp_path / "inst.toml"
    config.write_text(f'[bootstrap]\ncurve_cert = "curve.key"\nfanout = 2\nhosts = [\n'
                      f'  {{ host = "n0", bind = "tcp://127.0.0.1:{port}", '
                      f'connect = "tcp://127.0.0.1:{port}" }},\n  {{ host = "n[1-2]" }},\n]\n')
    ranks = [await brokers(config, r, "-S", f"hostname=n{r}") for r in (0, 1, 2)]
    uris = [await r.ready() for r in ranks]
    async with asyncio.timeout(30), await Handle.connect(uris[0]) as h:
        assert (await h.ping(2))["route"][1:] == ["r0", "r2"]
        assert await h.attr_get("hostlist", nodeid=2) == "n0,n1,n2"
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert await exit_codes(ranks, tmp_path) == [0, 0, 0]


async def test_links_over_ipv6(tmp_path: Path, brokers) -> None:
    """An IPv6 address in an endpoint (``tcp://[::1]:P``) failed at once
    ("No such device": ZeroMQ is IPv4-only unless told); and ``enable_ipv6
    = true`` (Flux's key, ``tbon.ipv6``) lets rank 0's wildcard bind take
    IPv6 connections too, which the child here makes."""
    assert (await run_cli("keygen", str(tmp_path / "curve.key")))[0] == 0
    assert parse('[bootstrap]\ncurve_cert = "k"\nenable_ipv6 = true\nhosts = [{ host = "a" }]\n',
                 "x.toml").attrs == {"tbon.ipv6": "true"}
    port = free_tcp_ports(1)[0]
    config = tmp_path / "inst.toml"
    config.write_text(f'[bootstrap]\ncurve_cert = "curve.key"\nenable_ipv6 = true\nhosts = [\n'
                      f'  {{ host = "[::1]", bind = "tcp://*:{port}", '
                      f'connect = "tcp://[::1]:{port}" }},\n  {{ host = "[::1]" }},\n]\n')
    ranks = [await brokers(config, r) for r in (0, 1)]
    uris = [await r.ready() for r in ranks]
    async with asyncio.timeout(30), await Handle.connect(uris[0]) as h:
        assert (await h.ping(1))["route"][1:] == ["r0", "r1"]
        assert await h.attr_get("tbon.ipv6", nodeid=1) in (True, "true")
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert await exit_codes(ranks, tmp_path) == [0, 0]


async def test_a_file_without_hosts_runs_one_rank_on_its_own(tmp_path: Path) -> None:
    """As Flux's: no ``hosts`` (or an empty list) is one rank, on whatever
    host runs it, and one rank has no links, so no ``curve_cert`` either
    (both were refused: a single-node Flux system file did not start)."""
    for text in ("[bootstrap]\n", "[bootstrap]\nhosts = []\n"):
        boot = parse(text, "x.toml")
        assert (boot.size, boot.curve_cert, boot.endpoints()) == (1, None, {})
        assert boot.rank_of("anyhost") == 0 and boot.hostnames("here") == ["here"]
    config = tmp_path / "inst.toml"
    config.write_text("[bootstrap]\n[attrs]\n\"my.attr\" = \"x\"\n")
    script = "kvbroker kvs put a=1 && kvbroker kvs get a && kvbroker attr get my.attr"
    rc, out, err = await run_cli("broker", "--config", str(config), "-S", "hostname=solo",
                                 "--", "sh", "-c", script + " && kvbroker attr get hostlist")
    assert (rc, out) == (0, "1\nx\nsolo\n"), err
    # Flux's -S statedir=DIR and -S rundir=DIR: its spellings of the options
    state, run = tmp_path / "state", tmp_path / "run"
    rc, out, err = await run_cli("broker", "--config", str(config), "-S", f"statedir={state}",
                                 "-S", f"rundir={run}", "--", "sh", "-c",
                                 "kvbroker attr get statedir && kvbroker attr get rundir")
    assert (rc, out) == (0, f"{state}\n{run}\n"), err
    assert (state / "content.sqlite").is_file() and run.is_dir()


async def test_a_second_rank_0_on_the_same_rundir_says_it_is_in_use(tmp_path: Path) -> None:
    """Two standalone ranks (no bind to collide on) given one ``--rundir``:
    the second said ``StoreLocked: .../content.sqlite: database is locked``.
    It now says the run directory is another rank 0's, and the first runs on."""
    config = tmp_path / "one.toml"
    config.write_text("[bootstrap]\n")
    rundir = tmp_path / "run"
    first = await asyncio.create_subprocess_exec(
        KVBROKER, "broker", "--config", str(config), "--rundir", str(rundir),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        stdin=asyncio.subprocess.DEVNULL)
    try:
        assert first.stdout is not None
        line = (await asyncio.wait_for(first.stdout.readline(), START)).decode()
        assert line.startswith("ready "), line
        rc, _, err = await run_cli("broker", "--config", str(config), "--rundir", str(rundir),
                                   timeout=30)
        assert rc == 1 and (f"start-up failed: rundir {rundir} is in use by another rank 0 "
                            "(its content.sqlite is locked)") in err, err
        rc, out, err = await run_cli("ping", uri=f"local://{rundir}/local-0")
        assert rc == 0 and first.returncode is None, err
    finally:
        first.kill()
        await first.wait()


def test_bootstrap_file_missing(tmp_path: Path) -> None:
    with pytest.raises(BootstrapError, match="nope.toml: No such file or directory"):
        load(str(tmp_path / "nope.toml"))


# ---------------------------------------------------------------- the commands


async def test_keygen_writes_owner_only_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "curve.key"
    rc, _, err = await run_cli("keygen", str(path))
    assert rc == 0, err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = path.read_bytes()
    rc, _, err = await run_cli("keygen", str(path))
    assert rc == 1 and "exists (keys are never overwritten)" in err
    assert path.read_bytes() == before
    # a local error names the file (it said only "No such file or directory")
    rc, _, err = await run_cli("keygen", str(tmp_path / "no" / "such.key"))
    assert rc == 1
    assert err == f"kvbroker: keygen: {tmp_path / 'no' / 'such.key'}: No such file or directory\n"


async def test_broker_refuses_a_bad_file_or_rank(tmp_path: Path) -> None:
    rc, _, err = await run_cli("broker", "--config", str(tmp_path / "none.toml"), "--rank", "0")
    assert rc == 2 and "none.toml: No such file or directory" in err
    config = tmp_path / "inst.toml"
    write_config(config, 2, 2, "missing.key", ["h0", "h1"])
    rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "0")
    assert rc == 2 and "missing.key: No such file or directory" in err
    assert (await run_cli("keygen", str(tmp_path / "missing.key")))[0] == 0
    rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "2")
    assert rc == 2 and "the bootstrap file lists ranks 0-1" in err
    rc, _, err = await run_cli("broker", "--config", str(config))  # no entry names this host
    assert rc == 2 and "no hosts entry for this host" in err
    # the host a rank goes by is -S hostname's, when given (as Flux's -Shostname)
    rc, _, err = await run_cli("broker", "--config", str(config), "-S", "hostname=h9")
    assert rc == 2 and "no hosts entry for this host (h9); give --rank" in err, err
    # a name its hello could not say (the parent would judge nothing): refused
    rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "0",
                               "-S", "hostname=node/1")
    assert rc == 2 and "hostname 'node/1' is not a host name" in err, err
    rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "0",
                               "-S", "content.blob-size-limit=lots")
    assert rc == 2 and "content.blob-size-limit" in err
    # a key file that is not a key pair: said, naming the file (it was a
    # ZMQError "Invalid argument" at start-up, exit 1)
    key = tmp_path / "missing.key"
    public, secret = key.read_bytes().split()
    for text, why in ((b"two words\n", "not a key pair file"),
                      (secret + b"\n" + public + b"\n", "is not the secret key's")):
        key.write_bytes(text)
        rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "0")
        assert rc == 2 and f"curve_cert {key}: " in err and why in err, err
    # a FIFO (or a directory) named as the key file: said, where a FIFO hung
    key.unlink()
    os.mkfifo(key, 0o600)
    rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "0", timeout=30)
    assert rc == 2 and f"curve_cert {key}: not a regular file" in err, err


async def test_four_ranks_from_one_file_make_one_instance(tmp_path: Path, brokers) -> None:
    config = await keyed_config(tmp_path, 4, 2)
    # started leaves first: a rank waits for its parent, whatever the order
    ranks = {r: await brokers(config, r) for r in (3, 2, 1, 0)}
    uris = {r: await ranks[r].ready() for r in (3, 2, 1, 0)}
    assert uris[0] == ranks[0].uri
    async with asyncio.timeout(30):
        h0 = await Handle.connect(uris[0])
        h3 = await Handle.connect(uris[3])
        try:
            assert (await h0.ping(3))["route"][1:] == ["r0", "r1", "r3"]
            assert await h3.attr_get("tbon.transport") == "tcp"
            assert await h3.attr_get("size") == 4
            rc, _, err = await run_cli("kvs", "put", "across=hosts", uri=uris[0])
            assert rc == 0, err
            rc, out, err = await run_cli("kvs", "get", "across", uri=uris[3])
            assert (rc, out) == (0, "hosts\n"), err
            assert (await stats(h0, 0))["overlay"]["refused"] == 0
        finally:
            await h0.close()
            await h3.close()
    # stopping rank 0 stops the instance: its shutdown goes down the tree
    ranks[0].proc.send_signal(signal.SIGTERM)
    codes = await exit_codes([ranks[r] for r in range(4)], tmp_path)
    assert codes == [0, 0, 0, 0]
    assert not any(os.path.exists(ranks[r].rundir / f"local-{r}") for r in range(4))


async def test_a_relative_statedir_is_made_absolute(tmp_path: Path, brokers) -> None:
    """``kvbroker broker --statedir sd``: the ``statedir`` attribute (and
    the log lines naming it) said ``sd``, which means nothing to an
    operator in another directory or on another host; ``start`` made it
    absolute already, as ``--rundir`` is."""
    config = await keyed_config(tmp_path, 1, 2)
    statedir = tmp_path / "state"
    rank = await brokers(config, 0, "--statedir", os.path.relpath(statedir))
    async with asyncio.timeout(30), await Handle.connect(await rank.ready()) as h:
        assert await h.attr_get("statedir") == str(statedir)
    rank.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank], tmp_path) == [0]
    assert (statedir / "content.sqlite").exists()


async def test_rank_0_without_a_statedir_leaves_no_store_in_its_rundir(
        tmp_path: Path, brokers) -> None:
    """Without a statedir nothing is kept (docs/kvs.md), but rank 0 of
    ``kvbroker broker --rundir DIR`` left its content store, a copy of
    every value, in DIR when it stopped: the directory is the operator's
    and outlives the rank, so the rank removes the file itself."""
    config = await keyed_config(tmp_path, 1, 2)
    rank = await brokers(config, 0)
    uri = await rank.ready()
    rc, _, err = await run_cli("kvs", "put", "--sync", "secret=value", uri=uri)
    assert rc == 0, err
    assert (rank.rundir / "content.sqlite").exists()
    rank.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank], tmp_path) == [0]
    assert sorted(p.name for p in rank.rundir.iterdir()) == []


async def test_rank_0_without_a_statedir_starts_without_a_killed_one_s_store(
        tmp_path: Path, brokers) -> None:
    """A rank 0 killed (SIGKILL) cannot remove its store from the --rundir
    it was given; the next rank 0 on that directory opened the file and
    kept serving from it -- every old value's copy lived on, and grew with
    each such restart.  Now it starts from an empty store."""
    config = await keyed_config(tmp_path, 1, 2)
    first = await brokers(config, 0)
    uri = await first.ready()
    async with await Handle.connect(uri) as h:
        kvs = KVS(h)
        await kvs.put("secret", "v" * 4096, sync=True)  # (a blob, not inline)
        ref = (await kvs.get_treeobj("secret"))["data"][0]
        assert (await h.rpc("content.load", {"blobref": ref}))["data"] == b"v" * 4096
    first.proc.kill()
    assert await exit_codes([first], tmp_path) == [-signal.SIGKILL]
    assert (first.rundir / "content.sqlite").exists()  # (nothing ran to remove it)
    second = await brokers(config, 0, "--rundir", str(first.rundir))
    async with await Handle.connect(await second.ready()) as h:
        with pytest.raises(RemoteError) as missing:
            await h.rpc("content.load", {"blobref": ref})
        assert missing.value.errnum == errno.ENOENT
        assert await KVS(h).get("secret", None) is None


async def test_a_rank_without_the_instance_keys_stops_with_status_3(tmp_path: Path,
                                                                   brokers) -> None:
    """A rank started with another key file was refused and dialled again
    every 20 ms for ever (logging the 1st, 10th, 100th... refusal, as its
    parent did).  It now gives up after 5 refusals in a row: it exits 3,
    saying why, in well under a second; its parent warns once, not per
    retry -- here for the 10 refusals of two such processes."""
    for name in ("curve.key", "other.key"):
        assert (await run_cli("keygen", str(tmp_path / name)))[0] == 0
    config = tmp_path / "inst.toml"
    write_config(config, 2, 2, "curve.key")
    forged = tmp_path / "forged.toml"
    forged.write_text(config.read_text().replace("curve.key", "other.key"))
    endpoint = load(str(config)).endpoints()[0]
    rank0 = await brokers(config, 0)
    async with asyncio.timeout(30):
        h = await _connect_when_listening(rank0.uri)
        try:
            for attempt in (1, 2):
                intruder = await brokers(forged, 1)
                assert await intruder.proc.wait() == 3
                err = (tmp_path / f"stderr1-{attempt}").read_text()
                assert (f"ERROR kvbroker: parent rank 0 at {endpoint} refused this rank's "
                        "CURVE key 5 times in a row (EVENT_HANDSHAKE_FAILED_NO_DETAIL") in err
                assert ("every rank needs the instance's key pair (this rank's curve_cert "
                        "must be the same key file as its parent's): stopping") in err
                # the WARNING at the first refusal says what is to come, not
                # "giving up", which a rank whose parent went away before the
                # fifth refusal did not do
                assert ("refused this rank's CURVE handshake (EVENT_HANDSHAKE_FAILED_NO_DETAIL"
                        in err), err
                assert ("; this rank stops (exit status 3) if 5 in a row are refused before "
                        "it joins\n") in err, err

            async def refused() -> bool:
                return (await stats(h, 0))["overlay"]["refused"] >= 10

            await wait_until(refused, "rank 0 to count every refusal")
            warnings = [line for line in (tmp_path / "stderr0-0").read_text().splitlines()
                        if "refused an overlay connection" in line]
            assert len(warnings) == 1, warnings
            assert ("WARNING kvbroker.overlay: refused an overlay connection: its CURVE "
                    "hello was not made for the instance's key") in warnings[0]
            assert (await stats(h, 0))["overlay"]["children"] == []
            genuine = await brokers(config, 1)
            assert await rank0.ready() == rank0.uri  # the instance is up only now
            await genuine.ready()
            assert (await stats(h, 0))["overlay"]["children"] == [1]
            assert (await h.ping(1))["route"][-1] == "r1"
        finally:
            await h.close()


async def test_a_rank_whose_key_the_parent_s_zap_refuses_stops_too(tmp_path: Path,
                                                                 brokers) -> None:
    """The other refusal: the parent's ZAP handler turns the rank's public
    key down (EVENT_HANDSHAKE_FAILED_AUTH).  ZeroMQ never dials again after
    that, so the rank waited for ever in silence; it now dials again itself
    and gives up, as above, after 5.  The parent here is a CURVE server with
    the instance's key whose ZAP handler admits another key only."""
    import zmq

    from broker.curve import ZAP_DOMAIN, load_keys, start_authenticator

    for name in ("curve.key", "other.key"):
        assert (await run_cli("keygen", str(tmp_path / name)))[0] == 0
    config = tmp_path / "inst.toml"
    write_config(config, 2, 2, "curve.key")
    public, secret = load_keys(str(tmp_path / "curve.key"))
    endpoint = load(str(config)).endpoints()[0]
    ctx = zmq.Context()
    auth = start_authenticator(ctx, load_keys(str(tmp_path / "other.key"))[0])
    parent = ctx.socket(zmq.ROUTER)
    parent.zap_domain = ZAP_DOMAIN.encode()
    parent.curve_server = True
    parent.curve_secretkey, parent.curve_publickey = secret, public
    monitor = parent.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    parent.bind(endpoint)
    try:
        rank1 = await brokers(config, 1)
        assert await asyncio.wait_for(rank1.proc.wait(), 30) == 3
        err = (tmp_path / "stderr1-0").read_text()
        assert (f"ERROR kvbroker: parent rank 0 at {endpoint} refused this rank's CURVE key "
                "5 times in a row (EVENT_HANDSHAKE_FAILED_AUTH: its ZAP handler refused our "
                "public key (status 400))") in err, err
        refusals = 0  # (the parent's monitor may report the last one a moment later)
        while refusals < 6 and monitor.poll(1000 if refusals < 5 else 0):
            monitor.recv_multipart()
            refusals += 1
        assert refusals == 5
    finally:
        monitor.close(0)
        parent.close(0)
        auth.stop()
        ctx.term()


async def test_a_rank_whose_file_names_another_parent_is_told_and_exits_1(
        tmp_path: Path, brokers) -> None:
    """Mismatched bootstrap files: rank 5's says fanout 4, so it says hello
    to rank 1, whose children are 3 and 4 (fanout 2; rank 5's parent is
    rank 2).  Rank 1 dropped the hello, and rank 5 waited for ever with
    nothing logged.  Rank 1 now answers (the peer passed CURVE with the
    instance's keys) why it refuses it, and rank 5 logs that as an ERROR
    and exits 1; a second such process is told too (once per process)."""
    config = await keyed_config(tmp_path, 6, 2)
    mismatched = tmp_path / "mismatched.toml"
    mismatched.write_text(config.read_text().replace("fanout = 2", "fanout = 4"))
    endpoint = load(str(config)).endpoints()[1]
    await brokers(config, 0)
    rank1 = await brokers(config, 1)
    async with asyncio.timeout(30):
        h = await _connect_when_listening(rank1.uri)
        try:
            for attempt in (2, 3):
                stray = await brokers(mismatched, 5)
                assert await asyncio.wait_for(stray.proc.wait(), 15) == 1
                err = (tmp_path / f"stderr5-{attempt}").read_text()
                assert (f"ERROR kvbroker: parent rank 1 at {endpoint} refused this rank's "
                        "hello: rank 5 is not a child of rank 1 in this instance's topology "
                        "(size 6, fanout 2: its parent is rank 2): check the bootstrap "
                        "file: stopping") in err, err
            assert (await stats(h, 1))["overlay"]["children"] == []
            assert (await h.ping())["rank"] == 1
        finally:
            await h.close()
    warned = (tmp_path / "stderr1-1").read_text()
    assert "a hello from rank 5, which is not a child of rank 1" in warned


async def test_a_rank_whose_file_lists_another_number_of_hosts_is_refused(
        tmp_path: Path, brokers) -> None:
    """Rank 1's file lists 3 hosts, or 5, where the instance has 4: its
    parent is right (rank 0), so its hello was admitted.  With 3 it had no
    children, so rank 3 could never join while rank 0 said ``ready``; with
    5 it served an instance of its own size.  Its hello now says its size,
    and rank 0 refuses another: the rank stops with status 1 saying why,
    and rank 1 from the right file joins after."""
    config = await keyed_config(tmp_path, 4, 2)
    lines = config.read_text().splitlines(keepends=True)
    last = next(i for i, line in enumerate(lines) if line.strip() == "]") - 1
    shorter, longer = tmp_path / "shorter.toml", tmp_path / "longer.toml"
    shorter.write_text("".join(lines[:last - 1] + [lines[last - 1].rstrip(",\n") + "\n"]
                               + lines[last + 1:]))
    extra = lines[last].replace("127.0.0.1:", "127.0.0.1:1").rstrip("\n")
    longer.write_text("".join(lines[:last] + [lines[last].rstrip("\n") + ",\n", extra + "\n"]
                              + lines[last + 1:]))
    assert (load(str(shorter)).size, load(str(longer)).size) == (3, 5)
    endpoint = load(str(config)).endpoints()[0]
    rank0 = await brokers(config, 0)
    async with asyncio.timeout(60):
        h = await _connect_when_listening(rank0.uri)
        try:
            for attempt, (file, size) in enumerate(((shorter, 3), (longer, 5)), start=1):
                stray = await brokers(file, 1)
                assert await asyncio.wait_for(stray.proc.wait(), 30) == 1
                err = (tmp_path / f"stderr1-{attempt}").read_text()
                assert (f"ERROR kvbroker: parent rank 0 at {endpoint} refused this rank's "
                        f"hello: this instance has 4 ranks, this rank's bootstrap file lists "
                        f"{size} hosts: every host needs the same bootstrap file: stopping") \
                    in err, err
                assert (await stats(h, 0))["overlay"]["children"] == []
            ranks = [await brokers(config, r) for r in (1, 2, 3)]
            assert await rank0.ready() == rank0.uri
            assert [(await h.ping(r))["rank"] for r in (1, 2, 3)] == [1, 2, 3]
            del ranks
        finally:
            await h.close()
    logged = (tmp_path / "stderr0-0").read_text()
    assert ("refusing overlay peer: a hello as rank 1 from "
            f"{socket.gethostname()}: this instance has 4 ranks") in logged, logged


async def exit_codes(ranks: list[Rank], logs: Path, timeout: float = 30.0) -> list[int]:
    """Each rank's exit status; on a timeout, fail naming the ranks still
    running, with every rank's log (they run at log level info)."""
    waits = [asyncio.ensure_future(r.proc.wait()) for r in ranks]
    _, pending = await asyncio.wait(waits, timeout=timeout)
    if pending:
        alive = [r.rank for r, w in zip(ranks, waits, strict=True) if w in pending]
        text = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.glob("stderr*")))
        for w in pending:
            w.cancel()
        raise AssertionError(f"ranks {alive} still running after {timeout}s\n{text}")
    return [w.result() for w in waits]


async def _connect_when_listening(uri: str) -> Handle:
    """Rank 0 serves its local socket before the instance is ready: connect
    as soon as the socket is there."""
    while True:
        try:
            return await Handle.connect(uri)
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(0.02)


async def test_ranks_stop_when_rank_0_dies(tmp_path: Path, brokers) -> None:
    """Across hosts nobody else watches the ranks: when rank 0 is killed its
    children notice the lost link and stop (status 1), and theirs follow."""
    config = await keyed_config(tmp_path, 4, 2)
    ranks = {r: await brokers(config, r) for r in range(4)}
    for r in range(4):
        await ranks[r].ready()
    ranks[0].proc.kill()
    codes = await exit_codes([ranks[r] for r in (1, 2, 3)], tmp_path)
    assert codes == [1, 1, 1]  # rank 3 too: told by rank 1 that it failed


async def test_a_rank_whose_bind_address_is_taken_says_so_and_exits_1(
        tmp_path: Path, brokers) -> None:
    """A second copy of a running rank with children on its host (or a
    port another program holds) cannot bind: the rank says which address
    and what to check in one line, and exits 1 -- it said ``start-up
    failed: ZMQError: Address already in use (addr='tcp://...')``."""
    config = await keyed_config(tmp_path, 2, 1)
    endpoint = load(str(config)).bind_endpoint(0)
    assert endpoint is not None
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    with socket.create_server((host, int(port))):  # (the "running" rank 0)
        rank = await brokers(config, 0)
        assert await exit_codes([rank], tmp_path) == [1]
    err = (tmp_path / "stderr0-0").read_text()
    assert (f"start-up failed: cannot bind {endpoint}, where this rank's children connect: "
            "Address already in use (another process holds it: this rank already running "
            "on this host, or another program on that port)") in err, err
    assert "ZMQError" not in err, err


async def test_exec_on_a_rank_of_another_host_runs_there(tmp_path: Path, brokers) -> None:
    """``exec -r R`` attaches to rank R's local socket, which across hosts is
    on R's host: there, R's ``rexec`` service runs the command (as Flux's
    subprocess server does for ``flux exec``), with R's ``KVBROKER_URI``,
    our environment and working directory, our input, its output and its
    exit status relayed."""
    config = await keyed_config(tmp_path, 2, 2)
    ranks = {r: await brokers(config, r) for r in (1, 0)}
    uris = {r: await ranks[r].ready() for r in (1, 0)}
    rc, out, err = await run_cli("exec", "-r", "1", "--", "sh", "-c", 'echo "$KVBROKER_URI"',
                                 uri=uris[0])
    assert (rc, out.strip()) == (0, uris[1]), err
    os.unlink(ranks[1].rundir / "local-1")  # as if rank 1 ran on another host
    script = 'echo "$KVBROKER_RANK $KVBROKER_URI $MARK $(pwd)"; cat; echo oops >&2; exit 3'
    env = dict(os.environ, MARK="from-the-client")
    rc, out, err = await run_cli("exec", "-r", "1", "--", "sh", "-c", script, uri=uris[0],
                                 input=b"in1\nin2\n", env=env, cwd=tmp_path)
    assert rc == 3, err
    assert out == f"1 {uris[1]} from-the-client {tmp_path}\nin1\nin2\n"
    assert err == "oops\nkvbroker: exec: rank 1: Exit 3\n"
    rc, _, err = await run_cli("exec", "-r", "1", "--", "nosuchcommand", uri=uris[0])
    assert (rc, err) == (127, "kvbroker: nosuchcommand: No such file or directory\n"
                              "kvbroker: exec: rank 1: Exit 127\n")
    rc, _, err = await run_cli("exec", "-r", "1", "-d", "/", "--", "sh", "-c",
                               'test "$(pwd)" = /', uri=uris[0])
    assert rc == 0, err
    # exec's output closed (| head -1): the command's writer gets SIGPIPE,
    # as a local one from the kernel, and its shell goes on -- it went to
    # the whole process group, the shell too, "Broken pipe" (a review's find)
    pipeline = await asyncio.create_subprocess_exec(
        "bash", "-c", f"{KVBROKER} exec -r 1 -- sh -c 'seq 3000000; echo went-on >&2; "
        "exit 5' | head -1; echo exec=${PIPESTATUS[0]} >&2",
        env=dict(os.environ, KVBROKER_URI=uris[0]),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out_b, err_b = await asyncio.wait_for(pipeline.communicate(), 60)
    assert out_b == b"1\n", (out_b, err_b)
    # (exec's own status is its broken pipe's, 141, as when it relays local ranks)
    assert err_b.decode().splitlines()[-2:] == ["went-on", "exec=141"], err_b
    # A stale socket file of this host at the path (a rank of an earlier run
    # that died there) is not the rank: the command still runs on rank 1's
    # host, by its rexec (its parent is rank 1), alone or in a set.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(ranks[1].rundir / "local-1"))
    stale.close()
    for ranks_arg in ("1", "all"):
        rc, out, err = await run_cli("exec", "-r", ranks_arg, "--", "sh", "-c",
                                     'echo "$KVBROKER_RANK $PPID"', uri=uris[0])
        assert rc == 0, err
        assert f"1 {ranks[1].proc.pid}" in out.splitlines(), (ranks_arg, out)


async def test_exec_on_a_set_spanning_hosts_runs_on_every_rank(tmp_path: Path,
                                                               brokers) -> None:
    """``exec -r all`` across hosts: the ranks of this host run theirs here,
    the others through their ``rexec``; output labelled, input copied to
    all, the statuses of each said, ``-t`` stopping those of every host."""
    config = await keyed_config(tmp_path, 3, 2)
    ranks = {r: await brokers(config, r) for r in (1, 2, 0)}
    uris = {r: await ranks[r].ready() for r in (1, 2, 0)}
    ran = tmp_path / "ran"
    ran.mkdir()
    touch = ["sh", "-c", f'touch {ran}/"$KVBROKER_RANK"; read line; echo "got $line"; '
             'exit $KVBROKER_RANK']
    for r in (1, 2):
        os.unlink(ranks[r].rundir / f"local-{r}")  # as if they ran on other hosts
    rc, out, err = await run_cli("exec", "-r", "all", "-l", "--", *touch, uri=uris[0],
                                 input=b"hello\n")
    assert rc == 2, err
    assert sorted(os.listdir(ran)) == ["0", "1", "2"]
    assert sorted(out.splitlines()) == ["0: got hello", "1: got hello", "2: got hello"]
    assert err == "kvbroker: exec: rank 1: Exit 1\nkvbroker: exec: rank 2: Exit 2\n"
    rc, out, err = await run_cli("exec", "-r", "0-2", "-t", "0.5", "--", "sleep", "59.75",
                                 uri=uris[0])
    assert rc == 124, err
    assert "ranks 0-2 still running after 0.5s: stopped" in err, err

    async def none_left() -> bool:
        return not any(p.startswith(b"sleep\x0059.75") for p in cmdlines())

    await wait_until(none_left, "the remote sleeps to be stopped")


def cmdlines() -> list[bytes]:
    """Every process's command line (NUL-separated), as /proc has them."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out.append(f.read())
    return out


SLOW_MODULE = '''\
import asyncio
import os

from broker.module import Module


class Slow(Module):
    """Starts once the test's file {go!r} exists."""
    name = "slow"

    def handlers(self):
        return {{"slow.hello": lambda msg: self.h.respond(msg, {{"rank": self.ctx.rank}})}}

    async def start(self):
        async with asyncio.timeout(30):
            while not os.path.exists({go!r}):
                await asyncio.sleep(0.01)
'''


async def test_a_request_that_comes_while_a_module_starts_waits_for_it(
        tmp_path: Path, brokers) -> None:
    """A rank's links are up before its modules have started, so a rank 0
    restarted under running followers is sent their clients' requests and
    reconnecting watches at once.  It answered those for a module still
    starting ``ENOSYS`` (``kvs is not loaded on rank 0``, which ended the
    watches); they now wait for it, as during a reload."""
    go = tmp_path / "go"
    (tmp_path / "slow.py").write_text(SLOW_MODULE.format(go=str(go)))
    config = await keyed_config(tmp_path, 2, 2)
    rank1 = await brokers(config, 1)
    modules = "content,kvs,kvs-watch," + str(tmp_path / "slow.py")
    rank0 = await brokers(config, 0, "-S", f"broker.modules={modules}")
    await rank1.ready()  # (rank 0 admitted it; its slow module has not started)
    async with asyncio.timeout(30):
        h = await Handle.connect(rank1.uri)
        try:
            answer = asyncio.ensure_future(h.rpc("slow.hello", {}))

            async def held() -> bool:
                return (await stats(h, 0))["held-for-reload"] == {"slow": 1}

            await wait_until(held, "rank 0 to hold the request for its slow module")
            assert not answer.done()
            go.touch()
            assert await answer == {"rank": 0}
            await rank0.ready()
        finally:
            await h.close()
    rank0.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank0, rank1], tmp_path) == [0, 0]


async def test_a_rank_restarted_while_its_old_link_looks_alive_takes_its_place(
        tmp_path: Path, brokers) -> None:
    """A host that froze (here: SIGSTOP) keeps its TCP connection open, so
    its parent still sees the old rank 1.  A new rank 1 started meanwhile is
    admitted at once (the newest hello wins); what was in flight to the old
    one is answered EHOSTUNREACH, and the old process, when it resumes, is
    told it was replaced and stops with status 1 without disturbing the new."""
    config = await keyed_config(tmp_path, 2, 2)
    rank0, old = await brokers(config, 0), await brokers(config, 1)
    await rank0.ready()
    await old.ready()
    async with asyncio.timeout(30):
        h = await Handle.connect(rank0.uri)
        try:
            assert await h.attr_get("rundir", nodeid=1) == str(old.rundir)
            old.proc.send_signal(signal.SIGSTOP)
            stuck = asyncio.ensure_future(h.ping(1))

            async def held() -> bool:
                return (await stats(h, 0))["sent-down"] >= 1

            await wait_until(held, "rank 0 to hold the ping sent to the frozen rank 1")
            new = await brokers(config, 1)
            await new.ready()  # before heartbeats could have dropped the old link (10 s)
            with pytest.raises(RemoteError) as lost:
                await stuck
            assert lost.value.errnum == errno.EHOSTUNREACH
            assert await h.attr_get("rundir", nodeid=1) == str(new.rundir)
            overlay = (await stats(h, 0))["overlay"]
            assert (overlay["replaced"], overlay["children"]) == (1, [1])
            old.proc.send_signal(signal.SIGCONT)
            assert await exit_codes([old], tmp_path) == [1]
            assert "admitted a newer rank 1 process" in (tmp_path / "stderr1-1").read_text()
            # (not "parent-gone": a launcher would blame rank 0, which runs on)
            assert old.proc.stdout is not None and await old.proc.stdout.read() == b""
            assert await h.attr_get("rundir", nodeid=1) == str(new.rundir)
        finally:
            await h.close()
    rank0.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank0, new], tmp_path) == [0, 0]


async def test_overlay_status_shows_a_restarted_and_a_replaced_rank(
        tmp_path: Path, brokers) -> None:
    """A rank that restarted is full again, so ``overlay status`` showed it
    as if nothing had happened: it now says, from its parent's stats
    (``overlay.rejoined``), how many times a new process of it joined, how
    long ago the last did, and how many took the place of an old process
    still connected (a frozen host), which ``overlay.replaced`` only
    counted for the parent as a whole.  Rank 0's log says each rejoin (it
    said only the losses)."""
    config = await keyed_config(tmp_path, 2, 2)
    rank0, first = await brokers(config, 0), await brokers(config, 1)
    await rank0.ready()
    await first.ready()
    async with asyncio.timeout(60):
        h0 = await Handle.connect(rank0.uri)
        try:
            rc, out, err = await run_cli("overlay", "status", uri=rank0.uri)
            assert rc == 0 and "restarted" not in out, (out, err)
            assert (await stats(h0, 0))["overlay"]["rejoined"] == {}
            first.proc.kill()  # (a crash: its parent loses it, then a new one joins)
            assert await exit_codes([first], tmp_path) == [-signal.SIGKILL]

            async def gone() -> bool:
                return (await stats(h0, 0))["overlay"]["children"] == []

            await wait_until(gone, "rank 0 to lose rank 1")
            second = await brokers(config, 1)
            await second.ready()
            rc, out, err = await run_cli("overlay", "status", uri=rank0.uri)
            assert rc == 0, (out, err)  # (full again: a restart is no failure)
            lines = out.splitlines()
            assert re.fullmatch(r"  1 \S+: full \(restarted \d+\.\ds ago\)", lines[1]), out
            # frozen: its link looks alive, and a third process takes its place
            second.proc.send_signal(signal.SIGSTOP)
            third = await brokers(config, 1)
            await third.ready()
            seen = (await stats(h0, 0))["overlay"]["rejoined"]
            assert seen["1"]["times"] == 2 and seen["1"]["replaced"] == 1, seen
            rc, out, err = await run_cli("overlay", "status", uri=rank0.uri)
            assert rc == 0, (out, err)
            assert re.fullmatch(r"  1 \S+: full \(restarted 2 times, the last \d+\.\ds ago, "
                                r"1 in place of a process still connected\)",
                                out.splitlines()[1]), out
            second.proc.send_signal(signal.SIGCONT)
            assert await exit_codes([second], tmp_path) == [1]  # (told it was replaced)
        finally:
            await h0.close()
    # the recoveries are in rank 0's log (dmesg), beside the losses
    logged = (tmp_path / "stderr0-0").read_text()
    host = socket.gethostname()
    for times in (1, 2):
        assert (f"INFO kvbroker.overlay: child rank 1 on {host} rejoined: a new process "
                f"({times} since this rank started)") in logged, logged


def named(host: str) -> tuple[str, str]:
    """``-S hostname=HOST``: the rank says it runs on ``host`` (as Flux's
    ``-Shostname``), as if each rank were on its own host."""
    return ("-S", f"hostname={host}")


FAST_TORPID = ("-S", "tbon.torpid_min=0.2", "-S", "tbon.torpid_max=1")


async def test_a_rank_said_to_be_on_another_host_is_refused_and_the_running_one_stays(
        tmp_path: Path, brokers) -> None:
    """A rank started with the wrong ``--rank`` (here: on node0, as rank 1,
    whose entry is node1) took the running rank 1's place: the newest
    hello wins, as for a restarted rank.  As in Flux (flux-core#6389) its
    hello says its host, and rank 0 refuses a hello from a host that is not
    the rank's entry: the newcomer stops with status 1 saying why, rank 0
    logs it, and the running rank 1 keeps serving, not counted as
    replaced or restarted, ``overlay status`` unchanged."""
    config = await keyed_config(tmp_path, 2, 2, hosts=["node0", "node1.example.org"])
    rank0 = await brokers(config, 0, *named("node0"))
    running = await brokers(config, 1, *named("node1"))  # (the short name will do)
    await rank0.ready()
    await running.ready()
    endpoint = load(str(config)).endpoints()[0]
    async with asyncio.timeout(60):
        h = await Handle.connect(rank0.uri)
        try:
            rc, before, err = await run_cli("overlay", "status", uri=rank0.uri)
            assert (rc, before) == (0, "0 node0: full\n  1 node1: full\n"), err
            stray = await brokers(config, 1, *named("node0"))
            assert await asyncio.wait_for(stray.proc.wait(), 30) == 1
            assert stray.proc.stdout is not None and await stray.proc.stdout.read() == b""
            said = (tmp_path / "stderr1-2").read_text()
            assert (f"ERROR kvbroker: parent rank 0 at {endpoint} refused this rank's hello: "
                    "node1.example.org is configured as rank 1: mismatched config? (this "
                    "hello came from node0: a wrong --rank, a rank started on the wrong "
                    "host, or another bootstrap file; an entry that is not the host's own "
                    "name needs -S hostname=node1.example.org on that rank): stopping") \
                in said, said
            assert (await h.ping(1))["rank"] == 1
            assert await h.attr_get("rundir", nodeid=1) == str(running.rundir)
            overlay = (await stats(h, 0))["overlay"]
            assert (overlay["children"], overlay["replaced"], overlay["rejoined"]) == \
                ([1], 0, {}), overlay
            assert overlay["hosts"] == {"1": "node1"}
            rc, after, err = await run_cli("overlay", "status", uri=rank0.uri)
            assert (rc, after) == (0, before), err
            assert running.proc.returncode is None
        finally:
            await h.close()
    logged = (tmp_path / "stderr0-0").read_text()
    assert ("ERROR kvbroker.overlay: refusing overlay peer: a hello as rank 1 from node0: "
            "node1.example.org is configured as rank 1") in logged, logged


async def test_entries_that_name_no_one_host_are_not_judged(tmp_path: Path, brokers) -> None:
    """An entry that is an IP address or ``localhost`` cannot be compared
    with the name a rank says it runs on: such a rank is never refused for
    its host (the parent cannot tell), whatever it says."""
    config = await keyed_config(tmp_path, 3, 2, hosts=["node0", "localhost", "127.0.0.1"])
    ranks = [await brokers(config, r, *named(f"node{r}")) for r in range(3)]
    for r in ranks:
        await r.ready()
    rc, out, err = await run_cli("overlay", "status", uri=ranks[0].uri)
    assert (rc, out) == (0, "0 node0: full\n  1 node1: full\n  2 node2: full\n"), err


async def test_lookup_and_disconnect_name_ranks_by_their_hosts(tmp_path: Path,
                                                              brokers) -> None:
    """Across hosts, ``overlay lookup`` translates the bootstrap file's
    hosts to ranks and back, and ``overlay disconnect`` takes a host, as
    Flux's do: the rank on it is cut off."""
    hosts = ["node0", "node1", "node2"]  # 0 -> 1, 2
    config = await keyed_config(tmp_path, 3, 2, hosts=hosts)
    ranks = [await brokers(config, r, *named(hosts[r])) for r in range(3)]
    for r in ranks:
        await r.ready()
    uri = ranks[0].uri
    assert await run_cli("overlay", "lookup", "0-2", uri=uri) == (0, "node[0-2]\n", "")
    assert await run_cli("overlay", "lookup", "node[1-2]", uri=uri) == (0, "1-2\n", "")
    assert await run_cli("overlay", "lookup", "node2,node0", uri=uri) == (0, "0,2\n", "")
    rc, out, err = await run_cli("overlay", "disconnect", "node3", uri=uri)
    assert (rc, out) == (1, ""), err
    assert "TARGET must be a valid rank or hostname: no rank of this instance runs on " \
        "host 'node3'" in err, err
    rc, out, err = await run_cli("overlay", "disconnect", "node2", uri=uri)
    assert (rc, out) == (0, "asking rank 0 to disconnect child rank 2\n"), err
    rc, out, err = await run_cli("overlay", "status", uri=uri)
    assert rc == 1 and re.search(r"^  2 node2: lost", out, re.M), out


async def test_overlay_status_names_the_host_of_a_rank_in_any_state(
        tmp_path: Path, brokers) -> None:
    """Across hosts, an operator needs to know which machine a rank that
    does not answer is on: a torpid, lost or offline rank's line named no
    host (only a rank that answered said its own).  It now names the host
    its last hello to its parent said, else its bootstrap file entry (a
    rank never started; one below an offline rank, whose parent is gone)."""
    hosts = [f"node{r}" for r in range(5)]  # 0 -> 1, 2; 1 -> 3, 4 (never started)
    config = await keyed_config(tmp_path, 5, 2, hosts=hosts)
    ranks = {r: await brokers(config, r, *named(hosts[r]), *FAST_TORPID) for r in range(4)}
    uri = ranks[0].uri

    async def status(*opts: str) -> list[str]:
        _, out, err = await run_cli("overlay", "status", *opts, uri=uri)
        return out.splitlines()

    async with asyncio.timeout(90):
        h = await _connect_when_listening(uri)
        try:
            async def joined() -> bool:
                return ((await stats(h, 0))["overlay"]["children"] == [1, 2]
                        and (await stats(h, 1))["overlay"]["children"] == [3])

            await wait_until(joined, "ranks 1-3 to join", START)
            lines = await status()
            assert lines[:3] + lines[4:] == ["0 node0: partial", "  1 node1: partial",
                                             "    3 node3: full", "  2 node2: full"]
            # (never started: offline, not lost)
            assert lines[3] == "    4 node4: offline (not joined since rank 1 started)", lines
            await stop_process(ranks[3].proc.pid)
            try:
                async def marked() -> bool:
                    return "3" in (await stats(h, 1))["overlay"]["torpid"]

                await wait_until(marked, "rank 1 to mark rank 3 torpid", 20)
                # (-t 0.5: the ping of the stopped rank 3 takes it all, and
                # the others answer within it -- asked again if a loaded
                # machine kept rank 1 from it, then shown "no answer in 0.5s")
                async def named_torpid() -> bool:
                    lines[:] = await status("-t", "0.5")
                    return lines[2].startswith("    3 node3: torpid (rank 1 ")

                with contextlib.suppress(AssertionError):  # (said below)
                    await wait_until(named_torpid, "rank 3 shown torpid by rank 1", 20)
            finally:
                ranks[3].proc.send_signal(signal.SIGCONT)
            assert lines[2].startswith("    3 node3: torpid (rank 1 has heard nothing from it "
                                       "for "), lines
            ranks[2].proc.kill()
            assert await exit_codes([ranks[2]], tmp_path) == [-signal.SIGKILL]

            async def lost_2() -> bool:
                return (await stats(h, 0))["overlay"]["children"] == [1]

            await wait_until(lost_2, "rank 0 to lose rank 2")
            assert (await status())[4] == ("  2 node2: lost (its connection closed, or it "
                                           "answered no heartbeat for 10 s)")
            ranks[1].proc.send_signal(signal.SIGTERM)
            # (rank 1 stops before its start-up ended -- rank 4 never joined it;
            # rank 3 was told to stop)
            assert await exit_codes([ranks[1], ranks[3]], tmp_path) == [0, 0]

            async def offline_1() -> bool:
                return (await stats(h, 0))["overlay"]["offline"] == {"1": "signal SIGTERM"}

            await wait_until(offline_1, "rank 0 to see rank 1 stop")
            assert (await status())[:4] == ["0 node0: partial",
                                            "  1 node1: offline (stopped: signal SIGTERM)",
                                            "    3 node3: offline (stopped with rank 1)",
                                            "    4 node4: offline (stopped with rank 1)"]
        finally:
            await h.close()


async def test_a_restarted_rank_s_clients_get_nothing_meant_for_the_old_one_s(
        tmp_path: Path, brokers) -> None:
    """A client of rank 1 watches a key on rank 0; rank 1 dies, so it never
    sends the client's disconnect.  Rank 0, losing the link, sends it
    itself: the watcher goes at once.  A restarted rank 1 must not get
    anything meant for the old one's clients (its new c1 -- any user --
    would have received the old c1's watch): rank 0 names the new
    process's link with a new hop, and nothing answers along the old one."""
    config = await keyed_config(tmp_path, 2, 2)
    rank0, old = await brokers(config, 0), await brokers(config, 1)
    await rank0.ready()
    await old.ready()
    async with asyncio.timeout(30):
        h0 = await Handle.connect(rank0.uri)
        h1 = await Handle.connect(old.uri)
        raw = None
        try:
            await h0.rpc("kvs.commit", {"namespace": "primary", "ops": [
                {"key": "secret", "flags": 0, "dirent": {"ver": 1, "type": "val",
                                                         "data": b"one"}}]})
            s = h1.rpc_stream("kvs-watch.lookup", {"key": "secret", "flags": 4}, nodeid=0)
            assert (await s.next_message()).payload["val"]["data"] == b"one"
            old.proc.kill()
            assert await exit_codes([old], tmp_path) == [-signal.SIGKILL]

            async def gone() -> bool:
                return (await stats(h0, 0))["overlay"]["children"] == []

            await wait_until(gone, "rank 0 to lose rank 1")

            async def watcher_gone() -> bool:
                st = await h0.rpc("kvs-watch.stats-get", {}, nodeid=0)
                return bool(st["watchers"] == 0 and st["counts"]["disconnected"] == 1)

            await wait_until(watcher_gone, "rank 0 to end the lost client's watch")
            new = await brokers(config, 1)
            await new.ready()
            raw = await asyncio.open_unix_connection(f"{new.rundir}/local-1")
            reader, writer = raw
            await h0.rpc("kvs.commit", {"namespace": "primary", "ops": [
                {"key": "secret", "flags": 0, "dirent": {"ver": 1, "type": "val",
                                                         "data": b"two"}}]})

            # a ping of rank 0 by the new client comes back over the same
            # link after anything the commit could have sent along it
            writer.write(codec.to_stream(codec.encode(Message(
                MsgType.REQUEST, "broker.ping", {}, matchtag=77, nodeid=0))))
            decoder, got = codec.StreamDecoder(), []
            while not got or got[-1].matchtag != 77:
                got += [codec.decode(f) for f in decoder.feed(await reader.read(65536))]
            assert [(m.topic, m.matchtag) for m in got] == [("broker.ping", 77)]
            assert (await h0.rpc("kvs-watch.stats-get", {}, nodeid=0))["counts"]["answers"] == 1
        finally:
            if raw is not None:
                raw[1].close()
            await h1.close()
            await h0.close()


async def test_a_rank_that_admits_guests_opens_its_run_directory(tmp_path: Path,
                                                                  brokers) -> None:
    """``kvbroker broker -S access.allow-guest-user=true`` made the guests'
    0777 socket in a 0700 run directory, out of their reach; it now opens
    the directory as ``kvbroker start`` does (0755)."""
    config = await keyed_config(tmp_path, 1, 2)
    for allow, mode in (("false", 0o700), ("true", 0o755)):
        rank = await brokers(config, 0, "-S", f"access.allow-guest-user={allow}")
        await rank.ready()
        assert os.stat(rank.rundir).st_mode & 0o777 == mode, allow
        rank.proc.terminate()
        assert await asyncio.wait_for(rank.proc.wait(), START) == 0


# ---------------------------------------------------------------- the initial program


async def test_rank_0_runs_the_initial_program_and_stops_the_instance_after_it(
        tmp_path: Path, brokers) -> None:
    """``kvbroker broker --config FILE -- CMD`` (as ``flux broker CMD``): rank
    0 runs CMD once the whole instance is up, with KVBROKER_URI; other ranks
    ignore it.  When CMD exits the instance stops, and rank 0 exits as CMD did."""
    config = await keyed_config(tmp_path, 3, 2)
    script = ('kvbroker kvs put from=program && kvbroker kvs get from && '
              'kvbroker ping --count 1 2 | cut -d" " -f2 && echo "$KVBROKER_URI"; exit 7')
    program = ("--", "sh", "-c", script)
    leaves = [await brokers(config, r, *program) for r in (2, 1)]
    rank0 = await brokers(config, 0, *program)
    uris = [await leaf.ready() for leaf in leaves]  # they serve: only rank 0 runs it
    codes = await exit_codes([rank0, *leaves], tmp_path)
    assert codes == [7, 0, 0]
    assert rank0.proc.stdout is not None
    out = (await asyncio.wait_for(rank0.proc.stdout.read(), 10)).decode().splitlines()
    assert out == ["program", "route=c3!r0!r2", rank0.uri]  # and no "ready" line
    assert all(uri.endswith(f"/local-{r}") for uri, r in zip(uris, (2, 1), strict=True))


async def test_a_signal_to_rank_0_goes_to_the_initial_program(tmp_path: Path, brokers) -> None:
    """SIGTERM to rank 0 reaches the program (and what it started); when it
    exits the instance stops, with the program's status (143)."""
    config = await keyed_config(tmp_path, 2, 2)
    leaf = await brokers(config, 1)
    started = tmp_path / "started"
    rank0 = await brokers(config, 0, "--", "sh", "-c",
                          f'touch {started}; sleep 300 & wait; echo "not reached"')
    await leaf.ready()

    async def program_started() -> bool:
        return started.exists()

    await wait_until(program_started, "the initial program to start")
    rank0.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank0, leaf], tmp_path) == [128 + signal.SIGTERM, 0]
    assert rank0.proc.stdout is not None
    assert await asyncio.wait_for(rank0.proc.stdout.read(), 10) == b""


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
async def test_a_signal_before_the_instance_is_up_stops_rank_0_as_it_names(
        tmp_path: Path, brokers, sig: int) -> None:
    """Rank 1 never starts: rank 0 waits for it.  A stop signal then ends
    rank 0 cleanly, with 128+N as start -- CMD would; the program never ran.
    (SIGHUP used to kill it outright, before any handler was in place.)"""
    config = await keyed_config(tmp_path, 2, 2)
    ran = tmp_path / "ran"
    rank0 = await brokers(config, 0, "--", "touch", str(ran))

    async def listening() -> bool:
        return (rank0.rundir / "local-0").exists()

    await wait_until(listening, "rank 0 to serve its socket")
    rank0.proc.send_signal(sig)
    assert await exit_codes([rank0], tmp_path) == [128 + sig]
    assert not ran.exists()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
async def test_a_signal_before_the_subtree_is_up_stops_a_rank_with_status_0(
        tmp_path: Path, brokers, sig: int) -> None:
    """Ranks 0 and 1 of 4 (fanout 2) run, waiting for rank 3 (below rank 1)
    and rank 2, which never start.  A stop signal to rank 1, then to rank
    0, is a stop asked for: each exits 0, as after start-up.  Before, both
    exited 1, and a supervisor took the stop for a failure."""
    config = await keyed_config(tmp_path, 4, 2)
    rank0 = await brokers(config, 0)
    rank1 = await brokers(config, 1)
    h = await _connect_when_listening(rank0.uri)
    try:
        async def joined() -> bool:
            return (await stats(h, 0))["overlay"]["children"] == [1]

        await wait_until(joined, "rank 1 to join rank 0", START)
    finally:
        await h.close()
    rank1.proc.send_signal(sig)
    assert await exit_codes([rank1], tmp_path) == [0]
    rank0.proc.send_signal(sig)
    assert await exit_codes([rank0], tmp_path) == [0]


async def test_a_killed_rank_0_kills_the_initial_program(tmp_path: Path, brokers) -> None:
    """Rank 0 SIGKILLed (the OOM killer): nothing of it runs to stop the
    program, so the kernel kills it (its parent-death signal, Linux), set
    beside the rank's ZeroMQ threads.  Before, it ran on, its instance gone."""
    config = await keyed_config(tmp_path, 2, 2)
    leaf = await brokers(config, 1)
    pidfile = tmp_path / "pid"
    rank0 = await brokers(config, 0, "--", "sh", "-c", f"echo $$ > {pidfile}.new; "
                          f"mv {pidfile}.new {pidfile}; exec sleep 300")
    await leaf.ready()

    async def program_started() -> bool:
        return pidfile.exists()

    await wait_until(program_started, "the initial program to start")
    pid = int(pidfile.read_text())
    try:
        assert alive(pid)
        rank0.proc.kill()
        await all_gone([pid], "the initial program to be killed with rank 0")
    finally:
        with contextlib.suppress(ProcessLookupError):  # (without it: still running)
            os.kill(pid, signal.SIGKILL)


async def test_shutting_the_instance_down_stops_the_initial_program(
        tmp_path: Path, brokers) -> None:
    config = await keyed_config(tmp_path, 2, 2)
    leaf = await brokers(config, 1)
    rank0 = await brokers(config, 0, "--", "sh", "-c", "kvbroker shutdown; sleep 300")
    assert await exit_codes([rank0, leaf], tmp_path) == [128 + signal.SIGTERM, 0]
    log = next(tmp_path.glob("stderr0-*")).read_text()
    assert "the instance is stopping: stopping the initial program" in log


async def test_an_initial_program_that_cannot_run_exits_127(tmp_path: Path, brokers) -> None:
    config = await keyed_config(tmp_path, 1, 2)
    rank0 = await brokers(config, 0, "--", str(tmp_path / "no-such-program"))
    assert await exit_codes([rank0], tmp_path) == [127]
    assert "no-such-program: No such file or directory" in \
        next(tmp_path.glob("stderr0-*")).read_text()


async def test_an_initial_program_that_cannot_be_executed_exits_126(
        tmp_path: Path, brokers) -> None:
    """Found but not executable (a file without the execute bit): 126, as a
    shell and ``kvbroker start`` (was 127, "not found")."""
    config = await keyed_config(tmp_path, 1, 2)
    rank0 = await brokers(config, 0, "--", str(config))
    assert await exit_codes([rank0], tmp_path) == [126]
    assert f"initial program {config}: Permission denied" in \
        next(tmp_path.glob("stderr0-*")).read_text()


class StandInParent:
    """A CURVE ``ROUTER`` with the instance's keys at rank 0's endpoint, in
    place of rank 0: the test decides which hellos it answers, as a parent
    whose answers were lost would (ZeroMQ drops what a ROUTER sends to a
    peer whose connection is gone)."""

    def __init__(self, tmp_path: Path, endpoint: str) -> None:
        import zmq

        from broker.curve import ZAP_DOMAIN, load_keys, start_authenticator

        self.endpoint = endpoint
        self.keys = load_keys(str(tmp_path / "curve.key"))
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, self.keys[0])
        self.zap_domain = ZAP_DOMAIN.encode()
        self.sock = self.bind()

    def bind(self) -> Any:
        """A new ROUTER bound at the endpoint (a restarted parent)."""
        import zmq

        s = self.ctx.socket(zmq.ROUTER)
        s.zap_domain = self.zap_domain
        s.curve_server = True
        s.curve_publickey, s.curve_secretkey = self.keys
        deadline = asyncio.get_running_loop().time() + 10
        while True:  # (the closed one's port is let go by ZeroMQ's I/O thread)
            try:
                s.bind(self.endpoint)
                return s
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or asyncio.get_running_loop().time() > deadline:
                    raise
                s.poll(10)  # (nothing to read: a 10 ms pause between tries)

    def recv(self, topic: str, timeout: float = 15.0) -> tuple[bytes, Message]:
        """The next message (it must be a control message ``topic``), with its sender."""
        assert self.sock.poll(int(timeout * 1000)), f"no {topic} within {timeout} s"
        ident, *frames = self.sock.recv_multipart()
        msg = codec.decode(frames)
        assert (msg.type, msg.topic) == (MsgType.CONTROL, topic), msg
        return ident, msg

    def answer_hello(self, ident: bytes) -> None:
        reply = Message(MsgType.CONTROL, "overlay.hello", {"rank": 0, "size": 2})
        self.sock.send_multipart([ident, *codec.encode(reply)])

    def close(self) -> None:
        self.sock.close(0)
        self.auth.stop()
        self.ctx.term()


async def test_a_rank_whose_first_hello_is_not_answered_says_it_again_and_joins(
        tmp_path: Path, brokers) -> None:
    """The parent's answer to a hello can be lost (the connection dropped
    after the parent read the hello; a parent restarted in between), and
    the rank said hello once: it waited for ever, silent, its local socket
    never opened.  It now says hello again over the live link, after 0.5 s
    then waits doubling up to 4 s, from the same identity (a parent answers
    a hello again from an identity it admitted), with one WARNING once it
    has waited 4 s, and joins at the first answer: here the fifth hello's
    (the first said after a 4 s wait)."""
    config = await keyed_config(tmp_path, 2, 2)
    parent = StandInParent(tmp_path, load(str(config)).endpoints()[0])
    try:
        rank1 = await brokers(config, 1)
        ident, hello = parent.recv("overlay.hello")
        assert hello.payload["rank"] == 1
        for _ in range(4):  # unanswered, as if each answer were lost
            assert not os.path.exists(rank1.rundir / "local-1")  # not admitted
            again, repeated = parent.recv("overlay.hello")
            assert (again, repeated.payload) == (ident, hello.payload)
        parent.answer_hello(ident)
        assert await rank1.ready() == rank1.uri
        assert parent.recv("overlay.ready")[0] == ident
        h = await Handle.connect(rank1.uri)
        await h.close()
    finally:
        parent.close()
    err = (tmp_path / "stderr1-0").read_text()
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, err
    assert "has not answered this rank's hello (5 sent, the first " in warnings[0]
    assert ("s ago) over a live link: saying it again, every 4 s at most, until it "
            "does") in warnings[0]
    assert "parent rank 0 answered this rank's hello (5 sent)" in err


async def test_a_rank_whose_link_drops_before_the_answer_says_hello_on_a_new_one(
        tmp_path: Path, brokers) -> None:
    """The link to the parent drops after the parent read the hello and
    before its answer arrived (here: the parent restarts).  A parent that
    stayed up lost that identity with its connection and drops what it
    sends from then on (it may be an old process resuming), so the rank,
    whose DEALER dials again by itself but said nothing more, waited for
    ever.  It now says hello again from a new DEALER, with a new identity,
    which a parent admits like any newcomer."""
    config = await keyed_config(tmp_path, 2, 2)
    parent = StandInParent(tmp_path, load(str(config)).endpoints()[0])
    try:
        rank1 = await brokers(config, 1)
        first, said = parent.recv("overlay.hello")
        parent.sock.close(0)  # the link drops; the answer is never sent
        parent.sock = parent.bind()
        ident, hello = parent.recv("overlay.hello")
        assert hello.payload == said.payload  # (the same rank and process)
        assert hello.payload["rank"] == 1 and isinstance(hello.payload["process"], str)
        assert ident != first and ident.startswith(b"1-")
        parent.answer_hello(ident)
        assert await rank1.ready() == rank1.uri
        assert parent.recv("overlay.ready")[0] == ident
    finally:
        parent.close()
    assert "closed before it answered this rank's hello: saying hello again on a new " \
        "connection" in (tmp_path / "stderr1-0").read_text()


async def test_a_rank_whose_parent_vanished_before_answering_says_so_after_connect_timeout(
        tmp_path: Path, brokers) -> None:
    """The parent read the hello and went away for good before answering
    (its host died).  The rank says hello again on a new connection, which
    never comes: it said so only at INFO, because the "no connection for
    30 s" WARNING was for a rank that had never had one.  Now each outage
    of the link before the answer is warned about once it lasts
    ``tbon.connect_timeout`` (here 2 s, not the default 30: the wait below
    is shorter than the default, so the attribute is what is tested)."""
    config = await keyed_config(tmp_path, 2, 2, **{"tbon.connect_timeout": "2s"})
    parent = StandInParent(tmp_path, load(str(config)).endpoints()[0])
    log = tmp_path / "stderr1-0"
    try:
        await brokers(config, 1)
        parent.recv("overlay.hello")
        parent.sock.close(0)  # the link drops, and nothing listens there again

        async def warned() -> bool:
            return "no connection to parent rank 0 at" in log.read_text()

        await wait_until(warned, "the no-connection WARNING", DEFAULT_CONNECT_TIMEOUT - 10)
    finally:
        parent.close()
    text = log.read_text()
    assert "closed before it answered this rank's hello" in text
    assert text.count("no connection to parent rank 0 at") == 1
    assert re.search(r"no connection to parent rank 0 at \S+ after [2-9](\.[0-9]+)? s", text), text


class DropFirstAnswer:
    """A TCP relay between rank 1 and rank 0 that breaks its first
    connection as rank 0's first message on it (its hello answer) comes
    through, after the CURVE handshake: a network that failed at the worst
    moment.  It reads ZMTP's framing, which CURVE leaves in the clear: after
    each side's 64-byte greeting, frames of a flags byte (0x02: an 8-byte
    size follows, else a 1-byte one; 0x04: a command -- the handshake's,
    heartbeats), and each message, encrypted, is a frame that starts with
    ``\x07MESSAGE``."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.connections = 0
        self.broken = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._relay, "127.0.0.1", port)

    async def _relay(self, child_r: asyncio.StreamReader, child_w: asyncio.StreamWriter) -> None:
        try:
            parent_r, parent_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:  # rank 0 is not listening yet: rank 1 dials again
            child_w.transport.abort()
            return
        self.connections += 1
        first = self.connections == 1
        up = asyncio.ensure_future(self._pipe(child_r, parent_w))
        down = asyncio.ensure_future(self._watch(parent_r, child_w) if first
                                     else self._pipe(parent_r, child_w))
        self.tasks |= {up, down}
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for task in (up, down):
            task.cancel()
        for w in (child_w, parent_w):
            w.transport.abort()

    @staticmethod
    async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()

    async def _watch(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        greeting = 64  # (forwarded as it comes: each side waits for parts of the other's)
        while greeting:
            data = await r.read(greeting)
            if not data:
                return
            greeting -= len(data)
            w.write(data)
        while True:
            flags = await r.readexactly(1)
            size_bytes = await r.readexactly(8 if flags[0] & 0x02 else 1)
            body = await r.readexactly(int.from_bytes(size_bytes, "big"))
            if not flags[0] & 0x04 and body.startswith(b"\x07MESSAGE"):
                self.broken.set()
                return  # (not forwarded: the relay breaks both connections)
            w.write(flags + size_bytes + body)
            await w.drain()


async def test_a_rank_joins_a_real_parent_whose_hello_answer_was_lost_with_its_link(
        tmp_path: Path, brokers) -> None:
    """Real ranks, with the link between them broken just as rank 0's hello
    answer goes through.  Rank 0 had admitted rank 1, lost it with the
    connection, and drops what its old identity sends; rank 1's DEALER
    dialled again by itself and rank 1 waited for ever.  Now it says hello
    again from a new identity, and the instance comes up -- with rank 1 not
    counted as restarted: the same process said both hellos (its hello
    names its process), where ``overlay status`` showed it ``restarted``."""
    assert (await run_cli("keygen", str(tmp_path / "curve.key")))[0] == 0
    port, relay_port = free_tcp_ports(2)
    config = tmp_path / "inst.toml"
    config.write_text(
        '[bootstrap]\ncurve_cert = "curve.key"\nfanout = 2\nhosts = [\n'
        f'  {{ host = "h0", bind = "tcp://127.0.0.1:{port}", '
        f'connect = "tcp://127.0.0.1:{relay_port}" }},\n  {{ host = "h1" }},\n]\n')
    # (h0, h1: each rank says it runs there, -S hostname, as on two hosts)
    relay = DropFirstAnswer(port)
    server = await relay.serve(relay_port)
    try:
        rank0 = await brokers(config, 0, "-S", "hostname=h0")
        # (listening before rank 1 dials: the relay would close a connection
        # it cannot pass on, which rank 1 counts as a refused handshake)
        h = await asyncio.wait_for(_connect_when_listening(rank0.uri), START)
        try:
            rank1 = await brokers(config, 1, "-S", "hostname=h1")
            await rank1.ready()
            await rank0.ready()
            # (2: the broken one and the next; more when a loaded machine
            # made rank 1 dial again before its handshake through the relay
            # was done)
            assert relay.broken.is_set() and relay.connections >= 2
            assert (await h.ping(1))["route"][-1] == "r1"
            overlay = (await stats(h, 0))["overlay"]
            assert overlay["children"] == [1]
            assert (overlay["rejoined"], overlay["replaced"]) == ({}, 0), overlay
        finally:
            await h.close()
    finally:
        server.close()
        for task in relay.tasks:
            task.cancel()
    assert re.search(r"lost child rank 1( on \S+)? unexpectedly",
                     (tmp_path / "stderr0-0").read_text())


async def test_a_rank_whose_parent_does_not_load_groups_says_so(tmp_path: Path,
                                                               brokers) -> None:
    """Each host's rank has its own command line (and may have its own
    file): rank 1 loads ``groups``, rank 0 was not told to.  Rank 1 judged
    its parent's module list by its own and took the ``ENOSYS`` for a
    parent still starting it, saying nothing; its parent's own list says
    it never will (a review's find)."""
    config = await keyed_config(tmp_path, 2, 2)
    ranks = [await brokers(config, 0)]
    ranks.append(await brokers(config, 1, "-S", "broker.modules=content,kvs,kvs-watch,groups"))
    uris = [await r.ready() for r in ranks]

    async def warned() -> bool:
        rc, out, err = await run_cli("dmesg", uri=uris[1])
        assert rc == 0, err
        return "rank 0 has no groups module" in out

    await wait_until(warned, "rank 1 to say rank 0 has no groups module")


async def test_a_request_a_module_sends_up_before_its_parent_is_there_is_answered(
        tmp_path: Path, brokers) -> None:
    """Rank 1 started well before rank 0: its modules start while it dials
    its parent again and again, and what ``groups`` sent up as it started
    (``groups.update``) went into a dial's socket that was closed with it --
    lost without a word, the module waiting for ever (so rank 1 never said
    that rank 0 has no groups module).  Now it is held until rank 0 answers
    the hello, then sent: rank 0's ``ENOSYS`` comes back and is said."""
    config = await keyed_config(tmp_path, 2, 2)
    ranks = [await brokers(config, 1, "-S", "broker.modules=content,kvs,kvs-watch,groups",
                           "-S", "tbon.connect_timeout=1s")]
    stderr = tmp_path / "stderr1-0"

    async def dialled_for_a_second() -> bool:  # (its modules started meanwhile)
        return "no connection to parent rank 0" in stderr.read_text()

    await wait_until(dialled_for_a_second, "rank 1 to have dialled rank 0 for 1 s", START)
    ranks.append(await brokers(config, 0))
    uris = {r.rank: await r.ready() for r in ranks}

    async def warned() -> bool:
        rc, out, err = await run_cli("dmesg", uri=uris[1])
        assert rc == 0, err
        return "rank 0 has no groups module" in out

    await wait_until(warned, "rank 1 to say rank 0 has no groups module", START)
