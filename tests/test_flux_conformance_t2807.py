"""flux-core t/t2807-dump-cmd.t (``flux dump``, ``flux restore``) against
``kvbroker kvs dump`` / ``kvs restore``.

Flux unloads its kvs module to work on the checkpoint; here the instance
stops and ``--checkpoint --statedir DIR`` works on its statedir (refused
while it runs).  Flux's data set goes through a checkpoint dump, an
offline restore into a fresh statedir (Flux's "offline garbage collection
with dump/restore": ``dump --checkpoint - | restore --checkpoint -``), and
comes back exact: a nested value, a dangling link, a 100-byte value, a link
into another namespace (``smurf::otherthing``) and a value built by
appends.  Then the online cases: ``restore --key``, ``dump - | restore
-``, a tar of the extracted files (with its ``./`` directory entries), a
UTF-8 key, and ``--size-limit``.  Departures, documented (docs/kvs.md,
Dump and restore): an empty directory is dumped (Flux leaves it out); the
summary lines are kvbroker's (``5 keys (...)``, Flux ``restored 5 keys (7
blobs)``); no ``--maxreqs``, ``--no-cache``, ``--ignore-failed-read`` (a
dangling reference cannot be committed here: docs/kvs.md, Differences),
nor the ``content.dump``/``content.restore`` attributes of Flux's rc
scripts.  The blob counts of Flux's SQLite file are its tree layout's.
"""

from __future__ import annotations

import io
import tarfile

from test_broker_support import run_cli
from test_kvs_cli import client_env, run

T = 60
X = "0" * 100  # printf "%-.*d" 100 0


async def script(inst, text: str, cwd) -> str:
    """Run ``text`` with sh, attached to rank 0; its stdout and stderr."""
    env = client_env(inst.uri(0)) if inst is not None else client_env("")
    if inst is None:
        env.pop("KVBROKER_URI")
    res = await run(["sh", "-c", "set -e\n" + text], env, cwd=str(cwd), timeout=T)
    assert res.rc == 0, res.text + res.err
    return res.text + res.err


async def test_t2807_usage_errors() -> None:
    for cmd in (["dump"], ["restore"]):  # "with no args prints Usage message"
        rc, _, err = await run_cli("kvs", *cmd)
        assert rc == 2 and err.startswith("usage: kvbroker kvs " + cmd[0]), err
    # "restore without required argument fails"
    rc, _, err = await run_cli("kvs", "restore", "foo.tar")
    assert rc == 2 and "--key KEY (online) or --checkpoint --statedir DIR" in err, err
    # "flux-dump with no backing store fails": a checkpoint needs a statedir
    for cmd in ("dump", "restore"):
        rc, _, err = await run_cli("kvs", cmd, "--checkpoint", "foo.tar")
        assert rc == 2 and "--checkpoint needs --statedir DIR" in err, err


