"""flux-core t0025-broker-state-machine, as kvbroker has it.

Flux's broker walks a state machine (join, config-sync, init: rc1,
quorum, run: rc2 = the initial program, cleanup, shutdown, finalize: rc3,
goodbye, exit), logs each transition, reports it on the
``state-machine.monitor`` streaming RPC, and has attributes bounding some
of its states (``broker.quorum``, ``-warn``, ``cleanup-timeout``,
``shutdown-warn``, ``shutdown-timeout``, ``exit-norestart``,
``unload-builtins-timeout``).  kvbroker has no rc scripts and no runlevels
(docs/cli.md, start: an empty ``broker.rc1_path``/``rc3_path`` is taken and
ignored, another refused): a rank is up once its whole subtree has joined
(``ready``), ``kvbroker start`` runs its command once every rank is up,
and stops the instance when the command exits (docs/guide.md, Starting an
instance; exit statuses: docs/guide.md, Running ranks as services).

Flux's cases, in order, and what each is here:

* quorum reached with 1, 2 and 3 TBON levels (size 3, 4, 8; ``groups get
  broker.online`` is all ranks): ``start --size N --fanout 2`` runs its
  command with every rank up -- ``overlay status`` shows the whole tree
  full (below).
* ``broker.quorum`` set on the command line to the size (quorum = all),
  and the compatibility values 0 and ``0-1`` at size 2 (Flux: "assuming
  full quorum"): that is what kvbroker always does, so a Flux command line
  saying so runs as written, as an empty ``rc1_path`` does: taken and
  ignored (it was refused, "unknown attribute (did you mean
  broker.starttime?)", until 2026-12-05: found by this file).
* malformed (``9-10``) and too big (``99``) ``broker.quorum`` fail
  ("Error parsing broker.quorum"): refused, exit 2, saying what kvbroker
  does instead, as are ``broker.cleanup-timeout``, ``shutdown-warn``,
  ``shutdown-timeout`` and ``exit-norestart`` (they met the hint "did you
  mean broker.starttime?", an attribute ``-S`` itself refuses, until
  2026-12-05).
* builtins-fail (a bad config for a built-in module): a module that cannot
  be loaded stops the start-up, exit 2, naming it -- tests/test_broker_modules.py
  and docs/cli.md (``broker.modules``); not repeated.
* late joiner with ``broker.quorum=1`` (rc2 runs with rank 1 still in
  rc1): does not apply under ``start`` (it waits for every rank); ranks
  started late across hosts, with rank 0 serving meanwhile:
  tests/test_flux_conformance_t3301.py.
* quorum-get RPC fails on rank > 0; ``state-machine.monitor`` reports
  INIT(3) in rc1, RUN(5) in rc2, CLEANUP(6) in a cleanup script,
  FINALIZE(8) in rc3: do not apply (no state machine, no rc or cleanup
  scripts, no such service).
* state transitions logged at size 1 and 2, on rank 0 and rank 1: there
  are no states to log; what a rank logs at ``info`` about its end is
  kvbroker's counterpart: each rank says why it stops (``stopping:
  signal SIGTERM``) and rank 0 that its child stopped on purpose (below).
* rc1 failure (exit 1), rc3 failure (exit 1), exit-norestart: no rc
  scripts (a non-empty ``broker.rc1_path`` is refused, exit 2:
  tests/test_flux_conformance_t0001.py).  rc2 failure: ``start -- false``
  exits 1, the command's status (t0001, "failing command passes
  through").
* ``broker.quorum-warn`` (none, 3h, x, "quorum delayed/reached" logged):
  does not apply (no quorum to wait for past start-up); refused, exit 2
  (any unknown ``broker.`` attribute is; t0001).  Where Flux waits for
  its quorum without end (warning), ``kvbroker start`` gives up on ranks
  not ready within 60 s that say no progress
  (tests/test_flux_conformance_t0003.py, a hung module); rank 0 busy with
  a ``-S content.restore`` of a large archive says ``starting COUNT`` as
  it reads it, and each line gives the start its 60 s again (until
  2026-12-05 a fixed 60 s cut such a restore of 700,000 keys off, the
  store emptied and half restored: found by this file's helper; the test
  is tests/test_kvs_archive.py's long-restore case).
* ``broker.cleanup-timeout`` (default none, 3h, x; a hanging cleanup gets
  SIGHUP after it when the initial program SIGTERMs the broker, exit 129):
  no cleanup scripts.  The command is what outlives a stop here: it gets
  SIGTERM, then SIGKILL after ``--stop-timeout`` (tests/test_cli_broker.py,
  ``..._kills_a_command_ignoring_sigterm``).  What the SIGTERM to rank 0
  does is tested below: rank 0 stops cleanly (status 0, a stop asked
  for), ``start`` says "rank 0 was stopped (signal SIGTERM)" and exits as
  its command does (143), as for ``kvbroker shutdown`` -- the same stop
  asked another way (tests/test_cli_overlay.py).  Until 2026-12-05 it
  said "rank 0 exited unexpectedly, with status 0" and exited 1 (found by
  this file).
* ``broker.shutdown-warn`` / ``shutdown-timeout`` (rc3 hanging on rank >
  0, "shutdown delayed" / "shutdown timeout" logged): a rank that does not
  exit within ``--rank-stop-timeout`` of its SIGTERM is killed and named,
  exit 1 -- tests/test_cli_broker.py, ``test_start_says_which_rank_it_had_to_kill``.
* ``broker.unload-builtins-timeout`` (default 1m; a hanging overlay
  unload): no such attribute (refused, exit 2); a rank hanging as it stops
  is the case just above.

Every case runs ``kvbroker start`` as a real process.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys

import pytest
from test_broker_support import KVBROKER
from test_cli_broker import start_process
from test_flux_conformance_t0001 import kvb

SLEEP = f'exec {sys.executable} -c "import time; time.sleep(60)"'


def tree_order(size: int, fanout: int = 2, rank: int = 0) -> list[int]:
    """The ranks of ``rank``'s subtree as ``overlay status`` lists them:
    depth first, each under its parent."""
    out = [rank]
    for child in range(fanout * rank + 1, min(fanout * rank + fanout, size - 1) + 1):
        out += tree_order(size, fanout, child)
    return out


@pytest.mark.parametrize("size", [3, 4, 8])  # 1, 2 and 3 levels below rank 0
async def test_every_rank_is_up_when_the_command_runs(size: int) -> None:
    host = socket.gethostname()
    rc, out, err = await kvb("start", "--size", str(size), "--fanout", "2", "--",
                             KVBROKER, "overlay", "status")
    assert rc == 0, (out, err)
    assert [line.strip() for line in out.splitlines()] == [
        f"{r} {host}: full" for r in tree_order(size)], out


@pytest.mark.parametrize(("size", "quorum"), [(3, "3"), (3, "0-2"), (1, "0"), (2, "0-1")])
async def test_flux_s_full_quorum_runs_as_written(size: int, quorum: str) -> None:
    rc, out, err = await kvb("start", "--size", str(size), "-S", f"broker.quorum={quorum}",
                             "--", KVBROKER, "attr", "get", "size")
    assert (rc, out) == (0, f"{size}\n"), err


@pytest.mark.parametrize("attr", ["broker.quorum=9-10", "broker.quorum=99",
                                  "broker.cleanup-timeout=3h", "broker.shutdown-warn=1s",
                                  "broker.shutdown-timeout=1s", "broker.exit-norestart=99"])
async def test_flux_s_state_machine_attributes_are_refused_without_a_misleading_hint(
        attr: str) -> None:
    rc, out, err = await kvb("start", "--size", "2", "-S", attr, "--", "true")
    assert (rc, out) == (2, ""), err
    assert attr.partition("=")[0] in err, err
    # the hint must not name what -S cannot set (a rank sets it itself)
    for own in ("broker.starttime", "broker.pid"):
        assert own not in err, err


async def test_each_rank_says_why_it_stops_and_rank_0_that_its_child_stopped() -> None:
    """Flux's transitions logged at size 2, on rank 0 and rank 1, as
    kvbroker has them: at ``info`` (Flux's ``-Slog-stderr-level=6``).
    ``start`` sends every rank SIGTERM; rank 1 may hear it, or its
    parent's stop, first (Flux's rank 1: "shutdown: run->cleanup"), and
    rank 0 says it stopped on purpose."""
    rc, out, err = await kvb("start", "--size", "2", "-S", "log-stderr-level=6",
                             "--", "true")
    assert (rc, out) == (0, ""), err
    assert "kvbroker[0]: INFO kvbroker: stopping: signal SIGTERM\n" in err, err
    why = re.search(r"^kvbroker\[1\]: INFO kvbroker: stopping: (.*)$", err, re.M)
    assert why is not None and why[1] in ("signal SIGTERM", "parent rank 0 stops"), err
    stopped = re.search(r"^kvbroker\[0\]: INFO kvbroker.overlay: child rank 1 stopped "
                        r"\((.*)\)$", err, re.M)
    assert stopped is not None, err
    assert stopped[1] in ("signal SIGTERM", "this rank told it to"), err
    assert "WARNING" not in err and "ERROR" not in err, err


@pytest.mark.parametrize("rank", [0, 1])
async def test_a_rank_sigtermed_under_start_is_a_stop_not_a_failure(rank: int) -> None:
    """Flux's "initial program SIGTERMs the broker": the instance stops and
    the command is stopped with it; ``start`` exits as the command does
    (here SIGTERM: 143; Flux's cleanup gets SIGHUP, 129)."""
    script = f"kill -TERM $({KVBROKER} attr get --rank {rank} broker.pid); {SLEEP}"
    rc, out, err = await kvb("start", "--size", "2", "--", "sh", "-c", script)
    assert "unexpectedly" not in err, err
    assert rc == 128 + signal.SIGTERM, err


async def test_rank_0_sigtermed_under_start_without_a_command_exits_0() -> None:
    async with start_process("--size", "2") as proc:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            uri = (await proc.stdout.readline()).decode().strip()
            rc, pid, err = await kvb("attr", "get", "broker.pid", env={"KVBROKER_URI": uri})
            assert rc == 0, err
            os.kill(int(pid), signal.SIGTERM)
            _, err_b = await proc.communicate()
    assert b"unexpectedly" not in err_b, err_b
    assert proc.returncode == 0, err_b
