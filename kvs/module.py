"""The ``kvs`` module: the key-value store on every rank, rank 0 the leader.

Reads (``kvs.lookup``, ``kvs.lookup-plus``, ``kvs.getroot``) are served by
the client's own rank from its namespace roots and blob cache; missing blobs
come from the ``content`` module.  Writes (``kvs.commit``) travel to rank 0
(``kvs.relaycommit``), which queues them per namespace, **merges** adjacent
ready transactions with equal flags (a failed merge is split and replayed),
applies them with the I/O-free engine :mod:`kvs.txn`, stores the new blobs,
and publishes ``kvs.namespace-<NS>-setroot``.  A follower answers its client
once it has applied the setroot naming the transaction (read-your-writes);
:mod:`kvs.relay` is that road.

This module is the RPC surface: it checks requests and access, and owns the
namespaces, their events, checkpoints and garbage collections.  The work is
done by one object per job, wired together in :meth:`KvsModule.__init__`:

* :mod:`kvs.blobs` -- the blob LRU and the loads that fill it (every read);
* :mod:`kvs.commits` -- rank 0's commit pipeline: queue, merge, apply,
  store, set the root, publish;
* :mod:`kvs.refcheck` -- rank 0's check that the blobs a commit names by
  reference exist, whole;
* :mod:`kvs.relay` -- a follower's road to rank 0;
* :mod:`kvs.namespaces`, :mod:`kvs.collect` -- namespace state, online
  garbage collection.

Events (docs/protocol.md, Namespace events): every rank's kvs subscribes
once, at start, to ``kvs.namespace-`` and drops the events of namespaces it
does not follow.  A follower handles setroot, removed and error for the
namespaces it has loaded, and remembers the namespaces it hears created
(:class:`~kvs.namespaces.Heard`): kvs-watch's ``WAITCREATE`` watches start
from them without a ``kvs.getroot`` to rank 0, and their setroots' blobs
are cached for the reads that follow; rank 0 made the events and drops
created.  All of it is counted in ``kvs.stats-get``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import reprlib
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Iterable
from itertools import islice
from typing import Any, ClassVar

from broker import codec, malloc, startlog, topology
from broker.agemarks import expire_seconds, restart_expiry
from broker.attrs import CONTENT_HASH, LINK_MAX_MESSAGE, AttrSpec, boolean, duration, integer
from broker.content import blobref
from broker.content.kvsroot import is_kvs_root
from broker.content.module import BLOB_SIZE_LIMIT, FAILURE_LOG_EVERY, ContentModule
from broker.errors import (
    ErrnoError,
    LastFailure,
    LastingFault,
    ProtocolError,
    RemoteError,
    outcome_read,
)
from broker.logring import LogThrottle
from broker.message import Message, MsgFlags, RawPayload
from broker.module import Handler, Module, require
from broker.services import BrokerServices
from broker.tally import add_count
from kvs import collect as collector
from kvs import diff as diff_engine
from kvs import lookup as lookup_engine
from kvs import treeobj, txn
from kvs.blobs import BLOB_CACHE_BYTES, BlobFetcher, BlobStore
from kvs.commits import CommitPipeline
from kvs.keys import MAX_NS_NAME, check_key, shown
from kvs.leases import MAX_LEASES, Lease, LeaseTable
from kvs.namespaces import (
    CHECKPOINT_KEY,
    EVENT_PREFIX,
    NAME_RULE,
    PRIMARY,
    Heard,
    Namespace,
    NamespaceRemoved,
    RecentRoots,
    check_name,
    event_topic_parts,
    list_chunks,
    rootseq_of,
    shown_name,
)
from kvs.refcheck import RefChecker
from kvs.relay import RelayOutbox, from_rank_0
from kvs.shards import names_a_directory
from kvs.txn import EXPECT, MAX_OPS, NO_MERGE

UNLINK_RETRY_MIN = 0.1
UNLINK_RETRY_MAX = 10.0
"""Seconds between tries of an ended lease's failed unlinks (doubling from
the first to the second): soon after a brief failure, and no more than a
commit every 10 s while the cause lasts (a full disk)."""
STOP_DRAIN_TIMEOUT = 10.0
"""Seconds rank 0's kvs waits at stop for the transactions already queued."""
EVENT_KINDS = ("setroot", "removed", "error", "created")
SETROOT_BLOB_LIMIT = 8 << 10
"""A setroot event carries the commit's new blobs when they total at most this:
a small commit's few tree levels, which saves a follower that reads the new
tree (a watcher) a ``content.load`` per level.  A batch of merged commits into
big directories writes tens of KB, which every rank then decodes and stores
whether it reads them or not: W2p ran ~10% faster at 8 KiB than at 64 KiB,
and W4's watch latency did not move (docs/performance.md, item 13)."""
CACHE_BYTES = AttrSpec(
    "kvs.cache-bytes", str(BLOB_CACHE_BYTES), integer(0),
    "per-rank kvs blob cache size (bytes); also bounds its decoded tree objects")
CACHE_EXPIRE = AttrSpec(
    "kvs.cache-expire", "10s", expire_seconds,
    "kvs blobs and decoded tree objects unused this long are forgotten (a duration; "
    "0: only when kvs.cache-bytes is reached)")
"""Flux's kvs module expires its cache entries unused for 10 s (at each
heartbeat): an idle follower gives back what a burst of reads brought in,
instead of keeping its caches full for as long as it lives
(:mod:`broker.agemarks`).  A read after that loads again from this rank's
content cache (which keeps its most recent ``content.cache-keep-bytes``)
or from upstream."""
SETROOT_LIMIT = AttrSpec(
    "kvs.setroot-blob-limit", str(SETROOT_BLOB_LIMIT), integer(0, "", 64 << 20),
    "a setroot event carries the commit's new blobs up to this total (bytes)")
MAX_GUEST_WAITS = AttrSpec(
    "kvs.max-waits-per-guest", "10000", integer(1),
    "one guest user's kvs.wait-version requests waiting on a rank, over all its "
    "connections; one more is refused with ENOSPC")
"""A wait holds a task on the rank until its version comes (a kilobyte or
two): as ``kvs-watch.max-watches-per-guest`` for watches, a guest may not
grow a rank without bound with them.  The instance owner is not capped."""
TRANSACTION_MERGE = AttrSpec(
    "kvs.transaction-merge", "true", boolean,
    "rank 0 applies concurrent commits of a namespace with the same flags as one "
    "new root (false: one root per commit, as if every commit were NO_MERGE)")
"""Flux's kvs module option ``transaction-merge`` (t1003): off, a watcher sees
one new value per commit, at the price of one root, one setroot event and
one tree update per commit."""
MIN_CHECKPOINT_PERIOD = 0.01
"""The shortest checkpoint period but 0 (never), in seconds: rank 0 wakes
once a period, changed or not, so a nanosecond kept it at 100% of a CPU
while idle (as ``heartbeat.period``'s bound)."""


def checkpoint_period(value: Any) -> float:
    """0, or a duration of at least :data:`MIN_CHECKPOINT_PERIOD` seconds."""
    seconds = duration(value)
    if 0 < seconds < MIN_CHECKPOINT_PERIOD:
        raise ValueError(f"{value!r} is under {MIN_CHECKPOINT_PERIOD:g}s (rank 0 would wake "
                         "that often, changed or not: a busy loop); 0 checkpoints only at "
                         "a clean stop and by SYNC commits")
    return seconds


RELAY_SETTLE_TIMEOUT = AttrSpec(
    "kvs.relay-settle-timeout", "5s", duration,
    "a follower's kvs at stop waits this long for rank 0 to settle the commits it "
    "relayed, answering them as without the stop")
"""Seconds a follower's kvs waits at stop (a ``module reload`` or
``remove``, or its rank's stop) for the events that settle the
transactions it relayed to rank 0.  Rank 0 applies a queued one whatever
this rank does: its client was answered ``ENOSYS`` ("module kvs was
removed"), read as not applied, retried -- and applied twice.  It is
answered from its event instead, as without the stop; one still unsettled
then ends ``ETIMEDOUT``, "it may yet be applied"."""

CHECKPOINT_PERIOD = AttrSpec(
    "kvs.checkpoint-period", "1s", checkpoint_period,
    "rank 0 with a statedir checkpoints the primary root this often when it "
    "changed (0: only at a clean stop and by SYNC commits; else at least 10ms)")
"""Flux's ``kvs.checkpoint-period`` (off there by default).  Blobs reach SQLite
within ``content.FLUSH_DELAY``; without a checkpoint naming the new root a
crash of rank 0 loses every commit since the last one.  1 s bounds that loss
for the cost of one SQLite transaction and fsync a second while the primary
namespace changes, and nothing while it does not."""


COUNTERS = ("commits", "batches", "merged", "merges-split", "commits-failed", "relays",
            "relayed", "commits-relayed-again", "lookups", "lookups-after", "diffs",
            "blob-fetches", "blob-loads",
            "namespaces-created", "namespaces-loaded", "getroot-heard", "namespaces-removed",
            "collections", "trees-checked")
"""The ``counts`` of ``kvs.stats-get`` (all shown, 0 included)."""


_OP_FIELDS = frozenset({"key", "flags", "dirent", "lease"})


def _check_ops(ops: Any, blob_limit: int | None = None, *,
               limits: bool = True) -> tuple[list[dict[str, Any]], bool]:
    """A commit's ops as received: well-formed enough to queue or relay
    (with ``limits``, where the commit enters: no field but an op's own, and
    a well-formed dirent), and
    within the limits (:func:`kvs.txn.check_limits`; ``blob_limit``:
    ``content.blob-size-limit``), refused here on the rank they enter
    rather than on rank 0 after crossing the tree; and whether any carries
    a ``lease`` (which rank 0 then checks against its lease table)."""
    if not isinstance(ops, list):
        raise ErrnoError(errno.EPROTO, "ops must be a list")
    if len(ops) > MAX_OPS:
        raise ErrnoError(errno.E2BIG, f"too many ops ({len(ops)} > {MAX_OPS})")
    leased = False
    for op in ops:
        if (
            not isinstance(op, dict)
            or not isinstance(op.get("key"), str)
            or type(op.get("flags", 0)) is not int  # (as rank 0: not a bool)
            or "dirent" not in op
            or not (op["dirent"] is None or isinstance(op["dirent"], dict))
        ):
            raise ErrnoError(errno.EPROTO, "each op must be {key: str, flags: int, "
                                           "dirent: treeobj|null}")
        if "\0" in op["key"]:
            raise ErrnoError(errno.EINVAL, "key contains a NUL character")
        if limits:
            if not op.keys() <= _OP_FIELDS:
                extra = ", ".join(sorted(reprlib.repr(k) for k in op.keys() - _OP_FIELDS)[:4])
                raise ErrnoError(errno.EPROTO, "an op has the fields key, flags, dirent and "
                                               f"lease only (not {extra})")
            dirent = op.get("dirent")
            if dirent is not None:
                # (as rank 0 would, EINVAL: a malformed one relayed with others
                # failed them all -- val data nested deeper than msgpack packs
                # once wrapped in a relay made it unsendable)
                treeobj.validate(dirent, dirent=True)
            txn.check_limits(op["key"], op.get("flags", 0), dirent, blob_limit)
        if "lease" in op:
            _check_lease_op(op)
            leased = True
    if limits and len(ops) > 1:  # (one key lies under at most MAX_DEPTH directories)
        txn.check_dirs([op["key"] for op in ops])
    return ops, leased


def _check_lease_op(op: dict[str, Any]) -> None:
    """A ``lease`` goes with a write of something (a put, append, mkdir or
    symlink): never with an unlink or a condition, which it could not keep."""
    if type(op["lease"]) is not int:
        raise ErrnoError(errno.EPROTO, "an op's lease is a lease id (an integer)")
    if op.get("dirent") is None or op.get("flags", 0) & EXPECT:
        raise ErrnoError(errno.EINVAL, f"{shown(op['key'])}: only a write that stores something "
                                       "may carry a lease (not an unlink or a condition)")


RelayedTxn = tuple[str, int, list[dict[str, Any]], int | None]
"""A relayed transaction as rank 0 queues it: (name, flags, ops, the
committer's uid if an op names a lease)."""


