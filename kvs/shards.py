"""Big directories without O(n) rewrites: hashed shards (``hdir``).

Flux stores a directory as one blob and rewrites it on every commit that
touches it, so committing into a directory of n entries costs O(n) bytes of
encoding, hashing and storing.  Here a directory with more than
:data:`SHARD_THRESHOLD` entries is stored as a hash-array-mapped trie (the
``hdir`` format is specified in :mod:`kvs.treeobj`): interior ``hdir`` nodes
of at most 16 shards, leaves that are ordinary ``dir`` objects of at most
``SHARD_THRESHOLD`` entries.  Changing one name rewrites one leaf plus the
interior nodes on its path -- O(log n) blobs of bounded size.

* A leaf that grows past ``SHARD_THRESHOLD`` splits into a node one level
  deeper; a node whose count falls below ``SHARD_THRESHOLD // 2`` collapses
  back into one leaf (the top node into a plain ``dir``), so sizes stay
  bounded in both directions with some hysteresis.
* Everything here is pure: blobs are read through a
  :class:`~kvs.treeobj.BlobCache` (raising :class:`~kvs.treeobj.NeedBlobs`
  with as many missing refs as can be known at once) and written through a
  :class:`~kvs.treeobj.BlobWriter`.

The functions accept either a plain ``dir`` or an ``hdir`` top node, so
callers need not care which one a ``dirref`` points to.
"""

from __future__ import annotations

import errno
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from broker.errors import ErrnoError
from kvs.treeobj import (
    HDIR_MAX_DEPTH,
    VER,
    BlobCache,
    BlobWriter,
    NeedBlobs,
    TreeObj,
    hdir,
)

SHARD_THRESHOLD = 128
"""Most entries a plain ``dir`` (or a leaf shard) holds before it is sharded.

Read at call time, so tests may monkeypatch it to exercise deep tries.
"""

# (name, hash, entry-or-None) -- an entry of None deletes the name.
_Item = tuple[str, str, "TreeObj | None"]


def name_hash(name: str) -> str:
    """16 hex digits of blake2b-64 of ``name``; digit ``d`` picks the shard at depth ``d``."""
    return hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def is_hdir(obj: TreeObj) -> bool:
    """True for an ``hdir`` node."""
    hdir: bool = obj["type"] == "hdir"
    return hdir


def names_a_directory(obj: TreeObj | None) -> bool:
    """Whether a loaded blob is a whole directory: a ``dir``, or the top
    shard (depth 0) of a big one -- an inner shard holds only part of it."""
    return obj is not None and (obj["type"] == "dir" or (
        obj["type"] == "hdir" and obj["data"]["depth"] == 0))


def count(obj: TreeObj) -> int:
    """Number of entries of a ``dir`` or ``hdir``, without loading any shard."""
    data = obj["data"]
    return data["count"] if obj["type"] == "hdir" else len(data)


def _corrupt(msg: str) -> ErrnoError:
    return ErrnoError(errno.ENOTRECOVERABLE, f"corrupt hashed directory: {msg}")


def _child(cache: BlobCache, writer: BlobWriter | None, ref: str, depth: int) -> TreeObj | None:
    """The shard ``ref`` below a node of ``depth``, or ``None`` when it is not loaded."""
    obj = writer.objs.get(ref) if writer is not None else None
    if obj is None:
        obj = cache.get_obj(ref)
        if obj is None:
            return None
    t = obj["type"]
    if t == "dir" or (t == "hdir" and obj["data"]["depth"] == depth + 1):
        return obj
    raise _corrupt(f"shard {ref} is a {t}")


def get(cache: BlobCache, obj: TreeObj, name: str) -> TreeObj | None:
    """The entry ``name`` of directory ``obj`` (dir or hdir), or ``None``."""
    entry: TreeObj | None
    if obj["type"] == "dir":
        entry = obj["data"].get(name)
        return entry
    h = name_hash(name)
    while True:
        data = obj["data"]
        depth = data["depth"]
        ref = data["shards"].get(h[depth])
        if ref is None:
            return None
        child = _child(cache, None, ref, depth)
        if child is None:
            raise NeedBlobs((ref,))
        if child["type"] == "dir":
            entry = child["data"].get(name)
            return entry
        obj = child


