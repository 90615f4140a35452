"""flux-core t/t1013-kvs-initial-rootref.t on the command line.

Flux reloads its kvs module; here the instance stops and starts again on
its statedir: the primary namespace resumes at the last root.  Flux's
module option ``initial-rootref=BLOBREF`` starts it at an older root, at
version 0; kvbroker has no such option, and does the same offline
(docs/kvs.md, Dump and restore): ``kvs dump -a BLOBREF`` while it runs, then
``kvs restore --checkpoint`` into the stopped instance's statedir.  The
next start has that very root (the same blobref) at version 0.  A bad
reference is refused, as Flux refuses to load the module with one.
"""

from __future__ import annotations

from test_broker_support import run_cli
from test_kvs_cli import kvs


async def test_t1013_restart_resumes_and_an_older_root_comes_back(start_instance,
                                                                  tmp_path) -> None:
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=4, statedir=statedir)
    blobs = []
    for i in range(1, 6):
        res = await kvs(inst, "put", "--blobref", f"data={i}")
        assert res.rc == 0, res.err
        blobs.append(res.text.strip())
    await inst.stop()

    inst = await start_instance(size=4, statedir=statedir)  # "reload kvs"
    assert (await kvs(inst, "get", "data", rank=3)).text == "5\n"
    assert (await kvs(inst, "getroot", "-b")).text.strip() == blobs[4]
    archive = str(tmp_path / "at3.tar")
    res = await kvs(inst, "dump", "-a", blobs[2], archive)
    assert res.rc == 0, res.err
    res = await kvs(inst, "dump", "-a", "abcdefghijklmnop", str(tmp_path / "bad.tar"))
    assert res.rc != 0 and "abcdefghijklmnop" in res.err, res
    await inst.stop()
    rc, _, err = await run_cli("kvs", "restore", "--checkpoint", "--statedir", statedir,
                               archive)
    assert rc == 0, err

    inst = await start_instance(size=4, statedir=statedir)
    assert (await kvs(inst, "get", "data", rank=3)).text == "3\n"
    assert (await kvs(inst, "getroot", "-b")).text.strip() == blobs[2]
    assert (await kvs(inst, "version")).text == "0\n"
