"""The commit engine: puts, unlinks, mkdir, symlinks, append, unroll, NeedBlobs.

Flux's src/modules/kvs/kvstxn.c and t/t1000-kvs.t are the reference.
"""

import errno
import random

import pytest
from conftest import CountingStore

from broker.content.blobref import hash_blob
from broker.errors import ErrnoError
from kvs import shards
from kvs import treeobj as T
from kvs.lookup import READDIR, SYMLINK_MAX, TREEOBJ, lookup
from kvs.txn import APPEND, EXPECT, MAX_DIRS, NeedBlobs, apply, check_dirs, empty_root


class Kvs:
    """One namespace over a dict store, driven through the engines."""

    def __init__(self) -> None:
        self.store: dict[str, bytes] = {}
        self.root, blob = empty_root()
        self.store[self.root] = blob
        self.cache = T.BlobCache(self.store)

    def commit(self, *ops: dict, **kw):
        res = apply(self.cache, self.root, list(ops), **kw)
        self.store.update(res.new_blobs)
        self.root = res.rootref
        return res

    def get(self, key: str, flags: int = 0) -> dict | None:
        return lookup(self.cache, self.root, key, flags)

    def ref(self, key: str) -> str:
        return self.get(key, TREEOBJ)["data"][0]


def put(key: str, value: bytes | dict | None, flags: int = 0) -> dict:
    dirent = T.val(value) if isinstance(value, bytes) else value
    return {"key": key, "flags": flags, "dirent": dirent}


def unlink(key: str) -> dict:
    return {"key": key, "flags": 0, "dirent": None}


def errnum(fn) -> int:
    with pytest.raises(ErrnoError) as e:
        fn()
    return e.value.errnum


@pytest.fixture
def kvs() -> Kvs:
    return Kvs()


def test_empty_root_is_an_empty_dir() -> None:
    ref, blob = empty_root()
    assert T.decode(blob) == T.dir_() and ref == hash_blob(blob)
    assert empty_root("sha1")[0].startswith("sha1-")


def test_put_creates_directories(kvs: Kvs) -> None:
    res = kvs.commit(put("a.b.c", b"1"), put("..a.x.", b"2"), put("a.b.c", b"3"))
    assert res.keys == ["a.b.c", "a.x"]
    assert kvs.get("a.b.c") == T.val(b"3")
    assert kvs.get("a.x") == T.val(b"2")
    assert kvs.get("a", TREEOBJ)["type"] == "dirref"
    assert set(kvs.get("a", READDIR)["data"]) == {"b", "x"}


def test_no_ops_keeps_root(kvs: Kvs) -> None:
    before = kvs.root
    res = kvs.commit()
    assert res.rootref == before and res.new_blobs == {} and res.keys == []


@pytest.mark.parametrize("key", [".", "", "..."])
def test_root_cannot_be_written(kvs: Kvs, key: str) -> None:
    assert errnum(lambda: kvs.commit(put(key, b"x"))) == errno.EINVAL
    assert errnum(lambda: kvs.commit(unlink(key))) == errno.EINVAL
    assert errnum(lambda: kvs.commit(put(key, T.dir_()))) == errno.EINVAL


def test_unlink(kvs: Kvs) -> None:
    kvs.commit(put("a.b", b"1"), put("a.c", b"2"))
    before = kvs.root
    res = kvs.commit(unlink("nope"), unlink("a.nope"), unlink("x.y.z"), unlink("a.b.deeper"))
    assert res.rootref == before and res.new_blobs == {}  # nothing changed, nothing written
    kvs.commit(unlink("a.b"))
    assert kvs.get("a.b") is None and kvs.get("a.c") == T.val(b"2")
    kvs.commit(unlink("a"))
    assert kvs.get("a.c") is None and kvs.get(".", READDIR) == T.dir_()


def test_mkdir_and_replace(kvs: Kvs) -> None:
    kvs.commit(put("d", T.dir_()))
    assert kvs.get("d", READDIR) == T.dir_()
    kvs.commit(put("d.k", b"v"))
    kvs.commit(put("d", T.dir_()))  # mkdir over a directory empties it, as in Flux
    assert kvs.get("d", READDIR) == T.dir_()
    kvs.commit(put("d", b"now a value"))
    assert kvs.get("d") == T.val(b"now a value")


def test_value_in_path_is_replaced_by_directory(kvs: Kvs) -> None:
    kvs.commit(put("a", b"value"))
    kvs.commit(put("a.b", b"under"))
    assert kvs.get("a.b") == T.val(b"under")
    assert kvs.get("a", TREEOBJ)["type"] == "dirref"


