"""flux-core t/t1008-kvs-eventlog.t, the cases the other tests left out, as
``kvbroker kvs eventlog ...`` processes against a real 2-rank instance.

Already covered elsewhere: append/get/--unformatted/--human/-L
(test_kvs_cli.py ``test_eventlog``, ``test_eventlog_color_takes_when_only_attached``),
get --watch --count, wait-event -u/-v/-t/-W, a missing or malformed eventlog
(test_watch_cli.py), append order and wait_event (test_watch_append.py).
Here: wait-event's -q and -v --human, the refused option combinations, color
on a terminal, --stream, and Flux's DURATION form of ``-t``.
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import sys

import test_watch_cli as watch_cli
from test_watch_helpers import append, commit, put, wait_watchers


def ev(ts: float, name: str, **ctx: object) -> bytes:
    e = {"timestamp": ts, "name": name, **({"context": ctx} if ctx else {})}
    return json.dumps(e, separators=(",", ":")).encode() + b"\n"


def _env(uri: str) -> dict[str, str]:
    return watch_cli._env(uri, TZ="UTC")  # --human prints local time


async def spawn(uri: str, *args: str) -> asyncio.subprocess.Process:
    return await watch_cli.spawn(uri, *args, TZ="UTC")


async def run(uri: str, *args: str, timeout: float = 20) -> tuple[int, str, str]:
    return await watch_cli.run(uri, *args, timeout=timeout, TZ="UTC")


async def run_on_tty(uri: str, *args: str, timeout: float = 20) -> tuple[int, str]:
    """Run with standard output (and error) on a pseudo-terminal, as Flux's
    runpty.py does; the exit status and what the terminal received."""
    master, slave = pty.openpty()
    try:
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "broker.cli", *args, env=_env(uri),
            stdin=asyncio.subprocess.DEVNULL, stdout=slave, stderr=slave)
    finally:
        os.close(slave)

    def drain() -> bytes:
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the last holder of the terminal's other side is gone
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)

    try:
        out = await asyncio.wait_for(asyncio.to_thread(drain), timeout)
    finally:
        if p.returncode is None:
            try:
                await asyncio.wait_for(p.wait(), timeout)
            except TimeoutError:
                p.kill()
                await p.wait()
        os.close(master)
    assert p.returncode is not None
    return p.returncode, out.decode()


ESC = "\033["


async def test_wait_event_quiet_verbose_human_and_refused_options(start_instance, connect):
    """t1008 'wait-event --human works' (``-v -H`` prints the events before the
    awaited one, the minute once and offsets within it), 'doesnt output events
    with -q', 'fails with -u and -H', 'reject invalid --color' (both usage
    errors, exit 2), and '--timeout works' with Flux's duration form ``0.2s``
    (``optparse_get_duration``; ours took bare seconds only: a usage error)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    await commit(h0, append("test.human", ev(120, "primus")))
    await commit(h0, append("test.human", ev(121, "secondus", n=1)), sync=(h0, 1))
    assert await run(uri, "kvs", "eventlog", "wait-event", "-v", "--human", "test.human",
                     "secondus") == (0, "[Jan01 00:02] primus\n[  +1.000000] secondus n=1\n", "")
    assert await run(uri, "kvs", "eventlog", "wait-event", "-q", "test.human", "secondus") == (
        0, "", "")
    for args in (("get", "-Hu", "test.human"), ("wait-event", "-Hu", "test.human", "primus"),
                 ("get", "--color=foo", "test.human"),
                 ("wait-event", "--color=foo", "test.human", "primus")):
        rc, out, err = await run(uri, "kvs", "eventlog", *args)
        assert (rc, out) == (2, ""), (args, err)
        assert "usage: kvbroker kvs eventlog" in err, (args, err)
    rc, out, err = await run(uri, "kvs", "eventlog", "wait-event", "--timeout=0.2s",
                             "test.human", "baz")
    assert (rc, out, err) == (1, "", "kvbroker: test.human: Connection timed out "
                                     "(no event 'baz' within 0.2 s)\n")
    await wait_watchers(h0, 0, nodeid=1)


async def test_color_by_default_on_a_terminal_only(start_instance, connect):
    """t1008 'displays color on tty' (no option, --color=auto, -H) and
    '--color=never disables color on tty'; through a pipe the default has
    none (the other tests read a pipe)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    await commit(h0, append("test.tty", ev(120, "primus", a=1)), sync=(h0, 1))
    rc, out = await run_on_tty(uri, "kvs", "eventlog", "get", "test.tty")
    assert rc == 0 and ESC in out and "primus" in out, out
    rc, out = await run_on_tty(uri, "kvs", "eventlog", "wait-event", "-H", "test.tty", "primus")
    assert rc == 0 and ESC in out and "[Jan01 00:02]" in out, out
    rc, out = await run_on_tty(uri, "kvs", "eventlog", "get", "--color=never", "test.tty")
    assert (rc, out) == (0, "120.000000 primus a=1\r\n")  # (the terminal's own CR)
    assert await run(uri, "kvs", "eventlog", "get", "test.tty") == (
        0, "120.000000 primus a=1\n", "")


async def test_eventlog_get_stream_prints_what_get_prints(start_instance, connect):
    """t1007's eventlog cases: 'eventlog get --stream works' (an eventlog
    of three appends, fetched in three answers, printed as a plain get),
    '--stream and --waitcreate works on existing key' and '... on
    non-existent key' (waits for the first append)."""
    inst = await start_instance(size=2)
    h0 = await connect(inst, 0)
    uri = inst.uri(1)
    for name in ("event1", "event2", "event3"):
        await commit(h0, append("test.stream.log", ev(1, name)))
    await commit(h0, put("other", "x"), sync=(h0, 1))
    plain = await run(uri, "kvs", "eventlog", "get", "test.stream.log")
    assert plain == (0, "1.000000 event1\n1.000000 event2\n1.000000 event3\n", "")
    assert await run(uri, "kvs", "eventlog", "get", "--stream", "test.stream.log") == plain
    assert await run(uri, "kvs", "eventlog", "get", "-S", "-W", "test.stream.log") == plain
    # -c N: the first N at most, without -w too (as flux's; it applied with -w only)
    two = (0, "1.000000 event1\n1.000000 event2\n", "")
    assert await run(uri, "kvs", "eventlog", "get", "-c", "2", "test.stream.log") == two
    assert await run(uri, "kvs", "eventlog", "get", "-S", "-c", "2", "test.stream.log") == two
    p = await spawn(uri, "kvs", "eventlog", "get", "--stream", "--waitcreate", "test.log2")
    await wait_watchers(h0, 1, nodeid=1)
    await commit(h0, append("test.log2", ev(2, "foo")))
    out, err = await asyncio.wait_for(p.communicate(), 20)
    assert (p.returncode, out, err) == (0, b"2.000000 foo\n", b"")
    await wait_watchers(h0, 0, nodeid=1)
