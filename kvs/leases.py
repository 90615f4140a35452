"""Rank 0's leases: keys that go away when their holder does (etcd's leases).

A client asks rank 0 for a lease of ``ttl`` seconds (``kvs.lease-grant``),
keeps it alive (``kvs.lease-keepalive``, each giving it its full ttl again)
and attaches keys to it by committing puts that carry ``lease: ID``.  When
the keepalives stop -- the client died, its rank died, or its way to rank 0
is cut: all state is here, so all of these end the same way -- or when it
is revoked, rank 0 commits the unlink of every key still attached, one
transaction per namespace, through the normal commit pipeline (watchers see
an unlink like any other).

Attachment follows etcd: a put with the lease attaches the key; any later
write of the key without it (put, append, mkdir, symlink, unlink) detaches
it.  Keys are paths here, so writing a key also detaches the attached keys
*below* it (their entries were replaced) and *above* it (a value that
became a directory is no longer the value the holder wrote).  A leased
put through a symlink on the path is refused (``EINVAL``): a key is
attached by its own name, and the put names the key it leads to.

The table lives in memory on rank 0.  :meth:`LeaseTable.check` and
:meth:`LeaseTable.applied` are called by the commit pipeline
(:mod:`kvs.commits`) for a batch that names a lease or touches a namespace
with attached keys; any other commit costs one dict lookup
(:attr:`LeaseTable.attached`).  The unlinks of an ended lease are computed
when their transaction is applied (:meth:`LeaseTable.unlink_ops`), so a key
detached meanwhile, by a commit queued before them, is left alone.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import heapq
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from broker.attrs import AttrSpec, integer
from broker.errors import ErrnoError
from kvs.keys import normalize
from kvs.txn import EXPECT

MIN_TTL = 1.0
"""Shortest lease, in seconds: a keepalive at a third of it must cross the
tree and back with room to spare, even on a loaded instance."""
MAX_TTL = 86400.0
"""Longest lease (a day): a lease is a liveness signal, not storage."""
UNLINK_BYTES = 16 << 10
"""The keys (bytes of their names, in UTF-8) one unlink transaction of an
ended lease takes: its setroot event lists them, and the smallest
``tbon.max-message`` is 64 KiB.  (Counted in characters, keys of 4-byte
characters made pieces of 64 KB, whose event did not fit beside a long
namespace name: the unlink failed ``EMSGSIZE`` and the keys stayed.)"""
ID_SPACE = 1 << 53
"""Lease ids are drawn at random below this (exact in a JSON double): an
id is never given again, across restarts too, whose counters a crash
rewinds -- an old holder (a shell loop of ``kvs lease keepalive ID``, a
client that reconnects) must find its lease gone, not keep another's
alive -- and is not guessed either."""
INFO_KEYS = 1000
"""``kvs.lease-info`` lists at most this many keys per namespace."""
INFO_BYTES = 32 << 10
"""... and at most this many bytes (UTF-8) of key and namespace names in
all, so that its answer fits the smallest ``tbon.max-message`` (64 KiB):
1,000 keys of 8 KB made an answer refused ``EMSGSIZE``, and the lease
could not be inspected at all.  ``key-count`` counts every key."""
READ_FIRST = 0.05
"""Seconds a lease whose deadline passed still waits, once, for the
keepalives that may wait unread in this rank's sockets (:meth:`LeaseTable._due`)..."""
STALL_GRACE = 1.0
"""... or as long as its timer fired late, up to this: after a stall of
this rank's loop (SIGSTOP, swap, a long collection) there is more to read."""
LIST_MAX = 500
"""``kvs.lease-list`` gives at most this many leases an answer (~70 bytes
each: the answer fits the smallest ``tbon.max-message``); the next are
asked for ``after`` the last."""
MAX_LEASES = AttrSpec(
    "kvs.max-leases-per-user", "10000", integer(1),
    "live kvs leases one user may hold (kvs.lease-grant past it is ENOSPC)")
"""Each lease is a timer and a record on rank 0: a user (a guest above all)
must not grow rank 0 without bound with them."""



