"""KVS keys: ``.``-separated paths, normalised as Flux does.

Repeated, leading and trailing dots are dropped, so ``"..a..b."`` is
``"a.b"``; a key with no components (``""``, ``"."``, ``"..."``) is the
root directory, spelled ``"."``.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable

from broker.errors import ErrnoError

ROOT = "."
NS_SEP = "::"
MAX_DEPTH = 256
"""Most levels a commit may write at: the path components of its key plus
the levels of directories its dirent nests.  Applying a commit walks the
tree recursively, and unbounded depth would exhaust Python's recursion
limit (an EIO and a traceback per commit); this is far more than any real
key needs."""


def split(key: str) -> list[str]:
    """Path components of ``key``; ``[]`` for the root."""
    return [p for p in key.split(".") if p]


def join(parts: Iterable[str]) -> str:
    """Inverse of :func:`split`: ``[]`` gives ``"."``."""
    return ".".join(parts) or ROOT


def normalize(key: str) -> str:
    """The canonical spelling of ``key``."""
    return join(split(key))


def check_key(key: object) -> str:
    """Return ``key`` normalised; ``EINVAL`` if it is not a string.

    The empty string is accepted and means the root, as in Flux.
    """
    if not isinstance(key, str):
        raise ErrnoError(errno.EINVAL, f"key must be a string, not {type(key).__name__}")
    if "\0" in key:
        raise ErrnoError(errno.EINVAL, "key contains a NUL character")
    return normalize(key)


def parse_ns_target(target: str) -> tuple[str | None, str]:
    """Split a symlink target ``"NS::key"`` into ``(NS, key)``.

    A target without ``::`` (or with an empty namespace part) is
    ``(None, target)``: it resolves in the link's own namespace.
    """
    ns, sep, rest = target.partition(NS_SEP)
    if sep and ns:
        return ns, rest
    return None, target
