"""Finding the URI of a running instance (``kvbroker uri``, Flux's ``flux uri``).

A client attaches to a rank by its URI (``local:///RUNDIR/local-RANK``, or
``ssh://host/RUNDIR/local-RANK`` from another host), which ``kvbroker start``
prints and sets as ``KVBROKER_URI`` for the command it runs.  A shell that
was not started inside the instance -- another terminal, a monitoring
script -- has to find it.  :func:`resolve` turns a *target* into that URI:

* ``local:///path`` and ``ssh://[user@]host[:port]/path``: already URIs,
  returned as they are (or in the other form, below); an absolute path to a
  socket is taken as ``local://`` (``KVBROKER_URI`` takes either);
* ``pid:PID``: the instance process PID belongs to, as Flux's ``pid``
  resolver.  A rank answers with its own socket (the Unix socket it listens
  on, found through ``/proc/PID/fd`` and ``/proc/net/unix``, since a rank's
  environment names the instance *around* it, if any); ``kvbroker start``
  (and its spawner) with rank 0's socket, the lowest-numbered rank among
  its descendants, since its own environment names the instance it was
  started *in*; any other process with the ``KVBROKER_URI`` of its
  environment (``/proc/PID/environ``: as it was when the process started);
* ``rank:N`` (kvbroker's own): rank N of the current instance
  (``KVBROKER_URI``), asked for its ``local-uri`` through the tree, so a
  program can attach to a given rank without ``kvbroker exec``;
* ``.``: the current instance's URI, as Flux's ``.``.

Any target takes ``?local`` or ``?remote`` (as Flux's): the ``local://``
form, or the ``ssh://`` form naming this host (for ``rank:N``, rank N's
host), for a client elsewhere.
``KVBROKER_URI_RESOLVE_LOCAL`` set (to anything but empty) makes every
answer local, as Flux's ``FLUX_URI_RESOLVE_LOCAL`` does.

Flux's ``jobid``, ``slurm`` and ``lsf`` resolvers have no counterpart: a
kvbroker instance is not a job of another.  Reading another user's
``/proc/PID`` is refused by the kernel, and said so.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from broker.errors import ErrnoError
from broker.handle import URI_ENV
from broker.message import NODEID_ANY

RESOLVE_LOCAL_ENV = "KVBROKER_URI_RESOLVE_LOCAL"
"""Set (not empty): every URI :func:`resolve` returns is in ``local://`` form."""

SCHEMES = {
    "local": "local:///PATH: a URI already (also an absolute PATH to a socket)",
    "ssh": "ssh://[USER@]HOST[:PORT]/PATH: a URI already",
    "pid": "pid:PID: the instance process PID is in (a rank's own; kvbroker start's "
           "rank 0)",
    "rank": "rank:N: rank N of the current instance ($KVBROKER_URI)",
    ".": ".: the current instance ($KVBROKER_URI)",
}
"""The targets :func:`resolve` takes, as ``kvbroker uri --help`` lists them."""

_RANK_SOCKET = re.compile(r"local-(\d+)")
_LISTENING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags column


class ResolveError(ValueError):
    """The target names no URI (the message says why)."""


class NotUpYet(ResolveError):
    """``kvbroker start`` whose ranks do not listen yet: ``--wait`` asks again."""


class ProcessGone(ResolveError):
    """No such process: none by that pid, or it exited while it was read
    (its ``/proc`` files then fail ``ENOENT``, or ``ESRCH`` for a zombie)."""


_GONE = (errno.ENOENT, errno.ESRCH)


def parse_query(target: str) -> tuple[str, str | None, bool]:
    """``pid:12?local&wait`` -> ``("pid:12", "local", True)``: the form
    asked for (None: as resolved) and whether to wait (Flux's ``?wait``)."""
    base, sep, query = target.partition("?")
    if not sep:
        return target, None, False
    words = [w for w in query.split("&") if w]
    if not words or any(w not in ("local", "remote", "wait") for w in words):
        raise ResolveError(f"{target}: unknown query {query!r} (?local, ?remote, ?wait)"
                           if words else f"{target}: an empty query")
    forms = {w for w in words if w != "wait"}
    if len(forms) > 1:
        raise ResolveError(f"{target}: ?local and ?remote cannot both be asked")
    return base, (forms.pop() if forms else None), "wait" in words


