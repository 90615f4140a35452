"""The commit engine: apply a transaction's ops to a root, without any I/O.

:func:`apply` takes a root blobref and a list of ops ``{"key", "flags",
"dirent"}`` and returns the new rootref plus every blob it created.  Like
:mod:`kvs.lookup` it never fetches anything: a missing blob raises
:class:`NeedBlobs` (gathering the first missing blob of every op), and the
caller retries from scratch once it has them.  Merging transactions is just
concatenating their ops.

Semantics follow Flux's ``kvstxn.c``:

* Keys are normalised; writing or unlinking ``"."`` is ``EINVAL``.
* Putting ``a.b.c`` creates the missing directories ``a`` and ``a.b``.  A
  *value* met in the middle of the path is replaced by a new directory (as
  Flux does); unlinking below a value or a missing directory succeeds and
  changes nothing.
* A *symlink* met in the middle of the path is followed (the write goes
  where the link points, resolved from the root); a link into another
  namespace is ``EINVAL`` (writes never cross namespaces), and a chain of
  more than 10 links is ``ELOOP``.  The final component is never followed:
  a put replaces a symlink, an unlink removes it.
* Unlinking a missing key succeeds.
* ``APPEND``: the dirent must be a ``val`` (else ``EPROTO``).  A missing key
  is created; a ``valref`` gets one more blobref; a ``val`` becomes a
  ``valref`` of its old bytes and the new bytes (old bytes are never copied
  into a new blob with the appended data).  A directory gives ``EISDIR``, a
  symlink ``EOPNOTSUPP``.
* ``EXPECT``: a condition, not a change (kvbroker's compare-and-swap, as
  etcd's ``txn`` compare or Redis ``WATCH``): the key must hold exactly the
  ``val`` dirent's bytes at this point of the transaction (a ``valref``'s
  blobs are read and joined), or with a ``null`` dirent not exist.  Else
  the transaction fails with ``ECANCELED`` and changes nothing.  A
  directory or symlink at the key is never a value; a symlink on the path
  is followed, as for a write.  Merged transactions are applied in order,
  so a condition sees the ones before it, as if each ran alone.
* A dirent may be any valid tree object except ``hdir`` (``EINVAL``
  otherwise); blobrefs in it are checked for form only -- the caller checks
  that they exist.

Afterwards every modified directory is "unrolled": stored as a blob and
replaced by a ``dirref`` (the root's blobref is the new rootref), and every
``val`` longer than :data:`~kvs.treeobj.INLINE_MAX` bytes becomes a
``valref``.  Directories bigger than :data:`kvs.shards.SHARD_THRESHOLD`
become ``hdir`` tries, so a change rewrites O(log n) small blobs.  Only the
directories on the paths of the ops are copied or re-encoded; a directory
reached but left unchanged keeps its blobref.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from broker.content import blobref
from broker.errors import ErrnoError
from kvs import shards
from kvs.keys import (
    MAX_DEPTH,
    check_length,
    check_target_length,
    normalize,
    parse_ns_target,
    shown,
    split,
)
from kvs.lookup import SYMLINK_MAX
from kvs.treeobj import (
    INLINE_MAX,
    VER,
    VTREE_CHUNK,
    BlobCache,
    BlobStore,
    BlobWriter,
    NeedBlobs,
    TreeObj,
    as_cache,
    copy,
    encode,
    nesting,
    symlink_target,
    validate,
    value_refs,
    vtree,
    vtree_of,
    vtree_parts,
)

__all__ = ["APPEND", "EXPECT", "MAX_DIRS", "MAX_OPS", "NO_MERGE", "SYNC", "TxnResult", "apply",
           "check_limits", "empty_root", "NeedBlobs"]

# op flags
APPEND = 32
EXPECT = 64
# commit flags (interpreted by the kvs module, not by this engine)
NO_MERGE = 1
SYNC = 4
MAX_OPS = 100_000
"""Most ops one ``kvs.commit`` may carry (``E2BIG`` past it; checked by the
kvs module, and by a guest's ``kvs restore``, which must fit one commit)."""


MAX_DIRS = 100_000
"""Most directories the keys of one ``kvs.commit`` may lie under (the
distinct parent paths of its keys, at every level: ``E2BIG`` past it).

Every such directory is walked, and rewritten as a blob, on rank 0's event
loop.  :data:`MAX_OPS` alone bounded ops, not that: 4,000 puts of keys 256
components deep, each under its own path, made a million directories in a
6 MB commit and held rank 0 for 7 s (and 2 GB it kept).  100,000 directories
is ~0.7 s of rank 0, about what :data:`MAX_OPS` flat puts cost; ordinary
commits come nowhere near (a directory counts once however many keys lie
under it)."""


def check_dirs(keys: list[str]) -> None:
    """``E2BIG`` if ``keys`` lie under more than :data:`MAX_DIRS` directories.

    Nothing is counted while the keys' components add up to no more than the
    limit (there cannot be more directories than that), so a commit of a few
    keys pays a ``count`` per key.  Beyond, the distinct parent paths are
    counted level by level, each once, stopping at the limit."""
    if sum(key.count(".") for key in keys) <= MAX_DIRS:
        return
    seen: set[str] = set()
    level = {key.rpartition(".")[0] for key in map(normalize, keys)}
    while level:
        new = level - seen
        new.discard("")
        seen |= new
        if len(seen) > MAX_DIRS:
            raise ErrnoError(errno.E2BIG, f"the keys of this commit lie under more than "
                                          f"{MAX_DIRS} directories: commit fewer at once")
        level = {path.rpartition(".")[0] for path in new}


def _check_size(data: object, blob_limit: int | None) -> None:
    if (blob_limit is not None and isinstance(data, (bytes, bytearray, memoryview))
            and len(data) > blob_limit):
        raise blobref.too_big(len(data), blob_limit)


def _check_link_namespace(target: str, ns: str | None) -> None:
    """``EINVAL`` for a symlink into a namespace no name can be (``"a b"``,
    ``"x/y"``, an empty ``namespace``): stored, it could only ever be read
    as ``ENOTSUP``.  (Restoring an archive does not check this, so the links
    such a dump holds, stored before this check, still restore.)"""
    if ns is None:
        ns = parse_ns_target(target)[0]
    if ns is not None:
        # (here, for links only: kvs.namespaces costs every kvs command
        # ~6 ms to import, and kvs.client imports this module)
        from kvs.namespaces import NAME_RULE, check_name, shown_name

        try:
            check_name(ns)
        except ErrnoError:
            raise ErrnoError(errno.EINVAL, f"symlink to an invalid namespace name "
                                           f"{shown_name(ns)}: {NAME_RULE}") from None


def check_limits(key: str, flags: int, dirent: object, blob_limit: int | None = None) -> None:
    """Refuse an op over the key or value limits, where it enters.

    ``ENAMETOOLONG`` for a name over :data:`kvs.keys.MAX_NAME` or a key over
    :data:`kvs.keys.MAX_KEY` that the op *creates*: its key, a symlink's
    target, the names in a ``dir`` dirent (their paths below ``key``
    included).  ``EINVAL`` for a NUL in such a name or target, as in a
    key (an entry stored so could be read or unlinked by no key, only
    with its whole directory), and for a symlink into a namespace whose
    name is not one (:func:`_check_link_namespace`).  ``EFBIG`` (the content module's message)
    for a ``val`` of more than ``blob_limit`` bytes, at any depth of a
    ``dir`` dirent: it
    becomes one blob, which rank 0's content store would refuse after the
    value had crossed the tree.  Unlinks and conditions (``EXPECT``) store
    nothing and pass, so keys stored before the limits stay removable.

    ``dirent`` need not be a well-formed tree object: what is not is left
    alone here (the kvs module validates a dirent where the commit enters,
    and :func:`apply` again on rank 0, ``EINVAL``/``EPROTO``).  Iterative,
    since a ``dir`` dirent may nest deep.
    """
    if flags & EXPECT or type(dirent) is not dict:  # (None: an unlink)
        return
    check_length(key)
    if dirent.get("type") == "val":  # the common case, without the walk below
        _check_size(dirent.get("data"), blob_limit)
        return
    todo: list[tuple[str, object]] = [(key, dirent)]
    while todo:
        path, obj = todo.pop()
        if not isinstance(obj, dict):
            continue
        t, data = obj.get("type"), obj.get("data")
        if t == "val":
            _check_size(data, blob_limit)
        elif t == "symlink":
            if isinstance(data, dict):
                target, ns = data.get("target"), data.get("namespace")
                if isinstance(target, str) and (ns is None or isinstance(ns, str)):
                    if "\0" in target:
                        raise ErrnoError(errno.EINVAL, "symlink target contains a NUL character")
                    check_target_length(target, ns)
                    _check_link_namespace(target, ns)
        elif t == "dir" and isinstance(data, dict):
            for name, entry in data.items():
                if isinstance(name, str):
                    if "\0" in name:  # (a key may not have one: unreadable by key)
                        raise ErrnoError(errno.EINVAL, "directory entry name contains a NUL "
                                                       "character")
                    sub = f"{path}.{name}"
                    check_length(sub)
                    todo.append((sub, entry))


@dataclass(slots=True)
class TxnResult:
    """Outcome of :func:`apply`.

    ``new_blobs`` holds every blob the transaction created (the store may
    already have some); the caller must store them before publishing
    ``rootref``.  ``keys`` lists the normalised keys named by the ops, in
    order and without duplicates, for the setroot event.
    """

    rootref: str
    new_blobs: dict[str, bytes] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)
    through: list[tuple[int, str]] = field(default_factory=list)
    """``(op index, key)`` for each write that a symlink on its path led
    to another key: the key it wrote (a lease attached to that key by its
    own name is detached by it, as by a write naming it)."""


