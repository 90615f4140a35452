"""Tree objects: constructors, validation, canonical msgpack, JSON, blob cache."""

import errno
import json

import msgpack
import pytest
from conftest import CountingStore

from broker.content.blobref import hash_blob
from broker.errors import ErrnoError
from kvs import treeobj as T
from kvs.keys import MAX_DEPTH

REF1 = hash_blob(b"one")
REF2 = hash_blob(b"two")
SHA1REF = hash_blob(b"one", "sha1")


def all_kinds() -> list[dict]:
    return [
        T.val(b"hello"),
        T.val(b""),
        T.valref([REF1, REF2]),
        T.valref([SHA1REF]),
        T.dirref(REF1),
        T.dir_(),
        T.dir_({"a": T.val(b"x"), "b": T.dir_({"c": T.symlink("a")})}),
        T.symlink("a.b"),
        T.symlink("a.b", "ns1"),
        T.hdir(0, 300, {"0": REF1, "f": REF2}),
    ]


@pytest.mark.parametrize("obj", all_kinds(), ids=lambda o: o["type"])
def test_valid_objects_round_trip(obj: dict) -> None:
    assert T.validate(obj) is obj
    assert T.typeof(obj) == obj["type"]
    blob = T.encode(obj)
    assert T.decode(blob) == obj
    assert T.from_json(T.to_json(obj)) == obj
    assert T.from_json(T.to_jsonable(obj)) == obj
    assert T.copy(obj) == obj


def test_val_json_is_base64_as_in_flux() -> None:
    assert json.loads(T.to_json(T.val(b"hello"))) == {"data": "aGVsbG8=", "type": "val", "ver": 1}
    nested = json.loads(T.to_json(T.dir_({"k": T.val(b"\x00\xff")})))
    assert nested["data"]["k"]["data"] == "AP8="


def test_encode_is_canonical() -> None:
    a = T.dir_({"x": T.val(b"1"), "y": T.symlink("t", "ns")})
    b = T.dir_({"y": {"ver": 1, "data": {"target": "t", "namespace": "ns"}, "type": "symlink"}})
    b["data"]["x"] = {"type": "val", "ver": 1, "data": b"1"}
    assert a == b
    assert T.encode(a) == T.encode(b)
    assert hash_blob(T.encode(a)) == hash_blob(T.encode(b))
    # bytes travel as msgpack bin, not str
    raw = msgpack.unpackb(T.encode(T.val(b"abc")), raw=True)
    assert raw[b"data"] == b"abc"


def test_decode_puts_fields_in_canonical_order() -> None:
    # A blob stored by hand, its fields in msgpack map order ver, type, data:
    # decode reorders them, so encode_built (which trusts the order of val,
    # valref and dirref entries) still produces the canonical bytes.
    by_hand = {"ver": 1, "type": "dir", "data": {
        "a": {"ver": 1, "type": "val", "data": b"1"},
        "b": {"type": "dirref", "ver": 1, "data": [REF1]},
        "c": {"data": {"target": "t", "namespace": "ns"}, "ver": 1, "type": "symlink"},
    }}
    raw = msgpack.packb(by_hand, use_bin_type=True)
    assert raw != T.encode(by_hand)
    obj = T.decode(raw)
    assert list(obj) == ["data", "type", "ver"]
    assert all(list(e) == ["data", "type", "ver"] for e in obj["data"].values())
    assert T.encode_built(obj) == T.encode(by_hand) == T.encode(obj)


def test_encode_built_matches_encode_for_built_objects() -> None:
    d = T.dir_({"x": T.val(b"1"), "v": T.valref([REF1, REF2]), "r": T.dirref(REF1),
                "s": T.symlink("t", "ns"), "i": T.dir_({"z": T.val(b"z"), "y": T.val(b"y")})})
    assert T.encode_built(d) == T.encode(d)
    assert T.encode_built(T.hdir(0, 3, {"f": REF1, "0": REF2})) == \
        T.encode(T.hdir(0, 3, {"f": REF1, "0": REF2}))
    # A hand-written entry in another field order is what encode_built does
    # not promise to fix: that is encode's job.
    d["data"]["x"] = {"type": "val", "ver": 1, "data": b"1"}
    assert T.encode_built(d) != T.encode(d)


