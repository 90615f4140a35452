"""A ZeroMQ overlay parent's bookkeeping of its children's connections.

These run one rank's :class:`Overlay` in the test process, with test DEALERs
as its children, so that the test can hold the rank's event loop (plain
synchronous code between two awaits) while ZeroMQ's I/O thread goes on:
what the rank then finds waiting, in which order, is what a busy rank
finds, and no timing decides it.  (A rank process's loop cannot be held
from outside without its ZeroMQ threads: SIGSTOP stops them all, and which
of a DISCONNECTED and a newcomer's hello it then reads first is left to
timing.)
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio
from test_broker_support import wait_until

from broker import codec
from broker.launch import make_rundir
from broker.message import Message, MsgType
from broker.overlay import Overlay, ipc_endpoint
from broker.router import Router


def control(topic: str, rank: int) -> list[bytes]:
    return codec.encode(Message(MsgType.CONTROL, topic, {"rank": rank}))  # type: ignore


class Parent:
    """Rank 0 of a 3-rank instance (children 1 and 2), and its test children."""

    def __init__(self, overlay: Overlay, rundir: str) -> None:
        self.overlay = overlay
        self.rundir = rundir
        self.ctx = zmq.asyncio.Context()
        self._primer = self.ctx.socket(zmq.DEALER)  # (starts the context's
        # threads, whose descriptors stay open: a join's new ones are its own)
        self.made: dict[bytes, dict[int, int]] = {}
        """Per child: the file descriptors its join opened in this process
        (its socket's, its connection's both ends), and their inodes."""

    def dealer(self, ident: bytes) -> zmq.asyncio.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.linger = 0
        s.setsockopt(zmq.IDENTITY, ident)
        s.setsockopt(zmq.SNDHWM, 0)  # (a test child queues what it sends)
        s.connect(ipc_endpoint(self.rundir, 0))
        return s

    async def join(self, ident: bytes, rank: int) -> tuple[zmq.asyncio.Socket, int]:
        """A child that said hello and was answered, and the number of its
        connection's file descriptor in the parent."""
        before = open_fds()
        s = self.dealer(ident)
        await s.send_multipart(control("overlay.hello", rank))
        assert codec.decode(await s.recv_multipart()).topic == "overlay.hello"
        assert self.overlay._down is not None
        self.made[ident] = {fd: inode for fd, inode in open_fds().items()
                            if before.get(fd) != inode}
        return s, self.overlay._down.last_fd


@pytest.fixture
async def parent() -> AsyncIterator[Parent]:
    rundir = make_rundir()
    overlay = Overlay(Router(rank=0, size=3, fanout=2, owner_uid=os.getuid()), rundir,
                      transport="ipc")
    await overlay.start()
    p = Parent(overlay, rundir)
    try:
        yield p
    finally:
        p.ctx.destroy(0)
        overlay.close()
        shutil.rmtree(rundir, ignore_errors=True)


def open_fds() -> dict[int, int]:
    """This process's open file descriptors, and their inodes."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            fds[int(name)] = os.fstat(int(name)).st_ino
        except OSError:  # (the listing's own, closed since)
            pass
    return fds


def wait_closed(fd: int, inode: int, timeout: float = 5.0) -> None:
    """Block (the loop too) until file descriptor ``fd`` no longer names
    the connection whose inode is ``inode``: ZeroMQ's I/O thread closed it,
    after it queued the monitor's DISCONNECTED."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.fstat(fd).st_ino != inode:
                return
        except OSError:
            return
        assert time.monotonic() < deadline, f"connection {fd} still open"
        time.sleep(0.001)


@pytest.mark.both_loops
@pytest.mark.parametrize("newcomer", [1, 2], ids=["the-same-rank-restarted",
                                                  "another-child"])