def test_symlinks(kvs: Kvs) -> None:
    kvs.commit(put("real.x", b"1"), put("ln", T.symlink("real")))
    kvs.commit(put("ln.y", b"2"))  # writes through an intermediate link
    assert kvs.get("real.y") == T.val(b"2")
    assert kvs.get("ln", TREEOBJ) == T.symlink("real")
    kvs.commit(unlink("ln.x"))
    assert kvs.get("real.x") is None
    kvs.commit(put("ln", b"replaced"))  # the final component is never followed
    assert kvs.get("ln") == T.val(b"replaced")
    assert kvs.get("real.y") == T.val(b"2")
    kvs.commit(put("rl", T.symlink(".")), put("rl.top", b"t"))
    assert kvs.get("top") == T.val(b"t")


def test_symlink_namespaces_and_loops(kvs: Kvs) -> None:
    kvs.commit(
        put("far", T.symlink("x", "other")),
        put("far2", T.symlink("other::x")),
        put("mine", T.symlink("d", "primary")),
        put("loop", T.symlink("loop")),
    )
    assert errnum(lambda: kvs.commit(put("far.k", b"v"))) == errno.EINVAL
    assert errnum(lambda: kvs.commit(put("far2.k", b"v"), namespace="primary")) == errno.EINVAL
    assert errnum(lambda: kvs.commit(put("mine.k", b"v"))) == errno.EINVAL  # unknown ns
    kvs.commit(put("mine.k", b"v"), namespace="primary")
    assert kvs.get("d.k") == T.val(b"v")
    assert errnum(lambda: kvs.commit(put("loop.k", b"v"))) == errno.ELOOP



def test_a_write_follows_at_most_symlink_max_links(kvs: Kvs) -> None:
    """A write through a chain of links follows SYMLINK_MAX of them, as a
    lookup does (tests/test_lookup.py); one more is ``ELOOP``."""
    n = SYMLINK_MAX  # c0 -> c1 -> ... -> cN -> d: N + 1 links from c0, N from c1
    kvs.commit(*(put(f"c{i}", T.symlink(f"c{i + 1}")) for i in range(n)),
               put(f"c{n}", T.symlink("d")), put("d.x", b"0"))
    kvs.commit(put("c1.k", b"v"))
    assert kvs.get("d.k") == T.val(b"v")
    assert errnum(lambda: kvs.commit(put("c0.k", b"w"))) == errno.ELOOP
    assert errnum(lambda: kvs.commit(put("c0.k", None, EXPECT))) == errno.ELOOP
    assert kvs.get("d.k") == T.val(b"v")

def test_big_values_are_unrolled(kvs: Kvs) -> None:
    small, big = b"s" * T.INLINE_MAX, b"b" * (T.INLINE_MAX + 1)
    res = kvs.commit(put("small", small), put("big", big))
    assert kvs.get("small", TREEOBJ) == T.val(small)
    entry = kvs.get("big", TREEOBJ)
    assert entry == T.valref([hash_blob(big)])
    assert res.new_blobs[hash_blob(big)] == big
    assert kvs.get("big") == T.val(big)


def test_nested_dir_dirent_is_unrolled(kvs: Kvs) -> None:
    big = b"B" * 100
    tree = T.dir_({"v": T.val(big), "sub": T.dir_({"w": T.val(b"w")}), "e": T.dir_()})
    kvs.commit(put("t", tree))
    assert kvs.get("t", TREEOBJ)["type"] == "dirref"
    listing = kvs.get("t", READDIR)["data"]
    assert listing["v"] == T.valref([hash_blob(big)])
    assert listing["sub"]["type"] == "dirref"
    assert kvs.get("t.sub.w") == T.val(b"w")
    assert kvs.get("t.e", READDIR) == T.dir_()
    # the caller's dirent is not modified
    assert tree["data"]["v"] == T.val(big)
    kvs.commit(put("u", T.dir_({"x": T.val(b"1")})), put("u.y", b"2"))
    assert set(kvs.get("u", READDIR)["data"]) == {"x", "y"}


def test_dirents_of_every_kind(kvs: Kvs) -> None:
    blob = b"external blob"
    kvs.store[hash_blob(blob)] = blob
    kvs.commit(put("d", T.dir_({"k": T.val(b"v")})))
    dref = kvs.get("d", TREEOBJ)
    kvs.commit(put("vr", T.valref([hash_blob(blob)])), put("copy", dref))
    assert kvs.get("vr") == T.val(blob)
    assert kvs.get("copy.k") == T.val(b"v")  # `kvs copy` is a dirref put


