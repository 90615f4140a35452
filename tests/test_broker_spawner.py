"""Ranks forked by one spawner per instance (broker/spawner.py), and the
one-interpreter-per-rank way kept beside it."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from test_broker_lifecycle import processes_of
from test_broker_support import install_plugin, run_python

from broker.handle import Handle
from broker.launch import Instance

# (of the spawner kvbroker start executes; tests/test_forkserver.py has the served one)
pytestmark = [pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc"),
              pytest.mark.no_forkserver]


def stat_of(pid: int) -> tuple[str, int, int]:
    """``(comm, parent pid, session id)`` of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    comm = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return comm, int(fields[1]), int(fields[3])


async def test_forked_ranks_are_processes_of_their_own_under_one_spawner() -> None:
    async with Instance(3, 2) as inst:
        assert inst.spawn == "fork"
        pids = inst.pids()
        assert len(set(pids)) == 3
        seen = [stat_of(pid) for pid in pids]
        assert [comm for comm, _, _ in seen] == ["kvbroker-r0", "kvbroker-r1", "kvbroker-r2"]
        assert len({parent for _, parent, _ in seen}) == 1  # the spawner
        spawner = seen[0][1]
        assert spawner != os.getpid()
        assert [sid for _, _, sid in seen] == pids  # each leads its own session
        with open(f"/proc/{spawner}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[1:4] == [b"-P", b"-m", b"broker.spawner"]
        async with Handle.connect(inst.uri(2)) as h:
            assert (await h.rpc("broker.ping", {}, nodeid=0))["rank"] == 0
            assert int(await h.attr_get("broker.pid")) == pids[2]
    assert inst.procs and all(p.returncode == 0 for p in inst.procs)
    assert processes_of(inst.rundir) == []  # the spawner too


async def test_a_forked_rank_killed_by_a_signal_says_which() -> None:
    async with Instance(2) as inst:
        inst.procs[1].send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(inst.procs[1].wait(), 30) == -signal.SIGKILL
        assert inst.procs[1].returncode == -signal.SIGKILL
        assert inst.failed is not None
        assert await asyncio.wait_for(inst.failed, 30) == (1, -signal.SIGKILL)


async def test_a_killed_spawner_takes_its_ranks_with_it() -> None:
    """The spawner is the ranks' parent and the only one who can say how
    they ended: gone, its ranks are killed and counted as killed, and
    nothing of the instance is left running."""
    inst = Instance(2)
    await asyncio.wait_for(inst.start(), 60)
    try:
        _, spawner, _ = stat_of(inst.pids()[0])
        os.kill(spawner, signal.SIGKILL)
        codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in inst.procs)), 30)
        assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    finally:
        await asyncio.wait_for(inst.stop(), 60)
    assert processes_of(inst.rundir) == []


@pytest.mark.parametrize("how", ["argument", "environment"])
async def test_exec_starts_each_rank_as_its_own_interpreter(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "environment":
        monkeypatch.setenv("KVBROKER_SPAWN", "exec")
    inst = Instance(2, spawn="exec" if how == "argument" else None)
    assert inst.spawn == "exec"
    async with inst:
        for rank, pid in enumerate(inst.pids()):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            assert argv[1:6] == [b"-P", b"-m", b"broker.rank", b"--rank", str(rank).encode()]
            assert stat_of(pid)[1] == os.getpid()
        async with Handle.connect(inst.uri(1)) as h:
            assert (await h.rpc("broker.ping", {}, nodeid=0))["rank"] == 0
    assert [p.returncode for p in inst.procs] == [0, 0]


def test_another_interpreter_is_exec_and_a_bad_spawn_is_refused() -> None:
    assert Instance(1, python="/usr/bin/python3-other").spawn == "exec"
    with pytest.raises(ValueError, match="spawn must be auto, fork or exec"):
        Instance(1, spawn="thread")


HANGING_IMPORT = """
import sys, time
from typing import ClassVar

from broker.module import Module

if sys.argv[0].endswith("spawner.py"):  # (the launcher imports it too, to check it)
    time.sleep(30)  # (a start not bounded by its timeout ends after it)


class Hang(Module):
    name: ClassVar[str] = "hang"
"""


_START_SCRIPT = """
import asyncio, subprocess, time
from broker.launch import Instance, StartError

async def main():
    inst = Instance(2, attrs={"broker.modules": "content,hang"})
    t = time.monotonic()
    try:
        await inst.start(timeout=2)
        print("started")
    except StartError as exc:
        print(exc, "in", round(time.monotonic() - t) < 30)
    left = subprocess.run(["pgrep", "-f", inst.rundir], capture_output=True, text=True)
    print("left:", left.stdout.split())

asyncio.run(main())
"""


async def test_a_spawner_that_hangs_is_bounded_by_the_starts_timeout(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module whose import blocks in the spawner (or a spawner stopped)
    held ``start()`` for as long as it hung: its timeout bounded only the
    wait for the ranks' ``ready``, and a Ctrl-C waited too.  The start now
    fails at its timeout, and the spawner is killed.  (In a process of its
    own, whose launcher sees the plugin, and so has the spawner preload it.)"""
    monkeypatch.setenv("PYTHONPATH", install_plugin(
        tmp_path, "hang-plugin", "[kvbroker.modules]\nhang = hangmod:Hang\n",
        {"hangmod.py": HANGING_IMPORT}))
    _, out, err = await run_python(_START_SCRIPT, timeout=60)
    assert out.splitlines() == ["instance of size 2 did not start in 2s (ranks 0-1 not "
                                "ready, and said no progress) in True",
                                "left: []"], err[-2000:]
