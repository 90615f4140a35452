"""``kvbroker overlay status`` and ``kvbroker shutdown`` (docs/cli.md)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import pwd
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import (
    KVBROKER,
    RawClient,
    run_cli,
    stats,
    stop_process,
    unanswering_ssh,
    wait_until,
)

from broker import cli, codec, overlay_cli, status
from broker.errors import RemoteError
from broker.message import Message, MsgFlags, MsgType
from broker.status import (
    FULL,
    LOST,
    OFFLINE,
    PARTIAL,
    TORPID,
    Answer,
    NoAnswer,
    RankStatus,
    classify,
    render,
)


def test_a_lost_rank_makes_its_ancestors_partial() -> None:
    # size 8, fanout 2: 0 -> 1, 2; 1 -> 3, 4; 3 -> 7
    answers: list[tuple[str, str] | str] = [("h", "")] * 8
    answers[3] = "rank 3 is unreachable"
    answers[7] = "rank 3 is unreachable"
    states = [s.state for s in classify(8, 2, answers)]
    assert states == [PARTIAL, PARTIAL, FULL, LOST, FULL, FULL, FULL, LOST]


def test_a_silent_rank_is_torpid_not_lost() -> None:
    answers: list[Answer] = [("h", "")] * 4
    answers[2] = NoAnswer("no answer in 2s")
    statuses = classify(4, 2, answers)
    assert [s.state for s in statuses] == [PARTIAL, FULL, TORPID, FULL]
    assert render(statuses, 2)[3] == "  2: torpid (no answer in 2s)"


def test_a_rank_its_parent_marked_torpid_is_torpid_even_if_it_answered() -> None:
    answers: list[Answer] = [("h", "")] * 4
    answers[2] = "rank 2 is unreachable"
    marked = {3: "rank 1 has heard nothing from it for 31s",
              2: "rank 0 has heard nothing from it for 40s"}
    statuses = classify(4, 2, answers, marked)
    assert [s.state for s in statuses] == [PARTIAL, PARTIAL, LOST, TORPID]
    assert render(statuses, 2)[2] == "    3: torpid (rank 1 has heard nothing from it for 31s)"


def test_a_restarted_rank_says_so_after_its_state() -> None:
    """What the parent saw of a rank's restarts follows its state, and the
    reason a lost rank is lost, on its line."""
    assert status.restarts(0, 0, 1.0) == ""
    assert status.restarts(1, 0, 12.34) == "restarted 12.3s ago"
    assert status.restarts(1, 1, 90) == \
        "restarted 1.5m ago, in place of a process still connected"
    assert status.restarts(3, 2, 7200) == \
        "restarted 3 times, the last 2.0h ago, 2 in place of a process still connected"
    statuses = [RankStatus(0, PARTIAL, "a"),
                RankStatus(1, FULL, "b", restarts="restarted 5.0s ago"),
                RankStatus(2, LOST, detail="gone", restarts="restarted 1.0m ago")]
    assert render(statuses, 2) == ["0 a: partial", "  1 b: full (restarted 5.0s ago)",
                                   "  2: lost (gone; before that, restarted 1.0m ago)"]


def test_a_rank_that_never_joined_is_offline_and_so_is_its_subtree() -> None:
    """Ranks across hosts start in any order: one its parent has had no
    hello from since it started (``overlay.unjoined``), and the ranks
    behind it, were shown lost, as if they had crashed.  They are offline,
    as Flux's children start; one that joined and went is still lost."""
    # size 8, fanout 2: 0 -> 1, 2; 1 -> 3, 4; 3 -> 7
    answers: list[Answer] = [("h", "")] * 8
    for rank in (1, 3, 4, 7):
        answers[rank] = "rank 1 is unreachable"
    answers[6] = "rank 6 is unreachable"
    statuses = classify(8, 2, answers, unjoined={1, 6, 5})
    assert render(statuses, 2) == [
        "0 h: partial",
        "  1: offline (not joined since rank 0 started)",
        "    3: offline (behind rank 1, not joined)",
        "      7: offline (behind rank 1, not joined)",
        "    4: offline (behind rank 1, not joined)",
        "  2 h: partial",
        "    5 h: full",  # (it answers: joined since)
        "    6: offline (not joined since rank 2 started)"]
    assert [s.state for s in classify(8, 2, answers)][1] == LOST


