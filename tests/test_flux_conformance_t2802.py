"""flux-core t/t2802-uri-cmd.t (``flux uri``) against real kvbroker ranks:
``kvbroker uri`` (broker/uri.py, docs/cli.md "uri").

Flux's cases, and what each becomes:

* ``--help`` lists the resolver schemes -> it lists the targets
  (:func:`test_help_lists_the_targets`).
* rejects an invalid URI (``bar``, ``bar:foo``) -> exit 1 naming the
  schemes (same test).
* passes ssh and local URIs through unchanged; ``--local`` of an ssh URI is
  its local one; ``--remote`` of a local one names this host ->
  :func:`test_uris_pass_through_and_convert`.
* the pid resolver gives a process's ``FLUX_URI``, with ``?local`` the same,
  with ``?remote`` the remote form -> ``KVBROKER_URI`` of a shell run in
  the instance (:func:`test_pid_of_processes_in_an_instance`).
* the pid resolver on a flux-broker (its child's ``FLUX_URI``, with a
  fallback scan of ``/proc``) -> a rank answers with its *own* socket, found
  through ``/proc/PID/fd``, since a rank's environment names the instance
  around it; ``kvbroker start``'s pid with rank 0's, found among its
  descendants, with the children file or by a scan of ``/proc/*/stat``
  (same test, both spawn modes; :func:`test_children_by_either_way`).
* fails if a broker has no child -> does not apply: every rank has its
  socket (rank 1's pid gives rank 1's URI, same test).
* fails for a nonexistent pid, with ``?local&remote``, and for a process
  with no ``FLUX_URI`` -> exit 1 each
  (:func:`test_pid_errors`).
* the ``jobid`` resolver (nested instances, ``..``), the ``slurm`` and
  ``lsf`` resolvers -> do not apply: a kvbroker instance is not a job of
  another.  ``.`` (the current instance) is kept.
* ``--wait`` (a pending job's URI, once it runs) -> ``--wait``/``?wait``
  on ``kvbroker start``'s pid: its URI once every rank is up, or an error
  if it exits first (:func:`test_wait_for_an_instance_starting`).
* (kvbroker's own) ``rank:N``: rank N of the current instance, or
  ``EHOSTUNREACH`` naming the ranks there are; ``KVBROKER_URI_RESOLVE_LOCAL``
  (Flux's ``FLUX_URI_RESOLVE_LOCAL``); a ``--remote`` answer attaches
  through ssh (:func:`test_rank_and_the_current_instance`); a Unix socket
  of this test process named like a rank's is found as one, another name
  is not (:func:`test_a_listening_socket_named_like_a_ranks`).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, stopped
from test_ssh_connector import STANDIN

from broker import uri as urimod

T = 60.0
HOST = socket.gethostname()


async def cli(*args: str, rc: int = 0, uri: str | None = None,
              env: dict[str, str] | None = None) -> str:
    code, out, err = await run_cli(*args, uri=uri, env=env)
    assert code == rc, (args, code, out, err)
    return out.strip() if rc == 0 else err.strip()


async def test_help_lists_the_targets() -> None:
    out = await cli("uri", "--help")
    assert "targets (each may end in ?local, ?remote or ?wait)" in out
    for scheme in ("pid:PID", "rank:N", "local:///PATH", "ssh://"):
        assert scheme in out
    for bad in ("bar", "bar:foo", "jobid:f1", "pid:x", "pid:0", "rank:-1", "rank:4294967294", "local://relative"):
        err = await cli("uri", bad, rc=1)
        assert err.startswith(f"kvbroker: uri: {bad}: "), err
    assert "schemes: local://, ssh://, pid:, rank:, ." in await cli("uri", "bar", rc=1)
    # --local and --remote together is a usage error
    assert "not allowed with" in await cli("uri", "--local", "--remote", ".", rc=2)


async def test_uris_pass_through_and_convert() -> None:
    ssh_uri = "ssh://bongo@foo.com:123/tmp/kvb-xyzzy/local-0"
    local_uri = "local:///tmp/kvb-xyzzy/local-0"
    assert await cli("uri", ssh_uri) == ssh_uri
    assert await cli("uri", local_uri) == local_uri
    assert await cli("uri", "--local", ssh_uri) == local_uri
    assert await cli("uri", f"{ssh_uri}?local") == local_uri
    assert await cli("uri", "--remote", local_uri) == f"ssh://{HOST}/tmp/kvb-xyzzy/local-0"
    assert await cli("uri", "--remote", ssh_uri) == ssh_uri
    assert await cli("uri", "/tmp/kvb-xyzzy/local-0") == local_uri  # (as KVBROKER_URI)
    assert "cannot both be asked" in await cli("uri", "--local", f"{local_uri}?remote", rc=1)


SCRIPT = """\
set -e
echo "uri $KVBROKER_URI"
echo "self $(kvbroker uri pid:$$)"
echo "self-local $(kvbroker uri "pid:$$?local")"
echo "self-remote $(kvbroker uri "pid:$$?remote")"
echo "remote-of-env $(kvbroker uri --remote "$KVBROKER_URI")"
echo "start $(kvbroker uri pid:$PPID)"
for r in 0 1 2; do
  echo "rank$r $(kvbroker uri pid:$(kvbroker exec -r $r kvbroker attr get broker.pid))"
  echo "local$r $(kvbroker exec -r $r kvbroker attr get local-uri)"
