"""A client that does not read: bounded memory on its rank, nothing lost.

A rank stops reading a client's requests while that client does not read
its answers (the kernel's socket buffers then stop the client), so a
flood of requests cannot pile answers up on the rank; once the client
reads, every request is answered.  And the slow-consumer limit is judged
before each message, so one answer bigger than it still reaches a client
that reads (a resource-exhaustion audit: a ping flood held 2.8 GB on
rank 0, and a 300 MB value could never be read).
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import os
import resource
import signal
import socket

import pytest
from test_broker_support import stop_process, wait_until

from broker import codec
from broker.connector import MAX_BACKLOG
from broker.errors import RemoteError
from broker.handle import Handle, parse_uri
from broker.message import Message, MsgType

FLOOD_LIMIT = 64 << 20
"""Bytes of requests the test gives up at: a rank that read without limit
took them all (its answers queued), one that pushes back stops far sooner."""


def _requests(count: int) -> tuple[bytes, list[int]]:
    """``count`` pings (matchtags 1..count) on the stream, and where each ends."""
    out = bytearray()
    ends = []
    for tag in range(1, count + 1):
        frames = codec.encode(Message(MsgType.REQUEST, "broker.ping", matchtag=tag, payload={}))
        out += codec.stream_prefix(frames) + b"".join(frames)
        ends.append(len(out))
    return bytes(out), ends


async def _writable(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                    timeout: float) -> bool:
    fut = loop.create_future()
    loop.add_writer(sock.fileno(), lambda: fut.done() or fut.set_result(None))
    try:
        await asyncio.wait_for(fut, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_writer(sock.fileno())


async def test_a_flood_that_never_reads_is_held_back_and_then_answered_in_full(
        start_instance, connect) -> None:
    inst = await start_instance(size=1)
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    await asyncio.wait_for(loop.sock_connect(sock, parse_uri(inst.uri(0))), 10)
    batch, ends = _requests(2000)
    sent = 0
    try:
        while sent < FLOOD_LIMIT:
            data = memoryview(batch)[sent % len(batch):]
            try:
                sent += sock.send(data)
                continue
            except BlockingIOError:
                pass
            if not await _writable(loop, sock, 2.0):
                break  # held back: the rank stopped reading us
        assert sent < FLOOD_LIMIT // 4, f"the rank took {sent} bytes of requests unread"
        # others are served meanwhile
        h = await connect(inst, 0)
        assert (await asyncio.wait_for(h.ping(0), 10))["rank"] == 0
        # finish the request cut in the middle, then read: every one answered
        laps, at = divmod(sent, len(batch))
        whole, rest = laps * 2000, b""  # the requests begun, the rest of the last one
        if at:
            i = bisect.bisect_left(ends, at)  # the request this lap's bytes end in
            whole, rest = whole + i + 1, batch[at:ends[i]]
        reader = codec.StreamDecoder()
        tags: list[int] = []

        async def read() -> None:
            while len(tags) < whole:
                chunk = await loop.sock_recv(sock, 1 << 16)
                assert chunk, "the rank closed the connection"
                for frames in reader.feed(chunk):
                    msg = codec.decode(frames)
                    assert (msg.type, msg.errnum) == (MsgType.RESPONSE, 0)
                    tags.append(msg.matchtag)

        await asyncio.wait_for(asyncio.gather(read(), loop.sock_sendall(sock, rest)), 60)
        assert tags == [1 + i % 2000 for i in range(whole)]
    finally:
        sock.close()


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
async def test_a_dropped_subscribers_backlog_is_let_go_of_at_once(start_instance, connect,
                                                                   loop_name) -> None:
    """A subscriber that stops reading is dropped past ``MAX_BACKLOG``
    queued.  What was queued for it went only at the garbage collector's
    next full pass (its connection and transport hold each other), which an
    idle rank may never make: after a 268 MB backlog it stayed at its peak.
    It is let go of at once now, and the heap's free pages given back."""
    inst = await start_instance(size=1, event_loop=loop_name)
    h = await connect(inst)
    before = (await h.rpc("broker.stats-get", {}))["rss_now_mb"]
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, parse_uri(inst.uri(0))), 10)
        frames = codec.encode(Message(MsgType.REQUEST, "event.subscribe", matchtag=1,
                                      payload={"topic": ""}))
        await loop.sock_sendall(sock, codec.stream_prefix(frames) + b"".join(frames))
        answer = codec.StreamDecoder()
        while not (got := answer.feed(await loop.sock_recv(sock, 1 << 16))):
            pass
        assert codec.decode(got[0]).errnum == 0  # subscribed; now it reads no more
        pad = "x" * 4000

        async def dropped() -> bool:
            for _ in range(500):
                h.publish_nowait("test.flood", {"pad": pad})
            st = await h.rpc("broker.stats-get", {})  # (after them: one connection)
            return st["connector"]["slow-consumers"] == 1

        await wait_until(dropped, "the subscriber that does not read to be dropped", 120)
        st = await h.rpc("broker.stats-get", {})
        assert st["rss_mb"] > before + 200, st  # (its backlog was there, at the peak)
        assert st["rss_now_mb"] < before + 64, (before, st["rss_now_mb"], st["rss_mb"])
        # It reads again: what the socket held, then why it was dropped
        # (it got only ECONNRESET before), then nothing more
        events, last = 0, None
        while last is None:
            data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 10)
            assert data, f"the stream ended after {events} events without saying why"
            for frames in answer.feed(data):
                msg = codec.decode(frames)
                if msg.type == MsgType.EVENT:
                    assert last is None, "an event after the closing message"
                    events += 1
                else:
                    last = msg
        assert last.topic == "broker.closing" and last.errnum == errno.ENOBUFS, last
        assert "dropped as a slow consumer" in last.errstr, last.errstr
        assert events < 1000, events  # (the backlog was let go of, not sent)
        # and the stream ends right after it (not when the rank's 10 s
        # linger is over: a client that read why waited for that)
        assert await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5) == b""
    finally:
        sock.close()


