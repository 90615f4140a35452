"""flux-core t/t1103-apidisconnect.t (a client's or a module's going away
ends the kvs watches it held, on every rank) against real kvbroker ranks:
a 4-rank instance (fanout 2: rank 3 is below rank 1), as Flux's.

Flux's cases, in order, and what each becomes:

1.  'kvs watcher gets disconnected on client exit' -- ``flux kvs get
    --watch --waitcreate noexist`` killed by SIGALRM (exit 142), then
    ``flux module stats --parse watchers kvs-watch`` back to its count
    before -> :func:`test_a_killed_watch_command_leaves_no_watcher`: the
    same ``kvbroker kvs get`` command, killed by SIGALRM once its watcher
    is counted, on rank 0 and on rank 3 (a leaf); the count read with the
    same ``kvbroker module stats --parse watchers kvs-watch`` line.
2.  'multi-node kvs watcher gets disconnected on client exit' (Flux's
    t/kvs/watch_disconnect: one streaming ``kvs-watch.lookup`` WATCH |
    WAITCREATE per rank, addressed by nodeid; the sum of every rank's
    ``watchers`` up by the size; close the handle; the sum back) ->
    :func:`test_a_clients_watches_on_every_rank_end_when_it_closes` (a
    Handle of rank 0 closing, as Flux's) and
    :func:`test_a_killed_clients_watches_on_every_rank_end` (a client of
    rank 3, whose requests cross rank 1 both ways, killed with SIGKILL:
    the broker learns it from the socket alone).
3.  'module watcher gets disconnected on module unload' (a module that
    watches ``noexist`` at load; ``watchers`` up by one; ``module remove``;
    back) -> :func:`test_a_modules_watch_ends_when_it_is_removed`, as
    Flux's: a ``watcher`` module (``LOAD_WATCHER`` below: one local watch
    of ``noexist`` as it starts) loaded with ``kvbroker module load
    watcher`` into the running rank 0, its watcher counted (``module stats
    --parse watchers kvs-watch``), ``module remove watcher``, the count
    back.  The same on every rank at once (``-r all``, each rank's count up
    by one and back), and a ``module reload watcher`` in between (the old
    module's watch goes, the new one's comes: one more, not two).
    :func:`test_a_modules_watch_ends_when_its_rank_goes` keeps the other
    way a module goes (before runtime unload existed, the only one): a
    ``watcher`` module (``WATCHER``) on every rank holds a watch on rank
    0's kvs-watch (4 there, one per module); rank 3 is killed (SIGKILL),
    and rank 0 must drop its module's watcher (3 left); then rank 2, a
    child of rank 0, is cut off with ``kvbroker overlay disconnect 2`` (2
    left).  The module's own rank's watchers (its kvs-watch is gone with
    it) are not counted.

    A DEFECT found here, fixed: the removed module's watch was never
    dropped (rank 0's ``watchers`` stayed one up for good, two after a
    reload): the router noted the services a client used, for the
    ``.disconnect`` it sends when the client goes, but not those of a
    module, so ``module remove`` sent none.  Flux's broker sends them for
    an unloaded module, which is what this case checks.

Beyond Flux's cases (the same rule, other paths a watch takes):

* watches sent to every rank and the handle closed at once, before any
  is counted (the disconnect follows each request on its path), 20 times;
* a watch addressed ``NODEID_UPSTREAM`` (served by the parent), a one-shot
  (non-streaming) WAITCREATE lookup on every rank, and a
  ``kvs-watch.namespaces`` watch on every rank: each ends with its client;
* the rank between a client and the ranks it watches on is lost (rank 1,
  between a client of rank 3 and ranks 0 and 2): ranks 0 and 2 drop the
  watches (rank 1's parent sends the disconnects of the clients below);
* a guest (another uid) killed: its watches and its per-guest count
  (``guest-users``) go on every rank;
* a client with 1,000 watches on one rank (dropped 256 per loop turn)
  closes while another client's watches go on and still answer.

The others pass: no kvbroker defect found on those paths.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import GUEST_UID, GuestProc, run_cli, use_module_plugin, wait_until

from broker.handle import Handle
from broker.message import NODEID_UPSTREAM, MsgFlags

WATCH, WAITCREATE = 4, 8
SIZE = 4
T = 20.0

WATCHER = '''
from typing import ClassVar

from broker.module import Module, require


class WatcherModule(Module):
    """Holds one kvs-watch.lookup WATCH|WAITCREATE of "noexist" (Flux's
    t/disconnect/watcher.c), sent where ``watcher.go`` says."""
    name: ClassVar[str] = "watcher"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.streams = []

    def handlers(self):
        return {"watcher.go": self.go}

    def go(self, msg):
        nodeid = require(msg.payload, nodeid=int)["nodeid"]
        self.streams.append(self.h.rpc_stream(
            "kvs-watch.lookup",
            {"namespace": "primary", "key": "noexist", "flags": 4 | 8},
            nodeid=nodeid))
        self.h.respond(msg, {"rank": self.ctx.rank})

    def stats(self):
        return {"streams": len(self.streams)}
'''


LOAD_WATCHER = '''
from typing import ClassVar

from broker.module import Module


class LoadWatcherModule(Module):
    """Flux's t/disconnect/watcher.c: as it starts, one kvs-watch.lookup
    WATCH|WAITCREATE of "noexist" on its own rank, held until it goes."""
    name: ClassVar[str] = "watcher"

    async def start(self):
        self.stream = self.h.rpc_stream(
            "kvs-watch.lookup",
            {"namespace": "primary", "key": "noexist", "flags": 4 | 8})
'''


async def watchers(h: Handle, rank: int) -> int:
    st = await asyncio.wait_for(h.rpc("kvs-watch.stats-get", {}, nodeid=rank), 10)
    return int(st["watchers"])


async def all_watchers(h: Handle, size: int = SIZE) -> list[int]:
    return [await watchers(h, r) for r in range(size)]


async def wait_all(h: Handle, want: list[int], what: str) -> None:
    async def check() -> bool:
        return await all_watchers(h, len(want)) == want

    await wait_until(check, what, T)


async def cli_watchers(uri: str) -> int:
    """Flux's line: ``module stats --parse watchers kvs-watch``."""
    rc, out, err = await run_cli("module", "stats", "--parse", "watchers", "kvs-watch",
                                 uri=uri, timeout=T)
    assert rc == 0, err
    return int(out)


