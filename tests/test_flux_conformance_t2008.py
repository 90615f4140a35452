"""flux-core t/t2008-althash.t: an instance started with another hash for
its content store and KVS (``content.hash``).

kvbroker's default is ``sha256`` (Flux's is ``sha1``: a documented
difference, docs/kvs.md "Differences from flux kvs"); ``sha1`` is the
other one it takes.  Flux's cases, in order, and what each becomes:

1.  started with ``content.hash=sha1``, ``getattr`` says so -> ``kvbroker
    start -S content.hash=sha1 -- kvbroker attr get content.hash``; and the
    hash is the one in use: the KVS's root, a stored blob and the content
    stats are ``sha1`` on every rank.
2.  the same with ``sha256``.
3.  ``sha256`` with the ``content-files`` backing module in a statedir, its
    files named by the hash -> kvbroker has one backing store, rank 0's
    SQLite file (docs/protocol.md, Content store): no ``content-files``.
    What the case pins, that the store keeps blobs under the instance's
    hash, is checked in that file: its ``objects`` table is keyed by the
    raw digest, 32 bytes for ``sha256`` and 20 for ``sha1``, and a
    restart on the statedir reads the KVS back.
4.  starting with an invalid hash fails hard -> ``-S
    content.hash=wronghash`` stops the start (exit 2, naming the hashes
    it takes) before the command runs; ``SHA1`` (case differs) too; and
    from a bootstrap file's ``[attrs]`` (``kvbroker broker -c``).

Beyond the script:

* A difference, documented (docs/kvs.md, kvs dump/restore: "an instance
  started there with ``-S content.hash=sha1`` reads them all the same"):
  a statedir written under one hash and started under the other reads its
  tree, and new blobs are named by the new hash.  Flux's content cache
  refuses a blobref whose hash is not the instance's size (``EPROTO``).
* A rank started alone (``kvbroker broker -S content.hash=sha1``) under
  a rank 0 of ``sha256`` is refused at its hello, naming ``content.hash``
  on both sides, and exits 1 (docs/protocol.md, overlay handshake).  It
  joined until 2026-12-05, and its ``content store`` printed a ``sha1-``
  blobref that rank 0, which stored the blob under ``sha256``, did not
  know: once the rank's cache let the blob go, the blobref the client was
  given named nothing.  (Behind that refusal a follower also checks its
  parent's answer to a store, as Flux's does: ``EIO`` if the blobrefs
  differ.)
* ``-S content.hash='sha1 '`` is the hash read back (``attr get
  content.hash``: ``sha1``), so ``kvbroker kvs restore``, which names
  blobs by that attribute, works; until 2026-12-05 the attribute kept the
  blanks the parser forgave, and the restore failed ``unsupported content
  hash 'sha1 '`` (found by this file).
tests/test_content_rpc.py has the RPC forms (test_sha1,
test_unsupported_hash_fails_start).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import sqlite3

import pytest
from test_broker_support import run_cli
from test_kvs_cli import KVB, client_env, run
from test_multihost import brokers as brokers  # noqa: F401  (the fixture)
from test_multihost import keyed_config

from broker.content.module import ContentModule
from broker.errors import ErrnoError
from broker.module import ModuleContext

T = 60


def sha(name: str, data: bytes) -> str:
    return f"{name}-{hashlib.new(name, data).hexdigest()}"


async def start(*args: str, cwd: str | None = None) -> tuple[int, str, str]:
    """``kvbroker start ARGS`` (its command after ``--`` in ARGS)."""
    res = await run([KVB, "start", *args], client_env("local:///nonexistent"),
                    cwd=cwd, timeout=T)
    return res.rc, res.text, res.err


SCRIPT = """
kvbroker attr get content.hash
kvbroker exec -r 1 -- kvbroker attr get content.hash
kvbroker kvs put a=1
kvbroker kvs getroot -b | cut -d- -f1
echo abc | kvbroker exec -r 1 -- kvbroker content store
kvbroker exec -r 1 -- kvbroker stats content -p hash
"""


@pytest.mark.parametrize("name", ["sha1", "sha256"])
async def test_t2008_started_with_content_hash(name) -> None:
    """Cases 1-2: the attribute, on every rank, and the hash in use."""
    rc, out, err = await start("--size", "2", "-S", f"content.hash={name}", "--",
                               "sh", "-ec", SCRIPT)
    assert (rc, err) == (0, "")
    assert out.splitlines() == [name, name, name, sha(name, b"abc\n"), f'"{name}"']


def digest_sizes(statedir) -> set[int]:
    db = sqlite3.connect(statedir / "content.sqlite")
    try:
        return {n for (n,) in db.execute("SELECT DISTINCT length(hash) FROM objects")}
    finally:
        db.close()


@pytest.mark.parametrize(("name", "size"), [("sha256", 32), ("sha1", 20)])
async def test_t2008_the_store_keeps_blobs_under_its_hash(tmp_path, name, size) -> None:
    """Case 3 where it applies: the statedir's store keys blobs by the
    instance's hash (its raw digest), and a restart reads them back."""
    statedir = tmp_path / "state"
    rc, out, err = await start("--statedir", str(statedir), "-S", f"content.hash={name}",
                               "--", "sh", "-ec", "kvbroker kvs put a=1; "
                               "kvbroker attr get content.hash")
    assert (rc, out, err) == (0, f"{name}\n", "")
    assert digest_sizes(statedir) == {size}
    rc, out, err = await start("--statedir", str(statedir), "-S", f"content.hash={name}",
                               "--", "kvbroker", "kvs", "get", "a")
    assert (rc, out, err) == (0, "1\n", "")


