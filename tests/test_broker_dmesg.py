"""``kvbroker dmesg``: the log records each rank keeps in memory
(``log.ring-size`` of them, at ``log.ring-level``), as ``flux dmesg``."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from test_broker_support import (
    KVBROKER,
    run_cli,
    stats,
    stop_process,
    unanswering_ssh,
    wait_until,
)

from broker import logring
from broker.broker import Broker
from broker.errors import RemoteError
from broker.handle import Handle
from broker.logring import RankLog
from broker.rank import _configure_logging

NO_STATEDIR = "no statedir: the primary namespace starts empty"
LINE = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) kvbroker\[(\d+)\]: "
                  r"(DEBUG|INFO|WARNING|ERROR) (\S+): (.*)")


def parse(out: str) -> list[tuple[str, int, str, str, str]]:
    lines = out.splitlines()
    matches = [LINE.fullmatch(line) for line in lines]
    assert all(matches), out
    return [(m[1], int(m[2]), m[3], m[4], m[5]) for m in matches if m]


async def test_dmesg_shows_what_a_rank_kept_below_its_stderr_level(start_instance) -> None:
    """By default a rank writes WARNING and above to stderr but keeps INFO
    and above: rank 0's INFO line about the namespace is in ``dmesg``, not
    in its stderr."""
    inst = await start_instance(size=2)
    assert inst.stderr_path is not None
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert rc == 0, err
    lines = parse(out)
    assert [(r, lvl, name) for _, r, lvl, name, msg in lines if NO_STATEDIR in msg] == [
        (0, "INFO", "kvbroker.kvs")]
    assert NO_STATEDIR not in Path(inst.stderr_path).read_text()
    rc, out, err = await run_cli("dmesg", "--rank", "1", uri=inst.uri(0))
    assert rc == 0, err
    assert NO_STATEDIR not in out  # rank 1's own records only


async def test_dmesg_all_merges_every_ranks_records_by_time(start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    for rank in (3, 1, 2, 0):  # each logs the change at INFO, in this order
        await h.attr_set("log.level", "warning", nodeid=rank)
    rc, out, err = await run_cli("dmesg", "--all", uri=inst.uri(3))
    assert rc == 0, err
    lines = parse(out)
    stamps = [stamp for stamp, *_ in lines]
    assert stamps == sorted(stamps)
    set_by = [r for _, r, _, _, msg in lines if msg == "attribute log.level set to warning"]
    assert set_by == [3, 1, 2, 0]
    assert {r for _, r, *_ in lines} == {0, 1, 2, 3}


async def test_ring_size_keeps_the_last_records_and_clear_forgets(
        start_instance, connect) -> None:
    inst = await start_instance(size=1, attrs={"log.ring-size": "3"})
    h = await connect(inst, 0)
    for level in ("debug", "info", "warning", "error", "warning"):
        await h.attr_set("log.ring-level", level)  # logged at INFO: kept while <= info
    await h.attr_set("log.ring-level", "info")
    for n in range(4):
        await h.attr_set("log.level", ("info", "warning")[n % 2])
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert rc == 0, err
    assert [msg for *_, msg in parse(out)] == [
        "attribute log.level set to warning", "attribute log.level set to info",
        "attribute log.level set to warning"]
    assert (await stats(h))["log"]["kept"] == 3
    rc, out, err = await run_cli("dmesg", "--read-clear", uri=inst.uri(0))
    assert rc == 0 and len(out.splitlines()) == 3, err
    rc, out, err = await run_cli("dmesg", uri=inst.uri(0))
    assert (rc, out) == (0, ""), err
    await h.attr_set("log.level", "info")
    rc, out, _ = await run_cli("dmesg", uri=inst.uri(0))
    assert len(out.splitlines()) == 1
    rc, out, err = await run_cli("dmesg", "--clear", uri=inst.uri(0))
    assert (rc, out) == (0, ""), err
    assert (await stats(h))["log"]["kept"] == 0


async def test_ring_level_decides_what_is_kept(start_instance, connect) -> None:
    """At ``log.ring-level`` warning the INFO lines are not kept; set back to
    info at run time, they are again."""
    inst = await start_instance(size=1, attrs={"log.ring-level": "warning"})
    h = await connect(inst, 0)
    rc, out, _ = await run_cli("dmesg", uri=inst.uri(0))
    assert (rc, out) == (0, "")
    await h.attr_set("log.level", "warning")  # an INFO record: not kept
    await h.attr_set("log.ring-level", "info")  # kept: the ring's level is info by then
    rc, out, _ = await run_cli("dmesg", uri=inst.uri(0))
    assert [msg for *_, msg in parse(out)] == ["attribute log.ring-level set to info"]


async def test_dmesg_follow_prints_new_records_until_interrupted(
        start_instance, connect) -> None:
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "dmesg", "--follow", "--rank", "2", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ, KVBROKER_URI=inst.uri(0)))
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            async def following() -> bool:
                return bool((await stats(h, 2))["log"]["followers"])

            await wait_until(following, "dmesg --follow to reach rank 2")
            await h.attr_set("log.level", "info", nodeid=1)  # another rank's: not printed
            await h.attr_set("log.level", "info", nodeid=2)
            line = (await proc.stdout.readline()).decode()
            assert parse(line)[0][1:] == (2, "INFO", "kvbroker",
                                          "attribute log.level set to info")
            proc.send_signal(signal.SIGINT)
            assert await proc.wait() == 130  # (128 + SIGINT, quietly, as event sub)
            assert proc.stderr is not None and await proc.stderr.read() == b""

            async def dropped() -> bool:
                return not (await stats(h, 2))["log"]["followers"]

            await wait_until(dropped, "rank 2 to drop the follower that went")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_logger_writes_to_a_ranks_log(start_instance) -> None:
    """``kvbroker logger``, as ``flux logger``: the line is in the rank's
    ring and, at WARNING (the default ``log.level``), on its stderr; a debug
    line is below both; a bad name changes nothing."""
    inst = await start_instance(size=2)
    assert inst.stderr_path is not None
    uri = inst.uri(0)
    rc, _, err = await run_cli("logger", "-s", "warning", "-n", "job.7", "-r", "1",
                               "step", "3", "done", uri=uri)
    assert rc == 0, err
    rc, _, err = await run_cli("logger", "-s", "debug", "not kept", uri=uri)
    assert rc == 0, err
    rc, _, err = await run_cli("logger", "-n", "a b", "refused", uri=uri)
    assert rc == 1 and "name must be 1 to 64 letters" in err, err
    rc, out, err = await run_cli("dmesg", "--all", uri=uri)
    assert rc == 0, err
    client_lines = [(r, lvl, name, msg) for _, r, lvl, name, msg in parse(out)
                    if not name.startswith("kvbroker")]
    assert client_lines == [(1, "WARNING", "job.7", "step 3 done")]
    assert "kvbroker[1]: WARNING job.7: step 3 done" in Path(inst.stderr_path).read_text()


async def test_every_stderr_and_dmesg_line_of_a_multi_line_record_has_the_prefix(
        start_instance) -> None:
    """A message with newlines (``kvbroker logger "$(cat notes)"``) made
    lines on the rank's stderr, and in ``dmesg``'s output, that said
    neither whose nor what they were: each line now carries the record's
    prefix (time, rank, level, name), so that ``grep 'kvbroker\\[1\\]'``
    keeps them all.  Trailing line breaks and empty lines are dropped, as
    Flux's stdlog does (t0009 "embedded blank log messages are ignored");
    the ring keeps the text whole."""
    inst = await start_instance(size=2)
    assert inst.stderr_path is not None
    uri = inst.uri(0)
    rc, _, err = await run_cli("logger", "-s", "warning", "-n", "notes", "-r", "1",
                               "first\nsecond\r\n\nfourth\n\n", uri=uri)
    assert rc == 0, err
    rc, out, err = await run_cli("dmesg", "--rank", "1", uri=uri)
    assert rc == 0, err
    mine = [(r, lvl, name, msg) for _, r, lvl, name, msg in parse(out) if name == "notes"]
    assert mine == [(1, "WARNING", "notes", m) for m in ("first", "second", "fourth")]
    stderr = Path(inst.stderr_path).read_text()
    mine = [(r, lvl, name, msg) for _, r, lvl, name, msg in parse(stderr) if name == "notes"]
    assert mine == [(1, "WARNING", "notes", m) for m in ("first", "second", "fourth")]
    h = await Handle.connect(uri)
    try:
        [kept] = [e["message"] async for e in h.dmesg(nodeid=1) if e["name"] == "notes"]
    finally:
        await h.close()
    assert kept == "first\nsecond\r\n\nfourth"


def test_a_traceback_on_stderr_and_in_dmesg_has_the_prefix_on_every_line() -> None:
    """A module's exception (``log.exception``: "handler ... failed") wrote
    its traceback on the rank's stderr as bare lines, between the prefixed
    ones of other records: each line now has its record's prefix.  The
    rank's own stderr handler, as ``kvbroker broker`` sets it up."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    try:
        rank_log = _configure_logging(3, "warning", "never", "info", 16)
        out = io.StringIO()
        rank_log.stderr.setStream(out)
        try:
            {}["missing"]
        except KeyError:
            logging.getLogger("kvbroker.test").exception("handler %s failed", "test.get")
    finally:
        root.handlers[:], root.level = saved
    lines = out.getvalue().splitlines()
    assert len(lines) > 3 and lines[-1] == "kvbroker[3]: ERROR kvbroker.test: KeyError: 'missing'"
    assert lines[0] == "kvbroker[3]: ERROR kvbroker.test: handler test.get failed"
    assert all(line.startswith("kvbroker[3]: ERROR kvbroker.test: ") for line in lines), lines
    [entry] = rank_log.ring.since()
    assert entry["message"].splitlines() == [line.split(": ", 2)[2] for line in lines]
    assert [line.split(": ", 1)[1] for line in logring.line(entry).splitlines()] == \
        [line.split(": ", 1)[1] for line in lines]


