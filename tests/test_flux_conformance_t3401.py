"""flux-core t/t3401-module-trace.t (``flux module trace``: the messages a
module sends and receives, printed as they pass) against real kvbroker
ranks.

kvbroker has no ``module trace``: its ``module`` command has ``list``,
``load``, ``remove`` and ``reload`` (docs/cli.md "module"), and its modules
run inside the rank's process, so no
message between the broker and a module crosses anything a tracer could
attach to.  What kvbroker shows of a module's traffic is counted, not
printed: ``module list``'s ``requests`` (every request given to the module,
answered or failed) and the ``events`` section of ``kvbroker stats MODULE``
(the events its subscriptions brought: ``received``, ``handled``,
``dropped``).  The messages crossing the tree are printed by ``kvbroker
overlay trace`` (tests/test_flux_conformance_t3400.py,
tests/test_overlay_trace.py).  Each of Flux's cases below becomes the
nearest of these, or is said not to apply.

Flux's cases, in order, and what each becomes:

1.  'fails with unknown argument' (``module trace --not-an-arg``) and
2.  'fails with wrong message type' (``module trace -t foo,bar``) -> the
    ``trace`` subcommand itself is refused: exit 2 (kvbroker's exit for
    every usage error, docs/cli.md Conventions; Flux's is 1), naming the one
    subcommand there is, with no traceback
    (:func:`test_module_trace_is_refused_as_a_usage_error`: the usage error
    lists the subcommands there are, ``list``, ``load``, ``remove``,
    ``reload``).  tests/test_flux_conformance_t0003.py checks ``debug`` the
    same way; ``trace`` is checked here.
3.  'reload heartbeat with increased heart rate' -> the same, ``kvbroker
    module reload heartbeat period=0.2s`` on rank 0 (docs/cli.md "module"),
    the module loaded at start at its default 2 s; ``stats heartbeat``
    says 2, then 0.2 (:func:`test_pulses_reach_the_subscribed_module_only`).
4.  'start background trace' (kvs, job-manager),
5.  '... second ... with --full',
6.  '... third ... with no module name' -> not applicable: no module
    trace.  The nearest is reading the counters before and after.
7.  'heartbeat.pulse event was captured' (and 8, 9 with --full / no
    module) -> the event is delivered to the module subscribed to it: on
    rank 1 the heartbeat module's ``events.received`` and ``handled`` grow
    with the pulses, ``count`` with them
    (:func:`test_pulses_reach_the_subscribed_module_only`).  In Flux the
    kvs module is subscribed to ``heartbeat.pulse``; kvbroker's kvs is not
    (it subscribes to its own namespace events), so the pulse is not the
    kvs module's here: deliberate, not a defect.
10. 'send one kvs.ping' -> kvbroker's modules have no ``NAME.ping``
    (docs/cli.md "ping": Flux's other targets have no counterpart;
    ``kvbroker rpc kvs.ping`` fails ENOSYS ``unknown topic kvs.ping``).
    Nearest: one request to a module, here a test module's
    ``tracemod.echo`` (:func:`test_requests_are_counted_by_the_module_given_them`).
11. 'kvs.ping request/response was captured' (and 12, 13) -> the answer
    comes back to the sender (the echo of its payload), and the module's
    ``requests`` grows by exactly one; no other module's moves.
14. 'send one job-manager.kill (failing)' -> no job manager; the same
    shape is a request the module fails with a human-readable text
    (``tracemod.fail``, ENOENT ``no such bunny``), and a topic of the
    module's service it has no handler for (``tracemod.nosuch``, ENOSYS).
15. 'job-manager.kill request/response was captured' (and 16, 17) -> the
    sender gets the errno and the text; each failed request is counted as
    one request of the module (same test); from the command line, as
    Flux's case runs it, exit 1 with the module's text
    (:func:`test_a_failed_request_s_text_reaches_the_command_line`).
18-20. 'stop background trace' (x3) -> not applicable (no trace process).
21. 'start background trace on multiple modules' (kvs content),
22. 'heartbeat.pulse event was captured',
23. 'send one content.ping',
24. 'content.ping request/response was captured',
25. 'stop background trace' -> one request to each of two modules moves
    each one's count by one, the others' not (the second test: ``tracemod``
    and ``content``, by ``kvbroker rpc``).
26. 'start background trace on resource module' (``--human --delta
    --type=request,response,event``),
27. 'synchronize tracing', 28. 'reload resource module',
29. 'kvs.lookup request was captured', 30. 'stop background trace' -> not
    applicable: no resource module (so nothing of it to reload; the reload
    of a module is case 3, and tests/test_module_runtime.py), no module
    trace formatting options (``overlay trace`` has
    ``--human``/``--delta``/``--type``: t3400 and
    tests/test_overlay_trace.py).
31. 'resource module trace excludes heartbeat' (flux-core issue #6944: a
    module not subscribed to ``heartbeat.pulse`` was shown receiving it) ->
    a module not subscribed to the pulse is not given it: on rank 1 the
    kvs, kvs-watch and test modules' ``events.received`` stay as they were
    while the heartbeat module's grow by several pulses
    (:func:`test_pulses_reach_the_subscribed_module_only`); the test
    module, subscribed to ``tracemod.``, is given its own event, once.

Beyond Flux's cases: a module's counters are what replace its trace
here, so reading one of a module that keeps none says so, ``(its
fields: none)`` (it listed nothing, ``(its fields: )``, until 2026-12-05:
found by this file; :func:`test_parse_of_a_module_with_no_stats_says_it_has_none`).

Note on the counts: a client that leaves has its rank send
``<service>.disconnect`` to each service it used, counted as one more
request of the module (as Flux's broker sends it and Flux's ``rx.request``
counts it).  It comes after the client has gone, so the requests here are
sent from one handle that stays, and counted through it.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli, use_module_plugin, wait_until

from broker.errors import RemoteError

T = 30.0
MODULES = "content,kvs,kvs-watch,heartbeat,tracemod"

TRACEMOD = '''
import errno
from typing import ClassVar

from broker.errors import ErrnoError
from broker.module import Module


class TraceMod(Module):
    """Echoes ``tracemod.echo``; fails ``tracemod.fail`` with a text;
    subscribed to ``tracemod.`` events."""
    name: ClassVar[str] = "tracemod"

    def handlers(self):
        return {"tracemod.echo": self.echo, "tracemod.fail": self.fail}

    async def start(self):
        self.h.subscribe("tracemod.")

    def on_event(self, msg):
        self.events.handled += 1

    def stats(self):
        return {"events": self.event_stats()}

    def echo(self, msg):
        self.h.respond(msg, msg.payload)

    def fail(self, msg):
        raise ErrnoError(errno.ENOENT, "no such bunny")
'''


@pytest.fixture
def tracemod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_module_plugin(tmp_path, monkeypatch, "tracemod", "TraceMod", TRACEMOD)


async def cli(*args: str, uri: str) -> Any:
    rc, out, err = await run_cli(*args, uri=uri)
    assert rc == 0 and err == "", (args, rc, err)
    return json.loads(out)


async def test_module_trace_is_refused_as_a_usage_error() -> None:
    """Cases 1, 2: no instance is needed to refuse the command line."""
    for args in (["--not-an-arg"], ["-t", "foo,bar"], ["kvs", "content"], []):
        rc, out, err = await run_cli("module", "trace", *args, uri="local:///nonexistent")
        assert (rc, out) == (2, ""), (args, rc, out, err)
        assert err.startswith("usage: kvbroker module "), err
        assert ("invalid choice: 'trace' (choose from 'list', 'load', 'remove', 'reload')"
                in err), err
        assert "Traceback" not in err


async def test_pulses_reach_the_subscribed_module_only(start_instance, tracemod) -> None:
    """Cases 3, 7-9 and 31 (#6944), on rank 1, which hears the pulse from
    rank 0."""
    inst = await start_instance(size=2, attrs={"broker.modules": MODULES})
    uri = inst.uri(0)
    # 3: reload heartbeat with increased heart rate (rank 0's: it beats)
    assert (await cli("stats", "heartbeat", "-p", "period", uri=uri)) == 2
    rc, out, err = await run_cli("module", "reload", "heartbeat", "period=0.2s", uri=uri)
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    assert (await cli("stats", "heartbeat", "-p", "period", uri=uri)) == 0.2

    async def events(module: str) -> dict[str, Any]:
        return dict(await cli("stats", module, "-r", "1", "-p", "events", uri=uri))

    before = {m: await events(m) for m in ("kvs", "kvs-watch", "tracemod")}
    assert before["tracemod"]["subscribe_calls"] == 1
    hb0 = await cli("stats", "heartbeat", "-r", "1", uri=uri)
    assert hb0["events"]["subscribe_calls"] == 1

    async def pulses_heard() -> bool:
        hb = await cli("stats", "heartbeat", "-r", "1", uri=uri)
        return bool(hb["events"]["received"] >= hb0["events"]["received"] + 3)

    await wait_until(pulses_heard, "rank 1's heartbeat module to be given 3 more pulses", T)
    hb1 = await cli("stats", "heartbeat", "-r", "1", uri=uri)
    assert hb1["events"]["handled"] == hb1["events"]["received"], hb1
    assert hb1["count"] >= hb0["count"] + 3, (hb0, hb1)
    assert sum(hb1["events"]["dropped"].values()) == 0, hb1
    # nothing but the heartbeat module was given them
    for m, was in before.items():
        assert await events(m) == was, m

    # the test module is given its own topic's event, once, handled
    rc, out, err = await run_cli("event", "pub", "--loopback", "tracemod.hello", uri=inst.uri(1))
    assert (rc, err) == (0, ""), err
    got = await events("tracemod")
    assert (got["received"], got["handled"]) == (before["tracemod"]["received"] + 1,
                                                 before["tracemod"]["handled"] + 1), got
    for m in ("kvs", "kvs-watch"):
        assert await events(m) == before[m], m


async def test_requests_are_counted_by_the_module_given_them(start_instance, connect,
                                                             tracemod) -> None:
    """Cases 10-17 and 21-25: each request given to a module, answered or
    failed, is one request of that module and of no other; the sender gets
    the answer, or the errno and the text.  The requests go from one handle
    (a client that leaves also has the broker send ``tracemod.disconnect``,
    one more request of the module, as Flux's broker does)."""
    inst = await start_instance(size=1, attrs={"broker.modules": "content,kvs,tracemod"})
    h = await connect(inst)

    async def requests() -> dict[str, int]:
        listing = await h.rpc("module.list", {})
        return {m["name"]: m["requests"] for m in listing["modules"]}

    others = ("content", "kvs")
    was = await requests()
    assert await h.rpc("tracemod.echo", {"ping": 1}) == {"ping": 1}
    now = await requests()
    assert now["tracemod"] == was["tracemod"] + 1, (was, now)
    assert [now[m] for m in others] == [was[m] for m in others], (was, now)

    with pytest.raises(RemoteError) as failed:
        await h.rpc("tracemod.fail", {})
    assert (failed.value.errnum, failed.value.errstr) == (errno.ENOENT, "no such bunny")
    with pytest.raises(RemoteError) as failed:
        await h.rpc("tracemod.nosuch", {})
    assert (failed.value.errnum, failed.value.errstr) == (
        errno.ENOSYS, "unknown topic tracemod.nosuch")
    after = await requests()
    assert after["tracemod"] == now["tracemod"] + 2, (now, after)
    assert [after[m] for m in others] == [now[m] for m in others], (now, after)

    # two modules: one request each (content's own unknown topic, failed)
    with pytest.raises(RemoteError) as failed:
        await h.rpc("content.nosuch", {})
    assert failed.value.errnum == errno.ENOSYS
    assert await h.rpc("tracemod.echo", {}) == {}
    last = await requests()
    assert (last["content"], last["tracemod"], last["kvs"]) == (
        after["content"] + 1, after["tracemod"] + 1, after["kvs"]), (after, last)


async def test_a_failed_request_s_text_reaches_the_command_line(start_instance,
                                                              tracemod) -> None:
    """Case 14 as Flux runs it, from a command (``flux job kill
    fuzzybunny`` exits 1 with the service's text): ``kvbroker rpc`` of the
    failing topic exits 1 with the errno's text and the module's."""
    inst = await start_instance(size=1, attrs={"broker.modules": "content,kvs,tracemod"})
    rc, out, err = await run_cli("rpc", "tracemod.fail", uri=inst.uri(0))
    assert (rc, out) == (1, "")
    assert err == "kvbroker: tracemod.fail: No such file or directory (no such bunny)\n", err


QUIETMOD = '''
from typing import ClassVar

from broker.module import Module


class QuietMod(Module):
    """A module with no stats of its own (Module's default: none)."""
    name: ClassVar[str] = "quietmod"
'''


async def test_parse_of_a_module_with_no_stats_says_it_has_none(
        start_instance, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading a module's counters is what replaces its trace here: a
    field asked of a module that keeps none is refused, exit 1, saying the
    module has no fields rather than listing nothing."""
    use_module_plugin(tmp_path, monkeypatch, "quietmod", "QuietMod", QUIETMOD)
    inst = await start_instance(size=1, attrs={"broker.modules": "content,kvs,quietmod"})
    uri = inst.uri(0)
    rc, out, err = await run_cli("stats", "quietmod", uri=uri)
    assert (rc, json.loads(out), err) == (0, {}, "")
    rc, out, err = await run_cli("stats", "quietmod", "-p", "events", uri=uri)
    assert (rc, out) == (1, "")
    assert err == ("kvbroker: stats quietmod: events: the stats has no field 'events' "
                   "(its fields: none)\n"), err
