"""A handle that reconnects (``Handle.connect(reconnect=True)``, as ``flux
proxy --reconnect``) when its rank restarts: requests in flight fail with
``ECONNRESET``, requests made meanwhile wait for the new connection, event
subscriptions are renewed, and key watches take up where they were.

The rank that restarts is rank 1 of a 2-rank instance started from a
bootstrap file (as under systemd), killed and started again on the same
run directory, so its socket is at the same path."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_broker_support import KVBROKER
from test_multihost import brokers, exit_codes, keyed_config  # noqa: F401 (a fixture)
from test_ssh_connector import ssh_uri, standin  # noqa: F401 (a fixture)
from test_watch_helpers import wait_until, wait_watchers

from broker.errors import RemoteError
from broker.handle import Handle
from kvs.client import KVS, SyncKVS
from kvs_watch import flags as F
from kvs_watch.client import (
    NS_LISTED,
    NamespaceEvent,
    NamespaceWatch,
    watch,
    watch_eventlog,
    watch_keys,
    watch_namespaces,
)
from kvs_watch.resume import WatchResume


class Restartable:
    """Rank 0, and rank 1 on a fixed run directory (its socket's path stays)."""

    def __init__(self, tmp_path: Path, brokers) -> None:  # noqa: F811
        self.tmp_path, self.brokers = tmp_path, brokers
        self.rundir = tmp_path / "run1"
        self.uri1 = f"local://{self.rundir}/local-1"

    async def start(self) -> Restartable:
        self.config = await keyed_config(self.tmp_path, 2, 2)
        self.rank0 = await self.brokers(self.config, 0)
        await self.start_rank1()  # (rank 0 is ready once its subtree is)
        await self.rank0.ready()
        return self

    async def start_rank1(self) -> None:
        self.rank1 = await self.brokers(self.config, 1, "--rundir", str(self.rundir))
        await self.rank1.ready()

    async def kill_rank1(self) -> None:
        self.rank1.proc.kill()
        assert await exit_codes([self.rank1], self.tmp_path) == [-signal.SIGKILL]

    async def stop_rank1(self, how: str) -> None:
        """SIGKILL, or SIGTERM (``systemctl restart``): a rank that stops
        first ends its watches with ENOSYS, "this rank is stopping", which
        a reconnecting handle's watch passed to its reader, ending it."""
        if how == "kill":
            await self.kill_rank1()
            return
        self.rank1.proc.send_signal(signal.SIGTERM)
        assert await exit_codes([self.rank1], self.tmp_path) == [0]


@pytest.fixture
async def inst(tmp_path: Path, brokers) -> Restartable:  # noqa: F811
    return await Restartable(tmp_path, brokers).start()


async def test_a_reconnecting_handle_outlives_a_restart_of_its_rank(inst: Restartable) -> None:
    """In flight at the crash: ``ECONNRESET`` saying so (whether the rank
    acted on it is unknown).  Made while the rank is away: sent once it is
    back, and answered.  The event subscription is made again."""
    async with asyncio.timeout(60), Handle.connect(inst.rank0.uri) as h0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        kvs = KVS(h)
        await kvs.put("a", "1")
        await h.subscribe("test.")
        assert h.connected and h.reconnects == 0
        never = h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**6})
        await inst.kill_rank1()
        with pytest.raises(RemoteError) as lost:
            await never
        assert lost.value.errnum == errno.ECONNRESET
        assert "reconnecting" in lost.value.errstr, lost.value.errstr
        assert not h.connected and "reconnecting" in repr(h)
        meanwhile = h.rpc("broker.ping", {}, nodeid=0)  # (parked: nobody listens there)
        put = asyncio.ensure_future(kvs.put("b", "2"))
        await inst.start_rank1()
        await h.wait_connected()
        assert h.connected and h.reconnects == 1
        route = (await meanwhile)["route"]
        assert route[-1] == "r0" and route[-2].startswith("r1"), route
        await put
        assert await kvs.get_str("b") == "2" and await kvs.get_str("a") == "1"
        await h0.publish("test.x", {"n": 1})
        event = await asyncio.wait_for(h.recv_event(), 10)
        assert (event.topic, event.payload) == ("test.x", {"n": 1})