@functools.cache
def empty_root(hash_name: str = blobref.DEFAULT_HASH) -> tuple[str, bytes]:
    """Blobref and blob of an empty directory: the root of a new namespace
    (made once per hash: every namespace created asked for it again, a
    tenth of rank 0's time in ``kvs.namespace-create``)."""
    data = encode({"data": {}, "type": "dir", "ver": VER})
    return blobref.hash_blob(data, hash_name), data


def _fresh_dirref(ref: str) -> TreeObj:
    """:func:`~kvs.treeobj.dirref` for a ref the writer has just computed
    (well-formed by construction), or :func:`apply` has just checked: no
    need to check it again (a regex, twice per batch on rank 0)."""
    return {"data": [ref], "type": "dirref", "ver": VER}


class _WDir:
    """A directory being changed by a transaction (the copy-on-write copy).

    A plain directory keeps a full copy of its entries; a hashed one keeps
    only an overlay of changed names (``None`` = deleted) over its ``hdir``
    base, so nothing is copied in proportion to its size.  Values are
    stored entries, raw dirents, or nested ``_WDir`` s.  ``dirty`` names
    need unrolling; ``changed`` says whether an op modified this directory
    itself (merely walking through it does not).
    """

    __slots__ = ("orig", "hashed", "entries", "dirty", "changed")

    def __init__(
        self,
        entries: dict[str, Any],
        *,
        orig: TreeObj | None = None,
        hashed: TreeObj | None = None,
        dirty: set[str] | None = None,
    ) -> None:
        self.orig = orig
        self.hashed = hashed
        self.entries = entries
        self.dirty = dirty if dirty is not None else set()
        self.changed = orig is None

    @classmethod
    def load(cls, cache: BlobCache, entry: TreeObj, *, is_root: bool = False) -> _WDir:
        ref = entry["data"][0]
        errnum = errno.EINVAL if is_root else errno.ENOTRECOVERABLE
        try:
            obj = cache.get_obj(ref)
        except ErrnoError:
            raise ErrnoError(errnum, f"{ref} is not a tree object") from None
        if obj is None:
            raise NeedBlobs((ref,))
        if obj["type"] == "hdir":
            return cls({}, orig=entry, hashed=obj)
        if obj["type"] != "dir":
            raise ErrnoError(errnum, f"{ref} is not a directory")
        return cls(dict(obj["data"]), orig=entry)

    @classmethod
    def inline(cls, obj: TreeObj) -> _WDir:
        """From a ``dir`` dirent: its entries may hold big vals and inline dirs."""
        return cls(dict(obj["data"]), dirty=set(obj["data"]))

    def get(self, cache: BlobCache, name: str) -> Any:
        if self.hashed is None:
            return self.entries.get(name)
        if name in self.entries:
            return self.entries[name]
        return shards.get(cache, self.hashed, name)

    def adopt(self, name: str, sub: _WDir) -> None:
        """Replace entry ``name`` by its working copy (not a change by itself)."""
        self.entries[name] = sub
        self.dirty.add(name)

    def set(self, name: str, value: Any) -> None:
        self.entries[name] = value
        self.dirty.add(name)
        self.changed = True

    def delete(self, name: str) -> None:
        if self.hashed is None:
            del self.entries[name]
        else:
            self.entries[name] = None
        self.dirty.discard(name)
        self.changed = True