async def test_a_killed_watch_command_leaves_no_watcher(start_instance, connect) -> None:
    """Case 1: ``kvbroker kvs get --watch --waitcreate noexist`` killed by
    SIGALRM (Flux's ``run_timeout -s ALRM``; the shell's 142 is a
    process killed by signal 14) leaves its rank's watcher count where it
    was, on rank 0 and on a leaf."""
    inst = await start_instance(size=SIZE)
    h = await connect(inst, 0)
    for rank in (0, 3):
        uri = inst.uri(rank)
        before = await cli_watchers(uri)
        env = dict(os.environ, KVBROKER_URI=uri)
        proc = await asyncio.create_subprocess_exec(
            os.path.join(os.path.dirname(sys.executable), "kvbroker"),
            "kvs", "get", "--watch", "--waitcreate", "noexist", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            async def counted(rank: int = rank, before: int = before) -> bool:
                return await watchers(h, rank) == before + 1

            await wait_until(counted, f"the command's watcher on rank {rank}", T)
            proc.send_signal(signal.SIGALRM)
            out, _err = await asyncio.wait_for(proc.communicate(), T)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode == -signal.SIGALRM, proc.returncode
        assert out == b""

        async def gone(rank: int = rank, before: int = before) -> bool:
            return await watchers(h, rank) == before

        await wait_until(gone, f"rank {rank}'s watcher to go with its client", T)
        assert await cli_watchers(uri) == before


def watch_everywhere(h: Handle, size: int = SIZE) -> list[Any]:
    return [h.rpc_stream("kvs-watch.lookup",
                         {"namespace": "primary", "key": "nonexist",
                          "flags": WATCH | WAITCREATE}, nodeid=rank)
            for rank in range(size)]


async def test_a_clients_watches_on_every_rank_end_when_it_closes(
        start_instance, connect) -> None:
    """Case 2 as Flux's watch_disconnect: one watch on each rank from a
    client of rank 0; counted on every rank; the client closes; every
    rank's count goes back."""
    inst = await start_instance(size=SIZE)
    probe = await connect(inst, 0)
    before = await all_watchers(probe)
    h = await Handle.connect(inst.uri(0))
    try:
        streams = watch_everywhere(h)
        assert len({s.matchtag for s in streams}) == SIZE
        await wait_all(probe, [n + 1 for n in before], "one watcher on each rank")
    finally:
        await h.close()
    await wait_all(probe, before, "every rank's watcher to go with its client")


KILLED_CLIENT = r"""
import asyncio, sys
from broker.handle import Handle

async def main():
    h = await Handle.connect(sys.argv[1])
    streams = [h.rpc_stream("kvs-watch.lookup",
                            {"namespace": "primary", "key": "nonexist", "flags": 12},
                            nodeid=r) for r in range(int(sys.argv[2]))]
    h.flush()
    print("sent", len(streams), flush=True)
    await asyncio.Event().wait()   # until killed

asyncio.run(main())
"""


async def test_a_killed_clients_watches_on_every_rank_end(start_instance, connect) -> None:
    """Case 2, the client a process of its own attached to rank 3 (its
    watches on ranks 0 and 2 cross rank 1), killed with SIGKILL once every
    rank counts its watcher: every count goes back."""
    inst = await start_instance(size=SIZE)
    probe = await connect(inst, 0)
    before = await all_watchers(probe)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", KILLED_CLIENT, inst.uri(3), str(SIZE),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), T)
        assert line == f"sent {SIZE}\n".encode(), line
        await wait_all(probe, [n + 1 for n in before], "the client's watcher on each rank")
    finally:
        proc.kill()
        await proc.wait()
    await wait_all(probe, before, "every rank's watcher to go with its killed client")
    assert await cli_watchers(inst.uri(0)) == before[0]


@pytest.fixture
def watcher_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_module_plugin(tmp_path, monkeypatch, "watcher", "WatcherModule", WATCHER)


async def test_a_modules_watch_ends_when_its_rank_goes(watcher_plugin, start_instance,
                                                       connect) -> None:
    """Case 3 (no module unload here: a module goes with its rank): the
    watcher module of each rank holds a watch on rank 0 (4 watchers
    there); rank 3 killed -> 3; rank 2 cut off by ``overlay disconnect``
    -> 2.  The modules of ranks 0 and 1 keep theirs."""
    inst = await start_instance(
        size=SIZE, attrs={"broker.modules": "content,kvs,kvs-watch,watcher"})
    h = await connect(inst, 0)
    before = await watchers(h, 0)
    async with asyncio.timeout(T):
        for rank in range(SIZE):
            assert await h.rpc("watcher.go", {"nodeid": 0}, nodeid=rank) == {"rank": rank}

    async def count(n: int) -> bool:
        return await watchers(h, 0) == before + n

    await wait_until(lambda: count(4), "the 4 modules' watchers on rank 0", T)
    inst.procs[3].kill()
    assert await asyncio.wait_for(inst.procs[3].wait(), T) == -signal.SIGKILL
    await wait_until(lambda: count(3), "rank 3's module's watcher to go", T)
    rc, out, err = await run_cli("overlay", "disconnect", "2", uri=inst.uri(0), timeout=T)
    assert rc == 0, (out, err)
    await wait_until(lambda: count(2), "rank 2's module's watcher to go", T)
    st = await asyncio.wait_for(h.rpc("kvs-watch.stats-get", {}, nodeid=0), T)
    assert st["watchers"] == before + 2  # ranks 0's and 1's modules keep theirs


@pytest.fixture
def load_watcher_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_module_plugin(tmp_path, monkeypatch, "watcher", "LoadWatcherModule", LOAD_WATCHER)


async def test_a_modules_watch_ends_when_it_is_removed(load_watcher_plugin, start_instance,
                                                       connect) -> None:
    """Case 3 as Flux's: ``module load watcher`` into the running rank 0
    adds its watcher to rank 0's count; ``module remove watcher`` takes it
    away.  Then on every rank at once, with a reload between."""
    inst = await start_instance(size=SIZE)
    h = await connect(inst, 0)
    uri = inst.uri(0)

    async def module(*args: str) -> None:
        rc, out, err = await run_cli("module", *args, uri=uri, timeout=T)
        assert (rc, out, err) == (0, "", ""), (args, rc, out, err)

    before = await cli_watchers(uri)
    await module("load", "watcher")

    async def on_0(n: int) -> bool:  # (an RPC: a command cut off by the timeout leaks pipes)
        return await watchers(h, 0) == n

    await wait_until(lambda: on_0(before + 1), "the module's watcher on rank 0", T)
    assert await cli_watchers(uri) == before + 1
    await module("remove", "watcher")
    await wait_until(lambda: on_0(before), "the removed module's watcher to go", 5)
    assert await cli_watchers(uri) == before

    counts = await all_watchers(h)
    up = [n + 1 for n in counts]
    await module("load", "-r", "all", "watcher")
    await wait_all(h, up, "each rank's module's watcher")
    await module("reload", "-r", "all", "watcher")
    await wait_all(h, up, "the reloaded modules' watchers (one each)")
    await module("remove", "-r", "all", "watcher")
    await wait_all(h, counts, "every removed module's watcher to go")


async def test_watches_closed_before_they_are_counted_leave_none(start_instance,
                                                                connect) -> None:
    """Watches on every rank from a client of rank 3, the handle closed in
    the same turn as the requests were sent (the close flushes them, then
    the connection ends): 20 times, and every rank's count is back."""
    inst = await start_instance(size=SIZE)
    probe = await connect(inst, 0)
    before = await all_watchers(probe)
    for _ in range(20):
        h = await Handle.connect(inst.uri(3))
        watch_everywhere(h)
        await h.close()
    # Every closed client gone from rank 3 (its end read after all it sent),
    # then a request from rank 3 to each rank: it travels behind every request
    # and disconnect those clients left on the way, so the counts it reads
    # are final.  (Read from rank 0 alone, a count back to what it was could
    # be a moment before a late request made a watcher and its client's
    # disconnect took it away: seen under load.)
    probe3 = await connect(inst, 3)

    async def clients_gone() -> bool:
        return bool((await probe3.rpc("broker.stats-get", {}, nodeid=3))["clients"] == 1)

    await wait_until(clients_gone, "rank 3 to see the 20 clients go", T)
    await wait_all(probe3, before, "no watcher left by the 20 closed clients")
    # (how many of the requests reached rank 0 before their client's end is
    # timing: some are dropped on the way, with the client they came from)
    st = await probe3.rpc("kvs-watch.stats-get", {}, nodeid=0)
    assert st["counts"]["watchers-created"] <= 20 and st["watchers"] == before[0], st


async def test_upstream_one_shot_and_namespace_watches_end_with_their_client(
        start_instance, connect) -> None:
    """A watch sent ``NODEID_UPSTREAM`` from rank 3 (served by rank 1), a
    one-shot WAITCREATE lookup (no STREAMING: Flux's
    ``flux_kvs_lookup(WAITCREATE)``) to every rank, and a
    ``kvs-watch.namespaces`` watch on every rank: each counted where it is
    served, and gone there once its client closes."""
    inst = await start_instance(size=SIZE)
    probe = await connect(inst, 0)
    before = await all_watchers(probe)
    h = await Handle.connect(inst.uri(3))
    try:
        h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "nonexist",
                                          "flags": WATCH | WAITCREATE}, nodeid=NODEID_UPSTREAM)
        await wait_all(probe, [before[0], before[1] + 1, *before[2:]], "rank 1's watcher")
        pending = [h.rpc("kvs-watch.lookup", {"namespace": "primary", "key": "nonexist",
                                              "flags": WAITCREATE}, nodeid=r)
                   for r in range(SIZE)]
        await wait_all(probe, [before[0] + 1, before[1] + 2, before[2] + 1, before[3] + 1],
                       "a one-shot watcher on each rank")
        streams = [h.rpc_stream("kvs-watch.namespaces", {}, nodeid=r) for r in range(SIZE)]
        for s in streams:  # the list first: the watcher is registered
            first = await asyncio.wait_for(s.__anext__(), T)
            assert first["namespace"] == "primary" and first["initial"], first
        await wait_all(probe, [before[0] + 2, before[1] + 3, before[2] + 2, before[3] + 2],
                       "a namespace watcher on each rank")
    finally:
        await h.close()
    for f in pending:  # the handle failed them locally at close
        assert f.done()
        f.exception()
    await wait_all(probe, before, "every watcher to go with its client")


