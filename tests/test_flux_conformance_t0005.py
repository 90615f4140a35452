"""flux-core t/t0005-exec.t (``flux exec``: a command on ranks of an
instance) against ``kvbroker exec`` and real ranks: a 4-rank instance
(fanout 2), as Flux's ``test_under_flux 4``.

kvbroker's exec is documented in docs/cli.md ("exec").  Two documented
differences shape the mapping: **the default rank is 0**, not every rank
(``flux exec CMD`` is ``kvbroker exec -r all -- CMD``), and one rank
without ``-l`` is a fast path where exec *becomes* the command (its exit
status is the command's own, a signal included).  ``flux getattr rank``
is ``kvbroker attr get rank``; ``FLUX_URI`` is ``KVBROKER_URI``.  More of
exec is pinned in tests/test_cli_exec.py (referenced below, not repeated).

Flux's cases, in order, and what each becomes:

1.-4. 'basic exec functionality', 'exec to specific rank', 'to "all"
    ranks', 'to subset of ranks' (``-n true``, ``-r 0``, ``-r all``,
    ``-r 2-3``) -> :func:`test_exec_runs_on_the_ranks_it_is_given`: each
    runs, on the ranks named (the default: rank 0 only).
5.-6. 'exec to all except a set of ranks' (``-x 2-3``: 0,1) and 'with
    --ranks and --exclude' (``-r 2-3 -x 3``: 2) ->
    :func:`test_exec_exclude_and_an_empty_set`: ``-r all -x 2-3`` gives
    ranks 0,1; ``-x 2-3`` alone rank 0 (the default, documented).
    More in test_cli_exec.py (test_exec_exclude_leaves_out_its_ranks).
7.-10. allow-guest-user on/off, 'exec to rank 0 from another rank is an
    error' / 'works' -> a command for a rank of this host is exec's own
    child, run as its caller; one for a rank elsewhere goes through that
    rank's ``rexec`` service, which is the instance owner's (a guest is
    refused everywhere: tests/test_rexec.py), and a multi-user instance's
    rank 0 refuses it from other ranks, as Flux's
    (tests/test_flux_conformance_t0005_rexec.py).  The nesting applies:
    :func:`test_exec_from_rank_1_to_rank_0_works`.
11. 'exec to non-existent rank is an error' -> in
    :func:`test_exec_runs_on_the_ranks_it_is_given` (exit 1, nothing run;
    the set path in test_cli_exec.py, test_exec_refuses_ranks_...).
12. 'exec to empty idset is an error' (``-r 0-1 -x 0-1``) -> usage error,
    exit 2, in :func:`test_exec_exclude_and_an_empty_set` (more in
    test_cli_exec.py, test_exec_exclude_of_every_rank_is_a_usage_error).
13.-15. test_on_rank works / sends to the correct rank / with
    test_must_fail (sharness's ``test_on_rank`` is ``flux exec -r``) ->
    :func:`test_exec_on_one_rank_reaches_that_rank`.
16. 'passes environment variables' -> :func:`test_exec_passes_the_environment`
    (fast path and a set).
17. 'does not pass FLUX_URI' -> the same test: each command's
    ``KVBROKER_URI`` is its own rank's, not the caller's.
18.-19. 'passes cwd', '-d option works' -> :func:`test_exec_working_directory`.
20. '-d none' (Flux: leave the cwd to the rexec server) -> DIFFERENCE,
    undocumented: kvbroker has no server to inherit a directory from (it
    spawns the commands itself), and ``none`` is a directory name like
    any other: ``-d none`` where there is none exits 1 (pinned there).
21. 'test_on_rank works on multiple ranks' (each rank writes its rank to
    its file) and 28. 'per rank output works' (``-lr 0-3``) ->
    :func:`test_exec_each_rank_of_a_set_is_attached_to_its_own_rank`.
22.-23. 'exits with code 127 for file not found' (and its message), 126
    for a non-executable -> :func:`test_exec_cannot_run_statuses` (fast
    path and a set; kvbroker says ``CMD: No such file or directory`` /
    ``Permission denied`` as a shell does, not "error launching process").
24. 'passes non-zero exit status' (2, 3, 139 for SIGSEGV) and 26. 'outputs
    tasks with errors' (``[0-3]: Exit 2``, ``Segmentation fault``) ->
    :func:`test_exec_passes_the_exit_status_and_names_the_ranks`; on the
    fast path exec *is* the command, so a SIGSEGV is the process's own
    death (a shell's 139), with no line of exec's.
25. '--with-imp' -> does not apply (no IMP, no multi-user execution):
    :func:`test_exec_has_no_rexec_options` pins it a usage error.
27. 'basic IO testing' -> :func:`test_exec_relays_stdout_and_stderr`.
29. 'I/O, multiple lines, no newline on last line' (``-lr 1``) -> DIFFERENCE,
    documented: with ``-l`` a last line without a newline gets one
    (``1: one\\n1: two\\n``; Flux: ``1: one\\n1: two``):
    :func:`test_exec_label_io_a_last_line_without_newline`.
30. 'I/O -- long lines' (a 5464-byte line, no newline) ->
    :func:`test_exec_relays_a_long_line_whole` (one rank, a set, ``-l``).
31. 'signal forwarding works' (SIGINT -> 130, SIGTERM -> 143; the commands
    read their input, which stays open) ->
    :func:`test_exec_a_forwarded_signal_ends_the_commands`.
    (test_cli_exec.py has commands that catch the signal and exit 7.)
    Flux's ``-v`` (print each rank's pid) does not exist here: a usage
    error, in :func:`test_exec_has_no_rexec_options`.
32.-36. stdin broadcast: default (Flux: 4; here rank 0: 1, the documented
    default), ``-rall`` 4, ``-r0-3`` 4, ``-r1`` 1, ``-r0-2`` 3 ->
    :func:`test_exec_broadcasts_stdin_to_each_rank`.
37.-38. 'stdin redirect from /dev/null works without / with -n' ->
    :func:`test_exec_stdin_from_dev_null`.
39.-44. 'stdin flow control' (5 MB, ``--setopt=stdin_BUFSIZE=4096``, each
    rank ``dd of=cpy.RANK``; one rank not reading) -> no ``--setopt`` (its
    flow control is built in, EXEC_STDIN_BACKLOG, documented); the same
    5 MB file as exec's stdin: :func:`test_exec_stdin_a_large_file_reaches_each_rank`.
    (The bound itself: test_cli_exec.py.)
45.-46. 'stdin broadcast -- multiple lines / long lines' (``-l -r0-3 cat``)
    -> :func:`test_exec_stdin_broadcast_lines_come_back_labelled`.
47.-48. 'dbus environment variable is set / not overwritten' -> Flux sets
    DBUS_SESSION_BUS_ADDRESS for its systemd user instance; kvbroker has
    none, so setting it does not apply; not overwriting it is part of
    passing the environment (:func:`test_exec_passes_the_environment`).
49.-end. rexec ``--bg``, ``--label``, ``--waitable``, ``flux sproc``
    ps/kill/wait, zombies -> NEW (2026-12-06): ``exec --bg [--waitable]
    [--label]`` and ``kvbroker sproc``, their cases in
    tests/test_flux_conformance_t0040.py (Flux's t0040-flux-sproc.t) and
    the protocol's in tests/test_rexec.py (``--waitable`` without ``--bg``,
    an empty or taken label, a failed start that leaves no zombie, a
    second waiter, a waiter's disconnect, zombies at the rank's stop, the
    end logged).  DIFFERENCES: ``--label`` needs ``--bg`` here (Flux
    labels a foreground command too); a second waiter is ``EBUSY`` (Flux:
    ``EINVAL``); a background command's output is not logged line by line
    -- a waitable one's last MiB per stream is kept for ``sproc wait
    --output``, a plain one's is ``/dev/null`` (its end is logged, as
    Flux's).  ``--attach`` (RFC 42) does not apply: a usage error
    (:func:`test_exec_has_no_rexec_options`).

Beyond Flux's cases (its output cases with exec's two outputs as one,
``> 2.out 2>&1`` as in case 26, and at a terminal):

* :func:`test_exec_lines_stay_whole_with_stdout_and_stderr_on_one_pipe`:
  stdout and stderr on one pipe (``2>&1 | tee``, a terminal), no line of
  one stream is cut by a line of the other (docs/cli.md: "interleave as
  lines, never within one");
* :func:`test_exec_leaves_its_outputs_blocking_mode_alone`: exec leaves
  its stdout and stderr (shared with the shell) as blocking as it was
  given them, on both loops;
* :func:`test_exec_relays_all_of_a_large_output_to_a_terminal`: at a
  terminal a large output is relayed whole, on both loops.
All three failed until 2026-12-05 (found by this file): each stream had
its own lock, and under uvloop ``add_writer`` left the descriptors
non-blocking, so a terminal refused a write (``EAGAIN``) and exec ended
"Resource temporarily unavailable", the rest of the output lost.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import signal
import sys
import termios
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli

SIZE = 4


def writer(batch: int) -> str:
    """A command writing 20 times ``batch`` lines to stdout at once, then 50
    lines to stderr one by one, each line naming its rank."""
    return ("import os\n"
            "r = os.environ['KVBROKER_RANK'].encode()\n"
            "for j in range(20):\n"
            "    os.write(1, b''.join(b'rank %s out %d-%d %s\\n' % (r, j, i, b'o' * 60)\n"
            f"                         for i in range({batch})))\n"
            "    for i in range(50):\n"
            "        os.write(2, b'rank %s err %d-%d %s\\n' % (r, j, i, b'e' * 30))\n")


async def run_exec(*args: str, uri: str, cwd: str | None = None, stdin: int | None = None,
                   input: bytes | None = None, env: dict[str, str] | None = None,
                   timeout: float = 60.0) -> tuple[int, str, str]:
    """``kvbroker exec ARGS`` in ``cwd``, with ``stdin`` (a file
    descriptor; default /dev/null) or ``input`` written to a pipe."""
    return await run_cli("exec", *args, uri=uri, cwd=cwd, stdin=stdin, input=input,
                         env=env, timeout=timeout)


def rank_lines(out: str, rank: int) -> list[str]:
    prefix = f"{rank}: "
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


ECHO_RANK = ["sh", "-c", 'echo "$KVBROKER_RANK"']


async def test_exec_runs_on_the_ranks_it_is_given(start_instance, tmp_path: Path) -> None:
    """Flux 1-4, 11: no ``-r`` (here rank 0), ``-r 0``, ``-r all``,
    ``-r 2-3`` each run their command, on those ranks; a rank the
    instance does not have fails (exit 1) and runs nothing."""
    inst = await start_instance(size=SIZE, fanout=2)
    uri = inst.uri(0)
    cases = ([], ["-r", "0"], ["-r", "all"], ["-r", "2-3"])
    results = await asyncio.gather(*(run_exec("-n", *opts, "--", *ECHO_RANK, uri=uri)
                                     for opts in cases))
    for opts, want, (rc, out, err) in zip(cases, (["0"], ["0"], ["0", "1", "2", "3"],
                                                  ["2", "3"]), results, strict=True):
        assert (rc, err) == (0, ""), opts
        assert sorted(out.splitlines()) == want, opts
    ran = tmp_path / "ran"
    for opts in (["-r", "5"], ["-r", "3-5"]):
        rc, out, err = await run_exec("-n", *opts, "--", "touch", str(ran), uri=uri)
        assert (rc, out) == (1, ""), opts
        assert err.startswith("kvbroker: exec: No route to host"), err
    assert not ran.exists()


async def test_exec_exclude_and_an_empty_set(start_instance) -> None:
    """Flux 5, 6, 12: ``-r all -x 2-3`` runs on 0 and 1 (Flux's ``-x 2-3``,
    whose default is all); ``-x 2-3`` alone here leaves rank 0, the
    default; ``-r 2-3 -x 3`` is rank 2; ``-r 0-1 -x 0-1`` is a usage error."""
    inst = await start_instance(size=SIZE, fanout=2)
    uri = inst.uri(0)
    getrank = [KVBROKER, "attr", "get", "rank"]
    (rc1, out1, err1), (rc2, out2, err2), (rc3, out3, err3) = await asyncio.gather(
        run_exec("-n", "-r", "all", "-x", "2-3", "--", *getrank, uri=uri),
        run_exec("-n", "-x", "2-3", "--", *getrank, uri=uri),
        run_exec("-n", "-r", "2-3", "-x", "3", "--", *getrank, uri=uri))
    assert (rc1, sorted(out1.splitlines()), err1) == (0, ["0", "1"], "")
    assert (rc2, out2, err2) == (0, "0\n", "")
    assert (rc3, out3, err3) == (0, "2\n", "")
    rc, out, err = await run_exec("-n", "-r", "0-1", "-x", "0-1", "--", "true", uri=uri)
    assert (rc, out) == (2, ""), err
    assert "-x 0-1 leaves no rank of -r 0-1 to run on" in err, err


async def test_exec_from_rank_1_to_rank_0_works(start_instance) -> None:
    """Flux 10: an exec run on rank 1 reaches rank 0 in turn (fast path
    and a set): the inner command is attached to rank 0."""
    inst = await start_instance(size=SIZE, fanout=2)
    show = 'echo "$KVBROKER_RANK $KVBROKER_URI"'
    for inner in (["-r", "0"], ["-r", "0", "-l"]):
        rc, out, err = await run_exec("-n", "-r", "1", "--", KVBROKER, "exec", "-n", *inner,
                                      "--", "sh", "-c", show, uri=inst.uri(0))
        assert (rc, err) == (0, ""), inner
        label = "0: " if "-l" in inner else ""
        assert out == f"{label}0 {inst.uri(0)}\n", inner


async def test_exec_on_one_rank_reaches_that_rank(start_instance) -> None:
    """Flux 13-15 (``test_on_rank``): ``-r 1`` runs where ``attr get rank``
    says 1 (and not 0: the failing check fails, its status passed)."""
    inst = await start_instance(size=SIZE, fanout=2)
    check = f"{KVBROKER} attr get rank | grep -x %s"
    (rc1, out1, err1), (rc0, out0, err0) = await asyncio.gather(
        run_exec("-n", "-r", "1", "--", "sh", "-c", check % 1, uri=inst.uri(0)),
        run_exec("-n", "-r", "1", "--", "sh", "-c", check % 0, uri=inst.uri(0)))
    assert (rc1, out1, err1) == (0, "1\n", "")
    assert (rc0, out0, err0) == (1, "", "")


async def test_exec_each_rank_of_a_set_is_attached_to_its_own_rank(start_instance,
                                                                  tmp_path: Path) -> None:
    """Flux 21, 28: on ``-r 0-3`` each command writes the rank its broker
    says to a file named by it, and prints it, labelled (``-lr 0-3``, as
    Flux spells it)."""
    inst = await start_instance(size=SIZE, fanout=2)
    script = f'r=$({KVBROKER} attr get rank) && echo "$r" > {tmp_path}/rank_output.$r && echo "$r"'
    rc, out, err = await run_exec("-n", "-lr", "0-3", "--", "sh", "-c", script,
                                  uri=inst.uri(0))
    assert (rc, err) == (0, "")
    assert sorted(out.splitlines()) == [f"{r}: {r}" for r in range(SIZE)]
    for r in range(SIZE):
        assert (tmp_path / f"rank_output.{r}").read_text() == f"{r}\n"


async def test_exec_passes_the_environment(start_instance) -> None:
    """Flux 16, 17, 48: the caller's environment reaches the commands (a
    variable unset is unset there; DBUS_SESSION_BUS_ADDRESS as it was),
    but ``KVBROKER_URI`` is each command's own rank's, not the caller's."""
    inst = await start_instance(size=SIZE, fanout=2)
    env = {k: v for k, v in os.environ.items() if k not in ("FOOTEST",)}
    test = ["sh", "-c", 'test "$FOOTEST" = t']
    for opts in (["-r", "0"], ["-r", "all"]):
        rc, _, _ = await run_exec("-n", *opts, "--", *test, uri=inst.uri(0), env=env)
        assert rc == 1, opts
        rc, out, err = await run_exec("-n", *opts, "--", *test, uri=inst.uri(0),
                                      env=dict(env, FOOTEST="t"))
        assert (rc, out, err) == (0, "", ""), opts
    show = 'echo "$KVBROKER_URI $DBUS_SESSION_BUS_ADDRESS"'
    rc, out, err = await run_exec("-n", "-r", "1", "--", "sh", "-c", show, uri=inst.uri(0),
                                  env=dict(env, DBUS_SESSION_BUS_ADDRESS="xyz"))
    assert (rc, out, err) == (0, f"{inst.uri(1)} xyz\n", "")
    assert inst.uri(1) != inst.uri(0)
    rc, out, err = await run_exec("-n", "-r", "all", "--", "sh", "-c", show, uri=inst.uri(0),
                                  env=dict(env, DBUS_SESSION_BUS_ADDRESS="xyz"))
    assert (rc, err) == (0, "")
    assert sorted(out.splitlines()) == sorted(f"{inst.uri(r)} xyz" for r in range(SIZE))


