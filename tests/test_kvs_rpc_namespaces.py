"""KVS namespaces over raw RPCs: create, remove, list, isolation, rootref, removal.

Reference: flux-core t/t1004-kvs-namespace.t and src/modules/kvs/kvs.c.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import sys
import time

import pytest
from test_broker_support import stop_process, stopped, wait_until
from test_kvs_rpc_helpers import (
    GUEST_PRELUDE,
    GUEST_UID,
    READDIR,
    TREEOBJ,
    T,
    commit,
    errnum,
    get,
    getroot,
    lookup,
    put,
    stats,
)

from broker.errors import RemoteError
from broker.handle import Handle
from kvs import treeobj
from kvs.client import KVS

SIZES = pytest.mark.parametrize("size", [1, 4])


def ns_create(h, name: str, owner: int = -1, **extra):
    return asyncio.wait_for(
        h.rpc("kvs.namespace-create", {"namespace": name, "owner": owner, **extra}), T)


def ns_remove(h, name: str):
    return asyncio.wait_for(h.rpc("kvs.namespace-remove", {"namespace": name}), T)


async def ns_list(h) -> dict[str, dict]:
    resp = await asyncio.wait_for(h.rpc("kvs.namespace-list", {}), T)
    return {d["namespace"]: d for d in resp["namespaces"]}


async def barrier(writer, followers) -> None:
    """Every event rank 0 published so far has reached ``followers``' kvs:
    a new primary version is published after them (events are ordered)."""
    resp = await commit(writer, put("barrier", "x"))
    for h in followers:
        await asyncio.wait_for(h.rpc("kvs.wait-version", {
            "namespace": "primary", "rootseq": resp["rootseq"]}), T)


@SIZES
async def test_create_list_remove(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h0 = await connect(inst, 0)
    hl = await connect(inst, size - 1)
    owner = await asyncio.wait_for(h0.attr_get("security.owner"), T)
    listed = await ns_list(hl)
    assert set(listed) == {"primary"}
    assert listed["primary"]["owner"] == owner
    await ns_create(h0, "ns-a")
    await ns_create(hl, "ns-b", owner=4242)
    listed = await ns_list(h0)
    assert set(listed) == {"primary", "ns-a", "ns-b"}
    assert listed["ns-a"]["owner"] == owner and listed["ns-a"]["rootseq"] == 0
    assert listed["ns-b"]["owner"] == 4242
    assert (await getroot(hl, "ns-b"))["owner"] == 4242
    # EEXIST, from any rank, including for primary
    for h in (h0, hl):
        assert await errnum(ns_create(h, "ns-a")) == errno.EEXIST
        assert await errnum(ns_create(h, "primary")) == errno.EEXIST
        # primary cannot be removed; removing an unknown namespace succeeds
        assert await errnum(ns_remove(h, "primary")) == errno.ENOTSUP
        # ("" names primary, as in every other request: it answered {})
        assert await errnum(ns_remove(h, "")) == errno.ENOTSUP
        await ns_remove(h, "never-existed")
    await ns_remove(hl, "ns-a")
    assert set(await ns_list(hl)) == {"primary", "ns-b"}
    # re-created after remove: a fresh, empty namespace
    await ns_create(h0, "ns-a")
    assert (await getroot(hl, "ns-a"))["rootseq"] == 0


@SIZES
async def test_namespaces_are_isolated(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h0 = await connect(inst, 0)
    hs = [await connect(inst, r) for r in range(size)]
    await ns_create(h0, "one")
    await ns_create(h0, "two")
    await commit(hs[-1], put("k", "p"))
    await commit(hs[-1], put("k", "1"), ns="one")
    r2 = await commit(hs[-1], put("k", "2"), put("only.two", "x"), ns="two")
    assert r2["rootseq"] == 1  # versions are per namespace
    for h in hs:
        await asyncio.wait_for(h.rpc("kvs.wait-version",
                                     {"namespace": "two", "rootseq": 1}), T)
        assert await get(h, "k") == b"p"
        assert await get(h, "k", ns="one") == b"1"
        assert await get(h, "k", ns="two") == b"2"
        assert await errnum(lookup(h, "only")) == errno.ENOENT
        assert set((await lookup(h, ".", READDIR, ns="two"))["data"]) == {"k", "only"}
    assert (await getroot(hs[0], "one"))["rootseq"] == 1
    assert (await getroot(hs[0]))["rootseq"] == 1


@SIZES
async def test_unknown_namespace_is_enotsup(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    for rank in {0, size - 1}:
        h = await connect(inst, rank)
        assert await errnum(lookup(h, "k", ns="nosuch")) == errno.ENOTSUP
        assert await errnum(commit(h, put("k", "v"), ns="nosuch")) == errno.ENOTSUP
        assert await errnum(getroot(h, "nosuch")) == errno.ENOTSUP
        assert await errnum(h.rpc("kvs.wait-version", {
            "namespace": "nosuch", "rootseq": 1})) == errno.ENOTSUP
        assert await errnum(h.rpc("kvs.lookup-plus", {
            "key": "k", "flags": 0, "namespace": "nosuch"})) == errno.ENOTSUP


@SIZES
async def test_removed_namespace_on_every_rank(start_instance, connect, size) -> None:
    inst = await start_instance(size=size, fanout=2)
    h0 = await connect(inst, 0)
    hs = [await connect(inst, r) for r in range(size)]
    await ns_create(h0, "gone")
    resp = await commit(hs[-1], put("k", "v"), ns="gone")
    for h in hs:  # every rank has loaded "gone" (and primary, for the barrier)
        await asyncio.wait_for(h.rpc("kvs.wait-version", {
            "namespace": "gone", "rootseq": resp["rootseq"]}), T)
        assert await get(h, "k", ns="gone") == b"v"
        await getroot(h)
    await ns_remove(hs[-1], "gone")
    await barrier(h0, hs)
    for h in hs:
        assert await errnum(get(h, "k", ns="gone")) == errno.ENOTSUP
        assert await errnum(commit(h, put("k", "w"), ns="gone")) == errno.ENOTSUP
        assert await errnum(getroot(h, "gone")) == errno.ENOTSUP
    assert "gone" not in await ns_list(h0)
    # re-created: every rank sees the new, empty namespace, not the old root
    await ns_create(h0, "gone")
    for h in hs:
        root = await getroot(h, "gone")
        assert root["rootseq"] == 0
        assert await errnum(get(h, "k", ns="gone")) == errno.ENOENT
    resp = await commit(hs[0], put("k2", "new"), ns="gone")
    for h in hs:
        await asyncio.wait_for(h.rpc("kvs.wait-version", {
            "namespace": "gone", "rootseq": resp["rootseq"]}), T)
        assert await get(h, "k2", ns="gone") == b"new"


async def test_create_with_rootref(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    await ns_create(h0, "src")
    await commit(h3, put("d.v", "foobar"), ns="src")
    rootref = (await getroot(h3, "src"))["rootref"]
    await ns_create(h3, "copy", rootref=rootref)
    root = await getroot(h3, "copy")
    assert (root["rootref"], root["rootseq"]) == (rootref, 0)
    assert await get(h3, "d.v", ns="copy") == b"foobar"
    # they do not clobber each other
    await commit(h3, put("d.v", "42"), ns="src")
    await commit(h3, put("d.v", "43"), ns="copy")
    assert await get(h3, "d.v", ns="src") == b"42"
    assert await get(h3, "d.v", ns="copy") == b"43"
    # a dirref of a subdirectory works as an initial root too
    sub = await lookup(h3, "d", TREEOBJ, ns="src")
    await ns_create(h0, "subcopy", rootref=sub["data"][0])
    assert await get(h0, "v", ns="subcopy") == b"42"
    # a malformed rootref is EINVAL; a well-formed one naming no blob is
    # refused with ENOENT (Flux accepts it and fails later lookups instead)
    assert await errnum(ns_create(h0, "bad1", rootref="sha256-zz")) == errno.EINVAL
    assert await errnum(ns_create(h3, "bad2", rootref="sha256-" + "0" * 64)) == errno.ENOENT
    # a blob that is not a directory cannot be a root
    await commit(h3, put("big", b"v" * 100), ns="src")
    value_blob = (await lookup(h3, "big", TREEOBJ, ns="src"))["data"][0]
    assert await errnum(ns_create(h3, "bad3", rootref=value_blob)) == errno.EINVAL
    # nor can an inner shard of a big directory (only part of it), as for a
    # commit's dirref (it was accepted)
    await commit(h0, *(put(f"h.k{i}", "v") for i in range(3000)), ns="src")
    top = (await lookup(h0, "h", TREEOBJ, ns="src"))["data"][0]
    async with asyncio.timeout(10):
        shards = treeobj.decode((await h0.rpc("content.load", {"blobref": top}))["data"])
        inner = [ref for ref in shards["data"]["shards"].values()
                 if treeobj.decode((await h0.rpc("content.load", {"blobref": ref}))["data"])
                 ["type"] == "hdir"]
    assert inner, "the test needs a directory big enough for inner shards"
    assert await errnum(ns_create(h0, "bad4", rootref=inner[0])) == errno.EINVAL
    await ns_create(h0, "whole", rootref=top)  # the top shard is the directory
    assert await get(h0, "k2999", ns="whole") == b"v"
    assert set(await ns_list(h0)) == {"primary", "src", "copy", "subcopy", "whole"}


async def test_bad_namespace_requests(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    for rank in (0, 2):
        h = await connect(inst, rank)
        for name in ("", "has space", "a/b", "a::b", "x" * 300, "primary\n", "a\nb", ".", ".."):
            assert await errnum(ns_create(h, name)) == errno.EINVAL, name
        assert await errnum(h.rpc("kvs.namespace-create", {"owner": -1})) == errno.EPROTO
        assert await errnum(h.rpc("kvs.namespace-create",
                                  {"namespace": 7, "owner": -1})) == errno.EPROTO
        for bad in ({"owner": "me"}, {"owner": True}, {"owner": -2}, {"owner": 2**40},
                    {"owner": -1, "flags": "x"}, {"owner": -1, "flags": None},
                    {"owner": -1, "rootref": 5}):
            n = await errnum(h.rpc("kvs.namespace-create", {"namespace": "ok", **bad}))
            assert n == errno.EPROTO, (bad, n)
        assert await errnum(h.rpc("kvs.namespace-remove", {})) == errno.EPROTO
        assert await errnum(h.rpc("kvs.namespace-remove", None)) == errno.EPROTO
    assert set(await ns_list(h)) == {"primary"}
    # 2**32 - 1 is no user, as -1 (Flux's FLUX_USERID_UNKNOWN): the owner's
    await asyncio.wait_for(h.rpc("kvs.namespace-create",
                                 {"namespace": "nobody", "owner": 2**32 - 1}), T)
    assert (await ns_list(h))["nobody"]["owner"] == os.getuid()


async def test_remove_while_commits_are_in_flight(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    await ns_create(h0, "busy")
    await getroot(h3)  # rank 3 follows primary (for the barrier below)
    # a slow commit being applied, and more queued behind it, from rank 0 and 3
    futs = [asyncio.ensure_future(commit(h0, put("big", b"b" * (8 << 20)), ns="busy",
                                         timeout=30))]
    futs += [asyncio.ensure_future(commit(h, put(f"k{i}", "v"), ns="busy", timeout=30))
             for i, h in enumerate([h0, h3] * 5)]
    await asyncio.sleep(0)
    await ns_remove(h0, "busy")
    results = await asyncio.gather(*futs, return_exceptions=True)
    for r in results:  # each one answered: applied before the removal, or ENOTSUP
        assert not isinstance(r, TimeoutError), results
        if isinstance(r, BaseException):
            assert getattr(r, "errnum", None) == errno.ENOTSUP, results
    await barrier(h0, [h3])
    assert await errnum(getroot(h3, "busy")) == errno.ENOTSUP
    # the name is free again
    await ns_create(h0, "busy")
    assert (await getroot(h3, "busy"))["rootseq"] == 0


async def test_follower_loading_a_namespace_under_commits(start_instance, connect) -> None:
    """Requests racing a follower's first load of a namespace, while setroot
    events overtake its getroot: every answer carries the real owner."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    for i in range(15):
        name = f"race{i}"
        await ns_create(h0, name, owner=4242)
        commits = [asyncio.ensure_future(commit(h0, put(f"k{j}", "v"), ns=name))
                   for j in range(20)]
        await asyncio.sleep(0.001 * (i % 5))  # (not a wait: varies where the race lands)
        roots = await asyncio.gather(*[getroot(h3, name) for _ in range(20)])
        await asyncio.gather(*commits)
        assert {r["owner"] for r in roots} == {4242}, roots
        assert all(r["namespace"] == name for r in roots)


