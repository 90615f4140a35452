"""Third-party modules and CLI commands plug in by entry point (docs/api.md).

The example module and command of docs/api.md are installed for the test only:
their code is copied from the docs into a temporary directory with a
``.dist-info`` declaring the entry points, put on ``PYTHONPATH`` of the rank
processes.  This also gives the broker a streaming service to test.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import doc_block, install_plugin, run_cli, stats, wait_until

from broker.errors import RemoteError
from broker.handle import Handle


@pytest.fixture
def echo_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = install_plugin(
        tmp_path, "echo-plugin",
        "[kvbroker.modules]\necho = mypkg.echo:EchoModule\n\n"
        "[kvbroker.commands]\necho = mypkg.echo_cli:register\n",
        {"mypkg/__init__.py": "",
         "mypkg/echo.py": doc_block("api.md", "# mypkg/echo.py"),
         "mypkg/echo_cli.py": doc_block("api.md", "# mypkg/echo_cli.py")})
    monkeypatch.setenv("PYTHONPATH", path)  # inherited by the rank processes
    return str(tmp_path)


MODULES = {"broker.modules": "content,echo"}


@pytest.mark.both_loops
async def test_a_module_found_by_entry_point(echo_plugin, start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=MODULES)
    async with asyncio.timeout(20):
        h = await connect(inst, 3)
        names = [m["name"] for m in (await h.rpc("module.list", {}, nodeid=2))["modules"]]
        assert names == ["broker", "content", "echo"]
        for rank in range(4):  # a module runs in every rank
            resp = await h.rpc("echo.hello", {"name": "x"}, nodeid=rank)
            assert resp == {"hello": "x", "rank": rank, "from": os.getuid()}
        with pytest.raises(RemoteError) as info:
            await h.rpc("echo.hello", {"name": 5})
        assert info.value.errnum == errno.EPROTO
        with pytest.raises(RemoteError) as info:
            await h.rpc("echo.nosuch", {})
        assert info.value.errnum == errno.ENOSYS
        # its events: subscribed at start, with a direct call
        stats = await h.rpc("echo.stats-get", {})
        assert stats == {"clients": 1, "events": 0}
        await h.publish("echo.ping")
        await h.publish("other.ping")

        async def one_event() -> bool:
            return (await h.rpc("echo.stats-get", {}, nodeid=1))["events"] == 1

        await wait_until(one_event, "rank 1's echo module to see the event")


@pytest.mark.both_loops
async def test_streaming_rpc(echo_plugin, start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2, attrs=MODULES)
    async with asyncio.timeout(20):
        h = await connect(inst, 1)
        assert [a async for a in h.rpc_stream("echo.count", {"n": 5}, nodeid=0)] == [
            {"i": i} for i in range(5)
        ]
        assert [a async for a in h.rpc_stream("echo.count", {"n": 0})] == []
        # several streams at once, interleaved on one connection
        streams = [h.rpc_stream("echo.count", {"n": n}, nodeid=n % 2) for n in range(1, 20)]
        assert len({stream.matchtag for stream in streams}) == len(streams)
        for n, stream in enumerate(streams, 1):
            assert [a["i"] async for a in stream] == list(range(n))
        # a streaming service refuses a plain request; errors end a stream
        with pytest.raises(RemoteError) as info:
            await h.rpc("echo.count", {"n": 1})
        assert info.value.errnum == errno.EPROTO
        stream = h.rpc_stream("echo.count", {"n": "many"})
        with pytest.raises(RemoteError) as info:
            await stream.next_message()
        assert info.value.errnum == errno.EPROTO
        assert await stream.next_message() is None


async def test_module_hears_disconnect(echo_plugin, start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=MODULES)
    async with asyncio.timeout(20):
        watcher = await connect(inst, 0)
        h = await Handle.connect(inst.uri(3))
        await h.rpc("echo.hello", {"name": "a"}, nodeid=1)  # served on rank 1
        assert (await watcher.rpc("echo.stats-get", {}, nodeid=1))["clients"] == 1
        await h.close()

        async def forgotten() -> bool:
            return (await watcher.rpc("echo.stats-get", {}, nodeid=1))["clients"] == 0

        await wait_until(forgotten, "echo.disconnect on rank 1")


async def test_a_cli_command_found_by_entry_point(echo_plugin, start_instance) -> None:
    inst = await start_instance(size=2, fanout=2, attrs=MODULES)
    rc, out, err = await run_cli("echo", "bob", uri=inst.uri(1))
    assert rc == 0, err
    assert out.strip() == f'{{"hello": "bob", "rank": 1, "from": {os.getuid()}}}'
    rc, out, err = await run_cli("--help")
    assert rc == 0 and "echo" in out


async def test_a_handler_never_started_is_closed_at_stop_without_a_warning() -> None:
    """A ``_finish`` task cancelled at stop before its first step left its
    handler coroutine unawaited: "coroutine ... was never awaited" on the
    rank's stderr (seen after SIGCONT of a stopped rank)."""
    import gc
    import warnings

    from broker.module import _close_unstarted_handler

    async def handler() -> None:
        pass

    async def finish(msg: object, aw: object) -> None:
        await aw  # type: ignore[misc]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = asyncio.get_running_loop().create_task(finish(None, handler()))
        _close_unstarted_handler(task)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        del task
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]


