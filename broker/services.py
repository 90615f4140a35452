"""The broker's built-in services: ``broker``, ``attr``, ``event``, ``module``,
``log``, ``overlay``, ``config``, and ``rexec`` (:mod:`broker.rexec`)."""

from __future__ import annotations

import errno
import logging
import math
import re
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar

from broker import attrs as battrs
from broker import config as bconfig
from broker.errors import ErrnoError, ProtocolError
from broker.logring import Entry, LogRing, clip
from broker.message import Message, MsgFlags
from broker.module import Handler, Module, require, zero_counts
from broker.reloadhold import RELOAD_HOLD_TIMEOUT
from broker.rexec import RexecService
from broker.trace import OverlayTrace

if TYPE_CHECKING:
    from broker.broker import Broker

_CLIENT_LOG = logging.getLogger("kvbroker.logger")
"""The logger ``log.append`` writes through (each record named as the client says)."""
_LOGGER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

RESTRICTED_EVENT_PREFIXES = ("kvs.", "broker.", "overlay.", "content.", "heartbeat.")
"""Topics only the instance owner may publish (guests could forge KVS events)."""
OVERLAY_HEALTH = ("lost", "offline", "torpid", "unjoined", "rejoined", "hosts")
"""The parts of a rank's ``overlay`` stats a guest's ``broker.stats-get`` gets:
the state of its children (:mod:`broker.status` reads them)."""
MAX_EVENT_TOPIC = 1024
"""Longest event topic (or subscription prefix), in characters.  Every rank
handles every event, and remembers the subscribers of the last topics it
matched: without a bound, a client's 1,000 events with topics of 1 MiB
pinned a GiB on every rank."""

EVENT_HEADER_ROOM = 256
"""An event's header beside its topic, at most: room a publisher's cheap
bound leaves (kvs/commits.py), before the router checks the encoded event
against ``tbon.max-message``."""


def _event_topic(topic: str, prefix: bool = False) -> str:
    if not topic and not prefix:
        raise ErrnoError(errno.EPROTO, "event.pub needs a topic")
    if len(topic) > MAX_EVENT_TOPIC:
        raise ErrnoError(errno.EPROTO, f"event topics are at most {MAX_EVENT_TOPIC} characters")
    return topic


def _settings(args: Any) -> dict[str, str]:
    """``module.load``'s ``args``: a list of ``ATTR=VALUE`` strings, as a map."""
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ErrnoError(errno.EPROTO, "args must be a list of ATTR=VALUE strings")
    out: dict[str, str] = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq or not key:
            raise ErrnoError(errno.EINVAL, f"a module argument is ATTR=VALUE: {arg!r}")
        if key in out:
            raise ErrnoError(errno.EINVAL, f"module argument {key} is given twice")
        out[key] = value
    return out