async def test_a_version_wait_goes_with_its_client_even_mid_load(start_instance, connect) -> None:
    """A client that leaves while its kvs.wait-version is still waiting for
    rank 3 to load the namespace from rank 0 (or before the wait ran at all)
    leaves no waiter behind: the disconnect finds it (it found nothing, and
    the waiter stayed until that far-off version or the namespace's end)."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    for i in range(10):
        await ns_create(h0, f"lz{i}")
    for i in range(10):
        h = await Handle.connect(inst.uri(3))
        pending = h.rpc("kvs.wait-version", {"namespace": f"lz{i}", "rootseq": 10**9})
        pending.add_done_callback(lambda f: f.cancelled() or f.exception())
        await h.close()

    async def no_waiters() -> bool:
        st = await h0.rpc("kvs.stats-get", {}, nodeid=3)
        return not any(v["waiters"] for v in st["namespaces"].values())

    await wait_until(no_waiters, "rank 3 to drop the departed clients' waits")
    # and a load another request shares is not cut short by a departed waiter
    await ns_create(h0, "shared")
    h = await Handle.connect(inst.uri(3))
    gone = h.rpc("kvs.wait-version", {"namespace": "shared", "rootseq": 10**9})
    gone.add_done_callback(lambda f: f.cancelled() or f.exception())
    h3 = await connect(inst, 3)
    root = asyncio.ensure_future(getroot(h3, "shared"))
    await h.close()
    assert (await root)["rootseq"] == 0


async def test_a_relay_for_a_removed_namespace_never_lands_in_its_successor(
        start_instance, connect) -> None:
    """A follower's relay names the namespace *and* which one: getroot's
    ``epoch``, new for every namespace-create.  Removed and created again
    with the same name, the namespace has a new epoch, and rank 0 refuses a
    relay for the old one (ENOTSUP) instead of applying it to the new one,
    whose client was already told ENOTSUP."""
    inst = await start_instance(size=2, fanout=2)
    h0 = await connect(inst, 0)
    await ns_create(h0, "job")
    old = (await getroot(h0, "job"))["epoch"]
    await ns_remove(h0, "job")
    await ns_create(h0, "job")
    new = (await getroot(h0, "job"))["epoch"]
    assert new != old
    txn = {"name": "late", "flags": 0, "ops": [put("stale", "1")]}
    n = await errnum(h0.rpc("kvs.relaycommit", {"namespace": "job", "epoch": old,
                                                 "txns": [txn]}))
    assert n == errno.ESTALE  # (its follower makes the commit again: see below)
    root = await getroot(h0, "job")
    assert root["rootseq"] == 0
    # the current epoch is queued as ever (no response: the setroot answers)
    h0.send_noresponse("kvs.relaycommit", {"namespace": "job", "epoch": new,
                                           "txns": [{**txn, "name": "fresh"}]})
    await asyncio.wait_for(h0.rpc("kvs.wait-version", {"namespace": "job", "rootseq": 1}), T)
    assert (await get(h0, "stale", ns="job")) == b"1"


async def relays_from(h: Handle) -> int:
    """How many relay messages ``h``'s rank has sent rank 0."""
    return (await asyncio.wait_for(h.rpc("kvs.stats-get", {}), T))["counts"]["relays"]


