"""The sans-IO codec: Message <-> frames <-> byte stream (docs/protocol.md, "Frames")."""

from __future__ import annotations

import random
import struct
from typing import Any

import msgpack
import pytest

from broker import codec
from broker.errors import ProtocolError
from broker.message import (
    NODEID_ANY,
    NODEID_UPSTREAM,
    Message,
    MsgFlags,
    MsgType,
    RawPayload,
    Role,
)

HEADER = [1, "kvs.lookup", 7, 3, 0, 1000, 2, ["c1", "r3"], 0, None, 0]
"""A well-formed header (as a list) that tests spoil one field at a time."""


def header(**changes: object) -> list[object]:
    names = [
        "type",
        "topic",
        "matchtag",
        "nodeid",
        "flags",
        "userid",
        "rolemask",
        "route",
        "errnum",
        "errstr",
        "seq",
    ]
    h = list(HEADER)
    for name, value in changes.items():
        h[names.index(name)] = value
    return h


def roundtrip(msg: Message) -> Message:
    return codec.decode([bytes(f) for f in codec.encode(msg)])


# ---------------------------------------------------------------- messages


def test_header_fields_round_trip() -> None:
    msg = Message(
        MsgType.RESPONSE,
        "kvs.lookup",
        {"val": "x"},
        matchtag=42,
        nodeid=5,
        flags=MsgFlags.STREAMING | MsgFlags.PRIVATE,
        userid=1234,
        rolemask=Role.USER,
        route=["c7", "r2", "r0"],
        errnum=2,
        errstr="No such file",
        seq=99,
    )
    out = roundtrip(msg)
    for field in (
        "type",
        "topic",
        "matchtag",
        "nodeid",
        "flags",
        "userid",
        "rolemask",
        "route",
        "errnum",
        "errstr",
        "seq",
    ):
        assert getattr(out, field) == getattr(msg, field), field
    assert out.payload == {"val": "x"}


@pytest.mark.parametrize("nodeid", [NODEID_ANY, NODEID_UPSTREAM, 0, 7])
def test_nodeids_round_trip(nodeid: int) -> None:
    assert roundtrip(Message(MsgType.REQUEST, "a.b", nodeid=nodeid)).nodeid == nodeid


@pytest.mark.parametrize("mtype", sorted(MsgType.NAMES))
def test_every_type_round_trips(mtype: int) -> None:
    assert roundtrip(Message(mtype, "t.x", [1, 2])).type == mtype


def test_no_payload_is_one_frame() -> None:
    frames = codec.encode(Message(MsgType.REQUEST, "broker.ping"))
    assert len(frames) == 1
    assert codec.decode(frames).payload is None


@pytest.mark.parametrize(
    "payload",
    [{"a": 1, "b": [1, "two", None], "c": {"d": 1.5}}, [1, 2, 3], "text", 17, b"small", True],
)
def test_payload_round_trip(payload: object) -> None:
    frames = codec.encode(Message(MsgType.REQUEST, "x.y", payload))
    assert len(frames) == 2
    assert codec.decode(frames).payload == payload


def test_large_bytes_travel_as_their_own_frames() -> None:
    big1, big2, big3 = b"a" * 5000, bytearray(b"b" * 10000), b"c" * codec.OOB_THRESHOLD
    payload = {"data": big1, "blobs": [big2, b"tiny"], "nested": {"x": big3, "n": 1}}
    frames = codec.encode(Message(MsgType.REQUEST, "content.store", payload))
    # header, the msgpack map, then one frame per large value -- not copied
    assert len(frames) == 5
    assert frames[2] is big1 and frames[3] is big2 and frames[4] is big3
    assert len(frames[1]) < 200
    out = codec.decode([bytes(f) for f in frames]).payload
    assert out == {"data": big1, "blobs": [bytes(big2), b"tiny"], "nested": {"x": big3, "n": 1}}


def test_large_bytes_at_top_level() -> None:
    blob = b"z" * 8192
    frames = codec.encode(Message(MsgType.RESPONSE, "content.load", blob))
    assert len(frames) == 3 and frames[2] is blob
    assert codec.decode(frames).payload == blob


