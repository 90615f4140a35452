"""Tree objects: the nodes of the KVS hash tree (Flux RFC 11), as plain dicts.

A tree object is ``{"ver": 1, "type": T, "data": D}``:

============  ==============================================================
``val``       ``data`` is ``bytes`` (the value itself, stored inline)
``valref``    ``data`` is a non-empty list of blobrefs; the value is the
              concatenation of those blobs (this is how APPEND stays cheap)
``dir``       ``data`` maps an entry name to a tree object
``dirref``    ``data`` is a list of exactly one blobref naming a directory
``symlink``   ``data`` is ``{"target": str}`` or
              ``{"target": str, "namespace": str}``
``hdir``      kvbroker extension for big directories, see below
============  ==============================================================

Blobs hold tree objects in *canonical* msgpack (bin type for bytes, map keys
sorted at every level), so equal objects always hash to the same blobref.
JSON is only for people and the CLI: there ``val`` data is base64, as in Flux.

``hdir`` -- hashed directory (never visible to users)
-----------------------------------------------------
Flux rewrites a whole directory blob on every commit that touches it, so a
commit into a 100,000-entry directory costs O(n).  kvbroker stores a directory
with more than ``kvs.shards.SHARD_THRESHOLD`` entries as a hash-array-mapped
trie instead::

    {"ver": 1, "type": "hdir",
     "data": {"depth": d, "count": n, "shards": {"<hex digit>": blobref, ...}}}

* ``H(name)`` is ``blake2b(name as UTF-8, digest_size=8)`` as 16 lowercase
  hex digits.  A node at ``depth`` d sends ``name`` to ``shards[H(name)[d]]``;
  empty buckets are absent.  The top node of a directory has depth 0.
* A shard blob is either a *leaf* -- an ordinary ``dir`` object holding the
  entries of that bucket -- or an ``hdir`` node of depth ``d + 1``.
* ``count`` is the number of entries below the node.
* Only a blob may be an ``hdir``: a parent directory (or a namespace's
  rootref) points at it through an ordinary ``dirref``.  It never appears as
  an entry inside a ``dir``, is never returned by a lookup, and is refused
  as a commit dirent -- so users only ever see ``dir``/``dirref``.

``vtree`` -- a long value's blob list (never visible to users)
---------------------------------------------------------------
A ``valref`` lists every blob of its value in the directory that holds it,
so each append to an eventlog of n lines stored its directory again with
n blobrefs: O(n) bytes encoded, hashed, stored and sent per append.  A
value of :data:`VTREE_CHUNK` blobs or more is stored instead as::

    {"ver": 1, "type": "vtree",
     "data": {"chunks": [blobref, ...], "index": [blobref, ...], "tail": [blobref, ...]}}

* each of ``chunks`` names a *chunk*: a blob holding a ``valref`` of exactly
  :data:`VTREE_CHUNK` blobrefs; ``tail`` holds the last 0 to
  ``VTREE_CHUNK - 1`` blobrefs.  Each of ``index`` (absent when empty)
  names a *group*: a blob holding a ``vtree`` of exactly ``VTREE_CHUNK``
  chunks, an empty tail and no index (:data:`VTREE_GROUP` blobs); with an
  index, ``chunks`` holds fewer than ``VTREE_CHUNK`` (and may be empty).
  The value is the blobs of the groups, then of the chunks, in order, then
  those of the tail.
* An append adds to the tail; when the tail fills, it becomes one more
  chunk, and when the chunks fill, one more group.  So the directory holds
  fewer than 2 x ``VTREE_CHUNK`` blobrefs and one per group, and an append
  stores one small chunk or group now and then.  A ``vtree`` without an
  index but with more chunks (stored by older versions) is read as it is
  and grouped when next written.
* A ``vtree`` is a directory entry in stored blobs only: every lookup shows
  it as the ``valref`` of all its blobs (``TREEOBJ``, ``READDIR``), and it
  is refused in a commit (or a ``dir`` a commit names inline).  The commit
  engine turns a ``valref`` of ``VTREE_CHUNK`` blobrefs or more into one
  when it stores it (:func:`vtree_of`).
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import json
import reprlib
from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import msgpack

from broker import jsontoml
from broker.agemarks import AgeMarks
from broker.content import blobref
from broker.errors import ErrnoError, KvbrokerError
from kvs.keys import MAX_DEPTH

VER = 1
INLINE_MAX = 64
"""Values longer than this many bytes are stored as blobs on commit ("unroll")."""

TYPES = frozenset({"val", "valref", "dir", "dirref", "symlink", "hdir", "vtree"})
VTREE_CHUNK = 128
"""Blobrefs in a ``vtree``'s chunk, and chunks in a group; a ``valref`` with
this many or more is stored as a ``vtree`` (see the module docstring)."""
VTREE_GROUP = VTREE_CHUNK * VTREE_CHUNK
"""Blobs of a value in one group of a ``vtree``'s index (16,384)."""
HDIR_MAX_DEPTH = 16  # one hex digit of the 64-bit name hash per level
_HEX = frozenset("0123456789abcdef")
_FIELD_ORDER = ["data", "type", "ver"]
"""Canonical field order of a tree object (sorted), as every constructor writes it."""
_FLAT_TYPES = frozenset({"val", "valref", "dirref"})

TreeObj = dict[str, Any]


# --------------------------------------------------------------------------
# Constructors


def val(data: bytes | bytearray | memoryview) -> TreeObj:
    """A value stored inline."""
    return {"data": bytes(data), "type": "val", "ver": VER}


def valref(refs: Iterable[str]) -> TreeObj:
    """A value stored as the concatenation of blobs ``refs``."""
    refs = list(refs)
    if not refs:
        raise ErrnoError(errno.EINVAL, "valref needs at least one blobref")
    for ref in refs:
        blobref.check(ref)
    return {"data": refs, "type": "valref", "ver": VER}


