"""KVS security with a real guest: a client process running under another uid.

The broker learns the uid from SO_PEERCRED, so the guest is a child process
that drops to uid/gid 65534 before it connects (see ``run_guest``).
Reference: flux-core t/t1005-kvs-security.t; docs/protocol.md, KVS.
"""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from test_broker_support import install_plugin, wait_until
from test_kvs_rpc_helpers import (
    GUEST_UID,
    TREEOBJ,
    commit,
    get,
    getroot,
    lookup,
    put,
    run_guest,
    symlink,
)

from broker.launch import Instance

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a guest")
GUEST_ATTRS = {"access.allow-guest-user": "true"}


def guest(uri: str, body: str):
    return asyncio.to_thread(run_guest, uri, body)


async def test_guests_refused_unless_allowed(start_instance) -> None:
    inst = await start_instance(size=1)
    with pytest.raises(AssertionError):
        await guest(inst.uri(0), """
            async def body(h):
                return await call(h, "kvs.getroot", {"namespace": "primary"})
        """)


@pytest.mark.parametrize("size", [1, 4])
async def test_guest_in_primary_and_foreign_namespaces(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2, attrs=GUEST_ATTRS)
    h = await connect(inst, 0)
    await commit(h, put("secret", "s"))
    await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                 {"namespace": "theirs", "owner": 4242}), 10)
    await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                 {"namespace": "owned-by-owner", "owner": -1}), 10)
    await commit(h, put("k", "v"), ns="theirs")
    # the owner watches a key of "theirs" on the guest's rank
    hw = await connect(inst, size - 1)
    watching = hw.rpc_stream("kvs-watch.lookup", {"namespace": "theirs", "key": "k",
                                                  "flags": 4 | 8})  # WATCH | WAITCREATE:
    # (rank size-1 may not have the commit yet: a plain watch would end ENOENT)
    assert (await asyncio.wait_for(watching.next_message(), 10)).errnum == 0
    out = await guest(inst.uri(size - 1), """
        async def body(h):
            r = {}
            ping = await call(h, "broker.ping", {})
            r["userid"] = ping["ok"]["userid"]
            for ns in ("primary", "theirs", "owned-by-owner"):
                r[ns] = [
                    await call(h, "kvs.lookup", {"key": "secret", "flags": 0, "namespace": ns}),
                    await call(h, "kvs.lookup-plus", {"key": "k", "flags": 0,
                                                      "namespace": ns}),
                    await commit(h, ns, put("x", val("1"))),
                    await call(h, "kvs.getroot", {"namespace": ns}),
                    await call(h, "kvs.wait-version", {"namespace": ns, "rootseq": 0}),
                ]
            r["admin"] = [
                await call(h, "kvs.namespace-create", {"namespace": "mine", "owner": 65534}),
                await call(h, "kvs.namespace-remove", {"namespace": "theirs"}),
                await call(h, "kvs.namespace-list", {}),
                await call(h, "kvs.dropcache", {}),
                await call(h, "kvs.relaycommit", {"namespace": "primary", "ops": [],
                                                  "name": "forged"}, nodeid=0),
            ]
            kvs = (await call(h, "kvs.stats-get", {}))["ok"]
            watch = (await call(h, "kvs-watch.stats-get", {}))["ok"]
            r["stats"] = [sorted(kvs["namespaces"]), "cache" in kvs,
                          sorted(watch["namespaces"]),
                          await call(h, "content.stats-get", {}, nodeid=0)]
            return r
    """)
    assert out["userid"] == GUEST_UID
    for ns in ("primary", "theirs", "owned-by-owner"):
        assert out[ns] == [{"errnum": errno.EPERM}] * 5, (ns, out[ns])
    assert out["admin"] == [{"errnum": errno.EPERM}] * 5, out["admin"]
    # stats, but none of another's namespaces, nor counts that would tell
    # whether a blob guessed is stored (committing it to a namespace of its
    # own, a guest read a 4-digit value of primary from them)
    assert out["stats"] == [[], False, [], {"errnum": errno.EPERM}], out["stats"]
    assert (await getroot(h))["rootseq"] == 1  # the guest changed nothing
    assert (await getroot(h, "theirs"))["rootseq"] == 1


