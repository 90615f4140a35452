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
PRIMARY = "primary"
"""The namespace a command uses by default (:func:`kvs.client.default_namespace`)."""
MAX_NS_NAME = 255
"""Most characters of a namespace name (:func:`kvs.namespaces.check_name`)."""
MAX_DEPTH = 256
"""Most levels a commit may write at: the path components of its key plus
the levels of directories its dirent nests.  Applying a commit walks the
tree recursively, and unbounded depth would exhaust Python's recursion
limit (an EIO and a traceback per commit); this is far more than any real
key needs."""
MAX_NAME = 1024
"""Most bytes (UTF-8) one component of a key a commit writes may have.

Every name is stored in its directory's blob, which each later commit to
that directory rewrites and which every read through it loads, and the keys
a commit writes travel in its ``setroot`` event to every rank: a 10 MB name
(accepted before this limit) cost that on every commit below it.  1 KiB is
four times Linux's ``NAME_MAX`` and as long as a whole S3 or Cloud Storage
object key: no reasonable name is refused.  ``ENAMETOOLONG`` past it."""
MAX_KEY = 8192
"""Most bytes (UTF-8) of a normalised key a commit writes (``ENAMETOOLONG``
past it): twice Linux's ``PATH_MAX``, for the same reasons as
:data:`MAX_NAME` (which alone would let 256 levels reach 256 KiB).

Both limits bound what a commit *creates* (the key of a put, append, mkdir
or symlink, a symlink's target, the names inside a ``dir`` dirent).  Reads,
watches, conditions and unlinks take any key, so whatever was stored under
a longer one before (an older statedir) stays readable and removable."""
SHOWN = 32
"""Characters of an overlong key an error message shows."""


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


def shown(key: str) -> str:
    """``key`` as an error message names it: whole if it is no longer than
    :data:`MAX_KEY` characters, else its first :data:`SHOWN` and ``...``.

    Reads, conditions and unlinks take keys of any length (up to a
    message's size), and an error naming such a key whole sent it back in
    the answer -- a megabyte for a megabyte's key -- as the CLI printed it
    whole.  A key a commit could have written is shown whole."""
    return key if len(key) <= MAX_KEY else key[:SHOWN] + "..."


def _utf8_len(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (a lone surrogate counted as 3)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _too_long(key: str, what: str, size: int, limit: int, unit: str = "bytes") -> ErrnoError:
    start = key[:SHOWN] + ("..." if len(key) > SHOWN else "")
    return ErrnoError(errno.ENAMETOOLONG, f"{start}: {what} of {size} {unit} exceeds the "
                                          f"limit of {limit} {unit}")


def check_length(key: str, what: str = "key") -> None:
    """``ENAMETOOLONG`` unless every component of ``key`` fits
    :data:`MAX_NAME` and the normalised key :data:`MAX_KEY` (for a key a
    commit writes; ``what`` names it in the message).

    The message shows only the start of the key: echoing a key of many
    megabytes back would cost what refusing it saves.  A short key is
    passed at once, without splitting it (every commit's every op comes
    here)."""
    n = len(key)
    if n <= MAX_NAME // 4 or (n <= MAX_NAME and key.isascii()):
        return
    parts = split(key)
    for part in parts:
        # (a str of more characters than the limit has more bytes: not encoded)
        size = len(part) if len(part) > MAX_NAME else _utf8_len(part)
        if size > MAX_NAME:
            raise _too_long(key, f"{what} component", size, MAX_NAME)
    size = sum(map(_utf8_len, parts)) + max(len(parts) - 1, 0)
    if size > MAX_KEY:
        raise _too_long(key, what, size, MAX_KEY)


def check_target_length(target: str, namespace: str | None) -> None:
    """:func:`check_length` for a symlink's ``target`` as stored, which is
    not normalised (the ``NS::`` of ``NS::key`` aside, held to a namespace
    name's 255 characters): its text as given must fit :data:`MAX_KEY`."""
    if namespace is None:
        namespace, target = parse_ns_target(target)
    if namespace is not None and len(namespace) > MAX_NS_NAME:
        raise _too_long(namespace, "symlink namespace", len(namespace), MAX_NS_NAME,
                        "characters")
    check_length(target, "symlink target")
    size = len(target) if len(target) > MAX_KEY else _utf8_len(target)
    if size > MAX_KEY:
        raise _too_long(target, "symlink target", size, MAX_KEY)


def parse_ns_target(target: str) -> tuple[str | None, str]:
    """Split a symlink target ``"NS::key"`` into ``(NS, key)``.

    A target without ``::`` (or with an empty namespace part) is
    ``(None, target)``: it resolves in the link's own namespace.
    """
    ns, sep, rest = target.partition(NS_SEP)
    if sep and ns:
        return ns, rest
    return None, target
