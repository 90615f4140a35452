"""The peripheral commands at their edges, from an adversarial audit (archive,
cron, sproc/exec --bg, groups, config, uri, dmesg/logger, startlog,
uptime, shutdown, module, stats), each a reproducer against real ranks.

They share one 4-rank instance (``kvbroker start --size 4``) and each uses
names of its own (archive names, labels), so that they do not meet.
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, started_in_background

T = 60.0


@pytest.fixture(scope="module")
def uri(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One 4-rank instance for the module, with the cron and groups modules."""
    with started_in_background(tmp_path_factory.mktemp("periph") / "ranks.log", "--size",
                               "4", "-S",
                               "broker.modules=content,kvs,kvs-watch,cron,groups") as line:
        yield line


async def cli(uri: str, *args: str, rc: int = 0) -> tuple[str, str]:
    """``kvbroker ARGS``: its stdout and stderr, once its status is ``rc``."""
    code, out, err = await run_cli(*args, uri=uri, timeout=T)
    assert code == rc, (args, code, out, err)
    return out, err


def no_traceback(err: str) -> None:
    assert "Traceback" not in err, err


# ---------------------------------------------------------------- archive


@pytest.mark.parametrize("kind", ["file", "link"])
async def test_archive_create_refuses_a_name_that_is_not_utf8(uri: str, tmp_path: Path,
                                                             kind: str) -> None:
    """A file name (or a link's target) that is not UTF-8 cannot go into
    the archive's JSON: it died with a ``TypeError`` traceback once every
    file had been read; it is refused up front, naming it, nothing stored."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_text("fine")
    if kind == "file":
        (src / os.fsdecode(b"bad\xffname")).write_text("x")
    else:
        os.symlink(os.fsdecode(b"t\xff"), src / "badlink")
    name = f"notutf8-{kind}"
    _, err = await cli(uri, "archive", "create", "-n", name, "-C", str(src), ".", rc=1)
    no_traceback(err)
    shown = "bad\\xffname: its name" if kind == "file" else "badlink: its target 't\\xff'"
    assert "is not UTF-8 text" in err and shown in err, err
    _, err = await cli(uri, "archive", "list", "-n", name, rc=1)
    assert "No such file or directory" in err, err


async def test_archive_remove_does_not_take_a_directory_of_other_archives(
        uri: str, tmp_path: Path) -> None:
    """``-n grp.one`` makes ``archive.grp`` a directory; ``archive remove -n
    grp`` unlinked that directory, and so the archive ``grp.one``, exit 0.
    Flux's looks ``archive.grp`` up as a value (a directory: "does not
    exist"); it is refused so, ``-f`` unlinking it as Flux's does."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    await cli(uri, "archive", "create", "-n", "grp.one", "-C", str(src), "f")
    _, err = await cli(uri, "archive", "remove", "-n", "grp", rc=1)
    assert "archive.grp" in err and "not an archive" in err, err
    out, _ = await cli(uri, "archive", "list", "-n", "grp.one")
    assert out == "f\n"
    await cli(uri, "archive", "remove", "-n", "grp", "-f")
    await cli(uri, "archive", "list", "-n", "grp.one", rc=1)


