"""The Message type shared by clients, modules and the overlay.

A message is a request, response, event or control.  Requests are routed by
``topic`` (service = the topic up to the first ``.``) and ``nodeid``;
responses retrace the request's ``route`` stack; events carry a global
``seq`` assigned by rank 0.  See docs/protocol.md section "Messages".
"""

from __future__ import annotations

from typing import Any

_new = object.__new__

NODEID_ANY = 0xFFFFFFFF
"""Deliver to the nearest rank that provides the service (local first)."""
NODEID_UPSTREAM = 0xFFFFFFFE
"""Deliver to the nearest provider strictly above the sending rank."""


class MsgType:
    """Message types (plain ints: enum arithmetic is too slow for the hot path)."""

    REQUEST = 1
    RESPONSE = 2
    EVENT = 4
    CONTROL = 8
    NAMES = {1: "request", 2: "response", 4: "event", 8: "control"}


class MsgFlags:
    """Message flag bits."""

    NONE = 0
    STREAMING = 1
    NORESPONSE = 2
    UPSTREAM = 4
    PRIVATE = 8


class Role:
    """Role bits stamped on a message from the sender's OS credentials."""

    NONE = 0
    OWNER = 1
    USER = 2


class RawPayload:
    """A payload still in wire form (msgpack frames), unpacked on first access.

    A rank that only forwards a message never unpacks or re-packs it.
    """

    __slots__ = ("frames",)

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames

    def decode(self, bounded: bool = False) -> Any:
        return _codec.decode_payload(self.frames, bounded)


class Message:
    """One broker message.

    ``payload`` is any msgpack-able value (usually a dict) or ``None``.
    ``route`` is the stack of hops a request took (pushed on the way in,
    popped by its responses).  ``userid``/``rolemask`` are stamped by the
    broker from the OS credentials of the connection, never trusted from a
    client.
    """

    __slots__ = (
        "type",
        "topic",
        "_payload",
        "matchtag",
        "nodeid",
        "flags",
        "userid",
        "rolemask",
        "route",
        "errnum",
        "errstr",
        "seq",
        "wire",
        "answered",
    )

    def __init__(
        self,
        type: int,
        topic: str,
        payload: Any = None,
        *,
        matchtag: int = 0,
        nodeid: int = NODEID_ANY,
        flags: int = 0,
        userid: int = -1,
        rolemask: int = 0,
        route: list[str] | None = None,
        errnum: int = 0,
        errstr: str | None = None,
        seq: int = 0,
    ) -> None:
        self.type = int(type)
        self.topic = topic
        self._payload = payload
        self.matchtag = matchtag
        self.nodeid = nodeid
        self.flags = flags
        self.userid = userid
        self.rolemask = rolemask
        self.route = route if route is not None else []
        self.errnum = errnum
        self.errstr = errstr
        self.seq = seq
        self.wire: list[Any] | None = None  # cached encoded frames (events sent to many peers)
        self.answered = False
        """A request a module handled has had its last answer (set by
        :class:`~broker.module.ModuleHandle`): one its handler returned
        without is kept, to be ended if the module is removed."""

    @classmethod
    def from_fields(
        cls,
        type: int,
        topic: str,
        payload: Any,
        matchtag: int,
        nodeid: int,
        flags: int,
        userid: int,
        rolemask: int,
        route: list[str],
        errnum: int,
        errstr: str | None,
        seq: int,
        /,
    ) -> Message:
        """Every field given, positionally and already checked (the codec and
        :meth:`response`): cheaper than the keyword constructor on the hot path."""
        m = _new(cls)
        m.type = type
        m.topic = topic
        m._payload = payload
        m.matchtag = matchtag
        m.nodeid = nodeid
        m.flags = flags
        m.userid = userid
        m.rolemask = rolemask
        m.route = route
        m.errnum = errnum
        m.errstr = errstr
        m.seq = seq
        m.wire = None
        m.answered = False
        return m

    def copy(self) -> Message:
        """This message anew: its route a list of its own, not answered --
        a request one module hands on to the next (:meth:`Module.parked
        <broker.module.Module.parked>`), which the first must not answer."""
        return Message.from_fields(self.type, self.topic, self._payload, self.matchtag,
                                   self.nodeid, self.flags, self.userid, self.rolemask,
                                   list(self.route), self.errnum, self.errstr, self.seq)

    @property
    def payload(self) -> Any:
        """The decoded payload; raises ``ProtocolError`` if the wire form is garbage."""
        p = self._payload
        if type(p) is RawPayload:
            # (a guest's request decodes to at most so many items for its
            # size: codec.decode_payload)
            p = self._payload = p.decode(bounded=self.type == MsgType.REQUEST
                                         and not self.rolemask & Role.OWNER)
        return p

    @payload.setter
    def payload(self, value: Any) -> None:
        self._payload = value

    @property
    def wire_payload(self) -> Any:
        """The payload as held: a :class:`RawPayload` if never decoded."""
        return self._payload

    @property
    def service(self) -> str:
        """The topic up to the first ``.`` (``kvs.lookup`` -> ``kvs``)."""
        return self.topic.partition(".")[0]

    @property
    def streaming(self) -> bool:
        return bool(self.flags & MsgFlags.STREAMING)

    @property
    def noresponse(self) -> bool:
        return bool(self.flags & MsgFlags.NORESPONSE)

    @property
    def is_owner(self) -> bool:
        return bool(self.rolemask & Role.OWNER)

    def response(
        self, payload: Any = None, errnum: int = 0, errstr: str | None = None
    ) -> Message:
        """A response to this request, addressed back along its route."""
        return Message.from_fields(
            MsgType.RESPONSE, self.topic, payload, self.matchtag, self.nodeid,
            self.flags & MsgFlags.STREAMING, self.userid, self.rolemask, self.route.copy(),
            errnum, errstr, 0,
        )

    def __repr__(self) -> str:
        kind = MsgType.NAMES.get(self.type, str(self.type))
        extra = f" errnum={self.errnum}" if self.errnum else ""
        return (
            f"<Message {kind} {self.topic!r} tag={self.matchtag} "
            f"nodeid={self.nodeid:#x} route={self.route}{extra}>"
        )


# Last, because broker.codec imports this module: bound here rather than in
# RawPayload.decode, where an import statement cost ~0.8 us per payload.
from broker import codec as _codec  # noqa: E402
