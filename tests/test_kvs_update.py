"""``KVS.update``: read-modify-write retried on conflict (etcd's STM, Redis
``WATCH``/``MULTI``), against real instances.

Concurrent writers on rank 0 and on followers, as async tasks and as
blocking scripts in threads (each its own connection), lose no increment,
and each one's retries are bounded by what the others committed.  A
conflict made on purpose (the function commits another value first) shows
that a follower's retry reads the value that won, not the one it read
before."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest

from broker.errors import ErrnoError
from kvs.client import DELETE, KVS, UPDATE_RETRIES, SyncKVS, Updated

T = 60  # seconds: bound on every await against a broker


def _plus_one(old: bytes | None) -> int:
    return int(old or 0) + 1


async def _increments(kvs: KVS, times: int) -> list[int]:
    """Add 1 to ``counter`` ``times`` times; the tries each one took."""
    return [(await kvs.update("counter", _plus_one)).tries for _ in range(times)]


def _sync_increments(uri: str, times: int) -> list[int]:
    with SyncKVS(uri=uri, timeout=T) as kvs:
        return [kvs.update("counter", _plus_one).tries for _ in range(times)]


async def test_concurrent_updates_lose_no_increment(start_instance, connect) -> None:
    inst = await start_instance(size=4)
    ranks = (0, 1, 3, 3)  # async tasks, on rank 0 and on followers (two on one)
    clients = [KVS(await connect(inst, rank)) for rank in ranks]
    threads = (0, 2)  # blocking scripts, each on its own connection
    each = 15
    writers = len(ranks) + len(threads)
    async with asyncio.timeout(T * 2):
        tries = await asyncio.gather(
            *(_increments(kvs, each) for kvs in clients),
            *(asyncio.to_thread(_sync_increments, inst.uri(r), each) for r in threads))
        top = await clients[0].getroot()
        for kvs in clients:  # every rank converges on the one right total
            await kvs.wait_version(top.rootseq)
            assert await kvs.get_str("counter") == str(writers * each)
    flat = [n for one in tries for n in one]
    assert len(flat) == writers * each and min(flat) >= 1
    # A try fails only if another writer committed between its read and its
    # commit, and each commit can fail at most one try of each other writer:
    # so no more failed tries than (writers - 1) per increment.
    assert sum(flat) - len(flat) <= (writers - 1) * len(flat)
    assert max(flat) <= UPDATE_RETRIES + 1


@pytest.mark.parametrize("rank", [0, 1])
async def test_a_conflict_is_retried_with_the_value_that_won(start_instance, connect,
                                                             rank) -> None:
    """The function's first call commits another value from rank 0 before it
    returns: the update's commit must fail, and its second try must read
    that value -- on a follower too, whose reads are its own rank's."""
    inst = await start_instance(size=2)
    k0 = KVS(await connect(inst, 0))
    kvs = KVS(await connect(inst, rank))
    seen: list[bytes | None] = []

    async def fn(old: bytes | None) -> int:
        seen.append(old)
        if len(seen) == 1:
            await k0.put("n", 7)  # the other writer wins
        return int(old or 0) + 1

    async with asyncio.timeout(T):
        await k0.put("n", 1)
        await kvs.wait_version((await k0.getroot()).rootseq)
        up = await kvs.update("n", fn)
        assert seen == [b"1", b"7"]
        assert up.value == 8 and up.tries == 2 and up.result is not None
        await k0.wait_version(up.result.rootseq)
        assert await k0.get("n") == b"8"


