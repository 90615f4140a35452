"""The asking side of the fork server (:mod:`broker.forkserver`), without
asyncio: what a launcher and a ``kvbroker`` command share to ask for a fork.

A ``kvbroker`` command is an interpreter's start and the command line's
imports (asyncio, the CLI, the KVS client): ~0.1 s of CPU for a request
that takes a millisecond.  With ``$KVBROKER_FORKSERVER`` set, the console
script (:mod:`broker.console`) imports only this module and asks the
server to fork the command instead (:func:`run_served_command`): the fork
runs the command line on this process's standard streams, working
directory, umask, environment and arguments, and this process stays as
its stand-in -- it passes on the signals it gets, and exits as the command
did (killing itself with the same signal, if a signal ended it).  If this
process dies unable to pass one on (``SIGKILL``), the command sees its
connection close and kills itself.  The server serves only a process that
matches its own start (:func:`inherited`, the interpreter, its flags and
the variables that shape its start); anything else, and the command runs
here as ever.

Only commands that are a client of the instance and nothing more are
asked for (:data:`SERVED`): not ``start``, ``broker`` or ``relay``, which
are or hold processes of the instance, nor ``exec``, ``sproc``, ``keygen``
or ``kvs lease run``, which run or watch other processes or files.
"""

from __future__ import annotations

# Only modules a command's interpreter has imported by now, or cheap C ones:
# this module is the whole import of a served command's stand-in, where
# ``json``, ``socket``, ``typing`` and ``contextlib`` each cost 3-9 ms of
# the ~20 it takes in all.
import _socket
import os
import resource
import signal
import struct
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

FORKSERVER_ENV = "KVBROKER_FORKSERVER"
"""The path of a running fork server's socket (tests, benchmarks)."""

HEADER = struct.Struct("!I")
FIRST = 4096
"""The request's first bytes, sent with its descriptors (one ``sendmsg``:
a stream socket may take a long one in parts)."""

SERVED = frozenset({
    "rpc", "ping", "event", "attr", "module", "groups", "cron", "config", "uri",
    "overlay", "uptime", "startlog", "shutdown", "dmesg", "logger", "stats", "content",
    "archive", "kvs",
})
"""The commands a ``kvbroker`` process asks the server to fork (above)."""

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
             signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGWINCH)
"""The signals a stand-in passes on to its served command."""


