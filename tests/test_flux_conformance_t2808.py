"""flux-core t/t2808-shutdown-cmd.t (``flux shutdown``) against real kvbroker
ranks.  kvbroker has no jobs, no rc scripts and no broker state machine:
``kvbroker shutdown [-r R] [-t SECONDS]`` asks rank 0 (or rank R) to stop
(docs/cli.md "overlay status, ..., shutdown"), and the KVS dump at stop is
the ``content.dump`` attribute, set at start (docs/kvs.md "Garbage
collection across a restart").

Flux's cases, in order, and what each becomes:

1.  '-h prints custom usage' (``Usage:.*TARGET``) -> ``shutdown -h``
    prints its usage line, exit 0; there is no TARGET (no jobs):
    :func:`test_usage_and_a_wrong_uri_send_nothing`.
2.  'fails on unknown option' -> exit 2, ``unrecognized arguments:
    --notopt`` (Flux: exit 1, "unrecognized option"; exit 2 is kvbroker's
    rule for usage errors, docs/cli.md Conventions: documented).
3.  'fails if FLUX_URI is set wrong' -> ``KVBROKER_URI=noturi``: exit 1,
    ``cannot connect to broker at KVBROKER_URI=noturi`` (a word without
    ``://`` is taken as a socket path, broker/handle.py ``parse_uri``).
4.  'fails if job argument is not a valid URI' and
5.  'fails if job argument is unknown' -> a TARGET word is a usage error
    (exit 2) and, above all, shuts nothing down: the instance still serves.
6.  'run a test job to completion',
7.  'fails if job is not running',
8.-11. batch job shut down by JOBID, its rc3 and ``finalize->goodbye`` log
    lines, the job's SIGHUP status,
12.-13. a non-instance job ("URI not found"), its cancel,
17.-18. ``--verbose`` (debug log lines streamed),
19.-20. ``--background`` on a multi-node batch job -> not applicable: no
    jobs, no log streaming (kvbroker's shutdown prints nothing and has no
    ``--quiet``/``--verbose``; it returns once the rank it is attached to
    has stopped, and ``--background`` on rank 0's answer, as Flux's:
    :func:`test_shutdown_returns_once_the_instance_has_stopped`).
14. 'instance with no initial program', 15. '--quiet works',
16. 'successful shutdown output is empty' -> ``kvbroker start`` without a
    command, ``kvbroker shutdown``: nothing on stdout or stderr, exit 0, and
    start exits 0 (:func:`test_shutdown_with_a_dump_and_a_restore_after`).
    (Flux's retry while the instance is not yet running has no
    counterpart: ``start`` prints the URI once every rank serves.)
21. 'as initial program does not hang' (``flux start flux shutdown``, 129)
    -> ``kvbroker start -- kvbroker shutdown`` ends, saying the instance
    was shut down, exit as its command (docs: "stops it ... and exits as it
    does"): killed by SIGTERM (143) if it was still there, else 0;
    :func:`test_shutdown_as_the_initial_program_does_not_hang`.  Which of
    the two is a race (Flux's is always 129, its broker kills the
    program): ``kvbroker shutdown`` now waits for rank 0's end, and
    ``start`` hears of the shutdown first and stops it (143) nearly
    always, but a loaded machine may let the command see the end first
    (0).  DIFFERENCE, documented (docs/cli.md, shutdown).
22.-27. ``--dump=dump.tgz``, the archive, a restart from it
    (``-Scontent.restore=dump.tgz``), the job listed from before -> the
    dump is chosen at start (``-S content.dump=FILE``; the attribute may not
    be changed on a running rank, so there is no ``--dump`` at shutdown:
    documented in the attribute table); shut down with ``kvbroker
    shutdown``, the archive holds the KVS, a restart with ``content.restore``
    has the key from before.
28.-30. ``--gc`` and ``dump/RESTORE`` -> the same with ``content.dump=auto``
    in a statedir (``STATEDIR/dump/RESTORE``) and ``content.restore=auto``:
    :func:`test_shutdown_with_a_dump_and_a_restore_after`.  (Restores
    without ``kvbroker shutdown`` are in tests/test_flux_conformance_t2810.py.)
31.-end. ``kvs.gc-threshold``, ``-y``/``-n``, the y/n prompt, ``--skip-gc``
    -> not applicable: kvbroker has no gc threshold (``kvbroker kvs gc``
    collects online, docs/cli.md "kvs gc"), so shutdown asks nothing.

Already elsewhere: ``shutdown -r R`` stops R's subtree and ``start`` stops
(tests/test_cli_overlay.py), a guest's EPERM (tests/test_broker_guests.py),
``-t`` on a stopped rank (tests/test_cli_stopped_rank.py), the rank bounds
(tests/test_cli_broker.py).

Beyond Flux's: ``-r`` a rank the instance does not have; ``shutdown`` run
on a leaf stops the whole instance (Flux's refuses on rank > 0; kvbroker's
``-r`` defaults to 0: docs); two shutdowns at once both end (the second
fails "cannot connect ... has the instance stopped?" or succeeds); a guest
running the command is refused, saying why.

Flux's ``flux shutdown`` waits for the instance to finish (it streams rank
0's log until then; only ``--background`` returns at once), so t2808 reads
the dump right after it.  So does ``kvbroker shutdown`` (``--background``
too): until 2026-12-05 it returned on rank 0's answer, before rank 0 had
stopped and written its dump (found by this file).
"""

