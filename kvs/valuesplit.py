"""A value too big for one blob, cut into the blobs of a ``valref``.

An appended value (an eventlog, a log) grows one blob per append, so it
may be larger than ``content.blob-size-limit`` as a whole while each of
its blobs fits.  An archive (``kvs dump``) holds it as one file, without
its blob boundaries; ``kvs restore`` gives it back as a ``valref`` of
several blobs, each at most the limit -- the shape appends make -- rather
than refusing it.

Where the cuts fall matters to an eventlog: an ``APPEND`` watch (``kvs
eventlog get --watch``, ``watch_eventlog``) answers one blob at a time
and decodes each answer alone, which must be whole lines (as Flux's
``eventlog_decode``).  So each blob is the longest run of whole lines that
fits the limit, and only a line longer than the limit is cut inside (an
eventlog appended an entry at a time has none: each append is at most the
limit).  A blob cut
short at a line end is followed by one that reaches at least to the end
of the first's window, so a value of ``n`` bytes takes at most
``2 * ceil(n / limit)`` blobs, whatever its bytes.

The value is read as it is cut, in blocks of at most :data:`READ_BLOCK`:
memory holds the window being cut (the limit and one byte) and the blob
cut from it, not the value.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

__all__ = ["READ_BLOCK", "split_value"]

READ_BLOCK = 1 << 20
"""Bytes read at a time: a blob is gathered from blocks, so a read never
holds a second copy of a blob-sized buffer."""


def split_value(read: Callable[[int], bytes], limit: int) -> Generator[bytes, None, None]:
    """The blobs of the value ``read(n)`` returns (``b""`` at its end), each
    at most ``limit`` bytes and, where a line end falls in its window,
    ending at the last one (see the module docstring).  A value of at
    most ``limit`` bytes is one blob; an empty one, none."""
    if limit < 1:
        raise ValueError(f"a blob limit of {limit} bytes")
    buf = bytearray()
    while True:
        # (one byte past the limit tells a value that ends at the limit,
        # one blob, from one that goes on, to be cut)
        while len(buf) <= limit:
            block = read(min(READ_BLOCK, limit + 1 - len(buf)))
            if not block:
                if buf:
                    yield bytes(buf)
                return
            buf += block
        cut = buf.rfind(b"\n", 0, limit) + 1 or limit
        piece = bytes(memoryview(buf)[:cut])
        del buf[:cut]
        yield piece
