"""``kvs.diff``: the keys that differ between two roots (a kvbroker extension).

Unit tests drive the pure engine (:mod:`kvs.diff`) on trees the commit
engine builds, and check it against a brute-force comparison of the two
trees flattened; integration tests run real instances: catching up after a
gap with ``watch_keys``, the CLI, and what a guest may compare.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import random
from typing import Any

import pytest
from test_broker_support import run_cli
from test_kvs_rpc_helpers import GUEST_UID, commit, errnum, getroot, put, run_guest, unlink

from broker.content import blobref
from broker.errors import ErrnoError, RemoteError
from kvs import shards, treeobj, txn
from kvs.client import KVS, SyncKVS
from kvs.diff import Diff, diff
from kvs.treeobj import BlobCache, NeedBlobs, TreeObj


class Tree:
    """A namespace kept in a dict of blobs, written by the commit engine."""

    def __init__(self) -> None:
        ref, data = txn.empty_root()
        self.blobs: dict[str, bytes] = {ref: data}
        self.root = ref

    def commit(self, *ops: dict[str, Any]) -> str:
        result = txn.apply(BlobCache(self.blobs), self.root, list(ops))
        self.blobs.update(result.new_blobs)
        self.root = result.rootref
        return self.root


def _put(key: str, value: str) -> dict[str, Any]:
    return {"key": key, "flags": 0, "dirent": treeobj.val(value.encode())}


def _entry(key: str, dirent: TreeObj | None) -> dict[str, Any]:
    return {"key": key, "flags": 0, "dirent": dirent}


def flatten(blobs: dict[str, bytes], root: str) -> dict[str, TreeObj]:
    """Every key of the tree with its entry: values, symlinks, empty dirs."""
    cache = BlobCache(blobs)
    out: dict[str, TreeObj] = {}

    def walk(prefix: str, obj: TreeObj) -> None:
        ents = shards.entries(cache, obj)
        if not ents and prefix:
            out[prefix] = treeobj.dir_()
        for name, e in ents.items():
            key = f"{prefix}.{name}" if prefix else name
            if e["type"] == "dirref":
                walk(key, cache.get_obj(e["data"][0]))
            else:
                out[key] = e
    walk("", cache.get_obj(root))
    return out


def brute_force(blobs: dict[str, bytes], old: str, new: str) -> list[str]:
    a, b = flatten(blobs, old), flatten(blobs, new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def brute_force_status(blobs: dict[str, bytes], old: str, new: str) -> dict[str, str]:
    """How each key of the flattened trees changed: only new has it, only old, both."""
    a, b = flatten(blobs, old), flatten(blobs, new)
    return {k: "added" if k not in a else "removed" if k not in b else "changed"
            for k in brute_force(blobs, old, new)}


def changes(cache: BlobCache, old: str, new: str, key: str = ".") -> dict[str, str]:
    work = Diff(cache, old, new, key)
    keys = work.run()
    status = work.changes()
    assert list(status) == keys  # the same keys, in the same order
    return dict(status)


# ---------------------------------------------------------------- the engine


def test_every_kind_of_change_is_a_key() -> None:
    t = Tree()
    r1 = t.commit(_put("a.b", "1"), _put("a.c", "2"), _put("gone", "3"), _put("same", "4"),
                  _put("v2d", "5"), _put("d2v.x", "6"), _put("d2v.y", "7"),
                  _entry("link", treeobj.symlink("a.b")), _entry("empty", treeobj.dir_()))
    r2 = t.commit(_put("a.b", "changed"), _entry("gone", None), _put("new.deep.k", "8"),
                  _entry("v2d", treeobj.dir_({"z": treeobj.val(b"9")})), _put("d2v", "now"),
                  _entry("link", treeobj.symlink("a.c")), _entry("empty", None),
                  _entry("fresh", treeobj.dir_()))
    expect = ["a.b", "d2v", "d2v.x", "d2v.y", "empty", "fresh", "gone", "link",
              "new.deep.k", "v2d", "v2d.z"]
    cache = BlobCache(t.blobs)
    assert diff(cache, r1, r2) == expect == brute_force(t.blobs, r1, r2)
    assert diff(cache, r2, r1) == expect  # either way round
    assert diff(cache, r1, r1) == []


def test_each_key_says_how_it_changed() -> None:
    """A key is a value, a symlink or an empty directory: added when only
    the new tree has it, removed when only the old one does, changed when
    both do (a value that became a directory with entries is removed, its
    new keys added, as git reports a file replaced by a directory)."""
    t = Tree()
    r1 = t.commit(_put("a.b", "1"), _put("gone", "3"), _put("same", "4"), _put("v2d", "5"),
                  _put("d2v.x", "6"), _put("d2v.y", "7"), _put("v2e", "8"), _put("v2l", "9"),
                  _entry("link", treeobj.symlink("a.b")), _entry("empty", treeobj.dir_()),
                  _entry("filled", treeobj.dir_()), _put("emptied.k", "1"))
    r2 = t.commit(_put("a.b", "changed"), _entry("gone", None), _put("new.deep.k", "8"),
                  _entry("v2d", treeobj.dir_({"z": treeobj.val(b"9")})), _put("d2v", "now"),
                  _entry("v2e", treeobj.dir_()), _entry("v2l", treeobj.symlink("a.b")),
                  _entry("link", treeobj.symlink("a.c")), _entry("empty", None),
                  _entry("fresh", treeobj.dir_()), _put("filled.k", "1"),
                  _entry("emptied.k", None))
    expect = {"a.b": "changed", "d2v": "added", "d2v.x": "removed", "d2v.y": "removed",
              "emptied": "added", "emptied.k": "removed", "empty": "removed",
              "filled": "removed", "filled.k": "added", "fresh": "added", "gone": "removed",
              "link": "changed", "new.deep.k": "added", "v2d": "removed", "v2d.z": "added",
              "v2e": "changed", "v2l": "changed"}
    cache = BlobCache(t.blobs)
    assert changes(cache, r1, r2) == expect == brute_force_status(t.blobs, r1, r2)
    swap = {"added": "removed", "removed": "added", "changed": "changed"}
    assert changes(cache, r2, r1) == {k: swap[v] for k, v in expect.items()}
    assert changes(cache, r1, r2, "v2d") == {"v2d": "removed", "v2d.z": "added"}
    assert changes(cache, r1, r1) == {}


def test_a_kind_is_the_same_whatever_rounds_the_diff_took() -> None:
    """Run cold, one level of blobs fetched a round, the kinds are those of
    a diff with every blob at hand: they depend on the two entries at a key,
    not on when the work got there."""
    t = Tree()
    deep = ".".join(f"l{i}" for i in range(8))
    r1 = t.commit(_put(f"{deep}.v", "1"), _entry(f"{deep}.e", treeobj.dir_()),
                  _put(f"{deep}.d.x", "2"), *[_put(f"wide.k{i}", "w") for i in range(300)])
    r2 = t.commit(_entry(f"{deep}.v", treeobj.dir_({"z": treeobj.val(b"3")})),
                  _put(f"{deep}.e", "now a value"), _entry(f"{deep}.d.x", None),
                  _entry("wide.k7", treeobj.dir_()), _entry("wide.k8", None))
    have = {r1: t.blobs[r1], r2: t.blobs[r2]}
    work = Diff(BlobCache(have), r1, r2)
    rounds = 0
    while True:
        try:
            work.run()
            break
        except NeedBlobs as need:
            rounds += 1
            have.update((ref, t.blobs[ref]) for ref in need.refs)
    assert rounds >= 8
    expect = {f"{deep}.d": "added", f"{deep}.d.x": "removed", f"{deep}.e": "changed",
              f"{deep}.v": "removed", f"{deep}.v.z": "added", "wide.k7": "changed",
              "wide.k8": "removed"}
    assert work.changes() == expect == changes(BlobCache(t.blobs), r1, r2)
    assert expect == brute_force_status(t.blobs, r1, r2)


def test_a_directory_that_becomes_empty_or_stops_being_is_a_key() -> None:
    t = Tree()
    r1 = t.commit(_entry("jobs.a", treeobj.dir_()))
    r2 = t.commit(_put("jobs.a.b", "1"))
    r3 = t.commit(_entry("jobs.a.b", None))
    cache = BlobCache(t.blobs)
    assert diff(cache, r1, r2) == ["jobs.a", "jobs.a.b"] == brute_force(t.blobs, r1, r2)
    assert diff(cache, r2, r3) == ["jobs.a", "jobs.a.b"] == brute_force(t.blobs, r2, r3)
    assert diff(cache, r1, r3) == []


def test_a_key_scopes_the_diff_and_links_are_not_followed() -> None:
    t = Tree()
    r1 = t.commit(_put("dir.a", "1"), _put("dir.b", "2"), _put("other", "x"),
                  _entry("ln", treeobj.symlink("dir")))
    r2 = t.commit(_put("dir.a", "changed"), _put("other", "y"))
    cache = BlobCache(t.blobs)
    assert diff(cache, r1, r2, "dir") == ["dir.a"]
    assert diff(cache, r1, r2, "dir.b") == []
    assert diff(cache, r1, r2, "ln") == []  # the link did not change; its target did
    with pytest.raises(ErrnoError) as exc:  # (not an empty answer: its target changed)
        diff(cache, r1, r2, "ln.a")
    assert exc.value.errnum == errno.EINVAL and "passes through the symlink ln" in str(exc.value)
    assert diff(cache, r1, r2, "other.below") == []  # a path through a value: nothing
    assert diff(cache, r1, r2, "nowhere") == []


def test_a_link_that_came_or_went_above_the_key_is_the_answer() -> None:
    """A watch of ``a.b`` reports ``a`` when ``a`` becomes a symlink (a
    directory above it replaced); a diff of ``a.b`` across that change
    answers the same, either way, instead of refusing the path."""
    t = Tree()
    r1 = t.commit(_put("a.b", "1"), _put("c.b", "2"))
    r2 = t.commit(_entry("a", treeobj.symlink("c")))
    r3 = t.commit(_entry("a", treeobj.symlink("elsewhere")))
    cache = BlobCache(t.blobs)
    assert diff(cache, r1, r2, "a.b") == ["a"] == diff(cache, r2, r1, "a.b")
    assert diff(cache, r2, r3, "a.b") == ["a"]  # another target: the link changed
    # how: as a diff of the whole tree says of a (a.b, the other key, is out of scope)
    assert changes(cache, r1, r2, "a.b") == {"a": "added"}  # (a directory with entries
    assert changes(cache, r2, r1, "a.b") == {"a": "removed"}  # is not a key)
    assert changes(cache, r2, r3, "a.b") == {"a": "changed"}
    assert changes(cache, r1, r2)["a"] == "added"
    r4 = t.commit(_entry("a", treeobj.dir_()))  # an empty directory is a key
    assert changes(cache, r4, r3, "a.b") == {"a": "changed"}


@pytest.mark.parametrize("seed", range(6))
def test_hashed_directories_diff_as_the_flattened_trees_do(monkeypatch, seed) -> None:
    """Random puts, replaces, unlinks and directory swaps into directories
    sharded three levels deep: the diff of every pair of versions is the
    brute-force comparison of the two trees flattened."""
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)
    rng = random.Random(seed)
    t = Tree()
    roots = [t.root]
    for _ in range(12):
        ops = []
        for _ in range(rng.randint(1, 25)):
            d, k = rng.choice("xyz"), f"k{rng.randint(0, 60)}"
            roll = rng.random()
            if roll < 0.5:
                ops.append(_put(f"{d}.{k}", str(rng.random())))
            elif roll < 0.6:  # into what may be an empty directory (or replace a value)
                ops.append(_put(f"{d}.{k}.v", str(rng.random())))
            elif roll < 0.9:
                ops.append(_entry(f"{d}.{k}", None))
            else:
                ops.append(_entry(f"{d}.{k}", treeobj.dir_()))
        roots.append(t.commit(*ops))
    cache = BlobCache(t.blobs)
    for old in roots[::3]:
        for new in roots[1::2]:
            assert diff(cache, old, new) == brute_force(t.blobs, old, new)
            assert changes(cache, old, new) == brute_force_status(t.blobs, old, new)


class CountingStore(dict[str, bytes]):
    """A blob store that counts the blobs read from it."""

    reads = 0

    def get(self, ref: str, default: Any = None) -> Any:  # type: ignore[override]
        self.reads += 1
        return super().get(ref, default)


def test_only_what_changed_is_read() -> None:
    """One key changed in a directory of 5,000: the diff reads the path to
    it (a handful of blobs), not the directory."""
    t = Tree()
    t.commit(*[_put(f"big.k{i}", str(i)) for i in range(5000)])
    old = t.root
    new = t.commit(_put("big.k1234", "changed"))
    store = CountingStore(t.blobs)
    assert diff(BlobCache(store), old, new) == ["big.k1234"]
    assert store.reads <= 12, store.reads


class CountingCache(BlobCache):
    """A blob cache that counts the tree objects asked of it."""

    asked = 0

    def get_obj(self, ref: str) -> TreeObj | None:
        self.asked += 1
        return super().get_obj(ref)


def test_a_cold_diff_goes_on_where_it_stopped() -> None:
    """Each round of fetches reaches one level deeper; a :class:`Diff` run
    again goes on from there (starting over made a tree 250 levels deep cost
    250 full passes: 17 s on a cold rank)."""
    t = Tree()
    deep = ".".join(f"l{i}" for i in range(60))
    r1 = t.commit(_put(f"{deep}.leaf", "1"), *[_put(f"wide.k{i}", "w") for i in range(300)])
    r2 = t.commit(_put(f"{deep}.leaf", "2"), _put("wide.k3", "x"))
    have = {r1: t.blobs[r1], r2: t.blobs[r2]}
    cache = CountingCache(have)
    work = Diff(cache, r1, r2)
    rounds = 0
    while True:
        try:
            keys = work.run()
            break
        except NeedBlobs as need:
            rounds += 1
            have.update((ref, t.blobs[ref]) for ref in need.refs)
    assert keys == [f"{deep}.leaf", "wide.k3"]
    assert 60 <= rounds <= 62  # one level a round (both trees at once)...
    assert cache.asked < 6 * 62, cache.asked  # ...each level asked for a few times, not 60


def test_a_tree_deeper_than_the_recursion_limit() -> None:
    """Trees built blob by blob, 3,000 directories deep, differing at the bottom."""
    blobs: dict[str, bytes] = {}

    def chain(value: bytes) -> str:
        entry = treeobj.val(value)
        for _ in range(3000):
            data = treeobj.encode(treeobj.dir_({"d": entry}))
            ref = blobref.hash_blob(data)
            blobs[ref] = data
            entry = treeobj.dirref(ref)
        return ref

    old, new = chain(b"1"), chain(b"2")
    keys = diff(BlobCache(blobs), old, new)
    assert keys == [".".join(["d"] * 3000)]


def test_a_root_that_is_not_a_directory_is_einval() -> None:
    t = Tree()
    r1 = t.commit(_put("a", "1"))
    junk = b"not a tree object"
    ref = blobref.hash_blob(junk)
    value = treeobj.encode(treeobj.val(b"x"))
    vref = blobref.hash_blob(value)
    cache = BlobCache({**t.blobs, ref: junk, vref: value})
    for bad in (ref, vref):
        with pytest.raises(ErrnoError) as exc:
            diff(cache, r1, bad)
        assert exc.value.errnum == errno.EINVAL, exc.value


def test_missing_blobs_are_named_and_the_retry_completes() -> None:
    t = Tree()
    r1 = t.commit(_put("a.b", "1"), *[_put(f"h.k{i}", str(i)) for i in range(300)])
    r2 = t.commit(_put("a.b", "2"), _put("h.k5", "x"))
    have = {r1: t.blobs[r1], r2: t.blobs[r2]}
    rounds = 0
    while True:
        try:
            keys = diff(BlobCache(have), r1, r2)
            break
        except NeedBlobs as need:
            rounds += 1
            have.update((ref, t.blobs[ref]) for ref in need.refs)
    assert keys == ["a.b", "h.k5"] and 1 <= rounds <= 5


def test_more_keys_than_the_limit_is_eoverflow() -> None:
    t = Tree()
    r1 = t.root
    r2 = t.commit(*[_put(f"d.k{i}", "v") for i in range(20)])
    with pytest.raises(ErrnoError) as exc:
        diff(BlobCache(t.blobs), r1, r2, limit=10)
    assert exc.value.errnum == errno.EOVERFLOW
    assert len(diff(BlobCache(t.blobs), r1, r2, limit=20)) == 20


def test_a_directory_past_the_limit_is_eoverflow_before_its_shards_are_read() -> None:
    """A directory on one side only is at least as many keys as it has
    entries (its stored count): past the limit, ``EOVERFLOW`` without its
    shards -- a removed directory of 1M keys was read whole first (11 s,
    775 MB of rank 0, in a data-at-scale probe)."""
    t = Tree()
    r1 = t.root
    r2 = t.commit(*[_put(f"d.k{i}", "v") for i in range(2000)])
    root = treeobj.decode(t.blobs[r2])
    hdir = treeobj.decode(t.blobs[root["data"]["d"]["data"][0]])
    assert hdir["type"] == "hdir"
    unread = set(hdir["data"]["shards"].values())
    have = {ref: blob for ref, blob in t.blobs.items() if ref not in unread}
    for old, new in ((r1, r2), (r2, r1)):
        with pytest.raises(ErrnoError) as exc:
            diff(BlobCache(have), old, new, limit=100)
        assert exc.value.errnum == errno.EOVERFLOW


# ---------------------------------------------------------------- on real ranks


async def test_a_watcher_catches_up_after_a_gap(start_instance, connect) -> None:
    """The pattern docs/kvs.md shows: keep the rootref of the last change
    seen; after reconnecting, diff it with the root the new watch starts at.
    The keys are exactly those written meanwhile, read on rank 3."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    seq = await commit(h0, put("jobs.a", "1"), put("jobs.b", "2"), put("other", "x"))
    async with KVS(await connect(inst, 3)) as kvs3:
        # (a watch starts at the root its rank has: make it this version)
        await asyncio.wait_for(kvs3.wait_version(seq["rootseq"]), 10)
        async with kvs3.watch_keys("jobs") as w:
            first = await asyncio.wait_for(anext(w), 10)
        last = first.rootref
    # the watcher is gone; the namespace moves on
    await commit(h0, put("jobs.a", "changed"), put("other", "y"))
    seq = await commit(h0, put("jobs.c.d", "new"), unlink("jobs.b"))
    async with KVS(await connect(inst, 3)) as kvs3:
        await asyncio.wait_for(kvs3.wait_version(seq["rootseq"]), 10)
        async with kvs3.watch_keys("jobs") as w:
            now = await asyncio.wait_for(anext(w), 10)
            changed = ["jobs.a", "jobs.b", "jobs.c.d"]
            assert await asyncio.wait_for(kvs3.diff(last, now.rootref, "jobs"), 10) == changed
            assert await asyncio.wait_for(kvs3.diff(last, key="jobs"), 10) == changed
            await commit(h0, put("jobs.e", "later"))
            later = await asyncio.wait_for(anext(w), 10)
            assert list(later.keys) == ["jobs.e"]  # and the watch goes on
        # the same in one step: the first answer holds what changed since
        async with kvs3.watch_keys("jobs", since=last) as w:
            first = await asyncio.wait_for(anext(w), 10)
            assert first.initial and first.keys == ("jobs.a", "jobs.b", "jobs.c.d", "jobs.e")
            await commit(h0, put("jobs.f", "then"))
            then = await asyncio.wait_for(anext(w), 10)
            assert not then.initial and then.keys == ("jobs.f",)
        st = await asyncio.wait_for(kvs3.handle.rpc("kvs.stats-get", {}), 10)
        assert st["counts"]["diffs"] == 3


