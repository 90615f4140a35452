"""flux-core t3310-system-heartbeat (a leaf deprived of heartbeats) and
t2804-uptime-cmd (``flux uptime``), as kvbroker has them: real ranks
(``Instance`` from Python, and ``kvbroker broker --config`` for ranks that
load different modules), real sockets, the ``kvbroker`` command.

t3310's cases, in order, and what each becomes here (a 2-rank instance
with the ``heartbeat`` module, ``-S broker.modules=...,heartbeat``):

1. *ensure child is online* (``overlay status --timeout=0 --wait full``):
   ``kvbroker overlay status --wait full -t 10`` exits 0, both ranks full.
2. *configure heartbeat* (``flux config load``: ``period = "0.1s"``,
   ``timeout = "0.5s"``): kvbroker has no config reload; the period is set
   by reloading the module with it, ``module reload -r all heartbeat
   period=0.1s`` (docs/cli.md "module";
   :func:`test_t3310_module_removed_on_rank_0_and_loaded_again`), or given
   at start, ``-S heartbeat.period=0.1s``
   (:func:`test_t3310_heartbeat_stopped_and_started_again`, which also
   asserts that ``attr set heartbeat.period`` on a running rank is refused
   with the reason: docs/cli.md, attr).  Flux's ``timeout`` is not built
   (docs/guide.md "A heartbeat"; docs/cli.md ``-S``): ``-S
   heartbeat.timeout=0.5s`` stops the start saying so, before any rank runs
   (:func:`test_t3310_flux_s_timeout_is_refused_as_not_built`).
3. *stop heartbeat* (``flux module remove heartbeat`` on rank 0): the same,
   ``kvbroker module remove heartbeat`` on rank 0
   (:func:`test_t3310_module_removed_on_rank_0_and_loaded_again`).  Kept
   from before runtime module management existed: rank 0 SIGSTOPped (its
   pulses stop, as rank 0 hung would;
   :func:`test_t3310_heartbeat_stopped_and_started_again`), and rank 0
   started without the module while rank 1 has it, two ``kvbroker broker``
   ranks from one bootstrap file, each given its own ``broker.modules``
   (:func:`test_t3310_rank_0_without_the_module_leaves_rank_1_overdue`).
   Each way rank 1 logs the WARNING ``heartbeat overdue`` (docs/guide.md)
   after ``warn_thresh`` periods, and its ``stats heartbeat`` says
   ``overdue``.
4. *wait for rank 1 to exit* (Flux's follower gives up after ``timeout``
   and exits 1): not built, deliberately (docs/guide.md "A heartbeat": a
   rank that cut itself off over a missed event would break the tree over
   a slow rank 0).  Asserted instead: past Flux's 0.5 s of silence rank 1
   still runs and answers.  With rank 0 stopped, what names the silent
   rank 0 is ``overlay status`` on rank 1, *torpid*, exit 1, and ``uptime``
   there exits 1, ``rank 0 did not answer`` (docs/cli.md); with the module
   removed rank 0 still answers, and nothing is torpid.
5. *start heartbeat* (``flux module load heartbeat``): ``kvbroker module
   load heartbeat`` on rank 0 (no arguments: the period of the last load,
   0.1 s, stays, docs/cli.md "module"), or SIGCONT; rank 1 logs
   ``heartbeat received`` and counts pulses again.
6. *wait for degraded status* (rank 0 *degraded*: its child was lost):
   kvbroker has no *degraded* (``--wait full|partial``, documented; see
   t3300 and t3303), and nothing was lost: rank 1 never left, so the
   instance is *full* again (``--wait full`` exits 0).  Where rank 0 does
   not beat at all (the broker-per-rank case) the instance stays full.

t2804's cases, in order (4 ranks, fanout 2, guests admitted:
``-S access.allow-guest-user=true``):

1. *works on rank 0*: ``kvbroker uptime`` prints Flux's one line,
   ``HH:MM:SS run 0.4s,  owner root,  size 4`` (asserted in full).
2. *works on rank 1*: ``kvbroker exec -r 1 -- kvbroker uptime``, the same
   line.
3. *works as guest*: ``kvbroker uptime`` run as another uid (as
   tests/test_broker_guests.py runs commands), on rank 0 and on rank 1:
   the same line.
4. *reports correct size*: ``size 4`` in each of the above.
5. *reports submit disabled*, 6. *reports scheduler stopped*, 7. *reports
   drained node count*: not applicable -- kvbroker has no job queue,
   scheduler or resource drain (out of its scope: a broker and KVS).
   Flux's uptime also counts *offline* nodes; kvbroker's counts lost,
   offline and torpid ranks (docs/cli.md, uptime): asserted with rank 3
   shut down (``1 offline``), rank 2 killed (``1 lost``) and rank 1
   stopped (``1 torpid``), from rank 0 and from rank 1.  Flux's ``depth``
   (nesting of instances as jobs) and broker state word other than ``run``
   do not apply either.

Found by this file: a guest's ``uptime`` counted a rank shut down on
purpose as *lost* where the owner's counted it *offline* (until
2026-12-05).  The cause was the guest's view of ``broker.stats-get``
(``rank`` and ``guests`` only), from which ``broker/status.py`` reads the
parents' ``overlay`` marks (offline, torpid, lost with why); ``overlay
status`` run by a guest showed the same rank *lost* too.  A guest now gets
the children's health too, as Flux's ``overlay.health`` is open to
guests.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from test_broker_guests import ALLOW, run_guest_cli
from test_broker_support import KVBROKER, run_cli, stop_process, wait_until
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import keyed_config

from broker.handle import Handle

T = 30.0
MODULES = "content,kvs,kvs-watch,heartbeat"
HEARTBEAT = {"broker.modules": MODULES, "heartbeat.period": "0.1s"}
OWNER = pwd.getpwuid(os.getuid()).pw_name
HOST = re.escape(socket.gethostname())

as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")


def uptime_re(extra: str = "") -> str:
    """Flux's uptime line for a 4-rank instance of ours (run time in
    seconds: the instance is young)."""
    return rf"\d\d:\d\d:\d\d run \d+\.\ds,  owner {re.escape(OWNER)},  size 4{extra}\n"


async def hb_stats(h: Handle, rank: int) -> dict[str, Any]:
    return await asyncio.wait_for(h.rpc("heartbeat.stats-get", {}, nodeid=rank), 15)


async def next_heartbeat_line(log: Any) -> dict[str, Any]:
    """The next entry of a followed ``log.dmesg`` that the heartbeat logged."""
    async with asyncio.timeout(T):
        async for entry in log:
            if entry["message"].startswith("heartbeat "):
                return dict(entry)
    raise AssertionError("the log ended")


# ------------------------------------------------------------------ t3310




async def received_and_full(h1: Any, log: Any, inst: Any) -> None:
    """Cases 5-6: rank 1 logs ``heartbeat received`` and counts pulses
    again, and nothing was lost: the instance is full, both ranks run."""
    entry = await next_heartbeat_line(log)
    assert (entry["level"], entry["message"]) == ("warning", "heartbeat received"), entry
    count = (await hb_stats(h1, 1))["count"]

    async def counting() -> bool:
        st = await hb_stats(h1, 1)
        return st["overdue"] is False and st["count"] > count

    await wait_until(counting, "rank 1 to count pulses again", T)
    rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "10",
                                 uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    assert re.fullmatch(rf"0 {HOST}: full\n  1 {HOST}: full\n", out), out
    assert [p.returncode for p in inst.procs] == [None, None]

async def overdue_past_flux_timeout(h1: Any, log: Any) -> None:
    """Case 3's end: rank 1 logs ``heartbeat overdue`` and its stats say
    so; then case 4's start: 0.5 s (Flux's timeout) pass without a pulse."""
    entry = await next_heartbeat_line(log)
    assert entry["level"] == "warning", entry
    assert re.fullmatch(r"heartbeat overdue: none from rank 0 for \d+\.\d s "
                        r"\(heartbeat\.period 0\.1s, warn_thresh 3\)",
                        entry["message"]), entry
    assert (await hb_stats(h1, 1))["overdue"] is True

    async def past_flux_timeout() -> bool:
        return float((await hb_stats(h1, 1))["silent"]) > 0.5

    await wait_until(past_flux_timeout, "0.5 s without a pulse on rank 1", T)

async def test_t3310_heartbeat_stopped_and_started_again(start_instance, connect) -> None:
    """Flux's cases 1-6, in order (3 and 5: rank 0 stopped and continued)."""
    inst = await start_instance(size=2, attrs=HEARTBEAT)
    u0, u1 = inst.uri(0), inst.uri(1)
    # 1: the child is online
    rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "10", uri=u0)
    assert (rc, err) == (0, ""), err
    assert re.fullmatch(rf"0 {HOST}: full\n  1 {HOST}: full\n", out), out

    # 2: the period given at start is in force; it is not changed at run time
    h1 = await connect(inst, 1)
    before = await hb_stats(h1, 1)
    assert (before["period"], before["overdue"]) == (0.1, False), before
    rc, out, err = await run_cli("attr", "set", "heartbeat.period", "1s", uri=u0)
    assert (rc, out) == (1, "") and "may not be changed on a running rank" in err, err
    assert (await hb_stats(h1, 1))["period"] == 0.1

    # 3: the pulses stop (rank 0 stopped): rank 1 says so, once overdue
    # (from what is logged from now on: a loaded machine may have delayed a
    # pulse past warn_thresh already, and the log keeps that)
    kept = [entry["seq"] async for entry in h1.rpc_stream("log.dmesg", {}, nodeid=1)]
    log = h1.rpc_stream("log.dmesg", {"follow": True, "since": max(kept, default=0)},
                        nodeid=1)
    rank0 = inst.pids()[0]
    await stop_process(rank0)
    try:
        await overdue_past_flux_timeout(h1, log)
        # 4: past Flux's timeout (0.5 s) rank 1 stays; overlay status and
        # uptime on it name the silent rank 0
        assert inst.procs[1].returncode is None
        rc, out, err = await run_cli("ping", "1", uri=u1)
        assert rc == 0 and out.startswith("rank=1 "), err
        rc, out, err = await run_cli("overlay", "status", "-t", "1", uri=u1)
        assert rc == 1, (rc, out, err)
        assert re.fullmatch(rf"0 {HOST}: torpid \(no answer in 1s\)\n  1 {HOST}: full\n",
                            out), out
        rc, out, err = await run_cli("uptime", "-t", "1", uri=u1)
        assert (rc, out, err) == (1, "", "kvbroker: uptime: rank 0 did not answer in 1s\n")
    finally:
        os.kill(rank0, signal.SIGCONT)

    # 5: the pulses come again: rank 1 says so, and counts them
    await received_and_full(h1, log, inst)