async def relayed_while_stopped(h: Handle, before: int) -> None:
    """Wait until ``h``'s rank has relayed another message (which its
    stopped parent holds)."""
    async def relayed() -> bool:
        return await relays_from(h) > before

    await wait_until(relayed, "the far rank to relay the commit")


@pytest.mark.parametrize("created_again", [True, False])
async def test_a_commit_sent_after_a_namespace_is_made_again_lands_on_a_lagging_rank(
        start_instance, connect, created_again) -> None:
    """A client removes and creates a namespace again through rank 0, then
    commits into it through rank 3, which still holds the old one: rank 1,
    between rank 3 and rank 0, is stopped, so rank 3 has heard neither event
    and relays the commit for the old namespace.  Rank 0 refuses it, and
    rank 3 hears the removal; the client was told ``ENOTSUP namespace job was
    removed`` for a commit it sent after the new namespace's create was
    answered (fresh-clone CI, test_watch_nsmodel).  Rank 3 now makes the
    commit again once it has heard the removal, and it lands in the new
    namespace; with none created again, it still ends ENOTSUP."""
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    await ns_create(h0, "job")
    await commit(h3, put("k", "old"), ns="job")  # rank 3 holds the namespace
    before = await relays_from(h3)
    async with stopped(inst.pids()[1]):
        await ns_remove(h0, "job")
        if created_again:
            await ns_create(h0, "job")
        late = asyncio.ensure_future(commit(h3, put("k", "new"), ns="job"))
        await relayed_while_stopped(h3, before)
    if created_again:
        answer = await late
        assert answer["rootseq"] == 1, answer
        assert await get(h0, "k", ns="job") == b"new"
        assert await get(h3, "k", ns="job") == b"new"  # (its writer reads it)
    else:
        assert await errnum(late) == errno.ENOTSUP
        assert await errnum(getroot(h0, "job")) == errno.ENOTSUP
    counts = (await stats(h3))["counts"]
    # (with none created again, rank 0 may have refused it as gone: not
    # made again)
    assert counts["commits-relayed-again"] in ((1,) if created_again else (0, 1)), counts
    assert counts["commits"] == 2, counts  # (the one made again counted once)


