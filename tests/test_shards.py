"""Hashed directories: commit cost stays flat as a directory grows.

Structural checks only (blob counts and sizes, trie invariants), no timing.
"""

import random

import pytest

from broker.errors import ErrnoError
from kvs import shards
from kvs import treeobj as T
from kvs.lookup import READDIR, TREEOBJ, lookup
from kvs.txn import apply, empty_root


class Kvs:
    def __init__(self) -> None:
        self.store: dict[str, bytes] = {}
        self.root, blob = empty_root()
        self.store[self.root] = blob
        self.cache = T.BlobCache(self.store)

    def commit(self, *ops: dict):
        res = apply(self.cache, self.root, list(ops))
        self.store.update(res.new_blobs)
        self.root = res.rootref
        return res

    def dir_ref(self, key: str) -> str:
        return lookup(self.cache, self.root, key, TREEOBJ)["data"][0]


def put(key: str, value: bytes) -> dict:
    return {"key": key, "flags": 0, "dirent": T.val(value)}


def unlink(key: str) -> dict:
    return {"key": key, "flags": 0, "dirent": None}


def check_trie(cache: T.BlobCache, ref: str) -> tuple[dict[str, dict], int]:
    """Check every invariant of the directory in blob ``ref``; return (entries, depth)."""
    top = cache.get_obj(ref)
    limit = shards.SHARD_THRESHOLD
    if top["type"] == "dir":
        assert len(top["data"]) <= limit
        return dict(top["data"]), 0
    assert top["type"] == "hdir" and top["data"]["depth"] == 0
    assert top["data"]["count"] >= limit // 2
    out: dict[str, dict] = {}
    max_depth = 0

    def walk(node: dict, prefix: str) -> int:
        nonlocal max_depth
        depth = node["data"]["depth"]
        assert depth == len(prefix)
        max_depth = max(max_depth, depth + 1)
        total = 0
        assert node["data"]["shards"], "no empty nodes"
        # (the memoized node as the engine made it: its digits in order, so
        # encode_built packed it without a canonical copy)
        assert list(node["data"]["shards"]) == sorted(node["data"]["shards"])
        for digit, child_ref in node["data"]["shards"].items():
            child = cache.get_obj(child_ref)
            path = prefix + digit
            if child["type"] == "dir":
                assert child["data"], "no empty leaves"
                assert len(child["data"]) <= limit or len(path) == T.HDIR_MAX_DEPTH
                for name, entry in child["data"].items():
                    assert shards.name_hash(name).startswith(path)
                    assert entry["type"] != "dir"  # unrolled
                    out[name] = entry
                n = len(child["data"])
            else:
                n = walk(child, path)
                assert n >= limit // 2, "small subtries collapse"
            total += n
        assert node["data"]["count"] == total
        return total

    walk(top, "")
    return out, max_depth


