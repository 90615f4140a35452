"""flux-core t/t3400-overlay-trace.t (``flux overlay trace``) against real
kvbroker ranks: a 4-rank instance, as Flux's, at fanout 2 (rank 3 is below
rank 1), with the ``heartbeat`` module at a 0.2 s period.

Flux's cases, in order, and what each becomes:

1.  'fails with extra positional argument' (``trace x y``),
2.  'fails with unknown argument' (``--not-an-arg``),
3.  'fails with wrong message type' (``-t foo,bar``) -> already
    tests/test_overlay_trace.py::test_the_cli_refuses_what_flux_s_refuses
    (the same three command lines, and ``--delta`` without ``--human``).
    Flux exits 1 there; kvbroker exits 2 with the usage line, its rule for
    every usage error (docs/cli.md, Conventions): documented, not a defect.
4.  'reload heartbeat with increased heart rate' (``flux module reload
    heartbeat period=0.2s``) -> the same, ``kvbroker module reload
    heartbeat period=0.2s`` on rank 0 (docs/cli.md "module"), the module
    loaded at start at its default 2 s; ``stats heartbeat`` says 2, then
    0.2 (:func:`test_trace_and_full_trace_see_pulse_ping_and_failed_request`).
    The other tests here load it at start with that period (``-S
    heartbeat.period=0.2s``).
5.  'start background trace' and
6.  'start second background trace with --full' -> two ``kvbroker overlay
    trace`` processes on rank 0, one with ``--full``
    (:func:`test_trace_and_full_trace_see_pulse_ping_and_failed_request`).
7.  'heartbeat.pulse event was captured' and
8.  '... with --full' -> each prints ``tx N e heartbeat.pulse`` (rank 0
    sends the pulse to its children); the pulse has no payload, so
    ``--full`` adds no line under it.
9.  'send one kvs.ping to rank 1' (``flux ping -r 1 -c 1 kvs``) ->
    kvbroker's modules have no ``<name>.ping`` and ``ping`` sends
    ``broker.ping`` only (docs/cli.md "ping": "Flux's other targets ...
    have no counterpart"): ``kvbroker ping 1``.
10. 'kvs.ping request/response was captured' and
11. '... with --full' -> two lines each, ``tx 1 > broker.ping`` and ``rx 1
    < broker.ping ... success``; with ``--full`` each followed by its
    payload as JSON (the answer names rank 1).
12. 'send one job-manager.kill (failing)' (``flux exec -r 1 flux job kill
    fuzzybunny``: a request from rank 1 to rank 0 that fails with a
    human-readable error) -> kvbroker has no job manager; the same shape is
    ``kvbroker exec -r 1 -- kvbroker attr get -r 0 nosuch``, exit 1.
13. 'job-manager.kill request/response was captured' and
14. '... with --full' -> ``rx 1 > attr.get`` then ``tx 1 < attr.get [..]
    ENOENT``; with ``--full`` the failed answer's text, ``unknown attribute
    'nosuch'``, on the line below (Flux prints the errstr there too).
15. 'stop background trace' and
16. 'stop second background trace' (SIGTERM) -> both end on SIGTERM, at
    once, with no traceback.

Beyond Flux's cases:

* ``-r/--rank`` from the command line keeps the messages to or from that
  neighbour only (tests/test_overlay_trace.py checks the request field);
* a trace attached to a rank that goes away (``kvbroker shutdown -r 1``)
  ends with an error and exit 1 instead of waiting for ever;
* ``-t control`` on a router whose child is shut down shows the goodbye
  it receives and the one it answers, with Flux's ``c`` mark;
* ``-t`` given twice (``-t request -t response``): Flux's ``-t`` is an
  auto-split option whose every occurrence adds to the type mask; so is
  kvbroker's (until 2026-12-05 argparse kept the last one only, and the
  requests were silently dropped: found by this file);
* a failed answer whose errno has no name (999, from a test module):
  ``errno 999``, as Flux prints it (it was a bare ``999`` after the size
  until 2026-12-05: found by this file).

Deliberate differences (documented, not defects): the size in brackets is
the whole message's here (docs/cli.md: "the message's size"), Flux's is the
payload's; usage errors exit 2, not 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import KVBROKER, run_cli, stats, use_module_plugin, wait_until

T = 30.0
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
HEARTBEAT = {"broker.modules": "content,kvs,kvs-watch,heartbeat", "heartbeat.period": "0.2s"}


class Trace:
    """A ``kvbroker overlay trace`` process; its stdout lines collected as
    they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []
        self._more = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, uri: str, *args: str) -> Trace:
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "overlay", "trace", *args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env={**os.environ, "KVBROKER_URI": uri})
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode().rstrip("\n"))
            self._more.set()
        self._more.set()

    async def wait_for(self, pattern: str, count: int = 1) -> list[int]:
        """The indexes of the first ``count`` lines matching ``pattern``
        (re.search), once there are that many (Flux's ``waitfile -c``)."""
        rx = re.compile(pattern)
        try:
            async with asyncio.timeout(T):
                while True:
                    hits = [i for i, line in enumerate(self.lines) if rx.search(line)]
                    if len(hits) >= count:
                        return hits[:count]
                    if self._reader.done():
                        raise AssertionError(f"trace ended: {self.lines}")
                    self._more.clear()
                    await self._more.wait()
        except TimeoutError:
            raise AssertionError(f"no {count} lines matching {pattern!r}: "
                                 f"{self.lines[-40:]}") from None

    async def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        return await self.ended()

    async def ended(self) -> tuple[int, str]:
        assert self.proc.stderr is not None
        async with asyncio.timeout(T):
            err = await self.proc.stderr.read()
            rc = await self.proc.wait()
            await self._reader
        return rc, err.decode()

    async def started(self, action: Any) -> None:
        """Run ``action`` (a coroutine function) until a line shows: the
        trace is registered once the rank has its request, and what passes
        before is not traced."""
        async with asyncio.timeout(T):
            while not self.lines:
                await action()
                self._more.clear()
                if not self.lines:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._more.wait(), 0.5)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


