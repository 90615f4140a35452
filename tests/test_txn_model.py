"""Concurrent, conflicting transactions from every rank against a model:
the versions they make are a serial history, and a failed one changed nothing.

Six writers (two on rank 0, one on each of ranks 1 and 2, two on rank 3;
or at size 8, one on rank 0 and five below, two of them three links away)
commit at once into a handful of keys, so rank 0 merges their transactions
into shared versions and has to split a merged batch when one of them fails.
Their transactions are drawn from a seed (``KVB_TXN_SEED`` to replay one):

* compare-and-swap increments of two counters (read the counter on the
  writer's rank, then ``expect`` what was read and put one more: a read
  that is stale, or a race lost, fails ``ECANCELED``);
* a lock taken with ``expect_missing`` and given back with ``expect`` of
  the holder's own name;
* appends of a token unique to the transaction to a log, and now and then a
  rewrite of it;
* a key that is by turns a value, a directory (a key put below it) and
  missing, appended to (``EISDIR`` while it is a directory), and a symlink
  to it, written through and appended to (``EOPNOTSUPP``);
* plain puts and unlinks, values big enough to be blobs of their own, and
  transactions that mix all of these, some ``NO_MERGE``;
* leases: each writer now and then takes one or revokes its own, and puts
  a key or takes the lock with its lease or another writer's -- which that
  writer may be revoking at that moment (docs/kvs.md, "Leases"); once they
  are done, a seventh client puts a key with a new lease and revokes it.

Every version's ``setroot`` event is recorded (a subscriber on rank 3), and
after the run every version's tree is read back (``rootdir``).  The test
checks what a serializable, real-time ordered KVS promises (etcd's and
Jepsen's terms):

* versions are contiguous, each has one event, and a commit answered with
  a version is answered with that version's root;
* the transactions answered with a version, applied one after another in
  *some* order to the previous version's tree, each succeed (every
  condition holds at its point) and give exactly the tree read back -- or,
  for a version no commit was answered with, it is the unlink of the keys
  still attached to a lease that was revoked (a revoke answered with a
  version it did not make found no key attached, in the model too);
* a write detaches the lease of every key it touches, and a lease's keys
  are unlinked, after its revoke, exactly as the model keeps them attached;
* a transaction answered before another was sent has an older version;
* a failed transaction fails, with its errno, against one of the versions
  that were current between its request and its answer (a merged batch that
  fails is replayed one transaction at a time, so each is judged alone); one
  naming a lease fails ``ENOENT`` only once that lease's revoke was sent, and
  succeeds only if that revoke was not answered before it was sent;
* a ``NO_MERGE`` transaction has a version of its own;
* each read a writer made (``kvs.lookup-plus``, on its own rank) returns
  the model's value at the version it names, never older than the writer's
  last commit (read-your-writes through that rank, relayed commits too).

Two more tests use these writers: one with some ``SYNC`` transactions,
then a restart after SIGKILL (the version it resumes and the leases it
takes back), and one racing commits against a namespace removed and made
again under them (each commit in one life of it, or refused and in none).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_watch_helpers import NO_MERGE, append, put, unlink
from test_watch_model import (
    INLINE_MAX,
    Link,
    Tree,
    Val,
    _parent,
    apply,
    copy_tree,
    find,
    mkdir,
    symlink,
)

from broker.errors import RemoteError
from broker.handle import Handle
from kvs.lookup import TREEOBJ
from kvs.txn import APPEND, EXPECT, SYNC

T = 20.0
SIZE = 4
TXNS = 40  # per writer
SETROOT = "kvs.namespace-primary-setroot"

# What the test reads back at every version: every key a transaction names
# (``c.s.y`` through the symlink, when ``c.s`` is one).
OBSERVED = ["c.n0", "c.n1", "c.lock", "c.log", "c.d", "c.d.x", "c.d.y", "c.s", "c.s.y",
            "c.k0", "c.k1", "c.k2"]
LINK = "c.s"  # also read as itself (``TREEOBJ``): a symlink, or not

# mode: (the share of NO_MERGE transactions, size, each writer's rank); at
# size 8 (fanout 2) rank 7's relays cross three links, merged on the way
MODES = {
    "merging": (0.0, SIZE, [0, 0, 1, 2, 3, 3]),
    "some unmerged": (0.3, SIZE, [0, 0, 1, 2, 3, 3]),
    "deep tree": (0.1, 8, [0, 7, 7, 4, 5, 6]),
}


def expect(key: str, value: bytes | None) -> dict[str, Any]:
    return {"key": key, "flags": EXPECT,
            "dirent": None if value is None else {"ver": 1, "type": "val", "data": value}}


# --- the model ---------------------------------------------------------------

@dataclass
class State:
    """One version: the tree, and the keys attached to each lease (by name)."""
    tree: Tree
    attached: dict[str, int] = field(default_factory=dict)

    def keys_of(self, lease: int) -> list[str]:
        return sorted(k for k, held in self.attached.items() if held == lease)


def apply_op(tree: Tree, op: dict[str, Any]) -> int:
    """One op applied to ``tree`` as kvs applies it (docs/protocol.md,
    commit flags; docs/kvs.md, "The model"): 0, or the errno that fails its
    transaction.  Symlinks on the path are followed; one at the key itself
    is what a write replaces, an append refuses, a condition never matches."""
    key, dirent, flags = op["key"], op["dirent"], op["flags"]
    if flags & EXPECT:
        parent, last = _parent(tree, key, create=False)
        node = None if parent is None else parent.get(last)
        want = None if dirent is None else dirent["data"]
        if want is None:
            return 0 if node is None else errno.ECANCELED
        return 0 if isinstance(node, Val) and node.data == want else errno.ECANCELED
    if dirent is not None and flags & APPEND:  # to a value or nothing
        parent, last = _parent(tree, key, create=False)
        old = None if parent is None else parent.get(last)
        if isinstance(old, dict):
            return errno.EISDIR
        if isinstance(old, Link):
            return errno.EOPNOTSUPP
    apply(tree, op)
    return 0


def apply_txn(state: State, ops: list[dict[str, Any]]) -> tuple[int, State]:
    """A transaction applied to a copy of ``state``: (0, the new state) or
    (errno, the old one).  Once applied, each write (not a condition), in
    order, detaches the keys it touches (itself, above and below it) and
    attaches its own key if it names a lease."""
    tree = copy_tree(state.tree)
    for op in ops:
        if err := apply_op(tree, op):
            return err, state
    attached = dict(state.attached)
    for op in ops:
        if op["flags"] & EXPECT:
            continue
        key = op["key"]
        for k in [k for k in attached
                  if k == key or k.startswith(key + ".") or key.startswith(k + ".")]:
            del attached[k]
        if "lease" in op:
            attached[key] = op["lease"]
    return 0, State(tree, attached)


def unlinks_of(state: State, lease: int) -> list[dict[str, Any]]:
    """What an ended lease's unlink transaction does at ``state``."""
    return [unlink(k) for k in state.keys_of(lease)]