async def test_calls_cut_short_leave_the_handle_in_step_with_its_rank(inst: Restartable) -> None:
    """A ``subscribe`` cut short once it was sent still subscribes on the
    rank, and an ``unsubscribe`` so cut still unsubscribes: the handle
    counts each as it leaves, so the reconnect subscribes again exactly
    what the rank had.  And the tags it kept out of use for answers that
    might still come on the lost connection are free again."""
    async with asyncio.timeout(60), Handle.connect(inst.rank0.uri) as h0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await h.subscribe("fence.")
        await h.subscribe("gone.")

        async def cut_short(call) -> None:
            task = asyncio.ensure_future(call)
            await asyncio.sleep(0)  # its first step: the request is sent
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        await cut_short(h.subscribe("cut."))
        await cut_short(h.unsubscribe("gone."))
        with pytest.raises(TimeoutError):  # given up on: its tag kept out of use
            await asyncio.wait_for(h.rpc("kvs.wait-version", {
                "namespace": "primary", "rootseq": 10**6}), 0.05)
        await h.rpc("broker.ping", {}, nodeid=1)  # (the answers to the cut calls came)
        assert h.retired >= 1
        await inst.kill_rank1()
        await inst.start_rank1()
        await h.wait_connected()
        assert h.retired == 0
        await h.rpc("broker.ping", {}, nodeid=1)  # (after the subscriptions made again)
        for topic in ("gone.1", "cut.1", "fence.1"):
            await h0.publish(topic)
        got = []
        while not got or got[-1] != "fence.1":
            got.append((await asyncio.wait_for(h.recv_event(), 10)).topic)
        assert got == ["cut.1", "fence.1"]


async def test_a_handle_over_ssh_reconnects_through_a_new_relay(
        inst: Restartable, standin: Path) -> None:  # noqa: F811
    """Over ``ssh://`` the relay goes with the rank's connection; the handle
    reaps that ssh and runs a new one (which fails while the rank is
    away, and is run again)."""
    async with asyncio.timeout(60), Handle.connect(ssh_uri(inst.uri1), reconnect=True) as h:
        kvs = KVS(h)
        await kvs.put("a", "1")
        first = h._ssh
        assert first is not None
        await inst.kill_rank1()

        async def lost() -> bool:  # (once the relay has gone too)
            return not h.connected

        await wait_until(lost, what="the relay's end")
        put = asyncio.ensure_future(kvs.put("a", "2"))
        await inst.start_rank1()
        await put
        assert await kvs.get_str("a") == "2" and h.reconnects == 1
        assert first.returncode is not None  # (reaped)
        assert h._ssh is not None and h._ssh is not first and h._ssh.returncode is None


async def test_the_cli_watches_go_on_with_reconnect(inst: Restartable) -> None:
    """``kvs get --watch --reconnect`` and ``kvs eventlog get --watch
    --reconnect`` print what changed while their rank restarted, once, and
    go on (without it they fail: the other test of this file)."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0:
        await kvs0.put("k", "1")
        await kvs0.append_event("log", "first")
        version = (await kvs0.put("ready", "1")).rootseq
        async with KVS.connect(inst.uri1) as kvs1:
            await kvs1.wait_version(version)
        env = dict(os.environ, KVBROKER_URI=inst.uri1)
        watchers = [await asyncio.create_subprocess_exec(
            KVBROKER, "kvs", *argv, "--reconnect", "--count", "3", env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
            for argv in (["get", "--watch", "k"], ["eventlog", "get", "--watch", "log"])]
        try:
            for w, first in zip(watchers, ("1", "first"), strict=True):
                assert w.stdout is not None
                line = (await w.stdout.readline()).decode()
                assert first in line, (line, await w.communicate())
            await inst.kill_rank1()
            await kvs0.put("k", "2")
            await kvs0.append_event("log", "second")
            await inst.start_rank1()
            # What changed meanwhile, once each, before anything else changes:
            # a change made once a watch is registered again may land before
            # its first lookup, and the two then make one change ("3" alone).
            for w, meanwhile in zip(watchers, ("2", "second"), strict=True):
                assert w.stdout is not None
                line = (await w.stdout.readline()).decode()
                assert meanwhile in line, (line, await w.communicate())
            await kvs0.put("k", "3")
            await kvs0.append_event("log", "third")
            (get_out, get_err), (log_out, log_err) = [await w.communicate() for w in watchers]
        finally:
            for w in watchers:
                if w.returncode is None:
                    w.kill()
                    await w.wait()
        assert [w.returncode for w in watchers] == [0, 0], (get_err, log_err)
        assert get_out.decode().splitlines() == ["3"]
        assert [line.split()[1] for line in log_out.decode().splitlines()] == ["third"]


async def test_a_handle_without_reconnect_stays_lost(inst: Restartable) -> None:
    """The default is unchanged: a lost connection is the handle's end."""
    async with asyncio.timeout(60), Handle.connect(inst.uri1) as h:
        await inst.kill_rank1()
        with pytest.raises(RemoteError) as lost:
            await h.wait_connected()
        assert lost.value.errnum == errno.ECONNRESET
        with pytest.raises(RemoteError):
            await h.ping()
        await inst.start_rank1()
        with pytest.raises(RemoteError):
            await h.ping()
        assert h.reconnects == 0


