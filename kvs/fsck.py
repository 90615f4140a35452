"""``kvbroker kvs fsck``: is a KVS tree whole in the content store?  As
Flux's ``flux fsck``, a walk of one root -- a namespace's current root
through a running instance, or the checkpoint of a stopped instance's
statedir -- that loads every tree object and every value's blob, and says
which keys cannot be read whole, and why, instead of stopping at the first
(as a collection does: :func:`kvs.garbage.reachable`).

It never writes.  The walk goes a level of the tree at a time, asking for
all the blobs of a level at once (:data:`Load` takes a list), so a running
instance answers a few large ``content.load`` requests rather than one per
blob.  A blob the store does not have is *missing*; one it holds damaged
(bytes that do not match their hash: rank 0 answers ``EIO``) is
*damaged*; a directory's blob that does not decode as a directory is a
damaged directory.  Each problem names the key (``.`` the root) and, for a
value, the position of each blob that fails (``index=1``), as Flux's
``--verbose`` does.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from broker.errors import ErrnoError
from kvs import treeobj
from kvs.treeobj import NeedBlobs, TreeObj

Load = Callable[[list[str]], Awaitable[dict[str, bytes | int]]]
"""Blobs by blobref: the bytes, or an errno (``ENOENT`` missing, ``EIO``
damaged); every blobref asked for is in the answer."""

BATCH = 1024
"""Blobrefs asked for at once (a ``content.load`` takes 4,096 at most)."""


@dataclass
class Problem:
    """What keeps ``key`` from being read whole."""

    key: str
    what: str
    """``missing blobref(s)``, ``missing dirref blobref``, ``missing hdir
    shard blobref(s)``, ``damaged blob(s)``, ``damaged directory``..."""
    refs: list[tuple[int | None, str]] = field(default_factory=list)
    """The blobs at fault, each with its position in the value (None for a
    directory's, a shard's, or a long value's group or chunk)."""
    detail: str = ""
    readable: list[str] | None = None
    """A value's blobs that could be read, in order (what ``--repair``
    keeps in ``lost+found``); None for a directory, or a long value whose
    groups or chunks could not be read."""


@dataclass
class Report:
    problems: list[Problem] = field(default_factory=list)
    keys: int = 0
    """Values and links checked."""
    dirs: int = 0
    blobs: int = 0
    """Blobs loaded (tree objects and values' data)."""


@dataclass
class _Dir:
    path: str  # the directory's key ("." for the root)
    ref: str
    what: str  # how to name it missing: "dirref", "root", "hdir shard"


async def check(load: Load, rootref: str,
                on_key: Callable[[str], None] | None = None) -> Report:
    """Walk the tree whose root directory is blob ``rootref``: every key,
    reported to ``on_key`` as it is checked (``--verbose``)."""
    report = Report()
    level = [_Dir(".", rootref, "root")]
    while level:
        blobs = await _load(load, [d.ref for d in level], report)
        values: list[tuple[str, TreeObj]] = []
        deeper: list[_Dir] = []
        for d in level:
            got = blobs[d.ref]
            if isinstance(got, int):
                _blob_problem(report, d.path, f"{d.what} blobref", [(None, d.ref)], got)
                continue
            try:
                obj = treeobj.decode(got)
                kind = treeobj.typeof(obj)
                if kind not in ("dir", "hdir"):
                    raise ErrnoError(errno.EINVAL, f"a {kind}, not a directory")
            except ErrnoError as exc:
                report.problems.append(Problem(d.path, "damaged directory", [(None, d.ref)],
                                               exc.errstr or ""))
                continue
            if kind == "hdir":
                deeper += [_Dir(d.path, ref, "hdir shard")
                           for ref in obj["data"]["shards"].values()]
                continue
            report.dirs += 1
            _entries(d.path, obj, report, values, deeper, on_key)
        await _check_values(load, values, report)
        level = deeper
    return report


def _entries(path: str, obj: TreeObj, report: Report, values: list[tuple[str, TreeObj]],
             deeper: list[_Dir], on_key: Callable[[str], None] | None) -> None:
    """Sort a directory's entries: values to check, directories to walk."""
    for name, entry in sorted(obj["data"].items()):
        key = name if path == "." else f"{path}.{name}"
        if on_key is not None:
            on_key(key)
        kind = entry["type"]
        if kind == "dirref":
            deeper.append(_Dir(key, entry["data"][0], "dirref"))
        elif kind == "dir":  # (an inline directory: walked here)
            report.dirs += 1
            _entries(key, entry, report, values, deeper, on_key)
        elif kind == "hdir":
            deeper += [_Dir(key, ref, "hdir shard") for ref in entry["data"]["shards"].values()]
        else:
            report.keys += 1
            if kind in ("valref", "vtree"):
                values.append((key, entry))


async def _check_values(load: Load, values: list[tuple[str, TreeObj]], report: Report) -> None:
    """Every blob of ``values`` (a level's): a long value's groups and
    chunks first, then all the data, in batches."""
    refs_of: dict[str, list[str]] = {}
    for key, entry in values:
        refs = await _value_refs(load, key, entry, report)
        if refs is not None:
            refs_of[key] = refs
    wanted = list(dict.fromkeys(ref for refs in refs_of.values() for ref in refs))
    blobs = await _load(load, wanted, report)
    for key, refs in refs_of.items():
        bad: dict[int, list[tuple[int | None, str]]] = {}
        for i, ref in enumerate(refs):
            got = blobs[ref]
            if isinstance(got, int):
                bad.setdefault(got, []).append((i, ref))
        readable = [ref for ref in refs if isinstance(blobs[ref], bytes)]
        for errnum, at in sorted(bad.items()):
            _blob_problem(report, key, "blobref(s)", at, errnum)
            report.problems[-1].readable = readable


async def _value_refs(load: Load, key: str, entry: TreeObj,
                      report: Report) -> list[str] | None:
    """The blobrefs of a value, its groups and chunks loaded (a ``vtree``);
    None, with the problem reported, when one of those cannot be read."""
    objs: dict[str, TreeObj] = {}
    while True:
        try:
            return treeobj.value_refs(entry, objs.get)
        except NeedBlobs as need:
            refs = list(need.refs)
        except ErrnoError as exc:  # a group or chunk of the wrong form
            report.problems.append(Problem(key, "damaged value", [], exc.errstr or ""))
            return None
        blobs = await _load(load, refs, report)
        failed: list[tuple[int | None, str]] = [
            (None, ref) for ref in refs if isinstance(blobs[ref], int)]
        if failed:
            errnum = next(b for b in blobs.values() if isinstance(b, int))
            _blob_problem(report, key, "blobref(s)", failed, errnum)
            return None
        for ref in refs:
            data = blobs[ref]
            assert isinstance(data, bytes)
            try:
                objs[ref] = treeobj.decode(data)
            except ErrnoError as exc:
                report.problems.append(Problem(key, "damaged value", [(None, ref)],
                                               exc.errstr or ""))
                return None


def _blob_problem(report: Report, key: str, noun: str, refs: list[tuple[int | None, str]],
                  errnum: int) -> None:
    what = "missing" if errnum == errno.ENOENT else "damaged"
    if errnum not in (errno.ENOENT, errno.EIO):
        what = f"unreadable ({errno.errorcode.get(errnum, errnum)})"
    report.problems.append(Problem(key, f"{what} {noun}", refs))


async def _load(load: Load, refs: Iterable[str], report: Report) -> dict[str, bytes | int]:
    out: dict[str, bytes | int] = {}
    todo = list(dict.fromkeys(refs))
    for start in range(0, len(todo), BATCH):
        out.update(await load(todo[start:start + BATCH]))
    report.blobs += sum(1 for v in out.values() if isinstance(v, bytes))
    return out


def describe(problem: Problem, verbose: bool) -> list[str]:
    """``problem`` as lines: ``KEY: missing blobref(s)``, and with
    ``verbose`` one line per blob (``KEY: missing blobref index=1 REF``)."""
    lines = [f"{problem.key}: {problem.what}" + (f" ({problem.detail})" if problem.detail
                                                   else "")]
    if verbose:
        single = problem.what.replace("(s)", "")
        for index, ref in problem.refs:
            where = f" index={index}" if index is not None else ""
            lines.append(f"{problem.key}: {single}{where} {ref}")
    return lines


LOST_FOUND = "lost+found"
"""Where ``--repair`` keeps what could be read of a damaged value, as
Flux's fsck does: ``lost+found.KEY``."""


@dataclass
class Repair:
    rootref: str
    rootseq: int
    moved: list[str]
    """Keys whose readable blobs went to ``lost+found.KEY``."""
    unlinked: list[str]


def repair(store: Any, checkpoint: dict[str, Any], report: Report) -> Repair:
    """Offline, the instance stopped (its kvs cannot write meanwhile, as
    Flux's ``fsck --repair`` asks the kvs unloaded): unlink every key
    ``report`` names from the checkpoint's tree, keeping a damaged value's
    readable blobs as ``lost+found.KEY``, in one transaction of the KVS
    engine; store the new blobs and make the new root the checkpoint, at
    the next version (the damaged one stays as the checkpoint before it:
    ``kvs checkpoint update`` takes it back).  A damaged root cannot be
    repaired (``ValueError``)."""
    import time

    import msgpack

    from kvs import txn
    from kvs.checkpoints import UNLIMITED
    from kvs.namespaces import CHECKPOINT_KEY, rootseq_of

    by_key: dict[str, Problem] = {}
    for problem in report.problems:
        if problem.key == ".":
            raise ValueError("the root directory itself cannot be read: nothing to repair "
                             "from (kvs checkpoint list; update to an older root)")
        by_key.setdefault(problem.key, problem)
    ops: list[dict[str, Any]] = []
    moved = []
    for key, problem in by_key.items():
        if problem.readable:
            ops.append({"key": f"{LOST_FOUND}.{key}", "flags": 0,
                        "dirent": treeobj.valref(problem.readable)})
            moved.append(key)
        ops.append({"key": key, "flags": 0, "dirent": None})
    rootref = str(checkpoint["rootref"])
    result = txn.apply(store, rootref, ops, hash_name=rootref.partition("-")[0],
                       namespace="primary")
    store.put_many(result.new_blobs.items())
    value = dict(checkpoint)
    old = rootseq_of(checkpoint)
    value.update({"rootref": result.rootref, "rootseq": (old if type(old) is int else 0) + 1,
                  "timestamp": time.time()})
    value.pop("sequence", None)  # (Flux's name for rootseq: rootseq says it now)
    store.checkpoints_kept = UNLIMITED
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb(value, use_bin_type=True))
    store.sync()
    return Repair(result.rootref, value["rootseq"], moved, list(by_key))


def from_store(store: Any) -> Load:
    """A :data:`Load` of a stopped instance's SQLite store (its
    :class:`broker.content.sqlite.SqliteStore`): a blob whose bytes do not
    match their blobref is damaged, as rank 0 would answer it."""
    from broker.content import blobref

    async def load(refs: list[str]) -> dict[str, bytes | int]:
        out: dict[str, bytes | int] = {}
        for ref in refs:
            data = store.get(ref)
            if data is None:
                out[ref] = errno.ENOENT
            elif blobref.hash_blob(data, ref.partition("-")[0]) != ref:
                out[ref] = errno.EIO
            else:
                out[ref] = data
        return out

    return load
