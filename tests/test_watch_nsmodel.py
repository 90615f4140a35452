"""Namespaces created, written and removed at random, watched on every rank
by the instance owner and by a guest, against a model of their lives.

A seeded random history (``KVB_NSWATCH_SEED`` replays one) creates
namespaces of a small pool with random owners (the instance owner, the
guest, another user), commits into them, commits into removed ones
(``ENOTSUP``), and removes them -- sometimes together with a commit, which
either fails ``ENOTSUP`` or counts before the removal -- from random ranks
of a size-4 instance: one request at a time, or one task per name, all at
once (see :data:`MODES`).  The model keeps each *incarnation* of a name: its owner,
when it was created and removed, and its commits' versions and values.
What each watcher must get follows from docs/protocol.md:

* ``kvs-watch.namespaces`` (every rank; prefixes ``""`` and ``job-``): the
  namespaces alive when it started, in creation order, then ``listed``, then
  every creation and removal in order; a guest's shows only its own; every
  ``removed`` carries the epoch of the ``created`` it ends, and epochs grow.
  One started during the history must match the model from some point at
  or after its start.
* ``kvs-watch.lookup`` of ``k`` with ``WATCH|WAITCREATE`` in each namespace
  of the pool: it follows the incarnation alive when it started (else the
  next one created): its latest value then, each later commit, and
  ``ENOTSUP`` when that incarnation is removed; a guest's ends ``EPERM``
  instead when the incarnation is not the guest's.  One started during the
  history must match the model from a point near its start: no sooner
  than the last request answered through its rank (which its rank had
  heard; a busy rank may not have heard those made elsewhere since), no
  later than the requests answered when its first answer came, and the
  ones then in flight (:func:`start_window`).
  Late ones without ``WAITCREATE`` too: they follow the incarnation alive
  at that point only if ``k`` has a value there, else end ``ENOTSUP`` (no
  namespace) or ``ENOENT`` (no key).

At the end every name of the pool is alive and gets a last value, so each
watcher still following one answers it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import random
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from test_watch_helpers import (
    GUEST_PRELUDE,
    GUEST_UID,
    WAITCREATE,
    WATCH,
    stats,
    wait_until,
    wait_watchers,
)
from test_watch_model import next_message

from broker.errors import RemoteError
from broker.handle import Handle, Stream
from broker.topology import child_toward

T = 10.0
SIZE = 4
FANOUT = 2
POOL = ["job-0", "job-1", "job-2", "ns-0", "ns-1"]
PREFIXES = ["", "job-"]
OTHER_UID = 4242
BEFORE = 12  # requests before the watchers start
HISTORY = 70  # requests while they watch
LATE_WATCHERS = 12
END_NS = "job-end"  # created last, owned by the guest: every namespace watcher sees it
GUEST_RANK = 3
IN_FLIGHT = 2
"""Requests that may be in flight at once (a commit racing a removal): made
but not yet counted in :attr:`Model.now`."""


@dataclass
class Incarnation:
    """One life of a namespace name."""
    name: str
    owner: int
    created: int  # the request count when it was created
    epoch: int = -1  # as the namespace watchers report it
    removed: int | None = None
    commits: list[tuple[int, int, str]] = field(default_factory=list)  # (when, rootseq, value)


@dataclass
class Model:
    lives: list[Incarnation] = field(default_factory=list)
    events: list[tuple[int, str, Incarnation]] = field(default_factory=list)
    """(when, "created" | "removed", incarnation), in the order rank 0 made them."""
    now: int = 0  # requests made so far
    via: list[int] = field(default_factory=list)
    """The rank whose handle made each request."""

    def count(self, rank: int) -> None:
        """A request made through ``rank``'s handle is done."""
        self.via.append(rank)
        self.now += 1

    def alive(self, name: str, when: int | None = None) -> Incarnation | None:
        """The incarnation of ``name`` alive after ``when`` requests (default: now)."""
        when = self.now if when is None else when
        for life in self.lives:
            if life.name == name and life.created < when and (
                    life.removed is None or life.removed >= when):
                return life
        return None

    def followed(self, name: str, start: int) -> Incarnation | None:
        """What a key watcher started after ``start`` requests follows."""
        return self.alive(name, start) or next(
            (life for life in self.lives if life.name == name and life.created >= start), None)


def sees(owner: int, guest: bool) -> bool:
    return not guest or owner == GUEST_UID


NsEvent = tuple[str, str, int]  # (event, namespace, owner); ("listed", "", -1)


