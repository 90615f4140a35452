"""Torpid children: a rank that hangs without closing its link is noticed
by its parent (``tbon.torpid_min`` / ``tbon.torpid_max``, docs/protocol.md)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli, stats, stop_process, stopped, wait_until

from broker import attrs as battrs
from broker.handle import Handle

TORPID_MIN, TORPID_MAX = 0.2, 1.0
FAST = {"tbon.torpid_min": str(TORPID_MIN), "tbon.torpid_max": str(TORPID_MAX),
        "log.level": "info"}


async def torpid(h: Handle, rank: int) -> dict[str, Any]:
    overlay: dict[str, Any] = (await stats(h, rank))["overlay"]
    return dict(overlay["torpid"])


async def stop_rank_3_until_marked(inst: Any, h: Handle) -> int:
    """SIGSTOP rank 3 (a child of rank 1 at fanout 2) and wait until rank 1
    marks it torpid; its pid (the caller sends SIGCONT)."""
    pid: int = inst.pids()[3]
    await stop_process(pid)

    async def marked() -> bool:
        return "3" in await torpid(h, 1)

    try:
        await wait_until(marked, "rank 1 to mark rank 3 torpid", 20)
    except BaseException:
        os.kill(pid, signal.SIGCONT)
        raise
    return pid


async def log_says(path: str, text: str) -> None:
    """Wait until the instance's log holds ``text`` (it is written by
    another process: the line may lag the state a client saw)."""

    async def there() -> bool:
        return text in Path(path).read_text()

    await wait_until(there, f"{text!r} in the log")


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_a_stopped_child_is_marked_torpid_then_responsive(
        start_instance, connect, transport: str) -> None:
    """SIGSTOP rank 3 (a child of rank 1 at fanout 2): its link stays open
    and, over tcp, ZeroMQ's heartbeats would take 10 s; rank 1 marks it
    torpid after ``torpid_max``, keeps it connected, and says when it is
    back after SIGCONT."""
    inst = await start_instance(size=4, fanout=2,
                                attrs={**FAST, "tbon.transport": transport})
    assert inst.stderr_path is not None
    h = await connect(inst, 0)
    pid = await stop_rank_3_until_marked(inst, h)
    try:
        silent = (await torpid(h, 1))["3"]
        assert silent >= TORPID_MAX - TORPID_MIN  # (seen_at: the check after its last message)
        overlay = (await stats(h, 1))["overlay"]
        assert overlay["children"] == [3]  # not disconnected
        await log_says(inst.stderr_path, "child rank 3 is torpid: nothing heard for")
        host = socket.gethostname()
        said: list[Any] = []

        async def shown() -> bool:
            # (-t 0.5: the ping of the stopped rank 3 takes it all, and ranks
            # 0 and 1 answer within it -- asked again if a loaded machine
            # kept one of them from it, then shown "no answer in 0.5s")
            said[:] = await run_cli("overlay", "status", "-t", "0.5", uri=inst.uri(0))
            lines = said[1].splitlines()
            return lines[:2] == [f"0 {host}: partial", f"  1 {host}: partial"] and \
                lines[2].startswith(f"    3 {host}: torpid (rank 1 ")

        with contextlib.suppress(AssertionError):  # (said below)
            await wait_until(shown, "rank 3 shown torpid by rank 1", 20)
        rc, out, err = said
        assert rc == 1, err
        lines = out.splitlines()
        assert lines[:2] == [f"0 {host}: partial", f"  1 {host}: partial"]
        assert lines[2].startswith(f"    3 {host}: torpid (rank 1 has heard nothing from it "
                                   "for ")
    finally:
        os.kill(pid, signal.SIGCONT)

    async def responsive() -> bool:
        return await torpid(h, 1) == {}

    await wait_until(responsive, "rank 3 to be responsive again", 20)
    await log_says(inst.stderr_path, "child rank 3 is responsive again")
    assert (await asyncio.wait_for(h.ping(3), 10))["rank"] == 3
    assert (await stats(h, 1))["overlay"]["children"] == [3]


async def test_torpid_attributes_changed_at_run_time_take_effect(
        start_instance, connect) -> None:
    """An instance started with the defaults (a child is torpid after 30 s)
    is told ``tbon.torpid_min`` 0.2 s and ``tbon.torpid_max`` 1 s with
    ``attr set --all``; a stopped rank is then marked torpid well before
    the 30 s it would have taken (the wait gives up at 20 s)."""
    inst = await start_instance(size=4, fanout=2, attrs={"log.level": "info"})
    assert inst.stderr_path is not None
    h = await connect(inst, 0)
    for name, value in (("tbon.torpid_min", TORPID_MIN), ("tbon.torpid_max", TORPID_MAX)):
        rc, _, err = await run_cli("attr", "set", name, str(value), "--all", uri=inst.uri(0))
        assert rc == 0, err
        for rank in range(4):
            assert float(await h.attr_get(name, nodeid=rank)) == value
    pid = await stop_rank_3_until_marked(inst, h)
    try:
        await log_says(inst.stderr_path, "(tbon.torpid_max 1 s)")
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_an_idle_healthy_instance_marks_no_one_torpid(start_instance, connect) -> None:
    """Idle ranks send nothing of their own: only their keepalives keep
    their parents from marking them torpid.  There is no event to wait for
    when nothing should happen, so this waits for a few ``torpid_max``
    periods (each check of every rank had its chance to mark a child), then
    checks that no parent marked anyone and no rank logged it."""
    inst = await start_instance(size=7, fanout=2, attrs=FAST)
    assert inst.stderr_path is not None
    h = await connect(inst, 0)
    parents = (0, 1, 2)
    for rank in parents:  # the attribute reached the ranks
        assert float(await h.attr_get("tbon.torpid_max", nodeid=rank)) == TORPID_MAX
    await asyncio.sleep(4 * TORPID_MAX)  # see the docstring: a negative check
    for rank in parents:
        assert await torpid(h, rank) == {}, rank
    assert "torpid" not in Path(inst.stderr_path).read_text()


def test_torpid_max_must_leave_room_for_keepalives() -> None:
    """An idle rank's keepalives may be up to twice ``torpid_min`` apart: a
    smaller ``torpid_max`` would mark healthy ranks torpid, so it is refused
    at start (0 turns the marking off)."""
    with pytest.raises(battrs.AttrError, match="tbon.torpid_max"):
        battrs.check({"tbon.torpid_min": "1", "tbon.torpid_max": "2"}, battrs.BROKER_ATTRS)
    with pytest.raises(battrs.AttrError, match="tbon.torpid_min"):
        battrs.check({"tbon.torpid_min": "0"}, battrs.BROKER_ATTRS)
    ok = battrs.check({"tbon.torpid_min": "1", "tbon.torpid_max": "0"}, battrs.BROKER_ATTRS)
    assert ok["tbon.torpid_max"] == 0
    assert battrs.check({}, battrs.BROKER_ATTRS)["tbon.torpid_max"] == 30


async def test_overlay_status_keeps_its_timeout_when_the_attached_rank_is_stopped(
        start_instance) -> None:
    """``overlay status -t`` is a health check: attached to a rank that is
    stopped (or hung) it waited for ever for that rank's size and fanout.
    It ends within its timeout now, exit 1, saying so."""
    inst = await start_instance(size=2, fanout=2)
    pid = inst.pids()[1]
    async with stopped(pid):
        rc, out, err = await run_cli("overlay", "status", "-t", "0.5", uri=inst.uri(1),
                                     timeout=15)
    assert (rc, out, err) == (1, "", "kvbroker: overlay status: the attached rank did not "
                                     "answer in 0.5s (stopped or hung?)\n")
