"""``kvbroker kvs get --watch ...`` and ``kvbroker kvs eventlog get/wait-event``
(:mod:`kvs_watch.cli`), as real processes; Ctrl-C cancels the watch."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import sys

import pytest
from test_broker_support import run_cli, stopped, unanswering_ssh
from test_watch_helpers import (
    NO_MERGE,
    WAITCREATE,
    WATCH,
    append,
    commit,
    put,
    stats,
    wait_until,
    wait_watchers,
)

from kvs_watch.client import wait_event


def _env(uri: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, KVBROKER_URI=uri, **extra)
    env.pop("KVBROKER_NAMESPACE", None)
    return env


async def spawn(uri: str, *args: str, **env: str) -> asyncio.subprocess.Process:
    """``kvbroker ARGS`` attached to ``uri`` (``env``: more variables)."""
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "broker.cli", *args, env=_env(uri, **env),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)


async def run(uri: str, *args: str, timeout: float = 20, **env: str) -> tuple[int, str, str]:
    p = await spawn(uri, *args, **env)
    try:
        out, err = await asyncio.wait_for(p.communicate(), timeout)
    except TimeoutError:
        p.kill()
        await p.wait()
        raise
    assert p.returncode is not None
    return p.returncode, out.decode(), err.decode()


def bad(line: int, why: str) -> str:
    """A malformed log's message: Flux's words, then which line and why."""
    return f"Invalid argument (cannot decode improperly formatted eventlog: line {line}: {why})"


NO_NEWLINE = "no newline at its end"


def ev(ts: float, name: str, **ctx) -> bytes:
    e = {"timestamp": ts, "name": name, **({"context": ctx} if ctx else {})}
    return json.dumps(e, separators=(",", ":")).encode() + b"\n"


async def test_kvs_get_watch_waitcreate_append_stream(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(3)
    await commit(h0, put("test.a", "42"), sync=(h0, 3))
    assert await run(uri, "kvs", "get", "--watch", "--count=1", "test.a") == (0, "42\n", "")
    p = await spawn(uri, "kvs", "get", "-w", "-c", "3", "test.a")
    await wait_watchers(h0, 1, nodeid=3)
    for v in ("43", "43"):
        await commit(h0, put("test.a", v), flags=NO_MERGE)
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out, err) == (0, b"42\n43\n43\n", b"")
    p = await spawn(uri, "kvs", "get", "-W", "-w", "-A", "-c", "3", "test.log")
    await wait_watchers(h0, 1, nodeid=3)
    await commit(h0, put("test.log", "abc"))
    await commit(h0, append("test.log", "d"), append("test.log", "e"))
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out, err) == (0, b"abc\nd\ne\n", b"")
    assert await run(uri, "kvs", "get", "--stream", "test.log") == (0, "abcde\n", "")
    # -S prints as the default does: -l's KEY= first, and up to the first NUL
    await commit(h0, put("test.nul", "x\0y"), append("test.nul", "z"), sync=(h0, 3))
    assert await run(uri, "kvs", "get", "test.nul") == (0, "x\n", "")
    assert await run(uri, "kvs", "get", "-S", "-l", "test.nul", "test.log") == (
        0, "test.nul=x\ntest.log=abcde\n", "")
    await commit(h0, put("test.nul0", "\0abc"), sync=(h0, 3))
    for how in ((), ("-S",)):  # a value that starts with NUL still prints its line
        assert await run(uri, "kvs", "get", *how, "test.nul0") == (0, "\n", "")
    rc, out, err = await run(uri, "kvs", "get", "--watch", "--count=1", "test.nokey")
    assert rc == 1 and err == "kvbroker: test.nokey: No such file or directory\n"
    rc, out, err = await run(uri, "kvs", "get", "-N", "noexist", "--watch", "test.a")
    assert rc == 1 and "Operation not supported" in err
    rc, out, err = await run(uri, "kvs", "get", "--watch", "--stream", "test.a")
    assert rc == 2 and "--watch and --stream cannot be combined" in err  # a usage error
    await wait_watchers(h0, 0, nodeid=3)


async def test_kvs_get_timeout_gives_up_and_cancels_its_watch(start_instance, connect):
    """--timeout bounds --waitcreate and --watch as kvs wait -t and eventlog
    wait-event -t bound theirs: ETIMEDOUT, exit 1, the watch cancelled on
    the rank; a value that comes in time ends it as without; without a
    watch it is a usage error.

    Where something must be printed before the bound ends the command (the
    watched value, the key that exists), the bound is 2 s, not 0.3: the one
    bound covers the rank's first answer too (its monitor's root, the
    lookup), and a rank that a loaded machine holds up 0.3 s printed
    nothing, naming t.k, not t.nokey (rank 1 stopped for 1.2 s around the
    call: the 0.3 s form fails, the 2 s one passes)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    rc, out, err = await run(uri, "kvs", "get", "-W", "--timeout", "0.3", "t.nokey")
    assert (rc, out, err) == (1, "", "kvbroker: t.nokey: Connection timed out "
                                     "(not created within 0.3 s)\n")
    # -w -W of a key never made: nothing was watched yet (it said "watched for")
    rc, out, err = await run(uri, "kvs", "get", "-w", "-W", "--timeout", "0.3", "t.nokey")
    assert (rc, out, err) == (1, "", "kvbroker: t.nokey: Connection timed out "
                                     "(not created within 0.3 s)\n")
    await commit(h0, put("t.k", "1"), sync=(h0, 1))
    rc, out, err = await run(uri, "kvs", "get", "-w", "--timeout", "2", "t.k")
    assert (rc, out, err) == (1, "1\n", "kvbroker: t.k: Connection timed out "
                                        "(watched for 2 s)\n")
    assert await run(uri, "kvs", "get", "-W", "--timeout", "10", "t.k") == (0, "1\n", "")
    # keys waited for one after the other: the message names the one it waited for
    rc, out, err = await run(uri, "kvs", "get", "-W", "--timeout", "2", "t.k", "t.nokey")
    assert (rc, out, err) == (1, "1\n", "kvbroker: t.nokey: Connection timed out "
                                        "(not created within 2 s)\n")
    rc, out, err = await run(uri, "kvs", "get", "--timeout", "1", "t.k")
    assert rc == 2 and err.endswith("error: --timeout needs --watch or --waitcreate\n"), err
    await wait_watchers(h0, 0, nodeid=1)
    # a stopped rank never starts the watch: said so, not "watched for"
    async with stopped(inst.pids()[1]):
        rc, out, err = await run(uri, "kvs", "get", "-w", "--timeout", "0.5", "t.k")
    assert (rc, out, err) == (1, "", "kvbroker: t.k: Connection timed out (the rank did "
                                     "not answer in 0.5 s: stopped or hung?)\n")