async def test_every_call_after_a_loss_says_the_connection_was_lost(inst: Restartable) -> None:
    """Calls made every loop turn as the rank is killed: each fails with
    ``connection to broker lost``.  For the one turn between the transport
    closing and the loss being handled, a call said "not connected to a
    broker" instead (a chaos probe: one call per task per kill)."""
    seen: set[str] = set()
    async with asyncio.timeout(60), Handle.connect(inst.uri1) as h:
        stop = False

        def note(f: asyncio.Future[object]) -> None:
            if not f.cancelled() and isinstance(f.exception(), RemoteError):
                seen.add(f.exception().errstr)  # type: ignore[union-attr]

        async def spin() -> None:
            while not stop:
                try:
                    h.rpc("broker.ping", {}).add_done_callback(note)
                except RemoteError as exc:
                    seen.add(exc.errstr)
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(spin()) for _ in range(10)]
        await h.ping()
        await inst.kill_rank1()
        with pytest.raises(RemoteError):
            await h.wait_connected()
        await asyncio.sleep(0)  # (a turn more of calls, made after the loss was handled)
        stop = True
        await asyncio.gather(*tasks)
    assert seen == {"connection to broker lost"}


async def test_closing_a_reconnecting_handle_fails_what_waits(inst: Restartable) -> None:
    """Closed while the rank is away: the parked requests and the tasks
    waiting for the connection fail, nothing is sent later."""
    async with asyncio.timeout(60):
        h = await Handle.connect(inst.uri1, reconnect=True)
        await h.ping()
        never = h.rpc("kvs.wait-version", {"namespace": "primary", "rootseq": 10**6})
        await inst.kill_rank1()
        with pytest.raises(RemoteError):
            await never  # (lost: the handle dials again from now on)
        parked = h.rpc("broker.ping", {})
        waiting = asyncio.ensure_future(h.wait_connected())
        await asyncio.sleep(0)
        await h.close()
        for fut in (parked, waiting):
            with pytest.raises(RemoteError) as closed:
                await fut
            assert (closed.value.errnum, closed.value.errstr) == (errno.ECONNRESET,
                                                                  "handle closed")
        assert not h.connected and h.pending == 0