def test_oob_threshold_boundary_and_depth() -> None:
    below = b"x" * (codec.OOB_THRESHOLD - 1)
    assert len(codec.encode(Message(MsgType.REQUEST, "t", {"v": below}))) == 2
    # only the top level and one level down are scanned: deeper bytes stay inline
    deep = {"a": {"b": {"c": b"y" * 10000}}}
    frames = codec.encode(Message(MsgType.REQUEST, "t", deep))
    assert len(frames) == 2
    assert codec.decode(frames).payload == deep


def test_a_payload_with_more_large_values_than_frames_keeps_the_rest_inline() -> None:
    values = [bytes([i % 256]) * 4096 for i in range(100)]
    frames = codec.encode(Message(MsgType.EVENT, "x", {"a": values}))
    assert len(frames) == codec.MAX_FRAMES
    assert codec.to_stream(frames)  # the stream prefix has room for them all
    assert codec.decode(frames).payload == {"a": values}


def test_a_payload_naming_one_frame_twice_is_refused() -> None:
    # Re-packed (a rank relaying it), each name would become a copy of the
    # frame: 40 names of a 28 MB frame made a 1.1 GB message.
    ref = msgpack.ExtType(codec.OOB_EXT, struct.pack("<I", 1))
    frames = [codec.encode_header(Message(MsgType.REQUEST, "kvs.commit")),
              msgpack.packb({"ops": [{"data": ref}, {"data": ref}]}), b"x" * 5000]
    with pytest.raises(ProtocolError, match="frame 1 more than once"):
        _ = codec.decode(frames).payload


def test_forwarding_does_not_repack_the_payload() -> None:
    frames = [bytes(f) for f in codec.encode(Message(MsgType.REQUEST, "t", {"k": b"v" * 9000}))]
    msg = codec.decode(frames)
    assert isinstance(msg.wire_payload, RawPayload)
    msg.route.append("r1")  # a hop changes the header only
    again = codec.encode(msg)
    assert again[1] is frames[1] and again[2] is frames[2]
    assert codec.decode(again).route == ["r1"]


def test_unpackable_payload_raises_type_error() -> None:
    with pytest.raises(TypeError):
        codec.encode(Message(MsgType.REQUEST, "t", {"x": object()}))


# ---------------------------------------------------------------- bad headers


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"\xc1"],  # a byte msgpack never uses
        [b"\x9b"],  # an array of 11 with nothing in it
        [msgpack.packb({"type": 1})],
        [msgpack.packb("request")],
        [msgpack.packb(HEADER[:10])],
        [msgpack.packb([*HEADER, 0])],
        [msgpack.packb(HEADER)] + [b"x"] * codec.MAX_FRAMES,
    ],
    ids=[
        "empty",
        "blank",
        "bad-byte",
        "truncated",
        "map",
        "string",
        "10-fields",
        "12-fields",
        "too-many-frames",
    ],
)
def test_garbage_headers(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames)
    assert info.value.errnum == 71  # EPROTO


