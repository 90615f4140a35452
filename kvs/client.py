"""The KVS client API: :class:`KVS` (async) and :class:`SyncKVS` (blocking).

    from broker.handle import Handle
    from kvs.client import KVS

    async with Handle.connect() as h:                # $KVBROKER_URI
        kvs = KVS(h)                                  # $KVBROKER_NAMESPACE or "primary"
        await kvs.put("a.b", {"x": 1})                # JSON; str is UTF-8; bytes raw
        print(await kvs.get_json("a.b"))
        async with kvs.txn() as t:                    # one transaction, committed on exit
            t.put("a.c", "hello").mkdir("a.d").symlink("a.e", "a.c")
        d = await kvs.dir("a")                        # a read-only mapping of entries
        print(sorted(d), d.kind("d"))                # by entry name: "dir"

Values travel as bytes.  :meth:`KVS.put` stores ``bytes`` as is, ``str``
as UTF-8 and anything else as compact JSON; :meth:`KVS.get` returns bytes,
:meth:`KVS.get_str` / :meth:`KVS.get_json` decode them.

Every method works in the handle's namespace given at construction
(``namespace=None`` means ``$KVBROKER_NAMESPACE``, else ``primary``; an
empty one is a ``ValueError``);
:meth:`KVS.with_namespace` gives a sibling bound to another one.

Errors: a failure reported by the kvs module raises
:class:`~broker.errors.RemoteError` with Flux's errno (``ENOENT`` for a
missing key, ``EISDIR`` for a directory read as a value, ``ENOTSUP`` for an
unknown namespace, ...).  Bad input caught before sending (a malformed tree
object or root reference) raises :class:`~broker.errors.ErrnoError` with
``EINVAL``; both are ``ErrnoError``.

Watching keys is the business of :mod:`kvs_watch.client`.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import json
import os
import random
import threading
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from contextlib import aclosing
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Literal,
    NamedTuple,
    Protocol,
    Self,
    TypeVar,
    Unpack,
    overload,
)

from broker import jsontoml
from broker.errors import ErrnoError, RemoteError
from broker.handle import Connecting
from broker.message import NODEID_ANY
from broker.rpc import WAIT_GRACE, check_str, check_timeout
from broker.sync import DEFAULT, Default
from kvs import eventlog, treeobj
from kvs.diff import Change
from kvs.keys import PRIMARY, join, normalize, parse_ns_target, split
from kvs.lookup import READDIR, READLINK, SYMLINK_MAX, TREEOBJ
from kvs.treeobj import TreeObj
from kvs.txn import APPEND, EXPECT, NO_MERGE, SYNC, check_limits

T = TypeVar("T")

if TYPE_CHECKING:
    from broker.handle import Handle
    from broker.sync import SyncHandle
    from kvs.checkpoints import Checkpoint
    from kvs_watch.client import (
        EventlogEntry,
        EventlogWatch,
        InitialDone,
        KeyChanges,
        KeyWatch,
        NamespaceEvent,
        NamespaceWatch,
        SyncWatch,
        Watch,
        WatchEntry,
        WatchOptions,
    )

__all__ = [
    "APPEND",
    "EXPECT",
    "NAMESPACE_ENV",
    "NO_MERGE",
    "READDIR",
    "READLINK",
    "READ_WINDOW",
    "SYNC",
    "TREEOBJ",
    "TREE_LIMIT",
    "Change",
    "CommitResult",
    "DELETE",
    "Dir",
    "KVS",
    "Lease",
    "LeaseGrant",
    "Link",
    "Root",
    "SyncKVS",
    "SyncLease",
    "SyncTxn",
    "Txn",
    "TxnOps",
    "UPDATE_BACKOFF",
    "UPDATE_BACKOFF_MAX",
    "UPDATE_RETRIES",
    "Updated",
    "default_namespace",
    "encode_value",
    "kind",
]

NAMESPACE_ENV = "KVBROKER_NAMESPACE"

_NO_DEFAULT: Any = object()
"""What ``get(key)`` without a ``default`` gets: a missing key is ``ENOENT``
(None cannot mean "no default": it is a useful default)."""
_MISSING_VALUE: Any = object()
"""What :meth:`KVS.get_str` and :meth:`KVS.get_json` ask :meth:`KVS.get` for
in place of a missing key's value: never a value a key holds."""


READ_WINDOW = 64
"""Value reads a subtree read (:meth:`KVS.get_tree`, ``kvbroker kvs dump``)
keeps in flight: a ``valref`` is one ``kvs.lookup``, and one at a time would
pay a round trip per key, all at once a request (and an answer held) per
key of the tree."""

TREE_LIMIT = 100_000
"""How many values :meth:`KVS.get_tree` returns by default before it gives
up with ``EOVERFLOW``: the whole answer is held in memory, and a tree of
millions of keys should be a clear error, not a process out of memory (the
same default bound as :meth:`KVS.diff`)."""


UPDATE_RETRIES = 32
"""How many times :meth:`KVS.update` tries again after a conflict by
default before it raises the conflict's ``ECANCELED``."""

UPDATE_BACKOFF = 0.0005
"""Seconds :meth:`KVS.update` waits at most before its first retry; each
conflict doubles it, up to :data:`UPDATE_BACKOFF_MAX`."""
UPDATE_BACKOFF_MAX = 0.064
"""The longest :meth:`KVS.update` waits before a retry.  The wait is a
random time up to ``UPDATE_BACKOFF * 2**(conflicts - 1)``, at most this
("full jitter").  Writers that read together conflict together: without
the wait, W updates started at once on one key retried in lock-step, one
winning per round, so the last needed W tries: 40 of them made ~700 tries
in all, and 2 gave up after 33.  With it, ~240 and at most ~10 each (100:
at most ~16); an update that meets no conflict never waits."""


class _Delete:
    """The type of :data:`DELETE` (one instance, made here)."""

    def __repr__(self) -> str:
        return "DELETE"


DELETE: Any = _Delete()
"""What an :meth:`KVS.update` function returns to remove the key."""


class Updated(NamedTuple):
    """What :meth:`KVS.update` returns: the ``value`` the function gave
    (None if the key is missing, removed or left missing), the
    :class:`CommitResult` of the commit that stored it (None when nothing
    was committed: the value was unchanged) and how many ``tries`` it took
    (1 without a conflict)."""

    value: Any
    result: CommitResult | None
    tries: int


def default_namespace(namespace: str | None = None) -> str:
    """``namespace``, else (None) ``$KVBROKER_NAMESPACE``, else ``"primary"``
    (an empty ``$KVBROKER_NAMESPACE`` counts as unset, as the shell's).

    An empty ``namespace`` is a ``ValueError``: it is no namespace, and
    taking it as "the default" turned a variable that was never set
    (``KVS(h, os.environ.get("JOBNS", ""))``) into writes to ``primary``.
    A namespace that is not a ``str`` is a ``TypeError``."""
    if namespace is None:
        return os.environ.get(NAMESPACE_ENV) or PRIMARY
    if not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, not {type(namespace).__name__}")
    if not namespace:
        raise ValueError("namespace must not be empty (None means the default: "
                         f"${NAMESPACE_ENV}, else {PRIMARY})")
    return namespace


def _namespace_named(name: Any) -> str:
    """A namespace to create or remove, checked before anything is sent:
    not a ``str``, ``TypeError``; empty, ``ValueError`` (``None`` and ``""``
    went out: ``EPROTO``, and a removal of ``""`` answered success)."""
    check_str(name, "a namespace's name")
    if not name:
        raise ValueError("a namespace's name must not be empty")
    return str(name)


def encode_value(value: Any) -> bytes:
    """The bytes :meth:`KVS.put` stores for ``value``.

    ``bytes``-like values as they are, ``str`` as UTF-8, anything else as
    compact JSON (``42`` -> ``b"42"``, ``{"a": 1}`` -> ``b'{"a":1}'``).
    ``TypeError`` for a value JSON cannot represent, NaN and infinities
    included (Python would write them as ``NaN``, which is not JSON), and
    one nested too deeply for ``json`` to write.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        try:
            return value.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as exc:  # (a lone surrogate no escape stands for)
            raise TypeError(f"cannot store a str value: {exc}") from None
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise TypeError(f"cannot store {_a(type(value).__name__)} value: {exc}") from None
    except RecursionError:
        raise TypeError(f"cannot store {_a(type(value).__name__)} value: "
                        f"{jsontoml.TOO_DEEP}") from None


def _a(noun: str) -> str:
    """``noun`` with its indefinite article (a type's name: ``an object``)."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _parse_json(key: str, data: bytes) -> Any:
    """``data`` parsed as JSON; ``ValueError`` naming ``key`` if it is not."""
    try:
        return jsontoml.loads_json(data)
    except json.JSONDecodeError as exc:
        raise json.JSONDecodeError(f"{key}: not JSON: {exc.msg}", exc.doc, exc.pos) \
            from None
    except UnicodeDecodeError as exc:
        raise UnicodeDecodeError(exc.encoding, exc.object, exc.start, exc.end,
                                 f"{key}: not JSON text: {exc.reason}") from None


def _decoded(key: str, data: bytes | None, decode: str) -> Any:
    """What :meth:`KVS.update` gives its function: None for a missing key,
    else ``data`` as ``get`` / ``get_str`` / ``get_json`` give it."""
    if data is None or decode == "bytes":
        return data
    if decode == "str":
        return data.decode("utf-8", "surrogateescape")
    return _parse_json(key, data)


def check_key(key: object) -> None:
    """``TypeError`` unless ``key`` is a str, ``UnicodeEncodeError`` (a
    ``ValueError``) if it is not UTF-8 text (API misuse, refused before any
    I/O: it failed as a payload msgpack could not pack)."""
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__}")
    if not key.isascii():
        try:
            key.encode()
        except UnicodeEncodeError as exc:  # (a ValueError; the CLI reports it as EINVAL)
            raise UnicodeEncodeError(
                exc.encoding, exc.object, exc.start, exc.end,
                "a lone surrogate (as os.fsdecode makes of bytes that are not UTF-8): "
                "a key must be UTF-8 text") from None


def _need_keys(what: str, keys: tuple[str, ...]) -> None:
    """``ValueError`` for a call given no key (before any I/O)."""
    if not keys:
        raise ValueError(f"{what} needs at least one key (none was given: nothing to do, "
                         "and an empty commit would still make a new version)")


def kind(obj: TreeObj) -> str:
    """What a directory entry is: ``"dir"``, ``"symlink"`` or ``"value"``."""
    t = obj["type"]
    if t in ("dir", "dirref"):
        return "dir"
    if t == "symlink":
        return "symlink"
    return "value"


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class CommitResult:
    """The root a commit produced: ``rootref`` (a blobref) at version
    ``rootseq`` of the namespace's life ``epoch`` (each creation of a name
    is a new one): ``wait_version(result)`` on another rank waits for this
    very namespace, never an older one of the same name."""

    rootref: str
    rootseq: int
    epoch: int | None = None
    namespace: str | None = None
    """The namespace the commit wrote (a version is a namespace's own)."""

    @property
    def treeobj(self) -> TreeObj:
        """The root as a ``dirref`` tree object (usable as ``at=``)."""
        return treeobj.dirref(self.rootref)