@pytest.fixture
async def traces() -> Any:
    started: list[Trace] = []

    async def start(uri: str, *args: str) -> Trace:
        started.append(await Trace.start(uri, *args))
        return started[-1]

    yield start
    for t in started:
        t.kill()
        await t.proc.wait()


async def test_trace_and_full_trace_see_pulse_ping_and_failed_request(
        start_instance, traces) -> None:
    """Flux's cases 4-16, in order."""
    inst = await start_instance(size=4, fanout=2,
                                attrs={"broker.modules": HEARTBEAT["broker.modules"]})
    uri = inst.uri(0)
    # 4: reload heartbeat with increased heart rate (rank 0's: it sends the
    # pulses), from the default 2 s
    rc, out, err = await run_cli("stats", "heartbeat", "-p", "period", uri=uri)
    assert (rc, err, float(out)) == (0, "", 2), (rc, out, err)
    rc, out, err = await run_cli("module", "reload", "heartbeat", "period=0.2s", uri=uri)
    assert (rc, out, err) == (0, "", ""), (rc, out, err)
    rc, out, err = await run_cli("stats", "heartbeat", "-p", "period", uri=uri)
    assert (rc, err, float(out)) == (0, "", 0.2), (rc, out, err)
    plain = await traces(uri)
    full = await traces(uri, "--full")
    # 7, 8: rank 0 sends the pulse down to its children
    for t in (plain, full):
        (i,) = await t.wait_for(r" tx [12] e heartbeat\.pulse ")
        assert re.fullmatch(STAMP + r" tx [12] e heartbeat\.pulse \[\d+B\]", t.lines[i])
    # (no payload: nothing under the pulse with --full either)
    i = (await full.wait_for(r"heartbeat\.pulse"))[0]
    await full.wait_for(STAMP, i + 2)  # (a line after it, to look at)
    assert re.match(STAMP, full.lines[i + 1]), full.lines[i:i + 2]

    # 9-11: one ping of rank 1
    rc, out, err = await run_cli("ping", "-c", "1", "1", uri=uri)
    assert rc == 0 and out.startswith("rank=1 "), err
    for t in (plain, full):
        req, resp = await t.wait_for(r"broker\.ping", 2)
        assert re.fullmatch(STAMP + r" tx 1 > broker\.ping \[\d+B\]", t.lines[req]), t.lines
        assert re.fullmatch(STAMP + r" rx 1 < broker\.ping \[\d+B\] success",
                            t.lines[resp]), t.lines
    req, resp = await full.wait_for(r"broker\.ping", 2)
    assert full.lines[req + 1] == "{"  # its payload, as JSON
    answer = full.lines[resp + 1:]
    assert '  "rank": 1,' in answer[:answer.index("}") + 1], answer

    # 12-14: a request from rank 1 that rank 0 refuses, with a text
    rc, out, err = await run_cli("exec", "-r", "1", "--", KVBROKER, "attr", "get",
                                 "-r", "0", "nosuch", uri=uri)
    assert (rc, out) == (1, ""), err
    assert "unknown attribute 'nosuch'" in err
    for t in (plain, full):
        (req,) = await t.wait_for(r" rx 1 > attr\.get ")
        (resp,) = await t.wait_for(r" tx 1 < attr\.get \[\d+B\] ENOENT$")
        assert req < resp, t.lines
    assert plain.lines[resp + 1:resp + 2] != ["unknown attribute 'nosuch'"]
    (resp,) = await full.wait_for(r" tx 1 < attr\.get \[\d+B\] ENOENT$")
    await full.wait_for(r".", resp + 2)
    assert full.lines[resp + 1] == "unknown attribute 'nosuch'", full.lines[resp:]

    # 15, 16: SIGTERM ends each at once, quietly
    for t in (plain, full):
        rc, err = await t.stop()
        assert rc == -signal.SIGTERM and "Traceback" not in err, (rc, err)


