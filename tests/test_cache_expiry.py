"""Caches expire by age on real ranks (broker/agemarks.py): a follower that
read a burst of values gives its kvs and content caches back once they are
unused for ``kvs.cache-expire`` / ``content.cache-expire``, the content
cache down to ``content.cache-keep-bytes`` (Flux's purge-target-size), and
reads still answer after.  The attributes change on a running rank.
Reference: flux-core src/modules/kvs (cache_expire_entries, 10 s) and its
content cache (purge-old-entry, purge-target-size)."""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any

import pytest
from test_kvs_rpc_helpers import T, commit, lookup, put, stats

from broker.content.module import BLOB_OVERHEAD
from broker.errors import RemoteError

VALUES = 100
VALUE_BYTES = 10_000
KEEP = 300_000


async def _until(h: Any, service: str, done: Any, timeout: float = T) -> dict[str, Any]:
    """Poll ``service``'s stats on ``h``'s rank until ``done(stats)``."""
    async with asyncio.timeout(timeout):
        while True:
            st = await stats(h, service)
            if done(st):
                return st
            await asyncio.sleep(0.05)


async def test_an_idle_follower_gives_its_caches_back(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs={
        "kvs.cache-expire": "0.3s", "content.cache-expire": "0.3s",
        "content.cache-keep-bytes": str(KEEP)})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    values = {f"v.k{i}": os.urandom(VALUE_BYTES) for i in range(VALUES)}
    done = await commit(h0, *(put(k, v) for k, v in values.items()))
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                       "rootseq": done["rootseq"]}), T)
    for key, value in values.items():
        assert (await lookup(h1, key))["data"] == value
    # then nothing reads: both caches let go of what the reads brought in,
    # the content cache down to its floor (one blob under it at most)
    kvs1 = await _until(h1, "kvs", lambda st: st["cache"]["blobs-expired"] >= VALUES
                        and st["cache"]["blobs"] == 0)
    assert kvs1["cache"]["bytes"] == 0  # (the expiry's marks are not counted: it said 2048)
    content1 = await _until(h1, "content",
                            lambda st: st["expired"] > 0 and st["cache-bytes"] <= KEEP)
    assert content1["cache-bytes"] > KEEP - 2 * (VALUE_BYTES + BLOB_OVERHEAD)
    # the values read again are the same (from the content cache, or upstream)
    for key, value in values.items():
        assert (await lookup(h1, key))["data"] == value
    # the floor changes on the running rank: 0 keeps nothing unused
    await h1.attr_set("content.cache-keep-bytes", "0")
    content1 = await _until(h1, "content", lambda st: st["count"] == 0)
    assert content1["cache-bytes"] == 0


async def test_rank_0_expires_what_it_wrote_back_and_reads_it_again(start_instance, connect,
                                                                    tmp_path) -> None:
    """With a statedir, rank 0's blobs once written expire as a follower's
    do, and are read back from its store."""
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"), attrs={
        "content.cache-expire": "0.3s", "content.cache-keep-bytes": "0"})
    h0 = await connect(inst, 0)
    values = {f"v.k{i}": os.urandom(VALUE_BYTES) for i in range(20)}
    await commit(h0, *(put(k, v) for k, v in values.items()))
    st = await _until(h0, "content", lambda st: st["expired"] >= len(values))
    assert st["dirty"] == 0
    for key, value in values.items():  # read back from the store
        assert (await lookup(h0, key))["data"] == value


async def test_rank_0_never_expires_what_it_has_not_written(start_instance,
                                                            connect) -> None:
    """Without a statedir rank 0 writes its blobs only to make room: they
    stay waiting for their write (``dirty``), and expiry passes them by --
    evicted, the cache's own copies of the instance's only data went."""
    inst = await start_instance(size=1, attrs={
        "content.cache-expire": "0.3s", "content.cache-keep-bytes": "0",
        "kvs.cache-expire": "0.3s"})
    h0 = await connect(inst, 0)
    values = {f"v.k{i}": os.urandom(VALUE_BYTES) for i in range(20)}
    await commit(h0, *(put(k, v) for k, v in values.items()))
    await _until(h0, "kvs", lambda st: st["cache"]["blobs-expired"] >= len(values))
    # (the kvs module's expiry, on the same period, took them: content's has
    # run as long, give or take a period; one more value's life makes sure)
    await commit(h0, put("late", b"x" * VALUE_BYTES))
    expired = (await stats(h0, "kvs"))["cache"]["blobs-expired"]
    await _until(h0, "kvs", lambda st: st["cache"]["blobs-expired"] > expired)
    content = await stats(h0, "content")
    assert content["expired"] == 0 and content["dirty"] >= len(values), content
    for key, value in values.items():
        assert (await lookup(h0, key))["data"] == value


@pytest.mark.parametrize("name", ["kvs.cache-expire", "content.cache-expire"])
async def test_the_expiry_changes_on_a_running_rank(start_instance, connect, name) -> None:
    inst = await start_instance(size=2)
    h1 = await connect(inst, 1)
    assert await h1.attr_get(name) == "10s"
    await h1.attr_set(name, "0")  # never: the task stops
    assert await h1.attr_get(name) == "0"
    await h1.attr_set(name, "2m")
    with pytest.raises(RemoteError) as e:
        await h1.attr_set(name, "1ms")  # a wake-up every 125 us
    assert e.value.errnum == errno.EINVAL and "under 0.1s" in e.value.errstr
    assert await h1.attr_get(name) == "2m"


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


async def test_what_expires_goes_back_to_the_system(start_instance, connect) -> None:
    """The heap's pages of what expired are given back (``malloc_trim``, once
    16 MiB have gone): without it, a follower whose caches let go of 40 MB
    stayed as big as it was."""
    inst = await start_instance(size=2, attrs={  # (no expiry while it reads)
        "kvs.cache-expire": "0", "content.cache-expire": "0",
        "content.cache-keep-bytes": "0"})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    # (small values: freed, they are holes all through the heap, which glibc
    # does not give back by itself as it does a free top of the heap)
    keys = [f"m{c}.k{i}" for c in range(20) for i in range(500)]
    for c in range(20):
        done = await commit(h0, *(put(k, os.urandom(4000)) for k in keys[c * 500:][:500]))
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                       "rootseq": done["rootseq"]}), T)
    for c in range(0, len(keys), 500):
        await asyncio.gather(*(lookup(h1, k) for k in keys[c:c + 500]))
    pid = inst.pids()[1]
    full = _rss_mb(pid)
    for name in ("kvs.cache-expire", "content.cache-expire"):
        await h1.attr_set(name, "0.3s")
    await _until(h1, "content", lambda st: st["cache-bytes"] < VALUE_BYTES)
    async with asyncio.timeout(T):
        while _rss_mb(pid) > full - 25:  # (40 MB of values let go)
            await asyncio.sleep(0.05)
