"""Python API of the ``cron`` module (:mod:`broker.cron`): create entries
(a shell command and its trigger: an interval, an event, a crontab
schedule, a time), read them, stop, start and delete them, set the sync
event.  ``kvbroker cron`` is built on it.

    async with Handle.connect() as h:
        cron = Cron(h)
        e = await cron.interval("./sweep >>sweep.log 2>&1", "10m", rank=1)
        await cron.event("./on-done", "job.done", nth=2)
        print((await cron.get(e["id"], rank=1))["stats"]["count"])   # runs so far
        await cron.delete(e["id"], kill=True, rank=1)

Each rank's cron runs its own entries on its host (``rank=None``: the
rank the handle is attached to), and ids are per rank.  An entry is a
dict, as the module answers (docs/protocol.md, "cron"): ``id``, ``rank``,
``name``, ``command``, ``type``, ``state`` (``active``, ``stopped``,
``deleted``), ``repeat``, ``typedata`` (the trigger, and ``next``: when
it is next due), ``stats`` (``count``, ``failcount``, ``success``...)
and ``tasks`` (the last runs, newest first, ``task-history-count`` of
them: ``state``, ``pid``, ``status``, ``code``, ``output``...), and
``source`` (``FILE:LINE``) for an entry rank 0 made from a crontab of
``cron.directory``.  Errors are :class:`broker.errors.RemoteError`:
``ENOENT`` an unknown id, ``EINVAL`` a bad trigger, ``ENOSYS`` the module
not loaded on that rank.
"""

from __future__ import annotations

import builtins
import datetime as dt
import errno
import os
import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from broker.errors import ErrnoError, RemoteError
from broker.message import NODEID_ANY
from broker.rpc import HandleCore

if TYPE_CHECKING:
    from broker.sync import SyncHandle

Entry = dict[str, Any]
Duration = float | int | str | dt.timedelta
"""Seconds, a ``timedelta``, or a duration as the CLI reads one
(``"0.5s"``, ``"10m"``, ``"2h"``)."""
Command = str | Sequence[str]
"""A shell line (run by ``/bin/sh -c`` on the rank), or words, quoted
into one (``["echo", "a b"]`` is ``echo 'a b'``)."""


def seconds(value: Duration) -> float:
    from broker.attrs import duration  # (here: every kvbroker command imports this module)

    if isinstance(value, dt.timedelta):
        value = value.total_seconds()
    return duration(value)  # (ValueError: negative, or not a duration)


def command_text(command: Command) -> str:
    return command if isinstance(command, str) else shlex.join(command)