async def test_a_catch_up_that_fails_ends_the_watch(start_instance, connect) -> None:
    """The first iteration raises what kvs.diff answered, with what it was
    catching up from, and the watch is over: going on would have skipped the
    gap without a word (its next answer is no start)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    await commit(h0, put("jobs.a", "1"))
    async with KVS(await connect(inst, 1)) as kvs1:
        gone = "sha256-" + "0" * 64
        w = kvs1.watch_keys("jobs", since=gone)
        with pytest.raises(RemoteError) as exc:
            await asyncio.wait_for(anext(w), 10)
        assert exc.value.errnum == errno.ENOENT and f"catching up since {gone}" in str(exc.value)
        assert w.watch.done  # ended, not left running
        with pytest.raises(ErrnoError) as bad:  # (a malformed one: at once)
            kvs1.watch_keys("jobs", since="nonsense")
        assert bad.value.errnum == errno.EINVAL


async def test_since_the_last_answer_starts_no_earlier(start_instance, connect) -> None:
    """``since=`` the last KeyChanges seen (its rootref and its version):
    the new watch waits until its rank has that version, so it never starts
    behind it and reports the next commit twice."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    async with KVS(h0) as kvs0:
        async with kvs0.watch_keys("jobs") as w:
            await asyncio.wait_for(anext(w), 10)
            await commit(h0, put("jobs.a", "1"))
            last = await asyncio.wait_for(anext(w), 10)
        async with KVS(await connect(inst, 3)) as kvs3:
            async with kvs3.watch_keys("jobs", since=last) as w3:
                first = await asyncio.wait_for(anext(w3), 10)
                assert first.initial and first.rootseq >= last.rootseq
                assert first.keys == ()  # nothing since: not jobs.a again
                await commit(h0, put("jobs.b", "2"))
                assert (await asyncio.wait_for(anext(w3), 10)).keys == ("jobs.b",)
    # a version the namespace will not reach (removed and created again
    # since): the watch starts anyway, after SINCE_WAIT, and diffs from there
    await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": "again"}), 10)
    await commit(h0, put("x", "1"), ns="again")
    async with KVS(h0, "again") as again:
        async with again.watch_keys(".") as w:
            start = await asyncio.wait_for(anext(w), 10)
        late = dataclasses.replace(start, rootseq=start.rootseq + 1000)
        async with asyncio.timeout(10), again.watch_keys(".", since=late) as w:
            first = await anext(w)
            assert first.initial and first.keys == ()


