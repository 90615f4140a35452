"""The command an instance runs: ``kvbroker start -- CMD``, and the initial
program of ``kvbroker broker --config FILE -- CMD`` on rank 0.

:class:`Command` owns how it is spawned, signalled and stopped.  It works on
any event loop -- the stock one (``start``'s supervisor) or uvloop (a rank):
it is spawned with :class:`subprocess.Popen`, whose ``process_group`` is set
in C after the fork (safe beside ZeroMQ's threads, unlike a ``preexec_fn``;
uvloop's subprocesses have no ``process_group``), and its exit is learnt
from a pidfd the loop watches, so no child watcher or thread is involved.

On Linux the command does not outlive us: it is SIGKILLed by the kernel
when we die, however we die (:data:`PARENT_DEATH_SIGNAL`, a
``prctl(PR_SET_PDEATHSIG)`` set between fork and exec) -- unless it
changes its credentials (a set-user-ID program such as ``sudo``, or a
``setuid()`` of its own), which makes the kernel drop the signal.  That
needs a ``preexec_fn``; see :func:`_parent_death_hook` for why it is safe
here.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

STOP_TIMEOUT = 15.0
"""How long :meth:`Command.stop` waits after SIGTERM before SIGKILL."""
STOP_CAP = 10
"""A rank that reports progress while it stops (``stopping <bytes>``) is
given more time by the launcher (:mod:`broker.launch`), up to this many
stop timeouts after its SIGTERM: a stop always ends."""
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM)
"""What ``start`` and ``exec`` pass on to the commands they run, and what
stops them cleanly otherwise: Flux's broker's stop signals (SIGQUIT and
SIGALRM killed ``start`` by their default action, 131 or 142, its ranks
left to stop by themselves)."""
PARENT_DEATH_SIGNAL = signal.SIGKILL
"""What the command gets from the kernel if we die while it runs (Linux).
SIGKILL, not SIGTERM: a SIGKILLed ``kvs lease run`` leaves nobody to
follow a SIGTERM that is ignored with the SIGKILL :meth:`Command.stop`
ends with, and its command must not go on believing it holds a lock whose
lease expires a ttl later.  (What the command started is not reached:
the kernel signals the command alone; nor is a command that changed its
credentials, for which the kernel clears the setting: prctl(2).)"""
PR_SET_PDEATHSIG = 1
"""prctl(2)'s option, from <linux/prctl.h>."""


@functools.cache
def libc_prctl() -> Any:
    """libc's ``prctl``, looked up once, in the parent (the child must not
    load anything between fork and exec); None where there is none."""
    import ctypes  # (only to spawn a command: no other CLI command pays for it)

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                      ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _parent_death_hook() -> Callable[[Iterable[int]], Callable[[], None]] | None:
    """A ``preexec_fn`` maker that has the kernel send
    :data:`PARENT_DEATH_SIGNAL` to the child when we die (None where that
    cannot be had: not Linux, or not the main thread).  Given the signal
    mask to restore, it returns the function the child runs
    (:func:`_preexec`).

    * The signal comes when the *thread* that forked exits, not the
      process: only the main thread spawns with it, whose exit is the
      process's (the interpreter joins the other threads on it).
    * We may die between the fork and the ``prctl``: the child then finds
      itself given to another parent and sends itself the signal, rather
      than exec a command no one will stop.  (``getppid()`` is 0 when the
      parent is in another pid namespace: nothing to compare, and no
      reason to think we are gone.)
    * A signal may reach the child between the fork and the exec (Ctrl-C
      to the foreground job, a signal to our process group).  There the
      child still runs our handlers: the C one writes the signal to the
      loop's wake-up socket, which the child shares with us, so *we*
      would see it a second time; a Python one (``KeyboardInterrupt``)
      would make ``Popen`` raise ``SubprocessError``.  So :func:`_preexec`
      blocks signals around the fork, and the child resets every caught
      signal to its default before unblocking them: what arrived is then
      handled as it would be after the exec, by the command's defaults.
      (``subprocess`` does the same on its own only when it vforks, which
      a ``preexec_fn`` rules out.)
    * A ``preexec_fn`` runs Python in the child, which the ``subprocess``
      docs call unsafe beside threads: a lock another thread held at the
      fork is held for ever in the child.  This one runs a libc call
      looked up beforehand, ``signal``/``pthread_sigmask`` and
      ``getppid``, under locks CPython re-creates in the child (the GIL,
      the import lock) and glibc's malloc, which is fork-safe; it takes no
      lock of ZeroMQ's threads (a rank's) or of the Python threads of its
      process.
    * Its cost: with a ``preexec_fn`` the child is forked, not vforked,
      and runs Python before its exec -- 3 to 9 ms more per command on a
      loaded 2-core machine (``exec -r all -- true`` on 8 ranks: 292 ms
      before, 360 after, medians of 15), paid once by ``start`` and
      ``lease run``, and once per rank by ``exec`` on a set (whose
      commands, as ``flux exec``'s, should not outlive it either).
    """
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    prctl = libc_prctl()
    if prctl is None:
        return None
    parent = os.getpid()
    sig = int(PARENT_DEATH_SIGNAL)
    caught = [s for s in signal.valid_signals()
              if s not in (signal.SIGKILL, signal.SIGSTOP)
              and signal.getsignal(s) not in (signal.SIG_DFL, signal.SIG_IGN)]

    def hook(mask: Iterable[int]) -> Callable[[], None]:
        def arm() -> None:
            for s in caught:
                signal.signal(s, signal.SIG_DFL)
            prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
            ppid = os.getppid()
            if ppid not in (parent, 0):  # we died before the prctl
                os.kill(os.getpid(), sig)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return arm

    return hook


