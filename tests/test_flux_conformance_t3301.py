"""flux-core t3301-system-latestart and t3302-system-offline, as kvbroker
has them: ranks of an instance across hosts (``kvbroker broker --config``,
docs/guide.md "Across hosts") that start late, or before their parent.

Flux starts its leader alone (quorum 1) and checks that it serves, that
``overlay status`` is partial, that ``exec -r 1`` fails EHOSTUNREACH, then
starts rank 1 and waits for full.  t3302 starts a leaf before the router
between it and the leader; there Flux's leaf already serves its local
clients (``flux uptime`` says "join"), where kvbroker's opens its socket
only once joined (docs/cli.md, Conventions: "is that rank still waiting
for its parent").  Real processes, over tcp with CURVE."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path

from test_broker_support import run_cli
from test_multihost import _connect_when_listening, exit_codes, keyed_config
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)


async def test_ranks_not_started_yet_are_offline_and_unreachable_then_join(
        tmp_path: Path, brokers) -> None:  # noqa: F811
    """Rank 0 of 3 (fanout 1: 0 -> 1 -> 2) alone: it serves the KVS, a
    request to rank 1 fails at once with EHOSTUNREACH (ping, exec), and
    ``overlay status`` shows ranks 1 and 2 offline, not joined -- they were
    shown *lost* ("crashed, killed, cut off"), which they never were.
    Rank 2 started before its parent waits, without a socket; once rank 1
    starts, both join (``overlay status --wait full``, as Flux's) and the
    instance is full and serves on rank 2.  ``--summary`` prints rank 0's
    state alone, as Flux's."""
    host = socket.gethostname()
    config = await keyed_config(tmp_path, 3, 1)
    rank0 = await brokers(config, 0)
    uri = rank0.uri
    h = await _connect_when_listening(uri)
    await h.close()
    async with asyncio.timeout(90):
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        assert (rc, out.splitlines()) == (1, [
            f"0 {host}: partial",
            f"  1 {host}: offline (not joined since rank 0 started)",
            f"    2 {host}: offline (behind rank 1, not joined)"]), err
        rc, out, err = await run_cli("overlay", "status", "--summary", uri=uri)
        assert (rc, out) == (1, "partial\n"), err
        rc, out, err = await run_cli("overlay", "status", "--wait", "full", "-t", "0.5",
                                     uri=uri)
        assert (rc, out, err) == (1, "", "kvbroker: overlay status: Connection timed out "
                                         "(rank 0 not full within 0.5s: partial)\n")
        rc, out, err = await run_cli("overlay", "status", "--wait", "partial", "--summary",
                                     uri=uri)
        assert (rc, out) == (1, "partial\n"), err
        rc, out, err = await run_cli("uptime", uri=uri)
        assert rc == 0 and out.rstrip().endswith("size 3,  2 offline"), (out, err)
        for argv in (["ping", "1"], ["exec", "-r", "1", "--", "true"]):
            rc, out, err = await run_cli(*argv, uri=uri)
            assert (rc, out) == (1, ""), argv
            assert err == f"kvbroker: {argv[0]}: No route to host (rank 1 is unreachable)\n"
        rc, out, err = await run_cli("kvs", "put", "job=one-node", uri=uri)
        assert rc == 0, err

        # as Flux's "wait for overlay status to be full": without -t, --wait
        # has no bound (it gave up after the 2 s each rank may take to
        # answer, where a script waits for ranks that start on other hosts)
        waiting = asyncio.ensure_future(run_cli("overlay", "status", "--wait", "full",
                                                "--summary", uri=uri))
        done, _ = await asyncio.wait({waiting}, timeout=3)
        assert not done, waiting.result()

        rank2 = await brokers(config, 2)  # (t3302: before its parent)
        rc, out, err = await run_cli("kvs", "get", "job", uri=rank2.uri)
        assert rc == 1 and "is that rank still waiting for its parent" in err, err
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        assert rc == 1 and f"  1 {host}: offline (not joined" in out, out

        rank1 = await brokers(config, 1)
        rc, out, err = await waiting
        assert (rc, out) == (0, "full\n"), err
        for r in (rank0, rank1, rank2):  # each says ready once its subtree is up
            await r.ready()
        rc, out, err = await run_cli("overlay", "status", uri=uri)
        assert (rc, out.splitlines()) == (0, [f"0 {host}: full", f"  1 {host}: full",
                                              f"    2 {host}: full"]), err
        rc, out, err = await run_cli("kvs", "get", "--waitcreate", "job", uri=rank2.uri)
        assert (rc, out) == (0, "one-node\n"), err
        rc, out, err = await run_cli("exec", "-r", "1", "--", "true", uri=uri)
        assert rc == 0, err
    rank0.proc.send_signal(signal.SIGTERM)
    assert await exit_codes([rank0, rank1, rank2], tmp_path) == [0, 0, 0]