def test_twenty_thousand_single_key_commits() -> None:
    """One key per commit into one directory: every commit writes O(log n) small blobs."""
    n = 20_000
    kvs = Kvs()
    max_blobs = 0
    max_blob_size = 0
    tail_blobs = tail_bytes = 0
    for i in range(n):
        res = kvs.commit(put(f"dir.key{i:05d}", b"value-%d" % i))
        sizes = [len(b) for b in res.new_blobs.values()]
        max_blobs = max(max_blobs, len(sizes))
        max_blob_size = max(max_blob_size, *sizes)
        if i >= n - 1000:
            tail_blobs += len(sizes)
            tail_bytes += sum(sizes)
    # steady state: root + dir top + interior path + one leaf; a leaf split adds <= 16
    assert max_blobs <= 16 + 6
    assert tail_blobs / 1000 <= 5
    # no blob grows with the directory (a plain 20,000-entry dir blob is ~450 KB)
    assert max_blob_size < 16_000
    assert tail_bytes / 1000 < 16_000

    listing = lookup(kvs.cache, kvs.root, "dir", READDIR)
    assert listing["type"] == "dir"
    assert sorted(listing["data"]) == [f"key{i:05d}" for i in range(n)]
    entries, depth = check_trie(kvs.cache, kvs.dir_ref("dir"))
    assert entries == listing["data"] and 2 <= depth <= 3
    assert lookup(kvs.cache, kvs.root, "dir.key12345", 0) == T.val(b"value-12345")

    # and back down, one unlink per commit, in random order
    order = list(range(n))
    random.Random(1).shuffle(order)
    for count, i in enumerate(order, 1):
        res = kvs.commit(unlink(f"dir.key{i:05d}"))
        assert len(res.new_blobs) <= 6
        assert all(len(b) < 16_000 for b in res.new_blobs.values())
        if count in (n // 2, n - 300, n - 100):
            entries, _ = check_trie(kvs.cache, kvs.dir_ref("dir"))
            assert len(entries) == n - count
    assert kvs.cache.get_obj(kvs.dir_ref("dir")) == T.dir_()  # a plain dir again
    assert lookup(kvs.cache, kvs.root, "dir", READDIR) == T.dir_()


def test_random_ops_against_a_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 8)
    rng = random.Random(7)
    kvs = Kvs()
    model: dict[str, bytes] = {}
    for step in range(300):
        ops = []
        for _ in range(rng.choice([1, 1, 3, 20])):
            name = f"k{rng.randrange(400)}"
            if rng.random() < (0.35 if step < 150 else 0.7):
                ops.append(unlink(f"d.{name}"))
                model.pop(name, None)
            else:
                value = b"%d" % rng.randrange(10**6) * rng.choice([1, 30])
                ops.append(put(f"d.{name}", value))
                model[name] = value
        kvs.commit(*ops)
        got = lookup(kvs.cache, kvs.root, "d", READDIR)
        if got is None:  # never created yet
            assert not model
            continue
        entries, _ = check_trie(kvs.cache, kvs.dir_ref("d"))
        assert set(entries) == set(model) == set(got["data"])
        name = rng.choice(sorted(model)) if model else "k0"
        assert lookup(kvs.cache, kvs.root, f"d.{name}", 0) == (
            T.val(model[name]) if model else None
        )


def test_subdirectories_inside_a_hashed_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)
    kvs = Kvs()
    kvs.commit(*(put(f"big.s{i}.leaf", b"%d" % i) for i in range(50)))
    assert kvs.cache.get_obj(kvs.dir_ref("big"))["type"] == "hdir"
    s7 = kvs.dir_ref("big.s7")
    res = kvs.commit(put("big.s3.other", b"x"))
    assert kvs.dir_ref("big.s7") == s7  # sibling subdirectory untouched
    assert len(res.new_blobs) <= 2 + 1 + 4  # s3, its leaf/path, big top, root
    assert lookup(kvs.cache, kvs.root, "big.s3.other", 0) == T.val(b"x")
    assert set(lookup(kvs.cache, kvs.root, "big.s3", READDIR)["data"]) == {"leaf", "other"}


def test_degenerate_hash_reaches_max_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """All names in one bucket: the trie bottoms out and the last leaf just grows."""
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 2)
    monkeypatch.setattr(shards, "name_hash", lambda name: "0" * 16)
    kvs = Kvs()
    kvs.commit(*(put(f"d.n{i}", b"v") for i in range(10)))
    entries, depth = check_trie(kvs.cache, kvs.dir_ref("d"))
    assert len(entries) == 10 and depth == T.HDIR_MAX_DEPTH
    kvs.commit(put("d.n99", b"w"), unlink("d.n3"))
    assert lookup(kvs.cache, kvs.root, "d.n99", 0) == T.val(b"w")
    assert lookup(kvs.cache, kvs.root, "d.n3", 0) is None
    kvs.commit(*(unlink(f"d.n{i}") for i in range(10)))
    assert set(lookup(kvs.cache, kvs.root, "d", READDIR)["data"]) == {"n99"}


