"""broker.idset: ranks to Flux's idset text and back (pure)."""

from __future__ import annotations

import pytest

from broker.idset import decode_ranks, encode_ranks


@pytest.mark.parametrize(("ranks", "text"), [
    ([], ""), ([0], "0"), ([0, 1, 2, 3], "0-3"), ([0, 2], "0,2"), ([1, 2, 5, 7, 8], "1-2,5,7-8"),
])
def test_encode_and_decode_agree(ranks: list[int], text: str) -> None:
    assert encode_ranks(ranks) == text
    assert decode_ranks(text, 16) == set(ranks)


@pytest.mark.parametrize("bad", ["x", "3-1", "-1", "0-16", "16", "1-", "a-b"])
def test_decode_refuses_what_is_not_ranks_of_the_instance(bad: str) -> None:
    with pytest.raises(ValueError):
        decode_ranks(bad, 16)