def test_render_indents_children_under_parents() -> None:
    statuses = [RankStatus(0, PARTIAL, "a"), RankStatus(1, LOST, detail="gone"),
                RankStatus(2, FULL, "c"), RankStatus(3, LOST, detail="gone")]
    assert render(statuses, 2) == ["0 a: partial", "  1: lost (gone)", "    3: lost (gone)",
                                   "  2 c: full"]


async def test_a_rank_stopped_on_purpose_is_offline_not_lost(start_instance, connect) -> None:
    """A rank stopped cleanly (SIGTERM: it says goodbye to its parent), and
    the subtree that stops with it, showed as lost, as if it had crashed:
    an operator could not tell maintenance from a failure.  They are
    offline now, as in Flux, with why; a rank killed is still lost."""
    inst = await start_instance(size=4, fanout=2)
    uri = inst.uri(0)
    host = socket.gethostname()
    h = await connect(inst, 0)
    async with asyncio.timeout(60):
        os.kill(inst.pids()[1], signal.SIGTERM)
        assert [await inst.procs[r].wait() for r in (1, 3)] == [0, 0]

        async def rank0_lost_it() -> bool:
            return 1 not in (await stats(h, 0))["overlay"]["children"]

        await wait_until(rank0_lost_it, "rank 0 to notice")
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        assert rc == 1, err
        assert out.splitlines() == [f"0 {host}: partial",
                                    f"  1 {host}: offline (stopped: signal SIGTERM)",
                                    f"    3 {host}: offline (stopped with rank 1)",
                                    f"  2 {host}: full"]
        assert (await stats(h, 0))["overlay"]["offline"] == {"1": "signal SIGTERM"}
        rc, out, err = await run_cli("uptime", uri=uri)
        assert rc == 0 and out.rstrip().endswith("size 4,  2 offline"), (out, err)
        os.kill(inst.pids()[2], signal.SIGKILL)

        async def rank0_lost_2() -> bool:
            return (await stats(h, 0))["overlay"]["children"] == []

        await wait_until(rank0_lost_2, "rank 0 to notice")
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        # (why rank 0 lost it, not the failed ping's "rank 2 is unreachable")
        assert re.fullmatch(rf"  2 {re.escape(host)}: lost \(its connection "
                            r"(closed|failed: .*)\)", out.splitlines()[3]), out


def test_a_rank_that_does_not_answer_is_named_by_its_hello_else_its_entry() -> None:
    """A rank that answers names its host; one that does not (torpid,
    lost, offline) is named by what its last hello to its parent said,
    else by its bootstrap file entry (the attached rank's ``hostlist``)."""
    statuses = [RankStatus(0, PARTIAL, "n0"), RankStatus(1, TORPID, detail="silent"),
                RankStatus(2, LOST, detail="gone"), RankStatus(3, OFFLINE, detail="stopped")]
    named = status.name_hosts(statuses, {1: "n1.example.org", 2: "n2"},
                              ["n0", "n1", "x2", "n3"])
    assert render(named, 2) == ["0 n0: partial", "  1 n1.example.org: torpid (silent)",
                                "    3 n3: offline (stopped)", "  2 n2: lost (gone)"]
    # a hostlist that is not one host per rank is not used
    assert [s.hostname for s in status.name_hosts(statuses, {}, ["n0"])] == ["n0", "", "", ""]


def test_ranks_below_an_offline_rank_are_offline_too() -> None:
    answers: list[Answer] = [("h", "")] * 8  # 0 -> 1, 2; 1 -> 3, 4; 3 -> 7
    for rank in (1, 3, 4, 7, 6):
        answers[rank] = f"rank {rank} is unreachable"
    statuses = classify(8, 2, answers, stopped={1: "stopped: signal SIGTERM"})
    assert [s.state for s in statuses] == [PARTIAL, OFFLINE, PARTIAL, OFFLINE, OFFLINE,
                                           FULL, LOST, OFFLINE]
    assert render(statuses, 2)[:3] == ["0 h: partial", "  1: offline (stopped: signal SIGTERM)",
                                       "    3: offline (stopped with rank 1)"]


