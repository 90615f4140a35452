"""Clients coming and going, ranks starting, stopping and dying; imports have no side effects."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from conftest import pid_alive
from test_broker_support import run_program, stats, stop_process, wait_until

from broker.errors import RemoteError
from broker.handle import Handle
from broker.launch import Instance, make_rundir
from broker.loops import loop_name
from kvs.client import KVS


async def module_requests(h: Handle, rank: int, module: str = "broker") -> int:
    mods = (await h.rpc("module.list", {}, nodeid=rank))["modules"]
    return next(m["requests"] for m in mods if m["name"] == module)


@pytest.mark.both_loops
async def test_clean_disconnect_drops_subscriptions_and_notifies(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(20):
        watcher = await connect(inst, 2)
        h = await Handle.connect(inst.uri(2))  # not the fixture's: this test closes it
        me = (await h.ping())["route"][0]
        await h.subscribe("a.")
        await h.subscribe("a.")
        await h.subscribe("b.")
        await h.ping(3)  # services used: event (ANY), broker (ANY), broker (rank 3)
        s = await stats(watcher)
        assert s["subscriptions"][me] == 3 and s["clients"] == 2
        sent_before = s["messages"].get("disconnects-sent", 0)
        on_rank3 = await module_requests(watcher, 3)

        await h.close()

        async def gone() -> bool:
            s = await stats(watcher)
            return me not in s["subscriptions"] and s["clients"] == 1

        await wait_until(gone, "the closed client's subscriptions to go")
        s = await stats(watcher)
        assert s["messages"]["disconnects-sent"] == sent_before + 3

        # rank 3's broker module got broker.disconnect (no response).  Each
        # module.list is itself one request, hence the running count.
        polls = 0

        async def notified() -> bool:
            nonlocal polls
            polls += 1
            return await module_requests(watcher, 3) == on_rank3 + polls + 1

        await wait_until(notified, "broker.disconnect on rank 3")
        # and everything else still works
        for rank in range(4):
            assert (await watcher.ping(rank))["rank"] == rank
        with pytest.raises(RemoteError) as info:
            await h.ping()
        assert info.value.errnum == errno.ECONNRESET


KILLED_CLIENT = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from broker import codec
    from broker.handle import Handle

    async def main():
        h = await Handle.connect(sys.argv[1])
        target = int(sys.argv[2])
        await h.subscribe("gone.")
        await h.subscribe("gone.too")
        print((await h.ping(target))["route"][0], flush=True)
        sys.stdin.readline()
        for _ in range(200):  # requests in flight when we die
            h.rpc("broker.ping", {"pad": "x" * 1000}, nodeid=target)
        # and half of one more message
        h._proto.transport.write(codec.stream_prefix([b"x" * 100]) + b"partial")
        await asyncio.sleep(0)
        os.kill(os.getpid(), signal.SIGKILL)

    asyncio.run(main())
    """
)


@pytest.mark.both_loops
async def test_client_killed_mid_request_leaves_nothing_behind(start_instance, connect) -> None:
    inst = await start_instance(size=8, fanout=2)
    async with asyncio.timeout(30):
        watcher = await connect(inst, 1)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            KILLED_CLIENT,
            inst.uri(1),
            "7",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None
        victim = (await proc.stdout.readline()).decode().strip()
        assert victim.startswith("c")
        assert (await stats(watcher))["subscriptions"][victim] == 2
        proc.stdin.write(b"go\n")
        assert await proc.wait() == -signal.SIGKILL

        async def gone() -> bool:
            s = await stats(watcher)
            return victim not in s["subscriptions"] and s["clients"] == 1

        await wait_until(gone, "the killed client's state to go")
        # every rank still answers, through rank 1 too
        for rank in range(8):
            assert (await watcher.ping(rank))["rank"] == rank
        await watcher.subscribe("after.")
        seq = await watcher.publish("after.kill")
        assert (await watcher.recv_event()).seq == seq