def test_every_blob_written_is_canonical(kvs: Kvs, monkeypatch: pytest.MonkeyPatch) -> None:
    # The engines encode with encode_built (trusting the field order of the
    # entries they build); whatever the ops look like, each blob must be the
    # canonical encoding of its object, or equal trees would hash apart.
    from kvs import shards

    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)  # hdir nodes and leaves too
    hand_written = {"type": "val", "ver": 1, "data": b"h"}
    results = [
        kvs.commit(put("a.b", b"1"), put("a.s", T.symlink("t", "ns")),
                   put("a.h", dict(hand_written))),
        kvs.commit(put("t", {"type": "dir", "data": {"x": dict(hand_written)}, "ver": 1})),
        kvs.commit(*(put(f"big.k{i}", str(i).encode()) for i in range(40))),
        kvs.commit(put("big.k3", b"x" * 100), put("l", b"one"), put("l", b"two", APPEND)),
        kvs.commit(unlink("big.k7"), put("copy", kvs.get("a", TREEOBJ))),
    ]
    written = {ref: blob for res in results for ref, blob in res.new_blobs.items()}
    assert len(written) > 20
    trees = 0
    for blob in written.values():
        try:
            obj = T.decode(blob)
        except ErrnoError:
            continue  # a value blob (unrolled or appended), not a tree object
        assert T.encode(obj) == blob, obj
        trees += 1
    assert trees > 20  # (the check ran: not every blob was skipped as a value)


def test_reused_entry_bytes_match_the_tree(kvs: Kvs, monkeypatch: pytest.MonkeyPatch) -> None:
    # Commits into a directory this cache wrote before repack only the names
    # they change (BlobWriter.put_obj with a base).  Drive puts, replaces,
    # unlinks and appends into plain dirs and hdir leaves, then read every
    # key back through a fresh cache that knows only the blobs: a stale or
    # missing entry would show as a wrong value or a wrong listing.
    import random

    from kvs import shards

    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 6)
    packs = 0
    pack_entry = T.pack_entry

    def counting_pack_entry(name: str, entry: dict) -> bytes:
        nonlocal packs
        packs += 1
        return pack_entry(name, entry)

    monkeypatch.setattr(T, "pack_entry", counting_pack_entry)
    written = 0  # entries in the dir blobs the commits wrote
    rng = random.Random(5)
    model: dict[str, bytes] = {}
    for step in range(300):
        ops = []
        for _ in range(rng.randint(1, 4)):
            key = f"d{rng.randint(0, 2)}.k{rng.randint(0, 30)}"
            roll = rng.random()
            if roll < 0.2 and key in model:
                ops.append(unlink(key))
                model.pop(key)
            elif roll < 0.3 and key in model:
                ops.append(put(key, b"+", APPEND))
                model[key] += b"+"
            else:
                value = f"{step}".encode()
                ops.append(put(key, value))
                model[key] = value
        res = kvs.commit(*ops)
        for blob in res.new_blobs.values():
            try:
                obj = T.decode(blob)
            except ErrnoError:
                continue
            written += len(obj["data"]) if obj["type"] == "dir" else 0
    fresh = T.BlobCache(dict(kvs.store))
    for key, value in model.items():
        dirent = lookup(fresh, kvs.root, key, 0)
        data = dirent["data"] if dirent["type"] == "val" else b"".join(
            kvs.store[r] for r in dirent["data"])
        assert data == value, key
    for d in ("d0", "d1", "d2"):
        names = set(lookup(fresh, kvs.root, d, READDIR)["data"])
        assert names == {k.split(".")[1] for k in model if k.startswith(d + ".")}
    assert packs < written / 2  # most entries' bytes were reused, not packed again


def test_put_obj_packs_afresh_when_changed_names_are_incomplete() -> None:
    w = T.BlobWriter(cache=None)
    a, b, c = T.val(b"a"), T.val(b"b"), T.val(b"c")
    base = w.put_obj(T.dir_({"a": a, "b": b}))
    # "b" removed and "c" added, but only "c" named: the names disagree.
    ref = w.put_obj(T.dir_({"a": a, "c": c}), base, ["c"])
    assert w.blobs[ref] == T.encode(T.dir_({"a": a, "c": c}))
    assert w.packed[ref].names == ["a", "c"]


@pytest.mark.parametrize(
    "dirent",
    [
        {"ver": 1, "type": "val", "data": "str"},
        {"ver": 1, "type": "valref", "data": ["sha256-bad"]},
        {"ver": 1, "type": "dirref", "data": []},
        {"ver": 1, "type": "symlink", "data": {}},
        {"ver": 1, "type": "nope", "data": 1},
        T.hdir(0, 1, {"0": hash_blob(b"x")}),
        "a string",
    ],
)
def test_invalid_dirent_is_einval(kvs: Kvs, dirent: object) -> None:
    assert errnum(lambda: kvs.commit({"key": "k", "flags": 0, "dirent": dirent})) == errno.EINVAL


@pytest.mark.parametrize(
    "op", [None, "k", {"key": 1, "flags": 0, "dirent": None}, {"key": "k", "flags": "0"}, {}]
)
def test_malformed_op_is_eproto(kvs: Kvs, op: object) -> None:
    assert errnum(lambda: kvs.commit(op)) == errno.EPROTO


