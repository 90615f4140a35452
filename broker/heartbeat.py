"""The ``heartbeat`` module (Flux's): rank 0 publishes ``heartbeat.pulse``
every ``heartbeat.period``; every other rank follows it and logs a WARNING,
``heartbeat overdue``, once none has come for ``heartbeat.warn_thresh``
periods, and ``heartbeat received`` when one comes again.

Why: a script or a module that wants to act on a steady beat across the
instance (a periodic sweep, a "still alive" check of rank 0 as seen from a
far rank) subscribes to one event instead of running a timer per rank; and
a rank whose events stop (rank 0 hung, or the path to it) says so in its own
log.  Loaded on demand (``-S broker.modules=content,kvs,kvs-watch,heartbeat``):
a pulse every 2 s on every rank is traffic an instance that does not use it
should not carry.

Flux's ``timeout`` (a follower that hears no pulse for that long disconnects
from its parent) is not built: a parent that stops answering is already
marked torpid (``tbon.torpid_max``), and a child that cuts itself off on a
missed event would turn a slow rank 0 into a broken tree.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

from broker.attrs import AttrSpec, duration_at_least, integer
from broker.message import Message
from broker.module import Module

TOPIC = "heartbeat.pulse"
"""The event rank 0 publishes each period (no payload), as Flux's."""

MIN_PERIOD = 0.01
"""The shortest period, in seconds: a faster pulse is a busy loop on rank 0
and an event storm on every rank."""


period = duration_at_least(MIN_PERIOD, "a pulse that fast is a busy loop")
"""A duration of at least :data:`MIN_PERIOD` seconds."""


PERIOD = AttrSpec("heartbeat.period", "2", period,
                  "seconds between two heartbeat.pulse events of rank 0 (or 100ms, 1m...)")
WARN_THRESH = AttrSpec("heartbeat.warn_thresh", "3", integer(1),
                       "pulses missed before a rank logs 'heartbeat overdue'")


class HeartbeatModule(Module):
    """Rank 0 beats; the others listen, count, and say when the beat stops."""

    name: ClassVar[str] = "heartbeat"
    attributes: ClassVar[tuple[AttrSpec, ...]] = (PERIOD, WARN_THRESH)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.period: float = PERIOD.value(ctx.attrs)
        self.warn_thresh: int = WARN_THRESH.value(ctx.attrs)
        self.count = 0
        """Pulses published (rank 0) or received (the others)."""
        self.last = time.monotonic()
        """When the last pulse came (or the module started)."""
        self.overdue = False

    async def start(self) -> None:
        if self.ctx.rank == 0:
            self.spawn(self._beat())
        else:
            self.h.subscribe(TOPIC)
            self.spawn(self._check())

    async def _beat(self) -> None:
        while True:
            self.h.publish_nowait(TOPIC)
            self.count += 1
            await asyncio.sleep(self.period)  # (the beat itself: a timer, not a wait)

    async def _check(self) -> None:
        """Each period: has the beat stopped?"""
        while True:
            await asyncio.sleep(self.period)
            silent = time.monotonic() - self.last
            if not self.overdue and silent > self.period * self.warn_thresh:
                self.overdue = True
                self.log.warning("heartbeat overdue: none from rank 0 for %.1f s "
                                 "(heartbeat.period %gs, warn_thresh %d)",
                                 silent, self.period, self.warn_thresh)

    def on_event(self, msg: Message) -> None:
        if msg.topic != TOPIC or msg.userid != self.ctx.owner_uid:
            self.events.drop("foreign")  # (a guest may not publish heartbeat.*, but)
            return
        self.events.handled += 1
        self.count += 1
        self.last = time.monotonic()
        if self.overdue:
            self.overdue = False
            self.log.warning("heartbeat received")

    def stats(self) -> dict[str, Any]:
        """Flux's fields (``period``, ``count``, ``warn_thresh``), and how
        long since the last pulse on a rank that listens."""
        out: dict[str, Any] = {"rank": self.ctx.rank, "period": self.period,
                               "warn_thresh": self.warn_thresh, "count": self.count}
        if self.ctx.rank != 0:
            out["overdue"] = self.overdue
            out["silent"] = round(time.monotonic() - self.last, 3)
            out["events"] = self.event_stats()
        return out
