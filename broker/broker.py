"""One rank: wires the router, the overlay, the local connector and the modules."""

from __future__ import annotations

import asyncio
import errno
import inspect
import logging
import os
import resource
import time
from typing import Any

from broker import __version__, bootstrap, gcpolicy, plugins, statsd
from broker import attrs as battrs
from broker import config as bconfig
from broker.connector import Connector
from broker.errors import ErrnoError, KvbrokerError, describe_failure
from broker.logring import RankLog
from broker.loops import loop_name
from broker.module import MODULE_FAILURES, RELOAD, Module, ModuleContext, ModuleHandle
from broker.overlay import Overlay
from broker.reloadhold import RELOAD_HOLD_TIMEOUT
from broker.router import Router
from broker.services import BrokerServices

log = logging.getLogger("kvbroker")

GOODBYE_WAIT = 1.0
"""Seconds a rank stopping cleanly waits for its parent to answer its
goodbye before it closes the link (:meth:`Overlay.goodbye_heard`)."""


def local_socket_path(rundir: str, rank: int) -> str:
    return os.path.join(rundir, f"local-{rank}")


class ModuleStartError(KvbrokerError):
    """A module's ``start()`` failed: the rank's start-up fails, naming it."""


def _listed_module_class(name: str) -> Any:
    """The class of module ``name`` of ``broker.modules``; one not found
    whose name holds a blank says how the list is written (``content
    kvs``: one name)."""
    try:
        return plugins.load_module_class(name)
    except LookupError as exc:
        if any(c.isspace() for c in name) and not plugins.is_file_module(name):
            raise LookupError(f"{exc}: broker.modules is a comma-separated list") from None
        raise


def start_order(classes: list[Any]) -> list[Any]:
    """``classes`` (the modules of ``broker.modules``, in its order), each
    after those its ``after`` names that are among them: ``kvs,content``
    starts content first (it was the start-up failure "no service matching
    content.store").  A module named twice stays twice (its second start
    is refused, naming the service); a cycle keeps the list's order."""
    first: dict[str, int] = {}
    for i, cls in enumerate(classes):
        first.setdefault(cls.name, i)
    placed: set[int] = set()
    out: list[Any] = []

    def place(i: int, seen: frozenset[int]) -> None:
        if i in placed or i in seen:
            return
        for dep in getattr(classes[i], "after", ()):
            if dep in first:
                place(first[dep], seen | {i})
        if i not in placed:
            placed.add(i)
            out.append(classes[i])

    for i in range(len(classes)):
        place(i, frozenset())
    return out


def _check_handlers_reachable(module: Module) -> None:
    """A handler whose topic is under none of the module's services is
    never called: the router sends a request to a module by its topic's
    first word.  Refused at load, naming them, rather than left for its
    callers to meet as ``ENOSYS``."""
    served = set(module.service_names())
    stray = sorted(t for t in module._handlers if t.partition(".")[0] not in served)
    if stray:
        raise ModuleStartError(
            f"module {module.name} has handlers no request could reach: "
            f"{', '.join(map(repr, stray))} (its services are "
            f"{', '.join(module.service_names())}; a request goes to the service "
            "named by its topic's first word)")


