"""The KVS checkpoints an instance keeps, listed and rolled back.

Rank 0's content store keeps the primary namespace's checkpoint and the
ones it replaced, ``content.max-checkpoints`` in all (5, as Flux's
content-sqlite), newest first.  Each names a whole tree, until a garbage
collection deletes it: an online one drops the older checkpoints past
``kvs.gc-grace`` (:func:`kvs.collect.stale_checkpoints`), an offline one
all of them (:mod:`kvs.garbage`), as Flux's keeps only the last.  They are
what a damaged or unwanted newest root is rolled back to:

* :func:`list_offline` reads them from a *stopped* instance's statedir (a
  running one answers ``content.checkpoint-list``: :meth:`KVS.checkpoints
  <kvs.client.KVS.checkpoints>`);
* :func:`update_offline` makes a root the checkpoint the next start
  resumes from, as ``flux content checkpoint update``, after checking that
  its whole tree is in the store.  The checkpoint it replaces is kept as
  the newest older one, so the rollback can itself be undone.

Offline only, because the running kvs module owns the checkpoint: Flux
asks for its kvs module to be unloaded first, and here a module is not
unloaded while its rank runs.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack

from broker.content import blobref
from broker.content.module import checkpoint_or_none
from kvs import treeobj
from kvs.archive import ArchiveError, open_stopped_store
from kvs.garbage import TreeDamaged, reachable
from kvs.namespaces import CHECKPOINT_KEY, rootseq_of

__all__ = ["Checkpoint", "UpdateReport", "format_table", "list_offline", "update_offline"]

UNLIMITED = 1 << 30
"""History kept by an offline update: none pruned.  The instance's own
``content.max-checkpoints`` is not known here; its next checkpoint prunes."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of the primary namespace, as stored."""

    rootref: str | None
    """The root directory's blobref (None: a value that is not a KVS root,
    which the instance owner could write with ``content.checkpoint-put``)."""
    rootseq: int | None
    """The namespace's version at that root."""
    timestamp: float | None
    """When it was written (seconds since the epoch)."""
    value: Any = field(repr=False, compare=False)
    """The whole stored value (with its ``leases``, if any)."""

    @classmethod
    def from_value(cls, value: Any) -> Checkpoint:
        if not isinstance(value, dict):
            return cls(None, None, None, value)
        ref = value.get("rootref")
        seq = rootseq_of(value)
        stamp = value.get("timestamp")
        return cls(ref if blobref.is_valid(ref) else None,
                   seq if type(seq) is int else None,
                   float(stamp) if isinstance(stamp, (int, float))
                   and math.isfinite(stamp) else None,
                   value)

    def as_json(self) -> str:
        """The stored value as one line of JSON (bytes as text, if any)."""
        return json.dumps(_finite(self.value), separators=(",", ":"), sort_keys=True,
                          allow_nan=False, default=lambda v: v.decode("utf-8", "replace")
                          if isinstance(v, bytes) else repr(v))


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity as ``None`` (JSON has neither:
    ``-j`` printed ``NaN``, which no JSON reader takes)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def format_table(checkpoints: list[Checkpoint], *, header: bool = True) -> list[str]:
    """``content checkpoint list``'s lines, as Flux prints them: index (0 the
    current one), sequence, UTC time, rootref; ``-`` for what a value lacks.
    A ``rootref`` that is not a blobref is shown as stored (as Flux does),
    quoted if it holds spaces or unprintable characters, cut at 80."""
    lines = [f"{'Index':<10} {'Sequence':<10} {'Time':<20} Rootref"] if header else []
    for index, cp in enumerate(checkpoints):
        when = "-" if cp.timestamp is None else _utc(cp.timestamp)
        seq = "-" if cp.rootseq is None else str(cp.rootseq)
        lines.append(f"{index:<10} {seq:<10} {when:<20} {cp.rootref or _stored_rootref(cp)}")
    return lines


