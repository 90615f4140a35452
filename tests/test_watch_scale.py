"""kvs-watch under load: commit order with 16 commits in flight, 1,000 watchers
across 100 namespaces on one rank, the slow-reader bound, and clients killed
with SIGKILL mid-watch (flux-core t/t1103-apidisconnect.t)."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import sys
import textwrap

import pytest
from test_broker_support import stopped
from test_watch_helpers import (
    APPEND,
    FULL,
    NO_MERGE,
    WAITCREATE,
    WATCH,
    answer,
    append,
    cancel,
    commit,
    end_errnum,
    ns_create,
    put,
    stats,
    value,
    wait_watchers,
    watch_stream,
)

from broker import codec
from broker.connector import MAX_PER_TURN
from broker.errors import RemoteError
from broker.message import Message, MsgFlags, MsgType
from kvs_watch.module import DROP_PER_TURN


async def _commit_all(h, n: int, in_flight: int, flags: int) -> dict[int, list[bytes]]:
    """Commit values 1..n to ``test.d``, ``in_flight`` at a time; rootseq -> values."""
    sem = asyncio.Semaphore(in_flight)
    by_seq: dict[int, list[bytes]] = {}

    async def one(i: int) -> None:
        async with sem:
            r = await commit(h, put("test.d", str(i)), flags=flags, timeout=30)
            by_seq.setdefault(r["rootseq"], []).append(str(i).encode())

    await asyncio.gather(*(one(i) for i in range(1, n + 1)))
    return by_seq


async def _collect(s, n: int) -> list[dict]:
    async with asyncio.timeout(60):
        return [await answer(s, timeout=60) for _ in range(n)]


async def test_commit_order_1000_commits_16_in_flight(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h2, h3 = await connect(inst, 0), await connect(inst, 2), await connect(inst, 3)
    base = (await commit(h0, put("test.d", "0"), sync=[h3, (h3, 1)]))["rootseq"]
    local = watch_stream(h3, "test.d")  # served by rank 3
    remote = watch_stream(h3, "test.d", nodeid=1)  # served by rank 1, answered via rank 0
    for s in (local, remote):
        assert (await answer(s))["rootseq"] == base
    # NO_MERGE: one version per commit, so every commit must be seen, in order
    by_seq = await _commit_all(h2, 1000, 16, NO_MERGE)
    assert sorted(by_seq) == list(range(base + 1, base + 1001))
    for s in (local, remote):
        got = await _collect(s, 1000)
        assert [g["rootseq"] for g in got] == sorted(by_seq)
        assert all([g["val"]["data"]] == by_seq[g["rootseq"]] for g in got)
    # merged commits: one answer per version, versions strictly increasing
    by_seq = await _commit_all(h2, 300, 16, 0)
    for s in (local, remote):
        got = await _collect(s, len(by_seq))
        assert [g["rootseq"] for g in got] == sorted(by_seq)
        assert all(g["val"]["data"] in by_seq[g["rootseq"]] for g in got)


async def test_1000_watchers_across_100_namespaces_on_one_rank(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    names = [f"ns-{i}" for i in range(100)]
    async with asyncio.timeout(60):
        await asyncio.gather(*(ns_create(h0, ns) for ns in names))
        await asyncio.gather(*(commit(h0, *(put(f"k.{j}", "0") for j in range(10)), ns=ns)
                               for ns in names))
    streams = [(ns, j, watch_stream(h3, f"k.{j}", ns=ns)) for ns in names for j in range(10)]
    async with asyncio.timeout(60):
        firsts = await asyncio.gather(*(value(s, 60) for _, _, s in streams))
    assert firsts == [b"0"] * 1000
    st = await stats(h3)
    assert st["watchers"] == 1000 and st["namespace-count"] == 100
    # every first answer given: nothing left under way (what a caller that
    # waits for the service to catch up, like benchmark W5x, looks at)
    assert st["monitors-starting"] == 0 and st["lookups-in-flight"] == 0
    assert st["events"]["subscribe_calls"] == 1  # the module's one, for 100 namespaces
    assert len(st["namespaces"]) == 100
    async with asyncio.timeout(60):
        await asyncio.gather(*(commit(h0, *(put(f"k.{j}", f"{ns}.{j}") for j in range(10)),
                                      ns=ns) for ns in names))
        updates = await asyncio.gather(*(answer(s, 60) for _, _, s in streams))
    for (ns, j, _), p in zip(streams, updates, strict=True):
        assert (p["val"]["data"], p["namespace"], p["rootseq"]) == (f"{ns}.{j}".encode(), ns, 2)
    await h3.close()
    await wait_watchers(h0, 0, nodeid=3, timeout=30)
    st = await stats(h0, 3)
    assert st["namespace-count"] == 0 and st["clients"] == 0


async def test_slow_reader_is_bounded(start_instance, connect):
    """A watcher more than ``kvs-watch.max-backlog`` roots behind ends with EOVERFLOW.

    To make it fall behind deterministically, the test (the instance owner)
    sends 300 setroot events for the watched key in ONE write: rank 0
    sequences and delivers them in one go, before any lookup can complete.
    """
    inst = await start_instance(size=4, fanout=2, attrs={"kvs-watch.max-backlog": "4"})
    h0 = await connect(inst, 0)
    await ns_create(h0, "slow")
    first = await commit(h0, put("k", "0"), ns="slow")
    steady = watch_stream(h0, "k", ns="slow")
    full = watch_stream(h0, "k", WATCH | FULL, ns="slow")
    assert await value(steady) == b"0" and await value(full) == b"0"
    for i in range(1, 21):  # commits at the speed of a round trip never overflow
        await commit(h0, put("k", str(i)), ns="slow")
        assert await value(steady) == str(i).encode()
    assert [await value(full) for _ in range(20)] == [str(i).encode() for i in range(1, 21)]
    root = await asyncio.wait_for(h0.rpc("kvs.getroot", {"namespace": "slow"}), 10)
    frames = []
    for i in range(1, 301):
        msg = Message(MsgType.REQUEST, "event.pub", {
            "topic": "kvs.namespace-slow-setroot",
            "payload": {"namespace": "slow", "rootseq": root["rootseq"] + i,
                        "rootref": root["rootref"], "names": [], "keys": ["k"],
                        "owner": root["owner"]}}, flags=int(MsgFlags.NORESPONSE))
        f = codec.encode(msg)
        frames += [codec.stream_prefix(f), *f]
    h0._proto.transport.write(b"".join(bytes(x) for x in frames))  # one write
    assert await end_errnum(steady) == errno.EOVERFLOW
    assert await end_errnum(full) == errno.EOVERFLOW
    await wait_watchers(h0, 0, nodeid=0)
    assert first["rootseq"] == 1


def _forged_setroots(ns: str, roots: list[tuple[int, str]], owner: int) -> bytes:
    """``kvs.namespace-NS-setroot`` events naming key ``log``, one per
    ``(rootseq, rootref)``, as one write's bytes: rank 0 sequences and
    delivers them in one go, faster than any lookup completes."""
    frames = []
    for seq, ref in roots:
        msg = Message(MsgType.REQUEST, "event.pub", {
            "topic": f"kvs.namespace-{ns}-setroot",
            "payload": {"namespace": ns, "rootseq": seq, "rootref": ref, "names": [],
                        "keys": ["log"], "owner": owner}}, flags=int(MsgFlags.NORESPONSE))
        f = codec.encode(msg)
        frames += [codec.stream_prefix(f), *f]
    return b"".join(bytes(x) for x in frames)


async def test_an_append_watcher_far_behind_folds_roots_and_answers_every_blob(
        start_instance, connect):
    """An eventlog appended to faster than a follower's watcher can read
    each version: the APPEND watcher reads the roots that queued behind its
    lookups at the newest one and answers every line once, in order, where
    a plain watcher of the same key ends EOVERFLOW.  (Before, both ended:
    5,000 fast appends left followers' eventlog watchers ~700 lines in.)

    The burst: 300 setroots in one write (as in the test above), whose
    roots are real versions of the same log, made in namespace ``src``
    (a lookup pinned to a root reads whatever tree it names)."""
    inst = await start_instance(size=4, fanout=2, attrs={"kvs-watch.max-backlog": "20"})
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    lines = [f"line {i}\n".encode() for i in range(30)]
    await ns_create(h0, "src")
    refs = []
    for line in lines:
        refs.append((await commit(h0, append("log", line), ns="src"))["rootref"])
    await ns_create(h0, "fold")
    first = await commit(h0, append("log", lines[0]), ns="fold", sync=h3)
    log = watch_stream(h3, "log", WATCH | APPEND, ns="fold")
    plain = watch_stream(h3, "log", ns="fold")
    assert await value(log) == lines[0] and await value(plain) == lines[0]
    owner = (await asyncio.wait_for(h0.rpc("kvs.getroot", {"namespace": "fold"}), 10))["owner"]
    burst = [(first["rootseq"] + i, refs[min(1 + i // 10, 29)]) for i in range(1, 301)]
    h0._proto.transport.write(_forged_setroots("fold", burst, owner))
    with pytest.raises(RemoteError) as exc:  # (after answering a few of the versions)
        async with asyncio.timeout(30):
            while await plain.next_message():
                pass
    assert exc.value.errnum == errno.EOVERFLOW
    assert [await value(log) for _ in lines[1:]] == lines[1:]
    st = await stats(h3, nodeid=3)
    assert st["counts"]["roots-folded"] > 0 and st["watchers"] == 1
    cancel(h3, log)  # ... and nothing after the last line: no blob answered twice
    assert await end_errnum(log) == 0


_CHILD = textwrap.dedent("""
    import asyncio, sys
    from broker.handle import Handle

    async def main(uri, size):
        h = await Handle.connect(uri)
        streams = [h.rpc_stream("kvs-watch.lookup", {"namespace": "primary",
                                "key": "k", "flags": 4}, nodeid=r) for r in range(size)]
        streams.append(h.rpc_stream("kvs-watch.lookup", {"namespace": "primary",
                                    "key": "k", "flags": 4}))
        for s in streams:
            await asyncio.wait_for(s.next_message(), 10)
        h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "nokey",
                     "flags": 4 | 8}, nodeid=size - 1)
        print("ready", flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
""")


async def test_sigkill_client_leaves_no_watcher_on_any_rank(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    await commit(h0, put("k", "1"))
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    children = []
    for rank in (1, 3):
        children.append(await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, inst.uri(rank), "4", stdout=asyncio.subprocess.PIPE,
            env=env))
    try:
        for child in children:
            assert child.stdout is not None
            line = await asyncio.wait_for(child.stdout.readline(), 20)
            assert line == b"ready\n"
        counts = [(await stats(h0, r))["watchers"] for r in range(4)]
        # each child: one watch served by every rank, one local, one WAITCREATE on rank 3
        assert counts == [2, 3, 2, 5], counts
        for child in children:
            child.send_signal(signal.SIGKILL)
        for r in range(4):
            await wait_watchers(h0, 0, nodeid=r)
            st = await stats(h0, r)
            assert st["namespace-count"] == 0 and st["clients"] == 0
    finally:
        for child in children:
            if child.returncode is None:
                child.kill()
            await asyncio.wait_for(child.wait(), 10)


async def test_a_gone_clients_watches_are_dropped_between_other_clients_requests(
        start_instance, connect):
    """A client that goes away holding 20,000 watches on a rank: its watchers
    are dropped a batch per loop turn, and other clients are answered in
    between.  They were all dropped in one turn: ~4-10 us each, so a ping
    waited 0.4-1 s behind a client with 100,000 watches going away (and
    kvs-watch.max-watches-per-client allows 1,000,000).

    The other client's requests are queued at the rank before it sees the
    client go (the rank stopped meanwhile): more than a connection's
    requests per turn (MAX_PER_TURN), so the rank takes them over several
    turns after the disconnect, whatever the load.  Polling instead, a
    client descheduled for the ~0.2 s of the drop saw only 20,000 and 0."""
    n = 20_000
    inst = await start_instance(size=1)
    h0, gone = await connect(inst, 0), await connect(inst, 0)
    for i in range(n):
        watch_stream(gone, f"gone.k{i % 100}", WATCH | WAITCREATE)
    await wait_watchers(h0, n, timeout=60)
    async with stopped(inst.pids()[0]):
        await gone.close()  # (the end of its stream waits at the rank)
        # Eight turns' worth: the rank sees the end of gone's stream in its
        # first turn or two, and the drop takes n / DROP_PER_TURN = 79.
        asks = [h0.rpc("kvs-watch.stats-get", {}) for _ in range(8 * MAX_PER_TURN)]
        h0.flush()
    async with asyncio.timeout(60):
        seen = [a["watchers"] for a in await asyncio.gather(*asks)]
    assert n > 8 * DROP_PER_TURN  # (the drop outlasts the turns the requests take)
    assert any(0 < w < n for w in seen), "no other request was answered meanwhile"
    await wait_watchers(h0, 0, timeout=60)
    st = await stats(h0)
    assert (st["clients"], st["namespace-count"], st["counts"]["disconnected"]) == (0, 0, n)
