"""flux-core t/t0027-broker-groups.t (broker groups) against real kvbroker
ranks, with the ``groups`` module loaded on every rank.

Flux always loads its groups module; kvbroker loads it on demand (``-S
broker.modules=content,kvs,kvs-watch,groups`` or ``kvbroker module load -r
all groups``: broker/groups.py says why).  Flux's ``t/scripts/groups.py``
(get, join, waitfor, barrier) is ``kvbroker groups`` here (docs/cli.md
"groups").

Flux's cases, and what each becomes:

* broker.online contains full instance; ``module stats groups`` agrees ->
  ``groups get broker.online`` prints ``0-3``, and rank 0's ``subtree``
  stats say the same (:func:`test_broker_online_is_the_whole_instance`).
* groups.get of nonexistent group returns empty set -> an empty line
  (same test).
* groups.get on rank > 0 fails "only available on rank 0"; but ``module
  stats groups`` works there -> ``EPROTO``, and rank 1's stats show its
  subtree (:func:`test_get_is_rank_0s_and_join_is_the_local_ranks`).
* nonlocal groups.join / groups.leave fail "restricted to the local
  broker" -> ``EPROTO`` with that text (same test).
* join / leave / get with a malformed payload -> ``EPROTO``; a malformed
  ``groups.update`` (no response) is dropped and the module serves on
  (:func:`test_malformed_requests`).
* join group and explicitly leave works (twice); join group and disconnect
  works (twice) -> ``groups join NAME -- CMD`` leaves as CMD ends, and a
  membership goes with its connection
  (:func:`test_join_leave_and_disconnect`).
* join group twice fails "already a member"; leave twice fails "not a
  member" -> ``EEXIST``, ``ENOENT`` (same test).
* join on all ranks; barrier test using groups; barrier count reaches zero
  -> ``exec -r all groups barrier barrier.1`` returns on every rank, then
  ``groups waitfor -c 0 barrier.1`` returns
  (:func:`test_barrier_on_every_rank`).
* dump groups logs on rank 0 -> not tested: the module logs only what goes
  wrong (a dropped update).
* a non-streaming ``overlay.monitor`` fails -> does not apply: a child's
  loss reaches the module as the router's ``groups.disconnect``.
* (kvbroker's own) a rank lost (SIGKILL) takes its subtree out of every
  group, and a streaming get says so
  (:func:`test_a_lost_rank_leaves_its_groups`); ``module remove groups``
  on rank 1 hides its subtree until the module is back; loaded on every
  rank of a running instance at once, the groups add up whatever order
  the ranks start their modules in
  (:func:`test_module_load_and_remove_at_runtime`); a guest is refused
  (:func:`test_a_guest_is_refused`).
* (kvbroker's own, Flux ends a streaming get only with the client's
  connection) ``groups.cancel {matchtag}`` ends one: every ``Groups`` call
  that watches sends it as it stops reading, so nothing stays on rank 0 or
  in the handle (:func:`test_group_waits_that_returned_leave_nothing_behind`,
  a client-API audit's reproducer); another client's cancel does not end
  it (:func:`test_a_cancel_ends_only_the_senders_own_stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from typing import Any

import pytest
from test_broker_guests import ALLOW, run_guest_cli
from test_broker_support import KVBROKER, run_cli, wait_until
from test_watch_helpers import errnum

from broker.errors import RemoteError
from broker.groups_client import Groups

WITH_GROUPS = {"broker.modules": "content,kvs,kvs-watch,groups"}
T = 20.0


async def cli(uri: str, *args: str, rc: int = 0) -> str:
    code, out, err = await run_cli(*args, uri=uri)
    assert code == rc and (rc != 0 or err == ""), (args, code, out, err)
    return out if rc == 0 else err


async def next_members(stream: object) -> str:
    answer = await asyncio.wait_for(stream.__anext__(), T)  # type: ignore[attr-defined]
    return str(answer["members"])


async def until_members(stream: object, members: str) -> None:
    """Read a streaming ``groups.get`` until the group is ``members``: the
    ranks' updates travel up the tree one link at a time, so the sets on
    the way (a rank, then its subtree) are answered too."""
    seen = []
    async with asyncio.timeout(T):
        while (got := await next_members(stream)) != members:
            seen.append(got)
    assert members not in seen


async def test_broker_online_is_the_whole_instance(start_instance, connect) -> None:
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    assert await cli(inst.uri(3), "groups", "waitfor", "-t", "10", "broker.online") == ""
    assert await cli(inst.uri(3), "groups", "get", "broker.online") == "0-3\n"
    h = await connect(inst, 0)
    stats = await asyncio.wait_for(h.rpc("groups.stats-get", {}), T)
    assert stats["subtree"]["broker.online"] == "0-3", stats
    assert await cli(inst.uri(0), "groups", "get", "newgroup") == "\n"


async def test_get_is_rank_0s_and_join_is_the_local_ranks(start_instance, connect) -> None:
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    h = await connect(inst, 0)
    for topic, text in (("groups.get", "groups.get is only available on rank 0"),
                        ("groups.join", "groups.join is restricted to the local broker"),
                        ("groups.leave", "groups.leave is restricted to the local broker")):
        with pytest.raises(RemoteError) as info:
            await asyncio.wait_for(h.rpc(topic, {"name": "foo"}, nodeid=1), T)
        assert (info.value.errnum, info.value.errstr) == (errno.EPROTO, text), topic
    await cli(inst.uri(0), "groups", "waitfor", "-t", "10", "broker.online")
    out = await cli(inst.uri(0), "stats", "groups", "-r", "1")
    assert '"broker.online": "1,3"' in out, out  # (rank 1 and its child, rank 3)


async def test_malformed_requests(start_instance, connect) -> None:
    inst = await start_instance(size=2, attrs=WITH_GROUPS)
    h = await connect(inst, 0)
    for topic in ("groups.join", "groups.leave", "groups.get"):
        assert await errnum(h.rpc(topic, None)) == errno.EPROTO, topic
        assert await errnum(h.rpc(topic, {"name": 3})) == errno.EPROTO, topic
        assert await errnum(h.rpc(topic, {"name": ""})) == errno.EINVAL, topic
    h.send_noresponse("groups.update", None, nodeid=0)
    h.send_noresponse("groups.update", {"update": {"foo": 42}}, nodeid=0)
    h.send_noresponse("groups.update", {"update": {"foo": "not-an-idset"}}, nodeid=0)
    assert await cli(inst.uri(0), "groups", "waitfor", "-t", "10", "broker.online") == ""
    assert await cli(inst.uri(0), "groups", "get", "foo") == "\n"


async def test_join_leave_and_disconnect(start_instance, connect) -> None:
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    for _ in range(2):  # join and explicitly leave
        out = await cli(inst.uri(2), "groups", "join", "test1", "--", "kvbroker", "groups",
                        "get", "test1")
        assert out == "2\n", out
        assert await cli(inst.uri(0), "groups", "get", "test1") == "\n"
    h = await connect(inst, 3)
    for _ in range(2):  # join and disconnect
        other = await connect(inst, 3)
        await asyncio.wait_for(other.rpc("groups.join", {"name": "test2"}), T)
        assert await cli(inst.uri(0), "groups", "get", "test2") == "3\n"
        watch = h.rpc_stream("groups.get", {"name": "test2"}, nodeid=0)
        assert await next_members(watch) == "3"
        await other.close()
        assert await next_members(watch) == ""
        watch.abandon()
    # join twice; leave twice
    await asyncio.wait_for(h.rpc("groups.join", {"name": "test3"}), T)
    other = await connect(inst, 3)
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(other.rpc("groups.join", {"name": "test3"}), T)
    assert info.value.errnum == errno.EEXIST
    assert info.value.errstr == "rank 3 is already a member of test3", info.value
    assert await errnum(other.rpc("groups.leave", {"name": "test3"})) == errno.ENOENT
    await asyncio.wait_for(h.rpc("groups.leave", {"name": "test3"}), T)
    assert await errnum(h.rpc("groups.leave", {"name": "test3"})) == errno.ENOENT


async def watchers(h: object, n: int) -> bool:
    stats = await asyncio.wait_for(h.rpc("groups.stats-get", {}), T)  # type: ignore[attr-defined]
    return bool(stats["watchers"] == n)


async def test_barrier_on_every_rank(start_instance, connect) -> None:
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    h = await connect(inst, 0)
    out = await cli(inst.uri(0), "exec", "-r", "all", "kvbroker", "groups", "barrier",
                    "barrier.1")
    assert out == "", out
    assert await cli(inst.uri(0), "groups", "waitfor", "-c", "0", "-t", "10",
                     "barrier.1") == ""
    # waitfor sees the members come and go: a barrier of two ranks (-c)
    waiting = asyncio.ensure_future(cli(inst.uri(1), "groups", "waitfor", "-c", "2", "w"))
    await wait_until(lambda: watchers(h, 1), "waitfor's watch to reach rank 0")
    out = await cli(inst.uri(0), "exec", "-r", "1-2", "kvbroker", "groups", "barrier", "-c",
                    "2", "w")
    assert out == "", out
    assert await asyncio.wait_for(waiting, T) == ""
    await wait_until(lambda: watchers(h, 0), "waitfor's watch to go")


async def test_a_lost_rank_leaves_its_groups(start_instance, connect) -> None:
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    h = await connect(inst, 0)
    watch = h.rpc_stream("groups.get", {"name": "broker.online"}, nodeid=0)
    await until_members(watch, "0-3")  # (the instance is ready before all have told)
    inst.procs[3].kill()
    assert await next_members(watch) == "0-2"
    watch.abandon()


async def logged(uri: str, text: str) -> bool:
    return text in await cli(uri, "dmesg")


async def test_a_join_whose_rank_is_lost_says_so(start_instance) -> None:
    """The membership is the connection's: when the rank is lost, a ``join``
    without COMMAND exits 1 at once, saying so (it waited silently for a
    signal for as long as it ran), and one with COMMAND says so at once,
    lets COMMAND finish, and exits 1 (it said nothing until then)."""
    inst = await start_instance(size=2, attrs=WITH_GROUPS)
    env = {**os.environ, "KVBROKER_URI": inst.uri(1)}
    bare = await asyncio.create_subprocess_exec(
        KVBROKER, "groups", "join", "bare", env=env, stderr=asyncio.subprocess.PIPE)
    wrapped = await asyncio.create_subprocess_exec(  # (a session: cat goes with it)
        KVBROKER, "groups", "join", "wrapped", "--", "cat", env=env,
        stdin=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
    assert bare.stderr is not None and wrapped.stderr is not None
    assert wrapped.stdin is not None
    try:
        for name in ("bare", "wrapped"):
            await cli(inst.uri(0), "groups", "waitfor", "-t", "10", "-c", "1", name)
        os.kill(inst.pids()[1], signal.SIGKILL)
        lost = ("groups join: {}: the connection to the broker was lost (its rank "
                "stopped?): no longer a member")
        assert await asyncio.wait_for(bare.wait(), T) == 1
        assert (await bare.stderr.read()).decode() == f"kvbroker: {lost.format('bare')}\n"
        line = await asyncio.wait_for(wrapped.stderr.readline(), T)
        assert line.decode() == f"kvbroker: {lost.format('wrapped')}; cat goes on\n"
        assert wrapped.returncode is None  # cat still runs
        wrapped.stdin.close()
        assert await asyncio.wait_for(wrapped.wait(), T) == 1
        assert (await wrapped.stderr.read()).decode() == f"kvbroker: {lost.format('wrapped')}\n"
    finally:
        for proc in (bare, wrapped):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    if proc is wrapped:
                        os.killpg(proc.pid, signal.SIGKILL)  # (and its cat)
                    else:
                        proc.kill()
                await proc.wait()


async def test_module_load_and_remove_at_runtime(start_instance, connect) -> None:
    inst = await start_instance(size=4)
    await cli(inst.uri(0), "module", "load", "-r", "all", "groups")
    h = await connect(inst, 0)
    watch = h.rpc_stream("groups.get", {"name": "broker.online"}, nodeid=0)
    await until_members(watch, "0-3")
    await cli(inst.uri(0), "module", "remove", "-r", "1", "groups")
    assert await next_members(watch) == "0,2"  # (rank 3's reports went to rank 1's)
    # a join on rank 3 waits for rank 1's module, and says so in rank 3's log
    joining = asyncio.ensure_future(cli(inst.uri(3), "groups", "join", "late", "--", "true"))
    await wait_until(lambda: logged(inst.uri(3), "rank 1 has no groups module"),
                     "rank 3 to say its parent has no groups module")
    assert not joining.done()
    await cli(inst.uri(0), "module", "load", "-r", "1", "groups")
    await until_members(watch, "0-3")  # (rank 3 sends its own again)
    assert await asyncio.wait_for(joining, T) == ""
    await cli(inst.uri(0), "module", "remove", "groups")
    with pytest.raises(RemoteError) as info:
        await next_members(watch)
    assert info.value.errnum == errno.ENOSYS


async def test_a_guest_is_refused(start_instance) -> None:
    inst = await start_instance(size=1, attrs={**WITH_GROUPS, **ALLOW})
    for args in (("get", "broker.online"), ("join", "x", "--", "true")):
        rc, out, err = await run_guest_cli(inst.uri(0), "groups", *args)
        assert rc == 1 and "Operation not permitted" in err, (args, err)
        assert "is for the instance owner" in err, err


async def rank0_groups(h: Any) -> dict[str, Any]:
    stats: dict[str, Any] = await asyncio.wait_for(
        h.rpc("groups.stats-get", {}, nodeid=0), T)
    return stats


async def test_group_waits_that_returned_leave_nothing_behind(start_instance,
                                                              connect) -> None:
    """Each way a ``Groups`` watch stops being read -- ``wait_for``
    satisfied, timed out, failed; ``watch()`` left by ``break`` or
    ``aclose()``; ``barrier`` -- cancels its ``groups.get`` at rank 0, from
    a client of rank 1 (the cancel goes up as the get did): rank 0's
    watchers, and the handle's pending and retired requests, come back to
    what they were."""
    inst = await start_instance(2, attrs=WITH_GROUPS)
    h = await connect(inst, 1)
    groups = Groups(h)
    await groups.wait_for("broker.online", 2)
    before = await rank0_groups(h)
    base = (before["watchers"], h.pending, h.retired)
    calls = 10
    for _ in range(calls):
        await groups.wait_for("broker.online", 2)  # satisfied at once
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await groups.wait_for("nobody", 1)  # never: a timeout
        await groups.join("mine")
        with pytest.raises(RemoteError) as info:  # fails after its watch was asked
            await groups.wait_for("mine", 1, join=True)
        assert info.value.errnum == errno.EEXIST
        await groups.leave("mine")
        async for _ranks in groups.watch("broker.online"):
            break  # (closed by the loop's async-generator finaliser)
        async with contextlib.aclosing(groups.watch("broker.online")) as watching:
            async for _ranks in watching:
                break
        await groups.barrier("b", 1)
    ended = 6 * calls

    async def settled() -> bool:
        stats = await rank0_groups(h)
        return bool((stats["watchers"], h.pending, h.retired) == base
                    and stats["cancelled"] == before["cancelled"] + ended)

    await h.ping(nodeid=0)  # (after what the calls sent rank 0, on the same path)
    await wait_until(settled, f"rank 0's watchers, h.pending and h.retired back to {base} "
                              f"after {ended} finished waits and watches", timeout=5)


async def test_a_cancel_ends_only_the_senders_own_stream(start_instance, connect) -> None:
    """``groups.cancel`` is matched by client and matchtag: another client
    naming the tag (from the same rank, by the same path) changes nothing;
    the owner's ends the stream with ``ENODATA``, answered ``{}`` when sent
    expecting an answer; a malformed one is ``EPROTO``."""
    inst = await start_instance(2, attrs=WITH_GROUPS)
    owner, other = await connect(inst, 1), await connect(inst, 1)
    await Groups(owner).wait_for("broker.online", 2)
    stream = owner.rpc_stream("groups.get", {"name": "g"}, nodeid=0)
    assert await next_members(stream) == ""
    base = await rank0_groups(owner)
    other.send_noresponse("groups.cancel", {"matchtag": stream.matchtag}, nodeid=0)
    assert await asyncio.wait_for(
        other.rpc("groups.cancel", {"matchtag": stream.matchtag}, nodeid=0), T) == {}
    after = await rank0_groups(owner)
    assert (after["watchers"], after["cancelled"]) == (base["watchers"], base["cancelled"])
    async with Groups(owner).joined("g"):  # the stream still answers
        assert await next_members(stream) == "1"
    assert await next_members(stream) == ""
    assert await errnum(owner.rpc("groups.cancel", {}, nodeid=0)) == errno.EPROTO
    assert await asyncio.wait_for(
        owner.rpc("groups.cancel", {"matchtag": stream.matchtag}, nodeid=0), T) == {}
    assert await asyncio.wait_for(stream.next_message(), T) is None  # ENODATA: its end
    after = await rank0_groups(owner)
    assert (after["watchers"], after["cancelled"]) == (base["watchers"] - 1,
                                                       base["cancelled"] + 1)


async def test_a_start_with_groups_on_every_rank_warns_nothing() -> None:
    """A rank's module starts before its parent's at an ordinary start (rank
    0 starts its content store and kvs first): its first update meets
    ``ENOSYS``, and the parent asks again as its module starts -- no
    ``rank N has no groups module`` WARNING (every start logged them, the
    docs audit found; cli.md's own example prints ``0-3`` alone)."""
    for _ in range(2):  # (rank 0's module starts last: its children warn each time)
        # (broker.online may still be filling when the command starts, as
        # cli.md says: a served command, ~15 ms from its start to its
        # request, found it at 0 alone -- waitfor first, as its example)
        rc, out, err = await run_cli("start", "--size", "4", "--fanout", "2", "-S",
                                     "broker.modules=content,kvs,kvs-watch,groups", "--",
                                     "sh", "-c", "kvbroker groups waitfor broker.online && "
                                     "kvbroker groups get broker.online")
        assert (rc, out) == (0, "0-3\n"), err
        assert "has no groups module" not in err, err


async def test_a_reloaded_module_says_its_parents_is_missing(start_instance,
                                                            connect) -> None:
    """The start-up silence about a parent's ``ENOSYS`` (above) lasts until
    the parent's module first answers this rank, not this module: a
    ``module reload groups`` below a parent whose module was removed said
    nothing, the join below it waiting without a word (a review's find)."""
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    h = await connect(inst, 0)
    watch = h.rpc_stream("groups.get", {"name": "broker.online"}, nodeid=0)
    await until_members(watch, "0-3")
    watch.abandon()
    await cli(inst.uri(0), "module", "remove", "-r", "1", "groups")
    await cli(inst.uri(0), "module", "reload", "-r", "3", "groups")
    joining = asyncio.ensure_future(cli(inst.uri(3), "groups", "join", "late", "--", "true"))
    await wait_until(lambda: logged(inst.uri(3), "rank 1 has no groups module"),
                     "rank 3's reloaded module to say its parent has none")
    assert not joining.done()
    await cli(inst.uri(0), "module", "load", "-r", "1", "groups")
    assert await asyncio.wait_for(joining, T) == ""


async def test_a_group_with_no_member_is_forgotten(start_instance, connect) -> None:
    """Every name ever joined was kept on each rank up to rank 0, empty,
    and counted towards the 10,000 groups a rank keeps: an instance making
    a barrier group per job had every join refused ``ENOSPC`` from then
    on, and a sibling's membership dropped unsaid on the way (rank 0 read
    its group empty; found by a probe of vanishing clients).  A group with
    no member is forgotten on every rank, and watching it still works."""
    inst = await start_instance(size=4, attrs=WITH_GROUPS)
    h0, h3 = await connect(inst, 0), await connect(inst, 3)
    await cli(inst.uri(0), "groups", "waitfor", "-t", "10", "broker.online")
    watch = h0.rpc_stream("groups.get", {"name": "job"}, nodeid=0)
    assert await next_members(watch) == ""
    await asyncio.wait_for(h3.rpc("groups.join", {"name": "job"}), T)
    await until_members(watch, "3")
    await asyncio.wait_for(h3.rpc("groups.leave", {"name": "job"}), T)
    await until_members(watch, "")
    for rank in (3, 1, 0):
        stats = await asyncio.wait_for(h0.rpc("groups.stats-get", {}, nodeid=rank), T)
        assert "job" not in stats["subtree"], (rank, stats["subtree"])
    await asyncio.wait_for(h3.rpc("groups.join", {"name": "job"}), T)
    await until_members(watch, "3")

    # (the count that refused joins: 10,000 names, each joined and left)
    async def join_and_leave(name: str) -> None:
        await h3.rpc("groups.join", {"name": name})
        await h3.rpc("groups.leave", {"name": name})

    for first in range(0, 10_000, 1_000):
        await asyncio.wait_for(asyncio.gather(
            *(join_and_leave(f"barrier-{i}") for i in range(first, first + 1_000))), T)
    h2 = await connect(inst, 2)
    await asyncio.wait_for(h2.rpc("groups.join", {"name": "fresh"}), T)
    await asyncio.wait_for(h3.rpc("groups.join", {"name": "fresh"}), T)
    assert await cli(inst.uri(0), "groups", "get", "fresh") == "2-3\n"


async def test_a_full_rank_takes_what_an_update_frees_and_holds_what_does_not_fit(
        start_instance, connect) -> None:
    """Rank 0 at its 10,000 groups with members.  An update from rank 1
    that leaves one group and joins another in the same turn fits (what
    it empties makes room: the whole update was refused, and sent again
    for ever).  A join that does not fit waits -- its update refused
    ``ENOSPC`` and sent again -- until a group is emptied, then is
    answered, rank 0 knowing it (a membership was dropped unsaid)."""
    from broker.groups import MAX_GROUPS

    inst = await start_instance(size=2, attrs=WITH_GROUPS)
    await cli(inst.uri(0), "groups", "waitfor", "-t", "10", "broker.online")
    h0, h1 = await connect(inst, 0), await connect(inst, 1)

    async def groups(rank: int) -> dict[str, str]:
        stats = await asyncio.wait_for(h0.rpc("groups.stats-get", {}, nodeid=rank), T)
        return dict(stats["subtree"])

    fill = MAX_GROUPS - len(await groups(0)) - 1
    for first in range(0, fill, 1_000):
        await asyncio.wait_for(asyncio.gather(*(
            h0.rpc("groups.join", {"name": f"g{i}"})
            for i in range(first, min(fill, first + 1_000)))), T)
    await asyncio.wait_for(h1.rpc("groups.join", {"name": "job1"}), T)
    assert len(await groups(0)) == MAX_GROUPS
    # (one turn: an existing group, a group left, a group joined)
    calls = [h1.rpc("groups.join", {"name": "g0"}), h1.rpc("groups.leave", {"name": "job1"}),
             h1.rpc("groups.join", {"name": "job2"})]
    await asyncio.wait_for(asyncio.gather(*calls), T)
    now = await groups(0)
    assert "job1" not in now and now["job2"] == "1" and now["g0"] == "0-1", now
    assert len(now) == MAX_GROUPS

    waiting = asyncio.ensure_future(h1.rpc("groups.join", {"name": "job3"}))
    with pytest.raises(RemoteError) as info:
        await asyncio.wait_for(h0.rpc("groups.join", {"name": "job4"}), T)
    assert info.value.errnum == errno.ENOSPC
    assert info.value.errstr == f"rank 0 keeps {MAX_GROUPS} groups with members"
    assert not waiting.done()
    await asyncio.wait_for(h0.rpc("groups.leave", {"name": "g1"}), T)
    await asyncio.wait_for(waiting, T)
    assert (await groups(0))["job3"] == "1"
