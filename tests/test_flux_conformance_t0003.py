"""flux-core t/t0003-module.t (broker module management) against real
kvbroker ranks.

Flux loads, reloads and removes modules at run time (``flux module
load|reload|remove``), lists them, sets their debug flags and reads their
stats.  kvbroker loads modules at start by entry-point name (``-S
broker.modules=...``, group ``kvbroker.modules``) and at run time with
``module load|remove|reload``; a module's stats are ``kvbroker stats
MODULE`` (docs/cli.md "module", "stats").  Flux's ``testmod.so`` becomes
``testmod`` below, a one-file plugin installed by entry point
(:func:`~test_broker_support.use_module_plugin`); its behaviour is chosen by
its attribute ``testmod.mode`` (a module argument, as Flux's), or
``TESTMOD_MODE`` in the ranks' environment at start.

Flux's cases, and what each becomes:

* load / reload test module; lsmod shows it; ``list -l`` shows its path ->
  ``testmod`` named in ``broker.modules`` is listed by ``module list`` (and
  ``--json``) on every rank, with its services
  (:func:`test_a_plugin_module_is_listed_with_its_services_on_every_rank`);
  ``module load -r all testmod``, ``reload``, ``remove`` on a running
  instance (:func:`test_load_reload_list_and_remove_at_runtime`).  The DSO
  path does not apply (entry points).
* cannot load the same module twice -> ``EEXIST`` (runtime test above);
  a module named twice in ``broker.modules`` stops the start, exit 2
  (:func:`test_a_module_named_twice_is_refused_at_start`).
* ``--name smurf``; module answers to new name; reload/remove by new name
  -> do not apply (a module's name is its class's ``name``); the module
  answers to its name: ``testmod.info`` answers ``testmod`` (first test).
* unload test module; lsmod does not show it -> ``module remove``; not
  listed, its services ``ENOSYS`` (runtime test); an instance started
  without it does not list it (first test).
* insmod returns initialization error -> ``module load`` answers the
  module's own error and leaves the rank as it was
  (:func:`test_insmod_returns_initialization_error`); at start, a module
  whose ``start()`` raises stops the start, exit 2, its message logged
  (:func:`test_a_module_that_fails_to_start_stops_the_start`); but the
  broker names the module (it did not: DEFECT found here, fixed;
  :func:`test_a_module_that_fails_to_start_is_named`).
* load / reload / remove with no arguments fail; list fails with an
  argument -> exit 2, NAME required; ``module debug`` is a usage error
  ("invalid choice"); ``module list foo`` exits 2
  (:func:`test_module_command_usage`).
* list shows a long service name -> ``testmod`` also serves
  ``abcdefghijklmnopqrstuvwxyz``, listed in full (first test).
* load fails on invalid module ("module not found"); ``load "noexist"``
  -> ``-S broker.modules=nosuchmodule`` stops the start, exit 2, naming it
  and the known modules (:func:`test_an_unknown_module_is_refused_at_start`).
* remove fails on invalid module; ``remove -f`` -> ``ENOENT``, exit 1;
  ``-f`` exits 0; ``reload -f`` of one not loaded loads it
  (:func:`test_remove_fails_on_invalid_module_and_f_succeeds`);
  ``stats nosuchmodule`` exits 1 saying no service matches; and
  Flux's ``invalid_rank`` helper: ``module list``/``stats`` of rank SIZE
  exit 1, no route
  (:func:`test_stats_of_an_unknown_module`).
* (kvbroker's own) module arguments are the module's attributes, checked
  before anything changes (:func:`test_module_arguments_are_its_attributes`).
* legacy module naming; versioned ``testmod.so.0.0.0`` by name
  (``FLUX_MODULE_PATH_PREPEND``) -> do not apply (entry points, no DSOs).
* ``module debug`` get/--setbit/--set/--clearbit/--clear; ``module.debug``
  defer (testmod not answering ping while deferred) -> do not apply: no
  debug flags, no defer; ``module debug`` is a usage error (usage test).
* ``stats`` gets comms statistics -> ``stats kvs`` prints JSON; a plugin's
  are what its ``stats()`` returns (testmod's: its ``events``)
  (:func:`test_stats_prints_json_and_requests_counts_move_and_clear`).
* ``stats --parse rx.request`` counts requests -> the module's request
  count is ``module list``'s ``requests`` (Flux's default stats have
  ``rx.request``; kvbroker's default stats have none); it grows with a
  request to the module (same test).
* ``stats --clear`` / ``--clear-all`` -> the request count goes back (same
  test; the counters themselves: tests/test_broker_modules.py).
* ``stats --scale`` -> ``-p FIELD --scale 2`` of an integer field: Flux
  prints the scaled integer (``%d``), and so does kvbroker (it printed a
  double: DEFECT found here, fixed;
  :func:`test_stats_scale_of_an_integer_field_stays_an_integer`);
  what agrees (``--type int`` truncates the scaled value, ``--type double``
  prints ``%f``, a double field scaled stays a double):
  :func:`test_stats_scale_of_a_double_and_type_conversions`.
* (kvbroker's own) ``--clear`` and ``--clear-all`` together: taken, every
  refused as a usage error (it cleared every rank: DEFECT found here,
  fixed; :func:`test_stats_clear_and_clear_all_together`).
* ``stats --rusage``, ``-Rself``, ``=children``, ``=thread``, ``=badopt``
  fails, ``--rusage --parse maxrss`` -> tests/test_broker_modules.py
  (``test_stats_rusage_is_the_ranks_process``) covers each; here only
  ``-R -p maxrss`` on a plugin module (it answers the rank's figures).
* stats with no args is an error (usage) -> exit 2, usage printed
  (:func:`test_stats_of_an_unknown_module`).
* ``flux module`` with no arguments prints usage and fails; ``-h`` lists
  subcommands -> exit 2 with usage; ``-h`` exits 0 and lists ``list``
  only (usage test).
* ``flux_module_set_running`` -> does not apply (``start()`` returns when
  the module runs; the rank is ready after every module's start).
* ``module.status`` rejects malformed request / unknown sender -> do not
  apply: no ``module.status`` (the rank answers ``ENOSYS``, usage test).
* attribute / configuration is cached (rank, size, security.owner) -> a
  module reads ``ctx.rank``, ``ctx.size``, ``ctx.owner_uid``: ``testmod.info``
  answers them right on each rank (first test).
* load without unload causes broker failure; module name called out -> a
  module whose ``stop()`` raises: the instance's exit status is 1 and the
  log names the module (:func:`test_a_module_that_fails_to_stop_is_named`).
* hanging module cannot be removed; ``remove --cancel`` -> a remove
  waits for a stop that hangs (``-t`` gives up), ``--cancel`` cancels it
  (:func:`test_hanging_module_remove_cancel`); a module whose ``start()``
  hangs at start: the start gives up at its timeout and the ranks stop on
  SIGTERM
  (:func:`test_a_module_whose_start_hangs_bounds_the_start`; the error
  names the ranks not ready, not the module).
* module runtime failure triggers broker panic; only logged with
  ``broker.module-nopanic=1`` -> kvbroker never panics: an event handler,
  request handler or ``stats()`` that raises is logged (a request answered
  ``EIO``), the rank and module run on
  (:func:`test_a_module_runtime_failure_is_logged_not_fatal`), Flux's
  nopanic behaviour.
* (kvbroker's own) a plugin whose code fails to import, or whose class
  sets no ``name``: the start stops, naming the module (DEFECTS found
  here, fixed)
  (:func:`test_a_module_that_fails_to_import_is_named`,
  :func:`test_a_module_class_without_a_name_is_refused`).
* (kvbroker's own) a module asking for a service another holds: refused at
  start (:func:`test_a_service_another_module_holds_is_refused`); one with
  a period in it, which no request could reach: refused at start (it was
  listed, unreachable: DEFECT found here, fixed)
  (:func:`test_a_service_name_with_a_period_is_refused`).
* (kvbroker's own) modules start in the order named: ``content,kvs``
  works (:func:`test_modules_start_in_the_order_named`); ``kvs,content``
  starts too, content first (``Module.after``; it failed "no service
  matching content.store": DEFECT found here, fixed)
  (:func:`test_the_order_of_modules_is_not_a_trap`).
* ``stats connector-local`` -> no such module; the connector's counters
  are ``stats broker -p connector`` (stats test).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path

import pytest
from test_broker_support import (
    KVBROKER,
    install_plugin,
    run_cli,
    use_module_plugin,
    wait_until,
)

from broker.errors import RemoteError
from broker.launch import Instance, StartError

TESTMOD = '''
import asyncio
import os
from typing import ClassVar

from broker.attrs import AttrSpec, text
from broker.module import Module

LONG = "abcdefghijklmnopqrstuvwxyz"


class TestMod(Module):
    """The counterpart of Flux's t/module/testmod.c."""
    name: ClassVar[str] = "testmod"
    services: ClassVar[tuple[str, ...]] = ("testmod", LONG)
    attributes: ClassVar[tuple[AttrSpec, ...]] = (AttrSpec("testmod.mode", "", text),)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.mode = ctx.attrs.get("testmod.mode") or os.environ.get("TESTMOD_MODE", "")
        if self.mode.startswith("service="):  # (another module's service too)
            self.services = ("testmod", self.mode.removeprefix("service="))

    def handlers(self):
        return {"testmod.info": self.info, "testmod.panic": self.panic,
                "testmod.break-stats": self.break_stats,
                "testmod.hang": self.hang, "testmod.park": self.park,
                LONG + ".info": self.info}

    async def hang(self, msg):  # (a handler that never ends)
        await asyncio.Event().wait()

    def park(self, msg):  # (a request kept, never answered)
        pass

    async def start(self):
        if self.mode == "init-failure":
            raise RuntimeError("testmod: init failure asked for")
        if self.mode == "start-hang":
            await asyncio.Event().wait()
        self.h.subscribe("testmod.")

    def on_event(self, msg):
        if msg.topic == "testmod.panic":
            raise RuntimeError("testmod: event failure asked for")
        self.events.handled += 1

    def stats(self):
        if self.mode == "stats-raise":
            raise RuntimeError("testmod: stats failure asked for")
        return {"events": self.event_stats()}

    def break_stats(self, msg):
        self.mode = "stats-raise"
        self.h.respond(msg, {})

    async def stop(self):
        if self.mode == "stop-failure":
            raise RuntimeError("testmod: stop failure asked for")
        if self.mode == "stop-hang":
            await asyncio.Event().wait()

    def info(self, msg):
        self.h.respond(msg, {"name": self.name, "rank": self.ctx.rank,
                             "size": self.ctx.size, "owner": self.ctx.owner_uid})

    def panic(self, msg):
        raise RuntimeError("testmod: runtime failure asked for")