async def test_t3310_module_removed_on_rank_0_and_loaded_again(start_instance, connect) -> None:
    """Flux's cases 1-6 as Flux runs them: the period set by ``module
    reload -r all heartbeat period=0.1s``, the pulses stopped by ``module
    remove heartbeat`` on rank 0 and started again by ``module load
    heartbeat`` there."""
    inst = await start_instance(size=2, attrs={"broker.modules": MODULES})
    u0 = inst.uri(0)
    # 1: the child is online
    rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "10", uri=u0)
    assert (rc, err) == (0, ""), err
    # 2: configure heartbeat: period 0.1s on every rank
    rc, out, err = await run_cli("module", "reload", "-r", "all", "heartbeat",
                                 "period=0.1s", uri=u0)
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    h1 = await connect(inst, 1)
    for rank in (0, 1):
        assert (await hb_stats(h1, rank))["period"] == 0.1
    kept = [entry["seq"] async for entry in h1.rpc_stream("log.dmesg", {}, nodeid=1)]
    log = h1.rpc_stream("log.dmesg", {"follow": True, "since": max(kept, default=0)},
                        nodeid=1)
    # 3: stop heartbeat on rank 0: rank 1 says so, once overdue
    rc, out, err = await run_cli("module", "remove", "heartbeat", uri=u0)
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    rc, out, err = await run_cli("module", "list", uri=u0)
    assert rc == 0 and "heartbeat" not in out, out
    await overdue_past_flux_timeout(h1, log)
    # 4: past Flux's timeout (0.5 s) rank 1 stays, and answers; rank 0
    # answers too (only its pulses stopped): the instance is full
    assert inst.procs[1].returncode is None
    rc, out, err = await run_cli("ping", "1", uri=u0)
    assert rc == 0 and out.startswith("rank=1 "), err
    # 5: start heartbeat on rank 0 (the period of the last load stays)
    rc, out, err = await run_cli("module", "load", "heartbeat", uri=u0)
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    assert (await hb_stats(h1, 0))["period"] == 0.1
    await received_and_full(h1, log, inst)


