"""The lookup engine: resolve a key in a KVS root, without doing any I/O.

Like Flux's ``lookup.c`` this is a resumable engine, but the resumption is
"call again from scratch": when a blob is not in the store, :func:`lookup`
raises :class:`NeedBlobs` naming every blob it can tell is missing; when a
symlink leads into a namespace whose root it does not know, it raises
:class:`NeedNamespace`.  The caller (the kvs module) fetches what is missing
and calls again.  With a shared :class:`~kvs.treeobj.BlobCache` the retry
costs only dict lookups.

Semantics follow Flux (``t/t1000-kvs.t``):

* The key is normalised; ``"."`` is the root directory.
* Symlinks in the middle of a path are always followed; the final
  component is followed unless ``READLINK`` or ``TREEOBJ`` is given.  A
  chain of more than 10 links gives ``ELOOP``.  A link's target resolves
  from the root of the namespace the link lives in, unless the link names a
  namespace (``{"target", "namespace"}`` or a target ``"NS::key"``); then it
  resolves from that namespace's root, obtained from ``ns_roots(ns)``.
  ``ns_roots`` may raise ``ErrnoError`` (e.g. ``EPERM`` for a guest).
* A missing key, or a path through a value, gives ``None``; the module
  answers ``ENOENT`` (or "no value" for lookup-plus / waitcreate), as Flux
  does for both cases.
* ``TREEOBJ``: the entry's tree object as stored (``val``, ``valref``,
  ``dirref``, ``symlink``; ``"."`` gives ``dirref(root_ref)``).  Hashed
  directories are reached only through ``dirref`` entries, so an ``hdir``
  is never returned; a long value stored as a ``vtree`` is shown as the
  ``valref`` of all its blobs (so is every entry of a ``READDIR``).
* ``TREEOBJ`` with ``after``: what an APPEND watcher asks, the blobs of a
  ``valref``/``vtree`` after those it has, with a mark that they are
  still in place (:func:`~kvs.treeobj.value_after`): a long log costs it
  O(chunks + new blobs) per version, not O(blobs).
* ``READLINK``: the final entry must be a symlink (else ``EINVAL``).
* ``READDIR``: the entry must be a directory (else ``ENOTDIR``); the result
  is a ``dir`` whose data maps every name to its stored entry (not
  expanded).  The shards of a hashed directory are merged, so ``hdir`` is
  invisible.
* no flag: the entry must be a value (else ``EISDIR``); the result is a
  ``val`` with the full bytes (the blobs of a ``valref`` concatenated).

Returned objects may share sub-objects with the cache: treat them as
read-only.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from broker.content import blobref
from broker.errors import ErrnoError, KvbrokerError
from kvs import shards
from kvs.keys import check_key, parse_ns_target, shown, split
from kvs.treeobj import (
    BlobCache,
    BlobStore,
    NeedBlobs,
    TreeObj,
    as_cache,
    as_valref,
    dir_,
    dirref,
    symlink_target,
    val,
    value_after,
    value_refs,
)

__all__ = [
    "READDIR",
    "READLINK",
    "TREEOBJ",
    "SYMLINK_MAX",
    "NeedBlobs",
    "NeedNamespace",
    "load_dir",
    "lookup",
    "read_dir",
    "read_value",
]

READDIR = 1
READLINK = 2
TREEOBJ = 16

SYMLINK_MAX = 10
"""Longest chain of symlinks followed; one more gives ``ELOOP`` (as Flux)."""

NsRoots = Callable[[str], "str | None"]


class NeedNamespace(KvbrokerError):
    """A symlink leads into ``namespace``, whose rootref the caller must supply."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        super().__init__(f"need root of namespace {namespace!r}")