BIGPUB = '''
from typing import ClassVar

from broker.module import Handler, Module, require


class BigPubModule(Module):
    """Publishes, on request, an event of ``size`` bytes of payload."""
    name: ClassVar[str] = "bigpub"

    def handlers(self) -> dict[str, Handler]:
        return {"bigpub.publish": self.publish}

    async def publish(self, msg):
        body = require(msg.payload, topic=str, size=int)
        seq = await self.h.publish(body["topic"], {"pad": "x" * body["size"]})
        self.h.respond(msg, {"seq": seq})
'''


@pytest.fixture
def bigpub_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    path = install_plugin(tmp_path, "bigpub-plugin",
                          "[kvbroker.modules]\nbigpub = bigpub_mod:BigPubModule\n",
                          {"bigpub_mod.py": BIGPUB})
    monkeypatch.setenv("PYTHONPATH", path)  # inherited by the rank processes
    return str(tmp_path)


async def test_a_modules_event_too_big_for_a_link_is_refused_before_sequencing(
        bigpub_plugin, start_instance, connect) -> None:
    """A module's ``event.pub`` payload arrives unserialised: it was counted
    as 0 bytes, so rank 0 sequenced an event bigger than
    ``tbon.max-message`` and delivered it to its own subscribers while its
    link dropped it -- a gap on every follower, whose subscribers never saw
    it.  It is refused ``EMSGSIZE`` instead, before it has a number."""
    inst = await start_instance(size=2, fanout=2, attrs={
        "broker.modules": "content,bigpub", "tbon.max-message": "65536"})
    async with asyncio.timeout(20):
        h0, h1 = await connect(inst, 0), await connect(inst, 1)
        await h0.subscribe("test.")
        await h1.subscribe("test.")
        with pytest.raises(RemoteError) as info:
            await h0.rpc("bigpub.publish", {"topic": "test.big", "size": 100_000})
        assert info.value.errnum == errno.EMSGSIZE, info.value.errstr
        assert "exceeds tbon.max-message (65536)" in info.value.errstr
        small = (await h0.rpc("bigpub.publish", {"topic": "test.small", "size": 10}))["seq"]
        for h in (h0, h1):  # neither saw the big one: the next is the small one
            ev = await h.recv_event()
            assert (ev.topic, ev.seq) == ("test.small", small)
        assert (await stats(h1, 1))["events"]["gaps"] == 0


