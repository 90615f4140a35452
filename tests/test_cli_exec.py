"""``kvbroker exec -r IDSET``: a command on each rank of a set, as ``flux
exec`` (docs/cli.md, exec).  Real ranks, real ``kvbroker`` processes; the
single-rank fast path is in test_cli_broker.py."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from test_broker_support import KVBROKER, run_cli, stopped

from broker.cliutil import encode_ranks, rank_set


def rank_lines(out: str, rank: int) -> list[str]:
    """The lines of ``--label-io`` output from ``rank``, label removed, in order."""
    prefix = f"{rank}: "
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


async def test_exec_runs_the_command_on_each_rank_of_a_set(start_instance) -> None:
    """Each rank of the set runs the command once, attached to its own rank:
    ``attr get rank`` through its ``KVBROKER_URI`` answers that rank, and
    ``KVBROKER_RANK`` says it too."""
    inst = await start_instance(size=4, fanout=2)
    show = f'echo "$KVBROKER_RANK $({KVBROKER} attr get rank) $KVBROKER_URI"'
    for idset, ranks in (("0,2-3", [0, 2, 3]), ("[1-2]", [1, 2]), ("all", [0, 1, 2, 3])):
        rc, out, err = await run_cli("exec", "-r", idset, "--", "sh", "-c", show,
                                     uri=inst.uri(0))
        assert rc == 0, err
        assert sorted(out.splitlines()) == [f"{r} {r} {inst.uri(r)}" for r in ranks], idset


async def test_exec_all_in_an_instance_of_one_rank_runs_it_once(start_instance) -> None:
    inst = await start_instance(size=1)
    rc, out, err = await run_cli("exec", "-r", "all", "--", KVBROKER, "attr", "get", "rank",
                                 uri=inst.uri(0))
    assert (rc, out, err) == (0, "0\n", "")


async def test_exec_exits_with_the_highest_status_and_names_the_ranks(start_instance) -> None:
    """The highest status wins, a signal counting 128+N (SIGTERM: 143 beats
    exit 5); each status but 0 is reported with its ranks, as flux exec."""
    inst = await start_instance(size=4, fanout=2)
    script = 'case $KVBROKER_RANK in 1|3) exit 5;; 2) kill -TERM $$;; esac'
    rc, out, err = await run_cli("exec", "-r", "all", "--", "sh", "-c", script,
                                 uri=inst.uri(0))
    assert rc == 128 + signal.SIGTERM, err
    assert err.splitlines() == ["kvbroker: exec: ranks 1,3: Exit 5",
                                "kvbroker: exec: rank 2: Terminated"]
    rc, out, err = await run_cli("exec", "-r", "0-3", "--", "sh", "-c", "exit $KVBROKER_RANK",
                                 uri=inst.uri(0))
    assert rc == 3, err
    rc, _, err = await run_cli("exec", "-r", "all", "--", "/nonexistent/cmd", uri=inst.uri(0))
    assert rc == 127
    assert err.splitlines() == ["kvbroker: /nonexistent/cmd: No such file or directory",
                                "kvbroker: exec: ranks 0-3: Exit 127"]


@pytest.mark.parametrize("idset, message", [
    ("3-1", "range '3-1' does not ascend (in '3-1')"),
    ("2,1", "'1' is out of order (in '2,1': ascending, each rank once)"),
    ("0-2,2", "'2' is out of order (in '0-2,2': ascending, each rank once)"),
    ("1-03", "not a rank or range of ranks: '1-03' (in '1-03': e.g. 0-3,5 or all)"),
    ("x", "not a rank or range of ranks: 'x' (in 'x': e.g. 0-3,5 or all)"),
    ("", "not a rank or range of ranks: '' (in '': e.g. 0-3,5 or all)"),
    ("1,,2", "not a rank or range of ranks: '' (in '1,,2': e.g. 0-3,5 or all)"),
    ("0-", "not a rank or range of ranks: '0-' (in '0-': e.g. 0-3,5 or all)"),
    ("[0-2", "not a rank or range of ranks: '[0-2' (in '[0-2': e.g. 0-3,5 or all)"),
    ("0-4294967294", "must be at most 4294967293: 4294967294"),
])
async def test_exec_refuses_a_malformed_idset_as_a_usage_error(idset: str, message: str) -> None:
    """Refused before anything is asked or run (exit 2, the usage line)."""
    rc, out, err = await run_cli("exec", "-r", idset, "--", "true",
                                 uri="local:///nonexistent/socket")
    assert (rc, out) == (2, ""), err
    assert err.startswith("usage: kvbroker exec "), err
    assert err.rstrip().endswith(f": error: argument -r/--rank: {message}"), err


def test_rank_sets_read_as_flux_idsets() -> None:
    for text, ranks in (("0-3,5", [0, 1, 2, 3, 5]), ("[7]", [7]), ("0,4-5", [0, 4, 5])):
        assert rank_set(text).ranks(8, "exec") == ranks
        assert encode_ranks(ranks) == text.strip("[]")
    assert rank_set("all").ranks(3, "exec") == [0, 1, 2]
    assert rank_set("4").single() == 4 and rank_set("all").single() is None
    with pytest.raises(argparse.ArgumentTypeError, match="must not be negative: -1"):
        rank_set("-1")


async def test_exec_refuses_ranks_the_instance_does_not_have(start_instance,
                                                             tmp_path: Path) -> None:
    """``-r 0-9`` in an instance of 4: exit 1 before any command runs."""
    inst = await start_instance(size=4, fanout=2)
    rc, out, err = await run_cli("exec", "-r", "0-9", "--", "touch", str(tmp_path / "ran"),
                                 uri=inst.uri(0))
    assert (rc, out, err) == (1, "", "kvbroker: exec: No route to host (no rank 4: the "
                              "instance's ranks are 0-3)\n")
    assert not (tmp_path / "ran").exists()


async def test_exec_label_io_prefixes_each_line_with_its_rank(start_instance) -> None:
    """``--label-io``: every line of stdout and stderr as ``RANK: line``, on
    the stream it was written to, in each rank's order; a last line without
    a newline gets one."""
    inst = await start_instance(size=4, fanout=2)
    script = "echo one; echo err >&2; echo two; printf tail"
    rc, out, err = await run_cli("exec", "-r", "1-3", "--label-io", "--", "sh", "-c", script,
                                 uri=inst.uri(0))
    assert rc == 0, err
    assert len(out.splitlines()) == 9 and len(err.splitlines()) == 3
    for rank in (1, 2, 3):
        assert rank_lines(out, rank) == ["one", "two", "tail"], out
        assert rank_lines(err, rank) == ["err"], err
    # one rank with -l is labelled too
    rc, out, err = await run_cli("exec", "-r", "2", "-l", "--", KVBROKER, "attr", "get", "rank",
                                 uri=inst.uri(0))
    assert (rc, out, err) == (0, "2: 2\n", "")


async def test_exec_label_io_writes_a_long_line_in_pieces_as_it_comes(start_instance) -> None:
    """Output without a newline (binary, or one huge line) was held whole
    until a newline or the end, and copied again at every read: memory
    without bound (``exec -l cat /dev/zero`` printed nothing and grew) and
    time growing as its square (a 40 MB line took 26 s, 10 MB 3.3 s).  It
    now comes out, labelled, in pieces of at most LABEL_LINE_MAX bytes
    (plus one read) while the command still runs; nothing is lost."""
    from broker.execute import LABEL_LINE_MAX

    inst = await start_instance(size=2)
    size = 3 * LABEL_LINE_MAX + 12345
    script = f"head -c {size} /dev/zero | tr '\\0' x; echo written >&2; exec sleep 300"
    env = dict(os.environ, KVBROKER_URI=inst.uri(0))
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "exec", "-r", "0-1", "-l", "--", "sh", "-c", script, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, limit=4 * LABEL_LINE_MAX)
    assert proc.stdout is not None and proc.stderr is not None
    pieces: dict[bytes, list[int]] = {b"0": [], b"1": []}
    try:
        async with asyncio.timeout(30):  # while the commands sleep: not held till the end
            while min(map(len, pieces.values())) < 2:  # (3 MiB sent: 2 pieces at least)
                line = await proc.stdout.readline()
                label, _, data = line.rstrip(b"\n").partition(b": ")
                assert data.strip(b"x") == b"" and label in pieces, line[:40]
                pieces[label].append(len(data))
            written = {await proc.stderr.readline() for _ in range(2)}
            assert written == {b"0: written\n", b"1: written\n"}, written
    finally:
        proc.send_signal(signal.SIGTERM)  # (passed on: the sleeps end, and their output)
    async with asyncio.timeout(60):
        rest, err = await proc.communicate()
    assert b"Terminated" in err, err
    for line in rest.splitlines():
        label, _, data = line.partition(b": ")
        assert data.strip(b"x") == b"", line[:40]
        pieces[label].append(len(data))
    for label, lengths in pieces.items():
        assert sum(lengths) == size, (label, lengths)
        assert max(lengths) <= LABEL_LINE_MAX + 65536, (label, lengths)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_exec_passes_a_signal_on_to_every_command(start_instance, sig: int) -> None:
    """A signal to ``exec`` reaches each rank's command (each catches it, says
    so and exits 7): exec goes on waiting and exits as they did.  (The
    command has no child: a shell's background ``sleep`` could be forked
    but not yet exec'd when the signal came, still running the shell's
    inherited trap, and outlive it holding exec's output open.)"""
    inst = await start_instance(size=4, fanout=2)
    script = ("import os, signal\n"
              "def say(word):  # (one write: the four commands share exec's stdout)\n"
              "    os.write(1, f\"{word} {os.environ['KVBROKER_RANK']}\\n\".encode())\n"
              "def caught(*_):\n"
              "    say('got')\n"
              "    os._exit(7)\n"
              f"signal.signal({int(sig)}, caught)\n"
              "say('ready')\n"
              "while True:\n"
              "    signal.pause()\n")
    env = dict(os.environ, KVBROKER_URI=inst.uri(0))
    proc = await asyncio.create_subprocess_exec(
        KVBROKER, "exec", "-r", "all", "--", sys.executable, "-c", script, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        async with asyncio.timeout(60):
            ready = set()
            while len(ready) < 4:  # every command has set its trap
                line = (await proc.stdout.readline()).decode()
                assert line.startswith("ready "), line
                ready.add(line.split()[1])
            proc.send_signal(sig)
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 7, err
    assert sorted(out.decode().splitlines()) == [f"got {r}" for r in range(4)]
    assert err.decode().splitlines() == ["kvbroker: exec: ranks 0-3: Exit 7"]


async def test_exec_timeout_stops_the_commands(start_instance) -> None:
    """``-t`` bounds the run: the commands still running when it expires get
    SIGTERM, one that ignores it SIGKILL 5 s later; exec exits 124."""
    inst = await start_instance(size=3, fanout=2)
    script = 'if [ "$KVBROKER_RANK" = 1 ]; then trap "" TERM; fi; echo $$; exec sleep 300'
    rc, out, err = await run_cli("exec", "-r", "all", "-t", "3", "--", "sh", "-c", script,
                                 uri=inst.uri(0), timeout=60)
    assert rc == 124, err
    assert err == "kvbroker: exec: Timer expired (ranks 0-2 still running after 3s: stopped)\n"
    pids = [int(pid) for pid in out.split()]
    assert len(pids) == 3
    for pid in pids:  # all gone (and reaped), the one that ignored SIGTERM too
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_exec_timeout_names_a_rank_that_does_not_answer(start_instance,
                                                              tmp_path: Path) -> None:
    """A stopped rank in the set: ``-t`` gives up on its look-up, naming it,
    exit 1, and runs nothing (not even on the ranks that answered)."""
    inst = await start_instance(size=3, fanout=2)
    pid = inst.pids()[2]
    async with stopped(pid):
        rc, out, err = await run_cli("exec", "-r", "0-2", "-t", "0.5", "--", "touch",
                                     str(tmp_path / "ran"), uri=inst.uri(0), timeout=30)
    assert (rc, out, err) == (1, "", "kvbroker: exec: Connection timed out (rank 2 did not "
                              "answer in 0.5s: stopped or hung?)\n")
    assert not (tmp_path / "ran").exists()