Seen = bytes | str | None  # a key's value, "dir", or None: missing


def observe(tree: Tree) -> dict[str, Seen]:
    """What a lookup of each :data:`OBSERVED` key finds in ``tree``."""
    out: dict[str, Seen] = {}
    for key in OBSERVED:
        node = find(tree, key)
        out[key] = node.data if isinstance(node, Val) else "dir" if isinstance(
            node, dict) else None
    parent, last = _parent(tree, LINK, create=False)
    link = None if parent is None else parent.get(last)
    out[LINK + "@"] = f"link:{link.target}" if isinstance(link, Link) else "not a link"
    return out


# --- the history -------------------------------------------------------------

@dataclass
class Txn:
    """A commit, or a lease's revoke (``revokes``: its id; no ``ops``)."""
    writer: int
    index: int
    ops: list[dict[str, Any]]
    flags: int
    sent: float
    revokes: int | None = None
    answered: float = 0.0
    seq: int | None = None  # the version it was answered with; None: it failed
    rootref: str = ""
    errnum: int = 0
    errstr: str = ""

    def leases(self) -> set[int]:
        return {op["lease"] for op in self.ops if "lease" in op}

    def describe(self) -> str:
        def one(op: dict[str, Any]) -> str:
            d = op["dirent"]
            lease = f" (lease {op['lease']})" if "lease" in op else ""
            if op["flags"] & EXPECT:
                return f"expect {op['key']}=={None if d is None else d['data'][:12]!r}"
            if d is None:
                return f"unlink {op['key']}"
            if d["type"] != "val":
                return f"{d['type']} {op['key']}"
            verb = "append" if op["flags"] & APPEND else "put"
            return f"{verb} {op['key']}={d['data'][:12]!r}{lease}"
        how = (f"errno {self.errnum} {self.errstr!r}" if self.errnum
               else "answered with no version" if self.seq is None else f"v{self.seq}")
        if self.revokes is not None:
            return f"w{self.writer}.{self.index} revoke lease {self.revokes} -> {how}"
        merge = (" NO_MERGE" if self.flags & NO_MERGE else "") + (
            " SYNC" if self.flags & SYNC else "")
        return f"w{self.writer}.{self.index}{merge} [{'; '.join(map(one, self.ops))}] -> {how}"


@dataclass
class Read:
    writer: int
    key: str
    after: int  # the writer's last version when it read (0: none yet)
    seq: int
    got: Seen