def ns_expected(model: Model, start: int, prefix: str, guest: bool) -> list[NsEvent]:
    """A namespace watcher started after ``start`` requests: the list, then the changes."""
    def shown(life: Incarnation) -> bool:
        return life.name.startswith(prefix) and sees(life.owner, guest)
    listed = [life for _, kind, life in model.events
              if kind == "created" and model.alive(life.name, start) is life and shown(life)]
    out: list[NsEvent] = [("created", life.name, life.owner) for life in listed]
    out.append(("listed", "", -1))
    out += [(kind, life.name, life.owner) for when, kind, life in model.events
            if when >= start and shown(life)]
    return out


def key_expected(model: Model, name: str, start: int, guest: bool, waitcreate: bool = True,
                 ) -> tuple[list[tuple[int, str]], int]:
    """Answers ``(rootseq, value)`` of a watcher of ``k`` in ``name``
    started after ``start`` requests, and its end (0: still running).
    Without ``waitcreate`` it follows only the incarnation alive then
    (none: ``ENOTSUP``), and only if ``k`` has a value there (``ENOENT``)."""
    life = model.followed(name, start) if waitcreate else model.alive(name, start)
    if life is None and not waitcreate:
        return [], errno.ENOTSUP
    assert life is not None, "the end of the history creates every name of the pool"
    if not sees(life.owner, guest):
        return [], errno.EPERM
    before = [(seq, v) for when, seq, v in life.commits if when < start]
    if not before and not waitcreate:
        return [], errno.ENOENT
    out = before[-1:] + [(seq, v) for when, seq, v in life.commits if when >= start]
    return out, errno.ENOTSUP if life.removed is not None else 0


def start_window(model: Model, rank: int, start: int, first_at: int) -> range:
    """The points a key watcher sent on ``rank``'s handle after ``start``
    requests may begin at.  No sooner than the last request answered
    through its rank: an answer travels behind its request's events, so
    the rank had heard that one (a rank busy beside other work may lag
    the others by any number of requests made elsewhere).  No later than
    what was made when its first answer was read (``first_at`` requests
    answered, and :data:`IN_FLIGHT` more): it began before it answered.
    (A fixed two requests after its start was once the bound, and a loaded
    run's rank 3 began a watcher after a removal three requests on.)"""
    heard = [i for i in range(start) if model.via[i] == rank
             or child_toward(rank, model.via[i], FANOUT) is not None]
    low = heard[-1] + 1 if heard else 0
    return range(low, min(model.now, first_at + IN_FLIGHT) + 1)


async def wait_started(h: Handle, rank: int) -> None:
    """Until kvs-watch on ``h``'s rank has a root for every monitor and no
    lookup in flight."""
    async def check() -> bool:
        st = await stats(h)
        return bool(st["monitors-starting"] == 0 and st["lookups-in-flight"] == 0)
    await wait_until(check, T, f"rank {rank}'s key watchers to start")


# ------------------------------------------------------------------ watchers

@dataclass
class NsWatcher:
    prefix: str
    rank: int
    start: int
    stream: Stream
    late: bool = False
    """Started during the history (one started at its first request has the
    first watchers' ``start`` too, but its list may already hold that
    request's namespace: it was not waited for)."""
    got: list[NsEvent] = field(default_factory=list)
    epochs: list[tuple[str, str, int]] = field(default_factory=list)

    async def read(self, until_listed: bool = False) -> None:
        """Until the namespace made last is reported (or its list is done)."""
        while True:
            msg = await next_message(self.stream, self.describe(), self.got)
            assert msg is not None, f"{self.describe()}: ended; got {self.got}"
            p = msg.payload
            if p["event"] == "listed":
                self.got.append(("listed", "", -1))
                if until_listed:
                    return
                continue
            self.got.append((p["event"], p["namespace"], p["owner"]))
            self.epochs.append((p["event"], p["namespace"], p["epoch"]))
            if p["namespace"] == END_NS:
                return

    def describe(self) -> str:
        return f"namespace watcher {self.prefix!r} on rank {self.rank} from request {self.start}"


def epochs_consistent(epochs: list[tuple[str, str, int]]) -> str:
    """Epochs grow with each creation; a removal names its creation's."""
    last, current = -1, {}
    for kind, name, epoch in epochs:
        if kind == "created":
            if epoch <= last:
                return f"created {name} at epoch {epoch} after epoch {last}"
            last, current[name] = epoch, epoch
        elif current.pop(name, None) != epoch:
            return f"removed {name} with epoch {epoch}, created with another"
    return ""


