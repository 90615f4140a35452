"""flux-core t/t0019-tbon-config.t: the brokers' ``tbon.*`` configuration.

Flux's tree-based overlay network is configured with ``tbon.*`` attributes
(``zmqdebug``, ``prefertcp``, ``interface-hint``, ``topo``, ``fanout``) and
reports its endpoints as attributes (``tbon.endpoint``,
``tbon.parent-endpoint``, ``tbon.maxlevel``).  kvbroker's overlay is a k-ary
tree set at start with ``--fanout K`` (or a bootstrap file's ``fanout``),
its links are ``tbon.transport`` (``unix`` by default, ``ipc`` or ``tcp``),
``start``'s tcp links listen on 127.0.0.1, and a bootstrap file's ``bind``
and ``connect`` choose the addresses across hosts (docs/cli.md, ``start``
and ``broker``; docs/guide.md, *Across hosts*).  Any unknown name under the
``tbon.`` prefix is refused before a rank starts (exit 2), so a Flux setting
kvbroker does not have is never silently dropped.  Each case runs real
``kvbroker start`` / ``kvbroker broker`` processes.

Flux case -> here:

1.  ``-Stbon.zmqdebug=1 -s2`` works -> DIFFERENCE (documented: unknown
    ``tbon.`` names are refused): exit 2, ``tbon.zmqdebug: unknown
    attribute``; there is no ZeroMQ debug switch.
2.  non-integer ``tbon.zmqdebug`` fails -> it does (exit 2, the same line).
3.  ``tbon.endpoint`` can be read -> DIFFERENCE: no endpoint attribute
    (``attr get tbon.endpoint``: exit 1, unknown attribute; docs/cli.md
    lists the attributes a rank has).  What Flux reads it for -- which
    transport the links use -- is ``tbon.transport``, tested in 4-7.
4.  ``ipc://`` in a standalone instance -> the default transport here is
    ``unix`` (documented, chosen by measurement); with ``unix`` and ``ipc``
    rank 0's overlay socket is ``RUNDIR/tbon-0`` (an AF_UNIX socket), every
    rank reports the transport, and rank 1 answers through it.
5.-6. ``tcp://`` when the process mapping is unavailable / per-broker ->
    no PMI here: not applicable.  tcp is asked for (7).
7.  ``tbon.prefertcp=1`` uses ``tcp://`` -> ``-S tbon.transport=tcp``:
    rank 0 listens on ``tcp://127.0.0.1:PORT`` (``Instance.endpoints``,
    found LISTENing in /proc/net/tcp), no ``tbon-0`` socket, and rank 1
    answers.  Flux's own ``-S tbon.prefertcp=1`` is refused, exit 2,
    naming kvbroker's ``tbon.transport=tcp`` (it said only ``unknown
    attribute`` until 2026-12-05: found by this file).
8.  ipc and tcp by a custom taskmap -> no PMI taskmap: not applicable.
9.  ``FLUX_IPADDR_INTERFACE=lo`` -> not applicable (no such variable);
    ``start``'s tcp links are on 127.0.0.1 anyway (7).
10.-11. ``tbon.interface-hint=lo`` / ``=127.0.0.0/8`` -> refused, exit 2
    (not applicable: ``start`` binds 127.0.0.1, a bootstrap file names its
    addresses), saying so (it said ``did you mean tbon.transport?``,
    an unrelated setting, until 2026-12-05: found by this file).
12. TOML ``tbon.interface-hint = "127.0.0.0/8"`` -> a bootstrap file
    whose ``bind``/``connect`` are on 127.0.0.1: two ``kvbroker broker``
    ranks make one instance (rank 0's initial program reaches rank 1).
13. TOML ``tbon.interface-hint = 42`` (wrong type) fails -> wrong types in
    a bootstrap file (``fanout``, ``default_port``, ``enable_ipv6``,
    ``hosts``, ``default_bind``, ``curve_cert``, an ``[attrs]`` value)
    exit 2 naming the key.  Flux's own spelling, an unquoted dotted key
    in ``[attrs]`` (``tbon.interface-hint = 42``, ``tbon.torpid_min = 1``,
    ``log.level = "bogus"``), is the attribute too (TOML reads it as a
    table ``tbon``, which was silently ignored until 2026-12-05: found by
    this file).  ``kvbroker broker`` always uses tcp (documented) and
    refuses another ``tbon.transport`` (``bogus``, from ``-S`` or the
    file's ``[attrs]``: it was overwritten without a word).
14. ``tbon.interface-hint=badiface`` fails -> a bootstrap file whose rank
    0 binds an address no interface has (192.0.2.1, TEST-NET-1): rank 0
    exits 1 with ``Cannot assign requested address`` (documented).
15.-16. interface-hint ``default-route`` / ``hostname`` work -> not
    applicable (refused as 10).
17.-19. interface-hint default, and its default from a parent instance ->
    not applicable (no such attribute, no nested jobs).
20. ``tbon.parent-endpoint`` cannot be read on rank 0 -> ``overlay
    parentof 0`` fails (exit 1, ``rank 0 has no parent``).
21. ``tbon.parent-endpoint`` can be read on ranks 1-3 of 4 -> ``overlay
    parentof R`` names their parent, 0.
22. ``-Stbon.fanout=4`` is ``tbon.topo=kary:4`` -> DIFFERENCE
    (documented): Flux's name is refused, exit 2, naming ``--fanout K``;
    ``--fanout 4`` gives ``attr get fanout`` 4.  In a bootstrap file's
    ``[attrs]`` too (naming its ``fanout`` key).
    kvbroker's own name in a bootstrap file's ``[attrs]`` (``"fanout" =
    4``) or ``kvbroker broker -S fanout=4`` is refused naming the file's
    ``fanout`` key (it said ``use --fanout K``, an option ``broker`` does
    not have, until 2026-12-05); ``"size"`` likewise names its hosts.
23. ``-Stbon.topo=kary:8`` -> the same (``--fanout 8``).
24. ``-Stbon.topo=kary:0`` (flat) works -> DIFFERENCE: ``--fanout 0`` is a
    usage error (exit 2); a flat tree is a fanout of at least size - 1 (the
    default, 32): every rank of 5 has parent 0 (also case 29).
25.-27. ``tbon.topo=custom`` / ``binomial`` / ``mincrit`` -> refused, exit
    2: only k-ary trees here.
28. ``mincrit:2`` on 5 ranks has ``tbon.maxlevel`` 2 -> no maxlevel
    attribute; ``--fanout 2`` on 5 ranks has depth 2 (``parentof 4`` is 1,
    ``parentof 1`` is 0).
29. ``mincrit`` is flat for small size -> see 24.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli
from test_multihost import brokers, keyed_config  # noqa: F401  (brokers: a fixture)

from broker.launch import free_tcp_ports

ARGS = ("-S", "broker.rc1_path=", "-S", "broker.rc3_path=")  # Flux's, taken
T = 60


async def kvb(*args: str, cwd: str | Path | None = None) -> tuple[int, str, str]:
    """``kvbroker ARGS`` outside any instance: (status, stdout, stderr)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(KVBROKER).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return await run_cli(*args, env=env, cwd=cwd, timeout=T)


