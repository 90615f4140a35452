"""A first end-to-end check: an instance of 4 ranks answers pings from every rank."""

from __future__ import annotations

import asyncio

import pytest


@pytest.mark.both_loops
async def test_ping_every_rank(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    for rank in range(4):
        resp = await asyncio.wait_for(h.ping(rank), 5)
        assert resp["rank"] == rank
        assert resp["route"][-1] == f"r{rank}"
