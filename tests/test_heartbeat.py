"""The ``heartbeat`` module (Flux's, t1107): rank 0's ``heartbeat.pulse``
every ``heartbeat.period``, counted on every rank, and a rank that stops
hearing it says so in its log."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
from test_broker_guests import run_guest_cli
from test_broker_support import run_cli, stop_process

from broker.handle import Handle

MODULES = {"broker.modules": "content,kvs,kvs-watch,heartbeat"}


async def hb_stats(h: Handle, rank: int) -> dict[str, Any]:
    return await asyncio.wait_for(h.rpc("heartbeat.stats-get", {}, nodeid=rank), 15)


async def test_rank_0_beats_and_every_rank_hears_it(start_instance, connect) -> None:
    inst = await start_instance(size=3, fanout=1,
                                attrs={**MODULES, "heartbeat.period": "100ms"})
    h2 = await connect(inst, 2)
    await h2.subscribe("heartbeat.pulse")
    async with asyncio.timeout(30):
        seqs = [(await h2.recv_event()).seq for _ in range(3)]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3
    s0, s2 = await hb_stats(h2, 0), await hb_stats(h2, 2)
    assert (s0["period"], s0["warn_thresh"], s0["rank"]) == (0.1, 3, 0)
    assert s0["count"] >= 3 and s2["count"] >= 2, (s0, s2)
    assert s2["overdue"] is False and s2["events"]["subscribe_calls"] == 1
    assert s2["events"]["handled"] == s2["count"]
    # (its attributes, defaults included, are readable where it is loaded)
    assert await h2.attr_get("heartbeat.warn_thresh", nodeid=2) == "3"
    assert await h2.attr_get("heartbeat.period", nodeid=0) == "100ms"
    rc, out, err = await run_cli("stats", "heartbeat", "-p", "period", uri=inst.uri(1))
    assert (rc, out, err) == (0, "0.1\n", "")


async def test_a_rank_that_stops_hearing_the_beat_says_so(start_instance, connect) -> None:
    """Rank 0 stopped (SIGSTOP): rank 1 logs ``heartbeat overdue`` after
    ``warn_thresh`` periods, once, and ``heartbeat received`` when it beats
    again (as t1107's dmesg check)."""
    inst = await start_instance(size=2, attrs={
        **MODULES, "heartbeat.period": "50ms", "heartbeat.warn_thresh": "4"})
    h1 = await connect(inst, 1)
    log = h1.rpc_stream("log.dmesg", {"follow": True}, nodeid=1)
    rank0 = inst.pids()[0]
    await stop_process(rank0)
    try:
        async with asyncio.timeout(30):
            async for entry in log:
                if "heartbeat" in entry["message"]:
                    break
        assert entry["level"] == "warning", entry
        assert entry["message"].startswith("heartbeat overdue: none from rank 0 for "), entry
        assert (await hb_stats(h1, 1))["overdue"] is True
    finally:
        os.kill(rank0, signal.SIGCONT)
    async with asyncio.timeout(30):
        async for entry in log:
            if "heartbeat" in entry["message"]:
                break
    assert (entry["level"], entry["message"]) == ("warning", "heartbeat received")
    assert (await hb_stats(h1, 1))["overdue"] is False


@pytest.mark.parametrize(("attr", "value", "why"), [
    ("heartbeat.period", "zzz", "'zzz' is not a duration"),
    ("heartbeat.period", "1ms", "under 0.01s"),
    ("heartbeat.warn_thresh", "0", "heartbeat.warn_thresh"),
    # Flux's timeout: not built, and said so (it met "did you mean heartbeat.period?")
    ("heartbeat.timeout", "1m", "not built here: a silent rank is marked torpid"),
])
async def test_a_bad_setting_stops_the_start_with_why(tmp_path, attr: str, value: str,
                                                      why: str) -> None:
    rc, out, err = await run_cli("start", "-S", "broker.modules=content,kvs,heartbeat",
                                 "-S", f"{attr}={value}", "--", "true")
    assert rc != 0 and why in err, err


async def test_a_guest_may_not_publish_the_beat(start_instance) -> None:
    """``heartbeat.`` is the instance owner's, as ``kvs.`` is: a listener
    counts rank 0's beat, not a guest's forgery."""
    inst = await start_instance(size=1, attrs={"access.allow-guest-user": "true"})
    rc, out, err = await run_guest_cli(inst.uri(0), "event", "pub", "heartbeat.pulse")
    assert rc == 1 and "Operation not permitted" in err, err
    assert "only the instance owner may publish heartbeat.pulse" in err