async def test_drain_waits_until_a_flood_of_nowaits_is_the_transports(start_instance) -> None:
    """``publish_nowait`` never waits, so a loop of it that never awaited
    queued in the client without bound while the rank was slower (2.6 GB);
    ``Handle.drain()`` is its back-pressure: it waits while the rank reads
    nothing (stopped), and returns once the flood is written."""
    inst = await start_instance(size=1)
    rank = inst.pids()[0]
    async with await Handle.connect(inst.uri(0)) as h:
        await asyncio.wait_for(h.drain(), 10)  # nothing waits: at once
        os.kill(rank, signal.SIGSTOP)
        try:
            for _ in range(5000):  # ~20 MB: far over what the socket and transport take
                h.publish_nowait("test.flood", {"pad": "x" * 4000})
            drain = asyncio.ensure_future(h.drain())
            done, _ = await asyncio.wait([drain], timeout=0.5)
            assert not done, "drain returned while the stopped rank read nothing"
        finally:
            os.kill(rank, signal.SIGCONT)
        await asyncio.wait_for(drain, 60)
        assert await asyncio.wait_for(h.publish("test.end"), 30) > 5000


async def test_one_answer_over_the_backlog_limit_reaches_a_reader(start_instance) -> None:
    inst = await start_instance(size=1)
    pad = "x" * (MAX_BACKLOG + (1 << 20))
    async with await Handle.connect(inst.uri(0)) as h:
        answer = await asyncio.wait_for(h.ping(0, {"pad": pad}), 120)
        assert len(answer["pad"]) == len(pad)
        assert (await asyncio.wait_for(h.ping(0), 10))["rank"] == 0  # and the connection goes on