async def test_a_disconnect_read_late_drops_the_lost_child_not_the_fd_s_new_one(
        parent: Parent, newcomer: int) -> None:
    """A monitor's DISCONNECTED names a connection by its file descriptor
    number only.  Rank 1's connection closes, and a new connection takes
    the same number (rank 1 restarted at once, or rank 2 joining) and says
    hello, all before the parent reads either: the DISCONNECTED is rank 1's
    old connection's, and must not drop the newcomer (it did: the newcomer
    was taken for the lost connection, its next messages were refused as a
    stranger's, and rank 1's old link, when the newcomer was rank 2, was
    kept for ever)."""
    overlay = parent.overlay
    async with asyncio.timeout(15):
        old, fd = await parent.join(b"1-old", 1)
        # -- the rank's loop is held from here to the next await --
        old.close(0)
        # every descriptor the old child's join opened is closed (not only
        # the parent's end): the newcomer's then take the same numbers, in
        # the same order, and its connection's parent end is ``fd`` again
        for made, made_inode in parent.made[b"1-old"].items():
            wait_closed(made, made_inode)
        new = parent.dealer(b"%d-new" % newcomer)
        new.send_multipart(control("overlay.hello", newcomer))
        assert overlay._down is not None
        assert overlay._down.sock.poll(5000) & zmq.POLLIN  # its hello is queued
        # -- the loop runs again: the DISCONNECTED and the hello are both there
        assert codec.decode(await new.recv_multipart()).topic == "overlay.hello"
        assert overlay._down.last_fd == fd  # (the number was reused)

        async def old_one_lost() -> bool:
            return overlay.hello_from == {newcomer} and (newcomer == 1 or overlay.replaced == 0)

        await wait_until(old_one_lost, "rank 1's old connection to be lost, and only it")
        # the newcomer is a child still: its request is routed (no such
        # service on rank 0), and the answer comes back down to it
        req = Message(MsgType.REQUEST, "nosuch.method", matchtag=7, route=[f"c{newcomer}"])
        await new.send_multipart(codec.encode(req))
        msg = codec.decode(await new.recv_multipart())
        assert (msg.type, msg.matchtag, msg.errnum) == (MsgType.RESPONSE, 7, errno.ENOSYS)
        assert overlay.hello_from == {newcomer}


@pytest.mark.both_loops
async def test_a_lost_child_s_backlog_is_read_in_slices_and_in_order(
        parent: Parent, caplog: pytest.LogCaptureFixture) -> None:
    """A child's connection closes with 9,000 of its messages unread: the
    parent reads them before it loses the child (its goodbye, the last
    one, makes the loss a clean stop, logged at INFO), but a few hundred
    per loop turn, not all in one callback -- which held a busy rank's
    other links, clients and timers for as long as that took."""
    caplog.set_level(logging.INFO, "kvbroker.overlay")
    overlay = parent.overlay
    router = overlay.router
    n = 9_000  # (under ZeroMQ's high-water mark: all of them queued)
    async with asyncio.timeout(30):
        child, fd = await parent.join(b"1-busy", 1)
        inode = os.fstat(fd).st_ino
        child.linger = 10_000  # (what it sent still leaves after close)
        up_event = codec.encode(Message(MsgType.EVENT, "up.event", seq=1))
        # -- the rank's loop is held from here to the next await --
        for _ in range(n):
            child.send_multipart(up_event)  # dropped by rank 0, and counted
        child.send_multipart(codec.encode(Message(MsgType.CONTROL, "overlay.goodbye",
                                                  {"rank": 1, "why": "test"})))
        child.close()
        wait_closed(fd, inode)  # all queued, and the DISCONNECTED after them
        # -- the loop runs again: count the messages handled per loop turn
        per_turn = []
        last = router.counts["dropped-events"]
        while 1 in overlay.hello_from:
            await asyncio.sleep(0)  # (one loop turn)
            now = router.counts["dropped-events"]
            per_turn.append(now - last)
            last = now
    assert last == n
    assert max(per_turn) <= 4 * 512, max(per_turn)
    assert "child rank 1 stopped (test)" in caplog.text
    assert "lost child rank 1 unexpectedly" not in caplog.text


