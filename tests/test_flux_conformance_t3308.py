"""flux-core t/t3308-system-torpid.t: torpid ranks -- the ``tbon.torpid_min``
/ ``tbon.torpid_max`` settings (defaults, their checks, live changes, at
start) and a stopped rank marked torpid, then not.  Here the settings are
broker attributes (docs/cli.md ``tbon.torpid_*``, ``attr set``; the guide's
"Torpid ranks"); every case runs real ranks and the ``kvbroker`` command.

Flux case -> here:

* load heartbeat module with a fast rate -> does not apply: keepalives are
  the overlay's own (``overlay.keepalive`` every ``tbon.torpid_min``), not
  the heartbeat module's.
* torpid max/min have expected values (``30s``, ``5s``) -> ``getattr``
  prints ``30`` and ``5``: DIFFERENCE, a value is printed as it was given
  (the defaults are plain seconds; ``1m`` stays ``1m``, Flux normalises
  its FSD to ``1m`` from ``60s``).  Documented defaults.
* max must be > min; min must be < max -> refused, exit 1, saying why.
  DIFFERENCE (documented): ``tbon.torpid_max`` must be more than *twice*
  ``tbon.torpid_min`` (an idle rank's keepalives may be that far apart),
  so Flux's own live example 30s/60s is refused here; 20s/1m is used.
* can be set on a live system -> ``attr set NAME VALUE --all`` (in the
  documented order: raising both, the maximum first), read back on every
  rank.  Flux's ``flux config load`` does not apply (no config reload).
* cannot be set to a non-FSD value (``foo``, ``bar``); min cannot be zero
  -> refused, exit 1, nothing changed.
* torpid_min via config (6s); min 0 via config fails; max 0 (disable) via
  config -> ``start -S`` (``start`` takes no ``--config``; ``broker -c``'s
  ``[attrs]`` table is in tests/test_multihost.py): ``6s`` read back,
  ``0`` refused before any command runs (exit 2), ``tbon.torpid_max=0``
  taken and read back ``0`` (Flux ``0s``).
* reduce to 1s/2s, kill -STOP rank 1, rank 1 in the ``broker.torpid``
  group, kill -CONT, removed from the group -> tests/test_broker_torpid.py
  (``test_a_stopped_child_is_marked_torpid_then_responsive``: marked in
  ``overlay status`` and ``stats``, logged, still connected, then
  responsive again; ``test_torpid_attributes_changed_at_run_time_take_
  effect``).  Not repeated here.  There is no groups service.
* resource list / scheduler show a node down, no nodes drained -> do not
  apply (no resource module or scheduler).
* command-line torpid_max overrides the initial config on a follower ->
  ``start -s 2 -S tbon.torpid_max=5h``: rank 1 reads ``5h`` (no config
  sync to override it; every rank takes the ``-S`` values).

Found here:

* ``attr set NAME VALUE --all`` names every rank that refused (``ranks
  0,2: ...``): until 2026-12-05 only the first in rank order, so it read
  as if rank 2 had the new value (broker/cliutil.py ``each_rank``; found
  by this file).
"""

from __future__ import annotations

import asyncio
import os
import re

from test_broker_support import KVBROKER, run_cli

DURATION = "is not a duration (e.g. 2, 0.5s, 30m))\n"


async def kvb_start(*args: str) -> tuple[int, str, str]:
    """``kvbroker start ARGS`` with kvbroker on the command's PATH."""
    env = dict(os.environ, PATH=f"{os.path.dirname(KVBROKER)}:{os.environ['PATH']}")
    env.pop("KVBROKER_URI", None)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", *args, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def values(uri: str, rank: int) -> tuple[str, str]:
    got = []
    for name in ("tbon.torpid_min", "tbon.torpid_max"):
        rc, out, err = await run_cli("attr", "get", name, "-r", str(rank), uri=uri)
        assert rc == 0, err
        got.append(out.strip())
    return got[0], got[1]


