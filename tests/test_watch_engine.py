"""The watcher and monitor engines, without a broker: a fake backend whose
lookups and loads the test completes by hand, in any order."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import pytest

from broker.content import blobref
from broker.errors import ErrnoError
from broker.message import Message, MsgFlags, MsgType, Role
from kvs import treeobj
from kvs_watch import flags as F
from kvs_watch.monitor import Monitor
from kvs_watch.watcher import FOLD_DEPTH, LOOKUP_WINDOW, Watcher


class FakeBackend:
    def __init__(self, max_backlog: int = 1000) -> None:
        self.max_backlog = max_backlog
        self.lookups: list[tuple[str, int, asyncio.Future[Any]]] = []
        self.loads: dict[str, list[asyncio.Future[Any]]] = {}
        self.answers: list[Any] = []
        self.error: tuple[int, str | None] | None = None
        self.ended_watchers: list[Watcher] = []
        self.roots: list[asyncio.Future[Any]] = []
        self.folds = 0
        self.afters: list[tuple[int, bytes] | None] = []
        """Each lookup's ``after`` (an APPEND watcher's), answered as the kvs would."""

    def lookup_at(self, w: Watcher, rootref: str, flags: int,
                  after: tuple[int, bytes] | None = None) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.lookups.append((rootref, flags, fut))
        self.afters.append(after)
        return fut

    def current_root(self, w: Watcher) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.roots.append(fut)
        return fut

    def load(self, ref: str) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.loads.setdefault(ref, []).append(fut)
        return fut

    def respond(self, w: Watcher, payload: Any) -> None:
        self.answers.append(payload)

    def respond_error(self, w: Watcher, errnum: int, errstr: str | None) -> None:
        self.error = (errnum, errstr)

    def ended(self, w: Watcher) -> None:
        self.ended_watchers.append(w)

    def hash_blob(self, data: bytes) -> str:
        return blobref.hash_blob(data)

    def folded(self, w: Watcher) -> None:
        self.folds += 1

    # -- test side
    def resolve(self, i: int, obj: Any = None, errnum: int = 0) -> None:
        fut = self.lookups[i][2]
        if errnum:
            fut.set_exception(ErrnoError(errnum, f"lookup failed ({errno.errorcode[errnum]})"))
        else:
            fut.set_result(self.answer(i, obj))

    def answer(self, i: int, obj: Any) -> dict[str, Any]:
        """What the kvs answers lookup ``i`` with, ``obj`` the key's value."""
        after = self.afters[i]
        if after is None or obj is None:
            return {"val": obj}
        return treeobj.value_after(obj, *after, lambda ref: None,
                                   lambda obj: blobref.hash_blob(treeobj.encode(obj)))

    def values(self) -> list[Any]:
        return [None if a is None else a["val"]["data"] for a in self.answers]


def request(flags: int = F.WATCH, userid: int = 0, owner: bool = True) -> Message:
    return Message(MsgType.REQUEST, "kvs-watch.lookup", None, matchtag=7,
                   flags=int(MsgFlags.STREAMING), userid=userid,
                   rolemask=int(Role.OWNER if owner else Role.USER), route=["c1"])


def val(data: bytes) -> dict[str, Any]:
    return {"ver": 1, "type": "val", "data": data}


def valref(*refs: str) -> dict[str, Any]:
    return {"ver": 1, "type": "valref", "data": list(refs)}


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def serve_loads(be: FakeBackend) -> None:
    """Answer every blob load, as they come, until none is left waiting."""
    while True:
        await settle()
        waiting = [fut for r, futs in be.loads.items() for fut in futs if not fut.done()]
        if not waiting:
            return
        for r, futs in be.loads.items():
            for fut in futs:
                if not fut.done():
                    fut.set_result({"data": r.encode()})


def ref(i: int) -> str:
    return blobref.hash_blob(str(i).encode())


async def test_answers_in_commit_order_when_lookups_complete_out_of_order() -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "k", F.WATCH, "primary")
    for seq in range(1, 21):
        w.push(seq, ref(seq), initial=seq == 1)
    # a bounded window of lookups in flight, pinned to each root
    assert len(be.lookups) == LOOKUP_WINDOW
    assert [r for r, _, _ in be.lookups] == [ref(s) for s in range(1, LOOKUP_WINDOW + 1)]
    for i in reversed(range(1, LOOKUP_WINDOW)):  # all but the head
        be.resolve(i, val(str(i + 1).encode()))
    await settle()
    assert be.answers == []  # the head is not done: nothing may overtake it
    be.resolve(0, val(b"1"))
    await settle()
    while len(be.answers) < 20:
        for i, (_, _, fut) in enumerate(be.lookups):
            if not fut.done():
                be.resolve(i, val(str(i + 1).encode()))
        await settle()
    assert [a["rootseq"] for a in be.answers] == list(range(1, 21))
    assert be.values() == [str(i).encode() for i in range(1, 21)]
    assert w.queue is None  # idle watchers hold no queue


