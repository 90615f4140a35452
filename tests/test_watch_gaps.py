"""kvs-watch paths no other test drives end to end, on real multi-rank
instances:

* an APPEND watcher on a follower that falls more than ``FOLD_DEPTH`` (64)
  versions behind real commits folds them (docs/protocol.md, kvs-watch,
  *Folding*): every appended byte answered once, in order, and the watch
  goes on -- or, when the value is then rewritten, the lines before the
  rewrite first and ``EINVAL`` after;
* FULL and UNIQ watchers whose next roots an online ``kvs gc`` collected
  while they lagged skip those versions and answer from a newer root
  (docs/kvs.md, *Online*, "A watcher that falls behind"); other watchers
  are unaffected;
* ``kvbroker kvs get --watch --reconnect`` (plain and ``--append``) across a
  SIGKILL and a SIGTERM of its rank prints what changed meanwhile, once,
  and goes on (docs/cli.md).

The lag is made deterministic as in test_watch_gc.py: the watcher's rank is
stopped (SIGSTOP, waited for) while rank 0 commits, and setroots carry no
blobs (``kvs.setroot-blob-limit=0``), so after SIGCONT the rank queues the
whole burst of setroots before any lookup (which loads from rank 0) is
answered.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import KVBROKER, stop_process, stopped
from test_handle_reconnect import Restartable
from test_multihost import brokers, exit_codes, keyed_config  # noqa: F401 (fixtures)
from test_watch_helpers import (
    APPEND,
    FULL,
    UNIQ,
    WATCH,
    answer,
    append,
    cancel,
    commit,
    end_errnum,
    ns_create,
    ns_remove,
    put,
    stats,
    unlink,
    value,
    wait_until,
    wait_watchers,
    watch_stream,
)

from broker.errors import RemoteError
from kvs.client import KVS
from kvs_watch.flags import DELETES
from kvs_watch.resume import WatchResume
from kvs_watch.watcher import FOLD_DEPTH, FOLDED_KEPT

NO_BLOBS = {"kvs.setroot-blob-limit": "0"}
"""Prime no follower cache with a commit's blobs: its lookups go to rank 0."""

LINES = 200
"""Appends made while the watcher's rank is stopped: > FOLD_DEPTH."""


def line(i: int) -> bytes:
    return f"line {i:03d}\n".encode()