def dir_(entries: Mapping[str, TreeObj] | None = None) -> TreeObj:
    """A directory held inline; ``entries`` is copied (not validated)."""
    return {"data": dict(entries) if entries else {}, "type": "dir", "ver": VER}


def vtree(chunks: list[str], tail: list[str], index: list[str] | None = None) -> TreeObj:
    """A long value stored as chunks of :data:`VTREE_CHUNK` blobrefs, after
    the groups of ``index`` if any, and a tail (see the module docstring);
    the lists are taken, not copied."""
    data = ({"chunks": chunks, "index": index, "tail": tail} if index
            else {"chunks": chunks, "tail": tail})
    return {"data": data, "type": "vtree", "ver": VER}


def dirref(ref: str) -> TreeObj:
    """A directory stored as blob ``ref`` (a ``dir`` or an ``hdir``)."""
    return {"data": [blobref.check(ref)], "type": "dirref", "ver": VER}


def symlink(target: str, namespace: str | None = None) -> TreeObj:
    """A symbolic link to ``target``, optionally in another ``namespace``."""
    if not isinstance(target, str) or not target:
        raise ErrnoError(errno.EINVAL, "symlink target must be a non-empty string")
    data: dict[str, str] = {"target": target}
    if namespace is not None:
        if not isinstance(namespace, str) or not namespace:
            raise ErrnoError(errno.EINVAL, "symlink namespace must be a non-empty string")
        data = {"namespace": namespace, "target": target}
    return {"data": data, "type": "symlink", "ver": VER}


def hdir(depth: int, count: int, shards: Mapping[str, str]) -> TreeObj:
    """An interior node of a hashed directory (see the module docstring)."""
    return {
        "data": {"count": count, "depth": depth, "shards": dict(shards)},
        "type": "hdir",
        "ver": VER,
    }


# --------------------------------------------------------------------------
# Inspection


def typeof(obj: object) -> str:
    """The type of tree object ``obj`` (``EINVAL`` when it is not one)."""
    if isinstance(obj, dict):
        t = obj.get("type")
        if isinstance(t, str) and t in TYPES:
            return t
    raise ErrnoError(errno.EINVAL, "not a tree object")


def symlink_target(obj: TreeObj) -> tuple[str | None, str]:
    """``(namespace or None, target)`` of a symlink tree object."""
    data = obj["data"]
    return data.get("namespace"), data["target"]


def blobrefs(obj: TreeObj) -> Iterator[tuple[str, bool]]:
    """The blobrefs a tree object names, each with whether it is another
    tree object (``dirref``, ``hdir`` shards) or a value's data (``valref``),
    which is never decoded: a user's bytes may look like anything."""
    t, data = obj["type"], obj["data"]
    if t == "dirref":
        yield data[0], True
    elif t == "valref":
        for ref in data:
            yield ref, False
    elif t == "hdir":
        for ref in data["shards"].values():
            yield ref, True
    elif t == "vtree":
        for ref in data.get("index", ()):
            yield ref, True
        for ref in data["chunks"]:
            yield ref, True
        for ref in data["tail"]:
            yield ref, False
    elif t == "dir":
        for entry in data.values():
            yield from blobrefs(entry)


def vtree_parts(entry: TreeObj) -> tuple[list[str], list[str], list[str]]:
    """A ``vtree``'s ``index``, ``chunks`` and ``tail`` (shared, not copied;
    ``index`` empty when the entry has none)."""
    data = entry["data"]
    return data.get("index", []), data["chunks"], data["tail"]


def value_refs(entry: TreeObj, get_obj: Callable[[str], TreeObj | None]) -> list[str]:
    """Every blobref of a ``valref`` or ``vtree`` entry's value, in order.

    ``get_obj`` gives a group's or a chunk's decoded object, or None when
    its blob is not here: :class:`NeedBlobs` then names every missing one
    (the groups' first, then the chunks').  A group or chunk of the wrong
    form is ``ENOTRECOVERABLE`` (a damaged or hand-made tree)."""
    if entry["type"] != "vtree":
        refs: list[str] = entry["data"]
        return refs
    index, chunks, tail = vtree_parts(entry)
    out: list[str] = []
    for lines in _lines_of([*_groups_chunks(index, get_obj), *chunks], get_obj):
        out += lines
    out += tail
    return out


def _members(refs: Sequence[str], get_obj: Callable[[str], TreeObj | None],
             check: Callable[[str, TreeObj | None], list[str]]) -> list[list[str]]:
    """The members of each group or chunk of ``refs`` (``check``: of a
    group, :func:`_group_chunks`; of a chunk, :func:`_chunk_refs`);
    :class:`NeedBlobs` names every one missing."""
    objs = [get_obj(ref) for ref in refs]
    missing = [ref for ref, obj in zip(refs, objs, strict=True) if obj is None]
    if missing:
        raise NeedBlobs(missing)
    return [check(ref, obj) for ref, obj in zip(refs, objs, strict=True)]


def _groups_chunks(groups: Sequence[str], get_obj: Callable[[str], TreeObj | None]
                   ) -> list[str]:
    """The chunks of ``groups`` (an index's blobrefs), in order."""
    return [c for chunks in _members(groups, get_obj, _group_chunks) for c in chunks]


def _lines_of(chunks: Sequence[str], get_obj: Callable[[str], TreeObj | None]
              ) -> list[list[str]]:
    """The blobrefs of each of ``chunks``."""
    return _members(chunks, get_obj, _chunk_refs)


def as_valref(entry: TreeObj, get_obj: Callable[[str], TreeObj | None]) -> TreeObj:
    """``entry`` as a lookup shows it: a ``vtree`` as the ``valref`` of all
    its blobs (:func:`value_refs`), anything else as it is."""
    if entry["type"] != "vtree":
        return entry
    return {"data": value_refs(entry, get_obj), "type": "valref", "ver": VER}