def test_append(kvs: Kvs) -> None:
    kvs.commit(put("log", b"one,", APPEND))  # append to a missing key creates it
    assert kvs.get("log") == T.val(b"one,")
    res = kvs.commit(put("log", b"two,", APPEND))
    entry = kvs.get("log", TREEOBJ)
    assert entry == T.valref([hash_blob(b"one,"), hash_blob(b"two,")])
    assert set(res.new_blobs) >= {hash_blob(b"one,"), hash_blob(b"two,")}
    res = kvs.commit(put("log", b"three", APPEND))
    refs = kvs.get("log", TREEOBJ)["data"]
    assert refs[:2] == entry["data"] and refs[2] == hash_blob(b"three")
    assert res.new_blobs[hash_blob(b"three")] == b"three"  # old bytes not copied
    assert all(b"one" not in blob for blob in res.new_blobs.values())
    assert kvs.get("log") == T.val(b"one,two,three")


def test_append_within_one_transaction(kvs: Kvs) -> None:
    kvs.commit(put("k", b"a"), put("k", b"b", APPEND), put("k", b"c", APPEND))
    assert kvs.get("k") == T.val(b"abc")
    kvs.commit(put("big", b"x" * 100), put("big", b"y", APPEND))
    assert kvs.get("big") == T.val(b"x" * 100 + b"y")


def test_many_appends_to_one_key_in_one_transaction_leave_older_versions_alone(
        kvs: Kvs) -> None:
    # Appends after the first in a transaction grow the valref it made in
    # place (n appends cost O(n), not O(n^2)); the stored version's list,
    # shared through the cache, must stay as it was.
    kvs.commit(put("log", b"a", APPEND), put("log", b"b", APPEND))
    old_root, old_refs = kvs.root, list(kvs.get("log", TREEOBJ)["data"])
    lines = [b"%d," % i for i in range(2000)]
    kvs.commit(*(put("log", line, APPEND) for line in lines), put("other", b"x", APPEND),
               put("log", b"!", APPEND))
    assert kvs.get("log") == T.val(b"ab" + b"".join(lines) + b"!")
    assert len(kvs.get("log", TREEOBJ)["data"]) == 2 + len(lines) + 1
    assert lookup(kvs.cache, old_root, "log", TREEOBJ)["data"] == old_refs
    assert lookup(kvs.cache, old_root, "log", 0) == T.val(b"ab")
    # a put between appends starts a new value, which the next ones grow
    kvs.commit(put("log", b"x", APPEND), put("log", b"new"), put("log", b"1", APPEND),
               put("log", b"2", APPEND))
    assert kvs.get("log") == T.val(b"new12")


def test_append_errors(kvs: Kvs) -> None:
    kvs.commit(put("d.k", b"v"), put("ln", T.symlink("d.k")))
    assert errnum(lambda: kvs.commit(put("d", b"x", APPEND))) == errno.EISDIR
    assert errnum(lambda: kvs.commit(put("new.dir", T.dir_()), put("new", b"x", APPEND))) == (
        errno.EISDIR
    )
    assert errnum(lambda: kvs.commit(put("ln", b"x", APPEND))) == errno.EOPNOTSUPP
    assert errnum(lambda: kvs.commit(put("k", T.dir_(), APPEND))) == errno.EPROTO
    assert errnum(lambda: kvs.commit(put("k", T.symlink("x"), APPEND))) == errno.EPROTO
    # (the whole key named: "l: cannot append to a symlink" said the last part)
    kvs.commit(put("p.l", T.symlink("d.k")), put("p.d.k", b"v"))
    for key, says in (("p.l", "p.l: cannot append to a symlink"),
                      ("p.d", "p.d: cannot append to a directory")):
        with pytest.raises(ErrnoError, match=f"^{says}$"):
            kvs.commit(put(key, b"x", APPEND))


def test_copy_on_write_touches_only_the_path(kvs: Kvs) -> None:
    kvs.commit(put("a.x", b"1"), put("b.y", b"2"), put("c.d.e", b"3"))
    b_ref, cd_ref = kvs.ref("b"), kvs.ref("c.d")
    old_root_obj = kvs.cache.get_obj(kvs.root)
    old_root_copy = T.copy(old_root_obj)
    res = kvs.commit(put("a.z", b"4"))
    assert len(res.new_blobs) == 2  # new "a" and new root, nothing else
    assert kvs.ref("b") == b_ref and kvs.ref("c.d") == cd_ref
    assert old_root_obj == old_root_copy  # cached objects are never mutated
    # walking through c.d without changing anything keeps its blobs
    res = kvs.commit(unlink("c.d.nope"), put("a.z", b"5"))
    assert kvs.ref("c.d") == cd_ref and len(res.new_blobs) == 2


