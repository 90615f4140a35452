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
``kvbroker`` command on the remote host (default: this ``kvbroker``'s
absolute path, i.e. the same installation path there).
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

SCHEME = "ssh://"
GREETING = b"kvbroker-relay "
GREETING_MAX = 4096


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


def remote_command() -> list[str]:
    """The ``kvbroker`` command to run on the remote host, as words:
    ``$KVBROKER_SSH_RCMD`` may carry some (``/opt/venv/bin/python -m
    broker.cli``), split as ``$KVBROKER_SSH`` is (as one word it named no
    program there)."""
    rcmd = os.environ.get("KVBROKER_SSH_RCMD")
    if rcmd and rcmd.strip():
        return _words("KVBROKER_SSH_RCMD", rcmd)
    here = os.path.join(os.path.dirname(sys.executable), "kvbroker")
    return [here if os.access(here, os.X_OK) else (shutil.which("kvbroker") or "kvbroker")]


def ssh_argv(target: SshTarget) -> list[str]:
    argv = _words("KVBROKER_SSH", os.environ.get("KVBROKER_SSH") or "ssh")
    if target.port is not None:
        argv += ["-p", str(target.port)]
    if target.user:
        argv += ["-l", target.user]
    # ssh hands the remote side one command line for its shell
    return [*argv, target.host, shlex.join([*remote_command(), "relay", target.path])]


async def open_connection(uri: str) -> tuple[socket.socket, subprocess.Popen[bytes]]:
    """Start the ssh relay for ``uri``; the connected socket (its greeting
    read) and the ssh process.  Raises OSError naming what failed."""
    target = parse(uri)
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen(ssh_argv(target), stdin=theirs.fileno(),
                                stdout=theirs.fileno(), close_fds=True)
    except OSError as exc:
        ours.close()
        raise OSError(exc.errno, f"cannot run {ssh_argv(target)[0]}: {exc.strerror}") from None
    finally:
        theirs.close()
    try:
        await _read_greeting(ours, target)
    except BaseException:
        ours.close()
        proc.kill()
        proc.wait()
        raise
    return ours, proc


async def _read_greeting(sock: socket.socket, target: SshTarget) -> None:
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    line = b""
    while not line.endswith(b"\n"):
        chunk = await loop.sock_recv(sock, 1)  # byte by byte: nothing beyond it is ours
        if not chunk:  # ssh failed: unknown host, no login, no kvbroker there...
            raise OSError(errno.EHOSTUNREACH, f"ssh to {target.host} ended before the relay "
                          "answered (ssh's own error, if any, is above)")
        line += chunk
        if len(line) > GREETING_MAX:
            raise OSError(errno.EPROTO, f"{target.host}: not a kvbroker relay")
    if not line.startswith(GREETING):
        raise OSError(errno.EPROTO, f"{target.host}: not a kvbroker relay: {line[:80]!r}")
    said = line[len(GREETING):].decode(errors="replace").strip()
    word, _, rest = said.partition(" ")
    if word == "ok" and not rest:
        return
    num, _, text = rest.partition(" ")
    if word != "error" or not num.isdigit():  # (a relay of another version, say)
        raise OSError(errno.EPROTO, f"{target.host}: the relay's greeting is not understood: "
                      f"{said[:80]!r} (another kvbroker version there?)")
    raise OSError(int(num), f"{target.host}: {text or os.strerror(int(num))}")


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


def relay(path: str) -> int:
    """``kvbroker relay PATH``: connect to the local socket PATH, greet, then
    copy standard input to it and it to standard output until either ends."""
    out = sys.stdout.buffer
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        out.write(GREETING + f"error {exc.errno} {path}: {exc.strerror}\n".encode())
        out.flush()
        return 1
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
