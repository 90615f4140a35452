"""Oversized input to a commit is refused where it enters, and loses nothing.

* Key names: a component over ``kvs.keys.MAX_NAME`` bytes or a key over
  ``MAX_KEY`` is ``ENAMETOOLONG`` for every op that creates it, on the rank
  the commit comes to (and in the client library, before anything is
  sent); reads and unlinks take any key, so what an older statedir holds
  under a longer one stays readable and removable.
* Values: a value over ``content.blob-size-limit`` is ``EFBIG`` on the
  follower it was committed to, with rank 0's message, instead of crossing
  the tree whole to be refused by rank 0's content store.

Reference: docs/kvs.md (Errors), docs/protocol.md (Keys, kvs.commit).
"""

from __future__ import annotations

import asyncio
import errno
import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
from test_kvs_rpc_helpers import (
    APPEND,
    READDIR,
    TREEOBJ,
    commit,
    dir_,
    errname,
    get,
    getroot,
    lookup,
    put,
    stats,
    symlink,
    unlink,
    val,
)

from broker.errors import ErrnoError, RemoteError
from kvs.archive import restore, restore_checkpoint
from kvs.client import KVS, TxnOps
from kvs.keys import MAX_KEY, MAX_NAME

FAST = 5.0
EXPECT = 64
LIMIT = 1 << 20  # content.blob-size-limit of the value tests


async def refusal(aw: Any, timeout: float = FAST) -> RemoteError:
    """The error an RPC fails with (fails the test if it succeeds or hangs)."""
    try:
        result = await asyncio.wait_for(aw, timeout)
    except RemoteError as exc:
        return exc
    raise AssertionError(f"expected an error, got {result!r}")


