"""Rank 0's commit pipeline: queue, merge, apply, store, set the root, publish.

Every transaction reaches it through :meth:`CommitPipeline.enqueue` -- a
client's ``kvs.commit`` on rank 0, or a follower's relayed by
``kvs.relaycommit`` (:mod:`kvs.relay`) -- and is answered by the future it
returns.  Per namespace, one task (:meth:`CommitPipeline._run_queue`) takes
the queued transactions in order, **merges** adjacent ones with equal flags
into one batch, and for each batch:

1. waits for room in the content module's write-back backlog
   (``content.backlog-bytes``), or fails the batch with the writer's errno;
   below the free-space reserve (``content.disk-reserve-bytes``) fails the
   transactions that write data with ``ENOSPC``, keeping those that only
   unlink (how an operator makes room while it runs) -- and above it, a
   transaction whose values would take the room below it;
2. applies the ops with the I/O-free engine :mod:`kvs.txn`, fetching what
   it misses (:mod:`kvs.blobs`), and checks the blobs they name
   (:mod:`kvs.refcheck`);
3. stores the new blobs, keeps the new root alive for a garbage
   collection until it is set (:attr:`CommitPipeline.unpublished`), and,
   for a ``SYNC`` commit (and at stop, for every batch of the primary
   namespace), flushes and checkpoints it;
4. sets the root and publishes ``kvs.namespace-<NS>-setroot`` (carrying
   small commits' new blobs), or an ``error`` event naming the failed
   transactions.  A merged batch that fails is split and replayed one by
   one, so only the faulty transaction fails.

The kvs module (:mod:`kvs.module`) checks requests and access, and owns the
namespaces, events and checkpoints; this module only turns queued
transactions into roots.  At stop, :meth:`CommitPipeline.drain` lets the
queued transactions finish.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

from broker import codec
from broker.content.module import ContentModule
from broker.errors import ErrnoError
from broker.rpc import HandleCore
from broker.services import EVENT_HEADER_ROOM
from kvs import collect as collector
from kvs import treeobj, txn
from kvs.blobs import BlobFetcher, BlobStore
from kvs.leases import Lease, LeaseTable
from kvs.namespaces import PRIMARY, Namespace, Pending
from kvs.refcheck import RefChecker

MAX_PRIMARY_ROOTS = 65536
"""Roots of the primary namespace :attr:`CommitPipeline.primary_roots` holds
at most (the oldest go first): a few MB.  It holds only those not yet known
written, and writes fail (a full disk) for long only while commits wait."""


class SetRoot(NamedTuple):
    """A root rank 0 set in the primary namespace, and what a checkpoint
    needs to know whether it may name it without writing anything first."""

    rootseq: int
    rootref: str
    store: int
    """The content module's ``store_seq`` when it was set: its blobs are
    written once ``written_through()`` reaches this."""
    collections: int
    """``collections_begun`` then: none began since, none deleted its blobs."""
    at: float
    """``time.monotonic()`` then, after the root history noted it."""


def take_batch(q: deque[Pending], merge: bool) -> list[Pending]:
    """Take the next batch off ``q``: its first transaction and, with
    ``merge`` (unless that one is ``NO_MERGE``), those after it with the same
    flags, as long as their ops add up to at most :data:`kvs.txn.MAX_OPS`.
    A batch is applied in one go on rank 0's loop: a pipeline of big commits
    merged whole held every other client for as long as all of them took."""
    first = q.popleft()
    batch = [first]
    if merge and not first.flags & txn.NO_MERGE:
        nops = len(first.ops)
        while q and q[0].flags == first.flags and nops + len(q[0].ops) <= txn.MAX_OPS:
            nops += len(q[0].ops)
            batch.append(q.popleft())
    return batch


def names_within(names: list[str], room: int) -> list[list[str]]:
    """``names`` in order, cut into runs that each take at most ``room``
    bytes packed (bounded as msgpack's 4n + 5 for a str of n characters),
    at least one name a run: what one event may list."""
    runs: list[list[str]] = []
    run: list[str] = []
    used = 0
    for name in names:
        size = 4 * len(name) + 5
        if run and used + size > room:
            runs.append(run)
            run, used = [], 0
        run.append(name)
        used += size
    if run:
        runs.append(run)
    return runs


def _adds_data(p: Pending) -> bool:
    """Whether transaction ``p`` writes a value or a directory (a dirent
    that is not an ``EXPECT`` condition): refused below the free-space
    reserve.  An unlink adds directory blobs too, but only smaller ones
    than those it replaces, and it is how an operator makes room."""
    if p.revoke is not None:  # (a lease's keys unlinked)
        return False
    for op in p.ops:
        if op.get("dirent") is not None and not op.get("flags", 0) & txn.EXPECT:
            return True
    return False


def _value_bytes(p: Pending) -> int:
    """The bytes of the values transaction ``p`` writes (``val`` dirents,
    at any depth of a ``dir`` one; not ``EXPECT`` conditions): what it will
    add to the store, less its directories.  A transaction bigger than the
    room left is refused below the free-space reserve even when the store
    is not (:meth:`CommitPipeline._refuse_for_space`)."""
    n = 0
    todo: list[Any] = []
    for op in p.ops:  # (the common case, a val, without the walk below)
        dirent = op.get("dirent")
        if dirent is None or op.get("flags", 0) & txn.EXPECT:
            continue
        data = dirent.get("data")
        if dirent.get("type") == "val" and isinstance(data, (bytes, bytearray, str)):
            n += len(data)
        else:
            todo.append(dirent)
    while todo:
        obj = todo.pop()
        if not isinstance(obj, dict):
            continue
        data = obj.get("data")
        if obj.get("type") == "val" and isinstance(data, (bytes, bytearray, str)):
            n += len(data)
        elif obj.get("type") == "dir" and isinstance(data, dict):
            todo.extend(data.values())
    return n


class CommitPipeline:
    """Rank 0: applies each namespace's queued transactions (see the module
    docstring).  Its collaborators are the kvs module's, given here so that
    what a commit touches is visible: ``spawn`` runs a task the module owns,
    ``publish`` sends a namespace event, ``checkpoint`` records a primary
    root (a ``SYNC`` commit's)."""

    def __init__(self, *, log: logging.Logger, counts: Counter[str],
                 spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
                 cache: treeobj.BlobCache, blobs: BlobStore, fetcher: BlobFetcher,
                 refcheck: RefChecker, publish: Callable[[str, dict[str, Any]], None],
                 checkpoint: Callable[[str, int, Any], Awaitable[bool]], hash_name: str,
                 statedir: str, root_history: collector.RootHistory,
                 prime_limit: int, event_limit: int = codec.MAX_LINK_MESSAGE,
                 merge: bool = True) -> None:
        self.log = log
        self.counts = counts
        self.spawn = spawn
        self.cache = cache
        self.blobs = blobs
        self.fetch = fetcher.fetch
        self.refcheck = refcheck
        self.publish = publish
        self.checkpoint = checkpoint
        self.hash_name = hash_name
        self.statedir = statedir
        self.root_history = root_history
        self.prime_limit = prime_limit
        """A setroot event carries the commit's new blobs up to this total
        (``kvs.setroot-blob-limit``)."""
        self.merge = merge
        """``kvs.transaction-merge``: false applies every commit alone."""
        self.event_limit = event_limit - EVENT_HEADER_ROOM
        """The most bytes a namespace event's topic and payload may take:
        every link carries it (``tbon.max-message``, less a header's room),
        or no rank but 0 would ever see it (:meth:`_setroot_event`)."""
        self.h: HandleCore  # (the kvs module's, bound at its start)
        self.leases: LeaseTable | None = None
        """Rank 0's leases (set at start): a batch naming one is checked
        against it, and attaches or detaches keys once applied."""
        self.content: ContentModule | None = None
        """Rank 0's content module when it is in this process with the kvs
        module's hash (set at start): new blobs go to it by a call instead
        of a ``content.store`` request."""
        self.stopping = False
        """Set by the kvs module's stop: new transactions are refused (``ENOSYS``)."""
        self._queue_runs: set[asyncio.Task[None]] = set()
        self._checkpointing: set[asyncio.Task[Any]] = set()
        """Queue runs writing a ``SYNC`` commit's checkpoint: past the point
        of no return (its root may be on disk), so a stop that gives up on
        late runs waits for these instead of failing them."""
        self._gave_up = False
        """Set when a stop gave up waiting: queue runs answer what is left ENOSYS."""
        self.unpublished: Counter[str] = Counter()
        """Roots made and stored, not yet set (a commit between its store
        and its new root): live, for a garbage collection."""
        self._admitted: dict[int, int] = {}
        """Per namespace (by ``id``: a removed one may still be applying a
        batch when a new one of its name starts), the bytes its batch was
        admitted with by the reserve's check and has not stored yet
        (:meth:`_admit`)."""
        self.primary_roots: deque[SetRoot] = deque(maxlen=MAX_PRIMARY_ROOTS)
        """Rank 0 with a statedir: the primary roots set since the newest one
        known written (which stays first), oldest first -- what a checkpoint
        that cannot write the newest root's blobs falls back to."""

    def _note_primary_root(self, ns: Namespace, content: ContentModule) -> None:
        roots = self.primary_roots
        roots.append(SetRoot(ns.rootseq, ns.rootref, content.store_seq,
                             content.collections_begun, time.monotonic()))
        through = content.written_through()
        while len(roots) > 1 and roots[1].store <= through:
            roots.popleft()  # (a newer one is written too)

    def newest_written_root(self) -> SetRoot | None:
        """The newest primary root whose blobs are all written to SQLite
        (with those of every root before it), if a collection cannot have
        deleted any of them since it was set (none began since, or it was
        set in the grace period still running: a collection keeps the roots
        of its grace period -- this root, not any with the same rootref)."""
        if self.content is None:
            return None
        through = self.content.written_through()
        best = None
        for root in self.primary_roots:
            if root.store > through:
                break
            best = root
        if best is None or (best.collections != self.content.collections_begun
                            and not self.root_history.noted_recently_by(best.rootref,
                                                                        best.at)):
            return None
        return best

    async def drain(self, timeout: float) -> None:
        """At stop (after :attr:`stopping` is set): wait up to ``timeout``
        seconds for the queued transactions (they are, or are about to be,
        acknowledged), then fail what is left with ``ENOSYS``."""
        if self._queue_runs:
            _done, late = await asyncio.wait(self._queue_runs, timeout=timeout)
            if late:
                self.log.error("%d namespaces still committing after %g s at stop: "
                               "their transactions fail with ENOSYS", len(late),
                               timeout)
                # Stopped before the checkpoint picks its root: one they
                # acknowledged after it would be lost at the next start.  A
                # run writing a SYNC commit's checkpoint finishes that commit
                # (its root may be on disk already), then stops too.
                self._gave_up = True
                for run in late:
                    if run not in self._checkpointing:
                        run.cancel()
                await asyncio.gather(*late, return_exceptions=True)

    def publish_error(self, ns: Namespace, names: list[str], exc: ErrnoError) -> None:
        """The ``error`` event: transactions ``names`` failed (a follower that
        relayed one of them answers its client from it).  In as many events
        as it takes for each to fit a link: a batch failed whole (no room,
        a full disk) may hold thousands of transactions of no ops, and one
        event naming them all was refused, its followers' clients never
        answered."""
        topic = f"kvs.namespace-{ns.name}-error"
        errstr = exc.errstr or ""
        room = self.event_limit - 256 - 4 * (len(topic) + len(ns.name) + len(errstr))
        for run in names_within(names, max(room, 1)):
            self.publish(topic, {"namespace": ns.name, "names": run, "errnum": exc.errnum,
                                 "errstr": exc.errstr})

    def refuse_if_stopping(self, nothing_done: str = "the transaction was not applied") -> None:
        """``ENOSYS`` once the module stops, saying what was not done."""
        if self.stopping:
            raise ErrnoError(errno.ENOSYS, f"the kvs module is stopping: {nothing_done}")

    def enqueue(self, ns: Namespace, ops: list[dict[str, Any]], flags: int,
                name: str, lease_user: int | None = None,
                revoke: Lease | None = None) -> asyncio.Future[tuple[int, str]]:
        """Queue transaction ``name`` in ``ns``; the future resolves to
        ``(rootseq, rootref)`` once its root is set, or fails with its errno.
        ``lease_user``: the committer's uid, when an op names a lease;
        ``revoke``: an ended lease whose keys this transaction unlinks
        (``ops`` empty: they are computed when it is applied)."""
        self.refuse_if_stopping()
        fut: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        q = ns.queue
        if q is None:
            q = ns.queue = deque()
        q.append(Pending(ops, flags, name, fut, lease_user, revoke))
        if not ns.committing:
            ns.committing = True
            run = self.spawn(self._run_queue(ns))
            self._queue_runs.add(run)
            run.add_done_callback(self._queue_runs.discard)
        return fut

    async def _run_queue(self, ns: Namespace) -> None:
        """Rank 0: apply a namespace's queued transactions, merging adjacent ones."""
        batch: list[Pending] = []
        q = ns.queue
        try:
            while q and not ns.removed:
                if self._gave_up:
                    self._fail_stopped(ns, [])
                    break
                # Back-pressure (content.backlog-bytes): while the writer is
                # behind, wait -- the queue grows meanwhile and merges into
                # bigger batches -- or fail the next batch with its errno.
                batch = []
                no_room = await self._room()
                if not q or ns.removed:
                    break
                batch = take_batch(q, self.merge)
                if no_room is not None:
                    self.counts["commits-failed"] += len(batch)
                    self._fail(ns, batch, no_room)
                    continue
                if self.content is not None:
                    batch = self._refuse_for_space(ns, batch, self.content)
                    if not batch:
                        continue
                try:
                    await self._apply_batch(ns, batch)
                except Exception as exc:  # a bug: fail the batch, never leave it hanging
                    self.log.exception("commit batch in %s failed", ns.name)
                    self._fail(ns, batch, ErrnoError(errno.EIO, f"internal error: {exc}"))
                finally:
                    self._unadmit(ns)  # (what it did not store: it failed, or was split)
                if q:  # more than one batch's worth queued: let the loop serve
                    await asyncio.sleep(0)  # others between them
        except asyncio.CancelledError:  # stop gave up waiting for it: answer every one
            self._fail_stopped(ns, batch)
            raise
        except Exception as exc:  # a bug outside a batch's apply (the wait for room,
            # an error event): the queue's task ends, so answer every one it held
            # rather than leave them waiting for ever
            self.log.exception("the commit queue of %s failed", ns.name)
            self._fail_queued(ns, batch, ErrnoError(errno.EIO, f"internal error: {exc}"))
        finally:
            ns.committing = False
            if not q:
                ns.queue = None  # idle again: give the deque back

    def _fail_stopped(self, ns: Namespace, batch: list[Pending]) -> None:
        """Answer ``batch`` and everything still queued in ``ns``: not applied."""
        self._fail_queued(ns, batch, ErrnoError(
            errno.ENOSYS, "the kvs module stopped before the transaction was applied"))

    def _fail_queued(self, ns: Namespace, batch: list[Pending], exc: ErrnoError) -> None:
        """Fail ``batch`` and everything still queued in ``ns`` with ``exc``."""
        q = ns.queue
        if q:
            batch = [*batch, *q]
            q.clear()
        self._fail(ns, batch, exc)

    def _fail(self, ns: Namespace, batch: list[Pending], exc: ErrnoError) -> None:
        """Fail the transactions of ``batch`` not answered yet, each with its
        own copy of ``exc`` (see :meth:`_apply_pinned`), and say so in an
        ``error`` event (a follower that relayed one answers from it)."""
        batch = [p for p in batch if not p.future.done()]
        for p in batch:
            p.future.set_exception(ErrnoError(exc.errnum, exc.errstr))
        if batch:
            self.publish_error(ns, [p.name for p in batch], exc)

    def _refuse_for_space(self, ns: Namespace, batch: list[Pending],
                          content: ContentModule) -> list[Pending]:
        """Below the free-space reserve (``content.disk-reserve-bytes``), fail
        the transactions of ``batch`` that add data with ``ENOSPC``; the
        rest of the batch, to apply: those that only unlink or expect (and
        a lease's revocation), which are how room is made while it runs.
        A transaction whose values would take the room below the reserve
        (or the data over ``content.store-quota-bytes``) is refused alone,
        in the order of the batch: its write would fill the disk.  Off the
        reserve this costs a sum of the values' sizes, a comparison and the
        admitted bytes' bookkeeping (:meth:`_admit`)."""
        if not (content.disk_reserve or content.store_quota):
            return batch
        refused = content.refusal()
        if refused is None:
            sizes = [_value_bytes(p) for p in batch]
            total = sum(sizes)
            if content.refusal(total) is None:
                self._admit(ns, content, total)
                return batch
            keep, adding = [], 0
            for p, size in zip(batch, sizes, strict=True):
                too_big = content.refusal(adding + size) if size else None
                if too_big is None:
                    adding += size
                    keep.append(p)
                else:
                    self.counts["commits-failed"] += 1
                    self._fail(ns, [p], too_big)
            self._admit(ns, content, adding)
            return keep
        keep = [p for p in batch if not _adds_data(p)]
        if len(keep) < len(batch):
            failed = [p for p in batch if _adds_data(p)]
            self.counts["commits-failed"] += len(failed)
            self._fail(ns, failed, refused)
        return keep

    def _admit(self, ns: Namespace, content: ContentModule, size: int) -> None:
        """``ns``'s batch was admitted with ``size`` bytes of values: counted
        by the reserve's checks (:attr:`ContentModule.admitted`) until it
        stores them (:meth:`_unadmit`), so that the batches of other
        namespaces checked meanwhile count them -- between its check and
        its store a batch may wait (a blob to read from the store, its
        thread busy), and two batches that fit alone were both admitted."""
        if size:
            self._admitted[id(ns)] = size
            content.admitted += size

    def _unadmit(self, ns: Namespace) -> None:
        """``ns``'s batch stored its blobs (counted as stored from then on:
        its values are among them), or ended without: its admitted bytes
        are no longer counted as admitted.  (A batch split after a failed
        lease stores in parts, and its later parts are not counted
        meanwhile: a rare case, and a batch's bytes, small beside a reserve.)"""
        size = self._admitted.pop(id(ns), 0)
        if size and self.content is not None:
            self.content.admitted -= size

    async def _room(self) -> ErrnoError | None:
        """Wait for room in rank 0's write-back backlog (:meth:`ContentModule.room`);
        the errno that stopped the wait, if the writer fails."""
        if self.content is None or self.stopping:
            return None
        try:
            await self.content.room()
        except ErrnoError as exc:
            exc.__traceback__ = None  # (see _apply_pinned)
            return exc
        return None

    async def _apply_batch(self, ns: Namespace, batch: list[Pending]) -> None:
        pinned: list[str] = []
        try:
            await self._apply_pinned(ns, batch, pinned)
        finally:
            for ref in pinned:
                self.unpublished[ref] -= 1
                if not self.unpublished[ref]:
                    del self.unpublished[ref]

    async def _apply_pinned(self, ns: Namespace, batch: list[Pending], pinned: list[str]) -> None:
        """:meth:`_apply_batch`: the root it makes is in :attr:`unpublished`
        (``pinned``) from its blobs' store until it is set."""
        ops = batch[0].ops if len(batch) == 1 else [op for p in batch for op in p.ops]
        sync = any(p.flags & txn.SYNC for p in batch)
        begun = self.content.collections_begun if self.content is not None else 0
        leases = self.leases
        found: dict[int, Lease] = {}
        if leases is not None and batch[0].revoke is not None:  # (NO_MERGE: alone)
            ops = leases.unlink_ops(ns.name, batch[0].revoke)
            if not ops:  # every key was detached since: nothing to do
                batch[0].future.set_result((ns.rootseq, ns.rootref))
                return
        leased = False
        if leases is not None:
            # (a plain loop: any() over a generator cost an unmerged commit
            # 0.48 us where this costs 0.05 -- the hot path pays no more
            # than a dict lookup or two for leases it does not use)
            for p in batch:
                if p.lease_user is not None:
                    leased = True
                    break
        try:
            if leased:
                assert leases is not None
                # (a dead lease fails its transaction whole: a merged batch is
                # split below, so only that one fails)
                found = leases.check((p.lease_user, p.ops) for p in batch
                                     if p.lease_user is not None)
            result, named = await self._apply(ns, ops)
            setroot = self._setroot_event(ns, batch, result)
            # Storing may fail too (EFBIG over content.blob-size-limit): that
            # fails the transaction like any other error, before the new root
            # exists anywhere.
            if result.new_blobs:
                if self.content is not None:
                    self.content.store_hashed(result.new_blobs)
                    if self._admitted:  # (what it adds counts as stored now)
                        self._unadmit(ns)
                else:
                    await self.h.rpc("content.store",
                                     {"blobs": list(result.new_blobs.values())})
            for ref, data in result.new_blobs.items():
                self.blobs.put(ref, data)
            # From here until it is set, a garbage collection must keep this
            # root whole: its blobs are stored, and may be before the
            # collection's barrier while the root is set after its listing.
            self.unpublished[result.rootref] += 1
            pinned.append(result.rootref)
            # The last check that can fail the transaction, before a SYNC
            # commit checkpoints its root: a failed commit's root must not be
            # the one a restart finds.  A collection that begins after it
            # keeps the pinned root whole.
            if named:
                await self.refcheck.keep_whole(named, begun)
            # At stop, a batch of the primary namespace is checkpointed
            # before it is answered, as a SYNC one: answered first, it was
            # lost (with every commit since the last checkpoint) if rank 0
            # was killed before the final checkpoint was written -- as
            # kvbroker start does to a rank still stopping 15 s after its
            # SIGTERM, while that checkpoint writes a slow disk's backlog.
            # (Decided here, after the last await before the answer: any
            # answer given once the stop began follows a checkpoint.)
            stop_sync = self.stopping and ns.name == PRIMARY and bool(self.statedir)
            if sync or stop_sync:
                await self.h.rpc("content.flush", {})
                if ns.name == PRIMARY and self.statedir and not ns.removed:
                    task = asyncio.current_task()
                    assert task is not None
                    self._checkpointing.add(task)
                    try:
                        # (with the lease attachments these ops make once
                        # applied, or a restart would find the keys unleased)
                        await self.checkpoint(result.rootref, ns.rootseq + 1,
                                              (_with_resolved(ops, result.through), found)
                                              if leases is not None and (
                                                  found or ns.name in leases.attached)
                                              else None)
                    finally:
                        self._checkpointing.discard(task)
        except Exception as exc:
            # An exception that is no errno (a bug: a RecursionError in the
            # engine) is one transaction's too, found as a merged batch is
            # split: it failed every transaction merged with the faulty one
            # (EIO), and clients that wrote nothing wrong lost their commits
            # (a data-model probe).  Logged with its traceback once, alone.
            # (A fault of no transaction's -- a store that fails -- is met
            # again by each one replayed, and logged for each: rare, and
            # each is answered with it.)
            if isinstance(exc, ErrnoError):
                err = exc
            else:
                if len(batch) == 1:
                    self.log.exception("a commit in %s failed", ns.name)
                err = ErrnoError(errno.EIO, f"internal error: {exc}")
            # Let go of the frames ``exc`` went through (they hold the ops
            # and the blobs made for them), and give a future a fresh
            # exception: the traceback made cycles (this frame -> batch ->
            # future -> exc; a failed blob fetch's task -> exc -> the frame
            # waiting for it) that kept every failed commit's data until a
            # full collection, rare with a rank's raised thresholds (six
            # EFBIG puts of 530 MB left rank 0 at 3.2 GB).
            exc.__traceback__ = None
            del exc
            if len(batch) > 1:
                self.counts["merges-split"] += 1
                for p in batch:  # replay one by one: only the faulty one fails
                    await self._apply_batch(ns, [p])
                return
            self.counts["commits-failed"] += 1
            p = batch[0]
            if not p.future.done():
                p.future.set_exception(ErrnoError(err.errnum, err.errstr))
            self.publish_error(ns, [p.name], err)
            return
        if ns.removed:  # removed while this batch was being applied
            err = ErrnoError(errno.ENOTSUP, f"namespace {ns.name} was removed")
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(err)
            return
        ns.set_root(ns.rootseq + 1, result.rootref)
        setroot["rootseq"] = ns.rootseq  # (the root just set, as ever)
        if leases is not None and (found or ns.name in leases.attached):
            leases.applied(ns.name, _with_resolved(ops, result.through), found)
        self.root_history.note(result.rootref)
        if ns.name == PRIMARY and self.statedir and self.content is not None:
            self._note_primary_root(ns, self.content)
        self.counts["batches"] += 1
        if len(batch) > 1:
            self.counts["merged"] += len(batch)
        self.publish(f"kvs.namespace-{ns.name}-setroot", setroot)
        answer = (ns.rootseq, ns.rootref)
        for p in batch:
            if not p.future.done():
                p.future.set_result(answer)

    def _setroot_event(self, ns: Namespace, batch: list[Pending],
                       result: txn.TxnResult) -> dict[str, Any]:
        """The setroot event ``batch`` will publish once its root is set, or
        ``EMSGSIZE`` (the batch is then split, or the transaction fails) if
        it would not fit in a link: it lists every key written, and rank 0
        would sequence it and deliver it to its own subscribers while every
        link dropped it -- no follower would ever learn the root (stale
        reads, version waits and relayed commits waiting for ever).  The
        blobs that prime the followers' caches go only if they fit too.
        The size is packed only when a cheap bound does not settle it."""
        setroot: dict[str, Any] = {
            "namespace": ns.name, "rootseq": ns.rootseq + 1, "rootref": result.rootref,
            "names": [p.name for p in batch], "keys": result.keys, "owner": ns.owner,
        }
        room = self.event_limit - len("kvs.namespace--setroot") - 4 * len(ns.name)
        # (msgpack: a str of n characters takes at most 4n + 5 bytes)
        bound = 256 + 4 * len(ns.name) + len(result.rootref) + sum(
            4 * len(k) + 5 for k in (*setroot["names"], *result.keys))
        size = bound if bound <= room else codec.frames_size(codec.encode_payload(setroot))
        if size > room:
            raise ErrnoError(errno.EMSGSIZE, f"this commit's setroot event ({size} bytes: "
                                             f"{len(result.keys)} keys) exceeds what a link "
                                             f"carries (tbon.max-message): commit fewer keys "
                                             "at once")
        # Prime the followers' caches: a commit's new blobs are few and small
        # (O(log n) shards), so carrying them in the event saves every rank
        # that watches this namespace a content.load round trip per tree level.
        new = result.new_blobs
        if new:
            blob_bytes = sum(map(len, new.values()))
            if blob_bytes <= self.prime_limit and size + blob_bytes + 80 * len(new) <= room:
                setroot["blobs"] = new
            elif len(new) > 1:
                some = self._smallest_blobs(new, room - size)
                if some:
                    setroot["blobs"] = some
        return setroot

    def _smallest_blobs(self, new: dict[str, bytes], room: int) -> dict[str, bytes]:
        """Of a commit's new blobs, too many bytes to prime the followers
        with all, the smallest that fit (``kvs.setroot-blob-limit``, and
        ``room`` left in the event): each saves a follower that reads the
        new tree a ``content.load``.  A long eventlog's directory (27 KB at
        40,000 lines) stays behind; the new line and the root go."""
        some: dict[str, bytes] = {}
        budget = self.prime_limit
        for ref, data in sorted(new.items(), key=lambda item: len(item[1])):
            budget -= len(data)
            room -= len(data) + 80
            if budget < 0 or room < 0:
                break
            some[ref] = data
        return some

    async def _apply(self, ns: Namespace,
                     ops: list[dict[str, Any]]) -> tuple[txn.TxnResult, dict[str, bool]]:
        """Apply ``ops`` to ``ns``'s root: the result, and the existing blobs
        the ops named (valrefs, dirrefs: see :meth:`RefChecker.keep_whole`)."""
        held: set[str] = set()
        try:
            while True:
                try:
                    result = txn.apply(self.cache, ns.rootref, ops, hash_name=self.hash_name,
                                       namespace=ns.name)
                except treeobj.NeedBlobs as need:
                    await self.fetch(need.refs, held)
                    continue
                named = await self.refcheck.check_refs(ops, result.new_blobs, held)
                return result, named
        finally:
            if held:
                self.blobs.release(held)


def _with_resolved(ops: list[dict[str, Any]],
                   through: list[tuple[int, str]]) -> list[dict[str, Any]]:
    """``ops`` as the leases see them: each write a symlink led to another
    key followed by a write of that key (it detaches a key attached there
    by name: ``put l.y`` with ``l`` -> ``a`` replaces ``a.y``, and the
    lease of ``a.y`` must not unlink it later)."""
    if not through:
        return ops
    out: list[dict[str, Any]] = []
    extra = dict(through)
    for i, op in enumerate(ops):
        out.append(op)
        key = extra.get(i)
        if key is not None:
            out.append({"key": key, "flags": 0, "dirent": None})
    return out

