"""Entry point of one rank process (started by :mod:`broker.launch`).

``python -m broker.rank --rank R --size N --fanout K --rundir DIR [...]``

The rank prints ``ready <uri>`` on stdout once its whole subtree is up
(for rank 0: the whole instance), then serves until SIGTERM/SIGINT/SIGHUP, a
client's ``broker.shutdown`` (it then prints ``shutdown`` first), its
parent's shutdown, or until the ``--watch-fd`` pipe from its launcher closes
(the launcher died), so no rank outlives the instance.  With ``--watch-fd``
(a launcher reads its stdout) it prints ``stopping <bytes>`` every 0.5 s
while it stops with bytes left to write (:func:`report_stopping`).  With
``--initial-program`` (rank 0 of ``kvbroker broker -- CMD``) it prints
nothing: it runs CMD once ready, passes SIGINT/SIGTERM/SIGHUP on to it,
stops the instance when CMD exits, and exits as CMD did.  With
``--cleanup-rundir`` (the launcher made the run directory), the last rank
to exit removes it if the launcher is gone; with ``--cleanup-curve-keys``
(the launcher wrote ``--curve-keys`` for this start, in a run directory
that stays), it removes that key file then.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import resource
import select
import signal
import stat
import sys
import time
from collections.abc import Callable
from typing import Any

from broker import attrs as battrs
from broker import gcpolicy, jsontoml, malloc, plugins
from broker.broker import Broker
from broker.command import (
    STOP_SIGNALS,
    Command,
    cannot_run_message,
    cannot_run_status,
    command_path,
    exit_code,
)
from broker.errors import ErrnoError, KvbrokerError, LastingFault, describe_failure
from broker.logring import PrefixedFormatter, RankLog
from broker.loops import loop_factory

# (STOP_SIGNALS, start's: what stops a rank cleanly, or while an initial
# program runs goes to it)

STOP_REPORT_PERIOD = 0.5
"""How often a stopping rank started by a launcher says ``stopping <bytes>``."""


def _json(text: str, fits: Callable[[Any], bool], what: str) -> Any:
    try:
        value = jsontoml.loads_json(text)
    except ValueError:
        value = None
    if not fits(value):
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}")
    return value


def json_object(text: str) -> dict[str, Any]:
    value: dict[str, Any] = _json(text, lambda v: isinstance(v, dict), "a JSON object")
    return value


def json_argv(text: str) -> list[str]:
    value: list[str] = _json(text, lambda v: isinstance(v, list) and bool(v)
                             and all(isinstance(a, str) for a in v), "a JSON list of strings")
    return value


def json_hosts(text: str) -> list[str]:
    value: list[str] = _json(text, lambda v: isinstance(v, list)
                             and all(isinstance(h, str) for h in v), "a JSON list of strings")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m broker.rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--fanout", type=int, default=32)
    p.add_argument("--rundir", required=True)
    p.add_argument("--statedir")
    p.add_argument("--event-loop", default="auto")
    p.add_argument("--attrs", type=json_object, default={}, help="JSON map of attributes")
    p.add_argument("--endpoints", type=json_object, default={},
                   help="JSON map rank -> overlay endpoint")
    p.add_argument("--bind", help="overlay endpoint this rank binds for its children "
                   "(default: its own entry of --endpoints)")
    p.add_argument("--hosts", type=json_hosts, metavar="JSON",
                   help="JSON list: each rank's host, by rank (a bootstrap file's): "
                   "the hostlist attribute, and what a parent checks its children's "
                   "hellos against")
    p.add_argument("--curve-keys", help="file holding the instance's CURVE key pair")
    p.add_argument("--config-file", help="the TOML file the rank's attributes came from "
                   "(the config.path attribute: config get, config reload)")
    p.add_argument("--initial-program", type=json_argv, metavar="JSON",
                   help="JSON list: the command to run once the instance is up "
                   "(kvbroker broker -- CMD, rank 0)")
    p.add_argument("--module-targets", type=json_object, default={}, metavar="JSON",
                   help="JSON map module name -> entry-point target, found by the "
                   "launcher (the rank then reads no entry points)")
    p.add_argument("--watch-fd", type=int, help="exit when this pipe closes")
    p.add_argument("--cleanup-rundir", action="store_true",
                   help="the launcher made --rundir: if it is gone (--watch-fd closed), "
                   "the last rank to exit removes it")
    p.add_argument("--cleanup-curve-keys", action="store_true",
                   help="the launcher wrote --curve-keys for this start: if it is gone "
                   "(--watch-fd closed), the last rank to exit removes that file")
    return p.parse_args(argv)


def hold_rundir(rundir: str) -> int | None:
    """A shared lock on ``rundir`` for as long as this rank lives (the
    kernel drops it when the process dies, even by SIGKILL): the rank
    that can then take it exclusively is the last one using the directory,
    and a new start on it is refused while any rank holds it
    (:func:`broker.launch.claim_rundir`: else the old instance's last rank
    out removed the directory under the new one).  ``None`` if the
    directory is gone already."""
    try:
        fd = os.open(rundir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def last_out(fd: int) -> bool:
    """Whether no other rank holds the run directory (:func:`hold_rundir`):
    this rank is the last one using it.  Each rank drops its shared lock
    before trying, so of ranks exiting together one always succeeds."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def remove_rundir_if_last(fd: int, rundir: str) -> None:
    """Remove ``rundir`` if no other rank holds it (:func:`last_out`)."""
    if last_out(fd):
        from broker.launch import remove_rundir  # (a symlink's directory too)

        remove_rundir(rundir)