async def test_t2807_the_checkpoint_goes_through_dump_and_restore_exact(
        start_instance, tmp_path) -> None:
    (tmp_path / "x.val").write_text(X)
    inst = await start_instance(size=1, statedir=str(tmp_path / "test"))
    await script(inst, """
        kvbroker kvs put --no-merge a.b.c=testkey
        kvbroker kvs link linkedthing y
        kvbroker kvs put --no-merge x=$(cat x.val)
        kvbroker kvs link --target-namespace=smurf otherthing z
        kvbroker kvs put --no-merge w=
        kvbroker kvs put --no-merge --append w=foo
        kvbroker kvs put --no-merge --append w=bar
        """, tmp_path)
    # "restore --checkpoint fails with kvs loaded": with the instance running
    rc, _, err = await run_cli("kvs", "restore", "--checkpoint", "--statedir",
                               str(tmp_path / "test"), str(tmp_path / "foo.tar"))
    assert rc == 1 and "in use by a running instance" in err, err
    assert await inst.stop() == [0]

    # "dump default=kvs-primary checkpoint", again with -q and -v; then the
    # offline collection: the checkpoint piped into a fresh statedir
    out = await script(None, """
        kvbroker kvs dump --checkpoint --statedir test foo.tar 2>dump.err
        kvbroker kvs dump -q --checkpoint --statedir test foo.tar 2>dump-q.err
        kvbroker kvs dump -v --checkpoint --statedir test foo.tar 2>dump-v.err
        kvbroker kvs restore -v --checkpoint --statedir test_v foo.tar 2>restore-v.err
        kvbroker kvs restore -q --checkpoint --statedir test_q foo.tar 2>restore-q.err
        kvbroker kvs dump -q --checkpoint --statedir test - \\
            | kvbroker kvs restore --checkpoint --statedir test_bak - 2>restore.err
        tar tvf foo.tar
        """, tmp_path)
    err = {name: (tmp_path / f"{name}.err").read_text()
           for name in ("dump", "dump-q", "dump-v", "restore-v", "restore-q", "restore")}
    assert err["dump-q"] == err["restore-q"] == ""
    assert err["dump"].startswith("kvbroker: kvs dump: 5 keys (113 bytes of values)"), err
    assert err["dump-v"].startswith("a.b.c\nw\nx\ny -> linkedthing\nz -> smurf::otherthing\n")
    assert err["restore-v"].startswith("a.b.c\nw\nx\ny -> linkedthing\n"), err
    assert "5 keys (113 bytes of values" in err["restore"], err
    listing = [line.split()[-1] if " -> " not in line else " ".join(line.split()[-3:])
               for line in out.splitlines()]
    assert listing == ["a/b/c", "w", "x", "y -> linkedthing", "z -> smurf::otherthing"], out

    # "verify that exact KVS content was restored", on the restored statedir
    inst = await start_instance(size=2, statedir=str(tmp_path / "test_bak"))
    out = await script(inst, """
        kvbroker kvs version
        kvbroker kvs get a.b.c
        test "$(kvbroker exec -r 1 -- kvbroker kvs get x)" = "$(cat x.val)"
        kvbroker kvs readlink y z
        kvbroker kvs get w
        """, tmp_path)
    assert out == "0\ntestkey\nlinkedthing\nsmurf::otherthing\nfoobar\n"

    # "now restore to key and verify content"; "try dump - | restore - to key"
    out = await script(inst, """
        kvbroker kvs restore -q --key zz foo.tar
        kvbroker kvs dump -q - | kvbroker kvs restore -q --key yy -
        kvbroker kvs get zz.a.b.c yy.zz.a.b.c yy.a.b.c
        test "$(kvbroker kvs get yy.zz.x)" = "$(cat x.val)"
        kvbroker kvs readlink zz.z yy.zz.z yy.zz.y
        kvbroker kvs get yy.zz.w
        """, tmp_path)
    assert out == ("testkey\ntestkey\ntestkey\nsmurf::otherthing\nsmurf::otherthing\n"
                   "linkedthing\nfoobar\n")

    # "dump ignores empty kvs directories": a departure, kvbroker keeps them;
    # "restore ignores directories added by tar of filesystem"
    out = await script(inst, """
        kvbroker kvs mkdir empty
        kvbroker kvs dump -q foo3.tar
        tar tf foo3.tar | grep empty
        mkdir tmp
        cd tmp && tar xf ../foo3.tar && tar cf - . | kvbroker kvs restore -q --key test -
        kvbroker kvs get test.a.b.c test.yy.zz.w
        kvbroker kvs readlink test.z
        kvbroker kvs ls -d test.empty
        """, tmp_path)
    assert out == "empty/\ntestkey\nfoobar\nsmurf::otherthing\ntest.empty\n"

    # "Cover UTF-8 keys"
    out = await script(inst, """
        kvbroker kvs put ƒuzzybunny=42
        kvbroker kvs dump -q --key . wide.tar
        tar tf wide.tar | grep uzzy
        kvbroker kvs restore -q --key wide wide.tar
        kvbroker kvs get wide.ƒuzzybunny
        """, tmp_path)
    assert out == "ƒuzzybunny\n42\n"


def _bigdump() -> bytes:
    """Flux's bigdump.tar: big/{tiny,big,small,med,med2}blob of 1, 12, 3, 6
    and 6 MiB of zeros."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mib in (("tinyblob", 1), ("bigblob", 12), ("smallblob", 3),
                          ("medblob", 6), ("med2blob", 6)):
            info = tarfile.TarInfo(f"big/{name}")
            info.size = mib << 20
            tar.addfile(info, io.BytesIO(bytes(info.size)))
    return buf.getvalue()


async def test_t2807_size_limit(start_instance, tmp_path) -> None:
    (tmp_path / "bigdump.tar").write_bytes(_bigdump())
    inst = await start_instance(size=1)
    out = await script(inst, """
        kvbroker kvs restore --key=foo bigdump.tar
        kvbroker kvs restore --size-limit=10485760 --key=foo bigdump.tar
        kvbroker kvs ls foo.big
        """, tmp_path)
    lines = out.splitlines()
    assert lines[0] == "med2blob     medblob      smallblob    tinyblob", out
    assert lines[1].startswith("kvbroker: kvs restore: 5 keys (29360128 bytes of values"), out
    # "exceeds": the value left out is named
    assert lines[2] == ("kvbroker: kvs restore: skipped big/bigblob: 12582912 bytes, "
                        "over the size limit of 10485760"), out
    assert lines[3].startswith("kvbroker: kvs restore: 4 keys (16777216 bytes of values"), out
