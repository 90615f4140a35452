"""Attaching to a rank on another host: ``ssh://[user@]host[:port]/path``.

A rank's local connector is a Unix socket, reachable only on its own host.
Across hosts a client attaches as Flux's ``ssh://`` connector does: it runs
``ssh host kvbroker relay PATH`` and speaks the ordinary connector protocol
through ssh's standard input and output, which the relay copies to and from
the rank's socket.  So nothing new listens on the network, ssh does the
authentication, and the rank learns the client's identity from the OS as
for any local client: the relay runs as the ssh login user (the instance
owner, or a guest where the instance allows guests).

ssh's standard input and output are one end of a socket pair, so the
:class:`broker.handle.Handle` on the other end is a plain stream connection
(both event loops support that).  Before handing it over, the client reads
the relay's one-line greeting (``kvbroker-relay ok``, or ``kvbroker-relay
error ...``): a host, login or socket that fails is reported by
``Handle.connect`` itself, not by the first request.

``$KVBROKER_SSH`` names the ssh command (default ``ssh``; tests use a
stand-in that runs the command locally), ``$KVBROKER_SSH_RCMD`` the
``kvbroker`` command on the remote host.  By default it is ``env
PATH=RUNDIR/bin:BINDIR:/bin:/usr/bin kvbroker``, as Flux's connector
sets the remote ``PATH``: every rank keeps in ``RUNDIR/bin`` (beside its
socket) a ``kvbroker`` that runs the rank's own installation
(:func:`install_relay_command`), so the relay is found on the rank's host
whatever this host's installation is; BINDIR (this ``kvbroker``'s
directory) is the fallback for a run directory without one.

ssh's standard error is kept while it connects: should the relay not
answer, what ssh (or the remote shell) said is the error's message, as
Flux's connector does; once the relay has answered it is passed on to
ours.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from broker.command import watch_exit

GREETING = b"kvbroker-relay "
GREETING_MAX = 4096
RELAY_BIN = "bin"
"""The directory of the run directory a rank keeps its ``kvbroker`` in
(Flux's ``RUNDIR/bin/flux``)."""


@dataclass(frozen=True)
class SshTarget:
    host: str
    path: str
    user: str | None = None
    port: int | None = None


def parse(uri: str) -> SshTarget:
    """``ssh://[user@]host[:port]/absolute/path/to/socket``; ValueError if not."""
    parts = urlsplit(uri)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme != "ssh" or not parts.hostname or not parts.path.startswith("/") \
            or port == -1 or parts.query or parts.fragment \
            or parts.hostname.startswith("-") or (parts.username or "").startswith("-"):
        # (a host or user like "-oProxyCommand=..." would be an ssh option)
        raise ValueError(f"bad ssh URI {uri!r}: expected ssh://[user@]host[:port]/socket-path")
    return SshTarget(host=parts.hostname, path=parts.path, user=parts.username, port=port)


def _words(name: str, value: str) -> list[str]:
    """Environment variable ``name``'s command line, split as a shell would."""
    try:
        return shlex.split(value)
    except ValueError as exc:  # (unbalanced quotes: said naming the variable)
        raise ValueError(f"${name} {value!r}: {exc}") from None


def local_bindir() -> str | None:
    """The directory of this host's ``kvbroker`` (beside this Python, else
    on ``$PATH``), None if there is none."""
    here = os.path.join(os.path.dirname(sys.executable), "kvbroker")
    found = here if os.access(here, os.X_OK) else shutil.which("kvbroker")
    return os.path.dirname(os.path.abspath(found)) if found else None


def remote_command(path: str) -> list[str]:
    """The ``kvbroker`` command to run on the remote host for the socket
    ``path``, as words: ``$KVBROKER_SSH_RCMD`` may carry some
    (``/opt/venv/bin/python -m broker.cli``), split as ``$KVBROKER_SSH``
    is (as one word it named no program there).  By default ``kvbroker``
    found through a ``PATH`` that puts the rank's ``RUNDIR/bin`` first, then
    this host's ``kvbroker`` directory and the system's (Flux's remote
    ``PATH``)."""
    rcmd = os.environ.get("KVBROKER_SSH_RCMD")
    if rcmd and rcmd.strip():
        return _words("KVBROKER_SSH_RCMD", rcmd)
    dirs = [os.path.join(os.path.dirname(path), RELAY_BIN)]
    if ":" in dirs[0]:  # (PATH cannot name it)
        dirs = []
    bindir = local_bindir()
    if bindir and ":" not in bindir:
        dirs.append(bindir)
    return ["env", "PATH=" + ":".join([*dirs, "/bin", "/usr/bin"]), "kvbroker"]


def ssh_argv(target: SshTarget) -> list[str]:
    argv = _words("KVBROKER_SSH", os.environ.get("KVBROKER_SSH") or "ssh")
    if target.port is not None:
        argv += ["-p", str(target.port)]
    if target.user:
        argv += ["-l", target.user]
    # ssh hands the remote side one command line for its shell
    return [*argv, target.host,
            shlex.join([*remote_command(target.path), "relay", target.path])]


async def open_connection(uri: str) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start the ssh relay for ``uri``; the connected socket (its greeting
    read) and the ssh process.  Raises OSError naming what failed, with
    what ssh said on its standard error meanwhile."""
    target = parse(uri)
    argv = ssh_argv(target)
    ours, theirs = socket.socketpair()
    said_r, said_w = os.pipe()
    try:
        proc = subprocess.Popen(argv, stdin=theirs.fileno(), stdout=theirs.fileno(),
                                stderr=said_w, close_fds=True)
    except OSError as exc:
        ours.close()
        os.close(said_r)
        raise OSError(exc.errno, f"cannot run {argv[0]}: {exc.strerror} (KVBROKER_SSH names "
                      "the ssh command)") from None
    finally:
        theirs.close()
        os.close(said_w)
    said = _Said(said_r)
    try:
        await _read_greeting(ours, target)
    except BaseException as exc:
        ours.close()
        proc.kill()
        proc.wait()
        text = said.close()
        if isinstance(exc, OSError) and text:
            raise OSError(exc.errno, f"{exc.strerror}: {text}") from None
        raise
    said.forward()
    return ours, proc


class _Said:
    """ssh's standard error while it connects: kept (the loop reads it as it
    comes), then either returned for the error (:meth:`close`) or written
    to ours and copied there from then on (:meth:`forward`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.data = bytearray()
        os.set_blocking(fd, False)
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 16):
                self.data += chunk
                if len(self.data) > 1 << 16:  # (the last of it is what matters)
                    del self.data[:-(1 << 15)]
            self.loop.remove_reader(self.fd)  # end of file
        except BlockingIOError:
            pass
        except OSError:
            self.loop.remove_reader(self.fd)

    def close(self) -> str:
        """ssh has ended: what it said (what is there to read), stripped."""
        self.loop.remove_reader(self.fd)
        self._read()
        os.close(self.fd)
        return self.data.decode(errors="replace").strip()

    def forward(self) -> None:
        self.loop.remove_reader(self.fd)
        os.set_blocking(self.fd, True)
        threading.Thread(target=_copy_to_stderr, args=(self.fd, bytes(self.data)),
                         daemon=True).start()