async def test_many_clients_come_and_go(start_instance, connect) -> None:
    inst = await start_instance(size=2, fanout=2)
    async with asyncio.timeout(20):
        watcher = await connect(inst, 1)
        for _ in range(3):
            hs = [await Handle.connect(inst.uri(1)) for _ in range(20)]
            await asyncio.gather(*(h.subscribe("churn.") for h in hs))
            await asyncio.gather(*(h.ping(0) for h in hs))
            assert (await stats(watcher))["clients"] == 21
            await asyncio.gather(*(h.close() for h in hs))

            async def gone() -> bool:
                s = await stats(watcher)
                return s["clients"] == 1 and not any(p[0] == "c" for p in s["subscriptions"])

            await wait_until(gone, "20 closed clients to go")


@pytest.mark.both_loops
async def test_clean_shutdown_leaves_nothing(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 3)
    async with asyncio.timeout(30):
        await h.subscribe("x.")
        pids, rundir = inst.pids(), inst.rundir
        assert all(pid_alive(p) for p in pids) and os.path.isdir(rundir)
        assert await inst.stop() == [0, 0, 0, 0]  # SIGTERM: every rank exits cleanly
        assert not any(pid_alive(p) for p in pids)
        assert not os.path.exists(rundir)
        with pytest.raises(RemoteError) as info:  # the client learns its broker is gone
            await h.ping()
        assert info.value.errnum == errno.ECONNRESET


async def test_an_interior_rank_that_exits_is_the_one_named(start_instance) -> None:
    """Rank 1 sent SIGTERM: its children 3 and 4 stop at once (it tells
    them to), while it stops its modules and says goodbye first, so their
    exits came first and were named (``rank 3 exited unexpectedly, with
    status 0``, every time).  A rank that stops because of its parent
    says so, and the rank above that stopped is named; a SIGTERM is a stop
    asked for (``kill``, ``systemctl stop``), as ``kvbroker shutdown`` is,
    so :attr:`ended` says it (None, the rank and why), and nothing failed
    (a killed rank is a failure: the next test)."""
    inst = await start_instance(size=7, fanout=2)
    assert inst.failed is not None and inst.ended is not None
    os.kill(inst.pids()[1], signal.SIGTERM)
    assert await asyncio.wait_for(asyncio.shield(inst.ended), 30) is None
    assert (inst.shutdown_rank, inst.shutdown_why) == (1, "signal SIGTERM")
    assert not inst.failed.done()


