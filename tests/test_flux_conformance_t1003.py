"""flux-core t/t1003-kvs-stress.t: big trees, many committers, merging.

Flux's helper programs (``t/kvs/dtree``, ``commit``, ``torture``,
``transactionmerge``) are C clients of its API; here the same work is done
by our Python API and checked with the command line, as Flux checks it.
Flux's cases only require the helpers to succeed; these also read back
what was written.  ``kvs.transaction-merge=false`` is Flux's kvs module
option ``transaction-merge=0``.  Flux reloads the module with it
('transaction-merge disabling works'): so does
:func:`test_t1003_transaction_merge_disabled_by_a_module_reload`
(``kvbroker module reload kvs transaction-merge=false`` on rank 0 of a
running instance, then the same 64 committers, each commit seen and none
merged); :func:`test_t1003_transaction_merge_disabled` keeps the same case
with the instance started with the setting.
"""

from __future__ import annotations

import asyncio

from test_broker_support import run_cli
from test_kvs_cli import kvs

from broker.handle import Handle
from kvs.client import KVS, NO_MERGE, TxnOps
from kvs_watch.client import watch

T = 60
DIR = "test.a.b.c"


def dtree(ops: TxnOps, prefix: str, width: int, height: int) -> TxnOps:
    """Flux's ``dtree``: ``width`` entries named ``%.4x`` per level, ``height``
    levels, each leaf the integer 1."""
    for i in range(width):
        key = f"{prefix}.{i:04x}"
        if height == 1:
            ops.put(key, 1)
        else:
            dtree(ops, key, width, height - 1)
    return ops


async def dtree_mkdir(k: KVS, prefix: str, width: int, height: int) -> None:
    """``dtree --mkdir``: make each directory, then commit each leaf alone."""
    await k.mkdir(prefix)
    for i in range(width):
        key = f"{prefix}.{i:04x}"
        if height == 1:
            await k.put(key, 1)
        else:
            await dtree_mkdir(k, key, width, height - 1)


async def lines(inst, *args: str) -> list[str]:
    res = await kvs(inst, *args)
    assert res.rc == 0, res.err
    return res.text.splitlines()


