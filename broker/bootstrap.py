"""An instance across hosts: the bootstrap file every rank reads.

``kvbroker start`` runs all ranks of an instance on one host.  To spread
them over several hosts, each host runs its own rank(s) with
``kvbroker broker --config FILE``, and every rank reads the same TOML file
(after Flux's ``[bootstrap]`` table)::

    [bootstrap]
    curve_cert = "/etc/kvbroker/curve.key"   # `kvbroker keygen`, copied to every host
    fanout = 2                               # optional (default 32)
    default_port = 8050                      # optional: %p (without it, %p is the rank)
                                             # (then write it after digits: 90%p)
    enable_ipv6 = false                      # optional: tbon.ipv6
    default_bind = "tcp://*:%p"              # optional; %h = the entry's host
    default_connect = "tcp://%h:%p"
    hosts = [
        { host = "node0" },
        { host = "node1" },
        { host = "node2", bind = "tcp://eth1:9000", connect = "tcp://10.0.0.2:9000" },
        { host = "node[3-9]" },              # a host list: one entry (rank) per name
    ]

    [attrs]                                  # optional instance attributes (as -S)
    "kvs.setroot-blob-limit" = 65536

A rank's number is its entry's index in ``hosts`` once host lists are
expanded (Flux's compact hosts); the instance's size is the number of
entries.  No ``hosts`` (or an empty list) is one rank on its own, as Flux's
standalone instance: one rank has no links, so no ``curve_cert`` either.
A rank with children binds ``bind`` and its children connect to
``connect``; leaves need neither.  The overlay is ZeroMQ over
``tcp://`` with CURVE: only processes holding the key pair in ``curve_cert``
are admitted (docs/protocol.md, CURVE on tcp://).  This module only reads and checks the
file; :mod:`broker.cli` runs the rank.
"""

from __future__ import annotations

import decimal
import ipaddress
import os
import re
import socket
import stat
import tomllib
from dataclasses import dataclass, field
from typing import Any

from broker import hostlist, jsontoml, topology

DEFAULT_FANOUT = 32
"""As ``kvbroker start --fanout``."""


class BootstrapError(ValueError):
    """The bootstrap file is missing, unreadable or inconsistent; the message says where."""


@dataclass(frozen=True)
class HostEntry:
    """One rank's line of ``hosts``: where it runs and where its children reach it."""

    host: str
    bind: str | None = None
    connect: str | None = None


@dataclass(frozen=True)
class Bootstrap:
    """A parsed, checked bootstrap file."""

    path: str
    curve_cert: str | None
    """None only for an instance of one rank: it has no links to secure."""
    fanout: int
    hosts: tuple[HostEntry, ...]
    """Empty for a standalone rank (no ``hosts``, as Flux's): rank 0 alone,
    on whatever host runs it."""
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.hosts) or 1

    def has_children(self, rank: int) -> bool:
        return bool(topology.children_of(rank, self.fanout, self.size))

    def endpoints(self) -> dict[int, str]:
        """The ``connect`` endpoint of every rank with children (what its
        children dial)."""
        return {r: e.connect for r, e in enumerate(self.hosts)
                if self.has_children(r) and e.connect}

    def bind_endpoint(self, rank: int) -> str | None:
        """What ``rank`` binds for its children (None for a leaf)."""
        return self.hosts[rank].bind if self.has_children(rank) else None

    def hostnames(self, this_host: str = "") -> list[str]:
        """Each rank's ``host``, by rank (the ``hostlist`` attribute); a
        standalone rank's is ``this_host``."""
        return [e.host for e in self.hosts] or [this_host]

    def rank_of(self, hostname: str | None = None) -> int:
        """The rank whose entry names this host (:func:`ranks_on`).  Raises
        :class:`BootstrapError` when none or several match: several ranks on
        one host need ``--rank``."""
        name = hostname or socket.gethostname()
        if not self.hosts:
            return 0
        ranks = ranks_on(self.hostnames(), name)
        if not ranks:
            raise BootstrapError(f"{self.path}: no hosts entry for this host ({name}); "
                                 "give --rank")
        if len(ranks) > 1:
            raise BootstrapError(f"{self.path}: ranks {', '.join(map(str, ranks))} all run "
                                 f"on {name}; give --rank")
        return ranks[0]


