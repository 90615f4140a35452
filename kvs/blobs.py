"""This rank's KVS blobs: the byte-bounded LRU the kvs module reads from
(:class:`BlobStore`) and the loads that fill it from the content store
(:class:`BlobFetcher`).

Every read and every commit of the kvs module starts from here: the I/O-free
engines (:mod:`kvs.lookup`, :mod:`kvs.txn`, :mod:`kvs.diff`) raise
:class:`~kvs.treeobj.NeedBlobs` for what is missing, the caller fetches it and
runs them again.  Kept apart from the module so that what a miss costs --
a direct call of this rank's content module (which asks its parent for a
turn's misses together), shared between concurrent readers, a bounded window of
loads in flight -- and what a garbage collection may vouch for are read in
one place.  Decoded tree objects are the business of
:class:`kvs.treeobj.BlobCache`, which sits in front of a :class:`BlobStore`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
from collections import Counter, OrderedDict, deque
from typing import Any

from broker.agemarks import AgeMarks
from broker.content.module import BLOB_OVERHEAD, ContentModule, LoadToken
from broker.errors import ErrnoError
from broker.rpc import HandleCore

BLOB_CACHE_BYTES = 64 << 20
"""The kvs module's blob LRU (attr ``kvs.cache-bytes``).  Its blobs are mostly
the very objects the content cache holds (in-process RPCs copy nothing); a
miss costs a direct call of this rank's content module (a ``content.load``
request where the kvs module runs without one in its process).  It is
bounded by the blobs' encoded size: decoded, a directory takes ~6 times
that."""
FETCH_WINDOW = 512
"""Blob loads one :meth:`BlobFetcher.fetch` keeps in flight.  A cold read of a
value of 100,000 blobs (a long eventlog) started them all at once: 100,000
tasks and requests, 570 MB more on rank 0."""
FETCH_CHUNK = 256
"""Blobs one :meth:`ContentModule.load_many` of a fetch asks for: the next
chunk is asked for as soon as the oldest is in, so a long read keeps
:data:`FETCH_WINDOW` blobs in flight without waiting for a whole window
(a follower asks upstream for a turn's misses 256 to a request)."""


class BlobStore:
    """This rank's blobs (ref -> bytes), a byte-bounded LRU (``size``
    counts each blob's data and its :data:`BLOB_OVERHEAD`) whose blobs
    unused for ``kvs.cache-expire`` also go (:meth:`age`)."""

    def __init__(self, limit: int = BLOB_CACHE_BYTES) -> None:
        self.limit = limit
        self.size = 0
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        # Blobs an operation fetched and still needs ([data, holders]), kept
        # outside the LRU: see hold()
        self._held: dict[str, list[Any]] = {}
        self._marks = AgeMarks()

    def get(self, ref: str) -> bytes | None:
        blobs = self._blobs
        data = blobs.get(ref)
        if data is not None:
            blobs.move_to_end(ref)  # (used: what age() expires is in front)
        elif self._held:
            entry = self._held.get(ref)
            if entry is not None:
                return entry[0]  # type: ignore[no-any-return]
        return data

    def hold(self, ref: str, data: bytes, held: set[str]) -> None:
        """Keep blob ``ref`` readable for an operation until :meth:`release`
        (``held``: the refs it holds), whatever the LRU evicts meanwhile.

        A lookup or a commit fetches what it misses and starts again from the
        root; with a cache smaller than what it reads, each pass evicted what
        the previous one fetched, and it never finished (a small
        ``kvs.cache-bytes``: one rank at full CPU, 470,000 fetches and no
        answer).  Held blobs make every pass progress."""
        if ref in held:
            return
        held.add(ref)
        entry = self._held.get(ref)
        if entry is None:
            self._held[ref] = [data, 1]
        else:
            entry[1] += 1

    def release(self, held: set[str]) -> None:
        """The operation that held ``held`` is done with them."""
        for ref in held:
            entry = self._held.get(ref)
            if entry is not None:  # (gone if the cache was dropped meanwhile)
                entry[1] -= 1
                if not entry[1]:
                    del self._held[ref]
        held.clear()

    def get_cached(self, ref: str) -> bytes | None:
        """From the LRU only: on rank 0 during a garbage collection, what
        it holds was vouched for (:meth:`ContentModule.load_token`), while
        an operation may hold a blob it read just before its row went."""
        return self._blobs.get(ref)

    def drop(self, keep: set[str] | None = None) -> None:
        """Forget the LRU's blobs (those not in ``keep``), in place: an
        operation under way keeps what it holds, and its cache objects stay
        the module's (swapping them left a diff reading one store while
        filling another, for ever)."""
        if keep is None:
            self._blobs.clear()
            self._marks.clear()
            self.size = 0
            return
        for ref in [r for r in self._blobs if r not in keep]:
            self.size -= len(self._blobs.pop(ref)) + BLOB_OVERHEAD

    def put(self, ref: str, data: bytes) -> None:
        if ref in self._blobs:
            self._blobs.move_to_end(ref)
            return
        self._blobs[ref] = data
        self.size += len(data) + BLOB_OVERHEAD
        while self.size > self.limit and len(self._blobs) > 1:
            _, old = self._blobs.popitem(last=False)
            self.size -= len(old) + BLOB_OVERHEAD

    def age(self) -> int:
        """A period of ``kvs.cache-expire`` passed (:mod:`broker.agemarks`):
        put a mark, and forget the blobs not used since the mark now due.
        Returns how many went; blobs an operation holds stay (:meth:`hold`)."""
        self._marks.put(self._blobs, b"")
        self.size += BLOB_OVERHEAD
        return self._marks.expire(self._blobs, self._expired)

    def _expired(self, ref: str, data: bytes) -> None:
        self.size -= len(data) + BLOB_OVERHEAD

    @property
    def expired(self) -> int:
        """Blobs forgotten by age since the start."""
        return self._marks.expired

    @property
    def blob_bytes(self) -> int:
        """:attr:`size` without the expiry's marks (what stats show: an
        empty store said 2048 bytes)."""
        return self.size - self._marks.live(self._blobs) * BLOB_OVERHEAD

    def __len__(self) -> int:
        return len(self._blobs) - self._marks.live(self._blobs)


class BlobFetcher:
    """Loads the blobs a :class:`BlobStore` misses from the content store:
    one load per blob in flight, whoever asks for it, and at most
    :data:`FETCH_WINDOW` at a time for one caller.  From this rank's
    content module (nearly always in the process), a chunk of blobs at a
    time: a future per chunk, no task per blob (:meth:`_load`)."""

    def __init__(self, blobs: BlobStore, counts: Counter[str]) -> None:
        self.blobs = blobs
        self.counts = counts
        """The kvs module's counts (``blob-fetches``, ``blob-loads``)."""
        self.h: HandleCore  # (the kvs module's, bound at its start)
        self.content: ContentModule | None = None
        """Rank 0's content module when it is in this process with the kvs
        module's hash (set at start): what its loads may vouch for."""
        self.loader: ContentModule | None = None
        """This rank's content module when it is in this process with the kvs
        module's hash (any rank; set at start): blobs are loaded from it by a
        call, not a ``content.load`` request each."""
        self._fetching: dict[str, asyncio.Future[bytes]] = {}
        """Without :attr:`loader`: the ``content.load`` requests in flight."""

    async def fetch(self, refs: set[str], held: set[str] | None = None, *,
                    keep: bool = False) -> dict[str, bytes]:
        """Load missing blobs from the content module (in parallel); with
        ``held``, hold them (and those of ``refs`` already here) for the
        caller until it releases them (:meth:`BlobStore.hold`).  Returns
        them all, ``{ref: blob}`` (the caches may have been dropped
        meanwhile: ``kvs.dropcache``, a garbage collection).

        With ``keep``, while rank 0 collects garbage, what is fetched is kept:
        blobs a commit is about to name
        (:meth:`kvs.refcheck.RefChecker.check_refs`)."""
        if keep and self.content is not None and self.content.collection is not None:
            self.content.collection.touch(refs)
        missing: list[str] = []
        found: dict[str, bytes] = {}
        get = self.blobs.get_cached if keep else self.blobs.get
        for ref in refs:
            data = get(ref)
            if data is not None:
                found[ref] = data
                if held is not None:
                    self.blobs.hold(ref, data, held)
                continue
            missing.append(ref)
        self.counts["blob-fetches"] += len(missing)
        if self.loader is not None:
            await self._load(missing, found, held)
            return found
        for i in range(0, len(missing), FETCH_WINDOW):
            part = missing[i:i + FETCH_WINDOW]
            got = await asyncio.gather(*(self._fetch_shared(ref) for ref in part))
            found.update(zip(part, got, strict=True))
            if held is not None:
                for ref, data in zip(part, got, strict=True):
                    self.blobs.hold(ref, data, held)
        return found

    async def _load(self, missing: list[str], found: dict[str, bytes],
                    held: set[str] | None) -> None:
        """Load ``missing`` from this rank's content module, :data:`FETCH_CHUNK`
        to a :meth:`ContentModule.load_many` and :data:`FETCH_WINDOW` in
        flight: a future per chunk, not a task per blob (the content module
        shares a blob's load between the chunks that want it).  The first
        blob that failed fails the fetch, once its chunk is in."""
        assert self.loader is not None
        load_many = self.loader.load_many
        content = self.content
        chunks: deque[_Chunk] = deque()
        try:
            for i in range(0, len(missing), FETCH_CHUNK):
                part = missing[i:i + FETCH_CHUNK]
                vouch = _Vouch(content, part)  # (before the load starts)
                chunks.append((part, vouch, load_many(part)))
                self.counts["blob-loads"] += 1
                if len(chunks) * FETCH_CHUNK >= FETCH_WINDOW:
                    await self._oldest_in(chunks, found, held)
            while chunks:
                await self._oldest_in(chunks, found, held)
        finally:
            for _, _, fut in chunks:  # (failed: nobody waits for the others)
                fut.cancel()

    async def _oldest_in(self, chunks: deque[_Chunk], found: dict[str, bytes],
                         held: set[str] | None) -> None:
        """Wait for the oldest chunk of :meth:`_load`, then take it in: cache
        its blobs (those its loads vouch for), hold them for the caller;
        raise the first one's error."""
        part, vouch, fut = chunks[0]
        got = await fut
        chunks.popleft()
        blobs = self.blobs
        failed: BaseException | None = None
        for ref in part:
            data = got[ref]
            if not isinstance(data, bytes):
                failed = failed or _fetch_error(ref, data)
                continue
            if vouch.vouches(ref):
                blobs.put(ref, data)  # (not a blob a collection may be deleting)
            found[ref] = data
        if failed is not None:
            raise failed
        if held is not None:
            for ref in part:
                blobs.hold(ref, found[ref], held)

    def _fetch_shared(self, ref: str) -> asyncio.Future[bytes]:
        """Without :attr:`loader`: the ``content.load`` of ``ref`` in flight,
        or a new one.  (No :attr:`content` to vouch for anything either: it
        is the loader on rank 0.)"""
        fut = self._fetching.get(ref)
        if fut is None:
            fut = self._fetching[ref] = asyncio.ensure_future(self._fetch_one(ref))
            fut.add_done_callback(functools.partial(self._fetched, ref))
        return fut

    def _fetched(self, ref: str, fut: asyncio.Future[bytes]) -> None:
        """Done callback of a blob fetch: it is no longer in flight."""
        if self._fetching.get(ref) is fut:
            del self._fetching[ref]

    async def _fetch_one(self, ref: str) -> bytes:
        self.counts["blob-loads"] += 1
        try:
            data: bytes = (await self.h.rpc("content.load", {"blobref": ref}))["data"]
        except ErrnoError as exc:
            raise _fetch_error(ref, exc) from None
        self.blobs.put(ref, data)
        return data


_Chunk = tuple[list[str], "_Vouch", asyncio.Future[dict[str, bytes | BaseException]]]
"""A chunk of :meth:`BlobFetcher._load`: its blobrefs, what their loads may
vouch for, and the :meth:`ContentModule.load_many` that loads them."""


class _Vouch:
    """What a load started now may vouch for, blob by blob (rank 0 during a
    garbage collection: :meth:`ContentModule.load_token`) -- one for a
    chunk while no collection runs (each blob's would be the same)."""

    __slots__ = ("content", "generation", "tokens")

    def __init__(self, content: ContentModule | None, refs: list[str]) -> None:
        self.content = content
        self.generation = content.generation if content is not None else 0
        self.tokens: dict[str, LoadToken] | None = None
        if content is not None and content.collection is not None:
            self.tokens = {ref: content.load_token(ref) for ref in refs}

    def vouches(self, ref: str) -> bool:
        content = self.content
        if content is None:
            return True
        if self.tokens is None:
            return content.generation == self.generation
        return content.vouches(self.tokens[ref])


def _fetch_error(ref: str, exc: BaseException) -> BaseException:
    """A blob's load failed: what to raise (``ENOENT`` says which blob the
    store lacks).  The error may be another fetch's too (a shared load): it
    is raised without the traceback it got there, as a future's result is."""
    if isinstance(exc, ErrnoError) and exc.errnum == errno.ENOENT:
        return ErrnoError(errno.ENOENT, f"blob {ref} is not in the content store")
    return exc.with_traceback(None)