def _utc(stamp: float) -> str:
    """``stamp`` as UTC time, or ``-`` for one no calendar holds (a damaged
    or hand-written value, ``1e300``: the listing failed with a traceback)."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))
    except (OverflowError, OSError, ValueError):
        return "-"


def _stored_rootref(cp: Checkpoint) -> str:
    """What a checkpoint that names no root holds as its ``rootref``, or ``-``."""
    ref = cp.value.get("rootref") if isinstance(cp.value, dict) else None
    if not isinstance(ref, str) or not ref:
        return "-"
    if ref.isprintable() and not any(c.isspace() for c in ref) and len(ref) <= 80:
        return ref
    shown = repr(ref)
    return shown if len(shown) <= 80 else f"{shown[:38]}...{shown[-39:]}"


def list_offline(statedir: str) -> list[Checkpoint]:
    """The checkpoints of the stopped instance whose statedir is
    ``statedir``, newest first (``ArchiveError`` if it cannot be read)."""
    with open_stopped_store(statedir, create=False, instead="stop it first, or list "
                            "online (without --statedir)", read_only=True) as store:
        return [Checkpoint.from_value(checkpoint_or_none(raw))
                for raw in store.checkpoint_list(CHECKPOINT_KEY)]


@dataclass(frozen=True)
class UpdateReport:
    """What :func:`update_offline` did."""

    checkpoint: Checkpoint
    """The new current checkpoint."""
    previous: Checkpoint | None
    """The one it replaced (kept as the newest older one), if any."""
    changed: bool
    """False: ``rootref`` was the current checkpoint already."""
    blobs: int
    """Blobs of its tree, all found in the store."""


def update_offline(statedir: str, rootref: str) -> UpdateReport:
    """Make ``rootref`` the checkpoint the stopped instance whose statedir is
    ``statedir`` resumes from.  Refused (``ArchiveError``, nothing written)
    unless it is a directory whose whole tree is in the store.  A root one
    of the kept checkpoints names comes back at its version (``rootseq``),
    with the leases kept with it; any other root at version 0, as Flux's
    ``checkpoint update`` and ``restore --checkpoint``."""
    if not blobref.is_valid(rootref):
        raise ArchiveError(f"{rootref!r} is not a blobref (HASH-HEX, as checkpoint list "
                           "prints them)")
    with open_stopped_store(statedir, create=False, instead="stop it first (its kvs "
                            "module owns the checkpoint)") as store:
        kept = [Checkpoint.from_value(checkpoint_or_none(raw))
                for raw in store.checkpoint_list(CHECKPOINT_KEY)]
        current = kept[0] if kept else None
        if current is not None and current.rootref == rootref:
            return UpdateReport(current, None, False, 0)
        data = store.get(rootref)
        if data is None:
            raise ArchiveError(f"root {rootref} is not in the content store")
        try:
            kind = treeobj.typeof(treeobj.decode(data))
        except Exception as exc:  # (ErrnoError, or what a garbled blob raises)
            raise ArchiveError(f"root {rootref} is not a tree object: {exc}") from None
        if kind not in ("dir", "hdir"):
            raise ArchiveError(f"root {rootref} is a {kind} tree object, not a directory")
        try:
            blobs = len(reachable(store.get, [rootref], has=store.has))
        except TreeDamaged as exc:
            raise ArchiveError(f"root {rootref}'s tree is not whole in the content store "
                               f"({exc.what}): a start there could not read it") from None
        same = next((cp for cp in kept if cp.rootref == rootref), None)
        value: dict[str, Any] = {"rootref": rootref, "rootseq": 0}
        if same is not None and isinstance(same.value, dict):
            value.update({k: v for k, v in same.value.items() if k in ("rootseq", "leases")})
        value["timestamp"] = time.time()
        store.checkpoints_kept = UNLIMITED
        store.checkpoint_put(CHECKPOINT_KEY, msgpack.packb(value, use_bin_type=True))
        return UpdateReport(Checkpoint.from_value(value), current, True, blobs)


