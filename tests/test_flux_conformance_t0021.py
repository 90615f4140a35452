"""flux-core t/t0021-archive-cmd.t (``flux archive``) against real kvbroker
ranks: ``kvbroker archive`` (docs/cli.md "archive") on a 2-rank instance,
as Flux's ``test_under_flux 2``, with the umask at 022 as Flux's test sets
it (the files' modes are set here explicitly).

Flux's cases, and what each becomes:

* create --badopt prints "unrecognized option"; create with no PATHs
  fails; create --overwrite --append fails -> usage errors, exit 2
  (``unrecognized arguments: --badopt``, argparse's words, once a PATH is
  given: without one argparse names the missing PATH first)
  (:func:`test_usage_and_early_errors`).
* create with a bad FLUX_URI fails -> ``KVBROKER_URI=local:///noexist``,
  exit 1 naming the URI (same test).
* create -C baddir fails; create of a FIFO fails -> exit 1, naming the
  directory, the FIFO (same test).
* remove fails if the archive does not exist; works with -f (same test).
* create (small file, ``--small-file-threshold=1K -v``): archive.main holds
  a base64-encoded file; create fails if the archive exists; create
  --overwrite --preserve (a 2048-byte file): a blobvec-encoded file, and
  archive.main_blobs exists (``kvs ls``); create --append (a directory)
  adds an entry; list prints ``testfile2``, ``testdir``; list -l prints
  ``f 0644     2048 testfile2``, ``d 0755        0 testdir``; list with a
  matching and a non-matching pattern works; extract -C baddir fails;
  extract -n main -v -C gooddir works, testfile2 faithful, testdir a
  directory; extract with a non-matching / a matching pattern works;
  remove works and both KVS keys are gone; list and extract of a
  nonexistent archive fail (``-n noexist`` too) ->
  :func:`test_create_list_extract_remove`, case by case.  ``-v`` names
  the files on stderr (Flux's create prints them on stdout, though its
  manual says stderr).
* create an archive, then access it from a job (``flux run -N2 flux
  archive list``) -> kvbroker has no jobs: ``exec -r all kvbroker archive
  list`` reads the primary namespace's archive on every rank
  (:func:`test_primary_from_every_rank_and_a_private_namespace`).
* the archive cannot be accessed from a job with --no-force-primary ->
  the job's namespace is ``$KVBROKER_NAMESPACE`` here (a namespace made
  with ``kvs namespace create``): ``list --no-force-primary`` there fails
  (same test).
* copy a private archive from rank 0 to rank 1 of a job (the consumer
  ``extract -v --waitcreate``, the producer ``create``, both
  ``--no-force-primary -n mystuff``); the output names the private
  archive's file (``1: testfile2``), jobdir/testfile2 is faithful, and the
  archive is in the job's KVS directory (``$jobdir.guest.archive.mystuff``)
  -> the two on ranks 1 and 0 with ``exec --label-io``, the consumer
  started first; the key is ``archive.mystuff`` of that namespace (same
  test).
* remove the main archive (same test).
* example 1 of flux-archive(1) (create -C project dataset1, ``exec -r 1``
  mkdir, extract --waitcreate, rm, remove) -> as written, with ``kvbroker``
  (:func:`test_manual_example_1`).  Example 2 uses ``--mmap`` and the
  ``stage-in`` shell plugin: neither exists here (``--mmap`` is refused,
  docs/cli.md says why; there are no jobs).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, started_in_background

T = 60.0


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 2-rank instance for the module, as Flux's ``test_under_flux 2``."""
    with started_in_background(tmp_path_factory.mktemp("t0021") / "ranks.log",
                               "--size", "2") as line:
        yield line