async def test_dmesg_follow_all_starts_with_the_records_merged_by_time(
        start_instance, connect) -> None:
    """``--follow --all`` first prints what ``dmesg --all`` prints (every
    rank's records merged by time), then the new ones -- not each rank's in
    turn, as their streams happen to arrive."""
    inst = await start_instance(size=3, fanout=2)
    h = await connect(inst, 0)
    for rank in (1, 2, 1, 2):  # interleaved in time across two ranks
        await h.attr_set("log.level", "warning", nodeid=rank)
    rc, kept, err = await run_cli("dmesg", "--all", uri=inst.uri(0))
    assert rc == 0, err
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "dmesg", "--follow", "--all", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=dict(os.environ, KVBROKER_URI=inst.uri(0)))
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(30):
            first = [(await proc.stdout.readline()).decode()
                     for _ in kept.splitlines()]
            assert "".join(first) == kept
            await h.attr_set("log.level", "info", nodeid=2)  # then a new one
            assert parse((await proc.stdout.readline()).decode())[0][1:] == (
                2, "INFO", "kvbroker", "attribute log.level set to info")
    finally:
        proc.send_signal(signal.SIGINT)
        await proc.wait()


async def test_log_cancel_ends_a_follow_stream_on_a_connection_that_stays(
        start_instance, connect) -> None:
    """A program that stops following keeps its connection: ``log.cancel
    {matchtag}`` (as Flux's) ends that stream with ``ENODATA``, and the rank
    stops sending it records (which its handle would otherwise keep, unread,
    without bound); another route's matchtag is not matched."""
    inst = await start_instance(size=2)
    h = await connect(inst, 0)
    other = await connect(inst, 1)
    stream = h.rpc_stream("log.dmesg", {"follow": True}, nodeid=1)

    async def following() -> bool:
        return (await stats(h, 1))["log"]["followers"] == 1

    await wait_until(following, "rank 1 to serve the follow stream")
    async with asyncio.timeout(30):
        await other.rpc("log.cancel", {"matchtag": stream.matchtag}, nodeid=1)
        assert (await stats(h, 1))["log"]["followers"] == 1  # not that client's
        await h.rpc("log.cancel", {"matchtag": stream.matchtag}, nodeid=1)
        async for _ in stream:  # (what rank 1 kept, if anything), then the end
            pass
        assert (await stats(h, 1))["log"]["followers"] == 0
        assert (await h.ping(1))["rank"] == 1