async def watching_after_one_answer(ns: str = "ns", errnum: int = 0,
                                    ) -> tuple[FakeBackend, Watcher]:
    """A WATCH of ``k`` in ``ns`` whose first root's lookup is done: it
    answered ``1``, or failed ``errnum``."""
    be = FakeBackend()
    w = Watcher(be, request(), "k", F.WATCH, ns)
    w.push(1, ref(1), initial=True)
    if errnum:
        be.resolve(0, errnum=errnum)
    else:
        be.resolve(0, val(b"1"))
    await settle()
    return be, w


async def test_a_namespace_removed_ends_the_watch_after_the_roots_queued_before() -> None:
    """The removal comes after the commits it follows: their answers first,
    then ENOTSUP -- also when a root queued then turns out unreadable (its
    namespace is gone: no newer root is asked for), and at once when
    nothing is queued."""
    be, w = await watching_after_one_answer()
    w.push(2, ref(2))
    w.push(3, ref(3))
    w.fail_after_queue(errno.ENOTSUP, "namespace ns was removed")
    w.push(4, ref(4))  # (none comes after the removal; ignored if it did)
    assert be.error is None and len(be.lookups) == 3
    be.resolve(2, val(b"3"))
    be.resolve(1, val(b"2"))
    await settle()
    assert be.values() == [b"1", b"2", b"3"]
    assert be.error is not None and be.error[0] == errno.ENOTSUP and w.done

    be, w = await watching_after_one_answer()
    w.push(2, ref(2))
    w.fail_after_queue(errno.ENOTSUP, "namespace ns was removed")
    be.resolve(1, errnum=errno.ENOENT)  # its root was collected meanwhile
    await settle()
    assert be.values() == [b"1"] and be.roots == []
    assert be.error is not None and be.error[0] == errno.ENOTSUP

    be, w = await watching_after_one_answer()
    w.fail_after_queue(errno.ENOTSUP, "namespace ns was removed")
    assert be.error is not None and be.error[0] == errno.ENOTSUP and w.done

    # removed while rank 0's current root was asked for (its own was
    # collected): the answer may be a new namespace's of the same name
    be, w = await watching_after_one_answer(errnum=errno.ENOENT)
    assert len(be.roots) == 1
    w.fail_after_queue(errno.ENOTSUP, "namespace ns was removed")
    be.roots[0].set_result({"rootseq": 1, "rootref": ref(9)})
    await settle()
    assert len(be.lookups) == 1 and be.answers == []
    assert be.error is not None and be.error[0] == errno.ENOTSUP


async def test_backlog_bound_ends_the_watcher_with_eoverflow() -> None:
    be = FakeBackend(max_backlog=5)
    w = Watcher(be, request(), "k", F.WATCH, "primary")
    for seq in range(1, 7):
        w.push(seq, ref(seq))
    assert be.error is not None and be.error[0] == errno.EOVERFLOW
    assert w.done and be.ended_watchers == [w]
    for i in range(len(be.lookups)):  # late lookups are ignored
        be.resolve(i, val(b"x"))
    await settle()
    assert be.answers == []


async def test_uniq_answers_only_changes() -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "k", F.WATCH | F.UNIQ, "primary")
    for seq, v in enumerate([b"1", b"1", b"2", b"2", b"1"], start=1):
        w.push(seq, ref(seq))
        be.resolve(seq - 1, val(v))
        await settle()
    assert be.values() == [b"1", b"2", b"1"]


async def test_waitcreate_keeps_waiting_on_a_missing_key_until_a_value() -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "k", F.WATCH | F.WAITCREATE, "primary")
    w.push(1, ref(1), initial=True)
    be.resolve(0, None)  # lookup-plus: no such key (data, not an error)
    w.push(2, ref(2))
    be.resolve(1, None)
    w.push(3, ref(3))
    be.resolve(2, val(b"v"))
    await settle()
    assert be.values() == [b"v"] and not w.done
    w.push(4, ref(4))
    be.resolve(3, None)  # removed after creation: the end
    await settle()
    assert be.error is not None and be.error[0] == errno.ENOENT


