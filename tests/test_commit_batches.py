"""How rank 0's commit queue is cut into batches (:func:`kvs.commits.take_batch`)."""

from __future__ import annotations

from collections import deque

import msgpack

from kvs.commits import names_within, take_batch
from kvs.namespaces import Pending
from kvs.txn import MAX_OPS, NO_MERGE, SYNC


def pending(name: str, nops: int = 1, flags: int = 0) -> Pending:
    ops = [{"key": f"{name}.k{i}", "flags": 0, "dirent": None} for i in range(nops)]
    return Pending(ops, flags, name, None)  # type: ignore[arg-type]  # (no future needed)


def names(batch: list[Pending]) -> list[str]:
    return [p.name for p in batch]


def test_adjacent_transactions_of_the_same_flags_merge() -> None:
    q = deque([pending("a"), pending("b"), pending("c", flags=SYNC), pending("d", flags=SYNC),
               pending("e")])
    assert names(take_batch(q, True)) == ["a", "b"]
    assert names(take_batch(q, True)) == ["c", "d"]
    assert names(take_batch(q, True)) == ["e"]
    assert not q


def test_no_merge_and_merging_off_take_one_at_a_time() -> None:
    q = deque([pending("a", flags=NO_MERGE), pending("b", flags=NO_MERGE), pending("c")])
    assert names(take_batch(q, True)) == ["a"]
    q = deque([pending("a"), pending("b")])
    assert names(take_batch(q, False)) == ["a"]
    assert names(q) == ["b"]  # type: ignore[arg-type]


def test_a_batch_holds_at_most_max_ops() -> None:
    # one batch is applied in one go on rank 0's loop: merging stops before
    # the ops would add up past what one commit may carry
    n = MAX_OPS * 3 // 10
    q = deque([pending(f"t{j}", n) for j in range(4)])
    assert names(take_batch(q, True)) == ["t0", "t1", "t2"]
    assert names(take_batch(q, True)) == ["t3"]
    q = deque([pending("full", MAX_OPS), pending("small")])
    assert names(take_batch(q, True)) == ["full"]
    q = deque([pending("most", MAX_OPS - 1), pending("one"), pending("more")])
    assert names(take_batch(q, True)) == ["most", "one"]


def test_an_error_events_names_are_cut_into_runs_that_fit_a_link() -> None:
    """A batch failed whole (no room, a full disk) may hold thousands of
    transactions of no ops: one ``error`` event naming them all could be
    over ``tbon.max-message`` and refused, and the followers that relayed
    them never answered their clients.  The names go in runs that each
    fit, in order, none lost; one name over the room still goes alone."""
    many = [f"{rank}.{i}" for rank in range(4) for i in range(20_000)]
    room = 65_536 - 1_024
    runs = names_within(many, room)
    assert len(runs) > 1 and [n for run in runs for n in run] == many
    assert all(len(msgpack.packb(run)) <= room for run in runs)
    assert names_within([], room) == []
    assert names_within(["x" * 100, "y"], 10) == [["x" * 100], ["y"]]
