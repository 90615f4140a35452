"""Restores replace the store whole or not at all, a SIGKILL included
(broker/content/storefile.py; the crash audit's bugs 2 and 4).

* A start with ``-S content.restore=FILE`` killed while it restores leaves
  the old store as it was: its data, its runs (``startlog --statedir``
  still lists the earlier ones and their crash), and the next start removes
  the unfinished file, saying so once.  (It used to empty the store first:
  the kill left none, or a half-restored one without a checkpoint or runs.)
* ``kvbroker kvs restore --checkpoint`` killed part-way into a statedir
  without a store leaves none (it used to leave one without a checkpoint,
  which a start took for an empty instance and ``kvs gc`` refused); into a
  store, the old checkpoint stays current (checked, as the docs claim).
* A completed restore over a store whose WAL holds frames (a crashed run)
  leaves no WAL beside the new file, keeps the runs, and is whole.

Each kill waits for the restore to be under way (its file growing), not
for a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, held_in_another_process, run_cli, wait_until

from broker.content.sqlite import STORE_FILE, SqliteStore

# (_kill_when kills a start "and every process under it")
pytestmark = pytest.mark.no_forkserver

TEMP = STORE_FILE + ".restoring"
CRASHED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - crashed$")
FINISHED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - \d{4}-\d\d-\d\d \d\d:\d\d \(\d+\.\ds\)$")
RUNNING = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d - running \(\d+\.\d[smhd]\)$")
INTERRUPTED = "a content restore was interrupted"
UNDER_WAY = 256 * 1024
"""Bytes a restore has written when it is killed: well inside an archive
of :func:`_archive` (its store is ~4 MB)."""


def _archive(path: Path, keys: int = 5000) -> Path:
    """A tar of ``keys`` values of 512 random bytes (a restore of ~1 s)."""
    with tarfile.open(path, "w") as tar:
        for i in range(keys):
            data = os.urandom(512)
            info = tarfile.TarInfo(f"d{i % 50}/k{i}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def _descendants(pid: int) -> list[int]:
    """``pid``'s processes, children before their parents' parents."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


async def _kill_when(proc: asyncio.subprocess.Process, under_way: Path | list[Path],
                     what: str, baseline: int = 0) -> None:
    """SIGKILL ``proc`` and every process under it once one of the files
    ``under_way`` has grown past ``baseline`` + :data:`UNDER_WAY` bytes."""
    files = under_way if isinstance(under_way, list) else [under_way]

    async def grown() -> bool:
        assert proc.returncode is None, f"it ended before {what} ({proc.returncode})"
        return any(_size(f) > baseline + UNDER_WAY for f in files)

    await wait_until(grown, what, timeout=60)
    for pid in reversed(_descendants(proc.pid)):  # (the ranks first, rank 0 among them)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    await proc.wait()


async def _crashed_run(sd: Path, script: str) -> None:
    """A run of an instance on ``sd`` that runs ``script`` and is then
    SIGKILLed (rank 0 first): its store keeps a WAL, its run is a crash."""
    rc, _out, err = await run_cli("start", "--statedir", str(sd), "--", "sh", "-c",
                                  f"{script} && kill -9 $(kvbroker attr get broker.pid); "
                                  "sleep 60", timeout=60)
    assert rc == 1 and "killed by signal 9" in err, err
    assert Path(f"{sd / STORE_FILE}-wal").exists()


async def test_a_start_killed_while_it_restores_keeps_the_old_store_and_its_runs(
        tmp_path: Path) -> None:
    sd = tmp_path / "sd"
    await _crashed_run(sd, "kvbroker kvs put a=old --sync")
    big = _archive(tmp_path / "big.tar")
    store = sd / STORE_FILE
    # (a rundir of the test's: the start SIGKILLed leaves the one it made)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "--statedir", str(sd), "--rundir", str(tmp_path / "run"), "-S",
        f"content.restore={big}", "--", "true", stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # (under way: its new file growing -- the temporary one, or, emptied
    # first as it was, the store itself)
    old = store.stat().st_ino
    await _kill_when(proc, [sd / TEMP, store], "the restore at start to be under way",
                     baseline=0)
    rc, out, err = await run_cli("startlog", "--statedir", str(sd))
    assert rc == 0, err
    assert [bool(CRASHED.match(s)) for s in out.splitlines()] == [True], out
    assert store.stat().st_ino == old, "the store was replaced"

    assert (sd / TEMP).exists()  # (killed part-way: the next start removes it)
    rc, out, err = await run_cli("start", "--statedir", str(sd), "--", "sh", "-c",
                                 "kvbroker kvs get a && kvbroker startlog", timeout=60)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "old", out
    assert len(lines) == 3 and CRASHED.match(lines[1]) and RUNNING.match(lines[2]), out
    assert err.count(INTERRUPTED) == 1 and f"{sd / TEMP}" in err, err
    assert "not shut down properly" in err  # (the first run's crash, still known)
    assert sorted(os.listdir(sd)) == [STORE_FILE]


