"""flux-core t/t1107-heartbeat.t: the heartbeat module's period and
warn_thresh, good and bad settings, and a follower that stops hearing the
leader.

Flux loads, reloads and unloads the module on a running instance and
re-reads its ``[heartbeat]`` table with ``flux config load``.  kvbroker
does the first the same way (``kvbroker module load|reload|remove``,
docs/cli.md "module"; the module's arguments are its attributes
``heartbeat.period`` and ``heartbeat.warn_thresh``, with or without the
``heartbeat.`` prefix), but has no config reload: the attributes can also
be given at start with ``-S`` (docs/cli.md, attributes; docs/guide.md, A
heartbeat), so each Flux "reconfig with X" is a start with X here, and a bad
X is refused before any rank starts (nothing runs to "still have period
5s").  The module cases are run at run time as Flux runs them, and kept at
start too.

Flux case -> here:

* load heartbeat (``flux exec``: every rank), period is 2s -> ``module load
  -r all heartbeat`` on an instance started without it: ``stats heartbeat
  -p period`` is 2 on rank 0 and rank 1, warn_thresh 3
  (:func:`test_t1107_load_reload_unload_at_run_time`); and the same loaded
  at start (:func:`test_t1107_loaded_on_every_rank_the_period_is_2s`).
* reload with period=10s -> ``module reload heartbeat period=10s``: rank
  0's period is 10, rank 1's module (not reloaded) stays at 2, ``attr get
  heartbeat.period`` says ``10s`` (same run-time test); also at start
  (:func:`test_t1107_a_period_and_warn_thresh_given_are_in_force`, which
  covers reconfig with period=5s, load with period=1s and reconfig with
  warn_thresh=10 as starts with each).
* wrong period *type* (TOML integer ``4``) -> does not apply: ``-S``
  values and module arguments are strings, and a bare number is seconds
  here (documented).
* bad period FSD ``zzz``, period is still 5s -> ``module reload heartbeat
  period=zzz`` exits 1 saying why, and the loaded module runs on at its
  period (:func:`test_t1107_load_reload_unload_at_run_time`); also
  tests/test_heartbeat.py; a bad key (``z =
  42``) and warn_thresh=-1 -> refused at start, saying why
  (:func:`test_t1107_a_bad_setting_or_key_is_refused_before_any_rank_starts`).
* reconfig with an empty table, period back to 2s -> no reconfig here; the
  default is the first case.
* unload heartbeat -> ``module remove heartbeat``: ``module list`` does not
  show it and ``stats heartbeat`` fails ENOSYS (run-time test); also an
  instance started without it
  (:func:`test_t1107_without_the_module_there_is_no_heartbeat`).
* load with period=bad FSD (``period=1x``), load with a bad option
  (``foo=42``) -> ``module load heartbeat period=1x`` / ``foo=42`` exit 1,
  saying why (``'1x' is not a duration``, ``no attribute 'foo'``), nothing
  loaded (run-time test); the same settings with ``-S`` are refused at
  start.
* load with period=1s, period is 1s -> ``module load heartbeat
  period=1s``: ``stats`` period 1 (run-time test).
* ``timeout`` (infinity, 0, 1m, wrong type, bad FSD, < period) -> not
  built (docs/guide.md: torpid marking names a silent rank); the setting
  is refused, saying so and naming what is done instead (it was refused
  with "did you mean heartbeat.period?", a hint that set the beat instead)
  (:func:`test_t1107_a_timeout_is_refused_as_not_built_not_as_a_typo_of_period`).
* reload with period=0.1s warn_thresh=3, stop leader (``module remove
  heartbeat`` on rank 0, ``module load heartbeat``), heartbeat overdue was
  logged, unload heartbeat (every rank) -> ``module reload -r all heartbeat
  period=0.1s warn_thresh=3``; ``module remove heartbeat`` on rank 0: rank
  1's ``dmesg`` gets ``heartbeat overdue`` and its stats say overdue;
  ``module load heartbeat`` (no arguments: the last load's settings stay,
  period 0.1) and rank 1 logs ``heartbeat received``; ``module remove -r
  all heartbeat`` (:func:`test_t1107_leader_s_module_removed_the_follower_logs_overdue`).
  Flux's ``sleep 2`` is a wait for the log line here.  Also
  tests/test_heartbeat.py (rank 0 SIGSTOPped: overdue, then received).
"""
from __future__ import annotations

import pytest
from test_broker_support import run_cli, wait_until

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


# ------------------------------------------- at run time: module load|reload|remove


async def ok(inst, *args: str) -> str:
    rc, out, err = await run_cli(*args, uri=inst.uri(0))
    assert (rc, err) == (0, ""), (args, rc, out, err)
    return out


async def raw(inst, rank: int, field: str) -> str:
    return (await ok(inst, "stats", "heartbeat", "-r", str(rank), "-p", field)).strip()


