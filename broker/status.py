"""The health of the tree (``kvbroker overlay status``, after ``flux overlay status``).

Every rank is asked for its hostname at once; a rank that the tree cannot
reach (``EHOSTUNREACH``: its parent dropped it) is *lost*, one that does not
answer in time while still connected (a stopped or overloaded process, or
one behind such a rank), or that its parent has marked torpid (it heard
nothing from it for ``tbon.torpid_max``: ``overlay.torpid`` in
``broker.stats-get`` of each rank with children), is *torpid*, Flux's word
for it.  A rank is *full*
when it and its whole subtree answer, *partial* when something below it is
lost or torpid.  A rank out of reach that stopped on purpose (it told its
parent so, ``overlay.goodbye``, or its parent told it to stop:
``overlay.offline`` of the parent's stats), and every rank below it, is
*offline* instead, as Flux says: stopped for maintenance is not a crash.
So is a rank out of reach that has not joined since its parent started
(``overlay.unjoined``: not started yet -- ranks across hosts start in any
order --, waiting for a parent of its own, or refused), and every rank
below it: Flux's children start offline too, and a rank that was never
there has not been lost.
Pure functions build and print the tree; :func:`gather` does the asking.

A rank that restarted (a new process said hello to its parent again, the
old one lost, or replaced while still connected: ``overlay.rejoined`` of
the parent's stats) shows so after its state, whatever the state: a rank
that came back is full again, and nothing else said it had ever gone.

Every line names its rank's host when it is known, whatever the state: the
one the rank answers with (its ``hostname``), else the one its last hello
to its parent named (``overlay.hosts`` of the parent's stats), else its
entry of the bootstrap file (the attached rank's ``hostlist``: under
``kvbroker start``, this host for every rank).  A torpid, lost or offline
rank answers nothing, and its line named no host: an operator of an
instance across hosts could not tell which machine to look at.
"""

from __future__ import annotations

import asyncio
import errno
from dataclasses import dataclass, replace
from typing import NamedTuple

from broker import topology
from broker.errors import RemoteError
from broker.handle import Handle
from broker.hostlist import encode
from broker.idset import encode_ranks

FULL, PARTIAL, LOST, TORPID, OFFLINE = "full", "partial", "lost", "torpid", "offline"


@dataclass(frozen=True)
class NoAnswer:
    """A rank that did not answer in time (not one the tree knows is gone)."""

    reason: str


Answer = tuple[str, str] | str | NoAnswer
"""A rank's answer: ``(hostname, "")``, why it is lost, or :class:`NoAnswer`."""


@dataclass(frozen=True)
class RankStatus:
    rank: int
    state: str
    hostname: str = ""
    detail: str = ""  # why it is lost
    restarts: str = ""  # what its parent saw of its restarts (:func:`restarts`)


async def _ask(h: Handle, rank: int, timeout: float) -> Answer:
    """``(hostname, "")`` for a rank that answers, else why it is lost, or
    :class:`NoAnswer`."""
    try:
        async with asyncio.timeout(timeout):
            return str(await h.attr_get("hostname", nodeid=rank)), ""
    except TimeoutError:
        return NoAnswer(f"no answer in {timeout:g}s")
    except RemoteError as exc:
        _raise_if_own_connection_lost(h)
        return exc.errstr or str(exc)


def _raise_if_own_connection_lost(h: Handle) -> None:
    """Raise ``ECONNRESET`` if a request failed because ``h``'s own
    connection went (the attached rank exited), not for the rank asked:
    every rank not yet answered was shown ``lost (connection to broker
    lost)``, the dead attached rank ``full``, and ``overlay errors`` and
    ``uptime`` exited 0."""
    if not h.connected:
        raise RemoteError(errno.ECONNRESET, "connection to broker lost")


class ChildrenView(NamedTuple):
    """What a rank's stats say of its children, by rank."""

    torpid: dict[int, str]
    """Those it marked torpid, with why."""
    restarts: dict[int, str]
    """Those that restarted since it started, said as :func:`restarts` says."""
    offline: dict[int, str]
    """Those that stopped on purpose and have not joined again, with why."""
    hosts: dict[int, str]
    """The host each one's last hello named."""
    unjoined: set[int]
    """Those no process of which has said hello since it started."""
    lost: dict[int, str]
    """Those it lost (a crash, a kill, cut off), with why."""


