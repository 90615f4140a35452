"""flux-core t/t0036-broker-rundir.t: the run directory and the statedir.

Flux gives every instance a temporary ``rundir`` (in ``$TMPDIR`` or /tmp)
and a temporary ``statedir`` (in ``$TMPDIR`` or /var/tmp), each removed at
the stop unless ``-S rundir-cleanup=0`` / ``-S statedir-cleanup=0``; one
given with ``-S rundir=DIR`` stays unless it was made by the start.
kvbroker (docs/cli.md, ``start``: ``--rundir``, ``--statedir``, ``-S``)
does the same for the run directory -- ``-S rundir=DIR`` is ``--rundir DIR``,
``-S rundir-cleanup=0|1`` keeps or removes it whoever made it, and one that
was there stays, emptied of what the start wrote -- but has a statedir only
when given one, which is never removed, and refuses ``-S
statedir-cleanup``.  Both must be the owner's and not writable by group or
others.  Each case runs ``kvbroker start`` (or ``kvbroker broker``) as a
real process; Flux's ``checkattrs.sh`` is a ``sh -c`` reading the
attributes.

Flux case -> here (the loop's cases, for ``rundir`` then ``statedir``):

rundir
  1.-3. defaults; ``rundir-cleanup`` is 1; the rundir was cleaned up -> a
      new ``/tmp/kvb-*`` directory, gone after the stop.  DIFFERENCE:
      ``rundir-cleanup`` is taken with ``-S`` but is not an attribute
      (``attr get rundir-cleanup``: unknown attribute, exit 1; docs/cli.md
      lists the attributes a rank has).
  4.-5. ``-S rundir-cleanup=0``: not cleaned up -> kept, emptied.
  6.-8. ``-S rundir=DIR`` (existing): the attribute is DIR; not cleaned up
      -> the same; kept, emptied (with the tcp transport too: its key file
      goes).
  9.-10. ``-S rundir-cleanup=1`` overrides -> removed, with what it held
      (documented, as Flux's).
  11.-14. DIR created if missing, then cleaned up; ``rundir-cleanup=0``
      keeps it -> the same.
  15. ``rundir`` and ``rundir-cleanup`` cannot be set at runtime -> ``attr
      set`` fails (exit 1) for both.
  16.-18. ``-S rundir=DIR`` with DIR mode 1777 uses a new DIR/subdir ->
      DIFFERENCE (documented): refused, exit 2 (writable by others), and
      nothing is made in it.  The refusal says what it is (``mode 1777: a
      shared, sticky directory, as /tmp``) and advises a private directory
      in it, not ``chmod go-w`` (it read ``mode 777; chmod go-w``).
statedir
  1.-3. defaults (a temporary statedir, cleaned up) -> DIFFERENCE
      (documented): no statedir unless given; the attribute is empty.
  4.-5., 9.-10., 13.-14. ``-S statedir-cleanup=0|1`` -> refused, exit 2
      (documented: there is no temporary statedir to keep).
  6.-8. ``-S statedir=DIR``: the attribute is DIR; it stays (holding the
      content store).
  11.-12. DIR created if missing, cleaned up -> created; DIFFERENCE
      (documented): kept, "never deleted".
  15. cannot be set at runtime -> ``attr set statedir`` fails.
  16.-18. sticky DIR -> refused, exit 2, as the rundir.
after the loop
  19. rundir in /tmp, statedir in /var/tmp -> the rundir is /tmp/kvb-*;
      no default statedir.
  20. ``TMPDIR`` overrides -> the rundir is in ``$TMPDIR``.  A relative
      ``TMPDIR`` is made absolute (it gave a relative ``rundir`` and
      ``KVBROKER_URI``, which a client in another directory could not
      reach); the same through ``kvbroker broker``.
  21. rundir buffer overflow (a 1024-character ``TMPDIR``) fails ->
      DIFFERENCE (documented): a ``$TMPDIR`` too long for the ranks'
      sockets (over 69 characters) is not used: the rundir is made in /tmp
      (it starts, exit 0) and a warning says so.  One of 61-69 characters,
      whose sockets fit (pytest's own tmp_path under xdist), is used (it
      was put aside without a word at a fixed cut of 60).
  22. nonexistent ``TMPDIR`` fails -> exit 2, ``cannot make a run
      directory in $TMPDIR /noexist: No such file or directory``; also
      ``kvbroker broker``.
  23. non-directory rundir fails -> exit 2, ``not a directory``.
  24. unwritable rundir fails -> as root, a read-only file system stands in
      for Flux's ``chmod u-w`` (root writes there anyway).  Refused before
      any rank starts, exit 2: ``rundir DIR: cannot write in it: Read-only
      file system`` (it exited 1 saying ``[Errno 30] Read-only file
      system: '.../curve.key'`` twice -- a key file the default (unix)
      transport never writes -- from the clean-up, instead of why).
Also (not in Flux's test)
  * a statedir inside (or equal to) a rundir removed by ``-S
    rundir-cleanup=1``: refused before anything starts, exit 2 (the
    statedir -- the content store and its checkpoints -- was removed with
    the rundir, though "a ``--statedir`` is never removed"); without
    ``rundir-cleanup=1`` the rundir holding it stays.
  * ``-S rundir-cleanup=1`` on a rundir given as a symlink to a directory:
    the directory it names is removed, and the link (neither was, without
    a word: rmtree refuses a symlink).
  * ``--rundir`` naming a stopped instance's statedir (``--rundir`` typed
    for ``--statedir``): refused, exit 2, naming ``--statedir``; a store
    with checkpoints is a statedir's (rank 0 took its ``content.sqlite``
    for a killed rank 0's leftover and deleted it -- the KVS and its
    checkpoints -- without a word).
  * ``start`` killed (SIGKILL): its ranks exit and a made rundir goes; a
    given one stays, "emptied of what the start wrote": with the tcp
    transport the last rank out removes the instance's CURVE secret key
    (``curve.key``) too, which only the launcher's stop removed.
kvbroker broker
  Also, as ``start``: ``-S rundir=DIR`` is ``--rundir``, ``-S
  rundir-cleanup=1`` (or the file's ``[attrs]``) removes it at the exit,
  a bad value (``maybe``) and ``-S statedir-cleanup`` are refused (until
  2026-12-05 all three were taken and did nothing: found by this file).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import pid_alive, tmpfs
from test_broker_support import KVBROKER, run_cli, wait_until

ARGS = ("-S", "broker.rc1_path=", "-S", "broker.rc3_path=")  # Flux's, taken
T = 60
CHECK = ("for a in rundir statedir; do printf '%s=%s\\n' $a \"$(kvbroker attr get $a)\"; "
         "done")


async def kvb(*args: str, cwd: str | Path | None = None,
              env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``kvbroker ARGS`` outside any instance: (status, stdout, stderr)."""
    e = dict(os.environ)
    e.pop("TMPDIR", None)  # (Flux's test unsets it too)
    e["PATH"] = f"{Path(KVBROKER).parent}:{e.get('PATH', '/usr/bin:/bin')}"
    e.update(env or {})
    return await run_cli(*args, env=e, cwd=cwd, timeout=T)


