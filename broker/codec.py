"""Sans-IO wire codec: Message <-> frames, frames <-> a byte stream.

A message travels as a list of frames::

    [header, payload?, blob...]

* ``header`` -- msgpack array ``[type, topic, matchtag, nodeid, flags, userid,
  rolemask, route, errnum, errstr, seq]``.
* ``payload`` -- msgpack of the payload (absent when the payload is ``None``).
  Byte strings of ``OOB_THRESHOLD`` bytes or more found in the payload (at the
  top level, or one level down in a map or list) are not copied into the map:
  each is replaced by msgpack ext type ``OOB_EXT`` holding its frame index and
  travels as its own ``blob`` frame -- up to ``MAX_BLOBS`` of them (a
  message has at most ``MAX_FRAMES`` frames); any more stay in the map.  A
  blob frame may be named once only: a payload naming one frame many times
  would grow by that frame each time it is re-packed (a relayed commit),
  past every size limit, so the decoder refuses it.

Payloads are decoded lazily (:class:`RawPayload`): a rank that only forwards a
message never unpacks or re-packs its payload.

On a byte stream (the local connector) a message is ``u32 nframes`` followed
by ``u32 length`` per frame, then the frames' bytes; see :class:`StreamDecoder`.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import msgpack

from broker.errors import ProtocolError
from broker.message import Message, MsgType, RawPayload

OOB_EXT = 1
OOB_THRESHOLD = 4096
MAX_FRAMES = 64
MATCHTAG_MAX = 2**32 - 1
"""A matchtag is a u32: a client picks 1 to this, 0 is for no answer."""
MAX_BLOBS = MAX_FRAMES - 2
"""Blob frames one payload may use: the header and the packed map take two."""
DEFAULT_MAX_MESSAGE = 1 << 30
MAX_LINK_MESSAGE = DEFAULT_MAX_MESSAGE
"""The largest message a rank sends on a link (to a neighbour or a client):
what every receiver accepts.  A bigger one is answered ``EMSGSIZE`` by the
sender instead (:func:`oversized_error`), never sent to be dropped."""

Frame = bytes | bytearray | memoryview

_U32 = struct.Struct("<I")
_VALID_TYPES = frozenset(MsgType.NAMES)


# ---------------------------------------------------------------- payloads

PACKER_KEEP = 1 << 20
"""Packing a payload bigger than this grows the shared packer's buffer to its
size for good; the packer is then replaced so the process does not keep it."""


def _new_packer() -> Callable[[Any], bytes]:
    pack: Callable[[Any], bytes] = msgpack.Packer(use_bin_type=True, autoreset=True).pack
    return pack


_packb = _new_packer()
_unpackb = msgpack.unpackb

MAX_REQUEST_TOPIC = 1024
"""The longest topic a client's request may have (as an event's,
``broker.services.MAX_EVENT_TOPIC``): the service it names is noted, for
the client's ``.disconnect``, on every rank the request passes, for as long
as the connection lives (``access.max-guest-services`` bounds how many)."""


def echoed_topic(topic: str) -> str:
    """A refused request's topic as its error answer carries it: at most
    :data:`MAX_REQUEST_TOPIC` characters (an answer is matched by its
    matchtag).  Whole, a topic past :data:`HEADER_MAX` made an answer no
    client could read, and the request waited for ever."""
    return topic[:MAX_REQUEST_TOPIC]


HEADER_MAX = 256 << 10
"""The largest header frame decoded: 11 fields, a route of a hop a tree
level, an error string that may quote a key or two (8,192 characters each,
kvs/keys.py) fit many times over.  A bigger one is malformed."""
HEADER_PLAIN = 4 << 10
"""Header frames up to this many bytes (all but the rarest) are unpacked
as they are; bigger ones under :func:`_unpack_header`'s limits."""
HEADER_ARRAYS = 2
"""Arrays a header holds: itself and its route."""


