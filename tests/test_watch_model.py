"""Watchers on every rank against a model, over a random history of commits.

A seeded random history of small transactions (puts, appends, unlinks,
``mkdir``, a value or a symlink replacing the directory above a watched key,
writes through that symlink, commits that name no watched key) is committed
to a size-4 instance from random ranks, in three ways: one writer, one
transaction at a time, which also attaches puts and appends to a lease now
and then and revokes it (its keys still attached are unlinked in a commit
of their own; a later write of a key, above or below it detaches it: the
model keeps the attachments); three writers at once on parts of the tree that
commute, so rank 0 merges their transactions into shared versions; three
writers at once over the whole tree with ``NO_MERGE``.  A plain Python model
of the tree replays the commits in version order (each commit's answer names
its ``rootseq``), so the state at every version and the keys each version's
commit named are known.

Watchers of every kind the protocol defines (``WATCH`` alone and with
``UNIQ``, ``FULL``, ``WAITCREATE``, ``WATCH_DELETES``, ``APPEND``, and
``WATCH_KEYS``) sit on every rank, some from the start, some started while
the history runs -- among those, ``KVS.watch_keys(since=...)`` watches
catching up from an earlier version, whose first answer must hold the
model's difference between that version and the one it starts at.  From
docs/protocol.md ("kvs-watch", *Semantics*), the model predicts the exact
answers of each one -- the versions it answers, the value at each, and
whether and how it ends -- and the test compares them with what it got:

* a watcher started before the history is predicted from its first
  version on, waiting ones included (the test waits until each rank counts
  them before the first commit);
* a watcher started during the history begins at whatever version its rank
  had reached; its first answer names that version, and it is predicted
  from there (the first answer must be the model's value at that version).

A last commit gives every watched key a new value, so each watcher still
running answers it; then each is cancelled and must end ``ENODATA``.  Reads
are checked too: right after each commit, on the rank that made it, a key
it wrote is read (the version served must be the commit's or newer:
read-your-writes, relayed commits included), and at the end every version's
root is read back (``rootdir``) from random ranks, every key compared with
the model at that version, and ``kvs.diff`` of random pairs of versions is
compared with the difference of the model's trees.

The history is drawn from a seed (``KVB_WATCH_SEED`` to replay one); a
failure names it and shows the watcher, its prediction and what it got, and
the history.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_watch_helpers import (
    APPEND,
    FULL,
    NO_MERGE,
    UNIQ,
    WAITCREATE,
    WATCH,
    append,
    commit,
    put,
    unlink,
    wait_watchers,
    watch_stream,
)

from broker.errors import RemoteError
from broker.handle import Handle, Stream
from broker.message import Message
from kvs.client import KVS

DELETES = 1 << 17
T = 10.0
SIZE = 4
HISTORY = 90  # transactions, besides the first and the last
LATE_WATCHERS = 12

# What every rank watches from the start: (key, flags).
SPECS: list[tuple[str, int]] = [
    ("m.a", WATCH),
    ("m.a", WATCH | UNIQ),
    ("m.a", WATCH | FULL),
    ("m.a", WATCH | WAITCREATE),
    ("m.a", WATCH | DELETES),
    ("m.a", WATCH | DELETES | UNIQ),
    ("m.b.c", WATCH | WAITCREATE),
    ("m.b.c", WATCH | FULL | WAITCREATE),
    ("m.b.c", WATCH | UNIQ | WAITCREATE),
    ("m.b.c", WATCH | DELETES),
    ("m.b.c", WATCH | DELETES | WAITCREATE | FULL),
    ("m.log", WATCH | APPEND | WAITCREATE),
    ("m.log", WATCH | WAITCREATE),
]

KEYS = 1 << 16  # WATCH_KEYS
KEY_WATCHED = [".", "m", "m.b"]  # WATCH_KEYS watchers of each, on every rank, from the start
SINCE_WATCHED = [".", "m"]  # kvs.watch_keys(since=...) started during the history

SHORT = [b"x", b"y", b"z"]  # few, so UNIQ and FULL meet equal values
LONG = [bytes([65 + i]) * 100 for i in range(2)]  # stored as blobs, not inline


# --- the model ---------------------------------------------------------------

INLINE_MAX = 64  # longer values are stored as a blob (docs/kvs.md, "The model")


@dataclass(frozen=True)
class Val:
    """A value as kvs stores it: inline (a ``val`` tree object), or the blobs
    of a ``valref``, one per append.  Blobs are named by their content, so
    two values made differently may still share their blobs -- what
    ``WATCH_APPEND`` compares."""
    chunks: tuple[bytes, ...]
    inline: bool

    @property
    def data(self) -> bytes:
        return b"".join(self.chunks)

    @staticmethod
    def of(data: bytes) -> Val:
        return Val((data,), len(data) <= INLINE_MAX)


@dataclass(frozen=True)
class Link:
    """A symlink: lookups and writes below it go to ``target``."""
    target: str


Tree = dict[str, Any]  # name -> Tree | Val | Link


def copy_tree(tree: Tree) -> Tree:
    return {k: copy_tree(v) if isinstance(v, dict) else v for k, v in tree.items()}


def _dir_at(tree: Tree, key: str, create: bool, depth: int = 0) -> Tree | None:
    """The directory ``key`` names, following symlinks on the way and at its
    end; with ``create``, made (over a value or nothing) as a write does."""
    assert depth < 8, "a symlink loop: the history makes none"
    node = tree
    for name in key.split("."):
        child = node.get(name)
        if isinstance(child, Link):
            child = _dir_at(tree, child.target, create, depth + 1)
        elif not isinstance(child, dict) and create:
            child = node[name] = {}  # a value on the way becomes a directory
        if not isinstance(child, dict):
            return None
        node = child
    return node


def find(tree: Tree, key: str) -> Tree | Val | None:
    """What a lookup of ``key`` finds (symlinks followed), None if missing."""
    *path, last = key.split(".")
    parent = _dir_at(tree, ".".join(path), create=False) if path else tree
    node = None if parent is None else parent.get(last)
    if isinstance(node, Link):
        return find(tree, node.target)
    return node  # type: ignore[no-any-return]


def _parent(tree: Tree, key: str, create: bool) -> tuple[Tree | None, str]:
    *path, last = key.split(".")
    return (_dir_at(tree, ".".join(path), create) if path else tree), last


def resolved(tree: Tree, key: str, depth: int = 0) -> str:
    """The key a write of ``key`` reaches: the symlinks on its path
    followed (not one at its end), as kvs writes through them."""
    assert depth < 8, "a symlink loop: the history makes none"
    parts = key.split(".")
    node = tree
    for i, name in enumerate(parts[:-1]):
        child = node.get(name)
        if isinstance(child, Link):
            return resolved(tree, ".".join([child.target, *parts[i + 1:]]), depth + 1)
        if not isinstance(child, dict):
            return key  # (made along the way: no link further on)
        node = child
    return key


def apply(tree: Tree, op: dict[str, Any]) -> None:
    """One transaction op, as kvs applies it (docs/kvs.md, "The model"):
    symlinks on the way are followed, one at the key is what is written."""
    key, dirent = op["key"], op["dirent"]
    if dirent is None:
        parent, last = _parent(tree, key, create=False)
        if parent is not None:
            parent.pop(last, None)
        return
    parent, last = _parent(tree, key, create=True)
    assert parent is not None
    if dirent["type"] == "dir":
        parent[last] = {}
    elif dirent["type"] == "symlink":
        parent[last] = Link(dirent["data"]["target"])
    elif op["flags"] & 32:  # append: a new blob after the old value's
        old = parent.get(last)
        assert isinstance(old, Val | None), "the history appends to values only"
        parent[last] = (Val(old.chunks + (dirent["data"],), False) if old is not None
                        else Val.of(dirent["data"]))
    else:
        parent[last] = Val.of(dirent["data"])


def symlink(key: str, target: str) -> dict[str, Any]:
    return {"key": key, "flags": 0,
            "dirent": {"ver": 1, "type": "symlink", "data": {"target": target}}}


def mkdir(key: str) -> dict[str, Any]:
    return {"key": key, "flags": 0, "dirent": {"ver": 1, "type": "dir", "data": {}}}


AREAS: dict[str, list[Callable[[random.Random, bytes], dict[str, Any]]]] = {
    "a": [
        lambda rng, value: put("m.a", value),
        lambda rng, value: put("m.a", value),
        lambda rng, value: unlink("m.a"),
    ],
    "b": [
        lambda rng, value: put("m.b.c", value),
        lambda rng, value: put("m.b.c", value),
        lambda rng, value: unlink("m.b.c"),
        lambda rng, value: put("m.b.d", value),
        lambda rng, value: unlink("m.b"),
        lambda rng, value: put("m.b", value),  # a value where the directory was
        lambda rng, value: mkdir("m.b"),
        # m.b a symlink: writes below it land in its target; a watcher of
        # m.b.c reads through it but is named by neither
        lambda rng, value: symlink("m.b", rng.choice(["m.t", "m.u"])),
        lambda rng, value: put(rng.choice(["m.t.c", "m.u.c"]), value),
        lambda rng, value: unlink(rng.choice(["m.t", "m.u.c"])),
    ],
    "log": [
        lambda rng, value: append("m.log", rng.choice(SHORT)),
        lambda rng, value: append("m.log", rng.choice(SHORT)),
        lambda rng, value: put("m.log", rng.choice(SHORT)),  # a rewrite: APPEND ends EINVAL
        lambda rng, value: unlink("m.log"),
        lambda rng, value: put("z.other", value),  # names no watched key
    ],
}
"""Ops by the part of the tree they touch: transactions of different areas
commute, so concurrent ones may be merged into one version."""


def random_op(rng: random.Random, areas: str = "a b log") -> dict[str, Any]:
    value = rng.choice(SHORT + LONG if rng.random() < 0.3 else SHORT)
    makers = [m for area in areas.split() for m in AREAS[area]]
    return rng.choice(makers)(rng, value)


def describe(op: dict[str, Any]) -> str:
    dirent = op["dirent"]
    if dirent is None:
        return f"unlink {op['key']}"
    if dirent["type"] == "dir":
        return f"mkdir {op['key']}"
    if dirent["type"] == "symlink":
        return f"symlink {op['key']} -> {dirent['data']['target']}"
    verb = "append" if op["flags"] & 32 else "put"
    data = dirent["data"]
    leased = f" (lease {op['lease'] % 1000})" if "lease" in op else ""
    return f"{verb} {op['key']}={data[:8]!r}{'...' if len(data) > 8 else ''}{leased}"


@dataclass
class History:
    """The state after each version and the keys each version's commit named."""
    states: dict[int, Tree] = field(default_factory=dict)
    names: dict[int, list[str]] = field(default_factory=dict)
    ops: dict[int, str] = field(default_factory=dict)
    """Each version's transactions, for a failure's report."""
    tree: Tree = field(default_factory=dict)
    applied: int = 0  # commits of ``replay``'s list applied so far
    attached: dict[str, int] = field(default_factory=dict)
    """Keys attached to a lease, by name as written (docs/kvs.md, Leases)."""

    def record(self, seq: int, names: list[str], tree: Tree, ops: str = "") -> None:
        self.states[seq] = copy_tree(tree)
        self.names[seq] = names
        self.ops[seq] = ops

    def replay(self, done: list[tuple[int, list[dict[str, Any]]]]) -> None:
        """Apply the commits of ``done`` not applied yet, in version order;
        commits merged into one version (same ``rootseq``) make one state.
        (They touch parts of the tree that commute: their order is moot.)"""
        new = sorted(done[self.applied:], key=lambda c: c[0])
        self.applied = len(done)
        for seq, group in itertools.groupby(new, key=lambda c: c[0]):
            ops = [op for _, txn in group for op in self.expand(txn)]
            assert seq not in self.states, f"version {seq} came back after its replay"
            for op in ops:
                apply(self.tree, op)
                self.lease_write(op)
            self.record(seq, [op["key"] for op in ops], self.tree,
                        "; ".join(describe(op) for op in ops))

    def expand(self, txn: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A revoked lease's entry (``{"revoke": id}``) is the unlink of every
        key still attached to it; any other op is itself."""
        out = []
        for op in txn:
            if "revoke" in op:
                out += [unlink(k) for k, lease in sorted(self.attached.items())
                        if lease == op["revoke"]]
            else:
                out.append(op)
        return out

    def lease_write(self, op: dict[str, Any]) -> None:
        """A write detaches the attached keys it touches (itself, above and
        below it), by its name and by the key a symlink on its path led it
        to; a put or append with a lease attaches its key (by its own name:
        the writer attaches none through a symlink, which kvs refuses)."""
        key = op["key"]
        for name in {key, resolved(self.tree, key)}:
            for k in [k for k in self.attached
                      if k == name or k.startswith(name + ".") or name.startswith(k + ".")]:
                del self.attached[k]
        if "lease" in op:
            self.attached[key] = op["lease"]


# --- what a watcher must see -------------------------------------------------

Answer = tuple[int, bytes | None]  # (rootseq, value; None: the key is missing)


def predict(key: str, flags: int, hist: History, start: int, final: int,
            ) -> tuple[list[Answer], int]:
    """The answers of a watcher of ``key`` that begins at version ``start``,
    through ``final``, and the errno that ends it (0: still running).
    ``APPEND`` answers are joined per version (one per blob on the wire)."""
    full, uniq, deletes = flags & FULL, flags & UNIQ, flags & DELETES
    waitcreate, appending = flags & WAITCREATE, flags & APPEND
    out: list[Answer] = []
    answered = False  # a value has been answered (and not removed since)
    last: Val | None = None
    node = find(hist.states[start], key)
    if isinstance(node, dict):
        return out, errno.EISDIR
    if isinstance(node, Val):
        out.append((start, node.data))
        answered, last = True, node
    elif deletes and not waitcreate:
        out.append((start, None))
    elif not (waitcreate or deletes):
        return out, errno.ENOENT
    for v in range(start + 1, final + 1):
        names = hist.names[v]
        if not (full
                or any(n == key or n.startswith(key + ".") for n in names)
                or (deletes and any(key.startswith(n + ".") for n in names))):
            continue
        node = find(hist.states[v], key)
        if isinstance(node, dict):
            return out, errno.EISDIR
        if node is None:
            if deletes:
                if answered:
                    out.append((v, None))
                answered, last = False, None
                continue
            if answered:
                return out, errno.ENOENT
            continue  # still waiting for it
        if appending and answered and last is not None:
            # grown by appends: every blob answered still there, in place
            n = len(last.chunks)
            if node.inline or node.chunks[:n] != last.chunks:
                return out, errno.EINVAL
            if len(node.chunks) > n:
                out.append((v, b"".join(node.chunks[n:])))
                last = node
            continue
        if (uniq or full) and last is not None and node.data == last.data:
            continue
        out.append((v, node.data))
        answered, last = True, node
    return out, 0


def names_for(key: str, names: list[str]) -> list[str]:
    """The keys of a commit a WATCH_KEYS watcher of ``key`` is told: at or
    below it, or a directory above it (docs/protocol.md)."""
    below = key + "."
    return [n for n in names
            if key == "." or n == key or n.startswith(below) or below.startswith(n + ".")]


def keys_expected(key: str, hist: History, start: int, final: int,
                  first: list[str]) -> list[tuple[int, list[str]]]:
    """A key watcher's answers: ``first`` at ``start``, then each version
    naming a key it is told of, those keys, each once (sorted: within a
    merged version the order of its transactions is rank 0's, unknown
    here)."""
    out = [(start, sorted(first))]
    for v in range(start + 1, final + 1):
        if mine := names_for(key, hist.names[v]):
            out.append((v, sorted(set(mine))))
    return out


# --- the watchers ------------------------------------------------------------

async def next_message(stream: Stream, what: str, got: Any) -> Message | None:
    """The stream's next message (None at its end) within ``T``; else fail,
    naming the watcher and what it got."""
    try:
        return await asyncio.wait_for(stream.next_message(), T)
    except TimeoutError:
        raise AssertionError(f"{what}: no answer for {T}s; got {got}") from None


@dataclass
class Watcher:
    key: str
    flags: int
    rank: int
    stream: Stream
    late: bool
    got: list[Answer] = field(default_factory=list)
    end: int | None = None  # errno that ended it (0: ENODATA), None: running

    def describe(self) -> str:
        names = [n for n, bit in [("WATCH", WATCH), ("WAITCREATE", WAITCREATE),
                                  ("FULL", FULL), ("UNIQ", UNIQ), ("APPEND", APPEND),
                                  ("DELETES", DELETES)] if self.flags & bit]
        when = "started during the history" if self.late else "started first"
        return f"{self.key} {'|'.join(names)} on rank {self.rank}, {when}"

    async def read(self, until: int) -> None:
        """Answers until one at version ``until`` or later, or the end of the
        stream.  An ``APPEND`` watcher's answers of one version (one per
        blob) are joined; those after the one this returns at are joined
        when read later."""
        while self.end is None:
            try:
                msg = await next_message(self.stream, self.describe(), self.got)
            except RemoteError as exc:
                self.end = exc.errnum
                return
            if msg is None:
                self.end = 0
                return
            seq, v = int(msg.payload["rootseq"]), msg.payload["val"]
            data = None if v is None else bytes(v["data"])
            if (self.flags & APPEND and self.got and self.got[-1][0] == seq
                    and data is not None):
                self.got[-1] = (seq, (self.got[-1][1] or b"") + data)
            else:
                self.got.append((seq, data))
            if seq >= until:
                return


@dataclass
class KeysWatcher:
    """A WATCH_KEYS watcher (raw), or a ``watch_keys(since=...)`` one (the
    client's, which catches up by a diff): the keys of each answer."""
    key: str
    rank: int
    got: list[tuple[int, list[str]]] = field(default_factory=list)
    since: int | None = None  # the version it caught up from

    def add(self, seq: int, keys: Any) -> None:
        self.got.append((seq, sorted(keys)))

    def describe(self) -> str:
        how = "WATCH_KEYS" if self.since is None else f"watch_keys(since=version {self.since})"
        return f"{how} of {self.key!r} on rank {self.rank}"


async def read_keys(w: KeysWatcher, stream: Stream, final: int) -> None:
    while not w.got or w.got[-1][0] < final:
        try:
            msg = await asyncio.wait_for(stream.next_message(), T)
        except TimeoutError:
            raise AssertionError(f"{w.describe()}: no answer for {T}s; got {w.got}") from None
        assert msg is not None, f"{w.describe()}: ended; got {w.got}"
        w.add(int(msg.payload["rootseq"]), msg.payload["keys"])


MODES = {
    # one writer, one transaction at a time, each from a random rank; puts
    # and appends attached to a lease now and then, and the lease revoked
    "one writer": (["a b log"], 0),
    # three writers at once, on parts of the tree that commute, merged
    "writers merged": (["a", "b", "log"], 0),
    # three writers at once over the whole tree, each commit its own version
    "writers unmerged": (["a b log"] * 3, NO_MERGE),
}
LEASES = "one writer"  # (a revoke's unlinks would not commute with the other writers')


@pytest.mark.parametrize("mode", MODES)
async def test_watchers_see_what_the_model_says(start_instance, connect, mode: str) -> None:
    writer_areas, commit_flags = MODES[mode]
    base = os.environ.get("KVB_WATCH_SEED")
    seed = int(base) if base else random.randrange(1 << 30)
    rng = random.Random(f"{seed} {mode}")
    where = f"{mode}, KVB_WATCH_SEED={seed}"
    inst = await start_instance(size=SIZE, fanout=2)
    handles: list[Handle] = [await connect(inst, r) for r in range(SIZE)]
    hist = History()
    done: list[tuple[int, list[dict[str, Any]]]] = []  # (rootseq, ops) of each commit
    rootrefs: dict[int, str] = {}
    reads: list[tuple[int, int, str, Any]] = []  # (committed, read at, key, what the read got)

    async def commit_ops(ops: list[dict[str, Any]], h: Handle) -> int:
        """Commit ``ops`` through ``h`` (the rank it is attached to)."""
        r = await commit(h, *ops, flags=commit_flags)
        seq = int(r["rootseq"])
        done.append((seq, ops))
        rootrefs[seq] = r["rootref"]
        # read-your-writes: the committing rank serves this version or a newer one
        key = ops[-1]["key"]
        try:
            got: Any = await asyncio.wait_for(h.rpc("kvs.lookup-plus", {
                "namespace": "primary", "key": key, "flags": 0}), T)
            reads.append((seq, int(got["rootseq"]), key, got["val"]))
        except RemoteError as exc:
            reads.append((seq, -1, key, exc.errnum))
        return seq

    root = await handles[0].rpc("kvs.getroot", {"namespace": "primary"})
    hist.record(int(root["rootseq"]), [], {})
    first_ops = [op for op in (random_op(rng) for _ in range(4)) if op["key"] != "z.other"]
    start = await commit_ops(first_ops, handles[0])
    hist.replay(done)
    for h in handles:  # every rank at ``start`` before its watchers begin
        await asyncio.wait_for(h.rpc("kvs.wait-version",
                                     {"namespace": "primary", "rootseq": start}), T)

    # The watchers that start first: each rank's set, settled before the
    # first commit -- an initial answer read, an immediate end seen, and the
    # waiting ones counted by kvs-watch on their rank.
    watchers: list[Watcher] = []
    for rank, h in enumerate(handles):
        for key, flags in SPECS:
            watchers.append(Watcher(key, flags, rank, watch_stream(h, key, flags), late=False))
    keys_watchers: list[tuple[KeysWatcher, Stream]] = [
        (KeysWatcher(key, rank), watch_stream(h, key, WATCH | KEYS))
        for rank, h in enumerate(handles) for key in KEY_WATCHED]
    since_tasks: list[tuple[KeysWatcher, asyncio.Future[None]]] = []
    at_start = {(key, flags): predict(key, flags, hist, start, start) for key, flags in SPECS}
    await asyncio.gather(*(w.read(start) for w in watchers
                           if at_start[w.key, w.flags][0] or at_start[w.key, w.flags][1]))
    waiting = sum(1 for answers, end in at_start.values() if not end) + len(KEY_WATCHED)
    for h in handles:
        await wait_watchers(h, waiting, timeout=T)

    finals: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def grant_or_revoke(lease: int | None, h: Handle) -> int | None:
        """A new lease (ttl an hour: it never expires here), or the current
        one revoked: its keys still attached are unlinked in one commit,
        whose version the answer names -- none if no key is attached."""
        if lease is None:
            return int((await asyncio.wait_for(h.rpc("kvs.lease-grant", {"ttl": 3600}), T))["id"])
        held = sorted(k for k, owner in hist.attached.items() if owner == lease)
        r = await asyncio.wait_for(h.rpc("kvs.lease-revoke", {"id": lease}), T)
        seq = r["rootseqs"].get("primary")
        assert (seq is not None) == bool(held), \
            f"{where}: revoking a lease holding {held} answered {r}"
        if seq is not None:
            # (the only writer: the current root is the unlinks')
            root = await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": "primary"}), T)
            assert root["rootseq"] == seq, f"{where}: revoke answered {seq}, root is {root}"
            done.append((int(seq), [{"key": "(revoke)", "revoke": lease}]))
            rootrefs[int(seq)] = root["rootref"]
            hist.replay(done)
        return None

    async def writer(index: int, areas: str, n: int) -> None:
        wrng = random.Random(f"{seed} {mode} {index}")
        own = [await connect(inst, r) for r in range(SIZE)]  # its own connection per rank
        late_at = set(wrng.sample(range(n), LATE_WATCHERS)) if index == 0 else set()
        lease: int | None = None
        for i in range(n):
            if i in late_at:
                rank = wrng.randrange(SIZE)
                key, flags = wrng.choice(SPECS)
                watchers.append(Watcher(key, flags, rank,
                                        watch_stream(handles[rank], key, flags), late=True))
            if index == 0 and i in late_at and rootrefs:
                # and a key watch catching up from an earlier version
                old = wrng.choice(sorted(rootrefs))
                kw = KeysWatcher(wrng.choice(SINCE_WATCHED), wrng.randrange(SIZE), since=old)
                since_tasks.append((kw, asyncio.ensure_future(
                    since_watch(kw, handles[kw.rank], rootrefs[old], finals))))
            rank = wrng.randrange(SIZE)
            if mode == LEASES and wrng.random() < 0.1:
                lease = await grant_or_revoke(lease, own[rank])
                continue
            ops = [random_op(wrng, areas) for _ in range(wrng.randint(1, 3))]
            if lease is not None:
                scratch = copy_tree(hist.tree)  # (the ops before it in the transaction too)
                for op in ops:  # attach some puts and appends, not through a symlink
                    if op["dirent"] is not None and op["dirent"]["type"] == "val" \
                            and wrng.random() < 0.5 and resolved(scratch, op["key"]) == op["key"]:
                        op["lease"] = lease
                    apply(scratch, op)
            await commit_ops(ops, own[rank])
            if mode == LEASES:  # (one writer: its versions come in order)
                hist.replay(done)

    await asyncio.gather(*(writer(k, areas, HISTORY // len(writer_areas))
                           for k, areas in enumerate(writer_areas)))
    # a new value for every watched key: each watcher still running answers it
    final = await commit_ops([put("m.a", b"end-a"), put("m.b.c", b"end-c"),
                              append("m.log", b"end-log")], handles[0])
    finals.set_result(final)
    hist.replay(done)
    assert sorted(hist.states) == list(range(min(hist.states), final + 1)), \
        f"{where}: versions are missing: {sorted(hist.states)}"
    await asyncio.gather(*(w.read(final) for w in watchers),
                         *(read_keys(w, stream, final) for w, stream in keys_watchers),
                         *(task for _, task in since_tasks))
    for w in watchers:
        if w.end is None:
            handles[w.rank].send_noresponse("kvs-watch.cancel", {"matchtag": w.stream.matchtag})
    await asyncio.gather(*(w.read(final + 1) for w in watchers if w.end is None))

    failures = [f for w in watchers if (f := check(w, hist, start, final))]
    failures += await check_snapshots(handles, rng, hist, rootrefs)
    failures += await check_diffs(handles, rng, hist, rootrefs)
    for kw, _ in keys_watchers:
        if kw.got != (want_keys := keys_expected(kw.key, hist, start, final, [])):
            failures.append(f"{kw.describe()}:\n    want {want_keys}\n    got  {kw.got}")
    for kw, _ in since_tasks:
        assert kw.since is not None
        began = kw.got[0][0] if kw.got else start
        changed = [k for k in model_diff(hist.states[kw.since], hist.states[began])
                   if kw.key == "." or k == kw.key or k.startswith(kw.key + ".")]
        if kw.got != (want_keys := keys_expected(kw.key, hist, began, final, changed)):
            failures.append(f"{kw.describe()}:\n    want {want_keys}\n    got  {kw.got}")
    failures += [f for read in reads if (f := check_read(hist, *read))]
    assert not failures, (
        f"{where}: {len(failures)} of {len(watchers)} watchers differ:\n" + "\n".join(failures)
        + "\nhistory (version: transaction):\n"
        + "\n".join(f"  {v}: {hist.ops[v]}" for v in sorted(hist.ops) if v >= start))


async def check_snapshots(handles: list[Handle], rng: random.Random, hist: History,
                          rootrefs: dict[int, str]) -> list[str]:
    """Every version's root, read back from a random rank (``rootdir``):
    each key the history writes as the model has it at that version."""
    async def read(v: int, key: str) -> str:
        root = {"ver": 1, "type": "dirref", "data": [rootrefs[v]]}
        want = find(hist.states[v], key)
        try:
            got = (await asyncio.wait_for(handles[rng.randrange(SIZE)].rpc("kvs.lookup", {
                "namespace": "primary", "key": key, "flags": 0, "rootdir": root}), T))["val"]
        except RemoteError as exc:
            if (exc.errnum, want) == (errno.ENOENT, None) or (
                    exc.errnum == errno.EISDIR and isinstance(want, dict)):
                return ""
            return f"version {v}: {key}: errno {exc.errnum}, the model has {want!r}"
        if isinstance(want, Val) and bytes(got["data"]) == want.data:
            return ""
        return f"version {v}: {key}: {got!r}, the model has {want!r}"

    reads = [read(v, key) for v in sorted(rootrefs)
             for key in ("m.a", "m.b", "m.b.c", "m.b.d", "m.log", "m.t.c", "m.u.c")]
    return [f for f in await asyncio.gather(*reads) if f]


EMPTY_DIR = "(empty directory)"


def keys_of(tree: Tree, prefix: str = "") -> dict[str, Any]:
    """The keys of a tree as ``kvs.diff`` sees them: values, symlinks (not
    followed) and empty directories, by path."""
    out: dict[str, Any] = {}
    for name, node in tree.items():
        path = f"{prefix}{name}"
        if isinstance(node, dict):
            out.update(keys_of(node, path + ".") if node else {path: EMPTY_DIR})
        else:
            out[path] = node
    return out


def model_diff(old: Tree, new: Tree) -> dict[str, str]:
    """docs/kvs.md's table: added, removed, or changed (the entries differ:
    a value's blobs or inline bytes, a link's target, an entry's kind)."""
    a, b = keys_of(old), keys_of(new)
    out = {k: "removed" for k in a.keys() - b.keys()}
    out.update({k: "added" for k in b.keys() - a.keys()})
    out.update({k: "changed" for k in a.keys() & b.keys() if a[k] != b[k]})
    return dict(sorted(out.items()))


async def check_diffs(handles: list[Handle], rng: random.Random, hist: History,
                      rootrefs: dict[int, str], pairs: int = 60) -> list[str]:
    """``kvs.diff`` of random pairs of versions (either way round, near and
    far apart), on random ranks, against the model's trees."""
    versions = sorted(rootrefs)

    async def diff(old: int, new: int) -> str:
        r = await asyncio.wait_for(handles[rng.randrange(SIZE)].rpc("kvs.diff", {
            "namespace": "primary", "old": rootrefs[old], "new": rootrefs[new]}), T)
        got = dict(zip(r["keys"], r["changes"], strict=True))
        want = model_diff(hist.states[old], hist.states[new])
        return "" if got == want else f"diff {old}..{new}:\n    want {want}\n    got  {got}"

    olds = [rng.choice(versions) for _ in range(pairs)]
    news = [rng.choice(versions) if i % 2 else min(o + 1, versions[-1])
            for i, o in enumerate(olds)]
    return [f for f in await asyncio.gather(*map(diff, olds, news)) if f]


def check_read(hist: History, committed: int, at: int, key: str, got: Any) -> str:
    """A read right after a commit, on the committing rank: at that version
    or a newer one, and the model's value there (an int: the errno)."""
    if isinstance(got, int):  # an error: only a directory, which has no value
        if got == errno.EISDIR and any(isinstance(find(hist.states[v], key), dict)
                                       for v in hist.states if v >= committed):
            return ""
        return f"read of {key} after {committed}: errno {got}"
    if at < committed:
        return f"read of {key} after committing version {committed} saw version {at}"
    want = find(hist.states[at], key)
    data = None if got is None else bytes(got["data"])
    if (data is None and want is None) or (isinstance(want, Val) and data == want.data):
        return ""
    return f"read of {key} at version {at}: {got!r}, the model has {want!r}"


async def since_watch(w: KeysWatcher, h: Handle, since: str,
                      finals: asyncio.Future[int]) -> None:
    """``KVS.watch_keys(since=...)``, started now (its answers wait in the
    handle), read once the history is over, until its last version."""
    async with KVS(h).watch_keys(w.key, since=since) as changes:
        final = await finals
        while not w.got or w.got[-1][0] < final:
            try:
                c = await asyncio.wait_for(anext(changes), T)
            except TimeoutError:
                raise AssertionError(f"{w.describe()}: no answer for {T}s; "
                                     f"got {w.got}") from None
            w.add(c.rootseq, c.keys)


def check(w: Watcher, hist: History, start: int, final: int) -> str:
    """What is wrong with ``w``'s answers and end ("" if nothing)."""
    if w.late:
        # It began at whatever version its rank had reached, at or after
        # ``start``: its first answer names that version (or a later one,
        # when it waited for the key); predicted from there.
        if not w.got:
            state = {errno.ENOENT: type(None), errno.EISDIR: dict}.get(w.end or 0)
            if state is not None and any(isinstance(find(hist.states[v], w.key), state)
                                         for v in range(start, final + 1)):
                return ""
            return f"{w.describe()}: ended errno {w.end} without an answer"
        began = w.got[0][0]
        if began < start:
            return f"{w.describe()}: first answer {w.got[0]} is older than {start}"
    else:
        began = start
    want, want_end = predict(w.key, w.flags, hist, began, final)
    # one still running at the end is ended by the cancel: ENODATA (0)
    if w.got == want and w.end == want_end:
        return ""
    return (f"{w.describe()}:\n    want {want} then errno {want_end}"
            f"\n    got  {w.got} then errno {w.end}")