done
"""


@pytest.mark.no_forkserver  # (the ranks found under kvbroker start)
@pytest.mark.parametrize("spawn", ["fork", "exec"])
async def test_pid_of_processes_in_an_instance(spawn: str) -> None:
    """A shell in the instance: its own pid gives its ``KVBROKER_URI``; its
    parent, ``kvbroker start``, rank 0's URI (the ranks are its
    grandchildren when forked by the spawner, its children when exec'd);
    each rank's pid its own URI."""
    env = dict(os.environ, KVBROKER_SPAWN=spawn)
    out = await cli("start", "--size", "3", "--", "sh", "-c", SCRIPT, env=env)
    got = dict(line.split(" ", 1) for line in out.splitlines())
    uri = got["uri"]
    assert uri.startswith("local://") and uri.endswith("/local-0")
    assert got["self"] == got["self-local"] == uri
    assert got["self-remote"] == got["remote-of-env"] == \
        f"ssh://{HOST}{uri.removeprefix('local://')}"
    assert got["start"] == uri
    for r in range(3):
        assert got[f"rank{r}"] == got[f"local{r}"] == uri.replace("/local-0", f"/local-{r}")


async def test_pid_errors(tmp_path: Path) -> None:
    err = await cli("uri", "pid:4194304999", rc=1)
    assert err == "kvbroker: uri: pid:4194304999: no such process"
    assert "cannot both be asked" in await cli("uri", f"pid:{os.getpid()}?local&remote", rc=1)
    assert "unknown query" in await cli("uri", f"pid:{os.getpid()}?bogus", rc=1)
    env = {k: v for k, v in os.environ.items() if k != "KVBROKER_URI"}
    sleeper = subprocess.Popen(["sleep", "60"], env=env)
    try:
        err = await cli("uri", f"pid:{sleeper.pid}", rc=1)
        assert err == (f"kvbroker: uri: pid:{sleeper.pid}: not in a kvbroker instance (no "
                       "rank, no kvbroker start, and no KVBROKER_URI in its environment)")
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_rank_and_the_current_instance(start_instance, monkeypatch) -> None:
    inst = await start_instance(size=4)
    assert await cli("uri", "rank:3", uri=inst.uri(0)) == inst.uri(3)
    assert await cli("uri", "rank:0", uri=inst.uri(2)) == inst.uri(0)
    assert await cli("uri", ".", uri=inst.uri(1)) == inst.uri(1)
    # (a digit of another script is no rank: it was taken as 3, or said in
    # Python's words, "invalid literal for int()")
    for odd in ("rank:\u0663", "rank:\u00b2"):
        err = await cli("uri", odd, uri=inst.uri(0), rc=1)
        assert "a rank is an integer from 0 to" in err, err
    err = await cli("uri", "rank:9", uri=inst.uri(0), rc=1)
    assert err == ("kvbroker: uri: rank:9: No route to host (no route to rank 9: the "
                   "instance has ranks 0-3)")
    assert "KVBROKER_URI is not set" in await cli("uri", ".", rc=1)
    assert "KVBROKER_URI is not set" in await cli("uri", "rank:1", rc=1)
    env = dict(os.environ, KVBROKER_URI_RESOLVE_LOCAL="1")
    assert await cli("uri", "--remote", "rank:2", uri=inst.uri(0), env=env) == inst.uri(2)
    # the remote form attaches (ssh is the tests' stand-in, run here)
    remote = await cli("uri", "--remote", "rank:2", uri=inst.uri(0))
    assert remote == f"ssh://{HOST}{inst.uri(2).removeprefix('local://')}"
    env = dict(os.environ, KVBROKER_SSH=STANDIN, SSH_STANDIN_LOG=os.devnull)
    assert await cli("attr", "get", "rank", uri=remote, env=env) == "2"
    # the Python API: the same resolver, awaitable
    monkeypatch.setenv("KVBROKER_URI", inst.uri(0))
    assert await urimod.resolve("rank:1") == inst.uri(1)