def entries(cache: BlobCache, obj: TreeObj, writer: BlobWriter | None = None) -> dict[str, TreeObj]:
    """All entries of directory ``obj`` merged into one new dict.

    Missing shards are gathered level by level: a :class:`NeedBlobs` carries
    every missing shard of the deepest level reachable so far.
    """
    if obj["type"] == "dir":
        return dict(obj["data"])
    out: dict[str, TreeObj] = {}
    missing: set[str] = set()
    frontier = [obj]
    while frontier:
        deeper = []
        for node in frontier:
            depth = node["data"]["depth"]
            for ref in node["data"]["shards"].values():
                child = _child(cache, writer, ref, depth)
                if child is None:
                    missing.add(ref)
                elif child["type"] == "dir":
                    out.update(child["data"])
                else:
                    deeper.append(child)
        frontier = deeper
    if missing:
        raise NeedBlobs(missing)
    return out


@dataclass
class LostShards:
    """Shards of one node that cannot be read (:func:`salvage`)."""

    refs: list[tuple[str, str | None]]
    """Each shard's blobref, and why it cannot be read (``None``: the store
    lacks it; else the error, e.g. its bytes do not match their hash)."""
    count: int
    """The entries in them, by their node's count less its readable shards'
    (their own counts are in the blobs that are gone)."""


def salvage(cache: BlobCache, obj: TreeObj) -> tuple[dict[str, TreeObj], list[LostShards]]:
    """The entries of directory ``obj`` that can be read, and the shards that
    cannot, grouped by node.

    :func:`entries` fails on the first level with a missing shard, which is
    right for the engines (they fetch it and try again) but loses the whole
    directory for a salvage: ``kvs dump --ignore-failed-read`` and
    ``kvs fsck --repair`` keep every entry of the readable shards instead.
    A shard's names are only known from its blob, so what is lost is
    counted, not named.  ``cache`` must raise (``ErrnoError``) for a blob
    it holds damaged; such a shard, or one of the wrong form, is lost too.
    """
    if obj["type"] == "dir":
        return dict(obj["data"]), []
    if obj["type"] != "hdir":
        raise ErrnoError(errno.EINVAL, f"a {obj['type']}, not a directory")
    out: dict[str, TreeObj] = {}
    lost: list[LostShards] = []
    stack = [obj]
    while stack:
        node = stack.pop()
        data = node["data"]
        gone: list[tuple[str, str | None]] = []
        held = 0
        for _, ref in sorted(data["shards"].items()):
            try:
                child = _child(cache, None, ref, data["depth"])
            except ErrnoError as exc:
                gone.append((ref, exc.errstr))
                continue
            if child is None:
                gone.append((ref, None))
                continue
            held += count(child)
            if child["type"] == "dir":
                out.update(child["data"])
            else:
                stack.append(child)
        if gone:
            lost.append(LostShards(gone, max(data["count"] - held, 0)))
    return out, lost


def missing(cache: BlobCache, obj: TreeObj, names: list[str]) -> set[str]:
    """Refs of the shards that resolving ``names`` in ``obj`` would load but cannot."""
    if obj["type"] == "dir":
        return set()
    return _missing(cache, obj, [(n, name_hash(n), None) for n in names])


def _missing(cache: BlobCache, obj: TreeObj, items: list[_Item]) -> set[str]:
    out: set[str] = set()
    stack = [(obj, items)]
    while stack:
        node, its = stack.pop()
        depth = node["data"]["depth"]
        shards = node["data"]["shards"]
        for digit, group in _group(its, depth).items():
            ref = shards.get(digit)
            if ref is None:
                continue
            child = _child(cache, None, ref, depth)
            if child is None:
                out.add(ref)
            elif child["type"] == "hdir":
                stack.append((child, group))
    return out


def _group(items: list[_Item], depth: int) -> dict[str, list[_Item]]:
    groups: dict[str, list[_Item]] = {}
    for item in items:
        groups.setdefault(item[1][depth], []).append(item)
    return groups


def _leaf(ents: dict[str, TreeObj]) -> TreeObj:
    return {"data": ents, "type": "dir", "ver": VER}


