"""What a module had parked survives ``module reload`` (broker/reloadhold.py,
``Module.parked``; docs/cli.md "module", docs/protocol.md ``module.reload``):
a ``kvs.wait-version`` waiting on rank 0 or on rank 3, a kvs-watch lookup
that has answered nothing yet, go to the new module -- at the front of the
reload's hold, in the order they came -- and are answered by it; a reload
that fails answers them as the requests it held; ``module remove`` still
answers them ``ENOSYS`` at once; a guest's version waits count again
toward ``kvs.max-waits-per-guest`` in the new module.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import GUEST_UID, GuestProc, run_cli, stats, use_module_plugin, wait_until
from test_flux_conformance_t0003 import TESTMOD
from test_watch_helpers import WAITCREATE, WATCH, commit, ns_create, put, value, watch_stream

from broker.errors import RemoteError
from broker.handle import Handle
from broker.message import Message, MsgType
from broker.reloadhold import ReloadHold

T = 20.0

PARKING = '''

class ParkingTestMod(TestMod):
    """testmod, which also parks ``testmod.park {i}`` until ``testmod.release``
    and hands the parked ones over on a reload (``repeatable``)."""
    repeatable = frozenset({"testmod.park"})

    def __init__(self, ctx):
        super().__init__(ctx)
        self.came = []
        self.go = asyncio.Event()

    def handlers(self):
        return {**super().handlers(), "testmod.park": self.park,
                "testmod.parked": self.parked_list, "testmod.release": self.release}

    async def park(self, msg):
        self.came.append(msg.payload["i"])
        await self.go.wait()
        self.h.respond(msg, {"i": msg.payload["i"], "by": id(self)})

    def parked_list(self, msg):
        self.h.respond(msg, {"came": self.came, "by": id(self)})

    def release(self, msg):
        self.go.set()
        self.h.respond(msg, {})
'''


@pytest.fixture
def parking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_module_plugin(tmp_path, monkeypatch, "testmod", "ParkingTestMod", TESTMOD + PARKING)
    monkeypatch.delenv("TESTMOD_MODE", raising=False)


async def cli(uri: str, *args: str) -> str:
    rc, out, err = await run_cli(*args, uri=uri)
    assert (rc, err) == (0, ""), (args, rc, out, err)
    return out


def wait_version(h: Handle, rootseq: int, ns: str = "primary") -> asyncio.Future[Any]:
    return h.rpc("kvs.wait-version", {"namespace": ns, "rootseq": rootseq})


async def waiters(h: Handle, rank: int, n: int, ns: str = "primary") -> None:
    """Until rank ``rank``'s kvs has ``n`` version waits parked on ``ns``."""

    async def parked() -> bool:
        st = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=rank), T)
        return bool(st["namespaces"].get(ns, {}).get("waiters") == n)

    await wait_until(parked, f"{n} version waits parked on rank {rank}", T)


async def reload_counts(h: Handle, rank: int) -> tuple[int, int, int]:
    counts = (await stats(h, rank))["messages"]
    return counts["reload-held"], counts["reload-released"], counts["reload-refused"]


