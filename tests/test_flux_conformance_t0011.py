# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t0011-content-cache.t: the content service's cache, on every
rank of a 4-rank instance (Flux sizes it ``cores + 1``, at least 4; here 4,
fanout 2, so rank 3 is a leaf under rank 1 and rank 2 a leaf of its own).

Flux runs the content module without a backing store (``minimal``), which
kvbroker cannot do: rank 0's content module always keeps its blobs in SQLite
(docs/protocol.md, Content store; a file in the run directory without a
statedir).  Flux's cases, in order, and what each becomes:

1.  load content with ``blob-size-limit=1048576`` -> ``-S
    content.blob-size-limit=1048576`` at start, read back on rank 3.
2.  content flush fails ``ENOSYS`` with no backing store -> a documented
    difference: there is always a backing store, so ``kvbroker content
    flush`` succeeds (and leaves nothing dirty, case 22).
3.-4. ``module stats content`` on the leader and a follower -> ``kvbroker
    stats content`` attached to rank 0 and to rank 1.
5.-9. ``content.register-backing`` / ``unregister-backing`` (a backing
    module announcing itself, once, never changed) -> not applicable: the
    store is the content module's own, there is no such service; the
    requests are ``Function not implemented`` naming the topic.
10. store 100 blobs, the count is at least 100 -> the same, the count read
    with ``stats content --type int --parse count``.
11. store blobs of 0, 64, 4 KiB and 1 MiB on rank 0 -> tests/
    test_flux_conformance_t0012.py (the same sizes, loaded on every rank).
12. a blob over the limit cannot be stored -> 1 MiB + 4 KiB refused with
    ``File too large``, naming the limit; exactly 1 MiB is stored (the 1m
    blob of 11 and 16 is the limit itself), from rank 0 and from rank 3.
13.-16. load and verify each blob on all ranks (``flux exec``, the blob's
    hash recomputed) -> t0012 for blobs stored on rank 0.