def _check_op(op: object, max_depth: int = MAX_DEPTH) -> tuple[str, list[str], int,
                                                               TreeObj | None]:
    if not isinstance(op, dict):
        raise ErrnoError(errno.EPROTO, "op must be a map")
    key = op.get("key")
    flags = op.get("flags", 0)
    if not isinstance(key, str) or type(flags) is not int or "dirent" not in op:
        raise ErrnoError(errno.EPROTO, "op needs key (str), flags (int) and dirent")
    parts = split(key)
    if not parts:
        raise ErrnoError(errno.EINVAL, "cannot write or unlink the root directory")
    norm = ".".join(parts)
    dirent = op["dirent"]
    if dirent is not None:
        validate(dirent, dirent=True)
    # (inline: every op of every commit passes here; _check_depth is the
    # same test, and the one a write through a link makes)
    if len(parts) > max_depth or (dirent is not None and dirent["type"] == "dir"):
        _check_depth(norm, parts, dirent, max_depth)
    if flags & EXPECT and (flags != EXPECT or not (dirent is None or dirent["type"] == "val")):
        raise ErrnoError(errno.EPROTO, f"{shown(norm)}: an expect op takes a val dirent or null, "
                                       "and no other flag")
    if flags & APPEND and (dirent is None or dirent["type"] != "val"):
        # (a null one too: link() took it for an unlink, and removed the key)
        raise ErrnoError(errno.EPROTO, f"{shown(norm)}: append needs a val dirent")
    if dirent is not None:
        dirent = copy(dirent)  # never alias the caller's objects into stored trees
    return norm, parts, flags, dirent