class Writer:
    """One client on one rank making transactions one after another."""

    def __init__(self, index: int, h: Handle, rng: random.Random, no_merge: float,
                 txns: list[Txn], reads: list[Read], leases: dict[int, int] | None,
                 ns: str = "primary", sync: float = 0.0, keep_lease: bool = False) -> None:
        self.index, self.h, self.rng, self.no_merge = index, h, rng, no_merge
        self.sync = sync  # the share of SYNC transactions
        self.keep_lease = keep_lease  # at the end (else revoked while others write)
        self.txns, self.reads = txns, reads
        self.leases = leases  # every writer's current lease, by writer: shared
        """(None: no leases; and each transaction begins with an append of a
        token of its own, so no two versions are alike)"""
        self.ns = ns
        self.last = 0  # the version of its last successful commit
        self.holds_lock = False
        self.answered = asyncio.Event()  # set at each answer (cleared by who waits)

    async def read(self, key: str) -> Seen:
        try:
            r = await asyncio.wait_for(self.h.rpc("kvs.lookup-plus", {
                "namespace": self.ns, "key": key, "flags": 0}), T)
        except RemoteError as exc:
            if self.leases is None and exc.errnum in (errno.ENOENT, errno.ENOTSUP):
                return None  # (the namespace is gone: a guess, its commit will say)
            assert exc.errnum == errno.EISDIR, f"w{self.index} read {key}: {exc}"
            return "dir"  # (no version to check it at: the model's states say)
        got = None if r["val"] is None else bytes(r["val"]["data"])
        self.reads.append(Read(self.index, key, self.last, int(r["rootseq"]), got))
        return got

    def leased(self, op: dict[str, Any]) -> dict[str, Any]:
        """``op`` with a lease now and then: this writer's, or another's."""
        if self.leases is None:
            return op
        held = list(self.leases.values())
        if held and self.rng.random() < 0.5:
            mine = self.leases.get(self.index)
            op["lease"] = mine if mine is not None and self.rng.random() < 0.6 \
                else self.rng.choice(held)
        return op

    async def pick(self, i: int) -> list[dict[str, Any]]:
        """The next transaction's ops (reads for a compare-and-swap first)."""
        rng = self.rng
        me = f"w{self.index}".encode()
        value = (f"w{self.index}.{i}." * (rng.choice([1, 12]))).encode()  # >64: a blob
        parts: list[list[dict[str, Any]]] = []
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            roll = rng.randrange(10)
            if roll < 3:  # a compare-and-swap increment
                key = rng.choice(["c.n0", "c.n1"])
                old = await self.read(key)
                n = int(old) if isinstance(old, bytes) else 0
                parts.append([expect(key, old if isinstance(old, bytes) else None),
                              put(key, str(n + 1).encode())])
            elif roll == 3:  # the lock
                if self.holds_lock:
                    parts.append([expect("c.lock", me), unlink("c.lock")])
                else:
                    parts.append([expect("c.lock", None), self.leased(put("c.lock", me))])
            elif roll < 6:
                parts.append([append("c.log", f"<{self.index}.{i}>".encode())]
                             if rng.random() < 0.85 else [put("c.log", value)])
            elif roll < 8:
                parts.append([rng.choice([
                    put("c.d", value), put("c.d.x", value), mkdir("c.d"), unlink("c.d"),
                    append("c.d", b"+"), unlink("c.d.x"),
                    symlink("c.s", "c.d"), put("c.s.y", value), append("c.s", b"+"),
                    unlink("c.s"),
                ])])
            else:
                key = rng.choice(["c.k0", "c.k1", "c.k2"])
                parts.append([self.leased(put(key, value)) if rng.random() < 0.7
                              else unlink(key)])
        if self.leases is None:
            parts.insert(0, [append("c.log", f"[{self.index}.{i}]".encode())])
        return [op for part in parts for op in part]

    async def grant_or_revoke(self, i: int) -> None:
        """A new lease (ttl an hour: none expires here), or this writer's
        revoked: answered once its keys' unlinks are applied, with the
        version they made (none if no key was attached)."""
        assert self.leases is not None
        lease = self.leases.get(self.index)
        if lease is None:
            r = await asyncio.wait_for(self.h.rpc("kvs.lease-grant", {"ttl": 3600}), T)
            self.leases[self.index] = int(r["id"])
            return
        del self.leases[self.index]  # (others stop picking it: some have already)
        t = Txn(self.index, i, [], NO_MERGE, time.monotonic(), revokes=lease)
        self.txns.append(t)
        r = await asyncio.wait_for(self.h.rpc("kvs.lease-revoke", {"id": lease}), T)
        t.answered = time.monotonic()
        seq = r["rootseqs"].get("primary")
        t.seq = None if seq is None else int(seq)
        self.last = max(self.last, t.seq or 0)

    async def commit(self, i: int, ops: list[dict[str, Any]], flags: int) -> None:
        t = Txn(self.index, i, ops, flags, time.monotonic())
        self.txns.append(t)
        try:
            r = await asyncio.wait_for(self.h.rpc("kvs.commit", {
                "namespace": self.ns, "flags": flags, "ops": ops}), T)
        except RemoteError as exc:
            t.errnum, t.errstr = exc.errnum, exc.errstr
            if exc.errstr.startswith("c.lock: condition failed") and self.holds_lock:
                self.holds_lock = False  # (a revoke of its lease took it)
        else:
            t.seq, t.rootref = int(r["rootseq"]), r["rootref"]
            self.last = max(self.last, t.seq)
            if any(op["key"] == "c.lock" for op in ops):
                self.holds_lock = not self.holds_lock
        t.answered = time.monotonic()
        self.answered.set()

    async def run(self, n: int) -> None:
        for i in range(n):
            if self.leases is not None and self.rng.random() < 0.08:
                await self.grant_or_revoke(i)
                continue
            ops = await self.pick(i)
            flags = NO_MERGE if self.rng.random() < self.no_merge else 0
            await self.commit(i, ops, flags | (SYNC if self.rng.random() < self.sync else 0))
        if self.leases and self.index in self.leases and not self.keep_lease:
            # its last: while the others still write
            await self.grant_or_revoke(n)

    async def finale(self, keep: bool) -> None:
        """Alone, once the others are done: a key put with a new lease, and
        the lease revoked -- its unlink a version of its own; or (``keep``)
        the put ``SYNC``, its lease kept."""
        await self.grant_or_revoke(0)
        assert self.leases is not None
        await self.commit(1, [put("c.k0", b"leased", 0) | {"lease": self.leases[self.index]}],
                          SYNC if keep else 0)
        if not keep:
            await self.grant_or_revoke(2)