def test_encode_built_packs_an_hdir_in_order_as_it_is_and_canonicalizes_any_other() -> None:
    # encode_built packs an hdir node without copying it only when its
    # fields and shard digits are in canonical order: checked, not trusted,
    # so a node in any other order (a blob stored by hand and decoded, a
    # dict written by hand) still gets the canonical bytes.
    want = T.encode(T.hdir(1, 3, {"0": REF2, "f": REF1}))
    assert msgpack.unpackb(want)["data"]["shards"] == {"0": REF2, "f": REF1}
    for node in (
        T.hdir(1, 3, {"0": REF2, "f": REF1}),
        T.hdir(1, 3, {"f": REF1, "0": REF2}),
        {"ver": 1, "type": "hdir", "data": {"count": 3, "depth": 1, "shards": {"0": REF2,
                                                                              "f": REF1}}},
        {"data": {"shards": {"0": REF2, "f": REF1}, "depth": 1, "count": 3}, "type": "hdir",
         "ver": 1},
        T.decode(msgpack.packb({"ver": 1, "type": "hdir", "data": {
            "depth": 1, "shards": {"f": REF1, "0": REF2}, "count": 3}})),
    ):
        assert T.encode_built(node) == want, node


def test_copy_is_deep() -> None:
    orig = T.dir_({"v": T.valref([REF1]), "d": T.dir_({"s": T.symlink("x")})})
    cp = T.copy(orig)
    cp["data"]["v"]["data"].append(REF2)
    cp["data"]["d"]["data"]["s"]["data"]["target"] = "y"
    assert orig["data"]["v"]["data"] == [REF1]
    assert orig["data"]["d"]["data"]["s"]["data"]["target"] == "x"


BAD = [
    ("not a map", "val"),
    ({"ver": 1, "type": "val"}, "missing data"),
    ({"ver": 1, "type": "val", "data": b"", "extra": 1}, "extra field"),
    ({"ver": 2, "type": "val", "data": b""}, "version"),
    ({"ver": True, "type": "val", "data": b""}, "bool version"),
    ({"ver": "1", "type": "val", "data": b""}, "str version"),
    ({"ver": 1, "type": "file", "data": b""}, "unknown type"),
    ({"ver": 1, "type": "val", "data": "text"}, "val str"),
    ({"ver": 1, "type": "valref", "data": []}, "empty valref"),
    ({"ver": 1, "type": "valref", "data": REF1}, "valref not list"),
    ({"ver": 1, "type": "valref", "data": ["sha256-xyz"]}, "bad blobref"),
    ({"ver": 1, "type": "valref", "data": [REF1[:-1]]}, "short blobref"),
    ({"ver": 1, "type": "dirref", "data": [REF1, REF2]}, "two dirrefs"),
    ({"ver": 1, "type": "dirref", "data": ["md5-00"]}, "bad hash"),
    ({"ver": 1, "type": "dir", "data": []}, "dir not map"),
    ({"ver": 1, "type": "dir", "data": {"": T.val(b"")}}, "empty name"),
    ({"ver": 1, "type": "dir", "data": {"a.b": T.val(b"")}}, "dotted name"),
    ({"ver": 1, "type": "dir", "data": {"a": {"ver": 1}}}, "bad nested entry"),
    ({"ver": 1, "type": "dir", "data": {"a": T.dir_({"b": 5})}}, "bad deep entry"),
    ({"ver": 1, "type": "dir", "data": {"h": T.hdir(0, 0, {})}}, "hdir as entry"),
    ({"ver": 1, "type": "symlink", "data": "a.b"}, "flux-v0 string symlink"),
    ({"ver": 1, "type": "symlink", "data": {}}, "no target"),
    ({"ver": 1, "type": "symlink", "data": {"target": ""}}, "empty target"),
    ({"ver": 1, "type": "symlink", "data": {"target": 1}}, "int target"),
    ({"ver": 1, "type": "symlink", "data": {"target": "a", "namespace": ""}}, "empty ns"),
    ({"ver": 1, "type": "symlink", "data": {"target": "a", "x": "y"}}, "extra symlink field"),
    ({"ver": 1, "type": "hdir", "data": {"depth": 0, "count": 1}}, "hdir no shards"),
    ({"ver": 1, "type": "hdir", "data": {"depth": -1, "count": 1, "shards": {}}}, "depth"),
    ({"ver": 1, "type": "hdir", "data": {"depth": 16, "count": 1, "shards": {}}}, "deep"),
    ({"ver": 1, "type": "hdir", "data": {"depth": 0, "count": -1, "shards": {}}}, "count"),
    ({"ver": 1, "type": "hdir", "data": {"depth": 0, "count": 1, "shards": {"g": REF1}}}, "key"),
    ({"ver": 1, "type": "hdir", "data": {"depth": 0, "count": 1, "shards": {"0": "x"}}}, "ref"),
]


