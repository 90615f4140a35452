# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t1004-kvs-namespace.t, the shapes not pinned elsewhere.

Most of t1004 is pinned by tests/test_kvs_cli.py (``test_namespaces``,
``test_version_wait_getroot``) and tests/test_kvs_rpc_namespaces.py; this
file adds, on the command line: ``dir`` and ``unlink -Rf`` in a namespace
other than primary with no pollution between them, a value (and its
unlink) seen on another rank after ``wait``, a removed and re-created
namespace as rank 1 sees it, ``put -N`` winning over a bad
``$KVBROKER_NAMESPACE``, ``kvs wait`` in two namespaces at once, a ``kvs
wait`` ended by the namespace's removal (exit 1, ``Operation not
supported``, as Flux's ``flux_kvs_wait_version: ENOTSUP``), and no
request left pending on any rank at the end.
"""

from __future__ import annotations

import asyncio

from test_broker_support import wait_until
from test_kvs_cli import expect, kvs, sh

T = 30


async def kvs_stats(h) -> dict:
    return await asyncio.wait_for(h.rpc("kvs.stats-get", {}), T)


async def test_t1004_namespaces_on_the_command_line(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, """
        D=test.a.b
        t kvbroker kvs namespace create nstest
        kvbroker kvs put -N primary $D.a=10 $D.b=11 $D.subdirA.A=A $D.subdirB.A=B
        kvbroker kvs put -N nstest $D.a=13 $D.b=14 $D.subdirA.A=A $D.subdirB.A=B
        t kvbroker kvs unlink -N primary -Rf $D.subdirA
        t kvbroker kvs unlink -N nstest -Rf $D.subdirB
        t kvbroker kvs dir -N primary $D
        t kvbroker kvs dir -N nstest $D
        t kvbroker kvs unlink -N nstest -Rf $D
        t kvbroker kvs dir -N nstest $D
        t kvbroker kvs get -N primary $D.a
        V=$(kvbroker kvs put -N nstest -s $D.all=1)
        t on 1 sh -c "kvbroker kvs wait -N nstest $V && kvbroker kvs get -N nstest $D.all"
        V=$(kvbroker kvs unlink -N nstest -s $D.all)
        t on 1 sh -c "kvbroker kvs wait -N nstest $V && kvbroker kvs get -N nstest $D.all"
        t kvbroker kvs namespace remove nstest
        # rank 0 published "removed" before this setroot: once rank 1 has it,
        # it has dropped nstest too
        V=$(kvbroker kvs put -s barrier=1)
        on 1 kvbroker kvs wait $V
        t on 1 kvbroker kvs get -N nstest $D.a
        t kvbroker kvs namespace create nstest
        kvbroker kvs put -N nstest $D.recreate=1
        t on 1 kvbroker kvs get -N nstest $D.recreate
        t on 1 kvbroker kvs get -N nstest $D.a
        t env KVBROKER_NAMESPACE=nsBAD kvbroker kvs put -N nstest $D.puttest=5
        t kvbroker kvs get -N nstest $D.puttest
        """)
    assert out == expect("""
        $ kvbroker kvs namespace create nstest
        $ kvbroker kvs unlink -N primary -Rf test.a.b.subdirA
        $ kvbroker kvs unlink -N nstest -Rf test.a.b.subdirB
        $ kvbroker kvs dir -N primary test.a.b
        test.a.b.a = 10
        test.a.b.b = 11
        test.a.b.subdirB.
        $ kvbroker kvs dir -N nstest test.a.b
        test.a.b.a = 13
        test.a.b.b = 14
        test.a.b.subdirA.
        $ kvbroker kvs unlink -N nstest -Rf test.a.b
        $ kvbroker kvs dir -N nstest test.a.b
        kvbroker: test.a.b: No such file or directory
        [rc=1]
        $ kvbroker kvs get -N primary test.a.b.a
        10
        $ on 1 sh -c kvbroker kvs wait -N nstest 4 && kvbroker kvs get -N nstest test.a.b.all
        1
        $ on 1 sh -c kvbroker kvs wait -N nstest 5 && kvbroker kvs get -N nstest test.a.b.all
        kvbroker: test.a.b.all: No such file or directory
        [rc=1]
        $ kvbroker kvs namespace remove nstest
        $ on 1 kvbroker kvs get -N nstest test.a.b.a
        kvbroker: test.a.b.a: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs namespace create nstest
        $ on 1 kvbroker kvs get -N nstest test.a.b.recreate
        1
        $ on 1 kvbroker kvs get -N nstest test.a.b.a
        kvbroker: test.a.b.a: No such file or directory
        [rc=1]
        $ env KVBROKER_NAMESPACE=nsBAD kvbroker kvs put -N nstest test.a.b.puttest=5
        $ kvbroker kvs get -N nstest test.a.b.puttest
        5
        """)

    # "wait in different namespaces works" and "wait recognizes removed
    # namespace", on rank 1: three waits at once, each on its own namespace
    h0 = await connect(inst, 0)
    h1 = await connect(inst, 1)
    assert (await kvs(inst, "namespace", "create", "gone")).rc == 0
    pv = int((await kvs(inst, "version")).out) + 1
    nv = int((await kvs(inst, "version", "-N", "nstest")).out) + 1
    waits = {
        "primary": asyncio.ensure_future(kvs(inst, "wait", "-N", "primary", str(pv), rank=1)),
        "nstest": asyncio.ensure_future(kvs(inst, "wait", "-N", "nstest", str(nv), rank=1)),
        "gone": asyncio.ensure_future(kvs(inst, "wait", "-N", "gone", "1", rank=1)),
    }

    async def all_waiting() -> bool:
        ns = (await kvs_stats(h1))["namespaces"]
        return all(ns.get(name, {}).get("waiters", 0) == 1 for name in waits)

    await wait_until(all_waiting, "the three waits on rank 1", T)
    assert not any(w.done() for w in waits.values())
    assert (await kvs(inst, "put", "-N", "primary", "test.a.b.xxx=X")).rc == 0
    assert (await kvs(inst, "put", "-N", "nstest", "test.a.b.xxx=X")).rc == 0
    for name in ("primary", "nstest"):
        res = await asyncio.wait_for(waits[name], T)
        assert (res.rc, res.out, res.err) == (0, b"", ""), (name, res)
    assert not waits["gone"].done()
    assert (await kvs(inst, "namespace", "remove", "gone")).rc == 0
    res = await asyncio.wait_for(waits["gone"], T)
    assert res.rc == 1 and res.out == b""
    assert res.err.startswith("kvbroker: kvs wait: Operation not supported"), res.err

    # "no pending requests at end of tests", on every rank
    for h in (h0, h1):
        st = await kvs_stats(h)
        assert st["rpcs-pending"] == 0 and st["relays-waiting"] == 0, st