def _check_depth(key: str, path: list[str], dirent: TreeObj | None,
                 max_depth: int = MAX_DEPTH) -> None:
    """``EINVAL`` for a write of ``key`` at ``path`` (its own components, or
    those a symlink on the way led to) deeper than ``max_depth``, the
    levels of the directories ``dirent`` nests counted.  Through a link the
    key's own depth said nothing: ``L.x`` with ``L`` 250 levels down wrote
    deeper, and 250 levels more were a ``RecursionError`` of the engine."""
    depth = len(path) + (nesting(dirent) if dirent is not None else 0)
    if depth > max_depth:
        through = "" if ".".join(path) == key else " through a symlink"
        raise ErrnoError(errno.EINVAL, f"{key[:64]}...: writes more than {max_depth} "
                         f"levels deep{through} (key components plus nested directories)")


class _Txn:
    def __init__(self, cache: BlobCache, writer: BlobWriter, namespace: str | None,
                 max_depth: int = MAX_DEPTH) -> None:
        self.cache = cache
        self.max_depth = max_depth
        self.writer = writer
        self.namespace = namespace
        # The blobref lists of the valrefs this transaction's appends made,
        # by id (the list itself held, so an id is never reused meanwhile):
        # a later append to the same key adds to its list in place.  Copying
        # it each time made n appends to one key cost O(n * (n + m)) -- a
        # guest's 100,000 appends to one key held rank 0 for 36 s.
        self._grown: dict[int, list[str]] = {}
        self.leased = False
        """The op being applied attaches its key to a lease: a key attached
        by name may not be reached through a symlink (:meth:`_through`)."""
        self.resolved: list[str] = []
        """The path the last op written resolved to (links followed)."""

    # -- applying ops ------------------------------------------------------

    def link(
        self, root: _WDir, parts: list[str], dirent: TreeObj | None, flags: int, depth: int = 0
    ) -> None:
        cache = self.cache
        self.resolved = parts
        d = root
        for i in range(len(parts) - 1):
            name = parts[i]
            e = d.get(cache, name)
            if isinstance(e, _WDir):
                d = e
                continue
            t = e["type"] if e is not None else None
            if t == "dirref":
                sub = _WDir.load(cache, e)
                d.adopt(name, sub)
            elif t == "dir":
                sub = _WDir.inline(e)  # a dirent not stored yet: counts as changed
                d.adopt(name, sub)
            elif t == "symlink":
                if self.leased:
                    raise ErrnoError(errno.EINVAL, (
                        f"{shown('.'.join(parts))}: a key is attached to a lease by its own "
                        f"name, not through a symlink ({shown('.'.join(parts[:i + 1]))} is one): "
                        "name the key it leads to"))
                path = self._through(e, parts[i + 1:], depth, "write")
                _check_depth(".".join(parts), path, dirent, self.max_depth)
                if dirent is not None:
                    # (the key sent and the link's target each fit; joined
                    # they may not: a 16 KB key was stored so, 256 KiB ones
                    # by links in a chain)
                    check_length(".".join(path), "key written through a symlink")
                self.link(root, path, dirent, flags, depth + 1)
                return
            else:  # missing, or a value: (re)place with a new directory
                if dirent is None:
                    return
                sub = _WDir({})
                d.set(name, sub)
            d = sub
        name = parts[-1]
        if dirent is None:
            if d.get(cache, name) is not None:
                d.delete(name)
        elif flags & APPEND:
            self.append(d, name, dirent, parts)
        else:
            if d.hashed is not None:
                d.get(cache, name)  # load the shard path now, so NeedBlobs comes early
            d.set(name, dirent)

    def _through(self, link: TreeObj, rest: list[str], depth: int, doing: str) -> list[str]:
        """The path a walk continues on when it meets symlink ``link`` with
        components ``rest`` still to go: resolved from the root, in this
        namespace only (``EINVAL``), at most :data:`SYMLINK_MAX` deep (``ELOOP``)."""
        if depth >= SYMLINK_MAX:
            raise ErrnoError(errno.ELOOP, "too many levels of symbolic links")
        ns, target = symlink_target(link)
        if ns is None:
            ns, target = parse_ns_target(target)
        if ns is not None and ns != self.namespace:
            raise ErrnoError(errno.EINVAL, f"cannot {doing} through a link into another "
                                           "namespace")
        return split(target) + rest

    def expect(self, root: _WDir, parts: list[str], want: TreeObj | None,
               depth: int = 0) -> None:
        """An ``EXPECT`` op: ``ECANCELED`` unless the key holds ``want``'s
        bytes now (``None``: unless it is missing).  The path is walked as
        :meth:`link` walks it, through the working copies, so the changes of
        earlier ops count; directories it loads are adopted unchanged, which
        leaves them as they were when unrolled."""
        cache = self.cache
        d = root
        for i in range(len(parts) - 1):
            e = d.get(cache, parts[i])
            if isinstance(e, _WDir):
                d = e
                continue
            t = e["type"] if e is not None else None
            if t in ("dirref", "dir"):
                sub = _WDir.load(cache, e) if t == "dirref" else _WDir.inline(e)
                d.adopt(parts[i], sub)
                d = sub
            elif t == "symlink":
                self.expect(root, self._through(e, parts[i + 1:], depth, "expect"), want,
                            depth + 1)
                return
            else:  # missing, or a value: so the key is missing
                _compare(".".join(parts), None, want, self._blob, self._obj)
                return
        _compare(".".join(parts), d.get(cache, parts[-1]), want, self._blob, self._obj)

    def _blob(self, ref: str) -> bytes | None:
        """Blob ``ref``: made by this transaction (an earlier append's), else
        from the cache."""
        data = self.writer.blobs.get(ref)
        return data if data is not None else self.cache.get(ref)

    def _obj(self, ref: str) -> TreeObj | None:
        """Tree object ``ref`` (a ``vtree``'s chunk): made by this
        transaction, else from the cache."""
        obj = self.writer.objs.get(ref)
        return obj if obj is not None else self.cache.get_obj(ref)

    def append(self, d: _WDir, name: str, dirent: TreeObj,
               parts: list[str] | None = None) -> None:
        """Append ``dirent``'s data to entry ``name`` of ``d`` (key ``parts``,
        for the errors: they named the last part alone, ``l`` for ``pl.l``)."""
        key = shown(".".join(parts)) if parts else name
        cur = d.get(self.cache, name)
        if cur is None:
            d.set(name, dirent)
            return
        t = "dir" if isinstance(cur, _WDir) else cur["type"]
        put = self.writer.put_raw
        if t == "vtree":  # a long value: the new blob joins its tail
            index, chunks, tail = vtree_parts(cur)
            mine = self._grown.get(id(tail))
            if mine is not None and mine is tail:  # (ours, as a valref's list below)
                mine.append(put(dirent["data"]))
                return
            tail = [*tail, put(dirent["data"])]
            self._grown[id(tail)] = tail
            d.set(name, vtree(chunks, tail, index))  # (a full tail: a chunk on unroll)
            return
        if t == "valref":
            data: list[str] = cur["data"]
            if self._grown.get(id(data)) is data:  # (made by an append here: ours)
                data.append(put(dirent["data"]))
                return
            refs = [*data, put(dirent["data"])]
        elif t == "val":
            refs = [put(cur["data"]), put(dirent["data"])]
        elif t == "symlink":
            raise ErrnoError(errno.EOPNOTSUPP, f"{key}: cannot append to a symlink")
        else:
            raise ErrnoError(errno.EISDIR, f"{key}: cannot append to a directory")
        self._grown[id(refs)] = refs
        d.set(name, {"data": refs, "type": "valref", "ver": VER})

    # -- unrolling ---------------------------------------------------------

    def unroll_entry(self, v: Any) -> tuple[TreeObj, bool]:
        """Stored form of a working entry, and whether it differs from before."""
        if isinstance(v, _WDir):
            return self.unroll_dir(v)
        t = v["type"]
        if t == "val" and len(v["data"]) > INLINE_MAX:
            return {"data": [self.writer.put_raw(v["data"])], "type": "valref", "ver": VER}, True
        if t == "valref" and len(v["data"]) >= VTREE_CHUNK:  # long: chunked (treeobj)
            return vtree_of(v["data"], self.writer.put_obj), True
        if t == "vtree":
            index, chunks, tail = vtree_parts(v)
            if len(tail) >= VTREE_CHUNK or len(chunks) >= VTREE_CHUNK:  # (or of one level)
                return vtree_of(tail, self.writer.put_obj, chunks, index), True
        if t == "dir":
            return self.unroll_dir(_WDir.inline(v))
        return v, True

    def unroll_dir(self, w: _WDir) -> tuple[TreeObj, bool]:
        """Store ``w`` (if changed) and return its ``dirref``."""
        changed = w.changed
        base: str | None = None  # the blob ``w`` came from, and the names it changed:
        names: set[str] | None = None  # only those entries need packing again
        if w.hashed is None:
            ents = w.entries
            for name in w.dirty:
                new, ch = self.unroll_entry(ents[name])
                ents[name] = new
                changed = changed or ch
            if not changed:
                return w.orig, False  # type: ignore[return-value]
            obj = shards.make_dir(ents, self.writer)
            if w.orig is not None:
                base, names = w.orig["data"][0], w.dirty
        else:
            changes: dict[str, TreeObj | None] = {}
            for name, v in w.entries.items():
                if v is None:
                    changes[name] = None
                    continue
                new, ch = self.unroll_entry(v)
                if ch:
                    changes[name] = new
            if not changes and not w.changed:
                return w.orig, False  # type: ignore[return-value]
            obj = shards.update(self.cache, w.hashed, changes, self.writer)
        if w.orig is not None:
            self.writer.replaced.append(w.orig["data"][0])
        return _fresh_dirref(self.writer.put_obj(obj, base, names)), True


