"""``kvbroker kvs fsck``: is a KVS tree whole in the content store?  As
Flux's ``flux fsck``, a walk of one root -- a namespace's current root
through a running instance, or the checkpoint of a stopped instance's
statedir -- that loads every tree object and every value's blob, and says
which keys cannot be read whole, and why, instead of stopping at the first
(as a collection does: :func:`kvs.garbage.reachable`).

The check never writes (:func:`repair` does).  The walk goes a level of
the tree at a time, asking for all the blobs of a level at once
(:data:`Load` takes a list), so a running instance answers a few large
``content.load`` requests rather than one per blob.  A blob the store
does not have is *missing*; one it holds damaged (bytes that do not match
their hash: rank 0 answers ``EIO``) is *damaged*; a directory's blob that
does not decode as a directory is a damaged directory.  Each problem names
the key (``.`` the root) and, for a value, the position of each blob that
fails (``index=1``), as Flux's
``--verbose`` does.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from broker.errors import ErrnoError
from kvs import treeobj
from kvs.treeobj import TreeObj

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
    """A value's data blobs that could be read, in order (what ``--repair``
    keeps in ``lost+found``: of a long value, those of the groups and
    chunks that could be read); None for a directory."""
    dir: bool = False
    """A directory that cannot be read: ``--repair`` unlinks it, keeping
    nothing."""
    shard: bool = False
    """A shard of the big directory ``key`` (an ``hdir``'s) that cannot be
    read: ``--repair`` rebuilds the directory from its readable shards
    (:func:`kvs.shards.salvage`), rather than lose every entry with it."""


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
            shard = d.what == "hdir shard"
            if isinstance(got, int):
                _blob_problem(report, d.path, f"{d.what} blobref", [(None, d.ref)], got)
                report.problems[-1].dir = not shard
                report.problems[-1].shard = shard
                continue
            try:
                obj = treeobj.decode(got)
                kind = treeobj.typeof(obj)
                if kind not in ("dir", "hdir"):
                    raise ErrnoError(errno.EINVAL, f"a {kind}, not a directory")
            except ErrnoError as exc:
                report.problems.append(Problem(d.path, "damaged directory", [(None, d.ref)],
                                               exc.errstr or "", dir=not shard, shard=shard))
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
    chunks first, then all the data, in batches.  A key's problems all
    carry the data blobs of it that could be read (``readable``)."""
    refs_of: dict[str, list[str]] = {}
    of_key: dict[str, list[Problem]] = {}
    for key, entry in values:
        before = len(report.problems)
        refs_of[key] = await _value_refs(load, key, entry, report)
        if len(report.problems) > before:
            of_key[key] = report.problems[before:]
    wanted = list(dict.fromkeys(ref for refs in refs_of.values() for ref in refs))
    blobs = await _load(load, wanted, report)
    for key, refs in refs_of.items():
        bad: dict[int, list[tuple[int | None, str]]] = {}
        for i, ref in enumerate(refs):
            got = blobs[ref]
            if isinstance(got, int):
                bad.setdefault(got, []).append((i, ref))
        for errnum, at in sorted(bad.items()):
            _blob_problem(report, key, "blobref(s)", at, errnum)
            of_key.setdefault(key, []).append(report.problems[-1])
        readable = [ref for ref in refs if isinstance(blobs[ref], bytes)]
        for problem in of_key.get(key, []):
            problem.readable = readable


async def _value_refs(load: Load, key: str, entry: TreeObj, report: Report) -> list[str]:
    """The blobrefs of a value's data, in order, its groups and chunks
    loaded (a ``vtree``).  A group or chunk that cannot be read (or is not
    of its form) is reported and left out, with the blobs it names: what
    remains is what ``--repair`` can keep."""
    if entry["type"] != "vtree":
        return list(treeobj.value_refs(entry, lambda ref: None))
    index, chunks, tail = treeobj.vtree_parts(entry)
    failed: list[tuple[int | None, str]] = []
    failed_errno = errno.ENOENT
    wrong: list[str] = []

    async def members(refs: list[str], of: Callable[[str, TreeObj | None], list[str]]
                      ) -> list[str]:
        nonlocal failed_errno
        blobs = await _load(load, refs, report)
        out: list[str] = []
        for ref in refs:
            data = blobs[ref]
            if isinstance(data, int):
                failed.append((None, ref))
                failed_errno = data if failed_errno == errno.ENOENT else failed_errno
                continue
            try:
                out += of(ref, treeobj.decode(data))
            except ErrnoError as exc:  # a group or chunk of the wrong form
                wrong.append(exc.errstr or ref)
        return out

    group_chunks = await members(list(index), treeobj.group_chunks)
    refs = await members([*group_chunks, *chunks], treeobj.chunk_refs)
    if failed:
        _blob_problem(report, key, "blobref(s)", failed, failed_errno)
    if wrong:
        report.problems.append(Problem(key, "damaged value", [], "; ".join(wrong)))
    return refs + list(tail)


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


JOB_DIR = re.compile(r"job(\.[0-9a-fA-F]{4}){4}\.")
"""A key inside a job's directory (``job.0123.4567.89ab.cdef.KEY``, Flux's
KVS job path: ``--job-aware``)."""


def job_dir_of(key: str) -> str | None:
    """The job directory ``key`` is inside (``job.0123.4567.89ab.cdef``),
    or None."""
    found = JOB_DIR.match(key)
    return found.group(0)[:-1] if found else None


@dataclass
class Rebuilt:
    """A big directory :func:`repair` rebuilt without its unreadable shards."""

    key: str
    lost: int
    """Entries lost with them (counted: their names were in the lost blobs)."""
    shards: int
    """Shards that could not be read."""


@dataclass
class Repair:
    rootref: str
    rootseq: int
    moved: list[str]
    """Damaged values kept as ``lost+found.KEY`` (Flux's repairs): their
    blobs that could be read, or an empty value if none could."""
    unlinked: list[str]
    """Directories unlinked, nothing kept (they cannot be listed)."""
    jobs: list[str] = field(default_factory=list)
    """Job directories moved whole to ``lost+found`` (``--job-aware``)."""
    rebuilt: list[Rebuilt] = field(default_factory=list)
    """Big directories rebuilt from the shards of them that could be read."""


def repair(store: Any, checkpoint: dict[str, Any], report: Report, *,
           job_aware: bool = False) -> Repair:
    """Offline, the instance stopped (its kvs cannot write meanwhile, as
    Flux's ``fsck --repair`` asks the kvs unloaded): unlink every key
    ``report`` names from the checkpoint's tree, keeping a damaged value
    as ``lost+found.KEY`` (the blobs of it that could be read, in order; an
    empty value if none could), as Flux's does; a directory that cannot be
    read is only unlinked.  With ``job_aware`` a job directory holding a
    damaged key moves whole to ``lost+found`` (``lost+found.job.…``, its
    damaged values as above).  A big directory (an ``hdir``) with shards
    that cannot be read is not unlinked but rebuilt from the entries of the
    shards that can (:func:`_rebuild`): one lost shard loses ~1/16 of its
    entries, not all of them.  The KVS engine applies it (two transactions
    with ``job_aware``: the job directories are moved as the first left
    them); the new blobs are stored and the new root made the checkpoint,
    at the next version (the damaged one stays the checkpoint before it:
    ``kvs checkpoint update`` takes it back).  A root that cannot be read
    cannot be repaired (``ValueError``); a big root that lost shards is
    rebuilt as any big directory."""
    import time

    import msgpack

    from kvs import lookup, txn
    from kvs.checkpoints import UNLIMITED
    from kvs.namespaces import CHECKPOINT_KEY, rootseq_of

    by_key: dict[str, Problem] = {}
    for problem in report.problems:
        if problem.key == "." and not problem.shard:
            raise ValueError("the root directory itself cannot be read: nothing to repair "
                             "from (kvs checkpoint list; update to an older root)")
        if not problem.shard:
            by_key.setdefault(problem.key, problem)
    sharded = list(dict.fromkeys(p.key for p in report.problems if p.shard))
    jobs = (list(dict.fromkeys(j for j in map(job_dir_of, [*by_key, *sharded]) if j))
            if job_aware else [])

    def kept(problem: Problem) -> dict[str, Any]:
        return {"key": f"{LOST_FOUND}.{problem.key}", "flags": 0,
                "dirent": treeobj.valref(problem.readable) if problem.readable
                else treeobj.val(b"")}

    rootref = str(checkpoint["rootref"])
    hash_name = rootref.partition("-")[0]

    def apply(root: str, ops: list[dict[str, Any]]) -> str:
        result = txn.apply(store, root, ops, hash_name=hash_name, namespace="primary")
        store.put_many(result.new_blobs.items())
        return result.rootref

    moved = [k for k, p in by_key.items() if not p.dir]
    in_job = {k for k in moved if job_dir_of(k) in jobs}
    root, ops, rebuilt = _rebuild(store, rootref, sharded, hash_name)
    ops += [{"key": key, "flags": 0, "dirent": None} for key in by_key]
    ops += [kept(by_key[k]) for k in moved if k not in in_job]
    root = apply(root, ops)
    if jobs:  # each job's directory as the unlinks left it, then its values kept
        ops = []
        for job in jobs:
            entry = lookup.lookup(store, root, job, lookup.TREEOBJ, namespace="primary")
            if entry is not None:
                ops += [{"key": f"{LOST_FOUND}.{job}", "flags": 0, "dirent": entry},
                        {"key": job, "flags": 0, "dirent": None}]
        ops += [kept(by_key[k]) for k in moved if k in in_job]
        root = apply(root, ops)
    value = dict(checkpoint)
    old = rootseq_of(checkpoint)
    value.update({"rootref": root, "rootseq": (old if type(old) is int else 0) + 1,
                  "timestamp": time.time()})
    value.pop("sequence", None)  # (Flux's name for rootseq: rootseq says it now)
    store.checkpoints_kept = UNLIMITED
    store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb(value, use_bin_type=True))
    store.sync()
    return Repair(root, value["rootseq"], moved, [k for k, p in by_key.items() if p.dir],
                  jobs, rebuilt)


