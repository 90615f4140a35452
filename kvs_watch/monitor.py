"""Per-namespace monitor state: the current root and the watchers, indexed by key.

One :class:`Monitor` exists per namespace that has at least one watcher on
this rank.  The module creates it (asking ``kvs.getroot``; the module's one
subscription, ``kvs.namespace-``, brings its events) and destroys it with
its last watcher.

Which commits concern a watcher (the key index)
-----------------------------------------------
A setroot event lists the normalised ``keys`` its ops named.  A watcher of
key ``K`` gets that root when

* ``K`` is one of the keys (as in Flux), or
* a key lies *below* ``K`` (``K.x.y``): ``K`` is a directory whose content
  changed -- or a value the commit replaced by a directory, which the
  watcher must hear about (``EISDIR``) rather than miss, or
* ``K`` is ``.`` (the root changes with every commit).

A commit naming an *ancestor* of ``K`` (replacing directory ``a`` while
``a.b`` is watched), or a symlink's target, is seen only with ``FULL``,
exactly as in Flux: ``FULL`` watchers get every root and answer when the
value changed.  ``WATCH_DELETES`` watchers (a kvbroker extension, etcd's
DELETE, which a range delete emits for every key in it) are the exception:
a commit naming an ancestor of ``K`` concerns them too, since unlinking
``a`` or replacing it by a value removes ``a.b`` without naming it, and
the removal is what they watch for.  They are also indexed under each
proper ancestor of their key (:attr:`Monitor.above`), so finding them is
one more dict probe per committed key.  A removal made at a symlink's
target (naming ``x`` while ``a.b`` -> ``x`` and ``a.b.c`` is watched) is
not seen: that would mean resolving every watcher's path at each commit.
Finding the watchers of a setroot costs, per committed key, one dict probe
per path component -- independent of the number of watchers, so a watch
costs nothing for commits that do not name its key.
"""

from __future__ import annotations

import errno
from typing import Any, TypeAlias

from kvs_watch.watcher import Watcher

INIT, READY, MISSING = "init", "ready", "missing"

Index: TypeAlias = dict[str, Watcher | dict[Watcher, None]]
"""Key -> its watcher, or a dict of them when there are several (most keys
have one watcher: no dict per key)."""


def _index_add(index: Index, key: str, w: Watcher) -> None:
    ws = index.get(key)
    if ws is None:
        index[key] = w
    elif isinstance(ws, dict):
        ws[w] = None
    else:
        index[key] = {ws: None, w: None}


def _index_drop(index: Index, key: str, w: Watcher) -> None:
    ws = index.get(key)
    if ws is w:
        del index[key]
    elif type(ws) is dict:
        ws.pop(w, None)
        if len(ws) == 1:
            index[key] = next(iter(ws))


def ancestors(key: str) -> list[str]:
    """The directories above ``key``, nearest the root first (``a.b.c``:
    ``a``, ``a.b``; none for ``a`` or ``.``)."""
    out: list[str] = []
    i = key.find(".")
    while i > 0:
        out.append(key[:i])
        i = key.find(".", i + 1)
    return out


