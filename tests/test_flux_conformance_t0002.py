"""flux-core t/t0002-request.t (basic request/response handling) against
real kvbroker ranks.

Flux loads a test module, ``req``, on ranks 0 and 1 of a 2-rank instance
and drives it with a client program, ``treq``; the last cases use a
generic RPC client on ``attr.*``.  Here a ``req`` plugin module (below,
installed by entry point as test_broker_modules.py installs its echo
module) is named in ``broker.modules`` and so runs on every rank; the
client is a :class:`~broker.handle.Handle`, a
:class:`~test_broker_support.RawClient` where the Handle's manners would
hide what the broker sends, and the ``kvbroker rpc`` command.

Flux's cases, in order, and what each becomes:

1.  'flux_rpc(3) example runs' -> docs/api.md's "Requests" example (the
    counterpart of the man page's example), run as written against a
    2-rank instance: :func:`test_the_api_docs_request_example_runs`.
2.  'flux_rpc_then(3) example runs' -> the same test: the example's
    ``asyncio.gather`` of 100 pings is the callback form's counterpart
    (there is no separate continuation API: an RPC is an awaitable).
3.  'load req module on rank 0', 4. '... on rank 1' -> as Flux's:
    ``kvbroker module load req`` with the URI of rank 0, then of rank 1
    (Flux's ``flux exec -r 1 flux module load``), into a running instance
    that did not start with it; listed on both ranks (``module.list``) and
    answering ``req.null`` there:
    :func:`test_req_module_loaded_and_removed_at_runtime`.  The other
    cases' tests name the module in ``broker.modules`` (found by entry
    point on every rank, listed on both: :func:`test_null_requests_by_rank`).
5.  'simple rpc with no payload' -> ``req.null`` with nodeid ANY: the
    module checks that the request has no payload, its topic and its
    nodeid (its rank or ANY), and answers with no payload.
6.  '... (traced)' (``FLUX_HANDLE_TRACE=1`` prints the messages) -> does
    not apply: kvbroker's Handle has no message trace.  The nearest thing,
    ``kvbroker overlay trace`` of what crosses a rank's links, is tested
    by tests/test_overlay_trace.py; not repeated here.
7.  'simple rpc to rank 0', 8. '... to rank 1' -> ``req.null`` addressed to
    each rank from a client of the other rank (and of its own).
9.  'rpc that echos back json payload' -> ``req.echo`` of a map; also a
    1 MiB ``bytes`` payload and a big map through the link (payload sizes),
    and a request with no payload answered ``EPROTO``, as Flux's echo does.
10. 'rpc returns expected error' -> ``req.err`` answers errno 42 (an errno
    with no name: the client still gets the number).
11. 'rpc returns expected json' -> ``req.src`` answers ``{"wormz": 42}``.
12. 'rpc accepts expected json' -> ``req.sink`` takes ``{"pi": 3.14}`` (and
    refuses another value ``EPROTO``).
13. '10K responses received in order' -> Flux sends a *plain* request to
    ``req.nsrc`` and reads 10,000 responses with ``flux_recv``.  Here: a
    streaming request through the link (client on rank 1, module on rank
    0) whose 10,000 responses arrive in order, then the end (``ENODATA``);
    and, as Flux does it, a plain (non-streaming) request sent raw: see
    :func:`test_many_responses_to_a_plain_request` for what kvbroker does.
14. '10K responses received in order, with deferrals' (``flux_requeue``
    of 500 of them on the client's own handle) -> does not apply: the
    Handle has no requeue; a client's reordering of its own queue is not a
    broker matter.  The in-order delivery it builds on is case 13.
15. 'proxy ping 0 from 1 is 4 hops', 16. '0 from 0 is 3 hops', 17. '1 from 1
    is 3 hops', 18. 'upstream from 1 is 4 hops' -> ``req.xping``: the
    client's request goes to the module on rank N, which sends
    ``broker.ping`` to rank X (or ``NODEID_UPSTREAM``) and answers the
    route the ping saw.  kvbroker's route is a list of hops (the module's
    ``m:req``, then each rank crossed), so the test asserts the exact
    route, and Flux's relations between the hop counts: from 1 to 0 is
    one hop more than from 0 to 0 or from 1 to 1, and upstream from 1 is
    the same as 0 from 1.
    (Flux's commented-out 'proxy ping any from 0 is ENOSYS') -> not a
    Flux case; kvbroker's counterpart, ``NODEID_UPSTREAM`` from rank 0, is
    answered ``EHOSTUNREACH`` (asserted in the same test), not left
    unanswered.
19. 'unloaded req module on rank 1', 20. '... on rank 0' -> the same
    test: ``kvbroker module remove req`` on rank 1, then on rank 0; after
    each the module is no longer listed there, a ``req.null`` addressed to
    that rank ends ``ENOSYS``, and one to any rank from a client of rank 1
    is served by rank 0's module (the request goes up) until it too is
    removed, then ends ``ENOSYS``.  Beyond the case: a request the module
    holds unanswered (``req.clog``) when it is removed ends ``ENOSYS``
    (docs/cli.md "module": "The requests it was still serving end
    ENOSYS"), and one whose client goes is forgotten
    (:func:`test_a_request_held_by_a_removed_module_ends_enosys`).  A
    DEFECT found here, fixed: it was never answered and its client waited
    for ever -- only a request whose handler was still running as the
    module stopped was.  (Flux answers those ``EHOSTUNREACH`` "module
    disconnect" for a module run as its own process, not for one run as a
    thread.)
21. 'rpc test client works with no request payload' -> ``kvbroker rpc
    attr.list`` prints a non-empty answer.
22. '... with request payload' -> ``kvbroker rpc attr.get '{"name":"rank"}'``.
23. '... handles expected failure' (``attr.get`` with no payload is
    ``EPROTO``, 71) -> ``kvbroker rpc attr.get`` exits 1 with
    ``Protocol error``; the Handle gets errnum 71.
24. '... expected failure other than EPROTO' (``noexist`` is ``ENOENT``)
    -> exits 1 with ``No such file or directory``; errnum 2.
25. '... handles unexpected failure' (the client expected 2, got 71, and
    fails) -> the test client's own check; here the same request's errnum
    is asserted to be 71, not 2 (the Handle distinguishes them).

Beyond the list, the semantics the brief names: a ``NORESPONSE`` request is
served and answered with nothing (the next message on the connection is
the next request's answer), a request to a rank that does not exist is
``EHOSTUNREACH``, and an unknown method of the module is ``ENOSYS``; the
errors the broker would answer itself (ENOSYS, EHOSTUNREACH, EPROTO) are
not sent for a ``NORESPONSE`` request either.  Payload sizes: 1 MiB and
10,000-key payloads echo through a link; over ``tbon.max-message`` (64 KiB
here) or ``broker.max-message`` a request or answer is ``EMSGSIZE``,
answered.  Two tests pin a DEFECT this file found (fixed): a *streaming*
answer too big for a link is replaced by ``EMSGSIZE`` -- the end of the
stream for the client -- but the service was not told: its later answers
still arrived on that matchtag (a second terminal answer among them), and
a kvs watch so ended stayed registered on the serving rank, answering
every commit to no one, until its client disconnected.  The rank that cuts
the stream now drops its later answers and sends the service
``<service>.cancel`` (broker/router.py ``Router._cut_stream``).

From Flux's req module beyond t0002.t's list: ``req.clog``/``req.flush``
(held requests answered in order, before the flush; one held on a rank
that is killed is answered ``EHOSTUNREACH``), and an error answer with
errnum 0, which Flux's ``flux_respond_error`` turns into EINVAL, as
kvbroker now does (it sent a success, and a stream so "ended" went on).
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import (
    RawClient,
    doc_block,
    run_cli,
    run_python,
    tree_path,
    use_module_plugin,
    wait_until,
)
from test_watch_helpers import commit, put

from broker.errors import RemoteError
from broker.message import NODEID_ANY, NODEID_UPSTREAM, MsgFlags, MsgType
from kvs_watch.client import watch

REQ = '''
import errno
from typing import ClassVar

from broker.errors import ErrnoError
from broker.message import NODEID_ANY
from broker.module import Module, require


class ReqModule(Module):
    """The counterpart of Flux's t/request/req.c."""
    name: ClassVar[str] = "req"

    def handlers(self):
        return {"req.null": self.null, "req.echo": self.echo, "req.err": self.err,
                "req.src": self.src, "req.sink": self.sink, "req.nsrc": self.nsrc,
                "req.xping": self.xping, "req.big": self.big, "req.clog": self.clog,
                "req.flush": self.flush, "req.count": self.count, "req.zero": self.zero}

    def null(self, msg):
        why = None
        if msg.topic != "req.null":
            why = f"topic {msg.topic}"
        elif msg.nodeid not in (self.ctx.rank, NODEID_ANY):
            why = f"nodeid {msg.nodeid} on rank {self.ctx.rank}"
        elif msg.payload is not None:
            why = f"payload {msg.payload!r}"
        if why:
            raise ErrnoError(errno.EPROTO, "req.null: unexpected " + why)
        self.h.respond(msg, None)

    def echo(self, msg):
        if msg.payload is None:
            raise ErrnoError(errno.EPROTO, "req.echo: no payload")
        self.h.respond(msg, msg.payload)

    def err(self, msg):
        self.h.respond_error(msg, 42)

    def src(self, msg):
        self.h.respond(msg, {"wormz": 42})

    def sink(self, msg):
        if require(msg.payload, pi=float)["pi"] != 3.14:
            raise ErrnoError(errno.EPROTO, "req.sink: not pi")
        self.h.respond(msg, None)

    def nsrc(self, msg):
        count = require(msg.payload, count=int)["count"]
        for i in range(count):
            self.h.respond(msg, {"seq": i})
        if msg.streaming:
            self.h.respond_error(msg, errno.ENODATA)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.clogged = []

    def clog(self, msg):
        self.clogged.append(msg)  # answered at the next req.flush

    def flush(self, msg):
        while self.clogged:
            self.h.respond(self.clogged.pop(0), None)
        self.h.respond(msg, None)

    def count(self, msg):
        self.h.respond(msg, {"count": len(self.clogged)})

    def zero(self, msg):
        self.h.respond_error(msg, 0)

    def big(self, msg):
        sizes = require(msg.payload, sizes=list)["sizes"]
        for i, n in enumerate(sizes):
            self.h.respond(msg, {"i": i, "pad": b"x" * n})
        if msg.streaming:
            self.h.respond_error(msg, errno.ENODATA)

    async def xping(self, msg):
        body = require(msg.payload, rank=int, service=str)
        resp = await self.h.rpc(body["service"], {"seq": 0}, nodeid=body["rank"])
        self.h.respond(msg, {"route": resp["route"], "rank": resp["rank"]})