def test_module_functions_on_plain_and_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)
    writer = T.BlobWriter()
    ents = {f"e{i}": T.val(b"%d" % i) for i in range(40)}
    plain = shards.make_dir(dict(list(ents.items())[:3]), writer)
    assert plain["type"] == "dir" and shards.count(plain) == 3
    top = shards.make_dir(ents, writer)
    assert shards.is_hdir(top) and shards.count(top) == 40
    store = dict(writer.blobs)
    cache = T.BlobCache(store)
    assert shards.get(cache, top, "e17") == T.val(b"17")
    assert shards.get(cache, top, "nope") is None
    assert shards.get(cache, plain, "e1") == T.val(b"1")
    assert shards.entries(cache, top) == ents
    assert shards.missing(cache, top, ["e1", "e2"]) == set()

    # the engine reports missing shards instead of failing
    cold = T.BlobCache({})
    with pytest.raises(T.NeedBlobs) as e:
        shards.get(cold, top, "e17")
    assert len(e.value.refs) == 1
    assert shards.missing(cold, top, list(ents)) == set(top["data"]["shards"].values())
    with pytest.raises(T.NeedBlobs) as e:
        shards.update(cold, top, {"e1": None}, T.BlobWriter())
    assert e.value.refs <= set(top["data"]["shards"].values())

    # shrinking below SHARD_THRESHOLD // 2 gives a plain dir back
    w2 = T.BlobWriter()
    small = shards.update(cache, top, {f"e{i}": None for i in range(39)}, w2)
    assert small == T.dir_({"e39": T.val(b"39")})
    assert shards.update(cache, top, dict.fromkeys(ents), w2) == T.dir_()
    # an update that changes one name rewrites one path only
    w3 = T.BlobWriter()
    new_top = shards.update(cache, top, {"e5": T.val(b"new")}, w3)
    cache.remember(w3.objs)
    store.update(w3.blobs)
    assert shards.get(cache, new_top, "e5") == T.val(b"new")
    assert len(w3.blobs) <= 4
    assert shards.update(cache, plain, {"x": T.val(b"x")}, T.BlobWriter())["type"] == "dir"


def test_salvage_keeps_the_readable_shards_and_counts_what_is_lost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`shards.salvage` (``kvs dump --ignore-failed-read``, ``kvs fsck
    --repair``): a lost leaf loses its entries only, a lost interior node
    all those below it, a shard of the wrong form is lost as one missing,
    and each loss is counted from its node's count; :func:`shards.entries`
    would give up on the whole directory."""
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)
    writer = T.BlobWriter()
    ents = {f"e{i}": T.val(b"%d" % i) for i in range(200)}
    top = shards.make_dir(ents, writer)
    store = dict(writer.blobs)
    assert shards.salvage(T.BlobCache(store), top) == (ents, [])
    assert shards.salvage(T.BlobCache({}), T.dir_({"a": T.val(b"1")})) == (
        {"a": T.val(b"1")}, [])
    with pytest.raises(ErrnoError):
        shards.salvage(T.BlobCache({}), T.val(b"1"))

    def below(ref: str) -> dict[str, dict]:
        return shards.entries(T.BlobCache(store), T.decode(store[ref]))

    interior = next(r for r in top["data"]["shards"].values()
                    if T.decode(store[r])["type"] == "hdir")
    leaf = next(r for r in T.decode(store[interior])["data"]["shards"].values()
                if T.decode(store[r])["type"] == "dir")
    other = next(r for r in top["data"]["shards"].values() if r != interior)
    # a lost leaf inside an interior node
    damaged = {k: v for k, v in store.items() if k != leaf}
    kept, lost = shards.salvage(T.BlobCache(damaged), top)
    assert kept == {k: v for k, v in ents.items() if k not in below(leaf)}
    assert lost == [shards.LostShards([(leaf, None)], len(below(leaf)))]
    with pytest.raises(T.NeedBlobs):
        shards.entries(T.BlobCache(damaged), top)
    # a lost interior node, and a top shard that is not a directory
    damaged = {k: v for k, v in store.items() if k != interior}
    damaged[other] = T.encode(T.val(b"x"))
    kept, lost = shards.salvage(T.BlobCache(damaged), top)
    gone = {**below(interior), **below(other)}
    assert kept == {k: v for k, v in ents.items() if k not in gone}
    assert len(lost) == 1 and lost[0].count == len(gone)
    assert sorted(ref for ref, _ in lost[0].refs) == sorted([interior, other])
    assert dict(lost[0].refs)[interior] is None
    assert "is a val" in str(dict(lost[0].refs)[other])
