"""flux-core t/t2816-fsck-cmd.t (``flux fsck``) against real kvbroker
instances: ``kvbroker kvs fsck`` (docs/cli.md "kvs fsck"; kvs/fsck.py).

How the store is damaged.  Flux's test corrupts a key by putting
(``flux kvs put --treeobj``) a copy of its tree object with one blobref
swapped for ``sha1-1234...``, a blob that was never stored.  kvbroker's
KVS refuses a tree object naming a blob the store does not have
(``ENOENT``: it never lets a commit write a dangling reference), so here
the copy names a *new* blob, stored for the purpose with ``content.store``
and unique to it; once the instance is stopped, those blobs are deleted
from ``content.sqlite``.  As in Flux's test, only the versions written
after the corruption are damaged: the older roots stay whole.

Flux runs every check with the kvs module unloaded, through the content
service of the running broker; here the checks run offline, on the
stopped instance's statedir (``--statedir``), which is where kvbroker's
``--repair`` works (a reloaded kvs module resumes from the state it hands
over, not from the checkpoint, so a repair written under it would be
lost).  Online checks work too, with the kvs running or removed.

Flux's cases, and what each becomes:

* load content, content-sqlite, kvs; create some kvs content; sync ->
  the instance's own modules; the same keys (testdir.a..d, appended to,
  testdir.adir/bdir, alink, namespace testns), the root after each step.
* fsck works with kvs loaded (read-only) -> online ``kvs fsck`` passes;
  and with the kvs module removed it checks the checkpoint the content
  service keeps, as Flux's does
  (:func:`test_fsck_with_the_kvs_running_removed_and_stopped`).
* ``--repair`` fails if kvs loaded ("please unload kvs module") -> online
  ``-R`` is a usage error that names ``--statedir DIR`` (same test).
* save some treeobjs; unload kvs -> the instance stopped.
* fsck works (simple): "Checking integrity" on stdout, no "Total errors"
  -> the same (same test).
* fsck verbose: every key on stderr, "Total errors: 0" -> the same, the
  list exactly (same test).
* LONGTEST: 2,001 appends to bigval, fsck --verbose names it, 0 errors
  -> one commit of 2,001 appends (a ``vtree``), checked whole (same
  test).
* make testdir.b's index 1 invalid; detects errors (2 lines, "testdir.b:
  missing blobref(s)", "Total errors: 1"); ``--verbose`` ("index=1");
  ``--quiet`` (the same 2 lines) -> the same lines, at the root written
  then (``--rootref``: kvbroker damages all four versions in one run)
  (:func:`test_damaged_keys_are_named_at_each_root`).
* the same for testdir.c (index 1 and 2: 3 lines, 2 errors), testdir.d
  (index 0 and 1: 4 lines, 3 errors), testdir.bdir's dirref ("missing
  dirref blobref": 5 lines, 4 errors) -> the same, the last at the
  checkpoint itself (same test).
* fsck does not prefix error messages on non-tty runs / prefixes them on
  tty runs -> does not apply: kvbroker's fsck writes its lines bare,
  tty or not (Flux's ``log_msg`` prefix is ``flux-fsck: ``).
* ``--rootref`` of roots a, b, c, d (3..6 lines, 0 errors), of the
  damaged roots (1..4 errors, every index) -> the same (same test).
* ``--rootref`` of a ref the store lacks ("Total errors: 1") -> the
  same, named ``.: missing root blobref``; of an invalid ref (fails) ->
  a usage error, exit 2 (same test).
* checkpoint-get returned final expected rootref -> ``kvs checkpoint
  list --statedir`` (same test).
* ``--repair`` works (1): each key "missing blobref(s)" and "repaired",
  bdir "unlinked", "Total errors: 4", "Total repairs: 3", "Total
  unlinked directories: 1", "Updated primary checkpoint"; exit 1 ->
  the same lines and status (:func:`test_repair_to_lost_and_found`).
* recovers data to lost+found (test1test3test4, testAtestD, testdir.d
  empty); unlinks bad entries; leaves good entries; testdir.d a ``val``;
  checkpoint-get is the root the kvs starts at; fsck passes now -> the
  same, after a restart (same test).
* fix testdir.c (``kvs copy`` from lost+found); overwrite testdir.d with
  testdir.d.e; ``--repair`` does nothing (no "Total ..." lines); with
  ``--verbose`` every total 0 -> the same (same test).
* leaves prior recoveries; testdir.d.e corrupted (index 1, 2); repair
  (3): 1 error, 1 repair, no unlinked line; overwrites older recoveries
  (lost+found.testdir.d, a value, becomes a directory holding e:
  test1test4) -> the same (same test).
* testdir.f corrupted; ``--repair --quiet`` suppresses "repaired" and
  "Updated primary checkpoint", keeps the error and totals -> the same
  (same test).
* ``--repair --job-aware``: job-like directories job.0123.4567.89ab.cdef
  (whole) and ...badd (two values damaged, one in a subdirectory); no
  errors: nothing done; errors: every key of the bad job moved to
  lost+found (the damaged values as what could be read: 13, AC), the job
  directory unlinked, everything else left -> the same, "job ... moved to
  lost+found" named (:func:`test_job_aware_repair_moves_the_whole_job`).
* remove content modules / truncate -> a fresh instance instead.

kvbroker's own, beyond Flux's cases: a long value (``vtree``) whose chunk
is lost keeps its other chunks' blobs in lost+found
(:func:`test_a_long_value_keeps_what_can_be_read`); ``--job-aware``
without ``--repair`` is a usage error (Flux ignores it).

Deliberate differences (docs/cli.md "kvs fsck"): ``--repair`` works on a
stopped instance's statedir (Flux's on a broker with the kvs unloaded);
it also mends values whose blobs are damaged (stored bytes that do not
match their hash: offline, no retry can help), where Flux's mends only
missing ones; it writes the checkpoint whenever it changed anything (Flux's
only when a value was repaired, not for unlinked directories alone);
``lost+found.JOB`` is the job's directory as the repair left it, put
whole (Flux's merges key by key into what is there); the verbose
per-blob line also names the blobref.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from test_broker_support import run_cli
from test_kvs_fsck import delete_blobs
from test_kvs_rpc_helpers import APPEND, commit, dirref, put

from kvs import treeobj
from kvs.client import KVS

T = 20.0


async def fsck(*args: str, rc: int = 0, uri: str | None = None) -> tuple[str, list[str]]:
    """``kvbroker kvs fsck ARGS``: its stdout and stderr lines."""
    code, out, err = await run_cli("kvs", "fsck", *args, uri=uri)
    assert code == rc, (args, code, out, err)
    return out, err.splitlines()


class Damage:
    """Flux's ``jq .data[i]="sha1-123..."`` and ``flux kvs put --treeobj``:
    the key's tree object with each blobref at ``index`` swapped for a new
    blob of its own, deleted (:meth:`apply`) once the instance stops."""

    def __init__(self) -> None:
        self.refs: list[str] = []

    async def blob(self, h: Any, data: bytes) -> str:
        ref = str((await asyncio.wait_for(h.rpc("content.store", {"data": data}), T))["blobref"])
        self.refs.append(ref)
        return ref

    async def value(self, h: Any, key: str, *index: int) -> str:
        obj = await KVS(h).get_treeobj(key)
        assert obj["type"] == "valref", obj
        data = list(obj["data"])
        for i in index:
            data[i] = await self.blob(h, f"doomed {key} {i}".encode())
        return str((await commit(h, put(key, {**obj, "data": data})))["rootref"])

    async def dir(self, h: Any, key: str) -> str:
        """``key`` a directory whose blob will be gone (Flux's bad dirref)."""
        ref = await self.blob(h, treeobj.encode(treeobj.dir_({"x": treeobj.val(key.encode())})))
        return str((await commit(h, put(key, dirref(ref))))["rootref"])

    def apply(self, statedir: Path) -> None:
        delete_blobs(statedir, *self.refs)
        self.refs = []


async def appended(h: Any, key: str, *parts: str) -> str:
    """``flux kvs put KEY=P0`` then ``put --append`` of the rest; the root."""
    await commit(h, put(key, parts[0]))
    for part in parts[1:]:
        root = await commit(h, put(key, part, flags=APPEND))
    return str(root["rootref"])


async def restart(start_instance, connect, statedir: Path) -> tuple[Any, Any]:
    inst = await start_instance(size=1, statedir=str(statedir))
    return inst, await connect(inst, 0)


async def stop(inst: Any, h: Any) -> None:
    await h.close()
    await inst.stop()


async def create_content(h: Any) -> dict[str, str]:
    """Flux's 'create some kvs content': the roots a, b, c, d."""
    kvs = KVS(h)
    roots = {"a": str((await commit(h, put("testdir.a", "test")))["rootref"])}
    roots["b"] = await appended(h, "testdir.b", "test1", "test2", "test3", "test4")
    roots["c"] = await appended(h, "testdir.c", "testA", "testB", "testC", "testD")
    roots["d"] = await appended(h, "testdir.d", "testE", "testF")
    await kvs.mkdir("testdir.adir")
    await kvs.mkdir("testdir.bdir")
    await kvs.symlink("alink", "testdir")
    await kvs.namespace_create("testns")
    await KVS(h, "testns").put("testdir.a", b"testns")
    await kvs.sync()
    return roots


EVERY_KEY = ["alink", "testdir", "testdir.a", "testdir.adir", "testdir.b", "testdir.bdir",
             "testdir.c", "testdir.d"]


async def test_fsck_with_the_kvs_running_removed_and_stopped(
        start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    inst, h = await restart(start_instance, connect, statedir)
    await create_content(h)
    # LONGTEST: 2,001 appends (one commit here)
    await commit(h, *(put("bigval", str(i), flags=APPEND) for i in range(1000, 3001)))
    assert (await KVS(h).get_treeobj("bigval"))["type"] == "valref"  # (as a lookup shows it)
    await KVS(h).sync()
    out, err = await fsck(uri=inst.uri(0))
    assert out.startswith("checking namespace primary at version ") and err == []
    code, _, stderr = await run_cli("kvs", "fsck", "--repair", uri=inst.uri(0))
    assert code == 2 and "--statedir DIR" in stderr, stderr
    code, _, stderr = await run_cli("kvs", "fsck", "-R", uri=inst.uri(0))
    assert code == 2, stderr
    # Flux's way: the kvs unloaded, the checkpoint the content service keeps
    code, _, stderr = await run_cli("module", "remove", "kvs", uri=inst.uri(0))
    assert code == 0, stderr
    out, err = await fsck("-v", uri=inst.uri(0))
    assert out.startswith("Checking integrity of checkpoint from "), out
    assert err == ["alink", "bigval", *EVERY_KEY[1:], "Total errors: 0"]
    await stop(inst, h)

    out, err = await fsck("--statedir", str(statedir))  # simple
    assert out.startswith("Checking integrity of checkpoint from ") and err == []
    out, err = await fsck("--verbose", "--statedir", str(statedir))
    assert err == ["alink", "bigval", *EVERY_KEY[1:], "Total errors: 0"]


async def test_damaged_keys_are_named_at_each_root(start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    inst, h = await restart(start_instance, connect, statedir)
    roots = await create_content(h)
    damage = Damage()
    roots["bbad"] = await damage.value(h, "testdir.b", 1)
    roots["cbad"] = await damage.value(h, "testdir.c", 1, 2)
    roots["dbad"] = await damage.value(h, "testdir.d", 0, 1)
    roots["bdirbad"] = await damage.dir(h, "testdir.bdir")
    await stop(inst, h)
    damage.apply(statedir)
    sd = ("--statedir", str(statedir))

    b_err, c_err = "testdir.b: missing blobref(s)", "testdir.c: missing blobref(s)"
    d_err, bdir_err = "testdir.d: missing blobref(s)", "testdir.bdir: missing dirref blobref"
    stages = [("bbad", [b_err]), ("cbad", [b_err, c_err]), ("dbad", [b_err, c_err, d_err]),
              ("bdirbad", [b_err, c_err, d_err, bdir_err])]
    verbose_lines = {"testdir.b": [1], "testdir.c": [1, 2], "testdir.d": [0, 1]}
    for name, errors in stages:
        ref = ("-r", roots[name]) if name != "bdirbad" else ()
        _, err = await fsck(*sd, *ref, rc=1)
        assert sorted(err[:-1]) == sorted(errors) and err[-1] == f"Total errors: {len(errors)}"
        out, quiet = await fsck(*sd, *ref, "--quiet", rc=1)
        assert (out, quiet) == ("", err)
        _, err = await fsck(*sd, *ref, "--verbose", rc=1)
        for key, indexes in verbose_lines.items():
            for i in indexes:
                wanted = f"{key}: missing blobref index={i} "
                assert any(line.startswith(wanted) for line in err) == (key in "".join(errors))
        assert (bdir_err in err) == (name == "bdirbad")
        assert err[-1] == f"Total errors: {len(errors)}"
    for name, keys in (("a", ["testdir.a"]), ("b", ["testdir.a", "testdir.b"]),
                       ("c", ["testdir.a", "testdir.b", "testdir.c"]),
                       ("d", ["testdir.a", "testdir.b", "testdir.c", "testdir.d"])):
        _, err = await fsck(*sd, "--verbose", f"--rootref={roots[name]}")
        assert err == ["testdir", *keys, "Total errors: 0"]
    _, err = await fsck(*sd, "--rootref=sha256-" + "1" * 64, rc=1)
    assert err == [".: missing root blobref", "Total errors: 1"]
    _, err = await fsck(*sd, "--rootref=lalalal", rc=2)
    assert "invalid blobref" in err[-1]
    code, out, stderr = await run_cli("kvs", "checkpoint", "list", *sd, "--no-header")
    assert code == 0 and out.splitlines()[0].endswith(roots["bdirbad"]), (out, stderr)


async def test_repair_to_lost_and_found(start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    sd = ("--statedir", str(statedir))
    inst, h = await restart(start_instance, connect, statedir)
    await create_content(h)
    damage = Damage()
    await damage.value(h, "testdir.b", 1)
    await damage.value(h, "testdir.c", 1, 2)
    await damage.value(h, "testdir.d", 0, 1)
    await damage.dir(h, "testdir.bdir")
    await stop(inst, h)
    damage.apply(statedir)

    out, err = await fsck(*sd, "--repair", rc=1)  # (1)
    assert out.startswith("Checking integrity of checkpoint from ")
    for key in ("testdir.b", "testdir.c", "testdir.d"):
        assert f"{key}: missing blobref(s)" in err
        assert f"{key} repaired and moved to lost+found" in err
    assert "testdir.bdir: missing dirref blobref" in err
    assert "testdir.bdir unlinked due to missing blobref" in err
    assert "Total errors: 4" in err
    assert err[-2:] == ["Total repairs: 3", "Total unlinked directories: 1"]
    assert any(line.startswith("Updated primary checkpoint to include lost+found")
               for line in err)

    inst, h = await restart(start_instance, connect, statedir)
    kvs = KVS(h)
    assert await kvs.get("lost+found.testdir.b") == b"test1test3test4"
    assert await kvs.get("lost+found.testdir.c") == b"testAtestD"
    assert await kvs.get("lost+found.testdir.d") == b""
    assert (await kvs.get_treeobj("lost+found.testdir.d"))["type"] == "val"
    for key in ("testdir.b", "testdir.c", "testdir.d", "testdir.bdir"):
        assert not await kvs.exists(key), key
    assert await kvs.get("testdir.a") == b"test"
    assert len(await kvs.dir("testdir.adir")) == 0
    assert (await kvs.get_treeobj("alink"))["type"] == "symlink"
    code, out, _ = await run_cli("kvs", "checkpoint", "list", "--no-header", uri=inst.uri(0))
    assert out.splitlines()[0].endswith((await kvs.getroot()).rootref), out
    await stop(inst, h)
    out, err = await fsck(*sd)  # passes now
    assert err == []

    inst, h = await restart(start_instance, connect, statedir)
    code, _, stderr = await run_cli("kvs", "copy", "lost+found.testdir.c", "testdir.c",
                                    uri=inst.uri(0))
    assert code == 0, stderr
    await appended(h, "testdir.d.e", "test1", "test2", "test3", "test4")
    await stop(inst, h)
    _, err = await fsck(*sd, "--repair")  # (2): nothing to do
    assert err == []
    _, err = await fsck(*sd, "--repair", "--verbose")
    assert err[-3:] == ["Total errors: 0", "Total repairs: 0", "Total unlinked directories: 0"]

    inst, h = await restart(start_instance, connect, statedir)
    kvs = KVS(h)
    assert await kvs.get("lost+found.testdir.c") == b"testAtestD"  # prior recoveries left
    assert await kvs.get("lost+found.testdir.d") == b""
    await damage.value(h, "testdir.d.e", 1, 2)
    await stop(inst, h)
    damage.apply(statedir)
    _, err = await fsck(*sd, "--repair", rc=1)  # (3)
    assert err[:3] == ["testdir.d.e: missing blobref(s)", "Total errors: 1",
                       "testdir.d.e repaired and moved to lost+found"], err
    assert err[3].startswith("Updated primary checkpoint") and err[4:] == ["Total repairs: 1"]

    inst, h = await restart(start_instance, connect, statedir)
    kvs = KVS(h)
    assert await kvs.get("lost+found.testdir.d.e") == b"test1test4"  # overwrites older
    assert await kvs.get("lost+found.testdir.c") == b"testAtestD"
    await appended(h, "testdir.f", "A", "B")
    await damage.value(h, "testdir.f", 1)
    await stop(inst, h)
    damage.apply(statedir)
    out, err = await fsck(*sd, "--repair", "--quiet", rc=1)
    assert (out, err) == ("", ["testdir.f: missing blobref(s)", "Total errors: 1",
                               "Total repairs: 1"])
    inst, h = await restart(start_instance, connect, statedir)
    assert await KVS(h).get("lost+found.testdir.f") == b"A"


JOB = "job.0123.4567.89ab"


async def test_job_aware_repair_moves_the_whole_job(start_instance, connect, tmp_path) -> None:
    statedir = tmp_path / "state"
    sd = ("--statedir", str(statedir))
    inst, h = await restart(start_instance, connect, statedir)
    kvs = KVS(h)
    await kvs.put("val", b"val")
    await appended(h, "dir.val", "v", "a", "l")
    good, bad = f"{JOB}.cdef", f"{JOB}.badd"
    await kvs.put(f"{good}.J", b"J")
    await appended(h, f"{good}.log", "1", "2", "3")
    await appended(h, f"{good}.Adir.data", "A", "B", "C")
    await appended(h, f"{good}.Bdir.data", "A", "B", "C")
    await kvs.symlink(f"{good}.alink", "tosomewhere")
    await kvs.put(f"{bad}.J", b"J")
    for key in ("good", "bad", "Adir.good", "Adir.bad", "Bdir.good"):
        await appended(h, f"{bad}.{key}", *(("1", "2", "3") if "dir" not in key
                                            else ("A", "B", "C")))
    await kvs.symlink(f"{bad}.alink", "tosomewhere")
    await stop(inst, h)
    out, err = await fsck(*sd, "--repair", "--job-aware")  # no errors
    assert out.startswith("Checking integrity") and err == []
    code, _, stderr = await run_cli("kvs", "fsck", *sd, "-j")
    assert code == 2 and "--job-aware goes with --repair" in stderr

    inst, h = await restart(start_instance, connect, statedir)
    damage = Damage()
    await damage.value(h, f"{bad}.bad", 1)
    await damage.value(h, f"{bad}.Adir.bad", 1)
    await stop(inst, h)
    damage.apply(statedir)
    out, err = await fsck(*sd, "-R", "-j", "--verbose", rc=1)
    assert out.startswith("Checking integrity")
    assert "Total errors: 2" in err and f"job {bad} moved to lost+found" in err

    inst, h = await restart(start_instance, connect, statedir)
    kvs = KVS(h)
    lost = f"lost+found.{bad}"
    assert await kvs.get(f"{lost}.bad") == b"13"
    assert await kvs.get(f"{lost}.Adir.bad") == b"AC"
    assert await kvs.get(f"{lost}.J") == b"J"
    assert await kvs.get(f"{lost}.good") == b"123"
    assert await kvs.get(f"{lost}.Adir.good") == b"ABC"
    assert await kvs.get(f"{lost}.Bdir.good") == b"ABC"
    assert (await kvs.get_treeobj(f"{lost}.alink"))["type"] == "symlink"
    assert await kvs.exists(JOB) and not await kvs.exists(bad)
    assert await kvs.get("val") == b"val" and await kvs.get("dir.val") == b"val"
    assert await kvs.get(f"{good}.J") == b"J" and await kvs.get(f"{good}.log") == b"123"
    assert await kvs.get(f"{good}.Adir.data") == b"ABC"
    assert await kvs.get(f"{good}.Bdir.data") == b"ABC"
    assert (await kvs.get_treeobj(f"{good}.alink"))["type"] == "symlink"
    assert not await kvs.exists(f"lost+found.{good}")


async def test_a_long_value_keeps_what_can_be_read(start_instance, connect, tmp_path) -> None:
    """kvbroker's own: a value of many appends is a ``vtree`` whose chunks
    are blobs; one lost, ``--repair`` keeps the blobs of the others (and
    the tail) in lost+found, in order."""
    statedir = tmp_path / "state"
    inst, h = await restart(start_instance, connect, statedir)
    root = await commit(h, *(put("bigval", f"{i}\n", flags=APPEND) for i in range(1000, 3001)))
    top = treeobj.decode((await h.rpc("content.load", {"blobref": root["rootref"]}))["data"])
    entry = top["data"]["bigval"]
    assert entry["type"] == "vtree" and len(entry["data"]["chunks"]) >= 2, entry
    lost = entry["data"]["chunks"][0]
    chunk = treeobj.decode((await h.rpc("content.load", {"blobref": lost}))["data"])
    gone = {bytes((await h.rpc("content.load", {"blobref": r}))["data"]) for r in chunk["data"]}
    await stop(inst, h)
    delete_blobs(statedir, lost)
    _, err = await fsck("--statedir", str(statedir), "-R", rc=1)
    assert err[:3] == ["bigval: missing blobref(s)", "Total errors: 1",
                       "bigval repaired and moved to lost+found"], err
    inst, h = await restart(start_instance, connect, statedir)
    kept = await KVS(h).get("lost+found.bigval")
    want = b"".join(f"{i}\n".encode() for i in range(1000, 3001)
                    if f"{i}\n".encode() not in gone)
    assert kept == want and len(want) < len(b"".join(f"{i}\n".encode()
                                                      for i in range(1000, 3001)))