def clean_up_after_launcher(args: argparse.Namespace, fd: int) -> None:
    """The launcher died (SIGKILL) without its stop's clean-up: the last
    rank out does it -- removes the run directory the launcher would have
    (``--cleanup-rundir``), or else the CURVE key file it wrote in one
    that stays (``--cleanup-curve-keys``): a given run directory is left
    "emptied of what the start wrote", and the instance's secret key is
    not left behind for anyone who later reads the directory."""
    if args.cleanup_rundir:
        remove_rundir_if_last(fd, args.rundir)
    elif args.cleanup_curve_keys and args.curve_keys and last_out(fd):
        with contextlib.suppress(OSError):
            os.unlink(args.curve_keys)


def pipe_closed(fd: int) -> bool:
    """Whether the other end of the ``--watch-fd`` pipe is closed: nothing
    is ever written to it, so it reads (EOF) only then."""
    return bool(select.select([fd], [], [], 0)[0])


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    rundir_lock = None
    if args.watch_fd is not None:  # (a launcher's: held whatever the clean-up, so a
        rundir_lock = hold_rundir(args.rundir)  # start on it waits until every rank is out)
    plugins.use_targets(args.module_targets)
    curve = None
    if args.curve_keys:
        from broker.curve import load_keys

        curve = load_keys(args.curve_keys)
    b = Broker(
        args.rank, args.size, args.fanout, args.rundir,
        statedir=args.statedir,
        attrs=args.attrs,
        endpoints={int(k): v for k, v in args.endpoints.items()},
        bind=args.bind,
        curve=curve,
        hosts=args.hosts,
        rank_log=getattr(args, "rank_log", None),
        config_file=args.config_file,
    )
    signalled: list[int] = []

    def on_stop_signal(sig: int) -> None:
        signalled.append(sig)
        b.request_stop(f"signal {signal.Signals(sig).name}")

    for sig in STOP_SIGNALS:  # SIGHUP too: a closed terminal stops a rank cleanly
        loop.add_signal_handler(sig, on_stop_signal, sig)
    if args.watch_fd is not None:
        def on_launcher_gone() -> None:
            loop.remove_reader(args.watch_fd)
            b.request_stop("its launcher exited")
        loop.add_reader(args.watch_fd, on_launcher_gone)
    # A stop (signal, launcher gone) must also end a start-up that waits for
    # a tree that may never come up, or the rank would outlive its instance.
    running = loop.create_task(b.run())
    status: int | None = None  # the initial program's, which is ours
    said_ready = False
    try:
        starting = loop.create_task(b.start())
        progress = (loop.create_task(report_starting(b))
                    if args.watch_fd is not None and not args.initial_program else None)
        try:
            await asyncio.wait({starting, running}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if progress is not None:
                progress.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            if args.initial_program and signalled:  # as start -- CMD says it
                return 128 + signalled[0]
            if not signalled:  # a lost parent, a refusal, the launcher gone
                return b.exit_code or 1  # (3: the parent refused our CURVE key)
            # A stop signal while the tree comes up (its parent or a child
            # not there yet) is a stop asked for, as one after: the status
            # is the stop's own (0 unless it lost something), not 1 -- a
            # supervisor would take 1 for a failure, and restart it.
        else:
            try:
                starting.result()
            except Exception as exc:
                # One line, not a traceback: the launcher then reports that this
                # rank exited during start-up.  The traceback is logged at debug.
                log = logging.getLogger("kvbroker")
                log.error("start-up failed: %s", describe(exc))
                log.debug("start-up failure", exc_info=exc)
                return 2 if isinstance(exc, LastingFault) else 1
            if args.initial_program:  # its output is the program's alone (as start -- CMD)
                status = await run_initial_program(b, args.initial_program, running,
                                                   on_stop_signal)
            else:
                tell_launcher(f"ready {b.uri}")
                said_ready = True
            await running
        if b.shutdown_requested and not args.initial_program:
            # Before any rank below is told: a launcher that reads this then
            # knows the ranks exiting next were shut down, not lost.
            tell_launcher("shutdown")
        elif signalled and said_ready:
            # The same for a stop a signal asked for (kill, systemctl stop):
            # it is a stop, not a crash, and the launcher says so.
            tell_launcher(f"stopped {signal.Signals(signalled[0]).name}")
        elif b.overlay is not None and b.overlay.parent_gone and not args.initial_program:
            # A launcher then blames the rank above that went, not this one
            # (which often exits first: it stops at once, its parent only
            # after its own modules and its goodbye).
            tell_launcher("parent-gone")
    finally:
        running.cancel()
        # A launcher's rank says how much it still has to write while it
        # stops: the launcher gives one that makes progress more time.
        reporter = (loop.create_task(report_stopping(b))
                    if args.watch_fd is not None and not args.initial_program else None)
        try:
            await b.stop()
        finally:
            if reporter is not None:
                reporter.cancel()
        # Stopping already (a parent's shutdown may come before the
        # launcher's SIGTERM): a late signal must not kill the exit, which
        # the loop's close would allow by restoring the default action.
        # Blocked meanwhile: between the loop restoring the default action
        # and SIG_IGN, a signal would still kill the rank.
        stops = set(STOP_SIGNALS)
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        for sig in stops:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        # A launcher that stopped us removes the run directory itself once
        # every rank has exited; one that died (SIGKILL) cannot.  Checked
        # here, not when its pipe closed: it may die while we stop anyway.
        if rundir_lock is not None and pipe_closed(args.watch_fd):
            clean_up_after_launcher(args, rundir_lock)
    return b.exit_code if status is None else status


async def report_starting(b: Broker) -> None:
    """While the rank starts, print ``starting <count>`` every
    :data:`STOP_REPORT_PERIOD` seconds if its modules did more start-up
    work since (:attr:`Broker.start_progress`: rank 0 restoring an
    archive counts its keys).  :class:`broker.launch.Instance` restarts
    its start deadline each time: a restore of a million keys is not a
    hung start, and cut off, it left the store half restored."""
    said = 0
    while True:
        await asyncio.sleep(STOP_REPORT_PERIOD)
        if b.start_progress != said:
            said = b.start_progress
            tell_launcher(f"starting {said}")


def tell_launcher(line: str) -> None:
    """Print ``line`` for the launcher, which reads this rank's stdout
    (:class:`broker.launch.Instance`).  A launcher that is gone (killed)
    is no one to tell: its pipe's ``BrokenPipeError`` was a traceback on
    the stderr the rank shared with it, and the rank's exit status 1.
    Then stdout becomes ``/dev/null``, or Python would flush what is left
    at exit and say so on stderr."""
    try:
        print(line, flush=True)
    except OSError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


async def report_stopping(b: Broker) -> None:
    """While the rank stops, print ``stopping <bytes>`` every
    :data:`STOP_REPORT_PERIOD` seconds if it still has bytes to write
    (rank 0's content backlog).  :class:`broker.launch.Instance` restarts
    the rank's stop deadline each time the number goes down, as systemd
    does for a service that sends ``EXTEND_TIMEOUT_USEC``: a slow disk
    writing a large backlog at stop is not mistaken for a hung rank."""
    while True:
        left = b.left_to_write()
        if left:
            tell_launcher(f"stopping {left}")
        await asyncio.sleep(STOP_REPORT_PERIOD)


async def run_initial_program(b: Broker, argv: list[str], running: asyncio.Task[None],
                              on_stop_signal: Callable[[int], None]) -> int:
    """Run the instance's initial program (``kvbroker broker -- CMD``, rank
    0, as ``flux broker CMD``); when it exits, stop the instance.  Returns
    its exit status.  Stop signals go to the program meanwhile (as with
    ``kvbroker start -- CMD``), then to ``on_stop_signal`` again; a
    ``kvbroker shutdown`` stops it."""
    loop = asyncio.get_running_loop()
    log = logging.getLogger("kvbroker")
    try:
        env = dict(os.environ, KVBROKER_URI=b.uri, KVBROKER_RANK=str(b.rank))
        env["PATH"] = command_path(env.get("PATH", ""))  # (its kvbroker is this one)
        cmd = Command.spawn(argv, env)
    except OSError as exc:
        log.error("initial program %s", cannot_run_message(argv[0], exc))
        b.request_stop("the initial program could not run")
        return cannot_run_status(exc, argv[0])
    signalled: list[int] = []

    def forward(sig: int) -> None:
        signalled.append(sig)
        cmd.forward(sig)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, forward, sig)
    try:
        waiting = asyncio.ensure_future(cmd.wait())
        await asyncio.wait({waiting, running}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            log.warning("the instance is stopping: stopping the initial program")
            await cmd.stop()
        elif signalled:  # it was stopped: nothing it started outlives the instance
            cmd.kill()
    finally:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_stop_signal, sig)
    rc = cmd.returncode
    assert rc is not None
    b.request_stop(f"the initial program exited with status {exit_code(rc)}")
    return exit_code(rc)