async def test_rank_behind_a_stopped_rank_gives_up_at_its_timeout(start_instance) -> None:
    """``uri rank:N`` asks rank N through the tree: with a rank on the way
    stopped it waited for ever, with no ``-t`` to bound it (an operator
    probe: ten minutes, then killed).  ``-t`` gives up naming the rank;
    ranks reached another way still answer."""
    inst = await start_instance(size=4, fanout=2)
    async with stopped(inst.pids()[1]):  # (rank 3's parent)
        err = await cli("uri", "-t", "0.5", "rank:3", uri=inst.uri(0), rc=1)
        assert err == ("kvbroker: uri: Connection timed out (rank 3 did not answer in "
                       "0.5s: stopped or hung?)"), err
        assert await cli("uri", "-t", "5", "rank:2", uri=inst.uri(0)) == inst.uri(2)


def test_a_listening_socket_named_like_a_ranks(tmp_path: Path) -> None:
    """This process listening on ``DIR/local-7`` is a rank as far as the pid
    resolver can tell; on ``DIR/other`` (or not listening), it is not."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound_only = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        other.bind(str(tmp_path / "other"))
        other.listen()
        bound_only.bind(str(tmp_path / "local-3"))  # (bound, never listening)
        assert urimod.rank_socket(os.getpid()) is None
        listener.bind(str(tmp_path / "local-7"))
        listener.listen()
        assert urimod.rank_socket(os.getpid()) == (7, str(tmp_path / "local-7"))
        assert urimod.pid_uri(os.getpid()) == f"local://{tmp_path}/local-7"
    finally:
        for s in (listener, other, bound_only):
            s.close()


def test_children_by_either_way() -> None:
    """The children file and the scan of every process's parent agree."""
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        mine = {k.pid for k in kids}
        assert mine <= set(urimod.children(os.getpid()))
        assert mine <= set(urimod.children_by_parent(os.getpid()))
        assert urimod.children(kids[0].pid) == urimod.children_by_parent(kids[0].pid) == []
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_a_process_that_exits_while_it_is_read_is_no_such_process(tmp_path: Path) -> None:
    """``pid:PID`` of a process that exits between the check that it is
    there and the reads of its ``/proc`` files (ENOENT; ESRCH for one
    exiting): "no such process", as for one that was never there (the
    fresh-clone CI once read "cannot read its environment: No such
    process"); ``--wait`` then says it exited before its instance was up.
    A ``/proc`` made here: its process directory is there, its files not."""
    (tmp_path / "net").mkdir()
    (tmp_path / "net" / "unix").write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n")
    (tmp_path / "4242").mkdir()
    with pytest.raises(urimod.ProcessGone, match="^pid:4242: no such process$"):
        urimod.pid_uri(4242, proc=str(tmp_path))