def refs_mark(groups: Sequence[str], chunks: Sequence[str], rest: Sequence[str]) -> bytes:
    """The *mark* of a value's first k blobs: 16 bytes of BLAKE2b over the
    blobrefs of the groups holding its first ``k // VTREE_GROUP *
    VTREE_GROUP`` blobs (``groups``), ``|``, those of the chunks holding
    the next whole :data:`VTREE_CHUNK` s (``chunks``), ``|``, and the
    blobrefs of the ``k % VTREE_CHUNK`` blobs after those (``rest``), each
    list joined by newlines; groups and chunks as a ``vtree`` stores them,
    also for a value stored otherwise (a flat ``valref``, a ``vtree`` of
    one level, both written by older versions).

    Blobs, chunks and groups are named by content, so two values with the
    same mark at k have the same first k blobs, and the mark of a ``vtree``
    is had from its index and chunk list, one group and one chunk, without
    reading the others: an APPEND watcher checks that what it answered is
    still there at O(k / VTREE_GROUP + VTREE_CHUNK) cost
    (:func:`value_after`)."""
    h = hashlib.blake2b(digest_size=16)
    h.update("\n".join(groups).encode())
    h.update(b"|")
    h.update("\n".join(chunks).encode())
    h.update(b"|")
    h.update("\n".join(rest).encode())
    return h.digest()


class _Levels:
    """A ``valref``/``vtree`` value seen as the two-level ``vtree`` it is
    (or would be) stored as: ``groups`` (the index), the ``chunks`` after
    them and the ``tail``.  What a flat ``valref`` or a ``vtree`` of one
    level (written by older versions) lacks is named with ``obj_ref`` (the
    blobref a tree object would be stored at), not stored; the rest is read
    with ``get_obj`` when asked for."""

    def __init__(self, entry: TreeObj, get_obj: Callable[[str], TreeObj | None],
                 obj_ref: Callable[[TreeObj], str]) -> None:
        self.get_obj = get_obj
        self.known: dict[str, list[str]] = {}
        """The members of groups and chunks named here, not stored."""
        k = VTREE_CHUNK
        if entry["type"] == "valref":
            refs: list[str] = entry["data"]
            whole = len(refs) - len(refs) % k
            chunks = []
            for i in range(0, whole, k):
                ref = obj_ref(_refs_obj(refs[i:i + k]))
                self.known[ref] = refs[i:i + k]
                chunks.append(ref)
            groups: list[str] = []
            tail = refs[whole:]
        else:
            groups, chunks, tail = vtree_parts(entry)
        if len(chunks) >= k:  # (a one-level vtree, or a flat valref: grouped here)
            whole = len(chunks) - len(chunks) % k
            groups = list(groups)
            for i in range(0, whole, k):
                ref = obj_ref(vtree(chunks[i:i + k], []))
                self.known[ref] = chunks[i:i + k]
                groups.append(ref)
            chunks = chunks[whole:]
        self.groups, self.chunks, self.tail = groups, chunks, tail
        self.length = len(groups) * VTREE_GROUP + len(chunks) * k + len(tail)

    def groups_chunks(self, groups: Sequence[str]) -> list[list[str]]:
        """The chunks of each of ``groups``."""
        return self._read(groups, _group_chunks)

    def lines(self, chunks: Sequence[str]) -> list[list[str]]:
        """The blobrefs of each of ``chunks``."""
        return self._read(chunks, _chunk_refs)

    def _read(self, refs: Sequence[str],
              check: Callable[[str, TreeObj | None], list[str]]) -> list[list[str]]:
        """The members of ``refs``: named here, else read (:func:`_members`)."""
        known = self.known
        stored = [ref for ref in refs if ref not in known]
        if stored:
            known = {**known, **dict(zip(stored, _members(stored, self.get_obj, check),
                                         strict=True))}
        return [known[ref] for ref in refs]


def value_after(entry: TreeObj, after: int, mark: bytes,
                get_obj: Callable[[str], TreeObj | None],
                obj_ref: Callable[[TreeObj], str]) -> dict[str, Any]:
    """A ``valref``/``vtree`` entry as an APPEND watcher that has answered
    its first ``after`` blobs, whose mark was ``mark``, asks for it.

    Returns ``{"val", "length", "mark", "grown"}``: ``length`` the value's
    blobs, ``mark`` the mark of all of them (:func:`refs_mark`), ``grown``
    whether the first ``after`` blobs are the ones marked ``mark``; if so,
    ``val`` is a ``valref`` of the blobs after them (possibly none), else
    of all of them.  A ``vtree``'s groups and chunks before the ones
    holding blob ``after`` are not read, so the cost is O(index + chunks +
    new blobs), not O(blobs).  Any other entry comes back as ``{"val":
    entry}``.  ``obj_ref`` names the blob a tree object would be stored
    as (:class:`_Levels`); :class:`NeedBlobs` names the blobs missing."""
    if entry["type"] not in ("valref", "vtree"):
        return {"val": entry}
    v = _Levels(entry, get_obj, obj_ref)
    n = v.length
    full = refs_mark(v.groups, v.chunks, v.tail)
    if after > n:
        return {"val": as_valref(entry, get_obj), "length": n, "mark": full, "grown": False}
    g, rest = divmod(after, VTREE_GROUP)
    c, r = divmod(rest, VTREE_CHUNK)
    # The chunks from the one holding blob `after` on: the first ones of its
    # group (or of the entry's chunks) are in the mark, the rest are new.
    if g < len(v.groups):
        members = v.groups_chunks(v.groups[g:])
        before = members[0][:c]
        later = members[0][c:]
        for more in members[1:]:
            later += more
        later += v.chunks
    else:
        before, later = v.chunks[:c], v.chunks[c:]
    lists = v.lines(later)
    lists.append(v.tail)
    if refs_mark(v.groups[:g], before, lists[0][:r]) != mark:
        return {"val": as_valref(entry, get_obj), "length": n, "mark": full, "grown": False}
    new = lists[0][r:]
    for more in lists[1:]:
        new += more
    return {"val": _refs_obj(new), "length": n, "mark": full, "grown": True}