async def test_logger_keeps_a_huge_message_to_the_ring_s_length_on_stderr_too(
        start_instance, connect) -> None:
    """A script's 1,000,000-character line (``kvbroker logger "$(cat
    file)"``) is cut to the ring's 8,192 characters on stderr as well, as
    Flux cuts a log message (2,048 bytes): a rank's stderr (a terminal,
    journald) got all of it, in one write from its event loop.  The ring
    keeps the same text, its end saying how much was left out."""
    inst = await start_instance(size=1)
    assert inst.stderr_path is not None
    h = await connect(inst)
    await h.log("y" * 1_000_000, "warning", "big")
    [entry] = [e async for e in h.dmesg() if e["name"] == "big"]
    text = entry["message"]
    assert len(text) <= logring.MAX_ENTRY_TEXT and text.startswith("y" * 8000), len(text)
    kept = text.index(".")
    assert text[kept:] == f"... ({1_000_000 - kept} more characters)"
    stderr = Path(inst.stderr_path).read_text()
    assert f"WARNING big: {text}\n" in stderr and len(stderr) < 20_000, len(stderr)


async def test_dmesg_needs_a_streaming_request_and_sound_fields(start_instance, connect) -> None:
    inst = await start_instance(size=1)
    h: Handle = await connect(inst, 0)
    with pytest.raises(RemoteError, match="streaming request") as e:
        await asyncio.wait_for(h.rpc("log.dmesg", {}), 10)
    assert e.value.errnum == 71  # EPROTO
    with pytest.raises(RemoteError, match="follow must be a boolean") as e:
        async for _ in h.rpc_stream("log.dmesg", {"follow": "yes"}):
            pass
    assert (await h.ping())["rank"] == 0