@pytest.mark.parametrize("how", ["kill", "term"])
async def test_watches_take_up_where_they_were_after_a_restart(inst: Restartable,
                                                              how: str) -> None:
    """Changed while the rank was away: the new value, once (not the one
    already seen first).  Unchanged: nothing until the next change.  An
    eventlog (an append watch): only the entries appended meanwhile."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await kvs0.put("k", "1")
        await kvs0.put("same", "s")
        await kvs0.append_event("log", "first")
        version = (await kvs0.put("ready", "1")).rootseq
        await KVS(h).wait_version(version)
        async with watch(h, "k") as changed, watch(h, "same") as unchanged, \
                watch_eventlog(h, "log") as log:
            assert (await anext(changed)).value == b"1"
            assert (await anext(unchanged)).value == b"s"
            assert (await anext(log))["name"] == "first"
            await inst.stop_rank1(how)
            await kvs0.put("k", "2")
            await kvs0.append_event("log", "second")
            await inst.start_rank1()
            assert (await anext(changed)).value == b"2"
            assert (await anext(log))["name"] == "second"
            await kvs0.put("same", "t")
            assert (await anext(unchanged)).value == b"t"
            await kvs0.put("k", "3")
            await kvs0.append_event("log", "third")
            assert (await anext(changed)).value == b"3"
            assert (await anext(log))["name"] == "third"
        assert h.reconnects == 1 and h.pending == 0


@pytest.mark.parametrize("how", ["kill", "term"])
async def test_a_key_watch_catches_up_on_what_changed_while_away(inst: Restartable,
                                                                 how: str) -> None:
    """``watch_keys`` resumes from the last root it reported (its ``since``):
    the keys two commits wrote meanwhile come in one answer, not initial;
    a restart with no change meanwhile yields nothing extra."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await KVS(h).wait_version((await kvs0.put("other", "x")).rootseq)
        async with watch_keys(h, "d") as w:
            assert (await anext(w)).initial
            await kvs0.put("d.a", "1")
            assert (await anext(w)).keys == ("d.a",)
            await inst.stop_rank1(how)
            await kvs0.put("d.b", "2")
            await kvs0.put("d.c", "3")
            await kvs0.put("other", "y")
            await inst.start_rank1()
            caught_up = await anext(w)
            assert not caught_up.initial and sorted(caught_up.keys) == ["d.b", "d.c"]
            await inst.stop_rank1(how)
            await inst.start_rank1()
            resumed = asyncio.ensure_future(anext(w))  # (nothing changed meanwhile)
            await wait_watchers(h, 1)
            await kvs0.put("d.e", "4")
            assert (await resumed).keys == ("d.e",)
        assert h.reconnects == 2


async def test_a_timeout_around_anext_while_the_rank_is_away_ends_no_watch(
        inst: Restartable) -> None:
    """A bounded wait for the next item while the handle reconnects: the
    timeout cut the wait for the rank short, the watch was left on its old,
    ended stream, and the next ``anext`` ended it silently."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await KVS(h).wait_version((await kvs0.put("k", "1")).rootseq)
        async with watch(h, "k") as w, watch_keys(h, "d") as kw:
            assert (await anext(w)).value == b"1"
            assert (await anext(kw)).initial
            await inst.kill_rank1()
            for it in (w, kw):
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(anext(it), 0.3)
            await kvs0.put("k", "2")
            await kvs0.put("d.a", "1")
            await inst.start_rank1()
            assert (await anext(w)).value == b"2"
            assert (await anext(kw)).keys == ("d.a",)


async def test_a_watch_cancelled_while_its_handle_is_away_is_not_sent_again(
        inst: Restartable) -> None:
    """Its reader, waiting for the handle to reconnect, ends; the restarted
    rank serves no watch for it."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await KVS(h).wait_version((await kvs0.put("k", "1")).rootseq)
        w = watch(h, "k")
        got: list[bytes | None] = []

        async def read() -> None:
            async for entry in w:
                got.append(entry.value)

        reader = asyncio.ensure_future(read())

        async def first() -> bool:
            return bool(got)

        await wait_until(first, what="the first value")
        await inst.kill_rank1()
        await w.cancel()
        await inst.start_rank1()
        await reader
        await h.wait_connected()
        assert got == [b"1"]
        assert (await h.rpc("kvs-watch.stats-get", {}))["watchers"] == 0