def test_need_blobs_gathered_across_ops() -> None:
    full = Kvs()
    full.commit(put("p.k", b"1"), put("q.k", b"2"), put("r.s.k", b"3"))
    p, q, r, rs = full.ref("p"), full.ref("q"), full.ref("r"), full.ref("r.s")
    partial = {ref: blob for ref, blob in full.store.items() if ref not in (p, q, r, rs)}
    ops = [put("p.new", b"x"), put("q.new", b"y", APPEND), unlink("r.s.k"), put("t", b"z")]
    with pytest.raises(NeedBlobs) as e:
        apply(partial, full.root, ops)
    assert e.value.refs == {p, q, r}
    partial.update({ref: full.store[ref] for ref in e.value.refs})
    with pytest.raises(NeedBlobs) as e:
        apply(partial, full.root, ops)
    assert e.value.refs == {rs}
    partial[rs] = full.store[rs]
    res = apply(partial, full.root, ops)
    partial.update(res.new_blobs)
    assert lookup(partial, res.rootref, "p.new", 0) == T.val(b"x")
    assert lookup(partial, res.rootref, "r.s.k", 0) is None
    with pytest.raises(NeedBlobs) as e:
        apply({}, full.root, ops)
    assert e.value.refs == {full.root}


def test_error_is_reported_only_when_no_blobs_missing() -> None:
    full = Kvs()
    full.commit(put("p.k", b"1"), put("d.x", b"v"))
    p = full.ref("p")
    partial = {ref: blob for ref, blob in full.store.items() if ref != p}
    ops = [put("p.new", b"x"), put("d", b"x", APPEND)]
    with pytest.raises(NeedBlobs):
        apply(partial, full.root, ops)
    partial[p] = full.store[p]
    assert errnum(lambda: apply(partial, full.root, ops)) == errno.EISDIR


def test_bad_root(kvs: Kvs) -> None:
    assert errnum(lambda: apply(kvs.store, "nope", [put("a", b"1")])) == errno.EINVAL
    blob = T.encode(T.val(b"x"))
    kvs.store[hash_blob(blob)] = blob
    assert errnum(lambda: apply(kvs.store, hash_blob(blob), [put("a", b"1")])) == errno.EINVAL


def test_hash_name(kvs: Kvs) -> None:
    res = kvs.commit(put("a.b", b"x" * 100), hash_name="sha1")
    assert res.rootref.startswith("sha1-")
    assert all(ref.startswith("sha1-") for ref in res.new_blobs)
    assert kvs.get("a.b") == T.val(b"x" * 100)


def test_memo_holds_current_versions_not_every_version() -> None:
    """Commits into one big directory: the versions each commit replaces are
    forgotten from the decoded-object memo, so it stays the size of the live
    tree, and old roots stay readable (decoded again from the store)."""
    kvs = Kvs()
    kvs.store = CountingStore(kvs.store)
    kvs.cache = T.BlobCache(kvs.store)
    first_root = None
    for i in range(1500):
        kvs.commit(put(f"big.k{i}", str(i).encode()))
        if i == 0:
            kvs.store.reads = 0  # the empty root, decoded once
        if i == 9:
            first_root = kvs.root
    assert kvs.cache.forgotten > 1000
    # ~6 versions a commit were written (9,000); held: the live tree (~25)
    # and the ~3 a commit replaces for PROBATION transactions
    assert len(kvs.cache) < 50 + 3 * T.PROBATION
    assert kvs.store.reads == 0  # nothing current was dropped
    assert kvs.get("big.k1499") == T.val(b"1499")
    assert lookup(kvs.cache, first_root, "big.k9", 0) == T.val(b"9")
    assert lookup(kvs.cache, first_root, "big.k10", 0) is None
    assert kvs.store.reads > 0


def test_memo_keeps_a_version_another_directory_still_holds() -> None:
    """W2p's clients write identical trees (same keys, same values) into
    sibling directories, so the version one of them replaces is often
    another's current one: it must not be dropped and decoded again."""
    kvs = Kvs()
    kvs.store = CountingStore(kvs.store)
    kvs.cache = T.BlobCache(kvs.store)
    for i in range(300):
        for batch in ((0, 1, 2), (3, 4, 5)):  # two groups, as 8 clients form
            kvs.commit(*(put(f"p.c{j}.k{i}", str(i).encode()) for j in batch))
            kvs.commit(put(f"other.k{i}", b"x"))  # someone else's commit between
        if i == 0:
            kvs.store.reads = 0  # the empty root, decoded once
    assert kvs.ref("p.c0") == kvs.ref("p.c5")  # identical trees, one blob
    assert kvs.cache.forgotten > 0
    assert kvs.store.reads == 0


