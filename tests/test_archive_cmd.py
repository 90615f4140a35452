"""``kvbroker archive`` (docs/cli.md "archive"): the RFC 37 format module
(:mod:`kvs.filearchive`) on its own, then the command against real ranks.

The integration tests share one 4-rank instance (``kvbroker start --size 4``,
guests admitted) and each uses archive names of its own; the garbage
collection test starts an instance of its own (``kvs.gc-grace=0``), as its
collection would take the other tests' blobs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_broker_guests import GUEST_UID, run_guest_cli
from test_broker_support import KVBROKER, run_cli, started_in_background

from broker.cliutil import PermutingParser
from broker.content.blobref import hash_blob
from kvs import filearchive as fa
from kvs.archive_cli import register

T = 60.0
PRELOAD = "import kvs.archive, kvs.filearchive, kvs.client"
"""Imported as the owner before a guest command runs (the interpreter's own
library may not be the guest's to read)."""
MTIME = 1_600_000_000


# ---------------------------------------------------------------- the format


def test_archive_path_is_relative_and_refuses_dotdot() -> None:
    assert fa.archive_path("/etc//passwd") == "etc/passwd"
    assert fa.archive_path("./a/./b/") == "a/b"
    assert fa.archive_path("/") == fa.archive_path(".") == "."
    with pytest.raises(fa.ArchiveInputError, match=r"\.\./x: a path with '\.\.'"):
        fa.archive_path("../x")
    with pytest.raises(fa.ArchiveInputError):
        fa.archive_path("a/../../b")


def test_walk_order_types_and_refusals(tmp_path: Path) -> None:
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "f").write_text("x")
    (tmp_path / "a").write_text("y")
    (tmp_path / "l").symlink_to("/nonexistent")
    found = [(s.path, s.target) for s in fa.walk(["."], str(tmp_path))]
    # each directory before its contents, sorted; "." itself is not an entry;
    # the link is a link (its dangling target is only data)
    assert found == [("a", None), ("d", None), ("d/e", None), ("d/f", None),
                     ("l", "/nonexistent")]
    assert [s.path for s in fa.walk(["d"], str(tmp_path))] == ["d", "d/e", "d/f"]
    assert [s.path for s in fa.walk([str(tmp_path / "a")])] == [str(tmp_path / "a")[1:]]
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(fa.ArchiveInputError, match=r"^fifo: unsupported file type \(a FIFO"):
        list(fa.walk(["fifo"], str(tmp_path)))
    with pytest.raises(fa.ArchiveInputError, match=r"^\./fifo: unsupported file type"):
        list(fa.walk(["."], str(tmp_path)))
    with pytest.raises(fa.ArchiveInputError, match="nope: No such file or directory"):
        list(fa.walk(["nope"], str(tmp_path)))
    if os.geteuid() != 0:  # (root reads anything)
        (tmp_path / "secret").write_text("s")
        (tmp_path / "secret").chmod(0)
        with pytest.raises(fa.ArchiveInputError, match="secret: Permission denied"):
            list(fa.walk(["secret"], str(tmp_path)))