# --- reading the versions back -----------------------------------------------

async def read_version(h: Handle, rootref: str) -> dict[str, Seen]:
    """Each :data:`OBSERVED` key at root ``rootref`` (``rootdir``)."""
    root = {"ver": 1, "type": "dirref", "data": [rootref]}

    async def one(key: str) -> Seen:
        try:
            r = await asyncio.wait_for(h.rpc("kvs.lookup", {
                "namespace": "primary", "key": key, "flags": 0, "rootdir": root}), T)
        except RemoteError as exc:
            if exc.errnum == errno.ENOENT:
                return None
            assert exc.errnum == errno.EISDIR, f"{key} at {rootref}: {exc}"
            return "dir"
        return bytes(r["val"]["data"])

    async def link() -> Seen:
        try:
            r = await asyncio.wait_for(h.rpc("kvs.lookup", {
                "namespace": "primary", "key": LINK, "flags": TREEOBJ, "rootdir": root}), T)
        except RemoteError as exc:
            assert exc.errnum == errno.ENOENT, f"{LINK} at {rootref}: {exc}"
            return "not a link"
        obj = r["val"]
        return f"link:{obj['data']['target']}" if obj["type"] == "symlink" else "not a link"

    got = dict(zip(OBSERVED, await asyncio.gather(*map(one, OBSERVED)), strict=True))
    got[LINK + "@"] = await link()
    return got


# --- the checks --------------------------------------------------------------

def explain(before: State, group: list[Txn], revoked: set[int],
            seen: dict[str, Seen]) -> State | None:
    """The state after one version, made by the commits answered with it
    (``group``'s commits) applied in an order in which each succeeds, or
    else (none answered with it) by the unlinks of a revoked lease's keys;
    it must read as ``seen``, and every revoke answered with it that did not
    make it must find its lease without keys there.  None if no way fits."""
    commits = [t for t in group if t.revokes is None]
    revokes = [t for t in group if t.revokes is not None]
    ways: list[tuple[State, int | None]] = []  # (a state, the lease whose unlinks made it)
    if commits:
        for order in itertools.permutations(commits):
            state = before
            for t in order:
                err, state = apply_txn(state, t.ops)
                if err:
                    break
            else:
                ways.append((state, None))
    else:  # a revoke's unlinks, or those of a lease attached to after its end
        for lease in sorted(revoked):
            if ops := unlinks_of(before, lease):
                ways.append((apply_txn(before, ops)[1], lease))
    for state, maker in ways:
        if observe(state.tree) == seen and all(
                not state.keys_of(t.revokes) for t in revokes  # type: ignore[arg-type]
                if t.revokes != maker):
            return state
    return None


def unexplained(version: str, before: State, seen: dict[str, Seen], group: list[Txn]) -> str:
    """A failure: nothing the model knows makes ``version`` from ``before``."""
    return (f"{version}: nothing explains what was read back\n"
            f"    before: {observe(before.tree)} attached {before.attached}\n"
            f"    read:   {seen}\n"
            + ("\n".join(f"    {t.describe()}" for t in group) or "    (no commit)"))