def test_memo_keeps_a_shared_leaf_until_its_other_writers_come_back() -> None:
    """As above, with directories big enough to be sharded (16 leaves) and
    the writers drifting apart (each batch, 4 of the 8 at random): a
    writer comes back to the same leaf only every ~16th of its commits,
    ~32 transactions later, so a leaf another writer replaced meanwhile
    must still be memoized then.  With a probation of 16 transactions,
    109 versions were decoded again here (and each next version packed
    whole: no packed entries are memoized for a decoded one)."""
    kvs = Kvs()
    kvs.store = CountingStore(kvs.store)
    kvs.cache = T.BlobCache(kvs.store)
    rnd = random.Random(1)
    done = [0] * 8
    batches = 0
    while min(done) < 400:
        live = [j for j in range(8) if done[j] < 400]
        ops = []
        for j in rnd.sample(live, min(4, len(live))):
            ops.append(put(f"p.c{j}.k{done[j]}", str(done[j]).encode()))
            done[j] += 1
        kvs.commit(*ops)
        batches += 1
        if batches == 1:
            kvs.store.reads = 0  # the empty root, decoded once
    assert shards.is_hdir(kvs.cache.get_obj(kvs.ref("p.c0")))
    assert kvs.cache.forgotten > 1000
    assert kvs.store.reads == 0


# ---------------------------------------------------------------- EXPECT (conditions)


def expect(key: str, value: bytes | None) -> dict:
    return {"key": key, "flags": EXPECT, "dirent": None if value is None else T.val(value)}


def test_expect_is_compare_and_swap(kvs: Kvs) -> None:
    kvs.commit(expect("lock", None), put("lock", b"a"))  # created: it was missing
    before = kvs.root
    for cond, why in ((expect("lock", None), "it exists"),
                      (expect("lock", b"b"), "another value"),
                      (expect("lock", b"a\0"), "another value"),
                      (expect(".lock.", b"x"), "another value")):
        with pytest.raises(ErrnoError) as e:
            kvs.commit(cond, put("lock", b"stolen"))
        assert (e.value.errnum, e.value.errstr) == (errno.ECANCELED,
                                                   f"lock: condition failed: {why}")
        assert kvs.root == before  # nothing changed
    res = kvs.commit(expect("lock", b"a"), put("lock", b"b"))
    assert kvs.get("lock")["data"] == b"b"
    assert res.keys == ["lock"]  # the condition names no key: watchers see no change


def test_expect_reads_values_big_and_appended_and_paths(kvs: Kvs) -> None:
    big = bytes(range(256)) * 4
    kvs.commit(put("v", big), put("log", b"one\n"))
    kvs.commit(put("log", b"two\n", APPEND))  # a valref of two blobs
    kvs.commit(expect("v", big), expect("log", b"one\ntwo\n"), put("ok", b"1"))
    kvs.commit({"key": "l", "flags": 0, "dirent": T.symlink("d")}, put("d.k", b"x"))
    kvs.commit(expect("l.k", b"x"))  # a symlink on the path is followed
    for key, why in (("d", "it is a directory"), ("l", "it is a symlink"),
                     ("v.sub", "it does not exist"), ("nope.k", "it does not exist")):
        with pytest.raises(ErrnoError, match=f"^{key}: condition failed: {why}$"):
            kvs.commit(expect(key, b"x"))
    kvs.commit(expect("v.sub", None), expect("nope.k", None))  # missing: as expected


def test_expect_in_merged_transactions_sees_the_ones_before(kvs: Kvs) -> None:
    """Merging concatenates ops: the second create-if-missing sees the first."""
    assert errnum(lambda: kvs.commit(expect("k", None), put("k", b"1"),
                                     expect("k", None), put("k", b"2"))) == errno.ECANCELED
    assert kvs.get("k") is None  # nothing was applied
    kvs.commit(expect("k", None), put("k", b"1"), expect("k", b"1"), put("k", b"2"))
    assert kvs.get("k")["data"] == b"2"


def test_expect_after_an_append_in_the_same_transaction_reads_the_new_blobs(
        kvs: Kvs) -> None:
    """The appended blob is not stored yet when the condition reads it."""
    kvs.commit(put("log", b"x"))
    kvs.commit(put("log", b"y", APPEND), expect("log", b"xy"), put("ok", b"1"))
    assert kvs.get("ok")["data"] == b"1"
    before = kvs.root
    with pytest.raises(ErrnoError) as e:
        kvs.commit(put("log", b"z", APPEND), expect("log", b"xy"))
    assert (e.value.errnum, e.value.errstr) == (errno.ECANCELED,
                                               "log: condition failed: another value")
    assert kvs.root == before


