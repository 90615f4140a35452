"""Reproducers from a newcomer's audit of kvbroker (docs/: README, guide, kvs.md).

Each test names a behaviour the audit found missing and is marked
``xfail(strict=True)``: it fails today, and the suite turns red when the
behaviour is fixed, so the marker is removed together with the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_broker_support import run_cli

from broker.handle import Handle
from kvs.client import KVS

LIMIT = 65536  # content.blob-size-limit of the instance below: each append fits, the sum does not


@pytest.mark.xfail(strict=True, reason=(
    "kvs restore refuses a value built by appends whose total is over "
    "content.blob-size-limit (kvs/archive.py:_item): an archive kvs dump wrote "
    "from this instance cannot be restored into it without --size-limit, which "
    "drops the value"))
async def test_dump_of_appended_value_restores_into_same_instance(
        start_instance: Any, tmp_path: Path) -> None:
    """An eventlog (or any appended value) may grow past the blob limit one
    append at a time; the instance stores and serves it, and ``kvs dump``
    archives it.  Restoring that archive into the same instance must give
    the value back (as several blobs, as the appends stored it), not fail."""
    inst = await start_instance(size=1, attrs={"content.blob-size-limit": str(LIMIT)})
    h = await Handle.connect(inst.uri(0))
    try:
        kvs = KVS(h)
        chunk = b"x" * (LIMIT // 2)
        for _ in range(3):  # 1.5 x the limit, each append under it
            await kvs.append("src.log", chunk)
        assert len(await kvs.get("src.log")) == 3 * len(chunk)
        archive = str(tmp_path / "src.tar")
        code, _, err = await run_cli("kvs", "dump", "--key", "src", archive, uri=inst.uri(0))
        assert code == 0, err
        code, _, err = await run_cli("kvs", "restore", "--key", "dst", archive,
                                     uri=inst.uri(0))
        assert code == 0, err
        assert await kvs.get("dst.log") == 3 * chunk
    finally:
        await h.close()