def check_history(txns: list[Txn], reads: list[Read], start: int, start_state: State,
                  events: dict[int, str], seen: dict[int, dict[str, Seen]],
                  ) -> tuple[list[str], dict[int, State]]:
    """What is wrong with the history (see the module's docstring), and the
    model's state at each version."""
    failures: list[str] = []
    final = max(events, default=start)
    if sorted(events) != list(range(start + 1, final + 1)):
        failures.append(f"setroot events, not one per version: {sorted(events)}")
    answered = [t for t in txns if t.seq is not None]
    by_seq: dict[int, list[Txn]] = {}
    for t in answered:
        by_seq.setdefault(t.seq, []).append(t)  # type: ignore[arg-type]
        if t.revokes is None and t.rootref != events.get(t.seq):  # type: ignore[arg-type]
            failures.append(f"{t.describe()}: answered root {t.rootref}, "
                            f"the version's event has {events.get(t.seq)}")  # type: ignore[arg-type]
    for seq, group in by_seq.items():
        if len({t.writer for t in group}) != len(group):
            failures.append(f"v{seq} holds two transactions of one writer")
        commits = [t for t in group if t.revokes is None]
        if len(commits) > 1 and any(t.flags & NO_MERGE for t in commits):
            failures.append(f"v{seq} merged a NO_MERGE transaction: "
                            f"{[t.describe() for t in group]}")
    revoke_of = {t.revokes: t for t in txns if t.revokes is not None}

    # Each version from the one before.
    states: dict[int, State] = {start: start_state}
    for seq in range(start + 1, final + 1):
        group = by_seq.get(seq, [])
        # (the leases whose revoke was sent before this version was answered)
        revoked = {lease for lease, r in revoke_of.items()
                   if r.sent < max((t.answered for t in group), default=float("inf"))}
        state = explain(states[seq - 1], group, revoked, seen[seq])
        if state is None:
            failures.append(unexplained(f"v{seq}", states[seq - 1], seen[seq], group))
            return failures, states  # (the states after it are unknown)
        states[seq] = state

    # Real time: answered before a commit was sent means an older version.
    commits = [t for t in answered if t.revokes is None]
    for t in commits:
        earlier = [u for u in answered if u.answered < t.sent]
        if earlier and (late := max(earlier, key=lambda u: u.seq or 0)).seq >= t.seq:  # type: ignore[operator]
            failures.append(f"{t.describe()} was sent after {late.describe()} was answered")
        for lease in t.leases():
            if lease in revoke_of and revoke_of[lease].answered < t.sent:
                failures.append(f"{t.describe()} was sent after the revoke of its "
                                f"lease was answered: {revoke_of[lease].describe()}")

    # A failure: its errno against a version current while it was in flight
    # (the versions answered before it was sent, up to the last one whose
    # transactions had all been sent before its answer came).
    last_sent = {seq: max(t.sent for t in group) for seq, group in by_seq.items()}

    def window(t: Txn) -> range:
        low = max((u.seq for u in commits if u.answered < t.sent), default=start)
        high = low
        while high + 1 <= final and last_sent.get(high + 1, t.sent) < t.answered:
            high += 1
        return range(low, high + 1)

    for t in txns:
        if t.revokes is not None:
            if t.seq is None and all(states[v].keys_of(t.revokes) for v in window(t)):
                failures.append(f"{t.describe()}: the model has keys attached to it "
                                f"at every version while it was in flight")
            continue
        if t.seq is not None:
            continue
        if t.errnum == errno.ENOENT and any(
                lease in revoke_of and revoke_of[lease].sent < t.answered
                for lease in t.leases()):
            continue  # its lease had ended
        outcomes = {v: apply_txn(states[v], t.ops)[0] for v in window(t)}
        if t.errnum not in outcomes.values() or t.errnum == 0:
            failures.append(f"{t.describe()}: against v{min(outcomes)}..v{max(outcomes)} "
                            f"the model gives {sorted(set(outcomes.values()))}")

    for r in reads:
        if r.seq < r.after:
            failures.append(f"w{r.writer} read {r.key} at v{r.seq} after committing v{r.after}")
        elif r.seq in states and (want := observe(states[r.seq].tree)[r.key]) != r.got:
            failures.append(f"w{r.writer} read {r.key} at v{r.seq}: {r.got!r}, "
                            f"the model has {want!r}")
    return failures, states


@dataclass
class Run:
    """A history made by :func:`run_history`, checked."""
    txns: list[Txn]
    events: dict[int, str]  # version -> root, from the setroot events
    states: dict[int, State]  # the model's, at each version


async def run_history(inst: Any, connect: Any, where: str, seed: int, mode: str,
                      sync: float = 0.0, keep_leases: bool = False) -> Run:
    """The writers of ``mode`` (:data:`MODES`) make their history on
    ``inst``; then every version is read back and checked against the model
    (``sync``: the share of ``SYNC`` transactions; ``keep_leases``: the
    writers keep their last leases, and the last ``SYNC`` commit puts a key
    with a lease)."""
    no_merge, size, ranks = MODES[mode]
    h0 = await connect(inst, 0)
    recorder = await connect(inst, size - 1)
    await recorder.subscribe(SETROOT)
    root = await asyncio.wait_for(h0.rpc("kvs.getroot", {"namespace": "primary"}), T)
    start = int(root["rootseq"])
    txns: list[Txn] = []
    reads: list[Read] = []
    leases: dict[int, int] = {}
    writers = [Writer(i, await connect(inst, rank), random.Random(f"{seed} {mode} {i}"),
                      no_merge, txns, reads, leases, sync=sync, keep_lease=keep_leases)
               for i, rank in enumerate(ranks)]
    await asyncio.gather(*(w.run(TXNS) for w in writers))
    await Writer(len(writers), await connect(inst, size - 1), random.Random(0), 0.0, txns,
                 reads, leases).finale(keep_leases)
    # A last commit, queued after every unlink the history set going (a
    # lease attached to after its revoke is unlinked at once, unasked), so
    # its event is the last one.
    marker = await asyncio.wait_for(h0.rpc("kvs.commit", {
        "namespace": "primary", "flags": 0, "ops": [put("end", b"1")]}), T)
    txns.append(Txn(-1, 0, [put("end", b"1")], 0, time.monotonic(), answered=time.monotonic(),
                    seq=int(marker["rootseq"]), rootref=marker["rootref"]))
    events: dict[int, str] = {}
    while max(events, default=start) < marker["rootseq"]:
        ev = await asyncio.wait_for(recorder.recv_event(), T)
        seq = int(ev.payload["rootseq"])
        assert seq not in events, f"{where}: two setroot events of v{seq}"
        events[seq] = ev.payload["rootref"]

    readers = [await connect(inst, r) for r in range(size)]
    seqs = sorted(events)
    versions = await asyncio.gather(*(read_version(readers[i % size], events[s])
                                      for i, s in enumerate(seqs)))
    failures, states = check_history(txns, reads, start, State({}), events,
                                     dict(zip(seqs, versions, strict=True)))
    stats = (await asyncio.wait_for(h0.rpc("kvs.stats-get"), T))["counts"]
    assert not failures, (
        f"{where}: {len(failures)} problems "
        f"(merged {stats.get('merged', 0)}, split {stats.get('merges-split', 0)}):\n"
        + "\n".join(failures[:20]) + "\nthe transactions, by writer:\n"
        + "\n".join(f"  {t.describe()}" for t in txns))
    # The history did what it is for: conflicts failed, and values were blobs.
    assert any(t.errnum == errno.ECANCELED for t in txns), where
    assert any(len(op["dirent"]["data"]) > INLINE_MAX for t in txns for op in t.ops
               if op["dirent"] is not None and op["dirent"]["type"] == "val"), where
    return Run(txns, events, states)