@pytest.mark.parametrize(("obj", "why"), BAD, ids=[why for _, why in BAD])
def test_validate_rejects(obj: object, why: str) -> None:
    with pytest.raises(ErrnoError) as e:
        T.validate(obj)
    assert e.value.errnum == errno.EINVAL, why



def test_validate_takes_directories_nested_max_depth_deep_and_no_deeper() -> None:
    """A dir object may hold MAX_DEPTH levels of directories (the commit
    engine recurses once per level: kvs/keys.py); a non-empty one below
    that is ``EINVAL``, an empty one is a leaf and may end the chain."""
    def nested(levels: int, leaf: dict) -> dict:
        obj = leaf
        for _ in range(levels):
            obj = T.dir_({"d": obj})
        return obj

    assert T.validate(nested(MAX_DEPTH, T.val(b"bottom")))
    assert T.validate(nested(MAX_DEPTH, T.dir_()))
    with pytest.raises(ErrnoError) as e:
        T.validate(nested(MAX_DEPTH, T.dir_({"v": T.val(b"too deep")})))
    assert e.value.errnum == errno.EINVAL

def test_constructors_reject_bad_input() -> None:
    for fn in (
        lambda: T.valref([]),
        lambda: T.valref(["nope"]),
        lambda: T.dirref("nope"),
        lambda: T.symlink(""),
        lambda: T.symlink("a", ""),
        lambda: T.typeof({"type": "bogus"}),
        lambda: T.typeof(None),
    ):
        with pytest.raises(ErrnoError) as e:
            fn()
        assert e.value.errnum == errno.EINVAL


@pytest.mark.parametrize("garbage", [b"", b"\xc1", b"\x92\x01", T.encode(T.val(b"x")) + b"\x00"])
def test_decode_garbage_is_eproto(garbage: bytes) -> None:
    with pytest.raises(ErrnoError) as e:
        T.decode(garbage)
    assert e.value.errnum == errno.EPROTO


@pytest.mark.parametrize(
    "obj", [{"ver": 1, "type": "val", "data": "str"}, [1, 2], {"a": 1}, 7], ids=repr
)
def test_decode_msgpack_non_treeobj_is_einval(obj: object) -> None:
    with pytest.raises(ErrnoError) as e:
        T.decode(msgpack.packb(obj))
    assert e.value.errnum in (errno.EINVAL, errno.EPROTO)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"ver":1,"type":"val","data":"!!!"}',
        '{"ver":1,"type":"val","data":5}',
        '{"ver":1,"type":"dir","data":{"a":{"ver":1,"type":"val","data":"@"}}}',
        '{"ver":1,"type":"nope","data":1}',
        "[]",
    ],
)
def test_from_json_rejects(text: str) -> None:
    with pytest.raises(ErrnoError) as e:
        T.from_json(text)
    assert e.value.errnum == errno.EINVAL


def test_blob_cache_memoizes_and_bounds() -> None:
    store: dict[str, bytes] = {}
    objs = [T.dir_({f"k{i}": T.val(b"v")}) for i in range(5)]
    refs = []
    for obj in objs:
        blob = T.encode(obj)
        refs.append(hash_blob(blob))
        store[refs[-1]] = blob
    cache = T.BlobCache(store, max_objects=3)
    first = cache.get_obj(refs[0])
    assert first == objs[0]
    assert cache.get_obj(refs[0]) is first  # decoded once
    for ref in refs[1:]:
        cache.get_obj(ref)
    assert len(cache._objs) == 3
    assert cache.get_obj(refs[0]) == objs[0]  # evicted, decoded again
    assert cache.get_obj(hash_blob(b"absent")) is None
    with pytest.raises(T.NeedBlobs) as e:
        cache.need_obj(hash_blob(b"absent"))
    assert e.value.refs == {hash_blob(b"absent")}
    assert T.as_cache(cache) is cache
    assert isinstance(T.as_cache(store), T.BlobCache)


