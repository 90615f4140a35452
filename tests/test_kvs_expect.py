"""Conditional commits (``EXPECT`` ops): compare-and-swap across ranks.

Several clients on different ranks increment one counter with read,
``expect(old)``, ``put(old + 1)``, retrying on ``ECANCELED``: with merging
on, through relays, no increment may be lost and none applied twice.  And
a lock taken with ``expect_missing`` has one winner.  Reference: etcd's
``txn`` compare, Redis ``WATCH``/``MULTI`` (Flux has no such op)."""

from __future__ import annotations

import asyncio
import errno

from test_broker_support import run_cli

from broker.errors import ErrnoError
from kvs.client import KVS


async def _increment(kvs: KVS, times: int) -> int:
    """Add 1 to ``counter`` ``times`` times; returns how many tries failed."""
    failed = 0
    for _ in range(times):
        while True:
            old = await kvs.get_str("counter")
            t = kvs.txn()
            t.expect("counter", old).put("counter", str(int(old) + 1))
            try:
                await t.commit()
                break
            except ErrnoError as exc:
                assert exc.errnum == errno.ECANCELED, exc
                failed += 1
    return failed


async def test_concurrent_compare_and_swap_loses_no_increment(start_instance, connect):
    inst = await start_instance(size=4)
    clients = [KVS(await connect(inst, rank)) for rank in (0, 1, 2, 3, 0, 3)]
    await asyncio.wait_for(clients[0].put("counter", "0"), 10)
    failed = await asyncio.wait_for(
        asyncio.gather(*(_increment(kvs, 25) for kvs in clients)), 120)
    for kvs in clients:  # every rank converges on the one right total
        top = await asyncio.wait_for(clients[0].getroot(), 10)
        await asyncio.wait_for(kvs.wait_version(top.rootseq), 10)
        assert await asyncio.wait_for(kvs.get_str("counter"), 10) == str(25 * len(clients))
    assert sum(failed) > 0  # they did collide, and the losers retried


async def test_a_lock_has_one_winner(start_instance, connect):
    inst = await start_instance(size=4)
    clients = [KVS(await connect(inst, rank)) for rank in range(4)]

    async def grab(kvs: KVS, me: str) -> bool:
        t = kvs.txn()
        t.expect_missing("lock").put("lock", me)
        try:
            await t.commit()
            return True
        except ErrnoError as exc:
            assert exc.errnum == errno.ECANCELED
            assert exc.errstr == "lock: condition failed: it exists"
            return False

    won = await asyncio.wait_for(
        asyncio.gather(*(grab(kvs, f"r{i}") for i, kvs in enumerate(clients))), 30)
    assert won.count(True) == 1
    assert await asyncio.wait_for(clients[0].get_str("lock"), 10) == f"r{won.index(True)}"


async def test_cli_put_expect(start_instance):
    """A failed condition changes nothing and exits 3 (CONDITION_FAILED),
    naming the condition's key; other errors exit 1."""
    inst = await start_instance(size=2)
    uri = inst.uri(1)
    assert (await run_cli("kvs", "put", "--expect-missing", "l", "l=me", uri=uri))[0] == 0
    rc, out, err = await run_cli("kvs", "put", "--expect-missing", "l", "l=you", uri=uri)
    assert (rc, err) == (3, "kvbroker: l: Operation canceled (condition failed: it exists)\n")
    rc, out, err = await run_cli("kvs", "put", "--expect", "l=you", "l=x", uri=uri)
    assert (rc, err) == (3, "kvbroker: l: Operation canceled "
                            "(condition failed: another value)\n")
    # the message names the condition's key, not the first key written
    rc, out, err = await run_cli("kvs", "put", "--expect", "nokey=1", "a=3", uri=uri)
    assert (rc, err) == (3, "kvbroker: nokey: Operation canceled "
                            "(condition failed: it does not exist)\n")
    rc, out, err = await run_cli("kvs", "put", "--expect-missing", "l", "a=1", "b=2", uri=uri)
    assert (rc, err) == (3, "kvbroker: l: Operation canceled (condition failed: it exists)\n")
    assert (await run_cli("kvs", "put", "--expect", "l=me", "l=free", uri=uri))[0] == 0
    assert (await run_cli("kvs", "get", "l", uri=uri))[1] == "free\n"
    # exit 3 is a failed condition only: any other error of such a put is 1
    rc, out, err = await run_cli("kvs", "put", "-N", "nosuch", "--expect-missing", "l", "l=x",
                                 uri=uri)
    assert rc == 1 and "Operation not supported" in err, err


async def test_cli_unlink_expect_gives_a_lock_back(start_instance):
    """The lock recipe of the docs: take with put --expect-missing, give
    back with unlink --expect (only as its holder), take again.  The docs'
    old release, put --expect lock=$me lock=, left an empty value that
    --expect-missing never took again."""
    inst = await start_instance(size=2)
    uri = inst.uri(1)
    assert (await run_cli("kvs", "put", "--expect-missing", "lock", "lock=alice",
                          uri=uri))[0] == 0
    rc, out, err = await run_cli("kvs", "unlink", "--expect", "lock=bob", "lock", uri=uri)
    assert (rc, err) == (3, "kvbroker: lock: Operation canceled "
                            "(condition failed: another value)\n")
    assert (await run_cli("kvs", "get", "lock", uri=uri))[1] == "alice\n"
    rc, out, err = await run_cli("kvs", "unlink", "--expect-missing", "other", "-s", "lock",
                                 uri=uri)
    assert rc == 0 and int(out) > 0, err
    rc, out, err = await run_cli("kvs", "get", "lock", uri=uri)
    assert (rc, err) == (1, "kvbroker: lock: No such file or directory\n")
    assert (await run_cli("kvs", "put", "--expect-missing", "lock", "lock=bob",
                          uri=uri))[0] == 0
    assert (await run_cli("kvs", "get", "lock", uri=uri))[1] == "bob\n"
    rc, out, err = await run_cli("kvs", "unlink", "--expect", "lock", "lock", uri=uri)
    assert rc == 2 and err.endswith(" unlink: error: --expect lock: give KEY=VALUE\n"), err
