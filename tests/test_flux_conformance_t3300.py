"""flux-core t3300-system-basic, as kvbroker has it: a "system instance",
each rank its own ``kvbroker broker --config FILE --rank R`` process (as
systemd runs them, docs/guide.md "Running ranks as services"), 3 ranks at
fanout 2 (0 -> 1, 2; Flux's ``kary:2``), over tcp with CURVE, each rank
saying it runs on its own host ``fakeN`` (``-S hostname=``).  A leaf is
stopped as ``systemctl stop`` does (SIGTERM), then killed (SIGKILL), and
each time started again by hand, as an operator (or ``Restart=``) would.

Flux's cases, in order, and what each becomes here:

1. *broker hostlist has fake hostlist*: ``attr get hostlist`` names the
   bootstrap file's hosts, by rank; kvbroker's attribute is comma-separated
   (``fake0,fake1,fake2``, docs/cli.md), where Flux's is compressed
   (``fake[0-2]``): documented.  ``overlay lookup all`` prints the compressed
   form, ``fake[0-2]``.
2. *startctl status works*: Flux's test harness (it starts and watches the
   brokers); not a broker behaviour, not applicable.
3. *broker overlay shows 2 connected children*: rank 0's ``broker``
   stats, ``overlay.children`` (``kvbroker stats broker -p``), is [1, 2].
4. *overlay status is full*: ``overlay status --summary``, ``full``, exit 0.
   (Flux's ``--timeout=0``, "no timeout", is refused by kvbroker's ``-t``,
   which must be more than 0: documented, asserted in t3303.)
5. *kill broker rank=2 with SIGTERM like systemd stop*: the same.
6. *broker exits with no error*: rank 2 exits 0 (a stop asked for, which a
   supervisor must not restart) and removes its socket.
7. *startctl shows rank 2 pid is -1*: harness, not applicable; what it
   means (rank 2 not running) is rank 0's view, 8-9.
8. *broker overlay shows 1 connected child*: ``overlay.children`` is [1].
9. *wait for overlay status to be partial*: ``--wait partial --summary``
   prints ``partial`` (exit 1: not full; documented).  The line for rank 2
   and ``overlay errors`` while it is stopped: asserted in t3303.
   Beyond Flux's file: ``exec -r all`` with rank 2 stopped fails naming
   it, exit 1.
10. *run broker rank=2*: the same command started again, in the same
    ``--rundir`` (its client URI stays the same).
11. *wait for overlay status to be full*: ``--wait full --summary`` (no
    ``-t``: it waits as long as the rank takes), ``full``, exit 0; rank 2
    prints ``ready`` at the URI it had; rank 0's children are [1, 2] again;
    ``overlay status`` shows rank 2 full and restarted, exit 0.
12. *flux exec over all ranks works*: ``exec -r all -l -- kvbroker attr
    get hostname`` runs once on each rank, each reaching its own rank.
    Beyond Flux's file, what a user restarting a rank expects: the
    restarted rank reads the KVS as it is now (a value changed and a key
    made while it was down), follows what is written after (``kvs wait``
    the writer's version, then read), and its writes are seen from rank 0;
    ``uptime`` on it counts no rank down.
13. *kill broker rank=2 with SIGKILL, broker exits with 128+9*: killed by
    SIGKILL (137 is the shell's way to say it, from Flux's harness).  Its
    socket stays behind, in its ``--rundir``.
14. *ping to rank 2 fails*: at once, exit 1, ``No route to host`` (asked
    right after the process is gone, before rank 0 may have seen it go;
    t3303 asserts it once the loss is seen).
15. *wait for overlay status to be degraded*: kvbroker has no *degraded*
    (a lost rank makes rank 0 partial: documented, asserted in t3303).
16-17. *run broker rank=2*, *wait for subtree to be full*: started again in
    the rundir it was killed in, over its stale socket: full again, and
    clients at its old URI reach the new process (the KVS as it is now).
18. *run broker rank=2 again fails*: Flux's harness refuses to start a rank
    it runs already (as systemd does a unit that runs).  A second
    ``kvbroker broker`` of a running rank is admitted instead, and the
    running one stops with status 1 (the newest process wins, docs/guide.md
    "Across hosts": a parent cannot tell a frozen host from a second copy):
    documented.  Asserted for a second copy in the same ``--rundir``: the
    new one serves at the same URI, the old one says it was replaced and
    leaves the new one's socket alone, rank 0's status says it.
19. *run broker rank=42 fails*: ``kvbroker broker --rank`` outside the file
    exits 2 (asserted in tests/test_multihost.py).
20. *kill broker rank=42 fails*: ``kvbroker shutdown -r 42``, exit 1, saying
    the instance has ranks 0-2.
21. *wait broker rank=42 fails*: harness, not applicable.
22. *dump broker logs from leader broker*: ``dmesg`` on rank 0 holds its
    own lines (``kvbroker[0]``) saying rank 2 stopped (SIGTERM), was lost
    (SIGKILL), and rejoined each time.  Across hosts those lines must say
    which host the rank ran on, as Flux's (``fake2 (rank 2) lost
    connection``) and as kvbroker's own rejoin line (``child rank 2 on fake2
    rejoined``) do: so the stop and loss lines do, for a child on another
    host (``child rank 1 on fake1 stopped (signal SIGTERM)``; until
    2026-12-05 they named no host).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

from test_broker_support import KVBROKER, run_cli, stats, wait_until
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import exit_codes, keyed_config, named

from broker.handle import Handle

HOSTS = ["fake0", "fake1", "fake2"]


async def _instance(tmp_path: Path, brokers: Any) -> tuple[Path, list[Any]]:  # noqa: F811
    config = await keyed_config(tmp_path, 3, 2, hosts=HOSTS)
    ranks = [await brokers(config, r, *named(HOSTS[r])) for r in range(3)]
    for r in ranks:
        assert await r.ready() == r.uri
    return config, ranks


async def _children(h: Handle) -> list[int]:
    return list((await stats(h, 0))["overlay"]["children"])


async def _until_children(h: Handle, want: list[int]) -> None:
    async def there() -> bool:
        return await _children(h) == want

    await wait_until(there, f"rank 0's children to be {want}", 30)


async def _version(uri: str) -> int:
    rc, out, err = await run_cli("kvs", "version", uri=uri)
    assert rc == 0, err
    return int(out)


async def _current_on(uri: str, writer: str, key: str, want: str) -> None:
    """``kvs wait`` the writer's version on ``uri``, then ``kvs get key``."""
    rc, _, err = await run_cli("kvs", "wait", "-t", "20", str(await _version(writer)), uri=uri)
    assert rc == 0, err
    assert await run_cli("kvs", "get", key, uri=uri) == (0, f"{want}\n", "")


