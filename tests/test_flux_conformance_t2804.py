"""flux-core t/t2804-uptime-cmd.t: ``flux uptime`` -> ``kvbroker uptime``
(broker/cli.py ``cmd_uptime``, docs/cli.md "uptime") against a real
4-rank instance (fanout 3: ranks 1-3 below rank 0) that admits guests
(``-S access.allow-guest-user=true``, as Flux's instance lets a guest run
``flux uptime``).  test_flux_conformance_t3310.py has these cases too,
beside its heartbeat cases; this file is t2804's own.

Flux's cases, and what each becomes:

1. *works on rank 0* -> ``kvbroker uptime`` prints Flux's one line,
   ``HH:MM:SS run 0.4s,  owner root,  size 4`` (asserted whole)
   (:func:`test_uptime_on_rank_0_rank_1_and_as_a_guest`).
2. *works on rank 1* (``flux exec -r 1 flux uptime``) -> ``kvbroker exec
   -r 1 -- kvbroker uptime``: the same line (same test).
3. *works as guest* (``FLUX_HANDLE_USERID``/``ROLEMASK`` to pose as one)
   -> run as another uid for real (tests/test_broker_guests.py's way; so
   it needs root, skipped otherwise): the same line, the owner named
   (same test).
4. *reports correct size* -> ``size 4`` in each of the above.
5. *reports submit disabled* (``flux queue disable``), 6. *reports
   scheduler stopped* (``flux queue stop``) -> do not apply: kvbroker has
   no job queue and no scheduler (a broker and a KVS).
7. *reports drained node count* (``flux resource drain 1,3``: ``2
   drained``) -> does not apply as such: there is no resource module to
   drain nodes in.  Its nearest counterpart is the count of ranks that
   are out of service, which Flux's uptime also prints (``offline``):
   ranks 1 and 3 shut down on purpose are ``2 offline``, on rank 0 and
   for a guest (:func:`test_uptime_counts_two_ranks_out_of_service`).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import re

import pytest
from test_broker_guests import ALLOW, run_guest_cli
from test_broker_support import KVBROKER, run_cli

T = 30.0
OWNER = pwd.getpwuid(os.getuid()).pw_name
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")


def uptime_re(extra: str = "") -> str:
    return rf"\d\d:\d\d:\d\d run \d+\.\d[sm],  owner {re.escape(OWNER)},  size 4{extra}\n"


@as_root
async def test_uptime_on_rank_0_rank_1_and_as_a_guest(start_instance) -> None:
    inst = await start_instance(size=4, fanout=3, attrs=ALLOW)
    rc, out, err = await run_cli("uptime", uri=inst.uri(0))
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(), out), (out, err)
    rc, out, err = await run_cli("exec", "-r", "1", "--", KVBROKER, "uptime", uri=inst.uri(0))
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(), out), (out, err)
    rc, out, err = await run_guest_cli(inst.uri(0), "uptime")
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(), out), (out, err)


@as_root
async def test_uptime_counts_two_ranks_out_of_service(start_instance) -> None:
    inst = await start_instance(size=4, fanout=3, attrs=ALLOW)
    for rank in (1, 3):
        rc, out, err = await run_cli("shutdown", "-r", str(rank), uri=inst.uri(0))
        assert (rc, out, err) == (0, "", ""), (rank, err)
        assert await asyncio.wait_for(inst.procs[rank].wait(), T) == 0
    rc, out, err = await run_cli("uptime", uri=inst.uri(0))
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(",  2 offline"), out), (out, err)
    rc, out, err = await run_guest_cli(inst.uri(0), "uptime")
    assert (rc, err) == (0, "") and re.fullmatch(uptime_re(",  2 offline"), out), (out, err)