async def test_rpc_stream_timeout_bounds_the_first_answer_not_the_stream(start_instance,
                                                                         connect):
    """``rpc --stream -t`` bounded the whole stream: a watch that answered at
    once still ended at ``-t``, exit 1, its later answers lost.  It bounds
    connecting and the first answer, as ``kvs watch-keys -t``: a stopped
    rank's stream gives up within it, a stream that answered runs on.

    The stream that must answer gets ``-t 2``, not 0.5: its first answer
    (rank 1's monitor root and lookup) is inside the bound, and a rank
    held up 0.5 s on a loaded machine ended it before it answered (rank 1
    stopped for 1.2 s around the call: the 0.5 s form fails, the 2 s one
    passes)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    lookup = json.dumps({"namespace": "primary", "key": "rs.k", "flags": WATCH | WAITCREATE})
    argv = ("rpc", "--stream", "kvs-watch.lookup", lookup, "-r", "1")
    async with stopped(inst.pids()[1]):
        assert await run(inst.uri(0), *argv, "-t", "0.5") == (
            1, "", "kvbroker: kvs-watch.lookup: Connection timed out "
                   "(rank 1 did not answer in 0.5s: stopped or hung?)\n")
    await commit(h0, put("rs.k", "1"), sync=(h0, 1))
    proc = await spawn(inst.uri(0), *argv, "-t", "2")
    try:
        assert proc.stdout is not None
        first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert first["val"]["data"] == "1"
        # still watching past its -t, which began before the first answer
        # (before: exit 1 at -t)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), 2.5)
        await commit(h0, put("rs.k", "2"))
        second = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert second["val"]["data"] == "2"
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def test_eventlog_get_watch_and_wait_event(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(2)
    await commit(h0, append("test.d", ev(42, "foo")))
    await commit(h0, append("test.d", ev(43, "bar", data="x")), sync=(h0, 2))
    assert await run(uri, "kvs", "eventlog", "get", "--watch", "--unformatted", "--count=2",
                     "test.d") == (0, (ev(42, "foo") + ev(43, "bar", data="x")).decode(), "")
    assert await run(uri, "kvs", "eventlog", "get", "-w", "-c", "2", "test.d") == (
        0, '42.000000 foo\n43.000000 bar data="x"\n', "")
    rc, out, _ = await run(uri, "kvs", "eventlog", "wait-event", "-u", "test.d", "bar")
    assert (rc, out) == (0, ev(43, "bar", data="x").decode())
    rc, out, _ = await run(uri, "kvs", "eventlog", "wait-event", "-v", "test.d", "bar")
    assert (rc, out) == (0, '42.000000 foo\n43.000000 bar data="x"\n')
    rc, out, err = await run(uri, "kvs", "eventlog", "wait-event", "-t", "0.2", "test.d", "baz")
    assert (rc, err) == (1, "kvbroker: test.d: Connection timed out "
                            "(no event 'baz' within 0.2 s)\n")
    rc, out, err = await run(uri, "kvs", "eventlog", "wait-event", "test.nolog", "foo")
    assert (rc, err) == (1, "kvbroker: test.nolog: No such file or directory\n")
    p = await spawn(uri, "kvs", "eventlog", "wait-event", "--waitcreate", "-u", "test.f", "foo")
    await wait_watchers(h0, 1, nodeid=2)
    await commit(h0, append("test.f", ev(1, "foo", data="bar")))
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out) == (0, ev(1, "foo", data="bar"))
    await commit(h0, put("test.noteventlog", "foo"), sync=(h0, 2))
    rc, out, err = await run(uri, "kvs", "eventlog", "get", "-W", "test.noteventlog")
    assert (rc, err) == (1, f"kvbroker: test.noteventlog: {bad(1, NO_NEWLINE)}\n")
    await wait_watchers(h0, 0, nodeid=2)


async def test_ctrl_c_cancels_the_watch(start_instance, connect):
    inst = await start_instance(size=4, fanout=2)
    h0 = await connect(inst, 0)
    p = await spawn(inst.uri(1), "kvs", "get", "--watch", "--waitcreate", "never.created")
    await wait_watchers(h0, 1, nodeid=1)
    p.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(p.communicate(), 20)
    assert p.returncode == 130, err

    async def cancelled() -> bool:
        st = await stats(h0, 1)
        return bool(st["watchers"] == 0)

    await wait_until(cancelled)
    st = await stats(h0, 1)
    assert st["counts"].get("cancelled") == 1  # a cancel, not just the disconnect


async def test_watch_forms_refuse_an_unterminated_eventlog(start_instance, connect):
    """A value that is not an eventlog and does not end in a newline made
    ``wait-event`` and ``eventlog get -w`` wait forever for the newline; each
    watch answer is one append and must be whole lines (as flux decodes each
    answer), so they fail at once, as plain ``eventlog get`` does."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    await commit(h0, put("p.bad", '{"name":"submit"}'))
    await commit(h0, put("p.good", ev(1, "go").rstrip(b"\n")))  # valid JSON, no newline
    await commit(h0, append("p.log", ev(1, "one")))
    await commit(h0, append("p.log", b"garbage"), sync=(h0, 1))
    for key in ("p.bad", "p.good"):
        expected = (1, "", f"kvbroker: {key}: {bad(1, NO_NEWLINE)}\n")
        assert await run(uri, "kvs", "eventlog", "get", key, timeout=10) == expected
        assert await run(uri, "kvs", "eventlog", "wait-event", key, "go", timeout=10) == expected
        assert await run(uri, "kvs", "eventlog", "wait-event", "-W", key, "x",
                         timeout=10) == expected
        assert await run(uri, "kvs", "eventlog", "get", "-w", key, timeout=10) == expected
    # the good first append is printed, the bad second one ends the watch,
    # named by its line in the log
    line2 = f"kvbroker: p.log: {bad(2, NO_NEWLINE)}\n"
    assert await run(uri, "kvs", "eventlog", "get", "-w", "-c", "3", "p.log",
                     timeout=10) == (1, "1.000000 one\n", line2)
    assert await run(uri, "kvs", "eventlog", "wait-event", "p.log", "two", timeout=10) == (
        1, "", line2)
    # the API: wait_event raises ValueError instead of waiting -- the same
    # EventlogError (EINVAL) a read raises, so one except catches both (a
    # read's was not a ValueError, a watch's not an EventlogError)
    from kvs.client import KVS
    from kvs.eventlog import EventlogError

    with pytest.raises(EventlogError, match="improperly formatted") as watched:
        await wait_event(h0, "p.bad", "go", timeout=10)
    with pytest.raises(ValueError, match="improperly formatted") as read:
        await KVS(h0).get_eventlog("p.bad")
    assert isinstance(read.value, EventlogError) and isinstance(watched.value, ValueError)
    assert watched.value.errnum == errno.EINVAL
    await wait_watchers(h0, 0, nodeid=1)