'''

LONG = "abcdefghijklmnopqrstuvwxyz"
WITH_TESTMOD = {"broker.modules": "content,kvs,kvs-watch,testmod"}
T = 20.0


@pytest.fixture
def testmod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    use_module_plugin(tmp_path, monkeypatch, "testmod", "TestMod", TESTMOD)
    monkeypatch.delenv("TESTMOD_MODE", raising=False)
    return monkeypatch


def start_args(modules: str, *cmd: str) -> tuple[str, ...]:
    return ("start", "-S", f"broker.modules={modules}", "--", *cmd)


async def test_a_plugin_module_is_listed_with_its_services_on_every_rank(
        testmod, start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs=WITH_TESTMOD)
    for rank in (0, 1):
        rc, out, err = await run_cli("module", "list", "-r", str(rank), uri=inst.uri(1))
        assert (rc, err) == (0, ""), err
        line = next(ln for ln in out.splitlines() if ln.startswith("testmod "))
        assert line.split()[-2:] == ["testmod,", LONG], line  # the long name in full
        rc, out, err = await run_cli("module", "list", "--json", "-r", str(rank),
                                     uri=inst.uri(0))
        mods = {m["name"]: m for m in json.loads(out)["modules"]}
        assert list(mods) == ["broker", "content", "kvs", "kvs-watch", "testmod"]
        assert mods["testmod"]["services"] == ["testmod", LONG]
    h = await connect(inst, 1)
    for rank in (0, 1):
        for service in ("testmod", LONG):
            info = await asyncio.wait_for(h.rpc(f"{service}.info", {}, nodeid=rank), T)
            assert info == {"name": "testmod", "rank": rank, "size": 2,
                            "owner": os.getuid()}, info
    # without it (Flux's 'lsmod does not show test module')
    other = await start_instance(size=1)
    rc, out, _ = await run_cli("module", "list", uri=other.uri(0))
    assert rc == 0 and "testmod" not in out and LONG not in out


async def test_a_module_named_twice_is_refused_at_start(testmod) -> None:
    rc, out, err = await run_cli(*start_args("content,testmod,testmod", "true"))
    assert rc == 2, (rc, out, err)
    assert "module testmod asks for service 'testmod', which testmod provides" in err, err


async def test_an_unknown_module_is_refused_at_start(testmod) -> None:
    rc, out, err = await run_cli(*start_args("content,nosuchmodule", "true"))
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "no module named 'nosuchmodule'" in err, err
    assert "known: content, cron, groups, heartbeat, kvs, kvs-watch, testmod" in err, err
    assert "Traceback" not in err


async def test_a_module_that_fails_to_start_stops_the_start(testmod) -> None:
    testmod.setenv("TESTMOD_MODE", "init-failure")
    rc, out, err = await run_cli(*start_args("content,testmod", "echo", "ran"))
    assert rc == 2 and "ran" not in out, (rc, out, err)
    assert "init failure asked for" in err and "Traceback" not in err, err


async def test_a_module_that_fails_to_start_is_named(testmod) -> None:
    testmod.setenv("TESTMOD_MODE", "init-failure")
    rc, out, err = await run_cli(*start_args("content,testmod", "true"))
    assert rc == 2, (rc, out, err)
    # the module's own message aside, the broker names the module
    assert "testmod" in err.replace("testmod: init failure", ""), err


async def test_a_module_that_fails_to_stop_is_named(testmod) -> None:
    testmod.setenv("TESTMOD_MODE", "stop-failure")
    rc, out, err = await run_cli(*start_args("content,testmod", "echo", "ran"))
    assert "ran" in out, (rc, out, err)
    assert rc == 1, (rc, out, err)
    assert "module testmod failed to stop" in err, err


async def test_a_module_runtime_failure_is_logged_not_fatal(
        testmod, start_instance, connect) -> None:
    """Flux's testmod fails at run time on the event ``testmod.panic`` and the
    broker panics (unless ``broker.module-nopanic=1``).  Here an event
    handler, a request handler or ``stats()`` that raises is logged; the
    request is answered ``EIO``; the module and the rank run on."""
    inst = await start_instance(size=1, attrs=WITH_TESTMOD)
    h = await connect(inst, 0)
    await asyncio.wait_for(h.publish("testmod.panic"), T)
    await asyncio.wait_for(h.publish("testmod.ok"), T)

    async def handled() -> bool:
        events = (await h.rpc("testmod.stats-get", {}))["events"]
        return events["received"] == 2 and events["handled"] == 1

    await wait_until(handled, "testmod to handle the event after the failing one")
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(h.rpc("testmod.panic", {}), T)
    assert info.value.errnum == errno.EIO
    assert (await asyncio.wait_for(h.rpc("testmod.info", {}), T))["name"] == "testmod"
    await asyncio.wait_for(h.rpc("testmod.break-stats", {}), T)
    rc, out, err = await run_cli("stats", "testmod", uri=inst.uri(0))
    assert (rc, out) == (1, ""), (rc, out, err)
    assert "Input/output error" in err and "stats failure asked for" in err, err
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert rc == 0, err
    for what in ("event failure", "runtime failure", "stats failure"):
        assert f"testmod: {what} asked for" in out, what


async def test_module_command_usage(start_instance) -> None:
    rc, out, err = await run_cli("module")
    assert rc == 2 and "usage:" in err and "required" in err, (rc, out, err)
    rc, out, err = await run_cli("module", "-h")
    assert rc == 0 and "{list,load,remove,reload}" in out, (rc, out, err)
    rc, out, err = await run_cli("module", "debug", "testmod")
    assert rc == 2 and "invalid choice: 'debug'" in err, (rc, err)
    for sub in ("load", "reload", "remove"):  # (Flux's "fails with no arguments")
        rc, out, err = await run_cli("module", sub)
        assert rc == 2 and "the following arguments are required: NAME" in err, (sub, err)
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("module", "list", "foo", uri=inst.uri(0))
    assert rc == 2 and "unrecognized arguments: foo" in err, (rc, err)
    rc, out, err = await run_cli("rpc", "module.status", '{"status": 0}', uri=inst.uri(0))
    assert rc == 1 and "Function not implemented" in err, (rc, out, err)


async def test_stats_of_an_unknown_module(start_instance) -> None:
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("stats", "nosuchmodule", uri=inst.uri(0))
    assert (rc, out) == (1, ""), (rc, out, err)
    assert "no service matching nosuchmodule.stats-get" in err, err
    assert err.endswith("is a module of that name loaded? kvbroker module list)\n"), err
    rc, out, err = await run_cli("stats", uri=inst.uri(0))
    assert rc == 2 and "usage:" in err and "MODULE" in err, (rc, err)
    for cmd in (("module", "list"), ("stats", "kvs")):  # (Flux's invalid_rank)
        rc, out, err = await run_cli(*cmd, "-r", "2", uri=inst.uri(0))
        assert (rc, out) == (1, ""), (cmd, rc, out, err)
        assert "no route to rank 2: the instance has rank 0" in err, err


def requests_of(listing: str, name: str) -> int:
    return next(m["requests"] for m in json.loads(listing)["modules"] if m["name"] == name)


async def test_stats_prints_json_and_requests_counts_move_and_clear(
        testmod, start_instance) -> None:
    inst = await start_instance(size=2, attrs=WITH_TESTMOD)
    uri = inst.uri(0)
    rc, out, err = await run_cli("stats", "kvs", uri=uri)
    assert rc == 0 and isinstance(json.loads(out)["counts"], dict), err
    rc, out, err = await run_cli("stats", "testmod", uri=uri)
    assert (rc, list(json.loads(out))) == (0, ["events"]), (out, err)
    rc, out, err = await run_cli("stats", "broker", "-p", "connector", uri=uri)
    assert rc == 0 and isinstance(json.loads(out), dict), (out, err)

    async def requests(rank: int = 0) -> int:
        rc, out, err = await run_cli("module", "list", "--json", "-r", str(rank), uri=uri)
        assert rc == 0, err
        return requests_of(out, "testmod")

    # (a client's testmod.disconnect counts as a request too, as in Flux, and
    # reaches the module when the rank notices the client gone: hence the
    # comparisons, as Flux's count2 > count and count2 < count)
    before = await requests()
    for rank in ("0", "1", "0", "1", "0", "1"):
        rc, _, err = await run_cli("rpc", "testmod.info", "--rank", rank, uri=uri)
        assert rc == 0, err
    counted, counted1 = await requests(), await requests(1)
    assert counted >= before + 3 and counted1 >= 3, (before, counted, counted1)

    rc, out, err = await run_cli("stats", "--clear", "testmod", uri=uri)
    assert (rc, out, err) == (0, "", "")
    assert await requests() < counted
    assert await requests(1) >= counted1  # (--clear: the rank attached to only)
    rc, out, err = await run_cli("stats", "--clear-all", "testmod", uri=uri)
    assert (rc, out, err) == (0, "", "")
    assert await requests(1) < counted1

    rc, out, err = await run_cli("stats", "-R", "testmod", "-p", "maxrss", uri=uri)
    assert rc == 0 and int(out) > 1000, (out, err)


async def test_stats_scale_of_a_double_and_type_conversions(start_instance) -> None:
    """What agrees with Flux's parse_json: ``--type int`` truncates the
    scaled value; ``--type double`` prints ``%f``; a double field scaled
    stays a double."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    rc, out, err = await run_cli("stats", "broker", "-p", "rank", "--type", "double", uri=uri)
    assert (rc, out) == (0, "0.000000\n"), (out, err)
    rc, out, err = await run_cli("stats", "kvs", "-p", "pid", uri=uri)
    pid = int(out)
    rc, out, err = await run_cli("stats", "kvs", "-p", "pid", "--type", "int", "-s", "2",
                                 uri=uri)
    assert (rc, out) == (0, f"{2 * pid}\n"), (out, err)
    rc, out, err = await run_cli("stats", "broker", "-p", "rss_mb", "-s", "2", uri=uri)
    assert rc == 0 and float(out) > 0 and "." in out, (out, err)


async def test_stats_scale_of_an_integer_field_stays_an_integer(start_instance) -> None:
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("stats", "kvs", "-p", "pid", uri=inst.uri(0))
    pid = int(out)
    rc, out, err = await run_cli("stats", "kvs", "-p", "pid", "--scale", "2",
                                 uri=inst.uri(0))
    assert (rc, out) == (0, f"{2 * pid}\n"), (rc, out, err)


BAD_PLUGINS = {
    "broken_mod.py": 'raise ImportError("broken on purpose")\n',
    "noname_mod.py": "from broker.module import Module\n\n\nclass NoName(Module):\n"
                     "    pass\n",
}
BAD_ENTRY_POINTS = ("[kvbroker.modules]\nbroken = broken_mod:Nope\n"
                    "noname = noname_mod:NoName\n")


@pytest.fixture
def bad_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", install_plugin(
        tmp_path / "bad", "bad-plugins", BAD_ENTRY_POINTS, BAD_PLUGINS))


async def test_a_module_that_fails_to_import_is_named(bad_plugins) -> None:
    rc, out, err = await run_cli(*start_args("content,broken", "true"))
    assert rc == 2, (rc, out, err)
    assert "broken on purpose" in err, err
    assert "broken" in err.replace("broken on purpose", ""), err


async def test_a_module_class_without_a_name_is_refused(bad_plugins) -> None:
    rc, out, err = await run_cli(*start_args("content,noname", KVBROKER, "module", "list"))
    assert rc == 2, (rc, out, err)
    assert "noname" in err, err


async def test_stats_clear_and_clear_all_together(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    for _ in range(5):
        await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=1), T)
    rc, out, err = await run_cli("module", "list", "--json", "-r", "1", uri=inst.uri(0))
    before = requests_of(out, "kvs")
    assert before >= 5
    rc, out, err = await run_cli("stats", "--clear", "--clear-all", "kvs", uri=inst.uri(0))
    if rc == 2:
        return  # (refused as a usage error: fine)
    assert rc == 0, (rc, out, err)
    rc, out, err = await run_cli("module", "list", "--json", "-r", "1", uri=inst.uri(0))
    # (cleared, rank 1 would count the clear's own disconnect at most)
    assert requests_of(out, "kvs") >= before, "rank 1 was cleared by --clear (rank 0's)"


async def test_a_module_whose_start_hangs_bounds_the_start(testmod, tmp_path: Path) -> None:
    """Flux's hanging module (remove hangs until ``--cancel``): here a module
    whose ``start()`` never returns keeps the rank from being ready; the
    start gives up at its timeout (``kvbroker start``: 60 s, exit 2) and the
    ranks stop on SIGTERM, none killed."""
    testmod.setenv("TESTMOD_MODE", "start-hang")
    inst = Instance(2, 2, attrs={"broker.modules": "content,testmod"},
                    stderr_path=str(tmp_path / "hang.log"))
    try:
        with pytest.raises(StartError) as info:
            await inst.start(timeout=2)
        assert "did not start in 2s (ranks 0-1 not ready" in str(info.value), info.value
    finally:
        await asyncio.wait_for(inst.stop(), 30)
    assert inst.killed == []


async def test_a_service_name_with_a_period_is_refused(testmod) -> None:
    testmod.setenv("TESTMOD_MODE", "service=content.x")
    rc, out, err = await run_cli(*start_args("content,testmod", KVBROKER, "rpc",
                                             "content.x.info"))
    assert rc == 2 and "content.x" in err, (rc, out, err)


async def test_a_service_another_module_holds_is_refused(testmod) -> None:
    """Flux's 'cannot load the same module twice' for a service: a module
    that asks for ``kvs`` (the kvs module's) or ``attr`` (the broker's)
    stops the start, exit 2, the service named (not the module asking)."""
    for service in ("kvs", "attr"):
        testmod.setenv("TESTMOD_MODE", f"service={service}")
        rc, out, err = await run_cli(*start_args("content,kvs,testmod", "echo", "ran"))
        assert rc == 2 and "ran" not in out, (rc, out, err)
        owner = "kvs" if service == "kvs" else "broker"
        assert f"asks for service '{service}', which {owner} provides on this rank" in err, err


async def test_modules_start_in_the_order_named() -> None:
    """Flux's rc1 loads content before kvs; here ``broker.modules`` is that
    order: ``content,kvs`` (and ``kvs-watch`` without ``kvs``: it starts,
    its requests answered ENOSYS at use)."""
    rc, out, err = await run_cli(*start_args("content,kvs", KVBROKER, "kvs", "put", "a=1"))
    assert (rc, err) == (0, ""), (rc, out, err)
    rc, out, err = await run_cli(*start_args("content,kvs-watch", KVBROKER, "module", "list"))
    assert rc == 0 and "kvs-watch" in out, (rc, out, err)


async def test_the_order_of_modules_is_not_a_trap() -> None:
    rc, out, err = await run_cli(*start_args("kvs,content", "echo", "ran"))
    assert rc == 0 or ("order" in err or "before" in err or "after" in err), (rc, out, err)


def listed(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines()[1:]]


async def test_load_reload_list_and_remove_at_runtime(testmod, start_instance, connect) -> None:
    """Flux's load / reload / lsmod shows / cannot load twice / unload /
    lsmod does not show, on a running instance, and on every rank at once
    (``-r all``); the module answers to its services once loaded, and
    ``ENOSYS`` once removed."""
    inst = await start_instance(size=2)
    rc, out, err = await run_cli("module", "load", "-r", "all", "testmod", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    h = await connect(inst, 1)
    for rank in (0, 1):
        rc, out, err = await run_cli("module", "list", "-r", str(rank), uri=inst.uri(0))
        assert listed(out) == ["broker", "content", "kvs", "kvs-watch", "testmod"], out
        info = await asyncio.wait_for(h.rpc(f"{LONG}.info", {}, nodeid=rank), T)
        assert info["rank"] == rank, info
    rc, out, err = await run_cli("module", "load", "testmod", uri=inst.uri(1))
    assert (rc, out) == (1, ""), (rc, out, err)
    assert err.strip() == ("kvbroker: module load: File exists (module testmod is loaded on "
                           "rank 1 already: module reload replaces it)"), err
    rc, out, err = await run_cli("module", "reload", "testmod", uri=inst.uri(1))
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    assert (await asyncio.wait_for(h.rpc("testmod.info", {}), T))["rank"] == 1
    rc, out, err = await run_cli("module", "remove", "-r", "0-1", "testmod", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    for rank in (0, 1):
        rc, out, err = await run_cli("module", "list", "-r", str(rank), uri=inst.uri(0))
        assert listed(out) == ["broker", "content", "kvs", "kvs-watch"], out
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(h.rpc("testmod.info", {}, nodeid=rank), T)
        assert info.value.errnum == errno.ENOSYS, info.value
    rc, out, err = await run_cli("dmesg", uri=inst.uri(1))
    assert "module testmod loaded" in out and "module testmod removed (module remove)" in out


async def test_insmod_returns_initialization_error(testmod, start_instance, connect) -> None:
    """Flux's 'insmod returns initialization error': the module's own error
    is the answer, and the rank is as it was -- not listed, its services
    free, its setting undone -- so a load after it works."""
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("module", "load", "testmod", "mode=init-failure",
                                 uri=inst.uri(0))
    assert (rc, out) == (1, ""), (rc, out, err)
    assert "testmod: init failure asked for" in err and "Traceback" not in err, err
    rc, out, err = await run_cli("module", "list", uri=inst.uri(0))
    assert "testmod" not in listed(out), out
    rc, out, err = await run_cli("attr", "get", "testmod.mode", uri=inst.uri(0))
    assert rc == 1 and "testmod.mode" in err, (rc, out, err)  # (undone: never loaded)
    rc, out, err = await run_cli("module", "load", "testmod", uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    h = await connect(inst, 0)
    assert (await asyncio.wait_for(h.rpc("testmod.info", {}), T))["name"] == "testmod"


async def test_remove_fails_on_invalid_module_and_f_succeeds(start_instance) -> None:
    """Flux's 'remove fails on invalid module', 'remove -f succeeds on
    nonexistent module', and 'load fails on invalid module'; reload -f
    of a module not loaded loads it."""
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("module", "remove", "nosuchmodule", uri=inst.uri(0))
    assert (rc, out) == (1, ""), (rc, out, err)
    assert "No such file or directory (module nosuchmodule is not loaded on rank 0)" in err
    rc, out, err = await run_cli("module", "remove", "-f", "nosuchmodule", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    rc, out, err = await run_cli("module", "load", "nosuchmodule", uri=inst.uri(0))
    assert rc == 1, (rc, err)
    assert "no module named 'nosuchmodule' (known: content, cron, groups, heartbeat" in err, err
    rc, out, err = await run_cli("module", "reload", "heartbeat", uri=inst.uri(0))
    assert rc == 1 and "module heartbeat is not loaded on rank 0 (module reload -f" in err, err
    rc, out, err = await run_cli("module", "reload", "-f", "heartbeat", uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    rc, out, err = await run_cli("module", "list", uri=inst.uri(0))
    assert listed(out)[-1] == "heartbeat", out


async def test_hanging_module_remove_cancel(testmod, start_instance, connect) -> None:
    """Flux's 'hanging module cannot be removed' and 'remove --cancel': a
    remove waits for the module's stop (here for ever: ``-t`` gives up),
    a second remove is refused while the first waits, and ``--cancel``
    cancels the stop; the module is gone, and can be loaded again."""
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("module", "load", "testmod", "testmod.mode=stop-hang",
                                 uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    rc, out, err = await run_cli("module", "remove", "-t", "1", "testmod", uri=inst.uri(0))
    assert rc != 0 and "module remove" in err, (rc, out, err)
    h = await connect(inst, 0)
    with pytest.raises(RemoteError) as info:  # (its services went at once)
        await asyncio.wait_for(h.rpc("testmod.info", {}), T)
    assert info.value.errnum == errno.ENOSYS
    rc, out, err = await run_cli("module", "remove", "testmod", uri=inst.uri(0))
    assert rc == 1 and "module testmod is being removed on rank 0 already" in err, err
    rc, out, err = await run_cli("module", "remove", "--cancel", "testmod", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    rc, out, err = await run_cli("module", "list", uri=inst.uri(0))
    assert "testmod" not in listed(out), out
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert "module testmod: its stop was cancelled (module remove --cancel)" in out, out
    # (again, as one that stops: the rank keeps the mode it was given last,
    # and a stop that hangs held the instance's teardown 15 s)
    rc, out, err = await run_cli("module", "load", "testmod", "testmod.mode=plain",
                                 uri=inst.uri(0))
    assert (rc, err) == (0, ""), err


async def test_a_remove_cancel_before_the_stop_began_ends_what_the_module_served(
        testmod, start_instance, connect) -> None:
    """``module remove --cancel`` of a module whose stop had not begun yet
    (not hung: the first remove) cancelled the stop before its first step,
    so nothing of its end ran: the requests it was serving, and those it
    kept, waited for ever, its handler tasks ran on (found by a review).
    They end ``ENOSYS``, as at a plain remove."""
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("module", "load", "testmod", "testmod.mode=plain",
                                 uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    h = await connect(inst, 0)
    hang = h.rpc("testmod.hang", {})
    park = h.rpc("testmod.park", {})
    assert (await asyncio.wait_for(h.rpc("testmod.info", {}), T))["name"] == "testmod"
    rc, out, err = await run_cli("module", "remove", "--cancel", "testmod", uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    for call in (hang, park):
        with pytest.raises(RemoteError) as ended:
            await asyncio.wait_for(call, T)
        assert ended.value.errnum == errno.ENOSYS, ended.value
        assert "module testmod was removed" in ended.value.errstr, ended.value


async def test_a_start_that_hangs_at_runtime_is_cancelled_by_remove_cancel(
        testmod, start_instance, connect) -> None:
    """A module loaded at runtime whose start hangs served requests and
    could be neither removed nor reloaded (``EBUSY``, with ``--cancel``
    too) until the rank stopped (found by a review).  ``remove --cancel``
    cancels its start: the load ends ``ECANCELED``, the module is gone,
    and it can be loaded again."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    h = await connect(inst, 0)
    load = asyncio.ensure_future(h.rpc("module.load", {
        "name": "testmod", "args": ["testmod.mode=start-hang"]}))
    async with asyncio.timeout(T):
        rc, out, err = await run_cli("module", "remove", "testmod", uri=uri)
        while rc == 1 and "is not loaded" in err:  # (the load's first step not run yet)
            rc, out, err = await run_cli("module", "remove", "testmod", uri=uri)
    assert rc == 1 and "is being loaded on rank 0" in err and "--cancel" in err, err
    rc, out, err = await run_cli("module", "remove", "--cancel", "testmod", uri=uri)
    assert (rc, err) == (0, ""), err
    with pytest.raises(RemoteError) as cancelled:
        await asyncio.wait_for(load, T)
    assert cancelled.value.errnum == errno.ECANCELED, cancelled.value
    rc, out, err = await run_cli("module", "list", uri=uri)
    assert "testmod" not in listed(out), out
    rc, out, err = await run_cli("module", "load", "testmod", "testmod.mode=plain", uri=uri)
    assert (rc, err) == (0, ""), err


async def test_module_arguments_are_its_attributes(testmod, start_instance) -> None:
    """Flux passes a module arguments; here they are the module's own
    attributes, with or without its name before them, checked before
    anything changes: a reload with a bad one leaves the loaded module."""
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("module", "load", "testmod", "nosuch=1", uri=inst.uri(0))
    assert rc == 1, (rc, out, err)
    assert ("Invalid argument (module testmod has no attribute 'nosuch' (its attributes: "
            "testmod.mode))") in err, err
    rc, out, err = await run_cli("module", "load", "testmod", "mode", uri=inst.uri(0))
    assert rc == 1 and "a module argument is ATTR=VALUE: 'mode'" in err, err
    rc, out, err = await run_cli("module", "load", "testmod", "mode=a", "testmod.mode=b",
                                 uri=inst.uri(0))
    assert rc == 1 and "module argument testmod.mode is given twice" in err, err
    rc, out, err = await run_cli("module", "load", "testmod", "mode=b", uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    rc, out, err = await run_cli("attr", "get", "testmod.mode", uri=inst.uri(0))
    assert out.strip() == "b", out
    rc, out, err = await run_cli("module", "reload", "kvs", "checkpoint-period=soon",
                                 uri=inst.uri(0))
    assert rc == 1 and "kvs.checkpoint-period" in err, (rc, err)
    rc, out, err = await run_cli("module", "list", uri=inst.uri(0))
    assert "kvs" in listed(out), out
