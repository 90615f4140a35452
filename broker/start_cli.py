"""``kvbroker start``, ``kvbroker broker``, ``kvbroker keygen`` and
``kvbroker relay``: starting an instance -- N ranks on this host, or one
rank of an instance spread over hosts (a bootstrap file) -- and what an
instance across hosts needs (its CURVE keys, the ssh connector's relay).
The other commands are in :mod:`broker.cli`, which registers these.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import stat
from collections.abc import Awaitable
from typing import Any

from broker.cliutil import (
    MAX_START_SIZE,
    CLIError,
    UsageError,
    command_args,
    print_err,
)
from broker.command import STOP_CAP, STOP_SIGNALS, command_path
from broker.loops import ENV_VAR as LOOP_ENV
from broker.loops import loop_factory


def parse_attr(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected ATTR=VALUE, got {text!r}")
    return name, value


# ------------------------------------------------------------------ start


def check_uri_file(path: str) -> None:
    """Refuse, as a usage error and before any rank starts, a ``--uri-file``
    that could not be written once the instance is up: a script waiting for
    it would otherwise wait for ever on an instance that serves."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"--uri-file {path}: no such directory {directory}")
    if os.path.isdir(path):
        raise UsageError(f"--uri-file {path}: is a directory")
    # The file is renamed over FILE: a FIFO (whose reader, already waiting,
    # would never see it), or a device node (/dev/null, /dev/stdout's
    # target, which as root would be replaced, then removed at stop) is not
    # a file to write that way.
    with contextlib.suppress(OSError):  # (none, or a dangling link: written as a file)
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise UsageError(f"--uri-file {path}: not a regular file (a FIFO, device or "
                             "terminal: start writes a new file and renames it over FILE)")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"--uri-file {path}: cannot write in {directory}")