class _Arrays:
    """``list_hook`` of a big header's unpack: a third array is refused as
    it is made, before the next (``route`` given as 12 million empty arrays,
    a byte each, was unpacked whole first: 1.7 GB and 6.6 s of a rank's
    loop for a 12 MB header, from a guest)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, items: list[Any]) -> list[Any]:
        self.n += 1
        if self.n > HEADER_ARRAYS:
            raise ValueError("an array nested in the header's fields")
        return items


def _unpack_header(frame: Frame) -> Any:
    """A header frame unpacked, within bounds: no more than
    :data:`HEADER_MAX` bytes, and past :data:`HEADER_PLAIN` no map, bytes,
    extension or array but the header's own and its route, so that what it
    costs follows its size.  Raises as ``msgpack.unpackb`` does."""
    size = len(frame)
    if size <= HEADER_PLAIN:
        return _unpackb(frame)
    if size > HEADER_MAX:
        raise ValueError(f"a header of {size} bytes (at most {HEADER_MAX})")
    return msgpack.unpackb(frame, list_hook=_Arrays(), max_map_len=0, max_bin_len=0,
                           max_ext_len=0)
_BYTES = (bytes, bytearray, memoryview)
_SCALARS = frozenset({str, int, float, bool, type(None)})


def _extract(value: Any, blobs: list[Frame]) -> Any:
    if isinstance(value, _BYTES) and len(value) >= OOB_THRESHOLD and len(blobs) < MAX_BLOBS:
        blobs.append(value)
        return msgpack.ExtType(OOB_EXT, _U32.pack(len(blobs)))
    return value


def _pack(value: Any) -> bytes:
    global _packb
    try:
        packed: bytes = _packb(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"payload is not msgpack-able: {exc}") from exc
    if len(packed) > PACKER_KEEP:
        _packb = _new_packer()
    return packed


def encode_payload(payload: Any) -> list[Frame]:
    """Frames for ``payload``: ``[]`` for None, else ``[packed, *blobs]``."""
    if payload is None:
        return []
    if isinstance(payload, dict):
        return _encode_map(payload)
    if type(payload) is RawPayload:
        return payload.frames
    if isinstance(payload, _BYTES) and len(payload) >= OOB_THRESHOLD:
        return [_packb(msgpack.ExtType(OOB_EXT, _U32.pack(1))), payload]
    return [_pack(payload)]


def _holds_large(payload: dict[Any, Any]) -> bool:
    """Whether ``payload`` has a large byte string at the top or one level down."""
    for v in payload.values():
        t = type(v)
        if t in _SCALARS:
            continue
        if t is dict or t is list:
            for x in v.values() if t is dict else v:
                if isinstance(x, _BYTES) and len(x) >= OOB_THRESHOLD:
                    return True
        elif isinstance(v, _BYTES) and len(v) >= OOB_THRESHOLD:
            return True
    return False


def _encode_map(payload: dict[Any, Any]) -> list[Frame]:
    # Most payloads hold no large byte string: a scan that allocates nothing
    # finds out, and only the others are rebuilt around their blobs.
    if not _holds_large(payload):
        return [_pack(payload)]
    blobs: list[Frame] = []
    out: dict[Any, Any] = {}
    for k, v in payload.items():
        if type(v) is dict:
            v = {k2: _extract(v2, blobs) for k2, v2 in v.items()}
        elif type(v) is list:
            v = [_extract(x, blobs) for x in v]
        else:
            v = _extract(v, blobs)
        out[k] = v
    return [_pack(out), *blobs]


GUEST_ITEMS_PER_BYTE = 4
"""A guest's payload may decode to at most one item (an array or map, an
element of an array, a pair of a map) per this many of its bytes, plus
:data:`GUEST_ITEMS_SLACK`: see :func:`decode_payload`."""
GUEST_ITEMS_SLACK = 4096
_TOO_MANY = ("payload decodes to too many items for its size (a guest's payload: at most "
             f"one array, map, element or pair per {GUEST_ITEMS_PER_BYTE} bytes)")


class _ItemBudget:
    """Counts the arrays and maps a decode builds, and their items, and
    stops it past ``limit`` (msgpack calls the hooks as each is built)."""

    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def spend(self, n: int) -> None:
        self.left -= n
        if self.left < 0:
            raise ProtocolError(_TOO_MANY)

    def list_hook(self, value: list[Any]) -> list[Any]:
        self.spend(1 + len(value))
        return value

    def object_hook(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self.spend(1 + len(value))
        return value


def decode_payload(frames: Sequence[Frame], bounded: bool = False) -> Any:
    """Inverse of :func:`encode_payload`; raise :class:`ProtocolError` on garbage.

    ``bounded`` (a guest's request): the payload may decode to at most one
    item per :data:`GUEST_ITEMS_PER_BYTE` bytes (and
    :data:`GUEST_ITEMS_SLACK`), else ``ProtocolError`` -- checked as it is
    built, so no more than that is ever built.  A byte of msgpack can be a
    whole Python object (``0x90``, an empty list: ~64 bytes): 2 MiB of them
    grew a rank by 130 MiB, 16 MiB by a GiB with a 4 s stall of its loop,
    whatever ``access.max-guest-bytes`` allowed.  Bounded, a payload costs
    at most ~16-20 times its bytes; real ones (ops, dirents, blobs) have
    5-10 bytes an item or more."""
    if not frames:
        return None
    ext_hook: Callable[[int, bytes], Any] = _no_ext
    if len(frames) > 1:
        named: set[int] = set()

        def oob_hook(code: int, data: bytes) -> Any:
            if code != OOB_EXT or len(data) != 4:
                raise ProtocolError(f"unknown msgpack ext type {code}")
            (index,) = _U32.unpack(data)
            if not 1 <= index < len(frames):
                raise ProtocolError(f"payload names missing frame {index}")
            if index in named:
                raise ProtocolError(f"payload names frame {index} more than once")
            named.add(index)
            frame = frames[index]
            return frame if isinstance(frame, bytes) else bytes(frame)

        ext_hook = oob_hook

    try:
        if bounded:
            limit = len(frames[0]) // GUEST_ITEMS_PER_BYTE + GUEST_ITEMS_SLACK
            budget = _ItemBudget(limit)
            return msgpack.unpackb(frames[0], raw=False, strict_map_key=False,
                                   ext_hook=ext_hook, max_array_len=limit, max_map_len=limit,
                                   list_hook=budget.list_hook, object_hook=budget.object_hook)
        return msgpack.unpackb(frames[0], raw=False, strict_map_key=False, ext_hook=ext_hook)
    except ProtocolError:
        raise
    except Exception as exc:
        if bounded and "exceeds max_" in str(exc):  # (an array or map's header, too long)
            raise ProtocolError(f"{_TOO_MANY}: {exc}") from None
        # (msgpack's StackError, past 1024 levels of nesting, has no text)
        raise ProtocolError(f"malformed payload: {str(exc) or type(exc).__name__}") from None


def _no_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"unexpected msgpack ext type {code}")


# ---------------------------------------------------------------- messages


ERRSTR_MAX = 64 << 10
"""The longest error string a header carries, in UTF-8 bytes (longer, its
head and a note): what every receiver's :data:`HEADER_MAX` takes, whatever
a service put in it (counted in characters, 65,536 of 4 bytes each did not
fit)."""


def _cut_errstr(errstr: str) -> str:
    """``errstr`` within :data:`ERRSTR_MAX` bytes, its note of what was cut
    included: cut again on the next hop, it stays as it is (with the note
    past the bound, every hop cut it anew, and the note then counted only
    the last hop's note)."""
    data = errstr.encode(errors="surrogatepass")
    if len(data) <= ERRSTR_MAX:
        return errstr
    head = data[:ERRSTR_MAX - 64].decode(errors="ignore")  # (a character cut: left out)
    return f"{head}... ({len(data) - len(head.encode())} more bytes)"


def encode_header(msg: Message) -> bytes:
    errstr = msg.errstr
    if errstr is not None and len(errstr) > ERRSTR_MAX // 4:  # (else it fits whatever it holds)
        errstr = _cut_errstr(errstr)
    return _packb(
        (
            msg.type,
            msg.topic,
            msg.matchtag,
            msg.nodeid,
            msg.flags,
            msg.userid,
            msg.rolemask,
            msg.route,
            msg.errnum,
            errstr,
            msg.seq,
        )
    )


def encode_request(topic: str, payload: Any, matchtag: int, nodeid: int,
                   flags: int) -> list[Frame]:
    """Frames of a client's request (no route, no credentials: the broker
    stamps those): :func:`encode` without building a :class:`Message` --
    the client ``Handle``'s hot path."""
    header = _packb((MsgType.REQUEST, topic, matchtag, nodeid, flags, -1, 0, [], 0, None, 0))
    return [header, *encode_payload(payload)]


_SURELY_WITHIN = 64 << 10


def may_exceed_link(frames: Sequence[Frame]) -> bool:
    """Whether ``frames`` need adding up against a link's limit (at least
    64 KiB): not for a message of one or two frames of less than 64 KiB
    together (the hot paths' messages), which cannot exceed it."""
    return len(frames) > 2 or len(frames[0]) + len(frames[-1]) > _SURELY_WITHIN


def frames_size(frames: Sequence[Frame]) -> int:
    """The bytes of a message's frames (what a receiver's limit counts)."""
    return sum(map(len, frames))


def oversized_error(msg: Message, size: int, limit: int, what: str) -> Message:
    """The answer that takes the place of ``msg`` when its ``size`` bytes
    are over the ``limit`` of ``what`` (the attribute, or who would not take
    it): for a request, its ``EMSGSIZE`` response; for a response, an
    ``EMSGSIZE`` response to the same request, sent on along its route."""
    return error_in_place(msg, errno.EMSGSIZE, f"message of {size} bytes exceeds {what} ({limit})")


def error_in_place(msg: Message, errnum: int, errstr: str) -> Message:
    """The error answer that takes the place of ``msg``, a request or a
    response that cannot go on: for a request, its response; for a
    response, the same error as the response to that request, to send on
    along its route."""
    if msg.type == MsgType.REQUEST:
        return msg.response(None, errnum, errstr)
    return Message(MsgType.RESPONSE, msg.topic, None, matchtag=msg.matchtag,
                   nodeid=msg.nodeid, flags=msg.flags, userid=msg.userid,
                   rolemask=msg.rolemask, route=msg.route.copy(), errnum=errnum,
                   errstr=errstr)


def peek_response(frames: Sequence[Frame]) -> tuple[int, int, str | None] | None:
    """``(matchtag, errnum, errstr)`` if ``frames`` are a response whose
    header is sound in those fields, else None (decode it in full).  A
    client waiting on a future needs nothing else from the header."""
    try:
        h = _unpack_header(frames[0])
    except Exception:
        return None
    if (type(h) is not list or len(h) != 11 or h[0] != MsgType.RESPONSE
            or type(h[2]) is not int or type(h[8]) is not int
            or (h[9] is not None and type(h[9]) is not str)):
        return None
    return h[2], h[8], h[9]


def encode(msg: Message) -> list[Frame]:
    """Frames for ``msg`` (header first).  Raises ``TypeError`` for an un-packable payload."""
    return [encode_header(msg), *encode_payload(msg.wire_payload)]


def decode(frames: Sequence[Frame]) -> Message:
    """Parse frames into a Message whose payload is a lazy :class:`RawPayload`.

    Raises :class:`ProtocolError` when the header is malformed.
    """
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(f"too many frames ({len(frames)})")
    try:
        h = _unpack_header(frames[0])  # msgpack >= 1.0: str as str, arrays as lists
    except Exception as exc:
        raise ProtocolError(f"malformed header: {exc}") from None
    if type(h) is not list or len(h) != 11:
        raise ProtocolError("malformed header: expected an array of 11 fields")
    mtype, topic, matchtag, nodeid, flags, userid, rolemask, route, errnum, errstr, seq = h
    if (
        type(mtype) is not int
        or mtype not in _VALID_TYPES
        or type(topic) is not str
        or type(matchtag) is not int
        or type(nodeid) is not int
        or type(flags) is not int
        or type(userid) is not int
        or type(rolemask) is not int
        or type(route) is not list
        or type(errnum) is not int
        or (errstr is not None and type(errstr) is not str)
        or type(seq) is not int
    ):
        raise ProtocolError("malformed header: a field has the wrong type")
    for hop in route:
        if type(hop) is not str:
            raise ProtocolError("malformed header: a field has the wrong type")
    if not 0 <= matchtag <= MATCHTAG_MAX:
        raise ProtocolError(f"malformed header: matchtag {matchtag} is not a u32 "
                            f"(0 to {MATCHTAG_MAX})")
    payload = RawPayload(list(frames[1:])) if len(frames) > 1 else None
    return Message.from_fields(mtype, topic, payload, matchtag, nodeid, flags, userid,
                               rolemask, route, errnum, errstr, seq)


def peek_request(header: Frame) -> tuple[int, str, int] | None:
    """Best effort ``(matchtag, topic, flags)`` of a request whose full
    decode failed, or that was too big to decode, from its header frame:
    None unless those read as a request's (flags 0 when unreadable)."""
    try:
        if len(header) <= HEADER_PLAIN:
            h = _unpackb(header)
        else:  # (the five fields it reads, scalars: nothing after them is built)
            fields = msgpack.Unpacker(max_array_len=0, max_map_len=0, max_bin_len=0,
                                      max_ext_len=0)
            fields.feed(header)
            h = [fields.unpack() for _ in range(min(fields.read_array_header(), 5))]
    except Exception:
        return None
    if (type(h) is not list or len(h) < 3 or type(h[0]) is not int  # (True == 1)
            or h[0] != MsgType.REQUEST
            or type(h[1]) is not str or type(h[2]) is not int
            or not 0 <= h[2] <= MATCHTAG_MAX):  # (no answer could carry it)
        return None
    flags = h[4] if len(h) > 4 and type(h[4]) is int else 0
    return h[2], h[1], flags


# ---------------------------------------------------------------- streams


_PREFIX = [struct.Struct(f"<{n + 1}I") for n in range(MAX_FRAMES + 1)]
_LENGTHS = [struct.Struct(f"<{n}I") for n in range(MAX_FRAMES + 1)]


def stream_prefix(frames: Sequence[Frame]) -> bytes:
    """The length prefix that precedes ``frames`` on a byte stream."""
    n = len(frames)
    if n == 2:
        return _PREFIX[2].pack(2, len(frames[0]), len(frames[1]))
    return _PREFIX[n].pack(n, *[len(f) for f in frames])


def to_stream(frames: Sequence[Frame]) -> bytes:
    """Serialise one message's frames for a byte stream (tests, small messages)."""
    return stream_prefix(frames) + b"".join(bytes(f) for f in frames)


HEADER_PEEK = 64 << 10
"""The header frame of an oversized message is kept (to answer it) only up to
this size, or ``max_message`` when smaller; a larger one is skipped too."""


class Oversized(NamedTuple):
    """A message :class:`StreamDecoder` skipped: its total ``size`` (the sum
    of its frame lengths) and its ``header`` frame, or None when that frame
    was too large to keep."""

    size: int
    header: bytes | None


class StreamDecoder:
    """Incremental parser of the connector's byte stream.

    ``feed(data)`` returns the complete messages (as frame lists) found so far.
    A message whose total size exceeds ``max_message`` is skipped: its header
    frame is kept (up to :data:`HEADER_PEEK` bytes), the rest is discarded as
    it arrives, never buffered.  Each skipped message is counted in
    ``oversized`` and reported once, as an :class:`Oversized`, by
    ``take_oversized()`` as soon as its header frame is complete -- the caller
    decides whether to answer it, and must take them (they accumulate).
    Raises :class:`ProtocolError` when the stream cannot be resynchronised
    (too many frames): the caller must close the connection.
    """

    def __init__(self, max_message: int = DEFAULT_MAX_MESSAGE) -> None:
        self.max_message = max_message
        self._buf = bytearray()
        self._skip = 0
        self._head = bytearray()  # the start of a skipped message's header
        self._head_need = 0  # bytes of that header still to come
        self._head_size = 0  # that message's total size
        self._skipped: list[Oversized] = []
        self.oversized = 0

    @property
    def buffered(self) -> int:
        """Bytes held of a message not yet complete (skipped bytes are not held)."""
        return len(self._buf) + len(self._head)

    def take_oversized(self) -> Sequence[Oversized]:
        """The messages skipped since the last call, oldest first (called
        for every chunk read: nothing is allocated when there are none)."""
        if not self._skipped:
            return ()
        out, self._skipped = self._skipped, []
        return out

    def _discard(self, data: bytes) -> int:
        """Consume the rest of a skipped message's header, then the bytes to
        skip, from the start of ``data``; return how many bytes were used."""
        start = 0
        if self._head_need:
            start = min(self._head_need, len(data))
            self._head += memoryview(data)[:start]
            self._head_need -= start
            if not self._head_need:
                self._skipped.append(Oversized(self._head_size, bytes(self._head)))
                self._head = bytearray()
        if self._skip and start < len(data):
            n = min(self._skip, len(data) - start)
            self._skip -= n
            start += n
        return start

    def _oversized(self, data: bytes | memoryview, p: int, end: int, total: int,
                   head: int) -> int:
        """Skip the message of ``total`` bytes whose frames start at ``p``
        (its header frame ``head`` bytes long): report it, or start keeping
        its header when ``data`` ends inside it, and arrange to discard the
        rest.  Return the offset after what of the message ``data`` holds."""
        self.oversized += 1
        have = end - p
        if head > min(HEADER_PEEK, self.max_message):
            self._skipped.append(Oversized(total, None))
        elif have >= head:
            self._skipped.append(Oversized(total, bytes(data[p : p + head])))
        else:
            self._head = bytearray(data[p:end])
            self._head_need = head - have
            self._head_size = total
            self._skip = total - head
            return end
        if have >= total:
            return p + total
        self._skip = total - have
        return end

    def feed(self, data: bytes) -> list[list[bytes]]:
        start = 0
        if self._head_need or self._skip:
            start = self._discard(data)
            if start == len(data):
                return []
        out: list[list[bytes]] = []
        buf = self._buf
        if buf:
            # The buffer holds the start of one message: complete it, then go
            # on with the rest of the chunk in place.
            held = len(buf)
            buf += memoryview(data)[start:]
            with memoryview(buf) as view:
                out, pos = self._parse(view, 0, held)
            if not pos:
                return out  # still incomplete
            del buf[:]
            start += pos - held
            if start >= len(data):
                return out
        # One copy per frame (a slice of the chunk); only an incomplete tail
        # is buffered.
        more, pos = self._parse(data, start, len(data))
        out += more
        if pos < len(data):
            buf += memoryview(data)[pos:] if pos else data
        return out

    def _parse(
        self, data: bytes | memoryview, pos: int, until: int
    ) -> tuple[list[list[bytes]], int]:
        """The complete messages of ``data`` that start at ``pos`` or later and
        before ``until``, and the offset where parsing stopped.

        Frames are slices of ``data``: bytes when ``data`` is bytes, else
        copied out of the view.
        """
        out: list[list[bytes]] = []
        end = len(data)
        unpack_u32 = _U32.unpack_from
        copy = type(data) is not bytes
        while pos < until and end - pos >= 4:
            (nframes,) = unpack_u32(data, pos)
            if nframes == 0 or nframes > MAX_FRAMES:
                raise ProtocolError(f"bad frame count {nframes} on stream")
            p = pos + 4 + 4 * nframes
            if p > end:
                break
            lengths = _LENGTHS[nframes].unpack_from(data, pos + 4)
            total = sum(lengths)
            if total > self.max_message:
                pos = self._oversized(data, p, end, total, lengths[0])
                if pos == end:
                    break
                continue
            if end - p < total:
                break
            frames: list[bytes | memoryview] = []
            for n in lengths:
                q = p + n
                frames.append(data[p:q])
                p = q
            if copy:
                frames = [bytes(f) for f in frames]
            # bytes either way: copied, or slices of ``data`` when it is bytes
            out.append(cast(list[bytes], frames))
            pos = p
        return out, pos


