"""Offline garbage collection of a statedir's content store (``kvbroker kvs gc``).

The content store only grows: every commit adds blobs (new leaves, new
directory nodes, a new root) and nothing ever removes the versions they
replace, nor the namespaces that do not survive a restart.  A crash soak
grew one to 1.9 GB.  Flux collects offline too (``flux shutdown --gc``
dumps the KVS and restores it into a fresh store); here the collection is
a mark and sweep on the SQLite file of a *stopped* instance:

* **Mark**: every blob reachable from a checkpoint.  The KVS's own
  checkpoint (``kvs-primary``) is the root of the ``primary`` namespace, the
  only one a restart brings back, and is walked as a tree: ``dirref`` and
  ``hdir`` shards lead to tree objects, ``valref`` to data blobs.  Any
  other checkpoint (``content.checkpoint-put`` lets the owner write one
  under any key) is opaque, so every blobref found in its value is kept, and
  walked too when it is a tree object.
* **Sweep**: delete the rest in one transaction, then ``VACUUM`` so the file
  shrinks.

It refuses, deleting nothing, when a checkpoint names a blob that is not in
the store or a tree object that does not decode (the store is damaged: keep
everything for whoever investigates), when there is no KVS checkpoint at all
(everything would go), and when an instance has the store open (SQLite's
exclusive lock, as for a second instance on the same statedir).  A crash
during the sweep rolls it back.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgpack

from broker.content import blobref, locks
from broker.content.sqlite import STORE_FILE, SqliteStore, StoreLocked, open_to_read
from broker.errors import ErrnoError
from broker.launch import StartError, private_dir
from kvs import treeobj
from kvs.namespaces import CHECKPOINT_KEY, rootseq_of


class GcError(Exception):
    """Why a collection did not run; nothing was deleted."""


@dataclass
class GcReport:
    """What a collection kept and removed (or would, with ``dry_run``)."""

    roots: dict[str, str] = field(default_factory=dict)
    """Checkpoint key -> what it names (the KVS's: ``rootseq N``)."""
    kept: int = 0
    kept_bytes: int = 0
    removed: int = 0
    removed_bytes: int = 0
    file_before: int = 0
    file_after: int = 0
    checkpoints_dropped: int = 0
    """The older KVS checkpoints dropped from the list (their trees went)."""
    dry_run: bool = False


TREE, DATA, MAYBE = "tree", "data", "maybe"
"""What a reference leads to: a tree object (must decode), a value's data
(never decoded: a user's bytes may look like anything), or a blob some
other checkpoint names (walked if it decodes, never required)."""


def reachable(get: Callable[[str], bytes | None], trees: Sequence[str],
              blobs: Sequence[str] = (),
              has: Callable[[str], bool] | None = None) -> set[str]:
    """Every blobref reachable from the tree objects ``trees`` and the
    blobs ``blobs`` (kept if present, walked if they decode as tree
    objects), read with ``get(ref) -> bytes | None``; ``has(ref)`` checks a
    value's data blob without reading it.  Raises :class:`GcError` when a
    blob the trees need is missing or a tree object does not decode, and
    when a blob read does not match its hash.

    A blob named both as a value's data and as a directory (a client may
    put either) is walked as the directory too."""
    if has is None:
        has = lambda ref: get(ref) is not None  # noqa: E731
    seen: set[str] = set()
    walked: set[str] = set()  # read as (possible) tree objects
    # The trees first (popped from the end): a subtree they share with a
    # blob walked as MAYBE would be walked once, as MAYBE, skipping what it
    # lacks -- damage under the trees never said
    todo = [(r, MAYBE) for r in blobs] + [(r, TREE) for r in trees]
    while todo:
        ref, kind = todo.pop()
        if kind == DATA:
            if ref not in seen:
                if not has(ref):
                    raise _damaged(f"blob {ref} is named but not in the store")
                seen.add(ref)
            continue
        if ref in walked:
            continue
        data = get(ref)
        if data is None:
            if kind == MAYBE:
                continue  # names nothing here: nothing to keep
            raise _damaged(f"blob {ref} is named but not in the store")
        if not blobref.matches(ref, data):
            # (walked as they are, its bytes would keep what they name and
            # not what the real blob names: that was deleted for good)
            raise _damaged(f"blob {ref} does not match its hash")
        seen.add(ref)
        walked.add(ref)
        try:
            obj = treeobj.decode(data)
        except ErrnoError as exc:
            if kind == TREE:
                raise _damaged(f"blob {ref} should be a tree object: {exc.errstr}") from None
            continue  # an opaque blob named by another checkpoint: kept, not walked
        for child, is_tree in treeobj.blobrefs(obj):
            if child not in walked:
                todo.append((child, MAYBE if kind == MAYBE else TREE if is_tree else DATA))
    return seen


class TreeDamaged(GcError):
    """A tree :func:`reachable` walks is not whole in the store."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} (the store is damaged; nothing was deleted)")
        self.what = what
        """What is wrong, without what it means to a collection."""


def _damaged(what: str) -> TreeDamaged:
    return TreeDamaged(what)


def _file_size(path: str) -> int:
    return sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))


COMPACT_FREE_FRACTION = 0.1
"""Compact when free pages are at least this share of the file -- also when
this run removed nothing: the compaction of a run that was interrupted (or
ran out of space) is still owed."""


def collect(statedir: str, *, dry_run: bool = False) -> GcReport:
    """Collect the garbage of the stopped instance whose statedir is ``statedir``."""
    path = os.path.join(statedir, STORE_FILE)
    if not os.path.isdir(statedir):
        raise GcError(f"statedir {statedir}: "
                      f"{'not a directory' if os.path.exists(statedir) else 'no such directory'}")
    if not os.path.exists(path):
        raise GcError(f"statedir {statedir} has no {STORE_FILE} (nothing to collect)")
    try:
        private_dir(statedir, "statedir")  # the owner's, as at start
    except StartError as exc:
        raise GcError(str(exc)) from None
    report = GcReport(dry_run=dry_run, file_before=_file_size(path))
    why = locks.unwritable(path)
    if why is not None and not dry_run:  # (a dry run only reads: it reads one there too)
        raise GcError(locks.cannot_write(path, why))
    try:
        store = open_to_read(path) if dry_run else SqliteStore(path)
    except StoreLocked:
        raise GcError(f"statedir {statedir} is in use by a running instance "
                      f"(its {STORE_FILE} is locked): stop it first") from None
    except (sqlite3.Error, OSError) as exc:
        raise _sqlite_error(path, exc) from None
    try:
        _collect(store, statedir, report)
    except (sqlite3.Error, OSError) as exc:
        raise _sqlite_error(path, exc) from None
    finally:
        store.close()
    report.file_after = _file_size(path)
    return report


def _collect(store: SqliteStore, statedir: str, report: GcReport) -> None:
    problem = store.check()
    if problem is not None:
        raise GcError(f"{STORE_FILE} is damaged ({problem}); nothing was deleted")
    trees: list[str] = []
    blobs: list[str] = []
    for key, raw, age in store.all_checkpoints():
        if key == CHECKPOINT_KEY and age > 0:
            continue  # the older KVS checkpoints go (below): only what the next start restores
        name = key if age == 0 else f"{key}, older {age}"
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several kinds, StackError has no text
            if key == CHECKPOINT_KEY:
                raise GcError(f"the checkpoint {key!r} does not decode: "
                              f"{str(exc) or type(exc).__name__}") from None
            report.roots[name] = "not msgpack: names nothing"
            continue
        if key == CHECKPOINT_KEY:
            if not (isinstance(value, dict) and blobref.is_valid(value.get("rootref"))):
                raise GcError(f"the checkpoint {key!r} is not a KVS root: {value!r:.200}")
            trees.append(value["rootref"])
            seq = rootseq_of(value)
            report.roots[name] = f"rootseq {seq}" if type(seq) is int else "rootseq unknown"
        else:
            refs = blobref.found_in(value)
            blobs += refs
            report.roots[name] = f"{len(refs)} blobref(s)"
    if CHECKPOINT_KEY not in report.roots:
        raise GcError(f"statedir {statedir} has no KVS checkpoint ({CHECKPOINT_KEY!r}): "
                      "a collection would delete everything (remove the directory to "
                      "start afresh)")
    keep = reachable(store.get, trees, blobs, has=store.has)
    # The older KVS checkpoints' trees are collected: they go from the list
    # too (as Flux's, whose collection restores the last one into a new store)
    older = [row_id for row_id, _ in store.checkpoint_history_rows(CHECKPOINT_KEY)]
    report.checkpoints_dropped = len(older)
    if not report.dry_run:
        store.drop_checkpoint_history(older)
    report.removed, report.removed_bytes = store.sweep(keep, dry_run=report.dry_run)
    report.kept, report.kept_bytes = store.totals()
    if report.dry_run:  # (nothing was deleted: what would be kept is the rest)
        report.kept -= report.removed
        report.kept_bytes -= report.removed_bytes
        return
    if store.free_bytes() >= COMPACT_FREE_FRACTION * _file_size(store.path):
        shortfall = store.compact_if_room()
        if shortfall is not None:  # (checked first: half-way, it filled the disk)
            raise GcError(f"{store.path}: no space left to compact: {shortfall}; the "
                          f"deletion stays done ({report.removed} blobs), and the next run "
                          "compacts once there is room")


def _sqlite_error(path: str, exc: BaseException) -> GcError:
    """A clear line for what SQLite or the file system refused."""
    why = locks.write_refused(exc)
    if why is not None:
        return GcError(locks.cannot_write(exc.filename if isinstance(exc, OSError) and exc.filename
                                    else path, why))
    if isinstance(exc, OSError):
        return GcError(f"{exc.filename or path}: {exc.strerror or exc}")
    text = str(exc)
    if "full" in text:
        return GcError(f"{path}: no space left ({text}): a collection needs free space "
                       "for a copy of what it keeps, in the statedir and in SQLite's "
                       "temporary directory; a deletion that completed stays done, and "
                       "the next run compacts")
    if "not a database" in text or "malformed" in text:
        return GcError(f"{path} is damaged ({text}); nothing was deleted")
    return GcError(f"{path}: {text}")


def describe(report: GcReport) -> str:
    """The report as ``kvbroker kvs gc`` prints it."""
    roots = ", ".join(f"{k} ({v})" for k, v in report.roots.items())
    verb = "would remove" if report.dry_run else "removed"
    file = (f"{size_text(report.file_before)} (a dry run compacts nothing)" if report.dry_run
            else f"{size_text(report.file_before)} -> {size_text(report.file_after)}")
    dropped = ""
    if report.checkpoints_dropped:
        n = report.checkpoints_dropped
        dropped = (f"{'would drop' if report.dry_run else 'dropped'} {n} older "
                   f"checkpoint{'' if n == 1 else 's'} of the KVS (their versions collected)\n")
    return (f"kept {_blobs(report.kept)} ({size_text(report.kept_bytes)}) "
            f"reachable from {roots}\n"
            f"{verb} {_blobs(report.removed)} ({size_text(report.removed_bytes)})\n"
            f"{dropped}{STORE_FILE}: {file}")


def _blobs(n: int) -> str:
    return f"{n:,} blob{'' if n == 1 else 's'}"


def size_text(n: int) -> str:
    """``n`` bytes for people: B, kB, MB or GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


__all__ = ["GcError", "GcReport", "collect", "describe", "reachable", "size_text"]
