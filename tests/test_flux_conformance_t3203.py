"""flux-core t3203-instance-recovery, as kvbroker has it: ``kvbroker start
--recovery TARGET`` runs rank 0 alone on a stopped instance's statedir (a
directory, as ``--statedir``) or on what a ``kvbroker kvs dump`` archive
holds (a file, restored into a store of its own that goes at the stop, as
``-S content.restore``): docs/cli.md "start", docs/kvs.md.

The instance looked at is made once for the file (Flux's first case): 4
ranks on a statedir, a few keys written through ranks 0 and 3; its
archive is made offline (``kvs dump --checkpoint --statedir``).  A test
that changes a statedir or its modes works on a copy of its own.

Flux's cases, in order, and what each becomes here:

1. *start a persistent instance of size 4*: the same (the module fixture).
2. *expected broker attributes are set in recovery mode*
   (``broker.recovery-mode`` 1, ``broker.quorum`` 1, ``log-stderr-level``
   5), with Flux's ``-Sbroker.rc1_path= -Sbroker.rc3_path=`` (taken and
   ignored here, docs/cli.md).  ``broker.quorum``: kvbroker has no quorum
   attribute (a full quorum is what ``start`` waits for, documented); the
   equivalent asserted is ``size`` 1 and ``statedir`` the target.
   ``log-stderr-level`` is Flux's name for ``log.level`` (documented); its
   value in recovery mode is a verbosity choice, not asserted.
   ``broker.recovery-mode`` is 1, and Flux's ``-S
   broker.recovery-mode=1`` with ``--statedir DIR`` is ``--recovery DIR``
   (until 2026-12-05 there was no such attribute: a command could not
   tell, and Flux's setting was refused as unknown).
3. *banner message is printed in interactive recovery mode*: Flux's
   interactive form is a shell on a tty; kvbroker's is ``start`` without a
   command, which prints the URI on stdout and serves until signalled
   (docs/cli.md), and in recovery mode it says so on stderr first, naming
   the statedir (it printed nothing until 2026-12-05).
4. *--recovery is not ignored if --test-size is specified*: the same,
   ``--test-size=1 --recovery DIR`` (the instance is on DIR, rank 0 alone).
   A larger ``--test-size`` is refused (documented: "not with --size"),
   asserted too.
5. *rc1 failure is ignored in recovery mode*: not applicable: kvbroker runs
   no rc scripts (a non-empty ``broker.rc1_path`` is refused, documented).
6. *module panic is ignored in recovery mode*: not applicable: modules are
   the ones listed in ``broker.modules`` at start, none is loaded at run
   time, and a module handler's exception is logged, never fatal, in any
   mode (broker/module.py).
7. *resources are offline in recovery mode*: resources are outside
   kvbroker's scope.  The equivalent: the instance of 4 ranks is brought
   back by one rank (``size`` 1) holding the KVS all four wrote (case 2's
   test).
8. *dump test instance in recovery mode*: ``flux dump --checkpoint`` while
   the instance runs; kvbroker's ``kvs dump --checkpoint`` is the offline
   form only (``--statedir DIR`` of a stopped instance, documented in the
   synopsis), and refuses the statedir the recovery instance holds
   (documented), asserted.  The online ``kvs dump`` in recovery mode
   writes the archive, and it holds the instance's keys: asserted.
9. *recovery mode also works with dump file*: the same, on the archive:
   rank 0 alone, no statedir, the keys there.
10. *banner message warns changes are not persistent*: as case 3, on an
    archive, saying what is changed is not kept (fixed 2026-12-05, as
    case 3).  What Flux's banner states is asserted separately: changes made
    in recovery on a statedir persist; on an archive they do not, and the
    archive is left as it was.
11. *recovery mode aborts early if statedir is missing*: the same: exit 2,
    "no such directory or file", nothing created, the command not run.
12. *... if statedir lacks rwx* (mode 600): the same, exit 2 and
    "Permission denied" naming the statedir's store, before the command.
    (As root, these permission cases run the start with
    CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH dropped from its bounding set, so
    file modes bind it as they bind a user.)
13. *... if content is missing* (an empty directory): the same, exit 2
    before anything starts (until 2026-12-05 kvbroker started a new, empty
    store there and ran the command on an empty KVS, leaving a
    ``content.sqlite`` in a directory that held none).
14. *... if content unwritable* (``content.sqlite`` mode 400): the same,
    exit 2, "Permission denied".
15. *... if content unreadable* (mode 200): the same.

Beyond Flux's file: Flux's ``--recovery`` without a target refuses a
running system instance; here, ``--recovery DIR`` on the statedir of a
running instance is refused (exit 2, "in use by another instance") and
the running instance is unharmed.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import tarfile
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli

KEYS = {"a": "1", "b.c": "2", "from.rank3": "3"}
FLUX_RC_OFF = ("-S", "broker.rc1_path=", "-S", "broker.rc3_path=")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A stopped 4-rank instance's statedir (keys written on ranks 0 and 3)
    and an archive of its checkpoint: (statedir, archive)."""
    top = tmp_path_factory.mktemp("t3203")
    state, archive = top / "test1", top / "test1.tar"
    script = (f"{KVBROKER} kvs put a=1 b.c=2 && "
              f"{KVBROKER} exec -r 3 -- {KVBROKER} kvs put from.rank3=3")
    subprocess.run([KVBROKER, "start", "--test-size=4", "--statedir", str(state),
                    "--", "sh", "-c", script], check=True, timeout=60)
    subprocess.run([KVBROKER, "kvs", "dump", "--checkpoint", "--statedir", str(state),
                    str(archive)], check=True, timeout=60, capture_output=True)
    return state, archive