async def test_retries_run_out_with_the_conflict(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    k0 = KVS(await connect(inst, 0))
    kvs = KVS(await connect(inst, 1))
    calls = 0

    async def always_beaten(old: bytes | None) -> int:
        nonlocal calls
        calls += 1
        await k0.put("n", 100 + calls)
        return 0

    async with asyncio.timeout(T):
        with pytest.raises(ErrnoError) as info:
            await kvs.update("n", always_beaten, retries=2)
        assert info.value.errnum == errno.ECANCELED
        assert calls == 3  # one try and two retries
        with pytest.raises(ErrnoError) as info:
            await kvs.update("n", always_beaten, retries=0)
        assert info.value.errnum == errno.ECANCELED and calls == 4


async def test_update_values_deletes_and_no_change(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    kvs = KVS(await connect(inst, 1))
    async with asyncio.timeout(T):
        # missing: fn gets None; None (or DELETE) leaves it missing, no commit
        v0 = await kvs.version()
        assert await kvs.update("m", lambda old: old) == Updated(None, None, 1)
        assert await kvs.update("m", lambda old: DELETE) == Updated(None, None, 1)
        assert await kvs.version() == v0 and not await kvs.exists("m")
        # created (JSON), then changed with decode="json"
        up = await kvs.update("m", lambda old: {"n": 1} if old is None else old)
        assert up.value == {"n": 1} and up.result is not None
        assert await kvs.get("m") == b'{"n":1}'
        up = await kvs.update("m", lambda c: {**c, "n": c["n"] + 1}, decode="json")
        assert await kvs.get_json("m") == {"n": 2} and up.result is not None
        # the same bytes again: nothing committed, the version stays
        v1 = await kvs.version()
        up = await kvs.update("m", lambda c: c, decode="json")
        assert up == Updated({"n": 2}, None, 1) and await kvs.version() == v1
        # str
        await kvs.put("s", "héllo")
        up = await kvs.update("s", lambda s: s.upper(), decode="str")
        assert up.value == "HÉLLO" and await kvs.get_str("s") == "HÉLLO"
        # DELETE removes it, on the condition it is unchanged
        up = await kvs.update("s", lambda s: DELETE)
        assert up.value is None and up.result is not None and not await kvs.exists("s")
        # not a value: a directory, a link
        await kvs.put("d.x", 1)
        with pytest.raises(ErrnoError) as info:
            await kvs.update("d", lambda old: 1)
        assert info.value.errnum == errno.EISDIR
        await kvs.symlink("link", "d.x")
        with pytest.raises(ErrnoError) as info:
            await kvs.update("link", lambda old: int(old) + 1)
        assert info.value.errnum == errno.EINVAL and await kvs.get("d.x") == b"1"
        # ...also where nothing would be committed: it answered the target's
        # value as the link's, or a dangling link's as missing
        for fn in (lambda old: old, lambda old: None):
            with pytest.raises(ErrnoError) as info:
                await kvs.update("link", fn)
            assert info.value.errnum == errno.EINVAL
        await kvs.symlink("dangling", "no.such.key")
        with pytest.raises(ErrnoError) as info:
            await kvs.update("dangling", lambda old: None)
        assert info.value.errnum == errno.EINVAL
        with pytest.raises(ValueError):
            await kvs.update("m", lambda old: old, decode="yaml")  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await kvs.update("m", lambda old: old, retries=-1)


async def test_sync_update(start_instance) -> None:
    inst = await start_instance(size=2)

    def script() -> list[Any]:
        with SyncKVS(uri=inst.uri(1), timeout=T) as kvs:
            first = kvs.update("c", lambda old: int(old or 0) + 5)
            second = kvs.update("c", lambda n: n * 2, decode="json")
            return [first.value, second.value, kvs.get("c"), second.tries]

    assert await asyncio.wait_for(asyncio.to_thread(script), T) == [5, 10, b"10", 1]


async def test_a_herd_of_updates_started_at_once_all_land(start_instance, connect) -> None:
    """Updates that read together conflict together: retried at once, they
    went in lock-step, one winning per round, so the last of W needed W
    tries and, past ``UPDATE_RETRIES + 1`` of them, gave up with
    ``ECANCELED``.  The random wait before a retry spreads them out."""
    inst = await start_instance(size=1)
    kvs = KVS(await connect(inst, 0))
    await kvs.put("counter", 0)
    writers = 2 * UPDATE_RETRIES
    async with asyncio.timeout(T):
        done = await asyncio.gather(*(kvs.update("counter", _plus_one)
                                      for _ in range(writers)), return_exceptions=True)
    failed = [r for r in done if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {writers} updates failed: {failed[0]!r}"
    assert await kvs.get_str("counter") == str(writers)