def seed_for(mode: str) -> tuple[int, str]:
    base = os.environ.get("KVB_TXN_SEED")
    seed = int(base) if base else random.randrange(1 << 30)
    return seed, f"{mode}, KVB_TXN_SEED={seed}"


@pytest.mark.parametrize("mode", list(MODES))
async def test_transactions_are_a_serial_history(start_instance, connect, mode: str) -> None:
    seed, where = seed_for(mode)
    inst = await start_instance(size=MODES[mode][1], fanout=2)
    await run_history(inst, connect, where, seed, mode)


async def test_a_restart_resumes_the_last_sync_version_with_its_leases(
        start_instance, connect, tmp_path) -> None:
    """The same history with some ``SYNC`` transactions, on a statedir
    checkpointed only by them (``kvs.checkpoint-period`` 0), the writers
    keeping their last leases; then every rank is killed (SIGKILL).  The
    restart resumes at the version of the last ``SYNC`` commit, its root
    the one that version's event named, and takes back the leases holding
    keys there, as the model has them attached at that version (a ``SYNC``
    commit's checkpoint is written before its root is set, with the
    attachments its ops will make): each such lease revoked now unlinks
    exactly those keys, and any other is unknown (``ENOENT``)."""
    seed, where = seed_for("SYNC, restart")
    attrs = {"kvs.checkpoint-period": "0"}
    statedir = str(tmp_path / "state")
    inst = await start_instance(size=SIZE, fanout=2, statedir=statedir, attrs=attrs)
    run = await run_history(inst, connect, where, seed, "merging", sync=0.15,
                            keep_leases=True)
    for pid in inst.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    await inst.stop()

    inst = await start_instance(size=SIZE, fanout=2, statedir=statedir, attrs=attrs)
    h = await connect(inst, SIZE - 1)
    root = await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": "primary"}), T)
    resumed = int(root["rootseq"])
    synced = max((t.seq for t in run.txns if t.flags & SYNC and t.seq is not None), default=0)
    assert resumed == synced and root["rootref"] == run.events.get(resumed), \
        f"{where}: resumed at v{resumed} {root['rootref']}, the last SYNC commit made v{synced}"
    state = run.states[resumed]
    assert await read_version(h, root["rootref"]) == observe(state.tree), where
    ids = {op["lease"] for t in run.txns for op in t.ops if "lease" in op}
    ids |= {t.revokes for t in run.txns if t.revokes is not None}
    for lease in sorted(ids):  # type: ignore[type-var]
        held = state.keys_of(lease)  # type: ignore[arg-type]
        try:
            r = await asyncio.wait_for(h.rpc("kvs.lease-revoke", {"id": lease}), T)
        except RemoteError as exc:
            assert (exc.errnum, held) == (errno.ENOENT, []), \
                f"{where}: revoking lease {lease} after the restart: {exc}; the model " \
                f"has {held} attached to it at v{resumed}"
            continue
        assert held, f"{where}: lease {lease} came back with no key attached in the model"
        seq = r["rootseqs"].get("primary")
        state = apply_txn(state, unlinks_of(state, lease))[1]
        now = await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": "primary"}), T)
        assert now["rootseq"] == seq, f"{where}: revoke answered {r}, the root is {now}"
        assert await read_version(h, now["rootref"]) == observe(state.tree), \
            f"{where}: revoking lease {lease} (the model: {held}) left another tree"


# --- a namespace removed and made again while commits race it ---------------

NS = "x"
LIVES = 10  # times the namespace is made (and removed)