def test_data_chunks_leave_out_holes(tmp_path: Path) -> None:
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(8 << 20)
        f.seek(3 << 20)
        f.write(b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        chunks = fa.data_chunks(fd, size, 4096)
        assert chunks, "some data"
        covered = sum(n for _, n in chunks)
        # the file system reports data by blocks: the 5000 bytes, rounded, not 8 MiB
        assert 5000 <= covered <= 64 << 10, chunks
        assert all(n <= 4096 for _, n in chunks)
        assert chunks[0][0] <= 3 << 20 < chunks[0][0] + 4096
        assert fa.data_chunks(fd, size, 0) == [(chunks[0][0], covered)]
    finally:
        os.close(fd)
    hole = tmp_path / "hole"
    with open(hole, "wb") as f:
        f.truncate(1 << 20)
    fd = os.open(hole, os.O_RDONLY)
    try:
        assert fa.data_chunks(fd, 1 << 20, 4096) == []
    finally:
        os.close(fd)


def test_objects_encodings_and_checks(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    st = os.stat(tmp_path / "f")
    assert fa.inline_object("t", st, "h\u00e9".encode())["encoding"] == "utf-8"
    # a NUL byte: base64 (Flux's reader of utf-8 data stops at a NUL)
    obj = fa.inline_object("b", st, b"a\0b")
    assert (obj["encoding"], obj["data"], obj["size"]) == ("base64", "YQBi", 3)
    assert fa.inline_data(obj) == b"a\0b"
    assert fa.inline_data({"path": "j", "mode": 0o100644, "data": {"a": [1, "\u00e9"]}}) == \
        '{"a":[1,"\u00e9"]}'.encode()
    ref = "sha256-" + "0" * 64
    good = {"path": "p", "mode": 0o100644, "size": 10, "encoding": "blobvec",
            "data": [[0, 4, ref], [6, 4, ref]]}
    assert fa.check_object(good) is good
    assert fa.blobrefs_of(good) == [ref, ref]
    for bad, why in [
        ({**good, "data": [[8, 4, ref]]}, "past the file's size"),
        ({**good, "data": [[0, 4, "sha256-nope"]]}, "bad blobvec entry"),
        ({**good, "encoding": "gzip"}, "unknown RFC 37 encoding"),
        ({**good, "encoding": "base64", "data": "!!"}, "not base64"),
        ({"path": "s", "mode": 0o120777}, "symbolic link without its target"),
        ({"path": "q", "mode": 0o010644}, "unknown file type"),
        ({"path": "", "mode": 0o100644}, "no path"),
        ({"path": "m", "mode": -1}, "mode must be"),
    ]:
        with pytest.raises(fa.BadArchive, match=why):
            fa.check_object(bad)
    with pytest.raises(fa.BadArchive, match="not an RFC 37 archive"):
        fa.file_objects("text")
    # RFC 37's other form: an object of path -> file object
    assert fa.file_objects({"x": {"mode": 0o40755}}) == [{"path": "x", "mode": 0o40755}]
    assert fa.pretty({"path": "t2", "mode": 0o100644, "size": 2048}, long=True) == \
        "f 0644     2048 t2"
    assert fa.pretty({"path": "d", "mode": 0o40755}, long=True) == "d 0755        0 d"
    assert fa.matches({"path": "a/b.txt"}, "*.txt") and not fa.matches({"path": "b"}, "a*")


def test_safe_parts() -> None:
    assert fa.safe_parts("a/./b//c") == ["a", "b", "c"]
    assert fa.safe_parts(".") == []
    for path in ("/etc/passwd", "../x", "a/../../x", "a/.."):
        with pytest.raises(fa.UnsafePath):
            fa.safe_parts(path)


def test_extractor_never_writes_through_a_link(tmp_path: Path) -> None:
    """A link the archive makes (or one already there) is not followed on
    the way to a later path, and an existing link is replaced, with
    --overwrite, never written through."""
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (outside / "victim").write_text("keep")
    with fa.Extractor(str(dest)) as ex:
        ex.symlink({"path": "esc", "mode": 0o120777, "data": str(outside)})
        with pytest.raises(fa.UnsafePath, match="esc/victim: esc is a symbolic link: not "
                                                "followed"):
            ex.create_file({"path": "esc/victim", "mode": 0o100644, "encoding": "utf-8",
                            "data": "pwned", "size": 5})
        with pytest.raises(FileExistsError):
            ex.create_file({"path": "esc", "mode": 0o100644, "size": 0})
    with fa.Extractor(str(dest), overwrite=True) as ex:
        fd = ex.create_file({"path": "esc", "mode": 0o100600, "encoding": "utf-8",
                             "data": "mine", "size": 4})
        ex.finish_file(fd, {"path": "esc", "mode": 0o100600, "size": 4})
    assert (outside / "victim").read_text() == "keep"
    assert not (dest / "esc").is_symlink() and (dest / "esc").read_text() == "mine"
    assert stat.S_IMODE(os.stat(dest / "esc").st_mode) == 0o600


def test_waitcreate_takes_its_fsd_attached_only() -> None:
    top = PermutingParser(prog="kvbroker")
    register(top.add_subparsers(dest="command"))
    args = top.parse_args(["archive", "extract", "--waitcreate", "pat"])
    assert (args.pattern, args.waitcreate) == ("pat", float("inf"))
    args = top.parse_args(["archive", "extract", "--waitcreate=1.5m"])
    assert (args.pattern, args.waitcreate) == (None, 90.0)
    for zero in ("0", "0s"):  # (taken, it failed as a connect that timed out)
        with pytest.raises(SystemExit) as exit_:
            top.parse_args(["archive", "extract", f"--waitcreate={zero}"])
        assert exit_.value.code == 2
    args = top.parse_args(["archive", "create", "--chunksize", "1.5k",
                           "--small-file-threshold=2M", "x"])
    assert (args.chunksize, args.small_file_threshold) == (1536, 2 << 20)


# ---------------------------------------------------------------- against ranks


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One 4-rank instance (fanout 2: rank 3 is below rank 1) for the module."""
    with started_in_background(tmp_path_factory.mktemp("archive") / "ranks.log", "--size",
                               "4", "--fanout", "2", "-S", "access.allow-guest-user=true") as line:
        yield line


async def cli(uri: str, *args: str, rc: int = 0, env: dict[str, str] | None = None) -> str:
    code, out, err = await run_cli(*args, uri=uri, timeout=T, env=env)
    assert code == rc, (args, code, out, err)
    return out if rc == 0 else err


async def on_rank(uri: str, rank: int, *args: str, rc: int = 0) -> str:
    return await cli(uri, "exec", "-r", str(rank), "--", KVBROKER, *args, rc=rc)


def make_tree(top: Path) -> None:
    """Every kind of thing an archive holds."""
    top.mkdir()
    (top / "big").write_bytes(os.urandom(200_000))  # 4 chunks of 64k
    (top / "text").write_text("hello, w\u00f6rld\n")
    (top / "binary").write_bytes(b"\0\1\2\xff" * 10)
    (top / "empty").write_bytes(b"")
    (top / "run.sh").write_text("#!/bin/sh\n")
    (top / "run.sh").chmod(0o755)
    (top / "private").write_text("p")
    (top / "private").chmod(0o600)
    (top / "emptydir").mkdir()
    (top / "sub" / "deeper").mkdir(parents=True)
    (top / "sub" / "deeper" / "leaf").write_text("leaf")
    (top / "sub").chmod(0o750)
    (top / "link").symlink_to("text")
    (top / "dangling").symlink_to("/no/such/target")
    with open(top / "sparse", "wb") as f:
        f.truncate(16 << 20)
        f.seek(8 << 20)
        f.write(os.urandom(100_000))
    for path in top.rglob("*"):
        os.utime(path, (MTIME, MTIME), follow_symlinks=False)
    os.utime(top / "sub", (MTIME, MTIME))


def assert_same_tree(src: Path, dst: Path) -> None:
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*"))
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == names
    for name in names:
        a, b = os.lstat(src / name), os.lstat(dst / name)
        assert stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode), name
        assert int(b.st_mtime) == int(a.st_mtime), name
        if stat.S_ISLNK(a.st_mode):
            assert os.readlink(dst / name) == os.readlink(src / name)
            continue
        assert stat.S_IMODE(b.st_mode) == stat.S_IMODE(a.st_mode), name
        if stat.S_ISREG(a.st_mode):
            assert (dst / name).read_bytes() == (src / name).read_bytes(), name


async def test_create_on_rank_0_extract_on_rank_3(uri: str, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    make_tree(src)
    dst.mkdir()
    out = await on_rank(uri, 0, "archive", "create", "-n", "whole", "-C", str(src),
                        "--chunksize", "64k", ".")
    assert out == ""
    stored = json.loads(await cli(uri, "kvs", "get", "archive.whole"))
    by_path = {o["path"]: o for o in stored}
    assert [o["path"] for o in stored][:4] == ["big", "binary", "dangling", "empty"]
    assert by_path["text"]["encoding"] == "utf-8"
    assert by_path["binary"]["encoding"] == "base64"
    assert "encoding" not in by_path["empty"] and by_path["empty"]["size"] == 0
    assert by_path["emptydir"]["mode"] == stat.S_IFDIR | 0o755
    big = by_path["big"]
    assert big["encoding"] == "blobvec" and [e[:2] for e in big["data"]] == [
        [0, 65536], [65536, 65536], [131072, 65536], [196608, 3392]]
    sparse = by_path["sparse"]
    assert sparse["size"] == 16 << 20
    assert sum(e[1] for e in sparse["data"]) < 1 << 20, "the holes are not stored"
    out = await on_rank(uri, 3, "archive", "extract", "-n", "whole", "--waitcreate",
                        "-C", str(dst))
    assert out == ""
    assert_same_tree(src, dst)
    st = os.stat(dst / "sparse")
    assert st.st_blocks * 512 < 1 << 20, "extracted sparse: its holes are holes"


async def test_verbose_names_files_on_stderr(uri: str, tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")
    (tmp_path / "d").mkdir()
    code, out, err = await run_cli("archive", "create", "-n", "verbose", "-v", "-C",
                                   str(tmp_path), "a", "d", uri=uri)
    assert (code, out, err) == (0, "", "a\nd\n")
    dst = tmp_path / "x"
    dst.mkdir()
    code, out, err = await run_cli("archive", "extract", "-n", "verbose", "-v", "-C", str(dst),
                                   uri=uri)
    assert (code, out, err) == (0, "", "a\nd\n")
    out = await cli(uri, "archive", "extract", "-n", "verbose", "-t", "-v")
    assert out == "f 0644        1 a\nd 0755        0 d\n"


async def test_threshold_and_chunksize(uri: str, tmp_path: Path) -> None:
    (tmp_path / "tiny").write_bytes(b"x")
    (tmp_path / "four").write_bytes(b"y" * 4096)
    await cli(uri, "archive", "create", "-n", "thr0", "--small-file-threshold", "0",
              "--chunksize", "1.5k", "-C", str(tmp_path), "tiny", "four")
    objs = json.loads(await cli(uri, "kvs", "get", "archive.thr0"))
    assert [o["encoding"] for o in objs] == ["blobvec", "blobvec"]
    assert [e[1] for e in objs[1]["data"]] == [1536, 1536, 1024]
    await cli(uri, "archive", "create", "-n", "thr4k", "--small-file-threshold", "4K",
              "-C", str(tmp_path), "four")
    assert json.loads(await cli(uri, "kvs", "get", "archive.thr4k"))[0]["encoding"] == "utf-8"
    dst = tmp_path / "dst"
    dst.mkdir()
    await on_rank(uri, 2, "archive", "extract", "--waitcreate", "-n", "thr0", "-C", str(dst))
    assert (dst / "four").read_bytes() == b"y" * 4096 and (dst / "tiny").read_bytes() == b"x"
    err = await cli(uri, "archive", "create", "-n", "thr", "--chunksize", "2M3", "x", rc=2)
    assert "not a size: '2M3'" in err


async def test_a_path_met_twice_is_archived_once_and_old_dates_kept(uri: str,
                                                                   tmp_path: Path) -> None:
    """A path given twice ("old" and "./old", or "d1" then "d1/d2", which d1
    has) is one entry: twice, every extract failed on the second ("File
    exists").  A file dated before 1970 keeps its date: its negative mtime
    was stored, then refused by every list and extract of the archive."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "d1" / "d2").mkdir(parents=True)
    (src / "d1" / "d2" / "f").write_text("f")
    (src / "old").write_text("x")
    os.utime(src / "old", (-315619200, -315619200))  # 1960-01-01
    dst.mkdir()
    await cli(uri, "archive", "create", "-n", "twice", "-C", str(src), "old", "./old", "d1",
              "d1/d2")
    assert (await cli(uri, "archive", "list", "-n", "twice")).split() == [
        "old", "d1", "d1/d2", "d1/d2/f"]
    await cli(uri, "archive", "extract", "-n", "twice", "-C", str(dst))
    assert int(os.stat(dst / "old").st_mtime) == -315619200
    assert (dst / "d1" / "d2" / "f").read_text() == "f"


async def test_chunksize_0_names_the_file_too_big_for_one_blob(uri: str,
                                                               tmp_path: Path) -> None:
    limit = int(await cli(uri, "attr", "get", "content.blob-size-limit"))
    with open(tmp_path / "huge", "wb") as f:
        f.truncate(limit + 1)  # (sparse: no disk)
    err = await cli(uri, "archive", "create", "-n", "huge", "--chunksize", "0", "-C",
                    str(tmp_path), "huge", rc=1)
    assert err == (f"kvbroker: archive create: --chunksize 0: huge ({limit + 1} bytes) "
                   f"would be one blob, over content.blob-size-limit ({limit}): give a "
                   f"--chunksize of at most {limit}\n")


async def test_list_patterns_long_and_raw(uri: str, tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "one.txt").write_text("1")
    (tmp_path / "two.txt").write_text("22")
    (tmp_path / "three.dat").write_text("333")
    await cli(uri, "archive", "create", "-n", "pat", "-C", str(tmp_path), "d", "two.txt",
              "three.dat")
    assert await cli(uri, "archive", "list", "-n", "pat") == "d\nd/one.txt\ntwo.txt\nthree.dat\n"
    # fnmatch(3) without flags, as Flux's: * matches / too
    assert await cli(uri, "archive", "list", "-n", "pat", "*.txt") == "d/one.txt\ntwo.txt\n"
    assert await cli(uri, "archive", "list", "-n", "pat", "-l", "t*") == (
        "f 0644        2 two.txt\nf 0644        3 three.dat\n")
    raw = await cli(uri, "archive", "list", "-n", "pat", "--raw", "two.txt")
    assert json.loads(raw)["data"] == "22" and raw.count("\n") == 1
    code, out, err = await run_cli("archive", "list", "-n", "pat", "nomatch", uri=uri)
    assert (code, out, err) == (0, "", "kvbroker: archive list: no files matched pattern "
                                       "'nomatch'\n")
    dst = tmp_path / "dst"
    dst.mkdir()
    await cli(uri, "archive", "extract", "-n", "pat", "-C", str(dst), "d/one.txt")
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == ["d", "d/one.txt"]


async def test_append_overwrite_preserve_remove(uri: str, tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        (tmp_path / name).write_bytes(os.urandom(3000))
    key = "archive.app"
    await cli(uri, "archive", "create", "-n", "app", "--preserve", "-C", str(tmp_path), "a")
    err = await cli(uri, "archive", "create", "-n", "app", "-C", str(tmp_path), "b", rc=1)
    assert err == ("kvbroker: archive create: archive.app: key exists (give --overwrite to "
                   "replace it, or --append to add to it)\n")
    refs_a = {e[2] for e in json.loads(await cli(uri, "kvs", "get", key))[0]["data"]}
    assert set((await cli(uri, "kvs", "ls", "-1", f"{key}_blobs")).split()) == refs_a
    # --append: added (b), and a path the archive has replaced (a, changed);
    # the archive was preserved, so the new blobs are too
    (tmp_path / "a").write_bytes(os.urandom(2000))
    await cli(uri, "archive", "create", "-n", "app", "--append", "-C", str(tmp_path), "b", "a")
    objs = json.loads(await cli(uri, "kvs", "get", key))
    assert [o["path"] for o in objs] == ["b", "a"]
    live = {e[2] for o in objs for e in o["data"]}
    assert set((await cli(uri, "kvs", "ls", "-1", f"{key}_blobs")).split()) == live
    assert not refs_a & live
    # --overwrite: replaced whole; without --preserve, no _blobs any more
    await cli(uri, "archive", "create", "-n", "app", "--overwrite", "-C", str(tmp_path), "c")
    assert [o["path"] for o in json.loads(await cli(uri, "kvs", "get", key))] == ["c"]
    await cli(uri, "kvs", "get", f"{key}_blobs", rc=1)
    dst = tmp_path / "dst"
    dst.mkdir()
    await cli(uri, "archive", "extract", "-n", "app", "-C", str(dst))
    assert (dst / "c").read_bytes() == (tmp_path / "c").read_bytes()
    # existing files: an error, unless --overwrite
    err = await cli(uri, "archive", "extract", "-n", "app", "-C", str(dst), rc=1)
    assert err == ("kvbroker: archive extract: c: File exists (give --overwrite to replace "
                   "it)\n")
    (dst / "c").write_text("stale")
    await cli(uri, "archive", "extract", "-n", "app", "-C", str(dst), "--overwrite")
    assert (dst / "c").read_bytes() == (tmp_path / "c").read_bytes()
    # --append to an archive that does not exist creates it
    await cli(uri, "archive", "create", "-n", "app2", "--append", "-C", str(tmp_path), "a")
    for name in ("app", "app2"):
        await cli(uri, "archive", "remove", "-n", name)
    await cli(uri, "kvs", "get", key, rc=1)
    err = await cli(uri, "archive", "remove", "-n", "app", rc=1)
    assert err == "kvbroker: archive remove: archive.app does not exist\n"
    await cli(uri, "archive", "remove", "-n", "app", "-f")


async def test_create_refuses_and_commits_nothing(uri: str, tmp_path: Path) -> None:
    (tmp_path / "ok").write_bytes(os.urandom(5000))
    os.mkfifo(tmp_path / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for args, why in [
            (["ok", "fifo"], "fifo: unsupported file type (a FIFO: only regular files, "
                             "directories and symbolic links are archived)"),
            (["ok", "sock"], "sock: unsupported file type (a socket"),
            (["."], "./fifo: unsupported file type"),
            (["ok", "missing"], "missing: No such file or directory"),
            (["../x"], "../x: a path with '..' cannot be extracted"),
        ]:
            err = await cli(uri, "archive", "create", "-n", "bad", "-C", str(tmp_path), *args,
                            rc=1)
            assert err.startswith(f"kvbroker: archive create: {why}"), err
    finally:
        sock.close()
    await cli(uri, "kvs", "get", "archive.bad", rc=1)
    err = await cli(uri, "archive", "create", "-n", "bad", "-C", str(tmp_path / "no"), "x",
                    rc=1)
    assert err == f"kvbroker: archive create: {tmp_path}/no: No such file or directory\n"
    err = await cli(uri, "archive", "create", "--mmap", "x", rc=1)
    assert "--mmap is not built in kvbroker" in err
    await cli(uri, "archive", "create", "x", "--overwrite", "--append", rc=2)
    for name in ("..", ".", "a..b", ".a", "a."):  # (".." wrote the key "archive" itself)
        err = await cli(uri, "archive", "create", "-n", name, "x", rc=2)
        assert f"--name {name}: an empty part" in err, err
    await cli(uri, "archive", "create", rc=2)


async def test_extract_errors_and_waitcreate(uri: str, tmp_path: Path) -> None:
    err = await cli(uri, "archive", "extract", "-n", "never", rc=1)
    assert err == ("kvbroker: archive extract: archive.never: No such file or directory\n")
    err = await cli(uri, "archive", "extract", "-n", "never", "--waitcreate=0.2s", rc=1)
    assert err == ("kvbroker: archive extract: archive.never: not created within 0.2s "
                   "(namespace primary)\n")
    err = await cli(uri, "archive", "extract", "-C", str(tmp_path / "nodir"), rc=1)
    assert err == f"kvbroker: archive extract: {tmp_path}/nodir: No such file or directory\n"
    await cli(uri, "kvs", "put", "archive.notjson=hello")
    err = await cli(uri, "archive", "list", "-n", "notjson", rc=1)
    assert "archive.notjson: not an RFC 37 archive" in err
    # --waitcreate: an extract started before the archive exists gets it
    (tmp_path / "late").write_text("late")
    dst = tmp_path / "dst"
    dst.mkdir()
    waiting = asyncio.ensure_future(on_rank(uri, 3, "archive", "extract", "-n", "late",
                                            "--waitcreate=1m", "-C", str(dst)))
    await cli(uri, "archive", "create", "-n", "late", "-C", str(tmp_path), "late")
    await asyncio.wait_for(waiting, T)
    assert (dst / "late").read_text() == "late"


def put_archive(objs: list[dict[str, Any]]) -> str:
    return json.dumps(objs)


async def test_a_hostile_archive_stays_in_its_directory(uri: str, tmp_path: Path) -> None:
    """An archive put straight into the KVS: absolute paths and ``..`` are
    refused before anything is written; a link it makes (to outside) is
    not followed by a later path; a chunk that cannot be loaded names its
    file, which is not left half written."""
    dst, outside = tmp_path / "dst", tmp_path / "outside"
    dst.mkdir()
    outside.mkdir()
    f = {"mode": 0o100644, "mtime": MTIME, "encoding": "utf-8", "data": "pwned", "size": 5}
    for bad, why in [
        ({**f, "path": f"{outside}/abs"}, "refusing an absolute path"),
        ({**f, "path": "a/../../outside/dots"}, "refusing a path with a '..' component"),
    ]:
        evil = [{**f, "path": "first"}, bad]
        await cli(uri, "kvs", "put", f"archive.evil={put_archive(evil)}")
        err = await cli(uri, "archive", "extract", "-n", "evil", "-C", str(dst), rc=1)
        assert why in err and err.endswith("nothing was extracted\n"), err
        assert list(dst.iterdir()) == []
    evil = [{"path": "esc", "mode": 0o120777, "data": str(outside)},
            {**f, "path": "esc/victim"}]
    await cli(uri, "kvs", "put", f"archive.evil={put_archive(evil)}")
    err = await cli(uri, "archive", "extract", "-n", "evil", "-C", str(dst), rc=1)
    assert err == ("kvbroker: archive extract: esc/victim: esc is a symbolic link: not "
                   "followed (it could lead outside the directory)\n")
    assert list(outside.iterdir()) == []
    missing = "sha256-" + "ab" * 32
    evil = [{**f, "path": "half", "encoding": "blobvec", "size": 8,
             "data": [[0, 4, missing], [4, 4, missing]]}]
    await cli(uri, "kvs", "put", f"archive.evil={put_archive(evil)}")
    err = await cli(uri, "archive", "extract", "-n", "evil", "-C", str(dst), rc=1)
    assert err == (f"kvbroker: archive extract: half: cannot load offset=0 size=4 from "
                   f"{missing}: No such file or directory (its blobs were collected? archive "
                   "create --preserve keeps them)\n")
    assert not (dst / "half").exists()


async def test_no_force_primary_uses_the_default_namespace(uri: str, tmp_path: Path) -> None:
    (tmp_path / "mine").write_bytes(os.urandom(3000))
    await cli(uri, "kvs", "namespace", "create", "arch-ns")
    env = dict(os.environ, KVBROKER_NAMESPACE="arch-ns")
    await cli(uri, "archive", "create", "-n", "nsd", "--no-force-primary", "-C", str(tmp_path),
              "mine", env=env)
    await cli(uri, "archive", "list", "-n", "nsd", rc=1, env=env)  # (primary: not there)
    assert await cli(uri, "archive", "list", "-n", "nsd", "--no-force-primary",
                     env=env) == "mine\n"
    await cli(uri, "kvs", "get", "-N", "arch-ns", "archive.nsd")
    dst = tmp_path / "dst"
    dst.mkdir()
    await cli(uri, "archive", "extract", "-n", "nsd", "--no-force-primary", "-C", str(dst),
              env=env)
    assert (dst / "mine").read_bytes() == (tmp_path / "mine").read_bytes()
    await cli(uri, "archive", "remove", "-n", "nsd", "--no-force-primary", env=env)
    await cli(uri, "kvs", "get", "-N", "arch-ns", "archive.nsd", rc=1)


async def test_guests(uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The primary namespace is the owner's: a guest's create there fails
    with the KVS's EPERM.  In a namespace of its own a guest archives
    small files; larger ones need the content store, the owner's."""
    guest = functools.partial(run_guest_cli, uri, preload=PRELOAD)
    rc, out, err = await guest("archive", "create", "-C", "/etc", "passwd")
    assert rc == 1 and "Operation not permitted" in err, err
    await cli(uri, "kvs", "get", "archive.main", rc=1)
    await cli(uri, "kvs", "namespace", "create", "-o", str(GUEST_UID), "guest-ns")
    monkeypatch.setenv("KVBROKER_NAMESPACE", "guest-ns")
    rc, out, err = await guest("archive", "create", "--no-force-primary",
                                       "--small-file-threshold", "1M", "-C", "/etc", "passwd")
    assert (rc, err) == (0, ""), err
    rc, out, err = await guest("archive", "list", "--no-force-primary")
    assert (rc, out) == (0, "passwd\n"), err
    rc, out, err = await guest("archive", "create", "--no-force-primary",
                                       "-n", "big", "--small-file-threshold", "0", "-C",
                                       "/etc", "passwd")
    assert rc == 1 and err == ("kvbroker: archive create: storing file data in the content "
                               "store: Operation not permitted (content.store is for the "
                               "instance owner)\n"), err


async def test_preserve_survives_garbage_collection(start_instance, tmp_path: Path) -> None:
    """``kvs gc`` keeps what the KVS tree reaches: the blobs of an archive
    made without --preserve (the archive's value names them only as
    text) are collected, those of one made with it are kept."""
    inst = await start_instance(size=2, attrs={"kvs.gc-grace": "0"})
    u = inst.uri(0)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    (src / "plain").write_bytes(os.urandom(5000))
    (src / "kept").write_bytes(os.urandom(5000))
    await cli(u, "archive", "create", "-n", "plain", "-C", str(src), "plain")
    await cli(u, "archive", "create", "-n", "kept", "--preserve", "-C", str(src), "kept")
    await cli(u, "kvs", "put", "later=1")  # (the last store before a collection stays young)
    await cli(u, "kvs", "gc")
    err = await cli(u, "archive", "extract", "-n", "plain", "-C", str(dst), rc=1)
    assert "plain: cannot load offset=0 size=5000" in err and "No such file" in err, err
    await cli(inst.uri(1), "archive", "extract", "-n", "kept", "-C", str(dst))
    assert (dst / "kept").read_bytes() == (src / "kept").read_bytes()
    await cli(u, "kvs", "put", "later=2")
    await cli(u, "kvs", "gc")
    await cli(u, "archive", "extract", "-n", "kept", "-C", str(dst), "--overwrite")
    assert (dst / "kept").read_bytes() == (src / "kept").read_bytes()


async def test_a_preserved_archive_extracts_after_dump_and_restore(start_instance,
                                                                   tmp_path: Path) -> None:
    """``kvs dump``/``kvs restore`` carry ``NAME_blobs``' valrefs as values,
    and a restore stores one of at most 64 bytes inside its directory: a
    file's tail just past a chunk boundary was then no blob at all in the
    new instance, and its extract failed.  Extract now takes such a blob's
    bytes from ``NAME_blobs`` (its hash checked); the same file archived
    without --preserve still says its tail is missing."""
    old, new = await start_instance(size=1), await start_instance(size=1)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    data = os.urandom(2 * 1024 + 10)  # two chunks and a 10-byte tail
    (src / "f").write_bytes(data)
    for name, extra in (("kept", ["--preserve"]), ("plain", [])):
        await cli(old.uri(0), "archive", "create", "-n", name, *extra, "--chunksize", "1024",
                  "--small-file-threshold", "0", "-C", str(src), "f")
    tarball = str(tmp_path / "archive.tar")
    await cli(old.uri(0), "kvs", "dump", "--key", "archive", tarball)
    await cli(new.uri(0), "kvs", "restore", "--key", "archive", tarball)
    hash_name = (await cli(new.uri(0), "attr", "get", "content.hash")).strip()
    tail = hash_blob(data[2048:], hash_name)
    assert "valref" not in await cli(new.uri(0), "kvs", "get", "--treeobj",
                                     f"archive.kept_blobs.{tail}")
    await cli(new.uri(0), "archive", "extract", "-n", "kept", "-C", str(dst))
    assert (dst / "f").read_bytes() == data
    # the same file without --preserve: its two chunks are the blobs the
    # other's restore stored, and its tail is nowhere
    err = await cli(new.uri(0), "archive", "extract", "-n", "plain", "-C", str(tmp_path), rc=1)
    assert f"f: cannot load offset=2048 size=10 from {tail}: No such file" in err, err