@pytest.mark.parametrize("how", ["kill", "term"])
@pytest.mark.parametrize("changes_only", [False, True])
async def test_a_namespace_watch_says_what_came_and_went_while_away(
        inst: Restartable, changes_only: bool, how: str) -> None:
    """Removed meanwhile: a ``removed``; removed and made again: a
    ``removed`` of the old and a ``created`` of the new; new: a
    ``created``, none ``initial``.  A ``changes_only`` watch too, though it
    was never told of the namespaces that were there before it."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await kvs0.namespace_create("job-a")
        async with watch_namespaces(h, "job-", changes_only=changes_only, listed=True) as w:
            # (changes_only: the list, taken to resume, is not yielded; the
            # marker after it says the watch has started)
            seen = [(e.event, e.namespace, e.initial) async for e in _until_listed(w)]
            assert seen == ([] if changes_only else [("created", "job-a", True)])
            await kvs0.namespace_create("job-b")
            assert (await anext(w)).namespace == "job-b"
            await inst.stop_rank1(how)
            await kvs0.namespace_remove("job-a")
            await kvs0.namespace_remove("job-b")
            await kvs0.namespace_create("job-b")
            await kvs0.namespace_create("job-c")
            await inst.start_rank1()
            meanwhile = [await anext(w) for _ in range(4)]
            assert [(e.event, e.namespace) for e in meanwhile] == [
                ("removed", "job-a"), ("removed", "job-b"),
                ("created", "job-b"), ("created", "job-c")]
            assert not any(e.initial for e in meanwhile)
            assert meanwhile[1].epoch != meanwhile[2].epoch
            await kvs0.namespace_create("job-d")
            after = await anext(w)
            assert (after.event, after.namespace, after.initial) == ("created", "job-d", False)


async def test_a_namespace_made_again_after_rank_0_restarts_is_a_new_one(
        inst: Restartable) -> None:
    """Rank 0 numbered the namespaces it creates (their epoch) from 1 at
    each start, so one made again after a restart, before a reconnecting
    namespace watch was back, had the epoch of the one it replaced: the
    watch reported neither the removal nor the creation."""
    async with asyncio.timeout(60):
        async with KVS.connect(inst.rank0.uri) as kvs0:
            await kvs0.namespace_create("job-9")
        async with Handle.connect(inst.uri1, reconnect=True) as h, \
                watch_namespaces(h, "job-", listed=True) as w:
            listed = [e async for e in _until_listed(w)]
            assert [(e.event, e.namespace) for e in listed] == [("created", "job-9")]
            inst.rank0.proc.send_signal(signal.SIGTERM)  # (rank 1 stops with it)
            assert await exit_codes([inst.rank0, inst.rank1], inst.tmp_path) == [0, 0]
            inst.rank0 = await inst.brokers(inst.config, 0)
            socket0 = inst.rank0.uri.removeprefix("local://")

            async def listening() -> bool:
                return os.path.exists(socket0)

            await wait_until(listening, what="the new rank 0's socket")
            async with KVS.connect(inst.rank0.uri) as kvs0:
                await kvs0.namespace_create("job-9")
            await inst.start_rank1()
            meanwhile = [await anext(w) for _ in range(2)]
            assert [(e.event, e.namespace) for e in meanwhile] == [
                ("removed", "job-9"), ("created", "job-9")]
            assert meanwhile[0].epoch == listed[0].epoch != meanwhile[1].epoch


async def _until_listed(w: NamespaceWatch) -> AsyncIterator[NamespaceEvent]:
    async for event in w:
        if event is NS_LISTED:
            return
        yield event


async def test_an_append_watch_whose_value_was_replaced_meanwhile_fails(
        inst: Restartable) -> None:
    """As the watch itself says of a replaced value: ``EINVAL``."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        version = (await kvs0.append("log", "abc\n")).rootseq
        await KVS(h).wait_version(version)
        async with watch(h, "log", append=True) as w:
            assert (await anext(w)).value == b"abc\n"
            await inst.kill_rank1()
            await kvs0.put("log", "xyz-and-more\n")
            await inst.start_rank1()
            with pytest.raises(RemoteError) as replaced:
                await anext(w)
            assert replaced.value.errnum == errno.EINVAL
            assert "replaced or shortened while the handle reconnected" in replaced.value.errstr


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
async def test_the_blocking_facade_reconnects_between_its_calls(inst: Restartable,
                                                                loop: str) -> None:
    """Its loop runs only inside a call: the first call after the rank
    restarted notices the closed connection before it sends, waits for the
    new one and succeeds (it does not fail as a request in flight)."""
    kvs = await asyncio.to_thread(SyncKVS, uri=inst.uri1, reconnect=True, timeout=30,
                                  event_loop=loop)
    try:
        await asyncio.to_thread(kvs.put, "a", "1")
        await inst.kill_rank1()
        put = asyncio.ensure_future(asyncio.to_thread(kvs.put, "a", "2"))
        await inst.start_rank1()
        await put
        assert await asyncio.to_thread(kvs.get_str, "a") == "2"
        assert kvs.sync_handle.aio.reconnects == 1
    finally:
        await asyncio.to_thread(kvs.close)