@pytest.mark.both_loops
async def test_a_lost_child_is_lost_while_a_sibling_keeps_the_socket_busy(
        parent: Parent, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's connection closes with 9,000 messages unread while rank 2
    sends without pause, so the children's socket is never found empty:
    rank 1 is still lost, after its last message (its goodbye), within the
    number of reads that ZeroMQ's turn-taking bounds -- not when the flood
    stops (reading until the socket was empty never returned meanwhile,
    and held the rank's loop for as long as the flood lasted)."""
    caplog.set_level(logging.INFO, "kvbroker.overlay")
    overlay = parent.overlay
    router = overlay.router
    async with asyncio.timeout(30):
        child, fd = await parent.join(b"1-busy", 1)
        sibling, _ = await parent.join(b"2-flood", 2)
        inode = os.fstat(fd).st_ino
        child.linger = 10_000
        up_event = codec.encode(Message(MsgType.EVENT, "up.event", seq=1))
        stop = threading.Event()
        flood_ended = threading.Event()

        def flood() -> None:
            """Rank 2 sends until told to stop, or for 10 s at most (so
            that a rank that never lets its loop run cannot hang the test)."""
            s = zmq.Socket.shadow(sibling.underlying)
            deadline = time.monotonic() + 10
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    s.send_multipart(up_event, zmq.NOBLOCK)
                except zmq.Again:
                    pass
            if not stop.is_set():
                flood_ended.set()

        # -- the rank's loop is held from here to the next await --
        for _ in range(9_000):
            child.send_multipart(up_event)
        child.send_multipart(codec.encode(Message(MsgType.CONTROL, "overlay.goodbye",
                                                  {"rank": 1, "why": "test"})))
        child.close()
        wait_closed(fd, inode)
        flooder = threading.Thread(target=flood)
        flooder.start()
        try:
            async def rank_1_lost() -> bool:
                return 1 not in overlay.hello_from

            await wait_until(rank_1_lost, "rank 1 to be lost", 20)
        finally:
            stop.set()
            await asyncio.to_thread(flooder.join)
    assert not flood_ended.is_set(), "rank 1 was lost only once the flood ended"
    assert 2 in overlay.hello_from
    assert router.counts["dropped-events"] > 9_000
    assert "child rank 1 stopped (test)" in caplog.text
    assert "lost child rank 1 unexpectedly" not in caplog.text


@pytest.mark.both_loops
async def test_what_a_lost_child_s_process_sends_when_it_resumes_is_dropped_quietly(
        parent: Parent, caplog: pytest.LogCaptureFixture) -> None:
    """A rank stopped (SIGSTOP) longer than ZeroMQ's heartbeat timeout is
    lost: its parent's end of the connection closes.  Resumed, its DEALER
    dials again by itself, with the same identity, and sends what it queued
    (a keepalive) before its loop reads that its link closed -- the parent
    took that for a stranger's first message and warned "not a child's
    hello".  It is the old process's, and is dropped quietly (counted).
    The parent's end is closed here as a heartbeat timeout closes it
    (:func:`hang_up`), without waiting 10 s for one."""
    from broker.overlay_zmq import hang_up

    caplog.set_level(logging.INFO, "kvbroker.overlay")
    overlay = parent.overlay
    async with asyncio.timeout(15):
        child, fd = await parent.join(b"1-stopped", 1)
        assert hang_up(fd, os.fstat(fd).st_ino)

        async def lost() -> bool:
            return 1 not in overlay.hello_from

        await wait_until(lost, "rank 1 to be lost")
        before = overlay.dropped
        await child.send_multipart(control("overlay.keepalive", 1))  # (sent on reconnection)

        async def dropped() -> bool:
            return overlay.dropped == before + 1

        await wait_until(dropped, "the resumed process's keepalive to be dropped")
    assert "lost child rank 1 unexpectedly" in caplog.text
    assert "not a child's hello" not in caplog.text
    assert not await child.poll(0)


async def test_a_hello_from_the_same_process_on_a_new_connection_replaces_nothing(
        parent: Parent, caplog: pytest.LogCaptureFixture) -> None:
    """A child whose link closed before its hello was answered says hello
    again from a new DEALER (``Overlay._dial_again``), whose hello names the
    same process; the parent may not have seen the old connection close
    yet.  That is the same process on a new connection: the old one is
    dropped, but nothing is counted as a replacement or a rejoin (``overlay
    status`` said "restarted ... 1 in place of a process still connected")
    and the old connection is not told it was replaced.  A hello naming
    another process, next, is a replacement, as before."""

    def hello(process: str) -> list[bytes]:
        payload = {"rank": 1, "process": process}
        return codec.encode(Message(MsgType.CONTROL, "overlay.hello", payload))  # type: ignore

    async def answered(ident: bytes, process: str) -> zmq.asyncio.Socket:
        s = parent.dealer(ident)
        await s.send_multipart(hello(process))
        assert codec.decode(await s.recv_multipart()).topic == "overlay.hello"
        return s

    caplog.set_level(logging.INFO, "kvbroker.overlay")
    overlay = parent.overlay
    async with asyncio.timeout(15):
        first = await answered(b"1-first", "p1")
        second = await answered(b"1-second", "p1")  # (first still connected)
        assert overlay.hello_from == {1}
        assert (overlay.replaced, overlay.rejoined()) == (0, {})
        _third = await answered(b"1-third", "p2")  # another process: a replacement
        told = codec.decode(await second.recv_multipart())
        assert (told.topic, told.payload) == ("overlay.shutdown", {"rank": 0, "replaced": True})
        assert overlay.replaced == 1
        assert {k: (v["times"], v["replaced"]) for k, v in overlay.rejoined().items()} == {
            "1": (1, 1)}
        # (a shutdown to it would have been sent before second's answer, three
        # round trips ago)
        assert not await first.poll(0)
    assert "said hello again on a new connection: dropping its old one" in caplog.text
    assert caplog.text.count("said hello again from a new process") == 1


def _hello(rank: int, process: str) -> list[bytes]:
    return codec.encode(Message(MsgType.CONTROL, "overlay.hello",  # type: ignore[return-value]
                                {"rank": rank, "process": process}))


def _flood_until(overlay: Overlay, done: Callable[[], bool]) -> None:
    """Send pings to rank 1, which does not read, until ``done()``: its
    ZeroMQ pipe fills, then the rank's backlog for it (``tbon.max-backlog``,
    0 here), then a send finds it over and drops the child as stuck."""
    for tag in range(1, 20_000):
        if done():
            return
        overlay.send(1, Message(MsgType.REQUEST, "broker.ping", {}, matchtag=tag, nodeid=1))
    raise AssertionError("the flood never got there")


async def _held_reads(overlay: Overlay) -> None:
    """Stop the rank's reads of its children's socket (until
    :func:`_release`), as a loop busy elsewhere leaves them."""
    down = overlay._down
    assert down is not None
    down.loop.remove_reader(down.fd)
    down._scheduled = True  # (no read scheduled either)


def _release(overlay: Overlay) -> None:
    down = overlay._down
    assert down is not None
    down._scheduled = False
    down.loop.add_reader(down.fd, down._run)
    down.read_all()


async def _waiting(overlay: Overlay) -> None:
    """Until a message waits in the children's socket, unread."""
    down = overlay._down
    assert down is not None

    async def ready() -> bool:
        return bool(down.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)
    await wait_until(ready, "a message waiting in the ROUTER", 5)


async def test_a_stuck_childs_new_process_read_in_the_same_turn_is_not_lost(
        parent: Parent) -> None:
    """A send drops rank 1 as stuck (its loss put off to the next loop
    turn), and in the same turn the rank reads a new process's hello for
    rank 1: it was admitted as a first join, then the loss put off took it
    for the old link -- answered, the new process never said hello again,
    and everything it sent was dropped for good (found by a review).  The
    old link's loss runs first now, and the new one is served."""
    overlay = parent.overlay
    assert overlay._down is not None
    overlay._down.max_backlog = 0
    async with asyncio.timeout(20):
        old = parent.dealer(b"1-old")
        await old.send_multipart(_hello(1, "p-old"))
        assert codec.decode(await old.recv_multipart()).topic == "overlay.hello"
        await _held_reads(overlay)
        new = parent.dealer(b"1-new")
        await new.send_multipart(_hello(1, "p-new"))
        await _waiting(overlay)
        _flood_until(overlay, lambda: 1 not in overlay._child_ident)  # stuck: dropped
        _release(overlay)  # (the same turn: the new hello is read)
        assert codec.decode(await new.recv_multipart()).topic == "overlay.hello"
        for _ in range(5):
            await asyncio.sleep(0)  # (the turn after, when the put-off loss ran)
        assert overlay.hello_from == {1} and overlay._child_ident[1] == b"1-new"
        dropped = overlay.dropped
        assert overlay.send(1, Message(MsgType.REQUEST, "broker.ping", {}, matchtag=1,
                                       nodeid=1))
        got = codec.decode(await new.recv_multipart())
        assert (got.topic, got.matchtag) == ("broker.ping", 1)
        assert overlay.dropped == dropped
        # (the old link lost first, then the new process joined: a rejoin)
        assert "1" not in overlay.lost() and overlay.rejoined()["1"]["times"] == 1
        old.close(0)
        new.close(0)


async def test_a_replaced_child_whose_backlog_is_over_the_limit_is_replaced_cleanly(
        parent: Parent, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 1's old process does not read (its backlog over
    ``tbon.max-backlog``) when a new one says hello: the notice that it was
    replaced tripped the limit, dropped it as stuck inside the
    replacement, which then raised ``KeyError`` -- the new hello was lost
    (found by a review).  What waited for the old one is let go of first,
    the notice goes, and the new process is admitted."""
    overlay = parent.overlay
    assert overlay._down is not None
    overlay._down.max_backlog = 0
    caplog.set_level(logging.INFO, "kvbroker.overlay")
    async with asyncio.timeout(20):
        old = parent.dealer(b"1-old")
        await old.send_multipart(_hello(1, "p-old"))
        assert codec.decode(await old.recv_multipart()).topic == "overlay.hello"
        down = overlay._down
        _flood_until(overlay, lambda: down.backlog_bytes.get(b"1-old", 0) > 0)
        new = parent.dealer(b"1-new")
        await new.send_multipart(_hello(1, "p-new"))
        assert codec.decode(await new.recv_multipart()).topic == "overlay.hello"
        assert overlay.hello_from == {1} and overlay._child_ident[1] == b"1-new"
        assert overlay.replaced == 1
        old.close(0)
        new.close(0)
    assert "error handling an overlay message" not in caplog.text, caplog.text


def test_a_bind_failure_names_zeromqs_own_errors() -> None:
    """ZeroMQ's own errnos (past the system's) are named, not "Unknown
    error 156384764": the operator reads this line and nothing else."""
    from broker.overlay_zmq import bind_failure

    line = bind_failure("tcp://10.0.0.1:8050", zmq.ENOCOMPATPROTO)
    assert "The protocol is not compatible with the socket type" in line
    assert "Unknown error" not in line
    assert "Address already in use" in bind_failure("tcp://10.0.0.1:8050", errno.EADDRINUSE)
    # a host name where ZeroMQ wants an address or an interface
    assert bind_failure("tcp://node1:8050", errno.ENODEV).endswith(
        "No such device (ZeroMQ binds an address or an interface of this host, not a host "
        "name: tcp://*:PORT, tcp://10.0.0.1:PORT or tcp://eth0:PORT)")


def test_the_link_to_the_parent_hears_of_a_handshake_done_before_its_loop_looked(
        tmp_path) -> None:
    """The monitor :func:`parent_socket` returns was started before its
    connect: a CURVE handshake that ZeroMQ's thread completes before the
    rank's loop reads a thing (a rank that lost the CPU right after the
    connect) is still reported.  Started after the connect, as it was, it
    could miss it, and the rank, thinking its link not live, never said
    its hello again when the answer to the first was lost."""
    from broker import overlay_zmq as zl

    ctx = zmq.Context()
    public, secret = zmq.curve_keypair()
    endpoint = f"ipc://{tmp_path}/parent"
    router = ctx.socket(zmq.ROUTER)
    router.curve_server = True
    router.curve_publickey, router.curve_secretkey = public, secret
    router.bind(endpoint)
    s, monitor = zl.parent_socket(ctx, 1, endpoint, (public, secret))
    try:
        s.send(b"hello")
        assert router.poll(5000), "the DEALER never got through"
        router.recv_multipart()  # a message crossed: the handshake is done
        events = []
        while zl.HANDSHAKE_SUCCEEDED not in events and monitor.poll(5000):
            events.append(zmq.utils.monitor.recv_monitor_message(monitor)["event"])
        assert zl.HANDSHAKE_SUCCEEDED in events, events
    finally:
        for sock in (monitor, s, router):
            sock.close(linger=0)
        ctx.term()


def test_what_the_parent_sent_before_closing_the_link_stays_readable(tmp_path) -> None:
    """A message the parent sent just before it closed the link -- its
    ``overlay.shutdown`` at a clean stop -- is still there for the rank to
    read after the link's DISCONNECTED, whenever its loop gets to it.  With
    ZeroMQ's reconnect off (-1) libzmq ended the endpoint on the drop and
    discarded what was unread: a child whose loop was late exited 1 at a
    clean stop, "lost the connection to parent rank 1".  Here the rank's
    loop is late on purpose: the socket is read only once the drop has
    been reported and the socket has processed its commands."""
    from broker import overlay_zmq as zl

    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/parent"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    s, monitor = zl.parent_socket(ctx, 1, endpoint, None)
    try:
        for n in range(5):
            s.send(b"hello")
            assert router.poll(5000), "the DEALER never got through"
            ident, _ = router.recv_multipart()
            router.send_multipart([ident, b"shutdown %d" % n])
            if n < 4:
                assert s.poll(5000) and s.recv() == b"shutdown %d" % n
        router.close(linger=1000)
        event = None
        while event != zmq.EVENT_DISCONNECTED:
            assert monitor.poll(5000), "no DISCONNECTED"
            event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
        deadline = time.monotonic() + 0.1
        while time.monotonic() < deadline:  # (the socket acts on ZeroMQ's commands)
            s.getsockopt(zmq.EVENTS)
        assert s.recv(zmq.NOBLOCK) == b"shutdown 4"
    finally:
        for sock in (monitor, s, router):
            sock.close(linger=0)
        ctx.term()
