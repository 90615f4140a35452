"""``overlay.trace``: a summary of every message a rank's overlay sends and
receives, streamed to the clients that asked (``kvbroker overlay trace``, as
``flux overlay trace``).

The overlay calls :meth:`OverlayTrace.note` from its send and receive paths
only while someone traces (:attr:`broker.overlay.Overlay.tracer` is None
otherwise: one attribute test per message).  A trace's own answers are
never traced: a tracer attached through the overlay (``nodeid`` another
rank) would otherwise have each answer's sending traced, and answered, for
ever.
"""

from __future__ import annotations

import errno
import fnmatch
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from broker import codec
from broker.errors import ErrnoError, ProtocolError
from broker.message import Message, MsgFlags, MsgType

TOPIC = "overlay.trace"
ALL_TYPES = MsgType.REQUEST | MsgType.RESPONSE | MsgType.EVENT | MsgType.CONTROL

Key = tuple[tuple[str, ...], int]
"""A trace request's route and matchtag."""


@dataclass
class _Tracer:
    request: Message
    typemask: int
    topic: re.Pattern[str]
    peer: int  # -1: any
    full: bool


class OverlayTrace:
    """The rank's trace requests and what answers them.  ``respond`` sends
    one answer to a request (the services' handle)."""

    def __init__(self, respond: Callable[[Message, Any], None],
                 on_change: Callable[[int], None]) -> None:
        self._respond = respond
        self._on_change = on_change
        """Called with how many trace now, at each change (the overlay's
        hook is on while any do)."""
        self._tracers: dict[Key, _Tracer] = {}

    def __len__(self) -> int:
        return len(self._tracers)

    def add(self, msg: Message) -> None:
        """Start answering ``msg``, an ``overlay.trace`` request: ``{typemask?,
        topic_glob?, nodeid?, full?}`` as Flux's (``typemask`` of
        :class:`MsgType` bits, default all; ``nodeid``: the overlay peer,
        -1 any)."""
        if not msg.is_owner:  # (what other users send crosses the overlay too)
            raise ErrnoError(errno.EPERM, "only the instance owner may trace the overlay")
        p = msg.payload if msg.payload is not None else {}
        if not isinstance(p, dict):
            raise ErrnoError(errno.EPROTO, "the payload must be a map")
        typemask = p.get("typemask", ALL_TYPES)
        glob = p.get("topic_glob", "*")
        peer = p.get("nodeid", -1)
        full = p.get("full", False)
        if (type(typemask) is not int or not 0 <= typemask <= ALL_TYPES
                or type(glob) is not str or type(peer) is not int
                or type(full) not in (bool, int)):
            raise ErrnoError(errno.EPROTO, "typemask and nodeid must be integers, topic_glob "
                                           "a string, full a boolean")
        if not msg.flags & MsgFlags.STREAMING:
            raise ErrnoError(errno.EPROTO, "overlay.trace is a streaming request")
        self._tracers[(tuple(msg.route), msg.matchtag)] = _Tracer(
            msg, typemask or ALL_TYPES, re.compile(fnmatch.translate(glob)), peer, bool(full))
        self._on_change(len(self._tracers))

    def end(self, key: Key) -> Message | None:
        """Stop answering the request ``key``; it, if it was there."""
        tracer = self._tracers.pop(key, None)
        if tracer is not None:
            self._on_change(len(self._tracers))
        return tracer.request if tracer is not None else None

    def end_route(self, route: tuple[str, ...]) -> None:
        """A client went: its traces end."""
        for key in [k for k in self._tracers if k[0] == route]:
            self.end(key)

    def note(self, prefix: str, peer: int, frames: Sequence[codec.Frame],
             msg: Message | None = None) -> None:
        """A message sent (``tx``) to, or received (``rx``) from, overlay
        ``peer``: its frames, and the message when it is decoded already."""
        if msg is None:
            try:
                msg = codec.decode(frames)
            except ProtocolError:
                return  # (the receiver drops and logs it)
        if msg.topic == TOPIC:
            return
        now = time.time()
        for tracer in list(self._tracers.values()):
            if (not msg.type & tracer.typemask or (tracer.peer >= 0 and tracer.peer != peer)
                    or not tracer.topic.match(msg.topic)):
                continue
            out: dict[str, Any] = {
                "timestamp": now, "prefix": prefix, "rank": peer, "type": msg.type,
                "topic": msg.topic, "size": codec.frames_size(frames),
                "errnum": msg.errnum}
            if tracer.full:
                if msg.errnum:
                    out["errstr"] = msg.errstr or ""
                else:
                    try:
                        out["payload"] = msg.payload
                    except ProtocolError:
                        out["payload"] = None
            self._respond(tracer.request, out)