async def start(*args: str) -> tuple[int, str, str]:
    return await kvb("start", *ARGS, *args)


async def broker(tmp_path: Path, text: str, *cmd: str) -> tuple[int, str, str]:
    """``kvbroker broker -c FILE -- CMD``, one rank, FILE holding ``text``."""
    conf = tmp_path / "conf.toml"
    conf.write_text(text)
    return await kvb("broker", "-c", str(conf), "--rundir", str(tmp_path / "run"),
                     "--", *cmd, cwd=tmp_path)


# -- 1-2: tbon.zmqdebug ------------------------------------------------------

@pytest.mark.parametrize("value", ["1", "foo"])
async def test_t0019_zmqdebug_refused(value: str) -> None:
    assert await start("-s2", f"-Stbon.zmqdebug={value}", "--", "true") == (
        2, "", "kvbroker: start: tbon.zmqdebug: unknown attribute\n")


# -- 3-7: the links' transport -------------------------------------------------

async def test_t0019_no_endpoint_attributes() -> None:
    """Case 3 (and 20-21's attribute): neither endpoint is an attribute."""
    script = "kvbroker attr get tbon.endpoint; kvbroker exec -r 1 -- kvbroker attr get " \
             "tbon.parent-endpoint; echo rc=$?"
    rc, out, err = await start("-s2", "--", "sh", "-c", script)
    assert (rc, out) == (0, "rc=1\n"), err
    assert err.count("unknown attribute") == 2, err
    assert "'tbon.endpoint'" in err and "'tbon.parent-endpoint'" in err, err


