"""Entry point of one rank process (started by :mod:`broker.launch`).

``python -m broker.rank --rank R --size N --fanout K --rundir DIR [...]``

The rank prints ``ready <uri>`` on stdout once its whole subtree is up
(for rank 0: the whole instance), then serves until SIGTERM/SIGINT, or until
the ``--watch-fd`` pipe from its launcher closes (the launcher died), so no
rank outlives the instance.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys

from broker import gcpolicy, malloc
from broker.broker import Broker
from broker.loops import loop_factory


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m broker.rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--fanout", type=int, default=32)
    p.add_argument("--rundir", required=True)
    p.add_argument("--statedir")
    p.add_argument("--event-loop", default="auto")
    p.add_argument("--attrs", default="{}", help="JSON map of attributes")
    p.add_argument("--endpoints", default="{}", help="JSON map rank -> overlay endpoint")
    p.add_argument("--curve-keys", help="file holding the instance's CURVE key pair")
    p.add_argument("--watch-fd", type=int, help="exit when this pipe closes")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    curve = None
    if args.curve_keys:
        from broker.curve import load_keys

        curve = load_keys(args.curve_keys)
    b = Broker(
        args.rank, args.size, args.fanout, args.rundir,
        statedir=args.statedir,
        attrs=json.loads(args.attrs),
        endpoints={int(k): v for k, v in json.loads(args.endpoints).items()},
        curve=curve,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, b.request_stop)
    if args.watch_fd is not None:
        def on_launcher_gone() -> None:
            loop.remove_reader(args.watch_fd)
            b.request_stop()
        loop.add_reader(args.watch_fd, on_launcher_gone)
    # A stop (signal, launcher gone) must also end a start-up that waits for
    # a tree that may never come up, or the rank would outlive its instance.
    running = loop.create_task(b.run())
    try:
        starting = loop.create_task(b.start())
        await asyncio.wait({starting, running}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            return 1
        try:
            starting.result()
        except (LookupError, ImportError, OSError, ValueError) as exc:
            logging.getLogger("kvbroker").error("start-up failed: %s", exc)
            return 1
        print(f"ready {b.uri}", flush=True)
        await running
    finally:
        running.cancel()
        await b.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = json.loads(args.attrs).get("log.level", "WARNING")
    logging.basicConfig(level=str(level).upper(), stream=sys.stderr,
                        format=f"kvbroker[{args.rank}]: %(levelname)s %(name)s: %(message)s")
    os.environ.pop("KVBROKER_URI", None)
    malloc.tune()
    gcpolicy.tune()
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        return runner.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
