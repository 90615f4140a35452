# ruff: noqa: E501  (expected transcripts keep the commands' long lines whole)
"""flux-core t/t0004-event.t: ``kvbroker event pub/sub`` on the command line.

Pinned: events published on rank 0 and on the last rank reach a
subscriber on rank 0 whole and in order (``t1.foo`` ... ``t1.eof``);
``pub`` with no payload, a JSON one, ``-p`` (private) and ``-l``
(loopback: wait until the event comes back to this rank) -- ``-p`` and
``-l`` were usage errors; an ``event.pub`` request without a payload is
``EPROTO``, as Flux's ``event.publish``.  Flux's ``-r`` (a raw payload)
and ``-s`` (print ``seq=N``) have no counterpart: payloads are JSON, and
``pub`` always waits for the sequence number (``-v`` prints it).  The
heartbeat module does not exist here.
"""

from __future__ import annotations

import asyncio
import os

from test_broker_support import KVBROKER, client_subscriptions, stats, wait_until
from test_kvs_cli import expect, sh


async def test_t0004_events(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    st = await stats(h, 0)
    before, subs = st["clients"], client_subscriptions(st)
    sub = await asyncio.create_subprocess_exec(
        KVBROKER, "event", "sub", "--count", "8", "t1.", "t2.", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ, KVBROKER_URI=inst.uri(0)))
    try:
        async with asyncio.timeout(60):
            async def subscribed() -> bool:
                # (the client's own two: rank 0's modules hold two already)
                s = await stats(h, 0)
                return (s["clients"] == before + 1 and client_subscriptions(s) >= subs + 2) \
                    or sub.returncode is not None

            await wait_until(subscribed, "kvbroker event sub to subscribe", timeout=20)
            out = await sh(inst, """
                for s in foo bar baz eof; do kvbroker event pub t1.$s; done
                for s in foo bar baz; do on 1 kvbroker event pub t2.$s; done
                on 1 kvbroker event pub t2.eof '{"last": [1, "x"]}'
                t kvbroker event pub -l foo.bar
                t kvbroker event pub -l foo.bar {}
                t kvbroker event pub -p -l foo.bar {}
                t on 1 kvbroker event pub -p -l foo.bar '"x"'
                t on 1 kvbroker event pub --loopback --private foo.bar
                t sh -c 'kvbroker event pub -v -l foo.bar | grep -cx "[0-9][0-9]*"'
                t kvbroker rpc event.pub
                """)
            assert out == expect("""
                $ kvbroker event pub -l foo.bar
                $ kvbroker event pub -l foo.bar {}
                $ kvbroker event pub -p -l foo.bar {}
                $ on 1 kvbroker event pub -p -l foo.bar "x"
                $ on 1 kvbroker event pub --loopback --private foo.bar
                $ sh -c kvbroker event pub -v -l foo.bar | grep -cx "[0-9][0-9]*"
                1
                $ kvbroker rpc event.pub
                kvbroker: event.pub: Protocol error (...)
                [rc=1]
                """)
            got, err = await sub.communicate()
        assert sub.returncode == 0, err
        assert got.decode().splitlines() == [
            "t1.foo\tnull", "t1.bar\tnull", "t1.baz\tnull", "t1.eof\tnull",
            "t2.foo\tnull", "t2.bar\tnull", "t2.baz\tnull", 't2.eof\t{"last": [1, "x"]}']
    finally:
        if sub.returncode is None:
            sub.kill()
            await sub.wait()