async def _children_view(h: Handle, rank: int, timeout: float) -> ChildrenView:
    """What ``rank`` says of its children (``broker.stats-get``); nothing
    if it does not answer (then it is torpid or lost itself)."""
    try:
        async with asyncio.timeout(timeout):
            resp = await h.rpc("broker.stats-get", {}, nodeid=rank)
    except TimeoutError:
        return ChildrenView({}, {}, {}, {}, set(), {})
    except RemoteError:
        _raise_if_own_connection_lost(h)
        return ChildrenView({}, {}, {}, {}, set(), {})
    overlay = resp.get("overlay", {}) if isinstance(resp, dict) else {}
    overlay = overlay if isinstance(overlay, dict) else {}
    torpid, rejoined = overlay.get("torpid", {}), overlay.get("rejoined", {})
    stopped, hosts = overlay.get("offline", {}), overlay.get("hosts", {})
    unjoined = overlay.get("unjoined", [])
    view = ChildrenView({}, {}, {}, {}, set(), {})
    lost = overlay.get("lost", {})
    for child, why in (lost.items() if isinstance(lost, dict) else ()):
        try:
            if isinstance(why, str) and why:
                view.lost[int(child)] = why
        except (TypeError, ValueError):
            continue
    for child in (unjoined if isinstance(unjoined, list) else ()):
        if isinstance(child, int) and not isinstance(child, bool):
            view.unjoined.add(child)
    for child, secs in (torpid.items() if isinstance(torpid, dict) else ()):
        try:
            view.torpid[int(child)] = (f"rank {rank} has heard nothing from it for "
                                       f"{float(secs):g}s")
        except (TypeError, ValueError):
            continue  # (not what a rank says: ignored)
    for child, why in (stopped.items() if isinstance(stopped, dict) else ()):
        try:
            view.offline[int(child)] = f"stopped: {why}"
        except (TypeError, ValueError):
            continue
    for child, host in (hosts.items() if isinstance(hosts, dict) else ()):
        try:
            if isinstance(host, str) and host:
                view.hosts[int(child)] = host
        except (TypeError, ValueError):
            continue
    for child, seen in (rejoined.items() if isinstance(rejoined, dict) else ()):
        try:
            view.restarts[int(child)] = restarts(int(seen["times"]), int(seen["replaced"]),
                                                 float(seen["ago"]))
        except (TypeError, ValueError, KeyError):
            continue
    return view


def fsd(seconds: float) -> str:
    """A duration as Flux writes one (RFC 23): ``45.1s``, ``3.2m``, ``2.3h``, ``1.5d``."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def restarts(times: int, replaced: int, ago: float) -> str:
    """A rank's restarts as its parent saw them: ``restarted 12.5s ago``,
    ``restarted 3 times, the last 12.5s ago, 1 in place of a process still
    connected`` (``replaced``: how many new processes took the place of an
    old one the parent still had a link to -- a frozen host, say -- which is
    told to stop if it ever runs again)."""
    if times < 1:
        return ""
    out = f"restarted {fsd(ago)} ago" if times == 1 \
        else f"restarted {times} times, the last {fsd(ago)} ago"
    if replaced:
        which = "" if times == 1 else f"{replaced} "
        out += f", {which}in place of a process still connected"
    return out


async def gather(h: Handle, timeout: float = 2.0) -> tuple[list[RankStatus], int]:
    """The state of every rank of the instance ``h`` is attached to, and
    the instance's fanout (to :func:`render` them)."""
    # (the rank ``h`` is attached to knows them as well as rank 0, and it
    # answers even when the way to rank 0 is held up by a torpid rank: the
    # command's timeout is then still kept)
    # (within the timeout too: a stopped or hung attached rank never
    # answers, and a health check that waits for ever checks nothing)
    try:
        async with asyncio.timeout(timeout):
            got = await asyncio.gather(*(h.attr_get(name)
                                         for name in ("size", "fanout", "hostlist")))
            size, fanout, hostlist = int(got[0]), int(got[1]), str(got[2])
    except TimeoutError:
        raise TimeoutError(f"the attached rank did not answer in {timeout:g}s "
                           "(stopped or hung?)") from None
    parents = [r for r in range(size) if topology.children_of(r, fanout, size)]
    asked = asyncio.gather(*(_ask(h, r, timeout) for r in range(size)))
    views = asyncio.gather(*(_children_view(h, r, timeout) for r in parents))
    answers, parents_views = await asyncio.gather(asked, views)
    marked: dict[int, str] = {}
    restarted: dict[int, str] = {}
    stopped: dict[int, str] = {}
    reported: dict[int, str] = {}
    unjoined: set[int] = set()
    seen_lost: dict[int, str] = {}
    for view in parents_views:
        unjoined |= view.unjoined
        seen_lost.update(view.lost)
        marked.update(view.torpid)
        restarted.update(view.restarts)
        stopped.update(view.offline)
        reported.update(view.hosts)
    statuses = classify(size, fanout, answers, marked, stopped, unjoined, seen_lost)
    statuses = name_hosts(statuses, reported, hostlist.split(",") if hostlist else [])
    return [replace(s, restarts=restarted.get(s.rank, "")) for s in statuses], fanout


def name_hosts(statuses: list[RankStatus], reported: dict[int, str],
               configured: list[str]) -> list[RankStatus]:
    """Each rank's host, where its answer did not say it: the one its
    last hello to its parent named (``reported``), else its entry of the
    bootstrap file (``configured``, by rank: the ``hostlist`` attribute;
    ignored unless it has one per rank)."""
    if len(configured) != len(statuses):
        configured = [""] * len(statuses)
    return [s if s.hostname else
            replace(s, hostname=reported.get(s.rank) or configured[s.rank])
            for s in statuses]


