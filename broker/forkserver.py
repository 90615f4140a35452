"""A fork server: one process that imported the broker once, and forks an
instance's rank spawner (:mod:`broker.spawner`) whenever a launcher asks.

Each :class:`broker.launch.Instance` start runs one spawner, which imports
the broker and its modules and forks the ranks.  That import is an
interpreter's start and ~120 ms of CPU; a program that starts instances by
the thousand (the test suite: about a sixth of its CPU went to it) pays it
each time.  With ``$KVBROKER_FORKSERVER`` naming this server's socket, a
launcher asks the server instead, and the spawner it gets is a fork of a
process that has imported everything already.

The spawner must be the one a fresh ``python -P -m broker.spawner`` would
have been, so the server serves only a launcher that matches the start it
had itself: the same user (the kernel's word, ``SO_PEERCRED``, not the
launcher's), the same interpreter, the same environment variables that
shape an interpreter's start (``PYTHON*``, ``LANG``, ``LC_*``), and all
else a process inherits (:func:`inherited`: groups, resource limits,
capabilities, signals ignored, namespaces...).  The child takes the launcher's working
directory (an open descriptor of it), umask, environment, standard error
and descriptors, each at the number the launcher gave it, and its own
session.  Anything else, or no server answering, and the launcher starts a
spawner of its own, as without the server.

The server is a single thread, as a process that forks must be.  It reaps
its children and tells each launcher its spawner's exit status; it exits
when its standard input closes (its starter is gone), leaving the spawners
running, which still end with their ranks.

Protocol, on a Unix stream socket: the launcher sends a 4-byte big-endian
length and a JSON object, with its descriptors attached (``SCM_RIGHTS``):
``{"fds": [number, ...], "spec": {...}, "env": {...}, "umask": int,
"python": path, "rundir": path, "inherited": {...}}`` (:func:`inherited`),
whose descriptors are, in order: the working directory, the spawner's
standard output and standard error, then one for each of ``fds``, to be
placed at that number.  ``spec`` is what :mod:`broker.spawner` reads.  The
server answers ``pid PID\\n`` and, once the spawner has exited, ``exit
STATUS\\n`` (a ``returncode``); or ``no REASON\\n`` when it will not serve.

A ``kvbroker`` command asks alike (:mod:`broker.forkclient`): ``{"kind":
"command", "argv": [...], "orig_argv": [...], "path0": str|null, "env": {...},
"umask": int, "python": path, "inherited": {...}, "start": {...}}``
(``start``: the interpreter's flags, which must be the server's too), with
the working directory and its standard input, output and error.  The fork
takes the asker's place and runs the command line; it kills itself if the
asker's connection closes first (the asker, which stands in for it, was
killed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from broker.forkclient import (
    FIRST,
    FORKSERVER_ENV,
    HEADER,
    inherited,
    interpreter_start,
    send_request,
    start_shaping_env,
    umask,
)
from broker.pipes import OutputProtocol, connect_read_pipe
from broker.pypath import child_env, module_command

if TYPE_CHECKING:
    import subprocess

_MAX_REQUEST = 16 << 20
_MAX_FDS = 4096


# -- the launcher's side -----------------------------------------------------

class ServedSpawner:
    """A spawner forked by the fork server, with what
    :class:`broker.launch.Instance` takes from an
    :class:`asyncio.subprocess.Process`: ``pid``, ``stdout``,
    ``returncode`` and ``wait()``.  It is not this process's child: its
    exit status comes from the server."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader,
                 conn: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.pid = pid
        self.stdout: asyncio.StreamReader | None = stdout
        self.returncode: int | None = None
        self._exit = asyncio.ensure_future(self._read_exit(*conn))

    async def _read_exit(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> int:
        try:
            line = await reader.readline()
        finally:
            writer.close()
        word, _, rest = line.decode(errors="replace").partition(" ")
        if word == "exit":
            return int(rest)
        # The server is gone: the spawner is no one's to report; wait for
        # it to go (a pidfd), and call it killed.
        from broker.launch import _exited

        await _exited(self.pid)
        return -signal.SIGKILL

    async def wait(self) -> int:
        if self.returncode is None:
            self.returncode = await asyncio.shield(self._exit)
        return self.returncode


async def start_spawner(rundir: str, spec: dict[str, Any], fds: list[int],
                        env: dict[str, str], stderr: Any) -> ServedSpawner | None:
    """A spawner for ``spec`` from the fork server ``$KVBROKER_FORKSERVER``
    names, with descriptors ``fds`` at their numbers; None if there is no
    server, or it would not serve this launcher (then start one's own)."""
    path = os.environ.get(FORKSERVER_ENV)
    if not path or not hasattr(socket, "send_fds"):
        return None
    request = json.dumps({
        "rundir": rundir, "spec": spec, "fds": fds, "env": env, "python": sys.executable,
        "umask": umask(), "inherited": inherited(),
    }).encode()
    status_r, status_w = os.pipe()
    try:
        fd = send_request(path, request, [status_w, stderr.fileno() if stderr else 2, *fds])
    finally:
        os.close(status_w)
    if fd is None:
        os.close(status_r)
        return None
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    try:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        os.close(status_r)
        raise
    pid = 0
    try:
        word, _, rest = (await reader.readline()).decode(errors="replace").partition(" ")
        if word != "pid":  # (``no REASON``: not for this launcher)
            writer.close()
            os.close(status_r)
            return None
        pid = int(rest)
        stdout = asyncio.StreamReader(limit=1 << 20)
        await connect_read_pipe(functools.partial(OutputProtocol, stdout),
                                os.fdopen(status_r, "rb", 0))
    except BaseException:
        if pid:  # (a spawner no one would report)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:
            os.close(status_r)
        writer.close()
        raise
    return ServedSpawner(pid, stdout, (reader, writer))


# -- the server's side -------------------------------------------------------

class _Refused(Exception):
    """A request this server will not serve; the launcher is told why."""


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One request and its descriptors (closed here if it is refused)."""
    data, fds, _flags, _addr = socket.recv_fds(conn, HEADER.size + FIRST, _MAX_FDS)
    try:
        while len(data) < HEADER.size:
            more = conn.recv(HEADER.size - len(data))
            if not more:
                raise _Refused("a request cut short")
            data += more
        (length,) = HEADER.unpack_from(data)
        if length > _MAX_REQUEST:
            raise _Refused("a request too long")
        body = bytearray(data[HEADER.size:])
        while len(body) < length:
            more = conn.recv(min(1 << 16, length - len(body)))
            if not more:
                raise _Refused("a request cut short")
            body += more
        request = json.loads(body)
        if isinstance(request, dict) and request.get("kind") == "command":
            if not _well_formed_command(request) or len(fds) != 4:
                raise _Refused("a malformed request")
        elif not _well_formed(request) or len(fds) != 3 + len(request["fds"]):
            raise _Refused("a malformed request")
        return request, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(a, str) for a in value)


def _environment(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _well_formed(request: Any) -> bool:
    """``request`` has each field, of its type: descriptors to place at
    distinct numbers past the standard streams', an environment of strings."""
    if not isinstance(request, dict):
        return False
    fds = request.get("fds")
    return (isinstance(fds, list) and all(type(n) is int and 2 < n < 1 << 20 for n in fds)
            and len(set(fds)) == len(fds) and _environment(request.get("env"))
            and isinstance(request.get("spec"), dict) and type(request.get("umask")) is int
            and isinstance(request.get("python"), str)
            and isinstance(request.get("rundir"), str))


def _well_formed_command(request: dict[str, Any]) -> bool:
    """A command's request (:func:`broker.forkclient.run_served_command`)
    has each field, of its type."""
    return (_strings(request.get("argv")) and len(request["argv"]) > 0
            and _strings(request.get("orig_argv"))
            and (request.get("path0") is None or isinstance(request.get("path0"), str))
            and _environment(request.get("env"))
            and type(request.get("umask")) is int and isinstance(request.get("python"), str)
            and isinstance(request.get("start"), dict))


class _Start:
    """How this server started, read once (it does not change): what an
    asker's start must equal for the server's fork to stand for it."""

    def __init__(self) -> None:
        self.context = inherited()
        self.shaping = start_shaping_env(dict(os.environ))
        self.interpreter = interpreter_start()


def _check_same_start(conn: socket.socket, request: dict[str, Any], mine: _Start) -> None:
    """Refuse a launcher whose spawner would not be this server's fork:
    another user, interpreter (or its flags, for a command), start-shaping
    variables, or an inherited context other than ``mine`` (the server's
    own)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, gid = struct.unpack("3i", creds)
    if (uid, gid) != (os.getuid(), os.getgid()):
        raise _Refused("another user")
    if not _same_interpreter(request["python"]):
        raise _Refused("another interpreter")
    theirs, context = request.get("inherited"), mine.context
    if theirs != context:
        differ = (sorted(k for k in context if theirs.get(k) != context[k])
                  if isinstance(theirs, dict) else ["all"])
        raise _Refused(f"another process context ({', '.join(differ)})")
    if start_shaping_env(request["env"]) != mine.shaping:
        raise _Refused("another interpreter environment")
    if request.get("kind") == "command" and request["start"] != mine.interpreter:
        raise _Refused("another interpreter start (its flags)")


def _same_interpreter(python: str) -> bool:
    """``python`` is this interpreter under the same or another name in its
    directory (a venv's ``python`` and ``python3``): the same binary and
    the same ``sys.prefix``, which is found from the directory."""
    if python == sys.executable:
        return True
    return (os.path.dirname(python) == os.path.dirname(sys.executable)
            and os.path.realpath(python) == os.path.realpath(sys.executable))


def _become_spawner(request: dict[str, Any], fds: list[int]) -> NoReturn:
    """In the forked child: take the launcher's place and run the spawner."""
    def spawner_run() -> int:
        _take_place(request, fds, [1, 2, *(int(n) for n in request["fds"])])
        null = os.open(os.devnull, os.O_RDONLY)
        if null != 0:
            os.dup2(null, 0)
            os.close(null)
        from broker import spawner  # (run with -P, as the server: no cwd on the path)

        python, rundir = str(request["python"]), str(request["rundir"])
        sys.argv = [str(spawner.__file__), rundir]
        sys.executable = python
        _retitle([*module_command(python, "broker.spawner"), rundir])
        return spawner.run(request["spec"])

    _run_in_child(spawner_run)


def _become_command(request: dict[str, Any], fds: list[int], conn: socket.socket) -> NoReturn:
    """In the forked child: take the asker's place (its standard streams,
    working directory, umask, environment, arguments) and run its
    ``kvbroker`` command, dying with the asker (:func:`_die_with_asker`)."""
    def command_run() -> int:
        _die_with_asker(conn)
        _take_place(request, fds, [0, 1, 2])
        sys.argv = list(request["argv"])
        sys.orig_argv = list(request["orig_argv"])
        sys.executable = str(request["python"])
        if request["path0"] is not None:  # (the server runs with -P: none of its own)
            sys.path.insert(0, str(request["path0"]))
        _reopen_std_streams()
        _retitle(sys.orig_argv)
        from broker.cli import main as run_command

        try:
            code = run_command()
        except SystemExit as exc:
            code = _exit_status(exc.code)
        except KeyboardInterrupt:
            code = 130
        import atexit
        import threading

        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  # (as the interpreter's exit)
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        return code

    _run_in_child(command_run)


def _take_place(request: dict[str, Any], fds: list[int], targets: list[int]) -> None:
    """The asker's place, in a forked child: a session of its own, the
    working directory ``fds[0]``, each other descriptor of ``fds`` at its
    number of ``targets``, the asker's umask and environment."""
    os.setsid()
    cwd, *given = fds
    # Out of the way of every target first, then each onto its number.
    low = max(*targets, *fds, 2) + 1
    moved = [_dup_above(fd, low) for fd in given]
    for fd in given:
        os.close(fd)
    os.fchdir(cwd)
    os.close(cwd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # (found again from the asker's $TMPDIR)


def _run_in_child(run: Callable[[], int]) -> NoReturn:
    """Exit this forked child with the status ``run()`` returns (1, with
    its traceback on standard error, if it raises), its output flushed:
    ``os._exit``, never back into the server's loop."""
    code = 1
    try:
        code = run()
    except BaseException:
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    os._exit(code & 0xFF)


def _exit_status(code: Any) -> int:
    """The exit status ``SystemExit(code)`` gives, as the interpreter's."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1


def _die_with_asker(conn: socket.socket) -> None:
    """Kill this process (``SIGKILL``) once its asker's connection closes:
    the asker stands in for it, and one killed (or gone) without passing
    that on leaves no one to answer to.  A thread waits for the close."""
    import threading

    def wait() -> None:
        while True:
            try:
                if not conn.recv(4096):
                    break
            except TimeoutError:  # (the server's timeout on the shared connection)
                continue
            except OSError:
                break
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="asker", daemon=True).start()


def _reopen_std_streams() -> None:
    """``sys.stdin``, ``stdout`` and ``stderr`` made again on descriptors
    0-2 (the asker's now), as an interpreter makes them at its start: line
    buffered on a terminal (stderr always), with the server's encoding and
    errors (its start-shaping environment is the asker's)."""
    import io

    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        write = fd != 0
        raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
        buffered: io.BufferedWriter | io.BufferedReader = (
            io.BufferedWriter(raw) if write else io.BufferedReader(raw))
        try:
            tty = os.isatty(fd)
        except OSError:
            tty = False
        stream = io.TextIOWrapper(buffered, encoding=old.encoding, errors=old.errors,
                                  newline="\n", line_buffering=write and (tty or fd == 2))
        raw.name = f"<{name}>"
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _retitle(argv: list[str]) -> None:
    """Show ``argv`` as this process's command line (``ps``, ``pgrep -f``,
    ``/proc/PID/cmdline``), as an executed spawner's, and what its ranks
    show too: written over the server's own, in the room it was started
    with (:func:`start_server`).  Where that cannot be done (no ``/proc``),
    the server's command line stays."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat") as f:
            text = f.read()
        fields = text[text.rindex(")") + 2:].split()
        start, end = int(fields[45]), int(fields[46])  # (arg_start, arg_end)
        title = b"\0".join(os.fsencode(a) for a in argv) + b"\0"
        room = end - start
        if room <= 0:
            return
        title = title[:room - 1] + b"\0" * max(1, room - len(title[:room - 1]))
        import ctypes

        ctypes.memmove(start, title, room)
        with open("/proc/self/comm", "w") as comm:
            comm.write(os.path.basename(argv[0])[:15])


def _dup_above(fd: int, low: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD, low)


class _Server:
    """The accept-fork-reap loop."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(sys.stdin, selectors.EVENT_READ, self._starter_gone)
        self.running = True
        self.start = _Start()
        self.conns: set[socket.socket] = set()
        """The askers' connections, each until its child is reaped."""

    def serve(self) -> None:
        while self.running:
            for key, _ in self.selector.select():
                key.data(key.fileobj)

    def _starter_gone(self, stdin: Any) -> None:
        if not os.read(stdin.fileno(), 4096):
            self.running = False

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            conn.settimeout(10)
            try:
                request, fds = _read_request(conn)
            except (_Refused, ValueError, OSError) as exc:
                with contextlib.suppress(OSError):
                    conn.sendall(f"no {exc}\n".encode())
                conn.close()
                return
            try:
                _check_same_start(conn, request, self.start)
            except _Refused as exc:
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(f"no {exc}\n".encode())
                conn.close()
                return
            self._fork(conn, request, fds)
        except BaseException:
            conn.close()
            raise

    def _fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._close_in_child(conn)
            if request.get("kind") == "command":
                _become_command(request, fds, conn)
            _become_spawner(request, fds)
        for fd in fds:
            os.close(fd)
        self.conns.add(conn)
        pidfd = os.pidfd_open(pid)
        self.selector.register(pidfd, selectors.EVENT_READ,
                               lambda _fd: self._reap(pid, pidfd, conn))
        try:
            conn.sendall(f"pid {pid}\n".encode())
        except OSError:  # (the launcher is gone before it knew: no one's spawner)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _close_in_child(self, conn: socket.socket) -> None:
        """Close what the server holds but ``conn``: the listener, its other
        askers' connections and its children's pidfds."""
        for key in list(self.selector.get_map().values()):
            if key.fileobj is not sys.stdin:
                with contextlib.suppress(OSError):
                    os.close(key.fd)
        self.selector.close()
        for other in self.conns:
            if other is not conn:
                other.close()

    def _reap(self, pid: int, pidfd: int, conn: socket.socket) -> None:
        self.conns.discard(conn)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        conn.close()


TITLE_ROOM = 1024
"""Bytes of command line a server is started with, for each spawner's own
(:func:`_retitle`): an interpreter's path and a run directory's."""


def start_server(path: str) -> subprocess.Popen[bytes]:
    """Start a fork server on the socket ``path`` (in a directory only this
    user can enter) and return once it serves; close its standard input
    to stop it."""
    import subprocess

    proc = subprocess.Popen(
        [*module_command(sys.executable, "broker.forkserver"), path, " " * TITLE_ROOM],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
        env=child_env(dict(os.environ)))
    assert proc.stdout is not None and proc.stdin is not None
    if proc.stdout.readline() != b"ready\n":
        proc.stdin.close()
        proc.stdout.close()
        raise RuntimeError(f"the fork server exited {proc.wait()} before it served")
    proc.stdout.close()
    return proc


def main(argv: list[str] | None = None) -> int:
    """``python -m broker.forkserver SOCKET [ROOM]``: serve until standard
    input closes; ``ready`` on standard output once the socket takes
    requests.  ROOM is ignored: its length is room for spawners' command
    lines (:data:`TITLE_ROOM`)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m broker.forkserver SOCKET [ROOM]", file=sys.stderr)
        return 2
    if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
        print("forkserver: needs Linux's pidfds and SCM_RIGHTS", file=sys.stderr)
        return 1
    # What every spawner imports, once here.
    from broker import rank, spawner  # noqa: F401
    from broker.cli import parser_for

    parser_for(["kvs"])  # (and what the commands served import: the KVS's)

    spawner.preload_default_modules()
    gc.freeze()
    server = _Server(args[0])
    print("ready", flush=True)
    server.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
