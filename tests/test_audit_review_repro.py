"""Reproducers of the review audit of the store replacement (3185f4f) and the
own dial of the parent (2393607): each is a bug found, marked
``xfail(strict=True)`` until it is fixed (then the mark goes).

1. A restore's sealed temporary file is unlocked between ``_seal`` and the
   rename/link of ``storefile.install``: another restore (or a start)
   takes it for a killed restore's leftover and removes it, and the first
   then links the *second's* live file as ``content.sqlite`` and reports
   success; the second killed, the store is a part (its WAL orphaned under
   the temporary name, removed by the next start).  The pause before the
   link is made with strace's syscall delay (skipped without strace).
2. A parent endpoint that closes connections during the ZeroMQ greeting
   (on ``ipc``, no CURVE at all) counts as a CURVE key refusal: five in a
   row and the child exits 3 blaming its key pair.
3. A store of a newer format whose WAL holds frames is written by the tools
   that refuse it: closing SQLite's connection checkpoints the WAL into
   the file and removes the WAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, wait_until

from broker.content.sqlite import STORE_FILE

TEMP = STORE_FILE + ".restoring"


def _archive(path: Path, values: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for key, data in values.items():
            info = tarfile.TarInfo(key)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.xfail(strict=True, reason="audit bug 1: a sealed restore file is unlocked "
                   "until renamed; a second restore removes it and the first links the "
                   "second's live file, reporting success")
@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (syscall delay)")
async def test_a_second_restore_does_not_become_the_first_restore_s_store(
        tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    first = _archive(tmp_path / "a.tar", {"mine": b"first"})
    trace = tmp_path / "strace.log"
    # restore A, held 5 s just before it links its finished file as the store
    a = await asyncio.create_subprocess_exec(
        "strace", "-f", "-qq", "-o", str(trace), "-e", "trace=link,linkat",
        "-e", "inject=link,linkat:delay_enter=5000000",
        KVBROKER, "kvs", "restore", "--checkpoint", "--statedir", str(sd), str(first),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    b = None
    try:
        async def a_links() -> bool:
            assert a.returncode is None
            return trace.exists() and "link" in trace.read_text()

        await wait_until(a_links, "restore A to reach its link()", timeout=30)
        # restore B into the same statedir, reading its archive from a pipe
        # that stays open: under way, its temporary file open
        b = await asyncio.create_subprocess_exec(
            KVBROKER, "kvs", "restore", "--checkpoint", "--statedir", str(sd), "-",
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        async def b_writes() -> bool:
            return (sd / f"{TEMP}-wal").exists()  # (A's sealed file has no WAL)

        await wait_until(b_writes, "restore B to be writing", timeout=4)
        _out, a_err = await asyncio.wait_for(a.communicate(), 30)
    finally:
        if b is not None:
            with contextlib.suppress(ProcessLookupError):
                b.kill()  # (a crash of B, part-way)
            await b.wait()
        if a.returncode is None:
            a.kill()
            await a.wait()
    assert a.returncode == 0, a_err.decode()  # A says its archive is the checkpoint now
    rc, out, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(sd),
                                 str(tmp_path / "out.tar"))
    assert rc == 0, f"A succeeded, but its store is not whole: {err} {os.listdir(sd)}"
    with tarfile.open(tmp_path / "out.tar") as tar:
        assert tar.getnames() == ["mine"]


@pytest.mark.xfail(strict=True, reason="audit bug 2: a connection closed during the "
                   "greeting counts as a CURVE key refusal, on ipc without CURVE too: "
                   "exit 3 after 5")
async def test_a_parent_that_drops_connections_is_not_taken_for_a_key_refusal(
        tmp_path: Path) -> None:
    """No CURVE on ipc: nothing to refuse.  A parent endpoint that accepts
    and closes (a parent dying as it accepts, restarting in a loop) is one
    to dial again, as the docs say of a parent restarting."""
    run = tmp_path / "run"
    run.mkdir()
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(str(run / "tbon-0"))
    srv.listen(16)
    srv.setblocking(False)
    attrs = {"tbon.transport": "ipc", "tbon.connect_timeout": "1s"}
    log = tmp_path / "rank1.log"
    with open(log, "wb") as err:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.rank", "--rank", "1", "--size", "2", "--fanout",
            "2", "--rundir", str(run), "--attrs", json.dumps(attrs), "--endpoints", "{}",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            start_new_session=True)
    loop = asyncio.get_running_loop()
    closed = 0
    try:
        while closed < 10:
            accept = asyncio.ensure_future(loop.sock_accept(srv))
            exited = asyncio.ensure_future(child.wait())
            done, _ = await asyncio.wait({accept, exited}, timeout=20,
                                         return_when=asyncio.FIRST_COMPLETED)
            if accept not in done:
                accept.cancel()
                break
            exited.cancel()
            conn, _addr = accept.result()
            conn.close()
            closed += 1
        assert child.returncode is None, (
            f"the child stopped (exit {child.returncode}) after {closed} closed "
            f"connections: {log.read_text()}")
        assert closed == 10
    finally:
        srv.close()
        if child.returncode is None:
            child.kill()
        await child.wait()


@pytest.mark.xfail(strict=True, reason="audit bug 3: a newer-format store's WAL is "
                   "checkpointed into it by the tools that refuse it")
async def test_a_newer_store_with_wal_frames_is_refused_without_being_written(
        tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    sd.mkdir(mode=0o700)
    store = sd / STORE_FILE
    # a newer kvbroker's store, its last writes in the WAL (killed: no checkpoint)
    script = ("import os, sqlite3, sys; db = sqlite3.connect(sys.argv[1], "
              "isolation_level=None); db.execute('PRAGMA journal_mode=WAL'); "
              "db.execute('PRAGMA wal_autocheckpoint=0'); "
              "db.execute('CREATE TABLE newer (x)'); db.execute('PRAGMA user_version=2'); "
              "db.execute('INSERT INTO newer VALUES (1)'); os._exit(0)")
    subprocess.run([sys.executable, "-c", script, str(store)], check=True)
    wal = Path(f"{store}-wal")
    assert wal.stat().st_size > 0

    def digest(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "absent"

    before = (digest(store), digest(wal))
    rc, _out, err = await run_cli("content", "checkpoint", "list", "--statedir", str(sd))
    assert rc == 1 and "written by a newer kvbroker (store format 2" in err, err
    assert (digest(store), digest(wal)) == before, "the refused store was written"
