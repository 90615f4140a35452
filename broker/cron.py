"""The ``cron`` module (Flux's): commands a rank runs on a trigger -- every
so often, at times of day, once at a given time, or when an event comes.

Why: a periodic sweep, a check, or a reaction to an event is a line given
to the instance (``kvbroker cron interval 10m -- ./sweep``), not a loop in
a script someone has to keep alive: the command runs as the instance
owner, on the rank's host, and stops with the rank.  Loaded on demand,
per rank (``kvbroker module load cron``, ``-S
broker.modules=content,kvs,kvs-watch,cron``): each rank's cron runs its
own entries on its own host.  Flux's cron lives on rank 0 and runs a
command on another rank through that rank's exec service (``-o
rank=R``); here ``kvbroker cron ... --rank R`` asks rank R's own cron,
so an entry and its command live on one rank and die with it.

An *entry* (``cron.create``) is a command line and a trigger:

* ``interval``: every ``interval`` seconds, the first run ``after``
  seconds from its start (default: ``interval``); an interval of 0 runs
  once, after ``after``, then the entry stops.
* ``event``: each event whose topic *is* ``topic`` (exact match, as
  Flux's; ``t.cron`` does not take ``t.cron.x``); ``nth``: every Nth
  one; ``after``: the first run on the Nth event (the N-1 before are
  counted, not run), as Flux's; ``min_interval``: a run comes at most
  that often -- an event sooner is held until the interval is up, the
  ones meanwhile are counted and not run.  Only the instance owner's
  events trigger (a guest's would run the owner's command on a guest's
  say-so; they are dropped and counted ``foreign``).
* ``tab``: a crontab(5) schedule, in the rank's local time
  (:mod:`broker.crontab`).
* ``at``: once, at ``at`` (seconds since the epoch; ``kvbroker cron at``
  reads an ISO 8601 time or ``+DURATION``); a time past runs at once.

Each entry has a ``repeat`` count (``--count``: run that many times, then
stop; 0 for ever), a ``timeout`` (a task running longer is sent SIGTERM,
then SIGKILL :data:`KILL_GRACE` seconds later, its state ``Timeout``),
``stop-on-failure`` N (stop after N failed runs since its start), a
working directory and an environment (default: the rank's), to which
``KVBROKER_URI`` and ``KVBROKER_RANK`` naming the rank are added.  The
command is a shell line, run by ``/bin/sh -c`` in a process group of its
own (as Flux's and a crontab's), its input ``/dev/null``.

One task per entry at a time: a trigger while the last task still runs
(or waits for the sync event) is skipped and counted (``stats.skipped``),
as Flux's.  The entry keeps its last task (state ``Deferred``,
``Running``, ``Exited``, ``Failed``, ``Timeout``, or ``Exec Failure``
when it could not be started at all): pid, times, status, and the last
:data:`OUTPUT_TAIL` bytes of its output (standard output and error as
written, one stream) with the count of bytes dropped before them.  The
output also goes to the rank's log (``kvbroker dmesg``), a line at a
time at level info (``cron-ID[NAME]: LINE``), up to :data:`LOG_BYTES`
per task: a command that writes a lot fills neither the rank's memory
nor its log ring.

*Sync* (Flux's): with a sync event set (``cron.sync`` attribute, or the
``cron.sync`` request), a task that is due is held (``Deferred``) until
the next such event -- ``heartbeat.pulse``, say, so that the ranks' tasks
run together -- unless the last one came less than ``sync_epsilon``
seconds ago (default 15 ms).

Events: the module subscribes once per distinct topic its entries (and
the sync event) need, and unsubscribes when the last entry needing it
goes; an event matching a subscription by prefix only, or whose entries
are stopped, is dropped and counted (``events.dropped``).

Requests (docs/protocol.md, "cron"), the instance owner's only (``EPERM``:
a task runs as the owner): ``cron.create``, ``cron.list``,
``cron.delete``, ``cron.stop``, ``cron.start``, ``cron.sync``;
``cron.stats-get`` as every module's.  An entry is gone when the module
is removed or the rank stops, and every task is killed: nothing outlives
the rank, and entries are not kept anywhere (a script that wants them
back creates them again).  But rank 0's cron makes an entry of each line
of the crontabs in ``cron.directory`` (:mod:`broker.cron_directory`)
each time it loads, as Flux's rc1 does at the start: those come back
after a ``module reload cron``, and setting the attribute at the start
(``kvbroker start -S cron.directory=DIR``) loads the module on rank 0
(:func:`broker.attrs.module_names`) before the initial program runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import signal
import subprocess
import time
from collections import Counter, deque
from typing import IO, Any, ClassVar

from broker import pipes
from broker.attrs import AttrSpec, duration, text
from broker.command import Command, cannot_run_status, exit_code
from broker.cron_directory import read_directory
from broker.crontab import LAST_AT, Schedule, parse_schedule
from broker.errors import ErrnoError
from broker.message import Message
from broker.module import Handler, Module, require
from broker.rexec import OutputTail, describe_status

TYPES = ("interval", "event", "tab", "at")
MAX_TASK_HISTORY = 16
"""The most tasks an entry keeps (``task-history-count``, Flux's option;
default 1, the last): each keeps up to :data:`OUTPUT_TAIL` bytes of
output, so 1,000 entries keep at most ~64 MiB of it."""

OUTPUT_TAIL = 4096
"""The bytes of a task's output an entry keeps (the last ones)."""
LOG_BYTES = 4096
"""The bytes of a task's output written to the rank's log, at most."""
MAX_LINE = 1024
"""A line longer than this is logged in pieces."""
KILL_GRACE = 2.0
"""Seconds between the SIGTERM of a timeout (or ``delete --kill``) and
the SIGKILL that follows if the task is still there."""
EOF_GRACE = 1.0
"""Seconds the output of a task that has exited is still read: a command
that left a process behind holding its output (``daemon &``) would
otherwise keep the task running for ever, and the entry with it."""
MIN_INTERVAL = 0.01
"""The shortest interval (but 0, run once): faster is a busy loop."""
MAX_ENTRIES = 1000
"""Entries a rank's cron holds at most (``ENOSPC`` past it)."""
MAX_COMMAND = 64 << 10
"""The longest command line, in bytes (``E2BIG``)."""
MAX_NAME = 128
READ_CHUNK = 1 << 16

