"""The client ``Handle`` against crafted answers on a real Unix socket.

The peer here is the test itself speaking the wire format (docs/protocol.md),
so the Handle meets answers a broker would never send: garbage payloads,
spoiled headers, unknown matchtags, streams.
"""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path
from typing import Any

import msgpack
import pytest

from broker import codec
from broker.errors import ProtocolError, RemoteError
from broker.handle import Handle
from broker.message import Message, MsgType

T = 5.0


class Peer:
    """A one-connection server: hands each request to the test, sends what it is told."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[Message] = asyncio.Queue()
        self.writer: asyncio.StreamWriter | None = None
        self.connected = asyncio.Event()
        """Set once the server has taken the connection: a client's connect
        can return before (on the stock loop, the accept runs a turn later)."""
        self.done = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.connected.set()
        decoder = codec.StreamDecoder()
        try:
            while data := await reader.read(1 << 16):
                for frames in decoder.feed(data):
                    self.requests.put_nowait(codec.decode(frames))
        finally:
            writer.close()
            self.done.set()

    def send_frames(self, frames: list[bytes]) -> None:
        assert self.writer is not None
        self.writer.write(codec.to_stream(frames))

    def answer(self, req: Message, payload: Any = None, errnum: int = 0,
               errstr: str | None = None) -> None:
        self.send_frames(codec.encode(req.response(payload, errnum, errstr)))  # type: ignore[arg-type]


@pytest.fixture
async def wired(tmp_path: Path):
    peer = Peer()
    path = str(tmp_path / "peer.sock")
    server = await asyncio.start_unix_server(peer.serve, path)
    h = await Handle.connect(f"local://{path}")
    await asyncio.wait_for(peer.connected.wait(), T)
    yield h, peer
    await h.close()
    await asyncio.wait_for(peer.done.wait(), T)  # the peer saw the hang-up
    server.close()
    await server.wait_closed()


def header(req: Message, **fields: Any) -> bytes:
    h = [MsgType.RESPONSE, req.topic, req.matchtag, 0, 0, 0, 0, [], 0, None, 0]
    names = ["type", "topic", "matchtag", "nodeid", "flags", "userid", "rolemask", "route",
             "errnum", "errstr", "seq"]
    for name, value in fields.items():
        h[names.index(name)] = value
    return msgpack.packb(h)


@pytest.mark.both_loops
async def test_answers_errors_and_garbage(wired) -> None:
    h, peer = wired
    ok = h.rpc("svc.ok", {"a": 1})
    req = await asyncio.wait_for(peer.requests.get(), T)
    assert (req.topic, req.payload) == ("svc.ok", {"a": 1})
    peer.answer(req, {"b": [1, b"x" * codec.OOB_THRESHOLD]})  # a blob in its own frame
    assert await asyncio.wait_for(ok, T) == {"b": [1, b"x" * codec.OOB_THRESHOLD]}

    failing = h.rpc("svc.fail", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.answer(req, errnum=errno.ENOENT, errstr="no such thing")
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(failing, T)
    assert (info.value.errnum, info.value.errstr) == (errno.ENOENT, "no such thing")

    garbage = h.rpc("svc.garbage", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.send_frames([header(req), b"\xc1 not msgpack"])
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(garbage, T)


@pytest.mark.both_loops
async def test_a_matchtag_is_not_issued_again_while_it_may_be_answered(wired) -> None:
    """Past 2**31 requests the tags wrap: a tag still in use (a stream's) or
    forgotten before its answer came (a cancelled request) is skipped, as
    Flux's matchtag pool never reissues an unanswered tag.  It was issued
    again: a long watch's entries went to the new request, and a late answer
    to a cancelled wait answered a newer one (concurrency audit)."""
    h, peer = wired
    h.rpc_stream("svc.watch", {})
    watched = await asyncio.wait_for(peer.requests.get(), T)
    abandoned = h.rpc("svc.wait", {})
    waited = await asyncio.wait_for(peer.requests.get(), T)
    abandoned.cancel()
    assert h.pending == 1  # (the cancelled one is forgotten, its tag kept back)
    h._next_tag = 0x7FFFFFFF  # the state of a handle ~2**31 requests later
    tags = []
    for _ in range(3):
        fut = h.rpc("svc.new", {})
        req = await asyncio.wait_for(peer.requests.get(), T)
        tags.append(req.matchtag)
        peer.answer(req, {})
        await asyncio.wait_for(fut, T)
    assert {watched.matchtag, waited.matchtag} == {1, 2}
    assert tags == [0x7FFFFFFF, 3, 4]
    # the late answer is dropped, and frees its tag for the next wrap
    peer.answer(waited, {"late": True})
    later = h.rpc("svc.after", {})
    after = await asyncio.wait_for(peer.requests.get(), T)
    peer.answer(after, {"n": 1})
    assert await asyncio.wait_for(later, T) == {"n": 1}
    assert waited.matchtag not in h._unanswered


async def test_a_retired_stream_s_tag_is_kept_until_its_last_answer(wired) -> None:
    """A stream retired on this side (closed, a loop left by ``break``) goes
    on being answered until the service ends it: its first late answer freed
    the tag, so after a wrap a new request got it, and the stream's next
    answer settled that request."""
    h, peer = wired
    stream = h.rpc_stream("svc.watch", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    h.retire(stream.matchtag)
    peer.answer(req, {"n": 1})  # (late: dropped, and the stream goes on)
    ping = h.rpc("svc.ping", {})  # (an answer after the late one: it was read)
    peer.answer(await asyncio.wait_for(peer.requests.get(), T), {})
    await asyncio.wait_for(ping, T)
    assert req.matchtag in h._unanswered
    peer.answer(req, None, errno.ENODATA)  # its last answer: the tag is free again
    ping = h.rpc("svc.ping", {})
    peer.answer(await asyncio.wait_for(peer.requests.get(), T), {})
    await asyncio.wait_for(ping, T)
    assert req.matchtag not in h._unanswered


@pytest.mark.both_loops
async def test_spoiled_headers_and_strangers_are_dropped(wired) -> None:
    h, peer = wired
    pending = h.rpc("svc.wait", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.send_frames([header(req, matchtag=str(req.matchtag)), msgpack.packb({})])
    peer.send_frames([header(req, errnum="ENOENT")])
    peer.send_frames([header(req, matchtag=req.matchtag + 1000), msgpack.packb({"x": 1})])
    peer.send_frames([b"\xc1"])
    peer.answer(req, {"finally": True})  # the one sound answer settles it
    assert await asyncio.wait_for(pending, T) == {"finally": True}
    assert h.pending == 0


@pytest.mark.both_loops
async def test_a_stream_gets_every_answer_in_order(wired) -> None:
    h, peer = wired
    stream = h.rpc_stream("svc.stream", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    for i in range(3):
        peer.answer(req, {"i": i})
    peer.answer(req, errnum=errno.ENODATA)
    got = [p async for p in stream]
    assert got == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert h.pending == 0


def send_event(peer: Peer, topic: str, payload: Any, seq: int) -> None:
    peer.send_frames(codec.encode(Message(MsgType.EVENT, topic, payload, seq=seq)))


@pytest.mark.both_loops
async def test_tasks_waiting_for_events_together_each_get_one(wired) -> None:
    """Each waiting task is served (one event each), a cancelled waiter
    leaves the others waiting, and close() ends those still waiting.  With
    one waiter slot, the first task waited for ever."""
    h, peer = wired
    waiters = [asyncio.ensure_future(h.recv_event()) for _ in range(3)]
    quitter = asyncio.ensure_future(h.recv_event())
    await asyncio.sleep(0)  # every waiter is registered
    quitter.cancel()
    for seq in (1, 2):
        send_event(peer, "t.x", {"n": seq}, seq)
    done: set[asyncio.Future] = set()
    still = set(waiters)
    async with asyncio.timeout(T):  # two events: two waiters served
        while len(done) < 2:
            served, still = await asyncio.wait(still, return_when=asyncio.FIRST_COMPLETED)
            done |= served
    assert len(done) == 2 and len(still) == 1, (done, still)  # (two events, two served)
    assert sorted(t.result().payload["n"] for t in done) == [1, 2]
    await h.close()
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(still.pop(), T)
    assert info.value.errnum == errno.ECONNRESET


@pytest.mark.both_loops
async def test_an_event_wakes_one_waiting_task_the_longest_waiting(wired) -> None:
    """With many tasks waiting, an event wakes one of them, the first to
    wait; the others stay asleep on their first wait.  (Every waiter used to
    be woken for every event, to find it taken and wait again: ~1.5 ms of
    CPU per event with 1,000 waiting.)  A woken task cancelled before it
    took its event passes it on to the next."""
    h, peer = wired
    tasks = [asyncio.ensure_future(h.recv_event()) for _ in range(100)]
    async with asyncio.timeout(T):
        while len(h._event_waiters) < 100:
            await asyncio.sleep(0)
    first_waits = list(h._event_waiters)
    send_event(peer, "t.x", {"n": 1}, 1)
    served = await asyncio.wait_for(tasks[0], T)
    assert served.payload == {"n": 1}
    assert not any(t.done() for t in tasks[1:])
    assert list(h._event_waiters) == first_waits[1:]  # the same waits, none woken
    assert not any(w.done() for w in first_waits[1:])
    # tasks[1] is woken for the next event and cancelled before it runs
    send_event(peer, "t.x", {"n": 2}, 2)
    async with asyncio.timeout(T):
        while not first_waits[1].done():
            await asyncio.sleep(0)
    tasks[1].cancel()
    got = await asyncio.wait_for(tasks[2], T)
    assert got.payload == {"n": 2}
    assert tasks[1].cancelled()
    assert not any(t.done() for t in tasks[3:])
    await h.close()
    results = await asyncio.wait_for(asyncio.gather(*tasks[3:], return_exceptions=True), T)
    assert all(isinstance(r, RemoteError) and r.errnum == errno.ECONNRESET for r in results)


@pytest.mark.both_loops
async def test_a_stream_has_one_reader(wired) -> None:
    """A second task reading the same stream gets RuntimeError (as a second
    __anext__ of an async generator), not a wait for ever."""
    h, peer = wired
    stream = h.rpc_stream("svc.stream", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    first = asyncio.ensure_future(stream.next_message())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="already reading"):
        await asyncio.wait_for(stream.next_message(), T)
    peer.answer(req, {"i": 0})
    assert (await asyncio.wait_for(first, T)).payload == {"i": 0}
    peer.answer(req, errnum=errno.ENODATA)
    assert await asyncio.wait_for(stream.next_message(), T) is None


@pytest.mark.both_loops
@pytest.mark.parametrize("call", [
    lambda h: h.rpc(None, {}), lambda h: h.rpc(b"svc.x", {}), lambda h: h.rpc(5),
    lambda h: h.rpc_stream(None), lambda h: h.send_noresponse(b"svc.x"),
    lambda h: h.rpc("svc.x", nodeid="1"), lambda h: h.rpc("svc.x", flags=None),
])
async def test_a_request_the_broker_could_not_read_is_a_type_error(wired, call) -> None:
    """The broker drops a request whose topic it cannot read (it cannot
    answer it), so the call would have waited for ever: refused here."""
    h, peer = wired
    with pytest.raises(TypeError):
        call(h)
    ok = h.rpc("svc.ok", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    assert req.topic == "svc.ok"  # nothing was sent before it
    peer.answer(req, {})
    await asyncio.wait_for(ok, T)
    assert h.pending == 0


async def test_rpc_with_noresponse_is_refused(wired) -> None:
    from broker.message import MsgFlags

    h, _peer = wired
    with pytest.raises(ValueError, match="send_noresponse"):
        h.rpc("svc.x", {}, flags=MsgFlags.NORESPONSE)
    with pytest.raises(ValueError, match="send_noresponse"):
        h.rpc_stream("svc.x", {}, flags=MsgFlags.NORESPONSE)
    assert h.pending == 0


@pytest.mark.both_loops
async def test_close_sends_what_this_turn_held_back(wired) -> None:
    """Messages sent in the same loop turn as close() are held by the writer
    (coalesced per turn), not yet the transport's: close() hands them over."""
    h, peer = wired
    for i in range(50):
        h.send_noresponse("svc.note", {"i": i})
    async with asyncio.timeout(T):
        await h.close()  # (awaited directly: it starts in this very turn)
    await asyncio.wait_for(peer.done.wait(), T)
    got = [peer.requests.get_nowait().payload["i"] for _ in range(peer.requests.qsize())]
    assert got == list(range(50))


@pytest.mark.both_loops
async def test_a_call_from_another_thread_is_refused_and_the_handle_goes_on(wired) -> None:
    """While the handle's loop runs, a call from another thread (no loop of
    its own there) went through unchecked, touching the loop's writer and
    futures; under asyncio's debug mode it wedged the handle for good."""
    h, peer = wired
    asyncio.get_running_loop().set_debug(True)

    def from_a_thread(call: Any) -> str:
        try:
            call()
        except RuntimeError as exc:
            return str(exc)
        return "went through"

    for call in (lambda: h.send_noresponse("svc.x", {}), lambda: h.rpc("svc.x", {}),
                 lambda: h.publish_nowait("ev.x")):
        said = await asyncio.to_thread(from_a_thread, call)
        assert "serves an event loop running in another thread" in said, said
    assert h.pending == 0
    ok = h.rpc("svc.ok", {})  # nothing was sent before it, and it is answered
    req = await asyncio.wait_for(peer.requests.get(), T)
    assert req.topic == "svc.ok"
    peer.answer(req, {})
    await asyncio.wait_for(ok, T)


@pytest.mark.both_loops
async def test_close_sends_a_big_message_and_those_behind_it(wired) -> None:
    """A message bigger than the socket takes at once waits in the writer
    in pieces, the ones behind it too: close() used to close the transport
    under them, so the peer read the start of the big one, then EOF, and
    both were lost."""
    h, peer = wired
    big = b"x" * (8 << 20)
    h.send_noresponse("svc.big", {"data": big})
    h.send_noresponse("svc.small", {"n": 1})
    async with asyncio.timeout(T):
        await h.close()
    await asyncio.wait_for(peer.done.wait(), T)
    got = [peer.requests.get_nowait() for _ in range(peer.requests.qsize())]
    assert [m.topic for m in got] == ["svc.big", "svc.small"]
    assert got[0].payload["data"] == big


@pytest.mark.both_loops
async def test_close_gives_up_flushing_to_a_peer_that_does_not_read(tmp_path: Path) -> None:
    """A broker that is stopped (SIGSTOP) or stuck reads nothing: close()
    flushes for CLOSE_FLUSH_TIMEOUT, then drops what is left.  It used to
    wait for ever."""
    path = str(tmp_path / "deaf.sock")
    accepted = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def deaf(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        accepted.set()

    server = await asyncio.start_unix_server(deaf, path)
    h = await Handle.connect(f"local://{path}")
    h.CLOSE_FLUSH_TIMEOUT = 0.2
    await asyncio.wait_for(accepted.wait(), T)
    h.send_noresponse("svc.big", {"data": b"x" * (16 << 20)})  # more than the socket holds
    await asyncio.wait_for(h.close(), T)
    with pytest.raises(RemoteError):
        h.rpc("svc.after", {})
    for w in writers:
        w.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize("uri", ["local://", "tcp://host:1", "ssh://host-without-path", ""])
async def test_a_malformed_uri_is_a_value_error(uri: str) -> None:
    with pytest.raises(ValueError):
        await Handle.connect(uri)


@pytest.mark.both_loops
async def test_connecting_to_nothing_names_the_socket(tmp_path: Path) -> None:
    """uvloop's FileNotFoundError said "No such file or directory" and not
    which socket: the error names the path it tried, on both loops."""
    path = tmp_path / "gone" / "local-0"
    for uri in (f"local://{path}", str(path)):
        with pytest.raises(FileNotFoundError) as info:
            await Handle.connect(uri)
        assert info.value.filename == str(path)
        assert str(path) in str(info.value)


# ---------------------------------------------------------------- fork()


async def _in_forked_child(child: Any) -> tuple[int, Any]:
    """Fork; the child runs ``child()`` (sync code, which may run its own
    event loop) and exits with its status at once (``os._exit``: nothing of
    the test's process runs there); returns (pid, a future of that status)."""
    import os

    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    loop = asyncio.get_running_loop()
    return pid, loop.run_in_executor(None, lambda: os.waitstatus_to_exitcode(
        os.waitpid(pid, 0)[1]))


@pytest.mark.both_loops
async def test_a_forked_childs_call_on_the_parents_handle_fails(start_instance,
                                                                connect) -> None:
    """A child of fork() calling the parent's handle (from a loop of its
    own) sent its request on the parent's connection with the matchtag the
    parent was to use next: the parent's request waiting under that tag
    got the child's answer (a ping's payload for a kvs.wait-version).  The
    child's call now raises ECONNRESET saying why, before sending."""
    import os

    inst = await start_instance(size=1)
    h = await connect(inst)
    version = int((await h.rpc("kvs.getroot", {"namespace": "primary"}))["rootseq"])
    go_r, go_w = os.pipe()

    def child() -> int:
        os.read(go_r, 1)  # (once the parent's request is waiting under the same tag)
        try:
            asyncio.run(h.ping(payload={"from": "child"}))
        except RemoteError as exc:
            return 1 if exc.errnum == errno.ECONNRESET and "forked" in exc.errstr else 2
        except BaseException:
            return 3
        return 0

    _, status = await _in_forked_child(child)
    tag, waiting = h.rpc_tagged("kvs.wait-version",
                                {"namespace": "primary", "rootseq": version + 1000})
    os.write(go_w, b"x")
    code = await asyncio.wait_for(status, 30)
    # the answer to anything the child sent comes before this one's
    assert (await asyncio.wait_for(h.ping(payload={"from": "parent"}), 10))["from"] == "parent"
    assert not waiting.done(), waiting.result()
    h.retire(tag)
    assert code == 1


@pytest.mark.both_loops
async def test_a_forked_childs_close_leaves_the_parents_handle_working(start_instance,
                                                                       connect) -> None:
    """A child of fork() closing the parent's handle unregistered the
    parent's socket from the event loop's epoll instance, which the two
    processes share: the parent's next call waited for ever.  In the child
    close() now does nothing, and the parent's calls go on."""
    inst = await start_instance(size=1)
    h = await connect(inst)
    await asyncio.wait_for(h.ping(), 10)

    def child() -> int:
        asyncio.run(h.close())
        return 0

    _, status = await _in_forked_child(child)
    code = await asyncio.wait_for(status, 30)
    assert (await asyncio.wait_for(h.ping(payload={"n": 1}), 10))["n"] == 1
    assert code == 0


async def test_the_longest_waiting_task_gets_the_next_event(wired) -> None:
    """A waiter woken for an event that a task which did not have to wait
    took first stays first in line: it went to the back, and the next event
    went to a task that had waited less.  (Events handed in as the
    connection's reader hands them, for a fixed interleaving.)"""
    h, _ = wired
    got: list[tuple[str, str]] = []

    async def waiter(name: str) -> None:
        got.append((name, (await h.recv_event()).topic))

    a = asyncio.ensure_future(waiter("A"))
    await asyncio.sleep(0)
    c = asyncio.ensure_future(waiter("C"))
    await asyncio.sleep(0)
    b = asyncio.ensure_future(waiter("B"))  # (scheduled: its first step runs next)
    h._on_event(Message(MsgType.EVENT, "e.1", seq=1))  # wakes A; B takes it, not waiting
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    h._on_event(Message(MsgType.EVENT, "e.2", seq=2))
    h._on_event(Message(MsgType.EVENT, "e.3", seq=3))
    await asyncio.wait_for(asyncio.gather(a, b, c), T)
    assert got == [("B", "e.1"), ("A", "e.2"), ("C", "e.3")]


async def test_recv_event_after_close_raises_though_events_are_queued(tmp_path) -> None:
    """After close() every call raises, recv_event too: it returned the
    events queued before (in a fork's child, the parent's, a second time)."""
    peer = Peer()
    path = str(tmp_path / "peer.sock")
    server = await asyncio.start_unix_server(peer.serve, path)
    try:
        h = await Handle.connect(f"local://{path}")
        await asyncio.wait_for(peer.connected.wait(), T)
        peer.send_frames(codec.encode(Message(MsgType.EVENT, "e.1", seq=1)))
        assert (await asyncio.wait_for(h.recv_event(), T)).topic == "e.1"
        peer.send_frames(codec.encode(Message(MsgType.EVENT, "e.2", seq=2)))
        ping = h.rpc("svc.ping", {})  # (answered after e.2: e.2 is queued by then)
        peer.answer(await asyncio.wait_for(peer.requests.get(), T), {})
        await asyncio.wait_for(ping, T)
        await h.close()
        with pytest.raises(RemoteError) as closed:
            await h.recv_event()
        assert closed.value.errnum == errno.ECONNRESET
    finally:
        server.close()
        await server.wait_closed()


async def test_recv_event_after_a_loss_gives_the_events_that_came_before(wired) -> None:
    """The rank went (not ``close()``): the events it sent before are read
    first -- a last word before it stopped -- then ``ECONNRESET``.  They
    were lost: it raised at once with them queued (found by a review)."""
    h, peer = wired
    for seq in (1, 2):
        peer.send_frames(codec.encode(Message(MsgType.EVENT, f"e.{seq}", seq=seq)))
    assert peer.writer is not None
    peer.writer.close()  # (after them, on the same stream)
    async with asyncio.timeout(T):
        while h.connected:
            await asyncio.sleep(0.005)
    assert [(await h.recv_event()).topic for _ in range(2)] == ["e.1", "e.2"]
    with pytest.raises(RemoteError) as lost:
        await h.recv_event()
    assert lost.value.errnum == errno.ECONNRESET


async def test_abandoning_a_stream_whose_end_came_ends_it(wired) -> None:
    """``Stream.abandon()`` with the stream's final answer already queued,
    unread: a reader finds the end (None).  It dropped that answer too,
    and no other would come, so the reader waited for ever (found by a
    review)."""
    h, peer = wired
    s = h.rpc_stream("svc.stream", {})
    req = await asyncio.wait_for(peer.requests.get(), T)
    peer.answer(req, {"n": 1})
    peer.answer(req, errnum=errno.ENODATA)
    ping = h.rpc("svc.ping", {})  # (answered after them: they are queued by then)
    peer.answer(await asyncio.wait_for(peer.requests.get(), T), {})
    await asyncio.wait_for(ping, T)
    s.abandon()
    assert await asyncio.wait_for(s.next_message(), T) is None
    assert s.done