async def test_a_lost_middle_rank_ends_the_watches_of_the_clients_below(
        start_instance, connect) -> None:
    """A client of rank 3 watches on every rank; rank 1 (between it and
    ranks 0 and 2) is killed: rank 3 goes with it, and ranks 0 and 2 drop
    the client's watches."""
    inst = await start_instance(size=SIZE)
    probe = await connect(inst, 0)
    before = await all_watchers(probe)
    h = await Handle.connect(inst.uri(3))
    try:
        watch_everywhere(h)
        await wait_all(probe, [n + 1 for n in before], "the client's watcher on each rank")
        inst.procs[1].kill()

        async def dropped() -> bool:
            return [await watchers(probe, 0), await watchers(probe, 2)] == [before[0],
                                                                            before[2]]

        await wait_until(dropped, "ranks 0 and 2 to drop the lost client's watches", T)
    finally:
        await h.close()


async def test_a_client_with_many_watches_leaves_none_and_others_keep_theirs(
        start_instance, connect) -> None:
    """kvs-watch drops a gone client's watches 256 per loop turn: a client
    with 1,000 watches on rank 1 (and one on rank 0) closes; both ranks'
    counts go back to what another client still holds there (1 each),
    and that client's watch still answers."""
    inst = await start_instance(size=2)
    probe = await connect(inst, 0)
    other = await connect(inst, 1)
    kept = [other.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "k",
                                                  "flags": WATCH | WAITCREATE}, nodeid=r)
            for r in (0, 1)]
    await wait_all(probe, [1, 1], "the other client's watches")
    h = await Handle.connect(inst.uri(1))
    try:
        for i in range(1000):
            h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": f"n{i}",
                                              "flags": WATCH | WAITCREATE}, nodeid=1)
        h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "n",
                                          "flags": WATCH | WAITCREATE}, nodeid=0)
        await wait_all(probe, [2, 1001], "the many watches")
    finally:
        await h.close()
    await wait_all(probe, [1, 1], "only the other client's watches")
    await probe.rpc("kvs.commit", {"namespace": "primary", "flags": 0, "ops": [
        {"key": "k", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"v"}}]})
    for s in kept:
        got = await asyncio.wait_for(s.__anext__(), T)
        assert got["val"]["data"] == b"v", got


