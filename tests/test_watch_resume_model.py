"""Watches on a reconnecting handle, across restarts of their rank, against
the model of tests/test_watch_model.py.

Rank 1 of a 2-rank instance (started from a bootstrap file, as under
systemd) is killed twice during a random history of commits made on rank
0, more commits are made while it is down, and it is started again.  The
watches on it -- plain, ``uniq``, ``full``, ``waitcreate``, ``deletes``,
and key watches -- are made on a handle connected with ``reconnect=True``,
so each is sent again once the rank is back (docs/api.md, Reconnecting);
an ``append`` watch of a value the history mostly appends to, too.
What each must yield follows from the model, version by version:

* until the kill, what the watch answers (:func:`test_watch_model.predict`);
  the test kills the rank only once its kvs-watch has answered every
  version so far (nothing in flight), so nothing answered is lost;
* from the version the rank is back at (no commit is made until every
  watch has been sent again), what a new watch answers there, except that
  its first answer is not yielded if it holds the value yielded last (the
  change made meanwhile comes once; no change, nothing) -- and a key
  removed meanwhile ends a plain watch ``ENOENT``, a ``waitcreate`` one
  waits, a ``deletes`` one yields one removal; an ``append`` watch yields
  the bytes appended meanwhile, or ends ``EINVAL`` if the value no longer
  starts with the bytes it yielded (missing included);
* a key watch yields, after the restart, the keys changed since the last
  root it yielded, in one answer (none if nothing changed), then follows;
* a namespace watch (a second test, namespaces created and removed at
  random) yields, after the restart, a ``removed`` for each namespace it
  knew that is gone or came back as another, then a ``created`` for each
  one new to it, then follows.

The history is drawn from a seed (``KVB_RESUME_SEED`` replays one).
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from test_handle_reconnect import Restartable, inst  # noqa: F401 (a fixture)
from test_multihost import brokers  # noqa: F401 (a fixture)
from test_watch_helpers import wait_until
from test_watch_model import (
    APPEND,
    DELETES,
    FULL,
    UNIQ,
    WAITCREATE,
    WATCH,
    History,
    Val,
    find,
    keys_expected,
    model_diff,
    predict,
    random_op,
)
from test_watch_nsmodel import Incarnation, Model

from broker.errors import RemoteError
from broker.handle import Handle
from kvs.client import KVS
from kvs_watch.client import watch, watch_keys, watch_namespaces

T = 10.0
HISTORY = 60
RESTARTS = 2
OUTAGE_COMMITS = (1, 5)  # commits made while the rank is down

VALUE_WATCHES: list[tuple[str, dict[str, bool]]] = [
    ("m.a", {}),
    ("m.a", {"uniq": True}),
    ("m.a", {"full": True}),
    ("m.a", {"waitcreate": True}),
    ("m.a", {"deletes": True}),
    ("m.a", {"deletes": True, "uniq": True}),
    ("m.b.c", {"waitcreate": True}),
    ("m.b.c", {"waitcreate": True, "full": True}),
    ("m.b.c", {"deletes": True, "waitcreate": True}),
    ("m.b.c", {"deletes": True}),
    ("m.log", {"append": True, "waitcreate": True}),
]
KEY_WATCHES = [".", "m", "m.b"]


def history_op(rng: random.Random) -> dict[str, Any]:
    """:func:`test_watch_model.random_op`, but ``m.log`` is mostly appended
    to, so its append watch lives through the restarts (a rewrite ends it)."""
    op = random_op(rng)
    if op["key"] == "m.log" and not op["flags"] & 32 and rng.random() < 0.85:
        op = {"key": "m.log", "flags": 32,
              "dirent": {"ver": 1, "type": "val", "data": rng.choice([b"x", b"y"])}}
    return op


def flags_of(options: dict[str, bool]) -> int:
    return WATCH | sum(bit for name, bit in (("uniq", UNIQ), ("full", FULL),
                                              ("waitcreate", WAITCREATE),
                                              ("deletes", DELETES),
                                              ("append", APPEND)) if options.get(name))


_NOTHING = object()


def up(start: int, final: int, outages: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The stretches ``(from, to)`` the rank was up, from ``start`` to
    ``final``, around ``outages`` of ``(went down after, back at)``."""
    froms = [start] + [back for _, back in outages]
    tos = [down for down, _ in outages] + [final]
    return list(zip(froms, tos, strict=True))