SYNC = AttrSpec("cron.sync", "", text,
                "with the cron module: tasks due wait for the next event of this topic "
                "(empty: run at once)")
SYNC_EPSILON = AttrSpec("cron.sync_epsilon", "15ms", duration,
                        "with cron.sync: a task due this soon after the sync event runs at once")
DIRECTORY = AttrSpec("cron.directory", "", text,
                     "rank 0's cron makes an entry of each line of each crontab in this "
                     "directory as it loads; set at start, it loads cron on rank 0")


class Task:
    """One run of an entry's command (the entry keeps the last)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.state = "Deferred"
        self.created = time.time()
        self.started: float | None = None
        self.ended: float | None = None
        self.pid: int | None = None
        self.status: int | None = None
        """The exit status (``-N``: killed by signal N)."""
        self.code: int | None = None
        """The status as a shell has it (127 not found, 128+N signal N)."""
        self.timedout = False
        self.error: str | None = None
        self.cmd: Command | None = None
        self.pipe: IO[bytes] | None = None
        """The command's output pipe until its reader takes it (then the
        reader's, closed with its transport); whoever ends the task
        without a reader having taken it closes it (:meth:`release`)."""
        self.output = OutputTail(OUTPUT_TAIL)
        self.logged = 0
        self.unlogged = 0
        self.kill_timer: asyncio.TimerHandle | None = None

    @property
    def busy(self) -> bool:
        return self.state in ("Deferred", "Running")

    def release(self) -> None:
        """Close the output pipe if no reader took it (its reader, or the
        task that supervises it, was cancelled before it ran: the module
        stops)."""
        if self.pipe is not None:
            pipes.close_pipe(self.pipe)
            self.pipe = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "state": self.state,
                               "create-time": self.created}
        for key, value in (("pid", self.pid), ("start-time", self.started),
                           ("end-time", self.ended), ("status", self.status),
                           ("code", self.code), ("error", self.error)):
            if value is not None:
                out[key] = value
        if self.timedout:
            out["timedout"] = True
        out["output"] = self.output.data.decode(errors="replace")
        out["output-dropped"] = self.output.dropped
        return out


class Entry:
    """A command and its trigger, with what it did."""

    def __init__(self, eid: int, kind: str, command: str, name: str, rank: int) -> None:
        self.id = eid
        self.type = kind
        self.command = command
        self.name = name
        self.rank = rank
        self.typedata: dict[str, Any] = {}
        self.schedule: Schedule | None = None
        self.repeat = 0
        self.timeout: float | None = None
        self.stop_on_failure = 0
        self.cwd: str | None = None
        self.env: dict[str, str] | None = None
        self.stopped = True
        self.deleted = False
        now = time.time()
        self.stats: dict[str, Any] = {"ctime": now, "starttime": now, "lastrun": 0.0,
                                      "count": 0, "failcount": 0, "total": 0, "success": 0,
                                      "failure": 0, "deferred": 0, "skipped": 0}
        self.task: Task | None = None
        """The last task (running, or ended)."""
        self.ran_at: float | None = None
        """``time.monotonic()`` when the last task started (``stats``'s
        ``lastrun`` is the wall clock's, to show)."""
        self.history: deque[Task] = deque(maxlen=0)
        """The ones before it, newest first: ``task-history-count`` - 1 of them."""
        self.timer: asyncio.Task[None] | None = None
        self.pause: asyncio.TimerHandle | None = None
        """An event entry's run held for its ``min_interval``."""
        self.next_run: float | None = None
        self.source: str | None = None
        """``FILE:LINE`` of an entry made from ``cron.directory``."""

    @property
    def busy(self) -> bool:
        return self.task is not None and self.task.busy

    def label(self) -> str:
        return f"cron-{self.id}[{self.name}]"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "rank": self.rank, "name": self.name, "command": self.command,
            "type": self.type, "repeat": self.repeat, "stopped": self.stopped,
            "state": "deleted" if self.deleted else "stopped" if self.stopped else "active",
            "stop-on-failure": self.stop_on_failure, "preserve-env": self.env is not None,
            "typedata": dict(self.typedata), "stats": dict(self.stats),
            "task-history-count": (self.history.maxlen or 0) + 1,
            "tasks": [t.to_dict() for t in (self.task, *self.history) if t is not None]}
        if self.timeout is not None:
            out["timeout"] = self.timeout
        if self.cwd is not None:
            out["cwd"] = self.cwd
        if self.next_run is not None and not self.stopped:
            out["typedata"]["next"] = self.next_run
        if self.source is not None:
            out["source"] = self.source
        return out