@pytest.mark.parametrize("facade", ["async", "blocking"])
async def test_a_lease_is_kept_alive_across_a_restart_of_its_holders_rank(
        inst: Restartable, facade: str) -> None:
    """The keepalives go on once the rank is back (the async lease's task,
    or the blocking one's thread, which has a connection of its own): the
    lease's time left goes up again, where it would have run out."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0:
        if facade == "async":
            kvs = await KVS.connect(inst.uri1, reconnect=True)
            lease_id = (await kvs.lease(3)).id
        else:
            sync = await asyncio.to_thread(SyncKVS, uri=inst.uri1, reconnect=True, timeout=30)
            lease_id = (await asyncio.to_thread(sync.lease, 3)).id
        try:
            await inst.kill_rank1()
            await inst.start_rank1()
            left = (await kvs0.lease_info(lease_id))["ttl_left"]

            async def kept() -> bool:
                return (await kvs0.lease_info(lease_id))["ttl_left"] > left + 0.1

            await wait_until(kept, 5, "a keepalive after the restart")
        finally:
            if facade == "async":
                await kvs.close()
            else:
                await asyncio.to_thread(sync.close)


# ---------------------------------------------------------------- the filter alone


def _val(data: bytes, rootseq: int = 1) -> dict[str, object]:
    return {"val": {"type": "val", "data": data}, "rootseq": rootseq, "namespace": "primary"}


def test_a_plain_watch_skips_the_value_it_delivered_last() -> None:
    r = WatchResume("k", F.WATCH)
    assert r.take(_val(b"1")) == [_val(b"1")]
    r.restarted()
    assert r.take(_val(b"1", 5)) == []  # unchanged: skipped once
    assert r.take(_val(b"1", 6)) == [_val(b"1", 6)]  # a commit naming it: reported
    r.restarted()
    assert r.take(_val(b"2", 7)) == [_val(b"2", 7)]
    r.restarted()
    r.restarted()  # (lost again before the first answer)
    assert r.take(_val(b"2", 8)) == []


def test_an_append_watch_yields_the_rest_and_its_pending_sentinel() -> None:
    r = WatchResume("log", F.WATCH | F.APPEND | F.INITIAL_SENTINEL)
    assert r.flags(F.WATCH | F.APPEND) & F.INITIAL_SENTINEL
    assert r.take(_val(b"ab")) == [_val(b"ab")]
    r.restarted()  # lost before the sentinel came
    assert r.take(_val(b"abc", 4)) == []
    assert r.take(_val(b"de", 4)) == []
    assert r.take(None) == [_val(b"cde", 4), None]  # (None: the sentinel)
    assert r.take(None) == []  # (a second sentinel is never the reader's)
    r.restarted()
    assert r.take(_val(b"abcde", 5)) == []
    assert r.take(None) == []  # nothing new, and the sentinel was delivered
    r.restarted()
    assert r.take(_val(b"abXde", 6)) == []
    with pytest.raises(RemoteError) as replaced:
        r.take(None)
    assert replaced.value.errnum == errno.EINVAL


def test_a_deletes_watch_reports_a_removal_once() -> None:
    removed = {"val": None, "rootseq": 3, "namespace": "primary"}
    r = WatchResume("k", F.WATCH | F.DELETES)
    assert r.take(removed) == [removed]
    r.restarted()
    assert r.take(removed) == []
    a = WatchResume("log", F.WATCH | F.APPEND | F.DELETES)
    assert a.take(_val(b"x\n")) == [_val(b"x\n")]
    assert a.take(removed) == [removed]
    a.restarted()
    assert a.take(removed) == []
    assert a.take(_val(b"y\n", 4)) == [_val(b"y\n", 4)]  # (back: whole)


def test_a_namespace_watch_lost_before_its_first_list_ended_lists_then() -> None:
    """The stream lost before its first list was served (a kvs-watch
    reload as the watch started): the list asked again is the first --
    ``initial`` entries (none for ``changes_only``), then the ``listed``
    marker.  They were taken for changes, and the marker swallowed: a
    reader waiting for ``NS_LISTED`` waited for ever (found by a review)."""
    from kvs_watch.resume import NamespaceResume

    def ns(name: str, epoch: int) -> dict:
        return {"namespace": name, "owner": 0, "event": "created", "epoch": epoch,
                "initial": True}
    listed = {"namespace": "", "owner": -1, "event": "listed"}
    for changes_only in (False, True):
        r = NamespaceResume(changes_only)
        seen = r.take(ns("a", 1))  # (the first list, cut short after one entry)
        r.restarted()
        assert r.take(ns("a", 1)) == [] and r.take(ns("b", 2)) == []
        seen += r.take(listed)
        expected = [listed] if changes_only else [ns("a", 1), ns("b", 2), listed]
        assert seen == expected, (changes_only, seen)
        # and a later restart is a catch-up, as ever
        r.restarted()
        r.take(ns("b", 2))
        assert r.take(listed) == [{**ns("a", 1), "event": "removed", "initial": False}]


async def test_subscriptions_made_and_ended_while_away_are_applied_once(
        inst: Restartable) -> None:
    """A ``subscribe`` or ``unsubscribe`` made while the handle reconnects
    waits with the other requests, and the handle's counts already hold
    it: the subscriptions made again once connected leave it out.  It was
    applied twice -- an unsubscribe after it left the rank subscribed, its
    events coming still, and an unsubscribe made while away was answered
    ``ENOENT`` (found by a review)."""
    async with asyncio.timeout(60), Handle.connect(inst.rank0.uri) as h0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await h.subscribe("keep.")
        await h.subscribe("one.")
        await inst.kill_rank1()

        async def gone() -> bool:
            return not h.connected
        await wait_until(gone, 10, "the handle to see its rank gone")
        sub = asyncio.ensure_future(h.subscribe("dup."))
        unsub = asyncio.ensure_future(h.unsubscribe("one."))
        never = asyncio.ensure_future(h.unsubscribe("never."))  # (not subscribed)
        await asyncio.sleep(0)  # (their first steps: all parked)
        await inst.start_rank1()
        await h.wait_connected()
        await asyncio.wait_for(asyncio.gather(sub, unsub), 10)  # (no ENOENT)
        with pytest.raises(RemoteError) as refused:  # (as when connected)
            await asyncio.wait_for(never, 10)
        assert refused.value.errnum == errno.ENOENT
        await h.unsubscribe("dup.")
        for topic in ("dup.1", "one.1", "keep.1"):
            await h0.publish(topic)
        assert (await asyncio.wait_for(h.recv_event(), 10)).topic == "keep.1"


async def test_tasks_waiting_for_events_keep_their_order_across_a_reconnect(
        inst: Restartable) -> None:
    """Each event goes to the task that has waited longest: the loss woke
    them all, and each went back first in line, so after a reconnect they
    were served last-come first (found by a review)."""
    async with asyncio.timeout(60), Handle.connect(inst.rank0.uri) as h0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await h.subscribe("order.")
        got: list[tuple[str, str]] = []

        async def waiter(name: str) -> None:
            got.append((name, (await h.recv_event()).topic))

        tasks = []
        for name in "ABC":
            tasks.append(asyncio.ensure_future(waiter(name)))
            await asyncio.sleep(0)  # (waiting, in this order)
        await inst.kill_rank1()
        await inst.start_rank1()
        await h.wait_connected()
        await h.rpc("broker.ping", {}, nodeid=1)  # (after the subscription made again)
        for i in range(3):
            await h0.publish(f"order.{i}")
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert got == [("A", "order.0"), ("B", "order.1"), ("C", "order.2")]


async def test_a_call_in_the_turn_the_connection_closes_waits_for_the_next(
        inst: Restartable) -> None:
    """Calls made every loop turn as the rank is killed: each made once the
    connection is closing waits for the next connection and is answered
    there; none raises.  For the one turn between the transport closing
    and the loss being handled, a call raised ``connection to broker lost``
    (a chaos probe, as the one without ``reconnect`` above)."""
    raised: list[str] = []
    parked: list[asyncio.Future[object]] = []
    async with asyncio.timeout(60), Handle.connect(inst.uri1, reconnect=True) as h:
        stop = False

        async def spin() -> None:
            while not stop:
                closing = not h.connected
                try:
                    f = h.rpc("broker.ping", {})
                except RemoteError as exc:
                    raised.append(exc.errstr)
                else:
                    if closing:
                        parked.append(f)
                    else:
                        f.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(spin()) for _ in range(10)]
        await h.ping()
        await inst.kill_rank1()

        async def gone() -> bool:
            return not h.connected
        await wait_until(gone, 10, "the handle to see its rank gone")
        await asyncio.sleep(0)
        stop = True
        await asyncio.gather(*tasks)
        await inst.start_rank1()
        await h.wait_connected()
        answers = await asyncio.wait_for(asyncio.gather(*parked), 10)
    assert raised == [] and parked and all("route" in a for a in answers)  # type: ignore[operator]


async def test_a_watch_cancelled_while_its_rank_is_away_ends_its_reader_at_once(
        inst: Restartable) -> None:
    """A reader waiting for the rank's return, and the watch cancelled by
    another task: the reader's loop ends then, as api.md says, not when
    (if ever) the rank comes back (found by a review: it waited)."""
    async with asyncio.timeout(60), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h:
        await KVS(h).wait_version((await kvs0.put("k", "1")).rootseq)
        w, kw = watch(h, "k"), watch_keys(h, "d")
        got: list[object] = []

        async def read(it: AsyncIterator[object]) -> None:
            async for item in it:
                got.append(item)

        readers = [asyncio.ensure_future(read(it)) for it in (w, kw)]

        async def both() -> bool:
            return len(got) == 2
        await wait_until(both, what="the first answers")
        await inst.kill_rank1()

        async def gone() -> bool:
            return not h.connected
        await wait_until(gone, 10, "the handle to see its rank gone")
        await w.cancel()
        await kw.cancel()
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert w.done and kw.done and len(got) == 2


async def test_a_blocking_watch_cancelled_from_another_thread_while_away_ends(
        inst: Restartable) -> None:
    """The blocking facade's ``for`` loop over a watch, the rank gone, and
    :meth:`SyncWatch.cancel` from another thread: the loop ends."""
    kvs = await asyncio.to_thread(SyncKVS, uri=inst.uri1, reconnect=True, timeout=30)
    try:
        await asyncio.to_thread(kvs.put, "k", "1")
        w = kvs.watch("k")
        first = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def read() -> list[bytes | None]:
            values = []
            with w:
                for entry in w:
                    values.append(entry.value)
                    loop.call_soon_threadsafe(first.set_result, None)
            return values

        reader = asyncio.ensure_future(asyncio.to_thread(read))
        await asyncio.wait_for(first, 10)
        await inst.kill_rank1()

        async def gone() -> bool:  # (read from here: the reader's thread runs its loop)
            return not kvs.sync_handle.aio.connected
        await wait_until(gone, 10, "the reader's handle to see its rank gone")
        w.cancel()
        assert await asyncio.wait_for(reader, 10) == [b"1"]
    finally:
        await asyncio.to_thread(kvs.close)


@pytest.mark.parametrize("how", ["kill", "term"])
async def test_a_watch_of_another_rank_goes_on_after_that_rank_restarts(
        inst: Restartable, how: str) -> None:
    """A ``nodeid`` watch on a reconnecting handle, its serving rank (not
    the handle's) stopped and started again: asked again until that rank
    is back, then the next value.  Stopped by SIGTERM, it waited for the
    handle's own connection to be made again, which never happened: for
    ever; killed, it raised ``EHOSTUNREACH`` (found by a review)."""
    async with asyncio.timeout(60), Handle.connect(inst.rank0.uri, reconnect=True) as h:
        kvs = KVS(h)
        await kvs.put("k", "1")
        async with watch(h, "k", nodeid=1) as w:
            assert (await anext(w)).value == b"1"
            await inst.stop_rank1(how)
            await inst.start_rank1()
            await kvs.put("k", "2")
            assert (await asyncio.wait_for(anext(w), 20)).value == b"2"
        assert h.reconnects == 0


async def test_a_plain_handles_watch_of_a_lost_rank_ends(inst: Restartable) -> None:
    """Without ``reconnect``, a ``nodeid`` watch (a value watch, a key
    watch) whose serving rank is killed ends with ``EHOSTUNREACH``: it is
    not asked again (a guard: the key watch's re-ask, made for reconnecting
    handles, is kept to them)."""
    async with asyncio.timeout(60), Handle.connect(inst.rank0.uri) as h:
        await KVS(h).put("k", "1")
        async with watch(h, "k", nodeid=1) as w, watch_keys(h, "d", nodeid=1) as kw:
            assert (await anext(w)).value == b"1"
            assert (await anext(kw)).initial
            await inst.kill_rank1()
            for it in (w, kw):
                with pytest.raises(RemoteError) as lost:
                    await asyncio.wait_for(anext(it), 20)
                assert lost.value.errnum == errno.EHOSTUNREACH, it
