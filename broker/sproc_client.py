"""Python API of the ``rexec`` service's background commands
(:mod:`broker.rexec`): start a command in the background on ranks, list a
rank's commands, signal one, wait for a waitable one and collect what it
wrote.  ``kvbroker exec --bg`` and ``kvbroker sproc`` are built on it.

    async with Handle.connect() as h:
        procs = Procs(h)
        pids = await procs.start(["sh", "-c", "sleep 60"], ranks="all",
                                 waitable=True, label="sleeper")    # {0: 4242, 1: 4243}
        for p in await procs.list(rank=1):
            print(p.pid, p.state, p.label, p.cmd)                   # 4243 R sleeper [...]
        await procs.kill("sleeper", rank=1)                         # SIGTERM
        print((await procs.wait("sleeper", rank=1)).code)           # 143

A command is named by its pid (an ``int``) or by its label (a ``str``);
``rank=None`` is the rank the handle is attached to.  Errors are the
rank's, as :class:`broker.errors.RemoteError`: ``ESRCH`` a pid or label
the rank does not know, ``EINVAL`` a wait for a command that is not
waitable, ``EEXIST`` a label taken (docs/protocol.md, "rexec").
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from broker.command import exit_code
from broker.errors import ErrnoError, RemoteError
from broker.idset import decode_ranks
from broker.message import NODEID_ANY
from broker.rpc import WAIT_GRACE, HandleCore

if TYPE_CHECKING:
    from broker.sync import SyncHandle

T = TypeVar("T")

SERVICE = "rexec"
"""The subprocess service (the only one; ``sproc --service`` names it)."""

Target = int | str
"""A command as a request names it: its pid, or its label."""
Ranks = int | Iterable[int] | str | None
"""Where :meth:`Procs.start` starts: a rank, ranks, an idset (``"0-3"``)
or ``"all"``; None, the rank the handle is attached to."""


@dataclass(frozen=True)
class Proc:
    """A command of a rank, as ``rexec.list`` shows it."""

    rank: int
    pid: int
    state: str
    """``R`` running, ``Z`` a zombie (a waitable command that has ended,
    until :meth:`Procs.wait` collects it)."""
    label: str
    """Its label (``""``: none)."""
    cmd: tuple[str, ...]
    bg: bool
    """A background command (the rank's): else one of a client's ``exec``."""
    waitable: bool
    mine: bool
    """Started by this handle's connection."""

    @property
    def running(self) -> bool:
        return self.state == "R"


@dataclass(frozen=True)
class WaitResult:
    """What :meth:`Procs.wait` collected of a waitable command."""

    status: int
    """Its exit status, ``-N`` when signal N ended it (as ``Popen``'s)."""
    stdout: bytes = b""
    """With ``output``: the last bytes of its standard output the rank kept
    (at most :data:`broker.rexec.RETAINED_OUTPUT`); else empty."""
    stderr: bytes = b""
    stdout_dropped: int = 0
    """Bytes of its standard output dropped before :attr:`stdout`."""
    stderr_dropped: int = 0

    @property
    def code(self) -> int:
        """The status as a shell has it: 128+N for signal N (143 SIGTERM)."""
        return exit_code(self.status)

    @property
    def signal(self) -> int | None:
        """The signal that ended it, if one did."""
        return -self.status if self.status < 0 else None

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> WaitResult:
        return cls(int(answer["status"]), bytes(answer.get("stdout") or b""),
                   bytes(answer.get("stderr") or b""),
                   int(answer.get("stdout-dropped") or 0),
                   int(answer.get("stderr-dropped") or 0))


class StartError(RemoteError):
    """:meth:`Procs.start` failed on some rank: ``errnum`` and the text are
    the lowest such rank's (``ENOENT`` command not found...), ``errors``
    has each failed rank's :class:`RemoteError`, ``started`` the pid of
    each rank where it did start -- those commands run on (kill them, or
    wait for them, by pid or label)."""

    def __init__(self, started: dict[int, int], errors: dict[int, ErrnoError]) -> None:
        first = errors[min(errors)]
        text = "; ".join(f"rank {r}: {e.errstr or os.strerror(e.errnum)}"
                         for r, e in sorted(errors.items()))
        if started:
            text += " (started on rank" + ("s " if len(started) > 1 else " ") + ", ".join(
                f"{r} as pid {p}" for r, p in sorted(started.items())) + ")"
        super().__init__(first.errnum, text)
        self.started = started
        self.errors = errors


def named(target: Target) -> dict[str, Any]:
    """A target as ``rexec.kill`` and ``rexec.wait`` take it: an ``int`` is
    a pid, a ``str`` a label (a label is never a number)."""
    if isinstance(target, bool) or not isinstance(target, (int, str)):
        raise TypeError(f"a command is named by its pid (int) or its label (str), not "
                        f"{target!r}")
    return {"pid": target} if isinstance(target, int) else {"label": target}


def _mapped(fut: asyncio.Future[Any], fn: Callable[[Any], T], *,
            timed_out: bool = False) -> asyncio.Future[T]:
    """A future of ``fn(fut's result)`` (its error, its cancel); cancelling
    it cancels ``fut``, whose answer is then dropped.  ``timed_out``: the
    rank's ``ETIMEDOUT`` (a ``timeout`` it was given) is ``TimeoutError``."""
    out: asyncio.Future[T] = fut.get_loop().create_future()

    def settled(f: asyncio.Future[Any]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif (error := f.exception()) is not None:
            if (timed_out and isinstance(error, RemoteError)
                    and error.errnum == errno.ETIMEDOUT):
                error = TimeoutError(error.errstr)
            out.set_exception(error)
        else:
            try:
                out.set_result(fn(f.result()))
            except Exception as exc:  # (a malformed answer)
                out.set_exception(exc)

    fut.add_done_callback(settled)
    out.add_done_callback(lambda o: fut.cancel() if o.cancelled() else None)
    return out


def _nodeid(rank: int | None) -> int:
    return NODEID_ANY if rank is None else rank


class Procs:
    """The background commands of the instance ``h`` is attached to
    (``rexec`` is every rank's, built in: nothing to load).  The instance
    owner's: a guest's requests are ``EPERM``."""

    def __init__(self, h: HandleCore, service: str = SERVICE) -> None:
        self.h = h
        self.service = service
        self._waits: dict[int, tuple[asyncio.Future[WaitResult], int]] = {}
        """The waits sent and not settled, by matchtag: one cancelled is
        cancelled on its rank too, before the next request of this object
        (:meth:`_tell_given_up`)."""

    async def start(self, cmd: builtins.list[str], *, ranks: Ranks = None,
                    waitable: bool = False, label: str | None = None,
                    env: Mapping[str, str] | None = None,
                    cwd: str | os.PathLike[str] | None = None) -> dict[int, int]:
        """Start ``cmd`` in the background on each of ``ranks`` at once:
        each rank's pid, by rank.  It is the rank's (it outlives this
        handle, not the rank), its input ``/dev/null``; ``waitable`` keeps
        it once ended, with the last MiB of each of its streams, until
        :meth:`wait`; ``label`` names it on each rank.  ``env``: its whole
        environment (default: the rank's), ``cwd`` its working directory
        (default: the rank's; a relative one is this process's).

        If any rank could not start it, :class:`StartError` (a
        :class:`RemoteError`) once every rank has answered, carrying what
        each did; the commands that did start run on."""
        where = await self._ranks(ranks)
        payload = self._payload(cmd, waitable, label, env, cwd)
        started: dict[int, int] = {}
        errors: dict[int, ErrnoError] = {}

        async def one(nodeid: int) -> None:
            try:
                rank, pid = await self._exec(payload, nodeid)
            except ErrnoError as exc:
                errors[nodeid] = exc
            else:
                started[rank] = pid

        await asyncio.gather(*(one(n) for n in where))
        if errors:
            if NODEID_ANY in errors:  # (the rank attached to: name it)
                here = await self.h.rpc("attr.get", {"name": "rank"})
                errors[int(here["value"])] = errors.pop(NODEID_ANY)
            raise StartError(dict(sorted(started.items())), errors)
        return dict(sorted(started.items()))

    async def start_one(self, cmd: builtins.list[str], *, rank: int | None = None,
                        waitable: bool = False, label: str | None = None,
                        env: Mapping[str, str] | None = None,
                        cwd: str | os.PathLike[str] | None = None) -> int:
        """:meth:`start` on one rank: its pid; the rank's own
        :class:`RemoteError` if it could not start it."""
        return (await self._exec(self._payload(cmd, waitable, label, env, cwd),
                                 _nodeid(rank)))[1]

    async def list(self, rank: int | None = None) -> builtins.list[Proc]:
        """The commands of ``rank`` (running and zombies): background ones,
        and those of clients' ``exec`` on another host."""
        answer = await self.h.rpc(f"{self.service}.list", {}, nodeid=_nodeid(rank))
        where = int(answer["rank"])
        return [Proc(where, int(p["pid"]), str(p.get("state", "R")), str(p.get("label", "")),
                     tuple(p.get("cmd") or ()), bool(p.get("bg")), bool(p.get("waitable")),
                     bool(p.get("mine")))
                for p in answer.get("procs", [])]

    async def kill(self, target: Target, signum: int = signal.SIGTERM, *,
                   rank: int | None = None) -> None:
        """Send ``signum`` to the command's process group.  ``ESRCH`` for a
        command the rank does not have, or a zombie (it has exited:
        :meth:`wait` collects it)."""
        await self.h.rpc(f"{self.service}.kill", {**named(target), "signum": int(signum)},
                         nodeid=_nodeid(rank))

    def wait(self, target: Target, *, rank: int | None = None, output: bool = False,
             timeout: float | None = None) -> asyncio.Future[WaitResult]:
        """Wait for a waitable command to end (at once for a zombie) and
        collect it: the rank forgets it (a second wait is ``ESRCH``).
        ``output``: with what the rank kept of its output.  ``EINVAL`` for
        a command that is not waitable, ``EBUSY`` while another client
        waits for it.  ``timeout`` (seconds): the rank gives up after that
        long, keeping the command for a later wait, and the future fails
        with ``TimeoutError``.

        A future, as ``h.rpc``'s, and the request is sent when this is
        called: ``w = procs.wait("job")``, then ``await procs.kill("job")``,
        reach the rank in that order, so the wait finds the command however
        soon the signal ends it.  Cancelling it (``w.cancel()``, a
        ``wait_for`` around it) cancels the wait on the rank too
        (``rexec.wait-cancel``): else the rank would answer it -- to nobody
        -- once the command ended, and forget the command and its status."""
        payload: dict[str, Any] = {**named(target), "output": output}
        if timeout is not None:
            payload["timeout"] = max(float(timeout), 0.0)
        nodeid = _nodeid(rank)
        self._tell_given_up()
        tag, answer = self.h.rpc_tagged(f"{self.service}.wait", payload, nodeid=nodeid)
        out = _mapped(answer, WaitResult.from_answer, timed_out=timeout is not None)
        self._waits[tag] = (out, nodeid)
        out.add_done_callback(lambda _: self._tell_given_up())
        return out

    def _tell_given_up(self) -> None:
        """Cancel on their ranks the waits cancelled here, and forget the
        settled ones.  Run as a wait's future is done (a callback: a turn
        later) and before each new wait is sent, so that a retry right
        after ``w.cancel()`` reaches the rank after the cancel, not before
        it (``EBUSY``)."""
        for tag, (out, nodeid) in list(self._waits.items()):
            if not out.done():
                continue
            del self._waits[tag]
            if out.cancelled():
                with contextlib.suppress(RemoteError, OSError):  # (the handle is closed)
                    self.h.send_noresponse(f"{self.service}.wait-cancel", {"matchtag": tag},
                                           nodeid=nodeid)
                self.h.retire(tag)  # (the rank answers the wait ECANCELED: the tag is free)

    # -- helpers
    async def _ranks(self, ranks: Ranks) -> builtins.list[int]:
        if ranks is None:
            return [NODEID_ANY]
        if isinstance(ranks, bool):
            raise TypeError(f"ranks: not {ranks!r}")
        if isinstance(ranks, int):
            return [ranks]
        if isinstance(ranks, str):
            size = int((await self.h.rpc("attr.get", {"name": "size"}))["value"])
            if ranks == "all":
                return list(range(size))
            return sorted(decode_ranks(ranks, size))  # (ValueError: not an idset of it)
        out = sorted(set(ranks))
        if not out:
            raise ValueError("ranks: no rank given")
        return out

    @staticmethod
    def _payload(cmd: builtins.list[str], waitable: bool, label: str | None,
                 env: Mapping[str, str] | None,
                 cwd: str | os.PathLike[str] | None) -> dict[str, Any]:
        if isinstance(cmd, str):
            raise TypeError("cmd is a list of words, not a string (for a shell line: "
                            "['sh', '-c', line])")
        payload: dict[str, Any] = {"cmd": list(cmd), "bg": True, "waitable": waitable}
        if label is not None:
            payload["label"] = label
        if env is not None:
            payload["env"] = dict(env)
        if cwd is not None:
            payload["cwd"] = os.path.abspath(cwd)
        return payload

    async def _exec(self, payload: dict[str, Any], nodeid: int) -> tuple[int, int]:
        """Start a background command: (its rank, its pid).  The stream
        ends at once after ``started``."""
        got: tuple[int, int] | None = None
        async for answer in self.h.rpc_stream(f"{self.service}.exec", payload, nodeid=nodeid):
            if isinstance(answer, dict) and answer.get("type") == "started" and got is None:
                got = (int(answer.get("rank", nodeid)), int(answer["pid"]))
        if got is None:
            where = "the rank" if nodeid == NODEID_ANY else f"rank {nodeid}"
            raise RemoteError(errno.EPROTO, f"{where} ended {self.service}.exec without "
                              "starting it")
        return got


class SyncProcs:
    """Blocking twin of :class:`Procs`, on a :class:`broker.sync.SyncHandle`
    (each call bounded by the handle's timeout, except :meth:`wait`, which
    waits as long as its own ``timeout`` says: None, as long as it takes)."""

    def __init__(self, sh: SyncHandle, service: str = SERVICE) -> None:
        self.sync_handle = sh
        self.aio = Procs(sh.aio, service)

    def start(self, cmd: builtins.list[str], **kw: Any) -> dict[int, int]:
        return self.sync_handle.run(self.aio.start(cmd, **kw))

    def start_one(self, cmd: builtins.list[str], **kw: Any) -> int:
        return self.sync_handle.run(self.aio.start_one(cmd, **kw))

    def list(self, rank: int | None = None) -> builtins.list[Proc]:
        return self.sync_handle.run(self.aio.list(rank))

    def kill(self, target: Target, signum: int = signal.SIGTERM, *,
             rank: int | None = None) -> None:
        self.sync_handle.run(self.aio.kill(target, signum, rank=rank))

    def wait(self, target: Target, *, rank: int | None = None, output: bool = False,
             timeout: float | None = None) -> WaitResult:
        """:meth:`Procs.wait`; with ``timeout`` the rank gives up (keeping
        the command) and this raises ``TimeoutError``; a rank that answers
        nothing at all is given up on :data:`WAIT_GRACE` seconds later."""
        async def waiting() -> WaitResult:  # (sent once the call has the handle)
            return await self.aio.wait(target, rank=rank, output=output, timeout=timeout)

        return self.sync_handle.run(waiting(), None if timeout is None
                                    else max(float(timeout), 0.0) + WAIT_GRACE)
