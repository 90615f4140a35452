"""Tunable attributes on real processes: bad values are refused before any
rank starts, every documented default is readable on every rank, and a rank
that fails at start-up says why in one line (docs/cli.md, "start")."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, install_plugin, run_cli

from broker.launch import Instance, StartError, make_rundir

CLI_MD = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def documented_defaults() -> dict[str, str]:
    """``{attribute: default}`` from the tunable-attributes table of docs/cli.md."""
    rows = re.findall(r"^\| `([a-z.-]+)` \| `([^`]*)`", CLI_MD.read_text(), re.M)
    assert len(rows) >= 10, rows
    return dict(rows)


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("setting, message", [
    ("log.level=bogus",
     "log.level: unknown level 'bogus' (choose from debug, info, warning, error)"),
    ("broker.max-message=abc", "broker.max-message: 'abc' is not an integer"),
    ("kvs.cache-bytes=abc", "kvs.cache-bytes: 'abc' is not an integer"),
    ("content.cache-bytes=-1", "content.cache-bytes: -1 is below the minimum of 0"),
    ("access.allow-guest-user=maybe",
     "access.allow-guest-user: 'maybe' is not a boolean (use true or false)"),
    ("content.blob-size-limit=10", "content.blob-size-limit: 10 is below the minimum of 256"),
    # a blob over SQLite's largest row was acknowledged, then failed every
    # write-back, and every commit after it, until the rank stopped
    ("content.blob-size-limit=1073741824",
     "content.blob-size-limit: 1073741824 is above the maximum of 999999000"),
    ("tbon.transport=udp", "tbon.transport: unknown transport 'udp'"),
    # a typo in a prefix the core or a module owns (was: kept and ignored)
    ("kvs.checkpoint_period=0",
     "kvs.checkpoint_period: unknown attribute (did you mean kvs.checkpoint-period?)"),
    ("log.levle=debug", "log.levle: unknown attribute (did you mean log.level?)"),
    # what a rank sets itself (was: taken and ignored, exit status 0)
    ("size=3", "size cannot be set with -S: use --size N"),
    ("broker.starttime=5", "broker.starttime cannot be set with -S: each rank sets it itself"),
])
async def test_start_refuses_a_bad_value_before_any_rank(setting: str, message: str) -> None:
    rc, out, err = await run_cli("start", "--size", "2", "-S", setting, "--",
                                 "sh", "-c", "echo the command ran", timeout=30)
    assert rc == 2, err
    assert out == ""
    line = one_line(err)  # no "kvbroker[R]: ..." line: no rank was started
    assert line.startswith(f"kvbroker: start: {message}"), line


async def test_instance_refuses_a_bad_value_without_starting_a_rank() -> None:
    inst = Instance(2, attrs={"content.blob-size-limit": "21"})
    try:
        with pytest.raises(StartError, match="^content.blob-size-limit: 21 is below"):
            await asyncio.wait_for(inst.start(), 30)
        assert inst.procs == [] and inst.rundir == ""
    finally:
        await asyncio.wait_for(inst.stop(), 30)


async def test_start_refuses_a_statedir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "afile"
    path.write_text("keep me")
    rc, out, err = await run_cli("start", "--statedir", str(path), "--", "true", timeout=30)
    assert rc == 2
    assert one_line(err) == f"kvbroker: start: statedir {path}: not a directory"
    assert path.read_text() == "keep me"
    rc, _, err = await run_cli("start", "--statedir", str(path / "sub"), "--", "true",
                               timeout=30)
    assert rc == 2
    assert one_line(err) == f"kvbroker: start: statedir {path / 'sub'}: Not a directory"


async def test_start_says_where_it_could_not_make_its_run_directory() -> None:
    """A $TMPDIR that does not exist gave "[Errno 2] No such file or
    directory: '/nonexistent/kvb-fsygu4b7'", a path nobody chose."""
    missing = f"/nonexistent-{os.getpid()}"  # (short: a long $TMPDIR is not used)
    rc, _, err = await run_cli("start", "--", "true", timeout=30,
                               env=dict(os.environ, TMPDIR=missing))
    assert rc == 2
    assert one_line(err) == (f"kvbroker: start: cannot make a run directory in $TMPDIR "
                             f"{missing}: No such file or directory")


@pytest.mark.parametrize("stamps", ["auto", "never"])
async def test_a_rank_logging_to_a_file_stamps_its_lines(start_instance, connect, tmp_path,
                                                         stamps: str) -> None:
    """Rank logs had no time: a rank logging to a file (``kvbroker broker
    2>>rank.log``; the fixture's stderr is one) now starts each line with
    the UTC time, unless ``log.timestamps=never``."""
    inst = await start_instance(size=2, attrs={"log.level": "info", "log.timestamps": stamps})
    h = await connect(inst, 0)
    await asyncio.wait_for(h.rpc("broker.shutdown", {}, nodeid=1), 10)  # rank 0 logs losing rank 1

    def logged() -> list[str]:
        return [line for line in (tmp_path / "broker-0.log").read_text().splitlines()
                if "child rank 1 stopped" in line]

    async with asyncio.timeout(10):
        while not logged():
            await asyncio.sleep(0.01)
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
    expect = (stamp if stamps == "auto" else "") + r"kvbroker\[0\]: INFO kvbroker.overlay: "
    assert re.match(expect + "child rank 1 stopped", logged()[0]), logged()


