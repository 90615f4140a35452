"""flux-core t/t1007-kvs-lookup-watch.t, the cases the other tests pin only
through the RPC, as ``kvbroker kvs get`` processes against a real 2-rank
instance: what the command prints and how it exits.

The RPC side (every flag, ENOENT/ENOTSUP/EINVAL ends, UNIQ, FULL, APPEND,
STREAM, INITIAL_SENTINEL, commit order, guests) is in test_watch_basic.py,
test_watch_append.py, test_watch_namespaces.py and test_watch_scale.py; the
basic CLI forms in test_watch_cli.py.
"""

from __future__ import annotations

import asyncio
import errno

from test_watch_cli import run, spawn
from test_watch_helpers import (
    NO_MERGE,
    TREEOBJ,
    WAITCREATE,
    append,
    commit,
    lookup,
    ns_create,
    ns_remove,
    put,
    unlink,
    wait_watchers,
)

from broker.errors import RemoteError


async def finish(p: asyncio.subprocess.Process, timeout: float = 20) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(p.communicate(), timeout)
    assert p.returncode is not None
    return p.returncode, out.decode(), err.decode()


async def test_append_watch_counts_an_empty_append_and_ends_on_a_rewrite(start_instance,
                                                                          connect):
    """t1007 '--append works with empty string' (an empty append is one of
    -c's values and prints nothing), '--append fails on removed key' (the
    chunks so far, then ``No such file or directory``, exit 1), '... on
    change to non-value' and '... on fake append' (``Invalid argument``)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    keys = ("t.removed", "t.dir", "t.rewritten", "t.empty")
    await commit(h0, *(put(k, "abc") for k in keys), sync=(h0, 1))
    procs = {k: await spawn(uri, "kvs", "get", "--watch", "--append", "--count=4", k)
             for k in keys}
    await wait_watchers(h0, len(keys), nodeid=1)
    await commit(h0, *(append(k, "d") for k in keys))
    await commit(h0, *(append(k, "") for k in keys))
    await commit(h0, unlink("t.removed"), put("t.dir.x", "1"), put("t.rewritten", "abcdef"),
                 append("t.empty", "e"))
    assert await finish(procs["t.empty"]) == (0, "abc\nd\ne\n", "")
    assert await finish(procs["t.removed"]) == (
        1, "abc\nd\n", "kvbroker: t.removed: No such file or directory\n")
    for k in ("t.dir", "t.rewritten"):
        rc, out, err = await finish(procs[k])
        assert (rc, out) == (1, "abc\nd\n"), (k, err)
        assert err.startswith(f"kvbroker: {k}: Invalid argument"), (k, err)
    await wait_watchers(h0, 0, nodeid=1)


async def test_uniq_full_and_normalised_keys(start_instance, connect):
    """t1007 '--watch and --uniq do not see duplicate committed values',
    'w/o --full doesnt detect change' / 'w/ --full detects change' (a
    parent directory replaced by another's dirref), '--full doesnt work with
    non-changing data', and 'normalized key matching works'."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    await commit(h0, put("test.f", "1"), put("test.dir_orig.a", "abc"),
                 put("test.dir_new.a", "xyz"), put("testnorm.a", "1"), sync=(h0, 1))
    uniq = await spawn(uri, "kvs", "get", "--watch", "--uniq", "--count=3", "test.f")
    plain = await spawn(uri, "kvs", "get", "--watch", "--count=3", "test.dir_orig.a")
    full = await spawn(uri, "kvs", "get", "--watch", "--full", "--count=3", "test.dir_orig.a")
    norm = await spawn(uri, "kvs", "get", "--watch", "--count=2", "testnorm...a")
    await wait_watchers(h0, 4, nodeid=1)
    for v in ("1", "1", "2", "2", "3"):
        await commit(h0, put("test.f", v), flags=NO_MERGE)
    await commit(h0, put("test.dir_orig", await lookup(h0, "test.dir_new", TREEOBJ)))
    await commit(h0, put("test.dir_orig.a", "xyz"))  # FULL saw this value: not again
    await commit(h0, put("test.dir_orig.a", "def"))
    await commit(h0, put("testnorm.....a", "2"))
    assert await finish(uniq) == (0, "1\n2\n3\n", "")
    # each xyz once: the plain watch did not see the parent replaced (it
    # saw the put naming the key), FULL saw it and not the put (no change)
    assert await finish(plain) == (0, "abc\nxyz\ndef\n", "")
    assert await finish(full) == (0, "abc\nxyz\ndef\n", "")
    assert await finish(norm) == (0, "1\n2\n", "")
    await wait_watchers(h0, 0, nodeid=1)


async def test_namespace_removal_ends_watches_with_enotsup(start_instance, connect):
    """t1007 '--watch terminated by namespace removal', '--watch &
    --waitcreate, create & remove namespace works' and '... doesnt work on
    removed namespace': exit 1, ``Operation not supported``, after what
    was printed."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    await ns_create(h0, "ns_remove")
    await commit(h0, put("other", "1"), ns="ns_remove", sync=(h0, 1))
    later = await spawn(uri, "kvs", "get", "-N", "ns_create_and_remove", "--watch",
                        "--waitcreate", "--count=2", "k")
    missing = await spawn(uri, "kvs", "get", "-N", "ns_remove", "--watch", "--waitcreate",
                          "--count=1", "k")
    await wait_watchers(h0, 1, nodeid=1, ns="ns_create_and_remove")
    await wait_watchers(h0, 1, nodeid=1, ns="ns_remove")
    await ns_create(h0, "ns_create_and_remove")
    await commit(h0, put("k", "0"), ns="ns_create_and_remove")
    assert later.stdout is not None
    assert await asyncio.wait_for(later.stdout.readline(), 20) == b"0\n"
    await ns_remove(h0, "ns_create_and_remove")
    await ns_remove(h0, "ns_remove")
    assert await finish(later) == (1, "", "kvbroker: k: Operation not supported (namespace "
                                          "ns_create_and_remove was removed)\n")
    assert await finish(missing) == (1, "", "kvbroker: k: Operation not supported (namespace "
                                            "ns_remove was removed)\n")
    await wait_watchers(h0, 0, nodeid=1)


async def test_stream_of_an_empty_value_and_a_cancelled_waitcreate(start_instance, connect):
    """t1007 'get --stream works (empty value)' (prints what get prints:
    nothing, as Flux's ``flux kvs get`` of an empty value), and
    'flux_kvs_lookup with waitcreate can be canceled': a non-streaming
    WAITCREATE lookup (what flux_kvs_lookup sends) that kvs-watch.cancel
    names is answered ENODATA, as Flux's waitcreate_cancel expects."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    await commit(h0, put("test.stream.empty", ""), sync=(h0, 1))
    assert await run(uri, "kvs", "get", "test.stream.empty") == (0, "", "")
    assert await run(uri, "kvs", "get", "--stream", "test.stream.empty") == (0, "", "")
    h1 = await connect(inst, 1)
    tag, fut = h1.rpc_tagged("kvs-watch.lookup", {"namespace": "primary",
                                                  "key": "test.not_a_key",
                                                  "flags": WAITCREATE})
    await wait_watchers(h0, 1, nodeid=1)
    h1.send_noresponse("kvs-watch.cancel", {"matchtag": tag})
    try:
        got = await asyncio.wait_for(fut, 10)
    except RemoteError as exc:
        assert exc.errnum == errno.ENODATA, exc
    else:
        raise AssertionError(f"a cancelled WAITCREATE lookup answered {got!r}")
    await wait_watchers(h0, 0, nodeid=1)
