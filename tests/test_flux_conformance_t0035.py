"""flux-core t/t0035-content-sqlite-checkpoint.t: checkpoints through the
content service, in Flux's own request forms.

Flux's test loads content-sqlite without the KVS and drives
``content.checkpoint-put {value}`` / ``content.checkpoint-get`` (no key: the
KVS's checkpoint) with its ``checkpoint_put`` helper, on rank 0 and rank 1.
Here too the instance runs the content module alone (``-S
broker.modules=content``: with the kvs module, which owns that checkpoint,
the put is ``EBUSY``).  The rootrefs are real blobrefs (the KVS's checkpoint
must name a root: Flux's test writes ``bar``, which is refused with
``EINVAL`` so that a later start can read it); the checks Flux makes after
each put are the same:

* "checkpoint-get returns ENOENT if there is no checkpoint".
* "checkpoint-put w/ rootref", "checkpoint-get returned rootref",
  "on rank 1 forwards to rank 0", "returned correct timestamp": the put
  and the get from either rank, ``value[0]`` the newest, its timestamp as
  given.
* "flux content checkpoint list" (default, ``--no-header``, ``--json``):
  ``kvbroker content checkpoint list`` with the same options, newest first.
* "flush + reload content-sqlite", "checkpoint-get still returns":
  a restart on the statedir.
* "stores only max of 5 checkpoints", "the oldest is not listed": with
  ``content.max-checkpoints=5``, six puts keep the last five.
* "invalid max-checkpoints config": ``-S content.max-checkpoints=-1`` is
  refused before any rank starts.
* "checkpoint update" is for a stopped instance here (``--statedir``):
  tests/test_checkpoint_history.py; Flux's "fails if KVS loaded" is the
  put's ``EBUSY`` above (tests/test_content_rpc.py).
* "content-backing.load wrong size hash fails with EPROTO": there is no
  ``content-backing`` service (the store is rank 0's content module);
  ``content.load`` of a malformed blobref is in tests/test_content_rpc.py.
* "run an instance to create a checkpt_v2 table" ... "new checkpoint is
  storing multiple checkpoints" (Flux's checkpt v1 -> v2 conversion):
  kvbroker's older store is one without the ``checkpoint_history`` table
  (one checkpoint a key, as Flux's v1 table).  Such a store (the table
  dropped from a stopped instance's file, as Flux drops ``checkpt_v2``) is
  listed offline, started from (``kvs get foo``), gains the table with its
  checkpoint kept, and after a ``kvs sync`` keeps more than one.
"""

from __future__ import annotations

import asyncio
import errno
import json
import sqlite3

from test_broker_support import run_cli
from test_kvs_rpc_helpers import errnum

from broker.content.blobref import hash_blob

T = 10


def put_msg(rootref: str, sequence: int, timestamp: float) -> dict:
    """What Flux's ``kvs_checkpoint_commit`` sends (no key)."""
    return {"value": {"version": 1, "rootref": rootref, "sequence": sequence,
                      "timestamp": timestamp}}


async def get_rootrefs(h) -> list[str]:
    got = await asyncio.wait_for(h.rpc("content.checkpoint-get", None), T)
    return [cp["rootref"] for cp in got["value"]]