async def test_exec_working_directory(start_instance, tmp_path: Path) -> None:
    """Flux 18-20: the commands run in exec's directory, or in ``-d DIR``
    (fast path and a set); ``-d none`` is a directory named ``none``
    (a difference: Flux's "leave it to the server"), not there: exit 1."""
    inst = await start_instance(size=SIZE, fanout=2)
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    for opts, n in ((["-r", "0"], 1), (["-r", "all"], SIZE)):
        rc, out, err = await run_exec("-n", *opts, "--", "pwd", uri=inst.uri(0), cwd=str(here))
        assert (rc, out, err) == (0, f"{here}\n" * n, ""), opts
        rc, out, err = await run_exec("-n", "-d", str(there), *opts, "--", "pwd",
                                      uri=inst.uri(0), cwd=str(here))
        assert (rc, out, err) == (0, f"{there}\n" * n, ""), opts
    rc, out, err = await run_exec("-n", "-d", "none", "--", "pwd", uri=inst.uri(0),
                                  cwd=str(here))
    assert (rc, out, err) == (1, "", "kvbroker: exec: -d none: No such file or directory\n")


async def test_exec_cannot_run_statuses(start_instance) -> None:
    """Flux 22, 23: a command not found is 127, one not executable
    (``/dev/null``) 126, with the reason on stderr, on one rank or four."""
    inst = await start_instance(size=SIZE, fanout=2)
    for opts in ([], ["-r", "all"]):
        rc, out, err = await run_exec("-n", *opts, "--", "./nosuchprocess", uri=inst.uri(0),
                                      timeout=30)
        assert (rc, out) == (127, ""), opts
        assert "./nosuchprocess: No such file or directory" in err, err
        rc, out, err = await run_exec("-n", *opts, "--", "/dev/null", uri=inst.uri(0))
        assert (rc, out) == (126, ""), opts
        assert "/dev/null: Permission denied" in err, err


