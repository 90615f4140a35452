"""``kvs-watch.lookup`` flags (Flux's ``FLUX_KVS_*`` values) and their rules.

The lookup flags ``READDIR``, ``READLINK`` and ``TREEOBJ`` are passed through
to ``kvs.lookup``; the others are interpreted by the kvs-watch module.  See
docs/protocol.md, section "kvs-watch".
"""

from __future__ import annotations

import errno

from broker.errors import ErrnoError

READDIR = 1
READLINK = 2
WATCH = 4
WAITCREATE = 8
TREEOBJ = 16
WATCH_FULL = 64
WATCH_UNIQ = 128
WATCH_APPEND = 256
STREAM = 512
WATCH_INITIAL_SENTINEL = 1024
WATCH_KEYS = 1 << 16
"""A kvbroker extension (far from Flux's bits): answer each commit with the
keys it wrote at or below the watched key, without looking anything up."""
WATCH_DELETES = 1 << 17
"""A kvbroker extension: with ``WATCH``, a removal of the key is answered
(``{"val": null, ...}``) and the watch goes on, waiting for the key to come
back, instead of ending with ``ENOENT`` -- etcd's DELETE event, for a
watcher (leader election) that must not start over and race the next
holder at each release.  A commit naming a directory above the key (one
unlinked or replaced: etcd's range delete) concerns such a watcher too."""

# Short names, as in docs/protocol.md, Flags.
FULL = WATCH_FULL
UNIQ = WATCH_UNIQ
APPEND = WATCH_APPEND
INITIAL_SENTINEL = WATCH_INITIAL_SENTINEL
DELETES = WATCH_DELETES

LOOKUP_FLAGS = READDIR | READLINK | TREEOBJ
"""Flags that only shape the value returned (passed to ``kvs.lookup``)."""

WATCH_ONLY = (WATCH_FULL | WATCH_UNIQ | WATCH_APPEND | WATCH_INITIAL_SENTINEL
              | WATCH_DELETES)
"""Flags that make sense only together with ``WATCH``."""

ALL = LOOKUP_FLAGS | WATCH | WAITCREATE | WATCH_ONLY | STREAM | WATCH_KEYS



STOPPING = "the watch ended: this rank is stopping"
"""How kvs-watch ends its watches (``ENOSYS``) as its rank stops: a client
that reconnects (``reconnect=True``) takes the watch up again on the rank's
next connection, as after a lost connection."""
REMOVED_PREFIX = "the watch ended: module kvs-watch was removed from rank"
REMOVED = REMOVED_PREFIX + " {rank} (module remove)"
"""How kvs-watch ends its watches (``ENOSYS``) as ``module remove`` takes
it off a rank that goes on: the client stays connected, and a watch asked
again is served once the module is loaded again (by rank 0's meanwhile,
when ``module remove`` took only this rank's).  A client that reconnects
asks again at once, and resumes."""
RELOADED_PREFIX = "the watch ended: module kvs-watch was reloaded on rank"
RELOADED = RELOADED_PREFIX + " {rank} (module reload)"
"""The same, as ``module reload`` replaces it: the new module holds none
of the old one's watches, so they end too; a watch asked again waits for
the new module (the broker holds it), and a client that reconnects asks
again at once, and resumes."""
ENDED_BY_MODULE_CHANGE = (REMOVED_PREFIX, RELOADED_PREFIX)
"""What a watch ended by ``module remove`` or ``reload`` starts with."""

def check(flags: object, streaming: bool) -> int:
    """Validate the flags of a ``kvs-watch.lookup`` request; return them.

    Raises ``EPROTO`` for a non-integer, or for ``WATCH``/``STREAM`` in a
    request that was not sent as a streaming RPC; ``EINVAL`` (with a message
    saying why) for unknown bits and for combinations Flux refuses.
    """
    if type(flags) is not int:
        raise ErrnoError(errno.EPROTO, "flags must be an integer")
    if flags & ~ALL or flags < 0:
        raise ErrnoError(errno.EINVAL, f"unknown kvs-watch flags {flags & ~ALL:#x}")
    if flags & WATCH and not streaming:
        raise ErrnoError(errno.EPROTO, "a WATCH request must be a streaming RPC")
    if flags & STREAM and not streaming:
        raise ErrnoError(errno.EPROTO, "a STREAM request must be a streaming RPC")
    if flags & WATCH and flags & STREAM:
        raise ErrnoError(errno.EINVAL, "WATCH and STREAM cannot be combined")
    if flags & WATCH_ONLY and not flags & WATCH:
        raise ErrnoError(errno.EINVAL, "FULL, UNIQ, APPEND, INITIAL_SENTINEL and DELETES "
                                       "need WATCH")
    if flags & WATCH_INITIAL_SENTINEL and not flags & WATCH_APPEND:
        raise ErrnoError(errno.EINVAL, "INITIAL_SENTINEL needs APPEND")
    if flags & WATCH_KEYS and not flags & WATCH:
        raise ErrnoError(errno.EINVAL, "KEYS needs WATCH")
    if flags & WATCH_KEYS and flags & (WATCH_ONLY | LOOKUP_FLAGS):
        raise ErrnoError(errno.EINVAL, "KEYS answers with keys, not values: FULL, UNIQ, "
                                       "APPEND, DELETES, READDIR, READLINK and TREEOBJ do "
                                       "not apply")
    if flags & (WATCH_APPEND | STREAM) and flags & (READDIR | READLINK):
        raise ErrnoError(errno.EINVAL, "APPEND and STREAM return values: READDIR and "
                                       "READLINK do not apply")
    return flags
