"""Sets of ranks written as Flux writes them (an *idset*, RFC 22): ``0-3,5``.

Here are the two plain conversions the broker and its modules share (the
``groups`` module's members, the CLI's messages); the CLI's ``-r IDSET``
parser, which checks what a user typed, is :func:`broker.cliutil.rank_set`.
"""

from __future__ import annotations

from collections.abc import Iterable


def encode_ranks(ranks: Iterable[int]) -> str:
    """``0-3,5`` for the ranks 0, 1, 2, 3, 5 (ascending): how Flux prints an
    idset, and what :func:`decode_ranks` (and ``-r IDSET``) reads back."""
    parts: list[str] = []
    run: list[int] = []
    for r in ranks:
        if run and r == run[-1] + 1:
            run[-1] = r
            continue
        if run:
            parts.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = [r, r]
    if run:
        parts.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(parts)


def decode_ranks(text: str, limit: int) -> set[int]:
    """The ranks of ``text`` (``""`` is none), each below ``limit`` (the
    instance's size): :class:`ValueError` for anything else, ranges that do
    not ascend included."""
    out: set[int] = set()
    for item in filter(None, text.split(",")):
        lo_text, dash, hi_text = item.partition("-")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if not 0 <= lo <= hi < limit:
            raise ValueError(f"{item!r} is not a range of ranks below {limit}")
        out.update(range(lo, hi + 1))
    return out
