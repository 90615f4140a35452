"""Helpers shared by the broker tests (this module holds no tests).

* :class:`RawClient` speaks the connector's byte stream directly, so tests
  can send what no :class:`~broker.handle.Handle` would: garbage, forged
  message types, oversized frames.
* :func:`wait_until` polls a condition the broker has no notification for
  (a counter in ``broker.stats-get``), bounded by a timeout.
* :func:`tree_path` is the list of ranks a request crosses in the TBON.
* :func:`run_guest` runs a client as another uid; :func:`run_cli` runs the
  ``kvbroker`` command.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

from broker import codec
from broker.content.module import ContentModule
from broker.handle import Handle, parse_uri
from broker.launch import Instance
from broker.message import NODEID_ANY, Message, MsgType
from broker.module import ModuleContext

GUEST_IMPORT_GUARD = """
import sys as _sys
# After the drop to the guest's uid, importing this project's modules (or
# its venv's) fails here as it does in CI, whose clone and venv the guest
# cannot read: a test that passed here then failed only there.
class _NotAfterTheDrop:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("broker", "kvs", "kvs_watch", "msgpack", "zmq", "uvloop"):
            raise ImportError(name + " imported after the drop to the guest's uid (CI's "
                              "checkout is unreadable to it): preload it as the owner")
        return None
_sys.meta_path.insert(0, _NotAfterTheDrop())
"""
"""Python a guest's wrapper runs once it is the guest (below its setuid)."""

GUEST_CLI_PRELOAD = (
    "import broker.cli, broker.start_cli, broker.execute, broker.overlay_cli, broker.status, "
    "broker.logring, broker.sproc_client, broker.forkclient, kvs.namespaces\n")
"""What ``kvbroker`` commands import only where they use it: a guest's
wrapper imports it as the owner (:data:`GUEST_IMPORT_GUARD`)."""

KVBROKER = os.path.join(os.path.dirname(sys.executable), "kvbroker")
GUEST_UID = 65534
OTHER_GUEST_UID = 65533

DOCS = Path(__file__).resolve().parent.parent / "docs"


def install_plugin(where: Path, name: str, entry_points: str,
                   files: dict[str, str]) -> str:
    """Install plugin distribution ``name`` into directory ``where`` for the
    rank processes to find by entry point: ``files`` (relative paths) and a
    ``.dist-info`` whose ``entry_points.txt`` is ``entry_points``.  Returns
    the ``PYTHONPATH`` to give them (``where`` first)."""
    for rel, text in files.items():
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    info = where / f"{name.replace('-', '_')}-0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    return os.pathsep.join(p for p in (str(where), os.environ.get("PYTHONPATH")) if p)


def use_module_plugin(where: Path, monkeypatch: Any, name: str, cls: str,
                      source: str) -> None:
    """A one-file module ``name`` (class ``cls`` of ``source``) installed in
    ``where`` by entry point, on the rank processes' ``PYTHONPATH``."""
    module = f"{name}_mod"
    monkeypatch.setenv("PYTHONPATH", install_plugin(
        where / "plugin", f"{name}-plugin", f"[kvbroker.modules]\n{name} = {module}:{cls}\n",
        {f"{module}.py": source}))


def doc_block(doc: str, first_line: str) -> str:
    """The fenced Python block of ``docs/<doc>`` that starts with
    ``first_line``: the tests run the docs' examples as written."""
    path = DOCS / doc
    for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
        if block.startswith(first_line):
            return block
    raise AssertionError(f"no code block starting with {first_line!r} in {path}")


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 10.0
) -> None:
    """Re-check ``predicate`` until it holds; fail after ``timeout`` seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not await predicate():
                await asyncio.sleep(0.005)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


async def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal is
    asynchronous: a rank may still take one more read)."""
    os.kill(pid, signal.SIGSTOP)

    async def stopped() -> bool:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "T"

    await wait_until(stopped, f"process {pid} to stop")


