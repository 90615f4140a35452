"""Fork an instance's ranks from one process that imported them once.

A rank started as ``python -m broker.rank`` spends most of its start-up
CPU importing (the interpreter, asyncio, the broker and its modules:
~170 ms of ~250 ms), and ``kvbroker start --size N`` paid that N times;
so did every test that starts an instance.  Instead, the launcher
(:class:`broker.launch.Instance`) starts this one process per instance,
which imports ``broker.rank`` and the instance's modules, then forks each
rank from itself: a rank costs a fork and its own start, and its pages
are shared with its siblings until written.

Each rank is still its own process, in its own session, with its own
standard output (a pipe the launcher made and passed here) and the
launcher's standard error; it runs :func:`broker.rank.main` with the
arguments it would have had on its command line.  This process stays the
ranks' parent and reaps them, and tells the launcher on its own standard
output: ``pid RANK PID`` for each rank forked, ``exit RANK STATUS`` (a
``returncode``: negative for a signal) for each that ended.  It exits
once every rank has.  The launcher sends the ranks their signals itself.

Protocol: ``python -m broker.spawner RUNDIR`` (the run directory is on the
command line so that the process, and the ranks it forks, show whose
they are in ``ps``), and on standard input one JSON object,
``{"preload": [module, ...], "ranks": [{"argv": [...], "stdout": fd}, ...],
"keep": [fd, ...]}``, whose ``stdout`` and ``keep`` descriptors it was
given (``pass_fds``: ``keep`` holds the launcher's watch pipe); it closes
every other one.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import signal
import sys
import traceback
from typing import Any, NoReturn


def _run_rank(argv: list[str], stdout_fd: int, other_fds: list[int],
              prctl: Any, spawner: int) -> NoReturn:
    """In the forked child: become rank ``argv`` and exit as it does.

    The rank dies with this process (``PR_SET_PDEATHSIG``, SIGKILL, with
    libc's ``prctl``): this process alone can say how its ranks ended, and
    the launcher kills them when it is gone; one forked but not yet
    reported when it was killed (a start cancelled at once) was left
    running until it noticed the launcher's watch pipe close."""
    code = 1
    try:
        os.setsid()  # (as start_new_session: the launcher's Ctrl-C is not ours)
        if prctl is not None:
            from broker.command import PR_SET_PDEATHSIG

            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            # Gone before the prctl took, the spawner has left us to a reaper:
            # compared with its pid from before the fork, not one read here.
            if os.getppid() != spawner:
                os._exit(128 + signal.SIGKILL)
        with contextlib.suppress(OSError, ValueError):  # (Linux: ps and top show it)
            with open("/proc/self/comm", "w") as comm:
                comm.write(f"kvbroker-r{argv[argv.index('--rank') + 1]}"[:15])
        os.dup2(stdout_fd, 1)
        for fd in other_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        from broker import rank

        sys.argv = [rank.__file__, *argv]
        code = rank.main(argv)
    except SystemExit as exc:  # (argparse refusing the arguments)
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        # What the interpreter's exit would do, without unwinding into the
        # spawner's own loop: exit handlers (logging's flush), the streams.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
    os._exit(code & 0xFF)


def _close_other_fds(keep: set[int]) -> None:
    """Close every descriptor but ``keep``: what the launcher's event loop
    left open in this process (uvloop's spawn leaves copies of the standard
    streams' sockets) the ranks would inherit, and a rank holding a copy
    of this process's standard output would hide its end from the
    launcher."""
    low = 0
    for fd in sorted(keep) + [os.sysconf("SC_OPEN_MAX")]:
        if fd > low:
            os.closerange(low, fd)
        low = max(low, fd + 1)


def preload_default_modules() -> None:
    """Import the modules a rank of the default ``broker.modules`` loads,
    and uvloop, as a launcher's ``preload`` would name them (the fork
    server, :mod:`broker.forkserver`, does so once for every spawner)."""
    from broker import attrs, plugins

    targets = plugins.module_targets(attrs.module_names({}))
    for module in sorted({t.partition(":")[0] for t in targets.values()} | {"uvloop"}):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


def main() -> int:
    return run(json.load(sys.stdin))


def run(spec: dict[str, Any]) -> int:
    """Fork and reap the ranks ``spec`` describes (above), this process's
    standard output being the launcher's status pipe."""
    ranks: list[dict[str, Any]] = spec["ranks"]
    fds = [int(r["stdout"]) for r in ranks]
    _close_other_fds({0, 1, 2, *fds, *(int(fd) for fd in spec.get("keep", []))})
    # A rank run as a script guards its standard streams first (broker.rank).
    from broker.cli import guard_std_streams
    from broker.command import libc_prctl

    guard_std_streams()
    from broker import rank  # noqa: F401 (imported once here, for every rank)

    for module in spec.get("preload", []):
        # (one that fails is the rank's to report, as it would have)
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    # Objects made so far are never freed: out of the collector's sight, a
    # rank's collections do not touch (and so copy) their shared pages.
    gc.freeze()
    status = sys.stdout
    by_pid: dict[int, int] = {}

    def say(line: str) -> None:
        with contextlib.suppress(OSError):  # (the launcher is gone)
            status.write(line + "\n")
            status.flush()

    prctl = libc_prctl() if sys.platform == "linux" else None
    me = os.getpid()
    for number, r in enumerate(ranks):
        status.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_rank([str(a) for a in r["argv"]], int(r["stdout"]), fds, prctl, me)
        by_pid[pid] = number
        os.close(int(r["stdout"]))  # (the rank's, from here)
        say(f"pid {number} {pid}")
    while by_pid:
        try:
            pid, wstatus = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid in by_pid:
            say(f"exit {by_pid.pop(pid)} {os.waitstatus_to_exitcode(wstatus)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