# ---------------------------------------------------------------- the ring itself


def record(msg: str, level: int = logging.INFO) -> logging.LogRecord:
    return logging.LogRecord("t", level, __file__, 1, msg, None, None)


def test_the_ring_keeps_the_newest_numbers_them_and_clears_up_to_a_seq() -> None:
    ring = logring.LogRing(rank=5, size=3, level=logging.INFO)
    logger = logging.getLogger("test.logring")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(ring)
    try:
        for n in range(5):
            logger.info("m%d", n)
        logger.debug("below the ring's level")
    finally:
        logger.removeHandler(ring)
    assert [(e["seq"], e["message"]) for e in ring.since()] == [(3, "m2"), (4, "m3"), (5, "m4")]
    assert [e["seq"] for e in ring.since(4)] == [5]
    ring.clear(4)
    assert [e["seq"] for e in ring.since()] == [5]
    ring.clear()
    assert ring.since() == [] and ring.next_seq == 6


def test_the_ring_keeps_the_start_of_a_long_record_only() -> None:
    """A record may quote a client (a malformed request's topic): the ring
    keeps its first ``MAX_ENTRY_TEXT`` characters, and says how many more."""
    ring = logring.LogRing(rank=0, size=4, level=logging.INFO)
    ring.handle(record("x" * (logring.MAX_ENTRY_TEXT + 5)))
    text = ring.since()[0]["message"]
    assert text == "x" * logring.MAX_ENTRY_TEXT + "... (5 more characters)"


async def test_a_record_the_ring_cannot_take_does_not_fail_the_code_that_logged(
        capsys: pytest.CaptureFixture[str]) -> None:
    """As every logging handler: a record whose arguments do not fit its
    format, or a follower that fails, is reported on stderr ("--- Logging
    error ---") -- the code that logged goes on, as it did when stderr was
    the only handler."""
    ring = logring.LogRing(rank=0, size=10, level=logging.INFO)
    ring.attach(asyncio.get_running_loop())
    logger = logging.getLogger("test.logring.errors")
    logger.propagate, logger.level = False, logging.DEBUG
    logger.addHandler(ring)

    def fail(entry: logring.Entry) -> None:
        raise RuntimeError("a follower failed")

    try:
        logger.info("%d records", "not a number")
        ring.followers["f"] = fail
        logger.info("for the follower")
        del ring.followers["f"]
        logger.info("still logging")
    finally:
        logger.removeHandler(ring)
    err = capsys.readouterr().err
    assert err.count("--- Logging error ---") == 2, err
    assert "a follower failed" in err
    assert [e["message"] for e in ring.since()][-1] == "still logging"


