"""What differs between two versions of a KVS tree, without doing any I/O.

Two roots of a namespace share every blob their trees have in common -- the
tree is content-addressed -- so comparing them visits only what changed:
two directory entries with the same ``dirref`` hold the same subtree and are
skipped whole, and so are two shards of a hashed directory (``hdir``) with
the same blobref.  That makes "what changed since version N" cheap to ask
after any gap, and is how a watcher that lost its connection catches up: it
keeps the ``rootref`` of the last change it saw and diffs it against the
root its new watch starts at (docs/kvs.md, "Catching up after a gap").

Like :mod:`kvs.lookup`, :func:`diff` is restarted from scratch by its caller
when it raises :class:`~kvs.treeobj.NeedBlobs`; with a shared
:class:`~kvs.treeobj.BlobCache` a retry costs only dict lookups.

What is reported: the keys whose entries differ, as full keys, sorted.  A
value, a symlink and an empty directory are keys; a directory that only one
side has (or that is something else on the other side) is reported as every
key below it, so the list names what a reader must read again.  Symlinks are
compared, never followed.
"""

from __future__ import annotations

import errno

from broker.errors import ErrnoError
from kvs import shards
from kvs.keys import split
from kvs.treeobj import BlobCache, NeedBlobs, TreeObj, dir_, dirref

__all__ = ["DEFAULT_LIMIT", "diff"]

DEFAULT_LIMIT = 100_000
"""Most keys a diff reports; more is ``EOVERFLOW`` (read the directory whole)."""

_DIRS = ("dir", "dirref")


class _Differ:
    """One pass of a diff: the keys found, the blobs found missing."""

    def __init__(self, cache: BlobCache, limit: int) -> None:
        self.cache = cache
        self.limit = limit
        self.keys: set[str] = set()
        self.missing: set[str] = set()

    def report(self, key: str) -> None:
        self.keys.add(key)
        if len(self.keys) > self.limit:
            raise ErrnoError(errno.EOVERFLOW, f"more than {self.limit} keys differ: "
                                              "read the directory whole")

    def load(self, ref: str) -> TreeObj | None:
        """The directory object in blob ``ref``; None (noted) when not here."""
        obj = self.cache.get_obj(ref)
        if obj is None:
            self.missing.add(ref)
            return None
        if obj["type"] not in ("dir", "hdir"):
            raise ErrnoError(errno.ENOTRECOVERABLE, f"{ref} is not a directory")
        return obj

    def directory(self, entry: TreeObj) -> TreeObj | None:
        """The directory object a ``dirref`` or inline ``dir`` entry holds."""
        return entry if entry["type"] == "dir" else self.load(entry["data"][0])

    def entries(self, obj: TreeObj) -> dict[str, TreeObj] | None:
        """Every entry of directory ``obj``; None (noted) when shards are missing."""
        try:
            return shards.entries(self.cache, obj)
        except NeedBlobs as need:
            self.missing.update(need.refs)
            return None

    def entry(self, key: str, old: TreeObj | None, new: TreeObj | None) -> None:
        """Compare what ``key`` holds in each tree (None: nothing)."""
        if old == new:
            return
        old_dir = old is not None and old["type"] in _DIRS
        new_dir = new is not None and new["type"] in _DIRS
        if old_dir and new_dir:
            assert old is not None and new is not None
            a, b = self.directory(old), self.directory(new)
            if a is not None and b is not None:
                self.dirs(key, a, b)
            return
        if (old is not None and not old_dir) or (new is not None and not new_dir):
            self.report(key)  # a value or symlink came, went or changed
        for side, is_dir in ((old, old_dir), (new, new_dir)):
            if is_dir:
                assert side is not None
                obj = self.directory(side)
                if obj is not None:
                    self.every_key(key, obj)

    def every_key(self, prefix: str, obj: TreeObj) -> None:
        """Report every key of a directory only one tree has."""
        ents = self.entries(obj)
        if ents is None:
            return
        if not ents:
            self.report(prefix)  # an empty directory is a key of its own
        for name, entry in ents.items():
            self.entry(_join(prefix, name), entry, None)

    def dirs(self, prefix: str, a: TreeObj, b: TreeObj) -> None:
        """Compare two directories: shard by shard when both are ``hdir``
        nodes of one depth (equal blobrefs, equal entries), else entry by
        entry."""
        if a["type"] == "hdir" and b["type"] == "hdir" \
                and a["data"]["depth"] == b["data"]["depth"]:
            sa, sb = a["data"]["shards"], b["data"]["shards"]
            for digit in sa.keys() | sb.keys():
                ra, rb = sa.get(digit), sb.get(digit)
                if ra == rb:
                    continue
                da = self.load(ra) if ra is not None else _EMPTY
                db = self.load(rb) if rb is not None else _EMPTY
                if da is not None and db is not None:
                    self.dirs(prefix, da, db)
            return
        ea, eb = self.entries(a), self.entries(b)
        if ea is None or eb is None:
            return
        for name in ea.keys() | eb.keys():
            self.entry(_join(prefix, name), ea.get(name), eb.get(name))

    def resolve(self, root: str, parts: list[str]) -> TreeObj | None:
        """The entry at ``parts`` in the tree rooted at ``root``, no link
        followed: None if there is none (a path through a value included)."""
        entry: TreeObj = dirref(root)
        for name in parts:
            if entry["type"] not in _DIRS:
                return None
            here = self.directory(entry)
            if here is None:
                return None  # (noted missing)
            try:
                found = shards.get(self.cache, here, name)
            except NeedBlobs as need:
                self.missing.update(need.refs)
                return None
            if found is None:
                return None
            entry = found
        return entry


_EMPTY: TreeObj = dir_()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def diff(cache: BlobCache, old_root: str, new_root: str, key: str = ".", *,
         limit: int = DEFAULT_LIMIT) -> list[str]:
    """The keys at or below ``key`` whose entries differ between the trees
    rooted at blobs ``old_root`` and ``new_root``, sorted.

    ``key`` is looked for in each tree without following symlinks.  Raises
    :class:`NeedBlobs` naming every missing blob it can tell, ``EOVERFLOW``
    past ``limit`` keys, ``EINVAL`` when a root is not a directory."""
    d = _Differ(cache, limit)
    for root in (old_root, new_root):
        obj = cache.get_obj(root)
        if obj is None:
            d.missing.add(root)
        elif obj["type"] not in ("dir", "hdir"):
            raise ErrnoError(errno.EINVAL, f"{root} is not a directory")
    if d.missing:
        raise NeedBlobs(d.missing)
    parts = split(key)
    old, new = d.resolve(old_root, parts), d.resolve(new_root, parts)
    if d.missing:
        raise NeedBlobs(d.missing)
    d.entry(".".join(parts), old, new)
    if d.missing:
        raise NeedBlobs(d.missing)
    return sorted(d.keys)