async def test_a_restore_at_start_over_a_crashed_store_leaves_no_wal_beside_it(
        tmp_path: Path) -> None:
    """The swap itself: the old store's WAL holds frames (a crashed run); the
    new one is whole, the old WAL is not replayed into it, the runs are kept."""
    sd = tmp_path / "sd"
    await _crashed_run(sd, "kvbroker kvs put a=old --sync")
    small = _archive(tmp_path / "small.tar", keys=20)
    rc, out, err = await run_cli(
        "start", "--statedir", str(sd), "-S", f"content.restore={small}", "--", "sh", "-c",
        "kvbroker kvs get d3.k3 >/dev/null && echo restored; kvbroker kvs get a; "
        "kvbroker startlog", timeout=60)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "restored" and lines[1:2] != ["old"], (out, err)
    assert len(lines) == 3 and CRASHED.match(lines[1]) and RUNNING.match(lines[2]), out
    assert INTERRUPTED not in err
    assert sorted(os.listdir(sd)) == [STORE_FILE]
    rc, out, err = await run_cli("kvs", "fsck", "--statedir", str(sd))
    assert rc == 0, err
    store = SqliteStore(str(sd / STORE_FILE))
    try:
        assert store.check() is None
        assert len(store.checkpoint_list("kvs-primary")) == 1  # (the restored one only)
    finally:
        store.close()


async def test_an_offline_restore_killed_into_a_new_statedir_leaves_no_store(
        tmp_path: Path) -> None:
    sd = tmp_path / "new"
    big = _archive(tmp_path / "big.tar")
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "kvs", "restore", "--checkpoint", "--statedir", str(sd), str(big),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await _kill_when(proc, [sd / TEMP, sd / STORE_FILE], "the offline restore to be under way")
    assert not (sd / STORE_FILE).exists(), os.listdir(sd)
    rc, _out, err = await run_cli("kvs", "fsck", "--statedir", str(sd))
    assert rc == 1 and f"statedir {sd} has no {STORE_FILE}" in err, err

    # the next restore there removes the leftover and completes
    small = _archive(tmp_path / "small.tar", keys=20)
    rc, _out, err = await run_cli("kvs", "restore", "--checkpoint", "--statedir", str(sd),
                                  str(small))
    assert rc == 0, err
    assert sorted(os.listdir(sd)) == [STORE_FILE]
    rc, out, err = await run_cli("kvs", "fsck", "--statedir", str(sd))
    assert rc == 0, err


async def test_an_offline_restore_killed_into_a_store_keeps_its_checkpoint(
        tmp_path: Path) -> None:
    """The claim of the docs, checked against a kill: into an existing store
    the blobs go first and the checkpoint last."""
    sd = tmp_path / "sd"
    small = _archive(tmp_path / "small.tar", keys=20)
    rc, _out, err = await run_cli("kvs", "restore", "--checkpoint", "--statedir", str(sd),
                                  str(small))
    assert rc == 0, err
    rc, before, err = await run_cli("content", "checkpoint", "list", "--statedir", str(sd))
    assert rc == 0, err
    big = _archive(tmp_path / "big.tar")
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "kvs", "restore", "--checkpoint", "--statedir", str(sd), str(big),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    await _kill_when(proc, sd / STORE_FILE, "the offline restore to be under way",
                     baseline=_size(sd / STORE_FILE))
    rc, after, err = await run_cli("content", "checkpoint", "list", "--statedir", str(sd))
    assert rc == 0, err
    assert after == before  # (the old checkpoint, alone: the new one never written)
    rc, _out, err = await run_cli("kvs", "fsck", "--statedir", str(sd))
    assert rc == 0, err