def tcp_listening(port: int) -> bool:
    """Someone LISTENs on 127.0.0.1:``port`` (/proc/net/tcp)."""
    want = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(line.split()[1] == want and line.split()[3] == "0A"
                   for line in f.readlines()[1:])


@pytest.mark.parametrize("transport", ["unix", "ipc", "tcp"])
async def test_t0019_links_use_the_transport_asked_for(start_instance, connect,
                                                       transport: str) -> None:
    """Cases 4 and 7: the transport each rank reports is the one its links
    use -- a socket in the run directory, or a TCP port on 127.0.0.1."""
    attrs = {} if transport == "unix" else {"tbon.transport": transport}
    inst = await start_instance(size=2, attrs=attrs)
    h = await connect(inst)
    assert [await h.attr_get("tbon.transport", nodeid=r) for r in (0, 1)] == [transport] * 2
    assert (await h.ping(nodeid=1)) is not None  # rank 1 answers over the link
    sock = Path(inst.rundir) / "tbon-0"
    if transport == "tcp":
        assert list(inst.endpoints) == [0], inst.endpoints
        host, port = inst.endpoints[0].removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1"  # (case 9's lo)
        assert tcp_listening(int(port))
        assert not sock.exists()
    else:
        assert inst.endpoints == {}
        assert stat.S_ISSOCK(sock.stat().st_mode)


async def test_t0019_prefertcp_refused() -> None:
    rc, out, err = await start("-s2", "-Stbon.prefertcp=1", "--", "true")
    assert (rc, out) == (2, ""), err
    assert err.startswith("kvbroker: start: tbon.prefertcp: "), err


async def test_t0019_prefertcp_refusal_names_tbon_transport() -> None:
    rc, _, err = await start("-s2", "-Stbon.prefertcp=1", "--", "true")
    assert rc == 2
    assert "tbon.transport=tcp" in err, err


# -- 9-16: interface hints ------------------------------------------------------

@pytest.mark.parametrize("hint", ["lo", "127.0.0.0/8", "badiface", "default-route",
                                  "hostname"])
async def test_t0019_interface_hint_refused(hint: str) -> None:
    rc, out, err = await start("-s2", f"-Stbon.interface-hint={hint}",
                               "-Stbon.transport=tcp", "--", "true")
    assert (rc, out) == (2, ""), err
    assert err.startswith("kvbroker: start: tbon.interface-hint: "), err


async def test_t0019_interface_hint_refusal_does_not_point_at_transport() -> None:
    rc, _, err = await start("-Stbon.interface-hint=lo", "--", "true")
    assert rc == 2
    assert "tbon.transport" not in err, err


