"""Flux's human-readable times (``flux dmesg -H``, ``flux overlay trace -H``,
``flux kvs eventlog get -H``, after util-linux's ``dmesg -H``): the first
time of each minute says when, in the local time zone (``[Dec03 14:02]``),
the others their seconds since it (``[  +0.012345]``), or, with ``delta``,
since the one before."""

from __future__ import annotations

import time

MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov",
          "Dec")


class HumanClock:
    """Keeps the minute last printed: one per output stream."""

    def __init__(self, delta: bool = False) -> None:
        self.delta = delta
        self._minute: tuple[int, ...] | None = None
        self._since = 0.0

    def stamp(self, t: float) -> tuple[str, bool]:
        """``t`` as printed, and whether it begins a new minute (Flux shows
        those in bold)."""
        try:
            tm = time.localtime(t)
        except (OverflowError, OSError, ValueError):  # no date: 1e300, say
            return f"[{t!r}]", False
        minute = tm[:5]
        if minute != self._minute:
            self._minute = minute
            self._since = t
            return (f"[{MONTHS[tm.tm_mon - 1]}{tm.tm_mday:02d} "
                    f"{tm.tm_hour:02d}:{tm.tm_min:02d}]"), True
        text = f"[{t - self._since:+11.6f}]"
        if self.delta:
            self._since = t
        return text, False
