# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t1001-kvs-internals.t, the cases other tests do not already
pin, on a real instance.

Left out as not applicable: ``setrootevents --pause`` (kvbroker has no
``kvs.setroot-pause``; the causal-consistency cases below keep their
``--at`` half, which needs no pause), ``lookup_invalid``, the
``transaction-opcount`` module stats and unloading the kvs module.  The
"invalid valref/dirref ... wont hang" cases differ on purpose: a commit
naming a blob the store lacks fails at once with ENOENT (docs/kvs.md,
"Differences from flux kvs"; tests/test_kvs_rpc_badinput.py).  Flux's
hard-coded ``sha1-`` blobrefs are the instance's ``sha256-`` ones here.
"""

from __future__ import annotations

from test_kvs_cli import expect, sh


async def test_zero_length_values_and_valrefs_as_t1001(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, """
        D=test.a.b
        # 'zero-length value ...'
        kvbroker kvs put --raw $D.a=
        t kvbroker kvs get --treeobj $D.a
        t kvbroker kvs dir $D
        t kvbroker kvs ls -FR $D
        t kvbroker kvs put --append $D.a=abc
        t kvbroker kvs get $D.a
        t kvbroker kvs put --append $D.a=
        t kvbroker kvs get $D.a
        kvbroker kvs put $D.e=
        t kvbroker kvs put --append $D.e=
        kvbroker kvs get --raw $D.e | wc -c
        # 'large put stores raw data into content store'
        L=abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyz
        kvbroker kvs put $D.largeval=$L
        REF=$(kvbroker kvs get --treeobj $D.largeval | grep -Eo 'sha256-[0-9a-f]+')
        t kvbroker kvs get --treeobj $D.largeval
        [ "$(kvbroker content load $REF)" = "$L" ] && echo content load ok
        # 'valref that points to content store data can be read'
        R1=$(echo "$L" | kvbroker content store)
        kvbroker kvs put --treeobj $D.largeval2='{"data":["'$R1'"],"type":"valref","ver":1}'
        [ "$(kvbroker kvs get $D.largeval2)" = "$L" ] && echo valref ok
        # '... zero size content store data can be read'
        E=$(kvbroker content store </dev/null)
        kvbroker kvs put --treeobj $D.empty='{"data":["'$E'"],"type":"valref","ver":1}'
        kvbroker kvs get --raw $D.empty | wc -c
        # 'multi blob-ref valref', empty blobs on the left, right, in the middle
        A=$(printf abcd | kvbroker content store)
        B=$(printf efgh | kvbroker content store)
        kvbroker kvs put --treeobj \\
            $D.m1='{"data":["'$A'","'$B'"],"type":"valref","ver":1}' \\
            $D.m2='{"data":["'$E'","'$A'"],"type":"valref","ver":1}' \\
            $D.m3='{"data":["'$A'","'$E'"],"type":"valref","ver":1}' \\
            $D.m4='{"data":["'$A'","'$E'","'$B'"],"type":"valref","ver":1}'
        t kvbroker kvs get --raw $D.m1 $D.m2 $D.m3 $D.m4; echo
        # 'valref can point to other treeobjs' (the blob of a directory, read as bytes)
        kvbroker kvs mkdir $D.d.b.c
        DIRREF=$(kvbroker kvs get --treeobj $D.d.b.c | grep -Eo 'sha256-[0-9a-f]+')
        kvbroker kvs put --treeobj $D.value='{"data":["'$DIRREF'"],"type":"valref","ver":1}' \\
            $D.multi='{"data":["'$A'","'$DIRREF'"],"type":"valref","ver":1}'
        [ "$(kvbroker kvs get --raw $D.value)" = "$(kvbroker content load $DIRREF)" ] && echo dir blob ok
        [ "$(kvbroker kvs get --raw $D.multi)" = "abcd$(kvbroker content load $DIRREF)" ] && echo multi dir blob ok
        """, rank=1)
    assert out == expect("""
        $ kvbroker kvs get --treeobj test.a.b.a
        {"data":"","type":"val","ver":1}
        $ kvbroker kvs dir test.a.b
        test.a.b.a =<sp>
        $ kvbroker kvs ls -FR test.a.b
        test.a.b:
        a
        $ kvbroker kvs put --append test.a.b.a=abc
        $ kvbroker kvs get test.a.b.a
        abc
        $ kvbroker kvs put --append test.a.b.a=
        $ kvbroker kvs get test.a.b.a
        abc
        $ kvbroker kvs put --append test.a.b.e=
        0
        $ kvbroker kvs get --treeobj test.a.b.largeval
        {"data":["REF"],"type":"valref","ver":1}
        content load ok
        valref ok
        0
        $ kvbroker kvs get --raw test.a.b.m1 test.a.b.m2 test.a.b.m3 test.a.b.m4
        abcdefghabcdabcdabcdefgh
        dir blob ok
        multi dir blob ok
        """)


async def test_consistency_across_ranks_as_t1001(start_instance) -> None:
    """'put on rank 0, exists on all ranks', 'unlink on rank 0, does not exist
    all ranks', 'causal consistency (put|mkdir|link|unlink)' (the root a
    write returns reads the same on another rank, at once; its version,
    waited for there, too) and 'read-your-writes consistency' (the rank a
    write went through reads it when the write returns) in an alt namespace."""
    inst = await start_instance(size=3)
    out = await sh(inst, """
        D=test.a.b
        kvbroker kvs put $D.xxx=99
        V=$(kvbroker kvs version)
        t kvbroker exec -r all -n sh -c "kvbroker kvs wait $V && kvbroker kvs get $D.xxx"
        kvbroker kvs unlink -Rf $D.xxx
        V=$(kvbroker kvs version)
        t kvbroker exec -r all -n sh -c "kvbroker kvs wait $V && ! kvbroker kvs get $D.xxx 2>/dev/null"
        kvbroker kvs put $D.fooA=3 $D.unlinkA=5
        ATREF=$(kvbroker kvs put -O $D.testA=1)
        t on 1 kvbroker kvs get --at "$ATREF" $D.testA
        ATREF=$(kvbroker kvs mkdir -O $D.dirA)
        t on 1 kvbroker kvs get --at "$ATREF" $D.dirA
        ATREF=$(kvbroker kvs link -O $D.fooA $D.linkA)
        t on 1 kvbroker kvs get --at "$ATREF" $D.linkA
        ATREF=$(kvbroker kvs unlink -O $D.unlinkA)
        t on 1 kvbroker kvs get --at "$ATREF" $D.unlinkA
        V=$(kvbroker kvs link -s $D.fooA $D.linkB)
        t on 2 kvbroker kvs wait $V
        t on 2 kvbroker kvs get $D.linkB
        kvbroker kvs namespace create rywtestns
        t on 1 kvbroker kvs put --namespace=rywtestns $D.test=1
        t on 1 kvbroker kvs put --namespace=rywtestns $D.test=2
        t on 1 kvbroker kvs get --namespace=rywtestns $D.test
        V=$(on 1 kvbroker kvs version --namespace=rywtestns)
        t kvbroker exec -r all -n sh -c "kvbroker kvs wait --namespace=rywtestns $V && kvbroker kvs get --namespace=rywtestns $D.test"
        t kvbroker kvs namespace remove rywtestns
        t kvbroker kvs sync
        """)
    assert out == expect("""
        $ kvbroker exec -r all -n sh -c kvbroker kvs wait 1 && kvbroker kvs get test.a.b.xxx
        99
        99
        99
        $ kvbroker exec -r all -n sh -c kvbroker kvs wait 2 && ! kvbroker kvs get test.a.b.xxx 2>/dev/null
        $ on 1 kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} test.a.b.testA
        1
        $ on 1 kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} test.a.b.dirA
        kvbroker: test.a.b.dirA: Is a directory (...)
        [rc=1]
        $ on 1 kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} test.a.b.linkA
        3
        $ on 1 kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} test.a.b.unlinkA
        kvbroker: test.a.b.unlinkA: No such file or directory
        [rc=1]
        $ on 2 kvbroker kvs wait 8
        $ on 2 kvbroker kvs get test.a.b.linkB
        3
        $ on 1 kvbroker kvs put --namespace=rywtestns test.a.b.test=1
        $ on 1 kvbroker kvs put --namespace=rywtestns test.a.b.test=2
        $ on 1 kvbroker kvs get --namespace=rywtestns test.a.b.test
        2
        $ kvbroker exec -r all -n sh -c kvbroker kvs wait --namespace=rywtestns 2 && kvbroker kvs get --namespace=rywtestns test.a.b.test
        2
        2
        2
        $ kvbroker kvs namespace remove rywtestns
        $ kvbroker kvs sync
        """)