def _compare(key: str, cur: Any, want: TreeObj | None, blob: Callable[[str], bytes | None],
             obj: Callable[[str], TreeObj | None]) -> None:
    """``ECANCELED`` unless entry ``cur`` is the value ``want`` (None: no entry);
    ``blob`` finds a valref's blobs, ``obj`` a vtree's chunks."""
    if want is None:
        if cur is None:
            return
        raise ErrnoError(errno.ECANCELED, f"{shown(key)}: condition failed: it exists")
    if cur is None:
        raise ErrnoError(errno.ECANCELED, f"{shown(key)}: condition failed: it does not exist")
    t = "dir" if isinstance(cur, _WDir) else cur["type"]
    if t == "val":
        data = cur["data"]
    elif t == "valref" or t == "vtree":
        refs = value_refs(cur, obj)
        blobs = [blob(ref) for ref in refs]
        missing = [ref for ref, b in zip(refs, blobs, strict=True) if b is None]
        if missing:
            raise NeedBlobs(tuple(missing))
        data = b"".join(blobs)  # type: ignore[arg-type]
    else:
        raise ErrnoError(errno.ECANCELED, f"{shown(key)}: condition failed: it is a "
                                          f"{'directory' if t in ('dir', 'dirref') else t}")
    if bytes(data) != bytes(want["data"]):
        raise ErrnoError(errno.ECANCELED, f"{shown(key)}: condition failed: another value")