class Broker:
    """A broker rank.  ``await run()`` serves until :meth:`request_stop`."""

    def __init__(
        self,
        rank: int,
        size: int,
        fanout: int,
        rundir: str,
        *,
        statedir: str | None = None,
        attrs: dict[str, Any] | None = None,
        owner_uid: int | None = None,
        endpoints: dict[int, str] | None = None,
        bind: str | None = None,
        curve: tuple[bytes, bytes] | None = None,
        hosts: list[str] | None = None,
        rank_log: RankLog | None = None,
        config_file: str | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.fanout = fanout
        self.rundir = rundir
        self.owner_uid = os.getuid() if owner_uid is None else owner_uid
        self.router = Router(rank, size, fanout, self.owner_uid)
        self.endpoints = endpoints
        self.bind = bind
        self.curve = curve
        self.rank_log = rank_log
        """This rank's log handlers (None: logging is the embedding program's)."""
        # The core's tunables with their defaults (checked in start(), where a
        # bad value is a start-up failure), then what the instance set.
        self.attrs: dict[str, Any] = {s.name: s.default for s in battrs.BROKER_ATTRS}
        self.attrs.update(attrs or {})
        hostname = battrs.rank_hostname(self.attrs)
        self.hosts = hosts
        """Each rank's host, by rank, from a bootstrap file (None: every
        rank runs on this host, ``kvbroker start``)."""
        self.attrs.update({
            "rank": rank,
            "size": size,
            "fanout": fanout,
            "rundir": rundir,
            "statedir": statedir or "",
            "version": __version__,
            "local-uri": f"local://{local_socket_path(rundir, rank)}",
            "broker.pid": os.getpid(),
            "broker.starttime": round(time.time(), 3),
            "hostname": hostname,
            # (RFC 29 allows a plain list; one host for every rank of `start`)
            "hostlist": ",".join(hosts if hosts else [hostname] * size),
            "security.owner": self.owner_uid,
            "config.path": config_file or "",
        })
        self.config: dict[str, Any] = {}
        """The configuration file's object (``config get``), as last read."""
        self._file_attrs: dict[str, Any] = {}
        """Its ``[attrs]`` as last read: what ``config reload`` compares."""
        self.modules: list[Module] = []
        self.services: BrokerServices | None = None
        """The broker's own services (``broker.*``, ``attr.*``, ``log.*``,
        ``overlay.*``, ...), once started."""
        self._by_name: dict[str, Module] = {}
        self._kept: dict[str, Any] = {}
        """See :attr:`ModuleContext.kept`: what modules removed at runtime left."""
        self._changing: set[str] = set()
        """Modules being loaded or removed at runtime (one change at a time each)."""
        self._stopping: dict[str, asyncio.Task[None]] = {}
        """The stops of modules being removed, by name (``module remove
        --cancel`` cancels one that hangs, as Flux's)."""
        self._starting: dict[str, tuple[asyncio.Future[None], asyncio.Task[Any]]] = {}
        """The starts of modules being loaded at runtime, by name: ``module
        remove --cancel`` cancels one that hangs too (nothing else could:
        the module served, and no remove or reload was let through)."""
        self._next_tags: dict[str, int] = {}
        """Where the matchtags of each removed module's handle had got to:
        a module's route hop is its name, the same for every load, so its
        next load numbers its requests on from there -- an answer to the
        removed one's request, still on its way, found no request of the
        new one's with its tag and is dropped (it was taken as the answer
        to the new one's request with the same number)."""
        self.overlay: Overlay | None = None
        self.connector: Connector | None = None
        self.start_progress = 0
        """Pieces of start-up work the modules said they did (rank 0's
        restore: keys read); see :attr:`ModuleContext.progress`."""
        self.statsd: statsd.StatsdSender | None = None
        """What sends this rank's figures to a statsd server, if one is set."""
        self._stop = asyncio.Event()
        self.exit_code = 0
        """The rank's exit status once it stopped: 1 when it lost its parent."""
        self.shutdown_requested = False
        """Stopping because a client asked (``broker.shutdown``)."""
        self.stop_reason: str | None = None
        """Why the rank stops (the first reason given), for its log and its
        parent's (``overlay.goodbye``); ``None`` while it runs, or when
        start-up failed."""

    @property
    def uri(self) -> str:
        return str(self.attrs["local-uri"])

    def request_stop(self, why: str = "asked to stop") -> None:
        if self.stop_reason is None:
            self.stop_reason = why
        self._stop.set()

    def left_to_write(self) -> int:
        """Bytes the modules still have to write to disk (see
        :meth:`broker.module.Module.left_to_write`)."""
        return sum(m.left_to_write() for m in self.modules)

    def _stop_for_overlay(self, error: str | None, status: int = 1) -> None:
        """The parent said shutdown (``None``), or was lost or refused us
        (``error``): then the rank exits with ``status`` (:attr:`exit_code`)."""
        if error is None:
            parent = self.overlay.parent if self.overlay is not None else None
            self.request_stop(f"parent rank {parent} stops")
            return
        if not self._stop.is_set():
            log.error("%s: stopping", error)
            self.exit_code = status
        self.request_stop(error)

    def _context(self) -> ModuleContext:
        return ModuleContext(rank=self.rank, size=self.size, fanout=self.fanout,
                             attrs=self.attrs, owner_uid=self.owner_uid, log=log,
                             siblings=self._by_name, kept=self._kept,
                             progress=self._progress, upstream_lost=self._upstream_lost)

    def _upstream_lost(self) -> bool:
        return self.overlay is not None and self.overlay.parent_lost

    def _progress(self, n: int) -> None:
        self.start_progress += n

    def _make_module(self, cls: Any) -> Module:
        """``cls(ctx)``, a failure of its ``__init__`` as one of its start
        (:class:`ModuleStartError` naming the module): a module file's
        ``raise ValueError`` there read "failed to start: " and no more on a
        load, and at start-up only "start-up failed: ValueError"."""
        try:
            module: Module = cls(self._context())
        except (KvbrokerError, OSError):
            raise
        except MODULE_FAILURES as exc:
            why = describe_failure(exc)
            raise ModuleStartError(f"module {cls.name} failed to start: {why}") from exc
        if not hasattr(module, "_tasks"):
            # (loaded, it failed every request with an AttributeError --
            # a local client's connection dropped, one from another rank
            # never answered -- and module list with it)
            raise ModuleStartError(f"module {cls.name} failed to start: its __init__ does "
                                   "not call super().__init__(ctx)")
        return module

    def _check_free(self, name: str, services: tuple[str, ...]) -> None:
        """``EEXIST`` if another module provides one of ``services`` here
        (it was ``EIO`` "already registered", the module's other services
        left registered)."""
        for service in services:
            taken = self.router.services.get(service)
            if taken is not None:
                raise ErrnoError(errno.EEXIST, f"module {name} asks for service {service!r}, "
                                 f"which {taken.peer_id.removeprefix('m:')} provides on this "
                                 "rank")

    async def load_module(self, module: Module) -> None:
        for service in module.service_names():
            if not service or "." in service:
                raise ModuleStartError(f"module {module.name} asks for service {service!r}: "
                                       "a service name is a topic's first word (no '.'), "
                                       "and no request could reach it")
        self._check_free(module.name, module.service_names())
        handle = ModuleHandle(self.router, module, self._next_tags.get(module.name, 1))
        module._bind(handle)
        try:
            _check_handlers_reachable(module)
        except ModuleStartError:
            module.h = None  # type: ignore[assignment]  # (never served: no stop to run)
            raise
        self.router.add_peer(handle, module.service_names())
        self.modules.append(module)
        self._by_name[module.name] = module
        try:
            started = module.start()
            if inspect.isawaitable(started):  # (a plain start() does its work as called)
                await started
        except (KvbrokerError, OSError):
            raise  # (a module's own error, written for people: "statedir DIR is in use...")
        except MODULE_FAILURES as exc:  # a bug, or a plugin's: the start-up error names it
            why = describe_failure(exc)
            raise ModuleStartError(f"module {module.name} failed to start: {why}") from exc

    async def load_at_runtime(self, name: str, settings: dict[str, str], *,
                              replace: bool = False, force: bool = False,
                              hold_timeout: float = RELOAD_HOLD_TIMEOUT) -> Module:
        """``module load NAME [ATTR=VALUE ...]`` on this running rank: find
        the module, check ``settings`` (its own attributes, ``kvs.`` or
        not), start it; with ``replace`` (``module reload``), all that is
        checked before the loaded one is removed (``force``: none loaded is
        no error).  :class:`ErrnoError` -- ``EEXIST`` loaded already,
        ``ENOENT`` no such module (or, replacing, none loaded), ``EINVAL`` a
        bad setting, ``EBUSY`` a module it calls is not loaded or it is
        being changed, the module's own error as it failed to start --
        leaves the rank as it was, but for the module replaced.  While a
        loaded module is replaced, the requests for its services wait for
        the new one, at most ``hold_timeout`` seconds (:mod:`broker.reloadhold`)."""
        path = None
        if plugins.is_file_module(name):
            path = name
        elif replace and name in self._by_name:  # (a reload runs a file's code as it is now)
            path = self._by_name[name].source_file
        if path is None:
            return await self._load_or_replace(name, None, settings, replace, force,
                                               hold_timeout)
        cls = _module_class(path)
        try:
            self._check_same_module(path, cls.name, replace)
            return await self._load_or_replace(cls.name, cls, settings, replace, force,
                                               hold_timeout, path)
        except BaseException:
            plugins.forget_module_file(cls)  # (not loaded: the file's import goes)
            raise

    async def _load_or_replace(self, name: str, cls: Any, settings: dict[str, str],
                               replace: bool, force: bool, hold_timeout: float,
                               path: str | None = None) -> Module:
        """:meth:`load_at_runtime` once the module file, if any, was read
        (``cls`` its class, else None: found by ``name``)."""
        if name in self._changing:
            raise ErrnoError(errno.EBUSY, f"module {name} is being loaded or removed on rank "
                                          f"{self.rank}: wait for that first")
        loaded = self._by_name.get(name)
        if loaded is not None and not replace:
            raise ErrnoError(errno.EEXIST, f"module {name} is loaded on rank {self.rank} "
                                           "already: module reload replaces it")
        if loaded is None and replace and not force:
            raise ErrnoError(errno.ENOENT, f"module {name} is not loaded on rank {self.rank} "
                                           "(module reload -f loads it all the same)")
        if cls is None:
            cls = _module_class(name)
        missing = [m for m in getattr(cls, "calls", ()) if m not in self._by_name]
        if missing:
            raise ErrnoError(errno.EBUSY, f"module {name} calls module {missing[0]}, which is "
                                          f"not loaded on rank {self.rank}: load it first")
        specs = {spec.name: spec for spec in getattr(cls, "attributes", ())}
        changes: dict[str, str] = {}
        for key, value in settings.items():
            attr = _attr_of(name, key, specs)
            if attr in changes:
                raise ErrnoError(errno.EINVAL, f"module argument {attr} is given twice")
            changes[attr] = value
        trial = {**self.attrs, **changes}
        try:
            battrs.with_defaults(trial, specs.values())
        except battrs.AttrError as exc:
            raise ErrnoError(errno.EINVAL, str(exc)) from None
        # What comes for its services waits until it has started (a reload:
        # from before the old one's removal; broker/reloadhold.py): it got
        # ENOSYS in a reload, and reached a new module's handlers before
        # its start() had set up what they use.
        if loaded is None:
            services = cls.declared_services()
            self._check_free(name, services)  # (a hold on another's would take its requests)
        else:
            services = loaded.service_names()
        action = "load" if loaded is None else "reload"
        hold = self.router.hold_for_reload(name, services, hold_timeout,
                                           starting=loaded is None)  # (its words: "start")
        failure: str | None = None
        try:
            if loaded is not None:
                await self.remove_at_runtime(name, RELOAD)
            return await self._load_new(name, cls, specs, changes, trial, path)
        except BaseException as exc:
            why = (exc.errstr if isinstance(exc, ErrnoError) else
                   f"the {action} was cancelled" if isinstance(exc, asyncio.CancelledError)
                   else str(exc) or type(exc).__name__)
            failure = (f"module {name} failed to {action} on rank {self.rank}: "
                       f"{why.removeprefix(f'module {name} failed to start: ')}")
            raise
        finally:
            # (to whichever module serves now: the new one, the old one if it
            # was kept -- remove refused --, or none: answered ``failure``)
            self.router.end_hold(hold, failure)

    async def _load_new(self, name: str, cls: Any, specs: dict[str, Any],
                        changes: dict[str, str], trial: dict[str, Any],
                        path: str | None = None) -> Module:
        """:meth:`load_at_runtime`'s load, once what it is given was checked
        (``trial``: the rank's attributes with ``changes``, defaulted;
        ``path``: the file ``cls`` is from, if it is a module file)."""
        before = {key: self.attrs[key] for key in specs if key in self.attrs}
        self.attrs.update({key: trial[key] for key in specs})
        self._changing.add(name)
        try:
            module = self._make_module(cls)
            module.source_file = path and os.path.abspath(path)
            starting = asyncio.ensure_future(self.load_module(module))
            loader = asyncio.current_task()
            assert loader is not None
            self._starting[name] = (starting, loader)
            try:
                try:
                    await starting
                except asyncio.CancelledError:
                    if not starting.done():  # (the load itself cancelled: the start with it)
                        starting.cancel()
                        await asyncio.wait({starting})
                    raise
                finally:
                    self._starting.pop(name, None)
            except BaseException as exc:
                if module.h is not None:
                    await self._unload(module, "it failed to start")
                if (isinstance(exc, asyncio.CancelledError) and starting.cancelled()
                        and not loader.cancelling()):
                    raise ErrnoError(errno.ECANCELED, f"module {name}'s start was cancelled "
                                                      "(module remove --cancel)") from None
                raise
        except BaseException as exc:
            for key in specs:
                if key in before:
                    self.attrs[key] = before[key]
                else:
                    self.attrs.pop(key, None)
            if isinstance(exc, (ErrnoError, asyncio.CancelledError)):
                raise
            if isinstance(exc, KvbrokerError | OSError):
                # (an OSError's own words, not "[Errno 17] ...": the errno is said)
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                raise ErrnoError(getattr(exc, "errno", None) or errno.EIO, why) from None
            why = describe_failure(exc)
            raise ErrnoError(errno.EIO, f"module {name} failed to start: {why}") from None
        finally:
            self._changing.discard(name)
        log.info("module %s loaded%s", name,
                 "".join(f", {k}={v}" for k, v in changes.items()))
        return module

    async def remove_at_runtime(self, name: str, why: str, cancel: bool = False) -> None:
        """``module remove NAME`` on this running rank: route no more
        requests to it, stop it (the requests it serves end ``ENOSYS``, as
        Flux's), forget it.  With ``cancel``, its stop is cancelled rather
        than waited for (Flux's ``--cancel``: a module whose stop hangs),
        also one a remove before is waiting for.  :class:`ErrnoError`:
        ``ENOENT`` not loaded, ``EINVAL`` the broker's own services,
        ``EBUSY`` another module calls it, it is rank 0's content store,
        or it is being loaded or removed already."""
        if plugins.is_file_module(name):  # (the module loaded from that file)
            name = self._loaded_from(name)
        stopping = self._stopping.get(name)
        if stopping is not None:
            if not cancel:
                raise ErrnoError(errno.EBUSY, f"module {name} is being removed on rank "
                                              f"{self.rank} already (module remove --cancel "
                                              "stops waiting for its stop)")
            stopping.cancel()
            await asyncio.wait({stopping})
            return
        module = self._by_name.get(name)
        start = self._starting.get(name)
        if start is not None and cancel:  # (a start that hangs: its load ends ECANCELED)
            starting, loader = start
            starting.cancel()
            await asyncio.wait({loader})  # (it unloads what it started)
            return
        if name in self._changing:
            raise ErrnoError(errno.EBUSY, f"module {name} is being loaded on rank "
                                          f"{self.rank}: wait for that first (module remove "
                                          "--cancel cancels a start that hangs)")
        if module is None:
            raise ErrnoError(errno.ENOENT, f"module {name} is not loaded on rank {self.rank}")
        if module is self.services:
            raise ErrnoError(errno.EINVAL, "the broker's own services cannot be removed")
        users = [m.name for m in self.modules if name in getattr(m, "calls", ())]
        if users:
            raise ErrnoError(errno.EBUSY, f"module {users[0]} calls module {name} on rank "
                                          f"{self.rank}: remove {users[0]} first")
        if name == "content" and self.rank == 0:
            raise ErrnoError(errno.EBUSY, "rank 0's content module holds the instance's "
                                          "store: it is loaded for the instance's life")
        self._changing.add(name)
        try:
            await self._unload(module, why, cancel)
        finally:
            self._changing.discard(name)
        log.info("module %s removed (%s)", name, why)

    def _check_same_module(self, path: str, name: str, replace: bool) -> None:
        """Refuse the module ``name`` of file ``path`` if a module of
        another name is loaded from that file: the file was edited to
        define another module, which a reload loaded beside the old one
        (``EINVAL``; a load: ``EEXIST``)."""
        path = os.path.abspath(path)
        for module in self.modules:
            if module.source_file == path and module.name != name:
                raise ErrnoError(errno.EINVAL if replace else errno.EEXIST,
                                 f"module file {path} now defines module {name}, not "
                                 f"{module.name}, which was loaded from it: remove "
                                 f"{module.name} first on rank {self.rank}")

    def _loaded_from(self, path: str) -> str:
        """The name of the module loaded from the file at ``path``
        (``module remove ./echo.py``); ``ENOENT`` if none is."""
        path = os.path.abspath(path)
        for module in self.modules:
            if module.source_file == path:
                return module.name
        raise ErrnoError(errno.ENOENT, f"no module loaded from {path} on rank {self.rank}")

    async def _unload(self, module: Module, why: str, cancel: bool = False) -> None:
        """Stop ``module`` and forget it: its services first, so that what
        comes meanwhile goes elsewhere, its handle last (the answers to its
        own requests reach it as it stops).  A stop that fails, or is
        cancelled, is logged: the module is gone all the same."""
        self.router.withdraw_services(module.h)
        module.removing = True
        stop = asyncio.get_running_loop().create_task(module._shutdown(why))
        self._stopping[module.name] = stop
        try:
            if cancel:
                # Begun first, cancelled at its first wait: what a stop does
                # before it waits runs -- kvs-watch ending its watches, rank
                # 0's kvs keeping the instance's state for its next load.
                # Cancelled before it began, a stop ran none of it: the
                # watches waited for ever, and the next kvs started empty.
                await asyncio.sleep(0)
                stop.cancel()
            # (a stop of its own: the request that asked may be cancelled)
            await asyncio.wait({stop})
            if stop.cancelled():
                module.end_serving(why)  # (again: what its stop's end did not reach)
                log.warning("module %s: its stop was cancelled (module remove --cancel)",
                            module.name)
            elif (exc := stop.exception()) is not None:
                if isinstance(exc, ErrnoError):
                    log.error("module %s failed to stop: %s", module.name, exc.errstr)
                else:
                    log.error("module %s failed to stop", module.name, exc_info=exc)
        finally:
            del self._stopping[module.name]
            if module.source_file:  # (no module runs that import's code now)
                plugins.forget_module_file(type(module))
            self.router.remove_peer(module.h)
            self._next_tags[module.name] = module.h.close_as_removed(
                f"module {module.name} was removed")
            if module in self.modules:
                self.modules.remove(module)
            if self._by_name.get(module.name) is module:
                del self._by_name[module.name]

    def _read_config(self) -> None:
        """The configuration file, as the rank starts: one it cannot read
        now (it was read by the launcher) is said, and ``config get`` is
        empty."""
        path = str(self.attrs["config.path"])
        if path:
            try:
                self.config, self._file_attrs = bconfig.read(path)
            except bootstrap.BootstrapError as exc:
                log.warning("config: %s", exc)

    def reload_config(self) -> dict[str, str]:
        """``config reload``: read the file again and set the ``[attrs]``
        that changed (:mod:`broker.config`); what was set.  ``ErrnoError``
        changes nothing: ``ENOENT`` no file (or an attribute taken out
        that has no default), ``EINVAL`` a bad file or value, or one that
        is fixed at start."""
        path = str(self.attrs["config.path"])
        if not path:
            raise ErrnoError(errno.ENOENT, "this rank was started without a configuration "
                                           "file (kvbroker start --config FILE)")
        try:
            doc, attrs = bconfig.read(path)
        except bootstrap.BootstrapError as exc:
            raise ErrnoError(errno.EINVAL, str(exc)) from None
        if doc.get("bootstrap") != self.config.get("bootstrap"):
            # (as config load refuses: the instance keeps its shape.  Not
            # checked, a changed fanout or host list was taken, and config
            # get showed it while the ranks ran as they started)
            raise ErrnoError(errno.EINVAL, f"{path}: [bootstrap] may not be changed on a "
                                           "running rank (the instance keeps the shape it "
                                           "started with: restart its ranks to change it)")
        return self._take_config(doc, attrs, path, f"reloaded from {path}")

    def load_config(self, doc: dict[str, Any]) -> dict[str, str]:
        """``config load``: ``doc`` in place of the object the rank read
        from its file, checked as the file is (:func:`bootstrap.loaded_attrs`),
        its ``[attrs]`` applied as a reload's; the file is untouched, and
        the next ``reload`` reads it again.  ``ErrnoError`` as
        :meth:`reload_config`'s, changing nothing."""
        path = str(self.attrs["config.path"])
        boot = self.config.get("bootstrap")
        try:
            attrs = bootstrap.loaded_attrs(doc, "the loaded object", boot if isinstance(boot, dict)
                                           else None,
                                           os.path.dirname(path) if path else None)
        except bootstrap.BootstrapError as exc:
            raise ErrnoError(errno.EINVAL, str(exc)) from None
        return self._take_config(doc, attrs, "the loaded object", "loaded")

    def _take_config(self, doc: dict[str, Any], attrs: dict[str, Any], where: str,
                     how: str) -> dict[str, str]:
        """Make ``doc`` (``attrs`` its ``[attrs]``) the rank's configuration:
        set the attributes that changed since the last one (one taken out
        goes back to its default), all checked first, or nothing."""
        try:  # (what a rank sets itself -- rank, size, hostlist... -- refused as in a
            # start's file: a load let it in, and then no load could take it out;
            # the values are checked as they are set, below, and no module is
            # imported to check them, as a start's check does)
            battrs.check_not_set_by_rank(
                [k for k in battrs.from_flux(dict(attrs), self.size)
                 if k not in ("statedir", "rundir")], bootstrap="bootstrap" in doc)
        except battrs.AttrError as exc:
            raise ErrnoError(errno.EINVAL, f"{where}: [attrs] {exc}") from None
        specs = [*battrs.BROKER_ATTRS, *(a for m in self.modules for a in m.attributes)]
        by_name = {spec.name: spec for spec in specs}
        for name in {*self._file_attrs, *attrs} - by_name.keys():
            # (a removed module's runtime attribute: set, it is kept for the
            # module's next load; taken out, it goes back to its default --
            # it was refused, "no default to go back to", with all the rest)
            unloaded = _unloaded_runtime_spec(name)
            if unloaded is not None:
                by_name[name] = unloaded
        defaults = {name: spec.default for name, spec in by_name.items()}

        def in_force(name: str, value: str) -> bool:
            """``value`` is what the rank runs with already: no change (a
            fixed attribute written into the file at its value -- the
            default, or -S's -- was refused as a change, and ``1000000.0``
            for ``1000000``)."""
            if name not in self.attrs:
                return False
            spec = by_name.get(name)
            if spec is None:
                return bconfig.text(self.attrs[name]) == value
            try:
                return bool(spec.value({name: self.attrs[name]}) == spec.value({name: value}))
            except battrs.AttrError:
                return False

        try:  # (both say which configuration: the file, or a load's object)
            wanted = {name: value for name, value
                      in bconfig.changes(self._file_attrs, attrs, defaults).items()
                      if not in_force(name, value)}
            self.set_attrs(wanted)
        except ErrnoError as exc:
            # (an unknown attribute, or one taken out without a default, is
            # ENOENT to attr set; in a configuration it is a bad one: it read
            # "No such file or directory (the loaded object: ...)")
            errnum = errno.EINVAL if exc.errnum == errno.ENOENT else exc.errnum
            raise ErrnoError(errnum, f"{where}: [attrs] {exc.errstr}") from None
        self.config, self._file_attrs = doc, attrs
        log.info("config %s: %s", how,
                 ", ".join(f"{k}={v}" for k, v in wanted.items()) or "nothing changed")
        return wanted

    async def start(self) -> None:
        """Bring up connector, overlay and modules; return once this rank's
        whole subtree is connected (rank 0: the whole instance)."""
        self._read_config()
        self.attrs["event-loop"] = loop_name(asyncio.get_running_loop())
        if self.rank_log is not None:
            self.rank_log.ring.attach(asyncio.get_running_loop())
        config = battrs.check(self.attrs, battrs.BROKER_ATTRS)  # AttrError: start-up fails
        battrs.normalize(self.attrs, battrs.BROKER_ATTRS)
        # A module that cannot load is a start-up failure, as in Flux: an
        # instance silently missing kvs-watch would only fail later.  Modules
        # are found, and their attributes checked and defaulted, before the
        # rank listens or loads any of them.
        names = battrs.module_names(self.attrs, self.rank)
        loaded = [_listed_module_class(name) for name in names]
        files = {cls: os.path.abspath(name)  # (module files: module reload reads them again)
                 for name, cls in zip(names, loaded, strict=True) if plugins.is_file_module(name)}
        classes = start_order(loaded)
        for cls in classes:
            battrs.with_defaults(self.attrs, getattr(cls, "attributes", ()))
        self.connector = Connector(
            self.router,
            local_socket_path(self.rundir, self.rank),
            owner_uid=self.owner_uid,
            allow_guest=config[battrs.ALLOW_GUEST_USER.name],
            max_message=config[battrs.MAX_MESSAGE.name],
            max_guest_connections=config[battrs.MAX_GUEST_CONNECTIONS.name],
            max_guest_bytes=config[battrs.MAX_GUEST_BYTES.name],
        )
        self.router.max_guest_requests = config[battrs.MAX_GUEST_REQUESTS.name]
        self.router.max_guest_services = config[battrs.MAX_GUEST_SERVICES.name]
        self.overlay = Overlay(self.router, self.rundir, endpoints=self.endpoints,
                               bind=self.bind, curve=self.curve,
                               transport=config[battrs.TRANSPORT.name],
                               max_backlog=config[battrs.LINK_BACKLOG.name],
                               max_message=config[battrs.LINK_MAX_MESSAGE.name],
                               torpid_min=config[battrs.TORPID_MIN.name],
                               torpid_max=config[battrs.TORPID_MAX.name],
                               connect_timeout=config[battrs.CONNECT_TIMEOUT.name],
                               ipv6=config[battrs.IPV6.name],
                               hostname=str(self.attrs["hostname"]), hosts=self.hosts,
                               content_hash=str(config[battrs.CONTENT_HASH.name]),
                               on_stop=self._stop_for_overlay)
        # What comes for a module's services before it has started waits
        # for it, as during a reload (broker/reloadhold.py): a rank 0
        # restarted under running followers is sent their clients' requests
        # and reconnecting watches as soon as its links are up.
        holds = [self.router.hold_for_reload(cls.name, cls.declared_services(), starting=True)
                 for cls in (BrokerServices, *classes)]
        try:
            await self.overlay.start()
            self.services = BrokerServices(self._context(), self)
            await self.load_module(self.services)
            self.router.end_hold(holds[0])
            for cls, hold in zip(classes, holds[1:], strict=True):
                module = self._make_module(cls)
                module.source_file = files.get(cls)
                await self.load_module(module)
                self.router.end_hold(hold)
        finally:
            for hold in holds:  # (a start-up that failed: what waits is told; no-op if ended)
                self.router.end_hold(hold, f"rank {self.rank} failed to start")
        # Only once the parent admitted this process: the connector takes
        # over a socket left at its path, and a process the parent refuses
        # (another process of this rank still holds its link) took the
        # running one's away -- and removed it as it exited.
        await self.overlay.admitted
        await self.connector.start()
        await self.overlay.ready
        await self._start_statsd(config)

    async def _start_statsd(self, config: dict[str, Any]) -> None:
        """Push this rank's figures to ``stats.statsd`` (or Flux's
        ``FLUX_FRIPP_STATSD``), once every module has started: a bad
        variable is logged, as Flux does, and the rank serves on."""
        address: str = config[battrs.STATSD.name]
        source = battrs.STATSD.name
        if not address and os.environ.get(statsd.ENV, "").strip():
            source = statsd.ENV
            try:
                address = battrs.statsd_address(os.environ[statsd.ENV])
            except ValueError as exc:
                log.error("%s parse error: %s; sending no figures", statsd.ENV, exc)
                return
            self.attrs[battrs.STATSD.name] = address
        if not address:
            return
        prefix = config[battrs.STATSD_PREFIX.name].replace("{rank}", str(self.rank))
        sender = statsd.StatsdSender(statsd.parse_address(address), prefix,
                                     config[battrs.STATSD_PERIOD.name], self.metrics)
        if await sender.start(source):
            self.statsd = sender

    def metrics(self) -> dict[str, float | int]:
        """Every module's figures for statsd, by dotted name (``kvs.counts.
        commits``), and the content cache's under Flux's names too."""
        out: dict[str, float | int] = {}
        for module in self.modules:
            out.update(statsd.flatten(module.stats(), module.metrics_skip, f"{module.name}."))
        for ours, flux in statsd.FLUX_CONTENT_NAMES.items():
            if f"content.{ours}" in out:
                out[f"content-cache.{flux}"] = out[f"content.{ours}"]
        return out

    async def run(self) -> None:
        await self._stop.wait()

    async def stop(self) -> None:
        if self.stop_reason is not None and self.exit_code == 0:  # (errors: logged)
            # (one line per rank's life: with its start-up lines, the log
            # says when and why each rank went, without a debug level)
            log.info("stopping: %s", self.stop_reason)
        if self.statsd is not None:
            self.statsd.close()
        if self.overlay is not None:
            # they stop alongside, not after us (and fail with us)
            self.overlay.shutdown_children(failed=self.exit_code != 0)
            if self.stop_reason is not None and self.exit_code == 0:
                # the parent then logs our link's closing at INFO, not as a loss
                self.overlay.goodbye(self.stop_reason)
        for module in reversed(self.modules):
            if module.removing:  # (module remove is stopping it: not twice)
                continue
            try:
                await module._shutdown(self.stop_reason)
            except Exception as exc:
                # e.g. the last checkpoint could not be written (a full
                # disk): say so, and exit 1 -- a clean stop that lost
                # something is not a clean stop
                self.exit_code = self.exit_code or 1
                if isinstance(exc, ErrnoError):
                    log.error("module %s failed to stop: %s", module.name, exc.errstr)
                else:
                    log.exception("module %s failed to stop", module.name)
        if self.connector is not None:
            await self.connector.close()
        if self.overlay is not None:
            await asyncio.gather(self.overlay.goodbye_heard(GOODBYE_WAIT),
                                 self.overlay.shutdown_heard(GOODBYE_WAIT))
            self.overlay.close()

    def set_attr(self, name: str, value: str) -> None:
        """Set runtime attribute ``name`` (:data:`broker.attrs.RUNTIME_ATTRS`,
        or a loaded module's :attr:`~broker.module.Module.runtime_attributes`)
        on this rank and apply it at once; :class:`ErrnoError` (ENOENT for an
        unknown name, ENOSYS for a log level when this rank's logging is its
        host program's, EINVAL otherwise) changes nothing."""
        self.set_attrs({name: value})

    def _reload_hint(self, owner: str, name: str) -> str:
        users = [m.name for m in self.modules if owner in getattr(m, "calls", ())]
        return _reload_hint_for(self.rank, owner, name, users)

    def set_attrs(self, changes: dict[str, str]) -> None:
        """:meth:`set_attr` of several at once (``config reload``): all are
        checked together (``tbon.torpid_min`` with the new ``_max``) before
        any is applied, so a refusal changes nothing."""
        modules: dict[str, tuple[Module, Any]] = {}
        core: list[str] = []
        trial = {**self.attrs, **changes}
        for name in changes:
            if name not in self.attrs:
                raise ErrnoError(errno.ENOENT, battrs.unknown_message(name, self.attrs))
            module = next((m for m in self.modules if name in m.runtime_attributes), None)
            if module is not None:  # a module's (kvs.checkpoint-period)
                spec = next(spec for spec in module.attributes if spec.name == name)
                try:
                    modules[name] = (module, battrs.check(trial, [spec])[name])
                except battrs.AttrError as exc:
                    raise ErrnoError(errno.EINVAL, str(exc)) from None
                continue
            spec = _unloaded_runtime_spec(name)
            if spec is not None:
                # A module's that is not loaded here (module remove): kept,
                # checked, for its next load, which starts from the rank's
                # attributes -- refused, it made a whole config reload fail
                # on this rank, told to "set it at start"
                try:
                    battrs.check(trial, [spec])
                except battrs.AttrError as exc:
                    raise ErrnoError(errno.EINVAL, str(exc)) from None
                continue
            if name not in battrs.RUNTIME_ATTRS:
                owner = next((m.name for m in self.modules
                              if any(spec.name == name for spec in m.attributes)), None)
                reload = "" if owner is None else self._reload_hint(owner, name)
                raise ErrnoError(errno.EINVAL, f"{name} may not be changed on a running rank "
                                 f"({battrs.how_to_set(name)}{reload})")
            levels = (battrs.LOG_LEVEL.name, battrs.LOG_RING_LEVEL.name)
            if name in levels and self.rank_log is None:
                raise ErrnoError(errno.ENOSYS, "this rank's logging is its host program's")
            core.append(name)
        torpid = (battrs.TORPID_MIN.name, battrs.TORPID_MAX.name)
        checked = set(core)
        if checked & set(torpid):  # (the pair is valid only together)
            checked.update(torpid)
        try:
            parsed = battrs.check(trial, [s for s in battrs.BROKER_ATTRS if s.name in checked])
        except battrs.AttrError as exc:
            raise ErrnoError(errno.EINVAL, str(exc)) from None
        for name, (module, value) in modules.items():
            module.set_attribute(name, value)
        self.attrs.update(changes)
        # as the start keeps them (attrs.normalize): ``DEBUG`` is ``debug``,
        # `` info`` ``info`` -- attr get read back what was typed
        battrs.normalize(self.attrs, [s for s in battrs.BROKER_ATTRS if s.name in core])
        if self.rank_log is not None and battrs.LOG_LEVEL.name in core:
            self.rank_log.set_levels(level=str(parsed[battrs.LOG_LEVEL.name]))
        if self.rank_log is not None and battrs.LOG_RING_LEVEL.name in core:
            self.rank_log.set_levels(ring_level=str(parsed[battrs.LOG_RING_LEVEL.name]))
        if self.overlay is not None and checked & set(torpid):
            self.overlay.set_torpid(parsed[battrs.TORPID_MIN.name],
                                    parsed[battrs.TORPID_MAX.name])
        for name in changes:
            log.info("attribute %s set to %s", name, self.attrs[name])

    def stats(self) -> dict[str, Any]:
        out = self.router.stats()
        if self.connector is not None:
            out["connector"] = dict(self.connector.counts)
            out["guests"] = self.connector.guest_stats()
        if self.overlay is not None:
            out["overlay"] = {"dropped": self.overlay.dropped,
                              "refused": self.overlay.refused,
                              "replaced": self.overlay.replaced,
                              "slow": self.overlay.slow,
                              "children": sorted(self.overlay.hello_from),
                              "rejoined": self.overlay.rejoined(),
                              "offline": self.overlay.offline(),
                              "lost": self.overlay.lost(),
                              "unjoined": self.overlay.unjoined(),
                              "hosts": self.overlay.child_hosts(),
                              "torpid": self.overlay.torpid_seconds(),
                              "traces": (len(self.services.trace)
                                         if self.services is not None else 0)}
        if self.rank_log is not None:
            ring = self.rank_log.ring
            out["log"] = {"kept": len(ring.entries), "logged": ring.next_seq - 1,
                          "followers": len(ring.followers)}
        out["modules"] = {m.name: m.h.subscribe_calls for m in self.modules}
        peak, now = _rss_mb()
        out["rss_mb"] = peak
        if now is not None:
            out["rss_now_mb"] = now
        out["gc"] = gcpolicy.stats()
        if self.statsd is not None:
            out["statsd"] = self.statsd.stats()
        return out


def _attr_of(module: str, key: str, specs: dict[str, Any]) -> str:
    """The attribute ``module load NAME KEY=VALUE`` sets: one of the module's
    own, named whole (``kvs.transaction-merge``) or, as Flux's module
    options, without the module's prefix (``transaction-merge``)."""
    for name in (key, f"{module}.{key}"):
        if name in specs:
            return name
    known = ", ".join(sorted(specs)) or "none"
    raise ErrnoError(errno.EINVAL, f"module {module} has no attribute {key!r} "
                                   f"(its attributes: {known})")


def _rss_mb() -> tuple[float, float | None]:
    """The rank's peak resident memory and its resident memory now, in MiB.
    ``rss_mb`` is the peak, which never comes down: an operator watching a
    rank's memory (after a burst of watches or a big commit was freed)
    could not see what it holds now, ``rss_now_mb``.  On Linux both come
    from one read of ``/proc/self/status`` (``VmHWM``, ``VmRSS``), so the
    peak is never below the current size: ``ru_maxrss`` lags the kernel's
    resident counters (0.1-0.4 MiB below ``VmRSS`` on a rank whose memory
    had just grown, and on every rank of an idle instance, Linux 6.18), and
    an operator read a "peak" smaller than the memory held now.  Elsewhere:
    ``ru_maxrss``, and no current size."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                name, _, value = line.partition(b":")
                if name in (b"VmHWM", b"VmRSS"):
                    fields[name.decode()] = int(value.split()[0])  # (kB)
    except (OSError, ValueError, IndexError):
        fields = {}
    if "VmHWM" in fields and "VmRSS" in fields:
        return max(fields["VmHWM"], fields["VmRSS"]) / 1024, fields["VmRSS"] / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, None


def _reload_hint_for(rank: int, owner: str, name: str, users: list[str]) -> str:
    """The tail of the refusal of ``attr set NAME`` for loaded module
    ``owner``'s fixed attribute: the reload that takes it -- after removing
    ``users`` (modules that call it: the reload alone is refused, EBUSY),
    and none for rank 0's content module, loaded for the instance's life."""
    if owner == "content" and rank == 0:
        return ""
    reload = f"kvbroker module reload {owner} {name.removeprefix(f'{owner}.')}=VALUE"
    if not users:
        return f"; or give it to a reload: {reload}"
    return (f"; or give it to a reload, with {users[0]} removed meanwhile (it calls "
            f"{owner}): kvbroker module remove {users[0]}; {reload}; kvbroker module "
            f"load {users[0]}")


def _unloaded_runtime_spec(name: str) -> Any:
    """The spec of attribute ``name`` if a module its prefix names (``kvs``
    of ``kvs.checkpoint-period``) may change it on a running rank; None
    otherwise, or if there is no such module."""
    prefix = name.partition(".")[0]
    if plugins.is_file_module(prefix):  # (a name shaped like a path: never run as a file)
        return None
    try:
        cls = _module_class(prefix)
    except ErrnoError:
        return None
    if name not in getattr(cls, "runtime_attributes", ()):
        return None
    return next((s for s in getattr(cls, "attributes", ()) if s.name == name), None)


def _module_class(name: str) -> Any:
    """:func:`broker.plugins.load_module_class` of an entry point's name or
    a module file's path, its failures as ``ErrnoError``: ``ENOENT`` no
    such module (or file), ``ENOEXEC`` one that does not import or define
    one module class."""
    try:
        return plugins.load_module_class(name)
    except LookupError as exc:
        raise ErrnoError(errno.ENOENT, str(exc).strip('"')) from None
    except plugins.ModuleLoadError as exc:
        raise ErrnoError(errno.ENOEXEC, str(exc)) from None