def _build(items: list[_Item], depth: int, writer: BlobWriter) -> TreeObj:
    """An hdir node of ``depth`` holding ``items`` (all with entries)."""
    shards: dict[str, str] = {}
    # (digits in order: the node then packs as it is, see encode_built)
    for digit, group in sorted(_group(items, depth).items()):
        if len(group) > SHARD_THRESHOLD and depth + 1 < HDIR_MAX_DEPTH:
            child = _build(group, depth + 1, writer)
        else:
            child = _leaf({name: entry for name, _, entry in group})  # type: ignore[misc]
        shards[digit] = writer.put_obj(child)
    return hdir(depth, len(items), shards)


def make_dir(ents: Mapping[str, TreeObj], writer: BlobWriter) -> TreeObj:
    """The top object for a directory of ``ents``: a plain ``dir`` if small,
    else an ``hdir`` whose shards are written to ``writer``.

    The caller stores the returned object itself (e.g. ``writer.put_obj``).
    ``ents`` must already be unrolled (no inline ``dir`` entries).
    """
    if len(ents) <= SHARD_THRESHOLD:
        return _leaf(dict(ents))
    return _build([(n, name_hash(n), e) for n, e in ents.items()], 0, writer)


def update(
    cache: BlobCache,
    obj: TreeObj,
    changes: Mapping[str, TreeObj | None],
    writer: BlobWriter,
) -> TreeObj:
    """Apply ``changes`` (name -> entry, or ``None`` to delete) to directory ``obj``.

    Returns the new top object (``dir`` or ``hdir``), not yet stored; the
    shards it references are written to ``writer``.  Only the leaves and
    nodes on the paths of the changed names are rewritten.  Raises
    :class:`NeedBlobs` (before doing any work) when shards on those paths
    are missing.
    """
    if obj["type"] == "dir":
        ents = dict(obj["data"])
        for name, entry in changes.items():
            if entry is None:
                ents.pop(name, None)
            else:
                ents[name] = entry
        return make_dir(ents, writer)
    items: list[_Item] = [(n, name_hash(n), e) for n, e in changes.items()]
    need = _missing(cache, obj, items)
    if need:
        raise NeedBlobs(need)
    node = _update_node(cache, obj, items, writer)
    if node is None:
        return _leaf({})
    if node["data"]["count"] < SHARD_THRESHOLD // 2:
        return _leaf(entries(cache, node, writer))
    return node


def _update_node(
    cache: BlobCache, node: TreeObj, items: list[_Item], writer: BlobWriter
) -> TreeObj | None:
    data = node["data"]
    depth = data["depth"]
    total = data["count"]
    shards = dict(data["shards"])
    added = False
    for digit, group in _group(items, depth).items():
        ref = shards.get(digit)
        added = added or ref is None
        child = None
        if ref is not None:
            child = _child(cache, writer, ref, depth)
            if child is None:
                raise NeedBlobs((ref,))
        new: TreeObj | None
        base = None  # the leaf ``new`` was derived from, for BlobWriter.put_obj
        if child is None or child["type"] == "dir":
            ents = dict(child["data"]) if child is not None else {}
            before = len(ents)
            for name, _, entry in group:
                if entry is None:
                    ents.pop(name, None)
                else:
                    ents[name] = entry
            total += len(ents) - before
            if not ents:
                new = None
            elif len(ents) > SHARD_THRESHOLD and depth + 1 < HDIR_MAX_DEPTH:
                new = _build([(n, name_hash(n), e) for n, e in ents.items()], depth + 1, writer)
            else:
                new = _leaf(ents)
                base = ref
        else:
            old_count = child["data"]["count"]
            new = _update_node(cache, child, group, writer)
            new_count = new["data"]["count"] if new is not None else 0
            total += new_count - old_count
            if new is not None and new_count < SHARD_THRESHOLD // 2:
                new = _leaf(entries(cache, new, writer))
        if ref is not None:
            writer.replaced.append(ref)
        if new is None:
            shards.pop(digit, None)
        else:
            shards[digit] = writer.put_obj(new, base, [name for name, _, _ in group])
    if total == 0:
        return None
    if added:  # a new digit went last: back in order, so the node packs as it is
        shards = {digit: shards[digit] for digit in sorted(shards)}
    return hdir(depth, total, shards)
