"""Blobrefs: ``<hash>-<hexdigest>`` names of content-addressed blobs.

The hash is the instance attribute ``content.hash`` (``sha256`` by default,
``sha1`` allowed), as in Flux RFC 10.
"""

from __future__ import annotations

import errno
import hashlib
import re
from typing import Any, TypeGuard

from broker.errors import ErrnoError

HASHES = {"sha1": 40, "sha256": 64}
DEFAULT_HASH = "sha256"

_BLOBREF_RE = re.compile(r"(sha1|sha256)-([0-9a-f]+)")

# The constructors themselves, not ``hashlib.new(name)``: that goes through
# a Python-level wrapper, ~0.35 us of the ~1-2.5 us a tree object's hash
# takes, and rank 0 hashes ~3 new tree objects per commit.
_CONSTRUCTORS = {name: getattr(hashlib, name) for name in HASHES}


def hash_blob(data: bytes | bytearray | memoryview, hash_name: str = DEFAULT_HASH) -> str:
    """Return the blobref of ``data`` under ``hash_name``."""
    make = _CONSTRUCTORS.get(hash_name)
    if make is None:
        raise ValueError(f"unsupported content hash {hash_name!r}")
    return f"{hash_name}-{make(data).hexdigest()}"


def matches(ref: str, data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` is what blobref ``ref`` names: bytes read from a
    store are checked so before they are trusted (a value served, a
    directory walked by a collection)."""
    return hash_blob(data, ref.partition("-")[0]) == ref


def damaged(ref: str) -> ErrnoError:
    """``EIO`` for blob ``ref`` read from a store with bytes that do not
    :func:`match <matches>` it: damage on disk, never served as a value."""
    return ErrnoError(errno.EIO, f"blob {ref} is damaged in the content store: its bytes "
                                 "do not match their hash")


def is_valid(ref: object) -> TypeGuard[str]:
    """True when ``ref`` is a well-formed blobref string."""
    if not isinstance(ref, str):
        return False
    m = _BLOBREF_RE.fullmatch(ref)
    return m is not None and len(m.group(2)) == HASHES[m.group(1)]


def check(ref: object) -> str:
    """Return ``ref`` if it is a well-formed blobref, else raise ``EINVAL``."""
    if not is_valid(ref):
        raise ErrnoError(errno.EINVAL, f"invalid blobref: {ref!r}")
    return ref


def too_big(size: int, limit: int) -> ErrnoError:
    """``EFBIG`` for a blob of ``size`` bytes over ``content.blob-size-limit``
    (``limit``): one message wherever it is refused -- by the content module,
    or early by the kvs module of the rank a commit enters, which saw the
    value in the request and need not send it up the tree to be refused."""
    return ErrnoError(errno.EFBIG, f"blob of {size} bytes exceeds "
                                   f"content.blob-size-limit ({limit})")


def found_in(value: Any) -> list[str]:
    """Every blobref in a decoded value (a checkpoint's): strings (or ASCII bytes)
    anywhere in it, map keys included.  Iterative: a value may nest deeper
    than Python's recursion limit."""
    found: list[str] = []
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, (bytes, bytearray)) and len(v) <= 200:
            v = bytes(v).decode("ascii", "replace")
        if is_valid(v):
            found.append(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return found
