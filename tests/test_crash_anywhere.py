"""Rank 0 killed (SIGKILL) at a random moment of a busy life, over and over,
on one statedir: every restart keeps what was promised and every tree whole.

Each round starts the instance on the same statedir with a checkpoint every
20 ms and no garbage-collection grace, and runs at once: writers making
plain commits, a writer making SYNC commits (from the last rank, relayed at
size 2), online collections back to back, namespaces created, written and
removed, and copies of the previous round's directory by reference.  When
the writers' acknowledgements reach a number drawn for the round, every
rank is killed.  The restart must then show:

* a root at least as new as every SYNC commit acknowledged (the promise of
  ``SYNC``; plain commits are kept up to the last checkpoint);
* each writer's commits applied as a prefix, whole: its ``hot`` key names
  the last transaction applied, exactly the acknowledged ones at or below
  the restored version are there (and maybe the one in flight), none above;
* every value of every earlier round still readable, the same;
* and, once stopped at the end, a store from which every blob the root
  reaches can be read (:func:`kvs.garbage.reachable` walks the SQLite file).

The kill points are drawn from a seed (``KVB_CRASH_SEED`` to replay one);
a failure names the seed and the round.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import random
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_kvs_gc_online import assert_whole
from test_kvs_rpc_helpers import SYNC, TREEOBJ, commit, errnum, get, getroot, lookup, put

from broker.errors import RemoteError

ROUNDS = 6
ATTRS = {"kvs.checkpoint-period": "20ms", "kvs.gc-grace": "0"}
PLAIN_WRITERS = 3
BIG = 3000  # bytes: past the inline limit, so such a value is a blob of its own


def value(writer: str, i: int, big: bool) -> bytes:
    text = f"{writer} {i};".encode()
    return text * (BIG // len(text) + 1) if big else text


@dataclass
class Writer:
    """One sequential committer of ``<prefix>.k<i>`` with ``<prefix>.hot`` = i."""

    name: str
    prefix: str
    flags: int = 0
    acked: list[tuple[int, int, bool]] = field(default_factory=list)  # (i, rootseq, big)
    inflight: tuple[int, bool] | None = None


class Round:
    def __init__(self, rng: random.Random, kill_at: int) -> None:
        self.rng = rng
        self.kill_at = kill_at
        self.acks = 0
        self.killed = asyncio.Event()

    def acked(self) -> None:
        self.acks += 1
        if self.acks >= self.kill_at:
            self.killed.set()


@contextlib.contextmanager
def until_killed(rnd: Round) -> Iterator[None]:
    """An error once the kill is decided is the kill's; before, the test's."""
    try:
        yield
    except (RemoteError, OSError, TimeoutError):
        if not rnd.killed.is_set():
            raise


async def write(h: Any, w: Writer, rnd: Round) -> None:
    i = 0
    with until_killed(rnd):  # (the kill takes the answer in flight with it)
        while not rnd.killed.is_set():
            big = rnd.rng.random() < 0.3
            w.inflight = (i, big)
            resp = await commit(h, put(f"{w.prefix}.k{i}", value(w.name, i, big)),
                                put(f"{w.prefix}.hot", str(i)), flags=w.flags)
            if rnd.killed.is_set():
                return  # acknowledged after the kill was decided: kept as in flight
            w.acked.append((i, resp["rootseq"], big))
            w.inflight = None
            rnd.acked()
            i += 1


async def collect(h: Any, rnd: Round) -> None:
    with until_killed(rnd):
        while not rnd.killed.is_set():
            await asyncio.wait_for(h.rpc("kvs.gc", {}), 30)


async def churn_namespaces(h: Any, rnd: Round, tag: str) -> None:
    n = 0
    with until_killed(rnd):
        while not rnd.killed.is_set():
            name = f"tmp-{tag}-{n}"
            await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": name}), 10)
            await commit(h, put("x", value(name, n, True)), ns=name)
            await asyncio.wait_for(h.rpc("kvs.namespace-remove", {"namespace": name}), 10)
            n += 1


async def copy(h: Any, rnd: Round, source: str | None,
               dest: str) -> list[tuple[str, int]]:
    """Copy ``source`` (a directory no one writes any more) to ``dest.c<j>``
    by reference, again and again; the copies acknowledged, with their
    rootseq."""
    done: list[tuple[str, int]] = []
    if source is None:
        return done
    with until_killed(rnd):
        while not rnd.killed.is_set():
            ref = await lookup(h, source, flags=TREEOBJ)
            key = f"{dest}.c{len(done)}"
            resp = await commit(h, put(key, ref))
            if not rnd.killed.is_set():
                done.append((key, resp["rootseq"]))
    return done


async def check_writer(h: Any, w: Writer, restored: int, truth: dict[str, bytes],
                       where: str) -> None:
    """``w``'s commits at the restored version are a whole prefix."""
    try:
        hot = int(await get(h, f"{w.prefix}.hot"))
    except RemoteError as exc:
        assert exc.errnum == errno.ENOENT, where
        hot = -1
    for i, rootseq, _big in w.acked:
        assert (rootseq <= restored) == (i <= hot), (
            f"{where}: {w.name} commit {i} (rootseq {rootseq}) against restored "
            f"rootseq {restored} and hot={hot}")
    last = w.acked[-1][0] if w.acked else -1
    if w.inflight is not None:
        assert hot <= w.inflight[0], where
        bigs = {i: big for i, _, big in w.acked} | {w.inflight[0]: w.inflight[1]}
    else:
        assert hot <= last, where
        bigs = {i: big for i, _, big in w.acked}
    for i in range(hot + 1):
        key = f"{w.prefix}.k{i}"
        assert await get(h, key) == value(w.name, i, bigs[i]), f"{where}: {key}"
        truth[key] = value(w.name, i, bigs[i])
    if hot >= 0:
        truth[f"{w.prefix}.hot"] = str(hot).encode()
    for i in range(hot + 1, max(last, hot) + 2):
        key = f"{w.prefix}.k{i}"
        assert await errnum(lookup(h, key)) == errno.ENOENT, f"{where}: {key} is there"