async def start(*args: str, **kw) -> tuple[int, str, str]:
    return await kvb("start", *ARGS, *args, **kw)


async def checkattrs(*opts: str, **kw) -> dict[str, str]:
    """``start OPTS -- checkattrs``: the rundir and statedir attributes."""
    rc, out, err = await start(*opts, "--", "sh", "-c", CHECK, **kw)
    assert rc == 0, err
    return dict(line.split("=", 1) for line in out.splitlines())


# -- rundir ---------------------------------------------------------------------

async def test_t0036_default_rundir_in_tmp_removed() -> None:
    """Rundir 1-3 and case 19."""
    attrs = await checkattrs()
    assert attrs["rundir"].startswith("/tmp/kvb-"), attrs
    assert attrs["statedir"] == ""
    assert not os.path.exists(attrs["rundir"])


async def test_t0036_rundir_cleanup_is_not_an_attribute(tmp_path: Path) -> None:
    # The rundir is given: rundir-cleanup=0 would keep a made one in /tmp.
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    rc, out, err = await start("-S", "rundir-cleanup=0", "-S", f"rundir={rundir}", "--",
                               KVBROKER, "attr", "get", "rundir-cleanup")
    assert (rc, out) == (1, ""), err
    assert "unknown attribute 'rundir-cleanup'" in err, err


