"""The Python APIs of background commands (broker.sproc_client: Procs,
SyncProcs) and of cron (broker.cron_client: Cron, SyncCron), end to end
on a real 2-rank instance: what ``kvbroker exec --bg``, ``sproc`` and
``cron`` are built on, used as a script would."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import errno
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import pid_alive
from test_broker_support import wait_until

from broker.cron_client import Cron, SyncCron
from broker.errors import RemoteError
from broker.sproc_client import Proc, Procs, StartError, SyncProcs
from broker.sync import connect as sync_connect

MODULES = {"broker.modules": "content,kvs,kvs-watch,cron"}
T = 20.0


async def refused(aw: Awaitable[Any], errnum: int, text: str = "") -> RemoteError:
    with pytest.raises(RemoteError) as info:
        await aw
    assert info.value.errnum == errnum, info.value
    assert text in str(info.value)
    return info.value


async def test_procs_start_list_kill_wait(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    procs = Procs(await connect(inst, 0))
    pids = await procs.start(["sleep", "59.25"], ranks="all", waitable=True, label="api-s")
    assert sorted(pids) == [0, 1]
    listed = await procs.list(rank=1)
    assert listed == [Proc(rank=1, pid=pids[1], state="R", label="api-s",
                           cmd=("sleep", "59.25"), bg=True, waitable=True, mine=True)]
    assert [(p.rank, p.pid, p.running) for p in await procs.list()] == [(0, pids[0], True)]

    # the wait is sent first: it finds the command however soon the kill ends it
    waiting = procs.wait("api-s", rank=1)
    await procs.kill("api-s", rank=1)
    result = await waiting
    assert (result.status, result.code, result.signal) == (-signal.SIGTERM, 143, 15)
    await procs.kill(pids[0], signal.SIGKILL)  # (by pid, on the rank attached to)
    assert (await procs.wait(pids[0])).code == 137
    assert await procs.list(rank=1) == [] and await procs.list() == []

    # its output, kept by the rank; the status of a command that exits itself
    pid = await procs.start_one(["sh", "-c", "echo out-$KVBROKER_RANK; echo err >&2; exit 3"],
                                rank=1, waitable=True)
    result = await procs.wait(pid, rank=1, output=True)
    assert (result.code, result.signal, result.stdout, result.stderr) == (
        3, None, b"out-1\n", b"err\n")
    assert result.stdout_dropped == result.stderr_dropped == 0

    # errors are the rank's
    await refused(procs.wait(pid, rank=1), errno.ESRCH, "does not belong")  # (collected)
    await refused(procs.kill(2**22 + 7), errno.ESRCH)
    await refused(procs.kill("no-such-label", rank=1), errno.ESRCH)
    plain = await procs.start_one(["sleep", "58.5"], rank=1, label="api-plain")
    await refused(procs.wait("api-plain", rank=1), errno.EINVAL, "not waitable")
    with pytest.raises(StartError) as info:  # (rank 1 has the label: rank 0 starts it)
        await procs.start(["sleep", "58.25"], ranks=[0, 1], label="api-plain")
    assert info.value.errnum == errno.EEXIST and isinstance(info.value, RemoteError)
    assert list(info.value.errors) == [1] and list(info.value.started) == [0]
    await procs.kill(info.value.started[0])
    await procs.kill(plain, rank=1)
    with pytest.raises(StartError) as info:
        await procs.start(["no-such-command-api"], ranks="0-1")
    assert info.value.errnum == errno.ENOENT and sorted(info.value.errors) == [0, 1]
    assert info.value.started == {} and "rank 0: " in str(info.value)
    with pytest.raises(TypeError):
        await procs.start_one("sleep 1")  # type: ignore[arg-type]  # (words, not a line)

    def blocking() -> None:
        with sync_connect(inst.uri(1), timeout=10) as sh:
            sp = SyncProcs(sh)
            sp.start_one(["sh", "-c", "exit 4"], waitable=True, label="api-sync")
            assert sp.wait("api-sync", timeout=10).code == 4
            assert sp.list() == []

    await asyncio.to_thread(blocking)


async def test_a_wait_given_up_on_leaves_the_command_to_a_later_wait(
        start_instance, connect) -> None:
    """A wait given up on -- its ``timeout`` passed, its future cancelled
    (a ``wait_for`` around it) -- is ended on the rank too, so the command
    and its status stay for the next wait (the client-API audit: a retry
    was ``EBUSY``, and once the command ended its status went to the
    abandoned wait and the next was ``ESRCH``); another client cannot
    cancel someone else's wait."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    procs = Procs(h)
    await procs.start_one(["sleep", "57.75"], rank=1, waitable=True, label="api-w")
    for _ in range(2):  # (the retry finds no wait in its way)
        with pytest.raises(TimeoutError, match="not ended within 0.05s"):
            await procs.wait("api-w", rank=1, timeout=0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(procs.wait("api-w", rank=1), 0.05)  # (cancelled here)
    given_up = procs.wait("api-w", rank=1)
    given_up.cancel()
    # (the cancels reach rank 1 before this wait: one path, in order)
    waiting = procs.wait("api-w", rank=1)
    other = await connect(inst, 0)
    await refused(Procs(other).wait("api-w", rank=1), errno.EBUSY, "already being waited")
    other.send_noresponse("rexec.wait-cancel", {"matchtag": 1}, nodeid=1)  # (not its wait)
    await procs.kill("api-w", signal.SIGKILL, rank=1)
    assert (await asyncio.wait_for(waiting, T)).code == 137
    stats = await h.rpc("rexec.stats-get", nodeid=1)
    assert stats["zombies"] == 0 and stats["waited"] == 1

    def blocking() -> None:  # (the same through the blocking facade)
        with sync_connect(inst.uri(1), timeout=10) as sh:
            sp = SyncProcs(sh)
            sp.start_one(["sleep", "57.5"], waitable=True, label="api-sw")
            with pytest.raises(TimeoutError):
                sp.wait("api-sw", timeout=0.05)
            sp.kill("api-sw", signal.SIGKILL)
            assert sp.wait("api-sw", timeout=10).code == 137

    await asyncio.to_thread(blocking)
    assert h.retired == 0  # (each wait given up on was answered ECANCELED or ETIMEDOUT)


async def test_cron_entries(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs=MODULES)
    h = await connect(inst, 0)
    cron = Cron(h)

    async def where(eid: int, check: Callable[[dict[str, Any]], bool], what: str,
                    rank: int | None = None) -> dict[str, Any]:
        found: dict[str, Any] = {}

        async def holds() -> bool:
            found["e"] = await cron.get(eid, rank=rank)
            return check(found["e"])

        await wait_until(holds, what, timeout=4)
        return found["e"]

    # interval: runs `count` times on rank 1, then stops
    tick = await cron.interval("true", 0.05, count=3, rank=1, name="tick")
    assert (tick["type"], tick["name"], tick["rank"], tick["repeat"]) == (
        "interval", "tick", 1, 3)
    e = await where(tick["id"], lambda e: e["stopped"] and e["tasks"][0]["state"] == "Exited",
                    "3 runs, then stopped", rank=1)
    assert e["stats"]["count"] == 3

    # event: every 2nd event of the topic runs it (on the rank attached to)
    ev = await cron.event(["sh", "-c", "exit 0"], "t.api.ev", nth=2)
    assert ev["command"] == "sh -c 'exit 0'" and ev["typedata"]["topic"] == "t.api.ev"
    for runs in (1, 2):
        await h.publish("t.api.ev")
        await h.publish("t.api.ev")
        await where(ev["id"], lambda e, n=runs: e["stats"]["count"] == n
                    and e["tasks"][0]["state"] == "Exited", f"{runs} event runs")

    # at: a datetime (local), past: runs at once, once
    at = await cron.at("true", dt.datetime.now() - dt.timedelta(seconds=1), name="once")
    assert abs(at["typedata"]["at"] - (dt.datetime.now().timestamp() - 1)) < 5
    await where(at["id"], lambda e: e["stats"]["count"] == 1 and e["stopped"], "the at run")

    # tab: stop, start
    tab = await cron.tab("true", "@hourly", rank=1, timeout="2s")
    assert tab["typedata"]["schedule"] == "@hourly" and tab["timeout"] == 2.0
    assert (await cron.stop(tab["id"], rank=1))["state"] == "stopped"
    await refused(cron.stop(tab["id"], rank=1), errno.EINVAL, "stopped already")
    assert (await cron.start(tab["id"], rank=1))["state"] == "active"
    assert [e["id"] for e in await cron.list(rank=1)] == [tick["id"], tab["id"]]

    # delete --kill: the running task is terminated, then the entry goes
    long = await cron.interval(["sleep", "57.5"], 3600, after=0, rank=1)
    e = await where(long["id"], lambda e: bool(e["tasks"])
                    and e["tasks"][0]["state"] == "Running", "the task running", rank=1)
    pid = e["tasks"][0]["pid"]
    # (deleted, its task left to end, then deleted again: counted once, and
    # the second may kill it -- every call counted, 8 for 6 entries)
    deleted = (await h.rpc("cron.stats-get", {}, nodeid=1))["deleted"]
    for _ in range(2):
        assert (await cron.delete(long["id"], rank=1))["id"] == long["id"]
    assert (await h.rpc("cron.stats-get", {}, nodeid=1))["deleted"] == deleted + 1
    assert pid_alive(pid)
    assert (await cron.delete(long["id"], kill=True, rank=1))["id"] == long["id"]

    async def gone() -> bool:
        return not pid_alive(pid) and long["id"] not in [
            e["id"] for e in await cron.list(rank=1)]

    await wait_until(gone, "the task killed and its entry gone", timeout=4)

    # errors
    await refused(cron.get(9999), errno.ENOENT, "no cron entry 9999 on rank 0")
    await refused(cron.delete(9999, rank=1), errno.ENOENT)
    await refused(cron.interval("true", 0.001), errno.EINVAL, "busy loop")
    await refused(cron.tab("true", "61 * * * *"), errno.EINVAL, "out of range")
    with pytest.raises(ValueError):
        await cron.interval("true", "soon")

    def blocking() -> None:
        with sync_connect(inst.uri(1), timeout=10) as sh:
            sc = SyncCron(sh)
            assert [e["id"] for e in sc.list()] == [tick["id"], tab["id"]]
            assert sc.delete(tab["id"])["name"] == "true"
            assert sc.sync()["sync_disabled"] is True

    await asyncio.to_thread(blocking)


def fd_count(pid: int) -> int:
    """The open file descriptors of process ``pid`` (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def pipe_count(pid: int) -> int:
    """The pipes process ``pid`` holds open (Linux)."""
    n = 0
    for f in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{f}").startswith("pipe:")
    return n


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, zombies included (Linux)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(entry))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="counts a rank's fds in /proc")
@pytest.mark.both_loops
async def test_cron_reloaded_as_its_tasks_start_leaves_no_fds(start_instance, connect) -> None:
    """``module reload cron`` sent right behind 20 entries whose tasks start
    at once (``at`` a time past), 8 times: the module stops as its tasks
    have just started, most before their output pipe was handed to the
    rank's loop, a few while it was.  By the time the reload is answered
    every such pipe is closed -- not left to the garbage collector, and a
    hand-over cancelled midway leaves no second owner of the descriptor
    (tests/test_pipes.py) --, then every task is found killed, and another
    client of the rank is unharmed."""
    k, rounds = 20, 8
    inst = await start_instance(size=2, attrs=MODULES)
    h = await connect(inst, 1)
    rank1 = inst.pids()[1]
    before = fd_count(rank1)
    before_pipes = pipe_count(rank1)
    for _ in range(rounds):
        created = [h.rpc("cron.create", {"type": "at", "command": "sleep 53.25",
                                          "args": {"at": 0}}) for _ in range(k)]
        reload = h.rpc("module.reload", {"name": "cron"})
        await asyncio.wait_for(asyncio.gather(*created, reload), T)
        assert pipe_count(rank1) == before_pipes, "the old module's tasks left pipes open"
        assert (await h.rpc("cron.list"))["entries"] == []  # (a new module's)

    async def settled() -> bool:
        return not children(rank1) and fd_count(rank1) <= before + 4

    await wait_until(settled, "rank 1's tasks killed and its fds back to what they were",
                     timeout=T)
    assert h.connected and (await h.ping(1))["rank"] == 1


def test_a_sproc_target_past_any_pid_is_a_usage_error() -> None:
    """A number msgpack cannot carry was a traceback ("not msgpack-able")."""
    from broker.cliutil import UsageError
    from broker.sproc_cli import MAX_PID, target

    assert target(str(MAX_PID)) == MAX_PID and target("job-1") == "job-1"
    with pytest.raises(UsageError, match="not a pid"):
        target("99999999999999999999999")
