"""SIGINT at every position of the blocking facade's code, one at a time.

    python sigint_positions.py URI EVENT_LOOP calls|lifecycle|paths

A trace function raises SIGINT just before one chosen instruction of one
of the facade's functions runs (``signal.raise_signal`` in the tracer:
Python runs the handler there, before that instruction); the script then
makes the call that reaches it and records what came out.  Every position
is tried in turn, so no moment is left to chance.  The positions:

* ``calls`` -- the start of every line of ``_enter``, ``rpc``, ``_wait``,
  ``run`` and ``rpc_stream`` (where a tracer, e.g. a debugger, runs
  handlers) and every point where CPython 3.11 runs one without a tracer
  (after a call returns, at a function's start, at a loop's back-edge),
  on a plain and on a reconnecting handle;
* ``lifecycle`` -- those CPython points in ``connect()`` (``__init__``),
  ``close()`` and the SIGINT bookkeeping they share;
* ``paths`` -- those CPython points in any Python code that a call passes
  (the facade's, the kvs client's, asyncio's, the standard library's), for
  an RPC, a ``SyncKVS.put``, and two waits that only a Ctrl-C or their
  timeout end (``recv_event``, a watch's ``next``).

It prints one JSON object: ``{"FUNCTION@OFFSET": outcome}``, the outcome
being ``interrupted`` (a KeyboardInterrupt came out of the call), else
``answered`` or the exception's type; for ``paths`` followed by ``then
next call interrupted`` when the next call raised it; for ``lifecycle`` followed by what
was left afterwards (``handler left``: the facade's SIGINT handler still
installed with no handle open; ``users N``; ``unraisable hook left``; ``N
open``: handles nobody can close).  Used by tests/test_sync_interrupts.py.
"""

from __future__ import annotations

import dis
import gc
import json
import signal
import sys
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from broker import sync
from broker.sync import SyncHandle
from kvs_watch.flags import WAITCREATE, WATCH

WAIT = 0.1
"""The waits' timeout in ``paths``: a position reached only on the way
out of a wait that timed out costs the whole wait, and some hundred are."""

CHECK_POINTS = {"CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD", "RESUME"}
"""Instructions after which CPython 3.11 looks for pending signals."""


def positions(code: CodeType, lines: bool) -> list[int]:
    """Offsets of the instructions before which a handler may run."""
    ins = list(dis.get_instructions(code))
    found = {b.offset for a, b in zip(ins, ins[1:], strict=False) if a.opname in CHECK_POINTS}
    if lines:
        found |= {i.offset for i in ins if i.starts_line is not None and i.opname != "RESUME"}
    return sorted(found)


def interrupt_at(code: CodeType, offset: int, call: Callable[[], object]) -> str:
    """Run ``call()`` with a SIGINT raised before instruction ``offset`` of
    ``code``: its outcome."""
    armed = [True]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode" and frame.f_lasti == offset and armed[0]:
            armed[0] = False
            signal.raise_signal(signal.SIGINT)  # (its handler runs here, in the tracer)
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        call()
        outcome = "answered"
    except KeyboardInterrupt:
        outcome = "interrupted"
    except BaseException as exc:  # noqa: BLE001 (reported: the test fails on it)
        outcome = type(exc).__name__
    finally:
        sys.settrace(None)
        reached = not armed[0]
        # (a suspended frame keeps its tracer: disarmed, it cannot fire
        # when it runs again under a later run's tracing)
        armed[0] = False
    return outcome if reached else "not reached"


def calls(uri: str, loop: str) -> dict[str, str]:
    plain = sync.connect(uri, event_loop=loop)
    # (a reconnecting handle's _enter waits once more: those positions too)
    reconnecting = sync.connect(uri, event_loop=loop, reconnect=True)

    def rpc(h: SyncHandle) -> None:
        h.rpc("broker.ping", {"n": 1}, timeout=10)

    def run(h: SyncHandle) -> None:
        h.ping(payload={"n": 1}, timeout=10)

    def stream(h: SyncHandle) -> None:
        h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": "never.there",
                                          "flags": WATCH | WAITCREATE}).close()

    cases: list[tuple[Callable[..., Any], Callable[[SyncHandle], None]]] = [
        (SyncHandle._enter, rpc), (SyncHandle.rpc, rpc), (SyncHandle._wait, rpc),
        (SyncHandle.run, run), (SyncHandle.rpc_stream, stream)]
    outcomes = {}
    for h, kind in ((plain, ""), (reconnecting, "reconnecting ")):
        for function, call in cases:
            code = function.__code__
            for offset in positions(code, lines=True):
                outcome = interrupt_at(code, offset, lambda: call(h))  # noqa: B023
                if outcome != "not reached":
                    outcomes[f"{kind}{function.__name__}@{offset}"] = outcome
                if h.rpc("broker.ping", {"n": -1}, timeout=10)["n"] != -1:
                    outcomes[f"{kind}{function.__name__}@{offset} after"] = "wrong answer"
    plain.close()
    reconnecting.close()
    return outcomes