@dataclass(frozen=True, slots=True)
class Root:
    """A namespace's current root, as ``kvs.getroot`` / ``kvs.namespace-list`` describe it."""

    namespace: str
    owner: int
    rootseq: int
    rootref: str
    flags: int = 0

    @classmethod
    def from_payload(cls, p: Mapping[str, Any]) -> Root:
        return cls(str(p["namespace"]), int(p["owner"]), int(p["rootseq"]),
                   str(p["rootref"]), int(p.get("flags", 0)))

    @property
    def treeobj(self) -> TreeObj:
        """The root as a ``dirref`` tree object (usable as ``at=``)."""
        return treeobj.dirref(self.rootref)

    def as_dict(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "owner": self.owner, "rootseq": self.rootseq,
                "rootref": self.rootref, "flags": self.flags}


class Link(NamedTuple):
    """A symlink's target; ``str(link)`` is ``NS::target`` when it names a namespace."""

    target: str
    namespace: str | None = None

    def __str__(self) -> str:
        return f"{self.namespace}::{self.target}" if self.namespace else self.target

    @classmethod
    def from_treeobj(cls, obj: TreeObj) -> Link:
        """The link's namespace: its own, else the ``NS::`` its target
        starts with (the form ``kvs link NS::key L`` writes), as reads
        resolve it (docs/kvs.md)."""
        ns, target = treeobj.symlink_target(obj)
        if ns is None:
            ns, target = parse_ns_target(target)
        return cls(target, ns)


class HasRootref(Protocol):
    """Anything naming a root by its ``rootref`` (``kvs_watch.client.KeyChanges``)."""

    @property
    def rootref(self) -> str: ...


RootSpec = str | Mapping[str, Any] | CommitResult | Root | HasRootref
"""What ``at=`` accepts: a blobref, a ``dirref`` tree object (dict or JSON
text, e.g. the output of ``kvbroker kvs getroot`` or ``get -t``), or a
:class:`CommitResult` / :class:`Root` / anything with a ``rootref`` (a
watch's ``KeyChanges``)."""


def _pinned(payload: dict[str, Any], at: RootSpec | None) -> dict[str, Any]:
    """A lookup ``payload`` read at root ``at`` (None: the current root).
    A :class:`Root` knows its namespace, and the read is made as one of
    that namespace, whatever the KVS's: a link naming it is followed inside
    the root, as docs/kvs.md says, and a link naming the KVS's namespace is
    not (a root of ``ns1`` read through a ``primary`` KVS took ``ns1``'s
    links to ``primary`` for its own, and its own for a foreign one)."""
    if at is not None:
        payload["rootdir"] = as_root(at)
        if isinstance(at, Root):
            payload["namespace"] = at.namespace
    return payload


def as_root(at: RootSpec) -> TreeObj:
    """The ``dirref`` tree object named by ``at`` (``EINVAL`` if it is not one)."""
    if isinstance(at, str):
        text = at.strip()
        if text.isdigit():  # (a version: etcd's --rev, not a root)
            raise ErrnoError(errno.EINVAL, f"a root is a blobref or a dirref tree object, "
                                           f"not a version ({text}): getroot -b prints one")
        if not text.startswith("{"):
            return treeobj.dirref(text)  # a bare blobref (EINVAL if malformed)
        obj = treeobj.from_json(text)
    elif isinstance(at, Mapping):
        obj = _as_treeobj(at)
    else:  # a CommitResult, a Root, a watch's KeyChanges: anything with a rootref
        ref = getattr(at, "rootref", None)
        if not isinstance(ref, str):
            raise TypeError("a root is a blobref, a dirref tree object, or something with "
                            f"a rootref, not a {type(at).__name__}")
        return treeobj.dirref(ref)
    if obj["type"] != "dirref":
        raise ErrnoError(errno.EINVAL, f"a root must be a dirref tree object, not {obj['type']}")
    return obj


def _as_treeobj(obj: str | bytes | Mapping[str, Any]) -> TreeObj:
    """A validated tree object from JSON text, a JSON-style dict (base64 ``val``
    data, as ``get -t`` prints) or a native dict (``bytes`` ``val`` data, as
    :meth:`KVS.get_treeobj` returns)."""
    if isinstance(obj, str | bytes):
        return treeobj.from_json(obj)
    native = dict(obj)
    try:
        return treeobj.copy(treeobj.validate(native))
    except ErrnoError:
        return treeobj.from_json(native)


# ---------------------------------------------------------------- transactions