async def test_exec_passes_the_exit_status_and_names_the_ranks(start_instance) -> None:
    """Flux 24, 26: exit 2, exit 3 and death by SIGSEGV (139) are exec's
    status; on several ranks each is reported with the ranks that had it
    (``ranks 0-3: Exit 2``, ``Segmentation fault``).  On the fast path
    exec is the command: it dies by SIGSEGV itself (139 to a shell)."""
    inst = await start_instance(size=SIZE, fanout=2)
    segv = "ulimit -c 0; kill -SEGV $$"
    scripts = ("exit 2", "exit 3", segv)
    fast = await asyncio.gather(*(run_exec("-n", "--", "sh", "-c", s, uri=inst.uri(0))
                                  for s in scripts))
    assert [rc for rc, _, _ in fast] == [2, 3, -signal.SIGSEGV]
    assert all(err == "" for _, _, err in fast), fast
    many = await asyncio.gather(*(run_exec("-n", "-r", "all", "--", "sh", "-c", s,
                                           uri=inst.uri(0)) for s in scripts))
    assert [rc for rc, _, _ in many] == [2, 3, 128 + signal.SIGSEGV]
    assert [err for _, _, err in many] == [
        "kvbroker: exec: ranks 0-3: Exit 2\n", "kvbroker: exec: ranks 0-3: Exit 3\n",
        "kvbroker: exec: ranks 0-3: Segmentation fault\n"]


