"""Namespace state held by each rank's kvs module.

A :class:`Namespace` is a named root (``rootref`` at version ``rootseq``)
with an owner.  Rank 0 (the leader) also queues the namespace's pending
transactions.  Every rank keeps waiters for versions (``kvs.wait-version``);
a follower also keeps the transactions it relayed to rank 0, by name, until
the ``setroot`` or ``error`` event naming them arrives.
"""

from __future__ import annotations

import asyncio
import errno
import heapq
import itertools
import re
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from broker.content.kvsroot import rootseq_of as rootseq_of  # (re-exported)
from broker.errors import ErrnoError
from broker.message import Message
from kvs.keys import MAX_NS_NAME, SHOWN
from kvs.keys import PRIMARY as PRIMARY  # (re-exported: kvs.client takes it from kvs.keys)

CHECKPOINT_KEY = "kvs-primary"  # (broker.content.module.KVS_CHECKPOINT_KEY)
"""The content store's checkpoint of the primary namespace's root: written
by rank 0's kvs, read at start, by ``kvs dump/restore --checkpoint`` and by
the offline ``kvs gc``."""
_NAME_RE = re.compile(rf"[A-Za-z0-9_.+@=%,-]{{1,{MAX_NS_NAME}}}")
_tiebreak = itertools.count()


def shown_name(name: str, longest: int = SHOWN) -> str:
    """``repr(name)`` for an error message, or only its start when it is
    longer than ``longest`` characters: a request may name a namespace of
    up to ``broker.max-message``, and the whole name would go back in the
    answer."""
    return f"{name[:SHOWN]!r}..." if len(name) > longest else repr(name)


NAME_RULE = (f"a namespace name is 1-{MAX_NS_NAME} of the letters, digits and _.+@=%,- "
             "(not . or ..)")
"""What a namespace name may be, for the message that refuses one."""