async def test_t3310_flux_s_timeout_is_refused_as_not_built() -> None:
    """Case 2's ``timeout = "0.5s"``: refused at start, saying what is done
    instead, and nothing runs."""
    rc, out, err = await run_cli("start", "-S", f"broker.modules={MODULES}",
                                 "-S", "heartbeat.period=0.1s",
                                 "-S", "heartbeat.timeout=0.5s", "--", "echo", "ran")
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "heartbeat.timeout" in err and "a silent rank is marked torpid" in err, err


async def test_t3310_rank_0_without_the_module_leaves_rank_1_overdue(
        tmp_path: Path, brokers) -> None:
    """The state Flux's ``module remove heartbeat`` (rank 0) leaves: rank 0
    runs without the module, rank 1 with it.  Rank 1 logs ``heartbeat
    overdue`` after ``warn_thresh`` periods and stays; the instance is
    full."""
    config = await keyed_config(tmp_path, 2, 1)
    r0 = await brokers(config, 0, "-S", "broker.modules=content,kvs,kvs-watch")
    r1 = await brokers(config, 1, "-S", f"broker.modules={MODULES}",
                       "-S", "heartbeat.period=0.1s", "-S", "heartbeat.warn_thresh=2")
    u0, u1 = await r0.ready(), await r1.ready()
    rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "10", uri=u0)
    assert (rc, err) == (0, ""), err
    rc, out, err = await run_cli("module", "list", uri=u0)
    assert rc == 0 and "heartbeat" not in out, out
    h1 = await asyncio.wait_for(Handle.connect(u1), 10)
    try:
        async def overdue() -> bool:
            return bool((await hb_stats(h1, 1))["overdue"])

        await wait_until(overdue, "rank 1 to find the beat overdue", T)
        st = await hb_stats(h1, 1)
        assert (st["count"], st["period"], st["warn_thresh"]) == (0, 0.1, 2), st
    finally:
        await h1.close()
    rc, out, err = await run_cli("dmesg", uri=u1)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if "heartbeat overdue" in line]
    assert len(lines) == 1 and " WARNING " in lines[0], out
    assert "none from rank 0 for " in lines[0], lines
    assert r1.proc.returncode is None
    rc, out, err = await run_cli("overlay", "status", "-t", "5", uri=u0)
    assert (rc, err) == (0, ""), (out, err)
    assert re.fullmatch(rf"0 {HOST}: full\n  1 {HOST}: full\n", out), out