@dataclass
class Life:
    """One incarnation of :data:`NS`, from its events: its epoch, the
    version it began at, and each version's root."""
    epoch: int
    start: int
    roots: dict[int, str] = field(default_factory=dict)
    created: tuple[float, float] = (0.0, 0.0)  # its create request: sent, answered
    removed: tuple[float, float] = (float("inf"), float("inf"))  # and its remove's
    heard: dict[int, float] = field(default_factory=dict)
    """When a client of each rank received its ``created`` event: that rank's
    kvs had taken it by then (a rank's modules take an event as it routes it)."""


async def churn(h0: Handle, writers: list[Writer], times: list[tuple[float, float, float, float]],
                rng: random.Random, stop: asyncio.Event) -> None:
    """Make :data:`NS` and remove it, :data:`LIVES` times, each after a
    random number of the writers' answers (its commits, then their failures
    while it is gone; until ``stop``): each life's create and remove
    requests' times (sent, answered) in ``times``."""
    async def answers(n: int) -> None:
        for _ in range(n):
            for w in writers:
                w.answered.clear()
            if stop.is_set():
                return
            waits = [asyncio.ensure_future(w.answered.wait()) for w in writers]
            waits.append(asyncio.ensure_future(stop.wait()))
            await asyncio.wait(waits, timeout=T, return_when=asyncio.FIRST_COMPLETED)
            for f in waits:
                f.cancel()

    for _ in range(LIVES):
        t0 = time.monotonic()
        await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": NS}), T)
        t1 = time.monotonic()
        await answers(rng.randint(4, 14))
        t2 = time.monotonic()
        await asyncio.wait_for(h0.rpc("kvs.namespace-remove", {"namespace": NS}), T)
        times.append((t0, t1, t2, time.monotonic()))
        await answers(rng.randint(0, 3))


def refused_for_namespace(t: Txn) -> bool:
    """Failed because :data:`NS` was not there (else: by its own ops)."""
    return t.errnum == errno.ENOTSUP and t.errstr.startswith("namespace ")


def refusal_explained(t: Txn, rank: int, lives: list[Life]) -> bool:
    """A commit refused for the namespace: some life had ended before the
    answer (or none had begun), and the rank it was sent to had not yet
    heard of the next one when it was sent.  (A follower knows the
    namespace by the events it has taken, as it knows its versions: one that
    has not taken the ``removed`` event yet relays the commit to the life
    it knows, which rank 0 refuses -- never applies to the next life.)"""
    inf = float("inf")
    for j in range(-1, len(lives)):
        ended = j < 0 or lives[j].removed[0] < t.answered
        unheard = j + 1 == len(lives) or lives[j + 1].heard.get(rank, inf) > t.sent
        if ended and unheard:
            return True
    return False


def check_lives(txns: list[Txn], lives: list[Life], ranks: dict[int, int],
                seen: dict[tuple[int, int], dict[str, Seen]]) -> list[str]:
    """Each life a serial history of the commits answered with its roots;
    a commit answered while no life overlapped it, or refused for the
    namespace without a reason (:func:`refusal_explained`; ``ranks``: each
    writer's), is wrong; one failed by its own ops fails so against a
    version of a life current while it was in flight."""
    failures: list[str] = []
    where: dict[tuple[int, str], Life] = {}
    for life in lives:
        if sorted(life.roots) != list(range(life.start + 1, life.start + 1 + len(life.roots))):
            failures.append(f"epoch {life.epoch}: setroots not one per version: {life.roots}")
        for seq, ref in life.roots.items():
            where[seq, ref] = life
    by_life: dict[int, dict[int, list[Txn]]] = {life.epoch: {} for life in lives}
    for t in txns:
        if t.seq is None:
            if refused_for_namespace(t) and not refusal_explained(t, ranks[t.writer], lives):
                failures.append(f"{t.describe()} on rank {ranks[t.writer]}, while {NS} "
                                f"was there and that rank knew it")
            continue
        life = where.get((t.seq, t.rootref))
        if life is None:
            failures.append(f"{t.describe()}: no life of {NS} has that root at v{t.seq}")
        elif not (life.created[0] < t.answered and t.sent < life.removed[1]):
            failures.append(f"{t.describe()}: applied to epoch {life.epoch}, "
                            f"which did not exist while it was in flight")
        else:
            by_life[life.epoch].setdefault(t.seq, []).append(t)

    states: dict[tuple[int, int], State] = {}
    for life in lives:
        state = states[life.epoch, life.start] = State({})
        for seq in sorted(life.roots):
            group = by_life[life.epoch].get(seq, [])
            if len(group) > 1 and any(t.flags & NO_MERGE for t in group):
                failures.append(f"epoch {life.epoch} v{seq} merged a NO_MERGE transaction")
            new = explain(state, group, set(), seen[life.epoch, seq])
            if new is None:
                failures.append(unexplained(f"epoch {life.epoch} v{seq}", state,
                                            seen[life.epoch, seq], group))
                return failures  # (the states after it are unknown)
            state = states[life.epoch, seq] = new

    for t in txns:
        if t.seq is not None or refused_for_namespace(t):
            continue
        outcomes: set[int] = set()
        for life in lives:
            if not (life.created[0] < t.answered and t.sent < life.removed[1]):
                continue
            mine = by_life[life.epoch]
            low = max((seq for seq, group in mine.items()
                       if any(u.answered < t.sent for u in group)), default=life.start)
            high = low
            while high + 1 in life.roots and all(u.sent < t.answered
                                                 for u in mine.get(high + 1, [])):
                high += 1
            outcomes |= {apply_txn(states[life.epoch, v], t.ops)[0]
                         for v in range(low, high + 1)}
        if t.errnum not in outcomes:
            failures.append(f"{t.describe()}: the lives current while it was in flight "
                            f"give {sorted(outcomes)}")
    return failures


