"""The startlog: when an instance with a statedir ran, and whether each run
stopped cleanly (Flux's ``flux startlog``).

Rank 0 records a run's start in the statedir's content store as it starts
(on disk before any client is served) and its finish once its final KVS
checkpoint is on disk.  A run with no finish was not shut down properly:
rank 0 was killed, its host lost, or its last checkpoint could not be
written, and the commits of its last checkpoint period may have been lost.
The next start says so in its log (a WARNING, on ``start``'s stderr), and
``kvbroker startlog`` lists the runs.

Flux keeps these events in the KVS (``admin.eventlog``); here they sit in
the store beside the checkpoints (its ``runs`` table), so that a restart
adds no version to the ``primary`` namespace, no key to it, and no
checkpoint to the history a rollback chooses from, and a finish means
what it says: it is written only after the final checkpoint.

Everything here is pure: the rows come from
:meth:`broker.content.sqlite.SqliteStore.runs`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from broker.status import fsd

__all__ = ["Run", "crash_warning", "crashed", "line", "runs"]


@dataclass(frozen=True)
class Run:
    """One run of the instance, from its start to its clean finish (None:
    none yet -- the current run -- or never: :attr:`crashed`)."""

    started: float
    finished: float | None = None
    crashed: bool = False
    """It ended without a clean stop."""
    version: str = ""
    """The kvbroker version that ran it."""
    checkpoint_period: float | None = None
    """Its ``kvs.checkpoint-period`` last (None: not recorded): how much a
    crash of it may have lost."""


def runs(rows: Iterable[Sequence[Any]], *, live: bool) -> list[Run]:
    """The runs ``rows`` record (:data:`broker.content.sqlite.Row`: start,
    finish or None, version, checkpoint period or None), oldest first.
    Every run without a finish crashed, but the newest one when ``live``
    (the instance asked is running: that run is the current one)."""
    rows = list(rows)
    out = []
    for i, row in enumerate(rows):
        started, finished, version = row[:3]
        period = row[3] if len(row) > 3 else None
        current = live and i == len(rows) - 1
        out.append(Run(started, finished, finished is None and not current, version, period))
    return out


def crashed(history: list[Run]) -> bool:
    """Flux's ``startlog --check``: did a run end without a clean stop, with
    no run since then that stopped cleanly?  (A crash is forgotten once a
    later run finishes.)"""
    last_crash = max((i for i, r in enumerate(history) if r.crashed), default=-1)
    last_finish = max((i for i, r in enumerate(history) if r.finished is not None),
                      default=-1)
    return last_crash > last_finish


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def line(run: Run, now: float, *, show_version: bool = False) -> str:
    """``2026-12-05 22:40 - 2026-12-05 22:52 (12.1m)``, ``... - crashed``
    or ``... - running (3.2s)`` (the current run), as Flux's listing;
    ``show_version`` puts the run's version first, right aligned in 25
    columns."""
    head = f"{run.version:>25}  " if show_version else ""
    if run.finished is not None:
        return (f"{head}{_when(run.started)} - {_when(run.finished)} "
                f"({fsd(max(0.0, run.finished - run.started))})")
    if run.crashed:
        return f"{head}{_when(run.started)} - crashed"
    return f"{head}{_when(run.started)} - running ({fsd(max(0.0, now - run.started))})"


def crash_warning(run: Run) -> str:
    """The start's WARNING when the run before it, ``run``, did not stop
    cleanly, saying what that run's checkpoint period may have lost (Flux's
    rc1 prints "Flux was not shut down properly.  Data may have been
    lost.")."""
    period = run.checkpoint_period
    if period is None:
        lost = "the commits since its last checkpoint may have been lost"
    elif period > 0:
        lost = (f"the commits of about its last {period:g} s (its kvs.checkpoint-period) "
                "may have been lost")
    else:
        lost = ("the commits since its last SYNC commit may have been lost (its "
                "kvs.checkpoint-period was 0)")
    return (f"the instance was not shut down properly: its last run (started "
            f"{_when(run.started)}) did not stop cleanly, and {lost} (kvbroker startlog "
            "lists the runs)")