async def test_a_collected_root_is_skipped_when_a_later_one_is_queued() -> None:
    """``ENOENT`` from lookup-plus: the root's blobs are gone, not the key.
    The slot is dropped, the next root answers, and the sentinel still
    follows the first value."""
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND | F.INITIAL_SENTINEL, "primary")
    w.push(1, ref(1), initial=True)
    w.push(2, ref(2))
    be.resolve(0, errnum=errno.ENOENT)
    be.resolve(1, val(b"a"))
    await settle()
    assert be.answers[0]["rootseq"] == 2 and be.values() == [b"a", None]
    assert be.roots == [] and not w.done


async def test_a_collected_last_root_is_read_again_at_rank_0s_current_root() -> None:
    """No later root queued, no monitor with a newer one: the watcher asks
    rank 0's current root and reads there; a WAITCREATE one-shot lookup
    answers from it (it waited for ever when ENOENT meant "not yet")."""
    be = FakeBackend()
    w = Watcher(be, request(), "k", F.WAITCREATE, "primary")
    w.push(1, ref(1), initial=True)
    be.resolve(0, None)  # not created yet: waits
    w.push(2, ref(2))
    be.resolve(1, errnum=errno.ENOENT)  # root 2 collected before it was read
    await settle()
    assert len(be.roots) == 1 and be.answers == [] and not w.done
    be.roots[0].set_result({"rootseq": 5, "rootref": ref(5)})
    await settle()
    assert be.lookups[-1][0] == ref(5)
    be.resolve(len(be.lookups) - 1, val(b"v"))
    await settle()
    assert be.values() == [b"v"] and be.answers[0]["rootseq"] == 5
    assert w.done and be.error == (errno.ENODATA, None)  # one-shot: done after it
    # roots up to 5 are in that answer: older ones are not queued again
    w2 = Watcher(be, request(), "k", F.WATCH, "primary")
    w2.push(3, ref(3), initial=True)
    be.resolve(len(be.lookups) - 1, errnum=errno.ENOENT)
    await settle()
    be.roots[-1].set_result({"rootseq": 7, "rootref": ref(7)})
    await settle()
    w2.push(6, ref(6))
    assert be.lookups[-1][0] == ref(7) and w2.seq == 7


async def test_a_later_root_queued_while_the_current_one_is_asked_answers() -> None:
    be, w = await watching_after_one_answer("primary", errnum=errno.ENOENT)
    assert len(be.roots) == 1
    w.push(2, ref(2))
    be.resolve(1, val(b"2"))
    await settle()
    assert be.values() == [b"2"] and be.answers[0]["rootseq"] == 2
    be.roots[0].set_result({"rootseq": 2, "rootref": ref(2)})  # late: ignored
    await settle()
    assert len(be.lookups) == 2 and not w.done


async def test_an_unreadable_current_root_ends_the_watch() -> None:
    """Rank 0's current root is no newer than the one that failed: not a
    collection (it keeps current roots) but a damaged store: the error."""
    be = FakeBackend()
    w = Watcher(be, request(), "k", F.WATCH, "primary")
    w.push(3, ref(3), initial=True)
    be.resolve(0, errnum=errno.ENOENT)
    await settle()
    be.roots[0].set_result({"rootseq": 3, "rootref": ref(3)})
    await settle()
    assert be.error is not None and be.error[0] == errno.ENOENT and w.done
    assert "cannot be read" in (be.error[1] or "")


async def test_append_answers_new_blobs_and_detects_rewrites() -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND | F.INITIAL_SENTINEL, "primary")
    assert w.lookup_flags == F.TREEOBJ
    w.push(1, ref(1), initial=True)
    be.resolve(0, val(b"a"))
    await settle()
    assert be.answers[-1] is None  # sentinel after the initial value
    # an append turned the val into [blob("a"), blob("b")]
    a, b, c = blobref.hash_blob(b"a"), blobref.hash_blob(b"b"), blobref.hash_blob(b"c")
    w.push(2, ref(2))
    be.resolve(1, valref(a, b))
    await settle()
    be.loads[b][0].set_result({"data": b"b"})
    await settle()
    w.push(3, ref(3))
    be.resolve(2, valref(a, b, c))
    await settle()
    be.loads[c][0].set_result({"data": b"c"})
    await settle()
    assert be.values() == [b"a", None, b"b", b"c"]
    assert a not in be.loads  # the initial val was not loaded again
    w.push(4, ref(4))
    be.resolve(3, valref(a, c, b))  # same length, rewritten
    await settle()
    assert be.error is not None and be.error[0] == errno.EINVAL