@pytest.mark.parametrize("size", [1, 4])
async def test_guest_in_its_own_namespace(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2, attrs=GUEST_ATTRS)
    h = await connect(inst, 0)
    await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                 {"namespace": "mine", "owner": GUEST_UID}), 10)
    await commit(h, put("ownerlink", symlink("a")), ns="mine")  # the owner may
    await commit(h, put("p", "primary-value"))
    out = await guest(inst.uri(size - 1), """
        async def body(h):
            ns = "mine"
            r = {}
            r["put"] = await commit(h, ns, put("a", val("42")), put("big", val("b" * 5000)))
            r["get"] = await call(h, "kvs.lookup", {"key": "a", "flags": 0, "namespace": ns})
            r["big"] = await call(h, "kvs.lookup", {"key": "big", "flags": 0,
                                                    "namespace": ns})
            r["append"] = await commit(h, ns, put("a", val("43"), 32))
            r["mkdir"] = await commit(h, ns, put("d", {"ver": 1, "type": "dir", "data": {}}))
            r["unlink"] = await commit(h, ns, put("d", None))
            r["readlink"] = await call(h, "kvs.lookup", {"key": "ownerlink", "flags": 2,
                                                         "namespace": ns})
            r["getroot"] = await call(h, "kvs.getroot", {"namespace": ns})
            seq = r["getroot"]["ok"]["rootseq"]
            r["wait"] = await call(h, "kvs.wait-version", {"namespace": ns, "rootseq": seq})
            r["treeobj"] = await call(h, "kvs.lookup", {"key": ".", "flags": 16,
                                                        "namespace": ns})
            bad = {
                "symlink": {"ver": 1, "type": "symlink", "data": {"target": "a"}},
                "symlink-ns": {"ver": 1, "type": "symlink",
                               "data": {"target": "p", "namespace": "primary"}},
                "valref": {"ver": 1, "type": "valref", "data": ["sha256-" + "0" * 64]},
                "dirref": {"ver": 1, "type": "dirref", "data": ["sha256-" + "0" * 64]},
                "nonempty-dir": {"ver": 1, "type": "dir", "data": {"b": val("1")}},
                "dir-with-link": {"ver": 1, "type": "dir", "data": {
                    "b": {"ver": 1, "type": "symlink", "data": {"target": "x"}}}},
            }
            r["refused"] = {k: await commit(h, ns, put("bad", v)) for k, v in bad.items()}
            r["mixed"] = await commit(h, ns, put("ok", val("1")), put("bad", bad["symlink"]))
            return r
    """)
    assert "ok" in out["put"], out
    assert out["get"]["ok"]["val"]["data"] == "42"
    assert out["big"]["ok"]["val"]["data"] == "b" * 5000
    assert "ok" in out["append"] and "ok" in out["mkdir"] and "ok" in out["unlink"], out
    assert out["readlink"]["ok"]["val"]["type"] == "symlink"
    assert out["getroot"]["ok"]["owner"] == GUEST_UID
    assert out["wait"]["ok"]["rootseq"] == out["getroot"]["ok"]["rootseq"]
    assert out["treeobj"]["ok"]["val"]["type"] == "dirref"
    assert out["refused"] == {k: {"errnum": errno.EPERM} for k in out["refused"]}, out
    assert out["mixed"] == {"errnum": errno.EPERM}
    assert await get(h, "a", ns="mine") == b"4243"
    assert await get(h, "big", ns="mine") == b"b" * 5000
    assert (await lookup(h, ".", 1, ns="mine"))["data"].keys() == {"a", "big", "ownerlink"}