@pytest.mark.parametrize("opt", ["--with-imp", "--attach=foo", "--setopt=stdin_BUFSIZE=4096",
                                 "-v"])
async def test_exec_has_no_rexec_options(opt: str, tmp_path: Path) -> None:
    """Flux 25, 39-44 (``--setopt``), the attach cases of 49-end: flux
    exec's options for its subprocess server (IMP, attach, channel buffer
    sizes) do not exist here: a usage error (exit 2), nothing run (and no
    instance asked).  (``--bg``, ``--waitable``, ``--label``: t0040.)"""
    ran = tmp_path / "ran"
    rc, out, err = await run_cli("exec", "-r", "0", opt, "--", "touch", str(ran),
                                 uri="local:///nonexistent/socket")
    assert (rc, out) == (2, ""), err
    assert err.startswith("usage: kvbroker exec "), err
    # (no abbreviation is taken: ``--attach`` is not ``--label-io`` or another)
    assert err.rstrip().endswith(f"kvbroker exec: error: unrecognized arguments: {opt}"), err
    assert not ran.exists()


async def test_exec_relays_stdout_and_stderr(start_instance) -> None:
    """Flux 27: a line to stdout comes out on exec's stdout, one to stderr
    on its stderr: one rank (fast path), one rank with ``-l``, two ranks."""
    inst = await start_instance(size=SIZE, fanout=2)
    for opts, label in ((["-r", "0"], ""), (["-r", "0", "-l"], "0: "),
                        (["-r", "0-1"], "")):
        n = 2 if opts[1] == "0-1" else 1
        rc, out, err = await run_exec("-n", *opts, "--", "echo", "Hello", uri=inst.uri(0))
        assert (rc, out, err) == (0, f"{label}Hello\n" * n, ""), opts
        rc, out, err = await run_exec("-n", *opts, "--", "sh", "-c", "echo Hello >&2",
                                      uri=inst.uri(0))
        assert (rc, out, err) == (0, "", f"{label}Hello\n" * n), opts