@dataclass
class KeyWatcher:
    name: str
    rank: int
    stream: Stream
    got: list[tuple[int, str]] = field(default_factory=list)
    end: int | None = None
    start: int = 0  # requests made before it was sent
    waitcreate: bool = True
    first_at: int | None = None
    """Requests answered when its first answer (or its end) was read."""

    async def read(self, now: Callable[[], int] | None = None) -> None:
        """Until the last value, or the end of the stream; ``now()``, the
        requests answered so far, is noted at the first answer."""
        try:
            while True:
                msg = await next_message(self.stream, f"k in {self.name} on rank {self.rank}",
                                         self.got)
                if self.first_at is None and now is not None:
                    self.first_at = now()
                if msg is None:
                    self.end = 0
                    return
                value = bytes(msg.payload["val"]["data"]).decode()
                self.got.append((int(msg.payload["rootseq"]), value))
                if value == "end":
                    return
        except RemoteError as exc:
            if self.first_at is None and now is not None:
                self.first_at = now()
            self.end = exc.errnum


GUEST_BODY = """
POOL, END_NS = {pool!r}, {end!r}

async def body(h):
    nsw = h.rpc_stream("kvs-watch.namespaces", {{}})
    keys = {{name: h.rpc_stream("kvs-watch.lookup", {{"namespace": name, "key": "k",
                                                    "flags": {flags}}})
             for name in POOL}}
    out = {{"ns": [], "epochs": [], "keys": {{n: [] for n in POOL}}, "ends": {{}}}}

    async def read_ns(until_listed):
        while True:
            p = (await asyncio.wait_for(nsw.next_message(), 30)).payload
            if p["event"] == "listed":
                out["ns"].append(["listed", "", -1])
                if until_listed:
                    return
                continue
            out["ns"].append([p["event"], p["namespace"], p["owner"]])
            out["epochs"].append([p["event"], p["namespace"], p["epoch"]])
            if p["namespace"] == END_NS:
                return

    async def read_key(name, s):
        try:
            while True:
                msg = await asyncio.wait_for(s.next_message(), 30)
                if msg is None:
                    out["ends"][name] = 0
                    return
                value = msg.payload["val"]["data"].decode()
                out["keys"][name].append([msg.payload["rootseq"], value])
                if value == "end":
                    return
        except RemoteError as exc:
            out["ends"][name] = exc.errnum

    await read_ns(True)
    print("ready", flush=True)
    await asyncio.gather(read_ns(False), *(read_key(n, s) for n, s in keys.items()))
    return out
"""


