"""flux-core t3307-system-leafcrash, as kvbroker has it: a leaf rank killed
hard (SIGKILL: no goodbye to its parent) and started again, by hand, as an
operator or a supervisor would (real ranks, an ``Instance`` from Python,
which keeps serving when a rank dies; ``kvbroker start`` would stop).

Flux's cases, in order, and what each is here:

* *start overlay status wait in the background* (``--wait degraded``, a
  state of rank 1 seen from rank 0): kvbroker's ``--wait`` is about rank 0
  only (docs/cli.md, overlay status), so the waiter is ``overlay status
  --wait partial``, started while the instance is full; it returns once
  rank 0 has lost rank 1, showing it *lost*.
* *kill -9 broker 1* (status 137 from ``startctl wait``): SIGKILL; the
  process's status is -9 here (an ``asyncio`` process, not a shell).
* *restart broker 1*: another process of rank 1 with the same options
  (as ``test_overlay_faults.start_rank``).
* *ensure child was lost*: the waiter returned, rank 1 *lost*; besides,
  what was in flight to rank 1 when it died is answered ``EHOSTUNREACH``
  (Flux's reason for going through lost: fail the pending RPCs), and rank
  0's log says the loss and the rejoin.
* *and child returned to service*: ``overlay status --wait full`` exits 0,
  rank 1 *full (restarted ...)*.
* *run a 2 node job*: ``exec -r all`` runs a command on both ranks, and a
  KVS value written on rank 0 is read on the new rank 1.

Flux's point -- the new process says hello while its parent may still
hold the old one's connection -- is the ``tcp`` case below: killed and
started again at once, before ZeroMQ's heartbeats (10 s) could tell rank
0 the old link is dead.  Over unix links the parent sees the close at
once.  (A frozen rank replaced while its link looks alive, and
``overlay status``'s ``restarted`` counts, over tcp across "hosts": in
tests/test_multihost.py, ``..._takes_its_place`` and
``test_overlay_status_shows_a_restarted_and_a_replaced_rank``.)
"""

from __future__ import annotations

import asyncio
import errno
import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import KVBROKER, run_cli, stats, wait_until
from test_overlay_faults import start_rank

from broker.errors import RemoteError

NEVER = {"namespace": "primary", "rootseq": 10**9}  # a version wait that never ends


async def rank_1_owes(h: Any) -> None:
    """Until rank 0 has sent a request down to rank 1 (``sent-down``)."""
    async def owed() -> bool:
        return bool((await stats(h, 0))["sent-down"] == 1)

    await wait_until(owed, "rank 0 to send the wait down to rank 1")


async def stop_rank(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def test_a_leaf_killed_hard_goes_through_lost_and_returns_to_service(
        start_instance, connect, tmp_path: Path) -> None:
    inst = await start_instance(size=2, fanout=2)
    h = await connect(inst, 0)
    host = socket.gethostname()
    uri = inst.uri(0)
    again: asyncio.subprocess.Process | None = None
    try:
        async with asyncio.timeout(60):
            rc, out, err = await run_cli("overlay", "status", "--summary", uri=uri)
            assert (rc, out) == (0, "full\n"), err
            waiter = asyncio.ensure_future(
                run_cli("overlay", "status", "--wait", "partial", uri=uri))
            waiting = h.rpc("kvs.wait-version", NEVER, nodeid=1)
            await rank_1_owes(h)
            inst.procs[1].kill()
            assert await inst.procs[1].wait() == -signal.SIGKILL
            with pytest.raises(RemoteError) as info:
                await waiting
            assert info.value.errnum == errno.EHOSTUNREACH
            rc, out, err = await waiter  # the child was lost
            lines = out.splitlines()
            assert (rc, lines[0]) == (1, f"0 {host}: partial"), err
            # (closed, or reset: the request sent down may have been unread)
            assert len(lines) == 2 and re.fullmatch(
                rf"  1 {re.escape(host)}: lost \(its connection (closed|failed: .*)\)",
                lines[1]), out

            again = await start_rank(inst, 1, tmp_path / "rank1-again.log")
            rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "30",
                                         uri=uri)
            assert rc == 0, (out, err)
            lines = out.splitlines()
            assert lines[0] == f"0 {host}: full", out
            assert lines[1].startswith(f"  1 {host}: full (restarted "), out
            assert (await stats(h, 0))["sent-down"] == 0

            # a job on both ranks
            rc, out, err = await run_cli("exec", "-r", "all", "--", KVBROKER, "attr", "get",
                                         "rank", uri=uri)
            assert (rc, sorted(out.split())) == (0, ["0", "1"]), err
            rc, _, err = await run_cli("kvs", "put", "job=both", uri=uri)
            assert rc == 0, err
            rc, out, err = await run_cli("kvs", "get", "--waitcreate", "job",
                                         uri=inst.uri(1))
            assert (rc, out) == (0, "both\n"), err
            rc, out, err = await run_cli("dmesg", uri=uri)
            assert rc == 0, err
            assert "lost child rank 1 unexpectedly" in out, out
            assert "child rank 1 on " in out and "rejoined" in out, out
    finally:
        if again is not None:
            await stop_rank(again)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
async def test_a_leaf_restarted_before_its_parent_noticed_is_admitted(
        start_instance, connect, tmp_path: Path, transport: str) -> None:
    """Killed and started again at once over ZeroMQ links: rank 0 may still
    hold the old process's link when the new one's hello comes.  The new
    one is admitted, what was in flight to the old one is answered
    EHOSTUNREACH (not left waiting for a process that is gone), and the new
    rank serves."""
    inst = await start_instance(size=2, fanout=2, attrs={"tbon.transport": transport})
    h = await connect(inst, 0)
    again: asyncio.subprocess.Process | None = None
    try:
        async with asyncio.timeout(60):
            waiting = h.rpc("kvs.wait-version", NEVER, nodeid=1)
            await rank_1_owes(h)
            inst.procs[1].kill()
            assert await inst.procs[1].wait() == -signal.SIGKILL
            again = await start_rank(inst, 1, tmp_path / "rank1-again.log")
            with pytest.raises(RemoteError) as info:
                await waiting
            assert info.value.errnum == errno.EHOSTUNREACH
            rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "30",
                                         uri=inst.uri(0))
            assert rc == 0, (out, err)
            assert "restarted" in out.splitlines()[1], out
            seen = (await stats(h, 0))["overlay"]["rejoined"]
            assert seen["1"]["times"] == 1, seen
            assert (await h.ping(1))["route"] == ["c1", "r0", "r1"]
            rc, out, err = await run_cli("exec", "-r", "1", "--", KVBROKER, "attr", "get",
                                         "broker.pid", uri=inst.uri(0))
            assert (rc, out) == (0, f"{again.pid}\n"), err
    finally:
        if again is not None:
            await stop_rank(again)