async def flux(uri: str, cwd: Path, *args: str, rc: int = 0,
               env: dict[str, str] | None = None) -> tuple[str, str]:
    """``kvbroker ARGS`` in ``cwd``: (stdout, stderr), exit status ``rc``
    (None: any failure, as sharness's ``test_must_fail``)."""
    code, out, err = await run_cli(*args, uri=uri, cwd=cwd, timeout=T, env=env)
    if rc is None:
        assert code not in (0, 124, 126, 127) and code < 128, (args, code, out, err)
    else:
        assert code == rc, (args, code, out, err)
    return out, err


def randbytes(path: Path, n: int) -> None:
    path.write_bytes(os.urandom(n))
    path.chmod(0o644)


async def test_usage_and_early_errors(uri: str, tmp_path: Path) -> None:
    _, err = await flux(uri, tmp_path, "archive", "create", "--badopt", rc=2)
    assert "error: the following arguments are required: PATH" in err
    _, err = await flux(uri, tmp_path, "archive", "create", "--badopt", "x", rc=2)
    assert "unrecognized arguments: --badopt" in err
    await flux(uri, tmp_path, "archive", "create", rc=2)
    code, _, err = await run_cli("archive", "create", ".", uri="local:///noexist",
                                 cwd=tmp_path)
    assert code == 1 and "cannot connect to broker at KVBROKER_URI=local:///noexist" in err
    await flux(uri, tmp_path, "archive", "create", "--overwrite", "--append", ".", rc=2)
    _, err = await flux(uri, tmp_path, "archive", "create", "-C", "baddir", ".", rc=1)
    assert err == "kvbroker: archive create: baddir: No such file or directory\n"
    os.mkfifo(tmp_path / "imafifo")
    _, err = await flux(uri, tmp_path, "archive", "create", "imafifo", rc=1)
    assert "imafifo: unsupported file type (a FIFO" in err
    _, err = await flux(uri, tmp_path, "archive", "remove", rc=1)
    assert err == "kvbroker: archive remove: archive.main does not exist\n"
    await flux(uri, tmp_path, "archive", "remove", "-f")


async def test_create_list_extract_remove(uri: str, tmp_path: Path) -> None:
    d = tmp_path
    # create works (small file); archive.main contains a base64-encoded file
    randbytes(d / "testfile", 128)
    _, err = await flux(uri, d, "archive", "create", "--small-file-threshold=1K", "-v",
                        "testfile")
    assert err == "testfile\n"
    out, _ = await flux(uri, d, "kvs", "get", "archive.main")
    assert json.loads(out)[0]["encoding"] == "base64"
    # create fails if the archive exists
    await flux(uri, d, "archive", "create", "testfile", rc=1)
    # --overwrite works (large file): blobvec, and archive.main_blobs (--preserve)
    randbytes(d / "testfile2", 2048)
    await flux(uri, d, "archive", "create", "--overwrite", "--preserve",
               "--small-file-threshold=1K", "-v", "testfile2")
    out, _ = await flux(uri, d, "kvs", "get", "archive.main")
    assert json.loads(out)[0]["encoding"] == "blobvec"
    await flux(uri, d, "kvs", "ls", "archive.main_blobs")
    # --append works (directory), and added an entry
    (d / "testdir").mkdir(mode=0o755)
    (d / "testdir").chmod(0o755)
    await flux(uri, d, "archive", "create", "--append", "testdir")
    out, _ = await flux(uri, d, "kvs", "get", "archive.main")
    assert json.loads(out)[1]["path"] == "testdir"
    # list, list -l
    assert (await flux(uri, d, "archive", "list"))[0] == "testfile2\ntestdir\n"
    assert (await flux(uri, d, "archive", "list", "-l"))[0] == (
        "f 0644     2048 testfile2\nd 0755        0 testdir\n")
    # list with a matching, a non-matching pattern
    assert (await flux(uri, d, "archive", "list", "testdir"))[0] == "testdir\n"
    assert (await flux(uri, d, "archive", "list", "notinthere"))[0] == ""
    # extract -C baddir fails; -n main -C gooddir works, faithfully
    await flux(uri, d, "archive", "extract", "-C", "baddir", rc=1)
    (d / "gooddir").mkdir()
    await flux(uri, d, "archive", "extract", "-n", "main", "-v", "-C", "gooddir")
    assert (d / "gooddir" / "testfile2").read_bytes() == (d / "testfile2").read_bytes()
    assert (d / "gooddir" / "testdir").is_dir()
    # extract with a non-matching pattern (nothing to write: no conflict),
    # with a matching one
    await flux(uri, d, "archive", "extract", "nomatch")
    (d / "gooddir2").mkdir()
    await flux(uri, d, "archive", "extract", "-C", "gooddir2", "testfile2")
    assert (d / "gooddir2" / "testfile2").read_bytes() == (d / "testfile2").read_bytes()
    # remove works, and the KVS keys are gone
    await flux(uri, d, "archive", "remove")
    await flux(uri, d, "kvs", "ls", "archive.main_blobs", rc=None)
    await flux(uri, d, "kvs", "ls", "archive.main", rc=None)
    # list and extract fail on a nonexistent archive
    for verb in ("list", "extract"):
        await flux(uri, d, "archive", verb, rc=1)
        await flux(uri, d, "archive", verb, "-n", "noexist", rc=1)


