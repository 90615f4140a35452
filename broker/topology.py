"""The k-ary tree of ranks (TBON): rank 0 is the root, parent of r is (r-1)//k."""

from __future__ import annotations


def parent_of(rank: int, fanout: int) -> int | None:
    return None if rank == 0 else (rank - 1) // fanout


def ancestors(rank: int, fanout: int) -> list[int]:
    """The ranks above ``rank``, its parent first and rank 0 last."""
    out: list[int] = []
    parent = parent_of(rank, fanout)
    while parent is not None:
        out.append(parent)
        parent = parent_of(parent, fanout)
    return out


def children_of(rank: int, fanout: int, size: int) -> list[int]:
    first = rank * fanout + 1
    return list(range(first, min(first + fanout, size)))


def child_toward(rank: int, target: int, fanout: int) -> int | None:
    """The child of ``rank`` on the path down to ``target``, or None if
    ``target`` is not below ``rank``."""
    while target > rank:
        parent = (target - 1) // fanout
        if parent == rank:
            return target
        target = parent
    return None


def subtree_size(rank: int, fanout: int, size: int) -> int:
    """How many ranks are in the subtree rooted at ``rank`` (itself included)."""
    count, level = 0, [rank]
    while level:
        count += len(level)
        level = [c for r in level for c in children_of(r, fanout, size)]
    return count