class Cron:
    """The cron entries of the instance ``h`` is attached to (the module
    must be loaded on the rank asked: ``kvbroker module load cron``).  The
    instance owner's: a guest's requests are ``EPERM``."""

    def __init__(self, h: HandleCore) -> None:
        self.h = h

    # -- creating entries: each returns the new entry, started
    async def interval(self, command: Command, every: Duration, *,
                       after: Duration | None = None, count: int = 0,
                       **options: Any) -> Entry:
        """Run ``command`` every ``every`` (0: once), the first time after
        ``after`` (default: ``every``); ``count`` runs, then it stops (0:
        until stopped).  ``options``: those of :meth:`create`."""
        args: dict[str, Any] = {"interval": seconds(every)}
        if after is not None:
            args["after"] = seconds(after)
        return await self.create("interval", command, args, count=count, **options)

    async def event(self, command: Command, topic: str, *, nth: int = 0, after: int = 0,
                    min_interval: Duration = 0, count: int = 0, **options: Any) -> Entry:
        """Run ``command`` on each event whose topic is ``topic`` (exactly;
        the instance owner's events only): every ``nth`` one, the first on
        the ``after``-th, at most once every ``min_interval`` (one sooner
        is held until then)."""
        return await self.create("event", command, {
            "topic": topic, "nth": nth, "after": after,
            "min_interval": seconds(min_interval)}, count=count, **options)

    async def tab(self, command: Command, schedule: str, *, count: int = 0,
                  **options: Any) -> Entry:
        """Run ``command`` on a crontab(5) schedule (``"*/5 * * * *"``,
        ``"@hourly"``), in the rank's local time."""
        return await self.create("tab", command, {"schedule": schedule}, count=count,
                                 **options)

    async def at(self, command: Command, when: float | dt.datetime, **options: Any) -> Entry:
        """Run ``command`` once at ``when``: seconds since the epoch, or a
        ``datetime`` (naive: local time); a time past runs at once."""
        at = when.timestamp() if isinstance(when, dt.datetime) else float(when)
        return await self.create("at", command, {"at": at}, **options)

    async def create(self, kind: str, command: Command, args: dict[str, Any], *,
                     count: int = 0, rank: int | None = None, name: str | None = None,
                     timeout: Duration | None = None, stop_on_failure: int = 0,
                     task_history_count: int = 1,
                     cwd: str | os.PathLike[str] | None = None,
                     env: Mapping[str, str] | None = None,
                     preserve_env: bool = False) -> Entry:
        """``cron.create``: an entry of type ``kind`` whose trigger is
        ``args`` (the module's ``typedata``), on ``rank``'s cron.  Every
        type takes: ``name`` (default: the command's first word), ``count``
        (``repeat``), ``timeout`` (a task still running then is sent
        SIGTERM, SIGKILL 2 s later), ``stop_on_failure`` N (stop after N
        failed runs), ``task_history_count`` (the last N tasks the entry
        keeps, 1 to 16: the entry's ``tasks``), ``cwd`` (default: the rank's; a relative one is this
        process's), ``env`` the command's whole environment, or
        ``preserve_env`` this process's (default: the rank's)."""
        if env is not None and preserve_env:
            raise ValueError("give env or preserve_env, not both")
        payload: dict[str, Any] = {"type": kind, "command": command_text(command),
                                   "args": args}
        for key, value in (("rank", rank), ("name", name), ("repeat", count or None),
                           ("stop-on-failure", stop_on_failure or None),
                           ("task-history-count",
                            None if task_history_count == 1 else task_history_count)):
            if value is not None:
                payload[key] = value
        if timeout is not None:
            payload["timeout"] = seconds(timeout)
        if cwd is not None:
            payload["cwd"] = os.path.abspath(cwd)
        if preserve_env:
            env = os.environ
        if env is not None:
            payload["environ"] = dict(env)
        return await self._rpc("cron.create", payload, rank)

    # -- reading and changing them
    async def list(self, rank: int | None = None) -> builtins.list[Entry]:
        """The entries of ``rank``'s cron, oldest first."""
        entries: builtins.list[Entry] = (await self._rpc("cron.list", {}, rank))["entries"]
        return entries

    async def get(self, eid: int, rank: int | None = None) -> Entry:
        """One entry (``ENOENT`` if ``rank`` has none of that id)."""
        answer = await self._rpc("cron.list", {}, rank)
        for e in answer["entries"]:
            if e.get("id") == eid:
                return dict(e)
        raise RemoteError(errno.ENOENT, f"no cron entry {eid} on rank {answer.get('rank')} "
                          "(kvbroker cron list shows them)")

    async def delete(self, eid: int, *, kill: bool = False, rank: int | None = None) -> Entry:
        """Delete an entry: it as it was.  A task still running is left to
        end (till then the entry is listed ``deleted``), or with ``kill``
        terminated (SIGTERM, SIGKILL 2 s later)."""
        return await self._rpc("cron.delete", {"id": eid, "kill": kill}, rank)

    async def stop(self, eid: int, *, rank: int | None = None) -> Entry:
        """No more runs until :meth:`start` (``EINVAL``: stopped already)."""
        return await self._rpc("cron.stop", {"id": eid}, rank)

    async def start(self, eid: int, *, rank: int | None = None) -> Entry:
        """Run a stopped entry again, its repeat and failure counts from 0."""
        return await self._rpc("cron.start", {"id": eid}, rank)

    async def sync(self, topic: str | None = None, *, disable: bool = False,
                   epsilon: Duration | None = None, rank: int | None = None) -> dict[str, Any]:
        """Set the sync event (tasks due wait for the next event of
        ``topic``), or ``disable`` it, or (neither) ask: ``{sync_event,
        sync_epsilon}`` or ``{sync_disabled: True, sync_epsilon}``."""
        payload: dict[str, Any] = {}
        if topic is not None:
            payload["topic"] = topic
        if disable:
            payload["disable"] = True
        if epsilon is not None:
            payload["sync_epsilon"] = seconds(epsilon)
        return await self._rpc("cron.sync", payload, rank)

    async def _rpc(self, topic: str, payload: dict[str, Any], rank: int | None) -> Entry:
        try:
            answer: dict[str, Any] = await self.h.rpc(
                topic, payload, nodeid=NODEID_ANY if rank is None else rank)
            return answer
        except ErrnoError as exc:
            if exc.errnum == errno.ENOSYS:
                where = "the rank attached to" if rank is None else f"rank {rank}"
                raise RemoteError(errno.ENOSYS, f"the cron module is not loaded on {where} "
                                  "(kvbroker module load cron)") from None
            raise


class SyncCron:
    """Blocking twin of :class:`Cron`, on a :class:`broker.sync.SyncHandle`
    (each call bounded by the handle's timeout)."""

    def __init__(self, sh: SyncHandle) -> None:
        self.sync_handle = sh
        self.aio = Cron(sh.aio)

    def interval(self, command: Command, every: Duration, **kw: Any) -> Entry:
        return self.sync_handle.run(self.aio.interval(command, every, **kw))

    def event(self, command: Command, topic: str, **kw: Any) -> Entry:
        return self.sync_handle.run(self.aio.event(command, topic, **kw))

    def tab(self, command: Command, schedule: str, **kw: Any) -> Entry:
        return self.sync_handle.run(self.aio.tab(command, schedule, **kw))

    def at(self, command: Command, when: float | dt.datetime, **kw: Any) -> Entry:
        return self.sync_handle.run(self.aio.at(command, when, **kw))

    def create(self, kind: str, command: Command, args: dict[str, Any], **kw: Any) -> Entry:
        return self.sync_handle.run(self.aio.create(kind, command, args, **kw))

    def list(self, rank: int | None = None) -> builtins.list[Entry]:
        return self.sync_handle.run(self.aio.list(rank))

    def get(self, eid: int, rank: int | None = None) -> Entry:
        return self.sync_handle.run(self.aio.get(eid, rank))

    def delete(self, eid: int, *, kill: bool = False, rank: int | None = None) -> Entry:
        return self.sync_handle.run(self.aio.delete(eid, kill=kill, rank=rank))

    def stop(self, eid: int, *, rank: int | None = None) -> Entry:
        return self.sync_handle.run(self.aio.stop(eid, rank=rank))

    def start(self, eid: int, *, rank: int | None = None) -> Entry:
        return self.sync_handle.run(self.aio.start(eid, rank=rank))

    def sync(self, topic: str | None = None, **kw: Any) -> dict[str, Any]:
        return self.sync_handle.run(self.aio.sync(topic, **kw))