async def test_t0019_bootstrap_file_on_loopback(tmp_path: Path, brokers) -> None:  # noqa: F811
    """Case 12: the addresses are the bootstrap file's; two ranks on
    127.0.0.1 make one instance."""
    config = await keyed_config(tmp_path, 2, 1)
    assert "tcp://127.0.0.1:" in config.read_text()
    rank1 = await brokers(config, 1)
    rank0 = await brokers(config, 0, "--", KVBROKER, "exec", "-r", "1", "--",
                          KVBROKER, "attr", "get", "rank")
    assert rank0.proc.stdout is not None
    out = await asyncio.wait_for(rank0.proc.stdout.read(), T)
    assert await asyncio.wait_for(rank0.proc.wait(), T) == 0
    assert out.decode() == "1\n"
    assert await asyncio.wait_for(rank1.proc.wait(), T) == 0


@pytest.mark.parametrize(("line", "says"), [
    ('fanout = "2"', "bootstrap.fanout must be an integer >= 1"),
    ('default_port = "x"', "bootstrap.default_port must be a port number"),
    ("enable_ipv6 = 42", "bootstrap.enable_ipv6 must be true or false"),
    ("hosts = 42", "bootstrap.hosts must be a list"),
    ("default_bind = 42", "default_bind must be a non-empty string"),
    ("curve_cert = 42", "curve_cert must be a non-empty string"),
    ("hosts = [ { host = 42 } ]", "hosts[0]: host must be a non-empty string"),
    ('[attrs]\n"tbon.interface-hint" = 42', "tbon.interface-hint: Flux's choice of the network"),
    ('[attrs]\n"tbon.torpid_min" = true', "tbon.torpid_min: 'true' is not a duration"),
    ('[attrs]\n"log.level" = 42', "log.level: unknown level '42'"),
])
async def test_t0019_bootstrap_file_wrong_type_refused(tmp_path: Path, line: str,
                                                       says: str) -> None:
    """Case 13: a value of the wrong type exits 2 before anything starts,
    naming the key."""
    rc, out, err = await broker(tmp_path, f"[bootstrap]\n{line}\n", "true")
    assert (rc, out) == (2, ""), err
    assert err.startswith("kvbroker: broker: ") and says in err, err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


async def test_t0019_bootstrap_file_dotted_key_wrong_type_refused(tmp_path: Path) -> None:
    rc, out, err = await broker(tmp_path, "[bootstrap]\n[attrs]\ntbon.interface-hint = 42\n",
                                "true")
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "tbon.interface-hint" in err, err


async def test_t0019_bootstrap_file_dotted_keys_apply_or_are_refused(tmp_path: Path) -> None:
    """Either the dotted key means the attribute (the value is in effect,
    a bad one refused), or the file is refused; never neither."""
    rc, out, err = await broker(tmp_path, "[bootstrap]\n[attrs]\ntbon.torpid_min = 1\n",
                                KVBROKER, "attr", "get", "tbon.torpid_min")
    assert (rc, out) == (0, "1\n") or rc == 2, (rc, out, err)
    rc, out, err = await broker(tmp_path, '[bootstrap]\n[attrs]\nlog.level = "bogus"\n',
                                "true")
    assert rc == 2 and "log.level" in err, (rc, out, err)


async def test_t0019_bind_to_an_address_no_interface_has(tmp_path: Path, brokers) -> None:  # noqa: F811
    """Case 14: rank 0 cannot bind its children's address: exit 1, saying so."""
    config = await keyed_config(tmp_path, 2, 1)
    [port] = free_tcp_ports(1)
    text = config.read_text()
    bind0 = text.split('bind = "', 1)[1].split('"', 1)[0]
    bad = f"tcp://192.0.2.1:{port}"
    config.write_text(text.replace(f'bind = "{bind0}"', f'bind = "{bad}"', 1))
    rank0 = await brokers(config, 0)
    assert await asyncio.wait_for(rank0.proc.wait(), T) == 1
    err = (tmp_path / "stderr0-0").read_text()
    assert f"cannot bind {bad}" in err and "Cannot assign requested address" in err, err


# -- 20-29: the tree ---------------------------------------------------------------