from __future__ import annotations

import asyncio
import os
import signal
import tarfile
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli

T = 30.0


async def serve(*args: str, cwd: Path | None = None) -> tuple[asyncio.subprocess.Process, str]:
    """``kvbroker start ARGS`` without a command, and the URI it prints."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", *args, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=cwd)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.startswith(b"local://"), line
    return proc, line.decode().strip()


async def ended(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    _, err = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_usage_and_a_wrong_uri_send_nothing(start_instance, connect) -> None:
    """Cases 1-5: help, an unknown option, a TARGET word, a URI that is
    none; none of them stops the instance."""
    inst = await start_instance(size=2)
    uri = inst.uri(0)
    rc, out, err = await run_cli("shutdown", "-h", uri=uri)
    assert rc == 0 and out.startswith("usage: kvbroker shutdown [-h] [--rank N]"), (out, err)
    for word, why in (("--notopt", "unrecognized arguments: --notopt"),
                      ("baduri", "unrecognized arguments: baduri"),
                      ("12345", "unrecognized arguments: 12345")):
        rc, out, err = await run_cli("shutdown", word, uri=uri)
        assert (rc, out) == (2, ""), err
        assert err.startswith("usage: kvbroker shutdown ") and why in err, err
    rc, out, err = await run_cli("shutdown", uri="noturi")
    assert (rc, out) == (1, ""), err
    assert err.startswith("kvbroker: shutdown: cannot connect to broker at "
                          "KVBROKER_URI=noturi: "), err
    h = await connect(inst, 1)
    assert (await h.ping(0))["rank"] == 0  # (still serving)
    assert all(p.returncode is None for p in inst.procs)


async def test_shutdown_with_a_dump_and_a_restore_after(tmp_path: Path) -> None:
    """Cases 14-16 and 22-30: an instance without a command, its KVS dumped
    as it stops (``content.dump``, chosen at start), shut down by
    ``kvbroker shutdown``, which says nothing; a restart restores the dump.
    With a named archive, then ``auto`` in a statedir (Flux's ``--gc``)."""
    async with asyncio.timeout(2 * T):
        archive = tmp_path / "dump.tgz"
        proc, uri = await serve("-s", "2", "-S", f"content.dump={archive}", cwd=tmp_path)
        rc, _, err = await run_cli("kvs", "put", "job.one=before", uri=uri)
        assert rc == 0, err
        assert await run_cli("shutdown", uri=uri) == (0, "", "")
        rc, err = await ended(proc)
        assert rc == 0, err
        with tarfile.open(archive) as tar:
            assert "job/one" in tar.getnames()
        rc, out, err = await run_cli("start", "-s", "2", "-S", f"content.restore={archive}",
                                     "--", KVBROKER, "kvs", "get", "job.one")
        assert (rc, out) == (0, "before\n"), err

        state = tmp_path / "state"
        proc, uri = await serve("-s", "2", "--statedir", str(state), "-S", "content.dump=auto")
        rc, _, err = await run_cli("kvs", "put", "job.two=before", uri=uri)
        assert rc == 0, err
        assert await run_cli("shutdown", uri=uri) == (0, "", "")
        rc, err = await ended(proc)
        assert rc == 0, err
        link = state / "dump" / "RESTORE"
        with tarfile.open(link) as tar:
            assert "job/two" in tar.getnames()
        rc, out, err = await run_cli("start", "-s", "2", "--statedir", str(state),
                                     "-S", "content.restore=auto",
                                     "--", KVBROKER, "kvs", "get", "job.two")
        assert (rc, out) == (0, "before\n"), err
        assert not link.is_symlink()  # (used once)


async def test_shutdown_returns_once_the_instance_has_stopped(tmp_path: Path) -> None:
    """As t2808 reads ``dump/RESTORE`` right after ``flux shutdown --gc``: by
    the time ``kvbroker shutdown`` returns, the dump is written and the
    ranks are gone.  (A few MB of values that do not compress: a dump that
    takes a moment.)"""
    state = tmp_path / "state"
    blob = tmp_path / "blob"
    blob.write_bytes(os.urandom(8 << 20))
    proc, uri = await serve("-s", "2", "--statedir", str(state), "-S", "content.dump=auto")
    try:
        async with asyncio.timeout(2 * T):
            rc, _, err = await run_cli("kvs", "put", "-r", "big=-", uri=uri,
                                       input=blob.read_bytes())
            assert rc == 0, err
            assert await run_cli("shutdown", uri=uri) == (0, "", "")
            done_at_return = ((state / "dump" / "RESTORE").exists(), proc.returncode)
            rc, err = await ended(proc)
            assert rc == 0, err
            assert (state / "dump" / "RESTORE").exists()
            assert done_at_return[0], "no dump yet when kvbroker shutdown returned"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_shutdown_as_the_initial_program_does_not_hang() -> None:
    """Case 21: the command that shuts its own instance down ends with it."""
    rc, out, err = await run_cli("start", "-s", "2", "--", KVBROKER, "shutdown", timeout=T)
    assert rc in (0, 128 + signal.SIGTERM), (rc, err)
    assert "kvbroker: the instance was shut down; stopping the command" in err, err
    assert "Traceback" not in err


async def test_a_rank_the_instance_does_not_have(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    rc, out, err = await run_cli("shutdown", "-r", "7", uri=inst.uri(0))
    assert (rc, out, err) == (1, "", "kvbroker: shutdown: No route to host (no route to "
                                     "rank 7: the instance has ranks 0-1)\n")
    h = await connect(inst, 0)
    assert (await h.ping(1))["rank"] == 1


async def test_shutdown_on_a_leaf_stops_the_whole_instance(start_instance) -> None:
    """Attached to rank 3 (below rank 1), without ``-r``: rank 0 and with
    it every rank stops, each exit 0."""
    inst = await start_instance(size=4, fanout=2)
    assert await run_cli("shutdown", uri=inst.uri(3)) == (0, "", "")
    async with asyncio.timeout(T):
        assert [await p.wait() for p in inst.procs] == [0, 0, 0, 0]


async def test_two_shutdowns_at_once_both_end(start_instance) -> None:
    """Flux retries a shutdown refused in the wrong state; here the second
    of two at once either succeeds or fails saying so -- no hang, no
    traceback -- and the instance stops."""
    inst = await start_instance(size=4, fanout=2)
    uri = inst.uri(0)
    results = await asyncio.gather(*(run_cli("shutdown", uri=uri, timeout=T)
                                     for _ in range(2)))
    assert (0, "", "") in results, results
    for rc, out, err in results:
        assert rc in (0, 1) and out == "" and "Traceback" not in err, results
        if rc:
            assert err.startswith("kvbroker: shutdown: "), err
    async with asyncio.timeout(T):
        assert [await p.wait() for p in inst.procs] == [0, 0, 0, 0]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="runs a command as another uid (root only)")
async def test_a_guest_may_not_shut_down_from_the_command(start_instance, connect) -> None:
    """``kvbroker shutdown`` run by another user (the instance admits
    guests): EPERM saying why, exit 1, for the instance and for a rank;
    nothing stops.  (The request's refusal is in test_broker_guests.py.)"""
    from test_broker_guests import ALLOW, run_guest_cli

    inst = await start_instance(size=2, attrs=ALLOW)
    for args in ((), ("-r", "1")):
        rc, out, err = await run_guest_cli(inst.uri(1), "shutdown", *args)
        assert (rc, out, err) == (1, "", "kvbroker: shutdown: Operation not permitted (only "
                                         "the instance owner may shut the instance down)\n")
    h = await connect(inst, 0)
    assert (await h.ping(1))["rank"] == 1


async def test_shutdown_background_returns_on_the_answer(start_instance, connect) -> None:
    """``--background`` (Flux's): ``shutdown`` returns once rank 0 answers,
    without waiting for the stop; ``-r R`` of a rank not above the one
    attached to returns on the answer too (nothing of the attached rank's
    end to wait for), and that rank still serves."""
    inst = await start_instance(size=3)
    assert await run_cli("shutdown", "-r", "2", uri=inst.uri(1)) == (0, "", "")
    h = await connect(inst, 1)
    assert (await h.ping(1))["rank"] == 1
    assert await run_cli("shutdown", "--background", uri=inst.uri(0)) == (0, "", "")
    async with asyncio.timeout(T):
        assert [await p.wait() for p in inst.procs] == [0, 0, 0]
