"""Random requests for the fuzz tests: seeded, so a failure replays.

Most requests follow a service's payload template (``kvs.commit`` with ops,
``kvs-watch.lookup`` with flags, ...) with a field or two replaced by a
random value, so they get past the first type check and reach the code
behind it; the rest are random topics, payloads and header fields.  Plain
msgpack and the stream framing only: this module is imported by a guest
process before it drops its uid, and by the tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgpack

from broker import codec
from broker.message import NODEID_ANY, NODEID_UPSTREAM, MsgType

TOPICS = (
    "attr.get attr.list broker.ping broker.stats-get content.checkpoint-get "
    "content.checkpoint-list content.checkpoint-put content.dropcache content.flush "
    "content.load content.stats-get "
    "content.store event.pub event.subscribe event.unsubscribe kvs-watch.cancel "
    "kvs-watch.disconnect kvs-watch.lookup kvs-watch.namespaces kvs-watch.stats-get "
    "kvs.commit kvs.diff "
    "kvs.disconnect kvs.dropcache kvs.getroot kvs.lookup kvs.lookup-plus "
    "kvs.namespace-create kvs.namespace-list kvs.namespace-remove kvs.relaycommit "
    "kvs.stats-get kvs.wait-version module.list kvs.gc nosuch.service "
    "kvs.lease-grant kvs.lease-keepalive kvs.lease-revoke kvs.lease-info kvs.lease-list "
    # (rexec.exec is left out: the owner's random command lines would run)
    "rexec.list rexec.kill rexec.wait rexec.wait-cancel rexec.write rexec.credit "
    "rexec.stats-get"
).split()
FIELDS = (
    "key namespace flags ops names name owner rootseq rootref blobref data topic payload "
    "old new limit rank txns epoch matchtag keys value dirent ver type rootdir heard "
    "timeout compact userid id ttl lease pid signum label output eof bytes"
).split()
KEYS = ("a", "a.b", "a.b.c", ".", "d", "d.e", "x.y.z", "", "a..b", ".a", "a.", "a/b")
SPECIALS: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 1e300,
    float("nan"), "", ".", "a.b.c", "sha1-" + "0" * 40, "sha256-" + "f" * 64, "\x00", "é",
)


class RequestFuzzer:
    """Frames of random requests; ``namespaces`` and ``blobrefs`` seed the
    templates (the caller may add blobrefs it learns from answers)."""

    def __init__(self, seed: int, namespaces: list[str], blobrefs: list[str],
                 lease_ids: list[int] | None = None) -> None:
        self.r = random.Random(seed)
        self.namespaces = namespaces
        self.blobrefs = blobrefs or ["sha1-" + "0" * 40]
        self.lease_ids = [*(lease_ids or ()), 1, 2, 99]
        """Lease ids to name: live ones the caller granted (ids are random,
        so none is hit by chance), and some that are not."""
        r = self.r
        self.templates: dict[str, Callable[[], dict[str, Any]]] = {
            "kvs.lookup": lambda: {"key": self.key(), "namespace": self.ns(),
                                   "flags": r.choice([0, 1, 2, 4, 8, 16, 32, 64, 256])},
            "kvs.lookup-plus": lambda: {"key": self.key(), "namespace": self.ns(),
                                        "flags": r.choice([0, 4, 8])},
            "kvs.commit": lambda: {"namespace": self.ns(), "flags": r.choice([0, 1, 2, 4]),
                                   "ops": self.ops()},
            "kvs.diff": lambda: {"namespace": self.ns(), "old": self.ref(), "key": self.key(),
                                 "limit": r.choice([1, 10, 0])},
            "kvs.getroot": lambda: {"namespace": self.ns()},
            "kvs.lease-grant": lambda: {"ttl": r.choice([0, 1, 1.5, 30, 86401, -1])},
            "kvs.lease-keepalive": lambda: {"id": r.choice(self.lease_ids)},
            "kvs.lease-revoke": lambda: {"id": r.choice(self.lease_ids)},
            "kvs.lease-info": lambda: {"id": r.choice(self.lease_ids)},
            "kvs.lease-list": lambda: {"after": r.choice([0, *self.lease_ids])},
            "kvs.wait-version": lambda: {"namespace": self.ns(), "rootseq": r.randrange(50),
                                         "timeout": 0.05},
            "kvs.namespace-create": lambda: {"namespace": self.ns(), "owner": r.choice(
                [0, 1234, 65534]), "flags": 0},
            "kvs.namespace-remove": lambda: {"namespace": self.ns()},
            "kvs.relaycommit": lambda: {"namespace": self.ns(), "epoch": r.randrange(3),
                                        "txns": [{"name": f"t{r.randrange(99)}", "flags": 0,
                                                  "ops": self.ops()}]},
            "kvs-watch.lookup": lambda: {"key": self.key(), "namespace": self.ns(),
                                         "flags": r.choice([1, 3, 5, 9, 17, 33, 65, 129, 257,
                                                            0x400, 0x401])},
            "kvs-watch.cancel": lambda: {"matchtag": r.randrange(300)},
            "kvs-watch.namespaces": lambda: {"prefix": r.choice(["", "a", "job-"]),
                                             "flags": r.choice([0, 1, 2])},
            "content.store": lambda: {"data": r.choice([b"", b"x", b"y" * 10_000])},
            "content.load": lambda: {"blobref": self.ref()},
            "content.checkpoint-get": lambda: {"key": r.choice(["kvs-primary", "x"])},
            "content.checkpoint-list": lambda: {"key": r.choice(["kvs-primary", "x", "", 7])},
            "event.pub": lambda: {"topic": r.choice(["kvs.namespace-primary-setroot", "x.y",
                                                     "kvs.namespace-a-removed", ""]),
                                  "payload": self.payload(), "flags": r.choice([0, 8])},
            "event.subscribe": lambda: {"topic": r.choice(["kvs.", "", "x"])},
            # (the test starts a waitable background command labelled "fz" on
            # each rank: some of these name it, kill it or collect it)
            "rexec.kill": lambda: {r.choice(["pid", "label"]): self.proc(),
                                   "signum": r.choice([0, 15, 18, 99, -1, "TERM"])},
            "rexec.wait": lambda: {r.choice(["pid", "label"]): self.proc(),
                                   "output": r.choice([True, False, 1, None])},
            "rexec.write": lambda: {"pid": self.proc(), "data": r.choice([b"", b"x", "x"]),
                                    "eof": r.choice([True, False, 0])},
            "rexec.credit": lambda: {"pid": self.proc(), "bytes": r.choice([1, -1, 2**62])},
        }

    # -- parts
    def ns(self) -> str:
        return self.r.choice(self.namespaces)

    def key(self) -> str:
        return self.r.choice(KEYS)

    def proc(self) -> Any:
        return self.r.choice(["fz", "", "nosuch", 1, 0, -1, 2**31, 2**63 - 1, None, 1.5])

    def ref(self) -> str:
        return self.r.choice(self.blobrefs)

    def scalar(self) -> Any:
        r = self.r
        c = r.randrange(6)
        if c == 0:
            return b"\x00\xff" * r.randrange(3000)
        if c == 1:
            return "x" * r.choice([1, 300, 70_000])
        if c == 2:
            return self.ref()
        return r.choice(SPECIALS)

    def value(self, depth: int = 0) -> Any:
        r = self.r
        c = r.randrange(10)
        if depth > 3 or c < 5:
            return self.scalar()
        if c == 5:
            return [self.value(depth + 1) for _ in range(r.randrange(4))]
        if c == 6:
            return {"ver": r.choice([1, 2, None]), "type": r.choice(
                ["val", "valref", "dir", "dirref", "hdir", "symlink", "x", 1]),
                "data": self.value(depth + 1)}
        if c == 7:
            return self.ops()
        return {r.choice(FIELDS): self.value(depth + 1) for _ in range(r.randrange(5))}

    def dirent(self) -> dict[str, Any]:
        r = self.r
        t = r.choice(["val", "valref", "dir", "dirref", "symlink", "hdir", "bad"])
        data: Any = {
            "val": lambda: b"v" * r.choice([0, 5, 5000]),
            "valref": lambda: [self.ref()],
            "dir": lambda: {"k": {"ver": 1, "type": "val", "data": b"x"}},
            "dirref": lambda: [self.ref()],
            "symlink": lambda: {"target": self.key()},
            "hdir": lambda: [self.ref()],
            "bad": lambda: self.value(),
        }[t]()
        return {"ver": 1, "type": t, "data": data}

    def ops(self) -> list[dict[str, Any]]:
        r = self.r
        ops = [{"key": self.key(), "flags": r.choice([0, 0, 0, 1, 2, 4, 8, 16]),
                "dirent": r.choice([self.dirent(), self.dirent(), None])}
               for _ in range(r.randrange(1, 4))]
        if r.random() < 0.1:  # (a lease id, live or not, or something else)
            ops[0]["lease"] = r.choice([*self.lease_ids, "1", None])
        return ops

    def payload(self) -> Any:
        if self.r.random() < 0.1:
            return self.value()
        return {self.r.choice(FIELDS): self.value() for _ in range(self.r.randrange(6))}

    # -- requests
    def frames(self, matchtag: int) -> list[bytes]:
        """One request's frames: mostly a template with a field or two made random."""
        r = self.r
        topic = r.choice(TOPICS)
        if topic in self.templates and r.random() < 0.8:
            p = self.templates[topic]()
            for _ in range(r.choice([0, 0, 1, 2])):
                p[r.choice([*p, r.choice(FIELDS)])] = self.value()
            streaming = int(topic in ("kvs-watch.lookup", "kvs-watch.namespaces"))
            header = [MsgType.REQUEST, topic, matchtag, r.choice([NODEID_ANY, NODEID_ANY, 0, 1]),
                      streaming, 0, 0, [], 0, None, 0]
            return [msgpack.packb(header), msgpack.packb(p)]
        typ = MsgType.REQUEST if r.random() < 0.95 else r.choice(
            [MsgType.RESPONSE, MsgType.EVENT, 9])
        header = [typ, topic, matchtag, r.choice([NODEID_ANY, NODEID_UPSTREAM, 0, 1, 2, 99, -1]),
                  r.choice([0, 0, 1, 2, 4, 3, 255]), r.choice([0, 1234]), r.choice([0, 1, 4]),
                  r.choice([[], [], ["x"]]), 0, None, 0]
        if r.random() < 0.05:
            header[r.randrange(len(header))] = self.value()
        frames = [msgpack.packb(header)]
        if r.random() < 0.9:
            frames.append(msgpack.packb(self.payload()))
        return frames

    def stream(self, matchtag: int) -> bytes:
        """:meth:`frames` as bytes of the local connector's stream."""
        return codec.to_stream(self.frames(matchtag))