@contextlib.asynccontextmanager
async def stopped(pid: int) -> AsyncIterator[None]:
    """``pid`` stopped (:func:`stop_process`) for the block, SIGCONT after,
    whatever the block raised."""
    await stop_process(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def stats(h: Handle, rank: int = NODEID_ANY) -> dict[str, Any]:
    # (15 s, not 5: once in a full suite on 2 loaded cores, rank 1's answer
    # right after its child was SIGKILLed over ipc took longer than 5 s)
    return await asyncio.wait_for(h.rpc("broker.stats-get", {}, nodeid=rank), 15)


def client_subscriptions(st: dict[str, Any]) -> int:
    """The event subscriptions the clients of a rank hold, from its
    ``broker.stats-get`` answer ``st``: its modules' own (``m:kvs``,
    ``m:kvs-watch``, one each on every rank) left out, so that a test
    waiting for a client to subscribe does not see them as its."""
    return sum(n for peer, n in st["subscriptions"].items() if peer.startswith("c"))


def rank0_content(rundir: object, **attrs: str) -> ContentModule:
    """Rank 0's content module in this process (not started), for tests of
    its own workings with a real SQLite file in ``rundir``; ``attrs`` are
    its attributes (``content.cache-bytes``, ``statedir``, ...)."""
    ctx = ModuleContext(rank=0, size=1, fanout=2, attrs={"rundir": str(rundir), **attrs},
                        owner_uid=os.getuid(), log=logging.getLogger("test"))
    return ContentModule(ctx)


def ancestors(rank: int, fanout: int) -> list[int]:
    """``rank`` and every rank above it, up to 0."""
    out = [rank]
    while rank != 0:
        rank = (rank - 1) // fanout
        out.append(rank)
    return out


def tree_path(src: int, dst: int, fanout: int) -> list[int]:
    """Every rank a request crosses from ``src`` to ``dst``, both included."""
    up, down = ancestors(src, fanout), ancestors(dst, fanout)
    common = next(r for r in up if r in down)
    return up[: up.index(common) + 1] + list(reversed(down[: down.index(common)]))


# ---------------------------------------------------------------- raw client


class RawClient:
    """A connection to a rank's local connector, without the Handle's manners."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = codec.StreamDecoder()
        self.pending: deque[list[bytes]] = deque()

    @classmethod
    async def connect(cls, inst: Instance, rank: int = 0) -> RawClient:
        path = parse_uri(inst.uri(rank))
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 5)
        return cls(reader, writer)

    def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)

    def send_frames(self, frames: list[bytes]) -> None:
        self.writer.write(codec.to_stream(frames))

    def send(self, msg: Message) -> None:
        self.send_frames(codec.encode(msg))  # type: ignore[arg-type]

    def request(
        self,
        topic: str,
        payload: Any = None,
        *,
        matchtag: int,
        nodeid: int = NODEID_ANY,
        flags: int = 0,
    ) -> None:
        self.send(
            Message(MsgType.REQUEST, topic, payload, matchtag=matchtag, nodeid=nodeid, flags=flags)
        )

    async def recv_frames(self, timeout: float = 5.0) -> list[bytes]:
        async with asyncio.timeout(timeout):
            while not self.pending:
                data = await self.reader.read(1 << 16)
                if not data:
                    raise EOFError("the broker closed the connection")
                self.pending.extend(self.decoder.feed(data))
        return self.pending.popleft()

    async def recv(self, timeout: float = 5.0) -> Message:
        return codec.decode(await self.recv_frames(timeout))

    async def rpc(
        self, topic: str, payload: Any = None, *, matchtag: int, nodeid: int = NODEID_ANY
    ) -> Message:
        """Send a request and return the next message, which must answer it."""
        self.request(topic, payload, matchtag=matchtag, nodeid=nodeid)
        msg = await self.recv()
        assert msg.type == MsgType.RESPONSE and msg.matchtag == matchtag, msg
        return msg

    async def wait_closed_by_peer(self, timeout: float = 5.0) -> None:
        """Read (and discard) until the broker closes the connection."""
        async with asyncio.timeout(timeout):
            while await self.reader.read(1 << 16):
                pass

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), 5)
        except (ConnectionError, BrokenPipeError):
            pass


# ---------------------------------------------------------------- other users

# Runs as root long enough to import everything (the interpreter lives under
# /root, which other users cannot read), then drops to the guest uid *before*
# connecting: SO_PEERCRED reports the credentials of connect() time.
GUEST_SCRIPT = r"""
import asyncio, json, os, socket, sys
from broker.errors import RemoteError
from broker.handle import Handle
from broker.loops import loop_factory

def out(**kw):
    print(json.dumps(kw), flush=True)

async def scenario_identity(h):
    r = await h.ping()
    out(userid=r["userid"], rolemask=r["rolemask"], rank=r["rank"])
    for topic in ("kvs.namespace-primary-setroot", "broker.fake", "guest.hello"):
        try:
            out(topic=topic, seq=await h.publish(topic, {}))
        except RemoteError as e:
            out(topic=topic, errnum=e.errnum)
    try:
        await h.rpc("content.store", {"data": b"guest"})
        out(content=0)
    except RemoteError as e:
        out(content=e.errnum)
    for rank in (3, 0):
        try:
            await h.rpc("broker.shutdown", {}, nodeid=rank)
            out(shutdown=0)
        except RemoteError as e:
            out(shutdown=e.errnum)
    try:
        await h.rpc("attr.set", {"name": "log.level", "value": "debug"})
        out(attr_set=0)
    except RemoteError as e:
        out(attr_set=e.errnum)
    try:
        async for _ in h.rpc_stream("log.dmesg", {}):
            pass
        out(dmesg=0)
    except RemoteError as e:
        out(dmesg=e.errnum)
    try:
        await h.rpc("log.append", {"message": "a guest's line"})
        out(logger=0)
    except RemoteError as e:
        out(logger=e.errnum)
    try:
        await h.rpc("overlay.disconnect-subtree", {"rank": 3}, nodeid=1)
        out(disconnect=0)
    except RemoteError as e:
        out(disconnect=e.errnum)
    rundir = os.path.dirname(h.uri[len("local://"):])
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(os.path.join(rundir, "tbon-0"))
        out(tbon=0)
    except OSError as e:
        out(tbon=e.errno)
    finally:
        s.close()

async def scenario_private(h):
    await h.subscribe("priv.")
    out(subscribed=True)
    while True:
        ev = await h.recv_event()
        out(topic=ev.topic, seq=ev.seq)
        if ev.topic == "priv.go" and sys.argv[5] == "publish":
            await h.publish("priv.from-guest", {}, private=True)
        if ev.topic == "priv.end":
            return

async def main(uri, name):
    try:
        h = await Handle.connect(uri)
    except OSError as e:
        out(connect=e.errno)
        return
    try:
        async with h:
            await globals()["scenario_" + name](h)
    except RemoteError as e:
        out(error=e.errnum)

uri, uid, loop, name = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
runner = asyncio.Runner(loop_factory=loop_factory(loop))
runner.get_loop()
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
with runner:
    runner.run(asyncio.wait_for(main(uri, name), 30))
"""


class Guest:
    """A client process running as another user; its output is JSON lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, timeout: float = 10.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            err = b""
            if self.proc.stderr is not None:
                err = await asyncio.wait_for(self.proc.stderr.read(), timeout)
            raise AssertionError(f"guest exited early: {err.decode()[-2000:]}")
        return json.loads(raw)

    async def lines(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Every remaining line, once the guest exits (must exit 0)."""
        out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        assert self.proc.returncode == 0, err.decode()[-2000:]
        return [json.loads(x) for x in out.decode().splitlines()]


STEP_SCRIPT = r"""
# imported while root: the guest uid cannot read this Python's library
import asyncio, concurrent.futures.thread, json, os, socket, sys
import uvloop
from broker import codec
from broker.errors import RemoteError
from broker.handle import Handle
from broker.message import NODEID_ANY

uri, uid, loop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
path = uri[len("local://"):]

def out(**kw):
    print(json.dumps(kw), flush=True)

async def step():
    # the test's go-ahead, one line on stdin
    return (await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)).strip()

async def outcome(call):
    # "ok", or the [errnum, errstr] the call failed with
    try:
        await asyncio.wait_for(call, 10)
        return "ok"
    except RemoteError as exc:
        return [exc.errnum, exc.errstr]

def request(topic, payload, tag):
    frames = codec.encode_request(topic, payload, tag, NODEID_ANY, 0)
    return b"".join([codec.stream_prefix(frames), *frames])

def raw():
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    return s

def read_one(s, dec):
    # the frames of the next whole message on s (dec keeps what follows it)
    got = []
    while not got:
        got = dec.feed(s.recv(1 << 16))
    return got[0]

def read_all(s):
    # what the rank sends until it closes the connection: the responses'
    # [matchtag, errnum, errstr], how many events, and "eof" or "reset"
    dec, responses, events = codec.StreamDecoder(), [], 0
    s.settimeout(20)
    while True:
        try:
            data = s.recv(1 << 16)
        except ConnectionResetError:
            end = "reset"
            break
        if not data:
            end = "eof"
            break
        for frames in dec.feed(data):
            peek = codec.peek_response(frames)
            if peek is None:
                events += 1
            else:
                responses.append(list(peek))
    return {"responses": responses, "events": events, "end": end}

def send_until_closed(s, data):
    try:
        s.sendall(data)
    except OSError:  # the rank closed the connection part-way
        pass

async def ping(h):
    try:
        await h.rpc("broker.ping", {})
        return 0, ""
    except RemoteError as exc:
        return exc.errnum, exc.errstr

BODY

os.setgroups([])
os.setgid(uid)
os.setuid(uid)
(uvloop.run if loop == "uvloop" else asyncio.run)(asyncio.wait_for(main(), 60))
"""


class GuestProc(Guest):
    """A guest process running ``body`` (which defines ``async def main()``,
    with the helpers of :data:`STEP_SCRIPT`); it prints JSON lines and waits
    for a line on stdin where the body says ``await step()``."""

    @classmethod
    async def start(cls, uri: str, body: str, uid: int = GUEST_UID,
                    loop: str = "asyncio") -> GuestProc:
        script = STEP_SCRIPT.replace("BODY", textwrap.dedent(body))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, uri, str(uid), loop, cwd="/",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        return cls(proc)

    def go(self, word: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word.encode() + b"\n")

    async def finish(self, timeout: float = 20.0) -> None:
        _out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        assert self.proc.returncode == 0, err.decode()[-2000:]

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def run_guest(
    uri: str, scenario: str, *args: str, uid: int = GUEST_UID, loop: str = "asyncio"
) -> Guest:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        GUEST_SCRIPT,
        uri,
        str(uid),
        loop,
        scenario,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd="/",
    )
    return Guest(proc)


# ---------------------------------------------------------------- the CLI


async def run_python(script: str, *args: str, timeout: float = 40.0) -> tuple[int, str, str]:
    """Run ``python -c SCRIPT ARGS`` from the repository's top (a script
    that needs a process of its own: a fork, a launcher of its own); return
    (exit status, stdout, stderr).  Killed if it outlasts ``timeout``."""
    return await run_program(sys.executable, "-c", script, *args, timeout=timeout,
                             cwd=str(Path(__file__).parent.parent))


async def run_program(*argv: str, timeout: float = 40.0, cwd: str | None = None,
                      env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run ``argv`` (its input /dev/null); return (exit status, stdout,
    stderr).  Killed if it outlasts ``timeout``."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, cwd=cwd, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@contextlib.contextmanager
def held_in_another_process(statement: str) -> Iterator[None]:
    """Run the Python ``statement`` (opening a store, making a restore's
    file: it takes the locks) in a process of its own, held until the block
    ends -- a running instance's hold, as another process sees it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys; {statement}; print('ready', flush=True); "
         "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        yield
    finally:
        holder.communicate("")