RELAY = '''
from typing import ClassVar

from broker.module import Handler, Module


class RelayModule(Module):
    """Answers each ``ping.`` event with a ``pong.`` one, published from
    ``on_event``; serves ``relay-svc`` (not its own name), where one
    request is answered with what msgpack cannot pack."""
    name: ClassVar[str] = "relay"
    services: ClassVar[tuple[str, ...]] = ("relay-svc",)

    async def start(self) -> None:
        self.h.subscribe("ping.")

    def handlers(self) -> dict[str, Handler]:
        return {"relay-svc.unpackable": self.unpackable}

    def on_event(self, msg):
        self.h.publish_nowait("pong." + msg.topic[5:], {"for": msg.seq})

    def unpackable(self, msg):
        self.h.respond(msg, {"set": {1, 2}})


def register(sub):  # a CLI command that takes a built-in's name
    sub.add_parser("ping")
'''


@pytest.fixture
def relay_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = install_plugin(tmp_path, "relay-plugin",
                          "[kvbroker.modules]\nrelay = relay_mod:RelayModule\n\n"
                          "[kvbroker.commands]\nping = relay_mod:register\n",
                          {"relay_mod.py": RELAY})
    monkeypatch.setenv("PYTHONPATH", path)  # inherited by the rank processes


async def test_an_event_published_from_on_event_comes_after_the_one_delivered(
        relay_plugin, start_instance, connect) -> None:
    """Rank 0 sequences an event a module publishes in ``on_event`` at once,
    while the event being delivered is half-way through its subscribers:
    those after the module got the new one (seq N+1) first, on rank 0
    only.  Every rank now sees seq order."""
    inst = await start_instance(size=2, fanout=2,
                                attrs={"broker.modules": "content,relay"})
    async with asyncio.timeout(20):
        handles = [await connect(inst, 0), await connect(inst, 1)]
        for h in handles:  # (subscribed after the module: delivered after it)
            await h.subscribe("ping.")
            await h.subscribe("pong.")
        for i in range(3):
            await handles[0].publish(f"ping.{i}")
        for rank, h in enumerate(handles):
            seen = [(ev.topic, ev.seq) for ev in  # a pong from each rank's relay
                    [await h.recv_event() for _ in range(9)]]
            assert [seq for _, seq in seen] == list(range(1, 10)), (rank, seen)
            assert seen[:2] == [("ping.0", 1), ("pong.0", 2)], (rank, seen)


async def test_a_modules_name_is_its_service_and_unpackable_answers_are_eproto(
        relay_plugin, start_instance, connect) -> None:
    """A module serving others than its name kept stats no request could
    reach; an answer msgpack cannot pack was dropped by the client's own
    rank (through a link it was EPROTO), and the RPC waited for ever."""
    inst = await start_instance(size=2, fanout=2,
                                attrs={"broker.modules": "content,relay"})
    async with asyncio.timeout(20):
        h = await connect(inst, 1)
        modules = (await h.rpc("module.list", {}))["modules"]
        assert {"name": "relay", "services": ["relay", "relay-svc"]} in [
            {k: m[k] for k in ("name", "services")} for m in modules]
        assert await h.rpc("relay.stats-get", {}) == {}  # (its stats(): the default)
        for nodeid in (1, 0):  # its own rank, then through the link
            with pytest.raises(RemoteError) as info:
                await h.rpc("relay-svc.unpackable", {}, nodeid=nodeid)
            assert info.value.errnum == errno.EPROTO, info.value.errstr
        assert (await h.rpc("broker.ping", {}))["rank"] == 1  # and it goes on serving
    rc, out, err = await run_cli("--help")
    assert rc == 0 and "kvbroker start" not in err, err
    assert "ignoring plugin command 'ping': " in err and "conflicting subparser" in err, err
    rc, _, err = await run_cli("nosuch")
    assert rc == 2 and "invalid choice: 'nosuch'" in err, err


async def mstats(h: Handle, module: str, rank: int) -> dict[str, Any]:
    return await asyncio.wait_for(h.rpc(f"{module}.stats-get", {}, nodeid=rank), 15)