'''

MODULES = {"broker.modules": "content,req"}
T = 20.0


@pytest.fixture
def req_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_module_plugin(tmp_path, monkeypatch, "req", "ReqModule", REQ)


async def test_the_api_docs_request_example_runs(start_instance,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Cases 1-2: docs/api.md's request example (pings to every rank, an
    expected ENOENT, 100 concurrent RPCs, a NORESPONSE send) runs as
    written and prints what its comments say."""
    inst = await start_instance(size=2)
    script = doc_block("api.md", "import asyncio\nfrom broker.errors import RemoteError")
    monkeypatch.setenv("KVBROKER_URI", inst.uri(1))
    rc, out, err = await run_python(script)
    assert rc == 0, err
    # (the client is on rank 1: its pings' routes; fanout is 2)
    assert out.splitlines() == ["0 c1!r1!r0", "1 c1!r1", "{'value': 2}",
                                "2 ENOENT unknown attribute 'nosuch'", "100"], out


async def test_req_module_loaded_and_removed_at_runtime(req_plugin, start_instance,
                                                        connect) -> None:
    """Cases 3-4 and 19-20 with ``kvbroker module load|remove`` on the
    running ranks (each command with the URI of its rank, as Flux runs
    ``flux module`` on rank 1 with ``flux exec -r 1``)."""
    inst = await start_instance(size=2)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)

    async def module(rank: int, *args: str) -> None:
        rc, out, err = await run_cli("module", *args, uri=inst.uri(rank), timeout=T)
        assert (rc, out, err) == (0, "", ""), (rank, args, rc, out, err)

    async def listed(rank: int) -> bool:
        mods = (await h0.rpc("module.list", {}, nodeid=rank))["modules"]
        return "req" in [m["name"] for m in mods]

    async def enosys(h, nodeid: int) -> None:
        with pytest.raises(RemoteError) as info:
            await h.rpc("req.null", None, nodeid=nodeid)
        assert info.value.errnum == errno.ENOSYS, info.value

    async with asyncio.timeout(T):
        assert not await listed(0) and not await listed(1)
        await module(0, "load", "req")  # "load req module on rank 0"
        await module(1, "load", "req")  # "load req module on rank 1"
        assert await listed(0) and await listed(1)
        for h in (h0, h1):
            for nodeid in (NODEID_ANY, 0, 1):
                assert await h.rpc("req.null", None, nodeid=nodeid) is None

        await module(1, "remove", "req")  # "unloaded req module on rank 1"
        assert not await listed(1) and await listed(0)
        await enosys(h0, 1)
        await enosys(h1, 1)
        assert await h1.rpc("req.null", None) is None  # (served by rank 0's, upstream)
        await module(0, "remove", "req")  # "unloaded req module on rank 0"
        assert not await listed(0)
        for h in (h0, h1):
            for nodeid in (NODEID_ANY, 0, 1):
                await enosys(h, nodeid)


async def test_a_request_held_by_a_removed_module_ends_enosys(req_plugin, start_instance,
                                                              connect) -> None:
    """Beyond 19: ``req.clog`` held by rank 1's module when ``module remove
    req`` takes it away is answered ``ENOSYS`` naming the removal, as
    docs/cli.md "module" says of the requests a removed module was still
    serving (its client stays connected and would otherwise wait)."""
    inst = await start_instance(size=2, attrs=MODULES)
    h0 = await connect(inst, 0)
    held = h0.rpc("req.clog", None, nodeid=1)

    async def holding() -> bool:
        return (await h0.rpc("req.count", None, nodeid=1))["count"] == 1

    await wait_until(holding, "a request held on rank 1", T)
    rc, out, err = await run_cli("module", "remove", "req", uri=inst.uri(1), timeout=T)
    assert (rc, out, err) == (0, "", "")
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(held, 5)
    assert info.value.errnum == errno.ENOSYS, info.value
    assert "module req was removed" in (info.value.errstr or ""), info.value


async def test_a_held_request_whose_client_goes_is_forgotten(req_plugin, start_instance,
                                                             connect) -> None:
    """The broker notes a request a module's handler returned without
    answering, to end it if the module is removed; its client's going
    forgets it (``module list --json`` counts them: ``held``)."""
    inst = await start_instance(size=1, attrs=MODULES)
    h = await connect(inst, 0)

    other = await connect(inst, 0)
    parked = other.rpc("req.clog", None)
    await wait_until(lambda: _is(held(h), 1), "the request held", T)
    await other.close()
    with pytest.raises(RemoteError):
        await asyncio.wait_for(parked, T)  # (ECONNRESET: the handle closed)
    await wait_until(lambda: _is(held(h), 0), "the held request forgotten", T)


async def _is(count: Awaitable[int], n: int) -> bool:
    return await count == n


async def held(h: Any) -> int:
    """The requests the broker notes for rank 0's ``req`` module."""
    listing = await asyncio.wait_for(h.rpc("module.list", {}), T)
    return int(next(m["held"] for m in listing["modules"] if m["name"] == "req"))


async def test_null_requests_by_rank(req_plugin, start_instance, connect) -> None:
    """Cases 3-5, 7-8: the module is on both ranks; ``req.null`` (no
    payload, checked by the module with its topic and nodeid) is answered
    with no payload, for nodeid ANY, 0 and 1, from clients of each rank."""
    inst = await start_instance(size=2, attrs=MODULES)
    async with asyncio.timeout(T):
        h0, h1 = await connect(inst, 0), await connect(inst, 1)
        for rank in (0, 1):
            names = [m["name"] for m in (await h0.rpc("module.list", {}, nodeid=rank))["modules"]]
            assert "req" in names, (rank, names)
        for h in (h0, h1):
            for nodeid in (NODEID_ANY, 0, 1):
                assert await h.rpc("req.null", None, nodeid=nodeid) is None
        # the module does refuse what it should not see (so the above checked)
        with pytest.raises(RemoteError) as info:
            await h1.rpc("req.null", {"x": 1}, nodeid=0)
        assert info.value.errnum == errno.EPROTO and "payload" in (info.value.errstr or "")


async def test_echo_err_src_sink(req_plugin, start_instance, connect) -> None:
    """Cases 9-12, through the link (client of rank 1, module of rank 0)
    and locally: echo (a map, 1 MiB of bytes, a 10,000-key map; none is
    EPROTO), err (errno 42), src (``{"wormz": 42}``), sink (3.14 accepted,
    another value EPROTO)."""
    inst = await start_instance(size=2, attrs=MODULES)
    async with asyncio.timeout(T):
        h1 = await connect(inst, 1)
        big = os.urandom(1 << 20)
        wide = {f"k{i}": i for i in range(10_000)}
        for nodeid in (0, 1):
            assert await h1.rpc("req.echo", {"mumble": "burble"}, nodeid=nodeid) == {
                "mumble": "burble"}
            assert await h1.rpc("req.echo", {"blob": big}, nodeid=nodeid) == {"blob": big}
            assert await h1.rpc("req.echo", wide, nodeid=nodeid) == wide
            with pytest.raises(RemoteError) as info:
                await h1.rpc("req.echo", None, nodeid=nodeid)
            assert info.value.errnum == errno.EPROTO
            with pytest.raises(RemoteError) as info:
                await h1.rpc("req.err", None, nodeid=nodeid)
            assert info.value.errnum == 42
            assert await h1.rpc("req.src", None, nodeid=nodeid) == {"wormz": 42}
            assert await h1.rpc("req.sink", {"pi": 3.14}, nodeid=nodeid) is None
            with pytest.raises(RemoteError) as info:
                await h1.rpc("req.sink", {"pi": 3.0}, nodeid=nodeid)
            assert info.value.errnum == errno.EPROTO
            with pytest.raises(RemoteError) as info:
                await h1.rpc("req.nosuch", None, nodeid=nodeid)
            assert info.value.errnum == errno.ENOSYS


async def test_10k_streamed_responses_in_order(req_plugin, start_instance, connect) -> None:
    """Case 13 (streaming form): 10,000 responses of one request, served on
    rank 0 for a client of rank 1, arrive in order, then ENODATA."""
    inst = await start_instance(size=2, attrs=MODULES)
    async with asyncio.timeout(T):
        h1 = await connect(inst, 1)
        seqs = [a["seq"] async for a in h1.rpc_stream("req.nsrc", {"count": 10_000}, nodeid=0)]
        assert seqs == list(range(10_000))


async def test_many_responses_to_a_plain_request(req_plugin, start_instance) -> None:
    """Case 13 as Flux does it: a plain (non-streaming) request answered
    10,000 times; Flux's client reads every response, in order, with
    ``flux_recv``.  Sent raw from a client of rank 1 to the module on rank
    0 (through the link) and on rank 1 (locally); then a ping on the same
    connection must be answered (nothing is left stuck)."""
    inst = await start_instance(size=2, attrs=MODULES)
    c = await RawClient.connect(inst, 1)
    try:
        for tag, nodeid in ((1, 0), (2, 1)):
            c.request("req.nsrc", {"count": 10_000}, matchtag=tag, nodeid=nodeid)
            c.request("broker.ping", {}, matchtag=100 + tag, nodeid=nodeid)
            seqs = []
            while True:
                msg = await c.recv(T)
                assert msg.type == MsgType.RESPONSE, msg
                if msg.matchtag == 100 + tag:
                    break
                assert msg.matchtag == tag and msg.errnum == 0, msg
                seqs.append(msg.payload["seq"])
            assert seqs == list(range(10_000)), (nodeid, len(seqs), seqs[:3])
    finally:
        await c.close()


async def test_proxy_ping_hops(req_plugin, start_instance, connect) -> None:
    """Cases 15-18: ``req.xping`` on rank N pings rank X from the module;
    the route the ping saw is the module's hop, then the ranks crossed.
    Flux's hop counts: 0 from 1 is 4, 0 from 0 is 3, 1 from 1 is 3,
    upstream from 1 is 4 -- here one fewer each (Flux's route also has the
    client's own hop), and the same relations hold.  Upstream of rank 0
    is EHOSTUNREACH, answered."""
    inst = await start_instance(size=2, attrs=MODULES)
    async with asyncio.timeout(T):
        h = await connect(inst, 0)

        async def xping(via: int, target: int) -> list[str]:
            resp = await h.rpc("req.xping", {"rank": target, "service": "broker.ping"},
                               nodeid=via)
            return list(resp["route"])

        zero_from_1 = await xping(1, 0)
        zero_from_0 = await xping(0, 0)
        one_from_1 = await xping(1, 1)
        up_from_1 = await xping(1, NODEID_UPSTREAM)
        assert zero_from_1 == ["m:req"] + [f"r{r}" for r in tree_path(1, 0, 2)] \
            == ["m:req", "r1", "r0"], zero_from_1
        assert zero_from_0 == ["m:req", "r0"], zero_from_0
        assert one_from_1 == ["m:req", "r1"], one_from_1
        assert len(zero_from_1) == len(zero_from_0) + 1 == len(one_from_1) + 1, (
            zero_from_1, zero_from_0, one_from_1)
        assert up_from_1 == zero_from_1, (up_from_1, zero_from_1)
        with pytest.raises(RemoteError) as info:
            await xping(0, NODEID_UPSTREAM)
        assert info.value.errnum == errno.EHOSTUNREACH


async def test_noresponse_and_unreachable(req_plugin, start_instance) -> None:
    """NORESPONSE: a NORESPONSE echo (and err, which would answer an error)
    sends nothing back; the next message is the following request's
    answer.  Nor do the errors the broker itself would answer (ENOSYS of
    an unknown method or service, EHOSTUNREACH of rank 7, EPROTO of
    attr.get without a payload) come back for a NORESPONSE request.  A
    plain request to rank 7 of 2 is EHOSTUNREACH."""
    inst = await start_instance(size=2, attrs=MODULES)
    c = await RawClient.connect(inst, 1)
    try:
        for nodeid in (0, 1):
            c.request("req.echo", {"x": 1}, matchtag=0, nodeid=nodeid,
                      flags=int(MsgFlags.NORESPONSE))
            c.request("req.err", None, matchtag=0, nodeid=nodeid,
                      flags=int(MsgFlags.NORESPONSE))
            msg = await c.rpc("req.src", None, matchtag=5, nodeid=nodeid)
            assert msg.errnum == 0 and msg.payload == {"wormz": 42}, msg
        for topic, nodeid in (("req.nosuch", 0), ("nosuch.x", 0), ("nosuch.x", 1),
                              ("req.src", 7), ("attr.get", 0), ("attr.get", 1)):
            c.request(topic, None, matchtag=0, nodeid=nodeid, flags=int(MsgFlags.NORESPONSE))
            msg = await c.rpc("broker.ping", {}, matchtag=4, nodeid=0)
            assert msg.errnum == 0, (topic, nodeid, msg)
        msg = await c.rpc("req.src", None, matchtag=6, nodeid=7)
        assert msg.errnum == errno.EHOSTUNREACH, msg
    finally:
        await c.close()


async def test_rpc_command_on_attr(start_instance, connect) -> None:
    """Cases 21-25 with ``kvbroker rpc`` (Flux's t/request/rpc client) and
    the Handle: attr.list with no payload, attr.get of ``rank``, attr.get
    with no payload EPROTO (71), of ``noexist`` ENOENT (2) -- and 71 is not
    2 (case 25: the client tells an unexpected errno from the expected)."""
    inst = await start_instance(size=2)
    uri = inst.uri(1)
    rc, out, err = await run_cli("rpc", "attr.list", uri=uri)
    assert rc == 0 and out.strip(), (rc, out, err)
    rc, out, err = await run_cli("rpc", "attr.get", '{"name": "rank"}', uri=uri)
    assert rc == 0 and out.strip(), (rc, out, err)
    assert "1" in out, out
    rc, out, err = await run_cli("rpc", "attr.get", uri=uri)
    assert rc == 1 and "Protocol error" in err, (rc, out, err)
    rc, out, err = await run_cli("rpc", "attr.get", '{"name": "noexist"}', uri=uri)
    assert rc == 1 and "No such file or directory" in err, (rc, out, err)
    h = await connect(inst, 1)
    async with asyncio.timeout(T):
        with pytest.raises(RemoteError) as info:
            await h.rpc("attr.get", None)
        assert info.value.errnum == errno.EPROTO != errno.ENOENT
        with pytest.raises(RemoteError) as info:
            await h.rpc("attr.get", {"name": "noexist"})
        assert info.value.errnum == errno.ENOENT


SMALL_LINKS = {"broker.modules": "content,kvs,kvs-watch,req", "tbon.max-message": "65536",
               "broker.max-message": "200000"}


async def test_payload_size_limits(req_plugin, start_instance, connect) -> None:
    """Payload sizes (docs/protocol.md): with ``tbon.max-message`` 64 KiB
    a 100 KB request for rank 0 from a client of rank 1 is EMSGSIZE (served
    on rank 1 it is answered); a 100 KB answer from rank 0 becomes EMSGSIZE;
    a request over ``broker.max-message`` is EMSGSIZE from the client's
    own rank.  Each is answered (no RPC left waiting) and the connection
    goes on serving."""
    inst = await start_instance(size=2, attrs=SMALL_LINKS)
    async with asyncio.timeout(T):
        h = await connect(inst, 1)
        pad = b"x" * 100_000
        assert await h.rpc("req.echo", {"p": pad}, nodeid=1) == {"p": pad}
        for what, aw in (("tbon.max-message", h.rpc("req.echo", {"p": pad}, nodeid=0)),
                         ("tbon.max-message", h.rpc("req.big", {"sizes": [100_000]}, nodeid=0)),
                         ("broker.max-message", h.rpc("req.echo", {"p": pad * 3}, nodeid=1))):
            with pytest.raises(RemoteError) as info:
                await aw
            assert info.value.errnum == errno.EMSGSIZE, info.value
            assert f"exceeds {what}" in (info.value.errstr or ""), info.value.errstr
        assert await h.rpc("req.src", None, nodeid=0) == {"wormz": 42}
        assert h.pending == 0


async def test_a_stream_ended_by_an_oversized_answer_gets_nothing_more(
        req_plugin, start_instance) -> None:
    """A stream (client of rank 1, ``req.big`` on rank 0) whose second
    answer cannot cross the 64 KiB link: the client gets the first, then
    EMSGSIZE in place of the second -- an error answer, the end of the
    stream (Flux's RFC 6) -- and then nothing more for that matchtag: the
    next message is the answer to a later ping."""
    inst = await start_instance(size=2, attrs=SMALL_LINKS)
    c = await RawClient.connect(inst, 1)
    try:
        c.request("req.big", {"sizes": [10, 100_000, 10, 20]}, matchtag=7, nodeid=0,
                  flags=int(MsgFlags.STREAMING))
        first = await c.recv(T)
        assert (first.matchtag, first.errnum, first.payload["i"]) == (7, 0, 0), first
        end = await c.recv(T)
        assert (end.matchtag, end.errnum) == (7, errno.EMSGSIZE), end
        c.request("broker.ping", {}, matchtag=8, nodeid=0)
        after = await c.recv(T)
        assert after.matchtag == 8, (after.matchtag, after.errnum, after.payload)
    finally:
        await c.close()


async def test_a_watch_ended_by_an_oversized_answer_leaves_no_watcher(
        req_plugin, start_instance, connect) -> None:
    """A client of rank 1 watches, on rank 0, a 100 KB value: the answer
    cannot cross the 64 KiB link and is EMSGSIZE, the end of the stream.
    The watcher it ended must be gone from rank 0 (as a cancel or an error
    of kvs-watch's own would leave none) and answer nothing more."""
    inst = await start_instance(size=2, attrs=SMALL_LINKS)
    h0 = await connect(inst, 0)
    async with asyncio.timeout(T):
        await commit(h0, put("big", b"x" * 100_000))
    c = await RawClient.connect(inst, 1)
    try:
        c.request("kvs-watch.lookup", {"namespace": "primary", "key": "big", "flags": 4},
                  matchtag=7, nodeid=0, flags=int(MsgFlags.STREAMING))
        end = await c.recv(T)
        assert (end.matchtag, end.errnum) == (7, errno.EMSGSIZE), end

        async def no_watcher() -> bool:
            st = await h0.rpc("kvs-watch.stats-get", {}, nodeid=0)
            return bool(st["watchers"] == 0)

        await wait_until(no_watcher, "rank 0's watcher to end with its stream", 5)
    finally:
        await c.close()


async def test_kvbroker_s_watch_client_cancels_a_watch_its_link_cut_short(
        req_plugin, start_instance, connect) -> None:
    """What kvbroker's own client does about the defect above: a ``watch()``
    from rank 1 of a value too big for the link ends ``EMSGSIZE``, and it
    cancels the watch on rank 0, which then has no watcher; the handle does
    not issue that matchtag again while rank 0 may still answer on it, and
    serves on."""
    inst = await start_instance(size=2, attrs=SMALL_LINKS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    async with asyncio.timeout(T):
        await commit(h0, put("big", b"x" * 100_000))
        async with watch(h1, "big", nodeid=0) as w:
            with pytest.raises(RemoteError) as info:
                await anext(w)
            assert info.value.errnum == errno.EMSGSIZE
            tag = w._stream.matchtag  # noqa: SLF001 (which tag it used)

        async def no_watcher() -> bool:
            return bool((await h0.rpc("kvs-watch.stats-get", {}, nodeid=0))["watchers"] == 0)

        await wait_until(no_watcher, "rank 0's watcher to be cancelled", 5)
        await commit(h0, put("small", b"1"))
        async with watch(h1, "small", nodeid=0) as w2:
            assert (await anext(w2)).value == b"1"
            assert w2._stream.matchtag != tag  # noqa: SLF001


async def test_clogged_requests_flush_in_order_and_a_lost_rank_answers(
        req_plugin, start_instance, connect) -> None:
    """Flux's req module also holds requests unanswered (``req.clog``) until
    ``req.flush`` answers them all, then the flush (``treq clog``/``flush``,
    not run by t0002.t).  Here: three clogged requests to rank 1 are
    answered, in order, by the flush, before it; a request clogged on rank
    3 when rank 3 is killed is answered ``EHOSTUNREACH`` (not left
    waiting)."""
    inst = await start_instance(size=4, attrs=MODULES)
    h = await connect(inst, 0)
    async with asyncio.timeout(T):
        done: list[str] = []
        clogged = [h.rpc("req.clog", None, nodeid=1) for _ in range(3)]
        for i, f in enumerate(clogged):
            f.add_done_callback(lambda _f, i=i: done.append(f"clog{i}"))

        async def queued(rank: int, n: int) -> bool:
            return (await h.rpc("req.count", None, nodeid=rank))["count"] == n

        await wait_until(lambda: queued(1, 3), "3 requests clogged on rank 1", T)
        assert not any(f.done() for f in clogged)
        flush = h.rpc("req.flush", None, nodeid=1)
        flush.add_done_callback(lambda _f: done.append("flush"))
        assert await flush is None
        assert [await f for f in clogged] == [None] * 3
        assert done == ["clog0", "clog1", "clog2", "flush"], done
        lost = h.rpc("req.clog", None, nodeid=3)
        await wait_until(lambda: queued(3, 1), "a request clogged on rank 3", T)
        inst.procs[3].kill()
        with pytest.raises(RemoteError) as info:
            await lost
        assert info.value.errnum == errno.EHOSTUNREACH, info.value


async def test_an_error_answer_with_errnum_0_is_einval(req_plugin, start_instance) -> None:
    """A module answering ``respond_error(msg, 0)`` (``req.zero``) meant an
    error: as Flux's ``flux_respond_error``, the requester gets EINVAL, and a
    stream so answered is ended.  (It was sent as a success, and the stream
    went on.)"""
    inst = await start_instance(size=2, attrs=MODULES)
    c = await RawClient.connect(inst, 1)
    try:
        for tag, flags in ((1, 0), (2, int(MsgFlags.STREAMING))):
            for nodeid in (1, 0):
                c.request("req.zero", None, matchtag=tag, nodeid=nodeid, flags=flags)
                msg = await c.recv(T)
                assert msg.matchtag == tag, msg
                assert msg.errnum == errno.EINVAL, (flags, nodeid, msg.errnum, msg.payload)
    finally:
        await c.close()


async def test_treq_cases_with_the_rpc_command(req_plugin, start_instance) -> None:
    """Cases 5, 7-11 and 13 once more with ``kvbroker rpc`` from rank 1 (as
    ``treq`` is a command): null prints ``null``; echo prints its payload;
    err exits 1 with errno 42's message; a streaming nsrc prints each
    answer, in order, and exits 0 at ENODATA; a plain nsrc prints the
    first answer only (one RPC, one answer)."""
    inst = await start_instance(size=2, attrs=MODULES)
    uri = inst.uri(1)
    assert await run_cli("rpc", "req.null", uri=uri, timeout=T) == (0, "null\n", "")
    assert await run_cli("rpc", "req.null", "-r", "0", uri=uri, timeout=T) == (0, "null\n", "")
    assert await run_cli("rpc", "req.echo", '{"mumble": "burble"}', "--rank", "0",
                         uri=uri, timeout=T) == (0, '{"mumble": "burble"}\n', "")
    assert await run_cli("rpc", "req.err", "-r", "0", uri=uri, timeout=T) == (
        1, "", f"kvbroker: req.err: {os.strerror(42)}\n")
    assert await run_cli("rpc", "req.src", uri=uri, timeout=T) == (0, '{"wormz": 42}\n', "")
    assert await run_cli("rpc", "--stream", "req.nsrc", '{"count": 3}', "-r", "0",
                         uri=uri, timeout=T) == (0, "".join(f'{{"seq": {i}}}\n'
                                                            for i in range(3)), "")
    assert await run_cli("rpc", "req.nsrc", '{"count": 3}', "-r", "0", uri=uri,
                         timeout=T) == (0, '{"seq": 0}\n', "")


async def test_the_requests_noted_for_a_module_are_bounded(req_plugin, start_instance,
                                                           connect) -> None:
    """A client parking more requests than the broker notes (``MAX_HELD``)
    pins no more: the count stops there, the rank's log says so once, and
    the client's going forgets them all."""
    from broker.module import MAX_HELD

    inst = await start_instance(size=1, attrs=MODULES)
    h = await connect(inst, 0)

    other = await connect(inst, 0)
    parked = [other.rpc("req.clog", None) for _ in range(MAX_HELD + 5)]
    await wait_until(lambda: _is(held(h), MAX_HELD), "the noted requests to reach the bound", T)
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert out.count(f"module req keeps {MAX_HELD} requests unanswered") == 1, out[-2000:]
    await other.close()
    await asyncio.gather(*parked, return_exceptions=True)
    await wait_until(lambda: _is(held(h), 0), "the held requests forgotten", T)
