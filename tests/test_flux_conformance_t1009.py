# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t1009-kvs-copy.t, the cases tests/test_kvs_cli.py's
``test_copy_move`` does not already pin, on a real instance.

Flux's file: copy and move of a value and of a directory, within
``primary``, from another namespace (``--src-namespace``) and to one
(``--dst-namespace``), and the failures: a missing argument, a missing
source key, a source or destination namespace that does not exist.
Here also: a copy or move that fails changes nothing (a move into a
namespace that does not exist must not lose its source, since across
namespaces the copy and the unlink are two commits).
"""

from __future__ import annotations

import json

from test_kvs_cli import KVB, client_env, expect, run, sh


async def test_copy_move_values_dirs_and_namespaces_as_t1009(start_instance) -> None:
    inst = await start_instance(size=1)
    out = await sh(inst, """
        kvbroker kvs put test.src=foo
        t kvbroker kvs copy test.src test.dst
        t kvbroker kvs get test.src test.dst
        kvbroker kvs put test.msrc=bar
        t kvbroker kvs move test.msrc test.mdst
        t kvbroker kvs get test.msrc
        t kvbroker kvs get test.mdst
        kvbroker kvs put test.dsrc.a.b.c=foo
        t kvbroker kvs copy test.dsrc test.ddst
        t kvbroker kvs get test.dsrc.a.b.c test.ddst.a.b.c
        t kvbroker kvs move test.dsrc test.dmv
        t kvbroker kvs get --treeobj test.dsrc
        t kvbroker kvs get test.dmv.a.b.c
        kvbroker kvs namespace create fromns tons
        kvbroker kvs put --namespace=fromns f.src=foo f.dir.a.b.c=foo
        t kvbroker kvs copy --src-namespace=fromns f.src f.dst
        t kvbroker kvs get --namespace=fromns f.src
        t kvbroker kvs get f.dst
        t kvbroker kvs move --src-namespace=fromns f.dir f.moved
        t kvbroker kvs get --namespace=fromns --treeobj f.dir
        t kvbroker kvs get f.moved.a.b.c
        t kvbroker kvs copy --dst-namespace=tons test.src to.dst
        t kvbroker kvs get --namespace=tons to.dst
        t kvbroker kvs move --dst-namespace=tons test.ddst to.moved
        t kvbroker kvs get --treeobj test.ddst
        t kvbroker kvs get --namespace=tons to.moved.a.b.c
        t kvbroker kvs copy foo
        t kvbroker kvs move foo
        t kvbroker kvs copy test.notakey foo
        t kvbroker kvs move test.notakey foo
        t kvbroker kvs copy --src-namespace=nons test.src foo
        t kvbroker kvs move --src-namespace=nons test.src foo
        t kvbroker kvs copy --dst-namespace=nons test.src test.src
        t kvbroker kvs move --dst-namespace=nons test.src test.src
        t kvbroker kvs move --dst-namespace=nons test.dmv test.dmv
        t kvbroker kvs get foo
        t kvbroker kvs get test.src test.dmv.a.b.c
        """)
    usage = {name: f"usage: kvbroker kvs {name} [-h] [-N NS] [-S NS] [-D NS] SRC DST\n"
                   f"kvbroker kvs {name}: error: the following arguments are required: DST\n"
             for name in ("copy", "move")}
    assert out == expect("""
        $ kvbroker kvs copy test.src test.dst
        $ kvbroker kvs get test.src test.dst
        foo
        foo
        $ kvbroker kvs move test.msrc test.mdst
        $ kvbroker kvs get test.msrc
        kvbroker: test.msrc: No such file or directory
        [rc=1]
        $ kvbroker kvs get test.mdst
        bar
        $ kvbroker kvs copy test.dsrc test.ddst
        $ kvbroker kvs get test.dsrc.a.b.c test.ddst.a.b.c
        foo
        foo
        $ kvbroker kvs move test.dsrc test.dmv
        $ kvbroker kvs get --treeobj test.dsrc
        kvbroker: test.dsrc: No such file or directory
        [rc=1]
        $ kvbroker kvs get test.dmv.a.b.c
        foo
        $ kvbroker kvs copy --src-namespace=fromns f.src f.dst
        $ kvbroker kvs get --namespace=fromns f.src
        foo
        $ kvbroker kvs get f.dst
        foo
        $ kvbroker kvs move --src-namespace=fromns f.dir f.moved
        $ kvbroker kvs get --namespace=fromns --treeobj f.dir
        kvbroker: f.dir: No such file or directory
        [rc=1]
        $ kvbroker kvs get f.moved.a.b.c
        foo
        $ kvbroker kvs copy --dst-namespace=tons test.src to.dst
        $ kvbroker kvs get --namespace=tons to.dst
        foo
        $ kvbroker kvs move --dst-namespace=tons test.ddst to.moved
        $ kvbroker kvs get --treeobj test.ddst
        kvbroker: test.ddst: No such file or directory
        [rc=1]
        $ kvbroker kvs get --namespace=tons to.moved.a.b.c
        foo
        $ kvbroker kvs copy foo
        """) + usage["copy"] + expect("""
        [rc=2]
        $ kvbroker kvs move foo
        """) + usage["move"] + expect("""
        [rc=2]
        $ kvbroker kvs copy test.notakey foo
        kvbroker: copy: No such file or directory (...)
        [rc=1]
        $ kvbroker kvs move test.notakey foo
        kvbroker: move: No such file or directory (...)
        [rc=1]
        $ kvbroker kvs copy --src-namespace=nons test.src foo
        kvbroker: copy: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs move --src-namespace=nons test.src foo
        kvbroker: move: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs copy --dst-namespace=nons test.src test.src
        kvbroker: copy: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs move --dst-namespace=nons test.src test.src
        kvbroker: move: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs move --dst-namespace=nons test.dmv test.dmv
        kvbroker: move: Operation not supported (...)
        [rc=1]
        $ kvbroker kvs get foo
        kvbroker: foo: No such file or directory
        [rc=1]
        $ kvbroker kvs get test.src test.dmv.a.b.c
        foo
        foo
        """)
    # t1009's last case: no request is left pending in the kvs module
    res = await run([KVB, "stats", "kvs"], client_env(inst.uri(0)))
    assert res.rc == 0 and json.loads(res.out)["rpcs-pending"] == 0, res.text + res.err
