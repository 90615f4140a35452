"""flux-core t3304-system-rpctrack-down, t3305-system-rpctrack-up and
t3306-system-routercrash, as kvbroker has them (real ranks, unix links,
size 3 at fanout 1: 0 -> 1 -> 2, Flux's ``kary:1``).

* Down: a request in flight to a rank that stops -- cleanly (SIGTERM) or
  killed -- is answered EHOSTUNREACH by the rank above it, and so is every
  new one; the parent owes nothing afterwards (Flux's ``child-rpc`` count,
  our ``sent-down``).  (SIGKILL of the target and of a router on the way is
  in tests/test_broker_lifecycle.py, every transport.)
* Up: a client of rank 2 with a request in flight to rank 0 when its router
  (rank 1) is cut off (``overlay disconnect``): Flux lets it fail with
  EHOSTUNREACH or ECONNRESET; here rank 2 stops with its parent, so
  ECONNRESET, at once.
* Router crash (SIGSEGV, not trapped: the status says the signal): its
  child stops by itself (status 1; in Flux it lingers until the restarted
  router refuses it -- either way it restarts after its router); the
  router restarted, then the leaf, both rejoin and serve."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
from pathlib import Path

import pytest
from test_broker_support import run_cli, stats, wait_until
from test_overlay_faults import start_rank

from broker.errors import RemoteError

NEVER = {"namespace": "primary", "rootseq": 10**9}  # a version wait that never ends


async def test_requests_to_a_rank_that_stops_are_answered_ehostunreach(
        start_instance, connect) -> None:
    inst = await start_instance(size=3, fanout=1)
    h = await connect(inst, 0)
    async with asyncio.timeout(60):
        waiting = h.rpc("kvs.wait-version", NEVER, nodeid=2)

        async def owed(rank: int, n: int) -> bool:
            return bool((await stats(h, rank))["sent-down"] == n)

        await wait_until(lambda: owed(1, 1), "rank 1 to forward the wait to rank 2")
        inst.procs[2].send_signal(signal.SIGTERM)  # nicely
        assert await inst.procs[2].wait() == 0
        with pytest.raises(RemoteError) as info:
            await waiting
        assert info.value.errnum == errno.EHOSTUNREACH
        with pytest.raises(RemoteError) as info:
            await h.ping(2)
        assert info.value.errnum == errno.EHOSTUNREACH
        assert (await stats(h, 1))["sent-down"] == 0

        waiting = h.rpc("kvs.wait-version", NEVER, nodeid=1)
        await wait_until(lambda: owed(0, 1), "rank 0 to forward the wait to rank 1")
        inst.procs[1].kill()  # hard
        with pytest.raises(RemoteError) as info:
            await waiting
        assert (info.value.errnum, info.value.errstr) == (
            errno.EHOSTUNREACH, "rank 1 was lost before answering")
        rc, out, err = await run_cli("ping", "1", uri=inst.uri(0))
        assert (rc, out) == (1, "") and err.startswith(  # (as rank 0 saw it go)
            "kvbroker: ping: No route to host (rank 1 was lost: "), err
        assert (await stats(h, 0))["sent-down"] == 0
        assert (await h.ping(0))["rank"] == 0  # rank 0's client goes on


async def test_a_request_up_through_a_router_cut_off_fails_at_once(
        start_instance, connect) -> None:
    inst = await start_instance(size=3, fanout=1)
    h0 = await connect(inst, 0)
    h2 = await connect(inst, 2)
    async with asyncio.timeout(60):
        waiting = h2.rpc("kvs.wait-version", NEVER, nodeid=0)
        await h2.ping(0)  # (the wait went up before the ping came back)
        rc, out, err = await run_cli("overlay", "disconnect", "1", uri=inst.uri(0))
        assert (rc, out) == (0, "asking rank 0 to disconnect child rank 1\n"), err
        with pytest.raises(RemoteError) as info:
            await waiting
        assert info.value.errnum == errno.ECONNRESET
        assert [await inst.procs[r].wait() for r in (1, 2)] == [1, 1]
        assert (await stats(h0, 0))["sent-down"] == 0
        rc, out, _ = await run_cli("overlay", "status", uri=inst.uri(0))
        host = socket.gethostname()
        assert (rc, out.splitlines()[1:]) == (1, [
            f"  1 {host}: lost (disconnected: kvbroker overlay disconnect, by uid "
            f"{os.getuid()})", f"    2 {host}: lost (rank 1 was lost: disconnected: kvbroker "
            f"overlay disconnect, by uid {os.getuid()})"])


async def test_a_crashed_router_and_its_leaf_restart_and_serve(
        start_instance, connect, tmp_path: Path) -> None:
    inst = await start_instance(size=3, fanout=1)
    h = await connect(inst, 0)
    host = socket.gethostname()
    again: list[asyncio.subprocess.Process] = []
    try:
        async with asyncio.timeout(90):
            inst.procs[1].send_signal(signal.SIGSEGV)
            assert [await inst.procs[r].wait() for r in (1, 2)] == [-signal.SIGSEGV, 1]

            async def children(rank: int, want: list[int]) -> bool:
                return bool((await stats(h, rank))["overlay"]["children"] == want)

            await wait_until(lambda: children(0, []), "rank 0 to lose rank 1")
            again.append(await start_rank(inst, 1, tmp_path / "rank1-again.log"))
            await wait_until(lambda: children(0, [1]), "rank 1 to rejoin", 30)
            rc, out, _ = await run_cli("overlay", "status", uri=inst.uri(0))
            lines = out.splitlines()
            assert rc == 1 and lines[1].startswith(f"  1 {host}: partial (restarted "), out
            assert lines[2] == f"    2 {host}: offline (not joined since rank 1 started)", out

            again.append(await start_rank(inst, 2, tmp_path / "rank2-again.log"))
            await wait_until(lambda: children(1, [2]), "rank 2 to rejoin", 30)
            rc, out, err = await run_cli("overlay", "status", uri=inst.uri(0))
            assert rc == 0, (out, err)
            assert (await h.ping(2))["route"] == ["c1", "r0", "r1", "r2"]
            rc, _, err = await run_cli("kvs", "put", "after=crash", uri=inst.uri(0))
            assert rc == 0, err
            rc, out, err = await run_cli("kvs", "get", "--waitcreate", "after",
                                         uri=inst.uri(2))
            assert (rc, out) == (0, "crash\n"), err
    finally:
        for proc in again:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