async def test_a_child_that_does_not_read_is_dropped_not_buffered(start_instance,
                                                                  connect) -> None:
    """A stopped child rank (SIGSTOP) made its parent queue every event and
    commit for it without bound (~15 MB/s).  Past ``tbon.max-backlog`` the
    link is dropped: the child is lost, as a missed ZeroMQ heartbeat makes
    it, and the parent serves on."""
    inst = await start_instance(size=2, attrs={"tbon.max-backlog": str(1 << 20)})
    h = await connect(inst, 0)
    child = inst.pids()[1]
    os.kill(child, signal.SIGSTOP)
    try:
        pad = "x" * (64 << 10)

        async def dropped() -> bool:
            await h.rpc("event.pub", {"topic": "test.flood", "payload": {"pad": pad}})
            return (await h.rpc("broker.stats-get", {}))["overlay"]["slow"] == 1

        await wait_until(dropped, "the link to the stopped child to be dropped", 60)
        assert (await asyncio.wait_for(h.ping(0), 10))["rank"] == 0
        with pytest.raises(RemoteError) as err:  # lost: answered at once, not held
            await asyncio.wait_for(h.ping(1), 10)
        assert err.value.errnum == errno.EHOSTUNREACH
    finally:
        os.kill(child, signal.SIGCONT)


async def test_a_parent_busy_for_a_moment_behind_big_messages_is_not_dropped(
        start_instance, connect) -> None:
    """Rank 1 sends its parent 2 MiB of requests (4 of 512 KiB) while the
    parent does not read (stopped, as a rank busy for a moment): over
    ``tbon.max-backlog`` (1 MiB), but the parent read until just now, so
    the link waits (``broker.linkstall``) and every request is answered
    once it reads again.  Judged by bytes alone, the link was dropped and
    rank 1, its parent lost, stopped (found by a review: a guest's few big
    requests did it)."""
    inst = await start_instance(size=2, attrs={"tbon.max-backlog": str(1 << 20)})
    h1 = await connect(inst, 1)
    pad = b"x" * (512 << 10)
    rank0 = inst.pids()[0]
    await stop_process(rank0)
    try:
        calls = [h1.rpc("broker.ping", {"pad": pad}, nodeid=0) for _ in range(4)]
        await asyncio.wait_for(h1.ping(1), 10)  # (after rank 1 sent the four on)
    finally:
        os.kill(rank0, signal.SIGCONT)
    for answer in await asyncio.wait_for(asyncio.gather(*calls), 30):
        assert answer["rank"] == 0 and len(answer["pad"]) == len(pad)
    assert (await h1.rpc("broker.stats-get", {}))["overlay"]["slow"] == 0


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
async def test_out_of_descriptors_the_rank_waits_and_then_accepts(start_instance, connect,
                                                                   tmp_path, loop_name) -> None:
    """A rank out of file descriptors: on the stock loop, CPython's server
    retried accept in a storm (full CPU, millions of logged tracebacks).
    The rank's own accept loop pauses, says so once, and takes the waiting
    clients when descriptors are free again."""
    inst = await start_instance(size=1, event_loop=loop_name)
    h = await connect(inst, 0)  # connected before: it keeps working
    pid = inst.pids()[0]
    in_use = len(os.listdir(f"/proc/{pid}/fd"))
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (in_use + 8, hard))
    path = parse_uri(inst.uri(0))
    socks = []
    try:
        for _ in range(40):  # more than it can take: the rest wait in the listen queue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            socks.append(s)

        async def refused() -> bool:
            st = await h.rpc("broker.stats-get", {})
            return st["connector"]["accept-failed"] >= 5

        await wait_until(refused, "the rank to run out of descriptors", 20)
        assert (await asyncio.wait_for(h.ping(0), 10))["rank"] == 0
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
        for s in socks:
            s.close()
    async with await Handle.connect(inst.uri(0)) as late:  # accepted again
        assert (await asyncio.wait_for(late.ping(0), 10))["rank"] == 0
    log = (tmp_path / "broker-0.log").read_text()
    assert log.count("cannot accept clients") == 1
    assert "out of system resource" not in log and "Traceback" not in log


