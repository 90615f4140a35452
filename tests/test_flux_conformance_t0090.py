"""flux-core t/t0090-content-enospc.t on the command line.

Flux fills a 1 MB tmpfs statedir, then checks that the instance still
works (dmesg says ``No space left on device``; here: reads), that ``flux
content flush`` fails with ``content.flush: No space left on device``, and
that ``flux kvs put --sync`` fails with ENOSPC.  The store is filled the
way tests/test_content_backlog.py does (a filler file, no free-space
reserve: with one, docs/kvs.md "What survives a restart", writes are
refused before the disk is full, also with ENOSPC).  Flux's ``flux start``
then fails, its rc3 unable to write; so does kvbroker's rank 0, unable to
write its final checkpoint.  ``content-files`` is Flux's other backing
module: not applicable.
"""

from __future__ import annotations

import asyncio

from test_content_backlog import LIMIT, NO_RESERVE, fill_the_disk
from test_kvs_cli import KVB, client_env, kvs, run
from test_kvs_rpc_helpers import get

from broker.handle import Handle
from broker.launch import Instance


async def test_t0090_a_full_statedir_fails_writes_with_enospc_and_serves_reads(
        small_disk, tmp_path) -> None:
    log = tmp_path / "rank.log"
    inst = Instance(2, statedir=str(small_disk / "state"), stderr_path=str(log),
                    attrs={"content.backlog-bytes": str(LIMIT), **NO_RESERVE})
    await asyncio.wait_for(inst.start(), 60)
    try:
        h = await Handle.connect(inst.uri(0))
        await fill_the_disk(h, small_disk)  # (content.flush fails with ENOSPC there)
        await h.close()

        # "content flush returns error on ENOSPC", from either rank
        for rank in (0, 1):
            res = await run([KVB, "content", "flush"], client_env(inst.uri(rank)))
            assert res.rc == 1, res
            assert res.err.startswith("kvbroker: content flush: No space left on device"), res.err
        # "kvs sync fails due to ENOSPC"
        res = await kvs(inst, "put", "--sync", "foo=1", rank=1)
        assert res.rc == 1 and res.err.startswith("kvbroker: foo: No space left on device"), res
        res = await kvs(inst, "sync")
        assert res.rc == 1 and "No space left on device" in res.err, res
        # "flux still operates": reads are served
        res = await kvs(inst, "get", "before", rank=1)
        assert (res.rc, res.text) == (0, "kept\n"), res.err
        h0 = await Handle.connect(inst.uri(0))
        assert await get(h0, "before") == b"kept"
        await h0.close()
    finally:
        codes = await asyncio.wait_for(inst.stop(), 60)
    # as Flux's flux start, the stop fails: the final checkpoint cannot be written
    assert codes[0] == 1, (codes, log.read_text())
    assert "module kvs failed to stop" in log.read_text()