def classify(size: int, fanout: int, answers: list[Answer],
             marked: dict[int, str] | None = None,
             stopped: dict[int, str] | None = None,
             unjoined: set[int] | None = None,
             lost: dict[int, str] | None = None) -> list[RankStatus]:
    """From each rank's answer to its state: lost, offline or torpid, else
    partial if anything below is one of those.  ``marked``: ranks their
    parent marked torpid, with why -- torpid whatever they answered (the
    parent's view is what routes their subtree's requests).  ``stopped``:
    ranks their parent saw stop on purpose, with why: offline, if out of
    reach, and so is every rank out of reach below one (they stopped with
    it).  ``unjoined``: ranks that have not joined since their parent
    started: offline too, if out of reach, and every rank out of reach
    below one (behind it).  ``lost``: ranks their parent lost, with why
    (``its connection closed``, ``disconnected: ...``): said instead of
    the failed request's text (``rank N is unreachable``)."""
    answers = list(answers)
    unjoined = unjoined or set()
    behind: dict[int, int] = {}  # offline rank -> the unjoined rank it is (or is behind)
    for rank, why in (marked or {}).items():
        if 0 <= rank < size and not isinstance(answers[rank], str):
            answers[rank] = NoAnswer(why)
    lost_below = [False] * size
    for rank in range(size - 1, -1, -1):  # children have higher ranks than parents
        if not isinstance(answers[rank], tuple) or lost_below[rank]:
            parent = topology.parent_of(rank, fanout)
            if parent is not None:
                lost_below[parent] = True
    out: list[RankStatus] = []
    for rank, answer in enumerate(answers):  # (parents first)
        parent = topology.parent_of(rank, fanout)
        if isinstance(answer, str) and rank in (stopped or {}):
            out.append(RankStatus(rank, OFFLINE, detail=(stopped or {})[rank]))
        elif isinstance(answer, str) and rank in unjoined and parent is not None:
            behind[rank] = rank
            out.append(RankStatus(rank, OFFLINE,
                                  detail=f"not joined since rank {parent} started"))
        elif isinstance(answer, str) and parent in behind:
            behind[rank] = behind[parent]
            out.append(RankStatus(rank, OFFLINE,
                                  detail=f"behind rank {behind[parent]}, not joined"))
        elif isinstance(answer, str) and parent is not None and out[parent].state == OFFLINE:
            out.append(RankStatus(rank, OFFLINE, detail=f"stopped with rank {parent}"))
        elif isinstance(answer, str):
            out.append(RankStatus(rank, LOST, detail=(lost or {}).get(rank, answer)))
        elif isinstance(answer, NoAnswer):
            out.append(RankStatus(rank, TORPID, detail=answer.reason))
        else:
            out.append(RankStatus(rank, PARTIAL if lost_below[rank] else FULL, answer[0]))
    return out


def render(statuses: list[RankStatus], fanout: int) -> list[str]:
    """One line per rank, indented under its parent, with its host when
    known (:func:`name_hosts`):
    ``0 node0: partial`` / ``  1 node1: lost (rank 1 was lost ...)`` /
    ``  2 node2: full (restarted 4.1s ago)``."""
    lines: list[str] = []

    def walk(rank: int, depth: int) -> None:
        s = statuses[rank]
        host = f" {s.hostname}" if s.hostname else ""
        # (a rank down now restarted before it went: "restarted 15s ago"
        # beside "offline" read as if it had come back)
        said = "; before that, ".join(x for x in (s.detail, s.restarts) if x)
        why = f" ({said})" if said else ""
        lines.append(f"{'  ' * depth}{rank}{host}: {s.state}{why}")
        for child in topology.children_of(rank, fanout, len(statuses)):
            walk(child, depth + 1)

    walk(0, 0)
    return lines


def errors(statuses: list[RankStatus]) -> list[str]:
    """``overlay errors``, as ``flux overlay errors``: the ranks that are
    lost, offline or torpid, those with the same state and reason on one
    line, in rank order: ``3,7 node[3,7]: lost (rank 3 is unreachable)``.
    A partial rank is left out: its line would only say that something
    below it is one of these.  A host is named once however many of the
    line's ranks run on it (on one machine, every rank's: a 32-rank
    instance's line named it 14 times)."""
    groups: dict[tuple[str, str], list[RankStatus]] = {}
    for s in statuses:
        if s.state not in (FULL, PARTIAL):
            groups.setdefault((s.state, s.detail), []).append(s)
    lines = []
    for (state, detail), members in groups.items():
        hosts = [s.hostname for s in members]
        where = f" {encode(dict.fromkeys(hosts))}" if all(hosts) else ""
        why = f" ({detail})" if detail else ""
        lines.append(f"{encode_ranks(s.rank for s in members)}{where}: {state}{why}")
    return lines