async def test_t1003_directory_trees(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    k = KVS(await connect(inst, 0))

    # "store 16x3 directory tree" in one commit, and walk it
    await asyncio.wait_for(k.commit(dtree(TxnOps(), f"{DIR}.dtree", 16, 3)), T)
    walked = await lines(inst, "dir", "-R", f"{DIR}.dtree")
    assert len(walked) == 4096
    assert walked[0] == f"{DIR}.dtree.0000.0000.0000 = 1"

    # "unlink, walk 16x3 directory tree with dir --at"
    dirref = (await kvs(inst, "get", "--treeobj", f"{DIR}.dtree")).text.strip()
    assert (await kvs(inst, "unlink", "-Rf", f"{DIR}.dtree")).rc == 0
    assert (await kvs(inst, "dir", "-R", f"{DIR}.dtree")).rc != 0  # gone now
    assert len(await lines(inst, "dir", "-R", "--at", dirref, ".")) == 4096

    # "store 2x4 directory tree and walk"
    await k.commit(dtree(TxnOps(), f"{DIR}.dtree", 2, 4))
    assert len(await lines(inst, "dir", "-R", f"{DIR}.dtree")) == 16

    # "add other types to 2x4 directory and walk": a link to the directory
    # itself is listed, not followed (no endless walk)
    for args in (("link", f"{DIR}.dtree", f"{DIR}.dtree.link"),
                 ("put", f"{DIR}.dtree.double=3.14"), ("put", f"{DIR}.dtree.boolean=true")):
        assert (await kvs(inst, *args)).rc == 0
    walked = await lines(inst, "dir", "-R", f"{DIR}.dtree")
    assert len(walked) == 19
    assert f"{DIR}.dtree.link -> {DIR}.dtree" in walked

    # "store 3x4 directory tree using kvsdir functions": one commit per leaf
    assert (await kvs(inst, "unlink", "-Rf", f"{DIR}.dtree")).rc == 0
    await asyncio.wait_for(dtree_mkdir(k, f"{DIR}.dtree", 3, 4), T)
    assert len(await lines(inst, "dir", "-R", f"{DIR}.dtree")) == 81


async def committer(h: Handle, prefix: str, rank: int, n: int, count: int,
                    nomerge_every: int) -> None:
    """Flux's ``commit`` thread: ``count`` put+commits of ``PREFIX.RANK.N.I`` =
    42; with ``nomerge_every`` k, every k-th one is ``NO_MERGE``."""
    k = KVS(h)
    for i in range(count):
        flags = NO_MERGE if nomerge_every and i % nomerge_every == 0 else 0
        await k.commit(TxnOps().put(f"{prefix}.{rank}.{n}.{i}", 42), flags)


async def test_t1003_threads_on_every_rank_commit(start_instance, connect) -> None:
    """"8 threads/rank each doing 100 put,commits in a loop", then with no
    merging, then with every other commit unmerged: every key is there."""
    inst = await start_instance(size=4)
    handles = [await connect(inst, r) for r in range(4) for _ in range(8)]
    for variant, nomerge_every in (("merge", 0), ("nomerge", 1), ("mixed", 2)):
        prefix = f"t1003.{variant}"
        await asyncio.wait_for(asyncio.gather(*(
            committer(h, prefix, n // 8, n % 8, 100, nomerge_every)
            for n, h in enumerate(handles))), T)
        tree = await KVS(handles[0]).get_tree(prefix)
        assert len(tree) == 4 * 8 * 100
        assert set(tree.values()) == {b"42"}
        assert "3.7.99" in tree
    stats = await handles[0].rpc("kvs.stats-get", {})
    assert stats["rpcs-pending"] == 0  # "no pending requests at end of tests"


async def test_t1003_ten_thousand_keys_in_one_directory(start_instance, connect) -> None:
    """Flux's ``torture --count 10000``: one commit of 10,000 keys into one
    directory, each read back."""
    inst = await start_instance(size=1)
    k = KVS(await connect(inst, 0))
    prefix = f"{DIR}.bigdir"

    def fill(i: int) -> str:  # torture's fill(): the number, padded with x
        return f"{i}".ljust(19, "x")

    await k.unlink(prefix, recursive=True, force=True)
    ops = TxnOps()
    for i in range(10_000):
        ops.put(f"{prefix}.key{i}", fill(i))
    await asyncio.wait_for(k.commit(ops), T)
    for start in range(0, 10_000, 500):
        got = await asyncio.wait_for(asyncio.gather(
            *(k.get_str(f"{prefix}.key{i}") for i in range(start, start + 500))), T)
        assert got == [fill(i) for i in range(start, start + 500)]
    assert len(await k.dir(prefix)) == 10_000


async def merge_test(inst, connect, threads: int, flags: int) -> None:
    """Flux's ``transactionmerge``: a watcher of one key, then ``threads``
    handles commit a value to it at once; the watcher must see each (a
    merged batch would be one change, and the count would never be reached)."""
    key = "t1003.transactionmerge-key"
    h = await connect(inst, 0)
    await KVS(h).put(key, "init-val")
    before = (await h.rpc("kvs.stats-get", {}))["counts"]
    handles = [await connect(inst, 0) for _ in range(threads)]
    async with asyncio.timeout(T), watch(h, key) as w:
        assert (await anext(w)).value == b"init-val"  # registered: sees what follows
        commits = asyncio.gather(*(KVS(c).commit(TxnOps().put(key, n), flags)
                                   for n, c in enumerate(handles)))
        seen = set()
        async for entry in w:
            seen.add(int(entry.value))
            if len(seen) == threads:
                break
        await commits
    assert seen == set(range(threads))
    after = (await h.rpc("kvs.stats-get", {}))["counts"]
    assert after["batches"] - before["batches"] == threads
    assert after["merged"] == before["merged"]


async def test_t1003_no_merge_commits_are_each_seen(start_instance, connect) -> None:
    """"test that KVS_NO_MERGE works with kvs_commit()": 64 committers."""
    inst = await start_instance(size=1)
    await merge_test(inst, connect, 64, NO_MERGE)


async def test_t1003_transaction_merge_disabled(start_instance, connect) -> None:
    """"transaction-merge disabling works": the same without NO_MERGE."""
    inst = await start_instance(size=1, attrs={"kvs.transaction-merge": "false"})
    await merge_test(inst, connect, 64, 0)


async def test_t1003_transaction_merge_disabled_by_a_module_reload(start_instance,
                                                                   connect) -> None:
    """"transaction-merge disabling works" as Flux does it: the running
    instance's kvs is reloaded with ``transaction-merge=false`` (Flux's
    ``transaction-merge=0``), which it then reports; 64 committers at once
    are each seen, none merged."""
    inst = await start_instance(size=1)
    k = KVS(await connect(inst, 0))
    await k.put("t1003.before-reload", "kept")
    for args in (("module", "reload", "kvs", "transaction-merge=false"),
                 ("attr", "get", "kvs.transaction-merge")):
        rc, out, err = await run_cli(*args, uri=inst.uri(0), timeout=T)
        assert (rc, err) == (0, ""), (args, rc, out, err)
    assert out == "false\n"
    assert await k.get("t1003.before-reload") == b"kept"
    await merge_test(inst, connect, 64, 0)