async def test_diff_from_the_cli(start_instance, connect) -> None:
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    await commit(h, put("a.b", "1"), put("c", "2"))
    old = (await getroot(h))["rootref"]
    await commit(h, put("a.b", "9"), unlink("c"))
    rc, out, err = await run_cli("kvs", "diff", old, uri=inst.uri(1))
    assert (rc, out, err) == (0, "a.b\nc\n", "")
    rc, out, _ = await run_cli("kvs", "diff", "-k", "a", old, uri=inst.uri(1))
    assert (rc, out) == (0, "a.b\n")
    new = (await commit(h, put("a.d", "new"), put("c.x", "now a directory")))["rootref"]
    rc, out, err = await run_cli("kvs", "diff", "--name-status", old, new, uri=inst.uri(1))
    assert (rc, out, err) == (0, "M\ta.b\nA\ta.d\nD\tc\nA\tc.x\n", "")
    rc, out, err = await run_cli("kvs", "diff", "sha256-nope", uri=inst.uri(0))
    assert rc == 1 and out == "" and "Invalid argument" in err


async def test_a_follower_says_how_each_key_changed(start_instance, connect) -> None:
    """``kvs.diff`` on rank 2 answers ``changes`` beside ``keys`` (which
    stays as it was); ``KVS.diff(status=True)`` and the blocking facade give
    the mapping, and the plain call still a list."""
    inst = await start_instance(size=3, fanout=1)
    h0 = await connect(inst, 0)
    await commit(h0, put("jobs.a", "1"), put("jobs.b", "2"), put("jobs.v", "3"),
                 put("jobs.l", "x"))
    old = (await getroot(h0))["rootref"]
    seq = await commit(h0, put("jobs.a", "9"), unlink("jobs.b"), put("jobs.v.sub", "4"),
                       put("jobs.c", "5"), {"key": "jobs.l", "flags": 0,
                                            "dirent": treeobj.symlink("jobs.a")},
                       {"key": "jobs.e", "flags": 0, "dirent": treeobj.dir_()})
    expect = {"jobs.a": "changed", "jobs.b": "removed", "jobs.c": "added", "jobs.e": "added",
              "jobs.l": "changed", "jobs.v": "removed", "jobs.v.sub": "added"}
    h2 = await connect(inst, 2)
    async with KVS(h2) as kvs2:
        await asyncio.wait_for(kvs2.wait_version(seq["rootseq"]), 10)
        answer = await asyncio.wait_for(h2.rpc("kvs.diff", {"old": old, "key": "jobs"}), 10)
        assert answer["keys"] == list(expect)
        assert answer["changes"] == list(expect.values())
        got = await asyncio.wait_for(kvs2.diff(old, key="jobs", status=True), 10)
        assert got == expect and list(got) == list(expect)  # (in key order)
        assert await asyncio.wait_for(kvs2.diff(old, key="jobs"), 10) == list(expect)
        assert await asyncio.wait_for(kvs2.diff(old, key="jobs.v", status=True), 10) \
            == {"jobs.v": "removed", "jobs.v.sub": "added"}

    def blocking() -> tuple[dict[str, str], list[str]]:
        with SyncKVS(uri=inst.uri(1)) as kvs:
            kvs.wait_version(seq["rootseq"])
            return kvs.diff(old, key="jobs", status=True), kvs.diff(old, key="jobs")
    assert await asyncio.wait_for(asyncio.to_thread(blocking), 30) == (expect, list(expect))


