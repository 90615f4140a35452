"""The workloads of ../shared/BENCHMARKS.md, one module per group.

Each module exports ``WORKLOADS``, a list of :class:`benchmarks.harness.Workload`;
:data:`ALL` keeps them in the order of BENCHMARKS.md.
"""

from __future__ import annotations

from benchmarks.harness import Workload


def _all() -> list[Workload]:
    from benchmarks.workloads import commits, events, namespaces, reads, rpc, w0_raw, watch

    found = [w for mod in (w0_raw, rpc, commits, reads, watch, namespaces, events)
             for w in mod.WORKLOADS]
    order = ["W0", "W1", "W1b", "W2", "W2s", "W2p", "W3", "W4", "W5", "W5x", "W6"]
    return sorted(found, key=lambda w: order.index(w.id) if w.id in order else len(order))


ALL: list[Workload] = _all()
BY_ID: dict[str, Workload] = {w.id.lower(): w for w in ALL}