async def test_t0019_parentof() -> None:
    """Cases 20-21."""
    script = ("kvbroker overlay parentof 0; echo rc=$?; "
              "for r in 1 2 3; do kvbroker overlay parentof $r; done")
    rc, out, err = await start("-s4", "--", "sh", "-c", script)
    assert (rc, out) == (0, "rc=1\n0\n0\n0\n"), err
    assert err == "kvbroker: overlay parentof: rank 0 has no parent\n"


@pytest.mark.parametrize("attr", ["tbon.fanout=4", "tbon.topo=kary:8", "tbon.topo=custom",
                                  "tbon.topo=binomial", "tbon.topo=mincrit",
                                  "tbon.topo=mincrit:2", "tbon.topo=kary:0"])
async def test_t0019_flux_topology_names_refused(attr: str) -> None:
    """Cases 22-27: Flux's names are refused, naming kvbroker's option."""
    name = attr.split("=")[0]
    assert await start(f"-S{attr}", "--", "true") == (
        2, "", f"kvbroker: start: {name} is Flux's name: kvbroker's is fanout, set it at "
        "start with --fanout K (a bootstrap file: its fanout key)\n")


async def test_t0019_flux_fanout_name_refused_in_bootstrap_file(tmp_path: Path) -> None:
    rc, out, err = await broker(tmp_path, '[bootstrap]\n[attrs]\n"tbon.fanout" = 4\n', "true")
    assert (rc, out) == (2, ""), err
    assert "tbon.fanout is Flux's name" in err and "its fanout key" in err, err


@pytest.mark.parametrize(("where", "name"), [("-S", "fanout"), ("[attrs]", "fanout"),
                                             ("[attrs]", "size")])
async def test_t0019_broker_fanout_refusal_names_the_file(tmp_path: Path, where: str,
                                                          name: str) -> None:
    text = "[bootstrap]\n" + (f'[attrs]\n"{name}" = 4\n' if where == "[attrs]" else "")
    conf = tmp_path / "conf.toml"
    conf.write_text(text)
    opts = ("-S", f"{name}=4") if where == "-S" else ()
    rc, out, err = await kvb("broker", "-c", str(conf), *opts, "--", "true", cwd=tmp_path)
    assert (rc, out) == (2, ""), err
    assert f"--{name}" not in err, err
    assert (await kvb("broker", "-c", str(conf), f"--{name}", "4", "--", "true"))[0] == 2


@pytest.mark.parametrize("where", ["-S", "[attrs]"])
async def test_t0019_broker_refuses_a_bad_transport(tmp_path: Path, where: str) -> None:
    text = "[bootstrap]\n" + ('[attrs]\n"tbon.transport" = "bogus"\n' if where == "[attrs]"
                              else "")
    conf = tmp_path / "conf.toml"
    conf.write_text(text)
    opts = ("-S", "tbon.transport=bogus") if where == "-S" else ()
    rc, out, err = await kvb("broker", "-c", str(conf), *opts, "--", "true", cwd=tmp_path)
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "tbon.transport" in err, err


@pytest.mark.parametrize("k", ["4", "8"])
async def test_t0019_fanout_option(k: str) -> None:
    """Cases 22-23 in kvbroker's terms."""
    assert await start("--fanout", k, "--", KVBROKER, "attr", "get", "fanout") == (
        0, f"{k}\n", "")


async def test_t0019_fanout_zero_is_a_usage_error() -> None:
    rc, out, err = await start("--fanout", "0", "--", "true")
    assert (rc, out) == (2, "")
    assert "--fanout must be at least 1 (got 0)" in err, err


@pytest.mark.parametrize(("opts", "parents"), [
    ((), "0 0 0 0"),                # cases 24, 29: flat
    (("--fanout", "2"), "0 0 1 1"),  # case 28: depth 2
])
async def test_t0019_tree_shape(opts: tuple[str, ...], parents: str) -> None:
    script = "for r in 1 2 3 4; do kvbroker overlay parentof $r; done | tr '\\n' ' '"
    rc, out, err = await start("-s5", *opts, "--", "sh", "-c", script)
    assert (rc, out.strip()) == (0, parents), err