def _check_relayed(txns: list[Any]) -> list[RelayedTxn]:
    """``kvs.relaycommit``'s ``txns``: ``[{name, flags, ops, userid?}, ...]``,
    all valid or the whole relay refused (before any of it is queued).
    ``userid`` (the committer's, which the follower knows) comes with a
    transaction whose ops name a lease."""
    if not txns:
        raise ErrnoError(errno.EPROTO, "kvs.relaycommit carries no transaction")
    out: list[RelayedTxn] = []
    for t in txns:
        t = require(t, name=str, ops=list)
        # (no limits: the follower's kvs checked them as it took the commit,
        # and a relay is refused whole, with any other transaction in it;
        # rank 0's content store still refuses an oversized blob, alone)
        ops, leased = _check_ops(t["ops"], limits=False)
        uid = t.get("userid")
        if leased and type(uid) is not int:
            raise ErrnoError(errno.EPROTO, "a relayed transaction naming a lease needs "
                                           "its committer's userid")
        out.append((t["name"], _commit_flags(t), ops, uid if leased else None))
    return out


def _wire_size(payload: Any) -> int:
    """The bytes of a request's payload as it came (0 if it was not wire
    frames: a module's own request), which a relay adds up."""
    return codec.frames_size(payload.frames) if type(payload) is RawPayload else 0


REMOVAL_HEARD_TIMEOUT = 60.0
"""How long a follower waits to hear the removal of a namespace rank 0
refused a relay for (``ESTALE``: rank 0 removed it), before the commit ends
ENOTSUP.  The event is on its way; this bounds a rank cut off from it."""


def _outran_removal(exc: BaseException | None) -> bool:
    """Whether a relayed transaction failed only because its namespace was
    removed before rank 0 applied it (so it was never applied): this rank
    heard the removal first (:class:`~kvs.namespaces.NamespaceRemoved`), or
    rank 0 refused the relay because the namespace it named was removed
    (``ESTALE``: a newer one of its name may exist)."""
    return isinstance(exc, NamespaceRemoved) or (
        isinstance(exc, ErrnoError) and exc.errnum == errno.ESTALE)


def _commit_flags(p: dict[str, Any]) -> int:
    flags = p.get("flags", 0)
    if type(flags) is not int:  # (not a bool: as every other int field)
        raise ErrnoError(errno.EPROTO, "flags must be an integer")
    return flags


def _ns_name(p: dict[str, Any]) -> str:
    """The namespace a request names: absent, null or ``""`` mean primary;
    anything but a string is EPROTO (``0`` must not silently mean primary)."""
    name = p.get("namespace")
    if name is None or name == "":
        return PRIMARY
    if not isinstance(name, str):
        raise ErrnoError(errno.EPROTO, "namespace must be a string")
    return name


def _after_of(p: dict[str, Any], flags: int) -> tuple[int, bytes] | None:
    """A lookup's ``after``/``mark`` (what an APPEND watcher has answered,
    :func:`kvs.treeobj.value_after`), or None; given together, with
    ``TREEOBJ`` (else ``EPROTO`` / ``EINVAL``)."""
    after, mark = p.get("after"), p.get("mark")
    if after is None and mark is None:
        return None
    if type(after) is not int or after < 0 or type(mark) is not bytes or len(mark) != 16:
        raise ErrnoError(errno.EPROTO, "after must be a count of blobs (at least 0) and "
                                       "mark its 16-byte mark, given together")
    if not flags & lookup_engine.TREEOBJ:
        raise ErrnoError(errno.EINVAL, "after needs the TREEOBJ flag")
    return after, mark


def _valid_name(name: str) -> bool:
    try:
        check_name(name)
    except ErrnoError:
        return False
    return True


def _older_epoch(name: str, epoch: int, now: int) -> ErrnoError:
    """``kvs.wait-version`` for an epoch older than the namespace's: the one
    asked for was removed -- or never given (0, -1: it said "removed" of
    a namespace never removed)."""
    return ErrnoError(errno.ENOTSUP, f"namespace {name} is at epoch {now}, not {epoch} "
                                     "(that one was removed, or never given)")


def _well_formed(kind: str, payload: dict[str, Any], names: object) -> bool:
    """A ``setroot`` or ``error`` event's fields have the types rank 0's kvs
    gives them (``removed`` needs only its namespace)."""
    if kind == "removed":
        return True
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        return False
    if kind == "setroot":
        return type(payload.get("rootseq")) is int and blobref.is_valid(payload.get("rootref"))
    return type(payload.get("errnum") or 0) is int


def _check_guest_ops(ops: list[dict[str, Any]]) -> None:
    """Guests may commit values, unlinks and empty directories only."""
    for op in ops:
        d = op.get("dirent")
        if d is None or d.get("type") == "val":
            continue
        if d.get("type") == "dir" and not d.get("data"):
            continue
        raise ErrnoError(errno.EPERM, "guests may only commit values, unlinks and empty "
                                      "directories")