@pytest.mark.parametrize("size", [1, 2])
async def test_sigkill_at_random_moments_keeps_promises_and_whole_trees(
        start_instance, connect, tmp_path, size) -> None:
    seed = int(os.environ.get("KVB_CRASH_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    statedir = str(tmp_path / "state")
    truth: dict[str, bytes] = {}
    previous: str | None = None
    resumes_at = 0  # the rootseq the next start must resume at
    for r in range(ROUNDS):
        where = f"seed {seed} (KVB_CRASH_SEED), size {size}, round {r}"
        inst = await start_instance(size=size, fanout=2, statedir=statedir, attrs=ATTRS)
        h0 = await connect(inst, 0)
        hn = await connect(inst, size - 1)
        root = await getroot(h0)
        assert root["rootseq"] == resumes_at, where
        for key, data in truth.items():
            assert await get(h0, key) == data, f"{where}: {key} of an earlier round"

        rnd = Round(rng, kill_at=rng.randrange(5, 250))
        writers = [Writer(f"w{j}", f"r{r}.w{j}") for j in range(PLAIN_WRITERS)]
        writers.append(Writer("sync", f"r{r}.sync", flags=SYNC))
        tasks = [asyncio.create_task(write(h0, w, rnd)) for w in writers[:-1]]
        tasks.append(asyncio.create_task(write(hn, writers[-1], rnd)))
        tasks.append(asyncio.create_task(collect(h0, rnd)))
        tasks.append(asyncio.create_task(churn_namespaces(hn, rnd, str(r))))
        copier = asyncio.create_task(copy(h0, rnd, previous, f"r{r}.copy"))
        await asyncio.wait_for(rnd.killed.wait(), 60)
        for pid in inst.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        copies = await asyncio.wait_for(copier, 30)
        await inst.stop()

        inst = await start_instance(size=size, fanout=2, statedir=statedir, attrs=ATTRS)
        h = await connect(inst, size - 1)
        restored = (await getroot(h))["rootseq"]
        synced = [seq for _, seq, _ in writers[-1].acked]
        assert restored >= max(synced, default=0), f"{where}: a SYNC commit was lost"
        for w in writers:
            await check_writer(h, w, restored, truth, where)
        if previous is not None:
            source = await lookup(h, previous, flags=TREEOBJ)
            for key, rootseq in copies:
                if rootseq <= restored:
                    assert await lookup(h, key, flags=TREEOBJ) == source, f"{where}: {key}"
                else:
                    assert await errnum(lookup(h, key)) == errno.ENOENT, f"{where}: {key}"
        # the next round starts after a clean stop: its checkpoint is this root
        resumes_at = restored
        if any(key.startswith(f"r{r}.") for key in truth):
            previous = f"r{r}"
        await inst.stop()

    inst = await start_instance(size=1, statedir=statedir, attrs=ATTRS)
    h = await connect(inst, 0)
    for key, data in truth.items():
        assert await get(h, key) == data, f"seed {seed}: {key} at the end"
    rootref = (await getroot(h))["rootref"]
    await inst.stop()
    assert_whole(tmp_path / "state", [rootref])