def ranks_on(hosts: list[str], hostname: str) -> list[int]:
    """The ranks whose ``hosts`` entry names host ``hostname``: by its full
    name, else by the short one (``node0`` and ``node0.example.org`` are the
    same host then), ignoring case (DNS does)."""
    ranks = [r for r, h in enumerate(hosts) if h.lower() == hostname.lower()]
    if not ranks:
        short = _short(hostname)
        ranks = [r for r, h in enumerate(hosts) if _short(h) == short]
    return ranks


def judged_by_name(host: str) -> bool:
    """Whether a host can be told from another by its name: not an IP
    address literal (``10.0.0.2``, ``::1``, ``[::1]``) nor ``localhost``
    (or ``localhost.localdomain``), which name no one host."""
    if not host or _short(host) == "localhost":
        return False
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]")
                             else host)
    except ValueError:
        return True
    return False


def wrong_host(hosts: list[str], rank: int, hostname: str) -> bool:
    """Whether a process that says it runs on ``hostname`` is not on the
    host that entry ``rank`` of ``hosts`` names, as :meth:`Bootstrap.rank_of`
    finds ranks (:func:`ranks_on`).  False -- not judged -- when that entry
    or ``hostname`` cannot be told from another host by name
    (:func:`judged_by_name`): an address, ``localhost``, or nothing."""
    if not 0 <= rank < len(hosts):
        return False
    if not (judged_by_name(hosts[rank]) and judged_by_name(hostname)):
        return False
    return rank not in ranks_on(hosts, hostname)


def _short(hostname: str) -> str:
    return hostname.split(".", 1)[0].lower()