def test_blob_cache_is_bounded_by_its_objects_blob_bytes() -> None:
    """Big objects (a directory whose eventlog valref lists every line's
    blobref, one version per append) are bounded by bytes, not only by count:
    a follower held 600 MB of them at 3,000 appends."""
    store: dict[str, bytes] = {}
    refs = []
    for i in range(20):
        obj = T.dir_({"log": T.valref([hash_blob(f"{i}.{j}".encode()) for j in range(100)])})
        refs.append(_stored(store, obj))
    size = len(store[refs[0]])
    cache = T.BlobCache(store, max_objects=1000, max_bytes=5 * size)
    for ref in refs:
        cache.get_obj(ref)
    assert len(cache) == 5 and cache.nbytes <= 5 * size
    assert list(cache._objs) == refs[-5:]  # the most recently used stay
    # what a transaction writes counts too, and forgetting gives bytes back
    written = T.dir_({"log": T.valref([hash_blob(b"w%d" % j) for j in range(100)])})
    ref = _stored(store, written)
    cache.remember({ref: written}, blobs={ref: store[ref]})
    assert ref in cache._objs and cache.nbytes <= 5 * size and len(cache) == 5
    one = T.BlobCache(store, max_bytes=1)  # the newest stays, however big
    assert one.get_obj(refs[0]) is not None and len(one) == 1


def _stored(store: dict, obj: dict) -> str:
    blob = T.encode(obj)
    ref = hash_blob(blob)
    store[ref] = blob
    return ref


def _write(cache: T.BlobCache, store: dict, obj: dict, replaced: tuple[str, ...] = ()) -> str:
    """Store ``obj`` and remember it as one transaction's output."""
    ref = _stored(store, obj)
    cache.remember({ref: obj}, replaced=replaced)
    return ref


def _other_txns(cache: T.BlobCache, store: dict, n: int) -> None:
    """``n`` transactions that touch nothing else."""
    for i in range(n):
        _write(cache, store, T.dir_({"x": T.val(f"other{i}".encode())}))


def test_blob_cache_forgets_replaced_versions_after_probation() -> None:
    store = CountingStore()
    cache = T.BlobCache(store)
    old = T.dir_({"k": T.val(b"1")})
    old_ref = _write(cache, store, old)
    _write(cache, store, T.dir_({"k": T.val(b"2")}), replaced=(old_ref,))
    _other_txns(cache, store, T.PROBATION - 1)  # the window: still memoized
    assert old_ref in cache._objs
    _other_txns(cache, store, 1)
    assert old_ref not in cache._objs and cache.forgotten == 1
    reads = store.reads
    assert cache.get_obj(old_ref) == old  # safe: decoded again from the store
    assert store.reads == reads + 1


def test_blob_cache_keeps_replaced_versions_read_again() -> None:
    """Identical content elsewhere is the same blob: a version one directory
    replaced may be another's current one, and reading it keeps it."""
    store = CountingStore()
    cache = T.BlobCache(store)
    shared = T.dir_({"k": T.val(b"same")})
    shared_ref = _write(cache, store, shared)
    _write(cache, store, T.dir_({"k": T.val(b"next")}), replaced=(shared_ref,))
    assert cache.get_obj(shared_ref) is shared  # read within the window
    rewritten = T.dir_({"k": T.val(b"again")})
    rewritten_ref = _write(cache, store, rewritten)
    _write(cache, store, T.dir_(), replaced=(rewritten_ref,))
    _write(cache, store, rewritten)  # written again: current once more
    _other_txns(cache, store, 2 * T.PROBATION)
    assert shared_ref in cache._objs and rewritten_ref in cache._objs
    assert cache.forgotten == 0 and store.reads == 0