async def test_archive_remove_follows_a_link_as_flux_lookup_does(uri: str, tmp_path: Path) -> None:
    """``archive.NAME`` a symlink: to nothing, ``does not exist`` without
    ``-f`` (Flux's lookup follows it and finds nothing; it was unlinked,
    exit 0); to a directory, refused as the directory is; to an archive,
    removed (the link), the archive it named left in place."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    await cli(uri, "kvs", "link", "no.such.key", "archive.gone")
    _, err = await cli(uri, "archive", "remove", "-n", "gone", rc=1)
    assert err.endswith("archive.gone does not exist\n"), err
    await cli(uri, "kvs", "readlink", "archive.gone")  # still there
    await cli(uri, "archive", "remove", "-n", "gone", "-f")
    await cli(uri, "kvs", "readlink", "archive.gone", rc=1)

    await cli(uri, "archive", "create", "-n", "grp.one", "-C", str(src), "f")
    await cli(uri, "kvs", "link", "archive.grp", "archive.togrp")
    _, err = await cli(uri, "archive", "remove", "-n", "togrp", rc=1)
    assert "not an archive" in err, err

    await cli(uri, "kvs", "link", "archive.grp.one", "archive.alias")
    await cli(uri, "archive", "remove", "-n", "alias")
    await cli(uri, "kvs", "readlink", "archive.alias", rc=1)
    out, _ = await cli(uri, "archive", "list", "-n", "grp.one")
    assert out == "f\n"

    await cli(uri, "kvs", "link", "archive.loop2", "archive.loop1")
    await cli(uri, "kvs", "link", "archive.loop1", "archive.loop2")
    _, err = await cli(uri, "archive", "remove", "-n", "loop1", rc=1)
    assert "Too many levels of symbolic links" in err, err


async def run_limited(uri: str, fsize: int, *args: str) -> tuple[int, str, str]:
    """``kvbroker ARGS`` with ``RLIMIT_FSIZE`` at ``fsize`` bytes (a quota
    for one file: past it a write or ``ftruncate`` fails ``EFBIG``)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    proc = await asyncio.create_subprocess_exec(
        KVBROKER, *args, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ, KVBROKER_URI=uri),
        preexec_fn=limit)
    out, err = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("sparse", [True, False])