@pytest.mark.parametrize(
    "changes",
    [
        {"type": 3},
        {"type": 0},
        {"type": "request"},
        {"type": [1]},
        {"type": {}},
        {"type": True},
        {"type": 1.0},
        {"type": None},
        {"topic": 5},
        {"topic": b"bytes"},
        {"topic": None},
        {"matchtag": "7"},
        {"matchtag": 1.5},
        {"matchtag": -1},
        {"matchtag": 2**32},
        {"nodeid": "any"},
        {"nodeid": None},
        {"flags": [1]},
        {"userid": "root"},
        {"rolemask": None},
        {"route": "c1"},
        {"route": [1, 2]},
        {"route": [b"c1"]},
        {"route": None},
        {"errnum": "ENOENT"},
        {"errstr": 5},
        {"seq": -0.5},
    ],
    ids=repr,
)
def test_wrong_field_types(changes: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        codec.decode([msgpack.packb(header(**changes))])


@pytest.mark.parametrize("payload", [None, {}, {"k": [1, b"x" * codec.OOB_THRESHOLD]}, 7])
def test_encode_request_is_encode_of_a_new_request(payload: object) -> None:
    """The client's shortcut writes the very frames of the long way."""
    msg = Message(MsgType.REQUEST, "kvs.commit", payload, matchtag=9, nodeid=3,
                  flags=MsgFlags.STREAMING)
    assert codec.encode_request("kvs.commit", payload, 9, 3, MsgFlags.STREAMING) == \
        codec.encode(msg)


def test_peek_response_reads_only_sound_responses() -> None:
    resp = header(type=MsgType.RESPONSE, errnum=2, errstr="gone")
    assert codec.peek_response([msgpack.packb(resp)]) == (7, 2, "gone")
    assert codec.peek_response([msgpack.packb(header(type=MsgType.RESPONSE))]) == (7, 0, None)
    # not a response, or the fields it reads are wrong: decode in full instead
    assert codec.peek_response([msgpack.packb(header())]) is None
    for spoiled in ({"matchtag": "7"}, {"errnum": None}, {"errstr": 5}):
        frames = [msgpack.packb(header(type=MsgType.RESPONSE, **spoiled))]
        assert codec.peek_response(frames) is None
    assert codec.peek_response([b"\xc1garbage"]) is None
    assert codec.peek_response([msgpack.packb([MsgType.RESPONSE, "t", 1])]) is None


def test_peek_request_of_a_spoiled_request() -> None:
    assert codec.peek_request(msgpack.packb(header(route="bad"))) == (7, "kvs.lookup", 0)
    assert codec.peek_request(msgpack.packb(header(route="bad", flags=2))) == (
        7, "kvs.lookup", 2)
    assert codec.peek_request(msgpack.packb(header(flags="x"))) == (7, "kvs.lookup", 0)
    assert codec.peek_request(msgpack.packb([1, "t", 3])) == (3, "t", 0)
    assert codec.peek_request(msgpack.packb(header(type=2, route="bad"))) is None
    assert codec.peek_request(msgpack.packb(header(matchtag="7"))) is None
    assert codec.peek_request(msgpack.packb(header(matchtag=2**32))) is None  # not a u32
    assert codec.peek_request(b"\xc1") is None
    assert codec.peek_request(msgpack.packb({"a": 1})) is None
    assert codec.peek_request(msgpack.packb(header(type=True))) is None  # (True == 1)


def test_a_big_header_costs_what_its_bytes_do() -> None:
    """A header's route of 200,000 empty arrays (a byte each) was unpacked
    whole before its type was checked, and again to answer it, ~145 bytes
    of memory per byte sent (a guest's 12 MB header: 1.7 GB and 6.6 s of a
    rank's loop); the third array now stops the unpack as it is made, and
    the answer's peek reads five scalar fields.  Past HEADER_MAX the frame
    is refused unread.  A big header that is sound still decodes."""
    import tracemalloc

    nested = b"".join([msgpack.packb(header()[:7]), b"\xdd", (200_000).to_bytes(4, "big"),
                       b"\x90" * 200_000, msgpack.packb(header()[8:])[1:]])
    nested = b"\x9b" + nested[1:]  # (the 11-field array's marker again)
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="malformed header"):
            codec.decode([nested])
        assert codec.peek_request(nested) == (7, "kvs.lookup", 0)  # (answered EPROTO)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak  # (whole: ~12 MB)
    too_big = msgpack.packb(header(errstr="x" * (codec.HEADER_MAX + 1)))
    with pytest.raises(ProtocolError, match=f"at most {codec.HEADER_MAX}"):
        codec.decode([too_big])
    # (an error string is cut to what every receiver takes, as it is sent)
    # (in bytes: 65,536 characters of 4 bytes each, counted as characters, did not fit)
    for char, size in (("é", 2), ("\U0001f600", 4)):
        long = Message(MsgType.RESPONSE, "t", matchtag=1, errnum=5, errstr=char * 70_000)
        got = codec.decode([bytes(f) for f in codec.encode(long)])
        kept = (codec.ERRSTR_MAX - 64) // size
        assert got.errstr == char * kept + f"... ({(70_000 - kept) * size} more bytes)"
        assert len(got.errstr.encode()) <= codec.ERRSTR_MAX
        # a rank that passes it on cuts nothing more (each hop cut it anew)
        again = codec.decode([bytes(f) for f in codec.encode(got)])
        assert again.errstr == got.errstr
    sound = header(route=[f"r{i}" for i in range(3000)], errstr="e" * 40_000)
    msg = codec.decode([msgpack.packb(sound)])
    assert len(msg.route) == 3000 and msg.errstr == "e" * 40_000