class KvsModule(Module):
    name: ClassVar[str] = "kvs"
    metrics_skip: ClassVar[tuple[str, ...]] = ("rank", "pid", "namespaces")
    after: ClassVar[tuple[str, ...]] = ("content",)  # (its start loads the checkpoint)
    calls: ClassVar[tuple[str, ...]] = ("content",)  # (stores and loads blobs in process)
    attributes: ClassVar[tuple[AttrSpec, ...]] = (CACHE_BYTES, CACHE_EXPIRE, SETROOT_LIMIT,
                                                  CHECKPOINT_PERIOD,
                                                  TRANSACTION_MERGE, MAX_GUEST_WAITS,
                                                  collector.GRACE,
                                                  collector.PERIOD, MAX_LEASES,
                                                  RELAY_SETTLE_TIMEOUT)
    runtime_attributes: ClassVar[tuple[str, ...]] = (CHECKPOINT_PERIOD.name, CACHE_EXPIRE.name)
    repeatable: ClassVar[frozenset[str]] = frozenset({"kvs.wait-version"})
    """A version wait acts on nothing: on ``module reload kvs`` the ones
    still waiting go to the new module (docs/protocol.md, ``module.reload``),
    which counts them again toward a guest's ``kvs.max-waits-per-guest``."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.rank = ctx.rank
        self.leader = ctx.rank == 0
        self.upstream = topology.ancestors(ctx.rank, ctx.fanout)
        self.hash_name = CONTENT_HASH.value(ctx.attrs)
        self.recent_roots = RecentRoots()
        self._failure_log = LogThrottle(self.log, every=FAILURE_LOG_EVERY)
        self.statedir = str(ctx.attrs.get("statedir") or "")
        # Flux's content.restore and content.dump (kvs/dumps.py) need a
        # checkpoint without a statedir too: the one restored, read at
        # start; the final one, which the dump reads at stop.
        self.loads_checkpoint = bool(self.statedir or ctx.attrs.get("content.restore"))
        self.final_checkpoint = bool(self.statedir or ctx.attrs.get("content.dump"))
        self.blobs = BlobStore(CACHE_BYTES.value(ctx.attrs))
        self._services: BrokerServices | None = None
        """Rank 0: the rank's own services, which publish its events (:meth:`_publish`)."""
        # decoded objects: bounded as the blobs are (they cost a few times
        # their blob's bytes), and by count
        self.cache = treeobj.BlobCache(self.blobs, max_objects=16384,
                                       max_bytes=self.blobs.limit)
        self.cache_expire: float = CACHE_EXPIRE.value(ctx.attrs)
        self._expiry: asyncio.Task[None] | None = None
        self.prime_limit = SETROOT_LIMIT.value(ctx.attrs)
        self.blob_limit: int = BLOB_SIZE_LIMIT.value(ctx.attrs)
        """``content.blob-size-limit``: a commit with a bigger value is refused
        where it enters (``EFBIG``), not sent whole to rank 0 to be refused
        there.  This rank's own value, as its content module's: ``kvbroker
        start -S`` and a bootstrap file's ``[attrs]`` give every rank the
        same, ``kvbroker broker -S`` only its own rank (docs/protocol.md)."""
        self.namespaces: dict[str, Namespace] = {}
        self._loading: dict[str, asyncio.Future[Namespace]] = {}
        self.heard = Heard()
        """A follower's namespaces heard created and not loaded (``getroot`` with ``heard``)."""
        self._txn_counter = 0
        self._txn_prefix = f"{self.rank}.{secrets.token_hex(4)}."
        """Each load's own: a follower learns how its relayed transactions
        went only from the names in rank 0's events, and a reload (or a
        restarted rank) counting from ``<rank>.1`` again had the old load's
        transactions, still queued on rank 0, settle the new one's of the
        same name -- answered applied at another's version, or failed."""
        # kvs.wait-version requests still waiting, by request route (the client)
        self._version_waits: dict[tuple[str, ...], set[asyncio.Future[Any]]] = {}
        self._guest_waits: Counter[int] = Counter()
        """kvs.wait-version requests waiting, per guest user."""
        self._max_guest_waits: int = MAX_GUEST_WAITS.value(ctx.attrs)
        self.counts: Counter[str] = Counter(dict.fromkeys(COUNTERS, 0))
        self.relays: RelayOutbox  # a follower's road to rank 0 (needs self.h: see start)
        self._last_epoch = time.time_ns() // 1000 - 1
        """Rank 0: the epoch last given (``namespace-list``'s ``epoch``: a
        watcher of namespaces merges the list and the events by it); see
        :meth:`_next_epoch`."""
        # Rank 0's content module when it is in this process with our hash
        # (also given to the fetcher, the checker and the pipeline at start)
        self._content: ContentModule | None = None
        # Rank 0 with a statedir: checkpoints of the primary root, one at a
        # time (periodic, SYNC commits, stop), never an older over a newer.
        self.checkpoint_period = CHECKPOINT_PERIOD.value(ctx.attrs)
        self.checkpointed = -1
        """rootseq of the last checkpoint written (or restored at start)."""
        self._checkpoint_lock = asyncio.Lock()
        self._checkpoint_unsure = False
        """A checkpoint write failed: the row may name its root (its sync
        failed, and so did putting the old row back), so the next checkpoint
        is written even if the root is not newer than :attr:`checkpointed`."""
        self._checkpoint_counts: Counter[str] = Counter()
        self._checkpoint_failing = LastFailure()
        """Why the last checkpoint of the newest root failed, until one
        succeeds (``checkpoint.failing`` in the stats): the count alone did
        not say whether it still fails."""
        self._ticker: asyncio.Task[None] | None = None
        # Rank 0: online garbage collection (kvs/collect.py)
        self.root_history = collector.RootHistory(collector.GRACE.value(ctx.attrs))
        self.gc_period = collector.PERIOD.value(ctx.attrs)
        self._last_gc: dict[str, Any] | None = None
        self._gc_ticker: asyncio.Task[None] | None = None
        # The work, one job each (their ``h`` and ``content`` are set at start)
        self.fetcher = BlobFetcher(self.blobs, self.counts)
        """Loads the blobs :attr:`blobs` misses (every read and commit)."""
        self.refcheck = RefChecker(self.fetcher, self.counts)
        """Rank 0: the blobs a commit or a namespace-create names must exist, whole."""
        self.commits = CommitPipeline(
            log=self.log, counts=self.counts, spawn=self.spawn, cache=self.cache,
            blobs=self.blobs, fetcher=self.fetcher, refcheck=self.refcheck,
            publish=self._publish, checkpoint=self._checkpoint, hash_name=self.hash_name,
            statedir=self.statedir, root_history=self.root_history,
            prime_limit=self.prime_limit, event_limit=LINK_MAX_MESSAGE.value(ctx.attrs),
            merge=TRANSACTION_MERGE.value(ctx.attrs))
        """Rank 0: queues, merges and applies the transactions, sets the roots."""
        self.leases = LeaseTable(ctx.owner_uid, MAX_LEASES.value(ctx.attrs), self._lease_ended)
        """Rank 0: the leases (kvs/leases.py); empty and unused on a follower."""
        self._unlinking: dict[int, tuple[Lease, asyncio.Future[dict[str, int]]]] = {}
        """Ended leases whose keys' unlinks are under way (their first
        pass), by id: a revoke of one waits for them (:meth:`lease_revoke`)."""
        if self.leader:
            self.commits.leases = self.leases

    # ================================================================ life cycle

    def handlers(self) -> dict[str, Handler]:
        return {
            "kvs.lookup": self.lookup,
            "kvs.lookup-plus": self.lookup_plus,
            "kvs.diff": self.diff,
            "kvs.commit": self.commit,
            "kvs.relaycommit": self.relaycommit,
            "kvs.getroot": self.getroot,
            "kvs.wait-version": self.wait_version,
            "kvs.namespace-create": self.namespace_create,
            "kvs.namespace-remove": self.namespace_remove,
            "kvs.namespace-list": self.namespace_list,
            "kvs.dropcache": self.dropcache,
            "kvs.gc": self.gc,
            "kvs.disconnect": self.disconnect,
            "kvs.stats-get": self.stats_get,
            "kvs.lease-grant": self.lease_grant,
            "kvs.lease-keepalive": self.lease_keepalive,
            "kvs.lease-revoke": self.lease_revoke,
            "kvs.lease-info": self.lease_info,
            "kvs.lease-list": self.lease_list,
        }

    async def start(self) -> None:
        self.relays = RelayOutbox(self.h, self.counts,
                                  LINK_MAX_MESSAGE.value(self.ctx.attrs) // 4)
        self.fetcher.h = self.commits.h = self.h
        # (before any request: a namespace heard created has had every event seen)
        self.h.subscribe(EVENT_PREFIX)
        content = self.ctx.siblings.get("content")
        if isinstance(content, ContentModule) and content.hash_name == self.hash_name:
            self.fetcher.loader = content
        self._expire_caches()
        if not self.leader:
            return
        services = self.ctx.siblings.get("broker")
        if isinstance(services, BrokerServices):
            self._services = services
        if self.fetcher.loader is not None and self.fetcher.loader.backing is not None:
            self._content = content = self.fetcher.loader
            self.fetcher.content = self.refcheck.content = self.commits.content = content
            # blobs stored again are young for a collection's grace period
            content.restored.span = max(content.restored.span, self.root_history.grace)
        handover = self.ctx.kept.pop(self.name, None)
        if handover is not None:  # module reload: the instance goes on where it was
            self._take_over(handover)
            return
        rootref, rootseq = "", 0
        saved_leases: Any = None
        if self.loads_checkpoint:
            rootref, rootseq, saved_leases = await self._restore()
        else:
            self.log.info("no statedir: the primary namespace starts empty, and is not kept "
                          "when the instance stops")
        if not rootref:
            rootref = await self._store_empty_root()
        self.namespaces[PRIMARY] = Namespace(PRIMARY, self.ctx.owner_uid, rootref, rootseq)
        if saved_leases is not None:
            n, nkeys = self.leases.restore(PRIMARY, saved_leases)
            ended = self.leases.end_restored()
            self.log.info("restored %d leases holding %d keys of the primary namespace from "
                          "the checkpoint: each has its full ttl again, from now%s", n, nkeys,
                          f" ({ended} that had ended: their keys are unlinked now)"
                          if ended else "")
        if self.statedir:
            self.checkpointed = rootseq
            await self._begin_run()
            if self.checkpoint_period > 0:
                self._ticker = self.spawn(self._checkpoint_periodically())
        if self._content is not None and self.gc_period > 0:
            self._gc_ticker = self.spawn(self._collect_periodically())

    def _next_epoch(self) -> int:
        """Rank 0: the epoch of a namespace created now -- the time in
        microseconds, or one past the last if that is not later.  They
        increase, across rank 0's runs too, so that a namespace made again
        after a restart is not taken for the one before by a watcher that
        reconnects (namespaces other than primary do not outlive rank 0).
        A guest sees its own namespaces' epochs: numbered one by one, the
        gap between two of them counted the namespaces anyone created
        between (a security probe), which a guest's stats leave out."""
        self._last_epoch = max(self._last_epoch + 1, time.time_ns() // 1000)
        return self._last_epoch

    def _handover(self) -> dict[str, Any]:
        """Rank 0, removed at runtime (``module remove``/``reload``): what the
        next kvs module of this rank takes over, so that the instance's
        namespaces, their versions and owners, and their leases outlive a
        reload -- with or without a statedir.  Their blobs stay in the
        content module.  (Flux's kvs keeps only the primary namespace, in
        its checkpoint.)"""
        kept = []
        for ns in self.namespaces.values():
            if ns.removed or ns.rootseq < 0:
                continue
            kept.append({"name": ns.name, "owner": ns.owner, "rootref": ns.rootref,
                         "rootseq": ns.rootseq, "flags": ns.flags, "epoch": ns.epoch,
                         "leases": self.leases.snapshot(ns.name)})
        return {"namespaces": kept, "last_epoch": self._last_epoch,
                "checkpointed": self.checkpointed, "root_history": self.root_history,
                "recent_roots": self.recent_roots,
                # (every live lease: those with no keys yet too)
                "live_leases": self.leases.live_entries()}

    def _take_over(self, handover: dict[str, Any]) -> None:
        """Rank 0: start where the kvs module removed before left off
        (:meth:`_handover`), its checkpoint ticker and collector again."""
        self._last_epoch = handover["last_epoch"]
        self.checkpointed = handover["checkpointed"]
        self.root_history = self.commits.root_history = handover["root_history"]
        self.root_history.grace = collector.GRACE.value(self.ctx.attrs)
        self.recent_roots = handover["recent_roots"]
        leases = self.leases.take_back(handover.get("live_leases"))
        for kept in handover["namespaces"]:
            ns = Namespace(kept["name"], kept["owner"], kept["rootref"], kept["rootseq"],
                           kept["flags"], kept["epoch"])
            self._note_roots(ns)
            self.namespaces[ns.name] = ns
            if kept["leases"] is not None:
                leases += self.leases.restore(ns.name, kept["leases"])[0]
        self.leases.end_restored()  # (ended before: their unlinks go now)
        self.log.info("took over %d namespaces (the primary at rootseq %d) and %d leases from "
                      "the kvs module removed before", len(self.namespaces),
                      self.namespaces[PRIMARY].rootseq, leases)
        if self._content is not None:
            self._content.kvs_left_cleanly = False  # (its run goes on: this module ends it)
        if self.statedir and self.checkpoint_period > 0:
            self._ticker = self.spawn(self._checkpoint_periodically())
        if self._content is not None and self.gc_period > 0:
            self._gc_ticker = self.spawn(self._collect_periodically())

    async def _begin_run(self) -> None:
        """Rank 0 with a statedir, as it starts: record this run in the
        store, and say so if the run before it did not stop cleanly
        (:mod:`broker.startlog`).  A store that cannot record it (a full
        disk) does not stop the start: the log says so."""
        if self._content is None or not self._content.persistent:
            return
        try:
            rows = await self._content.begin_run(self.checkpoint_period)
        except ErrnoError as exc:
            self.log.warning("this run could not be recorded in the startlog (%s)", exc.errstr)
            try:  # (the crash before it is still said: the runs can be read)
                rows = await self._content.past_runs()
            except ErrnoError:
                return
        history = startlog.runs(rows, live=False)
        if history and history[-1].crashed:
            self.log.warning("%s", startlog.crash_warning(history[-1]))

    async def _restore(self) -> tuple[str, int, Any]:
        """The primary root checkpointed in the statedir (``("", 0)``: none),
        and the leases kept with it (None: none)."""
        try:
            cp = (await self.h.rpc("content.checkpoint-get", {"key": CHECKPOINT_KEY}))
        except RemoteError as exc:
            if exc.errnum == errno.EIO:  # (a damaged checkpoint: starting again repeats it)
                raise LastingFault(exc.errnum, exc.errstr) from None
            if exc.errnum != errno.ENOENT:
                raise
            self.log.info("no checkpoint in %s: the primary namespace starts empty",
                          f"statedir {self.statedir}" if self.statedir
                          else "the restored store")
            return "", 0, None
        value = cp.get("value")
        if isinstance(value, dict):
            value = {**value, "rootseq": rootseq_of(value)}  # (Flux's form too)
        if not is_kvs_root(value):
            # (content.checkpoint-put lets the owner write any value there)
            raise LastingFault(errno.EINVAL, f"the checkpoint {CHECKPOINT_KEY!r} in statedir "
                                             f"{self.statedir} is not a KVS root: "
                                             f"{value!r:.200}")
        rootref, rootseq = value["rootref"], value["rootseq"]
        # Its root directory must be there, and be a directory: else nothing
        # could be read or written (every request failed "not a tree object").
        try:
            data = (await self.h.rpc("content.load", {"blobref": rootref}))["data"]
            kind = treeobj.typeof(treeobj.decode(data))
            if kind not in ("dir", "hdir"):
                raise ErrnoError(errno.EINVAL, f"a {kind} tree object, not a directory")
        except (RemoteError, ErrnoError) as exc:
            why = (f"which the content store cannot give ({exc.errstr})"
                   if isinstance(exc, RemoteError) else f"which is not a directory ({exc.errstr})")
            raise LastingFault(exc.errnum, f"the checkpoint in statedir {self.statedir} names "
                                           f"root {rootref} (rootseq {rootseq}), {why}: the "
                                           "store is damaged (kvbroker content checkpoint list "
                                           f"--statedir {self.statedir} shows the older "
                                           "checkpoints kept; checkpoint update makes one "
                                           "current)") from None
        stamp = value.get("timestamp")
        when = (f", written {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(stamp))}"
                if isinstance(stamp, (int, float)) else "")
        self.log.info("restored the primary namespace from checkpoint rootseq %d "
                      "(rootref %s%s)", rootseq, rootref, when)
        return rootref, rootseq, value.get("leases")

    async def _settle_relayed(self, timeout: float) -> None:
        """A follower at stop: wait up to ``timeout`` seconds for the events
        that settle the transactions it relayed (:data:`RELAY_SETTLE_TIMEOUT`);
        their commits are answered from them meanwhile.  One still unsettled
        then is answered ``ETIMEDOUT``, saying it may yet be applied: never
        "not applied", which this rank cannot know."""
        waiting = [f for ns in self.namespaces.values() for f in (ns.relayed or {}).values()
                   if not f.done()]
        if not waiting:
            # A turn of the loop all the same: the event handled in this one
            # settled the last of them, and their commits are answered by
            # callbacks still queued -- before them, the module's removal
            # answered those commits ENOSYS "removed", though applied.
            await asyncio.sleep(0)
            return
        if self.ctx.upstream_lost():  # (no event will come: said at once)
            timeout = 0.0
        self.log.info("at stop: waiting up to %g s for rank 0 to settle %d relayed "
                      "transactions", timeout, len(waiting))
        _done, late = await asyncio.wait(waiting, timeout=timeout)
        if late:
            self.log.warning("%d relayed transactions not settled by rank 0 %g s into this "
                             "kvs's stop: their commits end ETIMEDOUT (they may yet be "
                             "applied)", len(late), timeout)
            for fut in late:
                if not fut.done():
                    fut.set_exception(ErrnoError(
                        errno.ETIMEDOUT, "this rank's kvs stopped before rank 0 settled the "
                                         "transaction: it may yet be applied"))
            # (a turn of the loop: the handlers waiting on them answer so,
            # before the module's removal ends what is left "removed")
            await asyncio.sleep(0)

    async def stop(self) -> None:
        """Rank 0: refuse new transactions, let the queued ones finish (they
        are, or are about to be, acknowledged), then write the last
        checkpoint.  Clients kept committing while the rank stopped: what
        was applied and acknowledged after the last checkpoint was lost at
        the next start, and its versions numbered again."""
        self.commits.stopping = True
        self.leases.close()  # (no lease expires at stop: a statedir keeps them)
        if self._ticker is not None:
            self._ticker.cancel()  # a checkpoint it was writing finishes first (shielded)
        if self._gc_ticker is not None:
            self._gc_ticker.cancel()
        if self._content is not None:
            # queued commits stop waiting for room in the write-back backlog:
            # the last checkpoint's drain writes their blobs
            self._content.release_waiters()
        try:
            await self.commits.drain(STOP_DRAIN_TIMEOUT)
            await self._settle_relayed(RELAY_SETTLE_TIMEOUT.value(self.ctx.attrs))
        finally:
            # (a stop cancelled here, module remove --cancel, keeps the
            # state too: the next load started empty, at rootseq 0, and the
            # followers followed it back)
            if self.leader and self.removing:
                self.ctx.kept[self.name] = self._handover()
        if self.leader and self.final_checkpoint:
            try:
                written = await self._checkpoint()
            except Exception:
                await self._checkpoint_written_root()
                # The next start resumes from an older checkpoint; the root
                # acknowledged commits reached is named here so it can be
                # taken back (namespace create -r), if its blobs were written
                # -- and before a kvs gc, which keeps only what checkpoints name.
                ns = self.namespaces.get(PRIMARY)
                if ns is not None and ns.rootseq > self.checkpointed:
                    self.log.error("the primary namespace's last root (rootseq %d, rootref "
                                   "%s) is not checkpointed", ns.rootseq, ns.rootref)
                raise
            # What the next start resumes from, in the log: the pair of
            # the "restored ... from checkpoint" line of the next start.
            ns = self.namespaces.get(PRIMARY)
            if ns is not None:
                self.log.info("final checkpoint: the primary namespace at rootseq %d "
                              "(rootref %s)%s", ns.rootseq, ns.rootref,
                              "" if written else ", checkpointed already")
            if self.removing:
                # the run goes on: the next kvs module of this rank takes
                # over, or the content module records the clean stop
                if self._content is not None:
                    self._content.kvs_left_cleanly = True
            elif self._content is not None and self.statedir:
                try:
                    await self._content.end_run()  # (a clean stop: nothing acknowledged lost)
                except ErrnoError as exc:
                    self.log.warning("this run's clean stop could not be recorded (%s): the "
                                     "next start will say it was not shut down properly",
                                     exc.errstr)

    def _expire_caches(self) -> None:
        """(Re)start the task that expires the caches' unused entries every
        ``kvs.cache-expire`` (none for 0)."""
        self._expiry = restart_expiry(self._expiry, self.cache_expire, self._age_caches,
                                      self.spawn)

    def _age_caches(self) -> None:
        before = self.blobs.size + self.cache.nbytes
        self.blobs.age()
        self.cache.age()
        # (untrimmed, an idle rank stayed as big)
        malloc.let_go(before - self.blobs.size - self.cache.nbytes)

    def set_attribute(self, name: str, value: Any) -> None:
        """``kvs.checkpoint-period`` or ``kvs.cache-expire`` on a running
        rank (``attr set``, as Flux's ``flux config reload``).  Rank 0 with a
        statedir checkpoints at the new period from now on, 0 stops it; a
        checkpoint being written finishes.  The caches expire at the new age
        from now on (0: never)."""
        if name == CACHE_EXPIRE.name:
            self.cache_expire = float(value)
            self._expire_caches()
            return
        assert name == CHECKPOINT_PERIOD.name
        self.checkpoint_period = float(value)
        if self.leader and self._content is not None and self.statedir:
            # (what a crash of this run may lose, as the next start tells it)
            self.spawn(self._content.note_run_period(self.checkpoint_period))
        if self._ticker is not None:
            self._ticker.cancel()  # (shielded: a checkpoint under way completes)
            self._ticker = None
        if self.leader and self.statedir and PRIMARY in self.namespaces \
                and not self.commits.stopping and self.checkpoint_period > 0:
            self._ticker = self.spawn(self._checkpoint_periodically())

    async def _checkpoint_periodically(self) -> None:
        """Rank 0 with a statedir: every ``kvs.checkpoint-period``, checkpoint
        the primary root if it changed since the last checkpoint.  A timer,
        not per-commit work; as Flux's ``checkpoint-period``.  Periods run
        from the start of one checkpoint to the start of the next: one that
        takes long (it writes every blob stored since the last, tens of MB
        under heavy writes) is followed at once by the next, not a period
        later -- that put checkpoints 2 s apart at a 1 s period."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while True:
            await asyncio.sleep(max(0.0, start + self.checkpoint_period - loop.time()))
            start = loop.time()
            # Shielded: stop() cancels this loop, but a checkpoint under way
            # completes (holding the lock) before the final one is written.
            await asyncio.shield(self._periodic_checkpoint())

    async def _periodic_checkpoint(self) -> None:
        """A checkpoint that keeps failing (a full disk) is an ERROR at once,
        then at most one a minute (``checkpoint.failed`` in ``kvbroker stats
        kvs`` counts them all): one a period flooded stderr and pushed every
        other record out of the ring ``kvbroker dmesg`` reads."""
        try:
            written = await self._checkpoint()
        except Exception as exc:  # retried at the next period
            self._checkpoint_counts["failed"] += 1
            self._failure_log.log(logging.ERROR, "periodic",
                                  "periodic checkpoint of the primary namespace failed: %s", exc)
            await self._checkpoint_written_root()
            return
        if written:
            held = self._failure_log.reset("periodic") + self._failure_log.reset("fallback")
            if held:
                self.log.warning("periodic checkpoint of the primary namespace written again, "
                                 "after %d more %s not logged", held,
                                 "failure that was" if held == 1 else "failures that were")

    async def _checkpoint_written_root(self) -> None:
        """The newest root's checkpoint failed (its blobs could not be
        written: a full disk): checkpoint the newest root whose blobs were
        all written before, if newer than the last checkpoint, so that a
        crash loses only the commits after it -- it lost every commit since
        the last checkpoint that succeeded, though their blobs were on disk.
        Best effort: says what it did, or why not, and never raises."""
        async with self._checkpoint_lock:
            root = self.commits.newest_written_root()
            if root is None or root.rootseq <= self.checkpointed or self._content is None:
                return
            try:
                synced = await self._content.checkpoint_written(CHECKPOINT_KEY, self._cp_value(
                    root.rootref, root.rootseq))
            except Exception as exc:
                self._checkpoint_unsure = True
                self._failure_log.log(logging.ERROR, "fallback",
                                      "checkpoint of rootseq %d, the newest root whose blobs "
                                      "are written, failed too: %s", root.rootseq, exc)
                return
            self.checkpointed, self._checkpoint_unsure = root.rootseq, False
            self._checkpoint_counts["written"] += 1
            self._checkpoint_counts["written-fallback"] += 1
        primary = self.namespaces.get(PRIMARY)
        what = ("at a second try, the current root (the first failed after its blobs "
                "were written)" if primary is not None and primary.rootseq == root.rootseq
                else "instead, the newest root whose blobs are all written")
        self.log.warning("checkpointed rootseq %d (rootref %s) %s%s", root.rootseq,
                         root.rootref, what,
                         "" if synced else " (committed to SQLite's WAL, not synced to "
                         "disk: it survives a crash of this process, not of the host)")

    async def _checkpoint(self, rootref: str | None = None, rootseq: int = 0,
                          pending: Any = None) -> bool:
        """Record the primary root (default: the current one) in the content
        store, unless a checkpoint at least as new was written already
        (then False) and none failed since.

        ``content.checkpoint-put`` writes back every blob stored so far
        before the checkpoint itself, so the root it names is readable after
        a crash: the blobs of every root the kvs module has set (or is about
        to set, for a SYNC commit) were handed to the content module first."""
        async with self._checkpoint_lock:
            if rootref is None:
                ns = self.namespaces.get(PRIMARY)
                if ns is None:
                    return False
                rootref, rootseq = ns.rootref, ns.rootseq
            if rootseq <= self.checkpointed and not self._checkpoint_unsure:
                return False
            try:
                with self._checkpoint_failing.kept():
                    await self.h.rpc("content.checkpoint-put", {
                        "key": CHECKPOINT_KEY, "value": self._cp_value(rootref, rootseq,
                                                                       pending)})
            except BaseException:
                # (a SYNC commit's root, which then fails: the row may name it)
                self._checkpoint_unsure = True
                raise
            self.checkpointed, self._checkpoint_unsure = rootseq, False
            self._checkpoint_counts["written"] += 1
            return True

    def _cp_value(self, rootref: str, rootseq: int, pending: Any = None) -> dict[str, Any]:
        """A checkpoint of the primary root, with the leases that hold keys
        of the primary namespace now (a restart takes them back, each with
        its full ttl, so no leased key outlives a restart unwatched).  An
        older root (a fallback checkpoint) gets the leases of the newest:
        a key leased at that root and detached since stays, and is said to.
        ``pending``: a ``SYNC`` commit's ``(ops, leases found)``, whose root
        is checkpointed before it is set and its attachments made."""
        value: dict[str, Any] = {"rootref": rootref, "rootseq": rootseq,
                                 "timestamp": time.time()}
        leases = self.leases.snapshot(PRIMARY, *(pending or ()))
        if leases is not None:
            value["leases"] = leases
        return value

    async def _store_empty_root(self) -> str:
        ref, data = txn.empty_root(self.hash_name)
        self.blobs.put(ref, data)
        await self.h.rpc("content.store", {"blobs": [data]})
        return ref

    # ================================================================ namespaces

    async def get_ns(self, name: Any, msg: Message | None = None) -> Namespace:
        """The namespace ``name`` on this rank, loading it from rank 0 if needed.

        Raises ENOTSUP for an unknown namespace, EPERM if ``msg``'s sender may
        not use it.
        """
        if not isinstance(name, str):
            raise ErrnoError(errno.EPROTO, "namespace must be a string")
        ns = self.namespaces.get(name)
        # While a follower loads a namespace, a setroot event may already have
        # given the placeholder a root, but not its owner: wait for the load.
        if ns is None or ns.rootseq < 0 or name in self._loading:
            # (a name that cannot exist gets the same answer on every rank;
            # any name a namespace may have is shown whole)
            valid = _valid_name(name)
            if self.leader or not valid:  # (an invalid one: ENOTSUP still, as Flux's)
                raise ErrnoError(errno.ENOTSUP, f"namespace {shown_name(name, MAX_NS_NAME)} "
                                                "does not exist" + ("" if valid else
                                                                    f": {NAME_RULE}"))
            ns = await self._load_ns(name)
        if msg is not None:
            ns.check_access(msg)
        return ns

    async def _load_ns(self, name: str) -> Namespace:
        fut = self._loading.get(name)
        if fut is not None:
            try:
                return await asyncio.shield(fut)
            except ErrnoError as exc:
                if exc.errnum != errno.ENOTSUP:
                    raise
                # That load asked rank 0 before this request came: the
                # namespace may have been created since (a WAITCREATE watch
                # was loading it when the client's namespace-create
                # returned, and the client's commit failed).  Ask again.
                if name in self._loading:
                    return await asyncio.shield(self._loading[name])
                return await self._load_ns(name)
        check_name(name)
        fut = asyncio.get_running_loop().create_future()
        self._loading[name] = fut
        try:
            ns = await self._ask_root(name)
            fut.set_result(ns)
            self.counts["namespaces-loaded"] += 1
            return ns
        except BaseException as exc:
            self._forget_ns(name)
            err = exc
            if isinstance(exc, RemoteError):
                err = ErrnoError(exc.errnum, exc.errstr)
            fut.set_exception(err)
            fut.exception()
            raise err from None
        finally:
            del self._loading[name]

    async def _ask_root(self, name: str) -> Namespace:
        """Ask rank 0 for ``name``'s root; ask again if the answer may be stale.

        The task resumes with the answer only after the events that arrived
        with it, which may be newer than it: a ``removed`` (the answer may
        name the namespace removed) and a ``created`` (after an ENOTSUP, rank
        0 answered before creating it).  A ``created`` heard since the
        question (kept in :attr:`heard` by :meth:`on_event`) means the
        namespace exists now, so ask again: the request is answered from it,
        not refused ENOTSUP, and this rank follows it.  Without one, the
        answer stands, or the namespace is gone as far as this rank has
        heard (ENOTSUP).  Each question again follows a creation during the
        last, so this ends when they stop."""
        while True:
            # The placeholder first, then ask for the root: a setroot that
            # overtakes the answer is applied to it, and the newer one wins.
            placeholder = Namespace(name, owner=-1)
            self.namespaces[name] = placeholder
            self.heard.take(name)  # (its events now go to the placeholder)
            try:
                resp = await self.h.rpc("kvs.getroot", {"namespace": name}, nodeid=0)
            except RemoteError as exc:
                if exc.errnum == errno.ENOTSUP and name in self.heard:
                    continue  # created after rank 0 answered
                raise from_rank_0(exc) from None
            if placeholder.removed:
                if name in self.heard:
                    continue  # removed and created again meanwhile
                raise ErrnoError(errno.ENOTSUP, f"namespace {name} was removed")
            self.heard.take(name)  # (a created the answer already tells)
            placeholder.owner = int(resp["owner"])
            self._note_roots(placeholder)
            placeholder.flags = int(resp.get("flags", 0))
            placeholder.epoch = int(resp.get("epoch", 0))
            placeholder.set_root(int(resp["rootseq"]), resp["rootref"])
            return placeholder

    def _forget_ns(self, name: str) -> None:
        """A follower drops a namespace."""
        ns = self.namespaces.pop(name, None)
        if ns is not None:
            ns.remove()

    # ================================================================ events

    def _publish(self, topic: str, payload: dict[str, Any]) -> None:
        """Publish a namespace event (rank 0), private to the instance owner
        as in Flux: guests must not learn other namespaces' roots, keys or
        transaction names.  Modules (kvs-watch) are owners and receive them.

        By a direct call to the broker's own services, as the new blobs go
        to ``content``: the ``event.pub`` request this sent
        (without asking for an answer) was served within the send, so the
        event is sequenced and delivered at the same point as before, and
        rank 0 no longer builds, routes and dispatches a request per batch
        of commits.  An error is logged: the request's was dropped unseen
        (the setroot's size was checked before its root was set)."""
        services = self._services
        if services is None:  # (a module run without its rank's services: tests)
            self.h.send_noresponse("event.pub", {"topic": topic, "payload": payload,
                                                 "flags": int(MsgFlags.PRIVATE)})
            return
        try:
            services.publish_owned(topic, payload)
        except ErrnoError as exc:
            self.log.error("cannot publish %s: %s", topic, exc.errstr)
        except Exception:  # (as the request's handler failing was: logged, not raised)
            self.log.exception("publishing %s failed", topic)

    def on_event(self, msg: Message) -> None:
        """One namespace event: the topic names the namespace and the kind, so
        an event of a namespace this rank does not follow is dropped
        without decoding its payload."""
        parts = event_topic_parts(msg.topic)
        if parts is None or parts[1] not in EVENT_KINDS or msg.userid != self.ctx.owner_uid:
            self.events.drop("foreign")
            return
        name, kind = parts
        if self.leader:  # rank 0 made this event: its state is already current
            if kind == "created":
                self.events.drop("created")
            else:
                self.events.handled += 1
            return
        ns = self.namespaces.get(name)
        if ns is None and kind != "created" and name not in self.heard:
            self.events.drop("foreign")  # a namespace this rank does not follow
            return
        try:
            payload = msg.payload
        except ProtocolError:
            payload = None
        if not isinstance(payload, dict) or payload.get("namespace") != name:
            self.events.drop("foreign")
            return
        names = payload.get("names") or []
        if not _well_formed(kind, payload, names):
            # only the owner can publish kvs.*; still, a malformed one
            # (hand-made: rank 0's kvs never sends one) must not raise here
            self.events.drop("foreign")
            return
        if ns is None:
            self._hear(name, kind, payload)
            return
        if kind == "created":
            if name in self._loading:
                # A load under way: its getroot may have been answered
                # ENOTSUP before this creation; heard, the load asks again
                # (:meth:`_ask_root`), or the rank would not know the
                # namespace exists.  Otherwise the load's answer tells.
                self._hear(name, kind, payload)
            else:
                self.events.drop("created")
            return
        self.events.handled += 1
        if kind == "setroot":
            self._prime(payload)
            rootseq, rootref = payload["rootseq"], payload["rootref"]
            ns.set_root(rootseq, rootref)
            if ns.relayed:
                ns.finish(names, rootseq, rootref)
        elif kind == "removed":
            self._forget_ns(ns.name)
            self.heard.take(name)  # (a created heard while it loaded: gone too)
        else:  # error: fail this rank's relayed transactions it names
            errstr = payload.get("errstr")
            ns.fail(names, payload.get("errnum") or errno.EIO,
                    errstr if isinstance(errstr, str) else None)

    def _hear(self, name: str, kind: str, payload: dict[str, Any]) -> None:
        """An event of a namespace this follower has not loaded: remember a
        created one, keep a heard one current (its blobs too: a reader
        comes soon), forget it when removed."""
        heard = self.heard
        if kind == "created":
            if not heard.created(name, payload):
                self.events.drop("foreign")
                return
        elif kind == "setroot":
            self._prime(payload)
            heard.setroot(name, payload["rootseq"], payload["rootref"])
        elif kind == "removed":
            heard.removed(name)
        else:  # error: names transactions relayed by other ranks
            self.events.drop("error")
            return
        self.events.handled += 1

    def _prime(self, payload: dict[str, Any]) -> None:
        """Cache the new blobs a setroot carries (docs/protocol.md)."""
        blobs = payload.get("blobs")
        if isinstance(blobs, dict):
            for ref, data in blobs.items():
                if isinstance(ref, str) and isinstance(data, bytes):
                    self.blobs.put(ref, data)

    # ================================================================ reads

    async def _lookup(self, msg: Message, plus: bool) -> None:
        p = require(msg.payload, key=str)
        flags = p.get("flags", 0)
        if type(flags) is not int:  # (not a bool: as every other int field)
            raise ErrnoError(errno.EPROTO, "flags must be an integer")
        after = _after_of(p, flags)
        if after is not None:
            self.counts["lookups-after"] += 1
        ns: Namespace | None = None
        name = _ns_name(p)
        rootdir = p.get("rootdir")
        if rootdir is not None:
            root = treeobj.validate(rootdir)
            if root["type"] != "dirref":
                raise ErrnoError(errno.EINVAL, "rootdir must be a dirref tree object")
            # The owner's (and kvs-watch's, which reads at the roots of
            # the namespaces it checked the watcher may watch) is a
            # capability, as in Flux: the namespace is neither loaded nor
            # access-checked; links into other namespaces still are.
            rootref = root["data"][0]
            seq = -1
            if not await self._guest_roots_allowed(msg, name, [rootref], msg.payload,
                                                   "reads at"):
                return
        else:
            ns = await self.get_ns(name, msg)
            rootref, seq = ns.rootref, ns.rootseq
        try:
            val = await self.run_lookup(msg, rootref, p["key"], flags, name, after)
        except ErrnoError as exc:
            if rootdir is None or exc.errnum != errno.ENOENT:
                raise
            # A missing key is None here: this ENOENT is a blob the store
            # lacks.  Say so, so no one reads it as "no such key" (the
            # errno stays Flux's and etcd's "compacted" meaning).
            why = exc.errstr or "a blob is not in the content store"
            if rootref in why:
                why = "the root is not in the content store"
            raise ErrnoError(errno.ENOENT, f"cannot read {shown(p['key'])} at root {rootref}: "
                             f"{why} (kvs gc removes the roots older than "
                             "kvs.gc-grace)") from None
        if after is not None and val is not None:
            answer = val  # {val, length?, mark?, grown?}: treeobj.value_after
        else:
            answer = {"val": val}
        if plus:
            self.h.respond(msg, {**answer, "rootref": rootref, "rootseq": seq,
                                 "namespace": name})
            return
        if val is None:
            raise ErrnoError(errno.ENOENT, f"{shown(p['key'])}: no such key")
        self.h.respond(msg, answer)

    def _note_roots(self, ns: Namespace) -> None:
        """A guest's namespace notes the roots it takes (:class:`RecentRoots`)."""
        if ns.owner != self.ctx.owner_uid:
            ns.recent = self.recent_roots
            if ns.rootref:  # (a follower's placeholder has none yet)
                self.recent_roots.note(ns.rootref, ns.owner)

    async def _guest_roots_allowed(self, msg: Message, name: str, refs: list[str],
                                   payload: Any, what: str) -> bool:
        """A guest may name only roots of its own namespace ``name``, current
        or recent (the owner's, and kvs-watch's, are capabilities): True if
        ``refs`` all are.  Rank 0 refuses others (``EPERM``); a follower,
        which may not have seen every recent root, asks rank 0, which made
        them all, with ``payload`` and answers from there (False: answered)."""
        if msg.is_owner or msg.route == ["m:kvs-watch"]:
            return True
        for ref in refs:
            if await self._guest_root_known(msg, name, ref):
                continue
            if self.leader:
                raise ErrnoError(errno.EPERM, f"{ref} is not a recent root of a "
                                 f"namespace of yours: a guest {what} only those")
            self.h.respond(msg, await self.h.rpc_as(msg, msg.topic, payload, nodeid=0))
            return False
        return True

    async def _guest_root_known(self, msg: Message, name: str, rootref: str) -> bool:
        """A guest reads at ``rootdir`` only in a namespace of its own
        (``EPERM`` here), at its current root or a recent root of its
        namespaces (Flux lets anyone read at any root: a departure, see
        RecentRoots).  False: not one this rank has seen."""
        ns = await self.get_ns(name, msg)
        return rootref == ns.rootref or self.recent_roots.known(msg.userid, rootref)

    async def run_lookup(
        self, msg: Message, rootref: str, key: str, flags: int, namespace: str,
        after: tuple[int, bytes] | None = None,
    ) -> dict[str, Any] | None:
        """Run the lookup engine, fetching blobs and namespaces until it is done."""
        def ns_root(other: str) -> str | None:
            ns = self.namespaces.get(other)
            if ns is None or ns.rootseq < 0:
                return None
            ns.check_access(msg)
            return ns.rootref

        self.counts["lookups"] += 1
        held: set[str] = set()
        try:
            while True:
                try:
                    return lookup_engine.lookup(self.cache, rootref, key, flags,
                                                namespace=namespace, ns_roots=ns_root,
                                                after=after, obj_ref=self._obj_ref)
                except treeobj.NeedBlobs as need:
                    await self.fetcher.fetch(need.refs, held)
                except lookup_engine.NeedNamespace as need:
                    await self.get_ns(need.namespace, msg)
        finally:
            if held:
                self.blobs.release(held)

    def _obj_ref(self, obj: treeobj.TreeObj) -> str:
        """The blobref tree object ``obj`` would be stored at (the marks of a
        value stored by an older version: :func:`kvs.treeobj.refs_mark`)."""
        return blobref.hash_blob(treeobj.encode(obj), self.hash_name)

    async def lookup(self, msg: Message) -> None:
        await self._lookup(msg, plus=False)

    async def lookup_plus(self, msg: Message) -> None:
        await self._lookup(msg, plus=True)

    async def diff(self, msg: Message) -> None:
        """``kvs.diff`` ``{namespace, old, new?, key?, limit?}`` -> ``{keys,
        changes, old, new}``: the keys at or below ``key`` whose entries
        differ between the trees rooted at blobrefs ``old`` and ``new``
        (default: the namespace's current root here), sorted, and how each
        changed, ``added``, ``removed`` or ``changed``, in a list parallel
        to ``keys`` (:mod:`kvs.diff`; a list, not a mapping, so the answer
        names each key once and ``keys`` stays what older callers read).

        Roots are capabilities for the instance owner, as ``rootdir`` is for
        a lookup; a guest's must each be its namespace's current or a recent
        root (else ``EPERM``, from rank 0, which made them all)."""
        p = require(msg.payload, old=str)
        name = _ns_name(p)
        key, new = p.get("key", "."), p.get("new")
        limit = p.get("limit", diff_engine.DEFAULT_LIMIT)
        if type(key) is not str or (new is not None and type(new) is not str):
            raise ErrnoError(errno.EPROTO, "key and new must be strings")
        if type(limit) is not int or limit < 1:
            raise ErrnoError(errno.EPROTO, "limit must be a positive integer")
        key = check_key(key)
        old = blobref.check(p["old"])
        # (this rank's current root: named in what a follower asks rank 0)
        new = (await self.get_ns(name, msg)).rootref if new is None else blobref.check(new)
        if not await self._guest_roots_allowed(msg, name, [old, new], {**p, "new": new},
                                               "diffs"):
            return
        self.counts["diffs"] += 1
        held: set[str] = set()
        work = diff_engine.Diff(self.cache, old, new, key, limit=limit)
        try:
            while True:
                try:
                    keys = work.run()  # (it goes on where the last run stopped)
                    break
                except treeobj.NeedBlobs as need:
                    await self.fetcher.fetch(need.refs, held)
        finally:
            if held:
                self.blobs.release(held)
        changes = list(work.changes().values())  # (in the order of keys)
        self.h.respond(msg, {"keys": keys, "changes": changes, "old": old, "new": new})

    async def getroot(self, msg: Message) -> None:
        """``kvs.getroot {namespace, heard?}``.  With ``heard`` (kvs-watch,
        which follows the namespace's events from then on), a follower that
        has not loaded the namespace but heard it created answers the root
        it heard, which may lag rank 0's by the events in flight, without
        asking rank 0 (:class:`~kvs.namespaces.Heard`)."""
        p = require(msg.payload)
        name = _ns_name(p)
        if p.get("heard") is True and name not in self.namespaces:
            heard = self.heard.get(name)
            if heard is not None:
                if not (msg.is_owner or msg.userid == heard.owner):
                    raise ErrnoError(errno.EPERM, f"namespace {name} belongs to another user")
                self.counts["getroot-heard"] += 1
                self.h.respond(msg, heard.describe(name))
                return
        ns = await self.get_ns(name, msg)
        self.h.respond(msg, ns.describe())

    def wait_version(self, msg: Message) -> Awaitable[None]:
        p = require(msg.payload, rootseq=int)
        timeout = p.get("timeout")
        if timeout is not None and (type(timeout) not in (int, float) or not timeout >= 0):
            raise ErrnoError(errno.EPROTO, "timeout must be a number of seconds (at least 0)")
        if p.get("epoch") is not None and type(p["epoch"]) is not int:
            raise ErrnoError(errno.EPROTO, "epoch must be an integer (a commit's answer's)")
        # Remember who waits at once, before any await, so that kvs.disconnect
        # (as Flux) drops the wait even while the namespace is still being
        # loaded from rank 0, or before the waiting task has run at all.
        key = tuple(msg.route)
        guest = not msg.is_owner
        if guest:
            held = self._guest_waits[msg.userid]
            if held >= self._max_guest_waits:
                raise ErrnoError(errno.ENOSPC, f"this user has {held} version waits on rank "
                                               f"{self.rank} (kvs.max-waits-per-guest): "
                                               "end some first")
            add_count(self._guest_waits, msg.userid, 1)
        token: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._version_waits.setdefault(key, set()).add(token)
        return self._wait_version(msg, p, key, token, guest)

    async def _wait_version(self, msg: Message, p: dict[str, Any], key: tuple[str, ...],
                            token: asyncio.Future[None], guest: bool) -> None:
        try:
            await self._wait_version_of(msg, p, key, token)
        finally:
            if guest:
                add_count(self._guest_waits, msg.userid, -1)

    def _load_timeout(self, name: Any) -> float | None:
        """A ``kvs.wait-version`` of timeout 0's wait for its namespace:
        none where no load from rank 0 is needed (rank 0; a namespace this
        rank holds: answered after one step), else 0 -- ``ETIMEDOUT`` at
        once, not a wait for the load (an answer a stopped rank on the way
        held back for ever)."""
        ns = self.namespaces.get(name) if isinstance(name, str) else None
        if self.leader or (ns is not None and ns.rootseq >= 0 and name not in self._loading):
            return None
        return 0.0

    def _by_way_of(self) -> str:
        """The ranks a load from rank 0 crosses, for a message about one
        that does not come: any of them may be the one stopped."""
        if len(self.upstream) < 2:
            return ""
        between = ", ".join(str(r) for r in self.upstream[:-1])
        return f" by way of rank{'s' if len(self.upstream) > 2 else ''} {between}"

    async def _wait_version_of(self, msg: Message, p: dict[str, Any], key: tuple[str, ...],
                               token: asyncio.Future[None]) -> None:
        if token.cancelled():  # the client went away before this task ran:
            # no answer, by design -- not held (it was, for a client gone,
            # until the module was removed: 537 of them after a few closes)
            self.h.settled_elsewhere(msg)
            return
        waits = self._version_waits[key]  # (a disconnect would have cancelled token)
        task = asyncio.current_task()
        assert task is not None
        waits.discard(token)
        waits.add(task)
        try:
            # shielded: a disconnect cancelling this task must not abort a
            # namespace load that other requests are waiting for too
            loading = asyncio.ensure_future(self.get_ns(_ns_name(p), msg))
            # (cancelled meanwhile, nobody reads its outcome: an ENOTSUP was
            # logged as "Task exception was never retrieved")
            loading.add_done_callback(outcome_read)
            # The timeout counts from the request, the load included: a
            # rank whose way to rank 0 is stopped (torpid) loads for ever,
            # and ``kvs wait -t 1`` waited with it.
            timeout = p.get("timeout")
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            # (0 asks "reached now?": a namespace this rank holds is there at
            # once, but only after the loading task's first step -- one it
            # loads from rank 0 is not, and 0 waited without end for that)
            if timeout is not None and not (await asyncio.wait(
                    {loading}, timeout=timeout or self._load_timeout(_ns_name(p))))[0]:
                raise ErrnoError(errno.ETIMEDOUT, f"version {p['rootseq']} not reached in "
                                                  f"{timeout:g} s; this rank is still loading "
                                                  f"namespace {_ns_name(p)} from rank 0"
                                                  + self._by_way_of())
            ns = await asyncio.shield(loading)
            if p.get("epoch") is not None:
                ns = await self._life_of(msg, p, ns, deadline)
            if ns.rootseq < p["rootseq"]:
                try:
                    # (an extension: Flux's has no timeout, so a caller that
                    # gave up left its waiter here until the version came)
                    await asyncio.wait_for(ns.wait_version(p["rootseq"]),
                                           None if deadline is None
                                           else max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise ErrnoError(errno.ETIMEDOUT, f"version {p['rootseq']} not reached "
                                                      f"in {p['timeout']:g} s; this rank is at "
                                                      f"{ns.rootseq}") from None
        finally:
            waits.discard(task)
            if not waits and self._version_waits.get(key) is waits:
                del self._version_waits[key]
        self.h.respond(msg, {"rootseq": ns.rootseq, "rootref": ns.rootref})

    async def _life_of(self, msg: Message, p: dict[str, Any], ns: Namespace,
                       deadline: float | None) -> Namespace:
        """The namespace of ``p``'s epoch for a ``kvs.wait-version``, once
        this rank holds it.  A follower may still hold an older one of the
        same name, whose removal it has not heard yet: at a version past
        the one asked, it answered at once, and a read then found the old
        namespace's keys.  It waits to hear that removal and loads the
        namespace again.  A newer one than asked means the one asked for
        was removed: ``ENOTSUP``, as for a removal during the wait."""
        name, epoch = _ns_name(p), p["epoch"]
        loop = asyncio.get_running_loop()
        while ns.epoch != epoch:
            if ns.epoch > epoch:
                raise _older_epoch(name, epoch, ns.epoch)
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                async with asyncio.timeout(left):
                    # (rank 0 holds the newest: an epoch past its own was
                    # never given, and a follower would wait for ever)
                    newest = ns.epoch if self.leader else await self._epoch_at_rank_0(name)
                    if newest < epoch:
                        raise ErrnoError(errno.EINVAL, f"namespace {name} has no epoch "
                                                       f"{epoch} (it is at epoch {newest})")
                    if newest > epoch:
                        raise _older_epoch(name, epoch, newest)
                    await ns.until_removed()
                    loading = asyncio.ensure_future(self.get_ns(name, msg))
                    loading.add_done_callback(outcome_read)
                    ns = await asyncio.shield(loading)
            except TimeoutError:
                raise ErrnoError(errno.ETIMEDOUT, f"version {p['rootseq']} not reached in "
                                                  f"{p['timeout']:g} s; this rank still holds "
                                                  f"an older namespace {name} (epoch "
                                                  f"{ns.epoch}, not {epoch})") from None
        return ns

    async def _epoch_at_rank_0(self, name: str) -> int:
        """The epoch of namespace ``name`` rank 0 holds now (``ENOTSUP`` if
        none): asked with this rank's credentials, never answered to a
        client, only compared (:meth:`_life_of`)."""
        try:
            resp = await self.h.rpc("kvs.getroot", {"namespace": name}, nodeid=0)
        except RemoteError as exc:
            raise from_rank_0(exc) from None
        return int(resp.get("epoch", 0))

    def disconnect(self, msg: Message) -> None:
        """A client went away: cancel its pending ``kvs.wait-version`` requests
        (a task, or the token of one that has not started)."""
        for wait in self._version_waits.pop(tuple(msg.route), ()):
            wait.cancel()

    def dropcache(self, msg: Message) -> None:
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "only the instance owner may drop caches")
        self._drop_caches()
        self.h.respond(msg, {})

    def _drop_caches(self) -> None:
        self.blobs.drop()
        self.cache.clear()
        malloc.trim()  # (what they held is scattered through the heap: give it back)

    # ================================================================ garbage

    async def gc(self, msg: Message) -> None:
        """``kvs.gc`` ``{compact?}`` -> what was kept and removed: an online
        garbage collection of the content store, run by rank 0
        (:mod:`kvs.collect`).  The instance owner's; ``EBUSY`` while one runs."""
        self._owner_only(msg, "kvs.gc")
        p = require(msg.payload)
        compact = p.get("compact", False)
        if type(compact) is not bool:
            raise ErrnoError(errno.EPROTO, "compact must be a boolean")
        if not self.leader:
            self.h.respond(msg, await self.h.rpc("kvs.gc", p, nodeid=0))
            return
        if self._content is None:
            raise ErrnoError(errno.ENOSYS, "rank 0's content store is not in this process")
        self.commits.refuse_if_stopping("no collection was made")
        self.h.respond(msg, await self._collect(compact))

    async def _collect(self, compact: bool = False) -> dict[str, Any]:
        assert self._content is not None
        result = await collector.collect(
            self._content, self._gc_roots, self._gc_forget, CHECKPOINT_KEY,
            grace=self.root_history.grace, compact=compact)
        self.counts["collections"] += 1
        self._last_gc = result
        self.log.info("gc: removed %d blobs (%d bytes) in %.3f s", result["removed"],
                      result["removed-bytes"], result["seconds"])
        if result["damaged-count"]:
            self.log.warning("gc: %d blobs that live trees name are missing or unreadable "
                             "(first: %s): what is below them cannot be read",
                             result["damaged-count"], result["damaged"][0])
        return result

    async def _collect_periodically(self) -> None:
        """Rank 0 with ``kvs.gc-period`` > 0: an online collection that often
        (skipped while one asked for runs)."""
        while True:
            await asyncio.sleep(self.gc_period)
            try:
                await self._collect()
            except ErrnoError as exc:
                if exc.errnum != errno.EBUSY:
                    self.log.error("periodic gc failed: %s", exc.errstr)
            except Exception as exc:  # (SQLite: a full disk...): tried again next period
                self.log.error("periodic gc failed: %s", exc)

    def _gc_roots(self) -> collector.Roots:
        """The roots a collection keeps: every namespace's current root and
        those about to be (live), and the roots of the grace period and
        guests' recent roots."""
        live = [ns.rootref for ns in self.namespaces.values() if ns.rootref]
        live += self.commits.unpublished
        return collector.Roots(live, [*self.root_history.recent(), *self.recent_roots.roots()])

    def _gc_forget(self, keep: set[str]) -> None:
        """A collection decided: forget the blobs this module cached that it
        does not keep (the fetches in flight are no longer shared, nor
        cached when they end: :meth:`kvs.blobs.BlobFetcher._fetch_shared`),
        and their decoded objects, so a read at a collected root fails here
        as on a rank that never read it (the memo answered it until evicted).
        Forgetting is always safe: what a commit or a read still needs is
        fetched again, from the store, which keeps what it must."""
        self.blobs.drop(keep)
        self.cache.drop(keep)

    # ================================================================ writes

    def commit(self, msg: Message) -> Awaitable[None] | None:
        """``kvs.commit``.  With the namespace at hand (the hot path) no task
        is created: the answer is sent by the transaction's outcome future,
        queued here on rank 0, relayed to rank 0 on a follower."""
        wire = msg.wire_payload  # (its size, for a relay: before it is decoded)
        p = require(msg.payload, ops=list)
        ops, leased = _check_ops(p["ops"], self.blob_limit)
        flags = _commit_flags(p)
        name = _ns_name(p)
        lease_user = msg.userid if leased else None
        ns = self.namespaces.get(name)
        if ns is None or ns.rootseq < 0 or name in self._loading:
            return self._commit(msg, p, ops, flags, _wire_size(wire), lease_user)
        ns.check_access(msg)
        if not msg.is_owner:
            _check_guest_ops(ops)
        txn_name = self._txn_name()
        if self.leader:
            outcome = self.commits.enqueue(ns, ops, flags, txn_name, lease_user)
            outcome.add_done_callback(lambda f: self._answer_commit(msg, f, ns.epoch))
            return None
        size = _wire_size(wire)
        self.commits.refuse_if_stopping()  # (one relayed now is one more to settle)
        outcome = self.relays.submit(ns, ops, flags, txn_name, size, lease_user)

        def relayed(f: asyncio.Future[tuple[int, str]]) -> None:
            if not f.cancelled() and _outran_removal(f.exception()):
                self._serve(msg, self._commit(msg, p, ops, flags, size, lease_user,
                                             stale=ns))
            else:
                self._answer_commit(msg, f, ns.epoch)

        outcome.add_done_callback(relayed)
        return None

    def _txn_name(self, again: bool = False) -> str:
        self._txn_counter += 1
        if again:  # (the same commit, relayed again: counted once)
            self.counts["commits-relayed-again"] += 1
        else:
            self.counts["commits"] += 1
        return f"{self._txn_prefix}{self._txn_counter}"

    def _answer_commit(self, msg: Message, fut: asyncio.Future[tuple[int, str]],
                       epoch: int) -> None:
        """``kvs.commit``'s answer: the root the transaction made, and which
        life of the namespace (``epoch``) it is of, for a ``kvs.wait-version``
        on another rank that must not take a namespace of the same name,
        removed since, for this one."""
        if fut.cancelled():
            self.h.respond_error(msg, errno.ECANCELED, "commit cancelled")
            return
        exc = fut.exception()
        if exc is None:
            rootseq, rootref = fut.result()
            self.h.respond(msg, {"rootref": rootref, "rootseq": rootseq, "epoch": epoch})
        elif isinstance(exc, ErrnoError):
            self.h.respond_error(msg, exc.errnum, exc.errstr)
        else:
            self.log.error("commit failed: %r", exc)
            self.h.respond_error(msg, errno.EIO, f"internal error: {exc}")

    async def _commit(self, msg: Message, p: dict[str, Any], ops: list[dict[str, Any]],
                      flags: int, size: int = 0, lease_user: int | None = None,
                      stale: Namespace | None = None) -> None:
        """The general path: a follower relays to rank 0, or the namespace is unknown.

        ``stale``: a follower relayed this commit for that namespace, and it
        outran the namespace's removal (:func:`_outran_removal`).  This
        rank's view lagged rank 0's: the client may have sent the commit
        after a namespace of the same name was created again (its create
        answered, from any rank), and must not be told it was removed.  The
        commit was never applied, so it is made again, as if it came now:
        once this rank has heard the removal (the events before it settled
        what it had relayed before), the namespace is asked of rank 0 again,
        with the access check for whoever owns it now.  If none exists then,
        its ENOTSUP stands: a point where the namespace was gone fell within
        the commit's request.  If the one found is removed in turn before
        the commit lands, it is made again the same way (each time after a
        removal this rank has heard: it ends when one lands or none is
        left)."""
        name = _ns_name(p)
        while True:
            if stale is not None:
                try:
                    async with asyncio.timeout(REMOVAL_HEARD_TIMEOUT):
                        await stale.until_removed()
                except TimeoutError:
                    raise ErrnoError(errno.ENOTSUP, f"namespace {name} was removed") from None
            ns = await self.get_ns(name, msg)
            if not msg.is_owner:
                _check_guest_ops(ops)
            txn = self._txn_name(again=stale is not None)
            if self.leader:
                rootseq, rootref = await self.commits.enqueue(ns, ops, flags, txn, lease_user)
                break
            self.commits.refuse_if_stopping()
            try:
                rootseq, rootref = await self.relays.submit(ns, ops, flags, txn, size,
                                                            lease_user)
                break
            except ErrnoError as exc:
                if not _outran_removal(exc):
                    raise
            stale = ns
        self.h.respond(msg, {"rootref": rootref, "rootseq": rootseq, "epoch": ns.epoch})

    def relaycommit(self, msg: Message) -> Awaitable[None] | None:
        """Rank 0: transactions relayed by a follower's kvs (already
        access-checked there), see :mod:`kvs.relay`.  Answered only if refused
        here, all of them; once queued, each one's outcome is published
        (``setroot`` or ``error`` naming it).  No task when the namespace is at hand."""
        if not self.leader or not msg.is_owner:
            raise ErrnoError(errno.EPERM, "kvs.relaycommit is internal to the kvs module")
        p = require(msg.payload, namespace=str, txns=list)
        txns = _check_relayed(p["txns"])
        epoch = p.get("epoch")
        ns = self.namespaces.get(p["namespace"])
        if ns is None:
            return self._relaycommit(msg, p["namespace"], epoch, txns)
        self._enqueue_relayed(ns, epoch, txns)
        self.h.settled_elsewhere(msg)
        return None

    async def _relaycommit(self, msg: Message, name: str, epoch: Any,
                           txns: list[RelayedTxn]) -> None:
        self._enqueue_relayed(await self.get_ns(name), epoch, txns)
        self.h.settled_elsewhere(msg)

    def _enqueue_relayed(self, ns: Namespace, epoch: Any, txns: list[RelayedTxn]) -> None:
        self.commits.refuse_if_stopping()  # (all of them, or none)
        if epoch is not None and epoch != ns.epoch:
            # relayed for a namespace of this name that was removed since:
            # its follower has already failed them (the removed event)
            raise ErrnoError(errno.ESTALE, f"namespace {ns.name} was removed")
        for name, flags, ops, lease_user in txns:
            self.commits.enqueue(ns, ops, flags, name,
                                 lease_user).add_done_callback(outcome_read)

    # ================================================================ namespace admin

    def _owner_only(self, msg: Message, what: str) -> None:
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, f"{what} requires the instance owner")

    async def namespace_create(self, msg: Message) -> None:
        self._owner_only(msg, "namespace-create")
        p = require(msg.payload, namespace=str)
        name = check_name(p["namespace"])
        if not self.leader:
            self.h.respond(msg, await self.h.rpc("kvs.namespace-create", p, nodeid=0))
            return
        owner = p.get("owner", self.ctx.owner_uid)
        if type(owner) is not int or not -1 <= owner < 2**32:
            raise ErrnoError(errno.EPROTO, "owner must be a uid")
        if owner in (-1, 0xFFFFFFFF):  # no user (Flux's FLUX_USERID_UNKNOWN): the owner
            owner = self.ctx.owner_uid
        flags = p.get("flags", 0)
        rootref = p.get("rootref")
        if type(flags) is not int or not (rootref is None or isinstance(rootref, str)):
            raise ErrnoError(errno.EPROTO, "flags must be an integer, rootref a string")
        if name in self.namespaces:
            raise ErrnoError(errno.EEXIST, f"namespace {name} already exists")
        if rootref is None:
            rootref, data = txn.empty_root(self.hash_name)
            if self.blobs.get(rootref) is None:
                rootref = await self._store_empty_root()
            elif self._content is not None:
                await self.refcheck.keep_whole({rootref: True}, -1)  # (-1: check it once)
        else:
            blobref.check(rootref)
            begun = self._content.collections_begun if self._content is not None else 0
            found = await self.fetcher.fetch({rootref}, keep=True)  # ENOENT: no such blob
            try:
                obj: Any = treeobj.decode(found[rootref])
            except ErrnoError:
                obj = None
            if not names_a_directory(obj):
                raise ErrnoError(errno.EINVAL, f"rootref {rootref} is not a directory")
            await self.refcheck.check_whole({rootref: True})
            await self.refcheck.keep_whole({rootref: True}, begun)
        if name in self.namespaces:  # raced with another create while storing
            raise ErrnoError(errno.EEXIST, f"namespace {name} already exists")
        ns = Namespace(name, owner, rootref, 0, flags, self._next_epoch())
        self._note_roots(ns)
        self.namespaces[name] = ns
        self.counts["namespaces-created"] += 1
        self._publish(f"kvs.namespace-{name}-created", {
            "namespace": name, "rootseq": 0, "rootref": rootref, "owner": owner,
            "flags": flags, "epoch": ns.epoch})
        self.h.respond(msg, {})

    async def namespace_remove(self, msg: Message) -> None:
        self._owner_only(msg, "namespace-remove")
        p = require(msg.payload, namespace=str)
        name = p["namespace"]
        if name in (PRIMARY, ""):  # ("" names primary, as in every other request)
            raise ErrnoError(errno.ENOTSUP, "the primary namespace cannot be removed")
        if not self.leader:
            self.h.respond(msg, await self.h.rpc("kvs.namespace-remove", p, nodeid=0))
            return
        ns = self.namespaces.pop(name, None)
        if ns is not None:
            ns.remove()
            self.leases.forget_namespace(name)
            self.counts["namespaces-removed"] += 1
            # owner and epoch: which namespace of the name went, and whose
            # (kvs-watch.namespaces reports it to its owner, once)
            self._publish(f"kvs.namespace-{name}-removed", {
                "namespace": name, "owner": ns.owner, "epoch": ns.epoch})
        self.h.respond(msg, {})

    async def namespace_list(self, msg: Message) -> None:
        """One answer, as Flux's; or, asked as a stream, the same list cut
        into answers that each fit the smallest link (``list_chunks``),
        then ``ENODATA``: one answer of every namespace did not cross a
        link once there were more than ``tbon.max-message`` holds (~500 at
        its 64 KiB minimum, ~8,000 at 1 MiB)."""
        self._owner_only(msg, "namespace-list")
        if not self.leader:
            if not msg.streaming:
                self.h.respond(msg, await self.h.rpc("kvs.namespace-list", {}, nodeid=0))
                return
            async for part in self.h.rpc_stream("kvs.namespace-list", {}, nodeid=0):
                self.h.respond(msg, part)
            self.h.respond_error(msg, errno.ENODATA)
            return
        # epoch: the last one given, so a reader of the created and removed
        # events can tell those the list already reflects (kvs-watch.namespaces)
        entries = [ns.describe() for ns in self.namespaces.values() if ns.rootseq >= 0]
        if not msg.streaming:
            self.h.respond(msg, {"epoch": self._last_epoch, "namespaces": entries})
            return
        for part in list_chunks(entries):  # (one snapshot: every part, in this turn)
            self.h.respond(msg, {"epoch": self._last_epoch, "namespaces": part})
        self.h.respond_error(msg, errno.ENODATA)

    # ================================================================ stats

    def stats_get(self, msg: Message) -> None:
        """``kvs.stats-get``, open to guests (as in Flux), but a guest sees
        only its own namespaces (:meth:`guest_stats`).  Any instance-wide
        figure moves with what other users do, so a guest could watch it
        around an act of its own -- the cache counts around committing a
        guess told whether someone stored that value already."""
        if msg.is_owner:
            self.h.respond(msg, self.stats())
        else:
            self.h.respond(msg, self.guest_stats(msg.userid))

    def guest_stats(self, userid: int) -> dict[str, Any]:
        """A guest's view, all of it (an allow-list): ``rank``, and
        ``userid``'s namespaces on this rank (at most 100, chosen before the
        cut) and their count.  Every other field is instance-wide and tells
        of other users' namespaces: the cache and its misses whether a blob
        guessed is stored or was read (a guest read a 4-digit value of
        ``primary`` that way), ``commits``, ``batches``,
        ``namespaces-created`` minus ``-removed``, the ``checkpoint``'s
        rootseq, ``gc.last.kept``."""
        mine = [(name, ns) for name, ns in self.namespaces.items() if ns.owner == userid]
        return {"rank": self.rank, "namespace-count": len(mine),
                "namespaces": self._describe(mine)}

    @staticmethod
    def _describe(held: Iterable[tuple[str, Namespace]]) -> dict[str, Any]:
        """The ``namespaces`` section: at most 100 of ``held``."""
        return {name: {"rootseq": ns.rootseq, "owner": ns.owner, "waiters": ns.waiters}
                for name, ns in islice(held, 100)}

    def stats(self) -> dict[str, Any]:
        """The instance owner's view: the counters, and at most 100
        namespaces."""
        return {
            "rank": self.rank,
            "namespace-count": len(self.namespaces),
            "heard": len(self.heard),
            "namespaces": self._describe(self.namespaces.items()),
            "cache": {"blobs": len(self.blobs), "bytes": self.blobs.blob_bytes,
                      "objects": len(self.cache), "object-bytes": self.cache.nbytes,
                      "forgotten": self.cache.forgotten,
                      # unused for kvs.cache-expire, since the start
                      "blobs-expired": self.blobs.expired,
                      "objects-expired": self.cache.expired},
            "counts": dict(self.counts),
            "checkpoint": self._checkpoint_stats(),
            "leases": self.leases.stats() if self.leader else None,
            "gc": self._gc_stats(),
            "relays-waiting": sum(len(ns.relayed or ()) for ns in self.namespaces.values()),
            "trees-known-whole": len(self.refcheck.whole_memo() or ()),
            "rpcs-pending": self.h.pending,
            "rpcs-retired": self.h.retired,
            "events": self.event_stats(),
            "pid": os.getpid(),
        }

    def clear_stats(self) -> None:
        super().clear_stats()
        self._checkpoint_counts.clear()

    def _gc_stats(self) -> dict[str, Any] | None:
        """Rank 0: the grace period, the roots it holds, whether a collection
        runs, and what the last one did."""
        if not self.leader:
            return None
        return {"grace": self.root_history.grace, "period": self.gc_period,
                "recent-roots": len(self.root_history),
                "running": self._content is not None and self._content.collection is not None,
                "last": self._last_gc}

    def _checkpoint_stats(self) -> dict[str, Any] | None:
        """Rank 0 with a statedir: the checkpoint period (seconds, 0: none),
        the rootseq last checkpointed, checkpoints written (and of them,
        those that fell back to an older root, :meth:`_checkpoint_written_root`)
        and failed, and why the newest root's last checkpoint failed (None
        once one succeeds)."""
        if not (self.leader and self.statedir):
            return None
        return {"period": self.checkpoint_period, "rootseq": self.checkpointed,
                "written": self._checkpoint_counts["written"],
                "written-fallback": self._checkpoint_counts["written-fallback"],
                "failed": self._checkpoint_counts["failed"],
                "failing": self._checkpoint_failing.why}

    # ================================================================ leases

    async def _lease_rpc(self, msg: Message) -> dict[str, Any] | None:
        """A lease request's payload on rank 0, where the leases are; on a
        follower, the request is passed there with the client's credentials
        and answered from its answer (None: answered)."""
        p = require(msg.payload)
        if self.leader:
            return p
        self.h.respond(msg, await self.h.rpc_as(msg, msg.topic, p, nodeid=0))
        return None

    async def lease_grant(self, msg: Message) -> None:
        """``kvs.lease-grant {ttl}`` -> ``{id, ttl}``: a lease that expires
        ``ttl`` seconds from now unless kept alive (kvs/leases.py)."""
        p = await self._lease_rpc(msg)
        if p is None:
            return
        self.commits.refuse_if_stopping("no lease was granted")
        lease = self.leases.grant(msg.userid, p.get("ttl"))
        self.h.respond(msg, {"id": lease.id, "ttl": lease.ttl})

    async def lease_keepalive(self, msg: Message) -> None:
        """``kvs.lease-keepalive {id}`` -> ``{ttl}``: its full ttl again, from
        now; ``ENOENT`` once it expired or was revoked.  The lease's owner's,
        or the instance owner's."""
        p = await self._lease_rpc(msg)
        if p is None:
            return
        lease = self.leases.get(p.get("id"), msg.userid, msg.is_owner)
        self.leases.keepalive(lease)
        self.h.respond(msg, {"ttl": lease.ttl})

    async def lease_info(self, msg: Message) -> None:
        """``kvs.lease-info {id}`` -> ``{id, owner, ttl, ttl_left, key-count,
        keys: {NS: [key, ...]}}`` (at most 1,000 keys a namespace, 32 KiB of
        names in all: :data:`kvs.leases.INFO_BYTES`)."""
        p = await self._lease_rpc(msg)
        if p is None:
            return
        lease = self.leases.get(p.get("id"), msg.userid, msg.is_owner)
        self.h.respond(msg, self.leases.describe(lease))

    async def lease_list(self, msg: Message) -> None:
        """``kvs.lease-list {after?}`` -> ``{leases: [{id, owner, ttl,
        ttl_left, key-count}, ...], more}``: the requester's live leases
        (every one for the instance owner) in id order, from the first past
        ``after`` (default 0), 500 an answer (etcd's ``lease list``: a
        holder that lost its ids -- a crashed script -- can still find and
        revoke them)."""
        p = await self._lease_rpc(msg)
        if p is None:
            return
        self.h.respond(msg, self.leases.listing(p.get("after", 0), msg.userid, msg.is_owner))

    async def lease_revoke(self, msg: Message) -> None:
        """``kvs.lease-revoke {id}`` -> ``{rootseqs: {NS: rootseq}}``: end the
        lease now; answered once the unlinks of its keys are applied, with
        the version each namespace reached (a follower answers once it has
        reached them too: read-your-writes, as a commit)."""
        p = require(msg.payload)
        if not self.leader:
            resp = await self.h.rpc_as(msg, msg.topic, p, nodeid=0)
            got = resp.get("rootseqs") if isinstance(resp, dict) else None
            for name, seq in (got if isinstance(got, dict) else {}).items():
                ns = self.namespaces.get(name)
                if ns is not None and type(seq) is int and ns.rootseq < seq:
                    try:
                        await asyncio.wait_for(ns.wait_version(seq), 10)
                    except (TimeoutError, ErrnoError):
                        break  # (removed, or this rank lags: the answer stands)
            self.h.respond(msg, resp)
            return
        going = self._unlinking.get(p["id"]) if type(p.get("id")) is int else None
        if going is not None and going[0].ended:
            # It ended (expired, or another revoke) and its keys are being
            # unlinked now: answered once they are, as a revoke of a live
            # lease is -- not at once with ENOENT, which the client takes for
            # "already gone", and a lock released so was still held.
            if going[0].owner != msg.userid and not msg.is_owner:
                raise ErrnoError(errno.EPERM, f"lease {p['id']} belongs to another user")
            self.h.respond(msg, {"rootseqs": await asyncio.shield(going[1])})
            return
        lease = self.leases.get(p.get("id"), msg.userid, msg.is_owner)
        self.leases.end(lease, "revoked", unlink=False)
        self.h.respond(msg, {"rootseqs": await self._unlink_leased(lease)})

    def _lease_ended(self, lease: Lease) -> None:
        """The lease table's ``on_end``: ``lease`` expired (or was attached
        to after it ended) with keys attached: unlink them.  Marked as
        being unlinked at once, not when the task first runs: a revoke read
        in between was answered ``ENOENT``, "already gone", with the keys
        still there (see :meth:`lease_revoke`)."""
        fut = self._mark_unlinking(lease)

        def never_ran(_task: asyncio.Task[Any]) -> None:
            if not fut.done():  # (cancelled before it ran: the module stops)
                if self._unlinking.get(lease.id, (None, None))[1] is fut:
                    del self._unlinking[lease.id]
                fut.set_result({})

        self.spawn(self._unlink_leased(lease, fut)).add_done_callback(never_ran)

    def _mark_unlinking(self, lease: Lease) -> asyncio.Future[dict[str, int]]:
        """``lease``'s keys are being unlinked: a revoke meanwhile waits
        for the future returned (the versions reached), set once they are."""
        fut: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
        self._unlinking[lease.id] = (lease, fut)
        return fut

    async def _unlink_leased(self, lease: Lease,
                             fut: asyncio.Future[dict[str, int]] | None = None
                             ) -> dict[str, int]:
        """Commit the unlinks of ended ``lease``'s keys (:meth:`_unlink_pass`);
        the version each namespace reached.  If some fail (a full disk: the
        commit fails with the writer's errno), the keys stay attached and
        :meth:`_retry_unlinks` tries again until they are applied: before,
        they stayed until a restart with a statedir, and only a log line
        said so."""
        if fut is None:
            fut = self._mark_unlinking(lease)
        seqs: dict[str, int] = {}
        try:
            seqs, failed = await self._unlink_pass(lease)
        finally:
            if self._unlinking.get(lease.id, (None, None))[1] is fut:
                del self._unlinking[lease.id]
            fut.set_result(seqs)
        if failed and self.commits.stopping:
            name, exc = failed[0]
            self.log.info("lease %d ended as the kvs module stops: its keys in namespace %s "
                          "stay (%s)%s", lease.id, name, exc.errstr,
                          "; the checkpoint keeps the lease, and they are unlinked after "
                          "the restart" if self.statedir and name == PRIMARY else "")
        elif failed and lease not in self.leases.retrying:
            self.leases.retrying.add(lease)
            name, exc = failed[0]
            left = min(lease.keys.get(name, ()), default=None)
            self.log.error("lease %d ended, but unlinking its %d keys in namespace %s failed "
                           "(%s): retrying until applied (first: %s)", lease.id,
                           len(lease.keys.get(name, ())), name, exc.errstr, [left])
            self.spawn(self._retry_unlinks(lease))
        return seqs

    async def _unlink_pass(self, lease: Lease) -> tuple[dict[str, int],
                                                        list[tuple[str, ErrnoError]]]:
        """One try at the unlinks of ended ``lease``'s keys, one transaction
        per namespace (more for very many keys: :func:`LeaseTable.unlink_ops`),
        skipping a namespace removed since: the version each reached, and
        the namespaces whose unlink failed, with the error.  The keys are
        chosen when each transaction is applied, so one detached meanwhile
        stays.

        Any other exception (a bug: the pipeline answers its own with
        ``EIO``, so none is known to come here) is a failure too, as
        ``EIO``: logged with its traceback once per lease, counted
        (``unlink-errors``), and retried like an errno.  Let through, it
        ended the first try (an expiry's task) or the retries silently,
        and the keys stayed attached for ever, with the lease in no table
        that tries it again."""
        seqs: dict[str, int] = {}
        failed: list[tuple[str, ErrnoError]] = []
        for name in list(lease.keys):
            while lease.keys.get(name):
                ns = self.namespaces.get(name)
                if ns is None or ns.removed:
                    break
                try:
                    seqs[name] = (await self.commits.enqueue(
                        ns, [], NO_MERGE, self._txn_name(), revoke=lease))[0]
                except ErrnoError as exc:
                    if ns.removed:
                        break  # (its keys went with it)
                    self.leases.counts["unlink-failures"] += 1
                    failed.append((name, exc))
                    break
                except Exception as exc:  # (not CancelledError: a stop ends the tries)
                    self.leases.counts["unlink-failures"] += 1
                    self.leases.counts["unlink-errors"] += 1
                    if not lease.unlink_error_logged:
                        lease.unlink_error_logged = True
                        self.log.exception("lease %d: unlinking its keys in namespace %s "
                                           "raised an unexpected error", lease.id, name)
                    failed.append((name, ErrnoError(errno.EIO, f"internal error: {exc!r}")))
                    break
        return seqs, failed

    async def _retry_unlinks(self, lease: Lease) -> None:
        """Try the failed unlinks of ended ``lease`` again, after
        :data:`UNLINK_RETRY_MIN` seconds doubling to :data:`UNLINK_RETRY_MAX`,
        until none fails: its keys are unlinked, detached by a write, or
        their namespace removed (each pass takes only what is still
        attached).  Logged once at the end, not per attempt.  At stop it
        gives up: the keys stay attached, and a statedir's checkpoint keeps
        the lease, which expires again after the restart."""
        delay = UNLINK_RETRY_MIN
        tries = 0
        try:
            while not self.commits.stopping:
                await asyncio.sleep(delay)  # (a backoff, not a wait for an event)
                if self.commits.stopping:
                    break
                tries += 1
                self.leases.counts["unlink-retries"] += 1
                _seqs, failed = await self._unlink_pass(lease)
                if not failed:
                    self.log.info("lease %d: its keys' unlinks are done after %d retries",
                                  lease.id, tries)
                    return
                delay = min(delay * 2, UNLINK_RETRY_MAX)
        finally:
            self.leases.retrying.discard(lease)