def lifecycle(uri: str, loop: str) -> dict[str, str]:
    made: list[SyncHandle] = []

    def connect_and_close() -> None:
        made.append(sync.connect(uri, event_loop=loop))
        made[-1].close()

    functions: list[Callable[..., Any]] = [
        SyncHandle.__init__, SyncHandle.close, SyncHandle._let_go,
        sync._claim_sigint, sync._release_sigint, sync._hook_unraisable,
        sync._unhook_unraisable, sync._HoldCtrlC.__enter__, sync._HoldCtrlC.__exit__]
    outcomes = {}
    for function in functions:
        code = function.__code__
        for offset in positions(code, lines=False):
            made.clear()
            outcome = interrupt_at(code, offset, connect_and_close)
            for h in made:
                if not h.closed:  # (connected, then interrupted before close)
                    h.close()
            gc.collect()
            left = []
            if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
                left.append("handler left")
            if sync._sigint_users:
                left.append(f"users {sync._sigint_users}")
            if sys.unraisablehook is not sys.__unraisablehook__:
                left.append("unraisable hook left")
            unreachable = [h for h in list(sync._handles) if not h.closed]
            if unreachable:
                left.append(f"{len(unreachable)} open")
            if outcome != "not reached":
                where = f"{function.__qualname__}@{offset}"
                outcomes[where] = " ".join([outcome, *left])
            # (start the next position clean, whatever this one left)
            for h in unreachable:
                h.close()
            sync._sigint_users = 0
            signal.signal(signal.SIGINT, signal.default_int_handler)
            sys.unraisablehook = sys.__unraisablehook__
    return outcomes


def executed(call: Callable[[], object]) -> list[tuple[CodeType, int]]:
    """Every point where CPython may run a handler that ``call()`` passes,
    in any Python code on its way (the facade's, the kvs client's, asyncio's,
    the stdlib's), in the order first reached."""
    seen: dict[tuple[CodeType, int], None] = {}
    cache: dict[CodeType, set[int]] = {}

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            code = frame.f_code
            points = cache.get(code)
            if points is None:
                points = cache[code] = set(positions(code, lines=False))
            if frame.f_lasti in points:
                seen.setdefault((code, frame.f_lasti), None)
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        call()
    except TimeoutError:  # (the waits end so here)
        pass
    finally:
        sys.settrace(None)
    return list(seen)


def paths(uri: str, loop: str) -> dict[str, str]:
    """``path``: a SIGINT at every point a call's path passes, anywhere."""
    from kvs.client import SyncKVS

    h = sync.connect(uri, event_loop=loop)
    kvs = SyncKVS(h)
    h.subscribe("sigint-paths.nothing")
    watch = kvs.watch("sigint-paths.never", waitcreate=True, timeout=WAIT)
    watch.__enter__()
    calls: dict[str, Callable[[], object]] = {
        "rpc": lambda: h.rpc("broker.ping", {"n": 1}, timeout=10),
        "put": lambda: kvs.put("sigint-paths.k", 1),
        "recv_event": lambda: h.recv_event(timeout=WAIT),  # (only a Ctrl-C ends these
        "watch": lambda: next(watch),                     # before their timeouts)
    }
    outcomes = {}
    for name, call in calls.items():
        for code, offset in executed(call):
            outcome = interrupt_at(code, offset, call)
            if outcome == "not reached":
                continue
            after = ""
            for _ in range(3):  # (a Ctrl-C that came as the call ended: a next call's)
                try:
                    if h.rpc("broker.ping", {"n": 2}, timeout=10)["n"] != 2:
                        after += " then wrong answer"
                    break
                except KeyboardInterrupt:
                    after += " then next call interrupted"
            if sync._dropped:
                after += " then dropped pending"
                sync._dropped = False
            where = f"{name} {code.co_qualname} {code.co_filename.rsplit('/', 1)[-1]}@{offset}"
            outcomes[where] = outcome + after
    watch.cancel()
    h.close()
    return outcomes


if __name__ == "__main__":
    uri, event_loop, mode = sys.argv[1:4]
    modes = {"calls": calls, "lifecycle": lifecycle, "paths": paths}
    print(json.dumps(modes[mode](uri, event_loop)), flush=True)