async def test_guest_cross_namespace_links_and_rootdir(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=GUEST_ATTRS)
    h = await connect(inst, 0)
    for name, owner in (("mine", GUEST_UID), ("theirs", 4242)):
        await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                     {"namespace": name, "owner": owner}), 10)
    await commit(h, put("v", "theirs-value"), ns="theirs")
    await commit(h, put("v", "mine-value"), ns="mine")
    await commit(h, put("to-theirs", symlink("theirs::v")), put("to-primary", symlink(
        "p", "primary")), put("to-self", symlink("mine::v")), ns="mine")
    await commit(h, put("p", "primary-value"))
    theirs_root = await lookup(h, ".", TREEOBJ, ns="theirs")
    primary_root = await lookup(h, ".", TREEOBJ)
    out = await guest(inst.uri(3), f"""
        async def body(h):
            q = lambda key, **kw: call(h, "kvs.lookup", {{"key": key, "flags": 0,
                                                        "namespace": "mine", **kw}})
            # (on rank 0, as the commit: rank 3, asked at that root below,
            # never saw it, and asks rank 0)
            plus = await call(h, "kvs.lookup-plus", {{"key": "v", "flags": 0,
                                                      "namespace": "mine"}}, nodeid=0)
            old = {{"ver": 1, "type": "dirref", "data": [plus["ok"]["rootref"]]}}
            changed = await call(h, "kvs.commit", {{"namespace": "mine", "flags": 0, "ops": [
                {{"key": "v", "flags": 0, "dirent": {{"ver": 1, "type": "val",
                                                     "data": b"changed"}}}}]}}, nodeid=0)
            return {{
                "theirs": await q("to-theirs"),
                "primary": await q("to-primary"),
                "self": await q("to-self"),
                # Flux lets anyone read at a root reference ("get works
                # (wrong user, but with at reference)"); a blobref is a hash
                # of content, so a guest could guess one: guests read only
                # at their own namespaces' roots
                "at": await q("v", rootdir={theirs_root!r}),
                "at-theirs": await call(h, "kvs.lookup", {{"key": "v", "flags": 0,
                                        "namespace": "theirs", "rootdir": {theirs_root!r}}}),
                "at-primary": await q("p", rootdir={primary_root!r}),
                "changed": changed,
                "now": await q("v"),
                "at-own-old-root": await q("v", rootdir=old),
            }}
    """)
    assert out["theirs"] == {"errnum": errno.EPERM}
    assert out["primary"] == {"errnum": errno.EPERM}
    assert out["self"]["ok"]["val"]["data"] == "changed"  # (read after the commit)
    assert out["at"] == out["at-theirs"] == out["at-primary"] == {"errnum": errno.EPERM}
    assert "ok" in out["changed"], out
    assert out["now"]["ok"]["val"]["data"] == "changed"
    assert out["at-own-old-root"]["ok"]["val"]["data"] == "mine-value"


async def test_guest_events_and_content(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2, attrs=GUEST_ATTRS)
    h = await connect(inst, 0)
    await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                 {"namespace": "mine", "owner": GUEST_UID}), 10)
    ref = (await asyncio.wait_for(h.rpc("content.store", {"data": b"x" * 100}), 10))["blobref"]
    out = await guest(inst.uri(2), f"""
        async def body(h):
            r = {{}}
            r["pub"] = [await call(h, "event.pub", {{"topic": t, "payload": {{
                "namespace": "primary", "rootseq": 99, "rootref": "sha256-" + "0" * 64,
                "names": [], "keys": [], "owner": 0}}}})
                for t in ("kvs.namespace-primary-setroot", "kvs.namespace-mine-removed",
                          "kvs.anything", "content.x")]
            r["pub-other"] = await call(h, "event.pub", {{"topic": "guest.hello"}})
            # guests do not see the kvs namespace events (private, as in Flux)
            await h.subscribe("kvs.namespace")
            r["commit"] = await commit(h, "mine", put("a", val("1")))
            r["content"] = [
                await call(h, "content.load", {{"blobref": {ref!r}}}),
                await call(h, "content.store", {{"data": b"y"}}),
                await call(h, "content.flush", {{}}),
                await call(h, "content.checkpoint-get", {{"key": "kvs-primary"}}),
                await call(h, "content.checkpoint-put", {{"key": "k", "value": 1}}),
                await call(h, "content.checkpoint-list", {{"key": "kvs-primary"}}),
            ]
            await call(h, "broker.ping", {{}}, nodeid=0)
            r["events"] = [e.topic for e in h._events]
            return r
    """)
    assert out["pub"][:4] == [{"errnum": errno.EPERM}] * 4, out["pub"]
    assert "ok" in out["pub-other"]
    assert "ok" in out["commit"]
    assert out["content"] == [{"errnum": errno.EPERM}] * 6
    assert out["events"] == [], out["events"]
    root = await getroot(h)
    assert root["rootseq"] == 0  # the forged setroot had no effect


