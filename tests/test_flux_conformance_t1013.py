"""flux-core t/t1013-kvs-initial-rootref.t on the command line.

Flux reloads its kvs module ('kvs: reload kvs'): so does
:func:`test_t1013_module_reload_kvs_resumes_at_the_last_root` (``kvbroker
module reload kvs`` on rank 0 of a running 4-rank instance with a
statedir; 'data should be last written', 'root should be last one', on
rank 0 and a leaf).  Flux's 'reload kvs with different initial rootref',
'remove kvs module' and 'load kvs with bad rootref' become, in the same
test: ``module reload kvs initial-rootref=...`` is refused (``EINVAL``,
kvbroker's kvs has no such attribute) and leaves the kvs running at the
last root; ``module remove kvs``, then the same reload with the bad
reference fails and loads nothing (commits end ``ENOSYS``); ``module load
kvs`` brings the last root back.
:func:`test_t1013_restart_resumes_and_an_older_root_comes_back` keeps the
restart: the instance stops and starts again on its statedir: the primary
namespace resumes at the last root.  Flux's
module option ``initial-rootref=BLOBREF`` starts it at an older root, at
version 0; kvbroker has no such option, and does the same offline
(docs/kvs.md, Dump and restore): ``kvs dump -a BLOBREF`` while it runs, then
``kvs restore --checkpoint`` into the stopped instance's statedir.  The
next start has that very root (the same blobref) at version 0.  A bad
reference is refused, as Flux refuses to load the module with one.
"""

from __future__ import annotations

import asyncio
import errno

import pytest
from test_broker_support import run_cli
from test_kvs_cli import kvs
from test_watch_helpers import commit, put

from broker.errors import RemoteError


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


async def test_t1013_module_reload_kvs_resumes_at_the_last_root(start_instance, connect,
                                                                tmp_path) -> None:
    inst = await start_instance(size=4, statedir=str(tmp_path / "state"))
    blobs = []
    for i in range(1, 6):
        res = await kvs(inst, "put", "--blobref", f"data={i}")
        assert res.rc == 0, res.err
        blobs.append(res.text.strip())
    version = (await kvs(inst, "version")).text

    async def module(*args: str) -> tuple[int, str]:
        rc, out, err = await run_cli("module", *args, uri=inst.uri(0), timeout=20)
        assert out == "", out
        return rc, err

    assert await module("reload", "kvs") == (0, "")  # "kvs: reload kvs"
    for rank in (0, 3):
        assert (await kvs(inst, "get", "data", rank=rank)).text == "5\n"
    assert (await kvs(inst, "getroot", "-b")).text.strip() == blobs[4]
    assert (await kvs(inst, "version")).text == version

    # "reload kvs with different initial rootref": no such setting here
    rc, err = await module("reload", "kvs", f"initial-rootref={blobs[2]}")
    assert rc != 0 and "initial-rootref" in err, err
    assert (await kvs(inst, "getroot", "-b")).text.strip() == blobs[4]

    assert await module("remove", "kvs") == (0, "")  # "kvs: remove kvs module"
    h = await connect(inst, 0)
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(commit(h, put("data", "6")), 20)
    assert info.value.errnum == errno.ENOSYS, info.value
    # "load kvs with bad rootref" fails, and loads nothing
    rc, err = await module("reload", "-f", "kvs", "initial-rootref=abcdefghijklmnop")
    assert rc != 0 and "initial-rootref" in err, err
    names = [m["name"] for m in (await h.rpc("module.list", {}))["modules"]]
    assert "kvs" not in names, names
    assert await module("load", "kvs") == (0, "")
    assert (await kvs(inst, "getroot", "-b")).text.strip() == blobs[4]
    assert (await kvs(inst, "get", "data", rank=3)).text == "5\n"