class TxnOps:
    """An ordered list of KVS operations, built without any I/O.

    Each method appends one op ``{key, flags, dirent}`` (the ``kvs.commit``
    wire form) and returns ``self``, so calls chain.  Ops apply in order,
    atomically, when the transaction is committed.
    """

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.ops)

    def __repr__(self) -> str:
        keys = ", ".join(repr(op["key"]) for op in self.ops[:3])
        more = ", ..." if len(self.ops) > 3 else ""
        return f"<{type(self).__name__} {len(self.ops)} ops [{keys}{more}]>"

    def _op(self, key: str, dirent: TreeObj | None, flags: int = 0,
            lease: LeaseSpec | None = None) -> TxnOps:
        check_key(key)
        # (the kvs module refuses the same, but only once the op is sent)
        check_limits(key, flags, dirent)
        op: dict[str, Any] = {"key": key, "flags": flags, "dirent": dirent}
        if lease is not None:
            op["lease"] = lease_id(lease)
        self.ops.append(op)
        return self

    def put(self, key: str, value: Any, *, lease: LeaseSpec | None = None) -> TxnOps:
        """Store ``value`` (bytes raw, str UTF-8, else JSON; see :func:`encode_value`).
        With ``lease`` (a :class:`Lease` or its id), the key is attached to
        that lease: it is unlinked when the lease expires or is revoked,
        unless a later write without the lease detached it first."""
        return self._op(key, treeobj.val(encode_value(value)), lease=lease)

    def put_raw(self, key: str, data: bytes | bytearray | memoryview, *,
                lease: LeaseSpec | None = None) -> TxnOps:
        """Store ``data`` exactly (``lease``: as for :meth:`put`)."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError("put_raw needs bytes")
        return self._op(key, treeobj.val(data), lease=lease)

    def put_treeobj(self, key: str, obj: str | bytes | Mapping[str, Any], *,
                    lease: LeaseSpec | None = None) -> TxnOps:
        """Store a tree object (JSON text or dict) as ``key``'s entry -- e.g. a
        ``dirref`` from :meth:`KVS.get_treeobj` makes ``key`` a snapshot of
        that directory.  Raises ``EINVAL`` for a malformed object.
        ``lease``: as for :meth:`put`."""
        return self._op(key, treeobj.validate(_as_treeobj(obj), dirent=True), lease=lease)

    def append(self, key: str, value: Any, *, lease: LeaseSpec | None = None) -> TxnOps:
        """Append ``value`` (encoded as by :meth:`put`) to ``key``'s value,
        creating it if missing.  As any write, an append without ``lease``
        detaches the key from its lease; with it, attaches it."""
        return self._op(key, treeobj.val(encode_value(value)), APPEND, lease)

    def append_event(self, key: str, name: str,
                     context: Mapping[str, Any] | str | None = None, *,
                     timestamp: float | None = None) -> TxnOps:
        """Append one RFC 18 event to eventlog ``key`` (created if missing),
        in this transaction: a job's jobspec and its ``submit`` event go in
        one commit, so no reader sees one without the other.  The line is
        :func:`kvs.eventlog.encode_entry` of :func:`kvs.eventlog.entry`, as
        :meth:`KVS.append_event` writes it (``timestamp`` None: now, taken
        here, when the op is added; ``context`` a mapping or JSON object
        text); a bad name or context raises ``EventlogError`` (``EINVAL``)
        at once."""
        line = eventlog.encode_entry(eventlog.entry(name, context, timestamp))
        return self._op(key, treeobj.val(line), APPEND)

    def expect(self, key: str, value: Any) -> TxnOps:
        """A condition, not a change: the whole transaction fails with
        ``ECANCELED`` (and changes nothing) unless ``key`` holds ``value``
        (encoded as by :meth:`put`) at this point of it -- compare-and-swap:
        ``t.expect("lock", "free").put("lock", "mine")``."""
        return self._op(key, treeobj.val(encode_value(value)), EXPECT)

    def expect_raw(self, key: str, data: bytes | bytearray | memoryview) -> TxnOps:
        """:meth:`expect` of exactly ``data``."""
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError("expect_raw needs bytes")
        return self._op(key, treeobj.val(data), EXPECT)

    def expect_missing(self, key: str) -> TxnOps:
        """A condition: ``key`` must not exist (create-if-absent, a lock)."""
        return self._op(key, None, EXPECT)

    def mkdir(self, key: str) -> TxnOps:
        """Make ``key`` an empty directory (replacing what was there)."""
        return self._op(key, treeobj.dir_())

    def unlink(self, key: str) -> TxnOps:
        """Remove ``key`` (and everything under it); a missing key is not an error."""
        return self._op(key, None)

    def symlink(self, key: str, target: str, namespace: str | None = None) -> TxnOps:
        """Make ``key`` a link to ``target`` (in namespace ``namespace`` if given)."""
        return self._op(key, treeobj.symlink(target, namespace))


def _check_all_sent(t: Txn | SyncTxn) -> None:
    """At the end of a ``with`` block whose transaction was committed in
    it: ops added after that commit were never sent (the block does not
    commit again, which would apply every op again): say so."""
    if len(t.ops) > t.committed_ops:
        raise RuntimeError(f"{len(t.ops) - t.committed_ops} op(s) added after the "
                           "transaction was committed were not sent: commit() again "
                           "(it sends every op) or use a new transaction")


class Txn(TxnOps):
    """A transaction bound to a :class:`KVS` (from :meth:`KVS.txn`).

    ``await t.commit()`` sends it; as an async context manager it commits on
    a clean exit and sends nothing if the block raises.  ``result`` holds the
    :class:`CommitResult` once committed.  ``commit()`` again sends every op
    again, as Flux's; a block that ends with ops added after its commit
    raises ``RuntimeError`` rather than leave them unsent.
    """

    def __init__(self, kvs: KVS, flags: int = 0) -> None:
        super().__init__()
        self.kvs = kvs
        self.flags = flags
        self.result: CommitResult | None = None
        self.tried = False
        """:meth:`commit` was called (and maybe failed: ``result`` is then None)."""
        self.committed_ops = 0
        """How many of ``ops`` the last commit sent."""

    async def commit(self, flags: int | None = None) -> CommitResult:
        """Commit the ops (``flags``: :data:`SYNC`, :data:`NO_MERGE`; default
        the ones given to :meth:`KVS.txn`)."""
        self.tried = True  # (failed or not: a block's exit does not send it again)
        self.committed_ops = len(self.ops)
        self.result = await self.kvs.commit(self, self.flags if flags is None else flags)
        return self.result

    async def __aenter__(self) -> Txn:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            if not self.tried:
                await self.commit()
            else:
                _check_all_sent(self)


# ---------------------------------------------------------------- directories


class Dir(Mapping[str, TreeObj]):
    """A read-only snapshot of one directory: entry name -> stored tree object.

    Iterates names in sorted order.  Entries are as stored (``val``,
    ``valref``, ``dirref``, ``symlink``): use :meth:`kind`, :meth:`is_dir`,
    :meth:`is_symlink`, :meth:`link`.  :meth:`read` and :meth:`subdir` look
    further *at the same root* the directory was read from, so a recursive
    walk sees one consistent version even while others commit.
    """

    def __init__(self, kvs: KVS, key: str, entries: Mapping[str, TreeObj],
                 rootref: str) -> None:
        self.kvs = kvs
        self.key = normalize(key)
        self.rootref = rootref
        self._entries = dict(entries)
        self._names = sorted(self._entries)

    def __getitem__(self, name: str) -> TreeObj:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"<Dir {self.key!r} {len(self)} entries at {self.rootref}>"

    def kind(self, name: str) -> str:
        """``"dir"``, ``"symlink"`` or ``"value"``."""
        return kind(self._entries[name])

    def is_dir(self, name: str) -> bool:
        return self.kind(name) == "dir"

    def is_symlink(self, name: str) -> bool:
        return self.kind(name) == "symlink"

    def path(self, name: str) -> str:
        """The full key of entry ``name`` (``name`` itself in the root directory)."""
        return join([*split(self.key), name])

    def link(self, name: str) -> Link:
        """The target of symlink entry ``name`` (``EINVAL`` if it is not one)."""
        obj = self._entries[name]
        if obj["type"] != "symlink":
            raise ErrnoError(errno.EINVAL, f"{self.path(name)}: not a symlink")
        return Link.from_treeobj(obj)

    async def read(self, name: str) -> bytes:
        """The value of entry ``name`` (a link is followed)."""
        obj = self._entries[name]
        if obj["type"] == "val":
            return bytes(obj["data"])
        data: bytes = (await self.kvs.lookup(self.path(name), 0, at=self.rootref))["data"]
        return data

    async def subdir(self, name: str) -> Dir:
        """Directory entry ``name`` (a link is followed), at the same root."""
        val = await self.kvs.lookup(self.path(name), READDIR, at=self.rootref)
        return Dir(self.kvs, self.path(name), val["data"], self.rootref)

    async def walk(self, *, empty_dirs: bool = False) -> AsyncIterator[tuple[str, TreeObj]]:
        """Every non-directory entry below this one, depth first in name
        order, as ``(key, entry)``; with ``empty_dirs``, empty directories
        too (their entry is a ``dirref``).  (A stack, not recursion: a tree
        may be deeper than Python's recursion limit.)"""
        stack = [(self, iter(self))]
        while stack:
            d, names = stack[-1]
            name = next(names, None)
            if name is None:
                stack.pop()
            elif d.is_dir(name):
                sub = await d.subdir(name)
                if empty_dirs and not len(sub):
                    yield sub.key, d._entries[name]
                stack.append((sub, iter(sub)))
            else:
                yield d.path(name), d._entries[name]


async def pin_dir(kvs: KVS, key: str, at: RootSpec | None) -> Dir:
    """Directory ``key``, to be read at one version (:meth:`KVS.get_tree`,
    ``kvbroker kvs dump``).  The instance owner reads it at its own tree
    (its ``dirref``, a link to it followed, into any namespace), so every
    later read is of that tree -- at the namespace's root instead, a read
    below a link into another namespace would find that namespace as it is
    then.  A guest, who may read only at its namespaces' roots, reads at the
    root of its namespace."""
    top = await kvs.dir(key, at=at)  # (its errors name the key: ENOENT, ENOTDIR, EPERM)
    space, obj = kvs, await kvs.get_treeobj(key, at=at)
    if isinstance(at, Root) and at.namespace != kvs.namespace:
        # (a Root is read in its own namespace: a link there into another
        # was taken to be in the KVS's, and read at the Root's tree)
        space = kvs.with_namespace(at.namespace)
    for _ in range(SYMLINK_MAX):
        if obj["type"] != "symlink":
            break
        ns, target = treeobj.symlink_target(obj)
        if ns is None:
            ns, target = parse_ns_target(target)
        if ns is not None and ns != space.namespace:
            space, at = space.with_namespace(ns), None
        obj = await space.get_treeobj(target, at=at)
    if obj["type"] != "dirref":
        return top
    try:
        return await space.dir(".", at=obj)
    except RemoteError as exc:
        if exc.errnum == errno.EPERM:
            return top
        raise


async def read_tree(top: Dir, window: int = READ_WINDOW
                    ) -> AsyncGenerator[tuple[str, TreeObj, bytes | None], None]:
    """Every entry below ``top``, depth first in name order, as ``(key
    relative to top, stored entry, value)``: the value's bytes for a value,
    None for a symlink (not followed) or an empty directory.  Everything is
    read at ``top``'s root, with up to ``window`` value reads in flight;
    closing the generator (``aclosing``) cancels those still running.  What
    :meth:`KVS.get_tree` and ``kvbroker kvs dump`` read a subtree with."""
    base = len(split(top.key))
    pending: deque[tuple[str, TreeObj, asyncio.Future[bytes] | None]] = deque()

    async def settled(item: tuple[str, TreeObj, asyncio.Future[bytes] | None]
                      ) -> tuple[str, TreeObj, bytes | None]:
        k, obj, read = item
        if read is not None:
            return k, obj, await read
        return k, obj, bytes(obj["data"]) if obj["type"] == "val" else None

    try:
        async for k, entry in top.walk(empty_dirs=True):
            read: asyncio.Future[bytes] | None = None
            if entry["type"] == "valref":
                read = asyncio.ensure_future(top.kvs.get(k, at=top.rootref))
            pending.append((join(split(k)[base:]), entry, read))
            while len(pending) > window or (pending and pending[0][2] is None):
                yield await settled(pending.popleft())
        while pending:
            yield await settled(pending.popleft())
    finally:
        for _, _, read in pending:
            if read is None:
                continue
            if read.done() and not read.cancelled():
                read.exception()  # (retrieved: the error that stopped us is another)
            read.cancel()


# ---------------------------------------------------------------- the client


class KVS:
    """The key-value store seen through a :class:`~broker.handle.Handle`."""

    def __init__(self, handle: Handle, namespace: str | None = None) -> None:
        self.handle = handle
        self.namespace = default_namespace(namespace)
        self._owns_handle = False

    @classmethod
    def connect(cls, uri: str | None = None, namespace: str | None = None, *,
                reconnect: bool = False) -> Connecting[Self]:
        """Attach to a rank (default ``$KVBROKER_URI``); :meth:`close` detaches.
        ``kvs = await KVS.connect()``, or ``async with KVS.connect() as kvs:``.
        ``reconnect``: as :meth:`broker.handle.Handle.connect`'s."""
        default_namespace(namespace)  # (a bad one refused before connecting)
        return Connecting(functools.partial(cls._connect, uri, namespace, reconnect))

    @classmethod
    async def _connect(cls, uri: str | None, namespace: str | None, reconnect: bool) -> Self:
        from broker.handle import Handle

        self = cls(await Handle.connect(uri, reconnect=reconnect), namespace)
        self._owns_handle = True
        return self

    async def close(self) -> None:
        """Close the handle if :meth:`connect` opened it."""
        if self._owns_handle:
            await self.handle.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def with_namespace(self, namespace: str | None) -> KVS:
        """A :class:`KVS` on the same handle working in ``namespace``."""
        return KVS(self.handle, namespace)

    def __repr__(self) -> str:
        return f"<KVS {self.namespace!r} on {getattr(self.handle, 'uri', '?')}>"

    # ------------------------------------------------------------ reads

    async def lookup(self, key: str, flags: int = 0, *, at: RootSpec | None = None) -> TreeObj:
        """``kvs.lookup``: the result tree object for ``key`` with lookup ``flags``
        (:data:`READDIR`, :data:`READLINK`, :data:`TREEOBJ`), at the current
        root or at root ``at``.  Raises ``ENOENT`` if there is no such key."""
        check_key(key)
        payload = _pinned({"key": key, "flags": flags, "namespace": self.namespace}, at)
        resp = await self.handle.rpc("kvs.lookup", payload)
        found: TreeObj = resp["val"]
        return found

    async def lookup_at(self, at: RootSpec, key: str, flags: int = 0) -> TreeObj:
        """:meth:`lookup` at an older (or foreign) root ``at``."""
        return await self.lookup(key, flags, at=at)

    async def _get_or_none(self, key: str, at: RootSpec | None) -> bytes | None:
        """The value of ``key``, or None if there is no such key: one
        ``kvs.lookup-plus``, which answers a missing key as data, so "missing"
        is never confused with another ``ENOENT`` (a collected root's, which
        is raised) and needs no second, racy :meth:`exists` call."""
        check_key(key)
        payload = _pinned({"key": key, "flags": 0, "namespace": self.namespace}, at)
        val = (await self.handle.rpc("kvs.lookup-plus", payload)).get("val")
        return None if val is None else bytes(val["data"])

    @overload
    async def get(self, key: str, *, at: RootSpec | None = None) -> bytes: ...

    @overload
    async def get(self, key: str, default: T, *, at: RootSpec | None = None) -> bytes | T: ...

    async def get(self, key: str, default: Any = _NO_DEFAULT, *,
                  at: RootSpec | None = None) -> Any:
        """The value of ``key`` (``EISDIR`` for a directory, ``ENOENT`` if
        missing; with ``default``, that instead of ``ENOENT``, as
        ``dict.get``: a missing key is the common case of a config read)."""
        if default is not _NO_DEFAULT:
            data = await self._get_or_none(key, at)
            return default if data is None else data
        return bytes((await self.lookup(key, 0, at=at))["data"])

    @overload
    async def get_str(self, key: str, *, at: RootSpec | None = None) -> str: ...

    @overload
    async def get_str(self, key: str, default: T, *,
                      at: RootSpec | None = None) -> str | T: ...

    async def get_str(self, key: str, default: Any = _NO_DEFAULT, *,
                      at: RootSpec | None = None) -> Any:
        """The value of ``key`` decoded as UTF-8 (``default`` if missing, when
        given); bytes that are not UTF-8 come
        back as surrogate escapes, as :meth:`put` stores such a ``str``, so
        ``put(k, s)`` then ``get_str(k)`` gives ``s`` back for any ``s``."""
        data = await self.get(key, default if default is _NO_DEFAULT else _MISSING_VALUE, at=at)
        if data is _MISSING_VALUE:  # (not `is default`: b"" and b"x" are shared
            return default          # objects, and a stored one read as missing)
        return data.decode("utf-8", "surrogateescape")

    async def get_json(self, key: str, default: Any = _NO_DEFAULT, *,
                       at: RootSpec | None = None) -> Any:
        """The value of ``key`` parsed as JSON (``default``, not parsed, if
        missing, when given; ``ValueError`` naming the key if
        it is not JSON: ``json.JSONDecodeError``, or ``UnicodeDecodeError``
        for bytes that are not text)."""
        data = await self.get(key, default if default is _NO_DEFAULT else _MISSING_VALUE, at=at)
        if data is _MISSING_VALUE:  # (as get_str's)
            return default
        return _parse_json(key, data)

    async def get_treeobj(self, key: str, *, at: RootSpec | None = None) -> TreeObj:
        """The stored tree object of ``key``, links not followed (``"."`` gives
        the root's ``dirref``).  Render it with :func:`kvs.treeobj.to_json`."""
        return await self.lookup(key, TREEOBJ, at=at)

    async def readlink(self, key: str, *, at: RootSpec | None = None) -> Link:
        """The target of symlink ``key`` (``EINVAL`` if it is not a symlink)."""
        return Link.from_treeobj(await self.lookup(key, READLINK, at=at))

    @overload
    def watch(self, key: str, *, initial_sentinel: Literal[False] = False,
              **options: Unpack[WatchOptions]) -> Watch[WatchEntry]: ...

    @overload
    def watch(self, key: str, *, initial_sentinel: bool,
              **options: Unpack[WatchOptions]) -> Watch[WatchEntry | InitialDone]: ...

    def watch(self, key: str, *, initial_sentinel: bool = False,
              **options: Unpack[WatchOptions]) -> Watch[Any]:
        """:func:`kvs_watch.client.watch` of ``key`` in this namespace: its
        value, then one entry per commit naming it (``async for``).  The
        options are :func:`~kvs_watch.client.watch`'s (``waitcreate``,
        ``uniq``, ``append``, ``full``, ``nodeid``, ``max_backlog`` ...)."""
        from kvs_watch.client import watch

        return watch(self.handle, key, namespace=self.namespace,
                     initial_sentinel=initial_sentinel, **options)

    def watch_keys(self, key: str = ".", *, waitcreate: bool = False,
                   since: RootSpec | None = None, nodeid: int | None = None,
                   max_backlog: int | None = None) -> KeyWatch:
        """:func:`kvs_watch.client.watch_keys` below ``key`` in this namespace:
        the keys each commit writes there (``async for``); with ``since`` (a
        root as ``at=`` takes it, or the last ``KeyChanges`` seen), the first
        answer holds the keys changed since that root.  Given something
        with its version too (a ``KeyChanges``, ``CommitResult`` or
        ``Root``), the watch starts no earlier than that version.
        ``max_backlog``: as :meth:`watch`'s."""
        from kvs_watch.client import watch_keys

        extra = {} if nodeid is None else {"nodeid": nodeid}
        old = as_root(since)["data"][0] if since is not None else None
        version = getattr(since, "rootseq", None)  # (a KeyChanges, CommitResult or Root)
        return watch_keys(self.handle, key, namespace=self.namespace, waitcreate=waitcreate,
                          since=old, since_version=version if isinstance(version, int)
                          and version >= 0 else None, max_backlog=max_backlog, **extra)

    def watch_eventlog(self, key: str, *, waitcreate: bool = False,
                       nodeid: int | None = None) -> EventlogWatch:
        """:func:`kvs_watch.client.watch_eventlog` of ``key`` in this namespace."""
        from kvs_watch.client import watch_eventlog

        extra = {} if nodeid is None else {"nodeid": nodeid}
        return watch_eventlog(self.handle, key, namespace=self.namespace,
                              waitcreate=waitcreate, **extra)

    # Eventlogs as methods, next to watch_eventlog, so that a job's workflow
    # (append events, wait for one, read the log) is written on the KVS of
    # the job's namespace, and SyncKVS has it too, without the module
    # functions of kvs.eventlog and kvs_watch.client taking kvs.aio or a
    # handle and a namespace again.

    async def append_event(self, key: str, name: str,
                           context: Mapping[str, Any] | str | None = None, *,
                           timestamp: float | None = None, sync: bool = False) -> CommitResult:
        """Append one RFC 18 event to eventlog ``key`` (created if missing):
        :func:`kvs.eventlog.append` in this namespace (``timestamp`` None:
        now; ``context`` a mapping or JSON object text)."""
        from kvs import eventlog

        return await eventlog.append(self, key, name, context, timestamp=timestamp,
                                     flags=SYNC if sync else 0)

    async def get_eventlog(self, key: str) -> list[EventlogEntry]:
        """The entries of eventlog ``key`` (``ENOENT`` if missing,
        :class:`kvs.eventlog.EventlogError` if the value is not one)."""
        from kvs import eventlog

        return await eventlog.get(self, key)

    async def wait_event(self, key: str, name: str, *, waitcreate: bool = False,
                         timeout: float | None = None,
                         nodeid: int | None = None) -> EventlogEntry:
        """The first entry of eventlog ``key`` named ``name``, waiting for it:
        :func:`kvs_watch.client.wait_event` in this namespace (``TimeoutError``
        after ``timeout`` seconds; ``waitcreate``: wait for the log, and the
        namespace, to exist)."""
        from kvs_watch.client import wait_event

        extra = {} if nodeid is None else {"nodeid": nodeid}
        return await wait_event(self.handle, key, name, namespace=self.namespace,
                                waitcreate=waitcreate, timeout=timeout, **extra)

    async def dir(self, key: str = ".", *, at: RootSpec | None = None) -> Dir:
        """Directory ``key`` as a :class:`Dir` snapshot (``ENOTDIR`` for a value)."""
        check_key(key)
        payload = _pinned({"key": key, "flags": READDIR, "namespace": self.namespace}, at)
        resp = await self.handle.rpc("kvs.lookup-plus", payload)
        if resp.get("val") is None:
            raise RemoteError(errno.ENOENT, f"{key}: no such key")
        space = self if payload["namespace"] == self.namespace else \
            self.with_namespace(payload["namespace"])  # (its reads are of that root)
        return Dir(space, key, resp["val"]["data"], resp["rootref"])

    async def get_tree(self, key: str = ".", *, at: RootSpec | None = None,
                       limit: int | None = TREE_LIMIT) -> dict[str, bytes]:
        """Every value below directory ``key``, by its dotted path relative
        to ``key`` (``{"b.c": b"1"}`` for ``a.b.c`` below ``a``; full keys
        for ``"."``), in depth-first name order -- etcd's ``get --prefix``.

        One version: the directory's tree is taken first (at ``at``, else
        the current root) and everything is read in it, so a commit meanwhile
        cannot mix versions; up to :data:`READ_WINDOW` values are read at a
        time.  Symlinks below ``key`` are not followed and not returned (a
        link may lead out of the tree, into another namespace, or round in
        a loop; :meth:`Dir.walk` lists them), nor are empty directories
        (no value); ``key`` itself may be a link to a directory.  ``ENOENT``
        if ``key`` is missing, ``ENOTDIR`` if it is a value.  Past ``limit``
        values (default :data:`TREE_LIMIT`; None: no limit) it raises
        ``ErrnoError(EOVERFLOW)`` rather than hold a tree of any size in
        memory."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be at least 0 (got {limit})")
        top = await pin_dir(self, key, at)
        tree: dict[str, bytes] = {}
        async with aclosing(read_tree(top)) as entries:  # (stops the reads on error)
            async for k, _, value in entries:
                if value is None:
                    continue  # a symlink or an empty directory
                if limit is not None and len(tree) >= limit:
                    raise ErrnoError(errno.EOVERFLOW, (
                        f"{key}: more than {limit} values below it: give get_tree a "
                        "higher limit (None: no limit), or read it a part at a time "
                        "(dir(), Dir.walk())"))
                tree[k] = value
        return tree

    async def exists(self, key: str, *, at: RootSpec | None = None) -> bool:
        """Whether ``key`` names anything (a link counts, even a dangling one),
        now or at root ``at``.  Asked with ``kvs.lookup-plus``, which answers
        a missing key as data: its ``ENOENT`` (a root whose blobs are gone,
        collected by ``kvs gc``) is raised, not taken for "no"."""
        check_key(key)
        payload = _pinned({"key": key, "flags": TREEOBJ, "namespace": self.namespace}, at)
        resp = await self.handle.rpc("kvs.lookup-plus", payload)
        return resp.get("val") is not None

    # ------------------------------------------------------------ writes

    def txn(self, flags: int = 0) -> Txn:
        """A new transaction in this namespace (see :class:`Txn`)."""
        return Txn(self, flags)

    async def commit(self, ops: TxnOps | Iterable[dict[str, Any]], flags: int = 0) -> CommitResult:
        """``kvs.commit``: apply ``ops`` atomically; returns the new root.

        ``flags``: :data:`SYNC` (durable before the answer), :data:`NO_MERGE`
        (never merged with other transactions).
        """
        op_list = ops.ops if isinstance(ops, TxnOps) else list(ops)
        resp = await self.handle.rpc("kvs.commit", {
            "namespace": self.namespace, "flags": flags, "ops": op_list})
        epoch = resp.get("epoch")
        return CommitResult(resp["rootref"], int(resp["rootseq"]),
                            epoch if type(epoch) is int else None, self.namespace)

    async def put(self, key: str, value: Any, *, sync: bool = False,
                  lease: LeaseSpec | None = None) -> CommitResult:
        """Store ``value`` under ``key`` (bytes raw, str UTF-8, else JSON),
        attached to ``lease`` if given (see :meth:`TxnOps.put`)."""
        return await self.commit(TxnOps().put(key, value, lease=lease), SYNC if sync else 0)

    async def put_treeobj(self, key: str, obj: str | bytes | Mapping[str, Any], *,
                          sync: bool = False) -> CommitResult:
        """Store a tree object as ``key``'s entry (see :meth:`TxnOps.put_treeobj`)."""
        return await self.commit(TxnOps().put_treeobj(key, obj), SYNC if sync else 0)

    async def append(self, key: str, value: Any, *, sync: bool = False) -> CommitResult:
        """Append ``value`` to ``key``'s value (created if missing)."""
        return await self.commit(TxnOps().append(key, value), SYNC if sync else 0)

    async def mkdir(self, *keys: str) -> CommitResult:
        """Make each key an empty directory, in one transaction.  No key is a
        ``ValueError`` (as ``kvbroker kvs mkdir``'s usage error): an empty
        transaction would still make a new version."""
        _need_keys("mkdir", keys)
        t = TxnOps()
        for key in keys:
            t.mkdir(key)
        return await self.commit(t)

    async def symlink(self, key: str, target: str, namespace: str | None = None) -> CommitResult:
        """Make ``key`` a link to ``target`` (in namespace ``namespace`` if given)."""
        return await self.commit(TxnOps().symlink(key, target, namespace))

    async def unlinkable(self, key: str, *, recursive: bool = False, force: bool = False) -> bool:
        """The checks of ``unlink`` (as ``flux kvs unlink``): ``False`` if ``key``
        is missing and ``force``; raises ``ENOENT`` if missing, ``ENOTEMPTY``
        for a non-empty directory unless ``recursive``, ``EINVAL`` for the
        root (``.``)."""
        check_key(key)
        if not split(key):
            raise ErrnoError(errno.EINVAL, "cannot unlink the root directory")
        try:
            obj = await self.lookup(key, TREEOBJ)
        except RemoteError as exc:
            if exc.errnum == errno.ENOENT and force:
                return False
            raise
        if not recursive and kind(obj) == "dir":
            entries = obj["data"] if obj["type"] == "dir" else \
                (await self.lookup(key, READDIR))["data"]
            if entries:
                raise RemoteError(errno.ENOTEMPTY, f"{key}: directory not empty")
        return True

    async def unlink(self, *keys: str, recursive: bool = False,
                     force: bool = False) -> CommitResult:
        """Remove keys in one transaction.

        Like ``flux kvs unlink``: a missing key is ``ENOENT`` unless ``force``;
        a non-empty directory is ``ENOTEMPTY`` unless ``recursive``; the root
        (``.``) is ``EINVAL``.  No key is a ``ValueError`` (as ``kvbroker
        kvs unlink``'s usage error, and Flux's): an empty transaction would
        still make a new version.  Use
        :meth:`TxnOps.unlink` for the unchecked operation.
        """
        _need_keys("unlink", keys)
        t = TxnOps()
        for key in keys:
            if await self.unlinkable(key, recursive=recursive, force=force):
                t.unlink(key)
        return await self.commit(t)

    async def copy(self, src: str, dst: str, *, src_namespace: str | None = None,
                   dst_namespace: str | None = None) -> CommitResult:
        """Make ``dst`` a copy of ``src`` (links not followed; a directory is
        copied by reference, writing O(1)).  Namespaces default to this one.

        ``dst`` may lie inside ``src``: it gets a snapshot of ``src`` as it
        was (the copy holds a reference to ``src``'s old tree, so nothing
        recurses and nothing is lost)."""
        s, d = self._src(src_namespace), self._src(dst_namespace)  # (both checked first)
        obj = await s.lookup(src, TREEOBJ)
        return await d.commit(TxnOps().put_treeobj(dst, obj))

    async def move(self, src: str, dst: str, *, src_namespace: str | None = None,
                   dst_namespace: str | None = None) -> CommitResult:
        """Copy ``src`` to ``dst``, then unlink ``src``.  Within one namespace
        both happen in a single transaction.

        Within one namespace, ``dst`` equal to ``src`` or inside it
        (``move a a.sub``) is ``EINVAL``, as ``mv`` refuses: the unlink would
        take the copy with it.  ``dst`` may be an ancestor of ``src``
        (``move a.sub a``: ``a`` becomes what ``a.sub`` was)."""
        check_key(src)
        check_key(dst)
        s, d = self._src(src_namespace), self._src(dst_namespace)
        if s.namespace == d.namespace:
            sp, dp = split(src), split(dst)
            if sp == dp:
                raise ErrnoError(errno.EINVAL, f"{src}: source and destination are the same")
            if dp[:len(sp)] == sp:  # (the root, [], is everyone's ancestor)
                raise ErrnoError(errno.EINVAL, f"cannot move '{src}' to a subdirectory "
                                               f"of itself, '{dst}'")
        obj = await s.lookup(src, TREEOBJ)
        if s.namespace == d.namespace:
            # unlink first: if dst is an ancestor of src, src's old place is
            # inside what the put replaces, and an unlink after the put would
            # remove the part of the new dst that has src's relative path;
            # a link in dst's path leading into src's old place stays harmless
            return await s.commit(TxnOps().unlink(src).put_treeobj(dst, obj))
        await d.commit(TxnOps().put_treeobj(dst, obj))
        return await s.commit(TxnOps().unlink(src))

    async def update(self, key: str, fn: Callable[[Any], Any], *,
                     decode: Literal["bytes", "str", "json"] = "bytes",
                     retries: int = UPDATE_RETRIES, sync: bool = False,
                     lease: LeaseSpec | None = None) -> Updated:
        """Read-modify-write ``key`` with no lost update (compare-and-swap,
        retried: etcd's STM, Redis ``WATCH``/``MULTI``).

        ``fn`` gets the current value -- None if the key is missing, else
        its bytes, or with ``decode="str"`` / ``"json"`` what
        :meth:`get_str` / :meth:`get_json` return -- and returns the new
        value, stored as :meth:`put` stores it (bytes raw, str UTF-8, else
        JSON), or :data:`DELETE` to remove the key.  ``fn`` may be a
        coroutine function.  The new value is committed on the condition
        that the key still holds the bytes read (or is still missing); if
        another writer changed it meanwhile (``ECANCELED``), the key is
        read again, after a random wait (:data:`UPDATE_BACKOFF`), and ``fn``
        called again, up to ``retries`` more times, then that ``ECANCELED``
        is raised.  So ``fn`` may run several
        times: keep it free of side effects.

        Nothing is committed (no new version, no ``lease`` attached) when
        the new value's bytes are the stored ones, or the key is missing
        and ``fn`` returns None or :data:`DELETE`.  Returns
        :class:`Updated`: ``(value, result, tries)``, ``result`` the
        :class:`CommitResult` (None if nothing was committed).

        ``key`` must be a value or missing: a directory is ``EISDIR``, a
        symlink ``EINVAL`` (the condition would never hold: update its
        target).  ``sync`` and ``lease`` are :meth:`put`'s."""
        check_key(key)
        if decode not in ("bytes", "str", "json"):
            raise ValueError(f"decode must be 'bytes', 'str' or 'json', not {decode!r}")
        if type(retries) is not int or retries < 0:
            raise ValueError(f"retries must be an int of at least 0 (got {retries!r})")
        flags = SYNC if sync else 0
        tries = 0
        failed: list[bytes | None] = []  # the state whose condition failed last
        while True:
            tries += 1
            old = await self._get_or_none(key, None)
            if failed and old == failed[0]:
                # Read again after a conflict, and the same state: this rank
                # may be behind rank 0 (or the key changed and changed back).
                # A follower learns a conflict from the namespace's error
                # event, which rank 0 publishes after the setroots before it,
                # so its reads already see the value the condition met; this
                # catch-up keeps the loop from spinning on a stale read
                # should that order ever not hold, at no cost otherwise.
                await self.wait_version(await self._leader_version())
                # (missing_ok: another writer may have removed it since --
                # an ENOENT escaped update(), where it reads as missing)
                await self._check_not_symlink(key, missing_ok=True)
                old = await self._get_or_none(key, None)
            new = fn(_decoded(key, old, decode))
            if inspect.isawaitable(new):
                new = await new
            ops = TxnOps()
            if old is None:
                if new is None or new is DELETE:
                    await self._check_not_symlink(key, missing_ok=True)
                    return Updated(None, None, tries)
                ops.expect_missing(key)
            else:
                ops.expect_raw(key, old)
            if new is DELETE:
                ops.unlink(key)
            else:
                data = encode_value(new)
                if data == old:  # (nothing to commit: checked as a commit would be)
                    await self._check_not_symlink(key, missing_ok=True)
                    return Updated(new, None, tries)
                ops.put_raw(key, data, lease=lease)
            try:
                result = await self.commit(ops, flags)
            except RemoteError as exc:
                if exc.errnum != errno.ECANCELED:
                    raise
                # (a symlink's condition never holds: EINVAL whatever the
                # retries -- with none, or its target changing at each
                # try, it was ECANCELED)
                await self._check_not_symlink(key, missing_ok=True)
                if tries > retries:
                    raise
                failed[:] = [old]
                await asyncio.sleep(random.uniform(
                    0, min(UPDATE_BACKOFF_MAX, UPDATE_BACKOFF * 2 ** min(tries - 1, 16))))
                continue
            return Updated(None if new is DELETE else new, result, tries)

    async def _leader_version(self) -> int:
        """This namespace's current version on rank 0."""
        resp = await self.handle.rpc("kvs.getroot", {"namespace": self.namespace}, nodeid=0)
        return int(resp["rootseq"])

    async def _check_not_symlink(self, key: str, missing_ok: bool = False) -> None:
        """``EINVAL`` if ``key`` is a symlink: :meth:`update` reads through
        it, but a condition on it never holds -- and where nothing was to be
        committed, the link's target answered as if it were the key."""
        try:
            entry = await self.lookup(key, TREEOBJ)
        except ErrnoError as exc:
            if missing_ok and exc.errnum == errno.ENOENT:
                return
            raise
        if entry["type"] == "symlink":
            raise ErrnoError(errno.EINVAL, f"{key}: a symlink: update its target instead "
                                           "(a condition on a link never holds)")

    def _src(self, namespace: str | None) -> KVS:
        return self if namespace is None else self.with_namespace(namespace)

    # ------------------------------------------------------------ versions and roots

    @overload
    async def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
                   limit: int | None = None, status: Literal[False] = False) -> list[str]: ...

    @overload
    async def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
                   limit: int | None = None, status: Literal[True]) -> dict[str, Change]: ...

    @overload
    async def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
                   limit: int | None = None,
                   status: bool) -> list[str] | dict[str, Change]: ...

    async def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
                   limit: int | None = None, status: bool = False) -> Any:
        """The keys at or below ``key`` whose entries differ between roots
        ``old`` and ``new`` of this namespace (default: its current root on
        this rank), sorted: values, symlinks and empty directories that came,
        went or changed, every key below a directory that came or went.
        With ``status=True``, a dict (in key order) of each key to how it
        changed, as ``git diff --name-status`` says: ``"added"`` (only
        ``new`` has it), ``"removed"`` (only ``old``) or ``"changed"``
        (both, differing); a directory with entries is not a key, its keys
        are (:mod:`kvs.diff`, docs/kvs.md).

        Comparing two versions visits only what changed between them (the
        tree is content-addressed), so a watcher that lost its connection
        catches up by diffing the ``rootref`` of the last change it saw with
        the root its new watch starts at (docs/kvs.md).  ``EOVERFLOW`` past
        ``limit`` keys (default 100,000); a guest gives roots its namespace
        had recently, else ``EPERM``."""
        check_key(key)
        payload: dict[str, Any] = {"namespace": self.namespace, "key": key,
                                   "old": as_root(old)["data"][0]}
        if new is not None:
            payload["new"] = as_root(new)["data"][0]
        if limit is not None:
            payload["limit"] = limit
        answer = await self.handle.rpc("kvs.diff", payload)
        if status:
            return dict(zip(answer["keys"], answer["changes"], strict=True))
        return list(answer["keys"])

    async def getroot(self) -> Root:
        """``kvs.getroot``: this namespace's current root, version and owner."""
        return Root.from_payload(await self.handle.rpc(
            "kvs.getroot", {"namespace": self.namespace}))

    async def version(self) -> int:
        """The namespace's current version (``rootseq``) on this rank."""
        return (await self.getroot()).rootseq

    async def wait_create(self, key: str, timeout: float | None = None, *,
                          nodeid: int | None = None) -> WatchEntry:
        """The value of ``key`` once it exists (at once if it does):
        :func:`kvs_watch.client.wait_create` in this namespace, which waits
        for the namespace too.  With ``timeout`` (seconds) it gives up after
        that long, cancelling the watch, and raises ``TimeoutError`` naming
        the key and the namespace (as :func:`kvs_watch.client.wait_event`
        does: a bare ``TimeoutError()`` says nothing in a traceback).
        ``nodeid``: the rank whose kvs-watch waits (default: this one), as
        for :meth:`wait_event`."""
        from kvs_watch.client import wait_create

        check_key(key)
        timeout = check_timeout(timeout)
        try:
            async with asyncio.timeout(timeout) as bound:
                return await wait_create(self.handle, key, namespace=self.namespace,
                                         nodeid=NODEID_ANY if nodeid is None else nodeid)
        except TimeoutError:
            if timeout is None or not bound.expired():
                raise  # (not this timeout's)
            raise TimeoutError(f"{key}: not created within {timeout:g} s "
                               f"(namespace {self.namespace})") from None

    async def wait_version(self, version: int | CommitResult, timeout: float | None = None,
                           *, epoch: int | None = None) -> int:
        """Return once this rank has reached ``version``; returns the version
        it is at (``ENOTSUP`` if the namespace is removed meanwhile).  Given
        a :class:`CommitResult` (or an ``epoch``), the version of that very
        namespace: a rank that still holds an older one of the same name
        (removed and created again, the removal not heard here yet) waits
        for the new one, where a bare number may be answered at once by the
        old one; a namespace of the name created again since is
        ``ENOTSUP``.  With
        ``timeout`` (seconds) the rank gives up after that long, forgetting
        the wait, and this raises ``TimeoutError`` saying why; a rank that
        does not answer at all (stopped) is given up on
        :data:`WAIT_GRACE` seconds later, so the timeout always holds."""
        timeout = check_timeout(timeout)
        if isinstance(version, CommitResult):
            if version.namespace not in (None, self.namespace):
                raise ValueError(f"a commit's result in namespace {version.namespace}, not "
                                 f"{self.namespace}: wait on a KVS of its namespace")
            epoch = version.epoch if epoch is None else epoch
            version = version.rootseq
        if epoch is not None and type(epoch) is not int:
            raise TypeError(f"epoch must be an int (a CommitResult's), not {epoch!r}")
        payload: dict[str, Any] = {"namespace": self.namespace, "rootseq": int(version)}
        if epoch is not None:
            payload["epoch"] = epoch
        if timeout is not None:
            payload["timeout"] = timeout
        waiting = self.handle.rpc("kvs.wait-version", payload)
        try:
            if timeout is None:
                resp = await waiting
            else:
                resp = await asyncio.wait_for(waiting, max(float(timeout), 0.0) + WAIT_GRACE)
        except RemoteError as exc:
            if exc.errnum == errno.ETIMEDOUT and timeout is not None:
                raise TimeoutError(exc.errstr) from None
            raise
        except TimeoutError:
            raise TimeoutError(f"version {version} not reached in {timeout:g} s; the rank "
                               "did not answer (stopped?)") from None
        return int(resp["rootseq"])

    async def sync(self) -> CommitResult:
        """Make everything committed so far durable: an empty :data:`SYNC`
        commit (Flux's ``flux kvs sync``).  It returns once every blob
        stored until then is on stable storage and, in ``primary``, a
        checkpoint names the new root (with a statedir).  The version goes
        up by one, as for any commit."""
        return await self.commit([], SYNC)

    async def gc(self, compact: bool = False) -> dict[str, Any]:
        """Collect the content store's garbage now, while the instance runs
        (``kvs.gc``; instance owner only; ``EBUSY`` while one runs).  Keeps
        every namespace's current root, the roots of the last
        ``kvs.gc-grace`` seconds and the checkpoints; reads at older roots
        then fail with ``ENOENT`` (docs/kvs.md, "Garbage collection").
        With ``compact`` the file is also rewritten to its new size, which
        holds the store meanwhile.  Returns what was kept and removed:
        ``{removed, removed-bytes, kept, roots, damaged, damaged-count,
        file-bytes, free-bytes, compacted, grace, checkpoints-dropped, seconds}``."""
        resp = await self.handle.rpc("kvs.gc", {"compact": bool(compact)})
        return dict(resp)

    async def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints of the primary namespace rank 0 keeps, newest
        (the one a restart resumes from) first: ``content.max-checkpoints``
        of them at most, none without a statedir (``content.checkpoint-list``;
        instance owner only).  A stopped instance's are rolled back with
        ``kvbroker kvs checkpoint update`` (:mod:`kvs.checkpoints`)."""
        from kvs.checkpoints import Checkpoint
        from kvs.namespaces import CHECKPOINT_KEY

        resp = await self.handle.rpc("content.checkpoint-list", {"key": CHECKPOINT_KEY})
        return [Checkpoint.from_value(v) for v in resp.get("checkpoints", [])]

    # ------------------------------------------------------------ leases

    def lease(self, ttl: float, *, keepalive: bool = True) -> LeaseGrant:
        """A lease of ``ttl`` seconds from rank 0 (``kvs.lease-grant``; 1 s
        to a day): ``lease = await kvs.lease(10)``, or ``async with
        kvs.lease(10) as lease:``, which revokes it when the block ends.
        Keys put with ``lease=lease`` go when it ends.  With ``keepalive``
        (the default) a task of this loop keeps it alive every ``ttl/3``
        seconds until :meth:`Lease.revoke` or :meth:`Lease.close`: a
        process that dies, or whose rank or way to rank 0 does, stops
        keeping it, and its keys are unlinked at most ``ttl`` later.  A
        loop blocked for longer than ``ttl`` (a CPU-bound stretch without
        an ``await``) loses the lease as a dead process would."""
        return LeaseGrant(self, ttl, keepalive)

    async def lease_keepalive(self, lease: LeaseSpec) -> float:
        """``kvs.lease-keepalive``: give the lease its full ttl again, from
        now (returned); ``ENOENT`` once it expired or was revoked."""
        resp = await self.handle.rpc("kvs.lease-keepalive", {"id": lease_id(lease)})
        return float(resp["ttl"])

    async def lease_revoke(self, lease: LeaseSpec) -> None:
        """``kvs.lease-revoke``: end the lease now; returns once its keys are
        unlinked (visible on this rank), also when it had ended and they are
        still being unlinked.  ``ENOENT`` if it had ended and they are gone."""
        await self.handle.rpc("kvs.lease-revoke", {"id": lease_id(lease)})

    async def lease_info(self, lease: LeaseSpec) -> dict[str, Any]:
        """``kvs.lease-info``: ``{id, owner, ttl, ttl_left, key-count, keys:
        {namespace: [key, ...]}}`` (at most 1,000 keys a namespace, and 32 KiB
        of names in all; ``key-count`` counts them all)."""
        return dict(await self.handle.rpc("kvs.lease-info", {"id": lease_id(lease)}))

    async def lease_list(self) -> list[dict[str, Any]]:
        """``kvs.lease-list``, every page: the live leases this user holds
        (all of them for the instance owner), in id order, each ``{id,
        owner, ttl, ttl_left, key-count}`` (``lease_info`` lists its keys).
        A lease granted or ended while the pages are read may be missed or
        listed after it ended, as etcd's list."""
        leases: list[dict[str, Any]] = []
        after = 0
        while True:
            resp = await self.handle.rpc("kvs.lease-list", {"after": after})
            page = list(resp["leases"])
            leases += page
            if not resp.get("more") or not page:
                return leases
            after = page[-1]["id"]

    # ------------------------------------------------------------ namespaces

    async def namespace_create(self, name: str, owner: int | None = None,
                               rootref: RootSpec | None = None) -> None:
        """Create namespace ``name`` (owned by uid ``owner``, default the
        instance owner), empty or starting at root ``rootref`` (a blobref,
        or anything ``at=`` takes: the output of ``getroot`` too).
        ``EEXIST`` if it exists; instance owner only."""
        payload: dict[str, Any] = {"namespace": _namespace_named(name)}
        if owner is not None:
            if isinstance(owner, bool) or not isinstance(owner, int):
                raise TypeError(f"a namespace's owner is a uid (an int), not {owner!r}")
            payload["owner"] = int(owner)
        if rootref is not None:
            payload["rootref"] = as_root(rootref)["data"][0]
        await self.handle.rpc("kvs.namespace-create", payload)

    async def namespace_remove(self, name: str) -> None:
        """Remove namespace ``name`` (no error if it does not exist;
        ``ENOTSUP`` for ``primary``)."""
        await self.handle.rpc("kvs.namespace-remove", {"namespace": _namespace_named(name)})

    async def namespace_list(self) -> list[Root]:
        """Every namespace, with its owner, version and root."""
        # (kvs.namespaces, the ranks' namespace state, imported here: ~2.5 ms
        # of every kvs command)
        from kvs.namespaces import gather_namespace_list

        resp = await gather_namespace_list(self.handle, NODEID_ANY)  # (in parts: any count)
        return [Root.from_payload(p) for p in resp["namespaces"]]

    def watch_namespaces(self, prefix: str = "", *, changes_only: bool = False,
                         listed: bool = False, nodeid: int | None = None) -> NamespaceWatch:
        """:func:`kvs_watch.client.watch_namespaces`: the namespaces named
        ``prefix...`` that exist, then each one created or removed
        (``async for`` :class:`~kvs_watch.client.NamespaceEvent`; with
        ``listed``, the end-of-list marker between the two).  Not bound to
        this KVS's namespace; open to guests, who see their own."""
        from kvs_watch.client import watch_namespaces

        extra = {} if nodeid is None else {"nodeid": nodeid}
        return watch_namespaces(self.handle, prefix, changes_only=changes_only, listed=listed,
                                **extra)