def load_dir(cache: BlobCache, ref: str, *, is_root: bool) -> TreeObj:
    """The ``dir``/``hdir`` object in blob ``ref``.

    A bad root is the user's fault (``EINVAL``, e.g. a bogus ``--at``
    treeobj); a bad directory inside the tree is corruption.
    """
    errnum = errno.EINVAL if is_root else errno.ENOTRECOVERABLE
    try:
        obj = cache.get_obj(ref)
    except ErrnoError:
        raise ErrnoError(errnum, f"{ref} is not a tree object") from None
    if obj is None:
        raise NeedBlobs((ref,))
    if obj["type"] not in ("dir", "hdir"):
        raise ErrnoError(errnum, f"{ref} is not a directory")
    if is_root and not shards.names_a_directory(obj):
        # (an inner shard holds part of a big directory: read as a root it
        # listed a few of its keys and missed the rest -- refused, as a
        # namespace's new root or a dirref put are)
        raise ErrnoError(errnum, f"{ref} is an inner shard of a directory, not a whole one")
    return obj


def read_dir(store: BlobStore | BlobCache, ref: str) -> TreeObj:
    """The directory in blob ``ref`` as one plain ``dir`` (hdir shards merged)."""
    cache = as_cache(store)
    return listing(cache, shards.entries(cache, load_dir(cache, ref, is_root=True)))


def listing(cache: BlobCache, entries: dict[str, TreeObj]) -> TreeObj:
    """A ``dir`` of ``entries`` as a lookup shows them: a ``vtree`` as a
    ``valref`` (:func:`~kvs.treeobj.as_valref`); :class:`NeedBlobs` names
    the chunks missing for all of them."""
    if not any(e["type"] == "vtree" for e in entries.values()):
        return dir_(entries)
    out: dict[str, TreeObj] = {}
    need: set[str] = set()
    for name, entry in entries.items():
        try:
            out[name] = as_valref(entry, cache.get_obj)
        except NeedBlobs as e:
            need |= e.refs
    if need:
        raise NeedBlobs(need)
    return dir_(out)


def read_value(store: BlobStore | BlobCache, entry: TreeObj) -> bytes:
    """The bytes of a ``val``/``valref``/``vtree`` entry; :class:`NeedBlobs`
    lists all missing (a ``vtree``'s chunks first)."""
    if entry["type"] == "val":
        data: bytes = entry["data"]
        return data
    refs = value_refs(entry, as_cache(store).get_obj) if entry["type"] == "vtree" \
        else entry["data"]
    chunks = [store.get(ref) for ref in refs]
    need = {ref for ref, chunk in zip(refs, chunks, strict=True) if chunk is None}
    if need:
        raise NeedBlobs(need)
    return b"".join(chunks)  # type: ignore[arg-type]


class _Walker:
    """Resolves paths, following symlinks across namespaces."""

    def __init__(self, cache: BlobCache, ns_roots: NsRoots | None) -> None:
        self.cache = cache
        self.ns_roots = ns_roots

    def ns_root(self, ns: str) -> str:
        ref = self.ns_roots(ns) if self.ns_roots is not None else None
        if ref is None:
            raise NeedNamespace(ns)
        return ref

    def resolve(
        self,
        root_ref: str,
        ns: str | None,
        parts: list[str],
        follow_final: bool,
        depth: int = 0,
    ) -> tuple[TreeObj, str, str | None] | None:
        """The entry at ``parts`` below ``root_ref`` (``parts`` non-empty).

        Also returns the root and namespace the entry was found in: after a
        link into another namespace, later components (and links met there)
        resolve in that namespace.
        """
        cur = dirref(root_ref)
        last = len(parts) - 1
        for i, name in enumerate(parts):
            t = cur["type"]
            if t == "dirref":
                d = load_dir(self.cache, cur["data"][0], is_root=i == 0)
            elif t == "dir":
                d = cur
            else:  # a value in the middle of the path
                return None
            entry = shards.get(self.cache, d, name)
            if entry is None:
                return None
            if entry["type"] == "symlink" and (i < last or follow_final):
                if depth >= SYMLINK_MAX:
                    raise ErrnoError(errno.ELOOP, "too many levels of symbolic links")
                link_ns, target = symlink_target(entry)
                if link_ns is None:
                    link_ns, target = parse_ns_target(target)
                if link_ns is not None and link_ns != ns:
                    root_ref, ns = self.ns_root(link_ns), link_ns
                tparts = split(target)
                if not tparts:
                    entry = dirref(root_ref)
                else:
                    found = self.resolve(root_ref, ns, tparts, True, depth + 1)
                    if found is None:
                        return None
                    entry, root_ref, ns = found
            cur = entry
        return cur, root_ref, ns