async def test_start_refuses_a_statedir_others_may_write(tmp_path: Path) -> None:
    """A statedir others can write could be given a content store or a
    checkpoint of their making: refused, as Flux refuses such a rundir."""
    path = tmp_path / "shared"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    rc, _, err = await run_cli("start", "--statedir", str(path), "--", "true", timeout=30)
    assert rc == 2
    assert one_line(err) == (f"kvbroker: start: statedir {path}: writable by group or "
                             "others (mode 777); chmod go-w, or choose another directory")
    assert list(path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory away")
@pytest.mark.parametrize("how", ["directory", "symlink", "chain"])
async def test_a_statedir_or_rundir_another_user_made_is_refused(
        tmp_path: Path, how: str) -> None:
    """Another user made the directory first (or a symlink to one of ours,
    which they could point elsewhere later): the owner's instance would
    have written its content store where they could read it, or listened
    on a socket they could replace.  ``start --statedir`` and ``broker
    --rundir/--statedir`` refuse it, naming the owner."""
    theirs = tmp_path / "theirs"
    if how == "directory":
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
    elif how == "symlink":
        (tmp_path / "ours").mkdir(mode=0o700)
        theirs.symlink_to(tmp_path / "ours")
        os.lchown(theirs, 65534, 65534)
    else:  # our link to their link to our directory: they can repoint theirs
        (tmp_path / "ours").mkdir(mode=0o700)
        (tmp_path / "middle").symlink_to(tmp_path / "ours")
        os.lchown(tmp_path / "middle", 65534, 65534)
        theirs.symlink_to(tmp_path / "middle")
    rc, _, err = await run_cli("start", "--statedir", str(theirs), "--", "true", timeout=30)
    assert rc == 2
    whose = ("owned by uid 65534" if how == "directory" else
             f"the symlink {theirs if how == 'symlink' else tmp_path / 'middle'} is owned by "
             "uid 65534")
    assert one_line(err) == (f"kvbroker: start: statedir {theirs}: {whose}, not by "
                             f"this user (uid {os.geteuid()})")
    config = tmp_path / "inst.toml"
    keys = tmp_path / "curve.key"
    rc, _, err = await run_cli("keygen", str(keys), timeout=30)
    assert rc == 0, err
    config.write_text(f'[bootstrap]\ncurve_cert = "{keys}"\n'
                      'hosts = [{ host = "h0", bind = "tcp://127.0.0.1:0", '
                      'connect = "tcp://127.0.0.1:9" }]\n')
    for option in ("--rundir", "--statedir"):
        rc, _, err = await run_cli("broker", "--config", str(config), "--rank", "0",
                                   option, str(theirs), timeout=30)
        assert rc == 2, err
        assert one_line(err) == (f"kvbroker: broker: {option} {theirs}: {whose}, "
                                 f"not by this user (uid {os.geteuid()})")


async def test_every_documented_default_is_readable_on_every_rank(
        start_instance, connect) -> None:
    defaults = documented_defaults()
    inst = await start_instance(size=3, fanout=2, attrs={"kvs.cache-bytes": "100000"})
    h = await connect(inst, 1)
    async with asyncio.timeout(20):
        for rank in (0, 2):
            names = (await h.rpc("attr.list", {}, nodeid=rank))["names"]
            for name, default in defaults.items():
                if name.startswith(("heartbeat.", "cron.")):
                    continue  # (modules loaded on demand: test_heartbeat, t0015 read them)
                expected = "100000" if name == "kvs.cache-bytes" else default
                assert await h.attr_get(name, nodeid=rank) == expected, (rank, name)
                assert name in names, (rank, name)


async def test_cli_attr_get_and_list_show_defaults() -> None:
    script = (f"{KVBROKER} attr get log.level; "
              f"{KVBROKER} attr get --rank 1 content.blob-size-limit; "
              f"{KVBROKER} attr list --rank 1")
    rc, out, err = await run_cli("start", "--size", "2", "-S", "log.level=error", "--",
                                 "sh", "-c", script, timeout=30)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[:2] == ["error", str(512 << 20)]
    listed = dict(line.split(None, 1) for line in lines[2:] if len(line.split()) == 2)
    assert listed["kvs.setroot-blob-limit"] == str(8 << 10)
    assert listed["log.level"] == "error"
    assert listed["broker.max-message"] == str(1 << 30)


# ------------------------------------------------ a rank started directly


BOOM_MODULE = '''
from typing import ClassVar

from broker.errors import RemoteError
from broker.module import Module


class Boom(Module):
    name: ClassVar[str] = "boom"

    async def start(self) -> None:
        if self.ctx.attrs.get("boom.kind") == "remote":
            raise RemoteError(27, "blob of 21 bytes exceeds the limit of 10")
        raise RuntimeError("something unexpected")
'''


@pytest.fixture
def boom_plugin(tmp_path: Path) -> dict[str, str]:
    """An environment whose ranks can load module ``boom``, failing in start()."""
    path = install_plugin(tmp_path, "boom-plugin", "[kvbroker.modules]\nboom = boommod:Boom\n",
                          {"boommod.py": BOOM_MODULE})
    return dict(os.environ, PYTHONPATH=path)


async def run_rank(attrs: dict[str, str], env: dict[str, str] | None = None,
                   statedir: str | None = None) -> tuple[int, str]:
    """Start rank 0 of a 1-rank instance directly; its status and stderr."""
    rundir = make_rundir()
    extra = ["--statedir", statedir] if statedir else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.rank", "--rank", "0", "--size", "1",
        "--rundir", rundir, "--attrs", json.dumps(attrs), *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL, env=env,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        shutil.rmtree(rundir, ignore_errors=True)
    assert out == b""  # never claimed to be ready
    assert proc.returncode is not None
    return proc.returncode, err.decode()


@pytest.mark.parametrize("attrs, message", [
    ({"log.level": "bogus"}, "log.level: unknown level 'bogus'"),
    ({"broker.max-message": "abc"}, "broker.max-message: 'abc' is not an integer"),
    ({"content.blob-size-limit": "10"}, "content.blob-size-limit: 10 is below the minimum"),
    ({"access.allow-guest-user": "maybe"}, "access.allow-guest-user: 'maybe' is not a boolean"),
])
async def test_a_rank_started_directly_refuses_a_bad_value(attrs, message) -> None:
    rc, err = await run_rank(attrs)
    assert rc == 1
    assert one_line(err).startswith(f"kvbroker[0]: ERROR kvbroker: start-up failed: {message}")


@pytest.mark.parametrize("kind, message", [
    # a module's own error as it is; another named (it was not: the t0003 helper)
    ("remote", "blob of 21 bytes exceeds the limit of 10"),
    ("other", "module boom failed to start: RuntimeError: something unexpected"),
])
async def test_a_module_failing_at_start_up_is_one_line(boom_plugin, kind, message) -> None:
    rc, err = await run_rank({"broker.modules": "content,boom", "boom.kind": kind},
                             env=boom_plugin)
    assert rc == 1
    assert one_line(err) == f"kvbroker[0]: ERROR kvbroker: start-up failed: {message}"


@pytest.mark.parametrize("entry, source, message", [
    ("broken = brokenmod:Broken", "raise ImportError('broken on purpose')\n",
     "module 'broken' (brokenmod:Broken) cannot be loaded: broken on purpose"),
    ("broken = brokenmod:Broken", "import nosuch_pkg_xyz\n",
     "module 'broken' (brokenmod:Broken) cannot be loaded: No module named 'nosuch_pkg_xyz'"),
    ("broken = brokenmod:Broken", "x = 1 / 0\n",
     "module 'broken' (brokenmod:Broken) cannot be loaded: ZeroDivisionError: division by zero"),
    ("broken = brokenmod:Broken",
     "from broker.module import Module\n\nclass Broken(Module):\n    pass\n",
     "module 'broken' (brokenmod:Broken) is not a module class with a name (a Module "
     "subclass setting name)"),
])
async def test_a_module_that_cannot_be_loaded_is_named(tmp_path, entry, source, message) -> None:
    """A plugin whose code fails to import, or that names a class without a
    ``name``, stops the start-up naming the module and its entry point (it
    said the import's message alone, which for a missing package read like
    an unknown module; a nameless class loaded as '' and served nothing)."""
    path = install_plugin(tmp_path, "broken-plugin", f"[kvbroker.modules]\n{entry}\n",
                          {"brokenmod.py": source})
    rc, err = await run_rank({"broker.modules": "content,broken"},
                             env=dict(os.environ, PYTHONPATH=path))
    assert rc == 1
    assert one_line(err) == f"kvbroker[0]: ERROR kvbroker: start-up failed: {message}"


def test_a_fixed_attributes_refusal_names_the_reload_that_works() -> None:
    """A module another calls is reloaded with that one removed meanwhile
    (the reload alone is EBUSY), and rank 0's content module not at all."""
    from broker.broker import _reload_hint_for

    assert _reload_hint_for(1, "kvs", "kvs.cache-bytes", []) == (
        "; or give it to a reload: kvbroker module reload kvs cache-bytes=VALUE")
    assert _reload_hint_for(1, "content", "content.cache-bytes", ["kvs"]) == (
        "; or give it to a reload, with kvs removed meanwhile (it calls content): "
        "kvbroker module remove kvs; kvbroker module reload content cache-bytes=VALUE; "
        "kvbroker module load kvs")
    assert _reload_hint_for(0, "content", "content.cache-bytes", ["kvs"]) == ""
