"""W1's blocking-facade client: ``python -m benchmarks.workloads.sync_client URI LOOP N``.

A script's view of an RPC: :mod:`broker.sync` in the main thread of its
own process (where ``asyncio.Runner`` would install a SIGINT handler
around every call).  Connects, prints ``ready``, makes ``WARMUP`` then N
sequential ``broker.ping`` RPCs to its rank and prints one JSON line
``{"elapsed": seconds}``.  Exits when its stdin closes (the runner is gone:
:mod:`benchmarks.workloads.lifeline`).
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.workloads.lifeline import Lifeline
from broker import sync

WARMUP = 200


def main(uri: str, loop: str, n: int) -> float:
    with sync.connect(uri, event_loop=loop) as h:
        print("ready", flush=True)
        for _ in range(WARMUP):
            h.rpc("broker.ping", {})
        t0 = time.perf_counter()
        for _ in range(n):
            h.rpc("broker.ping", {})
        return time.perf_counter() - t0


if __name__ == "__main__":
    uri, loop_kind, count = sys.argv[1:4]
    Lifeline()
    print(json.dumps({"elapsed": main(uri, loop_kind, int(count))}), flush=True)
