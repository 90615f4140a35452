# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t1005-kvs-security.t, the shapes not pinned elsewhere.

Flux fakes a user with ``FLUX_HANDLE_USERID``; here two real guests run
``kvbroker`` under uids 65534 (``U``, Flux's 9999: owns namespace
``nsuser``) and 65533 (``W``, Flux's 9000: the wrong user), dropping to
their uid before they connect, so the broker learns it from SO_PEERCRED.
tests/test_kvs_cli.py ``test_guest`` and tests/test_kvs_rpc_security.py
pin the rest (one guest, and every case over raw RPCs); this file adds,
on the command line: the wrong user on another guest's namespace on both
ranks, ``--at`` a root of it (refused: a documented departure), a guest's
``kvs wait`` in its own namespace, each tree object a guest may not put
(``Operation not permitted``), a guest's ``link`` through rank 1, and a
guest's ``stats kvs`` / ``stats kvs-watch``.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys

import pytest
from test_broker_support import GUEST_CLI_PRELOAD, GUEST_IMPORT_GUARD, wait_until
from test_kvs_cli import client_env, expect, run, sh

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guest")
T = 30

# As test_kvs_cli's wrapper, with the uid from $GUEST_UID: the interpreter and
# the checkout may be unreadable to the guest, so it imports the CLI as root
# and drops to the uid before it connects.
_WRAPPER = (
    "import os, sys, json, base64, time, signal, datetime, shutil, textwrap\n"
    "from broker import cli\n"
    + GUEST_CLI_PRELOAD +
    "import kvs.cli, kvs.client, kvs.eventlog, kvs_watch.cli, kvs_watch.client\n"
    "parser = cli.build_parser()\n"
    "cli.build_parser = lambda *_: parser  # entry points are unreadable after the drop\n"
    "uid = int(os.environ.pop('GUEST_UID'))\n"
    "os.setgroups([]); os.setgid(uid); os.setuid(uid)\n"
    + GUEST_IMPORT_GUARD +
    "sys.argv[0] = 'kvbroker'\n"
    "sys.exit(cli.main(sys.argv[1:]))\n"
)
GUEST = f"{shlex.quote(sys.executable)} -c {shlex.quote(_WRAPPER)}"


async def test_t1005_guests_on_the_command_line(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs={"access.allow-guest-user": "true"})
    out = await sh(inst, f"""
        U() {{ shift; GUEST_UID=65534 {GUEST} "$@"; }}
        W() {{ shift; GUEST_UID=65533 {GUEST} "$@"; }}
        kvbroker kvs namespace create -o 65534 nsuser
        kvbroker kvs put -N nsuser k=2
        t W kvbroker kvs put -N nsuser k=1
        t W kvbroker kvs get -N nsuser k
        t on 1 W kvbroker kvs get -N nsuser k
        t on 1 W kvbroker kvs version -N nsuser
        t W kvbroker kvs wait -N nsuser 1
        t on 1 U kvbroker kvs version -N nsuser
        t on 1 U kvbroker kvs get -N nsuser k
        REF=$(U kvbroker kvs get -N nsuser -t .)
        t U kvbroker kvs get -N nsuser --at "$REF" k
        W kvbroker kvs get -N nsuser --at "$REF" k 2>&1 | grep -c 'Operation not permitted'
        t U kvbroker kvs namespace remove nsuser
        t U kvbroker kvs put -t -N nsuser 'cc={{"data":"Yg==","type":"val","ver":1}}'
        t U kvbroker kvs get -N nsuser cc
        t U kvbroker kvs put -t -N nsuser 'y={{"data":{{"target":"x"}},"type":"symlink","ver":1}}'
        t U kvbroker kvs put -t -N nsuser 'z={{"data":["sha1-8727ddf86fd56772f4ed38703d24d93e9d9e7fa6"],"type":"valref","ver":1}}'
        t U kvbroker kvs put -t -N nsuser 'z={{"data":["sha1-8727ddf86fd56772f4ed38703d24d93e9d9e7fa6"],"type":"dirref","ver":1}}'
        t U kvbroker kvs put -t -N nsuser 'q={{"data":{{"b":{{"data":"NDI=","type":"val","ver":1}}}},"type":"dir","ver":1}}'
        t U kvbroker kvs put -t -N nsuser 'qq={{"data":{{"b":{{"data":{{"target":"x"}},"type":"symlink","ver":1}}}},"type":"dir","ver":1}}'
        t on 1 kvbroker kvs link -N nsuser e f
        t on 1 U kvbroker kvs link -N nsuser g h
        U kvbroker stats kvs >/dev/null && echo stats kvs ok
        U kvbroker stats kvs-watch >/dev/null && echo stats kvs-watch ok
        t kvbroker kvs dir -N nsuser
        """)
    assert out == expect("""
        $ W kvbroker kvs put -N nsuser k=1
        kvbroker: k: Operation not permitted (...)
        [rc=1]
        $ W kvbroker kvs get -N nsuser k
        kvbroker: k: Operation not permitted (...)
        [rc=1]
        $ on 1 W kvbroker kvs get -N nsuser k
        kvbroker: k: Operation not permitted (...)
        [rc=1]
        $ on 1 W kvbroker kvs version -N nsuser
        kvbroker: kvs version: Operation not permitted (...)
        [rc=1]
        $ W kvbroker kvs wait -N nsuser 1
        kvbroker: kvs wait: Operation not permitted (...)
        [rc=1]
        $ on 1 U kvbroker kvs version -N nsuser
        1
        $ on 1 U kvbroker kvs get -N nsuser k
        2
        $ U kvbroker kvs get -N nsuser --at {"data":["REF"],"type":"dirref","ver":1} k
        2
        1
        $ U kvbroker kvs namespace remove nsuser
        kvbroker: nsuser: Operation not permitted (...)
        [rc=1]
        $ U kvbroker kvs put -t -N nsuser cc={"data":"Yg==","type":"val","ver":1}
        $ U kvbroker kvs get -N nsuser cc
        b
        $ U kvbroker kvs put -t -N nsuser y={"data":{"target":"x"},"type":"symlink","ver":1}
        kvbroker: y: Operation not permitted (...)
        [rc=1]
        $ U kvbroker kvs put -t -N nsuser z={"data":["REF"],"type":"valref","ver":1}
        kvbroker: z: Operation not permitted (...)
        [rc=1]
        $ U kvbroker kvs put -t -N nsuser z={"data":["REF"],"type":"dirref","ver":1}
        kvbroker: z: Operation not permitted (...)
        [rc=1]
        $ U kvbroker kvs put -t -N nsuser q={"data":{"b":{"data":"NDI=","type":"val","ver":1}},"type":"dir","ver":1}
        kvbroker: q: Operation not permitted (...)
        [rc=1]
        $ U kvbroker kvs put -t -N nsuser qq={"data":{"b":{"data":{"target":"x"},"type":"symlink","ver":1}},"type":"dir","ver":1}
        kvbroker: qq: Operation not permitted (...)
        [rc=1]
        $ on 1 kvbroker kvs link -N nsuser e f
        $ on 1 U kvbroker kvs link -N nsuser g h
        kvbroker: h: Operation not permitted (...)
        [rc=1]
        stats kvs ok
        stats kvs-watch ok
        $ kvbroker kvs dir -N nsuser
        cc = b
        f -> e
        k = 2
        """)

    # "version & wait works (user)": the guest waits on rank 1 for the
    # version its own put (on rank 0) makes
    h1 = await connect(inst, 1)
    guest = ["sh", "-c", f'GUEST_UID=65534 {GUEST} "$@"', "guest"]
    v = int((await run([*guest, "kvs", "version", "-N", "nsuser"], client_env(inst.uri(1)))).out)
    waiting = asyncio.ensure_future(run([*guest, "kvs", "wait", "-N", "nsuser", str(v + 1)],
                                        client_env(inst.uri(1))))

    async def waits() -> bool:
        st = await asyncio.wait_for(h1.rpc("kvs.stats-get", {}), T)
        return st["namespaces"].get("nsuser", {}).get("waiters", 0) == 1

    await wait_until(waits, "the guest's wait on rank 1", T)
    assert not waiting.done()
    res = await run([*guest, "kvs", "put", "-N", "nsuser", "xxx=99"], client_env(inst.uri(0)))
    assert res.rc == 0, res.err
    res = await asyncio.wait_for(waiting, T)
    assert (res.rc, res.out, res.err) == (0, b"", "")
