"""The lookup engine: flags, errnos, symlinks, namespaces, missing blobs.

Flux's t/t1000-kvs.t and src/modules/kvs/test/lookup.c are the reference.
"""

import errno

import pytest

from broker.content.blobref import hash_blob
from broker.errors import ErrnoError
from kvs import shards, txn
from kvs import treeobj as T
from kvs.lookup import (
    READDIR,
    READLINK,
    SYMLINK_MAX,
    TREEOBJ,
    NeedBlobs,
    NeedNamespace,
    lookup,
    read_dir,
)


class Kvs:
    """One namespace over a dict store, driven through the engines."""

    def __init__(self, store: dict[str, bytes] | None = None) -> None:
        self.store = store if store is not None else {}
        self.root, blob = txn.empty_root()
        self.store[self.root] = blob
        self.cache = T.BlobCache(self.store)

    def commit(self, *ops: dict, **kw) -> txn.TxnResult:
        res = txn.apply(self.cache, self.root, list(ops), **kw)
        self.store.update(res.new_blobs)
        self.root = res.rootref
        return res

    def get(self, key: str, flags: int = 0, **kw) -> dict | None:
        return lookup(self.cache, self.root, key, flags, **kw)


def put(key: str, value: bytes | dict, flags: int = 0) -> dict:
    dirent = T.val(value) if isinstance(value, bytes) else value
    return {"key": key, "flags": flags, "dirent": dirent}


def errnum(fn) -> int:
    with pytest.raises(ErrnoError) as e:
        fn()
    return e.value.errnum


@pytest.fixture
def kvs() -> Kvs:
    k = Kvs()
    k.commit(
        put("a.b.c", b"small"),
        put("a.big", b"x" * 1000),
        put("empty", T.dir_()),
        put("link", T.symlink("a.b")),
        put("vlink", T.symlink("a.b.c")),
        put("rootlink", T.symlink(".")),
        put("dangling", T.symlink("no.such.key")),
    )
    return k


def test_values(kvs: Kvs) -> None:
    assert kvs.get("a.b.c") == T.val(b"small")
    assert kvs.get("..a...b.c.") == T.val(b"small")
    assert kvs.get("a.big") == T.val(b"x" * 1000)
    assert kvs.get("a.big", TREEOBJ)["type"] == "valref"


def test_missing_and_through_value_give_none(kvs: Kvs) -> None:
    assert kvs.get("nope") is None
    assert kvs.get("a.nope.deeper") is None
    assert kvs.get("a.b.c.d") is None  # through a value: the module says ENOENT
    assert kvs.get("a.b.c.d", READDIR) is None
    assert kvs.get("dangling") is None


def test_directory_errnos(kvs: Kvs) -> None:
    assert errnum(lambda: kvs.get("a")) == errno.EISDIR
    assert errnum(lambda: kvs.get("empty")) == errno.EISDIR
    assert errnum(lambda: kvs.get(".")) == errno.EISDIR
    assert errnum(lambda: kvs.get("a.b.c", READDIR)) == errno.ENOTDIR
    assert errnum(lambda: kvs.get("a.big", READDIR)) == errno.ENOTDIR


def test_readdir(kvs: Kvs) -> None:
    d = kvs.get("a", READDIR)
    assert d["type"] == "dir"
    assert set(d["data"]) == {"b", "big"}
    assert d["data"]["b"]["type"] == "dirref"  # entries as stored, not expanded
    assert d["data"]["big"]["type"] == "valref"
    assert kvs.get("empty", READDIR) == T.dir_()
    root = kvs.get(".", READDIR)
    assert set(root["data"]) == {"a", "empty", "link", "vlink", "rootlink", "dangling"}
    assert kvs.get("", READDIR) == root
    assert read_dir(kvs.store, kvs.root) == root
    # a symlink to a directory reads as that directory
    assert kvs.get("link", READDIR) == kvs.get("a.b", READDIR)
    assert kvs.get("rootlink", READDIR) == root


def test_readlink(kvs: Kvs) -> None:
    assert kvs.get("link", READLINK) == T.symlink("a.b")
    assert kvs.get("vlink", READLINK) == T.symlink("a.b.c")
    assert errnum(lambda: kvs.get("a.b.c", READLINK)) == errno.EINVAL
    assert errnum(lambda: kvs.get("a.big", READLINK)) == errno.EINVAL
    assert errnum(lambda: kvs.get("a", READLINK)) == errno.EINVAL
    assert errnum(lambda: kvs.get(".", READLINK)) == errno.EINVAL
    assert errnum(lambda: kvs.get("link", READLINK | READDIR)) == errno.ENOTDIR
    # intermediate links are followed even with READLINK
    assert kvs.get("link.c", READLINK | TREEOBJ) == T.val(b"small")
    assert errnum(lambda: kvs.get("link.c", READLINK)) == errno.EINVAL