def start_shaping_env(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` an interpreter reads as it starts (or that
    set its streams' encoding): a served process is only right when the
    server started with the same."""
    return {k: v for k, v in env.items()
            if k.startswith(("PYTHON", "LC_")) or k == "LANG"}


def interpreter_start() -> dict[str, Any]:
    """How this interpreter was started beyond its environment: its flags
    (``-I``, ``-X dev``, ``-W``...), which a served command must share.
    But ``-P`` (``safe_path``): the server runs with it, and a command's
    first path entry is given as ``path0`` instead."""
    flags = {name: getattr(sys.flags, name) for name in dir(sys.flags)
             if not name.startswith(("_", "n_")) and name not in ("count", "index", "safe_path")}
    return {"flags": flags, "warnoptions": list(sys.warnoptions),
            "xoptions": {str(k): str(v) for k, v in sys._xoptions.items()}}


def inherited() -> dict[str, Any]:
    """What a process passes on to one it starts, beyond what the server
    hands over itself (working directory, umask, environment, descriptors):
    user and groups, resource limits, capabilities, ``no_new_privs``,
    seccomp, signals ignored and blocked, namespaces, root, cgroup, nice
    value, CPU affinity, OOM score adjustment.  An asker's and the
    server's must be equal for the server's fork to stand in for a
    process the asker would have started."""
    out: dict[str, Any] = {
        "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid(), sorted(os.getgroups())],
        "rlimits": {name: list(resource.getrlimit(getattr(resource, name)))
                    for name in dir(resource) if name.startswith("RLIMIT_")},
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
    }
    try:
        with open("/proc/self/status") as status:
            out["status"] = [line for line in status if line.startswith(_STATUS_KEPT)]
    except OSError:
        pass
    for name in ("cgroup", "oom_score_adj"):
        try:
            with open(f"/proc/self/{name}") as f:
                out[name] = f.read()
        except OSError:
            pass
    try:
        out["ns"] = {ns: os.readlink(f"/proc/self/ns/{ns}")
                     for ns in sorted(os.listdir("/proc/self/ns"))}
        out["root"] = os.readlink("/proc/self/root")
    except OSError:
        pass
    return out


_STATUS_KEPT = ("Cap", "NoNewPrivs:", "Seccomp:", "SigIgn:", "SigBlk:")
"""The lines of ``/proc/self/status`` a child inherits (capabilities,
``no_new_privs``, seccomp mode, signals ignored and blocked)."""


def umask() -> int:
    """This process's umask, read without setting it (Linux's
    ``/proc/self/status``), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def send_request(path: str, request: bytes, fds: list[int]) -> int | None:
    """Connect to the server at ``path`` and send ``request`` with this
    process's working directory and ``fds``; the connection's descriptor
    (blocking), or None if the server is not there (or hung) or a
    descriptor cannot be sent (a closed standard stream)."""
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(10)  # (a server that stopped reading)
        sock.connect(path)
        cwd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            first = HEADER.pack(len(request)) + request[:FIRST]
            rights = struct.pack(f"{1 + len(fds)}i", cwd, *fds)
            sent = sock.sendmsg([first], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
        finally:
            os.close(cwd)
        rest = first[sent:] + request[FIRST:]
        if rest:  # (not ``sendall(b"")``: a request sent whole in the first
            # part may have been served already, and the server gone from
            # the connection -- EPIPE, and the command would run again here)
            sock.sendall(rest)
        sock.settimeout(None)
        return sock.detach()
    except OSError:
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise


def servable(argv: list[str]) -> bool:
    """Whether ``kvbroker`` arguments ``argv`` (without the program) name a
    command the server may fork (:data:`SERVED`)."""
    words: list[str] = []
    it = iter(argv)
    for word in it:
        if word == "--event-loop":
            next(it, None)
        elif word == "--":
            return False  # (words past it are arguments: leave them to the parser)
        elif not word.startswith("-"):
            words.append(word)
            if len(words) == 2:
                break
    if not words or words[0] not in SERVED:
        return False
    return not (words[0] == "kvs" and words[1:2] == ["lease"])


def run_served_command(argv: list[str]) -> int | None:
    """Run ``kvbroker`` command ``argv`` (``sys.argv``) as a fork of the
    server ``$KVBROKER_FORKSERVER`` names, standing in for it here; its
    exit status, or None if it was not served (then run it here)."""
    path = os.environ.get(FORKSERVER_ENV)
    if not path or not servable(argv[1:]) or not _std_streams_open():
        return None
    request = to_json({
        "kind": "command", "argv": argv, "orig_argv": getattr(sys, "orig_argv", argv),
        # (what a plain start put first on the path; none under -P)
        "path0": sys.path[0] if sys.path and not sys.flags.safe_path else None,
        "env": dict(os.environ),
        "python": sys.executable, "umask": umask(), "inherited": inherited(),
        "start": interpreter_start(),
    }).encode()
    stand_in = _StandIn()
    # (one this process ignores, the command ignores too: the server's is
    # the same, :func:`inherited`)
    previous: dict[int, Any] = {sig: signal.signal(sig, stand_in.forward)
                                for sig in FORWARDED
                                if signal.getsignal(sig) is not signal.SIG_IGN}
    status: int | None = None
    try:
        fd = send_request(path, request, [0, 1, 2])
        if fd is not None:
            with open(fd, "rb", buffering=0) as conn:
                word, _, rest = _line(conn).partition(" ")
                if word == "pid":  # (else ``no REASON``: not for this process)
                    stand_in.started(int(rest))
                    word, _, rest = _line(conn).partition(" ")
                    # (no exit: the server went, and the command is no one's to report)
                    status = int(rest) if word == "exit" else stand_in.kill()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status is None:  # run here: with the signals it got meanwhile
        for sig in stand_in.pending:
            os.kill(os.getpid(), sig)
        return None
    if status < 0:  # ended by a signal: end so too
        signal.signal(-status, signal.SIG_DFL)
        sys.stdout.flush()
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


def _std_streams_open() -> bool:
    """Whether descriptors 0-2 are all open.  One closed (``<&-``: a
    daemon's or cron's child) would be taken by the connection to the
    server, or the working directory sent with it, and the command would
    read from or write to that: such a command runs in place, where the
    command line handles a closed stream (docs/cli.md)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            return False
    return True


def _line(conn: Any) -> str:
    """One line the server sent (without its newline; "" at the end),
    read a byte at a time: the next is the server's word once the command
    ends, which this must not read yet."""
    out = bytearray()
    while not out.endswith(b"\n"):
        more = conn.read(1)
        if not more:
            break
        out += more
    return out.decode(errors="replace").rstrip("\n")


def to_json(value: object) -> str:
    """``json.dumps(value)`` for the dicts, lists, strings, ints and bools
    of a request, without importing :mod:`json` (its decoder imports
    :mod:`re`): strings by its own C encoder."""
    try:
        from _json import encode_basestring_ascii as string
    except ImportError:  # (another Python: the module, then)
        import json

        return json.dumps(value)
    parts: list[str] = []

    def put(v: object) -> None:
        if isinstance(v, str):
            parts.append(string(v))
        elif v is True or v is False or v is None:
            parts.append("true" if v else "null" if v is None else "false")
        elif isinstance(v, int):
            parts.append(str(int(v)))
        elif isinstance(v, dict):
            parts.append("{")
            for i, (k, item) in enumerate(v.items()):
                parts.append((", " if i else "") + string(str(k)) + ": ")
                put(item)
            parts.append("}")
        elif isinstance(v, (list, tuple)):
            parts.append("[")
            for i, item in enumerate(v):
                if i:
                    parts.append(", ")
                put(item)
            parts.append("]")
        else:
            raise TypeError(f"not in a request: {type(v).__name__}")

    put(value)
    return "".join(parts)


class _StandIn:
    """Passes the signals this process gets on to the command it stands in
    for, once the server has said which process that is."""

    def __init__(self) -> None:
        self.pid = 0
        self.pending: list[int] = []
        """Signals got before the server said which process is the command."""

    def forward(self, sig: int, _frame: object) -> None:
        if self.pid:
            _kill(self.pid, sig)
        else:
            self.pending.append(sig)

    def started(self, pid: int) -> None:
        self.pid = pid
        for sig in self.pending:
            _kill(pid, sig)
        self.pending.clear()

    def kill(self) -> int:
        """Kill the command no server reports on any more; the status to end with."""
        _kill(self.pid, signal.SIGKILL)
        print("kvbroker: the fork server that ran this command went away", file=sys.stderr)
        return 1


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
