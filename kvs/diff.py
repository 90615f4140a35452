"""What differs between two versions of a KVS tree, without doing any I/O.

Two roots of a namespace share every blob their trees have in common -- the
tree is content-addressed -- so comparing them visits only what changed:
two directory entries with the same ``dirref`` hold the same subtree and are
skipped whole, and so are two shards of a hashed directory (``hdir``) with
the same blobref.  That makes "what changed since version N" cheap to ask
after any gap, and is how a watcher that lost its connection catches up: it
keeps the ``rootref`` of the last change it saw and diffs it against the
root its new watch starts at (docs/kvs.md, "Catching up after a gap").

:class:`Diff` is resumable: when blobs are missing it raises
:class:`~kvs.treeobj.NeedBlobs` naming every one it can tell, keeps the
comparisons that wait for them, and :meth:`Diff.run` goes on from there once
the caller has fetched them (each round of fetches reaches one more level of
the tree; starting over each time made a deep tree cost a full pass per
level).  The work is a stack, not recursion: a tree may be deeper than
Python's recursion limit.

What is reported: the keys whose entries differ, as full keys, sorted.  A
value, a symlink and an empty directory are keys (a directory that becomes
empty, or stops being empty, is reported too); a directory that only one
side has, or that is something else on the other side, is reported as every
key below it, so the list names what a reader must read again.  Symlinks
are compared, never followed: a ``key`` whose path passes through one is
``EINVAL`` (its target is what changes: diff there), not an empty answer,
unless the link itself came, went or changed: then its key is the answer.

How each key changed (:meth:`Diff.changes`, ``git diff --name-status``'s
A/D/M) compares what the key *is* in each tree, where a key is a value, a
symlink or an empty directory and a directory with entries is not a key
(its keys are below it): ``added`` when only the new tree has it,
``removed`` when only the old one does, ``changed`` when both do and they
differ (another value, a symlink retargeted, or one kind replaced by
another: a value that became a symlink or an empty directory).  So a value
that became a directory with entries is ``removed`` and each key below it
``added`` (as git reports a file replaced by a directory); an empty
directory that appears is ``added``, and one that gains entries is
``removed`` with the entries ``added``.  The kind is a function of the two
entries at the key alone, never of the order the work ran in, so a key
reported again in a later round (after a fetch) has the same kind.
"""

from __future__ import annotations

import errno
from typing import Literal, NamedTuple

from broker.errors import ErrnoError
from kvs import shards
from kvs.keys import shown, split
from kvs.lookup import load_dir
from kvs.treeobj import BlobCache, NeedBlobs, TreeObj, dir_, dirref

__all__ = ["ADDED", "CHANGED", "DEFAULT_LIMIT", "REMOVED", "Change", "Diff", "diff"]

DEFAULT_LIMIT = 100_000
"""Most keys a diff reports; more is ``EOVERFLOW`` (read the directory whole)."""

Change = Literal["added", "removed", "changed"]
"""How a key changed: only the new tree has it, only the old one, or both, differing."""

ADDED: Change = "added"
REMOVED: Change = "removed"
CHANGED: Change = "changed"

_DIRS = ("dir", "dirref")
_EMPTY: TreeObj = dir_()

# The comparisons still to make (a stack of these).  Each runs whole or not
# at all: one that finds a blob missing is put aside untouched, to run again
# once the blob is here (reporting a key twice is harmless: keys are a set,
# and its kind depends on its two entries only).


class _Entries(NamedTuple):
    """What ``key`` holds in each tree (None: nothing)."""
    key: str
    old: TreeObj | None
    new: TreeObj | None


class _Dirs(NamedTuple):
    """Two directory objects below ``prefix``."""
    prefix: str
    old: TreeObj
    new: TreeObj


class _Shards(NamedTuple):
    """Two shards of one hashed directory, by blobref (None: no such shard)."""
    prefix: str
    old: str | None
    new: str | None


class _Every(NamedTuple):
    """A directory with entries that only one tree has (``new``: the new
    one): every key of it."""
    prefix: str
    obj: TreeObj
    new: bool


_Task = _Entries | _Dirs | _Shards | _Every


class _Missing(Exception):
    """A blob the current comparison needs is not in the cache."""