async def test_a_killed_rank_resolves_failed(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h = await connect(inst, 0)
        assert inst.failed is not None and not inst.failed.done()
        os.kill(inst.pids()[3], signal.SIGKILL)
        assert await asyncio.shield(inst.failed) == (3, -signal.SIGKILL)
        # the others keep serving; rank 3 is unreachable (not a hang: a ping
        # sent before rank 1 noticed the loss is answered when it does)
        assert (await h.ping(1))["rank"] == 1
        with pytest.raises(RemoteError) as info:
            await h.ping(3)
        assert info.value.errnum == errno.EHOSTUNREACH
        pids, rundir = inst.pids(), inst.rundir
        codes = await inst.stop()
        assert codes[:3] == [0, 0, 0] and codes[3] == -signal.SIGKILL
        assert not any(pid_alive(p) for p in pids) and not os.path.exists(rundir)


async def test_shutdown_rpc_stops_a_subtree_or_the_instance(start_instance, connect) -> None:
    """``broker.shutdown`` (``flux shutdown``): on rank 1 it stops ranks 1
    and 3 (rank 1's subtree), cleanly; on rank 0 every remaining rank."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h = await connect(inst, 0)
        assert await h.rpc("broker.shutdown", {}, nodeid=1) == {"rank": 1}
        assert [await inst.procs[r].wait() for r in (1, 3)] == [0, 0]
        assert (await h.ping(2))["rank"] == 2  # the rest serves on
        assert await h.rpc("broker.shutdown", {}, nodeid=0) == {"rank": 0}
        assert [await inst.procs[r].wait() for r in (0, 2)] == [0, 0]


async def test_a_parent_closes_a_childs_link_once_it_answered_the_shutdown(
        start_instance, connect, tmp_path) -> None:
    """A child that wrote to its parent just after the parent closed their
    link got EPIPE, and the link was torn down with the parent's shutdown
    still unread: the child stopped as if its parent were lost, status 1
    (a chain of 16 ranks, all sent SIGTERM, stopped with status 1 one time
    in three).  A child now answers the shutdown as it reads it, and its
    parent closes the link once it has (as a child waits for the answer to
    its goodbye) -- or after 1 s, for a child that cannot answer: here rank
    1, held by SIGSTOP, which then stops as told."""
    inst = await start_instance(size=2, attrs={"log.level": "info"})
    async with asyncio.timeout(30):
        h0 = await connect(inst, 0)
        rank1 = inst.pids()[1]
        os.kill(rank1, signal.SIGSTOP)
        try:
            assert await h0.rpc("broker.shutdown", {}, nodeid=0) == {"rank": 0}
            assert await inst.procs[0].wait() == 0
        finally:
            os.kill(rank1, signal.SIGCONT)
        assert await inst.procs[1].wait() == 0
    log = (tmp_path / "broker-0.log").read_text()
    assert ("kvbroker[0]: INFO kvbroker.overlay: child rank(s) 1 did not answer this rank's "
            "shutdown within 1.0 s: their links are closed anyway") in log, log
    # answered: no wait, no such line
    inst = await start_instance(size=4, fanout=1, attrs={"log.level": "info"})
    assert await inst.stop() == [0, 0, 0, 0]
    assert "did not answer" not in (tmp_path / "broker-1.log").read_text()


async def test_a_rank_whose_parent_dies_stops_with_its_subtree(start_instance, connect) -> None:
    """A subtree cut off from rank 0 does not linger: rank 1 dies, so rank 3
    (its child) stops by itself with status 1, and rank 3's client is told
    (not left waiting on requests that can never go upstream)."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h3 = await connect(inst, 3)
        assert (await h3.ping(0))["rank"] == 0
        os.kill(inst.pids()[1], signal.SIGKILL)
        assert await inst.procs[3].wait() == 1
        with pytest.raises(RemoteError) as info:
            await h3.ping(0)
        assert info.value.errnum == errno.ECONNRESET
        h0 = await connect(inst, 0)  # rank 0 and rank 2 keep serving
        assert (await h0.ping(2))["rank"] == 2


@pytest.mark.parametrize(("transport", "why"), [
    ("unix", "its connection closed"),
    ("tcp", "its connection closed, or it answered no heartbeat for 10 s")])
async def test_a_rank_lost_is_a_warning_a_rank_shut_down_is_not(
        start_instance, connect, tmp_path, transport: str, why: str) -> None:
    """Rank 0 logged both at INFO, ``lost the connection to child rank N``:
    at the default level (warning) a dead rank left no trace in its
    parent's log.  A rank that stops on purpose now says goodbye first
    (``overlay.goodbye``, as Flux's) and its parent logs it at INFO with
    why; a rank lost otherwise is a WARNING naming it and why."""
    inst = await start_instance(size=3, fanout=2,
                                attrs={"tbon.transport": transport, "log.level": "info"})
    log = tmp_path / "broker-0.log"

    def lines(rank: int) -> list[str]:
        return [line for line in log.read_text().splitlines() if f"kvbroker[{rank}]:" in line]

    def about(child: int) -> list[str]:
        return [line for line in lines(0) if f"child rank {child} " in line]

    async with asyncio.timeout(30):
        h = await connect(inst, 0)
        assert await h.rpc("broker.shutdown", {}, nodeid=2) == {"rank": 2}
        assert await inst.procs[2].wait() == 0

        async def said(child: int) -> bool:
            return bool(about(child))

        await wait_until(lambda: said(2), "rank 0 to log rank 2's stop")
        assert [line.split(": ", 1)[1] for line in about(2)] == [
            "INFO kvbroker.overlay: child rank 2 stopped (kvbroker shutdown "
            "(broker.shutdown))"], lines(0)
        os.kill(inst.pids()[1], signal.SIGKILL)
        await wait_until(lambda: said(1), "rank 0 to log rank 1's loss")
        assert [line.split(": ", 1)[1] for line in about(1)] == [
            f"WARNING kvbroker.overlay: lost child rank 1 unexpectedly: {why} (requests in "
            "flight to its subtree are answered EHOSTUNREACH)"], lines(0)
        assert (await h.ping(0))["rank"] == 0  # and rank 0 serves on


@pytest.mark.parametrize("transport", ["unix", "ipc", "tcp"])
@pytest.mark.parametrize("victim", [3, 1])
async def test_requests_in_flight_to_a_lost_rank_are_answered(
        start_instance, connect, transport: str, victim: int) -> None:
    """A request already forwarded down when the rank below dies gets
    EHOSTUNREACH (as Flux's RPC tracker answers it), not silence -- whether
    the dead rank was the target (3) or on the way to it (1)."""
    inst = await start_instance(size=4, fanout=2, attrs={"tbon.transport": transport})
    async with asyncio.timeout(30):
        h = await connect(inst, 0)
        for _ in range(20):  # answered requests leave nothing tracked
            await h.ping(3)
        assert (await stats(h, 0))["sent-down"] == 0
        # waits on rank 3 until a version that never comes
        waiting = h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**9},
                        nodeid=3)

        parent = 1 if victim == 3 else 0

        async def tracked() -> bool:  # forwarded by the victim's parent
            return (await stats(h, parent))["sent-down"] == 1

        await wait_until(tracked, "the request to be forwarded to the victim")
        os.kill(inst.pids()[victim], signal.SIGKILL)
        with pytest.raises(RemoteError) as info:
            await waiting
        assert info.value.errnum == errno.EHOSTUNREACH
        # answered by the dead rank's parent
        assert f"rank {victim} was lost before answering" in str(info.value)
        assert (await stats(h, parent))["messages"]["lost-requests"] == 1
        assert (await stats(h, 0))["sent-down"] == 0
        assert (await h.ping(2))["rank"] == 2  # the rest keeps serving