# ---------------------------------------------------------------- blocking facade


class SyncTxn(TxnOps):
    """A transaction of a :class:`SyncKVS`; a ``with`` block commits on clean exit."""

    def __init__(self, kvs: SyncKVS, flags: int = 0) -> None:
        super().__init__()
        self.kvs = kvs
        self.flags = flags
        self.result: CommitResult | None = None
        self.tried = False
        """:meth:`commit` was called (and maybe failed: ``result`` is then None)."""
        self.committed_ops = 0
        """How many of ``ops`` the last commit sent."""

    def commit(self, flags: int | None = None) -> CommitResult:
        self.tried = True  # (failed or not: a block's exit does not send it again)
        self.committed_ops = len(self.ops)
        self.result = self.kvs.commit(self, self.flags if flags is None else flags)
        return self.result

    def __enter__(self) -> SyncTxn:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            if not self.tried:
                self.commit()
            else:
                _check_all_sent(self)


class SyncKVS:
    """Blocking twin of :class:`KVS`, on a :class:`broker.sync.SyncHandle`.

        from kvs.client import SyncKVS
        with SyncKVS() as kvs:                   # connects to $KVBROKER_URI
            kvs.put("a", 1)
            with kvs.txn() as t:
                t.put("b", "x").unlink("a")
            print(kvs.get_str("b"))

    ``aio`` is the underlying :class:`KVS`; ``run(coro)`` runs any of its
    coroutines (e.g. :func:`kvs.eventlog.append`) on the facade's loop.
    Each method is its :class:`KVS` namesake's twin (the same docstring).
    Every call gives up after the handle's ``timeout`` (``TimeoutError``;
    ``SyncKVS(timeout=2.0)`` sets it on the handle it makes), except
    :meth:`wait_version`, :meth:`wait_create` and :meth:`wait_event`, which
    wait as long as their own ``timeout`` says, the watches (``next()``
    waits as long as the watch's own ``timeout``) and :meth:`gc`, which
    waits as long as the collection takes.
    """

    def __init__(self, handle: SyncHandle | None = None, namespace: str | None = None, *,
                 uri: str | None = None, event_loop: str | None = None,
                 timeout: float | None = None, reconnect: bool = False) -> None:
        from broker.sync import SyncHandle

        if handle is not None and (uri is not None or event_loop is not None
                                   or timeout is not None or reconnect):
            raise ValueError("uri, event_loop, timeout and reconnect are the handle's: give "
                             "them to broker.sync.connect(), or give no handle")
        if isinstance(handle, str):
            raise TypeError(f"SyncKVS takes a SyncHandle first, not the URI {handle!r}: "
                            "give it as SyncKVS(uri=...)")
        if handle is None:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                pass
            else:  # (SyncHandle's own refusal names broker.handle.Handle)
                raise RuntimeError("SyncKVS cannot be used inside a running event loop: "
                                   "use its async twin there, kvs.client.KVS "
                                   "(await KVS.connect(), or KVS(handle))")
        default_namespace(namespace)  # (a bad one refused before connecting)
        self._owns_handle = handle is None
        self.sync_handle = handle if handle is not None else SyncHandle(
            uri, event_loop=event_loop, timeout=timeout, reconnect=reconnect)
        self.aio = KVS(self.sync_handle.aio, namespace)

    @property
    def namespace(self) -> str:
        return self.aio.namespace

    def run(self, aw: Awaitable[T], timeout: float | None | Default = DEFAULT) -> T:
        """Run an awaitable of the async API on this facade's loop, for at
        most ``timeout`` seconds (None: no limit; omitted: the handle's)."""
        return self.sync_handle.run(aw, timeout)

    def with_namespace(self, namespace: str | None) -> SyncKVS:
        """A facade on the same handle working in ``namespace``."""
        return SyncKVS(self.sync_handle, namespace)

    def close(self) -> None:
        """Close the handle, if this facade made it."""
        if self._owns_handle:
            self.sync_handle.close()

    def __repr__(self) -> str:
        return f"<SyncKVS {self.namespace!r} on {self.sync_handle.aio.uri}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # reads
    def lookup(self, key: str, flags: int = 0, *, at: RootSpec | None = None) -> TreeObj:
        return self.run(self.aio.lookup(key, flags, at=at))

    def lookup_at(self, at: RootSpec, key: str, flags: int = 0) -> TreeObj:
        return self.run(self.aio.lookup_at(at, key, flags))

    @overload
    def get(self, key: str, *, at: RootSpec | None = None) -> bytes: ...

    @overload
    def get(self, key: str, default: T, *, at: RootSpec | None = None) -> bytes | T: ...

    def get(self, key: str, default: Any = _NO_DEFAULT, *, at: RootSpec | None = None) -> Any:
        return self.run(self.aio.get(key, default, at=at))

    @overload
    def get_str(self, key: str, *, at: RootSpec | None = None) -> str: ...

    @overload
    def get_str(self, key: str, default: T, *, at: RootSpec | None = None) -> str | T: ...

    def get_str(self, key: str, default: Any = _NO_DEFAULT, *,
                at: RootSpec | None = None) -> Any:
        return self.run(self.aio.get_str(key, default, at=at))

    def get_json(self, key: str, default: Any = _NO_DEFAULT, *,
                 at: RootSpec | None = None) -> Any:
        return self.run(self.aio.get_json(key, default, at=at))

    def get_treeobj(self, key: str, *, at: RootSpec | None = None) -> TreeObj:
        return self.run(self.aio.get_treeobj(key, at=at))

    def readlink(self, key: str, *, at: RootSpec | None = None) -> Link:
        return self.run(self.aio.readlink(key, at=at))

    def dir(self, key: str = ".", *, at: RootSpec | None = None) -> Dir:
        """A :class:`Dir` (its mapping part is synchronous; for
        ``read``/``subdir`` use ``kvs.run(d.read(name))``)."""
        return self.run(self.aio.dir(key, at=at))

    @overload
    def watch(self, key: str, *, timeout: float | None = None,
              initial_sentinel: Literal[False] = False,
              **options: Unpack[WatchOptions]) -> SyncWatch[WatchEntry]: ...

    @overload
    def watch(self, key: str, *, timeout: float | None = None, initial_sentinel: bool,
              **options: Unpack[WatchOptions]) -> SyncWatch[WatchEntry | InitialDone]: ...

    def watch(self, key: str, *, timeout: float | None = None, initial_sentinel: bool = False,
              **options: Unpack[WatchOptions]) -> SyncWatch[Any]:
        """:meth:`KVS.watch` as a blocking iterator (``with`` cancels it);
        each ``next()`` waits at most ``timeout`` seconds (None: as long as
        it takes)."""
        from kvs_watch.client import SyncWatch

        return SyncWatch(self.sync_handle,
                         self.aio.watch(key, initial_sentinel=initial_sentinel, **options),
                         timeout=timeout)

    def watch_keys(self, key: str = ".", *, waitcreate: bool = False, since: RootSpec | None = None,
                   timeout: float | None = None, nodeid: int | None = None,
                   max_backlog: int | None = None) -> SyncWatch[KeyChanges]:
        """:meth:`KVS.watch_keys` as a blocking iterator of ``KeyChanges``."""
        from kvs_watch.client import SyncWatch

        return SyncWatch(self.sync_handle,
                         self.aio.watch_keys(key, waitcreate=waitcreate, since=since,
                                             nodeid=nodeid, max_backlog=max_backlog),
                         timeout=timeout)

    def watch_eventlog(self, key: str, *, waitcreate: bool = False,
                       timeout: float | None = None,
                       nodeid: int | None = None) -> SyncWatch[EventlogEntry]:
        """:meth:`KVS.watch_eventlog` as a blocking iterator of entries."""
        from kvs_watch.client import SyncWatch

        return SyncWatch(self.sync_handle,
                         self.aio.watch_eventlog(key, waitcreate=waitcreate, nodeid=nodeid),
                         timeout=timeout)

    def watch_namespaces(self, prefix: str = "", *, changes_only: bool = False,
                         listed: bool = False, timeout: float | None = None,
                         nodeid: int | None = None) -> SyncWatch[NamespaceEvent]:
        """:meth:`KVS.watch_namespaces` as a blocking iterator of
        ``NamespaceEvent`` (``with`` cancels it)."""
        from kvs_watch.client import SyncWatch

        return SyncWatch(self.sync_handle,
                         self.aio.watch_namespaces(prefix, changes_only=changes_only,
                                                   listed=listed, nodeid=nodeid),
                         timeout=timeout)

    def append_event(self, key: str, name: str,
                     context: Mapping[str, Any] | str | None = None, *,
                     timestamp: float | None = None, sync: bool = False) -> CommitResult:
        return self.run(self.aio.append_event(key, name, context, timestamp=timestamp,
                                              sync=sync))

    def get_eventlog(self, key: str) -> list[EventlogEntry]:
        return self.run(self.aio.get_eventlog(key))

    def wait_event(self, key: str, name: str, *, waitcreate: bool = False,
                   timeout: float | None = None, nodeid: int | None = None) -> EventlogEntry:
        # (its own timeout, as wait_create's: the handle's default does not apply)
        return self.run(self.aio.wait_event(key, name, waitcreate=waitcreate, timeout=timeout,
                                            nodeid=nodeid), None)

    def get_tree(self, key: str = ".", *, at: RootSpec | None = None,
                 limit: int | None = TREE_LIMIT) -> dict[str, bytes]:
        return self.run(self.aio.get_tree(key, at=at, limit=limit))

    def exists(self, key: str, *, at: RootSpec | None = None) -> bool:
        return self.run(self.aio.exists(key, at=at))

    def unlinkable(self, key: str, *, recursive: bool = False, force: bool = False) -> bool:
        return self.run(self.aio.unlinkable(key, recursive=recursive, force=force))

    # writes
    def txn(self, flags: int = 0) -> SyncTxn:
        return SyncTxn(self, flags)

    def commit(self, ops: TxnOps | Iterable[dict[str, Any]], flags: int = 0) -> CommitResult:
        return self.run(self.aio.commit(ops, flags))

    def put(self, key: str, value: Any, *, sync: bool = False,
            lease: LeaseSpec | None = None) -> CommitResult:
        return self.run(self.aio.put(key, value, sync=sync, lease=lease))

    def put_treeobj(self, key: str, obj: str | bytes | Mapping[str, Any], *,
                    sync: bool = False) -> CommitResult:
        return self.run(self.aio.put_treeobj(key, obj, sync=sync))

    def append(self, key: str, value: Any, *, sync: bool = False) -> CommitResult:
        return self.run(self.aio.append(key, value, sync=sync))

    def mkdir(self, *keys: str) -> CommitResult:
        return self.run(self.aio.mkdir(*keys))

    def symlink(self, key: str, target: str, namespace: str | None = None) -> CommitResult:
        return self.run(self.aio.symlink(key, target, namespace))

    def unlink(self, *keys: str, recursive: bool = False, force: bool = False) -> CommitResult:
        return self.run(self.aio.unlink(*keys, recursive=recursive, force=force))

    def update(self, key: str, fn: Callable[[Any], Any], *,
               decode: Literal["bytes", "str", "json"] = "bytes",
               retries: int = UPDATE_RETRIES, sync: bool = False,
               lease: LeaseSpec | None = None) -> Updated:
        return self.run(self.aio.update(key, fn, decode=decode, retries=retries, sync=sync,
                                        lease=lease))

    def copy(self, src: str, dst: str, *, src_namespace: str | None = None,
             dst_namespace: str | None = None) -> CommitResult:
        return self.run(self.aio.copy(src, dst, src_namespace=src_namespace,
                                      dst_namespace=dst_namespace))

    def move(self, src: str, dst: str, *, src_namespace: str | None = None,
             dst_namespace: str | None = None) -> CommitResult:
        return self.run(self.aio.move(src, dst, src_namespace=src_namespace,
                                      dst_namespace=dst_namespace))

    # versions, roots, namespaces
    @overload
    def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
             limit: int | None = None, status: Literal[False] = False) -> list[str]: ...

    @overload
    def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
             limit: int | None = None, status: Literal[True]) -> dict[str, Change]: ...

    @overload
    def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
             limit: int | None = None, status: bool) -> list[str] | dict[str, Change]: ...

    def diff(self, old: RootSpec, new: RootSpec | None = None, key: str = ".", *,
             limit: int | None = None, status: bool = False) -> Any:
        return self.run(self.aio.diff(old, new, key, limit=limit, status=status))

    def getroot(self) -> Root:
        return self.run(self.aio.getroot())

    def version(self) -> int:
        return self.run(self.aio.version())

    def wait_create(self, key: str, timeout: float | None = None, *,
                    nodeid: int | None = None) -> WatchEntry:
        return self.run(self.aio.wait_create(key, timeout, nodeid=nodeid), None)

    def wait_version(self, version: int | CommitResult, timeout: float | None = None,
                     *, epoch: int | None = None) -> int:
        # the rank gives up first and forgets the wait, and the async call
        # bounds a rank that does not answer at all (WAIT_GRACE)
        return self.run(self.aio.wait_version(version, timeout, epoch=epoch), None)

    def sync(self) -> CommitResult:
        return self.run(self.aio.sync())

    def gc(self, compact: bool = False) -> dict[str, Any]:
        return self.run(self.aio.gc(compact), None)

    def checkpoints(self) -> list[Checkpoint]:
        return self.run(self.aio.checkpoints())  # (a quick read: the handle's timeout)

    def lease(self, ttl: float, *, keepalive: bool = True) -> SyncLease:
        """A lease of ``ttl`` seconds (see :meth:`KVS.lease`): ``with
        kvs.lease(10) as lease:`` revokes it when the block ends.  This
        facade's loop turns only during its calls, so with ``keepalive``
        (the default) a thread of its own, on a connection of its own to
        the same rank, keeps the lease alive every ``ttl/3`` seconds while
        the script computes or sleeps; :meth:`SyncLease.revoke` (or the
        end of the block) stops it, and so does closing this facade's
        handle (the lease then expires, unless revoked).  A process that
        dies stops it too."""
        resp = self.run(self.aio.handle.rpc("kvs.lease-grant", {"ttl": lease_ttl(ttl)}))
        return SyncLease(self, int(resp["id"]), float(resp["ttl"]), keepalive)

    def lease_keepalive(self, lease: LeaseSpec) -> float:
        return self.run(self.aio.lease_keepalive(lease))

    def lease_revoke(self, lease: LeaseSpec) -> None:
        self.run(self.aio.lease_revoke(lease))

    def lease_info(self, lease: LeaseSpec) -> dict[str, Any]:
        return self.run(self.aio.lease_info(lease))

    def lease_list(self) -> list[dict[str, Any]]:
        return self.run(self.aio.lease_list())

    def namespace_create(self, name: str, owner: int | None = None,
                         rootref: RootSpec | None = None) -> None:
        self.run(self.aio.namespace_create(name, owner, rootref))

    def namespace_remove(self, name: str) -> None:
        self.run(self.aio.namespace_remove(name))

    def namespace_list(self) -> list[Root]:
        return self.run(self.aio.namespace_list())