def _same_host(host: str) -> str:
    """``host`` as one machine's name, for the check that two ranks with
    children do not bind one endpoint there: as :func:`ranks_on` takes
    names, ``a``, ``A`` and ``a.example.org`` are one (it compared the
    text, and let them through to fail at bind); an address is itself."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return _short(host)


def _expand(template: str, host: str, rank: int, port: int | None) -> str:
    """An endpoint of entry ``rank``: ``%h`` its host, ``%p`` the file's
    ``default_port`` (Flux's meaning), or without one the rank (so that
    ranks sharing a host on one machine get ports of their own)."""
    # (one pass: a %p or %h inside the host's own name is left as it is --
    # substituted in turn, host a%p connected to tcp://a0:900)
    value = str(rank if port is None else port)
    return re.sub(r"%[hp]", lambda m: host if m.group(0) == "%h" else value, template)


def _host_names(host: str, where: str) -> list[str]:
    """The hosts an entry's ``host`` names: a host list as Flux's compact
    hosts (RFC 29: ``node[1-1023]``, ``a,b``) makes one entry per name, in
    order; an address literal in brackets (``[::1]``) is one host."""
    if "," in host or "[" in host and judged_by_name(host):
        try:
            names = hostlist.expand(host)
        except ValueError as exc:
            raise BootstrapError(f"{where}: host {host!r} is not a host list: {exc}") from None
    else:
        names = [host]
    for name in names:
        if re.search(r"[\s\[\]]", name) and judged_by_name(name):
            raise BootstrapError(f"{where}: host {name!r} is not a host name (no spaces, "
                                 "and brackets only around a host list's numbers)")
    return names


def _str(table: dict[str, Any], key: str, where: str) -> str | None:
    value = table.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise BootstrapError(f"{where}: {key} must be a non-empty string")
    return value


def parse(text: str, path: str = "<bootstrap>") -> Bootstrap:
    """Parse and check a bootstrap file's text; relative ``curve_cert`` paths
    are taken from the file's directory."""
    try:
        doc = jsontoml.loads_toml(text)
    except tomllib.TOMLDecodeError as exc:
        raise BootstrapError(f"{path}: {exc}") from None
    boot = doc.get("bootstrap", {})  # (none: one rank on its own, as Flux's empty file)
    if not isinstance(boot, dict):
        raise BootstrapError(f"{path}: bootstrap must be a table ([bootstrap])")
    _only_tables(doc, path, ("bootstrap", "attrs"), "a bootstrap file holds [bootstrap] and "
                 "[attrs]")
    unknown = set(boot) - {"curve_cert", "fanout", "default_port", "default_bind",
                           "default_connect", "hosts", "enable_ipv6"}
    if unknown:
        raise BootstrapError(f"{path}: unknown bootstrap key(s): {', '.join(sorted(unknown))}")
    cert = _str(boot, "curve_cert", path)
    if cert is not None:
        cert = os.path.join(os.path.dirname(os.path.abspath(path)), cert)
    fanout = boot.get("fanout", DEFAULT_FANOUT)
    if type(fanout) is not int or fanout < 1:
        raise BootstrapError(f"{path}: bootstrap.fanout must be an integer >= 1")
    ipv6 = boot.get("enable_ipv6")
    if ipv6 is not None and type(ipv6) is not bool:
        raise BootstrapError(f"{path}: bootstrap.enable_ipv6 must be true or false")
    port = boot.get("default_port")
    if port is not None and (type(port) is not int or not 0 < port < 65536):
        raise BootstrapError(f"{path}: bootstrap.default_port must be a port number "
                             "(1-65535)")
    default_bind = _str(boot, "default_bind", path)
    default_connect = _str(boot, "default_connect", path)
    raw_hosts = boot.get("hosts", [])
    if not isinstance(raw_hosts, list):
        raise BootstrapError(f"{path}: bootstrap.hosts must be a list of host entries "
                             "(none, or empty: one rank on its own, as Flux's)")
    entries: list[HostEntry] = []
    labels: list[str] = []  # (what an error calls each rank's entry)
    templates: list[tuple[str | None, str | None]] = []  # (each one's bind and connect)
    for index, raw in enumerate(raw_hosts):
        where = f"{path}: hosts[{index}]"
        if not isinstance(raw, dict):
            raise BootstrapError(f"{where}: expected a table like {{ host = \"node0\" }}")
        extra = set(raw) - {"host", "bind", "connect"}
        if extra:
            hint = ("; the tree is k-ary here, shaped by bootstrap.fanout (Flux's per-host "
                    "parent is not built)" if "parent" in extra else "")
            raise BootstrapError(f"{where}: unknown key(s): {', '.join(sorted(extra))}{hint}")
        given = _str(raw, "host", where)
        if given is None:
            raise BootstrapError(f"{where}: host is required")
        names = _host_names(given, where)
        bind_t = _str(raw, "bind", where) or default_bind
        connect_t = _str(raw, "connect", where) or default_connect
        for host in names:
            if len(entries) >= hostlist.MAX_HOSTS:
                raise BootstrapError(f"{where}: more than {hostlist.MAX_HOSTS:,} ranks")
            rank = len(entries)
            labels.append(f"hosts[{index}]" if len(names) == 1 else
                          f"hosts[{index}] {host} (rank {rank})")
            templates.append((bind_t, connect_t))
            entries.append(HostEntry(host, bind_t and _expand(bind_t, host, rank, port),
                                     connect_t and _expand(connect_t, host, rank, port)))
    attrs = _with_ipv6(boot, _attrs_table(doc, path))
    if cert is None and len(entries) > 1:
        raise BootstrapError(f"{path}: bootstrap.curve_cert is required for more than one "
                             "rank (create it with 'kvbroker keygen FILE'; a tcp overlay "
                             "is never unauthenticated)")
    result = Bootstrap(path, cert, fanout, tuple(entries), dict(attrs))
    # Two ranks with children may not share an endpoint: found here, not as
    # "Address already in use" (or a hello to the wrong rank) at start-up.
    taken: dict[tuple[str, str, str], int] = {}
    for rank, entry in enumerate(entries):
        if not result.has_children(rank):
            continue
        label = labels[rank]
        for key in ("bind", "connect"):
            value = getattr(entry, key)
            if value is None:
                raise BootstrapError(f"{path}: {label} ({entry.host}) has children "
                                     f"and needs {key} (or bootstrap.default_{key})")
            if not value.startswith("tcp://"):
                raise BootstrapError(f"{path}: {label}.{key} must be a tcp:// "
                                     f"endpoint, not {value!r}")
            _check_port(value, f"{path}: {label}.{key}", port is None and "%p" in (
                templates[rank][0 if key == "bind" else 1] or ""))
            # a bind is per host; a connect names a place for everyone
            spot = (key, _same_host(entry.host) if key == "bind" else "", value)
            if spot in taken:
                raise BootstrapError(f"{path}: {label}.{key} {value!r} is also "
                                     f"{labels[taken[spot]]}'s: each rank with children "
                                     "needs its own")
            taken[spot] = rank
    return result