def own_copy(state: Path, where: Path) -> Path:
    copy = where / "state"
    shutil.copytree(state, copy)
    copy.chmod(0o700)
    return copy


def get_keys(*keys: str) -> str:
    return " && ".join(f"{KVBROKER} kvs get {k}" for k in keys)


async def serve(*args: str) -> str:
    """``kvbroker start ARGS`` without a command (kvbroker's interactive
    form): wait for its URI on stdout, stop it with SIGINT, return its
    stderr."""
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "start", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert line.startswith(b"local://"), line
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    return err.decode()


async def start_bound_by_modes(*args: str) -> tuple[int, str, str]:
    """``kvbroker start ARGS`` subject to file modes: as root, with the
    capabilities that bypass them dropped (setpriv); otherwise as is."""
    argv = [KVBROKER, "start", *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root without setpriv: file modes do not bind")
        argv = [setpriv, "--bounding-set=-dac_override,-dac_read_search", *argv]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


# ------------------------------------------------------------ cases 1-4, 7


async def test_t3203_recovery_on_a_statedir_is_rank_0_alone_with_its_kvs(made) -> None:
    state, _ = made
    rc, out, err = await run_cli(
        "start", "--recovery", str(state), *FLUX_RC_OFF, "--", "sh", "-c",
        f"{KVBROKER} attr get size && {KVBROKER} attr get statedir && {get_keys(*KEYS)}")
    assert rc == 0, err
    assert out.splitlines() == ["1", str(state), *KEYS.values()], (out, err)


async def test_t3203_recovery_mode_is_an_attribute(made) -> None:
    state, _ = made
    rc, out, err = await run_cli(
        "start", "--recovery", str(state), *FLUX_RC_OFF, "--",
        "kvbroker", "attr", "get", "broker.recovery-mode")
    assert (rc, out) == (0, "1\n"), err


async def test_t3203_flux_s_recovery_mode_attribute_is_recovery_on_the_statedir(
        made, tmp_path) -> None:
    state, _ = made
    rc, out, err = await run_cli(
        "start", "--statedir", str(state), "-S", "broker.recovery-mode=1", "--", "sh", "-c",
        f"{KVBROKER} attr get broker.recovery-mode && {KVBROKER} attr get size")
    assert (rc, out) == (0, "1\n1\n"), err
    rc, out, err = await run_cli("start", "-S", "broker.recovery-mode=1", "--",
                                 "touch", str(tmp_path / "ran"))
    assert (rc, out) == (2, ""), err
    assert "broker.recovery-mode=1 needs the statedir to recover" in err, err
    rc, out, err = await run_cli("start", "--", KVBROKER, "attr", "get",
                                 "broker.recovery-mode")
    assert (rc, out) == (0, "0\n"), err
    assert not (tmp_path / "ran").exists()


async def test_t3203_serving_in_recovery_mode_says_so(made) -> None:
    state, _ = made
    err = await serve("--recovery", str(state), *FLUX_RC_OFF)
    assert re.search(r"recovery mode", err, re.IGNORECASE), err
    assert str(state) in err, err


async def test_t3203_recovery_is_not_ignored_with_test_size(made, tmp_path) -> None:
    state, _ = made
    rc, out, err = await run_cli(
        "start", *FLUX_RC_OFF, "--test-size=1", f"--recovery={state}", "--", "sh", "-c",
        f"{KVBROKER} attr get size && {KVBROKER} attr get statedir && {get_keys('a')}")
    assert rc == 0, err
    assert out.splitlines() == ["1", str(state), "1"], (out, err)
    # more than rank 0 is refused, not ignored (docs/cli.md: "not with --size")
    rc, out, err = await run_cli("start", "--test-size=4", f"--recovery={state}",
                                 "--", "touch", str(tmp_path / "ran"))
    assert (rc, out) == (2, ""), err
    assert "--recovery runs rank 0 alone" in err, err
    assert not (tmp_path / "ran").exists()


# ------------------------------------------------------------ cases 8-10


async def test_t3203_dump_in_recovery_mode(made, tmp_path) -> None:
    state, _ = made
    online, offline = tmp_path / "online.tar", tmp_path / "offline.tar"
    rc, out, err = await run_cli(
        "start", "--recovery", str(state), "--", "sh", "-c",
        f"{KVBROKER} kvs dump {online} && "
        f"{{ {KVBROKER} kvs dump --checkpoint --statedir {state} {offline}; echo $?; }}")
    assert rc == 0, err
    # the offline form refuses the statedir the recovery instance holds
    assert out == "1\n", err
    assert "in use" in err and not offline.exists(), err
    with tarfile.open(online) as tar:
        assert sorted(tar.getnames()) == ["a", "b/c", "from/rank3"]
        assert tar.extractfile("from/rank3").read() == b"3"


async def test_t3203_recovery_on_a_dump_file(made) -> None:
    _, archive = made
    rc, out, err = await run_cli(
        "start", "--recovery", str(archive), *FLUX_RC_OFF, "--", "sh", "-c",
        f"{KVBROKER} attr get size && {KVBROKER} attr get statedir; {get_keys(*KEYS)}")
    assert rc == 0, err
    assert out.splitlines() == ["1", "", *KEYS.values()], (out, err)


async def test_t3203_serving_on_a_dump_file_warns_changes_are_not_kept(made) -> None:
    _, archive = made
    err = await serve("--recovery", str(archive), *FLUX_RC_OFF)
    assert re.search(r"not (be )?(preserved|kept|saved)|(lost|discarded)", err,
                     re.IGNORECASE), err


async def test_t3203_changes_persist_on_a_statedir_not_on_a_dump_file(made, tmp_path) -> None:
    state, archive = made
    mine = own_copy(state, tmp_path)
    before = archive.read_bytes()
    for target in (mine, archive):
        rc, _, err = await run_cli("start", "--recovery", str(target), "--",
                                   "kvbroker", "kvs", "put", "mended=yes")
        assert rc == 0, err
    rc, out, err = await run_cli("start", "--statedir", str(mine), "--",
                                 "kvbroker", "kvs", "get", "mended")
    assert (rc, out) == (0, "yes\n"), err
    rc, out, err = await run_cli("start", "--recovery", str(archive), "--",
                                 "kvbroker", "kvs", "get", "mended")
    assert (rc, out) == (1, ""), err
    assert "mended: No such file or directory" in err, err
    assert archive.read_bytes() == before


# ------------------------------------------------------------ cases 11-15


async def test_t3203_aborts_if_the_statedir_is_missing(tmp_path) -> None:
    missing = tmp_path / "test2"
    rc, out, err = await run_cli("start", "--recovery", str(missing), "--",
                                 "touch", str(tmp_path / "ran"))
    assert (rc, out) == (2, ""), err
    assert f"--recovery {missing}: no such directory or file" in err, err
    assert not missing.exists() and not (tmp_path / "ran").exists()


async def test_t3203_aborts_if_the_statedir_lacks_rwx(made, tmp_path) -> None:
    mine = own_copy(made[0], tmp_path)
    mine.chmod(0o600)
    try:
        rc, out, err = await start_bound_by_modes("--recovery", str(mine), "--",
                                                  "touch", str(tmp_path / "ran"))
    finally:
        mine.chmod(0o700)
    assert (rc, out) == (2, ""), err
    assert f"{mine}/content.sqlite: Permission denied" in err, err
    assert "Traceback" not in err, err
    assert not (tmp_path / "ran").exists()


async def test_t3203_aborts_if_the_content_is_missing(tmp_path) -> None:
    empty = tmp_path / "test2"
    empty.mkdir(mode=0o700)
    rc, out, err = await run_cli("start", "--recovery", str(empty), "--",
                                 "touch", str(tmp_path / "ran"))
    assert not (tmp_path / "ran").exists(), "the command ran on an empty KVS"
    assert (rc, out) == (2, ""), err
    assert "content.sqlite" in err, err
    assert list(empty.iterdir()) == []


@pytest.mark.parametrize("mode, lacks", [(0o400, "write"), (0o200, "read")])
async def test_t3203_aborts_if_the_content_is_not_usable(made, tmp_path, mode, lacks) -> None:
    mine = own_copy(made[0], tmp_path)
    store = mine / "content.sqlite"
    store.chmod(mode)
    rc, out, err = await start_bound_by_modes("--recovery", str(mine), "--",
                                              "touch", str(tmp_path / "ran"))
    assert (rc, out) == (2, ""), (lacks, err)
    assert f"{store}: Permission denied" in err, (lacks, err)
    assert "Traceback" not in err, err
    assert not (tmp_path / "ran").exists()
    assert (store.stat().st_mode & 0o777) == mode


# ------------------------------------------------------------ beyond Flux's file


async def test_t3203_recovery_on_a_running_instances_statedir_is_refused(made, tmp_path) -> None:
    mine = own_copy(made[0], tmp_path)
    rc, out, err = await run_cli(
        "start", "--statedir", str(mine), "--", "sh", "-c",
        f"{KVBROKER} start --recovery {mine} -- {KVBROKER} kvs put b.c=lost; "
        f"echo $?; {KVBROKER} kvs get b.c")
    assert rc == 0, err
    assert out.splitlines() == ["2", "2"], (out, err)
    assert f"statedir {mine} is in use by another instance" in err, err


async def test_t3203_broker_has_no_recovery_mode(tmp_path) -> None:
    conf = tmp_path / "one.toml"
    conf.write_text("[bootstrap]\n")
    rc, out, err = await run_cli("broker", "-c", str(conf), "-S", "broker.recovery-mode=1",
                                 "--rundir", str(tmp_path / "run"), "--",
                                 "touch", str(tmp_path / "ran"))
    assert (rc, out) == (2, ""), err
    assert "kvbroker broker has no recovery mode" in err, err
    assert not (tmp_path / "ran").exists()