def _chunk_refs(ref: str, chunk: TreeObj | None) -> list[str]:
    """The blobrefs of a ``vtree`` chunk; ``ENOTRECOVERABLE`` if it is not one."""
    if chunk is None or chunk["type"] != "valref" or len(chunk["data"]) != VTREE_CHUNK:
        raise ErrnoError(errno.ENOTRECOVERABLE, f"vtree chunk {ref} is not a valref "
                                                f"of {VTREE_CHUNK} blobrefs")
    refs: list[str] = chunk["data"]
    return refs


def _group_chunks(ref: str, group: TreeObj | None) -> list[str]:
    """The chunks of a ``vtree`` group; ``ENOTRECOVERABLE`` if it is not one."""
    if group is None or group["type"] != "vtree" or "index" in group["data"] \
            or len(group["data"]["chunks"]) != VTREE_CHUNK or group["data"]["tail"]:
        raise ErrnoError(errno.ENOTRECOVERABLE, f"vtree group {ref} is not a vtree of "
                                                f"{VTREE_CHUNK} chunks")
    chunks: list[str] = group["data"]["chunks"]
    return chunks


chunk_refs = _chunk_refs
group_chunks = _group_chunks
"""(Public names of the two: ``kvs fsck`` reads a damaged ``vtree`` a group
and a chunk at a time, keeping what it can.)"""


def _refs_obj(refs: list[str]) -> TreeObj:
    """A ``valref`` of ``refs``, which may be empty (:func:`value_after`'s
    answer: the blobs after those a watcher has)."""
    return {"data": refs, "type": "valref", "ver": VER}


def vtree_of(refs: list[str], put_obj: Callable[[TreeObj], str],
             chunks: list[str] | None = None, index: list[str] | None = None) -> TreeObj:
    """The stored form of a value whose blobs are ``refs`` after those of
    ``index`` and ``chunks`` (an existing ``vtree``'s): each whole
    :data:`VTREE_CHUNK` of ``refs`` stored as one more chunk, each whole
    :data:`VTREE_CHUNK` of chunks as one more group (``put_obj``), the rest
    the chunks and the tail."""
    k = VTREE_CHUNK
    whole = len(refs) - len(refs) % k
    new = [put_obj(_refs_obj(refs[i:i + k])) for i in range(0, whole, k)]
    chunks = [*chunks, *new] if chunks else new
    index = list(index) if index else []
    if len(chunks) >= k:
        grouped = len(chunks) - len(chunks) % k
        index += [put_obj(vtree(chunks[i:i + k], [])) for i in range(0, grouped, k)]
        chunks = chunks[grouped:]
    return vtree(chunks, refs[whole:], index)


def _inval(msg: str) -> ErrnoError:
    return ErrnoError(errno.EINVAL, f"invalid tree object: {msg}")


def validate(obj: object, *, dirent: bool = False) -> TreeObj:
    """Return ``obj`` if it is a well-formed tree object, else raise ``EINVAL``.

    Directory entries are checked recursively, at most
    :data:`kvs.keys.MAX_DEPTH` levels deep.  Blobrefs are checked for
    form only; whether the blobs exist is the caller's business.  An
    ``hdir`` is a blob, never a directory entry: with ``dirent=True`` (for
    commit dirents) it is refused at top level too.  ``obj`` is not modified.
    """
    return _validate(obj, dirent, False)


def _validate(obj: object, dirent: bool, fix: bool, level: int = 0) -> TreeObj:
    """:func:`validate`; with ``fix`` (for :func:`decode`, which owns the
    object) fields also end up in canonical order -- ``data``, ``type``,
    ``ver``, as every constructor here writes them: a top-level object in
    another order comes back as a reordered copy, the entries of a ``dir``
    are replaced in place.  So what :func:`decode` returns, even from a blob
    stored by hand, keeps :func:`encode_built`'s promise."""
    if not isinstance(obj, dict):
        raise _inval("not a map")
    if [*obj] != _FIELD_ORDER:
        if len(obj) != 3 or "ver" not in obj or "type" not in obj or "data" not in obj:
            raise _inval("expected exactly the fields ver, type, data")
        if fix:
            obj = {"data": obj["data"], "type": obj["type"], "ver": obj["ver"]}
    ver = obj["ver"]
    if type(ver) is not int or ver != VER:
        raise _inval(f"unsupported version {ver!r}")
    t = obj["type"]
    data = obj["data"]
    if t == "val":
        if not isinstance(data, bytes):
            raise _inval("val data must be bytes")
    elif t == "valref" or t == "dirref":
        if not isinstance(data, list) or not data:
            raise _inval(f"{t} data must be a non-empty list of blobrefs")
        if t == "dirref" and len(data) != 1:
            raise _inval("dirref must hold exactly one blobref")
        bad = _bad_ref(data)
        if bad is not None:
            raise _inval(f"bad blobref {reprlib.repr(bad[0])}")
    elif t == "dir":
        if not isinstance(data, dict):
            raise _inval("dir data must be a map")
        if level >= MAX_DEPTH and data:
            raise _inval(f"directories nested more than {MAX_DEPTH} deep")
        for name, entry in data.items():
            if not isinstance(name, str) or not name or "." in name:
                raise _inval(f"bad directory entry name {reprlib.repr(name)}")
            checked = _validate(entry, True, fix, level + 1)
            if checked is not entry:
                data[name] = checked  # a value swap: safe while iterating
    elif t == "symlink":
        if not isinstance(data, dict) or "target" not in data:
            raise _inval("symlink data must be a map with a target")
        if not (data.keys() <= {"target", "namespace"}):
            raise _inval("symlink data has unknown fields")
        if not isinstance(data["target"], str) or not data["target"]:
            raise _inval("symlink target must be a non-empty string")
        ns = data.get("namespace", "x")
        if not isinstance(ns, str) or not ns:
            raise _inval("symlink namespace must be a non-empty string")
    elif t == "hdir":
        if dirent:
            raise _inval("hdir cannot be a directory entry")
        _validate_hdir(data)
    elif t == "vtree":
        # kvbroker's own stored form of a long value: read from blobs only
        # (decode), never taken from a client, who sees it as a valref.
        if not fix:
            raise _inval("vtree is a stored form only: write a valref")
        _validate_vtree(data)
    else:
        raise _inval(f"unknown type {t!r}")
    return obj


