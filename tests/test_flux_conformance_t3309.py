"""flux-core t/t3309-system-reconnect.t (a handle that reconnects when the
rank it is attached to restarts) against real kvbroker ranks: rank 0 and
rank 1 of a 2-rank instance from a bootstrap file (``kvbroker broker``,
as under systemd), rank 1 on a fixed run directory so that its socket
comes back at the same path (tests/test_handle_reconnect.py's
``Restartable``).  Flux stops rank 1 with SIGTERM (``startctl kill 1
15``) and runs it again; so do these tests.

Flux's cases, in order, and what each becomes:

1.  'flux-proxy works on rank 1 broker' (``flux proxy URI flux getattr
    instance-level``) -> kvbroker has no ``proxy`` (commands attach with
    ``KVBROKER_URI``, ``ssh://`` from another host) nor the
    ``instance-level`` attribute: ``kvbroker attr get rank`` attached to
    rank 1 prints 1 (:func:`test_a_reconnecting_client_outlives_a_sigterm_restart`).
2.  'flux-proxy --reconnect survives broker restart' (a getattr, rank 1
    SIGTERMed, waited for, run again, a getattr on the same connection) ->
    a ``Handle.connect(reconnect=True)`` (as ``flux proxy --reconnect``,
    docs/api.md "Reconnecting") reads an attribute before and after rank
    1's SIGTERM restart, one connection made again.  (The same after a
    SIGKILL, and over ``ssh://``, is in tests/test_handle_reconnect.py.)
3.  'handle purges RPCs pending across broker restart' (``flux kvs get
    --waitcreate notakey`` pending through the restart fails with
    "Connection reset by peer"; then a getattr works) -> on that handle a
    pending one-shot request fails ECONNRESET and the handle goes on
    (:func:`test_a_pending_request_is_failed_across_a_sigterm_restart`);
    and the command: ``kvbroker kvs get --waitcreate notakey`` attached to
    rank 1 fails, exit 1
    (:func:`test_a_waitcreate_command_fails_when_its_rank_restarts`).
    Deliberate difference (docs/api.md "Reconnecting"): a rank stopped on
    purpose (SIGTERM) first ends its pending watches with ENOSYS, "the
    watch ended: this rank is stopping (signal SIGTERM)" -- so the handle
    fails with that, not ECONNRESET; Flux's "Connection reset by peer" is
    what a killed rank (SIGKILL) gives, checked too.
    With ``--reconnect`` (a kvbroker extension) the wait goes on instead,
    documented in docs/cli.md "kvs" (tested in test_handle_reconnect.py).
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, wait_until
from test_handle_reconnect import Restartable
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)

from broker.errors import RemoteError
from broker.handle import Handle

T = 60.0


@pytest.fixture
async def inst(tmp_path: Path, brokers) -> Restartable:  # noqa: F811
    return await Restartable(tmp_path, brokers).start()


async def test_a_reconnecting_client_outlives_a_sigterm_restart(inst: Restartable) -> None:
    """Cases 1 and 2."""
    async with asyncio.timeout(T):
        rc, out, err = await run_cli("attr", "get", "rank", uri=inst.uri1)
        assert (rc, out) == (0, "1\n"), err
        async with Handle.connect(inst.uri1, reconnect=True) as h:
            assert await h.attr_get("rank") == 1
            await inst.stop_rank1("term")
            await inst.start_rank1()
            assert await h.attr_get("rank") == 1
            assert h.connected and h.reconnects == 1


async def test_a_pending_request_is_failed_across_a_sigterm_restart(inst: Restartable) -> None:
    """Case 3, on the handle: a one-shot ``kvs-watch.lookup`` WAITCREATE of a
    key nobody makes, in flight when rank 1 stops on SIGTERM, fails (it is
    purged, not left waiting for ever); the handle then serves again."""
    async with asyncio.timeout(T), Handle.connect(inst.uri1, reconnect=True) as h:
        pending = h.rpc("kvs-watch.lookup", {"namespace": "primary", "key": "notakey",
                                             "flags": 8})  # WAITCREATE
        await h.ping()  # (the lookup is in before the ping's answer)
        await inst.stop_rank1("term")
        with pytest.raises(RemoteError) as info:
            await pending
        assert (info.value.errnum, info.value.errstr) == (
            errno.ENOSYS, "the watch ended: this rank is stopping (signal SIGTERM)")
        await inst.start_rank1()
        assert await h.attr_get("rank") == 1


STOPPED = {
    "term": b"kvbroker: notakey: Function not implemented (the watch ended: this rank is "
            b"stopping (signal SIGTERM))\n",
    "kill": b"kvbroker: notakey: Connection reset by peer (connection to broker lost)\n",
}


@pytest.mark.parametrize("how", ["term", "kill"])
async def test_a_waitcreate_command_fails_when_its_rank_restarts(inst: Restartable,
                                                                 how: str) -> None:
    """Case 3, the command: ``kvbroker kvs get --waitcreate notakey`` on rank
    1, which stops: exit 1, saying why -- stopped on purpose (SIGTERM),
    the rank's own words (ENOSYS, "this rank is stopping", docs/api.md);
    killed, Flux's "Connection reset by peer" -- and rank 1, run again,
    answers."""
    async with asyncio.timeout(T):
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "kvs", "get", "--waitcreate", "notakey",
            env={**os.environ, "KVBROKER_URI": inst.uri1}, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            async with Handle.connect(inst.rank0.uri) as h0:
                async def waiting() -> bool:
                    st = await h0.rpc("kvs-watch.stats-get", {}, nodeid=1)
                    return bool(st["watchers"] >= 1)

                await wait_until(waiting, "rank 1 to hold the wait", T)
            inst.rank1.proc.send_signal(signal.SIGTERM if how == "term" else signal.SIGKILL)
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert (proc.returncode, out, err) == (1, b"", STOPPED[how])
        assert await inst.rank1.proc.wait() == (0 if how == "term" else -signal.SIGKILL)
        await inst.start_rank1()
        rc, out, err = await run_cli("attr", "get", "rank", uri=inst.uri1)
        assert (rc, out) == (0, "1\n"), err