def test_blob_writer() -> None:
    w = T.BlobWriter("sha1")
    ref = w.put_obj(T.dir_())
    assert ref.startswith("sha1-")
    assert T.decode(w.blobs[ref]) == T.dir_()
    assert w.objs[ref] == T.dir_()
    raw = w.put_raw(b"data")
    assert w.blobs[raw] == b"data" and raw not in w.objs


@pytest.mark.parametrize("n", [0, 1, 15, 16, 300, 70_000])
def test_packed_dir_encodes_like_encode(n: int) -> None:
    # The head/entries/tail assembly must give the canonical bytes for every
    # msgpack map size class (fixmap, map16, map32) and for entries that
    # need canonicalising (symlinks) as well as flat ones.
    ents = {f"k{i:06d}": T.val(str(i).encode()) for i in range(n)}
    if n:
        ents["link"] = {"type": "symlink", "ver": 1, "data": {"target": "t", "namespace": "ns"}}
    assert T.encode_packed(T.pack_dir(ents)) == T.encode(T.dir_(ents))


def test_blobrefs_checked_before_are_not_checked_again_and_a_bad_one_still_fails() -> None:
    # A follower decodes each new version of a directory holding an
    # eventlog's valref: the refs it already found well-formed are looked up
    # in a bounded set instead of matched again; a bad one is refused anyway.
    refs = [hash_blob(b"%d" % i) for i in range(3000)]
    good = {"data": refs, "type": "valref", "ver": 1}
    T.validate(good)
    assert set(refs) <= T._KNOWN_REFS
    for bad in ("sha256-xyz", 7, ["x"], refs[0].upper()):
        with pytest.raises(ErrnoError) as info:
            T.validate({"data": [*refs, bad], "type": "valref", "ver": 1})
        assert info.value.errnum == errno.EINVAL and "bad blobref" in info.value.errstr
    assert "sha256-xyz" not in T._KNOWN_REFS
    many = [hash_blob(b"m%d" % i) for i in range(T._KNOWN_REFS_MAX + 10)]
    T.validate({"data": many, "type": "valref", "ver": 1})
    assert len(T._KNOWN_REFS) <= T._KNOWN_REFS_MAX  # (bounded: forgotten at once, then refilled)


# -- vtree ----------------------------------------------------------------------


def _vtree(nchunks: int = 1, ntail: int = 2) -> dict:
    chunks = [hash_blob(b"chunk %d" % i) for i in range(nchunks)]
    return T.vtree(chunks, [hash_blob(b"tail %d" % i) for i in range(ntail)])


def test_a_vtree_is_read_from_blobs_only() -> None:
    v = _vtree()
    assert T.decode(T.encode(v)) == v
    assert T.decode(T.encode(T.dir_({"log": v})))["data"]["log"] == v
    for obj in (v, T.dir_({"log": v})):  # a client's: refused
        with pytest.raises(ErrnoError) as e:
            T.validate(obj)
        assert e.value.errnum == errno.EINVAL and "valref" in e.value.errstr


@pytest.mark.parametrize("data", [
    {"chunks": [], "tail": [REF1]},
    {"chunks": [REF1]},
    {"chunks": [REF1], "tail": [REF2], "extra": 1},
    {"chunks": [REF1], "tail": [REF2] * T.VTREE_CHUNK},
    {"chunks": ["nope"], "tail": []},
    {"chunks": [REF1], "tail": [7]},
    [REF1],
])
def test_a_malformed_vtree_blob_is_refused(data) -> None:
    blob = msgpack.packb({"data": data, "type": "vtree", "ver": 1}, use_bin_type=True)
    with pytest.raises(ErrnoError) as e:
        T.decode(blob)
    assert e.value.errnum == errno.EINVAL


def test_a_vtree_names_its_chunks_as_trees_and_its_tail_as_data() -> None:
    v = _vtree(2, 1)
    assert list(T.blobrefs(v)) == [(v["data"]["chunks"][0], True),
                                   (v["data"]["chunks"][1], True),
                                   (v["data"]["tail"][0], False)]


