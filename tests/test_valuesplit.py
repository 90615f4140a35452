"""kvs.valuesplit: a value over the blob limit cut into the blobs of a
valref -- each at most the limit, of whole lines where a line end falls in
its window (an APPEND watch decodes each blob of an eventlog alone)."""

from __future__ import annotations

import io
import math
import random

import pytest

from kvs.valuesplit import READ_BLOCK, split_value


def _split(value: bytes, limit: int) -> list[bytes]:
    return list(split_value(io.BytesIO(value).read, limit))


@pytest.mark.parametrize(("value", "limit", "parts"), [
    (b"", 4, []),
    (b"abcd", 4, [b"abcd"]),  # at the limit: one blob, line ends or not
    (b"a\nb\n", 4, [b"a\nb\n"]),
    (b"ab\ncd", 4, [b"ab\n", b"cd"]),
    (b"1\n2\n3\n4\n5\n", 4, [b"1\n2\n", b"3\n4\n", b"5\n"]),  # the most whole lines that fit
    (b"abcde", 4, [b"abcd", b"e"]),  # no line end: cut at the limit
    (b"a\nbcdefghij\n", 4, [b"a\n", b"bcde", b"fghi", b"j\n"]),  # a line over the limit
])
def test_cuts_fall_at_line_ends_where_they_can(value: bytes, limit: int,
                                               parts: list[bytes]) -> None:
    assert _split(value, limit) == parts


def test_an_eventlog_comes_out_as_whole_lines() -> None:
    lines = [b'{"timestamp":%d,"name":"ev","context":{"pad":"%s"}}\n' % (i, b"p" * (i % 300))
             for i in range(2000)]
    value = b"".join(lines)
    parts = _split(value, 4096)
    assert b"".join(parts) == value
    assert all(len(p) <= 4096 and p.endswith(b"\n") for p in parts)
    # the most whole lines that fit: the next part's first line would not
    for part, after in zip(parts[:-1], parts[1:], strict=True):
        assert len(part) + after.index(b"\n") + 1 > 4096


@pytest.mark.parametrize("newline_every", [2, 50, 3000, 10**9])
def test_any_bytes_take_at_most_twice_the_blobs(newline_every: int) -> None:
    """Whatever the bytes, at most 2 * ceil(n / limit) blobs, each at most
    the limit, joined the value: a cut short at a line end is followed by
    one that reaches the end of its window."""
    rng = random.Random(newline_every)
    value = bytes(10 if rng.randrange(newline_every) == 0 else 65 for _ in range(50_000))
    for limit in (1, 7, 256, 4096, 49_999, 50_000):
        parts = _split(value, limit)
        assert b"".join(parts) == value
        assert all(0 < len(p) <= limit for p in parts)
        assert len(parts) <= 2 * math.ceil(len(value) / limit)
    # the worst case: a line end at the start of each window
    value = (b"\n" + b"x" * 99) * 100
    assert len(_split(value, 100)) <= 2 * math.ceil(len(value) / 100)


def test_short_reads_cut_the_same() -> None:
    value = bytes(random.Random(3).choice(b"ab\n") for _ in range(5000))
    src = io.BytesIO(value)
    assert list(split_value(lambda n: src.read(min(n, 3)), 300)) == _split(value, 300)


def test_reads_are_bounded_by_the_block_not_the_value() -> None:
    """Memory: one blob and one block, whatever the value's size or the limit."""
    limit = 3 * READ_BLOCK
    src = io.BytesIO(b"z" * (2 * limit + 5))
    asked: list[int] = []

    def read(n: int) -> bytes:
        asked.append(n)
        return src.read(n)

    parts = split_value(read, limit)
    assert len(next(parts)) == limit
    assert max(asked) <= READ_BLOCK and src.tell() <= limit + READ_BLOCK  # (not all read yet)
    assert [len(p) for p in parts] == [limit, 5]


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        list(split_value(io.BytesIO(b"x").read, 0))