async def test_a_record_from_another_thread_reaches_a_follower_on_the_loop() -> None:
    loop = asyncio.get_running_loop()
    ring = logring.LogRing(rank=0, size=10, level=logging.INFO)
    ring.attach(loop)
    got: asyncio.Future[tuple[str, int]] = loop.create_future()
    ring.followers["f"] = lambda e: got.set_result((e["message"], threading.get_ident()))
    worker = threading.Thread(target=ring.handle, args=(record("from a thread"),))
    worker.start()
    worker.join()
    assert await asyncio.wait_for(got, 10) == ("from a thread", threading.get_ident())


async def test_a_follower_gets_a_threads_record_logged_just_before_the_loops(
        tmp_path: Path) -> None:
    """A record from another thread reaches the followers on a later loop
    turn; one logged on the loop meanwhile reaches them at once.  The
    follower sends both (it used to drop the thread's, older by ``seq``,
    as if already sent).  The rank runs in this process, so that the
    thread's record is pending exactly when the loop logs."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    rank_log = RankLog(0, "error", "info", 64, logging.Formatter("%(message)s"))
    b = Broker(0, 1, 2, str(tmp_path), attrs={"broker.modules": ""}, rank_log=rank_log)
    log = logging.getLogger("test.thread")
    try:
        async with asyncio.timeout(30):
            await b.start()
            h = await Handle.connect(b.uri)
            try:
                stream = h.rpc_stream("log.dmesg", {"follow": True}).__aiter__()
                first = asyncio.ensure_future(anext(stream))
                while not rank_log.ring.followers:
                    await asyncio.sleep(0.005)
                worker = threading.Thread(target=log.info, args=("from a thread",))
                worker.start()
                worker.join()  # (its record now waits for a turn of this loop)
                log.info("from the loop")
                got = [(await first)["message"]]
                try:
                    got.append((await asyncio.wait_for(anext(stream), 10))["message"])
                except TimeoutError:
                    pass
                assert sorted(got) == ["from a thread", "from the loop"]
            finally:
                await h.close()
    finally:
        await b.stop()
        root.handlers[:], root.level = saved


async def test_a_record_logged_while_the_backlog_is_sent_reaches_the_follower(
        tmp_path: Path) -> None:
    """A follow request is answered with the records kept, then each new
    one.  A record logged while the kept ones were being sent (here, just
    as the first is sent, one by the loop's thread and one by another, as
    a module's worker logs) was in neither: the follower was registered after the backlog was
    read, so the ring told no one of it.  The follower is now registered
    first; every record comes once, in ``seq`` order.  The rank runs in
    this process, so that the thread logs exactly then (a profile hook on
    the loop's thread sees the backlog's first answer go)."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    rank_log = RankLog(0, "error", "info", 64, logging.Formatter("%(message)s"))
    b = Broker(0, 1, 2, str(tmp_path), attrs={"broker.modules": ""}, rank_log=rank_log)
    log = logging.getLogger("test.handover")
    fired: list[int] = []

    def during_the_backlog(frame: Any, event: str, _arg: object) -> None:
        if (event == "call" and not fired and frame.f_code.co_name == "respond"
                and frame.f_back is not None and frame.f_back.f_code.co_name == "log_dmesg"):
            fired.append(rank_log.ring.next_seq)
            log.info("during the backlog, by the loop")
            worker = threading.Thread(target=log.info, args=("during the backlog",))
            worker.start()
            worker.join()

    try:
        async with asyncio.timeout(30):
            await b.start()
            h = await Handle.connect(b.uri)
            try:
                log.info("kept before")
                stream = h.rpc_stream("log.dmesg", {"follow": True}).__aiter__()
                sys.setprofile(during_the_backlog)
                try:
                    got = [await anext(stream)]
                finally:
                    sys.setprofile(None)
                assert fired, "the backlog was sent without the hook seeing it"
                while got[-1]["message"] != "during the backlog":
                    try:
                        got.append(await asyncio.wait_for(anext(stream), 5))
                    except TimeoutError:
                        raise AssertionError(f"the record logged during the backlog "
                                             f"never came: {got}") from None
                log.info("after")
                got.append(await asyncio.wait_for(anext(stream), 10))
            finally:
                await h.close()
    finally:
        await b.stop()
        root.handlers[:], root.level = saved
    seqs = [e["seq"] for e in got]
    assert seqs == list(range(1, len(got) + 1)), got  # each once, in order
    assert [e["message"] for e in got] == [
        "kept before", "during the backlog, by the loop", "during the backlog", "after"]
    assert got[1]["seq"] == fired[0]


def test_line_is_the_stderr_format_with_the_utc_time() -> None:
    entry = {"seq": 1, "time": 1796157000.25, "rank": 3, "level": "warning",
             "name": "kvbroker.overlay", "message": "hello"}
    assert logring.line(entry) == \
        "2026-12-01T20:30:00.250Z kvbroker[3]: WARNING kvbroker.overlay: hello"


async def test_the_python_api_writes_reads_follows_and_cancels(start_instance, connect) -> None:
    """``Handle.log`` and ``Handle.dmesg``, what the commands use: a line
    written to rank 1 is read back there; a follow stream gets the next one,
    and ends when cancelled (``log.cancel``) while the handle stays."""
    inst = await start_instance(size=2)
    h: Handle = await connect(inst, 0)
    async with asyncio.timeout(30):
        await h.log("first", "warning", "api.test", nodeid=1)
        kept = [e async for e in h.dmesg(nodeid=1)]
        assert [(e["rank"], e["level"], e["name"], e["message"]) for e in kept
                if e["name"] == "api.test"] == [(1, "warning", "api.test", "first")]
        stream = h.dmesg(follow=True, since=kept[-1]["seq"], nodeid=1)
        await h.log("second", name="api.test", nodeid=1)
        entry = await anext(stream)
        assert (entry["message"], entry["level"], entry["seq"]) == (
            "second", "info", kept[-1]["seq"] + 1)
        h.send_noresponse("log.cancel", {"matchtag": stream.matchtag}, nodeid=1)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        assert (await h.ping(1))["rank"] == 1


async def test_dmesg_all_prints_the_other_ranks_records_while_one_is_lost(
        start_instance, connect) -> None:
    """With rank 3 lost, ``dmesg --all`` printed nothing and exited 1: the
    records of the ranks still there (rank 1's WARNING says why 3 went)
    are what an operator reads then.  Now they are printed, the lost rank
    is named on stderr, and the status is 1."""
    inst = await start_instance(size=4, fanout=2)
    h = await connect(inst, 0)
    os.kill(inst.pids()[3], signal.SIGKILL)

    async def rank1_lost_it() -> bool:
        return (await stats(h, 1))["overlay"]["children"] == []

    await wait_until(rank1_lost_it, "rank 1 to notice")
    rc, out, err = await run_cli("dmesg", "--all", uri=inst.uri(0))
    assert rc == 1, err
    assert err.startswith("kvbroker: dmesg: rank 3: No route to host"), err
    lines = parse(out)
    assert [(r, lvl) for _, r, lvl, _, msg in lines
            if msg.startswith("lost child rank 3 unexpectedly")] == [(1, "WARNING")]
    assert [r for _, r, _, _, msg in lines if NO_STATEDIR in msg] == [0]


async def test_dmesg_all_t_leaves_out_a_stopped_rank_and_prints_the_others(
        start_instance) -> None:
    """With rank 2 stopped (SIGSTOP), ``dmesg --all`` waited for ever, so an
    operator looking into a hung rank got nothing.  ``-t`` names the rank
    that did not answer in time and prints the others' records (exit 1)."""
    inst = await start_instance(size=3, fanout=2)
    await stop_process(inst.pids()[2])
    try:
        rc, out, err = await run_cli("dmesg", "--all", "-t", "0.5", uri=inst.uri(0), timeout=30)
    finally:
        os.kill(inst.pids()[2], signal.SIGCONT)
    assert rc == 1, err
    assert err == ("kvbroker: dmesg: rank 2: Connection timed out (did not answer in 0.5s: "
                   "stopped or hung?)\n"), err
    assert [r for _, r, _, _, msg in parse(out) if NO_STATEDIR in msg] == [0]


async def test_dmesg_t_bounds_connecting_to_a_host_that_never_answers(tmp_path: Path) -> None:
    """``-t`` bounds connecting too, as the health checks' (an ``ssh://``
    host that never answers kept ``dmesg -t 1`` waiting for ever)."""
    rc, _, err = await run_cli("dmesg", "-t", "1", uri="ssh://nohost/tmp/kvb-x/local-0",
                               env=unanswering_ssh(tmp_path), timeout=10)
    assert rc == 1 and "Connection timed out (no answer in 1s)" in err, err


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch):
    """The local time zone is UTC for the test (``dmesg -H`` prints local times)."""
    import time

    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_human_times_say_the_minute_then_the_seconds_since(utc) -> None:
    """``dmesg -H``, as Flux's (and util-linux's): the first record of a
    minute says when, the others the seconds since that one; ``--delta``
    since the record before; a new minute says when again."""
    def entry(t: float, message: str, level: str = "info") -> dict[str, Any]:
        return {"seq": 1, "time": t, "rank": 0, "level": level, "name": "n",
                "message": message}

    t0 = 1796157000.25  # 2026-12-01 20:30:00.25 UTC
    entries = [entry(t0, "a"), entry(t0 + 0.5, "b\nc"), entry(t0 + 2.0, "d"),
               entry(t0 + 61.0, "e")]
    human = logring.DmesgFormat(human=True)
    assert [human.line(e) for e in entries] == [
        "[Dec01 20:30] kvbroker[0]: INFO n: a",
        "[  +0.500000] kvbroker[0]: INFO n: b\n[  +0.500000] kvbroker[0]: INFO n: c",
        "[  +2.000000] kvbroker[0]: INFO n: d",
        "[Dec01 20:31] kvbroker[0]: INFO n: e"]
    delta = logring.DmesgFormat(human=True, delta=True)
    assert [delta.line(e).split(" ")[0:3] for e in entries[:3]] == [
        ["[Dec01", "20:30]", "kvbroker[0]:"], ["[", "", "+0.500000]"],
        ["[", "", "+1.500000]"]]
    colored = logring.DmesgFormat(color=True).line(entry(t0, "x", "error"))
    assert colored == ("\033[32m2026-12-01T20:30:00.250Z\033[0m kvbroker[0]: "
                       "\033[31mERROR\033[0m \033[33mn\033[0m: x")
    assert logring.DmesgFormat().line(entries[0]) == logring.line(entries[0])


async def test_dmesg_human_and_its_options(start_instance) -> None:
    inst = await start_instance(size=1)
    uri = inst.uri(0)
    assert (await run_cli("logger", "first", uri=uri))[0] == 0
    rc, out, err = await run_cli("dmesg", "-H", uri=uri)
    assert rc == 0, err
    lines = out.splitlines()
    assert re.fullmatch(r"\[[A-Z][a-z]{2}\d\d \d\d:\d\d\] kvbroker\[0\]: INFO .*", lines[0])
    assert re.fullmatch(r"(\[[A-Z][a-z]{2}\d\d \d\d:\d\d\]|\[ *\+\d+\.\d{6}\]) kvbroker\[0\]: "
                        r"INFO logger: first", lines[-1]), out
    rc, out, err = await run_cli("dmesg", "--color=never", uri=uri)  # (and auto: not a tty)
    assert rc == 0 and "\033" not in out and parse(out), err
    rc, out, err = await run_cli("dmesg", "-L", uri=uri)
    assert rc == 0 and out.startswith("\033[32m"), out
    rc, out, err = await run_cli("dmesg", "--delta", uri=uri)
    assert (rc, out) == (2, "") and "--delta can only be used with --human" in err, err