@pytest.mark.parametrize("mode", list(MODES))
async def test_commits_racing_a_namespace_made_again_land_in_one_life(
        start_instance, connect, mode: str) -> None:
    """Writers on every rank (five, four of them on followers: their
    commits are relayed with the namespace's epoch) commit to :data:`NS` while it is removed and
    made again under them.  Every commit answered with a version is in the
    life of the namespace it was answered from, in a serial history of that
    life's commits; a commit refused for the namespace (``ENOTSUP``) changed
    nothing, and was refused only once a life had ended, by a rank that had
    not heard of the next one when it was sent; one failed by its own ops
    fails so against a version current while it was in flight; no
    version holds a commit that was refused (each begins with a token of its
    own, appended to a log, so no two versions are alike)."""
    base = os.environ.get("KVB_TXN_SEED")
    seed = int(base) if base else random.randrange(1 << 30)
    where = f"{mode}, KVB_TXN_SEED={seed}"
    no_merge, size, ranks = MODES[mode]
    inst = await start_instance(size=size, fanout=2)
    h0 = await connect(inst, 0)
    recorder = await connect(inst, size - 1)
    await recorder.subscribe(f"kvs.namespace-{NS}-")
    heard: dict[int, dict[int, float]] = {}  # epoch -> rank -> when
    heralds = [await connect(inst, rank) for rank in range(size)]
    for h in heralds:
        await h.subscribe(f"kvs.namespace-{NS}-created")

    async def listen(rank: int, h: Handle) -> None:
        while True:
            ev = await h.recv_event()
            heard.setdefault(int(ev.payload["epoch"]), {})[rank] = time.monotonic()

    listeners = [asyncio.ensure_future(listen(rank, h)) for rank, h in enumerate(heralds)]
    txns: list[Txn] = []
    writer_ranks = dict(enumerate(ranks[1:]))
    writers = [Writer(i, await connect(inst, rank), random.Random(f"{seed} {mode} {i}"),
                      no_merge, txns, [], None, ns=NS)
               for i, rank in writer_ranks.items()]
    times: list[tuple[float, float, float, float]] = []
    stop = asyncio.Event()

    async def write() -> None:
        await asyncio.gather(*(w.run(TXNS) for w in writers))
        stop.set()

    await asyncio.gather(write(), churn(h0, writers, times, random.Random(seed), stop))
    for task in listeners:
        task.cancel()

    lives: list[Life] = []
    while len(lives) < len(times) or lives[-1].removed[0] == float("inf"):
        ev = await asyncio.wait_for(recorder.recv_event(), T)
        kind, p = ev.topic.rsplit("-", 1)[1], ev.payload
        if kind == "created":
            assert not lives or lives[-1].removed[0] != float("inf"), \
                f"{where}: created again before removed: {p}"
            lives.append(Life(int(p["epoch"]), int(p["rootseq"])))
        elif kind == "setroot":
            assert lives and lives[-1].removed[0] == float("inf"), f"{where}: setroot {p}"
            lives[-1].roots[int(p["rootseq"])] = p["rootref"]
        elif kind == "removed":
            assert lives and p["epoch"] == lives[-1].epoch, f"{where}: removed {p}"
            lives[-1].removed = (0.0, 0.0)  # (the times are the churner's: below)
    assert [life.epoch for life in lives] == sorted({life.epoch for life in lives}), where
    for life, (t0, t1, t2, t3) in zip(lives, times, strict=True):
        life.created, life.removed = (t0, t1), (t2, t3)
        life.heard = heard.get(life.epoch, {})

    readers = [await connect(inst, r) for r in range(size)]
    keys = [(life, seq) for life in lives for seq in sorted(life.roots)]
    versions = await asyncio.gather(*(read_version(readers[i % size], life.roots[seq])
                                      for i, (life, seq) in enumerate(keys)))
    seen = {(life.epoch, seq): v for (life, seq), v in zip(keys, versions, strict=True)}
    failures = check_lives(txns, lives, writer_ranks, seen)
    assert not failures, (
        f"{where}: {len(failures)} problems:\n" + "\n".join(failures[:20])
        + "\nthe lives: " + "; ".join(f"epoch {life.epoch} v{life.start}..v"
                                       f"{max(life.roots, default=life.start)}" for life in lives)
        + "\nthe transactions, by writer:\n" + "\n".join(f"  {t.describe()}" for t in txns))
    # The history did what it is for: commits were refused for the namespace.
    assert any(refused_for_namespace(t) for t in txns), where
