"""The offline tools that only read a stopped instance's store read one they
cannot write (a read-only mount, a snapshot), and the ones that write say
so in one line (broker/content/sqlite.py ``_open_read_only``,
broker/content/locks.py; the crash audit's bug 5).

They used to open the store for writing, to take its lock, and failed with
Python's raw ``[Errno 30] Read-only file system``.  Read-only, SQLite's
``mode=ro`` cannot open a WAL-mode file without making its ``-shm``; the
store is read ``immutable`` when it has no WAL (a clean stop), and through
an in-memory WAL index when it has one (a crash), whose frames must count:
``immutable`` would ignore them.

Where file modes are ignored (root), the statedir is a read-only bind
mount of the real one (a real read-only file system; skipped where it
cannot be mounted); otherwise its files are made read-only with
``chmod``, which the tools see as ``permission denied`` the same way.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from test_broker_support import KVBROKER, held_in_another_process, run_cli

from broker.content.sqlite import STORE_FILE, SqliteStore

CHECKPOINT_KEY = "kvs-primary"


def _modes_ignored(tmp_path: Path) -> bool:
    """Whether this process writes a file whose mode forbids it (root's
    ``CAP_DAC_OVERRIDE``): then only a read-only mount stops it."""
    probe = tmp_path / "probe"
    probe.touch(mode=0o400)
    try:
        with open(probe, "a"):
            return True
    except PermissionError:
        return False
    finally:
        probe.unlink()


@contextlib.contextmanager
def read_only_view(sd: Path, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """``sd`` as a directory its tools cannot write, and the cause they
    should name."""
    if _modes_ignored(tmp_path):
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o700, exist_ok=True)
        if subprocess.run(["mount", "--bind", str(sd), str(ro)],
                          capture_output=True).returncode != 0:
            pytest.skip("needs a bind mount")
        try:
            if subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)],
                              capture_output=True).returncode != 0:
                pytest.skip("needs a read-only bind mount")
            yield ro, "read-only file system"
        finally:
            subprocess.run(["umount", str(ro)], capture_output=True)
        return
    files = [sd / name for name in os.listdir(sd)]
    for f in files:
        f.chmod(0o400)
    sd.chmod(0o500)
    try:
        yield sd, "permission denied"
    finally:
        sd.chmod(0o700)
        for f in files:
            f.chmod(0o600)


def _statedir(tmp_path: Path) -> Path:
    """A stopped instance's statedir (an offline restore: no instance needed)."""
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        for key, value in (("a", b"1"), ("dir/b", b"2")):
            info = tarfile.TarInfo(key)
            info.size = len(value)
            tar.addfile(info, io.BytesIO(value))
    sd = tmp_path / "sd"
    subprocess.run([KVBROKER, "kvs", "restore", "--checkpoint", "--statedir", str(sd),
                    str(archive)], check=True, capture_output=True)
    return sd