def predict_resumed(key: str, flags: int, hist: History, start: int, final: int,
                    outages: list[tuple[int, int]]) -> tuple[list[Any], int]:
    """What the watch yields over ``start``..``final`` when its rank was
    down between versions ``a`` and ``r`` of each outage (everything up to
    ``a`` answered, the watch sent again at ``r``)."""
    if flags & APPEND:
        return append_resumed(key, flags, hist, start, final, outages)
    out: list[Any] = []
    last: Any = _NOTHING
    for i, (s, e) in enumerate(up(start, final, outages)):
        answers, end = predict(key, flags, hist, s, e)
        if i and answers and last is not _NOTHING and answers[0][1] == last:
            answers = answers[1:]  # the value yielded last: not again
        out += answers
        if answers:
            last = answers[-1][1]
        if end:
            return out, end
    return out, 0


def append_resumed(key: str, flags: int, hist: History, start: int, final: int,
                   outages: list[tuple[int, int]]) -> tuple[list[Any], int]:
    """An append watch (``waitcreate``): after a restart the new watch's
    value must start with the bytes yielded so far (else ``EINVAL``, a key
    missing then included), and only the rest is yielded; then the new
    watch's appends."""
    out: list[Any] = []
    delivered = b""
    for i, (s, e) in enumerate(up(start, final, outages)):
        answers, end = predict(key, flags, hist, s, e)
        if i:
            node = find(hist.states[s], key)
            now = node.data if isinstance(node, Val) else b""
            if not now.startswith(delivered):
                return out, errno.EINVAL
            if answers and answers[0][0] == s:  # the new watch's whole value
                rest = now[len(delivered):]
                answers = ([(s, rest)] if rest else []) + answers[1:]
        out += answers
        delivered += b"".join(data or b"" for _, data in answers)
        if end:
            return out, end
    return out, 0


def keys_resumed(key: str, hist: History, start: int, final: int,
                 outages: list[tuple[int, int]]) -> list[tuple[int, list[str]]]:
    """A key watch's answers: its first, each version's keys, and after each
    outage one answer with the keys changed since the last root it yielded."""
    out: list[tuple[int, list[str]]] = []
    for i, (s, e) in enumerate(up(start, final, outages)):
        seg = keys_expected(key, hist, s, e, [])
        if i:
            since = out[-1][0]
            changed = sorted(k for k in model_diff(hist.states[since], hist.states[s])
                             if key == "." or k == key or k.startswith(key + "."))
            seg = ([(s, changed)] if changed else []) + seg[1:]
        out += seg
    return out


def folds_into(got: list[Any], want: list[Any]) -> bool:
    """``got`` is ``want``, or ``want`` with runs of successive answers
    each folded into its last: the version of the last, the bytes of all.
    An ``append`` watch (without ``deletes``) folds the roots it queues once
    it is ``FOLD_DEPTH`` behind (kvs_watch/watcher.py), as on a loaded
    machine it may be."""
    i = 0
    for version, data in got:
        joined = b""
        while i < len(want) and want[i][0] <= version:
            joined += want[i][1] or b""
            i += 1
        if not (i and want[i - 1][0] == version and joined == data):
            return False
    return i == len(want)


def folding(flags: int) -> bool:
    return bool(flags & APPEND and not flags & DELETES)


def yielded(r: Reader, flags: int, want: list[Any]) -> bool:
    """``r`` has yielded ``want``, folded as its watch may fold."""
    return folds_into(r.got, want) if folding(flags) else r.got == want


def caught_up_with(r: Reader, flags: int, want: list[Any]) -> bool:
    """``r`` has yielded as many answers as ``want`` (what they hold is
    checked at the end), or, folding, all of ``want``'s bytes."""
    return folds_into(r.got, want) if folding(flags) else len(r.got) >= len(want)


@dataclass
class Reader:
    """A watch on the reconnecting handle and what it yielded."""
    what: str
    got: list[Any] = field(default_factory=list)
    end: int | None = None  # errno that ended it; None: running
    task: asyncio.Future[None] | None = None


async def none_behind(behind: Callable[[], list[str]], where: str) -> None:
    """Until ``behind()`` (the watches that have not yielded what the model
    says they yield by now) is empty; else fail, naming them."""
    async def check() -> bool:
        return not behind()
    try:
        await wait_until(check, T, "")
    except AssertionError:
        raise AssertionError(f"{where}: watches behind the model:\n"
                             + "\n".join(behind())) from None