async def test_exec_label_io_a_last_line_without_newline(start_instance) -> None:
    """Flux 29: ``-lr 1 echo -en 'one\\ntwo'``: both lines labelled, and (a
    documented difference) the last one given its newline."""
    inst = await start_instance(size=SIZE, fanout=2)
    rc, out, err = await run_exec("-n", "-l", "-r", "1", "--", "printf", "one\\ntwo",
                                  uri=inst.uri(0))
    assert (rc, out, err) == (0, "1: one\n1: two\n", "")
    rc, out, err = await run_exec("-n", "-l", "-r", "1", "--", "printf", "one",
                                  uri=inst.uri(0))
    assert (rc, out, err) == (0, "1: one\n", "")


async def test_exec_relays_a_long_line_whole(start_instance, tmp_path: Path) -> None:
    """Flux 30: a 5464-byte line without a newline (4 KiB of random bytes in
    base64) comes back as it is: from one rank; from each of four, whole
    (never cut by another rank's); labelled with ``-l``."""
    inst = await start_instance(size=SIZE, fanout=2)
    line = base64.b64encode(os.urandom(4096)).decode()
    expected = tmp_path / "expected"
    expected.write_text(line)
    rc, out, err = await run_exec("-n", "-r", "1", "--", "cat", str(expected), uri=inst.uri(0))
    assert (rc, out, err) == (0, line, "")
    rc, out, err = await run_exec("-n", "-r", "all", "--", "cat", str(expected),
                                  uri=inst.uri(0))
    assert (rc, out, err) == (0, line * SIZE, "")
    rc, out, err = await run_exec("-n", "-r", "all", "-l", "--", "cat", str(expected),
                                  uri=inst.uri(0))
    assert (rc, err) == (0, "")
    assert sorted(out.splitlines()) == [f"{r}: {line}" for r in range(SIZE)]


