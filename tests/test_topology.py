"""The k-ary tree helpers (broker/topology.py): parent of r is (r-1)//k."""

from __future__ import annotations

import pytest

from broker import topology

SHAPES = [(1, 2), (2, 1), (4, 2), (8, 2), (13, 3), (40, 32), (7, 1)]


def test_known_tree() -> None:
    # size 8, fanout 2:      0
    #                     1     2
    #                    3 4   5 6
    #                    7
    assert [topology.parent_of(r, 2) for r in range(8)] == [None, 0, 0, 1, 1, 2, 2, 3]
    assert topology.children_of(0, 2, 8) == [1, 2]
    assert topology.children_of(3, 2, 8) == [7]
    assert topology.children_of(4, 2, 8) == []
    assert topology.children_of(7, 2, 8) == []
    assert topology.child_toward(0, 7, 2) == 1
    assert topology.child_toward(1, 7, 2) == 3
    assert topology.child_toward(3, 7, 2) == 7
    assert topology.child_toward(2, 7, 2) is None
    assert topology.child_toward(7, 7, 2) is None
    assert topology.child_toward(3, 1, 2) is None
    assert topology.subtree_size(0, 2, 8) == 8
    assert topology.subtree_size(1, 2, 8) == 4
    assert topology.subtree_size(2, 2, 8) == 3
    assert topology.subtree_size(7, 2, 8) == 1


def test_default_fanout_is_flat_for_small_instances() -> None:
    assert topology.children_of(0, 32, 8) == list(range(1, 8))


@pytest.mark.parametrize(("size", "fanout"), SHAPES)
def test_parent_and_children_agree(size: int, fanout: int) -> None:
    seen = set()
    for r in range(size):
        kids = topology.children_of(r, fanout, size)
        assert len(kids) <= fanout
        for c in kids:
            assert topology.parent_of(c, fanout) == r
        seen.update(kids)
    assert seen == set(range(1, size))  # every rank but 0 has exactly one parent


def below(rank: int, target: int, fanout: int) -> bool:
    while target > rank:
        target = (target - 1) // fanout
    return target == rank


@pytest.mark.parametrize(("size", "fanout"), SHAPES)
def test_child_toward_every_pair(size: int, fanout: int) -> None:
    for r in range(size):
        for t in range(size):
            c = topology.child_toward(r, t, fanout)
            if t != r and below(r, t, fanout):
                assert c is not None and topology.parent_of(c, fanout) == r
                assert below(c, t, fanout)
            else:
                assert c is None


@pytest.mark.parametrize(("size", "fanout"), SHAPES)
def test_subtree_sizes_add_up(size: int, fanout: int) -> None:
    for r in range(size):
        kids = topology.children_of(r, fanout, size)
        assert topology.subtree_size(r, fanout, size) == 1 + sum(
            topology.subtree_size(c, fanout, size) for c in kids
        )
        assert topology.subtree_size(r, fanout, size) == sum(
            below(r, t, fanout) for t in range(size)
        )