async def read_value_watch(r: Reader, w: Any, final: asyncio.Future[int],
                           appending: bool = False) -> None:
    try:
        async with w:
            while (e := await next_until(r, w, final)) is not None:
                if r.got and appending and r.got[-1][0] == e.rootseq:  # one blob of a version
                    r.got[-1] = (e.rootseq, r.got[-1][1] + e.value)
                else:
                    r.got.append((e.rootseq, None if e.removed else e.value))
        r.end = 0
    except StopAsyncIteration:
        r.end = 0
    except RemoteError as exc:
        r.end = exc.errnum


async def read_key_watch(r: Reader, w: Any, final: asyncio.Future[int]) -> None:
    async with w:
        while (c := await next_until(r, w, final)) is not None:
            r.got.append((c.rootseq, sorted(c.keys)))
    r.end = 0


async def next_until(r: Reader, w: Any, final: asyncio.Future[int]) -> Any:
    """The watch's next item, or None once it has yielded the history's last
    version; after the last commit, the next item comes within ``T``."""
    def over() -> bool:
        return final.done() and bool(r.got) and r.got[-1][0] >= final.result()
    if over():
        return None
    nxt = asyncio.ensure_future(anext(w))
    await asyncio.wait([nxt, final], return_when=asyncio.FIRST_COMPLETED)
    if not nxt.done():
        if over():  # its last item came before the last commit's answer
            nxt.cancel()
            return None
        try:
            await asyncio.wait_for(asyncio.shield(nxt), T)
        except TimeoutError:
            nxt.cancel()
            raise AssertionError(f"{r.what}: nothing for {T}s after the last commit "
                                 f"(version {final.result()}); got {r.got}") from None
    return nxt.result()