def nesting(obj: TreeObj) -> int:
    """How many levels of inline directories ``obj`` (valid) holds below
    itself: 0 for anything but a ``dir`` with ``dir`` entries."""
    if obj["type"] != "dir":
        return 0
    deepest, level = 0, [obj]
    while True:
        level = [e for d in level for e in d["data"].values() if e["type"] == "dir"]
        if not level:
            return deepest
        deepest += 1


_KNOWN_REFS: set[str] = set()
"""Blobrefs :func:`_bad_ref` found well-formed lately (at most
:data:`_KNOWN_REFS_MAX`, then forgotten at once).  A follower decodes every
new version of a directory that holds an eventlog: its ``valref`` lists
every line's blobref, all but the newest already checked in the version
before.  Checking each again (a regular expression per blobref) was 40% of
a follower's time as it kept up with one client appending -- an eventlog
watcher on rank 3 fell 1,000 versions behind 2,000 appends and ended
``EOVERFLOW``; a set lookup is ~15 times cheaper."""
_KNOWN_REFS_MAX = 1 << 16


def _bad_ref(refs: list[Any]) -> tuple[object] | None:
    """``(ref,)`` for the first item of ``refs`` that is not a well-formed
    blobref, else None."""
    known = _KNOWN_REFS
    try:
        if all(map(known.__contains__, refs)):
            return None
    except TypeError:  # (an unhashable item: not a blobref)
        pass
    new: list[str] = []
    for ref in refs:
        if isinstance(ref, str) and ref in known:
            continue
        if not blobref.is_valid(ref):
            return (ref,)
        new.append(ref)
    if len(known) + len(new) > _KNOWN_REFS_MAX:
        known.clear()
    known.update(new[-_KNOWN_REFS_MAX:])
    return None


def _validate_vtree(data: object) -> None:
    if not isinstance(data, dict) or data.keys() not in ({"chunks", "tail"},
                                                          {"chunks", "index", "tail"}):
        raise _inval("vtree data must be a map of chunks, tail and maybe index")
    index, chunks, tail = data.get("index"), data["chunks"], data["tail"]
    if index is not None and (not isinstance(index, list) or not index
                              or not isinstance(chunks, list) or len(chunks) >= VTREE_CHUNK):
        raise _inval(f"a vtree's index must be a non-empty list, its chunks then fewer "
                     f"than {VTREE_CHUNK}")
    if not isinstance(chunks, list) or not (chunks or index) or not isinstance(tail, list) \
            or len(tail) >= VTREE_CHUNK:
        raise _inval(f"vtree needs a non-empty list of chunks (or an index) and a tail of "
                     f"fewer than {VTREE_CHUNK} blobrefs")
    bad = _bad_ref(chunks) or _bad_ref(tail) or (_bad_ref(index) if index else None)
    if bad is not None:
        raise _inval(f"bad blobref {reprlib.repr(bad[0])}")


def _validate_hdir(data: object) -> None:
    if not isinstance(data, dict) or data.keys() != {"count", "depth", "shards"}:
        raise _inval("hdir data must be a map of count, depth, shards")
    depth, count, shards = data["depth"], data["count"], data["shards"]
    if type(depth) is not int or not 0 <= depth < HDIR_MAX_DEPTH:
        raise _inval(f"bad hdir depth {depth!r}")
    if type(count) is not int or count < 0:
        raise _inval(f"bad hdir count {count!r}")
    if not isinstance(shards, dict):
        raise _inval("hdir shards must be a map")
    for key, ref in shards.items():
        if not isinstance(key, str) or len(key) != 1 or key not in _HEX:
            raise _inval(f"bad hdir shard key {reprlib.repr(key)}")
        if not blobref.is_valid(ref):
            raise _inval(f"bad blobref {reprlib.repr(ref)}")


# --------------------------------------------------------------------------
# Canonical msgpack


def _canon(obj: TreeObj) -> TreeObj:
    """A copy of ``obj`` whose maps have their keys in sorted order."""
    t = obj["type"]
    data = obj["data"]
    if t == "dir":
        data = {k: _canon(data[k]) for k in sorted(data)}
    elif t == "symlink":
        if len(data) > 1:
            data = {k: data[k] for k in sorted(data)}
    elif t == "hdir":
        shards = data["shards"]
        data = {
            "count": data["count"],
            "depth": data["depth"],
            "shards": {k: shards[k] for k in sorted(shards)},
        }
    elif t == "vtree":
        data = vtree(data["chunks"], data["tail"], data.get("index"))["data"]
    return {"data": data, "type": t, "ver": obj["ver"]}


def copy(obj: TreeObj) -> TreeObj:
    """A deep copy of a tree object (bytes are immutable and shared)."""
    t = obj["type"]
    data = obj["data"]
    if t == "dir":
        data = {k: copy(v) for k, v in data.items()}
    elif t == "hdir":
        data = {"count": data["count"], "depth": data["depth"], "shards": dict(data["shards"])}
    elif t == "vtree":
        data = vtree(list(data["chunks"]), list(data["tail"]), list(data.get("index", ())))["data"]
    elif t != "val":
        data = list(data) if isinstance(data, list) else dict(data)
    return {"data": data, "type": t, "ver": obj["ver"]}


