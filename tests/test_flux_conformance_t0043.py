"""flux-core t/t0043-content-sqlite-gc.t: garbage collection of the content
store -- what a collection deletes, what it keeps, and a collection with
the KVS module not loaded.

Flux pins its online collector's primitives at the RPC level:
``content-backing.gc-info`` / ``.mark`` / ``.sweep`` and the checkpoint
*epoch* stamped on each stored blob (a sweep below epoch N deletes the
unmarked blobs stored before the N-th checkpoint).  kvbroker has none of
those RPCs: ``kvbroker kvs gc`` (``kvs.gc``, run by the kvs module on rank
0) keeps by *time*, not by epoch (docs/kvs.md, "Online: kvbroker kvs gc",
and "Differences from flux kvs"): every blob a live tree names, and every
blob stored (or stored again) in the last ``kvs.gc-grace``; it deletes the
rest.  So the epoch boundary of Flux's cases is the grace period here, and
"mark" is "named by a live tree".  Blobs are stored and loaded with
``kvbroker content store|load``, as Flux's ``flux content store|load
--bypass-cache``.

Flux case -> here:

* gc-info current_epoch 0 / no candidates unless get_count / 0 candidates
  on an empty store / checkpoint-put advances the epoch / module stats
  current_epoch -> no epochs, no gc-info.  What the stats do say: ``stats
  kvs`` ``gc.last`` is null before any collection and then the collection's
  answer, the same ``removed`` as ``kvs gc`` printed (first test).
* store three blobs; mark one; sweep below the epoch deletes only the
  unmarked old ones; swept gone, others (marked, stored after) remain ->
  first test: A, B, C stored, A named by a commit, the grace period passes,
  D, E stored, ``kvs gc``: B and C are gone, A, D, E load.
* mark of a non-existent blob reports marked=0 -> a commit naming a blob
  that is not in the store (one never stored, one just collected) fails
  ``No such file or directory`` and commits nothing (first test).
* mark monotonic (a lower epoch does not lower it), an over-limit mark
  batch, sweep ``delete_cap`` / ``window`` / cursor / clamping -> do not
  apply: no epochs, and the collector's batches (8,192 rows) are its own,
  not the caller's.
* gc-info's candidate count matches what a sweep deletes -> offline
  ``kvs gc -n --statedir`` counts what the real run removes:
  tests/test_kvs_gc.py::test_gc_dry_run_counts_and_deletes_nothing.
* sweep above all epochs empties the store -> does not apply: a collection
  always keeps the namespaces' current roots.
* re-storing a blob after a checkpoint refreshes its epoch (same blobref);
  a sweep keeps it and drops the stale one -> second test: J, K stored,
  the grace period passes, J stored again (the same blobref), ``kvs gc``:
  J loads, K is gone.  (A ``kvs put`` after K makes a live root the store's
  newest row: the collector never deletes that row, so its rowids are not
  reused.)  (tests/test_kvs_gc_online.py checks J is kept;
  here K's removal and the CLI's blobref too.)
* flux gc with the KVS module not loaded: reclaims the garbage, keeps the
  checkpointed root -> third test, ``-S broker.modules=content`` and a
  statedir: an empty-directory tree object and two garbage blobs stored,
  the root checkpointed with Flux's own ``checkpoint_put`` (``{value:
  {version: 1, rootref, timestamp}}``, no key: the KVS's checkpoint).  The
  online ``kvs gc`` is the kvs module's service, so here it fails
  ``Function not implemented`` (Flux's ``flux gc`` marks from the
  checkpoint alone); the offline ``kvs gc --statedir`` on the stopped
  instance is the way, and it removes the garbage and keeps the root
  (``rootseq 0``: Flux's value has no sequence, which means 0 there).
* (beyond Flux's script) a start with the kvs module on that checkpoint
  resumes at its root, version 0, as Flux's kvs does with no sequence (it
  was refused as "not a KVS root").
* reload content-sqlite truncate / remove the modules -> no module reload;
  a fresh statedir is the clean table.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from test_broker_support import run_cli, wait_until

from broker.content import blobref
from kvs import txn

GRACE = 2.0
ATTRS = {"kvs.gc-grace": f"{GRACE:g}s"}


async def store(inst, data: bytes, rank: int = 1) -> str:
    rc, out, err = await run_cli("content", "store", uri=inst.uri(rank), input=data)
    assert rc == 0 and err == "", (rc, err)
    return out.strip()


async def load(inst, ref: str) -> tuple[int, str, str]:
    """``content load REF`` on rank 0 (which forgets what it collected at
    once; another rank may still answer from its cache)."""
    return await run_cli("content", "load", ref, uri=inst.uri(0))


async def grace_passed(since: float) -> None:
    """Wait until the blobs stored before ``since`` are older than the grace
    period.  Age is what the collector keeps by, so the wait is on the clock
    itself (with 0.3 s for the rank's own stamp, taken before ``since``)."""
    async def old() -> bool:
        return time.monotonic() - since > GRACE + 0.3

    await wait_until(old, "the grace period to pass", GRACE + 5)


async def flush(inst) -> None:
    """``content flush``: the blobs stored so far are rows of rank 0's file,
    each as old as its store (Flux's ``--bypass-cache`` stores straight to
    the backing store; unflushed blobs are written in the collection's own
    batch, each row as young as the batch's newest store)."""
    rc, _, err = await run_cli("content", "flush", uri=inst.uri(1))
    assert rc == 0, err


def absent_msg(ref: str) -> str:
    return f"No such file or directory (unknown blob {ref})"


async def test_t0043_gc_deletes_only_old_unnamed_blobs(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs=ATTRS)
    rc, out, err = await run_cli("stats", "kvs", "-r", "0", "-p", "gc.last", uri=inst.uri(1))
    assert (rc, out) == (0, "null\n"), err  # (no collection yet)
    a, b, c = [await store(inst, f"content-{x}".encode()) for x in "ABC"]
    rc, _, err = await run_cli("kvs", "put", "-t",
                               f"A={json.dumps({'ver': 1, 'type': 'valref', 'data': [a]})}",
                               uri=inst.uri(1))
    assert rc == 0, err  # (A is "marked": a live tree names it)
    await flush(inst)
    await grace_passed(time.monotonic())
    h = await connect(inst, 1)  # (RPCs: D and E must still be young at the collection)
    d, e = [(await asyncio.wait_for(h.rpc("content.store", {"data": f"content-{x}".encode()}),
                                    10))["blobref"] for x in "DE"]
    await asyncio.wait_for(h.rpc("content.flush", {}), 10)
    answer = await asyncio.wait_for(h.rpc("kvs.gc", {}), 60)
    assert answer["removed"] == 3, answer  # B, C and the empty root A's commit replaced

    for ref in (b, c):
        assert await load(inst, ref) == (1, "", f"kvbroker: content load: {absent_msg(ref)}\n")
    for ref, x in ((a, "A"), (d, "D"), (e, "E")):
        assert await load(inst, ref) == (0, f"content-{x}", ""), x
    rc, out, err = await run_cli("kvs", "get", "A", uri=inst.uri(0))
    assert (rc, out) == (0, "content-A\n"), err

    rc, out, err = await run_cli("stats", "kvs", "-r", "0", "-p", "gc.last.removed",
                                 uri=inst.uri(1))
    assert (rc, out) == (0, f"{answer['removed']}\n"), err

    # naming a blob the store does not have: one collected, one never stored
    never = blobref.hash_blob(b"absent")
    for ref in (b, never):
        rc, _, err = await run_cli("kvs", "put", "-t",
                                   f"X={json.dumps({'ver': 1, 'type': 'valref', 'data': [ref]})}",
                                   uri=inst.uri(1))
        assert rc == 1 and "No such file or directory" in err, (rc, err)
    rc, _, err = await run_cli("kvs", "get", "X", uri=inst.uri(0))
    assert rc == 1 and "No such file or directory" in err, err  # (nothing committed)


async def test_t0043_a_blob_stored_again_is_kept_and_a_stale_one_goes(start_instance,
                                                                      connect) -> None:
    inst = await start_instance(size=2, attrs=ATTRS)
    h = await connect(inst, 1)
    j, k = await store(inst, b"content-J"), await store(inst, b"content-K")
    # a live root stored last: the collector never deletes the store's
    # highest row (its rowids must not be reused), which K would be
    rc, _, err = await run_cli("kvs", "put", "after=K", uri=inst.uri(1))
    assert rc == 0, err
    await flush(inst)
    await grace_passed(time.monotonic())
    # stored again, and collected at once (RPCs: J must still be young)
    again = await asyncio.wait_for(h.rpc("content.store", {"data": b"content-J"}), 10)
    assert again["blobref"] == j  # (the same blobref: test_cmp J.ref J2.ref)
    await asyncio.wait_for(h.rpc("content.flush", {}), 10)
    answer = await asyncio.wait_for(h.rpc("kvs.gc", {}), 60)
    # K and the empty root the put replaced (Flux: sweep_all 2 == 1, K alone)
    assert answer["removed"] == 2, answer
    assert await load(inst, j) == (0, "content-J", "")
    assert await load(inst, k) == (1, "", f"kvbroker: content load: {absent_msg(k)}\n")


FLUX_VALUE = {"version": 1, "timestamp": 2.2}
"""Flux's t0043 ``checkpoint_put`` value (content-helper.sh), less its rootref."""


async def flux_checkpoint_put(inst, rootref: str) -> None:
    """Flux's ``checkpoint_put ROOTREF``: ``content.checkpoint-put`` with
    ``{value: {version: 1, rootref, timestamp: 2.2}}``, no key (the KVS's
    checkpoint; taken with the content module alone)."""
    body = {"value": {**FLUX_VALUE, "rootref": rootref}}
    rc, out, err = await run_cli("rpc", "content.checkpoint-put", json.dumps(body),
                                 uri=inst.uri(0))
    assert rc == 0, err


async def content_only_with_a_root(start_instance, statedir: str):
    """An instance of the content module alone (``-S broker.modules=content``:
    Flux's ``test_under_flux 1 minimal`` loading content and content-sqlite)
    on ``statedir``, with an empty directory's tree object stored; and its
    blobref and bytes."""
    inst = await start_instance(size=1, statedir=statedir,
                                attrs={"broker.modules": "content"})
    root_ref, root = txn.empty_root()
    assert await store(inst, root, rank=0) == root_ref
    return inst, root_ref, root


async def test_t0043_with_kvs_not_loaded_the_offline_gc_keeps_the_checkpointed_root(
        start_instance, connect, tmp_path: Path) -> None:
    statedir = str(tmp_path / "state")
    inst, root_ref, root = await content_only_with_a_root(start_instance, statedir)
    g1 = await store(inst, b"content-gc-garbage1", rank=0)
    g2 = await store(inst, b"content-gc-garbage2", rank=0)
    await flux_checkpoint_put(inst, root_ref)
    # Flux's flux gc marks from the checkpoint alone; ours online is the kvs module's
    rc, out, err = await run_cli("kvs", "gc", uri=inst.uri(0))
    # (the module that serves it, installed and not loaded, is named: an
    # operator read "no service matching" as a broken instance)
    assert rc == 1 and ("Function not implemented (no service matching kvs.gc: the kvs "
                        "module is not loaded on this rank (kvbroker module load kvs; -r all "
                        "for every rank))") in err, err
    await inst.stop()

    rc, out, err = await run_cli("kvs", "gc", "--statedir", statedir)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == (f"kept 1 blob ({len(root)} B) reachable from kvs-primary "
                        "(rootseq 0)"), out  # (no sequence in Flux's value: 0)
    assert lines[1].startswith("removed 2 blobs ("), out

    inst = await start_instance(size=1, statedir=statedir, attrs={"broker.modules": "content"})
    for ref in (g1, g2):
        assert await load(inst, ref) == (1, "", f"kvbroker: content load: {absent_msg(ref)}\n")
    h = await connect(inst, 0)
    got = await asyncio.wait_for(h.rpc("content.load", {"blobref": root_ref}), 10)
    assert got["data"] == root  # (the checkpointed root, whole)
    rc, out, err = await run_cli("content", "checkpoint", "list", "-n", uri=inst.uri(0))
    assert rc == 0 and out.split()[-1] == root_ref, (out, err)


async def test_t0043_a_start_resumes_at_a_checkpoint_put_in_fluxs_form(
        start_instance, tmp_path: Path) -> None:
    statedir = str(tmp_path / "state")
    inst, root_ref, _ = await content_only_with_a_root(start_instance, statedir)
    await flux_checkpoint_put(inst, root_ref)
    await inst.stop()
    rc, out, err = await run_cli("start", "--statedir", statedir, "--",
                                 "sh", "-c", "kvbroker kvs getroot -b && kvbroker kvs version")
    assert (rc, out) == (0, f"{root_ref}\n0\n"), err
