# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t0008-attr.t: ``kvbroker attr get/list/set`` on the command line.

Pinned (all as Flux, but for the differences docs/cli.md gives): ``rank``
read, and refused to ``set`` on a running rank; an unknown name refused
by ``get`` and by ``set`` (Flux's ``setattr`` creates it: here every
attribute but four is fixed at start, and ``start -S`` keeps an unknown
name outside the owned prefixes, as docs/cli.md says); ``list`` shows
``rank`` with its value in the second column (``flux lsattr -v``); an
extra or a missing argument is a usage error (exit 2); ``attr.get`` and
``attr.set`` without a payload are ``EPROTO``; a bad ``log.level`` refused
on the fly.  Also t0009's ``start -S`` refusals of bad log settings.
"""

from __future__ import annotations

from test_kvs_cli import expect, sh


async def test_t0008_attributes(start_instance) -> None:
    inst = await start_instance(size=1)
    out = await sh(inst, r"""
        rc() { "$@" >/dev/null 2>&1; echo "rc=$?"; }
        t kvbroker attr get rank
        t kvbroker attr set rank 42
        t kvbroker attr get test.nonexist
        t kvbroker attr set unknown-foo bar
        t sh -c "kvbroker attr list | awk '/^rank / { print \$2 }'"
        t rc kvbroker attr list badarg
        t rc kvbroker attr get
        t rc kvbroker attr set log.level
        t kvbroker rpc attr.get
        t kvbroker rpc attr.set
        t kvbroker attr set log.level 8
        t kvbroker attr set log.level error
        t kvbroker attr get log.level
        t kvbroker start -S log.ring-size= -- true
        t kvbroker start -S log.ring-size=-1 -- true
        t kvbroker start -S log.ring-size=4xx -- true
        t kvbroker start -S log.timestamps=wrong -- true
        t kvbroker start -S unknownattr=abc -- kvbroker attr get unknownattr
        """)
    assert out == expect("""
        $ kvbroker attr get rank
        0
        $ kvbroker attr set rank 42
        kvbroker: attr set: Invalid argument (...)
        [rc=1]
        $ kvbroker attr get test.nonexist
        kvbroker: attr get: No such file or directory (...)
        [rc=1]
        $ kvbroker attr set unknown-foo bar
        kvbroker: attr set: No such file or directory (...)
        [rc=1]
        $ sh -c kvbroker attr list | awk '/^rank / { print $2 }'
        0
        $ rc kvbroker attr list badarg
        rc=2
        $ rc kvbroker attr get
        rc=2
        $ rc kvbroker attr set log.level
        rc=2
        $ kvbroker rpc attr.get
        kvbroker: attr.get: Protocol error (...)
        [rc=1]
        $ kvbroker rpc attr.set
        kvbroker: attr.set: Protocol error (...)
        [rc=1]
        $ kvbroker attr set log.level 8
        kvbroker: attr set: Invalid argument (...)
        [rc=1]
        $ kvbroker attr set log.level error
        $ kvbroker attr get log.level
        error
        $ kvbroker start -S log.ring-size= -- true
        kvbroker: start: log.ring-size: '' is not an integer
        [rc=2]
        $ kvbroker start -S log.ring-size=-1 -- true
        kvbroker: start: log.ring-size: -1 is below the minimum of 0
        [rc=2]
        $ kvbroker start -S log.ring-size=4xx -- true
        kvbroker: start: log.ring-size: '4xx' is not an integer
        [rc=2]
        $ kvbroker start -S log.timestamps=wrong -- true
        kvbroker: start: log.timestamps: unknown choice 'wrong' (choose from auto, always, never)
        [rc=2]
        $ kvbroker start -S unknownattr=abc -- kvbroker attr get unknownattr
        abc
        """)
