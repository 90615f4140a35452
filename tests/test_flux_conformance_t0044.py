"""flux-core t/t0044-gc-cmd.t (``flux gc``) against ``kvbroker kvs gc``.

Flux's ``flux gc`` marks from its retained checkpoints and every live root
and sweeps blobs stored before the last checkpoint's epoch; kvbroker's
online ``kvs gc`` keeps every namespace's current root, the roots of the
last ``kvs.gc-grace`` seconds (0 here, so old versions go at once, as
after Flux's sync) and the checkpoints (docs/kvs.md, Online: kvbroker kvs
gc).  Its report is its own (``removed N blobs ...``, not ``gc complete:
marked .. reclaimed ..``); ``--no-cache``, ``--maxreqs``, the
``--test-*`` hooks, ``flux fsck``, retained checkpoint history
(``content-sqlite.max_checkpoints``) and the legacy-schema migration are
Flux's alone.  Pinned here on the command line: a collection removes what
no live tree names and nothing else, data and private namespaces read back
afterwards (from the store itself, caches dropped), a second run removes
nothing, and the "graft hazard": a namespace copied into primary and then
removed keeps its blobs, reachable only from primary's live root.
"""

from __future__ import annotations

import json
import re

from test_kvs_cli import KVB, client_env, kvs, run

BIG = "graft-survivor-" + "x" * 80  # over the inline limit: a valref of its own


async def cli(inst, *args: str, rank: int = 0):
    return await run([KVB, *args], client_env(inst.uri(rank)))


def removed(out: str) -> int:
    m = re.match(r"removed (\d+) blobs", out)
    assert m, out
    return int(m.group(1))


async def test_t0044_gc_keeps_every_live_tree_and_removes_the_rest(start_instance,
                                                                  tmp_path) -> None:
    inst = await start_instance(size=2, statedir=str(tmp_path / "state"),
                                attrs={"kvs.gc-grace": "0"})
    for args in (("put", "test.a=1", "test.b=2", "test.c=3"),
                 ("put", "garbage.x=100", "garbage.y=200"),
                 ("unlink", "garbage.x", "garbage.y"),
                 ("namespace", "create", "test-ns"),
                 ("put", "-N", "test-ns", "private.data=secret"),
                 ("namespace", "create", "graft-ns"),
                 ("put", "-N", "graft-ns", f"old={BIG}")):
        res = await kvs(inst, *args)
        assert res.rc == 0, (args, res.err)
    nsref = (await kvs(inst, "getroot", "-N", "graft-ns", "-b")).text.strip()
    valref = json.loads((await kvs(inst, "get", "-N", "graft-ns", "-t", "old")).text)["data"][0]
    # the graft: the namespace copied into primary by reference, then removed
    res = await kvs(inst, "copy", "-S", "graft-ns", ".", "job.graft.guest")
    assert res.rc == 0, res.err
    assert (await kvs(inst, "namespace", "remove", "graft-ns")).rc == 0

    # (the checkpoint at the current root first, as Flux's test syncs: a
    # periodic checkpoint landing between the two collections made the
    # first keep the root checkpointed before the copy, the second remove it)
    assert (await kvs(inst, "sync")).rc == 0
    res = await kvs(inst, "gc", rank=1)  # "flux gc runs successfully"
    assert res.rc == 0, res.err
    assert removed(res.text) > 0  # the old roots, the garbage's directory
    # "GC is a no-op when there is no garbage"
    res = await kvs(inst, "gc")
    assert (res.rc, removed(res.text)) == (0, 0), res.err

    # read back from the store itself: every blob written, every rank's caches dropped
    assert (await cli(inst, "content", "flush")).rc == 0
    for rank in (0, 1):
        assert (await cli(inst, "content", "dropcache", rank=rank)).rc == 0
    assert (await kvs(inst, "dropcache", "--all")).rc == 0
    res = await cli(inst, "content", "load", nsref, valref, rank=1)
    assert (res.rc, res.out.endswith(BIG.encode())) == (0, True), res.err
    for rank in (1, 0):
        res = await kvs(inst, "get", "test.a", "test.b", "test.c", "job.graft.guest.old",
                        rank=rank)
        assert (res.rc, res.text) == (0, f"1\n2\n3\n{BIG}\n"), res.err
        res = await kvs(inst, "get", "-N", "test-ns", "private.data", rank=rank)
        assert (res.rc, res.text) == (0, "secret\n"), res.err
    res = await kvs(inst, "get", "garbage.x")  # "verify garbage keys are gone"
    assert (res.rc, res.err) == (1, "kvbroker: garbage.x: No such file or directory\n")