def apply(
    store: BlobStore | BlobCache,
    root_ref: str,
    ops: list[dict[str, Any]],
    *,
    hash_name: str = blobref.DEFAULT_HASH,
    namespace: str | None = None,
    ns_roots: Callable[[str], str | None] | None = None,
    max_depth: int = MAX_DEPTH,
) -> TxnResult:
    """Apply ``ops`` in order to the tree rooted at blob ``root_ref``.

    ``namespace`` names the namespace being written, so that a symlink
    naming that same namespace may be followed; links to any other
    namespace give ``EINVAL``.  ``ns_roots`` is accepted for symmetry with
    :func:`kvs.lookup.lookup` and unused, since writes never cross
    namespaces.  Pass a long-lived :class:`~kvs.treeobj.BlobCache` as
    ``store`` so unchanged directories are not decoded again on every commit.

    ``max_depth``: how deep a write may reach (:data:`MAX_DEPTH` for a
    commit; deeper needs a recursion limit of about twice as many frames).

    Raises ``ErrnoError`` (EPROTO for malformed ops, EINVAL, EISDIR, ELOOP,
    EOPNOTSUPP, ...) or :class:`NeedBlobs`.  Nothing is modified on error.
    """
    del ns_roots
    cache = as_cache(store)
    if not blobref.is_valid(root_ref):
        raise ErrnoError(errno.EINVAL, f"invalid root blobref {root_ref!r}")
    checked = [_check_op(op, max_depth) for op in ops]
    keys = list(dict.fromkeys(norm for norm, _, flags, _ in checked if not flags & EXPECT))
    if not checked:
        return TxnResult(root_ref, {}, keys)

    writer = BlobWriter(hash_name, cache)
    root = _WDir.load(cache, _fresh_dirref(root_ref), is_root=True)  # (checked above)
    txn = _Txn(cache, writer, namespace, max_depth)
    missing: set[str] = set()
    through: list[tuple[int, str]] = []
    for i, (norm, parts, flags, dirent) in enumerate(checked):
        try:
            if flags & EXPECT:
                txn.expect(root, parts, dirent)
            else:
                txn.leased = ops[i].get("lease") is not None
                txn.link(root, parts, dirent, flags)
                if txn.resolved is not parts:
                    through.append((i, ".".join(txn.resolved)))
        except NeedBlobs as e:
            missing |= e.refs
        except ErrnoError as exc:
            if missing:  # may be an artefact of an op skipped for want of blobs
                break
            if flags & EXPECT and exc.errnum != errno.ECANCELED:
                # (named by its key: not one written, which a caller would blame)
                raise ErrnoError(exc.errnum, f"{shown(norm)}: condition cannot be checked: "
                                             f"{exc.errstr}") from None
            raise
    if missing:
        raise NeedBlobs(missing)

    entry, _ = txn.unroll_dir(root)
    cache.remember(writer.objs, writer.packed, writer.replaced, writer.blobs)
    return TxnResult(entry["data"][0], writer.blobs, keys, through)