@pytest.mark.parametrize("new, what", [
    (lambda refs: valref(refs[0]), "rewritten with fewer blobs than were answered"),
    (lambda refs: val(b"abc"), "overwritten"),
    (lambda refs: {"ver": 1, "type": "dirref", "data": [refs[0]]}, "overwritten"),
])
async def test_append_rejects_values_not_grown_by_appends(new: Any, what: str) -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    refs = [ref(1), ref(2)]
    w.push(1, ref(1), initial=True)
    be.resolve(0, valref(*refs))
    await settle()
    for r in refs:
        be.loads[r][0].set_result({"data": r.encode()})
    await settle()
    w.push(2, ref(2))
    be.resolve(1, new(refs))
    await settle()
    assert be.error is not None and be.error[0] == errno.EINVAL and what in be.error[1]


async def test_append_lookups_ask_only_for_the_blobs_after_those_answered() -> None:
    """An APPEND watcher's lookup names the blobs it has answered (count and
    mark), so the kvs sends the new ones only; lookups sent ahead, before
    the previous versions were answered, answer from what it had then, and
    the blobs answered since must be in place (else EINVAL)."""
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    refs = [ref(i) for i in range(6)]
    w.push(1, "root-1", initial=True)
    be.resolve(0, valref(*refs[:2]))
    await settle()
    for r in refs[:2]:
        be.loads[r][0].set_result({"data": r.encode()})
    w.push(2, "root-2")
    w.push(3, "root-3")  # both sent before root 2 is answered
    assert be.afters[0] == (0, treeobj.refs_mark([], [], []))
    assert be.afters[1] == be.afters[2] == (2, treeobj.refs_mark([], [], refs[:2]))
    assert be.answer(1, valref(*refs[:4]))["val"]["data"] == refs[2:4]  # (the new only)
    be.resolve(1, valref(*refs[:4]))
    be.resolve(2, valref(*refs[:5]))  # from blob 2: refs 2, 3 answered meanwhile
    await serve_loads(be)
    assert be.values() == [r.encode() for r in refs[:5]] and be.error is None
    assert all(len(futs) == 1 for futs in be.loads.values())  # each blob loaded once
    # sent ahead again, and blob 5 (answered meanwhile) then rewritten
    w.push(4, "root-4")
    w.push(5, "root-5")
    be.resolve(3, valref(*refs[:6]))
    be.resolve(4, valref(*refs[:5], ref(99), ref(100)))
    await serve_loads(be)
    assert be.error is not None and be.error[0] == errno.EINVAL
    assert "overwritten" in be.error[1] and ref(100) not in be.loads


async def test_an_append_deletes_watcher_reads_a_key_made_again_from_its_start() -> None:
    """Lookups sent for the old value, in flight when the key was removed
    and made again, are sent again for the new one: they named the old
    value's blobs, which the new one does not have (no false EINVAL)."""
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND | F.WATCH_DELETES, "primary")
    old, new = [ref(i) for i in range(2)], [ref(i) for i in range(10, 14)]
    w.push(1, "root-1", initial=True)
    be.resolve(0, valref(*old))
    await settle()
    for r in old:
        be.loads[r][0].set_result({"data": r.encode()})
    await settle()
    for seq in (2, 3, 4):
        w.push(seq, f"root-{seq}")
    be.resolve(1, None)  # removed at root 2
    be.resolve(2, valref(*new[:3]))  # made again at 3 (asked after 2 blobs of the old)
    be.resolve(3, valref(*new))
    await settle()
    assert [a[0] for a in be.afters[4:]] == [0]  # root 3 asked again, from the start
    be.resolve(4, valref(*new[:3]))
    await serve_loads(be)
    # root 4 too, when it is read: after the new value's 3 blobs, not the old's 2
    assert be.afters[5] == (3, treeobj.refs_mark([], [], new[:3]))
    be.resolve(5, valref(*new))
    await serve_loads(be)
    assert be.error is None
    got = [a["val"] and a["val"]["data"] for a in be.answers]
    assert got == [*(r.encode() for r in old), None, *(r.encode() for r in new)]


async def test_append_loads_are_windowed_and_answered_in_order() -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    refs = [ref(i) for i in range(100)]
    w.push(1, ref(1000), initial=True)
    be.resolve(0, valref(*refs))
    await settle()
    assert len(be.loads) == 16  # LOAD_WINDOW
    while len(be.answers) < len(refs):
        pending = [r for r, futs in be.loads.items() if not futs[0].done()]
        assert 0 < len(pending) <= 16
        for r in reversed(pending):  # complete each window back to front
            be.loads[r][0].set_result({"data": r.encode()})
        await settle()
    assert be.values() == [r.encode() for r in refs]


