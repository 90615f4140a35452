"""flux-core t3303-system-healthcheck, as kvbroker has it: subtree health
(``overlay status``, ``errors``, ``lookup``, ``disconnect``'s target
checks) as ranks are stopped, killed and frozen, on an instance across
hosts (``kvbroker broker --config``, over tcp with CURVE), each rank
saying it runs on its own host ``fakeN`` (``-S hostname=``).  Flux runs 15
ranks at fanout 2; here 9 at fanout 2 (0 -> 1, 2; 1 -> 3, 4; 2 -> 5, 6;
3 -> 7, 8), which keeps Flux's shape where it matters: rank 3 is a router
with two leaves, stopped with SIGTERM; a leaf (6 for Flux's 14) is killed;
another leaf (5 for Flux's 12) is frozen with SIGSTOP.

Flux's cases, in order, and what each becomes here:

1-2. *overlay.topology RPC with no payload / bad rank fails*: kvbroker has
   no ``overlay.topology`` service (the tree is computed from size and
   fanout, ``overlay parentof``): the request fails, ENOSYS.
3. *status fails on bad rank* (``--rank 99``): ``overlay status`` takes no
   ``--rank`` (it always asks every rank; documented in docs/cli.md):
   a usage error, exit 2.
4. *fails on bad subcommand*: usage error, exit 2.
5. *overlay status is full*: ``--summary`` prints ``full``, exit 0.
6. *errors prints nothing*: nothing, exit 0.
7. *wait timeout of zero is not an immediate timeout*: Flux's
   ``--timeout=0`` means none; kvbroker's ``-t`` must be more than 0
   (docs/cli.md: without ``-t``, ``--wait`` has no bound), so ``-t 0`` is a
   usage error, and ``--wait full --summary`` without ``-t`` returns at once
   on a full instance.  Documented difference.
8-11. *--highlight* (3 cases), *--color*: not in kvbroker's ``overlay status``
   (it prints no colour); not applicable.
12. *stop broker 3 with children 7,8* (SIGTERM): rank 3 exits 0, its
   leaves stop with it.
13. *wait for rank 0 overlay status to be partial*: ``--wait partial
   --summary`` prints ``partial`` (exit 1: not full).
14. *wait for rank 1 to lose connection with rank 3*: rank 1's
   ``broker.stats-get`` children drop to [4] (Flux: ``child-connected``).
15-23. *status -vv works*, *status shows rank 3 offline*, *errors shows
   rank 3*, *--summary*, *--down*, *-vv*, *0,1 partial, 3,7-8 offline,
   rest full*: no ``-v``/``--down`` here (``overlay errors`` is the
   "down" list); the tree: 0 and 1 partial, 3 offline with why
   (``stopped: signal SIGTERM``, Flux's ``administrative shutdown``), 7 and
   8 offline ``stopped with rank 3``, every other rank full; ``errors``
   names 3 and 7-8.
24. *kill broker 14* (SIGKILL): rank 6 here.
25. *ping to rank 14 fails with EHOSTUNREACH*: ``ping 6``, exit 1, ``No
   route to host (rank 6 was lost: its connection closed, ...)``, as its
   parent saw it (``rank 6 is unreachable`` until 2026-12-07).
26. *errors shows the lost connection*: ``6 fake6: lost (...)``.  Flux
   says ``lost connection``; kvbroker's line says why the parent lost it
   (``its connection closed``, ``... answered no heartbeat for 10 s``);
   until 2026-12-05 it said ``rank 6 is unreachable`` whatever happened
   (found by this file).
27. *wait for rank 0 subtree to be degraded*: kvbroker has no *degraded*
   (a lost rank makes its parents partial: documented); ``--wait partial``
   is the nearest, covered in 13.
28. *wait for unknown status fails*: ``--wait foo``, usage error, exit 2.
29. *wait timeout works*: ``--wait full --summary -t 0.1`` exits 1 saying
   it timed out.
30-31. *-vv*, *-v*: not in kvbroker.
32-40. *lookup*: with no target (exit 2), ``0`` -> fake0, ``0-8`` ->
   fake[0-8], ``-1`` and ``100`` fail, ``fake2`` -> 2, ``fake[2-3]`` ->
   2-3, ``fake2[`` and ``foo`` fail -- through the CLI on the real
   instance (tests/test_cli_overlay.py checks the translation itself).
   ``lookup 100`` says ``no rank 100: ...`` (until 2026-12-05 with ``No
   route to host``, ``exec -r``'s text, before it: a translation routes
   nothing; found by this file).
41-43. *disconnect* refuses ``42`` (not a rank of this instance), ``42xxx``
   (taken as a host: "TARGET must be a valid rank or hostname") and
   ``fake2[`` (the same), all exit 1, before asking anything.
44-46. *stop broker 12* (SIGSTOP), *status / errors print connection timed
   out on 12*: rank 5 here shows ``torpid (no answer in 1s)`` in both
   (Flux's ETIMEDOUT text; kvbroker's word is torpid, documented).
47. *continue broker 12*: SIGCONT, and it answers again.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from pathlib import Path

import pytest
from test_broker_support import run_cli, stats, stop_process, wait_until
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import exit_codes, keyed_config, named

from broker.errors import RemoteError
from broker.handle import Handle

HOSTS = [f"fake{r}" for r in range(9)]


async def test_t3303_health_as_ranks_stop_die_and_freeze(tmp_path: Path,
                                                         brokers) -> None:  # noqa: F811
    config = await keyed_config(tmp_path, 9, 2, hosts=HOSTS)
    ranks = [await brokers(config, r, *named(HOSTS[r])) for r in range(9)]
    for r in ranks:
        await r.ready()
    uri = ranks[0].uri

    async def cli(*argv: str) -> tuple[int, str, str]:
        return await run_cli(*argv, uri=uri)

    h = await Handle.connect(uri)
    try:
        async with asyncio.timeout(150):
            for payload in ({}, {"rank": 99}):  # (1, 2)
                with pytest.raises(RemoteError) as info:
                    await h.rpc("overlay.topology", payload, nodeid=0)
                assert info.value.errnum == errno.ENOSYS
            rc, out, err = await cli("overlay", "status", "--rank", "99")  # (3)
            assert (rc, out) == (2, ""), err
            rc, out, err = await cli("overlay", "notcommand")  # (4)
            assert (rc, out) == (2, ""), err
            assert await cli("overlay", "status", "--summary") == (0, "full\n", "")  # (5)
            assert await cli("overlay", "errors") == (0, "", "")  # (6)
            rc, out, err = await cli("overlay", "status", "-t", "0")  # (7)
            assert (rc, out) == (2, ""), err
            assert await cli("overlay", "status", "--wait", "full", "--summary") == (
                0, "full\n", "")

            ranks[3].proc.send_signal(signal.SIGTERM)  # (12)
            assert await exit_codes([ranks[r] for r in (3, 7, 8)], tmp_path) == [0, 0, 0]
            assert await cli("overlay", "status", "--wait", "partial", "--summary",
                             "-t", "30") == (1, "partial\n", "")  # (13)

            async def lost_3() -> bool:  # (14)
                return bool((await stats(h, 1))["overlay"]["children"] == [4])

            await wait_until(lost_3, "rank 1 to lose rank 3", 30)
            rc, out, err = await cli("overlay", "status", "-t", "10")  # (15-23)
            assert (rc, out.splitlines()) == (1, [
                "0 fake0: partial",
                "  1 fake1: partial",
                "    3 fake3: offline (stopped: signal SIGTERM)",
                "      7 fake7: offline (stopped with rank 3)",
                "      8 fake8: offline (stopped with rank 3)",
                "    4 fake4: full",
                "  2 fake2: full",
                "    5 fake5: full",
                "    6 fake6: full"]), err
            assert await cli("overlay", "errors", "-t", "10") == (0, (
                "3 fake3: offline (stopped: signal SIGTERM)\n"
                "7-8 fake[7-8]: offline (stopped with rank 3)\n"), "")

            ranks[6].proc.kill()  # (24)
            assert await exit_codes([ranks[6]], tmp_path) == [-signal.SIGKILL]

            async def lost_6() -> bool:
                return bool((await stats(h, 2))["overlay"]["children"] == [5])

            await wait_until(lost_6, "rank 2 to lose rank 6", 30)
            rc, out, err = await cli("ping", "6")  # (25)
            assert (rc, out) == (1, "") and err.startswith(
                "kvbroker: ping: No route to host (rank 6 was lost: "), err
            rc, out, err = await cli("overlay", "errors", "-t", "10")  # (26)
            assert rc == 0 and "\n6 fake6: lost (" in out, (out, err)
            rc, out, err = await cli("overlay", "status", "--wait", "foo")  # (28)
            assert (rc, out) == (2, ""), err
            rc, out, err = await cli("overlay", "status", "--wait", "full", "--summary",
                                     "-t", "0.1")  # (29)
            assert (rc, out) == (1, ""), err
            assert "Connection timed out (rank 0 not full within 0.1s: partial)" in err, err

            rc, out, err = await cli("overlay", "lookup")  # (32-40)
            assert (rc, out) == (2, ""), err
            assert await cli("overlay", "lookup", "0") == (0, "fake0\n", "")
            assert await cli("overlay", "lookup", "0-8") == (0, "fake[0-8]\n", "")
            assert await cli("overlay", "lookup", "fake2") == (0, "2\n", "")
            assert await cli("overlay", "lookup", "fake[2-3]") == (0, "2-3\n", "")
            for bad in ("-1", "100", "fake2[", "foo"):
                rc, out, err = await cli("overlay", "lookup", "--", bad)
                assert (rc, out) == (1, ""), (bad, err)
                assert "Traceback" not in err, err

            rc, out, err = await cli("overlay", "disconnect", "42")  # (41-43)
            assert (rc, out, err) == (1, "", "kvbroker: overlay disconnect: rank 42 is not "
                                             "a rank of this instance (size 9)\n")
            for bad in ("42xxx", "fake2["):
                rc, out, err = await cli("overlay", "disconnect", bad)
                assert (rc, out) == (1, ""), (bad, err)
                assert "TARGET must be a valid rank or hostname" in err, (bad, err)

            await stop_process(ranks[5].proc.pid)  # (44)
            try:
                rc, out, err = await cli("overlay", "status", "-t", "1")  # (45)
                assert rc == 1 and "    5 fake5: torpid (no answer in 1s)" in \
                    out.splitlines(), (out, err)
                rc, out, err = await cli("overlay", "errors", "-t", "1")  # (46)
                assert rc == 0 and "5 fake5: torpid (no answer in 1s)" in \
                    out.splitlines(), (out, err)
            finally:
                os.kill(ranks[5].proc.pid, signal.SIGCONT)  # (47)
            assert (await h.ping(5))["rank"] == 5
    finally:
        await h.close()
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert await exit_codes([ranks[r] for r in (0, 1, 2, 4, 5)], tmp_path) == [0] * 5


async def test_t3303_a_killed_rank_s_line_says_it_lost_its_connection(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    config = await keyed_config(tmp_path, 3, 2, hosts=HOSTS[:3])
    ranks = [await brokers(config, r, *named(HOSTS[r])) for r in range(3)]
    for r in ranks:
        await r.ready()
    uri = ranks[0].uri
    h = await Handle.connect(uri)
    try:
        async with asyncio.timeout(60):
            ranks[2].proc.kill()
            assert await exit_codes([ranks[2]], tmp_path) == [-signal.SIGKILL]

            async def lost_2() -> bool:
                return bool((await stats(h, 0))["overlay"]["children"] == [1])

            await wait_until(lost_2, "rank 0 to lose rank 2", 30)
            rc, out, err = await run_cli("overlay", "errors", "-t", "10", uri=uri)
            assert rc == 0 and out.startswith("2 fake2: lost ("), (out, err)
            assert "connection" in out, out
    finally:
        await h.close()


async def test_t3303_lookup_of_a_rank_too_big_says_only_that(start_instance) -> None:
    inst = await start_instance(size=2, fanout=2)
    rc, out, err = await run_cli("overlay", "lookup", "100", uri=inst.uri(0))
    assert (rc, out) == (1, ""), err
    assert "no rank 100: the instance's ranks are 0-1" in err, err
    assert "No route to host" not in err, err