class Diff:
    """One diff of the trees at blobs ``old_root`` and ``new_root``, at and
    below ``key``; :meth:`run` it until it returns the keys."""

    def __init__(self, cache: BlobCache, old_root: str, new_root: str, key: str = ".",
                 *, limit: int = DEFAULT_LIMIT) -> None:
        self.cache = cache
        self.roots = (old_root, new_root)
        self.parts = split(key)
        self.limit = limit
        self.keys: dict[str, Change] = {}
        self.todo: list[_Task] | None = None  # (None: the key is not resolved yet)
        self.missing: set[str] = set()

    # ------------------------------------------------------------ blobs

    def _get(self, ref: str, *, root: bool = False) -> TreeObj:
        """The directory object in blob ``ref`` (as a lookup loads it:
        ``EINVAL`` for a bad root, ``ENOTRECOVERABLE`` inside a tree);
        :class:`_Missing` (noted) when it is not here."""
        try:
            return load_dir(self.cache, ref, is_root=root)
        except NeedBlobs as need:
            self.missing.update(need.refs)
            raise _Missing from None

    def _directory(self, entry: TreeObj) -> TreeObj:
        """The directory a ``dirref`` or inline ``dir`` entry holds."""
        return entry if entry["type"] == "dir" else self._get(entry["data"][0])

    def _directories(self, *entries: TreeObj) -> list[TreeObj]:
        """:meth:`_directory` of each, every missing blob noted before
        :class:`_Missing` (so one round of fetches brings them all)."""
        out: list[TreeObj] = []
        short = False
        for entry in entries:
            try:
                out.append(self._directory(entry))
            except _Missing:
                short = True
        if short:
            raise _Missing
        return out

    def _entries(self, obj: TreeObj) -> dict[str, TreeObj]:
        try:
            return shards.entries(self.cache, obj)
        except NeedBlobs as need:
            self.missing.update(need.refs)
            raise _Missing from None

    # ------------------------------------------------------------ running

    def changes(self) -> dict[str, Change]:
        """How each key changed, in key order (once :meth:`run` has
        returned; so far, before)."""
        return {key: self.keys[key] for key in sorted(self.keys)}

    def run(self) -> list[str]:
        """Go on comparing: the keys that differ, sorted; :class:`NeedBlobs`
        (the work so far kept) while blobs are missing, ``EOVERFLOW`` past
        ``limit`` keys, ``EINVAL`` when a root is not a directory."""
        self.missing = set()
        if self.todo is None:
            self._start()
        todo, waiting = self.todo, []
        assert todo is not None
        while todo:
            task = todo.pop()
            try:
                self._do(task, todo)
            except _Missing:
                waiting.append(task)
        self.todo = waiting
        if waiting:
            raise NeedBlobs(self.missing)
        return sorted(self.keys)

    def _start(self) -> None:
        """Walk to ``key`` in both trees at once (no link followed) and queue
        the first comparison; :class:`NeedBlobs` until the directories on the
        way are here.  A symlink on the way that is the same in both trees is
        ``EINVAL`` (what changed is its target); one that came, went or
        changed there is the change, reported at its key, as a watch of
        ``key`` reports a directory above it that a commit replaced."""
        for ref in self.roots:
            try:
                self._get(ref, root=True)
            except _Missing:
                pass
        if self.missing:
            raise NeedBlobs(self.missing)
        sides: list[TreeObj | None] = [dirref(ref) for ref in self.roots]
        for i, name in enumerate(self.parts):
            if any(s is not None and s["type"] == "symlink" for s in sides):
                above = ".".join(self.parts[:i])
                if sides[0] == sides[1]:
                    key = shown(".".join(self.parts))
                    raise ErrnoError(errno.EINVAL, f"{key} passes through the symlink "
                                     f"{shown(above)}, which a diff does not follow: "
                                     "diff its target")
                try:  # (is a directory on the other side a key: empty?)
                    objs = self._loaded(sides[0], sides[1])
                except _Missing:
                    raise NeedBlobs(self.missing) from None
                kind = _kind(_present(sides[0], objs[0]), _present(sides[1], objs[1]))
                if kind is not None:  # (always: one side is a link, the other not it)
                    self._report(above, kind)
                self.todo = []
                return
            below: list[TreeObj | None] = []
            for side in sides:
                try:
                    below.append(self._child(side, name))
                except _Missing:
                    below.append(None)
            if self.missing:
                raise NeedBlobs(self.missing)
            sides = below
        self.todo = [_Entries(".".join(self.parts), sides[0], sides[1])]

    def _child(self, entry: TreeObj | None, name: str) -> TreeObj | None:
        """Entry ``name`` of the directory ``entry`` holds; None when there is
        none, or ``entry`` is nothing or a value (a path through a value)."""
        if entry is None or entry["type"] not in _DIRS:
            return None
        try:
            return shards.get(self.cache, self._directory(entry), name)
        except NeedBlobs as need:
            self.missing.update(need.refs)
            raise _Missing from None

    def _loaded(self, old: TreeObj | None, new: TreeObj | None) -> list[TreeObj | None]:
        """The directory each side holds (None: not a directory), every
        missing blob noted before :class:`_Missing`."""
        sides = (old, new)
        dirs = iter(self._directories(*(s for s in sides if s is not None and _is_dir(s))))
        return [next(dirs) if _is_dir(s) else None for s in sides]

    def _report(self, key: str, kind: Change) -> None:
        self.keys[key] = kind
        if len(self.keys) > self.limit:
            raise self._overflow()

    def _overflow(self) -> ErrnoError:
        return ErrnoError(errno.EOVERFLOW, f"more than {self.limit} keys differ: "
                                           "read the directory whole")

    def _do(self, task: _Task, todo: list[_Task]) -> None:
        if isinstance(task, _Entries):
            self._entry(task.key, task.old, task.new, todo)
        elif isinstance(task, _Dirs):
            self._dirs(task.prefix, task.old, task.new, todo)
        elif isinstance(task, _Shards):
            a, b = self._directories(*(dirref(r) if r is not None else _EMPTY
                                       for r in (task.old, task.new)))
            todo.append(_Dirs(task.prefix, a, b))
        else:
            ents = self._entries(task.obj)
            todo.extend(_Entries(_join(task.prefix, name), None, e) if task.new
                        else _Entries(_join(task.prefix, name), e, None)
                        for name, e in ents.items())

    def _entry(self, key: str, old: TreeObj | None, new: TreeObj | None,
               todo: list[_Task]) -> None:
        """Compare what ``key`` holds in each tree (None: nothing).  Every
        blob is loaded before anything is reported, so the comparison runs
        whole or not at all."""
        if old == new:
            return
        if not _is_dir(old) and not _is_dir(new):  # (the common case, kept quick)
            self._report(key, _kind(old is not None, new is not None) or CHANGED)
            return
        a, b = self._loaded(old, new)
        was, now = _present(old, a), _present(new, b)
        if a is not None and b is not None:
            if key and was != now:
                self._report(key, ADDED if now else REMOVED)  # became empty, or stopped
            todo.append(_Dirs(key, a, b))
            return
        kind = _kind(was, now)
        if kind is not None:
            self._report(key, kind)  # a value, symlink or empty directory came, went or changed
        # Every entry of a directory on one side only is at least one key:
        # past the limit, said before its shards are read (a removed
        # directory of 1M keys was loaded whole, 11 s and 775 MB, first).
        if len(self.keys) + sum(shards.count(d) for d in (a, b) if d is not None) > self.limit:
            raise self._overflow()
        todo.extend(_Every(key, d, side) for d, side in ((a, False), (b, True))
                    if d is not None and shards.count(d) > 0)

    def _dirs(self, prefix: str, a: TreeObj, b: TreeObj, todo: list[_Task]) -> None:
        """Compare two directories: shard by shard when both are ``hdir``
        nodes of one depth (equal blobrefs, equal entries), else entry by entry."""
        if a["type"] == "hdir" and b["type"] == "hdir" \
                and a["data"]["depth"] == b["data"]["depth"]:
            sa, sb = a["data"]["shards"], b["data"]["shards"]
            todo.extend(_Shards(prefix, sa.get(d), sb.get(d))
                        for d in sa.keys() | sb.keys() if sa.get(d) != sb.get(d))
            return
        ea, eb = self._entries(a), self._entries(b)
        todo.extend(_Entries(_join(prefix, name), ea.get(name), eb.get(name))
                    for name in ea.keys() | eb.keys())


def _is_dir(entry: TreeObj | None) -> bool:
    return entry is not None and entry["type"] in _DIRS


def _present(entry: TreeObj | None, directory: TreeObj | None) -> bool:
    """Whether ``entry`` (the directory it holds loaded, if it is one) is a
    key: a value, a symlink or an empty directory."""
    return entry is not None and (directory is None or shards.count(directory) == 0)


def _kind(was: bool, now: bool) -> Change | None:
    """How a key changed that differs between the trees (``was``: the old
    one has it as a key; ``now``: the new one)."""
    if was and now:
        return CHANGED
    if was or now:
        return ADDED if now else REMOVED
    return None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def diff(cache: BlobCache, old_root: str, new_root: str, key: str = ".", *,
         limit: int = DEFAULT_LIMIT) -> list[str]:
    """The keys at or below ``key`` whose entries differ between the trees
    rooted at blobs ``old_root`` and ``new_root``, sorted, in one go
    (:class:`NeedBlobs` if any blob is missing: a caller that fetches
    should keep a :class:`Diff` and run it again instead)."""
    return Diff(cache, old_root, new_root, key, limit=limit).run()