async def test_archive_extract_a_file_it_cannot_write_names_it_and_leaves_nothing(
        uri: str, tmp_path: Path, sparse: bool) -> None:
    """A file that cannot be written whole (past a file-size limit, a
    quota): the error named no file (``archive extract: File too
    large``), and a sparse one, whose size is set last, was left behind,
    short, mode 0600."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    with open(src / "f", "wb") as f:
        if sparse:
            f.truncate(8 << 20)  # all hole: its size is set as it is finished
        else:
            f.write(os.urandom(2 << 20))
    name = f"toolarge-{sparse}"
    await cli(uri, "archive", "create", "-n", name, "-C", str(src), "f")
    rc, out, err = await run_limited(uri, 1 << 20, "archive", "extract", "-n", name,
                                     "-C", str(dst))
    assert rc == 1, (rc, out, err)
    assert "archive extract: f: File too large" in err, err
    assert os.listdir(dst) == []


# ---------------------------------------------------------------- sproc


@pytest.mark.parametrize("fmt", ["{pid:>{width}}", "{pid:99999999999}"])
async def test_sproc_ps_format_a_spec_it_cannot_apply_is_a_usage_error(uri: str,
                                                                      fmt: str) -> None:
    """A nested field in a spec (``KeyError``) or a width too large to make
    (``MemoryError``) died with a traceback; a usage error (exit 2) now."""
    out, _ = await cli(uri, "exec", "--bg", "--label", "fmt-probe", "--", "sleep", "300")
    try:
        _, err = await cli(uri, "sproc", "ps", "-o", fmt, rc=2)
        no_traceback(err)
        assert f"--format {fmt!r}" in err, err
    finally:
        await cli(uri, "sproc", "kill", "KILL", "fmt-probe")



# ---------------------------------------------------------------- config


async def test_config_reload_of_a_fifo_refuses_it_and_the_rank_answers_on(
        tmp_path: Path) -> None:
    """The configuration file replaced by a FIFO: ``config reload`` opened
    it on the rank's event loop, which blocked there until a writer came --
    every request to the rank, ``ping`` too, waited.  A file that is not a
    regular one is refused (``EINVAL``, naming it), the rank answers on."""
    conf = tmp_path / "inst.toml"
    conf.write_text('[attrs]\n"log.level" = "info"\n')
    with started_in_background(tmp_path / "ranks.log", "--size", "2",
                               "--config", str(conf)) as line:
        conf.unlink()
        os.mkfifo(conf)
        code, out, err = await run_cli("config", "reload", "-r", "all", "-t", "10",
                                       uri=line, timeout=T)
        assert code == 1 and "not a regular file" in err and str(conf) in err, (code, err)
        await cli(line, "ping", "-c", "1", "-t", "10")


async def test_config_of_the_null_device_is_empty_and_a_device_without_end_is_refused(
        tmp_path: Path) -> None:
    """``start --config /dev/null`` (Flux's ``--config-path=/dev/null``, no
    configuration) warned at every start that rank 0 would not read a
    character device; it is read as it reads, empty, reloads too.
    ``--config /dev/zero`` filled the memory of ``start`` until it was
    killed: a file is read up to 16 MiB, and a longer one refused, as is
    ``config load`` of one."""
    log = tmp_path / "ranks.log"
    with started_in_background(log, "--config", os.devnull) as line:
        assert (await cli(line, "config", "get"))[0] == "{}\n"
        await cli(line, "config", "reload")
        _, err = await cli(line, "config", "load", "/dev/zero", rc=1)
        assert err.endswith("/dev/zero: larger than 16 MiB: not a configuration\n"), err
    assert "WARNING" not in log.read_text(), log.read_text()
    code, _, err = await run_cli("start", "--config", "/dev/zero", "--", "true", timeout=T)
    assert (code, err) == (2, "kvbroker: start: /dev/zero: larger than 16 MiB: not a "
                              "configuration file\n")


# ---------------------------------------------------------------- -t, unanswered


@pytest.mark.parametrize("command", [("config", "reload"), ("dmesg",)])
async def test_a_stopped_attached_rank_is_not_named_4294967295(uri: str,
                                                               command: tuple[str, ...]) -> None:
    """Without ``-r``, a command given ``-t`` whose attached rank does not
    answer said ``rank 4294967295 did not answer`` -- the wire's "any rank",
    not a rank -- where the others say ``no answer``."""
    pid = int((await cli(uri, "attr", "get", "-r", "3", "broker.pid"))[0])
    attached = uri.replace("local-0", "local-3")
    os.kill(pid, signal.SIGSTOP)
    try:
        code, _, err = await run_cli(*command, "-t", "0.5", uri=attached, timeout=T)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert code == 1 and "Connection timed out" in err, (code, err)
    assert "4294967295" not in err, err


# ---------------------------------------------------------------- groups


async def test_groups_waitfor_timeout_says_the_group_was_short_not_the_rank_silent(
        uri: str) -> None:
    """Rank 0 answers the watch at once (no member), but the group never
    has its 2 members: ``-t`` then said ``no answer in 1s: stopped or
    hung?``, sending the operator after a rank that is fine.  A count no
    group of the instance can reach (5 of 4 ranks) is refused at once."""
    code, _, err = await run_cli("groups", "waitfor", "-c", "2", "-t", "1", "never-joined",
                                 uri=uri, timeout=T)
    assert code == 1, (code, err)
    assert "stopped or hung" not in err, err
    assert err == ("kvbroker: groups waitfor: Connection timed out (never-joined had 0 of "
                   "the 2 members waited for (none) after 1s)\n"), err
    code, _, err = await run_cli("groups", "waitfor", "-c", "5", "-t", "1", "broker.online",
                                 uri=uri, timeout=T)
    assert (code, err) == (1, "kvbroker: groups waitfor: count 5 is more than the "
                              "instance's 4 ranks: it would wait for ever\n"), err


async def test_groups_get_watch_t_bounds_the_first_answer_only(uri: str) -> None:
    """``get -w -t 1`` printed the members, then ended at 1 s with ``no
    answer in 1s: stopped or hung?`` although rank 0 had answered: ``-t``
    bounds connecting and the first answer (as ``rpc --stream -t``), and the
    watch goes on to print a change made after it."""
    watch = await asyncio.create_subprocess_exec(
        KVBROKER, "groups", "get", "-w", "-t", "1", "late-joiners",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=dict(os.environ, KVBROKER_URI=uri))
    assert watch.stdout is not None and watch.stderr is not None
    try:
        assert await asyncio.wait_for(watch.stdout.readline(), T) == b"\n"  # (no members)
        await asyncio.sleep(1.5)  # (past the bound: what is tested, not a wait for an event)
        joined = await asyncio.create_subprocess_exec(
            KVBROKER, "groups", "join", "late-joiners", "--", "sleep", "30",
            env=dict(os.environ, KVBROKER_URI=uri))
        try:
            assert await asyncio.wait_for(watch.stdout.readline(), T) == b"0\n"
        finally:
            joined.terminate()
            await joined.wait()
    finally:
        if watch.returncode is None:
            watch.terminate()
        _, err = await asyncio.wait_for(watch.communicate(), T)
    assert b"timed out" not in err, err
