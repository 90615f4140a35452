# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t1000-kvs.t, the cases tests/test_kvs_cli.py does not
already pin, on a real instance (the audit that chose them: docs/kvs.md,
"Differences from flux kvs", and the conformance notes in the commit).

Each script runs attached to rank 1, so every read through a link into
another namespace makes that rank fetch the namespace's root from rank 0.
"""

from __future__ import annotations

import json

from test_kvs_cli import KVB, client_env, expect, run, sh


async def test_dirs_treeobjs_and_links_as_t1000(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, """
        D=test.a.b
        # 'flux kvs dir can display a UTF-8 key' (also where the locale is C)
        kvbroker kvs put ƒuzzybunny=42
        t kvbroker kvs dir
        LC_ALL=C t kvbroker kvs dir
        kvbroker kvs unlink ƒuzzybunny
        # 'empty directory remains after key removed'
        kvbroker kvs put $D.a=1
        t kvbroker kvs unlink $D.a
        t kvbroker kvs dir -R $D
        t kvbroker kvs ls -F test.a
        # 'unlink works on link that points to invalid namespace'
        kvbroker kvs put $D.foo=1
        kvbroker kvs link --target-namespace=invalid $D.foo $D.link
        t kvbroker kvs unlink $D.link
        # 'treeobj of all types handled by get --treeobj'
        kvbroker kvs unlink -Rf $D
        kvbroker kvs put $D.val=hello $D.valref=$(seq -s 1 100)
        kvbroker kvs mkdir $D.dirref
        kvbroker kvs link foo $D.symlink
        kvbroker kvs link --target-namespace=A bar $D.symlinkNS
        for k in val valref dirref symlink symlinkNS; do
            printf '%s %s\\n' $k "$(kvbroker kvs get --treeobj $D.$k | grep -o '"type":"[a-z]*"')"
        done
        t kvbroker kvs get --treeobj $D.symlinkNS
        # 'put --treeobj: clobbers destination'
        kvbroker kvs unlink -Rf $D
        kvbroker kvs put $D.a=42
        kvbroker kvs put --treeobj $D.a="$(kvbroker kvs get --treeobj .)"
        t kvbroker kvs get $D.a
        t kvbroker kvs dir $D.a
        # 'put --treeobj: fails bad dirent': link data, ref data not a list
        t kvbroker kvs put --treeobj $D.a='{"data":42,"type":"symlink","ver":1}'
        t kvbroker kvs put --treeobj $D.a='{"data":"sha1-4087718d190b373fb490b27873f61552d7f29dbe","type":"dirref","ver":1}'
        # 'link: copy does not follow links (mid)' and '(bottom)'
        kvbroker kvs unlink -Rf $D
        kvbroker kvs put $D.a.b.X=42
        kvbroker kvs link $D.a.b $D.a.link
        kvbroker kvs link $D.a.b.X $D.a.b.link
        t kvbroker kvs copy $D.a $D.copy
        t kvbroker kvs readlink $D.copy.link $D.copy.b.link
        # 'link: dangling link', 'readlink on dangling link', and a path through one
        kvbroker kvs unlink -Rf $D
        t kvbroker kvs link $D.dangle $D.a.b.c
        t kvbroker kvs readlink $D.a.b.c
        t kvbroker kvs get $D.a.b.c
        t kvbroker kvs link $D.q.r $D.Z.Y
        t kvbroker kvs get $D.Z.Y
        """, rank=1)
    assert out == expect("""
        $ kvbroker kvs dir
        ƒuzzybunny = 42
        $ kvbroker kvs dir
        ƒuzzybunny = 42
        $ kvbroker kvs unlink test.a.b.a
        $ kvbroker kvs dir -R test.a.b
        $ kvbroker kvs ls -F test.a
        b.
        $ kvbroker kvs unlink test.a.b.link
        val "type":"val"
        valref "type":"valref"
        dirref "type":"dirref"
        symlink "type":"symlink"
        symlinkNS "type":"symlink"
        $ kvbroker kvs get --treeobj test.a.b.symlinkNS
        {"data":{"namespace":"A","target":"bar"},"type":"symlink","ver":1}
        $ kvbroker kvs get test.a.b.a
        kvbroker: test.a.b.a: Is a directory (...)
        [rc=1]
        $ kvbroker kvs dir test.a.b.a
        test.a.b.a.test.
        $ kvbroker kvs put --treeobj test.a.b.a={"data":42,"type":"symlink","ver":1}
        kvbroker: test.a.b.a: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs put --treeobj test.a.b.a={"data":"REF","type":"dirref","ver":1}
        kvbroker: test.a.b.a: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs copy test.a.b.a test.a.b.copy
        $ kvbroker kvs readlink test.a.b.copy.link test.a.b.copy.b.link
        test.a.b.a.b
        test.a.b.a.b.X
        $ kvbroker kvs link test.a.b.dangle test.a.b.a.b.c
        $ kvbroker kvs readlink test.a.b.a.b.c
        test.a.b.dangle
        $ kvbroker kvs get test.a.b.a.b.c
        kvbroker: test.a.b.a.b.c: No such file or directory
        [rc=1]
        $ kvbroker kvs link test.a.b.q.r test.a.b.Z.Y
        $ kvbroker kvs get test.a.b.Z.Y
        kvbroker: test.a.b.Z.Y: No such file or directory
        [rc=1]
        """)


async def test_links_across_namespaces_as_t1000(start_instance) -> None:
    """t1000's 'symlink w/ Namespace' and 'symlinkNS:' cases, and 'readlink
    --at works after symlink w/ Namespace unlinked'."""
    inst = await start_instance(size=2)
    out = await sh(inst, """
        D=test.a.b
        NS=TESTSYMLINKNS
        kvbroker kvs namespace create $NS
        kvbroker kvs put --namespace=$NS $D.target1=foo1 $D.target2=foo2 $D.a.b.c=42
        kvbroker kvs link --target-namespace=$NS $D.target1 $D.symlinkNS1
        kvbroker kvs link --target-namespace=$NS $D.target2 $D.symlinkNS2
        t kvbroker kvs get $D.symlinkNS1
        t kvbroker kvs readlink $D.symlinkNS1 $D.symlinkNS2
        kvbroker kvs put $D.target1=here
        kvbroker kvs link --target-namespace=$NS-FAKE $D.target1 $D.fake
        t kvbroker kvs get $D.fake
        t kvbroker kvs readlink $D.fake
        # a link as an intermediate path component
        kvbroker kvs link --target-namespace=$NS $D.a.b $D.Z.Y
        t kvbroker kvs get $D.Z.Y.c
        # ... to a link in the other namespace, naming its own namespace or none
        kvbroker kvs link --namespace=$NS --target-namespace=$NS $D.a.b $D.N.M
        kvbroker kvs link --namespace=$NS $D.a.b $D.P.Q
        kvbroker kvs link --target-namespace=$NS $D.N.M $D.X.W
        kvbroker kvs link --target-namespace=$NS $D.P.Q $D.U.V
        t kvbroker kvs get $D.X.W.c $D.U.V.c
        # 'symlinkNS: put cant cross namespace'
        kvbroker kvs mkdir --namespace=$NS $D.dir
        kvbroker kvs link --target-namespace=$NS $D.dir $D.link
        t kvbroker kvs put $D.link.X=42
        t kvbroker kvs dir --namespace=$NS $D.dir
        # 'readlink --at works after symlink w/ Namespace unlinked'
        kvbroker kvs link --target-namespace=foo $D.a.b.X $D.a.b.link
        ROOTREF=$(kvbroker kvs get --treeobj .)
        kvbroker kvs unlink -R $D
        t kvbroker kvs readlink --at "$ROOTREF" $D.a.b.link
        t kvbroker kvs namespace remove $NS
        t kvbroker kvs get --at "$ROOTREF" $D.symlinkNS1
        """, rank=1)
    assert out == expect("""
        $ kvbroker kvs get test.a.b.symlinkNS1
        foo1
        $ kvbroker kvs readlink test.a.b.symlinkNS1 test.a.b.symlinkNS2
        TESTSYMLINKNS::test.a.b.target1
        TESTSYMLINKNS::test.a.b.target2
        $ kvbroker kvs get test.a.b.fake
        kvbroker: test.a.b.fake: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs readlink test.a.b.fake
        TESTSYMLINKNS-FAKE::test.a.b.target1
        $ kvbroker kvs get test.a.b.Z.Y.c
        42
        $ kvbroker kvs get test.a.b.X.W.c test.a.b.U.V.c
        42
        42
        $ kvbroker kvs put test.a.b.link.X=42
        kvbroker: test.a.b.link.X: Invalid argument (...)
        [rc=1]
        $ kvbroker kvs dir --namespace=TESTSYMLINKNS test.a.b.dir
        $ kvbroker kvs readlink --at {"data":["REF"],"type":"dirref","ver":1} test.a.b.a.b.link
        foo::test.a.b.a.b.X
        $ kvbroker kvs namespace remove TESTSYMLINKNS
        $ kvbroker kvs get --at {"data":["REF"],"type":"dirref","ver":1} test.a.b.symlinkNS1
        kvbroker: test.a.b.symlinkNS1: Operation not supported (...)
        [rc=1]
        """)
    # 'no pending requests at end of tests': on the rank the clients used, and rank 0
    for rank in (0, 1):
        res = await run([KVB, "stats", "kvs"], client_env(inst.uri(rank)))
        assert res.rc == 0 and json.loads(res.out)["rpcs-pending"] == 0, (rank, res.text)