def encode(obj: TreeObj) -> bytes:
    """Canonical msgpack of a (valid) tree object: equal objects, equal bytes."""
    # (the shared packer: ``msgpack.packb`` makes a Packer per call, ~1.5 us
    # of an hdir node's ~6)
    return _pack(_canon(obj))


def encode_built(obj: TreeObj) -> bytes:
    """:func:`encode` for the hot path, trusting that the ``val``, ``valref``
    and ``dirref`` entries of a ``dir`` already have their fields in canonical
    order.  True of every object the constructors, :func:`copy`,
    :func:`decode` / :func:`validate` and the engines make (the fields are
    always written ``data``, ``type``, ``ver``); not of a dict written by
    hand, which needs :func:`encode`.  Saves rebuilding every entry of a
    directory (see :func:`pack_entry`).

    An ``hdir`` node whose fields and shard digits are already in canonical
    order (what :func:`hdir` and the engines make while no shard is added:
    checked here, not trusted) is packed as it is, without :func:`_canon`'s
    copy: ~3 us instead of ~6, and rank 0 writes one or two per commit into
    a big directory."""
    t = obj["type"]
    if t == "dir":
        return encode_packed(pack_dir(obj["data"]), obj["ver"])
    if t == "hdir":
        data = obj["data"]
        if [*obj] == _FIELD_ORDER and [*data] == _HDIR_FIELDS:
            digits = [*data["shards"]]
            if digits == sorted(digits):
                return _pack(obj)
    return encode(obj)


# One packer for every encoding here: ``pack`` runs in C with the GIL held
# and calls back into no Python code (no ``default``), so sharing it is
# safe; a failed pack (a TypeError) empties its buffer before it raises.
_packer = msgpack.Packer(use_bin_type=True)
_pack: Callable[[Any], bytes] = _packer.pack
_HDIR_FIELDS = ["count", "depth", "shards"]
_DIR_HEAD = b"\x83" + _pack("data")  # a 3-field map, its "data" key first
_DIR_TYPE = _pack("type") + _pack("dir") + _pack("ver")


def pack_entry(name: str, entry: TreeObj) -> bytes:
    """The canonical msgpack of one ``dir`` entry, name and object: the bytes
    it contributes to its directory's blob (see :func:`encode_packed`)."""
    return _pack(name) + _pack(entry if entry["type"] in _FLAT_TYPES else _canon(entry))


class Packed(NamedTuple):
    """A ``dir``'s entries in canonical msgpack: ``names`` sorted, ``entries[i]``
    the :func:`pack_entry` bytes of ``names[i]``."""

    names: list[str]
    entries: list[bytes]


def pack_dir(ents: Mapping[str, TreeObj]) -> Packed:
    """Every entry of a ``dir`` packed, in canonical (sorted) order."""
    names = sorted(ents)
    return Packed(names, [pack_entry(k, ents[k]) for k in names])


def encode_packed(packed: Packed, ver: int = VER) -> bytes:
    """The canonical blob of a ``dir`` whose entries are already packed: the
    same bytes as :func:`encode`.

    A msgpack map is its header followed by its keys and values in order, so
    a directory's blob is a fixed head, its entries' bytes in name order,
    and a fixed tail -- an entry's bytes can be reused for as long as the
    entry is unchanged (:meth:`BlobWriter.put_obj` with ``base``)."""
    return b"".join([_DIR_HEAD, _packer.pack_map_header(len(packed.names)),
                     *packed.entries, _DIR_TYPE, _pack(ver)])


def decode(data: bytes | bytearray | memoryview) -> TreeObj:
    """Decode and validate a tree-object blob.

    Raises ``EPROTO`` when ``data`` is not msgpack, ``EINVAL`` when it is
    msgpack but not a valid tree object.
    """
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        raise ErrnoError(errno.EPROTO, f"tree object is not msgpack: {e}") from None
    return _validate(obj, False, True)


# --------------------------------------------------------------------------
# JSON (CLI ``-t``, ``--at``, ``getroot``)


def to_jsonable(obj: TreeObj) -> dict[str, Any]:
    """A JSON-ready copy of ``obj``: ``val`` data becomes base64 text, as in Flux."""
    t = obj["type"]
    data = obj["data"]
    if t == "val":
        data = base64.b64encode(data).decode("ascii")
    elif t == "dir":
        data = {k: to_jsonable(v) for k, v in data.items()}
    elif t == "hdir":
        data = {"count": data["count"], "depth": data["depth"], "shards": dict(data["shards"])}
    elif t == "vtree":
        data = vtree(list(data["chunks"]), list(data["tail"]), list(data.get("index", ())))["data"]
    elif t == "symlink":
        data = dict(data)
    else:
        data = list(data)
    return {"data": data, "type": t, "ver": obj["ver"]}


def to_json(obj: TreeObj) -> str:
    """Compact JSON text of ``obj`` with sorted keys."""
    return json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"))


def _from_jsonable(obj: Any) -> Any:
    if not isinstance(obj, dict) or "type" not in obj or "data" not in obj:
        return obj  # let validate() produce the error
    t = obj["type"]
    data = obj["data"]
    if t == "val":
        if not isinstance(data, str):
            raise _inval("val data must be base64 text")
        try:
            data = base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise _inval("val data is not valid base64") from None
    elif t == "dir" and isinstance(data, dict):
        data = {k: _from_jsonable(v) for k, v in data.items()}
    out = dict(obj)
    out["data"] = data
    return out


def from_json(text_or_obj: str | bytes | Mapping[str, Any]) -> TreeObj:
    """Parse JSON text (or an already-parsed object) into a validated tree object."""
    obj: Any = text_or_obj
    if isinstance(text_or_obj, str | bytes):
        try:
            obj = jsontoml.loads_json(text_or_obj)
        except (ValueError, UnicodeDecodeError) as e:
            raise _inval(f"not JSON: {e}") from None
    return validate(_from_jsonable(obj))


