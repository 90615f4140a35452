"""flux-core t/t1010-kvs-commit-sync.t on the command line.

Flux's checkpoint is read back with ``content.checkpoint-get`` (key
``kvs-primary``); ours holds ``{rootref, rootseq, timestamp}``
(docs/protocol.md, Durability).  With a statedir and periodic checkpoints
off (``kvs.checkpoint-period=0``, Flux's default): no checkpoint until a
sync; ``put --blobref --sync`` prints the root the checkpoint names; ``kvs
sync`` checkpoints the root of the plain ``put -b`` before it.  Two
departures, documented (docs/kvs.md "Differences from flux kvs", docs/cli.md
"kvs sync"): ``--sync`` in another namespace works (Flux: EINVAL), and so
does ``--sync`` without a statedir (Flux, with no backing store: fails).
The other durability cases are in tests/test_kvs_rpc_durability.py.
"""

from __future__ import annotations

import asyncio
import errno

from test_kvs_cli import kvs

from broker.errors import RemoteError

T = 30


async def checkpoint(h) -> dict | None:
    try:
        got = await asyncio.wait_for(h.rpc("content.checkpoint-get", {"key": "kvs-primary"}), T)
    except RemoteError as exc:
        assert exc.errnum == errno.ENOENT, exc
        return None
    return got["value"]


async def test_t1010_sync_checkpoints_the_root(start_instance, connect, tmp_path) -> None:
    inst = await start_instance(size=1, statedir=str(tmp_path / "state"),
                                attrs={"kvs.checkpoint-period": "0"})
    h = await connect(inst, 0)
    for kv in ("a=1", "b=2"):
        assert (await kvs(inst, "put", kv)).rc == 0
    assert await checkpoint(h) is None  # "no checkpoint of kvs-primary should exist yet"

    res = await kvs(inst, "put", "--blobref", "--sync", "c=3")
    assert res.rc == 0, res.err
    cp = await checkpoint(h)
    assert cp is not None and cp["rootref"] == res.text.strip()

    res = await kvs(inst, "put", "--blobref", "d=4")
    assert res.rc == 0, res.err
    assert (await checkpoint(h))["rootref"] != res.text.strip()  # not yet
    synced = await kvs(inst, "sync", "--blobref")
    assert synced.rc == 0, synced.err
    # an empty commit: the same tree, so the same root blobref
    assert (await checkpoint(h))["rootref"] == res.text.strip() == synced.text.strip()

    # departure: SYNC in another namespace works (Flux: EINVAL); primary's
    # checkpoint is left as it is
    assert (await kvs(inst, "namespace", "create", "testnamespace")).rc == 0
    assert (await kvs(inst, "put", "-N", "testnamespace", "a=10")).rc == 0
    res = await kvs(inst, "put", "-N", "testnamespace", "--sync", "b=11")
    assert (res.rc, res.err) == (0, "")
    assert (await checkpoint(h))["rootref"] == synced.text.strip()

    st = await asyncio.wait_for(h.rpc("kvs.stats-get", {}), T)
    assert st["rpcs-pending"] == 0


async def test_t1010_sync_without_a_statedir(start_instance) -> None:
    """Departure: without a statedir the store is flushed to the run
    directory's file (docs/cli.md, kvs sync); Flux with no backing store
    fails the sync."""
    inst = await start_instance(size=1)
    res = await kvs(inst, "put", "--sync", "testsync=1")
    assert (res.rc, res.err) == (0, "")
    res = await kvs(inst, "sync", "-s")
    assert (res.rc, res.text) == (0, "2\n")
