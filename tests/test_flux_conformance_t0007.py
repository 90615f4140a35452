# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t0007-ping.t: ``kvbroker ping`` on the command line.

Flux floods the local connector with padded pings given as ``--pad 10K``
or ``--pad 1M`` and ``--interval 0``: both were usage errors here (the pad
took bytes only, there was no interval).  Also pinned: the line's shape
(``time=N.NNN ms``), a rank out of the instance failing with ``No route to
host`` (exit 1), the local rank by default, and Flux's TARGET words
``any`` (the rank attached to) and ``upstream`` (its parent; none on rank
0: ``No route to host``), which were usage errors; a pad too big for
``broker.max-message`` with the ping's header (``-p 1G`` by default: the
help and docs/cli.md said "at most 1G") is ``Message too long``, exit 1.
A host name or a service as TARGET have no counterpart.
"""

from __future__ import annotations

from test_kvs_cli import expect, sh


async def test_t0007_ping(start_instance) -> None:
    inst = await start_instance(size=2)
    out = await sh(inst, r"""
        p() { sed -e 's/ route=c[0-9]*!/ route=cN!/' -e 's/ time=[0-9]*\.[0-9][0-9][0-9] ms$/ time=T ms/'; }
        tp() { printf '$ %s\n' "$*"; "$@" 2>&1 | p; }  # (t, the times made T)
        t sh -c 'kvbroker ping --pad 1024 --count 200 --interval 0 0 | wc -l'
        t sh -c 'kvbroker ping --pad 10K --count 20 -i 0 1 | wc -l'
        tp kvbroker ping --pad 1M --count 3 --interval 0 0
        tp kvbroker ping -p 1k -c 2 -i 10ms 1
        tp on 1 kvbroker ping --count 1
        t kvbroker ping --count 1 2
        tp on 1 kvbroker ping upstream
        tp on 1 kvbroker ping any
        t kvbroker ping upstream
        t sh -c 'kvbroker ping bogus 2>&1 | tail -1'
        t sh -c 'kvbroker ping --pad 2G 0 2>&1 | tail -1'
        t kvbroker start -S broker.max-message=4096 -- kvbroker ping -p 4K 0
        t sh -c 'kvbroker ping --interval=-1 0 2>&1 | tail -1'
        """)
    assert out == expect("""
        $ sh -c kvbroker ping --pad 1024 --count 200 --interval 0 0 | wc -l
        200
        $ sh -c kvbroker ping --pad 10K --count 20 -i 0 1 | wc -l
        20
        $ kvbroker ping --pad 1M --count 3 --interval 0 0
        rank=0 route=cN!r0 seq=0 time=T ms
        rank=0 route=cN!r0 seq=1 time=T ms
        rank=0 route=cN!r0 seq=2 time=T ms
        $ kvbroker ping -p 1k -c 2 -i 10ms 1
        rank=1 route=cN!r0!r1 seq=0 time=T ms
        rank=1 route=cN!r0!r1 seq=1 time=T ms
        $ on 1 kvbroker ping --count 1
        rank=1 route=cN!r1 seq=0 time=T ms
        $ kvbroker ping --count 1 2
        kvbroker: ping: No route to host (...)
        [rc=1]
        $ on 1 kvbroker ping upstream
        rank=0 route=cN!r1!r0 seq=0 time=T ms
        $ on 1 kvbroker ping any
        rank=1 route=cN!r1 seq=0 time=T ms
        $ kvbroker ping upstream
        kvbroker: ping: No route to host (...)
        [rc=1]
        $ sh -c kvbroker ping bogus 2>&1 | tail -1
        kvbroker ping: error: argument RANK: not a rank, 'any' or 'upstream': 'bogus'
        $ sh -c kvbroker ping --pad 2G 0 2>&1 | tail -1
        kvbroker ping: error: argument --pad/-p: must be at most 1073741824: 2G
        $ kvbroker start -S broker.max-message=4096 -- kvbroker ping -p 4K 0
        kvbroker: ping: Message too long (...)
        [rc=1]
        $ sh -c kvbroker ping --interval=-1 0 2>&1 | tail -1
        kvbroker ping: error: argument --interval/-i: '-1' is not a duration (e.g. 2, 0.5s, 30m)
        """)