async def test_overlay_status_and_shutdown(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    uri = inst.uri(0)
    host = socket.gethostname()
    async with asyncio.timeout(60):
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        assert (rc, out) == (0, f"0 {host}: full\n  1 {host}: full\n    3 {host}: full\n"
                                f"  2 {host}: full\n"), err
        h = await connect(inst, 0)
        os.kill(inst.pids()[3], signal.SIGKILL)

        async def rank1_lost_it() -> bool:
            return (await stats(h, 1))["overlay"]["children"] == []

        await wait_until(rank1_lost_it, "rank 1 to notice")
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        assert rc == 1, err
        lines = out.splitlines()
        assert lines[:2] + lines[3:] == [f"0 {host}: partial", f"  1 {host}: partial",
                                         f"  2 {host}: full"], out
        assert re.fullmatch(rf"    3 {re.escape(host)}: lost \(its connection "
                            r"(closed|failed: .*)\)", lines[2]), out
        # a stopped rank is still connected: torpid, not lost
        await stop_process(inst.pids()[2])
        said: list[Any] = []

        async def shown() -> bool:
            # (-t 0.5: the ping of the stopped rank 2 takes it all, and rank
            # 0 answers within it -- asked again if a loaded machine kept it
            # from it, then shown "no answer in 0.5s" too)
            said[:] = await run_cli("overlay", "status", "-t", "0.5", uri=uri)
            return said[1].splitlines()[:1] == [f"0 {host}: partial"]

        try:
            with contextlib.suppress(AssertionError):  # (said below)
                await wait_until(shown, "rank 0 shown partial", 20)
        finally:
            os.kill(inst.pids()[2], signal.SIGCONT)
        rc, out, err = said
        assert rc == 1, err
        assert out.splitlines()[0] == f"0 {host}: partial"
        assert out.splitlines()[3] == f"  2 {host}: torpid (no answer in 0.5s)"
        # shutdown: rank 2 and its (empty) subtree, then the instance
        assert (await run_cli("shutdown", "--rank", "2", uri=uri))[0] == 0
        assert await inst.procs[2].wait() == 0
        assert (await run_cli("shutdown", uri=uri))[0] == 0
        assert [await inst.procs[r].wait() for r in (0, 1)] == [0, 0]


async def start_serving() -> tuple[asyncio.subprocess.Process, str]:
    """``kvbroker start --size 4 --fanout 2`` without a command, and the URI it prints."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "--size", "4", "--fanout", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    return proc, (await proc.stdout.readline()).decode().strip()


async def test_start_exits_0_when_the_instance_is_shut_down() -> None:
    """``kvbroker shutdown`` inside ``kvbroker start``: a stop, not a lost
    rank -- with no command start exits 0; with one, the command is stopped
    and start exits as it does."""
    async with asyncio.timeout(60):
        proc, uri = await start_serving()
        assert (await run_cli("shutdown", uri=uri))[0] == 0
        _, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert b"unexpectedly" not in err
        script = f'{KVBROKER} shutdown; exec {sys.executable} -c "import time; time.sleep(60)"'
        rc, _, err = await run_cli("start", "--size", "2", "--", "sh", "-c", script)
        assert rc == 128 + signal.SIGTERM, err
        assert "the instance was shut down; stopping the command" in err


async def test_start_stops_when_a_rank_is_shut_down() -> None:
    """``kvbroker shutdown --rank R`` inside ``kvbroker start``: said as a
    shutdown, not "rank R exited unexpectedly, with status 0" and exit 1;
    the instance stops, and start exits 0, or as its command does."""
    async with asyncio.timeout(60):
        proc, uri = await start_serving()
        assert (await run_cli("shutdown", "--rank", "3", uri=uri))[0] == 0
        _, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert err.decode().strip() == (
            "kvbroker: rank 3 was shut down (kvbroker shutdown); stopping the instance")
        # rank 1's subtree (1 and 3), under a command: it is stopped too
        script = (f'{KVBROKER} shutdown --rank 1; '
                  f'exec {sys.executable} -c "import time; time.sleep(60)"')
        rc, _, err = await run_cli("start", "--size", "4", "--fanout", "2", "--",
                                   "sh", "-c", script)
        assert rc == 128 + signal.SIGTERM, err
        assert err.strip() == ("kvbroker: rank 1 was shut down (kvbroker shutdown); "
                               "stopping the instance and the command")


# ---------------------------------------------------------------- uptime


async def test_uptime_says_how_long_whose_and_how_big(start_instance) -> None:
    inst = await start_instance(size=3, fanout=2)
    rc, out, err = await run_cli("uptime", uri=inst.uri(2))
    assert rc == 0, err
    owner = pwd.getpwuid(os.getuid()).pw_name
    assert re.fullmatch(rf"\d\d:\d\d:\d\d run \d+\.\ds,  owner {owner},  size 3\n", out), out


async def test_status_and_uptime_keep_their_timeout_when_rank_0_is_out_of_reach(
        start_instance) -> None:
    """Run on rank 3 while its parent (rank 1) is stopped, so that nothing
    it sends towards rank 0 is answered: ``overlay status`` and ``uptime``
    still end within their ``--timeout`` -- the first showing rank 1 (and
    what only it leads to) torpid, the second saying rank 0 did not answer
    -- instead of waiting for ever for rank 0's size or start time."""
    inst = await start_instance(size=4, fanout=2)
    pid = inst.pids()[1]
    await stop_process(pid)
    try:
        async with asyncio.timeout(60):
            while True:  # (rank 3 itself must answer in the 1 s: asked again if it did not)
                rc, out, err = await run_cli("overlay", "status", "-t", "1", uri=inst.uri(3))
                if not re.search(r"^    3 \S+: torpid \(no answer", out, re.M):
                    break
            assert rc == 1, err
            host = socket.gethostname()  # (every rank's, under `start`: its hostlist)
            assert out.splitlines()[:2] == [f"0 {host}: torpid (no answer in 1s)",
                                            f"  1 {host}: torpid (no answer in 1s)"], out
            assert re.search(r"^    3 \S+: full$", out, re.M), out
            rc, out, err = await run_cli("uptime", "-t", "1", uri=inst.uri(3))
            assert (rc, out) == (1, ""), err
            assert err == "kvbroker: uptime: rank 0 did not answer in 1s\n", err
    finally:
        os.kill(pid, signal.SIGCONT)


def test_uptime_counts_lost_and_torpid_ranks_in_flux_units() -> None:
    ranks = [status.RankStatus(0, status.PARTIAL), status.RankStatus(1, status.LOST),
             status.RankStatus(2, status.LOST), status.RankStatus(3, status.TORPID)]
    now = time.mktime((2026, 12, 1, 13, 2, 55, 0, 0, -1))
    line = cli.uptime_line(now, now - 2.3 * 3600, os.getuid(), ranks)
    owner = pwd.getpwuid(os.getuid()).pw_name
    assert line == f"13:02:55 run 2.3h,  owner {owner},  size 4,  2 lost,  1 torpid"
    assert [status.fsd(s) for s in (0, 59.94, 60, 3599, 3600, 86400 * 1.5)] == [
        "0.0s", "59.9s", "1.0m", "60.0m", "1.0h", "1.5d"]
    assert cli.uptime_line(now, now + 5, 4_000_000_000, ranks[:1]).split(",  ")[:2] == [
        "13:02:55 run 0.0s", "owner 4000000000"]  # a clock step back; a uid with no name


# ---------------------------------------------------------------- disconnect


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_overlay_disconnect_cuts_a_hung_rank_off(start_instance, connect,
                                                       transport: str) -> None:
    """A stopped rank holds the requests sent to it (here, a ping waits);
    ``overlay disconnect`` has its parent cut it off, as Flux's: the waiting
    ping and every new one fail at once with EHOSTUNREACH, status shows it
    lost, and the process, once it runs again, finds its parent gone and
    exits 1."""
    inst = await start_instance(size=4, fanout=2, attrs={"tbon.transport": transport})
    assert inst.failed is not None
    h = await connect(inst, 0)
    pid = inst.pids()[3]
    await stop_process(pid)
    try:
        async with asyncio.timeout(30):
            waiting = asyncio.ensure_future(h.ping(3))
            rc, out, err = await run_cli("overlay", "disconnect", "3", uri=inst.uri(2))
            assert (rc, out) == (0, "asking rank 1 to disconnect child rank 3\n"), err
            with pytest.raises(RemoteError) as e:
                await waiting
            assert e.value.errnum == errno.EHOSTUNREACH
            with pytest.raises(RemoteError) as e:
                await h.ping(3)
            assert e.value.errnum == errno.EHOSTUNREACH
            assert (await stats(h, 1))["overlay"]["children"] == []
            rc, out, _ = await run_cli("overlay", "status", uri=inst.uri(0))
            assert rc == 1 and f"    3 {socket.gethostname()}: lost" in out, out
            rc, _, err = await run_cli("overlay", "disconnect", "3", uri=inst.uri(0))
            assert rc == 1 and "rank 3 is already lost" in err, err
    finally:
        os.kill(pid, signal.SIGCONT)
    assert await asyncio.wait_for(inst.failed, 30) == (3, 1)
    assert (await h.ping(2))["rank"] == 2
    # it says why, as a rank its parent dropped after missed ZeroMQ
    # heartbeats does (a frozen host: the same link closed; only
    # "disconnected" was said, which told an operator nothing)
    assert inst.stderr_path is not None
    why = ("its connection closed" if transport == "unix" else
           "its link closed: the parent stopped, or dropped this rank -- after 10 s "
           "without an answer to its heartbeats (was this rank, or its host, stopped "
           "that long?), or by `kvbroker overlay disconnect`")
    assert (f"kvbroker[3]: ERROR kvbroker: lost the connection to parent rank 1 ({why}): "
            "stopping") in Path(inst.stderr_path).read_text()


async def test_overlay_disconnect_of_a_busy_zeromq_child_logs_no_flood(
        start_instance, connect) -> None:
    """What a ZeroMQ child had in flight when it was cut off still arrives
    from its old identity: dropped quietly (``overlay.dropped``), not taken
    for a stranger's first message with a WARNING each -- thousands, which
    flooded stderr and pushed the disconnect's own record out of the dmesg
    ring."""
    inst = await start_instance(size=2, fanout=2, attrs={"tbon.transport": "ipc"})
    assert inst.failed is not None and inst.stderr_path is not None
    h = await connect(inst, 0)
    raw = await RawClient.connect(inst, 1)
    ping = Message(MsgType.REQUEST, "broker.ping", {}, nodeid=0, flags=MsgFlags.NORESPONSE)
    try:
        raw.send_bytes(codec.to_stream(codec.encode(ping)) * 200_000)  # (rank 1 forwards)

        async def flowing() -> bool:
            return (await stats(h, 0))["messages"]["requests"] > 5_000

        await wait_until(flowing, "rank 1's client's pings to reach rank 0")
        # Make sure some are in flight at the cut: with rank 0 stopped, rank
        # 1 forwards a few thousand more, and rank 0 reads them (512 a turn)
        # around the disconnect request.  (Left to timing, rank 0 under load
        # could keep up with rank 1, and nothing arrived late to be dropped.)
        h1 = await connect(inst, 1)
        before = (await stats(h1, 1))["messages"]["requests"]
        os.kill(inst.procs[0].pid, signal.SIGSTOP)
        try:
            async def forwarded() -> bool:
                return (await stats(h1, 1))["messages"]["requests"] > before + 2_000

            await wait_until(forwarded, "rank 1 to forward more pings to a stopped rank 0")
            # (written at once: rank 0 finds it beside the pings)
            cut = h.rpc("overlay.disconnect-subtree", {"rank": 1}, nodeid=0)
        finally:
            os.kill(inst.procs[0].pid, signal.SIGCONT)
        await asyncio.wait_for(cut, 30)
        assert await asyncio.wait_for(inst.failed, 30) == (1, 1)
    finally:
        await raw.close()
    assert "refusing overlay peer" not in Path(inst.stderr_path).read_text()
    assert (await stats(h, 0))["overlay"]["dropped"] > 0  # (some were in flight)
    entries = [e["message"] async for e in h.dmesg(nodeid=0)]
    assert any(m.startswith("disconnecting child rank 1") for m in entries), entries[-3:]


async def test_overlay_disconnect_refuses_what_it_cannot_do(start_instance) -> None:
    inst = await start_instance(size=3, fanout=2)
    rc, _, err = await run_cli("overlay", "disconnect", "0", uri=inst.uri(0))
    assert rc == 1 and "rank 0 has no parent" in err, err
    rc, out, err = await run_cli("overlay", "disconnect", "3", uri=inst.uri(0))
    assert (rc, out) == (1, ""), err  # (not "asking rank 1 to ...": there is no rank 3)
    assert err == "kvbroker: overlay disconnect: rank 3 is not a rank of this instance (size 3)\n"
    rc, _, err = await run_cli("overlay", "disconnect", "--parent", "2", "1", uri=inst.uri(0))
    assert rc == 1 and "rank 1 is not a connected child of rank 2" in err, err
    rc, _, err = await run_cli("overlay", "status", uri=inst.uri(0))
    assert rc == 0, err  # nothing was cut


def test_lookup_translates_ranks_and_hosts_as_flux_t3303() -> None:
    """``overlay lookup`` on flux-core's t3303 instance (ranks 0-14 on
    fake0..fake14): ranks to hosts and back, and what it refuses."""
    hosts = [f"fake{i}" for i in range(15)]
    assert overlay_cli.translate_target("0", hosts) == "fake0"
    assert overlay_cli.translate_target("0-14", hosts) == "fake[0-14]"
    assert overlay_cli.translate_target("all", hosts) == "fake[0-14]"
    assert overlay_cli.translate_target("1-2,5", hosts) == "fake[1-2,5]"
    assert overlay_cli.translate_target("fake2", hosts) == "2"
    assert overlay_cli.translate_target("fake[2-3]", hosts) == "2-3"
    assert overlay_cli.translate_target("fake[5,2]", hosts) == "2,5"
    for target, why in [("100", "no rank 100: the instance's ranks are 0-14"),
                        ("fake2[", "TARGET must be a rank idset or a host list: unbalanced"),
                        ("foo", "no rank of this instance runs on host 'foo' (its hosts: "
                                "fake[0-14])")]:
        with pytest.raises(overlay_cli.CLIError, match=re.escape(why)):
            overlay_cli.translate_target(target, hosts)
    # several ranks on one host: all of them (Flux names the first)
    assert overlay_cli.translate_target("vm", ["vm", "vm", "other", "vm"]) == "0-1,3"
    assert overlay_cli.translate_target("0-3", ["vm", "vm", "other", "vm"]) == "vm,vm,other,vm"


async def test_overlay_lookup_and_parentof_on_a_running_instance(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2)
    host = socket.gethostname()
    uri = inst.uri(3)
    assert await run_cli("overlay", "lookup", "0-3", uri=uri) == (
        0, ",".join([host] * 4) + "\n", "")
    assert await run_cli("overlay", "lookup", host, uri=uri) == (0, "0-3\n", "")
    rc, out, err = await run_cli("overlay", "lookup", "4", uri=uri)
    assert (rc, out) == (1, ""), err
    assert "no rank 4: the instance's ranks are 0-3" in err, err
    got = [await run_cli("overlay", "parentof", str(r), uri=uri) for r in (1, 2, 3)]
    assert got == [(0, "0\n", ""), (0, "0\n", ""), (0, "1\n", "")]
    assert await run_cli("overlay", "parentof", "0", uri=uri) == (
        1, "", "kvbroker: overlay parentof: rank 0 has no parent\n")
    assert await run_cli("overlay", "parentof", "4", uri=uri) == (
        1, "", "kvbroker: overlay parentof: 4 is not a rank of this instance (size 4)\n")


def test_errors_groups_the_ranks_that_are_down_by_why() -> None:
    ranks = [RankStatus(0, PARTIAL, "n0"), RankStatus(1, PARTIAL, "n1"),
             RankStatus(2, FULL, "n2"),
             RankStatus(3, LOST, "n3", "its connection closed"),
             RankStatus(4, TORPID, "n4", "no answer in 2s"),
             RankStatus(5, OFFLINE, "n5", "stopped: SIGTERM"),
             RankStatus(6, OFFLINE, "n6", "stopped: SIGTERM"),
             RankStatus(7, LOST, "n7", "rank 3 is unreachable"),
             RankStatus(8, LOST, "", "rank 3 is unreachable")]
    assert status.errors(ranks) == ["3 n3: lost (its connection closed)",
                                    "4 n4: torpid (no answer in 2s)",
                                    "5-6 n[5-6]: offline (stopped: SIGTERM)",
                                    "7-8: lost (rank 3 is unreachable)"]
    assert status.errors(ranks[:3]) == []
    # one machine: its name once, not once per rank
    same = [RankStatus(r, LOST, "vm", "rank 2 is unreachable") for r in (5, 6, 11, 12)]
    assert status.errors(same) == ["5-6,11-12 vm: lost (rank 2 is unreachable)"]


async def test_overlay_errors_names_a_rank_that_does_not_answer(start_instance) -> None:
    inst = await start_instance(size=4, fanout=2)
    assert await run_cli("overlay", "errors", uri=inst.uri(0)) == (0, "", "")
    pid = inst.pids()[3]
    await stop_process(pid)
    try:
        rc, out, err = await run_cli("overlay", "errors", "-t", "1", uri=inst.uri(0))
        assert (rc, out) == (0, f"3 {socket.gethostname()}: torpid (no answer in 1s)\n"), err
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_overlay_status_gives_up_connecting(tmp_path: Path) -> None:
    """``-t`` bounds connecting too: a host that never answers is given up."""
    rc, _, err = await run_cli("overlay", "status", "-t", "1", timeout=10,
                               uri="ssh://nohost/tmp/kvb-x/local-0",
                               env=unanswering_ssh(tmp_path))
    assert rc == 1 and "Connection timed out (no answer in 1s)" in err, err


async def test_overlay_errors_gives_up_connecting(tmp_path: Path) -> None:
    """As ``overlay status`` (it waited for ever: the docs audit)."""
    rc, _, err = await run_cli("overlay", "errors", "-t", "1", timeout=10,
                               uri="ssh://nohost/tmp/kvb-x/local-0",
                               env=unanswering_ssh(tmp_path))
    assert rc == 1 and "Connection timed out (no answer in 1s)" in err, err


@pytest.mark.parametrize("command", ["overlay status", "overlay errors", "uptime"])
async def test_a_command_whose_own_rank_exits_says_so_not_that_ranks_were_lost(
        start_instance, connect, command: str) -> None:
    """The hang audit: the attached rank (3) exits while the command waits
    for the other ranks' answers (rank 2 is stopped).  The requests its
    own connection lost were taken for the ranks asked: ``overlay status``
    printed rank 2 (and any other not answered yet) ``lost (connection to
    broker lost)`` and rank 3, gone, ``full``; ``overlay errors`` did so
    with exit status 0, ``uptime`` counted them lost.  Now each says its
    connection went, as any other command does, exit 1.  The kill waits
    for the command's ``broker.stats-get`` to pass rank 1, rank 3's
    parent: it is then past its attached rank's own answers (and, for
    ``uptime``, rank 0's), and its ask of rank 2 is out."""
    inst = await start_instance(size=4, fanout=2)
    h1 = await connect(inst, 1)
    trace = h1.overlay_trace("broker.stats-get", types=MsgType.REQUEST, peer=3)
    await h1.ping()  # (answered after the trace is registered)
    rank2 = inst.pids()[2]
    await stop_process(rank2)

    async def kill_rank3(_proc: asyncio.subprocess.Process) -> None:
        await trace.next_message()
        os.kill(inst.pids()[3], signal.SIGKILL)

    try:
        rc, out, err = await run_cli(*command.split(), "-t", "60", uri=inst.uri(3),
                                     timeout=30, meanwhile=kill_rank3)
    finally:
        os.kill(rank2, signal.SIGCONT)
    assert (rc, out) == (1, ""), (out, err)
    assert err == (f"kvbroker: {command}: Connection reset by peer "
                   "(connection to broker lost)\n")