def test_treeobj(kvs: Kvs) -> None:
    assert kvs.get(".", TREEOBJ) == T.dirref(kvs.root)
    assert kvs.get("a.b.c", TREEOBJ) == T.val(b"small")
    assert kvs.get("a", TREEOBJ)["type"] == "dirref"
    assert kvs.get("link", TREEOBJ) == T.symlink("a.b")  # final link not followed
    assert kvs.get("link.c", TREEOBJ) == T.val(b"small")


def test_symlinks_followed(kvs: Kvs) -> None:
    assert kvs.get("vlink") == T.val(b"small")
    assert kvs.get("link.c") == T.val(b"small")
    assert kvs.get("rootlink.a.b.c") == T.val(b"small")
    assert errnum(lambda: kvs.get("link")) == errno.EISDIR


def test_symlink_loop_is_eloop(kvs: Kvs) -> None:
    kvs.commit(put("l1", T.symlink("l2")), put("l2", T.symlink("l1")))
    assert errnum(lambda: kvs.get("l1")) == errno.ELOOP
    assert errnum(lambda: kvs.get("l1.x")) == errno.ELOOP
    assert kvs.get("l1", READLINK) == T.symlink("l2")


def test_symlink_chain_limit(kvs: Kvs) -> None:
    # c0 -> c1 -> ... -> cN (a value): N links
    n = SYMLINK_MAX
    kvs.commit(
        *(put(f"c{i}", T.symlink(f"c{i + 1}")) for i in range(n + 1)), put(f"c{n + 1}", b"end")
    )
    assert kvs.get("c1") == T.val(b"end")  # exactly 10 links
    assert errnum(lambda: kvs.get("c0")) == errno.ELOOP  # 11 links


def test_cross_namespace_symlinks() -> None:
    other = Kvs()
    other.commit(put("x.y", b"in-other"), put("back", T.symlink("x")))
    kvs = Kvs(other.store)  # one content store for all namespaces, as in kvbroker
    kvs.commit(
        put("far", T.symlink("x.y", "other")),
        put("fardir", T.symlink("x", "other")),
        put("oldstyle", T.symlink("other::x.y")),
        put("farroot", T.symlink(".", "other")),
        put("self", T.symlink("mine", "primary")),
        put("mine", b"here"),
    )
    roots = {"other": other.root, "primary": kvs.root}
    asked: list[str] = []

    def ns_roots(ns: str) -> str | None:
        asked.append(ns)
        return roots.get(ns)

    def get(key: str, flags: int = 0):
        return kvs.get(key, flags, namespace="primary", ns_roots=ns_roots)

    assert get("far") == T.val(b"in-other")
    assert get("oldstyle") == T.val(b"in-other")
    assert get("fardir.y") == T.val(b"in-other")
    assert get("farroot.x.y") == T.val(b"in-other")
    # a link inside the other namespace resolves from that namespace's root
    assert get("farroot.back.y") == T.val(b"in-other")
    assert set(get("fardir", READDIR)["data"]) == {"y"}
    assert get("far", READLINK) == T.symlink("x.y", "other")
    asked.clear()
    assert get("self") == T.val(b"here")
    assert asked == []  # a link naming our own namespace needs no root

    with pytest.raises(NeedNamespace) as e:
        kvs.get("far")  # no ns_roots
    assert e.value.namespace == "other"
    with pytest.raises(NeedNamespace) as e:
        kvs.get("far", ns_roots=lambda ns: None)
    assert e.value.namespace == "other"

    def denied(ns: str) -> str:
        raise ErrnoError(errno.EPERM)

    assert errnum(lambda: kvs.get("far", ns_roots=denied)) == errno.EPERM


def test_need_blobs_then_success() -> None:
    full = Kvs()
    full.commit(put("d1.d2.key", b"v"), put("big", b"B" * 500))
    blobs = dict(full.store)
    d1 = full.get("d1", TREEOBJ)["data"][0]
    d2 = full.get("d1.d2", TREEOBJ)["data"][0]
    partial = {ref: blob for ref, blob in blobs.items() if ref not in (d1, d2)}

    with pytest.raises(NeedBlobs) as e:
        lookup(partial, full.root, "d1.d2.key", 0)
    assert e.value.refs == {d1}
    partial[d1] = blobs[d1]
    with pytest.raises(NeedBlobs) as e:
        lookup(partial, full.root, "d1.d2.key", 0)
    assert e.value.refs == {d2}
    partial[d2] = blobs[d2]
    assert lookup(partial, full.root, "d1.d2.key", 0) == T.val(b"v")

    with pytest.raises(NeedBlobs) as e:
        lookup({}, full.root, "anything", 0)
    assert e.value.refs == {full.root}