def _rebuild(store: Any, rootref: str, keys: list[str], hash_name: str
             ) -> tuple[str, list[dict[str, Any]], list[Rebuilt]]:
    """The big directories ``keys`` (``.`` the root) rebuilt from the
    entries of their readable shards, their blobs stored: the root to apply
    the repair to (a new one if it was rebuilt), the operations that put
    the others in place (parents first, so a rebuilt directory inside a
    rebuilt one lands in the new one), and what each lost.  Each is read
    at ``rootref``, as the check found it; a blob stored damaged is as
    unreadable as a missing one (the check named both)."""
    from kvs import lookup, shards
    from kvs.archive import CheckedStore
    from kvs.treeobj import BlobCache, BlobWriter

    cache = BlobCache(CheckedStore(store))
    writer = BlobWriter(hash_name)
    root = rootref
    ops: list[dict[str, Any]] = []
    rebuilt: list[Rebuilt] = []
    for key in sorted(keys, key=lambda k: (k != ".", k.count("."), k)):
        if key == ".":
            top = cache.need_obj(rootref)
        else:
            entry = lookup.lookup(cache, rootref, key, lookup.TREEOBJ, namespace="primary")
            if entry is None:
                raise ValueError(f"{key}: not found again to rebuild")
            top = cache.need_obj(entry["data"][0]) if entry["type"] == "dirref" else entry
        ents, lost = shards.salvage(cache, top)
        ref = writer.put_obj(shards.make_dir(ents, writer))
        if key == ".":
            root = ref
        else:
            ops.append({"key": key, "flags": 0, "dirent": treeobj.dirref(ref)})
        rebuilt.append(Rebuilt(key, sum(part.count for part in lost),
                               sum(len(part.refs) for part in lost)))
    store.put_many(writer.blobs.items())
    return root, ops, rebuilt


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