def _copy_to_stderr(fd: int, first: bytes) -> None:
    try:
        try:
            out = sys.stderr.fileno()
        except (AttributeError, ValueError, OSError):  # (no real stderr: dropped)
            out = -1
        data = first
        while True:
            if out >= 0:
                view = memoryview(data)
                while view:
                    view = view[os.write(out, view):]
            data = os.read(fd, 1 << 16)
            if not data:
                return
    except OSError:
        pass
    finally:
        os.close(fd)


async def _read_greeting(sock: socket.socket, target: SshTarget) -> None:
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    line = b""
    while not line.endswith(b"\n"):
        chunk = await loop.sock_recv(sock, 1)  # byte by byte: nothing beyond it is ours
        if not chunk:  # ssh failed: unknown host, no login, no kvbroker there...
            raise OSError(errno.EHOSTUNREACH, f"ssh to {target.host} ended before the relay "
                          "answered")
        line += chunk
        if len(line) > GREETING_MAX:
            raise OSError(errno.EPROTO, f"{target.host}: not a kvbroker relay{NOISE_HINT}")
    if not line.startswith(GREETING):
        raise OSError(errno.EPROTO, f"{target.host}: not a kvbroker relay: {line[:80]!r}"
                      f"{NOISE_HINT}")
    said = line[len(GREETING):].decode(errors="replace").strip()
    word, _, rest = said.partition(" ")
    if word == "ok" and not rest:
        return
    num, _, text = rest.partition(" ")
    if word != "error" or not num.isdigit():  # (a relay of another version, say)
        raise OSError(errno.EPROTO, f"{target.host}: the relay's greeting is not understood: "
                      f"{said[:80]!r} (another kvbroker version there?)")
    raise OSError(int(num), f"{target.host}: {text or os.strerror(int(num))}")


