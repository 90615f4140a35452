"""flux-core t/t1107-heartbeat.t: the heartbeat module's period and
warn_thresh, good and bad settings, and a follower that stops hearing the
leader.

Flux loads, reloads and unloads the module on a running instance and
re-reads its ``[heartbeat]`` table with ``flux config load``.  kvbroker
loads modules at start only (``-S broker.modules=...,heartbeat``) and has
no config reload: the module's settings are the attributes
``heartbeat.period`` and ``heartbeat.warn_thresh``, given with ``-S``
(docs/cli.md, attributes; docs/guide.md, A heartbeat).  So each Flux
"load/reload/reconfig with X" is a start with X here, and a bad X is
refused before any rank starts (nothing runs to "still have period 5s").

Flux case -> here:

* load heartbeat (on every rank), period is 2s -> the default: ``stats
  heartbeat -p period`` is 2 on rank 0 and rank 1, warn_thresh 3.
* reload with period=10s, reconfig with period=5s, load with period=1s,
  reconfig with warn_thresh=10 works -> a start with each: ``period`` and
  ``warn_thresh`` in ``stats heartbeat`` on both ranks, the attribute
  readable as given.
* wrong period *type* (TOML integer ``4``) -> does not apply: ``-S``
  values are strings, and a bare number is seconds here (documented).
* bad period FSD ``zzz`` -> tests/test_heartbeat.py; ``period=1x`` (the
  module option) and a bad key / bad option (``z = 42``, ``foo=42``) ->
  refused at start, saying why; so is warn_thresh=-1 (0 in
  tests/test_heartbeat.py).
* reconfig with an empty table, period back to 2s -> no reconfig here; the
  default is the first case.
* unload heartbeat -> without it in ``broker.modules`` there is no
  ``heartbeat`` service: ``stats heartbeat`` fails ENOSYS, ``module list``
  does not show it.
* ``timeout`` (infinity, 0, 1m, wrong type, bad FSD, < period) -> not
  built (docs/guide.md: torpid marking names a silent rank); the setting
  is refused, saying so and naming what is done instead (it was refused
  with "did you mean heartbeat.period?", a hint that set the beat instead).
* period 0.1s, leader stops beating, follower logs "heartbeat overdue" ->
  tests/test_heartbeat.py (rank 0 SIGSTOPped: overdue, then received).
"""

from __future__ import annotations

import pytest
from test_broker_support import run_cli

MODULES = "content,kvs,kvs-watch,heartbeat"


async def hb(inst, rank: int, field: str) -> float:
    rc, out, err = await run_cli("stats", "heartbeat", "-r", str(rank), "-p", field,
                                 uri=inst.uri(0))
    assert rc == 0 and err == "", (rc, out, err)
    return float(out)


async def test_t1107_loaded_on_every_rank_the_period_is_2s(start_instance) -> None:
    inst = await start_instance(size=2, attrs={"broker.modules": MODULES})
    for rank in (0, 1):
        assert await hb(inst, rank, "period") == 2
        assert await hb(inst, rank, "warn_thresh") == 3
    rc, out, err = await run_cli("attr", "get", "heartbeat.period", "-r", "1",
                                 uri=inst.uri(0))
    assert (rc, out) == (0, "2\n"), err
    rc, out, err = await run_cli("module", "list", "-r", "1", uri=inst.uri(0))
    assert rc == 0 and any(line.split()[0] == "heartbeat" for line in out.splitlines()[1:]), out


@pytest.mark.parametrize(("period", "warn_thresh", "seconds", "thresh"), [
    ("10s", None, 10, 3),   # Flux: module reload heartbeat period=10s
    ("5s", "10", 5, 10),    # Flux: [heartbeat] period = "5s", warn_thresh = 10
    ("1s", None, 1, 3),     # Flux: module load heartbeat period=1s
])
async def test_t1107_a_period_and_warn_thresh_given_are_in_force(
        start_instance, period: str, warn_thresh: str | None, seconds: float,
        thresh: int) -> None:
    attrs = {"broker.modules": MODULES, "heartbeat.period": period}
    if warn_thresh is not None:
        attrs["heartbeat.warn_thresh"] = warn_thresh
    inst = await start_instance(size=2, attrs=attrs)
    for rank in (0, 1):
        assert await hb(inst, rank, "period") == seconds
        assert await hb(inst, rank, "warn_thresh") == thresh
    rc, out, err = await run_cli("attr", "get", "heartbeat.period", uri=inst.uri(1))
    assert (rc, out) == (0, f"{period}\n"), err


@pytest.mark.parametrize(("attr", "value", "why"), [
    ("heartbeat.period", "1x", "heartbeat.period: '1x' is not a duration"),
    ("heartbeat.z", "42", "heartbeat.z: unknown attribute"),
    ("heartbeat.foo", "42", "heartbeat.foo: unknown attribute"),
    ("heartbeat.warn_thresh", "-1", "heartbeat.warn_thresh: -1 is below the minimum of 1"),
])
async def test_t1107_a_bad_setting_or_key_is_refused_before_any_rank_starts(
        attr: str, value: str, why: str) -> None:
    rc, out, err = await run_cli("start", "-S", f"broker.modules={MODULES}",
                                 "-S", f"{attr}={value}", "--", "echo", "ran")
    assert rc == 2 and why in err, (rc, err)
    assert out == ""  # (the command never ran)


async def test_t1107_without_the_module_there_is_no_heartbeat(start_instance) -> None:
    inst = await start_instance(size=2)  # (the default modules: no heartbeat)
    rc, out, err = await run_cli("stats", "heartbeat", uri=inst.uri(1))
    assert rc == 1 and "Function not implemented" in err, (rc, err)
    rc, out, err = await run_cli("module", "list", uri=inst.uri(1))
    assert rc == 0 and "heartbeat" not in out, out


async def test_t1107_a_timeout_is_refused_as_not_built_not_as_a_typo_of_period() -> None:
    rc, out, err = await run_cli("start", "-S", f"broker.modules={MODULES}",
                                 "-S", "heartbeat.timeout=1m", "--", "echo", "ran")
    assert rc == 2 and out == "" and "heartbeat.timeout" in err, (rc, err)
    assert "did you mean heartbeat.period" not in err, err
    assert "not built here" in err and "tbon.torpid_max" in err, err