def to_local(uri: str) -> str:
    """The ``local://`` form of ``uri`` (an ``ssh://`` URI's path; the
    socket is on that host, which may not be this one)."""
    if uri.startswith("ssh://"):
        from broker.ssh import parse

        return f"local://{parse(uri).path}"
    if uri.startswith("local://"):
        return uri
    if uri.startswith("/"):
        return f"local://{uri}"
    raise ResolveError(f"{uri}: not a local:// or ssh:// URI")


def to_remote(uri: str, host: str | None = None) -> str:
    """The ``ssh://`` form of ``uri``: ``local:///p`` -> ``ssh://HOST/p``
    with this host's name (an ``ssh://`` URI is returned as it is)."""
    if uri.startswith("ssh://"):
        return uri
    path = to_local(uri)[len("local://"):]
    return f"ssh://{host or socket.gethostname()}{path}"


def listening_rank_sockets(proc: str = "/proc") -> dict[int, tuple[int, str]]:
    """The Unix sockets listening on this host (in this network namespace)
    whose name is a rank's (``.../local-N``): ``{inode: (N, path)}``."""
    found: dict[int, tuple[int, str]] = {}
    with open(os.path.join(proc, "net", "unix"), encoding="utf-8",
              errors="surrogateescape") as table:
        next(table, None)  # the header
        for line in table:
            fields = line.rstrip("\n").split(None, 7)
            if len(fields) < 8 or not fields[7].startswith("/"):
                continue  # unnamed or abstract
            try:
                flags, inode = int(fields[3], 16), int(fields[6])
            except ValueError:
                continue
            named = _RANK_SOCKET.fullmatch(os.path.basename(fields[7]))
            if flags & _LISTENING and named:
                found[inode] = (int(named.group(1)), fields[7])
    return found


def _socket_inodes(pid: int, proc: str) -> set[int]:
    """The inodes of the sockets ``pid`` holds open (empty if it is gone
    or another user's)."""
    inodes: set[int] = set()
    fd_dir = os.path.join(proc, str(pid), "fd")
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def rank_socket(pid: int, proc: str = "/proc",
                sockets: dict[int, tuple[int, str]] | None = None) -> tuple[int, str] | None:
    """``(rank, path)`` of the rank socket ``pid`` listens on, if it is a rank."""
    table = listening_rank_sockets(proc) if sockets is None else sockets
    held = [table[i] for i in _socket_inodes(pid, proc) if i in table]
    return min(held) if held else None


def children(pid: int, proc: str = "/proc") -> list[int]:
    """``pid``'s child processes: from ``/proc/PID/task/*/children`` where
    the kernel has it, else by each process's parent in ``/proc/*/stat``."""
    kids: list[int] = []
    task_dir = os.path.join(proc, str(pid), "task")
    try:
        tasks = os.listdir(task_dir)
    except OSError:
        return kids
    try:
        for task in tasks:
            with open(os.path.join(task_dir, task, "children")) as f:
                kids.extend(int(w) for w in f.read().split())
        return kids
    except FileNotFoundError:
        return children_by_parent(pid, proc)  # (a kernel without CONFIG_PROC_CHILDREN)
    except OSError:
        return kids


def children_by_parent(pid: int, proc: str = "/proc") -> list[int]:
    """``pid``'s child processes, found by each process's parent (the
    fourth field of ``/proc/*/stat``): slower, but any kernel has it."""
    kids: list[int] = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat")) as f:
                stat = f.read()
        except OSError:
            continue  # (gone meanwhile)
        after = stat[stat.rfind(")") + 2:].split()  # (the command may hold ") ")
        if len(after) > 1 and after[1] == str(pid):
            kids.append(int(name))
    return kids