async def test_a_version_wait_outlives_a_reload_of_kvs_on_rank_0_and_3(
        start_instance, connect) -> None:
    """A client on rank 0 and one on rank 3 (whose waits rank 3's own kvs
    serves) wait for the next version; kvs is reloaded on rank 0, then on
    rank 3: each wait is handed to the new module there (counted held and
    released), and answered when the commit comes."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    seq = (await commit(h0, put("a", "1")))["rootseq"]
    w0, w3 = wait_version(h0, seq + 1), wait_version(h3, seq + 1)
    await waiters(h0, 0, 1)
    await waiters(h0, 3, 1)

    await cli(inst.uri(0), "module", "reload", "kvs")
    await waiters(h0, 0, 1)  # (now in the new module of rank 0)
    assert not w0.done()
    assert await reload_counts(h0, 0) == (1, 1, 0)
    await cli(inst.uri(0), "module", "reload", "-r", "3", "kvs")
    await waiters(h0, 3, 1)
    assert not w3.done()
    assert await reload_counts(h0, 3) == (1, 1, 0)

    await commit(h0, put("a", "2"))
    for w in (w0, w3):
        assert (await asyncio.wait_for(w, T))["rootseq"] == seq + 1


async def test_module_remove_still_ends_a_version_wait(start_instance, connect) -> None:
    """``module remove kvs`` is no reload: a parked version wait is answered
    ``ENOSYS`` at once, saying the module was removed (as Flux's)."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    seq = (await commit(h, put("a", "1")))["rootseq"]
    w = wait_version(h, seq + 1)
    await waiters(h, 0, 1)
    await cli(inst.uri(0), "module", "remove", "kvs-watch")
    await cli(inst.uri(0), "module", "remove", "kvs")
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(w, T)
    assert (info.value.errnum, info.value.errstr) == (
        errno.ENOSYS, "module kvs was removed (module remove)")
    assert await reload_counts(h, 0) == (0, 0, 0)


async def _parked_then_held(h: Handle, uri: str, new_mode: str) -> tuple[
        asyncio.Future[Any], list[asyncio.Future[Any]]]:
    """testmod (its stop hangs) parks ``i`` 0 and 1; a reload to
    ``new_mode`` starts, and holds them; ``i`` 2 comes during the reload;
    the old module's stop is cancelled.  The reload, and the three."""
    await cli(uri, "module", "load", "testmod", "testmod.mode=stop-hang")
    parked = [h.rpc("testmod.park", {"i": i}) for i in (0, 1)]

    async def both_came() -> bool:
        return bool((await h.rpc("testmod.parked", {}))["came"] == [0, 1])

    await wait_until(both_came, "testmod to park two requests", T)
    reload = h.rpc("module.reload", {"name": "testmod", "args": [f"testmod.mode={new_mode}"]})

    async def holding(n: int) -> bool:
        return bool((await stats(h, 0))["held-for-reload"].get("testmod") == n)

    await wait_until(lambda: holding(2), "the parked two to be held", T)
    late = h.rpc("testmod.park", {"i": 2})
    await wait_until(lambda: holding(3), "the third to be held after them", T)
    assert not any(fut.done() for fut in parked)
    await cli(uri, "module", "remove", "--cancel", "testmod")
    return reload, [*parked, late]


async def test_parked_requests_go_first_to_the_new_module_in_order(
        parking, start_instance, connect) -> None:
    """What the old module parked is held before what came during the
    reload, and the new module gets them in that order, each from its own
    client and matchtag: its answers reach the right callers."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    reload, requests = await _parked_then_held(h, inst.uri(0), "plain")
    await asyncio.wait_for(reload, T)
    new = await h.rpc("testmod.parked", {})
    assert new["came"] == [0, 1, 2]
    await h.rpc("testmod.release", {})
    for i, fut in enumerate(requests):
        assert await asyncio.wait_for(fut, T) == {"i": i, "by": new["by"]}
    assert await reload_counts(h, 0) == (3, 3, 0)


async def test_a_failed_reload_answers_the_parked_as_the_held(
        parking, start_instance, connect) -> None:
    """The new module fails as it starts, leaving none: what the old one
    parked is answered as what came during the reload, ``ENOSYS`` saying
    the reload failed and why."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    reload, requests = await _parked_then_held(h, inst.uri(0), "init-failure")
    with pytest.raises(RemoteError):
        await asyncio.wait_for(reload, T)
    for fut in requests:
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(fut, T)
        assert (info.value.errnum, info.value.errstr) == (
            errno.ENOSYS, "module testmod failed to reload on rank 0: "
                          "RuntimeError: testmod: init failure asked for")
    assert await reload_counts(h, 0) == (3, 0, 3)


async def test_kvs_watch_hands_over_what_has_answered_nothing(start_instance,
                                                              connect) -> None:
    """A WAITCREATE lookup (one answer) and a WAITCREATE watch, both waiting
    for keys not there yet, and a WAITCREATE lookup waiting for its
    namespace to be created, go to the new kvs-watch and are answered when
    the keys come; a watch that has answered its first value ends, saying
    kvs-watch was reloaded (the new module would answer it again)."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    await commit(h, put("seen", "1"))
    once = h.rpc("kvs-watch.lookup", {"namespace": "primary", "key": "later.once",
                                      "flags": WAITCREATE})
    stream = watch_stream(h, "later.watched", WATCH | WAITCREATE)
    in_ns = h.rpc("kvs-watch.lookup", {"namespace": "later", "key": "k", "flags": WAITCREATE})
    answered = watch_stream(h, "seen")
    assert await value(answered) == b"1"

    async def watchers(n: int) -> bool:
        st = await asyncio.wait_for(h.rpc("kvs-watch.stats-get", {}), T)
        return bool(st["watchers"] == n)

    await wait_until(lambda: watchers(4), "four watchers", T)
    await cli(inst.uri(0), "module", "reload", "kvs-watch")
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(answered.next_message(), T)
    assert (info.value.errnum, info.value.errstr) == (
        errno.ENOSYS, "the watch ended: module kvs-watch was reloaded on rank 0 (module reload)")
    await wait_until(lambda: watchers(3), "the three in the new kvs-watch", T)
    assert await reload_counts(h, 0) == (3, 3, 0)
    await commit(h, put("later.once", "x"), put("later.watched", "y"))
    assert (await asyncio.wait_for(once, T))["val"]["data"] == b"x"
    assert await value(stream) == b"y"
    await ns_create(h, "later")
    await commit(h, put("k", "z"), ns="later")
    assert (await asyncio.wait_for(in_ns, T))["val"]["data"] == b"z"


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as another uid")
async def test_a_guests_handed_over_waits_count_in_the_new_kvs(start_instance,
                                                                connect) -> None:
    """A guest's two version waits go to a kvs reloaded with
    ``kvs.max-waits-per-guest=1``: the first waits there, the second (the
    newer) is refused ``ENOSPC`` as it would be now, and so is a third."""
    inst = await start_instance(size=1, attrs={"access.allow-guest-user": "true",
                                               "kvs.max-waits-per-guest": "2"})
    h = await connect(inst, 0)
    await ns_create(h, "gv", owner=GUEST_UID)
    seq = (await h.rpc("kvs.getroot", {"namespace": "gv"}))["rootseq"]
    guest = await GuestProc.start(inst.uri(0), f"""
        async def main():
            h = await Handle.connect(uri)
            def wait():
                return h.rpc("kvs.wait-version", {{"namespace": "gv", "rootseq": {seq + 1}}})
            first, second = wait(), wait()
            await step()
            out(second=await outcome(second), third=await outcome(wait()))
            await step()
            out(first=await outcome(first))
    """)
    try:
        await waiters(h, 0, 2, "gv")
        await cli(inst.uri(0), "module", "reload", "kvs", "kvs.max-waits-per-guest=1")
        guest.go()
        line = await guest.line(T)
        for name in ("second", "third"):
            assert line[name][0] == errno.ENOSPC, line
            assert "this user has 1 version waits on rank 0 (kvs.max-waits-per-guest)" \
                in line[name][1], line
        await waiters(h, 0, 1, "gv")
        await commit(h, put("k", "1"), ns="gv")
        guest.go()
        assert (await guest.line(T))["first"] == "ok"
        await guest.finish()
    finally:
        guest.kill()


def _request(topic: str, route: list[str]) -> Message:
    return Message(MsgType.REQUEST, topic, {}, route=route)


def test_parked_requests_go_first_and_count_toward_the_bound() -> None:
    """Taken before what is held, oldest first; past the bound (held ones
    counted), the newest parked are given back, to be refused."""
    hold = ReloadHold("kvs", ("kvs",), 0, limit=3)
    held = _request("kvs.commit", ["c9"])
    assert hold.take(held)
    parked = [_request("kvs.wait-version", [f"c{i}"]) for i in range(3)]
    assert hold.take_first(parked) == parked[2:]
    assert hold.drain() == [parked[0], parked[1], held]