async def test_an_append_watcher_far_behind_folds_the_roots_into_the_newest() -> None:
    """Past FOLD_DEPTH roots queued (LOOKUP_WINDOW lookups in flight, and
    one root waiting), the roots pushed become the last slot, read at the
    newest root: every blob is answered once, in order, and no EOVERFLOW
    however many roots came."""
    depth = FOLD_DEPTH
    assert depth == LOOKUP_WINDOW + 1
    be = FakeBackend()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    lines = [ref(i) for i in range(1, 401)]  # value at root n: lines[:n]
    for seq in range(1, 401):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.error is None
    assert [r for r, _, _ in be.lookups] == [f"root-{n}" for n in range(1, LOOKUP_WINDOW + 1)]
    assert be.folds == 400 - depth and w.backlog == depth

    async def load_until(n: int) -> None:
        while len(be.answers) < n:
            await settle()
            for r, futs in be.loads.items():
                if not futs[0].done():
                    futs[0].set_result({"data": r.encode()})

    for i in range(depth):
        while len(be.lookups) <= i:
            await settle()
        n = i + 1 if i < depth - 1 else 400
        assert be.lookups[i][0] == f"root-{n}"
        be.resolve(i, valref(*lines[:n]))
        await load_until(n)
    assert len(be.lookups) == depth
    assert all(len(futs) == 1 for futs in be.loads.values())  # each blob loaded once
    assert be.values() == [r.encode() for r in lines]
    assert [a["rootseq"] for a in be.answers] == [*range(1, depth), *[400] * (401 - depth)]
    assert be.error is None and not w.done and w.backlog == 0


async def _serve(be: FakeBackend, value_at: Any, until: Any) -> None:
    """Answer every lookup (``value_at(n)`` for ``root-n``) and blob load
    as they come, until ``until()``."""
    while not until():
        await settle()
        for i, (ref, _, fut) in enumerate(be.lookups):
            if not fut.done():
                fut.set_result(be.answer(i, value_at(int(ref.split("-")[1]))))
        for ref, futs in be.loads.items():
            for fut in futs:
                if not fut.done():
                    fut.set_result({"data": ref.encode()})


async def test_an_append_watcher_with_a_small_backlog_bound_folds_too() -> None:
    """With ``max_backlog`` at most LOOKUP_WINDOW every queued root had its
    lookup sent, none was left to fold into, and the watcher ended
    EOVERFLOW: it now queues one more, past the bound, and folds into it."""
    be = FakeBackend(max_backlog=5)
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    lines = [ref(i) for i in range(1, 31)]
    for seq in range(1, 31):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.error is None and be.folds == 30 - LOOKUP_WINDOW - 1
    assert w.backlog == LOOKUP_WINDOW + 1
    await _serve(be, lambda n: valref(*lines[:n]), lambda: len(be.answers) == 30)
    assert be.values() == [r.encode() for r in lines] and be.error is None


async def test_a_rewrite_seen_at_a_folded_root_answers_the_lines_before_it_first() -> None:
    """The newest root folded into a slot shows the value rewritten: the
    lines committed before the rewrite, in the roots folded in, were lost
    (the watch ended at once).  Now those roots are read one by one, in
    order, and the watch ends EINVAL where it would have without folding."""
    be = FakeBackend(max_backlog=20)
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    lines = [ref(i) for i in range(1, 101)]

    def value_at(n: int) -> dict[str, Any]:  # rewritten at root 90
        return valref(*lines[:n]) if n < 90 else val(b"rewritten")

    for seq in range(1, 101):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.folds == 100 - FOLD_DEPTH
    await _serve(be, value_at, lambda: be.error is not None)
    assert be.values() == [r.encode() for r in lines[:89]]
    assert be.error[0] == errno.EINVAL and "overwritten" in be.error[1]
    assert [a["rootseq"] for a in be.answers][-3:] == [87, 88, 89]


async def test_a_watcher_its_own_answer_ends_answers_nothing_more() -> None:
    """Sending an answer can end the watcher at once (a stream cut at a
    link's message limit cancels it; a client dropped): nothing may follow
    the error -- the initial sentinel went out after it."""
    class Cutting(FakeBackend):
        def respond(self, w: Watcher, payload: Any) -> None:
            super().respond(w, payload)
            w.fail(errno.EMSGSIZE, "cut")

    be = Cutting()
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND | F.WATCH_INITIAL_SENTINEL, "primary")
    w.push(1, ref(1), initial=True)
    be.resolve(0, val(b"x"))
    await settle()
    assert be.values() == [b"x"] and be.error == (errno.EMSGSIZE, "cut") and w.done