async def test_t0036_rundir_cleanup_0_keeps_the_made_rundir() -> None:
    """Rundir 4-5."""
    attrs = await checkattrs("-S", "rundir-cleanup=0")
    rundir = Path(attrs["rundir"])
    try:
        assert rundir.is_dir() and list(rundir.iterdir()) == []
    finally:
        if rundir.is_dir():
            rundir.rmdir()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_t0036_given_rundir_stays_emptied(tmp_path: Path, transport: str) -> None:
    """Rundir 6-8."""
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    attrs = await checkattrs("-s2", "-S", f"tbon.transport={transport}", "-S",
                             f"rundir={rundir}")
    assert attrs["rundir"] == str(rundir)
    assert rundir.is_dir() and list(rundir.iterdir()) == []


async def test_t0036_rundir_cleanup_1_removes_a_given_rundir(tmp_path: Path) -> None:
    """Rundir 9-10: with what it held."""
    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    (rundir / "mine").write_text("x")
    attrs = await checkattrs("-S", f"rundir={rundir}", "-S", "rundir-cleanup=1")
    assert attrs["rundir"] == str(rundir)
    assert not rundir.exists()


async def test_t0036_rundir_cleanup_1_removes_a_symlinked_rundir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    attrs = await checkattrs("-S", f"rundir={link}", "-S", "rundir-cleanup=1")
    assert attrs["rundir"] == str(link)
    assert not real.exists() and not link.is_symlink()


@pytest.mark.parametrize(("cleanup", "stays"), [((), False), (("-S", "rundir-cleanup=0"), True)])
async def test_t0036_missing_rundir_is_made(tmp_path: Path, cleanup: tuple[str, ...],
                                            stays: bool) -> None:
    """Rundir 11-14."""
    rundir = tmp_path / "noexist"
    attrs = await checkattrs("-S", f"rundir={rundir}", *cleanup)
    assert attrs["rundir"] == str(rundir)
    assert rundir.exists() == stays
    if stays:
        assert list(rundir.iterdir()) == []


async def test_t0036_rundir_and_statedir_fixed_at_runtime() -> None:
    """Rundir and statedir 15."""
    script = ("for a in rundir rundir-cleanup statedir; do kvbroker attr set $a /x; "
              "echo $a=$?; done; kvbroker attr get rundir")
    rc, out, err = await start("--", "sh", "-c", script)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[:3] == ["rundir=1", "rundir-cleanup=1", "statedir=1"], out
    assert lines[3].startswith("/tmp/kvb-"), out
    assert "rundir may not be changed on a running rank" in err, err
    assert "statedir may not be changed on a running rank" in err, err