@pytest.mark.parametrize("sig, status, name", [(signal.SIGINT, 130, "Interrupt"),
                                               (signal.SIGTERM, 143, "Terminated")])
async def test_exec_a_forwarded_signal_ends_the_commands(start_instance, sig: int,
                                                         status: int, name: str) -> None:
    """Flux 31: ``exec -r all`` of a command that says "hi" then reads its
    input (exec's, still open): SIGINT / SIGTERM to exec reaches every
    command, which dies of it; exec exits 128+N, naming the ranks."""
    inst = await start_instance(size=SIZE, fanout=2)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "exec", "-r", "all", "--", "sh", "-c", "echo hi; exec cat",
        env=dict(os.environ, KVBROKER_URI=inst.uri(0)), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            for _ in range(SIZE):
                assert await proc.stdout.readline() == b"hi\n"
            proc.send_signal(sig)
            out, err = await asyncio.gather(proc.stdout.read(), proc.stderr.read())
            rc = await proc.wait()
    finally:
        proc.stdin.close()  # (kept open till here: the commands had input to wait for)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert (rc, out) == (status, b""), err
    assert err.decode() == f"kvbroker: exec: ranks 0-3: {name}\n"


async def test_exec_broadcasts_stdin_to_each_rank(start_instance) -> None:
    """Flux 32-36: ``echo Hello | exec cat`` prints Hello once per rank of
    the set: the default (rank 0 here) 1, ``-r all`` 4, ``-r 0-3`` 4,
    ``-r 1`` 1, ``-r 0-2`` 3 (spelt as Flux's: ``-rall``, ``-r0-3``...)."""
    inst = await start_instance(size=SIZE, fanout=2)
    cases = (([], 1), (["-rall"], 4), (["-r0-3"], 4), (["-r1"], 1), (["-r0-2"], 3))
    results = await asyncio.gather(*(run_exec(*opts, "--", "cat", uri=inst.uri(0),
                                              input=b"Hello\n") for opts, _ in cases))
    for (opts, n), (rc, out, err) in zip(cases, results, strict=True):
        assert (rc, out, err) == (0, "Hello\n" * n, ""), opts