def test_queries_and_command_lines() -> None:
    assert urimod.parse_query("pid:1?local") == ("pid:1", "local", False)
    assert urimod.parse_query("pid:1?remote&remote") == ("pid:1", "remote", False)
    assert urimod.parse_query("pid:1") == ("pid:1", None, False)
    for bad in ("pid:1?", "pid:1?local&remote", "pid:1?x=1", "pid:1?wait&local&remote"):
        with pytest.raises(urimod.ResolveError):
            urimod.parse_query(bad)
    assert urimod.parse_query("pid:1?wait&remote") == ("pid:1", "remote", True)
    assert urimod.parse_query("pid:1?wait") == ("pid:1", None, True)
    py = sys.executable
    starts = [[py, "/v/bin/kvbroker", "start", "--size", "4"],
              [py, "/v/bin/kvbroker", "--event-loop", "asyncio", "start"],
              [py, "-m", "broker.cli", "start"], [py, "-m", "broker.spawner", "/tmp/kvb-x"]]
    others = [[py, "/v/bin/kvbroker", "exec", "--", "start"], [py, "/v/bin/kvbroker"],
              ["/bin/sh", "start"], [py, "-m", "broker.rank", "--rank", "1"]]
    assert all(urimod.starts_instances(a) for a in starts)
    assert not any(urimod.starts_instances(a) for a in others)


async def test_resolve_local_env_and_the_api() -> None:
    uri = "ssh://node1/tmp/kvb-q/local-1"
    assert await urimod.resolve(uri, env={"KVBROKER_URI_RESOLVE_LOCAL": "1"}) == \
        "local:///tmp/kvb-q/local-1"
    assert await urimod.resolve(uri, env={"KVBROKER_URI_RESOLVE_LOCAL": ""}) == uri
    assert await urimod.resolve(".", env={"KVBROKER_URI": "/tmp/s/local-2"}) == \
        "local:///tmp/s/local-2"
    with pytest.raises(ValueError, match="expected ssh://"):
        await asyncio.wait_for(urimod.resolve("ssh://node1"), 5)


@pytest.mark.no_forkserver  # (the ranks found under kvbroker start)
async def test_wait_for_an_instance_starting(tmp_path: Path) -> None:
    """``uri --wait pid:START`` right after ``kvbroker start`` went to the
    background: rank 0's URI, once every rank is up (overlay full at
    once, and the URI is the one start printed); a start that fails (a
    bad option) is said, exit 1, not waited on for ever."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "--size", "4", "--fanout", "2", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL, stdin=asyncio.subprocess.DEVNULL)
    try:
        uri = await cli("uri", "--wait", f"pid:{proc.pid}")
        assert await cli("overlay", "status", "--summary", uri=uri) == "full"
        assert proc.stdout is not None
        printed = (await asyncio.wait_for(proc.stdout.readline(), T)).decode().strip()
        assert uri == printed and uri.endswith("/local-0")
        assert await cli("uri", f"pid:{proc.pid}?wait&remote") == \
            f"ssh://{HOST}{uri.removeprefix('local://')}"
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), T)
    bad = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "--size", "2", "--fanout", "0",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        err = await cli("uri", "--wait", f"pid:{bad.pid}", rc=1)
        assert err in (f"kvbroker: uri: pid:{bad.pid}: it exited before its instance was up",
                       f"kvbroker: uri: pid:{bad.pid}: no such process"), err
    finally:
        await asyncio.wait_for(bad.wait(), T)
