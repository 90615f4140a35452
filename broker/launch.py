"""Start an instance: N rank processes on this host (``kvbroker start``).

:class:`Instance` is also the harness tests and benchmarks use: it learns
readiness from each rank's ``ready`` line (never a sleep), notices a rank
that dies, and on stop sends SIGTERM, waits, then SIGKILLs -- so no process
or socket is left behind.  A rank that reports progress writing its
backlog to disk (``stopping <bytes>``, fewer each time) has its wait
restarted, up to :data:`STOP_CAP` times the stop timeout in all.  Its run
directory is private (mode 0700 unless guests are allowed) and removed on
stop -- or, if the launcher dies without stopping, by the last rank to exit
(``--cleanup-rundir``; of a given one that stays, the CURVE key file the
launcher wrote: ``--cleanup-curve-keys``).

The command ``kvbroker start -- CMD`` runs in the instance is a
:class:`broker.command.Command`.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import random
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from broker import attrs as battrs
from broker import forkserver, plugins
from broker.broker import local_socket_path
from broker.command import STOP_CAP, STOP_TIMEOUT
from broker.idset import encode_ranks
from broker.pipes import OutputProtocol, connect_read_pipe
from broker.pypath import child_env, module_command
from broker.topology import ancestors, children_of

START_TIMEOUT = 60.0
PARENT_EXIT_WAIT = 5.0
"""How long a rank that stopped because of its parent waits for a rank
above it to exit, to be reported in its place (:meth:`Instance._went_with_its_parent`)."""
SPAWN_ENV = "KVBROKER_SPAWN"
"""``fork`` or ``exec``: how :class:`Instance` starts ranks when not told
(see :attr:`Instance.spawn`)."""


class StartError(RuntimeError):
    """The instance could not be brought up."""


def exit_status(code: int) -> str:
    """A process's exit status as words: ``with status 1``, or for a
    negative ``returncode`` ``killed by signal 9 (SIGKILL)``."""
    if code >= 0:
        return f"with status {code}"
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    return f"killed by signal {-code}{name}"


def private_dir(path: str, what: str) -> None:
    """Make ``path`` if missing (mode 0700), and refuse (:class:`StartError`)
    one that another user could tamper with: not owned by this user, or
    writable by group or others, or reached by a symlink (in its last
    component) someone else owns.  As Flux
    checks its rundir and statedir: a directory made first by someone else
    (a predictable name under /tmp) would let them read the content store,
    plant a checkpoint, or replace a rank's socket with their own."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: said below
    except OSError as exc:
        raise StartError(f"{what} {path}: {exc.strerror}") from None
    uid = os.geteuid()
    try:
        st = os.stat(path)
        # the last component's symlinks (ours -> theirs -> ours), not its
        # parents' (as Flux: a parent is the system's or the user's choice)
        hop, links = path, []
        for _ in range(40):  # (the kernel's own limit)
            link = os.lstat(hop)
            if not stat.S_ISLNK(link.st_mode):
                break
            links.append((hop, link.st_uid))
            hop = os.path.join(os.path.dirname(hop), os.readlink(hop))
    except OSError as exc:
        raise StartError(f"{what} {path}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StartError(f"{what} {path}: not a directory")
    if st.st_uid != uid:
        raise StartError(f"{what} {path}: owned by uid {st.st_uid}, not by this user "
                         f"(uid {uid})")
    for link_path, owner in links:
        if owner != uid:
            raise StartError(f"{what} {path}: the symlink {link_path} is owned by uid "
                             f"{owner}, not by this user (uid {uid})")
    if st.st_mode & 0o022:
        mode = f"{stat.S_IMODE(st.st_mode):o}"
        if st.st_mode & stat.S_ISVTX:
            # A shared directory such as /tmp: "chmod go-w" would take it
            # from everyone else; the way out is a directory of one's own.
            raise StartError(f"{what} {path}: writable by group or others (mode {mode}: a "
                             "shared, sticky directory, as /tmp); make a private directory "
                             f"in it (mkdir -m 700 {os.path.join(path, 'NAME')}) and give "
                             "that, or choose another directory")
        raise StartError(f"{what} {path}: writable by group or others (mode {mode}); "
                         "chmod go-w, or choose another directory")


def writable_dir(path: str, what: str) -> None:
    """Refuse (:class:`StartError`) a directory this process cannot write in
    (a read-only file system, ``chmod u-w``), saying why, before any rank
    starts: a rank failed then, and its reason was one log line among the
    launcher's own errors.  Tried by making a file and removing it (root
    passes ``os.access`` on a read-only file system)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".kvb-write-test-", dir=path)
    except OSError as exc:
        raise StartError(f"{what} {path}: cannot write in it: {exc.strerror}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


SOCKET_PATH_MAX = 100
"""Longest socket path a run directory may need: an AF_UNIX address (and so
a ZeroMQ ``ipc://`` endpoint) holds 108 bytes on Linux, 104 on macOS."""


RUNDIR_NAME = "kvb-XXXXXXXX"
"""The shape of a run directory's name :func:`make_rundir` makes
(``tempfile.mkdtemp``'s eight random characters)."""


def socket_room(path: str) -> int:
    """The bytes of an AF_UNIX address ``path`` takes (the limit is in
    bytes: ``é`` takes two), with ZeroMQ's ``ipc://``."""
    return len(os.fsencode(path)) + 6


def tmpdir_fits(base: str) -> bool:
    """Whether a run directory made in ``base`` leaves room for every rank's
    socket (``BASE/kvb-XXXXXXXX/local-99999``, and ZeroMQ's ``ipc://``):
    ``base`` of at most 69 bytes."""
    path = os.path.join(base, RUNDIR_NAME)
    return socket_room(local_socket_path(path, 99999)) <= SOCKET_PATH_MAX


def make_rundir() -> str:
    """A private, short directory for sockets (AF_UNIX paths are ~107 bytes max).

    Its path is absolute, whatever ``$TMPDIR`` says: the ``rundir``
    attribute and ``KVBROKER_URI`` (``local://RUNDIR/local-0``) are read by
    programs in other directories, where a relative one named nothing.

    ``$TMPDIR`` is used whenever the sockets fit in it (:func:`tmpdir_fits`):
    a fixed cut at 60 characters put a 61-69 character one (pytest's own
    ``tmp_path`` under xdist) aside without a word.  One too long is not
    refused (Flux's "overflow"): the run directory is made in /tmp, and a
    warning on stderr says so, since that is not where the user asked."""
    tmpdir = os.environ.get("TMPDIR") or ""
    base = os.path.abspath(tmpdir) if tmpdir else "/tmp"
    if not tmpdir_fits(base):
        print(f"kvbroker: warning: $TMPDIR {tmpdir} is too long for the ranks' sockets "
              f"({len(os.fsencode(base))} bytes, at most {SOCKET_PATH_MAX - 31} here): the run "
              "directory is made in /tmp", file=sys.stderr, flush=True)
        base = "/tmp"
    try:
        path = tempfile.mkdtemp(prefix="kvb-", dir=base)
    except OSError as exc:
        where = f"$TMPDIR {tmpdir}" if tmpdir and base != "/tmp" else base
        raise StartError(f"cannot make a run directory in {where}: {exc.strerror}") from None
    if socket_room(local_socket_path(path, 99999)) > SOCKET_PATH_MAX:
        raise StartError(f"run directory path too long for sockets: {path}")
    return path


def check_statedir_outside(statedir: str, rundir: str) -> None:
    """Refuse (:class:`StartError`) a statedir inside, or equal to, a
    rundir ``rundir-cleanup=1`` removes at the stop (``start`` and
    ``kvbroker broker``): a statedir (the content store and its
    checkpoints) is never removed, and removing the rundir took it with it.
    Refused rather than the rundir kept: the user asked for both, and
    either choice made silently loses what one of them expected.
    (Without ``rundir-cleanup=1`` the statedir, made first, makes the
    rundir one that was there, which stays.)  Compared as real paths: a
    symlink does not hide it."""
    real_state, real_run = os.path.realpath(statedir), os.path.realpath(rundir)
    if os.path.commonpath([real_state, real_run]) != real_run:
        return
    where = "is the rundir" if real_state == real_run else "is inside the rundir"
    raise StartError(f"statedir {statedir} {where} {rundir}, which -S rundir-cleanup=1 "
                     "removes at the stop (a statedir is never removed): give a statedir "
                     "outside the rundir, or drop rundir-cleanup=1")


def claim_rundir(path: str) -> int:
    """``path`` open, and locked shared for this instance's life: refused
    (:class:`StartError`) while another instance's processes hold it --
    its ranks each hold a shared lock on it until they exit
    (:func:`broker.rank.hold_rundir`), well after their rank 0 stops
    answering, and the last one out removes a run directory its launcher
    made and could not (killed).  A new start on it passed the old check
    (rank 0 answers) in that window, and the old instance's last rank then
    removed the directory with the new one's sockets in it (found by a
    review).  The exclusive try is the check; the lock kept is shared,
    as the new ranks' are, so two starts at once on one directory cannot
    both pass it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StartError(f"rundir {path} is in use: processes of another instance still "
                         "hold it (its ranks stopping?); try again once they have exited"
                         ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_rundir(path: str) -> None:
    """Remove the run directory ``path`` with all it holds (``rundir-cleanup``,
    or one the start made).  Given as a symlink (``--rundir link``, checked
    by :func:`private_dir`: every link the owner's), the directory it names
    goes, and then the link: the user asked for the run directory to go,
    and ``shutil.rmtree`` refuses a symlink -- hidden by ``ignore_errors``,
    nothing was removed, without a word."""
    if os.path.islink(path):
        shutil.rmtree(os.path.realpath(path), ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def free_tcp_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 for ranks to bind later.

    Between this check and a rank's bind another process may take a port.
    The likely taker is any process's outgoing connection, which the kernel
    gives a port from the ephemeral range; so ports are drawn at random
    *below* that range (``ip_local_port_range``), where only an explicit
    bind can land.  Each port stays bound here until all are drawn: drawn
    one at a time and let go at once, two ranks of an instance could be
    given the same port (one pair in ~23,000 draws), and the second rank's
    bind failed the start.  Falls back to ephemeral ports."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    with contextlib.ExitStack() as held:
        for _ in range(count):
            s = held.enter_context(socket.socket())
            for _ in range(100 if low > 11024 else 0):
                try:
                    s.bind(("127.0.0.1", random.randrange(10000, low)))
                    break
                except OSError:  # (taken: by another process, or drawn already)
                    continue
            else:
                s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
    return ports


def _signal(proc: RankProcess, sig: int) -> None:
    """Send ``sig`` to a rank that asyncio has not seen exit.

    ``os.kill``, not ``proc.send_signal``: Popen's polls first (bpo-38630),
    and that ``waitpid`` reaps a rank that has just exited behind the back of
    asyncio's child watcher, which then logs "Unknown child process pid N,
    will report returncode 255" and reports 255 for it.  A pid is not reused
    before it is reaped, so this reaches the rank or its zombie."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def _pipes(n: int) -> list[tuple[int, int]]:
    """``n`` pipes, or none: those made before one that fails (``EMFILE``:
    a size past the descriptor limit) are closed.  Left open, every later
    start in the process failed with ``EMFILE`` too, and the run directory
    could not be removed."""
    pipes: list[tuple[int, int]] = []
    try:
        for _ in range(n):
            pipes.append(os.pipe())
    except BaseException:
        for r, w in pipes:
            os.close(r)
            os.close(w)
        raise
    return pipes


async def _kill_spawner(spawner: SpawnerProcess,
                        ranks: Sequence[ForkedRank]) -> None:
    """SIGKILL a start's spawner and the ranks it reported forked, and reap
    the spawner, through further cancels (left running, its transport was
    collected with a ResourceWarning).  Ranks it reported that were not
    read yet (a start cancelled between the spawner's fork and the
    launcher's read of it) are killed too, and waited for: else they ran
    on until they noticed the launcher's watch pipe close."""
    for pid in (spawner.pid, *(r.pid for r in ranks)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reaped = asyncio.ensure_future(_reap_killed(spawner))
    while not reaped.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({reaped})


async def _reap_killed(spawner: SpawnerProcess) -> None:
    await spawner.wait()
    if spawner.stdout is None:
        return
    unread: list[int] = []
    with contextlib.suppress(TimeoutError, ValueError):
        async with asyncio.timeout(PARENT_EXIT_WAIT):  # (its end of file: it is gone)
            while line := await spawner.stdout.readline():
                word, _, rest = line.decode().partition(" ")
                if word == "pid":
                    unread.append(int(rest.split()[1]))
    for pid in unread:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in unread:
        await _exited(pid)


async def _exited(pid: int, patience: float = 10.0) -> None:
    """Until process ``pid``, not this one's child, has exited (a pidfd
    becomes readable then, zombie or not), or ``patience`` seconds where
    pidfds are missing (polled)."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        deadline = loop.time() + patience
        while loop.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            await asyncio.sleep(0.01)
        return
    try:
        readable: asyncio.Future[None] = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(pidfd, ready)
        try:
            await readable
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)


class ForkedRank:
    """A rank forked by the instance's spawner (:mod:`broker.spawner`),
    with what :class:`Instance` and its users take from an
    :class:`asyncio.subprocess.Process`: ``pid``, ``returncode``,
    ``stdout``, ``wait()``, ``send_signal()``, ``kill()``.  Its exit
    status comes from the spawner, its parent."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def _ended(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self._exited.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def send_signal(self, sig: int) -> None:
        _signal(self, sig)

    def kill(self) -> None:
        _signal(self, signal.SIGKILL)


RankProcess = asyncio.subprocess.Process | ForkedRank
"""A rank's process, as :class:`Instance` holds it."""

SpawnerProcess = asyncio.subprocess.Process | forkserver.ServedSpawner
"""An instance's spawner: this process's child, or the fork server's."""


class Instance:
    """An instance of ``size`` ranks on this host.

    ``async with Instance(size=4, fanout=2) as inst: inst.uri(3)``
    """

    def __init__(
        self,
        size: int = 1,
        fanout: int = 32,
        *,
        event_loop: str = "auto",
        statedir: str | None = None,
        rundir: str | None = None,
        attrs: dict[str, Any] | None = None,
        stderr_path: str | None = None,
        python: str = sys.executable,
        spawn: str | None = None,
        rundir_cleanup: bool | None = None,
        on_rank_command: Callable[[int, list[str]], None] | None = None,
        config_file: str | None = None,
    ) -> None:
        for name, number in (("size", size), ("fanout", fanout)):
            # (a str or float failed later with Python's words; True was
            # taken as 1 and refused by each rank's parser)
            if type(number) is not int:
                raise TypeError(f"{name} must be an int, not {type(number).__name__}")
            if number < 1:
                raise ValueError(f"{name} must be at least 1")
        from broker.loops import LOOP_NAMES

        if event_loop not in LOOP_NAMES:  # (else each rank failed with a traceback)
            raise ValueError(f"event_loop must be one of {', '.join(LOOP_NAMES)}, "
                             f"not {event_loop!r}")
        self.size = size
        self.fanout = fanout
        self.event_loop = event_loop
        self.config_file = os.path.abspath(config_file) if config_file else None
        """``start --config FILE``: each rank's ``config.path``, and the
        attributes of its ``[attrs]`` under ``attrs`` (they were not
        applied: only ``kvbroker start`` read them)."""
        file_attrs: dict[str, Any] = {}
        if self.config_file:  # (BootstrapError, a ValueError, naming the file)
            from broker import bootstrap

            file_attrs = bootstrap.load_start_attrs(self.config_file, size)
        # (start's options, not the ranks' attributes -- the arguments win,
        # kvbroker start giving them all, having read the file itself;
        # broker.recovery-mode is start --recovery's)
        statedir = file_attrs.pop("statedir", None) if statedir is None else statedir
        rundir = file_attrs.pop("rundir", None) if rundir is None else rundir
        cleanup = file_attrs.pop("rundir-cleanup", None)
        if rundir_cleanup is None and cleanup is not None:
            rundir_cleanup = battrs.boolean(cleanup)
        for name in ("statedir", "rundir", "broker.recovery-mode"):
            file_attrs.pop(name, None)  # (those the arguments gave)
        self.statedir = os.path.abspath(statedir) if statedir else None
        self.rundir_option = os.path.abspath(rundir) if rundir else None
        """The run directory asked for (Flux's ``flux start --rundir``),
        made if missing; None: a new one under ``$TMPDIR`` at each start.
        One this instance made is removed at stop, one that was there is not."""
        self._rundir_made = True
        self._rundir_fd: int | None = None
        """The run directory, open and locked shared while this instance
        runs (:func:`claim_rundir`)."""
        self.rundir_cleanup = rundir_cleanup
        """Flux's ``rundir-cleanup``: remove the run directory at stop (True)
        or keep it, emptied of what the start wrote (False), whoever made
        it; None: remove it if this instance made it."""
        self.on_rank_command = on_rank_command
        """Called with each rank and its command line (``python -P -m broker.rank
        ...``: what it runs, forked or executed) as it is started; what
        ``kvbroker start -v`` prints, as Flux's ``flux start -v``."""
        self._rundir_mode: int | None = None
        self._keyfile: str | None = None
        """The CURVE key file this start wrote in the run directory (tcp),
        removed at stop: never one it found there."""
        """The mode of a run directory that was there, while guests make it 0755."""
        self.attrs = {**file_attrs, **(attrs or {})}
        self.stderr_path = stderr_path
        self.python = python
        spawn = spawn or os.environ.get(SPAWN_ENV) or "auto"
        if spawn not in ("auto", "fork", "exec"):
            raise ValueError(f"spawn must be auto, fork or exec, not {spawn!r}")
        if spawn == "auto":
            spawn = "fork" if python == sys.executable and hasattr(os, "fork") else "exec"
        self.spawn = spawn
        """``fork``: the ranks are forked by one spawner process that
        imported them once (:mod:`broker.spawner`); ``exec``: each is
        ``python -P -m broker.rank``, as another interpreter (``python``)
        needs.  ``auto`` (the default, or ``$KVBROKER_SPAWN``) forks."""
        self._reapers: list[asyncio.Task[None]] = []
        self.rundir = ""
        self.endpoints: dict[int, str] = {}
        """The ``tcp://`` endpoints of ranks with children (``tbon.transport=tcp``);
        empty otherwise."""
        self.procs: list[RankProcess] = []
        self.failed: asyncio.Future[tuple[int, int]] | None = None
        """``(rank, exit status)`` of the first rank that exited unasked."""
        self.ended: asyncio.Future[tuple[int, int] | None] | None = None
        """As :attr:`failed`, or None once a rank was shut down from inside
        (``kvbroker shutdown [--rank R]``: the rank said ``shutdown``, then
        it and its subtree exit 0) -- what ``kvbroker start`` waits on."""
        self.killed: list[int] = []
        """The ranks the last :meth:`stop` had to SIGKILL: they did not exit
        within its timeout of their SIGTERM (a hung or stopped process)."""
        self.shutdown_rank: int | None = None
        """The rank that was shut down, once :attr:`ended` is None: 0 for
        the whole instance, else the top of the subtree that stopped."""
        self.shutdown_why = "kvbroker shutdown"
        """How :attr:`shutdown_rank` was asked to stop: ``kvbroker
        shutdown``, or the signal sent to it (``signal SIGTERM``, as
        ``systemctl stop`` or ``kill`` asks a rank to stop)."""
        self.left_to_write: list[int | None] = []
        """Per rank, the fewest bytes it said it still had to write while it
        stopped (``stopping <bytes>``), None if it never said."""
        self._deadlines: dict[int, asyncio.Timeout] = {}
        self._stop_timeout = STOP_TIMEOUT
        self._stop_cap = 0.0
        self._shutdown_said: list[asyncio.Future[str]] = []
        self._parent_gone_said: list[asyncio.Future[None]] = []
        self._stdout_read: list[asyncio.Future[None]] = []
        self._exited: list[asyncio.Future[None]] = []
        self._watch_w: int | None = None
        self._waiters: list[asyncio.Task[None]] = []
        self._stopping = False
        self._starting = False
        """:meth:`start` runs."""
        self._stops = 0
        """:meth:`stop` calls running (a start's own, when it fails, too)."""

    def uri(self, rank: int = 0) -> str:
        """The URI of rank ``rank``'s local socket (``RuntimeError`` before
        :meth:`start` has made the run directory)."""
        if not self.rundir:
            raise RuntimeError("the instance is not started: no URI yet")
        if type(rank) is not int or not 0 <= rank < self.size:  # (a path nothing listens at)
            raise ValueError(f"rank {rank!r} is not one of this instance's (0-{self.size - 1})")
        return f"local://{local_socket_path(self.rundir, rank)}"

    def __repr__(self) -> str:
        if not self.rundir:
            state = "not started"
        elif self._stopping:
            state = "stopping" if any(p.returncode is None for p in self.procs) else "stopped"
        else:
            alive = sum(p.returncode is None for p in self.procs)
            state = f"{alive} of {self.size} ranks running in {self.rundir}"
        return f"<Instance size={self.size} fanout={self.fanout} {state}>"

    async def __aenter__(self) -> Instance:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def check(self) -> None:
        """Refuse, before any rank starts, what would make the ranks fail:
        a bad attribute value (:func:`broker.attrs.check_instance`), a
        statedir that is not a directory or that another user could tamper
        with (:func:`private_dir`).  :class:`StartError` says which."""
        try:
            self.attrs = battrs.from_flux(self.attrs, self.size)
            battrs.check_instance(self.attrs)
        except battrs.AttrError as exc:
            raise StartError(str(exc)) from None
        if self.statedir:
            self._check_statedir_outside_a_removed_rundir()
            private_dir(self.statedir, "statedir")

    def _check_statedir_outside_a_removed_rundir(self) -> None:
        if self.statedir and self.rundir_option and self.rundir_cleanup:
            check_statedir_outside(self.statedir, self.rundir_option)

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the ranks and wait until every one answers.  After
        :meth:`stop` it may be called again: with a ``statedir`` the new
        ranks resume from what the old ones saved.  ``RuntimeError`` while
        it is started, being started or being stopped (a start beside
        either took over the other's run directory and pipe, and one was
        left behind)."""
        if self._starting:
            raise RuntimeError("the instance is being started already")
        if self._stops:
            raise RuntimeError("the instance is being stopped: await its stop() first")
        if self.procs and not self._stopping:
            raise RuntimeError("the instance is already started: stop() it first")
        self._starting = True
        try:
            await self._start(timeout)
        finally:
            self._starting = False

    async def _start(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self.check()
        self.procs, self._waiters, self._stopping, self.killed = [], [], False, []
        self.shutdown_rank, self.shutdown_why = None, "kvbroker shutdown"
        self.left_to_write = [None] * self.size
        self.failed = loop.create_future()
        self.ended = loop.create_future()
        self._shutdown_said = [loop.create_future() for _ in range(self.size)]
        self._parent_gone_said = [loop.create_future() for _ in range(self.size)]
        self._stdout_read = [loop.create_future() for _ in range(self.size)]
        self._exited = [loop.create_future() for _ in range(self.size)]
        self.rundir = self._make_rundir()
        ready: set[int] = set()
        try:
            # (the spawning too: a hung spawner; a rank that reports
            # progress, ``starting <count>``, restarts the deadline)
            async with asyncio.timeout(timeout) as bound:
                await self._spawn_ranks()
                await asyncio.gather(*(self._await_ready(r, p, bound, timeout, ready)
                                       for r, p in enumerate(self.procs)))
        except BaseException as exc:
            # (cancelled too, even while spawning: the ranks started so far
            # and the run directory must not outlive the failed start)
            await self.stop()
            if isinstance(exc, TimeoutError):
                late = [r for r in range(self.size) if r not in ready]
                which = (f"rank {late[0]}" if len(late) == 1
                         else f"ranks {encode_ranks(late)}")
                msg = (f"instance of size {self.size} did not start in {timeout:g}s "
                       f"({which} not ready, and said no progress)")
                raise StartError(msg) from None
            raise
        for rank, proc in enumerate(self.procs):
            self._waiters.append(loop.create_task(self._watch(rank, proc)))
            self._waiters.append(loop.create_task(self._read_stdout(rank, proc)))

    def _claim_rundir(self, path: str) -> None:
        self._rundir_fd = claim_rundir(path)

    def _make_rundir(self) -> str:
        """A new run directory, or the one asked for: private to this user
        (:func:`private_dir`), short enough for the sockets, and not another
        running instance's -- whose ranks' sockets ours would take over (a
        rank replaces a socket left at its path: a restart)."""
        path = self.rundir_option
        if path is None:
            self._rundir_made = True
            path = make_rundir()
            self._claim_rundir(path)
            return path
        # (checked before anything is made: a refused path left its
        # directories behind)
        if socket_room(local_socket_path(path, self.size - 1)) > SOCKET_PATH_MAX:
            raise StartError(f"rundir {path}: too long a path for the ranks' sockets "
                             f"(at most {SOCKET_PATH_MAX - 6 - len('/local-')} bytes "
                             "here)")
        self._rundir_made = not os.path.lexists(path)
        private_dir(path, "rundir")
        writable_dir(path, "rundir")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(local_socket_path(path, 0))
        except OSError:
            pass  # (no socket there, or a stale one: nobody answers)
        else:
            raise StartError(f"rundir {path} is in use by a running instance (its rank 0 "
                             "answers there)")
        finally:
            sock.close()
        self._claim_rundir(path)
        return path

    async def _spawn_ranks(self) -> None:
        """Start the rank processes (not waiting for them to be ready)."""
        if battrs.ALLOW_GUEST_USER.value(self.attrs):
            if not self._rundir_made:  # (one of the user's: its mode is put back at stop)
                self._rundir_mode = stat.S_IMODE(os.stat(self.rundir).st_mode)
            os.chmod(self.rundir, 0o755)
        endpoints: dict[int, str] = {}
        curve_args: list[str] = []
        if battrs.TRANSPORT.value(self.attrs) == "tcp":
            from broker.curve import generate_keys

            parents = [r for r in range(self.size) if children_of(r, self.fanout, self.size)]
            for r, port in zip(parents, free_tcp_ports(len(parents)), strict=True):
                endpoints[r] = f"tcp://127.0.0.1:{port}"
            keyfile = os.path.join(self.rundir, "curve.key")
            try:
                generate_keys(keyfile)
            except OSError as exc:  # (a StartError: exit 2, naming the rundir)
                raise StartError(f"rundir {self.rundir}: cannot write the instance's CURVE "
                                 f"key file {keyfile}: {exc.strerror}") from None
            self._keyfile = keyfile
            curve_args = ["--curve-keys", keyfile]
        self.endpoints = endpoints
        # Ranks of this interpreter find their modules where we did, without
        # reading entry points again (broker.plugins).
        targets = (plugins.module_targets(battrs.module_names(self.attrs))
                   if self.python == sys.executable else {})
        watch_r, self._watch_w = os.pipe()
        try:
            await self._spawn_with(watch_r, endpoints, curve_args, targets)
        finally:
            os.close(watch_r)  # (the ranks have theirs; failing before, it leaked)

    async def _spawn_with(self, watch_r: int, endpoints: dict[int, str],
                          curve_args: list[str], targets: dict[str, str]) -> None:
        """:meth:`_spawn_ranks` with the watch pipe's read end made."""
        argvs = []
        for rank in range(self.size):
            argv = [
                "--rank", str(rank), "--size", str(self.size),
                "--fanout", str(self.fanout), "--rundir", self.rundir,
                "--event-loop", self.event_loop,
                "--attrs", json.dumps(self.attrs),
                "--endpoints", json.dumps(endpoints),
                "--module-targets", json.dumps(targets),
                "--watch-fd", str(watch_r), *curve_args,
            ]
            if self._removes_rundir():  # (the last rank out removes it, if we cannot)
                argv.append("--cleanup-rundir")
            elif curve_args:  # (or, in one that stays, the key file we wrote)
                argv.append("--cleanup-curve-keys")
            if self.statedir:
                argv += ["--statedir", self.statedir]
            if self.config_file:
                argv += ["--config-file", self.config_file]
            argvs.append(argv)
            if self.on_rank_command is not None:
                self.on_rank_command(rank, [*module_command(self.python, "broker.rank"), *argv])
        env = child_env(dict(os.environ), self.python)
        env.pop("KVBROKER_URI", None)
        env.pop("KVBROKER_RANK", None)
        stderr = None
        if self.stderr_path:
            try:
                stderr = open(self.stderr_path, "ab")  # noqa: SIM115
            except OSError as exc:
                raise StartError(f"stderr_path {self.stderr_path}: "
                                 f"{exc.strerror or exc}") from None
        try:
            if self.spawn == "fork":
                preload = sorted({t.partition(":")[0] for t in targets.values()})
                if self.event_loop != "asyncio":
                    preload.append("uvloop")  # (the loop every rank makes)
                await self._fork_ranks(argvs, preload, watch_r, env, stderr)
            else:
                for argv in argvs:
                    await self._exec_rank(argv, watch_r, env, stderr)
        finally:
            if stderr is not None:
                stderr.close()

    async def _exec_rank(self, argv: list[str], watch_r: int, env: dict[str, str],
                         stderr: Any) -> None:
        """Start one rank as ``python -P -m broker.rank ARGV``."""
        async def start() -> list[RankProcess]:
            return [await asyncio.create_subprocess_exec(
                *module_command(self.python, "broker.rank"), *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr, stdin=asyncio.subprocess.DEVNULL, pass_fds=(watch_r,), env=env,
                start_new_session=True)]

        await self._keep_started(start())

    async def _fork_ranks(self, argvs: list[list[str]], preload: list[str], watch_r: int,
                          env: dict[str, str], stderr: Any) -> None:
        """Start every rank from one spawner (:mod:`broker.spawner`), which
        imports them once and forks each."""
        starting = asyncio.ensure_future(self._spawner(argvs, preload, watch_r, env, stderr))
        try:
            spawner, readers = await asyncio.shield(starting)
        except asyncio.CancelledError:
            while not starting.done():  # (as _keep_started: the process may exist)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({starting})
            if not starting.cancelled() and starting.exception() is None:
                await _kill_spawner(starting.result()[0], [])
            raise
        self.procs.extend(await self._forked(spawner, readers))

    async def _keep_started(self, starting: Awaitable[Sequence[RankProcess]]) -> None:
        """Add the processes ``starting`` starts to :attr:`procs` -- also
        when cancelled once they may exist: it waits for them then, through
        further cancels (starting takes moments, and uvloop leaves a child
        running), so that :meth:`stop` ends them too, and re-raises."""
        task = asyncio.ensure_future(starting)
        try:
            self.procs.extend(await asyncio.shield(task))
        except asyncio.CancelledError:
            while not task.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({task})
            if not task.cancelled() and task.exception() is None:
                self.procs.extend(task.result())
            raise

    async def _spawner(self, argvs: list[list[str]], preload: list[str], watch_r: int,
                       env: dict[str, str], stderr: Any,
                       ) -> tuple[SpawnerProcess, list[asyncio.StreamReader]]:
        """Start the spawner and give it the ranks to fork; its process and
        the readers of the ranks' standard outputs.  With a fork server
        (``$KVBROKER_FORKSERVER``, :mod:`broker.forkserver`) that will
        serve this launcher, the spawner is forked by it."""
        pipes = _pipes(len(argvs))
        spec = {"preload": preload, "keep": [watch_r],
                "ranks": [{"argv": argv, "stdout": w} for argv, (_, w) in zip(argvs, pipes,
                                                                               strict=True)]}
        spawner: SpawnerProcess | None = None
        try:
            if self.python == sys.executable:
                spawner = await forkserver.start_spawner(
                    self.rundir, spec, [watch_r, *(w for _, w in pipes)], env, stderr)
            if spawner is None:
                spawner = await self._exec_spawner(spec, pipes, watch_r, env, stderr)
        except BaseException:
            for r, w in pipes:
                os.close(r)
                os.close(w)
            raise
        for _, w in pipes:
            os.close(w)
        readers = []
        for r, _ in pipes:
            reader = asyncio.StreamReader(limit=1 << 20)
            await connect_read_pipe(functools.partial(OutputProtocol, reader),
                                    os.fdopen(r, "rb", 0))
            readers.append(reader)
        return spawner, readers

    async def _exec_spawner(self, spec: dict[str, Any], pipes: list[tuple[int, int]],
                            watch_r: int, env: dict[str, str], stderr: Any,
                            ) -> asyncio.subprocess.Process:
        """``python -P -m broker.spawner RUNDIR`` (:mod:`broker.pypath`: never
        a module of the working directory), given ``spec`` on its standard
        input."""
        spawner = await asyncio.create_subprocess_exec(
            *module_command(self.python, "broker.spawner"), self.rundir,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
            pass_fds=(watch_r, *(w for _, w in pipes)), env=env, start_new_session=True)
        assert spawner.stdin is not None
        spawner.stdin.write(json.dumps(spec).encode())
        spawner.stdin.close()
        return spawner

    async def _forked(self, spawner: SpawnerProcess,
                      readers: list[asyncio.StreamReader]) -> list[ForkedRank]:
        """The ranks as the spawner reports them forked.  Cancelled (a
        start's timeout, a Ctrl-C), the spawner and the ranks it reported
        are killed: a spawner that hangs (a module whose import blocks,
        one stopped) held the start, its timeout and its signals for as
        long as it hung; a rank not reported yet exits when the launcher's
        watch pipe closes."""
        loop = asyncio.get_running_loop()
        assert spawner.stdout is not None
        ranks: list[ForkedRank] = []
        try:
            while len(ranks) < len(readers):
                line = await spawner.stdout.readline()
                word, _, rest = line.decode().partition(" ")
                if word != "pid":
                    await spawner.wait()
                    raise StartError(f"the rank spawner exited "
                                     f"{exit_status(spawner.returncode or 0)} having started "
                                     f"{len(ranks)} of {len(readers)} ranks")
                ranks.append(ForkedRank(int(rest.split()[1]), readers[len(ranks)]))
        except asyncio.CancelledError:
            await _kill_spawner(spawner, ranks)
            raise
        # (not among the _waiters, which a stop cancels: the ranks it
        # signalled are still to be reaped)
        self._reapers = [t for t in self._reapers if not t.done()]
        self._reapers.append(loop.create_task(self._reap(spawner, ranks)))
        return ranks

    @staticmethod
    async def _reap(spawner: SpawnerProcess, ranks: list[ForkedRank]) -> None:
        """The ranks' exits, as their parent the spawner reports them; the
        last rank's once the spawner itself is gone, so that nothing of the
        instance is left running when :meth:`stop` returns."""
        assert spawner.stdout is not None
        while line := await spawner.stdout.readline():
            word, _, rest = line.decode().partition(" ")
            if word == "exit":
                number, code = (int(x) for x in rest.split())
                if sum(r.returncode is None for r in ranks) == 1:
                    await spawner.wait()
                ranks[number]._ended(code)
        # The spawner is gone (killed?) with ranks it did not report: they
        # are no one's children now, and cannot be waited for.
        for r in ranks:
            if r.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.pid, signal.SIGKILL)
                await _exited(r.pid)
                r._ended(-signal.SIGKILL)
        await spawner.wait()

    async def _await_ready(self, rank: int, proc: RankProcess, bound: asyncio.Timeout,
                           timeout: float, ready: set[int]) -> None:
        """Until the rank says ``ready``; each ``starting <count>`` it says
        before (its start-up work goes on: rank 0 restoring an archive)
        gives the whole start ``timeout`` seconds more from then."""
        assert proc.stdout is not None
        while True:
            line = await proc.stdout.readline()
            if line.startswith(b"starting "):
                bound.reschedule(asyncio.get_running_loop().time() + timeout)
                continue
            break
        if not line.startswith(b"ready"):
            code = await proc.wait()
            raise StartError(f"rank {rank} exited {exit_status(code)} during start-up")
        ready.add(rank)

    async def _read_stdout(self, rank: int, proc: RankProcess) -> None:
        """A rank prints ``shutdown`` (after ``ready``) when a client shut it
        down, or ``stopped SIGNAL`` when a signal asked it to stop, before it
        tells any rank below it to stop; ``parent-gone`` when it stops
        because of its parent; and ``stopping <bytes>`` while it stops with
        bytes left to write."""
        assert proc.stdout is not None
        said = self._shutdown_said[rank]
        try:
            while line := await proc.stdout.readline():
                word, _, arg = line.strip().partition(b" ")
                if word == b"shutdown" and not said.done():
                    said.set_result("kvbroker shutdown")
                elif word == b"stopped" and arg and not said.done():
                    said.set_result(f"signal {arg.decode(errors='replace')}")
                elif word == b"parent-gone" and not self._parent_gone_said[rank].done():
                    self._parent_gone_said[rank].set_result(None)
                elif word == b"stopping" and arg.isdigit():
                    self._progress(rank, int(arg))
        finally:
            if not self._stdout_read[rank].done():
                self._stdout_read[rank].set_result(None)

    def _progress(self, rank: int, left: int) -> None:
        """Rank ``rank`` still has ``left`` bytes to write: fewer than it
        ever said before is progress, which restarts its stop deadline
        (never past the cap); the same or more is not (a hung disk)."""
        lowest = self.left_to_write[rank]
        self.left_to_write[rank] = left if lowest is None else min(lowest, left)
        timer = self._deadlines.get(rank)
        if timer is not None and lowest is not None and left < lowest:
            now = asyncio.get_running_loop().time()
            timer.reschedule(min(now + self._stop_timeout, self._stop_cap))

    async def _watch(self, rank: int, proc: RankProcess) -> None:
        code = await proc.wait()
        self._exited[rank].set_result(None)
        shut_down = await self._shut_down_above(rank) if code == 0 else None
        if shut_down is None and not self._stopping and await self._went_with_its_parent(rank):
            return  # (the rank above that went reports it)
        if self._stopping or self.ended is None or self.ended.done():
            return
        if shut_down is not None:
            self.shutdown_rank = shut_down
            self.shutdown_why = self._shutdown_said[shut_down].result()
            self.ended.set_result(None)
            return
        assert self.failed is not None
        self.failed.set_result((rank, code))
        self.ended.set_result((rank, code))

    async def _shut_down_above(self, rank: int) -> int | None:
        """The highest of ``rank`` and its ancestors that said ``shutdown``
        (ancestors have lower numbers), or None: the rank stopped alone (it
        was sent a signal, or shut down by itself).

        A shutdown reaches a subtree through its top rank, which printed it
        first: the line is in that rank's pipe already, maybe not read yet,
        so it is waited for, briefly."""
        chain = [rank, *ancestors(rank, self.fanout)]
        said = [self._shutdown_said[r] for r in chain]
        if not any(f.done() for f in said):
            await asyncio.wait(said, timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
        done = [r for r, f in zip(chain, said, strict=True) if f.done()]
        return min(done) if done else None

    async def _went_with_its_parent(self, rank: int) -> bool:
        """Whether ``rank``, which exited unasked, stopped because of its
        parent (it said ``parent-gone``) and a rank above it has exited,
        or does within :data:`PARENT_EXIT_WAIT` seconds.  That rank's own
        exit is then the news: ``rank 3 exited unexpectedly`` named a child
        of the rank that was killed, which stops at once when its link
        goes, while its parent stops its modules and says goodbye first.

        Its stdout is read to its end first (it has exited: that is at
        once), so a rank that said nothing is reported without a wait."""
        said = self._parent_gone_said[rank]
        if not said.done():
            await asyncio.wait([said, self._stdout_read[rank]], timeout=1.0,
                               return_when=asyncio.FIRST_COMPLETED)
        if not said.done():
            return False
        above = [self._exited[parent] for parent in ancestors(rank, self.fanout)]
        if not any(f.done() for f in above):
            await asyncio.wait(above, timeout=PARENT_EXIT_WAIT,
                               return_when=asyncio.FIRST_COMPLETED)
        return any(f.done() for f in above)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def stop(self, timeout: float = STOP_TIMEOUT) -> list[int | None]:
        """Stop every rank (TERM, wait, KILL); remove the run directory.

        A rank is killed ``timeout`` seconds after its SIGTERM, or after the
        last progress it reported (``stopping <bytes>``, fewer bytes than
        ever before), and at most :data:`STOP_CAP` times ``timeout`` after
        its SIGTERM.  Returns each rank's exit status.  Cancelled while it waits, it
        still removes the run directory and closes the ranks' watch pipe:
        the ranks have their SIGTERM and exit on their own (each one also
        exits when that pipe closes), and nothing else would remove the
        directory once they are gone.
        """
        self._stopping = True
        self._stops += 1
        try:
            for proc in self.procs:
                _signal(proc, signal.SIGTERM)
            self._stop_timeout = timeout
            self._stop_cap = asyncio.get_running_loop().time() + STOP_CAP * timeout
            killed = await asyncio.gather(*(self._end(r, p, timeout)
                                            for r, p in enumerate(self.procs)))
            self.killed = [r for r, k in enumerate(killed) if k]
        finally:
            self._stops -= 1
            self._deadlines.clear()
            self._release()
        return [p.returncode for p in self.procs]

    async def _end(self, rank: int, proc: RankProcess, timeout: float) -> bool:
        """Wait for a rank sent SIGTERM to exit; SIGKILL it (True) once its
        deadline passes, which :meth:`_progress` may push back."""
        try:
            async with asyncio.timeout(timeout) as self._deadlines[rank]:
                await proc.wait()
            return False
        except TimeoutError:
            _signal(proc, signal.SIGKILL)
            await proc.wait()
            return True

    def _removes_rundir(self) -> bool:
        return self._rundir_made if self.rundir_cleanup is None else self.rundir_cleanup

    def _release(self) -> None:
        """What :meth:`stop` must do even if cancelled: stop watching the
        ranks, close their watch pipe, remove the run directory."""
        for task in self._waiters:
            task.cancel()
        if self._watch_w is not None:
            os.close(self._watch_w)
            self._watch_w = None
        keyfile, self._keyfile = self._keyfile, None
        try:
            if self.rundir and self._removes_rundir():
                remove_rundir(self.rundir)
            elif self.rundir:  # (one that was there stays: what the start wrote goes)
                # Only a key file this start wrote; and a clean-up error must not
                # replace the start's own (an unlink on a read-only file system
                # fails with EROFS even for a file that is not there).
                if keyfile is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(keyfile)
                if self._rundir_mode is not None:
                    with contextlib.suppress(OSError):
                        os.chmod(self.rundir, self._rundir_mode)
                    self._rundir_mode = None
        finally:
            # (last: a start that takes the directory next finds it as this
            # one leaves it, its key file and mode not undone under it)
            fd, self._rundir_fd = self._rundir_fd, None
            if fd is not None:
                os.close(fd)