def _number(p: dict[str, Any], key: str, default: float | None = None) -> float | None:
    """A number field (seconds), 0 or more: ``EPROTO`` not a number,
    ``EINVAL`` negative or not finite."""
    value = p.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ErrnoError(errno.EPROTO, f"{key} must be a number")
    if not (math.isfinite(value) and value >= 0):
        raise ErrnoError(errno.EINVAL, f"{key} must be a finite number of 0 or more: {value}")
    return float(value)


def _count(p: dict[str, Any], key: str) -> int:
    """A count field, 0 or more (0 when absent)."""
    value = p.get(key, 0)
    if type(value) is not int:
        raise ErrnoError(errno.EPROTO, f"{key} must be an integer")
    if value < 0:
        raise ErrnoError(errno.EINVAL, f"{key} must be 0 or more: {value}")
    return value


class CronModule(Module):
    """A rank's cron entries: triggers, tasks, and their record."""

    name: ClassVar[str] = "cron"
    attributes: ClassVar[tuple[AttrSpec, ...]] = (SYNC, SYNC_EPSILON, DIRECTORY)

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.entries: dict[int, Entry] = {}
        self.next_id = 1
        self.by_topic: dict[str, list[Entry]] = {}
        """Event entries by their topic."""
        self.subs: Counter[str] = Counter()
        """Topics subscribed to, and how many entries (or the sync) need each."""
        self.sync_topic: str | None = SYNC.value(ctx.attrs) or None
        self.sync_epsilon: float = SYNC_EPSILON.value(ctx.attrs)
        self.last_sync: float | None = None
        """``time.monotonic()`` of the last sync event (the wall clock: set
        back an hour, every task was deferred for that hour)."""
        self.deferred: list[Entry] = []
        self.counts: Counter[str] = Counter(dict.fromkeys(
            ("created", "deleted", "runs", "failures", "timeouts", "skipped", "deferred"), 0))

    async def start(self) -> None:
        if self.ctx.rank == 0:
            self._load_directory()
        if self.sync_topic:
            self._want(self.sync_topic)

    def _load_directory(self) -> None:
        """Rank 0: an entry of each line of the crontabs of
        ``cron.directory`` (:mod:`broker.cron_directory`), each time the
        module loads -- at the instance's start, and again at a ``module
        reload cron``, which would otherwise forget them.  A file that is
        not a crontab fails the load (the start, the reload), naming it:
        ``ErrnoError``, and no entry is made."""
        directory = DIRECTORY.value(self.ctx.attrs)
        if not directory:
            return
        lines = read_directory(directory)
        if len(self.entries) + len(lines) > MAX_ENTRIES:
            raise ErrnoError(errno.ENOSPC, f"cron.directory {directory}: {len(lines)} crontab "
                             f"lines, more than the {MAX_ENTRIES} entries a rank's cron holds")
        for found in lines:
            try:
                e = self._new_entry({"type": "tab", "command": found.line.command,
                                     "args": {"schedule": found.line.schedule}})
            except ErrnoError as exc:  # (a command over MAX_COMMAND)
                raise ErrnoError(exc.errnum, f"could not load crontab {found.path}: line "
                                 f"{found.line.number}: {exc.errstr}") from None
            e.source = found.source
        self.log.info("cron.directory %s: %d entries from its crontabs", directory, len(lines))

    async def stop(self) -> None:
        """Every task killed, every entry forgotten: nothing outlives the rank."""
        for e in self.entries.values():
            self._disarm(e)
            if e.task is not None and e.task.cmd is not None and e.task.state == "Running":
                e.task.cmd.kill()
                e.task.release()
        self.entries.clear()
        self.deferred.clear()

    def handlers(self) -> dict[str, Handler]:
        return {"cron.create": self.create, "cron.list": self.list_,
                "cron.delete": self.delete, "cron.stop": self.stop_entry,
                "cron.start": self.start_entry, "cron.sync": self.sync}

    def stats(self) -> dict[str, Any]:
        return {"rank": self.ctx.rank, "entries": len(self.entries),
                "active": sum(not e.stopped for e in self.entries.values()),
                "running": sum(e.task is not None and e.task.state == "Running"
                               for e in self.entries.values()),
                "deferred": len(self.deferred), "sync": self.sync_topic or "",
                "topics": len(self.subs), **dict(self.counts), "events": self.event_stats()}

    # -- subscriptions: one per distinct topic needed
    def _want(self, topic: str) -> None:
        if not self.subs[topic]:
            self.h.subscribe(topic)
        self.subs[topic] += 1

    def _unwant(self, topic: str) -> None:
        self.subs[topic] -= 1
        if self.subs[topic] <= 0:
            del self.subs[topic]
            self.h.unsubscribe(topic)

    def on_event(self, msg: Message) -> None:
        if msg.userid != self.ctx.owner_uid:
            self.events.drop("foreign")
            return
        topic = msg.topic
        entries = [e for e in self.by_topic.get(topic, ()) if not e.stopped]
        is_sync = topic == self.sync_topic
        if not entries and not is_sync:
            self.events.drop("unmatched" if topic not in self.by_topic else "stopped")
            return
        self.events.handled += 1
        if is_sync:
            self._synced()
        for e in entries:
            self._on_entry_event(e)

    # -- requests
    @staticmethod
    def _owner(msg: Message) -> None:
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "cron runs commands as the instance owner: it is "
                             "the instance owner's")

    def _find(self, msg: Message) -> Entry:
        eid = require(msg.payload, id=int)["id"]
        e = self.entries.get(eid)
        if e is None:
            raise ErrnoError(errno.ENOENT, f"no cron entry {eid} on rank {self.ctx.rank} "
                             "(kvbroker cron list shows them)")
        return e

    def create(self, msg: Message) -> None:
        """``cron.create {type, command, args, name?, ...}``: the new entry, started."""
        self._owner(msg)
        p = require(msg.payload, type=str, command=str, args=dict)
        self.h.respond(msg, self._new_entry(p).to_dict())

    def _new_entry(self, p: dict[str, Any]) -> Entry:
        """The entry ``p`` (``cron.create``'s payload) asks for, started;
        ``ErrnoError`` for a bad field."""
        if len(self.entries) >= MAX_ENTRIES:
            raise ErrnoError(errno.ENOSPC, f"rank {self.ctx.rank} holds {MAX_ENTRIES} cron "
                             "entries already: delete some first")
        kind, command = p["type"], p["command"]
        if kind not in TYPES:
            raise ErrnoError(errno.EINVAL, f"unknown cron entry type {kind!r} (one of "
                             f"{', '.join(TYPES)})")
        if not command.strip():
            raise ErrnoError(errno.EINVAL, "the command is empty")
        if "\0" in command:  # (no command line holds one: its task stayed "Deferred")
            raise ErrnoError(errno.EINVAL, "the command holds a NUL byte")
        if len(command.encode(errors="replace")) > MAX_COMMAND:
            raise ErrnoError(errno.E2BIG, f"the command is longer than {MAX_COMMAND} bytes")
        name = p.get("name") or command.split()[0]
        if not isinstance(name, str):
            raise ErrnoError(errno.EPROTO, "name must be a string")
        e = Entry(self.next_id, kind, command, name[:MAX_NAME], self.ctx.rank)
        self._options(e, p)
        self._typedata(e, p["args"])
        self.next_id += 1
        self.entries[e.id] = e
        if kind == "event":
            self.by_topic.setdefault(e.typedata["topic"], []).append(e)
            self._want(e.typedata["topic"])
        self.counts["created"] += 1
        self._start(e)
        return e

    def _options(self, e: Entry, p: dict[str, Any]) -> None:
        """The options every type takes: ``rank``, ``repeat``, ``timeout``,
        ``stop-on-failure``, ``cwd``, ``environ``."""
        rank = p.get("rank", self.ctx.rank)
        if type(rank) is not int:
            raise ErrnoError(errno.EPROTO, "rank must be an integer")
        if rank != self.ctx.rank:
            raise ErrnoError(errno.EINVAL, f"rank {rank}: this is rank {self.ctx.rank}, whose "
                             f"cron runs its own entries (send the request to rank {rank})")
        e.repeat = _count(p, "repeat")
        e.stop_on_failure = _count(p, "stop-on-failure")
        kept = p.get("task-history-count", 1)
        if type(kept) is not int:
            raise ErrnoError(errno.EPROTO, "task-history-count must be an integer")
        if not 1 <= kept <= MAX_TASK_HISTORY:
            raise ErrnoError(errno.EINVAL, f"task-history-count {kept}: an entry keeps 1 to "
                             f"{MAX_TASK_HISTORY} tasks")
        e.history = deque(maxlen=kept - 1)
        e.timeout = _number(p, "timeout")
        if e.timeout == 0:  # (every run was killed at once)
            raise ErrnoError(errno.EINVAL, "timeout must be more than 0 (none: no limit)")
        cwd, env = p.get("cwd"), p.get("environ")
        if cwd is not None:
            if not isinstance(cwd, str):
                raise ErrnoError(errno.EPROTO, "cwd must be a string")
            if not os.path.isdir(cwd):
                raise ErrnoError(errno.ENOENT, f"working directory {cwd}: no such directory "
                                 f"on rank {self.ctx.rank}'s host")
            e.cwd = cwd
        if env is not None:
            if not (isinstance(env, dict) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
                raise ErrnoError(errno.EPROTO, "environ must be a map of strings")
            e.env = env

    def _typedata(self, e: Entry, args: dict[str, Any]) -> None:
        """The trigger of ``e``'s type, from ``args``, checked."""
        if e.type == "interval":
            interval = _number(args, "interval")
            if interval is None:
                raise ErrnoError(errno.EPROTO, "an interval entry needs args.interval")
            if 0 < interval < MIN_INTERVAL:
                raise ErrnoError(errno.EINVAL, f"interval {interval:g}s is under "
                                 f"{MIN_INTERVAL:g}s (a busy loop); 0 runs once")
            e.typedata = {"interval": interval, "after": _number(args, "after", interval)}
        elif e.type == "event":
            topic = args.get("topic")
            if not isinstance(topic, str):
                raise ErrnoError(errno.EPROTO, "an event entry needs args.topic, a string")
            if not topic:
                raise ErrnoError(errno.EINVAL, "the topic is empty (it would match every "
                                 "event)")
            e.typedata = {"topic": topic, "nth": _count(args, "nth"),
                          "after": _count(args, "after"), "counter": 0,
                          "min_interval": _number(args, "min_interval", 0.0)}
        elif e.type == "tab":
            sched = args.get("schedule")
            if not isinstance(sched, str):
                raise ErrnoError(errno.EPROTO, "a tab entry needs args.schedule, a string")
            try:
                e.schedule = parse_schedule(sched)
            except ValueError as exc:
                raise ErrnoError(errno.EINVAL, str(exc)) from None
            e.typedata = {"schedule": e.schedule.text}
        else:
            at = _number(args, "at")
            if at is None:
                raise ErrnoError(errno.EPROTO, "an at entry needs args.at (seconds since the "
                                 "epoch)")
            if at > LAST_AT:  # (every cron list failed on it: "timestamp out of range")
                raise ErrnoError(errno.EINVAL, f"at {at:g} is past the end of 9999")
            e.typedata = {"at": at}
            e.repeat = 1

    def list_(self, msg: Message) -> None:
        """``cron.list {}``: ``{rank, entries: [...]}``, oldest first."""
        self._owner(msg)
        if msg.payload is not None:
            require(msg.payload)
        self.h.respond(msg, {"rank": self.ctx.rank,
                             "entries": [e.to_dict() for e in self.entries.values()]})

    def delete(self, msg: Message) -> None:
        """``cron.delete {id, kill?}``: the entry as it was.  A task still
        running is left to end (then the entry goes; till then it is
        listed ``deleted``, and may be deleted again, with ``kill`` to end
        it), or with ``kill`` sent SIGTERM (SIGKILL after :data:`KILL_GRACE`)."""
        self._owner(msg)
        e = self._find(msg)
        kill = msg.payload.get("kill", False)
        if not isinstance(kill, bool):
            raise ErrnoError(errno.EPROTO, "kill must be a boolean")
        out = e.to_dict()
        if not e.deleted:  # (deleted, its task still running: once more, -k kills it)
            self.counts["deleted"] += 1  # (counted once: it counted every call)
        self._stop(e)
        e.deleted = True
        if e in self.deferred:  # (its task never started: it goes with the entry)
            self.deferred.remove(e)
        if e.task is not None and e.task.state == "Running":
            if kill:
                self._terminate(e.task)
        else:
            self._forget(e)
        self.h.respond(msg, out)

    def stop_entry(self, msg: Message) -> None:
        """``cron.stop {id}``: no more runs until started (``EINVAL`` stopped
        already); a task held for the sync event is ``Canceled``, not run."""
        self._owner(msg)
        e = self._find(msg)
        if e.stopped:
            raise ErrnoError(errno.EINVAL, f"cron-{e.id} is stopped already")
        self._stop(e)
        if e in self.deferred:  # (held for the sync event: it ran at the event)
            self.deferred.remove(e)
            assert e.task is not None
            e.task.state, e.task.ended = "Canceled", time.time()
            e.stats["count"] -= 1
            e.stats["total"] -= 1
            self.log.info("%s: stopped: its task held for %s will not run", e.label(),
                          self.sync_topic)
        self.h.respond(msg, e.to_dict())

    def start_entry(self, msg: Message) -> None:
        """``cron.start {id}``: runs again, its repeat and failure counts
        from 0 (``EINVAL`` not stopped, or deleted)."""
        self._owner(msg)
        e = self._find(msg)
        if not e.stopped or e.deleted:
            raise ErrnoError(errno.EINVAL, f"cron-{e.id} is "
                             + ("deleted (its task is still running)" if e.deleted
                                else "not stopped"))
        self._start(e)
        self.h.respond(msg, e.to_dict())

    def sync(self, msg: Message) -> None:
        """``cron.sync {topic?, disable?, sync_epsilon?}``: set or clear the
        sync event; ``{}`` asks.  Answers ``{sync_event, sync_epsilon}`` or
        ``{sync_disabled: true, sync_epsilon}``."""
        self._owner(msg)
        p = require(msg.payload)
        topic, disable = p.get("topic"), p.get("disable", False)
        if topic is not None and not isinstance(topic, str) or not isinstance(disable, bool):
            raise ErrnoError(errno.EPROTO, "topic must be a string, disable a boolean")
        if topic == "" or (topic is not None and disable):
            raise ErrnoError(errno.EINVAL, "give a topic, or disable, not both (nor an "
                             "empty topic)")
        epsilon = _number(p, "sync_epsilon")
        if epsilon is not None:
            self.sync_epsilon = epsilon
            self.ctx.attrs[SYNC_EPSILON.name] = f"{epsilon:g}s"
        if topic is not None or disable:
            self._set_sync(topic)
        out: dict[str, Any] = {"sync_epsilon": self.sync_epsilon}
        if self.sync_topic:
            out["sync_event"] = self.sync_topic
        else:
            out["sync_disabled"] = True
        self.h.respond(msg, out)

    def _set_sync(self, topic: str | None) -> None:
        """A new sync event (None: none; the tasks waiting run now)."""
        if self.sync_topic:
            self._unwant(self.sync_topic)
        self.sync_topic = topic
        self.ctx.attrs[SYNC.name] = topic or ""
        if topic:
            self._want(topic)
            self.log.info("cron tasks wait for event %s to run", topic)
        else:
            self._synced(stamp=False)

    # -- entries' life
    def _start(self, e: Entry) -> None:
        e.stopped = False
        e.stats.update(starttime=time.time(), count=0, failcount=0)
        if e.type == "event":
            e.typedata["counter"] = 0
        elif e.type == "interval":  # (next: here too, for the answer that started it)
            e.next_run = time.time() + e.typedata["after"]
            e.timer = self.spawn(self._interval(e))
        elif e.type == "tab":
            when = self._next_tab(e)
            if when is not None:
                e.timer = self.spawn(self._tab(e, when))
        else:
            e.next_run = e.typedata["at"]
            e.timer = self.spawn(self._at(e))

    def _stop(self, e: Entry) -> None:
        if not e.stopped:
            e.stopped = True
            self._disarm(e)

    def _disarm(self, e: Entry) -> None:
        """Its timers cancelled (the one running this, left to end)."""
        if e.timer is not None and e.timer is not asyncio.current_task():
            e.timer.cancel()
        e.timer = None
        e.next_run = None
        if e.pause is not None:
            e.pause.cancel()
            e.pause = None

    def _forget(self, e: Entry) -> None:
        self.entries.pop(e.id, None)
        if e.type == "event":
            topic = e.typedata["topic"]
            mine = self.by_topic.get(topic, [])
            if e in mine:
                mine.remove(e)
                if not mine:
                    del self.by_topic[topic]
                self._unwant(topic)

    # -- triggers
    async def _interval(self, e: Entry) -> None:
        """Every ``interval`` from ``after``, on the loop's clock (no drift;
        ticks missed while the loop was busy are skipped and counted)."""
        loop = asyncio.get_running_loop()
        interval, due = e.typedata["interval"], loop.time() + e.typedata["after"]
        while True:
            e.next_run = time.time() + max(0.0, due - loop.time())
            await asyncio.sleep(max(0.0, due - loop.time()))
            self._trigger(e)
            if e.stopped:
                return
            if interval == 0:
                self._stop(e)
                return
            due += interval
            behind = loop.time() - due
            if behind > 0:
                missed = math.ceil(behind / interval)
                due += missed * interval
                e.stats["skipped"] += missed
                self.counts["skipped"] += missed

    def _next_tab(self, e: Entry) -> float | None:
        """When tab entry ``e`` runs next, from now (its ``next``); None,
        and the entry stopped, if its schedule does not come again."""
        assert e.schedule is not None
        when = e.schedule.next_time(time.time())
        if when is None:
            self.log.warning("%s: schedule %s does not come again: stopped", e.label(),
                             e.schedule.text)
            self._stop(e)
        e.next_run = when
        return when

    async def _tab(self, e: Entry, when: float) -> None:
        """Run ``e`` at ``when``, then at each next time of its schedule."""
        while True:
            await _sleep_until(when)
            self._trigger(e)
            if e.stopped:
                return
            found = self._next_tab(e)
            if found is None:
                return
            when = found

    async def _at(self, e: Entry) -> None:
        await _sleep_until(e.typedata["at"])
        self._trigger(e)

    def _on_entry_event(self, e: Entry) -> None:
        """An event of ``e``'s topic: counted; run if it is the one
        (``after``, ``nth``) and the ``min_interval`` is up, else held."""
        td = e.typedata
        td["counter"] += 1
        if e.pause is not None:
            return
        if td["counter"] < td["after"]:
            return
        if td["nth"] and (td["counter"] - td["after"]) % td["nth"]:
            return
        # (by the monotonic clock: by the wall clock set back an hour, the
        # events of that hour were counted and none run)
        remaining = (0.0 if e.ran_at is None
                     else td["min_interval"] - (time.monotonic() - e.ran_at))
        if td["min_interval"] > 0 and remaining > 1e-5:
            self.log.debug("%s: delaying %.3fs for its min-interval", e.label(), remaining)
            e.pause = asyncio.get_running_loop().call_later(remaining, self._unpause, e)
            return
        self._trigger(e)

    def _unpause(self, e: Entry) -> None:
        e.pause = None
        self._trigger(e)

    def _trigger(self, e: Entry) -> None:
        """The entry is due: a task, now or at the sync event -- unless
        the last one is still there (skipped, counted)."""
        if e.stopped:
            return
        if e.busy:
            e.stats["skipped"] += 1
            self.counts["skipped"] += 1
            assert e.task is not None
            self.log.info("%s: skipped: its last task is still %s", e.label(),
                          e.task.state.lower())
            return
        e.stats["count"] += 1
        e.stats["total"] += 1
        if e.repeat and e.stats["count"] >= e.repeat:
            self._stop(e)
        if e.task is not None and e.history.maxlen:
            e.history.appendleft(e.task)
        e.task = Task(self.ctx.rank)
        if self.sync_topic and (self.last_sync is None
                                or time.monotonic() - self.last_sync >= self.sync_epsilon):
            e.stats["deferred"] += 1
            self.counts["deferred"] += 1
            self.deferred.append(e)
            self.log.debug("%s: deferred to the next %s event", e.label(), self.sync_topic)
            return
        self._run(e)

    def _synced(self, stamp: bool = True) -> None:
        """The sync event came (or sync was disabled): the tasks held run."""
        if stamp:
            self.last_sync = time.monotonic()
        held, self.deferred = self.deferred, []
        for e in held:
            self._run(e)

    # -- tasks
    def _run(self, e: Entry) -> None:
        task = e.task
        assert task is not None
        env = dict(os.environ if e.env is None else e.env)
        env["KVBROKER_URI"] = str(self.ctx.attrs.get("local-uri", ""))
        env["KVBROKER_RANK"] = str(self.ctx.rank)
        task.started = e.stats["lastrun"] = time.time()
        e.ran_at = time.monotonic()
        self.counts["runs"] += 1
        try:
            task.cmd = Command.spawn(["/bin/sh", "-c", e.command], env, cwd=e.cwd,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, own_group=True)
        except OSError as exc:
            task.state, task.ended = "Exec Failure", time.time()
            task.code = cannot_run_status(exc)
            task.error = f"{exc.strerror or exc}" + (f": {e.cwd}" if e.cwd else "")
            self.log.error("%s: cannot run %s: %s", e.label(), e.command, task.error)
            self._failed(e)
            self._task_over(e)
            return
        task.state, task.pid, task.pipe = "Running", task.cmd.pid, task.cmd.proc.stdout
        self.spawn(self._supervise(e, task))

    async def _supervise(self, e: Entry, task: Task) -> None:
        """Its output read (kept, logged), its end recorded; killed if it
        outlives its ``timeout``, the entry's deletion with ``kill``, or
        the module."""
        assert task.cmd is not None
        loop = asyncio.get_running_loop()
        timer = (loop.call_later(e.timeout, self._time_out, e, task)
                 if e.timeout is not None else None)
        reader = self.spawn(self._read(e, task))
        try:
            status = await task.cmd.wait()
            if timer is not None:  # (it ended in time: a timeout while its output
                timer.cancel()     # drains called a success "Timeout", "terminated")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(reader), EOF_GRACE)
        finally:
            if timer is not None:
                timer.cancel()
            # A timeout's SIGKILL still goes, to what is left of the group (a
            # child that ignored the SIGTERM): the shell's end dropped it
            if task.kill_timer is not None and not task.timedout:
                task.kill_timer.cancel()
            reader.cancel()
            task.release()  # (a reader cancelled before it ran took nothing)
            if task.cmd.returncode is None:
                task.cmd.kill()
        self._ended(e, task, status)

    async def _read(self, e: Entry, task: Task) -> None:
        """Read the task's output.  Its pipe is this reader's from here:
        closed if the hand-over to the loop fails or is cancelled
        (:mod:`broker.pipes`), else with the transport."""
        pipe, task.pipe = task.pipe, None
        if pipe is None:
            return
        reader = asyncio.StreamReader(limit=READ_CHUNK)
        transport, _ = await pipes.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        held = b""
        try:
            while chunk := await reader.read(READ_CHUNK):
                task.output.add(chunk)
                *lines, held = (held + chunk).split(b"\n")
                for line in lines:
                    self._log_line(e, task, line)
                while len(held) > MAX_LINE:
                    self._log_line(e, task, held[:MAX_LINE])
                    held = held[MAX_LINE:]
            if held:
                self._log_line(e, task, held)
        finally:
            transport.close()

    def _log_line(self, e: Entry, task: Task, line: bytes) -> None:
        if task.logged + len(line) > LOG_BYTES:
            task.unlogged += len(line) + 1
            return
        task.logged += len(line) + 1
        self.log.info("%s: %s", e.label(), line.decode(errors="replace"))

    def _time_out(self, e: Entry, task: Task) -> None:
        if task.state != "Running" or task.cmd is None or task.cmd.returncode is not None:
            return
        task.timedout = True
        self.counts["timeouts"] += 1
        self.log.warning("%s: still running after its timeout of %gs: terminated",
                         e.label(), e.timeout)
        self._terminate(task)

    def _terminate(self, task: Task) -> None:
        """SIGTERM to the task's process group, SIGKILL a grace later."""
        if task.cmd is None or task.cmd.returncode is not None:
            return
        task.cmd.signal(signal.SIGTERM)
        if task.kill_timer is None:
            task.kill_timer = asyncio.get_running_loop().call_later(KILL_GRACE, task.cmd.kill)

    def _ended(self, e: Entry, task: Task, status: int) -> None:
        task.ended, task.status, task.code = time.time(), status, exit_code(status)
        if task.unlogged:
            self.log.info("%s: %d more bytes of output not logged (kvbroker cron dump %d "
                          "shows the last %d)", e.label(), task.unlogged, e.id, OUTPUT_TAIL)
        if task.timedout:
            task.state = "Timeout"
        elif status != 0:
            task.state = "Failed"
        else:
            task.state = "Exited"
        if task.state == "Exited":
            e.stats["success"] += 1
        else:
            self.log.warning("%s: \"%s\": %s: %s", e.label(), e.command, task.state,
                             describe_status(status))
            self._failed(e)
        self._task_over(e)

    def _failed(self, e: Entry) -> None:
        e.stats["failure"] += 1
        e.stats["failcount"] += 1
        self.counts["failures"] += 1
        if e.stop_on_failure and e.stats["failcount"] >= e.stop_on_failure and not e.stopped:
            self.log.error("%s: failed %d times: stopped (stop-on-failure)", e.label(),
                           e.stats["failcount"])
            self._stop(e)

    def _task_over(self, e: Entry) -> None:
        if e.deleted:
            self._forget(e)


async def _sleep_until(when: float) -> None:
    """Until the wall clock says ``when``, looked at again each minute at
    least (a clock set, a host suspended: the loop's clock does not follow)."""
    while (left := when - time.time()) > 0:
        await asyncio.sleep(min(left, 60.0))