async def test_a_folded_root_collected_while_unfolding_reads_on_from_the_newer_root() -> None:
    """Unfolding (the newest root folded in shows the key missing), one of
    the roots still to read was collected: the slot is read at rank 0's
    newer current root instead -- and then went back to the older roots
    it had still to read, older versions after a newer one, which ended
    the watch ``EINVAL`` ("fewer blobs") though nothing was rewritten
    (found by a review).  The newer root holds them: they are not read."""
    be = FakeBackend(max_backlog=1000)
    w = Watcher(be, request(), "log", F.WATCH | F.APPEND, "primary")
    lines = [ref(i) for i in range(1, 41)]

    def value_at(n: int) -> dict[str, Any] | None:  # missing at root 30 only
        return None if n == 30 else valref(*lines[:n])

    for seq in range(1, 31):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.folds > 0
    for _ in range(200):
        await settle()
        for i, (rootref, _, fut) in enumerate(be.lookups):
            if not fut.done():
                if rootref == "root-12":  # collected meanwhile
                    be.resolve(i, errnum=errno.ENOENT)
                else:
                    fut.set_result(be.answer(i, value_at(int(rootref.split("-")[1]))))
        for root in be.roots:
            if not root.done():
                root.set_result({"rootseq": 40, "rootref": "root-40"})
        for blob, futs in be.loads.items():
            for fut in futs:
                if not fut.done():
                    fut.set_result({"data": blob.encode()})
        if w.backlog == 0 or be.error is not None:
            break
    assert be.error is None, be.error
    assert be.values() == [r.encode() for r in lines]
    assert [a["rootseq"] for a in be.answers] == [*range(1, 12), *[40] * 29]
    assert not w.done and w.seq == 40


async def test_a_key_made_and_removed_in_folded_roots_is_answered_before_waitcreate_ends(
        ) -> None:
    """A WAITCREATE append watcher that has answered nothing folds roots
    in which the key was created, appended to and removed: the newest root
    shows it missing, which it took for "not created yet" -- every line
    was lost and the watch waited for ever.  Now the folded roots are read
    one by one, as without folding: each line, then ``ENOENT``."""
    be = FakeBackend(max_backlog=1000)
    w = Watcher(be, request(), "log", F.WATCH | F.WAITCREATE | F.APPEND, "primary")
    lines = [ref(i) for i in range(1, 7)]

    def value_at(n: int) -> dict[str, Any] | None:  # made at 10, appended to 15, gone at 16
        return valref(*lines[:n - 9]) if 10 <= n <= 15 else None

    for seq in range(1, 21):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.folds > 0
    await asyncio.wait_for(_serve(be, value_at, lambda: be.error is not None), 10)
    assert be.values() == [r.encode() for r in lines]
    assert [a["rootseq"] for a in be.answers] == list(range(10, 16))
    assert be.error[0] == errno.ENOENT, be.error


async def test_a_waitcreate_watcher_folding_a_key_that_stays_missing_keeps_waiting() -> None:
    """The same watcher when the key never appears in the roots folded:
    read one by one, all missing, it goes on waiting (no answer, no
    error), and answers the key once it is made."""
    be = FakeBackend(max_backlog=1000)
    w = Watcher(be, request(), "log", F.WATCH | F.WAITCREATE | F.APPEND, "primary")
    for seq in range(1, 21):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.folds > 0
    await asyncio.wait_for(_serve(be, lambda n: None, lambda: w.backlog == 0), 10)
    assert be.answers == [] and be.error is None and not w.done
    w.push(21, "root-21")
    await asyncio.wait_for(_serve(be, lambda n: valref(ref(1)) if n == 21 else None,
                                  lambda: len(be.answers) == 1), 10)
    assert be.values() == [ref(1).encode()] and be.error is None


@pytest.mark.parametrize("flags", [F.WATCH, F.WATCH | F.APPEND | F.WATCH_DELETES])
async def test_watchers_that_answer_each_version_do_not_fold(flags: int) -> None:
    """A plain watcher answers every version, and an APPEND watcher with
    DELETES must see a removal between two versions: they queue every root
    and end EOVERFLOW past the bound."""
    be = FakeBackend(max_backlog=FOLD_DEPTH + 5)
    w = Watcher(be, request(), "log", flags, "primary")
    for seq in range(1, FOLD_DEPTH + 6):
        w.push(seq, f"root-{seq}", initial=seq == 1)
    assert be.error is None and be.folds == 0 and w.backlog == FOLD_DEPTH + 5
    w.push(FOLD_DEPTH + 6, "root-x")
    assert be.error is not None and be.error[0] == errno.EOVERFLOW