async def test_rank_option_keeps_one_neighbours_messages(start_instance, traces) -> None:
    """``-r 2`` on rank 0 (children 1 and 2): a ping of rank 1 is not shown,
    one of rank 2 is."""
    inst = await start_instance(size=4, fanout=2)
    uri = inst.uri(0)
    t = await traces(uri, "-r", "2", "broker.ping")
    seen = await traces(uri, "broker.ping")  # (to know when the ping of 1 passed)

    async def ping(rank: str) -> None:
        rc, _, err = await run_cli("ping", rank, uri=uri)
        assert rc == 0, err

    await t.started(lambda: ping("2"))
    await seen.started(lambda: ping("2"))
    n = len(t.lines)
    await ping("1")
    await seen.wait_for(r" rx 1 < broker\.ping ")
    await ping("2")
    await t.wait_for(r"broker\.ping", n + 2)
    assert all(" 2 " in line.split("broker.ping")[0] for line in t.lines), t.lines
    assert not [line for line in t.lines if re.search(r" [tr]x 1 ", line)], t.lines


async def test_a_trace_of_a_rank_that_goes_away_ends_with_an_error(
        start_instance, connect, traces) -> None:
    """Attached to rank 1, which ``kvbroker shutdown -r 1`` stops: the trace
    ends, exit 1, saying why, instead of waiting for a rank that is gone."""
    inst = await start_instance(size=2, attrs=HEARTBEAT)
    t = await traces(inst.uri(1))
    await t.wait_for(r" rx 0 e heartbeat\.pulse ")
    rc, out, err = await run_cli("shutdown", "-r", "1", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", "")
    assert await asyncio.wait_for(inst.procs[1].wait(), T) == 0
    assert await t.ended() == (1, "kvbroker: overlay trace: Connection reset by peer "
                                  "(connection to broker lost)\n")


async def test_type_given_twice_traces_both_types(start_instance, traces) -> None:
    inst = await start_instance(size=2, fanout=2)
    uri = inst.uri(0)
    t = await traces(uri, "-t", "request", "-t", "response", "broker.ping")

    async def ping() -> None:
        rc, _, err = await run_cli("ping", "1", uri=uri)
        assert rc == 0, err

    await t.started(ping)
    # A ping in flight as the trace began may show its answer alone (a
    # fresh-clone CI run under load): the next one is traced whole, its
    # request between the two answers.
    await ping()
    first, second = await t.wait_for(r" rx 1 < broker\.ping ", 2)
    assert re.search(r" tx 1 > broker\.ping ", "\n".join(t.lines[first + 1:second])), t.lines


async def test_control_messages_of_a_child_leaving_are_traced(start_instance, connect,
                                                              traces) -> None:
    """``-t control`` on rank 1 while its child, rank 3, is shut down: the
    goodbye it receives (``rx 3 c``) and the one it answers (``tx 3 c``),
    Flux's mark for a control message; nothing but control messages."""
    inst = await start_instance(size=4, fanout=2)
    t = await traces(inst.uri(1), "-t", "control")
    h1 = await connect(inst, 1)

    async def registered() -> bool:
        return bool((await stats(h1))["overlay"]["traces"] == 1)

    await wait_until(registered, "rank 1 to serve the trace", T)
    rc, out, err = await run_cli("shutdown", "-r", "3", uri=inst.uri(0))
    assert (rc, out, err) == (0, "", "")
    assert await asyncio.wait_for(inst.procs[3].wait(), T) == 0
    rx, tx = await t.wait_for(r" [rt]x 3 c overlay\.goodbye ", 2)
    assert re.fullmatch(STAMP + r" rx 3 c overlay\.goodbye \[\d+B\]", t.lines[rx]), t.lines
    assert re.fullmatch(STAMP + r" tx 3 c overlay\.goodbye \[\d+B\]", t.lines[tx]), t.lines
    assert all(re.fullmatch(STAMP + r" [rt]x \d+ c \S+ \[\d+B\]", line)
               for line in t.lines), t.lines


ODD = '''
from typing import ClassVar

from broker.module import Module, require


class OddModule(Module):
    """Answers ``odd.fail`` with the errno its payload names."""
    name: ClassVar[str] = "odd"

    def handlers(self):
        return {"odd.fail": self.fail}

    def fail(self, msg):
        self.h.respond_error(msg, require(msg.payload, errnum=int)["errnum"], "odd failure")
'''


async def test_an_errno_without_a_name_is_printed_as_flux_does(
        start_instance, traces, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Flux's trace prints a failed answer's errno by name, else ``errno N``."""
    use_module_plugin(tmp_path, monkeypatch, "odd", "OddModule", ODD)
    inst = await start_instance(size=2, attrs={"broker.modules": "content,kvs,odd"})
    uri = inst.uri(0)
    t = await traces(uri, "-t", "response")

    async def fail(errnum: int) -> None:
        rc, _, err = await run_cli("rpc", "-r", "1", "odd.fail", f'{{"errnum": {errnum}}}',
                                   uri=uri)
        assert rc == 1 and "odd failure" in err, err

    await t.started(lambda: fail(2))
    assert re.fullmatch(STAMP + r" rx 1 < odd\.fail \[\d+B\] ENOENT", t.lines[0]), t.lines
    await fail(999)
    (i,) = await t.wait_for(r"999")
    assert re.fullmatch(STAMP + r" rx 1 < odd\.fail \[\d+B\] errno 999", t.lines[i]), t.lines
