"""A W2p client: ``python -m benchmarks.workloads.kvs_client URI LOOP N PREFIX [ping]``.

Connects to URI on its own event loop (LOOP), prints ``ready``, waits for a
``go`` line on stdin, then makes N sequential commits of one put each
(``<PREFIX>.k<i>`` = ``str(i)``), or with ``ping`` N ``broker.ping`` RPCs
(W2p's reference: what the broker alone does for 8 clients), and prints one
JSON line
``{"start", "end", "n", "errors", "error", "user", "sys", "ctxsw"}``
(``time.perf_counter`` stamps, comparable across processes on Linux:
CLOCK_MONOTONIC; CPU seconds and context switches spent between them).
It exits when its stdin closes (the runner is gone, or gave up on it:
:mod:`benchmarks.workloads.lifeline`), and quietly on SIGINT.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from typing import Any

from benchmarks.workloads import kvsops
from benchmarks.workloads.lifeline import Lifeline
from broker.errors import RemoteError
from broker.handle import Handle
from broker.loops import loop_factory


async def main(uri: str, n: int, prefix: str, lifeline: Lifeline,
               ping: bool = False) -> dict[str, Any]:
    h = await Handle.connect(uri)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    line = await loop.run_in_executor(None, lifeline.readline)
    if line.strip() != "go":
        await h.close()
        return {"start": 0.0, "end": 0.0, "n": 0, "errors": 0, "error": "not started"}
    errors, first_error = 0, ""
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for i in range(n):
        try:
            if ping:
                await h.rpc("broker.ping", {"seq": i})
            else:
                await kvsops.commit(h, [kvsops.put_op(f"{prefix}.k{i}", str(i).encode())])
        except RemoteError as exc:
            errors += 1
            first_error = first_error or f"{exc.errname}: {exc.errstr}"
    t1 = time.perf_counter()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    await h.close()
    return {"start": t0, "end": t1, "n": n, "errors": errors, "error": first_error,
            "user": r1.ru_utime - r0.ru_utime, "sys": r1.ru_stime - r0.ru_stime,
            "ctxsw": (r1.ru_nvcsw + r1.ru_nivcsw) - (r0.ru_nvcsw + r0.ru_nivcsw)}


if __name__ == "__main__":
    uri, loop_kind, count, key_prefix = sys.argv[1:5]
    mode = sys.argv[5] if len(sys.argv) > 5 else "commit"
    runner_lifeline = Lifeline()
    with asyncio.Runner(loop_factory=loop_factory(loop_kind)) as runner:
        result = runner.run(main(uri, int(count), key_prefix, runner_lifeline,
                                 ping=mode == "ping"))
    print(json.dumps(result), flush=True)