NOISE_HINT = (" (something wrote to the ssh session's standard output before the relay: "
              "do the shell's init files on that host write to standard output when not "
              "interactive? They must not)")


async def reap(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    """Wait for the ssh process once its connection is closed (it exits when
    the remote relay does); killed if it takes longer than ``timeout``."""
    if proc.poll() is not None:
        return
    exited = watch_exit(proc)
    try:
        await asyncio.wait_for(asyncio.shield(exited), timeout)
    except TimeoutError:
        proc.kill()
        await exited


# ---------------------------------------------------------------- the relay


def install_relay_command(rundir: str) -> None:
    """Write ``RUNDIR/bin/kvbroker``, a script that runs this rank's own
    installation (its Python, its ``broker`` package), for the relay an
    ``ssh://`` client runs through the ``PATH`` it sets (Flux's
    ``RUNDIR/bin/flux`` link).  Readable by all, as the run directory is
    where guests are allowed; written whole or not at all (the ranks of
    one host share it).  Failing is not fatal: a client's ``PATH`` goes on
    to its own ``kvbroker`` directory."""
    from broker.pypath import ROOT, module_command

    bindir = os.path.join(rundir, RELAY_BIN)
    command = shlex.join(module_command(sys.executable, "broker.cli"))
    script = ("#!/bin/sh\n"
              "# the relay of an ssh:// client (kvbroker relay): this rank's kvbroker\n"
              f"PYTHONPATH={shlex.quote(ROOT)}${{PYTHONPATH:+:$PYTHONPATH}}\n"
              "export PYTHONPATH\n"
              f"exec {command} \"$@\"\n")
    try:
        os.makedirs(bindir, mode=0o755, exist_ok=True)
        path = os.path.join(bindir, "kvbroker")
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(script)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
    except OSError:
        pass


def remove_relay_command(rundir: str) -> None:
    """Remove ``RUNDIR/bin`` once no rank's socket is left in ``rundir``
    (the last rank of the host to stop: the run directory is left as it
    was found)."""
    try:
        if any(name.startswith("local-") for name in os.listdir(rundir)):
            return
        bindir = os.path.join(rundir, RELAY_BIN)
        os.unlink(os.path.join(bindir, "kvbroker"))
        os.rmdir(bindir)
    except OSError:
        pass



def relay(path: str) -> int:
    """``kvbroker relay PATH``: connect to the local socket PATH, greet, then
    copy standard input to it and it to standard output until either ends."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError as exc:
            out = sys.stdout.buffer
            out.write(GREETING + f"error {exc.errno} {path}: {exc.strerror}\n".encode())
            out.flush()
            return 1
        return _copy_both_ways(sock)


def _copy_both_ways(sock: socket.socket) -> int:
    """:func:`relay` once connected: greet, then copy until either side ends
    (the caller closes ``sock``; the thread still reading standard input,
    a daemon, then ends on its next write)."""
    out = sys.stdout.buffer
    out.write(GREETING + b"ok\n")
    out.flush()

    def upstream() -> None:  # standard input -> the rank
        fd = sys.stdin.fileno()
        try:
            while data := os.read(fd, 1 << 16):
                sock.sendall(data)
        except OSError:
            pass
        finally:
            try:
                sock.shutdown(socket.SHUT_WR)  # the rank sees the client go
            except OSError:
                pass

    threading.Thread(target=upstream, daemon=True).start()
    fd = sys.stdout.fileno()
    try:
        while data := sock.recv(1 << 16):
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
    except OSError:
        pass
    return 0