@pytest.mark.parametrize("bad", ["wronghash", "SHA1", "sha-1", ""])
async def test_t2008_an_invalid_hash_fails_hard(tmp_path, bad) -> None:
    """Case 4: refused before the command runs, naming the attribute and
    what it takes."""
    rc, out, err = await start("-S", f"content.hash={bad}", "--", "touch", "ran",
                               cwd=str(tmp_path))
    assert (rc, out) == (2, "")
    assert err == (f"kvbroker: start: content.hash: unknown hash {bad!r} "
                   "(choose from sha1, sha256)\n"), err
    assert not (tmp_path / "ran").exists()


async def test_t2008_an_invalid_hash_in_a_bootstrap_file_fails_hard(tmp_path) -> None:
    """Case 4 for a rank started from a bootstrap file (``[attrs]``)."""
    conf = tmp_path / "conf.toml"
    conf.write_text('[bootstrap]\n[attrs]\n"content.hash" = "wronghash"\n')
    res = await run([KVB, "broker", "-c", str(conf), "--", "touch", "ran"],
                    client_env("local:///nonexistent"), cwd=str(tmp_path), timeout=T)
    assert (res.rc, res.text) == (2, "")
    assert res.err == (f"kvbroker: broker: {conf}: [attrs] content.hash: unknown hash "
                       "'wronghash' (choose from sha1, sha256)\n"), res.err
    assert not (tmp_path / "ran").exists()


async def test_t2008_a_statedir_read_under_the_other_hash(tmp_path) -> None:
    """The documented difference: a sha1 store started under sha256 (the
    default) reads its tree, and adds sha256 blobs; under sha1 again, both
    keys read."""
    statedir = str(tmp_path / "state")
    rc, out, err = await start("--statedir", statedir, "-S", "content.hash=sha1", "--",
                               "sh", "-ec", "kvbroker kvs put a=1; kvbroker kvs getroot -b")
    assert rc == 0 and out.startswith("sha1-"), (out, err)
    rc, out, err = await start("--statedir", statedir, "--", "sh", "-ec",
                               "kvbroker kvs get a; kvbroker kvs put b=2; "
                               "kvbroker kvs getroot -b | cut -d- -f1")
    assert (rc, out, err) == (0, "1\nsha256\n", "")
    rc, out, err = await start("--statedir", statedir, "-S", "content.hash=sha1", "--",
                               "kvbroker", "kvs", "get", "a", "b")
    assert (rc, out, err) == (0, "1\n2\n", "")
    assert digest_sizes(tmp_path / "state") == {20, 32}


