"""flux-core t/t2810-kvs-garbage-collect.t: offline garbage collection
across a restart, with Flux's ``content.dump`` and ``content.restore``
attributes (kvs/dumps.py).  Rank 0 dumps the KVS checkpoint as it stops
(``auto``: ``STATEDIR/dump/DATE.tgz`` and a ``RESTORE`` link to it), and
the next start empties the store and restores that archive into it, so
the store keeps only what the checkpoint reaches.  Then again without a
statedir and with a named archive (in the working directory), as Flux's
second half does (its content-files backing has no counterpart here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from test_broker_support import run_cli

T = 60.0
# Many versions of a few keys: garbage the dump leaves behind (Flux runs
# ten jobs, whose eventlogs and namespaces leave the same).
WORK = ("for i in $(seq 1 20); do kvbroker kvs put a.$i=$i b=$i c.d=$i >/dev/null; done; "
        "kvbroker kvs unlink -R a; kvbroker stats content")
COUNT = "kvbroker kvs get b c.d; kvbroker stats content"


def objects(out: str) -> int:
    """The blobs rank 0 holds, from the ``kvbroker stats content`` that ends
    ``out``: its store's, or its cache's where more (without a statedir,
    blobs are written to the store only to make room in the cache)."""
    stats = json.loads(out[out.index("{"):])
    return max(stats["backing-count"], stats["count"])


async def start(cwd: Path, *args: str) -> tuple[str, str]:
    here = os.getcwd()
    os.chdir(cwd)  # (the ranks run where start runs: an auto dump without statedir goes there)
    try:
        rc, out, err = await run_cli("start", "-S", "log.level=info", *args, timeout=T)
    finally:
        os.chdir(here)
    assert rc == 0, err
    return out, err


async def test_auto_dump_and_restore_in_the_statedir(tmp_path: Path) -> None:
    state = tmp_path / "state"
    out, err = await start(tmp_path, "-S", f"statedir={state}", "-S", "content.dump=auto",
                           "-S", "content.restore=auto", "--", "sh", "-c", WORK)
    before = objects(out)
    assert "dumping content to" in err, err
    link = state / "dump" / "RESTORE"
    assert link.is_symlink()
    archive = link.resolve()
    assert archive.is_file() and archive.parent == state / "dump"
    out, err = await start(tmp_path, "-S", f"statedir={state}", "-S", "content.restore=auto",
                           "--", "sh", "-c", COUNT)
    assert f"restoring content from {archive}" in err, err
    assert out.startswith("20\n20\n"), out  # (the data came back)
    assert objects(out) < before, (before, out)  # (and only what is reachable)
    assert not link.is_symlink() and archive.is_file()  # (the link is used once)
    # no link: content.restore=auto leaves the store as it is
    out, err = await start(tmp_path, "-S", f"statedir={state}", "-S", "content.restore=auto",
                           "--", "sh", "-c", COUNT)
    assert out.startswith("20\n20\n") and "restoring content" not in err, err


async def test_a_named_dump_without_a_statedir(tmp_path: Path) -> None:
    out, err = await start(tmp_path, "-S", "content.dump=foo.tgz", "--", "sh", "-c", WORK)
    before = objects(out)
    assert f"dumping content to {tmp_path / 'foo.tgz'}" in err, err
    assert (tmp_path / "foo.tgz").is_file()
    assert not (tmp_path / "dump").exists()  # (no RESTORE link: the path is explicit)
    out, err = await start(tmp_path, "-S", "content.restore=foo.tgz", "--", "sh", "-c", COUNT)
    assert f"restoring content from {tmp_path / 'foo.tgz'}" in err, err
    assert out.startswith("20\n20\n"), out
    assert objects(out) < before, (before, out)
    assert (tmp_path / "foo.tgz").is_file()


async def test_a_restore_that_cannot_be_read_stops_the_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(b"not an archive")
    rc, out, err = await run_cli("start", "-S", f"content.restore={bad}", "--", "true",
                                 timeout=T)
    assert rc != 0 and out == "", err
    assert f"start-up failed: content.restore {bad}: " in err, err


async def test_a_dump_that_cannot_be_written_fails_the_stop_saying_why(tmp_path: Path) -> None:
    target = tmp_path / "nodir" / "x.tgz"
    rc, _, err = await run_cli("start", "-S", f"content.dump={target}", "--",
                               "kvbroker", "kvs", "put", "a=1", timeout=T)
    assert rc == 1, err
    assert f"content.dump {target}: No such file or directory" in err, err