# ---------------------------------------------------------------- bad payloads


@pytest.mark.parametrize(
    "payload_frames",
    [
        [b"\xc1"],
        [b"\x92\x01"],  # truncated array
        [msgpack.packb(msgpack.ExtType(9, b"abcd")), b"blob"],  # unknown ext type
        [msgpack.packb(msgpack.ExtType(codec.OOB_EXT, struct.pack("<I", 5))), b"blob"],
        [msgpack.packb(msgpack.ExtType(codec.OOB_EXT, struct.pack("<I", 0))), b"blob"],
        [msgpack.packb(msgpack.ExtType(codec.OOB_EXT, b"\x01")), b"blob"],
        [msgpack.packb(msgpack.ExtType(codec.OOB_EXT, struct.pack("<I", 1)))],  # no blob
    ],
    ids=[
        "bad-byte",
        "truncated",
        "unknown-ext",
        "missing-frame",
        "frame-0",
        "short-ext",
        "ext-without-frames",
    ],
)
def test_garbage_payload_fails_lazily(payload_frames: list[bytes]) -> None:
    msg = codec.decode([msgpack.packb(HEADER), *payload_frames])  # the header is fine
    with pytest.raises(ProtocolError):
        _ = msg.payload


def test_a_payload_nested_too_deep_says_so() -> None:
    """msgpack's StackError has no text: the errstr ended in ': '."""
    deep = b"\x91" * 2000 + b"\xc0"  # 2,000 nested one-element arrays
    msg = codec.decode([msgpack.packb(HEADER), deep])
    with pytest.raises(ProtocolError, match="^malformed payload: StackError$"):
        _ = msg.payload


# ---------------------------------------------------------------- the byte stream


def messages(n: int) -> list[list[bytes]]:
    rng = random.Random(n)
    out = []
    for i in range(n):
        payload = {"i": i, "blob": rng.randbytes(rng.choice([0, 10, 5000]))}
        out.append(
            [
                bytes(f)
                for f in codec.encode(Message(MsgType.REQUEST, f"t.{i}", payload, matchtag=i))
            ]
        )
    out.append([b"", b"zero-length frames are fine", b""])
    return out


def test_stream_prefix_layout() -> None:
    frames = [b"abc", b"", b"defgh"]
    assert codec.stream_prefix(frames) == struct.pack("<4I", 3, 3, 0, 5)
    assert codec.to_stream(frames) == struct.pack("<4I", 3, 3, 0, 5) + b"abcdefgh"


def test_stream_fed_whole() -> None:
    msgs = messages(5)
    data = b"".join(codec.to_stream(m) for m in msgs)
    assert codec.StreamDecoder().feed(data) == msgs


def test_stream_fed_byte_by_byte() -> None:
    msgs = messages(4)
    data = b"".join(codec.to_stream(m) for m in msgs)
    d = codec.StreamDecoder()
    got = []
    for i in range(len(data)):
        got += d.feed(data[i : i + 1])
    assert got == msgs


def test_stream_fed_in_random_chunks() -> None:
    msgs = messages(20)
    data = b"".join(codec.to_stream(m) for m in msgs)
    rng = random.Random(1)
    d = codec.StreamDecoder()
    got, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, 3000)
        got += d.feed(data[pos : pos + n])
        pos += n
    assert got == msgs


def feed_in_chunks(d: codec.StreamDecoder, data: bytes, chunk: int, *,
                   keep_oversized: bool = False) -> tuple[list[Any], list[codec.Oversized]]:
    """Feed ``data`` to ``d`` ``chunk`` bytes at a time: the messages it
    decoded, and the oversized ones it reported after each chunk (none
    taken with ``keep_oversized``: the test reads them from ``d``)."""
    got: list[Any] = []
    skipped: list[codec.Oversized] = []
    for pos in range(0, len(data), chunk):
        got += d.feed(data[pos : pos + chunk])
        if not keep_oversized:
            skipped += list(d.take_oversized())
    return got, skipped