def write_uri_file(path: str, uri: str) -> tuple[int, int]:
    """Write ``uri`` (and a newline) to ``path`` atomically: a temporary
    file in the same directory, renamed over ``path``, so a reader finds no
    file or the whole URI, never part of it.  Returns the file's identity
    (device, inode), by which :func:`remove_uri_file` knows it is still
    this one."""
    directory, name = os.path.split(os.path.abspath(path))
    # (os.urandom, as secrets.token_hex: importing secrets, with hmac and
    # random, was ~2.5 ms of every kvbroker command, which imports this module)
    tmp = os.path.join(directory, f".{name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(uri + "\n")
            st = os.fstat(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return st.st_dev, st.st_ino


def remove_uri_file(path: str, identity: tuple[int, int]) -> None:
    """Remove ``path`` if it is still the file :func:`write_uri_file` wrote
    (a later ``start`` given the same file, or its owner, may have put
    another there: that one is not ours to remove)."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if (st.st_dev, st.st_ino) == identity:
            os.unlink(path)


def broker_opts(given: list[str]) -> list[tuple[str, str]]:
    """The attributes of ``start -o,-Sa=1,-Sb=2`` (Flux's ``--broker-opts``,
    so a Flux command line runs as written): each comma-separated option
    must be ``-SATTR=VAL``, ``-S`` ``ATTR=VAL`` or ``--setattr=ATTR=VAL``;
    the brokers' other options are ``start``'s own here.  ``-S`` given
    directly wins over ``-o``."""
    out: list[tuple[str, str]] = []
    for text in given:
        items = [x for x in text.split(",") if x]
        while items:
            item = items.pop(0)
            if item in ("-S", "--setattr") and items:
                item = "-S" + items.pop(0)
            for prefix in ("--setattr=", "-S"):
                if item.startswith(prefix):
                    try:
                        out.append(parse_attr(item[len(prefix):]))
                    except argparse.ArgumentTypeError as exc:
                        raise UsageError(f"{_as_given(text)}: {exc}") from None
                    break
            else:
                raise UsageError(f"{_as_given(text)}: {item!r} is not taken: only -S ATTR=VAL "
                                 "(--setattr) is; the brokers' other options are start's "
                                 "own (--size, --fanout, --statedir, ...)")
    return out


def _as_given(opts: str) -> str:
    return f"-o{opts}" if opts.startswith(",") else f"-o {opts}"


def ranks_loop(args: argparse.Namespace) -> str:
    """The ranks' event loop for ``start`` and ``broker``: their own
    ``--event-loop``, else ``kvbroker --event-loop``, else
    ``$KVBROKER_EVENT_LOOP``, else ``auto`` (the first two were one option's
    value, and the command's default silently replaced the other)."""
    return getattr(args, "event_loop", None) or os.environ.get(LOOP_ENV) or "auto"


def take_dir_attrs(args: argparse.Namespace, attrs: dict[str, Any],
                   names: tuple[str, ...]) -> None:
    """Flux's ``-S statedir=DIR`` and ``-S rundir=DIR``: its spellings of
    ``--statedir`` and ``--rundir``, so a ``flux start``
    line runs as written; taken out of ``attrs`` into ``args``.  Refused
    when the option says another directory."""
    for name in names:
        if name not in attrs:
            continue
        value = str(attrs.pop(name))
        given = getattr(args, name)
        if not value:
            raise UsageError(f"-S {name}= names no directory (or give --{name} DIR)")
        if given and os.path.abspath(given) != os.path.abspath(value):
            raise UsageError(f"-S {name}={value} and --{name} {given} name two "
                             "directories: give one")
        setattr(args, name, value)


def take_config(args: argparse.Namespace, given: dict[str, Any]) -> dict[str, Any]:
    """``start --config FILE``: the attributes of the file's ``[attrs]``
    (:func:`broker.bootstrap.load_attrs`), checked on their own first (a
    bad one is refused naming the file, even where ``-S`` overrides it:
    the same file would fail the next start); ``-S`` and the options win
    over them.  None without ``--config``."""
    if not args.config:
        return {}
    from broker import bootstrap

    try:
        attrs = bootstrap.load_start_attrs(args.config, args.size)
    except bootstrap.BootstrapError as exc:
        raise CLIError("start", detail=str(exc), status=2) from None
    for name in ("statedir", "rundir"):  # (the option, or -S, wins)
        if name in attrs and (getattr(args, name) or name in given):
            del attrs[name]
    return attrs


def take_cleanup_attrs(attrs: dict[str, Any]) -> bool | None:
    """Flux's ``-S rundir-cleanup=0|1``: keep (0) or remove (1) the run
    directory at the stop, whoever made it; None when not given (one the
    start made goes, one that was there stays).  Flux's
    ``statedir-cleanup`` has no counterpart and is refused with why: there
    is no temporary statedir here to keep."""
    if "statedir-cleanup" in attrs:
        raise UsageError("-S statedir-cleanup: an instance here has a statedir only when "
                         "given one (--statedir DIR, kept), and none otherwise: nothing to "
                         "clean up or keep")
    if "rundir-cleanup" not in attrs:
        return None
    value = attrs.pop("rundir-cleanup")
    try:
        from broker.attrs import boolean  # (here: every kvbroker command imports this module)

        return boolean(value)
    except ValueError as exc:
        raise UsageError(f"-S rundir-cleanup: {exc}") from None


def take_recovery(args: argparse.Namespace, attrs: dict[str, Any]) -> None:
    """Flux's ``start --recovery TARGET``: rank 0 alone, on a statedir
    (TARGET a directory: what a stopped instance kept), or on what an
    archive holds (a file from ``kvs dump``: restored into a store of its
    own, which goes at the stop, as ``-S content.restore``) -- to look at
    it, or mend it, with the usual commands."""
    target = args.recovery
    if args.size != 1:
        raise UsageError("--recovery runs rank 0 alone: no --size")
    if os.path.isdir(target):
        if args.statedir and os.path.abspath(args.statedir) != os.path.abspath(target):
            raise UsageError(f"--recovery {target} and --statedir {args.statedir} name two "
                             "directories: give one")
        store = os.path.join(target, "content.sqlite")
        try:
            os.lstat(store)
        except FileNotFoundError:
            # (an empty directory became a new, empty statedir: the command
            # ran on an empty KVS, and left a store behind)
            raise UsageError(f"--recovery {target}: it holds no content.sqlite: not a "
                             "statedir (nothing to recover)") from None
        except OSError as exc:  # (a directory we may not search)
            raise UsageError(f"--recovery {target}: {store}: {exc.strerror}") from None
        args.statedir = target
    elif os.path.isfile(target):
        if args.statedir:  # (content.restore would empty that store first)
            raise UsageError(f"--recovery {target}: an archive is restored into a store of "
                             "its own: no --statedir")
        attrs["content.restore"] = os.path.abspath(target)
    else:
        raise UsageError(f"--recovery {target}: no such directory or file (a statedir, or "
                         "an archive from kvbroker kvs dump)")
    attrs["broker.recovery-mode"] = "1"


def take_recovery_mode(args: argparse.Namespace, attrs: dict[str, Any]) -> None:
    """Flux's ``-S broker.recovery-mode=1`` (what its ``--recovery`` sets):
    ``--recovery`` on the ``--statedir``; 0 is no recovery.  Without a
    statedir there is nothing to recover."""
    from broker import attrs as battrs

    given = attrs.pop("broker.recovery-mode", None)
    if given is None:
        return
    try:
        on = bool(battrs.RECOVERY_MODE.value({"broker.recovery-mode": given}))
    except battrs.AttrError as exc:
        raise UsageError(f"-S {exc}") from None
    if on and args.recovery is None:
        if not args.statedir:
            raise UsageError("-S broker.recovery-mode=1 needs the statedir to recover: "
                             "give --recovery DIR (or an archive)")
        args.recovery = args.statedir


def recovery_banner(args: argparse.Namespace) -> str:
    """What ``start --recovery`` without a command says as it serves (Flux's
    interactive recovery banner)."""
    target = args.recovery
    if os.path.isdir(target):
        kept = "what is changed is kept in it"
        what = f"statedir {os.path.abspath(target)}"
    else:
        kept = ("what is changed is not kept: the store goes at the stop (kvbroker kvs dump "
                "saves it)")
        what = f"a store restored from {os.path.abspath(target)}"
    return (f"start: recovery mode: rank 0 alone on {what}; {kept}. Stop it with Ctrl-C or "
            "kvbroker shutdown.")


def print_rank_command(rank: int, argv: list[str]) -> None:
    """``start -v``: one rank's command line, quoted for a shell."""
    import shlex

    print_err(f"start: rank {rank}: {shlex.join(argv)}")


def cmd_start(args: argparse.Namespace) -> int:
    """Start an instance, run the command in it (or serve until signalled),
    stop it.

    SIGINT, SIGTERM and SIGHUP are handled from before the first rank
    starts until the instance has stopped -- a second Ctrl-C must not cut
    the stop short and leave the run directory behind -- and then ignored
    for the last moments of the exit.  While the command runs they are
    passed on to it (:meth:`broker.command.Command.forward`) and ``start``
    exits as the command does.  ``start``'s own event loop is the stock
    asyncio one whatever ``--event-loop`` says (that is the ranks' loop): it
    only supervises processes, and the command's process group needs
    ``process_group``, which uvloop lacks.
    """
    command = command_args(args.cmdline)
    args.event_loop = ranks_loop(args)
    given = dict([*broker_opts(args.broker_opts), *(args.setattr or [])])
    attrs = {**take_config(args, given), **given}
    take_dir_attrs(args, attrs, ("statedir", "rundir"))
    rundir_cleanup = take_cleanup_attrs(attrs)
    take_recovery_mode(args, attrs)
    if args.recovery is not None:
        take_recovery(args, attrs)
    for option, value in (("--size", args.size), ("--fanout", args.fanout)):
        if value < 1:
            raise UsageError(f"{option} must be at least 1 (got {value})")
    if args.size > MAX_START_SIZE:
        raise UsageError(f"--size must be at most {MAX_START_SIZE}, each rank a process "
                         f"on this host (got {args.size}); across hosts: kvbroker broker")
    try:
        loop_factory(args.event_loop)  # the ranks' loop: refused here if unavailable
    except ValueError as exc:
        raise CLIError("start", detail=str(exc)) from None
    if args.uri_file is not None:
        check_uri_file(args.uri_file)

    # Only `start` runs brokers: client commands do not import the broker
    # (nor ZeroMQ), ~30 ms of every `kvbroker kvs get`.
    from broker.command import Command, cannot_run_message, cannot_run_status, exit_code
    from broker.launch import Instance, StartError, exit_status

    async def main() -> int:
        loop = asyncio.get_running_loop()
        inst = Instance(args.size, args.fanout, event_loop=args.event_loop,
                        statedir=args.statedir, rundir=args.rundir, attrs=attrs,
                        rundir_cleanup=rundir_cleanup, config_file=args.config,
                        on_rank_command=print_rank_command if args.verbose else None)
        signalled: list[int] = []
        stop = asyncio.Event()
        cmd: Command | None = None
        uri_file: tuple[int, int] | None = None  # (the identity of the file written)

        def forget_uri() -> None:
            """The instance is stopping: its URI is no longer one to use."""
            nonlocal uri_file
            if uri_file is not None:
                remove_uri_file(args.uri_file, uri_file)
                uri_file = None

        def on_signal(sig: int) -> None:
            signalled.append(sig)
            stop.set()
            if cmd is not None:
                cmd.forward(sig)

        async def run() -> int:
            nonlocal cmd, uri_file
            try:
                if not await first(inst.start(), stop.wait()):
                    return 128 + signalled[0]  # stopped before the instance was up
            except (StartError, OSError) as exc:
                print_err(f"start: {exc}")
                return 2
            assert inst.ended is not None
            if args.uri_file is not None:  # (ready: every rank answered)
                try:
                    uri_file = write_uri_file(args.uri_file, inst.uri(0))
                except OSError as exc:
                    print_err(f"start: --uri-file {args.uri_file}: "
                              f"{exc.strerror or exc}; stopping")
                    return 1
            if not command:
                if args.recovery is not None:
                    print_err(recovery_banner(args))
                print(inst.uri(0), flush=True)
                if await first(stop.wait(), inst.ended):
                    return 0  # signalled
                if inst.ended.result() is None:  # kvbroker shutdown
                    if inst.shutdown_rank or inst.shutdown_why != "kvbroker shutdown":
                        print_err(shutdown_notice(inst.shutdown_rank or 0, command=False,
                                                  why=inst.shutdown_why))
                    return 0
            else:
                env = dict(os.environ, KVBROKER_URI=inst.uri(0), KVBROKER_RANK="0")
                env["PATH"] = command_path(env.get("PATH", ""))
                try:
                    cmd = Command.spawn(command, env)
                except OSError as exc:
                    print_err(cannot_run_message(command[0], exc))
                    return cannot_run_status(exc, command[0])
                for sig in signalled:  # came while it was being spawned
                    cmd.forward(sig)
                ended_first = not await first(cmd.wait(), inst.ended)
                if ended_first and inst.ended.result() is None:
                    print_err(shutdown_notice(inst.shutdown_rank or 0, command=True,
                                              why=inst.shutdown_why))
                    await cmd.stop(args.stop_timeout)
                if not ended_first or inst.ended.result() is None:
                    if signalled:  # we are stopping: nothing the command ran outlives us
                        cmd.kill()
                    rc = cmd.returncode
                    assert rc is not None
                    return exit_code(rc)
            result = inst.ended.result()
            assert result is not None
            rank, code = result
            print_err(f"rank {rank} exited unexpectedly, {exit_status(code)}; stopping")
            # The instance stops alongside the command, which may take its
            # time to go, or ignore SIGTERM (then it is killed after a bound).
            forget_uri()
            await asyncio.gather(*([cmd.stop(args.stop_timeout)] if cmd else []),
                                 inst.stop(args.rank_stop_timeout))
            return 1

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        rc = 1
        try:
            rc = await run()
        finally:
            forget_uri()
            try:
                codes = await inst.stop(args.rank_stop_timeout)
            finally:
                for sig in STOP_SIGNALS:
                    loop.remove_signal_handler(sig)
                    signal.signal(sig, signal.SIG_IGN)
        for rank in inst.killed:  # (its log cannot say why: it was not running)
            left = inst.left_to_write[rank]
            limit = args.rank_stop_timeout
            print_err(f"rank {rank} did not exit within {limit:g} s of SIGTERM, "
                      "so it was killed (a hung or stopped process)" if left is None else
                      f"rank {rank} did not exit within {limit:g} s of SIGTERM or of "
                      f"its last progress (at most {STOP_CAP * limit:g} s), so it was "
                      f"killed with {left} bytes still to write to disk")
        failed = [(rank, code) for rank, code in enumerate(codes)
                  if code and rank not in inst.killed]
        # (stopped by a signal too: without a command, that is how a
        # service stops, and its supervisor must hear of what was lost)
        if rc == 0 and inst.killed:
            return 1
        if rc == 0 and failed and inst.ended is not None:
            # A rank that could not stop cleanly (rank 0 could not write its
            # last checkpoint: a full disk) lost something: not a success.
            rank, code = failed[0]
            if code < 0:  # (a signal: the rank wrote nothing about it)
                print_err(f"rank {rank} was {exit_status(code)} as the instance stopped")
            else:
                print_err(f"rank {rank} exited {exit_status(code)} as it stopped "
                          "(its log says why)")
            return 1
        return rc

    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        return runner.run(main())


def shutdown_notice(rank: int, command: bool, why: str = "kvbroker shutdown") -> str:
    """What ``start`` says when ``kvbroker shutdown``, or a signal (``why``:
    ``signal SIGTERM``), stopped ``rank`` (0: the whole instance).  Not
    "exited unexpectedly": someone asked for it.  Any rank's stop ends the
    instance (an instance missing a subtree is not what ``start`` was asked
    for); it is a stop, so ``start`` exits 0, or as the command does."""
    tail = " and the command" if command else ""
    if why != "kvbroker shutdown":
        return f"rank {rank} was stopped ({why}); stopping the instance{tail}"
    if rank == 0:
        return "the instance was shut down; stopping the command"
    return f"rank {rank} was shut down (kvbroker shutdown); stopping the instance{tail}"


async def first(this: Awaitable[Any], other: Awaitable[Any]) -> bool:
    """Await ``this`` and ``other`` until one ends; ``True`` if ``this`` did
    (raising its exception).  The other is cancelled if it is a coroutine;
    a future is left alone (others may await it)."""
    a, b = asyncio.ensure_future(this), asyncio.ensure_future(other)
    try:
        done, _ = await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task, awaitable in ((a, this), (b, other)):
            if task is not awaitable and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if a in done:
        a.result()
        return True
    return False


# ------------------------------------------------------------------ across hosts


def cmd_keygen(args: argparse.Namespace) -> int:
    from broker.curve import generate_keys

    try:
        generate_keys(args.path)
    except FileExistsError:
        raise CLIError("keygen", detail=f"{args.path} exists (keys are never overwritten)") \
            from None
    return 0


def cmd_relay(args: argparse.Namespace) -> int:
    """What an ``ssh://`` URI runs on the rank's host (:mod:`broker.ssh`)."""
    from broker.ssh import relay

    return relay(args.path)


def cmd_broker(args: argparse.Namespace) -> int:
    """Run one rank of an instance spread over hosts (see :mod:`broker.bootstrap`).
    Rank 0 runs the initial program, if given (:mod:`broker.rank`); the
    other ranks ignore it, so every host may share one command line."""
    import json

    from broker import attrs as battrs
    from broker import bootstrap
    from broker import rank as rank_main
    from broker.curve import load_keys, loose_mode
    from broker.launch import (
        StartError,
        check_statedir_outside,
        make_rundir,
        private_dir,
        remove_rundir,
    )
    from broker.overlay import hello_hostname

    args.event_loop = ranks_loop(args)
    try:
        boot = bootstrap.load(args.config)
        bootstrap.check_file_attrs(args.config, boot.attrs, boot.size, bootstrap=True)
        attrs = {**boot.attrs, **dict(args.setattr or [])}
        given = attrs.get(battrs.TRANSPORT.name, "tcp")
        if str(given).strip() != "tcp":  # (was overwritten without a word)
            raise bootstrap.BootstrapError(
                f"{battrs.TRANSPORT.name}={given}: kvbroker broker's links are always tcp "
                "(ZeroMQ with CURVE: its ranks may be on other hosts)")
        attrs[battrs.TRANSPORT.name] = "tcp"
        if str(attrs.get(battrs.RECOVERY_MODE.name, "0")).strip() not in ("", "0"):
            raise bootstrap.BootstrapError(
                f"{battrs.RECOVERY_MODE.name}: kvbroker broker has no recovery mode (it "
                "runs one rank of an instance): kvbroker start --recovery STATEDIR runs "
                "rank 0 alone on a stopped instance's statedir")
        take_dir_attrs(args, attrs, ("statedir", "rundir"))
        cleanup = take_cleanup_attrs(attrs)  # (was kept as a free attribute, and ignored)
        hostname = battrs.rank_hostname(attrs)
        if hello_hostname({"hostname": hostname}) is None:  # (its hello would say none)
            raise bootstrap.BootstrapError(
                f"hostname {hostname!r} is not a host name (letters, digits, '.', '-', "
                "'_', ':', '%', '[', ']'; at most 255): give -S hostname=NAME")
        attrs["hostname"] = hostname
        rank = boot.rank_of(hostname) if args.rank is None else args.rank
    except bootstrap.BootstrapError as exc:
        print_err(f"broker: {exc}")
        return 2
    if not 0 <= rank < boot.size:
        raise UsageError(f"--rank {rank}: the bootstrap file lists ranks 0-{boot.size - 1}")
    try:
        attrs = battrs.from_flux(attrs, boot.size)
        battrs.check_instance(attrs, bootstrap=True)
        if boot.curve_cert is not None:  # (an instance of one rank needs none)
            load_keys(boot.curve_cert)
    except battrs.AttrError as exc:
        print_err(f"broker: {exc}")
        return 2
    except (OSError, ValueError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) else str(exc)
        print_err(f"broker: curve_cert {boot.curve_cert}: {detail}")
        return 2
    if boot.curve_cert is not None and loose_mode(boot.curve_cert):
        print_err(f"broker: warning: curve_cert {boot.curve_cert}: others may read it "
                  "(chmod 600: whoever holds the key pair is admitted as a rank)")
    rundir = args.rundir
    try:
        if cleanup and rundir and args.statedir:
            check_statedir_outside(args.statedir, rundir)
        if rundir:
            # absolute: the URI it prints must work from any directory
            rundir = os.path.abspath(rundir)
            private_dir(rundir, "--rundir")
        if args.statedir:
            # absolute, as `start` makes it: the `statedir` attribute and the
            # log lines naming it are read from other directories and hosts
            args.statedir = os.path.abspath(args.statedir)
            private_dir(args.statedir, "--statedir")
        if not rundir:
            rundir = make_rundir()
    except StartError as exc:
        print_err(f"broker: {exc}")
        return 2
    if battrs.ALLOW_GUEST_USER.value(attrs):
        os.chmod(rundir, 0o755)  # guests reach the socket in it (as `start` does)
    argv = ["--rank", str(rank), "--size", str(boot.size), "--fanout", str(boot.fanout),
            "--rundir", rundir, "--event-loop", args.event_loop,
            "--attrs", json.dumps(attrs), "--endpoints", json.dumps(boot.endpoints()),
            "--hosts", json.dumps(boot.hostnames(hostname))]
    if boot.curve_cert is not None:
        argv += ["--curve-keys", boot.curve_cert]
    argv += ["--config-file", os.path.abspath(args.config)]
    bind = boot.bind_endpoint(rank)
    if bind:
        argv += ["--bind", bind]
    if args.statedir:
        argv += ["--statedir", args.statedir]
    command = command_args(args.cmdline)
    if command and rank == 0:
        argv += ["--initial-program", json.dumps(command)]
    try:
        return rank_main.main(argv)
    finally:
        # Flux's rundir-cleanup: 1 removes even an operator's --rundir, 0
        # keeps even the one made here; by default a made one goes
        if cleanup or (cleanup is None and not args.rundir):
            remove_rundir(rundir)
