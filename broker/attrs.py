"""The broker attributes that take a value: name, parser, default, meaning.

One :class:`AttrSpec` per tunable attribute.  The broker core declares its
own in :data:`BROKER_ATTRS`; a module declares the attributes it reads in its
class attribute ``Module.attributes`` (the ``content`` module its
``content.*``, ``kvs`` its ``kvs.*``, ...), so the core never imports a
module to know them -- it finds the module class by entry point, as it does
to load it (:mod:`broker.plugins`).  The same specs serve three places:

* ``kvbroker start`` / :class:`broker.launch.Instance` refuses a bad value
  before any rank starts (:func:`check_instance`), with one line naming the
  attribute (``log.level: unknown value 'bogus' (choose from ...)``);
* a rank fills in the default of every declared attribute it does not have,
  so ``kvbroker attr get NAME`` and ``attr list`` show the effective value
  on every rank (:func:`with_defaults`), and checks the values again (a rank
  may be started without the launcher);
* the code that reads an attribute parses it with :meth:`AttrSpec.value`.

Values are kept as given (``-S`` values are strings); defaults are stored as
the text one would pass with ``-S``, so an attribute reads back the same way
whether it was set or defaulted.  Attributes no spec declares (``-S
my.attr=x``) are kept and readable, unchecked -- unless their name is in a
prefix the core or a loaded module owns (``kvs.``, ``log.`` ...), where an
unknown name is a typo refused at start (:func:`check_names`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from broker import codec, plugins
from broker.connector import DEFAULT_MAX_GUEST_BYTES, DEFAULT_MAX_GUEST_CONNECTIONS
from broker.content import blobref
from broker.statsd import parse_address


class AttrError(ValueError):
    """A bad attribute value: ``str()`` is ``<name>: <what is wrong>``."""


Parser = Callable[[Any], Any]
"""Turns a value (text as given with ``-S``, or a native Python value) into
the value the code uses; raises ``ValueError`` saying what is wrong."""


@dataclass(frozen=True)
class AttrSpec:
    name: str
    default: str
    parse: Parser
    doc: str = ""

    def value(self, attrs: Mapping[str, Any]) -> Any:
        """This attribute's parsed value in ``attrs`` (the default when unset);
        :class:`AttrError` when it is invalid."""
        raw = attrs.get(self.name, self.default)
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise AttrError(f"{self.name}: {exc}") from None


# ---------------------------------------------------------------- parsers

_INT_RE = re.compile(r"-?[0-9]+")


def integer(minimum: int = 0, why: str = "", maximum: int | None = None) -> Parser:
    """A decimal integer of at least ``minimum`` (``why`` says why, if it
    matters) and at most ``maximum``."""

    def parse(value: Any) -> int:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not an integer")
        if isinstance(value, int):
            n = value
        else:
            text = str(value).strip()
            if not _INT_RE.fullmatch(text):
                raise ValueError(f"{str(value)!r} is not an integer")
            n = int(text)
        if n < minimum:
            reason = f": {why}" if why else ""
            raise ValueError(f"{n} is below the minimum of {minimum}{reason}")
        if maximum is not None and n > maximum:
            raise ValueError(f"{n} is above the maximum of {maximum}")
        return n

    return parse


_DURATION_RE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ms|s|m|h|d)?")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def duration(value: Any) -> float:
    """A non-negative duration in seconds: a number, optionally with a unit
    as in Flux's standard durations (RFC 23): ``ms``, ``s``, ``m``, ``h``,
    ``d`` -- ``2``, ``0.5s``, ``30m``."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        if not 0 <= value < float("inf"):
            raise ValueError(f"{value!r} is not a duration (seconds, at least 0)")
        return float(value)
    m = _DURATION_RE.fullmatch(str(value).strip())
    if m is None:
        raise ValueError(f"{str(value)!r} is not a duration (e.g. 2, 0.5s, 30m)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def boolean(value: Any) -> bool:
    """``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``), any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{str(value)!r} is not a boolean (use true or false)")


def choice(names: Iterable[str], what: str = "value", fold_case: bool = False) -> Parser:
    """One of ``names`` (compared without case when ``fold_case``)."""
    allowed = tuple(names)

    def parse(value: Any) -> str:
        text = str(value).strip()
        key = text.lower() if fold_case else text
        if key not in allowed:
            raise ValueError(f"unknown {what} {str(value)!r} (choose from {', '.join(allowed)})")
        return key

    return parse


def text(value: Any) -> str:
    return str(value)


# ---------------------------------------------------------------- the core's

LOG_LEVELS = ("debug", "info", "warning", "error")
TRANSPORTS = ("unix", "ipc", "tcp")
MIN_MAX_MESSAGE = 256  # a request header with a topic and a route fits

ALLOW_GUEST_USER = AttrSpec(
    "access.allow-guest-user", "false", boolean,
    "true lets other users connect, with role USER")
MAX_GUEST_CONNECTIONS = AttrSpec(
    "access.max-guest-connections", str(DEFAULT_MAX_GUEST_CONNECTIONS), integer(1),
    "connections one guest user may hold to a rank; one more is closed (EUSERS)")
MAX_GUEST_BYTES = AttrSpec(
    "access.max-guest-bytes", str(DEFAULT_MAX_GUEST_BYTES), integer(1 << 16),
    "bytes a rank holds for one guest user's connections (messages part-received, "
    "output unread); past it, the connections holding the most are closed (ENOBUFS)")
MAX_GUEST_SUBSCRIPTIONS = AttrSpec(
    "access.max-guest-subscriptions", "10000", integer(1),
    "event subscriptions one guest user may hold on a rank, over all its "
    "connections; one more is refused with ENOSPC")
MAX_GUEST_REQUESTS = AttrSpec(
    "access.max-guest-requests", "100000", integer(1),
    "one guest user's requests a rank has sent on to its children and not "
    "seen answered; one more is refused with ENOSPC")
MAX_GUEST_SERVICES = AttrSpec(
    "access.max-guest-services", "65536", integer(1),
    "distinct (service, rank) pairs one guest user's connections to a rank "
    "address; one more is refused with ENOSPC")
MODULES = AttrSpec(
    "broker.modules", ",".join(plugins.DEFAULT_MODULES), text,
    "modules to load, by entry-point name")
MAX_MESSAGE = AttrSpec(
    "broker.max-message", str(codec.DEFAULT_MAX_MESSAGE),
    integer(MIN_MAX_MESSAGE, "every request carries a header, a topic and a route",
            codec.MAX_LINK_MESSAGE),
    "largest message a client may send (bytes)")
CONTENT_HASH = AttrSpec(
    "content.hash", blobref.DEFAULT_HASH, choice(blobref.HASHES, "hash"),
    "the hash naming blobs (read by every module that makes blobrefs)")
LOG_LEVEL = AttrSpec(
    "log.level", "warning", choice(LOG_LEVELS, "level", fold_case=True),
    "ranks log to stderr at this level")
LOG_RING_LEVEL = AttrSpec(
    "log.ring-level", "info", choice(LOG_LEVELS, "level", fold_case=True),
    "each rank keeps its last log records at this level in memory, for kvbroker dmesg")
LOG_RING_SIZE = AttrSpec(
    "log.ring-size", "1024", integer(0),
    "how many log records each rank keeps for kvbroker dmesg (the oldest go first)")
LOG_TIMESTAMPS = AttrSpec(
    "log.timestamps", "auto", choice(("auto", "always", "never"), "choice"),
    "start each log line with the UTC time (auto: when stderr is a file)")
RECOVERY_MODE = AttrSpec(
    "broker.recovery-mode", "0", integer(0, "", 1),
    "1 in an instance started by start --recovery (Flux's): rank 0 alone on a stopped "
    "instance's statedir or a dump archive")
TRANSPORT = AttrSpec(
    "tbon.transport", "unix", choice(TRANSPORTS, "transport"),
    "overlay links")
LINK_BACKLOG = AttrSpec(
    "tbon.max-backlog", str(512 << 20), integer(1 << 20),
    "bytes queued for a parent or child rank that does not read before its "
    "link is dropped")
LINK_MAX_MESSAGE = AttrSpec(
    "tbon.max-message", str(codec.MAX_LINK_MESSAGE),
    integer(64 << 10, "", codec.MAX_LINK_MESSAGE),
    "largest message a rank sends to its parent or a child (bytes): a bigger "
    "request, response or event is answered EMSGSIZE instead")
TORPID_MIN = AttrSpec(
    "tbon.torpid_min", "5", duration,
    "a rank that has sent its parent nothing for this long sends it a keepalive "
    "(overlay.keepalive); also how often each rank checks its children")
TORPID_MAX = AttrSpec(
    "tbon.torpid_max", "30", duration,
    "a child rank its parent has heard nothing from for this long is marked "
    "torpid (logged, listed by kvbroker overlay status; not disconnected); 0: never")

IPV6 = AttrSpec(
    "tbon.ipv6", "false", boolean,
    "tcp: links over IPv6 as well as IPv4 (a bootstrap file's enable_ipv6, as Flux's); "
    "an endpoint whose address is in brackets, tcp://[::1]:8050, has it anyway")

CONNECT_TIMEOUT = AttrSpec(
    "tbon.connect_timeout", "30", duration,
    "ipc/tcp: a rank that has had no connection to its parent for this long "
    "says so (WARNING) and goes on trying; on tcp, also how long one connect "
    "attempt may take before it is retried; 0: no warning, the system's connect timeout")

def statsd_address(value: Any) -> str:
    """Empty (no statsd), or a statsd server's ``HOST:PORT``."""
    text_value = str(value).strip()
    if text_value:
        parse_address(text_value)
    return text_value


def statsd_prefix(value: Any) -> str:
    """Dotted words; ``{rank}`` stands for the rank's number."""
    prefix = str(value).strip()
    words = prefix.replace("{rank}", "0").split(".")
    if not all(re.fullmatch(r"[A-Za-z0-9_-]+", word) for word in words):
        raise ValueError(f"{str(value)!r} is not words of letters, digits, _ and - "
                         "joined by dots ({rank}: the rank's number)")
    return prefix


STATSD = AttrSpec(
    "stats.statsd", "", statsd_address,
    "HOST:PORT of a statsd server each rank sends its figures to (those of "
    "kvbroker stats) once a period, as gauges; empty: FLUX_FRIPP_STATSD's, "
    "or none")
MIN_STATSD_PERIOD = 0.01
"""The shortest ``stats.statsd-period``: each send gathers every module's
stats, and ``0.0001ms`` made a rank send ~6,700 datagrams a second."""


def duration_at_least(minimum: float, why: str) -> Callable[[Any], float]:
    """A parser of durations of at least ``minimum`` seconds: a period a
    rank wakes at, of which a tiny one is a busy loop (``why`` says what
    it would do)."""
    def parse(value: Any) -> float:
        seconds = duration(value)
        if seconds < minimum:
            raise ValueError(f"{value!r} is under {minimum:g}s ({why})")
        return seconds
    return parse


STATSD_PERIOD = AttrSpec(
    "stats.statsd-period", "1",
    duration_at_least(MIN_STATSD_PERIOD, "a rank would gather and send its figures in a "
                      "busy loop"),
    "how often a rank sends the figures that changed to stats.statsd (at least 10ms)")
STATSD_PREFIX = AttrSpec(
    "stats.statsd-prefix", "kvbroker.{rank}", statsd_prefix,
    "what each figure's name starts with; {rank} is the rank (Flux's: flux.{rank})")


RUNTIME_ATTRS = (LOG_LEVEL.name, LOG_RING_LEVEL.name, TORPID_MIN.name, TORPID_MAX.name)
"""The attributes ``kvbroker attr set`` may change on a running rank (as
Flux's ``flux setattr log-stderr-level``); every other one is fixed at start."""

BROKER_ATTRS: tuple[AttrSpec, ...] = (
    ALLOW_GUEST_USER, MAX_GUEST_CONNECTIONS, MAX_GUEST_BYTES, MAX_GUEST_SUBSCRIPTIONS,
    MAX_GUEST_REQUESTS, MAX_GUEST_SERVICES, MODULES, MAX_MESSAGE, CONTENT_HASH, LOG_LEVEL,
    LOG_RING_LEVEL, LOG_RING_SIZE, LOG_TIMESTAMPS, TRANSPORT, LINK_BACKLOG, LINK_MAX_MESSAGE,
    TORPID_MIN, TORPID_MAX, CONNECT_TIMEOUT, IPV6, STATSD, STATSD_PERIOD, STATSD_PREFIX,
    RECOVERY_MODE)


# ---------------------------------------------------------------- checking


LOADED_BY_ATTR: dict[str, str] = {"cron.directory": "cron"}
"""Attributes that, set (not empty) at the start, load a module on rank 0
that ``broker.modules`` does not name: ``-S cron.directory=DIR`` loads
``cron``, which makes the entries of DIR's crontabs, as Flux's rc1 loads
cron and then them.  By name: the core imports no module."""


def module_names(attrs: Mapping[str, Any], rank: int | None = None) -> list[str]:
    """The modules a rank loads as it starts: those ``broker.modules``
    names, in order, then on rank 0 those of :data:`LOADED_BY_ATTR` whose
    attribute is set.  ``rank`` None: every module some rank loads (what a
    launcher finds and checks).  Blanks around a name are not part of it
    (``content, kvs``)."""
    names = [n for n in (item.strip() for item in str(MODULES.value(attrs)).split(",")) if n]
    if rank in (0, None):
        names += [module for attr, module in LOADED_BY_ATTR.items()
                  if str(attrs.get(attr, "")).strip() and module not in names]
    return names


def check(attrs: Mapping[str, Any], specs: Iterable[AttrSpec]) -> dict[str, Any]:
    """The parsed value of each spec (``{name: value}``); :class:`AttrError`
    for the first invalid one."""
    out = {spec.name: spec.value(attrs) for spec in specs}
    if TORPID_MIN.name in out and TORPID_MAX.name in out:
        _check_torpid(out[TORPID_MIN.name], out[TORPID_MAX.name])
    return out


MIN_TORPID = 0.1
"""The smallest ``tbon.torpid_min``, in seconds: a rank runs its torpid
check this often, and 1e-7 kept one at 100% of a CPU."""


def _check_torpid(tmin: float, tmax: float) -> None:
    """``tbon.torpid_min`` and ``tbon.torpid_max`` together: a rank may stay
    silent up to twice ``torpid_min`` before its keepalive leaves (one check
    finds it sent something, the next that it did not), so a
    ``torpid_max`` not above that would mark healthy idle ranks torpid."""
    if tmin < MIN_TORPID:
        raise AttrError(f"{TORPID_MIN.name}: must be at least {MIN_TORPID:g} "
                        "(every rank checks its children, and its parent, this often)")
    if tmax and tmax <= 2 * tmin:
        raise AttrError(f"{TORPID_MAX.name}: {tmax:g} must be 0 (never) or more than twice "
                        f"{TORPID_MIN.name} ({tmin:g}): an idle rank's keepalives may be "
                        "that far apart")


def with_defaults(attrs: MutableMapping[str, Any], specs: Iterable[AttrSpec]) -> None:
    """Check ``specs``' values in ``attrs`` and hold each as it is read
    (:func:`normalize`), then add the default of each one ``attrs`` lacks."""
    specs = tuple(specs)
    check(attrs, specs)
    normalize(attrs, specs)
    for spec in specs:
        attrs.setdefault(spec.name, spec.default)


def normalize(attrs: MutableMapping[str, Any], specs: Iterable[AttrSpec]) -> None:
    """Each of ``specs``' values in ``attrs`` as the rank takes it: a text
    value the way its parser reads it (``'sha1 '`` is ``sha1``, ``DEBUG``
    ``debug``), other text without its surrounding blanks.  The parsers
    forgave the blanks, but the attribute kept them: ``attr get
    content.hash`` read ``sha1 `` and ``kvs restore``, which names blobs by
    it, failed "unsupported content hash"."""
    for spec in specs:
        raw = attrs.get(spec.name)
        if not isinstance(raw, str):
            continue
        parsed = spec.value(attrs)
        attrs[spec.name] = parsed if isinstance(parsed, str) else raw.strip()


def check_instance(attrs: Mapping[str, Any], bootstrap: bool = False) -> None:
    """Check an instance's attributes before any rank starts: the core's, then
    those of each module in ``broker.modules`` that this process can find.  A
    module it cannot find or import is left to the ranks to report (their
    environment, e.g. ``PYTHONPATH``, may differ from the launcher's).
    ``bootstrap``: for ``kvbroker broker``, whose size and fanout are its
    bootstrap file's."""
    check_not_set_by_rank(attrs, bootstrap)
    check(attrs, BROKER_ATTRS)
    known = {spec.name for spec in BROKER_ATTRS} | set(RANK_SET)
    owned = set(CORE_PREFIXES)
    for name in module_names(attrs):
        try:
            cls = plugins.load_module_class(name)
        except (LookupError, ImportError):
            continue
        specs = getattr(cls, "attributes", ())
        check(attrs, specs)
        known.update(spec.name for spec in specs)
        owned.update((f"{name}.", f"{cls.name}."))  # (a module file's name: its class's)
    check_names(attrs, known, owned)


SET_BY_RANK: dict[str, str] = {
    "rank": "", "size": "--size N", "fanout": "--fanout K", "rundir": "--rundir DIR",
    "statedir": "--statedir DIR", "event-loop": "--event-loop NAME", "version": "",
    "local-uri": "", "broker.pid": "", "broker.starttime": "", "hostlist": "",
    "security.owner": "", "config.path": "--config FILE",
}
"""Attributes each rank sets itself, from its options or its own state,
whatever ``-S`` says -- with the option that sets it, if any.  ``-S
statedir=DIR`` (Flux's spelling) was taken and ignored: the instance ran
without a statedir and kept nothing, exit status 0."""


FLUX_SPELLINGS: dict[str, str] = {
    "tbon.fanout": "fanout",
    "tbon.topo": "fanout",
}
"""Flux's names for what kvbroker calls otherwise: ``-S tbon.fanout=2`` met
only "unknown attribute (did you mean tbon.transport?)"."""


FLUX_NOT_BUILT: dict[str, str] = {
    "heartbeat.timeout": (
        "Flux's heartbeat timeout (a rank cutting itself off its parent after "
        "missed beats) is not built here: a silent rank is marked torpid "
        "instead (-S tbon.torpid_max=DURATION), and a rank without a beat "
        "logs a warning after heartbeat.warn_thresh periods"),
    "content.backing-module": (
        "kvbroker has one content store, SQLite, in STATEDIR/content.sqlite (or "
        "the run directory without a statedir): Flux's content-sqlite, taken and "
        "ignored; content-files and content-s3 are not built"),
    "broker.rc2_none": (
        "kvbroker start without a COMMAND runs no program: it serves until "
        "signalled or kvbroker shutdown (so does kvbroker broker's rank 0)"),
    "tbon.tcp_user_timeout": (
        "Flux's bound on unacknowledged TCP data is not built: a peer that "
        "stops answering is lost after ZeroMQ's heartbeat (10 s), and a rank "
        "that sends nothing is marked torpid after tbon.torpid_max"),
    "tbon.prefertcp": (
        "Flux's choice of tcp links on one host; kvbroker's is "
        "-S tbon.transport=tcp (unix and ipc are the others)"),
    "tbon.interface-hint": (
        "Flux's choice of the network interface ranks bind; kvbroker start "
        "binds the loopback (127.0.0.1), and across hosts a bootstrap file's "
        "bind and connect addresses choose (docs/guide.md, Across hosts)"),
    "broker.quorum": (
        "kvbroker start runs its command once every rank is up (Flux's "
        "quorum of all ranks: 0-(size-1), the size, or 0 are taken and "
        "ignored); a smaller quorum is not built: across hosts, rank 0 serves "
        "while ranks below it join late"),
    "broker.quorum-warn": (
        "there is no quorum to wait for past start-up (kvbroker start waits "
        "for every rank, 60 s while they say no progress)"),
    "broker.cleanup-timeout": (
        "kvbroker runs no cleanup scripts; the command's stop is bounded by "
        "start --stop-timeout"),
    "broker.shutdown-warn": (
        "a rank that does not stop is killed after start --rank-stop-timeout "
        "(and named); nothing else is built"),
    "broker.shutdown-timeout": (
        "a rank that does not stop is killed after start --rank-stop-timeout "
        "(and named)"),
    "broker.exit-norestart": (
        "a rank's exit status says whether to restart it (docs/guide.md, the "
        "exit statuses: 3, refused by its parent's keys, is not worth a "
        "restart)"),
}
"""Flux's attributes for what kvbroker does not build, with what it does
instead: ``-S heartbeat.timeout=1m`` met "did you mean heartbeat.period?",
and following that hint would have set the beat to once a minute."""


FLUX_LEVELS = ("error",) * 4 + ("warning", "info", "info", "debug")
"""Flux's numeric (syslog) log levels 0-7, as ``log.level`` names them."""
FLUX_LEVEL_ATTRS = {"log-stderr-level": "log.level", "log-level": "log.ring-level"}
FLUX_RC_ATTRS = ("broker.rc1_path", "broker.rc3_path")


def full_quorum(value: Any, size: int) -> bool:
    """Whether Flux's ``broker.quorum=value`` means every rank of ``size``:
    the size, the idset ``0-(size-1)`` (``0`` at size 1), or ``0`` (Flux's
    compatibility value for "all")."""
    text = str(value).strip()
    everyone = "0" if size == 1 else f"0-{size - 1}"
    return text in (str(size), everyone, "0")


def from_flux(attrs: Mapping[str, Any], size: int | None = None) -> dict[str, Any]:
    """``attrs`` with Flux's own attributes that have a meaning here put in
    kvbroker's terms, so a Flux command line's ``-S`` runs as written:
    ``log-stderr-level=N`` (syslog 0-7) is ``log.level``, ``log-level=N``
    ``log.ring-level`` (kvbroker's own name wins when both are given), and
    an empty ``broker.rc1_path`` / ``broker.rc3_path`` (Flux's tests' "run
    no rc script") is dropped: kvbroker runs none, as are
    ``content.backing-module=content-sqlite`` (the one store here) and a
    ``broker.quorum`` of every rank of ``size`` (what ``start`` waits for).  Anything else of Flux's
    is left to :func:`check_instance`, which names kvbroker's term where
    there is one (:data:`FLUX_SPELLINGS`)."""
    out = dict(attrs)
    if size is not None and "broker.quorum" in out and full_quorum(out["broker.quorum"], size):
        del out["broker.quorum"]  # (what kvbroker start always waits for)
    for flux, ours in FLUX_LEVEL_ATTRS.items():
        if flux not in out:
            continue
        text = str(out.pop(flux)).strip()
        if not (text.isdigit() and int(text) < len(FLUX_LEVELS)):
            raise AttrError(f"{flux}={text}: Flux's level is a number 0-7 (here it sets "
                            f"{ours}, which also takes {', '.join(LOG_LEVELS)})")
        out.setdefault(ours, FLUX_LEVELS[int(text)])
    if str(out.get("content.backing-module", "")).strip() == "content-sqlite":
        del out["content.backing-module"]  # (Flux's default: the one store here)
    for name in FLUX_RC_ATTRS:
        if name in out:
            if str(out[name]) != "":
                raise AttrError(f"{name}: kvbroker runs no rc scripts; only an empty "
                                f"value is taken (as Flux's -S{name}=)")
            del out[name]
    return out


def unknown_message(name: str, known: Iterable[str] = ()) -> str:
    """``unknown attribute 'NAME'``, saying kvbroker's name for one of
    Flux's (:data:`FLUX_SPELLINGS`), or the closest of ``known`` (a running
    rank's: ``kvs.checkpoint_period`` -> did you mean kvs.checkpoint-period?,
    as ``-S`` says)."""
    ours = FLUX_SPELLINGS.get(name)
    if ours is None:
        close = difflib.get_close_matches(name, list(known), n=1)
        return f"unknown attribute {name!r}" + (f" (did you mean {close[0]}?)" if close
                                                 else "")
    return (f"unknown attribute {name!r}: Flux's name; kvbroker's is {ours!r} "
            f"({how_to_set(ours)})")


def how_to_set(name: str) -> str:
    """What to tell someone who tries to set attribute ``name`` on a running
    rank (``attr set``) or with ``-S``: the option that sets it at start, or
    that it is the rank's own."""
    if name in SET_BY_RANK:
        option = SET_BY_RANK[name]
        return f"set it at start with {option}" if option else "each rank sets it itself"
    return f"set it at start: -S {name}=VALUE"


SET_BY_BOOTSTRAP: dict[str, str] = {
    "size": "the number of ranks its hosts list", "fanout": "its fanout key",
    "hostlist": "its hosts list",
}
"""Attributes ``kvbroker broker`` takes from its bootstrap file, not from
``start``'s options, which it does not have."""


def check_not_set_by_rank(attrs: Iterable[str], bootstrap: bool = False) -> None:
    """:class:`AttrError` for ``-S`` naming an attribute a rank sets itself,
    saying what sets it (``start``'s option; with ``bootstrap``, for
    ``kvbroker broker``, the bootstrap file's key)."""
    for name in attrs:
        if name in SET_BY_RANK:
            option = SET_BY_RANK[name]
            if bootstrap and name in SET_BY_BOOTSTRAP:
                raise AttrError(f"{name} cannot be set with -S or [attrs]: the bootstrap "
                                f"file sets it ({SET_BY_BOOTSTRAP[name]})")
            raise AttrError(f"{name} cannot be set with -S: "
                            + (f"use {option}" if option else "each rank sets it itself"))


CORE_PREFIXES = ("access.", "broker.", "content.", "log.", "tbon.")
"""Attribute prefixes the core owns; each loaded module owns ``<name>.``."""
RANK_SET = ("broker.pid", "broker.starttime")
"""Attributes in an owned prefix that a rank sets itself."""


def check_names(attrs: Mapping[str, Any], known: set[str], owned: Iterable[str]) -> None:
    """:class:`AttrError` for a name in a prefix the core or a module owns that
    nobody declares: a typo (``kvs.checkpoint_period``) was kept and
    ignored, so a durability setting silently did not apply.  Names outside
    those prefixes (``my.attr``) stay free, as in Flux."""
    prefixes = tuple(owned)
    for name in attrs:
        if name in FLUX_SPELLINGS:
            ours = FLUX_SPELLINGS[name]
            raise AttrError(f"{name} is Flux's name: kvbroker's is {ours}, "
                            f"{how_to_set(ours)} (a bootstrap file: its {ours} key)")
        if name in FLUX_NOT_BUILT:
            raise AttrError(f"{name}: {FLUX_NOT_BUILT[name]}")
        if name.startswith(prefixes) and name not in known:
            # (never one a rank sets itself: -S refuses it in turn)
            settable = sorted(k for k in known if k not in SET_BY_RANK)
            close = difflib.get_close_matches(name, settable, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise AttrError(f"{name}: unknown attribute{hint}")


def rank_hostname(attrs: Mapping[str, Any]) -> str:
    """The host name a rank goes by (its entry, its hello, its ``hostname``
    attribute): ``-S hostname=NAME`` if given (as Flux's, to try a
    multi-host set-up on one machine), else this host's."""
    import socket

    return str(attrs.get("hostname") or socket.gethostname())
