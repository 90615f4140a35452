"""kvs-watch against online garbage collection (``kvs gc``).

A watcher that falls more than ``kvs.gc-grace`` behind (its rank stopped,
or slow) may be told about a root that rank 0 has collected since.  Its
pinned lookup there fails because the blobs are gone, which says nothing
about the key: the watcher must answer from a newer root (skipping the
versions the collection removed), never take the failure for "no such key"
(a WAITCREATE watcher waiting for ever, a WATCH ending ``ENOENT``).

Deterministic: the watcher's rank is stopped (SIGSTOP, waited for) while
rank 0 commits and collects with ``kvs.gc-grace=0``; setroots carry no
blobs (``kvs.setroot-blob-limit=0``), so the stopped rank has to fetch the
collected root's blobs after SIGCONT, and cannot.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from typing import Any

import pytest
from test_broker_support import stop_process
from test_watch_helpers import (
    WAITCREATE,
    WATCH,
    answer,
    cancel,
    commit,
    end_errnum,
    put,
    stats,
    value,
    wait_until,
    watch_stream,
)

from broker.errors import RemoteError

ATTRS = {"kvs.gc-grace": "0", "kvs.setroot-blob-limit": "0"}
"""Keep no old root; prime no follower cache with a commit's blobs."""


async def gc(h: Any) -> dict[str, Any]:
    return await asyncio.wait_for(h.rpc("kvs.gc", {}), 60)


async def waiting_at(h1: Any, rootseq: int) -> None:
    """Until rank 1's watcher has read the key at ``rootseq`` and waits."""
    async def check() -> bool:
        st = await stats(h1, 1)
        ns = st["namespaces"].get("primary", {})
        return bool(st["watchers"] == 1 and ns.get("rootseq") == rootseq
                    and ns.get("state") == "ready" and st["lookups-in-flight"] == 0)
    await wait_until(check, what="the watcher to wait at the first root")


async def _behind_a_collection(inst: Any, h0: Any, *commits: list[dict[str, Any]]
                               ) -> list[dict[str, Any]]:
    """Stop rank 1, make ``commits`` on rank 0, collect every older root,
    and let rank 1 go on: it hears of roots whose blobs are gone."""
    rank1 = inst.pids()[1]
    await stop_process(rank1)
    try:
        done = [await commit(h0, *ops) for ops in commits]
        assert (await gc(h0))["removed"] > 0
    finally:
        os.kill(rank1, signal.SIGCONT)
    return done


@pytest.mark.parametrize("flags", [WAITCREATE, WAITCREATE | WATCH])
async def test_waitcreate_watcher_behind_a_collection_answers_the_key(
        start_instance, connect, flags) -> None:
    """The key was created at a root collected before the watcher read it,
    and the later commits do not name it: the watcher answers the value
    (it waited silently for ever before: the failed read looked like the
    key still missing)."""
    inst = await start_instance(size=2, attrs=ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    first = await commit(h0, put("other", "0"), sync=(h1, 1))
    s = watch_stream(h1, "job.state", flags)
    await waiting_at(h1, first["rootseq"])
    done = await _behind_a_collection(inst, h0, [put("job.state", "ready")],
                                      [put("other", "1")])
    p = await answer(s)
    assert p is not None and p["val"]["data"] == b"ready", p
    # the version that created it was collected: answered at the newer one
    assert p["rootseq"] == done[1]["rootseq"]
    if flags & WATCH:
        await commit(h0, put("job.state", "done"))
        assert await value(s) == b"done"
        cancel(h1, s)
    assert await end_errnum(s) == 0


@pytest.mark.parametrize("later", [0, 1, 2])
async def test_watcher_behind_a_collection_does_not_end_enoent(
        start_instance, connect, later) -> None:
    """A WATCH watcher whose next roots were collected answers the key's
    value at the newest root it can read, instead of ending ``ENOENT`` as
    if the key had been removed.  ``later``: commits naming the key after
    the first collected one (their roots collected too but the last, when
    it is the current root)."""
    inst = await start_instance(size=2, attrs=ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("k", "v0"), sync=(h1, 1))
    s = watch_stream(h1, "k", WATCH)
    assert await value(s) == b"v0"
    commits = [[put("k", "v1")], *([put("k", f"v{2 + i}")] for i in range(later)),
               [put("other", "x")]]
    done = await _behind_a_collection(inst, h0, *commits)
    p = await answer(s)
    assert p is not None and p["val"]["data"] == f"v{1 + later}".encode(), p
    assert p["rootseq"] == done[-1]["rootseq"]
    await commit(h0, put("k", "after"))
    assert await value(s) == b"after"
    # a key removed at a root that can be read still ends the watch ENOENT
    await commit(h0, {"key": "k", "flags": 0, "dirent": None})
    with pytest.raises(RemoteError) as err:
        await answer(s)
    assert err.value.errnum == errno.ENOENT and "no such key" in err.value.errstr