async def test_clients_leave_descriptors_for_the_overlay(start_instance, connect) -> None:
    """Clients may not take a rank's last descriptors.  They took them all,
    and the next connection to rank 0's ipc:// overlay socket (a child rank
    starting again, any process of the owner) aborted it: libzmq's listener
    asserts on EMFILE, and the whole instance went."""
    inst = await start_instance(size=2, attrs={"tbon.transport": "ipc"})
    h = await connect(inst, 0)
    pid = inst.pids()[0]
    _, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE,
                     (len(os.listdir(f"/proc/{pid}/fd")) + 40, hard))
    socks = []
    try:
        for _ in range(60):  # more than it may take: the rest wait in the listen queue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(parse_uri(inst.uri(0)))
            socks.append(s)

        async def refused() -> bool:
            st = await h.rpc("broker.stats-get", {})
            return st["connector"]["accept-failed"] >= 1

        await wait_until(refused, "the rank to keep its last descriptors", 20)
        assert inst.rundir is not None
        for _ in range(3):  # each one a new accept by ZeroMQ's listener
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as overlay:
                overlay.connect(os.path.join(inst.rundir, "tbon-0"))
                assert (await asyncio.wait_for(h.ping(1), 10))["rank"] == 1
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (hard, hard))
        for s in socks:
            s.close()
    assert inst.failed is not None and not inst.failed.done()
    async with await Handle.connect(inst.uri(0)) as late:  # accepted again
        assert (await asyncio.wait_for(late.ping(1), 10))["rank"] == 1