def _line(log: str, *parts: str) -> str:
    """The line of ``log`` that holds every one of ``parts``."""
    found = [ln for ln in log.splitlines() if all(p in ln for p in parts)]
    assert len(found) == 1, (parts, log)
    return found[0]


async def test_t3300_a_rank_stopped_like_systemctl_stop_rejoins_when_started_again(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    config, ranks = await _instance(tmp_path, brokers)
    uri0, uri2 = ranks[0].uri, ranks[2].uri
    h = await Handle.connect(uri0)
    try:
        async with asyncio.timeout(90):
            # (1) the hosts, by rank
            assert await run_cli("attr", "get", "hostlist", uri=uri2) == (
                0, "fake0,fake1,fake2\n", "")
            assert await run_cli("overlay", "lookup", "all", uri=uri0) == (0, "fake[0-2]\n", "")
            # (3, 4) two children, full
            rc, out, err = await run_cli("stats", "broker", "-p", "overlay.children", uri=uri0)
            assert (rc, json.loads(out)) == (0, [1, 2]), err
            assert await run_cli("overlay", "status", "--summary", uri=uri0) == (0, "full\n", "")
            assert await run_cli("kvs", "put", "color=red", uri=uri0) == (0, "", "")
            assert await run_cli("kvs", "get", "color", uri=uri2) == (0, "red\n", "")

            ranks[2].proc.send_signal(signal.SIGTERM)  # (5)
            assert await exit_codes([ranks[2]], tmp_path) == [0]  # (6)
            assert not os.path.exists(ranks[2].rundir / "local-2")
            await _until_children(h, [1])  # (8)
            assert await run_cli("overlay", "status", "--wait", "partial", "--summary",
                                 uri=uri0) == (1, "partial\n", "")  # (9)
            # the instance goes on meanwhile; exec over every rank cannot
            assert await run_cli("kvs", "put", "color=blue", "made=while-down",
                                 uri=uri0) == (0, "", "")
            rc, out, err = await run_cli("exec", "-r", "all", "--", "true", uri=uri0)
            assert (rc, out) == (1, ""), err
            # (as overlay status says it: the operator's next question answered)
            assert err == ("kvbroker: exec: rank 2: No route to host (rank 2 is offline: "
                           "it stopped (signal SIGTERM))\n")

            again = await brokers(config, 2, *named("fake2"), "--rundir",
                                  str(ranks[2].rundir))  # (10)
            assert await run_cli("overlay", "status", "--wait", "full", "--summary",
                                 uri=uri0) == (0, "full\n", "")  # (11)
            # (12) at once, as a script would: exec over all ranks, each
            # command attached to its own rank
            rc, out, err = await run_cli("exec", "-r", "all", "-l", "--", KVBROKER, "attr",
                                         "get", "hostname", uri=uri0)
            assert (rc, sorted(out.splitlines())) == (
                0, ["0: fake0", "1: fake1", "2: fake2"]), err
            assert await again.ready() == uri2
            assert await _children(h) == [1, 2]
            rc, out, err = await run_cli("overlay", "status", uri=uri0)
            lines = out.splitlines()
            assert rc == 0 and lines[:2] == ["0 fake0: full", "  1 fake1: full"], (out, err)
            assert re.fullmatch(r"  2 fake2: full \(restarted \d+\.\ds ago\)", lines[2]), out

            # what the restarted rank sees: the KVS as it is, and as it goes on
            assert await run_cli("kvs", "get", "color", "made", uri=uri2) == (
                0, "blue\nwhile-down\n", "")
            assert await run_cli("kvs", "put", "color=green", uri=uri0) == (0, "", "")
            await _current_on(uri2, uri0, "color", "green")
            assert await run_cli("kvs", "put", "from=rank2", uri=uri2) == (0, "", "")
            await _current_on(uri0, uri2, "from", "rank2")
            rc, out, err = await run_cli("uptime", uri=uri2)
            assert rc == 0 and out.rstrip().endswith("size 3"), (out, err)

            # (20) a rank the instance does not have
            assert await run_cli("shutdown", "-r", "42", uri=uri0) == (
                1, "", "kvbroker: shutdown: No route to host (no route to rank 42: the "
                       "instance has ranks 0-2)\n")
            # (22) rank 0's log says what became of rank 2
            rc, out, err = await run_cli("dmesg", uri=uri0)
            assert rc == 0, err
            assert " kvbroker[0]: INFO kvbroker.overlay: " in _line(
                out, "child rank 2", "stopped (signal SIGTERM)")
            assert " kvbroker[0]: INFO kvbroker.overlay: " in _line(
                out, "child rank 2 on fake2 rejoined: a new process (1 since this rank started)")
    finally:
        await h.close()
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert await exit_codes([ranks[0], ranks[1], again], tmp_path) == [0, 0, 0]


async def test_t3300_a_rank_killed_with_sigkill_rejoins_in_its_old_rundir(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    config, ranks = await _instance(tmp_path, brokers)
    uri0, uri2 = ranks[0].uri, ranks[2].uri
    h = await Handle.connect(uri0)
    try:
        async with asyncio.timeout(90):
            ranks[2].proc.kill()  # (13)
            assert await exit_codes([ranks[2]], tmp_path) == [-signal.SIGKILL]
            assert os.path.exists(ranks[2].rundir / "local-2")  # (its socket stays)
            rc, out, err = await run_cli("ping", "2", uri=uri0)  # (14)
            assert (rc, out) == (1, ""), err
            assert err.startswith("kvbroker: ping: No route to host (rank 2 was lost: "), err
            await _until_children(h, [1])
            assert await run_cli("kvs", "put", "made=while-lost", uri=uri0) == (0, "", "")

            again = await brokers(config, 2, *named("fake2"), "--rundir",
                                  str(ranks[2].rundir))  # (16)
            assert await run_cli("overlay", "status", "--wait", "full", "--summary",
                                 uri=uri0) == (0, "full\n", "")  # (17)
            # clients at the old URI reach the new process, at once
            assert await run_cli("kvs", "get", "made", uri=uri2) == (0, "while-lost\n", "")
            assert await again.ready() == uri2
            assert await _children(h) == [1, 2]
            assert await run_cli("attr", "get", "broker.pid", uri=uri2) == (
                0, f"{again.proc.pid}\n", "")
            rc, out, err = await run_cli("exec", "-r", "all", "-l", "--", KVBROKER, "attr",
                                         "get", "rank", uri=uri0)
            assert (rc, sorted(out.splitlines())) == (0, ["0: 0", "1: 1", "2: 2"]), err
            # (22) the loss and the recovery, in rank 0's log
            rc, out, err = await run_cli("dmesg", uri=uri0)
            assert rc == 0, err
            assert " kvbroker[0]: WARNING kvbroker.overlay: lost child rank 2" in _line(
                out, "lost child rank 2", "unexpectedly")
            assert " kvbroker[0]: INFO kvbroker.overlay: " in _line(
                out, "child rank 2 on fake2 rejoined: a new process (1 since")
    finally:
        await h.close()
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert await exit_codes([ranks[0], ranks[1], again], tmp_path) == [0, 0, 0]


async def test_t3300_a_second_copy_of_a_running_rank_takes_its_place(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    """(18) documented: the newest process of a rank wins, the running one
    stops with status 1 saying why, and leaves the newcomer's socket in
    their shared ``--rundir``."""
    config, ranks = await _instance(tmp_path, brokers)
    uri0, uri2 = ranks[0].uri, ranks[2].uri
    async with asyncio.timeout(90):
        second = await brokers(config, 2, *named("fake2"), "--rundir", str(ranks[2].rundir))
        assert await second.ready() == uri2
        assert await exit_codes([ranks[2]], tmp_path) == [1]
        logged = (tmp_path / "stderr2-2").read_text()
        assert "ERROR kvbroker: rank 0 admitted a newer rank 2 process in this one's " \
            "place: stopping" in logged, logged
        assert ranks[2].proc.stdout is not None and await ranks[2].proc.stdout.read() == b""
        assert await run_cli("attr", "get", "broker.pid", uri=uri2) == (
            0, f"{second.proc.pid}\n", "")
        rc, out, err = await run_cli("overlay", "status", uri=uri0)
        assert rc == 0, (out, err)
        assert re.fullmatch(r"  2 fake2: full \(restarted \d+\.\ds ago, in place of a "
                            r"process still connected\)", out.splitlines()[2]), out
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert await exit_codes([ranks[0], ranks[1], second], tmp_path) == [0, 0, 0]


async def test_t3300_rank_0_s_log_names_the_host_of_a_child_that_stopped_or_was_lost(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    """(22, across hosts) an operator reading rank 0's ``dmesg`` after a rank
    went needs the machine it ran on, as ``overlay status`` gives it on every
    line: Flux logs ``fake2 (rank 2) lost connection``, and kvbroker's own
    line for the rank's return says ``child rank 2 on fake2 rejoined``; the
    lines for its stop and its loss said only ``child rank 1 stopped
    (signal SIGTERM)`` and ``lost child rank 2 unexpectedly: ...``."""
    _, ranks = await _instance(tmp_path, brokers)
    uri0 = ranks[0].uri
    h = await Handle.connect(uri0)
    try:
        async with asyncio.timeout(60):
            ranks[1].proc.send_signal(signal.SIGTERM)
            ranks[2].proc.kill()
            assert await exit_codes(ranks[1:], tmp_path) == [0, -signal.SIGKILL]
            await _until_children(h, [])
            rc, out, err = await run_cli("dmesg", uri=uri0)
            assert rc == 0, err
            assert "fake1" in _line(out, "child rank 1", "stopped (signal SIGTERM)")
            assert "fake2" in _line(out, "lost child rank 2", "unexpectedly")
    finally:
        await h.close()