@pytest.mark.parametrize("how", ["close", "kill"])
async def test_requests_a_client_abandons_down_the_tree_are_not_held(
        start_instance, connect, how: str, tmp_path) -> None:
    """A watch and a version wait served on rank 3 by a client of rank 0
    that goes away: the services end them without answering, so every
    rank on the way (0 and 1) held them for ever, ~0.6 KB a request (one
    per abandoned remote watch).  The client's disconnect now clears them."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h = await connect(inst, 0)
        await h.rpc("kvs.commit", {"namespace": "primary", "ops": [
            {"key": "w", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": b"1"}}]})
        if how == "close":
            c = await connect(inst, 0)
            for _ in range(3):
                s = c.rpc_stream("kvs-watch.lookup",
                                 {"namespace": "primary", "key": "w", "flags": 4}, nodeid=3)
                assert await s.next_message() is not None
            c.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**9},
                  nodeid=3).add_done_callback(lambda f: f.exception())
            await c.ping(3)  # the wait is on its way down before the next ping returns
            await c.close()
        else:
            script = tmp_path / "abandon.py"
            script.write_text(textwrap.dedent(f"""
                import asyncio, sys
                from broker.handle import Handle
                async def main():
                    c = await Handle.connect({inst.uri(0)!r})
                    for _ in range(3):
                        s = c.rpc_stream("kvs-watch.lookup",
                                         {{"namespace": "primary", "key": "w", "flags": 4}},
                                         nodeid=3)
                        await s.next_message()
                    c.rpc("kvs.wait-version", {{"namespace": "primary", "rootseq": 10**9}},
                          nodeid=3)
                    await c.ping(3)
                    print("ready", flush=True)
                    await asyncio.sleep(60)
                asyncio.run(main())
                """))
            proc = await asyncio.create_subprocess_exec(sys.executable, str(script),
                                                        stdout=subprocess.PIPE)
            assert proc.stdout is not None
            assert await proc.stdout.readline() == b"ready\n"
            assert [(await stats(h, r))["sent-down"] for r in (0, 1)] == [4, 4]
            proc.kill()
            await proc.wait()

        async def released() -> bool:
            return [(await stats(h, r))["sent-down"] for r in (0, 1)] == [0, 0]

        await wait_until(released, "ranks 0 and 1 to forget the abandoned requests")
        watchers = await h.rpc("kvs-watch.stats-get", {}, nodeid=3)
        assert watchers["watchers"] == 0
        assert (await h.ping(3))["rank"] == 3


async def test_what_a_lost_rank_s_clients_left_on_another_subtree_ends(
        start_instance, connect) -> None:
    """A client of rank 3 leaves a version wait and a watch served by rank 2
    (3 -> 1 -> 0 -> 2); rank 1 dies, and rank 3 with it.  Nobody sends
    their disconnect, so rank 2 kept both, and rank 0 tracked them, for
    ever.  Rank 0, losing rank 1, now sends it for them."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h3 = await connect(inst, 3)
        h3.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**9},
               nodeid=2).add_done_callback(lambda f: f.exception())
        watch = h3.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "nobody",
                                                   "flags": 4 | 8}, nodeid=2)
        h0 = await connect(inst, 0)

        async def served() -> bool:
            waits = (await h0.rpc("kvs.stats-get", {}, nodeid=2))["namespaces"]
            watchers = (await h0.rpc("kvs-watch.stats-get", {}, nodeid=2))["watchers"]
            return waits.get("primary", {}).get("waiters") == 1 and watchers == 1

        await wait_until(served, "rank 2 to serve the wait and the watch")
        assert (await stats(h0, 0))["sent-down"] == 2
        os.kill(inst.pids()[1], signal.SIGKILL)

        async def ended() -> bool:
            waits = (await h0.rpc("kvs.stats-get", {}, nodeid=2))["namespaces"]
            watchers = (await h0.rpc("kvs-watch.stats-get", {}, nodeid=2))["watchers"]
            return (waits.get("primary", {}).get("waiters") == 0 and watchers == 0
                    and (await stats(h0, 0))["sent-down"] == 0)

        await wait_until(ended, "rank 2 to drop what rank 3's client left")
        with pytest.raises(RemoteError):
            await watch.next_message()