async def test_guest_forged_route_does_not_outlive_its_connection(start_instance, connect) -> None:
    """A client's request carries the route the broker gives it, not one the
    client wrote into the header: services key per-client state by route and
    drop it on ``<service>.disconnect``, which names the real route.  A
    forged route made a guest's watcher and version wait survive its
    connection, doing work on every commit for no one."""
    inst = await start_instance(size=2, fanout=2, attrs=GUEST_ATTRS)
    h = await connect(inst, 0)
    await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                 {"namespace": "mine", "owner": GUEST_UID}), 10)
    await commit(h, put("k", "v"), ns="mine")
    out = await guest(inst.uri(1), """
        async def body(h):
            from broker.message import Message, MsgFlags, MsgType
            r, w = await asyncio.open_unix_connection(h.uri[len("local://"):])
            dec = broker.codec.StreamDecoder()
            for tag, topic, payload, flags in (
                (1, "kvs-watch.lookup", {"namespace": "mine", "key": "k", "flags": 4},
                 MsgFlags.STREAMING),
                (2, "kvs.wait-version", {"namespace": "mine", "rootseq": 1000}, 0),
                (3, "broker.ping", {}, 0),
            ):
                w.write(broker.codec.to_stream(broker.codec.encode(Message(
                    MsgType.REQUEST, topic, payload, matchtag=tag, flags=flags,
                    route=["c99", "forged"]))))
            answers = []
            while len(answers) < 2:  # the watcher's first answer and the ping
                data = await asyncio.wait_for(r.read(65536), 10)
                answers += [broker.codec.decode(f) for f in dec.feed(data)]
            w.close()
            ping = next(m for m in answers if m.matchtag == 3).payload
            return {"tags": sorted(m.matchtag for m in answers), "route": ping["route"]}
    """)
    assert out["tags"] == [1, 3]
    assert out["route"][1:] == ["r1"] and out["route"][0][0] == "c"  # not c99!forged

    async def forgotten() -> bool:
        watch = await asyncio.wait_for(h.rpc("kvs-watch.stats-get", {}, nodeid=1), 10)
        kvs = await asyncio.wait_for(h.rpc("kvs.stats-get", {}, nodeid=1), 10)
        return watch["watchers"] == 0 and kvs["namespaces"]["mine"]["waiters"] == 0

    await wait_until(forgotten, "the guest's watcher and version wait to be dropped")


async def test_guest_takes_a_heard_root_of_its_own_namespace_only(start_instance, connect):
    """kvs.getroot with ``heard`` on a follower that heard the namespaces
    created (and has not loaded them) checks the owner the event told."""
    inst = await start_instance(size=4, fanout=2, attrs=GUEST_ATTRS)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await asyncio.wait_for(h3.subscribe("kvs.namespace-"), 10)
    for name, owner in (("mine", GUEST_UID), ("theirs", 4242)):
        await asyncio.wait_for(h0.rpc("kvs.namespace-create",
                                      {"namespace": name, "owner": owner}), 10)
    async with asyncio.timeout(10):
        seen = [(await h3.recv_event()).topic for _ in range(2)]
    assert seen == ["kvs.namespace-mine-created", "kvs.namespace-theirs-created"]
    out = await guest(inst.uri(3), """
        async def body(h):
            return {ns: await call(h, "kvs.getroot", {"namespace": ns, "heard": True})
                    for ns in ("mine", "theirs")}
    """)
    assert out["mine"]["ok"]["owner"] == GUEST_UID
    assert out["theirs"] == {"errnum": errno.EPERM}
    st = await asyncio.wait_for(h3.rpc("kvs.stats-get", {}), 10)
    assert st["counts"]["getroot-heard"] == 1 and st["namespace-count"] == 0


