"""flux-core t/t1012-kvs-checkpoint.t: the instance killed while clients
append, then started again on its statedir, reads all the data.

Flux SIGKILLs ``flux start`` under 16 threads of appends and checks that
every key is readable after ``flux start --recovery``.  Here ``kvbroker
start`` is SIGKILLed under 4 writers of appends, with periodic checkpoints
off: its ranks stop cleanly as their launcher is gone (docs/cli.md,
Stopping), so the restart on the same statedir has every append that was
acknowledged -- more than Flux's test asks -- and each key is whole
transactions (5 lines at a time), never a part of one.  Crashes of rank 0
itself are in tests/test_kvs_rpc_durability.py.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap

from test_broker_support import wait_until
from test_cli_broker import all_gone, rank_pids, start_process

WRITERS = 4
WRITER = """
import asyncio, os, sys
from kvs.client import KVS, TxnOps

async def writer(i, out):
    async with KVS.connect() as kvs:
        n = 0
        while True:
            ops = TxnOps()
            for _ in range(5):
                ops.append(f"mydata{i}", f"{n}\\n")
                n += 1
            await kvs.commit(ops)
            with open(f"{out}/acked{i}.tmp", "w") as f:  # acknowledged: n lines
                f.write(str(n))
            os.replace(f"{out}/acked{i}.tmp", f"{out}/acked{i}")

async def main(out, count):
    await asyncio.gather(*(writer(i, out) for i in range(count)))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_t1012_a_killed_instance_restarts_with_every_acknowledged_append(
        start_instance, connect, tmp_path) -> None:
    statedir, uri_file, acked = tmp_path / "state", tmp_path / "uri", tmp_path / "acked"
    acked.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    async with start_process("--size", "2", "--statedir", str(statedir),
                             "-S", "kvs.checkpoint-period=0", "--uri-file", str(uri_file),
                             "--", sys.executable, str(script), str(acked),
                             str(WRITERS)) as proc:
        async def written() -> bool:
            return uri_file.exists()

        await wait_until(written, "the URI file", 60)
        pids = await rank_pids(uri_file.read_text().strip(), 2)

        async def appending() -> bool:
            files = [acked / f"acked{i}" for i in range(WRITERS)]
            return all(f.exists() and int(f.read_text()) >= 500 for f in files)

        await wait_until(appending, "every writer's first appends", 60)
        proc.kill()
        await proc.wait()
        await all_gone(pids, "the ranks to stop by themselves", 60)
    last = [int((acked / f"acked{i}").read_text()) for i in range(WRITERS)]

    inst = await start_instance(size=2, statedir=str(statedir))
    h = await connect(inst, 1)
    async with asyncio.timeout(30):
        for i in range(WRITERS):
            value = (await h.rpc("kvs.lookup", {"key": f"mydata{i}", "flags": 0,
                                                "namespace": "primary"}))["val"]["data"]
            lines = [int(n) for n in value.decode().splitlines()]
            assert lines == list(range(len(lines))), f"mydata{i} is not whole appends"
            assert len(lines) % 5 == 0 and len(lines) >= last[i], (i, len(lines), last[i])