@pytest.mark.parametrize("server", [0, 1, 2])
async def test_what_a_lost_rank_s_clients_left_elsewhere_ends(
        start_instance, connect, server: int) -> None:
    """A client of rank 3 leaves a version wait and a watch that never
    answers again on an ancestor (rank 0, or its parent rank 1) or on
    another subtree (rank 2); rank 3 dies.  Those above it stayed for ever
    (nothing answered them, so nothing noticed), and a watch elsewhere
    went only with its next answer.  The rank that loses the link (rank
    1) now sends the client's disconnects, and forgets what it noted of
    the link's clients."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h0 = await connect(inst, 0)
        h3 = await connect(inst, 3)
        h3.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**9},
               nodeid=server).add_done_callback(lambda f: f.exception())
        watch = h3.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "nobody",
                                                   "flags": 4 | 8}, nodeid=server)

        async def served(waiters: int, watchers: int) -> bool:
            waits = (await h0.rpc("kvs.stats-get", {}, nodeid=server))["namespaces"]
            watches = (await h0.rpc("kvs-watch.stats-get", {}, nodeid=server))["watchers"]
            return (waits.get("primary", {}).get("waiters"), watches) == (waiters, watchers)

        await wait_until(lambda: served(1, 1), f"rank {server} to serve the wait and the watch")
        assert (await stats(h0, 1))["used-below"] >= 2  # kvs and kvs-watch of h3's route
        os.kill(inst.pids()[3], signal.SIGKILL)
        await wait_until(lambda: served(0, 0), f"rank {server} to drop what rank 3's client left")
        assert (await stats(h0, 1))["used-below"] == 0
        assert (await stats(h0, 1))["messages"]["disconnects-sent"] >= 2
        del watch


async def test_a_client_s_disconnect_forgets_what_ranks_above_noted(
        start_instance, connect) -> None:
    """What a rank notes of the clients below each link goes when the
    client's own disconnect passes: a client that comes and goes leaves
    nothing behind on the ranks between it and the services it used."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h0 = await connect(inst, 0)
        base = [(await stats(h0, r))["used-below"] for r in (0, 1)]
        h3 = await Handle.connect(inst.uri(3))
        await h3.ping(0)
        await h3.rpc("kvs.getroot", {"namespace": "primary"}, nodeid=0)
        s = h3.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "nobody",
                                               "flags": 4 | 8}, nodeid=0)
        await h3.publish("any.thing")  # rank 3's event service passes it on to rank 0
        await h3.ping(0)  # the watch went up before this ping came back
        assert [(await stats(h0, r))["used-below"] for r in (0, 1)] == [b + 4 for b in base]
        await h3.close()

        async def forgotten() -> bool:
            return [(await stats(h0, r))["used-below"] for r in (0, 1)] == base

        await wait_until(forgotten, "ranks 0 and 1 to forget the closed client")
        del s
        # a publish sent to rank 1 by a client of rank 3: rank 1's event
        # service passes it on to rank 0, and the client's disconnect with it
        h3 = await Handle.connect(inst.uri(3))
        await h3.rpc("event.pub", {"topic": "via.rank1"}, nodeid=1)
        assert [(await stats(h0, r))["used-below"] for r in (0, 1)] == [b + 1 for b in base]
        await h3.close()
        await wait_until(forgotten, "ranks 0 and 1 to forget the publisher")
        # and by a client of rank 0: rank 1 gets its disconnect from its parent
        p0 = await Handle.connect(inst.uri(0))
        await p0.rpc("event.pub", {"topic": "via.rank1"}, nodeid=1)
        assert (await stats(h0, 0))["used-below"] == base[0] + 1  # (r1's, for rank 0)
        await p0.close()
        await wait_until(forgotten, "rank 0 to forget its own client's publish")


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_a_goodbye_the_parent_does_not_answer_is_a_warning(
        start_instance, connect, tmp_path, transport: str) -> None:
    """A rank stopping cleanly whose parent does not answer its goodbye
    (here: stopped) closes its link after 1 s anyway, and the parent may
    then log it as lost: a stop that went wrong, which the rank said at
    INFO only -- nothing on its stderr at the default level (warning).  As
    Flux's "goodbye timeout" (an error there), it is a WARNING; the rank
    still exits 0 (it stopped as asked)."""
    inst = await start_instance(size=2, fanout=2, attrs={"tbon.transport": transport})
    parent = inst.pids()[0]
    h1 = await connect(inst, 1)
    await stop_process(parent)
    try:
        async with asyncio.timeout(30):
            assert await h1.rpc("broker.shutdown", {}, nodeid=1) == {"rank": 1}
            assert await inst.procs[1].wait() == 0
    finally:
        os.kill(parent, signal.SIGCONT)
    lines = [line.split(": ", 1)[1] for line in
             (tmp_path / "broker-0.log").read_text().splitlines() if "kvbroker[1]:" in line]
    assert lines == ["WARNING kvbroker.overlay: parent rank 0 did not answer "
                     "this rank's goodbye within 1.0 s: its link is closed anyway (the "
                     "parent may log this rank as lost)"], lines