def _cmdline(pid: int, proc: str) -> list[str]:
    with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
        return [os.fsdecode(w) for w in f.read().split(b"\0") if w]


def starts_instances(argv: list[str]) -> bool:
    """Whether a command line is ``kvbroker start`` (its global
    ``--event-loop`` allowed before ``start``) or the spawner that forks
    its ranks (``python -P -m broker.spawner RUNDIR``)."""
    for i, word in enumerate(argv):
        if word == "-m" and argv[i + 1:i + 2] == ["broker.spawner"]:
            return True
        if os.path.basename(word) == "kvbroker" or (word == "-m" and
                                                    argv[i + 1:i + 2] == ["broker.cli"]):
            rest = iter(argv[i + (1 if word != "-m" else 2):])
            for arg in rest:
                if arg == "--event-loop":
                    next(rest, None)
                elif not arg.startswith("-"):
                    return arg == "start"
            return False
    return False


def _environ_uri(pid: int, proc: str) -> str | None:
    with open(os.path.join(proc, str(pid), "environ"), "rb") as f:
        for entry in f.read().split(b"\0"):
            name, sep, value = entry.partition(b"=")
            if sep and name == URI_ENV.encode():
                return os.fsdecode(value) or None
    return None


def pid_uri(pid: int, proc: str = "/proc") -> str:
    """The URI of the instance process ``pid`` is in (see the module's
    docstring); :class:`ResolveError` if there is none."""
    where = f"pid:{pid}"
    if not os.path.isdir(os.path.join(proc, str(pid))):
        raise ProcessGone(f"{where}: no such process")
    sockets = listening_rank_sockets(proc)
    own = rank_socket(pid, proc, sockets)
    if own is not None:
        return f"local://{own[1]}"
    try:
        argv = _cmdline(pid, proc)
    except OSError as exc:
        if exc.errno in _GONE:
            raise ProcessGone(f"{where}: no such process") from None
        raise ResolveError(f"{where}: {exc.strerror}") from None
    if starts_instances(argv):
        found = []
        todo, seen = [pid], {pid}
        while todo:  # (start -> spawner -> ranks; a few processes deep)
            for kid in children(todo.pop(), proc):
                if kid in seen:
                    continue
                seen.add(kid)
                rank = rank_socket(kid, proc, sockets)
                if rank is not None:
                    found.append(rank)
                else:
                    todo.append(kid)
        if found and min(found)[0] == 0:
            return f"local://{min(found)[1]}"
        raise NotUpYet(f"{where}: it is kvbroker start, and its rank 0 does not listen "
                       "(yet): is the instance up? (--wait waits for it)")
    try:
        uri = _environ_uri(pid, proc)
    except OSError as exc:
        if exc.errno in _GONE:
            raise ProcessGone(f"{where}: no such process") from None
        raise ResolveError(f"{where}: cannot read its environment: {exc.strerror}") from None
    if uri is None:
        raise ResolveError(f"{where}: not in a kvbroker instance (no rank, no kvbroker "
                           f"start, and no {URI_ENV} in its environment)")
    return uri if "://" in uri else to_local(uri)


Connect = Callable[[], Awaitable[Any]]


async def resolve(target: str, *, form: str | None = None, wait: bool = False,
                  connect: Connect | None = None, env: dict[str, str] | None = None) -> str:
    """``target``'s URI (see the module's docstring).  ``form``
    (``"local"``, ``"remote"`` or None) converts it, as a ``?local`` or
    ``?remote`` query does; ``wait`` (or ``?wait``) waits, for a
    ``pid:`` target, until the instance is up (:func:`wait_until_up`);
    ``connect`` opens a handle to the current instance for ``rank:N``
    (default: :meth:`Handle.connect` on ``$KVBROKER_URI``).
    :class:`ResolveError` names what failed."""
    environ = os.environ if env is None else env
    base, query, asked_wait = parse_query(target)
    if form is not None and query is not None and form != query:
        raise ResolveError(f"{target}: ?{query} and --{form} cannot both be asked")
    form = form or query
    if environ.get(RESOLVE_LOCAL_ENV):
        form = "local"
    uri = await _resolve_base(base, target, environ, connect, wait or asked_wait,
                              remote=form == "remote")
    return to_local(uri) if form == "local" else to_remote(uri) if form == "remote" else uri


