"""What a type checker sees of the watch API, and of other calls whose options

A user who runs ``mypy --strict`` on their own code reads ``entry.value``
straight from a plain watch: it yields :class:`WatchEntry`, and only a watch
given ``initial_sentinel`` yields ``WatchEntry | InitialDone``.  These tests
run mypy (the test extra installs it) on a small user script and check the
types it reveals and that it reports no error.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

USER_CODE = '''
from broker.handle import Handle
from kvs.client import KVS, SyncKVS
from kvs_watch.client import stream, watch, watch_eventlog, watch_keys


async def user(h: Handle, kvs: KVS, skvs: SyncKVS, flag: bool) -> None:
    async with watch(h, "a", waitcreate=True) as w:
        async for e in w:
            reveal_type(e)  # plain
            print(e.value, e.rootseq)
    async for e2 in watch(h, "a", append=True, initial_sentinel=True):
        reveal_type(e2)  # sentinel
    reveal_type(watch(h, "a", append=True, initial_sentinel=flag))  # maybe-sentinel
    async for e3 in kvs.watch("a", uniq=True, nodeid=3):
        reveal_type(e3)  # kvs-plain
        print(e3.value)
    reveal_type(kvs.watch("a", append=True, initial_sentinel=True))  # kvs-sentinel
    async for e4 in stream(h, "a"):
        reveal_type(e4)  # stream
    async for c in watch_keys(h, "a"):
        reveal_type(c)  # keys
    async for ev in watch_eventlog(h, "a"):
        reveal_type(ev)  # eventlog
    with skvs.watch("a", timeout=1.0) as sw:
        for e5 in sw:
            reveal_type(e5)  # sync-plain
            print(e5.value)
    for e6 in skvs.watch("a", append=True, initial_sentinel=True):
        reveal_type(e6)  # sync-sentinel
    for c2 in skvs.watch_keys("a"):
        reveal_type(c2)  # sync-keys
    for ev2 in skvs.watch_eventlog("a"):
        reveal_type(ev2)  # sync-eventlog
    async with Handle.connect() as h2:
        reveal_type(h2)  # connect-with
    reveal_type(await Handle.connect())  # connect-await
    async with KVS.connect() as k2:
        reveal_type(k2)  # kvs-connect-with
    reveal_type(await kvs.get("a"))  # get
    reveal_type(await kvs.get("a", None))  # get-default
    reveal_type(await kvs.get_str("a", "x"))  # get-str-default
    reveal_type(skvs.get_str("a", None))  # sync-get-str-default
    reveal_type(await kvs.diff("r"))  # diff
    reveal_type(await kvs.diff("r", status=True))  # diff-status
    reveal_type(skvs.diff("r", key="a", status=True))  # sync-diff-status
'''

ENTRY = "kvs_watch.client.WatchEntry"
EITHER = "kvs_watch.client.WatchEntry | kvs_watch.client.InitialDone"
STATUS = "dict[str, Literal['added'] | Literal['removed'] | Literal['changed']]"
EXPECTED = {
    "plain": ENTRY,
    "sentinel": EITHER,
    "maybe-sentinel": f"kvs_watch.client.Watch[{EITHER}]",
    "kvs-plain": ENTRY,
    "kvs-sentinel": f"kvs_watch.client.Watch[{EITHER}]",
    "stream": ENTRY,
    "keys": "kvs_watch.client.KeyChanges",
    "eventlog": "dict[str, Any]",
    "sync-plain": ENTRY,
    "sync-sentinel": EITHER,
    "sync-keys": "kvs_watch.client.KeyChanges",
    "sync-eventlog": "dict[str, Any]",
    "connect-with": "broker.handle.Handle",
    "connect-await": "broker.handle.Handle",
    "kvs-connect-with": "kvs.client.KVS",
    "get": "bytes",
    "get-default": "bytes | None",
    "get-str-default": "str",
    "sync-get-str-default": "str | None",
    "diff": "list[str]",
    "diff-status": STATUS,
    "sync-diff-status": STATUS,
}


def _check(tmp_path: Path, code: str) -> tuple[str, int]:
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent(code))
    out, err, status = mypy_api.run([
        "--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"),
        "--python-version", "3.11", str(script)])
    return out + err, status


def test_watches_yield_the_types_their_options_say(tmp_path: Path) -> None:
    out, status = _check(tmp_path, USER_CODE)
    lines = USER_CODE.splitlines()
    revealed: dict[str, str] = {}
    for m in re.finditer(r"user\.py:(\d+): note: Revealed type is \"(.+)\"", out):
        label = lines[int(m.group(1)) - 1].split("#")[-1].strip()
        revealed[label] = m.group(2)
    assert revealed == EXPECTED, out
    assert status == 0 and " error: " not in out, out  # e.value needs no narrowing


def test_a_watch_with_the_sentinel_needs_narrowing(tmp_path: Path) -> None:
    """The checker catches a user reading ``.value`` off what may be the sentinel."""
    out, status = _check(tmp_path, '''
        from broker.handle import Handle
        from kvs_watch.client import WatchEntry, watch


        async def user(h: Handle) -> None:
            async for e in watch(h, "a", append=True, initial_sentinel=True):
                print(e.value)
            async for e2 in watch(h, "a", append=True, initial_sentinel=True):
                if isinstance(e2, WatchEntry):
                    print(e2.value)
        ''')
    assert status == 1, out
    errors = [line for line in out.splitlines() if " error: " in line]
    assert len(errors) == 1 and ':8: error: Item "InitialDone"' in errors[0], out
