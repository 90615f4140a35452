"""flux-core t3302-system-offline, as kvbroker has it: a leaf of an
instance across hosts (``kvbroker broker --config``, 3 ranks at fanout 1,
0 -> 1 -> 2, Flux's ``kary:1``) started while the router between it and
rank 0 is not, as a login node whose upstream router is down.

Flux's cases, in order, and what each becomes here:

1. *start rank 2 before TBON parent is up*: the same, rank 0 and rank 2
   from the bootstrap file, rank 1 never started (yet).
2. *startctl shows rank 1 pid as -1*: Flux's test harness, not a broker
   behaviour.  Its meaning -- rank 1 is not running -- is what rank 0's
   ``overlay status`` says: rank 1 offline, not joined since rank 0
   started, rank 2 behind it (asserted in
   tests/test_flux_conformance_t3301.py; here only the line for rank 2,
   which must not show as lost or as full although it is running).
3. *flux run on rank 2 fails with "broker is offline"*: ``kvbroker exec``
   (and a KVS write) attached to rank 2 fail, exit 1, and say why: rank 2
   opens its local socket only once it has joined (docs/cli.md,
   Conventions), so the message is the connect error's hint ``is that rank
   still waiting for its parent``.  A documented difference in *where* it
   fails (Flux's leaf accepts the connection and refuses the job), not in
   what the user learns.
4. *flux uptime on rank 2 reports join state*: Flux's leaf serves
   ``uptime`` while in its ``join`` state.  kvbroker's cannot be asked
   before it joins (no socket: the same hint, exit 1; documented).  What
   it says instead is in its log: after ``tbon.connect_timeout`` without a
   connection to its parent it logs a WARNING naming the parent's rank and
   address, and it goes on waiting (asserted: it is still running, and it
   joins later).
5. *flux dmesg on rank 2 works*: before it joins, ``dmesg`` attached to it
   fails as in 3 (documented); from rank 0, ``dmesg --rank 2`` is refused
   at once, "No route to host".  Once rank 1 starts and both join,
   ``dmesg`` on rank 2 works and still holds what it logged while it waited
   (the WARNING of 4): its ring is kept from its start, not from its join.

Beyond Flux's file: a leaf waiting for a parent that never comes must
still stop when told to (SIGTERM: exit 0, as any rank stopped on purpose,
docs/guide.md), promptly and without a traceback.  And case 3 once more
for a leaf restarted by hand in its old run directory after a crash
(SIGKILL left its socket behind) while its router is down too: a client
must still be told the rank may be waiting for its parent: the rank
takes the old socket over only once admitted (broker/broker.py,
deliberately), so the socket refuses the connection, and the hint for
that names a restarted rank waiting for its parent too (until 2026-12-05
it said only "has the instance stopped?": found by this file).
"""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

from test_broker_support import run_cli, wait_until
from test_multihost import _connect_when_listening, exit_codes, keyed_config
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)

WAITING_HINT = "is that rank still waiting for its parent (kvbroker broker)?"


def _log(tmp_path: Path, rank: int, nth: int) -> str:
    path = tmp_path / f"stderr{rank}-{nth}"
    return path.read_text() if path.exists() else ""


async def test_t3302_a_leaf_before_its_router_refuses_clients_then_joins(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    host = socket.gethostname()
    config = await keyed_config(tmp_path, 3, 1)
    rank0 = await brokers(config, 0)
    h = await _connect_when_listening(rank0.uri)
    await h.close()
    rank2 = await brokers(config, 2, "-S", "tbon.connect_timeout=1")  # (case 1)
    async with asyncio.timeout(120):
        # (case 4, its log) the leaf says it has no parent, and goes on
        warned = (f"no connection to parent rank 1 at {_endpoint(config, 1)} after")

        async def said() -> bool:
            return warned in _log(tmp_path, 2, 1)

        await wait_until(said, "rank 2 to warn it has no connection to rank 1", 60)
        assert "WARNING" in next(line for line in _log(tmp_path, 2, 1).splitlines()
                                 if warned in line)
        assert rank2.proc.returncode is None

        # (case 2) rank 0 sees rank 2 behind the missing rank 1
        rc, out, err = await run_cli("overlay", "status", uri=rank0.uri)
        assert rc == 1 and f"    2 {host}: offline (behind rank 1, not joined)" in \
            out.splitlines(), (out, err)

        # (cases 3, 4, 5) attached to rank 2: every command fails, saying why
        for argv in (["exec", "--", "true"], ["kvs", "put", "a=1"], ["uptime"], ["dmesg"]):
            rc, out, err = await run_cli(*argv, uri=rank2.uri)
            assert (rc, out) == (1, ""), (argv, err)
            assert WAITING_HINT in err, (argv, err)
            assert "Traceback" not in err, (argv, err)
        # (case 5) from rank 0: refused at once
        rc, out, err = await run_cli("dmesg", "--rank", "2", uri=rank0.uri)
        assert (rc, out) == (1, ""), err
        assert "No route to host" in err, err

        rank1 = await brokers(config, 1)
        for r in (rank0, rank1, rank2):
            await r.ready()
        rc, out, err = await run_cli("uptime", uri=rank2.uri)
        assert rc == 0 and out.rstrip().endswith("size 3"), (out, err)
        rc, out, err = await run_cli("dmesg", uri=rank2.uri)
        assert rc == 0, err
        assert warned in out, out  # what it logged while it waited
    rank0.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank0, rank1, rank2], tmp_path) == [0, 0, 0]


async def test_t3302_a_leaf_waiting_for_its_parent_stops_on_sigterm(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    config = await keyed_config(tmp_path, 3, 1)
    rank2 = await brokers(config, 2, "-S", "tbon.connect_timeout=0.5")
    async with asyncio.timeout(60):
        async def waiting() -> bool:
            return "no connection to parent rank 1" in _log(tmp_path, 2, 0)

        await wait_until(waiting, "rank 2 to say it waits for rank 1", 40)
        rank2.proc.send_signal(signal.SIGTERM)
        assert await exit_codes([rank2], tmp_path, 20) == [0]
    logged = _log(tmp_path, 2, 0)
    assert "Traceback" not in logged, logged
    assert rank2.proc.stdout is not None and await rank2.proc.stdout.read() == b""


async def test_t3302_a_restarted_leaf_waiting_for_its_parent_says_so_over_a_stale_socket(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    config = await keyed_config(tmp_path, 3, 1)
    ranks = [await brokers(config, r) for r in range(3)]
    for r in ranks:
        await r.ready()
    async with asyncio.timeout(90):
        ranks[2].proc.kill()  # a crash: its socket stays
        ranks[1].proc.kill()  # and its router's host goes
        assert await exit_codes(ranks[1:], tmp_path) == [-signal.SIGKILL] * 2
        again = await brokers(config, 2, "--rundir", str(ranks[2].rundir),
                              "-S", "tbon.connect_timeout=0.5")

        async def said() -> bool:
            return "no connection to parent rank 1" in _log(tmp_path, 2, 3)

        await wait_until(said, "the restarted rank 2 to wait for rank 1", 40)
        rc, out, err = await run_cli("exec", "--", "true", uri=ranks[2].uri)
        assert (rc, out) == (1, ""), err
        assert "waiting for its parent" in err, err
        again.proc.send_signal(signal.SIGTERM)
        assert await exit_codes([again], tmp_path) == [0]


def _endpoint(config: Path, rank: int) -> str:
    from broker.bootstrap import load
    return str(load(str(config)).endpoints()[rank])