async def test_a_version_wait_with_the_commits_epoch_waits_for_the_new_namespace(
        start_instance, connect) -> None:
    """Read-your-writes across ranks (docs/kvs.md "Consistency"): commit on
    rank 0, wait for its version on rank 3, read there.  Across a removal
    and creation of the namespace that rank 3 has not heard yet (rank 1,
    between it and rank 0, stopped), a bare version number is answered at
    once by the old namespace, which is past it, and a read then finds the
    old keys (a probe: 3 rounds in 300).  The commit's answer names its
    namespace's ``epoch``, and a wait given it (``wait_version(result)``)
    waits until rank 3 holds that very namespace; one of an epoch removed
    since is ENOTSUP."""
    inst = await start_instance(size=4, fanout=2)
    k0 = KVS(await connect(inst, 0), "job")
    k3 = KVS(await connect(inst, 3), "job")
    await k0.namespace_create("job")
    for i in range(5):
        old = await k0.put("x", f"old{i}")
    await k3.wait_version(old, timeout=T)  # rank 3 holds the namespace, at 5
    assert await k3.get_str("x") == "old4"
    async with stopped(inst.pids()[1]):
        await k0.namespace_remove("job")
        await k0.namespace_create("job")
        new = await k0.put("x", "new")
        assert new.rootseq == 1 and new.epoch is not None and new.epoch > old.epoch
        # the bare number: answered by the old namespace, stale (the limit)
        assert await k3.wait_version(new.rootseq, timeout=T) == 5
        assert await k3.get_str("x") == "old4"
        with pytest.raises(TimeoutError, match="still holds an older namespace job"):
            await k3.wait_version(new, timeout=0.3)
        exact = asyncio.ensure_future(k3.wait_version(new, timeout=T))
        done, _ = await asyncio.wait({exact}, timeout=0.5)
        assert not done, exact.result()  # (rank 3 cannot hear the removal yet)
    assert await asyncio.wait_for(exact, T) == 1
    assert await k3.get_str("x") == "new"
    with pytest.raises(RemoteError) as exc:  # (the old one's epoch: removed)
        await k3.wait_version(old, timeout=T)
    assert exc.value.errnum == errno.ENOTSUP
    assert exc.value.errstr == (f"namespace job is at epoch {new.epoch}, not {old.epoch} "
                                "(that one was removed, or never given)")
    with pytest.raises(RemoteError) as exc:  # (never given: it said "was removed")
        await k0.wait_version(1, epoch=0, timeout=T)
    assert exc.value.errnum == errno.ENOTSUP
    assert "not 0 (that one was removed, or never given)" in exc.value.errstr
    with pytest.raises(ValueError, match="in namespace job, not primary"):
        await k3.with_namespace("primary").wait_version(new, timeout=T)
    for kvs, ns in ((k0, "job"), (k3, "job"), (k3, "primary")):
        with pytest.raises(RemoteError) as exc:  # (rank 0 gave no such epoch: a
            # follower asks it, where it waited for a removal for ever)
            await kvs.with_namespace(ns).wait_version(1, epoch=new.epoch + 1)
        assert exc.value.errnum == errno.EINVAL, (kvs, ns)
    with pytest.raises(RemoteError) as exc:
        await k3.handle.rpc("kvs.wait-version", {"namespace": "job", "rootseq": 1,
                                                 "epoch": "1"})
    assert exc.value.errnum == errno.EPROTO