async def test_defaults_checks_and_live_changes(start_instance) -> None:
    inst = await start_instance(size=2, fanout=2)
    uri = inst.uri(0)
    assert await values(uri, 0) == await values(uri, 1) == ("5", "30")

    def refused(what: str) -> str:
        return f"kvbroker: setattr: Invalid argument ({what}"

    # max not above (twice) min; min raised past it
    rc, out, err = await run_cli("setattr", "tbon.torpid_max", "2s", uri=uri)
    assert (rc, out) == (1, "") and err.startswith(refused(
        "tbon.torpid_max: 2 must be 0 (never) or more than twice tbon.torpid_min (5)")), err
    rc, out, err = await run_cli("setattr", "tbon.torpid_min", "1s", uri=uri)
    assert rc == 0, err
    rc, out, err = await run_cli("setattr", "tbon.torpid_max", "0.1s", uri=uri)
    assert (rc, out) == (1, "") and err.startswith(refused("tbon.torpid_max: 0.1 must be"))
    rc, out, err = await run_cli("setattr", "tbon.torpid_min", "20s", uri=uri)
    assert (rc, out) == (1, "") and err.startswith(refused("tbon.torpid_max: 30 must be"))
    # not durations, zero
    for name, bad in (("tbon.torpid_max", "foo"), ("tbon.torpid_min", "bar")):
        rc, out, err = await run_cli("setattr", name, bad, uri=uri)
        assert (rc, out, err) == (1, "", refused(f"{name}: '{bad}' {DURATION}"))
    rc, out, err = await run_cli("setattr", "tbon.torpid_min", "0", uri=uri)
    assert (rc, out) == (1, "") and err.startswith(refused("tbon.torpid_min: must be at "
                                                           "least 0.1"))
    assert await values(uri, 0) == ("1s", "30")  # nothing refused changed anything

    # live, on every rank: raising both, the maximum first
    for name, value in (("tbon.torpid_max", "1m"), ("tbon.torpid_min", "20s")):
        rc, out, err = await run_cli("attr", "set", name, value, "--all", uri=uri)
        assert (rc, out, err) == (0, "", "")
    assert await values(uri, 0) == await values(uri, 1) == ("20s", "1m")


async def test_settings_at_start() -> None:
    both, zero_max, zero_min = await asyncio.gather(
        kvb_start("-s", "2", "-S", "tbon.torpid_min=6s", "-S", "tbon.torpid_max=5h", "--",
                  KVBROKER, "exec", "-r", "1", "--", "sh", "-c",
                  "kvbroker getattr tbon.torpid_min; kvbroker getattr tbon.torpid_max"),
        kvb_start("-S", "tbon.torpid_max=0", "--", KVBROKER, "getattr", "tbon.torpid_max"),
        kvb_start("-S", "tbon.torpid_min=0", "--", "sh", "-c", "echo ran"))
    assert both == (0, "6s\n5h\n", "")  # (rank 1: every rank takes -S)
    assert zero_max == (0, "0\n", "")
    assert zero_min == (2, "", "kvbroker: start: tbon.torpid_min: must be at least 0.1 "
                               "(every rank checks its children, and its parent, this "
                               "often)\n")


async def test_attr_set_all_names_every_rank_that_refused(start_instance) -> None:
    inst = await start_instance(size=3, fanout=2)
    uri = inst.uri(0)
    rc, _, err = await run_cli("attr", "set", "tbon.torpid_min", "1", "-r", "1", uri=uri)
    assert rc == 0, err
    rc, out, err = await run_cli("attr", "set", "tbon.torpid_max", "5", "--all", uri=uri)
    # ranks 0 and 2 (torpid_min 5) refuse, rank 1 (torpid_min 1) takes it
    assert [await values(uri, r) for r in range(3)] == [("5", "30"), ("1", "5"), ("5", "30")]
    assert (rc, out) == (1, "")
    named = err.split(": Invalid argument")[0]
    assert set(re.findall(r"\d+", named)) == {"0", "2"}, err
