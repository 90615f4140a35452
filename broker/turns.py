"""Reading a stream in fair turns of the event loop.

One read from a stream socket takes up to 256 KiB: thousands of small
messages, tens of milliseconds of a rank's time, during which everyone
else's messages wait.  A :class:`TurnReader` hands its connection's
messages on at most a granted number per loop turn; the rest are held, with
the transport's reading paused, and handed on in the following turns, in
order.  The connector's client connections (64 per connection, or per
guest user: ``broker/connector.py``) and the overlay's stream links (512 per
link: ``broker/overlay_stream.py``) read this way.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

Frames = list[bytes]


class TurnReader:
    """Messages of one connection, handed to ``take`` at most ``grant(n)``
    of ``n`` per turn of the loop (``grant`` may count what it grants).

    ``pause`` stops the transport's reading while messages are held;
    ``resume`` is called once none is left (it decides whether the
    transport may read again)."""

    __slots__ = ("_take", "_grant", "_pause", "_resume", "_held")

    def __init__(self, take: Callable[[list[Frames]], None], grant: Callable[[int], int],
                 pause: Callable[[], None], resume: Callable[[], None]) -> None:
        self._take = take
        self._grant = grant
        self._pause = pause
        self._resume = resume
        self._held: deque[Frames] | None = None

    @property
    def holding(self) -> bool:
        """Messages wait for a later turn (the transport's reading is paused)."""
        return self._held is not None

    def feed(self, messages: list[Frames]) -> None:
        """The messages of one read, in order."""
        if self._held is not None:  # (read before the pause took effect)
            self._held.extend(messages)
            return
        n = self._grant(len(messages))
        if n < len(messages):
            self._held = deque(messages[n:])
            del messages[n:]
            self._pause()
            asyncio.get_running_loop().call_soon(self._next_turn)
        self._take(messages)

    def _next_turn(self) -> None:
        held = self._held
        if held is None:
            return  # dropped meanwhile
        batch = [held.popleft() for _ in range(self._grant(len(held)))]
        if held:
            asyncio.get_running_loop().call_soon(self._next_turn)
        else:
            self._held = None
        self._take(batch)
        if self._held is None:
            self._resume()

    def drop(self) -> list[Frames]:
        """Stop holding; the messages that were held (the connection goes)."""
        held, self._held = self._held, None
        return list(held or ())