@pytest.mark.both_loops
async def test_a_burst_from_one_client_does_not_hold_up_the_others(start_instance,
                                                                   connect) -> None:
    """A client that writes thousands of requests at once is taken at most
    MAX_PER_TURN per turn of the rank's loop, so another client's request
    that arrived with the burst goes through near its start, not after the
    whole read: rank 0 sequences it early among the burst's events.
    Nothing of the burst is lost."""
    from broker.connector import MAX_PER_TURN
    from broker.message import MsgFlags

    count = 20_000
    inst = await start_instance(size=1)
    sub, quiet = await connect(inst), await connect(inst)
    await asyncio.wait_for(sub.subscribe("fair."), 10)
    burst = b"".join(codec.to_stream(codec.encode(Message(
        MsgType.REQUEST, "event.pub", {"topic": "fair.burst", "payload": {"i": i}},
        matchtag=0, flags=MsgFlags.NORESPONSE))) for i in range(count))
    each = len(burst) // count
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(parse_uri(inst.uri(0)))
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    # one round trip first: the rank has accepted this connection and reads it
    await asyncio.wait_for(loop.sock_sendall(sock, codec.to_stream(codec.encode(
        Message(MsgType.REQUEST, "broker.ping", {}, matchtag=1)))), 10)
    decoder = codec.StreamDecoder()
    async with asyncio.timeout(10):
        while not decoder.feed(await loop.sock_recv(sock, 1 << 16)):
            pass
    rank0 = inst.pids()[0]
    order: list[str] = []
    # Both requests wait in their sockets while rank 0 is stopped, so its
    # first turn finds the burst (first) and the quiet request together.
    os.kill(rank0, signal.SIGSTOP)
    try:
        sent = sock.send(burst)
        quiet.publish_nowait("fair.quiet", {})
    finally:
        os.kill(rank0, signal.SIGCONT)
    assert sent >= 16 * MAX_PER_TURN * each, sent  # many turns' worth in one read
    try:
        async with asyncio.timeout(60):
            sending = loop.create_task(loop.sock_sendall(sock, burst[sent:]))
            while len(order) < count + 1:
                order.append((await sub.recv_event()).topic)
            await sending
    finally:
        sock.close()
    assert order.count("fair.burst") == count
    position = order.index("fair.quiet")
    # Taken whole, the rank's first read of the burst (every request the
    # socket held: thousands) would all have gone before it; taken in turns,
    # a turn or two's worth do (128 measured).
    assert position <= 4 * MAX_PER_TURN, (position, sent // each)


async def _raw_client(uri: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(parse_uri(uri))
    sock.setblocking(False)
    return sock


async def test_a_burst_down_the_tree_does_not_hold_up_a_ranks_clients(start_instance,
                                                                     connect) -> None:
    """A rank takes at most MAX_PER_TURN messages of a link per turn too: a
    burst of events from its parent (thousands in one read) does not hold
    up its own clients' requests.  Rank 1 is stopped while rank 0 forwards
    a burst to it and a client of rank 1 sends a ping; once it runs, the
    ping is answered after at most a turn or two of the burst's events,
    not after the whole read.  Every event still arrives, in order.  Three
    rounds: the rank's loop may also take the client first, whatever it
    does with the link (the old code held the ping behind ~3,000 events in
    most rounds, not all)."""
    from broker.overlay_stream import MAX_PER_TURN

    count, rounds = 10_000, 3
    inst = await start_instance(size=2)
    watcher, publisher = await connect(inst, 0), await connect(inst, 0)
    await asyncio.wait_for(watcher.subscribe("fair."), 10)
    loop = asyncio.get_running_loop()
    sock = await _raw_client(inst.uri(1))
    decoder = codec.StreamDecoder()
    received: list[Message] = []

    async def read_until(done) -> None:
        while not done():
            data = await loop.sock_recv(sock, 1 << 16)
            assert data, "rank 1 closed the connection"
            received.extend(codec.decode(f) for f in decoder.feed(data))

    await asyncio.wait_for(loop.sock_sendall(sock, codec.to_stream(codec.encode(Message(
        MsgType.REQUEST, "event.subscribe", {"topic": "fair."}, matchtag=1)))), 10)
    async with asyncio.timeout(10):
        await read_until(lambda: any(m.type == MsgType.RESPONSE for m in received))
    rank1 = inst.pids()[1]
    positions = []
    try:
        for r in range(rounds):
            received.clear()
            await stop_process(rank1)
            try:
                for i in range(count):
                    publisher.publish_nowait("fair.burst", {"i": i})
                publisher.flush()
                async with asyncio.timeout(60):  # rank 0 has forwarded them all
                    for _ in range(count):
                        await watcher.recv_event()
                await asyncio.wait_for(loop.sock_sendall(sock, codec.to_stream(codec.encode(Message(
                    MsgType.REQUEST, "broker.ping", {}, matchtag=2 + r)))), 10)
            finally:
                os.kill(rank1, signal.SIGCONT)
            async with asyncio.timeout(60):
                await read_until(lambda: len(received) >= count + 1)
            events = [m.payload["i"] for m in received if m.type == MsgType.EVENT]
            assert events == list(range(count))  # none lost, none reordered
            positions.append([m.type for m in received].index(MsgType.RESPONSE))
    finally:
        sock.close()
    # Taken whole, rank 1's first read of its parent's link (~200 KiB of
    # events waiting in the socket: thousands) would all go before the ping.
    assert max(positions) <= 2 * MAX_PER_TURN, positions


async def test_a_zeromq_child_that_does_not_read_does_not_hold_up_its_siblings(
        start_instance, connect) -> None:
    """ZeroMQ links: a child at its high-water mark (a stopped rank) made
    its parent queue every later message, to every child, behind its own
    (one backlog for the socket): the sibling got no events or answers until
    heartbeats dropped the stopped one (~10 s), or never while sends kept
    its socket buffers full (ipc).  Each child has its own backlog now: the
    sibling gets all of a burst past the mark while the stopped child is
    still connected."""
    from broker.overlay_zmq import HWM

    inst = await start_instance(size=3, fanout=2, attrs={"tbon.transport": "ipc"})
    h0, h2 = await connect(inst, 0), await connect(inst, 2)
    await asyncio.wait_for(h2.subscribe("flood."), 10)
    stopped = inst.pids()[1]
    await stop_process(stopped)
    try:
        count = 3 * HWM
        received = 0

        async def receive() -> None:
            nonlocal received
            while received < count:
                await h2.recv_event()
                received += 1

        reader = asyncio.create_task(receive())
        for i in range(count):
            h0.publish_nowait("flood.e")
            if i % 1000 == 999:
                await asyncio.sleep(0)  # (the handle writes as the loop turns)
        await asyncio.wait_for(reader, 60)
        assert (await asyncio.wait_for(h0.ping(2), 10))["rank"] == 2
        overlay = (await asyncio.wait_for(h0.rpc("broker.stats-get", {}), 10))["overlay"]
        assert 1 in overlay["children"], "the sibling was served only once rank 1 was dropped"
    finally:
        os.kill(stopped, signal.SIGCONT)


async def fill_zmq_pipe(h: Handle) -> None:
    """Publish past ZeroMQ's own high-water mark (it counts messages) towards
    a peer that does not read, so what follows queues in our backlog."""
    from broker.overlay_zmq import HWM

    for i in range(HWM + 1000):
        h.publish_nowait("test.fill")
        if i % 1000 == 999:
            await asyncio.sleep(0)


async def test_a_zeromq_child_that_does_not_read_is_dropped_and_stops(start_instance,
                                                                      connect) -> None:
    """ZeroMQ links: a stopped child made its parent buffer for it without
    bound while traffic flowed (~2.4 MB/s on ipc; its heartbeats never
    timed out while the link's buffers were full).  Past ``tbon.max-backlog``
    it is dropped, as on stream links: requests for it are answered
    ``EHOSTUNREACH`` at once, and the process, let run again, finds its
    connection hung up and exits 1."""
    inst = await start_instance(size=2, attrs={"tbon.transport": "ipc",
                                               "tbon.max-backlog": str(1 << 20)})
    h = await connect(inst, 0)
    child = inst.pids()[1]
    await stop_process(child)
    try:
        await fill_zmq_pipe(h)
        pad = "x" * (64 << 10)

        async def dropped() -> bool:
            await h.rpc("event.pub", {"topic": "test.flood", "payload": {"pad": pad}})
            return (await h.rpc("broker.stats-get", {}))["overlay"]["slow"] == 1

        await wait_until(dropped, "the link to the stopped child to be dropped", 60)
        with pytest.raises(RemoteError) as err:  # lost: answered at once, not held
            await asyncio.wait_for(h.ping(1), 10)
        assert err.value.errnum == errno.EHOSTUNREACH
        assert (await asyncio.wait_for(h.ping(0), 10))["rank"] == 0
    finally:
        os.kill(child, signal.SIGCONT)
    rank, status = await asyncio.wait_for(asyncio.shield(inst.failed), 30)
    assert (rank, status) == (1, 1)


async def test_a_zeromq_rank_whose_parent_does_not_read_stops(start_instance, connect) -> None:
    """ZeroMQ links, the other way: a rank whose parent stopped reading
    queued its requests upstream without bound.  Past ``tbon.max-backlog``
    it gives the parent up, as a stream link does: it stops, status 1."""
    inst = await start_instance(size=2, attrs={"tbon.transport": "ipc",
                                               "tbon.max-backlog": str(1 << 20)})
    h1 = await connect(inst, 1)
    parent = inst.pids()[0]
    await stop_process(parent)
    try:
        await fill_zmq_pipe(h1)
        pad = "x" * (64 << 10)
        for _ in range(40):  # then more than tbon.max-backlog behind it
            try:
                h1.publish_nowait("test.flood", {"pad": pad})
            except RemoteError as exc:  # (it gave its parent up already: stopped)
                assert exc.errnum == errno.ECONNRESET, exc
                break
            await asyncio.sleep(0)
        rank, status = await asyncio.wait_for(asyncio.shield(inst.failed), 30)
        assert (rank, status) == (1, 1)
    finally:
        os.kill(parent, signal.SIGCONT)
