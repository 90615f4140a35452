"""A rank whose event loop hangs while its parent floods it (found by the
tree-overlay fault audit, 2026-12): its ZeroMQ link fills past the
high-water mark, neither side reads the other's heartbeats, and after the
10 s heartbeat timeout the parent drops it -- before ``tbon.torpid_max``
would mark it torpid.  With ZeroMQ's reconnect on, the dropped rank's
DEALER reconnected by itself, and once the loop ran again libzmq 4.3.5
aborted the process (``Assertion failed: _input_stopped``,
zeromq/libzmq#3937): SIGABRT, no log line, its subtree gone with it.  The
rank now dials its parent itself, only until it joins, so a joined rank's
closed link stays closed and the rank exits 1 as documented (docs/guide.md,
Torpid ranks).  ~13 s: the heartbeat timeout is fixed at 10 s."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import use_module_plugin, wait_until
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import keyed_config

from broker.errors import RemoteError
from broker.handle import Handle

HANG = '''
import time
from pathlib import Path
from typing import ClassVar
from broker.module import Module


class Hang(Module):
    """Holds its rank's event loop (a deadlocked or busy loop) while its
    process -- and ZeroMQ's I/O threads -- run on."""
    name: ClassVar[str] = "hang"

    def handlers(self):
        return {"hang.block": self.block}

    def block(self, msg):
        started, until = Path(msg.payload["started"]), Path(msg.payload["until"])
        started.touch()
        while not until.exists():      # the hang itself: nothing else runs
            time.sleep(0.01)
        self.h.respond(msg, {})
'''


async def test_a_rank_dropped_while_its_loop_hung_under_a_flood_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        brokers: Callable[..., Any]) -> None:  # noqa: F811
    """Rank 1's loop hangs (a module handler that blocks); rank 0 publishes
    15,000 events, past ZeroMQ's 10,000-message high-water mark.  Rank 0
    drops rank 1 at the heartbeat timeout, answering what was in flight to
    it EHOSTUNREACH; once its loop runs again, rank 1 exits 1 saying it lost
    its parent -- it died of SIGABRT (status -6) in libzmq."""
    use_module_plugin(tmp_path, monkeypatch, "hang", "Hang", HANG)
    config = await keyed_config(tmp_path, 2, 2)
    r0 = await brokers(config, 0)
    r1 = await brokers(config, 1, "-S", "broker.modules=content,kvs,kvs-watch,hang")
    await r0.ready()
    await r1.ready()
    started, until = tmp_path / "hang-started", tmp_path / "hang-until"
    async with Handle.connect(r0.uri) as h:
        hang = asyncio.ensure_future(h.rpc(
            "hang.block", {"started": str(started), "until": str(until)}, nodeid=1))

        async def hanging() -> bool:
            return started.exists()

        await wait_until(hanging, "rank 1's loop to hang")
        for i in range(15_000):  # past the 10,000-message high-water mark
            h.publish_nowait("flood.event", {"i": i})
            if i % 500 == 0:
                await asyncio.sleep(0)
        await h.ping(0)
        with pytest.raises(RemoteError) as lost:
            await asyncio.wait_for(hang, 40)
        assert lost.value.errnum == errno.EHOSTUNREACH
    until.touch()  # rank 1's loop runs again
    status = await asyncio.wait_for(r1.proc.wait(), 20)
    assert status == 1, f"rank 1 ended with {status} (-6: SIGABRT)"
    err = (tmp_path / "stderr1-1").read_text()
    assert "lost the connection to parent rank 0 (its link closed" in err, err[-3000:]
    assert "Assertion failed" not in err
    assert "lost child rank 1 unexpectedly" in (tmp_path / "stderr0-0").read_text()