17.-20. store 64 B, 4 KiB, 1 MiB on rank 3, verify on all ranks -> the
    same with ``kvbroker exec -r 3`` (the blob on exec's stdin) and
    ``kvbroker exec -r all -l ... | sha256sum``; the empty blob too.
21. negative entries are not cached -> a load of an unknown blob fails on
    every rank at once; stored on rank 0 it then loads on every rank.
22. the same blob stored on every rank, loaded from rank 0 -> the four
    stores print one blobref and rank 0 caches one more blob ("whether
    stores were squashed", which Flux left "to fill in later").
23. rank 0's cache is all dirty (no backing store) -> true here too
    without a statedir (rank 0 writes back only to make room, past
    ``content.cache-bytes``): ``dirty`` equals ``count``; a flush then
    writes them all (``dirty`` 0, ``backing-count`` the count).  With a
    statedir they are written back within 100 ms without a flush.
24. rank 0's cache is all valid -> not applicable: kvbroker's cache holds
    only blobs it has (a load in flight is not an entry), there is no
    ``valid`` count.
25. store 8K blobs from rank 0, 1024 requests outstanding (content-spam)
    -> the same from a Handle on rank 0, each answer the blob's hash.
26. store 1K blobs from every rank at once, 256 outstanding -> the same,
    rank 0 then counting exactly the 8192 + 4096 distinct blobs, and a blob
    stored through rank 2 loads on rank 3 (the other branch).
27. content.load with an empty payload is ``EPROTO`` ->
    tests/test_content_rpc.py::test_bad_payloads_are_eproto (no payload,
    ``{}``, a payload that is not a map); ``kvbroker rpc content.load``
    without a payload here too.
28. register-backing with an empty payload is ``EPROTO`` -> not
    applicable (no such service, as 5-9).
29.-32. ``content store --chunksize`` splits a blob; loading the refs
    joins them -> a documented difference (docs/cli.md, content: "without
    ... ``store --chunksize``"): the option is a usage error, exit 2, not
    ignored.  Loading several blobrefs, from the command line or stdin, in
    order: t0012.
33. content load with no blobrefs fails -> t0012 (a usage error).
34. remove the content module -> not applicable (modules are fixed at
    start).
35. the module fails to load with an unknown option -> ``-S
    content.badopt=1`` stops the start (exit 2, naming it); so do the
    values of ``content.blob-size-limit`` that are not a size it takes.

Beyond the script: Flux's cache purges to its target, and so does
kvbroker's -- rank 0 without a statedir included, which kept every blob it
read back from its file past ``content.cache-bytes`` (4 times it in the
test, for good) while a blob it had yet to write was the oldest entry:
eviction stopped at that blob and a load never started the write-back that
would let it go (fixed 2026-12-05: the newest clean blobs go instead, and
the load starts that write).  Followers, and rank 0 with a statedir
(written within 100 ms, then trimmed), kept to the bound.  And beside case
27: a ``content.store`` giving both ``data`` and ``blobs`` (kvbroker's two
forms) is ``EPROTO``, nothing stored, as is a ``content.load`` with
``blobref`` and ``blobrefs`` (fixed 2026-12-05: the store kept ``data``
alone and answered success, the blobs dropped; the load answered the
first alone).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os

import pytest
from test_broker_support import wait_until
from test_kvs_cli import KVB, Result, client_env, expect, run, sh
from test_kvs_rpc_helpers import errnum

T = 30
MAXBLOB = 1048576
LIMIT = {"content.blob-size-limit": str(MAXBLOB)}


def sha256(data: bytes) -> str:
    return "sha256-" + hashlib.sha256(data).hexdigest()


async def content_stats(h) -> dict:
    return await asyncio.wait_for(h.rpc("content.stats-get", {}), T)


async def kvb(inst, *args: str, rank: int = 0, stdin: bytes = b"") -> Result:
    """One ``kvbroker ARGS`` attached to ``rank``."""
    return await run([KVB, *args], client_env(inst.uri(rank)), stdin)


async def test_t0011_flush_stats_and_no_backing_registration(start_instance) -> None:
    """Cases 1-9, 12, 27-28, 29: the limit on every rank, a flush that
    succeeds (Flux: ENOSYS), the stats on leader and follower, no backing
    registration service, no ``--chunksize``."""
    inst = await start_instance(size=4, fanout=2, attrs=LIMIT)
    out = await sh(inst, f"""
        t on 3 kvbroker attr get content.blob-size-limit
        t kvbroker content flush
        t kvbroker stats content -p hash
        t on 1 kvbroker stats content -p hash
        t kvbroker rpc content.register-backing '{{"name": "foo"}}'
        t kvbroker rpc content.unregister-backing '{{"name": "foo"}}'
        t kvbroker rpc content.load
        head -c {MAXBLOB} /dev/zero >max
        head -c {MAXBLOB + 4096} /dev/zero >toobig
        t sh -c 'kvbroker content store <max'
        t sh -c 'kvbroker content store <toobig'
        t sh -c 'KVBROKER_URI=$U3 kvbroker content store <toobig'
        t sh -c 'echo 0123456789 | kvbroker content store --chunksize=8'
        """)
    assert out == expect("""
        $ on 3 kvbroker attr get content.blob-size-limit
        1048576
        $ kvbroker content flush
        $ kvbroker stats content -p hash
        "sha256"
        $ on 1 kvbroker stats content -p hash
        "sha256"
        $ kvbroker rpc content.register-backing {"name": "foo"}
        kvbroker: content.register-backing: Function not implemented (...)
        [rc=1]
        $ kvbroker rpc content.unregister-backing {"name": "foo"}
        kvbroker: content.unregister-backing: Function not implemented (...)
        [rc=1]
        $ kvbroker rpc content.load
        kvbroker: content.load: Protocol error (...)
        [rc=1]
        $ sh -c kvbroker content store <max
        REF
        $ sh -c kvbroker content store <toobig
        kvbroker: content store: File too large (...)
        [rc=1]
        $ sh -c KVBROKER_URI=$U3 kvbroker content store <toobig
        kvbroker: content store: File too large (...)
        [rc=1]
        $ sh -c echo 0123456789 | kvbroker content store --chunksize=8
        usage: kvbroker content store [-h]
        kvbroker content store: error: unrecognized arguments: --chunksize=8
        [rc=2]
        """)


async def test_t0011_blobs_stored_on_rank_3_load_on_every_rank(start_instance) -> None:
    """Cases 17-20 (and 12 at rank 3): each blob stored through rank 3 comes
    back whole on every rank, its blobref the hash of its bytes."""
    inst = await start_instance(size=4, fanout=2, attrs=LIMIT)
    blobs = [b"", os.urandom(64), os.urandom(4096), os.urandom(256 * 4096)]
    for data in blobs:
        res = await kvb(inst, "exec", "-r", "3", "--", KVB, "content", "store", stdin=data)
        assert (res.rc, res.text, res.err) == (0, sha256(data) + "\n", "")
    for data in blobs:
        res = await kvb(inst, "exec", "-r", "all", "-n", "-l", "--", "sh", "-c",
                        f"{KVB} content load {sha256(data)} | sha256sum")
        assert (res.rc, res.err) == (0, ""), res.err
        digest = hashlib.sha256(data).hexdigest()
        assert sorted(res.text.splitlines()) == [f"{r}: {digest}  -" for r in range(4)]
    # one byte over, through rank 3: refused, the message naming the limit
    res = await kvb(inst, "content", "store", rank=3, stdin=bytes(MAXBLOB + 1))
    assert (res.rc, res.out) == (1, b"")
    assert res.err == ("kvbroker: content store: File too large (blob of "
                       f"{MAXBLOB + 1} bytes exceeds content.blob-size-limit ({MAXBLOB}))\n")


async def test_t0011_negative_entries_are_not_cached(start_instance, connect) -> None:
    """Case 21: an unknown blob fails to load on every rank at once (the
    leaves' loads pass through ranks 1 and 0); once stored on rank 0 every
    rank loads it."""
    inst = await start_instance(size=4, fanout=2)
    hs = [await connect(inst, r) for r in range(4)]
    value = b"sdflskdjflsdkjfsdjf\n"
    ref = sha256(value)
    fails = await asyncio.gather(*(errnum(h.rpc("content.load", {"blobref": ref}), T)
                                   for h in reversed(hs)))
    assert fails == [errno.ENOENT] * 4
    res = await kvb(inst, "content", "store", stdin=value)
    assert (res.rc, res.text) == (0, ref + "\n"), res.err
    got = await asyncio.gather(*(asyncio.wait_for(h.rpc("content.load", {"blobref": ref}), T)
                                 for h in reversed(hs)))
    assert [g["data"] for g in got] == [value] * 4


async def test_t0011_same_blob_stored_on_every_rank_is_one_blob(start_instance,
                                                                connect) -> None:
    """Case 22: ``echo foof | content store`` on every rank at once prints
    one blobref four times; rank 0 caches one blob more, and loads it."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    before = (await content_stats(h0))["count"]
    # (-l: four Pythons sharing exec's stdout may write a line and its
    # newline apart; labelled, each rank's line is whole)
    res = await kvb(inst, "exec", "-r", "all", "-n", "-l", "--", "sh", "-c",
                    f"echo foof | {KVB} content store")
    assert (res.rc, res.err) == (0, "")
    ref = sha256(b"foof\n")
    assert sorted(res.text.splitlines()) == [f"{r}: {ref}" for r in range(4)]
    assert (await content_stats(h0))["count"] == before + 1
    res = await kvb(inst, "content", "load", ref)
    assert (res.rc, res.out) == (0, b"foof\n"), res.err


async def test_t0011_rank_0_cache_is_all_dirty_until_written(start_instance, connect,
                                                             tmp_path) -> None:
    """Cases 10, 23: 100 blobs stored; without a statedir rank 0 writes
    none of them back on its own (all its cache is dirty) until a flush
    writes them all; with a statedir they go within 100 ms."""
    inst = await start_instance(size=2, fanout=2)
    h0 = await connect(inst, 0)
    for i in range(100):
        data = b"test%d\n" % i
        got = await asyncio.wait_for(h0.rpc("content.store", {"data": data}), T)
        assert got == {"blobref": sha256(data)}
    res = await kvb(inst, "stats", "content", "--type", "int", "--parse", "count")
    assert res.rc == 0 and int(res.text) >= 100, (res.text, res.err)
    st = await content_stats(h0)
    assert st["count"] == int(res.text) and st["dirty"] == st["count"], st
    res = await kvb(inst, "content", "flush", rank=1)
    assert (res.rc, res.out, res.err) == (0, b"", "")
    st = await content_stats(h0)
    assert (st["dirty"], st["backing-count"]) == (0, st["count"]), st

    inst = await start_instance(size=1, statedir=str(tmp_path / "state"))
    h = await connect(inst, 0)
    for i in range(100):
        await asyncio.wait_for(h.rpc("content.store", {"data": b"test%d\n" % i}), T)

    async def written() -> bool:
        st = await content_stats(h)
        return st["dirty"] == 0 and st["backing-count"] == st["count"] >= 100

    await wait_until(written, "rank 0 to write its blobs back", timeout=T)


def spam(rank: int, i: int) -> bytes:
    """content-spam's blob: 256 bytes naming its sender and sequence."""
    return f"spam-o-matic rank={rank} seq={i}".encode().ljust(256, b"\0")


async def store_window(h, rank: int, count: int, inflight: int) -> list[str]:
    """Store ``count`` spam blobs through ``h``, ``inflight`` at a time;
    return their blobrefs, in order."""
    refs: list[str] = [""] * count
    window = asyncio.Semaphore(inflight)

    async def one(i: int) -> None:
        try:
            got = await asyncio.wait_for(h.rpc("content.store", {"data": spam(rank, i)}), T)
            refs[i] = got["blobref"]
        finally:
            window.release()

    tasks = []
    for i in range(count):
        await window.acquire()
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    return refs


async def test_t0011_many_stores_outstanding_from_every_rank(start_instance, connect) -> None:
    """Cases 25-26: 8192 stores from rank 0 with 1024 outstanding, then
    1024 from each rank at once with 256 outstanding: every answer is the
    blob's hash, rank 0 counts each blob once, and a blob stored through
    one branch loads on the other."""
    inst = await start_instance(size=4, fanout=2)
    hs = [await connect(inst, r) for r in range(4)]
    before = (await content_stats(hs[0]))["count"]
    refs = await store_window(hs[0], 0, 8192, 1024)
    assert refs == [sha256(spam(0, i)) for i in range(8192)]
    # (rank 0's blobs again, sent from rank 0: the same blobrefs, no new blob)
    per_rank = await asyncio.gather(*(store_window(h, r if r else 9, 1024, 256)
                                      for r, h in enumerate(hs)))
    for r, got in enumerate(per_rank):
        assert got == [sha256(spam(r if r else 9, i)) for i in range(1024)], r
    assert (await content_stats(hs[0]))["count"] == before + 8192 + 4 * 1024
    for i in (0, 511, 1023):
        got = await asyncio.wait_for(hs[3].rpc("content.load", {"blobref": per_rank[2][i]}), T)
        assert got["data"] == spam(2, i)


@pytest.mark.parametrize(("attr", "value", "why"), [
    ("content.badopt", "1", "content.badopt: unknown attribute"),
    ("content.blob-size-limit", "1k", "content.blob-size-limit: '1k' is not an integer"),
    ("content.blob-size-limit", "-1", "content.blob-size-limit: -1 is below the minimum of 256"),
    ("content.blob-size-limit", "999999001",
     "content.blob-size-limit: 999999001 is above the maximum of 999999000"),
])
async def test_t0011_an_unknown_or_bad_content_option_stops_the_start(attr, value, why) -> None:
    """Case 35: Flux's module refuses an unknown option; here the attribute
    (or a value the content module cannot take) stops the start before any
    rank runs."""
    res = await run([KVB, "start", "-S", f"{attr}={value}", "--", "echo", "ran"],
                    client_env("local:///nonexistent"), timeout=T)
    assert (res.rc, res.text) == (2, ""), res.err
    assert res.err.startswith(f"kvbroker: start: {why}"), res.err


async def test_t0011_rank_0_reads_stay_within_its_cache_bound(start_instance, connect) -> None:
    """Beyond Flux's script (its cache has a purge target too): rank 0's
    cache keeps to ``content.cache-bytes`` when it reads back blobs it
    wrote to its file -- only the blobs it has yet to write may keep it
    over (docs/protocol.md: it writes the oldest to make room).  It kept
    them all: 4 times the limit, ``dirty`` 510 (a load started no write)."""
    limit = 256 * 1024
    inst = await start_instance(size=2, fanout=2, attrs={"content.cache-bytes": str(limit)})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    refs = await store_window(h1, 1, 2048, 256)  # 2048 x 512 bytes: 4 times the limit
    for i in range(0, 2048, 256):  # every blob read back on rank 0
        got = await asyncio.gather(*(asyncio.wait_for(
            h0.rpc("content.load", {"blobref": ref}), T) for ref in refs[i:i + 256]))
        assert [g["data"] for g in got] == [spam(1, j) for j in range(i, i + 256)]
    st1 = await content_stats(h1)
    assert st1["cache-bytes"] <= limit, st1  # (a follower keeps to it)
    st = await content_stats(h0)
    clean = st["cache-bytes"] - st["dirty"] * 512
    assert clean <= limit, {k: st[k] for k in ("count", "cache-bytes", "dirty", "written")}


@pytest.mark.parametrize("rank", [0, 1])
async def test_t0011_a_store_or_load_of_both_forms_at_once_is_eproto(start_instance, connect,
                                                                     rank) -> None:
    """Beyond case 27 (kvbroker's batch forms): a request that gives both
    the single and the batch form is malformed -- ``EPROTO``, as one
    missing both -- not half served."""
    inst = await start_instance(size=2, fanout=2)
    h = await connect(inst, rank)
    n = await errnum(h.rpc("content.store", {"data": b"one", "blobs": [b"two"]}), T)
    assert n == errno.EPROTO
    assert await errnum(h.rpc("content.load", {"blobref": sha256(b"two")}), T) == errno.ENOENT
    n = await errnum(h.rpc("content.load", {"blobref": sha256(b"one"),
                                            "blobrefs": [sha256(b"one")]}), T)
    assert n == errno.EPROTO
