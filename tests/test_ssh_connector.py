"""``ssh://`` URIs (broker/ssh.py): a client on another host attaches to a
rank through ``ssh HOST kvbroker relay SOCKET``.  ssh itself is replaced by
a stand-in that runs the command here (tests/bin/ssh-standin, as Flux's
tests do with tssh); the relay, the greeting and the connection are real."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli
from test_kvs_rpc_helpers import commit, put

from broker import ssh
from broker.handle import Handle
from kvs_watch.client import watch

STANDIN = str(Path(__file__).parent / "bin" / "ssh-standin")


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """ssh is the stand-in; returns the file it logs its arguments to."""
    log = tmp_path / "ssh-args"
    monkeypatch.setenv("KVBROKER_SSH", STANDIN)
    monkeypatch.setenv("SSH_STANDIN_LOG", str(log))
    return log


def ssh_uri(local_uri: str, authority: str = "node1") -> str:
    return f"ssh://{authority}{local_uri.removeprefix('local://')}"


def test_ssh_uris_parse() -> None:
    t = ssh.parse("ssh://alice@node1:2222/tmp/kvb-x/local-3")
    assert (t.user, t.host, t.port, t.path) == ("alice", "node1", 2222, "/tmp/kvb-x/local-3")
    assert ssh.parse("ssh://node1/run/s") == ssh.SshTarget("node1", "/run/s")
    for bad in ("ssh://node1", "ssh:///tmp/x", "ssh://node1:port/x", "ssh://node1/x?y=1",
                "ssh://-oProxyCommand=touch%20x/s", "ssh://-lroot@node1/s"):
        with pytest.raises(ValueError, match="expected ssh://"):
            ssh.parse(bad)


async def test_the_cli_reaches_a_rank_over_ssh(start_instance, standin: Path) -> None:
    inst = await start_instance(size=2)
    uri = ssh_uri(inst.uri(1), "alice@node1:2222")
    rc, _, err = await run_cli("kvs", "put", "via=ssh", uri=uri)
    assert rc == 0, err
    rc, out, err = await run_cli("kvs", "get", "via", uri=inst.uri(0))
    assert (rc, out) == (0, "ssh\n"), err
    rc, out, err = await run_cli("ping", "0", uri=uri)
    assert rc == 0 and "route=c" in out and "!r1!r0 " in out, (out, err)
    # ssh got the user and port, and one command line for the remote shell
    first = standin.read_text().splitlines()[0]
    assert first.startswith("-p 2222 -l alice node1 ")
    assert first.endswith(f"relay {inst.uri(1).removeprefix('local://')}")


async def test_the_remote_command_may_be_several_words(start_instance, standin: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``$KVBROKER_SSH_RCMD`` of several words (an interpreter and a
    module, ``env`` and a path) was quoted as one word: no such program."""
    inst = await start_instance(size=1)
    monkeypatch.setenv("KVBROKER_SSH_RCMD", f"env {KVBROKER}")
    rc, out, err = await run_cli("ping", "0", uri=ssh_uri(inst.uri(0)))
    assert rc == 0 and "route=c" in out, (out, err)
    assert standin.read_text().splitlines()[0] == \
        f"node1 env {KVBROKER} relay {inst.uri(0).removeprefix('local://')}"
    monkeypatch.setenv("KVBROKER_SSH_RCMD", 'kvbroker "')  # (named, not just "No closing ...")
    rc, _, err = await run_cli("ping", "0", uri=ssh_uri(inst.uri(0)))
    assert rc == 1 and "$KVBROKER_SSH_RCMD 'kvbroker \"': No closing quotation" in err, err


async def test_a_handle_over_ssh_watches_and_closes_cleanly(start_instance, connect,
                                                            standin: Path) -> None:
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    await commit(h0, put("w.key", "1"))
    async with asyncio.timeout(30):
        h = await Handle.connect(ssh_uri(inst.uri(1)))
        assert h.uri == ssh_uri(inst.uri(1))
        async with watch(h, "w.key") as w:
            assert (await anext(w)).value == b"1"
            await commit(h0, put("w.key", "2"))
            assert (await anext(w)).value == b"2"
        assert (await h.rpc("kvs-watch.stats-get", {}))["watchers"] == 0
        proc = h._ssh
        assert proc is not None and proc.returncode is None
        await h.close()
        assert proc.returncode == 0  # ssh (and the relay) exited with the connection


async def test_ssh_connection_errors_say_what_failed(start_instance, standin: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    inst = await start_instance(size=1)
    with pytest.raises(FileNotFoundError, match="node1: /nonexistent/local-0: No such file"):
        await Handle.connect("ssh://node1/nonexistent/local-0")
    monkeypatch.setenv("KVBROKER_SSH", "false")  # ssh that fails (unknown host, no login...)
    with pytest.raises(OSError, match="ssh to node1 ended before the relay") as info:
        await Handle.connect(ssh_uri(inst.uri(0)))
    assert info.value.errno == errno.EHOSTUNREACH
    monkeypatch.setenv("KVBROKER_SSH", "/nonexistent/ssh")
    with pytest.raises(OSError, match="cannot run /nonexistent/ssh") as info:
        await Handle.connect(ssh_uri(inst.uri(0)))
    assert info.value.errno == errno.ENOENT


async def test_relay_refuses_a_missing_socket(tmp_path: Path) -> None:
    rc, out, _ = await run_cli("relay", str(tmp_path / "nope"))
    assert rc == 1
    reason = os.strerror(errno.ENOENT)
    assert out == f"kvbroker-relay error {errno.ENOENT} {tmp_path}/nope: {reason}\n"


def test_a_blocking_connect_that_hangs_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """``broker.sync.connect(uri, timeout=...)`` bounds the connect too: an
    ssh that never answers (an unreachable host) hung it for ever."""
    import time

    from broker import sync

    monkeypatch.setenv("KVBROKER_SSH", "sh -c 'exec sleep 30' --")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        sync.connect("ssh://nowhere/tmp/x/local-0", timeout=0.5)
    assert time.monotonic() - t0 < 10


async def test_the_relay_closes_its_socket_either_way(start_instance, tmp_path: Path) -> None:
    """``kvbroker relay`` with warnings on says nothing on stderr, whether it
    connected and the client went, or could not connect: it left its socket
    to the interpreter's exit, and Python warned ``ResourceWarning:
    unclosed <socket.socket ...>`` (a suite run with
    ``PYTHONWARNINGS=always::ResourceWarning``)."""
    inst = await start_instance(size=1)
    env = {**os.environ, "PYTHONWARNINGS": "always::ResourceWarning"}
    path = inst.uri(0).removeprefix("local://")
    rc, out, err = await run_cli("relay", path, env=env, input=b"")
    assert (rc, out, err) == (0, "kvbroker-relay ok\n", "")
    rc, _, err = await run_cli("relay", str(tmp_path / "nope"), env=env)
    assert (rc, err) == (1, "")
