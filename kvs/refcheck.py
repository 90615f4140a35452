"""Rank 0: the blobs a commit names by reference must exist, whole.

A transaction may name blobs it did not make: a ``valref`` (a value's data
stored beforehand), a ``dirref`` (``kvs copy``, ``namespace create -r``, a
directory a client built).  Rank 0's kvs checks, before a commit's root is
made, that each exists and that everything below a named directory does --
a garbage collection keeps what live trees reach, not every version a
client may have read -- so that a commit fails (``ENOENT``, ``EINVAL``)
rather than make a tree that cannot be read.  It remembers the trees it
checked whole until the next collection begins (:data:`WHOLE_MEMO`), and
checks again what a collection that began meanwhile may not have kept
(:meth:`RefChecker.keep_whole`).  Used by :mod:`kvs.commits` and by
``kvs.namespace-create``.
"""

from __future__ import annotations

import errno
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any

from broker.content.module import ContentModule
from broker.errors import ErrnoError
from kvs import treeobj
from kvs.blobs import BlobFetcher
from kvs.shards import names_a_directory

WHOLE_MEMO = 16_384
"""Tree objects rank 0 remembers having checked whole (:meth:`RefChecker.check_whole`):
a commit naming a directory by reference (``kvs copy``) checks only what
it has not checked since the last garbage collection began, so copying a
directory of 100,000 keys again costs one blob, not its ~1,600 shards."""


class RefChecker:
    """Rank 0's checks of the blobs transactions name (see the module docstring)."""

    def __init__(self, fetcher: BlobFetcher, counts: Counter[str]) -> None:
        self.fetch = fetcher.fetch
        self.counts = counts
        """The kvs module's counts (``trees-checked``)."""
        self.content: ContentModule | None = None
        """Rank 0's in-process content module (set at start): without it
        there are no garbage collections to follow, and no memo."""
        self._whole: OrderedDict[str, None] = OrderedDict()
        """Rank 0: tree objects checked whole (every blob below them stored)
        since the last garbage collection began, most recent last
        (:meth:`check_whole`); at most :data:`WHOLE_MEMO`."""
        self._whole_epoch = 0
        """``collections_begun`` when :attr:`_whole` was last emptied."""

    async def check_refs(self, ops: list[dict[str, Any]], new_blobs: dict[str, bytes],
                          held: set[str]) -> dict[str, bool]:
        """Blobrefs named by dirents must exist, and a dirref must name a
        directory: fail fast (ENOENT, EINVAL) rather than store a tree that
        cannot be read.  Entries of ``dir`` dirents are checked too.
        Returns the blobrefs named that this transaction did not make, each
        with whether it names a tree object (a dirref) or data (a valref)."""
        valrefs: set[str] = set()
        dirrefs: set[str] = set()
        todo = [op.get("dirent") for op in ops]
        while todo:
            d = todo.pop()
            if not d:
                continue
            t = d.get("type")
            if t == "valref":
                valrefs.update(d["data"])
            elif t == "dirref":
                dirrefs.update(d["data"])
            elif t == "dir":
                todo.extend(d["data"].values())
        named = {ref: ref in dirrefs for ref in valrefs | dirrefs if ref not in new_blobs}
        tops = {ref for ref, is_tree in named.items() if is_tree}
        whole = self.whole_memo() if tops else None
        epoch = self._whole_epoch
        found = await self.fetch(tops, held, keep=True) if tops else {}  # ENOENT if unknown
        if whole is not None:
            self.whole_memo()  # (empties ``whole`` in place if a collection began)
        # what is below: the named values' data, and the entries of the
        # named directories (fetched and decoded once, here)
        below = {ref: False for ref, is_tree in named.items() if not is_tree}
        for ref in dirrefs:
            try:  # (a blob this very transaction made, or one fetched)
                obj: Any = treeobj.decode(new_blobs.get(ref) or found[ref])
            except ErrnoError:
                obj = None
            if not names_a_directory(obj):
                raise ErrnoError(errno.EINVAL, f"dirref {ref} does not name a directory")
            if ref in tops and (whole is None or ref not in whole):
                below.update(treeobj.blobrefs(obj))
        if below:
            await self.check_whole(below, seen=set(tops))
        if tops:
            self._note_whole(tops, epoch)
        return named

    async def check_whole(self, refs: dict[str, bool], seen: set[str] | None = None) -> None:
        """``ENOENT`` unless every blob below ``refs`` exists (``refs``: blobref
        -> whether it is a tree object, else a value's data, which is only
        checked, never read: it may be big).  While rank 0 collects garbage,
        each is kept from the moment it is checked.

        A directory a client names (``kvs copy`` of an old version, a
        dirref it built) may have lost blobs to a garbage collection, which
        keeps what live trees reach, not every version a client may have
        read: the commit fails whole rather than make a tree that cannot
        be read.  Without collections it also refuses a dirref to a
        directory whose entries were never stored.  (``seen``: tree objects
        already checked.)"""
        content = self.content
        whole = self.whole_memo()
        epoch = self._whole_epoch
        seen = set() if seen is None else seen
        known = whole if whole is not None else {}
        todo = {r: t for r, t in refs.items() if r not in seen and r not in known}
        checked: list[str] = []
        while todo:
            seen.update(todo)
            trees = {ref for ref, is_tree in todo.items() if is_tree}
            checked.extend(trees)
            self.counts["trees-checked"] += len(trees)
            data = [ref for ref in todo if ref not in trees]
            if data:
                if content is not None:
                    await content.check_present(data)
                else:
                    await self.fetch(set(data))
            found = await self.fetch(trees, keep=True) if trees else {}
            below: dict[str, bool] = {}
            for ref in trees:
                below.update(treeobj.blobrefs(treeobj.decode(found[ref])))
            self.whole_memo()  # (empties ``known`` in place if a collection began)
            todo = {r: t for r, t in below.items() if r not in seen and r not in known}
        self._note_whole(checked, epoch)

    def whole_memo(self) -> OrderedDict[str, None] | None:
        """:attr:`_whole`, emptied if a garbage collection began since it was
        filled (one may remove blobs below a tree checked before it); None
        without an in-process content module (no collections to follow)."""
        content = self.content
        if content is None:
            return None
        if content.collections_begun != self._whole_epoch:
            self._whole.clear()
            self._whole_epoch = content.collections_begun
        return self._whole

    def _note_whole(self, trees: Iterable[str], epoch: int) -> None:
        """Remember ``trees`` as checked whole, unless a collection began
        since the check did (``epoch``)."""
        whole = self.whole_memo()
        if whole is None or epoch != self._whole_epoch:
            return
        for ref in trees:
            whole[ref] = None
            whole.move_to_end(ref)
        while len(whole) > WHOLE_MEMO:
            whole.popitem(last=False)

    async def keep_whole(self, refs: dict[str, bool], begun: int) -> None:
        """Check the blobs below ``refs`` again if a garbage collection began
        since ``begun`` (``collections_begun`` when they were first
        checked), until none has: one that began meanwhile may have listed
        its roots before this commit's, and not kept what was checked
        before it began.  Once the new root is made, a collection keeps it
        whole (:attr:`kvs.commits.CommitPipeline.unpublished`)."""
        content = self.content
        while content is not None and content.collections_begun != begun:
            begun = content.collections_begun
            await self.check_whole(refs)