def test_value_refs_reads_the_chunks_and_says_what_is_missing() -> None:
    refs = [hash_blob(b"%d" % i) for i in range(2 * T.VTREE_CHUNK + 1)]
    objs: dict[str, dict] = {}
    v = T.vtree_of(refs, lambda obj: objs.setdefault(hash_blob(T.encode(obj)), obj) and
                   hash_blob(T.encode(obj)))
    assert len(v["data"]["chunks"]) == 2 and v["data"]["tail"] == refs[-1:]
    assert T.value_refs(v, objs.get) == refs
    assert T.as_valref(v, objs.get) == T.valref(refs)
    first = v["data"]["chunks"][0]
    with pytest.raises(T.NeedBlobs) as need:
        T.value_refs(v, {k: o for k, o in objs.items() if k != first}.get)
    assert need.value.refs == {first}
    short = dict(objs, **{first: T.valref(refs[:3])})  # not a whole chunk: damaged
    with pytest.raises(ErrnoError) as e:
        T.value_refs(v, short.get)
    assert e.value.errnum == errno.ENOTRECOVERABLE


def _chunked(n: int) -> tuple[list[str], dict[str, dict], dict]:
    """``n`` blobrefs, the chunk and group objects by blobref, and their ``vtree``."""
    refs = [hash_blob(b"line %d" % i) for i in range(n)]
    objs: dict[str, dict] = {}

    def put(obj: dict) -> str:
        ref = _obj_ref(obj)
        objs[ref] = obj
        return ref
    return refs, objs, T.vtree_of(refs, put)


def _obj_ref(obj: dict) -> str:
    return hash_blob(T.encode(obj))


def _mark(refs: list[str]) -> bytes:
    """A mark computed the long way: every chunk and group named from its members."""
    k = T.VTREE_CHUNK
    whole = len(refs) - len(refs) % k
    chunks = [_obj_ref(T.valref(refs[i:i + k])) for i in range(0, whole, k)]
    grouped = len(chunks) - len(chunks) % k
    groups = [_obj_ref(T.vtree(chunks[i:i + k], [])) for i in range(0, grouped, k)]
    return T.refs_mark(groups, chunks[grouped:], refs[whole:])


G, K = T.VTREE_GROUP, T.VTREE_CHUNK
LONG = 2 * G + 2 * K + 44  # two groups, two chunks and a tail


def test_a_value_of_whole_groups_of_chunks_is_stored_with_an_index() -> None:
    refs, objs, v = _chunked(LONG)
    index, chunks, tail = T.vtree_parts(v)
    assert len(index) == 2 and len(chunks) == 2 and len(tail) == 44
    group = objs[index[1]]  # a group: a vtree of 128 chunks and no tail
    assert group["type"] == "vtree" and len(group["data"]["chunks"]) == K
    assert group["data"]["tail"] == [] and "index" not in group["data"]
    assert T.value_refs(v, objs.get) == refs
    assert T.decode(T.encode(v)) == v and T.decode(T.encode(T.dir_({"log": v})))["data"]["log"] == v
    assert [r for r, tree in T.blobrefs(v) if tree] == [*index, *chunks]
    # a one-level vtree written by an older version: its chunks are grouped when written
    old = T.vtree([c for g in index for c in objs[g]["data"]["chunks"]] + chunks, tail)
    assert T.value_refs(old, objs.get) == refs
    assert T.vtree_of(tail, lambda obj: _obj_ref(obj), old["data"]["chunks"]) == v
    # exactly one whole group: an index alone, no chunks, no tail
    only_refs, only_objs, only = _chunked(G)
    assert only == T.vtree([], [], [index[0]]) and index[0] in only_objs
    assert T.value_refs(only, only_objs.get) == only_refs == refs[:G]


@pytest.mark.parametrize("data", [
    {"chunks": [REF1] * K, "index": [REF1], "tail": []},  # an index, and a whole group of chunks
    {"chunks": [], "index": [], "tail": []},
    {"chunks": [], "tail": [REF1]},
    {"chunks": [REF1], "index": ["nope"], "tail": []},
    {"chunks": [REF1], "index": REF1, "tail": []},
])
def test_a_malformed_vtree_index_is_refused(data) -> None:
    blob = msgpack.packb({"data": data, "type": "vtree", "ver": 1}, use_bin_type=True)
    with pytest.raises(ErrnoError) as e:
        T.decode(blob)
    assert e.value.errnum == errno.EINVAL