# ---------------------------------------------------------------- leases


class HasLeaseId(Protocol):
    @property
    def id(self) -> int: ...


LeaseSpec = int | HasLeaseId
"""A lease as the API takes it: its id, or a :class:`Lease` / :class:`SyncLease`."""


def lease_ttl(ttl: float) -> float:
    """``ttl`` checked for a grant: a number (``TypeError`` else, before
    anything is sent); its range is rank 0's to check (``EINVAL``)."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise TypeError(f"a lease's ttl is a number of seconds, not {ttl!r}")
    return ttl


def lease_id(lease: LeaseSpec) -> int:
    if isinstance(lease, LeaseGrant):
        raise TypeError("a lease is a Lease or its id (an int), not the LeaseGrant that "
                        "kvs.lease() returns: await it (lease = await kvs.lease(ttl)), or "
                        "use it as async with kvs.lease(ttl) as lease")
    lid = lease if isinstance(lease, int) else getattr(lease, "id", None)
    if type(lid) is not int:
        raise TypeError(f"a lease is a Lease or its id (an int), not {lease!r}")
    return lid


class Lease:
    """A lease granted by rank 0 (from :meth:`KVS.lease`), and the task
    keeping it alive.  ``lost`` is set when a keepalive found it gone
    (``ENOENT``: it expired -- this loop was blocked, or rank 0 unreachable,
    for longer than its ttl -- or someone revoked it): its keys are gone or
    going, and whoever relied on them (a lock) should stop."""

    def __init__(self, kvs: KVS, lease_id: int, ttl: float) -> None:
        self.kvs = kvs
        self.id = lease_id
        self.ttl = ttl
        self.lost = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<Lease {self.id} ttl {self.ttl:g}{' lost' if self.lost.is_set() else ''}>"

    def _start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        """Keep it alive every ttl/3; a failure other than ``ENOENT`` (a
        rank restarting, a timeout) is tried again at the next tick."""
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await asyncio.wait_for(self.kvs.lease_keepalive(self.id), self.ttl / 3)
            except RemoteError as exc:
                if exc.errnum == errno.ENOENT:
                    self.lost.set()
                    return
                if exc.errnum in (errno.ECONNRESET, errno.EPIPE):
                    if getattr(self.kvs.handle, "reconnect", False):
                        continue  # (lost, and made again: the next tick goes out then)
                    # the handle is closed (or its connection lost, for good:
                    # it does not reconnect), as a closed handle's calls
                    # say: nothing keeps the lease now
                    return
            except TimeoutError:
                continue
            except (ErrnoError, ConnectionError) as exc:
                if getattr(exc, "errnum", errno.ECONNRESET) in (errno.ECONNRESET, errno.EPIPE):
                    return  # the handle is closed: nothing keeps the lease now

    async def keepalive(self) -> float:
        """One keepalive now (the background task does them anyway); one
        that finds the lease gone (``ENOENT``) sets :attr:`lost` before it
        raises, as the task's does (with ``keepalive=False`` these are the
        only ones, and ``lost`` was never set)."""
        try:
            return await self.kvs.lease_keepalive(self.id)
        except RemoteError as exc:
            if exc.errnum == errno.ENOENT:
                self.lost.set()
            raise

    async def info(self) -> dict[str, Any]:
        """:meth:`KVS.lease_info` of this lease."""
        return await self.kvs.lease_info(self.id)

    async def close(self) -> None:
        """Stop keeping it alive, without revoking it: it expires in at most ``ttl``."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def revoke(self) -> None:
        """Stop keeping it alive and revoke it: its keys are unlinked before
        this returns.  A lease already gone (``lost``) is not an error."""
        await self.close()
        try:
            await self.kvs.lease_revoke(self.id)
        except RemoteError as exc:
            if exc.errnum != errno.ENOENT:
                raise
            self.lost.set()

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.revoke()