# --------------------------------------------------------------------------
# Blob access for the I/O-free engines


class NeedBlobs(KvbrokerError):
    """An engine needs blobs it does not have; fetch ``refs`` and call it again."""

    def __init__(self, refs: Iterable[str]) -> None:
        self.refs: set[str] = set(refs)
        super().__init__(f"missing {len(self.refs)} blob(s)")


class BlobStore(Protocol):
    """What the engines read: raw blob bytes by blobref, ``None`` if absent."""

    def get(self, ref: str, /) -> bytes | None: ...


PROBATION = 64
"""Transactions a replaced tree version stays memoized unless read again
(:meth:`BlobCache.remember`).

Long enough for a version that is still another directory's current one
(identical content, one blob) to be used again before it goes: a big
directory is 16 shards, so one writer comes back to the same leaf about
every 16th of its own commits -- with 8 writers in batches of ~4 (W2p's
clients write identical trees), ~32 transactions later.  At 16, rank 0
decoded that leaf again and, with no packed entries memoized for it,
packed every entry of its next version (~0.4 per batch; the W2p-like
engine with the clients drifting apart, in process: ~50 -> ~40 us per
commit).  It costs a W2 rank 0 ~0.4 MB more memo (~370 -> ~660 objects
at 5,000 keys)."""


class BlobCache:
    """A decoded-object memo in front of a :class:`BlobStore`.

    Directory blobs are decoded (and validated) once and then shared, so a
    commit into a big directory does not re-decode its unchanged shards.
    Objects returned by :meth:`get_obj` are shared: treat them as immutable.
    The memo is an LRU bounded by count (``max_objects``) and by the size
    of the objects' blobs (``max_bytes``), that also forgets the versions a
    transaction replaced (:meth:`remember`); blobs are content-addressed, so
    it never needs invalidating.  The kvs module should keep one per content
    cache.  The byte bound matters where objects are big: a follower serving
    an APPEND watch on an eventlog decodes every version of its directory,
    each carrying every line's blobref, and held 600 MB of them at 3,000
    appends under the count bound alone.
    """

    def __init__(self, store: BlobStore, max_objects: int = 8192,
                 max_bytes: int = 64 << 20) -> None:
        self.store = store
        self.max_objects = max_objects
        self.max_bytes = max_bytes
        self.nbytes = 0
        """The blob bytes of the objects held (what ``max_bytes`` bounds)."""
        self._sizes: dict[str, int] = {}
        # An OrderedDict, not a dict: evicting the oldest entry of a plain
        # dict (``del d[next(iter(d))]``) scans the deleted slots at its
        # front, ~8 us per eviction at 16K entries -- once the memo was full,
        # that was ~50 us on every commit (W2's later blocks).
        self._objs: OrderedDict[str, TreeObj] = OrderedDict()
        # Packed entries (:func:`pack_entry`) of directories this process
        # wrote, so the next commit into one packs only what it changed.
        # Kept for refs still in ``_objs`` and evicted with them.
        self._packed: dict[str, Packed] = {}
        # Versions replaced by the last PROBATION transactions, by ref: the
        # transaction's number (see remember); reading one takes it off.
        self._probation: dict[str, int] = {}
        self._replaced: deque[list[str]] = deque()
        self._txns = 0
        self.forgotten = 0  # replaced versions dropped by remember()
        self._marks = AgeMarks()  # (expiry by age: see age())

    def __len__(self) -> int:
        """Decoded objects held."""
        return len(self._objs) - self._marks.live(self._objs)

    def clear(self) -> None:
        """Forget every decoded object (``kvs dropcache``), in place."""
        self._objs.clear()
        self._marks.clear()
        self._sizes.clear()
        self._packed.clear()
        self._probation.clear()
        self._replaced.clear()
        self.nbytes = 0

    def drop(self, keep: set[str]) -> None:
        """Forget the decoded objects not in ``keep`` (a garbage collection
        decided: a read at a collected root must not be answered from here
        while the store has deleted its blobs), in place."""
        objs = self._objs
        probation = self._probation
        for ref in [r for r in objs if r not in keep]:
            del objs[ref]
            self._forget(ref)
            probation.pop(ref, None)

    def get(self, ref: str) -> bytes | None:
        """Raw blob bytes, or ``None`` when the store lacks them."""
        return self.store.get(ref)

    def get_obj(self, ref: str) -> TreeObj | None:
        """The decoded tree object in blob ``ref``, or ``None`` if missing.

        Raises ``EPROTO``/``EINVAL`` when the blob is not a tree object.
        """
        objs = self._objs
        obj = objs.get(ref)
        if obj is not None:
            objs.move_to_end(ref)  # most recently used
            if self._probation:
                self._probation.pop(ref, None)
            return obj
        raw = self.store.get(ref)
        if raw is None:
            return None
        obj = decode(raw)
        objs[ref] = obj
        self._sizes[ref] = len(raw)
        self.nbytes += len(raw)
        if len(objs) > self.max_objects or self.nbytes > self.max_bytes:
            self._trim()
        return obj

    def _trim(self) -> None:
        """Evict the least recently used objects until both bounds hold
        (the newest one stays, however big)."""
        objs = self._objs
        while len(objs) > 1 and (len(objs) > self.max_objects or self.nbytes > self.max_bytes):
            self._forget(objs.popitem(last=False)[0])

    def age(self) -> int:
        """A period of ``kvs.cache-expire`` passed (:mod:`broker.agemarks`):
        put a mark, and forget the objects not used since the mark now due
        (the blobs stay in the store).  Returns how many went."""
        self._marks.put(self._objs, None)
        return self._marks.expire(self._objs, self._expired)

    def _expired(self, ref: str, _obj: TreeObj | None) -> None:
        self._forget(ref)  # (for the mark too: it has no size, no packed entries)
        self._probation.pop(ref, None)

    @property
    def expired(self) -> int:
        """Objects forgotten by age since the start."""
        return self._marks.expired

    def _forget(self, ref: str) -> None:
        """The bookkeeping of an object that left ``_objs``."""
        self._packed.pop(ref, None)
        self.nbytes -= self._sizes.pop(ref, 0)

    def need_obj(self, ref: str) -> TreeObj:
        """Like :meth:`get_obj` but raises :class:`NeedBlobs` when missing."""
        obj = self.get_obj(ref)
        if obj is None:
            raise NeedBlobs((ref,))
        return obj

    def remember(self, objs: Mapping[str, TreeObj],
                 packed: Mapping[str, Packed] | None = None,
                 replaced: Iterable[str] = (),
                 blobs: Mapping[str, bytes] | None = None) -> None:
        """Memoize objects whose blobs were just created (they are immutable
        now), and the packed entries of the directories among them; ``blobs``
        has their encoded bytes, which count towards ``max_bytes``.

        ``replaced`` names the versions they replace.  Unless read again
        meanwhile, those are forgotten :data:`PROBATION` transactions later,
        so the memo holds mostly current versions instead of filling with
        old ones that the LRU frees thousands of commits later: a W2 rank 0
        peaked at 83 instead of 107 MB, and freeing a version while it is
        recent is cheaper (its entries are shared with the newer version, so
        freeing walks them all).  Not at once: another directory may hold
        identical content, hence the same blob, as its current version (W2p's
        clients write identical trees) and read it a few transactions later;
        reading it takes it off probation.  Forgetting is always safe: the
        blob stays in the store and is decoded again if ever needed."""
        mine = self._objs
        probation = self._probation
        sizes = self._sizes
        self._txns += 1
        now = [ref for ref in replaced if ref not in objs]
        for ref in now:
            probation[ref] = self._txns
        self._replaced.append(now)
        if len(self._replaced) > PROBATION:
            due = self._txns - PROBATION
            for ref in self._replaced.popleft():
                if probation.get(ref) == due:
                    del probation[ref]
                    self.forgotten += 1
                    if mine.pop(ref, None) is not None:
                        self._forget(ref)
        for ref, obj in objs.items():
            if ref not in sizes and blobs is not None and ref in blobs:
                sizes[ref] = n = len(blobs[ref])
                self.nbytes += n
            mine[ref] = obj
            mine.move_to_end(ref)
            if probation:
                probation.pop(ref, None)
        if packed:
            self._packed.update(packed)
        if len(mine) > self.max_objects or self.nbytes > self.max_bytes:
            self._trim()

    def packed(self, ref: str) -> Packed | None:
        """The packed entries of directory ``ref`` if this cache holds them
        (shared: copy before changing)."""
        p = self._packed.get(ref)
        if p is not None and self._probation:
            self._probation.pop(ref, None)
        return p


