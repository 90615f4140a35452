"""The client side of a watch's backlog bound (``kvs-watch.max-backlog``).

kvs-watch ends a watcher that falls more than ``max-backlog`` commits
behind with ``EOVERFLOW``, and an ``append`` watcher without ``deletes``
folds instead (docs/protocol.md, *Backlog* and *Folding*).  But the rank's
backlog is only what it has not answered yet: a client that stops reading
its socket lets it grow, a :class:`~broker.handle.Handle` never does -- it
reads every answer as it comes into the watch's :class:`~broker.rpc.Stream`
-- so a reader that fell behind held every answer in its process, without
bound, and never got the ``EOVERFLOW`` the docs promise.

:class:`Backlog` keeps a watch's unread answers to that bound on the client
(:meth:`broker.rpc.Stream.bound`: one length check per answer).  Past it:

* a value, ``uniq``, ``full``, ``deletes`` or ``watch_keys`` watch ends as
  if its rank had overflowed: its reader gets the answers queued, then
  ``EOVERFLOW``; the rank is sent ``kvs-watch.cancel``, so it keeps nothing;
* an ``append`` watch without ``deletes`` folds, as its rank does: an
  answer joins the unread one before it, at the newer version, so its
  reader still sees each byte once, in order, in fewer entries.  Its bytes
  are kept (they were read off the socket; the rank would read them again
  at the newest version): at most what was appended since the reader
  stopped, so less than the value itself.

The bound is the serving rank's ``kvs-watch.max-backlog``, asked once per
handle and rank (``attr.get``, sent with the first watch and not waited
for: until its answer, :data:`DEFAULT_MAX_BACKLOG`), or the watch's own
``max_backlog``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import weakref
from collections import deque
from typing import Any

from broker.errors import RemoteError
from broker.message import Message, MsgType
from broker.rpc import HandleCore, Stream
from kvs_watch import flags as F

DEFAULT_MAX_BACKLOG = 1000
"""The bound until the rank's is known (kvs-watch's own default)."""

ATTR = "kvs-watch.max-backlog"

_RankValue = int | asyncio.Future[Any]
_learnt: weakref.WeakKeyDictionary[HandleCore, dict[int, _RankValue]] = \
    weakref.WeakKeyDictionary()
"""Per handle, per ``nodeid``: the rank's bound, or the ``attr.get`` asking it."""


def check_max_backlog(n: object) -> int | None:
    """``max_backlog`` as given (None: the rank's); ``ValueError`` below 1,
    ``TypeError`` for a non-integer -- before anything is sent."""
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"max_backlog must be an int, not {type(n).__name__}")
    if n < 1:
        raise ValueError(f"max_backlog must be at least 1, not {n}")
    return n


class Folded(dict[str, Any]):
    """The payload of append answers folded into one (a plain dict to every
    reader once :meth:`settled`).  Its data is a ``bytearray`` while answers
    join it, so folding N of them costs O(their bytes), not O(N^2)."""

    __slots__ = ()

    def settled(self) -> dict[str, Any]:
        """The answer as the rank would have sent it: ``data`` as bytes."""
        val = self["val"]
        return {**self, "val": {**val, "data": bytes(val["data"])}}


def _data_answer(p: Any) -> bool:
    """An append watch's answer of one blob (not the sentinel, None)."""
    if type(p) is not dict and type(p) is not Folded:
        return False
    val = p.get("val")
    return (type(val) is dict and val.get("type") == "val"
            and isinstance(val.get("data"), (bytes, bytearray)))


def fold(unread: deque[Message], msg: Message) -> bool:
    """Join append answer ``msg`` into the last unread one, at ``msg``'s
    version (False: it cannot be folded).  The initial sentinel, and the
    first data answer after it, are queued past the bound instead (once a
    stream): the sentinel's place in the entries is kept."""
    try:
        p, tail = msg.payload, unread[-1]
        tp = tail.payload
    except Exception:  # (a payload that does not decode: its reader raises it)
        return False
    if p is None or tp is None:
        unread.append(msg)
        return True
    if not (_data_answer(p) and _data_answer(tp)):
        return False
    if type(tp) is not Folded:
        first = tp["val"]
        tp = Folded(tp)
        tp["val"] = {**first, "data": bytearray(first["data"])}
        unread[-1] = Message(MsgType.RESPONSE, tail.topic, tp, matchtag=tail.matchtag)
    tp["val"]["data"] += p["val"]["data"]
    tp["rootseq"] = p.get("rootseq", tp.get("rootseq"))
    return True


class Backlog:
    """The bound on one watch's unread answers (see the module docstring)."""

    __slots__ = ("h", "key", "nodeid", "given", "folds")

    def __init__(self, h: HandleCore, key: str, flags: int, nodeid: int,
                 max_backlog: int | None) -> None:
        self.h = h
        self.key = key
        self.nodeid = nodeid
        self.given = max_backlog
        """The watch's own bound (None: its rank's)."""
        self.folds = flags & (F.APPEND | F.DELETES) == F.APPEND
        """Folds past the bound, as the rank does, instead of overflowing."""

    def attach(self, stream: Stream) -> None:
        """Bound ``stream``, the watch's request as just sent."""
        n = self.given
        if n is None:
            n = self._rank_bound(stream)
        stream.bound(n, self._over)

    def _rank_bound(self, stream: Stream) -> int:
        """The serving rank's bound if known; else :data:`DEFAULT_MAX_BACKLOG`,
        and ``stream`` takes the rank's when its answer comes."""
        try:
            known = _learnt.get(self.h)
            if known is None:
                known = _learnt[self.h] = {}
        except TypeError:  # (a handle that cannot be a weak key: the default)
            return DEFAULT_MAX_BACKLOG
        v = known.get(self.nodeid)
        if type(v) is int:
            return v
        if v is None:
            try:
                v = known[self.nodeid] = self.h.rpc("attr.get", {"name": ATTR},
                                                    nodeid=self.nodeid)
            except (RemoteError, OSError, RuntimeError):  # (closed: the watch fails too)
                return DEFAULT_MAX_BACKLOG
        assert isinstance(v, asyncio.Future)
        v.add_done_callback(functools.partial(_learn, known, self.nodeid, stream))
        return DEFAULT_MAX_BACKLOG

    def _over(self, stream: Stream, msg: Message) -> None:
        """An answer past the bound: fold it, or end the watch ``EOVERFLOW``."""
        if self.folds and fold(stream.unread, msg):
            return
        stream.end_here(errno.EOVERFLOW, f"{self.key}: watcher fell more than "
                                         f"{stream.max_unread} commits behind (answers "
                                         "unread by this client)")
        with contextlib.suppress(RemoteError, OSError):  # (the handle is closed)
            self.h.send_noresponse("kvs-watch.cancel", {"matchtag": stream.matchtag},
                                   nodeid=self.nodeid)


def _learn(known: dict[int, _RankValue], nodeid: int, stream: Stream,
           fut: asyncio.Future[Any]) -> None:
    """The rank's ``attr.get`` answered: keep its bound for the handle's
    next watches, and give it to ``stream`` (asked with the first one)."""
    try:
        n = int(fut.result()["value"])
    except (asyncio.CancelledError, Exception):
        if known.get(nodeid) is fut:  # (asked again by the next watch)
            del known[nodeid]
        return
    if n < 1:
        return
    known[nodeid] = n
    if not stream.ended_here and stream.max_unread == DEFAULT_MAX_BACKLOG:
        stream.max_unread = n