async def test_a_lost_rank_s_whole_subtree_exits_1(start_instance) -> None:
    """Rank 0 dies: ranks 1 and 2 lose their parent and exit 1; rank 3,
    told to stop by rank 1, exited 0, so a supervisor restarting ranks that
    fail (Restart=on-failure) never brought it back."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        os.kill(inst.pids()[0], signal.SIGKILL)
        codes = [await inst.procs[r].wait() for r in (1, 2, 3)]
        assert codes == [1, 1, 1]


async def test_a_client_may_not_send_a_disconnect(start_instance, connect) -> None:
    """Only the broker says a client went away: a live client's own
    ``kvs.disconnect`` made every rank on the way forget its requests in
    flight, so a lost rank's EHOSTUNREACH never came."""
    inst = await start_instance(size=4, fanout=2)
    async with asyncio.timeout(30):
        h = await connect(inst, 0)
        waiting = h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**9},
                        nodeid=3)

        async def tracked() -> bool:
            return [(await stats(h, r))["sent-down"] for r in (0, 1)] == [1, 1]

        await wait_until(tracked, "the wait to be forwarded to rank 3")
        h.send_noresponse("kvs.disconnect", nodeid=3)
        with pytest.raises(RemoteError) as info:
            await h.rpc("kvs.disconnect", {}, nodeid=3)
        assert info.value.errnum == errno.EPERM
        assert (await stats(h, 0))["messages"]["dropped-local"] == 2
        assert [(await stats(h, r))["sent-down"] for r in (0, 1)] == [1, 1]
        os.kill(inst.pids()[3], signal.SIGKILL)
        with pytest.raises(RemoteError) as info:
            await waiting
        assert info.value.errnum == errno.EHOSTUNREACH


