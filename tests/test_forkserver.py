"""The fork server (broker/forkserver.py): an instance's spawner forked from
a process that imported the broker once, indistinguishable to its ranks
from one executed anew; and every launcher it will not serve left to start
its own.  Each test starts a server of its own (the suite's, from
conftest, serves the other tests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_broker_lifecycle import processes_of
from test_broker_spawner import stat_of

from broker import forkserver
from broker.handle import Handle
from broker.launch import Instance

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open") or not os.path.isdir("/proc"),
                                reason="Linux's pidfds and /proc")

T = 30.0

PROBE = """\
import os, sys, tempfile
from typing import ClassVar

from broker.module import Module


class Probe(Module):
    name: ClassVar[str] = "probe"

    def handlers(self):
        return {"probe.where": self.where}

    def where(self, msg):
        mask = os.umask(0)
        os.umask(mask)
        self.h.respond(msg, {
            "cwd": os.getcwd(), "umask": mask, "env": os.environ.get("KVB_PROBE"),
            "tmpdir": tempfile.gettempdir(), "executable": sys.executable,
            "path0": sys.path[0], "pid": os.getpid(), "sid": os.getsid(0),
        })
"""


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[subprocess.Popen[bytes]]:
    """A fork server of this test's, in ``$KVBROKER_FORKSERVER``."""
    where = tmp_path / "fs"
    where.mkdir(mode=0o700)
    proc = forkserver.start_server(str(where / "sock"))
    monkeypatch.setenv(forkserver.FORKSERVER_ENV, str(where / "sock"))
    yield proc
    assert proc.stdin is not None
    if not proc.stdin.closed:
        proc.stdin.close()
    proc.wait(T)


def spawner_of(inst: Instance) -> int:
    """The pid of the process that forked ``inst``'s ranks."""
    return stat_of(inst.pids()[0])[1]


def parent_of(pid: int) -> int:
    return stat_of(pid)[1]


async def probe(inst: Instance) -> dict[str, Any]:
    async with Handle.connect(inst.uri(0)) as h:
        answer: dict[str, Any] = await asyncio.wait_for(h.rpc("probe.where", {}), T)
    return answer


async def test_a_served_spawner_is_the_servers_child_and_looks_executed(server) -> None:
    """The spawner is the server's child, shows ``python -m broker.spawner
    RUNDIR`` as an executed one does (``ps``, ``pgrep -f RUNDIR``), forks
    ranks that serve, and is reaped by the server when they end."""
    async with Instance(3, 2) as inst:
        spawner = spawner_of(inst)
        assert parent_of(spawner) == server.pid
        with open(f"/proc/{spawner}/cmdline", "rb") as f:
            argv = f.read().rstrip(b"\0").split(b"\0")
        assert argv == [os.fsencode(sys.executable), b"-P", b"-m", b"broker.spawner",
                        os.fsencode(inst.rundir)]
        assert sorted(processes_of(inst.rundir)) == sorted([spawner, *inst.pids()])
        async with Handle.connect(inst.uri(2)) as h:
            assert (await h.rpc("broker.ping", {}, nodeid=0))["rank"] == 0
    assert all(p.returncode == 0 for p in inst.procs)
    assert processes_of(inst.rundir) == []
    assert not os.path.exists(f"/proc/{spawner}")  # (reaped, not a zombie)


async def test_a_served_rank_sees_what_an_executed_one_does(
        server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's working directory, umask, environment (``$TMPDIR``
    too), interpreter name and its own session: a rank forked from the
    server sees each as a rank of a spawner executed from the launcher
    does -- the same answers, asked of both."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "work").mkdir()
    (tmp_path / "tmp").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setenv("KVB_PROBE", "from the launcher")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    attrs = {"broker.modules": f"content,{tmp_path / 'probe.py'}"}
    mask = os.umask(0o027)
    try:
        async with Instance(1, attrs=attrs) as served:
            assert parent_of(spawner_of(served)) == server.pid
            seen_served = await probe(served)
        monkeypatch.delenv(forkserver.FORKSERVER_ENV)
        async with Instance(1, attrs=attrs) as executed:
            assert parent_of(spawner_of(executed)) == os.getpid()
            seen_executed = await probe(executed)
    finally:
        os.umask(mask)
    for seen in (seen_served, seen_executed):
        assert seen.pop("pid") == seen.pop("sid")  # (each rank leads a session)
    assert seen_served == seen_executed
    assert seen_served["cwd"] == str(tmp_path / "work")
    assert seen_served["umask"] == 0o027
    assert seen_served["env"] == "from the launcher"
    assert seen_served["tmpdir"] == str(tmp_path / "tmp")


