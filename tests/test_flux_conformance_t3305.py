"""flux-core t3305-system-rpctrack-up, as kvbroker has it: ``overlay
parentof`` and ``overlay disconnect`` put through their paces on an
instance across hosts (``kvbroker broker --config``, one process per rank,
over tcp with CURVE), each rank saying it runs on its own host
(``-S hostname=fakeN``, as Flux's ``fake0``..``fake14``).  Flux runs 15
ranks at fanout 2 and cuts off rank 6 (children 13, 14); here 7 ranks at
fanout 2 (0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6) and rank 2 (children 5, 6) is
cut off: the same shape, a router with two leaves, at half the processes
on a 2-core machine.

Flux's cases, in order, and what each becomes here:

1. *parentof fails with missing RANK*: a usage error, exit 2 (kvbroker's
   convention for a command line that cannot mean anything; Flux's
   exits 1 -- the documented split of usage errors from failures).
2. *parentof fails with rank out of range* (42): exit 1, saying so.
3. *parentof fails with rank 0*: exit 1, ``rank 0 has no parent``.
4. *parentof reflects k=2 topology*: every rank's parent, 1-6.
5. *disconnect fails with missing target*: usage error, exit 2.
6. *disconnect fails on incorrect parent* (``--parent 0`` a grandchild):
   exit 1, the rank is not a connected child of rank 0 (it says whom it
   asked first, on stdout, then the refusal); nothing is cut (``overlay
   status`` still full).
7. *construct FLUX_URI for rank 13*: the URI of rank 6 (a leaf under the
   router to be cut), ``attr get rank`` through it says 6.
8. *start background RPC to rank 0 via 13*: a request from a client of
   rank 6 to rank 0 that rank 0 holds unanswered (``kvs.wait-version``
   of a version never reached), and, as Flux's, a health check attached to
   rank 6 that waits (``overlay status --wait partial``: kvbroker's
   ``--wait`` polls, and knows no *lost* state of rank 0).
9. *ensure background request was received on rank 0*: a ping from the
   same client to rank 0 answered after it (requests keep their order on
   one link).
10. *disconnect host fake6*: ``overlay disconnect fake2`` -- by host, as
    Flux's -- exit 0, ``asking rank 0 to disconnect child rank 2``.
11-13. *rank 6 exited with rc=1*, *rank 13/14 exited*: rank 2 exits 1, and
    its children stop with it (Flux: may fail; here exit 1 too, each lost
    its parent).
14. *background RPC fails*: the request of 8 fails, EHOSTUNREACH or
    ECONNRESET (Flux allows either: the answer races the exits); rank 0
    drops the wait it held for that client (``kvs.stats-get`` waiters back
    to 0: the lost subtree's clients are disconnected there), and the
    health check exits 1, saying why (or printing ``partial``, if it saw
    rank 0 partial before rank 6 stopped), without a traceback.
15. *report health status*: ``overlay status`` exits 1, partial.
16. *health status for rank 6 is lost*: Flux prints ``6 fake6: lost
    administrative disconnect``.  Here rank 2 shows lost, under host
    fake2, saying ``disconnected: kvbroker overlay disconnect, by uid N``
    (until 2026-12-05 only ``rank 2 is unreachable``: found by this file).
17. *attempt to disconnect rank 6 again fails*: exit 1, ``No route to
    host (rank 6 is already lost)``, as Flux; one that is not a child of
    the rank asked (6's) ``No such device or address (rank 6 is not a
    connected child of rank 0)`` (both were ENOENT's ``No such file or
    directory`` until 2026-12-05: found by this file).

(tests/test_flux_conformance_t3304.py has the same request through a cut
router on unix links at fanout 1; tests/test_cli_overlay.py the hung-rank
disconnect and the refusals of ranks the instance does not have.)
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
from pathlib import Path

import pytest
from test_broker_support import run_cli, stats, wait_until
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import exit_codes, keyed_config, named

from broker.errors import RemoteError
from broker.handle import Handle

NEVER = {"namespace": "primary", "rootseq": 10**9}  # a version wait that never ends
HOSTS = [f"fake{r}" for r in range(7)]


@pytest.fixture
async def instance(tmp_path: Path, brokers):  # noqa: F811
    config = await keyed_config(tmp_path, 7, 2, hosts=HOSTS)
    ranks = [await brokers(config, r, *named(HOSTS[r])) for r in range(7)]
    for r in ranks:
        await r.ready()
    yield ranks
    ranks[0].proc.send_signal(signal.SIGTERM)


async def test_t3305_parentof(instance) -> None:
    uri = instance[0].uri
    rc, out, err = await run_cli("overlay", "parentof", uri=uri)  # (1)
    assert (rc, out) == (2, ""), err
    assert "RANK" in err, err
    assert await run_cli("overlay", "parentof", "42", uri=uri) == (  # (2)
        1, "", "kvbroker: overlay parentof: 42 is not a rank of this instance (size 7)\n")
    assert await run_cli("overlay", "parentof", "0", uri=uri) == (  # (3)
        1, "", "kvbroker: overlay parentof: rank 0 has no parent\n")
    got = [(await run_cli("overlay", "parentof", str(r), uri=uri))[:2]
           for r in range(1, 7)]  # (4)
    assert got == [(0, f"{p}\n") for p in (0, 0, 1, 1, 2, 2)]


async def test_t3305_disconnect_reason_shows_in_status(instance) -> None:
    uri = instance[0].uri
    rc, out, err = await run_cli("overlay", "disconnect", "fake2", uri=uri)
    assert rc == 0, err
    assert await exit_codes([instance[2]], instance[0].rundir.parent) == [1]
    rc, out, err = await run_cli("overlay", "status", "--timeout", "5", uri=uri)
    line = next(x for x in out.splitlines() if x.strip().startswith("2 "))
    assert line.startswith("  2 fake2: lost ("), out  # (not the defect's part)
    assert re.fullmatch(r"  2 fake2: lost \(.*disconnect.*\)", line), out


async def test_t3305_disconnect_a_router_fails_its_leaf_s_request_upward(
        instance, tmp_path: Path) -> None:
    uri = instance[0].uri
    async with asyncio.timeout(120):
        rc, out, err = await run_cli("overlay", "disconnect", uri=uri)  # (5)
        assert (rc, out) == (2, ""), err
        rc, out, err = await run_cli("overlay", "disconnect", "--parent", "0", "6",
                                     uri=uri)  # (6)
        assert (rc, out) == (1, "asking rank 0 to disconnect child rank 6\n"), err
        assert err == ("kvbroker: overlay disconnect: No such device or address "
                       "(rank 6 is not a connected child of rank 0)\n")
        rc, out, err = await run_cli("overlay", "status", "--timeout", "10", uri=uri)
        assert rc == 0, (out, err)  # nothing was cut

        uri6 = instance[6].uri  # (7)
        assert await run_cli("attr", "get", "rank", uri=uri6) == (0, "6\n", "")
        h6 = await Handle.connect(uri6)
        try:
            waiting = h6.rpc("kvs.wait-version", NEVER, nodeid=0)  # (8)
            assert (await h6.ping(0))["rank"] == 0  # (9)
            h0 = await Handle.connect(uri)

            async def waiters(n: int) -> bool:
                st = await h0.rpc("kvs.stats-get", {}, nodeid=0)
                return bool(st["namespaces"]["primary"]["waiters"] == n)

            await wait_until(lambda: waiters(1), "rank 0 to hold the wait", 30)
            # and Flux's own: a health check waiting through rank 6 (for a
            # partial rank 0, which a full instance is not)
            checking = asyncio.ensure_future(run_cli(
                "overlay", "status", "--wait", "partial", "--summary", uri=uri6))

            async def attached() -> bool:
                return bool((await stats(h6, 6))["clients"] == 2)

            await wait_until(attached, "the health check to attach to rank 6", 30)

            rc, out, err = await run_cli("overlay", "disconnect", "fake2", uri=uri)  # (10)
            assert (rc, out) == (0, "asking rank 0 to disconnect child rank 2\n"), err
            # (11-13)
            assert await exit_codes([instance[r] for r in (2, 5, 6)], tmp_path) == [1, 1, 1]
            with pytest.raises(RemoteError) as info:  # (14)
                await waiting
            assert info.value.errnum in (errno.EHOSTUNREACH, errno.ECONNRESET)
            # rank 0 heard the clients below the cut go: it holds nothing
            await wait_until(lambda: waiters(0), "rank 0 to drop the lost client's wait", 30)
            await h0.close()
            rc, out, err = await checking  # (it may have seen partial first)
            assert rc == 1 and out in ("", "partial\n"), (out, err)
            assert err == "" if out else "kvbroker: overlay status: " in err, err
            assert "Traceback" not in err, err
        finally:
            await h6.close()

        rc, out, err = await run_cli("overlay", "status", "--timeout", "10", uri=uri)  # (15)
        lines = out.splitlines()
        assert rc == 1 and lines[0] == "0 fake0: partial", (out, err)
        assert "  1 fake1: full" in lines, out
        assert re.search(r"^  2 fake2: lost \(", out, re.M), out  # (16)
        for r in (5, 6):
            assert re.search(rf"^    {r} fake{r}: lost \(", out, re.M), out
        rc, out, err = await run_cli("overlay", "errors", "--timeout", "10", uri=uri)
        assert (rc, err) == (0, ""), err
        assert out.splitlines() == [  # (2 says why; 5-6 are out of reach behind it)
            f"2 fake2: lost (disconnected: kvbroker overlay disconnect, by uid {os.getuid()})",
            "5-6 fake[5-6]: lost (rank 2 was lost: disconnected: kvbroker overlay disconnect, "
            f"by uid {os.getuid()})"], out

        rc, out, err = await run_cli("overlay", "disconnect", "2", uri=uri)  # (17)
        assert (rc, out) == (1, "asking rank 0 to disconnect child rank 2\n"), err
        assert "rank 2 is already lost" in err, err
        assert (await run_cli("ping", "1", uri=uri))[0] == 0  # the rest serves


async def test_t3305_disconnect_refusals_say_what_is_wrong(instance) -> None:
    uri = instance[0].uri
    rc, _, err = await run_cli("overlay", "disconnect", "--parent", "0", "6", uri=uri)
    assert rc == 1 and "not a connected child of rank 0" in err, err
    assert "No such file or directory" not in err, err
    rc, _, err = await run_cli("overlay", "disconnect", "6", uri=uri)
    assert rc == 0, err
    assert await exit_codes([instance[6]], instance[0].rundir.parent) == [1]
    rc, _, err = await run_cli("overlay", "disconnect", "6", uri=uri)
    assert rc == 1, err
    assert "No such file or directory" not in err, err
    assert "rank 6 is already lost" in err, err