async def test_t2008_a_hash_given_with_blanks_is_the_hash_in_use(tmp_path) -> None:
    """A value taken with blanks is the value read back (or it is refused,
    exit 2): a client that names blobs by the attribute (``kvs restore``)
    names them as the store does."""
    rc, out, err = await start(
        "-S", "content.hash=sha1 ", "--", "sh", "-c",
        "kvbroker attr get content.hash; kvbroker kvs put a.b=1; "
        "kvbroker kvs dump d.tar 2>/dev/null; kvbroker kvs restore --key x d.tar 2>&1 "
        "| sed 's/ (tree .*//'; kvbroker kvs get x.a.b", cwd=str(tmp_path))
    if rc == 2:  # refused: as good
        assert out == "" and "content.hash" in err, err
        return
    assert out.splitlines()[0] == "sha1", out
    assert out.splitlines()[1:] == ["kvbroker: kvs restore: 1 key (1 byte of values, 3 blobs "
                                    "sent to the store) to x", "1"], out
    assert (rc, err) == (0, "")


async def test_t2008_a_rank_of_another_hash_never_hands_out_a_ref_rank_0_lacks(
        tmp_path, brokers) -> None:  # noqa: F811
    """Each rank reads its own ``-S`` (``kvbroker broker``): a rank of
    another hash than rank 0's stays out -- its hello is refused, naming
    ``content.hash`` on both sides, and it exits 1 -- so it never gives a
    blobref that names nothing (it joined, and its ``content store`` gave
    ``sha1-a9993e...`` for a blob rank 0 kept as ``sha256-ba7816...``).
    A rank of the instance's hash then joins, and its blobrefs load on
    rank 0."""
    config = await keyed_config(tmp_path, 2, 2)
    r0 = await brokers(config, 0)
    r1 = await brokers(config, 1, "-S", "content.hash=sha1")
    rc = await asyncio.wait_for(r1.proc.wait(), T)
    err = (tmp_path / "stderr1-1").read_text()
    assert rc == 1, err
    assert ("refused this rank's hello: this rank's content.hash is 'sha1', its parent's "
            "(rank 0) is 'sha256': every rank needs the instance's content.hash "
            "(-S content.hash=sha256)") in err, err
    logged = (tmp_path / "stderr0-0").read_text()
    assert "refusing overlay peer: a hello as rank 1" in logged, logged
    r1 = await brokers(config, 1)
    await r0.ready()
    rc, out, err = await run_cli("content", "store", uri=r1.uri, input=b"abc", timeout=T)
    assert (rc, out.strip()) == (0, "sha256-" + hashlib.sha256(b"abc").hexdigest()), err
    rc0, data, err0 = await run_cli("content", "load", out.strip(), uri=r0.uri, timeout=T)
    assert (rc0, data) == (0, "abc"), (out, err0)


def test_t2008_a_follower_fails_a_store_its_parent_named_otherwise(tmp_path) -> None:
    """Behind the refusal at the hello, as Flux's follower does: when the
    parent answers a store with other blobrefs than this rank's hash gives
    (the parent's hash differs), the store fails ``EIO``, naming
    ``content.hash``, rather than answer a blobref rank 0 lacks."""
    ctx = ModuleContext(rank=1, size=2, fanout=2,
                        attrs={"rundir": str(tmp_path), "content.hash": "sha1"},
                        owner_uid=os.getuid(), log=logging.getLogger("test"))
    follower = ContentModule(ctx)
    ours = "sha1-" + hashlib.sha1(b"abc").hexdigest()
    assert follower._named_as_upstream([b"abc"], {"blobrefs": [ours]}) == [ours]
    theirs = "sha256-" + hashlib.sha256(b"abc").hexdigest()
    with pytest.raises(ErrnoError) as refused:
        follower._named_as_upstream([b"abc"], {"blobrefs": [theirs]})
    assert refused.value.errnum == errno.EIO
    assert refused.value.errstr == (
        f"this rank's content.hash (sha1) is not the instance's: rank 0 stored the blobs "
        f"under other blobrefs ({theirs}, here {ours})")