async def _answers(s: Any, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    async with asyncio.timeout(timeout):
        out = []
        for _ in range(n):
            p = await answer(s, timeout)
            assert p is not None and p["val"]["type"] == "val", p
            out.append(p)
        return out


# ---------------------------------------------------------------- 1. folding


async def _append_behind(inst: Any, h0: Any, h1: Any, then: list[dict[str, Any]] | None = None,
                         during: Callable[[], Awaitable[None]] | None = None,
                         ) -> tuple[Any, dict[str, Any]]:
    """An APPEND watcher of ``log`` on rank 1 that has answered line 0; rank
    1 stopped while rank 0 appends lines 1..LINES, each its own commit (and
    ``then``'s ops in one more; then ``during()``), then let go.  The
    stream, the last commit."""
    await commit(h0, append("log", line(0)), sync=(h1, 1))
    log = watch_stream(h1, "log", WATCH | APPEND)
    assert await value(log) == line(0)
    async with stopped(inst.pids()[1]):
        for i in range(1, LINES + 1):
            last = await commit(h0, append("log", line(i)))
        if then is not None:
            last = await commit(h0, *then)
        if during is not None:
            await during()
    return log, last


async def test_an_append_watcher_folding_real_commits_answers_each_line_once(
        start_instance, connect) -> None:
    """200 appends, each its own commit, reach a follower's watcher in one
    burst: it folds the versions past the 64th into the newest and still
    answers every line once, in order (each append one blob, one answer),
    with no ``EOVERFLOW``; then the watch goes on, and a plain watcher of
    another key on the same rank is unaffected."""
    assert LINES > FOLD_DEPTH
    inst = await start_instance(size=2, attrs=NO_BLOBS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("other", "0"), sync=(h1, 1))
    other = watch_stream(h1, "other", WATCH)
    assert await value(other) == b"0"
    log, last = await _append_behind(inst, h0, h1)
    got = await _answers(log, LINES)
    assert [p["val"]["data"] for p in got] == [line(i) for i in range(1, LINES + 1)]
    seqs = [p["rootseq"] for p in got]
    assert seqs == sorted(seqs) and seqs[-1] == last["rootseq"], seqs
    st = await stats(h1, 1)
    assert st["counts"]["roots-folded"] > 0, st["counts"]  # (the path under test ran)
    assert st["watchers"] == 2
    # the watch goes on: the next append, alone (nothing answered twice)
    await commit(h0, append("log", b"after\n"))
    assert await value(log) == b"after\n"
    await commit(h0, put("other", "1"))
    assert await value(other) == b"1"
    for s in (log, other):
        cancel(h1, s)
        assert await end_errnum(s) == 0
    await wait_watchers(h0, 0, nodeid=1)


@pytest.mark.parametrize("how", ["rewritten", "removed"])
async def test_a_rewrite_after_folded_appends_ends_the_watch_after_their_lines(
        start_instance, connect, how: str) -> None:
    """The value is rewritten (or removed) right after the 200 appends: the
    newest root folded in shows it, the folded roots are read one by one,
    so the 200 lines come first, then ``EINVAL`` (``ENOENT``), where the
    watch would have ended without folding (docs/protocol.md, *Folding*)."""
    inst = await start_instance(size=2, attrs=NO_BLOBS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    then = put("log", "rewritten\n") if how == "rewritten" else unlink("log")
    log, _ = await _append_behind(inst, h0, h1, then=[then])
    got = await _answers(log, LINES)
    assert [p["val"]["data"] for p in got] == [line(i) for i in range(1, LINES + 1)]
    assert await end_errnum(log) == (errno.EINVAL if how == "rewritten" else errno.ENOENT)
    assert (await stats(h1, 1))["counts"]["roots-folded"] > 0


# ---------------------------------------------------------------- 2. kvs gc


async def test_an_append_watcher_folding_roots_a_collection_removed_answers_every_line(
        start_instance, connect) -> None:
    """Folding and an online collection together: the 200 versions appended
    while rank 1 was stopped are collected (all but the current one) before
    it reads them.  The queued roots that cannot be read are skipped and the
    folded slot reads at the current root, which holds every line's blob:
    each line still comes once, in order ("APPEND answers the blobs they
    added, read at the newer root"), and the watch goes on."""
    inst = await start_instance(size=2, attrs={"kvs.gc-grace": "0", **NO_BLOBS})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)

    async def collect() -> None:
        r = await asyncio.wait_for(h0.rpc("kvs.gc", {}), 60)
        assert r["removed"] > 0, r

    log, last = await _append_behind(inst, h0, h1, during=collect)
    got = await _answers(log, LINES)
    assert [p["val"]["data"] for p in got] == [line(i) for i in range(1, LINES + 1)]
    assert {p["rootseq"] for p in got} == {last["rootseq"]}  # all read at the current root
    assert (await stats(h1, 1))["counts"]["roots-folded"] > 0
    await commit(h0, append("log", b"after\n"))
    assert await value(log) == b"after\n"
    cancel(h1, log)
    assert await end_errnum(log) == 0


GC_ATTRS = {"kvs.gc-grace": "0", **NO_BLOBS}


@pytest.mark.parametrize("mode", [FULL, UNIQ], ids=["full", "uniq"])
async def test_a_full_or_uniq_watcher_behind_a_collection_skips_to_a_newer_root(
        start_instance, connect, mode: int) -> None:
    """Rank 1 is stopped while rank 0 commits ``k`` twice and another key
    once and ``kvs gc`` collects every root but the current one: the
    lagging FULL/UNIQ watcher on rank 1 does not end (no ``ENOENT``); it
    answers the value at the current root, which it can read, once, and
    goes on.  A watcher of the same key on rank 0 that kept up saw each
    value; a watcher of another key on rank 1 goes on too."""
    inst = await start_instance(size=2, attrs=GC_ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, put("k", "v0"), put("quiet", "q0"), sync=(h1, 1))
    lagging = watch_stream(h1, "k", WATCH | mode)
    quiet = watch_stream(h1, "quiet", WATCH | mode)
    keeping_up = watch_stream(h0, "k", WATCH | mode)
    for s in (lagging, keeping_up):
        assert await value(s) == b"v0"
    assert await value(quiet) == b"q0"

    async def idle() -> bool:
        return bool((await stats(h1, 1))["lookups-in-flight"] == 0)

    await wait_until(idle, what="rank 1's watchers to be idle")
    rank1 = inst.pids()[1]
    await stop_process(rank1)
    try:
        await commit(h0, put("k", "v1"))
        assert await value(keeping_up) == b"v1"
        await commit(h0, put("k", "v2"))
        assert await value(keeping_up) == b"v2"
        current = await commit(h0, put("unrelated", "x"))
        r = await asyncio.wait_for(h0.rpc("kvs.gc", {}), 60)
        assert r["removed"] > 0, r
    finally:
        os.kill(rank1, signal.SIGCONT)
    p = await answer(lagging)
    assert p is not None and p["val"]["data"] == b"v2", p
    assert p["rootseq"] == current["rootseq"]  # read at the current root
    # then nothing more for those versions, and it goes on
    await commit(h0, put("k", "v3"))
    assert await value(lagging) == b"v3"
    assert await value(keeping_up) == b"v3"
    await commit(h0, put("quiet", "q1"))
    assert await value(quiet) == b"q1"
    st = await stats(h1, 1)
    assert st["watchers"] == 2, st
    cancel(h1, lagging)
    cancel(h1, quiet)
    cancel(h0, keeping_up)
    for s in (lagging, quiet, keeping_up):
        assert await end_errnum(s) == 0


# ---------------------------------------------------------------- 3. CLI --reconnect


@pytest.fixture
async def rinst(tmp_path: Path, brokers) -> Restartable:  # noqa: F811
    return await Restartable(tmp_path, brokers).start()


async def _readline(proc: asyncio.subprocess.Process, timeout: float = 30) -> str:
    assert proc.stdout is not None
    raw = await asyncio.wait_for(proc.stdout.readline(), timeout)
    if not raw:
        _, err = await proc.communicate()
        raise AssertionError(f"the command ended (rc {proc.returncode}): {err.decode()!r}")
    return raw.decode()


@pytest.mark.parametrize("how", ["kill", "term"])
async def test_kvs_get_watch_reconnect_prints_what_changed_while_its_rank_restarted(
        rinst: Restartable, how: str) -> None:
    """``kvs get --watch --reconnect`` (no ``--count``: it must not exit)
    through rank 1 while rank 1 is killed (or stopped with SIGTERM, which
    ends its watches ``ENOSYS``) and started again on its run directory:
    the value committed meanwhile is printed once (the newest: a plain watch
    prints a value, not each version), ``--append`` prints every line
    appended meanwhile, once each; then both go on, and Ctrl-C ends them
    (130) with nothing on stderr."""
    async with asyncio.timeout(120), KVS.connect(rinst.rank0.uri) as kvs0:
        await kvs0.put("k", "1")
        await kvs0.put("log", "a")
        version = (await kvs0.put("ready", "1")).rootseq
        async with KVS.connect(rinst.uri1) as kvs1:
            await kvs1.wait_version(version)
        env = dict(os.environ, KVBROKER_URI=rinst.uri1)
        env.pop("KVBROKER_NAMESPACE", None)
        procs = [await asyncio.create_subprocess_exec(
            KVBROKER, "kvs", "get", *argv, "--reconnect", env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
            for argv in (["--watch", "k"], ["--watch", "--append", "log"])]
        get, log = procs
        try:
            assert await _readline(get) == "1\n"
            assert await _readline(log) == "a\n"
            await rinst.stop_rank1(how)
            await kvs0.put("k", "2")
            await kvs0.put("k", "3")
            for v in ("b", "c"):
                await kvs0.append("log", v)
            await rinst.start_rank1()
            assert await _readline(get) == "3\n"  # (each value printed with a newline)
            # each append on its own line, as while connected (they were
            # joined: "bc")
            assert [await _readline(log) for _ in range(2)] == ["b\n", "c\n"]
            assert get.returncode is None and log.returncode is None
            # a second restart of the other kind, nothing changed meanwhile:
            # nothing printed again
            await rinst.stop_rank1("term" if how == "kill" else "kill")
            await rinst.start_rank1()
            async with KVS.connect(rinst.uri1) as kvs1:
                async def back() -> bool:
                    st = await kvs1.handle.rpc("kvs-watch.stats-get", {})
                    return bool(st["watchers"] == 2)
                await wait_until(back, 30, "both watches registered again")
            await kvs0.put("k", "4")
            await kvs0.append("log", "d")
            assert await _readline(get) == "4\n"
            assert await _readline(log) == "d\n"
            for p in procs:
                p.send_signal(signal.SIGINT)
            results = [await asyncio.wait_for(p.communicate(), 30) for p in procs]
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        assert [p.returncode for p in procs] == [130, 130], results
        assert results == [(b"", b""), (b"", b"")], results


def test_an_append_resume_yields_each_append_made_meanwhile_on_its_own() -> None:
    """The filter of a restarted append watch (no instance: the CLI test
    above runs it for real): the appends made meanwhile, an empty one too,
    come one entry each, as the watch gives them while connected."""
    def val(data: bytes, rootseq: int) -> dict[str, Any]:
        return {"val": {"type": "val", "data": data}, "rootseq": rootseq,
                "namespace": "primary"}

    r = WatchResume("log", WATCH | APPEND)
    assert r.take(val(b"a", 1)) == [val(b"a", 1)]
    assert r.take(val(b"b", 2)) == [val(b"b", 2)]
    r.restarted()
    for data in (b"a", b"b", b"c", b"", b"d"):  # the new initial value, per blob
        assert r.take(val(data, 5)) == []
    assert r.take(None) == [val(b"c", 5), val(b"", 5), val(b"d", 5)]
    r.restarted()
    for data in (b"a", b"b", b"c", b"", b"d", b"e"):
        assert r.take(val(data, 6)) == []
    assert r.take(None) == [val(b"e", 6)]  # nothing twice, the empty one neither


# ---------------------------------------------------------------- further paths


async def test_more_folded_roots_than_kept_still_answer_every_line_before_a_rewrite(
        start_instance, connect) -> None:
    """Past ``FOLDED_KEPT`` (1,000) roots folded into one slot every other
    older one is forgotten, the newest kept (docs/protocol.md, *Folding*):
    when the newest then shows the value rewritten, the roots kept are read
    one by one, and as each holds every blob before it, all 1,200 lines
    still come, once each, in order, before ``EINVAL``."""
    n = FOLDED_KEPT + 200
    inst = await start_instance(size=2, attrs=NO_BLOBS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, append("log", line(0)), sync=(h1, 1))
    log = watch_stream(h1, "log", WATCH | APPEND)
    assert await value(log) == line(0)
    async with stopped(inst.pids()[1]):
        for i in range(1, n + 1):
            await commit(h0, append("log", line(i)))
        await commit(h0, put("log", "rewritten\n"))
    got = await _answers(log, n, timeout=120)
    assert [p["val"]["data"] for p in got] == [line(i) for i in range(1, n + 1)]
    assert await end_errnum(log) == errno.EINVAL
    assert (await stats(h1, 1))["counts"]["roots-folded"] > FOLDED_KEPT


async def test_an_append_deletes_watcher_does_not_fold_and_overflows(
        start_instance, connect) -> None:
    """``WATCH_DELETES`` turns folding off (a removal between versions must
    be seen): such a watcher that falls more than ``kvs-watch.max-backlog``
    behind ends ``EOVERFLOW`` (docs/protocol.md, kvs-watch errors), while a
    plain APPEND watcher of the same key on the same rank folds and
    answers every line."""
    inst = await start_instance(size=2, attrs={"kvs-watch.max-backlog": "50", **NO_BLOBS})
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await commit(h0, append("log", line(0)), sync=(h1, 1))
    deletes = watch_stream(h1, "log", WATCH | APPEND | DELETES)
    folding = watch_stream(h1, "log", WATCH | APPEND)
    for s in (deletes, folding):
        assert await value(s) == line(0)
    async with stopped(inst.pids()[1]):
        for i in range(1, LINES + 1):
            await commit(h0, append("log", line(i)))
    with pytest.raises(RemoteError) as overflow:
        async with asyncio.timeout(30):
            while True:  # (it may answer a few versions first)
                p = await answer(deletes)
                assert p is not None and p["val"]["data"].startswith(b"line "), p
    assert overflow.value.errnum == errno.EOVERFLOW, overflow.value
    got = await _answers(folding, LINES)
    assert [p["val"]["data"] for p in got] == [line(i) for i in range(1, LINES + 1)]


@pytest.mark.parametrize("collected", [False, True], ids=["kept", "collected"])
async def test_a_namespace_removed_behind_a_watcher_then_made_again(
        start_instance, connect, collected: bool) -> None:
    """Rank 1 is stopped while rank 0 commits ``k`` in namespace ``job``,
    removes ``job``, (collects every unkept root,) and makes a new ``job``
    with ``k`` in it.  The watcher answers the commit made before the
    removal if its root can still be read, and ends ``ENOTSUP`` either way:
    a queued root that cannot be read after the removal ends the watch at
    once, never read at rank 0's current root (the new namespace's: its
    ``k`` is not this watch's) (docs/protocol.md, "A namespace removed")."""
    inst = await start_instance(size=2, attrs=GC_ATTRS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await ns_create(h0, "job")
    await commit(h0, put("k", "v0"), ns="job", sync=(h1, 1))
    s = watch_stream(h1, "k", WATCH, ns="job")
    assert await value(s) == b"v0"
    async with stopped(inst.pids()[1]):
        removed = await commit(h0, put("k", "v1"), ns="job")
        await ns_remove(h0, "job")
        await ns_create(h0, "job")
        await commit(h0, put("k", "new namespace"), ns="job")
        if collected:  # (after the new namespace's commit: a collection with a
            # grace of 0 still spares the blobs of the newest store)
            r = await asyncio.wait_for(h0.rpc("kvs.gc", {}), 60)
            assert r["removed"] > 0, r
            with pytest.raises(RemoteError) as gone:
                await asyncio.wait_for(h0.rpc("content.load", {"blobref": removed["rootref"]}), 10)
            assert gone.value.errnum == errno.ENOENT
    if not collected:
        assert await value(s) == b"v1"
    with pytest.raises(RemoteError) as ended:
        await answer(s)
    assert ended.value.errnum == errno.ENOTSUP, ended.value
    assert "was removed" in ended.value.errstr, ended.value.errstr
    await wait_watchers(h0, 0, nodeid=1)
    # a new watch sees the new namespace
    s = watch_stream(h1, "k", WATCH, ns="job")
    assert await value(s) == b"new namespace"
    cancel(h1, s)
    assert await end_errnum(s) == 0


async def test_a_job_eventlog_folded_then_its_namespace_removed_answers_every_line(
        start_instance, connect) -> None:
    """A job's pattern on a far rank: its eventlog appended to 200 times,
    then its namespace removed at once, while the watcher's rank was held
    up.  The watcher folds the versions, answers every line once, in order,
    and only then ends ``ENOTSUP`` (the removal comes after the commits
    made before it: docs/protocol.md, "A namespace removed")."""
    inst = await start_instance(size=2, attrs=NO_BLOBS)
    h0, h1 = await connect(inst, 0), await connect(inst, 1)
    await ns_create(h0, "job")
    await commit(h0, append("log", line(0)), ns="job", sync=(h1, 1))
    log = watch_stream(h1, "log", WATCH | APPEND, ns="job")
    assert await value(log) == line(0)
    async with stopped(inst.pids()[1]):
        for i in range(1, LINES + 1):
            await commit(h0, append("log", line(i)), ns="job")
        await ns_remove(h0, "job")
    got = await _answers(log, LINES)
    assert [p["val"]["data"] for p in got] == [line(i) for i in range(1, LINES + 1)]
    with pytest.raises(RemoteError) as ended:
        await answer(log)
    assert ended.value.errnum == errno.ENOTSUP, ended.value
    assert (await stats(h1, 1))["counts"]["roots-folded"] > 0
    await wait_watchers(h0, 0, nodeid=1)
