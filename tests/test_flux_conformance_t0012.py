"""flux-core t/t0012-content-sqlite.t on the command line.

Flux loads ``content-sqlite`` as a module with options (purge thresholds,
``truncate``, ``journal_mode``...); kvbroker's content module is always
there, rank 0 keeping its SQLite file (docs/protocol.md, Content store), so
those cases do not apply.  What the Flux test pins about the store itself:
blobs of 0 bytes to 1 MiB come back whole on every rank (faulted in from
rank 0), a blobref is the hash of the bytes, the same blob stored ten times
is one entry, ``flux content flush`` leaves nothing dirty, ``flux content
dropcache`` empties a rank's cache (which then faults in again), an unknown
blob is ``No such file or directory``, and a store whose SQLite header is
damaged stops the instance from starting.  ``--bypass-cache`` (load and
store straight from rank 0) is Flux's alone: here every load of a rank
without the blob goes up the tree.  Flux lets guests read the content
stats; kvbroker does not (broker/content/module.py: they tell whether a
blob is stored).
"""

from __future__ import annotations

import asyncio
import hashlib
import os

from test_broker_support import run_cli
from test_kvs_cli import KVB, Result, client_env, run
from test_kvs_rpc_durability import refused_start_log

T = 30


async def stats(h) -> dict:
    return await asyncio.wait_for(h.rpc("content.stats-get", {}), T)


async def content(inst, *args: str, rank: int = 0, stdin: bytes = b"") -> Result:
    """One ``kvbroker content ARGS`` attached to ``rank`` (stdout as bytes)."""
    return await run([KVB, "content", *args], client_env(inst.uri(rank)), stdin)


async def test_t0012_blobs_round_trip_on_every_rank(start_instance, connect) -> None:
    inst = await start_instance(size=3, fanout=2)
    blobs = [b"", os.urandom(64), os.urandom(4096), os.urandom(256 * 4096)]
    refs = []
    for data in blobs:  # "store blobs"
        res = await content(inst, "store", stdin=data)
        assert res.rc == 0, res.err
        refs.append(res.text.strip())
    # a blobref is the content.hash of the bytes (t/kvs/blobref)
    assert refs == ["sha256-" + hashlib.sha256(d).hexdigest() for d in blobs]

    # "load and verify ... blob on all ranks": ranks 2 and 1 fault them in
    # from rank 0; several blobrefs load in the order named
    for rank in (2, 1, 0):
        res = await content(inst, "load", *refs, rank=rank)
        assert (res.rc, res.err) == (0, "")
        assert res.out == b"".join(blobs), rank
    # without arguments, the blobrefs come on stdin, one a line
    res = await content(inst, "load", rank=1, stdin=f"{refs[2]}\n{refs[1]}\n".encode())
    assert (res.rc, res.out) == (0, blobs[2] + blobs[1]), res.err

    # "storing the same object multiple times is just one row"
    h0 = await connect(inst, 0)
    before = (await stats(h0))["count"]
    for _ in range(10):
        res = await content(inst, "store", rank=2, stdin=b"foo\n")
        assert res.rc == 0, res.err
    assert res.text.strip() == "sha256-" + hashlib.sha256(b"foo\n").hexdigest()
    assert (await stats(h0))["count"] == before + 1

    # "exercise batching of synchronous flush": nothing dirty after it
    res = await content(inst, "flush", rank=2)
    assert (res.rc, res.out, res.err) == (0, b"", "")
    assert (await stats(h0))["dirty"] == 0

    # "drop the cache": rank 2's cache is empty, and faults in again
    h2 = await connect(inst, 2)
    assert (await stats(h2))["count"] > 0
    res = await content(inst, "dropcache", rank=2)
    assert (res.rc, res.out, res.err) == (0, b"", "")
    assert (await stats(h2))["count"] == 0
    res = await content(inst, "load", refs[1], rank=2)
    assert (res.rc, res.out) == (0, blobs[1]), res.err
    assert (await stats(h2))["count"] == 1

    # "content validate fails on invalid hash": No such file or directory,
    # after the blobs before it
    unknown = "sha256-" + hashlib.sha256(b"never stored").hexdigest()
    res = await content(inst, "load", refs[1], unknown, refs[2], rank=1)
    assert (res.rc, res.out) == (1, blobs[1])
    assert res.err == ("kvbroker: content load: No such file or directory "
                       f"(unknown blob {unknown})\n"), res.err
    # no blobref at all is a usage error
    res = await content(inst, "load", rank=1)
    assert res.rc == 2 and "no blobrefs were given" in res.err, res.err


async def test_t0012_a_damaged_store_fails_start(start_instance, tmp_path) -> None:
    """"create database with bad schema format number" / "full instance start
    fails corrupt database" (the bad header magic: test_kvs_rpc_durability)."""
    statedir = tmp_path / "state"
    inst = await start_instance(size=1, statedir=str(statedir))
    rc, _, err = await run_cli("kvs", "put", "a=1", uri=inst.uri(0))
    assert rc == 0, err
    assert await inst.stop() == [0]
    # the bytes Flux's test writes from 44, the schema format number, on
    with open(statedir / "content.sqlite", "r+b") as f:
        f.seek(44)
        f.write(b"\\001\\001\\001\\001\n")
    text = await refused_start_log(statedir, tmp_path / "rank.log")
    assert (f"start-up failed: {statedir}/content.sqlite: unsupported file format"
            in text), text


def test_a_start_up_os_error_names_its_path_first() -> None:
    """A rank that cannot open its store (as root, mode bits do not stop it:
    Flux's #4210 needs ``chattr +i``) says ``PATH: Permission denied``, as
    the other start-up errors name their path -- not Python's ``[Errno 13]
    Permission denied: 'PATH'``."""
    from broker.rank import describe

    err = PermissionError(13, "Permission denied", "/state/content.sqlite")
    assert describe(err) == "/state/content.sqlite: Permission denied"
    assert describe(OSError(18, "Invalid cross-device link", "/a", None, "/b")) == \
        "/a -> /b: Invalid cross-device link"
    assert describe(OSError("no errno")) == "no errno"  # (nothing to rearrange)