GUEST_WATCHES = """
    async def main():
        h = await Handle.connect(uri)
        for r in range(4):
            h.rpc_stream("kvs-watch.lookup", {"namespace": "guestns", "key": "nonexist",
                                              "flags": 12}, nodeid=r)
        h.flush()
        out(sent=4)
        await step()
"""


async def test_a_killed_guests_watches_on_every_rank_end(start_instance, connect) -> None:
    """Case 2 for a guest (another uid, in a namespace it owns): its watch
    on each rank is counted there (``watchers``, ``guest-users``); the
    guest process killed, every rank forgets both (its per-guest cap is
    freed)."""
    inst = await start_instance(size=SIZE, attrs={"access.allow-guest-user": "true"})
    probe = await connect(inst, 0)
    await asyncio.wait_for(probe.rpc("kvs.namespace-create", {
        "namespace": "guestns", "owner": GUEST_UID}), T)
    guest = await GuestProc.start(inst.uri(3), GUEST_WATCHES)
    try:
        assert await guest.line(T) == {"sent": 4}
        await wait_all(probe, [1] * SIZE, "the guest's watcher on each rank")
        for r in range(SIZE):
            st = await probe.rpc("kvs-watch.stats-get", {}, nodeid=r)
            assert st["guest-users"] == 1, (r, st)
    finally:
        guest.kill()
    await wait_all(probe, [0] * SIZE, "every rank's watcher to go with the killed guest")
    for r in range(SIZE):
        st = await probe.rpc("kvs-watch.stats-get", {}, nodeid=r)
        assert st["guest-users"] == 0, (r, st)


def test_flags_are_fluxs() -> None:
    """FLUX_KVS_WATCH and FLUX_KVS_WAITCREATE, as the requests above send."""
    from kvs_watch import flags

    assert (flags.WATCH, flags.WAITCREATE) == (WATCH, WAITCREATE)
    assert int(MsgFlags.STREAMING) == 1
