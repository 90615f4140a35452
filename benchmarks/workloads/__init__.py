"""The workloads of the project's shared BENCHMARKS.md, one module per group.

Each module exports ``WORKLOADS``, a list of :class:`benchmarks.harness.Workload`;
:func:`all_workloads` lists them in the order of BENCHMARKS.md.  Nothing is
imported here eagerly: the helper processes (``w0_peer``, ``kvs_client``)
live in this package and should start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.harness import Workload

ORDER = ("W0", "W1", "W1b", "W2", "W2s", "W2p", "W3", "W3c", "W4", "W5", "W5x", "W5r", "W6",
         "Wgc", "Wlog", "Wcopy", "Wsync", "Wstart")


def all_workloads() -> list[Workload]:
    from benchmarks.workloads import (
        collect,
        commits,
        copies,
        durable,
        eventlog,
        events,
        namespaces,
        reads,
        rpc,
        startup,
        w0_raw,
        watch,
    )

    found = [w for mod in (w0_raw, rpc, commits, reads, watch, namespaces, events, collect,
                           eventlog, copies, durable, startup)
             for w in mod.WORKLOADS]
    return sorted(found, key=lambda w: ORDER.index(w.id) if w.id in ORDER else len(ORDER))