async def test_epochs_are_times_not_a_count_of_namespaces(start_instance, connect) -> None:
    """A namespace's epoch (which a guest sees of its own: commit answers,
    kvs-watch's namespace events) was the count of namespaces created
    since rank 0 started, so the gap between two of a guest's told how many
    others anyone had created between them (a security probe).  It is the
    time of the creation in microseconds now, one more than the last if
    that is not later: still increasing, and telling only when."""
    inst = await start_instance(size=2)
    kvs = KVS(await connect(inst, 1))
    epochs = []
    for i in range(6):
        before = time.time_ns() // 1000
        await kvs.namespace_create(f"e{i}")
        epochs.append((await getroot(kvs.handle, f"e{i}"))["epoch"])
        assert before <= epochs[-1] <= time.time_ns() // 1000, (before, epochs)
    assert epochs == sorted(set(epochs)), epochs
    await kvs.namespace_remove("e0")
    await kvs.namespace_create("e0")
    assert (await getroot(kvs.handle, "e0"))["epoch"] > epochs[-1]


GUEST_LATE_COMMIT = """
async def body(h):
    first = await commit(h, "mine", put("k", val("first")))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    return [first, await commit(h, "mine", put("k", val("late")))]
"""


async def test_a_guest_commit_made_again_is_checked_against_the_new_owner(
        start_instance, connect) -> None:
    """A guest's commit into its own namespace, relayed by a rank that has
    not heard the namespace removed and created again for another user, is
    made again only with the new owner's permission: ``EPERM``, and the new
    namespace is untouched (it was ENOTSUP before commits were made again;
    made again without the check, it would land)."""
    inst = await start_instance(size=4, fanout=2,
                                attrs={"access.allow-guest-user": "true"})
    h0 = await connect(inst, 0)
    h3 = await connect(inst, 3)
    await ns_create(h0, "mine", owner=GUEST_UID)
    src = GUEST_PRELUDE.format(uid=GUEST_UID) + GUEST_LATE_COMMIT + (
        "\nprint(json.dumps(asyncio.run(main(sys.argv[1])), default=str))\n")
    env = {k: v for k, v in os.environ.items() if k != "KVBROKER_URI"}
    guest = await asyncio.create_subprocess_exec(
        sys.executable, "-c", src, inst.uri(3), cwd="/", env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        assert guest.stdout is not None and guest.stdin is not None
        assert await asyncio.wait_for(guest.stdout.readline(), 30) == b"ready\n"
        before = await relays_from(h3)
        async with stopped(inst.pids()[1]):
            await ns_remove(h0, "mine")
            await ns_create(h0, "mine", owner=4242)
            guest.stdin.write(b"go\n")
            await guest.stdin.drain()
            await relayed_while_stopped(h3, before)
        out, _ = await asyncio.wait_for(guest.communicate(), 30)
    finally:
        if guest.returncode is None:
            guest.kill()
            await guest.wait()
    first, late = json.loads(out.decode().splitlines()[-1])
    assert "ok" in first, first
    assert late == {"errnum": errno.EPERM}, late
    assert (await getroot(h0, "mine"))["rootseq"] == 0


async def test_a_version_wait_given_up_while_its_namespace_loads_logs_nothing(tmp_path) -> None:
    """A client that sends a version wait for a namespace to a far rank and
    goes at once: the rank's load of the namespace ends ENOTSUP with nobody
    to read it, which logged "Task exception was never retrieved" at ERROR."""
    from broker.launch import Instance

    log = tmp_path / "ranks.log"
    inst = Instance(4, fanout=2, stderr_path=str(log))
    await asyncio.wait_for(inst.start(), 60)
    try:
        watcher = await Handle.connect(inst.uri(0))
        for i in range(5):
            h = await Handle.connect(inst.uri(0))
            wait = h.rpc("kvs.wait-version", {"namespace": f"nosuch{i}", "rootseq": 1},
                         nodeid=3)
            await h.close()
            assert isinstance(wait.exception(), RemoteError)  # "handle closed"

        async def settled() -> bool:
            return [(await watcher.rpc("broker.stats-get", {}, nodeid=r))["sent-down"]
                    for r in (0, 1)] == [0, 0]

        await wait_until(settled, "the waits to be dropped on the way to rank 3")
        await watcher.close()
    finally:
        await asyncio.wait_for(inst.stop(), 60)
    text = log.read_text()
    assert "never retrieved" not in text and "Traceback" not in text, text


async def _loading(h, name: str, rpcs: int = 1) -> None:
    """Wait until ``h``'s rank is loading ``name`` (its placeholder shows
    rootseq -1) with ``rpcs`` RPCs of its kvs sent and unanswered."""
    async def sent() -> bool:
        st = await stats(h)
        held = st["namespaces"].get(name)
        return held is not None and held["rootseq"] == -1 and st["rpcs-pending"] == rpcs

    await wait_until(sent, f"the kvs to ask rank 0 for {name}")


async def _follows(h0, h, name: str) -> None:
    """``h``'s rank follows ``name`` as rank 0 has it: loaded at rank 0's
    root, or heard created (and then answers a getroot with ``heard`` at
    rank 0's root, every event having arrived: see barrier)."""
    root = await getroot(h0, name)
    st = await stats(h)
    loaded = st["namespaces"].get(name)
    if loaded is not None:
        assert loaded["rootseq"] == root["rootseq"] and st["heard"] == 0, (st, root)
    else:
        assert st["heard"] == 1, st
    heard = await asyncio.wait_for(h.rpc("kvs.getroot", {"namespace": name, "heard": True}), T)
    assert (heard["rootseq"], heard["rootref"], heard["epoch"]) == (
        root["rootseq"], root["rootref"], root["epoch"])


async def test_a_first_load_overtaken_by_remove_and_create_reads_the_new_namespace(
        start_instance, connect) -> None:
    """Rank 2 asks rank 0 for "job" (its first use there) while rank 0
    removes "job" and creates it again: the removed and created events reach
    rank 2 before the answer, which names the new namespace.  The request was
    refused ENOTSUP (the removed event had marked the load's placeholder)
    though "job" existed; it is answered from the new namespace, and rank 2
    follows it.  Rank 1, between them, is stopped to hold the request."""
    inst = await start_instance(size=3, fanout=1)  # a chain: 0 - 1 - 2
    h0 = await connect(inst, 0)
    h2 = await connect(inst, 2)
    await ns_create(h0, "job")
    await commit(h0, put("k", "old"), ns="job")
    await barrier(h0, [h2])
    rank1 = inst.pids()[1]
    await stop_process(rank1)
    try:
        read = asyncio.ensure_future(lookup(h2, "k", ns="job"))
        await _loading(h2, "job")
        await ns_remove(h0, "job")
        await ns_create(h0, "job")
        await commit(h0, put("k", "new"), ns="job")
    finally:
        os.kill(rank1, signal.SIGCONT)
    assert (await read)["data"] == b"new"
    await barrier(h0, [h2])
    await _follows(h0, h2, "job")


async def test_a_namespace_created_as_its_load_is_refused_is_heard(
        start_instance, connect) -> None:
    """Rank 1 asks rank 0 for "late", which does not exist yet, and rank 0
    creates it right after answering ENOTSUP: the answer and the created
    event reach rank 1 together.  The event was dropped as "a load under
    way, its getroot answers" and the load then failed, so rank 1 neither
    had nor heard "late".  The load asks again (the namespace was created
    since it asked), the request is answered from it, and rank 1 follows it.
    Rank 0 is stopped to order the two requests, rank 1 to hold the answer
    with the event."""
    inst = await start_instance(size=2, fanout=2)
    h0 = await connect(inst, 0)
    h1 = await connect(inst, 1)
    rank0, rank1 = inst.pids()
    await stop_process(rank0)
    try:
        read = asyncio.ensure_future(lookup(h1, "k", ns="late"))
        await _loading(h1, "late")
        # through rank 1's kvs, so rank 0 reads it after the getroot
        create = asyncio.ensure_future(ns_create(h1, "late"))
        await _loading(h1, "late", rpcs=2)
        await stop_process(rank1)
    finally:
        os.kill(rank0, signal.SIGCONT)
    try:
        await wait_until(lambda: _exists(h0, "late"), "rank 0 to create late")
        await commit(h0, put("k", "v"), ns="late")
    finally:
        os.kill(rank1, signal.SIGCONT)
    await create
    assert (await read)["data"] == b"v"
    await barrier(h0, [h1])
    await _follows(h0, h1, "late")


async def _exists(h, name: str) -> bool:
    return name in await ns_list(h)


async def test_a_list_of_more_namespaces_than_a_link_carries_comes_in_parts(
        start_instance, connect) -> None:
    """1,500 namespaces are ~200 KB of list, over the smallest
    ``tbon.max-message`` (64 KiB): asked as a stream, ``kvs.namespace-list``
    comes in parts that each cross the link, one snapshot (one epoch), so
    ``KVS.namespace_list``, ``kvs namespace list`` and a namespace watch on
    a follower see them all; asked as one answer (Flux's way) it is
    ``EMSGSIZE`` from the follower, as any answer too big for its link."""
    inst = await start_instance(size=2, attrs={"tbon.max-message": "65536"})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    names = [f"job-{i:04}" for i in range(1500)]
    async with asyncio.timeout(120):
        await asyncio.gather(*(h0.rpc("kvs.namespace-create", {
            "namespace": n, "owner": os.getuid(), "flags": 0}) for n in names))
        parts = [p async for p in h1.rpc_stream("kvs.namespace-list", {})]
        assert len(parts) > 3 and len({p["epoch"] for p in parts}) == 1
        listed = [e["namespace"] for p in parts for e in p["namespaces"]]
        assert sorted(listed) == sorted([*names, "primary"])
        with pytest.raises(RemoteError) as too_big:
            await h1.rpc("kvs.namespace-list", {})
        assert too_big.value.errnum == errno.EMSGSIZE
        roots = await KVS(h1).namespace_list()
        assert len(roots) == 1501
        async with KVS(h1).watch_namespaces("job-", listed=True) as w:
            seen = []
            async for ev in w:
                if ev.listed:
                    break
                seen.append(ev.namespace)
            assert seen == names  # (in creation order)
            await h0.rpc("kvs.namespace-create", {"namespace": "job-new",
                                                  "owner": os.getuid(), "flags": 0})
            ev = await anext(w)
            assert (ev.namespace, ev.created, ev.initial) == ("job-new", True, False)