async def test_primary_from_every_rank_and_a_private_namespace(uri: str,
                                                                tmp_path: Path) -> None:
    d = tmp_path
    randbytes(d / "testfile", 128)
    randbytes(d / "testfile2", 2048)
    # the primary namespace, by default: every rank reads it
    await flux(uri, d, "archive", "create", "testfile")
    out, _ = await flux(uri, d, "exec", "-r", "all", "--label-io", "--", KVBROKER, "archive",
                        "list")
    assert sorted(out.splitlines()) == ["0: testfile", "1: testfile"]
    # a "job's" namespace: --no-force-primary honours $KVBROKER_NAMESPACE
    await flux(uri, d, "kvs", "namespace", "create", "job-t0021")
    job = dict(os.environ, KVBROKER_NAMESPACE="job-t0021")
    await flux(uri, d, "archive", "list", "--no-force-primary", rc=1, env=job)
    # copy a private archive from rank 0 to rank 1 (the consumer first)
    (d / "jobdir").mkdir()
    opts = ["--no-force-primary", "-n", "mystuff"]
    consumer = asyncio.ensure_future(flux(
        uri, d, "exec", "-r", "1", "--label-io", "--", KVBROKER, "archive", "extract", "-v",
        "--waitcreate", *opts, "-C", "jobdir", env=job))
    await flux(uri, d, "exec", "-r", "0", "--", KVBROKER, "archive", "create", *opts,
               "testfile2", env=job)
    _, err = await asyncio.wait_for(consumer, T)
    # the private archive's file, not primary's testfile
    assert err == "1: testfile2\n", err
    assert (d / "jobdir" / "testfile2").read_bytes() == (d / "testfile2").read_bytes()
    await flux(uri, d, "kvs", "get", "-N", "job-t0021", "archive.mystuff")
    await flux(uri, d, "archive", "remove")


async def test_manual_example_1(uri: str, tmp_path: Path) -> None:
    d = tmp_path
    (d / "project" / "dataset1").mkdir(parents=True)
    (d / "project" / "dataset1" / "testfile").write_text("foo\n")
    (d / "project" / "dataset1" / "testfile2").write_text("bar\n")
    await flux(uri, d, "archive", "create", "-C", "project", "dataset1")
    where = str(d / "tmp.project")
    await flux(uri, d, "exec", "-r", "1", "mkdir", "-p", where)
    await flux(uri, d, "exec", "-r", "1", KVBROKER, "archive", "extract", "--waitcreate",
               "-C", where)
    assert (d / "tmp.project" / "dataset1" / "testfile2").read_text() == "bar\n"
    await flux(uri, d, "exec", "-r", "1", "rm", "-r", where)
    await flux(uri, d, "archive", "remove")