async def wait_for_rank(uri: str) -> Handle:
    """Connect once the rank's socket is there (it has no 'ready' line yet)."""
    while True:
        try:
            return await Handle.connect(uri)
        except (FileNotFoundError, ConnectionRefusedError):
            await asyncio.sleep(0.01)


@pytest.mark.parametrize("how", ["launcher-gone", "sigterm"])
async def test_a_rank_stopped_during_start_up_exits(how: str) -> None:
    """Rank 0 of a 2-rank instance whose rank 1 never comes waits for it -- and
    must still stop on SIGTERM (a stop asked for: status 0) or when its
    launcher goes away (a failure: status 1)."""
    rundir = make_rundir()
    r, w = os.pipe()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "broker.rank",
        "--rank",
        "0",
        "--size",
        "2",
        "--rundir",
        rundir,
        "--watch-fd",
        str(r),
        "--attrs",
        '{"broker.modules": ""}',
        pass_fds=(r,),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    os.close(r)
    try:
        async with asyncio.timeout(15):
            h = await wait_for_rank(f"local://{rundir}/local-0")
            async with h:
                assert (await h.ping())["rank"] == 0  # up, but the tree is not
                if how == "sigterm":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.close(w)
                    w = -1
                assert await proc.wait() == (0 if how == "sigterm" else 1)
            assert proc.stdout is not None
            assert await proc.stdout.read() == b""  # it never claimed to be ready
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if w >= 0:
            os.close(w)
        shutil.rmtree(rundir, ignore_errors=True)


def test_imports_leave_the_event_loop_policy_alone() -> None:
    code = textwrap.dedent(
        """
        import asyncio, importlib, importlib.util, pkgutil, sys
        before = type(asyncio.get_event_loop_policy())
        names = []
        for top in ("broker", "kvs", "kvs_watch"):
            if importlib.util.find_spec(top) is None:
                continue
            pkg = importlib.import_module(top)
            names.append(top)
            for info in pkgutil.walk_packages(pkg.__path__, top + "."):
                try:
                    importlib.import_module(info.name)
                except ImportError:
                    if top == "broker":
                        raise
                    continue  # another package still being written
                names.append(info.name)
        after = type(asyncio.get_event_loop_policy())
        assert after is before, (before, after)
        assert "uvloop" not in after.__module__
        assert asyncio.events._get_running_loop() is None
        print(" ".join(names))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    imported = out.stdout.split()
    for name in (
        "broker.broker",
        "broker.handle",
        "broker.loops",
        "broker.cli",
        "broker.content.module",
        "broker.sync",
    ):
        assert name in imported


def test_an_instance_has_no_uri_before_it_starts() -> None:
    """(It returned "local://local-0", a socket nowhere.)"""
    from broker.launch import Instance

    with pytest.raises(RuntimeError, match="not started"):
        Instance(2).uri(0)


def processes_of(rundir: str) -> list[int]:
    """Live processes with ``rundir`` on their command line (the ranks of an
    instance, whether or not its launcher still knows them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if os.fsencode(rundir) in argv:
            found.append(int(entry))
    return found


async def cancel_after(coro: Any, steps: int) -> None:
    """Run ``coro`` as a task for ``steps`` turns of the loop, then cancel it;
    it must end cancelled.  (``sleep(0)`` is one turn, not a wait: a task
    created now runs its next step before this one resumes.)"""
    task = asyncio.ensure_future(coro)
    for _ in range(steps):
        await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="looks for ranks in /proc")
@pytest.mark.both_loops
async def test_a_cancelled_stop_still_removes_the_run_directory(tmp_path) -> None:
    """Cancelled while it waits for the ranks (a second Ctrl-C in the
    benchmark runner), stop() skipped removing the run directory."""
    inst = Instance(3, 2, event_loop=loop_name(asyncio.get_running_loop()),
                    stderr_path=str(tmp_path / "ranks.log"))
    await asyncio.wait_for(inst.start(), 60)
    rundir, procs = inst.rundir, list(inst.procs)
    async with asyncio.timeout(30):
        await cancel_after(inst.stop(), 1)  # SIGTERM sent, waiting for the ranks
        assert not os.path.exists(rundir)
        # the ranks exit anyway: they have their SIGTERM (and no launcher pipe)
        await asyncio.gather(*(p.wait() for p in procs))
    assert processes_of(rundir) == []


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="looks for ranks in /proc")
@pytest.mark.both_loops
@pytest.mark.parametrize("steps", [1, 4, 16])
async def test_a_start_cancelled_while_spawning_leaves_nothing(tmp_path, steps: int) -> None:
    """Cancelled inside its loop of rank spawns (before the clean-up that
    covered only the wait for 'ready'), start() left the run directory and
    the ranks spawned so far.  Wherever the cancel lands in the first turns
    of the loop, nothing is left: a rank the spawner had forked but not yet
    reported dies with it (its parent-death signal), a moment later."""
    inst = Instance(3, 2, event_loop=loop_name(asyncio.get_running_loop()),
                    stderr_path=str(tmp_path / "ranks.log"))
    async with asyncio.timeout(30):
        await cancel_after(inst.start(), steps)
        assert inst.rundir and not os.path.exists(inst.rundir)
        await asyncio.gather(*(p.wait() for p in inst.procs))

    async def none_left() -> bool:
        return processes_of(inst.rundir) == []
    await wait_until(none_left, "the ranks to be gone", 10)