class Monitor:
    """A watched namespace: its latest root, owner and watchers."""

    __slots__ = ("name", "owner", "rootseq", "rootref", "state", "watchers",
                 "by_key", "above", "full", "keyed", "waiting")

    def __init__(self, name: str) -> None:
        self.name = name
        self.owner = -1
        self.rootseq = -1
        self.rootref = ""
        self.state = INIT
        """INIT: getroot pending; READY: root known; MISSING: no such namespace yet."""
        self.watchers: dict[Watcher, None] = {}
        self.by_key: Index = {}
        """Indexed watchers (neither FULL nor KEYS) by the key they watch."""
        self.above: Index | None = None
        """DELETES watchers by each directory above their key (``a.b.c``: ``a``
        and ``a.b``): a commit naming one may have removed the key.  None
        while there are none (the usual case)."""
        # The three sets below are None until a watcher needs one: most
        # namespaces have one plain key watcher, and with tens of thousands of
        # namespaces alive three empty dicts each are ~190 bytes a namespace.
        self.full: dict[Watcher, None] | None = None
        self.keyed: dict[Watcher, None] | None = None
        """WATCH_KEYS watchers: every setroot's keys are filtered for each."""
        self.waiting: dict[Watcher, None] | None = None
        """Watchers that have not had their initial root yet."""

    def __len__(self) -> int:
        return len(self.watchers)

    # ------------------------------------------------------------ watchers

    def add(self, w: Watcher) -> None:
        """Take ``w`` in: start it now if the root is known, else park it."""
        w.monitor = self
        self.watchers[w] = None
        if self.state == READY:
            self.start(w)
        elif self.waiting is None:
            self.waiting = {w: None}
        else:
            self.waiting[w] = None

    def join(self, w: Watcher) -> None:
        """Take ``w`` in without starting it: its caller starts it (with
        :meth:`start`) once it has its initial root."""
        w.monitor = self
        self.watchers[w] = None

    def start(self, w: Watcher, seq: int | None = None, ref: str = "") -> None:
        """Give ``w`` the current root as its initial one (or root ``seq``,
        ``ref``: a newer one read meanwhile), and index it."""
        if not w.may_access(self.owner):
            w.fail(errno.EPERM, f"namespace {self.name} belongs to another user")
            return
        if w.wants_updates:
            if w.full:
                if self.full is None:
                    self.full = {}
                self.full[w] = None
            elif w.keyed:
                if self.keyed is None:
                    self.keyed = {}
                self.keyed[w] = None
            else:
                _index_add(self.by_key, w.key, w)
                if w.deletes:
                    above = self.above
                    if above is None:
                        above = self.above = {}
                    for d in ancestors(w.key):
                        _index_add(above, d, w)
        if seq is None:
            w.push(self.rootseq, self.rootref, initial=True)
        else:
            w.push(seq, ref, initial=True)

    def remove(self, w: Watcher) -> None:
        self.watchers.pop(w, None)
        if self.waiting is not None:
            self.waiting.pop(w, None)
        if w.full:
            if self.full is not None:
                self.full.pop(w, None)
        elif w.keyed:
            if self.keyed is not None:
                self.keyed.pop(w, None)
        else:
            _index_drop(self.by_key, w.key, w)
            above = self.above
            if above is not None and w.deletes:
                for d in ancestors(w.key):
                    _index_drop(above, d, w)
                if not above:
                    self.above = None

    # ------------------------------------------------------------ roots

    def set_root(self, rootseq: int, rootref: str, owner: Any) -> list[Watcher]:
        """Adopt a root; returns the parked watchers to start (if it is the first)."""
        self.rootseq = rootseq
        self.rootref = rootref
        if self.owner < 0 and isinstance(owner, int):
            self.owner = owner
        if self.state == READY:
            return []
        self.state = READY
        started = list(self.waiting) if self.waiting is not None else []
        self.waiting = None
        return started

    def concerned(self, keys: Any) -> list[Watcher]:
        """The indexed watchers a commit naming ``keys`` concerns (see module doc)."""
        by_key = self.by_key
        hit: dict[Watcher, None] = dict(self.full) if self.full is not None else {}
        if not by_key:
            return list(hit)

        def add(ws: Watcher | dict[Watcher, None] | None) -> None:
            if ws is None:
                return
            if isinstance(ws, dict):
                hit.update(ws)
            else:
                hit[ws] = None

        add(by_key.get("."))
        above = self.above  # (its watchers are in by_key too: the return above holds)
        if isinstance(keys, list):
            for k in keys:
                if not isinstance(k, str):
                    continue
                add(by_key.get(k))
                if above is not None:  # k is a directory above a DELETES watcher's key
                    add(above.get(k))
                i = k.find(".")
                while i > 0:  # the directories above k
                    add(by_key.get(k[:i]))
                    i = k.find(".", i + 1)
        return list(hit)

    def describe(self) -> dict[str, Any]:
        return {"owner": self.owner, "rootseq": self.rootseq, "rootref": self.rootref,
                "state": self.state, "watchers": len(self.watchers)}