def _writes(ops: list[dict[str, Any]],
            found: dict[int, Lease] | None) -> Iterator[tuple[str, Lease | None]]:
    """Each op of ``ops`` that writes (a condition does not), in order: its
    normalised key, and the lease of ``found`` it attaches the key to (None:
    the write detaches it) -- how :meth:`LeaseTable.applied` and a SYNC
    commit's :meth:`LeaseTable.snapshot` read a batch alike."""
    for op in ops:
        if op.get("flags", 0) & EXPECT:
            continue
        lid = op.get("lease")
        yield normalize(op["key"]), (found.get(lid) if found and type(lid) is int else None)

@dataclass(eq=False, slots=True)
class Lease:
    """One lease.  ``keys`` maps a namespace to the keys attached to this
    lease there (kept equal to :attr:`LeaseTable.attached`)."""

    id: int
    owner: int
    ttl: float
    deadline: float
    keys: dict[str, set[str]] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    ended: str = ""
    """``"expired"`` or ``"revoked"`` once ended (its unlinks may still be queued)."""
    unlink_order: dict[str, list[str]] = field(default_factory=dict)
    """Once ended: its keys in each namespace, sorted once, last first
    (:meth:`LeaseTable.unlink_ops`)."""
    graced: bool = False
    """Its deadline passed, and it waits a little for keepalives unread
    (:meth:`LeaseTable._due`)."""
    unlink_error_logged: bool = False
    """An unexpected exception (not an errno) of its unlinks was logged with
    its traceback: once per lease, its retries every 10 s do not log it again."""

    def key_count(self) -> int:
        return sum(map(len, self.keys.values()))


class _Attached:
    """The keys of one namespace attached to a lease, and for every path
    above them, how many attached keys are below it (so that writing a
    directory finds the keys it replaces without scanning them all).

    The paths above are counted by their hash, not their text: a key of
    256 levels and 8 KB has 255 paths above it, 1 MB of text that was kept
    for each such key attached (150 of them, 1.2 MB of commits, grew rank 0
    by 150 MB).  Two paths of one hash only share a count: a write of one
    then scans the keys for those really below it (:meth:`touching`)."""

    __slots__ = ("keys", "below")

    def __init__(self) -> None:
        self.keys: dict[str, Lease] = {}
        self.below: Counter[int] = Counter()

    def attach(self, key: str, lease: Lease) -> Lease | None:
        old = self.keys.get(key)
        self.keys[key] = lease
        if old is None:
            below = self.below
            for anc in _ancestors(key):
                below[hash(anc)] += 1
        return old

    def detach(self, key: str) -> Lease | None:
        lease = self.keys.pop(key, None)
        if lease is not None:
            below = self.below
            for anc in _ancestors(key):
                h = hash(anc)
                n = below[h] - 1
                if n:
                    below[h] = n
                else:
                    del below[h]
        return lease

    def touching(self, key: str) -> list[str]:
        """The attached keys a write of ``key`` replaces or changes: itself,
        those above it, those below it."""
        out = [k for k in (key, *_ancestors(key)) if k in self.keys]
        if self.below.get(hash(key)):
            prefix = key + "."
            out += [k for k in self.keys if k.startswith(prefix)]
        return out


def _ancestors(key: str) -> Iterable[str]:
    i = key.find(".")
    while i >= 0:
        yield key[:i]
        i = key.find(".", i + 1)


def _entry_fields(entry: Any) -> tuple[int, int, float] | None:
    """``(id, owner, ttl)`` of a saved lease (:meth:`LeaseTable.snapshot`,
    :meth:`LeaseTable.live_entries`); None for a malformed one (skipped)."""
    if not isinstance(entry, dict):
        return None
    lid, owner, ttl = entry.get("id"), entry.get("owner"), entry.get("ttl")
    if type(lid) is not int or type(owner) is not int or not isinstance(ttl, int | float) \
            or isinstance(ttl, bool):
        return None
    return lid, owner, float(ttl)