async def test_stream_ends_after_the_value_and_one_shot_after_one_answer() -> None:
    be = FakeBackend()
    w = Watcher(be, request(), "big", F.STREAM, "primary")
    w.push(1, ref(1), initial=True)
    be.resolve(0, valref(ref(5), ref(6)))
    await settle()
    be.loads[ref(6)][0].set_result({"data": b"6"})
    be.loads[ref(5)][0].set_result({"data": b"5"})
    await settle()
    assert be.values() == [b"5", b"6"] and be.error == (errno.ENODATA, None)
    be2 = FakeBackend()
    w2 = Watcher(be2, request(), "k", F.WAITCREATE, "primary")
    w2.push(1, ref(1), initial=True)
    be2.resolve(0, val(b"x"))
    await settle()
    assert be2.values() == [b"x"] and w2.done and be2.error == (errno.ENODATA, None)


async def test_monitor_key_index_matches_key_descendants_and_root() -> None:
    be = FakeBackend()
    mon = Monitor("ns")
    mon.set_root(0, ref(0), 0)
    ws = {k: Watcher(be, request(), k, F.WATCH, "ns") for k in ("a", "a.b", "a.bc", ".", "x")}
    full = Watcher(be, request(), "zz", F.WATCH | F.FULL, "ns")
    for w in [*ws.values(), full]:
        mon.add(w)
    got = mon.concerned(["a.b.c"])
    assert set(got) == {ws["a"], ws["a.b"], ws["."], full}
    assert set(mon.concerned(["a.bcd"])) == {ws["a"], ws["."], full}
    assert set(mon.concerned(["y"])) == {ws["."], full}
    mon.remove(ws["."])
    assert set(mon.concerned(["q"])) == {full}
    assert len(mon) == 5


async def test_monitor_deletes_watchers_are_concerned_by_their_ancestors_only() -> None:
    """A DELETES watcher of ``a.b.c`` is found for a commit naming ``a`` or
    ``a.b`` (which may have removed its key), not for one naming a key that
    only shares a prefix; a plain watcher of the same key is not (Flux);
    the ancestor index is dropped with the last DELETES watcher."""
    be = FakeBackend()
    mon = Monitor("ns")
    mon.set_root(0, ref(0), 0)
    d1, d2 = (Watcher(be, request(), "a.b.c", F.WATCH | F.DELETES, "ns") for _ in range(2))
    plain = Watcher(be, request(), "a.b.c", F.WATCH, "ns")
    for w in (d1, d2, plain):
        mon.add(w)
    assert set(mon.concerned(["a.b"])) == set(mon.concerned(["a"])) == {d1, d2}
    assert set(mon.concerned(["a.b.c"])) == {d1, d2, plain}
    for unrelated in ("a.bc", "a.b.cd", "a.b.d", "ab", "b", "a.x.c"):
        assert mon.concerned([unrelated]) == [], unrelated
    mon.remove(d1)
    assert mon.concerned(["a.b"]) == [d2]
    mon.remove(d2)
    assert mon.above is None and mon.concerned(["a"]) == [] and len(mon) == 1


async def test_monitor_index_several_watchers_of_one_key() -> None:
    be = FakeBackend()
    mon = Monitor("ns")
    mon.set_root(0, ref(0), 0)
    a, b, c = (Watcher(be, request(), "k", F.WATCH, "ns") for _ in range(3))
    for w in (a, b, c):
        mon.add(w)
    assert set(mon.concerned(["k"])) == {a, b, c}
    mon.remove(b)
    assert set(mon.concerned(["k"])) == {a, c}
    mon.remove(a)
    assert mon.concerned(["k"]) == [c] and mon.by_key["k"] is c
    mon.remove(c)
    assert mon.concerned(["k"]) == [] and not mon.by_key and not mon.watchers
    once = Watcher(be, request(), "k", F.STREAM, "ns")  # no updates wanted: not indexed
    mon.add(once)
    assert mon.concerned(["k"]) == [] and len(mon) == 1