def as_cache(store: BlobStore | BlobCache) -> BlobCache:
    """``store`` itself if it is a :class:`BlobCache`, else a fresh one around it."""
    return store if isinstance(store, BlobCache) else BlobCache(store)


class BlobWriter:
    """Collects the blobs an engine creates: ``blobs`` for the caller to store,
    ``objs`` (decoded dir/hdir objects) and ``packed`` (the packed entries of
    the dirs) to memoize in the :class:`BlobCache`."""

    def __init__(self, hash_name: str = blobref.DEFAULT_HASH,
                 cache: BlobCache | None = None) -> None:
        self.hash_name = hash_name
        self.cache = cache
        self.blobs: dict[str, bytes] = {}
        self.objs: dict[str, TreeObj] = {}
        self.packed: dict[str, Packed] = {}
        self.replaced: list[str] = []  # blobrefs of the versions these objects replace

    def put_obj(self, obj: TreeObj, base: str | None = None,
                changed: Iterable[str] | None = None) -> str:
        """Encode ``obj`` (built by this module or the engines: see
        :func:`encode_built`) as a blob and return its blobref; ``obj`` is
        now frozen.

        For a ``dir`` derived from directory blob ``base`` by adding,
        replacing or removing the names in ``changed`` (and no others), only
        those entries are packed again; the rest reuse ``base``'s bytes
        when the cache still holds them.  A commit into a 62-entry leaf:
        ~20 -> ~6 us.  Should ``changed`` miss a name that was added or
        removed, the entry count disagrees and everything is packed afresh
        (a replaced entry that is not named would keep its old bytes: the
        engines name every name they touch)."""
        if obj["type"] != "dir":
            data = encode_built(obj)
        else:
            ents = obj["data"]
            packed = self._derive(base, changed, ents) or pack_dir(ents)
            data = encode_packed(packed, obj["ver"])
        ref = blobref.hash_blob(data, self.hash_name)
        self.blobs[ref] = data
        self.objs[ref] = obj
        if obj["type"] == "dir":
            self.packed[ref] = packed
        return ref

    def _derive(self, base: str | None, changed: Iterable[str] | None,
                ents: Mapping[str, TreeObj]) -> Packed | None:
        if base is None or changed is None:
            return None
        old = self.packed.get(base)
        if old is None and self.cache is not None:
            old = self.cache.packed(base)
        if old is None:
            return None
        names = old.names.copy()
        entries = old.entries.copy()
        for name in changed:
            i = bisect_left(names, name)
            present = i < len(names) and names[i] == name
            entry = ents.get(name)
            if entry is None:
                if present:
                    del names[i], entries[i]
            elif present:
                entries[i] = pack_entry(name, entry)
            else:
                names.insert(i, name)
                entries.insert(i, pack_entry(name, entry))
        # Every added, replaced or removed name must have been named: a
        # removal that was not shows as a count that disagrees.
        return Packed(names, entries) if len(names) == len(ents) else None

    def put_raw(self, data: bytes) -> str:
        """Store raw value bytes as a blob and return its blobref."""
        ref = blobref.hash_blob(data, self.hash_name)
        self.blobs[ref] = data
        return ref