# ------------------------------------------------------------------ t2804


@as_root
async def test_t2804_uptime_on_rank_0_on_rank_1_and_as_guest_reports_size_4(
        start_instance) -> None:
    """Flux's cases 1-4."""
    inst = await start_instance(size=4, fanout=2, attrs=ALLOW)
    u0 = inst.uri(0)
    rc, out, err = await run_cli("uptime", uri=u0)
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(), out), out
    rc, out, err = await run_cli("exec", "-r", "1", "--", KVBROKER, "uptime", uri=u0)
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(), out), out
    for rank in (0, 1):
        rc, out, err = await run_guest_cli(inst.uri(rank), "uptime")
        assert (rc, err) == (0, "") and re.fullmatch(uptime_re(), out), (rank, out, err)


async def test_t2804_uptime_counts_offline_lost_and_torpid_ranks(start_instance) -> None:
    """Beyond 5-7 (not applicable): the counts kvbroker's uptime has, as
    Flux's has ``offline``.  Fanout 3: ranks 1, 2, 3 all below rank 0."""
    inst = await start_instance(size=4, fanout=3)
    u0, u1 = inst.uri(0), inst.uri(1)
    rc, out, err = await run_cli("shutdown", "-r", "3", uri=u0)
    assert (rc, out, err) == (0, "", "")
    assert await asyncio.wait_for(inst.procs[3].wait(), T) == 0
    for uri in (u0, u1):
        rc, out, err = await run_cli("uptime", uri=uri)
        assert (rc, err) == (0, "") and re.fullmatch(uptime_re(",  1 offline"), out), out

    inst.procs[2].kill()
    await asyncio.wait_for(inst.procs[2].wait(), T)

    async def lost() -> bool:
        rc, out, _ = await run_cli("uptime", uri=u1)
        return rc == 0 and re.fullmatch(uptime_re(",  1 lost,  1 offline"), out) is not None

    await wait_until(lost, "uptime on rank 1 to count rank 2 lost", T)
    await stop_process(inst.pids()[1])
    try:
        rc, out, err = await run_cli("uptime", "-t", "1", uri=u0)
        assert (rc, err) == (0, ""), err
        assert re.fullmatch(uptime_re(",  1 lost,  1 offline,  1 torpid"), out), out
    finally:
        os.kill(inst.pids()[1], signal.SIGCONT)


@as_root
async def test_t2804_a_guest_s_uptime_counts_what_the_owner_s_counts(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=ALLOW)
    u0 = inst.uri(0)
    rc, out, err = await run_cli("shutdown", "-r", "3", uri=u0)
    assert (rc, out, err) == (0, "", "")
    assert await asyncio.wait_for(inst.procs[3].wait(), T) == 0
    rc, out, err = await run_cli("uptime", uri=u0)
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(",  1 offline"), out), out
    rc, out, err = await run_guest_cli(u0, "uptime")
    assert (rc, err) == (0, ""), err
    assert re.fullmatch(uptime_re(",  1 offline"), out), out
