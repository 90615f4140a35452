"""flux-core t/t1105-proxy.t: ``flux proxy URI [CMD]`` -- reach an instance
through a proxy process, run a command whose ``FLUX_URI`` names the proxy,
and have RPCs, streams and events go through it.

kvbroker has no ``proxy`` command (**not built**).  What a user does
instead is documented (docs/cli.md, Conventions, "From another host";
docs/guide.md; docs/api.md, Connecting): every command, or a
``Handle``, takes ``KVBROKER_URI=ssh://[user@]host[:port]/RUNDIR/local-R``
itself and runs ``ssh host kvbroker relay SOCKET`` (broker/ssh.py), which
copies its standard input and output to and from the rank's local socket.
So nothing listens on the client's host and there is no proxy to start,
clean up or hang up on; a long-lived client that must outlive a rank's
restart uses ``Handle.connect(uri, reconnect=True)`` (Flux's ``flux proxy
--reconnect``).  Since the relay is documented as the whole mechanism, the
missing ``proxy`` command is not counted as a defect here.  ssh itself is
tests/bin/ssh-standin (as Flux's tests use tssh): it runs the remote
command line on this host, so the relay, the ranks and the sockets are
real.

Flux case -> here:

1. *creates new socket* / 2. *cleans up socket* -> a command over
   ``ssh://`` reaches the rank (``attr get size``) and leaves nothing
   behind: no relay process, no new file in the run directory.
3. *exits with command return code* -> no proxy to pass one on; a command
   over ``ssh://`` exits as it does locally (0, or 1 with the same error
   for a missing key).
4. *forwards getattr request* -> ``attr get size`` (case 1), and
   ``ping`` routed from the relayed client through the tree.
5.-8. *dynamic service registration* (``service.add``, re-register after
   disconnect, EINVAL with a method, EEXIST shadowing ``broker``) -> not
   applicable: a client cannot register services in kvbroker; services
   are modules loaded at start (docs/api.md, Writing a module).
9. *calls out to flux-uri for an unknown scheme* (``pid:``) / 10. *fails if
   flux-uri fails* -> not built (no ``flux uri`` resolver).  A URI with an
   unknown ``scheme://`` is refused naming the scheme; ``bloop:1234`` has
   no ``://`` and is a bare socket path here (docs/api.md), refused as one
   that does not exist, naming it.  A malformed ``ssh://`` is refused
   saying the form expected.
11. *unknown URI path (ENOENT)* -> ``ssh://node1/nonexistent/local-0``:
   exit 1, ``node1: PATH: No such file or directory``; also a path that is
   not a listening socket (``Connection refused``).
12. *forwards LD_LIBRARY_PATH* to the remote ``flux relay`` -> Flux needs
   its library path there; kvbroker runs the remote ``kvbroker`` through
   the ``PATH`` Flux's connector sets, the rank's ``RUNDIR/bin`` first
   (``KVBROKER_SSH_RCMD`` to change it; see t1106): the ssh command line
   is checked.  And a remote ``kvbroker`` that cannot be run is reported
   ("ended before the relay answered", then the remote shell's error).
13.-16. *version mismatch / --force* -> not applicable: the relay copies
   bytes and the connector protocol has no version handshake
   (docs/protocol.md); ``version`` is a read-only attribute.
17.-22., 24. *jobid arguments, FLUX_PROXY_REMOTE, parent-uri rewritten,
   cancel test job* -> not applicable: jobs and nested instances are out
   of scope.
23. *flux-start does not hang under flux-proxy* -> ``kvbroker start`` run
   with ``KVBROKER_URI=ssh://...`` in its environment starts, gives its
   command its own ``local://`` URI, and ends.
25.-26. *restore the terminal / SIGHUP to children without --nohup* -> no
   proxy process owns a terminal or children; what stands for it: Ctrl-C
   to a relayed ``kvs get --watch`` (the client's process group, its ssh
   too) ends it quietly, status 130, the relay gone.
27. *falls back to /tmp with an invalid TMPDIR* -> an ``ssh://`` client
   needs no local directory: it works with ``TMPDIR=/nonexistent``.

And what the ``ssh://`` + relay path promises (the brief; Flux's proxy
carries all of it): RPCs; streamed responses (``kvs get --watch``); event
subscriptions (``event sub``); large values both ways and in a watch; the
relay ending when the rank stops (``shutdown`` sent through the relay
returns once the instance is down, and the other relayed clients get
clear errors) and when the client goes (killed: the relay ends and the
rank drops its watch); guests (the relay runs as the ssh login user: a
guest gets role USER where guests are allowed, and a clear refusal where
not); a socket path with a space and a quote (quoted for the remote
shell); a relay to a socket that does not exist; ``flux proxy --reconnect``'s
equivalent (a ``reconnect=True`` handle over ``ssh://`` dials again when
the ssh connection drops, its watch going on); errors said clearly (an
ssh that fails, a remote kvbroker that cannot run, a hung ssh bounded by
``-t`` -- until 2026-12-05 ``ping``, ``uptime``, ``overlay status`` and
``shutdown`` waited for ever, their bound applying to requests only; a
relay greeting not understood, quoted -- until then said as ``node1: ``
and nothing more).  Not tested here:
``kvbroker exec`` over ``ssh://`` runs its commands on the client's host,
attached to local sockets -- documented (docs/guide.md: ``exec -r R`` only
reaches ranks on its own host, saying which host otherwise), unlike
``flux proxy ... flux exec``, which runs them on the ranks' hosts.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import sys
from pathlib import Path

import pytest
from test_broker_support import client_subscriptions, run_cli, stats, wait_until

from broker.handle import Handle
from kvs.client import KVS
from kvs_watch.client import watch

STANDIN = str(Path(__file__).parent / "bin" / "ssh-standin")
GUEST_UID = 65534

# The remote end of an ssh login as a guest: the real relay, run as that
# uid (imported while root: the guest cannot read this Python's library).
GUEST_RELAY = (
    "import os, sys\n"
    "from broker.ssh import relay\n"
    f"os.setgroups([]); os.setgid({GUEST_UID}); os.setuid({GUEST_UID})\n"
    "sys.exit(relay(sys.argv[2]))\n"
)


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """ssh is the stand-in; returns the file it logs its arguments to."""
    log = tmp_path / "ssh-args"
    monkeypatch.setenv("KVBROKER_SSH", STANDIN)
    monkeypatch.setenv("SSH_STANDIN_LOG", str(log))
    monkeypatch.delenv("KVBROKER_SSH_RCMD", raising=False)
    return log


def ssh_uri(local_uri: str, host: str = "node1") -> str:
    return f"ssh://{host}{local_uri.removeprefix('local://')}"


def relays(path: str) -> list[int]:
    """The pids of the ``kvbroker relay PATH`` processes running now."""
    want = [b"relay", path.encode()]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")[:-1]
        except OSError:
            continue
        if argv[-2:] == want:
            pids.append(int(entry))
    return pids


async def no_relays(path: str) -> None:
    async def gone() -> bool:
        return not relays(path)

    await wait_until(gone, f"the relays to {path} to end")


async def spawn_cli(*args: str, uri: str) -> asyncio.subprocess.Process:
    env = dict(os.environ, KVBROKER_URI=uri)
    return await asyncio.create_subprocess_exec(
        os.path.join(os.path.dirname(sys.executable), "kvbroker"), *args,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)


async def line(proc: asyncio.subprocess.Process, timeout: float = 15.0) -> str:
    assert proc.stdout is not None
    return (await asyncio.wait_for(proc.stdout.readline(), timeout)).decode()


async def finish(proc: asyncio.subprocess.Process, timeout: float = 15.0) -> tuple[int, str]:
    _, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


# ------------------------------------------------------------ Flux's cases


async def test_t1105_a_command_over_ssh_reaches_the_rank_and_leaves_nothing(
        start_instance, standin: Path) -> None:
    inst = await start_instance(size=2)
    path = inst.uri(1).removeprefix("local://")
    before = sorted(os.listdir(inst.rundir))
    rc, out, err = await run_cli("attr", "get", "size", uri=ssh_uri(inst.uri(1)))
    assert (rc, out, err) == (0, "2\n", "")
    rc, out, err = await run_cli("ping", "0", uri=ssh_uri(inst.uri(1)))
    assert rc == 0 and out.startswith("rank=0 route=c") and "!r1!r0 " in out, (out, err)
    assert relays(path) == []  # (the command waited for its ssh: none is left)
    assert sorted(os.listdir(inst.rundir)) == before
    # the remote command is the rank's kvbroker, found through RUNDIR/bin
    words = shlex.split(standin.read_text().splitlines()[0])
    assert words[0] == "node1" and words[-2:] == ["relay", path]
    assert words[1] == "env" and words[3] == "kvbroker", words
    assert words[2].startswith(f"PATH={inst.rundir}/bin:"), words
    assert os.access(f"{inst.rundir}/bin/kvbroker", os.X_OK)


async def test_a_socket_path_with_a_space_and_a_quote_reaches_the_remote_shell_intact(
        start_instance, standin: Path, tmp_path: Path) -> None:
    """ssh hands the remote shell one command line: the socket's path is
    quoted for it (a run directory may have any name)."""
    rundir = tmp_path / "run dir's" / "rd"
    rundir.parent.mkdir()
    inst = await start_instance(size=1, rundir=str(rundir))
    assert inst.uri(0) == f"local://{rundir}/local-0"
    rc, out, err = await run_cli("attr", "get", "rundir", uri=ssh_uri(inst.uri(0)))
    assert (rc, out, err) == (0, f"{rundir}\n", "")


async def test_t1105_exit_status_and_errors_are_those_of_a_local_command(
        start_instance, standin: Path) -> None:
    inst = await start_instance(size=1)
    uri = ssh_uri(inst.uri(0))
    assert (await run_cli("kvs", "put", "k=v", uri=uri))[0] == 0
    rc, out, err = await run_cli("kvs", "get", "k", uri=uri)
    assert (rc, out, err) == (0, "v\n", "")
    remote = await run_cli("kvs", "get", "nosuch", uri=uri)
    local = await run_cli("kvs", "get", "nosuch", uri=inst.uri(0))
    assert remote == local and remote[0] == 1 and "nosuch: No such file or directory" in remote[2]


async def test_t1105_unknown_schemes_and_malformed_uris_are_refused_clearly(standin: Path) -> None:
    rc, _, err = await run_cli("attr", "get", "size", uri="bloop://1234")
    assert rc == 1 and "unsupported broker URI scheme: 'bloop://1234'" in err, err
    rc, _, err = await run_cli("attr", "get", "size", uri="bloop:1234")  # a bare path
    assert rc == 1 and "KVBROKER_URI=bloop:1234: No such file or directory" in err, err
    rc, _, err = await run_cli("attr", "get", "size", uri="ssh://node1")
    assert rc == 1 and "bad ssh URI 'ssh://node1': expected ssh://[user@]host[:port]/" in err, err
    assert not standin.exists()  # nothing was run for any of them


async def test_t1105_a_socket_that_is_not_there_or_not_listening(
        standin: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "local-0"
    rc, out, err = await run_cli("attr", "get", "size", uri=f"ssh://node1{missing}")
    assert (rc, out) == (1, "")
    assert f"ssh://node1{missing}: node1: {missing}: No such file or directory" in err, err
    # a socket file nobody listens on (a rank killed, its socket left)
    stale = tmp_path / "local-1"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    try:
        rc, _, err = await run_cli("attr", "get", "size", uri=f"ssh://node1{stale}")
    finally:
        s.close()
    assert rc == 1 and f"node1: {stale}: Connection refused" in err, err
    # (a relay that answered with its error ends by itself: it may still be
    # on its way out as the command, which does not wait for it, returns)
    await no_relays(str(missing))
    await no_relays(str(stale))


async def test_t1105_ssh_or_the_remote_kvbroker_failing_is_said(
        start_instance, standin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inst = await start_instance(size=1)
    uri = ssh_uri(inst.uri(0))
    monkeypatch.setenv("KVBROKER_SSH_RCMD", "/nonexistent/kvbroker")
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 1, err
    assert "/nonexistent/kvbroker" in err  # the remote shell's own words
    assert "ssh to node1 ended before the relay answered" in err
    monkeypatch.delenv("KVBROKER_SSH_RCMD")
    monkeypatch.setenv("KVBROKER_SSH", "false")  # unknown host, login refused...
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 1 and f"KVBROKER_URI={uri}: ssh to node1 ended before" in err, err
    monkeypatch.setenv("KVBROKER_SSH", "/nonexistent/ssh")
    rc, _, err = await run_cli("attr", "get", "size", uri=uri)
    assert rc == 1 and "cannot run /nonexistent/ssh: No such file or directory" in err, err


async def test_t1105_kvbroker_start_under_an_ssh_uri_does_not_hang(
        start_instance, standin: Path) -> None:
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("start", "--", "sh", "-c", 'echo "$KVBROKER_URI"',
                                 uri=ssh_uri(inst.uri(0)), timeout=30)
    assert rc == 0, err
    assert out.startswith("local://") and out.strip() != inst.uri(0), out


async def test_t1105_an_invalid_tmpdir_does_not_matter(start_instance, standin: Path) -> None:
    inst = await start_instance(size=1)
    env = dict(os.environ, TMPDIR="/nonexistent/tmp")
    rc, out, err = await run_cli("uptime", uri=ssh_uri(inst.uri(0)), env=env)
    assert rc == 0 and "size 1" in out, (out, err)


# ------------------------------------------------ what the relay promises


async def test_relay_carries_a_streamed_watch(start_instance, connect, standin: Path) -> None:
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    assert (await run_cli("kvs", "put", "w=1", uri=inst.uri(0)))[0] == 0
    watch = await spawn_cli("kvs", "get", "--watch", "--count", "3", "w",
                            uri=ssh_uri(inst.uri(1)))
    assert await line(watch) == "1\n"
    for value in ("2", "3"):
        await KVS(h0).put("w", value.encode())
        assert await line(watch) == f"{value}\n"
    rc, err = await finish(watch)
    assert (rc, err) == (0, "")
    await no_relays(inst.uri(1).removeprefix("local://"))


async def test_relay_carries_event_subscriptions(start_instance, connect, standin: Path) -> None:
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    h1 = await connect(inst, 1)
    sub = await spawn_cli("event", "sub", "--count", "2", "t1105.",
                          uri=ssh_uri(inst.uri(1)))

    async def subscribed() -> bool:
        return client_subscriptions(await stats(h1, 1)) >= 1

    await wait_until(subscribed, "the relayed client's subscription", timeout=15)
    await h0.publish("other.topic", {"n": 0})
    seq = await h0.publish("t1105.a", {"n": 1})
    await h0.publish("t1105.b", {"n": 2})
    first, second = await line(sub), await line(sub)
    assert first.split("\t") == ["t1105.a", '{"n": 1}\n'], first
    assert second.split("\t") == ["t1105.b", '{"n": 2}\n'], second
    assert (await finish(sub)) == (0, "")
    assert seq > 0


async def test_relay_carries_large_values_both_ways(start_instance, connect,
                                                   standin: Path, tmp_path: Path) -> None:
    inst = await start_instance(size=2)
    uri = ssh_uri(inst.uri(1))
    big = os.urandom(6 << 20)
    src = tmp_path / "big"
    src.write_bytes(big)
    with open(src, "rb") as f:
        rc, _, err = await run_cli("kvs", "put", "-r", "big=-", uri=uri, stdin=f.fileno())
    assert rc == 0, err
    watch = await spawn_cli("kvs", "get", "--watch", "--count", "1", "-r", "big", uri=uri)
    assert watch.stdout is not None
    got = await asyncio.wait_for(watch.stdout.readexactly(len(big)), 30)
    assert got == big
    assert (await finish(watch)) == (0, "")
    # read back locally on rank 0: what went up the relay was stored whole
    h0 = await connect(inst, 0)
    assert await KVS(h0).get("big") == big


async def test_relay_ends_when_the_client_goes(start_instance, connect, standin: Path) -> None:
    inst = await start_instance(size=2)
    path = inst.uri(1).removeprefix("local://")
    h1 = await connect(inst, 1)
    assert (await run_cli("kvs", "put", "g=1", uri=inst.uri(0)))[0] == 0
    watch = await spawn_cli("kvs", "get", "--watch", "g", uri=ssh_uri(inst.uri(1)))
    assert await line(watch) == "1\n"
    assert len(relays(path)) == 1
    assert (await h1.rpc("kvs-watch.stats-get", {}))["watchers"] == 1
    watch.kill()  # the client dies: its end of the ssh connection closes
    await watch.wait()
    await no_relays(path)

    async def dropped() -> bool:
        return (await h1.rpc("kvs-watch.stats-get", {}))["watchers"] == 0

    await wait_until(dropped, "rank 1 to drop the relayed client's watch")


async def test_relay_ends_when_the_rank_stops(start_instance, standin: Path) -> None:
    inst = await start_instance(size=2)
    paths = [inst.uri(r).removeprefix("local://") for r in (0, 1)]
    assert (await run_cli("kvs", "put", "s=1", uri=inst.uri(0)))[0] == 0
    watch = await spawn_cli("kvs", "get", "--watch", "s", uri=ssh_uri(inst.uri(1)))
    assert await line(watch) == "1\n"
    sub = await spawn_cli("event", "sub", uri=ssh_uri(inst.uri(1)))
    async def both() -> bool:
        return len(relays(paths[1])) == 2

    await wait_until(both, "both relays to rank 1")
    # shutdown sent through a relay returns once the instance is down
    rc, _, err = await run_cli("shutdown", uri=ssh_uri(inst.uri(0)), timeout=30)
    assert rc == 0, err
    rc, err = await finish(watch)
    assert rc == 1 and "s: " in err and "this rank is stopping" in err, err
    rc, err = await finish(sub)
    assert rc == 1 and "event sub: Connection reset by peer (connection to broker lost)" in err, err
    for path in paths:
        await no_relays(path)


async def test_relay_as_a_guest_gets_the_guest_role(start_instance, standin: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBROKER_SSH_RCMD", f"{sys.executable} -c {shlex.quote(GUEST_RELAY)}")
    inst = await start_instance(size=2, attrs={"access.allow-guest-user": "true"})
    rc, out, err = await run_cli("ping", "--userid", "0", uri=ssh_uri(inst.uri(1)))
    assert rc == 0 and f"userid={GUEST_UID} rolemask=0x2" in out, (out, err)
    rc, _, err = await run_cli("kvs", "put", "x=1", uri=ssh_uri(inst.uri(1)))
    assert rc == 1 and "Operation not permitted" in err, err  # not the guest's namespace
    owner_only = await start_instance(size=1)
    path = owner_only.uri(0).removeprefix("local://")
    rc, _, err = await run_cli("ping", "0", uri=ssh_uri(owner_only.uri(0)))
    assert rc == 1 and f"node1: {path}: Permission denied" in err, err


async def test_ctrl_c_ends_a_relayed_stream_quietly(start_instance, standin: Path) -> None:
    """Flux's proxy hangs up on its children; here Ctrl-C goes to the
    terminal's process group, the client and its ssh: status 130, nothing
    said, the relay gone (as for a local client)."""
    inst = await start_instance(size=2)
    assert (await run_cli("kvs", "put", "c=1", uri=inst.uri(0)))[0] == 0
    proc = await asyncio.create_subprocess_exec(
        os.path.join(os.path.dirname(sys.executable), "kvbroker"), "kvs", "get", "--watch", "c",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, start_new_session=True,
        env=dict(os.environ, KVBROKER_URI=ssh_uri(inst.uri(1))))
    assert await line(proc) == "1\n"
    os.killpg(proc.pid, signal.SIGINT)
    assert (await finish(proc)) == (130, "")
    await no_relays(inst.uri(1).removeprefix("local://"))


async def test_a_reconnecting_handle_survives_a_dropped_ssh(start_instance, connect,
                                                          standin: Path) -> None:
    """Flux's ``flux proxy --reconnect``: ``Handle.connect(uri,
    reconnect=True)`` over ``ssh://`` dials again with a new ssh when the
    connection drops (the relay killed), and its watch goes on."""
    inst = await start_instance(size=2)
    path = inst.uri(1).removeprefix("local://")
    kvs0 = KVS(await connect(inst, 0))
    await kvs0.put("r", b"1")
    h = await asyncio.wait_for(Handle.connect(ssh_uri(inst.uri(1)), reconnect=True), 15)
    try:
        async with asyncio.timeout(30), watch(h, "r") as w:
            assert (await anext(w)).value == b"1"
            [first] = relays(path)
            os.kill(first, signal.SIGKILL)
            await kvs0.put("r", b"2")
            assert (await anext(w)).value == b"2"
            again = relays(path)
            assert len(again) == 1 and again != [first]
            assert (await h.rpc("broker.ping", {}))["rank"] == 1
    finally:
        await h.close()
    await no_relays(path)


async def test_a_greeting_not_understood_is_said(start_instance, standin: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay of another kvbroker version could greet otherwise (Flux's
    proxy refuses a version mismatch, saying so): the client must say it
    did not understand the greeting, and quote it."""
    inst = await start_instance(size=1)
    monkeypatch.setenv("KVBROKER_SSH", "sh -c 'echo kvbroker-relay ok2; exec cat >/dev/null' --")
    rc, _, err = await run_cli("attr", "get", "size", uri=ssh_uri(inst.uri(0)), timeout=10)
    assert rc == 1
    assert "ok2" in err, err


