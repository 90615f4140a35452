"""Pure parts of :class:`kvs.namespaces.Namespace`: the transactions a
follower relayed, settled by the events that name them."""

from __future__ import annotations

import errno

import pytest

from broker.errors import ErrnoError
from kvs.namespaces import Namespace


async def test_finish_settles_only_the_named_transactions() -> None:
    ns = Namespace("job-1", owner=0, rootref="r0", rootseq=0)
    a, b = ns.expect("3.1"), ns.expect("3.2")
    ns.set_root(1, "r1")
    ns.finish(["1.7", "3.1", 42], 1, "r1")  # others' names and junk are ignored
    assert a.result() == (1, "r1")
    assert not b.done() and list(ns.relayed) == ["3.2"]


async def test_fail_carries_errno_and_message() -> None:
    ns = Namespace("job-1", owner=0, rootref="r0", rootseq=0)
    a = ns.expect("3.1")
    ns.fail(["3.1"], errno.EISDIR, "d is a directory")
    with pytest.raises(ErrnoError) as info:
        a.result()
    assert (info.value.errnum, info.value.errstr) == (errno.EISDIR, "d is a directory")
    assert ns.relayed == {}


async def test_remove_fails_relayed_and_refuses_new_ones() -> None:
    ns = Namespace("job-1", owner=0, rootref="r0", rootseq=0)
    a = ns.expect("3.1")
    ns.remove()
    with pytest.raises(ErrnoError) as info:
        await a
    assert info.value.errnum == errno.ENOTSUP
    assert ns.relayed == {}
    with pytest.raises(ErrnoError):
        ns.expect("3.2")
