"""kvs-watch: watch KVS keys, driven by the kvs module's namespace events.

* :mod:`kvs_watch.module` -- the ``kvs-watch`` broker module (every rank);
* :mod:`kvs_watch.monitor` -- per-namespace state and the key index;
* :mod:`kvs_watch.watcher` -- one watch: ordered, pipelined, bounded;
* :mod:`kvs_watch.nswatch` -- one watch of namespaces (list, then follow);
* :mod:`kvs_watch.client` -- the Python API (:func:`~kvs_watch.client.watch`);
* :mod:`kvs_watch.cli` -- ``kvbroker kvs get --watch``, ``namespace watch`` and
  eventlog helpers;
* :mod:`kvs_watch.flags` -- the request flags.

See docs/api.md ("Watching keys") and docs/protocol.md ("kvs-watch").
"""

from kvs_watch.flags import (
    APPEND,
    DELETES,
    FULL,
    INITIAL_SENTINEL,
    READDIR,
    READLINK,
    STREAM,
    TREEOBJ,
    UNIQ,
    WAITCREATE,
    WATCH,
)

__all__ = [
    "APPEND",
    "DELETES",
    "FULL",
    "INITIAL_SENTINEL",
    "READDIR",
    "READLINK",
    "STREAM",
    "TREEOBJ",
    "UNIQ",
    "WAITCREATE",
    "WATCH",
]