def too_long_ops() -> list[dict[str, Any]]:
    """One op of every kind that would create an overlong name."""
    name = "n" * (MAX_NAME + 1)
    path = ".".join(["p" * 1000] * 9)  # 9,008 bytes: each name fits, the key does not
    return [
        put(name, "v"),
        put(f"a.{name}.b", "v"),
        put(path, "v"),
        put("é" * (MAX_NAME // 2 + 1), "v"),  # 1,026 bytes in UTF-8, 513 characters
        put(name, "v", APPEND),
        put(name, dir_()),
        put(name, symlink("a")),
        put("link", symlink(name)),
        put("link", symlink(path)),
        put("link", symlink("." * MAX_KEY + "a")),  # stored as given: not normalised
        put("link", symlink("a", "N" * 256)),
        put("link", symlink("N" * 256 + "::a")),
        put("d", dir_({"x": dir_({name: val("v")})})),
    ]


async def test_overlong_key_names_are_refused_where_they_enter(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h3, put("warm", "up"))
    root = await getroot(h0)
    relays = (await stats(h3))["counts"]["relays"]
    failed = (await stats(h0))["counts"]["commits-failed"]
    for h in (h0, h3):
        for op in too_long_ops():
            exc = await refusal(commit(h, op))
            assert exc.errnum == errno.ENAMETOOLONG, (op["key"][:40], errname(exc.errnum))
            # the message names the limit and shows only the start of the key
            assert f"limit of {MAX_NAME} bytes" in exc.errstr \
                or f"limit of {MAX_KEY} bytes" in exc.errstr \
                or "limit of 255 characters" in exc.errstr, exc.errstr
            assert len(exc.errstr) < 200, exc.errstr
    assert await getroot(h0) == root
    # refused on rank 3 itself: nothing was relayed, rank 0 failed nothing
    assert (await stats(h3))["counts"]["relays"] == relays
    assert (await stats(h0))["counts"]["commits-failed"] == failed

    # the client library refuses them before sending anything
    kvs = KVS(h3)
    with pytest.raises(ErrnoError) as info:
        await kvs.put("k" * (10 << 20), 1)
    assert info.value.errnum == errno.ENAMETOOLONG
    assert len(info.value.errstr) < 200
    for build in (lambda t: t.put("x." + "n" * (MAX_NAME + 1), 1),
                  lambda t: t.mkdir(".".join(["p" * 1000] * 9)),
                  lambda t: t.symlink("l", "t" * (MAX_NAME + 1)),
                  lambda t: t.append("é" * (MAX_NAME // 2 + 1), "x")):
        with pytest.raises(ErrnoError) as info:
            build(TxnOps())
        assert info.value.errnum == errno.ENAMETOOLONG
    assert (await stats(h3))["counts"]["commits"] == 1  # (the first put's)

    # at the limits is fine, counted in bytes; reads, conditions and unlinks
    # of longer keys are no error
    at_limit = ".".join(["q" * (MAX_NAME - 1)] * 8)  # 8,191 bytes
    await commit(h3, put("n" * MAX_NAME, "a"), put("é" * (MAX_NAME // 2), "b"),
                 put(at_limit, "c"), put("link", symlink(at_limit)))
    assert await get(h3, "n" * MAX_NAME) == b"a"
    assert await get(h3, "link") == b"c"
    longer = "n" * (MAX_NAME + 1)
    assert (await refusal(lookup(h3, longer))).errnum == errno.ENOENT
    await commit(h3, unlink(longer), {"key": longer, "flags": EXPECT, "dirent": None})

    # through a symlink, the key it resolves to counts: the key sent and
    # the link's target each fit, joined they did not (a 16 KB key stored)
    target = ".".join(["d" * 999] * 8)  # 7,999 bytes
    await commit(h3, put("dl", symlink(target)))
    await commit(h3, put("dl.f", "fits"))  # 8,001 bytes
    assert await get(h3, f"{target}.f") == b"fits"
    exc = await refusal(commit(h3, put("dl." + "g" * 200, "x"), put("other", "y")))
    assert exc.errnum == errno.ENAMETOOLONG, exc
    assert "written through a symlink" in exc.errstr and len(exc.errstr) < 300, exc.errstr
    assert (await refusal(lookup(h3, "other"))).errnum == errno.ENOENT  # the whole txn
    await commit(h3, unlink("dl." + "g" * 200))  # (an unlink through it is no error)


async def test_keys_stored_before_the_limit_stay_readable_and_removable(
        start_instance, connect, tmp_path: Path) -> None:
    """A statedir written without the limit (here by an offline restore of
    an archive, which does not apply it) holds a key with a 5,000-byte name:
    it is read and removed as any other, and only a new write of such a
    key is refused."""
    long_name = "old" + "x" * 4997
    archive = tmp_path / "old.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path, data in ((f"top/{long_name}", b"kept"), (long_name, b"root"), ("short", b"s")):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    statedir = tmp_path / "state"
    restore_checkpoint(str(statedir), str(archive))
    inst = await start_instance(size=2, statedir=str(statedir))
    h = await connect(inst, 1)
    assert await get(h, f"top.{long_name}") == b"kept"
    assert await get(h, long_name) == b"root"
    assert long_name in (await lookup(h, "top", 1))["data"]
    exc = await refusal(commit(h, put(f"top.{long_name}", "new")))
    assert exc.errnum == errno.ENAMETOOLONG
    assert await get(h, f"top.{long_name}") == b"kept"
    # removed one at a time, under a top-level directory or at the root
    await KVS(h).unlink(f"top.{long_name}", long_name)
    assert (await lookup(h, "top", 1))["data"] == {}
    assert sorted((await lookup(h, ".", 1))["data"]) == ["short", "top"]
    await commit(h, put("after", "fine"))


@pytest.fixture
async def small_blobs(start_instance, connect):
    inst = await start_instance(size=4, fanout=2, attrs={"content.blob-size-limit": str(LIMIT)})
    return inst, await connect(inst, 0), await connect(inst, 3)


async def test_an_oversized_value_is_refused_on_the_follower(small_blobs) -> None:
    """A value over ``content.blob-size-limit`` committed through rank 3 is
    refused by rank 3, with the message of rank 0's content store; rank 0
    never sees it (rank 3 relayed nothing, rank 0 failed nothing)."""
    _, h0, h3 = small_blobs
    await commit(h3, put("warm", "up"))
    big = b"v" * (LIMIT + 1)
    # rank 0's content store's own refusal, for its message
    stored = await refusal(h0.rpc("content.store", {"data": big}))
    assert stored.errnum == errno.EFBIG
    root = await getroot(h0)
    relays = (await stats(h3))["counts"]["relays"]
    failed = (await stats(h0))["counts"]["commits-failed"]
    for ops in ([put("big", big)],
                [put("big", big, APPEND)],
                [put("small", "s"), put("d", dir_({"e": dir_({"big": val(big)})}))]):
        exc = await refusal(commit(h3, *ops))
        assert (exc.errnum, exc.errstr) == (errno.EFBIG, stored.errstr)
    assert (await stats(h3))["counts"]["relays"] == relays
    assert (await stats(h0))["counts"]["commits-failed"] == failed
    assert await getroot(h0) == root
    # a condition stores nothing: compared on rank 0, not refused
    exc = await refusal(commit(h3, {"key": "big", "flags": EXPECT,
                                    "dirent": val(big)}))
    assert exc.errnum == errno.ECANCELED
    # a value at the limit is stored
    await commit(h3, put("max", b"m" * LIMIT))
    obj = await lookup(h0, "max", TREEOBJ)
    assert obj["type"] == "valref"
    assert len(await get(h3, "max")) == LIMIT


async def test_errors_name_an_overlong_key_by_its_start(start_instance, connect) -> None:
    """Reads, conditions and unlinks take keys of any length; an error about
    such a key names its start (``kvs.keys.shown``), not the whole key sent
    back in the answer -- a megabyte for a megabyte's key, through rank 3
    and from rank 0 alike.  A key a commit could write is named whole."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h3, put("x", "v"))
    huge = "k" * (1 << 20)
    failures = [
        # a malformed condition (rank 0's engine: EPROTO)
        (errno.EPROTO, commit(h3, {"key": huge, "flags": EXPECT | APPEND, "dirent": val("v")})),
        # a condition that fails
        (errno.ECANCELED, commit(h3, {"key": huge, "flags": EXPECT, "dirent": val("v")})),
        # reads: a missing key, a value read as a directory (the raw key)
        (errno.ENOENT, lookup(h3, huge)),
        (errno.ENOTDIR, lookup(h3, "x" + "." * (1 << 20), READDIR)),
        # a dir dirent's entry name that is not a string (not a key the
        # limits check: refused by rank 0's validation)
        (errno.EINVAL, commit(h3, put("d", {"ver": 1, "type": "dir", "data": {
            huge.encode(): val("v")}}))),
        # a namespace no name can be (ENOTSUP, as for any unknown one), on a
        # follower and on rank 0
        (errno.ENOTSUP, lookup(h3, "x", ns=huge)),
        (errno.ENOTSUP, lookup(h0, "x", ns=huge)),
        (errno.ENOTSUP, commit(h3, put("x", "v"), ns=huge)),
    ]
    for errnum, aw in failures:
        exc = await refusal(aw)
        assert exc.errnum == errnum, (errname(exc.errnum), exc.errstr[:80])
        assert len(exc.errstr) < 200, (errname(errnum), len(exc.errstr))
    # kvs-watch answers with the same messages
    watch = h3.rpc_stream("kvs-watch.lookup", {"namespace": "primary",
                                               "key": "x" + "." * (1 << 20),
                                               "flags": READDIR})
    exc = await refusal(watch.next_message())
    assert exc.errnum == errno.ENOTDIR and len(exc.errstr) < 200, exc.errstr[:80]
    # a key within the limits is named whole
    at_limit = "q" * MAX_NAME
    exc = await refusal(lookup(h3, at_limit))
    assert exc.errstr == f"{at_limit}: no such key"


async def test_an_owners_restore_is_held_to_the_key_limits(start_instance, connect,
                                                           tmp_path: Path) -> None:
    """The instance owner's ``kvs restore`` stores the tree's blobs and
    commits one ``dirref``, which names none of its keys: an archive entry
    with a 1,025-byte name, a 9,008-byte path, or a symlink to an overlong target, became a key
    no commit may write.  It is refused (``ENAMETOOLONG``) before anything
    is stored or committed; an archive within the limits is restored."""
    inst = await start_instance(size=2)
    h = await connect(inst, 1)
    long_name = "x" * (MAX_NAME + 1)

    def archive(name: str, *entries: tarfile.TarInfo) -> Path:
        path = tmp_path / name
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for info in entries:
                data = b"v" * info.size
                tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
        return path

    def value(path: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(path)
        info.size = 1
        return info

    def link(path: str, target: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(path)
        info.type, info.linkname = tarfile.SYMTYPE, target
        return info

    stored = (await h.rpc("content.stats-get", {}, nodeid=0))["stored"]
    for bad in (archive("name.tar", value("ok"), value(f"top/{long_name}")),
                archive("path.tar", value("/".join(["p" * 1000] * 9))),
                archive("link.tar", value("ok"), link("l", "t" * (MAX_KEY + 1)))):
        with pytest.raises(ErrnoError) as info:
            await asyncio.wait_for(restore(KVS(h), str(bad), "r"), FAST)
        assert info.value.errnum == errno.ENAMETOOLONG, info.value
        assert len(info.value.errstr) < 200
        assert (await refusal(lookup(h, "r"))).errnum == errno.ENOENT
    assert (await h.rpc("content.stats-get", {}, nodeid=0))["stored"] == stored
    # the limits, not less
    target = ".".join(["t" * (MAX_NAME - 1)] * 8)  # 8,191 bytes
    good = archive("good.tar", value("n" * MAX_NAME), link("l", target))
    await asyncio.wait_for(restore(KVS(h), str(good), "r"), FAST)
    assert await get(h, "r." + "n" * MAX_NAME) == b"v"


async def test_a_nul_cannot_enter_through_a_dir_dirent_or_a_symlink(start_instance,
                                                                      connect) -> None:
    """A key with a NUL is EINVAL, but a ``dir`` dirent's entry name ``a\\0b``
    was stored (on rank 0 and through rank 3): listed by ``dir``, then
    readable and removable by no key (``d.a\\0b`` is EINVAL), only with its
    whole directory; so was a symlink to ``x\\0y``.  Refused where the
    commit enters, as a key with a NUL is."""
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h3, put("warm", "up"))
    root = await getroot(h0)
    for h in (h0, h3):
        for op in (put("d", dir_({"a\0b": val("v")})),
                   put("d", dir_({"e": dir_({"a\0b": val("v")})})),
                   put("l", symlink("x\0y")),
                   put("d", dir_({"l": symlink("x\0y")}))):
            exc = await refusal(commit(h, op))
            assert exc.errnum == errno.EINVAL and "NUL" in exc.errstr, exc.errstr
    assert await getroot(h0) == root


async def test_a_commit_under_too_many_directories_is_refused_where_it_enters(
        start_instance, connect) -> None:
    # each directory under a commit's keys is walked and rewritten on rank
    # 0's loop: 400 paths 256 components deep (102,000 directories in a 1 MB
    # commit) are E2BIG on the rank they enter, and nothing is relayed
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h3, put("warm", "up"))
    root = await getroot(h0)
    relays = (await stats(h3))["counts"]["relays"]
    deep = ".".join(["d"] * 255)
    for h in (h0, h3):
        exc = await refusal(commit(h, *(put(f"t{i}.{deep}", "v") for i in range(400))))
        assert exc.errnum == errno.E2BIG, errname(exc.errnum)
        assert "100000 directories" in exc.errstr
    assert await getroot(h0) == root
    assert (await stats(h3))["counts"]["relays"] == relays
    # many keys under few directories are fine, however deep
    await commit(h3, *(put(f"{deep}.k{i}", "v") for i in range(400)))
    assert await get(h3, f"{deep}.k399") == b"v"


async def test_a_malformed_op_is_refused_where_it_enters_and_fails_alone(
        start_instance, connect) -> None:
    # checked on the follower as rank 0 would check it: relayed with others,
    # it made their relay unsendable (val data nested deeper than msgpack
    # packs once wrapped in the relay) and failed them all, EHOSTUNREACH
    inst = await start_instance(size=4, fanout=2)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await commit(h3, put("warm", "up"))
    nested: Any = b"x"
    for _ in range(1020):  # as deep as a commit can carry it: a relay cannot
        nested = [nested]
    relayed = (await stats(h3))["counts"]["relayed"]
    bad_val = {"key": "bad", "flags": 0, "dirent": {"ver": 1, "type": "val", "data": nested}}
    bad_field = {"key": "bad", "flags": 0, "dirent": val("x"), "note": nested}
    # issued together: relayed together, the bad ones failed the good ones
    outcomes = await asyncio.gather(
        commit(h3, put("good1", "one")), commit(h3, bad_val), commit(h3, bad_field),
        commit(h3, put("good2", "two")), return_exceptions=True)
    assert not isinstance(outcomes[0], BaseException), outcomes[0]
    assert not isinstance(outcomes[3], BaseException), outcomes[3]
    assert isinstance(outcomes[1], RemoteError) and outcomes[1].errnum == errno.EINVAL, \
        outcomes[1]
    assert "val data must be bytes" in outcomes[1].errstr
    assert isinstance(outcomes[2], RemoteError) and outcomes[2].errnum == errno.EPROTO, \
        outcomes[2]
    assert "'note'" in outcomes[2].errstr
    assert await get(h3, "good1") == b"one" and await get(h3, "good2") == b"two"
    assert (await stats(h3))["counts"]["relayed"] == relayed + 2  # the good ones only
    messages = (await h3.rpc("broker.stats-get", {}))["messages"]
    assert messages["unroutable"] == messages["unencodable"] == 0
    assert (await refusal(commit(h0, bad_val))).errnum == errno.EINVAL  # rank 0 alike
    # flags that are a bool, or no dirent: rank 0 refuses them, and so does
    # the follower now (it relayed them, to be refused there)
    for op in ({"key": "b", "flags": True, "dirent": val("x")}, {"key": "b", "flags": 0}):
        for h in (h3, h0):
            exc = await refusal(commit(h, op))
            assert exc.errnum == errno.EPROTO, (op, exc)
    assert (await stats(h3))["counts"]["relayed"] == relayed + 2