async def test_t0035_checkpoints_in_flux_forms_from_any_rank(start_instance, connect,
                                                             tmp_path) -> None:
    statedir = str(tmp_path / "state")
    attrs = {"broker.modules": "content", "content.max-checkpoints": "5"}
    inst = await start_instance(size=2, statedir=statedir, attrs=attrs)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    assert await errnum(h0.rpc("content.checkpoint-get", None)) == errno.ENOENT
    bar, baz = hash_blob(b"bar"), hash_blob(b"baz")
    assert await errnum(h0.rpc("content.checkpoint-put", put_msg("bar", 1, 1.5))) == (
        errno.EINVAL)  # (Flux's test's "bar": not a root)

    await asyncio.wait_for(h0.rpc("content.checkpoint-put", put_msg(bar, 1, 1.5)), T)
    assert (await get_rootrefs(h0))[0] == bar
    rc, out, err = await run_cli("content", "checkpoint", "list", uri=inst.uri(0))
    assert rc == 0 and len(out.splitlines()) == 2 and bar in out.splitlines()[1], (out, err)
    rc, out, err = await run_cli("content", "checkpoint", "list", "-n", uri=inst.uri(0))
    assert rc == 0 and len(out.splitlines()) == 1 and bar in out, (out, err)
    rc, out, err = await run_cli("content", "checkpoint", "list", "--json", uri=inst.uri(0))
    assert rc == 0 and json.loads(out)["rootref"] == bar, (out, err)

    # from rank 1: forwarded to rank 0, and its timestamp kept
    await asyncio.wait_for(h1.rpc("content.checkpoint-put", put_msg(baz, 2, 2.2)), T)
    got = await asyncio.wait_for(h1.rpc("content.checkpoint-get", None), T)
    assert [cp["rootref"] for cp in got["value"]] == [baz, bar]
    assert got["value"][0]["timestamp"] == 2.2 and got["value"][0]["sequence"] == 2
    rc, out, err = await run_cli("content", "checkpoint", "list", "-n", uri=inst.uri(1))
    assert rc == 0 and [ln.split()[-1] for ln in out.splitlines()] == [baz, bar], out

    refs = [hash_blob(b"ref%d" % i) for i in range(1, 7)]
    for i, ref in enumerate(refs):
        await asyncio.wait_for(h0.rpc("content.checkpoint-put", put_msg(ref, 10 + i, 3.0)), T)
    kept = await get_rootrefs(h0)
    assert kept == refs[::-1][:5] and refs[0] not in kept  # the oldest went
    await h0.close()
    await h1.close()
    await inst.stop()

    # "flush + reload": a restart on the statedir has them
    inst = await start_instance(size=2, statedir=statedir, attrs=attrs)
    h = await connect(inst, 1)
    assert await get_rootrefs(h) == refs[::-1][:5]


async def test_t0035_an_invalid_max_checkpoints_is_refused_at_start() -> None:
    rc, out, err = await run_cli("start", "-S", "content.max-checkpoints=-1", "--",
                                 "echo", "ran")
    assert rc == 2 and out == "" and "content.max-checkpoints" in err, (rc, err)


def tables(statedir) -> set[str]:
    db = sqlite3.connect(statedir / "content.sqlite")
    try:
        return {name for (name,) in db.execute(
            "SELECT tbl_name FROM sqlite_master WHERE type = 'table'")}
    finally:
        db.close()


async def test_t0035_an_older_store_gains_the_checkpoint_history(tmp_path) -> None:
    statedir = tmp_path / "state"
    rc, _, err = await run_cli("start", "--statedir", str(statedir), "--",
                               "kvbroker", "kvs", "put", "--sync", "foo=bar")
    assert rc == 0, err

    async def listed() -> list[str]:
        rc, out, err = await run_cli("content", "checkpoint", "list", "--statedir",
                                     str(statedir), "-j")
        assert rc == 0, err
        return [json.loads(line)["rootref"] for line in out.splitlines()]

    [old] = await listed()
    db = sqlite3.connect(statedir / "content.sqlite")
    try:
        db.execute("DROP TABLE checkpoint_history")
        db.commit()
    finally:
        db.close()
    assert "checkpoint_history" not in tables(statedir) and "checkpoints" in tables(statedir)
    assert await listed() == [old]  # (read as it is, offline)

    rc, out, err = await run_cli("start", "--statedir", str(statedir), "--",
                                 "kvbroker", "kvs", "get", "foo")
    assert (rc, out) == (0, "bar\n"), err
    assert "checkpoint_history" in tables(statedir)
    assert await listed() == [old]

    rc, _, err = await run_cli("start", "--statedir", str(statedir), "--",
                               "kvbroker", "kvs", "sync")
    assert rc == 0, err
    kept = await listed()
    assert len(kept) > 1 and old in kept, kept