async def test_watches_resume_across_restarts_as_the_model_says(inst: Restartable) -> None:  # noqa: F811
    seed = int(os.environ.get("KVB_RESUME_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    where = f"KVB_RESUME_SEED={seed}"
    async with asyncio.timeout(90), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h1:
        h0 = kvs0.handle
        hist = History()
        done: list[tuple[int, list[dict[str, Any]]]] = []

        async def commit(ops: list[dict[str, Any]]) -> int:
            r = await asyncio.wait_for(h0.rpc("kvs.commit", {
                "namespace": "primary", "flags": 0, "ops": ops}), T)
            done.append((int(r["rootseq"]), ops))
            hist.replay(done)
            return int(r["rootseq"])

        async def settled(version: int, created: int | None = None) -> None:
            """Rank 1's kvs-watch is at ``version`` with nothing in flight
            (and has made ``created`` watches in all)."""
            seen: dict[str, Any] = {}

            async def check() -> bool:
                st = seen["stats"] = await h0.rpc("kvs-watch.stats-get", {}, nodeid=1)
                return (st["namespaces"].get("primary", {}).get("rootseq") == version
                        and st["monitors-starting"] == 0 and st["lookups-in-flight"] == 0
                        and (created is None or st["counts"]["watchers-created"] == created))
            try:
                await wait_until(check, T, "")
            except AssertionError:
                st = seen.get("stats", {})
                raise AssertionError(
                    f"{where}: rank 1's kvs-watch not settled at version {version} "
                    f"({created} watches made): {st.get('namespaces')}, "
                    f"{st.get('monitors-starting')} starting, {st.get('lookups-in-flight')} "
                    f"in flight, {st.get('counts', {}).get('watchers-created')} made") from None

        root = await h0.rpc("kvs.getroot", {"namespace": "primary"})
        hist.record(int(root["rootseq"]), [], {})
        start = await commit([op for op in (random_op(rng) for _ in range(4))
                              if op["key"] != "z.other"])
        await KVS(h1).wait_version(start, timeout=T)
        final: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        readers: list[tuple[Reader, str, int]] = []
        for key, options in VALUE_WATCHES:
            r = Reader(f"watch({key!r}, {options})")
            r.task = asyncio.ensure_future(read_value_watch(
                r, watch(h1, key, **options), final, appending=bool(options.get("append"))))
            readers.append((r, key, flags_of(options)))
        keyed: list[tuple[Reader, str]] = []
        for key in KEY_WATCHES:
            r = Reader(f"watch_keys({key!r})")
            r.task = asyncio.ensure_future(read_key_watch(r, watch_keys(h1, key), final))
            keyed.append((r, key))
        created = len(VALUE_WATCHES) + len(KEY_WATCHES)
        await settled(start, created)

        outages: list[tuple[int, int]] = []

        async def caught_up(version: int) -> int:
            """Until every watch has yielded what the model says it yields up
            to ``version`` (or ended); the number still running."""
            def behind() -> list[str]:
                out = []
                for r, key, flags in readers:
                    want, end = predict_resumed(key, flags, hist, start, version, outages)
                    if not caught_up_with(r, flags, want) or (end and r.end is None):
                        out.append(f"{r.what}: want {want} then {end}, got {r.got}")
                for r, key in keyed:
                    want_keys = keys_resumed(key, hist, start, version, outages)
                    if len(r.got) < len(want_keys):
                        out.append(f"{r.what}: want {want_keys}, got {r.got}")
                return out

            await none_behind(behind, f"{where}: at version {version}, outages {outages}")
            return sum(1 for r, *_ in readers + keyed if r.end is None)

        kill_at = sorted(rng.sample(range(5, HISTORY - 5), RESTARTS))
        version = start
        for i in range(HISTORY):
            if i in kill_at:
                await settled(version)
                running = await caught_up(version)
                await inst.kill_rank1()
                a = version
                for _ in range(rng.randint(*OUTAGE_COMMITS)):
                    version = await commit([history_op(rng) for _ in range(rng.randint(1, 3))])
                await inst.start_rank1()
                # every watch still running is sent again (to a new process:
                # its counts start at 0)
                created = running
                await settled(version, created)
                outages.append((a, version))
            version = await commit([history_op(rng) for _ in range(rng.randint(1, 3))])
        # a new value for every watched key: each watch still running yields it
        version = await commit([{"key": key, "flags": flags, "dirent": {
            "ver": 1, "type": "val", "data": data}} for key, flags, data in (
                ("m.a", 0, b"end-a"), ("m.b.c", 0, b"end-c"), ("m.log", 32, b"end-log"))])
        final.set_result(version)
        await asyncio.gather(*(r.task for r, *_ in readers + keyed if r.task))
        assert h1.reconnects == RESTARTS

        failures = []
        for r, key, flags in readers:
            want, want_end = predict_resumed(key, flags, hist, start, version, outages)
            if not yielded(r, flags, want) or r.end != want_end:
                failures.append(f"{r.what}:\n    want {want} then {want_end}"
                                f"\n    got  {r.got} then {r.end}")
        for r, key in keyed:
            want_keys = keys_resumed(key, hist, start, version, outages)
            if r.got != want_keys:
                failures.append(f"{r.what}:\n    want {want_keys}\n    got  {r.got}")
        assert not failures, (
            f"{where}: outages (version before, version back at) {outages}; "
            f"{len(failures)} watches differ:\n" + "\n".join(failures)
            + "\nhistory:\n" + "\n".join(f"  {v}: {hist.ops[v]}" for v in sorted(hist.ops)))


# --- namespace watches ---------------------------------------------------------

NS_POOL = ["job-0", "job-1", "job-2", "ns-0", "ns-1"]
NS_HISTORY = 40
SYNC_NS = "job-zz-back-{}"  # made once the rank is back: where each resume batch ends
END_NS = "job-zz-end"  # made last: every namespace watch (both prefixes) sees it


def ns_resumed(model: Model, start: int, prefix: str,
               outages: list[tuple[int, int]]) -> list[tuple[str, str, int, bool]]:
    """What a namespace watch (``listed=True``) yields from request ``start``
    when its rank was down from request ``k`` to ``b`` of each outage: the
    list, ``listed``, the changes; after each outage, a ``removed`` for each
    namespace it knew that is gone or came back as another, then a
    ``created`` (not initial) for each one new to it, in creation order."""
    def shown(life: Incarnation) -> bool:
        return life.name.startswith(prefix)

    def alive(when: int) -> list[Incarnation]:
        return [life for _, kind, life in model.events if kind == "created"
                and model.alive(life.name, when) is life and shown(life)]

    out = [("created", life.name, life.owner, True) for life in alive(start)]
    out.append(("listed", "", -1, False))
    known = {life.name: life for life in alive(start)}
    for i, (s, e) in enumerate(up(start, model.now, outages)):
        if i:
            now = {life.name: life for life in alive(s)}
            for name, old in list(known.items()):
                if now.get(name) is not old:
                    del known[name]
                    out.append(("removed", name, old.owner, False))
            for name, life in now.items():
                if name not in known:
                    known[name] = life
                    out.append(("created", name, life.owner, False))
        for when, kind, life in model.events:
            if s <= when < e and shown(life):
                out.append((kind, life.name, life.owner, False))
                if kind == "created":
                    known[life.name] = life
                else:
                    known.pop(life.name, None)
    return out


async def test_namespace_watches_resume_across_restarts_as_the_model_says(
        inst: Restartable) -> None:  # noqa: F811
    """Namespaces created and removed at random on rank 0 while a namespace
    watch on rank 1 (a reconnecting handle) lives through two restarts of
    its rank, with namespaces created and removed while it is down."""
    seed = int(os.environ.get("KVB_RESUME_SEED", random.randrange(1 << 30)))
    rng = random.Random(f"{seed} namespaces")
    where = f"KVB_RESUME_SEED={seed}"
    me = os.getuid()
    async with asyncio.timeout(90), KVS.connect(inst.rank0.uri) as kvs0, \
            Handle.connect(inst.uri1, reconnect=True) as h1:
        h0 = kvs0.handle
        model = Model()
        primary = Incarnation("primary", me, created=-1)
        model.lives.append(primary)
        model.events.append((-1, "created", primary))

        async def create(name: str) -> None:
            owner = rng.choice([me, 4242])
            await asyncio.wait_for(h0.rpc("kvs.namespace-create",
                                          {"namespace": name, "owner": owner}), T)
            life = Incarnation(name, owner, model.now)
            model.lives.append(life)
            model.events.append((model.now, "created", life))
            model.now += 1

        async def remove(name: str) -> None:
            await asyncio.wait_for(h0.rpc("kvs.namespace-remove", {"namespace": name}), T)
            life = model.alive(name)
            if life is not None:
                life.removed = model.now
                model.events.append((model.now, "removed", life))
            model.now += 1

        async def random_request() -> None:
            name = rng.choice(NS_POOL)
            await (create(name) if model.alive(name) is None else remove(name))

        for _ in range(4):
            await random_request()
        start = model.now
        watches = {prefix: Reader(f"watch_namespaces({prefix!r})") for prefix in ("", "job-")}
        streams = {prefix: watch_namespaces(h1, prefix, listed=True) for prefix in watches}
        outages: list[tuple[int, int]] = []

        async def read(prefix: str) -> None:
            r, w = watches[prefix], streams[prefix]
            async with w:
                async for e in w:
                    r.got.append((e.event, e.namespace, e.owner, e.initial))
                    if e.namespace == END_NS:
                        return

        tasks = [asyncio.ensure_future(read(prefix)) for prefix in watches]

        async def caught_up() -> None:
            """Until each watch has yielded what the model says so far."""
            def behind() -> list[str]:
                return [f"{r.what}: want {want}, got {r.got}" for prefix, r in watches.items()
                        if len(r.got) < len(want := ns_resumed(model, start, prefix, outages))]

            await none_behind(behind, f"{where}: outages {outages}")

        await caught_up()
        kill_at = sorted(rng.sample(range(3, NS_HISTORY - 3), RESTARTS))
        for i in range(NS_HISTORY):
            if i in kill_at:
                await caught_up()
                await inst.kill_rank1()
                k = model.now
                for _ in range(rng.randint(*OUTAGE_COMMITS)):
                    await random_request()
                await inst.start_rank1()
                b = model.now
                outages.append((k, b))
                # A namespace made now is seen either in the new list or as
                # a change after it -- the same to the reader, once the
                # resume batch is out: it marks where the batch ends.
                await create(SYNC_NS.format(len(outages)))
                await caught_up()
            await random_request()
        await create(END_NS)
        await asyncio.wait_for(asyncio.gather(*tasks), T)
        assert h1.reconnects == RESTARTS

        failures = []
        for prefix, r in watches.items():
            want = ns_resumed(model, start, prefix, outages)
            if r.got != want:
                failures.append(f"{r.what}:\n    want {want}\n    got  {r.got}")
        assert not failures, (
            f"{where}: outages (request before, request back at) {outages}:\n"
            + "\n".join(failures) + "\nhistory:\n" + "\n".join(
                f"  {when}: {kind} {life.name}" for when, kind, life in model.events))