@pytest.mark.parametrize("change", ["PYTHONPATH", "rlimit", "signal ignored", "no server"])
async def test_a_launcher_the_server_cannot_serve_starts_its_own(
        server, change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher whose spawner would start otherwise than the server did
    (another ``$PYTHONPATH``, other resource limits, a signal ignored, as
    under ``nohup``), or with no server at the path given, gets a spawner
    of its own, and its instance serves."""
    core = resource.getrlimit(resource.RLIMIT_CORE)
    hup = signal.getsignal(signal.SIGHUP)
    if change == "PYTHONPATH":
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    elif change == "rlimit":
        resource.setrlimit(resource.RLIMIT_CORE, (0 if core[0] else 1, core[1]))
    elif change == "signal ignored":
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    else:
        monkeypatch.setenv(forkserver.FORKSERVER_ENV, str(tmp_path / "nothing-here"))
    try:
        async with Instance(2, 2) as inst:
            assert parent_of(spawner_of(inst)) == os.getpid()
            async with Handle.connect(inst.uri(1)) as h:
                assert (await h.rpc("broker.ping", {}, nodeid=0))["rank"] == 0
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, core)
        signal.signal(signal.SIGHUP, hup)
    assert all(p.returncode == 0 for p in inst.procs)
    assert server.poll() is None  # (and the server serves on)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv(forkserver.FORKSERVER_ENV, server.args[4])
    async with Instance(1) as inst:
        assert parent_of(spawner_of(inst)) == server.pid


def _raw_request(path: str, body: bytes, fds: list[int]) -> bytes:
    """Send ``body`` (with its length) and ``fds`` as a launcher would, and
    read the server's first answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(T)
        sock.connect(path)
        socket.send_fds(sock, [struct.pack("!I", len(body)) + body], fds)
        return sock.recv(4096)


@pytest.mark.parametrize("body, fds, answer", [
    (b"not json", 3, b"no Expecting value"),
    (b"[1, 2]", 3, b"no a malformed request"),
    (json.dumps({"fds": [7, 8]}).encode(), 3, b"no a malformed request"),
    (json.dumps({"fds": []}).encode(), 3, b"no a malformed request"),
    (json.dumps({"fds": [1], "env": {}, "spec": {}, "umask": 0, "python": "p",
                 "rundir": "r"}).encode(), 4, b"no a malformed request"),
    (json.dumps({"fds": [], "env": {}, "spec": {}, "umask": 0, "python": "/bin/true",
                 "rundir": "r"}).encode(), 3, b"no another interpreter"),
])
async def test_a_malformed_request_is_answered_and_the_server_serves_on(
        server, body: bytes, fds: int, answer: bytes) -> None:
    """Garbage, a request whose descriptors do not match its ``fds``, one
    missing a field or placing a descriptor over a standard stream, or one
    from another interpreter: each is answered ``no REASON`` and its
    descriptors closed, nothing forked; the next launcher is served."""
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        got = await asyncio.to_thread(_raw_request, server.args[4], body, [null] * fds)
    finally:
        os.close(null)
    assert got.startswith(answer), got
    async with Instance(1) as inst:
        assert parent_of(spawner_of(inst)) == server.pid


_GUEST_ASKS = """
import os, json, socket, struct, sys
path = sys.argv[1]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
os.setgroups([]); os.setgid(65534); os.setuid(65534)
sock.settimeout(30)
sock.connect(path)
body = json.dumps({"fds": [], "env": {}, "spec": {}, "umask": 0, "python": sys.executable,
                   "rundir": "/"}).encode()
fd = os.open("/", os.O_RDONLY)
socket.send_fds(sock, [struct.pack("!I", len(body)) + body], [fd, 1, 2])
print(sock.recv(100).decode().strip())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
async def test_another_user_is_refused_on_the_kernels_word() -> None:
    """A process of another user that can reach the socket (here it is
    opened to all) is refused, by the credentials the kernel gives
    (``SO_PEERCRED``), not by anything it says: its spawner would fork
    ranks as the server's user."""
    where = tempfile.mkdtemp(prefix="kvb-fs-open-")  # (pytest's tmp_path is private)
    try:
        path = os.path.join(where, "sock")
        server = forkserver.start_server(path)
        os.chmod(where, 0o755)
        os.chmod(path, 0o777)
        out = subprocess.run([sys.executable, "-c", _GUEST_ASKS, path], capture_output=True,
                             text=True, timeout=T)
        assert server.stdin is not None
        server.stdin.close()
        assert server.wait(T) == 0
    finally:
        shutil.rmtree(where)
    assert out.stdout.strip() == "no another user", out.stderr


async def test_the_spawners_exit_status_comes_from_the_server(server, tmp_path: Path) -> None:
    """The served spawner is not the launcher's child: the server reaps it
    and says how it ended -- 0 having forked nothing, 1 on a spec it could
    not read (its traceback on the launcher's standard error)."""
    err_path = tmp_path / "stderr"
    with open(err_path, "wb") as err:
        for spec, status in (({"ranks": []}, 0), ({"no ranks": []}, 1)):
            spawner = await forkserver.start_spawner(str(tmp_path), spec, [], dict(os.environ),
                                                     err)
            assert spawner is not None
            with contextlib.suppress(FileNotFoundError):  # (one that forks nothing
                # may be gone, reaped by the server, already: fresh-clone CI)
                assert parent_of(spawner.pid) == server.pid
            assert await asyncio.wait_for(spawner.wait(), T) == status
            assert spawner.returncode == status
            assert spawner.stdout is not None
            assert await asyncio.wait_for(spawner.stdout.read(), T) == b""
    assert "KeyError: 'ranks'" in err_path.read_text()


async def test_a_killed_served_spawner_says_so_and_takes_its_rank(server, tmp_path: Path) -> None:
    """A served spawner killed is reported killed (``-9``), as an executed
    one is by asyncio; and its rank dies with it, by the kernel's
    parent-death signal, while the launcher's watch pipe is still open (a
    rank forked but not yet reported had been left running until then)."""
    from broker.launch import _exited

    watch_r, watch_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        spec = {"keep": [watch_r], "ranks": [{"stdout": out_w, "argv": [
            "--rank", "0", "--size", "1", "--rundir", str(tmp_path), "--watch-fd", str(watch_r)]}]}
        spawner = await forkserver.start_spawner(str(tmp_path), spec, [watch_r, out_w],
                                                 dict(os.environ), None)
        assert spawner is not None and spawner.stdout is not None
        word, number, rank = (await asyncio.wait_for(spawner.stdout.readline(), T)).split()
        assert (word, number) == (b"pid", b"0")
        os.kill(spawner.pid, signal.SIGKILL)
        assert await asyncio.wait_for(spawner.wait(), T) == -signal.SIGKILL
        await asyncio.wait_for(_exited(int(rank)), T)
    finally:
        for fd in (watch_r, watch_w, out_r, out_w):
            os.close(fd)


async def test_spawners_outlive_a_server_whose_starter_went(server) -> None:
    """The server ends when its standard input closes (whoever started it
    is gone); an instance it served serves on, stops cleanly, and its
    spawner is reported killed, there being no one left to say otherwise."""
    async with Instance(2, 2) as inst:
        spawner = spawner_of(inst)
        assert parent_of(spawner) == server.pid
        assert server.stdin is not None
        server.stdin.close()
        assert await asyncio.to_thread(server.wait, T) == 0
        async with Handle.connect(inst.uri(1)) as h:
            assert (await h.rpc("broker.ping", {}, nodeid=0))["rank"] == 0
    assert all(p.returncode == 0 for p in inst.procs)
    assert processes_of(inst.rundir) == []