def check_name(name: object) -> str:
    """A namespace name: 1-255 characters, no spaces, slashes or colons,
    and not ``.`` or ``..`` (a file or directory named after a namespace,
    as ``kvs dump`` makes them, must be that namespace's)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        shown = shown_name(name) if isinstance(name, str) else repr(name)
        raise ErrnoError(errno.EINVAL, f"invalid namespace name {shown}: {NAME_RULE}")
    return name


LIST_CHUNK_BYTES = 16 * 1024
"""About the most bytes of namespaces one answer of a streaming
``kvs.namespace-list`` carries: a quarter of the smallest
``tbon.max-message`` (64 KiB), so the list crosses any link however many
namespaces there are (one answer of 1,500 was 198 KB)."""


def list_chunks(entries: list[dict[str, Any]],
                budget: int = LIST_CHUNK_BYTES) -> list[list[dict[str, Any]]]:
    """``entries`` (namespace descriptions) cut into runs of about
    ``budget`` bytes each, in order; one empty run for none (the answer
    still carries the list's epoch)."""
    chunks: list[list[dict[str, Any]]] = [[]]
    size = 0
    for entry in entries:
        cost = 120 + len(entry["namespace"])  # (the fields but the name: ~110 bytes packed)
        if chunks[-1] and size + cost > budget:
            chunks.append([])
            size = 0
        chunks[-1].append(entry)
        size += cost
    return chunks


async def gather_namespace_list(h: Any, nodeid: int) -> dict[str, Any]:
    """The whole ``kvs.namespace-list`` as one answer ``{epoch, namespaces}``,
    asked as a stream (each part fits a link, whatever the count): rank 0
    cuts one snapshot into the parts, so they share its epoch."""
    epoch: Any = None
    out: list[Any] = []
    async for part in h.rpc_stream("kvs.namespace-list", {}, nodeid=nodeid):
        if not isinstance(part, dict) or not isinstance(part.get("namespaces"), list):
            raise ErrnoError(errno.EPROTO, "malformed kvs.namespace-list answer")
        epoch = part.get("epoch")
        out += part["namespaces"]
    return {"epoch": epoch, "namespaces": out}


EVENT_PREFIX = "kvs.namespace-"
"""Every namespace event's topic starts so (``kvs.namespace-<NS>-<kind>``):
the one subscription each module makes, on every rank."""
HEARD_LIMIT = 1024
"""Namespaces a follower remembers having heard created (:class:`Heard`)."""


def event_topic_parts(topic: str) -> tuple[str, str] | None:
    """``(NS, kind)`` of a topic ``kvs.namespace-<NS>-<kind>``, else None.
    (A kind has no ``-``; a namespace name may.)"""
    if not topic.startswith(EVENT_PREFIX):
        return None
    name, sep, kind = topic[len(EVENT_PREFIX):].rpartition("-")
    return (name, kind) if sep and name else None


NEVER = 1 << 62
"""A version no namespace reaches: waiting for it waits for the removal."""


class NamespaceRemoved(ErrnoError):
    """ENOTSUP: the namespace was removed while this waited on this rank.

    Its own type, so a follower can tell a transaction it relayed that was
    failed by hearing the removal (never applied: one applied is named by a
    ``setroot`` that comes first) from one rank 0 failed."""

    def __init__(self, name: str) -> None:
        super().__init__(errno.ENOTSUP, f"namespace {name} was removed")


@dataclass(slots=True)
class Pending:
    """A transaction waiting in the leader's queue."""

    ops: list[dict[str, Any]]
    flags: int
    name: str
    future: asyncio.Future[tuple[int, str]]
    lease_user: int | None = None
    """The committer's uid when an op carries ``lease`` (checked on rank 0)."""
    revoke: Any = None
    """A :class:`kvs.leases.Lease` that ended: this transaction unlinks its
    keys still attached in the namespace, computed when it is applied."""


class RecentRoots:
    """The last ``size`` roots that each guest's namespaces took on this
    rank, per guest uid.  A guest may read at a root (``kvs.lookup`` with
    ``rootdir``) only if it is one of its own: a blobref is the hash of a
    blob's content, so a guest that could read at any root it names could
    guess one (a small directory holding a PIN) and confirm it, or read
    below it.  Per uid, so one guest's commits never push out another's
    roots, and a root two guests' namespaces share is each one's.  The
    instance owner's namespaces are not noted: the owner may read at any
    root."""

    __slots__ = ("_by_uid", "size")

    def __init__(self, size: int = 1024) -> None:
        self._by_uid: dict[int, OrderedDict[str, None]] = {}
        self.size = size

    def __len__(self) -> int:
        return sum(map(len, self._by_uid.values()))

    def note(self, rootref: str, owner: int) -> None:
        roots = self._by_uid.get(owner)
        if roots is None:
            roots = self._by_uid[owner] = OrderedDict()
        roots[rootref] = None
        roots.move_to_end(rootref)
        if len(roots) > self.size:
            roots.popitem(last=False)

    def roots(self) -> list[str]:
        """Every root noted, for a garbage collection to keep."""
        return [ref for roots in self._by_uid.values() for ref in roots]

    def known(self, uid: int, rootref: str) -> bool:
        """Whether ``rootref`` is a recent root of one of ``uid``'s namespaces."""
        roots = self._by_uid.get(uid)
        return roots is not None and rootref in roots


class HeardRoot(NamedTuple):
    """A namespace as its events tell it: enough to serve it without asking
    rank 0 (what ``kvs.getroot`` answers)."""

    owner: int
    rootseq: int
    rootref: str
    flags: int
    epoch: int

    def describe(self, name: str) -> dict[str, Any]:
        """As :meth:`Namespace.describe` (a ``kvs.getroot`` answer)."""
        return {"namespace": name, "owner": self.owner, "rootseq": self.rootseq,
                "rootref": self.rootref, "flags": self.flags, "epoch": self.epoch}


class Heard:
    """The namespaces a follower heard created and has not loaded, each
    kept current by its later ``setroot`` events, forgotten at ``removed``.

    A job's namespace is created on rank 0 and watched at once on the rank
    of its shell (``WAITCREATE``, for the eventlog).  That watch needs a
    root to start from, and the rank has heard one: the ``created`` event
    and the setroots since.  kvs-watch, which follows the events itself,
    takes it (``kvs.getroot`` with ``heard``) instead of a round trip
    through every rank between it and rank 0.  It is exact as of the events
    this rank has received: the module subscribes at start, and rank 0
    sequences every event.  It may lag rank 0 by the events in flight, so
    the kvs serves its own requests (a first lookup) from rank 0's
    ``getroot`` as before.  Bounded: the oldest heard are forgotten first.
    A namespace heard created while it loads is kept here until the load
    ends: it tells the load that rank 0's answer may be older than the
    namespace (``KvsModule._ask_root``).
    """

    __slots__ = ("_roots", "limit")

    def __init__(self, limit: int = HEARD_LIMIT) -> None:
        self._roots: OrderedDict[str, HeardRoot] = OrderedDict()
        self.limit = limit

    def __len__(self) -> int:
        return len(self._roots)

    def __contains__(self, name: object) -> bool:
        return name in self._roots

    def created(self, name: str, payload: dict[str, Any]) -> bool:
        """Note a ``created`` event; False if its fields are not rank 0's."""
        owner, rootref = payload.get("owner"), payload.get("rootref")
        seq, flags, epoch = (payload.get(k, 0) for k in ("rootseq", "flags", "epoch"))
        if not (type(owner) is int and isinstance(rootref, str) and type(seq) is int
                and type(flags) is int and type(epoch) is int):
            return False
        self._roots[name] = HeardRoot(owner, seq, rootref, flags, epoch)
        if len(self._roots) > self.limit:
            self._roots.popitem(last=False)
        return True

    def setroot(self, name: str, rootseq: int, rootref: str) -> None:
        heard = self._roots[name]
        if rootseq > heard.rootseq:
            self._roots[name] = heard._replace(rootseq=rootseq, rootref=rootref)

    def removed(self, name: str) -> None:
        del self._roots[name]

    def get(self, name: str) -> HeardRoot | None:
        return self._roots.get(name)

    def take(self, name: str) -> HeardRoot | None:
        """The namespace's root as heard, forgotten here (it is being loaded)."""
        return self._roots.pop(name, None)


@dataclass(slots=True)
class Namespace:
    name: str
    owner: int
    rootref: str = ""
    rootseq: int = -1  # -1: not loaded yet (a follower waiting for getroot)
    flags: int = 0
    epoch: int = 0
    """Which namespace of this name: rank 0 numbers every namespace-create
    (``primary`` is 0).  A follower's relay carries it, so rank 0 never
    applies a relay meant for a removed namespace to a new one of the same
    name (getroot tells followers, as ``epoch``)."""
    removed: bool = False
    # leader only
    queue: deque[Pending] | None = None
    """Transactions waiting to be applied; None while there are none (an empty
    deque is ~760 bytes, and most of the namespaces alive at once are idle)."""
    committing: bool = False
    _waiters: list[tuple[int, int, asyncio.Future[None]]] | None = None
    """Version waiters, a heap of (rootseq, tiebreak, future); None while
    there are none (an empty list and an empty dict are ~120 bytes of every
    namespace's record, and most namespaces alive at once have neither)."""
    _live: int = 0
    """Waiters still waiting; the heap also holds cancelled ones, skipped."""
    relayed: dict[str, asyncio.Future[tuple[int, str]]] | None = None
    """Follower only: transactions relayed to rank 0, by name (their futures
    resolve to (rootseq, rootref)); None while there are none."""
    recent: RecentRoots | None = None
    """Where a guest's namespace notes each root it takes (None: the owner's)."""

    def may_access(self, msg: Message) -> bool:
        """The instance owner sees every namespace; a guest only its own."""
        return msg.is_owner or msg.userid == self.owner

    def check_access(self, msg: Message) -> None:
        if not self.may_access(msg):
            raise ErrnoError(errno.EPERM, f"namespace {self.name} belongs to another user")

    def set_root(self, rootseq: int, rootref: str) -> bool:
        """Adopt a newer root; wake the waiters it satisfies.  False if stale."""
        if rootseq <= self.rootseq:
            return False
        self.rootseq = rootseq
        self.rootref = rootref
        if self.recent is not None:
            self.recent.note(rootref, self.owner)
        w = self._waiters
        if w:
            while w and w[0][0] <= rootseq:
                fut = heapq.heappop(w)[2]
                if not fut.done():  # (a cancelled one counted itself out)
                    fut.set_result(None)
                    self._live -= 1
            if not w:
                self._waiters = None
        return True

    async def wait_version(self, rootseq: int) -> None:
        """Return once this rank has applied version ``rootseq`` (ENOTSUP if removed)."""
        if self.removed:
            raise ErrnoError(errno.ENOTSUP, f"namespace {self.name} was removed")
        if self.rootseq >= rootseq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        heapq.heappush(self._waiters, (rootseq, next(_tiebreak), fut))
        self._live += 1
        try:
            await fut
        except asyncio.CancelledError:  # e.g. the client went away: forget it
            # Lazily: rebuilding the heap for each one made a client that
            # left with 100k waits cost O(n^2) -- rank 0 at full CPU for
            # over 17 minutes, and every commit of the instance waiting.
            # Only a wait still in the heap counts itself out: one whose
            # version came (set_root counted it) or whose namespace went
            # (remove) before the task resumed is counted already.
            if fut.cancelled() and not self.removed:
                self._live -= 1
                w = self._waiters
                if w is not None and len(w) > 2 * self._live + 16:
                    w = [x for x in w if not x[2].done()]
                    heapq.heapify(w)
                    self._waiters = w or None
            raise

    async def until_removed(self) -> None:
        """Return once this rank has heard the namespace removed: a version
        wait for a version it never reaches (so it costs no field of its own
        in every namespace's record, and counts among :attr:`waiters`
        meanwhile)."""
        try:
            await self.wait_version(NEVER)
        except ErrnoError:
            if not self.removed:
                raise

    def expect(self, name: str) -> asyncio.Future[tuple[int, str]]:
        """A future for the outcome of transaction ``name``, relayed to rank 0:
        resolved by :meth:`finish` or :meth:`fail` when the event naming it
        arrives, failed by :meth:`remove`."""
        if self.removed:
            raise ErrnoError(errno.ENOTSUP, f"namespace {self.name} was removed")
        fut: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        if self.relayed is None:
            self.relayed = {}
        self.relayed[name] = fut
        return fut

    def forget_relayed(self, name: str) -> None:
        """Stop expecting transaction ``name`` (its requester went away)."""
        relayed = self.relayed
        if relayed is not None:
            relayed.pop(name, None)
            if not relayed:
                self.relayed = None

    def finish(self, names: list[Any], rootseq: int, rootref: str) -> None:
        """A ``setroot`` event: the transactions it names are in ``rootseq``
        (call after :meth:`set_root`, so their requesters read their writes)."""
        relayed = self.relayed
        if not relayed:
            return
        for name in names:
            fut = relayed.pop(name, None) if type(name) is str else None
            if fut is not None and not fut.done():
                fut.set_result((rootseq, rootref))
        if not relayed:
            self.relayed = None

    def fail(self, names: list[Any], errnum: int, errstr: str | None) -> None:
        """An ``error`` event: the transactions it names failed with ``errnum``."""
        relayed = self.relayed
        if not relayed:
            return
        for name in names:
            fut = relayed.pop(name, None) if type(name) is str else None
            if fut is not None and not fut.done():
                fut.set_exception(ErrnoError(errnum, errstr))
        if not relayed:
            self.relayed = None

    @property
    def waiters(self) -> int:
        """Number of version waiters (``kvs.stats-get``)."""
        return self._live

    def remove(self) -> None:
        """Mark removed; every waiter and queued transaction fails with ENOTSUP."""
        self.removed = True
        err = NamespaceRemoved(self.name)
        for _, _, fut in self._waiters or ():
            if not fut.done():
                fut.set_exception(err)
        self._waiters = None
        self._live = 0
        for relay in (self.relayed or {}).values():
            if not relay.done():
                relay.set_exception(err)
        self.relayed = None
        q = self.queue
        while q:
            p = q.popleft()
            if not p.future.done():
                p.future.set_exception(err)

    def describe(self) -> dict[str, Any]:
        return {
            "namespace": self.name,
            "owner": self.owner,
            "rootseq": self.rootseq,
            "rootref": self.rootref,
            "flags": self.flags,
            "epoch": self.epoch,
        }