def test_expect_fetches_what_it_compares() -> None:
    """A valref's blobs, or an hdir's shards, missing from the cache: NeedBlobs."""
    full = Kvs()
    full.commit(put("v", b"x" * 300))
    cold = T.BlobCache({full.root: full.store[full.root]})
    with pytest.raises(NeedBlobs):
        apply(cold, full.root, [expect("v", b"x" * 300)])


@pytest.mark.parametrize("op", [
    {"key": "k", "flags": EXPECT | APPEND, "dirent": T.val(b"x")},
    {"key": "k", "flags": EXPECT, "dirent": T.dir_()},
])
def test_expect_takes_a_val_or_null_and_no_other_flag(kvs: Kvs, op: dict) -> None:
    assert errnum(lambda: kvs.commit(op)) == errno.EPROTO


def test_check_dirs_counts_each_directory_under_the_keys_once() -> None:
    # a commit's keys may lie under at most MAX_DIRS directories (each one
    # is walked and rewritten on rank 0's loop); shared ones count once
    deep = ".".join(["d"] * 255)
    check_dirs([f"{deep}.k{i}" for i in range(MAX_DIRS // 100)])  # 255 directories
    check_dirs([f"a{i}.b.k" for i in range(MAX_DIRS // 2)])  # exactly MAX_DIRS
    with pytest.raises(ErrnoError) as e:
        check_dirs([f"a{i}.b.k" for i in range(MAX_DIRS // 2)] + ["z.k"])
    assert e.value.errnum == errno.E2BIG
    with pytest.raises(ErrnoError) as e:  # 400 paths of 255 new directories each
        check_dirs([f"t{i}.{deep}" for i in range(400)])
    assert e.value.errnum == errno.E2BIG
    check_dirs([f"..a{i}..b..k" for i in range(MAX_DIRS // 2)])  # counted normalised
    check_dirs(["k"] * (MAX_DIRS + 1))  # (the op count has its own limit)


# -- long values: vtree (kvs/treeobj.py) ----------------------------------------


def stored(kvs: Kvs, directory: str, name: str) -> dict:
    """Entry ``name`` as the blob of ``directory`` holds it (a lookup shows a
    vtree as a valref)."""
    return T.decode(kvs.store[kvs.ref(directory)])["data"][name]


def test_a_long_value_is_stored_as_chunks_and_a_tail(kvs: Kvs) -> None:
    chunk = T.VTREE_CHUNK
    lines = [b"line %04d of a long eventlog\n" % i for i in range(3 * chunk + 5)]
    sizes = []
    for ln in lines:
        kvs.commit(put("d.log", ln, APPEND), put("d.other", b"x"))
        sizes.append(len(kvs.store[kvs.ref("d")]))
    assert stored(kvs, "d", "other") == T.val(b"x")
    e = stored(kvs, "d", "log")
    refs = [hash_blob(ln) for ln in lines]
    assert e["type"] == "vtree" and len(e["data"]["chunks"]) == 3
    assert e["data"]["tail"] == refs[3 * chunk:]
    for i, ref in enumerate(e["data"]["chunks"]):  # each chunk: its lines' blobs, in order
        assert T.decode(kvs.store[ref]) == T.valref(refs[i * chunk:(i + 1) * chunk])
    # the directory holds a chunk's worth of blobrefs at most, however long the value
    assert max(sizes[chunk:]) <= max(sizes[:chunk]) + 3 * 80
    # every reader sees the value whole, and a valref of all its blobs
    assert kvs.get("d.log") == T.val(b"".join(lines))
    assert kvs.get("d.log", TREEOBJ) == T.valref(refs)
    assert kvs.get("d", READDIR)["data"]["log"] == T.valref(refs)
    assert lookup(kvs.cache, kvs.root, ".", READDIR)["data"]["d"]["type"] == "dirref"
    # conditions read it whole
    kvs.commit(put("d.log", b"".join(lines), EXPECT))
    assert errnum(lambda: kvs.commit(put("d.log", b"".join(lines[1:]), EXPECT))) == (
        errno.ECANCELED)


def test_a_tail_that_fills_becomes_one_more_chunk(kvs: Kvs) -> None:
    chunk = T.VTREE_CHUNK
    kvs.commit(*(put("log", b"%05d" % i, APPEND) for i in range(2 * chunk - 1)))
    before = T.decode(kvs.store[kvs.root])["data"]["log"]
    assert len(before["data"]["chunks"]) == 1 and len(before["data"]["tail"]) == chunk - 1
    res = kvs.commit(put("log", b"last!", APPEND))
    after = T.decode(kvs.store[kvs.root])["data"]["log"]
    assert after["data"]["chunks"][0] == before["data"]["chunks"][0]  # not stored again
    assert len(after["data"]["chunks"]) == 2 and after["data"]["tail"] == []
    assert after["data"]["chunks"][1] in res.new_blobs
    assert kvs.get("log") == T.val(b"".join(b"%05d" % i for i in range(2 * chunk - 1)) + b"last!")


def test_a_long_valref_written_whole_is_stored_chunked_and_appended_to(kvs: Kvs) -> None:
    chunk = T.VTREE_CHUNK
    blobs = [b"blob %d" % i for i in range(chunk + 3)]
    kvs.store.update({hash_blob(b): b for b in blobs})
    flat = T.valref([hash_blob(b) for b in blobs])
    kvs.commit(put("copy", flat))
    e = T.decode(kvs.store[kvs.root])["data"]["copy"]
    assert e["type"] == "vtree" and len(e["data"]["tail"]) == 3
    assert kvs.get("copy", TREEOBJ) == flat
    # a long valref an older store holds flat stays so until it is written...
    legacy = T.dir_({"old": flat, "n": T.val(b"1")})
    ref = hash_blob(T.encode(legacy))
    kvs.store[ref] = T.encode(legacy)
    kvs.commit(put("legacy", T.dirref(ref)))
    kvs.commit(put("legacy.n", b"2"))
    assert stored(kvs, "legacy", "old") == flat
    # ... and an append stores it chunked
    kvs.commit(put("legacy.old", b"more", APPEND))
    assert stored(kvs, "legacy", "old")["type"] == "vtree"
    assert kvs.get("legacy.old") == T.val(b"".join(blobs) + b"more")


def test_whole_groups_of_chunks_go_to_the_index_and_the_entry_stays_small(kvs: Kvs) -> None:
    """128 chunks (16,384 blobs) become one group in the vtree's index, so
    the directory holds at most ~3 x 127 blobrefs however long the value:
    a log written flat (a valref of 16,384 + 300 blobs: copied, restored)
    and appended to across the next group's end stores one new group, and
    a one-level vtree an older version stored is grouped when appended to."""
    k, g = T.VTREE_CHUNK, T.VTREE_GROUP
    blobs = [b"line %06d\n" % i for i in range(g + 300)]
    kvs.store.update({hash_blob(b): b for b in blobs})
    refs = [hash_blob(b) for b in blobs]
    kvs.commit(put("log", T.valref(refs)))
    index, chunks, tail = T.vtree_parts(stored(kvs, ".", "log"))
    assert len(index) == 1 and len(chunks) == 2 and len(tail) == 300 - 2 * k
    group = T.decode(kvs.store[index[0]])
    assert group == T.vtree(T.decode(kvs.store[index[0]])["data"]["chunks"], [])
    assert [T.decode(kvs.store[c])["data"] for c in group["data"]["chunks"]] == \
        [refs[i:i + k] for i in range(0, g, k)]
    more = [b"more %06d\n" % i for i in range(g - 300 + 5)]  # past the second group's end
    for i in range(0, len(more), 500):
        kvs.commit(*(put("log", ln, APPEND) for ln in more[i:i + 500]))
    after = stored(kvs, ".", "log")
    assert T.vtree_parts(after)[0][0] == index[0] and len(T.vtree_parts(after)[0]) == 2
    assert T.vtree_parts(after)[1] == [] and len(T.vtree_parts(after)[2]) == 5
    assert len(T.encode(after)) < 3 * k * 80
    assert kvs.get("log") == T.val(b"".join(blobs + more))
    assert kvs.get("log", TREEOBJ) == T.valref(refs + [hash_blob(b) for b in more])
    # a vtree of one level (as an older version stored it): grouped at its next write
    flat = T.vtree([c for grp in T.vtree_parts(after)[0]
                    for c in T.decode(kvs.store[grp])["data"]["chunks"]], [])
    old = T.encode(T.dir_({"log": flat}))
    kvs.store[hash_blob(old)] = old
    kvs.commit(put("legacy", T.dirref(hash_blob(old))))
    assert len(stored(kvs, "legacy", "log")["data"]["chunks"]) == 2 * k  # read as it is
    assert kvs.get("legacy.log") == T.val(b"".join((blobs + more)[:2 * g]))
    kvs.commit(put("legacy.log", b"x", APPEND))
    assert T.vtree_parts(stored(kvs, "legacy", "log")) == (T.vtree_parts(after)[0], [],
                                                           [hash_blob(b"x")])


def test_a_vtree_is_not_a_dirent_a_commit_may_give(kvs: Kvs) -> None:
    kvs.commit(*(put("log", b"%05d" % i, APPEND) for i in range(T.VTREE_CHUNK)))
    e = T.decode(kvs.store[kvs.root])["data"]["log"]
    assert e["type"] == "vtree"
    for dirent in (e, T.dir_({"x": e})):
        assert errnum(lambda d=dirent: kvs.commit(put("mine", d))) == errno.EINVAL