@pytest.mark.parametrize("attr", ["rundir", "statedir"])
async def test_t0036_sticky_dir_refused(tmp_path: Path, attr: str) -> None:
    """Rundir and statedir 16-18: refused, nothing made."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    rc, out, err = await start("-S", f"{attr}={shared}", "--", "true")
    assert (rc, out) == (2, ""), err
    assert f"{attr} {shared}: writable by group or others" in err, err
    assert list(shared.iterdir()) == []


async def test_t0036_sticky_dir_refusal_says_what_it_is(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    rc, _, err = await start("-S", f"rundir={shared}", "--", "true")
    assert rc == 2
    assert "1777" in err and "chmod go-w" not in err, err


# -- statedir ---------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "1"])
async def test_t0036_statedir_cleanup_refused(tmp_path: Path, value: str) -> None:
    """Statedir 4-5, 9-10, 13-14."""
    rc, out, err = await start("-S", f"statedir={tmp_path / 'sd'}", "-S",
                               f"statedir-cleanup={value}", "--", "true")
    assert (rc, out) == (2, ""), err
    assert "-S statedir-cleanup: " in err, err
    assert not (tmp_path / "sd").exists()


@pytest.mark.parametrize("exists", [True, False])
async def test_t0036_given_statedir_is_kept(tmp_path: Path, exists: bool) -> None:
    """Statedir 6-8 and 11-12 (a made one kept too: a difference)."""
    statedir = tmp_path / "sd"
    if exists:
        statedir.mkdir(mode=0o700)
    attrs = await checkattrs("-S", f"statedir={statedir}")
    assert attrs["statedir"] == str(statedir)
    assert (statedir / "content.sqlite").is_file()


# -- TMPDIR and refusals --------------------------------------------------------------

@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A new directory in /tmp with a short name (pytest's tmp_path may be
    longer than the 60 characters kvbroker takes from ``$TMPDIR``)."""
    path = Path(tempfile.mkdtemp(prefix="t0036-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_t0036_tmpdir_overrides(short_tmp: Path) -> None:
    """Case 20."""
    attrs = await checkattrs(env={"TMPDIR": str(short_tmp)})
    assert Path(attrs["rundir"]).parent == short_tmp, attrs
    assert list(short_tmp.iterdir()) == []


async def test_t0036_tmpdir_of_65_characters_is_used(short_tmp: Path) -> None:
    tmpdir = short_tmp / ("d" * (65 - len(str(short_tmp)) - 1))
    tmpdir.mkdir()
    assert len(str(tmpdir)) == 65
    attrs = await checkattrs("-s2", env={"TMPDIR": str(tmpdir)})
    assert Path(attrs["rundir"]).parent == tmpdir, attrs


@pytest.mark.parametrize("how", ["start", "broker"])
async def test_t0036_relative_tmpdir_gives_an_absolute_rundir(short_tmp: Path,
                                                              how: str) -> None:
    # (in a short directory: made absolute, pytest's tmp_path is too long for
    # the sockets under xdist, and the rundir would be made in /tmp)
    (short_tmp / "rel").mkdir()
    script = "cd / && kvbroker attr get rundir"
    if how == "start":
        rc, out, err = await start("--", "sh", "-c", script, cwd=short_tmp,
                                   env={"TMPDIR": "rel"})
    else:
        (short_tmp / "one.toml").write_text("[bootstrap]\n")
        rc, out, err = await kvb("broker", "-c", "one.toml", "--", "sh", "-c", script,
                                 cwd=short_tmp, env={"TMPDIR": "rel"})
    assert rc == 0, err
    assert Path(out.strip()).parent == short_tmp / "rel", out


async def test_t0036_long_tmpdir_falls_back_to_tmp() -> None:
    """Case 21: a difference (Flux fails, saying overflow): /tmp, and a warning."""
    rc, out, err = await start("--", KVBROKER, "attr", "get", "rundir",
                               env={"TMPDIR": "/" + "D" * 1023})
    assert rc == 0, err
    assert out.startswith("/tmp/kvb-"), out
    assert err == (f"kvbroker: warning: $TMPDIR /{'D' * 1023} is too long for the ranks' "
                   "sockets (1024 bytes, at most 69 here): the run directory is made "
                   "in /tmp\n"), err


async def test_t0036_tmpdir_of_70_characters_falls_back(short_tmp: Path) -> None:
    tmpdir = short_tmp / ("d" * (70 - len(str(short_tmp)) - 1))
    tmpdir.mkdir()
    rc, out, err = await start("--", KVBROKER, "attr", "get", "rundir",
                               env={"TMPDIR": str(tmpdir)})
    assert rc == 0, err
    assert out.startswith("/tmp/kvb-") and "too long for the ranks' sockets" in err, (out, err)


async def test_t0036_tmpdir_long_in_bytes_falls_back(short_tmp: Path) -> None:
    """A socket path's limit is in bytes: a $TMPDIR of 40 ``é`` (under 69
    characters, over 69 bytes) was taken, and rank 0 failed to start
    ("AF_UNIX path too long")."""
    tmpdir = short_tmp / ("é" * 40)
    tmpdir.mkdir(mode=0o700)
    rc, out, err = await start("--", KVBROKER, "attr", "get", "rundir",
                               env={"TMPDIR": str(tmpdir)})
    assert rc == 0, err
    assert out.startswith("/tmp/kvb-") and "too long for the ranks' sockets" in err, (out, err)
    assert f"({len(os.fsencode(str(tmpdir)))} bytes, at most 69 here)" in err, err


@pytest.mark.parametrize("how", ["start", "broker"])
async def test_t0036_nonexistent_tmpdir(tmp_path: Path, how: str) -> None:
    """Case 22."""
    if how == "start":
        rc, out, err = await start("--", "true", env={"TMPDIR": "/noexist"})
    else:
        (tmp_path / "one.toml").write_text("[bootstrap]\n")
        rc, out, err = await kvb("broker", "-c", "one.toml", "--", "true", cwd=tmp_path,
                                 env={"TMPDIR": "/noexist"})
    assert (rc, out) == (2, "")
    assert err == (f"kvbroker: {how}: cannot make a run directory in $TMPDIR /noexist: "
                   "No such file or directory\n")


async def test_t0036_rundir_not_a_directory(tmp_path: Path) -> None:
    """Case 23."""
    (tmp_path / "notdir").touch()
    rc, out, err = await start("-S", "rundir=notdir", "--", "true", cwd=tmp_path)
    assert (rc, out) == (2, ""), err
    assert err == f"kvbroker: start: rundir {tmp_path / 'notdir'}: not a directory\n"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nobody can write in, root included: a read-only tmpfs."""
    yield from tmpfs(tmp_path / "ro", "ro,size=1m,mode=0700")


@pytest.mark.parametrize(("size", "transport"), [("1", "unix"), ("2", "tcp")])
async def test_t0036_unwritable_rundir_fails_gracefully(read_only_dir: Path, size: str,
                                                        transport: str) -> None:
    """Case 24."""
    rc, out, err = await start("-s", size, "-S", f"tbon.transport={transport}", "-S",
                               f"rundir={read_only_dir}", "--", "true")
    assert (rc, out) == (2, ""), err
    assert "Read-only file system" in err and "[Errno" not in err, err
    if transport == "unix":
        assert "curve.key" not in err, err
    assert err == f"kvbroker: start: rundir {read_only_dir}: cannot write in it: " \
        "Read-only file system\n"


# -- kvbroker broker ----------------------------------------------------------------

async def test_t0036_broker_rundir_attr_is_rundir(tmp_path: Path) -> None:
    (tmp_path / "one.toml").write_text("[bootstrap]\n")
    rundir = tmp_path / "brun"
    rc, out, err = await kvb("broker", "-c", "one.toml", "-S", f"rundir={rundir}", "--",
                             KVBROKER, "attr", "get", "rundir", cwd=tmp_path)
    assert (rc, out) == (0, f"{rundir}\n"), err
    assert rundir.is_dir()  # (broker: a --rundir is the operator's and stays)


@pytest.mark.parametrize("where", ["-S", "[attrs]"])
async def test_t0036_broker_rundir_cleanup_honoured_or_refused(tmp_path: Path,
                                                               where: str) -> None:
    text = "[bootstrap]\n" + ('[attrs]\n"rundir-cleanup" = 1\n' if where == "[attrs]" else "")
    (tmp_path / "one.toml").write_text(text)
    opts = ("-S", "rundir-cleanup=1") if where == "-S" else ()
    rundir = tmp_path / "brun"
    rc, out, err = await kvb("broker", "-c", "one.toml", "--rundir", str(rundir), *opts,
                             "--", "true", cwd=tmp_path)
    assert rc == 2 or (rc == 0 and not rundir.exists()), (rc, out, err)


async def test_t0036_broker_bad_rundir_cleanup_refused(tmp_path: Path) -> None:
    (tmp_path / "one.toml").write_text("[bootstrap]\n")
    rc, out, err = await kvb("broker", "-c", "one.toml", "-S", "rundir-cleanup=maybe", "--",
                             "true", cwd=tmp_path)
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "rundir-cleanup" in err, err


async def test_t0036_broker_statedir_cleanup_refused(tmp_path: Path) -> None:
    (tmp_path / "one.toml").write_text("[bootstrap]\n")
    rc, out, err = await kvb("broker", "-c", "one.toml", "-S", "statedir-cleanup=1", "--",
                             "true", cwd=tmp_path)
    assert (rc, out) == (2, ""), (rc, out, err)
    assert "statedir-cleanup" in err, err


# -- also: a statedir in the rundir, start killed --------------------------------------

@pytest.mark.parametrize("inside", [True, False])
async def test_t0036_rundir_cleanup_keeps_a_statedir_inside(tmp_path: Path,
                                                            inside: bool) -> None:
    rundir = tmp_path / "run"
    statedir = rundir / "state" if inside else rundir
    rc, out, err = await start("--rundir", str(rundir), "--statedir", str(statedir), "-S",
                               "rundir-cleanup=1", "--", KVBROKER, "kvs", "put", "a=1")
    # refused before anything starts (the statedir kept would do too)
    assert rc == 2 or (rc == 0 and (statedir / "content.sqlite").is_file()), (rc, out, err)
    where = "inside the rundir" if inside else "the rundir"
    assert f"statedir {statedir} is {where} {rundir}, which -S rundir-cleanup=1" in err, err
    assert not rundir.exists()


async def test_t0036_statedir_inside_a_rundir_is_kept(tmp_path: Path) -> None:
    """Without rundir-cleanup=1: the statedir, made first, makes the rundir
    one that was there, which stays (emptied of what the start wrote)."""
    rundir = tmp_path / "run"
    statedir = rundir / "state"
    rc, out, err = await start("--rundir", str(rundir), "--statedir", str(statedir), "--",
                               KVBROKER, "kvs", "put", "a=1")
    assert rc == 0, err
    assert sorted(p.name for p in rundir.iterdir()) == ["state"]
    assert (statedir / "content.sqlite").is_file()


async def test_t0036_rundir_on_a_statedir_keeps_its_store(tmp_path: Path) -> None:
    statedir = tmp_path / "sd"
    rc, _, err = await start("--statedir", str(statedir), "--", KVBROKER, "kvs", "put", "a=1")
    assert rc == 0 and (statedir / "content.sqlite").is_file(), err
    rc, out, err = await start("--rundir", str(statedir), "--", "true")
    assert rc == 2 or (rc == 0 and (statedir / "content.sqlite").is_file()), (rc, out, err)
    assert f"give --statedir {statedir}" in err, err
    rc, out, err = await start("--statedir", str(statedir), "--", KVBROKER, "kvs", "get", "a")
    assert (rc, out) == (0, "1\n"), err


async def killed_start(tmp_path: Path, *opts: str) -> str:
    """Start a 2-rank instance in the background, SIGKILL ``start`` once it
    is up, wait for both ranks to exit; its rundir."""
    uri_file = tmp_path / "uri"
    e = dict(os.environ)
    e.pop("KVBROKER_URI", None)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", "-s2", *opts, "--uri-file", str(uri_file), env=e,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        async def up() -> bool:
            return uri_file.exists() or proc.returncode is not None
        await wait_until(up, "the instance's URI file", T)
        assert proc.returncode is None
        uri = uri_file.read_text().strip()
        script = ("kvbroker attr get rundir; kvbroker attr get broker.pid; "
                  "kvbroker exec -r 1 -- kvbroker attr get broker.pid")
        res = await asyncio.create_subprocess_exec(
            "sh", "-c", script, env={**e, "KVBROKER_URI": uri,
                                     "PATH": f"{Path(KVBROKER).parent}:{e['PATH']}"},
            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(res.communicate(), T)
        rundir, *pids = out.decode().split()
        assert len(pids) == 2, out
    finally:
        proc.kill()
        await proc.wait()

    async def ranks_gone() -> bool:
        return not any(pid_alive(int(p)) for p in pids)
    await wait_until(ranks_gone, "the ranks to exit after start was killed", T)
    return rundir


async def test_t0036_killed_start_made_rundir_removed(tmp_path: Path) -> None:
    rundir = await killed_start(tmp_path, "-S", "tbon.transport=tcp")
    assert not os.path.exists(rundir)


async def test_t0036_killed_start_given_rundir_emptied(tmp_path: Path) -> None:
    given = tmp_path / "given"
    given.mkdir(mode=0o700)
    rundir = await killed_start(tmp_path, "-S", "tbon.transport=tcp", "--rundir", str(given))
    assert rundir == str(given)
    assert given.is_dir() and sorted(p.name for p in given.iterdir()) == []