class LeaseTable:
    """Rank 0's leases (see the module docstring).  ``on_end`` is called
    with a lease that expired or was revoked and has keys attached: it
    queues their unlinks (one transaction per namespace)."""

    def __init__(self, owner_uid: int, max_per_user: int,
                 on_end: Callable[[Lease], None]) -> None:
        self.owner_uid = owner_uid
        self.max_per_user = max_per_user
        self.on_end = on_end
        self.live: dict[int, Lease] = {}
        self.attached: dict[str, _Attached] = {}
        """Per namespace, its attached keys (absent: none)."""
        self.ids: list[int] = []
        """Every live lease's id, sorted: the instance owner's
        ``kvs.lease-list`` takes a page of them by bisection (a scan of all
        for each page of 500 made a list of N leases cost N^2/500)."""
        self.by_owner: dict[int, dict[int, Lease]] = {}
        """The live leases of each user: a guest's ``kvs.lease-list`` looks
        at its own alone (scanning all, its time told how many others held)."""
        self.counts: Counter[str] = Counter(dict.fromkeys(
            ("granted", "expired", "revoked", "restored", "attached", "detached", "stall-graced",
             "unlink-failures", "unlink-errors", "unlink-retries"), 0))
        self.retrying: set[Lease] = set()
        """Ended leases whose unlinks failed and are tried again (kept by
        their attachments until applied: see ``KvsModule._retry_unlinks``)."""
        self.closed = False
        """Set at stop: no lease expires any more."""
        self._ended_restored: dict[int, tuple[Lease, str]] = {}
        """Leases :meth:`restore` found ended, with why, until :meth:`end_restored`."""

    # ---------------------------------------------------------------- life

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def grant(self, uid: int, ttl: Any) -> Lease:
        if type(ttl) not in (int, float):
            raise ErrnoError(errno.EPROTO, "ttl must be a number of seconds")
        if not MIN_TTL <= ttl <= MAX_TTL:  # (nan too: a number, in no range)
            raise ErrnoError(errno.EINVAL, f"a lease's ttl must be {MIN_TTL:g} to "
                                           f"{MAX_TTL:g} seconds, not {ttl:g}")
        held = len(self.by_owner.get(uid, ()))
        if held >= self.max_per_user:
            raise ErrnoError(errno.ENOSPC, f"this user holds {held} leases "
                                           "(kvs.max-leases-per-user): revoke some first")
        lease_id = secrets.randbelow(ID_SPACE - 1) + 1
        while lease_id in self.live:
            lease_id = secrets.randbelow(ID_SPACE - 1) + 1
        lease = self._add(lease_id, uid, float(ttl))
        self.counts["granted"] += 1
        return lease

    def _add(self, lease_id: int, uid: int, ttl: float) -> Lease:
        lease = Lease(lease_id, uid, ttl, 0.0)
        self.live[lease_id] = lease
        bisect.insort(self.ids, lease_id)
        self.by_owner.setdefault(uid, {})[lease_id] = lease
        self.keepalive(lease)
        return lease

    def get(self, lease_id: Any, uid: int, is_owner: bool) -> Lease:
        """The live lease ``lease_id``: ``ENOENT`` if it expired, was revoked
        or never was; ``EPERM`` unless ``uid`` holds it or is the instance
        owner (``is_owner``)."""
        if type(lease_id) is not int:
            raise ErrnoError(errno.EPROTO, "a lease id is an integer")
        lease = self.live.get(lease_id)
        if lease is None:
            raise ErrnoError(errno.ENOENT, f"lease {lease_id} does not exist (expired, "
                                           "revoked, or never granted)")
        if lease.owner != uid and not is_owner:
            raise ErrnoError(errno.EPERM, f"lease {lease_id} belongs to another user")
        return lease

    def keepalive(self, lease: Lease) -> None:
        """Give ``lease`` its full ttl again, from now (at stop, no timer:
        nothing expires while the module stops)."""
        loop = asyncio.get_running_loop()
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        lease.deadline = loop.time() + lease.ttl
        lease.graced = False
        if not self.closed:
            lease.timer = loop.call_at(lease.deadline, self._due, lease)

    def _due(self, lease: Lease) -> None:
        """``lease``'s deadline passed.  A keepalive its holder sent in time
        may wait unread in this rank's sockets: the loop runs the timers due
        before it reads them, and after a stall of this rank (SIGSTOP, swap,
        a long collection) every timer overdue came first -- a stall of
        rank 0 for two thirds of a ttl expired leases punctual holders had
        kept alive (a probe: 3 of 6, after 2.4 s of a ttl of 3).  So it
        expires only on its second call: :data:`READ_FIRST` later, or as
        late as this call came, up to :data:`STALL_GRACE` (``stall-graced``
        counts those), the sockets read meanwhile."""
        lease.timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not lease.graced and not self.closed:
            lease.graced = True
            late = now - lease.deadline
            if late > READ_FIRST:
                self.counts["stall-graced"] += 1
            lease.timer = loop.call_at(now + min(max(late, READ_FIRST), STALL_GRACE),
                                       self._due, lease)
            return
        self.end(lease, "expired")

    def end(self, lease: Lease, why: str, unlink: bool = True) -> None:
        """``lease`` expired or was revoked: forget it, and have its keys
        unlinked (unless ``unlink`` is False: the caller queues them)."""
        if lease.ended:
            return
        lease.ended = why
        if lease.timer is not None:
            lease.timer.cancel()
            lease.timer = None
        del self.live[lease.id]
        del self.ids[bisect.bisect_left(self.ids, lease.id)]
        owned = self.by_owner[lease.owner]
        del owned[lease.id]
        if not owned:
            del self.by_owner[lease.owner]
        self.counts[why] += 1
        if lease.keys and unlink:
            self.on_end(lease)

    def close(self) -> None:
        """At stop: no lease expires any more (its keys stay; a statedir
        keeps the table with the checkpoint)."""
        self.closed = True
        for lease in self.live.values():
            if lease.timer is not None:
                lease.timer.cancel()
                lease.timer = None

    # ---------------------------------------------------------------- commits

    def check(self, leased: Iterable[tuple[int, list[dict[str, Any]]]]) -> dict[int, Lease]:
        """The leases named by the ops of transactions ``(committer uid,
        ops)``: each must be live (``ENOENT``) and the committer's
        (``EPERM``: even the instance owner attaches only its own), or the
        transaction fails whole."""
        found: dict[int, Lease] = {}
        for uid, ops in leased:
            for op in ops:
                lease_id = op.get("lease")
                if lease_id is not None:
                    lease = self.get(lease_id, uid, False)
                    found[lease.id] = lease
        return found

    def applied(self, ns: str, ops: list[dict[str, Any]], found: dict[int, Lease]) -> None:
        """``ops`` were applied to ``ns`` (in order): attach the keys put with
        a lease of ``found`` (what :meth:`check` returned for them), detach
        what every other write touches.  A lease that ended since it was
        checked gets its keys unlinked at once."""
        att = self.attached.get(ns)
        ended: set[Lease] = set()
        for key, lease in _writes(ops, found):
            if att is not None:
                for k in att.touching(key):
                    self._detach(ns, att, k)
            if lease is not None:
                if att is None:
                    att = self.attached[ns] = _Attached()
                att.attach(key, lease)
                lease.keys.setdefault(ns, set()).add(key)
                lease.unlink_order.pop(ns, None)  # (sorted again with it)
                self.counts["attached"] += 1
                if lease.ended:
                    ended.add(lease)
        if att is not None and not att.keys:
            del self.attached[ns]
        for lease in ended:
            self.on_end(lease)

    def _detach(self, ns: str, att: _Attached, key: str) -> None:
        lease = att.detach(key)
        if lease is None:
            return
        self.counts["detached"] += 1
        keys = lease.keys.get(ns)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del lease.keys[ns]

    def unlink_ops(self, ns: str, lease: Lease) -> list[dict[str, Any]]:
        """The unlinks of an ended lease's keys still attached in ``ns``,
        now: at most :data:`UNLINK_BYTES` of keys (at least one), so that
        the setroot event listing them fits in any link; the caller
        commits again while some are left."""
        keys = lease.keys.get(ns, set())
        order = lease.unlink_order.get(ns)
        if order is None:  # sorted once, not per transaction: O(n log n) in all
            order = lease.unlink_order[ns] = sorted(keys, reverse=True)
        ops: list[dict[str, Any]] = []
        size = 0
        i = len(order) - 1
        while i >= 0:
            key = order[i]
            if key not in keys:  # (unlinked by the last transaction, or detached)
                if i == len(order) - 1:
                    order.pop()
                i -= 1
                continue
            size += _size(key) + 8
            if ops and size > UNLINK_BYTES:
                break
            ops.append({"key": key, "flags": 0, "dirent": None})
            i -= 1
        return ops

    def forget_namespace(self, ns: str) -> None:
        """``ns`` was removed: its keys went with it."""
        att = self.attached.pop(ns, None)
        if att is not None:
            for lease in set(att.keys.values()):
                lease.keys.pop(ns, None)
                lease.unlink_order.pop(ns, None)  # (its keys' sorted order went too)

    # ---------------------------------------------------------------- restart

    def snapshot(self, ns: str, ops: list[dict[str, Any]] | None = None,
                 found: dict[int, Lease] | None = None) -> dict[str, Any] | None:
        """What a checkpoint of ``ns`` keeps: every lease with keys attached
        there (ended ones too: their unlinks may not be applied yet).
        None when there is none.  With ``ops`` (and ``found``, as for
        :meth:`applied`): as it will be once they are
        applied (a ``SYNC`` commit's checkpoint is written before that),
        worked out on a copy."""
        att = self.attached.get(ns)
        keys: dict[str, Lease] = dict(att.keys) if att is not None else {}
        if ops:
            # What each op touches is found as applied() finds it (the paths
            # above, the keys below through the counts): scanning every
            # leased key for every op stopped rank 0 for seconds (5,000 ops
            # beside 6,000 leased keys: 4.7 s).  Keys the ops attach are
            # kept apart, in a table of their own, for the later ops.
            later = _Attached()
            for key, lease in _writes(ops, found):
                if att is not None:
                    for k in att.touching(key):
                        keys.pop(k, None)
                for k in later.touching(key):
                    later.detach(k)
                if lease is not None:
                    later.attach(key, lease)
            keys.update(later.keys)
        if not keys:
            return None
        by_lease: dict[Lease, list[str]] = {}
        for key, lease in keys.items():
            by_lease.setdefault(lease, []).append(key)
        return {"leases": [
            {"id": lease.id, "owner": lease.owner, "ttl": lease.ttl, "keys": sorted(held),
             **({"ended": lease.ended} if lease.ended else {})}
            for lease, held in by_lease.items()]}

    def live_entries(self) -> list[dict[str, Any]]:
        """Every live lease, keys or not (``{id, owner, ttl}``): what a
        ``module reload`` of kvs hands over beside each namespace's
        :meth:`snapshot` -- those lists name only leases holding keys
        there, and a lease granted but holding none yet (a holder about to
        put its lock) was dropped by a reload, its holder's next keepalive
        ``ENOENT``."""
        return [{"id": lease.id, "owner": lease.owner, "ttl": lease.ttl}
                for lease in self.live.values()]

    def take_back(self, entries: Any) -> int:
        """Make live again each lease of :meth:`live_entries` (a reload's),
        with its full ttl from now; how many.  Their keys are attached by
        the namespaces' :meth:`restore` after."""
        n = 0
        for entry in entries if isinstance(entries, list) else ():
            fields = _entry_fields(entry)
            if fields is None or fields[0] in self.live:
                continue
            self._revive(*fields)
            n += 1
        return n

    def _revive(self, lid: int, owner: int, ttl: float) -> Lease:
        """A saved lease live again, with its full ttl from now."""
        self.counts["restored"] += 1
        return self._add(lid, owner, min(max(ttl, MIN_TTL), MAX_TTL))

    def restore(self, ns: str, saved: Any) -> tuple[int, int]:
        """Take back the leases a checkpoint kept (:meth:`snapshot`), each
        with its full ttl from now: their holders may keep them alive again
        (a client that reconnects), or they expire and their keys go.
        Returns (leases, keys); malformed entries are skipped (and an
        older checkpoint's ``next-id``: ids are random, see :data:`ID_SPACE`)."""
        if not isinstance(saved, dict):
            return 0, 0
        n = nkeys = 0
        for entry in saved.get("leases") or ():
            fields = _entry_fields(entry)
            keys = entry.get("keys") if fields is not None else None
            if fields is None or not isinstance(keys, list):
                continue
            lid, owner, ttl = fields
            ended = entry.get("ended")
            lease = self.live.get(lid)
            if lease is not None:
                # its keys in another namespace, restored before, or a
                # reload's live lease (take_back): one lease, keys in each
                # (skipped, each namespace's keys but the first stayed for
                # ever, the lease's expiry and revoke unlinking none)
                if lease.owner != owner:
                    continue
            elif isinstance(ended, str) and ended:
                # ended, its unlinks not applied when the checkpoint or the
                # reload took it: not live again (its old holder kept it
                # alive for ever), its keys unlinked once all are restored
                if lid not in self._ended_restored:
                    self._ended_restored[lid] = (Lease(lid, owner, ttl, 0.0), ended)
                lease = self._ended_restored[lid][0]
            else:
                lease = self._revive(lid, owner, ttl)
                n += 1
            before = lease.key_count()
            self.applied(ns, [{"key": k, "flags": 0, "lease": lid}
                              for k in keys if isinstance(k, str)], {lid: lease})
            nkeys += lease.key_count() - before
        return n, nkeys

    def end_restored(self) -> int:
        """After every :meth:`restore`: end the leases that had ended before
        (their keys' unlinks go now, once each); how many."""
        ended, self._ended_restored = self._ended_restored, {}
        for lease, why in ended.values():
            lease.ended = why
            if lease.keys:
                self.on_end(lease)
        return len(ended)

    def stats(self) -> dict[str, Any]:
        return {"live": len(self.live),
                "keys": sum(len(a.keys) for a in self.attached.values()),
                # (those with keys left: the retry task learns of its
                # success a turn of the loop after the unlinks are applied)
                "unlinks-pending": sum(1 for lease in self.retrying if lease.keys),
                **self.counts}

    def listing(self, after: Any, uid: int, is_owner: bool) -> dict[str, Any]:
        """``kvs.lease-list``'s answer: the live leases ``uid`` holds (all of
        them for the instance owner), in id order from the first past
        ``after``, at most :data:`LIST_MAX`; ``more`` says whether others
        follow.  (A guest learns nothing of another's leases, not even
        their number.)"""
        if type(after) is not int:
            raise ErrnoError(errno.EPROTO, "after is a lease id (an integer)")
        if is_owner:
            start = bisect.bisect_right(self.ids, after)
            first = self.ids[start:start + LIST_MAX + 1]
        else:  # (its own alone, at most kvs.max-leases-per-user)
            first = heapq.nsmallest(LIST_MAX + 1, (i for i in self.by_owner.get(uid, ())
                                                   if i > after))
        now = self._now()
        return {"leases": [self._summary(self.live[i], now) for i in first[:LIST_MAX]],
                "more": len(first) > LIST_MAX}

    @staticmethod
    def _summary(lease: Lease, now: float) -> dict[str, Any]:
        return {"id": lease.id, "owner": lease.owner, "ttl": lease.ttl,
                "ttl_left": round(max(0.0, lease.deadline - now), 3),  # (ms)
                "key-count": lease.key_count()}

    def describe(self, lease: Lease) -> dict[str, Any]:
        """``kvs.lease-info``'s answer."""
        listed: dict[str, list[str]] = {}
        room = INFO_BYTES
        for ns, keys in lease.keys.items():
            room -= _size(ns) + 8
            names: list[str] = []
            for key in sorted(keys)[:INFO_KEYS]:
                room -= _size(key) + 8
                if room < 0:
                    break
                names.append(key)
            if names:
                listed[ns] = names
            if room < 0:
                break
        return {**self._summary(lease, self._now()), "keys": listed}


def _size(name: str) -> int:
    """The bytes of ``name`` in UTF-8."""
    return len(name) if name.isascii() else len(name.encode())