async def start_guest(uri: str) -> asyncio.subprocess.Process:
    src = GUEST_PRELUDE.format(uid=GUEST_UID) + textwrap.dedent(GUEST_BODY.format(
        pool=POOL, end=END_NS, flags=WATCH | WAITCREATE)) + textwrap.dedent("""
        print(json.dumps(asyncio.run(main(sys.argv[1]))))
    """)
    env = dict(os.environ)
    env.pop("KVBROKER_URI", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", src, uri, cwd="/", env=env,
        stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    assert line == b"ready\n", f"the guest did not start: {line!r}"
    return proc


# ------------------------------------------------------------------ the test

MODES = ["one at a time", "names at once"]
"""One request at a time, in one order the model knows; or one task per
name of the pool, all at once, each also committing and removing its
namespace together now and then (a commit from a far rank, relayed, racing
the removal: it fails ENOTSUP, or it counts, before the removal).  The
order of requests on different names is then rank 0's: namespace watchers
are checked name by name."""


@pytest.mark.parametrize("mode", MODES)
async def test_namespace_and_key_watchers_follow_namespace_lives(start_instance, connect,
                                                                 mode: str) -> None:
    seed = int(os.environ.get("KVB_NSWATCH_SEED", random.randrange(1 << 30)))
    rng = random.Random(f"{seed} {mode}")
    where = f"{mode}, KVB_NSWATCH_SEED={seed}"
    inst = await start_instance(size=SIZE, fanout=FANOUT,
                                attrs={"access.allow-guest-user": "true"})
    handles: list[Handle] = [await connect(inst, r) for r in range(SIZE)]
    me = os.getuid()
    model = Model()
    primary = Incarnation("primary", me, created=-1)
    model.lives.append(primary)
    model.events.append((-1, "created", primary))

    def removed(name: str, rank: int) -> None:
        life = model.alive(name)
        if life is not None:
            life.removed = model.now
            model.events.append((model.now, "removed", life))
        model.count(rank)

    def committed(name: str, life: Incarnation | None, r: Any, rank: int,
                  racing: bool = False) -> None:
        """A commit into ``name`` answered ``r`` (an exception if it failed);
        ``racing`` its removal, it may have lost."""
        if isinstance(r, RemoteError):
            assert (life is None or racing) and r.errnum == errno.ENOTSUP, \
                f"{where}: commit into {name} ({life}): {r}"
        else:
            assert not isinstance(r, BaseException), f"{where}: commit into {name}: {r!r}"
            assert life is not None, f"{where}: a commit into removed {name} succeeded"
            life.commits.append((model.now, int(r["rootseq"]), r["value"]))
        model.count(rank)

    def commit_rpc(rank: int, name: str, value: str) -> Any:
        async def go() -> Any:
            r = await asyncio.wait_for(handles[rank].rpc("kvs.commit", {
                "namespace": name, "flags": 0, "ops": [
                    {"key": "k", "flags": 0,
                     "dirent": {"ver": 1, "type": "val", "data": value.encode()}}]}), T)
            return {**r, "value": value}
        return go()

    def remove_rpc(rank: int, name: str) -> Any:
        return asyncio.wait_for(handles[rank].rpc(
            "kvs.namespace-remove", {"namespace": name}), T)

    async def create(rng: random.Random, name: str, owner: int) -> None:
        rank = rng.randrange(SIZE)
        await asyncio.wait_for(handles[rank].rpc(
            "kvs.namespace-create", {"namespace": name, "owner": owner}), T)
        life = Incarnation(name, owner, model.now)
        model.lives.append(life)
        model.events.append((model.now, "created", life))
        model.count(rank)

    async def put(rng: random.Random, name: str, value: str) -> None:
        life = model.alive(name)
        rank = rng.randrange(SIZE)
        try:
            r = await commit_rpc(rank, name, value)
        except RemoteError as exc:
            r = exc
        committed(name, life, r, rank)

    async def random_request(rng: random.Random, name: str, together: bool = False) -> None:
        roll = rng.random()
        if roll < 0.3 and model.alive(name) is None:
            await create(rng, name, rng.choice([me, GUEST_UID, OTHER_UID]))
        elif roll < 0.45:
            rank = rng.randrange(SIZE)
            await remove_rpc(rank, name)  # a missing one: success, and no event
            removed(name, rank)
        elif roll < 0.55 and together:
            life = model.alive(name)
            value = f"v{model.now}"
            rc, rr = rng.randrange(SIZE), rng.randrange(SIZE)
            c, _ = await asyncio.gather(commit_rpc(rc, name, value), remove_rpc(rr, name),
                                        return_exceptions=True)
            committed(name, life, c, rc, racing=True)  # if it counted: before the removal
            removed(name, rr)
        else:
            await put(rng, name, f"v{model.now}")

    for _ in range(BEFORE):
        await random_request(rng, rng.choice(POOL))

    # The watchers that start first, counted on their ranks before the history.
    start = model.now
    nsws = [NsWatcher(prefix, r, start, handles[r].rpc_stream("kvs-watch.namespaces",
                                                              {"prefix": prefix}))
            for r in range(SIZE) for prefix in PREFIXES]
    keyws = [KeyWatcher(name, r, handles[r].rpc_stream("kvs-watch.lookup", {
                 "namespace": name, "key": "k", "flags": WATCH | WAITCREATE}))
             for r in range(SIZE) for name in POOL]
    guest = await start_guest(inst.uri(GUEST_RANK))
    # (a guest's watcher of a namespace alive and not its own has ended EPERM)
    guest_running = 1 + sum(1 for name in POOL if (life := model.alive(name, start)) is None
                            or sees(life.owner, guest=True))
    for r in range(SIZE):
        await wait_watchers(handles[r], len(PREFIXES) + len(POOL)
                            + (guest_running if r == GUEST_RANK else 0), timeout=T)
    # Counted is not yet started: a namespace watcher starts when rank 0
    # answers its list (a removal made before that is not in the list, and
    # its event is dropped), a key watcher when its monitor has a root and
    # its first lookup is answered.  The history waits for both.
    await asyncio.gather(*(w.read(until_listed=True) for w in nsws))
    for r in range(SIZE):
        await wait_started(handles[r], r)

    late_keyws: list[KeyWatcher] = []
    late_reads: list[asyncio.Future[None]] = []  # (read as they go: when each first answers)
    if mode == "one at a time":
        late_at = set(rng.sample(range(HISTORY), LATE_WATCHERS))
        for i in range(HISTORY):
            if i in late_at:
                r, prefix = rng.randrange(SIZE), rng.choice(PREFIXES)
                nsws.append(NsWatcher(prefix, r, model.now, handles[r].rpc_stream(
                    "kvs-watch.namespaces", {"prefix": prefix}), late=True))
                for waitcreate in (True, False):
                    r, name = rng.randrange(SIZE), rng.choice(POOL)
                    late = KeyWatcher(name, r, handles[r].rpc_stream(
                        "kvs-watch.lookup", {"namespace": name, "key": "k", "flags": WATCH | (
                            WAITCREATE if waitcreate else 0)}), start=model.now,
                        waitcreate=waitcreate)
                    late_keyws.append(late)
                    late_reads.append(asyncio.ensure_future(late.read(lambda: model.now)))
            await random_request(rng, rng.choice(POOL), together=True)
    else:
        async def one_name(name: str) -> None:
            nrng = random.Random(f"{seed} {mode} {name}")
            for _ in range(HISTORY // len(POOL) * 2):
                await random_request(nrng, name, together=True)
        await asyncio.gather(*(one_name(name) for name in POOL))
    for name in POOL:  # every name alive, with a last value
        if model.alive(name) is None:
            await create(rng, name, rng.choice([me, GUEST_UID, OTHER_UID]))
        await put(rng, name, "end")
    await create(rng, END_NS, GUEST_UID)

    await asyncio.gather(*(w.read() for w in nsws), *(w.read() for w in keyws), *late_reads)
    assert guest.stdout is not None
    out, _ = await asyncio.wait_for(guest.communicate(), 30)
    assert guest.returncode == 0, f"{where}: the guest failed"
    g = json.loads(out.decode().strip().splitlines()[-1])

    # In order when one request went at a time; name by name when they did not.
    by_name = mode != "one at a time"

    def differs(got: list[NsEvent], want: list[NsEvent]) -> bool:
        if not by_name:
            return got != want
        return sorted(got, key=lambda e: e[1]) != sorted(want, key=lambda e: e[1]) or any(
            [e for e in got if e[1] == name] != [e for e in want if e[1] == name]
            for name in {e[1] for e in want})

    failures: list[str] = []
    for w in nsws:
        if not w.late:
            want = ns_expected(model, start, w.prefix, guest=False)
            if differs(w.got, want):
                failures.append(f"{w.describe()}:\n    want {want}\n    got  {w.got}")
        elif not any(w.got == ns_expected(model, p, w.prefix, guest=False)
                     for p in range(w.start, model.now + 1)):
            failures.append(f"{w.describe()}: matches the model from no point on:\n"
                            f"    got {w.got}")
        if bad := epochs_consistent(w.epochs):
            failures.append(f"{w.describe()}: {bad}")
    want = ns_expected(model, start, "", guest=True)
    if differs([tuple(e) for e in g["ns"]], want):
        failures.append(f"the guest's namespace watcher:\n    want {want}\n    got  {g['ns']}")
    if bad := epochs_consistent([tuple(e) for e in g["epochs"]]):
        failures.append(f"the guest's namespace watcher: {bad}")
    for w in keyws:
        want_k, want_end = key_expected(model, w.name, start, guest=False)
        if (w.got, w.end or 0) != (want_k, want_end):
            failures.append(f"k in {w.name} on rank {w.rank}:\n    want {want_k} then "
                            f"{want_end}\n    got  {w.got} then {w.end}")
    for w in late_keyws:
        # It began at whatever its rank had heard when it came.
        assert w.first_at is not None  # (its read ended: it answered)
        near = start_window(model, w.rank, w.start, w.first_at)
        if not any((w.got, w.end or 0) == key_expected(model, w.name, p, False, w.waitcreate)
                   for p in near):
            failures.append(f"k in {w.name} on rank {w.rank} from request {w.start}"
                            f"{'' if w.waitcreate else ' (no WAITCREATE)'}: matches "
                            f"the model from no point in {near}:\n    got  {w.got} then {w.end}")
    for name in POOL:
        want_k, want_end = key_expected(model, name, start, guest=True)
        got = ([tuple(a) for a in g["keys"][name]], g["ends"].get(name, 0))
        if got != (want_k, want_end):
            failures.append(f"the guest's k in {name}:\n    want {want_k} then {want_end}"
                            f"\n    got  {got[0]} then {got[1]}")
    assert not failures, f"{where}: {len(failures)} watchers differ:\n" + "\n".join(failures) \
        + "\nhistory:\n" + "\n".join(
            f"  {when}: {kind} {life.name} (owner {life.owner})"
            for when, kind, life in model.events)