async def test_malformed_diff_requests_are_eproto_or_einval(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h = await connect(inst, 0)
    root = (await getroot(h))["rootref"]
    for payload, want in (({}, errno.EPROTO), ({"old": 5}, errno.EPROTO),
                          ({"old": "nope"}, errno.EINVAL),
                          ({"old": root, "limit": 0}, errno.EPROTO),
                          ({"old": root, "key": 7}, errno.EPROTO),
                          ({"old": root, "new": 5}, errno.EPROTO),
                          ({"old": root, "new": "sha256-" + "0" * 64}, errno.ENOENT)):
        assert await errnum(h.rpc("kvs.diff", payload)) == want, payload
    still = await asyncio.wait_for(h.rpc("kvs.diff", {"old": root}), 10)
    assert still["keys"] == []  # still serving


@pytest.mark.skipif(__import__("os").getuid() != 0, reason="needs root to run as another uid")
async def test_a_guest_diffs_only_roots_of_its_own(start_instance, connect) -> None:
    """Roots are capabilities for the owner only: a guest's must be recent
    roots of a namespace of its own, so it cannot read another's tree."""
    inst = await start_instance(size=2, attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    await asyncio.wait_for(
        h0.rpc("kvs.namespace-create", {"namespace": "mine", "owner": GUEST_UID}), 10)
    await commit(h0, put("secret", "s3cr3t"))
    primary = (await getroot(h0))["rootref"]
    await commit(h0, put("k", "1"), ns="mine")
    old = (await getroot(h0, ns="mine"))["rootref"]
    await commit(h0, put("k", "2"), put("j", "3"), ns="mine")
    result = await asyncio.to_thread(run_guest, inst.uri(1), f"""
        async def body(h):
            out = {{}}
            for name, payload in (
                    ("own", {{"namespace": "mine", "old": "{old}"}}),
                    ("primary-root", {{"namespace": "mine", "old": "{primary}"}}),
                    ("primary-ns", {{"namespace": "primary", "old": "{primary}"}})):
                r = await call(h, "kvs.diff", payload)
                out[name] = r.get("ok", {{}}).get("keys", r.get("errnum"))
            return out
    """)
    assert result == {"own": ["j", "k"], "primary-root": errno.EPERM,
                      "primary-ns": errno.EPERM}
    # the owner's roots are capabilities: a missing one is ENOENT, not EPERM
    assert await errnum(h0.rpc("kvs.diff", {"namespace": "mine",
                                            "old": "sha256-" + "1" * 64})) == errno.ENOENT