def _crash_with_wal_frames(sd: Path) -> None:
    """Leave ``sd``'s store as a killed rank 0 can: a newer checkpoint (and a
    run) committed only to the WAL, never copied into the main file."""
    script = f"""
import os, msgpack
from broker.content.sqlite import SqliteStore
s = SqliteStore({str(sd / STORE_FILE)!r})
old = msgpack.unpackb(s.checkpoint_get({CHECKPOINT_KEY!r}))
s.db.execute("PRAGMA wal_autocheckpoint=0")
s.db.execute("BEGIN")
s.db.execute("INSERT INTO checkpoint_history (key, value) VALUES (?, ?)",
             ({CHECKPOINT_KEY!r}, s.checkpoint_get({CHECKPOINT_KEY!r})))
s.db.execute("INSERT OR REPLACE INTO checkpoints (key, value) VALUES (?, ?)",
             ({CHECKPOINT_KEY!r}, msgpack.packb(dict(old, rootseq=7))))
s.db.execute("INSERT INTO runs (started, version) VALUES (1000.0, 'x')")
s.db.execute("COMMIT")
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    assert os.path.getsize(f"{sd / STORE_FILE}-wal") > 0


async def _readers_work(ro: Path, tmp_path: Path, seq: int, runs: int) -> None:
    rc, out, err = await run_cli("kvs", "fsck", "--statedir", str(ro))
    assert rc == 0, err
    assert f"(version {seq}," in out, out
    rc, out, err = await run_cli("content", "checkpoint", "list", "-n", "--statedir",
                                 str(ro))
    assert rc == 0, err
    assert re.match(rf"^0\s+{seq}\s", out), out
    rc, out, err = await run_cli("startlog", "--statedir", str(ro))
    assert rc == 0, err
    assert len(out.splitlines()) == runs, out
    out_tar = tmp_path / f"dump{seq}.tar"
    rc, _out, err = await run_cli("kvs", "dump", "--checkpoint", "--statedir", str(ro),
                                  str(out_tar))
    assert rc == 0, err
    with tarfile.open(out_tar) as tar:
        assert sorted(tar.getnames()) == ["a", "dir/b"]
    rc, out, err = await run_cli("kvs", "gc", "--dry-run", "--statedir", str(ro))
    assert rc == 0, err
    assert out.startswith("kept 2 blobs") and "would remove" in out, out


async def _writers_refused(ro: Path, why: str, tmp_path: Path) -> None:
    store = ro / STORE_FILE
    for args in (["kvs", "gc", "--statedir", str(ro)],
                 ["kvs", "restore", "--checkpoint", "--statedir", str(ro),
                  str(tmp_path / "a.tar")],
                 ["kvs", "fsck", "--repair", "--statedir", str(ro)]):
        rc, out, err = await run_cli(*args)
        assert rc == 1, (args, out, err)
        assert f"{store}: cannot be written ({why})" in err, (args, err)
        assert len(err.splitlines()) == 1 and "Errno" not in err, (args, err)


async def test_a_cleanly_stopped_store_is_read_where_it_cannot_be_written(
        tmp_path: Path) -> None:
    sd = _statedir(tmp_path)
    assert sorted(os.listdir(sd)) == [STORE_FILE]  # (no WAL: a clean close)
    with read_only_view(sd, tmp_path) as (ro, why):
        await _readers_work(ro, tmp_path, seq=0, runs=0)
        await _writers_refused(ro, why, tmp_path)
        assert sorted(os.listdir(ro)) == [STORE_FILE]  # (nothing made beside it)


async def test_a_crashed_store_is_read_with_its_wal(tmp_path: Path) -> None:
    """Its newest checkpoint and run are only in the WAL: read, not lost."""
    sd = _statedir(tmp_path)
    _crash_with_wal_frames(sd)
    with read_only_view(sd, tmp_path) as (ro, why):
        await _readers_work(ro, tmp_path, seq=7, runs=1)
        await _writers_refused(ro, why, tmp_path)
        assert sorted(os.listdir(ro)) == [STORE_FILE, f"{STORE_FILE}-wal"]


async def test_a_store_held_by_a_running_instance_is_refused_read_only(
        tmp_path: Path) -> None:
    """An instance holding the store through a writable path: the read-only
    reader's own lock says so, as the writable open's does."""
    sd = _statedir(tmp_path)
    with held_in_another_process("from broker.content.sqlite import SqliteStore; "
                                 f"s = SqliteStore({str(sd / STORE_FILE)!r}); s.runs()"):
        with read_only_view(sd, tmp_path) as (ro, _why):
            rc, _out, err = await run_cli("startlog", "--statedir", str(ro))
            assert rc == 1 and "is in use by a running instance" in err, err
            rc, _out, err = await run_cli("kvs", "fsck", "--statedir", str(ro))
            assert rc == 1 and "is in use by a running instance" in err, err
    with read_only_view(sd, tmp_path) as (ro, _why):  # (released: read)
        rc, _out, err = await run_cli("kvs", "fsck", "--statedir", str(ro))
        assert rc == 0, err


def test_a_read_only_open_writes_nothing_and_reads_an_older_layout(tmp_path: Path) -> None:
    """A store without the tables later versions added (checkpoint_history,
    runs) is read with them empty, none added to the file."""
    import sqlite3

    path = tmp_path / STORE_FILE
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE objects (hash BLOB PRIMARY KEY, object BLOB NOT NULL)")
    db.execute("CREATE TABLE checkpoints (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
    db.execute("INSERT INTO checkpoints VALUES (?, ?)",
               (CHECKPOINT_KEY, msgpack.packb({"rootref": "sha256-" + "0" * 64})))
    db.commit()
    db.close()
    before = path.read_bytes()
    store = SqliteStore(str(path), read_only=True)
    try:
        assert store.runs() == [] and len(store.checkpoint_list(CHECKPOINT_KEY)) == 1
    finally:
        store.close()
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == [STORE_FILE]
