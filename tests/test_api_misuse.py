"""API misuse is refused before anything is sent (docs/api.md "Errors"):
a wrong type is a TypeError, a value that cannot be one (a NaN or negative
timeout, an empty namespace, a group count no instance can reach) a
ValueError, and nothing is left pending.  Each of these went out before,
to come back EPROTO, to be carried out although the call raised, or to
wait for ever (a Python-API probe)."""

from __future__ import annotations

import asyncio
import errno
import math
from typing import Any

import pytest

from broker import sync
from broker.errors import RemoteError
from broker.groups_client import Groups
from broker.handle import Handle
from broker.rpc import check_timeout
from kvs.client import KVS
from kvs.treeobj import val
from kvs_watch.client import wait_event

T = 20
WITH_GROUPS = {"broker.modules": "content,kvs,kvs-watch,groups"}


@pytest.mark.parametrize("bad, error", [
    ("1", TypeError), (True, TypeError), ([1], TypeError),
    (math.nan, ValueError), (-1, ValueError), (math.inf, ValueError), (10**400, ValueError),
])
def test_check_timeout_refuses(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout"):
        check_timeout(bad)


def test_check_timeout_takes_seconds_and_none() -> None:
    assert [check_timeout(t) for t in (None, 0, 2, 0.5)] == [None, 0.0, 2.0, 0.5]


async def test_the_blocking_facade_refuses_a_bad_timeout_before_sending(
        start_instance) -> None:
    """``rpc(..., timeout="x")`` raised after its request had gone (the
    commit was made); ``run(coro, timeout=nan)`` left its task to run at
    the next call; ``connect(timeout=nan)`` warned "never awaited"."""
    inst = await start_instance(size=1)
    uri = inst.uri(0)

    def script() -> list[str]:
        seen = []
        with pytest.raises(ValueError, match="timeout"):
            sync.connect(uri, timeout=math.nan)
        with sync.connect(uri) as h:
            kvs = KVS(h.aio)
            commit = {"namespace": "primary", "flags": 0,
                      "ops": [{"key": "sent", "flags": 0, "dirent": val(b"1")}]}
            with pytest.raises(TypeError, match="timeout"):
                h.rpc("kvs.commit", commit, timeout="x")
            with pytest.raises(ValueError, match="timeout"):
                h.run(kvs.put("ran", 1), timeout=math.nan)
            with pytest.raises(ValueError, match="timeout"):
                h.recv_event(timeout=-1)
            with pytest.raises(ValueError, match="timeout"):
                h.rpc_stream("broker.ping", {}, timeout=math.nan)
            seen.append(str(h.run(kvs.exists("sent"))))
            seen.append(str(h.run(kvs.exists("ran"))))
            seen.append(str(h.aio.pending))
        return seen

    assert await asyncio.wait_for(asyncio.to_thread(script), T) == ["False", "False", "0"]


async def test_waits_refuse_a_timeout_that_is_no_time(start_instance, connect) -> None:
    """NaN gave up at once saying the rank "did not answer (stopped?)"; -1
    went to the rank and came back EPROTO."""
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    kvs = KVS(h)
    async with asyncio.timeout(T):
        for bad in (math.nan, -1):
            with pytest.raises(ValueError, match="timeout"):
                await kvs.wait_version(10**9, timeout=bad)
            with pytest.raises(ValueError, match="timeout"):
                await kvs.wait_create("never", timeout=bad)
            with pytest.raises(ValueError, match="timeout"):
                await wait_event(h, "log", "x", timeout=bad)
    assert h.pending == 0 and h.retired == 0


async def test_names_that_are_not_str_are_refused_before_sending(start_instance,
                                                                 connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    kvs = KVS(h)
    groups = Groups(h)
    calls: list[Any] = [
        lambda: h.subscribe([1]),  # (it went out, then failed "unhashable", left pending)
        lambda: h.subscribe(None), lambda: h.unsubscribe(None), lambda: h.publish(None),
        lambda: h.attr_get(None), lambda: h.attr_set("log.level", 7),
        lambda: h.log(None), lambda: kvs.namespace_create(None),
        lambda: kvs.namespace_remove(5), lambda: groups.join(None), lambda: groups.get(None),
    ]
    async with asyncio.timeout(T):
        for call in calls:
            with pytest.raises(TypeError):
                await call()
        with pytest.raises(TypeError):
            h.publish_nowait(None)  # (it went, and was dropped, unsaid)
        for empty in (kvs.namespace_create(""), kvs.namespace_remove("")):
            with pytest.raises(ValueError, match="must not be empty"):
                await empty  # (a removal of "" answered success)
        # a lone surrogate: "payload is not msgpack-able", of a good payload
        for bad in (lambda: h.publish("pl.\udcff", 1), lambda: h.subscribe("pl.\ud800"),
                    lambda: h.rpc("broker.\udcffping", {})):
            with pytest.raises(ValueError, match="is not UTF-8 text"):
                await bad()
    assert h.pending == 0


async def test_waiting_on_the_handle_from_another_loop_says_so(start_instance,
                                                               connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)

    def elsewhere() -> list[str]:
        errors = []
        for call in (h.drain, h.wait_closed):
            try:
                asyncio.run(asyncio.wait_for(call(), 5))
            except RuntimeError as exc:
                errors.append(str(exc))
        return errors

    errors = await asyncio.wait_for(asyncio.to_thread(elsewhere), T)
    assert len(errors) == 2 and all("was connected on another event loop" in e
                                    for e in errors), errors
    assert (await h.ping())["rank"] == 0


async def test_a_barrier_cut_short_leaves_and_counts_are_checked(start_instance,
                                                                 connect) -> None:
    """A barrier stopped by a timeout stayed a member (a retry: EEXIST); a
    count that is not an int from 0 to the size waited for ever."""
    inst = await start_instance(size=2, attrs=WITH_GROUPS)
    h = await connect(inst, 0)
    groups = Groups(h)
    async with asyncio.timeout(T):
        for _ in range(2):  # (the second would fail EEXIST)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5):
                    await groups.barrier("b", 2)
            assert await groups.get("b") == set()
        for bad, error in (("2", TypeError), (2.5, TypeError), (True, TypeError),
                           (-1, ValueError), (3, ValueError)):
            with pytest.raises(error, match="count"):
                await groups.wait_for("b", bad)
        # a membership the handle made before is not the barrier's to undo:
        # its join refused (EEXIST), or a bad count, leaves it a member
        await groups.join("mine")
        with pytest.raises(RemoteError) as exc:
            await groups.barrier("mine", 2)
        assert exc.value.errnum == errno.EEXIST
        with pytest.raises(TypeError):
            await groups.barrier("mine", "2")  # type: ignore[arg-type]
        assert await groups.get("mine") == {0}
    assert h.pending == 0


async def test_near_misses_are_named(start_instance, tmp_path) -> None:
    """Mistakes a newcomer makes (a newcomer probe): ``local:/path``, a
    slash short, was taken for a file named so (``FileNotFoundError:
    'local:/...'``); a run directory in place of a rank's socket was a bare
    ``ConnectionRefusedError``; a lease from ``kvs.lease()`` not awaited
    was "not <kvs.client.LeaseGrant object ...>"; an object() value was
    "cannot store a object value"."""
    inst = await start_instance(size=1)
    path = inst.uri(0)[len("local://"):]
    for uri, hint in ((f"local:{path}", "local:///path/to/socket"),
                      ("ssh:host/run/local-0", "ssh://host/path")):
        with pytest.raises(ValueError, match=f"^{uri}: not a URI: .*two slashes.*{hint}"):
            await Handle.connect(uri)
    with pytest.raises(ConnectionRefusedError, match="a directory, not a rank's socket"):
        await Handle.connect(str(tmp_path))
    async with KVS.connect(inst.uri(0)) as kvs:
        grant = kvs.lease(5)
        with pytest.raises(TypeError, match=r"not the LeaseGrant .* await it"):
            await kvs.put("k", 1, lease=grant)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="^cannot store an object value"):
            await kvs.put("k", object())
        assert not await kvs.exists("k")