def describe(exc: BaseException) -> str:
    """``exc`` in one line: its message, with its type when that says more."""
    if isinstance(exc, ErrnoError):
        return exc.errstr  # a service's message (a RemoteError's str leads with its errno)
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        # "PATH: Permission denied", as the other start-up errors name a
        # path -- not "[Errno 13] Permission denied: 'PATH'"
        names = [exc.filename, exc.filename2] if exc.filename2 is not None else [exc.filename]
        shown = [os.fsdecode(n) if isinstance(n, (str, bytes)) else str(n) for n in names]
        return f"{' -> '.join(shown)}: {exc.strerror}"
    if isinstance(exc, (LookupError, ImportError, OSError, ValueError, KvbrokerError)):
        return str(exc) or type(exc).__name__
    return describe_failure(exc)


def _raise_open_files_limit() -> None:
    """A rank holds a descriptor per client and per overlay connection:
    take the hard limit, not the soft 1,024 most systems start processes
    with, as servers do."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    except (ValueError, OSError):
        pass  # keep what we have


def _stderr_is_a_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def _configure_logging(rank: int, level: str, stamps: str, ring_level: str,
                       ring_size: int) -> RankLog:
    """Log lines ``kvbroker[R]: LEVEL logger: message`` on stderr, after the
    UTC time to the millisecond when ``log.timestamps`` says so -- by
    default when stderr is a file (``kvbroker broker ... 2>>rank.log``),
    not on a terminal, nor to journald, which stamps lines itself; and the
    last records in memory for ``kvbroker dmesg`` (:mod:`broker.logring`)."""
    fmt = f"kvbroker[{rank}]: %(levelname)s %(name)s: %(message)s"
    if stamps == "always" or (stamps == "auto" and _stderr_is_a_file()):
        fmt = "%(asctime)s.%(msecs)03dZ " + fmt
    formatter = PrefixedFormatter(fmt, datefmt="%Y-%m-%dT%H:%M:%S")  # (on every line)
    formatter.converter = time.gmtime
    return RankLog(rank, level, ring_level, ring_size, formatter)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        level = battrs.LOG_LEVEL.value(args.attrs)
        stamps = battrs.LOG_TIMESTAMPS.value(args.attrs)
        ring_level = battrs.LOG_RING_LEVEL.value(args.attrs)
        ring_size = battrs.LOG_RING_SIZE.value(args.attrs)
    except battrs.AttrError as exc:
        print(f"kvbroker[{args.rank}]: ERROR kvbroker: start-up failed: {exc}",
              file=sys.stderr, flush=True)
        return 1
    args.rank_log = _configure_logging(args.rank, level, stamps, ring_level, ring_size)
    os.environ.pop("KVBROKER_URI", None)
    os.environ.pop("KVBROKER_RANK", None)  # (an outer exec's: not this rank's)
    _raise_open_files_limit()
    malloc.tune()
    gcpolicy.tune()
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        return runner.run(serve(args))


if __name__ == "__main__":
    # ``kvbroker start 2>&-``: the ranks inherit its standard streams, and
    # what ``start`` put on a closed one is not inherited (close-on-exec),
    # so a rank began with no stderr and died logging its first line (exit
    # 1: start failed, status 2, saying so to nowhere).  Its log goes where
    # start's would: nowhere.  (``kvbroker broker`` runs main() in a process
    # that did this already.)
    from broker.cli import guard_std_streams

    guard_std_streams()
    sys.exit(main())