async def loaded(inst, rank: int) -> bool:
    out = await ok(inst, "module", "list", "-r", str(rank))
    return any(line.split()[0] == "heartbeat" for line in out.splitlines()[1:])


async def test_t1107_load_reload_unload_at_run_time(start_instance) -> None:
    """Flux's module cases, in order, on a running 2-rank instance started
    without the module: ``load`` on every rank (period 2s), ``reload
    period=10s``, ``unload``, ``load period=1x`` and ``load foo=42``
    refused, ``load period=1s``."""
    inst = await start_instance(size=2)
    assert not await loaded(inst, 0) and not await loaded(inst, 1)
    # load heartbeat (flux exec: every rank), period is 2s
    assert await ok(inst, "module", "load", "-r", "all", "heartbeat") == ""
    for rank in (0, 1):
        assert await loaded(inst, rank)
        assert await hb(inst, rank, "period") == 2
        assert await hb(inst, rank, "warn_thresh") == 3
    # reload heartbeat with period=10s (rank 0's; rank 1's is its own)
    assert await ok(inst, "module", "reload", "heartbeat", "period=10s") == ""
    assert await hb(inst, 0, "period") == 10
    assert await hb(inst, 1, "period") == 2
    assert (await ok(inst, "attr", "get", "heartbeat.period")) == "10s\n"
    # (reconfig with a bad period FSD, period is still 10s: a reload with
    # one is refused before the loaded module is touched)
    rc, out, err = await run_cli("module", "reload", "heartbeat", "period=zzz", uri=inst.uri(0))
    assert (rc, out) == (1, "") and "heartbeat.period: 'zzz' is not a duration" in err, err
    assert await loaded(inst, 0) and await hb(inst, 0, "period") == 10
    # unload heartbeat: no heartbeat service on rank 0 any more
    assert await ok(inst, "module", "remove", "heartbeat") == ""
    assert not await loaded(inst, 0)
    rc, out, err = await run_cli("stats", "heartbeat", uri=inst.uri(0))
    assert rc == 1 and "Function not implemented" in err, (rc, err)
    # load with a bad period FSD, with a bad option: refused, nothing loaded
    for arg, why in (("period=1x", "heartbeat.period: '1x' is not a duration"),
                     ("foo=42", "module heartbeat has no attribute 'foo'")):
        rc, out, err = await run_cli("module", "load", "heartbeat", arg, uri=inst.uri(0))
        assert (rc, out) == (1, "") and why in err, (arg, rc, err)
        assert "Traceback" not in err, err
        assert not await loaded(inst, 0)
    # load heartbeat with period=1s; period is 1s
    assert await ok(inst, "module", "load", "heartbeat", "period=1s") == ""
    assert await hb(inst, 0, "period") == 1
    assert await hb(inst, 0, "warn_thresh") == 3


async def test_t1107_leader_s_module_removed_the_follower_logs_overdue(start_instance) -> None:
    """Flux's last cases: ``reload`` with period=0.1s warn_thresh=3 (every
    rank: Flux's ``config load`` sets it for all, then reloads rank 1's),
    ``module remove heartbeat`` on rank 0, then ``module load heartbeat``
    (no arguments: the settings of the last load stay); rank 1 logged
    ``heartbeat overdue``, then ``heartbeat received``; ``unload`` on every
    rank."""
    inst = await start_instance(size=2, attrs={"broker.modules": MODULES})
    assert await ok(inst, "module", "reload", "-r", "all", "heartbeat",
                    "period=0.1s", "warn_thresh=3") == ""
    for rank in (0, 1):
        assert (await hb(inst, rank, "period"), await hb(inst, rank, "warn_thresh")) == (0.1, 3)

    async def rank1_log() -> list[str]:
        out = await ok(inst, "dmesg", "-r", "1")
        return [line for line in out.splitlines() if "heartbeat " in line]

    before = len(await rank1_log())
    assert await ok(inst, "module", "remove", "heartbeat") == ""

    async def logged(what: str) -> bool:
        return any(what in line for line in (await rank1_log())[before:])

    await wait_until(lambda: logged("heartbeat overdue"), "rank 1 to log heartbeat overdue", 30)
    assert await raw(inst, 1, "overdue") == "true"
    assert await ok(inst, "module", "load", "heartbeat") == ""
    assert await hb(inst, 0, "period") == 0.1
    await wait_until(lambda: logged("heartbeat received"), "rank 1 to log heartbeat received", 30)

    async def heard() -> bool:
        return await raw(inst, 1, "overdue") == "false"

    await wait_until(heard, "rank 1 to hear rank 0 again", 30)
    assert await ok(inst, "module", "remove", "-r", "all", "heartbeat") == ""
    assert not await loaded(inst, 0) and not await loaded(inst, 1)