async def test_monitor_of_one_key_watcher_holds_no_empty_sets() -> None:
    """Memory per namespace: the full, WATCH_KEYS and parked sets exist only while used."""
    be = FakeBackend()
    mon = Monitor("ns")
    early = Watcher(be, request(), "k", F.WATCH, "ns")
    gone = Watcher(be, request(), "k", F.WATCH, "ns")
    mon.add(early)
    mon.add(gone)
    assert mon.waiting is not None and set(mon.waiting) == {early, gone}
    mon.remove(gone)  # a parked watcher that goes away is not started later
    assert mon.set_root(0, ref(0), 0) == [early]
    mon.start(early)
    assert mon.waiting is None and mon.full is None and mon.keyed is None
    assert mon.concerned(["k"]) == [early]
    full = Watcher(be, request(), "zz", F.WATCH | F.FULL, "ns")
    mon.add(full)
    assert mon.full == {full: None} and set(mon.concerned(["q"])) == {full}
    mon.remove(full)
    assert mon.concerned(["q"]) == [] and mon.keyed is None


async def test_guest_needs_the_namespace_owner() -> None:
    be = FakeBackend()
    mon = Monitor("ns")
    guest = Watcher(be, request(userid=1234, owner=False), "k", F.WATCH, "ns")
    mon.add(guest)
    mon.set_root(1, ref(1), 99)
    mon.start(guest)
    assert be.error is not None and be.error[0] == errno.EPERM
    be2 = FakeBackend()
    mine = Watcher(be2, request(userid=99, owner=False), "k", F.WATCH, "ns")
    mon.add(mine)
    assert be2.error is None and len(be2.lookups) == 1


@pytest.mark.parametrize("flags, streaming, expect", [
    (F.WATCH, False, errno.EPROTO),
    (F.STREAM, False, errno.EPROTO),
    (F.WATCH | F.STREAM, True, errno.EINVAL),
    (F.FULL, True, errno.EINVAL),
    (F.UNIQ, True, errno.EINVAL),
    (F.APPEND, True, errno.EINVAL),
    (F.WATCH | F.INITIAL_SENTINEL, True, errno.EINVAL),
    (F.WATCH | F.APPEND | F.READDIR, True, errno.EINVAL),
    (1 << 20, True, errno.EINVAL),
    (F.WAITCREATE, False, 0),
    (F.WATCH | F.APPEND | F.INITIAL_SENTINEL | F.WAITCREATE, True, 0),
    (F.WATCH_KEYS, True, errno.EINVAL),
    (F.WATCH | F.WATCH_KEYS | F.UNIQ, True, errno.EINVAL),
    (F.WATCH | F.WATCH_KEYS | F.READDIR, True, errno.EINVAL),
    (F.WATCH | F.WATCH_KEYS | F.WAITCREATE, True, 0),
])
async def test_flag_rules(flags: int, streaming: bool, expect: int) -> None:
    try:
        F.check(flags, streaming)
    except ErrnoError as exc:
        assert exc.errnum == expect, exc
        assert exc.errstr
    else:
        assert expect == 0


async def test_key_watcher_answers_with_the_keys_at_below_or_above_it() -> None:
    """WATCH_KEYS looks nothing up: a first answer naming the root, then
    each commit's keys at or below the watched key, or a directory above
    it; commits without such keys are not answered."""
    be, be_root = FakeBackend(), FakeBackend()
    mon = Monitor("ns")
    mon.set_root(1, ref(1), 0)
    w = Watcher(be, request(), "a.b", F.WATCH | F.WATCH_KEYS, "ns")
    root = Watcher(be_root, request(), ".", F.WATCH | F.WATCH_KEYS, "ns")
    mon.add(w)
    mon.add(root)
    assert be.answers == [{"keys": [], "rootseq": 1, "rootref": ref(1), "namespace": "ns"}]
    commits = [["a.b.c", "x", "a.bc", "a.b"], ["x", "a.bc"], ["a"], ["a.b.c"]]
    for seq, keys in enumerate(commits, start=2):
        mon.set_root(seq, ref(seq), 0)
        assert mon.concerned(keys) == []  # (not in the key index)
        for kw in mon.keyed:
            kw.push_keys(seq, ref(seq), keys)
    assert [(a["rootseq"], a["keys"]) for a in be.answers[1:]] == [
        (2, ["a.b.c", "a.b"]), (4, ["a"]), (5, ["a.b.c"])]
    assert [(a["rootseq"], a["keys"]) for a in be_root.answers[1:]] == [
        (s, k) for s, k in enumerate(commits, start=2)]
    root.push_keys(6, ref(6), [])  # an empty commit (kvs sync, conditions only)
    assert len(be_root.answers) == 5  # ... is no change: the first answer alone has no keys
    w.push_keys(5, ref(5), ["a.b.c"])  # an old root again: ignored
    assert be.lookups == [] and len(be.answers) == 4
    mon.remove(w)
    assert list(mon.keyed) == [root]