def unanswering_ssh(tmp_path: Path) -> dict[str, str]:
    """An environment whose ``ssh://`` URIs reach an ssh that never answers
    (it reads its input until the client goes, and writes nothing): what a
    command's ``-t`` must bound, connecting included."""
    ssh = tmp_path / "ssh"
    ssh.write_text("#!/bin/sh\nexec cat >/dev/null\n")
    ssh.chmod(0o755)
    return {**os.environ, "KVBROKER_SSH": str(ssh)}


async def communicate(proc: asyncio.subprocess.Process,
                      input: bytes | None) -> tuple[bytes, bytes]:
    """``proc.communicate(input)``, except that a command which ends without
    reading its input (it failed first, or needed none) is not an error.

    The stdlib writes ``input`` even when it is empty, and uvloop's pipe
    transport raises RuntimeError ("the handler is closed"), not
    BrokenPipeError, once it has seen the reading end close: a fast command
    (a served one exits in a few ms) can end before the write is made."""
    if input is None or proc.stdin is None:
        return await proc.communicate()

    async def feed(stdin: asyncio.StreamWriter) -> None:
        try:
            if input:
                stdin.write(input)
                await stdin.drain()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass  # it ended without reading it all: its exit status says why
        finally:
            stdin.close()

    _, (out, err) = await asyncio.gather(feed(proc.stdin), proc.communicate())
    return out, err


