"""``kvbroker kvs lease run TTL -- COMMAND`` against real ranks: the command
holds a lease kept alive by the kvbroker process, sees its id in
``$KVBROKER_LEASE``, and its keys go when the command exits (revoked at
once), or within TTL when the kvbroker process is SIGKILLed (the command is
killed with it); the command's status is passed through, SIGTERM is passed
on to it, and a lease lost stops it.  docs/cli.md, "kvs lease".
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from test_cli_broker import alive, all_gone

from broker.errors import RemoteError
from kvs.client import KVS

T = 20.0
"""Time box for one step (a CLI start, an answer) on a loaded machine."""
MARGIN = 3.0
"""Seconds past a lease's ttl its keys may take to go (as test_kvs_leases)."""

HOLDER = """
import os, signal, sys
from kvs.client import SyncKVS

def stop(sig, frame):
    print("got", sig, flush=True)
    sys.exit(3)

signal.signal(signal.SIGTERM, stop)
with SyncKVS() as kvs:                     # $KVBROKER_URI, as the command was given
    kvs.put("lock", "held", lease=int(os.environ["KVBROKER_LEASE"]))
print("locked", os.environ["KVBROKER_LEASE"], os.getpid(), flush=True)
sys.stdin.readline()                       # hold it until told (or signalled)
sys.exit(int(sys.argv[1]))
"""


@contextlib.asynccontextmanager
async def lease_run(uri: str, ttl: float,
                    status: int = 0) -> AsyncIterator[asyncio.subprocess.Process]:
    """``kvbroker kvs lease run TTL -- python -c HOLDER STATUS`` on ``uri``'s
    rank; killed at the end of the block if it still runs, its command's
    input closed (it exits then, if it outlived lease run), and its output
    read to the end."""
    env = dict(os.environ, KVBROKER_URI=uri)
    env.pop("KVBROKER_LEASE", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", "kvs", "lease", "run", f"{ttl:g}", "--",
        sys.executable, "-c", HOLDER, str(status), env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # (the command's end, if it outlived lease run)
        if proc.returncode is None:
            proc.kill()
        # Read to the end of the output: a command that outlived lease run
        # holds the pipes until it reads EOF and exits, and pipes still open
        # when the test's loop closed failed its close (uvloop: EBUSY).
        await asyncio.wait_for(proc.communicate(), T)


async def ended(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """``proc``'s output, read to its end once it exits, its stdin left
    open: the command must end for the reason the test gives it, not of
    EOF on its input.  Not ``communicate()``: from Python 3.12 it closes
    stdin even with no input (CPython gh-83925), and the holder then read
    EOF and exited 0 before ``lease run``'s keepalive found its lease
    revoked (or before the SIGTERM passed on reached it)."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = await asyncio.wait_for(
        asyncio.gather(proc.stdout.read(), proc.stderr.read()), T)
    await asyncio.wait_for(proc.wait(), T)
    return out, err


async def locked(proc: asyncio.subprocess.Process) -> tuple[int, int]:
    """The holder's ``locked ID PID`` line: its lease id and its pid."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), T)
    word, lease_id, pid = line.split()
    assert word == b"locked", line
    return int(lease_id), int(pid)


async def _next(w: Any, timeout: float) -> Any:
    return await asyncio.wait_for(anext(w), timeout)


async def _gone(w: Any, timeout: float) -> None:
    """The watched key is unlinked within ``timeout``: the watch ends ENOENT."""
    with pytest.raises(RemoteError) as exc:
        await _next(w, timeout)
    assert exc.value.errnum == errno.ENOENT


async def _leases(kvs: KVS) -> dict[str, int]:
    return dict((await kvs.handle.rpc("kvs.stats-get", {}, nodeid=0))["leases"])


async def test_command_holds_the_lease_and_its_keys_go_when_it_exits(start_instance) -> None:
    """The command puts a key with ``$KVBROKER_LEASE``; when it exits, the
    lease is revoked before ``lease run`` exits (the key is gone on the
    command's rank at once, with a ttl of a minute), and ``lease run``
    exits with the command's status."""
    inst = await start_instance(size=4, fanout=2)
    async with KVS.connect(inst.uri(3)) as kvs:
        async with lease_run(inst.uri(3), 60, status=7) as proc:
            lease_id, _ = await locked(proc)
            assert await kvs.get_str("lock") == "held"
            info = await kvs.lease_info(lease_id)
            assert info["keys"] == {"primary": ["lock"]} and info["ttl"] == 60
            out, err = await asyncio.wait_for(proc.communicate(b"done\n"), T)
        assert (proc.returncode, out, err) == (7, b"", b"")
        assert not await kvs.exists("lock")  # revoked, and seen on this rank: at once
        stats = await _leases(kvs)
        assert (stats["revoked"], stats["expired"], stats["live"]) == (1, 0, 0)


async def test_sigkill_of_lease_run_kills_its_command_and_the_lease_expires_within_ttl(
        start_instance) -> None:
    """Kept alive while ``lease run`` lives (for longer than its ttl); once
    it is SIGKILLed (no revoke, nothing of it runs), the kernel kills the
    command too (its parent-death signal: before, the command ran on,
    believing it held the lock while its lease expired), and the key goes
    within the ttl."""
    ttl = 2.0
    inst = await start_instance(size=4, fanout=2)
    async with KVS.connect(inst.uri(1)) as watcher:
        async with lease_run(inst.uri(3), ttl) as proc:
            _, pid = await locked(proc)
            w = watcher.watch("lock", waitcreate=True)
            assert (await _next(w, T)).value == b"held"
            with pytest.raises(TimeoutError):  # kept alive: nothing happens for 2 ttls
                await _next(w, 2 * ttl)
            assert alive(pid)
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            await all_gone([pid], "the command to be killed with lease run", T)
            await _gone(w, ttl + MARGIN)
            assert time.monotonic() - killed <= ttl + MARGIN
        stats = await _leases(watcher)
        assert (stats["expired"], stats["revoked"], stats["live"]) == (1, 0, 0)


async def test_sigterm_is_passed_on_and_a_lost_lease_stops_the_command(
        start_instance) -> None:
    """SIGTERM to ``lease run`` reaches the command (whose status, 3, is
    passed through) and the lease is revoked; a lease revoked by someone
    else is found gone by a keepalive: said on stderr, the command gets
    SIGTERM."""
    inst = await start_instance(size=2)
    async with KVS.connect(inst.uri(1)) as kvs:
        async with lease_run(inst.uri(1), 60) as proc:
            await locked(proc)
            proc.send_signal(signal.SIGTERM)
            out, err = await ended(proc)
        assert (proc.returncode, out, err) == (3, f"got {signal.SIGTERM:d}\n".encode(), b"")
        assert not await kvs.exists("lock")

        async with lease_run(inst.uri(1), 1.5) as proc:  # (keepalives every 0.5 s)
            lease_id, _ = await locked(proc)
            await kvs.lease_revoke(lease_id)
            out, err = await ended(proc)
        assert (proc.returncode, out) == (3, f"got {signal.SIGTERM:d}\n".encode())
        assert err.decode().startswith(
            f"kvbroker: kvs lease run: lease {lease_id} was lost (it expired or was "
            "revoked): stopping "), err