@pytest.mark.parametrize("chunk", [1, 7, 100, 1 << 20])
def test_stream_skips_oversized_messages(chunk: int) -> None:
    small1, big, small2 = [b"one"], [b"h", b"x" * 500], [b"two", b"2"]
    data = codec.to_stream(small1) + codec.to_stream(big) + codec.to_stream(small2)
    d = codec.StreamDecoder(max_message=100)
    got, _ = feed_in_chunks(d, data, chunk, keep_oversized=True)
    assert got == [small1, small2]
    assert d.oversized == 1


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_stream_limit_is_inclusive(chunk: int) -> None:
    """``max_message`` is the largest message taken (the sum of its frames,
    as the link and connector limits count it): exactly that many bytes
    pass, one more is skipped."""
    at_limit, over = [b"h", b"x" * 99], [b"h", b"x" * 100]
    data = codec.to_stream(at_limit) + codec.to_stream(over) + codec.to_stream(at_limit)
    d = codec.StreamDecoder(max_message=100)
    got, _ = feed_in_chunks(d, data, chunk, keep_oversized=True)
    assert got == [at_limit, at_limit]
    assert d.oversized == 1 and list(d.take_oversized()) == [codec.Oversized(101, b"h")]

@pytest.mark.parametrize("chunk", [1, 3, 7, 100, 1 << 20])
def test_stream_reports_oversized_headers(chunk: int) -> None:
    # the header frame of each skipped message is reported (so the connector
    # can answer it), even when it arrives split across chunks; the message's
    # other frames are discarded, and what follows is decoded as usual
    small1, small2 = [b"one"], [b"two", b"2"]
    big1 = [b"header-1", b"x" * 500]
    big2 = [b"h2" * 30, b"y" * 200, b"z" * 300]  # header 60 bytes, under the limit
    data = b"".join(codec.to_stream(m) for m in (small1, big1, small2, big2, small1))
    d = codec.StreamDecoder(max_message=100)
    got, skipped = feed_in_chunks(d, data, chunk)
    assert got == [small1, small2, small1]
    assert skipped == [
        codec.Oversized(508, b"header-1"),
        codec.Oversized(560, b"h2" * 30),
    ]
    assert d.oversized == 2
    assert not d.take_oversized()


@pytest.mark.parametrize("chunk", [1, 50, 1 << 20])
def test_stream_oversized_header_frame_is_not_kept(chunk: int) -> None:
    # a header frame larger than the limit is not buffered either: reported
    # without it (the connector can only drop and log such a message)
    big = [b"h" * 300, b"x"]
    data = codec.to_stream(big) + codec.to_stream([b"ok"])
    d = codec.StreamDecoder(max_message=100)
    got, skipped = feed_in_chunks(d, data, chunk)
    assert got == [[b"ok"]]
    assert skipped == [codec.Oversized(301, None)]


@pytest.mark.parametrize("nframes", [0, codec.MAX_FRAMES + 1, 0xFFFFFFFF])
def test_stream_bad_frame_count(nframes: int) -> None:
    d = codec.StreamDecoder()
    with pytest.raises(ProtocolError):
        d.feed(struct.pack("<I", nframes) + b"\x00" * 16)


def test_stream_garbage_after_a_good_message() -> None:
    d = codec.StreamDecoder()
    with pytest.raises(ProtocolError):
        d.feed(codec.to_stream([b"ok"]) + b"GARBAGE!")


def test_a_guests_payload_decodes_to_a_bounded_number_of_items() -> None:
    """``bounded`` (a guest's request): a real commit's ops (the smallest
    puts, ~5.4 bytes an item) decode as ever; empty arrays (a byte each, a
    Python list each) past one item per 4 bytes are ``ProtocolError``,
    flat (the header says too many) or nested (counted as built); the
    owner's decoding is not bounded."""
    from kvs.client import TxnOps

    ops = TxnOps()
    for i in range(1000):
        ops.put(f"k{i}", i)
    commit = {"namespace": "mine", "flags": 0, "ops": ops.ops}
    frames = codec.encode_payload(commit)
    assert codec.decode_payload(frames, bounded=True) == commit
    n = 1 << 16
    flat = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n
    nested = b"\xdc" + (64).to_bytes(2, "big") + (b"\xdc\x04\x00" + b"\x90" * 1024) * 64
    for data in (flat, nested):
        with pytest.raises(codec.ProtocolError, match="^payload decodes to too many items"):
            codec.decode_payload([data], bounded=True)
        assert len(codec.decode_payload([data])) in (n, 64)