async def test_exec_stdin_from_dev_null(start_instance) -> None:
    """Flux 37, 38: ``exec -r 0-3 cat < /dev/null``, with and without
    ``-n``: each cat gets EOF at once, exec exits 0."""
    inst = await start_instance(size=SIZE, fanout=2)
    for opts in ([], ["-n"]):
        rc, out, err = await run_exec(*opts, "-r", "0-3", "--", "cat", uri=inst.uri(0),
                                      timeout=30)
        assert (rc, out, err) == (0, "", ""), opts


async def test_exec_stdin_a_large_file_reaches_each_rank(start_instance,
                                                         tmp_path: Path) -> None:
    """Flux 39-44: a 5 MB file as exec's stdin, each command copying its
    input to ``cpy.RANK``: rank 0 alone (fast path), ranks 0-3, and 0-3
    where rank 0 exits at once without reading (the others still get it
    all, and exec ends)."""
    inst = await start_instance(size=SIZE, fanout=2)
    data = os.urandom(5 << 20)
    big = tmp_path / "5Mfile"
    big.write_bytes(data)
    copy = f'cat > {tmp_path}/cpy.$KVBROKER_RANK'
    early = f'if [ "$KVBROKER_RANK" != 0 ]; then {copy}; fi'

    async def run(ranks: str, script: str) -> None:
        fd = os.open(big, os.O_RDONLY)
        try:
            rc, out, err = await run_exec("-r", ranks, "--", "sh", "-c", script,
                                          uri=inst.uri(0), stdin=fd, timeout=90)
        finally:
            os.close(fd)
        assert (rc, out, err) == (0, "", ""), (ranks, script)

    await run("0", copy)
    assert (tmp_path / "cpy.0").read_bytes() == data
    (tmp_path / "cpy.0").unlink()
    await run("0-3", copy)
    for r in range(SIZE):
        assert (tmp_path / f"cpy.{r}").read_bytes() == data, r
        (tmp_path / f"cpy.{r}").unlink()
    await run("0-3", early)
    assert not (tmp_path / "cpy.0").exists()
    for r in range(1, SIZE):
        assert (tmp_path / f"cpy.{r}").read_bytes() == data, r


@pytest.mark.parametrize("wrap", [True, False], ids=["multiple-lines", "long-line"])
async def test_exec_stdin_broadcast_lines_come_back_labelled(start_instance,
                                                             wrap: bool) -> None:
    """Flux 45, 46: 4 KiB of random bytes in base64 (lines of 76, or one
    line) through ``exec -l -r 0-3 cat``: each rank's labelled lines are
    the input's, in order."""
    inst = await start_instance(size=SIZE, fanout=2)
    raw = os.urandom(4096)
    text = (base64.encodebytes(raw) if wrap else base64.b64encode(raw) + b"\n").decode()
    rc, out, err = await run_exec("-l", "-r", "0-3", "--", "cat", uri=inst.uri(0),
                                  input=text.encode(), timeout=30)
    assert (rc, err) == (0, "")
    for r in range(SIZE):
        assert rank_lines(out, r) == text.splitlines(), r