async def wait_until_up(pid: int, poll: float = 0.05) -> str:
    """The URI :func:`pid_uri` gives for ``pid`` once there is one, and
    once its instance is up: the rank it names answers and reports every
    rank of the instance full (what ``kvbroker start`` waits for before it
    prints the URI).  A script can so start an instance in the background
    and attach as soon as it is ready.  :class:`ResolveError` if the process
    exits first."""
    from broker import status
    from broker.handle import Handle

    where = f"pid:{pid}"

    def gone() -> ResolveError:
        return ResolveError(f"{where}: it exited before its instance was up")

    while True:
        try:
            uri = pid_uri(pid)
            break
        except NotUpYet:
            pass
        except ProcessGone:
            raise gone() from None
        except ResolveError:
            if not os.path.isdir(f"/proc/{pid}"):
                raise gone() from None
            raise
        await asyncio.sleep(poll)
    while True:
        if not os.path.isdir(f"/proc/{pid}"):
            raise gone()
        with contextlib.suppress(OSError, TimeoutError, ErrnoError):
            async with await asyncio.wait_for(Handle.connect(uri), 5) as h:
                while os.path.isdir(f"/proc/{pid}"):
                    ranks, _ = await status.gather(h)
                    if all(r.state == status.FULL for r in ranks):
                        return uri
                    await asyncio.sleep(poll)
        await asyncio.sleep(poll)


async def _resolve_base(base: str, target: str, environ: Any, connect: Connect | None,
                        wait: bool, remote: bool = False) -> str:
    """``base``'s URI; with ``remote``, a ``rank:N`` target's in ``ssh://``
    form naming rank N's host (its ``hostname``), where its socket is,
    which may not be this one."""
    if base.startswith(("local://", "ssh://")):
        if base.startswith("ssh://"):
            from broker.ssh import parse

            parse(base)  # (ValueError, saying the form it wants)
        elif base == "local://" or not base[len("local://"):].startswith("/"):
            raise ResolveError(f"{target}: local:// needs the socket's absolute path: "
                               "local:///path/to/socket")
        return base
    if base.startswith("/"):
        return f"local://{base}"
    if base == ".":
        uri = environ.get(URI_ENV)
        if not uri:
            raise ResolveError(f".: {URI_ENV} is not set (not in an instance)")
        return uri if "://" in uri else to_local(uri)
    scheme, sep, rest = base.partition(":")
    if sep and scheme == "pid":
        if not (rest.isascii() and rest.isdigit()) or int(rest) == 0:
            raise ResolveError(f"{target}: a process id is a positive integer")
        return await wait_until_up(int(rest)) if wait else pid_uri(int(rest))
    if sep and scheme == "rank":
        if not (rest.isascii() and rest.isdigit()) or int(rest) > NODEID_ANY - 2:
            raise ResolveError(f"{target}: a rank is an integer from 0 to {NODEID_ANY - 2}")
        if connect is None:
            from broker.handle import Handle

            async def connect() -> Any:
                return await Handle.connect(environ.get(URI_ENV))
        async with await connect() as h:
            uri = str(await h.attr_get("local-uri", nodeid=int(rest)))
            if remote:
                uri = to_remote(uri, str(await h.attr_get("hostname", nodeid=int(rest))))
            return uri
    names = ", ".join(s if s == "." else f"{s}://" if s in ("local", "ssh") else f"{s}:"
                      for s in SCHEMES)
    raise ResolveError(f"{target}: unknown target (schemes: {names})")