class LeaseGrant:
    """What :meth:`KVS.lease` returns: await it for a :class:`Lease`, or use
    it as an ``async with`` block that revokes the lease at its end."""

    def __init__(self, kvs: KVS, ttl: float, keepalive: bool) -> None:
        self.kvs = kvs
        self.ttl = lease_ttl(ttl)
        self.keepalive = keepalive
        self._lease: Lease | None = None

    async def _grant(self) -> Lease:
        resp = await self.kvs.handle.rpc("kvs.lease-grant", {"ttl": self.ttl})
        lease = Lease(self.kvs, int(resp["id"]), float(resp["ttl"]))
        if self.keepalive:
            lease._start()
        return lease

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._grant().__await__()

    async def __aenter__(self) -> Lease:
        self._lease = await self._grant()
        return self._lease

    async def __aexit__(self, *exc: object) -> None:
        if self._lease is not None:
            await self._lease.revoke()


class SyncLease:
    """A lease of a :class:`SyncKVS` (from :meth:`SyncKVS.lease`); a ``with``
    block revokes it at its end.  Its keepalives run in a thread of their
    own on a connection of their own (see :meth:`SyncKVS.lease`);
    ``lost`` tells whether one found the lease gone."""

    def __init__(self, kvs: SyncKVS, lease_id: int, ttl: float, keepalive: bool) -> None:
        self.kvs = kvs
        self.id = lease_id
        self.ttl = ttl
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if keepalive:
            self._thread = threading.Thread(
                target=self._keep, args=(kvs.sync_handle.aio.uri,),
                name=f"kvs-lease-{lease_id}", daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"<SyncLease {self.id} ttl {self.ttl:g}{' lost' if self.lost else ''}>"

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def _keep(self, uri: str) -> None:
        """Keep it alive every ttl/3 until :meth:`close`, or until the
        facade's handle is closed: as :class:`Lease`'s task ends with its
        handle, a script that closed its connection holds nothing (this
        thread used to keep the lease, and its keys, for as long as the
        process lived)."""
        from broker.sync import SyncHandle

        owner = self.kvs.sync_handle
        reconnect = owner.aio.reconnect

        def connect() -> SyncHandle | None:
            # (reconnecting as the facade's own handle does: a restarted rank
            # loses nothing -- its first connect too: one that met the rank
            # going down is tried again at the next tick, where it ended the
            # thread, and the lease expired with its holder alive)
            try:
                return SyncHandle(uri, timeout=self.ttl / 3, reconnect=reconnect)
            except (ErrnoError, OSError):
                return None

        h = connect()
        if h is None and not reconnect:
            return  # (the lease expires: as if this process had died)
        try:
            while not self._stop.wait(self.ttl / 3):
                if owner.closed:
                    return
                if h is None:
                    h = connect()
                    if h is None:
                        continue
                try:
                    h.rpc("kvs.lease-keepalive", {"id": self.id})
                except RemoteError as exc:
                    if exc.errnum == errno.ENOENT:
                        self._lost.set()
                        return
                except (TimeoutError, ErrnoError, OSError):
                    continue
        finally:
            if h is not None:
                h.close()

    def keepalive(self) -> float:
        """One keepalive now, on the facade's own connection; ``ENOENT``
        (the lease is gone) sets :attr:`lost` before it is raised."""
        try:
            return self.kvs.lease_keepalive(self.id)
        except RemoteError as exc:
            if exc.errnum == errno.ENOENT:
                self._lost.set()
            raise

    def info(self) -> dict[str, Any]:
        return self.kvs.lease_info(self.id)

    def close(self) -> None:
        """Stop keeping it alive (the thread ends), without revoking it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def revoke(self) -> None:
        """Stop keeping it alive and revoke it (its keys are unlinked before
        this returns); a lease already gone is not an error."""
        self.close()
        try:
            self.kvs.lease_revoke(self.id)
        except RemoteError as exc:
            if exc.errnum != errno.ENOENT:
                raise
            self._lost.set()

    def __enter__(self) -> SyncLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revoke()


def _share_docstrings(twin: type, source: type) -> None:
    """Give each method of the blocking ``twin`` that has none its async
    namesake's docstring, so that ``help(SyncKVS.get)`` says what it does."""
    for name, func in vars(twin).items():
        if callable(func) and not name.startswith("_") and not func.__doc__:
            doc = getattr(getattr(source, name, None), "__doc__", None)
            if doc:
                func.__doc__ = doc


_share_docstrings(SyncKVS, KVS)
_share_docstrings(SyncTxn, Txn)
