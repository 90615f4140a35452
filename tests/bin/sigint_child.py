"""A script that makes blocking calls while it is sent SIGINT (Ctrl-C).

    python sigint_child.py URI EVENT_LOOP N [STACKS_FILE]

It makes calls of every kind through one SyncHandle -- bursts of RPCs,
SyncKVS puts and gets, ``run()`` of a coroutine, and waits that only an
interrupt ends (``recv_event``, a SyncWatch's and a SyncStream's next
answer) -- catches each KeyboardInterrupt and goes on.  After catching the
k-th it prints ``int k`` (from inside the ``try``, so that an interrupt
sent on seeing that line cannot land outside one: Python runs a signal
handler at the next of many points, a loop's back-edge among them).  After N it
checks that every kind of call still works and prints one JSON line:
what it counted, and the errors calls raised.  With STACKS_FILE, SIGUSR1
writes every thread's stack there (``faulthandler``): the test asks for it
when an interrupt goes unanswered, to show where the script was.  Used by
tests/test_sync_interrupts.py.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import sys
from typing import Any

from broker import sync
from broker.message import Message
from kvs.client import SyncKVS
from kvs_watch.flags import WAITCREATE, WATCH


def main() -> None:
    uri, loop, wanted = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if len(sys.argv) > 4:
        stacks = open(sys.argv[4], "w")  # noqa: SIM115 (open until the process ends)
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    key = f"sigint.{os.getpid()}"  # (keys of its own: several may share an instance)
    h = sync.connect(uri, event_loop=loop)
    kvs = SyncKVS(h)
    h.subscribe("sigint.")
    watch = kvs.watch(f"{key}.w", waitcreate=True)
    watch.__enter__()
    stream = h.rpc_stream("kvs-watch.lookup", {"namespace": "primary", "key": f"{key}.s",
                                               "flags": WATCH | WAITCREATE})
    counts = {"interrupts": 0, "rpcs": 0, "waits": 0, "puts": 0}
    errors: list[str] = []
    n = 0
    acked = -1  # interrupts reported ("int k"); -1 until "ready" is written
    rng = random.Random()

    def ping() -> None:
        nonlocal n
        n += 1
        answer = h.rpc("broker.ping", {"n": n}, timeout=10)
        if answer["n"] != n:  # an answer that was another request's
            raise AssertionError(f"ping {n} answered {answer['n']}")
        counts["rpcs"] += 1

    def step(rng: random.Random) -> None:
        op = rng.random()
        if op < 0.5:
            for _ in range(rng.randrange(1, 40)):
                ping()
        elif op < 0.65:
            kvs.put(f"{key}.k", n)
            if kvs.get_json(f"{key}.k") != n:
                raise AssertionError("put then get")
            counts["puts"] += 1
        elif op < 0.75:
            h.run(_pause(rng.random() * 0.005))
        else:  # a wait that only the interrupt ends (nothing is sent there)
            counts["waits"] += 1
            which = rng.randrange(3)
            if which == 0:
                ev: Message = h.recv_event()
                raise AssertionError(f"an event came: {ev.topic}")
            if which == 1:
                raise AssertionError(f"the watch answered: {next(watch)}")
            raise AssertionError(f"the stream answered: {next(stream)}")

    def steps() -> None:
        nonlocal acked
        if acked < 0:  # "ready" is written here too, not before: the first
            acked = 0  # SIGINT may land before the write's call returns
            sys.stdout.write("ready\n")
            sys.stdout.flush()
        while True:  # (a KeyboardInterrupt anywhere here, even at this loop's
            if acked < counts["interrupts"]:  # back-edge, goes to the try below)
                acked = counts["interrupts"]
                sys.stdout.write(f"int {acked}\n")  # (one write)
                sys.stdout.flush()
            if acked >= wanted:
                return
            try:
                step(rng)
            except Exception as exc:  # noqa: BLE001 (reported: the test fails on any)
                # and the first ends the steps: a script whose broker is
                # gone (its test killed) must not go on failing for ever
                errors.append(f"{type(exc).__name__}: {exc}")
                return

    while True:
        try:
            steps()
            break
        except KeyboardInterrupt:  # (only this count is outside a try: the
            counts["interrupts"] += 1  # next SIGINT comes after the next "int")

    # Every kind of call works after the interrupts.
    after: dict[str, Any] = {}
    try:
        for _ in range(200):
            ping()
        after["pings"] = True
        seq = h.publish("sigint.e", {"x": 1})
        ev = h.recv_event(timeout=10)
        after["event"] = ev.topic == "sigint.e" and ev.seq == seq
        kvs.put(f"{key}.w", "w")
        after["watch"] = next(watch).text()
        kvs.put(f"{key}.s", "s")
        after["stream"] = next(stream)["val"]["data"].decode()
        after["run"] = h.run(_pause(0.001))
        after["pending"] = h.aio.pending  # the watch's and the stream's requests
        watch.cancel()
        stream.close()
        h.close()
        after["handler_restored"] = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    except Exception as exc:  # noqa: BLE001
        after["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"counts": counts, "errors": errors, "after": after}), flush=True)


async def _pause(seconds: float) -> str:
    import asyncio

    await asyncio.sleep(seconds)
    return "ran"


if __name__ == "__main__":
    main()