async def test_guest_stats_show_its_namespaces_past_the_first_hundred(start_instance,
                                                                      connect) -> None:
    """``kvs.stats-get`` and ``kvs-watch.stats-get`` detail at most 100
    namespaces, and a guest sees its own among them: the cut was made before
    the guest's filter, so a guest whose namespaces came after the rank's
    first 100 saw none of them (an empty ``namespaces``, a count of 0)."""
    inst = await start_instance(size=1, attrs=GUEST_ATTRS)
    h = await connect(inst, 0)
    for i in range(100):
        await asyncio.wait_for(h.rpc("kvs.namespace-create", {"namespace": f"other-{i}"}), 10)
    for name in ("mine", "mine-too"):
        await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                     {"namespace": name, "owner": GUEST_UID}), 10)
    watches = [h.rpc_stream("kvs-watch.lookup", {"namespace": name, "key": "k",
                                                  "flags": 4 | 8})  # WATCH | WAITCREATE
               for name in [f"other-{i}" for i in range(100)] + ["mine", "mine-too"]]

    async def all_watched() -> bool:
        st = await asyncio.wait_for(h.rpc("kvs-watch.stats-get", {}), 10)
        return bool(st["namespace-count"] == 102 and st["monitors-starting"] == 0)

    await wait_until(all_watched, "kvs-watch to follow the 102 namespaces")
    out = await guest(inst.uri(0), """
        async def body(h):
            kvs = (await call(h, "kvs.stats-get", {}))["ok"]
            watch = (await call(h, "kvs-watch.stats-get", {}))["ok"]
            return {"kvs": sorted(kvs["namespaces"]), "watch": sorted(watch["namespaces"]),
                    "watch-count": watch["namespace-count"]}
    """)
    assert out == {"kvs": ["mine", "mine-too"], "watch": ["mine", "mine-too"],
                   "watch-count": 2}, out
    owner_view = await asyncio.wait_for(h.rpc("kvs.stats-get", {}), 10)
    assert len(owner_view["namespaces"]) == 100  # (the owner's view is still cut at 100)
    for s in watches:
        h.send_noresponse("kvs-watch.cancel", {"matchtag": s.matchtag})


async def secret_read_on_rank1(start_instance, connect) -> Instance:
    """An instance of 2 ranks open to guests where an app has read, on rank
    1, a 9 KiB value of ``primary`` holding ``pin=4821`` (over
    ``kvs.setroot-blob-limit``, so rank 1 fetched it), and guest
    ``GUEST_UID`` owns namespace ``mine``: the setting of the cache-oracle
    probes, which commit guesses to ``mine`` and read them on rank 1."""
    inst = await start_instance(size=2, attrs=GUEST_ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    secret = "config\n" + "x" * 9000 + "\npin=4821\n"
    r = await commit(h0, put("app.config", secret))
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                       "rootseq": r["rootseq"]}), 10)
    assert await get(h1, "app.config") == secret.encode()  # the app reads it on rank 1
    await asyncio.wait_for(h0.rpc("kvs.namespace-create",
                                  {"namespace": "mine", "owner": GUEST_UID}), 10)
    return inst


async def test_guest_stats_tell_no_blob_a_rank_has_cached(start_instance, connect) -> None:
    """A guest's ``kvs.stats-get`` shows no ``cache`` section, since the
    blobs a rank holds tell whether a value guessed is stored; its
    ``blob-fetches`` and ``blob-loads`` counts told the same: a guest that
    committed a guess to its own namespace and read it on rank 1 saw one
    fetch fewer for the guess equal to a value of ``primary`` an app had
    read there (a 9 KiB config file: its 4-digit PIN, one guess at a time)."""
    inst = await secret_read_on_rank1(start_instance, connect)
    out = await guest(inst.uri(1), """
        async def body(h):
            seen = {}
            for pin in ("1111", "4821", "2222"):
                guess = "config\\n" + "x" * 9000 + "\\npin=" + pin + "\\n"
                await commit(h, "mine", put("guess", val(guess)))
                before = (await call(h, "kvs.stats-get", {}))["ok"]
                await call(h, "kvs.lookup", {"key": "guess", "flags": 0, "namespace": "mine"})
                after = (await call(h, "kvs.stats-get", {}))["ok"]
                seen[pin] = {k: [before.get(k), v] for k, v in after.items()
                             if v != before.get(k)}
            return seen
    """)
    assert out["4821"] == out["1111"] == out["2222"] == {}, out  # no guess stands out
    h1 = await connect(inst, 1)
    owner_view = await asyncio.wait_for(h1.rpc("kvs.stats-get", {}), 10)
    assert owner_view["counts"]["blob-fetches"] > 0  # (the owner's are all there)


GUEST_STATS_VIEWS = """
    async def body(h):
        views = {}
        for rank in (0, 1):
            for service in ("kvs", "kvs-watch", "broker", "overlay", "log"):
                views[f"{service}@{rank}"] = (await call(h, f"{service}.stats-get", {},
                                                         nodeid=rank))["ok"]
        return views
"""
"""A guest's answers to every stats-get it may send, on ranks 0 and 1."""