async def test_a_hung_ssh_is_bounded_by_the_commands_timeouts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreachable host can leave ssh hanging.  ``attr get -t``, ``rpc
    -t``, ``exec -t`` give up after their timeout; docs/cli.md promises the
    same of ``shutdown -t`` ("the whole command, connecting included") and
    of the health checks ``uptime`` and ``overlay status`` (2 s by
    default), and ``ping -t`` is how a script checks a rank answers."""
    # an ssh that never answers (and ends with its client, when it is killed)
    monkeypatch.setenv("KVBROKER_SSH", "sh -c 'exec cat >/dev/null 2>&1' --")
    uri = "ssh://nowhere/tmp/t1105-nowhere/local-0"
    commands = [("attr", "get", "size", "-t", "1"), ("ping", "-t", "1", "0"),
                ("uptime", "-t", "1"), ("overlay", "status", "-t", "1"),
                ("shutdown", "-t", "1")]

    async def one(args: tuple[str, ...]) -> str | None:
        proc = await spawn_cli(*args, uri=uri)
        try:
            rc, err = await finish(proc, timeout=5)
        except TimeoutError:
            proc.kill()
            await proc.communicate()
            return f"{' '.join(args)}: still running after 5 s"
        if rc != 1 or "did not answer" not in err and "no answer" not in err:
            return f"{' '.join(args)}: {rc} {err!r}"
        return None

    hung = [r for r in await asyncio.gather(*(one(c) for c in commands)) if r]
    assert hung == []


async def test_relay_refuses_a_missing_socket_and_says_so(tmp_path: Path) -> None:
    """``kvbroker relay`` run by hand (what ssh runs): the greeting names
    the socket and the reason, exit 1."""
    rc, out, _ = await run_cli("relay", str(tmp_path / "gone" / "local-0"))
    assert rc == 1
    assert out.startswith("kvbroker-relay error 2 ")
    assert f"{tmp_path}/gone/local-0: No such file or directory" in out

