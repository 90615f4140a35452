"""A follower's road for commits to rank 0: coalesce, relay, settle by event.

A follower's kvs cannot apply a transaction; it relays it to rank 0 as
``kvs.relaycommit`` and learns the outcome from the namespace event that
names it (``setroot``: applied in that version; ``error``: failed), as Flux
does.  Two choices keep the road cheap:

* **No response once queued.**  Rank 0 answers a relay only if it refuses it
  before queueing (or the broker cannot route it), so a refusal never leaves
  a client waiting, and success costs no message beside the event every rank
  receives anyway.  The follower retires the relay's matchtag itself once
  every transaction in it has settled, and neither side keeps anything of
  a queued relay: rank 0 does not hold it as a request waiting for its
  answer, and the follower issues its matchtag again (an event naming one
  of its transactions says it was queued, so no answer will come).
* **One message per namespace per loop turn.**  Commits that arrive in the
  same turn of the event loop for one namespace leave as one message
  (``{namespace, txns: [{name, flags, ops}, ...]}``) when the turn ends
  (``call_soon``: no timer, no added latency).  Clients answered by the same
  ``setroot`` tend to commit again together, so under load this halves the
  messages through the tree.  Rank 0 queues the transactions one by one, so
  merging, ordering and failure stay per transaction.  A message holds
  transactions of at most ``RELAY_BYTES`` together (as their clients sent
  them; less with a small ``tbon.max-message``), unless one alone is bigger:
  big ones never add up past what a link carries.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from functools import partial
from typing import Any

from broker.errors import ErrnoError, no_service
from broker.rpc import HandleCore
from kvs.namespaces import Namespace

RELAY_BYTES = 16 << 20
"""The transactions one relay message gathers, in bytes of their requests."""

NOT_LOADED_ON_RANK_0 = "kvs is not loaded on rank 0"


def from_rank_0(exc: ErrnoError) -> ErrnoError:
    """``exc``, rank 0's answer to a request a follower's kvs sent it on its
    own (a relayed commit, a ``kvs.getroot``), as its client should read
    it: the router's ``no service matching kvs.relaycommit`` (no kvs
    loaded on rank 0: ``module remove kvs``) named a topic the client
    never sent."""
    if no_service(exc):
        return ErrnoError(exc.errnum, NOT_LOADED_ON_RANK_0)
    return exc


class _Relay:
    """One ``kvs.relaycommit`` message being filled, then in flight."""

    __slots__ = ("ns", "txns", "tag", "unsettled", "size", "queued")

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.txns: list[dict[str, Any]] = []
        self.tag: int | None = None
        self.unsettled = 0
        self.size = 0
        self.queued = False
        """An event named one of its transactions: rank 0 queued the relay
        (all of it), and so never answers it."""

    def names(self) -> list[str]:
        return [t["name"] for t in self.txns]


class RelayOutbox:
    """Relays a follower's transactions to rank 0 (see the module docstring)."""

    def __init__(self, handle: HandleCore, counts: Counter[str],
                 max_bytes: int = RELAY_BYTES) -> None:
        self._h = handle
        self._counts = counts
        self._max_bytes = min(max_bytes, RELAY_BYTES)
        """A relay message gathers transactions of at most this many bytes
        (a quarter of ``tbon.max-message``, at most ``RELAY_BYTES``)."""
        self._filling: dict[str, _Relay] = {}

    def submit(self, ns: Namespace, ops: list[dict[str, Any]], flags: int,
               name: str, size: int = 0,
               lease_user: int | None = None) -> asyncio.Future[tuple[int, str]]:
        """Relay transaction ``name`` (``size``: the bytes of its request;
        ``lease_user``: the committer's uid, sent when an op names a lease,
        which rank 0 checks it holds);
        the future resolves to ``(rootseq, rootref)`` once this rank has
        applied the root holding it (read-your-writes here), or fails with
        the error rank 0 reported."""
        outcome = ns.expect(name)
        relay = self._filling.get(ns.name)
        if (relay is None or relay.ns is not ns
                or (relay.txns and relay.size + size > self._max_bytes)):
            # (a full one stays scheduled, and leaves first)
            relay = self._filling[ns.name] = _Relay(ns)
            asyncio.get_running_loop().call_soon(self._send, relay)
        relay.size += size
        txn: dict[str, Any] = {"name": name, "flags": flags, "ops": ops}
        if lease_user is not None:
            txn["userid"] = lease_user
        relay.txns.append(txn)
        relay.unsettled += 1
        outcome.add_done_callback(partial(self._settled, relay, name))
        return outcome

    def _send(self, relay: _Relay) -> None:
        ns = relay.ns
        if self._filling.get(ns.name) is relay:
            del self._filling[ns.name]
        if ns.removed:  # removing it failed every transaction waiting here
            return
        try:
            relay.tag, refusal = self._h.rpc_tagged(
                "kvs.relaycommit", {"namespace": ns.name, "epoch": ns.epoch, "txns": relay.txns},
                nodeid=0)
        except ErrnoError as exc:  # our handle is closed: the rank is stopping
            ns.fail(relay.names(), exc.errnum, exc.errstr)
            return
        self._counts["relays"] += 1
        self._counts["relayed"] += len(relay.txns)
        if relay.unsettled == 0:  # every requester already gave up
            self._h.retire(relay.tag)
            return
        refusal.add_done_callback(partial(self._refused, relay))

    def _refused(self, relay: _Relay, answer: asyncio.Future[Any]) -> None:
        if answer.cancelled():
            return
        exc = answer.exception()
        if isinstance(exc, ErrnoError):
            exc = from_rank_0(exc)
            relay.ns.fail(relay.names(), exc.errnum, exc.errstr)
        # a success answer is not part of the protocol: the event settles it

    def _settled(self, relay: _Relay, name: str, outcome: asyncio.Future[Any]) -> None:
        ns = relay.ns
        ns.forget_relayed(name)  # (a cancelled requester leaves it there)
        if not outcome.cancelled() and (outcome.exception() is None or not ns.removed):
            # settled by the setroot or error event naming it (a refusal has
            # been answered already; a removal of the namespace says nothing
            # of whether rank 0 had queued it)
            relay.queued = True
        relay.unsettled -= 1
        if relay.unsettled == 0 and relay.tag is not None:
            self._h.retire(relay.tag, may_answer=not relay.queued)