async def run_cli(
    *args: str,
    uri: str | None = None,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    input: bytes | None = None,
    cwd: str | Path | None = None,
    stdin: int | None = None,
    meanwhile: Callable[[asyncio.subprocess.Process], Awaitable[None]] | None = None,
) -> tuple[int, str, str]:
    """Run ``kvbroker ARGS`` (with ``KVBROKER_URI=uri`` when given; in
    ``cwd``; ``input`` on a pipe, or the file descriptor ``stdin``, else
    /dev/null); return (exit status, stdout, stderr).  ``meanwhile(proc)``:
    awaited once the command runs, before its end is read (a fault to make
    while it waits: a signal, a rank killed), within ``timeout`` too."""
    e = dict(os.environ if env is None else env)
    e.pop("KVBROKER_URI", None)
    if uri is not None:
        e["KVBROKER_URI"] = uri
    proc = await asyncio.create_subprocess_exec(
        KVBROKER,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=(asyncio.subprocess.PIPE if input is not None
               else asyncio.subprocess.DEVNULL if stdin is None else stdin),
        env=e,
        cwd=cwd,
    )
    try:
        async with asyncio.timeout(timeout):
            if meanwhile is not None:
                await meanwhile(proc)
            out, err = await communicate(proc, input)
    finally:
        if proc.returncode is None:  # (timed out, or meanwhile failed)
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@contextlib.contextmanager
def started_in_background(log: Path, *args: str) -> Iterator[str]:
    """``kvbroker start ARGS`` (no command: it serves until SIGINT) for a
    module's tests; yields the URI it prints, and stops it at the end (its
    ranks' stderr in ``log``)."""
    with open(log, "wb") as err:
        proc = subprocess.Popen([KVBROKER, "start", *args], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("local://"), (line, log.read_text())
        yield line
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