async def test_exec_lines_stay_whole_with_stdout_and_stderr_on_one_pipe(start_instance) -> None:
    """Flux 26 sends exec's stdout and stderr to one place (``>2.out
    2>&1``).  docs/cli.md: lines of different ranks "interleave as lines,
    never within one" -- which must hold when both streams are one pipe
    (``2>&1 | tee log``; a terminal is one too): each command writes
    batches of lines to stdout and single lines to stderr, and every line
    of the merged output is whole."""
    inst = await start_instance(size=SIZE, fanout=2)
    script = writer(200)
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "exec", "-n", "-r", "all", "--", sys.executable, "-c", script,
        env=dict(os.environ, KVBROKER_URI=inst.uri(0)), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out[-500:]
    lines = out.decode().splitlines()
    assert len(lines) == SIZE * 20 * 250
    whole = re.compile(r"rank \d (out \d+-\d+ o{60}|err \d+-\d+ e{30})")
    cut = [line for line in lines if not whole.fullmatch(line)]
    assert cut == [], f"{len(cut)} lines cut, e.g. {cut[:2]}"



@pytest.mark.parametrize("loop", [
    "asyncio", "uvloop"])
async def test_exec_leaves_its_outputs_blocking_mode_alone(start_instance, loop: str) -> None:
    """Flux 27 (output relayed to exec's stdout and stderr), and what the
    shell keeps of them: exec's stdout and stderr are pipes the test holds
    (shared, as a shell's are); after ``exec -r all`` relayed lines there,
    both are still in blocking mode, as they were given (docs: relayed
    "leaving the descriptor's flags alone (it is shared with the shell)").
    A writer left with a non-blocking pipe fails with EAGAIN when its
    reader is slow (``{ kvbroker exec ...; cat big; } | less``)."""
    inst = await start_instance(size=SIZE, fanout=2)
    r_out, w_out = os.pipe()
    r_err, w_err = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "exec", "-n", "-r", "all", "--", "sh", "-c", "echo out; echo err >&2",
            env=dict(os.environ, KVBROKER_URI=inst.uri(0), KVBROKER_EVENT_LOOP=loop),
            stdin=asyncio.subprocess.DEVNULL, stdout=w_out, stderr=w_err)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
        assert os.read(r_out, 4096) == b"out\n" * SIZE
        assert os.read(r_err, 4096) == b"err\n" * SIZE
        assert (os.get_blocking(w_out), os.get_blocking(w_err)) == (True, True)
    finally:
        for fd in (r_out, w_out, r_err, w_err):
            os.close(fd)


@pytest.mark.parametrize("loop", [
    "asyncio", "uvloop"])
async def test_exec_relays_all_of_a_large_output_to_a_terminal(start_instance,
                                                               loop: str) -> None:
    """Flux 27 at a terminal (a pty as exec's stdout and stderr, the test
    reading it as a terminal emulator would): every command's 5,000 lines
    of stdout and 1,000 of stderr all come out, and exec exits 0."""
    inst = await start_instance(size=SIZE, fanout=2)
    script = writer(250)
    master, slave = os.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR  # (no "\r\n" for "\n")
    termios.tcsetattr(slave, termios.TCSANOW, attrs)

    def read_all() -> bytes:
        data = bytearray()
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer of the pty is gone
                return bytes(data)
            if not chunk:
                return bytes(data)
            data += chunk

    try:
        reader = asyncio.ensure_future(asyncio.to_thread(read_all))
        proc = await asyncio.create_subprocess_exec(
            KVBROKER, "exec", "-n", "-r", "all", "--", sys.executable, "-c", script,
            env=dict(os.environ, KVBROKER_URI=inst.uri(0), KVBROKER_EVENT_LOOP=loop),
            stdin=asyncio.subprocess.DEVNULL, stdout=slave, stderr=slave)
        os.close(slave)
        slave = -1
        try:
            rc = await asyncio.wait_for(proc.wait(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        out = await asyncio.wait_for(reader, 60)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert rc == 0, out[-300:]
    assert out.count(b"\n") == SIZE * 20 * 300, out[-300:]