async def test_guest_stats_show_only_its_own(start_instance, connect, tmp_path) -> None:
    """A guest's stats views hold an allow-list of fields, all about its own
    namespaces and connections (and the health of a rank's children, as
    Flux's overlay.health): nothing instance-wide, such as the counts
    (``commits``, ``namespaces-created`` minus ``-removed``), the
    ``checkpoint``'s rootseq (primary's version), ``gc.last.kept`` (a
    guessing oracle like the cache counts), kvs-watch's ``watchers`` and
    ``events``, or the broker's messages, clients and subscriptions.  The
    owner's views keep them all."""
    statedir = tmp_path / "state"
    statedir.mkdir()
    inst = await start_instance(size=2, statedir=str(statedir), attrs=GUEST_ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    for name, owner in (("mine", GUEST_UID), ("theirs", 4242)):
        await asyncio.wait_for(h0.rpc("kvs.namespace-create",
                                      {"namespace": name, "owner": owner}), 10)
        await commit(h0, put("k", "v"), ns=name)
    await commit(h0, put("secret", "s"), flags=4)  # SYNC: checkpointed
    await asyncio.wait_for(h0.rpc("kvs.gc", {}), 30)
    watching = h1.rpc_stream("kvs-watch.lookup", {"namespace": "theirs", "key": "k",
                                                  "flags": 4 | 8})  # WATCH | WAITCREATE
    assert (await asyncio.wait_for(watching.next_message(), 10)).errnum == 0
    views = await guest(inst.uri(1), GUEST_STATS_VIEWS)
    for where, view in views.items():
        service = where.split("@")[0]
        if service in ("kvs", "kvs-watch"):
            assert sorted(view) == ["namespace-count", "namespaces", "rank"], (where, view)
            assert set(view["namespaces"]) <= {"mine"}, (where, view)
            assert view["namespace-count"] == len(view["namespaces"]), (where, view)
        else:
            assert sorted(view) == ["guests", "overlay", "rank"], (where, view)
            assert set(view["guests"]) <= {str(GUEST_UID)}, (where, view)
            # (its children's health only: no message or byte counts)
            assert set(view["overlay"]) <= {"lost", "offline", "torpid", "unjoined",
                                            "rejoined", "hosts"}, (where, view)
    assert list(views["kvs@0"]["namespaces"]) == ["mine"]
    assert views["broker@1"]["guests"][str(GUEST_UID)]["connections"] == 1
    # the owner's views are whole
    kvs = await asyncio.wait_for(h0.rpc("kvs.stats-get", {}), 10)
    assert kvs["checkpoint"]["rootseq"] == 1 and kvs["gc"]["last"]["kept"] > 0
    assert kvs["counts"]["namespaces-created"] == 2 and "cache" in kvs
    watch = await asyncio.wait_for(h1.rpc("kvs-watch.stats-get", {}), 10)
    assert watch["watchers"] == 1 and watch["events"]["received"] > 0
    assert (await asyncio.wait_for(h1.rpc("broker.stats-get", {}), 10))["messages"]["requests"]


async def test_guest_stats_tell_nothing_of_others_activity(start_instance, connect) -> None:
    """The probe of ``test_guest_stats_tell_no_blob_a_rank_has_cached``
    with the figures that were left: a guest reads every stats view it may,
    other users work in namespaces not the guest's (commits to ``theirs``
    and ``primary``, a watch on ``theirs`` on the guest's rank, a namespace
    created and removed, a collection), and the guest reads them again.
    ``commits``, ``namespaces-created``/``-removed``, ``gc.last``,
    kvs-watch's ``watchers`` and ``events.received``, the broker's message
    counts... all moved, telling the guest what others did -- or, around a
    guess it committed to a namespace of its own, whether the guess was
    stored already.  Now the two readings are the same."""
    inst = await start_instance(size=2, attrs=GUEST_ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    for name, owner in (("mine", GUEST_UID), ("theirs", 4242)):
        await asyncio.wait_for(h0.rpc("kvs.namespace-create",
                                      {"namespace": name, "owner": owner}), 10)
    await commit(h0, put("k", "v"), ns="mine")
    before = await guest(inst.uri(1), GUEST_STATS_VIEWS)
    # others' activity, none of it in the guest's namespace
    await commit(h0, put("k", "v"), ns="theirs")
    watching = h1.rpc_stream("kvs-watch.lookup", {"namespace": "theirs", "key": "k",
                                                  "flags": 4})  # WATCH
    assert (await asyncio.wait_for(watching.next_message(), 10)).errnum == 0
    await asyncio.wait_for(h0.rpc("kvs.namespace-create", {"namespace": "brief"}), 10)
    await asyncio.wait_for(h0.rpc("kvs.namespace-remove", {"namespace": "brief"}), 10)
    r = await commit(h0, put("app.config", "pin=4821"))
    await asyncio.wait_for(h1.rpc("kvs.wait-version", {"namespace": "primary",
                                                       "rootseq": r["rootseq"]}), 10)
    assert await get(h1, "app.config") == b"pin=4821"
    await asyncio.wait_for(h0.rpc("kvs.gc", {}), 30)
    after = await guest(inst.uri(1), GUEST_STATS_VIEWS)
    assert after == before, {k: (before[k], v) for k, v in after.items() if v != before[k]}
    owner_view = await asyncio.wait_for(h1.rpc("kvs-watch.stats-get", {}), 10)
    assert owner_view["watchers"] == 1  # (the watch the guest did not see)


TALLY_MODULE = '''
from typing import Any, ClassVar

from broker.module import Module


class Tally(Module):
    name: ClassVar[str] = "tally"

    def stats(self) -> dict[str, Any]:
        return {"rank": self.ctx.rank, "requests-of-all-users": self.requests}
'''


async def test_guest_sees_only_the_rank_of_a_module_s_default_stats(
        start_instance, connect, tmp_path, monkeypatch) -> None:
    """A module loaded from ``broker.modules`` that keeps the default
    ``<name>.stats-get`` shows a guest ``rank`` only: its counters are
    instance-wide like kvs's, and it has no view of a guest's own."""
    monkeypatch.setenv("PYTHONPATH", install_plugin(
        tmp_path, "tally-plugin", "[kvbroker.modules]\ntally = tallymod:Tally\n",
        {"tallymod.py": TALLY_MODULE}))
    inst = await start_instance(size=1, attrs={**GUEST_ATTRS,
                                               "broker.modules": "content,kvs,kvs-watch,tally"})
    h = await connect(inst, 0)
    assert "requests-of-all-users" in await asyncio.wait_for(h.rpc("tally.stats-get", {}), 10)
    out = await guest(inst.uri(0), """
        async def body(h):
            return await call(h, "tally.stats-get", {})
    """)
    assert out == {"ok": {"rank": 0}}, out


async def test_guest_module_list_tells_no_blob_a_rank_has_cached(start_instance,
                                                                 connect) -> None:
    """``module.list`` gave a guest each module's ``requests`` count, which
    moves with what every user does: around reading a guess it committed
    to its own namespace on rank 1, rank 0's content module counted one
    request (rank 1's fetch of the value) for the guess equal to a value of
    ``primary`` an app had read on rank 1, two for the others -- the probe
    of ``test_guest_stats_tell_no_blob_a_rank_has_cached`` through another
    door.  A guest now gets each module's name and
    services only; the owner keeps the counts."""
    inst = await secret_read_on_rank1(start_instance, connect)
    out = await guest(inst.uri(1), """
        async def body(h):
            seen = {}
            for pin in ("1111", "4821", "2222"):
                guess = "config\\n" + "x" * 9000 + "\\npin=" + pin + "\\n"
                await commit(h, "mine", put("guess", val(guess)))
                before = (await call(h, "module.list", {}, nodeid=0))["ok"]["modules"]
                await call(h, "kvs.lookup", {"key": "guess", "flags": 0, "namespace": "mine"})
                after = (await call(h, "module.list", {}, nodeid=0))["ok"]["modules"]
                seen[pin] = {a["name"]: a["requests"] - b["requests"]
                             for a, b in zip(after, before) if a != b}
            return {"seen": seen, "view": after}
    """)
    seen = out["seen"]
    assert seen["4821"] == seen["1111"] == seen["2222"] == {}, seen  # no guess stands out
    assert all(sorted(m) == ["name", "services"] for m in out["view"]), out["view"]
    h1 = await connect(inst, 1)
    mods = (await asyncio.wait_for(h1.rpc("module.list", {}), 10))["modules"]
    assert all(m["requests"] >= 0 for m in mods)  # (the owner's counts are all there)
