"""SIGTERM to a command that writes files (``archive extract``, ``kvs
dump``) cleans up as Ctrl-C does, then the command dies of SIGTERM:
``timeout``, ``kvbroker exec -t`` and a stopping ``start`` send SIGTERM,
which ended it at once, a file cut short (a 300 MB file left at 54 MB) or a
dump's ``.part`` left for good.  Rank 0 is stopped (SIGSTOP) so that the
command is caught in the middle, waiting for blobs, deterministically."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from test_broker_support import run_cli, wait_until

DATA = os.urandom(300_000)


async def _terminated_once(proc: Any, started: Any) -> None:
    """``meanwhile``: SIGTERM the command once ``started()`` holds."""
    await wait_until(started, "the command's file", 20)
    proc.send_signal(signal.SIGTERM)


async def test_sigterm_removes_a_file_extract_was_writing(start_instance,
                                                          tmp_path: Path) -> None:
    inst = await start_instance(size=4, fanout=2)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "big").write_bytes(DATA)
    rc, _, err = await run_cli("archive", "create", "-n", "a", "--chunksize", "64k", "-C",
                               str(src), "big", uri=inst.uri(0))
    assert rc == 0, err
    rc, _, err = await run_cli("archive", "list", "-n", "a", uri=inst.uri(3))  # (cached there)
    assert rc == 0, err
    rank0 = inst.pids()[0]
    os.kill(rank0, signal.SIGSTOP)  # its blobs stay on their way
    try:
        async def started() -> bool:
            return (dst / "big").exists()

        rc, _, err = await run_cli(
            "archive", "extract", "-n", "a", "-C", str(dst), uri=inst.uri(3),
            meanwhile=lambda proc: _terminated_once(proc, started))
    finally:
        os.kill(rank0, signal.SIGCONT)
    assert rc == -signal.SIGTERM, err
    assert os.listdir(dst) == [], "no file left cut short"


async def test_sigterm_leaves_no_part_file_of_a_dump(start_instance, tmp_path: Path) -> None:
    inst = await start_instance(size=4, fanout=2)
    rc, _, err = await run_cli("kvs", "put", "--raw", "big=-", input=DATA, uri=inst.uri(0))
    assert rc == 0, err
    rc, version, err = await run_cli("kvs", "version", uri=inst.uri(0))
    assert rc == 0, err
    for args in (["wait", version.strip()], ["ls"]):  # rank 3 has the root, not the value
        rc, _, err = await run_cli("kvs", *args, uri=inst.uri(3))
        assert rc == 0, err
    out = tmp_path / "out"
    out.mkdir()
    rank0 = inst.pids()[0]
    os.kill(rank0, signal.SIGSTOP)  # the value's blob (not sent with the setroot) waits
    try:
        async def started() -> bool:
            return any(name.endswith(".part") for name in os.listdir(out))

        rc, _, err = await run_cli(
            "kvs", "dump", str(out / "out.tar"), uri=inst.uri(3),
            meanwhile=lambda proc: _terminated_once(proc, started))
    finally:
        os.kill(rank0, signal.SIGCONT)
    assert rc == -signal.SIGTERM, err
    assert os.listdir(out) == [], "neither the archive nor its .part"
