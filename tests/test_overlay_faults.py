"""Faults on the overlay seen from the rank that suffers them: a rank its
parent will not admit must say so and stop, not wait for ever."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from test_broker_support import stats, stopped

from broker.launch import Instance


async def start_rank(inst: Instance, rank: int, stderr: Path) -> asyncio.subprocess.Process:
    """Another process for ``rank`` of ``inst``, started as the launcher
    starts one (by hand, as an operator restarting a rank would), with the
    instance's CURVE key pair on tcp links (the launcher keeps it in the
    run directory)."""
    keys = os.path.join(inst.rundir, "curve.key")
    curve = ["--curve-keys", keys] if os.path.exists(keys) else []
    with open(stderr, "wb") as err:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.rank", "--rank", str(rank),
            "--size", str(inst.size), "--fanout", str(inst.fanout),
            "--rundir", inst.rundir, "--event-loop", inst.event_loop,
            "--attrs", json.dumps(inst.attrs), "--endpoints", json.dumps(inst.endpoints),
            *curve, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=err, start_new_session=True)


async def test_a_rank_its_parent_refuses_on_a_stream_link_exits_1(
        start_instance, connect, tmp_path: Path) -> None:
    """A stream parent refuses a second process of a connected rank (here
    the old rank 3 is frozen, its link open) by closing the connection.
    The newcomer waited for ever, silent: the link's closing before its
    hello was answered was taken for start-up noise.  It must log why and
    exit 1 (as a Flux broker whose hello is refused), and the old process,
    once resumed, is still rank 1's child and still reached on its local
    socket."""
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    log = tmp_path / "rank3-again.log"
    async with asyncio.timeout(30):
        async with stopped(inst.pids()[3]):
            proc = await start_rank(inst, 3, log)
            try:
                status = await asyncio.wait_for(proc.wait(), 15)
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
        assert status == 1
        text = log.read_text()
        assert "parent rank 1 closed this rank's link before answering its hello" in text
        assert "ERROR" in text
        assert (await stats(h, 1))["overlay"]["children"] == [3]
        assert (await h.ping(3))["route"] == ["c1", "r0", "r1", "r3"]
        # and keeps its local socket: the newcomer took the path over (and
        # removed it as it exited) before its parent had admitted it
        h3 = await connect(inst, 3)
        assert (await h3.ping())["rank"] == 3