def _with_ipv6(boot: dict[str, Any], attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with ``tbon.ipv6`` from ``bootstrap.enable_ipv6`` (Flux's
    key for it) unless ``[attrs]`` says otherwise."""
    ipv6 = boot.get("enable_ipv6")
    return attrs if ipv6 is None else {"tbon.ipv6": attr_text(ipv6), **attrs}


def loaded_attrs(doc: dict[str, Any], where: str, boot: dict[str, Any] | None,
                 base: str | None) -> dict[str, Any]:
    """``config load``: the ``[attrs]`` of an object given to a running
    rank in place of its file's, checked as the file is -- ``[attrs]``
    only, or beside ``boot``, the rank's own ``[bootstrap]`` (None: it
    started without one), which must come back unchanged: the instance's
    shape is fixed once it runs.  ``statedir`` and ``rundir`` given
    relative are taken from ``base``, the directory of the rank's file, as
    in the file (so that ``config get``'s object loads back as it is)."""
    if doc.get("bootstrap") != boot:
        raise BootstrapError(f"{where}: [bootstrap] may not be changed on a running rank: "
                             + ("give the rank's own, as config get shows it" if boot
                                is not None else "this rank was not started from a "
                                "bootstrap file"))
    if boot is not None:
        _only_tables(doc, where, ("bootstrap", "attrs"), "a bootstrap file holds "
                     "[bootstrap] and [attrs]")
        return _with_ipv6(boot, _attrs_table(doc, where))
    _only_tables(doc, where, ("attrs",), "a rank's configuration holds [attrs]")
    attrs = _attrs_table(doc, where)
    for name in ("statedir", "rundir"):
        if base is not None and isinstance(attrs.get(name), str) and attrs[name]:
            attrs[name] = os.path.join(base, os.path.expanduser(attrs[name]))
    return attrs


def _check_port(endpoint: str, what: str, rank_port: bool) -> None:
    """Refuse ``endpoint`` (a rank's bind or connect) unless it ends in a
    port number, 1-65535: ZeroMQ takes 0 and ``*`` (a port the system
    picks, which no child could know) and wraps a bigger number, so the
    instance never came up, saying nothing at once.  ``rank_port``: it
    came from ``%p`` without ``default_port``, where ``%p`` is the rank."""
    m = re.fullmatch(r"tcp://(.+):(\d+|\*)", endpoint)
    if m is None:
        raise BootstrapError(f"{what} {endpoint!r} needs a port (tcp://HOST:PORT)")
    host = m[1]
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        # (ZeroMQ took tcp://::1:90 as the host "::1" only when it bound,
        # failing "No such device" with the rank exiting 1)
        raise BootstrapError(f"{what} {endpoint!r}: an IPv6 address goes in brackets "
                             f"(tcp://[{host}]:{m[2]})")
    if m[2] == "*":
        raise BootstrapError(f"{what} {endpoint!r}: a rank with children needs a fixed "
                             "port (* lets the system pick one, which no child could know)")
    if not 0 < int(m[2]) < 65536:
        hint = (" (without bootstrap.default_port, %p is the rank: give default_port, "
                "or write it after digits, as 90%p)") if rank_port else ""
        raise BootstrapError(f"{what} {endpoint!r}: port {m[2]} is not a port number "
                             f"(1-65535){hint}")


def _only_tables(doc: dict[str, Any], path: str, allowed: tuple[str, ...],
                 holds: str) -> None:
    """Refuse a table or key of ``doc`` outside ``allowed``, saying where
    attributes go: a Flux config's ``[access]`` or ``[kvs]`` table was
    ignored without a word, its settings not in effect."""
    other = set(doc) - set(allowed)
    if other:
        first = sorted(other)[0]
        table = doc[first]
        example = (f" (as \"{first}.{next(iter(table))}\" = ...)"
                   if isinstance(table, dict) and table else "")
        raise BootstrapError(f"{path}: unknown table(s) or key(s): {', '.join(sorted(other))}: "
                             f"{holds}; broker attributes go in [attrs]{example}")


def _attrs_table(doc: dict[str, Any], path: str) -> dict[str, Any]:
    """The file's ``[attrs]``, as dotted names (:func:`_dotted`)."""
    attrs = doc.get("attrs", {})
    if not isinstance(attrs, dict):
        raise BootstrapError(f"{path}: [attrs] must be a table")
    return _dotted(attrs, f"{path}: [attrs]")


MAX_FILE_BYTES = 16 << 20
"""A configuration or bootstrap file is read up to this many bytes: a
device that never ends (``--config /dev/zero``) filled the memory of
``start`` until it was killed."""

def read_limited(f: Any) -> bytes | None:
    """All of binary file ``f``, or None past :data:`MAX_FILE_BYTES`."""
    data: bytes = f.read(MAX_FILE_BYTES + 1)
    return None if len(data) > MAX_FILE_BYTES else data


_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR:
          "a character device", stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"}


def _read(path: str, regular_only: bool = False) -> str:
    """The file's text.  ``regular_only``: a rank reading it on its event
    loop (as it starts, at ``config reload``), where opening a FIFO waited
    for a writer and the rank answered nothing meanwhile: another kind of
    file is refused, without waiting (``O_NONBLOCK``) -- but for the null
    device, read as it reads, empty (Flux's ``--config-path=/dev/null``,
    "no configuration": each start warned of it)."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_NONBLOCK if regular_only else 0)
    try:
        fd = os.open(path, flags)
        with open(fd, "rb") as f:
            st = os.fstat(fd)
            mode = st.st_mode
            if regular_only and _is_null_device(st):
                return ""
            if regular_only and not stat.S_ISREG(mode):
                kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
                raise BootstrapError(f"{path}: not a regular file ({kind}): a rank reads "
                                     "its configuration file again, and would wait on it")
            data = read_limited(f)
            if data is None:
                raise BootstrapError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB: not a "
                                     "configuration file")
            return data.decode()
    except OSError as exc:
        raise BootstrapError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise BootstrapError(f"{path}: not UTF-8 text") from None


def _is_null_device(st: os.stat_result) -> bool:
    """Whether ``st`` is the null device's (what ``os.devnull`` names)."""
    if not stat.S_ISCHR(st.st_mode):
        return False
    try:
        null = os.stat(os.devnull)
    except OSError:
        return False
    return stat.S_ISCHR(null.st_mode) and null.st_rdev == st.st_rdev


def load(path: str) -> Bootstrap:
    """Read and check the bootstrap file at ``path``."""
    return parse(_read(path), path)


def check_file_attrs(path: str, attrs: dict[str, Any], size: int,
                     bootstrap: bool = False) -> None:
    """A file's ``[attrs]`` (``start --config``, ``Instance(config_file=)``,
    a bootstrap file) checked on their own, before ``-S`` joins them: a bad
    one that ``-S`` fixes on this host fails on the next.
    :class:`BootstrapError` naming the file."""
    from broker import attrs as battrs

    try:
        battrs.check_instance(battrs.from_flux(dict(attrs), size), bootstrap=bootstrap)
    except battrs.AttrError as exc:
        raise BootstrapError(f"{path}: [attrs] {exc}") from None


def load_start_attrs(path: str, size: int) -> dict[str, Any]:
    """``start --config FILE`` (and ``Instance(config_file=)``): the file's
    ``[attrs]`` (:func:`load_attrs`), checked on their own
    (:func:`check_file_attrs`) but for ``statedir`` and ``rundir``, which
    are start's options."""
    attrs = load_attrs(path)
    check_file_attrs(path, {k: v for k, v in attrs.items() if k not in ("statedir", "rundir")},
                     size)
    return attrs


def load_attrs(path: str) -> dict[str, Any]:
    """``kvbroker start --config FILE``: the broker attributes of a TOML
    file's ``[attrs]``, as a bootstrap file gives them (dotted names; an
    attribute twice, or a value no attribute takes, refused naming it).
    ``statedir`` and ``rundir`` there (Flux's spellings of the options)
    are taken from the file's directory when relative, as ``curve_cert``
    is.  Not checked here: :func:`broker.attrs.check_instance` does."""
    try:
        doc = jsontoml.loads_toml(_read(path))
    except tomllib.TOMLDecodeError as exc:
        raise BootstrapError(f"{path}: {exc}") from None
    if "bootstrap" in doc:
        raise BootstrapError(f"{path}: [bootstrap] is kvbroker broker's (one rank of an "
                             "instance across hosts): the file of kvbroker start holds "
                             "[attrs] only")
    return _start_attrs(doc, path)


def config_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rank's configuration file, read once (``config get|reload``):
    its whole object, and its ``[attrs]`` as the start took them -- a
    bootstrap file's (``[bootstrap]`` in it) or ``start --config``'s."""
    text = _read(path, regular_only=True)
    try:
        doc = jsontoml.loads_toml(text)
    except tomllib.TOMLDecodeError as exc:
        raise BootstrapError(f"{path}: {exc}") from None
    attrs = parse(text, path).attrs if "bootstrap" in doc else _start_attrs(doc, path)
    return doc, attrs


def _start_attrs(doc: dict[str, Any], path: str) -> dict[str, Any]:
    """:func:`load_attrs` of a parsed file."""
    _only_tables(doc, path, ("attrs",), "the file of kvbroker start holds [attrs]")
    attrs = _attrs_table(doc, path)
    here = os.path.dirname(os.path.abspath(path))
    table = doc.get("attrs")
    for name in ("statedir", "rundir"):
        if name not in attrs:
            continue
        given = table.get(name) if isinstance(table, dict) else None
        if not isinstance(given, str) or not given:
            # (a number or true was taken as a path, relative to the current
            # directory or as the text "true": refused, as a path it is not)
            raise BootstrapError(f"{path}: attrs.{name} must be a directory's path (a "
                                 f"non-empty string), not {given!r}")
        attrs[name] = os.path.join(here, os.path.expanduser(given))
    return attrs


def _dotted(table: dict[str, Any], where: str, prefix: str = "",
            out: dict[str, Any] | None = None) -> dict[str, Any]:
    """``[attrs]`` with its nested tables as dotted names: TOML reads an
    unquoted dotted key (``tbon.torpid_min = 1``, as Flux's files write
    them) as a table ``tbon`` holding ``torpid_min``, and such a table was
    taken as one attribute named ``tbon``, unchecked and ignored: the
    setting did not apply, and a bad value was not refused.  A name given
    twice (``log.level`` and ``"log.level"``: TOML lets both through) and a
    value that is no attribute's (a date, a list) are refused, naming them
    (``where``): one was dropped silently, the other stopped the rank with
    a traceback."""
    out = {} if out is None else out
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _dotted(value, where, name + ".", out)
            continue
        if name in out:
            raise BootstrapError(f"{where}: {name} is given twice (as a dotted key and a "
                                 "quoted one?): give it once")
        if not isinstance(value, str | int | float):  # (bool is an int)
            kind = "a null" if value is None else _FILE_TYPES.get(
                type(value).__name__, f"a {type(value).__name__}")
            raise BootstrapError(f"{where}: {name}: {kind} is not an "
                                 "attribute value (a string, a number, true or false)")
        out[name] = attr_text(value)
    return out


_FILE_TYPES = {"list": "an array", "datetime": "a date-time", "date": "a date",
               "time": "a time"}
"""The TOML/JSON names of what a value that is no attribute's was read as
(a NoneType was named to the user)."""


def attr_text(value: str | int | float) -> str | int | float:
    """A file's attribute value as ``-S`` would give it where the two
    differ: a TOML ``true``/``false`` is the text ``true``/``false`` (it
    read back as Python's ``True`` in ``attr get`` and ``attr list``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and "e" in repr(value):
        # (as written, not as Python prints it: 0.0000001 is 1e-07, which no
        # attribute parser takes, and the error showed a value nobody wrote)
        return format(decimal.Decimal(repr(value)), "f")
    return value