async def test_stats_tell_a_rank_s_resident_memory_now_not_only_its_peak(
        start_instance, connect) -> None:
    """``rss_mb`` is the peak, which never comes down; an
    operator watching a rank's memory had nothing else.  ``rss_now_mb`` is
    what the kernel says the rank holds now (``VmRSS``)."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    for rank in (0, 1):
        before = _vm_rss_mb(inst.pids()[rank])
        st = await stats(h, rank)
        after = _vm_rss_mb(inst.pids()[rank])
        assert min(before, after) - 2 <= st["rss_now_mb"] <= max(before, after) + 2, (
            st["rss_now_mb"], before, after)
        assert st["rss_now_mb"] <= st["rss_mb"] + 1


async def test_a_rank_s_peak_memory_is_never_below_its_memory_now(
        start_instance, connect) -> None:
    """``rss_mb``, the peak, came from ``ru_maxrss``, which lags the
    kernel's resident counters: read beside ``rss_now_mb`` (``VmRSS``) it
    was 0.1-0.2 MiB below it on a rank that had just been working, a
    "peak" smaller than what the rank held.  Both come from one read now."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    kvs = KVS(h)
    async with asyncio.timeout(60):
        for i in range(20):
            # (memory that stays: the blobs kept in rank 0's cache, each put
            # a new peak, read while the kernel's counters catch up)
            await kvs.put(f"k{i}", os.urandom(256 << 10).hex())
            st = await stats(h, 0)
            assert st["rss_now_mb"] <= st["rss_mb"], (i, st["rss_now_mb"], st["rss_mb"])


def _vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


_DESCRIPTOR_LIMIT_SCRIPT = """
import asyncio, json, os, resource
from broker.launch import Instance

def descriptors():
    return len(os.listdir("/proc/self/fd"))

async def main():
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    before = descriptors()
    big = Instance(size=300, fanout=16)
    try:
        await big.start(timeout=30)
        failed = None
    except OSError as exc:
        failed = exc.errno
    await big.stop()
    after = descriptors()
    small = Instance(size=1)
    await small.start(timeout=30)
    await small.stop()
    print(json.dumps({"failed": failed, "leaked": after - before,
                      "left": os.listdir(os.environ["TMPDIR"])}))

asyncio.run(main())
"""


async def test_a_start_past_the_descriptor_limit_leaves_none_open(tmp_path) -> None:
    """A start that fails making its ranks' pipes (EMFILE: a size past the
    descriptor limit) closes those it made: left open, every later start in
    the process failed with EMFILE too, and the run directory stayed."""
    rc, out, err = await run_program(sys.executable, "-c", _DESCRIPTOR_LIMIT_SCRIPT,
                                     cwd=os.path.dirname(os.path.dirname(__file__)),
                                     env={**os.environ, "TMPDIR": str(tmp_path)}, timeout=90)
    assert rc == 0, err[-3000:]
    assert json.loads(out) == {"failed": errno.EMFILE, "leaked": 0, "left": []}