@contextlib.contextmanager
def _preexec() -> Iterator[Callable[[], None] | None]:
    """The ``preexec_fn`` of a spawn (:func:`_parent_death_hook`), with
    signals blocked while the ``with`` block forks (see there why)."""
    hook = _parent_death_hook()
    if hook is None:
        yield None
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        yield hook(mask)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def watch_exit(proc: subprocess.Popen[bytes]) -> asyncio.Future[int]:
    """A future of ``proc``'s exit status, resolved (and the process reaped)
    by the running loop when the process's pidfd becomes readable: on any
    loop, with no child watcher or thread."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[int] = loop.create_future()
    pidfd = os.pidfd_open(proc.pid)

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        exited.set_result(proc.wait())  # it has exited: this does not block

    loop.add_reader(pidfd, reap)
    return exited


def in_terminal_foreground() -> bool:
    """Whether this process is the foreground job of its controlling
    terminal (started at a shell's prompt, not in the background)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return False  # no controlling terminal
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def cannot_run_status(exc: OSError, argv0: str | None = None) -> int:
    """The exit status for a command that could not be started, as a shell
    (and POSIX) has it: 127 when it was not found, 126 when it was found
    but cannot be executed (a directory, a file without execute permission,
    an unknown format, a script whose ``#!`` interpreter is missing: that
    ``ENOENT`` is not the command's) -- a script can tell a typo from a bad
    install."""
    if exc.errno != errno.ENOENT:
        return 126
    return 126 if argv0 is not None and _interpreter_missing(argv0) is not None else 127


def cannot_run_message(argv0: str, exc: OSError) -> str:
    """``CMD: <strerror>``: what a shell says of a command it cannot run
    (``CMD: INTERP: bad interpreter: ...`` for a script whose ``#!``
    interpreter is missing, as bash says it)."""
    if not argv0:
        return ": command not found"  # (as bash says it)
    why = os.strerror(exc.errno) if exc.errno else str(exc)
    interp = _interpreter_missing(argv0) if exc.errno == errno.ENOENT else None
    return f"{argv0}: {interp}: bad interpreter: {why}" if interp else f"{argv0}: {why}"


def _interpreter_missing(argv0: str) -> str | None:
    """The ``#!`` interpreter of the file ``argv0`` names (a path, or found
    on ``PATH``), when there is such a file: execve's ``ENOENT`` is then
    that interpreter's, not the command's."""
    path = argv0 if os.sep in argv0 else shutil.which(argv0)
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            line = f.readline(256)
    except OSError:
        return None
    words = line[2:].split() if line.startswith(b"#!") else []
    return os.fsdecode(words[0]) if words else None


def exit_code(returncode: int) -> int:
    """A process's status as a shell reports it: a signal N is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


class Command:
    """A command run in an instance.

    Outside a terminal's foreground (a script, a service, a test, a job put
    in the background) it gets its own process group, so that stopping it
    reaches whatever it started (``sh -c 'sleep 300; echo after'`` loses
    its ``sleep`` too).  What is sent to our own group (a shell's ``kill
    %1``, a hangup) does not reach that one: the owner passes on each
    SIGINT, SIGTERM and SIGHUP it receives (:meth:`forward`).

    When we are the foreground job of a terminal (``kvbroker start --
    bash`` at a prompt), the command stays in our process group instead.  A
    group other than the terminal's foreground one cannot read the terminal
    (SIGTTIN: an interactive bash stops itself until it is in the
    foreground), and handing the terminal to the command's group
    (tcsetpgrp, as a shell does) would need us to follow the command's
    stops (Ctrl-Z), which asyncio does not report.  There the terminal
    sends Ctrl-C and a hangup to the whole foreground job, the command and
    its children included, so only SIGTERM is passed on; and the command
    alone is stopped, with SIGHUP -- what an interactive shell obeys (it
    ignores SIGTERM) and passes on to its jobs.  What else the command left
    running is not reached, as with GNU ``timeout --foreground``.

    As a shell's command, it inherits the file descriptors we were given
    (a make jobserver's, a redirection ``3>log``); our own are close-on-exec.

    If we die while it runs (a SIGKILL, the OOM killer), the kernel kills
    it (:data:`PARENT_DEATH_SIGNAL`, Linux): ``kvbroker kvs lease run``'s
    command must not outlive the keepalives of its lease, nor ``start``'s
    or ``exec``'s the supervisor that would stop it.
    """

    def __init__(self, proc: subprocess.Popen[bytes], own_group: bool) -> None:
        self.proc = proc
        self.own_group = own_group
        """The command leads its own process group (not in a terminal's foreground)."""
        self._exited = watch_exit(proc)

    @classmethod
    def spawn(cls, argv: list[str], env: dict[str, str], *, stdin: int | None = None,
              stdout: int | None = None, stderr: int | None = None,
              cwd: str | None = None, own_group: bool | None = None) -> Command:
        """Start ``argv`` (raises OSError if it cannot be executed).  Its
        standard streams are ours unless given (``subprocess.PIPE``,
        ``DEVNULL``): ``exec`` on several ranks reads their output to label
        it, and gives them no input to share.  Killed if we die (Linux:
        :func:`_parent_death_hook`).  It leads a process group of its own
        unless we are a terminal's foreground job (where it shares ours, to
        read the terminal), or as ``own_group`` says: a rank's ``rexec``
        commands always do, whatever terminal the rank was started at."""
        if not argv or not argv[0]:  # (Popen tried each PATH directory as the
            # program: "Permission denied", 126, where a shell says 127)
            raise FileNotFoundError(errno.ENOENT, "command not found", "")
        if own_group is None:
            own_group = not in_terminal_foreground()
        with _preexec() as preexec_fn:
            proc = subprocess.Popen(argv, env=env, close_fds=False, stdin=stdin, stdout=stdout,
                                    stderr=stderr, process_group=0 if own_group else None,
                                    preexec_fn=preexec_fn, cwd=cwd)
        return cls(proc, own_group)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (``-N``: killed by signal N)."""
        return self.proc.returncode

    async def wait(self) -> int:
        """Wait for the command to exit; its status (``-N``: signal N)."""
        return await asyncio.shield(self._exited)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command's process group (in a terminal: to
        the command alone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.own_group:
                # Once the command has exited, this reaches what is left of
                # its group (the kernel does not reuse the id of a group
                # that has a member).
                os.killpg(self.proc.pid, sig)
            elif not self._exited.done():
                self.proc.send_signal(sig)

    def forward(self, sig: int) -> None:
        """Pass on a signal we received.  In a terminal, SIGINT and SIGHUP
        came to the whole foreground job, the command included: sent again,
        they would interrupt it twice."""
        if self.own_group or sig not in (signal.SIGINT, signal.SIGHUP):
            self.signal(sig)

    def kill(self) -> None:
        """SIGKILL the command and what is left of its process group."""
        self.signal(signal.SIGKILL)

    @contextlib.contextmanager
    def forwarding_stop_signals(self) -> Iterator[None]:
        """While in the block, our :data:`STOP_SIGNALS` are passed on to the
        command (:meth:`forward`); leaving it with the command still
        running (an error of ours) kills it: it does not outlive us.
        Enter it right after :meth:`spawn`, with no await between, so that
        no signal is missed."""
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self.forward, sig)
        try:
            yield
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
            if self.returncode is None:
                self.kill()

    async def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """Stop the command (SIGTERM to its group; in a terminal, SIGHUP to
        it), wait up to ``timeout`` seconds, then :meth:`kill` -- so a
        command that ignores SIGTERM cannot keep us waiting.  Returns its
        exit status."""
        self.signal(signal.SIGTERM if self.own_group else signal.SIGHUP)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.wait()
        self.kill()
        return await self.wait()


def command_path(path: str) -> str:
    """``PATH`` for ``start``'s command, so that its ``kvbroker`` is this
    one, as Flux's driver does for ``flux start``: this command's
    directory just before the first other directory holding a
    ``kvbroker`` (a command of another venv found first ran another
    version against this instance), first if none holds one, and
    ``path`` as it is when this one is found first already."""
    mine = os.path.dirname(os.path.abspath(sys.argv[0]))
    if not os.access(os.path.join(mine, "kvbroker"), os.X_OK):
        return path  # (not run as the kvbroker command: python -m, a test harness)
    entries = path.split(":") if path else []
    for i, entry in enumerate(entries):
        here = entry or "."
        if os.path.realpath(here) == os.path.realpath(mine):
            return path
        exe = os.path.join(here, "kvbroker")
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return ":".join([*entries[:i], mine, *entries[i:]])
    return ":".join([mine, *entries])