def test_a_leftover_held_by_a_live_restore_is_not_removed(tmp_path: Path) -> None:
    """Another instance's restore writing the temporary file (its lock held):
    a start on the same statedir is refused, not let to remove it."""
    from broker.content import storefile
    from broker.content.sqlite import StoreLocked

    path = str(tmp_path / STORE_FILE)
    with held_in_another_process(f"from broker.content import storefile; "
                                 f"s = storefile.create({path!r})"):
        try:
            storefile.remove_leftover(path)
        except StoreLocked:
            pass
        else:
            raise AssertionError("a live restore's file was removed")
        assert (tmp_path / TEMP).exists()
    assert storefile.remove_leftover(path) and not (tmp_path / TEMP).exists()


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (syscall delay)")
async def test_a_finished_restore_is_held_until_it_is_in_place(tmp_path: Path) -> None:
    """A restore into a new statedir, held 5 s just before it links its
    finished (sealed, SQLite-closed) file as the store: a second restore
    and a start on that statedir are refused as "a restore is writing it",
    and the first's archive is the store.  Found by a review audit: SQLite's
    lock went with the seal, so the second restore removed the first's
    file as a leftover and the first linked the second's half-written one,
    reporting success; a start logged a false "restore was interrupted"."""
    sd = tmp_path / "sd"
    first = tmp_path / "a.tar"
    with tarfile.open(first, "w") as tar:
        info = tarfile.TarInfo("mine")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"first"))
    trace = tmp_path / "strace.log"
    a = await asyncio.create_subprocess_exec(
        "strace", "-f", "-qq", "-o", str(trace), "-e", "trace=link,linkat",
        "-e", "inject=link,linkat:delay_enter=5000000",
        KVBROKER, "kvs", "restore", "--checkpoint", "--statedir", str(sd), str(first),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        async def a_links() -> bool:
            assert a.returncode is None
            return trace.exists() and "link" in trace.read_text()

        await wait_until(a_links, "restore A to reach its link()", timeout=30)
        rc, out, err = await run_cli("kvs", "restore", "--checkpoint", "--statedir",
                                     str(sd), str(_archive(tmp_path / "b.tgz", 10)))
        assert rc == 1 and "another restore is writing" in err, err
        rc, out, err = await run_cli("start", "--statedir", str(sd), "--", "true")
        assert rc != 0 and "a restore is writing" in err, err
        assert "interrupted" not in err, err
        _out, a_err = await asyncio.wait_for(a.communicate(), 30)
    finally:
        if a.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                a.kill()
            await a.wait()
    assert a.returncode == 0, a_err.decode()
    rc, out, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(sd),
                                 str(tmp_path / "out.tar"))
    assert rc == 0, err
    with tarfile.open(tmp_path / "out.tar") as tar:
        assert tar.getnames() == ["mine"]
    assert sorted(os.listdir(sd)) == [STORE_FILE]


def test_a_restore_at_start_answers_the_errno_of_why_the_old_store_cannot_open(
        tmp_path: Path) -> None:
    """``content.restore`` over a store it cannot open is refused with the
    cause's errno: ``EIO`` for a damaged file, ``EBUSY`` for one another
    process holds (every failure was ``EBUSY``, "in use", before)."""
    import errno

    from broker.errors import ErrnoError
    from kvs import dumps

    archive = _archive(tmp_path / "a.tar", keys=3)
    statedir = tmp_path / "state"
    statedir.mkdir(mode=0o700)
    attrs = {"content.restore": str(archive)}
    (statedir / STORE_FILE).write_bytes(b"not a database " * 100)
    with pytest.raises(ErrnoError) as damaged:
        dumps.restore_at_start(attrs, str(statedir), str(statedir))
    assert damaged.value.errnum == errno.EIO, damaged.value
    assert "not a database" in str(damaged.value)

    (statedir / STORE_FILE).unlink()
    with held_in_another_process("from broker.content.sqlite import SqliteStore; "
                                 f"s = SqliteStore({str(statedir / STORE_FILE)!r})"):
        with pytest.raises(ErrnoError) as held:
            dumps.restore_at_start(attrs, str(statedir), str(statedir))
        assert held.value.errnum == errno.EBUSY, held.value