async def test_a_read_and_a_watch_of_the_same_lines_agree(start_instance, connect):
    """Lines that are no JSON in UTF-8 (a Flux job-flow probe): a
    byte-order mark before one, or one in UTF-16, was refused by a read and
    taken by a watch (``json.loads`` of bytes guesses the encoding); NaN in
    a context (Python's, not JSON's, which the writer refuses) was taken by
    both; a lone surrogate escape in a name was taken by both, and
    ``eventlog get`` then died printing it (two tracebacks).  Each is
    refused, EINVAL, by every reader, in the same words, naming the line
    and why (it said only that the log was malformed); a surrogate pair is
    a character and reads as one."""
    from kvs.client import KVS

    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    bad_data = {"bom": b"\xef\xbb\xbf" + ev(1, "b"),
           "utf16": '{"timestamp":1.0,"name":"b"}'.encode("utf-16-le") + b"\n",
           "nan": b'{"timestamp":1.0,"name":"b","context":{"x":NaN}}\n',
           "lone": b'{"timestamp":1.0,"name":"b"}\n{"timestamp":2.0,"name":"\\ud800"}\n',
           # the first bad line, not the unterminated last one
           "first": b'garbage\n{"timestamp":1.0,"name":"b"}'}
    for key, data in bad_data.items():
        await commit(h0, put(f"l.{key}", data))
    await commit(h0, put("l.pair", b'{"timestamp":1.0,"name":"\\ud83d\\ude00"}\n'),
                 sync=(h0, 1))
    why = {"bom": (1, "a byte-order mark before it (not JSON)"),
           "utf16": (1, "not JSON: Expecting property name enclosed in double quotes"),
           "nan": (1, "NaN is not JSON"),
           "lone": (2, "not JSON in UTF-8: a lone surrogate escape"),
           "first": (1, "not JSON: Expecting value")}
    kvs = KVS(h0)
    for key in bad_data:
        want = (1, "", f"kvbroker: l.{key}: {bad(*why[key])}\n")
        assert await run(uri, "kvs", "eventlog", "get", f"l.{key}", timeout=10) == want
        assert await run(uri, "kvs", "eventlog", "get", "-u", f"l.{key}", timeout=10) == want
        assert await run(uri, "kvs", "eventlog", "wait-event", f"l.{key}", "b",
                         timeout=10) == want
        for read in (kvs.get_eventlog(f"l.{key}"), wait_event(h0, f"l.{key}", "b", timeout=10)):
            with pytest.raises(ValueError, match="improperly formatted") as exc:
                await read
            assert f"Invalid argument ({exc.value})" == bad(*why[key])
    assert await run(uri, "kvs", "eventlog", "get", "l.pair", timeout=10) == (
        0, "1.000000 \U0001f600\n", "")
    assert (await kvs.get_eventlog("l.pair"))[0]["name"] == "\U0001f600"
    await wait_watchers(h0, 0, nodeid=1)


@pytest.mark.parametrize("command", [
    ("kvs", "wait", "-t", "1", "5"),
    ("kvs", "get", "--watch", "--timeout", "1", "a"),
    ("kvs", "get", "--waitcreate", "--timeout", "1", "a"),
    ("kvs", "eventlog", "wait-event", "-t", "1", "a", "x"),
    ("kvs", "watch-keys", "-t", "1", "a"),
    ("archive", "extract", "--waitcreate=1", "--list-only"),
], ids=lambda c: " ".join(c[:3]))
async def test_a_waiting_commands_timeout_bounds_connecting(command, tmp_path) -> None:
    """A waiting command's ``-t``/``--timeout`` bounds connecting too: over
    an ``ssh://`` host that never answers each waited for ever (``archive
    extract --waitcreate=FSD``: found by the hang audit, after the others)."""
    rc, _, err = await run_cli(*command, uri="ssh://nohost/tmp/kvb-x/local-0",
                               env=unanswering_ssh(tmp_path), timeout=10)
    assert rc == 1 and "Connection timed out (no answer in 1s)" in err, err