def test_need_blobs_gathers_all_valref_blobs() -> None:
    chunks = [b"chunk-%d" % i * 20 for i in range(3)]
    refs = [hash_blob(c) for c in chunks]
    kvs = Kvs()
    kvs.commit(put("v", T.valref(refs)))
    with pytest.raises(NeedBlobs) as e:
        kvs.get("v")
    assert e.value.refs == set(refs)
    kvs.store[refs[1]] = chunks[1]
    with pytest.raises(NeedBlobs) as e:
        kvs.get("v")
    assert e.value.refs == {refs[0], refs[2]}
    kvs.store.update(zip(refs, chunks, strict=True))
    assert kvs.get("v") == T.val(b"".join(chunks))
    assert kvs.get("v", TREEOBJ) == T.valref(refs)  # no blobs needed


def test_bad_roots() -> None:
    store = {hash_blob(b"raw"): b"raw"}
    val_blob = T.encode(T.val(b"not a dir"))
    store[hash_blob(val_blob)] = val_blob
    assert errnum(lambda: lookup(store, "bogus", "a", 0)) == errno.EINVAL
    assert errnum(lambda: lookup(store, hash_blob(b"raw"), "a", 0)) == errno.EINVAL
    assert errnum(lambda: lookup(store, hash_blob(val_blob), "a", 0)) == errno.EINVAL
    assert errnum(lambda: lookup(store, hash_blob(val_blob), ".", READDIR)) == errno.EINVAL


def test_hashed_directory_is_invisible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)
    kvs = Kvs()
    names = [f"n{i}" for i in range(200)]
    kvs.commit(*(put(f"big.{n}", n.encode()) for n in names), put("big.sub.x", b"deep"))
    top = kvs.cache.get_obj(kvs.get("big", TREEOBJ)["data"][0])
    assert top["type"] == "hdir" and top["data"]["count"] == 201
    assert kvs.get("big", TREEOBJ)["type"] == "dirref"
    listing = kvs.get("big", READDIR)
    assert listing["type"] == "dir"
    assert set(listing["data"]) == {*names, "sub"}
    assert all(e["type"] != "hdir" for e in listing["data"].values())
    assert kvs.get("big.n123") == T.val(b"n123")
    assert kvs.get("big.sub.x") == T.val(b"deep")
    assert kvs.get("big.missing") is None

    # READDIR on a cold store asks for every shard of a level at once
    cold = {kvs.root: kvs.store[kvs.root], top_ref(kvs): kvs.store[top_ref(kvs)]}
    with pytest.raises(NeedBlobs) as e:
        lookup(cold, kvs.root, "big", READDIR)
    assert e.value.refs == set(top["data"]["shards"].values())
    rounds = 1
    while True:
        try:
            again = lookup(cold, kvs.root, "big", READDIR)
            break
        except NeedBlobs as e:
            rounds += 1
            cold.update({ref: kvs.store[ref] for ref in e.refs})
    assert again == listing
    assert rounds <= 4


def top_ref(kvs: Kvs) -> str:
    return kvs.get("big", TREEOBJ)["data"][0]


def test_an_inner_shard_is_refused_as_a_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read at a root (``--at``, ``kvs diff``), an inner shard of a big
    directory listed the few keys under it and missed the rest, as if the
    directory held only those: ``EINVAL``, as a namespace's new root or a
    ``dirref`` put refuse it.  The whole directory's top shard is a root."""
    monkeypatch.setattr(shards, "SHARD_THRESHOLD", 4)
    writer = T.BlobWriter()
    ents = {f"e{i}": T.val(b"%d" % i) for i in range(40)}
    top = shards.make_dir(ents, writer)
    store = dict(writer.blobs)
    cache = T.BlobCache(store)
    inner = [ref for ref in store if (o := cache.get_obj(ref)) is not None
             and o["type"] == "hdir" and o["data"]["depth"] >= 1]
    assert inner, "no inner shard at this threshold"
    assert errnum(lambda: read_dir(store, inner[0])) == errno.EINVAL
    assert errnum(lambda: lookup(cache, inner[0], "e1", 0)) == errno.EINVAL
    top_ref = hash_blob(T.encode(top))
    store[top_ref] = T.encode(top)
    assert set(read_dir(store, top_ref)["data"]) == set(ents)