class BrokerServices(Module):
    name: ClassVar[str] = "broker"
    ends_its_requests: ClassVar[bool] = True  # (never removed: a rank's own)
    metrics_skip: ClassVar[tuple[str, ...]] = ("rank", "guests", "subscriptions", "overlay.hosts",
                                               "overlay.offline", "overlay.rejoined",
                                               "overlay.torpid", "held-for-reload")
    services: ClassVar[tuple[str, ...]] = ("broker", "attr", "event", "module", "log",
                                           "overlay", "config", "rexec")

    def __init__(self, ctx: Any, broker: Broker) -> None:
        super().__init__(ctx)
        self.broker = broker
        self.router = broker.router
        self.max_guest_subscriptions: int = battrs.MAX_GUEST_SUBSCRIPTIONS.value(broker.attrs)
        self._follows: dict[tuple[tuple[str, ...], int], Message] = {}
        """The ``log.dmesg`` follow requests being served, by (route, matchtag)."""
        self.trace = OverlayTrace(lambda req, out: self.h.respond(req, out),
                                  self._tracing)
        """The ``overlay.trace`` requests being served."""
        self.rexec = RexecService(self)
        """The commands this rank runs for clients elsewhere (``kvbroker exec``)."""

    def handlers(self) -> dict[str, Handler]:
        return {
            "broker.ping": self.ping,
            "broker.stats-get": self.broker_stats,
            "broker.shutdown": self.shutdown,
            "broker.conf-builtin": self.conf_builtin,
            "attr.get": self.attr_get,
            "attr.list": self.attr_list,
            "attr.set": self.attr_set,
            "event.pub": self.event_pub,
            "event.subscribe": self.event_subscribe,
            "event.unsubscribe": self.event_unsubscribe,
            "config.get": self.config_get,
            "config.reload": self.config_reload,
            "config.load": self.config_load,
            "config.stats-get": self.broker_stats,
            "module.list": self.module_list,
            "module.load": self.module_load,
            "module.remove": self.module_remove,
            "module.reload": self.module_reload,
            "module.stats-get": self.broker_stats,
            "attr.stats-get": self.broker_stats,
            "event.stats-get": self.broker_stats,
            "log.dmesg": self.log_dmesg,
            "log.clear": self.log_clear,
            "log.append": self.log_append,
            "log.cancel": self.log_cancel,
            "log.disconnect": self.log_disconnect,
            "log.stats-get": self.broker_stats,
            "overlay.disconnect-subtree": self.overlay_disconnect,
            "overlay.trace": self.overlay_trace,
            "overlay.trace-cancel": self.overlay_trace_cancel,
            "overlay.disconnect": self.overlay_client_gone,
            "overlay.stats-get": self.broker_stats,
            **self.rexec.handlers(),
        }

    async def stop(self) -> None:
        """The rank stops: nothing ``rexec`` started outlives it."""
        await self.rexec.stop()

    def clear_stats(self) -> None:
        """``broker.stats-clear``: the rank's ``messages`` and ``connector``
        counters (what is now -- clients, subscriptions, the overlay's
        children -- stays)."""
        super().clear_stats()
        zero_counts(self.router.counts)
        if self.broker.connector is not None:
            zero_counts(self.broker.connector.counts)

    # -- broker
    def ping(self, msg: Message) -> None:
        payload = msg.payload
        out = dict(payload) if isinstance(payload, dict) else {}
        out["route"] = [*msg.route, f"r{self.ctx.rank}"]
        out["rank"] = self.ctx.rank
        out["userid"] = msg.userid
        out["rolemask"] = msg.rolemask
        self.h.respond(msg, out)

    def stats(self) -> dict[str, Any]:
        """The rank's figures (:meth:`Broker.stats`), as statsd reads them."""
        return self.broker.stats()

    def broker_stats(self, msg: Message) -> None:
        """``broker.stats-get`` (and ``attr.``, ``event.``, ``module.``,
        ``log.``, ``overlay.stats-get``), open to guests, but a guest sees
        only ``rank``, its children's health (:data:`OVERLAY_HEALTH`) and
        its own connections and bytes (``guests``): the
        rank's message and event counts, clients, subscriptions, log and
        overlay figures move with what other users do, which a guest could
        follow around an act of its own."""
        out = self.broker.stats()
        if msg.is_owner:
            self.h.respond(msg, out)
            return
        guests = out.get("guests") or {}
        mine = str(msg.userid)
        overlay = out.get("overlay") or {}
        # The children's health (what overlay status and uptime read) is
        # about ranks, not users: open, as Flux's overlay.health is.  A
        # guest's uptime counted a rank shut down on purpose as lost.
        health = {k: overlay[k] for k in OVERLAY_HEALTH if k in overlay}
        self.h.respond(msg, {"rank": out["rank"], "overlay": health,
                             "guests": {mine: guests[mine]} if mine in guests else {}})

    def shutdown(self, msg: Message) -> None:
        """Stop this rank and its subtree (rank 0: the instance), as ``flux
        shutdown``: the instance owner only.  Answered first, so the caller
        learns it was accepted before its connection closes."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "only the instance owner may shut the instance down")
        self.h.respond(msg, {"rank": self.ctx.rank})
        self.broker.shutdown_requested = True
        self.broker.request_stop("kvbroker shutdown (broker.shutdown)")

    # -- attr
    def attr_get(self, msg: Message) -> None:
        name = require(msg.payload, name=str)["name"]
        attrs = self.broker.attrs
        if name not in attrs:
            raise ErrnoError(errno.ENOENT, battrs.unknown_message(name, attrs))
        self.h.respond(msg, {"value": attrs[name]})

    def attr_set(self, msg: Message) -> None:
        """Change one of :data:`broker.attrs.RUNTIME_ATTRS` on this rank (the
        instance owner only, as Flux's ``attr.set``): ``{name, value}``,
        ``value`` as text, as ``-S`` gives it.  An unknown name is ENOENT,
        one fixed at start or a bad value EINVAL, with the reason."""
        if not msg.is_owner:  # (before the payload: a guest learns nothing of it)
            raise ErrnoError(errno.EPERM, "only the instance owner may set attributes")
        p = require(msg.payload, name=str, value=str)
        self.broker.set_attr(p["name"], p["value"])
        self.h.respond(msg, {})

    # -- overlay
    def overlay_disconnect(self, msg: Message) -> None:  # (not .disconnect: the router's)
        """``{rank}`` -> ``{}``: cut this rank's child ``rank`` off, and its
        subtree with it (:meth:`broker.overlay.Overlay.disconnect_child`).
        The instance owner only; ``EHOSTUNREACH`` if it was lost already
        (``rank N is already lost``, as Flux's), ``ENXIO`` if it is not a
        connected child of this rank (ENOENT's "No such file or directory"
        read like a missing file)."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "only the instance owner may disconnect ranks")
        child = require(msg.payload, rank=int)["rank"]
        overlay = self.broker.overlay
        if overlay is not None and overlay.was_lost(child):
            raise ErrnoError(errno.EHOSTUNREACH, f"rank {child} is already lost")
        if overlay is None or not overlay.disconnect_child(
                child, f"kvbroker overlay disconnect, by uid {msg.userid}"):
            raise ErrnoError(errno.ENXIO, f"rank {child} is not a connected child of "
                                          f"rank {self.ctx.rank}")
        self.h.respond(msg, {})

    def overlay_trace(self, msg: Message) -> None:
        """``{typemask?, topic_glob?, nodeid?, full?}``, streaming, as Flux's:
        one answer per message this rank's overlay sends or receives that
        matches (:mod:`broker.trace`), until the client goes or cancels.
        The instance owner only."""
        self.trace.add(msg)

    def _tracing(self, count: int) -> None:
        overlay = self.broker.overlay
        if overlay is not None:
            overlay.tracer = self.trace.note if count else None

    def overlay_trace_cancel(self, msg: Message) -> None:
        """``{matchtag}``: end, with ``ENODATA``, that trace of the same route -> ``{}``."""
        tag = require(msg.payload, matchtag=int)["matchtag"]
        request = self.trace.end((tuple(msg.route), tag))
        if request is not None:
            self.h.respond_error(request, errno.ENODATA)
        self.h.respond(msg, {})

    def overlay_client_gone(self, msg: Message) -> None:
        """A client went: its traces end."""
        self.trace.end_route(tuple(msg.route))

    # -- log
    def _ring(self, msg: Message) -> LogRing:
        if not msg.is_owner:  # (a log may say what other users did)
            raise ErrnoError(errno.EPERM, "only the instance owner may read or clear the log")
        rank_log = self.broker.rank_log
        if rank_log is None:
            raise ErrnoError(errno.ENOSYS, "this rank's logging is its host program's")
        return rank_log.ring

    def log_dmesg(self, msg: Message) -> None:
        """``{follow?, since?}``, streaming: the records this rank keeps whose
        ``seq`` is above ``since`` (default 0: all), one per answer, oldest
        first; then ``ENODATA``, or with ``follow`` each new record as it is
        logged, until the client goes (as ``flux dmesg [-f]``).

        A follower is registered before the records kept are read, so the
        hand-over has no gap: it was registered after they were sent, and a
        record logged in between (by another thread, or by the sending
        itself) was in neither.  What reaches it while the backlog is sent
        waits, and goes after it; a record in both (kept, its call still
        pending) is sent once, by ``seq``."""
        ring = self._ring(msg)  # (a guest is refused before its payload is read)
        p = msg.payload if msg.payload is not None else {}
        require(p)
        follow, since = p.get("follow", False), p.get("since", 0)
        if type(follow) is not bool or type(since) is not int:
            raise ErrnoError(errno.EPROTO, "follow must be a boolean and since an integer")
        if not msg.flags & MsgFlags.STREAMING:
            raise ErrnoError(errno.EPROTO, "log.dmesg is a streaming request")
        if not follow:
            for entry in ring.since(since):
                self.h.respond(msg, entry)
            self.h.respond_error(msg, errno.ENODATA)
            return
        last = since
        held: deque[Entry] = deque()
        holding = True  # until the backlog and what waited are sent

        def send(entry: Entry) -> None:
            # Each record reaches the followers once, but not always in seq
            # order: one from another thread comes a loop turn later than
            # one the loop logs meanwhile.  So only those already sent in
            # the backlog (kept, their call still pending) are skipped.
            if holding:
                held.append(entry)
            elif entry["seq"] > last:
                self.h.respond(msg, entry)

        key = (tuple(msg.route), msg.matchtag)
        ring.followers[key] = send
        self._follows[key] = msg
        try:
            for entry in ring.since(since):
                self.h.respond(msg, entry)
                last = entry["seq"]
        except BaseException:
            ring.followers.pop(key, None)
            self._follows.pop(key, None)
            raise
        while held:  # (what sending them logs joins the queue)
            entry = held.popleft()
            if entry["seq"] > last:
                self.h.respond(msg, entry)
        holding = False

    def log_clear(self, msg: Message) -> None:
        """``{seq?}``: forget the records kept (up to ``seq``) -> ``{}``."""
        ring = self._ring(msg)  # (a guest is refused before its payload is read)
        p = msg.payload if msg.payload is not None else {}
        require(p)
        seq = p.get("seq")
        if seq is not None and type(seq) is not int:
            raise ErrnoError(errno.EPROTO, "seq must be an integer")
        ring.clear(seq)
        self.h.respond(msg, {})

    def log_append(self, msg: Message) -> None:
        """``{message, level?, name?}`` -> ``{}``: log ``message`` on this rank
        as logger ``name`` (default ``logger``) at ``level`` (default
        ``info``), as ``flux logger`` does: a job script's notes land in
        the rank's log, stderr and ring alike.  The instance owner only.
        One logger serves every name (a name per client would be kept by
        :mod:`logging` for ever).  The message is cut to the ring's length
        (:func:`broker.logring.clip`) before it reaches stderr too, as
        Flux cuts a log message: a script's megabyte was written whole to
        the rank's stderr, at once, from its event loop."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "only the instance owner may write to the log")
        p = require(msg.payload, message=str)
        level, name = p.get("level", "info"), p.get("name", "logger")
        if type(level) is not str or level.lower() not in battrs.LOG_LEVELS:
            raise ErrnoError(errno.EINVAL, f"level must be one of {', '.join(battrs.LOG_LEVELS)}")
        if type(name) is not str or not _LOGGER_NAME.fullmatch(name):
            raise ErrnoError(errno.EINVAL, "name must be 1 to 64 letters, digits, '.', '_' or '-'")
        levelno = logging.getLevelName(level.upper())
        if _CLIENT_LOG.isEnabledFor(levelno):
            _CLIENT_LOG.handle(_CLIENT_LOG.makeRecord(
                name, levelno, "(client)", 0, "%s", (clip(p["message"]),), None))
        self.h.respond(msg, {})

    def log_cancel(self, msg: Message) -> None:
        """``{matchtag}`` (as Flux's ``log.cancel``): end, with ``ENODATA``,
        the follow stream of that matchtag from the same route (a program
        that stops following but keeps its connection) -> ``{}``."""
        tag = require(msg.payload, matchtag=int)["matchtag"]
        key = (tuple(msg.route), tag)
        request = self._follows.pop(key, None)
        if request is not None and self.broker.rank_log is not None:
            self.broker.rank_log.ring.followers.pop(key, None)
            self.h.respond_error(request, errno.ENODATA)
        self.h.respond(msg, {})

    def log_disconnect(self, msg: Message) -> None:
        """A client went: its ``--follow`` streams end."""
        rank_log = self.broker.rank_log
        route = tuple(msg.route)
        for key in [k for k in self._follows if k[0] == route]:
            del self._follows[key]
            if rank_log is not None:
                rank_log.ring.followers.pop(key, None)

    def attr_list(self, msg: Message) -> None:
        self.h.respond(msg, {"names": sorted(self.broker.attrs)})

    # -- event
    def publish_owned(self, topic: str, payload: Any) -> int:
        """What an ``event.pub`` request of the instance owner flagged
        ``PRIVATE`` does on rank 0, for a module of rank 0 calling in
        process (:attr:`ModuleContext.siblings`): the same topic check, the same
        sequencing, at once -- that request too was routed and served
        within the call that sent it -- without building, routing and
        dispatching a request.  Rank 0's kvs publishes a setroot per batch
        of commits so; raises ``ErrnoError`` where the request would have
        been answered with it (an event too big for a link: ``EMSGSIZE``).
        Returns the event's sequence number."""
        if self.ctx.rank != 0:
            raise RuntimeError("publish_owned is for rank 0, which sequences every event")
        return self.router.sequence_event(_event_topic(topic), payload, MsgFlags.PRIVATE,
                                          self.router.owner_uid)

    def event_pub(self, msg: Message) -> None:
        body = require(msg.payload, topic=str)
        topic = _event_topic(body["topic"])
        flags = body.get("flags", 0)
        if type(flags) is not int or flags & ~MsgFlags.PRIVATE:
            raise ErrnoError(errno.EPROTO, "event.pub flags are 0 or PRIVATE (8)")
        if not msg.is_owner and topic.startswith(RESTRICTED_EVENT_PREFIXES):
            raise ErrnoError(errno.EPERM, f"only the instance owner may publish {topic}")
        if self.ctx.rank != 0:
            self.router.pass_on(msg, 0)  # rank 0 sequences every event
            return
        userid = msg.userid
        claimed = body.get("userid")
        if msg.is_owner and claimed is not None:  # (a guest's is ignored, as ever)
            if type(claimed) is not int or not 0 <= claimed < 1 << 32:
                # e.g. true: it was sequenced, then every rank dropped the
                # event as malformed -- a gap everywhere, seen by no one
                raise ErrnoError(errno.EPROTO, "event.pub userid must be a uid")
            userid = claimed
        # An event every rank can forward, or none: the router refuses one
        # too big for a link before it has a sequence number.
        seq = self.router.sequence_event(topic, body.get("payload"),
                                         flags & MsgFlags.PRIVATE, userid)
        self.h.respond(msg, {"seq": seq})

    def _local_peer(self, msg: Message) -> Any:
        peer = self.router.peers.get(msg.route[-1]) if len(msg.route) == 1 else None
        if peer is None:
            raise ErrnoError(errno.EINVAL, "subscriptions are made on the subscriber's own rank")
        return peer

    def event_subscribe(self, msg: Message) -> None:
        topic = _event_topic(require(msg.payload, topic=str)["topic"], prefix=True)
        peer = self._local_peer(msg)
        if not msg.is_owner:
            held = self.router.guest_subscriptions[msg.userid]
            if held >= self.max_guest_subscriptions:
                raise ErrnoError(errno.ENOSPC, f"this user has {held} subscriptions on rank "
                                               f"{self.ctx.rank} (access.max-guest-"
                                               "subscriptions): drop some first")
        self.router.subscribe(peer, topic)
        self.h.respond(msg, {})

    def event_unsubscribe(self, msg: Message) -> None:
        topic = require(msg.payload, topic=str)["topic"]
        if not self.router.unsubscribe(self._local_peer(msg), topic):
            raise ErrnoError(errno.ENOENT, f"not subscribed to {topic!r}")
        self.h.respond(msg, {})

    # -- config
    def config_get(self, msg: Message) -> None:
        """``config.get`` -> ``{config, path}``: the rank's configuration
        file as it read it last (``{}`` without one), open to guests as
        Flux's (it holds attributes and host names, no keys)."""
        self.h.respond(msg, {"config": self.broker.config,
                             "path": self.broker.attrs["config.path"]})

    def config_reload(self, msg: Message) -> None:
        """``config.reload`` -> ``{changed: {name: value}}``: read the file
        again and set the ``[attrs]`` that changed (broker/config.py); the
        instance owner only."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "config reload is for the instance owner")
        self.h.respond(msg, {"changed": self.broker.reload_config()})

    def config_load(self, msg: Message) -> None:
        """``config.load {config}`` -> ``{changed: {name: value}}``:
        ``config`` in place of what the rank read from its file, checked
        as the file is, its ``[attrs]`` applied as a reload's (nothing on
        a refusal); this rank only; the instance owner only."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "config load is for the instance owner")
        p = require(msg.payload, config=dict)
        problem = _config_problem(p["config"])
        if problem is not None:
            raise problem
        self.h.respond(msg, {"changed": self.broker.load_config(p["config"])})

    def conf_builtin(self, msg: Message) -> None:
        """``broker.conf-builtin {keys}`` -> ``{values: {key: value}}``: what
        this rank's installation is (broker/config.py :func:`builtin`),
        as Flux's compiled-in paths; open to guests, as Flux's.  A key
        that is not one of them is refused naming it (the first such);
        ``keys`` not a list of strings ``EPROTO``."""
        keys = require(msg.payload, keys=list)["keys"]
        if not all(isinstance(key, str) for key in keys):
            raise ProtocolError("keys must be a list of strings")
        known = bconfig.builtin()
        for key in keys:
            if key not in known:
                raise ErrnoError(errno.EINVAL, f"{key}: invalid key (the keys: "
                                 f"{', '.join(sorted(known))})")
        self.h.respond(msg, {"values": {key: known[key] for key in keys}})

    # -- module
    async def module_load(self, msg: Message) -> None:
        """``module.load {name, args?}``: load module ``name`` on this rank,
        ``args`` its attribute settings (``["ATTR=VALUE", ...]``, Flux's
        module arguments); the instance owner only.  Answered once it has
        started: ``{name, services}``."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "loading modules is for the instance owner")
        p = require(msg.payload, name=str)
        settings = _settings(p.get("args", []))
        module = await self.broker.load_at_runtime(p["name"], settings)
        self.h.respond(msg, {"name": module.name, "services": list(module.service_names())})

    async def module_reload(self, msg: Message) -> None:
        """``module.reload {name, args?, force?, timeout?}``: ``module.load``
        in place of the loaded one, whose removal waits until the module is
        found and ``args`` checked (a bad setting leaves the loaded one
        running); ``force``: none loaded is no error.  The requests for the
        loaded one's services wait for the new one meanwhile, at most
        ``timeout`` seconds (default ``RELOAD_HOLD_TIMEOUT``, 60; the CLI's
        ``-t``): broker/reloadhold.py.  The instance owner only."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "loading modules is for the instance owner")
        p = require(msg.payload, name=str)
        force = p.get("force", False)
        if not isinstance(force, bool):
            raise ErrnoError(errno.EPROTO, "force must be a boolean")
        timeout = p.get("timeout", RELOAD_HOLD_TIMEOUT)
        if (type(timeout) not in (int, float) or not math.isfinite(timeout)
                or timeout <= 0):
            raise ErrnoError(errno.EPROTO, "timeout must be a positive number of seconds")
        module = await self.broker.load_at_runtime(p["name"], _settings(p.get("args", [])),
                                                   replace=True, force=force,
                                                   hold_timeout=float(timeout))
        self.h.respond(msg, {"name": module.name, "services": list(module.service_names())})

    async def module_remove(self, msg: Message) -> None:
        """``module.remove {name, cancel?}``: stop and forget module ``name``
        on this rank (``cancel``: cancel its stop, Flux's ``--cancel``);
        the instance owner only.  Answered once it has stopped."""
        if not msg.is_owner:
            raise ErrnoError(errno.EPERM, "removing modules is for the instance owner")
        p = require(msg.payload, name=str)
        cancel = p.get("cancel", False)
        if not isinstance(cancel, bool):
            raise ErrnoError(errno.EPROTO, "cancel must be a boolean")
        await self.broker.remove_at_runtime(p["name"], "module remove", cancel)
        self.h.respond(msg, {})

    def module_list(self, msg: Message) -> None:
        """``module.list``, open to guests (as in Flux), but a guest gets
        each module's name and services only: a module's ``requests`` count
        moves with what every user does, so a guest reading rank 0's
        content count around a read of its own saw whether a value it
        guessed was cached already (the oracle the stats views closed)."""
        if msg.is_owner:
            self.h.respond(msg, {"modules": [
                {"name": m.name, "services": list(m.service_names()), "requests": m.requests,
                 "held": m.h.held_count, **({"file": m.source_file} if m.source_file else {})}
                for m in self.broker.modules
            ]})
            return
        self.h.respond(msg, {"modules": [
            {"name": m.name, "services": list(m.service_names())}
            for m in self.broker.modules
        ]})


MAX_CONFIG_DEPTH = 64
"""Tables and arrays nested in a configuration ``config.load`` takes, at
most: no configuration is deeper, and the checks that walk one recurse
(500 levels failed as an internal error, with a traceback in the log)."""


def _config_problem(config: dict[str, Any]) -> ErrnoError | None:
    """Why ``config`` cannot be a configuration, if it cannot: a table
    keyed by other than strings (a msgpack map may be keyed by anything,
    and the checks of a configuration -- as a file's, whose keys TOML makes
    strings -- failed on another key as an internal error), or nesting
    deeper than :data:`MAX_CONFIG_DEPTH`.  Walked without recursion."""
    stack: list[tuple[Any, int]] = [(config, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                return ProtocolError("config must be an object whose keys are strings, "
                                     "as JSON's")
            inner: Any = value.values()
        elif isinstance(value, list):
            inner = value
        else:
            continue
        if depth > MAX_CONFIG_DEPTH:
            return ErrnoError(errno.EINVAL, f"config is nested more than {MAX_CONFIG_DEPTH} "
                                            "tables or arrays deep")
        stack.extend((v, depth + 1) for v in inner)
    return None