def lookup(
    store: BlobStore | BlobCache,
    root_ref: str,
    key: str,
    flags: int,
    *,
    namespace: str | None = None,
    ns_roots: NsRoots | None = None,
    after: tuple[int, bytes] | None = None,
    obj_ref: Callable[[TreeObj], str] | None = None,
) -> TreeObj | None:
    """Look ``key`` up in the tree whose root directory is blob ``root_ref``.

    ``namespace`` is the namespace ``root_ref`` belongs to (so a symlink
    naming it is not treated as foreign).  Returns the result tree object
    described in the module docstring, or ``None`` when the key does not
    exist.  Raises ``ErrnoError`` (EISDIR, ENOTDIR, EINVAL, ELOOP, ...),
    :class:`NeedBlobs` or :class:`NeedNamespace`.

    ``after`` (``TREEOBJ`` only): ``(count, mark)`` of the blobs an APPEND
    watcher has answered; the result is then
    :func:`~kvs.treeobj.value_after`'s answer, a map holding ``val`` (the
    new blobs only, when the value grew from those), and ``obj_ref``
    names the blob a tree object is stored as.
    """
    cache = as_cache(store)
    if not blobref.is_valid(root_ref):
        raise ErrnoError(errno.EINVAL, f"invalid root blobref {shown(root_ref)!r}")
    if after is not None and (not flags & TREEOBJ or obj_ref is None):
        raise ErrnoError(errno.EINVAL, "after needs the TREEOBJ flag")
    parts = split(check_key(key))
    if not parts:
        if flags & TREEOBJ:
            return dirref(root_ref) if after is None else {"val": dirref(root_ref)}
        if flags & READLINK:
            raise ErrnoError(errno.EINVAL, "the root is not a symlink")
        if not flags & READDIR:
            raise ErrnoError(errno.EISDIR, "the root is a directory")
        return listing(cache, shards.entries(cache, load_dir(cache, root_ref, is_root=True)))

    follow_final = not flags & (READLINK | TREEOBJ)
    found = _Walker(cache, ns_roots).resolve(root_ref, namespace, parts, follow_final)
    if found is None:
        return None
    entry = found[0]
    if after is not None:
        assert obj_ref is not None
        return value_after(entry, *after, cache.get_obj, obj_ref)
    if flags & TREEOBJ:
        return as_valref(entry, cache.get_obj)
    t = entry["type"]
    if t == "dirref" or t == "dir":
        if flags & READLINK:
            raise ErrnoError(errno.EINVAL, f"{shown(key)}: not a symlink")
        if not flags & READDIR:
            raise ErrnoError(errno.EISDIR, f"{shown(key)}: is a directory")
        d = entry if t == "dir" else load_dir(cache, entry["data"][0], is_root=False)
        return listing(cache, shards.entries(cache, d))
    if t == "val" or t == "valref" or t == "vtree":
        if flags & READLINK:
            raise ErrnoError(errno.EINVAL, f"{shown(key)}: not a symlink")
        if flags & READDIR:
            raise ErrnoError(errno.ENOTDIR, f"{shown(key)}: not a directory")
        if t == "val":
            return entry
        return val(read_value(cache, entry))
    if t == "symlink":  # reached only with READLINK
        if flags & READDIR:
            raise ErrnoError(errno.ENOTDIR, f"{shown(key)}: not a directory")
        return entry
    raise ErrnoError(errno.ENOTRECOVERABLE, f"{shown(key)}: unexpected {t} entry")