@pytest.mark.parametrize("n, after", [
    (400, 0), (400, 1), (400, 127), (400, 128), (400, 129), (400, 300), (400, 384),
    (400, 400), (LONG, 0), (LONG, 5), (LONG, G - 1), (LONG, G), (LONG, G + K + 3),
    (LONG, 2 * G), (LONG, 2 * G + K), (LONG, LONG - 1), (LONG, LONG)])
def test_value_after_answers_the_blobs_after_those_marked(n: int, after: int) -> None:
    """A watcher that has the first ``after`` blobs gets the rest, and the
    mark of all of them; the groups and chunks before the ones holding blob
    ``after`` are not read; a flat valref of the same blobs, and a vtree of
    one level (both stored by older versions), have the same marks."""
    refs, objs, v = _chunked(n)
    read: list[str] = []

    def get_obj(ref: str) -> dict | None:
        read.append(ref)
        return objs.get(ref)
    got = T.value_after(v, after, _mark(refs[:after]), get_obj, _obj_ref)
    assert got == {"val": {"data": refs[after:], "type": "valref", "ver": 1},
                   "length": n, "mark": _mark(refs), "grown": True}
    index, chunks, _ = T.vtree_parts(v)
    g, rest = divmod(after, G)
    members = [c for grp in index[g:] for c in objs[grp]["data"]["chunks"]]
    want = [*index[g:], *members[rest // K:], *chunks] if g < len(index) \
        else chunks[rest // K:]
    assert read == want
    for other in (T.valref(refs),
                  T.vtree([c for grp in index for c in objs[grp]["data"]["chunks"]] + chunks,
                          T.vtree_parts(v)[2])):
        assert T.value_after(other, after, _mark(refs[:after]), objs.get, _obj_ref) == got


def test_value_after_says_when_the_blobs_marked_are_not_there() -> None:
    refs, objs, v = _chunked(300)
    other = [*refs[:200], hash_blob(b"rewritten"), *refs[201:]]
    for after, mark in [(250, _mark(other[:250])),  # one blob replaced before `after`
                        (301, _mark([*refs, refs[0]])),  # shortened
                        (10, b"\0" * 16)]:
        got = T.value_after(v, after, mark, objs.get, _obj_ref)
        assert got["grown"] is False and got["length"] == 300
        assert got["val"] == T.valref(refs)  # (all of it, as a plain lookup)
    # a value that is not a list of blobs comes as it is
    assert T.value_after(T.val(b"x"), 1, T.refs_mark([], [], [REF1]), objs.get, _obj_ref) \
        == {"val": T.val(b"x")}


def test_value_after_names_the_blobs_it_lacks_and_refuses_damaged_ones() -> None:
    refs, objs, v = _chunked(LONG)
    index, chunks, _ = T.vtree_parts(v)
    lacking = {k: o for k, o in objs.items() if k not in (index[0], index[1])}
    with pytest.raises(T.NeedBlobs) as need:
        T.value_after(v, G + 130, _mark(refs[:G + 130]), lacking.get, _obj_ref)
    assert need.value.refs == {index[1]}  # (group 0 is before blob G + 130: not wanted)
    first = objs[index[1]]["data"]["chunks"][1]
    lacking = {k: o for k, o in objs.items() if k != first}
    with pytest.raises(T.NeedBlobs) as need:
        T.value_refs(v, lacking.get)
    assert need.value.refs == {first}
    for damaged in ({index[1]: T.valref(refs[:3])}, {first: T.valref(refs[:3])},
                    {index[1]: T.vtree(objs[index[1]]["data"]["chunks"][:5], [])}):
        with pytest.raises(ErrnoError) as e:
            T.value_after(v, G + 130, _mark(refs[:G + 130]), {**objs, **damaged}.get, _obj_ref)
        assert e.value.errnum == errno.ENOTRECOVERABLE
        with pytest.raises(ErrnoError) as e:
            T.value_refs(v, {**objs, **damaged}.get)
        assert e.value.errnum == errno.ENOTRECOVERABLE