async def test_stats_clear_sets_the_counters_back_and_keeps_what_is_now(
        start_instance, connect) -> None:
    """``stats --clear`` (Flux's ``module stats --clear``): one rank's module
    counters back to 0, every name kept; the watchers (what is now) and the
    subscriptions stay.  ``--clear-all``: every rank's."""
    inst = await start_instance(size=2)
    h1 = await connect(inst, 1)
    await h1.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
        {"key": "a", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"1"}}]})
    watch = h1.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "a",
                                               "flags": 4})  # (WATCH)
    await asyncio.wait_for(watch.next_message(), 30)
    for rank in (0, 1):
        s = await mstats(h1, "kvs", rank)
        assert sum(s["counts"].values()) > 0 and s["events"]["received"] > 0, s
    before = await mstats(h1, "kvs-watch", 1)
    assert before["counts"]["watchers-created"] == 1 and before["watchers"] == 1, before

    rc, out, err = await run_cli("stats", "--clear", "kvs", uri=inst.uri(1))
    assert (rc, out, err) == (0, "", "")
    cleared = await mstats(h1, "kvs", 1)
    assert set(cleared["counts"]) == set(s["counts"]) and not any(cleared["counts"].values())
    assert cleared["events"]["received"] == cleared["events"]["handled"] == 0
    assert cleared["events"]["subscribe_calls"] == s["events"]["subscribe_calls"] > 0
    assert sum((await mstats(h1, "kvs", 0))["counts"].values()) > 0  # (rank 1's only)

    rc, out, err = await run_cli("stats", "-C", "kvs-watch", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", "")
    for rank in (0, 1):
        after = await mstats(h1, "kvs-watch", rank)
        assert not any(after["counts"].values()), after
    assert (await mstats(h1, "kvs-watch", 1))["watchers"] == 1  # (what is now: kept)
    rc, out, err = await run_cli("stats", "-c", "broker", uri=inst.uri(1))
    assert rc == 0
    messages = (await mstats(h1, "broker", 1))["messages"]
    assert messages["requests"] <= 2, messages  # (the stats-get, and the clear's answer)

    rc, _, err = await run_cli("stats", "--clear-all", "-r", "1", "kvs", uri=inst.uri(0))
    assert rc == 2 and "--clear-all clears every rank" in err
    rc, _, err = await run_cli("stats", "--clear", "-p", "counts", "kvs", uri=inst.uri(0))
    assert rc == 2 and "print nothing" in err


async def test_stats_rusage_is_the_ranks_process(start_instance) -> None:
    """``stats -R`` (Flux's ``module stats --rusage[=WHO]``): getrusage(2) of
    the rank's process, readable with ``--parse``; a WHO it does not know is
    a usage error."""
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("stats", "--rusage", "kvs", uri=inst.uri(0))
    assert (rc, err) == (0, ""), err
    ru = json.loads(out)
    # (a rank forked from the spawner may have used under a clock tick of
    # its own CPU: utime can be 0.0; its memory cannot)
    assert ru["maxrss"] > 1000 and ru["minflt"] > 0, ru
    assert isinstance(ru["utime"], float) and {"stime", "nvcsw", "oublock"} <= set(ru)
    for spelled in ("-Rself", "--rusage=children", "--rusage=thread"):
        rc, out, err = await run_cli("stats", spelled, "content", uri=inst.uri(0))
        assert (rc, err) == (0, "") and "utime" in json.loads(out), (spelled, err)
    rc, out, err = await run_cli("stats", "-R", "kvs", "-p", "maxrss", "--type", "double",
                                 uri=inst.uri(0))
    assert rc == 0 and float(out) > 1000 and out.strip().endswith(".000000"), (out, err)
    rc, _, err = await run_cli("stats", "--rusage=badopt", "kvs", uri=inst.uri(0))
    assert rc == 2 and "badopt" in err
